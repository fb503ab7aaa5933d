// Samples by active message, the learner's fetch (am_sample.h,
// AmSampleClient::fetch): one request to each node, then the wait until
// every part has landed or failed, then the slot headers of whole items.
#include <poll.h>

#include <chrono>
#include <cstring>
#include <string>

#include "am_sample.h"
#include "am_sample_batch.h"
#include "am_sample_util.h"
#include "idle_wait.h"
#include "status.h"

namespace distore {

using namespace am_sample_detail;  // NOLINT: this side's own helpers

namespace {

// Past the deadline, receives under way get this long to end by themselves
// before their endpoints are force-closed.
constexpr auto kGrace = std::chrono::milliseconds(500);
// A fetch polls its worker this long without result before it sleeps on
// the worker's event fd.
constexpr auto kSpin = std::chrono::microseconds(20);

}  // namespace

// One fetch: its arguments, the items each node serves, and the batch the
// data handler fills (registered under its token from start() to finish()).
struct AmSampleClient::Fetch {
  Fetch(AmSampleClient& client, const std::vector<Endpoint*>& eps, const uint32_t* node,
        const uint64_t* rows, size_t n)
      : c(client), eps(eps), node(node), rows(rows), n(n), of(eps.size()),
        awaited(eps.size(), 0) {}

  void group(const uint64_t* slot_offset);
  void start(const BatchLayout& layout, const MemoryRegion& dest);
  void send(const uint64_t* slot_offset, const uint32_t* tags, uint64_t slot_size,
            uint64_t rndv_min);
  int32_t request(size_t e, const std::vector<AmSamplePart>& parts, const ucp_request_param_t& sp,
                  const uint64_t* slot_offset, const uint32_t* tags, uint64_t slot_size,
                  uint64_t rndv_min);
  void wait(double timeout_s, double stall_s);
  bool settled(unsigned* events, clock::time_point* moved);
  bool pause(IdleWait& idle_wait, clock::duration quiet, clock::time_point* now);
  void give_up();
  void force_awaited(bool all);
  void finish(int32_t* statuses);

  AmSampleClient& c;
  const std::vector<Endpoint*>& eps;
  const uint32_t* const node;
  const uint64_t* const rows;
  const size_t n;
  std::vector<std::vector<uint32_t>> of;  // items per node
  std::vector<uint8_t> joined;            // per item: 1 if it joins the one before (a run)
  std::vector<uint8_t> awaited;           // nodes with parts not done when late
  bool late = false;
  Batch b;
};

// The items of each node, checked: an endpoint for each, on this worker, at
// most kAmSampleMaxItems from one node, slot offsets aligned.
void AmSampleClient::Fetch::group(const uint64_t* slot_offset) {
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
    if (eps[e]->worker() != c.worker_h_) {
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
}

// The batch, with its runs, registered for the data handler to fill.
void AmSampleClient::Fetch::start(const BatchLayout& layout, const MemoryRegion& dest) {
  const auto& fields = layout.fields();
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
  joined.assign(n, 0);
  for (size_t e = 0; e < eps.size(); ++e) {
    for (size_t j = 1; j < of[e].size(); ++j) {
      const uint32_t i = of[e][j], prev = of[e][j - 1];
      if (i == prev + 1 && rows[i] == rows[prev] + 1) {
        joined[i] = 1;
        b.run[i] = b.run[prev];
      }
    }
  }
  for (size_t k = 0; k < b.refs.size(); ++k) b.refs[k] = Batch::Ref{&c, &b, k};
  b.status.assign(n, UCS_OK);
  b.key.assign(n, 0);
  b.generation.assign(n, 0);
  b.have_header.assign(n, 0);
  b.left = n * b.parts;
  std::lock_guard<std::mutex> lock(c.mu_);
  b.token = c.next_token_++;
  c.batches_[b.token] = &b;
  ++c.stats_.batches;
}

// One request per node: the parts to send, then the items. A node whose
// endpoint failed, or that UCX refuses to send to, fails its items.
void AmSampleClient::Fetch::send(const uint64_t* slot_offset, const uint32_t* tags,
                                 uint64_t slot_size, uint64_t rndv_min) {
  const auto& fields = b.layout->fields();
  std::vector<AmSamplePart> parts(fields.size());
  for (size_t k = 0; k < fields.size(); ++k) parts[k] = {fields[k].src, fields[k].length};
  ucp_request_param_t sp;
  std::memset(&sp, 0, sizeof(sp));
  sp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  sp.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_COPY_HEADER | UCP_AM_SEND_FLAG_EAGER;
  for (size_t e = 0; e < eps.size(); ++e) {
    if (of[e].empty()) continue;
    const int32_t failed = eps[e]->alive()
                               ? request(e, parts, sp, slot_offset, tags, slot_size, rndv_min)
                               : eps[e]->status();
    if (failed != UCS_OK) {
      std::lock_guard<std::mutex> lock(c.mu_);
      for (uint32_t i : of[e]) b.fail_waiting(i, failed);
    }
  }
}

// Posts node e's request; a send not done at once is kept, with its buffer,
// until it is (reap_sends). UCS_OK, or the status UCX refused it with.
int32_t AmSampleClient::Fetch::request(size_t e, const std::vector<AmSamplePart>& parts,
                                       const ucp_request_param_t& sp,
                                       const uint64_t* slot_offset, const uint32_t* tags,
                                       uint64_t slot_size, uint64_t rndv_min) {
  AmSampleRequest q{kAmSampleVersion,
                    static_cast<uint32_t>(e),
                    b.token,
                    c.client_id_,
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
      ucp_am_send_nbx(eps[e]->ep(), c.request_id_, &q, sizeof(q), buf.data(), buf.size(), &sp);
  if (UCS_PTR_IS_ERR(r)) return UCS_PTR_STATUS(r);
  if (r != nullptr) {
    std::lock_guard<std::mutex> lock(c.sends_mu_);
    c.sends_.push_back(PendingSend{r, std::move(buf)});
  }
  return UCS_OK;
}

// Progress until every part has landed or failed. After a short stretch
// of fruitless progress, sleep in the kernel until the worker has
// something (its event fd), as `ucx_perftest -E sleep` does: the node's
// progress thread needs the core we would spin on (idle_wait.h says the
// same of the gather). Without an event fd, pace with IdleWait.
void AmSampleClient::Fetch::wait(double timeout_s, double stall_s) {
  const auto deadline = clock::now() + std::chrono::duration<double>(timeout_s);
  const auto stall = std::chrono::duration<double>(stall_s);
  IdleWait idle_wait;
  bool forced = false;
  auto quiet_from = clock::now();
  auto moved = clock::now();  // when a message of this batch last came or a part ended
  auto force_at = deadline;
  unsigned quiet_rounds = 0;
  while (true) {
    unsigned events = ucp_worker_progress(c.worker_h_);
    if (settled(&events, &moved)) break;
    if (events != 0) {
      idle_wait.reset();
      quiet_rounds = 0;
      continue;
    }
    if (quiet_rounds++ == 0) quiet_from = clock::now();
    auto now = clock::now();
    if (!pause(idle_wait, now - quiet_from, &now)) continue;
    const bool stalled = stall_s > 0 && now - moved > stall;
    if (!late && (now > deadline || stalled)) {
      // Nothing more is waited for. After a stall nothing moved for
      // stall_s already: no grace for the receives under way.
      late = true;
      force_at = stalled ? now : deadline + kGrace;
      give_up();
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
}

// What the handler did since the last look (added to `*events`; `*moved`:
// now, if anything); a node whose endpoint failed (error handling) sends
// nothing more: its items fail. True once every part is done.
bool AmSampleClient::Fetch::settled(unsigned* events, clock::time_point* moved) {
  std::lock_guard<std::mutex> lock(c.mu_);
  if (b.left == 0) return true;
  if (b.events != 0) *moved = clock::now();
  *events += b.events;
  b.events = 0;
  for (size_t e = 0; e < eps.size(); ++e) {
    if (of[e].empty() || eps[e]->alive()) continue;
    for (uint32_t i : of[e]) b.fail_waiting(i, eps[e]->status());
  }
  return b.left == 0;
}

// Waits for the worker after fruitless progress (`quiet` long): on its event
// fd past kSpin, else paced by IdleWait without one. False when it is to
// progress again at once; else `*now` is the time after any sleep.
bool AmSampleClient::Fetch::pause(IdleWait& idle_wait, clock::duration quiet,
                                  clock::time_point* now) {
  if (c.efd_ >= 0 && quiet > kSpin) {
    if (ucp_worker_arm(c.worker_h_) == UCS_OK) {
      pollfd pfd{c.efd_, POLLIN, 0};
      poll(&pfd, 1, late ? 10 : 2);
      *now = clock::now();
    }
  } else if (c.efd_ < 0) {
    const unsigned idle = idle_wait.pause(late);
    if (!late && (idle & 63) != 0) return false;
    *now = clock::now();
  }
  return true;
}

// Past the deadline (or a stall): the nodes with parts not done are the
// ones awaited, and the items whose message has not come fail.
void AmSampleClient::Fetch::give_up() {
  std::lock_guard<std::mutex> lock(c.mu_);
  for (size_t k = 0; k < b.state.size(); ++k) {
    if (b.state[k] != Batch::kDone) awaited[node[k / b.parts]] = 1;
  }
  for (size_t i = 0; i < n; ++i) b.fail_waiting(i, UCS_ERR_TIMED_OUT);
}

// Force-closes the endpoints (with error handling) of the nodes awaited
// that still hold receives under way, or all of them (`all`).
void AmSampleClient::Fetch::force_awaited(bool all) {
  std::vector<uint8_t> hung(eps.size(), 0);
  {
    std::lock_guard<std::mutex> lock(c.mu_);
    for (size_t k = 0; k < b.state.size(); ++k) {
      if (b.state[k] == Batch::kReceiving) hung[node[k / b.parts]] = 1;
    }
  }
  for (size_t e = 0; e < eps.size(); ++e) {
    if ((hung[e] || (all && awaited[e])) && eps[e]->error_handling()) eps[e]->close(true, 0.0);
  }
}

// Unregisters the batch (later messages for it are dropped), frees its
// requests, and writes the statuses and, last, the headers of whole items
// only: a failed item reads as no item.
void AmSampleClient::Fetch::finish(int32_t* statuses) {
  {
    std::lock_guard<std::mutex> lock(c.mu_);
    c.batches_.erase(b.token);
  }
  for (void* r : b.requests) {
    if (r != nullptr) ucp_request_free(r);
  }
  for (size_t i = 0; i < n; ++i) {
    statuses[i] = b.status[i];
    if (statuses[i] == UCS_OK && !b.have_header[i]) statuses[i] = UCS_ERR_NO_MESSAGE;
    uint64_t h[2] = {0, 0};
    if (statuses[i] == UCS_OK) {
      h[0] = b.key[i];
      h[1] = b.generation[i];
    }
    std::memcpy(b.base + b.layout->header_at(rows[i]), h, sizeof(h));
  }
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
  if (layout.fields().size() > kAmSampleMaxParts) {
    throw UcxError(kStatusBadArgument, "am sample: more than " +
                                           std::to_string(kAmSampleMaxParts) + " fields");
  }
  Fetch f(*this, eps, node, rows, n);
  f.group(slot_offset);
  {
    std::lock_guard<std::mutex> lock(sends_mu_);
    reap_sends(false);
  }
  f.start(layout, dest);
  f.send(slot_offset, tags, slot_size, rndv_min);
  f.wait(timeout_s, stall_s);
  f.finish(statuses);
}

}  // namespace distore
