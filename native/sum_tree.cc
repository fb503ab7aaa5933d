#include "sum_tree.h"

namespace distore {

void SumTree::resize(size_t capacity) {
  size_t leaves = 1;
  while (leaves < capacity) leaves <<= 1;
  if (leaves <= leaves_ && !tree_.empty()) return;
  std::vector<double> tree(2 * leaves, 0.0);
  for (size_t i = 0; i < leaves_; ++i) tree[leaves + i] = tree_[leaves_ + i];
  for (size_t i = leaves - 1; i >= 1; --i) tree[i] = tree[2 * i] + tree[2 * i + 1];
  tree_.swap(tree);
  leaves_ = leaves;
}

void SumTree::set(size_t index, double value) {
  size_t i = leaves_ + index;
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
