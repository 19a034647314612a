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
  } else if (kind == FailureKind::kMismatch) {
    // A peer already past this generation means an earlier call went wrong on some rank.
    const bool out_of_step = d.gen_seen != d.gen_expected;
    char peer_at[64] = "";
    if (out_of_step)
      std::snprintf(peer_at, sizeof(peer_at), "(already at generation %u) ", d.gen_seen);
    std::snprintf(buf, sizeof(buf),
                  "rank %u and rank %u disagree on the call of generation %u (step %u, stage %u, "
                  "block %u): rank %u has numel %u signature 0x%08x, rank %u %shas numel %u "
                  "signature 0x%08x; %s",
                  d.rank, d.peer, d.gen_expected, d.step, d.stage, d.block, d.rank, d.numel,
                  d.signature, d.peer, peer_at, d.peer_numel, d.peer_signature,
                  out_of_step ? "the ranks fell out of step (an earlier call failed or took a "
                                "different path on one of them)"
                              : "every rank must all-reduce the same shape and dtype in the same "
                                "order");
  } else {
    std::snprintf(buf, sizeof(buf), "no failure recorded");
  }
  return buf;
}

}  // namespace pcie_ar::plan
