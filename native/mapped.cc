#include "mapped.h"

#include <sched.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#include "status.h"
#include "stream_copy.h"

namespace distore {

namespace {
constexpr size_t kHeader = 16;       // key, generation (spec.SLOT_HEADER)
constexpr size_t kPopulateStep = size_t(2) << 20;
constexpr int kMadvPopulateRead = 22;  // MADV_POPULATE_READ (Linux 5.14), not in older headers
constexpr size_t kStreamMin = size_t(1) << 20;  // non-temporal stores from here up
// Ring slots are read later by the consumer: copies of kStreamMin bytes
// and more stream past the cache (stream_copy.h; glibc's memcpy streams only
// copies larger than most of the last-level cache).
void copy(uint8_t* dst, const uint8_t* src, size_t len) { stream_copy(dst, src, len, kStreamMin); }
// A sampled batch of mapped_batch_stream_min() bytes or more streams every
// piece of at least kStreamPiece bytes, however small its items: what a
// batch evicts from the cache is its total, not its largest item.
constexpr size_t kStreamPiece = size_t(4) << 10;
void copy_batch(uint8_t* dst, const uint8_t* src, size_t len) {
  stream_copy(dst, src, len, kStreamPiece);
}
void copy_plain(uint8_t* dst, const uint8_t* src, size_t len) { std::memcpy(dst, src, len); }

// The last-level cache this process's first CPU shares, in bytes, as sysfs
// says (the size a core reaches: sysconf reports a whole socket's on some
// AMD parts); 0 when it does not say.
size_t last_level_cache() {
  size_t best = 0;
  for (int index = 0; index < 8; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index);
    std::ifstream level_file(dir + "/level"), size_file(dir + "/size");
    int level = 0;
    std::string size;
    if (!(level_file >> level) || !(size_file >> size) || level < 2) continue;
    char* end = nullptr;
    const unsigned long long n = std::strtoull(size.c_str(), &end, 10);
    const size_t bytes = size_t(n) * (*end == 'K' ? 1024 : *end == 'M' ? 1 << 20 : 1);
    best = std::max(best, bytes);
  }
  return best;
}

}  // namespace

// A learner's ring (prefetch + 1 batches) that fits in the last-level cache
// keeps its lines there between uses: plain stores then hit the cache, and
// streaming them to memory only costs (W1, 32 x 110 KB, on a 32 MiB L3:
// 17 GB/s streamed, 23 plain). A ring larger than the cache finds its lines
// gone, and a plain store first reads each for ownership (W2, 8 x 3 MB: 24
// GB/s streamed, 17 plain). So a batch streams from a quarter of the cache
// up, and from kStreamMin where the cache's size is unknown.
size_t mapped_batch_stream_min() {
  static const size_t threshold = std::max(kStreamMin, last_level_cache() / 4);
  return threshold;
}

MappedArena::MappedArena(int fd, size_t size, std::string peer, size_t populate)
    : size_(size), peer_(std::move(peer)) {
  if (size == 0) throw UcxError(kStatusBadArgument, "cannot map an empty arena", peer_);
  void* p = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    throw UcxError(UCS_ERR_NO_MEMORY,
                   "mapping the node's arena read-only failed: " + std::string(std::strerror(errno)),
                   peer_);
  }
  base_ = static_cast<uint8_t*>(p);
  populate_to(populate);
}

void MappedArena::populate_to(size_t end) const {
  if (end <= populated_.load(std::memory_order_acquire)) return;
  std::lock_guard<std::mutex> lock(populate_mu_);
  const size_t from = populated_.load(std::memory_order_relaxed);
  const size_t to = std::min(size_, (end + kPopulateStep - 1) / kPopulateStep * kPopulateStep);
  if (to <= from) return;
  // One system call maps every page of the range (pages the node wrote
  // exist; the few past its high-water mark get allocated, as the node would
  // on its next insert). Without it each first touch is a page fault per
  // 4 KiB page, which slows a fresh learner's copies.
  if (madvise(base_ + from, to - from, kMadvPopulateRead) != 0) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    volatile uint8_t sink = 0;
    for (size_t at = from; at < to; at += page) sink = sink + base_[at];  // kernels < 5.14
    (void)sink;
  }
  populated_.store(to, std::memory_order_release);
}

MappedArena::~MappedArena() {
  if (base_ != nullptr) munmap(base_, size_);
}

CopyPool::CopyPool(unsigned helpers) {
  threads_.reserve(helpers);
  for (unsigned i = 0; i < helpers; ++i) threads_.emplace_back([this] { work(); });
}

CopyPool::~CopyPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

size_t CopyPool::drain(const std::function<void(size_t)>& job, size_t parts) {
  size_t done = 0;
  for (size_t i = next_.fetch_add(1); i < parts; i = next_.fetch_add(1)) {
    job(i);
    ++done;
  }
  return done;
}

void CopyPool::work() {
  uint64_t seen = 0;
  while (true) {
    if (seen != 0) {
      // Watch for the next batch a while before sleeping, yielding the core
      // to any thread that wants it (mapped.h, kLinger).
      const auto until = std::chrono::steady_clock::now() + kLinger;
      while (epoch_.load(std::memory_order_acquire) == seen &&
             std::chrono::steady_clock::now() < until) {
        sched_yield();
      }
    }
    const std::function<void(size_t)>* job;
    size_t parts;
    {
      std::unique_lock<std::mutex> lock(mu_);
      wake_.wait(lock, [&] { return stop_ || epoch_ != seen; });
      if (stop_) return;
      seen = epoch_;
      if (job_ == nullptr) continue;  // woke after that batch was done
      job = job_;
      parts = parts_;
      ++busy_;
    }
    const size_t done = drain(*job, parts);
    {
      std::lock_guard<std::mutex> lock(mu_);
      finished_ += done;
      --busy_;
    }
    done_.notify_all();
  }
}

void CopyPool::run(size_t parts, const std::function<void(size_t)>& job) {
  if (parts == 0) return;
  std::unique_lock<std::mutex> caller(caller_, std::try_to_lock);
  if (threads_.empty() || parts == 1 || !caller.owns_lock()) {
    // No helpers, nothing to share, or another thread's batch has them (a
    // node pulls on its event loop and on a worker thread at once): the
    // job/parts/finished state below is one batch's, so run it all here.
    for (size_t i = 0; i < parts; ++i) job(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &job;
    parts_ = parts;
    finished_ = 0;
    next_.store(0);
    epoch_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  const size_t done = drain(job, parts);
  std::unique_lock<std::mutex> lock(mu_);
  finished_ += done;
  // Every part done and no helper still inside this batch: then no helper
  // can touch `job` (a late waker sees job_ == nullptr).
  done_.wait(lock, [&] { return finished_ == parts_ && busy_ == 0; });
  job_ = nullptr;
}

void mapped_gather(const std::vector<const MappedArena*>& arenas, const MappedItem* items,
                   size_t n, uint8_t* dest, size_t dest_size, CopyPool* pool,
                   size_t parallel_bytes, int32_t* statuses) {
  size_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    const MappedItem& it = items[i];
    if (it.arena_index >= arenas.size() || arenas[it.arena_index] == nullptr) {
      throw UcxError(kStatusBadArgument, "item " + std::to_string(i) + ": arena index " +
                                             std::to_string(it.arena_index) + " out of range");
    }
    const MappedArena& a = *arenas[it.arena_index];
    if (it.length < kHeader || it.length > a.size() || it.offset > a.size() - it.length) {
      throw UcxError(kStatusOutOfBounds,
                     "item " + std::to_string(i) + ": slot range [" + std::to_string(it.offset) +
                         ", +" + std::to_string(it.length) + ") lies outside the mapped arena",
                     a.peer());
    }
    if (it.length > dest_size || it.dest_offset > dest_size - it.length) {
      throw UcxError(kStatusOutOfBounds, "item " + std::to_string(i) +
                                             ": destination range exceeds the local buffer (" +
                                             std::to_string(dest_size) + " bytes)");
    }
    total += it.length;
  }
  // Map the pages this batch touches that are not mapped yet (arenas grow
  // from offset 0 up, so a high-water mark per arena is enough).
  std::vector<size_t> reach(arenas.size(), 0);
  for (size_t i = 0; i < n; ++i) {
    const MappedItem& it = items[i];
    reach[it.arena_index] = std::max<size_t>(reach[it.arena_index], it.offset + it.length);
  }
  for (size_t a = 0; a < arenas.size(); ++a) {
    if (reach[a] != 0) arenas[a]->populate_to(reach[a]);
  }

  copy_ranges(
      pool, n, total, parallel_bytes,
      [&](size_t i) { return arenas[items[i].arena_index]->base() + items[i].offset; },
      [&](size_t i) { return dest + items[i].dest_offset; },
      [&](size_t i) { return items[i].length; }, copy);

  // Seqlock check: every payload byte was loaded before the header is read
  // again; a header that changed means the slot was rewritten meanwhile.
  std::atomic_thread_fence(std::memory_order_acquire);
  for (size_t i = 0; i < n; ++i) {
    const MappedItem& it = items[i];
    const uint8_t* src = arenas[it.arena_index]->base() + it.offset;
    uint64_t now[2], copied[2];
    now[0] = __atomic_load_n(reinterpret_cast<const uint64_t*>(src), __ATOMIC_RELAXED);
    now[1] = __atomic_load_n(reinterpret_cast<const uint64_t*>(src + 8), __ATOMIC_RELAXED);
    std::memcpy(copied, dest + it.dest_offset, kHeader);
    statuses[i] = (now[0] == copied[0] && now[1] == copied[1]) ? 0 : kStatusTorn;
  }
}

void mapped_gather_located(const std::vector<const MappedArena*>& arenas,
                           const int64_t* map_lut, size_t lut_size, const ItemLocation* items,
                           size_t n, const uint64_t* rows, const BatchLayout& layout,
                           uint8_t* dest, size_t dest_size, CopyPool* pool,
                           size_t parallel_bytes, int32_t* statuses) {
  layout.check(rows, n, dest_size);
  struct Mapped {
    const uint8_t* src;  // the slot in its arena
    size_t item;         // index into items / rows / statuses
  };
  std::vector<Mapped> mapped;
  mapped.reserve(n);
  std::vector<size_t> reach(arenas.size(), 0);
  const uint64_t read = layout.read_length();
  for (size_t i = 0; i < n; ++i) {
    const uint32_t node = items[i].node;
    const int64_t index = node < lut_size ? map_lut[node] : -1;
    if (index < 0 || static_cast<size_t>(index) >= arenas.size() || arenas[index] == nullptr) {
      statuses[i] = kStatusNotMapped;
      continue;
    }
    const MappedArena& a = *arenas[index];
    if (read > a.size() || items[i].offset > a.size() - read) {
      throw UcxError(kStatusOutOfBounds,
                     "item " + std::to_string(i) + ": slot range [" +
                         std::to_string(items[i].offset) + ", +" + std::to_string(read) +
                         ") lies outside the mapped arena",
                     a.peer());
    }
    mapped.push_back(Mapped{a.base() + items[i].offset, i});
    reach[index] = std::max<size_t>(reach[index], items[i].offset + read);
  }
  // Map the pages this batch touches that are not mapped yet (arenas grow
  // from offset 0 up, so a high-water mark per arena is enough).
  for (size_t a = 0; a < arenas.size(); ++a) {
    if (reach[a] != 0) arenas[a]->populate_to(reach[a]);
  }

  // Seqlock, first read: every header, before any payload byte.
  for (const Mapped& m : mapped) {
    uint64_t* to = reinterpret_cast<uint64_t*>(dest + layout.header_at(rows[m.item]));
    to[0] = __atomic_load_n(reinterpret_cast<const uint64_t*>(m.src), __ATOMIC_RELAXED);
    to[1] = __atomic_load_n(reinterpret_cast<const uint64_t*>(m.src + 8), __ATOMIC_RELAXED);
  }
  std::atomic_thread_fence(std::memory_order_acquire);

  // Payloads: item by item, each field to its row of that field's array.
  const auto& fields = layout.fields();
  const size_t per = fields.size();
  size_t total = 0;
  for (const auto& f : fields) total += f.length;
  total *= mapped.size();
  copy_ranges(
      pool, mapped.size() * per, total, parallel_bytes,
      [&](size_t j) { return mapped[j / per].src + fields[j % per].src; },
      [&](size_t j) { return dest + layout.field_at(j % per, rows[mapped[j / per].item]); },
      [&](size_t j) { return fields[j % per].length; },
      total >= mapped_batch_stream_min() ? copy_batch : copy_plain);

  // Seqlock, second read: every payload byte was loaded before the header is
  // read again; a header that changed means the slot was rewritten meanwhile.
  std::atomic_thread_fence(std::memory_order_acquire);
  for (const Mapped& m : mapped) {
    const size_t i = m.item;
    uint64_t now[2], copied[2];
    now[0] = __atomic_load_n(reinterpret_cast<const uint64_t*>(m.src), __ATOMIC_RELAXED);
    now[1] = __atomic_load_n(reinterpret_cast<const uint64_t*>(m.src + 8), __ATOMIC_RELAXED);
    std::memcpy(copied, dest + layout.header_at(rows[i]), kHeader);
    if (now[0] != copied[0] || now[1] != copied[1]) {
      statuses[i] = kStatusTorn;
    } else {
      statuses[i] = copied[0] == items[i].key && copied[1] == items[i].generation ? 0
                                                                                  : kStatusStale;
    }
  }
}

}  // namespace distore
