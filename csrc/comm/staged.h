// The tensors a call's executors (or its fallback) address: Communicator::Staged, shared by the
// call path (communicator.cc) and the kernels' calls (kernel_calls.cc).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include "comm/arguments.h"
#include "comm/communicator.h"

namespace pcie_ar::comm {

// Each of the call's own tensors, or a contiguous copy where its layout would not do. A tensor's
// own layout never changes the path.
struct Communicator::Staged {
  at::Tensor inp, out, residual, weight, residual_out, scale, block_scale;
  // Where the all-reduce leaves the sum of a fused call: out, which y then overwrites (the plain
  // forms with a residual); residual_out (the forms without one: the sum is that output; and a
  // quantised form with one, whose out is y_q and whose y is never stored: residual_out =
  // sum + residual is formed in place, element by element, on every path); or, where that
  // residual_out is the residual itself (in place), a scratch tensor.
  at::Tensor sum;
  double eps = 0.0;
  double weight_offset = 0.0;
  bool any = false;

  Staged(Op op, const OpArgs& a) : eps(a.eps), weight_offset(a.weight_offset) {
    const auto input = [this](const at::Tensor& t) {
      if (executor_ready(t)) return t;
      any = true;
      return t.clone(at::MemoryFormat::Contiguous);
    };
    const auto output = [this](const at::Tensor& t, const at::Tensor* in_place_of,
                               const at::Tensor& staged_input) {
      if (in_place_of != nullptr && t.is_same(*in_place_of)) return staged_input;
      if (executor_ready(t)) return t;
      any = true;
      return at::empty(t.sizes(), t.options());
    };
    inp = input(a.inp);
    out = output(a.out, &a.inp, inp);
    sum = out;
    if (has_epilogue(op)) {
      weight = input(*a.weight);
      if (has_residual(op)) {
        residual = input(*a.residual);
        residual_out = output(*a.residual_out, a.residual, residual);
        if (is_quantised(op)) {
          sum =
              residual_out.is_same(residual) ? at::empty(inp.sizes(), inp.options()) : residual_out;
        }
      } else {
        residual_out = output(*a.residual_out, nullptr, inp);
        sum = residual_out;
      }
      if (is_quantised(op)) scale = a.scale->contiguous();
      if (is_nvfp4(op)) block_scale = output(*a.block_scale, nullptr, inp);
    }
  }

  void copy_back(const OpArgs& a) const {
    if (!out.is_same(a.out)) a.out.copy_(out);
    if (residual_out.defined() && !residual_out.is_same(*a.residual_out)) {
      a.residual_out->copy_(residual_out);
    }
    if (block_scale.defined() && !block_scale.is_same(*a.block_scale)) {
      a.block_scale->copy_(block_scale);
    }
  }
};

}  // namespace pcie_ar::comm
