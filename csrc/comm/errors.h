// What a rank-level failure throws. The bindings translate Failure into
// pcie_allreduce.PcieAllReduceTimeout carrying the diagnostic, and Interrupted into the
// interpreter's own exception (KeyboardInterrupt for Ctrl-C).
#pragma once

#include <stdexcept>
#include <string>
#include <utility>

#include "plan/protocol.h"

namespace pcie_ar::comm {

// A peer never arrived or disagreed about the call.
class Failure : public std::runtime_error {
 public:
  Failure(const plan::Diagnostic& diagnostic, std::string message)
      : std::runtime_error(std::move(message)), diagnostic_(diagnostic) {}
  const plan::Diagnostic& diagnostic() const { return diagnostic_; }

 private:
  plan::Diagnostic diagnostic_;
};

// A call abandoned because the interrupt check said so (Ctrl-C): the communicator is failed
// (later calls raise Failure).
class Interrupted : public Failure {
 public:
  using Failure::Failure;
};

}  // namespace pcie_ar::comm
