// What the binding files of _native share: the array type of batch
// arguments, the raw UCX handle of a ucxx object and the Owner (owner.h) that
// keeps it alive, per-item status arrays, and one bind_* function per concept
// (each in its own bind_*.cc; module.cc calls them). The core takes plain C++
// types; these files convert. Every native failure is thrown as UcxError and
// translated in bind_status.cc.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "am_connections.h"
#include "owner.h"
#include "pull.h"
#include "status.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace distore {

template <typename T>
using Vec = nb::ndarray<const T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

inline uintptr_t handle_of(const nb::object& obj, const char* what) {
  if (!nb::hasattr(obj, "handle")) {
    throw UcxError(kStatusBadArgument, std::string(what) + " object has no .handle attribute");
  }
  return nb::cast<uintptr_t>(obj.attr("handle"));
}

// An Owner holding a reference to `obj` (none if it is null): the core keeps
// the Python object alive without knowing it. Made with the GIL held; its
// last copy drops the reference, so it goes with the GIL held too (owner.h).
inline Owner owner_of(nb::object obj) {
  if (!obj.is_valid()) return Owner();
  return Owner(obj.release().ptr(),
               [](void* p) { nb::handle(static_cast<PyObject*>(p)).dec_ref(); });
}

using StatusArray = nb::ndarray<nb::numpy, int32_t, nb::ndim<1>>;

// A numpy array for the per-item statuses of a batch of n, owned by Python,
// and its data for native code to fill (without the GIL) before returning it.
inline std::pair<StatusArray, int32_t*> new_statuses(size_t n) {
  auto* statuses = new int32_t[n > 0 ? n : 1];
  nb::capsule owner(statuses, [](void* p) noexcept { delete[] static_cast<int32_t*>(p); });
  return {StatusArray(statuses, {n}, owner), statuses};
}

// A pull's per-item arrays (pull, pull_mapped) as PullItems; UcxError
// naming `what` when their lengths differ.
inline std::vector<PullItem> pull_items(const char* what, const Vec<uint64_t>& slot_offsets,
                                        const Vec<uint64_t>& src_addresses,
                                        const Vec<uint64_t>& lengths, const Vec<uint64_t>& keys,
                                        const Vec<uint64_t>& generations) {
  const size_t n = slot_offsets.shape(0);
  if (src_addresses.shape(0) != n || lengths.shape(0) != n || keys.shape(0) != n ||
      generations.shape(0) != n) {
    throw UcxError(kStatusBadArgument,
                   std::string(what) + ": the per-item arrays differ in length");
  }
  std::vector<PullItem> items(n);
  for (size_t i = 0; i < n; ++i) {
    items[i] = PullItem{slot_offsets(i), src_addresses(i), lengths(i), keys(i), generations(i)};
  }
  return items;
}

// A listener's connection counts (AmConnections::counts) as a dict.
inline nb::dict connection_counts(const AmConnections::Counts& c) {
  nb::dict d;
  d["open"] = c.open;
  d["accepted"] = c.accepted;
  d["refused"] = c.refused;
  d["failed"] = c.failed;
  d["aborted"] = c.aborted;
  d["pending"] = c.pending;
  d["unauthenticated"] = c.unauthenticated;
  return d;
}

void bind_status(nb::module_& m);      // error translation, status names, UCX version
void bind_status_constants(nb::module_& m);  // STATUS_* values
void bind_memory(nb::module_& m);      // MemoryRegion
void bind_remote_key(nb::module_& m);  // RemoteKey
void bind_gather(nb::module_& m);      // gather (one-sided reads), put
void bind_mapped(nb::module_& m);      // MappedArena, CopyPool, mapped_gather
void bind_pull(nb::module_& m);        // pull (inserts read by the node)
void bind_endpoint(nb::module_& m);    // Endpoint (force-closable), remote-access guard
void bind_staging(nb::module_& m);     // StagingMap, pull_mapped (same-host writers)
void bind_disk(nb::module_& m);        // disk_write, disk_read (the disk tier)
void bind_am(nb::module_& m);          // AmInbox, am_send, pull_am (inserts by active message)
void bind_am_sample(nb::module_& m);   // AmSampleServer, AmSampleClient (samples by active message)
void bind_slots(nb::module_& m);       // slot_carve, slot_index, slot_commit, slot_reuse, ...

}  // namespace distore
