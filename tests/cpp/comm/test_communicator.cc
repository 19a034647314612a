// The communicator's one call path, at world 3 (flat) and 4 (two islands), ranks as threads:
// every op's result is the all-reduce's (the same sums in the same order), the fused call gives
// the same bits on its kernels and on its unfused path, a table change reaches every op's next
// decision, stats() and restore_stats() carry every op's counters, and a call that declines to
// its caller touches nothing and counts nothing.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/full_like.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "comm_group.h"

namespace pcie_ar::comm {
namespace {

using test::CommGroup;
using test::rank_input;

constexpr int64_t kRows = 4;
constexpr int64_t kHidden = 96;
// Row A's reduce-scatter and all-gather take its all-reduce choice in two-shot form; row B is a
// two-shot of another direction, staging and launch shape.
const std::string kTableA = "*,*,*,0,*,oneshot,push,1,1,64\n";
const std::string kTableB = "*,*,*,0,*,twoshot,pull,0,2,64\n";
const std::string kLabelA = "oneshot/push/staged/flag/b1/t64";
const std::string kLabelAHalves = "twoshot/push/staged/flag/b1/t64";
const std::string kLabelB = "twoshot/pull/unstaged/flag/b2/t64";

// One rank's tensors: the message (world x kRows rows of kHidden), its piece of an all-gather, a
// residual and a weight shared by every rank.
struct Tensors {
  at::Tensor x, piece, residual, weight;
  Tensors(int rank, int world, at::ScalarType dtype = at::kFloat)
      : x(rank_input(rank, world * kRows * kHidden, dtype).view({world * kRows, kHidden})),
        piece(rank_input(rank, kRows * kHidden, dtype, 5.0).view({kRows, kHidden})),
        residual(
            rank_input(99, world * kRows * kHidden, dtype, 7.0).view({world * kRows, kHidden})),
        weight(rank_input(98, kHidden, dtype, 9.0)) {}
};

// The labels that would run each op on these tensors.
std::vector<std::string> labels(Communicator& c, const Tensors& t) {
  return {c.chosen_tactic(kAllReduce, t.x), c.chosen_tactic(kAllReduceAddRmsNorm, t.x, &t.weight),
          c.chosen_tactic(kReduceScatter, t.x), c.chosen_tactic(kAllGather, t.piece)};
}

struct Results {
  at::Tensor sum, scattered, gathered, y, residual_out;
};

// One call of each op (kFallback: every one must run on the kernels here, with no group).
Results run_every_op(Communicator& c, const Tensors& t) {
  Results r;
  EXPECT_EQ(c.run(kAllReduce, {t.x, r.sum}), Decline::kNone);
  EXPECT_EQ(c.run(kReduceScatter, {t.x, r.scattered}), Decline::kNone);
  EXPECT_EQ(c.run(kAllGather, {t.piece, r.gathered}), Decline::kNone);
  EXPECT_EQ(c.run(kAllReduceAddRmsNorm, {t.x, r.y, &t.residual, &t.weight, &r.residual_out, 1e-6}),
            Decline::kNone);
  return r;
}

// One call of each fused form beside all_reduce_add_rms_norm (no residual, FP8, NVFP4 on a bf16
// copy of the tensors: NVFP4 quantises bf16 or fp16).
void run_other_fused_forms(Communicator& c, const Tensors& t) {
  const at::Tensor scale = at::full({1}, 0.5f);
  const at::Tensor x16 = t.x.to(at::kBFloat16);
  const at::Tensor residual16 = t.residual.to(at::kBFloat16);
  const at::Tensor weight16 = t.weight.to(at::kBFloat16);
  for (const Op op : {kAllReduceRmsNorm, kAllReduceAddRmsNormFp8, kAllReduceRmsNormFp8,
                      kAllReduceAddRmsNormNvfp4, kAllReduceRmsNormNvfp4}) {
    const bool bf16 = is_nvfp4(op);
    at::Tensor out;
    at::Tensor residual_out;
    at::Tensor block_scale;
    OpArgs args{bf16 ? x16 : t.x, out};
    args.residual = has_residual(op) ? (bf16 ? &residual16 : &t.residual) : nullptr;
    args.weight = bf16 ? &weight16 : &t.weight;
    args.residual_out = &residual_out;
    args.eps = 1e-6;
    args.scale = is_quantised(op) ? &scale : nullptr;
    args.block_scale = is_nvfp4(op) ? &block_scale : nullptr;
    EXPECT_EQ(c.run(op, args), Decline::kNone) << op_name(op);
  }
}

void expect_halves_of_the_all_reduce(int rank, int world, const Tensors& t, const Results& r) {
  EXPECT_TRUE(at::equal(r.scattered, r.sum.narrow(0, rank * kRows, kRows))) << "rank " << rank;
  EXPECT_EQ(r.gathered.size(0), world * kRows);
  for (int q = 0; q < world; ++q) {
    EXPECT_TRUE(at::equal(r.gathered.narrow(0, q * kRows, kRows),
                          rank_input(q, kRows * kHidden, at::kFloat, 5.0).view({kRows, kHidden})));
  }
  EXPECT_TRUE(at::equal(r.residual_out, r.sum + t.residual)) << "rank " << rank;
}

TEST(CommunicatorOps, EveryOpIsTheAllReducesSumAsTheGroupsTree) {
  for (const auto& [world, islands] :
       std::vector<std::pair<int, std::vector<int>>>{{3, {}}, {4, {0, 0, 1, 1}}}) {
    CommGroup group(world, kTableA, world * kRows * kHidden, islands);
    group.each([&](int rank, Communicator& c) {
      const Tensors t(rank, world);
      const Results r = run_every_op(c, t);
      // oneshot: the group's tree in fp32 (islands: each island's sum, then the two).
      at::Tensor exact = at::zeros_like(t.x);
      if (islands.empty()) {
        for (int q = 0; q < world; ++q) exact = exact + Tensors(q, world).x;
      } else {
        exact = (exact + Tensors(0, world).x + Tensors(1, world).x) +
                (at::zeros_like(t.x) + Tensors(2, world).x + Tensors(3, world).x);
      }
      EXPECT_TRUE(at::equal(r.sum, exact)) << "rank " << rank << " world " << world;
      expect_halves_of_the_all_reduce(rank, world, t, r);
    });
  }
}

TEST(CommunicatorDecisions, SetTableDecidesEveryOpsNextCall) {
  CommGroup group(3, kTableA, 3 * kRows * kHidden);
  group.each([&](int rank, Communicator& c) {
    const Tensors t(rank, 3);
    // Rank 0 only asks (which decides there alone); the others run every op.
    if (rank == 0) {
      EXPECT_EQ(labels(c, t),
                (std::vector<std::string>{kLabelA, kLabelA, kLabelAHalves, kLabelAHalves}));
    }
  });
  for (int r = 0; r < 3; ++r) group[r].set_table(kTableB, "table B");
  group.each([&](int rank, Communicator& c) {
    const Tensors t(rank, 3);
    EXPECT_EQ(labels(c, t), std::vector<std::string>(4, kLabelB));
    expect_halves_of_the_all_reduce(rank, 3, t, run_every_op(c, t));
    const Stats s = c.stats();
    for (const Op op : {kAllReduceAddRmsNorm, kReduceScatter, kAllGather}) {
      EXPECT_EQ(s.of(op).calls, (std::map<std::string, int64_t>{{kLabelB, 1}})) << op_name(op);
    }
    // The fused call counts as the all-reduce it holds.
    EXPECT_EQ(s.of(kAllReduce).calls, (std::map<std::string, int64_t>{{kLabelB, 2}}));
  });
}

TEST(CommunicatorStats, RestoreRoundTripsEveryOpsCounters) {
  CommGroup group(3, kTableA, 3 * kRows * kHidden);
  group.each([&](int rank, Communicator& c) {
    const Tensors t(rank, 3);
    run_every_op(c, t);
    at::Tensor strided_out = at::empty({kHidden, 3 * kRows}).t();
    c.run(kAllReduce, {t.x, strided_out});  // staged
    const Stats before = c.stats();
    EXPECT_EQ(before.staged, 1);
    EXPECT_EQ(before.of(kAllReduce).calls.at(kLabelA), 3);
    for (const Op op : {kAllReduceAddRmsNorm, kReduceScatter, kAllGather}) {
      EXPECT_EQ(before.of(op).calls.size(), 1u) << op_name(op);
    }
    run_every_op(c, t);
    c.run(kAllReduce, {t.x, strided_out});
    EXPECT_NE(c.stats(), before);
    c.restore_stats(before);
    EXPECT_EQ(c.stats(), before);
    c.restore_stats(Stats{});
    EXPECT_EQ(c.stats().of(kAllReduce).calls.size(), 0u);
    EXPECT_EQ(c.stats().staged, 0);
    run_every_op(c, t);  // decisions made before still count
    run_other_fused_forms(c, t);
    for (const Op op : kOpNames.values()) {
      EXPECT_EQ(c.stats().of(op).calls.size(), 1u) << op_name(op);
    }
  });
}

TEST(CommunicatorStats, CountersRestoreDeclinesAndTheirFirstLogLine) {
  Counters counters(3);
  int64_t* calls = counters.calls(kReduceScatter, "some/label");
  ++*calls;
  EXPECT_TRUE(counters.decline(kAllGather, Decline::kTooLarge));
  EXPECT_FALSE(counters.decline(kAllGather, Decline::kTooLarge));  // said once
  EXPECT_TRUE(counters.decline(kAllReduceAddRmsNorm, Decline::kHidden));
  counters.sent({0.5, 0.0, 0.25}, 64);
  counters.staged();
  const Stats before = counters.snapshot();
  EXPECT_EQ(before.of(kAllGather).calls, (std::map<std::string, int64_t>{{"fallback", 2}}));
  EXPECT_EQ(before.of(kAllGather).declines, (std::map<std::string, int64_t>{{"too_large", 2}}));
  EXPECT_EQ(before.of(kAllReduceAddRmsNorm).calls,
            (std::map<std::string, int64_t>{{"unfused", 1}}));
  EXPECT_EQ(before.bytes_sent_per_peer, (std::vector<int64_t>{32, 0, 16}));

  ++*calls;
  EXPECT_TRUE(counters.decline(kAllReduce, Decline::kTable));
  counters.staged();
  counters.restore(before);
  EXPECT_EQ(counters.snapshot(), before);
  EXPECT_FALSE(counters.decline(kAllGather, Decline::kTooLarge));  // counted before: not again
  EXPECT_TRUE(counters.decline(kAllReduce, Decline::kTable));      // not counted before: said
  ++*calls;                                                        // the counter outlives restore
  EXPECT_EQ(counters.snapshot().of(kReduceScatter).calls.at("some/label"), 2);
}

TEST(CommunicatorOps, TheFusedCallsUnfusedPathGivesItsKernelsBits) {
  CommGroup group(3, kTableA, 3 * kRows * kHidden);
  group.each([&](int rank, Communicator& c) {
    const Tensors t(rank, 3, at::kBFloat16);
    at::Tensor y, residual_out, y_unfused, residual_out_unfused;
    ASSERT_EQ(c.run(kAllReduceAddRmsNorm, {t.x, y, &t.residual, &t.weight, &residual_out, 1e-5}),
              Decline::kNone);
    // A weight of another dtype declines the fused kernels; the unfused path (the all-reduce on
    // the kernels, then plan/epilogue.h's add and norm in ATen) gives the same bits.
    const at::Tensor wide_weight = t.weight.to(at::kDouble);
    EXPECT_EQ(c.decline_reason(kAllReduceAddRmsNorm, t.x, &wide_weight), Decline::kDtype);
    EXPECT_EQ(c.run(kAllReduceAddRmsNorm,
                    {t.x, y_unfused, &t.residual, &wide_weight, &residual_out_unfused, 1e-5}),
              Decline::kDtype);
    EXPECT_TRUE(at::equal(y, y_unfused)) << "rank " << rank;
    EXPECT_TRUE(at::equal(residual_out, residual_out_unfused)) << "rank " << rank;
    // A row's bits do not depend on the batch that holds it.
    at::Tensor y_row, residual_out_row;
    const at::Tensor x_row = t.x.narrow(0, 5, 1);
    const at::Tensor residual_row = t.residual.narrow(0, 5, 1);
    ASSERT_EQ(c.run(kAllReduceAddRmsNorm,
                    {x_row, y_row, &residual_row, &t.weight, &residual_out_row, 1e-5}),
              Decline::kNone);
    EXPECT_TRUE(at::equal(y_row, y.narrow(0, 5, 1))) << "rank " << rank;
    const Stats s = c.stats();
    EXPECT_EQ(s.of(kAllReduceAddRmsNorm).calls,
              (std::map<std::string, int64_t>{{kLabelA, 2}, {"unfused", 1}}));
    EXPECT_EQ(s.of(kAllReduceAddRmsNorm).declines, (std::map<std::string, int64_t>{{"dtype", 1}}));
    EXPECT_EQ(s.of(kAllReduce).calls, (std::map<std::string, int64_t>{{kLabelA, 3}}));
  });
}

TEST(CommunicatorOps, ADeclineReturnedToTheCallerTouchesAndCountsNothing) {
  const std::string table = "*,*,*,0,1024,oneshot,push,1,1,64\n*,*,*,1024,*,fallback\n";
  CommGroup group(2, table, 4096);
  Communicator& c = group[0];
  const Stats before = c.stats();
  const at::Tensor x = at::ones({512});  // 2048 bytes: the table's fallback
  at::Tensor out = at::full({512}, 7.0);
  EXPECT_EQ(c.run(kAllReduce, {x, out}, OnDecline::kReturn), Decline::kTable);
  EXPECT_TRUE(at::equal(out, at::full({512}, 7.0)));
  const at::Tensor big = at::ones({8192});
  at::Tensor unallocated;
  EXPECT_EQ(c.run(kAllReduce, {big, unallocated}, OnDecline::kReturn), Decline::kTooLarge);
  const at::Tensor piece = at::ones({5});  // 20 bytes a rank: not whole vectors
  at::Tensor gathered;
  EXPECT_EQ(c.run(kAllGather, {piece, gathered}, OnDecline::kReturn), Decline::kNot16ByteMultiple);
  const at::Tensor rows = at::ones({8, 6}, at::kBFloat16);  // 12-byte rows
  const at::Tensor weight = at::ones({6}, at::kBFloat16);
  at::Tensor y, residual_out;
  EXPECT_EQ(c.run(kAllReduceAddRmsNorm, {rows, y, &rows, &weight, &residual_out, 1e-6},
                  OnDecline::kReturn),
            Decline::kHidden);
  EXPECT_EQ(c.stats(), before);
}

// With grad mode on, an operand the call reads that autograd tracks: kReturn declines kAutograd
// (the caller's path keeps the graph) and still raises for any other bad argument; kFallback
// raises (the torch ops' caller has no path of its own). Grad mode off: the kernels run it.
TEST(CommunicatorOps, AReturnedCallReadingATrackedOperandDeclinesAutograd) {
  CommGroup group(2, kTableA, 4096);
  Communicator& c = group[0];  // its peer never calls: nothing may wait for it
  const Stats before = c.stats();
  const Tensors t(0, 2);
  const at::Tensor weight = t.weight.clone().requires_grad_(), x = t.x.clone().requires_grad_();
  at::Tensor out = at::full_like(t.x, 7.0), y, residual_out, sum;
  EXPECT_EQ(c.run(kAllReduceAddRmsNorm, {t.x, y, &t.residual, &weight, &residual_out, 1e-6},
                  OnDecline::kReturn),
            Decline::kAutograd);
  EXPECT_EQ(c.run(kAllReduce, {x, out}, OnDecline::kReturn), Decline::kAutograd);
  EXPECT_TRUE(at::equal(out, at::full_like(t.x, 7.0)));
  const at::Tensor short_weight = weight.narrow(0, 0, kHidden - 8);
  EXPECT_THROW(c.run(kAllReduceAddRmsNorm, {t.x, y, &t.residual, &short_weight, &residual_out},
                     OnDecline::kReturn),
               std::invalid_argument);
  EXPECT_THROW(c.run(kAllReduce, {x, sum}), std::runtime_error);
  EXPECT_EQ(c.stats(), before);
  group.each([&](int rank, Communicator& comm) {
    const at::NoGradGuard untracked;
    const Tensors mine(rank, 2);
    const at::Tensor tracked = mine.x.clone().requires_grad_();
    at::Tensor result;
    EXPECT_EQ(comm.run(kAllReduce, {tracked, result}, OnDecline::kReturn), Decline::kNone);
  });
}

TEST(CommunicatorArgs, BadArgumentsRaiseBeforeAnyCommunication) {
  CommGroup group(2, kTableA, 4096);
  Communicator& c = group[0];  // its peer never calls: nothing may wait for it
  const at::Tensor x = at::ones({6, 8});
  at::Tensor wrong = at::empty({6, 8});
  EXPECT_THROW(
      {
        at::Tensor out = at::empty({3, 8});
        c.run(kReduceScatter, {at::ones({5, 8}), out});
      },
      std::invalid_argument);
  EXPECT_THROW(c.run(kAllGather, {x, wrong}), std::invalid_argument);  // dim 0 not world x 6
  at::Tensor overlapping = x.narrow(0, 0, 3);
  EXPECT_THROW(c.run(kReduceScatter, {x, overlapping}), std::invalid_argument);
  at::Tensor expanded = at::ones({8}).expand({6, 8});
  EXPECT_THROW(c.run(kAllReduce, {x, expanded}), std::invalid_argument);
  const at::Tensor weight = at::ones({7});
  at::Tensor y, residual_out;
  EXPECT_THROW(c.run(kAllReduceAddRmsNorm, {x, y, &x, &weight, &residual_out, 1e-6}),
               std::invalid_argument);
  Stats nothing;
  nothing.bytes_sent_per_peer = {0, 0};
  EXPECT_EQ(c.stats(), nothing);
}

// What `call` raised as std::invalid_argument, or what happened instead.
std::string refusal(const std::function<void()>& call) {
  try {
    call();
  } catch (const std::invalid_argument& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("not std::invalid_argument: ") + e.what();
  }
  return "no error";
}

// Every rank makes the same bad call, so a call that is not refused runs (and is counted) instead
// of waiting for a peer: each message names the op, the argument and what it expects.
TEST(CommunicatorArgs, EveryOperandIsCheckedAndNamedBeforeAnyCommunication) {
  CommGroup group(2, kTableA, 4096);
  group.each([&](int rank, Communicator& c) {
    const Tensors t(rank, 2);
    const at::Tensor meta_weight = at::empty({kHidden}, at::TensorOptions().device(at::kMeta));
    // Copies of a tensor are the same tensor (in place), an undefined one is allocated.
    const auto fused = [&](at::Tensor out, at::Tensor residual, at::Tensor weight,
                           at::Tensor residual_out) {
      return [&c, &t, out, residual, weight, residual_out]() mutable {
        c.run(kAllReduceAddRmsNorm, {t.x, out, &residual, &weight, &residual_out});
      };
    };
    const at::Tensor given = at::zeros_like(t.x), residual = t.residual.clone(), fresh;
    const std::vector<std::pair<std::string, std::function<void()>>> cases = {
        {"all_reduce_add_rms_norm: out overlaps weight", fused(given, t.residual, given[0], fresh)},
        {"all_reduce_add_rms_norm: residual_out overlaps weight",
         fused(fresh, residual, residual[0], residual)},
        {"all_reduce_add_rms_norm: out overlaps x",
         fused(t.x.view_as(t.x), t.residual, t.weight, fresh)},
        {"all_reduce_add_rms_norm: weight is a Float [96] on meta; this communicator runs on cpu",
         fused(fresh, t.residual, meta_weight, fresh)},
        {"reduce_scatter: the input is torch.uint16",
         [&] {
           at::Tensor out;
           c.run(kReduceScatter, {t.x.to(at::ScalarType::UInt16), out});
         }},
        {"all_gather: out is a Float [8, 96] on meta",
         [&] {
           at::Tensor out = at::empty({8, kHidden}, at::TensorOptions().device(at::kMeta));
           c.run(kAllGather, {t.piece, out});
         }},
    };
    for (const auto& [expected, call] : cases) {
      const std::string got = refusal(call);
      EXPECT_EQ(got.substr(0, expected.size()), expected) << "rank " << rank << ": " << got;
    }
  });
  Stats nothing;
  nothing.bytes_sent_per_peer = {0, 0};
  for (int r = 0; r < 2; ++r) EXPECT_EQ(group[r].stats(), nothing);
}

// check() alone, for a caller that forms an output itself: run()'s refusals, and an undefined
// output (one the call would allocate) is left as it is.
TEST(CommunicatorArgs, CheckRefusesWhatRunRefusesAndTouchesNothing) {
  CommGroup group(2, kTableA, 4096);
  Communicator& c = group[0];  // its peer never calls: nothing may wait for it
  const Tensors t(0, 2);
  at::Tensor x = t.x, unallocated, same_x = t.x;
  EXPECT_NO_THROW(c.check(kAllReduceAddRmsNorm, {t.x, x, &t.residual, &t.weight, &unallocated}));
  EXPECT_FALSE(unallocated.defined());
  EXPECT_EQ(refusal([&] {
              c.check(kAllReduceAddRmsNorm, {t.x, x, &t.residual, &t.weight, &same_x});
            }).substr(0, 46),
            "all_reduce_add_rms_norm: residual_out overlaps");
  EXPECT_NO_THROW(c.check(kAllGather, {t.piece, unallocated}));
  EXPECT_FALSE(unallocated.defined());
  Stats nothing;
  nothing.bytes_sent_per_peer = {0, 0};
  EXPECT_EQ(c.stats(), nothing);
}

}  // namespace
}  // namespace pcie_ar::comm
