// The torch ops: torch.ops.pcie_allreduce.all_reduce(inp, handle) -> Tensor, the in-place
// all_reduce_(inp, handle) -> () and all_reduce_into(inp, handle, out) -> (). All three are one
// operation, Communicator::all_reduce(inp, out), with the output allocated, aliased or given.
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

}  // namespace

TORCH_LIBRARY(pcie_allreduce, m) {
  m.def("all_reduce(Tensor inp, int handle) -> Tensor");
  m.def("all_reduce_(Tensor(a!) inp, int handle) -> ()");
  m.def("all_reduce_into(Tensor inp, int handle, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(pcie_allreduce, CPU, m) {
  m.impl("all_reduce", &all_reduce);
  m.impl("all_reduce_", &all_reduce_);
  m.impl("all_reduce_into", &all_reduce_into);
}

TORCH_LIBRARY_IMPL(pcie_allreduce, CUDA, m) {
  m.impl("all_reduce", &all_reduce);
  m.impl("all_reduce_", &all_reduce_);
  m.impl("all_reduce_into", &all_reduce_into);
}

}  // namespace pcie_ar::bindings
