// Bindings: same-host reads of mapped arenas.
#include "bindings.h"

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
}

}  // namespace distore
