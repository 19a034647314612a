// The per-call admission: can the kernels run this op on these tensors? One function for every
// op. Every reason depends only on what all ranks agree on (numel, dtype, shape, max_numel, the
// enabled state), never on a tensor's layout, so every rank declines the same calls; kDevice,
// which a call raises instead, is the one exception.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <optional>

#include "comm/decline.h"
#include "comm/op.h"
#include "comm/options.h"
#include "plan/tactic.h"

namespace pcie_ar::comm {

// The communicator's side of admission.
struct Gate {
  const Options& options;
  std::optional<int> device;  // where tensors must live (-1: the CPU); nullopt: no workspace
  bool failed = false;        // an earlier call failed
  bool connected = false;     // every peer's workspace is mapped
};

// What a call is: why the kernels do not take it (kNone: they can), its dtype and the message
// the workspace carries (the all-gather's input is one chunk of it).
struct Admission {
  Decline decline = Decline::kNone;
  plan::DType dtype = plan::DType::kBF16;
  int64_t message = 0;  // elements

  int64_t bytes() const { return message * plan::dtype_bytes(dtype); }
};

// In this order: the communicator's state (disabled, failed), the dtype, the device, an empty
// input, a message that is not whole 16-byte vectors (a reduce-scatter's or all-gather's chunk
// per rank), one larger than the workspace, peers not yet connected; then, for the fused call, a
// weight of another dtype and a row that is not whole vectors or is too long (kHidden). Never
// throws. `weight` is the fused call's (may be null for other ops).
Admission admit(Op op, const at::Tensor& inp, const at::Tensor* weight, const Gate& gate);

}  // namespace pcie_ar::comm
