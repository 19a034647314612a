// The quantised outputs of the fused epilogue (plan/epilogue.h), in integer arithmetic shared by
// the host executor, the CPU device and the GPU, so a byte never depends on a compiler flag, a
// CPU feature or an instruction only some GPUs have.
//
// FP8 (float8_e4m3fn, static per-tensor scale) is vLLM's own static quantisation, the arithmetic
// of `_C.static_scaled_fp8_quant` and of its fused `rms_norm_static_fp8_quant` kernels (vLLM
// 0.33, csrc/quantization/w8a8/fp8/common.cuh), applied to y already rounded to the activation
// dtype, as those kernels apply it:
//   inv = 1.0f / scale                       one IEEE fp32 division (round to nearest)
//   v   = float(y) * inv                     one fp32 multiply
//   v   = max(-448, min(v, 448))             fminf/fmaxf: a NaN becomes +448
//   q   = e4m3(v)                            round to nearest even (cvt.rn.satfinite.e4m3)
// Torch's native form (`(x * scale.reciprocal()).clamp(-448, 448).to(float8_e4m3fn)`, what vLLM
// runs under Inductor) gives the same bytes for every finite y; for a NaN it gives 0x7F (NaN)
// where vLLM's CUDA op gives 0x7E (448). docs/integration.md says which we follow and why.
#pragma once

#include <cstdint>

#include "plan/host_device.h"

namespace pcie_ar::plan {

inline constexpr float kFp8E4m3Max = 448.0f;

// float8_e4m3fn's byte for |v| <= 448 (any larger finite magnitude saturates to 448, a NaN gives
// 0x7F), rounded to nearest even. e4m3fn: exponent bias 7, 3 mantissa bits, no infinities;
// 0x7E = 448, 0x7F = NaN; subnormals are m * 2^-9.
PCIE_AR_HD uint8_t fp8_e4m3_from_float(float v) {
  uint32_t x = 0;
  __builtin_memcpy(&x, &v, sizeof(x));
  const uint32_t sign = (x >> 24) & 0x80u;
  const uint32_t a = x & 0x7fffffffu;
  // Both roundings are formed and one is selected (no branch: CPU loops vectorise, and the GPU
  // has none to diverge on).
  // |v| >= 2^-6, a normal e4m3 (or saturated): round the 23 mantissa bits to 3, half to even; a
  // carry into the exponent is the correct next binade. Then rebias 127 -> 7; beyond 448 (or
  // inf): satfinite.
  const uint32_t rounded = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  const uint32_t normal = rounded > (120u << 3) + 0x7eu ? 0x7eu : rounded - (120u << 3);
  // Below, a subnormal e4m3 m * 2^-9: |v| + 2^14 is an fp32 whose ulp is 2^-9, so that one add
  // (round to nearest even, the default mode both CPU executors run in: DefaultFloatEnv) rounds
  // |v| to e4m3's subnormal step, and the low bits are m (8 is the smallest normal, 0x08).
  float magnitude = 0.0f;
  __builtin_memcpy(&magnitude, &a, sizeof(magnitude));
  const float stepped = magnitude + 16384.0f;
  uint32_t stepped_bits = 0;
  __builtin_memcpy(&stepped_bits, &stepped, sizeof(stepped_bits));
  const uint32_t subnormal = stepped_bits - 0x46800000u;        // 16384.0f
  const uint32_t code = a >= 0x3c800000u ? normal : subnormal;  // 2^-6
  return static_cast<uint8_t>(a > 0x7f800000u ? 0x7fu : (sign | code));
}

// The clamp of vLLM's scaled_fp8_conversion: fminf(v, 448) then fmaxf(v, -448), each returning
// the non-NaN operand, so a NaN becomes +448. In integer compares of the bits (for magnitudes
// that are not NaN the order of the bits is the order of the values), so CPU loops vectorise:
// float compares under -ftrapping-math leave a branch per element.
PCIE_AR_HD float fp8_e4m3_clamp(float v) {
  constexpr uint32_t kMaxBits = 0x43e00000u;  // 448.0f
  uint32_t x = 0;
  __builtin_memcpy(&x, &v, sizeof(x));
  const uint32_t a = x & 0x7fffffffu;
  const uint32_t clamped =
      a > 0x7f800000u ? kMaxBits : (a > kMaxBits ? (x & 0x80000000u) | kMaxBits : x);
  float f;
  __builtin_memcpy(&f, &clamped, sizeof(f));
  return f;
}

// ---------------------------------------------------------------------------------------------
// NVFP4: e2m1 values in blocks of 16 consecutive elements of a row, one float8_e4m3fn scale per
// block in vLLM's swizzled 128x4 layout, and a global fp32 scale G (vLLM's `input_global_scale`,
// 448 * 6 / amax of the tensor). vLLM's `scaled_fp4_quant` (vLLM 0.33,
// csrc/quantization/fp4/nvfp4_utils.cuh, cvt_warp_fp16_to_fp4) computes, per block:
//   amax      = max |y_i| over the block (NaN ignored; NaN only if all 16 are NaN)
//   SF        = G * (amax * rcp(6))               two fp32 multiplies
//   sf        = e4m3(SF)                          round to nearest even, satfinite (stored byte)
//   out_scale = sf != 0 ? rcp(float(sf) * rcp(G)) : 0
//   q_i       = e2m1(y_i * out_scale)             round to nearest even, satfinite at 6
// where vLLM's rcp is the GPU's approximate reciprocal (rcp.approx.ftz.f32), whose bits no
// document specifies. Here every rcp is the IEEE reciprocal (round to nearest), the same bits on
// every executor; it can differ from vLLM's by an ulp where rcp.approx does, which moves a q_i
// only at a rounding midpoint (docs/integration.md; a Blackwell GPU check is owed).
// Packing: byte k of a row holds element 2k in its low nibble and 2k + 1 in its high nibble.

inline constexpr int kNvfp4Block = 16;
inline constexpr float kNvfp4Max = 6.0f;

// e2m1's 4-bit code of v, rounded to nearest even on {0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturating at
// 6; the sign is bit 3 (so -0 is 0x8). A NaN gives +6 (0x7): e2m1 has no NaN, and satfinite
// conversions to formats without one give their largest value.
PCIE_AR_HD uint8_t e2m1_from_float(float v) {
  uint32_t x = 0;
  __builtin_memcpy(&x, &v, sizeof(x));
  const uint32_t a = x & 0x7fffffffu;
  // Each compare counts one threshold passed, on the magnitude's bits (for non-NaN floats the
  // order of the bits is the order of the values), so CPU loops vectorise (float compares under
  // -ftrapping-math leave a branch per element) and the GPU has no branch. Thresholds and ties
  // in values: > 0.25, >= 0.75, > 1.25, >= 1.75, > 2.5, >= 3.5, > 5 (ties to the even code:
  // 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4).
  const uint32_t code = static_cast<uint32_t>(a > 0x3e800000u) + (a >= 0x3f400000u) +
                        (a > 0x3fa00000u) + (a >= 0x3fe00000u) + (a > 0x40200000u) +
                        (a >= 0x40600000u) + (a > 0x40a00000u);
  return static_cast<uint8_t>(a > 0x7f800000u ? 0x7u : (((x >> 28) & 0x8u) | code));
}

// float8_e4m3fn's value of a byte (exact).
PCIE_AR_HD float fp8_e4m3_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exponent = (b >> 3) & 0xFu;
  const uint32_t mantissa = b & 0x7u;
  uint32_t bits;
  if ((b & 0x7fu) == 0x7fu) {
    bits = 0x7fc00000u;  // NaN
  } else if (exponent == 0) {
    const float m = static_cast<float>(mantissa) * 0.001953125f;  // m * 2^-9, exact
    __builtin_memcpy(&bits, &m, sizeof(bits));
  } else {
    bits = ((exponent + 120u) << 23) | (mantissa << 20);
  }
  bits |= sign;
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}

// The block scale's byte and the multiplier of its elements, from the block's amax (NaN when all
// 16 elements are NaN) and the IEEE reciprocal of G (computed once per call).
struct Nvfp4Scale {
  uint8_t byte;
  float out_scale;
};
PCIE_AR_HD Nvfp4Scale nvfp4_block_scale(float amax, float global_scale, float inv_global_scale) {
  // RN(1 / 6): the IEEE reciprocal (vLLM: rcp.approx.ftz.f32(6)).
  constexpr float kRcp6 = 0.16666667163372040f;  // 0x3E2AAAAB
  const float sf = global_scale * (amax * kRcp6);
  const uint8_t byte = fp8_e4m3_from_float(sf);
  const float sf_value = fp8_e4m3_to_float(byte);
  const float out_scale = sf_value != 0.0f ? 1.0f / (sf_value * inv_global_scale) : 0.0f;
  return {byte, out_scale};
}

// Byte offset of block column `c` of row `r` in vLLM's swizzled scale layout: tiles of 128 rows x
// 4 block columns (512 bytes), row-major over tiles, each tile [32][4][4] with (r % 32,
// (r / 32) % 4, c % 4) innermost. The tensor is [round_up(rows, 128), round_up(hidden / 16, 4)]
// bytes; its padding (rows past the last, columns past hidden / 16) holds zeros.
PCIE_AR_HD int64_t nvfp4_scale_offset(int64_t r, int64_t c, int64_t k_tiles) {
  return ((r / 128) * k_tiles + c / 4) * 512 + (r % 32) * 16 + ((r / 32) % 4) * 4 + (c % 4);
}
PCIE_AR_HD int64_t nvfp4_k_tiles(int64_t hidden) { return (hidden / kNvfp4Block + 3) / 4; }
PCIE_AR_HD int64_t nvfp4_padded_rows(int64_t rows) { return (rows + 127) / 128 * 128; }

}  // namespace pcie_ar::plan
