// Topology: islands derived from link classes, the nvidia-smi parser on realistic output
// (tests/cpp/data/*.txt, modelled on drivers from the SOC era to 580), its error messages,
// and the fingerprint that keys the tuning cache.
#include <gtest/gtest.h>

#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "plan/topology.h"

namespace pcie_ar::plan {
namespace {

using Islands = std::vector<std::vector<int>>;

std::string read_fixture(const std::string& name) {
  const std::string path = std::string(PCIE_AR_TEST_DATA_DIR) + "/" + name;
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot open fixture " << path;
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

Topology parse_fixture(const std::string& name) {
  return Topology::from_nvidia_smi(read_fixture(name));
}

// The message of the TopologyError that parsing `text` throws ("" and a failure if none).
std::string parse_error(const std::string& text) {
  try {
    Topology::from_nvidia_smi(text);
  } catch (const TopologyError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a TopologyError for:\n" << text;
  return {};
}

std::string from_islands_error(const Islands& islands) {
  try {
    Topology::from_islands(islands);
  } catch (const TopologyError& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected a TopologyError";
  return {};
}

// A small, well-formed 4-GPU, two-socket output; the malformed cases each change one line.
std::vector<std::string> base_lines() {
  return {
      "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID",  // line 1
      "GPU0\t X \tNODE\tSYS\tSYS\t0-15,32-47\t0\t\tN/A",                     // line 2
      "GPU1\tNODE\t X \tSYS\tSYS\t0-15,32-47\t0\t\tN/A",                     // line 3
      "GPU2\tSYS\tSYS\t X \tNODE\t16-31,48-63\t1\t\tN/A",                    // line 4
      "GPU3\tSYS\tSYS\tNODE\t X \t16-31,48-63\t1\t\tN/A",                    // line 5
      "",                                                                    // line 6
      "Legend:",                                                             // line 7
      "",
      "  X    = Self",
      "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes",
  };
}

std::string join(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& line : lines) out += line + "\n";
  return out;
}

// base_lines() with 1-based line `line_no` replaced.
std::string base_with(int line_no, const std::string& replacement) {
  auto lines = base_lines();
  lines.at(line_no - 1) = replacement;
  return join(lines);
}

// What a terminal capture or a web copy does to the text.
std::string expand_tabs(const std::string& text) {
  std::string out;
  size_t column = 0;
  for (const char c : text) {
    if (c == '\t') {
      do {
        out += ' ';
        ++column;
      } while (column % 8 != 0);
    } else {
      out += c;
      column = c == '\n' ? 0 : column + 1;
    }
  }
  return out;
}

std::string to_crlf_with_trailing_space(const std::string& text) {
  std::string out;
  for (const char c : text) out += c == '\n' ? std::string("  \r\n") : std::string(1, c);
  return out;
}

// Underlines the header and bolds the row labels, as nvidia-smi does on a terminal.
std::string with_ansi(const std::string& text) {
  std::string out;
  std::istringstream in(text);
  bool header = true;
  for (std::string line; std::getline(in, line); header = false) {
    const size_t tab = line.find('\t');
    if (header) {
      line = "\x1b[4m" + line + "\x1b[0m";
    } else if (tab != std::string::npos &&
               (line.rfind("GPU", 0) == 0 || line.rfind("NIC", 0) == 0)) {
      line = "\x1b[1m" + line.substr(0, tab) + "\x1b[0m" + line.substr(tab);
    }
    out += line + "\n";
  }
  return out;
}

bool same_matrix(const Topology& a, const Topology& b) {
  return a.world == b.world && a.links == b.links && a.nvlinks == b.nvlinks &&
         a.numa_node == b.numa_node;
}

// ------------------------------------------------------------------ realistic hosts

TEST(TopologyParse, TwoSocketsWithoutSwitchGiveTwoIslandsOfFour) {
  const Topology t = parse_fixture("two_socket_8gpu.txt");
  EXPECT_EQ(t.world, 8);
  EXPECT_EQ(t.source, "nvidia-smi");
  EXPECT_EQ(t.islands(), (Islands{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(t.island_of(), (std::vector<int>{0, 0, 0, 0, 1, 1, 1, 1}));
  EXPECT_EQ(t.table_key(), "islands-2x4");
  EXPECT_EQ(t.why_not_two_equal_islands(), std::nullopt);
  EXPECT_FALSE(t.has_nvlink());
  EXPECT_EQ(t.link(0, 1), LinkClass::kNode);
  EXPECT_EQ(t.link(2, 3), LinkClass::kPhb);
  EXPECT_EQ(t.link(3, 4), LinkClass::kSys);
  EXPECT_EQ(t.link(5, 5), LinkClass::kSelf);
  EXPECT_EQ(t.numa_node, (std::vector<int>{0, 0, 0, 0, 1, 1, 1, 1}));
  EXPECT_TRUE(t.gpu_names.empty());
}

TEST(TopologyParse, SwitchPairsGiveTheSameIslands) {
  const Topology t = parse_fixture("switch_pairs_8gpu.txt");
  EXPECT_EQ(t.islands(), (Islands{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(t.table_key(), "islands-2x4");
  EXPECT_EQ(t.link(0, 1), LinkClass::kPix);
  EXPECT_EQ(t.link(6, 7), LinkClass::kPix);
  EXPECT_EQ(t.link(1, 2), LinkClass::kNode);
  EXPECT_EQ(t.link(0, 7), LinkClass::kSys);
}

TEST(TopologyParse, NvlinkBoxWithNicsIsOneNvlinkIsland) {
  const Topology t = parse_fixture("dgx_nvlink_8gpu.txt");
  EXPECT_EQ(t.world, 8);
  EXPECT_TRUE(t.has_nvlink());
  EXPECT_EQ(t.islands(), (Islands{{0, 1, 2, 3, 4, 5, 6, 7}}));
  EXPECT_EQ(t.table_key(), "nvlink");
  EXPECT_EQ(t.link(0, 7), LinkClass::kNvLink);
  EXPECT_EQ(t.nvlinks[0 * 8 + 7], 18);
  EXPECT_EQ(t.nvlinks[3 * 8 + 3], 0);
  EXPECT_EQ(t.numa_node, (std::vector<int>{0, 0, 0, 0, 1, 1, 1, 1}));
  ASSERT_TRUE(t.why_not_two_equal_islands().has_value());
  EXPECT_NE(t.why_not_two_equal_islands()->find("one island"), std::string::npos);
}

TEST(TopologyParse, NicColumnsAndRowsDoNotConfuseGpuRows) {
  const Topology t = parse_fixture("pcie_nics_8gpu.txt");
  EXPECT_EQ(t.world, 8);
  EXPECT_EQ(t.islands(), (Islands{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(t.table_key(), "islands-2x4");
  EXPECT_EQ(t.link(0, 1), LinkClass::kPxb);
  EXPECT_EQ(t.link(1, 2), LinkClass::kNode);
  EXPECT_EQ(t.numa_node, (std::vector<int>{0, 0, 0, 0, 1, 1, 1, 1}));

  // A NIC row between GPU rows (some tools reorder devices) is skipped just the same.
  std::vector<std::string> lines;
  std::istringstream in(read_fixture("pcie_nics_8gpu.txt"));
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.at(9).rfind("NIC0", 0), 0u);
  const std::string nic_row = lines[9];
  lines.erase(lines.begin() + 9);
  lines.insert(lines.begin() + 3, nic_row);
  EXPECT_TRUE(same_matrix(Topology::from_nvidia_smi(join(lines)), t));
}

TEST(TopologyParse, InterleavedSocketsDeriveIslandsFromLinksNotRanks) {
  const Topology t = parse_fixture("interleaved_sockets_8gpu.txt");
  EXPECT_EQ(t.islands(), (Islands{{0, 2, 4, 6}, {1, 3, 5, 7}}));
  EXPECT_EQ(t.island_of(), (std::vector<int>{0, 1, 0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(t.table_key(), "islands-2x4");
  EXPECT_EQ(t.why_not_two_equal_islands(), std::nullopt);
  EXPECT_EQ(t.numa_node, (std::vector<int>{0, 1, 0, 1, 0, 1, 0, 1}));
}

TEST(TopologyParse, UnevenIslandsAreValidButNotTwoEqual) {
  const Topology t = parse_fixture("uneven_3_5_8gpu.txt");
  EXPECT_EQ(t.islands(), (Islands{{0, 1, 2}, {3, 4, 5, 6, 7}}));
  EXPECT_EQ(t.table_key(), "islands-3+5");
  EXPECT_EQ(t.why_not_two_equal_islands(),
            std::optional<std::string>("islands are uneven: {0,1,2} and {3,4,5,6,7}"));
}

TEST(TopologyParse, SingleSocketHostsAreFlat) {
  const Topology two = parse_fixture("single_socket_2gpu.txt");  // 470 layout, no GPU NUMA ID
  EXPECT_EQ(two.world, 2);
  EXPECT_EQ(two.table_key(), "flat");
  EXPECT_EQ(two.link(0, 1), LinkClass::kPhb);
  EXPECT_EQ(two.numa_node, (std::vector<int>{0, 0}));
  EXPECT_EQ(two.why_not_two_equal_islands(),
            std::optional<std::string>("one island: no socket boundary to respect"));

  const Topology four = parse_fixture("single_socket_4gpu.txt");
  EXPECT_EQ(four.world, 4);
  EXPECT_EQ(four.table_key(), "flat");
  EXPECT_EQ(four.islands(), (Islands{{0, 1, 2, 3}}));
  EXPECT_EQ(four.link(0, 1), LinkClass::kPix);
  EXPECT_EQ(four.link(1, 2), LinkClass::kPxb);
}

TEST(TopologyParse, LegacySocMeansSys) {
  const Topology t = parse_fixture("legacy_soc_4gpu.txt");  // mlx5_0 column, CPU Affinity only
  EXPECT_EQ(t.world, 4);
  EXPECT_EQ(t.link(0, 2), LinkClass::kSys);
  EXPECT_EQ(t.islands(), (Islands{{0, 1}, {2, 3}}));
  EXPECT_EQ(t.table_key(), "islands-2x2");
  EXPECT_EQ(t.numa_node, (std::vector<int>{-1, -1, -1, -1}));  // no NUMA Affinity column
}

TEST(TopologyParse, AnsiCodesCrlfAndTrailingSpaceAreIgnored) {
  for (const char* name : {"two_socket_8gpu.txt", "dgx_nvlink_8gpu.txt", "pcie_nics_8gpu.txt"}) {
    SCOPED_TRACE(name);
    const std::string plain = read_fixture(name);
    const Topology expected = Topology::from_nvidia_smi(plain);
    const std::string decorated = to_crlf_with_trailing_space(with_ansi(plain));
    ASSERT_NE(decorated.find('\x1b'), std::string::npos);
    EXPECT_TRUE(same_matrix(Topology::from_nvidia_smi(decorated), expected));
  }
}

TEST(TopologyParse, SpaceSeparatedCopyParsesTheSame) {
  for (const char* name : {"two_socket_8gpu.txt", "pcie_nics_8gpu.txt", "legacy_soc_4gpu.txt",
                           "single_socket_2gpu.txt"}) {
    SCOPED_TRACE(name);
    const std::string plain = read_fixture(name);
    const std::string spaced = expand_tabs(plain);
    ASSERT_EQ(spaced.find('\t'), std::string::npos);
    EXPECT_TRUE(same_matrix(Topology::from_nvidia_smi(spaced), Topology::from_nvidia_smi(plain)));
  }
}

TEST(TopologyParse, NotApplicableNumaIsUnknown) {
  const Topology t =
      Topology::from_nvidia_smi(base_with(2, "GPU0\t X \tNODE\tSYS\tSYS\tN/A\tN/A\t\tN/A"));
  EXPECT_EQ(t.numa_node, (std::vector<int>{-1, 0, 1, 1}));
  EXPECT_EQ(t.islands(), (Islands{{0, 1}, {2, 3}}));
}

TEST(TopologyParse, SingleGpuHost) {
  const Topology t = Topology::from_nvidia_smi(
      "\tGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\nGPU0\t X \t0-15\t0\t\tN/A\n");
  EXPECT_EQ(t.world, 1);
  EXPECT_EQ(t.table_key(), "flat");
  EXPECT_EQ(t.islands(), (Islands{{0}}));
}

// ------------------------------------------------------------------ malformed text

TEST(TopologyParseError, WrongCellCountNamesLineAndCounts) {
  EXPECT_EQ(parse_error(base_with(4, "GPU2\tSYS\tSYS\t X \t16-31,48-63\t1\t\tN/A")),
            "nvidia-smi topo line 4: expected 4 link cells for GPU2, found 3");
  EXPECT_EQ(parse_error(base_with(3, "GPU1\tNODE\t X \tSYS\tSYS\tSYS\t0-15\t0\t\tN/A")),
            "nvidia-smi topo line 3: expected 4 link cells for GPU1, found 5");
}

TEST(TopologyParseError, WrongCellCountCountsNicColumns) {
  std::string text = read_fixture("pcie_nics_8gpu.txt");
  const std::string row = "GPU2\tNODE\tNODE\t X \tPXB\tSYS\tSYS\tSYS\tSYS\tNODE\tPXB\tSYS\tSYS\t";
  const size_t at = text.find(row);
  ASSERT_NE(at, std::string::npos);
  text.replace(at, row.size(), "GPU2\tNODE\tNODE\t X \tPXB\tSYS\tSYS\tSYS\tSYS\tNODE\tPXB\tSYS\t");
  EXPECT_EQ(parse_error(text), "nvidia-smi topo line 4: expected 12 link cells for GPU2, found 11");
}

TEST(TopologyParseError, UnknownClassNamesLineAndExpectedClasses) {
  EXPECT_EQ(parse_error(base_with(3, "GPU1\tNODE\t X \tFOO\tSYS\t0-15\t0\t\tN/A")),
            "nvidia-smi topo line 3: unknown link class 'FOO' in column GPU2 of GPU1 (expected "
            "X, NV#, PIX, PXB, PHB, NODE, SYS or SOC)");
  // NV needs a positive count.
  EXPECT_NE(parse_error(base_with(2, "GPU0\t X \tNV0\tSYS\tSYS\t0-15\t0\t\tN/A"))
                .find("line 2: unknown link class 'NV0'"),
            std::string::npos);
}

TEST(TopologyParseError, AsymmetricMatrixNamesBothLines) {
  EXPECT_EQ(parse_error(base_with(4, "GPU2\tNODE\tSYS\t X \tNODE\t16-31\t1\t\tN/A")),
            "nvidia-smi topo line 4: expected a symmetric matrix, found GPU2->GPU0 = NODE but "
            "GPU0->GPU2 = SYS (line 2)");
  // NV counts must agree too.
  const std::string nv = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV12\t0-7\nGPU1\tNV18\t X \t0-7\n";
  EXPECT_NE(parse_error(nv).find("line 3: expected a symmetric matrix, found GPU1->GPU0 = NV18 "
                                 "but GPU0->GPU1 = NV12"),
            std::string::npos);
}

TEST(TopologyParseError, DiagonalMustBeXAndOnlyThere) {
  EXPECT_EQ(parse_error(base_with(5, "GPU3\tSYS\tSYS\tNODE\tNODE\t16-31\t1\t\tN/A")),
            "nvidia-smi topo line 5: expected X on the diagonal in column GPU3 of GPU3, found "
            "'NODE'");
  EXPECT_EQ(parse_error(base_with(2, "GPU0\t X \t X \tSYS\tSYS\t0-15\t0\t\tN/A")),
            "nvidia-smi topo line 2: expected a link class in column GPU1 of GPU0, found X (X "
            "marks only GPU0's own column)");
}

TEST(TopologyParseError, GarbageNamesTheLine) {
  EXPECT_EQ(parse_error("hello world\nthis is not nvidia-smi\n"),
            "nvidia-smi topo line 1: expected the header row of `nvidia-smi topo -m` (GPU0 GPU1 "
            "... CPU Affinity), found 'hello world'");
  EXPECT_EQ(parse_error("\n\nNo devices were found\n"),
            "nvidia-smi topo line 3: expected the header row of `nvidia-smi topo -m` (GPU0 GPU1 "
            "... CPU Affinity), found 'No devices were found'");
  EXPECT_EQ(parse_error(base_with(4, "%%$# garbage ~~")),
            "nvidia-smi topo line 4: expected a row for GPU2 or for a device named in the "
            "header, found '%%$# garbage ~~'");
  EXPECT_NE(parse_error(base_with(1, "\tGPU0\tGPU2\tGPU1\tGPU3\tCPU Affinity"))
                .find("line 1: expected header column GPU1, found 'GPU2'"),
            std::string::npos);
}

TEST(TopologyParseError, MissingOrMisorderedRowsNameTheLine) {
  EXPECT_EQ(parse_error(base_with(5, "")),
            "nvidia-smi topo line 5: expected the row for GPU3, found the end of the matrix (the "
            "header names 4 GPUs)");
  EXPECT_EQ(parse_error(base_with(3, "GPU2\tSYS\tSYS\t X \tNODE\t16-31\t1\t\tN/A")),
            "nvidia-smi topo line 3: expected the row for GPU1, found a row for GPU2");
  EXPECT_EQ(parse_error(base_with(6, "GPU4\tSYS\tSYS\tSYS\tSYS\t16-31\t1\t\tN/A")),
            "nvidia-smi topo line 6: found a row for GPU4, but the header names only 4 GPUs");
  // A header with no rows at all (text cut after the first line).
  EXPECT_EQ(parse_error(base_lines().front()),
            "nvidia-smi topo line 2: expected the row for GPU0, found the end of the matrix (the "
            "header names 4 GPUs)");
}

// Found by fuzz_nvidia_smi_topo: messages quoted raw bytes of binary input, which Python cannot
// decode (strict UTF-8) and a terminal garbles. Bytes outside printable ASCII and tab are \xNN.
TEST(TopologyParseError, BinaryBytesAreQuotedAsEscapes) {
  std::string escaped;
  for (int i = 0; i < 48; ++i) escaped += "\\xce";
  EXPECT_EQ(
      parse_error("\tGPU0\tGPU1\n" + std::string(88, '\xce') + "GPU0\t X \tSYS\n1\tPUGPIX\t X \n"),
      "nvidia-smi topo line 2: expected a row for GPU0 or for a device named in the header, "
      "found '" +
          escaped + "...'");
  EXPECT_EQ(parse_error("\tGPU0\tGPU1\tNI\x01"
                        "C\nGPU0\t X \tSYS\tFOO\n"),
            "nvidia-smi topo line 2: unknown link class 'FOO' in column NI\\x01C of GPU0 (expected "
            "X, NV#, PIX, PXB, PHB, NODE, SYS or SOC)");
  EXPECT_EQ(parse_error("\tGPU0\tGPU1\nGPU0\t X \t\xff\xfe\x7f\n"),
            "nvidia-smi topo line 2: unknown link class '\\xff\\xfe\\x7f' in column GPU1 of GPU0 "
            "(expected X, NV#, PIX, PXB, PHB, NODE, SYS or SOC)");
  using namespace std::string_literals;
  EXPECT_EQ(parse_error("GPU0\0\tGPU1\n"s),
            "nvidia-smi topo line 1: expected the header row of `nvidia-smi topo -m` (GPU0 GPU1 "
            "... CPU Affinity), found 'GPU0\\x00\tGPU1'");
}

TEST(TopologyParseError, EmptyTextSaysWhatWasExpected) {
  EXPECT_EQ(parse_error(""),
            "nvidia-smi topo: the text is empty; expected the output of `nvidia-smi topo -m`");
  EXPECT_EQ(parse_error(" \r\n\t\n"),
            "nvidia-smi topo: the text is empty; expected the output of `nvidia-smi topo -m`");
}

// ------------------------------------------------------------------ islands and keys

TEST(TopologyIslands, FromIslandsBuildsNodeInsideAndSysAcross) {
  const Topology t = Topology::from_islands({{0, 1, 2, 3}, {4, 5, 6, 7}});
  EXPECT_EQ(t.source, "islands");
  EXPECT_EQ(t.link(1, 3), LinkClass::kNode);
  EXPECT_EQ(t.link(3, 4), LinkClass::kSys);
  EXPECT_EQ(t.table_key(), "islands-2x4");
  EXPECT_EQ(t.why_not_two_equal_islands(), std::nullopt);
}

TEST(TopologyIslands, IslandsAreNumberedByLowestRankWhateverTheInputOrder) {
  const Topology t = Topology::from_islands({{7, 5, 3, 1}, {6, 0, 4, 2}});
  EXPECT_EQ(t.island_of(), (std::vector<int>{0, 1, 0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(t.islands(), (Islands{{0, 2, 4, 6}, {1, 3, 5, 7}}));
}

TEST(TopologyIslands, TableKeys) {
  EXPECT_EQ(Topology::from_islands({{0, 1}, {2, 3}, {4, 5}, {6, 7}}).table_key(), "islands-4x2");
  EXPECT_EQ(Topology::from_islands({{3, 4, 5, 6, 7}, {0, 1, 2}}).table_key(), "islands-3+5");
  EXPECT_EQ(Topology::from_islands({{0, 1, 2, 3, 4}, {5, 6, 7}}).table_key(), "islands-3+5");
  EXPECT_EQ(Topology::from_islands({{0, 1, 2, 3}}).table_key(), "flat");
  EXPECT_EQ(Topology::flat(8).table_key(), "flat");
  EXPECT_EQ(Topology::flat(4, LinkClass::kNvLink).table_key(), "nvlink");
}

TEST(TopologyIslands, WhyNotTwoEqualIslandsExplains) {
  EXPECT_EQ(Topology::flat(4).why_not_two_equal_islands(),
            std::optional<std::string>("one island: no socket boundary to respect"));
  EXPECT_EQ(Topology::from_islands({{0, 1}, {2, 3}, {4, 5}, {6, 7}}).why_not_two_equal_islands(),
            std::optional<std::string>(
                "4 islands: {0,1} {2,3} {4,5} {6,7}; island algorithms need exactly two"));
  EXPECT_EQ(Topology::from_islands({{0}, {1}}).why_not_two_equal_islands(),
            std::optional<std::string>("islands of one GPU each: {0} and {1}; island algorithms "
                                       "need at least two per island"));
  EXPECT_EQ(Topology::from_islands({{1, 2, 3}, {0, 4}}).why_not_two_equal_islands(),
            std::optional<std::string>("islands are uneven: {0,4} and {1,2,3}"));
}

TEST(TopologyIslands, FromIslandsRejectsWhatIsNotAPartition) {
  EXPECT_EQ(from_islands_error({{0, 1, 2}, {2, 3, 4}}),
            "Topology::from_islands: rank 2 appears in islands 0 and 1; expected each of 0..5 "
            "exactly once (got {0,1,2} {2,3,4})");
  EXPECT_EQ(from_islands_error({{0, 1, 1}}),
            "Topology::from_islands: rank 1 appears twice in island 0; expected each of 0..2 "
            "exactly once (got {0,1,1})");
  EXPECT_EQ(from_islands_error({{0, 1}, {3, 4}}),
            "Topology::from_islands: expected each of 0..3 exactly once, but rank 2 is missing "
            "and rank 4 is out of range (got {0,1} {3,4})");
  EXPECT_EQ(from_islands_error({{0, -1}}),
            "Topology::from_islands: rank -1 is negative; expected ranks 0..1 (got {0,-1})");
  EXPECT_EQ(from_islands_error({{0, 1}, {}}),
            "Topology::from_islands: island 1 is empty (got {0,1} {})");
  EXPECT_EQ(from_islands_error({}),
            "Topology::from_islands: expected islands that partition 0..n-1, found no ranks (got "
            "none)");
}

TEST(TopologyIslands, FlatValidatesItsArguments) {
  EXPECT_EQ(Topology::flat(1).world, 1);
  EXPECT_EQ(Topology::flat(64).world, 64);
  EXPECT_THROW(Topology::flat(0), TopologyError);
  EXPECT_THROW(Topology::flat(65), TopologyError);
  EXPECT_THROW(Topology::flat(4, LinkClass::kSys), TopologyError);
  EXPECT_THROW(Topology::flat(4, LinkClass::kSelf), TopologyError);
  const Topology nv = Topology::flat(2, LinkClass::kNvLink);
  EXPECT_EQ(nv.nvlinks, (std::vector<int>{0, 1, 1, 0}));
  EXPECT_EQ(Topology::flat(3).link(0, 2), LinkClass::kPhb);
}

TEST(TopologyIslands, HandBuiltInconsistenciesAreReportedNotRead) {
  Topology t = Topology::flat(3);
  EXPECT_THROW(t.link(3, 0), std::out_of_range);
  EXPECT_THROW(t.link(0, -1), std::out_of_range);
  t.links[0 * 3 + 1] = LinkClass::kSys;  // asymmetric
  EXPECT_THROW(t.island_of(), TopologyError);
  t = Topology::flat(3);
  t.links.pop_back();
  EXPECT_THROW(t.link(0, 0), std::out_of_range);
  EXPECT_THROW(t.table_key(), TopologyError);
  EXPECT_THROW(Topology{}.islands(), TopologyError);
}

TEST(TopologyIslands, LinkClassNames) {
  EXPECT_EQ(link_class_name(LinkClass::kSelf), "X");
  EXPECT_EQ(link_class_name(LinkClass::kNvLink), "NV");
  EXPECT_EQ(link_class_name(LinkClass::kPix), "PIX");
  EXPECT_EQ(link_class_name(LinkClass::kPxb), "PXB");
  EXPECT_EQ(link_class_name(LinkClass::kPhb), "PHB");
  EXPECT_EQ(link_class_name(LinkClass::kNode), "NODE");
  EXPECT_EQ(link_class_name(LinkClass::kSys), "SYS");
}

TEST(TopologyIslands, DescribeShowsMatrixAndIslands) {
  const std::string text = parse_fixture("two_socket_8gpu.txt").describe();
  EXPECT_NE(text.find("key islands-2x4"), std::string::npos) << text;
  EXPECT_NE(text.find("GPU7"), std::string::npos) << text;
  EXPECT_NE(text.find("PHB"), std::string::npos) << text;
  EXPECT_NE(text.find("NUMA"), std::string::npos) << text;
  EXPECT_NE(text.find("islands: {0,1,2,3} {4,5,6,7}\n"), std::string::npos) << text;
  EXPECT_NE(parse_fixture("dgx_nvlink_8gpu.txt").describe().find("NV18"), std::string::npos);
}

// ------------------------------------------------------------------ a process group's view

TEST(TopologySubset, RanksSeeTheirOwnGpusLinksInRankOrder) {
  const Topology host = parse_fixture("two_socket_8gpu.txt");
  // A group of four ranks on GPUs 6, 1, 7, 0: two per socket, interleaved by rank.
  const Topology group = host.subset({6, 1, 7, 0});
  EXPECT_EQ(group.world, 4);
  EXPECT_EQ(group.link(0, 2), host.link(6, 7));
  EXPECT_EQ(group.link(1, 3), host.link(1, 0));
  EXPECT_EQ(group.link(0, 1), LinkClass::kSys);
  EXPECT_EQ(group.island_of(), (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(group.table_key(), "islands-2x2");
  EXPECT_EQ(group.numa_node, (std::vector<int>{1, 0, 1, 0}));
  EXPECT_NO_THROW(group.validate());
}

TEST(TopologySubset, NvlinkPairsAreNamedInRankOrder) {
  const Topology host = parse_fixture("dgx_nvlink_8gpu.txt");
  const Topology group = host.subset({3, 5});
  EXPECT_TRUE(group.has_nvlink());
  EXPECT_EQ(group.nvlink_pairs(), (std::vector<std::pair<int, int>>{{0, 1}}));
  EXPECT_EQ(group.table_key(), "nvlink");
  EXPECT_TRUE(parse_fixture("two_socket_8gpu.txt").nvlink_pairs().empty());
}

TEST(TopologySubset, RanksSharingAGpuAreOneIsland) {
  // Tests run several processes on one GPU: they must not read as NVLink or as a socket split.
  const Topology group = parse_fixture("two_socket_8gpu.txt").subset({2, 2, 2});
  EXPECT_EQ(group.link(0, 1), LinkClass::kPix);
  EXPECT_EQ(group.link(1, 1), LinkClass::kSelf);
  EXPECT_EQ(group.table_key(), "flat");
  EXPECT_FALSE(group.has_nvlink());
}

TEST(TopologySubset, RejectsGpusOutsideTheHost) {
  const Topology host = parse_fixture("single_socket_4gpu.txt");
  EXPECT_THROW(host.subset({}), TopologyError);
  try {
    host.subset({0, 4});
    ADD_FAILURE() << "accepted GPU 4 of a 4-GPU host";
  } catch (const TopologyError& e) {
    EXPECT_NE(std::string(e.what()).find("GPU index 4 is outside 0..3"), std::string::npos)
        << e.what();
  }
}

// ------------------------------------------------------------------ fingerprint

TEST(TopologyFingerprint, IsAPureFunctionOfItsInputs) {
  const std::string text = read_fixture("two_socket_8gpu.txt");
  const Topology a = Topology::from_nvidia_smi(text);
  const Topology b = Topology::from_nvidia_smi(text);
  EXPECT_EQ(a.fingerprint(), a.fingerprint());
  EXPECT_EQ(a.fingerprint(), b.fingerprint());
  EXPECT_EQ(a.fingerprint("driver=580.65"), b.fingerprint("driver=580.65"));
  // Decoration of the text is not part of the topology.
  EXPECT_EQ(Topology::from_nvidia_smi(to_crlf_with_trailing_space(with_ansi(text))).fingerprint(),
            a.fingerprint());
}

TEST(TopologyFingerprint, GoldenValuesPinTheCanonicalForm) {
  // Changing these invalidates every tuning cache in the field: bump the canonical text's
  // version ("pcie_ar.topology.v1") when you do it on purpose. Cross-checked against an
  // independent FNV-1a of the canonical text, e.g. for flat(2):
  // "pcie_ar.topology.v1\nworld=2\nnames=0\nlinks=\nX,PHB,\nPHB,X,\nislands=0,0,\nextra=0:".
  EXPECT_EQ(Topology::flat(2).fingerprint(), Topology::flat(2).fingerprint());
  EXPECT_EQ(Topology::flat(2).fingerprint(), "flat-w2-ae80cb4195e23f0e");
  EXPECT_EQ(Topology::from_islands({{0, 1}, {2, 3}}).fingerprint("cuda=13.0"),
            "islands-2x2-w4-f6be55735c0a008b");
}

TEST(TopologyFingerprint, HasTheDocumentedShapeAndAlphabet) {
  const std::regex shape("[a-z0-9-]+-w[0-9]+-[0-9a-f]{16}");
  const std::regex alphabet("[a-z0-9-]+");
  for (const char* name : {"two_socket_8gpu.txt", "dgx_nvlink_8gpu.txt", "uneven_3_5_8gpu.txt",
                           "single_socket_2gpu.txt", "legacy_soc_4gpu.txt"}) {
    const std::string fp = parse_fixture(name).fingerprint("driver=580.65.06 nccl=2.27.3/\\:*");
    EXPECT_TRUE(std::regex_match(fp, shape)) << name << ": " << fp;
    EXPECT_TRUE(std::regex_match(fp, alphabet)) << name << ": " << fp;
  }
  EXPECT_EQ(parse_fixture("two_socket_8gpu.txt").fingerprint().rfind("islands-2x4-w8-", 0), 0u);
  EXPECT_EQ(parse_fixture("uneven_3_5_8gpu.txt").fingerprint().rfind("islands-3-5-w8-", 0), 0u);
  EXPECT_EQ(parse_fixture("dgx_nvlink_8gpu.txt").fingerprint().rfind("nvlink-w8-", 0), 0u);
}

TEST(TopologyFingerprint, ChangesWithAnyInput) {
  const Topology base = parse_fixture("two_socket_8gpu.txt");
  const std::string fp = base.fingerprint();

  Topology one_link = base;  // PHB -> NODE between GPU2 and GPU3: same islands, other host
  one_link.links[2 * 8 + 3] = one_link.links[3 * 8 + 2] = LinkClass::kNode;
  EXPECT_EQ(one_link.table_key(), base.table_key());
  EXPECT_NE(one_link.fingerprint(), fp);

  EXPECT_NE(base.fingerprint("driver=580.65.06"), fp);
  EXPECT_NE(base.fingerprint("driver=580.65.06"), base.fingerprint("driver=580.65.07"));

  Topology named = base;
  named.gpu_names.assign(8, "NVIDIA RTX PRO 6000 Blackwell Server Edition");
  const std::string named_fp = named.fingerprint();
  EXPECT_NE(named_fp, fp);
  named.gpu_names[5] = "NVIDIA L40S";
  EXPECT_NE(named.fingerprint(), named_fp);

  const Topology nv12 = Topology::from_nvidia_smi(
      "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV12\t0-7\nGPU1\tNV12\t X \t0-7\n");
  const Topology nv18 = Topology::from_nvidia_smi(
      "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV18\t0-7\nGPU1\tNV18\t X \t0-7\n");
  EXPECT_NE(nv12.fingerprint(), nv18.fingerprint());

  // A name cannot be shifted into `extra` (or vice versa) to collide.
  Topology a = Topology::flat(1);
  a.gpu_names = {"ab"};
  Topology b = Topology::flat(1);
  b.gpu_names = {"a"};
  EXPECT_NE(a.fingerprint(""), b.fingerprint("b"));
}

}  // namespace
}  // namespace pcie_ar::plan
