// Python bindings of the control plane's table core: selectors, sum tree,
// lease counts, the slice index. Its own extension module (_tables), built without UCX, so
// that the control plane never loads libucx for its tables. A refused call
// (TableError) is raised as distore_ucx.errors.TableCoreError.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "am_grant.h"
#include "slice_index.h"
#include "sum_tree.h"
#include "table_core.h"
#include "table_error.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace distore {
namespace {

template <typename T>
using Vec = nb::ndarray<const T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

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
      throw TableError(std::string(what) + ": id not in the table");
    }
    out[i] = get(ids(i));
  }
  return to_numpy(std::move(out));
}

template <typename A, typename B>
void same_length(const A& a, const B& b, const char* what) {
  if (a.shape(0) != b.shape(0)) {
    throw TableError(std::string(what) + ": arrays differ in length");
  }
}

// Lease counting for the control plane's item records, batch-shaped:
// np.add.at / np.subtract.at are slow at small batch sizes.
void lease_add(nb::ndarray<uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> counts,
               Vec<int64_t> ids) {
  const size_t n = counts.shape(0);
  for (size_t i = 0; i < ids.shape(0); ++i) {
    if (ids(i) < 0 || static_cast<size_t>(ids(i)) >= n) {
      throw TableError("lease_add: record id out of range");
    }
  }
  for (size_t i = 0; i < ids.shape(0); ++i) __builtin_prefetch(&counts(ids(i)), 1);
  for (size_t i = 0; i < ids.shape(0); ++i) ++counts(ids(i));
}

// Drops one lease per id; returns, once each, the ids whose count reached 0
// while their state equals `retired`.
nb::ndarray<nb::numpy, int64_t, nb::ndim<1>> lease_release(
    nb::ndarray<uint32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> counts,
    nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> state,
    Vec<int64_t> ids, uint8_t retired) {
  const size_t n = counts.shape(0);
  if (state.shape(0) != n) throw TableError("lease_release: shapes differ");
  for (size_t i = 0; i < ids.shape(0); ++i) {
    if (ids(i) >= 0 && static_cast<size_t>(ids(i)) < n) {
      __builtin_prefetch(&counts(ids(i)), 1);
      __builtin_prefetch(&state(ids(i)));
    }
  }
  for (size_t i = 0; i < ids.shape(0); ++i) {
    if (ids(i) < 0 || static_cast<size_t>(ids(i)) >= n || counts(ids(i)) == 0) {
      throw TableError("lease_release: id out of range or not leased");
    }
  }
  std::vector<int64_t> done;
  for (size_t i = 0; i < ids.shape(0); ++i) {
    const int64_t id = ids(i);
    if (--counts(id) == 0 && state(id) == retired) done.push_back(id);
  }
  return to_numpy(std::move(done));
}

std::string key_of(const nb::bytes& key) {
  if (key.size() != kAmKeyBytes) {
    throw TableError("a node's key is " + std::to_string(kAmKeyBytes) + " bytes, not " +
                     std::to_string(key.size()));
  }
  return std::string(key.c_str(), key.size());
}

// The grants of a sample reply (am_grant.h): each ITEM_LOCATION record's
// `pad` (the high half of its first word) set to its slot's tag under its
// node's key (keys[node]; a node past the table gets 0, which no node
// accepts but by chance).
void am_sign(nb::ndarray<uint64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> words,
             nb::ndarray<const uint8_t, nb::ndim<2>, nb::shape<-1, 16>, nb::c_contig,
                         nb::device::cpu> keys,
             uint64_t slot_size) {
  if (words.shape(0) % 4 != 0) throw TableError("am_sign: ITEM_LOCATION records are 4 words");
  uint64_t* w = words.data();
  const size_t n = words.shape(0) / 4, nodes = keys.shape(0);
  nb::gil_scoped_release release;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t node = w[4 * i] & 0xffffffffull;
    const uint64_t tag =
        node < nodes ? am_item_tag(keys.data() + 16 * node, w[4 * i + 1], slot_size) : 0;
    w[4 * i] = node | (tag << 32);
  }
}

void bind_grants(nb::module_& m) {
  m.def("am_sign", &am_sign, "words"_a, "keys"_a, "slot_size"_a,
        "Set the grant of each ITEM_LOCATION record in `words` (uint64, 4 a record,\n"
        "written in place): its `pad` becomes the tag of its slot (offset, `slot_size`)\n"
        "under keys[node] ((nodes, 16) uint8; am_grant.h). One call per sample reply.");
  m.def(
      "am_connect_cap",
      [](nb::bytes key) {
        uint8_t cap[kAmCapBytes];
        am_connect_cap(reinterpret_cast<const uint8_t*>(key_of(key).data()), cap);
        return nb::bytes(reinterpret_cast<const char*>(cap), sizeof(cap));
      },
      "key"_a, "The connection capability (16 bytes) of the node whose key is `key`.");
  m.def(
      "am_item_tags",
      [](nb::bytes key, Vec<uint64_t> slots, uint64_t slot_size) {
        const std::string k = key_of(key);
        std::vector<uint32_t> out(slots.shape(0));
        for (size_t i = 0; i < out.size(); ++i) {
          out[i] = am_item_tag(reinterpret_cast<const uint8_t*>(k.data()), slots(i), slot_size);
        }
        return to_numpy(std::move(out));
      },
      "key"_a, "slots"_a, "slot_size"_a,
      "The grants of slots at offsets `slots` of `slot_size` bytes under `key`.");
  m.def(
      "siphash24",
      [](nb::bytes key, nb::bytes data) {
        return siphash24(reinterpret_cast<const uint8_t*>(key_of(key).data()), data.c_str(),
                         data.size());
      },
      "key"_a, "data"_a, "SipHash-2-4 of `data` under the 16-byte `key` (for tests).");
}

// A SliceIndex as Python holds it. Its calls release the GIL, so two Python
// threads could enter it at once; the index has no locks (the control plane
// uses one thread), and `busy` turns such a call into an error, not a race.
struct BoundSliceIndex {
  BoundSliceIndex(int64_t slice_len, int64_t period, bool prioritized, double alpha,
                  uint64_t seed, int pad)
      : core(slice_len, period, prioritized, alpha, seed, pad) {}
  SliceIndex core;
  std::atomic<bool> busy{false};
};

class Exclusive {
 public:
  Exclusive(BoundSliceIndex& s, const char* what) : busy_(s.busy) {
    if (busy_.exchange(true)) {
      throw TableError(std::string("SliceIndex.") + what +
                       ": another thread is inside this index; it has one caller thread "
                       "(the control plane's), so serialise the calls");
    }
  }
  ~Exclusive() { busy_.store(false); }
  Exclusive(const Exclusive&) = delete;
  Exclusive& operator=(const Exclusive&) = delete;

 private:
  std::atomic<bool>& busy_;
};

template <typename A, typename B>
void same_length(const A& a, const B& b, const char* what, const char* a_name,
                 const char* b_name) {
  if (a.shape(0) != b.shape(0)) {
    throw TableError(std::string(what) + ": " + a_name + " has " + std::to_string(a.shape(0)) +
                     " entries and " + b_name + " " + std::to_string(b.shape(0)) +
                     "; pass one entry a step");
  }
}

void bind_slice_index(nb::module_& m) {
  nb::class_<BoundSliceIndex>(
      m, "SliceIndex",
      "The episodes of a table's steps and its valid slice starts (slice_index.h): a start\n"
      "is a step at a position p with p % period == 0 whose slice_len - 1 successors in\n"
      "its episode are present. Draws starts uniformly or by priority^alpha of the start\n"
      "step. Steps are record ids < 2^32 - 1. Batch operations only; one caller thread.\n"
      "pad 1: also starts whose run of steps ends at their episode's last step before\n"
      "slice_len; pad 2: only such starts at position 0 (episodes shorter than slice_len).")
      .def(nb::init<int64_t, int64_t, bool, double, uint64_t, int>(), "slice_len"_a,
           "period"_a = 1, "prioritized"_a = false, "alpha"_a = 1.0, "seed"_a = 0, "pad"_a = 0)
      .def_prop_ro("slice_len", [](const BoundSliceIndex& s) { return s.core.slice_len(); })
      .def_prop_ro("period", [](const BoundSliceIndex& s) { return s.core.period(); })
      .def_prop_ro("pad", [](const BoundSliceIndex& s) { return static_cast<int>(s.core.pad()); })
      .def_prop_ro("prioritized", [](const BoundSliceIndex& s) { return s.core.prioritized(); })
      .def_prop_ro("valid_starts", [](const BoundSliceIndex& s) { return s.core.valid_starts(); },
                   "How many steps are valid starts now.")
      .def_prop_ro("steps", [](const BoundSliceIndex& s) { return s.core.steps(); })
      .def_prop_ro("episodes", [](const BoundSliceIndex& s) { return s.core.episode_count(); },
                   "Episodes that hold at least one step.")
      .def_prop_ro("min_probability",
                   [](const BoundSliceIndex& s) { return s.core.min_probability(); },
                   "The smallest probability a draw can have now (0 with no valid start): "
                   "importance weights (P(i) / min)^-beta normalise by it.")
      .def(
          "add",
          [](BoundSliceIndex& s, Vec<int64_t> ids, Vec<uint64_t> episodes,
             Vec<uint32_t> positions, Vec<double> priorities, std::optional<Vec<uint8_t>> last) {
            same_length(ids, episodes, "SliceIndex.add", "ids", "episodes");
            same_length(ids, positions, "SliceIndex.add", "ids", "positions");
            same_length(ids, priorities, "SliceIndex.add", "ids", "priorities");
            if (last) same_length(ids, *last, "SliceIndex.add", "ids", "last");
            Exclusive one(s, "add");
            nb::gil_scoped_release release;
            s.core.add(ids.data(), episodes.data(), positions.data(), priorities.data(),
                       ids.shape(0), last ? last->data() : nullptr);
          },
          "ids"_a, "episodes"_a, "positions"_a, "priorities"_a, "last"_a = nb::none(),
          "Add steps: record ids (int64), their episodes (uint64), 0-based positions in\n"
          "them (uint32) and priorities (float64, finite >= 0), in any order; `last`\n"
          "(uint8, optional): nonzero for a step that ends its episode. A refused\n"
          "batch (an id or an (episode, position) present already) adds nothing.")
      .def(
          "remove",
          [](BoundSliceIndex& s, Vec<int64_t> ids) {
            Exclusive one(s, "remove");
            nb::gil_scoped_release release;
            return s.core.remove(ids.data(), ids.shape(0));
          },
          "ids"_a, "Remove steps by id (unknown ids skipped); returns how many were steps.")
      .def(
          "set_priorities",
          [](BoundSliceIndex& s, Vec<int64_t> ids, Vec<double> priorities) {
            same_length(ids, priorities, "SliceIndex.set_priorities", "ids", "priorities");
            Exclusive one(s, "set_priorities");
            nb::gil_scoped_release release;
            return s.core.set_priorities(ids.data(), priorities.data(), ids.shape(0));
          },
          "ids"_a, "priorities"_a,
          "Set steps' priorities (a slice's priority is its start step's); unknown ids\n"
          "skipped. Returns how many ids were steps.")
      .def(
          "sample",
          [](BoundSliceIndex& s, int64_t n) {
            if (n < 0) {
              throw TableError("SliceIndex.sample: n is " + std::to_string(n) +
                               "; ask for n >= 0 slices");
            }
            std::vector<int64_t> starts(static_cast<size_t>(n));
            std::vector<double> probabilities(static_cast<size_t>(n));
            size_t drawn;
            {
              Exclusive one(s, "sample");
              nb::gil_scoped_release release;
              drawn = s.core.sample(starts.size(), starts.data(), probabilities.data());
            }
            starts.resize(drawn);
            probabilities.resize(drawn);
            return nb::make_tuple(to_numpy(std::move(starts)), to_numpy(std::move(probabilities)));
          },
          "n"_a,
          "Draw n starts independently: (start ids, each draw's probability). Both are\n"
          "empty when no start is valid (wait for steps; not an error).")
      .def(
          "expand",
          [](BoundSliceIndex& s, Vec<int64_t> starts) {
            if (starts.shape(0) > SIZE_MAX / sizeof(int64_t) / s.core.slice_len()) {
              throw TableError("SliceIndex.expand: " + std::to_string(starts.shape(0)) +
                               " slices of " + std::to_string(s.core.slice_len()) +
                               " steps do not fit in memory; expand fewer at a time");
            }
            std::vector<int64_t> out;
            {
              Exclusive one(s, "expand");
              nb::gil_scoped_release release;
              out.resize(starts.shape(0) * s.core.slice_len());
              s.core.expand(starts.data(), starts.shape(0), out.data());
            }
            return to_numpy(std::move(out));
          },
          "starts"_a,
          "The record ids of each start's slice in position order (n * slice_len int64).\n"
          "Refuses an id that is not a valid start now.")
      .def(
          "expand_lengths",
          [](BoundSliceIndex& s, Vec<int64_t> starts) {
            if (starts.shape(0) > SIZE_MAX / sizeof(int64_t) / s.core.slice_len()) {
              throw TableError("SliceIndex.expand_lengths: " + std::to_string(starts.shape(0)) +
                               " slices of " + std::to_string(s.core.slice_len()) +
                               " steps do not fit in memory; expand fewer at a time");
            }
            std::vector<int64_t> out;
            std::vector<uint32_t> lengths;
            {
              Exclusive one(s, "expand_lengths");
              nb::gil_scoped_release release;
              out.resize(starts.shape(0) * s.core.slice_len());
              lengths.resize(starts.shape(0));
              s.core.expand(starts.data(), starts.shape(0), out.data(), lengths.data());
            }
            return nb::make_tuple(to_numpy(std::move(out)), to_numpy(std::move(lengths)));
          },
          "starts"_a,
          "As expand, and each slice's length (uint32): its real steps; a short slice\n"
          "(pad) repeats its last step up to slice_len.")
      .def(
          "position",
          [](BoundSliceIndex& s, Vec<int64_t> ids) {
            std::vector<uint32_t> out(ids.shape(0));
            {
              Exclusive one(s, "position");
              nb::gil_scoped_release release;
              s.core.positions(ids.data(), out.size(), out.data());
            }
            return to_numpy(std::move(out));
          },
          "ids"_a, "Each step's position in its episode (uint32); refuses an id not a step.")
      .def(
          "episode",
          [](BoundSliceIndex& s, Vec<int64_t> ids) {
            std::vector<uint64_t> out(ids.shape(0));
            {
              Exclusive one(s, "episode");
              nb::gil_scoped_release release;
              s.core.episodes(ids.data(), out.size(), out.data());
            }
            return to_numpy(std::move(out));
          },
          "ids"_a, "Each step's episode (uint64); refuses an id not a step.")
      .def(
          "probability",
          [](BoundSliceIndex& s, Vec<int64_t> ids) {
            std::vector<double> out(ids.shape(0));
            {
              Exclusive one(s, "probability");
              nb::gil_scoped_release release;
              s.core.probabilities(ids.data(), out.size(), out.data());
            }
            return to_numpy(std::move(out));
          },
          "ids"_a,
          "The probability that a draw returns each id now (0 for an id that is not a\n"
          "valid start).")
      .def(
          "memory_usage",
          [](BoundSliceIndex& s) {
            std::vector<std::pair<std::string, size_t>> bytes;
            {
              Exclusive one(s, "memory_usage");
              nb::gil_scoped_release release;
              bytes = s.core.resident_bytes();
            }
            nb::dict out;
            for (const auto& [name, n] : bytes) out[name.c_str()] = n;
            return out;
          },
          "Bytes of memory the index holds now, by structure (pages written at least\n"
          "once; the episodes' windows: what malloc gave them).");
}

void bind_tables(nb::module_& m) {
  m.attr("SELECTOR_KINDS") = kSelectorKinds;
  m.attr("NO_SAMPLER") = kNoSelector;
  bind_grants(m);
  bind_slice_index(m);
  m.def("lease_add", &lease_add, "counts"_a, "ids"_a, "counts[ids] += 1, duplicates counted.");
  m.def("lease_release", &lease_release, "counts"_a, "state"_a, "ids"_a, "retired"_a,
        "counts[ids] -= 1; the ids that reached 0 in state `retired`, once each.");
  nb::class_<SumTree>(m, "SumTree", "Sum tree over non-negative weights (O(log n)).")
      .def(nb::init<size_t>(), "capacity"_a)
      .def_prop_ro("capacity", &SumTree::capacity)
      .def_prop_ro("total", &SumTree::total)
      .def_prop_ro("min_positive", &SumTree::min_positive,
                   "The smallest positive weight (0 when none is positive).")
      .def(
          "set",
          [](SumTree& t, Vec<int64_t> idx, Vec<double> values) {
            same_length(idx, values, "SumTree.set");
            for (size_t i = 0; i < idx.shape(0); ++i) {
              if (idx(i) < 0 || static_cast<size_t>(idx(i)) >= t.capacity() ||
                  !(values(i) >= 0.0) || std::isinf(values(i))) {
                throw TableError(
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
                throw TableError("SumTree.get: index out of range");
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
          [](TableCore* self, int sampler, double sampler_alpha,
             int remover, double remover_alpha, uint64_t capacity,
             uint32_t max_times_sampled, uint64_t seed) {
            if (remover == kNoSelector) {
              throw TableError("TableCore: a remover must select (an index of "
                               "distore_ucx.selectors.KINDS), not NO_SAMPLER");
            }
            new (self) TableCore(selector_kind(sampler), sampler_alpha, selector_kind(remover),
                                 remover_alpha, capacity, max_times_sampled, seed);
          },
          "sampler"_a, "sampler_alpha"_a, "remover"_a, "remover_alpha"_a, "capacity"_a,
          "max_times_sampled"_a, "seed"_a,
          "`sampler` and `remover` are indices into distore_ucx.selectors.KINDS; sampler -1\n"
          "(NO_SAMPLER): none, for a table of slices (it draws from its SliceIndex).")
      .def_prop_ro("size", &TableCore::size)
      .def_prop_ro("capacity", &TableCore::capacity)
      .def_prop_ro("max_times_sampled", &TableCore::max_times_sampled)
      .def_prop_ro("remaining_uses", &TableCore::remaining_uses)
      .def_prop_ro("min_probability", &TableCore::min_probability,
                   "The smallest probability a draw can have now (0 when empty): "
                   "importance weights (P(i) / min)^-beta normalise by it.")
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
          "ids"_a, "Insertion sequence numbers (FIFO order) of live ids.")
      .def(
          "keys",
          [](const TableCore& t, Vec<int64_t> ids) {
            return per_live_id<uint64_t>(t, ids, "keys", [&](int64_t id) { return t.key(id); });
          },
          "ids"_a, "Keys of live ids.")
      .def(
          "record_keys",
          [](const TableCore& t, Vec<int64_t> ids) {
            std::vector<uint64_t> out(ids.shape(0));
            for (size_t i = 0; i < out.size(); ++i) out[i] = t.record_key(ids(i));
            return to_numpy(std::move(out));
          },
          "ids"_a,
          "The key last inserted under each id, whether or not it is still in the table "
          "(0 for an id never used): the keys of records evicted while leased.")
      .def(
          "locations",
          [](const TableCore& t,
             nb::ndarray<const uint64_t, nb::ndim<2>, nb::shape<-1, 3>, nb::c_contig,
                         nb::device::cpu> places,
             Vec<int64_t> ids) {
            // (node|pad, offset, generation) rows of the item store + this
            // core's key: protocol.ITEM_LOCATION records, 4 words each.
            const size_t rows = places.shape(0);
            for (size_t i = 0; i < ids.shape(0); ++i) {
              if (ids(i) < 0 || static_cast<size_t>(ids(i)) >= rows) {
                throw TableError("locations: record id " + std::to_string(ids(i)) +
                                 " is outside the item store (" + std::to_string(rows) +
                                 " records)");
              }
            }
            std::vector<uint64_t> out(4 * ids.shape(0));
            const uint64_t* p = places.data();
            // Random rows of a large table miss the caches: ask for all of
            // them first so the misses overlap.
            for (size_t i = 0; i < ids.shape(0); ++i) {
              __builtin_prefetch(p + 3 * static_cast<size_t>(ids(i)));
              __builtin_prefetch(p + 3 * static_cast<size_t>(ids(i)) + 2);
              t.prefetch_key(ids(i));
            }
            for (size_t i = 0; i < ids.shape(0); ++i) {
              const uint64_t* row = p + 3 * static_cast<size_t>(ids(i));
              out[4 * i] = row[0];
              out[4 * i + 1] = row[1];
              out[4 * i + 2] = row[2];
              out[4 * i + 3] = t.record_key(ids(i));
            }
            return to_numpy(std::move(out));
          },
          "places"_a, "ids"_a,
          "ITEM_LOCATION records (as uint64 words, 4 an item) of records `ids`: node, "
          "offset and generation from `places` (the item store's (n, 3) uint64 view), the "
          "key from this core.")
      .def(
          "memory_usage",
          [](const TableCore& t) {
            nb::dict out;
            for (const auto& [name, bytes] : t.resident_bytes()) out[name.c_str()] = bytes;
            return out;
          },
          "Bytes of memory the core holds now, by structure (pages written at least once).");
}

}  // namespace
}  // namespace distore

NB_MODULE(_tables, m) {
  using namespace distore;
  m.doc() = "distore-ucx table core: selectors, sum tree, lease counts, slice index (no UCX).";
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const TableError& e) {
      nb::object errors = nb::module_::import_("distore_ucx.errors");
      PyErr_SetString(errors.attr("TableCoreError").ptr(), e.what());
    }
  });
  bind_tables(m);
}
