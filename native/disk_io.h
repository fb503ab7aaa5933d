// Batched slot I/O against a storage node's tier file (the disk tier).
//
// The tier file is opened by the caller with O_DIRECT; these functions
// only move whole slots. Each call issues its n transfers from a small
// pool of threads (positional reads/writes, several in flight at once, so
// the device sees a queue, never one blocking read per item) and returns
// per-item statuses: 0, an errno value, or kStatusStale when a slot read
// back does not hold the (key, generation) asked for.
//
// Ownership: nothing is kept between calls; threads are joined before
// return. Thread safety: calls may run concurrently on disjoint slots.
#pragma once

#include <cstddef>
#include <cstdint>

namespace distore {

// Alignment of every O_DIRECT buffer, offset and length: 4 KiB covers the
// logical block size of every disk we expect (512 B or 4 KiB).
constexpr size_t kDiskAlign = 4096;

// Copies slot i (slot_size bytes at src + src_offsets[i]) into an aligned
// buffer, sets its header to (keys[i], generations[i]), and writes `stride`
// bytes (slot_size rounded up to kDiskAlign) at disk_offsets[i]. Then
// fdatasync when `sync`.
void disk_write_slots(int fd, const uint8_t* src, const uint64_t* src_offsets, size_t slot_size,
                      const uint64_t* disk_offsets, size_t stride, const uint64_t* keys,
                      const uint64_t* generations, size_t n, size_t threads, bool sync,
                      int32_t* statuses);

// Reads `stride` bytes at disk_offsets[i] straight into dest + dest_offsets[i]
// (dest and dest_offsets aligned to kDiskAlign, the space `stride` long) and
// checks the header against (keys[i], generations[i]). A failed slot gets
// its header zeroed, so no reader can take it for the item.
// With `bounce` (threads x `chunk` bytes, chunk a multiple of kDiskAlign),
// each thread reads `chunk` bytes at a time into its own part of it and
// copies them to dest: for a dest of scattered 4 KiB pages, which a disk
// splits into many small requests, and a bounce of hugepages, which it
// does not (storage/tier.py says when).
void disk_read_slots(int fd, const uint64_t* disk_offsets, size_t stride, uint8_t* dest,
                     const uint64_t* dest_offsets, const uint64_t* keys,
                     const uint64_t* generations, size_t n, size_t threads, int32_t* statuses,
                     uint8_t* bounce = nullptr, size_t chunk = 0);

}  // namespace distore
