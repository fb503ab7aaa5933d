// One selection policy of a replay table (Reverb's selectors): which item a
// sample returns, or which item leaves at capacity.
//
// Ownership: owns its index structures. Thread safety: none (the table
// core's caller serialises).
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "column.h"
#include "heap.h"
#include "seq_queue.h"
#include "sum_tree.h"

namespace distore {

// A selector kind is the index of its name in distore_ucx.selectors.KINDS,
// the one list of selector names (Python passes the index; no name is
// spelled here). Keep this enum in that order. kNone is not a name of
// KINDS: a sampler that holds nothing (no memory an item) and refuses to
// draw, for a table of slices, which draws from its SliceIndex (index -1).
enum class SelectorKind : int { kUniform, kPrioritized, kFifo, kLifo, kMinHeap, kMaxHeap, kNone };
constexpr int kSelectorKinds = 6;
constexpr int kNoSelector = -1;

// The kind of index `index` in KINDS (or kNoSelector: kNone); throws
// TableError when out of range.
SelectorKind selector_kind(int index);

// One selection policy over the table's items. Ids are below 2^32 - 1.
// Memory an item: uniform 8 bytes (dense list + position), prioritized
// about 16 (sum tree) + 1 bit (membership), fifo/lifo under 11 (queue of under
// 1.75x the live ids + position), heaps 8 (id + position).
class Selector {
 public:
  // `priority` and `seq1` (sequence + 1) are the table core's columns, read
  // by the heap kinds; the core writes an item's values before insert/update.
  Selector(SelectorKind kind, double alpha, const Column<double>* priority,
           const Column<uint64_t>* seq1);
  void insert(int64_t id, double priority);
  void remove(int64_t id);
  void update(int64_t id, double priority);
  // The next item and its probability (1 for the deterministic kinds).
  // Requires size() > 0.
  int64_t select(std::mt19937_64& rng, double* probability);
  size_t size() const { return size_; }
  // Probability that select() returns `id` now (for tests and reporting).
  double probability(int64_t id) const;
  // The smallest probability select() can return now among items it can
  // return at all (importance weights normalise by it); 0 when empty.
  double min_probability() const;
  // n independent draws at once (no removal between them).
  void select_many(std::mt19937_64& rng, size_t n, int64_t* ids, double* probabilities);
  // Bytes in memory now, by structure.
  void resident_bytes(const char* prefix,
                      std::vector<std::pair<std::string, size_t>>* out) const;

 private:
  double weight(double priority) const;
  bool member(size_t id) const { return (members_[id >> 6] >> (id & 63)) & 1; }
  // A uniform draw among the members of a prioritized selector whose
  // weights are all 0 (Reverb falls back to uniform there).
  int64_t uniform_member(std::mt19937_64& rng);

  SelectorKind kind_;
  double alpha_;
  size_t size_ = 0;
  // uniform: the ids in a dense list, and each id's index in it
  Column<uint32_t> items_;
  Column<uint32_t> pos_;
  // prioritized: the weights, a membership bit an id, and (built only when
  // every weight is 0 and members are sparse) a list of the members
  SumTree tree_;
  Column<uint64_t> members_;
  std::vector<uint32_t> member_list_;
  bool member_list_valid_ = false;
  // fifo, lifo: insertion order; min/max heap: by priority
  SequenceQueue queue_;
  IndexedHeap heap_;
  bool by_sequence() const { return kind_ == SelectorKind::kFifo || kind_ == SelectorKind::kLifo; }
};

}  // namespace distore
