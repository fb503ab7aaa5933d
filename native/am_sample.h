// Samples carried by UCX active messages with rendezvous, where UCX
// emulates RMA in software (TCP): the learner says where each item goes,
// the node sends it.
//
// The learner sends each node one small request (AM `request_id`, eager):
// a batch token and, per item, its slot's offset in the node's arena; the
// parts of a slot to send (the fields of the table's spec: offset in the
// slot, length) are listed once. The node's handler, on the thread that
// progresses its worker, posts one message per (item, part) (AM `data_id`;
// header: token, item, part and the slot header as read when posted; data:
// the part's bytes straight from the arena, rendezvous forced for parts of
// `rndv_min` bytes and more, so that with UCX_RNDV_SCHEME=put_zcopy the
// bytes go from the arena into the learner's memory with no copy of UCX's
// own). At most `max_in_flight` messages of a batch are in flight; the
// next ones are posted as those complete.
//
// Runs: items the request marks `joined` go to the rows right after the
// previous item's, so a part of such a run is one contiguous stretch of
// the learner's dense array. The node copies that part of up to
// kAmSampleMaxRun of them (as many as fit a chunk of its bounce region)
// into a chunk and sends them as one message whose header carries each
// item's slot header: over TCP every rendezvous costs both sides a
// handshake and several system calls, so 110 KB items move in ~1 MiB
// messages at about twice the rate, for one memcpy on the node (UCX's
// rendezvous takes no iov: an iov send falls back to copying fragments).
// Without a free chunk a run goes item by item from the arena. The learner's handler receives
// each part straight into its row of the part's dense array in the
// learner's registered destination (ucp_am_recv_data_nbx: a contiguous
// receive, as UCX's zero-copy rendezvous needs; an iov receive would make
// UCX fall back to copying fragments); the slot header goes to the
// layout's header array when every part of the item has landed, for the
// caller to check against the (key, generation) it asked for, as after a
// get.
//
// Where the node answers (the endpoint mode, `AmSampleServer::Endpoints`):
//   kReply       on the endpoint the request came on (UCP_AM_SEND_FLAG_REPLY):
//                the endpoint the node's listener accepted when the learner
//                connected through it (listen(); Endpoint.to_listener), with
//                peer-failure handling, or the node's end of a learner's
//                worker-address endpoint, with the error handling mode the
//                learner chose for it;
//   kRegistered  on an endpoint the node made to that learner itself and
//                registered under the learner's client id (set_peer). UCX
//                refuses two endpoints between the same two workers whose
//                error handling differs: it must match the learner's.
// Which endpoints keep the zero-copy rendezvous over TCP: those without
// peer-failure handling, and those with it made through a listener (a
// connection-manager lane; am_connections.h); worker-address endpoints with
// it make UCX send eagerly through bounce buffers. perf/am_sample_native.py
// measures both. Learners connect through the listener: peer-failure
// handling and zero copy at once.
//
// Who may read (with a key: listen()'s; am_grant.h): a request is served
// only on a listener connection that authenticated (am_connections.h), and
// only whole: every item must carry the grant the control plane gave for
// its slot and the request's slot size, and every part must lie inside
// that slot, the parts together no larger than it; else the request is
// refused (UCS_ERR_REJECTED) and its connection closed. Requests that
// come any other way (another endpoint to the worker) are dropped unread.
// What a request makes the node hold is bounded in bytes: its items and
// parts (24 and 16 bytes each; what to send next is derived from them, not
// listed), at most kMaxHeldBytes for the node and kMaxHeldBytesPerPeer for
// one connection, abandoned batches included (else UCS_ERR_BUSY).
//
// A learner that dies mid-batch fails the node's sends, and the batch's
// state is freed when its last send ends; the listener's connection to it
// is closed by reap(). Sends name the arena's own registration: a
// rendezvous aborted on a failed endpoint then ends at once, where one
// sent from memory UCX registered through its cache first invalidates that
// registration, which UCX 1.21 does not always finish (the batch never
// ended) and, with the cache off, crashes in. UCX does not always end
// sends on an endpoint without peer-failure handling whose peer died
// before answering a rendezvous (its maintainers disable rendezvous with
// error handling for that reason, openucx/ucx#6721). So a batch whose
// sends made no progress for `stall_s` is abandoned (Core::sweep): it
// stops counting against max_batches, and what it holds (its state, UCX's
// requests, never a slot) is freed if UCX ever ends its sends. Nothing on
// the node waits for it; the node serves on.
//
// A node that stops answering (a stopped process, a cut link) leaves the
// learner's fetch without progress: after `stall_s` of none it fails the
// node's items and force-closes the endpoints with error handling of the
// nodes it still waits for, as the gather does with gets (gather.h).
//
// Ownership: the server holds its worker and arena (their owners, owner.h:
// the Python objects), owns
// its listener and connections, and shares its state with the batches it
// serves, which hold it until their last send ends; close() unregisters the
// handler, closes the connections (their sends end with an error) and
// waits for the batches (an arena with sends still pending after close's
// timeout is kept mapped for good rather than freed under UCX). The client holds its worker; a fetch
// never returns while a receive may still write into its destination.
// Thread safety: handlers and completions run on whichever thread
// progresses the worker; every other method may be called from any thread
// without the GIL (set_peer/drop_peer with it). One client per worker (it
// owns the worker's handler for `data_id`); any number of threads may fetch
// through it at once (batches are told apart by their tokens); close waits
// for the fetches under way.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <ucp/api/ucp.h>

#include "am_connections.h"
#include "endpoint.h"
#include "layout.h"
#include "memory.h"
#include "owner.h"

namespace distore {

// Active message ids (protocol.AM_INSERT_ID is 0x4453, "DS").
constexpr unsigned kAmSampleRequestId = 0x4454;
constexpr unsigned kAmSampleDataId = 0x4455;
constexpr uint32_t kAmSampleVersion = 3;
// Limits of one request, checked on both sides.
constexpr uint32_t kAmSampleMaxItems = 1u << 16;
constexpr uint32_t kAmSampleMaxParts = 256;
// Most items one message may carry (a run's slot headers travel in its
// message header: 24 + 16 bytes each).
constexpr uint32_t kAmSampleMaxRun = 64;
// Bytes of request state (items and parts of the batches being sent,
// abandoned ones included) a node holds at most, and for one connection.
constexpr uint64_t kMaxHeldBytes = 64ull << 20;
constexpr uint64_t kMaxHeldBytesPerPeer = 16ull << 20;

// Wire formats (little-endian, as both ends are x86-64 or aarch64).
struct AmSampleRequest {  // header of a request message
  uint32_t version;
  uint32_t node;      // the learner's number for this node: echoed in a refusal
  uint64_t token;     // the batch, chosen by the learner
  uint64_t client;    // the learner's client id (kRegistered)
  uint32_t items;
  uint32_t parts;
  uint64_t rndv_min;   // parts of at least this many bytes go by rendezvous
  uint64_t slot_size;  // the slots' size, which the items' grants name
};
struct AmSamplePart {  // request data: `parts` of these, then `items` AmSampleItem
  uint64_t src;        // offset in a slot (the slot header included)
  uint64_t length;
};
struct AmSampleItem {
  uint64_t slot;   // offset of the slot in the arena
  uint32_t index;  // the item in the learner's batch
  uint32_t joined; // 1: this item's rows follow the previous item's (a run), else 0
  uint32_t tag;    // the control plane's grant for the slot (am_grant.h)
  uint32_t reserved;
};
// Header of each data message: this, then one AmSampleSlotHeader per item
// it carries (`count` of them; a refusal carries none). A message carries a
// part of `count` consecutive items of the batch: the learner's rows for
// them are consecutive (the request joined them), so the bytes land in one
// contiguous stretch of the part's dense array.
struct AmSampleReply {
  uint64_t token;
  uint32_t index;  // the batch's first item carried; the node (request.node) in a refusal
  uint16_t part;
  uint16_t flags;  // kAmSampleRefused
  uint32_t count;  // items carried (1..kAmSampleMaxRun); 0 in a refusal
  uint32_t reserved;
  uint64_t status;  // a refusal's status (0 otherwise)
};
struct AmSampleSlotHeader {  // a slot header as read when its message was made
  uint64_t key;
  uint64_t generation;
};
constexpr uint16_t kAmSampleRefused = 1;

class AmSampleServer {
 public:
  enum class Endpoints { kReply, kRegistered };

  struct Core;  // shared with the batches in flight (am_sample_job.h)

  // Registers the request handler for AM `request_id` on the worker
  // (`worker_handle`, kept alive by `worker`); sends parts of `arena` (its
  // registered, remote-readable address; `arena_owner` keeps it) as AM
  // `data_id`. At most `max_in_flight` messages per batch, `max_batches`
  // batches at a time (more are refused: the learner sees UCS_ERR_BUSY); a
  // batch whose sends made no progress for `stall_s` stops counting (Core::sweep).
  // `bounce` (null, or a MemoryRegion cut into chunks of `chunk_bytes`,
  // kept by `bounce_owner`): a part of up to kAmSampleMaxRun joined items
  // that fit one chunk is copied there and sent as one message; null sends
  // each item's part from the arena alone.
  AmSampleServer(Owner worker, uintptr_t worker_handle, Owner arena_owner,
                 const MemoryRegion& arena, unsigned request_id, unsigned data_id,
                 Endpoints endpoints, size_t max_in_flight, size_t max_batches,
                 double stall_s, Owner bounce_owner, const MemoryRegion* bounce,
                 size_t chunk_bytes);
  ~AmSampleServer();
  AmSampleServer(const AmSampleServer&) = delete;
  AmSampleServer& operator=(const AmSampleServer&) = delete;

  // kRegistered: answer learner `client` on `ep` (GIL held; `keep` holds
  // it until drop_peer, or the server goes).
  void set_peer(uint64_t client, Endpoint* ep, Owner keep);
  // Stops posting to learner `client` (its batches in flight fail); GIL held.
  void drop_peer(uint64_t client);

  // Listens on `host`:`port` (port 0: any free one) for learners'
  // connections (Endpoint.to_listener), at most `max_connections` at once;
  // requests on them are answered on them (kReply). With `key` (the node's,
  // am_grant.h), connections must authenticate and requests carry grants
  // (see above); empty: any connection is served. Returns the port.
  // Throws UcxError if it listens already, is closed, or UCX cannot listen.
  uint16_t listen(const std::string& host, uint16_t port, size_t max_connections,
                  const std::string& key = "");
  // Closes the connections of learners that failed or left; how many.
  size_t reap(double timeout_s);
  // The listener's connection counts (all 0 when not listening).
  AmConnections::Counts connections() const;

  struct Stats {
    uint64_t requests = 0;   // requests accepted
    uint64_t refused = 0;    // requests refused (malformed, out of bounds, busy, no endpoint)
    uint64_t unauthorized = 0;  // of those, from no authenticated connection or without grants
    uint64_t held_bytes = 0;    // request state held now (kMaxHeldBytes)
    uint64_t batches_done = 0;
    uint64_t batches_failed = 0;  // a send failed (the learner went away)
    uint64_t messages = 0;        // messages whose send completed
    uint64_t bytes = 0;
    uint64_t send_errors = 0;
    uint64_t in_flight = 0;  // batches being sent now
    uint64_t abandoned = 0;  // batches given up after `stall_s` without progress
    uint64_t stuck = 0;      // of those, batches whose sends UCX has not ended yet
    uint64_t runs = 0;       // messages that carried several items (from a bounce chunk)
    uint64_t unpacked = 0;   // runs sent item by item: no bounce chunk was free
  };
  Stats stats() const;

  // Unregisters the handler and closes the listener's connections
  // (idempotent), then progresses the worker up to `timeout_s` while
  // batches are still being sent; true if none is left.
  bool close(double timeout_s);

 private:
  AmConnections* connections_ptr() const;

  Owner worker_;
  Owner arena_;
  Owner bounce_;  // of the MemoryRegion runs are packed into (an empty one: none)
  std::shared_ptr<Core> core_;
  std::shared_ptr<Core>* handler_arg_ = nullptr;  // the handler's hold on core_
  unsigned request_id_ = 0;
  std::unordered_map<uint64_t, Owner> peers_;  // kRegistered; GIL held
  bool closed_ = false;
  // Made by listen(), closed by close(), kept until the server goes (UCX's
  // callbacks on its endpoints name it). conns_mu_ guards the pointer only.
  mutable std::mutex conns_mu_;
  std::unique_ptr<AmConnections> conns_;
};

class AmSampleClient {
 public:
  // Registers the reply handler for AM `data_id` on the worker
  // (`worker_handle`, kept alive by `worker`; where the endpoints to the
  // nodes live); requests go as AM `request_id` naming `client_id`.
  AmSampleClient(Owner worker, uintptr_t worker_handle, unsigned request_id, unsigned data_id,
                 uint64_t client_id);
  ~AmSampleClient();
  AmSampleClient(const AmSampleClient&) = delete;
  AmSampleClient& operator=(const AmSampleClient&) = delete;

  // One batch: item i (slot at slot_offset[i] in the arena of node
  // eps[node[i]], of `slot_size` bytes, granted by tags[i]: the control
  // plane's, protocol.ITEM_LOCATION's `pad`; tags may be null where the
  // nodes ask for none) lands in row rows[i] of `layout` in `dest` (host memory:
  // headers and eagerly sent fields are copied by the CPU): each field in
  // its dense array, straight from the node; its slot header, once every
  // part has landed, in the header array ((0, 0) for an item that failed).
  // Sends one request per node, then progresses the worker until every
  // part has landed or failed. statuses[i]: UCS_OK, or why not:
  // UCS_ERR_TIMED_OUT (nothing came within `timeout_s`), the endpoint's
  // failure, a node's refusal (UCS_ERR_BUSY, kStatusOutOfBounds...),
  // UCS_ERR_MESSAGE_TRUNCATED, kStatusTorn (the parts carried different
  // slot headers). When nothing of the batch arrives for `stall_s` (0:
  // never), the items still awaited fail with UCS_ERR_TIMED_OUT as at the
  // timeout. Past the timeout, receives under way get a short grace (none
  // after a stall) and then, on endpoints with error handling, the
  // endpoints of the nodes still awaited are force-closed; on others the
  // call waits for them: it never returns while UCX may still write into
  // `dest`. Throws UcxError before sending anything if an argument is
  // malformed. Must be called without the GIL.
  void fetch(const std::vector<Endpoint*>& eps, const uint32_t* node,
             const uint64_t* slot_offset, const uint32_t* tags, uint64_t slot_size,
             const uint64_t* rows, size_t n, const BatchLayout& layout,
             const MemoryRegion& dest, double timeout_s, uint64_t rndv_min, double stall_s,
             int32_t* statuses);

  struct Stats {
    uint64_t batches = 0;
    uint64_t late = 0;      // messages for no batch under way (a batch that timed out)
    uint64_t refused = 0;   // refusals received
    uint64_t malformed = 0; // messages of the wrong size or naming no item
  };
  Stats stats() const;

  // Unregisters the handler (idempotent); requests still being sent are
  // cancelled.
  void close();

  struct Batch;  // am_sample_batch.h
  // A receive into part `part` of `b` ended (its completion callback).
  void received(Batch* b, size_t part, int32_t status);

 private:
  static ucs_status_t on_data(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  ucs_status_t receive(const AmSampleReply& h, const AmSampleSlotHeader* slots, void* data,
                       size_t length, const ucp_am_recv_param_t* param);
  void reap_sends(bool abandon);  // under sends_mu_
  struct Fetch;  // one fetch under way (am_sample_fetch.cc)

  Owner worker_;
  ucp_worker_h worker_h_;
  unsigned request_id_, data_id_;
  uint64_t client_id_;
  std::mutex life_mu_;  // registered_, active_
  std::condition_variable idle_;
  bool registered_ = false;
  size_t active_ = 0;  // fetches under way
  mutable std::mutex mu_;  // batches_ and the batches' state, stats_; never held across a UCX call
  std::unordered_map<uint64_t, Batch*> batches_;
  Stats stats_;
  uint64_t next_token_;
  // Requests whose send has not completed yet, with their buffers: kept
  // across fetches (a node that does not read must not make UCX read freed
  // memory). Under sends_mu_ (UCX is called under it, never the reverse).
  struct PendingSend {
    void* request;
    std::vector<uint8_t> buffer;
  };
  std::mutex sends_mu_;
  std::vector<PendingSend> sends_;
  int efd_ = -1;  // the worker's event fd (owned by UCX), or -1
};

}  // namespace distore
