// The host's fused epilogue (epilogue.h). Rows go through in tiles of local arrays, so the
// compiler vectorises every loop (the operands never alias a tile) while each fp32 operation
// stays the one plan/epilogue.h names: this file is built with -ffp-contract=off (CMakeLists.txt)
// and every NaN is the canonical one, as on the GPU. The same loops are compiled for AVX2 and
// AVX-512 with target attributes and picked at run time like the reducers (active_reduce_isa()):
// lanes change the speed (5x from SSE2 to AVX-512 here), never a bit. The quantised outputs go
// through quant_simd.h's encoders on the entry point's vector width (L lanes): FP8's codes, and
// NVFP4's block amax, 16 block scales at once, codes and packing. On AVX-512, 64 rows of 4096
// bf16: the FP8 form takes about 1.2x the plain one's time, NVFP4 about 1.6x.
#include "transport/executors/host/epilogue.h"

#include <algorithm>
#include <cmath>

#include "plan/quant.h"
#include "transport/executors/element_codecs.h"
#include "transport/executors/host/quant_simd.h"
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
// row `row` (of the whole tensor) from block column `c0` on (a multiple of 4: a tile is whole
// groups of 4 columns, which lie side by side in the layout, so each group is one 4-byte store;
// a row's last group, when partial, stores its padding columns' zeros with it).
// plan::nvfp4_block_scale's arithmetic, one vector over the tile's blocks.
template <int L>
PCIE_AR_EPILOGUE_INLINE void nvfp4_tile(const float* v, int n, float global_scale,
                                        float inv_global_scale, uint8_t* block_scale, int64_t row,
                                        int64_t c0, int64_t k_tiles, uint8_t* y_q) {
  constexpr int kB = plan::kNvfp4Block;
  constexpr int kBlocks = kTile / kB;
  static_assert(kTile % (4 * kB) == 0 && kBlocks % 16 == 0);
  alignas(64) int32_t amax[kBlocks];
  alignas(64) uint8_t scale_byte[kBlocks];
  alignas(64) float out_scale[kBlocks];
  const int blocks = n / kB;
  quant_simd::block_amax<L>(v, blocks, kBlocks, amax);
  quant_simd::nvfp4_scales<L>(amax, blocks, kBlocks, global_scale, inv_global_scale, scale_byte,
                              out_scale);
  for (int g = 0; g < (blocks + 3) / 4; ++g) {
    __builtin_memcpy(block_scale + plan::nvfp4_scale_offset(row, c0 + 4 * g, k_tiles),
                     scale_byte + 4 * g, 4);
  }
  quant_simd::e2m1_quantise<L>(v, out_scale, n, y_q);
}

// The padding rows of NVFP4's block scales, zeroed by the call that holds the tensor's last row:
// rows total_rows .. of its last 128-row tile. Within a 512-byte tile a row's bytes sit at the
// same places in every column group, so one mask of the tile's kept bytes clears them all (the
// host executor runs a tensor's rounds one after another: nothing else writes the tile meanwhile).
inline void nvfp4_zero_padding_rows(uint8_t* block_scale, int64_t total_rows, int64_t k_tiles) {
  const int64_t kept = total_rows % 128;
  if (kept == 0) return;
  alignas(64) uint8_t keep[512];
  for (int i = 0; i < 512; ++i) {
    const int64_t local_row = i / 16 + 32 * ((i % 16) / 4);  // nvfp4_scale_offset's inverse
    keep[i] = local_row < kept ? 0xFF : 0x00;
  }
  uint8_t* tiles = block_scale + (total_rows / 128) * k_tiles * 512;
  for (int64_t t = 0; t < k_tiles; ++t) {
    for (int i = 0; i < 512; ++i) tiles[t * 512 + i] &= keep[i];
  }
}

// One row: `sum` holds the all-reduce's result; with a residual, r = round(sum + residual) goes to
// residual_out, else r = sum (residual_out is `sum` itself). y = round((r * rstd) * w) goes to y
// (when asked for) and its quantised form to y_q (when asked for).
template <typename Codec, int L>
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
  alignas(64) float part[kQ];
  alignas(64) float a[kTile];
  alignas(64) float b[kTile];
  alignas(64) Bits bits[kTile];
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
        for (int k = 0; k < n; ++k) {  // one loop: apart, the copy became a `rep movs`
          const Bits r = narrow<Codec>(a[k] + b[k]);
          bits[k] = r;
          residual_out[base + i + k] = r;
        }
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
      const auto y_at = [&](int k) { return narrow<Codec>((a[k] * rstd) * b[k]); };
      // The quantisations take the rounded y, widened (exact), from `a`.
      if (!fp8 && !nvfp4) {
        for (int k = 0; k < n; ++k) y[base + i + k] = y_at(k);
      } else if (y != nullptr) {
        for (int k = 0; k < n; ++k) {
          const Bits q = y_at(k);
          y[base + i + k] = q;
          a[k] = Codec::to_float(q);
        }
      } else {  // y_q only: y is never stored as the dtype's bits
        for (int k = 0; k < n; ++k) a[k] = Codec::to_float(y_at(k));
      }
      if (fp8) quant_simd::fp8_quantise<L>(a, n, inv_scale, y_q + base + i);
      if (nvfp4) {
        nvfp4_tile<L>(a, n, global_scale, inv_scale, args.block_scale, args.first_row + row,
                      i / plan::kNvfp4Block, k_tiles, y_q + base / 2 + i / 2);
      }
    }
  }
  // The call that holds the tensor's last row zeroes the padding rows, every column of them.
  if (nvfp4 && args.first_row + rows == args.total_rows) {
    nvfp4_zero_padding_rows(args.block_scale, args.total_rows, k_tiles);
  }
}

template <typename Codec, int L>
PCIE_AR_EPILOGUE_INLINE void run_typed(void* output, int64_t numel,
                                       const plan::EpilogueArgs& args) {
  using Bits = typename Codec::Bits;
  epilogue_rows<Codec, L>(static_cast<const Bits*>(output), static_cast<const Bits*>(args.residual),
                          static_cast<Bits*>(args.residual_out),
                          static_cast<const Bits*>(args.weight), static_cast<Bits*>(args.y),
                          static_cast<uint8_t*>(args.y_q), numel / args.hidden, args);
}

// One entry point per ISA: the loops above inlined into a function compiled for it, the quantised
// outputs' encoders on its vector width (L lanes of 32 bits).
#define PCIE_AR_EPILOGUE_ENTRY(name, L, attributes)                    \
  attributes void name(plan::DType dtype, void* output, int64_t numel, \
                       const plan::EpilogueArgs& args) {               \
    switch (dtype) {                                                   \
      case plan::DType::kBF16:                                         \
        return run_typed<Bf16Codec, L>(output, numel, args);           \
      case plan::DType::kFP16:                                         \
        return run_typed<Fp16Codec, L>(output, numel, args);           \
      case plan::DType::kFP32:                                         \
        return run_typed<Fp32Codec, L>(output, numel, args);           \
    }                                                                  \
  }

PCIE_AR_EPILOGUE_ENTRY(epilogue_baseline, 4, )
#if defined(__x86_64__)
PCIE_AR_EPILOGUE_ENTRY(epilogue_avx2, 8, __attribute__((target("avx2,f16c"))))
PCIE_AR_EPILOGUE_ENTRY(epilogue_avx512, 16,
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
