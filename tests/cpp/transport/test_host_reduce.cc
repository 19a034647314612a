// The vector reducers (AVX2, AVX-512) against the scalar reference, bit for bit: every dtype,
// 1..8 operands, lengths that exercise the unrolled loop, the single-group loop and the scalar
// tail, unaligned operands, in-place aliasing, and operand bits drawn from the whole encoding
// space (NaNs with payloads, infinities, subnormals, values that round across a binade or to
// infinity). An ISA this CPU does not run is skipped, saying so.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "plan/layout.h"
#include "plan/step.h"
#include "plan/tactic.h"
#include "transport/executors/host/reduce.h"

namespace pcie_ar::transport {
namespace {

using plan::DType;
using plan::kVectorBytes;

struct Case {
  DType dtype;
  ReduceIsa isa;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  return std::string(plan::dtype_name(info.param.dtype)) + "_" +
         std::string(reduce_isa_name(info.param.isa));
}

// Operand bytes: uniformly random bits, so every class of value (NaN payloads, infinities,
// subnormals, zeros of both signs) turns up, with a share of small exponents mixed in for
// fp32 so that sums and cancellations land in the subnormal range too.
std::vector<uint8_t> random_bytes(DType dtype, int64_t bytes, std::mt19937_64& rng) {
  std::vector<uint8_t> out(static_cast<size_t>(bytes));
  for (size_t i = 0; i + 8 <= out.size(); i += 8) {
    uint64_t bits = rng();
    if (dtype == DType::kFP32 && (bits & 3) == 0) bits &= 0x80ffffff80ffffffull;  // tiny values
    std::memcpy(&out[i], &bits, 8);
  }
  return out;
}

std::string hex_at(const std::vector<uint8_t>& bytes, size_t offset, int width) {
  std::ostringstream s;
  s << "0x" << std::hex;
  for (int b = width - 1; b >= 0; --b) {
    s << ((bytes[offset + b] >> 4) & 0xf) << (bytes[offset + b] & 0xf);
  }
  return s.str();
}

class VectorReducer : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    if (!reduce_isa_available(GetParam().isa)) {
      GTEST_SKIP() << "this CPU (or build) does not run " << reduce_isa_name(GetParam().isa);
    }
    reference_ = reducer_for(GetParam().dtype, ReduceIsa::kScalar);
    vector_ = reducer_for(GetParam().dtype, GetParam().isa);
    ASSERT_NE(reference_, nullptr);
    ASSERT_NE(vector_, nullptr);
  }

  // Runs both reducers on the same operands (each `misalign` bytes past a 64-byte boundary)
  // and expects identical bytes; `in_place` >= 0 makes dst alias that operand.
  void expect_identical(int num_srcs, int64_t num_vecs, int64_t misalign, int in_place,
                        std::mt19937_64& rng) {
    const DType dtype = GetParam().dtype;
    const int64_t bytes = num_vecs * kVectorBytes;
    const int64_t stride = bytes + 128;
    const std::vector<uint8_t> operands = random_bytes(dtype, stride * num_srcs, rng);
    std::vector<uint8_t> results[2];
    const ReduceFn fns[2] = {reference_, vector_};
    for (int which = 0; which < 2; ++which) {
      // A fresh 64-byte aligned copy each time: in place overwrites an operand.
      std::vector<uint8_t> data(operands.size() + 64);
      auto* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(data.data()) + 63) &
                                              ~uintptr_t{63});
      std::copy(operands.begin(), operands.end(), base);
      const uint8_t* srcs[plan::kMaxSources];
      for (int s = 0; s < num_srcs; ++s) srcs[s] = base + s * stride + misalign;
      std::vector<uint8_t> out(static_cast<size_t>(bytes) + 64, 0xa5);
      uint8_t* dst = in_place >= 0 ? const_cast<uint8_t*>(srcs[in_place]) : out.data() + misalign;
      fns[which](dst, srcs, num_srcs, num_vecs);
      results[which].assign(dst, dst + bytes);
      if (in_place < 0) {  // nothing written past the end
        for (size_t i = static_cast<size_t>(misalign + bytes); i < out.size(); ++i) {
          ASSERT_EQ(out[i], 0xa5) << "wrote past the end at byte " << i - misalign;
        }
      }
    }
    const int width = plan::dtype_bytes(dtype);
    for (size_t i = 0; i < results[0].size(); i += width) {
      if (std::memcmp(&results[0][i], &results[1][i], width) != 0) {
        std::ostringstream operand_bits;
        for (int s = 0; s < num_srcs; ++s) {
          operand_bits << " " << hex_at(operands, s * stride + misalign + i, width);
        }
        FAIL() << reduce_isa_name(GetParam().isa) << " differs from scalar at element " << i / width
               << " of " << results[0].size() / width << " (" << num_srcs << " operands, misalign "
               << misalign << ", in_place " << in_place << "): scalar "
               << hex_at(results[0], i, width) << ", vector " << hex_at(results[1], i, width)
               << "; operands" << operand_bits.str();
      }
    }
  }

  ReduceFn reference_ = nullptr;
  ReduceFn vector_ = nullptr;
};

TEST_P(VectorReducer, MatchesScalarBitForBitOnRandomBits) {
  std::mt19937_64 rng(0x5eed + static_cast<int>(GetParam().dtype));
  // 0..40 vectors covers every tail length of every group size; 257 and 4099 are long runs
  // with a tail.
  std::vector<int64_t> lengths;
  for (int64_t n = 0; n <= 40; ++n) lengths.push_back(n);
  lengths.push_back(257);
  lengths.push_back(4099);
  for (int num_srcs = 1; num_srcs <= plan::kMaxSources; ++num_srcs) {
    for (const int64_t n : lengths) {
      expect_identical(num_srcs, n, 0, -1, rng);
      if (HasFatalFailure() || HasNonfatalFailure()) return;
    }
  }
}

TEST_P(VectorReducer, MatchesScalarOnUnalignedOperands) {
  std::mt19937_64 rng(0xa119 + static_cast<int>(GetParam().dtype));
  for (const int64_t misalign : {16, 32, 48}) {
    for (const int num_srcs : {2, 3, 8}) {
      expect_identical(num_srcs, 133, misalign, -1, rng);
      if (HasFatalFailure() || HasNonfatalFailure()) return;
    }
  }
}

TEST_P(VectorReducer, MatchesScalarInPlace) {
  std::mt19937_64 rng(0x1ace + static_cast<int>(GetParam().dtype));
  for (const int num_srcs : {2, 4, 8}) {
    for (const int alias : {0, num_srcs - 1}) {
      expect_identical(num_srcs, 77, 0, alias, rng);
      if (HasFatalFailure() || HasNonfatalFailure()) return;
    }
  }
}

// Every 16-bit pattern as one operand, against a random partner and alone: all NaN payloads,
// both infinities, every subnormal, and every rounding boundary of the conversions.
using HalfPrecisionReducer = VectorReducer;

TEST_P(HalfPrecisionReducer, MatchesScalarForEveryPattern) {
  const DType dtype = GetParam().dtype;
  std::vector<uint16_t> all(65536);
  for (uint32_t v = 0; v < all.size(); ++v) all[v] = static_cast<uint16_t>(v);
  std::mt19937_64 rng(0xe7e7);
  std::vector<uint16_t> partner(all.size());
  for (auto& p : partner) p = static_cast<uint16_t>(rng());
  const int64_t num_vecs = static_cast<int64_t>(all.size() * 2 / kVectorBytes);
  for (const int num_srcs : {1, 2, 3}) {
    const uint8_t* srcs[3] = {reinterpret_cast<const uint8_t*>(all.data()),
                              reinterpret_cast<const uint8_t*>(partner.data()),
                              reinterpret_cast<const uint8_t*>(all.data())};
    std::vector<uint16_t> expected(all.size()), got(all.size());
    reference_(reinterpret_cast<uint8_t*>(expected.data()), srcs, num_srcs, num_vecs);
    vector_(reinterpret_cast<uint8_t*>(got.data()), srcs, num_srcs, num_vecs);
    for (size_t i = 0; i < all.size(); ++i) {
      ASSERT_EQ(expected[i], got[i])
          << reduce_isa_name(GetParam().isa) << " " << plan::dtype_name(dtype) << " with "
          << num_srcs << " operands: pattern 0x" << std::hex << all[i] << " (partner 0x"
          << partner[i] << ")";
    }
  }
}

// Hand-picked fp32 sums whose rounding to bf16/fp16 sits on an edge: exact ties (both
// directions), carries into the next binade and to infinity, results just below and above the
// half subnormal range, and NaN inputs of every kind (their sums are the canonical NaN).
TEST_P(VectorReducer, MatchesScalarOnRoundingEdges) {
  const std::vector<uint32_t> fp32_bits = {
      0x3f808000, 0x3f818000, 0x3f80ffff, 0x3f7fffff, 0x7f7fffff, 0x7f7f8000, 0x477ff000,
      0x477fefff, 0x477fe000, 0x38800000, 0x387fffff, 0x33000000, 0x33000001, 0x32ffffff,
      0x00000001, 0x80000001, 0x007fffff, 0x7f800000, 0xff800000, 0x7f800001, 0x7fc00001,
      0xffbfffff, 0x7fffffff, 0x00000000, 0x80000000, 0x3c00ffff, 0xc77fefff, 0x4b800001};
  // fp32: each edge plus zero (NaN payloads, signed zeros, subnormals pass the add).
  const DType dtype = GetParam().dtype;
  const int width = plan::dtype_bytes(dtype);
  std::vector<float> values;
  for (const uint32_t b : fp32_bits) values.push_back(std::bit_cast<float>(b));
  if (dtype == DType::kFP32) {
    values.resize((values.size() + 3) / 4 * 4, 1.0f);
    std::vector<float> zeros(values.size(), 0.0f), expected(values.size()), got(values.size());
    const uint8_t* srcs[2] = {reinterpret_cast<const uint8_t*>(values.data()),
                              reinterpret_cast<const uint8_t*>(zeros.data())};
    const int64_t num_vecs = static_cast<int64_t>(values.size() * 4 / kVectorBytes);
    reference_(reinterpret_cast<uint8_t*>(expected.data()), srcs, 2, num_vecs);
    vector_(reinterpret_cast<uint8_t*>(got.data()), srcs, 2, num_vecs);
    EXPECT_EQ(0, std::memcmp(expected.data(), got.data(), values.size() * 4));
    return;
  }
  // 16-bit dtypes: operands near each edge's top half (the edge's own bf16 neighbourhood),
  // summed 2, 3 and 5 times, so the fp32 sums fall on ties, binade carries and overflow.
  std::vector<uint16_t> halves;
  for (const uint32_t b : fp32_bits) {
    const uint16_t top = static_cast<uint16_t>(b >> 16);
    for (int d = -2; d <= 2; ++d) halves.push_back(static_cast<uint16_t>(top + d));
  }
  halves.resize((halves.size() + 7) / 8 * 8, 0x3c00);
  std::vector<uint16_t> expected(halves.size()), got(halves.size());
  const int64_t num_vecs = static_cast<int64_t>(halves.size() * width / kVectorBytes);
  for (const int num_srcs : {2, 3, 5}) {
    const uint8_t* srcs[5];
    for (auto& s : srcs) s = reinterpret_cast<const uint8_t*>(halves.data());
    reference_(reinterpret_cast<uint8_t*>(expected.data()), srcs, num_srcs, num_vecs);
    vector_(reinterpret_cast<uint8_t*>(got.data()), srcs, num_srcs, num_vecs);
    for (size_t i = 0; i < halves.size(); ++i) {
      ASSERT_EQ(expected[i], got[i]) << num_srcs << " x 0x" << std::hex << halves[i];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    EveryDtypeAndIsa, VectorReducer,
    testing::Values(Case{DType::kBF16, ReduceIsa::kAvx2}, Case{DType::kFP16, ReduceIsa::kAvx2},
                    Case{DType::kFP32, ReduceIsa::kAvx2}, Case{DType::kBF16, ReduceIsa::kAvx512},
                    Case{DType::kFP16, ReduceIsa::kAvx512}, Case{DType::kFP32, ReduceIsa::kAvx512}),
    case_name);

// A NaN sum is the canonical quiet NaN whatever the operands' payloads, signs and order, for
// every reducer: the result bits cannot depend on which payload an add happens to keep.
TEST(HostReduce, NaNSumsAreTheCanonicalQuietNaN) {
  const uint16_t bf16_nans[8] = {0x7fc1, 0xffe5, 0x7f81, 0xffff, 0xff81, 0x7fa0, 0xffc0, 0x7fff};
  const uint16_t fp16_nans[8] = {0x7e01, 0xfe84, 0x7c01, 0x7fff, 0xfc01, 0x7d00, 0xffe5, 0x7fc1};
  const uint32_t fp32_nans[4] = {0x7fc00001, 0xffb893d2, 0x7f800001, 0xffffffff};
  for (const ReduceIsa isa : kAllReduceIsas) {
    if (!reduce_isa_available(isa)) continue;
    for (const DType dtype : plan::kAllDTypes) {
      const ReduceFn reduce = reducer_for(dtype, isa);
      // 64 vectors so the vector loops (not just their scalar tail) see the NaNs; lane i holds
      // NaN operand i % k against another NaN or a number.
      const int64_t num_vecs = 64;
      const size_t count = static_cast<size_t>(num_vecs * kVectorBytes / plan::dtype_bytes(dtype));
      std::vector<uint8_t> a(num_vecs * kVectorBytes), b(a.size()), out(a.size());
      for (size_t i = 0; i < count; ++i) {
        if (dtype == DType::kFP32) {
          const uint32_t x = fp32_nans[i % 4];
          const uint32_t y = i % 3 == 0 ? std::bit_cast<uint32_t>(1.5f) : fp32_nans[(i + 1) % 4];
          std::memcpy(&a[i * 4], &x, 4);
          std::memcpy(&b[i * 4], &y, 4);
        } else {
          const uint16_t* nans = dtype == DType::kBF16 ? bf16_nans : fp16_nans;
          const uint16_t x = nans[i % 8];
          const uint16_t y = i % 3 == 0 ? 0x3c00 : nans[(i + 3) % 8];
          std::memcpy(&a[i * 2], &x, 2);
          std::memcpy(&b[i * 2], &y, 2);
        }
      }
      for (const bool swapped : {false, true}) {
        const uint8_t* srcs[2] = {swapped ? b.data() : a.data(), swapped ? a.data() : b.data()};
        reduce(out.data(), srcs, 2, num_vecs);
        for (size_t i = 0; i < count; ++i) {
          if (dtype == DType::kFP32) {
            uint32_t got = 0;
            std::memcpy(&got, &out[i * 4], 4);
            ASSERT_EQ(got, kCanonicalNaN) << reduce_isa_name(isa) << " fp32 lane " << i;
          } else {
            uint16_t got = 0;
            std::memcpy(&got, &out[i * 2], 2);
            ASSERT_EQ(got, 0x7fff)
                << reduce_isa_name(isa) << " " << plan::dtype_name(dtype) << " lane " << i;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Bf16AndFp16, HalfPrecisionReducer,
                         testing::Values(Case{DType::kBF16, ReduceIsa::kAvx2},
                                         Case{DType::kFP16, ReduceIsa::kAvx2},
                                         Case{DType::kBF16, ReduceIsa::kAvx512},
                                         Case{DType::kFP16, ReduceIsa::kAvx512}),
                         case_name);

TEST(ReduceIsaChoice, NamesRoundTripAndUnknownNamesAreRejected) {
  for (const ReduceIsa isa : kAllReduceIsas) {
    EXPECT_EQ(parse_reduce_isa(reduce_isa_name(isa)), isa);
  }
  EXPECT_FALSE(parse_reduce_isa("sse2").has_value());
  EXPECT_FALSE(parse_reduce_isa("AVX2").has_value());
}

TEST(ReduceIsaChoice, SetReduceIsaSelectsThatIsasReducersAndRefusesWhatTheCpuLacks) {
  const ReduceIsa before = active_reduce_isa();
  EXPECT_TRUE(reduce_isa_available(ReduceIsa::kScalar));
  EXPECT_TRUE(reduce_isa_available(best_reduce_isa()));
  for (const ReduceIsa isa : kAllReduceIsas) {
    if (reduce_isa_available(isa)) {
      set_reduce_isa(isa);
      EXPECT_EQ(active_reduce_isa(), isa);
      for (const DType dtype : plan::kAllDTypes) {
        EXPECT_EQ(reducer_for(dtype), reducer_for(dtype, isa)) << reduce_isa_name(isa);
      }
    } else {
      EXPECT_EQ(reducer_for(DType::kBF16, isa), nullptr);
      try {
        set_reduce_isa(isa);
        ADD_FAILURE() << "set_reduce_isa accepted " << reduce_isa_name(isa);
      } catch (const std::invalid_argument& e) {
        EXPECT_NE(std::string(e.what()).find(reduce_isa_name(isa)), std::string::npos) << e.what();
      }
    }
  }
  // The three ISAs' reducers are distinct functions where available.
  if (reduce_isa_available(ReduceIsa::kAvx2)) {
    EXPECT_NE(reducer_for(DType::kBF16, ReduceIsa::kAvx2),
              reducer_for(DType::kBF16, ReduceIsa::kScalar));
  }
  set_reduce_isa(before);
}

}  // namespace
}  // namespace pcie_ar::transport
