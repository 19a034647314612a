// The Simulation's end-of-round and end-of-run checks: the outputs hold the group's sum (or the
// collective's chunks), epilogues ran once, everyone heard from everyone, LL data was consumed.
#include <string>
#include <tuple>
#include <vector>

#include "plan/verify_simulation.h"

namespace pcie_ar::plan::verifier {

// What chunk c of rank r's output holds at the end of this round, or -1 when nothing wrote it.
int Simulation::output_expr(int r, int c) const {
  auto it = regions_.find(key(round_, BufRef{Space::kOutput, static_cast<uint8_t>(r), 0, 0}, c));
  return it == regions_.end() || it->second.writer < 0 ? -1 : it->second.expr;
}

// "rank r output chunk c = <expr>", prefixed with the round when there are several.
std::string Simulation::output_text(int r, int c, int expr) const {
  return in_round(round_) + "rank " + std::to_string(r) + " output chunk " + std::to_string(c) +
         " = " + exprs_.text(expr);
}

// `expr`, which `what` names, sums every rank's input of this round exactly once, as the
// group's tree does (the same order and rounding points whatever the tactic: every tactic of
// a group agrees), and nothing of another round.
void Simulation::check_whole_sum(const std::string& what, int expr) {
  std::vector<int> counts(exprs_.num_leaves(), 0);
  exprs_.count_leaves(expr, counts);
  bool once = true;
  for (int q = 0; q < world_; ++q) {
    const int n = counts[round_ * world_ + q];
    if (n != 1) {
      error(what + ": rank " + std::to_string(q) + "'s input is summed " + std::to_string(n) +
            " times, expected exactly once");
      once = false;
    }
  }
  for (int leaf = 0; leaf < exprs_.num_leaves(); ++leaf) {
    if (leaf / world_ == round_ || counts[leaf] == 0) continue;
    error(what + ": holds " + exprs_.leaf_text(leaf) + ", rank " + std::to_string(leaf % world_) +
          "'s input of round " + std::to_string(leaf / world_) +
          " (data another round left in a slot)");
    once = false;
  }
  if (once && expr != canonical_[round_]) {
    error(what + ", but the group's one reduction order is " + exprs_.text(canonical_[round_]) +
          ": another tactic of this group would give other bits");
  }
}

// Reduce-scatter: rank r's one output chunk, r, is the group's tree (one owner per chunk: it
// agrees with every all-reduce of the group instead). All-gather: every chunk c of every
// output is rank c's input moved untouched (a copy, never a sum: bit-exact).
void Simulation::check_collective_outputs() {
  const bool scatter = s().collective == Collective::kReduceScatter;
  for (int r = 0; r < world_; ++r) {
    for (int c = 0; c < s().num_chunks; ++c) {
      if (scatter && c != r) continue;
      const int expr = output_expr(r, c);
      const std::string what = output_text(r, c, expr);
      if (expr < 0) {
        error(what + ": never written");
        continue;
      }
      if (!scatter) {
        if (expr != round_ * world_ + c) {
          error(what + ": expected rank " + std::to_string(c) + "'s input, copied");
        }
        continue;
      }
      check_whole_sum(what, expr);
    }
  }
}

void Simulation::check_outputs() {
  if (s().collective != Collective::kAllReduce) return check_collective_outputs();
  for (int c = 0; c < s().num_chunks; ++c) {
    int reference = -2;
    for (int r = 0; r < world_; ++r) {
      const int expr = output_expr(r, c);
      const std::string what = output_text(r, c, expr);
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

void Simulation::check_epilogues() {
  if (!s().epilogue) return;
  for (int r = 0; r < world_; ++r) {
    const int runs = epilogues_[round_][r];
    if (runs != 1) {
      error(in_round(round_) + "rank " + std::to_string(r) + " runs the epilogue " +
            std::to_string(runs) +
            " times; a fused schedule runs it exactly once, as each rank's last step");
    }
  }
}

// The generation double buffer is safe only if no rank can finish a call before every other
// rank has started it (and so finished the previous one). Streamed, every round is a call:
// each rank's end of round k must have heard of every other rank's first step of round k.
void Simulation::check_everyone_heard_from_everyone() {
  for (int r = 0; r < world_; ++r) {
    for (int q = 0; q < world_; ++q) {
      if (q != r && heard_at_end_[round_][r][q] < start_[q][round_]) {
        error(in_round(round_) + "rank " + std::to_string(r) +
              " can finish without hearing from rank " + std::to_string(q) +
              ": the generation double buffer would be unsafe");
      }
    }
  }
}

// LL data left unread would keep valid tags in the workspace.
void Simulation::check_ll_consumed() {
  for (const auto& [k, region] : regions_) {
    if (!region.ll_pending) continue;
    error(in_round(region.round) + "rank " + std::to_string(region.writer) + "'s LL data in rank " +
          std::to_string(std::get<1>(k)) + "'s slot " + std::to_string(std::get<2>(k)) + " chunk " +
          std::to_string(std::get<4>(k)) + " is never read in the call: its tags would stay valid");
  }
}

}  // namespace pcie_ar::plan::verifier
