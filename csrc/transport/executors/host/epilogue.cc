// The host's fused epilogue (epilogue.h). Rows go through in tiles of local arrays, so the
// compiler vectorises every loop (the operands never alias a tile) while each fp32 operation
// stays the one plan/epilogue.h names: this file is built with -ffp-contract=off (CMakeLists.txt)
// and every NaN is the canonical one, as on the GPU. The same loops are compiled for AVX2 and
// AVX-512 with target attributes and picked at run time like the reducers (active_reduce_isa()):
// lanes change the speed (5x from SSE2 to AVX-512 here), never a bit.
#include "transport/executors/host/epilogue.h"

#include <algorithm>
#include <cmath>

#include "transport/executors/element_codecs.h"
#include "transport/executors/host/reduce.h"

namespace pcie_ar::transport {
namespace {

constexpr int kQ = plan::kNormPartials;
constexpr int kTile = 256;  // elements per tile: one tile of each operand stays in L1
static_assert(kQ % kTile == 0);

#define PCIE_AR_EPILOGUE_INLINE __attribute__((always_inline)) inline

// NaN payloads: every GPU operation returns the canonical NaN, and a NaN only ever makes NaNs
// downstream (sums and products), so canonicalising a value once, before it is narrowed into a
// result, gives the GPU's bits without a select after every operation.
template <typename Codec>
PCIE_AR_EPILOGUE_INLINE typename Codec::Bits narrow(float f) {
  return Codec::from_float(canonical_nan(f));
}

template <typename Codec>
PCIE_AR_EPILOGUE_INLINE void epilogue_rows(const typename Codec::Bits* sum,
                                           const typename Codec::Bits* residual,
                                           typename Codec::Bits* residual_out,
                                           const typename Codec::Bits* weight,
                                           typename Codec::Bits* y, int64_t rows, int64_t hidden,
                                           float eps) {
  using Bits = typename Codec::Bits;
  alignas(64) float part[kQ];
  alignas(64) float a[kTile];
  alignas(64) float b[kTile];
  alignas(64) Bits bits[kTile];
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t base = row * hidden;
    std::fill(part, part + kQ, 0.0f);
    // Pass 1: residual_out = round(sum + residual); partial (i mod Q) += r_i * r_i, i ascending.
    for (int64_t i = 0; i < hidden; i += kTile) {
      const int n = static_cast<int>(std::min<int64_t>(kTile, hidden - i));
      const int q0 = static_cast<int>(i % kQ);
      for (int k = 0; k < n; ++k) a[k] = Codec::to_float(sum[base + i + k]);
      for (int k = 0; k < n; ++k) b[k] = Codec::to_float(residual[base + i + k]);
      for (int k = 0; k < n; ++k) {
        bits[k] = narrow<Codec>(a[k] + b[k]);
        const float r = Codec::to_float(bits[k]);
        part[q0 + k] = part[q0 + k] + r * r;
      }
      for (int k = 0; k < n; ++k) residual_out[base + i + k] = bits[k];
    }
    for (int h = kQ / 2; h >= 1; h /= 2) {
      for (int q = 0; q < h; ++q) part[q] = part[q] + part[q + h];
    }
    const float rstd = 1.0f / std::sqrt(part[0] / static_cast<float>(hidden) + eps);
    // Pass 2: y = round((r * rstd) * weight).
    for (int64_t i = 0; i < hidden; i += kTile) {
      const int n = static_cast<int>(std::min<int64_t>(kTile, hidden - i));
      for (int k = 0; k < n; ++k) a[k] = Codec::to_float(residual_out[base + i + k]);
      for (int k = 0; k < n; ++k) b[k] = Codec::to_float(weight[i + k]);
      for (int k = 0; k < n; ++k) bits[k] = narrow<Codec>((a[k] * rstd) * b[k]);
      for (int k = 0; k < n; ++k) y[base + i + k] = bits[k];
    }
  }
}

template <typename Codec>
PCIE_AR_EPILOGUE_INLINE void run_typed(void* output, int64_t numel,
                                       const plan::EpilogueArgs& args) {
  using Bits = typename Codec::Bits;
  epilogue_rows<Codec>(static_cast<const Bits*>(output), static_cast<const Bits*>(args.residual),
                       static_cast<Bits*>(args.residual_out), static_cast<const Bits*>(args.weight),
                       static_cast<Bits*>(output), numel / args.hidden, args.hidden, args.eps);
}

// One entry point per ISA: the loops above inlined into a function compiled for it.
#define PCIE_AR_EPILOGUE_ENTRY(name, attributes)                       \
  attributes void name(plan::DType dtype, void* output, int64_t numel, \
                       const plan::EpilogueArgs& args) {               \
    switch (dtype) {                                                   \
      case plan::DType::kBF16:                                         \
        return run_typed<Bf16Codec>(output, numel, args);              \
      case plan::DType::kFP16:                                         \
        return run_typed<Fp16Codec>(output, numel, args);              \
      case plan::DType::kFP32:                                         \
        return run_typed<Fp32Codec>(output, numel, args);              \
    }                                                                  \
  }

PCIE_AR_EPILOGUE_ENTRY(epilogue_baseline, )
#if defined(__x86_64__)
PCIE_AR_EPILOGUE_ENTRY(epilogue_avx2, __attribute__((target("avx2,f16c"))))
PCIE_AR_EPILOGUE_ENTRY(epilogue_avx512,
                       __attribute__((target("avx512f,avx512bw,avx512vl,prefer-vector-width=512"))))
#endif

}  // namespace

void run_epilogue(plan::DType dtype, void* output, int64_t numel, const plan::EpilogueArgs& args) {
#if defined(__x86_64__)
  switch (active_reduce_isa()) {
    case ReduceIsa::kAvx512:
      return epilogue_avx512(dtype, output, numel, args);
    case ReduceIsa::kAvx2:
      return epilogue_avx2(dtype, output, numel, args);
    case ReduceIsa::kScalar:
      break;
  }
#endif
  epilogue_baseline(dtype, output, numel, args);
}

}  // namespace pcie_ar::transport
