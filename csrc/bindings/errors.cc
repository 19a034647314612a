// The exceptions Python sees: comm::Failure as pcie_allreduce.PcieAllReduceTimeout carrying its
// diagnostic, wherever it is thrown (a method of this module or inside a torch op), and
// comm::Interrupted as the exception the signal handler raised (KeyboardInterrupt for Ctrl-C).
#include "comm/errors.h"

#include <pybind11/pybind11.h>

#include <exception>

#include "bindings/bindings.h"

namespace pcie_ar::bindings {
namespace {

// The exception a signal handler raised inside a wait (KeyboardInterrupt for Ctrl-C), kept
// from the moment the wait asked until the call's C++ unwinding reaches the translator below.
// Raw references (a thread_local py::object would need the GIL at thread exit).
struct PendingSignal {
  PyObject* type = nullptr;
  PyObject* value = nullptr;
  PyObject* traceback = nullptr;
};
thread_local PendingSignal pending_signal;

// Py_IsFinalizing() is public from Python 3.13; before, the same function had a private name.
bool interpreter_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

void translate_failure(std::exception_ptr thrown) {
  try {
    if (thrown) std::rethrow_exception(thrown);
  } catch (const comm::Interrupted& e) {
    PendingSignal& p = pending_signal;
    if (p.type != nullptr) {
      PyErr_Restore(p.type, p.value, p.traceback);  // steals the references
      p = PendingSignal{};
    } else {
      PyErr_SetString(PyExc_KeyboardInterrupt, e.what());
    }
  } catch (const comm::Failure& e) {
    const py::object type =
        py::module_::import("pcie_allreduce.errors").attr("PcieAllReduceTimeout");
    const py::object error = type(e.what(), diagnostic_dict(e.diagnostic(), e.what()));
    PyErr_SetObject(type.ptr(), error.ptr());
  }
}

}  // namespace

py::dict diagnostic_dict(const plan::Diagnostic& d, const std::string& message) {
  py::dict out;
  out["kind"] = std::string(
      plan::kFailureKindNames.name_of(static_cast<plan::FailureKind>(d.kind), "unknown"));
  out["rank"] = d.rank;
  out["peer"] = d.peer == plan::kUnknownRank ? py::none() : py::object(py::int_(d.peer));
  out["step"] = d.step;
  out["stage"] = d.stage;
  out["block"] = d.block;
  out["flag"] = d.flag;
  out["flag_owner"] = d.flag_owner;
  out["generation_seen"] = d.gen_seen;
  out["generation_expected"] = d.gen_expected;
  out["numel"] = d.numel;
  out["peer_numel"] = d.peer_numel;
  out["signature"] = d.signature;
  out["peer_signature"] = d.peer_signature;
  out["message"] = message;
  return out;
}

// Python runs signal handlers on its main thread only, so elsewhere this costs a GIL round and
// answers false, as time.sleep() does between its slices.
bool python_signal_raised() {
  if (!Py_IsInitialized() || interpreter_finalizing()) return false;
  const py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  PendingSignal& p = pending_signal;
  Py_CLEAR(p.type);
  Py_CLEAR(p.value);
  Py_CLEAR(p.traceback);
  PyErr_Fetch(&p.type, &p.value, &p.traceback);
  return true;
}

void bind_errors(py::module_& /*m*/) { py::register_exception_translator(&translate_failure); }

}  // namespace pcie_ar::bindings
