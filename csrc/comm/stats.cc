#include "comm/stats.h"

#include <algorithm>

namespace pcie_ar::comm {

static_assert(static_cast<size_t>(Decline::kSelfTest) + 1 == kDeclineCount,
              "decline values are dense: they index the counters");

Counters::Counters(int world) : bytes_sent_(std::max(world, 0), 0) {
  for (size_t i = 0; i < kOpCount; ++i) {
    ops_[i].fallback = calls(kOpNames.entries[i].value, fallback_label(kOpNames.entries[i].value));
  }
}

int64_t* Counters::calls(Op op, std::string_view label) {
  auto& calls = ops_[op_index(op)].calls;
  auto it = calls.find(label);
  if (it == calls.end()) it = calls.emplace(std::string(label), 0).first;
  return &it->second;
}

bool Counters::decline(Op op, Decline reason) {
  PerOp& per_op = ops_[op_index(op)];
  const auto index = static_cast<size_t>(reason);
  ++per_op.declines[index];
  ++*per_op.fallback;
  const bool first = !per_op.logged[index];
  per_op.logged[index] = true;
  return first;
}

void Counters::sent(const std::vector<double>& fraction, int64_t bytes) {
  const auto total = static_cast<double>(bytes);
  for (size_t p = 0; p < fraction.size() && p < bytes_sent_.size(); ++p) {
    bytes_sent_[p] += static_cast<int64_t>(fraction[p] * total);
  }
}

Stats Counters::snapshot() const {
  Stats s;
  for (size_t i = 0; i < kOpCount; ++i) {
    for (const auto& [label, count] : ops_[i].calls) {
      if (count) s.ops[i].calls[label] = count;  // decided (or installed) but never run: left out
    }
    for (size_t d = 0; d < kDeclineCount; ++d) {
      if (ops_[i].declines[d]) {
        s.ops[i].declines[std::string(decline_name(static_cast<Decline>(d)))] = ops_[i].declines[d];
      }
    }
  }
  s.bytes_sent_per_peer = bytes_sent_;
  s.staged = staged_;
  return s;
}

void Counters::restore(const Stats& earlier) {
  for (size_t i = 0; i < kOpCount; ++i) {
    PerOp& per_op = ops_[i];
    const OpStats& was = earlier.ops[i];
    for (auto& [label, count] : per_op.calls) {  // entries stay: decisions point at them
      const auto it = was.calls.find(label);
      count = it == was.calls.end() ? 0 : it->second;
    }
    for (const auto& [label, count] : was.calls) *calls(kOpNames.entries[i].value, label) = count;
    per_op.declines.fill(0);
    for (const auto& [name, count] : was.declines) {
      per_op.declines[static_cast<size_t>(parse_decline(name))] = count;
    }
    for (size_t d = 0; d < kDeclineCount; ++d) per_op.logged[d] = per_op.declines[d] > 0;
  }
  if (earlier.bytes_sent_per_peer.size() == bytes_sent_.size()) {
    bytes_sent_ = earlier.bytes_sent_per_peer;
  }
  staged_ = earlier.staged;
}

}  // namespace pcie_ar::comm
