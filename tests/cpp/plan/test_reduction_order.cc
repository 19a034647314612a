// One reduction order per group (plan::canonical_groups): every tactic and collective of a group
// computes each element as the same tree, so a table that mixes tactics by size changes no bit.
// The verifier proves it for every schedule; here the step lists are also replayed with bf16
// rounding on values whose sums round differently in different orders, and every tactic's bits
// are compared with an oracle of the tree written without the step lists.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "plan/schedule.h"
#include "plan/verify.h"
#include "replay.h"

namespace pcie_ar::plan {
namespace {

struct Group {
  int world;
  std::vector<int> island_of;
  std::string name;
};

std::vector<Group> groups() {
  std::vector<Group> out;
  for (int world = 2; world <= kMaxWorld; ++world) {
    out.push_back({world, {}, "flat w" + std::to_string(world)});
    if (world % 2 != 0) continue;
    std::vector<int> halves(world), interleaved(world);
    for (int r = 0; r < world; ++r) {
      halves[r] = r < world / 2 ? 0 : 1;
      interleaved[r] = r % 2;
    }
    out.push_back({world, halves, "halves w" + std::to_string(world)});
    if (world >= 4) out.push_back({world, interleaved, "interleaved w" + std::to_string(world)});
  }
  out.push_back({4, {1, 0, 1, 0}, "rank 0 in island 1"});
  out.push_back({8, {0, 0, 0, 1, 1, 1, 1, 1}, "uneven 3+5"});
  out.push_back({6, {0, 0, 1, 1, 2, 2}, "three islands"});
  return out;
}

float round_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits = (bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff0000u;
  std::memcpy(&x, &bits, 4);
  return x;
}

// The tree, from the design's words: where the group has two islands of equal size >= 2, each
// island's rank-ordered sum is rounded, then the two (the island holding rank 0 first) are
// summed and rounded; elsewhere one rank-ordered sum, rounded once.
float oracle(const std::vector<float>& x, const std::vector<int>& island_of) {
  const int world = static_cast<int>(x.size());
  const std::set<int> ids(island_of.begin(), island_of.end());
  int first = 0;
  for (int island : island_of) first += island == island_of[0] ? 1 : 0;
  if (ids.size() != 2 || first * 2 != world || first < 2) {
    float sum = 0.0f;
    for (float v : x) sum += v;
    return round_bf16(sum);
  }
  float partial[2] = {0.0f, 0.0f};
  for (int q = 0; q < world; ++q) partial[island_of[q] == island_of[0] ? 0 : 1] += x[q];
  return round_bf16(0.0f + round_bf16(partial[0]) + round_bf16(partial[1]));
}

TEST(ReductionOrder, EveryTacticOfAGroupGivesTheTreesBitsOnEveryRank) {
  constexpr int64_t kNumel = 4 * 29;  // fp32 vectors of 4; chunks and slices uneven
  int compared = 0;
  int differs_from_flat = 0;  // elements where the tree's two roundings change the result
  for (const Group& g : groups()) {
    const int w = g.world;
    {
      for (Collective collective : {Collective::kAllReduce, Collective::kReduceScatter}) {
        for (const Tactic& t : buildable_tactics(w, g.island_of, collective)) {
          const Schedule built = build_schedule(t.algorithm, t.direction, t.staged, w, g.island_of,
                                                t.protocol, collective);
          for (const Schedule& s : {built, fuse_forwarding_copies(built)}) {
            ASSERT_TRUE(verify(s).ok) << tactic_label(t) << " " << g.name;
            Replay replay(s, kNumel, 2, false, /*bf16=*/true, /*seed=*/77);
            replay.keep_inputs();
            ASSERT_TRUE(replay.run()) << "deadlock";
            for (int r = 0; r < w; ++r) {
              const VecRange mine = slice_range(kNumel / 4, w, r, 1, 0);
              for (int64_t i = 0; i < kNumel; ++i) {
                if (collective == Collective::kReduceScatter &&
                    (i < mine.begin * 4 || i >= mine.end * 4)) {
                  continue;
                }
                const std::vector<float> x = replay.inputs_at(i);
                const float want = oracle(x, g.island_of);
                const float flat = oracle(x, std::vector<int>(w, 0));
                ASSERT_EQ(replay.output(r)[i], want)
                    << collective_name(collective) << " " << tactic_label(t) << " " << g.name
                    << " rank " << r << " element " << i;
                differs_from_flat += want != flat ? 1 : 0;
                ++compared;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(compared, 100000);
  // The data must tell the two trees apart, or the test proves nothing about the islands.
  EXPECT_GT(differs_from_flat, 1000);
}

// A flat tactic on an islanded group that sums every operand at once computes another tree:
// the verifier names the group's.
TEST(ReductionOrder, TheVerifierRejectsAFlatSumOnAnIslandedGroup) {
  const std::vector<int> halves = {0, 0, 1, 1};
  Schedule s = build_schedule(Algorithm::kOneshot, Direction::kPush, false, 4, halves);
  int splits = 0;
  for (auto& program : s.programs) {
    for (Step& step : program) {
      if (step.kind == StepKind::kReduce && step.split != 0) {
        EXPECT_EQ(step.split, 2) << describe_step(step);
        ++splits;
        step.split = 0;
      }
    }
  }
  EXPECT_EQ(splits, 4);
  const Verification v = verify(s);
  ASSERT_FALSE(v.ok);
  EXPECT_NE(v.errors.front().find("the group's one reduction order is ((x0+x1)+(x2+x3))"),
            std::string::npos)
      << v.errors.front();
}

// A split in the wrong place is another tree too, and so is an island order that puts the
// island without rank 0 first.
TEST(ReductionOrder, TheVerifierRejectsASplitElsewhereOrIslandsSwapped) {
  const std::vector<int> interleaved = {0, 1, 0, 1};
  Schedule s = build_schedule(Algorithm::kOneshot, Direction::kPush, false, 4, interleaved);
  for (Step& step : s.programs[2]) {
    if (step.kind == StepKind::kReduce && step.split != 0) step.split = 1;
  }
  Verification v = verify(s);
  ASSERT_FALSE(v.ok);
  EXPECT_NE(v.errors.front().find("rank 2"), std::string::npos) << v.errors.front();
  EXPECT_NE(v.errors.front().find("((x0+x2)+(x1+x3))"), std::string::npos) << v.errors.front();

  s = build_schedule(Algorithm::kIslandOneshot, Direction::kPush, false, 4, interleaved);
  for (Step& step : s.programs[1]) {
    if (step.kind == StepKind::kReduce && step.dst.space == Space::kOutput)
      std::swap(step.srcs[0], step.srcs[1]);
  }
  v = verify(s);
  ASSERT_FALSE(v.ok);
  EXPECT_NE(v.errors.front().find("rank 1"), std::string::npos) << v.errors.front();
}

// Flat tactics on an islanded group carry the split; island tactics and flat groups never do
// (their sums already are the tree).
TEST(ReductionOrder, OnlyFlatTacticsOnIslandedGroupsSplit) {
  for (const Group& g : groups()) {
    const int w = g.world;
    const bool two_groups = canonical_groups(w, g.island_of).size() == 2;
    for (const Tactic& t : buildable_tactics(w, g.island_of)) {
      const Schedule s =
          build_schedule(t.algorithm, t.direction, t.staged, w, g.island_of, t.protocol);
      bool split = false;
      for (const auto& program : s.programs) {
        for (const Step& step : program) split |= step.kind == StepKind::kReduce && step.split;
      }
      EXPECT_EQ(split, two_groups && !is_island_algorithm(t.algorithm))
          << tactic_label(t) << " " << g.name;
    }
  }
}

TEST(ReductionOrder, CanonicalGroupsAreTheIslandsWhereIslandTacticsBuild) {
  using Groups = std::vector<std::vector<int>>;
  EXPECT_EQ(canonical_groups(4, {}), (Groups{{0, 1, 2, 3}}));
  EXPECT_EQ(canonical_groups(4, {0, 0, 1, 1}), (Groups{{0, 1}, {2, 3}}));
  EXPECT_EQ(canonical_groups(4, {1, 0, 1, 0}), (Groups{{0, 2}, {1, 3}}));
  EXPECT_EQ(canonical_groups(2, {0, 1}), (Groups{{0, 1}}));  // islands of one
  EXPECT_EQ(canonical_groups(6, {0, 0, 0, 1, 1, 2}), (Groups{{0, 1, 2, 3, 4, 5}}));  // three
  EXPECT_EQ(canonical_groups(8, {0, 0, 0, 1, 1, 1, 1, 1}),
            (Groups{{0, 1, 2, 3, 4, 5, 6, 7}}));  // uneven
}

}  // namespace
}  // namespace pcie_ar::plan
