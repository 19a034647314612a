// The Simulation's memory: reads and writes of regions and LL slots, checked for races within a
// round and, slot-wide, across rounds that share a slot.
#include <algorithm>
#include <string>

#include "plan/verify_simulation.h"

namespace pcie_ar::plan::verifier {

// Rounds that share a slot (same parity) share its memory whatever their chunks: a round's
// size and tactic decide where its chunks lie, so one round's chunk may overlap any chunk of
// another. Two accesses of a slot from different rounds, one of them a write, are ordered
// slot-wide, earlier round first. A read need not be checked against earlier rounds' writes:
// it reads this round's write, which such a write was checked against, or it reads stale
// data (an error of its own).
void Simulation::check_across_rounds(int r, int index, const Step& step, const BufRef& buf,
                                     Use use) {
  if (!many_rounds()) return;
  SlotHistory& history = histories_[{static_cast<int>(buf.space), buf.owner, buf.slot, round_ & 1}];
  const bool writes = use != Use::kRead;
  for (int a = 0; a < world_; ++a) {
    if (a == r) continue;  // program order
    for (const bool other_writes : {true, false}) {
      if (!writes && !other_writes) continue;  // two reads never conflict
      for (const auto& [j, access] : other_writes ? history.writes[a] : history.reads[a]) {
        if (j == round_) continue;  // one round: the chunk-wise checks
        const std::string what = other_writes ? "wrote" : "read";
        if (j > round_) {
          error(where(r, index, step) + ": " + (writes ? "writes " : "reads ") + slot_text(buf) +
                ", which rank " + std::to_string(a) + " already " + what + " in round " +
                std::to_string(j) + " " + step_text(access) + ": rank " + std::to_string(a) +
                " ran two rounds ahead (race across rounds)");
        } else if (!writes && j < round_) {
          continue;
        } else if (!ordered_after(r, a, j)) {
          error(where(r, index, step) + ": overwrites " + slot_text(buf) + ", which rank " +
                std::to_string(a) + " " + what + " in round " + std::to_string(j) + " " +
                step_text(access) + ", before rank " + std::to_string(r) +
                " heard that round end on rank " + std::to_string(a) +
                " (race across rounds: rounds " + std::to_string(j) + " and " +
                std::to_string(round_) + " share the slot)");
        }
      }
    }
  }
  const Access access{r, round_, index, &step};
  (use == Use::kWrite ? history.writes : history.reads)[r][round_] = access;
}

int Simulation::read(int r, int index, const Step& step, const BufRef& buf) {
  Region& region = regions_[key(round_, buf, step.chunk)];
  if (region.expr < 0) {
    error(where(r, index, step) + ": reads chunk " + std::to_string(step.chunk) +
          " before anything wrote it");
  } else if (region.round < round_) {
    error(where(r, index, step) + ": reads chunk " + std::to_string(step.chunk) + " of " +
          slot_text(buf) + ", which nothing wrote in this round: it holds round " +
          std::to_string(region.round) + "'s data (stale)");
  } else if (region.round == round_ && region.writer >= 0 && region.writer != r &&
             region.write_time > clocks_[r][region.writer]) {
    error(where(r, index, step) + ": reads data rank " + std::to_string(region.writer) +
          " wrote without waiting for its flag (race)");
  }
  region.reads.push_back({r, clocks_[r][r], round_});
  arrive(r, buf, region.avail);
  if (is_slot(buf)) check_across_rounds(r, index, step, buf, Use::kRead);
  return region.expr;
}

// The reader waits for the data itself: that orders this read after the write (no race) and
// proves the writer's progress, but makes none of its other writes visible.
int Simulation::read_ll(int r, int index, const Step& step, const BufRef& buf) {
  Region& region = regions_[key(round_, buf, step.chunk)];
  if (buf.owner != r) {
    error(where(r, index, step) + ": reads an LL slot in rank " + std::to_string(buf.owner) +
          "'s memory; LL readers poll only their own memory");
  }
  if (region.writer != buf.writer) {
    error(where(r, index, step) + ": expects rank " + std::to_string(buf.writer) +
          "'s LL data but rank " + std::to_string(region.writer) + " writes it");
  }
  region.ll_pending = false;
  for (int q = 0; q < world_; ++q) heard_[r][q] = std::max(heard_[r][q], region.heard[q]);
  region.reads.push_back({r, clocks_[r][r], round_});
  arrive(r, buf, region.avail);
  check_across_rounds(r, index, step, buf, Use::kReset);
  return region.expr;
}

void Simulation::write_ll(int r, int index, const Step& step, const BufRef& buf, int expr) {
  Region& region = regions_[key(round_, buf, step.chunk)];
  if (buf.writer != r) {
    error(where(r, index, step) + ": names rank " + std::to_string(buf.writer) +
          " as the writer of an LL slot that rank " + std::to_string(r) + " writes");
  }
  if (region.round == round_) {
    error(where(r, index, step) +
          ": writes an LL slot a second time in one call (its tags cannot tell the writes "
          "apart)");
  }
  if (many_rounds()) {
    // The tags name the call: data of an earlier round that is still unread when this round's
    // lands is lost, and its reader waits forever. The chunks of the two rounds may differ:
    // any pending chunk of the slot is in the way.
    for (int c = 0; c < kMaxWorld; ++c) {
      auto it = regions_.find(key(round_, buf, c));
      if (it == regions_.end() || !it->second.ll_pending || it->second.round == round_) {
        continue;
      }
      error(where(r, index, step) + ": overwrites rank " + std::to_string(it->second.writer) +
            "'s round " + std::to_string(it->second.round) + " LL data (chunk " +
            std::to_string(c) + ") in " + slot_text(buf) + ", which rank " +
            std::to_string(buf.owner) + " has not read yet (race across rounds)");
    }
    check_across_rounds(r, index, step, buf, Use::kWrite);
  }
  region.round = round_;
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
void Simulation::arrive(int r, const BufRef& buf, int avail) {
  const bool remote = is_slot(buf) ? buf.owner != r : false;
  step_hops_ =
      std::max(step_hops_, remote ? std::max(hops_[r] + 2, avail + 1) : std::max(hops_[r], avail));
}

void Simulation::write(int r, int index, const Step& step, const BufRef& buf, int expr) {
  if (buf.space == Space::kInput) {
    error(where(r, index, step) + ": writes the rank's input, which the caller owns read-only");
    return;
  }
  // A reduce-scatter's output is the one chunk the rank owns: any other chunk lies outside
  // the caller's tensor.
  if (buf.space == Space::kOutput && s().collective == Collective::kReduceScatter &&
      step.chunk != r) {
    error(where(r, index, step) + ": writes output chunk " + std::to_string(step.chunk) +
          "; a reduce-scatter's output is chunk " + std::to_string(r) + " only");
    return;
  }
  Region& region = regions_[key(round_, buf, step.chunk)];
  // Chunk by chunk inside one round; check_across_rounds() orders it after other rounds.
  if (region.round == round_ && region.writer >= 0 && region.writer != r &&
      region.write_time > clocks_[r][region.writer]) {
    error(where(r, index, step) + ": overwrites data rank " + std::to_string(region.writer) +
          " wrote, with no ordering between the two writes (race)");
  }
  for (const Read& read : region.reads) {
    if (read.round == round_ && read.reader != r && read.time > clocks_[r][read.reader]) {
      error(where(r, index, step) + ": overwrites data rank " + std::to_string(read.reader) +
            " may still be reading (race)");
    }
  }
  if (is_slot(buf)) check_across_rounds(r, index, step, buf, Use::kWrite);
  region.expr = expr;
  region.writer = r;
  region.write_time = clocks_[r][r];
  region.round = round_;
  region.reads.clear();
  region.avail = hops_[r] + (buf.space == Space::kSlot && buf.owner != r ? 1 : 0);
}

}  // namespace pcie_ar::plan::verifier
