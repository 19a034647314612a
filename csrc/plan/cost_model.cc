#include "plan/cost_model.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "plan/layout.h"

namespace pcie_ar::plan {

ExecutorModel current_executor() {
  ExecutorModel e;
  // The decode-shaped kernels' groups (kLLGroup<kDecodeThreads>, primitives_gpu.cuh): every LL
  // and lamport tactic the seed derives launches 256 threads (tuning/model.py, launch_shape), so
  // it runs them (kernel_params.h, executor_bound). The large-message kernels take 2 (lamport 4
  // on sm_100+); nothing the model prices runs LL on them.
  e.first_look_group = kMaxSources;
  e.dense_first_look_group = kMaxSources;
  e.parallel_first_look = true;       // gather_ll_group: loads, then compares (tests/sass)
  e.parallel_relooks = true;          // relook_ll_group: every missed operand at each look
  e.multi_destination_copies = true;  // runs of copies of one chunk: run_fanout
  return e;
}

namespace {

std::string fixed(double us) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.2f", us);
  return text;
}

// A moment on some rank's critical path, and the chain of latencies that led to it.
struct Timed {
  double us = 0.0;
  int trips = 0;
  std::vector<std::string> path;

  void add(double cost_us, const std::string& what) {
    us += cost_us;
    ++trips;
    path.push_back(what + " " + fixed(cost_us));
  }
};

const Timed& later(const Timed& a, const Timed& b) { return b.us > a.us ? b : a; }

std::string rank_text(int r) { return "rank " + std::to_string(r); }

class Model {
 public:
  Model(const Schedule& s, int64_t nbytes, Placement placement, const LatencyModel& l,
        const ExecutorModel& e)
      : s_(s),
        host_(placement == Placement::kHostMemory),
        l_(l),
        e_(e),
        chunk_bytes_(static_cast<double>(nbytes) / s.num_chunks),
        ll_expansion_(s.protocol == Protocol::kLamport ? 1 : kLLExpansion),
        now_(s.world),
        tx_(s.world, 0.0),
        rx_(s.world, 0.0),
        peers_out_(s.world),
        peers_in_(s.world),
        wrote_out_(s.world, false) {
    for (int r = 0; r < s.world; ++r) {
      now_[r].us = l.launch_us;
      now_[r].path.push_back("launch " + fixed(l.launch_us));
      // The generation counter is read before anything else (it names the call's tags).
      now_[r].add(l.local_load_us, rank_text(r) + ": read the generation counter (local load)");
    }
  }

  CostReport run() {
    std::vector<size_t> pc(s_.world, 0);
    for (bool progress = true; progress;) {
      progress = false;
      for (int r = 0; r < s_.world; ++r) {
        const auto& program = s_.programs[r];
        while (pc[r] < program.size()) {
          // A reduce runs alone; signals and waits run as runs, a run of waits once all are in.
          size_t end = pc[r] + 1;
          if (program[pc[r]].kind != StepKind::kReduce) {
            while (end < program.size() && program[end].kind == program[pc[r]].kind) ++end;
          }
          if (!ready(r, program, pc[r], end)) break;
          execute(r, program, pc[r], end);
          pc[r] = end;
          progress = true;
        }
      }
    }
    for (int r = 0; r < s_.world; ++r) {
      if (pc[r] != s_.programs[r].size()) {
        throw std::invalid_argument("cost model: rank " + std::to_string(r) +
                                    " never finishes; verify the schedule first");
      }
    }
    CostReport report;
    const Timed* last = &now_[0];
    for (const Timed& t : now_) last = &later(*last, t);
    report.latency_us = last->us;
    report.serial_round_trips = last->trips;
    report.critical_path = last->path;
    busiest(report);
    report.modelled_us = report.latency_us + report.bandwidth_us;
    return report;
  }

 private:
  using Key = std::tuple<int, int, int, int>;  // (space, owner, slot, chunk)

  static bool is_slot(const BufRef& b) { return b.space == Space::kSlot || b.space == Space::kLL; }

  Key key(int r, const BufRef& b, int chunk) const {
    const bool slot = is_slot(b);
    return {static_cast<int>(b.space), slot ? b.owner : r, slot ? b.slot : 0, chunk};
  }
  bool crosses(int a, int b) const { return s_.island_of[a] != s_.island_of[b]; }

  // A step can start once everything it waits for exists: its LL operands written, its flag
  // raised (the verifier proved that they all will be).
  bool ready(int r, const Step& step) const {
    if (step.kind == StepKind::kWait) return flags_.count({step.flag_owner, step.flag}) > 0;
    if (step.kind != StepKind::kReduce) return true;
    for (int i = 0; i < step.num_srcs; ++i) {
      if (step.srcs[i].space == Space::kLL && !regions_.count(key(r, step.srcs[i], step.chunk))) {
        return false;
      }
    }
    return true;
  }

  bool ready(int r, const std::vector<Step>& program, size_t begin, size_t end) const {
    for (size_t i = begin; i < end; ++i) {
      if (!ready(r, program[i])) return false;
    }
    return true;
  }

  // The latency of one load (or poll) by rank r of something in `owner`'s workspace (a slot or
  // a flag), and what to call it.
  std::pair<double, std::string> workspace_read_cost(int r, int owner) const {
    if (host_) return {l_.host_read_us, "host memory read"};
    if (owner == r) return {l_.local_load_us, "local load"};
    return crosses(r, owner) ? std::pair{l_.peer_read_cross_us, std::string("peer read, across")}
                             : std::pair{l_.peer_read_us, std::string("peer read")};
  }

  // The same for an operand: the rank's own input and output are always in its GPU's memory.
  std::pair<double, std::string> load_cost(int r, const BufRef& b) const {
    if (!is_slot(b)) return {l_.local_load_us, "local load"};
    return workspace_read_cost(r, b.owner);
  }

  // From a store by rank r to `owner`'s memory until the owner (or anyone) can read it.
  std::pair<double, std::string> write_cost(int r, int owner) const {
    if (host_) return {l_.host_write_us, "write to host memory"};
    if (owner == r) return {0.0, ""};
    return crosses(r, owner) ? std::pair{l_.posted_write_cross_us,
                                         "posted write to " + rank_text(owner) + ", across"}
                             : std::pair{l_.posted_write_us, "posted write to " + rank_text(owner)};
  }

  std::string operand_text(const BufRef& b) const {
    switch (b.space) {
      case Space::kInput:
        return "the input";
      case Space::kOutput:
        return "the output";
      case Space::kSlot:
        return "slot " + std::to_string(b.slot) + " of " + rank_text(b.owner);
      case Space::kLL:
        return "LL from " + rank_text(b.writer);
    }
    return "?";
  }

  void count_bytes(int stage, int from, int to, double bytes) {
    tx_[from] += bytes;
    rx_[to] += bytes;
    peers_out_[from][stage].insert(to);
    peers_in_[to][stage].insert(from);
    if (crosses(from, to)) cross_[{from, s_.island_of[from], s_.island_of[to]}] += bytes;
  }

  // Bytes a rank moves over the links for one operand load or one store. On host memory an LL
  // operand's reset to kLLEmpty goes back over the link too.
  void traffic_of_load(int stage, int r, const BufRef& b, double bytes) {
    if (!is_slot(b)) return;
    if (host_) {
      rx_[r] += bytes;  // host DRAM to this GPU
      if (b.space == Space::kLL) tx_[r] += bytes;
      if (crosses(r, b.owner)) cross_[{r, s_.island_of[b.owner], s_.island_of[r]}] += bytes;
    } else if (b.owner != r) {
      count_bytes(stage, b.owner, r, bytes);
    }
  }

  void traffic_of_store(int stage, int r, const BufRef& b, double bytes) {
    if (!is_slot(b)) return;
    if (host_) {
      tx_[r] += bytes;
      if (crosses(r, b.owner)) cross_[{r, s_.island_of[r], s_.island_of[b.owner]}] += bytes;
    } else if (b.owner != r) {
      count_bytes(stage, r, b.owner, bytes);
    }
  }

  void execute(int r, const std::vector<Step>& program, size_t begin, size_t end) {
    const Step& step = program[begin];
    const std::string where = rank_text(r) + " step " + std::to_string(begin);
    switch (step.kind) {
      case StepKind::kReduce:
        return reduce(r, program, begin, where);
      case StepKind::kSignal:
        return signal(r, program, begin, end, where);
      case StepKind::kWait:
        return wait(r, program, begin, end, where);
      case StepKind::kEpilogue:
        return epilogue(r, where);
    }
  }

  // The fused epilogue: the rank's CTAs meet on flags in its own memory (one local poll), then
  // each row is read (output, residual, weight: loaded together), summed into its partials and
  // reduced in shared memory, and read again to be normalised (the CTA's own stores). No fabric:
  // every operand is the rank's own.
  void epilogue(int r, const std::string& where) {
    Timed& t = now_[r];
    t.add(l_.local_load_us, where + ": the rank's CTAs meet (local poll)");
    t.add(l_.local_load_us, where + ": epilogue, rows loaded (local load)");
    t.add(l_.local_load_us, where + ": epilogue, rows normalised (local load)");
  }

  // Operands are loaded in waves: a wave issues every load at once; it is one group of
  // first_look_group operands, or (without a parallel first look) ends at its first LL operand.
  // Operands whose data was not there at the wave's first look are polled until they land.
  void reduce(int r, const std::vector<Step>& program, size_t index, const std::string& where) {
    const Step& step = program[index];
    Timed& t = now_[r];
    const bool ll_dst = step.dst.space == Space::kLL;
    // The executor's fan-out (run_fanout): a copy that joins the run the previous step started
    // finds its source already in registers.
    const bool reuses_source =
        e_.multi_destination_copies && index > 0 && continues_fanout(program[index - 1], step);
    int i = 0;
    while (i < step.num_srcs) {
      const int group = std::max(
          1, s_.protocol == Protocol::kLamport ? e_.dense_first_look_group : e_.first_look_group);
      const int group_end = std::min<int>(step.num_srcs, (i / group + 1) * group);
      int wave_end = i;
      while (wave_end < group_end) {
        if (step.srcs[wave_end++].space == Space::kLL && !e_.parallel_first_look) break;
      }
      // The first look: every load of the wave in flight, the wave done when the slowest is back.
      const Timed start = t;
      Timed first = start;
      std::vector<std::pair<int, const Timed*>> missed;  // (operand, when it landed)
      for (int k = i; k < wave_end; ++k) {
        const BufRef& src = step.srcs[k];
        const auto [cost, kind] = load_cost(r, src);
        Timed look = start;
        if (reuses_source) {
          look.path.push_back(where + ": " + operand_text(src) + " still in registers 0.00");
        } else {
          look.add(cost, where + ": load " + operand_text(src) + " (" + kind + ")");
        }
        first = later(first, look);
        const auto it = regions_.find(key(r, src, step.chunk));
        if (it != regions_.end() && it->second.us > start.us) missed.emplace_back(k, &it->second);
        traffic_of_load(step.stage, r, src,
                        chunk_bytes_ * (src.space == Space::kLL ? ll_expansion_ : 1));
      }
      t = first;
      if (e_.parallel_relooks && !missed.empty()) {
        // Every look re-loads all of the group's pending operands: one more look after the
        // last of them lands.
        auto last = missed.front();
        for (const auto& m : missed) {
          if (m.second->us > last.second->us) last = m;
        }
        const BufRef& src = step.srcs[last.first];
        const auto [cost, kind] = load_cost(r, src);
        Timed seen = later(t, *last.second);
        seen.add(cost, where + ": a look sees " + operand_text(src) + " land (" + kind + ")");
        t = seen;
      } else {
        // Pending operands are awaited one at a time, in operand order: each costs at least
        // one more look, after the one before it.
        for (const auto& [k, landed] : missed) {
          const BufRef& src = step.srcs[k];
          const auto [cost, kind] = load_cost(r, src);
          Timed seen = later(t, *landed);
          seen.add(cost, where + ": poll sees " + operand_text(src) + " land (" + kind + ")");
          t = seen;
        }
      }
      i = wave_end;
    }
    // Stores are posted: the rank goes on at once; the data is readable where it lands later.
    for (int d = 0; d < step.num_dsts; ++d) {
      const BufRef& dst = d == 0 ? step.dst : step.dst2;
      const double bytes = chunk_bytes_ * (ll_dst ? ll_expansion_ : 1);
      traffic_of_store(step.stage, r, dst, bytes);
      if (is_slot(dst) && (host_ || dst.owner != r)) wrote_out_[r] = true;
      Timed landed = t;
      if (is_slot(dst)) {
        const auto [cost, kind] = write_cost(r, dst.owner);
        if (cost > 0.0) landed.add(cost, where + ": " + kind);
      }
      regions_[key(r, dst, step.chunk)] = landed;
    }
  }

  // A run of signals: one barrier, one system fence, then every flag goes out at once.
  void signal(int r, const std::vector<Step>& program, size_t begin, size_t end,
              const std::string& where) {
    Timed& t = now_[r];
    const double fence =
        wrote_out_[r] ? l_.fence_after_peer_writes_us : l_.fence_after_local_writes_us;
    t.add(fence, where + ": system fence" + (wrote_out_[r] ? " after fabric writes" : ""));
    wrote_out_[r] = false;
    for (size_t i = begin; i < end; ++i) {
      const Step& step = program[i];
      Timed landed = t;
      const auto [cost, kind] = write_cost(r, step.flag_owner);
      if (cost > 0.0) landed.add(cost, where + ": flag, " + kind);
      flags_[{step.flag_owner, step.flag}] = landed;
    }
  }

  // A run of waits: polled in parallel, done when the last flag is seen.
  void wait(int r, const std::vector<Step>& program, size_t begin, size_t end,
            const std::string& where) {
    Timed& t = now_[r];
    Timed done = t;
    for (size_t i = begin; i < end; ++i) {
      const Step& step = program[i];
      const auto [cost, kind] = workspace_read_cost(r, step.flag_owner);
      Timed seen = later(t, flags_.at({step.flag_owner, step.flag}));
      seen.add(cost,
               where + ": a poll sees the flag of " + rank_text(step.peer) + " (" + kind + ")");
      done = later(done, seen);
    }
    t = done;
  }

  void busiest(CostReport& report) const {
    auto consider = [&](double bytes, double gbps, const std::string& name) {
      const double us = bytes / (gbps * 1e3);
      if (bytes > 0.0 && us > report.bandwidth_us) {
        report.bandwidth_us = us;
        report.busiest_link_bytes = bytes;
        report.busiest_link = name;
      }
    };
    auto rate = [&](const std::map<int, std::set<int>>& by_stage) {
      for (const auto& [stage, peers] : by_stage) {
        if (peers.size() > 1) return l_.gpu_link_fanout_gbps;
      }
      return l_.gpu_link_gbps;
    };
    for (int r = 0; r < s_.world; ++r) {
      consider(tx_[r], rate(peers_out_[r]), rank_text(r) + " out");
      consider(rx_[r], rate(peers_in_[r]), rank_text(r) + " in");
    }
    // socket_link_gbps is one rank's flow across the sockets (FlashInfer #4870 measured it per
    // flow), so each rank's crossing bytes are priced apart.
    for (const auto& [flow, bytes] : cross_) {
      const auto [rank, from, to] = flow;
      consider(
          bytes, l_.socket_link_gbps,
          rank_text(rank) + " across socket " + std::to_string(from) + "->" + std::to_string(to));
    }
  }

  const Schedule& s_;
  const bool host_;
  const LatencyModel& l_;
  const ExecutorModel& e_;
  const double chunk_bytes_;
  const int ll_expansion_;  // LL slot bytes per payload byte: 2 (tagged), 1 (lamport)
  std::vector<Timed> now_;
  std::vector<double> tx_, rx_;
  // The peers each rank sends to (receives from) in each stage, P2P only (host memory is one
  // stream): a link fans out when one stage has several.
  std::vector<std::map<int, std::set<int>>> peers_out_, peers_in_;
  std::vector<bool> wrote_out_;  // fabric writes since this rank's last fence
  // Bytes across the socket link per (the rank whose flow it is, from island, to island): the
  // sender of a P2P store, the reader of a P2P load, the GPU on either side of host memory.
  std::map<std::tuple<int, int, int>, double> cross_;
  std::map<Key, Timed> regions_;  // when each written buffer is readable where it lives
  std::map<std::pair<int, int>, Timed> flags_;
};

}  // namespace

CostReport model_cost(const Schedule& schedule, int64_t nbytes, Placement placement,
                      const LatencyModel& latency, const ExecutorModel& executor) {
  if (nbytes < 0) throw std::invalid_argument("cost model: nbytes must be >= 0");
  if (schedule.world < 2 || static_cast<int>(schedule.programs.size()) != schedule.world ||
      static_cast<int>(schedule.island_of.size()) != schedule.world || schedule.num_chunks < 1) {
    throw std::invalid_argument("cost model: malformed schedule; verify it first");
  }
  return Model(schedule, nbytes, placement, latency, executor).run();
}

}  // namespace pcie_ar::plan
