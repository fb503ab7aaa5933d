// Inserts by active message, the writer's side (am_insert.h): a batch's
// items posted as rendezvous messages (or runs of them), and the raw sends
// the security tests attack a node's listeners with.
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "am_insert.h"
#include "status.h"

namespace distore {

namespace {

using clock = std::chrono::steady_clock;

}  // namespace

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

}  // namespace distore
