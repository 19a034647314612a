// The per-rank step list: a schedule compiled for one rank into a small POD array. Both
// transports execute exactly this array, so the schedule the verifier proved on the CPU is the
// schedule the GPU runs. Values are explicit and append-only: they cross into kernels.
#pragma once

#include <cstdint>

#include "plan/host_device.h"
#include "plan/tactic.h"

namespace pcie_ar::plan {

inline constexpr int kMaxWorld = 8;
inline constexpr int kMaxSources = kMaxWorld;  // a reduce sums at most one operand per rank
inline constexpr int kMaxSteps = 64;           // per rank; builders stay far below

// Where a buffer lives. Input and output are the executing rank's own tensors (peers never
// see them); slots are regions of a rank's workspace that peers map. An LL slot holds data in
// the flag-in-data format (plan/protocol.h): a reduce that writes one tags every word with the
// call, and a reduce that reads one waits, vector by vector, until the tags say the data of
// this call has landed, then resets them. Only the owner reads its LL slots (it polls its own
// memory), and each is read exactly once per write.
enum class Space : uint8_t { kInput = 0, kOutput = 1, kSlot = 2, kLL = 3 };
inline constexpr auto kSpaceNames = name_table<Space>("space", {{Space::kInput, "input"},
                                                                {Space::kOutput, "output"},
                                                                {Space::kSlot, "slot"},
                                                                {Space::kLL, "ll"}});

struct BufRef {
  Space space = Space::kInput;
  uint8_t owner = 0;   // rank whose memory holds the buffer
  uint8_t slot = 0;    // slot index (Space::kSlot and Space::kLL)
  uint8_t writer = 0;  // Space::kLL: the rank that writes it (named in a timeout)
};

enum class StepKind : uint8_t {
  kReduce = 0,  // dst[chunk] (and dst2[chunk]) = the sum of srcs[chunk] (see Step::split); LL
                // sources are awaited per vector, an LL destination is written tagged
  kSignal = 1,  // release-store this generation into flag `flag` of rank `flag_owner`
  kWait = 2,    // acquire-wait until flag `flag` of rank `flag_owner` reaches this generation
  // The fused epilogue (plan/epilogue.h), a program's last step: once every chunk of this rank's
  // output holds the sum (all of the rank's CTAs have passed it: a barrier on its own memory),
  // each row becomes residual_out = sum + residual and output = rms_norm(residual_out) * weight.
  // Reads and writes only this rank's own tensors; no peer sees it. peer and flag_owner are the
  // rank (its CTAs meet on its own generation counters, not on a flag).
  kEpilogue = 3,
};
inline constexpr auto kStepKindNames =
    name_table<StepKind>("step kind", {{StepKind::kReduce, "reduce"},
                                       {StepKind::kSignal, "signal"},
                                       {StepKind::kWait, "wait"},
                                       {StepKind::kEpilogue, "epilogue"}});

struct Step {
  StepKind kind = StepKind::kReduce;
  uint8_t stage = 0;       // stage of the schedule this step belongs to
  uint8_t chunk = 0;       // kReduce: chunk index (of Program::num_chunks)
  uint8_t num_srcs = 0;    // kReduce: operands in srcs, 1 = plain copy
  uint8_t peer = 0;        // kSignal: rank being told; kWait: rank expected to write the flag
  uint8_t flag_owner = 0;  // kSignal/kWait: rank whose workspace holds the flag
  uint8_t flag = 0;        // kSignal/kWait: flag index in the owner's per-block flag array
  uint8_t num_dsts = 1;    // kReduce: 1, or 2 when dst2 receives the same result (a fused
                           // forwarding copy, see fuse_forwarding_copies()); never LL
  // kReduce: how the sum is associated. Every sum of two or more operands is formed in fp32 in
  // operand order from +0 (((+0 + a0) + a1) + ...), so no sum is ever -0, and rounded once to the
  // dtype; one operand is a copy and moves bits. split = 0: one such sum of all srcs. split = s
  // (1 <= s < num_srcs): the sum of two rounded sums, srcs[0, s) and srcs[s, num_srcs) — the
  // group's canonical tree (plan::canonical_groups) computed by a tactic that does not store
  // the island partials, in registers, with the same roundings as one that does.
  uint8_t split = 0;
  uint8_t reserved[3] = {};  // zero; keeps Step a whole number of 32-bit words
  BufRef dst;
  BufRef srcs[kMaxSources];
  BufRef dst2;  // kReduce with num_dsts == 2: the second destination, same chunk
};

// A copy that may share its load with the copies after it: one source, this rank's input or
// output (never an LL slot: each is read once per write); one destination, a data or LL slot. The
// CUDA executor runs a run of them as one pass (run_fanout: one load, a store per destination) and
// the cost model prices them that way.
PCIE_AR_HD bool is_fanout_copy(const Step& s) {
  return s.kind == StepKind::kReduce && s.num_srcs == 1 && s.num_dsts == 1 &&
         (s.srcs[0].space == Space::kInput || s.srcs[0].space == Space::kOutput) &&
         (s.dst.space == Space::kSlot || s.dst.space == Space::kLL);
}

// True when `next` joins the run of copies `first` starts: the same chunk of the same tensor,
// to a slot of the same kind.
PCIE_AR_HD bool continues_fanout(const Step& first, const Step& next) {
  return is_fanout_copy(first) && is_fanout_copy(next) && next.chunk == first.chunk &&
         next.srcs[0].space == first.srcs[0].space && next.dst.space == first.dst.space;
}

// How a program's LL slots hold data (plan/protocol.h): {payload, tag} words (the ll protocol), or
// the payload itself with one tagged header per slice (lamport). One format per program.
enum class LLFormat : uint8_t { kTagged = 0, kDense = 1 };

struct Program {
  uint8_t rank = 0;
  uint8_t world = 0;
  uint8_t num_chunks = 1;
  uint8_t num_stages = 0;
  uint16_t num_steps = 0;
  Direction direction = Direction::kPush;  // push programs never read a peer's slot
  LLFormat ll_format = LLFormat::kTagged;
  Step steps[kMaxSteps];
};

}  // namespace pcie_ar::plan
