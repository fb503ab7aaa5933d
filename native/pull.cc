#include "pull.h"

#include <sys/uio.h>

#include <atomic>
#include <cerrno>
#include <climits>
#include <string>
#include <vector>

#include "gather.h"
#include "status.h"

namespace distore {

namespace {

constexpr uint64_t kHeader = 16;  // key, generation (spec.SLOT_HEADER)

}  // namespace

void store_header(uint8_t* base, uint64_t slot, uint64_t key, uint64_t generation) {
  auto* h = reinterpret_cast<uint64_t*>(base + slot);
  __atomic_store_n(&h[0], key, __ATOMIC_RELAXED);
  __atomic_store_n(&h[1], generation, __ATOMIC_RELAXED);
}

void validate_pull(const MemoryRegion& arena, uint64_t src_base, uint64_t src_size,
                   const PullItem* items, size_t n) {
  const uint64_t size = arena.size();
  for (size_t i = 0; i < n; ++i) {
    const PullItem& it = items[i];
    if (it.slot_offset % 8 != 0 || it.slot_offset > size || size - it.slot_offset < kHeader ||
        it.length > size - it.slot_offset - kHeader) {
      throw UcxError(kStatusOutOfBounds, "pull: item " + std::to_string(i) + ": slot at " +
                                             std::to_string(it.slot_offset) +
                                             " does not fit in the arena");
    }
    if (it.src_address < src_base || it.length > src_size ||
        it.src_address - src_base > src_size - it.length) {
      throw UcxError(kStatusOutOfBounds,
                     "pull: item " + std::to_string(i) + ": source range [" +
                         std::to_string(it.src_address) + ", +" + std::to_string(it.length) +
                         ") lies outside the writer's staging buffer");
    }
  }
}

namespace {

int32_t errno_status(int err) {
  switch (err) {
    case ESRCH:
      return UCS_ERR_CONNECTION_RESET;  // the writer's process is gone
    case EFAULT:
      return UCS_ERR_INVALID_ADDR;  // not mapped in the writer
    default:
      return UCS_ERR_IO_ERROR;
  }
}

// Reads items from process `pid` with as few process_vm_readv calls as the
// kernel's iovec limit allows; a short read resumes at the first byte missed.
void pull_cma(pid_t pid, uint8_t* base, const PullItem* items, size_t n, int32_t* statuses) {
  size_t i = 0;
  uint64_t done_in_first = 0;  // bytes of items[i] already read
  std::vector<iovec> local, remote;
  while (i < n) {
    local.clear();
    remote.clear();
    size_t j = i;
    for (; j < n && local.size() < IOV_MAX; ++j) {
      const uint64_t skip = j == i ? done_in_first : 0;
      const PullItem& it = items[j];
      if (it.length == skip) continue;
      local.push_back({base + it.slot_offset + kHeader + skip, it.length - skip});
      remote.push_back({reinterpret_cast<void*>(it.src_address + skip), it.length - skip});
    }
    ssize_t got = local.empty() ? 0
                                : process_vm_readv(pid, local.data(), local.size(),
                                                   remote.data(), remote.size(), 0);
    if (got < 0) {
      const int32_t s = errno_status(errno);
      for (size_t k = i; k < n; ++k) statuses[k] = s;
      return;
    }
    // Mark the items the kernel copied completely.
    uint64_t left = static_cast<uint64_t>(got);
    while (i < j) {
      const uint64_t need = items[i].length - done_in_first;
      if (left < need) {
        done_in_first += left;
        break;
      }
      left -= need;
      statuses[i++] = UCS_OK;
      done_in_first = 0;
    }
    if (i < j && got == 0) {  // no progress on a non-empty request: give up
      for (size_t k = i; k < n; ++k) statuses[k] = UCS_ERR_IO_ERROR;
      return;
    }
  }
}

}  // namespace

void pull(const MemoryRegion& arena, const MemoryRegion* dest, ucp_worker_h worker,
          const RemoteKey* rkey, pid_t pid, uint64_t src_base, uint64_t src_size,
          const PullItem* items, size_t n, double timeout_s, int32_t* statuses) {
  validate_pull(arena, src_base, src_size, items, n);
  if (rkey != nullptr && (dest == nullptr || worker == nullptr)) {
    throw UcxError(kStatusBadArgument, "pull: a UCX pull needs the worker and a destination");
  }
  if (rkey == nullptr && pid <= 0) {
    throw UcxError(kStatusBadArgument, "pull: neither a remote key nor a writer pid");
  }
  if (dest != nullptr && (dest->address() != arena.local_address() || dest->size() < arena.size())) {
    throw UcxError(kStatusBadArgument, "pull: dest is not the arena's writable alias");
  }
  auto* base = reinterpret_cast<uint8_t*>(arena.local_address());
  for (size_t i = 0; i < n; ++i) store_header(base, items[i].slot_offset, 0, 0);
  std::atomic_thread_fence(std::memory_order_release);

  if (rkey != nullptr) {
    std::vector<const RemoteKey*> keys{rkey};
    std::vector<GatherItem> reads(n);
    for (size_t i = 0; i < n; ++i) {
      reads[i] = GatherItem{0, items[i].src_address, items[i].length,
                            items[i].slot_offset + kHeader};
    }
    gather(worker, keys, reads.data(), n, *dest, timeout_s, statuses);
  } else {
    pull_cma(pid, base, items, n, statuses);
  }

  std::atomic_thread_fence(std::memory_order_release);
  for (size_t i = 0; i < n; ++i) {
    if (statuses[i] == UCS_OK) {
      store_header(base, items[i].slot_offset, items[i].key, items[i].generation);
    }
  }
}

}  // namespace distore
