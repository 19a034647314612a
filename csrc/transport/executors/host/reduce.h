// The host executor's arithmetic: dst = sum of sources in order, accumulated in fp32 from +0
// and rounded once, for bf16, fp16 and fp32, matching the CUDA executor's __fadd_rn and
// round-to-nearest-even bit for bit.
//
// Three implementations of one function, chosen at run time by what the CPU supports:
//   scalar  portable C++, integer bit manipulation for the conversions, so its results never
//           depend on compiler flags or CPU features. The reference (the tests' oracle) and
//           the fallback on every CPU.
//   avx2    x86-64 AVX2 (+F16C for fp16): 8 lanes.
//   avx512  x86-64 AVX-512 F/BW/VL: 16 lanes.
// A NaN result is always the canonical quiet NaN (fp32 0x7fffffff, bf16 and fp16 0x7fff), the
// one the GPU's adds and conversions produce, whatever payloads the NaN operands carry: which
// payload an IEEE add keeps depends on operand order, which the compiler may swap.
// The vector variants are bit-identical to the scalar one
// (tests/cpp/transport/test_host_reduce.cc): the same fp32 additions in the same order, the same
// integer rounding for bf16, and the hardware's round-to-nearest-even conversion for fp16, whose
// NaN, infinity, overflow and subnormal results equal the scalar codec's.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

#include "plan/names.h"
#include "plan/tactic.h"
#include "transport/executors/element_codecs.h"  // kCanonicalNaN

namespace pcie_ar::transport {

// dst[0, num_vecs) = +0 + srcs[0] + ... + srcs[num_srcs - 1] over 16-byte vectors, in operand
// order (num_srcs >= 2: one operand is a copy, which moves bits and is not a reduce).
// Every source vector is loaded before dst is stored, so dst may alias a source elementwise.
using ReduceFn = void (*)(uint8_t* dst, const uint8_t* const* srcs, int num_srcs, int64_t num_vecs);

enum class ReduceIsa : uint8_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };
inline constexpr auto kReduceIsaNames = plan::name_table<ReduceIsa>(
    "host reduce kernels",
    {{ReduceIsa::kScalar, "scalar"}, {ReduceIsa::kAvx2, "avx2"}, {ReduceIsa::kAvx512, "avx512"}});
inline constexpr auto kAllReduceIsas = kReduceIsaNames.values();  // narrowest first

inline std::string_view reduce_isa_name(ReduceIsa isa) { return kReduceIsaNames.name_of(isa); }
inline std::optional<ReduceIsa> parse_reduce_isa(std::string_view name) {
  return kReduceIsaNames.find(name);
}

// Whether this build has `isa` and this CPU runs it. kScalar always.
bool reduce_isa_available(ReduceIsa isa);

// The widest available ISA.
ReduceIsa best_reduce_isa();

// The ISA reducer_for(dtype) uses: best_reduce_isa() unless set_reduce_isa() chose another.
ReduceIsa active_reduce_isa();
// Process-wide choice for later calls (results do not change with it, only speed, so ranks may
// differ). Throws std::invalid_argument naming the ISA and what this CPU offers when
// `isa` is not available.
void set_reduce_isa(ReduceIsa isa);

// The reducer of `isa` for `dtype`, or nullptr when `isa` is not available.
ReduceFn reducer_for(plan::DType dtype, ReduceIsa isa);
// The reducer of the active ISA.
ReduceFn reducer_for(plan::DType dtype);

}  // namespace pcie_ar::transport
