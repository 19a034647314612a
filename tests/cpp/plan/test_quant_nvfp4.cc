// plan/quant.h's NVFP4 part against the formats alone: e2m1 (sign, 2 exponent bits of bias 1, 1
// mantissa bit: {0, 0.5, 1, 1.5, 2, 3, 4, 6}) over its whole grid, with the rounding between each
// pair of neighbours, saturation, signed zero, NaN and subnormals; the e4m3 decoder as the exact
// inverse of the encoder; the block scale on hand-computed cases; and the swizzled layout of the
// block scales against the [m tiles][k tiles][32][4][4] array it is built from.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <set>
#include <vector>

#include "plan/quant.h"

namespace pcie_ar::plan {
namespace {

// e2m1's values by code, magnitude bits only.
constexpr float kE2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

uint32_t bits_of(float f) {
  uint32_t u = 0;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

TEST(E2m1, EveryCodesValueEncodesToTheCode) {
  for (int code = 0; code < 16; ++code) {
    const float v = (code & 0x8) != 0 ? -kE2m1[code & 0x7] : kE2m1[code & 0x7];
    EXPECT_EQ(e2m1_from_float(v), code) << "code " << code << " value " << v;
  }
  EXPECT_EQ(kNvfp4Max, 6.0f);
  EXPECT_EQ(kNvfp4Block, 16);
}

// Between neighbours a < b of one sign: the midpoint goes to the even code (mantissa bit 0), the
// fp32 just above it to b, just below it to a; the values a quarter of the way from each end to
// theirs.
TEST(E2m1, NeighboursRoundToNearestTiesToEven) {
  for (const float sign : {1.0f, -1.0f}) {
    const uint8_t sign_bit = sign < 0.0f ? 0x8 : 0x0;
    for (int lo = 0; lo < 7; ++lo) {
      const float a = sign * kE2m1[lo];
      const float b = sign * kE2m1[lo + 1];
      const float mid = (a + b) / 2.0f;  // exact
      const uint8_t code_a = sign_bit | lo;
      const uint8_t code_b = sign_bit | (lo + 1);
      const uint8_t even = (lo & 1) == 0 ? code_a : code_b;
      EXPECT_EQ(e2m1_from_float(mid), even) << a << " .. " << b;
      const float toward_b = std::nextafter(mid, b);
      const float toward_a = std::nextafter(mid, a);
      EXPECT_EQ(e2m1_from_float(toward_b), code_b) << toward_b;
      EXPECT_EQ(e2m1_from_float(toward_a), code_a) << toward_a;
      EXPECT_EQ(e2m1_from_float(a + (b - a) / 4.0f), code_a) << a;
      EXPECT_EQ(e2m1_from_float(b - (b - a) / 4.0f), code_b) << b;
    }
  }
}

TEST(E2m1, SaturatesAtSix) {
  for (const float v : {std::nextafter(6.0f, 7.0f), 6.5f, 7.0f, 100.0f, 1e30f,
                        std::numeric_limits<float>::max(), INFINITY}) {
    EXPECT_EQ(e2m1_from_float(v), 0x7) << v;
    EXPECT_EQ(e2m1_from_float(-v), 0xF) << -v;
  }
}

TEST(E2m1, SignedZeroNanAndSubnormals) {
  EXPECT_EQ(e2m1_from_float(0.0f), 0x0);
  EXPECT_EQ(e2m1_from_float(-0.0f), 0x8);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(e2m1_from_float(nan), 0x7);
  EXPECT_EQ(e2m1_from_float(-nan), 0x7);  // e2m1 has no NaN: +6, whatever the sign bit
  EXPECT_EQ(e2m1_from_float(std::numeric_limits<float>::signaling_NaN()), 0x7);
  ASSERT_NE(bits_of(-nan) & 0x80000000u, 0u);
  for (const float tiny : {std::numeric_limits<float>::denorm_min(), 1e-40f,
                           std::numeric_limits<float>::min(), 1e-30f}) {
    EXPECT_EQ(e2m1_from_float(tiny), 0x0) << tiny;
    EXPECT_EQ(e2m1_from_float(-tiny), 0x8) << -tiny;
  }
}

// e4m3fn's value of a byte, written from the format: m * 2^-9 for exponent 0, else
// (1 + m / 8) * 2^(e - 7); S.1111.111 is NaN.
float e4m3_value(int b) {
  const float sign = (b & 0x80) != 0 ? -1.0f : 1.0f;
  const int e = (b >> 3) & 0xF;
  const int m = b & 0x7;
  if ((b & 0x7F) == 0x7F) return std::numeric_limits<float>::quiet_NaN();
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), -9);
  return sign * std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
}

TEST(Fp8E4m3ToFloat, InvertsTheEncoderOnEveryByte) {
  for (int b = 0; b < 256; ++b) {
    const float v = fp8_e4m3_to_float(static_cast<uint8_t>(b));
    if ((b & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << b;
      EXPECT_EQ(fp8_e4m3_from_float(v), 0x7F);
      continue;
    }
    EXPECT_EQ(bits_of(v), bits_of(e4m3_value(b))) << "byte 0x" << std::hex << b;
    EXPECT_EQ(fp8_e4m3_from_float(v), b) << "byte 0x" << std::hex << b;
  }
  EXPECT_EQ(fp8_e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0x38), 1.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(bits_of(fp8_e4m3_to_float(0x80)), 0x80000000u);  // -0
}

TEST(Nvfp4BlockScale, HandComputedCases) {
  // RN(1/6) as the header gives it.
  const float rcp6 = 1.0f / 6.0f;
  EXPECT_EQ(bits_of(rcp6), 0x3E2AAAABu);

  // amax 0: byte 0, multiplier 0 (every element's code is then a zero of its sign).
  Nvfp4Scale s = nvfp4_block_scale(0.0f, 1.0f, 1.0f);
  EXPECT_EQ(s.byte, 0x00);
  EXPECT_EQ(s.out_scale, 0.0f);

  // amax 6, G 1: SF = 6 * RN(1/6) = 1.0000000298..., which rounds to 1.0f: byte 0x38 (1.0),
  // multiplier 1 / (1 * 1) = 1. Six then encodes to 0x7.
  s = nvfp4_block_scale(6.0f, 1.0f, 1.0f);
  EXPECT_EQ(s.byte, 0x38);
  EXPECT_EQ(s.out_scale, 1.0f);
  EXPECT_EQ(e2m1_from_float(6.0f * s.out_scale), 0x7);

  // amax 3, G 896 (= 448 * 6 / 3): 3 * RN(1/6) rounds to 0.5, SF = 448 exactly: byte 0x7E;
  // RN(1/896) * 448 rounds to 0.5, so the multiplier is 2.
  s = nvfp4_block_scale(3.0f, 896.0f, 1.0f / 896.0f);
  EXPECT_EQ(s.byte, 0x7E);
  EXPECT_EQ(s.out_scale, 2.0f);

  // Saturation: SF = 1000 * (6 * RN(1/6)) = 1000 > 448: byte 0x7E (448); the multiplier
  // 1 / (448 * RN(1/1000)), one IEEE operation each.
  s = nvfp4_block_scale(6.0f, 1000.0f, 1.0f / 1000.0f);
  EXPECT_EQ(s.byte, 0x7E);
  const float inv_g = 1.0f / 1000.0f;
  const float product = 448.0f * inv_g;
  EXPECT_EQ(s.out_scale, 1.0f / product);
  // An infinite amax saturates the same way.
  EXPECT_EQ(nvfp4_block_scale(INFINITY, 1.0f, 1.0f).byte, 0x7E);
  EXPECT_EQ(nvfp4_block_scale(INFINITY, 1.0f, 1.0f).out_scale, 1.0f / 448.0f);

  // An e4m3 subnormal SF: amax 6 * 2^-9 (G 1) gives SF 2^-9 (byte 0x01), multiplier 512.
  s = nvfp4_block_scale(6.0f * std::ldexp(1.0f, -9), 1.0f, 1.0f);
  EXPECT_EQ(s.byte, 0x01);
  EXPECT_EQ(s.out_scale, 512.0f);
  // Below half the smallest subnormal the SF is 0: byte 0, multiplier 0.
  s = nvfp4_block_scale(6.0f * std::ldexp(1.0f, -11), 1.0f, 1.0f);
  EXPECT_EQ(s.byte, 0x00);
  EXPECT_EQ(s.out_scale, 0.0f);

  // A NaN amax (all 16 elements NaN): byte 0x7F, a NaN multiplier, so every code is 0x7.
  s = nvfp4_block_scale(std::numeric_limits<float>::quiet_NaN(), 1.0f, 1.0f);
  EXPECT_EQ(s.byte, 0x7F);
  EXPECT_TRUE(std::isnan(s.out_scale));
  EXPECT_EQ(e2m1_from_float(1.0f * s.out_scale), 0x7);
}

// Row r, column c of the [rows, cols] scale matrix sits at the position of (r / 128, c / 4, r % 32,
// (r / 32) % 4, c % 4) in a row-major [padded_rows / 128][k_tiles][32][4][4] array.
TEST(Nvfp4ScaleLayout, IsTheSwizzledArrayRowMajor) {
  const int64_t rows = 300;
  const int64_t cols = 20;  // hidden 320
  const int64_t k_tiles = nvfp4_k_tiles(cols * kNvfp4Block);
  ASSERT_EQ(k_tiles, 5);
  const int64_t padded = nvfp4_padded_rows(rows);
  ASSERT_EQ(padded, 384);
  // Walk the array in memory order; each position names its (row, column).
  std::vector<int64_t> expected(padded * 4 * k_tiles, -1);
  int64_t offset = 0;
  for (int64_t m_tile = 0; m_tile < padded / 128; ++m_tile) {
    for (int64_t k_tile = 0; k_tile < k_tiles; ++k_tile) {
      for (int64_t outer = 0; outer < 32; ++outer) {
        for (int64_t inner = 0; inner < 4; ++inner) {
          for (int64_t kk = 0; kk < 4; ++kk) {
            const int64_t r = m_tile * 128 + inner * 32 + outer;
            const int64_t c = k_tile * 4 + kk;
            expected[r * 4 * k_tiles + c] = offset++;
          }
        }
      }
    }
  }
  ASSERT_EQ(offset, padded * 4 * k_tiles);
  std::set<int64_t> seen;
  for (int64_t r = 0; r < padded; ++r) {
    for (int64_t c = 0; c < 4 * k_tiles; ++c) {
      const int64_t o = nvfp4_scale_offset(r, c, k_tiles);
      EXPECT_EQ(o, expected[r * 4 * k_tiles + c]) << "row " << r << " column " << c;
      EXPECT_GE(o, 0);
      EXPECT_LT(o, padded * 4 * k_tiles);
      seen.insert(o);
    }
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), padded * 4 * k_tiles) << "offsets collide";
  // The 300 x 20 real entries alone are distinct and inside the tensor.
  std::set<int64_t> real;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) real.insert(nvfp4_scale_offset(r, c, k_tiles));
  }
  EXPECT_EQ(static_cast<int64_t>(real.size()), rows * cols);
}

TEST(Nvfp4ScaleLayout, TilesAndPaddedRows) {
  EXPECT_EQ(nvfp4_k_tiles(16), 1);
  EXPECT_EQ(nvfp4_k_tiles(64), 1);
  EXPECT_EQ(nvfp4_k_tiles(80), 2);
  EXPECT_EQ(nvfp4_k_tiles(4096), 64);
  EXPECT_EQ(nvfp4_k_tiles(4112), 65);
  EXPECT_EQ(nvfp4_padded_rows(0), 0);
  EXPECT_EQ(nvfp4_padded_rows(1), 128);
  EXPECT_EQ(nvfp4_padded_rows(128), 128);
  EXPECT_EQ(nvfp4_padded_rows(129), 256);
}

}  // namespace
}  // namespace pcie_ar::plan
