// The flag protocol both transports speak. Flags are 32-bit generations that only grow and are
// compared modulo 2^32, so they never need a reset (CUDA-graph replay is safe) and survive the
// wrap. Each flag has exactly one writer per generation; data slots and flags are double
// buffered by generation parity, so a fast rank never overwrites what a slow peer still reads.
#pragma once

#include <cstdint>
#include <string>

#include "plan/host_device.h"
#include "plan/step.h"

namespace pcie_ar::plan {

// One flag. The writer stores numel and signature, then release-stores gen; the reader
// acquire-loads gen and then checks that the peer entered this generation with the same call.
struct alignas(16) FlagWord {
  uint32_t gen;
  uint32_t numel;
  uint32_t signature;
  uint32_t writer;  // rank that wrote it, for diagnostics
};
static_assert(sizeof(FlagWord) == 16);

// True when `seen` is at or past `expected`, modulo 2^32.
PCIE_AR_HD bool gen_reached(uint32_t seen, uint32_t expected) {
  return static_cast<int32_t>(seen - expected) >= 0;
}

PCIE_AR_HD int gen_parity(uint32_t gen) { return static_cast<int>(gen & 1u); }

enum class FailureKind : uint32_t { kNone = 0, kTimeout = 1, kMismatch = 2 };

// What an executor records before it fails, where the host can read it (mapped host memory on
// the GPU). All fields are plain words so a kernel can write them without a format.
struct alignas(16) Diagnostic {
  uint32_t kind;  // FailureKind
  uint32_t rank;
  uint32_t peer;
  uint32_t step;
  uint32_t stage;
  uint32_t block;
  uint32_t flag;
  uint32_t flag_owner;
  uint32_t gen_seen;
  uint32_t gen_expected;
  uint32_t numel;           // this rank's call
  uint32_t signature;       // this rank's call
  uint32_t peer_numel;      // what the peer's flag carried
  uint32_t peer_signature;  // what the peer's flag carried
  uint32_t reserved[2];
};
static_assert(sizeof(Diagnostic) == 64);

// Where one executor (a CTA on the GPU, a slice loop on the host) stands in a call: the part
// of a diagnostic that does not depend on the step that failed.
struct CallPosition {
  uint32_t rank;
  uint32_t block;
  uint32_t gen;        // the generation this call runs
  uint32_t numel;      // this rank's call
  uint32_t signature;  // this rank's call (call_signature)
};

// What a wait saw in the flag it was polling.
struct FlagSeen {
  uint32_t gen;
  uint32_t numel = 0;      // mismatch only: what the peer's flag carried
  uint32_t signature = 0;  // mismatch only
};

// The record both executors write before they fail, so a host timeout and a trapped kernel
// read the same to the user.
PCIE_AR_HD Diagnostic make_diagnostic(FailureKind kind, const CallPosition& at, int step_index,
                                      const Step& step, const FlagSeen& seen) {
  Diagnostic d{};
  d.kind = static_cast<uint32_t>(kind);
  d.rank = at.rank;
  d.peer = step.peer;
  d.step = static_cast<uint32_t>(step_index);
  d.stage = step.stage;
  d.block = at.block;
  d.flag = step.flag;
  d.flag_owner = step.flag_owner;
  d.gen_seen = seen.gen;
  d.gen_expected = at.gen;
  d.numel = at.numel;
  d.signature = at.signature;
  d.peer_numel = seen.numel;
  d.peer_signature = seen.signature;
  return d;
}

// True when a wait that reached its generation must still fail: the peer entered it with a
// different call, or it is already past this generation (the ranks fell out of step).
PCIE_AR_HD bool is_mismatch(const CallPosition& at, const FlagSeen& seen) {
  return seen.numel != at.numel || seen.signature != at.signature || seen.gen != at.gen;
}

// Flag refresh, the end of every call (both executors): every generation counter of the
// finishing block's residue class (blocks b, b + blocks, b + 2*blocks, ... < max_blocks) takes
// this call's generation, so the next call starts from the same value whatever its block
// count; and every OWN flag of this parity in those blocks takes it too. A flag that this
// call's schedule or block count left unused would otherwise fall 2^31 generations behind
// during a long run of other calls and then read as "reached" by the modulo-2^32 compare.
// Safe because each flag of ours is raised or awaited by this rank (check_program() requires
// a flag to live with the step's rank or its peer), so every write this call makes to it has
// landed, and no peer writes this parity again before it has seen this rank start its next
// call.

// One sentence for an error message: who failed, where, waiting for whom, what was seen and
// what was expected, e.g. "rank 0 timed out after 30 s at step 4 (stage 1, block 0) waiting for
// rank 2 to raise flag 9: generation seen 6, expected 7". A mismatch names both calls, and
// says so when the peer is already at a later generation (the ranks fell out of step).
std::string describe_failure(const Diagnostic& diagnostic, double timeout_s = 0.0);

}  // namespace pcie_ar::plan
