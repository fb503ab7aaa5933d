#include "table_core.h"

#include <cmath>


namespace distore {

// -- TableCore --------------------------------------------------------------

TableCore::TableCore(SelectorKind sampler, double sampler_alpha, SelectorKind remover,
                     double remover_alpha, uint64_t capacity, uint32_t max_times_sampled,
                     uint64_t seed)
    : sampler_(sampler, sampler_alpha, &priority_, &seq1_),
      remover_(remover, remover_alpha, &priority_, &seq1_),
      capacity_(capacity),
      max_times_(max_times_sampled),
      rng_(seed) {
  if (capacity == 0) throw TableError("table capacity must be > 0");
}

void TableCore::add(int64_t id, uint64_t key, double priority, uint64_t seq, uint32_t times) {
  const size_t need = static_cast<size_t>(id) + 1;
  if (need > seq1_.size()) {
    key_.grow(need);
    priority_.grow(need);
    times_.grow(need);
    seq1_.grow(need);
  }
  key_[id] = key;
  priority_[id] = priority;
  times_[id] = times;
  seq1_[id] = seq + 1;
  by_key_.put(key, static_cast<uint32_t>(id), key_);
  sampler_.insert(id, priority);
  remover_.insert(id, priority);
  if (max_times_) remaining_ += max_times_ - times;
}

void TableCore::check_new(const int64_t* ids, size_t n, const char* what) const {
  for (size_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || live(ids[i])) {
      throw TableError(std::string(what) + ": id " + std::to_string(ids[i]) +
                                             " is negative or already in the table");
    }
    if (static_cast<uint64_t>(ids[i]) > KeyIndex::kMaxId) {
      throw TableError(std::string(what) + ": id " + std::to_string(ids[i]) +
                       " is above the table core's largest id " +
                       std::to_string(KeyIndex::kMaxId) + " (record ids are 32-bit)");
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
  by_key_.erase(key_[id], static_cast<uint32_t>(id), key_);
  sampler_.remove(id);
  remover_.remove(id);
  seq1_[id] = 0;
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
    if (seqs[i] == UINT64_MAX) {
      throw TableError("restore: sequence number 2^64 - 1 is out of range");
    }
    if (max_times_ && times_sampled[i] >= max_times_) {
      throw TableError(
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
    for (size_t i = start; i < start + n; ++i) __builtin_prefetch(&times_[(*ids)[i]], 1);
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
    const int64_t id = by_key_.find(keys[i], key_);
    if (id < 0) continue;
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
    ids[i] = by_key_.find(keys[i], key_);
  }
}

std::vector<std::pair<std::string, size_t>> TableCore::resident_bytes() const {
  std::vector<std::pair<std::string, size_t>> out{
      {"key", key_.resident_bytes()},
      {"priority", priority_.resident_bytes()},
      {"times_sampled", times_.resident_bytes()},
      {"sequence", seq1_.resident_bytes()},
      {"key_index", by_key_.resident_bytes()},
  };
  sampler_.resident_bytes("sampler", &out);
  remover_.resident_bytes("remover", &out);
  return out;
}

}  // namespace distore
