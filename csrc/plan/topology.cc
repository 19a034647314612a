// Topology: validation, island derivation, keys, and the `nvidia-smi topo -m` parser.
//
// The parser works line by line on text with ANSI codes and CR removed. Cell values never
// contain spaces, so GPU rows are split on whitespace: the link cells are the leading run of
// tokens that do not look like affinity values (those start with a digit or are "N/A"), which
// lets a short or long row be reported as such instead of misreading an affinity as a link.
// Header names do contain spaces ("CPU Affinity"): the header is split on tabs when it has
// them (as nvidia-smi prints it), else known multi-word names are re-joined.
#include "plan/topology.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <map>
#include <optional>
#include <utility>

#include "plan/hash.h"
#include "plan/text.h"

namespace pcie_ar::plan {
namespace {

// What a cell may hold, for messages: "X, NV#, PIX, PXB, PHB, NODE, SYS or SOC".
std::string expected_classes() {
  std::vector<std::string> words;
  for (const auto& e : kLinkClassNames.entries) {
    words.push_back(std::string(e.name) + (e.value == LinkClass::kNvLink ? "#" : ""));
    for (const std::string_view alias : e.aliases) {
      if (!alias.empty()) words.emplace_back(alias);
    }
  }
  std::string out;
  for (size_t i = 0; i < words.size(); ++i) {
    out += (i == 0 ? "" : i + 1 == words.size() ? " or " : ", ") + words[i];
  }
  return out;
}
constexpr int kMaxNvLinks = 99;  // NV1..NV18 today; room for bigger bonds without a parser change

// One cell of the matrix: a class, plus the link count for NV#.
struct Cell {
  LinkClass cls = LinkClass::kSelf;
  int nv = 0;
  bool operator==(const Cell&) const = default;
};

std::string cell_text(Cell c) {
  if (c.cls == LinkClass::kNvLink) return "NV" + std::to_string(c.nv);
  return std::string(link_class_name(c.cls));
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\v' || c == '\f'; }

std::vector<std::string_view> split_whitespace(std::string_view s) {
  std::vector<std::string_view> out;
  size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && is_space(s[i])) ++i;
    const size_t start = i;
    while (i < s.size() && !is_space(s[i])) ++i;
    if (i > start) out.push_back(s.substr(start, i - start));
  }
  return out;
}

// Removes CSI sequences (ESC '[' ... final byte), OSC sequences (ESC ']' ... BEL or ESC '\')
// and other two-byte escapes, plus every CR: what a terminal-captured nvidia-smi leaves behind.
std::string strip_control(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '\r') continue;
    if (c != '\x1b') {
      out.push_back(c);
      continue;
    }
    if (i + 1 >= s.size()) break;
    const char kind = s[++i];
    if (kind == '[') {
      while (i + 1 < s.size() && !(s[i + 1] >= 0x40 && s[i + 1] <= 0x7e)) ++i;
      ++i;  // the final byte
    } else if (kind == ']') {
      while (i + 1 < s.size() && s[i + 1] != '\a' && s[i + 1] != '\x1b') ++i;
      ++i;
      if (i < s.size() && s[i] == '\x1b') ++i;  // ESC '\' terminator
    }
  }
  return out;
}

std::optional<int> parse_small_uint(std::string_view s, int max_value) {
  if (s.empty() || s.size() > 6) return std::nullopt;
  int value = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
  if (ec != std::errc() || end != s.data() + s.size() || value < 0 || value > max_value) {
    return std::nullopt;
  }
  return value;
}

// "GPU<k>" -> k.
std::optional<int> parse_gpu_label(std::string_view s) {
  if (s.size() < 4 || s.substr(0, 3) != "GPU") return std::nullopt;
  return parse_small_uint(s.substr(3), 9999);
}

std::optional<Cell> parse_cell(std::string_view s) {
  const auto named = kLinkClassNames.find(s);
  if (named && *named != LinkClass::kNvLink) return Cell{*named, 0};  // NVLink cells count links
  if (s.size() > 2 && s.substr(0, 2) == "NV") {
    const auto n = parse_small_uint(s.substr(2), kMaxNvLinks);
    if (n && *n > 0) return Cell{LinkClass::kNvLink, *n};
  }
  return std::nullopt;
}

// Affinity values ("0-31,64-95", "0", "N/A") start where the link cells end.
bool looks_like_affinity(std::string_view s) {
  return s == "N/A" || (!s.empty() && s.front() >= '0' && s.front() <= '9');
}

// At most 48 bytes of `s` for a message, printable ASCII and tab as is, other bytes as \xNN:
// nvidia-smi prints ASCII, and a message quoting binary input must stay clean text (Python
// decodes it as strict UTF-8; a raw control byte would garble a terminal).
std::string excerpt(std::string_view s) {
  constexpr size_t kMax = 48;
  constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (const char ch : s.substr(0, kMax)) {
    const auto c = static_cast<unsigned char>(ch);
    if ((c >= 0x20 && c < 0x7F) || c == '\t') {
      out.push_back(ch);
    } else {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 0xF]);
    }
  }
  if (s.size() > kMax) out += "...";
  return out;
}

std::string quote_excerpt(std::string_view s) { return "'" + excerpt(s) + "'"; }

[[noreturn]] void fail_line(int line, const std::string& what) {
  throw TopologyError("nvidia-smi topo line " + std::to_string(line) + ": " + what);
}

std::string format_island(const std::vector<int>& island) {
  std::string out = "{";
  for (size_t i = 0; i < island.size(); ++i) {
    if (i) out += ",";
    out += std::to_string(island[i]);
  }
  return out + "}";
}

std::string format_islands(const std::vector<std::vector<int>>& islands, std::string_view sep) {
  std::string out;
  for (size_t i = 0; i < islands.size(); ++i) {
    if (i) out += sep;
    out += format_island(islands[i]);
  }
  return out;
}

// "rank 5 is" / "ranks 5,6 are".
std::string rank_list(const std::vector<int>& ranks) {
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (i) out += ",";
    out += std::to_string(ranks[i]);
  }
  return out + (ranks.size() == 1 ? " is" : " are");
}

// Splits the header into column names. Tabs are authoritative when present; otherwise the
// multi-word names nvidia-smi prints are re-joined from single words.
std::vector<std::string> header_columns(std::string_view line) {
  std::vector<std::string> cols;
  if (line.find('\t') != std::string_view::npos) {
    size_t start = 0;
    while (start <= line.size()) {
      size_t end = line.find('\t', start);
      if (end == std::string_view::npos) end = line.size();
      const std::string_view cell = trim(line.substr(start, end - start));
      if (!cell.empty()) cols.emplace_back(cell);
      start = end + 1;
    }
    return cols;
  }
  static const std::vector<std::vector<std::string_view>> kPhrases = {
      {"CPU", "Affinity"}, {"NUMA", "Affinity"}, {"GPU", "NUMA", "ID"}};
  const std::vector<std::string_view> words = split_whitespace(line);
  for (size_t i = 0; i < words.size();) {
    std::string col(words[i]);
    size_t taken = 1;
    for (const auto& phrase : kPhrases) {
      if (i + phrase.size() <= words.size() &&
          std::equal(phrase.begin(), phrase.end(), words.begin() + i)) {
        for (size_t k = 1; k < phrase.size(); ++k) col += " " + std::string(words[i + k]);
        taken = phrase.size();
        break;
      }
    }
    cols.push_back(std::move(col));
    i += taken;
  }
  return cols;
}

bool is_affinity_column(std::string_view name) {
  return name == "CPU Affinity" || name == "NUMA Affinity" || name == "GPU NUMA ID" ||
         name.find(' ') != std::string_view::npos;
}

// The header, classified: GPU columns, then other devices, then affinity columns.
struct Header {
  int gpus = 0;
  std::vector<std::string> devices;   // NIC0, mlx5_0, ...: rows to skip, columns to read past
  std::vector<std::string> trailing;  // CPU Affinity, NUMA Affinity, GPU NUMA ID, ...
  int numa_column = -1;               // index into `trailing`, -1 when absent

  int link_columns() const { return gpus + static_cast<int>(devices.size()); }
  std::string column_name(int j) const {
    return j < gpus ? "GPU" + std::to_string(j) : devices[j - gpus];
  }
};

Header parse_header(std::string_view line, int line_no) {
  const std::vector<std::string> cols = header_columns(line);
  if (cols.empty() || cols.front() != "GPU0") {
    fail_line(line_no,
              "expected the header row of `nvidia-smi topo -m` (GPU0 GPU1 ... CPU Affinity), "
              "found " +
                  quote_excerpt(trim(line)));
  }
  Header h;
  size_t i = 0;
  for (; i < cols.size(); ++i) {
    const auto k = parse_gpu_label(cols[i]);
    if (!k) break;
    if (*k != h.gpus) {
      fail_line(line_no, "expected header column GPU" + std::to_string(h.gpus) + ", found " +
                             quote_excerpt(cols[i]) + " (GPU columns must be in order)");
    }
    ++h.gpus;
  }
  for (; i < cols.size() && !is_affinity_column(cols[i]); ++i) {
    if (parse_gpu_label(cols[i])) {
      fail_line(line_no, "expected the GPU columns first, found " + quote_excerpt(cols[i]) +
                             " after other devices");
    }
    h.devices.push_back(cols[i]);
  }
  for (; i < cols.size(); ++i) {
    if (cols[i] == "NUMA Affinity") h.numa_column = static_cast<int>(h.trailing.size());
    h.trailing.push_back(cols[i]);
  }
  if (h.gpus > kMaxTopologyWorld) {
    fail_line(line_no, "expected at most " + std::to_string(kMaxTopologyWorld) +
                           " GPU columns, found " + std::to_string(h.gpus));
  }
  return h;
}

}  // namespace

LinkClass Topology::link(int a, int b) const {
  if (a < 0 || b < 0 || a >= world || b >= world ||
      links.size() != static_cast<size_t>(world) * static_cast<size_t>(world)) {
    throw std::out_of_range("Topology::link(" + std::to_string(a) + ", " + std::to_string(b) +
                            "): expected ranks in 0.." + std::to_string(world - 1) +
                            " and world*world links, have world " + std::to_string(world) +
                            " and " + std::to_string(links.size()) + " links");
  }
  return links[static_cast<size_t>(a) * world + b];
}

void Topology::validate() const {
  auto fail = [](const std::string& what) { throw TopologyError("Topology: " + what); };
  if (world < 1 || world > kMaxTopologyWorld) {
    fail("expected world in 1.." + std::to_string(kMaxTopologyWorld) + ", got " +
         std::to_string(world));
  }
  const size_t cells = static_cast<size_t>(world) * world;
  if (links.size() != cells || nvlinks.size() != cells) {
    fail("expected world*world = " + std::to_string(cells) + " links and NV counts, got " +
         std::to_string(links.size()) + " and " + std::to_string(nvlinks.size()));
  }
  if (!gpu_names.empty() && gpu_names.size() != static_cast<size_t>(world)) {
    fail("expected no GPU names or " + std::to_string(world) + ", got " +
         std::to_string(gpu_names.size()));
  }
  if (!numa_node.empty() && numa_node.size() != static_cast<size_t>(world)) {
    fail("expected no NUMA ids or " + std::to_string(world) + ", got " +
         std::to_string(numa_node.size()));
  }
  for (int a = 0; a < world; ++a) {
    for (int b = 0; b < world; ++b) {
      const size_t ab = static_cast<size_t>(a) * world + b;
      const size_t ba = static_cast<size_t>(b) * world + a;
      // Built only on failure; GCC 12 at -O3 also misreports `"(" + to_string()` (-Wrestrict).
      auto pair = [a, b] {
        std::string out = "(";
        out += std::to_string(a);
        out += ",";
        out += std::to_string(b);
        return out + ")";
      };
      if (static_cast<uint8_t>(links[ab]) > static_cast<uint8_t>(LinkClass::kSys)) {
        fail("link " + pair() + " has class value " + std::to_string(int(links[ab])) +
             ", expected 0..6");
      }
      if ((a == b) != (links[ab] == LinkClass::kSelf)) {
        fail("link " + pair() + " is " + std::string(link_class_name(links[ab])) +
             (a == b ? ", expected X on the diagonal" : ", expected X only on the diagonal"));
      }
      if ((links[ab] == LinkClass::kNvLink) != (nvlinks[ab] > 0) || nvlinks[ab] < 0) {
        fail("link " + pair() + " is " + std::string(link_class_name(links[ab])) +
             " with NV count " + std::to_string(nvlinks[ab]) +
             ", expected a count > 0 exactly for NV links");
      }
      if (links[ab] != links[ba] || nvlinks[ab] != nvlinks[ba]) {
        fail("link " + pair() + " is " + cell_text({links[ab], nvlinks[ab]}) +
             " but its mirror is " + cell_text({links[ba], nvlinks[ba]}) +
             ", expected a symmetric matrix");
      }
    }
  }
}

std::vector<int> Topology::island_of() const {
  validate();
  std::vector<int> island(world, -1);
  int next_id = 0;
  // Scanning ranks in order makes each island's id follow its lowest rank.
  for (int root = 0; root < world; ++root) {
    if (island[root] >= 0) continue;
    std::vector<int> stack = {root};
    island[root] = next_id;
    while (!stack.empty()) {
      const int a = stack.back();
      stack.pop_back();
      for (int b = 0; b < world; ++b) {
        if (island[b] < 0 && link(a, b) < LinkClass::kSys) {
          island[b] = next_id;
          stack.push_back(b);
        }
      }
    }
    ++next_id;
  }
  return island;
}

std::vector<std::vector<int>> Topology::islands() const {
  const std::vector<int> of = island_of();
  std::vector<std::vector<int>> out(*std::max_element(of.begin(), of.end()) + 1);
  for (int r = 0; r < world; ++r) out[of[r]].push_back(r);
  return out;
}

bool Topology::has_nvlink() const { return !nvlink_pairs().empty(); }

std::vector<std::pair<int, int>> Topology::nvlink_pairs() const {
  validate();
  std::vector<std::pair<int, int>> pairs;
  for (int a = 0; a < world; ++a) {
    for (int b = a + 1; b < world; ++b) {
      if (link(a, b) == LinkClass::kNvLink) pairs.emplace_back(a, b);
    }
  }
  return pairs;
}

Topology Topology::subset(const std::vector<int>& gpus) const {
  validate();
  const int n = static_cast<int>(gpus.size());
  if (n < 1 || n > kMaxTopologyWorld) {
    throw TopologyError("Topology::subset: expected 1.." + std::to_string(kMaxTopologyWorld) +
                        " GPU indices, got " + std::to_string(n));
  }
  for (int g : gpus) {
    if (g < 0 || g >= world) {
      throw TopologyError("Topology::subset: GPU index " + std::to_string(g) + " is outside 0.." +
                          std::to_string(world - 1));
    }
  }
  Topology t;
  t.world = n;
  t.source = source;
  t.links.assign(static_cast<size_t>(n) * n, LinkClass::kSelf);
  t.nvlinks.assign(t.links.size(), 0);
  for (int a = 0; a < n; ++a) {
    for (int b = 0; b < n; ++b) {
      const size_t from = static_cast<size_t>(gpus[a]) * world + gpus[b];
      const size_t to = static_cast<size_t>(a) * n + b;
      const bool shared_gpu = a != b && gpus[a] == gpus[b];
      t.links[to] = shared_gpu ? LinkClass::kPix : links[from];
      t.nvlinks[to] = shared_gpu ? 0 : nvlinks[from];
    }
  }
  for (int g : gpus) {
    if (!gpu_names.empty()) t.gpu_names.push_back(gpu_names[g]);
    if (!numa_node.empty()) t.numa_node.push_back(numa_node[g]);
  }
  return t;
}

std::optional<std::string> Topology::why_not_two_equal_islands() const {
  const auto groups = islands();
  if (groups.size() == 1) return "one island: no socket boundary to respect";
  if (groups.size() > 2) {
    return std::to_string(groups.size()) + " islands: " + format_islands(groups, " ") +
           "; island algorithms need exactly two";
  }
  if (groups[0].size() != groups[1].size()) {
    return "islands are uneven: " + format_islands(groups, " and ");
  }
  if (groups[0].size() < 2) {
    return "islands of one GPU each: " + format_islands(groups, " and ") +
           "; island algorithms need at least two per island";
  }
  return std::nullopt;
}

std::string Topology::table_key() const {
  if (has_nvlink()) return "nvlink";
  const auto groups = islands();
  if (groups.size() == 1) return "flat";
  std::vector<size_t> sizes;
  for (const auto& g : groups) sizes.push_back(g.size());
  std::sort(sizes.begin(), sizes.end());
  if (sizes.front() == sizes.back()) {
    return "islands-" + std::to_string(sizes.size()) + "x" + std::to_string(sizes.front());
  }
  std::string key = "islands-";
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (i) key += "+";
    key += std::to_string(sizes[i]);
  }
  return key;
}

std::string Topology::fingerprint(std::string_view extra) const {
  const std::vector<int> of = island_of();  // validates
  // Strings are length-prefixed so no choice of names or `extra` can collide with another.
  std::string canon = "pcie_ar.topology.v1\nworld=" + std::to_string(world) + "\nnames=";
  canon += std::to_string(gpu_names.size());
  for (const auto& name : gpu_names) {
    canon += "\n";
    canon += std::to_string(name.size());
    canon += ":";
    canon += name;
  }
  canon += "\nlinks=";
  for (int a = 0; a < world; ++a) {
    canon += "\n";
    for (int b = 0; b < world; ++b) {
      const size_t ab = static_cast<size_t>(a) * world + b;
      canon += cell_text({links[ab], nvlinks[ab]}) + ",";
    }
  }
  canon += "\nislands=";
  for (const int id : of) canon += std::to_string(id) + ",";
  canon += "\nextra=" + std::to_string(extra.size()) + ":" + std::string(extra);

  std::string key = table_key();
  for (char& c : key) {
    const bool safe = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-';
    if (!safe) c = '-';
  }
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(fnv1a(canon)));
  return key + "-w" + std::to_string(world) + "-" + hex;
}

std::string Topology::describe() const {
  const auto groups = islands();  // validates
  const size_t width = std::max<size_t>(4, ("GPU" + std::to_string(world - 1)).size()) + 2;
  auto pad = [width](std::string s) {
    s.resize(std::max(width, s.size() + 1), ' ');
    return s;
  };
  const bool has_numa = !numa_node.empty();
  const bool has_names = !gpu_names.empty();
  auto finish_line = [](std::string& out, std::string line) {
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  };

  std::string out;
  finish_line(out, "topology: world " + std::to_string(world) + ", key " + table_key() +
                       ", source " + (source.empty() ? "unknown" : source));
  std::string header = pad("");
  for (int b = 0; b < world; ++b) header += pad("GPU" + std::to_string(b));
  if (has_numa) header += pad("NUMA");
  if (has_names) header += "Name";
  finish_line(out, header);
  for (int a = 0; a < world; ++a) {
    std::string row = pad("GPU" + std::to_string(a));
    for (int b = 0; b < world; ++b) {
      const size_t ab = static_cast<size_t>(a) * world + b;
      row += pad(cell_text({links[ab], nvlinks[ab]}));
    }
    if (has_numa) row += pad(numa_node[a] < 0 ? "N/A" : std::to_string(numa_node[a]));
    if (has_names) row += gpu_names[a];
    finish_line(out, row);
  }
  out += "islands: " + format_islands(groups, " ") + "\n";
  return out;
}

Topology Topology::flat(int world, LinkClass cls) {
  if (world < 1 || world > kMaxTopologyWorld) {
    throw TopologyError("Topology::flat: expected world in 1.." +
                        std::to_string(kMaxTopologyWorld) + ", got " + std::to_string(world));
  }
  if (cls == LinkClass::kSelf || cls >= LinkClass::kSys) {
    throw TopologyError(
        "Topology::flat: expected a link class that joins GPUs into one island (NV, PIX, PXB, "
        "PHB or NODE), got " +
        std::string(link_class_name(cls)) + "; use from_islands for a socket split");
  }
  Topology t;
  t.world = world;
  t.links.assign(static_cast<size_t>(world) * world, cls);
  t.nvlinks.assign(t.links.size(), cls == LinkClass::kNvLink ? 1 : 0);
  for (int r = 0; r < world; ++r) {
    t.links[static_cast<size_t>(r) * world + r] = LinkClass::kSelf;
    t.nvlinks[static_cast<size_t>(r) * world + r] = 0;
  }
  t.source = "flat";
  return t;
}

Topology Topology::from_islands(const std::vector<std::vector<int>>& islands) {
  size_t total = 0;
  for (const auto& island : islands) total += island.size();
  const std::string got =
      " (got " + (islands.empty() ? "none" : format_islands(islands, " ")) + ")";
  auto fail = [&](const std::string& what) {
    throw TopologyError("Topology::from_islands: " + what + got);
  };
  if (total == 0) fail("expected islands that partition 0..n-1, found no ranks");
  if (total > static_cast<size_t>(kMaxTopologyWorld)) {
    fail("expected at most " + std::to_string(kMaxTopologyWorld) + " ranks, found " +
         std::to_string(total));
  }
  const int world = static_cast<int>(total);
  const std::string range = "0.." + std::to_string(world - 1);
  std::map<int, size_t> owner;  // rank -> index of the island that holds it
  for (size_t i = 0; i < islands.size(); ++i) {
    if (islands[i].empty()) fail("island " + std::to_string(i) + " is empty");
    for (const int r : islands[i]) {
      if (r < 0) fail("rank " + std::to_string(r) + " is negative; expected ranks " + range);
      const auto [it, inserted] = owner.emplace(r, i);
      if (!inserted) {
        fail("rank " + std::to_string(r) + " appears " +
             (it->second == i
                  ? "twice in island " + std::to_string(i)
                  : "in islands " + std::to_string(it->second) + " and " + std::to_string(i)) +
             "; expected each of " + range + " exactly once");
      }
    }
  }
  // No rank repeats, so a missing rank implies one beyond the range, and vice versa.
  std::vector<int> missing;
  std::vector<int> beyond;
  for (int r = 0; r < world; ++r) {
    if (!owner.count(r)) missing.push_back(r);
  }
  for (const auto& [r, island] : owner) {
    if (r >= world) beyond.push_back(r);
  }
  if (!missing.empty()) {
    fail("expected each of " + range + " exactly once, but " + rank_list(missing) +
         " missing and " + rank_list(beyond) + " out of range");
  }

  Topology t;
  t.world = world;
  t.links.resize(static_cast<size_t>(world) * world);
  t.nvlinks.assign(t.links.size(), 0);
  for (int a = 0; a < world; ++a) {
    for (int b = 0; b < world; ++b) {
      t.links[static_cast<size_t>(a) * world + b] =
          a == b ? LinkClass::kSelf : (owner[a] == owner[b] ? LinkClass::kNode : LinkClass::kSys);
    }
  }
  t.source = "islands";
  return t;
}

namespace {

// The matrix as read, before it becomes a Topology.
struct Matrix {
  explicit Matrix(int gpus)
      : n(gpus), cells(static_cast<size_t>(gpus) * gpus), numa(gpus, -1), row_line(gpus, 0) {}
  int n;
  std::vector<Cell> cells;
  std::vector<int> numa;
  std::vector<int> row_line;  // 1-based line of each GPU's row
};

// Lines with ANSI codes and CR removed.
std::vector<std::string> split_lines(std::string_view text) {
  std::vector<std::string> lines;
  for (size_t start = 0; start <= text.size();) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    lines.push_back(strip_control(text.substr(start, end - start)));
    start = end + 1;
  }
  return lines;
}

// The link cells and NUMA node of GPU `gpu`'s row (tokens[0] is its label).
void read_gpu_row(const Header& header, const std::vector<std::string_view>& tokens, int gpu,
                  int line_no, Matrix& m) {
  const int columns = header.link_columns();
  const std::string row_name = "GPU" + std::to_string(gpu);
  size_t found = 0;
  while (1 + found < tokens.size() && !looks_like_affinity(tokens[1 + found])) ++found;
  if (found != static_cast<size_t>(columns)) {
    fail_line(line_no, "expected " + std::to_string(columns) + " link cells for " + row_name +
                           ", found " + std::to_string(found));
  }
  for (int j = 0; j < columns; ++j) {
    const std::string_view token = tokens[1 + j];
    const auto cell = parse_cell(token);
    const std::string where = " in column " + excerpt(header.column_name(j)) + " of " + row_name;
    if (!cell) {
      fail_line(line_no, "unknown link class " + quote_excerpt(token) + where + " (expected " +
                             expected_classes() + ")");
    }
    if (j == gpu && cell->cls != LinkClass::kSelf) {
      fail_line(line_no, "expected X on the diagonal" + where + ", found " + quote_excerpt(token));
    }
    if (j != gpu && cell->cls == LinkClass::kSelf) {
      fail_line(line_no, "expected a link class" + where + ", found X (X marks only " + row_name +
                             "'s own column)");
    }
    if (j < m.n) m.cells[static_cast<size_t>(gpu) * m.n + j] = *cell;
  }
  const size_t rest = tokens.size() - 1 - columns;
  if (header.numa_column >= 0 && rest == header.trailing.size()) {
    const auto id = parse_small_uint(tokens[1 + columns + header.numa_column], 99999);
    m.numa[gpu] = id ? *id : -1;
  }
  m.row_line[gpu] = line_no;
}

// The GPU a row is for, or nullopt for a row of another device named in the header; anything
// else, or GPUs out of order, fails naming the line.
std::optional<int> row_gpu(const Header& header, std::string_view line, std::string_view label,
                           int line_no, int next_gpu) {
  const auto gpu = parse_gpu_label(label);
  if (!gpu) {
    if (std::find(header.devices.begin(), header.devices.end(), label) != header.devices.end()) {
      return std::nullopt;  // a NIC (or other device) row: nothing in it concerns GPU pairs
    }
    fail_line(line_no, "expected a row for GPU" + std::to_string(next_gpu) +
                           " or for a device named in the header, found " +
                           quote_excerpt(trim(line)));
  }
  if (*gpu >= header.gpus) {
    fail_line(line_no, "found a row for GPU" + std::to_string(*gpu) +
                           ", but the header names only " + std::to_string(header.gpus) + " GPUs");
  }
  if (*gpu != next_gpu) {
    fail_line(line_no, "expected the row for GPU" + std::to_string(next_gpu) +
                           ", found a row for GPU" + std::to_string(*gpu));
  }
  return gpu;
}

void check_symmetric(const Matrix& m) {
  for (int b = 0; b < m.n; ++b) {
    for (int a = 0; a < b; ++a) {
      const Cell ba = m.cells[static_cast<size_t>(b) * m.n + a];
      const Cell ab = m.cells[static_cast<size_t>(a) * m.n + b];
      if (ab != ba) {
        fail_line(m.row_line[b], "expected a symmetric matrix, found GPU" + std::to_string(b) +
                                     "->GPU" + std::to_string(a) + " = " + cell_text(ba) +
                                     " but GPU" + std::to_string(a) + "->GPU" + std::to_string(b) +
                                     " = " + cell_text(ab) + " (line " +
                                     std::to_string(m.row_line[a]) + ")");
      }
    }
  }
}

}  // namespace

Topology Topology::from_nvidia_smi(std::string_view text) {
  const std::vector<std::string> lines = split_lines(text);
  size_t i = 0;
  while (i < lines.size() && trim(lines[i]).empty()) ++i;
  if (i == lines.size()) {
    throw TopologyError(
        "nvidia-smi topo: the text is empty; expected the output of `nvidia-smi topo -m`");
  }
  const Header header = parse_header(lines[i], static_cast<int>(i) + 1);
  Matrix m(header.gpus);
  int next_gpu = 0;
  int end_line = static_cast<int>(lines.size()) + 1;  // where the matrix stops
  for (++i; i < lines.size(); ++i) {
    const int line_no = static_cast<int>(i) + 1;
    const std::vector<std::string_view> tokens = split_whitespace(lines[i]);
    if (tokens.empty() || tokens.front() == "Legend:") {
      end_line = line_no;
      break;
    }
    const auto gpu = row_gpu(header, lines[i], tokens.front(), line_no, next_gpu);
    if (!gpu) continue;
    read_gpu_row(header, tokens, *gpu, line_no, m);
    ++next_gpu;
  }
  if (next_gpu < m.n) {
    fail_line(end_line, "expected the row for GPU" + std::to_string(next_gpu) +
                            ", found the end of the matrix (the header names " +
                            std::to_string(m.n) + " GPUs)");
  }
  check_symmetric(m);

  Topology t;
  t.world = m.n;
  for (const Cell& cell : m.cells) {
    t.links.push_back(cell.cls);
    t.nvlinks.push_back(cell.nv);
  }
  t.numa_node = std::move(m.numa);
  t.source = "nvidia-smi";
  t.validate();
  return t;
}

}  // namespace pcie_ar::plan
