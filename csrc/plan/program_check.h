// What an executor may assume about a step list, checked once when the program is added to a
// workspace (transport::Workspace::add_program), never per call: every buffer, flag and chunk
// a step names exists in the layout, only the executing rank's own tensors are touched, the
// input is never written, and a push program reads no peer memory. The executors (the host
// loop and the CUDA kernel) trust a program that passed, which is what lets them skip bounds
// checks on the hot path.
#pragma once

#include "plan/layout.h"
#include "plan/step.h"

namespace pcie_ar::plan {

// Facts about a checked program that a transport may use (the verifier proves the rest).
struct ProgramFacts {
  bool loads_peer_slots = false;   // some kReduce reads a peer's slot (pull programs only)
  bool stores_peer_slots = false;  // some kReduce writes a peer's slot (push programs)
  bool uses_ll = false;            // some kReduce reads or writes an LL slot
  bool has_epilogue = false;       // the program ends with the fused epilogue
};

// Checks `program` as rank `rank`'s program on a workspace of `layout`. Throws
// std::invalid_argument naming the rank, the step and the bad field, and what was expected:
//   - the layout is one make_layout() produces; the program is for `rank` of layout.world;
//   - 0..kMaxSteps steps (none: plan::skip_program()), at least one chunk, a known direction;
//   - kReduce: chunk < num_chunks, 1..kMaxSources operands, a split of 0 or num_srcs / 2 (two
//     equal halves, num_srcs even), zero reserved bytes, the destination is not the input,
//     inputs/outputs are `rank`'s own, slots lie inside the layout; an LL operand is `rank`'s
//     own LL slot (readers poll only their own memory), an LL destination names `rank` as its
//     writer;
//   - kSignal/kWait: peer, flag owner and flag inside the layout, and the flag lives with
//     `rank` or with the step's peer;
//   - kEpilogue: only as the last step (the executors run it once every slice is done);
//   - a push program never reads a peer's slot (push kernels read only local memory), and a
//     pull program has no LL operand (LL is push-only).
ProgramFacts check_program(const Program& program, const Layout& layout, int rank);

}  // namespace pcie_ar::plan
