#include "plan/tuning_table.h"

#include <charconv>
#include <string>

#include "plan/hash.h"
#include "plan/text.h"

namespace pcie_ar::plan {
namespace {

constexpr std::string_view kSeedTable =
    R"csv(# Seed table compiled into pcie_allreduce; PCIE_ALLREDUCE_TABLE names a file that replaces it.
# docs/tuning.md says which rows were measured and which are estimates from the cost model.
topology,world,dtype,min_bytes,max_bytes,algorithm,direction,staged,blocks,threads,protocol
# Host shared-memory transport (CPU tensors), measured on the 2-core CI VM: one thread per rank
# walks one slice. Past a few tens of KiB, reducing half the message each (twoshot) beats
# reducing all of it. LL loses here at every size (x86 releases are free; LL doubles the bytes).
host,2,*,0,32768,oneshot,push,0,1,32
host,2,*,32768,*,twoshot,push,0,1,32
host,*,*,0,65536,oneshot,push,0,1,32
host,*,*,65536,*,twoshot,push,0,1,32
# NVLink-connected GPUs belong to the serving engine's own custom all-reduce.
nvlink,*,*,0,*,fallback,,,,
# GPU rows below are ESTIMATES (cost model, not yet measured on a real PCIe host).
# Two sockets: reduce inside each island and cross the socket link once. Decode sizes use LL
# (no fence, no flag, local polls only); then one fence per phase with parallel flags.
islands-2x4,8,*,0,16384,island_oneshot,push,0,8,256,ll
islands-2x4,8,*,16384,131072,island_oneshot,push,0,16,256
islands-2x4,8,*,131072,*,island_twoshot,push,1,32,512
islands-2x3,6,*,0,16384,island_oneshot,push,0,8,256,ll
islands-2x3,6,*,16384,131072,island_oneshot,push,0,16,256
islands-2x3,6,*,131072,*,island_twoshot,push,1,32,512
islands-2x2,4,*,0,16384,island_oneshot,push,0,8,256,ll
islands-2x2,4,*,16384,131072,island_oneshot,push,0,16,256
islands-2x2,4,*,131072,*,island_twoshot,push,1,32,512
# One switch or root complex.
*,*,*,0,16384,oneshot,push,0,8,256,ll
*,2,*,0,*,oneshot,push,0,16,256
*,*,*,0,131072,oneshot,push,0,16,256
*,*,*,131072,*,twoshot,push,1,32,512
*,*,*,0,*,fallback,,,,
)csv";

constexpr std::string_view kHeader =
    "topology,world,dtype,min_bytes,max_bytes,algorithm,direction,staged,blocks,threads";
constexpr size_t kProtocolColumn = 10;

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

class RowParser {
 public:
  RowParser(std::string_view source, int line) : source_(source), line_(line) {}

  [[noreturn]] void fail(const std::string& what) const {
    throw TableError(std::string(source_) + " line " + std::to_string(line_) + ": " + what);
  }

  int64_t integer(std::string_view cell, std::string_view column, int64_t min) const {
    int64_t value = 0;
    const auto [end, ec] = std::from_chars(cell.data(), cell.data() + cell.size(), value);
    if (ec != std::errc() || end != cell.data() + cell.size() || value < min) {
      fail("column " + std::string(column) + " must be an integer >= " + std::to_string(min) +
           " or '*', got '" + std::string(cell) + "'");
    }
    return value;
  }

  // One rule from its cells (at least the first six; a tactic needs all ten).
  TableRow row(const std::vector<std::string_view>& cells) const {
    if (cells.size() < 6) fail_columns(cells.size());
    TableRow row;
    row.line = line_;
    row.topology = std::string(cells[0]);
    if (row.topology.empty()) fail("column topology is empty (use '*' for any)");
    row.world = cells[1] == "*" ? -1 : static_cast<int>(integer(cells[1], "world", 1));
    if (cells[2] != "*") {
      row.dtype = parse_dtype(cells[2]);
      if (!row.dtype) {
        fail("column dtype must be bf16, fp16, fp32 or '*', got '" + std::string(cells[2]) + "'");
      }
    }
    row.min_bytes = integer(cells[3], "min_bytes", 0);
    row.max_bytes = cells[4] == "*" ? -1 : integer(cells[4], "max_bytes", 1);
    if (row.max_bytes >= 0 && row.max_bytes <= row.min_bytes) {
      fail("max_bytes (" + std::to_string(row.max_bytes) + ") must exceed min_bytes (" +
           std::to_string(row.min_bytes) + ")");
    }
    row.algorithm_text = std::string(cells[5]);
    row.fallback = row.algorithm_text == "fallback";
    if (!row.fallback) read_tactic(cells, row);
    for (size_t i = kProtocolColumn + 1; i < cells.size(); ++i) row.extra.emplace_back(cells[i]);
    return row;
  }

 private:
  [[noreturn]] void fail_columns(size_t found) const {
    fail("expected 10 columns (" + std::string(kHeader) + "), found " + std::to_string(found));
  }

  void read_tactic(const std::vector<std::string_view>& cells, TableRow& row) const {
    if (cells.size() < 10) fail_columns(cells.size());
    row.algorithm = parse_algorithm(cells[5]);  // unknown: kept, skipped when matched
    if (row.algorithm) row.tactic.algorithm = *row.algorithm;
    const auto direction = parse_direction(cells[6]);
    if (!direction) {
      fail("column direction must be push or pull, got '" + std::string(cells[6]) + "'");
    }
    row.tactic.direction = *direction;
    if (cells[7] != "0" && cells[7] != "1") {
      fail("column staged must be 0 or 1, got '" + std::string(cells[7]) + "'");
    }
    row.tactic.staged = cells[7] == "1";
    row.tactic.blocks = static_cast<int>(integer(cells[8], "blocks", 1));
    row.tactic.threads = static_cast<int>(integer(cells[9], "threads", 1));
    if (cells.size() > kProtocolColumn && !cells[kProtocolColumn].empty()) {
      const auto protocol = parse_protocol(cells[kProtocolColumn]);
      if (!protocol) {
        fail("column protocol must be flag or ll (or empty for flag), got '" +
             std::string(cells[kProtocolColumn]) + "'");
      }
      row.tactic.protocol = *protocol;
    }
  }

  std::string_view source_;
  int line_;
};

}  // namespace

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
  int line_no = 0;
  size_t pos = 0;
  while (pos <= text.size()) {
    const size_t eol = text.find('\n', pos);
    std::string_view line = text.substr(pos, eol == std::string_view::npos ? eol : eol - pos);
    pos = eol == std::string_view::npos ? text.size() + 1 : eol + 1;
    ++line_no;
    if (const size_t hash = line.find('#'); hash != std::string_view::npos)
      line = line.substr(0, hash);
    line = trim(line);
    if (line.empty()) continue;
    const auto cells = split(line);
    RowParser p(source, line_no);
    if (cells[0] == "topology") {
      if (line != kHeader && line.substr(0, kHeader.size()) != kHeader) {
        p.fail("header must start with '" + std::string(kHeader) + "'");
      }
      continue;
    }
    table.rows_.push_back(p.row(cells));
  }
  return table;
}

std::string_view TuningTable::embedded_text() { return kSeedTable; }

TuningTable TuningTable::embedded() { return parse(kSeedTable, "embedded seed table"); }

TableChoice TuningTable::choose(std::string_view topology_key, int world, DType dtype,
                                int64_t bytes, const RunnableCheck& why_not_runnable) const {
  TableChoice choice;
  for (const TableRow& row : rows_) {
    if (!row.matches(topology_key, world, dtype, bytes)) continue;
    if (row.fallback) {
      choice.line = row.line;
      return choice;
    }
    std::optional<std::string> why;
    if (!row.algorithm) {
      why = "unknown algorithm '" + row.algorithm_text +
            "' (expected oneshot, twoshot, island_oneshot, island_twoshot or fallback)";
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
