// pcie_allreduce._C: the pybind11 module (torch's bundled pybind11, so the ABI matches torch's
// own bindings). The communicator for the Python layer; the plan layer (schedules, verifier,
// topology, tuning table, cost model) for the CLI and the tests.
#include <pybind11/pybind11.h>

#include "bindings/bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "pcie_allreduce native module: the communicator and the plan layer";
  pcie_ar::bindings::bind_plan(m);
  pcie_ar::bindings::bind_communicator(m);
  pcie_ar::bindings::bind_errors(m);
}
