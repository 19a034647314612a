// Host-side checks of the CUDA IPC transport that need no GPU: which tactics the kernels can
// run, how launches are encoded, and the clear error when CUDA is requested on a machine
// without a device. What the kernel may assume about step lists is plan::check_program
// (tests/cpp/plan/test_program_check.cc); what it may assume about a call is the communicator's
// admission (tests/python).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "../host_test_util.h"
#include "plan/layout.h"
#include "plan/program_check.h"
#include "plan/schedule.h"
#include "plan/tactic.h"
#include "support/cuda_loopback.h"
#include "transport/cuda_host.h"
#include "transport/cuda_ipc.h"
#include "transport/workspace.h"

namespace pcie_ar::transport {
namespace {

using plan::Algorithm;
using plan::Direction;
using plan::DType;
using plan::Protocol;

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
  tactic.protocol = schedule.protocol;
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

TEST(CudaLaunchParams, CarryTheWorkspacesPdlChoice) {
  const plan::Schedule schedule =
      plan::build_schedule(Algorithm::kOneshot, Direction::kPush, false, 2);
  Fixture fixture(schedule, 4096, 4);
  EXPECT_FALSE(fixture.params(DType::kBF16, tactic_for(schedule), 1024, 0, 2).pdl);
  fixture.view.pdl = true;
  EXPECT_TRUE(fixture.params(DType::kBF16, tactic_for(schedule), 1024, 0, 2).pdl);
}

TEST(CudaLaunchParams, CountersAndSlotReadsFollowWhereTheSlabsAre) {
  const plan::Schedule schedule =
      plan::build_schedule(Algorithm::kOneshot, Direction::kPush, false, 2);
  Fixture fixture(schedule, 4096, 2);
  LaunchParams p = fixture.params(DType::kBF16, tactic_for(schedule), 1024, 0, 2);
  EXPECT_EQ(p.counters[0], p.bases[0]);  // cuda_ipc: the slab is device memory
  EXPECT_EQ(p.counters[1], p.bases[1]);
  EXPECT_FALSE(p.slots_in_host_memory);  // push reads of slots may use L2
  // cuda_host: the slab is host memory, the counters stay on the GPU (read every call).
  fixture.view.counters[1] = fake_address(0xC0000);
  fixture.view.slots_in_host_memory = true;
  p = fixture.params(DType::kBF16, tactic_for(schedule), 1024, 0, 2);
  EXPECT_TRUE(p.slots_in_host_memory);
  EXPECT_EQ(p.counters[0], p.bases[0]);
  EXPECT_EQ(p.counters[1], fake_address(0xC0000));
  EXPECT_NE(p.bases[1], fake_address(0xC0000));
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
  int ll_schedules = 0;
  for (int world = 2; world <= plan::kMaxWorld; ++world) {
    for (const std::vector<int>& islands : island_maps(world)) {
      for (const plan::Tactic& wanted : plan::buildable_tactics(world, islands)) {
        const Direction direction = wanted.direction;
        const Protocol protocol = wanted.protocol;
        const plan::Schedule schedule = plan::build_schedule(
            wanted.algorithm, direction, wanted.staged, world, islands, protocol);
        SCOPED_TRACE(plan::tactic_label(tactic_for(schedule)) + " world " + std::to_string(world) +
                     " islands " + std::to_string(islands.size()));
        const Fixture fixture(schedule, 1 << 16, 4);
        ++schedules;
        if (plan::flag_in_data(protocol)) ++ll_schedules;
        for (int r = 0; r < world; ++r) {
          const plan::Program& program = fixture.programs[r];
          EXPECT_EQ(program.rank, r);
          EXPECT_EQ(program.world, world);
          EXPECT_EQ(program.num_chunks, schedule.num_chunks);
          // The kernel picks its LL path per step: only LL and lamport programs name LL slots,
          // and the program says which format they hold.
          EXPECT_EQ(fixture.facts[r].uses_ll, plan::flag_in_data(protocol));
          EXPECT_EQ(program.ll_format == plan::LLFormat::kDense, protocol == Protocol::kLamport);
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
          std::vector<LaunchParams> launches = {fixture.params(dtype, tactic, 1 << 12, 0, world)};
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
  EXPECT_GT(schedules, 50);
  EXPECT_GT(ll_schedules, 10);
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
        EXPECT_LE(l.gen_counter_offset(l.max_blocks - 1) + sizeof(uint64_t), l.flags_offset);
        EXPECT_EQ(l.gen_offset % 8, 0u);  // the kernel loads and stores counters as 8 bytes
        EXPECT_LE(l.flag_offset(1, l.max_blocks - 1, l.num_flags - 1) + sizeof(plan::FlagWord),
                  l.control_bytes);
        EXPECT_LE(l.flag_offset(1, l.max_blocks - 1, l.num_flags - 1) + sizeof(plan::FlagWord),
                  l.ll_offset);
        EXPECT_LE(l.ll_slot_offset(1, l.num_slots - 1) + l.ll_slot_bytes, l.control_bytes);
        EXPECT_GE(l.ll_slot_bytes, static_cast<uint64_t>(l.ll_capacity_bytes) * plan::kLLExpansion);
        EXPECT_EQ(l.ll_offset % 32, 0u);  // an LL payload vector is two aligned 16-byte stores
        EXPECT_EQ(l.ll_slot_bytes % 32, 0u);
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

// The kernel moves a flag as one 16-byte access of two 64-bit halves: {gen} and
// {numel | signature << 32}. The host and the plan layer see the same bytes as a FlagWord.
TEST(CudaWireFormat, FlagWordIsGenThenNumelThenSignature) {
  static_assert(offsetof(plan::FlagWord, gen) == 0);
  static_assert(offsetof(plan::FlagWord, numel) == 8);
  static_assert(offsetof(plan::FlagWord, signature) == 12);
  static_assert(alignof(plan::FlagWord) == 16);
  const uint64_t halves[2] = {0x0123456789ABCDEFull,
                              uint64_t{0x00001000} | (uint64_t{0xA5123456} << 32)};
  plan::FlagWord word;
  std::memcpy(&word, halves, sizeof(word));
  EXPECT_EQ(word.gen, 0x0123456789ABCDEFull);
  EXPECT_EQ(word.numel, 0x00001000u);
  EXPECT_EQ(word.signature, 0xA5123456u);
}

// The kernel stores LL payload vector {x, y, z, w} as 32-bit words {x, tag, y, tag} and
// {z, tag, w, tag}: as 64-bit words, exactly what plan::ll_word() builds for the host.
TEST(CudaWireFormat, LLVectorsAreWhatTheHostCallsLLWords) {
  const uint32_t tag = plan::ll_tag(0x100000003ull, 4096, 0xA5000001u);
  const uint32_t payload[4] = {0x11111111u, 0x22222222u, 0x33333333u, 0x44444444u};
  const uint32_t stored[8] = {payload[0], tag, payload[1], tag, payload[2], tag, payload[3], tag};
  uint64_t words[4];
  std::memcpy(words, stored, sizeof(words));
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(words[i], plan::ll_word(payload[i], tag));
    EXPECT_EQ(plan::ll_word_payload(words[i]), payload[i]);
    EXPECT_EQ(plan::ll_word_tag(words[i]), tag);
  }
  // The reset a reader writes back never reads as valid again, nor as another call's data.
  EXPECT_NE(plan::kLLEmpty, tag);
  EXPECT_FALSE(plan::ll_foreign(plan::kLLEmpty, tag));
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

// What the factory gets for a two-rank CUDA workspace on device 0.
WorkspaceOptions cuda_options(Kind transport) {
  WorkspaceOptions options;
  options.transport = transport;
  options.max_numel = 4096;
  options.world = 2;
  options.device = 0;
  return options;
}

TEST(CudaDevice, WorkspaceSaysNoDeviceIsVisible) {
  if (device_visible()) GTEST_SKIP() << "a CUDA device is visible; this checks GPU-less hosts";
  const plan::Layout layout = plan::make_layout(4096, 2, 2);
  expect_no_device_error([&] { CudaIpcWorkspace workspace(layout, 0, 0, 0, 30.0, true); });
  expect_no_device_error([&] { make_workspace(cuda_options(Kind::kCudaIpc)); });
}

TEST(CudaDevice, HostMemoryWorkspaceSaysNoDeviceIsVisibleAndLeavesNoSegment) {
  if (device_visible()) GTEST_SKIP() << "a CUDA device is visible; this checks GPU-less hosts";
  const plan::Layout layout = plan::make_layout(4096, 2, 2);
  expect_no_device_error([&] { CudaHostWorkspace workspace(layout, 1, 0, 0, 30.0, true); });
  expect_no_device_error([&] { make_workspace(cuda_options(Kind::kCudaHost)); });
  // The device is checked before the segment is created: nothing to clean up.
  EXPECT_TRUE(host_test::segments_of(getpid()).empty());
}

TEST(CudaDevice, LoopbackSaysNoDeviceIsVisible) {
  if (device_visible()) GTEST_SKIP() << "a CUDA device is visible; this checks GPU-less hosts";
  const plan::Layout layout = plan::make_layout(4096, 4, 4);
  expect_no_device_error([&] { CudaLoopback loopback(layout, 0, 0, 30.0, true); });
}

TEST(CudaDevice, PdlCanBeSwitchedOffWithoutAskingTheDevice) {
  EXPECT_FALSE(use_pdl(false, 0));  // no CUDA call: works with or without a GPU
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
