// A sum tree over non-negative weights: O(log n) update and proportional
// sampling. Internal nodes are recomputed from their children on every
// update (never adjusted by deltas), so totals do not drift.
//
// Memory: the nodes live in a Column, so only the leaves written so far and
// their ancestors cost memory (about 16 bytes a leaf in use, whatever the
// power-of-two capacity); growing copies only that used part.
//
// Ownership: owns its storage. Thread safety: none; the caller serialises
// (the control plane uses one thread).
#pragma once

#include <cstddef>
#include <cstdint>

#include "column.h"

namespace distore {

class SumTree {
 public:
  explicit SumTree(size_t capacity = 0) { resize(capacity); }

  // Grows (never shrinks) to hold at least `capacity` leaves; keeps values.
  void resize(size_t capacity);
  size_t capacity() const { return leaves_; }

  void set(size_t index, double value);
  double get(size_t index) const { return tree_[leaves_ + index]; }
  double total() const { return leaves_ ? tree_[1] : 0.0; }
  // One past the highest leaf ever set (leaves beyond it are 0).
  size_t used() const { return used_; }

  // The leaf where the running sum first exceeds `prefix` (0 <= prefix < total).
  size_t find(double prefix) const;
  // find() for many prefixes at once: walks 16 paths in lockstep so their
  // cache misses overlap (the lower levels of a large tree miss every time).
  void find_many(const double* prefixes, size_t n, int64_t* out) const;

  size_t resident_bytes() const { return tree_.resident_bytes(); }

 private:
  size_t leaves_ = 0;         // a power of two
  size_t used_ = 0;
  Column<double> tree_;       // 1-based heap layout: node i has children 2i, 2i+1
};

}  // namespace distore
