// Bindings: the same-host insert path (staging.h): a writer's staging buffer
// mapped read-only, and the batched copy from it into arena slots.
#include "bindings.h"

#include "mapped.h"
#include "memory.h"
#include "staging.h"

namespace distore {

// A same-host insert batch smaller than this is copied with the GIL held:
// handing the GIL to another thread and taking it back (a condition
// variable broadcast and a wake-up) cost more than copying a fan-in's batch
// of a few 3 KB items (5% of a node's event loop under 256 actors).
constexpr size_t kKeepGilBytes = size_t(64) << 10;

void bind_staging(nb::module_& m) {
  nb::class_<StagingMap>(m, "StagingMap",
                         "A same-host writer's staging buffer, mapped read-only (PROT_READ).")
      .def(nb::init<int, size_t, std::string>(), "fd"_a, "size"_a, "peer"_a = "",
           nb::call_guard<nb::gil_scoped_release>(),
           "Map `size` bytes of the writer's sealed memfd `fd` read-only (a hugepage\n"
           "memfd's pages made at once); refuses an fd not sealed against shrinking and\n"
           "writes. The caller keeps (and closes) the fd. Releases the GIL.")
      .def_prop_ro("size", &StagingMap::size)
      .def_prop_ro("peer", &StagingMap::peer)
      .def_prop_ro("address",
                   [](const StagingMap& s) { return reinterpret_cast<uintptr_t>(s.base()); });
  m.def(
      "pull_mapped",
      [](const MemoryRegion& arena, const StagingMap& src, uint64_t src_base,
         Vec<uint64_t> slot_offsets, Vec<uint64_t> src_addresses, Vec<uint64_t> lengths,
         Vec<uint64_t> keys, Vec<uint64_t> generations, CopyPool* pool, size_t parallel_bytes) {
        const std::vector<PullItem> items =
            pull_items("pull_mapped", slot_offsets, src_addresses, lengths, keys, generations);
        const size_t n = items.size();
        auto [array, statuses] = new_statuses(n);
        size_t total = 0;
        for (const PullItem& item : items) total += item.length;
        if (total < kKeepGilBytes) {  // a fan-in's batch of small items: copied at once
          pull_mapped(arena, src, src_base, items.data(), n, pool, parallel_bytes, statuses);
        } else {
          nb::gil_scoped_release release;
          pull_mapped(arena, src, src_base, items.data(), n, pool, parallel_bytes, statuses);
        }
        return array;
      },
      "arena"_a, "src"_a, "src_base"_a, "slot_offsets"_a, "src_addresses"_a, "lengths"_a,
      "keys"_a, "generations"_a, "pool"_a.none(), "parallel_bytes"_a = 1 << 20,
      "Copy a same-host writer's staged items from its mapped staging buffer into arena\n"
      "slots (payload at slot + 16) in one call, GIL released, over `pool` for batches of\n"
      "`parallel_bytes` or more: headers invalidated first, real headers written after\n"
      "the payloads. `src_addresses` are the items' addresses in the writer, whose\n"
      "staging buffer starts at `src_base`. Returns per-item statuses (all 0). Batches\n"
      "under 64 KiB are copied with the GIL held. Raises\n"
      "OutOfBoundsError before writing anything if an item lies outside the arena or the\n"
      "staging buffer.");
}

}  // namespace distore
