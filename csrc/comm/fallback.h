// What a call the kernels do not run does instead, with the result its kernels would give: the
// group's own collective (NCCL on GPUs, gloo on CPUs, through c10d's functional ops: the
// communicator the engine already uses, traceable and safe under graph capture), and the fused
// call's add and norm in ATen, operation for operation as plan/epilogue.h orders them.
#pragma once

#include <ATen/Tensor.h>

#include <functional>
#include <string>

#include "comm/op.h"

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

// residual_out = sum + residual, out = rms_norm(residual_out) * weight, each row of
// sum.size(-1) elements, every fp32 step one IEEE operation in plan/epilogue.h's order: given the
// same sum, the fused kernels' result bit for bit (NaN payloads aside), so a row does not change
// when a batch that holds it runs unfused. `out` may be `sum` and `residual_out` `residual`.
void add_rms_norm_in_order(const at::Tensor& sum, const at::Tensor& residual,
                           const at::Tensor& weight, double eps, const at::Tensor& out,
                           const at::Tensor& residual_out);

}  // namespace pcie_ar::comm
