// What a storage node's active-message listeners (am_connections.h) ask of
// a peer before they serve it, derived from a key only the node and the
// control plane know:
//
// - a connection capability, cap = SipHash-2-4(key, "distore connect" || i)
//   for i = 0, 1 (16 bytes): the control plane gives it to clients on the
//   authenticated channel (a node descriptor's `am_cap`); a peer's first
//   message on a new connection must carry it, or the node closes the
//   connection;
// - a grant per sampled item, tag = low 32 bits of SipHash-2-4(key, slot
//   offset || slot size): the control plane writes it into each sample
//   reply's item record (protocol.ITEM_LOCATION's `pad`); a learner's
//   request names it per item, and the node sends nothing of a request one
//   of whose items it does not match, nor any part outside the slot.
//
// The node draws the key when it starts and sends it only to the control
// plane (register_node's `am_key`). SipHash-2-4 is a keyed pseudorandom
// function (Aumasson and Bernstein, 2012): without the key, a tag or a
// capability cannot be made from others. A 32-bit tag could be guessed one
// request in 2^32, but a connection that sends a wrong one is closed and
// has to authenticate again first.
//
// Header-only, with no UCX and no Python: the control plane's table module
// (bindings/bind_grants.cc) and the node's (am_sample_request.cc,
// am_connections.cc) compute the same values. Thread safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace distore {

constexpr size_t kAmKeyBytes = 16;
constexpr size_t kAmCapBytes = 16;

namespace siphash_detail {

inline uint64_t rotl(uint64_t x, int b) { return (x << b) | (x >> (64 - b)); }

inline void round(uint64_t& v0, uint64_t& v1, uint64_t& v2, uint64_t& v3) {
  v0 += v1;
  v1 = rotl(v1, 13);
  v1 ^= v0;
  v0 = rotl(v0, 32);
  v2 += v3;
  v3 = rotl(v3, 16);
  v3 ^= v2;
  v0 += v3;
  v3 = rotl(v3, 21);
  v3 ^= v0;
  v2 += v1;
  v1 = rotl(v1, 17);
  v1 ^= v2;
  v2 = rotl(v2, 32);
}

inline uint64_t load_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

}  // namespace siphash_detail

// SipHash-2-4 of `n` bytes at `data` under the 16-byte `key` (little-endian
// words, as the reference implementation).
inline uint64_t siphash24(const uint8_t key[kAmKeyBytes], const void* data, size_t n) {
  using namespace siphash_detail;
  const uint64_t k0 = load_le64(key), k1 = load_le64(key + 8);
  uint64_t v0 = 0x736f6d6570736575ull ^ k0;
  uint64_t v1 = 0x646f72616e646f6dull ^ k1;
  uint64_t v2 = 0x6c7967656e657261ull ^ k0;
  uint64_t v3 = 0x7465646279746573ull ^ k1;
  const auto* p = static_cast<const uint8_t*>(data);
  const size_t whole = n - n % 8;
  for (size_t i = 0; i < whole; i += 8) {
    const uint64_t m = load_le64(p + i);
    v3 ^= m;
    round(v0, v1, v2, v3);
    round(v0, v1, v2, v3);
    v0 ^= m;
  }
  uint64_t last = static_cast<uint64_t>(n & 0xff) << 56;
  for (size_t i = 0; i < n % 8; ++i) last |= static_cast<uint64_t>(p[whole + i]) << (8 * i);
  v3 ^= last;
  round(v0, v1, v2, v3);
  round(v0, v1, v2, v3);
  v0 ^= last;
  v2 ^= 0xff;
  for (int i = 0; i < 4; ++i) round(v0, v1, v2, v3);
  return v0 ^ v1 ^ v2 ^ v3;
}

// The connection capability of the node whose key is `key` (see above).
inline void am_connect_cap(const uint8_t key[kAmKeyBytes], uint8_t cap[kAmCapBytes]) {
  uint8_t msg[16] = {'d', 'i', 's', 't', 'o', 'r', 'e', ' ', 'c', 'o', 'n', 'n', 'e', 'c', 't', 0};
  for (uint8_t i = 0; i < 2; ++i) {
    msg[15] = i;
    const uint64_t h = siphash24(key, msg, sizeof(msg));
    for (int b = 0; b < 8; ++b) cap[8 * i + b] = static_cast<uint8_t>(h >> (8 * b));
  }
}

// The grant of the slot at `slot` (offset in the arena) of `slot_size`
// bytes on the node whose key is `key` (see above).
inline uint32_t am_item_tag(const uint8_t key[kAmKeyBytes], uint64_t slot, uint64_t slot_size) {
  uint8_t msg[16];
  for (int b = 0; b < 8; ++b) {
    msg[b] = static_cast<uint8_t>(slot >> (8 * b));
    msg[8 + b] = static_cast<uint8_t>(slot_size >> (8 * b));
  }
  return static_cast<uint32_t>(siphash24(key, msg, sizeof(msg)));
}

// Whether two capabilities are equal, in time independent of where they differ.
inline bool am_cap_equal(const uint8_t* a, const uint8_t* b) {
  uint8_t diff = 0;
  for (size_t i = 0; i < kAmCapBytes; ++i) diff |= a[i] ^ b[i];
  return diff == 0;
}

}  // namespace distore
