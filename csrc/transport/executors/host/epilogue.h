// The fused epilogue on the host (plan/epilogue.h says what it computes, in which order): after
// every slice of the all-reduce is done, each row of the output becomes
// residual_out = sum + residual and output = rms_norm(residual_out) * weight, bit for bit what
// the CUDA executor computes.
#pragma once

#include <cstdint>

#include "plan/epilogue.h"
#include "plan/tactic.h"

namespace pcie_ar::transport {

// `output` holds `numel` elements of the sum (numel / args.hidden rows) and receives y.
// args.residual_out may be args.residual; neither may overlap `output`.
void run_epilogue(plan::DType dtype, void* output, int64_t numel, const plan::EpilogueArgs& args);

}  // namespace pcie_ar::transport
