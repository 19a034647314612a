// A streamed message: one larger than the workspace runs as rounds, each one call of a schedule
// of one group, back to back on one workspace (rounds k and k + 2 share the slots, LL slots and
// flags of their parity). verify_rounds() proves the rounds together. Here every pair of a
// group's tactics streams, in every form a table runs; hand-broken rounds are caught with the
// round named; rounds of different groups are refused; and one round is verify().
#include <gtest/gtest.h>

#include <algorithm>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "plan/layout.h"
#include "plan/schedule.h"
#include "plan/verify.h"

namespace pcie_ar::plan {
namespace {

std::string all_errors(const Verification& v) {
  std::string out;
  for (const std::string& e : v.errors) out += "\n  " + e;
  return out.empty() ? "(no error)" : out;
}

// Whether one error holds every one of `parts`.
bool says(const Verification& v, const std::vector<std::string>& parts) {
  for (const std::string& e : v.errors) {
    if (std::all_of(parts.begin(), parts.end(),
                    [&](const std::string& p) { return e.find(p) != std::string::npos; })) {
      return true;
    }
  }
  return false;
}

struct Group {
  int world;
  std::vector<int> island_of;
  std::string name;
  bool sample = false;  // too many pairs to run them all: each tactic with a few partners
};

std::vector<Group> groups() {
  return {{2, {}, "flat_w2"},
          {3, {}, "flat_w3"},
          {4, {}, "flat_w4"},
          {4, {0, 0, 1, 1}, "halves_w4"},
          {4, {0, 1, 0, 1}, "interleaved_w4"},
          {8, {0, 0, 0, 0, 1, 1, 1, 1}, "halves_w8", true}};
}

// The forms a table runs: as built (GPUs), with forwarding copies fused (hosts), and each as
// the fused all-reduce + RMSNorm.
enum class Form { kBuilt, kForwardingFused, kEpilogue, kEpilogueForwardingFused };

std::string form_name(Form form) {
  switch (form) {
    case Form::kBuilt:
      return "built";
    case Form::kForwardingFused:
      return "forwarding_fused";
    case Form::kEpilogue:
      return "epilogue";
    case Form::kEpilogueForwardingFused:
      return "epilogue_forwarding_fused";
  }
  return "?";
}

Schedule in_form(Schedule s, Form form) {
  if (form == Form::kForwardingFused || form == Form::kEpilogueForwardingFused) {
    s = fuse_forwarding_copies(std::move(s));
  }
  if (form == Form::kEpilogue || form == Form::kEpilogueForwardingFused) {
    s = with_epilogue(std::move(s));
  }
  return s;
}

using PairsCase = std::tuple<Group, Form>;

void PrintTo(const PairsCase& c, std::ostream* os) {
  *os << std::get<0>(c).name << " " << form_name(std::get<1>(c));
}

class EveryPairOfTactics : public testing::TestWithParam<PairsCase> {};

// Any tactic may follow any other in a message (the last, shorter round often takes another), so
// every ordered pair (A, B) streams: A A B (a change of tactic after a repeat, B sharing its
// parity with the first A) and A B A B (alternating, each parity used by both).
TEST_P(EveryPairOfTactics, Streams) {
  const auto& [group, form] = GetParam();
  const std::vector<Tactic> tactics = buildable_tactics(group.world, group.island_of);
  ASSERT_FALSE(tactics.empty());
  std::vector<Schedule> schedules;
  for (const Tactic& t : tactics) {
    schedules.push_back(in_form(build_schedule(t.algorithm, t.direction, t.staged, group.world,
                                               group.island_of, t.protocol),
                                form));
  }
  const int n = static_cast<int>(schedules.size());
  std::vector<std::pair<int, int>> pairs;
  for (int a = 0; a < n; ++a) {
    if (!group.sample) {
      for (int b = 0; b < n; ++b) pairs.emplace_back(a, b);
      continue;
    }
    // Each tactic follows itself and three others, and is followed by as many.
    for (int step : {0, 1, 5, 11}) pairs.emplace_back(a, (a + step) % n);
  }
  // The in-place op streams too: each round's output aliases that round's input.
  const bool in_place_too = form == Form::kBuilt;
  int runs = 0;
  int failures = 0;
  for (const auto& [a, b] : pairs) {
    const Schedule& A = schedules[a];
    const Schedule& B = schedules[b];
    for (const std::vector<Schedule>& rounds :
         {std::vector<Schedule>{A, A, B}, std::vector<Schedule>{A, B, A, B}}) {
      for (const bool in_place : {false, true}) {
        if (in_place && !in_place_too) continue;
        ++runs;
        const Verification v = verify_rounds(rounds, VerifyOptions{in_place});
        if (v.ok) continue;
        if (++failures <= 10) {
          ADD_FAILURE() << tactic_label(tactics[a]) << " then " << tactic_label(tactics[b]) << " ("
                        << rounds.size() << " rounds" << (in_place ? ", in place" : "")
                        << "): " << all_errors(v);
        }
      }
    }
  }
  EXPECT_EQ(failures, 0) << "of " << runs << " streams";
  EXPECT_GE(runs, static_cast<int>(pairs.size()) * 2);
}

INSTANTIATE_TEST_SUITE_P(VerifyRounds, EveryPairOfTactics,
                         testing::Combine(testing::ValuesIn(groups()),
                                          testing::Values(Form::kBuilt, Form::kForwardingFused,
                                                          Form::kEpilogue,
                                                          Form::kEpilogueForwardingFused)),
                         [](const testing::TestParamInfo<PairsCase>& info) {
                           return std::get<0>(info.param).name + "_" +
                                  form_name(std::get<1>(info.param));
                         });

// ---------------------------------------------------------------- one round is verify()

void expect_same(const Verification& a, const Verification& b, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(a.ok, b.ok);
  EXPECT_EQ(a.errors, b.errors);
  EXPECT_EQ(a.num_stages, b.num_stages);
  EXPECT_EQ(a.max_steps, b.max_steps);
  EXPECT_EQ(a.max_outbound_per_stage, b.max_outbound_per_stage);
  EXPECT_EQ(a.max_inbound_per_stage, b.max_inbound_per_stage);
  EXPECT_EQ(a.cross_island[0], b.cross_island[0]);
  EXPECT_EQ(a.cross_island[1], b.cross_island[1]);
  EXPECT_EQ(a.sent_to, b.sent_to);
  EXPECT_EQ(a.cost.system_fences, b.cost.system_fences);
  EXPECT_EQ(a.cost.peer_polls, b.cost.peer_polls);
  EXPECT_EQ(a.cost.local_waits, b.cost.local_waits);
  EXPECT_EQ(a.cost.data_polls, b.cost.data_polls);
  EXPECT_EQ(a.cost.fabric_hops, b.cost.fabric_hops);
  EXPECT_EQ(a.cost.cross_island, b.cost.cross_island);
}

struct Mutant {
  std::string name;
  Schedule schedule;
  const Schedule* unbroken;  // what it was made from (itself when unbroken)
};

// Every schedule of a few groups and collectives, and broken ones (each step dropped, each pair
// of neighbours swapped: races, deadlocks, wrong sums). `built` holds the unbroken schedules.
std::vector<Mutant> schedules_and_mutants(std::vector<Schedule>& built) {
  built.clear();
  std::vector<std::string> names;
  for (const Group& g : {Group{2, {}, "flat_w2"}, Group{4, {0, 0, 1, 1}, "halves_w4"}}) {
    for (Collective c :
         {Collective::kAllReduce, Collective::kReduceScatter, Collective::kAllGather}) {
      for (const Tactic& t : buildable_tactics(g.world, g.island_of, c)) {
        const Schedule s =
            build_schedule(t.algorithm, t.direction, t.staged, g.world, g.island_of, t.protocol, c);
        const std::string name =
            g.name + " " + std::string(collective_name(c)) + " " + tactic_label(t);
        built.push_back(s);
        names.push_back(name);
        if (c != Collective::kAllReduce) continue;
        built.push_back(with_epilogue(s));
        names.push_back(name + " epilogue");
      }
    }
  }
  std::vector<Mutant> out;
  for (size_t k = 0; k < built.size(); ++k) {
    const Schedule& s = built[k];
    out.push_back({names[k], s, &s});
    for (int r = 0; r < s.world; ++r) {
      for (size_t i = 0; i < s.programs[r].size(); ++i) {
        const std::string at = " rank " + std::to_string(r) + " step " + std::to_string(i);
        Schedule dropped = s;
        dropped.programs[r].erase(dropped.programs[r].begin() + static_cast<long>(i));
        out.push_back({names[k] + " without" + at, std::move(dropped), &s});
        if (i + 1 == s.programs[r].size()) continue;
        Schedule swapped = s;
        std::swap(swapped.programs[r][i], swapped.programs[r][i + 1]);
        out.push_back({names[k] + " swapped" + at, std::move(swapped), &s});
      }
    }
  }
  return out;
}

TEST(VerifyRounds, OneRoundIsVerifyErrorsAndCountsAlike) {
  std::vector<Schedule> built;
  int accepted = 0;
  int rejected = 0;
  for (const Mutant& m : schedules_and_mutants(built)) {
    for (const bool in_place : {false, true}) {
      const VerifyOptions options{in_place};
      const Verification one = verify(m.schedule, options);
      expect_same(verify_rounds({m.schedule}, options), one,
                  m.name + (in_place ? " in place" : ""));
      ++(one.ok ? accepted : rejected);
    }
  }
  // Both verdicts were exercised, with the errors of every kind the mutants make.
  EXPECT_GT(accepted, 100);
  EXPECT_GT(rejected, 100);
}

// Every schedule whose every round verifies streams, and no broken one does: a schedule whose
// outputs verify has every rank hear from every other in every round (each output needs every
// rank's input, and data travels only with flags or LL tags), which is all the double buffer
// needs; so streaming adds no verdict of its own to a group's schedules, only its proof. The
// mutants, three times over and between unbroken rounds.
TEST(VerifyRounds, StreamsExactlyTheSchedulesThatVerify) {
  std::vector<Schedule> built;
  int accepted = 0;
  int disagreements = 0;
  for (const Mutant& m : schedules_and_mutants(built)) {
    const bool one = verify(m.schedule).ok;
    accepted += one && m.unbroken != &m.schedule ? 1 : 0;
    for (const std::vector<Schedule>& rounds :
         {std::vector<Schedule>{m.schedule, m.schedule, m.schedule},
          std::vector<Schedule>{*m.unbroken, m.schedule, *m.unbroken, m.schedule}}) {
      const Verification v = verify_rounds(rounds);
      if (v.ok != one && ++disagreements <= 10) {
        ADD_FAILURE() << m.name << " in " << rounds.size() << " rounds: verify says " << one
                      << all_errors(v);
      }
    }
  }
  EXPECT_EQ(disagreements, 0);
  EXPECT_GT(accepted, 100);  // broken yet right: independent steps swapped, waits a later covers
}

TEST(VerifyRounds, CountsAreTheWorstRoundsFieldByField) {
  const Schedule staged = build_schedule(Algorithm::kOneshot, Direction::kPush, true, 4);
  const Schedule ll =
      build_schedule(Algorithm::kOneshot, Direction::kPush, false, 4, {}, Protocol::kLL);
  const Verification a = verify(staged);
  const Verification b = verify(ll);
  const Verification v = verify_rounds({staged, ll, staged, ll});
  ASSERT_TRUE(v.ok) << all_errors(v);
  EXPECT_EQ(v.num_stages, std::max(a.num_stages, b.num_stages));
  EXPECT_EQ(v.max_steps, std::max(a.max_steps, b.max_steps));
  EXPECT_EQ(v.max_outbound_per_stage, std::max(a.max_outbound_per_stage, b.max_outbound_per_stage));
  EXPECT_EQ(v.cost.system_fences, a.cost.system_fences);  // LL pays none
  EXPECT_EQ(v.cost.data_polls, b.cost.data_polls);        // flags poll no data
  EXPECT_EQ(v.cost.fabric_hops, std::max(a.cost.fabric_hops, b.cost.fabric_hops));
  EXPECT_EQ(v.sent_to, a.sent_to);  // both send every peer the whole message
}

// ---------------------------------------------------------------- broken rounds

BufRef input_of(int r) { return BufRef{Space::kInput, static_cast<uint8_t>(r), 0, 0}; }
BufRef output_of(int r) { return BufRef{Space::kOutput, static_cast<uint8_t>(r), 0, 0}; }
BufRef ll_of(int owner, int slot, int writer) {
  return BufRef{Space::kLL, static_cast<uint8_t>(owner), static_cast<uint8_t>(slot),
                static_cast<uint8_t>(writer)};
}

Step reduce(BufRef dst, std::vector<BufRef> srcs) {
  Step step;
  step.kind = StepKind::kReduce;
  step.num_srcs = static_cast<uint8_t>(srcs.size());
  std::copy(srcs.begin(), srcs.end(), step.srcs);
  step.dst = dst;
  return step;
}

Step signal(int owner, int flag) {
  Step step;
  step.kind = StepKind::kSignal;
  step.peer = static_cast<uint8_t>(owner);
  step.flag_owner = static_cast<uint8_t>(owner);
  step.flag = static_cast<uint8_t>(flag);
  return step;
}

Step wait(int owner, int flag, int writer) {
  Step step;
  step.kind = StepKind::kWait;
  step.peer = static_cast<uint8_t>(writer);
  step.flag_owner = static_cast<uint8_t>(owner);
  step.flag = static_cast<uint8_t>(flag);
  return step;
}

// A hand-written schedule of a flat group, one chunk, pushing LL data.
Schedule by_hand(std::vector<std::vector<Step>> programs) {
  Schedule s;
  s.direction = Direction::kPush;
  s.staged = false;
  s.protocol = Protocol::kLL;
  s.world = static_cast<int>(programs.size());
  s.num_chunks = 1;
  s.num_stages = 1;
  s.island_of.assign(programs.size(), 0);
  s.programs = std::move(programs);
  return s;
}

Schedule without_last_wait(Schedule s, int rank) {
  auto& program = s.programs[rank];
  for (auto it = program.end(); it != program.begin();) {
    if ((--it)->kind == StepKind::kWait) {
      program.erase(it);
      break;
    }
  }
  return s;
}

TEST(VerifyRounds, RejectsARankThatSkipsItsLastWaitAndRepublishesUnderAReader) {
  // Pull, staged, world 3: rank 0's last wait is for rank 1's "ready". Without it rank 0 can end
  // a round before rank 1 has read the input rank 0 published in its slot 3, and two rounds
  // later publish again into that slot while rank 1 is still reading it.
  const Schedule s = build_schedule(Algorithm::kOneshot, Direction::kPull, true, 3);
  ASSERT_TRUE(verify_rounds({s, s, s}).ok);
  const Schedule m = without_last_wait(s, 0);
  ASSERT_EQ(m.programs[0].size() + 1, s.programs[0].size());
  // The one-round verifier rejects it too, and has to (StreamsExactlyTheSchedulesThatVerify):
  // rank 0 reads rank 1's data without that wait, and never hears from rank 1.
  EXPECT_FALSE(verify(m).ok);
  const Verification v = verify_rounds({m, m, m});
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(
      says(v, {"round 2: rank 0 step 0 (s0 r0.slot3[0] = input): overwrites rank 0's slot 3, "
               "which rank 1 read in round 0 step 4",
               "race across rounds"}))
      << all_errors(v);
  // Its "ready" for round 2 could be taken by rank 1's wait of round 0.
  EXPECT_TRUE(says(v, {"round 2: rank 0 step 1 (s0 signal r1.flag0): raises flag 0 of rank 1 again "
                       "before hearing that rank 1's round 0 wait for it"}))
      << all_errors(v);
}

TEST(VerifyRounds, ARankTwoRoundsAheadSatisfiesAnOldWaitAndLeavesItsDataInAPeersSum) {
  // Push, world 2: rank 1 skips its wait for rank 0's data. It runs on into round 2, raising
  // its flag over the round-0 raise rank 0 has not waited for yet (a flag compares with >=, so
  // rank 0's round-0 wait takes it) after writing round 2's input into rank 0's slot: rank 0's
  // round-0 sum holds rank 1's round-2 input.
  const Schedule s = build_schedule(Algorithm::kOneshot, Direction::kPush, false, 2);
  const Schedule m = without_last_wait(s, 1);
  const Verification v = verify_rounds({m, m, m});
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, {"round 2: rank 1 step 1 (s0 signal r0.flag4): raises flag 4 of rank 0 over "
                       "its round 0 raise, which rank 0 has not waited for yet"}))
      << all_errors(v);
  EXPECT_TRUE(
      says(v, {"round 0: rank 0 step 2 (s0 wait r0.flag4 from r1): finds the flag raised in "
               "round 2"}))
      << all_errors(v);
  EXPECT_TRUE(says(v, {"round 0: rank 0 output chunk 0 = (x0@0+x1@2)", "x1@2"})) << all_errors(v);
}

TEST(VerifyRounds, RejectsAReadOfTheDataTwoRoundsAgoLeftInASlot) {
  // Round 2's rank 1 delivers into another slot of rank 0 than the one rank 0 sums from. One
  // round alone reads a slot nothing wrote; streamed, the slot still holds round 0's data, and
  // nothing in the hardware would tell.
  const Schedule a = build_schedule(Algorithm::kOneshot, Direction::kPush, false, 2);
  Schedule b = a;
  Step& send = b.programs[1].front();
  ASSERT_EQ(send.dst.space, Space::kSlot);
  ASSERT_EQ(send.dst.slot, 1);
  send.dst.slot = static_cast<uint8_t>(slot_gather(2));
  EXPECT_FALSE(verify(b).ok);
  const Verification v = verify_rounds({a, a, b});
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, {"round 2: rank 0 step 3 (", "it holds round 0's data (stale)"}))
      << all_errors(v);
  // The wrong expression: round 0's input of rank 1 in round 2's sum.
  EXPECT_TRUE(
      says(v, {"round 2: rank 0 output chunk 0 = (x0@2+x1@0)", "rank 1's input is summed 0 times"}))
      << all_errors(v);
  EXPECT_TRUE(says(v, {"round 2: rank 0 output chunk 0 = (x0@2+x1@0)", "holds x1@0"}))
      << all_errors(v);
  EXPECT_TRUE(verify_rounds({a, a, a}).ok);
}

TEST(VerifyRounds, RejectsLLDataOverwrittenBeforeItsReaderReadIt) {
  // LL, world 2: rank 1 no longer reads rank 0's data (it copies its input out), so nothing
  // holds it back: its round-2 data lands on its round-0 data before rank 0 has read that.
  Schedule m = build_schedule(Algorithm::kOneshot, Direction::kPush, false, 2, {}, Protocol::kLL);
  m.programs[1].back() = reduce(output_of(1), {input_of(1)});
  const Verification v = verify_rounds({m, m, m});
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, {"round 2: rank 1 step 0 (",
                       "overwrites rank 1's round 0 LL data (chunk 0) in "
                       "rank 0's LL slot 1, which rank 0 has not read yet"}))
      << all_errors(v);
}

TEST(VerifyRounds, RejectsAnLLWriteThatHasNotHeardTheReadTwoRoundsAgo) {
  // World 3. Rank 1 delivers LL data to rank 0 in rounds 0 and 2; rank 0 reads it. In round 2
  // rank 1 first waits for rank 2, which has heard nothing of rank 0: rank 0's read (and reset)
  // of round 0 may not have reached the slot when round 2's data does. Round 1 exchanges
  // nothing. The control: rank 0 tells rank 2 it has started round 1, rank 2 passes that on.
  const Step read = reduce(output_of(0), {input_of(0), ll_of(0, 1, 1)});
  const Step deliver = reduce(ll_of(0, 1, 1), {input_of(1)});
  auto copy_out = [](int r) { return reduce(output_of(r), {input_of(r)}); };
  const int from_2 = 2 * kFlagsPerWriter;  // rank 2's flag in rank 1's array
  const Schedule round0 = by_hand({{read}, {deliver, copy_out(1)}, {copy_out(2)}});
  const Schedule round2 = by_hand(
      {{read}, {wait(1, from_2, 2), deliver, copy_out(1)}, {signal(1, from_2), copy_out(2)}});
  const Schedule silent = by_hand({{copy_out(0)}, {copy_out(1)}, {copy_out(2)}});
  const Schedule relayed =
      by_hand({{signal(2, 0), copy_out(0)}, {copy_out(1)}, {wait(2, 0, 0), copy_out(2)}});
  const std::vector<std::string> race = {
      "round 2: rank 1 step 1 (", "overwrites rank 0's LL slot 1, which rank 0 read in round 0",
      "before rank 1 heard that round end on rank 0"};
  const Verification v = verify_rounds({round0, silent, round2});
  EXPECT_TRUE(says(v, race)) << all_errors(v);
  // What lets it happen, round by round: hearing from a peer in round 0 is not hearing from it
  // in round 1.
  EXPECT_TRUE(says(v, {"round 1: rank 0 can finish without hearing from rank 1: the generation "
                       "double buffer would be unsafe"}))
      << all_errors(v);
  const Verification control = verify_rounds({round0, relayed, round2});
  EXPECT_FALSE(says(control, race)) << all_errors(control);
  EXPECT_FALSE(says(control, {"across rounds"})) << all_errors(control);
  // Told in round 0, after its read, is not enough: a flag chain orders only the CTA that read
  // (each CTA has its own flags), and round 2 may launch CTAs whose slices cover the others';
  // only the end of rank 0's round-0 kernel orders them all.
  const Schedule told_in_round0 =
      by_hand({{read, signal(2, 0)}, {deliver, copy_out(1)}, {wait(2, 0, 0), copy_out(2)}});
  const Verification early = verify_rounds({told_in_round0, silent, round2});
  EXPECT_TRUE(says(early, race)) << all_errors(early);
}

// ---------------------------------------------------------------- one group

TEST(VerifyRounds, RefusesRoundsOfDifferentGroups) {
  const Schedule w2 = build_schedule(Algorithm::kOneshot, Direction::kPush, false, 2);
  const Schedule w3 = build_schedule(Algorithm::kOneshot, Direction::kPush, false, 3);
  Verification v = verify_rounds({w2, w2, w3});
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, {"round 2: a schedule of another group than round 0's (world 3, not 2)"}))
      << all_errors(v);

  const Schedule halves =
      build_schedule(Algorithm::kIslandOneshot, Direction::kPush, false, 4, {0, 0, 1, 1});
  const Schedule interleaved =
      build_schedule(Algorithm::kIslandOneshot, Direction::kPush, false, 4, {0, 1, 0, 1});
  v = verify_rounds({halves, interleaved});
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, {"round 1: ", "island map {0,1,0,1}, not {0,0,1,1}"})) << all_errors(v);

  const Schedule all_reduce = build_schedule(Algorithm::kTwoshot, Direction::kPush, false, 4);
  const Schedule scatter = build_schedule(Algorithm::kTwoshot, Direction::kPush, false, 4, {},
                                          Protocol::kFlag, Collective::kReduceScatter);
  v = verify_rounds({all_reduce, scatter});
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, {"round 1: ", "reduce_scatter, not all_reduce"})) << all_errors(v);

  v = verify_rounds({all_reduce, with_epilogue(all_reduce)});
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, {"round 1: ", "fused epilogue, not none"})) << all_errors(v);

  v = verify_rounds({});
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, {"no rounds"})) << all_errors(v);

  // The same group with another tactic, protocol and chunking is one message.
  const Schedule ll =
      build_schedule(Algorithm::kOneshot, Direction::kPush, false, 4, {}, Protocol::kLamport);
  EXPECT_TRUE(verify_rounds({all_reduce, ll, all_reduce}).ok);
}

TEST(VerifyRounds, NamesTheRoundOfAnErrorInsideOneRound) {
  // A race inside round 1 alone: the errors of verify(), with the round in front.
  const Schedule good = build_schedule(Algorithm::kOneshot, Direction::kPush, false, 3);
  Schedule bad = good;
  auto& program = bad.programs[0];
  program.erase(std::find_if(program.begin(), program.end(),
                             [](const Step& step) { return step.kind == StepKind::kWait; }));
  const Verification one = verify(bad);
  ASSERT_FALSE(one.ok);
  const Verification v = verify_rounds({good, bad, good});
  EXPECT_FALSE(v.ok);
  EXPECT_TRUE(says(v, {"round 1: " + one.errors.front()})) << all_errors(v);
  for (const std::string& e : v.errors) EXPECT_EQ(e.rfind("round ", 0), 0u) << e;
}

}  // namespace
}  // namespace pcie_ar::plan
