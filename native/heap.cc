#include "heap.h"

namespace distore {

void IndexedHeap::push(int64_t id) {
  pos_.grow(static_cast<size_t>(id) + 1);
  heap_.grow(size_ + 1);
  place(size_, static_cast<uint32_t>(id));
  ++size_;
  sift_up(size_ - 1);
}

void IndexedHeap::remove(int64_t id) {
  if (!contains(id)) return;
  const size_t i = pos_[id] - 1;
  pos_[id] = 0;
  const uint32_t last = heap_[--size_];
  if (i == size_) return;
  place(i, last);
  sift_up(i);
  sift_down(pos_[last] - 1);
}

void IndexedHeap::update(int64_t id) {
  if (!contains(id)) return;
  sift_up(pos_[id] - 1);
  sift_down(pos_[id] - 1);
}

void IndexedHeap::sift_up(size_t i) {
  const uint32_t e = heap_[i];
  while (i > 0) {
    const size_t parent = (i - 1) / 2;
    if (!above(e, heap_[parent])) break;
    place(i, heap_[parent]);
    i = parent;
  }
  place(i, e);
}

void IndexedHeap::sift_down(size_t i) {
  const uint32_t e = heap_[i];
  const size_t n = size_;
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
