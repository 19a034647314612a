// libFuzzer target: arbitrary bytes into Topology::from_nvidia_smi. A TopologyError is the
// expected way to refuse; any other exception, a crash, a sanitizer report or a broken invariant
// below is a bug. A topology that parses must answer every query without throwing, its islands
// must partition the ranks, and printing its matrix in nvidia-smi's own form must parse back to
// the same links. See tests/fuzz/README.md.
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_check.h"
#include "plan/topology.h"

namespace pcie_ar::plan {
namespace {

using fuzz::check;

// The matrix as `nvidia-smi topo -m` prints it (tabs, X on the diagonal, no affinity columns).
std::string as_nvidia_smi(const Topology& t) {
  std::string out;
  for (int b = 0; b < t.world; ++b) out += "\tGPU" + std::to_string(b);
  out += "\n";
  for (int a = 0; a < t.world; ++a) {
    out += "GPU" + std::to_string(a);
    for (int b = 0; b < t.world; ++b) {
      const size_t ab = static_cast<size_t>(a) * t.world + b;
      const LinkClass c = t.links[ab];
      out += "\t";
      out += c == LinkClass::kNvLink ? "NV" + std::to_string(t.nvlinks[ab])
                                     : std::string(link_class_name(c));
    }
    out += "\n";
  }
  return out;
}

void exercise(const Topology& t) {
  t.validate();
  check(t.world >= 1 && t.world <= kMaxTopologyWorld, "world in 1..kMaxTopologyWorld");
  check(t.source == "nvidia-smi", "source is nvidia-smi");
  check(t.gpu_names.empty(), "the text names no GPUs");
  check(t.numa_node.size() == static_cast<size_t>(t.world), "one NUMA entry per GPU");
  for (const int n : t.numa_node) check(n >= -1, "NUMA ids are -1 or a node");

  const std::vector<int> of = t.island_of();
  const auto groups = t.islands();
  size_t total = 0;
  for (size_t i = 0; i < groups.size(); ++i) {
    check(!groups[i].empty(), "no empty island");
    for (const int r : groups[i]) check(of[r] == static_cast<int>(i), "island_of agrees");
    total += groups[i].size();
  }
  check(total == static_cast<size_t>(t.world), "islands partition the ranks");

  const std::string key = t.table_key();
  check(!key.empty(), "table key is not empty");
  check((key == "nvlink") == t.has_nvlink(), "nvlink key iff an NVLink pair");
  for (const auto& [a, b] : t.nvlink_pairs()) {
    check(a < b && t.link(a, b) == LinkClass::kNvLink, "nvlink pairs are NVLink links");
  }
  const auto why = t.why_not_two_equal_islands();
  check(why.has_value() || groups.size() == 2, "two equal islands means two islands");
  check(!t.describe().empty(), "describe says something");
  check(t.fingerprint("fuzz") != t.fingerprint("fuzz2"), "fingerprint depends on extra");

  // Rank r on GPU world-1-r: a valid subset with the same island sizes.
  std::vector<int> reversed;
  for (int r = t.world - 1; r >= 0; --r) reversed.push_back(r);
  const Topology sub = t.subset(reversed);
  check(sub.islands().size() == groups.size(), "reordering keeps the number of islands");

  // The matrix printed as nvidia-smi prints it parses back to the same links.
  const Topology again = Topology::from_nvidia_smi(as_nvidia_smi(t));
  check(again.links == t.links && again.nvlinks == t.nvlinks, "matrix round-trips");
  check(again.table_key() == key, "table key round-trips");
}

}  // namespace
}  // namespace pcie_ar::plan

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pcie_ar::plan;
  using pcie_ar::fuzz::check;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  Topology t;
  try {
    t = Topology::from_nvidia_smi(text);
  } catch (const TopologyError& e) {
    check(std::string_view(e.what()).substr(0, 14) == "nvidia-smi top",
          "errors say they come from the nvidia-smi parser");
    check(pcie_ar::fuzz::is_clean_utf8(e.what()), "errors are clean UTF-8");
    return 0;
  }
  exercise(t);
  return 0;
}
