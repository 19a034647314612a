// Topology: which GPUs talk over which kind of link, and the islands that follow from it.
//
// On a PCIe-only host the scarce resource is the link between CPU sockets (SYS in
// `nvidia-smi topo -m`). An island is a set of GPUs that reach each other without crossing
// it; island algorithms cross it once. Islands are always DERIVED from the link classes
// (connected components of "better than SYS"), never assumed from rank numbering: BIOSes
// and CUDA_VISIBLE_DEVICES interleave sockets freely.
//
// A Topology is plain data. The factories (flat, from_islands, from_nvidia_smi) return only
// topologies that pass validate(); every query on a hand-built one validates it first and
// throws TopologyError instead of reading out of bounds.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "plan/names.h"

namespace pcie_ar::plan {

// Link classes of `nvidia-smi topo -m`, ordered best to worst. Values cross into tuning
// files and Python: explicit and append-only.
enum class LinkClass : uint8_t {
  kSelf = 0,    // X: a GPU and itself
  kNvLink = 1,  // NV#: a bonded set of # NVLinks
  kPix = 2,     // at most one PCIe bridge (a shared switch)
  kPxb = 3,     // several PCIe bridges, no host bridge
  kPhb = 4,     // through one PCIe host bridge (the CPU)
  kNode = 5,    // between host bridges within one NUMA node
  kSys = 6,     // across the SMP interconnect between sockets (legacy name: SOC)
};

// The names `nvidia-smi topo -m` prints (SOC: drivers before SYS); an NVLink cell is "NV<count>".
inline constexpr auto kLinkClassNames =
    name_table<LinkClass>("link class", {{LinkClass::kSelf, "X"},
                                         {LinkClass::kNvLink, "NV"},
                                         {LinkClass::kPix, "PIX"},
                                         {LinkClass::kPxb, "PXB"},
                                         {LinkClass::kPhb, "PHB"},
                                         {LinkClass::kNode, "NODE"},
                                         {LinkClass::kSys, "SYS", {"SOC"}}});

// "X", "NV", "PIX", "PXB", "PHB", "NODE", "SYS" ("?" for a value outside the enum).
inline std::string_view link_class_name(LinkClass c) { return kLinkClassNames.name_of(c); }

// Every malformed input and every inconsistent Topology is reported with this; what() says
// what was found and what was expected (for nvidia-smi text: the 1-based line number too).
class TopologyError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

inline constexpr int kMaxTopologyWorld = 64;

struct Topology {
  int world = 0;
  std::vector<LinkClass> links;        // world*world, row-major, kSelf exactly on the diagonal
  std::vector<int> nvlinks;            // world*world, the # of NV# (> 0 iff the class is kNvLink)
  std::vector<std::string> gpu_names;  // empty, or one per GPU
  std::vector<int> numa_node;          // empty, or one per GPU (NUMA Affinity column; -1 unknown)
  std::string source;                  // "islands", "nvidia-smi", "flat"

  // Throws std::out_of_range unless 0 <= a, b < world (and links has world*world entries).
  LinkClass link(int a, int b) const;

  // Throws TopologyError naming the first inconsistency: world outside 1..kMaxTopologyWorld,
  // a vector of the wrong size, kSelf off the diagonal or missing from it, an asymmetric
  // pair, an NV count that disagrees with the class.
  void validate() const;

  // Islands: connected components of "link class better than SYS" (NV#, PIX, PXB, PHB and
  // NODE join; SYS separates). Islands are numbered by their lowest rank.
  std::vector<int> island_of() const;                     // rank -> island id
  std::vector<std::vector<int>> islands() const;          // sorted ranks per island, by lowest rank
  bool has_nvlink() const;                                // any pair linked by NVLink
  std::vector<std::pair<int, int>> nvlink_pairs() const;  // (a, b) with a < b, by a then b

  // nullopt when there are exactly two islands of equal size >= 2 (what island algorithms
  // need), else the reason, e.g. "islands are uneven: {0,1,2} and {3,4,5,6,7}" or
  // "one island: no socket boundary to respect".
  std::optional<std::string> why_not_two_equal_islands() const;

  // The key the tuning table matches on: "nvlink" (any NVLink pair, whatever the islands),
  // "flat" (one island), "islands-<k>x<s>" (k equal islands of s GPUs: "islands-2x4",
  // "islands-4x2"), "islands-<a>+<b>+..." (uneven; sizes ascending: "islands-3+5").
  std::string table_key() const;

  // A stable, file-name-safe cache key: "<table_key>-w<world>-<16 lowercase hex>", where any
  // character of the key outside [a-z0-9-] becomes '-' ("islands-3-5-w8-..."), and the hex
  // is the 64-bit FNV-1a of a versioned canonical text of world, GPU names, every link class
  // and NV count, the island map and `extra` (e.g. driver and library versions). A pure
  // function of those inputs: the same on every run and machine; any difference changes it.
  // NUMA ids and `source` are not part of it.
  std::string fingerprint(std::string_view extra = {}) const;

  // A matrix like nvidia-smi's (plus NUMA and name columns when known), then a line
  // "islands: {0,1,2,3} {4,5,6,7}".
  std::string describe() const;

  // Every pair linked by `cls`; world 1..kMaxTopologyWorld. `cls` must join GPUs into one
  // island (not kSelf, not kSys: use from_islands for a socket split). kNvLink gets NV1.
  static Topology flat(int world, LinkClass cls = LinkClass::kPhb);

  // What a process group sees: rank r runs on GPU gpus[r] of this topology, so the result has
  // gpus.size() ranks whose links, names and NUMA nodes are those of their GPUs. Two ranks on
  // one GPU (tests share a GPU between processes) are joined as PIX: one island, no NVLink.
  // Throws TopologyError for an empty list or a GPU index outside 0..world-1.
  Topology subset(const std::vector<int>& gpus) const;

  // NODE inside an island, SYS between islands. The islands must partition 0..n-1 exactly
  // (n = the total number of entries, 1..kMaxTopologyWorld); otherwise TopologyError says
  // which rank is duplicated, missing or out of range. Their order does not matter.
  static Topology from_islands(const std::vector<std::vector<int>>& islands);

  // Parses the text of `nvidia-smi topo -m` (drivers from the SOC era to today): the header
  // row (GPU0..GPUn-1, then other devices such as NIC0 or mlx5_0, then "CPU Affinity",
  // "NUMA Affinity", "GPU NUMA ID" when present); one row per GPU, in order; rows of other
  // devices (skipped); the legend after the first blank line (ignored). Tabs or spaces,
  // ANSI escape codes, trailing whitespace and CRLF are accepted. The matrix must be
  // symmetric with X exactly on the diagonal. gpu_names stays empty (the text has none);
  // numa_node has one entry per GPU, -1 where the column is absent or not a number.
  // Throws TopologyError("nvidia-smi topo line <n>: <what was expected>, found <what>").
  static Topology from_nvidia_smi(std::string_view text);
};

}  // namespace pcie_ar::plan
