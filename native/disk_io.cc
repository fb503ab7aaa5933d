// Batched slot I/O against the tier file: see disk_io.h.
#include "disk_io.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "status.h"

namespace distore {

namespace {

constexpr size_t kHeader = 16;  // key, generation (spec.SLOT_HEADER)

// Runs work(i) for i in [0, n) over up to `threads` threads (the calling
// one included); items are handed out one at a time, so a slow transfer
// never holds back a queue behind it.
// work(i, worker): worker in [0, threads) names the thread (0: the caller).
template <typename F>
void fan_out(size_t n, size_t threads, F work) {
  std::atomic<size_t> next{0};
  auto loop = [&](size_t worker) {
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) work(i, worker);
  };
  const size_t extra = std::min(n, threads > 0 ? threads : 1) - (n > 0 ? 1 : 0);
  std::vector<std::thread> pool;
  pool.reserve(extra);
  for (size_t t = 0; t < extra; ++t) pool.emplace_back(loop, t + 1);
  loop(0);
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

}  // namespace

void disk_write_slots(int fd, const uint8_t* src, const uint64_t* src_offsets, size_t slot_size,
                      const uint64_t* disk_offsets, size_t stride, const uint64_t* keys,
                      const uint64_t* generations, size_t n, size_t threads, bool sync,
                      int32_t* statuses) {
  fan_out(n, threads, [&](size_t i, size_t) {
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

void disk_read_slots(int fd, const uint64_t* disk_offsets, size_t stride, uint8_t* dest,
                     const uint64_t* dest_offsets, const uint64_t* keys,
                     const uint64_t* generations, size_t n, size_t threads, int32_t* statuses,
                     uint8_t* bounce, size_t chunk) {
  // Work units: whole slots, or with a bounce buffer each slot's chunks, so
  // that a batch of a few large items still keeps `threads` reads in flight.
  const size_t pieces = bounce == nullptr ? 1 : (stride + chunk - 1) / chunk;
  std::vector<std::atomic<int>> errors(n);
  for (auto& e : errors) e.store(0, std::memory_order_relaxed);
  fan_out(n * pieces, threads, [&](size_t u, size_t worker) {
    const size_t i = u / pieces;
    if (errors[i].load(std::memory_order_relaxed) != 0) return;  // the slot failed already
    uint8_t* to = dest + dest_offsets[i];
    int status;
    if (bounce == nullptr) {
      status = transfer_all(
          [&](size_t at, size_t len, off_t off) { return ::pread(fd, to + at, len, off); },
          stride, disk_offsets[i]);
    } else {  // this chunk through this thread's part of the contiguous buffer
      uint8_t* via = bounce + worker * chunk;
      const size_t done = (u % pieces) * chunk;
      const size_t len = std::min(chunk, stride - done);
      status = transfer_all(
          [&](size_t at, size_t l, off_t off) { return ::pread(fd, via + at, l, off); }, len,
          disk_offsets[i] + done);
      if (status == 0) std::memcpy(to + done, via, len);
    }
    if (status != 0) {
      int none = 0;
      errors[i].compare_exchange_strong(none, status);
    }
  });
  for (size_t i = 0; i < n; ++i) {  // every unit has ended: check the headers
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

}  // namespace distore
