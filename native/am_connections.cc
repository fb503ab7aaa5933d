#include "am_connections.h"

#include <algorithm>

#include <netdb.h>
#include <sched.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <memory>

#include "status.h"

namespace distore {

void force_close(ucp_worker_h worker, ucp_ep_h ep, double timeout_s) {
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;
  ucs_status_ptr_t req = ucp_ep_close_nbx(ep, &param);
  if (req == nullptr || UCS_PTR_IS_ERR(req)) return;
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration<double>(timeout_s);
  while (ucp_request_check_status(req) == UCS_INPROGRESS && clock::now() < deadline) {
    if (ucp_worker_progress(worker) == 0) sched_yield();
  }
  ucp_request_free(req);  // UCX releases it when the close completes
}

AmConnections::AmConnections(ucp_worker_h worker, const std::string& host, uint16_t port,
                             size_t max_connections, const std::string& what)
    : worker_(worker), max_connections_(max_connections) {
  addrinfo hints;
  std::memset(&hints, 0, sizeof(hints));
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int rc = getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints,
                             &found);
  if (rc != 0 || found == nullptr) {
    throw UcxError(UCS_ERR_INVALID_ADDR, "cannot listen for " + what + "s on " + host + ":" +
                                             service + ": " + gai_strerror(rc) +
                                             "; give the node an address of this host");
  }
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> owner(found, &freeaddrinfo);
  ucp_listener_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_LISTENER_PARAM_FIELD_SOCK_ADDR | UCP_LISTENER_PARAM_FIELD_CONN_HANDLER;
  params.sockaddr.addr = found->ai_addr;
  params.sockaddr.addrlen = found->ai_addrlen;
  params.conn_handler.cb = &AmConnections::on_connect;
  params.conn_handler.arg = this;
  check(ucp_listener_create(worker_, &params, &listener_),
        "listening for " + what + " connections on " + host + ":" + service);
  ucp_listener_attr_t attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.field_mask = UCP_LISTENER_ATTR_FIELD_SOCKADDR;
  const ucs_status_t s = ucp_listener_query(listener_, &attr);
  if (s != UCS_OK) {
    ucp_listener_destroy(listener_);
    check(s, "ucp_listener_query");
  }
  if (attr.sockaddr.ss_family == AF_INET6) {
    port_ = ntohs(reinterpret_cast<const sockaddr_in6*>(&attr.sockaddr)->sin6_port);
  } else {
    port_ = ntohs(reinterpret_cast<const sockaddr_in*>(&attr.sockaddr)->sin_port);
  }
}

AmConnections::~AmConnections() { close(1.0); }

void AmConnections::on_connect(ucp_conn_request_h request, void* arg) {
  auto* self = static_cast<AmConnections*>(arg);
  bool take;
  {
    std::lock_guard<std::mutex> lock(self->mu_);
    take = !self->closed_ && self->conns_.size() < self->max_connections_;
    if (!take) ++self->refused_;
  }
  if (!take) {
    ucp_listener_reject(self->listener_, request);
    return;
  }
  ucp_ep_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_EP_PARAM_FIELD_CONN_REQUEST | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER;
  params.conn_request = request;
  params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  params.err_handler.cb = &AmConnections::on_error;
  params.err_handler.arg = self;
  ucp_ep_h ep = nullptr;
  if (ucp_ep_create(self->worker_, &params, &ep) != UCS_OK) {
    // UCX rejected the request itself; the writer's endpoint fails.
    std::lock_guard<std::mutex> lock(self->mu_);
    ++self->refused_;
    return;
  }
  std::lock_guard<std::mutex> lock(self->mu_);
  self->conns_[ep] = Conn{self->next_id_++, false};
  ++self->accepted_;
}

void AmConnections::on_error(void* arg, ucp_ep_h ep, ucs_status_t) {
  auto* self = static_cast<AmConnections*>(arg);
  std::lock_guard<std::mutex> lock(self->mu_);
  auto it = self->conns_.find(ep);
  if (it == self->conns_.end() || it->second.failed) return;
  it->second.failed = true;
  ++self->failures_;
  self->failed_.push_back(ep);  // closed by reap(), outside UCX's callback
}

uint64_t AmConnections::id_of(ucp_ep_h ep) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = conns_.find(ep);
  return (it == conns_.end() || it->second.failed) ? 0 : it->second.id;
}

bool AmConnections::abort(uint64_t id, double timeout_s) {
  ucp_ep_h ep = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = conns_.begin(); it != conns_.end(); ++it) {
      if (it->second.id != id) continue;
      ep = it->first;
      conns_.erase(it);
      break;
    }
    if (ep == nullptr) return false;
    for (size_t i = 0; i < failed_.size(); ++i) {
      if (failed_[i] == ep) {
        failed_.erase(failed_.begin() + i);
        break;
      }
    }
    ++aborted_;
  }
  force_close(worker_, ep, timeout_s);
  return true;
}

std::vector<uint64_t> AmConnections::failed_ids() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<uint64_t> ids;
  for (ucp_ep_h ep : failed_) {
    auto it = conns_.find(ep);
    if (it != conns_.end()) ids.push_back(it->second.id);
  }
  return ids;
}

size_t AmConnections::reap(const std::vector<uint64_t>& ids, double timeout_s) {
  std::vector<ucp_ep_h> gone;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = failed_.begin(); it != failed_.end();) {
      auto conn = conns_.find(*it);
      const bool named = conn != conns_.end() &&
                         std::find(ids.begin(), ids.end(), conn->second.id) != ids.end();
      if (named) {
        gone.push_back(*it);
        conns_.erase(conn);
        it = failed_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (ucp_ep_h ep : gone) force_close(worker_, ep, timeout_s);
  return gone.size();
}

size_t AmConnections::reap(double timeout_s) {
  std::vector<ucp_ep_h> gone;
  {
    std::lock_guard<std::mutex> lock(mu_);
    gone.swap(failed_);
    for (ucp_ep_h ep : gone) conns_.erase(ep);
  }
  for (ucp_ep_h ep : gone) force_close(worker_, ep, timeout_s);
  return gone.size();
}

void AmConnections::close(double timeout_s) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
  }
  // No connection is accepted once this returns (it takes the worker's
  // lock, which a connection callback under way holds).
  if (listener_ != nullptr) ucp_listener_destroy(listener_);
  listener_ = nullptr;
  std::vector<ucp_ep_h> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : conns_) all.push_back(kv.first);
    conns_.clear();
    failed_.clear();
  }
  for (ucp_ep_h ep : all) force_close(worker_, ep, timeout_s);
  // Run what the closes queued for later progress (UCX's async thread
  // queues some of it as the sockets close): a worker destroyed with such
  // callbacks still queued after forced closes was seen to double-free
  // them (UCX 1.21, ucs_callbackq_oneshot_elems_free). Until the worker
  // has been idle for 20 ms, at most `timeout_s`.
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration<double>(timeout_s);
  auto idle_since = clock::now();
  while (clock::now() < deadline && clock::now() - idle_since < std::chrono::milliseconds(20)) {
    if (ucp_worker_progress(worker_) != 0) {
      idle_since = clock::now();
    } else {
      sched_yield();
    }
  }
}

AmConnections::Counts AmConnections::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t open = 0;
  for (auto& kv : conns_) open += !kv.second.failed;
  return Counts{open, accepted_, refused_, failures_, aborted_};
}

}  // namespace distore
