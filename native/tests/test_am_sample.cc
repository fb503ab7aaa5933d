// Samples by active message (native/am_sample.h), both ends in one process
// over UCX TCP on loopback: a node's AmSampleServer over a write-protected
// arena of patterned slots, on a worker a thread progresses, listening; a
// learner's AmSampleClient on a worker only its fetch progresses, with an
// endpoint to the listener. Every field of every item lands in its row of
// the learner's dense arrays and the slot header beside it, one item a
// message or in runs from the node's bounce chunks; a request outside the
// arena is refused whole (its items fail, no row claims an item), malformed
// requests are refused, and the node serves on.
#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "am_insert.h"  // am_send_raw
#include "am_sample.h"
#include "check.h"
#include "layout.h"
#include "pull.h"
#include "status.h"
#include "ucx_env.h"

using distore::AmSampleClient;
using distore::AmSampleServer;
using distore::BatchLayout;
using distore::Endpoint;
using distore::MemoryRegion;
using distore::Owner;
using distore_test::Progress;
using distore_test::Ucx;
using distore_test::wait_for;

namespace {

// A slot: header, obs (20000 bytes: by rendezvous), reward (4), padding,
// step (8); the two small fields go eagerly.
constexpr uint64_t kObs = 20000;
constexpr uint64_t kSlot = 16 + kObs + 16;
constexpr size_t kSlots = 32;
constexpr size_t kRows = 16;
constexpr uint64_t kRndvMin = 8192;
const std::vector<uint64_t> kSrc{16, 16 + kObs, 16 + kObs + 8};
const std::vector<uint64_t> kLength{kObs, 4, 8};

uintptr_t handle(const void* p) { return reinterpret_cast<uintptr_t>(p); }

uint64_t key_of(size_t slot) { return slot + (uint64_t(1) << 40); }
uint64_t generation_of(size_t slot) { return slot * 3 + 1; }

// A node: its arena's slots hold random bytes under their headers; with
// `chunk_bytes`, a bounce region of 8 chunks for runs.
struct Node {
  Ucx ucx;
  std::unique_ptr<MemoryRegion> arena, bounce;
  std::unique_ptr<AmSampleServer> server;
  uint16_t port = 0;
  std::unique_ptr<Progress> ticks;

  explicit Node(size_t chunk_bytes)
      : arena(MemoryRegion::write_protected(Owner(), handle(ucx.context()), kSlot * kSlots,
                                            false)) {
    auto* base = reinterpret_cast<uint8_t*>(arena->local_address());
    std::mt19937 rng(11);
    for (size_t i = 0; i < kSlot * kSlots; ++i) base[i] = static_cast<uint8_t>(rng());
    for (size_t s = 0; s < kSlots; ++s) distore::store_header(base, s * kSlot, key_of(s), generation_of(s));
    if (chunk_bytes != 0) {
      bounce.reset(new MemoryRegion(Owner(), handle(ucx.context()), 8 * chunk_bytes, false,
                                    false));
    }
    server.reset(new AmSampleServer(Owner(), handle(ucx.worker()), Owner(), *arena,
                                    distore::kAmSampleRequestId, distore::kAmSampleDataId,
                                    AmSampleServer::Endpoints::kReply, 16, 256, 10.0, Owner(),
                                    bounce.get(), chunk_bytes));
    port = server->listen("127.0.0.1", 0, 64);
    ticks.reset(new Progress(ucx.worker()));
  }
  ~Node() {
    ticks.reset();  // the server's close progresses the worker itself
    server->close(5.0);
  }
  const uint8_t* slot(size_t s) const {
    return reinterpret_cast<const uint8_t*>(arena->local_address()) + s * kSlot;
  }
};

// A learner: a destination laid out as a header array and one dense array
// a field, a client and an endpoint to the node's listener.
struct Learner {
  Ucx ucx;
  BatchLayout layout;
  MemoryRegion dest;
  AmSampleClient client;
  std::unique_ptr<Endpoint> ep;
  std::vector<int32_t> statuses;

  explicit Learner(const Node& node)
      : layout(kRows, 0,
               {{kSrc[0], kLength[0], kRows * 16},
                {kSrc[1], kLength[1], kRows * (16 + kObs)},
                {kSrc[2], kLength[2], kRows * (16 + kObs + 4)}}),
        dest(Owner(), handle(ucx.context()), layout.end(), false, false),
        client(Owner(), handle(ucx.worker()), distore::kAmSampleRequestId,
               distore::kAmSampleDataId, 0),
        ep(new Endpoint(Endpoint::ToListener{}, Owner(), handle(ucx.worker()), "127.0.0.1",
                        node.port, "node")) {
    CHECK_EQ(ep->flush(10.0), int{UCS_OK});  // connected
  }
  ~Learner() {
    ep.reset();
    client.close();
  }
  uint8_t* base() const { return reinterpret_cast<uint8_t*>(dest.local_address()); }

  // Slot slots[r] into row r; the buffer first holds 0xAB (what a failed
  // row must not keep claiming).
  void fetch(const std::vector<uint64_t>& slots) {
    std::memset(base(), 0xAB, layout.end());
    const size_t n = slots.size();
    std::vector<uint32_t> node(n, 0);
    std::vector<uint64_t> offsets(n), rows(n);
    for (size_t r = 0; r < n; ++r) offsets[r] = slots[r] * kSlot;
    std::iota(rows.begin(), rows.end(), 0);
    statuses.assign(n, 1);
    client.fetch({ep.get()}, node.data(), offsets.data(), nullptr, kSlot, rows.data(), n,
                 layout, dest, 20.0, kRndvMin, 0.0, statuses.data());
  }
  uint64_t header(size_t row, size_t word) const {
    uint64_t v;
    std::memcpy(&v, base() + layout.header_at(row) + 8 * word, 8);
    return v;
  }
  // Row r holds slot slots[r]: its header and every field's bytes.
  void check_rows(const Node& node, const std::vector<uint64_t>& slots) const {
    CHECK_EQ(statuses, std::vector<int32_t>(slots.size(), UCS_OK));
    for (size_t r = 0; r < slots.size(); ++r) {
      CHECK_EQ(header(r, 0), key_of(slots[r]));
      CHECK_EQ(header(r, 1), generation_of(slots[r]));
      for (size_t k = 0; k < kSrc.size(); ++k) {
        CHECK(std::memcmp(base() + layout.field_at(k, r), node.slot(slots[r]) + kSrc[k],
                          kLength[k]) == 0);
      }
    }
  }
};

std::vector<uint64_t> some_slots(unsigned seed) {
  std::vector<uint64_t> all(kSlots);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), std::mt19937(seed));
  all.resize(kRows);
  return all;
}

}  // namespace

TEST(every_field_lands_in_its_row_one_item_a_message_and_in_runs) {
  for (const bool runs : {false, true}) {
    Node node(runs ? 1 << 20 : 0);
    Learner learner(node);
    for (unsigned k = 0; k < 2; ++k) {
      const std::vector<uint64_t> slots = some_slots(k);
      learner.fetch(slots);
      learner.check_rows(node, slots);
    }
    // The node's sends end after the learner has its bytes.
    CHECK(wait_for([&] { return node.server->stats().batches_done == 2; }, 20.0));
    const AmSampleServer::Stats stats = node.server->stats();
    CHECK_EQ(stats.in_flight, uint64_t{0});
    CHECK_EQ(stats.batches_failed, uint64_t{0});
    CHECK_EQ(stats.refused, uint64_t{0});
    if (runs) {  // 16 rows in a row: each field of a batch in one message
      CHECK_EQ(stats.messages, uint64_t{2 * 3});
      CHECK_EQ(stats.runs, uint64_t{2 * 3});
    } else {
      CHECK_EQ(stats.messages, uint64_t{2 * kRows * 3});
      CHECK_EQ(stats.runs, uint64_t{0});
    }
    const AmSampleClient::Stats mine = learner.client.stats();
    CHECK_EQ(mine.batches, uint64_t{2});
    CHECK_EQ(mine.malformed, uint64_t{0});
    CHECK_EQ(mine.late, uint64_t{0});
    CHECK(node.server->close(10.0));  // no batch left to send
  }
}

TEST(refused_and_malformed_requests_fail_and_the_node_serves_on) {
  Node node(0);
  Learner learner(node);
  std::vector<uint64_t> slots = some_slots(3);
  slots[5] = kSlots;  // one slot past the arena: the whole request is refused
  learner.fetch(slots);
  CHECK_EQ(learner.statuses, std::vector<int32_t>(kRows, distore::kStatusOutOfBounds));
  for (size_t r = 0; r < kRows; ++r) {  // no failed row claims an item
    CHECK_EQ(learner.header(r, 0), uint64_t{0});
    CHECK_EQ(learner.header(r, 1), uint64_t{0});
  }
  CHECK_EQ(node.server->stats().refused, uint64_t{1});
  CHECK_EQ(learner.client.stats().refused, uint64_t{1});

  // Requests no learner's fetch makes, sent raw (without the reply flag:
  // nothing to answer on). A header of another version, one whose data is
  // not its items and parts, one of the wrong size: each refused, unread.
  distore::AmSampleRequest q{};
  q.version = 99;
  q.token = 77;
  const auto raw = [&](const distore::AmSampleRequest& h, const std::string& data) {
    const std::string header(reinterpret_cast<const char*>(&h), sizeof(h));
    return distore::am_send_raw(*learner.ep, distore::kAmSampleRequestId, header, data, 1,
                                true, 10.0);
  };
  CHECK_EQ(raw(q, ""), size_t{1});
  q.version = distore::kAmSampleVersion;
  q.items = 2;
  q.parts = 1;
  CHECK_EQ(raw(q, std::string(10, 'x')), size_t{1});
  CHECK_EQ(distore::am_send_raw(*learner.ep, distore::kAmSampleRequestId, "short", "", 1, true,
                                10.0),
           size_t{1});
  CHECK(wait_for([&] { return node.server->stats().refused == 4; }, 20.0));
  CHECK_EQ(node.server->stats().requests, uint64_t{0});

  slots[5] = 5;
  learner.fetch(slots);
  learner.check_rows(node, slots);
  CHECK_EQ(node.server->stats().requests, uint64_t{1});
  const AmSampleClient::Stats mine = learner.client.stats();
  CHECK_EQ(mine.malformed, uint64_t{0});
  CHECK_EQ(mine.late, uint64_t{0});  // no answer to the raw requests came
  CHECK_EQ(mine.refused, uint64_t{1});
}
