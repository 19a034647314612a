// The CUDA executor's fused epilogue (issue 24) on the CPU device: every buildable tactic with
// plan::with_epilogue, each dtype, both launch shapes, strict and weak memory, both placements,
// out of place and in place. The fused call must give, bit for bit, what the plain all-reduce of
// the same inputs followed by the host executor's epilogue (executors/host/epilogue.cc) gives:
// the two executors' epilogues agree, and the CUDA one reads whole rows only after every CTA of
// its rank has finished its slices (weak memory delivers the others' stores late otherwise).
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace pcie_ar::transport::cpu_device_test
