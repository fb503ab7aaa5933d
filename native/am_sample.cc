#include "am_sample.h"

#include <poll.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <unordered_set>

#include "am_grant.h"
#include "chunk_pool.h"
#include "idle_wait.h"
#include "status.h"

namespace nb = nanobind;

namespace distore {

namespace {

using clock = std::chrono::steady_clock;

// Past the deadline, receives under way get this long to end by themselves
// before their endpoints are force-closed.
constexpr auto kGrace = std::chrono::milliseconds(500);
// A fetch polls its worker this long without result before it sleeps on
// the worker's event fd.
constexpr auto kSpin = std::chrono::microseconds(20);
// s a forced close of a listener's connection may progress the worker.
constexpr double kConnCloseTimeout = 1.0;

void set_am_handler(ucp_worker_h worker, unsigned id, ucp_am_recv_callback_t cb, void* arg,
                    const char* what) {
  ucp_am_handler_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_FLAGS |
                     UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG;
  param.id = id;
  param.flags = UCP_AM_FLAG_WHOLE_MSG;  // eager data assembled; not kept past the callback
  param.cb = cb;
  param.arg = arg;
  const ucs_status_t s = ucp_worker_set_am_recv_handler(worker, &param);
  if (cb != nullptr) check(s, what);
}

void free_request(void* request, ucs_status_t, void*) { ucp_request_free(request); }

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now().time_since_epoch())
      .count();
}

}  // namespace

// ---------------------------------------------------------------- node side

struct ServeJob;

struct AmSampleServer::Core {
  ucp_worker_h worker = nullptr;
  unsigned data_id = 0;
  Endpoints endpoints = Endpoints::kReply;
  size_t max_in_flight = 0, max_batches = 0;
  int64_t stall_ns = 0;
  const uint8_t* base = nullptr;  // the arena as registered (read-only where write-protected)
  ucp_mem_h memh = nullptr;       // its registration (the server holds the arena)
  uint64_t size = 0;
  // Runs: a part of several consecutive items of a batch is copied into a
  // chunk of `bounce` and sent as one message (fewer, larger rendezvous;
  // the server holds the region). No bounce region: one message per item.
  std::unique_ptr<ChunkPool> chunks;  // over `bounce`, or none
  ucp_mem_h bounce_memh = nullptr;
  size_t max_run = 1;  // items one message may carry

  struct Link {  // a registered endpoint to one learner
    Endpoint* ep;
    bool open;  // under mu
  };
  std::mutex mu;  // everything below; never held across a UCX call
  // With a key (listen()): requests only on authenticated connections of
  // `conns`, with grants (am_grant.h). Set before the listener exists.
  bool auth = false;
  uint8_t key[kAmKeyBytes] = {};
  AmConnections* conns = nullptr;  // the server's listener's (it outlives the handler)
  // Request state held (bytes), in all and per connection (0: not a
  // listener connection).
  uint64_t held = 0;
  std::unordered_map<uint64_t, uint64_t> held_by;
  std::unordered_map<uint64_t, std::shared_ptr<Link>> links;
  std::unordered_set<ServeJob*> live;  // batches not ended (abandoned ones included)
  bool open = true;
  Stats stats;

  // Under mu: batches whose sends made no progress for stall_ns are
  // abandoned: UCX did not end the sends to a learner that went away (an
  // endpoint without error handling, or one still connecting when the peer
  // died, is never failed by UCX 1.21). They stop counting against
  // max_batches; what they hold is freed if UCX ever ends their sends.
  void sweep();
};

// One request being answered. Touched only under the worker's lock (the
// request handler and send completions run there), except `last_ns`
// (atomic) and `abandoned` (under the core's mutex).
struct ServeJob {
  std::shared_ptr<AmSampleServer::Core> core;
  std::shared_ptr<AmSampleServer::Core::Link> link;  // kRegistered
  ucp_ep_h ep = nullptr;
  uint64_t token = 0, rndv_min = 0;
  uint64_t conn = 0, held = 0;  // its connection, and the bytes it counts against the bounds
  std::vector<AmSamplePart> parts;
  std::vector<AmSampleItem> items;
  // What to send next, in order: part `part` of the run of joined items
  // [pos, end) (at most `per` of them; end found when the run starts),
  // `sub` of them sent. Derived as it goes: a request's state is its items
  // and parts, nothing per (item, part).
  size_t pos = 0, end = 0, per = 1, in_flight = 0;
  uint32_t sub = 0;
  uint16_t part = 0;
  uint64_t sent = 0, bytes = 0, errors = 0, runs = 0, unpacked = 0;
  bool failed = false, pumping = false, no_rndv = false;
  bool abandoned = false;           // under core->mu
  std::atomic<int64_t> last_ns{0};  // when a send was last posted or ended
};

void AmSampleServer::Core::sweep() {
  const int64_t now = now_ns();
  for (ServeJob* j : live) {
    if (j->abandoned || now - j->last_ns.load(std::memory_order_relaxed) < stall_ns) continue;
    j->abandoned = true;
    --stats.in_flight;
    ++stats.abandoned;
    ++stats.stuck;
  }
}

namespace {

using Core = AmSampleServer::Core;

void pump(ServeJob* j);


// The end of the run that starts at item `pos` of `j` (see ServeJob).
size_t run_end(const ServeJob& j, size_t pos) {
  size_t e = pos + 1;
  while (e < j.items.size() && e - pos < j.per && j.items[e].joined == 1 &&
         j.items[e].index == j.items[e - 1].index + 1) {
    ++e;
  }
  return e;
}

void finish(ServeJob* j) {
  {
    std::lock_guard<std::mutex> lock(j->core->mu);
    Core& c = *j->core;
    AmSampleServer::Stats& s = c.stats;
    c.live.erase(j);
    c.held -= j->held;
    auto by = c.held_by.find(j->conn);
    if (by != c.held_by.end() && (by->second -= j->held) == 0) c.held_by.erase(by);
    --(j->abandoned ? s.stuck : s.in_flight);
    ++(j->failed ? s.batches_failed : s.batches_done);
    s.messages += j->sent;
    s.bytes += j->bytes;
    s.send_errors += j->errors;
    s.runs += j->runs;
    s.unpacked += j->unpacked;
  }
  delete j;
}

void on_sent(void* request, ucs_status_t status, void* user_data) {
  auto* j = static_cast<ServeJob*>(user_data);
  ucp_request_free(request);
  j->last_ns.store(now_ns(), std::memory_order_relaxed);
  --j->in_flight;
  if (status == UCS_OK) {
    ++j->sent;
  } else {
    j->failed = true;
    ++j->errors;
  }
  pump(j);
}

// A message sent from a bounce chunk: the chunk goes back when it ends.
struct ChunkSend {
  ServeJob* job;
  uint8_t* chunk;
};

void on_sent_chunk(void* request, ucs_status_t status, void* user_data) {
  auto* cs = static_cast<ChunkSend*>(user_data);
  ServeJob* j = cs->job;
  j->core->chunks->give(cs->chunk);
  delete cs;
  on_sent(request, status, j);
}

bool link_open(const ServeJob* j) {
  if (!j->link) return true;
  std::lock_guard<std::mutex> lock(j->core->mu);
  return j->link->open && j->link->ep->alive();
}

// Posts the job's next messages while fewer than max_in_flight are under
// way; frees the job once the last has ended. Re-entrant calls (a completion
// inside a send) return at once: the outer call carries on.
void pump(ServeJob* j) {
  if (j->pumping) return;
  j->pumping = true;
  j->last_ns.store(now_ns(), std::memory_order_relaxed);
  Core& c = *j->core;
  while (!j->failed && j->pos < j->items.size() && j->in_flight < c.max_in_flight) {
    if (!link_open(j)) {
      j->failed = true;
      break;
    }
    if (j->end <= j->pos) j->end = run_end(*j, j->pos);
    const uint32_t run = static_cast<uint32_t>(j->end - j->pos);
    const AmSamplePart& p = j->parts[j->part];
    // A run goes whole, from a chunk its parts are copied into (headers
    // alone need none); without a free chunk, item by item from the arena.
    uint32_t count = 1;
    uint8_t* packed = nullptr;
    if (j->sub == 0 && run > 1) {
      if (p.length == 0) {
        count = run;
      } else if (c.chunks && (packed = c.chunks->take()) != nullptr) {
        count = run;
      } else {
        ++j->unpacked;
      }
    }
    const size_t first = j->pos + j->sub;
    alignas(8) uint8_t header[sizeof(AmSampleReply) + kAmSampleMaxRun * sizeof(AmSampleSlotHeader)];
    const AmSampleReply h{j->token, j->items[first].index, j->part, 0, count, 0, 0};
    std::memcpy(header, &h, sizeof(h));
    auto* slots = reinterpret_cast<AmSampleSlotHeader*>(header + sizeof(h));
    for (uint32_t k = 0; k < count; ++k) {
      const uint64_t at = j->items[first + k].slot;
      const auto* slot = reinterpret_cast<const uint64_t*>(c.base + at);
      slots[k] = {__atomic_load_n(&slot[0], __ATOMIC_RELAXED),
                  __atomic_load_n(&slot[1], __ATOMIC_RELAXED)};
      if (packed != nullptr) std::memcpy(packed + k * p.length, c.base + at + p.src, p.length);
    }
    const uint64_t length = count * p.length;
    const bool rndv = length >= j->rndv_min && length > 0 && !j->no_rndv;
    ucp_request_param_t param;
    std::memset(&param, 0, sizeof(param));
    param.op_attr_mask =
        UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    // The region's own registration: UCX then registers nothing through
    // its cache, and a rendezvous aborted because the learner went away
    // (ucp_proto_rndv_rts_abort) ends at once instead of first invalidating
    // a cached registration, which UCX 1.21 does not always finish and,
    // with its memory cache off, crashes in (ucs_rcache_region_invalidate
    // on no cache). A send still pending at close keeps the arena and the
    // bounce region (close).
    ucp_mem_h memh = packed != nullptr ? c.bounce_memh : c.memh;
    if (memh != nullptr) {
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
      param.memh = memh;
    }
    param.flags = UCP_AM_SEND_FLAG_COPY_HEADER | (rndv ? UCP_AM_SEND_FLAG_RNDV : 0);
    ChunkSend* cs = nullptr;
    if (packed != nullptr) {
      cs = new ChunkSend{j, packed};
      param.cb.send = &on_sent_chunk;
      param.user_data = cs;
    } else {
      param.cb.send = &on_sent;
      param.user_data = j;
    }
    const void* data = length == 0 ? nullptr
                       : packed != nullptr
                           ? static_cast<const void*>(packed)
                           : static_cast<const void*>(c.base + j->items[first].slot + p.src);
    // Counted before the call: UCX may end the request, and call on_sent,
    // inside it (an endpoint that fails while the message is posted); a
    // count taken after would then never come back to 0.
    ++j->in_flight;
    ucs_status_ptr_t r = ucp_am_send_nbx(j->ep, c.data_id, header,
                                         sizeof(h) + count * sizeof(AmSampleSlotHeader), data,
                                         length, &param);
    if (UCS_PTR_IS_ERR(r) || r == nullptr) {
      if (cs != nullptr) {  // no callback comes: the chunk is free again
        c.chunks->give(cs->chunk);
        delete cs;
      }
      --j->in_flight;
    }
    if (UCS_PTR_IS_ERR(r)) {
      if (rndv && UCS_PTR_STATUS(r) == UCS_ERR_UNSUPPORTED) {
        j->no_rndv = true;  // this endpoint has no rendezvous: let UCX choose
        continue;
      }
      j->failed = true;
      ++j->errors;
      break;
    }
    j->sub += count;
    if (j->sub >= run) {  // the next part of the run, or the next run
      j->sub = 0;
      if (++j->part == j->parts.size()) {
        j->part = 0;
        j->pos = j->end;
      }
    }
    j->bytes += length;
    if (count > 1) ++j->runs;
    if (r == nullptr) ++j->sent;  // sent at once; no callback comes
  }
  j->pumping = false;
  if (j->in_flight == 0 && (j->failed || j->pos >= j->items.size())) finish(j);
}

void send_refusal(const Core& c, ucp_ep_h ep, const AmSampleRequest& q, int status) {
  AmSampleReply h{q.token, q.node, 0, kAmSampleRefused, 0, 0,
                  static_cast<uint64_t>(static_cast<int64_t>(status))};
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS | UCP_OP_ATTR_FIELD_CALLBACK;
  param.flags = UCP_AM_SEND_FLAG_COPY_HEADER;
  param.cb.send = &free_request;
  ucs_status_ptr_t r = ucp_am_send_nbx(ep, c.data_id, &h, sizeof(h), nullptr, 0, &param);
  (void)r;  // an error or NULL: nothing to free; a request frees itself
}

ucs_status_t on_request(void* arg, const void* header, size_t header_length, void* data,
                        size_t length, const ucp_am_recv_param_t* param) {
  auto* owner = static_cast<std::shared_ptr<Core>*>(arg);
  const std::shared_ptr<Core>& core = *owner;
  Core& c = *core;
  const ucp_ep_h reply_ep =
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
  // With a key, only an authenticated connection's requests are read: any
  // other is dropped unanswered (its sender learns nothing).
  uint64_t conn = 0;
  AmConnections* conns = nullptr;
  bool auth;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    auth = c.auth;
    conns = c.conns;
  }
  if (auth) {
    conn = (conns != nullptr && reply_ep != nullptr) ? conns->id_of(reply_ep) : 0;
    if (conn == 0) {
      std::lock_guard<std::mutex> lock(c.mu);
      ++c.stats.refused;
      ++c.stats.unauthorized;
      return UCS_OK;
    }
  }
  AmSampleRequest q;
  if (header_length != sizeof(q)) {
    std::lock_guard<std::mutex> lock(c.mu);
    ++c.stats.refused;
    return UCS_OK;  // not ours: nothing to answer to
  }
  std::memcpy(&q, header, sizeof(q));
  auto refuse = [&](int status) {
    {
      std::lock_guard<std::mutex> lock(c.mu);
      ++c.stats.refused;
    }
    if (reply_ep != nullptr) send_refusal(c, reply_ep, q, status);
    return UCS_OK;  // a rendezvous request is dropped: its sender's request ends
  };
  if (q.version != kAmSampleVersion) return refuse(UCS_ERR_UNSUPPORTED);
  if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) || q.items > kAmSampleMaxItems ||
      q.parts > kAmSampleMaxParts ||
      length != q.parts * sizeof(AmSamplePart) + q.items * sizeof(AmSampleItem)) {
    return refuse(kStatusBadArgument);
  }
  auto job = std::make_unique<ServeJob>();
  job->last_ns.store(now_ns(), std::memory_order_relaxed);  // before a sweep can see it
  job->parts.resize(q.parts);
  job->items.resize(q.items);
  const auto* p = static_cast<const uint8_t*>(data);
  if (q.parts > 0) std::memcpy(job->parts.data(), p, q.parts * sizeof(AmSamplePart));
  if (q.items > 0) {
    std::memcpy(job->items.data(), p + q.parts * sizeof(AmSamplePart),
                q.items * sizeof(AmSampleItem));
  }
  // Every byte a message will carry lies inside the arena, and every slot
  // header it reads.
  uint64_t end = 16, total = 0;
  for (const AmSamplePart& part : job->parts) {
    if (part.src > c.size || part.length > c.size - part.src) return refuse(kStatusOutOfBounds);
    end = std::max(end, part.src + part.length);
    total += part.length;
  }
  for (const AmSampleItem& it : job->items) {
    if (it.slot % 8 != 0 || end > c.size || it.slot > c.size - end) {
      return refuse(kStatusOutOfBounds);
    }
  }
  if (auth) {
    // Only what the control plane granted: each item's slot, of the
    // request's slot size, and no part outside it (nor parts that add up
    // to more than it: no slot is sent twice over).
    bool granted = q.slot_size >= 16 && end <= q.slot_size && total <= q.slot_size;
    for (size_t i = 0; granted && i < job->items.size(); ++i) {
      granted = job->items[i].tag == am_item_tag(c.key, job->items[i].slot, q.slot_size);
    }
    if (!granted) {
      {
        std::lock_guard<std::mutex> lock(c.mu);
        ++c.stats.unauthorized;
      }
      conns->kick(conn);  // a learner never sends that: closed at the next reap
      return refuse(UCS_ERR_REJECTED);
    }
  }
  if (job->parts.empty()) job->parts.push_back({0, 0});  // the slot header alone
  // Runs of joined items, each cut to what one message may carry (a chunk
  // holds the largest part of that many items); item-major order.
  // Without a bounce region max_run is 1 and chunk 0: one item a message.
  uint64_t widest = 0;
  for (const AmSamplePart& part : job->parts) widest = std::max(widest, part.length);
  const size_t chunk = c.chunks ? c.chunks->chunk_bytes() : 0;
  job->per = std::max<size_t>(
      1, widest == 0 ? c.max_run : std::min<size_t>(c.max_run, chunk / widest));
  job->conn = conn;
  job->held = sizeof(ServeJob) + job->items.capacity() * sizeof(AmSampleItem) +
              job->parts.capacity() * sizeof(AmSamplePart);

  ucp_ep_h ep = reply_ep;
  int why_not = UCS_OK;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    c.sweep();
    if (c.endpoints == AmSampleServer::Endpoints::kRegistered) {
      auto it = c.links.find(q.client);
      if (it != c.links.end() && it->second->open && it->second->ep->alive()) {
        job->link = it->second;
        ep = it->second->ep->ep();
      } else {
        ep = nullptr;
      }
    }
    if (ep == nullptr) {
      why_not = UCS_ERR_NOT_CONNECTED;
    } else if (!c.open) {
      why_not = UCS_ERR_CANCELED;
    } else if (c.stats.in_flight >= c.max_batches || c.held + job->held > kMaxHeldBytes ||
               c.held_by[conn] + job->held > kMaxHeldBytesPerPeer) {
      why_not = UCS_ERR_BUSY;  // the learner reads these items by gets
      if (c.held_by[conn] == 0) c.held_by.erase(conn);
    } else {
      ++c.stats.in_flight;
      ++c.stats.requests;
      c.held += job->held;
      c.held_by[conn] += job->held;
      c.live.insert(job.get());
    }
  }
  if (why_not != UCS_OK) return refuse(why_not);
  job->core = core;
  job->ep = ep;
  job->token = q.token;
  job->rndv_min = q.rndv_min;
  pump(job.release());
  return UCS_OK;
}

}  // namespace

AmSampleServer::AmSampleServer(nb::object worker, uintptr_t worker_handle, nb::object arena_obj,
                               const MemoryRegion& arena, unsigned request_id, unsigned data_id,
                               Endpoints endpoints, size_t max_in_flight, size_t max_batches,
                               double stall_s, nb::object bounce_obj, size_t chunk_bytes)
    : worker_(std::move(worker)),
      arena_(std::move(arena_obj)),
      bounce_(std::move(bounce_obj)),
      core_(new Core) {
  if (worker_handle == 0) throw UcxError(kStatusBadArgument, "AmSampleServer: no worker");
  if (max_in_flight == 0 || max_batches == 0) {
    throw UcxError(kStatusBadArgument, "AmSampleServer: max_in_flight and max_batches must be > 0");
  }
  Core& c = *core_;
  c.worker = reinterpret_cast<ucp_worker_h>(worker_handle);
  c.data_id = data_id;
  c.endpoints = endpoints;
  c.max_in_flight = max_in_flight;
  c.max_batches = max_batches;
  c.stall_ns = static_cast<int64_t>(stall_s * 1e9);
  c.base = reinterpret_cast<const uint8_t*>(arena.address());
  c.size = arena.size();
  c.memh = arena.memh();
  if (!bounce_.is_none()) {
    const MemoryRegion& b = nb::cast<const MemoryRegion&>(bounce_);
    if (chunk_bytes == 0 || b.size() / chunk_bytes == 0) {
      throw UcxError(kStatusBadArgument,
                     "AmSampleServer: the bounce region holds no chunk of chunk_bytes");
    }
    // A run's slot headers travel in its message header: as many as fit.
    ucp_worker_attr_t attr;
    std::memset(&attr, 0, sizeof(attr));
    attr.field_mask = UCP_WORKER_ATTR_FIELD_MAX_AM_HEADER;
    const bool known =
        ucp_worker_query(c.worker, &attr) == UCS_OK && attr.max_am_header > sizeof(AmSampleReply);
    const size_t room =
        known ? (attr.max_am_header - sizeof(AmSampleReply)) / sizeof(AmSampleSlotHeader) : 1;
    c.max_run = std::max<size_t>(1, std::min<size_t>(kAmSampleMaxRun, room));
    c.chunks = std::make_unique<ChunkPool>(reinterpret_cast<uint8_t*>(b.local_address()),
                                           chunk_bytes, b.size() / chunk_bytes);
    c.bounce_memh = b.memh();
  }
  request_id_ = request_id;
  // The handler's argument: the core, held as long as the handler is registered.
  handler_arg_ = new std::shared_ptr<Core>(core_);
  try {
    set_am_handler(c.worker, request_id, &on_request, handler_arg_,
                   "registering the sample request handler");
  } catch (...) {
    delete handler_arg_;
    handler_arg_ = nullptr;
    throw;
  }
}

AmSampleServer::~AmSampleServer() { close(1.0); }

void AmSampleServer::set_peer(uint64_t client, Endpoint* ep, nb::object keep) {
  if (ep == nullptr) throw UcxError(kStatusBadArgument, "set_peer: no endpoint");
  if (ep->worker() != core_->worker) {
    throw UcxError(kStatusBadArgument,
                   "set_peer: the endpoint is on another worker than the server's", ep->peer());
  }
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    auto it = core_->links.find(client);
    if (it != core_->links.end()) it->second->open = false;
    core_->links[client] = std::make_shared<Core::Link>(Core::Link{ep, true});
  }
  peers_[client] = std::move(keep);
}

void AmSampleServer::drop_peer(uint64_t client) {
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    auto it = core_->links.find(client);
    if (it == core_->links.end()) return;
    it->second->open = false;
    core_->links.erase(it);
  }
  // Batches in flight to it still hold its Endpoint (it outlives their
  // sends, which its close ends); it is dropped with the last Python
  // reference, after this.
  peers_.erase(client);
}

uint16_t AmSampleServer::listen(const std::string& host, uint16_t port,
                                size_t max_connections, const std::string& key) {
  {
    std::lock_guard<std::mutex> lock(conns_mu_);
    if (conns_ != nullptr) {
      throw UcxError(kStatusBadArgument, "AmSampleServer.listen: it listens already");
    }
  }
  if (!key.empty() && key.size() != kAmKeyBytes) {
    throw UcxError(kStatusBadArgument, "AmSampleServer.listen: the key must be " +
                                           std::to_string(kAmKeyBytes) + " bytes");
  }
  {
    std::lock_guard<std::mutex> lock(core_->mu);
    if (!core_->open) throw UcxError(UCS_ERR_CANCELED, "AmSampleServer.listen: it is closed");
    // From now on requests must be authenticated and granted (none can be,
    // until the listener below accepts their connection).
    if (!key.empty()) {
      core_->auth = true;
      std::memcpy(core_->key, key.data(), kAmKeyBytes);
    }
  }
  // Made outside the locks: creating the listener takes the worker's lock,
  // under which the request handler takes the core's.
  auto made = std::make_unique<AmConnections>(core_->worker, host, port, max_connections,
                                              "sample", key, kAmSampleAuthId);
  const uint16_t chosen = made->port();
  std::lock_guard<std::mutex> lock(conns_mu_);
  if (conns_ != nullptr) {  // another thread listened meanwhile
    made->close(kConnCloseTimeout);
    throw UcxError(kStatusBadArgument, "AmSampleServer.listen: it listens already");
  }
  conns_ = std::move(made);
  {
    std::lock_guard<std::mutex> core_lock(core_->mu);
    core_->conns = conns_.get();
  }
  return chosen;
}

AmConnections* AmSampleServer::connections_ptr() const {
  std::lock_guard<std::mutex> lock(conns_mu_);
  return conns_.get();
}

size_t AmSampleServer::reap(double timeout_s) {
  AmConnections* c = connections_ptr();
  return c != nullptr ? c->reap(timeout_s) : 0;
}

AmConnections::Counts AmSampleServer::connections() const {
  AmConnections* c = connections_ptr();
  return c != nullptr ? c->counts() : AmConnections::Counts{};
}

AmSampleServer::Stats AmSampleServer::stats() const {
  std::lock_guard<std::mutex> lock(core_->mu);
  core_->sweep();
  Stats s = core_->stats;
  s.held_bytes = core_->held;
  return s;
}

bool AmSampleServer::close(double timeout_s) {
  Core& c = *core_;
  if (!closed_) {
    closed_ = true;
    {
      std::lock_guard<std::mutex> lock(c.mu);
      c.open = false;
    }
    // Returns once no handler call is under way (it takes the worker's lock).
    set_am_handler(c.worker, request_id_, nullptr, nullptr, "");
    delete handler_arg_;
    handler_arg_ = nullptr;
    // No learner connects any more, and the sends to those connected end
    // with an error: their batches finish below.
    if (AmConnections* conns = connections_ptr()) conns->close(kConnCloseTimeout);
  }
  const auto deadline = clock::now() + std::chrono::duration<double>(timeout_s);
  IdleWait wait;
  while (true) {
    {
      std::lock_guard<std::mutex> lock(c.mu);
      if (c.live.empty()) return true;
    }
    if (clock::now() > deadline) break;
    if (ucp_worker_progress(c.worker) == 0) wait.pause(false);
  }
  // Sends still pending (a learner that neither reads nor fails): UCX may
  // still read the arena and the bounce region, so they stay mapped for good.
  arena_.release();
  bounce_.release();
  return false;
}

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

AmSampleClient::AmSampleClient(nb::object worker, uintptr_t worker_handle, unsigned request_id,
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
