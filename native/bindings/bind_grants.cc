// Bindings of _tables: the grants a node checks (am_grant.h): the control
// plane signs each item location of a sample reply for its node, and gives
// writers and learners the capability they connect with.
#include <cstdint>
#include <string>
#include <vector>

#include "am_grant.h"
#include "bind_tables.h"

namespace distore {

namespace {

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

}  // namespace

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

}  // namespace distore
