// An indexed binary heap over item ids, ordered by (key, sequence): the top
// is the smallest key (or the largest, for a max-heap), ties broken by the
// oldest sequence number. Supports removal and re-keying of any id.
//
// Ownership: owns its storage. Thread safety: none (one caller thread).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace distore {

class IndexedHeap {
 public:
  explicit IndexedHeap(bool max_heap = false) : max_(max_heap) {}

  bool contains(int64_t id) const {
    return id >= 0 && static_cast<size_t>(id) < pos_.size() && pos_[id] >= 0;
  }
  size_t size() const { return heap_.size(); }
  bool empty() const { return heap_.empty(); }
  int64_t top() const { return heap_.front().id; }

  void push(int64_t id, double key, uint64_t seq);
  void remove(int64_t id);
  void update(int64_t id, double key);

 private:
  struct Entry {
    double key;
    uint64_t seq;
    int64_t id;
  };
  // True when a should sit above b.
  bool above(const Entry& a, const Entry& b) const {
    if (a.key != b.key) return max_ ? a.key > b.key : a.key < b.key;
    return a.seq < b.seq;
  }
  void place(size_t i, const Entry& e) {
    heap_[i] = e;
    pos_[e.id] = static_cast<int64_t>(i);
  }
  void sift_up(size_t i);
  void sift_down(size_t i);

  bool max_;
  std::vector<Entry> heap_;
  std::vector<int64_t> pos_;  // id -> index in heap_, -1 when absent
};

}  // namespace distore
