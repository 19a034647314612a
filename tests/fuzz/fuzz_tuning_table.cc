// libFuzzer target: arbitrary bytes into TuningTable::parse. A TableError naming the source is
// the expected way to refuse; any other exception, a crash, a sanitizer report or a broken
// invariant below is a bug. A table that parses must keep its promises: rows hold values in
// their documented ranges, the canonical text parses back to the same rules and hash, and
// choose() picks a row that matches (or falls back) for any call. See tests/fuzz/README.md.
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_check.h"
#include "plan/tuning_table.h"

namespace pcie_ar::plan {
namespace {

using fuzz::check;

constexpr std::string_view kSource = "fuzz.csv";

void check_row(const TableRow& row) {
  check(row.line >= 1, "row line is 1-based");
  check(!row.topology.empty(), "topology is never empty");
  check(row.world == -1 || row.world >= 1, "world is -1 (any) or >= 1");
  check(row.min_bytes >= 0, "min_bytes >= 0");
  check(row.max_bytes == -1 || row.max_bytes > row.min_bytes, "max_bytes is -1 or > min_bytes");
  check(row.fallback == (row.algorithm_text == "fallback"), "fallback iff algorithm is fallback");
  if (row.fallback) return;
  check(row.tactic.blocks >= 1, "blocks >= 1");
  check(row.tactic.threads >= 1, "threads >= 1");
  check(row.algorithm.has_value() == parse_algorithm(row.algorithm_text).has_value(),
        "known algorithms are recognised");
}

// Every message size worth probing for one row: both boundaries and their neighbours.
std::vector<int64_t> probe_bytes(const TableRow& row) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> out = {0, 1, kMax, row.min_bytes};
  if (row.min_bytes > 0) out.push_back(row.min_bytes - 1);
  if (row.max_bytes > 0) {
    out.push_back(row.max_bytes - 1);
    out.push_back(row.max_bytes);
  }
  return out;
}

void exercise(const TuningTable& table) {
  check(table.source() == kSource, "source is kept");
  check(!table.rows().empty(), "a table that parses has rows");
  for (const TableRow& row : table.rows()) check_row(row);

  // Round trip: the canonical text is itself a table with the same rules.
  const std::string canon = table.canonical_text();
  const TuningTable again = TuningTable::parse(canon, kSource);
  check(again.rows().size() == table.rows().size(), "canonical text keeps every row");
  check(again.canonical_text() == canon, "canonical text is a fixed point");
  check(again.hash() == table.hash(), "hash survives the round trip");

  // choose(): the deciding row matches the call; skipped rows are real rows.
  const RunnableCheck odd_blocks = [](const TableRow& row, int64_t) -> std::optional<std::string> {
    if (row.tactic.blocks % 2 == 1) return "odd blocks";
    return std::nullopt;
  };
  size_t probes = 0;
  for (const TableRow& row : table.rows()) {
    if (++probes > 64) break;  // keeps each input O(rows) rather than O(rows^2)
    const std::string key = row.topology == "*" ? "flat" : row.topology;
    const int world = row.world < 0 ? 8 : row.world;
    for (const int64_t bytes : probe_bytes(row)) {
      for (const DType dtype : kAllDTypes) {
        for (const RunnableCheck* why : {static_cast<const RunnableCheck*>(nullptr), &odd_blocks}) {
          const TableChoice c = table.choose(key, world, dtype, bytes, why ? *why : nullptr);
          check(c.line >= 0, "choice line >= 0");
          if (c.line > 0) {
            const TableRow* decided = nullptr;
            for (const TableRow& r : table.rows()) {
              if (r.line == c.line) decided = &r;
            }
            check(decided != nullptr, "the deciding line is a row");
            check(decided->matches(key, world, dtype, bytes), "the deciding row matches");
            check(c.fallback == decided->fallback, "fallback iff the deciding row says so");
            if (!c.fallback) check(c.tactic == decided->tactic, "the tactic is the row's");
          } else {
            check(c.fallback, "no deciding row means fallback");
          }
          for (const auto& [line, reason] : c.skipped) {
            check(line >= 1 && !reason.empty(), "skipped rows have a line and a reason");
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace pcie_ar::plan

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace pcie_ar::plan;
  using pcie_ar::fuzz::check;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  TuningTable table;
  try {
    table = TuningTable::parse(text, kSource);
  } catch (const TableError& e) {
    // Refusals name the source first, so an operator knows which file to fix.
    check(std::string_view(e.what()).substr(0, kSource.size()) == kSource,
          "errors start with the source name");
    check(pcie_ar::fuzz::is_clean_utf8(e.what()), "errors are clean UTF-8");
    return 0;
  }
  exercise(table);
  return 0;
}
