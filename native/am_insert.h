// Inserts carried by UCX active messages with rendezvous: the writer posts
// one message per staged item (header: batch token, item index, item
// count; data: the item in its registered staging buffer, rendezvous
// forced); the storage node receives each straight into the item's arena
// slot (ucp_am_recv_data_nbx at slot + 16). Over a transport whose RMA UCX
// emulates in software (TCP), UCX's rendezvous moves the bytes with
// zero-copy sends and receives into the slot, where an emulated get copies
// them through bounce buffers on both sides; over RDMA the rendezvous is
// a one-sided read of the writer's buffer, as the get path.
//
// Ownership: an AmInbox holds the Python worker object (and through it the
// context) it registered its handler on, and owns the messages it has
// been handed until a pull takes them or they expire; closing it (or its
// destructor) unregisters the handler and releases them, which completes
// the senders' requests. Thread safety: the handler runs on whichever
// thread progresses the worker; take/expire/close may be called from any
// thread (one mutex). pull_am must be called without the GIL.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <nanobind/nanobind.h>
#include <ucp/api/ucp.h>

#include "endpoint.h"
#include "memory.h"
#include "pull.h"

namespace distore {

// The header every insert message starts with (little-endian on the wire).
struct AmInsertHeader {
  uint64_t token;  // names the batch; random, chosen by the writer
  uint32_t index;  // the item in the batch
  uint32_t count;  // items in the batch
};

class AmInbox {
 public:
  // Registers the insert handler for active message `am_id` on the worker.
  // At most `max_messages` messages wait to be taken; more are released
  // at once (their senders' requests complete with an error).
  AmInbox(nanobind::object worker, uintptr_t worker_handle, unsigned am_id,
          size_t max_messages);
  ~AmInbox();
  AmInbox(const AmInbox&) = delete;
  AmInbox& operator=(const AmInbox&) = delete;

  ucp_worker_h worker() const { return worker_h_; }
  unsigned am_id() const { return am_id_; }
  // Messages received and not taken yet.
  size_t waiting() const;
  // Messages refused so far (malformed header, inbox full, closed).
  uint64_t refused() const;
  // Releases messages that waited longer than `max_age_s` (a batch the
  // node refused, or whose pull timed out); returns how many.
  size_t expire(double max_age_s);
  // Releases the messages of batch `token` and any that arrive for it later
  // (up to `count` items): the node failed that batch.
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
    std::chrono::steady_clock::time_point arrived;
  };
  // Moves the message of (token, index) into `out`; false if none arrived yet.
  bool take(uint64_t token, uint32_t index, Message* out);
  // Gives a taken message's descriptor back to UCX without receiving it.
  void release(Message& m);

 private:
  static ucs_status_t on_message(void* arg, const void* header, size_t header_length,
                                 void* data, size_t length, const ucp_am_recv_param_t* param);
  ucs_status_t receive(const AmInsertHeader& h, void* data, size_t length,
                       const ucp_am_recv_param_t* param);

  nanobind::object worker_;
  ucp_worker_h worker_h_;
  unsigned am_id_;
  size_t max_messages_;
  mutable std::mutex mu_;
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
  // Batches failed by the node: their late messages are released on arrival.
  std::unordered_map<uint64_t, std::chrono::steady_clock::time_point> discarded_;
  uint64_t refused_ = 0;
  bool registered_ = false;
};

// Writer side: posts one rendezvous active message per item of `region`
// (items at `offsets`, `lengths` bytes each) to `ep`, headed by `token`.
// Requests are released at once: they complete when the node has received
// the bytes (or released the message); the node's acknowledgement over the
// control channel is what tells the writer the batch landed. Throws
// UcxError if UCX refuses to post (a failed endpoint), before or during.
void am_send(const Endpoint& ep, const MemoryRegion& region, unsigned am_id, uint64_t token,
             const uint64_t* offsets, const uint64_t* lengths, size_t n);

// Node side: receives batch `token`'s n items, each straight into its slot
// of `arena` (payload at slot + 16, through `dest`, the arena's writable
// alias registered for local access), under the slot seqlock as pull():
// headers invalidated first, real headers after the payloads. Items
// validated first (slot inside the arena; `lengths` as the descriptor
// said; a message whose length differs fails that item with
// UCS_ERR_MESSAGE_TRUNCATED). Progresses the inbox's worker until every
// item has landed or failed; an item whose message has not arrived after
// `timeout_s` gets UCS_ERR_TIMED_OUT. Writes each item's status into
// `statuses`.
//
// It returns while a receive is under way only when the batch is discarded
// (the caller saw the writer's control connection close, or the node is
// shutting down; such items get UCS_ERR_CONNECTION_RESET): the writer is
// gone, and with it the connection its bytes came on. The writer's
// endpoint has no peer-failure handling (UCX sends rendezvous zero-copy
// only without it), so UCX would never end that receive itself; its
// request is left to UCX.
void pull_am(const MemoryRegion& arena, const MemoryRegion& dest, AmInbox& inbox,
             uint64_t token, const PullItem* items, size_t n, double timeout_s,
             int32_t* statuses);

}  // namespace distore
