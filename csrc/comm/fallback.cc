#include "comm/fallback.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/reciprocal.h>
#include <ATen/ops/sqrt.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "plan/epilogue.h"

namespace pcie_ar::comm {
namespace {

c10::OperatorHandle c10d_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// The mean of squares of each row of `rf` (fp32, [..., hidden]) in plan/epilogue.h's order, as
// elementwise ATen ops (each one IEEE operation per element, on the CPU and the GPU alike; the
// divisor is a tensor, because ATen's CUDA division by a scalar multiplies by its reciprocal).
at::Tensor mean_of_squares_in_order(const at::Tensor& rf) {
  constexpr int64_t kQ = plan::kNormPartials;
  const int64_t hidden = rf.size(-1);
  const at::Tensor sq = rf.mul(rf);
  at::Tensor part = at::zeros_like(sq.narrow(-1, 0, std::min(hidden, kQ)));
  part = at::constant_pad_nd(part, {0, kQ - part.size(-1)});
  for (int64_t base = 0; base < hidden; base += kQ) {
    const int64_t n = std::min(kQ, hidden - base);
    part.narrow(-1, 0, n).add_(sq.narrow(-1, base, n));
  }
  for (int64_t h = kQ / 2; h >= 1; h /= 2) {
    part = part.narrow(-1, 0, h).add(part.narrow(-1, h, h));
  }
  return part.div(at::full_like(part, static_cast<double>(hidden)));
}

}  // namespace

// Work::wait(timeout) throws when a slice passes without completion, and rethrows a completed
// work's own failure. The work can complete between a slice's end and the catch: it is then asked
// again without a timeout, which returns at once, or rethrows the collective's own failure (a
// slice's "Operation timed out!" must never stand for a collective that succeeded).
GroupWait await_bounded(c10d::Work& work, const Group& group) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  for (;;) {
    try {
      work.wait(std::chrono::milliseconds(20));
      return GroupWait::kDone;
    } catch (const c10::Error&) {
      if (work.isCompleted()) {
        work.wait();
        return GroupWait::kDone;
      }
    }
    if (group.interrupted != nullptr && *group.interrupted && (*group.interrupted)()) {
      return GroupWait::kInterrupted;
    }
    const std::chrono::duration<double> waited = Clock::now() - start;
    if (group.timeout_s > 0 && waited.count() >= group.timeout_s) return GroupWait::kTimedOut;
  }
}

namespace {

// CPU tensors: the group's own work (gloo), awaited at most the timeout.
GroupWait run_host_collective(Op op, const Group& group, const at::Tensor& inp,
                              const at::Tensor& out) {
  const c10::intrusive_ptr<c10d::ProcessGroup> pg = c10d::resolve_process_group(group.name);
  at::Tensor in = inp;
  at::Tensor o = out;
  c10::intrusive_ptr<c10d::Work> work;
  switch (op.collective) {
    case plan::Collective::kAllReduce: {
      if (!o.is_same(in)) o.copy_(in);
      std::vector<at::Tensor> tensors{o};
      work = pg->allreduce(tensors);
      break;
    }
// _reduce_scatter_base and _allgather_base: the names every torch this package supports has
// (2.14 calls them deprecated aliases of reduce_scatter_single / all_gather_single, which 2.11
// lacks).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    case plan::Collective::kReduceScatter:
      work = pg->_reduce_scatter_base(o, in);
      break;
    case plan::Collective::kAllGather:
      work = pg->_allgather_base(o, in);
      break;
#pragma GCC diagnostic pop
  }
  return await_bounded(*work, group);
}

}  // namespace

GroupWait run_group_collective(Op op, const Group& group, const at::Tensor& inp,
                               const at::Tensor& out) {
  if (group.name.empty()) {
    throw std::runtime_error("pcie_allreduce has no process group to fall back to");
  }
  if (inp.is_cpu()) return run_host_collective(op, group, inp, out);
  const std::string& group_name = group.name;
  const int64_t world = group.world;
  static const c10::OperatorHandle all_reduce = c10d_op("_c10d_functional::all_reduce_");
  static const c10::OperatorHandle reduce_scatter =
      c10d_op("_c10d_functional::reduce_scatter_tensor");
  static const c10::OperatorHandle all_gather = c10d_op("_c10d_functional::all_gather_into_tensor");
  static const c10::OperatorHandle wait = c10d_op("_c10d_functional::wait_tensor");
  torch::jit::Stack stack;
  switch (op.collective) {
    case plan::Collective::kAllReduce:
      if (!out.is_same(inp)) out.copy_(inp);
      stack = {out, std::string("sum"), group_name};
      all_reduce.callBoxed(&stack);
      stack = {out};
      wait.callBoxed(&stack);
      return GroupWait::kDone;
    case plan::Collective::kReduceScatter:
      stack = {inp, std::string("sum"), world, group_name};
      reduce_scatter.callBoxed(&stack);
      break;
    case plan::Collective::kAllGather:
      stack = {inp, world, group_name};
      all_gather.callBoxed(&stack);
      break;
  }
  const at::Tensor result = stack.back().toTensor();
  stack = {result};
  wait.callBoxed(&stack);
  out.copy_(result.view(out.sizes()));
  return GroupWait::kDone;
}

void add_rms_norm_in_order(const at::Tensor& sum, const at::Tensor& residual,
                           const at::Tensor& weight, double eps, const at::Tensor& out,
                           const at::Tensor& residual_out) {
  const at::ScalarType dtype = sum.scalar_type();
  const at::Tensor r = sum.to(at::kFloat).add(residual.to(at::kFloat)).to(dtype);
  const at::Tensor rf = r.to(at::kFloat);
  const at::Tensor mean = mean_of_squares_in_order(rf);
  // The square root in fp64, rounded to fp32: exactly the IEEE fp32 square root (53 >= 2 * 24 + 2
  // bits, so the double rounding is exact), where ATen's vectorised fp32 sqrt on the CPU (Sleef)
  // is not correctly rounded for about a fifth of its inputs.
  const at::Tensor root =
      at::sqrt(mean.add(static_cast<float>(eps)).to(at::kDouble)).to(at::kFloat);
  const at::Tensor rstd = at::reciprocal(root);
  const at::Tensor y = rf.mul(rstd).mul(weight.to(at::kFloat)).to(dtype);
  residual_out.copy_(r);
  out.copy_(y);
}

}  // namespace pcie_ar::comm
