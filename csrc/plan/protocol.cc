#include "plan/protocol.h"

#include <cstdio>
#include <string>

namespace pcie_ar::plan {
namespace {

using ull = unsigned long long;

std::string after_text(double timeout_s) {
  char after[64] = "";
  if (timeout_s > 0) std::snprintf(after, sizeof(after), " after %g s", timeout_s);
  return after;
}

std::string describe_mismatch(const Diagnostic& d) {
  // A peer already past this generation means an earlier call went wrong on some rank.
  const bool out_of_step = d.gen_seen != d.gen_expected;
  char peer_at[64] = "";
  if (out_of_step) {
    std::snprintf(peer_at, sizeof(peer_at), "(already at generation %llu) ",
                  static_cast<ull>(d.gen_seen));
  }
  char buf[512];
  std::snprintf(buf, sizeof(buf),
                "rank %u and rank %u disagree on the call of generation %llu (step %u, stage %u, "
                "block %u): rank %u has numel %u signature 0x%08x, rank %u %shas numel %u "
                "signature 0x%08x; %s",
                d.rank, d.peer, static_cast<ull>(d.gen_expected), d.step, d.stage, d.block, d.rank,
                d.numel, d.signature, d.peer, peer_at, d.peer_numel, d.peer_signature,
                out_of_step ? "the ranks fell out of step (an earlier call failed or took a "
                              "different path on one of them)"
                            : "every rank must all-reduce the same shape and dtype in the same "
                              "order");
  return buf;
}

}  // namespace

std::string describe_failure(const Diagnostic& d, double timeout_s) {
  char buf[512];
  switch (static_cast<FailureKind>(d.kind)) {
    case FailureKind::kTimeout:
      std::snprintf(buf, sizeof(buf),
                    "rank %u timed out%s at step %u (stage %u, block %u) waiting for rank %u to "
                    "raise flag %u of rank %u: generation seen %llu, expected %llu; rank %u never "
                    "arrived (dead, hung, or it took a different path for this call)",
                    d.rank, after_text(timeout_s).c_str(), d.step, d.stage, d.block, d.peer, d.flag,
                    d.flag_owner, static_cast<ull>(d.gen_seen), static_cast<ull>(d.gen_expected),
                    d.peer);
      return buf;
    case FailureKind::kMismatch:
      return describe_mismatch(d);
    case FailureKind::kLLTimeout:
      std::snprintf(buf, sizeof(buf),
                    "rank %u timed out%s at step %u (stage %u, block %u) waiting for rank %u's "
                    "data in LL slot %u of generation %llu: tag seen 0x%08x, expected 0x%08x; "
                    "rank %u never arrived (dead, hung, or it took a different path for this "
                    "call)",
                    d.rank, after_text(timeout_s).c_str(), d.step, d.stage, d.block, d.peer, d.flag,
                    static_cast<ull>(d.gen_expected), static_cast<unsigned>(d.gen_seen),
                    d.peer_signature, d.peer);
      return buf;
    case FailureKind::kLLMismatch:
      std::snprintf(buf, sizeof(buf),
                    "rank %u and rank %u disagree on the call of generation %llu (step %u, stage "
                    "%u, block %u): rank %u's data in LL slot %u is tagged 0x%08x where rank %u's "
                    "call (numel %u signature 0x%08x) expects 0x%08x; rank %u entered this "
                    "generation with a different shape, dtype or tactic, or the ranks fell out "
                    "of step",
                    d.rank, d.peer, static_cast<ull>(d.gen_expected), d.step, d.stage, d.block,
                    d.peer, d.flag, static_cast<unsigned>(d.gen_seen), d.rank, d.numel, d.signature,
                    d.peer_signature, d.peer);
      return buf;
    case FailureKind::kInterrupted:
      if (d.peer == kUnknownRank) {
        std::snprintf(buf, sizeof(buf),
                      "rank %u was interrupted (a signal, such as Ctrl-C) while waiting in the "
                      "group's own collective (the fallback of a call the kernels declined), and "
                      "abandoned the call mid-way: its peers time out waiting for it",
                      d.rank);
        return buf;
      }
      std::snprintf(buf, sizeof(buf),
                    "rank %u was interrupted (a signal, such as Ctrl-C) at step %u (stage %u, "
                    "block %u) while waiting for rank %u, and abandoned the call mid-way: its "
                    "peers time out waiting for it",
                    d.rank, d.step, d.stage, d.block, d.peer);
      return buf;
    case FailureKind::kFallbackTimeout:
      std::snprintf(buf, sizeof(buf),
                    "rank %u timed out%s in the group's own collective (the fallback of a call the "
                    "kernels declined): a peer took the kernels for this call (the ranks disagree "
                    "about it), is slower than PCIE_ALLREDUCE_TIMEOUT_S, or is gone",
                    d.rank, after_text(timeout_s).c_str());
      return buf;
    default:
      return "no failure recorded";
  }
}

}  // namespace pcie_ar::plan
