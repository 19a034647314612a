// The host epilogue's vector encoders (executors/host/quant_simd.h) against plan/quant.h's scalar
// functions, at every lane count the host compiles them for (4: SSE2 and other CPUs, 8: AVX2,
// 16: AVX-512; here all in the baseline ISA, where the compiler splits the wider vectors, which
// changes no lane's value). Inputs: every bf16 value with several low halves (so every fp32
// exponent, both signs, the FP8 and e2m1 rounding midpoints and their neighbours, subnormals,
// infinities, NaNs of both signs), and scaled by factors that saturate and underflow.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "plan/quant.h"
#include "transport/executors/host/quant_simd.h"

namespace pcie_ar::transport {
namespace {

float from_bits(uint32_t x) {
  float f;
  std::memcpy(&f, &x, sizeof(f));
  return f;
}

// 65536 bf16 patterns x these low halves: the midpoints of FP8's 3-bit and e2m1's 1-bit mantissa
// rounding sit at low bits 0x80000 / 0x200000 of the fp32 (inside the bf16 part), and their
// neighbours one ulp either side come from the low halves 0xFFFF and 0x0001.
std::vector<float> inputs() {
  std::vector<float> v;
  for (const uint32_t low : {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0xFFFFu, 0x5A5Au}) {
    for (uint32_t high = 0; high < 0x10000u; ++high) v.push_back(from_bits((high << 16) | low));
  }
  return v;
}

template <int L>
void expect_fp8_equal(const std::vector<float>& v, float inv_scale) {
  std::vector<uint8_t> got(v.size());
  const int n = static_cast<int>(v.size()) - 3;  // a tail shorter than L goes the scalar way
  quant_simd::fp8_quantise<L>(v.data(), n, inv_scale, got.data());
  for (int k = 0; k < n; ++k) {
    const uint8_t want = plan::fp8_e4m3_from_float(plan::fp8_e4m3_clamp(v[k] * inv_scale));
    ASSERT_EQ(got[k], want) << "L " << L << " input " << v[k] << " inv_scale " << inv_scale;
  }
}

TEST(QuantSimd, Fp8EqualsTheScalarEncoderAtEveryLaneCount) {
  const std::vector<float> v = inputs();
  for (const float inv_scale : {1.0f, 3.0f, 0.0078125f, 1e-30f, 1e30f}) {
    expect_fp8_equal<4>(v, inv_scale);
    expect_fp8_equal<8>(v, inv_scale);
    expect_fp8_equal<16>(v, inv_scale);
  }
}

template <int L>
void expect_nvfp4_equal(const std::vector<float>& v, float global_scale) {
  constexpr int kB = plan::kNvfp4Block;
  const float inv_global_scale = 1.0f / global_scale;
  constexpr int kBlocks = 16;  // blocks per call, as the epilogue's tiles hold them
  std::vector<int32_t> amax(kBlocks);
  std::vector<uint8_t> bytes(kBlocks);
  std::vector<float> out_scale(kBlocks);
  std::vector<uint8_t> codes(kBlocks * kB / 2);
  for (size_t start = 0; start + kBlocks * kB <= v.size(); start += kBlocks * kB) {
    const float* tile = v.data() + start;
    const int blocks = start % 3 == 0 ? kBlocks : 13;  // also padding columns
    quant_simd::block_amax<L>(tile, blocks, kBlocks, amax.data());
    quant_simd::nvfp4_scales<L>(amax.data(), blocks, kBlocks, global_scale, inv_global_scale,
                                bytes.data(), out_scale.data());
    quant_simd::e2m1_quantise<L>(tile, out_scale.data(), blocks * kB, codes.data());
    for (int j = 0; j < kBlocks; ++j) {
      if (j >= blocks) {
        ASSERT_EQ(bytes[j], 0) << "padding column " << j;
        continue;
      }
      float block_max = -1.0f;
      for (int k = 0; k < kB; ++k) {
        const float a = std::fabs(tile[j * kB + k]);
        if (a == a && a > block_max) block_max = a;
      }
      const float want_amax =
          block_max >= 0.0f ? block_max : std::numeric_limits<float>::quiet_NaN();
      const plan::Nvfp4Scale want =
          plan::nvfp4_block_scale(want_amax, global_scale, inv_global_scale);
      ASSERT_EQ(bytes[j], want.byte) << "L " << L << " block at " << start + j * kB;
      ASSERT_EQ(std::memcmp(&out_scale[j], &want.out_scale, 4), 0) << "L " << L;
      for (int k = 0; k < kB; ++k) {
        const uint8_t code = plan::e2m1_from_float(tile[j * kB + k] * want.out_scale);
        const int index = j * kB + k;
        ASSERT_EQ((codes[index / 2] >> (4 * (index % 2))) & 0xF, code)
            << "L " << L << " element " << start + index << " = " << tile[index];
      }
    }
  }
}

TEST(QuantSimd, Nvfp4EqualsTheScalarEncoderAtEveryLaneCount) {
  const std::vector<float> v = inputs();
  for (const float global_scale : {1.0f, 672.0f, 1e-20f, 1e20f}) {
    expect_nvfp4_equal<4>(v, global_scale);
    expect_nvfp4_equal<8>(v, global_scale);
    expect_nvfp4_equal<16>(v, global_scale);
  }
}

}  // namespace
}  // namespace pcie_ar::transport
