// One selection policy of a replay table (Reverb's selectors): which item a
// sample returns, or which item leaves at capacity.
//
// Ownership: owns its index structures. Thread safety: none (the table
// core's caller serialises).
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "heap.h"
#include "sum_tree.h"

namespace distore {

// A selector kind is the index of its name in distore_ucx.control.selectors.KINDS,
// the one list of selector names (Python passes the index; no name is
// spelled here). Keep this enum in that order.
enum class SelectorKind : int { kUniform, kPrioritized, kFifo, kLifo, kMinHeap, kMaxHeap };
constexpr int kSelectorKinds = 6;

// The kind of index `index` in KINDS; throws TableError when out of range.
SelectorKind selector_kind(int index);

// One selection policy over the table's items.
class Selector {
 public:
  Selector(SelectorKind kind, double alpha);
  void insert(int64_t id, double priority, uint64_t seq);
  void remove(int64_t id);
  void update(int64_t id, double priority);
  // The next item and its probability (1 for the deterministic kinds).
  // Requires size() > 0.
  int64_t select(std::mt19937_64& rng, double* probability);
  size_t size() const { return size_; }
  // Probability that select() returns `id` now (for tests and reporting).
  double probability(int64_t id) const;
  // n independent draws at once (no removal between them).
  void select_many(std::mt19937_64& rng, size_t n, int64_t* ids, double* probabilities);

 private:
  double weight(double priority) const;
  void grow(int64_t id);

  SelectorKind kind_;
  double alpha_;
  size_t size_ = 0;
  // uniform (also the fallback of prioritized when every weight is 0)
  std::vector<int64_t> items_;
  std::vector<int64_t> pos_;
  // prioritized
  SumTree tree_;
  // fifo, lifo, min/max heap
  IndexedHeap heap_;
};

}  // namespace distore
