// plan/quant.h's FP8 and e2m1 encoders on L lanes at once, for the host's fused epilogue
// (epilogue.cc), bit for bit the scalar functions. GCC/Clang vector extensions: the same source
// compiles to SSE2 (L = 4), AVX2 (8) or AVX-512 (16) inside each ISA's entry point, with every
// select written as a bitwise blend of compare masks, so nothing is left to the vectoriser (which
// turned the scalar encoders into per-lane branches and mask shuffles: 0.5 ns an element for FP8
// on AVX-512, against 0.19 here). Every compare is signed on a magnitude (never negative).
#pragma once

#include <array>
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

// The lanes of two vectors, a and b, picked by an index vector (index < L: a's lane, else b's
// lane index - L). Clang has no __builtin_shuffle (its __builtin_shufflevector takes literal
// indices): there the lanes go through memory.
#if defined(__clang__)
#define PCIE_AR_QUANT_SHUFFLE2(a, b, index)                                        \
  [&](auto in, auto other, auto at) {                                              \
    constexpr int n = static_cast<int>(sizeof(in) / 4);                            \
    decltype(in) out{};                                                            \
    for (int l = 0; l < n; ++l) out[l] = at[l] < n ? in[at[l]] : other[at[l] - n]; \
    return out;                                                                    \
  }(a, b, index)
#else
#define PCIE_AR_QUANT_SHUFFLE2(a, b, index) __builtin_shuffle(a, b, index)
#endif

// The lane types of width L (their vector_size must not depend on a template parameter: GCC
// drops it there), Lanes<L> naming them, and the codes' packing into nibbles.
template <int L>
struct Lanes;
#define PCIE_AR_QUANT_LANES(L, HALF)                                                      \
  typedef int32_t i32x##L __attribute__((vector_size(4 * (L))));                          \
  typedef float f32x##L __attribute__((vector_size(4 * (L))));                            \
  typedef uint8_t u8x##L __attribute__((vector_size(L)));                                 \
  typedef uint64_t u64x##HALF __attribute__((vector_size(8 * (HALF))));                   \
  typedef uint8_t u8x##HALF##h __attribute__((vector_size(HALF)));                        \
  template <>                                                                             \
  struct Lanes<L> {                                                                       \
    using I32 = i32x##L;                                                                  \
    using F32 = f32x##L;                                                                  \
  };                                                                                      \
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

template <typename V>
PCIE_AR_QUANT_INLINE V pick(V mask, V if_set, V otherwise) {
  return (mask & if_set) | (~mask & otherwise);
}

// Lane-wise signed min and max: one instruction each (vpminsd / vpmaxsd), where a pick of a
// compare takes two.
template <typename V>
PCIE_AR_QUANT_INLINE V lane_min(V a, V b) {
  return a < b ? a : b;
}
template <typename V>
PCIE_AR_QUANT_INLINE V lane_max(V a, V b) {
  return a > b ? a : b;
}

// plan::fp8_e4m3_from_float(plan::fp8_e4m3_clamp(v)) of each lane, by one rounding add, as
// e2m1_codes: |v| is first clamped to 448 (e4m3's largest, exact: infinities, NaNs and every
// |v| > 448 become its code 0x7E, as the clamp saturates them); with E the exponent of
// max(|v|, 2^-6) (the subnormal step 2^-9 is the lowest binade's), |v| + 2^(E + 20) rounds |v| to
// that binade's step, 2^(E - 3), to nearest even, and the bits it adds are the step count k
// (8 <= k <= 16 above 2^-6: 16 is the next binade's first code); the code is 8 (E + 6) + k. A NaN
// loses its sign, as the clamp's NaN -> +448. Equal to the scalar pair on all 2^32 inputs
// (checked on each ISA when written; QuantSimd and the host epilogue's FP8 cases check it in CI).
template <int L>
PCIE_AR_QUANT_INLINE typename Lanes<L>::I32 fp8_codes(typename Lanes<L>::F32 v) {
  using I32 = typename Lanes<L>::I32;
  using F32 = typename Lanes<L>::F32;
  const I32 x = (I32)v;
  const I32 a = x & 0x7fffffff;
  const I32 clamped = lane_min(a, I32{} + 0x43e00000);                      // 448.0f
  const I32 exponent = lane_max(clamped & 0x7f800000, I32{} + 0x3c800000);  // 2^-6
  const I32 magic = exponent + (20 << 23);
  const F32 stepped = (F32)clamped + (F32)magic;
  const I32 code = ((I32)stepped - magic) + ((exponent >> 20) - (121 << 3));
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
  const I32 clamped = lane_min(a, I32{} + 0x41000000);  // 8.0f
  const I32 binade = clamped & 0x7f800000;
  const I32 exponent = lane_max(binade, I32{} + 0x3f800000);  // 1.0f
  const I32 magic = exponent + (22 << 23);
  const F32 stepped = (F32)clamped + (F32)magic;
  const I32 code = (exponent >> 22) - 254 + ((I32)stepped - magic);
  const I32 saturated = lane_min(code, I32{} + 0x7);
  return (~(a > 0x7f800000) & (x >> 28) & 0x8) | saturated;
}

// One level of block_amax's tree: m[0 .. Size) hold Size vectors whose lanes form groups of Size
// lanes (one block each); m[i] becomes the max of the low and high halves of m[2i]'s groups
// followed by m[2i + 1]'s (2 * L / Size groups of Size / 2 lanes), so the blocks stay in order.
template <int L, int Size>
constexpr std::array<int32_t, L> amax_tree_lanes(int half) {
  std::array<int32_t, L> index{};
  constexpr int kGroups = L / Size;
  for (int l = 0; l < L; ++l) {
    const int group = l / (Size / 2);  // m[2i]'s groups, then m[2i + 1]'s
    index[l] = (group < kGroups ? 0 : L) + (group % kGroups) * Size + l % (Size / 2) + half;
  }
  return index;
}
template <int L, int Size>
PCIE_AR_QUANT_INLINE void amax_tree_level(typename Lanes<L>::I32* m) {
  if constexpr (Size > 1) {
    using I32 = typename Lanes<L>::I32;
    static constexpr std::array<int32_t, L> kLow = amax_tree_lanes<L, Size>(0);
    static constexpr std::array<int32_t, L> kHigh = amax_tree_lanes<L, Size>(Size / 2);
    I32 low;
    I32 high;
    std::memcpy(&low, kLow.data(), sizeof(low));
    std::memcpy(&high, kHigh.data(), sizeof(high));
    for (int i = 0; i < Size / 2; ++i) {
      m[i] = lane_max(PCIE_AR_QUANT_SHUFFLE2(m[2 * i], m[2 * i + 1], low),
                      PCIE_AR_QUANT_SHUFFLE2(m[2 * i], m[2 * i + 1], high));
    }
    amax_tree_level<L, Size / 2>(m);
  }
}

// NVFP4's block amax (plan/quant.h) of each 16-element block of v, as the bits of a float: the
// max of the magnitudes with NaNs ignored (a NaN lane counts -1, below every magnitude; signed
// compares of magnitudes order them as their values), NaN only when all 16 are NaN. `count`
// blocks are written (a multiple of L); those from `blocks` on are padding columns (NaN, their
// elements never read). L blocks at a time: each block's lane-wise max as one vector, then a
// transposing tree of two-vector shuffles halves the lanes per block at each level, L - 1 maxima
// for L blocks (a per-block reduction is log2(L)).
template <int L>
PCIE_AR_QUANT_INLINE void block_amax(const float* v, int blocks, int count, int32_t* amax_bits) {
  using I32 = typename Lanes<L>::I32;
  constexpr int kB = plan::kNvfp4Block;
  static_assert(kB % L == 0);
  for (int j0 = 0; j0 < count; j0 += L) {
    I32 m[L];
    for (int b = 0; b < L; ++b) {
      m[b] = I32{} - 1;
      if (j0 + b >= blocks) continue;
      for (int k = 0; k < kB; k += L) {
        I32 x;
        std::memcpy(&x, v + (j0 + b) * kB + k, sizeof(x));
        const I32 a = x & 0x7fffffff;
        m[b] = lane_max(m[b], pick<I32>(a > 0x7f800000, I32{} - 1, a));
      }
    }
    amax_tree_level<L, L>(m);
    const I32 amax = pick<I32>(m[0] >= 0, m[0], I32{} + 0x7fc00000);
    std::memcpy(amax_bits + j0, &amax, sizeof(amax));
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
