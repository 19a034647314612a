// What a call the kernels do not run does instead, with the result its kernels would give: the
// group's own collective (NCCL on GPUs, gloo on CPUs, through c10d's functional ops: the
// communicator the engine already uses, traceable and safe under graph capture), and the fused
// call's add and norm in ATen, operation for operation as plan/epilogue.h orders them.
#pragma once

#include <ATen/Tensor.h>

#include <string>

#include "comm/op.h"

namespace pcie_ar::comm {

// `op`'s collective (never its epilogue) over the c10d group `group_name` of `world` ranks, from
// `inp` into `out` (contiguous tensors; `out` may be `inp` for the all-reduce). Throws
// std::runtime_error when there is no group to fall back to.
void run_group_collective(Op op, const std::string& group_name, int world, const at::Tensor& inp,
                          const at::Tensor& out);

// residual_out = sum + residual, out = rms_norm(residual_out) * weight, each row of
// sum.size(-1) elements, every fp32 step one IEEE operation in plan/epilogue.h's order: given the
// same sum, the fused kernels' result bit for bit (NaN payloads aside), so a row does not change
// when a batch that holds it runs unfused. `out` may be `sum` and `residual_out` `residual`.
void add_rms_norm_in_order(const at::Tensor& sum, const at::Tensor& residual,
                           const at::Tensor& weight, double eps, const at::Tensor& out,
                           const at::Tensor& residual_out);

}  // namespace pcie_ar::comm
