// Inserts by active message, the node's inbox (am_insert.h): the handler
// that takes writers' messages, what it holds of them and for how long, and
// the listener's connections they come on.
#include <algorithm>
#include <cstring>
#include <string>

#include "am_insert.h"
#include "status.h"

namespace distore {

namespace {

using clock = std::chrono::steady_clock;

// How long a failed batch's token is remembered (late messages released).
constexpr auto kDiscardMemory = std::chrono::seconds(300);
constexpr double kCloseTimeout = 1.0;  // s a forced close may progress the worker

}  // namespace

AmInbox::AmInbox(Owner worker, uintptr_t worker_handle, unsigned am_id, size_t max_messages)
    : worker_(std::move(worker)),
      worker_h_(reinterpret_cast<ucp_worker_h>(worker_handle)),
      am_id_(am_id),
      max_messages_(max_messages) {
  if (worker_h_ == nullptr) throw UcxError(kStatusBadArgument, "AmInbox: no worker");
  ucp_am_handler_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                     UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  param.id = am_id;
  // Whole messages only, and eager data we may keep until a pull takes it.
  param.flags = UCP_AM_FLAG_WHOLE_MSG | UCP_AM_FLAG_PERSISTENT_DATA;
  param.cb = &AmInbox::on_message;
  param.arg = this;
  check(ucp_worker_set_am_recv_handler(worker_h_, &param), "registering the insert handler");
  registered_ = true;
}

AmInbox::~AmInbox() { close(); }

uint16_t AmInbox::listen(const std::string& host, uint16_t port, size_t max_connections,
                         const std::string& key) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (connections_ != nullptr) {
      throw UcxError(kStatusBadArgument, "AmInbox.listen: it listens already");
    }
    if (!registered_) throw UcxError(UCS_ERR_CANCELED, "AmInbox.listen: the inbox is closed");
  }
  // Made outside the lock: creating the listener takes the worker's lock,
  // under which the message handler takes ours.
  auto made = std::make_unique<AmConnections>(worker_h_, host, port, max_connections, "insert",
                                              key, kAmInsertAuthId);
  const uint16_t chosen = made->port();
  std::lock_guard<std::mutex> lock(mu_);
  connections_ = std::move(made);
  return chosen;
}

AmConnections* AmInbox::connections_ptr() const {
  std::lock_guard<std::mutex> lock(mu_);
  return connections_.get();
}

bool AmInbox::abort(uint64_t conn) {
  AmConnections* c = connections_ptr();
  if (c == nullptr || conn == 0) return false;
  std::lock_guard<std::mutex> hold(release_mu_);
  release_messages_of({conn});  // while their endpoint still exists
  return c->abort(conn, kCloseTimeout);
}

void AmInbox::release_messages_of(const std::vector<uint64_t>& conns) {
  if (conns.empty()) return;
  std::vector<Message> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = messages_.begin(); it != messages_.end();) {
      if (std::find(conns.begin(), conns.end(), it->second.conn) != conns.end()) {
        unhold_locked(it->second);
        dropped.push_back(std::move(it->second));
        it = messages_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& m : dropped) release_locked(m);
}

AmConnections::Counts AmInbox::connections() const {
  AmConnections* c = connections_ptr();
  return c != nullptr ? c->counts() : AmConnections::Counts{};
}

uint64_t AmInbox::abandoned() const {
  std::lock_guard<std::mutex> lock(mu_);
  return abandoned_;
}

void AmInbox::count_abandoned(size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  abandoned_ += n;
}

void AmInbox::close() {
  std::vector<Message> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!registered_) return;
    registered_ = false;
    for (auto& kv : messages_) dropped.push_back(std::move(kv.second));
    messages_.clear();
    held_.clear();
    eager_ = 0;
    for (auto& m : deferred_) dropped.push_back(std::move(m));
    deferred_.clear();
  }
  ucp_am_handler_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                     UCP_AM_HANDLER_PARAM_FIELD_ARG;
  param.id = am_id_;
  param.cb = nullptr;
  param.arg = nullptr;
  ucp_worker_set_am_recv_handler(worker_h_, &param);
  // Released before the connections close: each release tells its sender.
  std::lock_guard<std::mutex> hold(release_mu_);
  for (auto& m : dropped) release_locked(m);
  if (AmConnections* c = connections_ptr()) c->close(kCloseTimeout);
}

bool AmInbox::discarded(uint64_t token) const {
  std::lock_guard<std::mutex> lock(mu_);
  return !registered_ || discarded_.count(token) != 0;
}

size_t AmInbox::waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return messages_.size() + deferred_.size();
}

uint64_t AmInbox::refused() const {
  std::lock_guard<std::mutex> lock(mu_);
  return refused_;
}

// UCX calls (which take the worker's lock) are never made under mu_: the
// handler runs under the worker's lock and takes mu_.
void AmInbox::release(Message& m) {
  std::lock_guard<std::mutex> hold(release_mu_);
  release_locked(m);
}

void AmInbox::release_later(Message&& m) {
  std::lock_guard<std::mutex> lock(mu_);
  deferred_.push_back(std::move(m));
}

void AmInbox::release_locked(Message& m) {
  if (m.desc != nullptr) ucp_am_data_release(worker_h_, m.desc);
  m.desc = nullptr;
  m.bytes.clear();
}

size_t AmInbox::expire(double max_age_s) {
  // Connection failures UCX has noticed are handled before any release
  // below acknowledges a message on its connection (see discard).
  for (int i = 0; i < 64 && ucp_worker_progress(worker_h_) != 0; ++i) {
  }
  std::vector<Message> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& m : deferred_) dropped.push_back(std::move(m));
    deferred_.clear();
    const auto now = clock::now();
    const auto age = std::chrono::duration<double>(max_age_s);
    for (auto it = messages_.begin(); it != messages_.end();) {
      if (now - it->second.arrived > age) {
        unhold_locked(it->second);
        dropped.push_back(std::move(it->second));
        it = messages_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto it = discarded_.begin(); it != discarded_.end();) {
      it = now - it->second > kDiscardMemory ? discarded_.erase(it) : std::next(it);
    }
  }
  std::lock_guard<std::mutex> hold(release_mu_);
  for (auto& m : dropped) release_locked(m);
  if (AmConnections* c = connections_ptr()) {
    // Messages of writers that failed are released while their endpoints
    // still exist, and only then are those endpoints closed.
    const std::vector<uint64_t> failed = c->failed_ids();
    release_messages_of(failed);
    c->reap(failed, kCloseTimeout);
  }
  return dropped.size();
}

void AmInbox::discard(uint64_t token, uint32_t count) {
  // No UCX call here: the caller is not the thread that progresses the
  // worker, and the writer of a discarded batch has usually just died.
  // Releasing a rendezvous message acknowledges it on its connection; sent
  // before UCX has handled that connection's failure (the next progress),
  // the acknowledgement went into a TCP endpoint UCX had half torn down,
  // and the node crashed inside UCX (uct_tcp_ep_am_short). The messages
  // are released by the next expire(), on the progressing thread, after a
  // progress that handles the failure.
  std::lock_guard<std::mutex> lock(mu_);
  for (uint32_t i = 0; i < count; ++i) {
    auto it = messages_.find(Key{token, i});
    if (it == messages_.end()) continue;
    unhold_locked(it->second);
    deferred_.push_back(std::move(it->second));
    messages_.erase(it);
  }
  discarded_[token] = clock::now();
}

bool AmInbox::take(uint64_t token, uint32_t index, Message* out) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = messages_.find(Key{token, index});
  if (it == messages_.end()) return false;
  unhold_locked(it->second);
  *out = std::move(it->second);
  messages_.erase(it);
  return true;
}

ucs_status_t AmInbox::on_message(void* arg, const void* header, size_t header_length,
                                 void* data, size_t length, const ucp_am_recv_param_t* param) {
  auto* self = static_cast<AmInbox*>(arg);
  AmInsertRunHeader h{};
  const bool single = header_length == sizeof(AmInsertHeader);
  if (self == nullptr || (!single && header_length != sizeof(AmInsertRunHeader))) {
    if (self != nullptr) {
      std::lock_guard<std::mutex> lock(self->mu_);
      ++self->refused_;
    }
    return UCS_OK;  // not ours to keep: UCX releases it (a rendezvous sender gets an error)
  }
  std::memcpy(&h, header, header_length);
  return self->receive(h.head, single ? 1 : h.run, data, length, param);
}

void AmInbox::unhold_locked(const Message& m) {
  eager_ -= m.eager;
  auto it = held_.find(m.conn);
  if (it == held_.end()) return;
  it->second.eager -= m.eager;
  if (--it->second.messages == 0) held_.erase(it);
}

ucs_status_t AmInbox::receive(const AmInsertHeader& h, uint32_t run, void* data, size_t length,
                              const ucp_am_recv_param_t* param) {
  std::lock_guard<std::mutex> lock(mu_);
  const bool rndv = param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV;
  const bool persistent = param->recv_attr & UCP_AM_RECV_ATTR_FLAG_DATA;
  uint64_t conn = 0;
  if (connections_ != nullptr) {
    // Listening: only the connections it accepted (peer-failure handling)
    // may hand it a receive; others (and messages sent without the reply
    // flag) are refused.
    if (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) {
      conn = connections_->id_of(param->reply_ep);
    }
    if (conn == 0) {
      ++refused_;
      return UCS_OK;
    }
  }
  // Eager data is held here (persistent) or copied: counted against the
  // bounds; a rendezvous message holds only UCX's descriptor.
  const uint64_t eager = rndv ? 0 : length;
  auto held = held_.find(conn);
  const Held mine = held != held_.end() ? held->second : Held{};
  if (!registered_ || h.index >= h.count || run == 0 || run > h.count - h.index ||
      (run > 1 && length > kRunBytes) || messages_.size() >= max_messages_ ||
      mine.messages >= kMaxPerConnection || mine.eager + eager > kMaxEagerPerConnection ||
      eager_ + eager > kMaxEagerBytes || discarded_.count(h.token) != 0 ||
      messages_.count(Key{h.token, h.index}) != 0) {
    ++refused_;
    return UCS_OK;  // dropped: a rendezvous sender's request completes with an error
  }
  Held& hold = held_[conn];
  ++hold.messages;
  hold.eager += eager;
  eager_ += eager;
  Message m;
  m.conn = conn;
  m.eager = eager;
  m.length = length;
  m.rndv = rndv;
  m.run = run;
  m.arrived = clock::now();
  if (rndv || persistent) {
    m.desc = data;  // kept until a pull receives or releases it
  } else {
    const auto* p = static_cast<const uint8_t*>(data);
    m.bytes.assign(p, p + length);
  }
  messages_.emplace(Key{h.token, h.index}, std::move(m));
  return (rndv || persistent) ? UCS_INPROGRESS : UCS_OK;
}

}  // namespace distore
