// The torch ops: torch.ops.pcie_allreduce.all_reduce(inp, handle) -> Tensor, the in-place
// all_reduce_(inp, handle) -> () and all_reduce_into(inp, handle, out) -> (). All three are one
// operation, Communicator::all_reduce(inp, out), with the output allocated, aliased or given.
// The fused all_reduce_add_rms_norm has the same three forms; reduce_scatter and all_gather have
// two (functional and into).
// One implementation serves CPU and CUDA tensors: the communicator behind `handle` picks its
// transport, and anything it declines goes to the group's own all-reduce. Fake (meta)
// implementations are registered from Python so torch.compile can trace the ops.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "comm/communicator.h"

namespace pcie_ar::bindings {
namespace {

at::Tensor all_reduce(const at::Tensor& inp, int64_t handle) {
  return comm::lookup_communicator(handle)->all_reduce(inp);
}

// Mutates and returns nothing: torch.compile functionalizes mutable custom ops only when no
// output aliases an input.
void all_reduce_(at::Tensor& inp, int64_t handle) {
  comm::lookup_communicator(handle)->all_reduce(inp, inp);
}

void all_reduce_into(const at::Tensor& inp, int64_t handle, at::Tensor& out) {
  comm::lookup_communicator(handle)->all_reduce(inp, out);
}

// The fused end of a decoder layer (Communicator::all_reduce_add_rms_norm): returns
// (y, residual_out) in new tensors; in place (y into x, residual_out into residual, as the
// engines' fused_add_rms_norm does); or into two given, disjoint tensors.
std::tuple<at::Tensor, at::Tensor> all_reduce_add_rms_norm(const at::Tensor& x,
                                                           const at::Tensor& residual,
                                                           const at::Tensor& weight, double eps,
                                                           int64_t handle) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor residual_out = at::empty(residual.sizes(), residual.options());
  comm::lookup_communicator(handle)->all_reduce_add_rms_norm(x, residual, weight, eps, out,
                                                             residual_out);
  return {out, residual_out};
}

void all_reduce_add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                              double eps, int64_t handle) {
  comm::lookup_communicator(handle)->all_reduce_add_rms_norm(x, residual, weight, eps, x, residual);
}

void all_reduce_add_rms_norm_into(const at::Tensor& x, const at::Tensor& residual,
                                  const at::Tensor& weight, double eps, int64_t handle,
                                  at::Tensor& out, at::Tensor& residual_out) {
  comm::lookup_communicator(handle)->all_reduce_add_rms_norm(x, residual, weight, eps, out,
                                                             residual_out);
}

// Reduce-scatter and all-gather along dim 0 (Communicator::reduce_scatter, all_gather): into a
// new tensor, or into a given one. `world` is the group's size, which the fake implementation
// needs to shape the result; it must be the communicator's.
at::Tensor collective_result(const comm::Communicator& c, plan::Collective collective,
                             const at::Tensor& inp, int64_t world) {
  if (world != c.options().world) {
    throw std::invalid_argument(std::string(plan::collective_name(collective)) + ": world " +
                                std::to_string(world) + " is not the communicator's world size " +
                                std::to_string(c.options().world));
  }
  std::vector<int64_t> sizes = inp.sizes().vec();
  if (!sizes.empty()) {
    sizes[0] = collective == plan::Collective::kReduceScatter ? sizes[0] / world : sizes[0] * world;
  }
  return at::empty(sizes, inp.options());
}

at::Tensor reduce_scatter(const at::Tensor& inp, int64_t world, int64_t handle) {
  const auto c = comm::lookup_communicator(handle);
  at::Tensor out = collective_result(*c, plan::Collective::kReduceScatter, inp, world);
  c->reduce_scatter(inp, out);
  return out;
}

void reduce_scatter_into(const at::Tensor& inp, int64_t handle, at::Tensor& out) {
  comm::lookup_communicator(handle)->reduce_scatter(inp, out);
}

at::Tensor all_gather(const at::Tensor& inp, int64_t world, int64_t handle) {
  const auto c = comm::lookup_communicator(handle);
  at::Tensor out = collective_result(*c, plan::Collective::kAllGather, inp, world);
  c->all_gather(inp, out);
  return out;
}

void all_gather_into(const at::Tensor& inp, int64_t handle, at::Tensor& out) {
  comm::lookup_communicator(handle)->all_gather(inp, out);
}

}  // namespace

TORCH_LIBRARY(pcie_allreduce, m) {
  m.def("reduce_scatter(Tensor inp, int world, int handle) -> Tensor");
  m.def("reduce_scatter_into(Tensor inp, int handle, Tensor(a!) out) -> ()");
  m.def("all_gather(Tensor inp, int world, int handle) -> Tensor");
  m.def("all_gather_into(Tensor inp, int handle, Tensor(a!) out) -> ()");
  m.def("all_reduce(Tensor inp, int handle) -> Tensor");
  m.def("all_reduce_(Tensor(a!) inp, int handle) -> ()");
  m.def("all_reduce_into(Tensor inp, int handle, Tensor(a!) out) -> ()");
  m.def(
      "all_reduce_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, int handle) "
      "-> (Tensor, Tensor)");
  m.def(
      "all_reduce_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, "
      "int handle) -> ()");
  m.def(
      "all_reduce_add_rms_norm_into(Tensor x, Tensor residual, Tensor weight, float eps, "
      "int handle, Tensor(a!) out, Tensor(b!) residual_out) -> ()");
}

#define PCIE_AR_IMPLS(m)                                                 \
  m.impl("all_reduce", &all_reduce);                                     \
  m.impl("all_reduce_", &all_reduce_);                                   \
  m.impl("all_reduce_into", &all_reduce_into);                           \
  m.impl("all_reduce_add_rms_norm", &all_reduce_add_rms_norm);           \
  m.impl("all_reduce_add_rms_norm_", &all_reduce_add_rms_norm_);         \
  m.impl("all_reduce_add_rms_norm_into", &all_reduce_add_rms_norm_into); \
  m.impl("reduce_scatter", &reduce_scatter);                             \
  m.impl("reduce_scatter_into", &reduce_scatter_into);                   \
  m.impl("all_gather", &all_gather);                                     \
  m.impl("all_gather_into", &all_gather_into)

TORCH_LIBRARY_IMPL(pcie_allreduce, CPU, m) { PCIE_AR_IMPLS(m); }

TORCH_LIBRARY_IMPL(pcie_allreduce, CUDA, m) { PCIE_AR_IMPLS(m); }

#undef PCIE_AR_IMPLS

}  // namespace pcie_ar::bindings
