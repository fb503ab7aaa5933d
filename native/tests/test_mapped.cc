// Same-host reads (native/mapped.h): a node's arena (a memfd) mapped
// read-only, the batched copies out of it with and without a copy pool,
// the located gather's statuses, and the seqlock check against a writer
// that rewrites slots meanwhile.
#include <sys/mman.h>
#include <unistd.h>

#include <time.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <random>
#include <thread>
#include <vector>

#include "check.h"
#include "mapped.h"
#include "status.h"

using distore::BatchLayout;
using distore::CopyPool;
using distore::ItemLocation;
using distore::MappedArena;
using distore::MappedItem;
using distore::UcxError;

namespace {

constexpr size_t kArena = size_t{4} << 20;

// A node's arena: a memfd the test writes through one mapping and reads
// through a MappedArena.
struct Arena {
  int fd = -1;
  uint8_t* writable = nullptr;
  Arena() {
    fd = memfd_create("distore-test-arena", 0);
    if (fd < 0 || ftruncate(fd, kArena) != 0) throw std::runtime_error("memfd");
    writable = static_cast<uint8_t*>(
        mmap(nullptr, kArena, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    std::mt19937_64 rng(fd);
    for (size_t i = 0; i < kArena; i += 8) {
      const uint64_t v = rng();
      std::memcpy(writable + i, &v, 8);
    }
  }
  ~Arena() {
    munmap(writable, kArena);
    close(fd);
  }
  void header(uint64_t slot, uint64_t key, uint64_t generation) {
    __atomic_store_n(reinterpret_cast<uint64_t*>(writable + slot), key, __ATOMIC_RELAXED);
    __atomic_store_n(reinterpret_cast<uint64_t*>(writable + slot + 8), generation,
                     __ATOMIC_RELAXED);
  }
};

}  // namespace

TEST(a_mapped_arena_reads_the_nodes_bytes_and_populates_ahead) {
  Arena arena;
  MappedArena mapped(arena.fd, kArena, "node-1", 100);
  CHECK_EQ(mapped.populated(), size_t{2} << 20);  // rounded up to 2 MiB
  CHECK(std::memcmp(mapped.base(), arena.writable, kArena) == 0);
  arena.writable[12345] ^= 0xFF;  // the node writes: the learner sees it
  CHECK_EQ(mapped.base()[12345], arena.writable[12345]);
  mapped.populate_to(kArena + 1);  // never past the arena
  CHECK_EQ(mapped.populated(), kArena);
  CHECK_THROWS(MappedArena(arena.fd, 0, "node-1"), UcxError, "empty arena");
  CHECK_THROWS(MappedArena(-1, 4096, "node-2"), UcxError, "read-only failed");
}

TEST(mapped_gather_copies_every_item_with_and_without_helpers) {
  Arena arena;
  MappedArena mapped(arena.fd, kArena, "node-1");
  const std::vector<const MappedArena*> arenas = {&mapped};
  std::mt19937_64 rng(3);
  for (unsigned helpers : {0u, 2u}) {
    CopyPool pool(helpers);
    for (size_t parallel : {size_t{0}, size_t{1} << 30}) {  // split, or on the caller
      std::vector<MappedItem> items;
      uint64_t at = 0;
      for (int i = 0; i < 40; ++i) {
        const uint64_t length = 16 + rng() % (200 << 10);
        const uint64_t offset = rng() % (kArena - length) / 8 * 8;
        items.push_back({0, offset, length, at});
        at += length;
      }
      std::vector<uint8_t> dest(at);
      std::vector<int32_t> statuses(items.size(), -1);
      distore::mapped_gather(arenas, items.data(), items.size(), dest.data(), dest.size(), &pool,
                             parallel, statuses.data());
      for (size_t i = 0; i < items.size(); ++i) {
        CHECK_EQ(statuses[i], 0);
        CHECK(std::memcmp(dest.data() + items[i].dest_offset, mapped.base() + items[i].offset,
                          items[i].length) == 0);
      }
    }
  }
}

TEST(mapped_gather_refuses_items_out_of_bounds_before_copying) {
  Arena arena;
  MappedArena mapped(arena.fd, kArena, "node-1");
  const std::vector<const MappedArena*> arenas = {&mapped};
  std::vector<uint8_t> dest(4096, 0xAB);
  int32_t statuses[2];
  const std::pair<MappedItem, const char*> bad[] = {
      {{1, 0, 64, 0}, "arena index 1 out of range"},
      {{0, kArena - 32, 64, 0}, "lies outside the mapped arena"},
      {{0, 0, 8, 0}, "lies outside the mapped arena"},  // shorter than a header
      {{0, 0, 64, 4096 - 32}, "destination range exceeds"}};
  for (const auto& [item, message] : bad) {
    const MappedItem items[] = {{0, 0, 64, 0}, item};
    CHECK_THROWS(distore::mapped_gather(arenas, items, 2, dest.data(), dest.size(), nullptr, 0,
                                        statuses),
                 UcxError, message);
    CHECK_EQ(dest[0], 0xAB);  // nothing copied, not even the good item
  }
}

TEST(mapped_gather_located_reads_rows_and_says_which_items_it_could_not) {
  Arena a, b;
  MappedArena ma(a.fd, kArena, "node-3"), mb(b.fd, kArena, "node-5");
  const std::vector<const MappedArena*> arenas = {&ma, &mb};
  const int64_t lut[] = {-1, -1, -1, 0, -1, 1, -1, -1};  // nodes 3, 5 mapped; 7 not
  using Field = BatchLayout::Field;
  const uint64_t n = 6;
  const BatchLayout layout(n, 0, {Field{16, 100, 128}, Field{200, 56, 1024}});
  const uint64_t slots[] = {0, 4096, 8192, 40960, 4096, 12288};
  const uint32_t nodes[] = {3, 5, 3, 7, 3, 99};
  const uint64_t rows[] = {5, 0, 2, 1, 4, 3};
  std::vector<ItemLocation> items;
  for (size_t i = 0; i < n; ++i) {
    Arena& arena = nodes[i] == 5 ? b : a;
    arena.header(slots[i], 1000 + i, 7 + i);
    items.push_back({nodes[i], 0, slots[i], 7 + i, 1000 + i});
  }
  items[4].generation = 99;  // the slot holds another generation: stale
  std::vector<uint8_t> dest(layout.end(), 0xCD);
  CopyPool pool(1);
  std::vector<int32_t> statuses(n, 1);
  distore::mapped_gather_located(arenas, lut, 8, items.data(), n, rows, layout, dest.data(),
                                 dest.size(), &pool, 0, statuses.data());
  CHECK_EQ(statuses, (std::vector<int32_t>{0, 0, 0, distore::kStatusNotMapped,
                                           distore::kStatusStale, distore::kStatusNotMapped}));
  for (size_t i : {0, 1, 2, 4}) {
    const uint8_t* slot = (nodes[i] == 5 ? mb : ma).base() + slots[i];
    CHECK(std::memcmp(dest.data() + layout.header_at(rows[i]), slot, 16) == 0);
    CHECK(std::memcmp(dest.data() + layout.field_at(0, rows[i]), slot + 16, 100) == 0);
    CHECK(std::memcmp(dest.data() + layout.field_at(1, rows[i]), slot + 200, 56) == 0);
  }
  CHECK_EQ(dest[layout.header_at(rows[3])], 0xCD);  // not mapped: its row is untouched
  const ItemLocation outside[] = {{3, 0, kArena - 100, 0, 0}};
  CHECK_THROWS(distore::mapped_gather_located(arenas, lut, 8, outside, 1, rows, layout,
                                              dest.data(), dest.size(), nullptr, 0,
                                              statuses.data()),
               UcxError, "lies outside the mapped arena");
}

TEST(seqlock_never_accepts_a_slot_rewritten_during_its_copy) {
  // A node rewrites 8 slots of 64 KiB over and over, as it writes a slot:
  // an invalid header, the payload (every byte its generation's), the real
  // header, release fences between. Every item a copy accepts (status 0,
  // a real header: neither word 0) must hold its generation's bytes only.
  Arena arena;
  MappedArena mapped(arena.fd, kArena, "node-1");
  const std::vector<const MappedArena*> arenas = {&mapped};
  constexpr uint64_t kSlot = 64 << 10;
  // Each slot whole before the writer starts (it may start late), at a
  // generation below every one the writer gives it: generations never repeat.
  for (uint64_t i = 0; i < 8; ++i) {
    std::memset(arena.writable + i * kSlot + 16, static_cast<int>(i + 1), kSlot - 16);
    arena.header(i * kSlot, 42, i + 1);
  }
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (uint64_t gen = 8; !stop.load(std::memory_order_relaxed); ++gen) {
      const uint64_t slot = (gen % 8) * kSlot;
      arena.header(slot, 0, 0);
      std::atomic_thread_fence(std::memory_order_release);
      std::memset(arena.writable + slot + 16, static_cast<int>(gen & 0xFF), kSlot - 16);
      std::atomic_thread_fence(std::memory_order_release);
      arena.header(slot, 42, gen);
    }
  });
  std::vector<MappedItem> items;
  for (uint64_t i = 0; i < 8; ++i) items.push_back({0, i * kSlot, kSlot, i * kSlot});
  std::vector<uint8_t> dest(8 * kSlot);
  CopyPool pool(1);
  size_t accepted = 0, torn = 0, mixed = 0, other = 0;  // checked once the writer stopped
  for (int round = 0; round < 400; ++round) {
    int32_t statuses[8];
    distore::mapped_gather(arenas, items.data(), 8, dest.data(), dest.size(), &pool,
                           round % 2 ? 0 : SIZE_MAX, statuses);
    for (size_t i = 0; i < 8; ++i) {
      const uint8_t* got = dest.data() + i * kSlot;
      uint64_t key, gen;
      std::memcpy(&key, got, 8);
      std::memcpy(&gen, got + 8, 8);
      if (statuses[i] != 0) {
        ++(statuses[i] == distore::kStatusTorn ? torn : other);
        continue;
      }
      // Caught between writes: the header copied holds a word of the invalid
      // header (0, 0), which no caller asks for (it checks the header
      // against the (key, generation) it sampled): dropped.
      if (key == 0 || gen == 0) continue;
      ++accepted;
      for (uint64_t k = 16; k < kSlot; k += 509) mixed += got[k] != static_cast<uint8_t>(gen);
    }
  }
  stop = true;
  writer.join();
  CHECK_EQ(mixed, size_t{0});
  CHECK_EQ(other, size_t{0});
  CHECK(accepted > 0);
  std::printf("  %zu accepted, %zu torn\n", accepted, torn);
}

TEST(copy_pool_runs_every_part_once_for_two_callers_at_once) {
  CopyPool pool(2);
  CHECK_EQ(pool.helpers(), 2u);
  constexpr size_t kParts = 5000;
  auto batch = [&](std::vector<std::atomic<int>>& seen) {
    for (int round = 0; round < 20; ++round) {
      pool.run(kParts, [&](size_t i) { seen[i].fetch_add(1, std::memory_order_relaxed); });
    }
  };
  std::vector<std::atomic<int>> a(kParts), b(kParts);
  std::thread other([&] { batch(b); });  // finds the helpers taken at times: runs alone
  batch(a);
  other.join();
  for (size_t i = 0; i < kParts; ++i) {
    CHECK_EQ(a[i].load(), 20);
    CHECK_EQ(b[i].load(), 20);
  }
  pool.run(0, [](size_t) { throw std::logic_error("no part to run"); });
}

TEST(copy_pool_helpers_linger_for_the_next_batch_then_sleep) {
  CopyPool pool(2);
  constexpr size_t kParts = 64;
  std::vector<std::atomic<int>> seen(kParts);
  // Batches back to back, a little apart (the helpers still linger), and
  // further apart than kLinger (they sleep and are woken): every part runs
  // once each time.
  const std::chrono::microseconds gaps[] = {std::chrono::microseconds(0),
                                            CopyPool::kLinger / 4, CopyPool::kLinger * 3};
  constexpr int kRounds = 60;
  for (int round = 0; round < kRounds; ++round) {
    pool.run(kParts, [&](size_t i) { seen[i].fetch_add(1, std::memory_order_relaxed); });
    std::this_thread::sleep_for(gaps[round % 3]);
  }
  for (size_t i = 0; i < kParts; ++i) CHECK_EQ(seen[i].load(), kRounds);
  // Idle after a batch, the helpers stop watching once kLinger has passed:
  // the process spends next to no CPU time while it sleeps 300 ms.
  pool.run(kParts, [&](size_t i) { seen[i].fetch_add(1, std::memory_order_relaxed); });
  auto cpu = [] {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;  // ms
  };
  const double before = cpu();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const double spent = cpu() - before;
  std::printf("  %.2f ms of CPU while idle 300 ms\n", spent);
  CHECK(spent < 30.0);
}

TEST(copy_ranges_cuts_large_ranges_over_the_pool) {
  CopyPool pool(2);
  std::vector<uint8_t> src(size_t{10} << 20), dst(src.size());
  std::mt19937_64 rng(8);
  for (auto& x : src) x = static_cast<uint8_t>(rng());
  // Three ranges, one of 8 MiB: pieces of at most 1 MiB spread over 3 threads.
  const size_t off[] = {0, 100, (size_t{1} << 20) + 7}, len[] = {100, (size_t{1} << 20) - 93,
                                                                 size_t{8} << 20};
  std::atomic<size_t> pieces{0}, largest{0};
  distore::copy_ranges(
      &pool, 3, len[0] + len[1] + len[2], 1 << 20, [&](size_t i) { return src.data() + off[i]; },
      [&](size_t i) { return dst.data() + off[i]; }, [&](size_t i) { return len[i]; },
      [&](uint8_t* d, const uint8_t* s, size_t l) {
        std::memcpy(d, s, l);
        ++pieces;
        size_t seen = largest.load();
        while (l > seen && !largest.compare_exchange_weak(seen, l)) {
        }
      });
  CHECK(std::memcmp(dst.data(), src.data(), off[2] + len[2]) == 0);
  CHECK(pieces.load() >= 9);
  CHECK(largest.load() <= size_t{1} << 20);
}
