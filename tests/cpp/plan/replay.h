// A numeric replay of a schedule's encoded step lists (tests only).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "plan/layout.h"
#include "plan/schedule.h"

namespace pcie_ar::plan {

// Replays the encoded programs of all ranks with real numbers, single-threaded, honouring
// flags, block by block: what a transport does, minus concurrency. Each sum is formed in fp32
// from +0 in operand order and, with `bf16`, rounded to bf16 (round to nearest even) as the
// executors round a bf16 sum; a split step (Step::split) rounds its two groups first.
class Replay {
 public:
  // Small integers (they sum exactly in fp32, whatever the order), or with `bf16` values of wide
  // exponents, each exact in bf16, whose sums round differently in different orders.
  Replay(const Schedule& s, int64_t numel, int blocks, bool in_place, bool bf16 = false,
         uint32_t seed = 1234)
      : s_(s), numel_(numel), blocks_(blocks), in_place_(in_place), bf16_(bf16) {
    for (int r = 0; r < s.world; ++r) programs_.push_back(encode_program(s, r));
    std::mt19937 rng(seed + s.world);
    std::uniform_int_distribution<int> dist(-64, 64);
    std::uniform_int_distribution<int> mantissa(-255, 255);
    std::uniform_int_distribution<int> exponent(-12, 12);
    inputs_.assign(s.world, std::vector<float>(numel));
    for (auto& in : inputs_) {
      for (auto& x : in) {
        x = bf16 ? std::ldexp(static_cast<float>(mantissa(rng)), exponent(rng))
                 : static_cast<float>(dist(rng));
      }
    }
    outputs_ = in_place
                   ? inputs_
                   : std::vector<std::vector<float>>(s.world, std::vector<float>(numel, -999.f));
    slots_.assign(s.world, std::vector<std::vector<float>>(num_slots_for(s.world),
                                                           std::vector<float>(numel, -777.f)));
    ll_slots_ = slots_;
  }

  // Returns false on deadlock.
  bool run() {
    for (int b = 0; b < blocks_; ++b) {
      flags_.clear();
      EXPECT_TRUE(ll_landed_.empty()) << "LL data left unread";
      std::vector<int> pc(s_.world, 0);
      bool done = false;
      while (!done) {
        done = true;
        bool progress = false;
        for (int r = 0; r < s_.world; ++r) {
          const Program& p = programs_[r];
          while (pc[r] < p.num_steps) {
            const Step& step = p.steps[pc[r]];
            if (step.kind == StepKind::kWait && !flags_.count({step.flag_owner, step.flag})) break;
            if (!ll_ready(step)) break;
            execute(r, b, step);
            ++pc[r];
            progress = true;
          }
          if (pc[r] < p.num_steps) done = false;
        }
        if (!done && !progress) return false;
      }
    }
    return true;
  }

  float expected(int64_t i) const {
    float sum = 0;
    for (int r = 0; r < s_.world; ++r) sum += original_inputs_.empty() ? 0 : original_inputs_[r][i];
    return sum;
  }

  void keep_inputs() { original_inputs_ = inputs_; }
  // Every rank's original input element i (after keep_inputs()).
  std::vector<float> inputs_at(int64_t i) const {
    std::vector<float> x;
    for (const auto& in : original_inputs_) x.push_back(in[i]);
    return x;
  }
  const std::vector<float>& output(int r) const { return in_place_ ? inputs_[r] : outputs_[r]; }

 private:
  float round(float x) const {
    if (!bf16_ || std::isnan(x)) return x;
    uint32_t bits;
    std::memcpy(&bits, &x, 4);
    bits = (bits + 0x7fff + ((bits >> 16) & 1)) & 0xffff0000u;
    std::memcpy(&x, &bits, 4);
    return x;
  }

  // A reduce whose LL operands have all landed (and not yet been consumed).
  bool ll_ready(const Step& step) const {
    if (step.kind != StepKind::kReduce) return true;
    for (int i = 0; i < step.num_srcs; ++i) {
      const BufRef& src = step.srcs[i];
      if (src.space == Space::kLL && !ll_landed_.count({src.owner, src.slot, step.chunk})) {
        return false;
      }
    }
    return true;
  }

  float* resolve(int r, const BufRef& buf) {
    switch (buf.space) {
      case Space::kInput:
        EXPECT_EQ(buf.owner, r);
        return inputs_[r].data();
      case Space::kOutput:
        EXPECT_EQ(buf.owner, r);
        return in_place_ ? inputs_[r].data() : outputs_[r].data();
      case Space::kSlot:
        return slots_[buf.owner][buf.slot].data();
      case Space::kLL:
        return ll_slots_[buf.owner][buf.slot].data();
    }
    return nullptr;
  }

  void execute(int r, int block, const Step& step) {
    if (step.kind == StepKind::kSignal) {
      flags_[{step.flag_owner, step.flag}] = r;
      return;
    }
    if (step.kind == StepKind::kWait) {
      EXPECT_EQ(flags_.at({step.flag_owner, step.flag}), step.peer);
      return;
    }
    // 4 fp32 elements per 16-byte vector.
    const VecRange v = slice_range(numel_ / 4, programs_[r].num_chunks, step.chunk, blocks_, block);
    float* dst = resolve(r, step.dst);
    float* dst2 = step.num_dsts == 2 ? resolve(r, step.dst2) : nullptr;
    const int n = step.num_srcs;
    for (int64_t i = v.begin * 4; i < v.end * 4; ++i) {
      const auto sum = [&](int from, int to) {
        float acc = 0.0f;
        for (int k = from; k < to; ++k) acc += resolve(r, step.srcs[k])[i];
        return round(acc);
      };
      const float value = n == 1            ? resolve(r, step.srcs[0])[i]
                          : step.split == 0 ? sum(0, n)
                                            : round(0.0f + sum(0, step.split) + sum(step.split, n));
      dst[i] = value;
      if (dst2 != nullptr) dst2[i] = value;
    }
    for (int k = 0; k < step.num_srcs; ++k) {
      const BufRef& src = step.srcs[k];
      if (src.space == Space::kLL) {
        EXPECT_EQ(src.owner, r) << "an LL read polls a peer's memory";
        ll_landed_.erase({src.owner, src.slot, step.chunk});
      }
    }
    if (step.dst.space == Space::kLL) {
      EXPECT_TRUE(ll_landed_.insert({step.dst.owner, step.dst.slot, step.chunk}).second)
          << "an LL slot written twice before it was read";
    }
  }

  const Schedule& s_;
  int64_t numel_;
  int blocks_;
  bool in_place_;
  bool bf16_;
  std::vector<Program> programs_;
  std::vector<std::vector<float>> inputs_, original_inputs_, outputs_;
  std::vector<std::vector<std::vector<float>>> slots_;
  std::map<std::pair<int, int>, int> flags_;
  std::vector<std::vector<std::vector<float>>> ll_slots_;
  std::set<std::tuple<int, int, int>> ll_landed_;  // (owner, slot, chunk) written, unread
};

}  // namespace pcie_ar::plan
