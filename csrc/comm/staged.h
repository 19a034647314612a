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
  at::Tensor inp, out, residual, weight, residual_out;
  bool any = false;

  Staged(Op op, const OpArgs& a) {
    const auto input = [this](const at::Tensor& t) {
      if (executor_ready(t)) return t;
      any = true;
      return t.clone(at::MemoryFormat::Contiguous);
    };
    const auto output = [this](const at::Tensor& t, const at::Tensor& in_place_of,
                               const at::Tensor& staged_input) {
      if (t.is_same(in_place_of)) return staged_input;
      if (executor_ready(t)) return t;
      any = true;
      return at::empty(t.sizes(), t.options());
    };
    inp = input(a.inp);
    out = output(a.out, a.inp, inp);
    if (has_epilogue(op)) {
      residual = input(*a.residual);
      weight = input(*a.weight);
      residual_out = output(*a.residual_out, *a.residual, residual);
    }
  }

  void copy_back(const OpArgs& a) const {
    if (!out.is_same(a.out)) a.out.copy_(out);
    if (residual_out.defined() && !residual_out.is_same(*a.residual_out)) {
      a.residual_out->copy_(residual_out);
    }
  }
};

}  // namespace pcie_ar::comm
