#include "am_connections.h"

#include <algorithm>

#include <netdb.h>
#include <sched.h>
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <thread>

#include "am_grant.h"
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

namespace {

using clock = std::chrono::steady_clock;

void set_handler(ucp_worker_h worker, unsigned id, ucp_am_recv_callback_t cb, void* arg) {
  ucp_am_handler_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                     UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  param.id = id;
  param.flags = UCP_AM_FLAG_WHOLE_MSG;
  param.cb = cb;
  param.arg = arg;
  const ucs_status_t s = ucp_worker_set_am_recv_handler(worker, &param);
  if (cb != nullptr) check(s, "registering the authentication handler");
}

void free_request(void* request, ucs_status_t, void*) { ucp_request_free(request); }

}  // namespace

AmConnections::AmConnections(ucp_worker_h worker, const std::string& host, uint16_t port,
                             size_t max_connections, const std::string& what,
                             const std::string& key, unsigned auth_id)
    : worker_(worker), max_connections_(max_connections), auth_id_(auth_id) {
  if (!key.empty()) {
    if (key.size() != kAmKeyBytes) {
      throw UcxError(kStatusBadArgument, "the listener's key must be " +
                                             std::to_string(kAmKeyBytes) + " bytes");
    }
    am_connect_cap(reinterpret_cast<const uint8_t*>(key.data()), cap_);
    auth_ = true;
  }
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
  if (auth_) {
    try {
      set_handler(worker_, auth_id_, &AmConnections::on_auth, this);
    } catch (...) {
      ucp_listener_destroy(listener_);
      throw;
    }
  }
}

AmConnections::~AmConnections() { close(1.0); }

void AmConnections::on_connect(ucp_conn_request_h request, void* arg) {
  auto* self = static_cast<AmConnections*>(arg);
  bool take;
  {
    std::lock_guard<std::mutex> lock(self->mu_);
    self->sweep_locked();
    // Connections waiting to authenticate: the oldest makes room for this
    // one (closed by the next reap), so that a flood of silent connections
    // never keeps a peer that authenticates within a round trip out.
    take = !self->closed_ && self->authed_ + self->pending_ < self->max_connections_ +
                                                                 AmConnections::kMaxPending;
    if (take && self->auth_ && self->pending_ >= AmConnections::kMaxPending) {
      ucp_ep_h oldest = nullptr;
      auto since = clock::time_point::max();
      for (auto& kv : self->conns_) {
        if (!kv.second.failed && !kv.second.authed && kv.second.since < since) {
          oldest = kv.first;
          since = kv.second.since;
        }
      }
      if (oldest != nullptr) self->fail_locked(oldest, true);
    }
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
  self->conns_[ep] = Conn{self->next_id_++, false, !self->auth_, clock::now()};
  ++(self->auth_ ? self->pending_ : self->authed_);
  ++self->accepted_;
}

void AmConnections::fail_locked(ucp_ep_h ep, bool unauthenticated) {
  auto it = conns_.find(ep);
  if (it == conns_.end() || it->second.failed) return;
  it->second.failed = true;
  --(it->second.authed ? authed_ : pending_);
  ++(unauthenticated ? unauthenticated_ : failures_);
  failed_.push_back(ep);  // closed by reap(), outside UCX's callbacks
}

void AmConnections::sweep_locked() {
  if (!auth_ || pending_ == 0) return;
  const auto limit = clock::now() - std::chrono::duration_cast<clock::duration>(
                                        std::chrono::duration<double>(kAuthTimeout));
  std::vector<ucp_ep_h> late;
  for (auto& kv : conns_) {
    if (!kv.second.failed && !kv.second.authed && kv.second.since < limit) late.push_back(kv.first);
  }
  for (ucp_ep_h ep : late) fail_locked(ep, true);
}

ucs_status_t AmConnections::on_auth(void* arg, const void* header, size_t header_length, void*,
                                    size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<AmConnections*>(arg);
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP)) return UCS_OK;
  const ucp_ep_h ep = param->reply_ep;
  AmAuthRequest q;
  std::memset(&q, 0, sizeof(q));
  const bool well_formed = header_length == sizeof(q) && length == 0 &&
                           !(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV);
  if (well_formed) std::memcpy(&q, header, sizeof(q));
  int64_t status = UCS_OK;
  {
    std::lock_guard<std::mutex> lock(self->mu_);
    auto it = self->conns_.find(ep);
    if (it == self->conns_.end() || it->second.failed) return UCS_OK;  // not ours, or closing
    if (it->second.authed) return UCS_OK;  // once is enough
    if (!well_formed || q.version != kAmAuthVersion || !am_cap_equal(q.cap, self->cap_)) {
      status = UCS_ERR_REJECTED;
      self->fail_locked(ep, true);
    } else if (self->authed_ >= self->max_connections_) {
      status = UCS_ERR_EXCEEDS_LIMIT;
      self->fail_locked(ep, false);
    } else {
      it->second.authed = true;
      --self->pending_;
      ++self->authed_;
    }
  }
  // The answer, on the connection itself (from within the handler: UCX
  // queues it; the header is copied).
  const AmAuthAck ack{q.nonce, status};
  ucp_request_param_t p;
  std::memset(&p, 0, sizeof(p));
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK;
  p.flags = UCP_AM_SEND_FLAG_COPY_HEADER | UCP_AM_SEND_FLAG_EAGER;
  p.cb.send = &free_request;
  ucs_status_ptr_t r = ucp_am_send_nbx(ep, kAmAuthAckId, &ack, sizeof(ack), nullptr, 0, &p);
  (void)r;  // an error or NULL: nothing to free; a request frees itself
  return UCS_OK;
}

void AmConnections::on_error(void* arg, ucp_ep_h ep, ucs_status_t) {
  auto* self = static_cast<AmConnections*>(arg);
  std::lock_guard<std::mutex> lock(self->mu_);
  self->fail_locked(ep, false);
}

void AmConnections::kick(uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& kv : conns_) {
    if (kv.second.id == id) {
      fail_locked(kv.first, false);
      return;
    }
  }
}

uint64_t AmConnections::id_of(ucp_ep_h ep) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = conns_.find(ep);
  return (it == conns_.end() || it->second.failed || !it->second.authed) ? 0 : it->second.id;
}

bool AmConnections::abort(uint64_t id, double timeout_s) {
  ucp_ep_h ep = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = conns_.begin(); it != conns_.end(); ++it) {
      if (it->second.id != id) continue;
      ep = it->first;
      if (!it->second.failed) --(it->second.authed ? authed_ : pending_);
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

std::vector<uint64_t> AmConnections::failed_ids() {
  std::lock_guard<std::mutex> lock(mu_);
  sweep_locked();
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
    sweep_locked();
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
  // lock, which a connection callback under way holds); nor an
  // authentication handled.
  if (listener_ != nullptr) ucp_listener_destroy(listener_);
  if (auth_) set_handler(worker_, auth_id_, nullptr, nullptr);
  listener_ = nullptr;
  std::vector<ucp_ep_h> all;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& kv : conns_) all.push_back(kv.first);
    conns_.clear();
    failed_.clear();
    authed_ = pending_ = 0;
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
  return Counts{authed_, accepted_, refused_, failures_, aborted_, pending_, unauthenticated_};
}

// ------------------------------------------------------------ client side

AmAuthClient::AmAuthClient(ucp_worker_h worker) : worker_(worker) {
  if (worker_ == nullptr) throw UcxError(kStatusBadArgument, "AmAuthClient: no worker");
  std::random_device rd;
  next_nonce_ = (uint64_t(rd()) << 32) ^ rd();
  set_handler(worker_, kAmAuthAckId, &AmAuthClient::on_ack, this);
  registered_ = true;
}

AmAuthClient::~AmAuthClient() { close(); }

void AmAuthClient::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!registered_) return;
    registered_ = false;
  }
  set_handler(worker_, kAmAuthAckId, nullptr, nullptr);
}

ucs_status_t AmAuthClient::on_ack(void* arg, const void* header, size_t header_length, void*,
                                  size_t, const ucp_am_recv_param_t*) {
  auto* self = static_cast<AmAuthClient*>(arg);
  if (header_length != sizeof(AmAuthAck)) return UCS_OK;
  AmAuthAck ack;
  std::memcpy(&ack, header, sizeof(ack));
  std::lock_guard<std::mutex> lock(self->mu_);
  auto it = self->answers_.find(ack.nonce);
  if (it != self->answers_.end()) it->second = static_cast<int32_t>(ack.status);
  return UCS_OK;
}

int32_t AmAuthClient::authenticate(ucp_ep_h ep, unsigned auth_id, const std::string& cap,
                                   double timeout_s) {
  if (cap.size() != kAmCapBytes) {
    throw UcxError(kStatusBadArgument, "a connection capability is " +
                                           std::to_string(kAmCapBytes) + " bytes");
  }
  constexpr int32_t kWaiting = 1;  // no ucs_status_t is positive
  AmAuthRequest q{kAmAuthVersion, 0, 0, {}};
  std::memcpy(q.cap, cap.data(), kAmCapBytes);
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!registered_) throw UcxError(UCS_ERR_CANCELED, "AmAuthClient: closed");
    q.nonce = next_nonce_++;
    answers_[q.nonce] = kWaiting;
  }
  ucp_request_param_t p;
  std::memset(&p, 0, sizeof(p));
  p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = UCP_AM_SEND_FLAG_COPY_HEADER | UCP_AM_SEND_FLAG_EAGER | UCP_AM_SEND_FLAG_REPLY;
  ucs_status_ptr_t r = ucp_am_send_nbx(ep, auth_id, &q, sizeof(q), nullptr, 0, &p);
  int32_t status = kWaiting;
  if (UCS_PTR_IS_ERR(r)) status = UCS_PTR_STATUS(r);
  const auto deadline = clock::now() + std::chrono::duration<double>(timeout_s);
  while (status == kWaiting) {
    if (ucp_worker_progress(worker_) == 0) {
      // A connection is made once: waiting a little costs nothing that matters.
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    std::lock_guard<std::mutex> lock(mu_);
    status = answers_[q.nonce];
    if (status == kWaiting && clock::now() > deadline) status = UCS_ERR_TIMED_OUT;
  }
  // The header was copied: UCX releases the request once it ends (with the
  // endpoint at worst).
  if (r != nullptr && !UCS_PTR_IS_ERR(r)) ucp_request_free(r);
  std::lock_guard<std::mutex> lock(mu_);
  answers_.erase(q.nonce);
  return status;
}

}  // namespace distore
