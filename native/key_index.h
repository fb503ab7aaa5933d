// The table core's index from item key to record id: open addressing with
// linear probing over 4-byte slots that hold id + 1 (0 = empty). The keys
// themselves are not stored here: a probe compares against the core's key
// column, so the index costs 4 bytes a slot (load <= 3/4: 5.3 to 10.7 bytes
// an item) instead of a hash node per item. Removal shifts the following
// entries back (no tombstones), so probes stay short under churn.
//
// Ownership: owns its slots; reads the key column it is given on each call.
// Thread safety: none (one caller thread).
#pragma once

#include <cstddef>
#include <cstdint>

#include "column.h"

namespace distore {

class KeyIndex {
 public:
  // Largest id the index can hold (slots are 32 bits and 0 means empty).
  static constexpr uint64_t kMaxId = 0xFFFFFFFEull;

  // The id of `key`, or -1.
  int64_t find(uint64_t key, const Column<uint64_t>& keys) const;
  // Maps `key` to `id` (replacing the id it had, if any). keys[id] == key.
  void put(uint64_t key, uint32_t id, const Column<uint64_t>& keys);
  // Removes `key` if it maps to `id` (a key re-inserted under another id
  // keeps that one).
  void erase(uint64_t key, uint32_t id, const Column<uint64_t>& keys);

  size_t size() const { return count_; }
  size_t slots() const { return slots_.size(); }
  size_t resident_bytes() const { return slots_.resident_bytes(); }

 private:
  size_t home(uint64_t key) const {
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  void rehash(size_t slots, const Column<uint64_t>& keys);

  Column<uint32_t> slots_;
  size_t mask_ = 0;
  unsigned shift_ = 64;
  size_t count_ = 0;
};

}  // namespace distore
