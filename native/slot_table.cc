// See slot_table.h.
#include "slot_table.h"

#include <algorithm>

namespace distore {

bool slot_numbers(const uint64_t* carved, size_t n, const uint64_t* offsets, size_t k,
                  int64_t* idx) {
  const uint64_t* end = carved + n;
  for (size_t i = 0; i < k; ++i) {
    const uint64_t* at = std::lower_bound(carved, end, offsets[i]);
    if (at == end || *at != offsets[i]) return false;
    idx[i] = at - carved;
  }
  return true;
}

bool slot_carve(uint64_t* carved, uint8_t* state, size_t n, uint64_t slot_size,
                const uint64_t* offsets, size_t k) {
  uint64_t end = n > 0 ? carved[n - 1] + slot_size : 0;
  for (size_t i = 0; i < k; ++i) {
    if (offsets[i] < end || (i > 0 && offsets[i] <= offsets[i - 1])) return false;
    if (i == 0) end = 0;  // the next ones need only ascend
  }
  for (size_t i = 0; i < k; ++i) {
    carved[n + i] = offsets[i];
    state[n + i] = kSlotAllocated;
  }
  return true;
}

void slot_reuse(const int64_t* free_stack, size_t nfree, size_t k, uint8_t* state,
                const uint64_t* carved, uint64_t* out) {
  // storage/slots.py took the top k as one slice, lowest stack position first
  for (size_t i = 0; i < k; ++i) {
    const int64_t s = free_stack[nfree - k + i];
    state[s] = kSlotAllocated;
    out[i] = carved[s];
  }
}

long slot_release(const uint64_t* carved, size_t n, uint8_t* state, const uint64_t* offsets,
                  size_t k, bool live_only, int64_t* free_stack, size_t nfree, int64_t* scratch) {
  if (!slot_numbers(carved, n, offsets, k, scratch)) return -1;
  size_t m = 0;
  for (size_t i = 0; i < k; ++i) {
    const uint8_t s = state[scratch[i]];
    if (live_only ? s == kSlotLive : s != kSlotFree) scratch[m++] = scratch[i];
  }
  std::sort(scratch, scratch + m);
  m = std::unique(scratch, scratch + m) - scratch;
  for (size_t i = 0; i < m; ++i) {
    state[scratch[i]] = kSlotFree;
    free_stack[nfree + i] = scratch[i];
  }
  return static_cast<long>(m);
}

}  // namespace distore
