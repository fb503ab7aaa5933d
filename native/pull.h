// The storage node's side of an insert: it reads a writer's staged items
// one-sided, straight into arena slots, under the slot seqlock.
//
// Ownership: nothing here owns memory; the caller keeps the arena, the
// local-only registration of its writable alias and the writer's remote key
// alive for the call. Thread safety: one call writes only the slots it is
// given, which the caller has allocated to it alone.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>

#include <ucp/api/ucp.h>

#include "memory.h"
#include "remote_key.h"

namespace distore {

// One item of a pull: where it lies in the writer's staging buffer and which
// slot (offset into the arena) it goes to; its payload lands at slot + 16.
struct PullItem {
  uint64_t slot_offset;
  uint64_t src_address;
  uint64_t length;
  uint64_t key;
  uint64_t generation;
};

// Throws UcxError (kStatusOutOfBounds) if an item's slot does not fit in
// the arena (or is not 8-byte aligned) or its source range lies outside
// [src_base, src_base + src_size).
void validate_pull(const MemoryRegion& arena, uint64_t src_base, uint64_t src_size,
                   const PullItem* items, size_t n);

// Writes a slot header (key, generation) with relaxed atomic stores.
void store_header(uint8_t* arena_base, uint64_t slot, uint64_t key, uint64_t generation);

// Pulls a batch into slots of `arena` (written through its writable alias):
//   1. every slot's header becomes (key 0, generation 0): invalid;
//   2. release fence; the payloads are read from the writer, one-sided:
//      with `rkey` through UCX (ucp_get_nbx into `dest`, the arena's
//      writable alias registered for local access), else from process `pid`
//      with process_vm_readv (a same-host writer: unlike UCX's CMA transport
//      without peer-failure handling, a dead writer is an error, not an abort);
//   3. release fence; each slot whose read succeeded gets its real header.
// Validates every item first (slot inside the arena, source inside
// [src_base, src_base + src_size)) and throws UcxError before writing
// anything if one is wrong. Writes each item's ucs_status_t into `statuses`.
// Must be called without the GIL.
void pull(const MemoryRegion& arena, const MemoryRegion* dest, ucp_worker_h worker,
          const RemoteKey* rkey, pid_t pid, uint64_t src_base, uint64_t src_size,
          const PullItem* items, size_t n, double timeout_s, int32_t* statuses);

}  // namespace distore
