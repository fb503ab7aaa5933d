// The selection core of a replay table: which item a sample returns and
// which item leaves at capacity, following Reverb's selectors.
//
// TableCore knows items by id (assigned by the caller, reused only after
// the caller has seen them leave), their key, priority, insertion sequence
// and times sampled. Every operation takes a whole batch. The caller keeps
// everything else (node, slot, generation, leases).
//
// Memory (issue #16): dense columns addressed by id (key 8 B, priority 8,
// times sampled 4, sequence 8), a key index of 4-byte slots that compares
// against the key column, and the two selectors' own structures (see
// selector.h); every structure sits in a Column, so capacity reserved but
// never written costs nothing. Ids are below 2^32 - 1.
//
// Ownership: owns its storage. Thread safety: none; the control plane
// calls it from one thread. Not copyable (the selectors point at its columns).
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
#include "table_error.h"

namespace distore {

class TableCore {
 public:
  TableCore(SelectorKind sampler, double sampler_alpha, SelectorKind remover,
            double remover_alpha, uint64_t capacity, uint32_t max_times_sampled, uint64_t seed);
  TableCore(const TableCore&) = delete;
  TableCore& operator=(const TableCore&) = delete;

  // Inserts items; an item arriving at capacity first evicts the remover's
  // choice (as Reverb does). Appends the evicted ids to `evicted`.
  void insert(const int64_t* ids, const uint64_t* keys, const double* priorities, size_t n,
              std::vector<int64_t>* evicted);
  // Draws up to n items one after another (an item that reaches
  // max_times_sampled leaves before the next draw). Stops early only if the
  // table empties.
  void sample(size_t n, std::vector<int64_t>* ids, std::vector<double>* probabilities,
              std::vector<int64_t>* exhausted);
  // Sets priorities by key; unknown keys are skipped. Returns how many were set.
  size_t update_priorities(const uint64_t* keys, const double* priorities, size_t n);
  // Puts back items from a checkpoint with their times sampled and insertion
  // sequence (so FIFO/LIFO order and use counts survive a restart); evicts at
  // capacity like insert. Later inserts are sequenced after every restored item.
  void restore(const int64_t* ids, const uint64_t* keys, const double* priorities,
               const uint32_t* times_sampled, const uint64_t* seqs, size_t n,
               std::vector<int64_t>* evicted);
  // Removes items by id (unknown ids skipped); returns how many were removed.
  size_t remove(const int64_t* ids, size_t n);
  // Ids of items by key (-1 for unknown keys).
  void lookup(const uint64_t* keys, size_t n, int64_t* ids) const;

  size_t size() const { return sampler_.size(); }
  bool contains(int64_t id) const { return live(id); }
  uint64_t capacity() const { return capacity_; }
  uint32_t max_times_sampled() const { return max_times_; }
  // Samples the table can still give before items run out (max_times_sampled > 0).
  uint64_t remaining_uses() const { return remaining_; }
  double priority(int64_t id) const { return priority_[id]; }
  uint32_t times_sampled(int64_t id) const { return times_[id]; }
  double probability(int64_t id) const { return sampler_.probability(id); }
  // The smallest probability a draw can have now (see Selector).
  double min_probability() const { return sampler_.min_probability(); }
  uint64_t sequence(int64_t id) const { return seq1_[id] - 1; }
  uint64_t key(int64_t id) const { return key_[id]; }
  // The key last inserted under `id` (kept after the item leaves, until the
  // id is reused); 0 for an id never used.
  uint64_t record_key(int64_t id) const {
    return id >= 0 && static_cast<size_t>(id) < key_.size() ? key_[id] : 0;
  }
  void prefetch_key(int64_t id) const {
    if (id >= 0 && static_cast<size_t>(id) < key_.size()) __builtin_prefetch(&key_[id]);
  }
  // Bytes in memory now, by structure (pages written at least once).
  std::vector<std::pair<std::string, size_t>> resident_bytes() const;
  // The sequence number the next inserted item gets; raising it (never
  // lowering) keeps items restored later ordered before new ones.
  uint64_t next_seq() const { return seq_; }
  void raise_next_seq(uint64_t seq) { if (seq > seq_) seq_ = seq; }

 private:
  void add(int64_t id, uint64_t key, double priority, uint64_t seq, uint32_t times);
  void check_new(const int64_t* ids, size_t n, const char* what) const;
  void make_room(std::vector<int64_t>* evicted);
  void drop(int64_t id);
  bool live(int64_t id) const {
    return id >= 0 && static_cast<size_t>(id) < seq1_.size() && seq1_[id] != 0;
  }

  // Columns by id, declared before the selectors that read them.
  Column<uint64_t> key_;
  Column<double> priority_;
  Column<uint32_t> times_;
  Column<uint64_t> seq1_;  // insertion sequence + 1; 0: not in the table
  KeyIndex by_key_;
  Selector sampler_;
  Selector remover_;
  uint64_t capacity_;
  uint32_t max_times_;
  uint64_t remaining_ = 0;
  uint64_t seq_ = 0;
  std::mt19937_64 rng_;
};

}  // namespace distore
