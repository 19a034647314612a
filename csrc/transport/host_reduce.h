// The host executor's arithmetic: dst = sum of sources in order, accumulated in fp32 and
// rounded once, for bf16, fp16 and fp32. Pure integer bit manipulation for the conversions, so
// results never depend on compiler flags or CPU features, and they match the CUDA executor's
// __fadd_rn / round-to-nearest-even bit for bit.
#pragma once

#include <cstdint>

#include "plan/tactic.h"

namespace pcie_ar::transport {

// dst[0, num_vecs) = srcs[0] + ... + srcs[num_srcs - 1] over 16-byte vectors, in operand order.
// Every source vector is loaded before dst is stored, so dst may alias a source elementwise.
using ReduceFn = void (*)(uint8_t* dst, const uint8_t* const* srcs, int num_srcs, int64_t num_vecs);

ReduceFn reducer_for(plan::DType dtype);

}  // namespace pcie_ar::transport
