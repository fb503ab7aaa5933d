// The error of the control plane's table core (selectors, sum tree, lease
// counts): a call it refuses, such as an id outside the table or an unknown
// selector kind. Not a UCX failure: the _tables module (bindings/
// bind_tables.cc) raises it in Python as distore_ucx.errors.TableCoreError.
#pragma once

#include <stdexcept>
#include <string>

namespace distore {

class TableError : public std::invalid_argument {
 public:
  explicit TableError(const std::string& message) : std::invalid_argument(message) {}
};

}  // namespace distore
