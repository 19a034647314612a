// The verifier: proves, symbolically, that a schedule is a correct all-reduce. It simulates
// every rank's program with vector clocks and flags, and rejects a schedule unless
//  - every output element is every rank's input summed exactly once, by the same expression
//    (the same operands, the same order, the same rounding points) on every rank, with the
//    operands of every sum in ascending rank order;
//  - every read of a buffer happens after the write it needs and no write races a read or
//    another write (happens-before through flags only);
//  - no rank deadlocks, every flag has a single writer, and every rank's end depends on every
//    other rank's start (what makes the generation double buffer safe);
//  - in a staged schedule, each stage is a permutation: at most one outbound and one inbound
//    peer stream per rank.
// It also counts the elements that cross between islands.
#pragma once

#include <string>
#include <vector>

#include "plan/schedule.h"

namespace pcie_ar::plan {

struct VerifyOptions {
  bool in_place = false;  // output aliases input (the in-place op)
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
};

Verification verify(const Schedule& schedule, const VerifyOptions& options = {});

}  // namespace pcie_ar::plan
