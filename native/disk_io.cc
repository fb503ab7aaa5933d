// Batched slot I/O against the tier file: see disk_io.h.
#include "disk_io.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "checksum.h"
#include "status.h"
#include "stream_copy.h"

namespace distore {

namespace {

constexpr size_t kHeader = 16;  // key, generation (spec.SLOT_HEADER)

// Runs work(i) for i in [0, n) over up to `threads` threads (the calling
// one included); items are handed out one at a time, so a slow transfer
// never holds back a queue behind it.
template <typename F>
void fan_out(size_t n, size_t threads, F work) {
  std::atomic<size_t> next{0};
  auto loop = [&] {
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) work(i);
  };
  const size_t extra = std::min(n, threads > 0 ? threads : 1) - (n > 0 ? 1 : 0);
  std::vector<std::thread> pool;
  pool.reserve(extra);
  for (size_t t = 0; t < extra; ++t) pool.emplace_back(loop);
  loop();
  for (auto& t : pool) t.join();
}

// pread/pwrite the whole range, resuming after short transfers; 0 or an errno
// (EIO for an end of file inside the range: a truncated tier file).
template <typename Op>
int transfer_all(Op op, size_t length, uint64_t offset) {
  size_t done = 0;
  while (done < length) {
    const ssize_t got = op(done, length - done, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (got == 0) return EIO;
    done += static_cast<size_t>(got);
  }
  return 0;
}

// Writes the trailer of the stride bytes at `slot`.
void seal(uint8_t* slot, size_t stride) {
  const uint32_t crc = crc32c_update(0, slot, stride - kDiskTrailer);
  const uint32_t trailer[2] = {crc, ~crc};
  std::memcpy(slot + stride - kDiskTrailer, trailer, kDiskTrailer);
}

}  // namespace

bool disk_slot_sealed(const uint8_t* slot, size_t stride) {
  uint32_t trailer[2];
  std::memcpy(trailer, slot + stride - kDiskTrailer, kDiskTrailer);
  return trailer[1] == ~trailer[0] &&
         trailer[0] == crc32c_update(0, slot, stride - kDiskTrailer);
}

void disk_write_slots(int fd, const uint8_t* src, const uint64_t* src_offsets, size_t slot_size,
                      const uint64_t* disk_offsets, size_t stride, const uint64_t* keys,
                      const uint64_t* generations, size_t n, size_t threads, bool sync,
                      int32_t* statuses) {
  fan_out(n, threads, [&](size_t i) {
    void* raw = nullptr;
    if (posix_memalign(&raw, kDiskAlign, stride) != 0) {
      statuses[i] = ENOMEM;
      return;
    }
    auto* buf = static_cast<uint8_t*>(raw);
    std::memcpy(buf, src + src_offsets[i], slot_size);
    std::memset(buf + slot_size, 0, stride - slot_size);
    const uint64_t header[2] = {keys[i], generations[i]};
    std::memcpy(buf, header, kHeader);
    seal(buf, stride);
    statuses[i] = transfer_all(
        [&](size_t at, size_t len, off_t off) { return ::pwrite(fd, buf + at, len, off); },
        stride, disk_offsets[i]);
    std::free(raw);
  });
  if (sync && n > 0 && ::fdatasync(fd) != 0) {
    const int err = errno;
    for (size_t i = 0; i < n; ++i) {
      if (statuses[i] == 0) statuses[i] = err;
    }
  }
}

namespace {

// One work unit of a read: slot i whole into dest, or its `part`-th chunk
// through `via` (chunk bytes of contiguous memory) and on into dest.
int read_unit(int fd, uint64_t disk_offset, size_t stride, uint8_t* to, size_t part,
              uint8_t* via, size_t chunk) {
  if (via == nullptr) {
    return transfer_all(
        [&](size_t at, size_t len, off_t off) { return ::pread(fd, to + at, len, off); },
        stride, disk_offset);
  }
  const size_t done = part * chunk;
  const size_t len = std::min(chunk, stride - done);
  const int status = transfer_all(
      [&](size_t at, size_t l, off_t off) { return ::pread(fd, via + at, l, off); }, len,
      disk_offset + done);
  // On to the staging slot with non-temporal stores (stream_copy.h): the
  // staged bytes are read next by a learner, not by this thread. On a small
  // machine this copy slows the disk's transfers beside it, less so streamed
  // in chunks than as whole items (docs/performance.md, perf/tier_bandwidth.py).
  if (status == 0) stream_copy(to + done, via, len, 0);
  return status;
}

// After every unit has ended: each slot's status, its header checked; a
// failed slot's header zeroed.
void check_slots(uint8_t* dest, const uint64_t* dest_offsets, const uint64_t* keys,
                 const uint64_t* generations, size_t n, const std::atomic<int>* errors,
                 int32_t* statuses) {
  for (size_t i = 0; i < n; ++i) {
    uint8_t* to = dest + dest_offsets[i];
    int status = errors[i].load();
    if (status == 0) {
      uint64_t header[2];
      std::memcpy(header, to, kHeader);
      if (header[0] != keys[i] || header[1] != generations[i]) status = kStatusStale;
    }
    if (status != 0) std::memset(to, 0, kHeader);
    statuses[i] = status;
  }
}

void fail(std::atomic<int>& error, int status) {
  int none = 0;
  error.compare_exchange_strong(none, status);
}

// A slot whose reads all succeeded: its trailer checked (kStatusCorrupt if
// it does not match, the slot's error unless it has one already).
void verify_slot(const uint8_t* slot, size_t stride, std::atomic<int>& error) {
  if (error.load(std::memory_order_relaxed) == 0 && !disk_slot_sealed(slot, stride)) {
    fail(error, kStatusCorrupt);
  }
}

}  // namespace

void disk_read_slots(int fd, const uint64_t* disk_offsets, size_t stride, uint8_t* dest,
                     const uint64_t* dest_offsets, const uint64_t* keys,
                     const uint64_t* generations, size_t n, size_t threads, bool verify,
                     int32_t* statuses) {
  std::vector<std::atomic<int>> errors(n);
  for (auto& e : errors) e.store(0, std::memory_order_relaxed);
  fan_out(n, threads, [&](size_t i) {
    const int status =
        read_unit(fd, disk_offsets[i], stride, dest + dest_offsets[i], 0, nullptr, 0);
    if (status != 0) fail(errors[i], status);
    if (verify) verify_slot(dest + dest_offsets[i], stride, errors[i]);
  });
  check_slots(dest, dest_offsets, keys, generations, n, errors.data(), statuses);
}

struct DiskReader::Batch {
  int fd;
  const uint64_t* disk_offsets;
  size_t stride;
  uint8_t* dest;
  const uint64_t* dest_offsets;
  size_t pieces;  // units per slot
  size_t units;
  size_t next = 0;  // the next unit to hand out (under mu_)
  size_t done = 0;  // units ended (under mu_)
  std::vector<std::atomic<int>> errors;
  std::vector<std::atomic<size_t>> left;  // units of each slot not yet ended
};

DiskReader::DiskReader(size_t threads, size_t chunk) : chunk_(chunk) {
  threads = std::max<size_t>(1, threads);
  if (chunk % kDiskAlign != 0) {
    throw std::invalid_argument("DiskReader: chunk must be a multiple of 4096 bytes (0: none)");
  }
  if (chunk > 0) {
    constexpr size_t kHuge = size_t{2} << 20;
    map_bytes_ = threads * chunk + kHuge;
    map_ = ::mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
                  0);
    if (map_ == MAP_FAILED) {
      map_ = nullptr;
      throw std::system_error(errno, std::generic_category(),
                              "DiskReader: cannot map " + std::to_string(map_bytes_) +
                                  " bytes of bounce memory");
    }
    ::madvise(map_, map_bytes_, MADV_HUGEPAGE);  // a hint: 4 KiB pages still work
    const auto at = reinterpret_cast<uintptr_t>(map_);
    bounce_ = reinterpret_cast<uint8_t*>((at + kHuge - 1) / kHuge * kHuge);
    std::memset(bounce_, 0, threads * chunk);  // faulted in address order: contiguous
  }
  pool_.reserve(threads);
  for (size_t t = 0; t < threads; ++t) pool_.emplace_back(&DiskReader::work, this, t);
}

DiskReader::~DiskReader() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  ready_.notify_all();
  for (auto& t : pool_) t.join();
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

void DiskReader::work(size_t worker) {
  uint8_t* via = bounce_ == nullptr ? nullptr : bounce_ + worker * chunk_;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    ready_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and every queued batch handed out
    Batch* b = queue_.front();
    const size_t u = b->next++;
    if (b->next == b->units) queue_.pop_front();
    lock.unlock();
    const size_t i = u / b->pieces;
    if (b->errors[i].load(std::memory_order_relaxed) == 0) {  // else the slot failed already
      const int status = read_unit(b->fd, b->disk_offsets[i], b->stride,
                                   b->dest + b->dest_offsets[i], u % b->pieces, via, chunk_);
      if (status != 0) fail(b->errors[i], status);
    }
    // The slot's last unit: every part of it is in dest (each unit's copy
    // ends with a store fence; acq_rel orders the other threads' parts).
    if (b->left[i].fetch_sub(1, std::memory_order_acq_rel) == 1) {
      verify_slot(b->dest + b->dest_offsets[i], b->stride, b->errors[i]);
    }
    lock.lock();
    if (++b->done == b->units) finished_.notify_all();
  }
}

void DiskReader::read(int fd, const uint64_t* disk_offsets, size_t stride, uint8_t* dest,
                      const uint64_t* dest_offsets, const uint64_t* keys,
                      const uint64_t* generations, size_t n, int32_t* statuses) {
  if (n == 0) return;
  Batch b;
  b.fd = fd;
  b.disk_offsets = disk_offsets;
  b.stride = stride;
  b.dest = dest;
  b.dest_offsets = dest_offsets;
  b.pieces = chunk_ == 0 ? 1 : (stride + chunk_ - 1) / chunk_;
  b.units = n * b.pieces;
  b.errors = std::vector<std::atomic<int>>(n);
  for (auto& e : b.errors) e.store(0, std::memory_order_relaxed);
  b.left = std::vector<std::atomic<size_t>>(n);
  for (auto& l : b.left) l.store(b.pieces, std::memory_order_relaxed);
  {
    std::unique_lock<std::mutex> lock(mu_);
    queue_.push_back(&b);
    ready_.notify_all();
    finished_.wait(lock, [&] { return b.done == b.units; });
  }
  check_slots(dest, dest_offsets, keys, generations, n, b.errors.data(), statuses);
}

}  // namespace distore
