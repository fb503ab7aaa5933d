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

#include "gather.h"
#include "mapped.h"
#include "memory.h"
#include "pull.h"
#include "remote_key.h"
#include "staging.h"
#include "status.h"
#include "sum_tree.h"
#include "table_core.h"

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
    Vec<uint64_t> dest_offset, double timeout_s) {
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
    gather(worker_h, rkeys, items.data(), n, dest, timeout_s, statuses);
  }
  return array;
}

template <typename T>
nb::ndarray<nb::numpy, T, nb::ndim<1>> to_numpy(std::vector<T>&& v) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(heap->data(), {heap->size()}, owner);
}

// One value per id, read by `get`; an id that is not in the table is an
// error naming `what`.
template <typename T, typename Get>
nb::ndarray<nb::numpy, T, nb::ndim<1>> per_live_id(const TableCore& t, Vec<int64_t> ids,
                                                   const char* what, Get get) {
  std::vector<T> out(ids.shape(0));
  for (size_t i = 0; i < out.size(); ++i) {
    if (!t.contains(ids(i))) {
      throw UcxError(kStatusBadArgument, std::string(what) + ": id not in the table");
    }
    out[i] = get(ids(i));
  }
  return to_numpy(std::move(out));
}

template <typename A, typename B>
void same_length(const A& a, const B& b, const char* what) {
  if (a.shape(0) != b.shape(0)) {
    throw UcxError(kStatusBadArgument, std::string(what) + ": arrays differ in length");
  }
}

// Lease counting for the control plane's item records, batch-shaped:
// np.add.at / np.subtract.at cost ~8 us a call at batch sizes of 32.
void lease_add(nb::ndarray<uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> counts,
               Vec<int64_t> ids) {
  const size_t n = counts.shape(0);
  for (size_t i = 0; i < ids.shape(0); ++i) {
    if (ids(i) < 0 || static_cast<size_t>(ids(i)) >= n) {
      throw UcxError(kStatusBadArgument, "lease_add: record id out of range");
    }
  }
  for (size_t i = 0; i < ids.shape(0); ++i) ++counts(ids(i));
}

// Drops one lease per id; returns, once each, the ids whose count reached 0
// while their state equals `retired`.
nb::ndarray<nb::numpy, int64_t, nb::ndim<1>> lease_release(
    nb::ndarray<uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> counts,
    nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> state,
    Vec<int64_t> ids, uint8_t retired) {
  const size_t n = counts.shape(0);
  if (state.shape(0) != n) throw UcxError(kStatusBadArgument, "lease_release: shapes differ");
  for (size_t i = 0; i < ids.shape(0); ++i) {
    if (ids(i) < 0 || static_cast<size_t>(ids(i)) >= n || counts(ids(i)) == 0) {
      throw UcxError(kStatusBadArgument, "lease_release: id out of range or not leased");
    }
  }
  std::vector<int64_t> done;
  for (size_t i = 0; i < ids.shape(0); ++i) {
    const int64_t id = ids(i);
    if (--counts(id) == 0 && state(id) == retired) done.push_back(id);
  }
  return to_numpy(std::move(done));
}

void bind_tables(nb::module_& m) {
  m.def("lease_add", &lease_add, "counts"_a, "ids"_a, "counts[ids] += 1, duplicates counted.");
  m.def("lease_release", &lease_release, "counts"_a, "state"_a, "ids"_a, "retired"_a,
        "counts[ids] -= 1; the ids that reached 0 in state `retired`, once each.");
  nb::class_<SumTree>(m, "SumTree", "Sum tree over non-negative weights (O(log n)).")
      .def(nb::init<size_t>(), "capacity"_a)
      .def_prop_ro("capacity", &SumTree::capacity)
      .def_prop_ro("total", &SumTree::total)
      .def(
          "set",
          [](SumTree& t, Vec<int64_t> idx, Vec<double> values) {
            same_length(idx, values, "SumTree.set");
            for (size_t i = 0; i < idx.shape(0); ++i) {
              if (idx(i) < 0 || static_cast<size_t>(idx(i)) >= t.capacity() ||
                  !(values(i) >= 0.0) || std::isinf(values(i))) {
                throw UcxError(kStatusBadArgument,
                               "SumTree.set: index out of range or weight not finite >= 0");
              }
            }
            nb::gil_scoped_release release;
            for (size_t i = 0; i < idx.shape(0); ++i) t.set(idx(i), values(i));
          },
          "indices"_a, "values"_a, "Set a batch of weights.")
      .def(
          "get",
          [](const SumTree& t, Vec<int64_t> idx) {
            std::vector<double> out(idx.shape(0));
            for (size_t i = 0; i < out.size(); ++i) {
              if (idx(i) < 0 || static_cast<size_t>(idx(i)) >= t.capacity()) {
                throw UcxError(kStatusBadArgument, "SumTree.get: index out of range");
              }
              out[i] = t.get(idx(i));
            }
            return to_numpy(std::move(out));
          },
          "indices"_a)
      .def(
          "find",
          [](const SumTree& t, Vec<double> prefixes) {
            std::vector<int64_t> out(prefixes.shape(0));
            for (size_t i = 0; i < out.size(); ++i) out[i] = t.find(prefixes(i));
            return to_numpy(std::move(out));
          },
          "prefixes"_a, "The leaf of each running-sum prefix in [0, total).");

  nb::class_<TableCore>(m, "TableCore",
                        "Reverb-style selection core of a table: sampler, remover, "
                        "max_times_sampled, priorities. Batch operations only.")
      .def(
          "__init__",
          [](TableCore* self, const std::string& sampler, double sampler_alpha,
             const std::string& remover, double remover_alpha, uint64_t capacity,
             uint32_t max_times_sampled, uint64_t seed) {
            new (self) TableCore(selector_kind(sampler), sampler_alpha, selector_kind(remover),
                                 remover_alpha, capacity, max_times_sampled, seed);
          },
          "sampler"_a, "sampler_alpha"_a, "remover"_a, "remover_alpha"_a, "capacity"_a,
          "max_times_sampled"_a, "seed"_a)
      .def_prop_ro("size", &TableCore::size)
      .def_prop_ro("capacity", &TableCore::capacity)
      .def_prop_ro("max_times_sampled", &TableCore::max_times_sampled)
      .def_prop_ro("remaining_uses", &TableCore::remaining_uses)
      .def(
          "insert",
          [](TableCore& t, Vec<int64_t> ids, Vec<uint64_t> keys, Vec<double> prios) {
            same_length(ids, keys, "insert");
            same_length(ids, prios, "insert");
            std::vector<int64_t> evicted;
            t.insert(ids.data(), keys.data(), prios.data(), ids.shape(0), &evicted);
            return to_numpy(std::move(evicted));
          },
          "ids"_a, "keys"_a, "priorities"_a, "Insert a batch; returns the evicted ids.")
      .def(
          "restore",
          [](TableCore& t, Vec<int64_t> ids, Vec<uint64_t> keys, Vec<double> prios,
             Vec<uint32_t> times, Vec<uint64_t> seqs) {
            same_length(ids, keys, "restore");
            same_length(ids, prios, "restore");
            same_length(ids, times, "restore");
            same_length(ids, seqs, "restore");
            std::vector<int64_t> evicted;
            t.restore(ids.data(), keys.data(), prios.data(), times.data(), seqs.data(),
                      ids.shape(0), &evicted);
            return to_numpy(std::move(evicted));
          },
          "ids"_a, "keys"_a, "priorities"_a, "times_sampled"_a, "sequences"_a,
          "Put back checkpointed items with their use counts and insertion order; returns "
          "the evicted ids.")
      .def_prop_ro("next_seq", &TableCore::next_seq,
                   "Insertion sequence number of the next inserted item.")
      .def(
          "raise_next_seq",
          [](TableCore& t, uint64_t seq) { t.raise_next_seq(seq); },
          "seq"_a, "Sequence later inserts after `seq` (never lowers it).")
      .def(
          "sample",
          [](TableCore& t, size_t n) {
            std::vector<int64_t> ids, exhausted;
            std::vector<double> probs;
            ids.reserve(n);
            probs.reserve(n);
            t.sample(n, &ids, &probs, &exhausted);
            return nb::make_tuple(to_numpy(std::move(ids)), to_numpy(std::move(probs)),
                                  to_numpy(std::move(exhausted)));
          },
          "n"_a, "Draw n items: (ids, probabilities, ids that reached max_times_sampled).")
      .def(
          "update_priorities",
          [](TableCore& t, Vec<uint64_t> keys, Vec<double> prios) {
            same_length(keys, prios, "update_priorities");
            return t.update_priorities(keys.data(), prios.data(), keys.shape(0));
          },
          "keys"_a, "priorities"_a, "Set priorities by key; returns how many keys were found.")
      .def(
          "remove",
          [](TableCore& t, Vec<int64_t> ids) { return t.remove(ids.data(), ids.shape(0)); },
          "ids"_a, "Remove items by id; returns how many were in the table.")
      .def(
          "lookup",
          [](const TableCore& t, Vec<uint64_t> keys) {
            std::vector<int64_t> ids(keys.shape(0));
            t.lookup(keys.data(), ids.size(), ids.data());
            return to_numpy(std::move(ids));
          },
          "keys"_a, "Ids of items by key (-1 when not in the table).")
      .def(
          "probabilities",
          [](const TableCore& t, Vec<int64_t> ids) {
            return per_live_id<double>(t, ids, "probabilities",
                                       [&](int64_t id) { return t.probability(id); });
          },
          "ids"_a, "The probability that the next draw returns each (live) id.")
      .def(
          "priorities",
          [](const TableCore& t, Vec<int64_t> ids) {
            return per_live_id<double>(t, ids, "priorities",
                                       [&](int64_t id) { return t.priority(id); });
          },
          "ids"_a, "Priorities of live ids.")
      .def(
          "times_sampled",
          [](const TableCore& t, Vec<int64_t> ids) {
            return per_live_id<uint32_t>(t, ids, "times_sampled",
                                         [&](int64_t id) { return t.times_sampled(id); });
          },
          "ids"_a, "How often each live id was sampled.")
      .def(
          "sequences",
          [](const TableCore& t, Vec<int64_t> ids) {
            return per_live_id<uint64_t>(t, ids, "sequences",
                                         [&](int64_t id) { return t.sequence(id); });
          },
          "ids"_a, "Insertion sequence numbers (FIFO order) of live ids.");
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
             uint64_t size, std::string peer) {
            uintptr_t h = handle_of(endpoint, "endpoint");
            new (self) RemoteKey(std::move(endpoint), h, std::move(packed), base, size,
                                 std::move(peer));
          },
          "endpoint"_a, "packed"_a, "remote_base"_a, "remote_size"_a, "peer"_a = "")
      .def_prop_ro("remote_base", &RemoteKey::remote_base)
      .def_prop_ro("remote_size", &RemoteKey::remote_size)
      .def_prop_ro("peer", &RemoteKey::peer);

  m.def("gather", &gather_py, "worker"_a, "rkeys"_a, "key_index"_a, "remote_address"_a,
        "length"_a, "dest"_a, "dest_offset"_a, "timeout"_a = 30.0,
        "Read every item of a batch into `dest` with one-sided gets, in one call.\n\n"
        "Returns the per-item ucs_status_t (0 = UCS_OK). Raises OutOfBoundsError or\n"
        "InvalidArgument before posting anything if an item is malformed.");
  bind_tables(m);
  bind_mapped(m);
  bind_staging(m);
  m.attr("STATUS_OUT_OF_BOUNDS") = kStatusOutOfBounds;
  m.attr("STATUS_BAD_ARGUMENT") = kStatusBadArgument;
  m.attr("STATUS_TORN") = kStatusTorn;
  m.attr("STATUS_UNREACHABLE") = static_cast<int>(UCS_ERR_UNREACHABLE);

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
