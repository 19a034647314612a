#include "plan/program_check.h"

#include <stdexcept>
#include <string>

#include "plan/schedule.h"

namespace pcie_ar::plan {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

void check_header(const Program& program, const Layout& layout, int rank) {
  const std::string who = "rank " + str(program.rank) + "'s program";
  if (program.rank != rank) {
    throw std::invalid_argument("program is for rank " + str(program.rank) + " of world " +
                                str(program.world) + ", but this workspace is rank " + str(rank) +
                                " of world " + str(layout.world));
  }
  if (program.world != layout.world) {
    throw std::invalid_argument(who + " is for world " + str(program.world) +
                                " but the workspace layout is for world " + str(layout.world));
  }
  if (program.num_steps > kMaxSteps) {  // 0: a skip_program()
    throw std::invalid_argument(who + " has " + str(program.num_steps) + " steps; expected 0.." +
                                str(kMaxSteps));
  }
  if (program.num_chunks < 1) throw std::invalid_argument(who + " has zero chunks");
  if (program.direction != Direction::kPush && program.direction != Direction::kPull) {
    throw std::invalid_argument(who + " has unknown direction code " +
                                str(static_cast<int>(program.direction)));
  }
}

// Checks one operand of a kReduce; records whether it touches a peer's slot.
class RefChecker {
 public:
  RefChecker(const Layout& layout, int rank, ProgramFacts& facts)
      : layout_(layout), rank_(rank), facts_(facts) {}

  void operator()(const std::string& at, const BufRef& ref, bool is_dst) const {
    switch (ref.space) {
      case Space::kInput:
        if (is_dst)
          throw std::invalid_argument(at + "writes the caller's input, which is read-only");
        [[fallthrough]];
      case Space::kOutput:
        if (ref.owner != rank_) {
          throw std::invalid_argument(at + "names rank " + str(ref.owner) +
                                      "'s input/output, but only the executing rank's own "
                                      "tensors are local");
        }
        return;
      case Space::kSlot:
        if (ref.owner >= layout_.world || ref.slot >= layout_.num_slots) {
          throw std::invalid_argument(at + "slot " + str(ref.slot) + " of rank " + str(ref.owner) +
                                      " is outside the layout (" + str(layout_.num_slots) +
                                      " slots, world " + str(layout_.world) + ")");
        }
        if (ref.owner != rank_)
          (is_dst ? facts_.stores_peer_slots : facts_.loads_peer_slots) = true;
        return;
      case Space::kLL:
        check_ll(at, ref, is_dst);
        return;
    }
    throw std::invalid_argument(at + "unknown buffer space " + str(static_cast<int>(ref.space)));
  }

 private:
  void check_ll(const std::string& at, const BufRef& ref, bool is_dst) const {
    if (ref.owner >= layout_.world || ref.slot >= layout_.num_slots ||
        ref.writer >= layout_.world) {
      throw std::invalid_argument(at + "LL slot " + str(ref.slot) + " of rank " + str(ref.owner) +
                                  " written by rank " + str(ref.writer) +
                                  " is outside the layout (" + str(layout_.num_slots) +
                                  " slots, world " + str(layout_.world) + ")");
    }
    if (is_dst && ref.writer != rank_) {
      throw std::invalid_argument(at + "an LL destination names rank " + str(ref.writer) +
                                  " as its writer, but rank " + str(rank_) + " writes it");
    }
    if (!is_dst && ref.owner != rank_) {
      throw std::invalid_argument(at + "reads rank " + str(ref.owner) +
                                  "'s LL slot; an LL reader polls only its own memory");
    }
    facts_.uses_ll = true;
    if (is_dst && ref.owner != rank_) facts_.stores_peer_slots = true;
  }

  const Layout& layout_;
  int rank_;
  ProgramFacts& facts_;
};

void check_reduce(const std::string& at, const Step& step, const Program& program,
                  const RefChecker& check_ref) {
  if (step.chunk >= program.num_chunks) {
    throw std::invalid_argument(at + "chunk " + str(step.chunk) + " of " + str(program.num_chunks));
  }
  if (step.num_srcs < 1 || step.num_srcs > kMaxSources) {
    throw std::invalid_argument(at + str(step.num_srcs) + " operands; expected 1.." +
                                str(kMaxSources));
  }
  // 0 (one sum), or the two equal halves of the group's tree: the only split the builders emit
  // and the only one the CUDA executor compiles (its split is a template parameter).
  if (step.split != 0 && 2 * step.split != step.num_srcs) {
    throw std::invalid_argument(at + "split at operand " + str(step.split) + " of " +
                                str(step.num_srcs) + "; expected 0 (one sum) or " +
                                str(step.num_srcs / 2) + " (two equal halves)");
  }
  if (step.reserved[0] != 0 || step.reserved[1] != 0 || step.reserved[2] != 0) {
    throw std::invalid_argument(at + "reserved bytes are not zero");
  }
  check_ref(at, step.dst, true);
  for (int i = 0; i < step.num_srcs; ++i) {
    check_ref(at, step.srcs[i], false);
    // The CUDA executor resets an LL step's consumed words after it stores the result
    // (reduce_slice_ll): a destination among them would be erased.
    if (step.dst.space == Space::kLL && step.srcs[i].space == Space::kLL &&
        step.srcs[i].owner == step.dst.owner && step.srcs[i].slot == step.dst.slot) {
      throw std::invalid_argument(at + "writes LL slot " + str(step.dst.slot) + " of rank " +
                                  str(step.dst.owner) + ", which it also reads (operand " + str(i) +
                                  "); an LL step consumes its operands, so its destination must "
                                  "be another slot");
    }
  }
  if (step.num_dsts == 2) {
    if (step.dst.space == Space::kLL || step.dst2.space == Space::kLL) {
      throw std::invalid_argument(at + "an LL slot cannot be one of two destinations");
    }
    check_ref(at, step.dst2, true);
  } else if (step.num_dsts != 1) {
    throw std::invalid_argument(at + str(step.num_dsts) + " destinations; expected 1 or 2");
  }
}

void check_flag_step(const std::string& at, const Step& step, const Layout& layout, int rank) {
  if (step.peer >= layout.world || step.flag_owner >= layout.world ||
      step.flag >= layout.num_flags) {
    throw std::invalid_argument(at + "peer " + str(step.peer) + ", flag " + str(step.flag) +
                                " of rank " + str(step.flag_owner) + " is outside the layout (" +
                                str(layout.num_flags) + " flags, world " + str(layout.world) + ")");
  }
  if (step.flag_owner != rank && step.flag_owner != step.peer) {
    throw std::invalid_argument(at +
                                "the flag must live with this rank or with the step's peer; a "
                                "third rank's flag cannot be kept generation-fresh by its owner");
  }
}

}  // namespace

ProgramFacts check_program(const Program& program, const Layout& layout, int rank) {
  check_layout(layout);
  check_header(program, layout, rank);
  ProgramFacts facts;
  const RefChecker check_ref(layout, rank, facts);
  for (int s = 0; s < program.num_steps; ++s) {
    const Step& step = program.steps[s];
    const std::string at =
        "rank " + str(rank) + "'s program, step " + str(s) + " (" + describe_step(step) + "): ";
    switch (step.kind) {
      case StepKind::kReduce:
        check_reduce(at, step, program, check_ref);
        break;
      case StepKind::kSignal:
      case StepKind::kWait:
        check_flag_step(at, step, layout, rank);
        break;
      case StepKind::kEpilogue:
        if (s + 1 != program.num_steps) {
          throw std::invalid_argument(at + "the epilogue must be the program's last step");
        }
        if (step.peer != rank || step.flag_owner != rank) {
          throw std::invalid_argument(at + "the epilogue's CTAs meet in rank " + str(rank) +
                                      "'s own memory; peer and flag owner must be " + str(rank));
        }
        facts.has_epilogue = true;
        break;
      default:
        throw std::invalid_argument(at + "unknown step kind " + str(static_cast<int>(step.kind)));
    }
  }
  if (program.direction == Direction::kPull && facts.uses_ll) {
    throw std::invalid_argument("rank " + str(rank) +
                                "'s program is a pull program with LL slots; the ll protocol is "
                                "push-only");
  }
  if (program.direction == Direction::kPush && facts.loads_peer_slots) {
    throw std::invalid_argument("rank " + str(rank) +
                                "'s program reads a peer's slot but it is a push program (push "
                                "kernels read only local memory); build the pull schedule");
  }
  return facts;
}

}  // namespace pcie_ar::plan
