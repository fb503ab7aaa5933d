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

}  // namespace distore
