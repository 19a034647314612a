// The derivatives of the functional torch ops (the Autograd key of pcie_allreduce's library), so
// backward through them computes the gradient instead of passing them by silently.
//
// Each rank's loss is taken to depend on every rank's inputs (the sum over ranks, as with
// torch.distributed.nn.functional): the gradient of all_reduce's input is the all-reduce of its
// gradient; reduce_scatter and all_gather (dim 0) are each other's adjoints; the fused
// all_reduce_add_rms_norm differentiates rms_norm(sum_ranks(x) + residual) * weight, whose
// gradient of x is all-reduced too. A backward therefore runs collectives through the same
// communicator: every rank must run it, in the same order, with the same inputs requiring grad.
// The mutating forms have no derivative (the call path refuses to write a tensor that requires
// grad while grad mode is on).
//
// In C++ and unboxed: a call whose inputs do not require grad (every inference call) costs one
// check before it goes on to the op's kernel; a Python kernel here cost about 4 us a call, more
// than a small CPU all-reduce. Every op is reached through the dispatcher below autograd, so
// FakeTensor tracing (torch.compile, opcheck) sees the ops and their fake implementations.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <string>
#include <tuple>

namespace pcie_ar::bindings {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using Functional = at::Tensor(const at::Tensor&, int64_t);
using Sized = at::Tensor(const at::Tensor&, int64_t, int64_t);
using Fused = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                 const at::Tensor&, double, int64_t, double);

template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow((std::string("pcie_allreduce::") + name).c_str(), "")
      .template typed<Signature>();
}

// The ops' kernels below autograd (and the fake ones under FakeTensorMode).
at::Tensor all_reduce(const at::Tensor& x, int64_t handle) {
  static const auto handle_op = op<Functional>("all_reduce");
  at::AutoDispatchBelowADInplaceOrView guard;
  return handle_op.call(x, handle);
}

at::Tensor reduce_scatter(const at::Tensor& x, int64_t world, int64_t handle) {
  static const auto handle_op = op<Sized>("reduce_scatter");
  at::AutoDispatchBelowADInplaceOrView guard;
  return handle_op.call(x, world, handle);
}

at::Tensor all_gather(const at::Tensor& x, int64_t world, int64_t handle) {
  static const auto handle_op = op<Sized>("all_gather");
  at::AutoDispatchBelowADInplaceOrView guard;
  return handle_op.call(x, world, handle);
}

std::tuple<at::Tensor, at::Tensor> fused(const at::Tensor& x, const at::Tensor& residual,
                                         const at::Tensor& weight, double eps, int64_t handle,
                                         double weight_offset) {
  static const auto handle_op = op<Fused>("all_reduce_add_rms_norm");
  at::AutoDispatchBelowADInplaceOrView guard;
  return handle_op.call(x, residual, weight, eps, handle, weight_offset);
}

bool tracked(const at::Tensor& t) { return t.defined() && t.requires_grad(); }

struct AllReduce : torch::autograd::Function<AllReduce> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t handle) {
    ctx->saved_data["handle"] = handle;
    return all_reduce(x, handle);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_reduce(grads[0].contiguous(), ctx->saved_data["handle"].toInt()), at::Tensor()};
  }
};

// reduce_scatter (kScatter) and all_gather are each other's adjoints.
template <bool kScatter>
struct DimZero : torch::autograd::Function<DimZero<kScatter>> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t world,
                            int64_t handle) {
    ctx->saved_data["world"] = world;
    ctx->saved_data["handle"] = handle;
    return kScatter ? reduce_scatter(x, world, handle) : all_gather(x, world, handle);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const int64_t world = ctx->saved_data["world"].toInt();
    const int64_t handle = ctx->saved_data["handle"].toInt();
    const at::Tensor g = grads[0].contiguous();
    return {kScatter ? all_gather(g, world, handle) : reduce_scatter(g, world, handle),
            at::Tensor(), at::Tensor()};
  }
};

// rms_norm's backward at residual_out r, in fp32: with rstd = 1 / sqrt(mean(r^2) + eps),
// n = r * rstd and g = grad_y * weight, grad_r = rstd * (g - n * mean(g * n)) + grad_residual_out
// and grad_weight = the sum over rows of grad_y * n; residual's gradient is grad_r, x's is its
// sum over the ranks. With a weight offset (Gemma) the weight is weight + offset in g.
struct AddRmsNorm : torch::autograd::Function<AddRmsNorm> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x,
                               const at::Tensor& residual, const at::Tensor& weight, double eps,
                               int64_t handle, double weight_offset) {
    auto [y, residual_out] = fused(x, residual, weight, eps, handle, weight_offset);
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["weight_offset"] = weight_offset;
    ctx->saved_data["handle"] = handle;
    ctx->save_for_backward({residual_out, weight});
    return {y, residual_out};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& residual_out = saved[0];
    const at::Tensor& weight = saved[1];
    const double eps = ctx->saved_data["eps"].toDouble();
    const at::Tensor r = residual_out.to(at::kFloat);
    const at::Tensor rstd = at::rsqrt(r.square().mean(-1, /*keepdim=*/true).add(eps));
    const at::Tensor n = r.mul(rstd);
    const at::Tensor gy =
        grads[0].defined() ? grads[0].to(at::kFloat) : at::zeros_like(r, r.options());
    const at::Tensor g =
        gy.mul(weight.to(at::kFloat).add(ctx->saved_data["weight_offset"].toDouble()));
    at::Tensor grad_r = rstd.mul(g.sub(n.mul(g.mul(n).mean(-1, /*keepdim=*/true))));
    if (grads[1].defined()) grad_r = grad_r.add(grads[1].to(at::kFloat));
    grad_r = grad_r.to(residual_out.scalar_type()).contiguous();
    at::Tensor grad_x;
    if (ctx->needs_input_grad(0)) grad_x = all_reduce(grad_r, ctx->saved_data["handle"].toInt());
    at::Tensor grad_weight;
    if (ctx->needs_input_grad(2)) {
      grad_weight = gy.mul(n).reshape({-1, n.size(-1)}).sum(0).to(weight.scalar_type());
    }
    return {grad_x,       ctx->needs_input_grad(1) ? grad_r : at::Tensor(),
            grad_weight,  at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

// The Autograd kernels: a graph node only where grad mode is on and an input requires grad.
at::Tensor all_reduce_autograd(const at::Tensor& x, int64_t handle) {
  if (!(at::GradMode::is_enabled() && tracked(x))) return all_reduce(x, handle);
  return AllReduce::apply(x, handle);
}

at::Tensor reduce_scatter_autograd(const at::Tensor& x, int64_t world, int64_t handle) {
  if (!(at::GradMode::is_enabled() && tracked(x))) return reduce_scatter(x, world, handle);
  return DimZero<true>::apply(x, world, handle);
}

at::Tensor all_gather_autograd(const at::Tensor& x, int64_t world, int64_t handle) {
  if (!(at::GradMode::is_enabled() && tracked(x))) return all_gather(x, world, handle);
  return DimZero<false>::apply(x, world, handle);
}

std::tuple<at::Tensor, at::Tensor> fused_autograd(const at::Tensor& x, const at::Tensor& residual,
                                                  const at::Tensor& weight, double eps,
                                                  int64_t handle, double weight_offset) {
  if (!(at::GradMode::is_enabled() && (tracked(x) || tracked(residual) || tracked(weight)))) {
    return fused(x, residual, weight, eps, handle, weight_offset);
  }
  const variable_list out = AddRmsNorm::apply(x, residual, weight, eps, handle, weight_offset);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_IMPL(pcie_allreduce, Autograd, m) {
  m.impl("all_reduce", &all_reduce_autograd);
  m.impl("reduce_scatter", &reduce_scatter_autograd);
  m.impl("all_gather", &all_gather_autograd);
  m.impl("all_reduce_add_rms_norm", &fused_autograd);
}

}  // namespace pcie_ar::bindings
