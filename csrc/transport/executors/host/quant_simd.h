// plan/quant.h's FP8 and e2m1 encoders on L lanes at once, for the host's fused epilogue
// (epilogue.cc), bit for bit the scalar functions. GCC/Clang vector extensions: the same source
// compiles to SSE2 (L = 4), AVX2 (8) or AVX-512 (16) inside each ISA's entry point, with every
// select written as a bitwise blend of compare masks, so nothing is left to the vectoriser (which
// turned the scalar encoders into per-lane branches and mask shuffles: 0.5 ns an element for FP8
// on AVX-512, against 0.19 here). Every compare is signed on a magnitude (never negative).
#pragma once

#include <cstdint>
#include <cstring>

#include "plan/quant.h"

namespace pcie_ar::transport::quant_simd {

#define PCIE_AR_QUANT_INLINE __attribute__((always_inline)) inline

// A cast between two of these vector types (same size) is a copy of the bits, as in GCC's vector
// extension. Every function here is inlined into its ISA's entry point, so no vector wider than
// the ISA is ever passed; GCC warns (-Wpsabi) about the ABI such a call would have, at the
// definitions and again at the end of the file that includes this header, so the warning stays
// off for that whole file.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

// A permutation of a vector's lanes by an index vector. Clang has no __builtin_shuffle (its
// __builtin_shufflevector takes literal indices): there the lanes go through memory.
#if defined(__clang__)
#define PCIE_AR_QUANT_SHUFFLE(v, index)                                            \
  [&](auto in, auto at) {                                                          \
    decltype(in) out{};                                                            \
    for (int l = 0; l < static_cast<int>(sizeof(in) / 4); ++l) out[l] = in[at[l]]; \
    return out;                                                                    \
  }(v, index)
#else
#define PCIE_AR_QUANT_SHUFFLE(v, index) __builtin_shuffle(v, index)
#endif

// The lane types of width L (their vector_size must not depend on a template parameter: GCC
// drops it there), and the narrowings to bytes.
#define PCIE_AR_QUANT_LANES(L, HALF)                                                      \
  typedef int32_t i32x##L __attribute__((vector_size(4 * (L))));                          \
  typedef uint32_t u32x##L __attribute__((vector_size(4 * (L))));                         \
  typedef float f32x##L __attribute__((vector_size(4 * (L))));                            \
  typedef uint8_t u8x##L __attribute__((vector_size(L)));                                 \
  typedef uint64_t u64x##HALF __attribute__((vector_size(8 * (HALF))));                   \
  typedef uint8_t u8x##HALF##h __attribute__((vector_size(HALF)));                        \
  PCIE_AR_QUANT_INLINE i32x##L lane_max(i32x##L v) { /* every lane: the max of all */     \
    i32x##L lane{};                                                                       \
    for (int l = 0; l < (L); ++l) lane[l] = l;                                            \
    for (int w = (L) / 2; w >= 1; w /= 2) {                                               \
      const i32x##L other = PCIE_AR_QUANT_SHUFFLE(v, lane ^ w);                           \
      const i32x##L larger = other > v;                                                   \
      v = (larger & other) | (~larger & v);                                               \
    }                                                                                     \
    return v;                                                                             \
  }                                                                                       \
  /* Lanes 2k and 2k + 1 (4-bit codes) into byte k: 2k in the low nibble. */              \
  PCIE_AR_QUANT_INLINE u8x##HALF##h nibble_pairs(i32x##L v) {                             \
    const u64x##HALF pair = (u64x##HALF)v;                                                \
    return __builtin_convertvector((pair & 0xFu) | ((pair >> 28) & 0xF0u), u8x##HALF##h); \
  }
PCIE_AR_QUANT_LANES(4, 2)
PCIE_AR_QUANT_LANES(8, 4)
PCIE_AR_QUANT_LANES(16, 8)
#undef PCIE_AR_QUANT_LANES

// Each lane's low byte (the codes), in lane order. On AVX2 a direct conversion goes lane by lane
// through general registers (GCC 12); through 16-bit lanes and one byte shuffle it is half the
// FP8 encoder's time.
PCIE_AR_QUANT_INLINE u8x4 low_bytes(i32x4 v) { return __builtin_convertvector(v, u8x4); }
PCIE_AR_QUANT_INLINE u8x16 low_bytes(i32x16 v) { return __builtin_convertvector(v, u8x16); }
PCIE_AR_QUANT_INLINE u8x8 low_bytes(i32x8 v) {
  typedef int16_t i16x8 __attribute__((vector_size(16)));
  typedef uint8_t u8x16_bytes __attribute__((vector_size(16)));
  const u8x16_bytes bytes = (u8x16_bytes) __builtin_convertvector(v, i16x8);
#if defined(__clang__)
  const u8x16_bytes even =
      __builtin_shufflevector(bytes, bytes, 0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14);
#else
  const u8x16_bytes even =
      __builtin_shuffle(bytes, u8x16_bytes{0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14});
#endif
  u8x8 low;
  std::memcpy(&low, &even, sizeof(low));
  return low;
}

template <int L>
struct Lanes;
template <>
struct Lanes<4> {
  using I32 = i32x4;
  using U32 = u32x4;
  using F32 = f32x4;
};
template <>
struct Lanes<8> {
  using I32 = i32x8;
  using U32 = u32x8;
  using F32 = f32x8;
};
template <>
struct Lanes<16> {
  using I32 = i32x16;
  using U32 = u32x16;
  using F32 = f32x16;
};

template <typename V>
PCIE_AR_QUANT_INLINE V pick(V mask, V if_set, V otherwise) {
  return (mask & if_set) | (~mask & otherwise);
}

// plan::fp8_e4m3_from_float(plan::fp8_e4m3_clamp(v)) of each lane: the clamp's saturation is the
// normal path's min (every |v| >= 448, infinities and NaNs included, rounds to a code >= 0x7E),
// and its NaN -> +448 is the sign dropped for a NaN. Equal to the scalar pair on all 2^32 inputs
// (checked on each ISA when written; test_host_epilogue.cc's FP8 cases check it in CI).
template <int L>
PCIE_AR_QUANT_INLINE typename Lanes<L>::I32 fp8_codes(typename Lanes<L>::F32 v) {
  using I32 = typename Lanes<L>::I32;
  using U32 = typename Lanes<L>::U32;
  using F32 = typename Lanes<L>::F32;
  const I32 x = (I32)v;
  const I32 a = x & 0x7fffffff;
  const U32 carry = (U32)a + 0x7ffffu + ((a >> 20) & 1);
  const U32 shifted = carry >> 20;  // logical: a NaN's carry passes 2^31
  const I32 biased = (I32)shifted - (120 << 3);
  const I32 normal = pick<I32>(biased < 0x7e, biased, I32{} + 0x7e);
  const F32 stepped = (F32)a + 16384.0f;
  const I32 subnormal = (I32)stepped - 0x46800000;
  const I32 code = pick<I32>(a >= 0x3c800000, normal, subnormal);
  return (~(a > 0x7f800000) & (x >> 24) & 0x80) | code;
}

// plan::e2m1_from_float of each lane, by one rounding add: with E the exponent of max(|v|, 1)
// (e2m1's subnormal step 0.5 is its lowest binade's), |v| + 2^(e + 22) rounds |v| to that
// binade's step, 2^(e - 1), to nearest even, and the bits it adds are the step count k; the code is
// 2e + k (a carry into the next binade is its code), so an even k is an even code. Magnitudes from
// 8 up (infinities and NaNs too) are taken as 8, which saturates to 7 (6.0) like every value past
// 5; a NaN loses its sign. Equal to the scalar function on all 2^32 inputs (checked when written).
template <int L>
PCIE_AR_QUANT_INLINE typename Lanes<L>::I32 e2m1_codes(typename Lanes<L>::F32 v) {
  using I32 = typename Lanes<L>::I32;
  using F32 = typename Lanes<L>::F32;
  const I32 x = (I32)v;
  const I32 a = x & 0x7fffffff;
  const I32 clamped = pick<I32>(a < 0x41000000, a, I32{} + 0x41000000);  // 8.0f
  const I32 binade = clamped & 0x7f800000;
  const I32 exponent = pick<I32>(binade > 0x3f800000, binade, I32{} + 0x3f800000);  // 1.0f
  const I32 magic = exponent + (22 << 23);
  const F32 stepped = (F32)clamped + (F32)magic;
  const I32 code = (exponent >> 22) - 254 + ((I32)stepped - magic);
  const I32 saturated = pick<I32>(code < 0x7, code, I32{} + 0x7);
  return (~(a > 0x7f800000) & (x >> 28) & 0x8) | saturated;
}

// NVFP4's block amax (plan/quant.h) of each 16-element block of v, as the bits of a float: the
// max of the magnitudes with NaNs ignored (a NaN lane counts -1, below every magnitude; signed
// compares of magnitudes order them as their values), NaN only when all 16 are NaN.
template <int L>
PCIE_AR_QUANT_INLINE void block_amax(const float* v, int blocks, int32_t* amax_bits) {
  using I32 = typename Lanes<L>::I32;
  for (int j = 0; j < blocks; ++j) {
    I32 mx = I32{} - 1;
    for (int k = 0; k < plan::kNvfp4Block; k += L) {
      I32 x;
      std::memcpy(&x, v + j * plan::kNvfp4Block + k, sizeof(x));
      const I32 a = x & 0x7fffffff;
      const I32 m = pick<I32>(a > 0x7f800000, I32{} - 1, a);
      mx = pick<I32>(m > mx, m, mx);
    }
    const int32_t top = lane_max(mx)[0];
    amax_bits[j] = top >= 0 ? top : 0x7fc00000;
  }
}

// plan::nvfp4_block_scale of `count` blocks' amax (a multiple of L): each block's scale byte and
// its elements' multiplier; blocks from `blocks` on are padding columns (byte 0).
template <int L>
PCIE_AR_QUANT_INLINE void nvfp4_scales(const int32_t* amax_bits, int blocks, int count,
                                       float global_scale, float inv_global_scale, uint8_t* byte,
                                       float* out_scale) {
  using I32 = typename Lanes<L>::I32;
  using F32 = typename Lanes<L>::F32;
  constexpr float kRcp6 = 0.16666667163372040f;  // as plan::nvfp4_block_scale
  for (int j = 0; j < count; j += L) {
    I32 amax_lanes;
    std::memcpy(&amax_lanes, amax_bits + j, sizeof(amax_lanes));
    const F32 sf = global_scale * ((F32)amax_lanes * kRcp6);
    const I32 sf_bits = (I32)sf;
    // fp8_e4m3_from_float: fp8_codes but for a NaN, which gives 0x7F.
    I32 code = pick<I32>((sf_bits & 0x7fffffff) > 0x7f800000, I32{} + 0x7f, fp8_codes<L>(sf));
    I32 lane{};
    for (int l = 0; l < L; ++l) lane[l] = j + l;
    code = pick<I32>(lane < blocks, code, I32{});
    // plan::fp8_e4m3_to_float of the byte, exact.
    const I32 exponent = (code >> 3) & 0xF;
    const I32 mantissa = code & 0x7;
    const F32 subnormal = __builtin_convertvector(mantissa, F32) * 0.001953125f;
    const I32 normal = ((exponent + 120) << 23) | (mantissa << 20);
    I32 value = pick<I32>(exponent == 0, (I32)subnormal, normal);
    value = pick<I32>((code & 0x7f) == 0x7f, I32{} + 0x7fc00000, value) | ((code & 0x80) << 24);
    const I32 nonzero = (value & 0x7fffffff) != 0;
    const F32 denominator =
        (F32)pick<I32>(nonzero, (I32)((F32)value * inv_global_scale), (I32)(F32{} + 1.0f));
    const F32 multiplier = 1.0f / denominator;
    const I32 multiplier_bits = pick<I32>(nonzero, (I32)multiplier, I32{});
    std::memcpy(out_scale + j, &multiplier_bits, sizeof(multiplier_bits));
    const auto bytes = low_bytes(code);
    std::memcpy(byte + j, &bytes, sizeof(bytes));
  }
}

// y_q[k] = FP8 of v[k] * inv_scale, k < n (vLLM's static quantisation of the rounded y).
template <int L>
PCIE_AR_QUANT_INLINE void fp8_quantise(const float* v, int n, float inv_scale, uint8_t* y_q) {
  using F32 = typename Lanes<L>::F32;
  int k = 0;
  for (; k + L <= n; k += L) {
    F32 f;
    std::memcpy(&f, v + k, sizeof(f));
    const auto bytes = low_bytes(fp8_codes<L>(f * inv_scale));
    std::memcpy(y_q + k, &bytes, sizeof(bytes));
  }
  for (; k < n; ++k) y_q[k] = plan::fp8_e4m3_from_float(plan::fp8_e4m3_clamp(v[k] * inv_scale));
}

// y_q[k / 2] = the e2m1 codes of v[k] * block_scale[k / 16] packed in pairs, k < n (n a multiple
// of 16, which L divides: each vector lies in one block).
template <int L>
PCIE_AR_QUANT_INLINE void e2m1_quantise(const float* v, const float* block_scale, int n,
                                        uint8_t* y_q) {
  static_assert(plan::kNvfp4Block % L == 0);
  using F32 = typename Lanes<L>::F32;
  for (int k = 0; k < n; k += L) {
    F32 f;
    std::memcpy(&f, v + k, sizeof(f));
    const auto bytes = nibble_pairs(e2m1_codes<L>(f * block_scale[k / plan::kNvfp4Block]));
    std::memcpy(y_q + k / 2, &bytes, sizeof(bytes));
  }
}

#undef PCIE_AR_QUANT_INLINE

}  // namespace pcie_ar::transport::quant_simd
