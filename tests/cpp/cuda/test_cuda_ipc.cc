// Host-side checks of the CUDA IPC transport that need no GPU: launch validation, what the
// kernel may assume about the step lists it is given, how launches are encoded, and the clear
// error when CUDA is requested on a machine without a device.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "plan/layout.h"
#include "plan/schedule.h"
#include "plan/tactic.h"
#include "transport/cuda_ipc.h"

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
  WorkspaceView view;
  ProgramSet set;
  const void* inputs[plan::kMaxWorld] = {};
  void* outputs[plan::kMaxWorld] = {};

  Fixture(const plan::Schedule& schedule, int64_t max_numel, int elem_bytes) {
    layout = plan::make_layout(max_numel, schedule.world, elem_bytes);
    programs.reserve(schedule.world);
    for (int r = 0; r < schedule.world; ++r) {
      programs.push_back(plan::encode_program(schedule, r));
    }
    view.layout = layout;
    view.diag = fake_address<plan::Diagnostic>(0x7000000);
    view.claim = fake_address<uint32_t>(0x7001000);
    view.timeout_ns = 30'000'000'000ull;
    for (int r = 0; r < schedule.world; ++r) {
      view.bases[r] = fake_address(0x10000000ull * (r + 1));
      set.device[r] = &programs[r];
      set.info[r] = inspect_program(programs[r], layout);
      inputs[r] = fake_address<const void>(0x100000000ull * (r + 1));
      outputs[r] = fake_address<void>(0x100000000ull * (r + 1) + 0x80000000ull);
    }
  }

  LaunchParams params(DType dtype, const plan::Tactic& tactic, int64_t numel, int first_rank,
                      int count) const {
    return make_launch_params(view, set, dtype, tactic, inputs, outputs, numel,
                              plan::call_signature(dtype, tactic), first_rank, count);
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

// Expects validate_launch() to throw std::invalid_argument whose message contains `needle`.
void expect_rejected(const LaunchParams& p, const std::string& needle) {
  try {
    validate_launch(p);
    ADD_FAILURE() << "accepted a launch that should fail with: " << needle;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << needle;
  }
}

void expect_inspect_rejects(const plan::Program& program, const plan::Layout& layout,
                            const std::string& needle) {
  try {
    inspect_program(program, layout);
    ADD_FAILURE() << "accepted a program that should fail with: " << needle;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << needle;
  }
}

class CudaLaunchValidation : public ::testing::Test {
 protected:
  CudaLaunchValidation()
      : schedule_(plan::build_schedule(Algorithm::kOneshot, Direction::kPush, true, 4)),
        fixture_(schedule_, 4096, 4),
        good_(fixture_.params(DType::kBF16, tactic_for(schedule_), 1024, 0, 4)) {}

  plan::Schedule schedule_;
  Fixture fixture_;
  LaunchParams good_;
};

TEST_F(CudaLaunchValidation, AcceptsLoopbackAndEveryRealRank) {
  EXPECT_NO_THROW(validate_launch(good_));
  for (int r = 0; r < 4; ++r) {
    EXPECT_NO_THROW(
        validate_launch(fixture_.params(DType::kFP32, tactic_for(schedule_), 4096, r, 1)));
  }
}

TEST_F(CudaLaunchValidation, AcceptsTheSmallestAndLargestShapes) {
  LaunchParams p = good_;
  p.numel = 8;  // one 16-byte vector of bf16
  p.blocks = 1;
  p.threads = 32;
  EXPECT_NO_THROW(validate_launch(p));
  p.numel = 4096;
  p.blocks = plan::kDefaultMaxBlocks;
  p.threads = 1024;
  EXPECT_NO_THROW(validate_launch(p));
}

TEST_F(CudaLaunchValidation, AcceptsInPlace) {
  LaunchParams p = good_;
  for (int r = 0; r < 4; ++r) p.outputs[r] = const_cast<void*>(p.inputs[r]);
  EXPECT_NO_THROW(validate_launch(p));
}

TEST_F(CudaLaunchValidation, RejectsBlocksOutsideTheWorkspace) {
  LaunchParams p = good_;
  p.blocks = 0;
  expect_rejected(p, "blocks must be in 1..64 (the workspace's max_blocks), got 0");
  p.blocks = 65;
  expect_rejected(p, "blocks must be in 1..64 (the workspace's max_blocks), got 65");
}

TEST_F(CudaLaunchValidation, RejectsThreadsThatAreNotWholeWarps) {
  for (int threads : {0, 16, 33, 100, 1056, 2048}) {
    LaunchParams p = good_;
    p.threads = threads;
    expect_rejected(p,
                    "threads must be a multiple of 32 in 32..1024, got " + std::to_string(threads));
  }
}

TEST_F(CudaLaunchValidation, RejectsEmptyMessages) {
  LaunchParams p = good_;
  p.numel = 0;
  expect_rejected(p, "numel must be positive, got 0");
  p.numel = -8;
  expect_rejected(p, "numel must be positive, got -8");
}

TEST_F(CudaLaunchValidation, RejectsMessagesThatAreNotWholeVectors) {
  LaunchParams p = good_;
  p.numel = 1020;  // 2040 bytes of bf16
  expect_rejected(p, "multiple of 16 bytes (8 bf16 elements), got numel 1020");
  p.dtype = DType::kFP32;
  p.numel = 6;  // 24 bytes
  expect_rejected(p, "multiple of 16 bytes (4 fp32 elements), got numel 6");
}

TEST_F(CudaLaunchValidation, RejectsMessagesLargerThanTheWorkspace) {
  LaunchParams p = good_;
  p.numel = 4096 + 8;
  expect_rejected(p, "numel 4104 exceeds the workspace's max_numel 4096");
}

TEST_F(CudaLaunchValidation, RejectsElementsWiderThanTheWorkspace) {
  const Fixture narrow(schedule_, 4096, 2);
  LaunchParams p = narrow.params(DType::kFP32, tactic_for(schedule_), 1024, 0, 4);
  expect_rejected(p, "fp32 elements are 4 bytes but the workspace holds 2-byte elements");
}

TEST_F(CudaLaunchValidation, RejectsUnknownEnums) {
  LaunchParams p = good_;
  p.dtype = static_cast<DType>(7);
  expect_rejected(p, "unknown dtype code 7");
  p = good_;
  p.direction = static_cast<Direction>(5);
  expect_rejected(p, "unknown direction code 5");
}

TEST_F(CudaLaunchValidation, RejectsMisalignedOrMissingTensors) {
  LaunchParams p = good_;
  p.inputs[2] = fake_address<const void>(reinterpret_cast<uintptr_t>(p.inputs[2]) + 8);
  expect_rejected(p, "rank 2's input must be a non-null 16-byte aligned pointer, got a misaligned");
  p = good_;
  p.outputs[1] = nullptr;
  expect_rejected(p, "rank 1's output must be a non-null 16-byte aligned pointer, got null");
}

TEST_F(CudaLaunchValidation, RejectsPartlyOverlappingInputAndOutput) {
  LaunchParams p = good_;
  p.outputs[0] = fake_address<void>(reinterpret_cast<uintptr_t>(p.inputs[0]) + 16);
  expect_rejected(p, "rank 0's input and output overlap without being the same buffer");
}

TEST_F(CudaLaunchValidation, RejectsRankRangesOutsideTheWorld) {
  LaunchParams p = good_;
  p.ranks_in_launch = 0;
  expect_rejected(p, "ranks [0, 0) must be a non-empty range inside world 4");
  p = good_;
  p.first_rank = 2;
  p.ranks_in_launch = 3;
  expect_rejected(p, "ranks [2, 5) must be a non-empty range inside world 4");
  p = good_;
  p.first_rank = -1;
  p.ranks_in_launch = 1;
  expect_rejected(p, "ranks [-1, 0) must be a non-empty range inside world 4");
}

TEST_F(CudaLaunchValidation, RejectsAMissingPeerWorkspace) {
  LaunchParams p = good_;
  p.bases[3] = nullptr;
  expect_rejected(p, "rank 3's workspace base is missing (have the peers been opened?)");
  p = good_;
  p.bases[1] = fake_address(reinterpret_cast<uintptr_t>(p.bases[1]) + 4);
  expect_rejected(p, "rank 1's workspace base is not 16-byte aligned");
}

TEST_F(CudaLaunchValidation, RejectsAMissingFailureRecord) {
  LaunchParams p = good_;
  p.diag = nullptr;
  expect_rejected(p, "the failure record is missing");
}

TEST_F(CudaLaunchValidation, RejectsAnotherRanksProgram) {
  LaunchParams p = good_;
  std::swap(p.programs[0], p.programs[1]);
  std::swap(p.infos[0], p.infos[1]);
  expect_rejected(p, "rank 0's program slot holds rank 1's program");
  p = good_;
  p.programs[2] = nullptr;
  expect_rejected(p, "rank 2's program is missing");
}

TEST_F(CudaLaunchValidation, RejectsAProgramForAnotherWorld) {
  LaunchParams p = good_;
  p.infos[0].world = 8;
  expect_rejected(p, "rank 0's program is for world 8 but the workspace is world 4");
}

TEST_F(CudaLaunchValidation, RejectsAProgramThatDoesNotFit) {
  LaunchParams p = good_;
  p.infos[3].num_steps = plan::kMaxSteps + 1;
  expect_rejected(p, "rank 3's program has 65 steps; expected 1..64");
}

TEST_F(CudaLaunchValidation, RejectsPushKernelsOnProgramsThatReadPeers) {
  const plan::Schedule pull = plan::build_schedule(Algorithm::kOneshot, Direction::kPull, false, 4);
  const Fixture fixture(pull, 4096, 4);
  plan::Tactic tactic = tactic_for(pull);
  EXPECT_NO_THROW(validate_launch(fixture.params(DType::kBF16, tactic, 1024, 0, 4)));
  tactic.direction = Direction::kPush;
  expect_rejected(fixture.params(DType::kBF16, tactic, 1024, 0, 4),
                  "program reads a peer's slot but the tactic is push");
}

TEST_F(CudaLaunchValidation, IgnoresWithheldRanks) {
  LaunchParams p = fixture_.params(DType::kBF16, tactic_for(schedule_), 1024, 0, 1);
  EXPECT_EQ(p.inputs[1], nullptr);  // only launched ranks' tensors are carried
  EXPECT_NO_THROW(validate_launch(p));
}

// ------------------------------------------------------------------ what the kernel assumes

class CudaProgramInspection : public ::testing::Test {
 protected:
  CudaProgramInspection()
      : layout_(plan::make_layout(4096, 4, 4)),
        program_(plan::encode_program(
            plan::build_schedule(Algorithm::kTwoshot, Direction::kPush, true, 4), 1)) {}

  // The first step of `kind` in the program.
  plan::Step& first(plan::StepKind kind) {
    for (int s = 0; s < program_.num_steps; ++s) {
      if (program_.steps[s].kind == kind) return program_.steps[s];
    }
    throw std::logic_error("no such step");
  }

  plan::Layout layout_;
  plan::Program program_;
};

TEST_F(CudaProgramInspection, DescribesAGoodProgram) {
  const ProgramInfo info = inspect_program(program_, layout_);
  EXPECT_EQ(info.rank, 1);
  EXPECT_EQ(info.world, 4);
  EXPECT_EQ(info.num_chunks, 4);
  EXPECT_EQ(info.num_steps, program_.num_steps);
  EXPECT_FALSE(info.loads_peer_slots);
  EXPECT_TRUE(info.stores_peer_slots);
}

TEST_F(CudaProgramInspection, RejectsAProgramForAnotherWorld) {
  expect_inspect_rejects(program_, plan::make_layout(4096, 8, 4),
                         "rank 1's program is for world 4 but the workspace layout is for world 8");
}

TEST_F(CudaProgramInspection, RejectsSlotsOutsideTheLayout) {
  first(plan::StepKind::kReduce).dst = plan::BufRef{plan::Space::kSlot, 4, 0, 0};
  expect_inspect_rejects(program_, layout_, "slot 0 of rank 4 is outside the layout");
  program_ =
      plan::encode_program(plan::build_schedule(Algorithm::kTwoshot, Direction::kPush, true, 4), 1);
  first(plan::StepKind::kReduce).dst =
      plan::BufRef{plan::Space::kSlot, 0, static_cast<uint8_t>(layout_.num_slots), 0};
  expect_inspect_rejects(program_, layout_, "slot 7 of rank 0 is outside the layout (7 slots");
}

TEST_F(CudaProgramInspection, RejectsAnotherRanksTensors) {
  plan::Step& step = first(plan::StepKind::kReduce);
  step.srcs[0] = plan::BufRef{plan::Space::kInput, 2, 0, 0};
  expect_inspect_rejects(program_, layout_, "names rank 2's input/output");
}

TEST_F(CudaProgramInspection, RejectsWritesToTheInput) {
  first(plan::StepKind::kReduce).dst = plan::BufRef{plan::Space::kInput, 1, 0, 0};
  expect_inspect_rejects(program_, layout_, "writes the caller's input");
}

TEST_F(CudaProgramInspection, RejectsOperandCountsTheKernelDoesNotUnroll) {
  first(plan::StepKind::kReduce).num_srcs = 0;
  expect_inspect_rejects(program_, layout_, "0 operands; expected 1..8");
  first(plan::StepKind::kReduce).num_srcs = 9;
  expect_inspect_rejects(program_, layout_, "9 operands; expected 1..8");
}

TEST_F(CudaProgramInspection, RejectsChunksOutsideTheProgram) {
  first(plan::StepKind::kReduce).chunk = 4;
  expect_inspect_rejects(program_, layout_, "chunk 4 of 4");
}

TEST_F(CudaProgramInspection, RejectsFlagsOutsideTheLayout) {
  first(plan::StepKind::kSignal).flag = static_cast<uint8_t>(layout_.num_flags);
  expect_inspect_rejects(program_, layout_, "flag 16 of rank");
}

TEST_F(CudaProgramInspection, RejectsAThirdRanksFlag) {
  plan::Step& wait = first(plan::StepKind::kWait);
  int third = 0;
  while (third == program_.rank || third == wait.peer) ++third;
  wait.flag_owner = static_cast<uint8_t>(third);
  expect_inspect_rejects(program_, layout_,
                         "the flag must live with this rank or with the step's peer");
}

TEST_F(CudaProgramInspection, RejectsUnknownStepKinds) {
  first(plan::StepKind::kSignal).kind = static_cast<plan::StepKind>(9);
  expect_inspect_rejects(program_, layout_, "unknown step kind 9");
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
              const ProgramInfo& info = fixture.set.info[r];
              EXPECT_EQ(info.rank, r);
              EXPECT_EQ(info.world, world);
              EXPECT_EQ(info.num_chunks, schedule.num_chunks);
              // The push kernel reads every operand as local memory; a pull program only
              // ever writes its own slots.
              if (direction == Direction::kPush) {
                EXPECT_FALSE(info.loads_peer_slots);
              } else {
                EXPECT_FALSE(info.stores_peer_slots);
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
                EXPECT_NO_THROW(validate_launch(p));
                EXPECT_EQ(p.layout, fixture.layout);
                EXPECT_EQ(p.signature, plan::call_signature(dtype, tactic));
                EXPECT_EQ(p.direction, direction);
                for (int r = 0; r < world; ++r) {
                  EXPECT_EQ(p.bases[r], fixture.view.bases[r]);
                }
                for (int r = p.first_rank; r < p.first_rank + p.ranks_in_launch; ++r) {
                  ASSERT_EQ(p.programs[r], &fixture.programs[r]);
                  EXPECT_EQ(p.programs[r]->rank, r);
                  EXPECT_EQ(p.infos[r].rank, r);
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
