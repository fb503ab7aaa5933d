// One copy routine for the same-host data paths (mapped reads, mapped
// inserts): ranges of `stream_min` bytes and more are written with
// non-temporal stores, since their destination (a ring slot, an arena slot)
// is read later by another core or process: streaming past the cache saves
// the read-for-ownership of every destination line. Ends with a store fence,
// so the streamed bytes are ordered before whatever the caller writes next
// (a slot header). Thread safe; no state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace distore {

// Ranges under 64 bytes are copied plainly whatever `stream_min` says (a
// range shorter than the alignment head would be overrun).
inline void stream_copy(uint8_t* dst, const uint8_t* src, size_t len, size_t stream_min) {
#if defined(__SSE2__)
  if (len >= stream_min && len >= 64) {
    const size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    len -= head;
    auto* d = reinterpret_cast<__m128i*>(dst);
    const auto* s = reinterpret_cast<const __m128i*>(src);
    for (size_t blocks = len / 64; blocks != 0; --blocks, d += 4, s += 4) {
      const __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1);
      const __m128i c = _mm_loadu_si128(s + 2), e = _mm_loadu_si128(s + 3);
      _mm_stream_si128(d, a);
      _mm_stream_si128(d + 1, b);
      _mm_stream_si128(d + 2, c);
      _mm_stream_si128(d + 3, e);
    }
    const size_t done = len / 64 * 64;
    std::memcpy(dst + done, src + done, len - done);
    _mm_sfence();
    return;
  }
#endif
  std::memcpy(dst, src, len);
}

}  // namespace distore
