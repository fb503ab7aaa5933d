// Inserts carried by UCX active messages with rendezvous: the writer posts
// one message per staged item (header: batch token, item index, item
// count; data: the item in its registered staging buffer, rendezvous
// forced); the storage node receives each straight into the item's arena
// slot (ucp_am_recv_data_nbx at slot + 16). Items much smaller than a
// megabyte travel as runs instead: one message carries several items that
// follow one another in the staging buffer (the header also says how
// many), which the node receives into a bounce chunk and copies into the
// items' slots. Over TCP each rendezvous is a handshake of four messages
// (RTS, RTR, the data, its acknowledgement), which cost more than the copy
// at 110 KB (docs/performance.md); the node says whether it takes runs,
// and how large (AmInbox::kRunBytes). Over a transport whose RMA UCX
// emulates in software (TCP), UCX's rendezvous moves the bytes with
// zero-copy sends and receives into the slot, where an emulated get copies
// them through bounce buffers on both sides; over RDMA the rendezvous is
// a one-sided read of the writer's buffer, as the get path.
//
// Writers connect through the inbox's listener (listen(); am_connections.h
// says why): their endpoints have peer-failure handling and still send
// zero-copy, so a writer that dies mid-batch fails the node's receives, and
// one that hangs has its connection force-closed when the batch's time is
// up; either way a receive always ends before its slot is given back. An
// inbox that does not listen takes messages from any endpoint, as before
// listeners: a receive from an endpoint without peer-failure handling is
// left to UCX when its writer is gone (pull_am).
//
// Who may send (with listen()'s key; am_connections.h): only connections
// that authenticated with the node's capability, which the control plane
// gives writers on the authenticated channel; messages from any other are
// dropped at once, nothing of them kept. A batch's messages are matched to
// its descriptor (the writer's authenticated RPC connection) by its token,
// 63 random bits only the writer and the node learn. What one connection
// can make the inbox hold is bounded: kMaxPerConnection messages and
// kMaxEagerPerConnection bytes of eagerly sent data (a rendezvous message
// holds a small descriptor, its bytes stay at the writer), and
// kMaxEagerBytes of eager data for all; more are refused.
//
// Ownership: an AmInbox holds the owner (owner.h) of the worker it
// registered its handler on (the Python worker object, and through it the
// context), owns its listener and the connections it accepted, and owns
// the messages it has been handed until a pull takes them or they expire;
// closing it (or its destructor) unregisters the handler, releases them
// (which completes the senders' requests) and force-closes the
// connections. Thread safety: the handler
// runs on whichever thread progresses the worker; the other methods may be
// called from any thread (one mutex, never held across a UCX call).
// pull_am must be called without the GIL.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <ucp/api/ucp.h>

#include "am_connections.h"
#include "chunk_pool.h"
#include "endpoint.h"
#include "memory.h"
#include "owner.h"
#include "pull.h"

namespace distore {

// The header every insert message starts with (little-endian on the wire).
struct AmInsertHeader {
  uint64_t token;  // names the batch; random, chosen by the writer
  uint32_t index;  // the item in the batch (of a run: its first item)
  uint32_t count;  // items in the batch
};

// The header of a run: items index .. index + run - 1, back to back in the
// message's data.
struct AmInsertRunHeader {
  AmInsertHeader head;
  uint32_t run;       // items in this message, at least 2
  uint32_t reserved;  // 0
};

class AmInbox {
 public:
  // Registers the insert handler for active message `am_id` on the worker
  // (`worker_handle`, a ucp_worker_h, which `worker` keeps alive). At most
  // `max_messages` messages wait to be taken; more are released at once
  // (their senders' requests complete with an error).
  AmInbox(Owner worker, uintptr_t worker_handle, unsigned am_id, size_t max_messages);
  ~AmInbox();
  AmInbox(const AmInbox&) = delete;
  AmInbox& operator=(const AmInbox&) = delete;

  // The largest run message (bytes of data) a pull receives: the size of
  // its bounce chunks, which writers are told (register_node's
  // insert_run_bytes).
  static constexpr uint64_t kRunBytes = 1 << 20;
  // Bounce chunks a pull may receive runs into at once (more wait).
  static constexpr size_t kMaxChunks = 16;
  // What one connection's messages may hold at once (see above), and all.
  static constexpr size_t kMaxPerConnection = 16384;
  static constexpr uint64_t kMaxEagerPerConnection = 16ull << 20;
  static constexpr uint64_t kMaxEagerBytes = 128ull << 20;

  ucp_worker_h worker() const { return worker_h_; }
  unsigned am_id() const { return am_id_; }
  // Listens on `host`:`port` (0: any free port) for writers' connections,
  // at most `max_connections` at once, and from then on takes messages
  // only from the connections it accepted (with `key`, the node's: only
  // once they authenticated; see above). Returns the port. Once only.
  uint16_t listen(const std::string& host, uint16_t port, size_t max_connections,
                  const std::string& key = "");
  // Force-closes connection `conn` (Message::conn): its receives end with
  // an error. False if it is not open (or the inbox does not listen).
  bool abort(uint64_t conn);
  // Connection counts (all 0 when not listening) and receives left to UCX
  // (a receive that a forced close did not end; see pull_am).
  AmConnections::Counts connections() const;
  uint64_t abandoned() const;
  void count_abandoned(size_t n);
  // Messages received and not taken (or released) yet.
  size_t waiting() const;
  // Messages refused so far (malformed header, inbox full, closed).
  uint64_t refused() const;
  // Releases messages that waited longer than `max_age_s` (a batch the
  // node refused, or whose pull timed out), and closes the connections of
  // writers that failed or left; returns how many messages it released.
  size_t expire(double max_age_s);
  // Releases the messages of batch `token` (at the next expire(), on the
  // thread that progresses the worker) and any that arrive for it later (up
  // to `count` items): the node failed that batch.
  void discard(uint64_t token, uint32_t count);
  // Unregisters the handler and releases every waiting message (idempotent).
  void close();
  // Whether batch `token` was discarded, or the inbox closed: its pull ends.
  bool discarded(uint64_t token) const;

  struct Message {
    void* desc = nullptr;        // UCX's data descriptor (rendezvous or persistent eager)
    uint64_t length = 0;
    bool rndv = false;           // the bytes are still at the sender
    std::vector<uint8_t> bytes;  // eager data that UCX did not let us keep
    uint64_t conn = 0;           // the connection it came on (0: not one of the listener's)
    uint64_t eager = 0;          // bytes of eager data it holds (persistent or copied)
    uint32_t run = 1;            // items it carries, back to back
    std::chrono::steady_clock::time_point arrived;
  };
  // Moves the message of (token, index) into `out`; false if none arrived yet.
  bool take(uint64_t token, uint32_t index, Message* out);
  // Gives a taken message's descriptor back to UCX without receiving it.
  void release(Message& m);
  // Gives it back at the next expire(), after a progress that handles its
  // connection's failure (a pull's message of a writer that died: see
  // discard).
  void release_later(Message&& m);
  // Bounce chunks of kRunBytes for runs' receives, at most kMaxChunks out
  // (take() gives nullptr then). A chunk whose receive was left to UCX (it
  // may still write there) is given back `tainted` and never handed out
  // again (kept until the inbox goes).
  ChunkPool& chunk_pool() { return chunks_; }
  const ChunkPool& chunk_pool() const { return chunks_; }

 private:
  static ucs_status_t on_message(void* arg, const void* header, size_t header_length,
                                 void* data, size_t length, const ucp_am_recv_param_t* param);
  ucs_status_t receive(const AmInsertHeader& h, uint32_t run, void* data, size_t length,
                       const ucp_am_recv_param_t* param);

  Owner worker_;
  ucp_worker_h worker_h_;
  unsigned am_id_;
  size_t max_messages_;
  mutable std::mutex mu_;
  // Held around every release of a held message and around closing
  // connections: a rendezvous message's release acknowledges it on its
  // endpoint, so it must never race with that endpoint's close (UCX would
  // use the freed endpoint). Taken before any UCX call, never under mu_;
  // the message handler (under the worker's lock) never takes it.
  std::mutex release_mu_;
  // Releases, then forgets, the held messages of connections `conns`.
  // Under release_mu_.
  void release_messages_of(const std::vector<uint64_t>& conns);
  void release_locked(Message& m);  // under release_mu_
  // (token, index) -> message; keyed by both to be exact.
  struct Key {
    uint64_t token;
    uint32_t index;
    bool operator==(const Key& o) const { return token == o.token && index == o.index; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const {
      return std::hash<uint64_t>()(k.token ^ (uint64_t(k.index) * 0x9E3779B97F4A7C15ull));
    }
  };
  std::unordered_map<Key, Message, KeyHash> messages_;
  // What the messages in messages_ hold, per connection and in all.
  struct Held {
    size_t messages = 0;
    uint64_t eager = 0;
  };
  std::unordered_map<uint64_t, Held> held_;
  uint64_t eager_ = 0;
  // Under mu_: message `m` leaves messages_ (its hold is given back).
  void unhold_locked(const Message& m);
  // Messages of discarded batches, released by the next expire() (discard
  // says why not at once).
  std::vector<Message> deferred_;
  // Batches failed by the node: their late messages are released on arrival.
  std::unordered_map<uint64_t, std::chrono::steady_clock::time_point> discarded_;
  uint64_t refused_ = 0;
  uint64_t abandoned_ = 0;
  ChunkPool chunks_{kRunBytes, kMaxChunks};
  bool registered_ = false;
  // Made by listen(), closed by close(), kept until the inbox goes (a pull
  // may still call abort on it).
  std::unique_ptr<AmConnections> connections_;
  AmConnections* connections_ptr() const;
};

// Writer side: posts one rendezvous active message per item of `region`
// (items at `offsets`, `lengths` bytes each) to `ep`, headed by `token`,
// with UCP_AM_SEND_FLAG_REPLY (the node learns which connection it came
// on); with `run_bytes` > 0, items that follow one another in `region` go
// as runs of up to `run_bytes` bytes (a node that takes runs of that size).
// The sends use the region's own registration, not one from UCX's cache: a
// send aborted after the node was told where to read it then ends at once
// (test_held_sends.py).
// Requests are released at once: they complete when the node has received
// the bytes (or released the message); the node's acknowledgement over the
// control channel is what tells the writer the batch landed. Throws
// UcxError if UCX refuses to post (a failed endpoint), before or during.
void am_send(const Endpoint& ep, const MemoryRegion& region, unsigned am_id, uint64_t token,
             const uint64_t* offsets, const uint64_t* lengths, size_t n, uint64_t run_bytes);

// Posts `count` messages `am_id` of `header` and `data` on `ep` (eager or
// rendezvous) and progresses its worker until they end or `timeout_s`
// passes (then their requests are left to UCX, their buffers kept);
// returns how many ended with UCS_OK. Arbitrary bytes: what a hostile peer
// can send (tests/integration/am_attacker.py).
size_t am_send_raw(const Endpoint& ep, unsigned am_id, const std::string& header,
                   const std::string& data, size_t count, bool eager, double timeout_s);

// Node side: receives batch `token`'s n items, each straight into its slot
// of `arena` (payload at slot + 16, through `dest`, the arena's writable
// alias registered for local access), under the slot seqlock as pull():
// headers invalidated first, real headers after the payloads. Items
// validated first (slot inside the arena; `lengths` as the descriptor
// said; a message whose length differs fails that item with
// UCS_ERR_MESSAGE_TRUNCATED; a run whose items are not all waiting, or
// whose length is not theirs, fails them all so). Progresses the inbox's
// worker until every item has landed or failed, and writes each item's
// status into `statuses`. It returns only once no receive of the batch is
// under way (UCX writes no byte of it into a slot afterwards), but for
// receives left to UCX as below:
//
// - an item whose message has not arrived `timeout_s` after the call gets
//   UCS_ERR_TIMED_OUT; a receive still under way then has its connection
//   force-closed (the writer hangs), which ends it with an error;
// - a writer that dies fails its receives (UCX reports the connection
//   reset), and the rest of the batch waits no longer once the node
//   discards it (the writer's control connection closed, or the node
//   stops): items whose message has not come get UCS_ERR_CANCELED, and
//   receives still under way a grace period later are ended by force as
//   above;
// - a receive from an endpoint the inbox did not accept (an inbox that does
//   not listen) cannot be ended that way: once the batch is discarded it is
//   left to UCX (UCS_ERR_CONNECTION_RESET), as is, and counted in
//   abandoned(), one that a forced close did not end within seconds.
void pull_am(const MemoryRegion& arena, const MemoryRegion& dest, AmInbox& inbox,
             uint64_t token, const PullItem* items, size_t n, double timeout_s,
             int32_t* statuses);

}  // namespace distore
