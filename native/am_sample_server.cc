// Samples by active message, the node's side (am_sample.h): the server,
// which registers the request handler (am_sample_request.cc) over the core
// it shares with the batches it sends (am_sample_send.cc), keeps their
// memory, the learners' endpoints and its listener, and closes them.
#include <chrono>
#include <cstring>
#include <string>

#include "am_sample_job.h"
#include "am_sample_util.h"
#include "idle_wait.h"
#include "status.h"

namespace distore {

using namespace am_sample_detail;  // NOLINT: this side's own helpers

namespace {

// s a forced close of a listener's connection may progress the worker.
constexpr double kConnCloseTimeout = 1.0;

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
