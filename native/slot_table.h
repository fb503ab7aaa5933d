// A storage node's slot table, batch-shaped (storage/slots.py keeps the
// columns as numpy arrays; these functions work on them in place): one call
// per insert batch for what was an index lookup and a handful of numpy
// calls each (allocation, acknowledgement, frees), which cost a node under
// fan-in more per batch than its items did.
//
// A table's slots are numbered in the order they were carved, and their
// offsets ascend with their numbers (storage/arena.py carves new slots
// above every earlier one), so offset -> number is a binary search.
#pragma once

#include <cstddef>
#include <cstdint>

namespace distore {

// Slot states, as storage/slots.py names them.
constexpr uint8_t kSlotFree = 0;
constexpr uint8_t kSlotAllocated = 1;
constexpr uint8_t kSlotLive = 2;

// The numbers of k slots at `offsets` among the n carved ones (`carved`,
// ascending) into `idx`; false (idx partly written) if an offset is not a
// slot's.
bool slot_numbers(const uint64_t* carved, size_t n, const uint64_t* offsets, size_t k,
                  int64_t* idx);

// Records k freshly carved slots of `slot_size` bytes at `offsets` as slots
// n..n+k-1, ALLOCATED (the columns have room for them); false, nothing
// changed, unless the offsets ascend from the end of slot n-1 or above.
bool slot_carve(uint64_t* carved, uint8_t* state, size_t n, uint64_t slot_size,
                const uint64_t* offsets, size_t k);

// The k FREE slots on top of the stack `free_stack[0..nfree)` (k <= nfree)
// made ALLOCATED; their offsets into `out`, in stack order (the deepest first).
void slot_reuse(const int64_t* free_stack, size_t nfree, size_t k, uint8_t* state,
                const uint64_t* carved, uint64_t* out);

// The slots at `offsets` made FREE and pushed, in ascending number, onto
// `free_stack` above `nfree` (it has room for k more); each slot once, however
// often it is named, and only one not FREE already (LIVE only, with
// `live_only`). Returns how many were pushed; -1 (nothing changed) if an
// offset is not a slot's. `scratch` holds k numbers.
long slot_release(const uint64_t* carved, size_t n, uint8_t* state, const uint64_t* offsets,
                  size_t k, bool live_only, int64_t* free_stack, size_t nfree, int64_t* scratch);

}  // namespace distore
