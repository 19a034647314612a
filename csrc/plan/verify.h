// The verifier: proves, symbolically, that a schedule is a correct all-reduce. It simulates
// every rank's program with vector clocks and flags, and rejects a schedule unless
//  - every output element is every rank's input summed exactly once, by the group's one
//    expression (canonical_groups: the same operands, order and rounding points on every rank
//    and in every tactic and collective of the group, so a table may mix tactics freely);
//  - every read of a buffer happens after the write it needs and no write races a read or
//    another write (happens-before through flags only);
//  - no rank deadlocks, every flag has a single writer, and every rank's end depends on every
//    other rank's start (what makes the generation double buffer safe);
//  - in a staged schedule, each stage is a permutation: at most one outbound and one inbound
//    peer stream per rank;
//  - LL slots (flag-in-data): only their owner reads them, each write is read exactly once in
//    the same call (the read resets the tags; a second read would wait forever, an unread
//    write would leave valid tags behind), and each is written at most once per call. An LL
//    read orders only that data: it does not make the writer's other writes visible (no
//    fence), so it proves progress (the writer has started the call) but not visibility.
//  - a fused schedule (Schedule::epilogue) ends every rank's program with exactly one epilogue
//    step, and each rank's output holds the whole sum, every chunk, before it runs.
//  - a reduce-scatter (Schedule::collective) writes only chunk r of rank r's output, and that
//    chunk is the group's sum; an all-gather reads only chunk r of
//    rank r's input, and every output chunk c is rank c's input, copied (bit-exact). No
//    schedule writes an input.
//    The message is the whole tensor of `world` chunks in both (the all-gather's output, the
//    reduce-scatter's input); the executors address the one-chunk tensor from its chunk.
// It also counts the elements that cross between islands, and what each rank pays in
// synchronisation (Cost).
#pragma once

#include <string>
#include <vector>

#include "plan/schedule.h"

namespace pcie_ar::plan {

struct VerifyOptions {
  bool in_place = false;  // output aliases input (the in-place op)
};

// What the worst rank pays per call and per CTA, counted from the step lists. Runs of
// consecutive signals (or waits) go out in parallel, so each run counts once.
struct Cost {
  int system_fences = 0;  // runs of signals: each is a barrier and one system-scope release
  int peer_polls = 0;     // waits (or LL reads) that poll a peer's memory: PCIe round trips
  int local_waits = 0;    // runs of flag waits on this rank's own memory
  int data_polls = 0;     // LL operands awaited vector by vector in this rank's own memory
  // The longest chain of dependent fabric crossings: a posted write is one hop, a read of a
  // peer's memory two (a round trip).
  int fabric_hops = 0;
  // Elements one island writes into the other per message of N, as a multiple of N.
  double cross_island = 0.0;
};

struct Verification {
  bool ok = false;
  std::vector<std::string> errors;  // empty when ok
  int num_stages = 0;
  int max_steps = 0;               // longest rank program
  int max_outbound_per_stage = 0;  // distinct peers one rank sends to in one stage
  int max_inbound_per_stage = 0;   // distinct peers one rank receives from in one stage
  // Elements crossing islands per message of N elements, as a multiple of N:
  // cross_island[0] from island 0 to island 1, cross_island[1] the other way.
  double cross_island[2] = {0.0, 0.0};
  double cross_island_elements() const {
    return cross_island[0] > cross_island[1] ? cross_island[0] : cross_island[1];
  }
  // Total elements each rank sends to peers per message of N, as a multiple of N
  // (bytes_sent_per_peer in the stats comes from the same count).
  std::vector<std::vector<double>> sent_to;  // sent_to[src][dst]
  Cost cost;                                 // the worst rank, field by field
};

Verification verify(const Schedule& schedule, const VerifyOptions& options = {});

// A streamed message: one larger than the workspace runs as a sequence of rounds, each one
// ordinary call of a schedule (one generation, one launch of the executor) on its own part of the
// input and output; a round may take another tactic than the last (the last, shorter round
// often does). verify_rounds() proves the rounds back to back, as one message: each rank runs
// round 0's program, then round 1's, ..., as far ahead of its peers as its waits let it.
//  - Slots, LL slots and flags are the round's parity's (rounds k and k + 2 share them), the
//    input and output the round's own; every round's inputs are distinct leaves, so data another
//    round left in a slot is a wrong expression, and each round's outputs must be that round's
//    group sum. Every check of verify() holds in every round (the epilogue once per round, and
//    every rank's end of round k hears of every other rank's start of round k).
//  - A flag holds the generation of its last raise and a wait compares with >=: a round-k wait
//    takes a raise of round k or later. A raise of round k + 2 must follow every round-k wait for
//    the round-k raise, heard of the same way; otherwise that wait could take it.
//  - Two accesses of one slot from different rounds, one of them a write, must be ordered
//    slot-wide (another round's chunks and CTA slices may lie anywhere in the slot), the earlier
//    round's first: the later rank must have heard of the earlier one's next round (its kernel
//    of the earlier round had completed). So LL data of round k must be read, and the read heard
//    of so, before round k + 2 writes that LL slot.
// Errors name the round ("round 2: rank 1 step 4 (...)"). The rounds must be of one group: the
// same world, island map, collective and epilogue; anything else is refused. The counts
// (stages, steps, traffic, cost) are the worst round's, field by field: each round is one call.
// verify_rounds({s}) is verify(s).
Verification verify_rounds(const std::vector<Schedule>& rounds, const VerifyOptions& options = {});

}  // namespace pcie_ar::plan
