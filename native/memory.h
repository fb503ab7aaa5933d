// A memory region registered with UCX (ucp_mem_map).
//
// Ownership: a MemoryRegion owns its pages (mmap'd here, or borrowed from a
// caller-owned allocation such as a torch/CuPy buffer, which it keeps alive
// through `owner`) and its ucp_mem_h, and holds the owner (owner.h) of
// the ucp_context_h (the Python runtime's RegionOwner, which also holds
// every worker made on the context: UCX finishes a rendezvous send aborted
// while its peer held this memory only at ucp_mem_unmap, on the sending
// worker), so neither can be destroyed first. Teardown: ucp_mem_unmap, then munmap, then the
// context reference is dropped.
// Thread safety: immutable after construction; the bytes themselves are the
// caller's to synchronise (the storage node writes only slots it owns).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include <ucp/api/ucp.h>

#include "owner.h"

namespace distore {

// A packed remote key travels sealed: "DSRK", uint32 length, uint32 CRC-32C
// of UCX's packed bytes, then those bytes.
constexpr uint32_t kRkeyMagic = 0x4B525344;  // "DSRK" little-endian
constexpr size_t kRkeyHeader = 12;

class MemoryRegion {
 public:
  // Allocates `size` bytes, page aligned, and maps them with UCX. Pages:
  // reserved 2 MiB hugepages when `hugepages` and the kernel has them, else
  // transparent hugepages (madvise) for regions of 2 MiB or more, else 4 KiB.
  // `remote_read`: peers may read the region with a packed remote key.
  // Remote write is never granted.
  MemoryRegion(Owner context, uintptr_t context_handle, size_t size, bool remote_read,
               bool hugepages);
  // A write-protected region for remote reading: the same pages mapped
  // twice from a memfd, read-only where UCX registers them (and peers read
  // them) and writable at local_address() for the owner. UCX's software
  // transports (TCP emulation, CMA) do not enforce a registration's access
  // flags; this makes a remote write fault instead of changing data.
  // The memfd is sealed against any new writable mapping, against write()
  // and against resizing (F_SEAL_FUTURE_WRITE | SHRINK | GROW | SEAL) and
  // kept open: share_fd() can be handed to same-host readers, who can only
  // map it read-only. Pages: reserved hugepages (MFD_HUGETLB) when
  // `hugepages` and the kernel has enough, else shmem transparent hugepages
  // where the admin allows them (madvise), else 4 KiB; page_kind() says.
  static MemoryRegion* write_protected(Owner context, uintptr_t context_handle, size_t size,
                                       bool hugepages);
  // Registers caller-owned memory [address, address + size); `owner` keeps it
  // alive. `memory_type` is a ucs_memory_type_t (0 host, 1 cuda, ...).
  MemoryRegion(Owner context, uintptr_t context_handle, uintptr_t address, size_t size,
               Owner owner, int memory_type);
  ~MemoryRegion();
  MemoryRegion(const MemoryRegion&) = delete;
  MemoryRegion& operator=(const MemoryRegion&) = delete;

  uintptr_t address() const { return reinterpret_cast<uintptr_t>(base_); }
  // Where the owner writes: address() unless the region is write-protected.
  uintptr_t local_address() const {
    return reinterpret_cast<uintptr_t>(local_ != nullptr ? local_ : base_);
  }
  bool is_write_protected() const { return local_ != nullptr; }
  size_t size() const { return size_; }
  bool hugepages() const { return hugepages_; }  // reserved or transparent
  bool remote_read() const { return remote_read_; }
  // The sealed memfd behind a write-protected region, or -1 (other regions,
  // or a kernel without F_SEAL_FUTURE_WRITE: then it must not be shared).
  // Owned by the region; callers that send it elsewhere do not close it.
  int share_fd() const { return share_fd_; }
  // "hugetlb" (reserved 2 MiB pages), "thp" (transparent hugepages asked
  // for; the kernel's shmem/anon THP setting decides), or "4k".
  const char* page_kind() const { return page_kind_; }
  ucp_mem_h memh() const { return memh_; }
  // Makes the pages of [offset, offset + length) (clipped to the region) now,
  // writable, so that later writes take no first-touch fault (the kernel
  // allocates and zeroes each page there). One madvise(MADV_POPULATE_WRITE)
  // (Linux 5.14) on the writable mapping; on an older kernel each page's
  // first byte is written back as read. Returns 0, or the errno of a
  // failure: ENOMEM/EFAULT when the host cannot back the pages (no memory,
  // or no hugepages left).
  // Thread safety: call it before anything else writes those bytes (the
  // older kernels' way rewrites a byte a page).
  int populate(size_t offset, size_t length) const;
  // Packs a remote key a peer unpacks with RemoteKey (sealed: see above).
  // Raises if the region was not mapped for remote read.
  std::string pack_rkey() const;

 private:
  MemoryRegion() = default;
  void map(int memory_type, unsigned prot);

  Owner context_;
  Owner owner_;
  ucp_context_h context_handle_ = nullptr;
  void* base_ = nullptr;
  void* local_ = nullptr;  // writable alias of base_ (write-protected regions)
  size_t size_ = 0;
  size_t mapped_size_ = 0;  // bytes to munmap; 0 for borrowed memory
  bool hugepages_ = false;
  bool remote_read_ = false;
  ucp_mem_h memh_ = nullptr;
  int share_fd_ = -1;
  const char* page_kind_ = "4k";
};

}  // namespace distore
