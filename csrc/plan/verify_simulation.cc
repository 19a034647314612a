// The Simulation's driver: setting up the rounds, running every rank's program as far as its
// waits let it, and executing each step (reduces, signals, waits, the epilogue).
#include "plan/verify_simulation.h"

#include <algorithm>
#include <string>
#include <vector>

#include "plan/layout.h"

namespace pcie_ar::plan::verifier {

Simulation::Simulation(const std::vector<const Schedule*>& rounds, const VerifyOptions& options,
                       Verification& v)
    : rounds_(rounds),
      world_(rounds[0]->world),
      options_(options),
      v_(v),
      exprs_(rounds[0]->world, static_cast<int>(rounds.size())) {
  const int num_rounds = static_cast<int>(rounds.size());
  clocks_.assign(world_, Clock(world_, 0));
  heard_.assign(world_, Clock(world_, 0));
  hops_.assign(world_, 0);
  epilogues_.assign(num_rounds, std::vector<int>(world_, 0));
  heard_at_end_.assign(num_rounds, std::vector<Clock>(world_, Clock(world_, 0)));
  counts_.resize(num_rounds);
  start_.assign(world_, std::vector<int>(num_rounds + 1, 1));
  waiters_.resize(num_rounds);
  for (int k = 0; k < num_rounds; ++k) {
    const Schedule& s = *rounds[k];
    // The group's tree (canonical_groups) over this round's inputs: each group summed and
    // rounded, then the groups' sums.
    std::vector<int> groups;
    for (const std::vector<int>& group : canonical_groups(world_, s.island_of)) {
      std::vector<int> leaves;
      for (int q : group) leaves.push_back(k * world_ + q);
      groups.push_back(exprs_.sum(leaves));
    }
    canonical_.push_back(exprs_.sum(groups));
    counts_[k].sent_to.assign(world_, std::vector<double>(world_, 0.0));
    for (int r = 0; r < world_; ++r) {
      const int steps = static_cast<int>(s.programs[r].size());
      start_[r][k + 1] = start_[r][k] + steps;
      for (const Step& step : s.programs[r]) {
        if (step.kind != StepKind::kWait) continue;
        std::vector<int>& ranks = waiters_[k][{step.flag_owner, step.flag}];
        if (std::find(ranks.begin(), ranks.end(), r) == ranks.end()) ranks.push_back(r);
      }
    }
    // An all-gather's input is one chunk, its rank's: the other chunks do not exist.
    const bool gather = s.collective == Collective::kAllGather;
    for (int r = 0; r < world_; ++r) {
      for (int c = 0; c < s.num_chunks; ++c) {
        if (gather && c != r) continue;
        Region& input = regions_[key(k, BufRef{Space::kInput, static_cast<uint8_t>(r), 0, 0}, c)];
        input.expr = k * world_ + r;
        input.round = k;
      }
    }
  }
}

void Simulation::run() {
  const int num_rounds = static_cast<int>(rounds_.size());
  std::vector<int> round(world_, 0);
  std::vector<size_t> pc(world_, 0);
  // Moves rank r past the rounds whose programs it has finished.
  auto end_rounds = [&](int r) {
    while (round[r] < num_rounds && pc[r] == rounds_[round[r]]->programs[r].size()) {
      end_round(r, round[r]);
      ++round[r];
      pc[r] = 0;
    }
  };
  for (int r = 0; r < world_; ++r) end_rounds(r);
  while (true) {
    bool progress = false;
    bool done = true;
    for (int r = 0; r < world_; ++r) {
      while (round[r] < num_rounds) {
        round_ = round[r];
        const Step& step = rounds_[round_]->programs[r][pc[r]];
        if (blocked(step)) break;
        execute(r, static_cast<int>(pc[r]), step);
        ++pc[r];
        progress = true;
        end_rounds(r);
      }
      if (round[r] < num_rounds) done = false;
    }
    if (done) break;
    if (!progress) {
      for (int r = 0; r < world_; ++r) {
        if (round[r] < num_rounds) {
          round_ = round[r];
          const Step& step = rounds_[round_]->programs[r][pc[r]];
          error(in_round(round_) + "deadlock: rank " + std::to_string(r) +
                " blocks forever at step " + std::to_string(pc[r]) + " (" + describe_step(step) +
                ")");
          counts_[round_].fabric_hops = std::max(counts_[round_].fabric_hops, hops_[r]);
        }
      }
      return;
    }
  }
  for (int k = 0; k < num_rounds; ++k) {
    round_ = k;
    check_outputs();
    check_epilogues();
    check_everyone_heard_from_everyone();
  }
  check_ll_consumed();
}

// Rank r has run its program of round k to the end.
void Simulation::end_round(int r, int k) {
  heard_at_end_[k][r] = heard_[r];
  counts_[k].fabric_hops = std::max(counts_[k].fabric_hops, hops_[r]);
  hops_[r] = 0;  // a round's fabric chain starts at its launch
}

// A wait whose flag nobody has raised in this round yet, or a reduce whose LL operand of this
// round has not landed.
bool Simulation::blocked(const Step& step) {
  if (step.kind == StepKind::kWait) {
    auto it = flags_.find(flag_key(step));
    return it == flags_.end() || it->second.round < round_;  // the flag compares with >=
  }
  if (step.kind != StepKind::kReduce) return false;
  for (int i = 0; i < step.num_srcs && i < kMaxSources; ++i) {
    const BufRef& src = step.srcs[i];
    if (src.space != Space::kLL) continue;
    const Region& region = regions_[key(round_, src, step.chunk)];
    if (!region.ll_pending || region.round != round_) return true;
  }
  return false;
}

bool Simulation::check_buf(int r, int index, const Step& step, const BufRef& buf) {
  if (buf.owner >= world_) {
    error(where(r, index, step) + ": buffer owner " + std::to_string(buf.owner) +
          " is outside the world");
    return false;
  }
  const bool slot = is_slot(buf);
  if (!slot && buf.owner != r) {
    error(where(r, index, step) + ": touches rank " + std::to_string(buf.owner) +
          "'s input/output, which only that rank can see");
    return false;
  }
  if (slot && buf.slot >= num_slots_for(world_)) {
    error(where(r, index, step) + ": slot " + std::to_string(buf.slot) + " is outside the " +
          std::to_string(num_slots_for(world_)) + " slots of the layout");
    return false;
  }
  return true;
}

void Simulation::record_transfer(int stage, int from, int to, int r, int index, const Step& step) {
  if (from == to) return;
  RoundCounts& counts = counts_[round_];
  counts.out[{stage, from}].insert(to);
  counts.in[{stage, to}].insert(from);
  const double share = 1.0 / s().num_chunks;
  counts.sent_to[from][to] += share;
  const int island_from = s().island_of[from];
  if (island_from != s().island_of[to]) {
    counts.cross_island[island_from == s().island_of[0] ? 0 : 1] += share;
  }
  const bool pushes = s().direction == Direction::kPush;
  if (pushes != (from == r)) {
    error(where(r, index, step) + (pushes ? ": a push schedule reads peer memory"
                                          : ": a pull schedule writes peer memory"));
  }
}

void Simulation::execute(int r, int index, const Step& step) {
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
void Simulation::execute_epilogue(int r, int index, const Step& step) {
  if (!s().epilogue) {
    error(where(r, index, step) + ": an epilogue in a schedule without one");
    return;
  }
  if (index + 1 != static_cast<int>(s().programs[r].size())) {
    error(where(r, index, step) + ": the epilogue must be the rank's last step");
    return;
  }
  if (step.peer != r || step.flag_owner != r) {
    error(where(r, index, step) + ": the epilogue's CTAs meet in rank " + std::to_string(r) +
          "'s own memory, not another rank's");
  }
  ++epilogues_[round_][r];
  const int canonical = canonical_[round_];
  for (int c = 0; c < s().num_chunks; ++c) {
    auto it = regions_.find(key(round_, BufRef{Space::kOutput, static_cast<uint8_t>(r), 0, 0}, c));
    const bool written = it != regions_.end() && it->second.writer == r;
    if (!written || it->second.expr != canonical) {
      error(where(r, index, step) + ": output chunk " + std::to_string(c) + " is " +
            (written ? exprs_.text(it->second.expr) : std::string("not written")) +
            " when the epilogue reads it; the group's sum " + exprs_.text(canonical) +
            " must be in it first");
    }
  }
}

void Simulation::execute_reduce(int r, int index, const Step& step) {
  if (step.num_srcs < 1 || step.num_srcs > kMaxSources) {
    error(where(r, index, step) + ": a reduce needs 1.." + std::to_string(kMaxSources) +
          " operands");
    return;
  }
  if (step.chunk >= s().num_chunks) {
    error(where(r, index, step) + ": chunk " + std::to_string(step.chunk) +
          " is outside the schedule's " + std::to_string(s().num_chunks));
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
  if (step.split >= step.num_srcs) {
    error(where(r, index, step) + ": split at operand " + std::to_string(step.split) + " of " +
          std::to_string(step.num_srcs));
    return;
  }
  int sum = exprs_.sum(operands);
  if (step.split > 0) {  // two rounded sums, then their sum
    const auto at = operands.begin() + step.split;
    sum = exprs_.sum({exprs_.sum({operands.begin(), at}), exprs_.sum({at, operands.end()})});
  }
  if (step.dst.space == Space::kLL) {
    write_ll(r, index, step, step.dst, sum);
    return;
  }
  for (int d = 0; d < step.num_dsts; ++d) write(r, index, step, d == 0 ? step.dst : step.dst2, sum);
}

// A flag holds the generation of its last raise, and a wait compares with >=: a raise of
// round k + 2 (same parity) over round k's satisfies a round-k wait that has not yet looked,
// which then runs on with round k + 2's data in the slots. So every rank that waits for the
// round-k raise must have taken it, and this rank must have heard so, before the flag rises
// again.
void Simulation::check_flag_taken(int r, int index, const Step& step, const Flag& flag) {
  const int j = flag.round;
  auto it = waiters_[j].find({step.flag_owner, step.flag});
  if (it == waiters_[j].end()) return;
  const std::string name =
      "flag " + std::to_string(step.flag) + " of rank " + std::to_string(step.flag_owner);
  for (int w : it->second) {
    if (w == r) continue;  // program order
    const Access* taken = nullptr;
    for (const Access& wait : flag.waits) {
      if (wait.rank == w && wait.round == j) taken = &wait;
    }
    if (taken == nullptr) {
      error(where(r, index, step) + ": raises " + name + " over its round " + std::to_string(j) +
            " raise, which rank " + std::to_string(w) +
            " has not waited for yet: that wait would take this raise for round " +
            std::to_string(j) + "'s (race across rounds)");
    } else if (!ordered_after(r, w, j)) {
      error(where(r, index, step) + ": raises " + name + " again before hearing that rank " +
            std::to_string(w) + "'s round " + std::to_string(j) + " wait for it, " +
            step_text(*taken) + ", has returned (race across rounds)");
    }
  }
}

void Simulation::execute_signal(int r, int index, const Step& step) {
  if (step.flag_owner >= world_ || step.flag >= num_flags_for(world_)) {
    error(where(r, index, step) + ": flag outside the layout");
    return;
  }
  Flag& flag = flags_[flag_key(step)];
  if (flag.round == round_) {
    error(where(r, index, step) + ": flag already raised this generation by rank " +
          std::to_string(flag.writer) + " (each flag has one writer, once per call)");
  } else if (flag.round > round_) {
    error(where(r, index, step) + ": raises a flag rank " + std::to_string(flag.writer) +
          " already raised in round " + std::to_string(flag.round) + ": rank " +
          std::to_string(flag.writer) + " ran two rounds ahead (race across rounds)");
    return;  // the flag keeps the later generation
  } else if (flag.round >= 0) {
    check_flag_taken(r, index, step, flag);
  }
  flag.writer = r;
  flag.round = round_;
  flag.clock = clocks_[r];
  flag.heard = heard_[r];
  flag.avail = hops_[r] + (step.flag_owner != r ? 1 : 0);
  flag.waits.clear();
}

void Simulation::execute_wait(int r, int index, const Step& step) {
  Flag& flag = flags_.at(flag_key(step));
  if (flag.round > round_) {
    error(where(r, index, step) + ": finds the flag raised in round " + std::to_string(flag.round) +
          ", not this one: rank " + std::to_string(flag.writer) +
          " ran two rounds ahead (race across rounds)");
  }
  if (flag.writer != step.peer) {
    error(where(r, index, step) + ": waits for rank " + std::to_string(step.peer) + " but rank " +
          std::to_string(flag.writer) + " raises that flag");
  }
  for (int q = 0; q < world_; ++q) {
    clocks_[r][q] = std::max(clocks_[r][q], flag.clock[q]);
    heard_[r][q] = std::max(heard_[r][q], flag.heard[q]);
  }
  hops_[r] = step.flag_owner != r ? std::max(hops_[r] + 2, flag.avail + 1)
                                  : std::max(hops_[r], flag.avail);
  flag.waits.push_back(Access{r, round_, index, &step});
}

}  // namespace pcie_ar::plan::verifier
