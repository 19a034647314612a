#include "comm/decisions.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <utility>

#include "plan/layout.h"
#include "plan/verify.h"
#include "transport/workspace.h"

namespace pcie_ar::comm {
namespace {

plan::TuningTable parse_table(const Options& options) {
  return options.table_text.empty()
             ? plan::TuningTable::embedded()
             : plan::TuningTable::parse(options.table_text, options.table_source);
}

// One key for every op: the op's row in the stats table, the dtype and the message's bytes.
uint64_t decision_key(Op op, plan::DType dtype, int64_t bytes) {
  return (static_cast<uint64_t>(op_index(op)) << 60) | (static_cast<uint64_t>(dtype) << 56) |
         static_cast<uint64_t>(bytes);
}
constexpr uint64_t kBytesMask = (uint64_t{1} << 56) - 1;

}  // namespace

Decisions::Decisions(const Options& options, Counters& counters)
    : options_(options), counters_(counters), table_(parse_table(options)) {}

std::optional<std::string> Decisions::why_not_runnable(const plan::TableRow& row,
                                                       int64_t bytes) const {
  const plan::Tactic& t = row.tactic;
  if (auto why = plan::why_unsupported(t, options_.world, options_.island_of, row.collective)) {
    return why;
  }
  // The layout is agreed by every rank (handshake), so this depends only on the call's size.
  const int64_t ll_capacity = workspace_->layout().ll_capacity_bytes;
  if (plan::flag_in_data(t.protocol) && bytes > ll_capacity) {
    return "a " + std::to_string(bytes) + "-byte message exceeds the LL slots (" +
           std::to_string(ll_capacity) + " bytes)";
  }
  return workspace_->why_not(t);
}

const InstalledProgram& Decisions::program_for(Op op, const plan::Tactic& tactic) {
  const auto key =
      std::make_tuple(static_cast<int>(tactic.algorithm), static_cast<int>(tactic.direction),
                      tactic.staged ? 1 : 0, static_cast<int>(tactic.protocol),
                      op_index(program_op(op)));  // every fused form runs one program
  auto it = programs_.find(key);
  if (it != programs_.end()) return *it->second;
  plan::Schedule schedule =
      plan::build_schedule(tactic.algorithm, tactic.direction, tactic.staged, options_.world,
                           options_.island_of, tactic.protocol, op.collective);
  // Where the executor writes a sum and its forwarded copy in one pass, fewer passes over memory.
  if (workspace_->runs_multi_destination_steps()) {
    schedule = plan::fuse_forwarding_copies(std::move(schedule));
  }
  if (has_epilogue(op)) schedule = plan::with_epilogue(std::move(schedule));
  const plan::Verification v = plan::verify(schedule);
  if (!v.ok) {  // the builders are proven in CI; refuse rather than run something unproven
    throw std::logic_error("schedule " + plan::tactic_label(tactic) +
                           " failed verification: " + v.errors.front());
  }
  auto program = std::make_unique<InstalledProgram>();
  program->id = workspace_->add_program(plan::encode_program(schedule, options_.rank));
  program->sent_fraction = v.sent_to[options_.rank];
  return *programs_.emplace(key, std::move(program)).first->second;
}

const Decision& Decisions::decide(Op op, plan::DType dtype, int64_t bytes) {
  const uint64_t key = decision_key(op, dtype, bytes);
  auto it = decisions_.find(key);
  if (it != decisions_.end()) return it->second;
  const plan::TableChoice choice = table_.decide(
      options_.topology_key, options_.world, dtype, bytes,
      [this](const plan::TableRow& row, int64_t b) { return why_not_runnable(row, b); },
      op.collective);
  for (const auto& [line, why] : choice.skipped) {
    log(options_, 1, table_.source() + " line " + std::to_string(line) + " skipped: " + why);
  }
  Decision d;
  d.reason = choice.fallback ? Decline::kTable : Decline::kNone;
  d.tactic = choice.tactic;
  if (!d.fallback() && !withdrawn_.empty() &&
      withdrawn_.count(tactic_key(op, dtype, plan::tactic_label(d.tactic))) != 0) {
    d.reason = Decline::kSelfTest;
  }
  if (!d.fallback()) {
    d.program = &program_for(op, d.tactic);
    d.signature = op_signature(op, dtype, d.tactic);
    const std::string label = plan::tactic_label(d.tactic);
    d.calls = counters_.calls(op, label);
    if (has_epilogue(op)) d.contained_calls = counters_.calls(kAllReduce, label);
  }
  return decisions_.emplace(key, d).first->second;
}

int Decisions::prepare(const std::vector<plan::DType>& dtypes) {
  const int64_t ll_capacity = workspace_->layout().ll_capacity_bytes;
  std::vector<int64_t> edges = {ll_capacity, ll_capacity + plan::kVectorBytes};
  for (const plan::TableRow& row : table_.rows()) {
    edges.push_back(row.min_bytes);
    if (row.max_bytes > 0) edges.push_back(row.max_bytes - plan::kVectorBytes);
  }
  // Admitted messages are whole vectors (per rank for the reduce-scatter and all-gather), from
  // one up to the workspace: the admitted sizes on either side of every edge.
  for (const plan::DType dtype : dtypes) {
    const int64_t top = options_.max_numel * plan::dtype_bytes(dtype);
    for (const int64_t edge : edges) {
      for (const Op op : kOpNames.values()) {
        const int64_t unit = plan::kVectorBytes *
                             (op.collective == plan::Collective::kAllReduce ? 1 : options_.world);
        const int64_t largest = top - top % unit;
        if (largest < unit) continue;
        const int64_t below = edge - edge % unit;
        for (const int64_t bytes : {below, below + unit}) {
          decide(op, dtype, std::clamp(bytes, unit, largest));
        }
      }
    }
  }
  return static_cast<int>(programs_.size());
}

std::vector<TacticUse> Decisions::uses() const {
  std::map<TacticKey, TacticUse> by_use;
  for (const auto& [key, d] : decisions_) {
    if (d.fallback()) continue;
    const Op op = kOpNames.entries[key >> 60].value;
    const auto dtype = static_cast<plan::DType>((key >> 56) & 0xF);
    TacticUse& use = by_use[tactic_key(op, dtype, plan::tactic_label(d.tactic))];
    use.op = op;
    use.dtype = dtype;
    use.tactic = d.tactic;
    use.bytes.push_back(static_cast<int64_t>(key & kBytesMask));
  }
  std::vector<TacticUse> uses;
  for (auto& [key, use] : by_use) {
    std::sort(use.bytes.begin(), use.bytes.end());
    uses.push_back(std::move(use));
  }
  return uses;
}

void Decisions::withdraw(Op op, plan::DType dtype, const std::string& tactic) {
  withdrawn_.insert(tactic_key(op, dtype, tactic));
  decisions_.clear();
}

void Decisions::set_table(plan::TuningTable table) {
  table_ = std::move(table);
  decisions_.clear();
}

}  // namespace pcie_ar::comm
