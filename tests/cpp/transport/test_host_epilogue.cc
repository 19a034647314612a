// The host executor's fused epilogue (executors/host/epilogue.cc): every ISA it is compiled for
// gives the scalar build's bits, special values included (the GPU's canonical NaN, infinities,
// signed zeros, overflowing squares); a row's bits do not depend on the rows beside it; and the
// results are within rounding of a double-precision reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "plan/epilogue.h"
#include "plan/tactic.h"
#include "transport/executors/element_codecs.h"
#include "transport/executors/host/epilogue.h"
#include "transport/executors/host/reduce.h"

namespace pcie_ar::transport {
namespace {

using plan::DType;

float decode(DType d, const std::vector<uint8_t>& v, int64_t i) {
  if (d == DType::kFP32) {
    float f;
    std::memcpy(&f, v.data() + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, v.data() + 2 * i, 2);
  return d == DType::kBF16 ? Bf16Codec::to_float(h) : Fp16Codec::to_float(h);
}

void encode(DType d, std::vector<uint8_t>& v, int64_t i, float f) {
  if (d == DType::kFP32) {
    std::memcpy(v.data() + 4 * i, &f, 4);
    return;
  }
  const uint16_t h = d == DType::kBF16 ? Bf16Codec::from_float(f) : Fp16Codec::from_float(f);
  std::memcpy(v.data() + 2 * i, &h, 2);
}

std::vector<uint8_t> values(DType d, int64_t n, uint64_t seed, bool specials) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.5f);
  std::vector<uint8_t> v(n * plan::dtype_bytes(d));
  const float odd[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 1e-40f, 6e4f, 3e38f};
  for (int64_t i = 0; i < n; ++i) {
    const bool special = specials && rng() % 97 == 0;
    encode(d, v, i, special ? odd[rng() % std::size(odd)] : normal(rng));
  }
  return v;
}

struct Result {
  std::vector<uint8_t> y, residual_out;
};

Result run(DType d, const std::vector<uint8_t>& sum, const std::vector<uint8_t>& residual,
           const std::vector<uint8_t>& weight, int64_t hidden) {
  Result out{sum, std::vector<uint8_t>(sum.size())};
  const plan::EpilogueArgs args{residual.data(), out.residual_out.data(), weight.data(), hidden,
                                1e-6f};
  run_epilogue(d, out.y.data(), static_cast<int64_t>(sum.size()) / plan::dtype_bytes(d), args);
  return out;
}

class HostEpilogue : public testing::TestWithParam<DType> {
 protected:
  void TearDown() override { set_reduce_isa(best_reduce_isa()); }
};

TEST_P(HostEpilogue, EveryIsaGivesTheScalarBitsSpecialValuesIncluded) {
  const DType d = GetParam();
  for (const int64_t hidden : {int64_t{16}, int64_t{2056}, int64_t{4104}}) {
    const int64_t rows = 5;
    const auto sum = values(d, rows * hidden, 1 + hidden, true);
    const auto residual = values(d, rows * hidden, 2 + hidden, true);
    const auto weight = values(d, hidden, 3 + hidden, false);
    set_reduce_isa(ReduceIsa::kScalar);
    const Result scalar = run(d, sum, residual, weight, hidden);
    int compared = 0;
    for (const ReduceIsa isa : kAllReduceIsas) {
      if (!reduce_isa_available(isa)) continue;
      set_reduce_isa(isa);
      const Result got = run(d, sum, residual, weight, hidden);
      EXPECT_EQ(got.y, scalar.y) << reduce_isa_name(isa) << " hidden " << hidden;
      EXPECT_EQ(got.residual_out, scalar.residual_out) << reduce_isa_name(isa);
      ++compared;
    }
    EXPECT_GE(compared, 1);
  }
}

TEST_P(HostEpilogue, ARowsBitsDoNotDependOnTheRowsBesideIt) {
  const DType d = GetParam();
  const int64_t hidden = 2056;
  const int eb = plan::dtype_bytes(d);
  const auto sum = values(d, 7 * hidden, 11, false);
  const auto residual = values(d, 7 * hidden, 12, false);
  const auto weight = values(d, hidden, 13, false);
  const Result batch = run(d, sum, residual, weight, hidden);
  for (int64_t row = 0; row < 7; ++row) {
    const auto at = [&](const std::vector<uint8_t>& v) {
      return std::vector<uint8_t>(v.begin() + row * hidden * eb,
                                  v.begin() + (row + 1) * hidden * eb);
    };
    const Result alone = run(d, at(sum), at(residual), weight, hidden);
    EXPECT_EQ(alone.y, at(batch.y)) << "row " << row;
    EXPECT_EQ(alone.residual_out, at(batch.residual_out)) << "row " << row;
  }
}

TEST_P(HostEpilogue, IsWithinRoundingOfADoubleReference) {
  const DType d = GetParam();
  const int64_t hidden = 4104;
  const int64_t rows = 3;
  const auto sum = values(d, rows * hidden, 21, false);
  const auto residual = values(d, rows * hidden, 22, false);
  const auto weight = values(d, hidden, 23, false);
  const Result got = run(d, sum, residual, weight, hidden);
  const double ulp = d == DType::kBF16   ? std::ldexp(1.0, -8)
                     : d == DType::kFP16 ? std::ldexp(1.0, -11)
                                         : std::ldexp(1.0, -23);
  for (int64_t row = 0; row < rows; ++row) {
    double squares = 0.0;
    std::vector<double> r(hidden);
    for (int64_t i = 0; i < hidden; ++i) {
      const int64_t at = row * hidden + i;
      r[i] = static_cast<double>(decode(d, sum, at)) + decode(d, residual, at);
      EXPECT_NEAR(decode(d, got.residual_out, at), r[i], ulp * std::fabs(r[i]) + 1e-30);
      squares += r[i] * r[i];
    }
    const double rstd = 1.0 / std::sqrt(squares / hidden + 1e-6);
    for (int64_t i = 0; i < hidden; ++i) {
      const double want = r[i] * rstd * decode(d, weight, i);
      // The sum's rounding, the norm's fp32 work, then y's own rounding.
      EXPECT_NEAR(decode(d, got.y, row * hidden + i), want, 3 * ulp * std::fabs(want) + 1e-6)
          << "row " << row << " element " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, HostEpilogue,
                         testing::Values(DType::kBF16, DType::kFP16, DType::kFP32),
                         [](const testing::TestParamInfo<DType>& info) {
                           return std::string(plan::dtype_name(info.param));
                         });

}  // namespace
}  // namespace pcie_ar::transport
