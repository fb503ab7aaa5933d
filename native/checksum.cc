// CRC-32C, hardware where the CPU has it (checksum.h).
#include "checksum.h"

#include <cstring>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#include <arm_acle.h>
#endif

namespace distore {

namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // CRC-32C, reflected

struct Tables {
  uint32_t t[8][256];
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? kPoly ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    }
  }
};

// Slicing-by-8: eight table look-ups per 8 bytes (about 1-2 GB/s).
uint32_t crc_tables(uint32_t crc, const uint8_t* p, size_t n) {
  static const Tables tables;  // built once (thread-safe static)
  const auto& t = tables.t;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);  // little-endian hosts only (every one we build for)
    w ^= crc;
    crc = t[7][w & 0xFF] ^ t[6][(w >> 8) & 0xFF] ^ t[5][(w >> 16) & 0xFF] ^
          t[4][(w >> 24) & 0xFF] ^ t[3][(w >> 32) & 0xFF] ^ t[2][(w >> 40) & 0xFF] ^
          t[1][(w >> 48) & 0xFF] ^ t[0][w >> 56];
  }
  for (; n > 0; --n, ++p) crc = t[0][(crc ^ *p) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
// One crc32 instruction per 8 bytes: about 8 bytes per 3 cycles on one core.
__attribute__((target("sse4.2"))) uint32_t crc_sse42(uint32_t crc, const uint8_t* p,
                                                     size_t n) {
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c = _mm_crc32_u64(c, w);
  }
  auto c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = _mm_crc32_u8(c32, *p);
  return c32;
}

bool has_sse42() {
  static const bool yes = __builtin_cpu_supports("sse4.2");
  return yes;
}
#endif

}  // namespace

uint32_t crc32c_update(uint32_t crc, const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  if (has_sse42()) return ~crc_sse42(crc, p, size);
#elif defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
  for (; size >= 8; size -= 8, p += 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    crc = __crc32cd(crc, w);
  }
  for (; size > 0; --size, ++p) crc = __crc32cb(crc, *p);
  return ~crc;
#endif
  return ~crc_tables(crc, p, size);
}

}  // namespace distore
