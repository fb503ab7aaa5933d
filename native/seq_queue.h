// Ids in insertion-sequence order, for the FIFO and LIFO selectors: the
// oldest (FIFO) or newest (LIFO) on top in O(1), removal of any id in O(1)
// amortized, nothing read from the core's columns on the insert/evict path.
//
// Sequences only grow as items are inserted, so the order is the order of
// push(): ids are appended to a queue, a removed id leaves a hole (skipped,
// and squeezed out when holes outnumber ids), both ends are kept on live
// ids so top() is one read. The one push out of order is a restore's (items
// come back with their old sequences in checkpoint order): it marks the
// queue unsorted, and the next top() sorts the live ids by sequence once.
//
// It replaced an indexed binary heap for these two kinds: inserting into a
// full FIFO table (one eviction an insert) spent most of its time in the
// heap's sift-down, two random reads of the sequence column a level.
//
// Memory: 4 bytes an entry of the queue, which holds under 1.75x the live
// ids (the free entries are squeezed out once they are a quarter of them),
// plus 4 bytes a position per id: under 11 bytes an item.
// Ownership: owns its storage; reads the sequence column it was given
// (owned by the table core, which outlives it). Thread safety: none.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "column.h"

namespace distore {

class SequenceQueue {
 public:
  // `newest_on_top`: LIFO; else FIFO. `seq1` holds each id's sequence + 1.
  SequenceQueue(bool newest_on_top, const Column<uint64_t>* seq1)
      : lifo_(newest_on_top), seq1_(seq1) {}

  bool contains(int64_t id) const {
    return id >= 0 && static_cast<size_t>(id) < pos_.size() && pos_[id] != 0;
  }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }

  // The oldest (FIFO) or newest (LIFO) id. Requires !empty().
  int64_t top() const {
    if (!sorted_) sort();
    return lifo_ ? q_[tail_ - 1] : q_[head_];
  }

  // The core has written the id's sequence already.
  void push(int64_t id) {
    const auto u = static_cast<uint32_t>(id);
    if (size_ != 0 && (*seq1_)[u] < (*seq1_)[q_[tail_ - 1]]) sorted_ = false;
    if (tail_ == q_.size()) make_room();
    pos_.grow(static_cast<size_t>(id) + 1);
    q_[tail_] = u;
    pos_[u] = static_cast<uint32_t>(tail_ + 1);
    ++tail_;
    ++size_;
  }

  void remove(int64_t id) {
    if (!contains(id)) return;
    const size_t i = pos_[id] - 1;
    pos_[id] = 0;
    q_[i] = kHole;
    --size_;
    if (size_ == 0) {
      head_ = tail_ = 0;
      return;
    }
    while (q_[head_] == kHole) ++head_;
    while (q_[tail_ - 1] == kHole) --tail_;
  }

  size_t resident_bytes() const { return q_.resident_bytes() + pos_.resident_bytes(); }

 private:
  static constexpr uint32_t kHole = UINT32_MAX;  // ids are below 2^32 - 1

  // The queue is full at its end. Squeeze out the free entries (those before
  // head_ and the holes) when they are at least a quarter of the live ids:
  // each squeeze then moves at most 4 ids per free entry it makes, so pushes
  // stay O(1) amortized. Else grow by half the live ids. In a full FIFO table
  // (one removal at the head per push) the queue so stays under 1.75x the
  // live ids (growing by doubling let it reach 2.5x).
  void make_room() {
    const size_t free_entries = tail_ - size_;  // head_ plus the holes
    if (free_entries != 0 && free_entries >= size_ / 4) {
      compact();
      if (tail_ < q_.size()) return;
    }
    q_.grow_to(tail_ + std::max<size_t>(size_ / 2, 1024));
  }

  // Live ids moved to the front, in order.
  void compact() const {
    size_t w = 0;
    for (size_t r = head_; r < tail_; ++r) {
      const uint32_t id = q_[r];
      if (id == kHole) continue;
      q_[w] = id;
      pos_[id] = static_cast<uint32_t>(w + 1);
      ++w;
    }
    head_ = 0;
    tail_ = w;
  }

  // Live ids in sequence order (after a restore pushed some out of order).
  void sort() const {
    compact();
    std::sort(q_.data(), q_.data() + tail_,
              [this](uint32_t a, uint32_t b) { return (*seq1_)[a] < (*seq1_)[b]; });
    for (size_t i = 0; i < tail_; ++i) pos_[q_[i]] = static_cast<uint32_t>(i + 1);
    sorted_ = true;
  }

  bool lifo_;
  const Column<uint64_t>* seq1_;
  size_t size_ = 0;
  // Sorting and squeezing holes out change no id's place in the order, so
  // const top() may do them.
  mutable bool sorted_ = true;
  mutable size_t head_ = 0;  // first live entry of q_
  mutable size_t tail_ = 0;  // one past the last live entry
  mutable Column<uint32_t> q_;
  mutable Column<uint32_t> pos_;  // id -> index in q_ + 1, 0 when absent
};

}  // namespace distore
