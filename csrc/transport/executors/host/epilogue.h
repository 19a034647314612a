// The fused epilogue on the host (plan/epilogue.h says what it computes, in which order): after
// every slice of the all-reduce is done, each row becomes residual_out = sum + residual (or the
// sum), y = rms_norm(residual_out) * (weight + weight_offset) and y's quantised form, bit for
// bit what the CUDA executor computes.
#pragma once

#include <cstdint>

#include "plan/epilogue.h"
#include "plan/tactic.h"

namespace pcie_ar::transport {

// `output` holds `numel` elements of the sum (numel / args.hidden rows); y goes to args.y (which
// may be `output`), y_q to args.y_q. args.residual_out may be args.residual, or, without a
// residual, is `output` itself.
void run_epilogue(plan::DType dtype, void* output, int64_t numel, const plan::EpilogueArgs& args);

}  // namespace pcie_ar::transport
