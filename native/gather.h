// The batched one-sided read at the heart of the sample path.
#pragma once

#include <cstdint>
#include <vector>

#include <ucp/api/ucp.h>

#include "layout.h"
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
// every read has completed. Items of a key with a pid (same-host peer) are
// read with process_vm_readv instead: a dead peer is an error status, not
// an abort. Writes each item's final ucs_status_t into `statuses`.
// Validates every item (key index, remote bounds, destination bounds) before
// posting anything and throws UcxError if one is wrong. Must be called
// without the GIL.
//
// On a stall or a timeout: UCX cannot cancel an RMA read that is already
// posted; such a read ends only when it completes or its endpoint fails.
// So when no read has finished for `stall_s` (0: never), or `timeout_s` has
// passed, the endpoints of the reads still pending are force-closed (our own
// Endpoints, made with error handling), which completes those reads with an
// error status. The call never returns while a read may still write into
// `dest`; a hung peer cannot hold the caller beyond the stall time. The
// control plane's lease on the slots is what keeps the data valid meanwhile.
void gather(ucp_worker_h worker, const std::vector<const RemoteKey*>& rkeys,
            const GatherItem* items, size_t n, const MemoryRegion& dest, double timeout_s,
            int32_t* statuses, double stall_s = 0.0);

// A sampled batch read into a structure of arrays: item i (slot at
// remote_address[i] under rkeys[key_index[i]]) lands in row rows[i] of
// `layout` in `dest`, its 16-byte header in the header array and each field
// in that field's dense array. Over UCX, with a host `staging` region (at
// least n x layout.read_length() bytes), each slot is read whole with one
// get, header with payload, and then copied into place (a get per part
// costs a round trip each where RMA is emulated: twice the time of the
// batch over TCP); without one (a device ring), one get per part. Items of
// same-host (CMA) keys are scattered by process_vm_readv, one iovec per
// part, in the same order (header first). statuses[i]: the first failed
// read's ucs_status_t, else UCS_OK. The caller checks the headers against
// the items it asked for (they may be in device memory). Throws like
// gather(), and if a row is outside the layout, the layout does not fit
// `dest` or staging is too small. Must be called without the GIL.
//
// Runs: with `slot_stride` (the arena's slot size; 0: none), whole slots
// are staged `slot_stride` apart, and an item whose slot follows the
// previous item's in the same arena joins its get: a slice's steps stored
// one after another are one read (staging then needs (n - 1) x slot_stride
// + read_length bytes). A failed get fails every item of its run.
// `reads`, when given, is incremented by the reads posted (gets, and parts
// of CMA items).
void gather_dense(ucp_worker_h worker, const std::vector<const RemoteKey*>& rkeys,
                  const uint32_t* key_index, const uint64_t* remote_address,
                  const uint64_t* rows, size_t n, const BatchLayout& layout,
                  const MemoryRegion& dest, const MemoryRegion* staging, double timeout_s,
                  int32_t* statuses, double stall_s = 0.0, uint64_t slot_stride = 0,
                  uint64_t* reads = nullptr);

// One-sided write of `length` bytes from `src` to `remote_address` under
// `key`; returns the final ucs_status_t. It exists to verify that storage
// arenas refuse remote writes (they are mapped for remote READ only).
int32_t put(ucp_worker_h worker, const RemoteKey& key, uint64_t remote_address,
            const MemoryRegion& src, uint64_t length, double timeout_s);

}  // namespace distore
