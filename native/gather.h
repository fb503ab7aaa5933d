// The batched one-sided read at the heart of the sample path.
#pragma once

#include <cstdint>
#include <vector>

#include <ucp/api/ucp.h>

#include "memory.h"
#include "remote_key.h"

namespace distore {

struct GatherItem {
  uint32_t key_index;  // index into the rkeys vector
  uint64_t remote_address;
  uint64_t length;
  uint64_t dest_offset;
};

// Posts one ucp_get_nbx per item into `dest`, then progresses `worker` until
// every read has completed. Writes each item's final ucs_status_t into
// `statuses`. Validates every item (key index, remote bounds, destination
// bounds) before posting anything and throws UcxError if one is wrong. Must
// be called without the GIL.
//
// On a timeout: once `timeout_s` has passed, every read still in flight is
// handed to ucp_request_cancel, and the call goes on progressing (polling
// every millisecond) until each has completed. It never returns while a read
// may still write into `dest`. UCX cannot cancel an RMA read that is already
// posted: such a read ends only when it completes (status UCS_OK), or when
// the endpoint fails (peer-failure handling or keepalive: an error status);
// on transports without peer-failure detection (shared memory) a dead peer's
// read may keep the call waiting. `timeout_s` is therefore a deadline for
// giving up, not a bound on how long the call takes; the control plane's
// lease on the slots is what keeps the data valid meanwhile.
void gather(ucp_worker_h worker, const std::vector<const RemoteKey*>& rkeys,
            const GatherItem* items, size_t n, const MemoryRegion& dest, double timeout_s,
            int32_t* statuses);

// One-sided write of `length` bytes from `src` to `remote_address` under
// `key`; returns the final ucs_status_t. It exists to verify that storage
// arenas refuse remote writes (they are mapped for remote READ only).
int32_t put(ucp_worker_h worker, const RemoteKey& key, uint64_t remote_address,
            const MemoryRegion& src, uint64_t length, double timeout_s);

}  // namespace distore
