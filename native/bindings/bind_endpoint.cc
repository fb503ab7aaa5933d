// Bindings: our own UCX endpoints (force-closable, so a hung peer cannot
// hold a gather), and the guard that keeps software RMA from writing arenas.
#include "bindings.h"

#include "endpoint.h"
#include "guard.h"

namespace distore {

void bind_endpoint(nb::module_& m) {
  nb::class_<Endpoint>(m, "Endpoint",
                       "A UCX endpoint made with the C API on a ucxx worker; force-closable.")
      .def(
          "__init__",
          [](Endpoint* self, nb::object worker, nb::bytes address, bool error_handling,
             std::string peer) {
            uintptr_t h = handle_of(worker, "worker");
            new (self) Endpoint(owner_of(std::move(worker)), h,
                                std::string(address.c_str(), address.size()), error_handling,
                                std::move(peer));
          },
          "worker"_a, "address"_a, "error_handling"_a, "peer"_a = "")
      .def_static(
          "to_listener",
          [](nb::object worker, const std::string& host, uint16_t port, std::string peer) {
            uintptr_t h = handle_of(worker, "worker");
            return new Endpoint(Endpoint::ToListener{}, owner_of(std::move(worker)), h, host,
                                port, std::move(peer));
          },
          "worker"_a, "host"_a, "port"_a, "peer"_a = "", nb::rv_policy::take_ownership,
          "An endpoint to the UCX listener at `host`:`port` (a storage node's insert\n"
          "listener), with peer-failure handling; connected in the background.")
      .def_prop_ro("handle", &Endpoint::handle)
      .def_prop_ro("alive", &Endpoint::alive, "False once failed or closed.")
      .def_prop_ro("status", &Endpoint::status)
      .def_prop_ro("error_handling", &Endpoint::error_handling)
      .def(
          "flush",
          [](Endpoint& self, double timeout) {
            nb::gil_scoped_release release;
            return self.flush(timeout);
          },
          "timeout"_a = 5.0,
          "Wait until everything posted on it has completed remotely (for an endpoint\n"
          "to a listener: the connection is made): 0, the ucs_status_t it failed with,\n"
          "or UCS_ERR_TIMED_OUT after `timeout` s.")
      .def(
          "close",
          [](Endpoint& self, bool force, double timeout) {
            nb::gil_scoped_release release;
            self.close(force, timeout);
          },
          "force"_a = false, "timeout"_a = 1.0,
          "Close once; `force` ends outstanding requests at once (error handling only).");

  m.def("refuse_remote_writes", &refuse_remote_writes,
        "Replace UCX's software PUT/atomic handlers in this process by ones that drop\n"
        "the message, and guard GETs; call before the worker exists. '' or why not.");
  m.def("allow_remote_reads", &allow_remote_reads, "base"_a, "size"_a,
        "Software GETs may read [base, base + size); others are dropped.");
  m.def("refused_remote_access",
        []() {
          nb::dict d;
          d["software_writes"] = refused_writes();
          d["reads"] = refused_reads();
          d["tcp_puts"] = refused_tcp_puts();
          d["tcp_puts_accepted"] = accepted_tcp_puts();
          d["last_tcp_put"] = last_refused_tcp_put();
          return d;
        },
        "What the guard refused so far: software puts and atomics dropped, reads outside\n"
        "the arena dropped, TCP connections ended for a put outside the insert windows\n"
        "(the last in words), and TCP puts accepted into those windows.");
  m.def("refuse_tcp_puts", &refuse_tcp_puts,
        "End this process's UCX TCP connections that carry a put outside the windows\n"
        "opened for receives; call before the worker exists. '' or why not.");
}

}  // namespace distore
