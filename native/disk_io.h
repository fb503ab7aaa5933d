// Batched slot I/O against a storage node's tier file (the disk tier).
//
// The tier file is opened by the caller with O_DIRECT; these functions
// only move whole slots. Each call issues its n transfers from a small
// pool of threads (positional reads/writes, several in flight at once, so
// the device sees a queue, never one blocking read per item) and returns
// per-item statuses: 0, an errno value, kStatusStale when a slot read back
// does not hold the (key, generation) asked for, or kStatusCorrupt when its
// bytes fail their checksum.
//
// A slot on disk is `stride` bytes (the slot size plus kDiskTrailer, rounded
// up to kDiskAlign): the slot, zeros, and a trailer of CRC-32C of every byte
// before it and that CRC inverted, written with the slot and checked on
// every read, so a flipped bit anywhere in a slot is never handed out.
//
// Ownership: the functions keep nothing between calls (threads are joined
// before return); DiskReader keeps its threads. Thread safety: calls may run
// concurrently on disjoint slots.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace distore {

// Alignment of every O_DIRECT buffer, offset and length: 4 KiB covers the
// logical block size of every disk we expect (512 B or 4 KiB).
constexpr size_t kDiskAlign = 4096;
// The last bytes of a disk slot: CRC-32C of the rest, then its complement (an
// all-zero trailer, never written, never verifies).
constexpr size_t kDiskTrailer = 8;

// Whether the `stride` bytes at `slot` carry a trailer that matches them.
bool disk_slot_sealed(const uint8_t* slot, size_t stride);

// Copies slot i (slot_size bytes at src + src_offsets[i]) into an aligned
// buffer, sets its header to (keys[i], generations[i]), seals it with its
// trailer, and writes `stride` bytes (slot_size + kDiskTrailer rounded up to
// kDiskAlign) at disk_offsets[i]. Then fdatasync when `sync`.
void disk_write_slots(int fd, const uint8_t* src, const uint64_t* src_offsets, size_t slot_size,
                      const uint64_t* disk_offsets, size_t stride, const uint64_t* keys,
                      const uint64_t* generations, size_t n, size_t threads, bool sync,
                      int32_t* statuses);

// Reads `stride` bytes at disk_offsets[i] straight into dest + dest_offsets[i]
// (dest and dest_offsets aligned to kDiskAlign, the space `stride` long) and
// checks the header against (keys[i], generations[i]) and, when `verify`,
// the trailer against the bytes. A failed slot gets its header zeroed, so
// no reader can take it for the item. Threads are made for the call: the
// perf baseline's reader (a node reads with DiskReader).
void disk_read_slots(int fd, const uint64_t* disk_offsets, size_t stride, uint8_t* dest,
                     const uint64_t* dest_offsets, const uint64_t* keys,
                     const uint64_t* generations, size_t n, size_t threads, bool verify,
                     int32_t* statuses);

// A storage node's cold reads: `threads` threads kept for the node's life
// and one first-in, first-out queue of work units. read() queues its batch
// behind the batches of earlier calls (from any thread) and returns when
// its own units are done, so the disk always has the next batch's reads
// queued while the last reads of the current one complete, and each batch
// completes at the disk's full speed instead of two completing together.
//
// Runs: slots that follow each other in the batch and on disk (each one
// `stride` past the one before, as a cold slice's steps are) are read
// together. With chunk 0 a run is one unit, read straight into dest: one
// pread when the run's destinations follow each other too, else one preadv
// (at most IOV_MAX destination pieces a run). With `chunk` > 0 each thread
// reads through its own `chunk` bytes of hugepage-backed memory (made here,
// 2 MiB aligned) and copies to dest, a run in ceil(run bytes / chunk) units:
// for a dest of scattered 4 KiB pages, which a disk splits into many small
// requests (storage/tier.py says when). Every slot of a run is still checked
// alone (header, trailer); a read of several slots that fails is read again
// slot by slot, so an I/O error fails only the slots it is in.
//
// Ownership: the threads and the bounce memory, released by the destructor,
// which first lets every queued batch finish. Thread safety: read() may be
// called from several threads at once on disjoint destinations.
class DiskReader {
 public:
  DiskReader(size_t threads, size_t chunk);
  ~DiskReader();
  DiskReader(const DiskReader&) = delete;
  DiskReader& operator=(const DiskReader&) = delete;

  // As disk_read_slots with `verify`, through the queue (statuses: 0, an
  // errno, kStatusStale or kStatusCorrupt). A slot's trailer is checked by
  // the thread that ends its last unit, so checks run on every thread.
  void read(int fd, const uint64_t* disk_offsets, size_t stride, uint8_t* dest,
            const uint64_t* dest_offsets, const uint64_t* keys, const uint64_t* generations,
            size_t n, int32_t* statuses);

  size_t threads() const { return pool_.size(); }
  size_t chunk() const { return chunk_; }
  // Read calls (pread/preadv) issued so far, all batches together: one per
  // run or per chunk of a run, more after short reads or failed runs.
  uint64_t reads() const { return reads_.load(std::memory_order_relaxed); }

 private:
  struct Batch;
  void work(size_t worker);
  void read_run(Batch& b, size_t run);
  void read_chunk(Batch& b, size_t run, size_t part, uint8_t* via);

  size_t chunk_;
  uint8_t* bounce_ = nullptr;  // threads x chunk_ bytes, 2 MiB aligned, inside map_
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  std::mutex mu_;
  std::condition_variable ready_;     // work queued, or stopping
  std::condition_variable finished_;  // a batch's last unit is done
  std::deque<Batch*> queue_;          // batches with units not yet handed out
  bool stopping_ = false;
  std::vector<std::thread> pool_;
  std::atomic<uint64_t> reads_{0};
};

}  // namespace distore
