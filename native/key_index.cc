#include "key_index.h"

namespace distore {

int64_t KeyIndex::find(uint64_t key, const Column<uint64_t>& keys) const {
  if (count_ == 0) return -1;
  for (size_t i = home(key);; i = (i + 1) & mask_) {
    const uint32_t s = slots_[i];
    if (s == 0) return -1;
    if (keys[s - 1] == key) return static_cast<int64_t>(s - 1);
  }
}

void KeyIndex::put(uint64_t key, uint32_t id, const Column<uint64_t>& keys) {
  if ((count_ + 1) * 4 > slots_.size() * 3) rehash(slots_.size() ? 2 * slots_.size() : 64, keys);
  for (size_t i = home(key);; i = (i + 1) & mask_) {
    const uint32_t s = slots_[i];
    if (s == 0) {
      slots_[i] = id + 1;
      ++count_;
      return;
    }
    if (keys[s - 1] == key) {
      slots_[i] = id + 1;
      return;
    }
  }
}

void KeyIndex::erase(uint64_t key, uint32_t id, const Column<uint64_t>& keys) {
  if (count_ == 0) return;
  // Look for the id itself (no key reads): an id whose key was inserted
  // again under another id is not in the index, and the probe ends at an
  // empty slot.
  size_t i = home(key);
  for (;; i = (i + 1) & mask_) {
    const uint32_t s = slots_[i];
    if (s == 0) return;
    if (s - 1 == id) break;
  }
  // Backward shift: pull later entries of the run into the hole when their
  // home does not lie cyclically after the hole.
  for (size_t j = (i + 1) & mask_;; j = (j + 1) & mask_) {
    const uint32_t s = slots_[j];
    if (s == 0) break;
    const size_t h = home(keys[s - 1]);
    if (((j - h) & mask_) >= ((j - i) & mask_)) {
      slots_[i] = s;
      i = j;
    }
  }
  slots_[i] = 0;
  --count_;
}

void KeyIndex::rehash(size_t slots, const Column<uint64_t>& keys) {
  Column<uint32_t> old(std::move(slots_));
  slots_ = Column<uint32_t>(slots);
  mask_ = slots - 1;
  shift_ = 64 - static_cast<unsigned>(__builtin_ctzll(slots));
  for (size_t k = 0; k < old.size(); ++k) {
    const uint32_t s = old[k];
    if (s == 0) continue;
    size_t i = home(keys[s - 1]);
    while (slots_[i] != 0) i = (i + 1) & mask_;
    slots_[i] = s;
  }
}

}  // namespace distore
