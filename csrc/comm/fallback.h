// What a call the kernels do not run does instead, with the result its kernels would give: the
// group's own collective (NCCL on GPUs, gloo on CPUs, through c10d's functional ops: the
// communicator the engine already uses, traceable and safe under graph capture), and the fused
// call's add and norm in ATen, operation for operation as plan/epilogue.h orders them.
#pragma once

#include <ATen/Tensor.h>

#include <functional>
#include <string>

#include "comm/op.h"
#include "plan/epilogue.h"

namespace c10d {
class Work;
}  // namespace c10d

namespace pcie_ar::comm {

// The group a communicator falls back to, and how long its own collective may take.
struct Group {
  std::string name;  // the c10d group's registered name
  int world = 0;
  double timeout_s = 0;  // 0: forever
  // Asked between slices of a wait: true abandons it (Ctrl-C). May be empty.
  const std::function<bool()>* interrupted = nullptr;
};

enum class GroupWait { kDone, kTimedOut, kInterrupted };

// `op`'s collective (never its epilogue) over `group`, from `inp` into `out` (contiguous
// tensors; `out` may be `inp` for the all-reduce). CPU tensors: the group's work is awaited in
// slices of 20 ms, at most group.timeout_s, asking group.interrupted between slices; kTimedOut
// and kInterrupted leave the work pending in the group (the ranks are out of step: the caller
// fails). CUDA tensors: enqueued on the stream (NCCL's watchdog bounds it); kDone. Throws
// std::runtime_error when there is no group to fall back to, and whatever the collective itself
// raises.
GroupWait run_group_collective(Op op, const Group& group, const at::Tensor& inp,
                               const at::Tensor& out);

// How run_group_collective awaits a CPU group's work: slices of 20 ms, at most group.timeout_s,
// asking group.interrupted between them. kDone once the work has completed (its own failure is
// rethrown).
GroupWait await_bounded(c10d::Work& work, const Group& group);

// The fused epilogue's operands beside the sum and the outputs: residual (undefined: the forms
// without one), weight, and the quantised output's: its kind, scale (kFp8E4m3: the static scale;
// kNvfp4: the global scale G; one fp32 each, undefined for kNone) and, for kNvfp4, block_scale:
// the whole tensor of block scales, [round_up(rows, 128), round_up(hidden / 16, 4)] uint8 or
// float8_e4m3fn in plan/quant.h's swizzled layout, padding included (the fallback's call holds
// every row of the tensor: first_row 0, total_rows = rows).
struct EpilogueOperands {
  at::Tensor residual, weight, scale;
  double eps = 0.0;
  double weight_offset = 0.0;
  plan::Quant quant = plan::Quant::kNone;
  at::Tensor block_scale;
};

// plan/epilogue.h's epilogue, each row of sum.size(-1) elements, every fp32 step one IEEE
// operation in its order: residual_out = sum + residual (or the sum), y = rms_norm(residual_out)
// * (weight + weight_offset), out = y or its quantised form (plan/quant.h: kFp8E4m3's y_q is
// float8_e4m3fn shaped like y; kNvfp4's is uint8 [rows, hidden / 2], and its block scales go to
// e.block_scale). Given the same sum,
// the fused kernels' result bit for bit (NaN payloads aside), so a row does not change when a
// batch that holds it runs unfused. `out` may be `sum`, `residual_out` `e.residual` or `sum`.
void rms_norm_in_order(const at::Tensor& sum, const EpilogueOperands& e, const at::Tensor& out,
                       const at::Tensor& residual_out);

}  // namespace pcie_ar::comm
