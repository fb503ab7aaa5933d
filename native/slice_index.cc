#include "slice_index.h"

#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <new>

#include "table_error.h"

namespace distore {

namespace {


uint64_t pow2_at_least(uint64_t n) {
  uint64_t p = 1;
  while (p < n) p <<= 1;
  return p;
}

// The first multiple of `period` at or after x (x >= 0).
int64_t first_multiple(int64_t x, uint64_t period) {
  const int64_t p = static_cast<int64_t>(period);
  return (x + p - 1) / p * p;
}

bool good_priority(double p) { return p >= 0.0 && !std::isinf(p); }  // false for NaN

// What a window's allocation costs: malloc's usable size and its header.
size_t window_size(uint32_t* slots) { return malloc_usable_size(slots) + sizeof(size_t); }

}  // namespace

SliceIndex::SliceIndex(int64_t slice_len, int64_t period, bool prioritized, double alpha,
                       uint64_t seed, int pad)
    : T_(static_cast<uint64_t>(slice_len)),
      P_(static_cast<uint64_t>(period)),
      pad_(static_cast<SlicePad>(pad)),
      prioritized_(prioritized),
      sampler_(prioritized ? SelectorKind::kPrioritized : SelectorKind::kUniform, alpha, &prio_,
               &no_sequence_),
      rng_(seed) {
  if (slice_len < 1 || static_cast<uint64_t>(slice_len) > kMaxSpan) {
    throw TableError("SliceIndex: slice_len " + std::to_string(slice_len) +
                     " is not in 1..2^30 (steps in a slice)");
  }
  if (period < 1 || static_cast<uint64_t>(period) > kMaxSpan) {
    throw TableError("SliceIndex: period " + std::to_string(period) +
                     " is not in 1..2^30 (1: a slice may start at every step)");
  }
  if (!good_priority(alpha)) {
    throw TableError("SliceIndex: alpha " + std::to_string(alpha) +
                     " is not finite and >= 0 (draws go by priority^alpha)");
  }
  if (pad < 0 || pad > static_cast<int>(SlicePad::kShortEpisodes)) {
    throw TableError("SliceIndex: pad " + std::to_string(pad) +
                     " is not 0 (strict slices), 1 (short slices at an episode's end) or 2 "
                     "(short episodes, whole)");
  }
}

SliceIndex::~SliceIndex() {
  for (uint32_t s = 0; s < slots_used_; ++s) free_window(eps_[s]);
}

std::string SliceIndex::describe(int64_t id) const {
  return "(episode " + std::to_string(episode_id_[ep_[id] - 1]) + ", position " +
         std::to_string(pos_[id]) + ")";
}

// -- episodes and their windows ---------------------------------------------

uint32_t SliceIndex::new_episode(uint64_t episode, uint32_t position) {
  uint32_t s;
  if (!free_slots_.empty()) {
    s = free_slots_.back();
    free_slots_.pop_back();
  } else {
    s = slots_used_++;
    eps_.grow(s + 1);
    episode_id_.grow(s + 1);
  }
  Episode& e = eps_[s];
  e = Episode{};
  e.mask = kInlineSlots - 1;
  e.lo = e.hi = position;
  episode_id_[s] = episode;
  by_episode_.put(episode, s, episode_id_);
  ++episodes_;
  return s;
}

void SliceIndex::free_window(Episode& e) {
  if (e.mask < kInlineSlots) return;
  window_bytes_ -= window_size(e.window.heap);
  std::free(e.window.heap);
  e.mask = 0;
}

void SliceIndex::forget_episode(uint32_t s) {
  free_window(eps_[s]);
  eps_[s] = Episode{};
  by_episode_.erase(episode_id_[s], s, episode_id_);
  free_slots_.push_back(s);
  --episodes_;
}

void SliceIndex::resize(Episode& e, uint64_t capacity) {
  // The inline slots share their bytes with the heap pointer: copy into a
  // separate buffer first.
  uint32_t small[kInlineSlots] = {};
  uint32_t* fresh = small;
  if (capacity > kInlineSlots) {
    fresh = static_cast<uint32_t*>(std::calloc(capacity, sizeof(uint32_t)));
    if (fresh == nullptr) throw std::bad_alloc();
  }
  const uint64_t mask = capacity - 1;
  if (e.count != 0) {
    const uint32_t* old = slots(e);
    for (uint64_t q = e.lo; q <= e.hi; ++q) {
      const uint32_t v = old[q & e.mask];
      if (v != 0) fresh[q & mask] = v;
    }
  }
  free_window(e);
  if (capacity > kInlineSlots) {
    e.window.heap = fresh;
    window_bytes_ += window_size(fresh);
  } else {
    for (uint64_t i = 0; i < kInlineSlots; ++i) e.window.inline_slots[i] = small[i];
  }
  e.mask = static_cast<uint32_t>(mask);
}

// -- starts -----------------------------------------------------------------

void SliceIndex::set_start(int64_t id) {
  start_[static_cast<uint64_t>(id) >> 6] |= uint64_t{1} << (id & 63);
  sampler_.insert(id, prioritized_ ? prio_[id] : 0.0);
}

void SliceIndex::clear_start(int64_t id) {
  start_[static_cast<uint64_t>(id) >> 6] &= ~(uint64_t{1} << (id & 63));
  sampler_.remove(id);
}

void SliceIndex::mark(int64_t id, bool valid) {
  if (valid == is_start(id)) return;
  if (valid) {
    set_start(id);
  } else {
    clear_start(id);
  }
}

void SliceIndex::mark_short(const Episode& e, int64_t from, int64_t to, int64_t end) {
  const bool ends = end >= 0 && is_last(at(e, end) - 1);
  for (int64_t p = first_multiple(from, P_); p <= to; p += static_cast<int64_t>(P_)) {
    const bool valid = ends && (pad_ == SlicePad::kEnd || p == static_cast<int64_t>(e.lo));
    mark(at(e, p) - 1, valid);
  }
}

void SliceIndex::recheck_first(const Episode& e, int64_t p) {
  if (pad_ != SlicePad::kShortEpisodes || at(e, p) == 0) return;
  const int64_t T = static_cast<int64_t>(T_);
  int64_t b = p;
  while (b < p + (T - 1) && at(e, b + 1) != 0) ++b;
  if (b - p + 1 < T) mark_short(e, p, p, b);  // a full start is not a short one's business
}

// -- steps ------------------------------------------------------------------

void SliceIndex::add_one(int64_t id, uint64_t episode, uint32_t position, double priority,
                         bool last) {
  if (is_step(id)) {
    throw TableError("SliceIndex.add: record id " + std::to_string(id) +
                     " appears twice in the batch; an id is added once and reused only "
                     "after it was removed");
  }
  const int64_t found = by_episode_.find(episode, episode_id_);
  uint32_t s = 0;
  if (found >= 0) {
    s = static_cast<uint32_t>(found);
    const Episode& e = eps_[s];
    const uint32_t there = at(e, position);
    if (there != 0) {
      throw TableError("SliceIndex.add: step (episode " + std::to_string(episode) +
                       ", position " + std::to_string(position) +
                       ") is present already as record id " + std::to_string(there - 1) +
                       "; remove that step before adding it again");
    }
    const uint64_t lo = std::min(e.lo, position), hi = std::max(e.hi, position);
    if (hi - lo + 1 > kMaxSpan) {
      throw TableError("SliceIndex.add: episode " + std::to_string(episode) +
                       " would hold steps from position " + std::to_string(lo) + " to " +
                       std::to_string(hi) +
                       ", more than 2^30 apart; positions count steps from the episode's "
                       "start (0-based), and its old steps must leave first");
    }
  }
  // Nothing below refuses the step: a refused step has changed nothing.
  const size_t need = static_cast<size_t>(id) + 1;
  if (need > ep_.size()) {
    ep_.grow(need);
    pos_.grow(need);
    start_.grow((ep_.size() + 63) / 64);  // every id below ep_.size() has its bits
    last_.grow((ep_.size() + 63) / 64);
  }
  if (prioritized_) prio_.grow(need);
  if (found < 0) s = new_episode(episode, position);
  Episode& e = eps_[s];
  const uint64_t lo = std::min(e.lo, position), hi = std::max(e.hi, position);
  if (hi - lo + 1 > uint64_t{e.mask} + 1) resize(e, pow2_at_least(hi - lo + 1));
  const int64_t was_first = found >= 0 && position < e.lo ? int64_t{e.lo} : -1;
  e.lo = static_cast<uint32_t>(lo);
  e.hi = static_cast<uint32_t>(hi);
  slots(e)[position & e.mask] = static_cast<uint32_t>(id) + 1;
  ++e.count;

  if (prioritized_) prio_[id] = priority;
  ep_[id] = s + 1;
  pos_[id] = position;
  const uint64_t bit = uint64_t{1} << (id & 63);
  if (last) {
    last_[static_cast<uint64_t>(id) >> 6] |= bit;
  } else {
    last_[static_cast<uint64_t>(id) >> 6] &= ~bit;
  }
  ++steps_;

  // The run of present steps around q, at most T - 1 each way: the starts it
  // completes lie in [q - T + 1, q] and need T steps of the run.
  const int64_t q = position, T = static_cast<int64_t>(T_);
  int64_t a = q, b = q;
  while (a > q - (T - 1) && at(e, a - 1) != 0) --a;
  while (b < q + (T - 1) && at(e, b + 1) != 0) ++b;
  const int64_t full = std::min(q, b - T + 1);
  const int64_t from = std::max(a, q - T + 1);
  for (int64_t p = first_multiple(from, P_); p <= full; p += static_cast<int64_t>(P_)) {
    mark(at(e, p) - 1, true);
  }
  // Short slices: the starts after those run out at b before T steps (b is
  // where the run really ends: it stopped before q + T - 1).
  if (pad_ != SlicePad::kNone) mark_short(e, std::max(from, full + 1), q, b);
  // kShortEpisodes: the step that was the episode's first is not now.
  if (was_first >= 0) recheck_first(e, was_first);
}

void SliceIndex::remove_one(int64_t id) {
  const uint32_t s = ep_[id] - 1;
  Episode& e = eps_[s];
  const int64_t q = pos_[id], T = static_cast<int64_t>(T_);
  // Starts whose slice holds q lie in the run that ends at q, within T - 1.
  int64_t a = q;
  while (a > q - (T - 1) && at(e, a - 1) != 0) --a;
  for (int64_t p = first_multiple(a, P_); p <= q; p += static_cast<int64_t>(P_)) {
    const int64_t start = at(e, p) - 1;
    if (is_start(start)) clear_start(start);
  }
  uint32_t* window = slots(e);
  window[static_cast<uint64_t>(q) & e.mask] = 0;
  // Short slices: the runs of the starts before q now end at q - 1.
  if (pad_ != SlicePad::kNone && a < q) mark_short(e, a, q - 1, q - 1);
  ep_[id] = 0;
  --steps_;
  if (--e.count == 0) {
    forget_episode(s);
    return;
  }
  // Keep lo and hi on present steps (there is one: count > 0).
  if (q == e.lo) {
    while (window[e.lo & e.mask] == 0) ++e.lo;
    recheck_first(e, e.lo);  // kShortEpisodes: what is left of the episode starts here now
  } else if (q == e.hi) {
    while (window[e.hi & e.mask] == 0) --e.hi;
  }
  const uint64_t span = uint64_t{e.hi} - e.lo + 1, capacity = uint64_t{e.mask} + 1;
  if (capacity > kInlineSlots && 4 * span <= capacity) {
    resize(e, std::max(kInlineSlots, 2 * pow2_at_least(span)));
  }
}

void SliceIndex::add(const int64_t* ids, const uint64_t* episodes, const uint32_t* positions,
                     const double* priorities, size_t n, const uint8_t* last) {
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || static_cast<uint64_t>(ids[i]) > kMaxId) {
      throw TableError("SliceIndex.add: record id " + std::to_string(ids[i]) +
                       " is outside 0.." + std::to_string(kMaxId) + " (record ids are 32-bit)");
    }
    if (is_step(ids[i])) {
      throw TableError("SliceIndex.add: record id " + std::to_string(ids[i]) +
                       " is a step already " + describe(ids[i]) +
                       "; an id is reused only after it was removed");
    }
    if (!good_priority(priorities[i])) {
      throw TableError("SliceIndex.add: the priority of record id " + std::to_string(ids[i]) +
                       " is " + std::to_string(priorities[i]) +
                       "; priorities are finite and >= 0");
    }
  }
  // What the first pass cannot see (an id or a step twice in the batch, a
  // step present already) is found on the way: the steps added before it
  // leave again, so a refused batch changes nothing.
  size_t i = 0;
  try {
    for (; i < n; ++i) {
      add_one(ids[i], episodes[i], positions[i], priorities[i], last != nullptr && last[i] != 0);
    }
  } catch (...) {
    while (i-- > 0) remove_one(ids[i]);
    throw;
  }
}

size_t SliceIndex::remove(const int64_t* ids, size_t n) {
  size_t removed = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!is_step(ids[i])) continue;
    remove_one(ids[i]);
    ++removed;
  }
  return removed;
}

size_t SliceIndex::set_priorities(const int64_t* ids, const double* priorities, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (!good_priority(priorities[i])) {
      throw TableError("SliceIndex.set_priorities: the priority of record id " +
                       std::to_string(ids[i]) + " is " + std::to_string(priorities[i]) +
                       "; priorities are finite and >= 0");
    }
  }
  size_t set = 0;
  for (size_t i = 0; i < n; ++i) {
    const int64_t id = ids[i];
    if (!is_step(id)) continue;
    ++set;
    if (!prioritized_) continue;  // uniform draws ignore priorities
    prio_[id] = priorities[i];
    if (is_start(id)) sampler_.update(id, priorities[i]);
  }
  return set;
}

// -- reads ------------------------------------------------------------------

size_t SliceIndex::sample(size_t n, int64_t* starts, double* probabilities) {
  if (sampler_.size() == 0 || n == 0) return 0;
  sampler_.select_many(rng_, n, starts, probabilities);
  return n;
}

void SliceIndex::expand(const int64_t* starts, size_t n, int64_t* out,
                        uint32_t* lengths) const {
  for (size_t i = 0; i < n; ++i) {
    if (!is_start(starts[i])) {
      throw TableError("SliceIndex.expand: record id " + std::to_string(starts[i]) +
                       (is_step(starts[i]) ? " " + describe(starts[i]) +
                                                 " is not a valid start now (a step of its "
                                                 "slice is missing, or its position is off "
                                                 "the period)"
                                           : " is not a step") +
                       "; expand starts as sample() returns them, before steps leave");
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const Episode& e = eps_[ep_[starts[i]] - 1];
    const int64_t q = pos_[starts[i]];
    int64_t* slice = out + i * T_;
    uint64_t k = 0;
    for (; k < T_; ++k) {
      const uint32_t v = at(e, q + static_cast<int64_t>(k));
      if (v == 0) break;  // a short slice (pad): its episode ended before T steps
      slice[k] = v - 1;
    }
    if (lengths != nullptr) lengths[i] = static_cast<uint32_t>(k);
    for (uint64_t j = k; j < T_; ++j) slice[j] = slice[k - 1];
  }
}

void SliceIndex::positions(const int64_t* ids, size_t n, uint32_t* out) const {
  for (size_t i = 0; i < n; ++i) {
    if (!is_step(ids[i])) {
      throw TableError("SliceIndex.position: record id " + std::to_string(ids[i]) +
                       " is not a step of this index (never added, or removed)");
    }
    out[i] = pos_[ids[i]];
  }
}

void SliceIndex::episodes(const int64_t* ids, size_t n, uint64_t* out) const {
  for (size_t i = 0; i < n; ++i) {
    if (!is_step(ids[i])) {
      throw TableError("SliceIndex.episode: record id " + std::to_string(ids[i]) +
                       " is not a step of this index (never added, or removed)");
    }
    out[i] = episode_id_[ep_[ids[i]] - 1];
  }
}

void SliceIndex::probabilities(const int64_t* ids, size_t n, double* out) const {
  for (size_t i = 0; i < n; ++i) out[i] = is_start(ids[i]) ? sampler_.probability(ids[i]) : 0.0;
}

std::vector<std::pair<std::string, size_t>> SliceIndex::resident_bytes() const {
  std::vector<std::pair<std::string, size_t>> out{
      {"episode_of", ep_.resident_bytes()},
      {"position", pos_.resident_bytes()},
      {"priority", prio_.resident_bytes()},
      {"starts", start_.resident_bytes() + last_.resident_bytes()},
      {"episodes", eps_.resident_bytes() + episode_id_.resident_bytes() +
                       free_slots_.capacity() * sizeof(uint32_t)},
      {"episode_index", by_episode_.resident_bytes()},
      {"windows", window_bytes_},
  };
  sampler_.resident_bytes("sampler", &out);
  return out;
}

}  // namespace distore
