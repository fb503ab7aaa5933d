// Bindings of _tables: a table's selection core (table_core.h): inserts,
// draws, priorities, and what the control plane reads of its items.
#include <cstdint>
#include <string>
#include <vector>

#include "bind_tables.h"
#include "table_core.h"

namespace distore {

namespace {

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

using TableCoreClass = nb::class_<TableCore>;

// Inserting, restoring, drawing, reprioritising and removing items.
void bind_table_core_updates(TableCoreClass& cls) {
  cls.def(
      "insert",
      [](TableCore& t, Vec<int64_t> ids, Vec<uint64_t> keys, Vec<double> prios) {
        same_length(ids, keys, "insert");
        same_length(ids, prios, "insert");
        std::vector<int64_t> evicted;
        t.insert(ids.data(), keys.data(), prios.data(), ids.shape(0), &evicted);
        return to_numpy(std::move(evicted));
      },
      "ids"_a, "keys"_a, "priorities"_a, "Insert a batch; returns the evicted ids.");
  cls.def(
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
      "the evicted ids.");
  cls.def_prop_ro("next_seq", &TableCore::next_seq,
                  "Insertion sequence number of the next inserted item.");
  cls.def(
      "raise_next_seq",
      [](TableCore& t, uint64_t seq) { t.raise_next_seq(seq); },
      "seq"_a, "Sequence later inserts after `seq` (never lowers it).");
  cls.def(
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
      "n"_a, "Draw n items: (ids, probabilities, ids that reached max_times_sampled).");
  cls.def(
      "update_priorities",
      [](TableCore& t, Vec<uint64_t> keys, Vec<double> prios) {
        same_length(keys, prios, "update_priorities");
        return t.update_priorities(keys.data(), prios.data(), keys.shape(0));
      },
      "keys"_a, "priorities"_a, "Set priorities by key; returns how many keys were found.");
  cls.def(
      "remove",
      [](TableCore& t, Vec<int64_t> ids) { return t.remove(ids.data(), ids.shape(0)); },
      "ids"_a, "Remove items by id; returns how many were in the table.");
}

// Items' ids, probabilities, priorities, use counts, sequences and keys.
void bind_table_core_reads(TableCoreClass& cls) {
  cls.def(
      "lookup",
      [](const TableCore& t, Vec<uint64_t> keys) {
        std::vector<int64_t> ids(keys.shape(0));
        t.lookup(keys.data(), ids.size(), ids.data());
        return to_numpy(std::move(ids));
      },
      "keys"_a, "Ids of items by key (-1 when not in the table).");
  cls.def(
      "probabilities",
      [](const TableCore& t, Vec<int64_t> ids) {
        return per_live_id<double>(t, ids, "probabilities",
                                   [&](int64_t id) { return t.probability(id); });
      },
      "ids"_a, "The probability that the next draw returns each (live) id.");
  cls.def(
      "priorities",
      [](const TableCore& t, Vec<int64_t> ids) {
        return per_live_id<double>(t, ids, "priorities",
                                   [&](int64_t id) { return t.priority(id); });
      },
      "ids"_a, "Priorities of live ids.");
  cls.def(
      "times_sampled",
      [](const TableCore& t, Vec<int64_t> ids) {
        return per_live_id<uint32_t>(t, ids, "times_sampled",
                                     [&](int64_t id) { return t.times_sampled(id); });
      },
      "ids"_a, "How often each live id was sampled.");
  cls.def(
      "sequences",
      [](const TableCore& t, Vec<int64_t> ids) {
        return per_live_id<uint64_t>(t, ids, "sequences",
                                     [&](int64_t id) { return t.sequence(id); });
      },
      "ids"_a, "Insertion sequence numbers (FIFO order) of live ids.");
  cls.def(
      "keys",
      [](const TableCore& t, Vec<int64_t> ids) {
        return per_live_id<uint64_t>(t, ids, "keys", [&](int64_t id) { return t.key(id); });
      },
      "ids"_a, "Keys of live ids.");
  cls.def(
      "record_keys",
      [](const TableCore& t, Vec<int64_t> ids) {
        std::vector<uint64_t> out(ids.shape(0));
        for (size_t i = 0; i < out.size(); ++i) out[i] = t.record_key(ids(i));
        return to_numpy(std::move(out));
      },
      "ids"_a,
      "The key last inserted under each id, whether or not it is still in the table "
      "(0 for an id never used): the keys of records evicted while leased.");
}

// Sample replies' item locations, and the core's memory.
void bind_table_core_locations(TableCoreClass& cls) {
  cls.def(
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
      "key from this core.");
  cls.def(
      "memory_usage",
      [](const TableCore& t) {
        nb::dict out;
        for (const auto& [name, bytes] : t.resident_bytes()) out[name.c_str()] = bytes;
        return out;
      },
      "Bytes of memory the core holds now, by structure (pages written at least once).");
}

}  // namespace

void bind_table_core(nb::module_& m) {
  TableCoreClass cls(m, "TableCore",
                     "Reverb-style selection core of a table: sampler, remover, "
                     "max_times_sampled, priorities. Batch operations only.");
  cls.def(
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
      "(NO_SAMPLER): none, for a table of slices (it draws from its SliceIndex).");
  cls.def_prop_ro("size", &TableCore::size);
  cls.def_prop_ro("capacity", &TableCore::capacity);
  cls.def_prop_ro("max_times_sampled", &TableCore::max_times_sampled);
  cls.def_prop_ro("remaining_uses", &TableCore::remaining_uses);
  cls.def_prop_ro("min_probability", &TableCore::min_probability,
                  "The smallest probability a draw can have now (0 when empty): "
                  "importance weights (P(i) / min)^-beta normalise by it.");
  bind_table_core_updates(cls);
  bind_table_core_reads(cls);
  bind_table_core_locations(cls);
}

}  // namespace distore
