// Samples by active message, the node's sends (am_sample.h): a batch's
// messages posted a few at a time, each part of an item (or of a run of
// them, packed into a bounce chunk) with its slot headers as read when
// posted, on the worker's thread, until the last send ends.
#include <cstring>

#include "am_sample_job.h"
#include "am_sample_util.h"

namespace distore {

using namespace am_sample_detail;  // NOLINT: this side's own helpers

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

// How many items of the run of `run` items at j->pos the next message
// (part `p`) carries: a run goes whole, from a chunk its parts are copied
// into (`*packed`; headers alone need none); without a free chunk, item by
// item from the arena (`*packed` null).
uint32_t message_items(ServeJob* j, uint32_t run, const AmSamplePart& p, uint8_t** packed) {
  const Core& c = *j->core;
  *packed = nullptr;
  if (j->sub != 0 || run <= 1) return 1;
  if (p.length == 0) return run;
  if (c.chunks && (*packed = c.chunks->take()) != nullptr) return run;
  ++j->unpacked;
  return 1;
}

// The header of the message of part `p` of `count` items from `first`
// (the reply, then each item's slot header as read now) into `header`, and
// the items' part into the chunk `packed` (if any); returns its length.
size_t make_header(const ServeJob& j, size_t first, uint32_t count, const AmSamplePart& p,
                   uint8_t* packed, uint8_t* header) {
  const Core& c = *j.core;
  const AmSampleReply h{j.token, j.items[first].index, j.part, 0, count, 0, 0};
  std::memcpy(header, &h, sizeof(h));
  auto* slots = reinterpret_cast<AmSampleSlotHeader*>(header + sizeof(h));
  for (uint32_t k = 0; k < count; ++k) {
    const uint64_t at = j.items[first + k].slot;
    const auto* slot = reinterpret_cast<const uint64_t*>(c.base + at);
    slots[k] = {__atomic_load_n(&slot[0], __ATOMIC_RELAXED),
                __atomic_load_n(&slot[1], __ATOMIC_RELAXED)};
    if (packed != nullptr) std::memcpy(packed + k * p.length, c.base + at + p.src, p.length);
  }
  return sizeof(h) + count * sizeof(AmSampleSlotHeader);
}

// Posts one message of the job (from chunk `packed`, or from the arena);
// counted in flight unless UCX ended it at once (nullptr) or refused it.
ucs_status_ptr_t post(ServeJob* j, const void* header, size_t header_length, const void* data,
                      uint64_t length, bool rndv, uint8_t* packed) {
  Core& c = *j->core;
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
  // Counted before the call: UCX may end the request, and call on_sent,
  // inside it (an endpoint that fails while the message is posted); a
  // count taken after would then never come back to 0.
  ++j->in_flight;
  ucs_status_ptr_t r = ucp_am_send_nbx(j->ep, c.data_id, header, header_length, data, length,
                                       &param);
  if (UCS_PTR_IS_ERR(r) || r == nullptr) {
    if (cs != nullptr) {  // no callback comes: the chunk is free again
      c.chunks->give(cs->chunk);
      delete cs;
    }
    --j->in_flight;
  }
  return r;
}

// Posts the job's next message and moves its place on (j->failed if UCX
// refused it; nothing moves when the endpoint has no rendezvous, which the
// next call then does without).
void send_next(ServeJob* j) {
  const Core& c = *j->core;
  if (j->end <= j->pos) j->end = run_end(*j, j->pos);
  const uint32_t run = static_cast<uint32_t>(j->end - j->pos);
  const AmSamplePart& p = j->parts[j->part];
  uint8_t* packed;
  const uint32_t count = message_items(j, run, p, &packed);
  const size_t first = j->pos + j->sub;
  alignas(8) uint8_t header[sizeof(AmSampleReply) + kAmSampleMaxRun * sizeof(AmSampleSlotHeader)];
  const size_t header_length = make_header(*j, first, count, p, packed, header);
  const uint64_t length = count * p.length;
  const bool rndv = length >= j->rndv_min && length > 0 && !j->no_rndv;
  const void* data = length == 0 ? nullptr
                     : packed != nullptr
                         ? static_cast<const void*>(packed)
                         : static_cast<const void*>(c.base + j->items[first].slot + p.src);
  ucs_status_ptr_t r = post(j, header, header_length, data, length, rndv, packed);
  if (UCS_PTR_IS_ERR(r)) {
    if (rndv && UCS_PTR_STATUS(r) == UCS_ERR_UNSUPPORTED) {
      j->no_rndv = true;  // this endpoint has no rendezvous: let UCX choose
      return;
    }
    j->failed = true;
    ++j->errors;
    return;
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

}  // namespace

namespace am_sample_detail {

// Re-entrant calls (a completion inside a send) return at once: the outer
// call carries on.
void pump(ServeJob* j) {
  if (j->pumping) return;
  j->pumping = true;
  j->last_ns.store(now_ns(), std::memory_order_relaxed);
  const Core& c = *j->core;
  while (!j->failed && j->pos < j->items.size() && j->in_flight < c.max_in_flight) {
    if (!link_open(j)) {
      j->failed = true;
      break;
    }
    send_next(j);
  }
  j->pumping = false;
  if (j->in_flight == 0 && (j->failed || j->pos >= j->items.size())) finish(j);
}

}  // namespace am_sample_detail
}  // namespace distore
