// The host executor's fused epilogue (executors/host/epilogue.cc): every ISA it is compiled for
// gives the scalar build's bits, special values included (the GPU's canonical NaN, infinities,
// signed zeros, overflowing squares); a row's bits do not depend on the rows beside it; and the
// results are within rounding of a double-precision reference. Its NVFP4 output is a scalar
// reference's, written here from plan/quant.h's functions, byte for byte: codes, block scales in
// the swizzled layout, and the layout's padding zeroed, whether the rows come in one call or in
// several.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "plan/epilogue.h"
#include "plan/quant.h"
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
  plan::EpilogueArgs args;
  args.residual = residual.data();
  args.residual_out = out.residual_out.data();
  args.weight = weight.data();
  args.y = out.y.data();  // y over the sum, as the plain form with a residual leaves it
  args.hidden = hidden;
  args.eps = 1e-6f;
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

// ---------------------------------------------------------------------------------- NVFP4

constexpr uint8_t kUnwritten = 0xA5;  // what the outputs hold before a call

struct Nvfp4Call {
  int64_t first_row = 0;
  int64_t total_rows = 0;
  bool store_y = true;
  float eps = 1e-6f;
};

struct Nvfp4Result {
  std::vector<uint8_t> y, residual_out, y_q;
};

// The NVFP4 form with a residual over `sum`'s rows (rows first_row.. of a tensor of total_rows),
// into `block_scale` (the whole tensor's, kept between calls).
Nvfp4Result run_nvfp4(DType d, const std::vector<uint8_t>& sum,
                      const std::vector<uint8_t>& residual, const std::vector<uint8_t>& weight,
                      int64_t hidden, float global_scale, std::vector<uint8_t>& block_scale,
                      const Nvfp4Call& call) {
  const int64_t numel = static_cast<int64_t>(sum.size()) / plan::dtype_bytes(d);
  Nvfp4Result out{std::vector<uint8_t>(sum.size(), kUnwritten), std::vector<uint8_t>(sum.size()),
                  std::vector<uint8_t>(numel / 2, kUnwritten)};
  std::vector<uint8_t> output = sum;  // the all-reduce's result; a quantised form keeps it
  plan::EpilogueArgs args;
  args.residual = residual.data();
  args.residual_out = out.residual_out.data();
  args.weight = weight.data();
  args.y = call.store_y ? out.y.data() : nullptr;
  args.y_q = out.y_q.data();
  args.scale = &global_scale;
  args.block_scale = block_scale.data();
  args.first_row = call.first_row;
  args.total_rows = call.total_rows;
  args.hidden = hidden;
  args.eps = call.eps;
  args.quant = plan::Quant::kNvfp4;
  run_epilogue(d, output.data(), numel, args);
  EXPECT_EQ(output, sum) << "the quantised form changed the all-reduce's result";
  return out;
}

std::vector<uint8_t> unwritten_block_scale(int64_t total_rows, int64_t hidden) {
  return std::vector<uint8_t>(plan::nvfp4_padded_rows(total_rows) * 4 * plan::nvfp4_k_tiles(hidden),
                              kUnwritten);
}

// plan/quant.h's NVFP4 of y's rows, one element at a time: codes into y_q ([rows, hidden / 2]),
// block scales into block_scale (rows first_row.., padding columns zero).
void nvfp4_reference(DType d, const std::vector<uint8_t>& y, int64_t rows, int64_t hidden,
                     float global_scale, int64_t first_row, std::vector<uint8_t>& y_q,
                     std::vector<uint8_t>& block_scale) {
  const int64_t k_tiles = plan::nvfp4_k_tiles(hidden);
  const float inv_global_scale = 1.0f / global_scale;
  y_q.assign(rows * hidden / 2, 0);
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t c = 0; c < 4 * k_tiles; ++c) {
      if (c >= hidden / plan::kNvfp4Block) {
        block_scale[plan::nvfp4_scale_offset(first_row + row, c, k_tiles)] = 0;
        continue;
      }
      float amax = NAN;  // NaN only if every element is
      for (int64_t k = 0; k < plan::kNvfp4Block; ++k) {
        const float a = std::fabs(decode(d, y, row * hidden + c * plan::kNvfp4Block + k));
        if (!std::isnan(a) && (std::isnan(amax) || a > amax)) amax = a;
      }
      const plan::Nvfp4Scale sf = plan::nvfp4_block_scale(amax, global_scale, inv_global_scale);
      block_scale[plan::nvfp4_scale_offset(first_row + row, c, k_tiles)] = sf.byte;
      for (int64_t k = 0; k < plan::kNvfp4Block; ++k) {
        const int64_t i = row * hidden + c * plan::kNvfp4Block + k;
        const uint8_t code = plan::e2m1_from_float(decode(d, y, i) * sf.out_scale);
        y_q[i / 2] = static_cast<uint8_t>(y_q[i / 2] | (i % 2 == 0 ? code : code << 4));
      }
    }
  }
}

// Inputs for the NVFP4 tests: normal values with the odd special one (or none); row 1 all zeros
// (every block scale 0), row 2 with a NaN in its sum (a NaN rstd: every y NaN); weight element 3
// NaN (one NaN in the first block of every row) and element 40 infinite.
struct Nvfp4Inputs {
  std::vector<uint8_t> sum, residual, weight;
};

Nvfp4Inputs nvfp4_inputs(DType d, int64_t rows, int64_t hidden, uint64_t seed,
                         bool specials = true) {
  Nvfp4Inputs in{values(d, rows * hidden, seed, specials),
                 values(d, rows * hidden, seed + 1, specials), values(d, hidden, seed + 2, false)};
  for (int64_t i = 0; i < hidden && rows > 2; ++i) {
    encode(d, in.sum, hidden + i, 0.0f);
    encode(d, in.residual, hidden + i, i % 3 == 0 ? -0.0f : 0.0f);
  }
  if (rows > 2) encode(d, in.sum, 2 * hidden + hidden / 2, NAN);
  if (hidden > 3) encode(d, in.weight, 3, NAN);
  if (hidden > 40) encode(d, in.weight, 40, INFINITY);
  return in;
}

class HostEpilogueNvfp4 : public testing::TestWithParam<DType> {
 protected:
  void TearDown() override { set_reduce_isa(best_reduce_isa()); }
};

// Byte for byte the scalar reference of the y the call returns, which is the unquantised form's
// y; the block-scale tensor's padding (columns past hidden / 16, rows past the last) is zeroed
// and every other byte written; without y the same bytes. Global scales from the ordinary one
// to ones whose block scales are e4m3 subnormals or zero, or saturate at 448.
TEST_P(HostEpilogueNvfp4, IsTheScalarReferenceOfY) {
  const DType d = GetParam();
  for (const int64_t hidden : {int64_t{16}, int64_t{48}, int64_t{272}, int64_t{2064}}) {
    for (const int64_t rows : {int64_t{3}, int64_t{130}}) {
      const Nvfp4Inputs in = nvfp4_inputs(d, rows, hidden, 100 + hidden + rows);
      const Result plain = run(d, in.sum, in.residual, in.weight, hidden);
      for (const float g : {1.0f, 2688.0f / 7.0f, 0.01f, 1e-4f, 1e5f}) {
        SCOPED_TRACE(testing::Message() << "hidden " << hidden << " rows " << rows << " G " << g);
        auto block_scale = unwritten_block_scale(rows, hidden);
        const Nvfp4Result got =
            run_nvfp4(d, in.sum, in.residual, in.weight, hidden, g, block_scale, {0, rows, true});
        EXPECT_EQ(got.y, plain.y);
        EXPECT_EQ(got.residual_out, plain.residual_out);
        std::vector<uint8_t> want_y_q;
        auto want_block_scale = unwritten_block_scale(rows, hidden);
        for (int64_t r = rows; r < plan::nvfp4_padded_rows(rows); ++r) {
          for (int64_t c = 0; c < 4 * plan::nvfp4_k_tiles(hidden); ++c) {
            want_block_scale[plan::nvfp4_scale_offset(r, c, plan::nvfp4_k_tiles(hidden))] = 0;
          }
        }
        nvfp4_reference(d, got.y, rows, hidden, g, 0, want_y_q, want_block_scale);
        EXPECT_EQ(got.y_q, want_y_q);
        EXPECT_EQ(block_scale, want_block_scale);
        EXPECT_EQ(std::count(block_scale.begin(), block_scale.end(), kUnwritten),
                  std::count(want_block_scale.begin(), want_block_scale.end(), kUnwritten))
            << "a byte left unwritten";

        auto block_scale_no_y = unwritten_block_scale(rows, hidden);
        const Nvfp4Result no_y = run_nvfp4(d, in.sum, in.residual, in.weight, hidden, g,
                                           block_scale_no_y, {0, rows, false});
        EXPECT_EQ(no_y.y_q, got.y_q);
        EXPECT_EQ(block_scale_no_y, block_scale);
        EXPECT_EQ(no_y.y, std::vector<uint8_t>(no_y.y.size(), kUnwritten)) << "y was stored";
      }
    }
  }
}

// Special rows and blocks, in known bytes: an all-zero row has block scales 0 and codes 0 (or
// 0x8 for a -0); a row whose rstd is NaN has scales 0x7F and codes 0x7; a block with a NaN
// element takes its scale from the others; the padding is zero.
TEST_P(HostEpilogueNvfp4, KnownBytesOfSpecialRows) {
  const DType d = GetParam();
  const int64_t hidden = 48;  // 3 blocks: 1 padding column
  const int64_t rows = 4;
  const Nvfp4Inputs in = nvfp4_inputs(d, rows, hidden, 7, false);
  auto block_scale = unwritten_block_scale(rows, hidden);
  const Nvfp4Result got =
      run_nvfp4(d, in.sum, in.residual, in.weight, hidden, 1.0f, block_scale, {0, rows, true});
  const auto scale_at = [&](int64_t r, int64_t c) {
    return block_scale[plan::nvfp4_scale_offset(r, c, plan::nvfp4_k_tiles(hidden))];
  };
  for (int64_t c = 0; c < 3; ++c) EXPECT_EQ(scale_at(1, c), 0) << "zero row, column " << c;
  for (int64_t k = 0; k < hidden / 2; ++k) {
    // Element 3 is NaN (the weight), so its nibble is 0x7; the zeros' signs are y's.
    for (const int64_t i : {2 * k, 2 * k + 1}) {
      const uint8_t code = (got.y_q[hidden / 2 + k] >> (4 * (i % 2))) & 0xF;
      const float y = decode(d, got.y, hidden + i);
      if (std::isnan(y)) {
        EXPECT_EQ(code, 0x7) << i;
      } else {
        EXPECT_EQ(code, std::signbit(y) ? 0x8 : 0x0) << i;
      }
    }
  }
  for (int64_t c = 0; c < 3; ++c) EXPECT_EQ(scale_at(2, c), 0x7F) << "NaN row, column " << c;
  for (int64_t k = 0; k < hidden / 2; ++k) EXPECT_EQ(got.y_q[hidden + k], 0x77) << k;
  // Row 0's first block holds one NaN (element 3): its scale is that of the other 15.
  float amax = 0.0f;
  for (int64_t k = 0; k < 16; ++k) {
    if (k != 3) amax = std::max(amax, std::fabs(decode(d, got.y, k)));
  }
  EXPECT_TRUE(std::isnan(decode(d, got.y, 3)));
  EXPECT_EQ(scale_at(0, 0), plan::nvfp4_block_scale(amax, 1.0f, 1.0f).byte);
  EXPECT_NE(scale_at(0, 0), 0x7F);
  for (int64_t r = 0; r < plan::nvfp4_padded_rows(rows); ++r) {
    for (int64_t c = r < rows ? 3 : 0; c < 4; ++c) EXPECT_EQ(scale_at(r, c), 0) << r << " " << c;
  }
}

// e2m1's rounding through the whole epilogue, where random values seldom reach it: rows whose y
// is exactly their sum times 2^-5 (eps 2^40 swamps the mean of squares, so rstd is 2^-20, and
// every weight is 2^15), each block holding 6 * 2^k (so the block scale is 2^k and y * out_scale
// is y * 2^-k exactly) beside midpoints of e2m1's grid times 2^k and their neighbours in the
// dtype. The midpoints go to the even code, the neighbours to the side they lie on, on every ISA.
TEST_P(HostEpilogueNvfp4, MidpointsRoundToTheEvenCode) {
  const DType d = GetParam();
  const float grid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const auto neighbour = [&](float v, int step) {  // the dtype's next value up (+1) or down (-1)
    std::vector<uint8_t> one(plan::dtype_bytes(d));
    encode(d, one, 0, v);
    uint16_t h;
    std::memcpy(&h, one.data(), 2);
    h = static_cast<uint16_t>(h + step);
    std::memcpy(one.data(), &h, 2);
    return decode(d, one, 0);
  };
  // (value, code) of a positive magnitude; the negative one has bit 3 set.
  std::vector<std::pair<float, uint8_t>> cases;
  for (int lo = 0; lo < 7; ++lo) {
    const float mid = (grid[lo] + grid[lo + 1]) / 2.0f;
    cases.emplace_back(mid, static_cast<uint8_t>((lo & 1) == 0 ? lo : lo + 1));
    cases.emplace_back(neighbour(mid, +1), static_cast<uint8_t>(lo + 1));
    cases.emplace_back(neighbour(mid, -1), static_cast<uint8_t>(lo));
  }
  cases.emplace_back(0.0f, 0);
  std::vector<float> row_values;
  std::vector<uint8_t> want_codes;
  for (const int k : {0, -3, 1}) {
    const float p = std::ldexp(1.0f, k);
    std::vector<std::pair<float, uint8_t>> signed_cases;
    for (const auto& [v, code] : cases) {
      signed_cases.emplace_back(v * p, code);
      signed_cases.emplace_back(-v * p, static_cast<uint8_t>(code | 0x8));
    }
    for (size_t i = 0; i < signed_cases.size(); i += 15) {
      row_values.push_back(6.0f * p);
      want_codes.push_back(0x7);
      for (size_t j = i; j < i + 15; ++j) {
        row_values.push_back(j < signed_cases.size() ? signed_cases[j].first : p);
        want_codes.push_back(j < signed_cases.size() ? signed_cases[j].second : 0x2);
      }
    }
  }
  const int64_t hidden = static_cast<int64_t>(row_values.size());
  ASSERT_EQ(hidden % 16, 0);
  std::vector<uint8_t> y(hidden * plan::dtype_bytes(d));
  std::vector<uint8_t> sum(y.size());
  std::vector<uint8_t> residual(y.size());
  std::vector<uint8_t> weight(y.size());
  for (int64_t i = 0; i < hidden; ++i) {
    encode(d, y, i, row_values[i]);
    ASSERT_EQ(decode(d, y, i), row_values[i]) << "not exact in the dtype: " << row_values[i];
    encode(d, sum, i, row_values[i] * 32.0f);
    encode(d, residual, i, -0.0f);  // x + -0 is x, -0 included
    encode(d, weight, i, std::ldexp(1.0f, 15));
  }
  for (const ReduceIsa isa : kAllReduceIsas) {
    if (!reduce_isa_available(isa)) continue;
    set_reduce_isa(isa);
    auto block_scale = unwritten_block_scale(1, hidden);
    const Nvfp4Result got = run_nvfp4(d, sum, residual, weight, hidden, 1.0f, block_scale,
                                      {0, 1, true, std::ldexp(1.0f, 40)});
    ASSERT_EQ(got.y, y) << "y is not the sum times 2^-5: the construction failed";
    for (int64_t i = 0; i < hidden; ++i) {
      const uint8_t code = (got.y_q[i / 2] >> (4 * (i % 2))) & 0xF;
      EXPECT_EQ(code, want_codes[i])
          << reduce_isa_name(isa) << " element " << i << " value " << row_values[i];
    }
    for (int64_t c = 0; c < hidden / 16; ++c) {
      const float p = std::fabs(row_values[16 * c]) / 6.0f;  // 2^k
      EXPECT_EQ(plan::fp8_e4m3_to_float(
                    block_scale[plan::nvfp4_scale_offset(0, c, plan::nvfp4_k_tiles(hidden))]),
                p)
          << "block " << c;
    }
  }
}

TEST_P(HostEpilogueNvfp4, EveryIsaGivesTheScalarBits) {
  const DType d = GetParam();
  for (const int64_t hidden : {int64_t{16}, int64_t{272}, int64_t{4112}}) {
    const int64_t rows = 5;
    const Nvfp4Inputs in = nvfp4_inputs(d, rows, hidden, 300 + hidden);
    set_reduce_isa(ReduceIsa::kScalar);
    auto scalar_block_scale = unwritten_block_scale(rows, hidden);
    const Nvfp4Result scalar = run_nvfp4(d, in.sum, in.residual, in.weight, hidden, 50.0f,
                                         scalar_block_scale, {0, rows, true});
    int compared = 0;
    for (const ReduceIsa isa : kAllReduceIsas) {
      if (!reduce_isa_available(isa)) continue;
      set_reduce_isa(isa);
      auto block_scale = unwritten_block_scale(rows, hidden);
      const Nvfp4Result got =
          run_nvfp4(d, in.sum, in.residual, in.weight, hidden, 50.0f, block_scale, {0, rows, true});
      EXPECT_EQ(got.y_q, scalar.y_q) << reduce_isa_name(isa) << " hidden " << hidden;
      EXPECT_EQ(block_scale, scalar_block_scale) << reduce_isa_name(isa) << " hidden " << hidden;
      EXPECT_EQ(got.y, scalar.y) << reduce_isa_name(isa);
      ++compared;
    }
    EXPECT_GE(compared, 1);
  }
}

// A row alone (its index in the tensor given by first_row) gives the bytes it has in a batch:
// its codes and its block scales.
TEST_P(HostEpilogueNvfp4, ARowsBytesDoNotDependOnTheRowsBesideIt) {
  const DType d = GetParam();
  const int64_t hidden = 272;
  const int64_t rows = 7;
  const int64_t k_tiles = plan::nvfp4_k_tiles(hidden);
  const int eb = plan::dtype_bytes(d);
  const Nvfp4Inputs in = nvfp4_inputs(d, rows, hidden, 41);
  auto batch_block_scale = unwritten_block_scale(rows, hidden);
  const Nvfp4Result batch = run_nvfp4(d, in.sum, in.residual, in.weight, hidden, 3.0f,
                                      batch_block_scale, {0, rows, true});
  for (int64_t row = 0; row < rows; ++row) {
    const auto at = [&](const std::vector<uint8_t>& v) {
      return std::vector<uint8_t>(v.begin() + row * hidden * eb,
                                  v.begin() + (row + 1) * hidden * eb);
    };
    auto block_scale = unwritten_block_scale(rows, hidden);
    const Nvfp4Result alone = run_nvfp4(d, at(in.sum), at(in.residual), in.weight, hidden, 3.0f,
                                        block_scale, {row, rows, true});
    EXPECT_EQ(alone.y_q, std::vector<uint8_t>(batch.y_q.begin() + row * hidden / 2,
                                              batch.y_q.begin() + (row + 1) * hidden / 2))
        << "row " << row;
    for (int64_t r = 0; r < plan::nvfp4_padded_rows(rows); ++r) {
      for (int64_t c = 0; c < 4 * k_tiles; ++c) {
        const int64_t o = plan::nvfp4_scale_offset(r, c, k_tiles);
        // Its own row's bytes, and the padding rows' when it is the last row; nothing else.
        const bool written = r == row || (row == rows - 1 && r >= rows);
        EXPECT_EQ(block_scale[o], written ? batch_block_scale[o] : kUnwritten)
            << "row " << row << ": byte of row " << r << " column " << c;
      }
    }
  }
}

// Rows in two calls (first_row 0 and h of total_rows), as a streamed call splits them: the same
// bytes as one call, and the padding rows written by the call that holds the last row only.
TEST_P(HostEpilogueNvfp4, TwoCallsOverTheRowsGiveOneCallsBytes) {
  const DType d = GetParam();
  const int64_t hidden = 80;  // 5 blocks: k_tiles 2, 3 padding columns
  const int eb = plan::dtype_bytes(d);
  for (const int64_t rows : {int64_t{130}, int64_t{256}}) {
    for (const int64_t h : {int64_t{1}, int64_t{64}, int64_t{128}, rows - 1}) {
      SCOPED_TRACE(testing::Message() << "rows " << rows << " split at " << h);
      const Nvfp4Inputs in = nvfp4_inputs(d, rows, hidden, 500 + rows + h);
      auto one_block_scale = unwritten_block_scale(rows, hidden);
      const Nvfp4Result one = run_nvfp4(d, in.sum, in.residual, in.weight, hidden, 448.0f,
                                        one_block_scale, {0, rows, true});
      const auto part = [&](const std::vector<uint8_t>& v, int64_t from, int64_t to) {
        return std::vector<uint8_t>(v.begin() + from * hidden * eb, v.begin() + to * hidden * eb);
      };
      auto block_scale = unwritten_block_scale(rows, hidden);
      const Nvfp4Result first = run_nvfp4(d, part(in.sum, 0, h), part(in.residual, 0, h), in.weight,
                                          hidden, 448.0f, block_scale, {0, rows, true});
      if (plan::nvfp4_padded_rows(rows) > rows) {
        const int64_t o = plan::nvfp4_scale_offset(rows, 0, plan::nvfp4_k_tiles(hidden));
        EXPECT_EQ(block_scale[o], kUnwritten) << "the first call wrote a padding row";
      }
      const Nvfp4Result second = run_nvfp4(d, part(in.sum, h, rows), part(in.residual, h, rows),
                                           in.weight, hidden, 448.0f, block_scale, {h, rows, true});
      std::vector<uint8_t> y_q = first.y_q;
      y_q.insert(y_q.end(), second.y_q.begin(), second.y_q.end());
      EXPECT_EQ(y_q, one.y_q);
      EXPECT_EQ(block_scale, one_block_scale);
      EXPECT_EQ(std::count(block_scale.begin(), block_scale.end(), kUnwritten), 0);
    }
  }
}

// Within rounding of the unrounded y: each element decodes (e2m1 * sf / G) to within half the
// e2m1 step at its magnitude times the block's scale, the block scale itself within e4m3's
// rounding of amax / 6 * G.
TEST_P(HostEpilogueNvfp4, DecodesToWithinTheFormatsRoundingOfY) {
  const DType d = GetParam();
  const int64_t hidden = 2064;
  const int64_t rows = 3;
  const Nvfp4Inputs in{values(d, rows * hidden, 61, false), values(d, rows * hidden, 62, false),
                       values(d, hidden, 63, false)};
  const float g = 10.0f;  // block scales well inside e4m3's normal range
  auto block_scale = unwritten_block_scale(rows, hidden);
  const Nvfp4Result got =
      run_nvfp4(d, in.sum, in.residual, in.weight, hidden, g, block_scale, {0, rows, true});
  const float e2m1_values[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t c = 0; c < hidden / 16; ++c) {
      const uint8_t byte =
          block_scale[plan::nvfp4_scale_offset(row, c, plan::nvfp4_k_tiles(hidden))];
      const double sf = plan::fp8_e4m3_to_float(byte);
      double amax = 0.0;
      for (int64_t k = 0; k < 16; ++k) {
        amax = std::max(
            amax, std::fabs(static_cast<double>(decode(d, got.y, row * hidden + c * 16 + k))));
      }
      EXPECT_NEAR(sf, amax / 6.0 * g, amax / 6.0 * g / 16.0 + 1e-9) << row << " " << c;
      for (int64_t k = 0; k < 16; ++k) {
        const int64_t i = row * hidden + c * 16 + k;
        const uint8_t code = (got.y_q[i / 2] >> (4 * (i % 2))) & 0xF;
        const double value = ((code & 0x8) != 0 ? -1.0 : 1.0) * e2m1_values[code & 0x7] * sf / g;
        const double y = decode(d, got.y, i);
        // Half the step between e2m1 values near |y| (at most 1, at 4..6), in y's units, plus
        // the block scale's own rounding.
        EXPECT_NEAR(value, y, (sf / g) * 1.0 + amax / 16.0) << "row " << row << " element " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, HostEpilogue,
                         testing::Values(DType::kBF16, DType::kFP16, DType::kFP32),
                         [](const testing::TestParamInfo<DType>& info) {
                           return std::string(plan::dtype_name(info.param));
                         });

INSTANTIATE_TEST_SUITE_P(Dtypes, HostEpilogueNvfp4, testing::Values(DType::kBF16, DType::kFP16),
                         [](const testing::TestParamInfo<DType>& info) {
                           return std::string(plan::dtype_name(info.param));
                         });

}  // namespace
}  // namespace pcie_ar::transport
