#include "heap.h"

namespace distore {

void IndexedHeap::push(int64_t id, double key, uint64_t seq) {
  if (static_cast<size_t>(id) >= pos_.size()) pos_.resize(static_cast<size_t>(id) * 2 + 1, -1);
  heap_.push_back(Entry{key, seq, id});
  pos_[id] = static_cast<int64_t>(heap_.size() - 1);
  sift_up(heap_.size() - 1);
}

void IndexedHeap::remove(int64_t id) {
  if (!contains(id)) return;
  size_t i = static_cast<size_t>(pos_[id]);
  pos_[id] = -1;
  Entry last = heap_.back();
  heap_.pop_back();
  if (i == heap_.size()) return;
  place(i, last);
  sift_up(i);
  sift_down(static_cast<size_t>(pos_[last.id]));
}

void IndexedHeap::update(int64_t id, double key) {
  if (!contains(id)) return;
  size_t i = static_cast<size_t>(pos_[id]);
  heap_[i].key = key;
  sift_up(i);
  sift_down(static_cast<size_t>(pos_[id]));
}

void IndexedHeap::sift_up(size_t i) {
  Entry e = heap_[i];
  while (i > 0) {
    size_t parent = (i - 1) / 2;
    if (!above(e, heap_[parent])) break;
    place(i, heap_[parent]);
    i = parent;
  }
  place(i, e);
}

void IndexedHeap::sift_down(size_t i) {
  Entry e = heap_[i];
  const size_t n = heap_.size();
  while (true) {
    size_t child = 2 * i + 1;
    if (child >= n) break;
    if (child + 1 < n && above(heap_[child + 1], heap_[child])) ++child;
    if (!above(heap_[child], e)) break;
    place(i, heap_[child]);
    i = child;
  }
  place(i, e);
}

}  // namespace distore
