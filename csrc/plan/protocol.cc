#include "plan/protocol.h"

#include <cstdio>
#include <string>

namespace pcie_ar::plan {

std::string describe_failure(const Diagnostic& d, double timeout_s) {
  char buf[512];
  const auto kind = static_cast<FailureKind>(d.kind);
  if (kind == FailureKind::kTimeout) {
    char after[64] = "";
    if (timeout_s > 0) std::snprintf(after, sizeof(after), " after %g s", timeout_s);
    std::snprintf(buf, sizeof(buf),
                  "rank %u timed out%s at step %u (stage %u, block %u) waiting for rank %u to "
                  "raise flag %u of rank %u: generation seen %u, expected %u; rank %u never "
                  "arrived (dead, hung, or it took a different path for this call)",
                  d.rank, after, d.step, d.stage, d.block, d.peer, d.flag, d.flag_owner, d.gen_seen,
                  d.gen_expected, d.peer);
  } else if (kind == FailureKind::kMismatch && d.gen_seen != d.gen_expected) {
    std::snprintf(buf, sizeof(buf),
                  "rank %u and rank %u disagree at step %u (stage %u, block %u): rank %u runs "
                  "generation %u with numel %u signature 0x%08x, but rank %u is already at "
                  "generation %u with numel %u signature 0x%08x: the ranks fell out of step "
                  "(an earlier call failed or took a different path on one of them)",
                  d.rank, d.peer, d.step, d.stage, d.block, d.rank, d.gen_expected, d.numel,
                  d.signature, d.peer, d.gen_seen, d.peer_numel, d.peer_signature);
  } else if (kind == FailureKind::kMismatch) {
    std::snprintf(buf, sizeof(buf),
                  "rank %u and rank %u disagree on the call of generation %u (step %u, stage %u, "
                  "block %u): rank %u has numel %u signature 0x%08x, rank %u has numel %u "
                  "signature 0x%08x; every rank must all-reduce the same shape and dtype in the "
                  "same order",
                  d.rank, d.peer, d.gen_expected, d.step, d.stage, d.block, d.rank, d.numel,
                  d.signature, d.peer, d.peer_numel, d.peer_signature);
  } else {
    std::snprintf(buf, sizeof(buf), "no failure recorded");
  }
  return buf;
}

}  // namespace pcie_ar::plan
