#include "table_core.h"

#include <cmath>

#include "status.h"

namespace distore {

SelectorKind selector_kind(const std::string& name) {
  if (name == "uniform") return SelectorKind::kUniform;
  if (name == "prioritized") return SelectorKind::kPrioritized;
  if (name == "fifo") return SelectorKind::kFifo;
  if (name == "lifo") return SelectorKind::kLifo;
  if (name == "min_heap") return SelectorKind::kMinHeap;
  if (name == "max_heap") return SelectorKind::kMaxHeap;
  throw UcxError(kStatusBadArgument,
                 "unknown selector '" + name +
                     "' (uniform, prioritized, fifo, lifo, min_heap, max_heap)");
}

// -- Selector ---------------------------------------------------------------

Selector::Selector(SelectorKind kind, double alpha)
    : kind_(kind),
      alpha_(alpha),
      heap_(kind == SelectorKind::kLifo || kind == SelectorKind::kMaxHeap) {}

double Selector::weight(double priority) const {
  if (alpha_ == 1.0) return priority;
  if (alpha_ == 0.0) return 1.0;
  return std::pow(priority, alpha_);
}

void Selector::grow(int64_t id) {
  if (static_cast<size_t>(id) >= pos_.size()) pos_.resize(static_cast<size_t>(id) * 2 + 1, -1);
}

void Selector::insert(int64_t id, double priority, uint64_t seq) {
  ++size_;
  switch (kind_) {
    case SelectorKind::kUniform:
    case SelectorKind::kPrioritized:
      grow(id);
      pos_[id] = static_cast<int64_t>(items_.size());
      items_.push_back(id);
      if (kind_ == SelectorKind::kPrioritized) {
        if (static_cast<size_t>(id) >= tree_.capacity()) tree_.resize(static_cast<size_t>(id) + 1);
        tree_.set(static_cast<size_t>(id), weight(priority));
      }
      break;
    case SelectorKind::kFifo:
    case SelectorKind::kLifo:
      // Keyed by sequence: oldest on top of the min-heap (FIFO), newest on
      // top of the max-heap (LIFO). Exact while seq < 2^53.
      heap_.push(id, static_cast<double>(seq), seq);
      break;
    case SelectorKind::kMinHeap:
    case SelectorKind::kMaxHeap:
      heap_.push(id, priority, seq);
      break;
  }
}

void Selector::remove(int64_t id) {
  --size_;
  switch (kind_) {
    case SelectorKind::kUniform:
    case SelectorKind::kPrioritized: {
      int64_t p = pos_[id];
      int64_t last = items_.back();
      items_[p] = last;
      pos_[last] = p;
      items_.pop_back();
      pos_[id] = -1;
      if (kind_ == SelectorKind::kPrioritized) tree_.set(static_cast<size_t>(id), 0.0);
      break;
    }
    default:
      heap_.remove(id);
  }
}

void Selector::update(int64_t id, double priority) {
  if (kind_ == SelectorKind::kPrioritized) {
    tree_.set(static_cast<size_t>(id), weight(priority));
  } else if (kind_ == SelectorKind::kMinHeap || kind_ == SelectorKind::kMaxHeap) {
    heap_.update(id, priority);
  }
}

int64_t Selector::select(std::mt19937_64& rng, double* probability) {
  switch (kind_) {
    case SelectorKind::kPrioritized: {
      const double total = tree_.total();
      if (total > 0.0) {
        std::uniform_real_distribution<double> u(0.0, total);
        const int64_t id = static_cast<int64_t>(tree_.find(u(rng)));
        *probability = tree_.get(static_cast<size_t>(id)) / total;
        return id;
      }
      [[fallthrough]];  // every weight is 0: uniform, as Reverb does
    }
    case SelectorKind::kUniform: {
      std::uniform_int_distribution<size_t> u(0, items_.size() - 1);
      *probability = 1.0 / static_cast<double>(items_.size());
      return items_[u(rng)];
    }
    default:
      *probability = 1.0;
      return heap_.top();
  }
}

void Selector::select_many(std::mt19937_64& rng, size_t n, int64_t* ids, double* probabilities) {
  const double total = tree_.total();
  if (kind_ != SelectorKind::kPrioritized || total <= 0.0) {
    for (size_t i = 0; i < n; ++i) ids[i] = select(rng, &probabilities[i]);
    return;
  }
  std::uniform_real_distribution<double> u(0.0, total);
  std::vector<double> prefixes(n);
  for (auto& p : prefixes) p = u(rng);
  tree_.find_many(prefixes.data(), n, ids);
  for (size_t i = 0; i < n; ++i) probabilities[i] = tree_.get(static_cast<size_t>(ids[i])) / total;
}

double Selector::probability(int64_t id) const {
  switch (kind_) {
    case SelectorKind::kPrioritized: {
      const double total = tree_.total();
      if (total > 0.0) return tree_.get(static_cast<size_t>(id)) / total;
      [[fallthrough]];
    }
    case SelectorKind::kUniform:
      return items_.empty() ? 0.0 : 1.0 / static_cast<double>(items_.size());
    default:
      return (!heap_.empty() && heap_.top() == id) ? 1.0 : 0.0;
  }
}

// -- TableCore --------------------------------------------------------------

TableCore::TableCore(SelectorKind sampler, double sampler_alpha, SelectorKind remover,
                     double remover_alpha, uint64_t capacity, uint32_t max_times_sampled,
                     uint64_t seed)
    : sampler_(sampler, sampler_alpha),
      remover_(remover, remover_alpha),
      capacity_(capacity),
      max_times_(max_times_sampled),
      rng_(seed) {
  if (capacity == 0) throw UcxError(kStatusBadArgument, "table capacity must be > 0");
}

void TableCore::add(int64_t id, uint64_t key, double priority, uint64_t seq, uint32_t times) {
  const size_t need = static_cast<size_t>(id) + 1;
  if (need > live_.size()) {
    const size_t n = need * 2;
    key_.resize(n);
    priority_.resize(n);
    times_.resize(n);
    seq_id_.resize(n);
    live_.resize(n, 0);
  }
  key_[id] = key;
  priority_[id] = priority;
  times_[id] = times;
  seq_id_[id] = seq;
  live_[id] = 1;
  by_key_[key] = id;
  sampler_.insert(id, priority, seq);
  remover_.insert(id, priority, seq);
  if (max_times_) remaining_ += max_times_ - times;
}

void TableCore::check_new(const int64_t* ids, size_t n, const char* what) const {
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || live(ids[i])) {
      throw UcxError(kStatusBadArgument, std::string(what) + ": id " + std::to_string(ids[i]) +
                                             " is negative or already in the table");
    }
  }
}

void TableCore::make_room(std::vector<int64_t>* evicted) {
  while (size() >= capacity_) {
    double unused;
    const int64_t victim = remover_.select(rng_, &unused);
    drop(victim);
    evicted->push_back(victim);
  }
}

void TableCore::drop(int64_t id) {
  live_[id] = 0;
  auto it = by_key_.find(key_[id]);
  if (it != by_key_.end() && it->second == id) by_key_.erase(it);
  sampler_.remove(id);
  remover_.remove(id);
  if (max_times_) remaining_ -= max_times_ - times_[id];
}

void TableCore::insert(const int64_t* ids, const uint64_t* keys, const double* priorities,
                       size_t n, std::vector<int64_t>* evicted) {
  check_new(ids, n, "insert");
  for (size_t i = 0; i < n; ++i) {
    make_room(evicted);
    add(ids[i], keys[i], priorities[i], seq_++, 0);
  }
}

void TableCore::restore(const int64_t* ids, const uint64_t* keys, const double* priorities,
                        const uint32_t* times_sampled, const uint64_t* seqs, size_t n,
                        std::vector<int64_t>* evicted) {
  check_new(ids, n, "restore");
  for (size_t i = 0; i < n; ++i) {
    if (max_times_ && times_sampled[i] >= max_times_) {
      throw UcxError(kStatusBadArgument,
                     "restore: an item sampled " + std::to_string(times_sampled[i]) +
                         " times cannot be in a table with max_times_sampled " +
                         std::to_string(max_times_));
    }
  }
  for (size_t i = 0; i < n; ++i) {
    make_room(evicted);
    add(ids[i], keys[i], priorities[i], seqs[i], times_sampled[i]);
    raise_next_seq(seqs[i] + 1);
  }
}

void TableCore::sample(size_t n, std::vector<int64_t>* ids, std::vector<double>* probabilities,
                       std::vector<int64_t>* exhausted) {
  if (max_times_ == 0 && size() > 0) {
    // Draws are independent when sampling removes nothing: do them together.
    const size_t start = ids->size();
    ids->resize(start + n);
    probabilities->resize(start + n);
    sampler_.select_many(rng_, n, ids->data() + start, probabilities->data() + start);
    for (size_t i = start; i < start + n; ++i) ++times_[(*ids)[i]];
    return;
  }
  for (size_t i = 0; i < n && size() > 0; ++i) {
    double p;
    const int64_t id = sampler_.select(rng_, &p);
    ids->push_back(id);
    probabilities->push_back(p);
    ++times_[id];
    if (max_times_) {
      --remaining_;
      if (times_[id] >= max_times_) {
        drop(id);
        exhausted->push_back(id);
      }
    }
  }
}

size_t TableCore::update_priorities(const uint64_t* keys, const double* priorities, size_t n) {
  size_t updated = 0;
  for (size_t i = 0; i < n; ++i) {
    auto it = by_key_.find(keys[i]);
    if (it == by_key_.end()) continue;
    const int64_t id = it->second;
    priority_[id] = priorities[i];
    sampler_.update(id, priorities[i]);
    remover_.update(id, priorities[i]);
    ++updated;
  }
  return updated;
}

size_t TableCore::remove(const int64_t* ids, size_t n) {
  size_t removed = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!live(ids[i])) continue;
    drop(ids[i]);
    ++removed;
  }
  return removed;
}

void TableCore::lookup(const uint64_t* keys, size_t n, int64_t* ids) const {
  for (size_t i = 0; i < n; ++i) {
    auto it = by_key_.find(keys[i]);
    ids[i] = it == by_key_.end() ? -1 : it->second;
  }
}

}  // namespace distore
