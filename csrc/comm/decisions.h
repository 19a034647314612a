// Which tactic runs a call, decided once per (op, dtype, message bytes) and table: the one
// decision cache of every op. A decision holds everything its calls need (the program installed
// in the workspace, the signature its flags carry, its counters), so a call decided before costs
// one lookup. Replacing the table forgets every decision, of every op, at once.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "comm/decline.h"
#include "comm/op.h"
#include "comm/options.h"
#include "comm/stats.h"
#include "plan/tactic.h"
#include "plan/tuning_table.h"

namespace pcie_ar::transport {
class Workspace;
}  // namespace pcie_ar::transport

namespace pcie_ar::comm {

// One (algorithm, direction, staged, protocol) of one op installed in the workspace for this
// rank, and how much it sends each peer.
struct InstalledProgram {
  int id = -1;                        // the workspace's program id
  std::vector<double> sent_fraction;  // per peer, as a multiple of the message
};

struct Decision {
  // kNone: the kernels run it; else why not: the table's choice (kTable) or the self-test's
  // withdrawal of the tactic the table chose (kSelfTest).
  Decline reason = Decline::kTable;
  bool fallback() const { return reason != Decline::kNone; }
  plan::Tactic tactic;
  // A kernel decision's:
  const InstalledProgram* program = nullptr;
  uint32_t signature = 0;    // op_signature(op, dtype, tactic)
  int64_t* calls = nullptr;  // the op's counter for this tactic
  // The fused call also counts as the all-reduce it holds: the all-reduce's counter.
  int64_t* contained_calls = nullptr;
};

// (op index, dtype, tactic label): what the self-test tests once and withdraws.
using TacticKey = std::tuple<size_t, int, std::string>;
inline TacticKey tactic_key(Op op, plan::DType dtype, const std::string& tactic_label) {
  return {op_index(op), static_cast<int>(dtype), tactic_label};
}

// One (op, dtype, tactic) the table chose for admitted messages, with every message size (bytes,
// ascending) it was decided for: what the self-test runs once (comm/self_test.h).
struct TacticUse {
  Op op;
  plan::DType dtype = plan::DType::kBF16;
  plan::Tactic tactic;
  std::vector<int64_t> bytes;
};

class Decisions {
 public:
  // Parses options.table_text (the embedded seed table when empty); throws plan::TableError.
  Decisions(const Options& options, Counters& counters);

  // The workspace programs are installed in and asked what it can run; set once the communicator
  // has one (an off communicator never decides).
  void use_workspace(transport::Workspace& workspace) { workspace_ = &workspace; }

  // The table's choice for `op` on a message of `bytes` (plan::TuningTable::decide: the fused
  // call decides as the all-reduce of its message does, a reduce-scatter or all-gather without a
  // row of its own takes the all-reduce's choice in two-shot form), with its program installed.
  // Logs the rows it skipped, once per decision.
  const Decision& decide(Op op, plan::DType dtype, int64_t bytes);

  // Decides every op for each dtype at every size where a choice can change (the table's row
  // edges and the LL capacity), so every program the table can pick is installed before a graph
  // capture. Returns the programs installed.
  int prepare(const std::vector<plan::DType>& dtypes);

  int installed() const { return static_cast<int>(programs_.size()); }

  // Every (op, dtype, tactic) decided so far that runs on the kernels, in one order on every rank
  // (op, dtype, tactic label).
  std::vector<TacticUse> uses() const;
  // From now on, whatever table decides, `op`'s `dtype` messages that the tactic labelled
  // `tactic` (plan::tactic_label) would run go to the fallback (Decline::kSelfTest); forgets every
  // decision so the next call asks again.
  void withdraw(Op op, plan::DType dtype, const std::string& tactic);

  // Makes `table` decide from now on, forgetting every decision of every op.
  void set_table(plan::TuningTable table);
  const plan::TuningTable& table() const { return table_; }

 private:
  std::optional<std::string> why_not_runnable(const plan::TableRow& row, int64_t bytes) const;
  const InstalledProgram& program_for(Op op, const plan::Tactic& tactic);

  const Options& options_;
  Counters& counters_;
  transport::Workspace* workspace_ = nullptr;
  plan::TuningTable table_;
  std::unordered_map<uint64_t, Decision> decisions_;
  std::map<std::tuple<int, int, int, int, size_t>, std::unique_ptr<InstalledProgram>> programs_;
  std::set<TacticKey> withdrawn_;  // withdraw(): kept across tables
};

}  // namespace pcie_ar::comm
