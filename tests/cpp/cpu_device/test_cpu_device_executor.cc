// The CUDA executor's own source (executors/cuda/executor.cuh) run on the CPU device: every
// buildable tactic x dtype x world (and two-island layout) x launch shape against the independent
// number model of host_test_util.h (bitwise, and within tolerance of the double-precision sum),
// bitwise equal across ranks, inputs changing every call, in place and out of place, in both
// placements (cuda_ipc's and cuda_host's) and in the strict and weak memory models. All ranks of a
// group run in one launch (the GPU loopback check's shape), so CTAs of different ranks really race.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../transport/host_test_util.h"
#include "cpu_device_group.h"
#include "cpu_device_workload.h"
#include "plan/layout.h"
#include "plan/program_check.h"
#include "plan/schedule.h"
#include "plan/tactic.h"
#include "transport/executors/cuda/cpu/device.h"
#include "transport/executors/cuda/cpu/launch.h"
#include "transport/host_shm.h"

namespace pcie_ar::transport {
namespace {

using cpu_device::DeviceOptions;
using cpu_device::LaunchStatus;
using cpu_device::MemoryModel;
using cpu_device_test::CpuDeviceGroup;
using cpu_device_test::make_workload;
using cpu_device_test::Placement;
using cpu_device_test::run_workload;
using host_test::CallCase;
using host_test::GroupParam;
using host_test::halves;
using host_test::interleaved;
using host_test::RankReport;
using host_test::TacticCase;
using host_test::Workload;
using plan::DType;

struct SuiteParam {
  GroupParam group;
  cpu_device_test::Mode mode;
};

std::string param_name(const ::testing::TestParamInfo<SuiteParam>& info) {
  return info.param.group.name + cpu_device_test::mode_name(info.param.mode);
}

class CpuDeviceExecutor : public ::testing::TestWithParam<SuiteParam> {};

TEST_P(CpuDeviceExecutor, EveryTacticMatchesTheModelOnEveryRank) {
  const SuiteParam& p = GetParam();
  constexpr int64_t kMaxNumel = 2100;
  const Workload w = make_workload(p.group.world, p.group.island_of, kMaxNumel, 1);
  ASSERT_FALSE(w.tactics.empty());
  const double start = host_test::now_s();
  EXPECT_EQ(run_workload(w, kMaxNumel, p.mode.placement, DeviceOptions{p.mode.memory, 1}), "");
  std::printf("    %zu tactics, %zu calls: %.2f s\n", w.tactics.size(), w.calls.size(),
              host_test::now_s() - start);
}

std::vector<SuiteParam> suite_params() {
  const std::vector<GroupParam> groups = {
      GroupParam{"flat_w2", 2, {}},
      GroupParam{"flat_w3", 3, {}},
      GroupParam{"flat_w4", 4, {}},
      GroupParam{"flat_w5", 5, {}},
      GroupParam{"flat_w6", 6, {}},
      GroupParam{"flat_w7", 7, {}},
      GroupParam{"flat_w8", 8, {}},
      GroupParam{"islands_2x2", 4, halves(4)},
      GroupParam{"islands_3x3", 6, halves(6)},
      GroupParam{"islands_4x4", 8, halves(8)},
      GroupParam{"interleaved_4x4", 8, interleaved(8)},
  };
  std::vector<SuiteParam> params;
  for (const GroupParam& g : groups) {
    for (const cpu_device_test::Mode& mode : cpu_device_test::all_modes()) {
      params.push_back(SuiteParam{g, mode});
    }
  }
  return params;
}

INSTANTIATE_TEST_SUITE_P(Loopback, CpuDeviceExecutor, ::testing::ValuesIn(suite_params()),
                         param_name);

// ---------------------------------------------------------------- back to back

// The generation sequence of graph replays: 240 calls back to back on one group, four tactics
// interleaved (LL, lamport, flag unstaged, flag staged pull), sizes and dtypes changing every call,
// starting 100 calls before the LL tags' 32 bits wrap.
TEST(CpuDeviceBackToBack, TwoHundredFortyCallsAcrossTheTagWrap) {
  constexpr int64_t kMaxNumel = 1024;
  const auto subset = [](const plan::Tactic& t) {
    return t.algorithm == plan::Algorithm::kOneshot &&
           (plan::flag_in_data(t.protocol) || !t.staged || t.direction == plan::Direction::kPull);
  };
  for (MemoryModel memory : {MemoryModel::kStrict, MemoryModel::kWeak}) {
    const Workload w = make_workload(4, {}, kMaxNumel, 14, subset);
    ASSERT_GE(w.calls.size(), 240u);
    EXPECT_EQ(run_workload(w, kMaxNumel, Placement::kHost, DeviceOptions{memory, 9},
                           (uint64_t{1} << 32) - 100),
              "")
        << (memory == MemoryModel::kStrict ? "strict" : "weak");
  }
}

// ---------------------------------------------------------------- the host executor agrees

// For the same schedule and inputs, the CUDA executor on the CPU device and the host executor
// (host_shm's BlockPass, over threads as ranks) write the same bytes: the schedule as built
// (what GPUs run) and fused (what the host communicator runs).
class HostRanks {
 public:
  HostRanks(const plan::Layout& layout) {
    std::vector<HostShmWorkspace*> peers;
    for (int r = 0; r < layout.world; ++r) {
      ranks_.push_back(std::make_unique<HostShmWorkspace>(layout, r, 0, 20.0));
      peers.push_back(ranks_.back().get());
    }
    for (auto& rank : ranks_) rank->open_peers_in_process(peers);
    for (auto& rank : ranks_) rank->retire_token();
  }
  std::vector<int> add(const plan::Schedule& schedule) {
    std::vector<int> ids;
    for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
      ids.push_back(ranks_[r]->add_program(plan::encode_program(schedule, r)));
    }
    return ids;
  }
  // One call of every rank, each on its own thread.
  void run(const std::vector<int>& ids, DType dtype, const plan::Tactic& tactic,
           const std::vector<const void*>& inputs, const std::vector<void*>& outputs,
           int64_t numel) {
    std::vector<std::thread> threads;
    for (int r = 0; r < static_cast<int>(ranks_.size()); ++r) {
      threads.emplace_back([&, r] {
        host_test::run_call(*ranks_[r], ids[r], dtype, tactic.blocks, inputs[r], outputs[r], numel,
                            plan::call_signature(dtype, tactic));
      });
    }
    for (auto& t : threads) t.join();
  }

 private:
  std::vector<std::unique_ptr<HostShmWorkspace>> ranks_;
};

TEST(CpuDeviceCrossCheck, TheHostExecutorWritesTheSameBytes) {
  constexpr int world = 4;
  constexpr int64_t kMaxNumel = 2048;
  const plan::Layout layout = plan::make_layout(kMaxNumel, world, 4, HostShmWorkspace::kMaxBlocks);
  HostRanks host(layout);
  CpuDeviceGroup device(layout, Placement::kDevice);
  const std::vector<int> island_of = halves(world);
  int compared = 0;
  for (const plan::Tactic& built : plan::buildable_tactics(world, island_of)) {
    const plan::Schedule schedule = plan::build_schedule(
        built.algorithm, built.direction, built.staged, world, island_of, built.protocol);
    const int device_id = device.add_schedule(schedule);
    const std::vector<int> unfused = host.add(schedule);
    const std::vector<int> fused = host.add(plan::fuse_forwarding_copies(schedule));
    for (DType dtype : plan::kAllDTypes) {
      const int64_t numel = 37 * plan::kVectorBytes / plan::dtype_bytes(dtype);
      const size_t bytes = static_cast<size_t>(numel) * plan::dtype_bytes(dtype);
      plan::Tactic tactic = built;
      tactic.blocks = 2;
      tactic.threads = 32;
      const uint64_t seed = 31 * compared + 5;
      std::vector<std::vector<uint8_t>> in(world, std::vector<uint8_t>(bytes));
      std::vector<std::vector<uint8_t>> out[3];  // device, host unfused, host fused
      for (auto& o : out) o.assign(world, std::vector<uint8_t>(bytes));
      for (int r = 0; r < world; ++r) {
        for (int64_t e = 0; e < numel; ++e) {
          host_test::encode(dtype, host_test::input_value(seed, r, e, dtype),
                            &in[r][e * plan::dtype_bytes(dtype)]);
        }
      }
      std::vector<const void*> inputs;
      std::vector<void*> outputs[3];
      for (int r = 0; r < world; ++r) {
        inputs.push_back(in[r].data());
        for (int k = 0; k < 3; ++k) outputs[k].push_back(out[k][r].data());
      }
      ASSERT_EQ(device.launch(device_id, tactic, dtype, inputs, outputs[0], numel,
                              DeviceOptions{MemoryModel::kWeak, seed}),
                LaunchStatus::kCompleted);
      host.run(unfused, dtype, tactic, inputs, outputs[1], numel);
      host.run(fused, dtype, tactic, inputs, outputs[2], numel);
      for (int r = 0; r < world; ++r) {
        EXPECT_EQ(out[1][r], out[0][r])
            << plan::tactic_label(tactic) << " " << plan::dtype_name(dtype) << " rank " << r;
        EXPECT_EQ(out[2][r], out[0][r])
            << plan::tactic_label(tactic) << " fused " << plan::dtype_name(dtype) << " rank " << r;
      }
      ++compared;
    }
  }
  EXPECT_GT(compared, 40);
}

// ---------------------------------------------------------------- signed zeros

// Zeros of both signs in every position a word can hold them, every tactic: -0 on every rank
// (fp32's -0 and a 16-bit pair {+0, -0} are the bits of kLLEmpty, the word a lamport reader
// waits to see replaced), zeros of mixed signs, and -0 beside one non-zero value. Every sum
// starts from +0 (plan::Step::split), so a sum of zeros is +0 whatever their signs, and the same
// in every protocol (a lamport writer stores -0 as +0: plan/protocol.h); the expected value is
// the group's canonical tree (canonical_sum), whichever tactic computes it. Two calls, so both
// parities' slots see the pattern. A writer that stored the empty word would leave its reader
// waiting: the short timeout turns that into a failed launch.
TEST(CpuDeviceSignedZeros, ZerosOfBothSignsSumAsIeeeSaysInEveryProtocol) {
  constexpr int world = 4;
  constexpr int64_t kNumel = 256;
  const plan::Layout layout = plan::make_layout(kNumel, world, 4, 2);
  const std::vector<int> island_of = halves(world);
  // Element e of rank r, by e % 4: +0 on even ranks and -0 on odd ones; -0 everywhere; 1.5 on
  // rank 0 and -0 elsewhere; -2 on the last rank and -0 elsewhere. Rank 0's elements 0 and 1
  // are {+0, -0}: in bf16 and fp16 that pair is the empty word.
  const auto value = [](int64_t e, int r) -> float {
    switch (e % 4) {
      case 0:
        return r % 2 == 0 ? 0.0f : -0.0f;
      case 1:
        return -0.0f;
      case 2:
        return r == 0 ? 1.5f : -0.0f;
      default:
        return r == world - 1 ? -2.0f : -0.0f;
    }
  };
  int checked = 0;
  for (const Placement placement : {Placement::kDevice, Placement::kHost}) {
    CpuDeviceGroup group(layout, placement, 0, 2.0);
    for (const plan::Tactic& built : plan::buildable_tactics(world, island_of)) {
      const plan::Schedule schedule = plan::build_schedule(
          built.algorithm, built.direction, built.staged, world, island_of, built.protocol);
      const int id = group.add_schedule(schedule);
      plan::Tactic tactic = built;
      tactic.blocks = 2;
      tactic.threads = 32;
      for (DType dtype : plan::kAllDTypes) {
        const int elem = plan::dtype_bytes(dtype);
        std::vector<std::vector<uint8_t>> in(world, std::vector<uint8_t>(kNumel * elem));
        std::vector<std::vector<uint8_t>> out(world, std::vector<uint8_t>(kNumel * elem, 0xA5));
        std::vector<const void*> inputs;
        std::vector<void*> outputs;
        for (int r = 0; r < world; ++r) {
          for (int64_t e = 0; e < kNumel; ++e)
            host_test::encode(dtype, value(e, r), &in[r][e * elem]);
          inputs.push_back(in[r].data());
          outputs.push_back(out[r].data());
        }
        for (int call = 0; call < 2; ++call) {
          const MemoryModel memory = call == 0 ? MemoryModel::kWeak : MemoryModel::kStrict;
          const std::string what =
              plan::tactic_label(tactic) + " " + std::string(plan::dtype_name(dtype)) + " call " +
              std::to_string(call) + (placement == Placement::kHost ? " host" : " device");
          ASSERT_EQ(group.launch(id, tactic, dtype, inputs, outputs, kNumel,
                                 DeviceOptions{memory, static_cast<uint64_t>(7 + call)}),
                    LaunchStatus::kCompleted)
              << what;
          for (int r = 0; r < world; ++r) {
            for (int64_t e = 0; e < kNumel; ++e) {
              std::vector<float> by_rank(world);
              for (int q = 0; q < world; ++q) by_rank[q] = value(e, q);
              const float want = cpu_device_test::canonical_sum(dtype, by_rank, island_of);
              std::vector<uint8_t> bits(elem);
              host_test::encode(dtype, want, bits.data());
              ASSERT_EQ(std::memcmp(&out[r][e * elem], bits.data(), elem), 0)
                  << what << " rank " << r << " element " << e << ": want "
                  << (std::signbit(want) ? "-" : "+") << want;
            }
          }
          ++checked;
        }
      }
    }
  }
  EXPECT_GT(checked, 100);
}

// ---------------------------------------------------------------- ranks as processes

// Each rank its own process over POSIX shared memory (host_shm's segments, as cuda_host's ranks
// share theirs), launching only itself: the cross-process path, both placements.
void run_as_processes(const Workload& w, int64_t max_numel, Placement placement,
                      MemoryModel memory) {
  host_test::GroupSpec spec;
  spec.world = w.world;
  spec.layout = plan::make_layout(max_numel, w.world, 4);
  spec.num_calls = w.calls.size();
  const auto body = [&](HostShmWorkspace& ws, host_test::ChildEnv& env) {
    std::vector<uint64_t> counters = cpu_device_test::separate_counters(ws.layout(), 0);
    std::vector<plan::Program> programs;
    for (const TacticCase& t : w.tactics)
      programs.push_back(plan::encode_program(t.schedule, env.rank));
    for (const plan::Program& program : programs)
      plan::check_program(program, ws.layout(), env.rank);
    plan::Diagnostic diag{};
    uint32_t claim = 0;
    std::vector<uint8_t> input(max_numel * 4 + host_test::kGuardBytes);
    std::vector<uint8_t> output(max_numel * 4 + host_test::kGuardBytes);
    for (int i = 0; i < static_cast<int>(w.calls.size()); ++i) {
      const CallCase& call = w.calls[i];
      uint8_t* out = host_test::prepare_call(
          call,
          [&](int64_t e) { return host_test::input_value(call.seed, env.rank, e, call.dtype); },
          input, output);
      WorkspaceView view;
      view.layout = ws.layout();
      for (int r = 0; r < w.world; ++r) view.bases[r] = ws.mapped_base(r);
      if (placement == Placement::kHost) {
        view.counters[env.rank] = reinterpret_cast<uint8_t*>(counters.data());
      }
      view.diag = &diag;
      view.claim = &claim;
      view.timeout_ns = timeout_to_ns(20.0);
      view.slots_in_host_memory = placement == Placement::kHost;
      ProgramSet set;
      set.device[env.rank] = &programs[call.tactic];
      set.direction = w.tactics[call.tactic].schedule.direction;
      const plan::Tactic tactic = cpu_device_test::launch_tactic(w, call);
      const void* inputs[plan::kMaxWorld] = {};
      void* outputs[plan::kMaxWorld] = {};
      inputs[env.rank] = input.data();
      outputs[env.rank] = out;
      const LaunchParams p =
          make_launch_params(view, set, call.dtype, tactic.blocks, tactic.threads, inputs, outputs,
                             call.numel, plan::call_signature(call.dtype, tactic), env.rank, 1);
      if (cpu_device::launch_executor(p, DeviceOptions{memory, 100u * env.rank + i}) !=
          LaunchStatus::kCompleted) {
        throw TransportFailure(diag, plan::describe_failure(diag, 20.0));
      }
      const size_t bytes = static_cast<size_t>(call.numel) * plan::dtype_bytes(call.dtype);
      env.hashes[i * plan::kMaxWorld + env.rank] = host_test::fnv1a(out, bytes);
      host_test::check_output(w, call, env.rank, i, out, env.report);
      env.report->calls_done = i + 1;
    }
  };
  const host_test::GroupResult g = host_test::run_group(spec, body);
  host_test::expect_all_returned(g);
  for (size_t i = 0; i < w.calls.size(); ++i) {
    for (int r = 1; r < w.world; ++r) {
      EXPECT_EQ(g.hashes[i * plan::kMaxWorld + r], g.hashes[i * plan::kMaxWorld])
          << host_test::describe_call(w, static_cast<int>(i)) << ": rank " << r;
    }
  }
}

TEST(CpuDeviceProcesses, EveryTacticAcrossProcessesInBothPlacements) {
  constexpr int64_t kMaxNumel = 1500;
  for (const GroupParam& g :
       {GroupParam{"flat_w3", 3, {}}, GroupParam{"islands_2x2", 4, halves(4)}}) {
    const Workload w = make_workload(g.world, g.island_of, kMaxNumel, 1);
    run_as_processes(w, kMaxNumel, Placement::kDevice, MemoryModel::kWeak);
    run_as_processes(w, kMaxNumel, Placement::kHost, MemoryModel::kStrict);
  }
}

}  // namespace
}  // namespace pcie_ar::transport
