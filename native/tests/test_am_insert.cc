// Inserts by active message (native/am_insert.h), both ends in one process
// over UCX TCP on loopback: a writer's am_send of a staged batch to a node's
// listening AmInbox, received by pull_am into slots of a write-protected
// arena. Items land whole with their slot headers written after them, one
// item a message or several (runs, through bounce chunks, more runs than
// chunks included); a run that is not its items fails them; messages from
// an endpoint the listener did not accept are refused; a writer that hangs
// mid-batch is force-closed at the pull's timeout, and a batch the node
// discards (its writer went away) ends after a short grace, long before
// the timeout; neither leaves a header claiming a slot. And a node's arena
// is populated (every page made at start) without changing its bytes.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "am_insert.h"
#include "check.h"
#include "status.h"
#include "ucx_env.h"

using distore::AmInbox;
using distore::Endpoint;
using distore::MemoryRegion;
using distore::Owner;
using distore::PullItem;
using distore_test::Progress;
using distore_test::Ucx;
using distore_test::wait_for;

namespace {

constexpr unsigned kAmId = 0x4453;  // protocol.AM_INSERT_ID
constexpr uint64_t kItem = 64 << 10;
constexpr size_t kN = 4;
constexpr uint64_t kHeader = 16;
constexpr size_t kArena = 1 << 20;
constexpr uint64_t kStaleKey = 999;

uintptr_t handle(const void* p) { return reinterpret_cast<uintptr_t>(p); }

// A node (its inbox listening on a worker a thread progresses, as a node's
// reader ticks) and a writer with a staging buffer of random bytes and an
// endpoint to the listener. The writer's worker is progressed by a thread
// too unless `writer_ticks` is false (a writer that hangs once it posted).
// Members go in reverse: the endpoint first (its forced close ends its
// sends), then the threads, the inbox, the regions, the workers.
struct Sides {
  Ucx rx, tx;
  std::unique_ptr<MemoryRegion> arena;
  MemoryRegion dest, staging;
  AmInbox inbox;
  uint16_t port;
  Progress rx_ticks;
  std::unique_ptr<Progress> tx_ticks;
  std::unique_ptr<Endpoint> ep;

  explicit Sides(bool writer_ticks = true)
      : arena(MemoryRegion::write_protected(Owner(), handle(rx.context()), kArena, false)),
        dest(Owner(), handle(rx.context()), arena->local_address(), arena->size(), Owner(), 0),
        staging(Owner(), handle(tx.context()), kArena, false, false),
        inbox(Owner(), handle(rx.worker()), kAmId, 1 << 16),
        port(inbox.listen("127.0.0.1", 0, 64)),
        rx_ticks(rx.worker()),
        tx_ticks(writer_ticks ? new Progress(tx.worker()) : nullptr) {
    std::mt19937 rng(7);
    auto* s = reinterpret_cast<uint8_t*>(staging.address());
    for (size_t i = 0; i < kArena; ++i) s[i] = static_cast<uint8_t>(rng());
    ep.reset(new Endpoint(Endpoint::ToListener{}, Owner(), handle(tx.worker()), "127.0.0.1",
                          port, "rx"));
    CHECK_EQ(ep->flush(10.0), int{UCS_OK});  // connected
  }

  uint8_t* base() const { return reinterpret_cast<uint8_t*>(arena->local_address()); }
  const uint8_t* staged(uint64_t offset) const {
    return reinterpret_cast<const uint8_t*>(staging.address()) + offset;
  }

  // Sends n items of `item` bytes, back to back from the staging buffer.
  void send(uint64_t token, size_t n, uint64_t item, uint64_t run_bytes) {
    std::vector<uint64_t> offsets(n), lengths(n, item);
    for (size_t i = 0; i < n; ++i) offsets[i] = i * item;
    distore::am_send(*ep, staging, kAmId, token, offsets.data(), lengths.data(), n, run_bytes);
  }
};

// One pull of batch `token` into slots 0..n-1 (of kHeader + item bytes),
// which first hold 0xAB and a stale header; expects `length` bytes an item.
struct Pull {
  std::vector<PullItem> items;
  std::vector<int32_t> statuses;
  uint64_t slot;

  Pull(Sides& s, size_t n, uint64_t item, uint64_t length)
      : items(n), statuses(n, 1), slot(kHeader + item) {
    CHECK(n * slot <= kArena);
    for (size_t i = 0; i < n; ++i) {
      std::memset(s.base() + i * slot, 0xAB, slot);
      distore::store_header(s.base(), i * slot, kStaleKey, kStaleKey);
      items[i] = PullItem{i * slot, 0, length, 100 + i, 7 + i};
    }
  }
  void run(Sides& s, uint64_t token, double timeout_s) {
    distore::pull_am(*s.arena, s.dest, s.inbox, token, items.data(), items.size(), timeout_s,
                     statuses.data());
  }
  uint64_t key(const Sides& s, size_t i) const {
    uint64_t k;
    std::memcpy(&k, s.base() + items[i].slot_offset, 8);
    return k;
  }
  uint64_t generation(const Sides& s, size_t i) const {
    uint64_t g;
    std::memcpy(&g, s.base() + items[i].slot_offset + 8, 8);
    return g;
  }
  // Every item landed: its bytes are the staged ones and its header is real.
  void check_landed(const Sides& s) const {
    CHECK_EQ(statuses, std::vector<int32_t>(items.size(), UCS_OK));
    for (size_t i = 0; i < items.size(); ++i) {
      CHECK_EQ(key(s, i), items[i].key);
      CHECK_EQ(generation(s, i), items[i].generation);
      const uint8_t* got = s.base() + items[i].slot_offset + kHeader;
      CHECK(std::memcmp(got, s.staged(i * items[i].length), items[i].length) == 0);
    }
  }
  // Every item failed (never with `not_this`), and no header claims its slot.
  void check_failed(const Sides& s, int32_t not_this) const {
    for (size_t i = 0; i < items.size(); ++i) {
      CHECK(statuses[i] != UCS_OK);
      CHECK(statuses[i] != not_this);
      CHECK_EQ(key(s, i), uint64_t{0});
      CHECK_EQ(generation(s, i), uint64_t{0});
    }
  }
};

// A worker's packed address, as Endpoint takes it.
std::string address_of(ucp_worker_h worker) {
  ucp_address_t* a = nullptr;
  size_t length = 0;
  CHECK_EQ(ucp_worker_get_address(worker, &a, &length), UCS_OK);
  std::string out(reinterpret_cast<const char*>(a), length);
  ucp_worker_release_address(worker, a);
  return out;
}

}  // namespace

TEST(a_batch_lands_in_its_slots_and_only_the_listeners_connections_may_send) {
  Sides s;
  Pull p(s, kN, kItem, kItem);
  s.send(11, kN, kItem, 0);
  p.run(s, 11, 30.0);
  p.check_landed(s);
  CHECK_EQ(s.inbox.waiting(), size_t{0});
  CHECK_EQ(s.inbox.chunk_pool().made(), size_t{0});  // one item a message: no bounce
  auto c = s.inbox.connections();
  CHECK_EQ(c.accepted, uint64_t{1});
  CHECK_EQ(c.open, uint64_t{1});
  CHECK_EQ(s.inbox.refused(), uint64_t{0});

  // An endpoint made from the node's worker address (not the listener's):
  // every message is refused on arrival, none kept.
  Endpoint plain(Owner(), handle(s.tx.worker()), address_of(s.rx.worker()), false, "rx");
  std::vector<uint64_t> offsets{0, kItem}, lengths{kItem, kItem};
  distore::am_send(plain, s.staging, kAmId, 12, offsets.data(), lengths.data(), 2, 0);
  CHECK(wait_for([&] { return s.inbox.refused() == 2; }, 20.0));
  CHECK_EQ(s.inbox.waiting(), size_t{0});
  plain.close(false, 5.0);

  // The listener's connection serves on.
  Pull again(s, kN, kItem, kItem);
  s.send(13, kN, kItem, 0);
  again.run(s, 13, 30.0);
  again.check_landed(s);
  CHECK(s.ep->alive());
}

TEST(runs_land_through_bounce_chunks_and_a_run_that_is_not_its_items_fails_them) {
  Sides s;
  {  // Two runs of two items: each received into a chunk, copied to its slots.
    Pull p(s, kN, kItem, kItem);
    s.send(21, kN, kItem, 2 * kItem);
    p.run(s, 21, 30.0);
    p.check_landed(s);
    const size_t made = s.inbox.chunk_pool().made();
    CHECK(made >= 1 && made <= 2);
    CHECK_EQ(s.inbox.waiting(), size_t{0});
  }
  {  // The node expects shorter items than the runs carry: every item fails.
    Pull p(s, kN, kItem, kItem - 8);
    s.send(22, kN, kItem, 2 * kItem);
    p.run(s, 22, 30.0);
    CHECK_EQ(p.statuses, std::vector<int32_t>(kN, UCS_ERR_MESSAGE_TRUNCATED));
    p.check_failed(s, UCS_OK);
    CHECK_EQ(s.inbox.waiting(), size_t{0});
  }
  {  // 64 items of 4 KiB in 32 runs, all arrived before the pull: twice the
     // chunks a pull may have out, so half the runs wait for a chunk.
    const size_t n = 64;
    const uint64_t item = 4096;
    Pull p(s, n, item, item);
    s.send(23, n, item, 2 * item);
    CHECK(wait_for([&] { return s.inbox.waiting() == n / 2; }, 20.0));
    p.run(s, 23, 30.0);
    p.check_landed(s);
    CHECK_EQ(s.inbox.chunk_pool().made(), AmInbox::kMaxChunks);  // no more than may be out
    CHECK_EQ(s.inbox.waiting(), size_t{0});
  }
  CHECK_EQ(s.inbox.refused(), uint64_t{0});
}

TEST(a_writer_that_hangs_mid_batch_is_closed_by_force_at_the_pulls_timeout) {
  Sides s(false);
  s.send(31, kN, kItem, 0);
  // The writer's worker moves only here: enough to post the batch's messages.
  CHECK(wait_for([&] { return s.inbox.waiting() == kN; }, 20.0, s.tx.worker()));
  Pull p(s, kN, kItem, kItem);
  const auto start = std::chrono::steady_clock::now();
  p.run(s, 31, 1.0);  // the receives start; the writer never answers
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  p.check_failed(s, UCS_OK);
  CHECK(took < 20.0);  // the forced close ended them (kAbortWait is 5 s)
  auto c = s.inbox.connections();
  CHECK_EQ(c.aborted, uint64_t{1});
  CHECK_EQ(c.open, uint64_t{0});
  CHECK_EQ(s.inbox.abandoned(), uint64_t{0});
  // The writer, progressed again, sees its connection gone.
  CHECK(wait_for([&] { return !s.ep->alive(); }, 20.0, s.tx.worker()));
}

TEST(a_batch_whose_writer_went_away_ends_once_the_node_discards_it) {
  // The node discards a batch when its writer's control connection closes.
  // (A forced close of the writer's endpoint in this process does not reach
  // the node's UCX as a failure, as a killed writer's reset does:
  // tests/integration/test_am_insert_kills.py kills real processes.)
  Sides s(false);
  s.send(41, kN, kItem, 0);
  CHECK(wait_for([&] { return s.inbox.waiting() == kN; }, 20.0, s.tx.worker()));
  Pull p(s, kN, kItem, kItem);
  std::atomic<bool> done{false};
  std::thread puller([&] {
    p.run(s, 41, 60.0);
    done = true;
  });
  // The pull took every message (its receives are under way); the writer,
  // which never answered them, goes, and the node discards its batch.
  const bool taken = wait_for([&] { return s.inbox.waiting() == 0; }, 20.0);
  s.ep->close(true, 5.0);
  s.inbox.discard(41, kN);
  const bool ended = wait_for([&] { return done.load(); }, 30.0);
  puller.join();  // at the latest at the pull's timeout
  CHECK(taken);
  CHECK(ended);  // long before the timeout: a grace, then a forced close
  p.check_failed(s, UCS_ERR_TIMED_OUT);
  CHECK(s.inbox.discarded(41));
  auto c = s.inbox.connections();
  CHECK_EQ(c.aborted, uint64_t{1});
  CHECK_EQ(c.open, uint64_t{0});
  CHECK_EQ(s.inbox.abandoned(), uint64_t{0});
  // Late messages of the discarded batch are released on arrival.
  CHECK_EQ(s.inbox.expire(60.0), size_t{0});
  CHECK_EQ(s.inbox.waiting(), size_t{0});
}

// Pages of [p, p + n) the kernel holds (mincore).
static size_t resident_pages(const uint8_t* p, size_t n) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  std::vector<unsigned char> in((n + page - 1) / page);
  CHECK_EQ(mincore(const_cast<uint8_t*>(p), n, in.data()), 0);
  size_t count = 0;
  for (unsigned char c : in) count += c & 1;
  return count;
}

TEST(populate_makes_every_page_of_an_arena_and_keeps_its_bytes) {
  Ucx ucx;
  std::unique_ptr<MemoryRegion> arena(
      MemoryRegion::write_protected(Owner(), handle(ucx.context()), kArena, false));
  auto* rw = reinterpret_cast<uint8_t*>(arena->local_address());
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  rw[5000] = 42;  // one page (the second) written before
  CHECK_EQ(resident_pages(rw, kArena), size_t{1});
  CHECK_EQ(arena->populate(kArena, 10), 0);  // past the end: nothing
  CHECK_EQ(arena->populate(3 * page + 1, 1), 0);  // one more page, from an unaligned offset
  CHECK_EQ(resident_pages(rw, kArena), size_t{2});
  CHECK_EQ(arena->populate(0, kArena + 12345), 0);  // clipped to the region
  CHECK_EQ(resident_pages(rw, kArena), kArena / page);
  CHECK_EQ(int{rw[5000]}, 42);
  CHECK_EQ(int{rw[0]}, 0);
  CHECK_EQ(int{rw[kArena - 1]}, 0);
}
