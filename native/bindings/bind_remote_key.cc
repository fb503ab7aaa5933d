// Bindings: a peer's remote key (RemoteKey).
#include "bindings.h"

#include "endpoint.h"
#include "remote_key.h"

namespace distore {

void bind_remote_key(nb::module_& m) {
  nb::class_<RemoteKey>(m, "RemoteKey", "A peer's remote key unpacked on one endpoint.")
      .def(
          "__init__",
          [](RemoteKey* self, nb::object endpoint, nb::bytes packed, uint64_t base,
             uint64_t size, std::string peer, int64_t pid) {
            if (pid < 0 || pid > INT32_MAX) throw UcxError(kStatusBadArgument, "bad pid", peer);
            uintptr_t h = (pid > 0 && endpoint.is_none()) ? 0 : handle_of(endpoint, "endpoint");
            Endpoint* ours = nullptr;  // stays null unless `endpoint` is one of ours
            if (!endpoint.is_none()) nb::try_cast<Endpoint*>(endpoint, ours);
            new (self) RemoteKey(owner_of(std::move(endpoint)), h, ours,
                                 std::string_view(packed.c_str(), packed.size()), base, size,
                                 std::move(peer), static_cast<pid_t>(pid));
          },
          "endpoint"_a.none(), "packed"_a, "remote_base"_a, "remote_size"_a, "peer"_a = "",
          "pid"_a = 0,
          "`pid` > 0 (a same-host peer): reads use process_vm_readv, `endpoint` may be None.")
      .def_prop_ro("pid", [](const RemoteKey& k) { return static_cast<int64_t>(k.pid()); })
      .def_prop_ro("remote_base", &RemoteKey::remote_base)
      .def_prop_ro("remote_size", &RemoteKey::remote_size)
      .def_prop_ro("peer", &RemoteKey::peer);
}

}  // namespace distore
