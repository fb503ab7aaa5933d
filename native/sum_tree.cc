#include "sum_tree.h"

namespace distore {

void SumTree::resize(size_t capacity) {
  size_t leaves = leaves_ ? leaves_ : 1;
  while (leaves < capacity) leaves <<= 1;
  if (leaves == leaves_) return;
  Column<double> tree(2 * leaves);
  if (leaves_ != 0) {
    // Level d of the old tree (nodes [2^d, 2^(d+1))) covers the same leaves
    // as level d + shift of the new one: copy each level's used prefix.
    const unsigned shift = static_cast<unsigned>(__builtin_ctzll(leaves / leaves_));
    const unsigned depth = static_cast<unsigned>(__builtin_ctzll(leaves_));
    for (unsigned d = 0; d <= depth; ++d) {
      const size_t span = size_t{1} << (depth - d);  // leaves under one node of level d
      const size_t count = (used_ + span - 1) / span;
      const size_t from = size_t{1} << d;
      const size_t to = size_t{1} << (d + shift);
      for (size_t j = 0; j < count; ++j) tree[to + j] = tree_[from + j];
    }
    // The new levels above the old root: their left-most node holds it all.
    for (unsigned k = 0; k < shift; ++k) tree[size_t{1} << k] = tree_[1];
  }
  tree_ = std::move(tree);
  leaves_ = leaves;
}

void SumTree::set(size_t index, double value) {
  size_t i = leaves_ + index;
  if (index >= used_) used_ = index + 1;
  tree_[i] = value;
  for (i >>= 1; i >= 1; i >>= 1) tree_[i] = tree_[2 * i] + tree_[2 * i + 1];
}

size_t SumTree::find(double prefix) const {
  size_t i = 1;
  while (i < leaves_) {
    const double left = tree_[2 * i];
    if (prefix < left) {
      i = 2 * i;
    } else {
      prefix -= left;
      // Rounding can leave prefix just past the right subtree's total: stay
      // on a side that has weight.
      i = (tree_[2 * i + 1] > 0.0 || left <= 0.0) ? 2 * i + 1 : 2 * i;
    }
  }
  return i - leaves_;
}

void SumTree::find_many(const double* prefixes, size_t n, int64_t* out) const {
  constexpr size_t kLanes = 16;
  for (size_t base = 0; base < n; base += kLanes) {
    const size_t lanes = n - base < kLanes ? n - base : kLanes;
    size_t node[kLanes];
    double rest[kLanes];
    for (size_t j = 0; j < lanes; ++j) {
      node[j] = 1;
      rest[j] = prefixes[base + j];
    }
    for (size_t width = 1; width < leaves_; width <<= 1) {
      for (size_t j = 0; j < lanes; ++j) {
        const size_t i = node[j];
        const double left = tree_[2 * i];
        if (rest[j] < left) {
          node[j] = 2 * i;
        } else {
          rest[j] -= left;
          node[j] = (tree_[2 * i + 1] > 0.0 || left <= 0.0) ? 2 * i + 1 : 2 * i;
        }
        __builtin_prefetch(&tree_[2 * node[j]]);
      }
    }
    for (size_t j = 0; j < lanes; ++j) out[base + j] = static_cast<int64_t>(node[j] - leaves_);
  }
}

}  // namespace distore
