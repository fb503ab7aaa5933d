// A sum tree over non-negative weights: O(log n) update and proportional
// sampling. Internal nodes are recomputed from their children on every
// update (never adjusted by deltas), so totals do not drift.
//
// Layout: 8-ary, one array a level counted from the leaves (level 0), node
// j of level k summing children 8j..8j+7 of level k-1. A node's children
// are one 64-byte cache line, so a draw from 10^7 leaves touches 8 lines
// instead of the 24 of a binary tree (the lower levels miss every time),
// and the internal levels cost 1/7 of the leaves (about 9 bytes a leaf in
// all). Each level is a Column: growing appends (no copy), and only the
// leaves written so far and their ancestors cost memory.
//
// Beside the sums, each internal node keeps the smallest positive weight
// below it (0: none), so min_positive() is O(1) and an update costs one more
// look at the first level above the leaf in most cases (the walk up stops
// where a node's minimum does not change): importance weights normalise by the
// smallest probability in the table, (p_i / p_min)^-beta, as TorchRL's and
// the PER paper's implementations do. The leaves serve both trees.
//
// Ownership: owns its storage. Thread safety: none; the caller serialises
// (the control plane uses one thread).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "column.h"

namespace distore {

class SumTree {
 public:
  explicit SumTree(size_t capacity = 0) { resize(capacity); }
  SumTree(const SumTree&) = delete;
  SumTree& operator=(const SumTree&) = delete;
  SumTree(SumTree&&) = default;
  SumTree& operator=(SumTree&&) = default;

  // Grows (never shrinks) to hold at least `capacity` leaves; keeps values.
  void resize(size_t capacity);
  // Leaves (a multiple of 8).
  size_t capacity() const { return levels_.empty() ? 0 : levels_[0].size(); }

  void set(size_t index, double value);
  double get(size_t index) const { return levels_[0][index]; }
  double total() const { return total_; }
  // The smallest positive leaf; 0 when no leaf is positive.
  double min_positive() const { return min_; }
  // One past the highest leaf ever set (leaves beyond it are 0).
  size_t used() const { return used_; }

  // The leaf where the running sum first exceeds `prefix` (0 <= prefix < total).
  size_t find(double prefix) const;
  // find() for many prefixes at once: walks 32 paths in lockstep so their
  // cache misses overlap.
  void find_many(const double* prefixes, size_t n, int64_t* out) const;

  size_t resident_bytes() const;

 private:
  static double sum8(const double* c) {
    return ((c[0] + c[1]) + (c[2] + c[3])) + ((c[4] + c[5]) + (c[6] + c[7]));
  }
  // The child of group `c` (8 weights, not all 0) where `*prefix` falls;
  // subtracts the weight before it. Never a child of weight 0 (rounding can
  // leave the prefix past the group's total: then the last with weight).
  // The smallest positive of 8 values (0: none is positive): both a leaf
  // group and a group of mins, where 0 means "nothing positive below".
  static double min8(const double* c) {
    constexpr double kNone = std::numeric_limits<double>::infinity();
    double m = kNone;
    for (size_t i = 0; i < 8; ++i) m = std::min(m, c[i] > 0.0 ? c[i] : kNone);
    return m == kNone ? 0.0 : m;
  }
  static size_t pick(const double* c, double* prefix);

  std::vector<Column<double>> levels_;  // [0]: leaves; the last has <= 8 nodes
  // mins_[k] (k >= 1) beside levels_[k]; mins_[0] stays empty (the leaves).
  std::vector<Column<double>> mins_;
  double total_ = 0.0;
  double min_ = 0.0;
  size_t used_ = 0;
};

}  // namespace distore
