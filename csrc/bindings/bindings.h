// What the pybind11 module's parts share: each binds one layer (plan.cc the plan layer,
// communicator.cc the communicator and its transports, errors.cc the exceptions), and module.cc
// puts them together as pcie_allreduce._C.
#pragma once

#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "plan/protocol.h"

namespace pcie_ar::bindings {

namespace py = pybind11;

void bind_plan(py::module_& m);
void bind_communicator(py::module_& m);
// Translates comm::Failure into pcie_allreduce.PcieAllReduceTimeout and comm::Interrupted into
// the exception the interrupted wait's signal handler raised.
void bind_errors(py::module_& m);

// A diagnostic as Python sees it (PcieAllReduceTimeout.diagnostic, failure()).
py::dict diagnostic_dict(const plan::Diagnostic& d, const std::string& message);
// The host transport's interrupt check (comm::Communicator::set_interrupt_check): runs the
// interpreter's signal handlers; true when one raised (its exception is kept for the
// translator).
bool python_signal_raised();

// The value `name` names in `table`, or std::invalid_argument "<what> must be a, b or c, got 'x'"
// (ValueError in Python).
template <typename Table>
auto parse_or_throw(const Table& table, const std::string& name) {
  if (auto value = table.find(name)) return *value;
  throw std::invalid_argument(table.must_be(name));
}

// Every canonical name in `table`, in its order.
template <typename Table>
std::vector<std::string> names_of(const Table& table) {
  std::vector<std::string> names;
  for (const auto name : table.names()) names.emplace_back(name);
  return names;
}

}  // namespace pcie_ar::bindings
