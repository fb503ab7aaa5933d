// A storage node's slot table calls (slot_table.h) on the numpy columns of
// storage/slots.py's SlotTable: an offset that is not a slot's, or columns
// too short for what they are asked, raise ValueError and change nothing.
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "slot_table.h"

namespace distore {
namespace {

template <typename T>
using Col = nb::ndarray<T, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
template <typename T>
using Out = nb::ndarray<nb::numpy, T, nb::ndim<1>>;

// A numpy array of n T, owned by Python, and its data to fill.
template <typename T>
std::pair<Out<T>, T*> new_array(size_t n) {
  auto* data = new T[n > 0 ? n : 1];
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return {Out<T>(data, {n}, owner), data};
}

void need(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("slot table: ") + what);
}

constexpr const char* kNotSlots = "offsets that are not slots of this table";

Out<int64_t> index(Vec<uint64_t> carved, size_t n, Vec<uint64_t> offsets) {
  need(n <= carved.shape(0), "more slots than the offset column holds");
  const size_t k = offsets.shape(0);
  auto [out, idx] = new_array<int64_t>(k);
  if (!slot_numbers(carved.data(), n, offsets.data(), k, idx)) {
    throw std::invalid_argument(kNotSlots);
  }
  return out;
}

Out<int64_t> commit(Vec<uint64_t> carved, size_t n, Col<uint8_t> state, Col<uint64_t> key,
                    Col<uint64_t> generation, Col<double> priority, Vec<uint64_t> offsets,
                    Vec<uint64_t> keys, Vec<uint64_t> generations, Vec<double> priorities) {
  const size_t k = offsets.shape(0);
  need(n <= carved.shape(0) && n <= state.shape(0) && n <= key.shape(0) &&
           n <= generation.shape(0) && n <= priority.shape(0),
       "more slots than a column holds");
  need(keys.shape(0) == k && generations.shape(0) == k && priorities.shape(0) == k,
       "keys, generations and priorities must have one value per offset");
  auto [out, idx] = new_array<int64_t>(k);
  if (!slot_numbers(carved.data(), n, offsets.data(), k, idx)) {
    throw std::invalid_argument(kNotSlots);
  }
  for (size_t i = 0; i < k; ++i) {
    const int64_t s = idx[i];
    state(s) = kSlotLive;
    key(s) = keys(i);
    generation(s) = generations(i);
    priority(s) = priorities(i);
  }
  return out;
}

void carve(Col<uint64_t> carved, Col<uint8_t> state, size_t n, uint64_t slot_size,
           Vec<uint64_t> offsets) {
  const size_t k = offsets.shape(0);
  need(n + k <= carved.shape(0) && n + k <= state.shape(0), "no room in the columns");
  if (!slot_carve(carved.data(), state.data(), n, slot_size, offsets.data(), k)) {
    throw std::invalid_argument("new slots must ascend, above every earlier slot of the table");
  }
}

Out<uint64_t> reuse(Vec<int64_t> free_stack, size_t nfree, size_t k, Col<uint8_t> state,
                    Vec<uint64_t> carved) {
  need(k <= nfree && nfree <= free_stack.shape(0), "more slots asked than the stack holds");
  const size_t n = std::min(state.shape(0), carved.shape(0));
  for (size_t i = nfree - k; i < nfree; ++i) {
    need(free_stack(i) >= 0 && static_cast<size_t>(free_stack(i)) < n,
         "a free slot number outside the columns");
  }
  auto [out, offsets] = new_array<uint64_t>(k);
  slot_reuse(free_stack.data(), nfree, k, state.data(), carved.data(), offsets);
  return out;
}

long release(Vec<uint64_t> carved, size_t n, Col<uint8_t> state, Vec<uint64_t> offsets,
             bool live_only, Col<int64_t> free_stack, size_t nfree) {
  const size_t k = offsets.shape(0);
  need(n <= carved.shape(0) && n <= state.shape(0), "more slots than a column holds");
  need(nfree + k <= free_stack.shape(0), "no room on the free stack");
  std::vector<int64_t> scratch(k);
  const long freed = slot_release(carved.data(), n, state.data(), offsets.data(), k, live_only,
                                  free_stack.data(), nfree, scratch.data());
  if (freed < 0) throw std::invalid_argument(kNotSlots);
  return freed;
}

}  // namespace

void bind_slots(nb::module_& m) {
  m.def("slot_index", &index, "carved"_a, "n"_a, "offsets"_a,
        "The numbers of the slots at `offsets` among the first n of `carved` (ascending); "
        "ValueError if one is not a slot's.");
  m.def("slot_commit", &commit, "carved"_a, "n"_a, "state"_a, "key"_a, "generation"_a,
        "priority"_a, "offsets"_a, "keys"_a, "generations"_a, "priorities"_a,
        "The slots at `offsets` made LIVE holding keys, generations and priorities; "
        "returns their numbers (ValueError, nothing changed, if one is not a slot's).");
  m.def("slot_carve", &carve, "carved"_a, "state"_a, "n"_a, "slot_size"_a, "offsets"_a,
        "Freshly carved slots (ascending, above slot n-1's end) recorded as slots n.., "
        "ALLOCATED; ValueError, nothing changed, otherwise.");
  m.def("slot_reuse", &reuse, "free_stack"_a, "nfree"_a, "k"_a, "state"_a, "carved"_a,
        "The top k of the free stack made ALLOCATED; their offsets, in stack order.");
  m.def("slot_release", &release, "carved"_a, "n"_a, "state"_a, "offsets"_a, "live_only"_a,
        "free_stack"_a, "nfree"_a,
        "The slots at `offsets` not FREE (LIVE only, with live_only) made FREE and pushed "
        "once each, ascending, on the free stack above nfree; returns how many.");
}

}  // namespace distore
