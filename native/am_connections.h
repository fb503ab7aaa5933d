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
// Ownership: owned by the AmInbox or AmSampleServer whose worker it listens
// on; closing it destroys the listener and force-closes every endpoint
// (their requests end with an error). Thread safety: the UCX callbacks run on whichever thread
// progresses the worker; every method may be called from any thread. One
// mutex guards the tables, and no UCX call is made under it (the callbacks
// take it under the worker's lock).
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include <ucp/api/ucp.h>

namespace distore {

class AmConnections {
 public:
  // Listens on `host`:`port` (port 0: any free one) for peers' connections
  // (`what` names them in errors: "insert", "sample"), at most
  // `max_connections` open at once (more are refused). Throws UcxError if
  // UCX cannot listen there.
  AmConnections(ucp_worker_h worker, const std::string& host, uint16_t port,
                size_t max_connections, const std::string& what = "insert");
  ~AmConnections();
  AmConnections(const AmConnections&) = delete;
  AmConnections& operator=(const AmConnections&) = delete;

  // The port it listens on (the one chosen, with port 0).
  uint16_t port() const { return port_; }
  // The id of the live connection `ep` is (never 0), or 0 if `ep` is not one
  // of them (made otherwise, failed or closed).
  uint64_t id_of(ucp_ep_h ep) const;
  // Force-closes connection `id` (a receive from it that does not end by
  // itself): UCX ends its requests with an error, and no byte of it lands
  // after this returns. Progresses the worker for at most `timeout_s`
  // waiting for the close. False if `id` is not open.
  bool abort(uint64_t id, double timeout_s);
  // Closes the connections whose writer failed or went away; how many.
  size_t reap(double timeout_s);
  // The ids of the connections that failed and are not closed yet.
  std::vector<uint64_t> failed_ids() const;
  // Closes those of the failed connections `ids` names (as failed_ids gave
  // them; others are left for a later reap); how many.
  size_t reap(const std::vector<uint64_t>& ids, double timeout_s);
  // Destroys the listener and force-closes every connection (idempotent).
  void close(double timeout_s);

  struct Counts {
    uint64_t open, accepted, refused, failed, aborted;
  };
  Counts counts() const;

 private:
  static void on_connect(ucp_conn_request_h request, void* arg);
  static void on_error(void* arg, ucp_ep_h ep, ucs_status_t status);

  ucp_worker_h worker_;
  ucp_listener_h listener_ = nullptr;
  uint16_t port_ = 0;
  size_t max_connections_;
  mutable std::mutex mu_;
  struct Conn {
    uint64_t id;
    bool failed;
  };
  std::unordered_map<ucp_ep_h, Conn> conns_;
  std::vector<ucp_ep_h> failed_;  // failed and not closed yet
  uint64_t next_id_ = 1;
  uint64_t accepted_ = 0, refused_ = 0, failures_ = 0, aborted_ = 0;
  bool closed_ = false;
};

// Closes `ep` (forced: its requests end at once with an error), progressing
// `worker` for at most `timeout_s` until UCX has; after that UCX finishes it
// alone.
void force_close(ucp_worker_h worker, ucp_ep_h ep, double timeout_s);

}  // namespace distore
