// Byte-level pieces of the data path: CRC-32C, the listeners' SipHash
// grants, permute_rows, copy_rows, the batch layout, bounce chunks, stream_copy, and
// the status names errors carry.
#include <algorithm>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "am_grant.h"
#include "check.h"
#include "checksum.h"
#include "chunk_pool.h"
#include "layout.h"
#include "rows.h"
#include "status.h"
#include "stream_copy.h"

using distore::UcxError;

namespace {

// CRC-32C bit by bit, as the standard defines it.
uint32_t crc32c_reference(const uint8_t* p, size_t n, uint32_t crc = 0) {
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) {
    crc ^= p[i];
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ ((crc & 1) ? 0x82F63B78u : 0u);
  }
  return ~crc;
}

std::vector<uint8_t> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

}  // namespace

TEST(crc32c_is_the_standard_value_at_every_length_and_split) {
  CHECK_EQ(distore::crc32c_update(0, "123456789", 9), 0xE3069283u);  // the check value
  const auto data = random_bytes(40000, 9);
  // Short lengths take one stream, long ones three combined (12 KiB and up).
  for (size_t n : {0, 1, 7, 8, 9, 63, 4095, 12287, 12288, 12289, 12295, 40000}) {
    CHECK_EQ(distore::crc32c_update(0, data.data(), n), crc32c_reference(data.data(), n));
  }
  // Continued from an earlier CRC: the same as one pass over both.
  const uint32_t whole = distore::crc32c_update(0, data.data(), data.size());
  for (size_t cut : {1, 5000, 20000, 39999}) {
    const uint32_t head = distore::crc32c_update(0, data.data(), cut);
    CHECK_EQ(distore::crc32c_update(head, data.data() + cut, data.size() - cut), whole);
  }
  CHECK_EQ(distore::crc32c(data.data(), data.size()), whole);  // status.h's seal of rkeys
}

TEST(siphash_matches_the_reference_vectors_and_grants_follow_it) {
  uint8_t key[distore::kAmKeyBytes];
  uint8_t msg[15];
  for (uint8_t i = 0; i < 16; ++i) key[i] = i;
  for (uint8_t i = 0; i < 15; ++i) msg[i] = i;
  CHECK_EQ(distore::siphash24(key, msg, 15), 0xA129CA6149BE45E5ull);
  CHECK_EQ(distore::siphash24(key, msg, 0), 0x726FDB47DD0E0E31ull);
  // A slot's grant: the low 32 bits of SipHash(key, offset || size).
  uint8_t slot[16] = {};
  slot[0] = 0x10;  // offset 4112 = 0x1010, little-endian
  slot[1] = 0x10;
  slot[8] = 0x00;  // size 8192 = 0x2000
  slot[9] = 0x20;
  CHECK_EQ(distore::am_item_tag(key, 4112, 8192),
           static_cast<uint32_t>(distore::siphash24(key, slot, 16)));
  CHECK(distore::am_item_tag(key, 4112, 8192) != distore::am_item_tag(key, 4112, 8193));
  // The capability: two hashes of "distore connect" || i.
  uint8_t cap[16], other[16];
  distore::am_connect_cap(key, cap);
  const uint8_t connect0[16] = {'d', 'i', 's', 't', 'o', 'r', 'e', ' ',
                                'c', 'o', 'n', 'n', 'e', 'c', 't', 0};
  uint64_t first;
  std::memcpy(&first, cap, 8);
  CHECK_EQ(first, distore::siphash24(key, connect0, 16));
  key[15] ^= 1;  // another node's key: another capability
  distore::am_connect_cap(key, other);
  CHECK(distore::am_cap_equal(cap, cap));
  CHECK(!distore::am_cap_equal(cap, other));
  std::memcpy(other, cap, 16);
  other[15] ^= 0x80;  // a difference in the last byte counts too
  CHECK(!distore::am_cap_equal(cap, other));
}

TEST(permute_rows_moves_each_row_where_the_order_says) {
  std::mt19937_64 rng(4);
  for (size_t n : {0, 1, 2, 3, 17, 256}) {
    for (size_t row : {1, 8, 100}) {
      auto rows = random_bytes(n * row, n * 31 + row);
      std::vector<int64_t> order(n);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      std::vector<uint8_t> want(n * row);  // a gather into a copy
      for (size_t i = 0; i < n; ++i) {
        std::memcpy(want.data() + i * row, rows.data() + order[i] * row, row);
      }
      distore::permute_rows(rows.data(), row, order.data(), n);
      CHECK(rows == want);
    }
  }
}

TEST(permute_rows_refuses_what_is_not_a_permutation_touching_nothing) {
  auto rows = random_bytes(4 * 8, 1);
  const auto before = rows;
  const std::vector<std::vector<int64_t>> bad = {{0, 1, 1, 3}, {0, 1, 2, 4}, {-1, 1, 2, 3}};
  for (const auto& order : bad) {
    CHECK_THROWS(distore::permute_rows(rows.data(), 8, order.data(), 4), UcxError,
                 "not a permutation of 0..3");
    CHECK(rows == before);
  }
  try {
    distore::permute_rows(rows.data(), 8, bad[0].data(), 4);
  } catch (const UcxError& e) {
    CHECK_EQ(e.status(), distore::kStatusBadArgument);
  }
}

TEST(batch_layout_places_rows_and_refuses_overlaps_and_bad_rows) {
  using Field = distore::BatchLayout::Field;
  // 6 rows: headers at 0 (96 bytes), a 1000-byte field at 128, 3072 at 6144.
  const distore::BatchLayout layout(6, 0, {Field{16, 1000, 128}, Field{1024, 3072, 6144}});
  CHECK_EQ(layout.read_length(), uint64_t{4096});
  CHECK_EQ(layout.end(), uint64_t{6144 + 6 * 3072});
  CHECK_EQ(layout.header_at(5), uint64_t{80});
  CHECK_EQ(layout.field_at(1, 2), uint64_t{6144 + 2 * 3072});
  CHECK_THROWS(distore::BatchLayout(6, 0, {Field{16, 1000, 64}}), UcxError, "two arrays overlap");
  CHECK_THROWS(distore::BatchLayout(2, 0, {Field{8, 4, 100}}), UcxError, "slot header");
  distore::BatchLayout empty_field(2, 0, {Field{16, 0, 0}});  // an empty array overlaps nothing
  CHECK_EQ(empty_field.end(), uint64_t{32});
  const uint64_t rows[] = {0, 5, 6};
  layout.check(rows, 2, layout.end());
  CHECK_THROWS(layout.check(rows, 3, layout.end()), UcxError, "row 6 of a batch of 6");
  CHECK_THROWS(layout.check(rows, 1, layout.end() - 1), UcxError, "batch layout needs");
}

TEST(chunk_pool_hands_out_at_most_max_out_and_retires_tainted_chunks) {
  ChunkPool heap(64, 2);
  uint8_t* a = heap.take();
  uint8_t* b = heap.take();
  CHECK(a != nullptr && b != nullptr && a != b);
  CHECK(heap.take() == nullptr);  // max_out are out
  heap.give(a);
  CHECK(heap.take() == a);  // reused
  heap.give(b, true);       // tainted: never again; another made in its place
  uint8_t* c = heap.take();
  CHECK(c != nullptr && c != b);
  CHECK_EQ(heap.made(), size_t{3});

  std::vector<uint8_t> region(4 * 32);
  ChunkPool cut(region.data(), 32, 4);
  CHECK_EQ(cut.made(), size_t{4});
  std::set<uint8_t*> got;
  for (int i = 0; i < 4; ++i) got.insert(cut.take());
  CHECK(*got.begin() == region.data() && got.size() == 4);
  CHECK(cut.take() == nullptr);
  cut.give(region.data() + 32, true);  // a region's tainted chunk is not replaced
  CHECK(cut.take() == nullptr);
  cut.give(region.data());
  CHECK(cut.take() == region.data());
}

TEST(chunk_pool_never_gives_one_chunk_to_two_threads) {
  ChunkPool pool(16, 3);
  std::mutex mu;
  std::set<uint8_t*> held;  // chunks out now
  size_t most = 0, clashes = 0;
  auto work = [&] {
    for (int k = 0; k < 20000; ++k) {
      uint8_t* c = pool.take();
      if (c == nullptr) continue;
      {
        std::lock_guard<std::mutex> lock(mu);
        clashes += !held.insert(c).second;  // out already: handed out twice
        most = std::max(most, held.size());
      }
      std::lock_guard<std::mutex> lock(mu);
      held.erase(c);
      pool.give(c);  // under mu: nobody takes it before it left `held`
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back(work);
  for (auto& t : threads) t.join();
  CHECK_EQ(clashes, size_t{0});
  CHECK(most >= 1 && most <= 3);
  CHECK(pool.made() <= 3);
}

TEST(stream_copy_copies_every_length_and_alignment) {
  const auto src = random_bytes((size_t{3} << 20) + 64, 2);
  std::vector<uint8_t> dst(src.size() + 64);
  for (size_t len : {0, 1, 15, 16, 63, 64, 65, 200, 4096 + 7}) {
    for (size_t shift = 0; shift < 16; ++shift) {
      std::fill(dst.begin(), dst.end(), 0xAB);
      // stream_min 1: every range of 64 bytes or more streams, shorter ones
      // (which the alignment head would overrun) are copied plainly.
      distore::stream_copy(dst.data() + shift, src.data() + 3, len, 1);
      CHECK(std::memcmp(dst.data() + shift, src.data() + 3, len) == 0);
      CHECK_EQ(dst[shift + len], 0xAB);  // nothing past the end
      if (shift > 0) CHECK_EQ(dst[shift - 1], 0xAB);
    }
  }
  distore::stream_copy(dst.data() + 1, src.data(), size_t{3} << 20, size_t{1} << 20);
  CHECK(std::memcmp(dst.data() + 1, src.data(), size_t{3} << 20) == 0);
}

TEST(copy_rows_copies_strided_rows_streaming_the_long_ones) {
  // Rows of one field of a staged batch: the destination's rows lie
  // item_bytes apart, the source's as the caller's array has them.
  for (size_t row : {size_t{40}, distore::kStageStreamMin + 24}) {
    const size_t n = 3, dst_stride = row + 72, src_stride = row + 8;
    const auto src = random_bytes(n * src_stride, 5);
    std::vector<uint8_t> dst(n * dst_stride, 0xAB);
    distore::copy_rows(dst.data() + 8, dst_stride, src.data(), src_stride, n, row);
    for (size_t i = 0; i < n; ++i) {
      CHECK(std::memcmp(dst.data() + 8 + i * dst_stride, src.data() + i * src_stride, row) == 0);
      CHECK_EQ(dst[8 + i * dst_stride + row], 0xAB);  // the gap between rows untouched
    }
    CHECK_EQ(dst[7], 0xAB);
  }
}

TEST(statuses_have_names_and_check_throws_with_the_peer) {
  CHECK_EQ(distore::status_name(distore::kStatusTorn), std::string("DISTORE_TORN_READ"));
  CHECK_EQ(distore::status_name(UCS_ERR_UNREACHABLE), std::string("UCS_ERR_UNREACHABLE"));
  CHECK_EQ(distore::status_name(12345), std::string("UCS_STATUS_12345"));
  distore::check(UCS_OK, "nothing");
  distore::check(UCS_INPROGRESS, "nothing");
  CHECK_THROWS(distore::check(UCS_ERR_NO_MEMORY, "mapping", "node-3"), UcxError,
               "mapping failed: ");
  try {
    distore::check(UCS_ERR_NO_MEMORY, "mapping", "node-3");
  } catch (const UcxError& e) {
    CHECK_EQ(e.status(), int{UCS_ERR_NO_MEMORY});
    CHECK_EQ(e.peer(), std::string("node-3"));
    CHECK(std::string(e.what()).find("(peer node-3)") != std::string::npos);
  }
}
