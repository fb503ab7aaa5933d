// Same-host reads: a storage node's arena mapped read-only in a learner,
// and the batched copy out of such mappings.
//
// Ownership: a MappedArena owns its mapping (munmap on destruction) but not
// the file descriptor it was made from (the caller closes it). A CopyPool
// owns its threads; idle, they sleep on a condition variable (after
// watching for the next batch for kLinger).
// Thread safety: a MappedArena's mapping is fixed; only its populated
// high-water mark moves (under a mutex). A CopyPool runs one batch at a
// time (run() is serialised by the caller: one learner thread uses it).
//
// Why the copy is safe against a node that rewrites a slot meanwhile: the
// node writes a slot seqlock style (an invalid header first, then the
// payload, then the real header, with release fences between; generations
// never repeat). The reader copies header + payload, then (after an acquire
// fence) reads the source header again; the item is good only if the
// header it copied equals the one it re-read, and the caller then checks
// that header against the (key, generation) it was given. A node that dies
// leaves its mapping readable (the pages belong to the memfd, not to the
// process), so a crash cannot fault the reader.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "layout.h"

namespace distore {

class MappedArena {
 public:
  // Maps `size` bytes of `fd` PROT_READ, MAP_SHARED, and its first
  // `populate` bytes' page tables at once (the node's high-water mark).
  // Throws UcxError if the mapping fails. `peer` names the node in errors.
  MappedArena(int fd, size_t size, std::string peer, size_t populate = 0);
  ~MappedArena();
  MappedArena(const MappedArena&) = delete;
  MappedArena& operator=(const MappedArena&) = delete;

  const uint8_t* base() const { return base_; }
  size_t size() const { return size_; }
  const std::string& peer() const { return peer_; }
  size_t populated() const { return populated_.load(); }
  // Maps the page tables of [0, end) (rounded up to 2 MiB) if not done yet,
  // in one system call; thread safe.
  void populate_to(size_t end) const;

 private:
  uint8_t* base_ = nullptr;
  size_t size_ = 0;
  std::string peer_;
  mutable std::mutex populate_mu_;
  mutable std::atomic<size_t> populated_{0};
};

class CopyPool {
 public:
  // A helper that finished a batch watches for the next one this long
  // (yielding the core meanwhile) before it sleeps on the condition
  // variable. A learner sampling back to back hands the pool a batch every
  // ~150 us (W1: 32 x 110 KB) with ~30 us of Python between two; a helper
  // woken from its sleep for each one (a futex wake-up takes tens of us on a
  // VM) came in late, and the caller copied most of the batch alone.
  static constexpr std::chrono::microseconds kLinger{100};

  // `helpers` threads besides the caller (0: everything on the caller).
  explicit CopyPool(unsigned helpers);
  ~CopyPool();
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  unsigned helpers() const { return static_cast<unsigned>(threads_.size()); }
  // Runs job(i) for every i in [0, parts) on the helpers and the caller;
  // returns when all are done. Safe to call from several threads at once:
  // one caller at a time has the helpers, a caller that finds them taken
  // runs its whole job on its own thread (it never waits for another's).
  void run(size_t parts, const std::function<void(size_t)>& job);

 private:
  void work();
  size_t drain(const std::function<void(size_t)>& job, size_t parts);

  std::mutex caller_;  // held by the caller that has the helpers
  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  const std::function<void(size_t)>* job_ = nullptr;
  size_t parts_ = 0;
  std::atomic<size_t> next_{0};
  size_t finished_ = 0;
  unsigned busy_ = 0;  // helpers inside the current batch
  // Batches posted; changed under mu_, read without it by lingering helpers.
  std::atomic<uint64_t> epoch_{0};
  bool stop_ = false;
};

// Copies n ranges, range i being len_of(i) bytes from src_of(i) to dst_of(i)
// (`total` bytes in all), with copy(dst, src, len): on the calling thread
// when there is no pool or `total` < `parallel_bytes`, else cut into pieces
// of at most 1 MiB (at least two per thread, so that a batch of a few large
// items still spreads over every thread) run on the pool. The one splitting
// rule of the mapped read path and the mapped insert path.
template <class SrcOf, class DstOf, class LenOf, class Copy>
void copy_ranges(CopyPool* pool, size_t n, size_t total, size_t parallel_bytes, SrcOf src_of,
                 DstOf dst_of, LenOf len_of, Copy copy) {
  if (pool == nullptr || pool->helpers() == 0 || total < parallel_bytes) {
    for (size_t i = 0; i < n; ++i) copy(dst_of(i), src_of(i), len_of(i));
    return;
  }
  constexpr size_t kPiece = size_t(1) << 20;  // unit of work handed to a copy thread
  const size_t threads = pool->helpers() + 1;
  const size_t piece = std::max<size_t>(64 << 10, std::min(kPiece, total / (threads * 2) + 1));
  struct Piece {
    const uint8_t* src;
    uint8_t* dst;
    size_t len;
  };
  std::vector<Piece> pieces;
  pieces.reserve(total / piece + n);
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* src = src_of(i);
    uint8_t* dst = dst_of(i);
    const size_t len = len_of(i);
    for (size_t at = 0; at < len; at += piece) {
      pieces.push_back({src + at, dst + at, std::min(piece, len - at)});
    }
  }
  pool->run(pieces.size(), [&](size_t k) { copy(pieces[k].dst, pieces[k].src, pieces[k].len); });
}

struct MappedItem {
  uint32_t arena_index;  // index into the arenas vector
  uint64_t offset;       // slot offset within the arena
  uint64_t length;       // header + payload bytes
  uint64_t dest_offset;  // where in dest
};

// Copies every item from its arena into dest (dest_size bytes), splitting
// the work over `pool` when the batch holds `parallel_bytes` or more; then
// re-reads each item's 16-byte header from the arena and writes 0 (good)
// or kStatusTorn into statuses. Validates every item before copying and
// throws UcxError if one is out of bounds. Call without the GIL.
void mapped_gather(const std::vector<const MappedArena*>& arenas, const MappedItem* items,
                   size_t n, uint8_t* dest, size_t dest_size, CopyPool* pool,
                   size_t parallel_bytes, int32_t* statuses);

// Bytes from which a sampled batch's mapped copy uses non-temporal stores:
// a quarter of the last-level cache, at least 1 MiB (mapped.cc says why).
size_t mapped_batch_stream_min();

// One sampled item as the control plane sends it (protocol.ITEM_LOCATION).
struct ItemLocation {
  uint32_t node;
  uint32_t pad;
  uint64_t offset;      // slot offset within the node's arena
  uint64_t generation;  // the slot header's second word
  uint64_t key;         // the slot header's first word
};
static_assert(sizeof(ItemLocation) == 32, "ItemLocation must match protocol.ITEM_LOCATION");

// A whole sampled batch, as the learner gets it: every item whose node has a
// mapping (map_lut[node] >= 0, an index into `arenas`) is read into row
// rows[i] of `layout` in dest: its slot header into the header array, each
// field into that field's dense array. Seqlock order per batch: every
// header is copied first, then (after an acquire fence) every payload, then
// (after another) every header is read again. statuses[i]: 0 (good),
// kStatusTorn (the header changed during the copy: the slot was
// rewritten), kStatusStale (the slot holds another item than the
// (key, generation) asked for), or kStatusNotMapped (the item's node is not
// mapped here: nothing was copied; the caller reads it another way).
// Validates every item first and throws UcxError if one is out of bounds.
// Call without the GIL.
void mapped_gather_located(const std::vector<const MappedArena*>& arenas,
                           const int64_t* map_lut, size_t lut_size, const ItemLocation* items,
                           size_t n, const uint64_t* rows, const BatchLayout& layout,
                           uint8_t* dest, size_t dest_size, CopyPool* pool,
                           size_t parallel_bytes, int32_t* statuses);

}  // namespace distore
