// Batched slot I/O against the tier file: see disk_io.h.
#include "disk_io.h"

#include <unistd.h>

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

}  // namespace

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
                     const uint64_t* generations, size_t n, size_t threads, int32_t* statuses) {
  fan_out(n, threads, [&](size_t i) {
    uint8_t* to = dest + dest_offsets[i];
    int status = transfer_all(
        [&](size_t at, size_t len, off_t off) { return ::pread(fd, to + at, len, off); }, stride,
        disk_offsets[i]);
    if (status == 0) {
      uint64_t header[2];
      std::memcpy(header, to, kHeader);
      if (header[0] != keys[i] || header[1] != generations[i]) status = kStatusStale;
    }
    if (status != 0) std::memset(to, 0, kHeader);
    statuses[i] = status;
  });
}

}  // namespace distore
