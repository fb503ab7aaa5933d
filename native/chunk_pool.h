// Bounce chunks: fixed-size buffers a run of items is copied through, handed
// out one at a time, at most `max_out` at once. The node's two active-message
// paths use it: the insert inbox receives writers' runs into chunks made on
// the heap as first needed (am_insert.h), the sample server packs runs into
// chunks of a registered region the caller gives, so that UCX sends from it
// with the region's own registration (am_sample.h).
//
// Ownership: a heap pool owns its chunks, and keeps every one it made until
// it goes; a pool over a region only cuts it up (the caller keeps the region
// alive and registered while a chunk may be in use). A chunk given back
// `tainted` (a receive left to UCX, which may still write it) is never handed
// out again; a heap pool makes another in its place. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

class ChunkPool {
 public:
  // Chunks of `chunk_bytes` made on the heap as needed, at most `max_out` out.
  ChunkPool(size_t chunk_bytes, size_t max_out)
      : chunk_bytes_(chunk_bytes), max_out_(max_out), heap_(true) {}
  // `count` chunks of `chunk_bytes` cut from `base` (count * chunk_bytes
  // bytes the caller holds), all of which may be out at once.
  ChunkPool(uint8_t* base, size_t chunk_bytes, size_t count)
      : chunk_bytes_(chunk_bytes), max_out_(count), heap_(false), made_(count) {
    free_.reserve(count);
    for (size_t k = count; k-- > 0;) free_.push_back(base + k * chunk_bytes);  // first on top
  }
  ChunkPool(const ChunkPool&) = delete;
  ChunkPool& operator=(const ChunkPool&) = delete;

  // A free chunk, or nullptr when max_out are out.
  uint8_t* take() {
    std::lock_guard<std::mutex> lock(mu_);
    if (out_ >= max_out_) return nullptr;
    if (free_.empty()) {
      if (!heap_) return nullptr;  // a region's chunks given back tainted
      owned_.emplace_back(new uint8_t[chunk_bytes_]);
      free_.push_back(owned_.back().get());
      ++made_;
    }
    uint8_t* chunk = free_.back();
    free_.pop_back();
    ++out_;
    return chunk;
  }

  // `chunk` (from take) is free again, or, `tainted`, never handed out again.
  void give(uint8_t* chunk, bool tainted = false) {
    std::lock_guard<std::mutex> lock(mu_);
    --out_;
    if (!tainted) free_.push_back(chunk);
  }

  size_t chunk_bytes() const { return chunk_bytes_; }

  // Chunks made so far: a heap pool's grow as needed (tainted ones count).
  size_t made() const {
    std::lock_guard<std::mutex> lock(mu_);
    return made_;
  }

 private:
  const size_t chunk_bytes_;
  const size_t max_out_;
  const bool heap_;  // makes (and owns) its chunks, or cuts a region
  mutable std::mutex mu_;
  size_t made_ = 0;
  size_t out_ = 0;
  std::vector<uint8_t*> free_;
  std::vector<std::unique_ptr<uint8_t[]>> owned_;  // a heap pool's chunks
};
