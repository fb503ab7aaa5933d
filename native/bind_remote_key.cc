// Bindings: a peer's remote key (RemoteKey).
#include "bindings.h"

#include "remote_key.h"

namespace distore {

void bind_remote_key(nb::module_& m) {
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
}

}  // namespace distore
