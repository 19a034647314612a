// Chaos on the host transport, through the executor's test-only step hook
// (HostShmWorkspace::set_step_hook_for_testing):
//   * random delays before random steps (and inside waits) change no bit of any result;
//   * a rank that dies before any step of its program makes every survivor fail with the named
//     timeout, within the deadline, and leaves nothing in /dev/shm.
// The process machinery is host_test_util.h (one forked process per rank).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "host_test_util.h"
#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/schedule.h"
#include "plan/step.h"
#include "plan/tactic.h"
#include "transport/host_shm.h"
#include "transport/workspace.h"

namespace pcie_ar::transport {
namespace {

using namespace host_test;  // NOLINT(google-build-using-namespace): the shared test machinery

using StepPoint = HostShmWorkspace::StepPoint;

std::string describe_tactic(const plan::Tactic& tactic) {
  plan::Tactic t = tactic;
  t.blocks = 1;
  std::string label = plan::tactic_label(t);
  return label.substr(0, label.find("/b"));  // algorithm/direction/staging/protocol
}

// ------------------------------------------------------------------ random delays

constexpr int kMaxDelayUs = 200;

// Sleeps 0..kMaxDelayUs µs before about one step in four, and before about one poll in 64 of a
// wait that had to yield, while *active. Seeded per rank, so every rank's choices differ and a
// failure names a seed to replay (the interleaving itself stays up to the scheduler). Counts
// the delays into *taken.
HostShmWorkspace::StepHook random_delays(uint64_t seed, int rank, const bool* active, int* taken) {
  auto rng = std::make_shared<std::mt19937_64>(mix(seed ^ mix(static_cast<uint64_t>(rank) + 1)));
  return [rng, active, taken](const StepPoint& at) {
    if (!*active) return;
    const uint64_t r = (*rng)();
    if (r % (at.in_wait ? 64 : 4) != 0) return;
    const auto us = static_cast<useconds_t>((r >> 16) % (kMaxDelayUs + 1));
    if (us > 0) usleep(us);
    ++*taken;
  };
}

class HostChaosDelays : public ::testing::TestWithParam<GroupParam> {};

// Every tactic the builders emit (every protocol, direction and staging), every dtype, sizes from
// one vector to the maximum, block counts 1..8, in place and not: the calls run once calm, then
// kRounds times again with every rank delayed at random. Every output must equal, bit for bit,
// the calm run's, the other ranks', and the test-side reference (rank-ordered fp32 sums, see
// expected_element in host_test_util.h; run_workload checks it for every call).
TEST_P(HostChaosDelays, RandomDelaysAtRandomStepsChangeNoBit) {
  const GroupParam& p = GetParam();
  constexpr int64_t kMaxNumel = 2048;
  constexpr int kRounds = 6;
  constexpr uint64_t kSeed = 0xC4A05;
  Workload w;
  w.world = p.world;
  w.island_of = p.island_of;
  w.tactics = all_tactics(p.world, p.island_of);
  ASSERT_FALSE(w.tactics.empty());
  const int block_cycle[] = {1, 2, 3, 8, 5};
  const int64_t numel_cycle[] = {8, 8 * 3, 8 * 37, kMaxNumel};
  int n = 0;
  for (int t = 0; t < static_cast<int>(w.tactics.size()); ++t) {
    for (DType dtype : plan::kAllDTypes) {
      for (int k = 0; k < 2; ++k) {
        w.calls.push_back(CallCase{t, dtype, numel_cycle[n % 4], block_cycle[n % 5], n % 3 == 2,
                                   kSeed + static_cast<uint64_t>(n)});
        ++n;
      }
    }
  }
  const size_t calm = w.calls.size();
  for (int round = 0; round < kRounds; ++round) {
    for (size_t i = 0; i < calm; ++i) w.calls.push_back(w.calls[i]);
  }

  GroupSpec spec;
  spec.world = w.world;
  spec.layout = plan::make_layout(kMaxNumel, w.world, 4);
  ASSERT_GE(spec.layout.ll_capacity_bytes, kMaxNumel * 4);  // LL tactics take every size too
  spec.num_calls = w.calls.size();
  spec.deadline_s = 120.0;
  const double start = now_s();
  const GroupResult g = run_group(spec, [&](HostShmWorkspace& ws, ChildEnv& env) {
    bool delaying = false;
    ws.set_step_hook_for_testing(
        random_delays(kSeed, env.rank, &delaying, &env.report->scenario_ok));
    run_workload(w, ws, env, [&](int call) { delaying = call >= static_cast<int>(calm); });
  });
  expect_all_returned(g);
  for (int r = 0; r < w.world; ++r) {
    // One step in four of every delayed call: far more than one delay per delayed call.
    EXPECT_GE(g.reports[r].scenario_ok, static_cast<int>(w.calls.size() - calm))
        << "rank " << r << " was hardly delayed";
  }
  int differing = 0;
  for (size_t i = 0; i < w.calls.size(); ++i) {
    const size_t calm_index = i % calm;
    for (int r = 0; r < w.world; ++r) {
      const uint64_t got = g.hashes[i * kMaxWorld + r];
      const uint64_t want = g.hashes[calm_index * kMaxWorld];  // rank 0, calm
      if (got != want && differing++ == 0) {
        ADD_FAILURE() << describe_call(w, static_cast<int>(i)) << " (seed " << kSeed << "): rank "
                      << r << "'s output differs bitwise from rank 0's calm call "
                      << describe_call(w, static_cast<int>(calm_index));
      }
    }
  }
  EXPECT_EQ(differing, 0) << "outputs that differ from the calm run or across ranks";
  std::printf("    world %d, %zu tactics, %zu calm + %zu delayed calls: %.2f s\n", w.world,
              w.tactics.size(), calm, w.calls.size() - calm, now_s() - start);
}

INSTANTIATE_TEST_SUITE_P(
    HostShm, HostChaosDelays,
    ::testing::Values(GroupParam{"flat_w2", 2, {}}, GroupParam{"flat_w3", 3, {}},
                      GroupParam{"flat_w4", 4, {}}, GroupParam{"islands_2x2", 4, halves(4)},
                      GroupParam{"flat_w5", 5, {}},
                      GroupParam{"interleaved_2x4", 8, interleaved(8)}),
    [](const ::testing::TestParamInfo<GroupParam>& info) { return info.param.name; });

// ------------------------------------------------------------------ a rank dies

// Short, so hundreds of deaths fit in a minute; long enough that two cores shared by a few
// groups of up to eight processes do not miss it (every wait yields the core).
constexpr double kKillTimeoutS = 0.25;
// Two cores and up to eight processes per group, three groups at once: a failing call may end
// a little after its deadline.
constexpr double kKillSlackS = 2.5;
constexpr int kKillCalls = 3;       // per rank
constexpr int kDeathCall = 1;       // the victim's second call: the first one completes
constexpr int kParallelGroups = 3;  // groups in flight at once
constexpr uint32_t kKillInitialGen = 0xFFFFFFFEu;  // the death call's generation crosses 2^32

struct KillCase {
  int tactic = 0;  // index into the world's tactics
  int victim = 0;
  int blocks = 1;
  int block = 0;  // the victim dies in this slice
  int step = 0;   // ... just before this step of its program
};

struct KillParam {
  GroupParam group;
  // Victim steps per tactic: every one, or (larger worlds) a sample.
  bool every_step = true;
};

void PrintTo(const KillParam& param, std::ostream* os) { *os << param.group.name; }

class HostChaosKill : public ::testing::TestWithParam<KillParam> {};

std::string describe_kill(const std::vector<TacticCase>& tactics, int world, const KillCase& k) {
  return describe_tactic(tactics[k.tactic].tactic) + " world " + std::to_string(world) +
         " blocks " + std::to_string(k.blocks) + ": rank " + std::to_string(k.victim) +
         " dies before step " + std::to_string(k.step) + " of block " + std::to_string(k.block) +
         " in call " + std::to_string(kDeathCall);
}

// True when step `index` of `program` waits for `peer`: a flag that `peer` raises, or an LL
// operand `peer` writes. What a timeout diagnostic names must be one of these.
bool step_waits_for(const plan::Program& program, uint32_t index, uint32_t peer,
                    plan::FailureKind kind) {
  if (index >= program.num_steps) return false;
  const plan::Step& step = program.steps[index];
  if (kind == plan::FailureKind::kTimeout) {
    return step.kind == plan::StepKind::kWait && step.peer == peer;
  }
  if (step.kind != plan::StepKind::kReduce) return false;
  for (int s = 0; s < step.num_srcs; ++s) {
    if (step.srcs[s].space == plan::Space::kLL && step.srcs[s].writer == peer) return true;
  }
  return false;
}

// Every rank runs kKillCalls calls; the victim _exit(0)s at its hook just before (block, step)
// of call kDeathCall, after retire_token() like a crash in production. Each survivor must fail
// with the timeout (flag or LL, the protocol's), during the death call or the next one, after
// at least the timeout and within timeout + slack, naming a rank that the failing step of its
// own program waits for; at least one survivor must name the victim (the waits-for chain of the
// survivors ends at the dead rank: a schedule has no cycle of waits). Nobody hangs, and no
// segment of the group is left in /dev/shm.
TEST_P(HostChaosKill, EverySurvivorTimesOutNamingWhomItWaitedFor) {
  const KillParam& p = GetParam();
  const int world = p.group.world;
  const std::vector<TacticCase> tactics = all_tactics(world, p.group.island_of);
  ASSERT_FALSE(tactics.empty());

  std::vector<KillCase> cases;
  for (int t = 0; t < static_cast<int>(tactics.size()); ++t) {
    const int victim = (t * 3 + 1) % world;  // victims rotate over the ranks
    const int steps = plan::encode_program(tactics[t].schedule, victim).num_steps;
    std::vector<int> chosen;
    if (p.every_step) {
      for (int s = 0; s < steps; ++s) chosen.push_back(s);
    } else {
      chosen = {0, steps / 3, (2 * steps) / 3, steps - 1};
      chosen.erase(std::unique(chosen.begin(), chosen.end()), chosen.end());
    }
    for (int s : chosen) cases.push_back(KillCase{t, victim, 1, 0, s});
    // Slices run in turn: a death in a later slice, after earlier ones completed.
    cases.push_back(KillCase{t, victim, 3, 1, steps / 2});
  }

  std::vector<GroupSpec> specs;
  std::vector<ChildBody> bodies;
  for (const KillCase& k : cases) {
    GroupSpec spec;
    spec.world = world;
    spec.layout = plan::make_layout(1024, world, 4);
    spec.initial_gen = kKillInitialGen;
    spec.timeout_s = kKillTimeoutS;
    spec.deadline_s = 30.0;
    specs.push_back(spec);
    const TacticCase& tc = tactics[k.tactic];
    bodies.push_back([k, tc, world](HostShmWorkspace& ws, ChildEnv& env) {
      const int program = ws.add_program(plan::encode_program(tc.schedule, env.rank));
      plan::Tactic tactic = tc.tactic;
      tactic.blocks = k.blocks;
      const int64_t numel = 4 * 4 * world * k.blocks;  // 4 vectors of fp32 per chunk and slice
      std::vector<float> input(static_cast<size_t>(numel));
      std::vector<float> output(input.size());
      for (int64_t i = 0; i < numel; ++i) input[i] = input_value(5, env.rank, i, DType::kFP32);
      int call = 0;
      if (env.rank == k.victim) {
        RankReport* report = env.report;
        ws.set_step_hook_for_testing([&call, k, report](const StepPoint& at) {
          if (call == kDeathCall && !at.in_wait && at.block == k.block && at.step == k.step) {
            report->scenario_ok = 1;  // reached the point of death
            _exit(0);                 // no destructor, no cleanup: a crash
          }
        });
      }
      for (call = 0; call < kKillCalls; ++call) {
        const double start = now_s();
        try {
          run_call(ws, program, DType::kFP32, k.blocks, input.data(), output.data(), numel,
                   plan::call_signature(DType::kFP32, tactic));
        } catch (const TransportFailure& e) {
          env.report->failure_elapsed_s = now_s() - start;
          record_exception(env.report, e);
          return;
        }
        env.report->calls_done = call + 1;
      }
    });
  }

  const double start = now_s();
  const std::vector<GroupResult> results = run_groups(specs, bodies, kParallelGroups);
  const double elapsed = now_s() - start;

  for (size_t c = 0; c < cases.size(); ++c) {
    const KillCase& k = cases[c];
    const GroupResult& g = results[c];
    SCOPED_TRACE(describe_kill(tactics, world, k));
    expect_clean(g);
    for (pid_t pid : g.pids) EXPECT_TRUE(segments_of(pid).empty()) << "pid " << pid;
    ASSERT_EQ(static_cast<int>(g.reports.size()), world);
    ASSERT_EQ(static_cast<int>(g.status.size()), world);

    const RankReport& dead = g.reports[k.victim];
    EXPECT_EQ(dead.scenario_ok, 1)
        << "the victim never reached its point of death; " << describe_child(g, k.victim);
    EXPECT_EQ(dead.outcome, kRunning) << describe_child(g, k.victim);
    EXPECT_TRUE(WIFEXITED(g.status[k.victim]) && WEXITSTATUS(g.status[k.victim]) == 0)
        << describe_child(g, k.victim);

    bool someone_named_the_victim = false;
    for (int r = 0; r < world; ++r) {
      if (r == k.victim) continue;
      const RankReport& rep = g.reports[r];
      SCOPED_TRACE(describe_child(g, r));
      EXPECT_EQ(rep.outcome, kReturned);
      ASSERT_EQ(rep.error_type, kTransportError);
      const auto kind = static_cast<plan::FailureKind>(rep.diagnostic.kind);
      const plan::FailureKind timeout = plan::flag_in_data(tactics[k.tactic].tactic.protocol)
                                            ? plan::FailureKind::kLLTimeout
                                            : plan::FailureKind::kTimeout;
      // LL tactics also raise flags (the end-of-call barrier may be a flag wait), so an LL
      // survivor may time out on either; a flag tactic only on a flag.
      if (timeout == plan::FailureKind::kTimeout) {
        EXPECT_EQ(kind, plan::FailureKind::kTimeout);
      } else {
        EXPECT_TRUE(kind == plan::FailureKind::kLLTimeout || kind == plan::FailureKind::kTimeout)
            << "kind " << rep.diagnostic.kind;
      }
      EXPECT_TRUE(rep.calls_done == kDeathCall || rep.calls_done == kDeathCall + 1);
      EXPECT_EQ(rep.diagnostic.gen_expected,
                uint64_t{kKillInitialGen} + static_cast<uint64_t>(rep.calls_done) + 1);
      EXPECT_EQ(rep.diagnostic.rank, static_cast<uint32_t>(r));
      EXPECT_LT(rep.diagnostic.block, static_cast<uint32_t>(k.blocks));
      EXPECT_LT(rep.diagnostic.peer, static_cast<uint32_t>(world));
      EXPECT_NE(rep.diagnostic.peer, static_cast<uint32_t>(r));
      EXPECT_TRUE(step_waits_for(plan::encode_program(tactics[k.tactic].schedule, r),
                                 rep.diagnostic.step, rep.diagnostic.peer, kind))
          << "step " << rep.diagnostic.step << " does not wait for rank " << rep.diagnostic.peer;
      const std::string message = rep.message;
      EXPECT_NE(message.find("rank " + std::to_string(rep.diagnostic.peer)), std::string::npos)
          << message;
      EXPECT_GE(rep.failure_elapsed_s, kKillTimeoutS * 0.9);
      EXPECT_LE(rep.failure_elapsed_s, kKillTimeoutS + kKillSlackS);
      someone_named_the_victim |= rep.diagnostic.peer == static_cast<uint32_t>(k.victim);
    }
    EXPECT_TRUE(someone_named_the_victim) << "no survivor named the dead rank";
  }
  std::printf("    world %d, %zu tactics, %zu deaths: %.2f s\n", world, tactics.size(),
              cases.size(), elapsed);
}

// Every (tactic, step of the victim's program) for worlds 2, 3 and 4 (islands_2x2 holds every
// flat tactic as well as the island ones). World 8 samples four steps per tactic (first, a third,
// two thirds, last): its 20 tactics have up to 51 steps per rank, and eight processes per group
// on a two-core CI machine would take minutes for all of them; the steps of a larger world are
// the same kinds of waits as in the smaller ones.
INSTANTIATE_TEST_SUITE_P(
    HostShm, HostChaosKill,
    ::testing::Values(KillParam{GroupParam{"flat_w2", 2, {}}, true},
                      KillParam{GroupParam{"flat_w3", 3, {}}, true},
                      KillParam{GroupParam{"islands_2x2", 4, halves(4)}, true},
                      KillParam{GroupParam{"islands_2x4_sampled", 8, halves(8)}, false}),
    [](const ::testing::TestParamInfo<KillParam>& info) { return info.param.group.name; });

}  // namespace
}  // namespace pcie_ar::transport
