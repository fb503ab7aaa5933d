// Bindings: batched slot I/O of the disk tier (disk_io.h).
#include "bindings.h"

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
  if (stride < slot_size + kDiskTrailer || stride % kDiskAlign != 0) {
    throw UcxError(kStatusBadArgument, "disk_write: the stride must be the slot size plus "
                                       "its 8-byte trailer, rounded up to 4096 bytes");
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

// Slots of the tier file `fd` read into the arena `region` (its writable
// alias) through the node's queue `reader`.
StatusArray disk_reader_read(DiskReader& reader, int fd, Vec<uint64_t> disk_offsets,
                             size_t stride, MemoryRegion& region, Vec<uint64_t> dest_offsets,
                             Vec<uint64_t> keys, Vec<uint64_t> generations) {
  const size_t n = disk_offsets.shape(0);
  check_batch(n, {dest_offsets.shape(0), keys.shape(0), generations.shape(0)}, "disk read");
  if (stride == 0 || stride % kDiskAlign != 0 || region.local_address() % kDiskAlign != 0) {
    throw UcxError(kStatusBadArgument, "disk read: stride and arena must be 4096-aligned");
  }
  for (size_t i = 0; i < n; ++i) {
    if (dest_offsets(i) % kDiskAlign != 0 || disk_offsets(i) % kDiskAlign != 0 ||
        dest_offsets(i) > region.size() || region.size() - dest_offsets(i) < stride) {
      throw UcxError(kStatusOutOfBounds, "disk read: slot " + std::to_string(i) +
                                             " lies outside the arena or is misaligned");
    }
  }
  auto [array, statuses] = new_statuses(n);
  {
    nb::gil_scoped_release release;
    reader.read(fd, disk_offsets.data(), stride,
                reinterpret_cast<uint8_t*>(region.local_address()), dest_offsets.data(),
                keys.data(), generations.data(), n, statuses);
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
                    none.data(), n, threads, false, statuses);
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
        "Write arena slots to the tier file with new headers and a checksum trailer (GIL "
        "released); per-slot statuses (0 or an errno).");
  nb::class_<DiskReader>(m, "DiskReader",
                         "A node's cold-read queue: threads kept for its life, batches of "
                         "all callers served first in, first out (disk_io.h).")
      .def(nb::init<size_t, size_t>(), "threads"_a, "chunk"_a,
           "`threads` reading threads; with `chunk` > 0 (a multiple of 4096) each reads "
           "through its own `chunk` bytes of hugepage-backed memory.")
      .def_prop_ro("threads", &DiskReader::threads, "Reading threads.")
      .def_prop_ro("chunk", &DiskReader::chunk, "Bounce bytes per thread (0: straight in).")
      .def_prop_ro("reads", &DiskReader::reads,
                   "Read calls (pread/preadv) issued so far: one per run of slots that "
                   "follow each other on disk, or per chunk of a run through the bounce "
                   "memory; more after short or failed reads.")
      .def("read", &disk_reader_read, "fd"_a, "disk_offsets"_a, "stride"_a, "region"_a,
           "dest_offsets"_a, "keys"_a, "generations"_a,
           "Read tier-file slots into the arena behind earlier calls' batches and check "
           "their headers and checksums (GIL released); per-slot statuses (0, an errno, "
           "STATUS_STALE or STATUS_CORRUPT). Slots that follow each other on disk are "
           "read as one run.");
  m.def("disk_read_raw", &disk_read_raw_py, "fd"_a, "disk_offsets"_a, "stride"_a, "threads"_a,
        "scratch"_a,
        "O_DIRECT reads of the same shape into scratch memory (the disk's own bandwidth).");
}

}  // namespace distore
