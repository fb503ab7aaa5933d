#include "endpoint.h"

#include <netdb.h>
#include <sched.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>

#include "status.h"

namespace distore {

Endpoint::Endpoint(Owner worker, uintptr_t worker_handle, const std::string& address,
                   bool error_handling, std::string peer)
    : worker_(std::move(worker)),
      worker_h_(reinterpret_cast<ucp_worker_h>(worker_handle)),
      error_handling_(error_handling),
      peer_(std::move(peer)) {
  if (worker_h_ == nullptr) throw UcxError(kStatusBadArgument, "null worker handle", peer_);
  if (address.empty()) throw UcxError(UCS_ERR_INVALID_PARAM, "empty worker address", peer_);
  ucp_ep_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.address = reinterpret_cast<const ucp_address_t*>(address.data());
  params.err_mode = error_handling ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  if (error_handling) {
    params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.err_handler.cb = &Endpoint::on_error;
    params.err_handler.arg = this;
  }
  check(ucp_ep_create(worker_h_, &params, &ep_), "ucp_ep_create", peer_);
}

Endpoint::Endpoint(ToListener, Owner worker, uintptr_t worker_handle, const std::string& host,
                   uint16_t port, std::string peer)
    : worker_(std::move(worker)),
      worker_h_(reinterpret_cast<ucp_worker_h>(worker_handle)),
      error_handling_(true),
      peer_(std::move(peer)) {
  if (worker_h_ == nullptr) throw UcxError(kStatusBadArgument, "null worker handle", peer_);
  addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int rc = getaddrinfo(host.c_str(), service.c_str(), &hints, &found);
  if (rc != 0 || found == nullptr) {
    throw UcxError(UCS_ERR_INVALID_ADDR,
                   "cannot resolve " + host + ":" + service + ": " + gai_strerror(rc), peer_);
  }
  ucp_ep_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_EP_PARAM_FIELD_FLAGS | UCP_EP_PARAM_FIELD_SOCK_ADDR |
                      UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE | UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.flags = UCP_EP_PARAMS_FLAGS_CLIENT_SERVER;
  params.sockaddr.addr = found->ai_addr;
  params.sockaddr.addrlen = found->ai_addrlen;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &Endpoint::on_error;
  params.err_handler.arg = this;
  const ucs_status_t s = ucp_ep_create(worker_h_, &params, &ep_);
  freeaddrinfo(found);
  check(s, "connecting to the UCX listener at " + host + ":" + service, peer_);
}

Endpoint::~Endpoint() {
  // Force where allowed: a destructor must not wait on a peer that hangs.
  close(error_handling_, 1.0);
}

void Endpoint::on_error(void* arg, ucp_ep_h, ucs_status_t status) {
  auto* self = static_cast<Endpoint*>(arg);
  int ok = UCS_OK;
  self->status_.compare_exchange_strong(ok, status, std::memory_order_acq_rel);
}

int Endpoint::flush(double timeout_s) {
  {
    std::lock_guard<std::mutex> lock(close_mu_);
    if (closed_) return UCS_ERR_CANCELED;
  }
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  ucs_status_ptr_t req = ucp_ep_flush_nbx(ep_, &param);
  if (req == nullptr) return status();
  if (UCS_PTR_IS_ERR(req)) return UCS_PTR_STATUS(req);
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration<double>(timeout_s);
  ucs_status_t s;
  while ((s = ucp_request_check_status(req)) == UCS_INPROGRESS && clock::now() < deadline) {
    if (ucp_worker_progress(worker_h_) == 0) sched_yield();
  }
  ucp_request_free(req);  // released by UCX when it ends, if it has not
  if (s == UCS_INPROGRESS) return UCS_ERR_TIMED_OUT;
  return s != UCS_OK ? s : status();
}

void Endpoint::close(bool force, double timeout_s) {
  std::lock_guard<std::mutex> lock(close_mu_);
  if (closed_) return;
  closed_ = true;
  int ok = UCS_OK;
  status_.compare_exchange_strong(ok, UCS_ERR_CANCELED, std::memory_order_acq_rel);
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = (force && error_handling_) ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t req = ucp_ep_close_nbx(ep_, &param);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) return;
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration<double>(timeout_s);
  while (ucp_request_check_status(req) == UCS_INPROGRESS && clock::now() < deadline) {
    if (ucp_worker_progress(worker_h_) == 0) sched_yield();
  }
  // Still flushing to a peer that does not answer: UCX releases the request
  // when the close completes (only endpoints without an error callback,
  // which could otherwise fire on a freed object, get here unforced).
  ucp_request_free(req);
}

}  // namespace distore
