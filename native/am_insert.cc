#include "am_insert.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>

#include "guard.h"
#include "idle_wait.h"
#include "status.h"

namespace distore {

namespace {

constexpr uint64_t kHeader = 16;  // key, generation (spec.SLOT_HEADER)
using clock = std::chrono::steady_clock;

// How long a failed batch's token is remembered (late messages released).
constexpr auto kDiscardMemory = std::chrono::seconds(300);
// Receives under way when their batch is discarded get this long to end by
// themselves (a dead writer's fail at once) before their connection is
// force-closed: a writer that only closed its control connection may have
// other batches in flight on the same UCX connection.
constexpr auto kDiscardGrace = std::chrono::seconds(1);
// How long a forced close gets to end the receives on its connection
// before they are left to UCX (it has always ended them when tested).
constexpr auto kAbortWait = std::chrono::seconds(5);
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

void am_send(const Endpoint& ep, const MemoryRegion& region, unsigned am_id, uint64_t token,
             const uint64_t* offsets, const uint64_t* lengths, size_t n, uint64_t run_bytes) {
  if (n > UINT32_MAX) throw UcxError(kStatusBadArgument, "am_send: too many items", ep.peer());
  for (size_t i = 0; i < n; ++i) {
    if (lengths[i] > region.size() || offsets[i] > region.size() - lengths[i]) {
      throw UcxError(kStatusOutOfBounds,
                     "am_send: item " + std::to_string(i) + " lies outside the staging buffer",
                     ep.peer());
    }
  }
  if (!ep.alive()) {
    throw UcxError(ep.status(), "the endpoint to " + ep.peer() + " has failed", ep.peer());
  }
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_MEMH;
  // Rendezvous always (the node receives each item straight into its slot);
  // the header is copied, so it need not outlive the call; the reply flag
  // tells the node which of its connections the message came on.
  param.flags = UCP_AM_SEND_FLAG_RNDV | UCP_AM_SEND_FLAG_COPY_HEADER | UCP_AM_SEND_FLAG_REPLY;
  // The staging buffer's own registration, not one UCX looks up in its
  // cache: a send aborted after the node was told where to read it (the
  // node died, or the writer closed while the node still held the batch)
  // then ends at once. With a cached registration UCX invalidates it and
  // ends the send only once the buffer is unmapped, on this worker: a
  // request held until then, and a crash or a hang if the worker went
  // first (ucp_request_memh_invalidate; test_held_sends.py).
  param.memh = region.memh();
  auto* base = reinterpret_cast<char*>(region.address());
  for (size_t i = 0; i < n;) {
    // A run: the items after i that follow it in the buffer, up to run_bytes.
    size_t k = 1;
    uint64_t bytes = lengths[i];
    while (run_bytes > 0 && i + k < n &&
           offsets[i + k] == offsets[i + k - 1] + lengths[i + k - 1] &&
           bytes + lengths[i + k] <= run_bytes) {
      bytes += lengths[i + k];
      ++k;
    }
    AmInsertRunHeader h{{token, static_cast<uint32_t>(i), static_cast<uint32_t>(n)},
                        static_cast<uint32_t>(k), 0};
    // A single item keeps the short header (what nodes without runs take).
    const size_t header_length = k == 1 ? sizeof(AmInsertHeader) : sizeof(AmInsertRunHeader);
    ucs_status_ptr_t r =
        ucp_am_send_nbx(ep.ep(), am_id, &h, header_length, base + offsets[i], bytes, &param);
    if (UCS_PTR_IS_ERR(r)) {
      throw UcxError(UCS_PTR_STATUS(r),
                     "posting insert message " + std::to_string(i) + " to " + ep.peer() +
                         " failed: " + status_name(UCS_PTR_STATUS(r)),
                     ep.peer());
    }
    if (r != nullptr) ucp_request_free(r);  // released by UCX once complete
    i += k;
  }
}

size_t am_send_raw(const Endpoint& ep, unsigned am_id, const std::string& header,
                   const std::string& data, size_t count, bool eager, double timeout_s) {
  // Kept until every request ended (or for good, if one never does).
  auto* payload = new std::string(data);
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_AM_SEND_FLAG_COPY_HEADER | (eager ? UCP_AM_SEND_FLAG_EAGER
                                                      : UCP_AM_SEND_FLAG_RNDV);
  std::vector<void*> pending;
  size_t ok = 0;
  for (size_t i = 0; i < count && ep.alive(); ++i) {
    ucs_status_ptr_t r = ucp_am_send_nbx(ep.ep(), am_id, header.data(), header.size(),
                                         payload->data(), payload->size(), &param);
    if (r == nullptr) {
      ++ok;
    } else if (!UCS_PTR_IS_ERR(r)) {
      pending.push_back(r);
    }
    if (pending.size() >= 256 || i + 1 == count) {
      const auto deadline = clock::now() + std::chrono::duration<double>(timeout_s);
      while (!pending.empty() && clock::now() < deadline) {
        ucp_worker_progress(ep.worker());
        for (size_t k = 0; k < pending.size();) {
          const ucs_status_t s = ucp_request_check_status(pending[k]);
          if (s == UCS_INPROGRESS) {
            ++k;
            continue;
          }
          ok += s == UCS_OK;
          ucp_request_free(pending[k]);
          pending[k] = pending.back();
          pending.pop_back();
        }
      }
      if (!pending.empty()) break;  // the node does not take them: stop sending
    }
  }
  for (void* r : pending) ucp_request_free(r);  // UCX releases them if they ever end
  if (pending.empty()) delete payload;
  return ok;
}

void pull_am(const MemoryRegion& arena, const MemoryRegion& dest, AmInbox& inbox,
             uint64_t token, const PullItem* items, size_t n, double timeout_s,
             int32_t* statuses) {
  validate_pull(arena, 0, UINT64_MAX, items, n);
  if (dest.address() != arena.local_address() || dest.size() < arena.size()) {
    throw UcxError(kStatusBadArgument, "pull_am: dest is not the arena's writable alias");
  }
  ucp_worker_h worker = inbox.worker();
  auto* base = reinterpret_cast<uint8_t*>(arena.local_address());
  for (size_t i = 0; i < n; ++i) store_header(base, items[i].slot_offset, 0, 0);
  std::atomic_thread_fence(std::memory_order_release);

  // Straight into a slot: the arena alias's registration; into a bounce
  // chunk (a run): UCX's own (its registration cache).
  ucp_request_param_t to_slot;
  std::memset(&to_slot, 0, sizeof(to_slot));
  to_slot.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
  to_slot.memh = dest.memh();
  ucp_request_param_t to_chunk;
  std::memset(&to_chunk, 0, sizeof(to_chunk));

  // An item waits for its message; the first item of a message holds it
  // until a bounce chunk is free (a run), or is being received; the run's
  // other items are covered by it meanwhile; then each is done.
  enum : uint8_t { kWaiting, kHeld, kReceiving, kCovered, kDone };
  std::vector<uint8_t> state(n, kWaiting);
  // Per message, at the index of its first item: the request, the
  // connection it is on, the items it carries, the chunk it lands in.
  std::vector<void*> requests(n, nullptr);
  std::vector<uint64_t> conns(n, 0);
  std::vector<uint32_t> runs(n, 1);
  std::vector<uint8_t*> chunks(n, nullptr);
  std::vector<AmInbox::Message> held;  // messages of kHeld runs, by first item
  // receiving: messages under way; next: the first item perhaps not done.
  size_t left = n, receiving = 0, next = 0;
  const auto deadline = clock::now() + std::chrono::duration<double>(timeout_s);
  // When receives still under way are ended by force (their connections
  // closed), and when that was done.
  auto force_at = clock::time_point::max();
  auto forced_at = clock::time_point::max();
  IdleWait wait;
  unsigned idle = 0, checks = 0;
  bool late = false, discarded = false;
  auto slot_of = [&](size_t i) { return base + items[i].slot_offset + kHeader; };
  auto landing = [&](size_t i) { return chunks[i] != nullptr ? chunks[i] : slot_of(i); };
  auto bytes_of = [&](size_t i) {  // of the message whose first item is i
    uint64_t b = 0;
    for (size_t j = i; j < i + runs[i]; ++j) b += items[j].length;
    return b;
  };
  // Ends the message whose first item is i: each of its items gets status s.
  // `tainted`: UCX may still write its chunk (a receive left to it).
  auto finish = [&](size_t i, int32_t s, bool tainted = false) {
    if (state[i] == kReceiving) {
      --receiving;
      close_put_window(reinterpret_cast<uint64_t>(landing(i)), bytes_of(i));
    }
    if (chunks[i] != nullptr) {
      inbox.chunk_pool().give(chunks[i], tainted);
      chunks[i] = nullptr;
    }
    for (size_t j = i; j < i + runs[i]; ++j) {
      statuses[j] = s;
      state[j] = kDone;
      --left;
    }
  };
  // A run's items from where they landed (`from`) into their slots.
  auto scatter = [&](size_t i, const uint8_t* from) {
    for (size_t j = i; j < i + runs[i]; ++j) {
      std::memcpy(slot_of(j), from, items[j].length);
      from += items[j].length;
    }
  };
  // A receive ended: a run's items go from its chunk into their slots.
  auto received = [&](size_t i, int32_t s) {
    if (s == UCS_OK && chunks[i] != nullptr) scatter(i, chunks[i]);
    finish(i, s);
  };
  // Posts the receive of message m (items i .. i + runs[i] - 1) into where
  // it lands; the run's chunk, if any, is chunks[i] already.
  auto start = [&](size_t i, AmInbox::Message& m) {
    // A rendezvous receive is the one place a peer's TCP put may land in
    // this process (guard.h): where the message lands (its slot, or its
    // chunk) is open to puts until finish() ends it.
    uint8_t* to = landing(i);
    open_put_window(reinterpret_cast<uint64_t>(to), m.length);  // == bytes_of(i)
    conns[i] = m.conn;
    state[i] = kReceiving;
    for (size_t j = i + 1; j < i + runs[i]; ++j) state[j] = kCovered;
    ++receiving;
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker, m.desc, to, m.length,
                                              chunks[i] != nullptr ? &to_chunk : &to_slot);
    if (r == nullptr) {
      received(i, UCS_OK);
    } else if (UCS_PTR_IS_ERR(r)) {
      finish(i, UCS_PTR_STATUS(r));
    } else {
      requests[i] = r;
    }
  };
  // Messages held for a chunk go back to UCX unreceived; their items fail.
  // `later`: at the inbox's next expire (their writer may have just died,
  // see discard); else now, before their connection may be force-closed.
  auto drop_held = [&](int32_t s, bool later) {
    for (size_t i = 0; i < n; ++i) {
      if (state[i] != kHeld) continue;
      if (later) {
        inbox.release_later(std::move(held[i]));
      } else {
        inbox.release(held[i]);
      }
      finish(i, s);
    }
  };
  // Receives UCX will not end (see the header): their requests go back to UCX.
  auto leave_to_ucx = [&](bool unaccepted_only, int32_t s) {
    size_t left_to_ucx = 0;
    for (size_t i = 0; i < n; ++i) {
      if (state[i] != kReceiving || (unaccepted_only && conns[i] != 0)) continue;
      ucp_request_free(requests[i]);  // UCX releases it if it ever ends
      requests[i] = nullptr;
      left_to_ucx += conns[i] != 0;
      finish(i, s, true);
    }
    if (left_to_ucx) inbox.count_abandoned(left_to_ucx);
  };
  while (left > 0) {
    unsigned events = ucp_worker_progress(worker);
    for (size_t i = next; i < n; ++i) {
      if (state[i] == kReceiving) {
        const ucs_status_t s = ucp_request_check_status(requests[i]);
        if (s == UCS_INPROGRESS) continue;
        ucp_request_free(requests[i]);
        requests[i] = nullptr;
        received(i, s);
        events = 1;
        continue;
      }
      if (state[i] == kHeld) {
        if ((chunks[i] = inbox.chunk_pool().take()) == nullptr) continue;
        start(i, held[i]);
        events = 1;
        continue;
      }
      if (state[i] != kWaiting) continue;
      AmInbox::Message m;
      if (!inbox.take(token, static_cast<uint32_t>(i), &m)) continue;
      events = 1;
      // The message's items: all still waiting, and its length theirs.
      size_t k = m.run, bytes = 0, waiting = 0;
      for (size_t j = i; j < std::min(n, i + k); ++j) {
        bytes += items[j].length;
        waiting += state[j] == kWaiting;
      }
      if (i + k > n || waiting != k || m.length != bytes) {
        inbox.release(m);
        // Its items fail (those no other message has taken): a writer that
        // sends such a run sends nothing else for them.
        for (size_t j = i; j < std::min(n, i + k); ++j) {
          if (state[j] == kWaiting) finish(j, UCS_ERR_MESSAGE_TRUNCATED);
        }
        continue;
      }
      runs[i] = static_cast<uint32_t>(k);
      if (!m.rndv) {  // eager: the bytes are here already
        scatter(i, m.desc != nullptr ? static_cast<const uint8_t*>(m.desc) : m.bytes.data());
        inbox.release(m);
        finish(i, UCS_OK);
      } else if (k == 1) {
        start(i, m);
      } else if ((chunks[i] = inbox.chunk_pool().take()) != nullptr) {
        start(i, m);
      } else {  // every chunk is out: held until one comes back
        if (held.size() < n) held.resize(n);
        held[i] = std::move(m);
        state[i] = kHeld;
        for (size_t j = i + 1; j < i + k; ++j) state[j] = kCovered;
      }
    }
    while (next < n && state[next] == kDone) ++next;
    if (left == 0) break;
    if (!discarded && (events != 0 ? (++checks & 63) == 0 : (idle & 15) == 0) &&
        inbox.discarded(token)) {
      // The writer is gone (or the node stops): nothing more will come.
      discarded = true;
      drop_held(UCS_ERR_CANCELED, true);
      for (size_t i = 0; i < n; ++i) {
        if (state[i] == kWaiting) finish(i, UCS_ERR_CANCELED);
      }
      // Receives from endpoints the inbox did not accept: nothing can end them.
      leave_to_ucx(true, UCS_ERR_CONNECTION_RESET);
      force_at = std::min(force_at, clock::now() + kDiscardGrace);
      events = 1;
    }
    if (!late && (idle & 255) == 0 && clock::now() > deadline) {
      // Items whose message never came (or waits for a chunk) fail now;
      // receives under way are ended by force below.
      late = true;
      drop_held(UCS_ERR_TIMED_OUT, false);
      for (size_t i = 0; i < n; ++i) {
        if (state[i] == kWaiting) finish(i, UCS_ERR_TIMED_OUT);
      }
      force_at = std::min(force_at, clock::now());
    }
    if (receiving > 0 && forced_at == clock::time_point::max() && clock::now() >= force_at) {
      // The writer hangs, or left: close its connections by force, which
      // ends their receives with an error (UCX purges the endpoint's
      // requests) and closes their sockets, so nothing lands after.
      forced_at = clock::now();
      std::vector<uint64_t> aborted;
      for (size_t i = 0; i < n; ++i) {
        if (state[i] != kReceiving || conns[i] == 0) continue;
        if (std::find(aborted.begin(), aborted.end(), conns[i]) != aborted.end()) continue;
        aborted.push_back(conns[i]);
        inbox.abort(conns[i]);
      }
      events = 1;
    }
    if (receiving > 0 && forced_at != clock::time_point::max() &&
        clock::now() > forced_at + kAbortWait) {
      // Closed by force and still not ended (never seen): left to UCX; the
      // sockets they came on are closed.
      leave_to_ucx(false, UCS_ERR_CANCELED);
      break;
    }
    if (events != 0) {
      wait.reset();
      idle = 0;
      continue;
    }
    // Nothing moved: pause (the writer's progress thread may need the core
    // we would spin on), as the gather does.
    idle = wait.pause(late || discarded);
  }

  std::atomic_thread_fence(std::memory_order_release);
  for (size_t i = 0; i < n; ++i) {
    if (statuses[i] == UCS_OK) {
      store_header(base, items[i].slot_offset, items[i].key, items[i].generation);
    }
  }
}

}  // namespace distore
