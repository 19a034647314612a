// Reduce-scatter and all-gather (plan::Collective): every schedule the builders accept, flat and
// island, push and pull, staged and not, flag, LL and lamport, is proven by the verifier, and
// the verifier rejects each way such a schedule can be wrong.
#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <vector>

#include "../transport/host_test_util.h"
#include "plan/schedule.h"
#include "plan/verify.h"

namespace pcie_ar::plan {
namespace {

using transport::host_test::halves;
using transport::host_test::interleaved;

std::string first_error(const Verification& v) {
  return v.errors.empty() ? "(no error)" : v.errors.front();
}

bool says(const Verification& v, const std::string& what) {
  for (const auto& e : v.errors) {
    if (e.find(what) != std::string::npos) return true;
  }
  return false;
}

struct Case {
  Collective collective;
  Tactic tactic;
  int world;
  std::vector<int> island_of;
  std::string islands_name;
};

Schedule build(const Case& c) {
  return build_schedule(c.tactic.algorithm, c.tactic.direction, c.tactic.staged, c.world,
                        c.island_of, c.tactic.protocol, c.collective);
}

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  const Tactic& t = c.tactic;
  return std::string(collective_name(c.collective)) + "_" +
         std::string(algorithm_name(t.algorithm)) + "_" + std::string(direction_name(t.direction)) +
         (t.staged ? "_staged_" : "_unstaged_") + std::string(protocol_name(t.protocol)) + "_w" +
         std::to_string(c.world) + "_" + c.islands_name;
}

void PrintTo(const Case& c, std::ostream* os) { *os << collective_name(c.collective); }

std::vector<Case> accepted_cases() {
  std::vector<Case> cases;
  for (Collective collective : {Collective::kReduceScatter, Collective::kAllGather}) {
    for (int world = 2; world <= kMaxWorld; ++world) {
      std::vector<std::pair<std::vector<int>, std::string>> maps = {{{}, "flat"}};
      if (world % 2 == 0) {
        maps.emplace_back(halves(world), "halves");
        if (world >= 4) maps.emplace_back(interleaved(world), "interleaved");
      }
      for (const auto& [island_of, name] : maps) {
        for (const Tactic& t : buildable_tactics(world, island_of, collective)) {
          cases.push_back({collective, t, world, island_of, name});
        }
      }
    }
  }
  return cases;
}

class EveryCollectiveSchedule : public testing::TestWithParam<Case> {};

TEST_P(EveryCollectiveSchedule, VerifiesBuiltAndFused) {
  const Case& c = GetParam();
  const Schedule built = build(c);
  EXPECT_EQ(built.collective, c.collective);
  EXPECT_EQ(built.num_chunks, c.world);
  for (const Schedule& s : {built, fuse_forwarding_copies(built)}) {
    const Verification v = verify(s);
    EXPECT_TRUE(v.ok) << first_error(v);
    if (c.tactic.staged) {
      EXPECT_LE(v.max_outbound_per_stage, 1);
      EXPECT_LE(v.max_inbound_per_stage, 1);
    }
    EXPECT_LE(v.max_steps, kMaxSteps);
    // Both move half an all-reduce's data: every rank sends each peer at most one chunk in
    // `world` of the message per phase it takes part in.
    for (int r = 0; r < c.world; ++r) {
      for (int q = 0; q < c.world; ++q) EXPECT_LE(v.sent_to[r][q], 2.0 / c.world + 1e-9);
    }
    EXPECT_FALSE(verify(s, VerifyOptions{true}).ok) << "no in-place form";
  }
  EXPECT_THROW(with_epilogue(built), std::invalid_argument);
}

INSTANTIATE_TEST_SUITE_P(Plan, EveryCollectiveSchedule, testing::ValuesIn(accepted_cases()),
                         case_name);

// An all-gather is not built on lamport: lamport stores -0 as +0, and an all-gather moves every
// bit (the owner's chunk is its own copy, so its peers' copies would differ from it).
TEST(Collectives, AreBuiltForBothTwoShotFamiliesAndEveryProtocolAnAllGatherCarriesExactly) {
  for (Collective collective : {Collective::kReduceScatter, Collective::kAllGather}) {
    const int lamports = collective == Collective::kAllGather ? 0 : 2;
    int flat = 0;
    int island = 0;
    int ll = 0;
    int lamport = 0;
    int pull = 0;
    for (const Tactic& t : buildable_tactics(8, halves(8), collective)) {
      flat += t.algorithm == Algorithm::kTwoshot;
      island += t.algorithm == Algorithm::kIslandTwoshot;
      ll += t.protocol == Protocol::kLL;
      lamport += t.protocol == Protocol::kLamport;
      pull += t.direction == Direction::kPull;
      EXPECT_TRUE(t.algorithm == Algorithm::kTwoshot || t.algorithm == Algorithm::kIslandTwoshot);
    }
    EXPECT_EQ(flat, 5 + lamports / 2)
        << "push/pull x staged/unstaged flag, and unstaged push LL (and lamport)";
    EXPECT_EQ(island, 5 + lamports / 2);
    EXPECT_EQ(ll, 2);
    EXPECT_EQ(lamport, lamports);
    EXPECT_EQ(pull, 4);
  }
  const Tactic lamport{Algorithm::kTwoshot, Direction::kPush, false, Protocol::kLamport};
  const auto why = why_unsupported(lamport, 8, halves(8), Collective::kAllGather);
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("-0 as +0"), std::string::npos) << *why;
}

TEST(Collectives, OneShotHasNoHalfThatIsOne) {
  const Tactic oneshot{Algorithm::kOneshot, Direction::kPush, false, Protocol::kFlag};
  const auto why = why_unsupported(oneshot, 4, {}, Collective::kReduceScatter);
  ASSERT_TRUE(why.has_value());
  EXPECT_NE(why->find("two-shot algorithms"), std::string::npos) << *why;
  EXPECT_FALSE(why_unsupported(oneshot, 4, {}, Collective::kAllReduce).has_value());
  EXPECT_THROW(build_schedule(Algorithm::kIslandOneshot, Direction::kPush, false, 4, halves(4),
                              Protocol::kFlag, Collective::kAllGather),
               UnsupportedSchedule);
}

// Every chunk crosses the socket link once in the island forms, (world / 2) times flat.
TEST(Collectives, IslandFormsCrossTheSocketLinkOncePerChunk) {
  for (Collective collective : {Collective::kReduceScatter, Collective::kAllGather}) {
    const Verification flat = verify(build_schedule(Algorithm::kTwoshot, Direction::kPush, false, 8,
                                                    halves(8), Protocol::kFlag, collective));
    const Verification island =
        verify(build_schedule(Algorithm::kIslandTwoshot, Direction::kPush, false, 8, halves(8),
                              Protocol::kFlag, collective));
    ASSERT_TRUE(flat.ok && island.ok) << first_error(flat) << first_error(island);
    EXPECT_DOUBLE_EQ(flat.cross_island_elements(), 2.0);
    EXPECT_DOUBLE_EQ(island.cross_island_elements(), 0.5);
  }
}

Schedule flat(Collective collective, int world = 4, Direction direction = Direction::kPush) {
  return build_schedule(Algorithm::kTwoshot, direction, false, world, {}, Protocol::kFlag,
                        collective);
}

// Finds rank r's first copy or sum that writes its output.
Step* output_write(Schedule& s, int r) {
  for (Step& step : s.programs[r]) {
    if (step.kind == StepKind::kReduce && step.dst.space == Space::kOutput) return &step;
  }
  return nullptr;
}

TEST(CollectiveVerifier, RejectsAReduceScatterWritingOutsideItsChunk) {
  Schedule s = flat(Collective::kReduceScatter);
  Step copy;  // rank 2 copies its input's chunk 1 into its output, which holds chunk 2 only
  copy.chunk = 1;
  copy.num_srcs = 1;
  copy.srcs[0] = BufRef{Space::kInput, 2, 0, 0};
  copy.dst = BufRef{Space::kOutput, 2, 0, 0};
  s.programs[2].push_back(copy);
  const Verification v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, "a reduce-scatter's output is chunk 2 only")) << first_error(v);
}

TEST(CollectiveVerifier, RejectsAReduceScatterMissingAContribution) {
  Schedule s = flat(Collective::kReduceScatter);
  Step* sum = output_write(s, 1);
  ASSERT_NE(sum, nullptr);
  ASSERT_EQ(sum->num_srcs, 4);
  sum->num_srcs = 3;  // drops rank 3's chunk 1
  const Verification v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, "rank 3's input is summed 0 times")) << first_error(v);
}

TEST(CollectiveVerifier, RejectsAnAllGatherReadingAnInputChunkItDoesNotHold) {
  Schedule s = flat(Collective::kAllGather);
  Step* copy = output_write(s, 0);
  ASSERT_NE(copy, nullptr);
  ASSERT_EQ(copy->srcs[0].space, Space::kInput);
  copy->chunk = 3;  // rank 0's input is chunk 0 alone
  const Verification v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, "reads chunk 3 before anything wrote it")) << first_error(v);
}

TEST(CollectiveVerifier, RejectsAnAllGatherThatSumsOrMisplacesAChunk) {
  Schedule summed = flat(Collective::kAllGather, 2);
  // Rank 1's last copy takes rank 0's chunk from the gather slot into its output: make it add
  // rank 1's own input chunk... which it does not hold, so use its output chunk 1 instead.
  Step& last = summed.programs[1].back();
  ASSERT_EQ(last.dst.space, Space::kOutput);
  ASSERT_EQ(last.chunk, 0);
  last.srcs[1] = BufRef{Space::kOutput, 1, 0, 0};
  last.num_srcs = 2;
  Verification v = verify(summed);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, "reads chunk 0 before anything wrote it") ||
              says(v, "expected rank 0's input, copied"))
      << first_error(v);

  Schedule own_only = flat(Collective::kAllGather, 2);
  own_only.programs[0].pop_back();  // rank 0 never copies rank 1's chunk out of its slot
  v = verify(own_only);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, "rank 0 output chunk 1 = nothing: never written")) << first_error(v);
}

TEST(CollectiveVerifier, RejectsAWriteIntoAnInput) {
  Schedule s = flat(Collective::kReduceScatter, 2);
  Step* sum = output_write(s, 0);
  ASSERT_NE(sum, nullptr);
  sum->dst = BufRef{Space::kInput, 0, 0, 0};
  const Verification v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, "writes the rank's input")) << first_error(v);
}

TEST(CollectiveVerifier, RejectsAnEpilogueAndAWrongChunkCount) {
  Schedule s = flat(Collective::kReduceScatter, 2);
  s.epilogue = true;
  Verification v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, "the epilogue ends an all-reduce")) << first_error(v);

  Schedule chunks = flat(Collective::kAllGather, 2);
  chunks.num_chunks = 4;
  v = verify(chunks);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, "cuts the message into world = 2 chunks")) << first_error(v);
}

TEST(CollectiveVerifier, RejectsAPullReduceScatterReadingBeforeTheFlag) {
  Schedule s = flat(Collective::kReduceScatter, 3, Direction::kPull);
  auto& program = s.programs[1];
  for (size_t i = 0; i < program.size(); ++i) {
    if (program[i].kind == StepKind::kWait) {
      program.erase(program.begin() + static_cast<std::ptrdiff_t>(i));
      break;
    }
  }
  const Verification v = verify(s);
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, "without waiting for its flag")) << first_error(v);
}

TEST(Collectives, SignaturesTellTheCollectivesApart) {
  const Tactic t{Algorithm::kTwoshot, Direction::kPush, false, Protocol::kFlag};
  const uint32_t ar = call_signature(DType::kBF16, t);
  const uint32_t rs = call_signature(DType::kBF16, t, false, Collective::kReduceScatter);
  const uint32_t ag = call_signature(DType::kBF16, t, false, Collective::kAllGather);
  EXPECT_NE(ar, rs);
  EXPECT_NE(ar, ag);
  EXPECT_NE(rs, ag);
  EXPECT_NE(call_signature(DType::kBF16, t, true), rs);
  EXPECT_EQ(parse_collective("reduce_scatter"), Collective::kReduceScatter);
  EXPECT_EQ(collective_name(Collective::kAllGather), "all_gather");
  EXPECT_FALSE(parse_collective("broadcast").has_value());
}

}  // namespace
}  // namespace pcie_ar::plan
