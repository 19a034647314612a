// Host-side checks of the CUDA IPC transport that need no GPU: which tactics the kernels can
// run, how launches are encoded, and the clear error when CUDA is requested on a machine
// without a device. What the kernel may assume about step lists is plan::check_program
// (tests/cpp/test_program_check.cc); what it may assume about a call is the communicator's
// admission (tests/python).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "plan/layout.h"
#include "plan/program_check.h"
#include "plan/schedule.h"
#include "plan/tactic.h"
#include "transport/cuda_ipc.h"
#include "transport/workspace.h"

namespace pcie_ar::transport {
namespace {

using plan::Algorithm;
using plan::Direction;
using plan::DType;

// Addresses that are never dereferenced: validation only looks at them.
template <typename T = uint8_t>
T* fake_address(uintptr_t value) {
  return reinterpret_cast<T*>(value);
}

std::vector<int> halves(int world) {
  std::vector<int> islands(world);
  for (int r = 0; r < world; ++r) islands[r] = r < world / 2 ? 0 : 1;
  return islands;
}

std::vector<int> interleaved(int world) {
  std::vector<int> islands(world);
  for (int r = 0; r < world; ++r) islands[r] = r % 2;
  return islands;
}

// Every island map worth trying for a world size: flat, two halves, odd/even ranks.
std::vector<std::vector<int>> island_maps(int world) {
  std::vector<std::vector<int>> maps = {{}};
  if (world % 2 == 0) {
    maps.push_back(halves(world));
    maps.push_back(interleaved(world));
  }
  return maps;
}

// A schedule encoded and "uploaded" to host memory, with fake slabs and tensors around it.
struct Fixture {
  plan::Layout layout;
  std::vector<plan::Program> programs;  // host copies stand in for the device copies
  std::vector<plan::ProgramFacts> facts;
  WorkspaceView view;
  ProgramSet set;
  const void* inputs[plan::kMaxWorld] = {};
  void* outputs[plan::kMaxWorld] = {};

  Fixture(const plan::Schedule& schedule, int64_t max_numel, int elem_bytes) {
    layout = plan::make_layout(max_numel, schedule.world, elem_bytes);
    programs.reserve(schedule.world);
    for (int r = 0; r < schedule.world; ++r) {
      programs.push_back(plan::encode_program(schedule, r));
      facts.push_back(plan::check_program(programs.back(), layout, r));
    }
    view.layout = layout;
    view.diag = fake_address<plan::Diagnostic>(0x7000000);
    view.claim = fake_address<uint32_t>(0x7001000);
    view.timeout_ns = 30'000'000'000ull;
    set.direction = schedule.direction;
    for (int r = 0; r < schedule.world; ++r) {
      view.bases[r] = fake_address(0x10000000ull * (r + 1));
      set.device[r] = &programs[r];
      inputs[r] = fake_address<const void>(0x100000000ull * (r + 1));
      outputs[r] = fake_address<void>(0x100000000ull * (r + 1) + 0x80000000ull);
    }
  }

  LaunchParams params(DType dtype, const plan::Tactic& tactic, int64_t numel, int first_rank,
                      int count) const {
    return make_launch_params(view, set, dtype, tactic.blocks, tactic.threads, inputs, outputs,
                              numel, plan::call_signature(dtype, tactic), first_rank, count);
  }
};

plan::Tactic tactic_for(const plan::Schedule& schedule, int blocks = 4, int threads = 256) {
  plan::Tactic tactic;
  tactic.algorithm = schedule.algorithm;
  tactic.direction = schedule.direction;
  tactic.staged = schedule.staged;
  tactic.blocks = blocks;
  tactic.threads = threads;
  return tactic;
}

// A GPU on which every instantiation keeps `ctas` CTAs of any thread count resident.
ResidencyTable uniform_residency(int ctas) {
  ResidencyTable table;
  for (auto& by_direction : table.ctas) {
    for (auto& by_threads : by_direction) {
      for (int& n : by_threads) n = ctas;
    }
  }
  return table;
}

// ------------------------------------------------------------------ which tactics can run

TEST(CudaKernelLimits, AcceptTheSmallestAndLargestShapes) {
  const ResidencyTable gpu = uniform_residency(132);
  plan::Tactic tactic;
  tactic.blocks = 1;
  tactic.threads = 32;
  EXPECT_EQ(why_kernels_cannot_run(tactic, tactic.blocks, gpu), std::nullopt);
  tactic.blocks = plan::kDefaultMaxBlocks;
  tactic.threads = 1024;
  EXPECT_EQ(why_kernels_cannot_run(tactic, tactic.blocks, gpu), std::nullopt);
}

TEST(CudaKernelLimits, RejectThreadsThatAreNotWholeWarps) {
  const ResidencyTable gpu = uniform_residency(132);
  for (int threads : {0, 16, 33, 100, 1056, 2048}) {
    plan::Tactic tactic;
    tactic.threads = threads;
    EXPECT_EQ(why_kernels_cannot_run(tactic, 1, gpu).value_or("accepted"),
              "threads must be a multiple of 32 in 32..1024, got " + std::to_string(threads));
  }
}

TEST(CudaKernelLimits, RejectMoreCtasThanTheGpuKeepsResident) {
  // Peers' CTA b waits for ours: a CTA that never becomes resident would stall them.
  ResidencyTable gpu = uniform_residency(24);
  plan::Tactic tactic;
  tactic.threads = 1024;
  tactic.blocks = 24;
  EXPECT_EQ(why_kernels_cannot_run(tactic, tactic.blocks, gpu), std::nullopt);
  tactic.blocks = 25;
  const std::string why = why_kernels_cannot_run(tactic, tactic.blocks, gpu).value_or("accepted");
  EXPECT_NE(why.find("25 CTAs of 1024 threads do not fit on the GPU at once (at most 24"),
            std::string::npos)
      << why;
  // One instantiation that holds fewer decides.
  gpu.ctas[static_cast<int>(DType::kFP32)][static_cast<int>(Direction::kPush)][1024 / 32 - 1] = 8;
  tactic.blocks = 16;
  EXPECT_NE(why_kernels_cannot_run(tactic, tactic.blocks, gpu).value_or("accepted").find("fp32"),
            std::string::npos);
}

TEST(CudaLaunchParams, CarryOnlyTheLaunchedRanksTensors) {
  const plan::Schedule schedule =
      plan::build_schedule(Algorithm::kOneshot, Direction::kPush, true, 4);
  const Fixture fixture(schedule, 4096, 4);
  const LaunchParams p = fixture.params(DType::kBF16, tactic_for(schedule), 1024, 0, 1);
  EXPECT_EQ(p.inputs[0], fixture.inputs[0]);
  EXPECT_EQ(p.inputs[1], nullptr);  // only launched ranks' tensors are carried
  EXPECT_EQ(p.outputs[3], nullptr);
}

TEST(CudaLaunchParams, TakeTheDirectionFromThePrograms) {
  const plan::Schedule pull = plan::build_schedule(Algorithm::kOneshot, Direction::kPull, false, 4);
  const Fixture fixture(pull, 4096, 4);
  plan::Tactic tactic = tactic_for(pull);
  tactic.direction = Direction::kPush;  // a tactic cannot send a pull program to the push kernel
  EXPECT_EQ(fixture.params(DType::kBF16, tactic, 1024, 0, 4).direction, Direction::kPull);
}

// ------------------------------------------------------------------ launch encoding

TEST(CudaLaunchEncoding, EveryBuiltScheduleReachesTheKernelIntact) {
  int schedules = 0;
  for (int world = 2; world <= plan::kMaxWorld; ++world) {
    for (const std::vector<int>& islands : island_maps(world)) {
      for (Algorithm algorithm : plan::kAllAlgorithms) {
        if (plan::why_unsupported(algorithm, world, islands)) continue;
        for (Direction direction : {Direction::kPush, Direction::kPull}) {
          for (bool staged : {true, false}) {
            const plan::Schedule schedule =
                plan::build_schedule(algorithm, direction, staged, world, islands);
            SCOPED_TRACE(plan::tactic_label(tactic_for(schedule)) + " world " +
                         std::to_string(world) + " islands " + std::to_string(islands.size()));
            const Fixture fixture(schedule, 1 << 16, 4);
            ++schedules;
            for (int r = 0; r < world; ++r) {
              const plan::Program& program = fixture.programs[r];
              EXPECT_EQ(program.rank, r);
              EXPECT_EQ(program.world, world);
              EXPECT_EQ(program.num_chunks, schedule.num_chunks);
              // The push kernel reads every operand as local memory; a pull program only
              // ever writes its own slots.
              if (direction == Direction::kPush) {
                EXPECT_FALSE(fixture.facts[r].loads_peer_slots);
              } else {
                EXPECT_FALSE(fixture.facts[r].stores_peer_slots);
              }
            }
            const plan::Tactic tactic = tactic_for(schedule);
            for (DType dtype : plan::kAllDTypes) {
              // Loopback: one launch carries every rank; real: each rank launches alone.
              std::vector<LaunchParams> launches = {
                  fixture.params(dtype, tactic, 1 << 12, 0, world)};
              for (int r = 0; r < world; ++r) {
                launches.push_back(fixture.params(dtype, tactic, 1 << 12, r, 1));
              }
              for (const LaunchParams& p : launches) {
                EXPECT_EQ(p.layout, fixture.layout);
                EXPECT_EQ(p.signature, plan::call_signature(dtype, tactic));
                EXPECT_EQ(p.direction, direction);
                for (int r = 0; r < world; ++r) {
                  EXPECT_EQ(p.bases[r], fixture.view.bases[r]);
                }
                for (int r = p.first_rank; r < p.first_rank + p.ranks_in_launch; ++r) {
                  ASSERT_EQ(p.programs[r], &fixture.programs[r]);
                  EXPECT_EQ(p.programs[r]->rank, r);
                  EXPECT_EQ(p.inputs[r], fixture.inputs[r]);
                  EXPECT_EQ(p.outputs[r], fixture.outputs[r]);
                }
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(schedules, 50);
}

TEST(CudaLaunchEncoding, EveryRankComputesTheSameSlabLayout) {
  for (int world = 2; world <= plan::kMaxWorld; ++world) {
    for (int elem : {2, 4}) {
      for (int64_t max_numel : {int64_t{8}, int64_t{393216}, int64_t{6144} * 129}) {
        const plan::Layout reference = plan::make_layout(max_numel, world, elem);
        for (int r = 0; r < world; ++r) {
          const plan::Layout mine = plan::make_layout(max_numel, world, elem);
          EXPECT_EQ(mine, reference);
          EXPECT_EQ(plan::layout_hash(mine), plan::layout_hash(reference));
        }
        // Every address the kernel forms stays inside the slab.
        const plan::Layout& l = reference;
        EXPECT_LE(l.gen_counter_offset(l.max_blocks - 1) + 4, l.flags_offset);
        EXPECT_LE(l.flag_offset(1, l.max_blocks - 1, l.num_flags - 1) + sizeof(plan::FlagWord),
                  l.control_bytes);
        EXPECT_LE(l.control_bytes, l.data_offset);
        EXPECT_LE(l.slot_offset(1, l.num_slots - 1) + l.slot_bytes, l.total_bytes);
        EXPECT_GE(l.slot_bytes, static_cast<uint64_t>(max_numel * elem));
        EXPECT_EQ(l.flags_offset % 16, 0u);
        EXPECT_EQ(l.data_offset % 16, 0u);
        EXPECT_EQ(l.slot_bytes % 16, 0u);
      }
    }
  }
}

// ------------------------------------------------------------------ no GPU here

bool device_visible() {
  int count = 0;
  const bool visible = cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
  cudaGetLastError();
  return visible;
}

template <typename Make>
void expect_no_device_error(Make make) {
  try {
    make();
    ADD_FAILURE() << "constructed a CUDA workspace without a device";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "CUDA was requested but no CUDA device is visible (cudaGetDeviceCount: "),
              std::string::npos)
        << e.what();
  }
}

TEST(CudaDevice, WorkspaceSaysNoDeviceIsVisible) {
  if (device_visible()) GTEST_SKIP() << "a CUDA device is visible; this checks GPU-less hosts";
  const plan::Layout layout = plan::make_layout(4096, 2, 2);
  expect_no_device_error([&] { CudaIpcWorkspace workspace(layout, 0, 0, 0, 30.0); });
  WorkspaceOptions options;
  options.transport = "cuda";
  options.max_numel = 4096;
  options.world = 2;
  options.device = 0;
  expect_no_device_error([&] { make_workspace(options); });
}

TEST(CudaDevice, LoopbackSaysNoDeviceIsVisible) {
  if (device_visible()) GTEST_SKIP() << "a CUDA device is visible; this checks GPU-less hosts";
  const plan::Layout layout = plan::make_layout(4096, 4, 4);
  expect_no_device_error([&] { CudaLoopback loopback(layout, 0, 0, 30.0); });
}

TEST(CudaDevice, TimeoutIsConvertedToNanoseconds) {
  EXPECT_EQ(timeout_to_ns(0.0), 0u);
  EXPECT_EQ(timeout_to_ns(30.0), 30'000'000'000ull);
  EXPECT_EQ(timeout_to_ns(0.25), 250'000'000ull);
  EXPECT_EQ(timeout_to_ns(1e300), 0u);  // effectively forever
  EXPECT_THROW(timeout_to_ns(-1.0), std::invalid_argument);
  EXPECT_THROW(timeout_to_ns(std::nan("")), std::invalid_argument);
  EXPECT_THROW(timeout_to_ns(std::numeric_limits<double>::infinity()), std::invalid_argument);
}

}  // namespace
}  // namespace pcie_ar::transport
