// The self-test before serving (comm/self_test.h), ranks as threads over the host transport: every
// (op, dtype, tactic) the table chooses runs bit-exact on a correct executor and counts nothing; a
// wrong executor on one rank (the host executor's test mutants) fails there, and once withdrawn on
// every rank the tactic's calls decline self_test, touching nothing. And the known data shows the
// order: the reference of the inputs in another order, or summed without the island groups, differs
// from the group's tree in every dtype.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "comm/self_test.h"
#include "comm_group.h"
#include "plan/tactic.h"
#include "transport/host_shm.h"

namespace pcie_ar::comm {
namespace {

using test::CommGroup;
using test::rank_input;
using Mutant = transport::HostExecutor::Mutant;

// The one-shot below 4 KiB, a two-shot of the other direction and staging above.
const std::string kTable = "*,*,*,0,4096,oneshot,push,0,2,64\n*,*,*,4096,*,twoshot,pull,1,2,64\n";
constexpr int64_t kMaxNumel = 16384;

using Key = std::tuple<std::string, std::string, std::string>;  // op, dtype, tactic

Key key_of(const SelfTestResult& r) {
  return {std::string(op_name(r.use.op)), std::string(plan::dtype_name(r.use.dtype)),
          plan::tactic_label(r.use.tactic)};
}

void set_mutant(Communicator& c, Mutant mutant) {
  auto* host = dynamic_cast<transport::HostShmWorkspace*>(c.workspace_for_testing());
  ASSERT_NE(host, nullptr);
  host->set_mutant_for_testing(mutant);
}

TEST(SelfTest, EveryChosenTacticIsBitExactAndCountsNothing) {
  for (const auto& [world, islands] :
       std::vector<std::pair<int, std::vector<int>>>{{3, {}}, {4, {0, 0, 1, 1}}}) {
    CommGroup group(world, kTable, kMaxNumel, islands);
    std::vector<std::vector<SelfTestResult>> results(world);
    group.each([&](int rank, Communicator& c) {
      results[rank] = c.self_test();
      EXPECT_TRUE(c.stats().ops[op_index(kAllReduce)].calls.empty()) << "rank " << rank;
      // Tested once: a second run without `again` has nothing left to test.
      EXPECT_TRUE(c.self_test().empty());
    });
    int ran = 0;
    std::set<std::string> ops;
    for (const SelfTestResult& r : results[0]) {
      if (!r.ran) {  // NVFP4 in fp32 only
        EXPECT_TRUE(is_nvfp4(r.use.op) && r.use.dtype == plan::DType::kFP32) << r.detail;
        continue;
      }
      ++ran;
      ops.insert(std::string(op_name(r.use.op)));
      EXPECT_TRUE(r.ok) << std::get<0>(key_of(r)) << " " << std::get<2>(key_of(r)) << ": "
                        << r.detail;
      // The smallest size it is chosen for and the largest up to 64 KiB.
      EXPECT_FALSE(r.use.bytes.empty());
    }
    EXPECT_EQ(ran, 2 * (9 * 3 - 2)) << "world " << world;
    EXPECT_EQ(ops.size(), kOpCount);
    for (int rank = 1; rank < world; ++rank) {
      ASSERT_EQ(results[rank].size(), results[0].size());
      for (size_t k = 0; k < results[0].size(); ++k) {
        EXPECT_EQ(key_of(results[rank][k]), key_of(results[0][k])) << "the same cases in order";
      }
    }
  }
}

TEST(SelfTest, AWrongExecutorFailsAndItsWithdrawnTacticsDeclineOnEveryRank) {
  CommGroup group(3, kTable, kMaxNumel);
  std::vector<std::vector<SelfTestResult>> results(3);
  group.each([&](int rank, Communicator& c) {
    c.self_test();  // all pass first (the previous test's promise)
    if (rank == 2) set_mutant(c, Mutant::kReverseOperands);
    results[rank] = c.self_test(/*again=*/true);
  });
  std::set<Key> failed;
  for (const auto& per_rank : results) {
    for (const SelfTestResult& r : per_rank) {
      if (r.ran && !r.ok) {
        failed.insert(key_of(r));
        EXPECT_NE(r.detail.find(" element "), std::string::npos) << r.detail;
      }
    }
  }
  // Rank 2 sums in the wrong order: every tactic of every op that sums, in every dtype, fails
  // on some rank (the all-gather sums nothing).
  EXPECT_EQ(failed.size(), 2u * (8 * 3 - 2));
  for (const Key& k : failed) EXPECT_NE(std::get<0>(k), "all_gather");
  for (const SelfTestResult& r : results[2]) {
    if (r.ran && r.use.op == kAllReduce) {
      EXPECT_FALSE(r.ok) << "the mutant's own sums";
    }
  }
  group.each([&](int rank, Communicator& c) {
    for (const auto& [op, dtype, tactic] : failed) {
      c.withdraw(*find_op(op), plan::kDTypeNames.parse(dtype), tactic);
    }
    at::Tensor x = rank_input(rank, 512, at::kFloat);
    const at::Tensor before = x.clone();
    at::Tensor out;
    EXPECT_EQ(c.decline_reason(kAllReduce, x), Decline::kSelfTest);
    EXPECT_EQ(c.chosen_tactic(kAllReduce, x), "fallback");
    EXPECT_EQ(c.run(kAllReduce, {x, out}, OnDecline::kReturn), Decline::kSelfTest);
    EXPECT_TRUE(at::equal(x, before));
    // The all-gather was not withdrawn: it still runs on the kernels.
    at::Tensor gathered;
    EXPECT_EQ(c.run(kAllGather, {x, gathered}), Decline::kNone);
    // A new table keeps the withdrawal: the tactic stays out whatever chooses it.
    c.set_table("*,*,*,0,*,oneshot,push,0,2,64\n", "another table");
    EXPECT_EQ(c.decline_reason(kAllReduce, x), Decline::kSelfTest);
  });
}

TEST(SelfTest, AMutantThatChangesNoBitFailsNothing) {
  // Two islands of two: each group's sum has two operands, which commute.
  CommGroup group(4, kTable, kMaxNumel, {0, 0, 1, 1});
  group.each([&](int rank, Communicator& c) {
    set_mutant(c, Mutant::kReverseOperands);
    for (const SelfTestResult& r : c.self_test()) {
      EXPECT_TRUE(!r.ran || r.ok) << "rank " << rank << ": " << r.detail;
    }
  });
}

// The known inputs show the order: in every dtype, the group's tree of them differs in some
// element from the same sum in another rank order (world 3) and from a flat sum of every rank
// (world 4 in two islands), as a wrong executor's would.
TEST(SelfTest, TheKnownInputsShowTheReductionOrder) {
  for (const plan::DType dtype : {plan::DType::kBF16, plan::DType::kFP16, plan::DType::kFP32}) {
    const std::vector<at::Tensor> three = known_inputs(3, 2048, dtype);
    const std::vector<at::Tensor> reversed(three.rbegin(), three.rend());
    EXPECT_NE(first_difference("reversed", canonical_sum(reversed, {}), canonical_sum(three, {})),
              "")
        << plan::dtype_name(dtype);
    const std::vector<at::Tensor> four = known_inputs(4, 2048, dtype);
    EXPECT_NE(first_difference("flat", canonical_sum(four, {}), canonical_sum(four, {0, 0, 1, 1})),
              "")
        << plan::dtype_name(dtype);
    for (const at::Tensor& t : four) {
      EXPECT_TRUE(t.isfinite().all().item<bool>()) << plan::dtype_name(dtype);
    }
  }
}

TEST(SelfTest, FirstDifferenceNamesTheElementAndItsBits) {
  const at::Tensor a = at::full({4}, 1.0, at::kBFloat16);
  at::Tensor b = a.clone();
  b[2] = 2.0;
  EXPECT_EQ(first_difference("out", a, a.clone()), "");
  EXPECT_EQ(first_difference("out", b, a), "out element 2 is 0x4000, expected 0x3f80");
  EXPECT_NE(first_difference("out", a, at::full({5}, 1.0, at::kBFloat16)).find("holds 8 bytes"),
            std::string::npos);
}

}  // namespace
}  // namespace pcie_ar::comm
