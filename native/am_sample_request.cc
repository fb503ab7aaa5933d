// Samples by active message, the node's request handler (am_sample.h): who
// sent a request, whether it is well formed, inside the arena and granted,
// whether the server takes it on now; then its batch is sent
// (am_sample_send.cc), or the learner is told why not.
#include <algorithm>
#include <cstring>
#include <memory>

#include "am_sample_job.h"
#include "am_sample_util.h"
#include "status.h"

namespace distore {

using namespace am_sample_detail;  // NOLINT: this side's own helpers

namespace {

using Core = AmSampleServer::Core;

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

// Who sent a request: with a key (`auth`), the listener's connection it came
// on (`conn`, of `conns`).
struct Sender {
  bool auth = false;
  AmConnections* conns = nullptr;
  uint64_t conn = 0;
};

// With a key, only an authenticated connection's requests are read: false
// (counted) for any other, which is dropped unanswered (its sender learns
// nothing).
bool identify(Core& c, ucp_ep_h reply_ep, Sender* from) {
  {
    std::lock_guard<std::mutex> lock(c.mu);
    from->auth = c.auth;
    from->conns = c.conns;
  }
  if (!from->auth) return true;
  from->conn =
      (from->conns != nullptr && reply_ep != nullptr) ? from->conns->id_of(reply_ep) : 0;
  if (from->conn != 0) return true;
  std::lock_guard<std::mutex> lock(c.mu);
  ++c.stats.refused;
  ++c.stats.unauthorized;
  return false;
}

// The request's parts and items, read from its data (of the size they need).
std::unique_ptr<ServeJob> read_job(const AmSampleRequest& q, const void* data) {
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
  return job;
}

// Whether every byte a message of the job will carry lies inside the arena,
// and every slot header it reads, and (with a key) inside what the control
// plane granted: UCS_OK, or why not. An ungranted request's connection is
// kicked.
int check_job(Core& c, const ServeJob& job, const AmSampleRequest& q, const Sender& from) {
  uint64_t end = 16, total = 0;
  for (const AmSamplePart& part : job.parts) {
    if (part.src > c.size || part.length > c.size - part.src) return kStatusOutOfBounds;
    end = std::max(end, part.src + part.length);
    total += part.length;
  }
  for (const AmSampleItem& it : job.items) {
    if (it.slot % 8 != 0 || end > c.size || it.slot > c.size - end) return kStatusOutOfBounds;
  }
  if (!from.auth) return UCS_OK;
  // Only what the control plane granted: each item's slot, of the
  // request's slot size, and no part outside it (nor parts that add up
  // to more than it: no slot is sent twice over).
  bool granted = q.slot_size >= 16 && end <= q.slot_size && total <= q.slot_size;
  for (size_t i = 0; granted && i < job.items.size(); ++i) {
    granted = job.items[i].tag == am_item_tag(c.key, job.items[i].slot, q.slot_size);
  }
  if (granted) return UCS_OK;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    ++c.stats.unauthorized;
  }
  from.conns->kick(from.conn);  // a learner never sends that: closed at the next reap
  return UCS_ERR_REJECTED;
}

// Runs of joined items, each cut to what one message may carry (a chunk
// holds the largest part of that many items); item-major order. Without a
// bounce region max_run is 1 and chunk 0: one item a message. Then what
// the job holds, counted against connection `conn`.
void plan_job(const Core& c, ServeJob* job, uint64_t conn) {
  if (job->parts.empty()) job->parts.push_back({0, 0});  // the slot header alone
  uint64_t widest = 0;
  for (const AmSamplePart& part : job->parts) widest = std::max(widest, part.length);
  const size_t chunk = c.chunks ? c.chunks->chunk_bytes() : 0;
  job->per = std::max<size_t>(
      1, widest == 0 ? c.max_run : std::min<size_t>(c.max_run, chunk / widest));
  job->conn = conn;
  job->held = sizeof(ServeJob) + job->items.capacity() * sizeof(AmSampleItem) +
              job->parts.capacity() * sizeof(AmSamplePart);
}

// Takes the job on if the server can now: UCS_OK (in flight, live; `*ep`
// the endpoint to answer on), or why not.
int admit(Core& c, const AmSampleRequest& q, ServeJob* job, ucp_ep_h* ep) {
  const uint64_t conn = job->conn;
  std::lock_guard<std::mutex> lock(c.mu);
  c.sweep();
  if (c.endpoints == AmSampleServer::Endpoints::kRegistered) {
    auto it = c.links.find(q.client);
    if (it != c.links.end() && it->second->open && it->second->ep->alive()) {
      job->link = it->second;
      *ep = it->second->ep->ep();
    } else {
      *ep = nullptr;
    }
  }
  if (*ep == nullptr) return UCS_ERR_NOT_CONNECTED;
  if (!c.open) return UCS_ERR_CANCELED;
  if (c.stats.in_flight >= c.max_batches || c.held + job->held > kMaxHeldBytes ||
      c.held_by[conn] + job->held > kMaxHeldBytesPerPeer) {
    if (c.held_by[conn] == 0) c.held_by.erase(conn);
    return UCS_ERR_BUSY;  // the learner reads these items by gets
  }
  ++c.stats.in_flight;
  ++c.stats.requests;
  c.held += job->held;
  c.held_by[conn] += job->held;
  c.live.insert(job);
  return UCS_OK;
}

}  // namespace

namespace am_sample_detail {

ucs_status_t on_request(void* arg, const void* header, size_t header_length, void* data,
                        size_t length, const ucp_am_recv_param_t* param) {
  const std::shared_ptr<Core>& core = *static_cast<std::shared_ptr<Core>*>(arg);
  Core& c = *core;
  const ucp_ep_h reply_ep =
      (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
  Sender from;
  if (!identify(c, reply_ep, &from)) return UCS_OK;
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
  std::unique_ptr<ServeJob> job = read_job(q, data);
  int why_not = check_job(c, *job, q, from);
  if (why_not != UCS_OK) return refuse(why_not);
  plan_job(c, job.get(), from.conn);
  ucp_ep_h ep = reply_ep;
  why_not = admit(c, q, job.get(), &ep);
  if (why_not != UCS_OK) return refuse(why_not);
  job->core = core;
  job->ep = ep;
  job->token = q.token;
  job->rndv_min = q.rndv_min;
  pump(job.release());
  return UCS_OK;
}

}  // namespace am_sample_detail
}  // namespace distore
