// The host's fused epilogue (epilogue.h). Rows go through in tiles of local arrays, so the
// compiler vectorises every loop (the operands never alias a tile) while each fp32 operation
// stays the one plan/epilogue.h names: this file is built with -ffp-contract=off (CMakeLists.txt)
// and every NaN is the canonical one, as on the GPU. The same loops are compiled for AVX2 and
// AVX-512 with target attributes and picked at run time like the reducers (active_reduce_isa()):
// lanes change the speed (5x from SSE2 to AVX-512 here), never a bit. NVFP4's block scales are
// one scalar call of plan/quant.h per 16 elements; its amax, codes and packing are tile loops
// (on AVX-512 the NVFP4 form takes about 4x the plain one's time, FP8 about 2.3x).
#include "transport/executors/host/epilogue.h"

#include <algorithm>
#include <bit>
#include <cmath>

#include "plan/quant.h"
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

// NVFP4 (plan/quant.h) of one tile of a row: `v` holds the tile's rounded y as fp32, n a multiple
// of 16; the codes go to `y_q` (n / 2 bytes), the block scales of the tile's n / 16 blocks to
// row `row` (of the whole tensor) from block column `c0` on.
PCIE_AR_EPILOGUE_INLINE void nvfp4_tile(const float* v, int n, float global_scale,
                                        float inv_global_scale, uint8_t* block_scale, int64_t row,
                                        int64_t c0, int64_t k_tiles, uint8_t* y_q) {
  constexpr int kB = plan::kNvfp4Block;
  static_assert(kTile % kB == 0);
  alignas(64) float m[kTile];
  alignas(64) float s[kTile];
  alignas(64) float amax[kTile / kB];
  alignas(64) float out_scale[kTile / kB];
  alignas(64) uint8_t code[kTile];
  // |v| with a NaN made -1, below every magnitude: the block's max then ignores NaNs, and is
  // negative only when all 16 are NaN. Max is exact, so the order of the comparisons is free.
  for (int k = 0; k < n; ++k) {
    const float a = std::fabs(v[k]);
    m[k] = a >= 0.0f ? a : -1.0f;
  }
  for (int j = 0; j < n / kB; ++j) {
    float mx = m[j * kB];
    for (int k = 1; k < kB; ++k) mx = m[j * kB + k] > mx ? m[j * kB + k] : mx;
    amax[j] = mx >= 0.0f ? mx : NAN;
  }
  for (int j = 0; j < n / kB; ++j) {
    const plan::Nvfp4Scale sf = plan::nvfp4_block_scale(amax[j], global_scale, inv_global_scale);
    block_scale[plan::nvfp4_scale_offset(row, c0 + j, k_tiles)] = sf.byte;
    out_scale[j] = sf.out_scale;
  }
  for (int k = 0; k < n; ++k) s[k] = out_scale[k / kB];
  for (int k = 0; k < n; ++k) code[k] = plan::e2m1_from_float(v[k] * s[k]);
  for (int k = 0; k < n / 2; ++k) {
    y_q[k] = static_cast<uint8_t>(code[2 * k] | (code[2 * k + 1] << 4));
  }
}

// One row: `sum` holds the all-reduce's result; with a residual, r = round(sum + residual) goes to
// residual_out, else r = sum (residual_out is `sum` itself). y = round((r * rstd) * w) goes to y
// (when asked for) and its quantised form to y_q (when asked for).
template <typename Codec>
PCIE_AR_EPILOGUE_INLINE void epilogue_rows(const typename Codec::Bits* sum,
                                           const typename Codec::Bits* residual,
                                           typename Codec::Bits* residual_out,
                                           const typename Codec::Bits* weight,
                                           typename Codec::Bits* y, uint8_t* y_q, int64_t rows,
                                           const plan::EpilogueArgs& args) {
  using Bits = typename Codec::Bits;
  const int64_t hidden = args.hidden;
  const float offset = plan::weight_addend(args.weight_offset);
  const bool fp8 = args.quant == plan::Quant::kFp8E4m3;
  const bool nvfp4 = args.quant == plan::Quant::kNvfp4;
  // FP8: the reciprocal of the static scale. NVFP4: G and the reciprocal of G.
  const float global_scale = nvfp4 ? *args.scale : 0.0f;
  const float inv_scale = fp8 || nvfp4 ? 1.0f / *args.scale : 0.0f;
  const int64_t k_tiles = plan::nvfp4_k_tiles(hidden);
  const int64_t scale_columns = hidden / plan::kNvfp4Block;
  alignas(64) float part[kQ];
  alignas(64) float a[kTile];
  alignas(64) float b[kTile];
  alignas(64) Bits bits[kTile];
  alignas(64) uint8_t q[kTile];
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t base = row * hidden;
    std::fill(part, part + kQ, 0.0f);
    // Pass 1: r = round(sum + residual) (or the sum); partial (i mod Q) += r_i * r_i, i ascending.
    for (int64_t i = 0; i < hidden; i += kTile) {
      const int n = static_cast<int>(std::min<int64_t>(kTile, hidden - i));
      const int q0 = static_cast<int>(i % kQ);
      if (residual != nullptr) {
        for (int k = 0; k < n; ++k) a[k] = Codec::to_float(sum[base + i + k]);
        for (int k = 0; k < n; ++k) b[k] = Codec::to_float(residual[base + i + k]);
        for (int k = 0; k < n; ++k) bits[k] = narrow<Codec>(a[k] + b[k]);
        for (int k = 0; k < n; ++k) residual_out[base + i + k] = bits[k];
      } else {
        for (int k = 0; k < n; ++k) bits[k] = sum[base + i + k];
      }
      for (int k = 0; k < n; ++k) {
        const float r = Codec::to_float(bits[k]);
        part[q0 + k] = part[q0 + k] + r * r;
      }
    }
    for (int h = kQ / 2; h >= 1; h /= 2) {
      for (int qi = 0; qi < h; ++qi) part[qi] = part[qi] + part[qi + h];
    }
    const float rstd = 1.0f / std::sqrt(part[0] / static_cast<float>(hidden) + args.eps);
    // Pass 2: y = round((r * rstd) * (weight + offset)); y_q from the rounded y.
    for (int64_t i = 0; i < hidden; i += kTile) {
      const int n = static_cast<int>(std::min<int64_t>(kTile, hidden - i));
      for (int k = 0; k < n; ++k) a[k] = Codec::to_float(residual_out[base + i + k]);
      for (int k = 0; k < n; ++k) b[k] = Codec::to_float(weight[i + k]) + offset;
      for (int k = 0; k < n; ++k) bits[k] = narrow<Codec>((a[k] * rstd) * b[k]);
      if (y != nullptr) {
        for (int k = 0; k < n; ++k) y[base + i + k] = bits[k];
      }
      if (fp8) {
        for (int k = 0; k < n; ++k) {
          q[k] =
              plan::fp8_e4m3_from_float(plan::fp8_e4m3_clamp(Codec::to_float(bits[k]) * inv_scale));
        }
        std::copy(q, q + n, y_q + base + i);
      }
      if (nvfp4) {
        for (int k = 0; k < n; ++k) a[k] = Codec::to_float(bits[k]);
        nvfp4_tile(a, n, global_scale, inv_scale, args.block_scale, args.first_row + row,
                   i / plan::kNvfp4Block, k_tiles, y_q + base / 2 + i / 2);
      }
    }
    if (nvfp4) {  // the row's padding columns
      for (int64_t c = scale_columns; c < 4 * k_tiles; ++c) {
        args.block_scale[plan::nvfp4_scale_offset(args.first_row + row, c, k_tiles)] = 0;
      }
    }
  }
  // The call that holds the tensor's last row zeroes the padding rows, every column of them.
  if (nvfp4 && args.first_row + rows == args.total_rows) {
    for (int64_t r = args.total_rows; r < plan::nvfp4_padded_rows(args.total_rows); ++r) {
      for (int64_t c = 0; c < 4 * k_tiles; ++c) {
        args.block_scale[plan::nvfp4_scale_offset(r, c, k_tiles)] = 0;
      }
    }
  }
}

template <typename Codec>
PCIE_AR_EPILOGUE_INLINE void run_typed(void* output, int64_t numel,
                                       const plan::EpilogueArgs& args) {
  using Bits = typename Codec::Bits;
  epilogue_rows<Codec>(static_cast<const Bits*>(output), static_cast<const Bits*>(args.residual),
                       static_cast<Bits*>(args.residual_out), static_cast<const Bits*>(args.weight),
                       static_cast<Bits*>(args.y), static_cast<uint8_t*>(args.y_q),
                       numel / args.hidden, args);
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
