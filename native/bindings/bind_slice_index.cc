// Bindings of _tables: the slice index (slice_index.h) of a table of
// slices, behind a guard against two threads inside it at once.
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "bind_tables.h"
#include "slice_index.h"

namespace distore {

namespace {

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

using SliceIndexClass = nb::class_<BoundSliceIndex>;

// Adding and removing steps, and setting their priorities.
void bind_slice_index_updates(SliceIndexClass& cls) {
  cls.def(
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
      "batch (an id or an (episode, position) present already) adds nothing.");
  cls.def(
      "remove",
      [](BoundSliceIndex& s, Vec<int64_t> ids) {
        Exclusive one(s, "remove");
        nb::gil_scoped_release release;
        return s.core.remove(ids.data(), ids.shape(0));
      },
      "ids"_a, "Remove steps by id (unknown ids skipped); returns how many were steps.");
  cls.def(
      "set_priorities",
      [](BoundSliceIndex& s, Vec<int64_t> ids, Vec<double> priorities) {
        same_length(ids, priorities, "SliceIndex.set_priorities", "ids", "priorities");
        Exclusive one(s, "set_priorities");
        nb::gil_scoped_release release;
        return s.core.set_priorities(ids.data(), priorities.data(), ids.shape(0));
      },
      "ids"_a, "priorities"_a,
      "Set steps' priorities (a slice's priority is its start step's); unknown ids\n"
      "skipped. Returns how many ids were steps.");
}

// Drawing slice starts and expanding them into their steps.
void bind_slice_index_draws(SliceIndexClass& cls) {
  cls.def(
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
      "empty when no start is valid (wait for steps; not an error).");
  cls.def(
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
      "Refuses an id that is not a valid start now.");
  cls.def(
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
      "(pad) repeats its last step up to slice_len.");
}

// Steps' positions, episodes and probabilities, and the index's memory.
void bind_slice_index_reads(SliceIndexClass& cls) {
  cls.def(
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
      "ids"_a, "Each step's position in its episode (uint32); refuses an id not a step.");
  cls.def(
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
      "ids"_a, "Each step's episode (uint64); refuses an id not a step.");
  cls.def(
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
      "valid start).");
  cls.def(
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

}  // namespace

void bind_slice_index(nb::module_& m) {
  SliceIndexClass cls(
      m, "SliceIndex",
      "The episodes of a table's steps and its valid slice starts (slice_index.h): a start\n"
      "is a step at a position p with p % period == 0 whose slice_len - 1 successors in\n"
      "its episode are present. Draws starts uniformly or by priority^alpha of the start\n"
      "step. Steps are record ids < 2^32 - 1. Batch operations only; one caller thread.\n"
      "pad 1: also starts whose run of steps ends at their episode's last step before\n"
      "slice_len; pad 2: only such starts at position 0 (episodes shorter than slice_len).");
  cls.def(nb::init<int64_t, int64_t, bool, double, uint64_t, int>(), "slice_len"_a,
          "period"_a = 1, "prioritized"_a = false, "alpha"_a = 1.0, "seed"_a = 0, "pad"_a = 0);
  cls.def_prop_ro("slice_len", [](const BoundSliceIndex& s) { return s.core.slice_len(); });
  cls.def_prop_ro("period", [](const BoundSliceIndex& s) { return s.core.period(); });
  cls.def_prop_ro("pad", [](const BoundSliceIndex& s) { return static_cast<int>(s.core.pad()); });
  cls.def_prop_ro("prioritized", [](const BoundSliceIndex& s) { return s.core.prioritized(); });
  cls.def_prop_ro("valid_starts", [](const BoundSliceIndex& s) { return s.core.valid_starts(); },
                  "How many steps are valid starts now.");
  cls.def_prop_ro("steps", [](const BoundSliceIndex& s) { return s.core.steps(); });
  cls.def_prop_ro("episodes", [](const BoundSliceIndex& s) { return s.core.episode_count(); },
                  "Episodes that hold at least one step.");
  cls.def_prop_ro("min_probability",
                  [](const BoundSliceIndex& s) { return s.core.min_probability(); },
                  "The smallest probability a draw can have now (0 with no valid start): "
                  "importance weights (P(i) / min)^-beta normalise by it.");
  bind_slice_index_updates(cls);
  bind_slice_index_draws(cls);
  bind_slice_index_reads(cls);
}

}  // namespace distore
