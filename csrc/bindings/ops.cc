// The torch ops: every op of the communicator (comm/op.h) in the forms torch users expect, each
// one call of Communicator::run():
//   all_reduce(inp, handle) -> Tensor, all_reduce_(inp, handle) -> (), all_reduce_into(inp,
//   handle, out) -> (); all_reduce_add_rms_norm in the same three forms; all_reduce_rms_norm
//   (no residual) and the quantised all_reduce_{add_,}rms_norm_{fp8,nvfp4} functional and into;
//   reduce_scatter and all_gather functional and into.
// One implementation serves CPU and CUDA tensors: the communicator behind `handle` picks its
// transport, and anything it declines goes to the op's fallback. Fake implementations are
// registered from Python so torch.compile can trace the ops, with Meta kernels that refuse a real
// call with an operand on the meta device (pcie_allreduce/native.py). The mutating forms return
// nothing: torch.compile functionalizes mutable custom ops only when no output aliases an input.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "comm/communicator.h"
#include "comm/registry.h"

namespace pcie_ar::bindings {
namespace {

using comm::lookup_communicator;

at::Tensor all_reduce(const at::Tensor& inp, int64_t handle) {
  at::Tensor out;
  lookup_communicator(handle)->run(comm::kAllReduce, {inp, out});
  return out;
}

void all_reduce_(at::Tensor& inp, int64_t handle) {
  lookup_communicator(handle)->run(comm::kAllReduce, {inp, inp});
}

void all_reduce_into(const at::Tensor& inp, int64_t handle, at::Tensor& out) {
  lookup_communicator(handle)->run(comm::kAllReduce, {inp, out});
}

// The fused end of a decoder layer: (y, residual_out) in new tensors; in place (y into x,
// residual_out into residual, as the engines' fused_add_rms_norm does); or into two given,
// disjoint tensors. weight_offset 1 is Gemma's weight convention.
void fused(comm::Op op, const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
           const at::Tensor* scale, double eps, int64_t handle, double weight_offset,
           at::Tensor& out, at::Tensor& residual_out, at::Tensor* block_scale = nullptr) {
  comm::OpArgs args{x, out, residual, &weight, &residual_out, eps, weight_offset, scale};
  args.block_scale = block_scale;
  lookup_communicator(handle)->run(op, args);
}

std::tuple<at::Tensor, at::Tensor> all_reduce_add_rms_norm(const at::Tensor& x,
                                                           const at::Tensor& residual,
                                                           const at::Tensor& weight, double eps,
                                                           int64_t handle, double weight_offset) {
  at::Tensor out;
  at::Tensor residual_out;
  fused(comm::kAllReduceAddRmsNorm, x, &residual, weight, nullptr, eps, handle, weight_offset, out,
        residual_out);
  return {out, residual_out};
}

void all_reduce_add_rms_norm_(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                              double eps, int64_t handle, double weight_offset) {
  fused(comm::kAllReduceAddRmsNorm, x, &residual, weight, nullptr, eps, handle, weight_offset, x,
        residual);
}

void all_reduce_add_rms_norm_into(const at::Tensor& x, const at::Tensor& residual,
                                  const at::Tensor& weight, double eps, int64_t handle,
                                  at::Tensor& out, at::Tensor& residual_out, double weight_offset) {
  fused(comm::kAllReduceAddRmsNorm, x, &residual, weight, nullptr, eps, handle, weight_offset, out,
        residual_out);
}

// The first layer's form: no residual; residual_out is the sum itself.
std::tuple<at::Tensor, at::Tensor> all_reduce_rms_norm(const at::Tensor& x,
                                                       const at::Tensor& weight, double eps,
                                                       int64_t handle, double weight_offset) {
  at::Tensor out;
  at::Tensor sum;
  fused(comm::kAllReduceRmsNorm, x, nullptr, weight, nullptr, eps, handle, weight_offset, out, sum);
  return {out, sum};
}

void all_reduce_rms_norm_into(const at::Tensor& x, const at::Tensor& weight, double eps,
                              int64_t handle, at::Tensor& out, at::Tensor& sum,
                              double weight_offset) {
  fused(comm::kAllReduceRmsNorm, x, nullptr, weight, nullptr, eps, handle, weight_offset, out, sum);
}

// The quantised forms: (y_q, residual_out), y_q float8_e4m3fn at the static scale.
std::tuple<at::Tensor, at::Tensor> all_reduce_add_rms_norm_fp8(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
    const at::Tensor& scale, double eps, int64_t handle, double weight_offset) {
  at::Tensor out;
  at::Tensor residual_out;
  fused(comm::kAllReduceAddRmsNormFp8, x, &residual, weight, &scale, eps, handle, weight_offset,
        out, residual_out);
  return {out, residual_out};
}

void all_reduce_add_rms_norm_fp8_into(const at::Tensor& x, const at::Tensor& residual,
                                      const at::Tensor& weight, const at::Tensor& scale, double eps,
                                      int64_t handle, at::Tensor& out, at::Tensor& residual_out,
                                      double weight_offset) {
  fused(comm::kAllReduceAddRmsNormFp8, x, &residual, weight, &scale, eps, handle, weight_offset,
        out, residual_out);
}

std::tuple<at::Tensor, at::Tensor> all_reduce_rms_norm_fp8(const at::Tensor& x,
                                                           const at::Tensor& weight,
                                                           const at::Tensor& scale, double eps,
                                                           int64_t handle, double weight_offset) {
  at::Tensor out;
  at::Tensor sum;
  fused(comm::kAllReduceRmsNormFp8, x, nullptr, weight, &scale, eps, handle, weight_offset, out,
        sum);
  return {out, sum};
}

void all_reduce_rms_norm_fp8_into(const at::Tensor& x, const at::Tensor& weight,
                                  const at::Tensor& scale, double eps, int64_t handle,
                                  at::Tensor& out, at::Tensor& sum, double weight_offset) {
  fused(comm::kAllReduceRmsNormFp8, x, nullptr, weight, &scale, eps, handle, weight_offset, out,
        sum);
}

// NVFP4: (y_q, residual_out, block_scale), y_q uint8 [..., hidden / 2] (two e2m1 codes a byte),
// block_scale float8_e4m3fn in vLLM's swizzled layout, at the global scale.
std::tuple<at::Tensor, at::Tensor, at::Tensor> all_reduce_add_rms_norm_nvfp4(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
    const at::Tensor& scale, double eps, int64_t handle, double weight_offset) {
  at::Tensor out;
  at::Tensor residual_out;
  at::Tensor block_scale;
  fused(comm::kAllReduceAddRmsNormNvfp4, x, &residual, weight, &scale, eps, handle, weight_offset,
        out, residual_out, &block_scale);
  return {out, residual_out, block_scale};
}

void all_reduce_add_rms_norm_nvfp4_into(const at::Tensor& x, const at::Tensor& residual,
                                        const at::Tensor& weight, const at::Tensor& scale,
                                        double eps, int64_t handle, at::Tensor& out,
                                        at::Tensor& residual_out, at::Tensor& block_scale,
                                        double weight_offset) {
  fused(comm::kAllReduceAddRmsNormNvfp4, x, &residual, weight, &scale, eps, handle, weight_offset,
        out, residual_out, &block_scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> all_reduce_rms_norm_nvfp4(const at::Tensor& x,
                                                                         const at::Tensor& weight,
                                                                         const at::Tensor& scale,
                                                                         double eps, int64_t handle,
                                                                         double weight_offset) {
  at::Tensor out;
  at::Tensor sum;
  at::Tensor block_scale;
  fused(comm::kAllReduceRmsNormNvfp4, x, nullptr, weight, &scale, eps, handle, weight_offset, out,
        sum, &block_scale);
  return {out, sum, block_scale};
}

void all_reduce_rms_norm_nvfp4_into(const at::Tensor& x, const at::Tensor& weight,
                                    const at::Tensor& scale, double eps, int64_t handle,
                                    at::Tensor& out, at::Tensor& sum, at::Tensor& block_scale,
                                    double weight_offset) {
  fused(comm::kAllReduceRmsNormNvfp4, x, nullptr, weight, &scale, eps, handle, weight_offset, out,
        sum, &block_scale);
}

// `world` is the group's size, which the fake implementation needs to shape the result; it must
// be the communicator's.
template <const comm::Op& kOp>
at::Tensor collective(const at::Tensor& inp, int64_t world, int64_t handle) {
  const auto c = lookup_communicator(handle);
  if (world != c->options().world) {
    throw std::invalid_argument(std::string(comm::op_name(kOp)) + ": world " +
                                std::to_string(world) + " is not the communicator's world size " +
                                std::to_string(c->options().world));
  }
  at::Tensor out;
  c->run(kOp, {inp, out});
  return out;
}

template <const comm::Op& kOp>
void collective_into(const at::Tensor& inp, int64_t handle, at::Tensor& out) {
  lookup_communicator(handle)->run(kOp, {inp, out});
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
  // The fused forms (comm/op.h). weight_offset comes last, with a default, so every call
  // written before it (and the engines' adapters) is unchanged.
  m.def(
      "all_reduce_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, int handle, "
      "float weight_offset=0.) -> (Tensor, Tensor)");
  m.def(
      "all_reduce_add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, "
      "int handle, float weight_offset=0.) -> ()");
  m.def(
      "all_reduce_add_rms_norm_into(Tensor x, Tensor residual, Tensor weight, float eps, "
      "int handle, Tensor(a!) out, Tensor(b!) residual_out, float weight_offset=0.) -> ()");
  m.def(
      "all_reduce_rms_norm(Tensor x, Tensor weight, float eps, int handle, "
      "float weight_offset=0.) -> (Tensor, Tensor)");
  m.def(
      "all_reduce_rms_norm_into(Tensor x, Tensor weight, float eps, int handle, Tensor(a!) out, "
      "Tensor(b!) residual_out, float weight_offset=0.) -> ()");
  m.def(
      "all_reduce_add_rms_norm_fp8(Tensor x, Tensor residual, Tensor weight, Tensor scale, "
      "float eps, int handle, float weight_offset=0.) -> (Tensor, Tensor)");
  m.def(
      "all_reduce_add_rms_norm_fp8_into(Tensor x, Tensor residual, Tensor weight, Tensor scale, "
      "float eps, int handle, Tensor(a!) out, Tensor(b!) residual_out, "
      "float weight_offset=0.) -> ()");
  m.def(
      "all_reduce_rms_norm_fp8(Tensor x, Tensor weight, Tensor scale, float eps, int handle, "
      "float weight_offset=0.) -> (Tensor, Tensor)");
  m.def(
      "all_reduce_rms_norm_fp8_into(Tensor x, Tensor weight, Tensor scale, float eps, "
      "int handle, Tensor(a!) out, Tensor(b!) residual_out, float weight_offset=0.) -> ()");
  m.def(
      "all_reduce_add_rms_norm_nvfp4(Tensor x, Tensor residual, Tensor weight, Tensor scale, "
      "float eps, int handle, float weight_offset=0.) -> (Tensor, Tensor, Tensor)");
  m.def(
      "all_reduce_add_rms_norm_nvfp4_into(Tensor x, Tensor residual, Tensor weight, "
      "Tensor scale, float eps, int handle, Tensor(a!) out, Tensor(b!) residual_out, "
      "Tensor(c!) block_scale, float weight_offset=0.) -> ()");
  m.def(
      "all_reduce_rms_norm_nvfp4(Tensor x, Tensor weight, Tensor scale, float eps, int handle, "
      "float weight_offset=0.) -> (Tensor, Tensor, Tensor)");
  m.def(
      "all_reduce_rms_norm_nvfp4_into(Tensor x, Tensor weight, Tensor scale, float eps, "
      "int handle, Tensor(a!) out, Tensor(b!) residual_out, Tensor(c!) block_scale, "
      "float weight_offset=0.) -> ()");
}

#define PCIE_AR_IMPLS(m)                                                             \
  m.impl("all_reduce", &all_reduce);                                                 \
  m.impl("all_reduce_", &all_reduce_);                                               \
  m.impl("all_reduce_into", &all_reduce_into);                                       \
  m.impl("all_reduce_add_rms_norm", &all_reduce_add_rms_norm);                       \
  m.impl("all_reduce_add_rms_norm_", &all_reduce_add_rms_norm_);                     \
  m.impl("all_reduce_add_rms_norm_into", &all_reduce_add_rms_norm_into);             \
  m.impl("all_reduce_rms_norm", &all_reduce_rms_norm);                               \
  m.impl("all_reduce_rms_norm_into", &all_reduce_rms_norm_into);                     \
  m.impl("all_reduce_add_rms_norm_fp8", &all_reduce_add_rms_norm_fp8);               \
  m.impl("all_reduce_add_rms_norm_fp8_into", &all_reduce_add_rms_norm_fp8_into);     \
  m.impl("all_reduce_rms_norm_fp8", &all_reduce_rms_norm_fp8);                       \
  m.impl("all_reduce_rms_norm_fp8_into", &all_reduce_rms_norm_fp8_into);             \
  m.impl("all_reduce_add_rms_norm_nvfp4", &all_reduce_add_rms_norm_nvfp4);           \
  m.impl("all_reduce_add_rms_norm_nvfp4_into", &all_reduce_add_rms_norm_nvfp4_into); \
  m.impl("all_reduce_rms_norm_nvfp4", &all_reduce_rms_norm_nvfp4);                   \
  m.impl("all_reduce_rms_norm_nvfp4_into", &all_reduce_rms_norm_nvfp4_into);         \
  m.impl("reduce_scatter", &collective<comm::kReduceScatter>);                       \
  m.impl("reduce_scatter_into", &collective_into<comm::kReduceScatter>);             \
  m.impl("all_gather", &collective<comm::kAllGather>);                               \
  m.impl("all_gather_into", &collective_into<comm::kAllGather>)

TORCH_LIBRARY_IMPL(pcie_allreduce, CPU, m) { PCIE_AR_IMPLS(m); }

TORCH_LIBRARY_IMPL(pcie_allreduce, CUDA, m) { PCIE_AR_IMPLS(m); }

#undef PCIE_AR_IMPLS

}  // namespace pcie_ar::bindings
