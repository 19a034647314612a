// Messages larger than the workspace, streamed through it in rounds (plan/rounds.h), ranks as
// threads at world 3 (flat) and 4 (two islands): every row of a streamed batch has the bits of the
// same row reduced alone, fused and unfused, under a table whose tactic changes with the size;
// the call counts once; ranks in different rounds, or streaming different messages, fail at once
// naming each other.
#include <ATen/ops/cat.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "comm/errors.h"
#include "comm_group.h"

namespace pcie_ar::comm {
namespace {

using test::CommGroup;
using test::rank_input;

constexpr int64_t kHidden = 64;  // bf16: 128-byte rows
constexpr int64_t kRows = 8;     // the workspace holds 8 rows
// Flat below 512 bytes, island (or flat two-shot) above: the streamed rounds (up to 8 rows, 1 KiB)
// and the small calls take different families.
const std::string kFlatTable =
    "*,*,*,0,512,oneshot,push,0,1,64,lamport\n*,*,*,512,*,twoshot,pull,1,2,64\n";
const std::string kIslandTable =
    "*,*,*,0,512,oneshot,push,0,1,64,lamport\n*,*,*,512,*,island_twoshot,push,0,2,64\n";

// Wide exponents: sums round differently in different orders.
at::Tensor batch(int rank, int64_t rows) {
  const at::Tensor x = rank_input(rank, rows * kHidden, at::kFloat).view({rows, kHidden});
  const at::Tensor scale =
      at::exp2(at::remainder(at::arange(rows * kHidden, at::kFloat) * (rank + 3), 13.0).sub(6.0));
  return (x * scale.view({rows, kHidden})).to(at::kBFloat16);
}

TEST(CommunicatorStreaming, EveryRowOfAStreamedBatchHasTheBitsOfTheRowAlone) {
  constexpr int64_t kMost = 37;  // five rounds of 8, 8, 7, 7, 7 rows
  for (const auto& [world, islands] :
       std::vector<std::pair<int, std::vector<int>>>{{3, {}}, {4, {0, 1, 0, 1}}}) {
    CommGroup group(world, islands.empty() ? kFlatTable : kIslandTable, kRows * kHidden, islands,
                    kMost * kHidden);
    group.each([&](int rank, Communicator& c) {
      const at::Tensor x = batch(rank, kMost);
      const at::Tensor residual =
          rank_input(99, kMost * kHidden, at::kBFloat16, 7.0).view({kMost, kHidden});
      const at::Tensor weight = rank_input(98, kHidden, at::kBFloat16, 9.0);
      at::Tensor sum, y, residual_out;
      ASSERT_EQ(c.run(kAllReduce, {x, sum}), Decline::kNone);
      ASSERT_EQ(c.run(kAllReduceAddRmsNorm, {x, y, &residual, &weight, &residual_out, 1e-6}),
                Decline::kNone);
      for (int64_t row = 0; row < kMost; row += 3) {
        const at::Tensor one = x.narrow(0, row, 1);
        const at::Tensor one_residual = residual.narrow(0, row, 1);
        at::Tensor one_sum, one_y, one_residual_out;
        ASSERT_EQ(c.run(kAllReduce, {one, one_sum}), Decline::kNone);
        ASSERT_EQ(c.run(kAllReduceAddRmsNorm,
                        {one, one_y, &one_residual, &weight, &one_residual_out, 1e-6}),
                  Decline::kNone);
        EXPECT_TRUE(at::equal(one_sum, sum.narrow(0, row, 1))) << "rank " << rank << " row " << row;
        EXPECT_TRUE(at::equal(one_y, y.narrow(0, row, 1))) << "rank " << rank << " row " << row;
        EXPECT_TRUE(at::equal(one_residual_out, residual_out.narrow(0, row, 1)))
            << "rank " << rank << " row " << row;
      }
      // Each streamed call counts once, under its rounds' tactic; the rows under the small one.
      const Stats s = c.stats();
      const std::string big = islands.empty() ? "twoshot/pull/staged/flag/b2/t64"
                                              : "island_twoshot/push/unstaged/flag/b2/t64";
      EXPECT_EQ(s.of(kAllReduceAddRmsNorm).calls.at(big), 1) << "rank " << rank;
      EXPECT_EQ(s.of(kAllReduce).calls.at(big), 2) << "rank " << rank;  // the fused one holds one
      EXPECT_EQ(s.of(kAllReduce).declines.size(), 0u);
    });
  }
}

TEST(CommunicatorStreaming, EveryOperationStreamsUpToItsCapAndDeclinesTooLargeAboveIt) {
  CommGroup group(2, kFlatTable, kRows * kHidden, {}, 4 * kRows * kHidden);
  Communicator& c = group[0];
  EXPECT_EQ(c.decline_reason(kAllReduce, batch(0, 4 * kRows)), Decline::kNone);
  EXPECT_EQ(c.decline_reason(kAllReduce, batch(0, 4 * kRows + 1)), Decline::kTooLarge);
  // The collectives' message is the whole tensor (the all-gather's: its output).
  EXPECT_EQ(c.decline_reason(kReduceScatter, batch(0, 4 * kRows)), Decline::kNone);
  EXPECT_EQ(c.decline_reason(kReduceScatter, batch(0, 4 * kRows + 2)), Decline::kTooLarge);
  EXPECT_EQ(c.decline_reason(kAllGather, batch(0, 2 * kRows)), Decline::kNone);
  EXPECT_EQ(c.decline_reason(kAllGather, batch(0, 2 * kRows + 1)), Decline::kTooLarge);
  const at::Tensor wide = batch(0, 1).view({1, kHidden}).repeat({1, kRows + 1});  // a row > 8 rows
  const at::Tensor wide_weight = at::ones({wide.size(1)}, at::kBFloat16);
  EXPECT_EQ(c.decline_reason(kAllReduceAddRmsNorm, at::cat({wide, wide}), &wide_weight),
            Decline::kTooLarge);
}

// Rank 0 streams a 16-row message in two rounds of 8 rows; its peer makes two calls of 8 rows.
// The round signatures differ from the plain calls', so both fail at once naming each other
// instead of pairing up and each returning a sum the other did not form.
TEST(CommunicatorStreaming, ARoundNeverPairsWithAnUnstreamedCallOfItsSize) {
  CommGroup group(2, kFlatTable, kRows * kHidden, {}, 2 * kRows * kHidden);
  std::vector<std::string> errors(2);
  group.each([&](int rank, Communicator& c) {
    const at::Tensor x = batch(rank, 2 * kRows);
    at::Tensor out;
    try {
      if (rank == 0) {
        c.run(kAllReduce, {x, out});
      } else {
        for (int k = 0; k < 2; ++k) {
          at::Tensor part;
          c.run(kAllReduce, {x.narrow(0, k * kRows, kRows), part});
        }
      }
    } catch (const Failure& e) {
      errors[rank] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("rank " + std::to_string(1 - r)), std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
}

}  // namespace
}  // namespace pcie_ar::comm
