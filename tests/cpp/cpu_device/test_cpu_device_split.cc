// How a reduce associates its operands (plan::Step::split), run by the CUDA executor's own source
// on the CPU device and compared bit for bit with a scalar oracle written from the rule alone:
// every sum of two or more operands runs in fp32 in operand order from +0 and is rounded once;
// a split step rounds the sums of its two operand groups before it adds them. Values span many
// binades (1e-3 beside 1e4, both signs, some zeros of either sign) so that the association shows
// in the bits. Plain slots, LL and lamport operands, push and pull, both memory models.
//
// 1. The splits of a flat sum: flat schedules with the split set by hand on every sum of all
//    ranks, worlds 2..8, at every split the kernels run (transport::executor_runs_split: none, or
//    two equal groups). The flat builders of a flat group sum in ascending rank order, so operand
//    i is rank i's. A split the kernels do not run is refused before any launch.
// 2. Every tactic as built on islanded groups computes the group's canonical tree: round(round(sum
//    of the island holding rank 0) + round(sum of the other)) where two equal islands of two or
//    more ranks exist, else one sum of every rank in ascending order. Island tactics store the
//    partials in slots; flat tactics split their sums in registers; the bits must agree.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "../transport/host_test_util.h"
#include "cpu_device_group.h"
#include "cpu_device_workload.h"
#include "plan/layout.h"
#include "plan/schedule.h"
#include "plan/tactic.h"
#include "transport/executors/cuda/cpu/device.h"
#include "transport/executors/cuda/kernel_params.h"

namespace pcie_ar::transport {
namespace {

using cpu_device::DeviceOptions;
using cpu_device::LaunchStatus;
using cpu_device::MemoryModel;
using cpu_device_test::canonical_sum;
using cpu_device_test::CpuDeviceGroup;
using cpu_device_test::Placement;
using cpu_device_test::split_sum;
using plan::DType;

constexpr int64_t kNumel = 192;

// ---------------------------------------------------------------- values

using Inputs = cpu_device_test::RankValues;

Inputs make_inputs(int world, DType dtype, uint64_t seed) {
  return cpu_device_test::wide_values(world, kNumel, dtype, seed);
}

// Runs schedule `id` of `group` on `in` (out of place) and compares every rank's every element
// with want(e) bitwise; "" or the first mismatch.
template <typename Want>
std::string run_and_compare(CpuDeviceGroup& group, int id, const plan::Tactic& tactic, DType dtype,
                            const Inputs& in, const DeviceOptions& options, Want want) {
  const int world = static_cast<int>(in.bytes.size());
  const int elem = plan::dtype_bytes(dtype);
  std::vector<std::vector<uint8_t>> out(world, std::vector<uint8_t>(kNumel * elem, 0xA5));
  std::vector<const void*> inputs;
  std::vector<void*> outputs;
  for (int r = 0; r < world; ++r) {
    inputs.push_back(in.bytes[r].data());
    outputs.push_back(out[r].data());
  }
  if (group.launch(id, tactic, dtype, inputs, outputs, kNumel, options) !=
      LaunchStatus::kCompleted) {
    return "the launch failed";
  }
  std::vector<uint8_t> bits(elem);
  for (int64_t e = 0; e < kNumel; ++e) {
    const float w = want(e);
    host_test::encode(dtype, w, bits.data());
    for (int r = 0; r < world; ++r) {
      if (std::memcmp(&out[r][e * elem], bits.data(), elem) != 0) {
        return "rank " + std::to_string(r) + " element " + std::to_string(e) + " is " +
               std::to_string(host_test::decode(dtype, &out[r][e * elem])) + ", want " +
               (std::signbit(w) ? "-" : "+") + std::to_string(std::fabs(w));
      }
    }
  }
  return "";
}

plan::Tactic small_launch(plan::Tactic tactic) {
  tactic.blocks = 2;
  tactic.threads = 32;
  return tactic;
}

// ---------------------------------------------------------------- 1. the splits of a flat sum

// A copy of `schedule` with every sum of all `world` operands split at `split`.
plan::Schedule split_every_sum(plan::Schedule schedule, int world, int split) {
  for (auto& program : schedule.programs) {
    for (plan::Step& step : program) {
      if (step.kind == plan::StepKind::kReduce && step.num_srcs == world) {
        step.split = static_cast<uint8_t>(split);
      }
    }
  }
  return schedule;
}

int sums_of_all(const plan::Schedule& schedule, int world) {
  int sums = 0;
  for (const auto& program : schedule.programs) {
    for (const plan::Step& step : program) {
      sums += step.kind == plan::StepKind::kReduce && step.num_srcs == world && step.split == 0;
    }
  }
  return sums;
}

TEST(CpuDeviceSplitSums, EverySplitTheKernelsRunRoundsBothGroups) {
  int checked = 0;
  int association_shows = 0;  // elements whose bits the split changes: the test has teeth
  for (int world = 2; world <= plan::kMaxWorld; ++world) {
    const plan::Layout layout = plan::make_layout(kNumel, world, 4, 2);
    CpuDeviceGroup group(layout, Placement::kDevice, 0, 5.0);
    for (const plan::Tactic& built : plan::buildable_tactics(world, {})) {
      const plan::Schedule flat = plan::build_schedule(built.algorithm, built.direction,
                                                       built.staged, world, {}, built.protocol);
      ASSERT_GT(sums_of_all(flat, world), 0) << plan::tactic_label(built);
      for (int split = 0; split < world; ++split) {
        if (!executor_runs_split(world, split)) continue;
        const int id = group.add_schedule(split_every_sum(flat, world, split));
        for (DType dtype : plan::kAllDTypes) {
          for (MemoryModel memory : {MemoryModel::kWeak, MemoryModel::kStrict}) {
            const uint64_t seed = 1000u * world + checked;
            const Inputs in = make_inputs(world, dtype, seed);
            const auto operands = [&](int64_t e) {
              std::vector<float> x(world);
              for (int r = 0; r < world; ++r) x[r] = in.values[r][e];
              return x;
            };
            const auto want = [&](int64_t e) { return split_sum(dtype, operands(e), split); };
            ASSERT_EQ(run_and_compare(group, id, small_launch(built), dtype, in,
                                      DeviceOptions{memory, seed}, want),
                      "")
                << plan::tactic_label(built) << " split " << split << " " << plan::dtype_name(dtype)
                << (memory == MemoryModel::kWeak ? " weak" : " strict");
            for (int64_t e = 0; split != 0 && e < kNumel; ++e) {
              association_shows += std::bit_cast<uint32_t>(want(e)) !=
                                   std::bit_cast<uint32_t>(split_sum(dtype, operands(e), 0));
            }
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 200);
  EXPECT_GT(association_shows, 1000);
}

// The kernels run the canonical tree's split only (executor_runs_split; they trap on another rather
// than sum it some other way): check_program(), which every workspace runs on a program before it
// is installed, refuses any other.
TEST(CpuDeviceSplitSums, ASplitTheKernelsDoNotRunIsRefusedBeforeAnyLaunch) {
  constexpr int world = 4;
  const plan::Layout layout = plan::make_layout(kNumel, world, 4, 2);
  CpuDeviceGroup group(layout, Placement::kDevice, 0, 5.0);
  const plan::Tactic built =
      host_test::make_tactic(plan::Algorithm::kOneshot, plan::Direction::kPush, false);
  const plan::Schedule flat = plan::build_schedule(built.algorithm, built.direction, built.staged,
                                                   world, {}, built.protocol);
  ASSERT_FALSE(executor_runs_split(world, 1));
  try {
    group.add_schedule(split_every_sum(flat, world, 1));
    ADD_FAILURE() << "a split at operand 1 of 4 was installed";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("split at operand 1 of 4"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------- 2. the canonical tree

TEST(CpuDeviceSplitSums, EveryTacticComputesTheCanonicalTree) {
  struct GroupCase {
    std::string name;
    int world;
    std::vector<int> island_of;
  };
  const std::vector<GroupCase> groups = {
      {"halves_4", 4, host_test::halves(4)},
      {"halves_6", 6, host_test::halves(6)},
      {"interleaved_8", 8, host_test::interleaved(8)},
      {"interleaved_8_first_1", 8, host_test::interleaved(8, 1)},
      {"uneven_4", 4, {0, 0, 0, 1}},  // no island algorithm: one flat sum
  };
  int checked = 0;
  int split_sums = 0;
  for (const GroupCase& g : groups) {
    const plan::Layout layout = plan::make_layout(kNumel, g.world, 4, 2);
    for (const Placement placement : {Placement::kDevice, Placement::kHost}) {
      CpuDeviceGroup group(layout, placement, 0, 5.0);
      for (const plan::Tactic& built : plan::buildable_tactics(g.world, g.island_of)) {
        const plan::Schedule schedule = plan::build_schedule(
            built.algorithm, built.direction, built.staged, g.world, g.island_of, built.protocol);
        for (const auto& program : schedule.programs) {
          for (const plan::Step& step : program) split_sums += step.split != 0;
        }
        const int id = group.add_schedule(schedule);
        for (DType dtype : plan::kAllDTypes) {
          for (MemoryModel memory : {MemoryModel::kWeak, MemoryModel::kStrict}) {
            const uint64_t seed = 77u * checked + 3;
            const Inputs in = make_inputs(g.world, dtype, seed);
            const auto want = [&](int64_t e) {
              std::vector<float> x(g.world);
              for (int r = 0; r < g.world; ++r) x[r] = in.values[r][e];
              return canonical_sum(dtype, x, g.island_of);
            };
            const std::string failure = run_and_compare(group, id, small_launch(built), dtype, in,
                                                        DeviceOptions{memory, seed}, want);
            ASSERT_EQ(failure, "")
                << g.name << " " << plan::tactic_label(built) << " " << plan::dtype_name(dtype)
                << (memory == MemoryModel::kWeak ? " weak" : " strict")
                << (placement == Placement::kHost ? " host" : " device");
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 200);
  EXPECT_GT(split_sums, 0);  // the flat tactics on the islanded groups split their sums
}

}  // namespace
}  // namespace pcie_ar::transport
