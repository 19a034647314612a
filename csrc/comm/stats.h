// The one stats table: for every operation, calls per tactic label (or its fallback label) and
// declines per reason; for the communicator, bytes sent per peer and calls staged through a
// contiguous copy. stats() reads it whole and restore_stats() writes it whole.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "comm/decline.h"
#include "comm/op.h"

namespace pcie_ar::comm {

struct OpStats {
  std::map<std::string, int64_t> calls;     // tactic label (or fallback_label(op)) -> count
  std::map<std::string, int64_t> declines;  // decline name -> count

  bool operator==(const OpStats&) const = default;
};

// A snapshot: every counter, zero ones left out.
struct Stats {
  std::array<OpStats, kOpCount> ops;  // by op_index()
  std::vector<int64_t> bytes_sent_per_peer;
  int64_t staged = 0;  // calls whose tensors went through a contiguous copy

  OpStats& of(Op op) { return ops[op_index(op)]; }
  const OpStats& of(Op op) const { return ops[op_index(op)]; }
  bool operator==(const Stats&) const = default;
};

class Counters {
 public:
  explicit Counters(int world);

  // The counter of `op`'s calls under `label`. It lives as long as this object (restore()
  // zeroes it, never removes it), so a decision keeps it and counts without a lookup.
  int64_t* calls(Op op, std::string_view label);
  // Counts a decline of `op` and a call under its fallback label; true the first time `op`
  // declines for `reason` since construction or restore() (the one time it is logged).
  bool decline(Op op, Decline reason);
  // A kernel call of `bytes` that sent `fraction[p]` of them to peer p.
  void sent(const std::vector<double>& fraction, int64_t bytes);
  void staged() { ++staged_; }

  Stats snapshot() const;
  // Every counter back to `earlier` (a snapshot); counters it leaves out become zero. A reason
  // counted in `earlier` is not logged again; one that is not will be, at its first decline.
  void restore(const Stats& earlier);

 private:
  struct PerOp {
    std::map<std::string, int64_t, std::less<>> calls;
    int64_t* fallback = nullptr;  // calls[fallback_label(op)]
    std::array<int64_t, kDeclineCount> declines{};
    std::array<bool, kDeclineCount> logged{};
  };
  std::array<PerOp, kOpCount> ops_;
  std::vector<int64_t> bytes_sent_;
  int64_t staged_ = 0;
};

}  // namespace pcie_ar::comm
