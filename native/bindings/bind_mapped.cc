// Bindings: same-host reads of mapped arenas.
#include "bindings.h"

#include <cstring>

#include "layout.h"
#include "mapped.h"
#include "memory.h"

namespace distore {

namespace {

// The same-host batched copy: items of mapped arenas into `dest`.
nb::ndarray<nb::numpy, int32_t, nb::ndim<1>> mapped_gather_py(
    std::vector<const MappedArena*> arenas, Vec<uint32_t> arena_index, Vec<uint64_t> offset,
    Vec<uint64_t> length, MemoryRegion& dest, Vec<uint64_t> dest_offset, CopyPool* pool,
    size_t parallel_bytes) {
  const size_t n = arena_index.shape(0);
  if (offset.shape(0) != n || length.shape(0) != n || dest_offset.shape(0) != n) {
    throw UcxError(kStatusBadArgument, "mapped_gather: arena_index, offset, length and "
                                       "dest_offset must have the same length");
  }
  std::vector<MappedItem> items(n);
  for (size_t i = 0; i < n; ++i) {
    items[i] = MappedItem{arena_index(i), offset(i), length(i), dest_offset(i)};
  }
  auto [array, statuses] = new_statuses(n);
  {
    nb::gil_scoped_release release;
    mapped_gather(arenas, items.data(), n, reinterpret_cast<uint8_t*>(dest.local_address()),
                  dest.size(), pool, parallel_bytes, statuses);
  }
  return array;
}

// A whole sampled batch from mapped arenas: the control plane's item
// records as they came (bytes of protocol.ITEM_LOCATION), one call, each
// item scattered into row rows[i] of `layout`.
nb::ndarray<nb::numpy, int32_t, nb::ndim<1>> mapped_gather_located_py(
    std::vector<const MappedArena*> arenas, Vec<int64_t> map_lut, nb::bytes items,
    Vec<uint64_t> rows, const BatchLayout& layout, MemoryRegion& dest, CopyPool* pool,
    size_t parallel_bytes) {
  if (items.size() % sizeof(ItemLocation) != 0) {
    throw UcxError(kStatusBadArgument, "mapped_gather_located: item records are " +
                                           std::to_string(sizeof(ItemLocation)) + " bytes each");
  }
  const size_t n = items.size() / sizeof(ItemLocation);
  if (rows.shape(0) != n) {
    throw UcxError(kStatusBadArgument, "mapped_gather_located: one row per item record is needed");
  }
  // The records are copied out of the bytes object: it need not be aligned.
  std::vector<ItemLocation> located(n);
  std::memcpy(located.data(), items.c_str(), items.size());
  auto [array, statuses] = new_statuses(n);
  {
    nb::gil_scoped_release release;
    mapped_gather_located(arenas, map_lut.data(), map_lut.shape(0), located.data(), n,
                          rows.data(), layout, reinterpret_cast<uint8_t*>(dest.local_address()),
                          dest.size(), pool, parallel_bytes, statuses);
  }
  return array;
}

}  // namespace

void bind_mapped(nb::module_& m) {
  nb::class_<MappedArena>(m, "MappedArena",
                          "A same-host storage node's arena, mapped read-only (PROT_READ).")
      .def(nb::init<int, size_t, std::string, size_t>(), "fd"_a, "size"_a, "peer"_a = "",
           "populate"_a = 0,
           "Map `size` bytes of the arena's sealed memfd `fd` read-only, with the page "
           "tables of its first `populate` bytes made at once; the caller keeps (and "
           "closes) the fd.")
      .def_prop_ro("size", &MappedArena::size)
      .def_prop_ro("populated", &MappedArena::populated)
      .def_prop_ro("peer", &MappedArena::peer)
      .def_prop_ro("address", [](const MappedArena& a) {
        return reinterpret_cast<uintptr_t>(a.base());
      });
  nb::class_<CopyPool>(m, "CopyPool", "Threads that split large same-host batch copies.")
      .def(nb::init<unsigned>(), "helpers"_a,
           "`helpers` threads besides the caller; they sleep while idle.")
      .def_prop_ro("helpers", &CopyPool::helpers);
  m.def("mapped_gather", &mapped_gather_py, "arenas"_a, "arena_index"_a, "offset"_a,
        "length"_a, "dest"_a, "dest_offset"_a, "pool"_a.none(), "parallel_bytes"_a = 1 << 20,
        "Copy every item (16-byte header + payload) of a batch out of mapped arenas into\n"
        "`dest`, in one call with the GIL released (over `pool` for batches of\n"
        "`parallel_bytes` or more). Returns per-item statuses: 0, or STATUS_TORN when\n"
        "the slot's header changed during the copy (the slot was rewritten).");
  m.def("mapped_gather_located", &mapped_gather_located_py, "arenas"_a, "map_lut"_a, "items"_a,
        "rows"_a, "layout"_a, "dest"_a, "pool"_a.none(), "parallel_bytes"_a = 1 << 20,
        "A sampled batch in one call: `items` are the control plane's records\n"
        "(protocol.ITEM_LOCATION bytes); items of nodes with map_lut[node] >= 0 (an\n"
        "index into `arenas`) are read into row rows[i] of `layout` (a BatchLayout) in\n"
        "dest: the slot header into the header array, each field into its own dense\n"
        "array; headers are read before and after the payloads and checked.\n"
        "Per-item statuses: 0, STATUS_TORN, STATUS_STALE (the slot holds another\n"
        "item), or STATUS_NOT_MAPPED (nothing copied: read it over UCX).");
  m.def("mapped_batch_stream_min", &mapped_batch_stream_min,
        "Bytes from which mapped_gather_located writes a batch with non-temporal\n"
        "stores: a quarter of the last-level cache sysfs gives for CPU 0, at least\n"
        "1 MiB (1 MiB when sysfs does not say). Below it, plain stores: a learner's\n"
        "ring of such batches stays in the cache.");
}

}  // namespace distore
