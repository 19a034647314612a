#include "plan/tactic.h"

#include <string>

namespace pcie_ar::plan {

int dtype_bytes(DType dtype) { return dtype == DType::kFP32 ? 4 : 2; }

bool is_island_algorithm(Algorithm algorithm) {
  return algorithm == Algorithm::kIslandOneshot || algorithm == Algorithm::kIslandTwoshot;
}

Tactic two_shot_form(Tactic tactic, Collective collective) {
  if (tactic.algorithm == Algorithm::kOneshot) tactic.algorithm = Algorithm::kTwoshot;
  if (tactic.algorithm == Algorithm::kIslandOneshot) tactic.algorithm = Algorithm::kIslandTwoshot;
  if (collective == Collective::kAllGather && tactic.protocol == Protocol::kLamport) {
    tactic.protocol = Protocol::kLL;
  }
  return tactic;
}

std::string tactic_label(const Tactic& tactic) {
  std::string label(algorithm_name(tactic.algorithm));
  label += '/';
  label += direction_name(tactic.direction);
  label += tactic.staged ? "/staged/" : "/unstaged/";
  label += protocol_name(tactic.protocol);
  label += "/b" + std::to_string(tactic.blocks) + "/t" + std::to_string(tactic.threads);
  return label;
}

uint32_t call_signature(DType dtype, const Tactic& tactic, bool fused, Collective collective) {
  // Packed rather than hashed so a diagnostic can be decoded by eye. Threads are left out:
  // they change nothing a peer can observe. Blocks are in: they decide the slice boundaries.
  uint32_t kind = fused ? 0xF5u : 0xA5u;
  if (collective == Collective::kReduceScatter) kind = 0xB5u;
  if (collective == Collective::kAllGather) kind = 0xC5u;
  return (kind << 24) | (static_cast<uint32_t>(dtype) << 20) |
         (static_cast<uint32_t>(tactic.algorithm) << 16) |
         (static_cast<uint32_t>(tactic.direction) << 13) | (tactic.staged ? 1u << 12 : 0u) |
         (static_cast<uint32_t>(tactic.protocol) << 14) |
         (static_cast<uint32_t>(tactic.blocks) & 0xFFFu);
}

}  // namespace pcie_ar::plan
