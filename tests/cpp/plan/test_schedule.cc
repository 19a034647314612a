// Every builder's schedules, for every accepted (algorithm, world, islands, direction, staged),
// are proven by the verifier, replayed numerically, and encoded for the transports.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "plan/epilogue.h"
#include "plan/layout.h"
#include "plan/program_check.h"
#include "plan/schedule.h"
#include "plan/verify.h"
#include "replay.h"

namespace pcie_ar::plan {
namespace {

std::vector<int> halves(int world) {
  std::vector<int> island_of(world);
  for (int r = 0; r < world; ++r) island_of[r] = r < world / 2 ? 0 : 1;
  return island_of;
}

std::vector<int> interleaved(int world) {
  std::vector<int> island_of(world);
  for (int r = 0; r < world; ++r) island_of[r] = r % 2;
  return island_of;
}

std::string first_error(const Verification& v) {
  return v.errors.empty() ? "(no error)" : v.errors.front();
}

struct Case {
  Algorithm algorithm;
  Direction direction;
  bool staged;
  int world;
  std::vector<int> island_of;
  std::string islands_name;
  Protocol protocol = Protocol::kFlag;
};

Schedule build(const Case& c) {
  return build_schedule(c.algorithm, c.direction, c.staged, c.world, c.island_of, c.protocol);
}

// Keeps CTest's listing readable (the default prints the parameter's bytes).
void PrintTo(const Case& c, std::ostream* os) {
  *os << algorithm_name(c.algorithm) << "/" << direction_name(c.direction)
      << (c.staged ? "/staged/" : "/unstaged/") << protocol_name(c.protocol) << " w" << c.world
      << " " << c.islands_name;
}

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(algorithm_name(c.algorithm)) + "_" + std::string(direction_name(c.direction)) +
         (c.staged ? "_staged_" : "_unstaged_") + std::string(protocol_name(c.protocol)) + "_w" +
         std::to_string(c.world) + "_" + c.islands_name;
}

// Every combination the builders accept, over flat, split-in-half and interleaved islands.
std::vector<Case> accepted_cases() {
  std::vector<Case> cases;
  for (Algorithm a : kAllAlgorithms) {
    for (int world = 2; world <= kMaxWorld; ++world) {
      std::vector<std::pair<std::vector<int>, std::string>> maps = {{{}, "flat"}};
      if (world % 2 == 0) {
        maps.emplace_back(halves(world), "halves");
        if (world >= 4) maps.emplace_back(interleaved(world), "interleaved");
      }
      for (const auto& [island_of, name] : maps) {
        for (const Tactic& t : buildable_tactics(world, island_of)) {
          if (t.algorithm != a) continue;
          cases.push_back({a, t.direction, t.staged, world, island_of, name, t.protocol});
        }
      }
    }
  }
  return cases;
}

class EveryAcceptedSchedule : public testing::TestWithParam<Case> {};

// Each schedule as built (what GPUs run) and with its forwarding copies fused (what hosts run).
std::vector<Schedule> built_and_fused(const Case& c) {
  Schedule built = build(c);
  Schedule fused = fuse_forwarding_copies(built);
  return {std::move(built), std::move(fused)};
}

TEST_P(EveryAcceptedSchedule, VerifiesOutOfPlaceAndInPlace) {
  const Case& c = GetParam();
  for (const Schedule& s : built_and_fused(c)) {
    for (bool in_place : {false, true}) {
      const Verification v = verify(s, VerifyOptions{in_place});
      EXPECT_TRUE(v.ok) << first_error(v);
      if (c.staged) {
        EXPECT_LE(v.max_outbound_per_stage, 1);
        EXPECT_LE(v.max_inbound_per_stage, 1);
      }
      EXPECT_LE(v.max_steps, kMaxSteps);
    }
  }
}

TEST_P(EveryAcceptedSchedule, ReplayedStepListsProduceTheSum) {
  const Case& c = GetParam();
  for (const Schedule& s : built_and_fused(c)) {
    // 4 fp32 per vector; an odd vector count so chunks and slices are uneven.
    for (int blocks : {1, 3}) {
      for (bool in_place : {false, true}) {
        Replay replay(s, 4 * 37, blocks, in_place);
        replay.keep_inputs();
        ASSERT_TRUE(replay.run()) << "deadlock";
        for (int r = 0; r < c.world; ++r) {
          for (int64_t i = 0; i < 4 * 37; ++i) {
            // Small integers sum exactly in fp32, whatever the order.
            ASSERT_EQ(replay.output(r)[i], replay.expected(i))
                << "rank " << r << " element " << i << " blocks " << blocks << " in_place "
                << in_place;
          }
        }
      }
    }
  }
}

TEST_P(EveryAcceptedSchedule, EncodesEveryRank) {
  const Case& c = GetParam();
  for (const Schedule& s : built_and_fused(c)) {
    for (int r = 0; r < c.world; ++r) {
      const Program p = encode_program(s, r);
      EXPECT_EQ(p.rank, r);
      EXPECT_EQ(p.world, c.world);
      EXPECT_EQ(p.num_chunks, s.num_chunks);
      ASSERT_EQ(p.num_steps, s.programs[r].size());
      for (int i = 0; i < p.num_steps; ++i) {
        EXPECT_EQ(describe_step(p.steps[i]), describe_step(s.programs[r][i]));
      }
    }
  }
}

TEST_P(EveryAcceptedSchedule, FusingFoldsOnlyForwardingCopiesIntoSums) {
  const Case& c = GetParam();
  const Schedule built = build(c);
  const Schedule fused = fuse_forwarding_copies(built);
  for (int r = 0; r < c.world; ++r) {
    int dual = 0;
    for (const Step& step : fused.programs[r]) {
      if (step.kind != StepKind::kReduce || step.num_dsts == 1) continue;
      ++dual;
      EXPECT_EQ(step.num_dsts, 2);
      EXPECT_GE(step.num_srcs, 2) << "only sums take a second destination";
      EXPECT_NE(step.dst.space, Space::kLL);
      EXPECT_NE(step.dst2.space, Space::kLL);
    }
    // Each fused step replaced exactly one copy.
    EXPECT_EQ(built.programs[r].size() - fused.programs[r].size(), static_cast<size_t>(dual))
        << "rank " << r;
    // Flat two-shot with flags: the all-gather send (unstaged push) or the copy of the
    // published chunk (pull) joins the reduce-scatter's sum on every rank; staged push sends in
    // the next stage, and one-shot and LL have nothing to fuse.
    const bool expect_one = c.algorithm == Algorithm::kTwoshot && c.protocol == Protocol::kFlag &&
                            (c.direction == Direction::kPull || !c.staged);
    if (expect_one) {
      EXPECT_EQ(dual, 1) << "rank " << r;
    }
    if (c.algorithm == Algorithm::kOneshot || c.protocol == Protocol::kLL) {
      EXPECT_EQ(dual, 0);
    }
  }
}

// The fused schedule of every tactic: the same programs plus one epilogue each, proven
// whole-output-first, and no dearer between ranks: the same fences, peer polls and fabric hops.
TEST_P(EveryAcceptedSchedule, WithEpilogueVerifiesAndCostsNoFabric) {
  const Case& c = GetParam();
  for (const Schedule& s : built_and_fused(c)) {
    const Schedule fused = with_epilogue(s);
    ASSERT_TRUE(fused.epilogue);
    for (bool in_place : {false, true}) {
      const Verification plain = verify(s, VerifyOptions{in_place});
      const Verification v = verify(fused, VerifyOptions{in_place});
      ASSERT_TRUE(v.ok) << first_error(v);
      EXPECT_EQ(v.cost.system_fences, plain.cost.system_fences);
      EXPECT_EQ(v.cost.peer_polls, plain.cost.peer_polls);
      EXPECT_EQ(v.cost.fabric_hops, plain.cost.fabric_hops);
      EXPECT_EQ(v.sent_to, plain.sent_to);
    }
    for (int r = 0; r < c.world; ++r) {
      ASSERT_EQ(fused.programs[r].size(), s.programs[r].size() + 1);
      const Step& last = fused.programs[r].back();
      EXPECT_EQ(last.kind, StepKind::kEpilogue);
      EXPECT_EQ(last.peer, r);
      const Program p = encode_program(fused, r);
      EXPECT_NO_THROW(check_program(p, make_layout(4096, c.world, 4), r));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Schedule, EveryAcceptedSchedule, testing::ValuesIn(accepted_cases()),
                         case_name);

TEST(Schedule, AcceptedCasesCoverEveryAlgorithmAndWorld) {
  std::map<Algorithm, std::set<int>> worlds;
  for (const Case& c : accepted_cases()) worlds[c.algorithm].insert(c.world);
  EXPECT_EQ(worlds[Algorithm::kOneshot], (std::set<int>{2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(worlds[Algorithm::kTwoshot], (std::set<int>{2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(worlds[Algorithm::kIslandOneshot], (std::set<int>{4, 6, 8}));
  EXPECT_EQ(worlds[Algorithm::kIslandTwoshot], (std::set<int>{4, 6, 8}));
}

TEST(Schedule, IslandTwoshotMovesOneMessageEachWayAcrossTwoIslandsOfFour) {
  for (Direction d : {Direction::kPush, Direction::kPull}) {
    for (bool staged : {false, true}) {
      const Verification v =
          verify(build_schedule(Algorithm::kIslandTwoshot, d, staged, 8, halves(8)));
      ASSERT_TRUE(v.ok);
      EXPECT_DOUBLE_EQ(v.cross_island[0], 1.0);
      EXPECT_DOUBLE_EQ(v.cross_island[1], 1.0);
    }
  }
}

TEST(Schedule, FlatOneshotMovesSixteenMessagesEachWayAcrossTwoIslandsOfFour) {
  for (Direction d : {Direction::kPush, Direction::kPull}) {
    const Verification v = verify(build_schedule(Algorithm::kOneshot, d, true, 8, halves(8)));
    ASSERT_TRUE(v.ok);
    EXPECT_DOUBLE_EQ(v.cross_island[0], 16.0);
    EXPECT_DOUBLE_EQ(v.cross_island[1], 16.0);
    EXPECT_DOUBLE_EQ(v.cross_island_elements(), 16.0);
  }
}

TEST(Schedule, IslandOneshotMovesOneMessagePerPartnerPair) {
  const Verification v =
      verify(build_schedule(Algorithm::kIslandOneshot, Direction::kPush, true, 8, halves(8)));
  ASSERT_TRUE(v.ok);
  EXPECT_DOUBLE_EQ(v.cross_island_elements(), 4.0);
}

TEST(Schedule, UnstagedOneshotTalksToEveryPeerAtOnce) {
  const Verification v = verify(build_schedule(Algorithm::kOneshot, Direction::kPush, false, 8));
  ASSERT_TRUE(v.ok);
  EXPECT_EQ(v.max_outbound_per_stage, 7);
  EXPECT_EQ(v.max_inbound_per_stage, 7);
}

TEST(Schedule, FlatTopologyCrossesNothing) {
  const Verification v = verify(build_schedule(Algorithm::kTwoshot, Direction::kPush, true, 8));
  ASSERT_TRUE(v.ok);
  EXPECT_DOUBLE_EQ(v.cross_island_elements(), 0.0);
}

TEST(Schedule, SentToCountsEveryPeerTransfer) {
  // Oneshot push: each rank sends the whole message to each peer exactly once.
  const Verification v = verify(build_schedule(Algorithm::kOneshot, Direction::kPush, true, 4));
  for (int a = 0; a < 4; ++a) {
    for (int b = 0; b < 4; ++b) EXPECT_DOUBLE_EQ(v.sent_to[a][b], a == b ? 0.0 : 1.0);
  }
  // Twoshot: a quarter to each peer in each of the two phases.
  const Verification t = verify(build_schedule(Algorithm::kTwoshot, Direction::kPush, true, 4));
  EXPECT_DOUBLE_EQ(t.sent_to[0][1], 0.5);
}

TEST(Schedule, RefusesWhatItCannotBuildWithAReason) {
  EXPECT_THROW(build_schedule(Algorithm::kOneshot, Direction::kPush, true, 1), UnsupportedSchedule);
  EXPECT_THROW(build_schedule(Algorithm::kOneshot, Direction::kPush, true, 9), UnsupportedSchedule);
  try {
    build_schedule(Algorithm::kIslandTwoshot, Direction::kPush, true, 8, {0, 0, 0, 1, 1, 1, 1, 1});
    FAIL() << "uneven islands accepted";
  } catch (const UnsupportedSchedule& e) {
    EXPECT_NE(std::string(e.what()).find("uneven"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(why_unsupported(Algorithm::kIslandOneshot, 8, {}).has_value());
  EXPECT_TRUE(why_unsupported(Algorithm::kIslandOneshot, 8, {0, 0, 1, 1, 2, 2, 3, 3}).has_value());
  EXPECT_TRUE(why_unsupported(Algorithm::kIslandOneshot, 2, {0, 1}).has_value());
  EXPECT_FALSE(why_unsupported(Algorithm::kIslandOneshot, 6, {0, 0, 0, 1, 1, 1}).has_value());
}

// ---------------------------------------------------------------- broken schedules
Schedule good() { return build_schedule(Algorithm::kTwoshot, Direction::kPush, true, 4); }

Step* find_step(Schedule& s, int rank, StepKind kind, int nth = 0) {
  for (Step& step : s.programs[rank]) {
    if (step.kind == kind && nth-- == 0) return &step;
  }
  return nullptr;
}

bool mentions(const Verification& v, const std::string& text) {
  for (const auto& e : v.errors) {
    if (e.find(text) != std::string::npos) return true;
  }
  return false;
}

TEST(Schedule, FusingNeverMovesACopyAcrossAWait) {
  // Twoshot push: rank r's sum writes output chunk r and the next step forwards it. Put a wait
  // between the two: the copy may depend on it, so nothing fuses.
  Schedule s = build_schedule(Algorithm::kTwoshot, Direction::kPush, false, 2);
  for (auto& program : s.programs) {
    for (size_t i = 0; i + 1 < program.size(); ++i) {
      if (program[i].kind == StepKind::kReduce && program[i].num_srcs == 2) {
        Step wait;
        wait.kind = StepKind::kWait;
        program.insert(program.begin() + static_cast<std::ptrdiff_t>(i) + 1, wait);
        break;
      }
    }
  }
  const Schedule fused = fuse_forwarding_copies(s);
  for (const auto& program : fused.programs) {
    for (const Step& step : program) EXPECT_EQ(step.num_dsts, 1) << describe_step(step);
  }
  // Without the wait both ranks fuse (the control).
  const Schedule plain =
      fuse_forwarding_copies(build_schedule(Algorithm::kTwoshot, Direction::kPush, false, 2));
  for (const auto& program : plain.programs) {
    EXPECT_EQ(std::count_if(program.begin(), program.end(),
                            [](const Step& step) { return step.num_dsts == 2; }),
              1);
  }
}

TEST(Verifier, RejectsAnLLSecondDestinationAndABadDestinationCount) {
  Schedule s =
      fuse_forwarding_copies(build_schedule(Algorithm::kTwoshot, Direction::kPush, false, 2));
  Step* dual = nullptr;
  for (Step& step : s.programs[0]) {
    if (step.num_dsts == 2) dual = &step;
  }
  ASSERT_NE(dual, nullptr);
  Schedule ll = s;
  for (Step& step : ll.programs[0]) {
    if (step.num_dsts == 2) step.dst2.space = Space::kLL;
  }
  Verification v = verify(ll);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(mentions(v, "LL slot cannot be one of two destinations")) << first_error(v);
  dual->num_dsts = 3;
  v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(mentions(v, "writes 1 or 2 destinations, not 3")) << first_error(v);
}

TEST(Verifier, AcceptsTheUnbrokenSchedule) { EXPECT_TRUE(verify(good()).ok); }

TEST(Verifier, RejectsAnElementSummedTwice) {
  Schedule s = good();
  // Rank 0's final reduce of its own chunk: add its input a second time.
  Step* reduce = nullptr;
  for (Step& step : s.programs[0]) {
    if (step.kind == StepKind::kReduce && step.num_srcs == 4) reduce = &step;
  }
  ASSERT_NE(reduce, nullptr);
  reduce->srcs[reduce->num_srcs++] = reduce->srcs[0];
  const Verification v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(mentions(v, "summed 2 times")) << first_error(v);
}

TEST(Verifier, RejectsAMissingContribution) {
  Schedule s = good();
  Step* reduce = nullptr;
  for (Step& step : s.programs[2]) {
    if (step.kind == StepKind::kReduce && step.num_srcs == 4) reduce = &step;
  }
  ASSERT_NE(reduce, nullptr);
  reduce->num_srcs = 3;  // drops rank 3's operand
  const Verification v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(mentions(v, "summed 0 times")) << first_error(v);
}

TEST(Verifier, RejectsTwoWritersIntoOneRankInOneStage) {
  Schedule s = good();
  // Rank 1's first staged send goes to rank 3 instead of rank 2: rank 3 now receives from two
  // ranks in stage 0 (and rank 2 waits for data that never comes).
  Step* send = find_step(s, 1, StepKind::kReduce);
  ASSERT_NE(send, nullptr);
  ASSERT_EQ(send->dst.owner, 2);
  send->dst.owner = 3;
  const Verification v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(mentions(v, "one inbound stream")) << first_error(v);
}

TEST(Verifier, RejectsAReadThatDoesNotWaitForItsFlag) {
  // Unstaged: no later wait covers the removed one transitively (in a staged schedule a later
  // stage's flag can, and the verifier rightly accepts that).
  Schedule s = build_schedule(Algorithm::kOneshot, Direction::kPush, false, 3);
  auto& program = s.programs[0];
  for (auto it = program.begin(); it != program.end(); ++it) {
    if (it->kind == StepKind::kWait) {
      program.erase(it);
      break;
    }
  }
  const Verification v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(mentions(v, "race")) << first_error(v);
}

TEST(Verifier, RejectsADeadlock) {
  Schedule s = good();
  Step* wait = find_step(s, 0, StepKind::kWait);
  ASSERT_NE(wait, nullptr);
  wait->flag = static_cast<uint8_t>(num_flags_for(4) - 1);  // nobody raises it
  const Verification v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(mentions(v, "deadlock")) << first_error(v);
}

TEST(Verifier, RejectsAFlagWithTwoWriters) {
  Schedule s = good();
  Step* sig0 = find_step(s, 0, StepKind::kSignal);
  Step* sig1 = find_step(s, 1, StepKind::kSignal);
  ASSERT_TRUE(sig0 && sig1);
  sig1->flag_owner = sig0->flag_owner;
  sig1->flag = sig0->flag;
  EXPECT_FALSE(verify(s).ok);
}

TEST(Verifier, RejectsRanksThatSumInDifferentOrders) {
  Schedule s = build_schedule(Algorithm::kOneshot, Direction::kPush, false, 3);
  Step& last = s.programs[1].back();
  ASSERT_EQ(last.num_srcs, 3);
  std::swap(last.srcs[0], last.srcs[2]);
  const Verification v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(mentions(v, "rank order") || mentions(v, "bitwise")) << first_error(v);
}

TEST(Verifier, RejectsInPlaceUseOfAScheduleThatRereadsItsInput) {
  // Overwrite the output before a later read of the input: fine out of place, wrong in place.
  Schedule s = build_schedule(Algorithm::kOneshot, Direction::kPush, false, 2);
  auto& p = s.programs[0];
  Step copy_out;
  copy_out.kind = StepKind::kReduce;
  copy_out.num_srcs = 1;
  copy_out.srcs[0] = BufRef{Space::kSlot, 0, 1, 0};
  copy_out.dst = BufRef{Space::kOutput, 0, 0, 0};
  // After the wait (slot 1 holds rank 1's data), before the final sum reads the input.
  p.insert(p.end() - 1, copy_out);
  EXPECT_TRUE(verify(s, VerifyOptions{false}).ok);
  EXPECT_FALSE(verify(s, VerifyOptions{true}).ok);
}

TEST(Verifier, RejectsAPushScheduleThatReadsPeerMemory) {
  Schedule s = build_schedule(Algorithm::kOneshot, Direction::kPush, false, 2);
  Step& last = s.programs[0].back();
  last.srcs[1] = BufRef{Space::kSlot, 1, 0, 0};
  const Verification v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(mentions(v, "reads peer memory")) << first_error(v);
}

// ---------------------------------------------------------------- LL and cost
Schedule ll(Algorithm a, int world, const std::vector<int>& island_of = {}) {
  return build_schedule(a, Direction::kPush, false, world, island_of, Protocol::kLL);
}

Step* find_ll_read(Schedule& s, int rank) {
  for (Step& step : s.programs[rank]) {
    for (int i = 0; i < step.num_srcs; ++i) {
      if (step.kind == StepKind::kReduce && step.srcs[i].space == Space::kLL) return &step;
    }
  }
  return nullptr;
}

TEST(Cost, LLPaysNoFenceNoFlagAndPollsOnlyItsOwnMemory) {
  for (const Case& c : accepted_cases()) {
    const Cost cost = verify(build(c)).cost;
    SCOPED_TRACE(case_name(testing::TestParamInfo<Case>(c, 0)));
    EXPECT_EQ(cost.peer_polls, 0);  // every flag lives with the rank that waits on it
    if (flag_in_data(c.protocol)) {
      EXPECT_EQ(cost.system_fences, 0);
      EXPECT_EQ(cost.local_waits, 0);
      EXPECT_GT(cost.data_polls, 0);
    } else {
      EXPECT_GT(cost.system_fences, 0);
      EXPECT_EQ(cost.data_polls, 0);
    }
  }
}

TEST(Cost, CountsRunsOfSignalsAndWaitsAsOneAndHopsAlongTheCriticalPath) {
  const Cost staged = verify(build_schedule(Algorithm::kOneshot, Direction::kPush, true, 8)).cost;
  EXPECT_EQ(staged.system_fences, 7);  // one peer per stage: seven serial releases
  EXPECT_EQ(staged.local_waits, 7);
  EXPECT_EQ(staged.fabric_hops, 7);  // each stage sends after the previous one arrived
  const Cost unstaged =
      verify(build_schedule(Algorithm::kOneshot, Direction::kPush, false, 8)).cost;
  EXPECT_EQ(unstaged.system_fences, 1);  // seven flags go out together after one barrier
  EXPECT_EQ(unstaged.local_waits, 1);
  EXPECT_EQ(unstaged.fabric_hops, 1);
  const Cost pull = verify(build_schedule(Algorithm::kOneshot, Direction::kPull, false, 4)).cost;
  EXPECT_EQ(pull.peer_polls, 0);
  EXPECT_EQ(pull.fabric_hops, 3);  // "ready" posted to the reader, then a read round trip
  EXPECT_EQ(verify(ll(Algorithm::kOneshot, 8)).cost.fabric_hops, 1);
  EXPECT_EQ(verify(ll(Algorithm::kOneshot, 8)).cost.data_polls, 7);
  const Cost island = verify(ll(Algorithm::kIslandOneshot, 8, halves(8))).cost;
  EXPECT_EQ(island.fabric_hops, 2);
  EXPECT_DOUBLE_EQ(island.cross_island, 4.0);
  EXPECT_EQ(verify(ll(Algorithm::kIslandTwoshot, 8, halves(8))).cost.fabric_hops, 3);
}

TEST(Verifier, RejectsLLPullAndStagedLLWithAReason) {
  const Tactic pull{Algorithm::kOneshot, Direction::kPull, false, Protocol::kLL};
  EXPECT_NE(why_unsupported(pull, 4, {}).value_or("").find("push-only"), std::string::npos);
  const Tactic staged{Algorithm::kOneshot, Direction::kPush, true, Protocol::kLL};
  EXPECT_NE(why_unsupported(staged, 4, {}).value_or("").find("unstaged"), std::string::npos);
  EXPECT_THROW(build_schedule(Algorithm::kOneshot, Direction::kPull, false, 4, {}, Protocol::kLL),
               UnsupportedSchedule);
}

TEST(Verifier, RejectsAnLLSlotReadTwice) {
  Schedule s = ll(Algorithm::kOneshot, 3);
  Step* read = find_ll_read(s, 0);
  ASSERT_NE(read, nullptr);
  s.programs[0].push_back(*read);  // the first read reset the tags: this one waits forever
  const Verification v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(mentions(v, "deadlock")) << first_error(v);
}

TEST(Verifier, RejectsLLDataNobodyReads) {
  Schedule s = ll(Algorithm::kOneshot, 3);
  Step extra = s.programs[1].front();  // rank 1's first delivery, to another slot of rank 0
  ASSERT_EQ(extra.dst.space, Space::kLL);
  extra.dst.slot = static_cast<uint8_t>(slot_gather(3));
  s.programs[1].insert(s.programs[1].begin(), extra);
  const Verification v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(mentions(v, "never read")) << first_error(v);
}

TEST(Verifier, RejectsAnLLReadOfPeerMemoryAndAWrongWriter) {
  Schedule s = ll(Algorithm::kOneshot, 2);
  Step* read = find_ll_read(s, 0);
  ASSERT_NE(read, nullptr);
  for (int i = 0; i < read->num_srcs; ++i) {
    if (read->srcs[i].space == Space::kLL) read->srcs[i].writer = 0;
  }
  Verification v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(mentions(v, "expects rank 0's LL data but rank 1 writes it")) << first_error(v);

  s = ll(Algorithm::kOneshot, 2);
  Step& send = s.programs[1].front();
  ASSERT_EQ(send.dst.space, Space::kLL);
  send.dst.owner = 1;  // rank 1 delivers into its own slot ...
  read = find_ll_read(s, 0);
  for (int i = 0; i < read->num_srcs; ++i) {
    if (read->srcs[i].space == Space::kLL) read->srcs[i].owner = 1;  // ... rank 0 polls it there
  }
  v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(mentions(v, "LL readers poll only their own memory")) << first_error(v);
}

TEST(Verifier, AnLLReadProvesProgressButNotVisibilityOfOtherWrites) {
  // Rank 1 copies its input into its own (plain) slot, then delivers LL data to rank 0; rank 0
  // reads the plain slot after the LL read. The LL data carries no fence: a race.
  Schedule s = ll(Algorithm::kOneshot, 2);
  Step publish;
  publish.kind = StepKind::kReduce;
  publish.num_srcs = 1;
  publish.srcs[0] = BufRef{Space::kInput, 1, 0, 0};
  publish.dst = BufRef{Space::kSlot, 0, 0, 0};
  s.programs[1].insert(s.programs[1].begin(), publish);
  Step peek;
  peek.kind = StepKind::kReduce;
  peek.num_srcs = 1;
  peek.srcs[0] = BufRef{Space::kSlot, 0, 0, 0};
  peek.dst = BufRef{Space::kSlot, 0, 1, 0};
  s.programs[0].push_back(peek);
  const Verification v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(mentions(v, "race")) << first_error(v);
}

// ---------------------------------------------------------------- layout
TEST(Layout, IsAlignedAndHoldsEverySlot) {
  const Layout l = make_layout(393216, 8, 2);
  EXPECT_EQ(l.num_slots, num_slots_for(8));
  EXPECT_EQ(l.flags_offset % kAlignBytes, 0u);
  EXPECT_EQ(l.data_offset % kAlignBytes, 0u);
  EXPECT_EQ(l.slot_bytes % kAlignBytes, 0u);
  EXPECT_GE(l.slot_bytes, 393216u * 2);
  EXPECT_EQ(l.slot_offset(1, l.num_slots - 1) + l.slot_bytes, l.total_bytes);
  EXPECT_LE(l.flag_offset(1, l.max_blocks - 1, l.num_flags - 1) + sizeof(FlagWord),
            l.control_bytes);
  EXPECT_LE(l.control_bytes, l.data_offset);
  // Every slot every algorithm uses fits: the builders only name slots below num_slots.
  EXPECT_EQ(slot_gather(8), l.num_slots - 1);
}

TEST(Layout, IsAPureFunctionOfItsInputs) {
  EXPECT_EQ(make_layout(4096, 4, 2), make_layout(4096, 4, 2));
  EXPECT_EQ(layout_hash(make_layout(4096, 4, 2)), layout_hash(make_layout(4096, 4, 2)));
  EXPECT_NE(layout_hash(make_layout(4096, 4, 2)), layout_hash(make_layout(4096, 4, 4)));
  EXPECT_NE(layout_hash(make_layout(4096, 4, 2)), layout_hash(make_layout(4104, 4, 2)));
}

TEST(Layout, RejectsBadArgumentsWithAReason) {
  auto message = [](auto fn) {
    try {
      fn();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([] { make_layout(4096, 1, 2); }).find("world size"), std::string::npos);
  EXPECT_NE(message([] { make_layout(4097, 2, 2); }).find("multiple of 16 bytes"),
            std::string::npos);
  EXPECT_NE(message([] { make_layout(4096, 2, 3); }).find("element size"), std::string::npos);
  EXPECT_NE(message([] { make_layout(4096, 2, 2, 0); }).find("max_blocks"), std::string::npos);
}

TEST(Layout, InitialisedControlExpectsTheNextGeneration) {
  const Layout l = make_layout(1024, 2, 4, 4);
  std::vector<unsigned char> control(l.control_bytes);
  initialize_control(control.data(), l, 0xFFFFFFFEu);
  const auto* flag = reinterpret_cast<const FlagWord*>(control.data() + l.flag_offset(1, 3, 5));
  EXPECT_EQ(flag->gen, 0xFFFFFFFEu);
  EXPECT_FALSE(gen_reached(flag->gen, 0xFFFFFFFFu));
  EXPECT_TRUE(gen_reached(0x100000000ull, 0xFFFFFFFFu));  // 64-bit: past 2^32 without a wrap
  EXPECT_FALSE(gen_reached(0xFFFFFFFFu, 0x100000000ull));
  uint64_t counter = 0;
  std::memcpy(&counter, control.data() + l.gen_counter_offset(3), sizeof(counter));
  EXPECT_EQ(counter, 0xFFFFFFFEu);
}

TEST(Layout, LLSlotsStartStaleForEveryGenerationOfTheirParity) {
  const Layout l = make_layout(4096, 3, 2, 2);
  EXPECT_EQ(l.ll_capacity_bytes, 4096 * 2);
  EXPECT_GE(l.ll_slot_bytes, static_cast<uint64_t>(l.ll_capacity_bytes) * kLLExpansion);
  EXPECT_EQ(l.ll_offset % kAlignBytes, 0u);
  EXPECT_LE(l.ll_slot_offset(1, l.num_slots - 1) + l.ll_slot_bytes, l.control_bytes);
  std::vector<unsigned char> control(l.control_bytes);
  initialize_control(control.data(), l, 41);
  for (int parity = 0; parity < 2; ++parity) {
    for (int slot : {0, l.num_slots - 1}) {
      for (uint64_t at : {uint64_t{0}, l.ll_slot_bytes - 8}) {
        uint64_t word = 0;
        std::memcpy(&word, control.data() + l.ll_slot_offset(parity, slot) + at, sizeof(word));
        // Whatever call and generation of this parity reads it, it has not arrived.
        for (uint64_t gen : {uint64_t{42}, uint64_t{43}, uint64_t{0x100000000}, uint64_t{7}}) {
          if (gen_parity(gen) != parity) continue;
          for (uint32_t numel : {0u, 64u, 4096u}) {
            const uint32_t tag = ll_tag(gen, numel, 0xA5000001u);
            EXPECT_NE(ll_word_tag(word), tag);
            EXPECT_FALSE(ll_foreign(ll_word_tag(word), tag));
          }
        }
      }
    }
  }
}

// Lamport headers: one per (parity, slot, chunk, block), each its own 32 bytes between the
// flags and the LL slots, and all of them empty after initialisation.
TEST(Layout, LamportHeadersAreDistinctAndStartEmpty) {
  const Layout l = make_layout(4096, 3, 2, 2);
  std::vector<unsigned char> control(l.control_bytes);
  initialize_control(control.data(), l, 41);
  std::set<uint64_t> seen;
  for (int parity = 0; parity < 2; ++parity) {
    for (int slot = 0; slot < l.num_slots; ++slot) {
      for (int chunk = 0; chunk < kMaxWorld; ++chunk) {
        for (int block = 0; block < l.max_blocks; ++block) {
          const uint64_t at = l.ll_header_offset(parity, slot, chunk, block);
          EXPECT_GE(at, l.flag_offset(1, l.max_blocks - 1, l.num_flags - 1) + sizeof(FlagWord));
          EXPECT_LE(at + kLLHeaderBytes, l.ll_offset);
          EXPECT_TRUE(seen.insert(at).second);
          for (int w = 0; w < kLLHeaderBytes / 4; ++w) {
            uint32_t word = 0;
            std::memcpy(&word, control.data() + at + 4 * w, sizeof(word));
            EXPECT_EQ(word, kLLEmpty);
          }
        }
      }
    }
  }
  for (uint64_t a : seen) EXPECT_EQ(seen.count(a + 16), 0u);  // 32 bytes apart at least
}

TEST(Protocol, LLTagsNameTheCallAndTheEmptyWordNeverMatches) {
  const uint32_t a = ll_tag(10, 1024, 0xA5000001u);
  EXPECT_EQ(a & 1u, 0u);  // bit 0 is the generation's parity
  EXPECT_EQ(ll_tag(11, 1024, 0xA5000001u) & 1u, 1u);
  EXPECT_NE(a, ll_tag(10, 2048, 0xA5000001u));
  EXPECT_NE(a, ll_tag(10, 1024, 0xA5000002u));
  EXPECT_TRUE(ll_foreign(ll_tag(10, 2048, 0xA5000001u), a));  // same generation, other call
  EXPECT_TRUE(ll_foreign(ll_tag(12, 1024, 0xA5000001u), a));  // same parity, other generation
  // A consumed word is kLLEmpty: no generation ever accepts it, even after 2^32 generations,
  // for any call, and it is never taken for another call's data.
  for (uint64_t gen = 10; gen < 10 + (uint64_t{1} << 33); gen += (uint64_t{1} << 31) + 1) {
    for (uint32_t numel : {1024u, 8u}) {
      const uint32_t tag = ll_tag(gen, numel, 0xA5000001u);
      EXPECT_NE(kLLEmpty, tag);
      EXPECT_FALSE(ll_foreign(kLLEmpty, tag));
    }
  }
  // The one generation whose tag would be kLLEmpty gets another of the same parity.
  const uint32_t h = ll_tag(0, 1024, 0xA5000001u);  // the call's hash, generation 0
  const uint64_t unlucky = (uint64_t{1} << 32) | (h ^ kLLEmpty);
  EXPECT_NE(ll_tag(unlucky, 1024, 0xA5000001u), kLLEmpty);
  EXPECT_EQ(ll_tag(unlucky, 1024, 0xA5000001u) & 1u, 0u);
  const uint64_t word = ll_word(0xDEADBEEFu, a);
  EXPECT_EQ(ll_word_payload(word), 0xDEADBEEFu);
  EXPECT_EQ(ll_word_tag(word), a);
}

// A Lamport writer never stores the empty word: negative zeros become positive zeros, in every
// 16-bit half (bf16, fp16) or the whole word (fp32), and nothing else changes.
TEST(Protocol, LamportWordsAreNeverEmpty) {
  EXPECT_EQ(ll_dense_word(kLLEmpty, 4), 0u);
  EXPECT_EQ(ll_dense_word(kLLEmpty, 2), 0u);              // {+0, -0} -> {+0, +0}
  EXPECT_EQ(ll_dense_word(0x80008000u, 2), 0u);           // {-0, -0}
  EXPECT_EQ(ll_dense_word(0x3F808000u, 2), 0x3F800000u);  // {-0, 1.0}: the -0 half only
  EXPECT_EQ(ll_dense_word(0x80003F80u, 2), 0x00003F80u);
  EXPECT_EQ(ll_dense_word(0x80008000u, 4), 0x80008000u);  // an fp32 denormal stays
  for (uint32_t w : {0u, 1u, 0x3F800000u, 0xFF800000u, 0x7FC00000u, 0x80000001u, 0xFFFFFFFFu}) {
    EXPECT_EQ(ll_dense_word(w, 4), w);
    EXPECT_NE(ll_dense_word(w, 4), kLLEmpty);
    EXPECT_NE(ll_dense_word(w, 2), kLLEmpty);
  }
  EXPECT_TRUE(ll_dense_arrived(0u, 1u, 2u, 3u));
  EXPECT_FALSE(ll_dense_arrived(0u, 1u, kLLEmpty, 3u));
}

TEST(Layout, SlicesCoverEveryVectorExactlyOnce) {
  for (int64_t vecs : {1, 7, 64, 1000}) {
    for (int chunks : {1, 3, 8}) {
      for (int blocks : {1, 5, 64}) {
        std::vector<int> hits(vecs, 0);
        for (int c = 0; c < chunks; ++c) {
          for (int b = 0; b < blocks; ++b) {
            const VecRange r = slice_range(vecs, chunks, c, blocks, b);
            for (int64_t v = r.begin; v < r.end; ++v) ++hits[v];
          }
        }
        for (int64_t v = 0; v < vecs; ++v) ASSERT_EQ(hits[v], 1) << vecs << " " << chunks;
      }
    }
  }
}

// The fused call's form is part of what its peers must agree on: another eps, row length,
// weight offset, quantised output or residual presence changes the signature (and so every flag,
// LL tag and lamport header of the call) but keeps its kind and dtype, and the same form gives the
// same signature on every rank, whatever its tensors' addresses.
TEST(Tactic, TheFusedCallsSignatureCarriesItsForm) {
  const uint32_t fused = call_signature(DType::kBF16, Tactic{}, /*fused=*/true);
  alignas(16) static uint8_t tensors[4][64];
  const float scale = 0.5f;
  EpilogueArgs args;
  args.residual = tensors[0];
  args.residual_out = tensors[1];
  args.weight = tensors[2];
  args.y = tensors[3];
  args.hidden = 4096;
  args.eps = 1e-6f;
  const uint32_t base = epilogue_signature(fused, args);
  EXPECT_EQ(epilogue_signature(fused, args), base);
  // Other tensors (another rank's), the same form: the same signature.
  EpilogueArgs elsewhere = args;
  elsewhere.residual = tensors[1];
  elsewhere.residual_out = tensors[1];
  elsewhere.weight = tensors[0];
  elsewhere.y = nullptr;
  EXPECT_EQ(epilogue_signature(fused, elsewhere), base);
  std::set<uint32_t> seen{base};
  auto differs = [&](const EpilogueArgs& other, const std::string& what) {
    EXPECT_TRUE(seen.insert(epilogue_signature(fused, other)).second) << what;
  };
  for (const float eps : {1e-5f, 1e-6f * (1.0f + 1e-7f), 0.0f, -0.0f}) {
    EpilogueArgs other = args;
    other.eps = eps;
    differs(other, "eps " + std::to_string(eps));
  }
  for (const int64_t hidden : {2048, 4104, 8192, 65536}) {
    EpilogueArgs other = args;
    other.hidden = hidden;
    differs(other, "hidden " + std::to_string(hidden));
  }
  for (const float offset : {1.0f, -1.0f, 0.5f, 1.0f + 1.1920929e-7f}) {
    EpilogueArgs other = args;
    other.weight_offset = offset;
    differs(other, "weight_offset " + std::to_string(offset));
  }
  EpilogueArgs quantised = args;
  quantised.quant = Quant::kFp8E4m3;
  quantised.y_q = tensors[3];
  quantised.scale = &scale;
  differs(quantised, "fp8");
  EpilogueArgs no_residual = args;
  no_residual.residual = nullptr;
  differs(no_residual, "no residual");
  EpilogueArgs no_residual_quantised = quantised;
  no_residual_quantised.residual = nullptr;
  differs(no_residual_quantised, "no residual, fp8");
  EpilogueArgs gemma_quantised = quantised;
  gemma_quantised.weight_offset = 1.0f;
  differs(gemma_quantised, "weight_offset 1, fp8");
  for (const uint32_t s : seen) EXPECT_EQ(s & 0xFFF00000u, fused & 0xFFF00000u);
}

TEST(Tactic, NamesRoundTripAndSignaturesDiffer) {
  for (Algorithm a : kAllAlgorithms) EXPECT_EQ(parse_algorithm(algorithm_name(a)), a);
  for (DType d : kAllDTypes) EXPECT_EQ(parse_dtype(dtype_name(d)), d);
  EXPECT_FALSE(parse_algorithm("threeshot").has_value());
  Tactic t;
  Tactic u = t;
  u.blocks = 2;
  EXPECT_NE(call_signature(DType::kBF16, t), call_signature(DType::kBF16, u));
  EXPECT_NE(call_signature(DType::kBF16, t), call_signature(DType::kFP16, t));
  // The fused call (all_reduce_add_rms_norm) is another call than the plain one of its tensor.
  EXPECT_NE(call_signature(DType::kBF16, t, /*fused=*/true), call_signature(DType::kBF16, t));
  u = t;
  u.threads = 512;  // threads do not change what peers see
  EXPECT_EQ(call_signature(DType::kBF16, t), call_signature(DType::kBF16, u));
  EXPECT_EQ(tactic_label(t), "oneshot/push/staged/flag/b1/t256");
  u = t;
  u.protocol = Protocol::kLL;
  EXPECT_NE(call_signature(DType::kBF16, t), call_signature(DType::kBF16, u));
  EXPECT_EQ(tactic_label(u), "oneshot/push/staged/ll/b1/t256");
  EXPECT_EQ(parse_protocol("ll"), Protocol::kLL);
  EXPECT_EQ(parse_protocol("flag"), Protocol::kFlag);
  EXPECT_FALSE(parse_protocol("LL").has_value());
}

TEST(Protocol, DescribesATimeoutNamingThePeer) {
  Diagnostic d{};
  d.kind = static_cast<uint32_t>(FailureKind::kTimeout);
  d.rank = 0;
  d.peer = 2;
  d.gen_seen = 6;
  d.gen_expected = 7;
  const std::string text = describe_failure(d, 30);
  EXPECT_NE(text.find("rank 0 timed out after 30 s"), std::string::npos) << text;
  EXPECT_NE(text.find("waiting for rank 2"), std::string::npos) << text;
  EXPECT_NE(text.find("seen 6, expected 7"), std::string::npos) << text;
}

TEST(Protocol, DescribesAnLLTimeoutAndMismatchNamingTheWriter) {
  Step step;
  step.stage = 1;
  const CallPosition at{3, 2, 9, 1024, 0xA5000001u};
  const BufRef src{Space::kLL, 3, 5, 6};
  Diagnostic d = make_ll_diagnostic(FailureKind::kLLTimeout, at, 4, step, src, 0x10u, 0x21u);
  EXPECT_EQ(d.peer, 6u);
  EXPECT_EQ(d.flag, 5u);
  std::string text = describe_failure(d, 2);
  EXPECT_NE(text.find("rank 3 timed out after 2 s at step 4"), std::string::npos) << text;
  EXPECT_NE(text.find("waiting for rank 6's data in LL slot 5 of generation 9"), std::string::npos)
      << text;
  d = make_ll_diagnostic(FailureKind::kLLMismatch, at, 4, step, src, 0x10u, 0x22u);
  text = describe_failure(d);
  EXPECT_NE(text.find("rank 3 and rank 6 disagree on the call of generation 9"), std::string::npos)
      << text;
  EXPECT_NE(text.find("tagged 0x00000010"), std::string::npos) << text;
}

}  // namespace
}  // namespace pcie_ar::plan

namespace pcie_ar::plan {
namespace {

Schedule fused_twoshot(int world) {
  return with_epilogue(build_schedule(Algorithm::kTwoshot, Direction::kPush, false, world));
}

bool says(const Verification& v, const std::string& what) {
  for (const auto& e : v.errors) {
    if (e.find(what) != std::string::npos) return true;
  }
  return false;
}

TEST(Epilogue, MustComeAfterEveryChunkOfTheOutput) {
  // Two-shot: rank 0's output is whole only after the all-gather. Move its epilogue in front of
  // the last wait and the copy after it: the verifier sees chunks that are not the sum yet.
  Schedule s = fused_twoshot(4);
  auto& program = s.programs[0];
  const Step epilogue = program.back();
  program.pop_back();
  size_t last_wait = 0;
  for (size_t i = 0; i < program.size(); ++i) {
    if (program[i].kind == StepKind::kWait) last_wait = i;
  }
  program.erase(program.begin() + static_cast<std::ptrdiff_t>(last_wait), program.end());
  program.push_back(epilogue);
  const Verification v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, "when the epilogue reads it")) << first_error(v);
}

TEST(Epilogue, IsTheLastStepExactlyOnceAndOnlyInAFusedSchedule) {
  Schedule twice = fused_twoshot(2);
  twice.programs[1].insert(twice.programs[1].begin(), twice.programs[1].back());
  Verification v = verify(twice);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, "must be the rank's last step")) << first_error(v);

  Schedule unmarked = fused_twoshot(2);
  unmarked.epilogue = false;
  v = verify(unmarked);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, "an epilogue in a schedule without one")) << first_error(v);

  Schedule missing = fused_twoshot(3);
  missing.programs[2].pop_back();
  v = verify(missing);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, "rank 2 runs the epilogue 0 times")) << first_error(v);

  EXPECT_THROW(with_epilogue(fused_twoshot(2)), std::invalid_argument);
}

TEST(Epilogue, MeetsInTheRanksOwnMemory) {
  Schedule s = fused_twoshot(2);
  s.programs[0].back().peer = 1;
  const Verification v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, "meet in rank 0's own memory")) << first_error(v);
}

TEST(Epilogue, CheckProgramRefusesOneThatIsNotLastOrMeetsElsewhere) {
  const Layout layout = make_layout(4096, 2, 2);
  const Schedule s = fused_twoshot(2);
  Program p = encode_program(s, 0);
  EXPECT_NO_THROW(check_program(p, layout, 0));
  Program early = p;
  std::swap(early.steps[0], early.steps[early.num_steps - 1]);
  try {
    check_program(early, layout, 0);
    ADD_FAILURE() << "an epilogue before the last step passed";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("must be the program's last step"), std::string::npos)
        << e.what();
  }
  Program elsewhere = p;
  elsewhere.steps[elsewhere.num_steps - 1].flag_owner = 1;
  EXPECT_THROW(check_program(elsewhere, layout, 0), std::invalid_argument);
}

}  // namespace
}  // namespace pcie_ar::plan
