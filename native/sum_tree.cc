#include "sum_tree.h"

namespace distore {

namespace {
size_t round8(size_t n) { return (n + 7) / 8 * 8; }
}  // namespace

void SumTree::resize(size_t capacity) {
  size_t leaves = round8(capacity < 8 ? 8 : capacity);
  if (!levels_.empty()) {
    if (leaves <= levels_[0].size()) return;
    if (leaves < 2 * levels_[0].size()) leaves = 2 * levels_[0].size();
  }
  // Every level keeps its nodes (their leaf ranges do not change); levels
  // above the old top are new, their node 0 the sum of the old top.
  size_t n = leaves;
  for (size_t k = 0;; ++k) {
    if (k == levels_.size()) {
      levels_.emplace_back(n);
      mins_.emplace_back(k > 0 ? n : 0);
      if (k > 0) {
        levels_[k][0] = sum8(levels_[k - 1].data());
        mins_[k][0] = min8(k > 1 ? mins_[k - 1].data() : levels_[0].data());
      }
    } else {
      levels_[k].grow_to(n);
      if (k > 0) mins_[k].grow_to(n);
    }
    if (n <= 8) break;
    n = round8((n + 7) / 8);
  }
}

void SumTree::set(size_t index, double value) {
  if (index >= used_) used_ = index + 1;
  levels_[0][index] = value;
  size_t j = index;
  bool min_settled = false;  // a node's minimum did not change: nor do its ancestors'
  for (size_t k = 1; k < levels_.size(); ++k) {
    j >>= 3;
    levels_[k][j] = sum8(levels_[k - 1].data() + 8 * j);
    if (!min_settled) {
      const double m = min8((k > 1 ? mins_[k - 1].data() : levels_[0].data()) + 8 * j);
      min_settled = mins_[k][j] == m;
      mins_[k][j] = m;
    }
  }
  total_ = sum8(levels_.back().data());
  if (!min_settled) min_ = min8(levels_.size() > 1 ? mins_.back().data() : levels_[0].data());
}

size_t SumTree::pick(const double* c, double* prefix) {
  // A scan of one cache line. (Branch-free variants, a running-sum count
  // or a 3-level descent within the group, measured slower here.)
  size_t last = 0;
  for (size_t i = 0; i < 8; ++i) {
    if (c[i] <= 0.0) continue;
    if (*prefix < c[i]) return i;
    *prefix -= c[i];
    last = i;
  }
  return last;
}

size_t SumTree::find(double prefix) const {
  size_t idx = 0;
  for (size_t k = levels_.size(); k-- > 0;) {
    const size_t base = 8 * idx;
    idx = base + pick(levels_[k].data() + base, &prefix);
  }
  return idx;
}

void SumTree::find_many(const double* prefixes, size_t n, int64_t* out) const {
  constexpr size_t kLanes = 32;
  for (size_t base = 0; base < n; base += kLanes) {
    const size_t lanes = n - base < kLanes ? n - base : kLanes;
    size_t node[kLanes];
    double rest[kLanes];
    for (size_t j = 0; j < lanes; ++j) {
      node[j] = 0;
      rest[j] = prefixes[base + j];
    }
    for (size_t k = levels_.size(); k-- > 0;) {
      const double* level = levels_[k].data();
      for (size_t j = 0; j < lanes; ++j) {
        const size_t first = 8 * node[j];
        node[j] = first + pick(level + first, &rest[j]);
        if (k > 0) __builtin_prefetch(levels_[k - 1].data() + 8 * node[j]);
      }
    }
    for (size_t j = 0; j < lanes; ++j) out[base + j] = static_cast<int64_t>(node[j]);
  }
}

size_t SumTree::resident_bytes() const {
  size_t bytes = 0;
  for (const auto& level : levels_) bytes += level.resident_bytes();
  for (const auto& level : mins_) bytes += level.resident_bytes();
  return bytes;
}

}  // namespace distore
