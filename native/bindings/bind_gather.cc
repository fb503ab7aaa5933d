// Bindings: the batched one-sided gather, and put (to test that arenas refuse it).
#include "bindings.h"

#include <ucp/api/ucp.h>

#include "gather.h"
#include "layout.h"
#include "memory.h"
#include "remote_key.h"

namespace distore {

namespace {

nb::ndarray<nb::numpy, int32_t, nb::ndim<1>> gather_py(
    nb::object worker, std::vector<const RemoteKey*> rkeys, Vec<uint32_t> key_index,
    Vec<uint64_t> remote_address, Vec<uint64_t> length, const MemoryRegion& dest,
    Vec<uint64_t> dest_offset, double timeout_s, double stall_s) {
  const size_t n = key_index.shape(0);
  if (remote_address.shape(0) != n || length.shape(0) != n || dest_offset.shape(0) != n) {
    throw UcxError(kStatusBadArgument, "gather: key_index, remote_address, length and "
                                       "dest_offset must have the same length");
  }
  auto worker_h = reinterpret_cast<ucp_worker_h>(handle_of(worker, "worker"));
  std::vector<GatherItem> items(n);
  for (size_t i = 0; i < n; ++i) {
    items[i] = GatherItem{key_index(i), remote_address(i), length(i), dest_offset(i)};
  }
  auto [array, statuses] = new_statuses(n);
  {
    nb::gil_scoped_release release;
    gather(worker_h, rkeys, items.data(), n, dest, timeout_s, statuses, stall_s);
  }
  return array;
}

nb::ndarray<nb::numpy, int32_t, nb::ndim<1>> gather_dense_py(
    nb::object worker, std::vector<const RemoteKey*> rkeys, Vec<uint32_t> key_index,
    Vec<uint64_t> remote_address, Vec<uint64_t> rows, const BatchLayout& layout,
    const MemoryRegion& dest, const MemoryRegion* staging, double timeout_s, double stall_s,
    uint64_t slot_stride, nb::object reads_obj) {
  using Counter = nb::ndarray<uint64_t, nb::shape<1>, nb::c_contig, nb::device::cpu>;
  const size_t n = key_index.shape(0);
  if (remote_address.shape(0) != n || rows.shape(0) != n) {
    throw UcxError(kStatusBadArgument, "gather_dense: key_index, remote_address and rows "
                                       "must have the same length");
  }
  Counter reads;
  const bool count = !reads_obj.is_none();
  if (count && !nb::try_cast(reads_obj, reads)) {
    throw UcxError(kStatusBadArgument, "gather_dense: `reads` must be a writable uint64 "
                                       "array of one element");
  }
  auto worker_h = reinterpret_cast<ucp_worker_h>(handle_of(worker, "worker"));
  auto [array, statuses] = new_statuses(n);
  uint64_t posted = 0;
  {
    nb::gil_scoped_release release;
    gather_dense(worker_h, rkeys, key_index.data(), remote_address.data(), rows.data(), n,
                 layout, dest, staging, timeout_s, statuses, stall_s, slot_stride, &posted);
  }
  if (count) reads(0) += posted;
  return array;
}

BatchLayout make_layout(uint64_t rows, uint64_t header, Vec<uint64_t> src,
                        Vec<uint64_t> length, Vec<uint64_t> dest) {
  const size_t k = src.shape(0);
  if (length.shape(0) != k || dest.shape(0) != k) {
    throw UcxError(kStatusBadArgument, "BatchLayout: src, length and dest need one entry "
                                       "per field");
  }
  std::vector<BatchLayout::Field> fields(k);
  for (size_t i = 0; i < k; ++i) fields[i] = {src(i), length(i), dest(i)};
  return BatchLayout(rows, header, std::move(fields));
}

}  // namespace

void bind_gather(nb::module_& m) {
  m.def("gather", &gather_py, "worker"_a, "rkeys"_a, "key_index"_a, "remote_address"_a,
        "length"_a, "dest"_a, "dest_offset"_a, "timeout"_a = 30.0, "stall"_a = 2.0,
        "Read every item of a batch into `dest` with one-sided gets, in one call.\n\n"
        "When no read finishes for `stall` s (0: never), the endpoints of the reads\n"
        "still pending are force-closed and those items fail (a hung peer).\n"
        "Returns the per-item ucs_status_t (0 = UCS_OK). Raises OutOfBoundsError or\n"
        "InvalidArgument before posting anything if an item is malformed.");

  nb::class_<BatchLayout>(m, "BatchLayout",
                          "Where a batch lands: a (rows, 2) header array and one dense\n"
                          "array per field (spec.TableSpec.layout).")
      .def(nb::new_(&make_layout), "rows"_a, "header"_a, "src"_a, "length"_a, "dest"_a,
           "`rows` items; the header array at offset `header`; field k read from\n"
           "src[k] bytes into a slot (header included), length[k] bytes an item, into\n"
           "the array at offset dest[k]. Raises InvalidArgument if arrays overlap.")
      .def_prop_ro("rows", &BatchLayout::rows)
      .def_prop_ro("nbytes", &BatchLayout::end)
      .def_prop_ro("read_length", &BatchLayout::read_length);

  m.def("gather_dense", &gather_dense_py, "worker"_a, "rkeys"_a, "key_index"_a,
        "remote_address"_a, "rows"_a, "layout"_a, "dest"_a, "staging"_a.none() = nb::none(),
        "timeout"_a = 30.0, "stall"_a = 2.0, "slot_stride"_a = 0, "reads"_a = nb::none(),
        "Read a sampled batch over UCX into `layout` (a BatchLayout) in `dest`, in one\n"
        "call: item i's slot at remote_address[i] goes to row rows[i], its header into\n"
        "the header array, each field into its own dense array. With a host `staging`\n"
        "region (n x layout.read_length bytes) each slot is read whole with one get\n"
        "and copied into place; without, one get per part (header, each field).\n"
        "With `slot_stride` (the arena's slot size), slots staged that far apart, and\n"
        "items whose slots follow each other in one arena read with one get a run\n"
        "(staging: (n - 1) x slot_stride + read_length bytes). `reads` (a uint64\n"
        "array of one), when given, is incremented by the reads posted.\n"
        "Same-host (CMA) keys always scatter directly. Per-item ucs_status_t\n"
        "(0 = UCS_OK); the caller checks the headers. Stalls and bad items as in\n"
        "gather().");

  m.def(
      "put",
      [](nb::object worker, const RemoteKey& key, uint64_t remote_address,
         const MemoryRegion& src, uint64_t length, double timeout_s) {
        auto w = reinterpret_cast<ucp_worker_h>(handle_of(worker, "worker"));
        nb::gil_scoped_release release;
        return put(w, key, remote_address, src, length, timeout_s);
      },
      "worker"_a, "key"_a, "remote_address"_a, "src"_a, "length"_a, "timeout"_a = 10.0,
      "One-sided write (returns the ucs_status_t); arenas must refuse it.");
}

}  // namespace distore
