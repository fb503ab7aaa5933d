// Our own UCX endpoints, made on ucxx's worker with the C API.
//
// Why not ucxx's: a read that a hung peer never answers (TCP, where UCX
// emulates RMA with active messages) cannot be cancelled, and only a forced
// close (ucp_ep_close_nbx with UCP_EP_CLOSE_FLAG_FORCE) completes it. ucxx
// would close its endpoint a second time later; ours know they are closed.
//
// Ownership: holds its worker's owner (owner.h: the Python worker object,
// and through it the context), so the worker outlives every endpoint made
// on it; remote keys hold their Endpoint. Thread safety: close() and the
// error callback may run on any thread (the worker is
// UCS_THREAD_MODE_MULTI); handle() is read-only.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include <ucp/api/ucp.h>

#include "owner.h"

namespace distore {

class Endpoint {
 public:
  // Connects to the worker whose packed address is `address`. With
  // `error_handling`, UCP_ERR_HANDLING_MODE_PEER: a failed peer fails the
  // endpoint's requests (needs a transport that detects failures: not the
  // shared-memory ones alone). Throws UcxError if UCX refuses.
  Endpoint(Owner worker, uintptr_t worker_handle, const std::string& address,
           bool error_handling, std::string peer);
  // Connects to the UCX listener at `host`:`port` (a storage node's insert
  // listener, am_connections.h), with peer-failure handling: such an
  // endpoint has a connection-manager lane, with which UCX still sends
  // rendezvous zero-copy over TCP. The connection is made in the
  // background; a listener that cannot be reached fails the endpoint (and
  // its sends) later. Throws UcxError if `host` does not resolve.
  struct ToListener {};
  Endpoint(ToListener, Owner worker, uintptr_t worker_handle, const std::string& host,
           uint16_t port, std::string peer);
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  ucp_ep_h ep() const { return ep_; }
  ucp_worker_h worker() const { return worker_h_; }
  uintptr_t handle() const { return reinterpret_cast<uintptr_t>(ep_); }
  bool error_handling() const { return error_handling_; }
  // UCS_OK while usable; the failure UCX reported, or UCS_ERR_CANCELED once closed.
  int status() const { return status_.load(std::memory_order_acquire); }
  bool alive() const { return status() == UCS_OK; }
  const std::string& peer() const { return peer_; }

  // Flushes the endpoint: UCS_OK once everything posted on it so far has
  // completed remotely (for an endpoint made through a listener, that
  // includes the connection being made), the error if it failed, or
  // UCS_ERR_TIMED_OUT after `timeout_s` (the request is then left to UCX).
  // Progresses the worker while it waits.
  int flush(double timeout_s);

  // Closes the endpoint once (later calls return at once). `force`
  // completes every outstanding request at once with an error (only
  // allowed with error handling; without it the close flushes). Progresses
  // the worker for at most `timeout_s` waiting for the close to finish.
  void close(bool force, double timeout_s);

 private:
  static void on_error(void* arg, ucp_ep_h ep, ucs_status_t status);

  Owner worker_;
  ucp_worker_h worker_h_;
  ucp_ep_h ep_ = nullptr;
  bool error_handling_;
  std::string peer_;
  std::atomic<int> status_{UCS_OK};
  std::mutex close_mu_;
  bool closed_ = false;
};

}  // namespace distore
