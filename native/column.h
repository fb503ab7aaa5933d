// A growable array of trivially copyable values in its own anonymous
// mapping: new elements are zero, pages cost memory only once written (a
// column sized past what is used costs nothing for the rest), and growing
// is an mremap, not a copy (no transient second copy, no 2x peak).
// Columns of 2 MiB or more ask for transparent huge pages (fewer TLB misses
// on the random reads of a large table).
//
// Ownership: owns its mapping. Thread safety: none (one caller thread).
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

namespace distore {

template <typename T>
class Column {
  static_assert(std::is_trivially_copyable_v<T>, "Column holds plain values");

 public:
  Column() = default;
  explicit Column(size_t n) { grow_to(n); }
  ~Column() { unmap(); }
  Column(const Column&) = delete;
  Column& operator=(const Column&) = delete;
  Column(Column&& o) noexcept { swap(o); }
  Column& operator=(Column&& o) noexcept {
    Column tmp(std::move(o));
    swap(tmp);
    return *this;
  }
  void swap(Column& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(size_, o.size_);
  }

  size_t size() const { return size_; }
  T* data() { return data_; }
  const T* data() const { return data_; }
  T& operator[](size_t i) { return data_[i]; }
  const T& operator[](size_t i) const { return data_[i]; }

  // Makes size() at least n: doubles (the untouched part costs nothing),
  // keeps the values, new elements zero.
  void grow(size_t n) {
    if (n <= size_) return;
    grow_to(n < 2 * size_ ? 2 * size_ : n);
  }
  // Exactly n elements (n >= size()).
  void grow_to(size_t n) {
    if (n <= size_) return;
    const size_t old_bytes = mapped_bytes(size_);
    const size_t bytes = mapped_bytes(n);
    void* p;
    if (data_ == nullptr) {
      p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
               -1, 0);
    } else if (bytes == old_bytes) {
      p = data_;
    } else {
      p = mremap(data_, old_bytes, bytes, MREMAP_MAYMOVE);
    }
    if (p == MAP_FAILED) throw std::bad_alloc();
    if (bytes >= (2u << 20)) madvise(p, bytes, MADV_HUGEPAGE);  // advice: failure is harmless
    data_ = static_cast<T*>(p);
    size_ = n;
  }

  // Bytes of this column in memory now (pages written at least once).
  size_t resident_bytes() const {
    if (data_ == nullptr) return 0;
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t bytes = mapped_bytes(size_);
    std::vector<unsigned char> vec((bytes + page - 1) / page);
    if (mincore(data_, bytes, vec.data()) != 0) return bytes;
    size_t pages = 0;
    for (unsigned char v : vec) pages += v & 1;
    return pages * page;
  }

 private:
  static size_t mapped_bytes(size_t n) {
    if (n == 0) return 0;
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    return (n * sizeof(T) + page - 1) / page * page;
  }
  void unmap() {
    if (data_ != nullptr) munmap(data_, mapped_bytes(size_));
    data_ = nullptr;
    size_ = 0;
  }

  T* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace distore
