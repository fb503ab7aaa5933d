// The _tables extension module: the control plane's table core (selectors,
// sum tree, lease counts, the slice index, grants), built without UCX so that
// the control plane never loads libucx for its tables; one bind_*.cc per
// concept (bind_tables.h). A refused call (TableError) is raised as
// distore_ucx.errors.TableCoreError.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "bind_tables.h"
#include "sum_tree.h"
#include "table_core.h"

namespace distore {
namespace {

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

void bind_sum_tree(nb::module_& m) {
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
}

void bind_tables(nb::module_& m) {
  m.attr("SELECTOR_KINDS") = kSelectorKinds;
  m.attr("NO_SAMPLER") = kNoSelector;
  bind_grants(m);
  bind_slice_index(m);
  m.def("lease_add", &lease_add, "counts"_a, "ids"_a, "counts[ids] += 1, duplicates counted.");
  m.def("lease_release", &lease_release, "counts"_a, "state"_a, "ids"_a, "retired"_a,
        "counts[ids] -= 1; the ids that reached 0 in state `retired`, once each.");
  bind_sum_tree(m);
  bind_table_core(m);
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
