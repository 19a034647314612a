#include "plan/tactic.h"

#include <string>

namespace pcie_ar::plan {

int dtype_bytes(DType dtype) { return dtype == DType::kFP32 ? 4 : 2; }

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return "bf16";
    case DType::kFP16:
      return "fp16";
    case DType::kFP32:
      return "fp32";
  }
  return "?";
}

std::string_view algorithm_name(Algorithm algorithm) {
  switch (algorithm) {
    case Algorithm::kOneshot:
      return "oneshot";
    case Algorithm::kTwoshot:
      return "twoshot";
    case Algorithm::kIslandOneshot:
      return "island_oneshot";
    case Algorithm::kIslandTwoshot:
      return "island_twoshot";
  }
  return "?";
}

std::string_view direction_name(Direction direction) {
  return direction == Direction::kPush ? "push" : "pull";
}

std::string_view protocol_name(Protocol protocol) {
  return protocol == Protocol::kLL ? "ll" : "flag";
}

bool is_island_algorithm(Algorithm algorithm) {
  return algorithm == Algorithm::kIslandOneshot || algorithm == Algorithm::kIslandTwoshot;
}

std::optional<DType> parse_dtype(std::string_view name) {
  for (DType d : kAllDTypes) {
    if (dtype_name(d) == name) return d;
  }
  return std::nullopt;
}

std::optional<Algorithm> parse_algorithm(std::string_view name) {
  for (Algorithm a : kAllAlgorithms) {
    if (algorithm_name(a) == name) return a;
  }
  return std::nullopt;
}

std::optional<Direction> parse_direction(std::string_view name) {
  if (name == "push") return Direction::kPush;
  if (name == "pull") return Direction::kPull;
  return std::nullopt;
}

std::optional<Protocol> parse_protocol(std::string_view name) {
  if (name == "flag") return Protocol::kFlag;
  if (name == "ll") return Protocol::kLL;
  return std::nullopt;
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

uint32_t call_signature(DType dtype, const Tactic& tactic) {
  // Packed rather than hashed so a diagnostic can be decoded by eye. Threads are left out:
  // they change nothing a peer can observe. Blocks are in: they decide the slice boundaries.
  return (0xA5u << 24) | (static_cast<uint32_t>(dtype) << 20) |
         (static_cast<uint32_t>(tactic.algorithm) << 16) |
         (static_cast<uint32_t>(tactic.direction) << 13) | (tactic.staged ? 1u << 12 : 0u) |
         (static_cast<uint32_t>(tactic.protocol) << 14) |
         (static_cast<uint32_t>(tactic.blocks) & 0xFFFu);
}

}  // namespace pcie_ar::plan
