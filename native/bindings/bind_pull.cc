// Bindings: the storage node's pull of a writer's staged batch.
#include "bindings.h"

#include <ucp/api/ucp.h>

#include "memory.h"
#include "pull.h"
#include "remote_key.h"

namespace distore {

void bind_pull(nb::module_& m) {
  m.def(
      "pull",
      [](const MemoryRegion& arena, const MemoryRegion* dest, nb::object worker,
         const RemoteKey* rkey, int64_t pid, uint64_t src_base, uint64_t src_size,
         Vec<uint64_t> slot_offsets, Vec<uint64_t> src_addresses, Vec<uint64_t> lengths,
         Vec<uint64_t> keys, Vec<uint64_t> generations, double timeout_s) {
        const std::vector<PullItem> items =
            pull_items("pull", slot_offsets, src_addresses, lengths, keys, generations);
        const size_t n = items.size();
        if (pid < 0 || pid > INT32_MAX) throw UcxError(kStatusBadArgument, "pull: bad pid");
        ucp_worker_h w =
            worker.is_none() ? nullptr : reinterpret_cast<ucp_worker_h>(handle_of(worker, "worker"));
        auto [array, statuses] = new_statuses(n);
        {
          nb::gil_scoped_release release;
          pull(arena, dest, w, rkey, static_cast<pid_t>(pid), src_base, src_size, items.data(),
               n, timeout_s, statuses);
        }
        return array;
      },
      "arena"_a, "dest"_a.none(), "worker"_a.none(), "rkey"_a.none(), "pid"_a, "src_base"_a,
      "src_size"_a, "slot_offsets"_a, "src_addresses"_a, "lengths"_a, "keys"_a,
      "generations"_a, "timeout"_a = 30.0,
      "Read a writer's staged items one-sided into arena slots (payload at slot + 16),\n"
      "in one call: headers invalidated first, real headers written after the payloads.\n\n"
      "Through UCX with `rkey` (and `dest`, the arena's writable alias registered for\n"
      "local access, and `worker`), else from same-host process `pid` (process_vm_readv).\n"
      "Returns the per-item ucs_status_t (0 = UCS_OK); a failed item keeps an invalid\n"
      "header. Raises OutOfBoundsError before writing anything if an item lies outside\n"
      "the arena or the source range [src_base, src_base + src_size).");
}

}  // namespace distore
