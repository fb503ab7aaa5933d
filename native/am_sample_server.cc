// Samples by active message, the node's side (am_sample.h): serving the
// requests of learners, sending each item's parts (or runs of them).
#include <chrono>
#include <cstring>
#include <string>
#include <unordered_set>

#include "am_grant.h"
#include "am_sample.h"
#include "am_sample_util.h"
#include "chunk_pool.h"
#include "idle_wait.h"
#include "status.h"

namespace distore {

using namespace am_sample_detail;  // NOLINT: this file's own helpers

namespace {

// s a forced close of a listener's connection may progress the worker.
constexpr double kConnCloseTimeout = 1.0;

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

AmSampleServer::AmSampleServer(Owner worker, uintptr_t worker_handle, Owner arena_owner,
                               const MemoryRegion& arena, unsigned request_id, unsigned data_id,
                               Endpoints endpoints, size_t max_in_flight, size_t max_batches,
                               double stall_s, Owner bounce_owner, const MemoryRegion* bounce,
                               size_t chunk_bytes)
    : worker_(std::move(worker)),
      arena_(std::move(arena_owner)),
      bounce_(std::move(bounce_owner)),
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
  if (bounce != nullptr) {
    const MemoryRegion& b = *bounce;
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

void AmSampleServer::set_peer(uint64_t client, Endpoint* ep, Owner keep) {
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
  keep_for_good(std::move(arena_));
  keep_for_good(std::move(bounce_));
  return false;
}

}  // namespace distore
