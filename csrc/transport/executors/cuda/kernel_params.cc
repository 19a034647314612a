// How a launch's parameters are put together; see kernel_params.h.
#include "transport/executors/cuda/kernel_params.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace pcie_ar::transport {

LaunchParams make_launch_params(const WorkspaceView& workspace, const ProgramSet& programs,
                                plan::DType dtype, int blocks, int threads,
                                const void* const* inputs, void* const* outputs, int64_t numel,
                                uint32_t signature, int first_rank, int ranks_in_launch,
                                int64_t chunk_stride) {
  LaunchParams p;
  p.layout = workspace.layout;
  for (int r = 0; r < plan::kMaxWorld; ++r) {
    p.bases[r] = workspace.bases[r];
    p.counters[r] = workspace.counters[r] != nullptr ? workspace.counters[r] : workspace.bases[r];
    p.programs[r] = programs.device[r];
  }
  for (int r = first_rank; r >= 0 && r < first_rank + ranks_in_launch && r < plan::kMaxWorld; ++r) {
    p.inputs[r] = inputs[r];
    p.outputs[r] = outputs[r];
  }
  p.diag = workspace.diag;
  p.claim = workspace.claim;
  p.numel = numel;
  p.chunk_stride_vecs = chunk_stride * plan::dtype_bytes(dtype) / plan::kVectorBytes;
  p.timeout_ns = workspace.timeout_ns;
  p.signature = signature;
  p.dtype = dtype;
  p.direction = programs.direction;
  p.blocks = blocks;
  p.threads = threads;
  p.first_rank = first_rank;
  p.ranks_in_launch = ranks_in_launch;
  p.pdl = workspace.pdl;
  p.slots_in_host_memory = workspace.slots_in_host_memory;
  return p;
}

void set_epilogue(LaunchParams& p, int rank, const plan::EpilogueArgs& args) {
  if (args.quant == plan::Quant::kNvfp4 && p.dtype == plan::DType::kFP32) {
    // The ops refuse it too (comm/arguments.cc): NVFP4 quantises bf16 or fp16.
    throw std::invalid_argument("the CUDA executor's NVFP4 epilogue takes bf16 or fp16 rows");
  }
  EpilogueTensors& t = p.epilogue[rank];
  t.residual = args.residual;
  t.residual_out = args.residual_out;
  t.weight = args.weight;
  t.y = args.y;
  t.y_q = args.y_q;
  t.scale = args.scale;
  t.block_scale = args.block_scale;
  p.hidden = args.hidden;
  p.eps = args.eps;
  p.weight_offset = args.weight_offset;
  p.quant = args.quant;
  p.first_row = args.first_row;
  p.total_rows = args.total_rows;
}

uint64_t timeout_to_ns(double timeout_s) {
  if (!std::isfinite(timeout_s) || timeout_s < 0) {
    throw std::invalid_argument(
        "the all-reduce timeout must be a finite number of seconds >= 0 "
        "(0 waits forever), got " +
        std::to_string(timeout_s));
  }
  const double ns = timeout_s * 1e9;
  return ns >= 1.8e19 ? 0 : static_cast<uint64_t>(ns);  // beyond 570 years: forever
}

}  // namespace pcie_ar::transport
