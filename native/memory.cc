#include "memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "status.h"

namespace nb = nanobind;

namespace distore {

namespace {
constexpr size_t kHugePage = size_t(2) << 20;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }
}  // namespace

MemoryRegion::MemoryRegion(nb::object context, uintptr_t context_handle, size_t size,
                           bool remote_read, bool hugepages)
    : context_(std::move(context)),
      context_handle_(reinterpret_cast<ucp_context_h>(context_handle)),
      remote_read_(remote_read) {
  if (size == 0) throw UcxError(kStatusBadArgument, "memory region size must be > 0");
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* p = MAP_FAILED;
  if (hugepages) {
    mapped_size_ = round_up(size, kHugePage);
    p = mmap(nullptr, mapped_size_, PROT_READ | PROT_WRITE,
             MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    hugepages_ = p != MAP_FAILED;
  }
  if (p == MAP_FAILED && size >= kHugePage) {
    // No reserved hugepages: ask for transparent ones on a 2 MiB-aligned
    // range. Fewer pages to pin and translate makes one-sided reads (CMA,
    // NIC) and local copies faster.
    mapped_size_ = round_up(size, kHugePage);
    void* raw = mmap(nullptr, mapped_size_ + kHugePage, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw != MAP_FAILED) {
      auto start = reinterpret_cast<uintptr_t>(raw);
      uintptr_t aligned = round_up(start, kHugePage);
      if (aligned > start) munmap(raw, aligned - start);
      uintptr_t end = aligned + mapped_size_;
      uintptr_t raw_end = start + mapped_size_ + kHugePage;
      if (raw_end > end) munmap(reinterpret_cast<void*>(end), raw_end - end);
      p = reinterpret_cast<void*>(aligned);
      hugepages_ = madvise(p, mapped_size_, MADV_HUGEPAGE) == 0;
    }
  }
  if (p == MAP_FAILED) {
    mapped_size_ = round_up(size, page);
    p = mmap(nullptr, mapped_size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  }
  if (p == MAP_FAILED) {
    throw UcxError(UCS_ERR_NO_MEMORY, "mmap of " + std::to_string(size) +
                                          " bytes failed: " + std::strerror(errno));
  }
  base_ = p;
  size_ = size;
  unsigned prot = UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE;
  if (remote_read) prot |= UCP_MEM_MAP_PROT_REMOTE_READ;
  try {
    map(UCS_MEMORY_TYPE_HOST, prot);
  } catch (...) {
    munmap(base_, mapped_size_);
    throw;
  }
}

MemoryRegion::MemoryRegion(nb::object context, uintptr_t context_handle, uintptr_t address,
                           size_t size, nb::object owner, int memory_type)
    : context_(std::move(context)),
      owner_(std::move(owner)),
      context_handle_(reinterpret_cast<ucp_context_h>(context_handle)),
      base_(reinterpret_cast<void*>(address)),
      size_(size) {
  if (size == 0 || address == 0) {
    throw UcxError(kStatusBadArgument, "cannot register an empty or null buffer");
  }
  map(memory_type, UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE);
}

MemoryRegion* MemoryRegion::write_protected(nb::object context, uintptr_t context_handle,
                                            size_t size) {
  if (size == 0) throw UcxError(kStatusBadArgument, "memory region size must be > 0");
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const size_t length = round_up(size, page);
  int fd = memfd_create("distore-arena", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(length)) != 0) {
    std::string why = std::strerror(errno);
    if (fd >= 0) close(fd);
    throw UcxError(UCS_ERR_NO_MEMORY, "memfd for a " + std::to_string(size) +
                                          "-byte arena failed: " + why);
  }
  void* rw = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  void* ro = rw == MAP_FAILED ? MAP_FAILED : mmap(nullptr, length, PROT_READ, MAP_SHARED, fd, 0);
  const int err = errno;
  close(fd);  // the mappings keep the memory
  if (ro == MAP_FAILED) {
    if (rw != MAP_FAILED) munmap(rw, length);
    throw UcxError(UCS_ERR_NO_MEMORY, "mmap of a " + std::to_string(size) +
                                          "-byte arena failed: " + std::strerror(err));
  }
  auto* r = new MemoryRegion();
  r->context_ = std::move(context);
  r->context_handle_ = reinterpret_cast<ucp_context_h>(context_handle);
  r->base_ = ro;
  r->local_ = rw;
  r->size_ = size;
  r->mapped_size_ = length;
  r->remote_read_ = true;
  try {
    r->map(UCS_MEMORY_TYPE_HOST, UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_REMOTE_READ);
  } catch (...) {
    delete r;
    throw;
  }
  return r;
}

void MemoryRegion::map(int memory_type, unsigned prot) {
  ucp_mem_map_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_PROT | UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  params.address = base_;
  params.length = size_;
  params.prot = prot;
  params.memory_type = static_cast<ucs_memory_type_t>(memory_type);
  check(ucp_mem_map(context_handle_, &params, &memh_), "ucp_mem_map");
}

MemoryRegion::~MemoryRegion() {
  if (memh_ != nullptr) ucp_mem_unmap(context_handle_, memh_);
  if (mapped_size_ != 0) munmap(base_, mapped_size_);
  if (local_ != nullptr) munmap(local_, mapped_size_);
  // context_ and owner_ are released after this body: parents outlive us.
}

nb::bytes MemoryRegion::pack_rkey() const {
  if (!remote_read_) {
    throw UcxError(UCS_ERR_UNSUPPORTED, "this memory region is not mapped for remote access");
  }
  void* buf = nullptr;
  size_t len = 0;
  check(ucp_rkey_pack(context_handle_, memh_, &buf, &len), "ucp_rkey_pack");
  // Sealed: magic, length, CRC-32C, then UCX's bytes (see RemoteKey).
  std::string sealed(kRkeyHeader + len, '\0');
  const uint32_t magic = kRkeyMagic, n = static_cast<uint32_t>(len), crc = crc32c(buf, len);
  std::memcpy(&sealed[0], &magic, 4);
  std::memcpy(&sealed[4], &n, 4);
  std::memcpy(&sealed[8], &crc, 4);
  std::memcpy(&sealed[kRkeyHeader], buf, len);
  ucp_rkey_buffer_release(buf);
  return nb::bytes(sealed.data(), sealed.size());
}

}  // namespace distore
