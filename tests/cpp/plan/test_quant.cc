// plan/quant.h, the fused epilogue's FP8 codec, against a decoder written here from the format
// alone (float8_e4m3fn: sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities; only
// S.1111.111 is NaN): every one of the 256 codes, the rounding between each pair of neighbours,
// saturation, NaN, and the clamp in front of it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "plan/quant.h"

namespace pcie_ar::plan {
namespace {

bool is_nan_code(int code) { return (code & 0x7f) == 0x7f; }

// The value of an e4m3fn code (NaN for 0x7F and 0xFF).
float decode(int code) {
  const float sign = (code & 0x80) != 0 ? -1.0f : 1.0f;
  const int exponent = (code >> 3) & 0xf;
  const int mantissa = code & 0x7;
  if (is_nan_code(code)) return std::numeric_limits<float>::quiet_NaN();
  if (exponent == 0) return sign * std::ldexp(static_cast<float>(mantissa), -9);  // m * 2^-9
  return sign * std::ldexp(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
}

uint32_t bits_of(float f) {
  uint32_t u = 0;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float from_bits(uint32_t u) {
  float f = 0.0f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

TEST(Fp8E4m3, TheDecoderKnowsTheFormat) {
  EXPECT_EQ(decode(0x00), 0.0f);
  EXPECT_EQ(decode(0x01), std::ldexp(1.0f, -9));  // the smallest subnormal
  EXPECT_EQ(decode(0x07), 7.0f * std::ldexp(1.0f, -9));
  EXPECT_EQ(decode(0x08), std::ldexp(1.0f, -6));  // the smallest normal
  EXPECT_EQ(decode(0x38), 1.0f);
  EXPECT_EQ(decode(0x7e), 448.0f);
  EXPECT_EQ(decode(0xfe), -448.0f);
  EXPECT_EQ(decode(0xb8), -1.0f);
  EXPECT_TRUE(std::isnan(decode(0x7f)));
  EXPECT_TRUE(std::isnan(decode(0xff)));
  EXPECT_EQ(kFp8E4m3Max, 448.0f);
}

// Every finite code's value encodes to the code itself (both zeros keep their sign); both NaN
// codes' values encode to 0x7F.
TEST(Fp8E4m3, EveryCodesValueEncodesToTheCode) {
  for (int code = 0; code < 256; ++code) {
    const float v = decode(code);
    const int expect = is_nan_code(code) ? 0x7f : code;
    EXPECT_EQ(fp8_e4m3_from_float(v), expect) << "code 0x" << std::hex << code;
  }
}

// Between two neighbouring finite codes of one sign (0 and 2^-9, ..., 416 and 448): the
// midpoint rounds to the even code (mantissa's last bit 0), the fp32 just above it to the upper,
// the fp32 just below it to the lower, and every fp32 strictly between a code and the midpoint to
// that code. The midpoints are exact in fp32 (4 mantissa bits).
TEST(Fp8E4m3, NeighboursRoundToNearestTiesToEven) {
  int pairs = 0;
  for (const int sign : {0x00, 0x80}) {
    for (int low = 0; low < 0x7e; ++low) {
      const int lo = sign | low;
      const int hi = sign | (low + 1);
      const float a = decode(lo);
      const float b = decode(hi);
      const float mid = (a + b) / 2.0f;
      ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(a) + b) / 2.0) << "inexact";
      const int even = (lo & 1) == 0 ? lo : hi;
      EXPECT_EQ(fp8_e4m3_from_float(mid), even) << a << " .. " << b;
      const float toward_b = std::nextafter(mid, b);
      const float toward_a = std::nextafter(mid, a);
      EXPECT_EQ(fp8_e4m3_from_float(toward_b), hi) << toward_b;
      EXPECT_EQ(fp8_e4m3_from_float(toward_a), lo) << toward_a;
      // A quarter of the way from each end.
      EXPECT_EQ(fp8_e4m3_from_float(a + (b - a) / 4.0f), lo) << a;
      EXPECT_EQ(fp8_e4m3_from_float(b - (b - a) / 4.0f), hi) << b;
      ++pairs;
    }
  }
  EXPECT_EQ(pairs, 2 * 126);
}

// Past 448 every finite value saturates to ±448, infinities too (satfinite); the midpoint between
// 448 and 480 (the code 0x7F would be) rounds to even, 448, like the ones below it.
TEST(Fp8E4m3, LargeMagnitudesSaturate) {
  const float inf = std::numeric_limits<float>::infinity();
  for (const float v :
       {448.0f, std::nextafter(448.0f, inf), 464.0f, std::nextafter(464.0f, inf), 479.0f, 480.0f,
        481.0f, 512.0f, 1e4f, 65504.0f, 1e30f, std::numeric_limits<float>::max(), inf}) {
    EXPECT_EQ(fp8_e4m3_from_float(v), 0x7e) << v;
    EXPECT_EQ(fp8_e4m3_from_float(-v), 0xfe) << -v;
  }
  EXPECT_EQ(fp8_e4m3_from_float(std::nextafter(432.0f, 0.0f)), 0x7d);  // 416 .. 448's midpoint
}

// A NaN of either sign and any payload encodes to 0x7F.
TEST(Fp8E4m3, NanEncodesToThePositiveNan) {
  for (const uint32_t bits : {0x7fc00000u, 0xffc00000u, 0x7f800001u, 0xff800001u, 0x7fffffffu,
                              0xffffffffu, 0x7fa00000u}) {
    EXPECT_EQ(fp8_e4m3_from_float(from_bits(bits)), 0x7f) << std::hex << bits;
  }
}

// Below half the smallest subnormal (2^-10) every value is a zero of its sign: fp32 subnormals,
// the smallest normals, 2^-10 itself (a tie, to the even 0), and its fp32 predecessor; just
// above 2^-10 is the smallest subnormal.
TEST(Fp8E4m3, TinyValuesAreZerosOfTheirSign) {
  const float half_ulp = std::ldexp(1.0f, -10);
  for (const float v : {0.0f, from_bits(1u), from_bits(0x007fffffu), from_bits(0x00400000u),
                        std::numeric_limits<float>::min(), 1e-30f, std::ldexp(1.0f, -11),
                        std::nextafter(half_ulp, 0.0f), half_ulp}) {
    EXPECT_EQ(fp8_e4m3_from_float(v), 0x00) << v;
    EXPECT_EQ(fp8_e4m3_from_float(-v), 0x80) << -v;
  }
  EXPECT_EQ(fp8_e4m3_from_float(std::nextafter(half_ulp, 1.0f)), 0x01);
  EXPECT_EQ(fp8_e4m3_from_float(-std::nextafter(half_ulp, 1.0f)), 0x81);
}

// fp32 values sampled across the whole range below 448, both signs: the encoder gives the
// nearest code by the decoder's values (the even one on a tie; a zero keeps the value's sign).
TEST(Fp8E4m3, EncodesToTheNearestCode) {
  double value[256];
  for (int code = 0; code < 256; ++code) value[code] = decode(code);
  int checked = 0;
  for (uint32_t bits = 0; bits < 0x43e00000u; bits += 0x4e6fu) {  // up to 448
    for (const uint32_t sign : {0u, 0x80000000u}) {
      const float v = from_bits(bits | sign);
      const int got = fp8_e4m3_from_float(v);
      ASSERT_FALSE(is_nan_code(got)) << v;
      ASSERT_EQ(got & 0x80, sign != 0 ? 0x80 : 0) << v;
      const double err = std::fabs(value[got] - v);
      for (int other = 0; other < 256; ++other) {
        if (is_nan_code(other) || other == got) continue;
        const double other_err = std::fabs(value[other] - v);
        ASSERT_TRUE(other_err > err || (other_err == err && (got & 1) == 0))
            << v << ": 0x" << std::hex << got << " but 0x" << other;
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 100000);
}

// vLLM's clamp: fminf then fmaxf, so a NaN becomes +448 (and so the byte 0x7E, not the NaN),
// infinities and large values ±448, and everything inside stays as it is, -0 included.
TEST(Fp8E4m3, TheClampIsVllms) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(fp8_e4m3_clamp(std::numeric_limits<float>::quiet_NaN()), 448.0f);
  EXPECT_EQ(fp8_e4m3_clamp(-std::numeric_limits<float>::quiet_NaN()), 448.0f);
  EXPECT_EQ(fp8_e4m3_clamp(1e9f), 448.0f);
  EXPECT_EQ(fp8_e4m3_clamp(-1e9f), -448.0f);
  EXPECT_EQ(fp8_e4m3_clamp(inf), 448.0f);
  EXPECT_EQ(fp8_e4m3_clamp(-inf), -448.0f);
  EXPECT_EQ(fp8_e4m3_clamp(448.5f), 448.0f);
  EXPECT_EQ(fp8_e4m3_clamp(-448.5f), -448.0f);
  for (const float v : {0.0f, 1.0f, -1.0f, 447.9f, -447.9f, 448.0f, -448.0f, 1e-30f}) {
    EXPECT_EQ(bits_of(fp8_e4m3_clamp(v)), bits_of(v)) << v;
  }
  EXPECT_EQ(bits_of(fp8_e4m3_clamp(-0.0f)), bits_of(-0.0f));
  EXPECT_EQ(fp8_e4m3_from_float(fp8_e4m3_clamp(std::numeric_limits<float>::quiet_NaN())), 0x7e);
}

}  // namespace
}  // namespace pcie_ar::plan
