#include "plan/verify.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "plan/layout.h"

namespace pcie_ar::plan {
namespace {

// Hash-consed sum expressions: ids 0..world-1 are the ranks' inputs; a sum node is an ordered
// list of operand ids, rounded once to the dtype. Two ranks computing the same id compute the
// same bits.
class Expressions {
 public:
  explicit Expressions(int world) : world_(world) {}

  int sum(const std::vector<int>& operands) {
    if (operands.size() == 1) return operands[0];  // a copy is exact
    auto [it, inserted] = ids_.try_emplace(operands, world_ + static_cast<int>(nodes_.size()));
    if (inserted) nodes_.push_back(operands);
    return it->second;
  }

  void count_leaves(int id, std::vector<int>& counts) const {
    if (id < world_) {
      ++counts[id];
      return;
    }
    for (int child : nodes_[id - world_]) count_leaves(child, counts);
  }

  int min_leaf(int id) const {
    if (id < world_) return id;
    int best = world_;
    for (int child : nodes_[id - world_]) best = std::min(best, min_leaf(child));
    return best;
  }

  // Every sum's operands ordered by the lowest rank they contain.
  bool in_rank_order(int id) const {
    if (id < world_) return true;
    const auto& children = nodes_[id - world_];
    for (size_t i = 0; i < children.size(); ++i) {
      if (!in_rank_order(children[i])) return false;
      if (i > 0 && min_leaf(children[i - 1]) >= min_leaf(children[i])) return false;
    }
    return true;
  }

  std::string text(int id) const {
    if (id < 0) return "nothing";
    if (id < world_) return "x" + std::to_string(id);
    std::string out = "(";
    const auto& children = nodes_[id - world_];
    for (size_t i = 0; i < children.size(); ++i) out += (i ? "+" : "") + text(children[i]);
    return out + ")";
  }

 private:
  int world_;
  std::map<std::vector<int>, int> ids_;
  std::vector<std::vector<int>> nodes_;
};

using Clock = std::vector<int>;

struct Region {
  int expr = -1;
  int writer = -1;
  int write_time = 0;                      // writer's own clock entry at the write
  std::vector<std::pair<int, int>> reads;  // (reader, reader's clock) since the last write
  int avail = 0;                           // fabric hops until the data is in place
  // LL slots only: written this call, and not yet consumed by its one read.
  bool ll_written = false;
  bool ll_pending = false;
  Clock heard;  // the writer's progress clock at the write
};

struct Flag {
  int writer = -1;
  Clock clock;
  Clock heard;
  int avail = 0;
};

// (space, owner, slot, chunk)
using RegionKey = std::tuple<int, int, int, int>;

class Simulation {
 public:
  Simulation(const Schedule& s, const VerifyOptions& options, Verification& v)
      : s_(s), options_(options), v_(v), exprs_(s.world) {
    clocks_.assign(s.world, Clock(s.world, 0));
    heard_.assign(s.world, Clock(s.world, 0));
    hops_.assign(s.world, 0);
    epilogues_.assign(s.world, 0);
    // An all-gather's input is one chunk, its rank's: the other chunks do not exist.
    const bool gather = s.collective == Collective::kAllGather;
    for (int r = 0; r < s.world; ++r) {
      for (int c = 0; c < s.num_chunks; ++c) {
        if (gather && c != r) continue;
        regions_[key(r, BufRef{Space::kInput, static_cast<uint8_t>(r), 0, 0}, c)].expr = r;
      }
    }
  }

  void run() {
    std::vector<size_t> pc(s_.world, 0);
    while (true) {
      bool progress = false;
      bool done = true;
      for (int r = 0; r < s_.world; ++r) {
        const auto& program = s_.programs[r];
        while (pc[r] < program.size()) {
          const Step& step = program[pc[r]];
          if (blocked(r, step)) break;
          execute(r, static_cast<int>(pc[r]), step);
          ++pc[r];
          progress = true;
        }
        if (pc[r] < program.size()) done = false;
      }
      if (done) break;
      if (!progress) {
        for (int r = 0; r < s_.world; ++r) {
          if (pc[r] < s_.programs[r].size()) {
            const Step& step = s_.programs[r][pc[r]];
            error("deadlock: rank " + std::to_string(r) + " blocks forever at step " +
                  std::to_string(pc[r]) + " (" + describe_step(step) + ")");
          }
        }
        return;
      }
    }
    check_outputs();
    check_epilogues();
    check_everyone_heard_from_everyone();
    check_ll_consumed();
  }

  int fabric_hops() const { return *std::max_element(hops_.begin(), hops_.end()); }

 private:
  void error(std::string message) {
    if (v_.errors.size() < 32) v_.errors.push_back(std::move(message));
  }

  // A wait whose flag nobody has raised yet, or a reduce whose LL operand has not landed.
  bool blocked(int r, const Step& step) {
    if (step.kind == StepKind::kWait) return !flags_.count({step.flag_owner, step.flag});
    if (step.kind != StepKind::kReduce) return false;
    for (int i = 0; i < step.num_srcs && i < kMaxSources; ++i) {
      const BufRef& src = step.srcs[i];
      if (src.space == Space::kLL && !regions_[key(r, src, step.chunk)].ll_pending) return true;
    }
    return false;
  }

  RegionKey key(int r, const BufRef& buf, int chunk) const {
    int space = static_cast<int>(buf.space);
    if (options_.in_place && buf.space == Space::kOutput) space = static_cast<int>(Space::kInput);
    (void)r;
    const bool slot = buf.space == Space::kSlot || buf.space == Space::kLL;
    return {space, buf.owner, slot ? buf.slot : 0, chunk};
  }

  std::string where(int r, int index, const Step& step) const {
    return "rank " + std::to_string(r) + " step " + std::to_string(index) + " (" +
           describe_step(step) + ")";
  }

  bool check_buf(int r, int index, const Step& step, const BufRef& buf) {
    if (buf.owner >= s_.world) {
      error(where(r, index, step) + ": buffer owner " + std::to_string(buf.owner) +
            " is outside the world");
      return false;
    }
    const bool slot = buf.space == Space::kSlot || buf.space == Space::kLL;
    if (!slot && buf.owner != r) {
      error(where(r, index, step) + ": touches rank " + std::to_string(buf.owner) +
            "'s input/output, which only that rank can see");
      return false;
    }
    if (slot && buf.slot >= num_slots_for(s_.world)) {
      error(where(r, index, step) + ": slot " + std::to_string(buf.slot) + " is outside the " +
            std::to_string(num_slots_for(s_.world)) + " slots of the layout");
      return false;
    }
    return true;
  }

  void record_transfer(int stage, int from, int to, int r, int index, const Step& step) {
    if (from == to) return;
    out_[{stage, from}].insert(to);
    in_[{stage, to}].insert(from);
    const double share = 1.0 / s_.num_chunks;
    v_.sent_to[from][to] += share;
    const int island_from = s_.island_of[from];
    if (island_from != s_.island_of[to]) {
      v_.cross_island[island_from == s_.island_of[0] ? 0 : 1] += share;
    }
    const bool pushes = s_.direction == Direction::kPush;
    if (pushes != (from == r)) {
      error(where(r, index, step) + (pushes ? ": a push schedule reads peer memory"
                                            : ": a pull schedule writes peer memory"));
    }
  }

  int read(int r, int index, const Step& step, const BufRef& buf) {
    Region& region = regions_[key(r, buf, step.chunk)];
    if (region.expr < 0) {
      error(where(r, index, step) + ": reads chunk " + std::to_string(step.chunk) +
            " before anything wrote it");
    } else if (region.writer >= 0 && region.writer != r &&
               region.write_time > clocks_[r][region.writer]) {
      error(where(r, index, step) + ": reads data rank " + std::to_string(region.writer) +
            " wrote without waiting for its flag (race)");
    }
    region.reads.emplace_back(r, clocks_[r][r]);
    arrive(r, buf, region.avail);
    return region.expr;
  }

  // The reader waits for the data itself: that orders this read after the write (no race) and
  // proves the writer's progress, but makes none of its other writes visible.
  int read_ll(int r, int index, const Step& step, const BufRef& buf) {
    Region& region = regions_[key(r, buf, step.chunk)];
    if (buf.owner != r) {
      error(where(r, index, step) + ": reads an LL slot in rank " + std::to_string(buf.owner) +
            "'s memory; LL readers poll only their own memory");
    }
    if (region.writer != buf.writer) {
      error(where(r, index, step) + ": expects rank " + std::to_string(buf.writer) +
            "'s LL data but rank " + std::to_string(region.writer) + " writes it");
    }
    region.ll_pending = false;
    for (int q = 0; q < s_.world; ++q) heard_[r][q] = std::max(heard_[r][q], region.heard[q]);
    region.reads.emplace_back(r, clocks_[r][r]);
    arrive(r, buf, region.avail);
    return region.expr;
  }

  void write_ll(int r, int index, const Step& step, const BufRef& buf, int expr) {
    Region& region = regions_[key(r, buf, step.chunk)];
    if (buf.writer != r) {
      error(where(r, index, step) + ": names rank " + std::to_string(buf.writer) +
            " as the writer of an LL slot that rank " + std::to_string(r) + " writes");
    }
    if (region.ll_written) {
      error(where(r, index, step) +
            ": writes an LL slot a second time in one call (its tags cannot tell the writes "
            "apart)");
    }
    region.ll_written = true;
    region.ll_pending = true;
    region.expr = expr;
    region.writer = r;
    region.write_time = clocks_[r][r];
    region.heard = heard_[r];
    region.reads.clear();
    region.avail = hops_[r] + (buf.owner != r ? 1 : 0);
  }

  // Fabric time: data in the reader's memory is usable once it has landed; data in a peer's
  // memory costs a round trip after it has landed there. The operands of one reduce are loaded
  // together, so the step waits for the latest of them, not their sum.
  void arrive(int r, const BufRef& buf, int avail) {
    const bool remote =
        buf.space == Space::kSlot || buf.space == Space::kLL ? buf.owner != r : false;
    step_hops_ = std::max(step_hops_,
                          remote ? std::max(hops_[r] + 2, avail + 1) : std::max(hops_[r], avail));
  }

  void write(int r, int index, const Step& step, const BufRef& buf, int expr) {
    if (buf.space == Space::kInput) {
      error(where(r, index, step) + ": writes the rank's input, which the caller owns read-only");
      return;
    }
    // A reduce-scatter's output is the one chunk the rank owns: any other chunk lies outside
    // the caller's tensor.
    if (buf.space == Space::kOutput && s_.collective == Collective::kReduceScatter &&
        step.chunk != r) {
      error(where(r, index, step) + ": writes output chunk " + std::to_string(step.chunk) +
            "; a reduce-scatter's output is chunk " + std::to_string(r) + " only");
      return;
    }
    Region& region = regions_[key(r, buf, step.chunk)];
    if (region.writer >= 0 && region.writer != r && region.write_time > clocks_[r][region.writer]) {
      error(where(r, index, step) + ": overwrites data rank " + std::to_string(region.writer) +
            " wrote, with no ordering between the two writes (race)");
    }
    for (auto [reader, time] : region.reads) {
      if (reader != r && time > clocks_[r][reader]) {
        error(where(r, index, step) + ": overwrites data rank " + std::to_string(reader) +
              " may still be reading (race)");
      }
    }
    region.expr = expr;
    region.writer = r;
    region.write_time = clocks_[r][r];
    region.reads.clear();
    region.avail = hops_[r] + (buf.space == Space::kSlot && buf.owner != r ? 1 : 0);
  }

  void execute(int r, int index, const Step& step) {
    ++clocks_[r][r];
    heard_[r][r] = clocks_[r][r];
    switch (step.kind) {
      case StepKind::kReduce:
        return execute_reduce(r, index, step);
      case StepKind::kSignal:
        return execute_signal(r, index, step);
      case StepKind::kWait:
        return execute_wait(r, index, step);
      case StepKind::kEpilogue:
        return execute_epilogue(r, index, step);
    }
  }

  // The fused epilogue normalises whole rows, and a row may span every chunk: it must be the
  // rank's last step (nothing may change the output after it), appear only in a schedule that
  // says it has one, and find every chunk of the rank's output holding the sum already. Only
  // the rank itself writes its output, so its program order is the whole proof; the executors
  // keep that order across their slices (the CUDA executor's CTAs meet at a barrier first).
  void execute_epilogue(int r, int index, const Step& step) {
    if (!s_.epilogue) {
      error(where(r, index, step) + ": an epilogue in a schedule without one");
      return;
    }
    if (index + 1 != static_cast<int>(s_.programs[r].size())) {
      error(where(r, index, step) + ": the epilogue must be the rank's last step");
      return;
    }
    if (step.peer != r || step.flag_owner != r) {
      error(where(r, index, step) + ": the epilogue's CTAs meet in rank " + std::to_string(r) +
            "'s own memory, not another rank's");
    }
    ++epilogues_[r];
    for (int c = 0; c < s_.num_chunks; ++c) {
      auto it = regions_.find(key(r, BufRef{Space::kOutput, static_cast<uint8_t>(r), 0, 0}, c));
      const bool written = it != regions_.end() && it->second.writer == r;
      std::vector<int> counts(s_.world, 0);
      if (written) exprs_.count_leaves(it->second.expr, counts);
      const bool whole =
          written && std::all_of(counts.begin(), counts.end(), [](int n) { return n == 1; });
      if (!whole) {
        error(where(r, index, step) + ": output chunk " + std::to_string(c) + " is " +
              (written ? exprs_.text(it->second.expr) : std::string("not written")) +
              " when the epilogue reads it; every rank's input must be summed into it first");
      }
    }
  }

  void execute_reduce(int r, int index, const Step& step) {
    if (step.num_srcs < 1 || step.num_srcs > kMaxSources) {
      error(where(r, index, step) + ": a reduce needs 1.." + std::to_string(kMaxSources) +
            " operands");
      return;
    }
    if (step.chunk >= s_.num_chunks) {
      error(where(r, index, step) + ": chunk " + std::to_string(step.chunk) +
            " is outside the schedule's " + std::to_string(s_.num_chunks));
      return;
    }
    std::vector<int> operands;
    step_hops_ = hops_[r];
    for (int i = 0; i < step.num_srcs; ++i) {
      const BufRef& src = step.srcs[i];
      if (!check_buf(r, index, step, src)) return;
      if (src.space == Space::kLL) {
        operands.push_back(read_ll(r, index, step, src));
        continue;
      }
      if (src.owner != r) record_transfer(step.stage, src.owner, r, r, index, step);
      operands.push_back(read(r, index, step, src));
    }
    hops_[r] = step_hops_;
    if (step.num_dsts != 1 && step.num_dsts != 2) {
      error(where(r, index, step) + ": a reduce writes 1 or 2 destinations, not " +
            std::to_string(step.num_dsts));
      return;
    }
    const bool ll =
        step.dst.space == Space::kLL || (step.num_dsts == 2 && step.dst2.space == Space::kLL);
    if (step.num_dsts == 2 && ll) {
      error(where(r, index, step) + ": an LL slot cannot be one of two destinations");
      return;
    }
    for (int d = 0; d < step.num_dsts; ++d) {
      const BufRef& dst = d == 0 ? step.dst : step.dst2;
      if (!check_buf(r, index, step, dst)) return;
      if (dst.owner != r) record_transfer(step.stage, r, dst.owner, r, index, step);
    }
    if (std::find(operands.begin(), operands.end(), -1) != operands.end()) return;
    const int sum = exprs_.sum(operands);
    if (step.dst.space == Space::kLL) {
      write_ll(r, index, step, step.dst, sum);
      return;
    }
    for (int d = 0; d < step.num_dsts; ++d)
      write(r, index, step, d == 0 ? step.dst : step.dst2, sum);
  }

  void execute_signal(int r, int index, const Step& step) {
    if (step.flag_owner >= s_.world || step.flag >= num_flags_for(s_.world)) {
      error(where(r, index, step) + ": flag outside the layout");
      return;
    }
    Flag& flag = flags_[{step.flag_owner, step.flag}];
    if (flag.writer >= 0) {
      error(where(r, index, step) + ": flag already raised this generation by rank " +
            std::to_string(flag.writer) + " (each flag has one writer, once per call)");
    }
    flag.writer = r;
    flag.clock = clocks_[r];
    flag.heard = heard_[r];
    flag.avail = hops_[r] + (step.flag_owner != r ? 1 : 0);
  }

  void execute_wait(int r, int index, const Step& step) {
    const Flag& flag = flags_.at({step.flag_owner, step.flag});
    if (flag.writer != step.peer) {
      error(where(r, index, step) + ": waits for rank " + std::to_string(step.peer) + " but rank " +
            std::to_string(flag.writer) + " raises that flag");
    }
    for (int q = 0; q < s_.world; ++q) {
      clocks_[r][q] = std::max(clocks_[r][q], flag.clock[q]);
      heard_[r][q] = std::max(heard_[r][q], flag.heard[q]);
    }
    hops_[r] = step.flag_owner != r ? std::max(hops_[r] + 2, flag.avail + 1)
                                    : std::max(hops_[r], flag.avail);
  }

  // What chunk c of rank r's output holds at the end, or -1 when nothing wrote it.
  int output_expr(int r, int c) const {
    auto it = regions_.find(key(r, BufRef{Space::kOutput, static_cast<uint8_t>(r), 0, 0}, c));
    return it == regions_.end() || it->second.writer < 0 ? -1 : it->second.expr;
  }

  // `expr`, which `what` names, sums every rank's input exactly once, in rank order.
  void check_whole_sum(const std::string& what, int expr) {
    std::vector<int> counts(s_.world, 0);
    exprs_.count_leaves(expr, counts);
    for (int q = 0; q < s_.world; ++q) {
      if (counts[q] != 1) {
        error(what + ": rank " + std::to_string(q) + "'s input is summed " +
              std::to_string(counts[q]) + " times, expected exactly once");
      }
    }
    if (!exprs_.in_rank_order(expr)) error(what + ": operands are not in rank order");
  }

  // Reduce-scatter: rank r's one output chunk, r, is every input summed exactly once in rank
  // order (one owner per chunk: nothing to agree with). All-gather: every chunk c of every
  // output is rank c's input moved untouched (a copy, never a sum: bit-exact).
  void check_collective_outputs() {
    const bool scatter = s_.collective == Collective::kReduceScatter;
    for (int r = 0; r < s_.world; ++r) {
      for (int c = 0; c < s_.num_chunks; ++c) {
        if (scatter && c != r) continue;
        const int expr = output_expr(r, c);
        const std::string what = "rank " + std::to_string(r) + " output chunk " +
                                 std::to_string(c) + " = " + exprs_.text(expr);
        if (expr < 0) {
          error(what + ": never written");
          continue;
        }
        if (!scatter) {
          if (expr != c) error(what + ": expected rank " + std::to_string(c) + "'s input, copied");
          continue;
        }
        check_whole_sum(what, expr);
      }
    }
  }

  void check_outputs() {
    if (s_.collective != Collective::kAllReduce) return check_collective_outputs();
    for (int c = 0; c < s_.num_chunks; ++c) {
      int reference = -2;
      for (int r = 0; r < s_.world; ++r) {
        const int expr = output_expr(r, c);
        const std::string what = "rank " + std::to_string(r) + " output chunk " +
                                 std::to_string(c) + " = " + exprs_.text(expr);
        if (expr < 0) {
          error(what + ": never written");
          continue;
        }
        check_whole_sum(what, expr);
        if (reference == -2) {
          reference = expr;
        } else if (expr != reference) {
          error(what + " but rank 0 computes " + exprs_.text(reference) +
                ": results would not be bitwise identical across ranks");
        }
      }
    }
  }

  void check_epilogues() {
    if (!s_.epilogue) return;
    for (int r = 0; r < s_.world; ++r) {
      if (epilogues_[r] != 1) {
        error("rank " + std::to_string(r) + " runs the epilogue " + std::to_string(epilogues_[r]) +
              " times; a fused schedule runs it exactly once, as each rank's last step");
      }
    }
  }

  // The generation double buffer is safe only if no rank can finish a call before every other
  // rank has started it (and so finished the previous one).
  void check_everyone_heard_from_everyone() {
    for (int r = 0; r < s_.world; ++r) {
      for (int q = 0; q < s_.world; ++q) {
        if (q != r && heard_[r][q] < 1) {
          error("rank " + std::to_string(r) + " can finish without hearing from rank " +
                std::to_string(q) + ": the generation double buffer would be unsafe");
        }
      }
    }
  }

 public:
  std::map<std::pair<int, int>, std::set<int>> out_, in_;  // (stage, rank) -> peers

 private:
  const Schedule& s_;
  const VerifyOptions& options_;
  Verification& v_;
  Expressions exprs_;
  // LL data left unread would keep valid tags in the workspace.
  void check_ll_consumed() {
    for (const auto& [k, region] : regions_) {
      if (!region.ll_pending) continue;
      error("rank " + std::to_string(region.writer) + "'s LL data in rank " +
            std::to_string(std::get<1>(k)) + "'s slot " + std::to_string(std::get<2>(k)) +
            " chunk " + std::to_string(std::get<3>(k)) +
            " is never read in the call: its tags would stay valid");
    }
  }

  std::vector<Clock> clocks_;   // visibility: joined only through flags (release/acquire)
  std::vector<Clock> heard_;    // progress: joined through flags and LL reads
  std::vector<int> hops_;       // fabric hops on each rank's critical path
  std::vector<int> epilogues_;  // epilogue steps each rank ran
  int step_hops_ = 0;           // the reduce being executed: when its last operand is in
  std::map<RegionKey, Region> regions_;
  std::map<std::pair<int, int>, Flag> flags_;
};

// Folds rank r's program into the worst-rank cost.
void add_cost(const std::vector<Step>& program, int r, Cost& worst) {
  Cost c;
  StepKind previous = StepKind::kReduce;
  for (const Step& step : program) {
    const bool run = &step != program.data() && previous == step.kind;
    if (step.kind == StepKind::kSignal && !run) ++c.system_fences;
    if (step.kind == StepKind::kWait) {
      if (step.flag_owner != r) {
        ++c.peer_polls;
      } else if (!run) {
        ++c.local_waits;
      }
    }
    if (step.kind == StepKind::kEpilogue) ++c.local_waits;  // the rank's CTAs meet locally
    if (step.kind == StepKind::kReduce) {
      for (int i = 0; i < step.num_srcs && i < kMaxSources; ++i) {
        if (step.srcs[i].space != Space::kLL) continue;
        ++(step.srcs[i].owner == r ? c.data_polls : c.peer_polls);
      }
    }
    previous = step.kind;
  }
  worst.system_fences = std::max(worst.system_fences, c.system_fences);
  worst.peer_polls = std::max(worst.peer_polls, c.peer_polls);
  worst.local_waits = std::max(worst.local_waits, c.local_waits);
  worst.data_polls = std::max(worst.data_polls, c.data_polls);
}

}  // namespace

Verification verify(const Schedule& schedule, const VerifyOptions& options) {
  Verification v;
  v.num_stages = schedule.num_stages;
  const int W = schedule.world;
  if (W < 2 || W > kMaxWorld || static_cast<int>(schedule.programs.size()) != W ||
      static_cast<int>(schedule.island_of.size()) != W || schedule.num_chunks < 1) {
    v.errors.push_back("malformed schedule: world " + std::to_string(W) + ", " +
                       std::to_string(schedule.programs.size()) + " programs, " +
                       std::to_string(schedule.island_of.size()) + " island entries, " +
                       std::to_string(schedule.num_chunks) + " chunks");
    return v;
  }
  if (schedule.collective != Collective::kAllReduce) {
    const std::string name(collective_name(schedule.collective));
    if (schedule.num_chunks != W) {
      v.errors.push_back("a " + name + " cuts the message into world = " + std::to_string(W) +
                         " chunks, not " + std::to_string(schedule.num_chunks));
    }
    if (options.in_place) v.errors.push_back("a " + name + " has no in-place form");
    if (schedule.epilogue) v.errors.push_back("the epilogue ends an all-reduce, not a " + name);
    if (!v.errors.empty()) return v;
  }
  v.sent_to.assign(W, std::vector<double>(W, 0.0));
  for (const auto& program : schedule.programs) {
    v.max_steps = std::max(v.max_steps, static_cast<int>(program.size()));
  }
  if (v.max_steps > kMaxSteps) {
    v.errors.push_back("a program has " + std::to_string(v.max_steps) + " steps; at most " +
                       std::to_string(kMaxSteps) + " fit the executors");
  }
  Simulation sim(schedule, options, v);
  sim.run();
  for (int r = 0; r < W; ++r) add_cost(schedule.programs[r], r, v.cost);
  v.cost.fabric_hops = sim.fabric_hops();
  v.cost.cross_island = v.cross_island_elements();
  for (const auto& [where, peers] : sim.out_) {
    v.max_outbound_per_stage = std::max(v.max_outbound_per_stage, static_cast<int>(peers.size()));
    if (schedule.staged && peers.size() > 1) {
      v.errors.push_back("stage " + std::to_string(where.first) + ": rank " +
                         std::to_string(where.second) + " sends to " +
                         std::to_string(peers.size()) +
                         " peers; a staged schedule allows one outbound stream per stage");
    }
  }
  for (const auto& [where, peers] : sim.in_) {
    v.max_inbound_per_stage = std::max(v.max_inbound_per_stage, static_cast<int>(peers.size()));
    if (schedule.staged && peers.size() > 1) {
      v.errors.push_back("stage " + std::to_string(where.first) + ": rank " +
                         std::to_string(where.second) + " receives from " +
                         std::to_string(peers.size()) +
                         " peers; a staged schedule allows one inbound stream per stage");
    }
  }
  v.ok = v.errors.empty();
  return v;
}

}  // namespace pcie_ar::plan
