#include "gather.h"

#include <sched.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "status.h"

namespace distore {

namespace {

void validate(const std::vector<const RemoteKey*>& rkeys, const GatherItem* items, size_t n,
              const MemoryRegion& dest) {
  for (size_t i = 0; i < n; ++i) {
    const GatherItem& it = items[i];
    if (it.key_index >= rkeys.size() || rkeys[it.key_index] == nullptr) {
      throw UcxError(kStatusBadArgument, "item " + std::to_string(i) + ": remote key index " +
                                             std::to_string(it.key_index) + " out of range");
    }
    const RemoteKey& key = *rkeys[it.key_index];
    if (!key.contains(it.remote_address, it.length)) {
      throw UcxError(kStatusOutOfBounds,
                     "item " + std::to_string(i) + ": remote range [" +
                         std::to_string(it.remote_address) + ", +" + std::to_string(it.length) +
                         ") lies outside the peer's registered region",
                     key.peer());
    }
    if (it.length > dest.size() || it.dest_offset > dest.size() - it.length) {
      throw UcxError(kStatusOutOfBounds, "item " + std::to_string(i) +
                                             ": destination range exceeds the local buffer (" +
                                             std::to_string(dest.size()) + " bytes)");
    }
  }
}

}  // namespace

void gather(ucp_worker_h worker, const std::vector<const RemoteKey*>& rkeys,
            const GatherItem* items, size_t n, const MemoryRegion& dest, double timeout_s,
            int32_t* statuses) {
  validate(rkeys, items, n, dest);
  std::vector<void*> requests(n, nullptr);
  size_t pending = 0;

  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
  param.memh = dest.memh();

  auto* base = reinterpret_cast<char*>(dest.address());
  for (size_t i = 0; i < n; ++i) {
    const GatherItem& it = items[i];
    const RemoteKey& key = *rkeys[it.key_index];
    if (it.length == 0) {
      statuses[i] = UCS_OK;
      continue;
    }
    ucs_status_ptr_t r = ucp_get_nbx(key.endpoint(), base + it.dest_offset, it.length,
                                     it.remote_address, key.rkey(), &param);
    if (r == nullptr) {
      statuses[i] = UCS_OK;  // completed inline
    } else if (UCS_PTR_IS_ERR(r)) {
      statuses[i] = UCS_PTR_STATUS(r);
    } else {
      requests[i] = r;
      statuses[i] = UCS_INPROGRESS;
      ++pending;
    }
  }

  // Progress ourselves: another thread (ucxx's) may be parked in epoll on the
  // same worker and only polling request status can hang. After a stretch of
  // fruitless progress we yield the core rather than spin it.
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration<double>(timeout_s);
  unsigned idle = 0;
  bool cancelled = false;
  while (pending > 0) {
    unsigned events = ucp_worker_progress(worker);
    for (size_t i = 0; i < n; ++i) {
      if (requests[i] == nullptr) continue;
      ucs_status_t s = ucp_request_check_status(requests[i]);
      if (s == UCS_INPROGRESS) continue;
      statuses[i] = s;
      ucp_request_free(requests[i]);
      requests[i] = nullptr;
      --pending;
      events = 1;
    }
    if (events != 0) {
      idle = 0;
      continue;
    }
    // Nothing moved: yield, then sleep a little (a peer that answers over
    // TCP needs the core we would spin on), and past the deadline only poll.
    ++idle;
    if (cancelled) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    } else if (idle > 1024) {
      std::this_thread::sleep_for(std::chrono::microseconds(20));
    } else if (idle > 64) {
      sched_yield();
    }
    if (!cancelled && (idle & 255) == 0 && clock::now() > deadline) {
      // UCX completes cancelled requests with UCS_ERR_CANCELED on later
      // progress, except RMA reads, which it cannot cancel: those finish when
      // the endpoint fails (peer-failure handling, keepalive) or never.
      for (size_t i = 0; i < n; ++i) {
        if (requests[i] != nullptr) ucp_request_cancel(worker, requests[i]);
      }
      cancelled = true;
    }
  }
}

int32_t put(ucp_worker_h worker, const RemoteKey& key, uint64_t remote_address,
            const MemoryRegion& src, uint64_t length, double timeout_s) {
  if (!key.contains(remote_address, length) || length > src.size()) {
    throw UcxError(kStatusOutOfBounds, "put: range outside the remote or local region",
                   key.peer());
  }
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH;
  param.memh = src.memh();
  ucs_status_ptr_t r = ucp_put_nbx(key.endpoint(), reinterpret_cast<void*>(src.address()), length,
                                   remote_address, key.rkey(), &param);
  if (r == nullptr) {
    // Completed locally; flush to learn whether the peer accepted it.
    r = ucp_ep_flush_nbx(key.endpoint(), &param);
    if (r == nullptr) return UCS_OK;
  }
  if (UCS_PTR_IS_ERR(r)) return UCS_PTR_STATUS(r);
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration<double>(timeout_s);
  ucs_status_t s;
  while ((s = ucp_request_check_status(r)) == UCS_INPROGRESS) {
    if (ucp_worker_progress(worker) == 0) sched_yield();
    if (clock::now() > deadline) {
      ucp_request_cancel(worker, r);
    }
  }
  ucp_request_free(r);
  return s;
}

}  // namespace distore
