// The tuning table: CSV rules mapping (topology, world, dtype, message bytes) to a tactic or to
// the fallback. First matching *runnable* row wins; a row whose tactic cannot run here is
// skipped with a reason and matching continues (as RCCL's CSV tuner does); no match means
// fallback. Decisions are a pure function of the table and the call, so every rank that holds
// the same table (the handshake compares hash()) takes the same path.
//
//   topology,world,dtype,min_bytes,max_bytes,algorithm,direction,staged,blocks,threads,protocol
//   islands-2x4,8,bf16,0,16384,island_oneshot,push,0,8,256,ll
//   islands-2x4,8,bf16,16384,65536,island_oneshot,push,1,16,256
//   *,*,*,0,*,fallback,,,,
//
// min_bytes is inclusive, max_bytes exclusive, "*" matches anything. Topology keys that name a
// transport have a legacy spelling, accepted in the topology column and by choose() alike:
// "host" is "host_shm" (CPU tensors), "hostmem" is "cuda_host" (GPUs without peer-to-peer).
// Parsed rows hold the canonical key, so canonical_text() and hash() are the same either way.
// The eleventh column, protocol (flag, ll or lamport), is optional: absent or empty means flag, so
// ten-column tables stay valid.
//
// A row decides the all-reduce unless its algorithm names another collective before a colon:
//   *,*,*,0,65536,reduce_scatter:twoshot,push,0,1,256,ll
//   *,*,*,0,*,all_gather:fallback
// Such rows decide only that collective (plan/tactic.h), and all-reduce rows only the
// all-reduce; a table without rows for a collective leaves it to the caller (the Communicator
// derives it from the all-reduce's choice). Old tables have none: their text, rows and hash are
// what they were. Columns after the eleventh (measured times written by the
// tuner) are kept but never matched on.
//
// Integers are plain decimal digits checked against their range (world, blocks, threads:
// 1..2^31-1; min_bytes: 0..2^63-1; max_bytes: 1..2^63-1); a value past the range is an error,
// never a wrapped number. The text must be UTF-8 (a leading byte-order mark is skipped) with no
// control characters but tab (CRLF line ends are fine): a binary file is rejected on its first
// offending line as "not a text tuning table".
//
// No rows means a mistake, not "fall back for everything": parse() throws TableError when the
// text is empty or holds only comments, blank lines and a header. A table that wants every call
// to fall back says so with one row, "*,*,*,0,*,fallback". "No table given" is not parse()'s
// business: callers that hold no table text (an empty Options::table_text) use embedded().
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "plan/tactic.h"

namespace pcie_ar::plan {

class TableError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// `key` with a legacy transport key replaced by its canonical name; any other key unchanged.
std::string_view canonical_topology_key(std::string_view key);

struct TableRow {
  int line = 0;                // 1-based line in the source text
  std::string topology = "*";  // table key of the topology (canonical_topology_key), or "*"
  int world = -1;              // -1 = any
  std::optional<DType> dtype;  // nullopt = any
  int64_t min_bytes = 0;       // inclusive
  int64_t max_bytes = -1;      // exclusive; -1 = no bound
  bool fallback = false;
  std::string algorithm_text;                      // as written, so an unknown name can be reported
  Collective collective = Collective::kAllReduce;  // the collective the row decides
  std::optional<Algorithm> algorithm;
  Tactic tactic;
  std::vector<std::string> extra;  // columns after the eleventh

  bool matches(std::string_view topology_key, int world, DType dtype, int64_t bytes) const;
};

// Why a row's tactic cannot run a message of `bytes` on this communicator (world, workspace,
// topology), or nullopt. Must depend only on what every rank agrees on.
using RunnableCheck = std::function<std::optional<std::string>(const TableRow&, int64_t bytes)>;

struct TableChoice {
  bool fallback = true;
  Tactic tactic;
  int line = 0;  // row that decided; 0 when nothing matched
  // Rows that matched but could not run: (line, reason).
  std::vector<std::pair<int, std::string>> skipped;
};

class TuningTable {
 public:
  // Throws TableError naming `source` and the line: "table.csv line 4: expected 10 columns
  // (topology,world,...), found 7", "table.csv line 2: column blocks must be an integer in
  // 1..2147483647, got '2147483648' (out of range)"; or "table.csv: the table has no rows ...".
  static TuningTable parse(std::string_view text, std::string_view source = "table");
  // The seed table compiled into the library.
  static TuningTable embedded();
  static std::string_view embedded_text();

  // The first matching runnable row of `collective` for a call; topology_key may be a legacy
  // key. line 0: no row of the collective matched and ran.
  TableChoice choose(std::string_view topology_key, int world, DType dtype, int64_t bytes,
                     const RunnableCheck& why_not_runnable,
                     Collective collective = Collective::kAllReduce) const;

  // What decides a call of `collective`: choose() for it; a reduce-scatter or all-gather that
  // no row of its own decides (line 0) takes the all-reduce's choice for the same message in
  // its two-shot form (two_shot_form: same direction, staging, protocol and launch shape; an
  // all-gather takes LL for lamport), or
  // the fallback where the all-reduce's is. `skipped` holds the rows skipped on the way, both
  // lookups'. A table may so tune the halves apart from the all-reduce, or not at all.
  TableChoice decide(std::string_view topology_key, int world, DType dtype, int64_t bytes,
                     const RunnableCheck& why_not_runnable, Collective collective) const;

  const std::vector<TableRow>& rows() const { return rows_; }
  const std::string& source() const { return source_; }
  // FNV-1a over the canonical text of the matched columns: comments, spacing and extra
  // columns do not change it; any rule does.
  uint64_t hash() const;
  std::string canonical_text() const;

 private:
  std::vector<TableRow> rows_;
  std::string source_;
};

}  // namespace pcie_ar::plan
