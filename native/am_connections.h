// The connections a storage node takes active messages on: a UCX listener
// on one of its workers and the endpoints it accepts, each with peer-failure
// handling (UCP_ERR_HANDLING_MODE_PEER). Writers' inserts come on the
// inbox's (am_insert.h); learners' sample requests come, and their answers
// go, on the sample server's (am_sample.h).
//
// Why a listener: UCX selects zero-copy rendezvous lanes for an endpoint
// with peer-failure handling only when its transport lanes are connected
// point to point, which over TCP means an endpoint with a
// connection-manager lane, i.e. one made through a listener (UCX 1.21,
// src/ucp/wireup/select.c, ucp_wireup_add_rma_bw_lanes and
// ucp_wireup_connect_p2p: without it, RMA lanes must have memory
// invalidation, which TCP lacks, and rendezvous falls back to copying
// through bounce buffers). With it, a writer that dies mid-rendezvous fails
// the node's receives (UCS_ERR_CONNECTION_RESET) instead of leaving them
// under way for ever, and its connection can be force-closed to end a
// receive from a writer that hangs. perf/am_rndv_probe.py measures both.
//
// A learner that dies mid-batch fails the node's sends to it likewise.
//
// Authentication (with a key; am_grant.h): a new connection is served only
// once its first message, an AmAuthRequest on the listener's `auth_id`,
// carried the node's connection capability; the node answers it with an
// AmAuthAck on `kAmAuthAckId` (the client waits for it: UCX does not keep
// active messages of one endpoint in order). Until then id_of() does not
// know it, so its owner takes nothing from it. One that sends a wrong
// capability, or none within kAuthTimeout, is closed by the next reap;
// at most kMaxPending wait to authenticate at once (a new one evicts the
// oldest: a legitimate peer authenticates within a round trip), and at most
// `max_connections` are authenticated at once. (UCX 1.21 keeps the sockets
// of a connection closed by force until its peer closes them: a peer that
// holds thousands of connections holds that many descriptors of the node,
// but nothing else of it, and takes no other peer's place.) Without a key (tests,
// perf/) every accepted connection is served, as before authentication.
//
// Ownership: owned by the AmInbox or AmSampleServer whose worker it listens
// on; closing it destroys the listener and force-closes every endpoint
// (their requests end with an error). Thread safety: the UCX callbacks run on whichever thread
// progresses the worker; every method may be called from any thread. One
// mutex guards the tables, and no UCX call is made under it (the callbacks
// take it under the worker's lock).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <ucp/api/ucp.h>

namespace distore {

// Active message ids of the authentication exchange (protocol/framing.py
// names them too): a peer's request to the insert or the sample listener,
// and the node's answer.
constexpr unsigned kAmInsertAuthId = 0x4456;
constexpr unsigned kAmSampleAuthId = 0x4457;
constexpr unsigned kAmAuthAckId = 0x4458;
constexpr uint32_t kAmAuthVersion = 1;

struct AmAuthRequest {  // the header of an authentication message (no data)
  uint32_t version;
  uint32_t reserved;
  uint64_t nonce;     // echoed in the answer
  uint8_t cap[16];    // the node's connection capability (am_grant.h)
};
struct AmAuthAck {  // the node's answer
  uint64_t nonce;
  int64_t status;  // UCS_OK, or why not (UCS_ERR_REJECTED: wrong capability)
};

class AmConnections {
 public:
  // How long a new connection has to authenticate, and how many may wait to.
  static constexpr double kAuthTimeout = 1.0;
  static constexpr size_t kMaxPending = 4096;

  // Listens on `host`:`port` (port 0: any free one) for peers' connections
  // (`what` names them in errors: "insert", "sample"), at most
  // `max_connections` authenticated at once (more are refused). With `key`
  // (kAmKeyBytes, or empty: none), a connection is served only once it
  // authenticated with an AmAuthRequest on `auth_id` (see above). Throws
  // UcxError if UCX cannot listen there or the key is malformed.
  AmConnections(ucp_worker_h worker, const std::string& host, uint16_t port,
                size_t max_connections, const std::string& what, const std::string& key,
                unsigned auth_id);
  ~AmConnections();
  AmConnections(const AmConnections&) = delete;
  AmConnections& operator=(const AmConnections&) = delete;

  // The port it listens on (the one chosen, with port 0).
  uint16_t port() const { return port_; }
  // The id of the live connection `ep` is (never 0), or 0 if `ep` is not one
  // of them (made otherwise, failed or closed) or has not authenticated yet.
  uint64_t id_of(ucp_ep_h ep) const;
  // Force-closes connection `id` (a receive from it that does not end by
  // itself): UCX ends its requests with an error, and no byte of it lands
  // after this returns. Progresses the worker for at most `timeout_s`
  // waiting for the close. False if `id` is not open.
  bool abort(uint64_t id, double timeout_s);
  // Closes the connections whose writer failed or went away, or that did
  // not authenticate in time; how many.
  size_t reap(double timeout_s);
  // Closes connection `id` at the next reap (it broke the protocol: a wrong
  // grant, a message it may not send).
  void kick(uint64_t id);
  // The ids of the connections that failed (or did not authenticate in
  // time) and are not closed yet.
  std::vector<uint64_t> failed_ids();
  // Closes those of the failed connections `ids` names (as failed_ids gave
  // them; others are left for a later reap); how many.
  size_t reap(const std::vector<uint64_t>& ids, double timeout_s);
  // Destroys the listener and force-closes every connection (idempotent).
  void close(double timeout_s);

  struct Counts {
    uint64_t open, accepted, refused, failed, aborted;
    uint64_t pending;          // open, not authenticated yet
    uint64_t unauthenticated;  // closed for a wrong capability or none in time
  };
  Counts counts() const;

 private:
  static void on_connect(ucp_conn_request_h request, void* arg);
  static void on_error(void* arg, ucp_ep_h ep, ucs_status_t status);
  static ucs_status_t on_auth(void* arg, const void* header, size_t header_length, void* data,
                              size_t length, const ucp_am_recv_param_t* param);
  // Under mu_: marks `ep` failed (closed by the next reap).
  void fail_locked(ucp_ep_h ep, bool unauthenticated);
  // Under mu_: connections that did not authenticate in time fail.
  void sweep_locked();

  ucp_worker_h worker_;
  ucp_listener_h listener_ = nullptr;
  uint16_t port_ = 0;
  size_t max_connections_;
  mutable std::mutex mu_;
  bool auth_ = false;  // a key was given: connections must authenticate
  uint8_t cap_[16] = {};
  unsigned auth_id_ = 0;
  struct Conn {
    uint64_t id;
    bool failed;
    bool authed;
    std::chrono::steady_clock::time_point since;  // when accepted
  };
  std::unordered_map<ucp_ep_h, Conn> conns_;
  std::vector<ucp_ep_h> failed_;  // failed and not closed yet
  uint64_t next_id_ = 1;
  uint64_t accepted_ = 0, refused_ = 0, failures_ = 0, aborted_ = 0, unauthenticated_ = 0;
  size_t authed_ = 0, pending_ = 0;  // open connections of each kind (not failed)
  bool closed_ = false;
};

// A client's side of the authentication: waits for nodes' answers on one
// worker (registers the handler for kAmAuthAckId there). Thread safety:
// authenticate may be called from any thread, several at once.
class AmAuthClient {
 public:
  explicit AmAuthClient(ucp_worker_h worker);
  ~AmAuthClient();
  AmAuthClient(const AmAuthClient&) = delete;
  AmAuthClient& operator=(const AmAuthClient&) = delete;
  // Sends `cap` (kAmCapBytes) on `ep` (an endpoint to a listener, on this
  // worker) as an authentication message `auth_id`, and progresses the
  // worker until the node answers: UCS_OK, the node's refusal, or
  // UCS_ERR_TIMED_OUT after `timeout_s`.
  int32_t authenticate(ucp_ep_h ep, unsigned auth_id, const std::string& cap, double timeout_s);
  void close();  // unregisters the handler (idempotent)

 private:
  static ucs_status_t on_ack(void* arg, const void* header, size_t header_length, void* data,
                             size_t length, const ucp_am_recv_param_t* param);
  ucp_worker_h worker_;
  std::mutex mu_;
  std::unordered_map<uint64_t, int32_t> answers_;  // nonce -> status
  uint64_t next_nonce_;
  bool registered_ = false;
};

// Closes `ep` (forced: its requests end at once with an error), progressing
// `worker` for at most `timeout_s` until UCX has; after that UCX finishes it
// alone.
void force_close(ucp_worker_h worker, ucp_ep_h ep, double timeout_s);

}  // namespace distore
