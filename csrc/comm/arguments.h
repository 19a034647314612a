// The tensors of one call and the checks every call makes of them before any rank talks: bad
// arguments raise on the rank that passed them, before any communication, for every op alike.
#pragma once

#include <ATen/Tensor.h>

#include <optional>
#include <string>
#include <vector>

#include "comm/op.h"

namespace pcie_ar::comm {

// The tensors of one call. inp and out for every op (out may be inp: in place; an undefined out
// is allocated by the call); the fused calls also read weight (and residual, in the forms that
// add one) and write residual_out (which may be residual: in place; undefined: allocated; in the
// forms without a residual, the sum). A quantised form's out is y_q (FP8: float8_e4m3fn shaped
// like x; NVFP4: uint8 [..., hidden / 2], two e2m1 codes a byte) and reads the fp32 scale.
struct OpArgs {
  const at::Tensor& inp;
  at::Tensor& out;
  const at::Tensor* residual = nullptr;
  const at::Tensor* weight = nullptr;
  at::Tensor* residual_out = nullptr;
  double eps = 0.0;
  double weight_offset = 0.0;  // plan::EpilogueArgs::weight_offset (Gemma: 1)
  const at::Tensor* scale = nullptr;
  // NVFP4's block scales (written; undefined: allocated): float8_e4m3fn [round_up(rows, 128),
  // round_up(hidden / 16, 4)] in vLLM's swizzled layout (plan/quant.h).
  at::Tensor* block_scale = nullptr;
};

// Raises std::invalid_argument (or std::runtime_error for the autograd rules torch's own in-place
// and out= ops enforce) when `args` cannot be a call of `op` on this communicator: any operand on
// another device than `device` (-1: the CPU; nullopt: no workspace, so the input's) or on meta; an
// input dtype the group's own collective cannot take (gloo for CPU tensors, NCCL for CUDA ones:
// the fallback of every call the kernels decline); outputs of the wrong dtype or shape, outputs
// that overlap any operand other than the one they may be in place of (the fused call's weight
// included), or that overlap themselves (an expand); a reduce-scatter input whose dim 0 is not a
// multiple of `world`. An undefined output (one the call allocates) is not checked. The message
// names the op, the argument, what was passed and what was expected. Every rank passes the same
// dtypes and shapes, so every rank refuses alike, before any communication.
void check_args(Op op, const OpArgs& args, int world, std::optional<int> device);

// The operand a form that writes given tensors reads and autograd tracks ("the input", "residual"
// or "weight"; one it writes in place does not count), or null. With grad mode on, check_args
// refuses such a call and try_run declines it (Decline::kAutograd).
const char* tracked_read(Op op, const OpArgs& args);

// Where the kernels can address a tensor directly: one dense, 16-byte aligned run of elements.
// Anything else is staged through a contiguous copy (the path never depends on a tensor's
// layout).
bool executor_ready(const at::Tensor& t);

// NVFP4's block scales for x: [round_up(rows, 128), round_up(hidden / 16, 4)] (plan/quant.h).
std::vector<int64_t> nvfp4_scale_sizes(const at::Tensor& x);

// "Float [32, 32] on cpu", for messages.
std::string describe(const at::Tensor& t);

}  // namespace pcie_ar::comm
