#include "plan/tuning_table.h"

#include <charconv>
#include <iterator>
#include <limits>
#include <string>
#include <utility>

#include "plan/hash.h"
#include "plan/text.h"

namespace pcie_ar::plan {
namespace {

constexpr std::string_view kSeedTable =
    R"csv(# Seed table compiled into pcie_allreduce; PCIE_ALLREDUCE_TABLE names a file that replaces it.
# docs/tuning.md says which rows were measured and which are estimates from the cost model.
topology,world,dtype,min_bytes,max_bytes,algorithm,direction,staged,blocks,threads,protocol
# The host_shm transport (CPU tensors), measured on the 2-core CI VM: one thread per rank
# walks one slice. Past a few tens of KiB, reducing half the message each (twoshot) beats
# reducing all of it. LL loses here at every size (x86 releases are free; LL doubles the bytes).
# From 256 KiB (world 2) or 1 MiB, pull: each rank stages its chunks in its own memory and the
# reducer reads them there, instead of writing into the peer's cache lines (5-25 % faster in
# interleaved runs, docs/benchmarks.md).
host_shm,2,*,0,32768,oneshot,push,0,1,32
host_shm,2,*,32768,262144,twoshot,push,0,1,32
host_shm,2,*,262144,*,twoshot,pull,0,1,32
host_shm,*,*,0,65536,oneshot,push,0,1,32
host_shm,*,*,65536,1048576,twoshot,push,0,1,32
host_shm,*,*,1048576,*,twoshot,pull,0,1,32
# The reduce-scatter and all-gather: the all-reduce's rows in two-shot form, measured
# against the alternatives at world 2 (flag push and pull within a few %, LL and lamport 2-5x
# slower, docs/benchmarks.md).
host_shm,2,*,0,262144,reduce_scatter:twoshot,push,0,1,32
host_shm,2,*,262144,*,reduce_scatter:twoshot,pull,0,1,32
host_shm,*,*,0,1048576,reduce_scatter:twoshot,push,0,1,32
host_shm,*,*,1048576,*,reduce_scatter:twoshot,pull,0,1,32
host_shm,2,*,0,262144,all_gather:twoshot,push,0,1,32
host_shm,2,*,262144,*,all_gather:twoshot,pull,0,1,32
host_shm,*,*,0,1048576,all_gather:twoshot,push,0,1,32
host_shm,*,*,1048576,*,all_gather:twoshot,pull,0,1,32
# NVLink-connected GPUs belong to the serving engine's own custom all-reduce.
nvlink,*,*,0,*,fallback,,,,
nvlink,*,*,0,*,reduce_scatter:fallback,,,,
nvlink,*,*,0,*,all_gather:fallback,,,,
# GPU rows: ESTIMATES from the cost model (csrc/plan/cost_model.h), not yet measured on a real
# PCIe host; regenerate them with `python -m pcie_allreduce.tuning.model` after a refit (a test
# holds them equal to the model). Per bucket, the tactic with the lowest modelled time of one
# call; push only over P2P (pull is the fabric's call: only a tune may pick it). Decode sizes
# take lamport: LL's steps with the payload moved once; all-gathers take LL, since lamport stores
# -0 as +0 and an all-gather moves every bit.
# Each family's reduce-scatter and all-gather rows follow its all-reduce rows, each
# collective judged on its own modelled cost: flat two-shot halves at decode sizes, the island
# forms where crossing the socket link once per chunk pays.
# GPUs without peer-to-peer (the cuda_host transport: every workspace in shared pinned host
# memory): every poll is a PCIe read of host DRAM and every slot byte crosses the GPU's link.
cuda_host,2,*,0,131072,oneshot,push,0,8,256,lamport
cuda_host,2,*,131072,*,oneshot,push,0,32,512
cuda_host,2,*,0,262144,reduce_scatter:twoshot,push,0,8,256,lamport
cuda_host,2,*,262144,*,reduce_scatter:twoshot,push,0,32,512
cuda_host,2,*,0,65536,all_gather:twoshot,push,0,8,256,ll
cuda_host,2,*,65536,131072,all_gather:twoshot,push,0,16,256
cuda_host,2,*,131072,*,all_gather:twoshot,push,0,32,512
cuda_host,4,*,0,32768,oneshot,push,0,8,256,lamport
cuda_host,4,*,32768,131072,oneshot,push,0,16,256
cuda_host,4,*,131072,262144,oneshot,push,0,32,512
cuda_host,4,*,262144,*,twoshot,push,0,32,512
cuda_host,4,*,0,131072,reduce_scatter:twoshot,push,0,8,256,lamport
cuda_host,4,*,131072,*,reduce_scatter:twoshot,push,0,32,512
cuda_host,4,*,0,65536,all_gather:twoshot,push,0,8,256,ll
cuda_host,4,*,65536,131072,all_gather:twoshot,push,0,16,256
cuda_host,4,*,131072,*,all_gather:twoshot,push,0,32,512
cuda_host,*,*,0,16384,oneshot,push,0,8,256,lamport
cuda_host,*,*,16384,131072,oneshot,push,0,16,256
cuda_host,*,*,131072,*,twoshot,push,0,32,512
cuda_host,*,*,0,131072,reduce_scatter:twoshot,push,0,8,256,lamport
cuda_host,*,*,131072,*,reduce_scatter:twoshot,push,0,32,512
cuda_host,*,*,0,65536,all_gather:twoshot,push,0,8,256,ll
cuda_host,*,*,65536,131072,all_gather:twoshot,push,0,16,256
cuda_host,*,*,131072,*,all_gather:twoshot,push,0,32,512
# Two sockets: each rank's flow across the socket link is priced on its own (a per-flow rate):
# the flat forms at the smallest sizes, the island forms where crossing once per chunk pays.
islands-2x4,8,*,0,8192,oneshot,push,0,8,256,lamport
islands-2x4,8,*,8192,32768,island_oneshot,push,0,8,256,lamport
islands-2x4,8,*,32768,262144,island_twoshot,push,0,8,256,lamport
islands-2x4,8,*,262144,524288,twoshot,push,0,32,512
islands-2x4,8,*,524288,*,island_twoshot,push,1,32,512
islands-2x4,8,*,0,262144,reduce_scatter:twoshot,push,0,8,256,lamport
islands-2x4,8,*,262144,1048576,reduce_scatter:twoshot,push,0,32,512
islands-2x4,8,*,1048576,*,reduce_scatter:island_twoshot,push,1,32,512
islands-2x4,8,*,0,65536,all_gather:twoshot,push,0,8,256,ll
islands-2x4,8,*,65536,131072,all_gather:twoshot,push,0,16,256
islands-2x4,8,*,131072,1048576,all_gather:twoshot,push,0,32,512
islands-2x4,8,*,1048576,*,all_gather:island_twoshot,push,1,32,512
islands-2x3,6,*,0,16384,oneshot,push,0,8,256,lamport
islands-2x3,6,*,16384,32768,island_oneshot,push,0,8,256,lamport
islands-2x3,6,*,32768,262144,island_twoshot,push,0,8,256,lamport
islands-2x3,6,*,262144,*,island_twoshot,push,1,32,512
islands-2x3,6,*,0,262144,reduce_scatter:twoshot,push,0,8,256,lamport
islands-2x3,6,*,262144,1048576,reduce_scatter:twoshot,push,0,32,512
islands-2x3,6,*,1048576,*,reduce_scatter:island_twoshot,push,1,32,512
islands-2x3,6,*,0,65536,all_gather:twoshot,push,0,8,256,ll
islands-2x3,6,*,65536,131072,all_gather:twoshot,push,0,16,256
islands-2x3,6,*,131072,1048576,all_gather:twoshot,push,0,32,512
islands-2x3,6,*,1048576,*,all_gather:island_twoshot,push,1,32,512
islands-2x2,4,*,0,16384,oneshot,push,0,8,256,lamport
islands-2x2,4,*,16384,131072,island_oneshot,push,0,8,256,lamport
islands-2x2,4,*,131072,262144,island_twoshot,push,0,8,256,lamport
islands-2x2,4,*,262144,*,island_twoshot,push,0,32,512
islands-2x2,4,*,0,131072,reduce_scatter:twoshot,push,0,8,256,lamport
islands-2x2,4,*,131072,262144,reduce_scatter:island_twoshot,push,0,8,256,lamport
islands-2x2,4,*,262144,524288,reduce_scatter:twoshot,push,0,32,512
islands-2x2,4,*,524288,*,reduce_scatter:island_twoshot,push,0,32,512
islands-2x2,4,*,0,65536,all_gather:twoshot,push,0,8,256,ll
islands-2x2,4,*,65536,262144,all_gather:island_twoshot,push,0,8,256,ll
islands-2x2,4,*,262144,524288,all_gather:twoshot,push,0,32,512
islands-2x2,4,*,524288,*,all_gather:island_twoshot,push,0,32,512
# One switch or root complex.
*,2,*,0,262144,oneshot,push,0,8,256,lamport
*,2,*,262144,*,oneshot,push,0,32,512
*,2,*,0,262144,reduce_scatter:twoshot,push,0,8,256,lamport
*,2,*,262144,*,reduce_scatter:twoshot,push,0,32,512
*,2,*,0,262144,all_gather:twoshot,push,0,8,256,ll
*,2,*,262144,*,all_gather:twoshot,push,0,32,512
*,4,*,0,32768,oneshot,push,0,8,256,lamport
*,4,*,32768,262144,twoshot,push,0,8,256,lamport
*,4,*,262144,524288,twoshot,push,0,32,512
*,4,*,524288,*,twoshot,push,1,32,512
*,4,*,0,262144,reduce_scatter:twoshot,push,0,8,256,lamport
*,4,*,262144,524288,reduce_scatter:twoshot,push,0,32,512
*,4,*,524288,*,reduce_scatter:twoshot,push,1,32,512
*,4,*,0,131072,all_gather:twoshot,push,0,8,256,ll
*,4,*,131072,524288,all_gather:twoshot,push,0,32,512
*,4,*,524288,*,all_gather:twoshot,push,1,32,512
*,*,*,0,16384,oneshot,push,0,8,256,lamport
*,*,*,16384,262144,twoshot,push,0,8,256,lamport
*,*,*,262144,1048576,twoshot,push,0,32,512
*,*,*,1048576,*,twoshot,push,1,32,512
*,*,*,0,*,fallback,,,,
*,*,*,0,262144,reduce_scatter:twoshot,push,0,8,256,lamport
*,*,*,262144,1048576,reduce_scatter:twoshot,push,0,32,512
*,*,*,1048576,*,reduce_scatter:twoshot,push,1,32,512
*,*,*,0,65536,all_gather:twoshot,push,0,8,256,ll
*,*,*,65536,131072,all_gather:twoshot,push,0,16,256
*,*,*,131072,1048576,all_gather:twoshot,push,0,32,512
*,*,*,1048576,*,all_gather:twoshot,push,1,32,512
)csv";

// Keys that name a transport, by the names tables and callers used before the transports had
// theirs: {legacy, canonical}.
constexpr std::pair<std::string_view, std::string_view> kLegacyTopologyKeys[] = {
    {"host", "host_shm"},      // CPU tensors
    {"hostmem", "cuda_host"},  // GPUs without peer-to-peer
};

constexpr std::string_view kHeader =
    "topology,world,dtype,min_bytes,max_bytes,algorithm,direction,staged,blocks,threads";
constexpr std::string_view kHeaderColumns[] = {"topology",  "world",     "dtype",     "min_bytes",
                                               "max_bytes", "algorithm", "direction", "staged",
                                               "blocks",    "threads"};
constexpr size_t kProtocolColumn = 10;
constexpr std::string_view kUtf8Bom = "\xEF\xBB\xBF";
constexpr int64_t kIntMax = std::numeric_limits<int>::max();  // world, blocks, threads are int
constexpr int64_t kBytesMax = std::numeric_limits<int64_t>::max();

std::vector<std::string_view> split(std::string_view line) {
  std::vector<std::string_view> cells;
  size_t start = 0;
  while (true) {
    const size_t comma = line.find(',', start);
    cells.push_back(trim(line.substr(start, comma - start)));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return cells;
}

// Length of the well-formed UTF-8 sequence starting at s[i], or 0: overlong forms, surrogates,
// code points past U+10FFFF and truncated sequences are not text.
size_t utf8_length(std::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char lead = byte(i);
  if (lead < 0x80) return 1;
  size_t n = 0;
  unsigned char lo = 0x80;  // range of the second byte; later bytes are always 0x80..0xBF
  unsigned char hi = 0xBF;
  if (lead >= 0xC2 && lead <= 0xDF) {
    n = 2;
  } else if (lead >= 0xE0 && lead <= 0xEF) {
    n = 3;
    if (lead == 0xE0) lo = 0xA0;
    if (lead == 0xED) hi = 0x9F;
  } else if (lead >= 0xF0 && lead <= 0xF4) {
    n = 4;
    if (lead == 0xF0) lo = 0x90;
    if (lead == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (n > s.size() - i || byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k) {
    if (byte(i + k) < 0x80 || byte(i + k) > 0xBF) return 0;
  }
  return n;
}

std::string hex_byte(unsigned char c) {
  constexpr char kDigits[] = "0123456789abcdef";
  return std::string("0x") + kDigits[c >> 4] + kDigits[c & 0xF];
}

// A cell as quoted in an error: at most 40 bytes, cut on a character boundary, so a message
// about a huge or multi-byte cell stays short and valid UTF-8 (Python decodes it).
std::string quoted(std::string_view cell) {
  constexpr size_t kMax = 40;
  if (cell.size() <= kMax) return "'" + std::string(cell) + "'";
  size_t cut = kMax;
  while (cut > 0 && (static_cast<unsigned char>(cell[cut]) & 0xC0) == 0x80) --cut;
  return "'" + std::string(cell.substr(0, cut)) + "...' (" + std::to_string(cell.size()) +
         " bytes)";
}

class RowParser {
 public:
  RowParser(std::string_view source, int line) : source_(source), line_(line) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw TableError(std::string(source_) + " line " + std::to_string(line_) + ": " + what);
  }

  // Rejects a line that is not text: bytes that are not UTF-8 and every control byte but tab
  // and a CR that ends the line (CRLF files); also a byte-order mark (parse() skips the one
  // that may start the text). Error messages quote cells, so a table that
  // parses this far yields messages that are clean text. A binary file fails on its first line.
  void check_text(std::string_view line) const {
    for (size_t i = 0; i < line.size();) {
      const auto c = static_cast<unsigned char>(line[i]);
      if (c >= 0x80) {
        const size_t n = utf8_length(line, i);
        if (n == 0) fail_binary("byte " + hex_byte(c) + " that is not UTF-8", i);
        if (line.substr(i, kUtf8Bom.size()) == kUtf8Bom) {
          // Invisible inside a cell: "\uFEFFislands-2x4" would never match its topology.
          fail("byte-order mark (U+FEFF, invisible) at byte " + std::to_string(i + 1) +
               " of the line; only the start of the file may hold one");
        }
        i += n;
        continue;
      }
      const bool allowed = c == '\t' || (c == '\r' && i + 1 == line.size());
      if ((c < 0x20 && !allowed) || c == 0x7F) fail_binary("control byte " + hex_byte(c), i);
      ++i;
    }
  }

  // A whole cell holding a decimal integer in [min, max]; anything else (empty, a sign or
  // junk around the digits, a value past the range or past int64) fails naming the column,
  // the value and the range.
  int64_t integer(std::string_view cell, std::string_view column, int64_t min, int64_t max,
                  bool wildcard) const {
    int64_t value = 0;
    const char* const last = cell.data() + cell.size();
    const auto [end, ec] = std::from_chars(cell.data(), last, value);
    const bool whole = end == last && !cell.empty();
    if (ec == std::errc() && whole && value >= min && value <= max) return value;
    const bool out_of_range = whole && (ec == std::errc() || ec == std::errc::result_out_of_range);
    const char* why = cell.empty()   ? " (the field is empty)"
                      : out_of_range ? " (out of range)"
                                     : " (not a decimal integer)";
    fail("column " + std::string(column) + " must be an integer in " + std::to_string(min) + ".." +
         std::to_string(max) + (wildcard ? " or '*'" : "") + ", got " + quoted(cell) + why);
  }

  // One rule from its cells (at least the first six; a tactic needs all ten).
  TableRow row(const std::vector<std::string_view>& cells) const {
    if (cells.size() < 6) fail_columns(cells.size());
    TableRow row;
    row.line = line_;
    row.topology = std::string(canonical_topology_key(cells[0]));
    if (row.topology.empty()) fail("column topology is empty (use '*' for any)");
    row.world =
        cells[1] == "*" ? -1 : static_cast<int>(integer(cells[1], "world", 1, kIntMax, true));
    if (cells[2] != "*") {
      row.dtype = parse_dtype(cells[2]);
      if (!row.dtype) {
        fail("column dtype must be " + kDTypeNames.list() + " or '*', got " + quoted(cells[2]));
      }
    }
    row.min_bytes = integer(cells[3], "min_bytes", 0, kBytesMax, false);
    row.max_bytes = cells[4] == "*" ? -1 : integer(cells[4], "max_bytes", 1, kBytesMax, true);
    if (row.max_bytes >= 0 && row.max_bytes <= row.min_bytes) {
      fail("max_bytes (" + std::to_string(row.max_bytes) + ") must exceed min_bytes (" +
           std::to_string(row.min_bytes) + ")");
    }
    row.algorithm_text = std::string(cells[5]);
    std::string_view algorithm = cells[5];
    if (const size_t colon = algorithm.find(':'); colon != std::string_view::npos) {
      const auto collective = parse_collective(algorithm.substr(0, colon));
      if (!collective) {
        fail("column algorithm: " + quoted(algorithm.substr(0, colon)) +
             " before ':' is not a collective (expected " + kCollectiveNames.list() +
             ", as in reduce_scatter:twoshot)");
      }
      row.collective = *collective;
      algorithm.remove_prefix(colon + 1);
    }
    row.fallback = algorithm == "fallback";
    if (!row.fallback) read_tactic(cells, algorithm, row);
    for (size_t i = kProtocolColumn + 1; i < cells.size(); ++i) row.extra.emplace_back(cells[i]);
    return row;
  }

  // The header names the first ten columns in order; more (protocol, measured times) may follow.
  void header(const std::vector<std::string_view>& cells) const {
    bool ok = cells.size() >= std::size(kHeaderColumns);
    for (size_t i = 0; ok && i < std::size(kHeaderColumns); ++i) ok = cells[i] == kHeaderColumns[i];
    if (!ok) fail("header must start with '" + std::string(kHeader) + "'");
  }

 private:
  [[noreturn]] void fail_columns(size_t found) const {
    fail("expected 10 columns (" + std::string(kHeader) + "), found " + std::to_string(found));
  }

  [[noreturn]] void fail_binary(const std::string& what, size_t offset) const {
    fail("not a text tuning table: " + what + " at byte " + std::to_string(offset + 1) +
         " of the line; expected UTF-8 CSV text without control characters (tab aside)");
  }

  void read_tactic(const std::vector<std::string_view>& cells, std::string_view algorithm,
                   TableRow& row) const {
    if (cells.size() < 10) fail_columns(cells.size());
    row.algorithm = parse_algorithm(algorithm);  // unknown: kept, skipped when matched
    if (row.algorithm) row.tactic.algorithm = *row.algorithm;
    const auto direction = parse_direction(cells[6]);
    if (!direction) {
      fail("column direction must be " + kDirectionNames.list(" or ") + ", got " +
           quoted(cells[6]));
    }
    row.tactic.direction = *direction;
    if (cells[7] != "0" && cells[7] != "1") {
      fail("column staged must be 0 or 1, got " + quoted(cells[7]));
    }
    row.tactic.staged = cells[7] == "1";
    row.tactic.blocks = static_cast<int>(integer(cells[8], "blocks", 1, kIntMax, false));
    row.tactic.threads = static_cast<int>(integer(cells[9], "threads", 1, kIntMax, false));
    if (cells.size() > kProtocolColumn && !cells[kProtocolColumn].empty()) {
      const auto protocol = parse_protocol(cells[kProtocolColumn]);
      if (!protocol) {
        fail("column protocol must be " + kProtocolNames.list(" or ") +
             " (or empty for flag), got " + quoted(cells[kProtocolColumn]));
      }
      row.tactic.protocol = *protocol;
    }
  }

  std::string_view source_;
  int line_;
};

}  // namespace

std::string_view canonical_topology_key(std::string_view key) {
  for (const auto& [legacy, canonical] : kLegacyTopologyKeys) {
    if (key == legacy) return canonical;
  }
  return key;
}

bool TableRow::matches(std::string_view topology_key, int w, DType d, int64_t bytes) const {
  if (topology != "*" && topology != topology_key) return false;
  if (world >= 0 && world != w) return false;
  if (dtype && *dtype != d) return false;
  if (bytes < min_bytes) return false;
  return max_bytes < 0 || bytes < max_bytes;
}

TuningTable TuningTable::parse(std::string_view text, std::string_view source) {
  TuningTable table;
  table.source_ = std::string(source);
  if (text.substr(0, kUtf8Bom.size()) == kUtf8Bom) text.remove_prefix(kUtf8Bom.size());
  int line_no = 0;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t eol = text.find('\n', pos);
    std::string_view line = text.substr(pos, eol == std::string_view::npos ? eol : eol - pos);
    pos = eol == std::string_view::npos ? text.size() + 1 : eol + 1;
    if (line_no == std::numeric_limits<int>::max()) {
      RowParser(source, line_no).fail("too many lines for a tuning table");
    }
    ++line_no;
    const RowParser p(source, line_no);
    p.check_text(line);
    if (const size_t hash = line.find('#'); hash != std::string_view::npos)
      line = line.substr(0, hash);
    line = trim(line);
    if (line.empty()) continue;
    const auto cells = split(line);
    if (cells[0] == "topology") {
      p.header(cells);
      continue;
    }
    table.rows_.push_back(p.row(cells));
  }
  if (table.rows_.empty()) {
    throw TableError(std::string(source) +
                     ": the table has no rows (the text is empty or holds only comments, blank "
                     "lines and a header); write '*,*,*,0,*,fallback' to send every call to the "
                     "fallback, or give no table to use the embedded seed");
  }
  return table;
}

std::string_view TuningTable::embedded_text() { return kSeedTable; }

TuningTable TuningTable::embedded() { return parse(kSeedTable, "embedded seed table"); }

TableChoice TuningTable::choose(std::string_view topology_key, int world, DType dtype,
                                int64_t bytes, const RunnableCheck& why_not_runnable,
                                Collective collective) const {
  TableChoice choice;
  const std::string_view key = canonical_topology_key(topology_key);  // rows hold canonical keys
  for (const TableRow& row : rows_) {
    if (row.collective != collective || !row.matches(key, world, dtype, bytes)) continue;
    if (row.fallback) {
      choice.line = row.line;
      return choice;
    }
    std::optional<std::string> why;
    if (!row.algorithm) {
      why = "unknown algorithm '" + row.algorithm_text + "' (expected " + kAlgorithmNames.list() +
            " or fallback)";
    } else if (why_not_runnable) {
      why = why_not_runnable(row, bytes);
    }
    if (why) {
      choice.skipped.emplace_back(row.line, *why);
      continue;
    }
    choice.fallback = false;
    choice.tactic = row.tactic;
    choice.line = row.line;
    return choice;
  }
  return choice;
}

TableChoice TuningTable::decide(std::string_view topology_key, int world, DType dtype,
                                int64_t bytes, const RunnableCheck& why_not_runnable,
                                Collective collective) const {
  TableChoice own = choose(topology_key, world, dtype, bytes, why_not_runnable, collective);
  if (collective == Collective::kAllReduce || own.line != 0) return own;
  TableChoice all_reduce = choose(topology_key, world, dtype, bytes, why_not_runnable);
  all_reduce.tactic = two_shot_form(all_reduce.tactic, collective);
  all_reduce.skipped.insert(all_reduce.skipped.begin(), own.skipped.begin(), own.skipped.end());
  return all_reduce;
}

std::string TuningTable::canonical_text() const {
  std::string text;
  for (const TableRow& r : rows_) {
    text += r.topology + "," + (r.world < 0 ? "*" : std::to_string(r.world)) + "," +
            (r.dtype ? std::string(dtype_name(*r.dtype)) : "*") + "," +
            std::to_string(r.min_bytes) + "," +
            (r.max_bytes < 0 ? "*" : std::to_string(r.max_bytes)) + "," + r.algorithm_text;
    if (!r.fallback) {
      text += "," + std::string(direction_name(r.tactic.direction)) + "," +
              (r.tactic.staged ? "1" : "0") + "," + std::to_string(r.tactic.blocks) + "," +
              std::to_string(r.tactic.threads);
      // Ten-column rows keep their old canonical text (and hash); only LL rows grow.
      if (r.tactic.protocol != Protocol::kFlag) {
        text += "," + std::string(protocol_name(r.tactic.protocol));
      }
    }
    text += "\n";
  }
  return text;
}

uint64_t TuningTable::hash() const { return fnv1a(canonical_text()); }

}  // namespace pcie_ar::plan
