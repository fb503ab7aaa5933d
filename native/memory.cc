#include "memory.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "status.h"

namespace distore {

namespace {
constexpr size_t kHugePage = size_t(2) << 20;
constexpr int kMadvPopulateWrite = 23;  // MADV_POPULATE_WRITE (Linux 5.14), not in older headers

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// The CUDA driver's context calls, found only if the process already loaded
// libcuda (torch or CuPy did): a context can be current only then.
struct CudaContextCalls {
  using Get = int (*)(void**);
  using Pop = int (*)(void**);
  using Push = int (*)(void*);
  Get get = nullptr;
  Pop pop = nullptr;
  Push push = nullptr;
};

CudaContextCalls cuda_context_calls() {
  CudaContextCalls c;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) return c;
  c.get = reinterpret_cast<CudaContextCalls::Get>(dlsym(lib, "cuCtxGetCurrent"));
  c.pop = reinterpret_cast<CudaContextCalls::Pop>(dlsym(lib, "cuCtxPopCurrent_v2"));
  c.push = reinterpret_cast<CudaContextCalls::Push>(dlsym(lib, "cuCtxPushCurrent_v2"));
  dlclose(lib);  // RTLD_NOLOAD took a reference; the library stays loaded
  if (c.get == nullptr || c.pop == nullptr || c.push == nullptr) return CudaContextCalls{};
  return c;
}

// Registers `params` with no CUDA context current on this thread, if one
// was: UCX's cuda_copy memory domain pins host memory (cuMemHostRegister)
// only when a context is current, and pinning a read-only mapping fails,
// which fails the whole registration. Our read-only regions are read by
// peers over the network or shared memory, never copied by CUDA, so they
// need no pinning. Returns UCS_ERR_UNSUPPORTED if no context was current
// (nothing to retry).
ucs_status_t map_without_cuda_context(ucp_context_h context, const ucp_mem_map_params_t* params,
                                      ucp_mem_h* memh) {
  const CudaContextCalls cuda = cuda_context_calls();
  void* ctx = nullptr;
  if (cuda.get == nullptr || cuda.get(&ctx) != 0 || ctx == nullptr) return UCS_ERR_UNSUPPORTED;
  void* popped = nullptr;
  if (cuda.pop(&popped) != 0) return UCS_ERR_UNSUPPORTED;
  const ucs_status_t status = ucp_mem_map(context, params, memh);
  cuda.push(popped);
  return status;
}
}  // namespace

MemoryRegion::MemoryRegion(Owner context, uintptr_t context_handle, size_t size,
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
    if (hugepages_) page_kind_ = "hugetlb";
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
      if (hugepages_) page_kind_ = "thp";
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

MemoryRegion::MemoryRegion(Owner context, uintptr_t context_handle, uintptr_t address,
                           size_t size, Owner owner, int memory_type)
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

namespace {

// A memfd of `length` bytes mapped read-write and read-only. Returns false
// (and leaves errno) when any step fails; cleans up what it made.
bool memfd_pair(unsigned flags, size_t length, int* fd_out, void** rw_out, void** ro_out) {
  int fd = memfd_create("distore-arena", MFD_CLOEXEC | MFD_ALLOW_SEALING | flags);
  if (fd < 0) return false;
  if (ftruncate(fd, static_cast<off_t>(length)) != 0) {
    const int err = errno;
    close(fd);
    errno = err;
    return false;
  }
  void* rw = mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  void* ro = rw == MAP_FAILED ? MAP_FAILED : mmap(nullptr, length, PROT_READ, MAP_SHARED, fd, 0);
  if (ro == MAP_FAILED) {
    const int err = errno;
    if (rw != MAP_FAILED) munmap(rw, length);
    close(fd);
    errno = err;
    return false;
  }
  *fd_out = fd;
  *rw_out = rw;
  *ro_out = ro;
  return true;
}

}  // namespace

MemoryRegion* MemoryRegion::write_protected(Owner context, uintptr_t context_handle,
                                            size_t size, bool hugepages) {
  if (size == 0) throw UcxError(kStatusBadArgument, "memory region size must be > 0");
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  int fd = -1;
  void *rw = nullptr, *ro = nullptr;
  size_t length = 0;
  const char* kind = "4k";
  if (hugepages) {
    // Reserved hugepages: the reservation is made at mmap time, so a host
    // without enough of them fails here and we fall back.
    length = round_up(size, kHugePage);
    if (memfd_pair(MFD_HUGETLB, length, &fd, &rw, &ro)) kind = "hugetlb";
  }
  if (fd < 0) {
    length = round_up(size, size >= kHugePage ? kHugePage : page);
    if (!memfd_pair(0, length, &fd, &rw, &ro)) {
      throw UcxError(UCS_ERR_NO_MEMORY, "memfd for a " + std::to_string(size) +
                                            "-byte arena failed: " + std::strerror(errno));
    }
    // Shared-memory THP: honoured when the admin set shmem_enabled to
    // advise/always/within_size; harmless otherwise.
    if (hugepages && length >= kHugePage && madvise(rw, length, MADV_HUGEPAGE) == 0) {
      madvise(ro, length, MADV_HUGEPAGE);
      kind = "thp";
    }
  }
  // Seal: no new writable mapping, no write(), no resize, no more seals.
  // Without F_SEAL_FUTURE_WRITE (Linux < 5.1) the fd is not shareable.
  const int seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL;
  if (fcntl(fd, F_ADD_SEALS, seals) != 0) {
    close(fd);
    fd = -1;
  }
  auto* r = new MemoryRegion();
  r->context_ = std::move(context);
  r->context_handle_ = reinterpret_cast<ucp_context_h>(context_handle);
  r->base_ = ro;
  r->local_ = rw;
  r->size_ = size;
  r->mapped_size_ = length;
  r->remote_read_ = true;
  r->share_fd_ = fd;
  r->page_kind_ = kind;
  r->hugepages_ = std::strcmp(kind, "4k") != 0;
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
  ucs_status_t status = UCS_ERR_UNSUPPORTED;
  if (local_ != nullptr && memory_type == UCS_MEMORY_TYPE_HOST) {
    // A write-protected region (its registered mapping is read-only) in a
    // process with a current CUDA context: see map_without_cuda_context.
    status = map_without_cuda_context(context_handle_, &params, &memh_);
  }
  if (status == UCS_ERR_UNSUPPORTED) status = ucp_mem_map(context_handle_, &params, &memh_);
  check(status, "ucp_mem_map");
}

int MemoryRegion::populate(size_t offset, size_t length) const {
  if (offset >= size_ || length == 0) return 0;
  length = std::min(length, size_ - offset);
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  auto* local = static_cast<uint8_t*>(local_ != nullptr ? local_ : base_);
  // madvise needs a page-aligned start; the region's base is one.
  const size_t start = offset / page * page;
  const size_t end = round_up(offset + length, page);
  if (madvise(local + start, end - start, kMadvPopulateWrite) == 0) return 0;
  if (errno != EINVAL) return errno;
  // A kernel without MADV_POPULATE_WRITE: a write to each page makes it.
  // The bytes are written back as they are read (a fresh region is zeros).
  for (size_t at = start; at < end; at += page) {
    volatile uint8_t* byte = local + at;
    *byte = *byte;
  }
  return 0;
}

MemoryRegion::~MemoryRegion() {
  if (memh_ != nullptr) ucp_mem_unmap(context_handle_, memh_);
  if (mapped_size_ != 0) munmap(base_, mapped_size_);
  if (local_ != nullptr) munmap(local_, mapped_size_);
  if (share_fd_ >= 0) close(share_fd_);
  // context_ and owner_ are released after this body: parents outlive us.
}

std::string MemoryRegion::pack_rkey() const {
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
  return sealed;
}

}  // namespace distore
