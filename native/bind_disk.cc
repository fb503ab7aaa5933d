// Bindings: batched slot I/O of the disk tier (disk_io.h).
#include "bindings.h"

#include <nanobind/stl/optional.h>

#include <algorithm>
#include <optional>

#include "disk_io.h"
#include "memory.h"

namespace distore {

namespace {

void check_batch(size_t n, std::initializer_list<size_t> lengths, const char* what) {
  for (size_t len : lengths) {
    if (len != n) {
      throw UcxError(kStatusBadArgument, std::string(what) + ": every array of the batch must "
                                                             "have one entry per slot");
    }
  }
}

// Slots of the arena `region` written to the tier file `fd`.
StatusArray disk_write_py(int fd, const MemoryRegion& region, Vec<uint64_t> src_offsets,
                          size_t slot_size, Vec<uint64_t> disk_offsets, size_t stride,
                          Vec<uint64_t> keys, Vec<uint64_t> generations, size_t threads,
                          bool sync) {
  const size_t n = src_offsets.shape(0);
  check_batch(n, {disk_offsets.shape(0), keys.shape(0), generations.shape(0)}, "disk_write");
  if (stride < slot_size || stride % kDiskAlign != 0) {
    throw UcxError(kStatusBadArgument, "disk_write: the stride must be the slot size rounded "
                                       "up to 4096 bytes");
  }
  for (size_t i = 0; i < n; ++i) {
    if (src_offsets(i) > region.size() || region.size() - src_offsets(i) < slot_size ||
        disk_offsets(i) % kDiskAlign != 0) {
      throw UcxError(kStatusOutOfBounds, "disk_write: slot " + std::to_string(i) +
                                             " lies outside the arena or is misaligned on disk");
    }
  }
  auto [array, statuses] = new_statuses(n);
  {
    nb::gil_scoped_release release;
    disk_write_slots(fd, reinterpret_cast<const uint8_t*>(region.address()), src_offsets.data(),
                     slot_size, disk_offsets.data(), stride, keys.data(), generations.data(), n,
                     threads, sync, statuses);
  }
  return array;
}

// Slots of the tier file `fd` read into the arena `region` (its writable alias).
using Bytes = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

StatusArray disk_read_py(int fd, Vec<uint64_t> disk_offsets, size_t stride, MemoryRegion& region,
                         Vec<uint64_t> dest_offsets, Vec<uint64_t> keys,
                         Vec<uint64_t> generations, size_t threads, std::optional<Bytes> bounce,
                         size_t chunk) {
  const size_t n = disk_offsets.shape(0);
  check_batch(n, {dest_offsets.shape(0), keys.shape(0), generations.shape(0)}, "disk_read");
  if (stride % kDiskAlign != 0 || region.local_address() % kDiskAlign != 0) {
    throw UcxError(kStatusBadArgument, "disk_read: stride and arena must be 4096-aligned");
  }
  uint8_t* via = nullptr;
  if (bounce.has_value()) {
    via = bounce->data();
    const size_t workers = std::max<size_t>(1, threads);
    if (chunk == 0 || chunk % kDiskAlign != 0 ||
        reinterpret_cast<uintptr_t>(via) % kDiskAlign != 0 ||
        bounce->shape(0) / workers < chunk) {
      throw UcxError(kStatusBadArgument, "disk_read: the bounce buffer must be 4096-aligned "
                                         "and hold threads x chunk bytes, chunk a positive "
                                         "multiple of 4096");
    }
  }
  for (size_t i = 0; i < n; ++i) {
    if (dest_offsets(i) % kDiskAlign != 0 || disk_offsets(i) % kDiskAlign != 0 ||
        dest_offsets(i) > region.size() || region.size() - dest_offsets(i) < stride) {
      throw UcxError(kStatusOutOfBounds, "disk_read: slot " + std::to_string(i) +
                                             " lies outside the arena or is misaligned");
    }
  }
  auto [array, statuses] = new_statuses(n);
  {
    nb::gil_scoped_release release;
    disk_read_slots(fd, disk_offsets.data(), stride,
                    reinterpret_cast<uint8_t*>(region.local_address()), dest_offsets.data(),
                    keys.data(), generations.data(), n, threads, statuses, via, chunk);
  }
  return array;
}

// Plain O_DIRECT reads of the same shape into `scratch` (4096-aligned,
// n x stride bytes, reused across calls as a learner's ring is): the disk's
// own bandwidth, the baseline of perf/tier_bandwidth.py.
StatusArray disk_read_raw_py(int fd, Vec<uint64_t> disk_offsets, size_t stride, size_t threads,
                             nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>
                                 scratch) {
  const size_t n = disk_offsets.shape(0);
  auto* base = scratch.data();
  if (stride % kDiskAlign != 0 || reinterpret_cast<uintptr_t>(base) % kDiskAlign != 0 ||
      scratch.shape(0) < n * stride) {
    throw UcxError(kStatusBadArgument, "disk_read_raw: stride and scratch must be 4096-aligned "
                                       "and the scratch n x stride bytes");
  }
  std::vector<uint64_t> dest(n), none(n, 0);
  for (size_t i = 0; i < n; ++i) dest[i] = i * stride;
  auto [array, statuses] = new_statuses(n);
  {
    nb::gil_scoped_release release;
    // keys/generations of 0: the header check fails by design; only I/O errors count.
    disk_read_slots(fd, disk_offsets.data(), stride, base, dest.data(), none.data(),
                    none.data(), n, threads, statuses);
  }
  for (size_t i = 0; i < n; ++i) {
    if (statuses[i] == kStatusStale) statuses[i] = 0;
  }
  return array;
}

}  // namespace

void bind_disk(nb::module_& m) {
  m.def("disk_write", &disk_write_py, "fd"_a, "region"_a, "src_offsets"_a, "slot_size"_a,
        "disk_offsets"_a, "stride"_a, "keys"_a, "generations"_a, "threads"_a, "sync"_a,
        "Write arena slots to the tier file with new headers (GIL released); per-slot "
        "statuses (0 or an errno).");
  m.def("disk_read", &disk_read_py, "fd"_a, "disk_offsets"_a, "stride"_a, "region"_a,
        "dest_offsets"_a, "keys"_a, "generations"_a, "threads"_a, "bounce"_a = nb::none(),
        "chunk"_a = 0,
        "Read tier-file slots into the arena and check their headers (GIL released); "
        "per-slot statuses (0, an errno, or STATUS_STALE). With `bounce` (threads x chunk "
        "bytes, 4096-aligned) each thread reads through its own chunk of it.");
  m.def("disk_read_raw", &disk_read_raw_py, "fd"_a, "disk_offsets"_a, "stride"_a, "threads"_a,
        "scratch"_a,
        "O_DIRECT reads of the same shape into scratch memory (the disk's own bandwidth).");
}

}  // namespace distore
