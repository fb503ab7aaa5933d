// The storage node's same-host insert path: a writer's staging buffer
// mapped read-only, and the batched copy from it into arena slots.
//
// A same-host writer hands the node the sealed memfd behind its staging
// buffer (transport/local_map.py); the node maps it PROT_READ and copies
// each batch into its slots with plain loads, in one call without the GIL.
// No system call and no page pinning per item (process_vm_readv pins every
// page it reads), and a writer that dies leaves the mapping readable: the
// pages belong to the memfd, which the mapping keeps alive, so a dead
// writer cannot fault the node.
//
// Ownership: a StagingMap owns its mapping (munmap on destruction), not the
// fd it was made from (the caller closes it). Thread safety: a StagingMap is
// immutable; pull_mapped writes only the slots it is given, which the caller
// has allocated to it alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "mapped.h"
#include "memory.h"
#include "pull.h"

namespace distore {

class StagingMap {
 public:
  // Maps the first `size` bytes of a writer's memfd read-only (a hugepage
  // memfd's pages made at once, staging.cc says why only those). Refuses (UcxError, kStatusBadArgument) an fd
  // that is not sealed against shrinking and against writes (a file that
  // could shrink, or have holes punched, could fault a later read with
  // SIGBUS), or that is smaller than `size`. `peer` names the writer.
  StagingMap(int fd, size_t size, std::string peer);
  ~StagingMap();
  StagingMap(const StagingMap&) = delete;
  StagingMap& operator=(const StagingMap&) = delete;

  const uint8_t* base() const { return base_; }
  size_t size() const { return size_; }
  const std::string& peer() const { return peer_; }

 private:
  uint8_t* base_ = nullptr;
  size_t size_ = 0;
  std::string peer_;
};

// Copies a batch from `src` into slots of `arena` (through its writable
// alias), seqlock style as pull() does: every slot's header invalid first,
// release fence, the payloads (at slot + 16), release fence, the real
// headers. items[i].src_address is the item's address in the writer, read
// at src.base() + (src_address - src_base). Validates every item first and
// throws UcxError before writing anything if one lies outside the arena or
// outside [src_base, src_base + src.size()). Batches of `parallel_bytes`
// or more are split over `pool` (may be null). Every item succeeds (the
// mapping cannot fail); statuses are all UCS_OK, for the caller's one
// code path. Call without the GIL.
void pull_mapped(const MemoryRegion& arena, const StagingMap& src, uint64_t src_base,
                 const PullItem* items, size_t n, CopyPool* pool, size_t parallel_bytes,
                 int32_t* statuses);

}  // namespace distore
