// Bindings: native failures as Python exceptions (one translator), status names.
#include "bindings.h"

#include <ucp/api/ucp.h>

#include "checksum.h"

namespace distore {

void bind_status(nb::module_& m) {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const UcxError& e) {
      nb::object errors = nb::module_::import_("distore_ucx.errors");
      nb::object exc = errors.attr("from_native")(e.status(), status_name(e.status()),
                                                   std::string(e.what()), e.peer());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
    }
  });

  m.def("ucx_version", [] { return std::string(ucp_get_version_string()); },
        "Version of the UCX library actually loaded, e.g. '1.21.0'.");
  m.def("status_name", &status_name, "status"_a, "Name of a ucs_status_t value.");
  m.def(
      "crc32c",
      [](nb::bytes data, uint32_t crc) { return crc32c_update(crc, data.c_str(), data.size()); },
      "data"_a, "crc"_a = 0,
      "CRC-32C of `data`, continuing from `crc` (the one disk-tier slots and remote keys "
      "are sealed with).");
}

void bind_status_constants(nb::module_& m) {
  m.attr("STATUS_OUT_OF_BOUNDS") = kStatusOutOfBounds;
  m.attr("STATUS_BAD_ARGUMENT") = kStatusBadArgument;
  m.attr("STATUS_TORN") = kStatusTorn;
  m.attr("STATUS_STALE") = kStatusStale;
  m.attr("STATUS_NOT_MAPPED") = kStatusNotMapped;
  m.attr("STATUS_CORRUPT") = kStatusCorrupt;
  m.attr("STATUS_UNREACHABLE") = static_cast<int>(UCS_ERR_UNREACHABLE);
  m.attr("STATUS_BUSY") = static_cast<int>(UCS_ERR_BUSY);          // a node too busy to send
  m.attr("STATUS_REJECTED") = static_cast<int>(UCS_ERR_REJECTED);  // a node refused us
}

}  // namespace distore
