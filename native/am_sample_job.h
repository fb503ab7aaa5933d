// Samples by active message, the node's side (am_sample.h): what the
// server, its request handler and the batches it sends share. Internal to
// am_sample_server.cc (the server), am_sample_request.cc (reading, checking
// and admitting a request) and am_sample_send.cc (sending a batch).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ucp/api/ucp.h>

#include "am_grant.h"
#include "am_sample.h"
#include "chunk_pool.h"

namespace distore {

struct ServeJob;

struct AmSampleServer::Core {
  ucp_worker_h worker = nullptr;
  unsigned data_id = 0;
  Endpoints endpoints = Endpoints::kReply;
  size_t max_in_flight = 0, max_batches = 0;
  int64_t stall_ns = 0;
  const uint8_t* base = nullptr;  // the arena as registered (read-only where write-protected)
  ucp_mem_h memh = nullptr;       // its registration (the server holds the arena)
  uint64_t size = 0;
  // Runs: a part of several consecutive items of a batch is copied into a
  // chunk of `bounce` and sent as one message (fewer, larger rendezvous;
  // the server holds the region). No bounce region: one message per item.
  std::unique_ptr<ChunkPool> chunks;  // over `bounce`, or none
  ucp_mem_h bounce_memh = nullptr;
  size_t max_run = 1;  // items one message may carry

  struct Link {  // a registered endpoint to one learner
    Endpoint* ep;
    bool open;  // under mu
  };
  std::mutex mu;  // everything below; never held across a UCX call
  // With a key (listen()): requests only on authenticated connections of
  // `conns`, with grants (am_grant.h). Set before the listener exists.
  bool auth = false;
  uint8_t key[kAmKeyBytes] = {};
  AmConnections* conns = nullptr;  // the server's listener's (it outlives the handler)
  // Request state held (bytes), in all and per connection (0: not a
  // listener connection).
  uint64_t held = 0;
  std::unordered_map<uint64_t, uint64_t> held_by;
  std::unordered_map<uint64_t, std::shared_ptr<Link>> links;
  std::unordered_set<ServeJob*> live;  // batches not ended (abandoned ones included)
  bool open = true;
  Stats stats;

  // Under mu: batches whose sends made no progress for stall_ns are
  // abandoned: UCX did not end the sends to a learner that went away (an
  // endpoint without error handling, or one still connecting when the peer
  // died, is never failed by UCX 1.21). They stop counting against
  // max_batches; what they hold is freed if UCX ever ends their sends.
  void sweep();
};

// One request being answered. Touched only under the worker's lock (the
// request handler and send completions run there), except `last_ns`
// (atomic) and `abandoned` (under the core's mutex).
struct ServeJob {
  std::shared_ptr<AmSampleServer::Core> core;
  std::shared_ptr<AmSampleServer::Core::Link> link;  // kRegistered
  ucp_ep_h ep = nullptr;
  uint64_t token = 0, rndv_min = 0;
  uint64_t conn = 0, held = 0;  // its connection, and the bytes it counts against the bounds
  std::vector<AmSamplePart> parts;
  std::vector<AmSampleItem> items;
  // What to send next, in order: part `part` of the run of joined items
  // [pos, end) (at most `per` of them; end found when the run starts),
  // `sub` of them sent. Derived as it goes: a request's state is its items
  // and parts, nothing per (item, part).
  size_t pos = 0, end = 0, per = 1, in_flight = 0;
  uint32_t sub = 0;
  uint16_t part = 0;
  uint64_t sent = 0, bytes = 0, errors = 0, runs = 0, unpacked = 0;
  bool failed = false, pumping = false, no_rndv = false;
  bool abandoned = false;           // under core->mu
  std::atomic<int64_t> last_ns{0};  // when a send was last posted or ended
};

namespace am_sample_detail {

// Posts the job's next messages while fewer than max_in_flight are under
// way; frees the job once the last has ended (am_sample_send.cc).
void pump(ServeJob* j);

// The request handler (AM request_id): `arg` is the handler's
// std::shared_ptr<Core> (am_sample_request.cc).
ucs_status_t on_request(void* arg, const void* header, size_t header_length, void* data,
                        size_t length, const ucp_am_recv_param_t* param);

}  // namespace am_sample_detail
}  // namespace distore
