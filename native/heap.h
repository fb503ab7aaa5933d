// An indexed binary heap over item ids, ordered by the table core's own
// columns: by insertion sequence (FIFO: oldest on top; LIFO: newest), or by
// priority with ties broken by the oldest sequence (min/max heap). Supports
// removal and re-ordering of any id.
//
// Memory: 4 bytes an id in the heap plus 4 a position (the keys are read
// from the core's columns, not copied here).
//
// Ownership: owns its storage; reads the priority and sequence columns it
// was given (owned by the table core, which outlives it). Thread safety:
// none (one caller thread).
#pragma once

#include <cstddef>
#include <cstdint>

#include "column.h"

namespace distore {

class IndexedHeap {
 public:
  // `by_sequence`: order by sequence only; else by priority, then sequence.
  // `seq1` holds each id's sequence + 1.
  IndexedHeap(bool max_heap, bool by_sequence, const Column<double>* priority,
              const Column<uint64_t>* seq1)
      : max_(max_heap), by_seq_(by_sequence), priority_(priority), seq1_(seq1) {}

  bool contains(int64_t id) const {
    return id >= 0 && static_cast<size_t>(id) < pos_.size() && pos_[id] != 0;
  }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  int64_t top() const { return heap_[0]; }

  // The core has written the id's priority and sequence already.
  void push(int64_t id);
  void remove(int64_t id);
  // The id's priority changed (already written in the column).
  void update(int64_t id);

  size_t resident_bytes() const { return heap_.resident_bytes() + pos_.resident_bytes(); }

 private:
  // True when a should sit above b.
  bool above(uint32_t a, uint32_t b) const {
    const uint64_t sa = (*seq1_)[a], sb = (*seq1_)[b];
    if (!by_seq_) {
      const double pa = (*priority_)[a], pb = (*priority_)[b];
      if (pa != pb) return max_ ? pa > pb : pa < pb;
      return sa < sb;
    }
    return max_ ? sa > sb : sa < sb;
  }
  void place(size_t i, uint32_t id) {
    heap_[i] = id;
    pos_[id] = static_cast<uint32_t>(i + 1);
  }
  void sift_up(size_t i);
  void sift_down(size_t i);

  bool max_;
  bool by_seq_;
  const Column<double>* priority_;
  const Column<uint64_t>* seq1_;
  size_t size_ = 0;
  Column<uint32_t> heap_;
  Column<uint32_t> pos_;  // id -> index in heap_ + 1, 0 when absent
};

}  // namespace distore
