#include "comm/arguments.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <vector>

#include "plan/layout.h"

namespace pcie_ar::comm {
namespace {

// True when two tensors may share a byte. ATen cannot always tell for strided views of one
// storage; those count as overlapping (conservative, and the message says what to pass).
bool may_overlap(const at::Tensor& a, const at::Tensor& b) {
  switch (at::get_overlap_status(a, b)) {
    case at::MemOverlapStatus::Full:
    case at::MemOverlapStatus::Partial:
      return true;
    case at::MemOverlapStatus::TooHard:
      return a.storage().is_alias_of(b.storage());
    default:
      return false;
  }
}

bool like(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes().equals(b.sizes()) &&
         a.device() == b.device();
}

// A written-to tensor whose elements share memory (an expand) would be written twice.
void check_no_internal_overlap(const at::Tensor& out) {
  if (at::has_internal_overlap(out) == at::MemOverlap::Yes) {
    throw std::invalid_argument(
        "unsupported operation: more than one element of the written-to tensor refers to a "
        "single memory location (an expanded or overlapping view); clone() it first");
  }
}

// The autograd rules torch's own in-place and out= ops enforce: the op has no derivative, so
// writing into a tensor that autograd tracks would silently break its gradient.
// The op's name, for messages: built only on the way to a throw (every call checks).
std::string name_of(Op op) { return std::string(op_name(op)); }

void check_writable(Op op, const at::Tensor& out, bool in_place) {
  if (out.requires_grad() && at::GradMode::is_enabled()) {
    const std::string name = name_of(op);
    throw std::runtime_error(
        in_place && out.is_leaf()
            ? "a leaf Variable that requires grad is being used in an in-place operation (" + name +
                  "_); call it under torch.no_grad() or on a tensor that does not require "
                  "grad"
            : (in_place ? name + "_" : name + "(out=)") +
                  " has no derivative, but the tensor it writes requires grad; call it under "
                  "torch.no_grad() or on a detached tensor");
  }
  if (out.is_inference() && !c10::InferenceMode::is_enabled()) {
    throw std::runtime_error(
        "Inplace update to inference tensor outside InferenceMode is not allowed: the tensor " +
        name_of(op) +
        " writes was created in inference mode; call it inside torch.inference_mode() or "
        "clone() the tensor first");
  }
}

void check_output(Op op, const at::Tensor& out, bool in_place) {
  check_writable(op, out, in_place);
  check_no_internal_overlap(out);
}

void check_device(const at::Tensor& inp, int device) {
  const bool here =
      device < 0 ? inp.device().is_cpu() : inp.is_cuda() && inp.device().index() == device;
  if (!here) {
    throw std::invalid_argument(
        "the input is a " + describe(inp) + "; this communicator all-reduces tensors on " +
        (device < 0 ? std::string("cpu") : "cuda:" + std::to_string(device)));
  }
}

// The all-reduce's out, and the fused call's: like the input, or the input itself.
void check_same_shape_output(Op op, const at::Tensor& inp, const at::Tensor& out) {
  if (!out.is_same(inp)) {
    if (!like(out, inp)) {
      throw std::invalid_argument(
          "out must have the input's dtype, shape and device: the input is a " + describe(inp) +
          ", out a " + describe(out));
    }
    if (may_overlap(inp, out)) {
      throw std::invalid_argument(
          "out overlaps the input without being the same tensor; pass the input itself for an "
          "in-place all-reduce (all_reduce_) or a disjoint tensor");
    }
  }
  check_output(op, out, out.is_same(inp));
}

void check_fused(Op op, const OpArgs& a) {
  const at::Tensor& x = a.inp;
  const at::Tensor& residual = *a.residual;
  const at::Tensor& weight = *a.weight;
  const at::Tensor& out = a.out;
  const at::Tensor& residual_out = *a.residual_out;
  if (x.dim() < 1) {
    throw std::invalid_argument(
        "all_reduce_add_rms_norm needs x of at least one dimension (rows of hidden); got a " +
        describe(x));
  }
  const int64_t hidden = x.size(-1);
  if (!like(residual, x)) {
    throw std::invalid_argument("residual must have x's dtype, shape and device: x is a " +
                                describe(x) + ", residual a " + describe(residual));
  }
  if (weight.dim() != 1 || weight.size(0) != hidden || weight.device() != x.device()) {
    throw std::invalid_argument("weight must be [hidden] = [" + std::to_string(hidden) +
                                "] on x's device: x is a " + describe(x) + ", weight a " +
                                describe(weight));
  }
  if (!like(out, x) || !like(residual_out, x)) {
    throw std::invalid_argument(
        "out and residual_out must have x's dtype, shape and device: x is a " + describe(x) +
        ", out a " + describe(out) + ", residual_out a " + describe(residual_out));
  }
  auto apart = [](const at::Tensor& p, const at::Tensor& q) { return !may_overlap(p, q); };
  if (!(out.is_same(x) || apart(out, x)) ||
      !(residual_out.is_same(residual) || apart(residual_out, residual)) || !apart(out, residual) ||
      !apart(out, residual_out) || !apart(residual_out, x)) {
    throw std::invalid_argument(
        "all_reduce_add_rms_norm writes out and residual_out: out may be x and residual_out may "
        "be residual (in place), but they may not overlap each other or any other operand");
  }
  check_output(op, residual_out, residual_out.is_same(residual));  // out: with the all-reduce's
}

// Reduce-scatter and all-gather: along dim 0, out is inp with dim 0 divided or multiplied by
// the world size, never in place.
void check_collective(Op op, const at::Tensor& inp, const at::Tensor& out, int world) {
  const bool scatter = output_is_chunk(op);
  if (inp.dim() < 1) {
    throw std::invalid_argument(
        name_of(op) + " works along dim 0 and needs a tensor of at least one dimension; got a " +
        describe(inp));
  }
  if (scatter && inp.size(0) % world != 0) {
    throw std::invalid_argument(name_of(op) +
                                " needs dim 0 of the input divisible by the world size " +
                                std::to_string(world) + "; got a " + describe(inp));
  }
  const int64_t rows = output_rows(op, inp.size(0), world);
  bool shaped = out.dim() == inp.dim() && out.size(0) == rows;
  for (int64_t d = 1; shaped && d < inp.dim(); ++d) shaped = out.size(d) == inp.size(d);
  if (out.scalar_type() != inp.scalar_type() || out.device() != inp.device() || !shaped) {
    std::vector<int64_t> expected = inp.sizes().vec();
    expected[0] = rows;
    throw std::invalid_argument(
        name_of(op) + "'s out must have the input's dtype and device and shape " +
        c10::str(at::IntArrayRef(expected)) + " (dim 0 " + (scatter ? "divided" : "multiplied") +
        " by the world size " + std::to_string(world) + "): the input is a " + describe(inp) +
        ", out a " + describe(out));
  }
  if (may_overlap(inp, out)) {
    throw std::invalid_argument(name_of(op) + "'s out overlaps its input; pass a disjoint tensor");
  }
  check_output(op, out, false);
}

}  // namespace

void check_args(Op op, const OpArgs& a, int world, std::optional<int> device) {
  if (device) check_device(a.inp, *device);
  if (op.collective != plan::Collective::kAllReduce) {
    check_collective(op, a.inp, a.out, std::max(world, 1));
    return;
  }
  check_same_shape_output(op, a.inp, a.out);
  if (has_epilogue(op)) check_fused(op, a);
}

bool executor_ready(const at::Tensor& t) {
  return t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % plan::kVectorBytes == 0;
}

std::string describe(const at::Tensor& t) {
  std::string shape = "[";
  for (int64_t i = 0; i < t.dim(); ++i) shape += (i ? ", " : "") + std::to_string(t.size(i));
  return std::string(c10::toString(t.scalar_type())) + " " + shape + "] on " + t.device().str();
}

}  // namespace pcie_ar::comm
