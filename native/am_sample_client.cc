// Samples by active message, the learner's side (am_sample.h): one request
// to each node, receiving each part straight into its rows.
#include <poll.h>

#include <chrono>
#include <cstring>
#include <random>
#include <string>

#include "am_sample.h"
#include "am_sample_util.h"
#include "idle_wait.h"
#include "status.h"

namespace distore {

using namespace am_sample_detail;  // NOLINT: this file's own helpers

namespace {

// Past the deadline, receives under way get this long to end by themselves
// before their endpoints are force-closed.
constexpr auto kGrace = std::chrono::milliseconds(500);
// A fetch polls its worker this long without result before it sleeps on
// the worker's event fd.
constexpr auto kSpin = std::chrono::microseconds(20);

}  // namespace

// ------------------------------------------------------------ learner side

struct AmSampleClient::Batch {
  enum : uint8_t { kWaiting, kReceiving, kDone };
  struct Ref {
    AmSampleClient* client;
    Batch* batch;
    size_t part;
  };
  uint64_t token = 0;
  size_t n = 0, parts = 0;
  bool header_only = false;
  const BatchLayout* layout = nullptr;
  uint8_t* base = nullptr;
  ucp_mem_h memh = nullptr;
  const uint64_t* rows = nullptr;
  const uint32_t* node = nullptr;
  std::vector<uint8_t> state;   // per part
  std::vector<void*> requests;  // per part: a receive's request, freed by fetch
  std::vector<Ref> refs;        // per part: a receive's user data
  std::vector<uint32_t> span;   // per part: items a receive starting there carries
  std::vector<uint32_t> run;    // per item: the first item of its run (joined items)
  std::vector<int32_t> status;  // per item
  std::vector<uint64_t> key, generation;
  std::vector<uint8_t> have_header;
  size_t left = 0;       // parts not done
  size_t receiving = 0;  // parts in kReceiving
  unsigned events = 0;   // things that happened since fetch last looked

  // Under the client's mutex.
  void done(size_t part, int32_t s) {
    const size_t item = part / parts;
    if (state[part] == kReceiving) --receiving;
    state[part] = kDone;
    --left;
    ++events;
    if (s != UCS_OK && status[item] == UCS_OK) status[item] = s;
  }
  void fail_waiting(size_t item, int32_t s) {
    for (size_t k = item * parts; k < (item + 1) * parts; ++k) {
      if (state[k] == kWaiting) done(k, s);
    }
  }
  // The receive into `part` (and the same part of the span - 1 items after
  // it) ended.
  void done_span(size_t part, int32_t s) {
    for (size_t k = 0, at = part; k < span[part]; ++k, at += parts) {
      if (state[at] == kReceiving) done(at, s);
    }
  }
};

namespace {

void on_received(void*, ucs_status_t status, size_t, void* user_data) {
  auto* ref = static_cast<AmSampleClient::Batch::Ref*>(user_data);
  ref->client->received(ref->batch, ref->part, status);
}

}  // namespace

void AmSampleClient::received(Batch* b, size_t part, int32_t status) {
  std::lock_guard<std::mutex> lock(mu_);
  b->done_span(part, status);
}

AmSampleClient::AmSampleClient(Owner worker, uintptr_t worker_handle, unsigned request_id,
                               unsigned data_id, uint64_t client_id)
    : worker_(std::move(worker)),
      worker_h_(reinterpret_cast<ucp_worker_h>(worker_handle)),
      request_id_(request_id),
      data_id_(data_id),
      client_id_(client_id) {
  if (worker_h_ == nullptr) throw UcxError(kStatusBadArgument, "AmSampleClient: no worker");
  std::random_device rd;
  next_token_ = (uint64_t(rd()) << 32) ^ rd();
  set_am_handler(worker_h_, data_id, &AmSampleClient::on_data, this,
                 "registering the sample data handler");
  registered_ = true;
  // Without UCP_FEATURE_WAKEUP there is no event fd: fetch then paces
  // itself with IdleWait.
  if (ucp_worker_get_efd(worker_h_, &efd_) != UCS_OK) efd_ = -1;
}

AmSampleClient::~AmSampleClient() { close(); }

void AmSampleClient::close() {
  {
    std::unique_lock<std::mutex> lock(life_mu_);
    if (!registered_) return;
    registered_ = false;  // no new fetch starts
    idle_.wait(lock, [this] { return active_ == 0; });
  }
  set_am_handler(worker_h_, data_id_, nullptr, nullptr, "");
  std::lock_guard<std::mutex> lock(sends_mu_);
  reap_sends(true);
}

AmSampleClient::Stats AmSampleClient::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

void AmSampleClient::reap_sends(bool abandon) {
  for (size_t i = 0; i < sends_.size();) {
    PendingSend& s = sends_[i];
    if (ucp_request_check_status(s.request) == UCS_INPROGRESS && !abandon) {
      ++i;
      continue;
    }
    if (ucp_request_check_status(s.request) == UCS_INPROGRESS) {
      // Closing with a request still unsent to a node that reads nothing:
      // UCX may still read its buffer, which is left to it.
      new std::vector<uint8_t>(std::move(s.buffer));
    }
    ucp_request_free(s.request);
    sends_[i] = std::move(sends_.back());
    sends_.pop_back();
  }
}

ucs_status_t AmSampleClient::on_data(void* arg, const void* header, size_t header_length,
                                     void* data, size_t length,
                                     const ucp_am_recv_param_t* param) {
  auto* self = static_cast<AmSampleClient*>(arg);
  AmSampleReply h;
  size_t carried = 0;  // slot headers after the reply header
  bool ok = header_length >= sizeof(h) &&
            (header_length - sizeof(h)) % sizeof(AmSampleSlotHeader) == 0;
  if (ok) {
    std::memcpy(&h, header, sizeof(h));
    carried = (header_length - sizeof(h)) / sizeof(AmSampleSlotHeader);
    ok = carried <= kAmSampleMaxRun && carried == ((h.flags & kAmSampleRefused) ? 0 : h.count);
  }
  if (!ok) {
    std::lock_guard<std::mutex> lock(self->mu_);
    ++self->stats_.malformed;
    return UCS_OK;  // dropped (a rendezvous sender's request ends)
  }
  AmSampleSlotHeader slots[kAmSampleMaxRun];
  std::memcpy(slots, static_cast<const uint8_t*>(header) + sizeof(h),
              carried * sizeof(AmSampleSlotHeader));
  return self->receive(h, slots, data, length, param);
}

ucs_status_t AmSampleClient::receive(const AmSampleReply& h, const AmSampleSlotHeader* slots,
                                     void* data, size_t length,
                                     const ucp_am_recv_param_t* param) {
  std::unique_lock<std::mutex> lock(mu_);
  auto found = batches_.find(h.token);
  if (found == batches_.end()) {
    ++stats_.late;
    return UCS_OK;
  }
  Batch* b = found->second;
  ++b->events;
  if (h.flags & kAmSampleRefused) {
    ++stats_.refused;
    const auto s = static_cast<int32_t>(static_cast<int64_t>(h.status));
    for (size_t i = 0; i < b->n; ++i) {
      if (b->node[i] == h.index) b->fail_waiting(i, s == UCS_OK ? UCS_ERR_REJECTED : s);
    }
    return UCS_OK;
  }
  const size_t count = h.count;
  if (count == 0 || h.index >= b->n || count > b->n - h.index || h.part >= b->parts ||
      b->run[h.index + count - 1] != b->run[h.index]) {  // several items: one run only
    ++stats_.malformed;
    return UCS_OK;
  }
  const size_t first = h.index;
  const size_t head = first * b->parts + h.part;  // the first item's part
  for (size_t k = 0, at = head; k < count; ++k, at += b->parts) {
    if (b->state[at] != Batch::kWaiting) {
      ++stats_.late;  // a duplicate, or an item already failed
      return UCS_OK;
    }
  }
  const uint64_t want = b->header_only ? 0 : b->layout->fields()[h.part].length * count;
  b->span[head] = static_cast<uint32_t>(count);
  if (length != want) {
    ++stats_.malformed;
    for (size_t k = 0, at = head; k < count; ++k, at += b->parts) {
      b->done(at, UCS_ERR_MESSAGE_TRUNCATED);
    }
    return UCS_OK;
  }
  for (size_t k = 0; k < count; ++k) {
    const size_t item = first + k;
    if (!b->have_header[item]) {
      b->have_header[item] = 1;
      b->key[item] = slots[k].key;
      b->generation[item] = slots[k].generation;
    } else if (b->key[item] != slots[k].key || b->generation[item] != slots[k].generation) {
      if (b->status[item] == UCS_OK) b->status[item] = kStatusTorn;
    }
  }
  if (length == 0) {
    for (size_t k = 0, at = head; k < count; ++k, at += b->parts) b->done(at, UCS_OK);
    return UCS_OK;
  }
  // The run's rows are consecutive (fetch joined them): one stretch.
  uint8_t* dest = b->base + b->layout->field_at(h.part, b->rows[first]);
  if (!(param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV)) {
    std::memcpy(dest, data, length);  // eager: UCX hands the bytes to this call only
    for (size_t k = 0, at = head; k < count; ++k, at += b->parts) b->done(at, UCS_OK);
    return UCS_OK;
  }
  // Claimed before the mutex is let go: fetch does not end the batch while
  // a part is being received.
  for (size_t k = 0, at = head; k < count; ++k, at += b->parts) {
    b->state[at] = Batch::kReceiving;
    ++b->receiving;
  }
  Batch::Ref* ref = &b->refs[head];
  ucp_mem_h memh = b->memh;
  lock.unlock();
  ucp_request_param_t p;
  std::memset(&p, 0, sizeof(p));
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  if (memh != nullptr) {
    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
    p.memh = memh;
  }
  p.cb.recv_am = &on_received;
  p.user_data = ref;
  ucs_status_ptr_t r = ucp_am_recv_data_nbx(worker_h_, data, dest, length, &p);
  lock.lock();
  if (r == nullptr) {
    b->done_span(head, UCS_OK);
  } else if (UCS_PTR_IS_ERR(r)) {
    b->done_span(head, UCS_PTR_STATUS(r));
  } else {
    b->requests[head] = r;  // completes through on_received; freed by fetch
  }
  // A receive under way keeps the descriptor; UCS_OK is what the API wants
  // once ucp_am_recv_data_nbx was called from the callback.
  return UCS_OK;
}

void AmSampleClient::fetch(const std::vector<Endpoint*>& eps, const uint32_t* node,
                           const uint64_t* slot_offset, const uint32_t* tags,
                           uint64_t slot_size, const uint64_t* rows, size_t n,
                           const BatchLayout& layout, const MemoryRegion& dest,
                           double timeout_s, uint64_t rndv_min, double stall_s,
                           int32_t* statuses) {
  {
    std::lock_guard<std::mutex> lock(life_mu_);
    if (!registered_) throw UcxError(UCS_ERR_CANCELED, "AmSampleClient: closed");
    ++active_;
  }
  struct Active {  // close() waits for this fetch, also when it throws
    AmSampleClient* self;
    ~Active() {
      std::lock_guard<std::mutex> lock(self->life_mu_);
      if (--self->active_ == 0) self->idle_.notify_all();
    }
  } active{this};
  layout.check(rows, n, dest.size());
  if (n > UINT32_MAX) throw UcxError(kStatusBadArgument, "am sample: too many items");
  const auto& fields = layout.fields();
  if (fields.size() > kAmSampleMaxParts) {
    throw UcxError(kStatusBadArgument, "am sample: more than " +
                                           std::to_string(kAmSampleMaxParts) + " fields");
  }
  std::vector<std::vector<uint32_t>> of(eps.size());  // items per node
  for (size_t i = 0; i < n; ++i) {
    if (node[i] >= eps.size() || eps[node[i]] == nullptr) {
      throw UcxError(kStatusBadArgument, "item " + std::to_string(i) + ": node index " +
                                             std::to_string(node[i]) + " out of range");
    }
    if (slot_offset[i] % 8 != 0) {
      throw UcxError(kStatusOutOfBounds, "item " + std::to_string(i) + ": slot offset " +
                                             std::to_string(slot_offset[i]) + " is not aligned");
    }
    of[node[i]].push_back(static_cast<uint32_t>(i));
  }
  for (size_t e = 0; e < eps.size(); ++e) {
    if (of[e].empty()) continue;
    if (eps[e]->worker() != worker_h_) {
      throw UcxError(kStatusBadArgument, "am sample: the endpoint to " + eps[e]->peer() +
                                             " is on another worker than the client's",
                     eps[e]->peer());
    }
    if (of[e].size() > kAmSampleMaxItems) {
      throw UcxError(kStatusBadArgument, "am sample: more than " +
                                             std::to_string(kAmSampleMaxItems) +
                                             " items from one node");
    }
  }
  {
    std::lock_guard<std::mutex> lock(sends_mu_);
    reap_sends(false);
  }

  Batch b;
  b.n = n;
  b.header_only = fields.empty();
  b.parts = b.header_only ? 1 : fields.size();
  b.layout = &layout;
  b.base = reinterpret_cast<uint8_t*>(dest.local_address());
  b.memh = dest.memh();
  b.rows = rows;
  b.node = node;
  b.state.assign(n * b.parts, Batch::kWaiting);
  b.requests.assign(n * b.parts, nullptr);
  b.refs.resize(n * b.parts);
  b.span.assign(n * b.parts, 1);
  // Runs: a node's item joins the one before it in the request when it is
  // the next item of the batch and goes to the next row (always so for a
  // batch from one node read whole); the node may then send a part of
  // several of them in one message, which lands in one stretch.
  b.run.resize(n);
  for (size_t i = 0; i < n; ++i) b.run[i] = static_cast<uint32_t>(i);
  std::vector<uint8_t> joined(n, 0);
  for (size_t e = 0; e < eps.size(); ++e) {
    for (size_t j = 1; j < of[e].size(); ++j) {
      const uint32_t i = of[e][j], prev = of[e][j - 1];
      if (i == prev + 1 && rows[i] == rows[prev] + 1) {
        joined[i] = 1;
        b.run[i] = b.run[prev];
      }
    }
  }
  for (size_t k = 0; k < b.refs.size(); ++k) b.refs[k] = Batch::Ref{this, &b, k};
  b.status.assign(n, UCS_OK);
  b.key.assign(n, 0);
  b.generation.assign(n, 0);
  b.have_header.assign(n, 0);
  b.left = n * b.parts;
  {
    std::lock_guard<std::mutex> lock(mu_);
    b.token = next_token_++;
    batches_[b.token] = &b;
    ++stats_.batches;
  }

  // One request per node: the parts to send, then the items.
  std::vector<AmSamplePart> parts(fields.size());
  for (size_t k = 0; k < fields.size(); ++k) parts[k] = {fields[k].src, fields[k].length};
  ucp_request_param_t sp;
  std::memset(&sp, 0, sizeof(sp));
  sp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  sp.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_COPY_HEADER | UCP_AM_SEND_FLAG_EAGER;
  for (size_t e = 0; e < eps.size(); ++e) {
    if (of[e].empty()) continue;
    Endpoint& ep = *eps[e];
    int32_t failed = UCS_OK;
    if (!ep.alive()) {
      failed = ep.status();
    } else {
      AmSampleRequest q{kAmSampleVersion,
                        static_cast<uint32_t>(e),
                        b.token,
                        client_id_,
                        static_cast<uint32_t>(of[e].size()),
                        static_cast<uint32_t>(parts.size()),
                        rndv_min,
                        slot_size};
      std::vector<uint8_t> buf(parts.size() * sizeof(AmSamplePart) +
                               of[e].size() * sizeof(AmSampleItem));
      if (!parts.empty()) std::memcpy(buf.data(), parts.data(), parts.size() * sizeof(AmSamplePart));
      auto* items = reinterpret_cast<AmSampleItem*>(buf.data() + parts.size() * sizeof(AmSamplePart));
      for (size_t j = 0; j < of[e].size(); ++j) {
        const uint32_t i = of[e][j];
        items[j] = AmSampleItem{slot_offset[i], i, joined[i], tags != nullptr ? tags[i] : 0, 0};
      }
      ucs_status_ptr_t r =
          ucp_am_send_nbx(ep.ep(), request_id_, &q, sizeof(q), buf.data(), buf.size(), &sp);
      if (UCS_PTR_IS_ERR(r)) {
        failed = UCS_PTR_STATUS(r);
      } else if (r != nullptr) {
        std::lock_guard<std::mutex> lock(sends_mu_);
        sends_.push_back(PendingSend{r, std::move(buf)});
      }
    }
    if (failed != UCS_OK) {
      std::lock_guard<std::mutex> lock(mu_);
      for (uint32_t i : of[e]) b.fail_waiting(i, failed);
    }
  }

  // Progress until every part has landed or failed. After a short stretch
  // of fruitless progress, sleep in the kernel until the worker has
  // something (its event fd), as `ucx_perftest -E sleep` does: the node's
  // progress thread needs the core we would spin on (idle_wait.h says the
  // same of the gather). Without an event fd, pace with IdleWait.
  const auto deadline = clock::now() + std::chrono::duration<double>(timeout_s);
  const auto stall = std::chrono::duration<double>(stall_s);
  IdleWait wait;
  bool late = false, forced = false;
  auto quiet_from = clock::now();
  auto moved = clock::now();  // when a message of this batch last came or a part ended
  auto force_at = deadline;
  unsigned quiet_rounds = 0;
  std::vector<uint8_t> awaited(eps.size(), 0);  // nodes with parts not done when late
  // Force-closes the endpoints (with error handling) of the nodes awaited
  // that still hold receives under way, or all of them (`all`).
  auto force_awaited = [&](bool all) {
    std::vector<uint8_t> hung(eps.size(), 0);
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t k = 0; k < b.state.size(); ++k) {
        if (b.state[k] == Batch::kReceiving) hung[node[k / b.parts]] = 1;
      }
    }
    for (size_t e = 0; e < eps.size(); ++e) {
      if ((hung[e] || (all && awaited[e])) && eps[e]->error_handling()) eps[e]->close(true, 0.0);
    }
  };
  while (true) {
    unsigned events = ucp_worker_progress(worker_h_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (b.left == 0) break;
      if (b.events != 0) moved = clock::now();
      events += b.events;
      b.events = 0;
      // A node whose endpoint failed (error handling) sends nothing more.
      for (size_t e = 0; e < eps.size(); ++e) {
        if (of[e].empty() || eps[e]->alive()) continue;
        for (uint32_t i : of[e]) b.fail_waiting(i, eps[e]->status());
      }
      if (b.left == 0) break;
    }
    if (events != 0) {
      wait.reset();
      quiet_rounds = 0;
      continue;
    }
    if (quiet_rounds++ == 0) quiet_from = clock::now();
    auto now = clock::now();
    if (efd_ >= 0 && now - quiet_from > kSpin) {
      if (ucp_worker_arm(worker_h_) == UCS_OK) {
        pollfd pfd{efd_, POLLIN, 0};
        poll(&pfd, 1, late ? 10 : 2);
        now = clock::now();
      }
    } else if (efd_ < 0) {
      const unsigned idle = wait.pause(late);
      if (!late && (idle & 63) != 0) continue;
      now = clock::now();
    }
    const bool stalled = stall_s > 0 && now - moved > stall;
    if (!late && (now > deadline || stalled)) {
      // Nothing more is waited for. After a stall nothing moved for
      // stall_s already: no grace for the receives under way.
      late = true;
      force_at = stalled ? now : deadline + kGrace;
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t k = 0; k < b.state.size(); ++k) {
        if (b.state[k] != Batch::kDone) awaited[node[k / b.parts]] = 1;
      }
      for (size_t i = 0; i < n; ++i) b.fail_waiting(i, UCS_ERR_TIMED_OUT);
    }
    if (late && !forced && now >= force_at) {
      // Receives still under way from a node that stopped sending: only a
      // forced close ends them (endpoints with error handling); others are
      // waited for, since UCX would still write into dest.
      forced = true;
      force_awaited(false);
    }
  }
  // The nodes that did not answer in time: their endpoints with error
  // handling are force-closed, as the gather does to a node whose reads
  // hang, so that dropping them costs no wait (the caller forgets them).
  if (late) force_awaited(true);
  {
    std::lock_guard<std::mutex> lock(mu_);
    batches_.erase(b.token);  // later messages for it are dropped
  }
  for (void* r : b.requests) {
    if (r != nullptr) ucp_request_free(r);
  }

  // Headers last, of whole items only: a failed item reads as no item.
  for (size_t i = 0; i < n; ++i) {
    statuses[i] = b.status[i];
    if (statuses[i] == UCS_OK && !b.have_header[i]) statuses[i] = UCS_ERR_NO_MESSAGE;
    uint64_t h[2] = {0, 0};
    if (statuses[i] == UCS_OK) {
      h[0] = b.key[i];
      h[1] = b.generation[i];
    }
    std::memcpy(b.base + layout.header_at(rows[i]), h, sizeof(h));
  }
}

}  // namespace distore
