// Batched slot I/O against the tier file: see disk_io.h.
#include "disk_io.h"

#include <sys/mman.h>
#include <sys/uio.h>
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
// (EIO for an end of file inside the range: a truncated tier file). Each
// call of `op` is counted in *calls when given.
template <typename Op>
int transfer_all(Op op, size_t length, uint64_t offset, uint64_t* calls = nullptr) {
  size_t done = 0;
  while (done < length) {
    if (calls != nullptr) ++*calls;
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

// Slot i read whole straight into dest (disk_read_slots, one read a slot).
int read_slot(int fd, uint64_t disk_offset, size_t stride, uint8_t* to) {
  return transfer_all(
      [&](size_t at, size_t len, off_t off) { return ::pread(fd, to + at, len, off); }, stride,
      disk_offset);
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
    const int status = read_slot(fd, disk_offsets[i], stride, dest + dest_offsets[i]);
    if (status != 0) fail(errors[i], status);
    if (verify) verify_slot(dest + dest_offsets[i], stride, errors[i]);
  });
  check_slots(dest, dest_offsets, keys, generations, n, errors.data(), statuses);
}

namespace {

// Destination pieces one preadv takes (Linux's UIO_MAXIOV): a run whose
// destinations do not follow each other is cut after this many.
constexpr size_t kMaxIov = 1024;

// preadv of the whole of `iov` from `offset`, resuming after short reads
// (iov is advanced past what was read); 0 or an errno, EIO at an end of file.
int read_vec(int fd, std::vector<iovec>& iov, uint64_t offset, uint64_t* calls) {
  size_t at = 0;  // the first piece not read whole
  while (at < iov.size()) {
    ++*calls;
    const ssize_t got = ::preadv(fd, iov.data() + at, static_cast<int>(iov.size() - at),
                                 static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (got == 0) return EIO;
    offset += static_cast<uint64_t>(got);
    for (size_t left = static_cast<size_t>(got); left > 0;) {
      if (left >= iov[at].iov_len) {
        left -= iov[at].iov_len;
        ++at;
      } else {
        iov[at].iov_base = static_cast<uint8_t*>(iov[at].iov_base) + left;
        iov[at].iov_len -= left;
        left = 0;
      }
    }
  }
  return 0;
}

}  // namespace

struct DiskReader::Batch {
  struct Unit {
    size_t run;
    size_t part;  // the run's part (chunk) this unit reads; 0 without a chunk
  };
  int fd;
  const uint64_t* disk_offsets;
  size_t stride;
  uint8_t* dest;
  const uint64_t* dest_offsets;
  std::vector<size_t> runs;  // run r is slots [runs[r], runs[r + 1])
  std::vector<Unit> units;
  size_t next = 0;  // the next unit to hand out (under mu_)
  size_t done = 0;  // units ended (under mu_)
  std::vector<std::atomic<int>> errors;
  std::vector<std::atomic<size_t>> left;  // units of each slot not yet ended

  size_t first(size_t run) const { return runs[run]; }
  size_t count(size_t run) const { return runs[run + 1] - runs[run]; }
  uint8_t* to(size_t slot) const { return dest + dest_offsets[slot]; }
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

// A run straight into dest: one pread when its destinations follow each
// other, else one preadv; a failed read of several slots is read again slot
// by slot, so that only the slots the error is in fail.
void DiskReader::read_run(Batch& b, size_t run) {
  const size_t first = b.first(run), count = b.count(run);
  uint64_t calls = 0;
  std::vector<iovec> iov;
  for (size_t i = first; i < first + count; ++i) {
    if (!iov.empty() && static_cast<uint8_t*>(iov.back().iov_base) + iov.back().iov_len ==
                            b.to(i)) {
      iov.back().iov_len += b.stride;
    } else {
      iov.push_back({b.to(i), b.stride});
    }
  }
  int status;
  if (iov.size() == 1) {
    auto* to = b.to(first);
    status = transfer_all(
        [&](size_t at, size_t len, off_t off) { return ::pread(b.fd, to + at, len, off); },
        count * b.stride, b.disk_offsets[first], &calls);
  } else {
    status = read_vec(b.fd, iov, b.disk_offsets[first], &calls);
  }
  if (status != 0 && count == 1) {
    fail(b.errors[first], status);
  } else if (status != 0) {
    for (size_t i = first; i < first + count; ++i) {
      auto* to = b.to(i);
      const int one = transfer_all(
          [&](size_t at, size_t len, off_t off) { return ::pread(b.fd, to + at, len, off); },
          b.stride, b.disk_offsets[i], &calls);
      if (one != 0) fail(b.errors[i], one);
    }
  }
  reads_.fetch_add(calls, std::memory_order_relaxed);
}

// Part `part` of a run (chunk_ bytes of it, the last one shorter) through
// `via` and on into the slots it holds parts of; a failed read of parts of
// several slots is read again slot by slot.
void DiskReader::read_chunk(Batch& b, size_t run, size_t part, uint8_t* via) {
  const size_t first = b.first(run), stride = b.stride;
  const size_t from = part * chunk_;
  const size_t len = std::min(chunk_, b.count(run) * stride - from);
  const size_t lo = first + from / stride, hi = first + (from + len - 1) / stride;  // slots
  bool wanted = false;  // a slot that has not failed already
  for (size_t i = lo; i <= hi; ++i) wanted |= b.errors[i].load(std::memory_order_relaxed) == 0;
  if (!wanted) return;
  const uint64_t disk = b.disk_offsets[first];
  uint64_t calls = 0;
  const int status = transfer_all(
      [&](size_t at, size_t l, off_t off) { return ::pread(b.fd, via + at, l, off); }, len,
      disk + from, &calls);
  for (size_t i = lo; i <= hi; ++i) {
    // The bytes of slot i in this part: [begin, end) of the run.
    const size_t slot = (i - first) * stride;
    const size_t begin = std::max(from, slot), end = std::min(from + len, slot + stride);
    int one = status;
    if (status != 0 && lo != hi) {
      one = transfer_all(
          [&](size_t at, size_t l, off_t off) {
            return ::pread(b.fd, via + (begin - from) + at, l, off);
          },
          end - begin, disk + begin, &calls);
    }
    // On to the staging slot with non-temporal stores (stream_copy.h): the
    // staged bytes are read next by a learner, not by this thread. On a
    // small machine this copy slows the disk's transfers beside it, less so
    // streamed in chunks than as whole items (docs/performance.md,
    // perf/tier_bandwidth.py).
    if (one == 0) {
      stream_copy(b.to(i) + (begin - slot), via + (begin - from), end - begin, 0);
    } else {
      fail(b.errors[i], one);
    }
  }
  reads_.fetch_add(calls, std::memory_order_relaxed);
}

void DiskReader::work(size_t worker) {
  uint8_t* via = bounce_ == nullptr ? nullptr : bounce_ + worker * chunk_;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    ready_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and every queued batch handed out
    Batch* b = queue_.front();
    const Batch::Unit u = b->units[b->next++];
    if (b->next == b->units.size()) queue_.pop_front();
    lock.unlock();
    size_t lo = b->first(u.run), hi = lo + b->count(u.run) - 1;  // the slots it reads
    if (via == nullptr) {
      read_run(*b, u.run);
    } else {
      read_chunk(*b, u.run, u.part, via);
      const size_t from = u.part * chunk_;
      const size_t len = std::min(chunk_, b->count(u.run) * b->stride - from);
      hi = lo + (from + len - 1) / b->stride;
      lo += from / b->stride;
    }
    // A slot's last unit: every part of it is in dest (each unit's copy
    // ends with a store fence; acq_rel orders the other threads' parts).
    for (size_t i = lo; i <= hi; ++i) {
      if (b->left[i].fetch_sub(1, std::memory_order_acq_rel) == 1) {
        verify_slot(b->to(i), b->stride, b->errors[i]);
      }
    }
    lock.lock();
    if (++b->done == b->units.size()) finished_.notify_all();
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
  // Runs: each slot one stride past the one before it on disk. Straight
  // into dest, a run's destination pieces (where one slot's does not
  // follow the one before) are limited to what one preadv takes.
  b.runs.push_back(0);
  size_t pieces = 1;
  for (size_t i = 1; i < n; ++i) {
    const bool follows = disk_offsets[i] == disk_offsets[i - 1] + stride;
    const bool dest_follows = dest_offsets[i] == dest_offsets[i - 1] + stride;
    if (!follows || (chunk_ == 0 && !dest_follows && pieces == kMaxIov)) {
      b.runs.push_back(i);
      pieces = 1;
    } else if (!dest_follows) {
      ++pieces;
    }
  }
  b.runs.push_back(n);
  b.left = std::vector<std::atomic<size_t>>(n);
  for (size_t r = 0; r + 1 < b.runs.size(); ++r) {
    const size_t parts = chunk_ == 0 ? 1 : (b.count(r) * stride + chunk_ - 1) / chunk_;
    for (size_t p = 0; p < parts; ++p) b.units.push_back({r, p});
    for (size_t i = b.first(r); i < b.first(r) + b.count(r); ++i) {
      const size_t slot = (i - b.first(r)) * stride;
      b.left[i].store(chunk_ == 0 ? 1 : (slot + stride - 1) / chunk_ - slot / chunk_ + 1,
                      std::memory_order_relaxed);
    }
  }
  b.errors = std::vector<std::atomic<int>>(n);
  for (auto& e : b.errors) e.store(0, std::memory_order_relaxed);
  {
    std::unique_lock<std::mutex> lock(mu_);
    queue_.push_back(&b);
    ready_.notify_all();
    finished_.wait(lock, [&] { return b.done == b.units.size(); });
  }
  check_slots(dest, dest_offsets, keys, generations, n, b.errors.data(), statuses);
}

}  // namespace distore
