// The CUDA executor's fused epilogue on the CPU device: every buildable tactic with
// plan::with_epilogue, each dtype, both launch shapes, strict and weak memory, both placements,
// out of place and in place. The fused call must give, bit for bit, what the plain all-reduce of
// the same inputs followed by the host executor's epilogue (executors/host/epilogue.cc) gives:
// the two executors' epilogues agree, and the CUDA one reads whole rows only after every CTA of
// its rank has finished its slices (weak memory delivers the others' stores late otherwise).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "cpu_device_group.h"
#include "cpu_device_workload.h"
#include "plan/epilogue.h"
#include "plan/layout.h"
#include "plan/schedule.h"
#include "transport/executors/element_codecs.h"
#include "transport/executors/host/epilogue.h"

namespace pcie_ar::transport::cpu_device_test {
namespace {

using plan::DType;

// Elements of `dtype` for values in [-2, 2): a row's mean of squares is order one, so y is too.
std::vector<uint8_t> random_elements(DType dtype, int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<uint8_t> out(n * plan::dtype_bytes(dtype));
  for (int64_t i = 0; i < n; ++i) {
    const float f = dist(rng);
    if (dtype == DType::kFP32) {
      std::memcpy(out.data() + 4 * i, &f, 4);
    } else {
      const uint16_t h =
          dtype == DType::kBF16 ? Bf16Codec::from_float(f) : Fp16Codec::from_float(f);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

struct WorldCase {
  int world;
  std::vector<int> island_of;
  const char* name;
};

struct EpilogueCase {
  WorldCase world;
  Mode mode;
};

std::vector<EpilogueCase> cases() {
  const WorldCase worlds[] = {{2, {0, 0}, "w2"}, {4, {0, 0, 1, 1}, "w4_islands"}};
  std::vector<EpilogueCase> out;
  for (const WorldCase& w : worlds) {
    for (const Mode& m : all_modes()) out.push_back({w, m});
  }
  return out;
}

class CpuDeviceEpilogue : public testing::TestWithParam<EpilogueCase> {};

TEST_P(CpuDeviceEpilogue, EqualsThePlainAllReduceThenTheHostEpilogueBitForBit) {
  const EpilogueCase& c = GetParam();
  const int world = c.world.world;
  // 2056 elements: past kNormPartials (the partials wrap), whole 16-byte vectors in every dtype;
  // 3 rows over 2 or 3 CTAs.
  const int64_t hidden = 2056;
  const int64_t rows = 3;
  const int64_t numel = rows * hidden;
  static_assert(2056 > plan::kNormPartials);
  const plan::Layout layout = plan::make_layout(numel, world, 4);
  CpuDeviceGroup group(layout, c.mode.placement, 0, 5.0);
  cpu_device::DeviceOptions options;
  options.memory = c.mode.memory;
  std::mt19937 rng(7);
  int launches = 0;
  for (const host_test::TacticCase& t : gpu_tactics(world, c.world.island_of)) {
    const int plain = group.add_schedule(t.schedule);
    const int fused = group.add_schedule(plan::with_epilogue(t.schedule));
    for (DType dtype : plan::kAllDTypes) {
      const int64_t bytes = numel * plan::dtype_bytes(dtype);
      if (plan::flag_in_data(t.tactic.protocol) && bytes > layout.ll_capacity_bytes) continue;
      for (int shape = 0; shape < 2; ++shape) {
        const bool in_place = shape == 1;
        plan::Tactic tactic = t.tactic;
        tactic.blocks = kShapes[shape].blocks;
        tactic.threads = kShapes[shape].threads;
        std::vector<std::vector<uint8_t>> in(world), res(world), w(world), sum(world), out(world),
            res_out(world);
        std::vector<const void*> inputs(world), plain_in(world);
        std::vector<void*> outputs(world), sums(world);
        std::vector<plan::EpilogueArgs> args(world);
        // The residual stream and the weight are replicated: every rank holds the same.
        const std::vector<uint8_t> residual = random_elements(dtype, numel, rng);
        const std::vector<uint8_t> weight = random_elements(dtype, hidden, rng);
        for (int r = 0; r < world; ++r) {
          in[r] = random_elements(dtype, numel, rng);
          res[r] = residual;
          w[r] = weight;
          sum[r].assign(bytes, 0);
          out[r] = in_place ? in[r] : std::vector<uint8_t>(bytes, 0);
          res_out[r].assign(bytes, 0);
          plain_in[r] = in[r].data();
          sums[r] = sum[r].data();
          inputs[r] = in_place ? out[r].data() : in[r].data();
          outputs[r] = out[r].data();
          args[r].residual = res[r].data();
          args[r].residual_out = in_place ? res[r].data() : res_out[r].data();
          args[r].weight = w[r].data();
          args[r].hidden = hidden;
          args[r].eps = 1e-6f;
        }
        const std::string what = plan::tactic_label(tactic) + " " +
                                 std::string(plan::dtype_name(dtype)) +
                                 (in_place ? " in place" : "") + mode_name(c.mode);
        // The plain all-reduce's sum, then the host epilogue on it: the expected bits.
        ASSERT_EQ(group.launch(plain, tactic, dtype, plain_in, sums, numel, options),
                  cpu_device::LaunchStatus::kCompleted)
            << what;
        std::vector<std::vector<uint8_t>> expect_res(world);
        for (int r = 0; r < world; ++r) {
          expect_res[r].assign(bytes, 0);
          plan::EpilogueArgs host = args[r];
          host.residual_out = expect_res[r].data();
          run_epilogue(dtype, sum[r].data(), numel, host);
        }
        ASSERT_EQ(
            group.launch(fused, tactic, dtype, inputs, outputs, numel, options, 0, -1, 0, &args),
            cpu_device::LaunchStatus::kCompleted)
            << what << ": "
            << (group.failure() ? plan::describe_failure(*group.failure(), 1.0) : "no record");
        ++launches;
        for (int r = 0; r < world; ++r) {
          const std::vector<uint8_t>& got_res = in_place ? res[r] : res_out[r];
          ASSERT_EQ(out[r], sum[r]) << what << ": rank " << r << "'s y";
          ASSERT_EQ(got_res, expect_res[r]) << what << ": rank " << r << "'s residual_out";
          ASSERT_EQ(out[r], out[0]) << what << ": ranks 0 and " << r << " differ";
        }
      }
    }
  }
  EXPECT_GT(launches, 0);
}

void PrintTo(const EpilogueCase& c, std::ostream* os) { *os << c.world.name << mode_name(c.mode); }

INSTANTIATE_TEST_SUITE_P(Fused, CpuDeviceEpilogue, testing::ValuesIn(cases()),
                         [](const testing::TestParamInfo<EpilogueCase>& info) {
                           return std::string(info.param.world.name) + mode_name(info.param.mode);
                         });

// Rows whose only non-zero elements share one partial (every 2048th): a row's total is that
// partial, so one rounding of one of its 32 terms more or less (a multiply-add contracted into an
// FMA, another order) changes rstd and every y of the row. In the matrix above such a difference
// is usually lost in the total's own rounding. fp32, so the squares are inexact; the test first
// checks that its data tells an FMA from a multiply and an add.
TEST(CpuDeviceEpilogueOrder, RowsHeldByOnePartialShowEveryRounding) {
  const int world = 2;
  const int64_t hidden = 32 * plan::kNormPartials;
  const int64_t rows = 8;
  const int64_t numel = rows * hidden;
  const plan::Layout layout = plan::make_layout(numel, world, 4);
  CpuDeviceGroup group(layout, Placement::kDevice);
  const plan::Schedule plain_schedule =
      plan::build_schedule(plan::Algorithm::kOneshot, plan::Direction::kPush, false, world);
  const int plain = group.add_schedule(plain_schedule);
  const int fused = group.add_schedule(plan::with_epilogue(plain_schedule));
  plan::Tactic tactic;
  tactic.algorithm = plan::Algorithm::kOneshot;
  tactic.blocks = 2;
  tactic.threads = 64;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> in(world, std::vector<float>(numel, 0.0f));
  for (auto& x : in) {
    for (int64_t i = 0; i < numel; i += plan::kNormPartials) x[i] = normal(rng);
  }
  int sensitive_rows = 0;  // rows whose partial differs when its terms are fused
  for (int64_t row = 0; row < rows; ++row) {
    float apart = 0.0f, fused_terms = 0.0f;
    for (int64_t i = row * hidden; i < (row + 1) * hidden; i += plan::kNormPartials) {
      volatile float r = in[0][i] + in[1][i];
      volatile float square = r * r;
      apart = apart + square;
      fused_terms = std::fma(static_cast<float>(r), static_cast<float>(r), fused_terms);
    }
    sensitive_rows += apart != fused_terms;
  }
  ASSERT_GT(sensitive_rows, 0) << "the data cannot tell an FMA from a multiply and an add";
  const std::vector<float> residual(numel, 0.0f), weight(hidden, 1.0f);
  std::vector<std::vector<float>> sum(world, std::vector<float>(numel)),
      out(world, std::vector<float>(numel)), res_out(world, std::vector<float>(numel));
  std::vector<const void*> inputs{in[0].data(), in[1].data()};
  std::vector<void*> sums{sum[0].data(), sum[1].data()}, outputs{out[0].data(), out[1].data()};
  std::vector<plan::EpilogueArgs> args(world);
  for (int r = 0; r < world; ++r) {
    args[r] = plan::EpilogueArgs{residual.data(), res_out[r].data(), weight.data(), hidden, 1e-6f};
  }
  const cpu_device::DeviceOptions options;
  ASSERT_EQ(group.launch(plain, tactic, DType::kFP32, inputs, sums, numel, options),
            cpu_device::LaunchStatus::kCompleted);
  ASSERT_EQ(
      group.launch(fused, tactic, DType::kFP32, inputs, outputs, numel, options, 0, -1, 0, &args),
      cpu_device::LaunchStatus::kCompleted);
  std::vector<float> expect_res(numel);
  plan::EpilogueArgs host = args[0];
  host.residual_out = expect_res.data();
  run_epilogue(DType::kFP32, sum[0].data(), numel, host);
  EXPECT_EQ(std::memcmp(out[0].data(), sum[0].data(), numel * 4), 0) << "y";
  EXPECT_EQ(std::memcmp(res_out[0].data(), expect_res.data(), numel * 4), 0) << "residual_out";
}

}  // namespace
}  // namespace pcie_ar::transport::cpu_device_test
