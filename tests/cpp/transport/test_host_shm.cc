// host_shm with real processes and real shared memory: every test forks one child per rank
// (the machinery is in host_test_util.h), each child builds its own HostShmWorkspace, and the
// parent checks the results, the diagnostics and /dev/shm afterwards.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "host_test_util.h"
#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/schedule.h"
#include "plan/tactic.h"
#include "transport/host_shm.h"
#include "transport/workspace.h"

namespace pcie_ar::transport {
namespace {

using namespace host_test;  // NOLINT(google-build-using-namespace): the shared test machinery

// ------------------------------------------------------------------ the schedule matrix

class HostShmScheduleMatrix : public ::testing::TestWithParam<GroupParam> {};

// Every tactic x dtype x size on one set of processes, switching tactic, dtype, size, block
// count and in-place between consecutive calls (as a communicator does).
TEST_P(HostShmScheduleMatrix, EveryScheduleMatchesTheReferenceOnEveryRank) {
  const GroupParam& p = GetParam();
  constexpr int64_t kMaxNumel = 6000;  // not a power of two; a multiple of 8 elements
  Workload w;
  w.world = p.world;
  w.island_of = p.island_of;
  w.tactics = all_tactics(p.world, p.island_of);
  ASSERT_FALSE(w.tactics.empty());
  const int block_cycle[] = {1, 2, 3, 5, 8, 1, 4};
  uint64_t seed = 1000 * p.world;
  int n = 0;
  for (int t = 0; t < static_cast<int>(w.tactics.size()); ++t) {
    for (DType dtype : plan::kAllDTypes) {
      for (int64_t numel : sizes_for(dtype, kMaxNumel)) {
        w.calls.push_back(CallCase{t, dtype, numel, block_cycle[n % 7], n % 3 == 1, ++seed});
        ++n;
      }
    }
  }
  run_and_check(w, kMaxNumel);
}

INSTANTIATE_TEST_SUITE_P(
    HostShm, HostShmScheduleMatrix,
    ::testing::Values(GroupParam{"flat_w2", 2, {}}, GroupParam{"flat_w3", 3, {}},
                      GroupParam{"flat_w4", 4, {}}, GroupParam{"flat_w5", 5, {}},
                      GroupParam{"flat_w6", 6, {}}, GroupParam{"flat_w7", 7, {}},
                      GroupParam{"flat_w8", 8, {}}, GroupParam{"islands_2x2", 4, halves(4)},
                      GroupParam{"islands_2x3", 6, halves(6)},
                      GroupParam{"islands_2x4", 8, halves(8)},
                      GroupParam{"interleaved_2x2", 4, interleaved(4)},
                      GroupParam{"interleaved_2x2_rank0_in_island1", 4, interleaved(4, 1)},
                      GroupParam{"interleaved_2x3", 6, interleaved(6)},
                      GroupParam{"interleaved_2x4", 8, interleaved(8)}),
    [](const ::testing::TestParamInfo<GroupParam>& info) { return info.param.name; });

// ------------------------------------------------------------------ focused behaviours

TEST(HostShm, LargeMessagesAtMaxNumelAreCorrect) {
  constexpr int64_t kMaxNumel = 100000;  // 400 KB of fp32, not a power of two
  Workload w;
  w.world = 4;
  w.island_of = halves(4);
  w.tactics = all_tactics(w.world, w.island_of);
  uint64_t seed = 77;
  int n = 0;
  // LL tactics carry at most the LL slots' capacity: they run at exactly that size.
  const int64_t ll_capacity = plan::make_layout(kMaxNumel, w.world, 4).ll_capacity_bytes;
  ASSERT_LT(ll_capacity, kMaxNumel * 4);
  for (int t = 0; t < static_cast<int>(w.tactics.size()); ++t) {
    const DType dtype = plan::kAllDTypes[t % 3];
    const bool ll = plan::flag_in_data(w.tactics[t].tactic.protocol);
    const int64_t numel = ll ? ll_capacity / plan::dtype_bytes(dtype) : kMaxNumel;
    w.calls.push_back(CallCase{t, dtype, numel, 1 + (n % 4) * 3, n % 2 == 1, ++seed});
    ++n;
  }
  w.calls.push_back(CallCase{0, DType::kBF16, kMaxNumel - 8, 7, false, ++seed});
  run_and_check(w, kMaxNumel);
}

TEST(HostShm, BlockCountsChangingBetweenCallsStayCorrect) {
  Workload w;
  w.world = 4;
  w.tactics = all_tactics(w.world, {});
  uint64_t seed = 500;
  // Up, down, past the vector count, the maximum, and back to 1: counters of every block stay
  // equal, so whichever flags the next call uses expect the right generation.
  const int blocks[] = {1, 7, 2, 64, 3, 1, 16, 5, 64, 1};
  for (int t = 0; t < static_cast<int>(w.tactics.size()); ++t) {
    for (int b : blocks) {
      w.calls.push_back(CallCase{t, DType::kBF16, 8 * 41, b, false, ++seed});
    }
  }
  run_and_check(w, 4096);
}

TEST(HostShm, InPlaceIsCorrectForEverySchedule) {
  for (const auto& [world, island_of] :
       std::vector<std::pair<int, std::vector<int>>>{{3, {}}, {8, interleaved(8)}}) {
    SCOPED_TRACE("world " + std::to_string(world));
    Workload w;
    w.world = world;
    w.island_of = island_of;
    w.tactics = all_tactics(world, island_of);
    uint64_t seed = 900;
    for (int t = 0; t < static_cast<int>(w.tactics.size()); ++t) {
      for (DType dtype : plan::kAllDTypes) {
        w.calls.push_back(CallCase{t, dtype, 8 * 53, 1 + t % 3, true, ++seed});
      }
    }
    run_and_check(w, 1024);
  }
}

TEST(HostShm, GenerationWrapAroundIsSeamless) {
  for (const auto& [world, island_of] :
       std::vector<std::pair<int, std::vector<int>>>{{3, {}}, {4, halves(4)}}) {
    SCOPED_TRACE("world " + std::to_string(world));
    Workload w;
    w.world = world;
    w.island_of = island_of;
    w.tactics = all_tactics(world, island_of);
    for (int i = 0; i < 20; ++i) {
      // Tactics and block counts rotate so both parities of several flag sets cross the wrap.
      w.calls.push_back(CallCase{i % static_cast<int>(w.tactics.size()), plan::kAllDTypes[i % 3],
                                 8 * (5 + i), 1 + i % 3, i % 4 == 3,
                                 3000 + static_cast<uint64_t>(i)});
    }
    run_and_check(w, 1024, 0xFFFFFFFFu - 5);
  }
}

// One call of `numel` fp32 elements with `tactic`, timed; TransportFailure recorded in the
// report (the body returns normally).
void timed_call(HostShmWorkspace& ws, ChildEnv& env, const plan::Tactic& tactic, int world,
                int64_t numel) {
  const int program = ws.add_program(
      plan::encode_program(plan::build_schedule(tactic.algorithm, tactic.direction, tactic.staged,
                                                world, {}, tactic.protocol),
                           env.rank));
  std::vector<float> data(static_cast<size_t>(numel));
  for (int64_t i = 0; i < numel; ++i) data[i] = input_value(9, env.rank, i, DType::kFP32);
  std::vector<float> out(data.size());
  const double start = now_s();
  try {
    run_call(ws, program, DType::kFP32, tactic.blocks, data.data(), out.data(), numel,
             plan::call_signature(DType::kFP32, tactic));
    set_text(env.report->message, "the call returned instead of failing");
  } catch (const TransportFailure& e) {
    env.report->failure_elapsed_s = now_s() - start;
    record_exception(env.report, e);
    // The ranks are out of step now: the next call must be refused at once, not hang.
    const double retry = now_s();
    try {
      run_call(ws, program, DType::kFP32, tactic.blocks, data.data(), out.data(), numel,
               plan::call_signature(DType::kFP32, tactic));
    } catch (const TransportFailure&) {
      env.report->scenario_ok = now_s() - retry < 0.1 ? 1 : 0;
    }
  }
}

// Rank 2 of a world-3 group: mapped, then silent until ranks 0 and 1 have given up (at most
// 15 s), so they can only time out waiting for it.
void stay_silent_while_others_run(ChildEnv& env) {
  const double deadline = now_s() + 15.0;
  while (now_s() < deadline &&
         (outcome_of(env.arena, 0) == kRunning || outcome_of(env.arena, 1) == kRunning)) {
    usleep(1000);
  }
}

constexpr double kShortTimeoutS = 0.5;
// Two cores and up to eight processes: a failing call may end a little after its deadline.
constexpr double kSchedulingSlackS = 2.5;

// A group whose waits give up after kShortTimeoutS, its first call at initial_gen + 1.
GroupSpec short_timeout_group(int world, uint32_t initial_gen) {
  GroupSpec spec;
  spec.world = world;
  spec.layout = plan::make_layout(256, world, 4);
  spec.initial_gen = initial_gen;
  spec.timeout_s = kShortTimeoutS;
  spec.deadline_s = 20.0;
  return spec;
}

TEST(HostShm, TimeoutNamesThePeerThatNeverCalled) {
  constexpr uint32_t kInitialGen = 41;
  const GroupSpec spec = short_timeout_group(3, kInitialGen);
  const auto tactic = make_tactic(Algorithm::kOneshot, Direction::kPush, false);
  const GroupResult g = run_group(spec, [&](HostShmWorkspace& ws, ChildEnv& env) {
    if (env.rank == 2) return stay_silent_while_others_run(env);
    timed_call(ws, env, tactic, 3, 64);
  });
  expect_clean(g);
  bool someone_named_rank2 = false;
  for (int r = 0; r < 2; ++r) {
    const RankReport& rep = g.reports[r];
    SCOPED_TRACE(describe_child(g, r));
    ASSERT_EQ(rep.error_type, kTransportError);
    EXPECT_EQ(rep.diagnostic.kind, static_cast<uint32_t>(plan::FailureKind::kTimeout));
    EXPECT_EQ(rep.diagnostic.rank, static_cast<uint32_t>(r));
    EXPECT_NE(rep.diagnostic.peer, static_cast<uint32_t>(r));
    EXPECT_EQ(rep.diagnostic.gen_expected, kInitialGen + 1);
    EXPECT_EQ(rep.diagnostic.gen_seen, kInitialGen);
    EXPECT_EQ(rep.diagnostic.numel, 64u);
    someone_named_rank2 |= rep.diagnostic.peer == 2;
    const std::string message = rep.message;
    EXPECT_NE(message.find("rank " + std::to_string(r)), std::string::npos);
    EXPECT_NE(message.find("rank " + std::to_string(rep.diagnostic.peer)), std::string::npos);
    EXPECT_GE(rep.failure_elapsed_s, kShortTimeoutS * 0.9);
    EXPECT_LE(rep.failure_elapsed_s, kShortTimeoutS + kSchedulingSlackS);
    EXPECT_EQ(rep.scenario_ok, 1) << "a call after the failure was not refused at once";
  }
  EXPECT_TRUE(someone_named_rank2);
  EXPECT_EQ(g.reports[2].outcome, kReturned) << describe_child(g, 2);
}

// A wait that has yielded asks the interrupt check now and then, and a true
// abandons the call at once with kInterrupted at that step (recorded: the next call is refused),
// long before the deadline; flag and LL waits alike. Rank 1 never calls. The timeout is long
// (10 s) so that only the check can end the wait.
TEST(HostShm, AnInterruptCheckThatSaysStopEndsAWaitAtOnceAndFailsTheWorkspace) {
  for (const plan::Protocol protocol : plan::kProtocolNames.values()) {
    SCOPED_TRACE(std::string(plan::protocol_name(protocol)));
    GroupSpec spec = short_timeout_group(2, 5);
    spec.timeout_s = 10.0;
    auto tactic = make_tactic(Algorithm::kOneshot, Direction::kPush, false);
    tactic.protocol = protocol;
    const GroupResult g = run_group(spec, [&](HostShmWorkspace& ws, ChildEnv& env) {
      if (env.rank == 1) {
        const double deadline = now_s() + 15.0;
        while (now_s() < deadline && outcome_of(env.arena, 0) == kRunning) sched_yield();
        return;
      }
      int asked = 0;
      ws.set_interrupt_check([&asked] { return ++asked == 3; });  // the third look says stop
      timed_call(ws, env, tactic, 2, 64);
      env.report->calls_done = asked;
    });
    expect_clean(g);
    const RankReport& rep = g.reports[0];
    SCOPED_TRACE(describe_child(g, 0));
    ASSERT_EQ(rep.error_type, kTransportError);
    EXPECT_EQ(rep.diagnostic.kind, static_cast<uint32_t>(plan::FailureKind::kInterrupted));
    EXPECT_EQ(rep.diagnostic.rank, 0u);
    EXPECT_EQ(rep.diagnostic.peer, 1u);
    EXPECT_NE(std::string(rep.message).find("rank 0 was interrupted"), std::string::npos);
    EXPECT_EQ(rep.calls_done, 3) << "the check was asked again after it said stop";
    // Three looks 20 ms apart, not the 10 s deadline.
    EXPECT_LT(rep.failure_elapsed_s, 10.0 * 0.5);
    EXPECT_EQ(rep.scenario_ok, 1) << "a call after the interruption was not refused at once";
  }
}

// Rank 0 sends a call to the fallback (it runs plan::skip_program, as the
// communicator does) while rank 1 runs it on the executor and times out. At the next call of the
// same shape rank 0 must not sum what rank 1 left for the abandoned call: it times out naming
// rank 1. Without the skip (`skip` false, the control) it returns that mixed sum, which is why
// every fallback call takes its generation.
GroupResult diverge(const plan::Tactic& tactic, bool skip) {
  GroupSpec spec = short_timeout_group(2, 7);
  return run_group(spec, [&](HostShmWorkspace& ws, ChildEnv& env) {
    const int program = ws.add_program(
        plan::encode_program(plan::build_schedule(tactic.algorithm, tactic.direction, tactic.staged,
                                                  2, {}, tactic.protocol),
                             env.rank));
    const int skip_program = ws.add_program(plan::skip_program(env.rank, 2));
    constexpr int64_t kNumel = 64;
    std::vector<float> in(kNumel, env.rank == 0 ? 1.0f : 100.0f), out(kNumel, 0.0f);
    const uint32_t signature = plan::call_signature(DType::kFP32, tactic);
    if (env.rank == 1) {  // the abandoned call, on the executor: it times out
      try {
        run_call(ws, program, DType::kFP32, 1, in.data(), out.data(), kNumel, signature);
      } catch (const TransportFailure&) {
      }
      arrive_and_wait(env.arena, 3 * spec.world, 10.0);
      return;
    }
    if (skip) run_call(ws, skip_program, DType::kFP32, 1, nullptr, nullptr, 0, 0);
    arrive_and_wait(env.arena, 3 * spec.world, 10.0);  // rank 1 has given up on its call
    std::fill(in.begin(), in.end(), 2.0f);
    try {
      run_call(ws, program, DType::kFP32, 1, in.data(), out.data(), kNumel, signature);
      env.report->scenario_ok = 2;  // returned
      set_text(env.report->message, "returned " + std::to_string(static_cast<int>(out[0])));
    } catch (const TransportFailure& e) {
      record_exception(env.report, e);
      env.report->scenario_ok = e.diagnostic().peer == 1 ? 1 : 0;
    }
  });
}

TEST(HostShm, ACallOneRankSentToTheFallbackNeverMixesIntoTheNext) {
  for (const plan::Tactic& tactic :
       {make_tactic(Algorithm::kOneshot, Direction::kPush, false), ll_tactic(Algorithm::kOneshot),
        make_tactic(Algorithm::kTwoshot, Direction::kPull, true)}) {
    SCOPED_TRACE(plan::tactic_label(tactic));
    const GroupResult g = diverge(tactic, true);
    expect_clean(g);
    EXPECT_EQ(g.reports[0].scenario_ok, 1)
        << "rank 0 did not fail naming rank 1: " << describe_child(g, 0);
    EXPECT_EQ(g.reports[0].error_type, kTransportError);
  }
}

TEST(HostShm, WithoutTheSkipTheAbandonedCallsDataIsSummed) {
  // The control: the harness above can tell a mixed sum from a refusal.
  const GroupResult g = diverge(make_tactic(Algorithm::kOneshot, Direction::kPush, false), false);
  expect_clean(g);
  ASSERT_EQ(g.reports[0].scenario_ok, 2) << describe_child(g, 0);
  // Rank 0's 2 plus the 100 rank 1 left for the abandoned call.
  EXPECT_EQ(std::string(g.reports[0].message), "returned 102");
}

TEST(HostShm, KilledPeerIsReportedAndLeavesNothingInDevShm) {
  constexpr int kCallsBeforeDeath = 5;
  GroupSpec spec;
  spec.world = 2;
  spec.layout = plan::make_layout(256, 2, 4);
  spec.timeout_s = kShortTimeoutS;
  spec.deadline_s = 20.0;
  const auto tactic = make_tactic(Algorithm::kTwoshot, Direction::kPush, true);
  const plan::Schedule schedule =
      plan::build_schedule(Algorithm::kTwoshot, Direction::kPush, true, 2);
  const GroupResult g = run_group(spec, [&](HostShmWorkspace& ws, ChildEnv& env) {
    const int program = ws.add_program(plan::encode_program(schedule, env.rank));
    std::vector<float> data(64, 1.0f + env.rank);
    for (int i = 0; i < kCallsBeforeDeath; ++i) {
      run_call(ws, program, DType::kFP32, 1, data.data(), data.data(), 64,
               plan::call_signature(DType::kFP32, tactic));
      env.report->calls_done = i + 1;
    }
    if (env.rank == 1) kill(getpid(), SIGKILL);  // mid-sequence, no destructor, no cleanup
    timed_call(ws, env, tactic, 2, 64);
  });
  expect_clean(g);
  ASSERT_EQ(g.status.size(), 2u);
  EXPECT_TRUE(WIFSIGNALED(g.status[1]) && WTERMSIG(g.status[1]) == SIGKILL) << describe_child(g, 1);
  const RankReport& rep = g.reports[0];
  SCOPED_TRACE(describe_child(g, 0));
  ASSERT_EQ(rep.error_type, kTransportError);
  EXPECT_EQ(rep.diagnostic.kind, static_cast<uint32_t>(plan::FailureKind::kTimeout));
  EXPECT_EQ(rep.diagnostic.peer, 1u);
  EXPECT_EQ(rep.diagnostic.gen_expected, static_cast<uint32_t>(kCallsBeforeDeath + 1));
  EXPECT_LE(rep.failure_elapsed_s, kShortTimeoutS + kSchedulingSlackS);
  EXPECT_TRUE(segments_of(g.pids[0]).empty());
  EXPECT_TRUE(segments_of(g.pids[1]).empty());
}

// Ranks that enter the same generation with different calls must fail fast on every rank.
void expect_disagreement_fails(int world, const std::vector<plan::Tactic>& tactic_of,
                               const std::vector<int64_t>& numel_of, bool expect_mismatch) {
  GroupSpec spec;
  spec.world = world;
  spec.layout = plan::make_layout(1024, world, 4);
  spec.timeout_s = kShortTimeoutS;
  spec.deadline_s = 20.0;
  const GroupResult g = run_group(spec, [&](HostShmWorkspace& ws, ChildEnv& env) {
    timed_call(ws, env, tactic_of[env.rank], world, numel_of[env.rank]);
  });
  expect_clean(g);
  int mismatches = 0;
  for (int r = 0; r < world; ++r) {
    const RankReport& rep = g.reports[r];
    SCOPED_TRACE(describe_child(g, r));
    ASSERT_EQ(rep.error_type, kTransportError);
    EXPECT_LE(rep.failure_elapsed_s, kShortTimeoutS + kSchedulingSlackS);
    EXPECT_EQ(rep.scenario_ok, 1) << "a call after the failure was not refused at once";
    if (rep.diagnostic.kind == static_cast<uint32_t>(plan::FailureKind::kMismatch)) {
      ++mismatches;
      const int peer = static_cast<int>(rep.diagnostic.peer);
      ASSERT_LT(peer, world);
      EXPECT_EQ(rep.diagnostic.numel, static_cast<uint32_t>(numel_of[r]));
      EXPECT_EQ(rep.diagnostic.peer_numel, static_cast<uint32_t>(numel_of[peer]));
      EXPECT_EQ(rep.diagnostic.peer_signature, plan::call_signature(DType::kFP32, tactic_of[peer]));
      EXPECT_NE(std::string(rep.message).find("disagree"), std::string::npos);
    } else {
      // An LL reader waits for data instead of a flag: it times out (or sees a foreign tag).
      const auto kind = static_cast<plan::FailureKind>(rep.diagnostic.kind);
      EXPECT_TRUE(kind == plan::FailureKind::kTimeout || kind == plan::FailureKind::kLLTimeout ||
                  kind == plan::FailureKind::kLLMismatch)
          << rep.message;
    }
  }
  if (expect_mismatch) {
    EXPECT_GE(mismatches, 1);
  }
}

TEST(HostShm, DifferentNumelOnTwoRanksIsAMismatchNotAHang) {
  const auto oneshot = make_tactic(Algorithm::kOneshot, Direction::kPush, false);
  expect_disagreement_fails(2, {oneshot, oneshot}, {64, 128}, true);
  const auto twoshot = make_tactic(Algorithm::kTwoshot, Direction::kPull, true, 2);
  expect_disagreement_fails(4, {twoshot, twoshot, twoshot, twoshot}, {256, 256, 256, 96}, true);
}

TEST(HostShm, DifferentAlgorithmsOnTwoRanksFailWithinTheTimeout) {
  const auto oneshot = make_tactic(Algorithm::kOneshot, Direction::kPush, true);
  const auto twoshot = make_tactic(Algorithm::kTwoshot, Direction::kPush, true);
  expect_disagreement_fails(3, {oneshot, twoshot, oneshot}, {64, 64, 64}, false);
  const auto pull = make_tactic(Algorithm::kOneshot, Direction::kPull, false);
  expect_disagreement_fails(2, {oneshot, pull}, {64, 64}, false);
}

// LL and lamport: the data carries its own arrival (lamport: its slice's header names the call).
class HostShmFlagInData : public ::testing::TestWithParam<plan::Protocol> {
 protected:
  static plan::Tactic tactic() {
    plan::Tactic t = ll_tactic(Algorithm::kOneshot);
    t.protocol = GetParam();
    return t;
  }
};

TEST_P(HostShmFlagInData, LLTimeoutNamesTheWriterThatNeverCalled) {
  constexpr uint32_t kInitialGen = 0xFFFFFFFFu;  // the first call's tag crosses 2^32
  const GroupSpec spec = short_timeout_group(3, kInitialGen);
  const auto tactic = HostShmFlagInData::tactic();
  const GroupResult g = run_group(spec, [&](HostShmWorkspace& ws, ChildEnv& env) {
    if (env.rank == 2) return stay_silent_while_others_run(env);
    timed_call(ws, env, tactic, 3, 64);
  });
  expect_clean(g);
  for (int r = 0; r < 2; ++r) {
    const RankReport& rep = g.reports[r];
    SCOPED_TRACE(describe_child(g, r));
    ASSERT_EQ(rep.error_type, kTransportError);
    EXPECT_EQ(rep.diagnostic.kind, static_cast<uint32_t>(plan::FailureKind::kLLTimeout));
    EXPECT_EQ(rep.diagnostic.peer, 2u);  // the only rank whose data never lands
    EXPECT_EQ(rep.diagnostic.flag_owner, static_cast<uint32_t>(r));
    EXPECT_EQ(rep.diagnostic.gen_expected, uint64_t{kInitialGen} + 1);
    EXPECT_EQ(
        rep.diagnostic.peer_signature,
        plan::ll_tag(uint64_t{kInitialGen} + 1, 64, plan::call_signature(DType::kFP32, tactic)));
    EXPECT_NE(std::string(rep.message).find("waiting for rank 2's data in LL slot 2"),
              std::string::npos)
        << rep.message;
    EXPECT_GE(rep.failure_elapsed_s, kShortTimeoutS * 0.9);
    EXPECT_LE(rep.failure_elapsed_s, kShortTimeoutS + kSchedulingSlackS);
    EXPECT_EQ(rep.scenario_ok, 1) << "a call after the failure was not refused at once";
  }
}

TEST_P(HostShmFlagInData, LLCallsThatDisagreeAreAMismatchNotGarbage) {
  // Same generation, different numel: the tags differ, so the reader refuses the data at once.
  GroupSpec spec;
  spec.world = 2;
  spec.layout = plan::make_layout(1024, 2, 4);
  spec.timeout_s = kShortTimeoutS;
  spec.deadline_s = 20.0;
  const auto tactic = HostShmFlagInData::tactic();
  const int64_t numel_of[] = {64, 128};
  const GroupResult g = run_group(spec, [&](HostShmWorkspace& ws, ChildEnv& env) {
    timed_call(ws, env, tactic, 2, numel_of[env.rank]);
  });
  expect_clean(g);
  int mismatches = 0;
  for (int r = 0; r < 2; ++r) {
    const RankReport& rep = g.reports[r];
    SCOPED_TRACE(describe_child(g, r));
    ASSERT_EQ(rep.error_type, kTransportError);
    EXPECT_LE(rep.failure_elapsed_s, kShortTimeoutS + kSchedulingSlackS);
    if (rep.diagnostic.kind == static_cast<uint32_t>(plan::FailureKind::kLLMismatch)) {
      ++mismatches;
      EXPECT_EQ(rep.diagnostic.peer, static_cast<uint32_t>(1 - r));
      EXPECT_NE(std::string(rep.message).find("disagree"), std::string::npos) << rep.message;
    } else {
      EXPECT_EQ(rep.diagnostic.kind, static_cast<uint32_t>(plan::FailureKind::kLLTimeout));
    }
  }
  EXPECT_GE(mismatches, 1);
  // An LL rank and a flag rank in one generation: nobody reduces garbage, both fail in time.
  expect_disagreement_fails(2, {tactic, make_tactic(Algorithm::kOneshot, Direction::kPush, false)},
                            {64, 64}, false);
  // An LL rank and a lamport rank in one generation share the slots but not the format: the
  // lamport reader never sees a header, the LL reader never sees its tag.
  if (GetParam() == plan::Protocol::kLamport) {
    expect_disagreement_fails(2, {ll_tactic(Algorithm::kOneshot), tactic}, {64, 64}, false);
  }
}

INSTANTIATE_TEST_SUITE_P(Protocols, HostShmFlagInData,
                         ::testing::Values(plan::Protocol::kLL, plan::Protocol::kLamport),
                         [](const ::testing::TestParamInfo<plan::Protocol>& info) {
                           return std::string(plan::protocol_name(info.param));
                         });

TEST(HostShm, LLAndFlagTacticsInterleaveAcrossManyCallsOfChangingSize) {
  // Large LL calls leave words far into the slots that the small calls in between never touch;
  // every read resets its words, so nothing stale is taken for data when a large call returns.
  Workload w;
  w.world = 3;
  w.tactics = all_tactics(3, {});
  std::vector<int> ll_index;
  for (int t = 0; t < static_cast<int>(w.tactics.size()); ++t) {
    if (plan::flag_in_data(w.tactics[t].tactic.protocol)) ll_index.push_back(t);
  }
  ASSERT_EQ(ll_index.size(), 4u);  // oneshot and twoshot, each ll and lamport: they share slots
  for (int i = 0; i < 60; ++i) {
    const bool large = i % 10 == 0;
    const int tactic =
        i % 3 == 2 ? i % static_cast<int>(w.tactics.size()) : ll_index[i % ll_index.size()];
    w.calls.push_back(CallCase{tactic, plan::kAllDTypes[i % 3], large ? 1024 : 8 * (1 + i % 4),
                               1 + i % 4, i % 5 == 4, 7000 + static_cast<uint64_t>(i)});
  }
  run_and_check(w, 1024, 0xFFFFFFFFu - 30);
}

// A sum with +0.0 must give back every fp16 and bf16 value exactly (-0 becomes +0, NaN stays
// NaN): pins the fp32 conversions both ways, subnormals and infinities included. In every
// protocol: lamport's writer turns -0 into +0 (plan::ll_dense_word), LL's carries it in words.
class HostShmEveryValue : public ::testing::TestWithParam<plan::Protocol> {};

TEST_P(HostShmEveryValue, EveryHalfPrecisionValueSurvivesASumWithZero) {
  constexpr int64_t kNumel = 65536;
  GroupSpec spec;
  spec.world = 2;
  spec.layout = plan::make_layout(kNumel, 2, 2);
  auto tactic = make_tactic(Algorithm::kOneshot, Direction::kPush, false);
  tactic.protocol = GetParam();
  const plan::Schedule schedule =
      plan::build_schedule(Algorithm::kOneshot, Direction::kPush, false, 2, {}, tactic.protocol);
  const GroupResult g = run_group(spec, [&](HostShmWorkspace& ws, ChildEnv& env) {
    const int program = ws.add_program(plan::encode_program(schedule, env.rank));
    std::vector<uint16_t> input(kNumel);
    std::vector<uint16_t> output(kNumel);
    for (DType dtype : {DType::kFP16, DType::kBF16}) {
      for (int64_t i = 0; i < kNumel; ++i) {
        input[i] = env.rank == 0 ? static_cast<uint16_t>(i) : 0;
      }
      std::fill(output.begin(), output.end(), 0x1234);
      run_call(ws, program, dtype, 3, input.data(), output.data(), kNumel,
               plan::call_signature(dtype, tactic));
      for (int64_t i = 0; i < kNumel; ++i) {
        const auto bits = static_cast<uint16_t>(i);
        uint8_t bytes[4] = {};  // decode() reads up to 4 bytes
        std::memcpy(bytes, &bits, 2);
        const double in = decode(dtype, bytes);
        std::memcpy(bytes, &output[i], 2);
        const double out = decode(dtype, bytes);
        bool ok = false;
        if (std::isnan(in)) {
          ok = std::isnan(out);
        } else if (bits == 0x8000) {
          ok = output[i] == 0;
        } else {
          ok = output[i] == bits;
        }
        if (!ok && env.report->check_failures++ == 0) {
          char text[256];
          std::snprintf(text, sizeof(text), "%s: 0x%04x + 0 gave 0x%04x",
                        std::string(plan::dtype_name(dtype)).c_str(), bits, output[i]);
          set_text(env.report->check_message, text);
        }
      }
      env.report->calls_done += 1;
    }
  });
  expect_all_returned(g);
}

INSTANTIATE_TEST_SUITE_P(Protocols, HostShmEveryValue,
                         ::testing::ValuesIn(plan::kProtocolNames.values()),
                         [](const ::testing::TestParamInfo<plan::Protocol>& info) {
                           return std::string(plan::protocol_name(info.param));
                         });

// The edges of rounding that random inputs rarely reach: overflow to infinity, the tie at the
// largest finite value, ties to even near 1, NaN and inf - inf.
TEST(HostShm, OverflowTiesAndNaNRoundAsIeeeSays) {
  struct Case {
    DType dtype;
    double a;  // rank 0's element
    double b;  // rank 1's element
    double want;
  };
  const double inf = INFINITY;
  const double nan = NAN;
  const std::vector<Case> cases = {
      {DType::kFP16, 60000, 60000, inf},
      {DType::kFP16, -60000, -60000, -inf},
      {DType::kFP16, 65504, 8, 65504},           // below the halfway point to 65536
      {DType::kFP16, 65504, 16, inf},            // exactly halfway: even is 65536, i.e. inf
      {DType::kFP16, 1, std::ldexp(1, -11), 1},  // tie, 1.0 is even
      {DType::kFP16, 1 + std::ldexp(1, -10), std::ldexp(1, -11), 1 + std::ldexp(1, -9)},
      {DType::kFP16, std::ldexp(1, -24), std::ldexp(1, -24), std::ldexp(1, -23)},  // subnormals
      {DType::kFP16, inf, -inf, nan},
      {DType::kFP16, nan, 1, nan},
      {DType::kBF16, std::ldexp(1.5, 127), std::ldexp(1.5, 127), inf},
      {DType::kBF16, 1, std::ldexp(1, -8), 1},
      {DType::kBF16, 1 + std::ldexp(1, -7), std::ldexp(1, -8), 1 + std::ldexp(1, -6)},
      {DType::kBF16, inf, -inf, nan},
      {DType::kBF16, nan, 1, nan},
      {DType::kFP32, std::ldexp(1.5, 127), std::ldexp(1.5, 127), inf},
      {DType::kFP32, nan, 1, nan},
  };
  GroupSpec spec;
  spec.world = 2;
  spec.layout = plan::make_layout(1024, 2, 4);
  const auto tactic = make_tactic(Algorithm::kOneshot, Direction::kPush, false);
  const plan::Schedule schedule =
      plan::build_schedule(Algorithm::kOneshot, Direction::kPush, false, 2);
  const GroupResult g = run_group(spec, [&](HostShmWorkspace& ws, ChildEnv& env) {
    const int program = ws.add_program(plan::encode_program(schedule, env.rank));
    for (DType dtype : plan::kAllDTypes) {
      const int elem = plan::dtype_bytes(dtype);
      std::vector<const Case*> mine;
      for (const Case& c : cases) {
        if (c.dtype == dtype) mine.push_back(&c);
      }
      const int64_t numel = 16;  // a multiple of 16 bytes in every dtype; the rest is 1 + 1
      std::vector<uint8_t> input(numel * elem);
      std::vector<uint8_t> output(numel * elem, 0xFF);
      for (int64_t i = 0; i < numel; ++i) {
        const double v =
            i < static_cast<int64_t>(mine.size()) ? (env.rank == 0 ? mine[i]->a : mine[i]->b) : 1.0;
        encode(dtype, static_cast<float>(v), &input[i * elem]);
      }
      run_call(ws, program, dtype, 1, input.data(), output.data(), numel,
               plan::call_signature(dtype, tactic));
      for (int64_t i = 0; i < numel; ++i) {
        const double want = i < static_cast<int64_t>(mine.size()) ? mine[i]->want : 2.0;
        const double got = decode(dtype, &output[i * elem]);
        const bool ok = std::isnan(want) ? std::isnan(got) : got == want;
        if (!ok && env.report->check_failures++ == 0) {
          char text[256];
          std::snprintf(text, sizeof(text), "%s element %lld: got %.9g, expected %.9g",
                        std::string(plan::dtype_name(dtype)).c_str(), static_cast<long long>(i),
                        got, want);
          set_text(env.report->check_message, text);
        }
      }
      env.report->calls_done += 1;
    }
  });
  expect_all_returned(g);
}

// ------------------------------------------------------------------ single-process behaviours

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

template <typename Exception, typename F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const Exception& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

// What the workspace itself refuses: bad peers, programs that fail plan::check_program, and
// tactics outside the layout. Calls are admitted by the communicator (tests/python), so run()
// re-checks nothing.
TEST(HostShm, RejectsInvalidSetupSayingWhatWasExpected) {
  const plan::Layout layout = plan::make_layout(1024, 2, 4);
  std::string names[2];
  {
    HostShmWorkspace ws0(layout, 0, 0, 1.0);
    HostShmWorkspace ws1(layout, 1, 0, 1.0);
    names[0] = ws0.segment_name();
    names[1] = ws1.segment_name();
    EXPECT_EQ(ws0.local_token(), names[0]);
    const plan::Program program = plan::encode_program(
        plan::build_schedule(Algorithm::kOneshot, Direction::kPush, false, 2), 0);

    EXPECT_TRUE(contains(message_of<std::invalid_argument>([&] { ws0.open_peers({names[0]}); }),
                         "one segment"));
    EXPECT_TRUE(contains(message_of<std::invalid_argument>([&] {
                           ws0.open_peers({names[1], names[0]});
                         }),
                         "own segment"));
    ws0.open_peers({names[0], names[1]});
    EXPECT_TRUE(contains(message_of<std::logic_error>([&] {
                           ws0.open_peers({names[0], names[1]});
                         }),
                         "already"));

    // None of these may touch shared memory: rank 1 never runs, so a wait would time out.
    plan::Tactic tactic;
    tactic.blocks = 0;
    EXPECT_TRUE(contains(ws0.why_not(tactic).value_or("accepted"),
                         "blocks must be in 1..64 (the workspace's max_blocks), got 0"));
    tactic.blocks = 65;
    EXPECT_TRUE(contains(ws0.why_not(tactic).value_or("accepted"),
                         "blocks must be in 1..64 (the workspace's max_blocks), got 65"));
    tactic.blocks = 64;
    EXPECT_EQ(ws0.why_not(tactic), std::nullopt);
    const plan::Program other_rank = plan::encode_program(
        plan::build_schedule(Algorithm::kOneshot, Direction::kPush, false, 2), 1);
    EXPECT_TRUE(contains(message_of<std::invalid_argument>([&] { ws0.add_program(other_rank); }),
                         "program is for rank 1"));
    plan::Program peer_input = program;
    peer_input.steps[0].kind = plan::StepKind::kReduce;
    peer_input.steps[0].chunk = 0;
    peer_input.steps[0].num_srcs = 1;
    peer_input.steps[0].dst = plan::BufRef{plan::Space::kOutput, 0, 0, 0};
    peer_input.steps[0].srcs[0] = plan::BufRef{plan::Space::kInput, 1, 0, 0};
    EXPECT_TRUE(contains(message_of<std::invalid_argument>([&] { ws0.add_program(peer_input); }),
                         "only the executing rank's own tensors are local"));
    EXPECT_EQ(ws0.add_program(program), 0);
  }
  EXPECT_FALSE(segment_exists(names[0]));
  EXPECT_FALSE(segment_exists(names[1]));

  EXPECT_TRUE(
      contains(message_of<std::invalid_argument>([&] { HostShmWorkspace bad(layout, 2, 0, 1.0); }),
               "rank must be 0..1, got 2"));
  EXPECT_TRUE(
      contains(message_of<std::invalid_argument>([&] { HostShmWorkspace bad(layout, 0, 0, -1.0); }),
               "timeout_s must be >= 0"));
  EXPECT_TRUE(segments_of(getpid()).empty());
}

TEST(HostShm, TheFactoryCapsHostBlocksAndRejectsUnknownTransports) {
  WorkspaceOptions options;
  options.max_numel = 1024;
  options.world = 2;
  options.elem_bytes = 4;
  const auto ws = make_workspace(options);
  EXPECT_EQ(ws->device(), -1);
  EXPECT_EQ(ws->layout().max_blocks, HostShmWorkspace::kMaxBlocks);
  EXPECT_TRUE(contains(message_of<std::invalid_argument>([&] { kKindNames.parse("infiniband"); }),
                       "transport: expected one of host_shm, cuda_ipc, cuda_host (aliases: host = "
                       "host_shm, cuda = cuda_ipc, p2p = cuda_ipc, hostmem = cuda_host), got "
                       "'infiniband'"));
  options.transport = static_cast<Kind>(7);
  EXPECT_TRUE(contains(message_of<std::invalid_argument>([&] { make_workspace(options); }),
                       "unknown transport code 7; expected one of host_shm, cuda_ipc, cuda_host"));
}

// The workspace, not its caller, says whether fused (two-destination) steps may be installed.
TEST(HostShm, TheHostWorkspaceSaysItRunsFusedSteps) {
  const plan::Layout layout = plan::make_layout(1024, 2, 4);
  HostShmWorkspace ws(layout, 0, 0, 1.0);
  EXPECT_TRUE(ws.runs_multi_destination_steps());
  const plan::Schedule fused = plan::fuse_forwarding_copies(
      plan::build_schedule(Algorithm::kTwoshot, Direction::kPush, false, 2));
  EXPECT_EQ(ws.add_program(plan::encode_program(fused, 0)), 0);
}

TEST(HostShm, OpenPeersRejectsAPeerBuiltWithAnotherLayout) {
  const plan::Layout small = plan::make_layout(1024, 2, 4);
  const plan::Layout large = plan::make_layout(2048, 2, 4);
  std::string names[2];
  {
    HostShmWorkspace ws0(small, 0, 0, 1.0);
    HostShmWorkspace ws1(large, 1, 0, 1.0);
    names[0] = ws0.segment_name();
    names[1] = ws1.segment_name();
    const std::string message = message_of<std::runtime_error>([&] {
      ws0.open_peers({names[0], names[1]});
    });
    EXPECT_TRUE(contains(message, "rank 1")) << message;
    EXPECT_TRUE(contains(message, std::to_string(large.total_bytes))) << message;
    EXPECT_TRUE(contains(message, std::to_string(small.total_bytes))) << message;
    // This rank cannot connect any more: its name is gone at once, not when the object dies.
    EXPECT_FALSE(segment_exists(names[0])) << "a failed open_peers() left our segment linked";
    EXPECT_TRUE(segment_exists(names[1])) << "only the failing rank's own name goes";

    const std::string missing = message_of<std::runtime_error>([&] {
      ws0.open_peers({names[0], "/pcie_ar.0.0000000000000000.r1"});
    });
    EXPECT_TRUE(contains(missing, "rank 1")) << missing;
  }
  EXPECT_FALSE(segment_exists(names[0]));
  EXPECT_FALSE(segment_exists(names[1]));
}

TEST(HostShm, SegmentNamesAreUniquePrivateAndUnlinked) {
  const plan::Layout layout = plan::make_layout(512, 4, 2);
  // "/pcie_ar.<creator pid>.<64 random bits>.r<rank>": unguessable, and a dead creator's
  // segments can be told apart (reclaim_orphaned_segments()).
  // (No std::regex: GCC 12 reports its std::function members as maybe-uninitialized under
  // -fsanitize=address,undefined, which -Werror turns into a build failure.)
  const std::string prefix = "/pcie_ar." + std::to_string(getpid()) + ".";
  const auto well_formed = [&prefix](const std::string& name) {
    const size_t hex = prefix.size();
    if (name.size() != hex + 16 + 3 || name.compare(0, hex, prefix) != 0) return false;
    for (size_t i = hex; i < hex + 16; ++i) {
      if (!std::isdigit(static_cast<unsigned char>(name[i])) && (name[i] < 'a' || name[i] > 'f')) {
        return false;
      }
    }
    return name.compare(hex + 16, 3, ".r3") == 0;
  };
  std::string first;
  {
    HostShmWorkspace a(layout, 3, 0, 0.0);
    HostShmWorkspace b(layout, 3, 0, 0.0);
    first = a.segment_name();
    EXPECT_TRUE(well_formed(a.segment_name())) << a.segment_name();
    EXPECT_TRUE(well_formed(b.segment_name())) << b.segment_name();
    EXPECT_NE(a.segment_name(), b.segment_name());
    struct stat info {};
    ASSERT_EQ(stat(("/dev/shm" + a.segment_name()).c_str(), &info), 0);
    EXPECT_EQ(info.st_mode & 0777, 0600u);
    EXPECT_EQ(static_cast<uint64_t>(info.st_size), layout.total_bytes);
    a.retire_token();
    a.retire_token();  // idempotent
    EXPECT_FALSE(segment_exists(a.segment_name()));
    EXPECT_TRUE(segment_exists(b.segment_name()));
  }
  EXPECT_FALSE(segment_exists(first));
  EXPECT_TRUE(segments_of(getpid()).empty());
}

// Waits (at most 30 s) until *flag is non-zero.
bool await_flag(int* flag) {
  const double deadline = now_s() + 30.0;
  while (std::atomic_ref<int>(*flag).load(std::memory_order_acquire) == 0) {
    if (now_s() > deadline) return false;
    usleep(1000);
  }
  return true;
}

// A rank killed after creating its segment and before retire_token() cannot unlink it. The next
// workspace this user creates removes it once its creator is gone, and leaves alone the segment
// of a creator that is still alive (even a zombie), and names it cannot attribute.
TEST(HostShm, ASegmentOrphanedByADeadCreatorIsReclaimedByTheNextWorkspace) {
  struct Page {
    char orphan[128];
    char live[128];
    int live_ready;
    int live_may_exit;
  };
  SharedPages pages(sizeof(Page));
  auto* page = static_cast<Page*>(pages.get());
  const plan::Layout layout = plan::make_layout(1024, 2, 4);

  std::fflush(nullptr);
  const pid_t orphan_maker = fork();
  ASSERT_GE(orphan_maker, 0);
  if (orphan_maker == 0) {
    try {
      HostShmWorkspace ws(layout, 0, 0, 1.0);
      set_text(page->orphan, ws.segment_name());
      _exit(0);  // dies before retire_token(): no destructor, no cleanup
    } catch (...) {
    }
    _exit(1);
  }
  const pid_t live = fork();
  if (live == 0) {
    int code = 1;
    try {
      HostShmWorkspace ws(layout, 1, 0, 1.0);
      set_text(page->live, ws.segment_name());
      std::atomic_ref<int>(page->live_ready).store(1, std::memory_order_release);
      code = await_flag(&page->live_may_exit) ? 0 : 2;
    } catch (...) {
    }
    _exit(code);  // after the destructor: a live creator cleans up after itself
  }
  ASSERT_GE(live, 0);

  // Until it is reaped the orphan maker is a zombie whose pid is taken: no workspace created by
  // a concurrent test can reclaim its segment before we have looked at it.
  siginfo_t info{};
  ASSERT_EQ(waitid(P_PID, static_cast<id_t>(orphan_maker), &info, WEXITED | WNOWAIT), 0);
  const std::string orphan = page->orphan;
  ASSERT_FALSE(orphan.empty()) << "the child could not create its workspace";
  EXPECT_TRUE(contains(orphan, "/pcie_ar." + std::to_string(orphan_maker) + ".")) << orphan;
  EXPECT_TRUE(segment_exists(orphan)) << "the dead creator's segment should still be linked";
  reclaim_orphaned_segments();
  EXPECT_TRUE(segment_exists(orphan)) << "reclaimed while its creator was not yet reaped";
  int status = 0;
  ASSERT_EQ(waitpid(orphan_maker, &status, 0), orphan_maker);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);

  ASSERT_TRUE(await_flag(&page->live_ready));
  const std::string live_name = page->live;
  EXPECT_TRUE(contains(live_name, "/pcie_ar." + std::to_string(live) + ".")) << live_name;

  // Names whose creator cannot be told are never touched: pid 0, no '.' after the pid.
  const std::string unattributable[] = {
      "/pcie_ar.0." + std::to_string(getpid()) + ".r0",
      "/pcie_ar." + std::to_string(orphan_maker),
  };
  for (const std::string& name : unattributable) {
    const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0) << name;
    if (fd >= 0) close(fd);
  }
  // Nor another user's entry, dead creator or not (root can make one here).
  const std::string foreign = "/pcie_ar." + std::to_string(orphan_maker) + ".foreign.r0";
  bool have_foreign = false;
  if (geteuid() == 0) {
    const int fd = shm_open(foreign.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    have_foreign = fd >= 0 && fchown(fd, 65534, 65534) == 0;
    if (fd >= 0) close(fd);
  }

  {
    HostShmWorkspace ws(layout, 0, 0, 1.0);  // creating a workspace reclaims
    EXPECT_FALSE(segment_exists(orphan)) << "the orphan was not reclaimed: " << orphan;
    EXPECT_TRUE(segment_exists(live_name)) << "a live creator's segment was reclaimed";
    EXPECT_TRUE(segment_exists(ws.segment_name()));
    for (const std::string& name : unattributable) EXPECT_TRUE(segment_exists(name)) << name;
    if (have_foreign) {
      EXPECT_TRUE(segment_exists(foreign)) << "another user's entry was removed";
    }
  }
  for (const std::string& name : unattributable) shm_unlink(name.c_str());
  if (have_foreign) shm_unlink(foreign.c_str());

  std::atomic_ref<int>(page->live_may_exit).store(1, std::memory_order_release);
  ASSERT_EQ(waitpid(live, &status, 0), live);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "status " << status;
  EXPECT_FALSE(segment_exists(live_name));
  for (const std::string& name : {orphan, live_name}) {
    if (segment_exists(name)) shm_unlink(name.c_str());  // after a failure only
  }
}

// A process that forks after creating its workspace: the child's copy never unlinks the
// parent's segment (peers may still have to open it), the parent's own teardown does.
TEST(HostShm, AForkedChildNeverUnlinksItsParentsSegment) {
  const plan::Layout layout = plan::make_layout(1024, 2, 4);
  std::string name;
  {
    HostShmWorkspace ws(layout, 0, 0, 1.0);
    name = ws.segment_name();
    std::fflush(nullptr);
    const pid_t child = fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      ws.retire_token();
      ws.release();
      _exit(segment_exists(name) ? 0 : 1);
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "the child unlinked it";
    EXPECT_TRUE(segment_exists(name));
  }
  EXPECT_FALSE(segment_exists(name));
}

// The test hook sees every step of every slice in order, and costs nothing once removed.
TEST(HostShm, TheStepHookSeesEveryStepOfEverySlice) {
  GroupSpec spec;
  spec.world = 2;
  spec.layout = plan::make_layout(1024, 2, 4);
  spec.timeout_s = 5.0;
  spec.deadline_s = 30.0;
  const auto tactic = make_tactic(Algorithm::kTwoshot, Direction::kPull, true, 3);
  const plan::Schedule schedule =
      plan::build_schedule(Algorithm::kTwoshot, Direction::kPull, true, 2);
  const GroupResult g = run_group(spec, [&](HostShmWorkspace& ws, ChildEnv& env) {
    const plan::Program program = plan::encode_program(schedule, env.rank);
    const int id = ws.add_program(program);
    std::vector<std::pair<int, int>> seen;
    ws.set_step_hook_for_testing([&seen](const HostShmWorkspace::StepPoint& at) {
      if (!at.in_wait) seen.emplace_back(at.block, at.step);
    });
    std::vector<float> data(256, 1.0f);
    run_call(ws, id, DType::kFP32, 3, data.data(), data.data(), 256,
             plan::call_signature(DType::kFP32, tactic));
    std::vector<std::pair<int, int>> want;
    for (int block = 0; block < 3; ++block) {
      for (int step = 0; step < program.num_steps; ++step) want.emplace_back(block, step);
    }
    env.report->scenario_ok = seen == want ? 1 : 0;
    ws.set_step_hook_for_testing({});
    const size_t before = seen.size();
    run_call(ws, id, DType::kFP32, 1, data.data(), data.data(), 256,
             plan::call_signature(DType::kFP32, tactic));
    if (seen.size() != before) env.report->scenario_ok = 0;
    env.report->calls_done = 2;
  });
  expect_all_returned(g);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(g.reports[r].scenario_ok, 1) << describe_child(g, r);
}

}  // namespace
}  // namespace pcie_ar::transport
