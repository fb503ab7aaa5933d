// What the binding files of _tables (the control plane's table core, built
// without UCX) share: the array type of batch arguments, vectors handed to
// numpy, the length check of paired arrays, and one bind_* function per
// concept (bind_tables.cc's module init calls them). A refused call throws
// TableError, raised in Python as distore_ucx.errors.TableCoreError.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <utility>
#include <vector>

#include "table_error.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace distore {

template <typename T>
using Vec = nb::ndarray<const T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

// A vector's data as a numpy array that owns it.
template <typename T>
nb::ndarray<nb::numpy, T, nb::ndim<1>> to_numpy(std::vector<T>&& v) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(heap->data(), {heap->size()}, owner);
}

template <typename A, typename B>
void same_length(const A& a, const B& b, const char* what) {
  if (a.shape(0) != b.shape(0)) {
    throw TableError(std::string(what) + ": arrays differ in length");
  }
}

void bind_grants(nb::module_& m);       // am_sign, am_connect_cap, am_item_tags, siphash24
void bind_slice_index(nb::module_& m);  // SliceIndex (a table of slices)
void bind_table_core(nb::module_& m);   // TableCore (a table's selection core)

}  // namespace distore
