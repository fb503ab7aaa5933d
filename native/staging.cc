#include "staging.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <vector>

#include "status.h"
#include "stream_copy.h"

namespace distore {

namespace {

constexpr uint64_t kHeader = 16;                 // key, generation (spec.SLOT_HEADER)
constexpr int kMadvPopulateRead = 22;            // MADV_POPULATE_READ (Linux 5.14)
constexpr size_t kStreamMin = size_t(256) << 10;  // non-temporal stores from here up

// Arena slots are read later by learners (other processes): copies of
// kStreamMin bytes and more stream past the cache (stream_copy.h).
void copy_to_slot(uint8_t* dst, const uint8_t* src, size_t len) {
  stream_copy(dst, src, len, kStreamMin);
}

}  // namespace

StagingMap::StagingMap(int fd, size_t size, std::string peer) : size_(size), peer_(std::move(peer)) {
  if (size == 0) throw UcxError(kStatusBadArgument, "cannot map an empty staging buffer", peer_);
  const int seals = fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    throw UcxError(kStatusBadArgument,
                   "the writer's staging fd is not a sealable memfd: " +
                       std::string(std::strerror(errno)),
                   peer_);
  }
  if (!(seals & F_SEAL_SHRINK) || !(seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE))) {
    throw UcxError(kStatusBadArgument,
                   "the writer's staging memfd is not sealed against shrinking and writes "
                   "(its pages could vanish under a read)",
                   peer_);
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size < 0 || static_cast<uint64_t>(st.st_size) < size) {
    throw UcxError(kStatusOutOfBounds,
                   "the writer's staging memfd is smaller than the " + std::to_string(size) +
                       " bytes it claims",
                   peer_);
  }
  void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    throw UcxError(UCS_ERR_NO_MEMORY,
                   "mapping a writer's staging buffer read-only failed: " +
                       std::string(std::strerror(errno)),
                   peer_);
  }
  base_ = static_cast<uint8_t*>(p);
  // A hugepage memfd's pages are made now, in one call: one without pages
  // left fails here, cleanly, rather than with SIGBUS in the middle of a
  // copy. Not a 4k (or THP) one: populating allocates and zeroes every page
  // the writer never wrote, and a writer of small items writes a few KB of
  // its 8 MiB buffers (15 ms and 8 MiB of memory a hand-off, 8 GiB for 256
  // writers' buffers on one node); the pages it wrote fault in on first read.
  struct statfs fs;
  const bool hugetlb = fstatfs(fd, &fs) == 0 && fs.f_type == HUGETLBFS_MAGIC;
  if (hugetlb && madvise(base_, size_, kMadvPopulateRead) != 0) {
    const int err = errno;
    munmap(base_, size_);
    base_ = nullptr;
    throw UcxError(UCS_ERR_NO_MEMORY,
                   "populating a writer's staging mapping failed (Linux >= 5.14 needed): " +
                       std::string(std::strerror(err)),
                   peer_);
  }
}

StagingMap::~StagingMap() {
  if (base_ != nullptr) munmap(base_, size_);
}

void pull_mapped(const MemoryRegion& arena, const StagingMap& src, uint64_t src_base,
                 const PullItem* items, size_t n, CopyPool* pool, size_t parallel_bytes,
                 int32_t* statuses) {
  validate_pull(arena, src_base, src.size(), items, n);
  auto* base = reinterpret_cast<uint8_t*>(arena.local_address());
  size_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    store_header(base, items[i].slot_offset, 0, 0);
    total += items[i].length;
  }
  std::atomic_thread_fence(std::memory_order_release);

  copy_ranges(
      pool, n, total, parallel_bytes,
      [&](size_t i) { return src.base() + (items[i].src_address - src_base); },
      [&](size_t i) { return base + items[i].slot_offset + kHeader; },
      [&](size_t i) { return static_cast<size_t>(items[i].length); }, copy_to_slot);

  std::atomic_thread_fence(std::memory_order_release);
  for (size_t i = 0; i < n; ++i) {
    store_header(base, items[i].slot_offset, items[i].key, items[i].generation);
    statuses[i] = UCS_OK;
  }
}

}  // namespace distore
