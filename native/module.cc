// Python bindings of the native core: small, batch-shaped, GIL released
// while UCX works. Every native failure becomes the exception class that
// distore_ucx.errors maps its status to (errors.from_native), in one place.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include <ucp/api/ucp.h>

#include "endpoint.h"
#include "gather.h"
#include "guard.h"
#include "mapped.h"
#include "memory.h"
#include "pull.h"
#include "remote_key.h"
#include "status.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace distore {
namespace {

template <typename T>
using Vec = nb::ndarray<const T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

uintptr_t handle_of(const nb::object& obj, const char* what) {
  if (!nb::hasattr(obj, "handle")) {
    throw UcxError(kStatusBadArgument, std::string(what) + " object has no .handle attribute");
  }
  return nb::cast<uintptr_t>(obj.attr("handle"));
}

using StatusArray = nb::ndarray<nb::numpy, int32_t, nb::ndim<1>>;

// A numpy array for the per-item statuses of a batch of n, owned by Python,
// and its data for native code to fill (without the GIL) before returning it.
std::pair<StatusArray, int32_t*> new_statuses(size_t n) {
  auto* statuses = new int32_t[n > 0 ? n : 1];
  nb::capsule owner(statuses, [](void* p) noexcept { delete[] static_cast<int32_t*>(p); });
  return {StatusArray(statuses, {n}, owner), statuses};
}

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
// records as they came (bytes of protocol.ITEM_LOCATION), one call.
nb::ndarray<nb::numpy, int32_t, nb::ndim<1>> mapped_gather_located_py(
    std::vector<const MappedArena*> arenas, Vec<int64_t> map_lut, nb::bytes items,
    Vec<uint64_t> dest_offset, size_t length, MemoryRegion& dest, CopyPool* pool,
    size_t parallel_bytes) {
  if (items.size() % sizeof(ItemLocation) != 0) {
    throw UcxError(kStatusBadArgument, "mapped_gather_located: item records are " +
                                           std::to_string(sizeof(ItemLocation)) + " bytes each");
  }
  const size_t n = items.size() / sizeof(ItemLocation);
  if (dest_offset.shape(0) != n) {
    throw UcxError(kStatusBadArgument,
                   "mapped_gather_located: one dest_offset per item record is needed");
  }
  // The records are copied out of the bytes object: it need not be aligned.
  std::vector<ItemLocation> located(n);
  std::memcpy(located.data(), items.c_str(), items.size());
  auto [array, statuses] = new_statuses(n);
  {
    nb::gil_scoped_release release;
    mapped_gather_located(arenas, map_lut.data(), map_lut.shape(0), located.data(), n,
                          dest_offset.data(), length,
                          reinterpret_cast<uint8_t*>(dest.local_address()), dest.size(), pool,
                          parallel_bytes, statuses);
  }
  return array;
}

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
        "dest_offset"_a, "length"_a, "dest"_a, "pool"_a.none(), "parallel_bytes"_a = 1 << 20,
        "A sampled batch in one call: `items` are the control plane's records\n"
        "(protocol.ITEM_LOCATION bytes); items of nodes with map_lut[node] >= 0 (an\n"
        "index into `arenas`) are copied (`length` bytes each, header included) to\n"
        "dest at dest_offset and their headers checked. Per-item statuses: 0,\n"
        "STATUS_TORN, STATUS_STALE (the slot holds another item), or\n"
        "STATUS_NOT_MAPPED (nothing copied: read it over UCX).");
}

}  // namespace
}  // namespace distore

NB_MODULE(_native, m) {
  using namespace distore;
  m.doc() = "distore-ucx native core: UCX memory, remote keys and the batched gather.";

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const UcxError& e) {
      nb::object errors = nb::module_::import_("distore_ucx.errors");
      nb::object exc = errors.attr("from_native")(e.status(), status_name(e.status()),
                                                   std::string(e.what()), e.peer());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  m.def("ucx_version", [] { return std::string(ucp_get_version_string()); },
        "Version of the UCX library actually loaded, e.g. '1.21.0'.");
  m.def("status_name", &status_name, "status"_a, "Name of a ucs_status_t value.");

  nb::class_<MemoryRegion>(m, "MemoryRegion",
                           "Memory registered with UCX; page aligned when allocated here.")
      .def(
          "__init__",
          [](MemoryRegion* self, nb::object context, size_t size, bool remote_read,
             bool hugepages) {
            uintptr_t h = handle_of(context, "context");
            new (self) MemoryRegion(std::move(context), h, size, remote_read, hugepages);
          },
          "context"_a, "size"_a, "remote_read"_a = false, "hugepages"_a = false,
          "Allocate and map `size` bytes; `remote_read` lets peers read it (never write).")
      .def_static(
          "register",
          [](nb::object context, uintptr_t address, size_t size, nb::object owner,
             int memory_type) {
            uintptr_t h = handle_of(context, "context");
            return new MemoryRegion(std::move(context), h, address, size, std::move(owner),
                                    memory_type);
          },
          "context"_a, "address"_a, "size"_a, "owner"_a, "memory_type"_a = 0,
          nb::rv_policy::take_ownership,
          "Map caller-owned memory (host, or CUDA with memory_type=1) as a local "
          "destination; `owner` is kept alive.")
      .def_static(
          "write_protected",
          [](nb::object context, size_t size, bool hugepages) {
            uintptr_t h = handle_of(context, "context");
            return MemoryRegion::write_protected(std::move(context), h, size, hugepages);
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
      .def("pack_rkey", &MemoryRegion::pack_rkey, "Remote key bytes for peers.")
      .def(
          "view",
          [](nb::handle_t<MemoryRegion> self) {
            MemoryRegion& r = nb::cast<MemoryRegion&>(self);
            return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(
                reinterpret_cast<uint8_t*>(r.local_address()), {r.size()}, self);
          },
          "A writable uint8 numpy view of the whole region (keeps the region alive).");

  nb::class_<RemoteKey>(m, "RemoteKey", "A peer's remote key unpacked on one endpoint.")
      .def(
          "__init__",
          [](RemoteKey* self, nb::object endpoint, nb::bytes packed, uint64_t base,
             uint64_t size, std::string peer, int64_t pid) {
            if (pid < 0 || pid > INT32_MAX) throw UcxError(kStatusBadArgument, "bad pid", peer);
            uintptr_t h = (pid > 0 && endpoint.is_none()) ? 0 : handle_of(endpoint, "endpoint");
            new (self) RemoteKey(std::move(endpoint), h, std::move(packed), base, size,
                                 std::move(peer), static_cast<pid_t>(pid));
          },
          "endpoint"_a.none(), "packed"_a, "remote_base"_a, "remote_size"_a, "peer"_a = "",
          "pid"_a = 0,
          "`pid` > 0 (a same-host peer): reads use process_vm_readv, `endpoint` may be None.")
      .def_prop_ro("pid", [](const RemoteKey& k) { return static_cast<int64_t>(k.pid()); })
      .def_prop_ro("remote_base", &RemoteKey::remote_base)
      .def_prop_ro("remote_size", &RemoteKey::remote_size)
      .def_prop_ro("peer", &RemoteKey::peer);

  m.def("gather", &gather_py, "worker"_a, "rkeys"_a, "key_index"_a, "remote_address"_a,
        "length"_a, "dest"_a, "dest_offset"_a, "timeout"_a = 30.0, "stall"_a = 2.0,
        "Read every item of a batch into `dest` with one-sided gets, in one call.\n\n"
        "When no read finishes for `stall` s (0: never), the endpoints of the reads\n"
        "still pending are force-closed and those items fail (a hung peer).\n"
        "Returns the per-item ucs_status_t (0 = UCS_OK). Raises OutOfBoundsError or\n"
        "InvalidArgument before posting anything if an item is malformed.");
  bind_mapped(m);
  m.attr("STATUS_OUT_OF_BOUNDS") = kStatusOutOfBounds;
  m.attr("STATUS_BAD_ARGUMENT") = kStatusBadArgument;
  m.attr("STATUS_TORN") = kStatusTorn;
  m.attr("STATUS_STALE") = kStatusStale;
  m.attr("STATUS_NOT_MAPPED") = kStatusNotMapped;
  m.attr("STATUS_UNREACHABLE") = static_cast<int>(UCS_ERR_UNREACHABLE);

  nb::class_<Endpoint>(m, "Endpoint",
                       "A UCX endpoint made with the C API on a ucxx worker; force-closable.")
      .def(
          "__init__",
          [](Endpoint* self, nb::object worker, nb::bytes address, bool error_handling,
             std::string peer) {
            uintptr_t h = handle_of(worker, "worker");
            new (self) Endpoint(std::move(worker), h, std::string(address.c_str(), address.size()),
                                error_handling, std::move(peer));
          },
          "worker"_a, "address"_a, "error_handling"_a, "peer"_a = "")
      .def_prop_ro("handle", &Endpoint::handle)
      .def_prop_ro("alive", &Endpoint::alive, "False once failed or closed.")
      .def_prop_ro("status", &Endpoint::status)
      .def_prop_ro("error_handling", &Endpoint::error_handling)
      .def(
          "close",
          [](Endpoint& self, bool force, double timeout) {
            nb::gil_scoped_release release;
            self.close(force, timeout);
          },
          "force"_a = false, "timeout"_a = 1.0,
          "Close once; `force` ends outstanding requests at once (error handling only).");

  m.def("refuse_remote_writes", &refuse_remote_writes,
        "Replace UCX's software PUT/atomic handlers in this process by ones that drop\n"
        "the message, and guard GETs; call before the worker exists. '' or why not.");
  m.def("allow_remote_reads", &allow_remote_reads, "base"_a, "size"_a,
        "Software GETs may read [base, base + size); others are dropped.");
  m.def("refused_remote_access", []() { return nb::make_tuple(refused_writes(), refused_reads()); },
        "(writes dropped, reads dropped) by the guard so far.");

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


  m.def(
      "pull",
      [](const MemoryRegion& arena, const MemoryRegion* dest, nb::object worker,
         const RemoteKey* rkey, int64_t pid, uint64_t src_base, uint64_t src_size,
         Vec<uint64_t> slot_offsets, Vec<uint64_t> src_addresses, Vec<uint64_t> lengths,
         Vec<uint64_t> keys, Vec<uint64_t> generations, double timeout_s) {
        const size_t n = slot_offsets.shape(0);
        if (src_addresses.shape(0) != n || lengths.shape(0) != n || keys.shape(0) != n ||
            generations.shape(0) != n) {
          throw UcxError(kStatusBadArgument, "pull: the per-item arrays differ in length");
        }
        if (pid < 0 || pid > INT32_MAX) throw UcxError(kStatusBadArgument, "pull: bad pid");
        ucp_worker_h w =
            worker.is_none() ? nullptr : reinterpret_cast<ucp_worker_h>(handle_of(worker, "worker"));
        std::vector<PullItem> items(n);
        for (size_t i = 0; i < n; ++i) {
          items[i] = PullItem{slot_offsets(i), src_addresses(i), lengths(i), keys(i),
                              generations(i)};
        }
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
