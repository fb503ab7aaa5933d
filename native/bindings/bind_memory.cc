// Bindings: memory registered with UCX (MemoryRegion).
#include "bindings.h"

#include "memory.h"
#include "rows.h"

namespace distore {

void bind_memory(nb::module_& m) {
  m.def(
      "permute_rows",
      [](nb::ndarray<uint8_t, nb::ndim<2>, nb::c_contig, nb::device::cpu> rows,
         Vec<int64_t> order) {
        if (order.shape(0) != rows.shape(0)) {
          throw UcxError(kStatusBadArgument, "permute_rows: one order entry per row");
        }
        nb::gil_scoped_release release;
        permute_rows(rows.data(), rows.shape(1), order.data(), rows.shape(0));
      },
      "rows"_a, "order"_a,
      "Reorder the rows of a C-contiguous (n, row_bytes) uint8 array in place so\n"
      "that row i holds what row order[i] held (each row moved copied once).\n"
      "Raises InvalidArgument, touching nothing, unless `order` is a permutation.");
  m.def(
      "copy_rows",
      [](nb::ndarray<uint8_t, nb::ndim<2>, nb::device::cpu> dst,
         nb::ndarray<const uint8_t, nb::ndim<2>, nb::device::cpu> src) {
        const size_t n = dst.shape(0), row = dst.shape(1);
        if (src.shape(0) != n || src.shape(1) != row) {
          throw UcxError(kStatusBadArgument,
                         "copy_rows: the source is " + std::to_string(src.shape(0)) + " x " +
                             std::to_string(src.shape(1)) + " bytes, the destination " +
                             std::to_string(n) + " x " + std::to_string(row));
        }
        if (row > 1 && (dst.stride(1) != 1 || src.stride(1) != 1)) {
          throw UcxError(kStatusBadArgument,
                         "copy_rows: each row must be contiguous (a column stride of 1)");
        }
        if (n > 1 && (dst.stride(0) < 0 || src.stride(0) < 0)) {
          throw UcxError(kStatusBadArgument, "copy_rows: rows in reverse order");
        }
        uint8_t* d = dst.data();
        const uint8_t* s = src.data();
        const auto ds = static_cast<size_t>(dst.stride(0));
        const auto ss = static_cast<size_t>(src.stride(0));
        nb::gil_scoped_release release;
        copy_rows(d, ds, s, ss, n, row);
      },
      "dst"_a, "src"_a,
      "Copy the rows of `src` into those of `dst`, both (n, row_bytes) uint8 arrays\n"
      "whose rows are contiguous (any row stride): a writer staging a large field.\n"
      "Rows of 256 KiB and more are written with non-temporal stores (the writer\n"
      "never reads a staged row again). Releases the GIL. Raises InvalidArgument,\n"
      "copying nothing, if the shapes differ or a row is not contiguous.");
  m.attr("STAGE_STREAM_MIN") = kStageStreamMin;
  nb::class_<MemoryRegion>(m, "MemoryRegion",
                           "Memory registered with UCX; page aligned when allocated here.")
      .def(
          "__init__",
          [](MemoryRegion* self, nb::object context, size_t size, bool remote_read,
             bool hugepages) {
            uintptr_t h = handle_of(context, "context");
            new (self) MemoryRegion(owner_of(std::move(context)), h, size, remote_read, hugepages);
          },
          "context"_a, "size"_a, "remote_read"_a = false, "hugepages"_a = false,
          "Allocate and map `size` bytes; `remote_read` lets peers read it (never write).")
      .def_static(
          "register",
          [](nb::object context, uintptr_t address, size_t size, nb::object owner,
             int memory_type) {
            uintptr_t h = handle_of(context, "context");
            return new MemoryRegion(owner_of(std::move(context)), h, address, size,
                                    owner_of(std::move(owner)), memory_type);
          },
          "context"_a, "address"_a, "size"_a, "owner"_a, "memory_type"_a = 0,
          nb::rv_policy::take_ownership,
          "Map caller-owned memory (host, or CUDA with memory_type=1) as a local "
          "destination; `owner` is kept alive.")
      .def_static(
          "write_protected",
          [](nb::object context, size_t size, bool hugepages) {
            uintptr_t h = handle_of(context, "context");
            return MemoryRegion::write_protected(owner_of(std::move(context)), h, size,
                                                 hugepages);
          },
          "context"_a, "size"_a, "hugepages"_a = true, nb::rv_policy::take_ownership,
          "A region peers may read but never write: registered through a read-only "
          "mapping of a sealed memfd, written by its owner through view().")
      .def_prop_ro("share_fd", &MemoryRegion::share_fd,
                   "The sealed memfd same-host readers may map read-only, or -1.")
      .def_prop_ro("page_kind", [](const MemoryRegion& r) { return std::string(r.page_kind()); },
                   "'hugetlb', 'thp' (transparent hugepages asked for) or '4k'.")
      .def_prop_ro("address", &MemoryRegion::address)
      .def_prop_ro("is_write_protected", &MemoryRegion::is_write_protected)
      .def_prop_ro("size", &MemoryRegion::size)
      .def_prop_ro("hugepages", &MemoryRegion::hugepages)
      .def_prop_ro("remote_read", &MemoryRegion::remote_read)
      .def(
          "populate",
          [](const MemoryRegion& r, size_t offset, size_t length) {
            nb::gil_scoped_release released;
            return r.populate(offset, length);
          },
          "offset"_a, "length"_a,
          "Make the pages of [offset, offset + length) now, writable (no first-touch "
          "fault later); returns 0 or the errno of a failure (ENOMEM/EFAULT: the host "
          "cannot back them).")
      .def(
          "pack_rkey",
          [](const MemoryRegion& r) {
            const std::string packed = r.pack_rkey();
            return nb::bytes(packed.data(), packed.size());
          },
          "Remote key bytes for peers.")
      .def(
          "view",
          [](nb::handle_t<MemoryRegion> self) {
            MemoryRegion& r = nb::cast<MemoryRegion&>(self);
            return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(
                reinterpret_cast<uint8_t*>(r.local_address()), {r.size()}, self);
          },
          "A writable uint8 numpy view of the whole region (keeps the region alive).");
}

}  // namespace distore
