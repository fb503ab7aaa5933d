// The control plane's slice index (DESIGN.md, "Trajectories"): steps of
// episodes are items; a learner samples slices of T consecutive steps of one
// episode, the start drawn at sample time. This keeps, for every step, its
// episode and position, and the set of valid starts: a present step at a
// position p with p % P == 0 whose T - 1 successors p+1..p+T-1 of the same
// episode are all present (strict slices: never across an episode's end or a
// missing step). Starts follow every add and remove; nothing is rescanned.
//
// Steps are known by record id (assigned by the caller, below 2^32 - 1,
// reused only after the caller removed it). They may arrive and leave in
// any order; a second step at an (episode, position) that is present is
// refused. Draws are independent (with replacement), uniform over the valid
// starts or proportional to priority^alpha of the start step, by a Selector
// of kind kUniform / kPrioritized over the valid start ids (its sum tree is
// the only one). With no valid start, sample() draws nothing: the caller
// waits for data (an empty result is not an error).
//
// Short slices (pad != kNone): a start may also be a present step whose run
// of present successors ends, before T steps, at a step marked as its
// episode's last (add's `last`). kEnd: any such step (a slice may start
// anywhere and be cut by its episode's end); kShortEpisodes: only an
// episode's first present step (position 0, or the first one left after
// its oldest steps were removed), so that only episodes, or what is left
// of them, shorter than T give short slices, whole (TorchRL's
// strict_length=False, whose trajectories are what its storage holds).
// expand() pads a short slice by repeating its last step and says each
// slice's length.
//
// Structures:
//  - by id (Columns): the step's episode slot + 1 (0: not a step), its
//    position, its priority (prioritized only; uniform never writes that
//    column), a bit that says it is a valid start and one that it ends its
//    episode;
//  - by episode slot: a window of the ids of its present steps, a ring of
//    2^k slots (id + 1, 0: absent) indexed by position mod 2^k that covers
//    the span from its first to its last present step. 2^k lies between the
//    span and 4x the span: a step that widens the span past the ring regrows
//    it, and it shrinks when the span falls to a quarter. Storage follows the
//    span, never the absolute positions. Windows of 1 or 2 slots live in the
//    episode's record, larger ones in their own allocation. An episode
//    without present steps is forgotten: its window is freed and its slot
//    (record, id) reused by the next new episode;
//  - an index from episode id to slot (KeyIndex over the episode id column);
//  - the selector over the valid start ids.
//
// Memory: a step 4 (episode) + 4 (position) + 8 (priority, prioritized
// only) + 2 bits + its window slot (4 to 16 bytes; 4 to 8 while a window
// only grows); a valid start the selector's (uniform 8, prioritized about
// 10 + 1 bit); an episode about 40 (record 24, id 8, index 5 to 11) + the
// window's allocation header. Measured at 10^6 steps
// (tests/unit/test_slice_index.py): 22 bytes a step uniform, 33 prioritized
// in episodes of 100 steps; 59 and 70 with episodes of one step each.
// Like the table core's columns, the by-id and by-slot columns keep their
// high-water size (pages written once stay); windows are freed.
//
// Cost: add and remove of a step O(T) lookups in its window (the runs of
// present steps around it, at most T - 1 each way) plus one selector update,
// O(1) uniform or O(log n) prioritized, per start it makes valid or invalid
// (in-order arrival: one); removing an episode's first or last present step
// also walks its window over the absent steps behind it (FIFO eviction walks
// each position once), and a regrown or shrunk window copies its span.
// sample O(1) a draw uniform, O(log n) prioritized; expand O(T) a slice;
// set_priorities O(log n) a valid start, O(1) otherwise. A batch that is
// refused leaves the index as it was.
//
// Ownership: owns its storage (columns, windows, selector). Thread safety:
// none; the control plane calls it from one thread. Not copyable (the
// selector points at its priority column).
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "column.h"
#include "key_index.h"
#include "selector.h"

namespace distore {

// Which short slices are valid starts (see above).
enum class SlicePad : int { kNone = 0, kEnd = 1, kShortEpisodes = 2 };

class SliceIndex {
 public:
  // Largest record id (window slots and the selector hold 32-bit ids).
  static constexpr uint64_t kMaxId = KeyIndex::kMaxId;
  // Largest span of an episode's present positions (a 4 GiB window), and of
  // slice_len and period.
  static constexpr uint64_t kMaxSpan = uint64_t{1} << 30;

  // Refuses (TableError) slice_len or period outside 1..kMaxSpan, an
  // alpha that is not finite and >= 0 and a pad that is not a SlicePad.
  SliceIndex(int64_t slice_len, int64_t period, bool prioritized, double alpha, uint64_t seed,
             int pad = 0);
  ~SliceIndex();
  SliceIndex(const SliceIndex&) = delete;
  SliceIndex& operator=(const SliceIndex&) = delete;

  // Adds steps. Refuses the whole batch (TableError, nothing added) for an
  // id out of range or present already (also twice in the batch), a
  // priority that is not finite and >= 0, a step whose (episode, position)
  // is present, or an episode whose span would pass kMaxSpan. `last`
  // (nullable: none) marks the steps that end their episode.
  void add(const int64_t* ids, const uint64_t* episodes, const uint32_t* positions,
           const double* priorities, size_t n, const uint8_t* last = nullptr);
  // Removes steps by id (unknown ids skipped); returns how many were removed.
  size_t remove(const int64_t* ids, size_t n);
  // Sets steps' priorities (unknown ids skipped; a valid start's draw weight
  // follows); returns how many ids were steps. Refuses the whole batch for a
  // priority that is not finite and >= 0.
  size_t set_priorities(const int64_t* ids, const double* priorities, size_t n);
  // Draws n starts independently; returns n, or 0 (nothing written) when no
  // start is valid.
  size_t sample(size_t n, int64_t* starts, double* probabilities);
  // The slice_len() ids of each start's slice, in position order, into
  // out[i * slice_len() ...]; a short slice (pad) repeats its last step to
  // slice_len(), and `lengths` (nullable) gets each slice's real steps.
  // Refuses (TableError, nothing written) an id that is not a valid start now.
  void expand(const int64_t* starts, size_t n, int64_t* out, uint32_t* lengths = nullptr) const;
  // Each step's position / episode; refuses an id that is not a step.
  void positions(const int64_t* ids, size_t n, uint32_t* out) const;
  void episodes(const int64_t* ids, size_t n, uint64_t* out) const;
  // The probability that a draw returns each id now (0 for an id that is not
  // a valid start, whatever it is).
  void probabilities(const int64_t* ids, size_t n, double* out) const;

  uint64_t slice_len() const { return T_; }
  uint64_t period() const { return P_; }
  SlicePad pad() const { return pad_; }
  bool prioritized() const { return prioritized_; }
  size_t valid_starts() const { return sampler_.size(); }
  size_t steps() const { return steps_; }
  size_t episode_count() const { return episodes_; }
  // The smallest probability a draw can have now (0 with no valid start).
  double min_probability() const { return sampler_.min_probability(); }
  bool is_step(int64_t id) const {
    return id >= 0 && static_cast<uint64_t>(id) < ep_.size() && ep_[id] != 0;
  }
  bool is_start(int64_t id) const {
    return is_step(id) && ((start_[static_cast<uint64_t>(id) >> 6] >> (id & 63)) & 1);
  }
  // Whether the step `id` ends its episode (add's `last`).
  bool is_last(int64_t id) const {
    return is_step(id) && ((last_[static_cast<uint64_t>(id) >> 6] >> (id & 63)) & 1);
  }
  // Bytes in memory now, by structure (pages written at least once; the
  // windows: what malloc gave them).
  std::vector<std::pair<std::string, size_t>> resident_bytes() const;

 private:
  // A window of up to this many slots lives in the Episode itself (short
  // episodes cost no allocation).
  static constexpr uint64_t kInlineSlots = 2;
  // The present steps of one episode: ring slot (position & mask) holds
  // id + 1 (0: absent) for every position in [lo, hi]; hi - lo < mask + 1.
  struct Episode {
    union {
      uint32_t* heap;  // mask + 1 > kInlineSlots
      uint32_t inline_slots[kInlineSlots];
    } window;
    uint32_t mask;
    uint32_t count;  // present steps
    uint32_t lo, hi;  // first and last present position (count > 0)
  };

  static uint32_t* slots(Episode& e) {
    return e.mask < kInlineSlots ? e.window.inline_slots : e.window.heap;
  }
  static const uint32_t* slots(const Episode& e) {
    return e.mask < kInlineSlots ? e.window.inline_slots : e.window.heap;
  }
  // id + 1 of the step at position q of `e`, 0 when absent (q may be out of
  // the uint32 range: -1 or 2^32 are absent).
  static uint32_t at(const Episode& e, int64_t q) {
    if (q < static_cast<int64_t>(e.lo) || q > static_cast<int64_t>(e.hi)) return 0;
    return slots(e)[static_cast<uint64_t>(q) & e.mask];
  }
  void add_one(int64_t id, uint64_t episode, uint32_t position, double priority, bool last);
  // Short slices: (un)mark the starts of [from, to] (positions of `e`,
  // multiples of P) whose runs now end at `end` (a present step, or -1 for
  // none) without T steps; starts with T steps are marked by the caller.
  void mark_short(const Episode& e, int64_t from, int64_t to, int64_t end);
  // kShortEpisodes: (un)mark present step p of `e` as a short start after
  // the episode's first present step changed (p: the new first, or the old).
  void recheck_first(const Episode& e, int64_t p);
  void mark(int64_t id, bool valid);
  void remove_one(int64_t id);
  uint32_t new_episode(uint64_t episode, uint32_t position);
  void forget_episode(uint32_t slot);
  void resize(Episode& e, uint64_t capacity);
  void free_window(Episode& e);
  void set_start(int64_t id);
  void clear_start(int64_t id);
  std::string describe(int64_t id) const;

  uint64_t T_;
  uint64_t P_;
  SlicePad pad_;
  bool prioritized_;
  // By record id.
  Column<uint32_t> ep_;    // episode slot + 1; 0: not a step
  Column<uint32_t> pos_;
  Column<double> prio_;    // prioritized only
  Column<uint64_t> start_;  // a bit an id: a valid start
  Column<uint64_t> last_;   // a bit an id: ends its episode
  // By episode slot.
  Column<Episode> eps_;
  Column<uint64_t> episode_id_;
  std::vector<uint32_t> free_slots_;
  uint32_t slots_used_ = 0;
  KeyIndex by_episode_;
  size_t window_bytes_ = 0;
  size_t steps_ = 0;
  size_t episodes_ = 0;
  Column<uint64_t> no_sequence_;  // the selector's kinds here never read it
  Selector sampler_;
  std::mt19937_64 rng_;
};

}  // namespace distore
