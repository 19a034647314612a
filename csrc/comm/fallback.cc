#include "comm/fallback.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/bitwise_and.h>
#include <ATen/ops/bitwise_left_shift.h>
#include <ATen/ops/bitwise_or.h>
#include <ATen/ops/bitwise_right_shift.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/nan_to_num.h>
#include <ATen/ops/reciprocal.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/signbit.h>
#include <ATen/ops/sqrt.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros_like.h>

#include <algorithm>
#include <chrono>
#include <limits>
#include <stdexcept>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "plan/epilogue.h"
#include "plan/quant.h"

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

// NVFP4 (plan/quant.h) of the rounded y ([..., hidden], bf16 or fp16) into out (uint8
// [rows, hidden / 2]) and e.block_scale (the whole swizzled tensor, padding zeroed), in
// elementwise ATen ops that are one IEEE operation per element on the CPU and the GPU alike, the
// blocks' max (exact in any order) and integer index arithmetic: the host executor's bytes.
void nvfp4_quant_in_order(const at::Tensor& y, const EpilogueOperands& e, const at::Tensor& out) {
  constexpr int64_t kB = plan::kNvfp4Block;
  const int64_t hidden = y.size(-1);
  TORCH_CHECK(hidden % kB == 0, "pcie_allreduce: NVFP4 needs hidden % 16 == 0, got ", hidden);
  TORCH_CHECK(e.scale.defined() && e.scale.numel() == 1,
              "pcie_allreduce: NVFP4 output needs a global scale of one element");
  TORCH_CHECK(e.block_scale.defined(), "pcie_allreduce: NVFP4 output without block scales");
  const int64_t rows = hidden == 0 ? 0 : y.numel() / hidden;
  const int64_t blocks = hidden / kB;
  const int64_t k_tiles = plan::nvfp4_k_tiles(hidden);
  TORCH_CHECK(e.block_scale.numel() == plan::nvfp4_padded_rows(rows) * 4 * k_tiles &&
                  e.block_scale.element_size() == 1,
              "pcie_allreduce: NVFP4 block scales must be ", plan::nvfp4_padded_rows(rows), " x ",
              4 * k_tiles, " bytes, got ", e.block_scale.sizes(), " ", e.block_scale.dtype());
  TORCH_CHECK(out.scalar_type() == at::kByte && out.numel() * 2 == y.numel(),
              "pcie_allreduce: NVFP4 y_q must be uint8 [rows, hidden / 2]");
  const at::Tensor v = y.to(at::kFloat).reshape({rows, blocks, kB});
  const at::Tensor g = e.scale.to(at::kFloat).reshape({});
  const at::Tensor inv_g = at::reciprocal(g);
  // amax of |y| over each block, NaN ignored (NaN made -1, below every magnitude), and NaN only
  // when all 16 are NaN.
  const at::Tensor magnitude = v.abs();
  at::Tensor amax = magnitude.masked_fill(magnitude.isnan(), -1.0).amax(-1);
  amax = amax.masked_fill(amax.lt(0), std::numeric_limits<double>::quiet_NaN());
  // SF = G * (amax * RN(1 / 6)); its e4m3 byte rounds to nearest even and saturates at 448:
  // ATen's conversion makes anything from 464 on NaN, so the clamp comes first (a NaN SF stays
  // NaN, and so does its byte, 0x7F).
  const at::Tensor rcp6 = at::scalar_tensor(0.16666667163372040, v.options());
  const at::Tensor sf = g.mul(amax.mul(rcp6));
  const double max = plan::kFp8E4m3Max;
  const at::Tensor sf_fp8 = at::clamp(sf, -max, max).to(at::kFloat8_e4m3fn);
  const at::Tensor sf_value = sf_fp8.to(at::kFloat);
  // out_scale = sf != 0 ? 1 / (sf * (1 / G)) : 0 (a NaN sf gives NaN).
  const at::Tensor out_scale =
      at::where(sf_value.ne(0), at::reciprocal(sf_value.mul(inv_g)), at::zeros_like(sf_value));
  // e2m1 of y * out_scale, round to nearest even on {0, 0.5, 1, 1.5, 2, 3, 4, 6} and saturating:
  // the code is the number of decision points the magnitude passes (ties to the even code), the
  // sign bit 3; a NaN gives 0x7.
  const at::Tensor q = v.mul(out_scale.unsqueeze(-1));
  const at::Tensor a = q.abs();
  at::Tensor code = a.gt(0.25).to(at::kByte);
  code = code.add(a.ge(0.75).to(at::kByte));
  code = code.add(a.gt(1.25).to(at::kByte));
  code = code.add(a.ge(1.75).to(at::kByte));
  code = code.add(a.gt(2.5).to(at::kByte));
  code = code.add(a.ge(3.5).to(at::kByte));
  code = code.add(a.gt(5.0).to(at::kByte));
  code = at::bitwise_or(code, at::bitwise_left_shift(at::signbit(q).to(at::kByte), 3));
  code = code.masked_fill(q.isnan(), 0x7);
  // Two codes a byte: the even element in the low nibble.
  const at::Tensor pairs = code.reshape({rows, hidden / 2, 2});
  const at::Tensor packed =
      at::bitwise_or(pairs.select(-1, 0), at::bitwise_left_shift(pairs.select(-1, 1), 4));
  out.copy_(packed.reshape(out.sizes()));
  // The block scales in the swizzled layout (plan::nvfp4_scale_offset, in shifts and masks of the
  // non-negative indices), every other byte (padding rows and columns) zero.
  const at::TensorOptions index = v.options().dtype(at::kLong);
  const at::Tensor r = at::arange(rows, index).unsqueeze(1);
  const at::Tensor c = at::arange(blocks, index).unsqueeze(0);
  const at::Tensor offset = at::bitwise_right_shift(r, 7)
                                .mul(k_tiles)
                                .add(at::bitwise_right_shift(c, 2))
                                .mul(512)
                                .add(at::bitwise_and(r, 31).mul(16))
                                .add(at::bitwise_and(at::bitwise_right_shift(r, 5), 3).mul(4))
                                .add(at::bitwise_and(c, 3));
  const bool direct = e.block_scale.is_contiguous();
  at::Tensor flat = (direct ? e.block_scale : e.block_scale.contiguous()).view(at::kByte).view(-1);
  flat.zero_();
  flat.index_copy_(0, offset.reshape(-1), sf_fp8.view(at::kByte).reshape(-1));
  if (!direct) e.block_scale.view(at::kByte).copy_(flat.view(e.block_scale.sizes()));
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

void rms_norm_in_order(const at::Tensor& sum, const EpilogueOperands& e, const at::Tensor& out,
                       const at::Tensor& residual_out) {
  const at::ScalarType dtype = sum.scalar_type();
  const at::Tensor r =
      e.residual.defined() ? sum.to(at::kFloat).add(e.residual.to(at::kFloat)).to(dtype) : sum;
  const at::Tensor rf = r.to(at::kFloat);
  const at::Tensor mean = mean_of_squares_in_order(rf);
  // The square root in fp64, rounded to fp32: exactly the IEEE fp32 square root (53 >= 2 * 24 + 2
  // bits, so the double rounding is exact), where ATen's vectorised fp32 sqrt on the CPU (Sleef)
  // is not correctly rounded for about a fifth of its inputs.
  const at::Tensor root =
      at::sqrt(mean.add(static_cast<float>(e.eps)).to(at::kDouble)).to(at::kFloat);
  const at::Tensor rstd = at::reciprocal(root);
  at::Tensor w = e.weight.to(at::kFloat);
  if (e.weight_offset != 0.0) w = w.add(static_cast<float>(e.weight_offset));
  const at::Tensor y = rf.mul(rstd).mul(w).to(dtype);
  if (!r.is_same(residual_out)) residual_out.copy_(r);
  switch (e.quant) {
    case plan::Quant::kNone:
      out.copy_(y);
      return;
    case plan::Quant::kFp8E4m3: {
      // vLLM's static FP8 quantisation of the rounded y (plan/quant.h): times the IEEE reciprocal
      // of the scale, then fminf(v, 448) and fmaxf(v, -448), which make a NaN +448 (nan_to_num,
      // then the clamp), then float8_e4m3fn rounded to nearest even.
      TORCH_CHECK(e.scale.defined(), "pcie_allreduce: FP8 output without a scale");
      const at::Tensor inv = at::reciprocal(e.scale.to(at::kFloat).reshape({}));
      const double max = plan::kFp8E4m3Max;
      out.copy_(at::clamp(at::nan_to_num(y.to(at::kFloat).mul(inv), max, max, -max), -max, max)
                    .to(at::kFloat8_e4m3fn));
      return;
    }
    case plan::Quant::kNvfp4:
      nvfp4_quant_in_order(y, e, out);
      return;
  }
}

}  // namespace pcie_ar::comm
