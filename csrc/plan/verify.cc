// The verifier's entry points: the checks on the rounds as a group, the cost count, and the
// Simulation (verify_simulation.h) that proves the rest.
#include "plan/verify.h"

#include <algorithm>
#include <string>
#include <vector>

#include "plan/verify_simulation.h"

namespace pcie_ar::plan {
namespace {

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

std::string island_text(const std::vector<int>& island_of) {
  std::string out = "{";
  for (size_t i = 0; i < island_of.size(); ++i)
    out += (i ? "," : "") + std::to_string(island_of[i]);
  return out + "}";
}

// What makes round k's schedule one of another group than round 0's, or empty.
std::string other_group(const Schedule& first, const Schedule& s) {
  std::string out;
  auto differs = [&](const std::string& what) { out += (out.empty() ? "" : ", ") + what; };
  if (s.world != first.world) {
    differs("world " + std::to_string(s.world) + ", not " + std::to_string(first.world));
  }
  if (s.world == first.world && s.island_of != first.island_of) {
    differs("island map " + island_text(s.island_of) + ", not " + island_text(first.island_of));
  }
  if (s.collective != first.collective) {
    differs(std::string(collective_name(s.collective)) + ", not " +
            std::string(collective_name(first.collective)));
  }
  if (s.epilogue != first.epilogue) {
    differs(s.epilogue ? std::string("fused epilogue, not none") : "no epilogue, not fused");
  }
  return out;
}

Verification verify_all(const std::vector<const Schedule*>& rounds, const VerifyOptions& options) {
  Verification v;
  if (rounds.empty()) {
    v.errors.push_back("no rounds: a message runs at least one");
    return v;
  }
  const int num_rounds = static_cast<int>(rounds.size());
  auto in_round = [&](int k) {
    return num_rounds > 1 ? "round " + std::to_string(k) + ": " : std::string();
  };
  v.num_stages = rounds[0]->num_stages;
  for (int k = 0; k < num_rounds; ++k) {
    const Schedule& schedule = *rounds[k];
    v.num_stages = std::max(v.num_stages, schedule.num_stages);
    const int W = schedule.world;
    if (W < 2 || W > kMaxWorld || static_cast<int>(schedule.programs.size()) != W ||
        static_cast<int>(schedule.island_of.size()) != W || schedule.num_chunks < 1) {
      v.errors.push_back(in_round(k) + "malformed schedule: world " + std::to_string(W) + ", " +
                         std::to_string(schedule.programs.size()) + " programs, " +
                         std::to_string(schedule.island_of.size()) + " island entries, " +
                         std::to_string(schedule.num_chunks) + " chunks");
    }
  }
  if (!v.errors.empty()) return v;
  // A message's rounds are calls of one group: a table may pick another tactic for a round (the
  // last, shorter one), never another world, island map, collective or epilogue.
  for (int k = 1; k < num_rounds; ++k) {
    const std::string differs = other_group(*rounds[0], *rounds[k]);
    if (!differs.empty()) {
      v.errors.push_back(in_round(k) + "a schedule of another group than round 0's (" + differs +
                         "): the rounds of one message run one group's schedules");
    }
  }
  if (!v.errors.empty()) return v;
  for (int k = 0; k < num_rounds; ++k) {
    const Schedule& schedule = *rounds[k];
    if (schedule.collective == Collective::kAllReduce) continue;
    const std::string name(collective_name(schedule.collective));
    if (schedule.num_chunks != schedule.world) {
      v.errors.push_back(in_round(k) + "a " + name +
                         " cuts the message into world = " + std::to_string(schedule.world) +
                         " chunks, not " + std::to_string(schedule.num_chunks));
    }
    if (options.in_place) v.errors.push_back(in_round(k) + "a " + name + " has no in-place form");
    if (schedule.epilogue) {
      v.errors.push_back(in_round(k) + "the epilogue ends an all-reduce, not a " + name);
    }
  }
  if (!v.errors.empty()) return v;
  const int W = rounds[0]->world;
  v.sent_to.assign(W, std::vector<double>(W, 0.0));
  for (int k = 0; k < num_rounds; ++k) {
    int max_steps = 0;
    for (const auto& program : rounds[k]->programs) {
      max_steps = std::max(max_steps, static_cast<int>(program.size()));
    }
    v.max_steps = std::max(v.max_steps, max_steps);
    if (max_steps > kMaxSteps) {
      v.errors.push_back(in_round(k) + "a program has " + std::to_string(max_steps) +
                         " steps; at most " + std::to_string(kMaxSteps) + " fit the executors");
    }
  }
  verifier::Simulation sim(rounds, options, v);
  sim.run();
  for (int k = 0; k < num_rounds; ++k) {
    const Schedule& schedule = *rounds[k];
    const verifier::RoundCounts& counts = sim.counts()[k];
    for (int r = 0; r < W; ++r) add_cost(schedule.programs[r], r, v.cost);
    v.cost.fabric_hops = std::max(v.cost.fabric_hops, counts.fabric_hops);
    for (int side = 0; side < 2; ++side) {
      v.cross_island[side] = std::max(v.cross_island[side], counts.cross_island[side]);
    }
    for (int from = 0; from < W; ++from) {
      for (int to = 0; to < W; ++to) {
        v.sent_to[from][to] = std::max(v.sent_to[from][to], counts.sent_to[from][to]);
      }
    }
    for (const auto& [where, peers] : counts.out) {
      v.max_outbound_per_stage = std::max(v.max_outbound_per_stage, static_cast<int>(peers.size()));
      if (schedule.staged && peers.size() > 1) {
        v.errors.push_back(in_round(k) + "stage " + std::to_string(where.first) + ": rank " +
                           std::to_string(where.second) + " sends to " +
                           std::to_string(peers.size()) +
                           " peers; a staged schedule allows one outbound stream per stage");
      }
    }
    for (const auto& [where, peers] : counts.in) {
      v.max_inbound_per_stage = std::max(v.max_inbound_per_stage, static_cast<int>(peers.size()));
      if (schedule.staged && peers.size() > 1) {
        v.errors.push_back(in_round(k) + "stage " + std::to_string(where.first) + ": rank " +
                           std::to_string(where.second) + " receives from " +
                           std::to_string(peers.size()) +
                           " peers; a staged schedule allows one inbound stream per stage");
      }
    }
  }
  v.cost.cross_island = v.cross_island_elements();
  v.ok = v.errors.empty();
  return v;
}

}  // namespace

Verification verify(const Schedule& schedule, const VerifyOptions& options) {
  return verify_all({&schedule}, options);
}

Verification verify_rounds(const std::vector<Schedule>& rounds, const VerifyOptions& options) {
  std::vector<const Schedule*> pointers;
  for (const Schedule& s : rounds) pointers.push_back(&s);
  return verify_all(pointers, options);
}

}  // namespace pcie_ar::plan
