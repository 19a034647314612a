// The verifier's state (regions, flags, slot histories, per-round counts) and the Simulation that
// runs every rank's program over it. Internal to the verifier; not part of the plan API.
#pragma once

#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "plan/schedule.h"
#include "plan/step.h"
#include "plan/verify.h"
#include "plan/verify_expressions.h"

namespace pcie_ar::plan::verifier {

using Clock = std::vector<int>;

// One step's access, remembered to name it in an error about a later one.
struct Access {
  int rank = -1;
  int round = 0;
  int index = 0;  // the step's index in that round's program
  const Step* step = nullptr;
};

struct Read {
  int reader;
  int time;  // reader's clock
  int round;
};

struct Region {
  int expr = -1;
  int writer = -1;
  int write_time = 0;       // writer's own clock entry at the write
  int round = -1;           // the round of the last write (an input: its round)
  std::vector<Read> reads;  // since the last write
  int avail = 0;            // fabric hops until the data is in place
  // LL slots only: the last write (of `round`) is not yet consumed by its one read.
  bool ll_pending = false;
  Clock heard;  // the writer's progress clock at the write
};

struct Flag {
  int writer = -1;
  int round = -1;  // the round of the last raise: the generation the flag holds
  Clock clock;
  Clock heard;
  int avail = 0;
  std::vector<Access> waits;  // the waits that took the last raise
};

// (space, owner, slot, epoch, chunk). The epoch is the round's parity for slots and LL slots
// (the workspace's double buffer: rounds k and k + 2 share them) and the round for the input and
// output (each round has its own part of the tensors).
using RegionKey = std::tuple<int, int, int, int, int>;
// (space, owner, slot, parity): a whole slot, whatever the chunks.
using SlotKey = std::tuple<int, int, int, int>;
// (parity, owner, flag)
using FlagKey = std::tuple<int, int, int>;

// Every access of one slot, by rank and round: the latest read and the latest write. An LL read
// is kept as a read, but checked as a write: it resets what it read.
struct SlotHistory {
  std::map<int, Access> reads[kMaxWorld];   // round -> latest
  std::map<int, Access> writes[kMaxWorld];  // round -> latest
};

// What a round adds to the counts; verify_rounds() keeps the worst round's.
struct RoundCounts {
  std::map<std::pair<int, int>, std::set<int>> out, in;  // (stage, rank) -> peers
  std::vector<std::vector<double>> sent_to;
  double cross_island[2] = {0.0, 0.0};
  int fabric_hops = 0;
};

// Runs the rounds back to back: each rank runs round 0's program, then round 1's, ..., as far
// ahead of its peers as its waits let it. One round is verify().
class Simulation {
 public:
  Simulation(const std::vector<const Schedule*>& rounds, const VerifyOptions& options,
             Verification& v);

  void run();

  const std::vector<RoundCounts>& counts() const { return counts_; }

 private:
  const Schedule& s() const { return *rounds_[round_]; }
  bool many_rounds() const { return rounds_.size() > 1; }

  // Errors name the round when there are several.
  std::string in_round(int k) const {
    return many_rounds() ? "round " + std::to_string(k) + ": " : std::string();
  }

  void error(std::string message) {
    if (v_.errors.size() < 32) v_.errors.push_back(std::move(message));
  }

  static bool is_slot(const BufRef& buf) {
    return buf.space == Space::kSlot || buf.space == Space::kLL;
  }

  RegionKey key(int round, const BufRef& buf, int chunk) const {
    int space = static_cast<int>(buf.space);
    if (options_.in_place && buf.space == Space::kOutput) space = static_cast<int>(Space::kInput);
    const bool slot = is_slot(buf);
    return {space, buf.owner, slot ? buf.slot : 0, slot ? round & 1 : round, chunk};
  }

  FlagKey flag_key(const Step& step) const { return {round_ & 1, step.flag_owner, step.flag}; }

  std::string where(int r, int index, const Step& step) const {
    return in_round(round_) + "rank " + std::to_string(r) + " step " + std::to_string(index) +
           " (" + describe_step(step) + ")";
  }

  // Another round's step, named in an error about this one.
  static std::string step_text(const Access& a) {
    return "step " + std::to_string(a.index) + " (" + describe_step(*a.step) + ")";
  }

  static std::string slot_text(const BufRef& buf) {
    return "rank " + std::to_string(buf.owner) + "'s " +
           (buf.space == Space::kLL ? "LL slot " : "slot ") + std::to_string(buf.slot);
  }

  // Whether rank q's current step is ordered after everything rank a did in an earlier round j:
  // q has heard of a's progress into a later round. a's kernel of round j had completed (its
  // loads returned, its stores performed: design.md, "What orders a reset before the next write
  // of the same slot") before any of its round j + 1 began. Nothing less will do, not even a flag
  // chain that reaches a's very step: every CTA runs the program on its own slice with its own
  // flags, and rounds may launch different numbers of CTAs, so a slice of round j + 2 may overlap
  // the slices of CTAs that chain never touched.
  bool ordered_after(int q, int a, int j) const { return heard_[q][a] >= start_[a][j + 1]; }

  enum class Use { kRead, kWrite, kReset };  // kReset: an LL read, which rewrites what it read

  // Running the programs and executing their steps (verify_simulation.cc).
  void end_round(int r, int k);
  bool blocked(const Step& step);
  bool check_buf(int r, int index, const Step& step, const BufRef& buf);
  void record_transfer(int stage, int from, int to, int r, int index, const Step& step);
  void execute(int r, int index, const Step& step);
  void execute_epilogue(int r, int index, const Step& step);
  void execute_reduce(int r, int index, const Step& step);
  void check_flag_taken(int r, int index, const Step& step, const Flag& flag);
  void execute_signal(int r, int index, const Step& step);
  void execute_wait(int r, int index, const Step& step);

  // Reads and writes of regions and LL slots, and the checks across rounds (verify_memory.cc).
  void check_across_rounds(int r, int index, const Step& step, const BufRef& buf, Use use);
  int read(int r, int index, const Step& step, const BufRef& buf);
  int read_ll(int r, int index, const Step& step, const BufRef& buf);
  void write_ll(int r, int index, const Step& step, const BufRef& buf, int expr);
  void arrive(int r, const BufRef& buf, int avail);
  void write(int r, int index, const Step& step, const BufRef& buf, int expr);

  // The end-of-round and end-of-run checks (verify_checks.cc).
  int output_expr(int r, int c) const;
  std::string output_text(int r, int c, int expr) const;
  void check_whole_sum(const std::string& what, int expr);
  void check_collective_outputs();
  void check_outputs();
  void check_epilogues();
  void check_everyone_heard_from_everyone();
  void check_ll_consumed();

  const std::vector<const Schedule*>& rounds_;
  const int world_;
  const VerifyOptions& options_;
  Verification& v_;
  Expressions exprs_;
  int round_ = 0;               // the round of the step being executed, or being checked
  std::vector<int> canonical_;  // per round: the group's sum, as every tactic computes it
  std::vector<Clock> clocks_;   // visibility: joined only through flags (release/acquire)
  std::vector<Clock> heard_;    // progress: joined through flags and LL reads
  std::vector<int> hops_;       // fabric hops on each rank's critical path, this round
  std::vector<std::vector<int>> epilogues_;       // [round][rank]: epilogue steps run
  std::vector<std::vector<Clock>> heard_at_end_;  // [round][rank]: heard_ when it ended the round
  // [rank][round]: the rank's clock at its first step of the round (its steps number on across
  // rounds); [rank][rounds] is one past its last step.
  std::vector<std::vector<int>> start_;
  // [round]: (flag owner, flag) -> the ranks whose program of that round waits for it.
  std::vector<std::map<std::pair<int, int>, std::vector<int>>> waiters_;
  std::vector<RoundCounts> counts_;
  int step_hops_ = 0;  // the reduce being executed: when its last operand is in
  std::map<RegionKey, Region> regions_;
  std::map<SlotKey, SlotHistory> histories_;
  std::map<FlagKey, Flag> flags_;
};

}  // namespace pcie_ar::plan::verifier
