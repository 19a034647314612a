// The torch ops: torch.ops.pcie_allreduce.all_reduce(inp, handle) -> Tensor and the in-place
// all_reduce_(inp, handle) -> ().
// One implementation serves CPU and CUDA tensors: the communicator behind `handle` picks its
// transport, and anything it declines goes to the group's own all-reduce. Fake (meta)
// implementations are registered from Python so torch.compile can trace the ops.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "comm/communicator.h"

namespace pcie_ar::bindings {
namespace {

at::Tensor all_reduce(const at::Tensor& inp, int64_t handle) {
  auto communicator = comm::lookup_communicator(handle);
  at::Tensor out = at::empty(inp.sizes(), inp.options());  // contiguous, whatever inp's strides
  communicator->all_reduce(inp, out);
  return out;
}

// Mutates and returns nothing: torch.compile functionalizes mutable custom ops only when no
// output aliases an input.
void all_reduce_(at::Tensor& inp, int64_t handle) {
  comm::lookup_communicator(handle)->all_reduce(inp, inp);
}

}  // namespace

TORCH_LIBRARY(pcie_allreduce, m) {
  m.def("all_reduce(Tensor inp, int handle) -> Tensor");
  m.def("all_reduce_(Tensor(a!) inp, int handle) -> ()");
}

TORCH_LIBRARY_IMPL(pcie_allreduce, CPU, m) {
  m.impl("all_reduce", &all_reduce);
  m.impl("all_reduce_", &all_reduce_);
}

TORCH_LIBRARY_IMPL(pcie_allreduce, CUDA, m) {
  m.impl("all_reduce", &all_reduce);
  m.impl("all_reduce_", &all_reduce_);
}

}  // namespace pcie_ar::bindings
