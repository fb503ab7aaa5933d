// Rows of a staged batch reordered in place (a writer grouping each
// episode's steps before it sends a batch of a table of slices).
// Ownership: none kept. Thread safety: the caller owns the rows.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "status.h"

namespace distore {

// Reorders the n rows of `row_bytes` at `base` so that row i holds what row
// order[i] held, following the permutation's cycles: each row moved is
// copied once (one row of scratch), where a gather into a copy and back
// costs two copies of the batch and a scratch as large. Throws
// UcxError(kStatusBadArgument), touching nothing, unless `order` is a
// permutation of 0..n-1.
inline void permute_rows(uint8_t* base, size_t row_bytes, const int64_t* order, size_t n) {
  std::vector<uint8_t> seen(n, 0);
  for (size_t i = 0; i < n; ++i) {
    if (order[i] < 0 || static_cast<uint64_t>(order[i]) >= n || seen[order[i]]) {
      throw UcxError(kStatusBadArgument, "permute_rows: the order is not a permutation of 0.." +
                                             std::to_string(n == 0 ? 0 : n - 1));
    }
    seen[order[i]] = 1;
  }
  std::vector<uint8_t> scratch(row_bytes);
  std::vector<uint8_t> done(n, 0);
  for (size_t start = 0; start < n; ++start) {
    if (done[start] || static_cast<size_t>(order[start]) == start) continue;
    // The cycle start <- order[start] <- order[order[start]] ...: hold row
    // `start`, pull each next row into place, the held row into the last.
    std::memcpy(scratch.data(), base + start * row_bytes, row_bytes);
    size_t at = start;
    while (true) {
      const size_t from = static_cast<size_t>(order[at]);
      done[at] = 1;
      if (from == start) {
        std::memcpy(base + at * row_bytes, scratch.data(), row_bytes);
        break;
      }
      std::memcpy(base + at * row_bytes, base + from * row_bytes, row_bytes);
      at = from;
    }
  }
}

}  // namespace distore
