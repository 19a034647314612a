// plan::check_program: what every executor may assume about a step list, checked once when a
// program is added to a workspace. Every program the builders emit passes; each kind of
// corruption is refused with a message naming the rank, the step and the bad field.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "plan/layout.h"
#include "plan/program_check.h"
#include "plan/schedule.h"

namespace pcie_ar::plan {
namespace {

void expect_rejects(const Program& program, const Layout& layout, int rank,
                    const std::string& needle) {
  try {
    check_program(program, layout, rank);
    ADD_FAILURE() << "accepted a program that should fail with: " << needle;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
        << "message: " << e.what() << "\nexpected to contain: " << needle;
  }
}

std::vector<std::vector<int>> island_maps(int world) {
  std::vector<std::vector<int>> maps = {{}};
  if (world % 2 == 0) {
    std::vector<int> halves(world), interleaved(world);
    for (int r = 0; r < world; ++r) {
      halves[r] = r < world / 2 ? 0 : 1;
      interleaved[r] = r % 2;
    }
    maps.push_back(halves);
    maps.push_back(interleaved);
  }
  return maps;
}

TEST(ProgramCheck, EveryBuiltProgramPassesAndPushProgramsReadOnlyLocalMemory) {
  int programs = 0;
  for (int world = 2; world <= kMaxWorld; ++world) {
    const Layout layout = make_layout(1 << 16, world, 4);
    for (const std::vector<int>& islands : island_maps(world)) {
      for (const Tactic& t : buildable_tactics(world, islands)) {
        const Schedule schedule =
            build_schedule(t.algorithm, t.direction, t.staged, world, islands, t.protocol);
        for (int r = 0; r < world; ++r) {
          const Program program = encode_program(schedule, r);
          EXPECT_EQ(program.direction, t.direction);
          const ProgramFacts facts = check_program(program, layout, r);
          EXPECT_EQ(facts.uses_ll, flag_in_data(t.protocol));
          // The push kernel reads every operand as local memory; a pull program only
          // ever writes its own slots.
          if (t.direction == Direction::kPush) {
            EXPECT_FALSE(facts.loads_peer_slots);
          } else {
            EXPECT_FALSE(facts.stores_peer_slots);
          }
          ++programs;
        }
      }
    }
  }
  EXPECT_GT(programs, 300);
}

// A call sent to the fallback runs the program of no steps, which only takes the generation.
TEST(ProgramCheck, TheSkipProgramPassesForEveryRankAndTouchesNothing) {
  for (int world = 2; world <= kMaxWorld; ++world) {
    const Layout layout = make_layout(4096, world, 4);
    for (int r = 0; r < world; ++r) {
      const Program skip = skip_program(r, world);
      EXPECT_EQ(skip.num_steps, 0);
      const ProgramFacts facts = check_program(skip, layout, r);
      EXPECT_FALSE(facts.loads_peer_slots || facts.stores_peer_slots || facts.uses_ll);
    }
  }
  EXPECT_THROW(skip_program(4, 4), std::out_of_range);
}

class ProgramCheckRejects : public ::testing::Test {
 protected:
  ProgramCheckRejects()
      : layout_(make_layout(4096, 4, 4)),
        program_(
            encode_program(build_schedule(Algorithm::kTwoshot, Direction::kPush, true, 4), 1)) {}

  // The first step of `kind` in the program.
  Step& first(StepKind kind) {
    for (int s = 0; s < program_.num_steps; ++s) {
      if (program_.steps[s].kind == kind) return program_.steps[s];
    }
    throw std::logic_error("no such step");
  }

  Layout layout_;
  Program program_;
};

TEST_F(ProgramCheckRejects, NothingInAGoodProgram) {
  const ProgramFacts facts = check_program(program_, layout_, 1);
  EXPECT_FALSE(facts.loads_peer_slots);
  EXPECT_TRUE(facts.stores_peer_slots);
}

TEST_F(ProgramCheckRejects, AnotherRanksProgram) {
  expect_rejects(program_, layout_, 0,
                 "program is for rank 1 of world 4, but this workspace is rank 0 of world 4");
}

TEST_F(ProgramCheckRejects, AProgramForAnotherWorld) {
  expect_rejects(program_, make_layout(4096, 8, 4), 1,
                 "rank 1's program is for world 4 but the workspace layout is for world 8");
}

TEST_F(ProgramCheckRejects, AProgramThatDoesNotFit) {
  program_.num_steps = kMaxSteps + 1;
  expect_rejects(program_, layout_, 1, "rank 1's program has 65 steps; expected 0..64");
}

TEST_F(ProgramCheckRejects, ALayoutMakeLayoutDidNotProduce) {
  Layout zeroed;
  expect_rejects(program_, zeroed, 1, "the workspace layout is not one plan::make_layout()");
}

TEST_F(ProgramCheckRejects, SlotsOutsideTheLayout) {
  first(StepKind::kReduce).dst = BufRef{Space::kSlot, 4, 0, 0};
  expect_rejects(program_, layout_, 1, "slot 0 of rank 4 is outside the layout");
  program_ = encode_program(build_schedule(Algorithm::kTwoshot, Direction::kPush, true, 4), 1);
  first(StepKind::kReduce).dst =
      BufRef{Space::kSlot, 0, static_cast<uint8_t>(layout_.num_slots), 0};
  expect_rejects(program_, layout_, 1, "slot 7 of rank 0 is outside the layout (7 slots");
}

TEST(ProgramCheck, LLProgramsPassAndBadLLRefsAreRefused) {
  const Layout layout = make_layout(4096, 4, 4);
  const Schedule s =
      build_schedule(Algorithm::kOneshot, Direction::kPush, false, 4, {}, Protocol::kLL);
  Program program = encode_program(s, 1);
  const ProgramFacts facts = check_program(program, layout, 1);
  EXPECT_TRUE(facts.uses_ll);
  EXPECT_TRUE(facts.stores_peer_slots);
  EXPECT_FALSE(facts.loads_peer_slots);
  // The final reduce reads rank 1's own LL slots; point one at rank 2's memory.
  Step& sum = program.steps[program.num_steps - 1];
  ASSERT_EQ(sum.srcs[0].space, Space::kLL);
  sum.srcs[0].owner = 2;
  expect_rejects(program, layout, 1, "reads rank 2's LL slot; an LL reader polls only its own");
  program = encode_program(s, 1);
  program.steps[0].dst.writer = 3;  // a delivery that claims another writer
  expect_rejects(program, layout, 1, "an LL destination names rank 3 as its writer");
  program = encode_program(s, 1);
  program.steps[0].dst.slot = static_cast<uint8_t>(layout.num_slots);
  expect_rejects(program, layout, 1, "is outside the layout");
  program = encode_program(s, 1);
  program.direction = Direction::kPull;
  expect_rejects(program, layout, 1, "the ll protocol is push-only");
  // A sum into one of its own LL operands: the executor resets consumed words after the store.
  program = encode_program(s, 1);
  Step& into = program.steps[program.num_steps - 1];
  ASSERT_EQ(into.srcs[0].space, Space::kLL);
  into.dst = into.srcs[0];
  into.dst.writer = 1;
  expect_rejects(program, layout, 1, "which it also reads (operand 0); an LL step consumes");
}

TEST_F(ProgramCheckRejects, AnotherRanksTensors) {
  first(StepKind::kReduce).srcs[0] = BufRef{Space::kInput, 2, 0, 0};
  expect_rejects(program_, layout_, 1,
                 "names rank 2's input/output, but only the executing rank's own tensors are "
                 "local");
}

TEST_F(ProgramCheckRejects, WritesToTheInput) {
  first(StepKind::kReduce).dst = BufRef{Space::kInput, 1, 0, 0};
  expect_rejects(program_, layout_, 1, "writes the caller's input");
}

TEST_F(ProgramCheckRejects, OperandCountsTheKernelDoesNotUnroll) {
  first(StepKind::kReduce).num_srcs = 0;
  expect_rejects(program_, layout_, 1, "0 operands; expected 1..8");
  first(StepKind::kReduce).num_srcs = 9;
  expect_rejects(program_, layout_, 1, "9 operands; expected 1..8");
}

TEST_F(ProgramCheckRejects, ASplitOutsideTheOperandsAndNonZeroReservedBytes) {
  Step& step = first(StepKind::kReduce);
  step.split = step.num_srcs;
  expect_rejects(program_, layout_, 1,
                 "split at operand " + std::to_string(step.num_srcs) + " of " +
                     std::to_string(step.num_srcs) + "; expected 0 (one sum) or");
  step.num_srcs = 4;
  step.srcs[1] = step.srcs[2] = step.srcs[3] = step.srcs[0];
  step.split = 1;
  expect_rejects(program_, layout_, 1, "split at operand 1 of 4; expected 0 (one sum) or 2");
  step.split = 2;
  EXPECT_NO_THROW(check_program(program_, layout_, 1));
  step.split = 0;
  step.reserved[1] = 7;
  expect_rejects(program_, layout_, 1, "reserved bytes are not zero");
}

TEST_F(ProgramCheckRejects, ChunksOutsideTheProgram) {
  first(StepKind::kReduce).chunk = 4;
  expect_rejects(program_, layout_, 1, "chunk 4 of 4");
}

TEST_F(ProgramCheckRejects, FlagsOutsideTheLayout) {
  first(StepKind::kSignal).flag = static_cast<uint8_t>(layout_.num_flags);
  expect_rejects(program_, layout_, 1, "flag 16 of rank");
}

TEST_F(ProgramCheckRejects, AThirdRanksFlag) {
  Step& wait = first(StepKind::kWait);
  int third = 0;
  while (third == program_.rank || third == wait.peer) ++third;
  wait.flag_owner = static_cast<uint8_t>(third);
  expect_rejects(program_, layout_, 1, "the flag must live with this rank or with the step's peer");
}

TEST_F(ProgramCheckRejects, UnknownStepKindsAndDirections) {
  first(StepKind::kSignal).kind = static_cast<StepKind>(9);
  expect_rejects(program_, layout_, 1, "unknown step kind 9");
  program_ = encode_program(build_schedule(Algorithm::kTwoshot, Direction::kPush, true, 4), 1);
  program_.direction = static_cast<Direction>(5);
  expect_rejects(program_, layout_, 1, "unknown direction code 5");
}

TEST_F(ProgramCheckRejects, PushProgramsThatReadPeers) {
  Program pull = encode_program(build_schedule(Algorithm::kOneshot, Direction::kPull, false, 4), 0);
  EXPECT_TRUE(check_program(pull, layout_, 0).loads_peer_slots);
  pull.direction = Direction::kPush;
  expect_rejects(pull, layout_, 0, "program reads a peer's slot but it is a push program");
}

}  // namespace
}  // namespace pcie_ar::plan
