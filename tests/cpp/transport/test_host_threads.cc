// host_shm with THREADS as ranks: one process, one HostShmWorkspace per rank, each rank on its
// own std::thread doing exactly what a rank process does (construct, exchange segment names,
// open_peers, retire_token, add_program, run ..., close_peers, release). The forked tests in
// test_host_shm.cc cover the cross-process path; this file exists for the tools that only see
// one process: ThreadSanitizer (.ci/sanitize runs it under -fsanitize=thread) checks the
// executor's atomics and its release/acquire ordering on flags and LL words, and
// AddressSanitizer sees every rank's accesses at once.
//
// Inputs are multiples of 1/4 in [-31/4, 31/4], so every partial sum of up to 4 ranks is exact
// in bf16, fp16 and fp32 whatever the order: the reference is the exact sum, compared bitwise.
//
// A note on what TSan can see: it tracks memory by virtual address. open_peers() maps every
// peer's segment again (mmap of the same /dev/shm name), so the same bytes would have one
// address per rank and TSan would see neither the cross-rank accesses nor their
// synchronisation. connect() below uses open_peers_in_process() instead (ranks that are
// threads of one process reuse the owner's mapping), so TSan checks the protocol itself:
// weakening the flag store in raise_flag to relaxed is reported as a race at once.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iterator>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "host_test_util.h"
#include "plan/layout.h"
#include "plan/tactic.h"
#include "transport/host_shm.h"

namespace pcie_ar::transport {
namespace {

using host_test::all_tactics;
using host_test::CallCase;
using host_test::describe_call;
using host_test::encode;
using host_test::GroupParam;
using host_test::halves;
using host_test::interleaved;
using host_test::Workload;
using plan::DType;

#if defined(__SANITIZE_THREAD__)
constexpr int kRounds = 4;  // TSan runs the executor 5-15x slower
#else
constexpr int kRounds = 8;
#endif
constexpr double kWaitTimeoutS =
    30.0;  // the executor's wait deadline; a lost rank fails, not hangs

// ------------------------------------------------------------------ exact values

// k / 4 for k in [-31, 31]: few enough mantissa bits that bf16 holds every sum of 4 of them.
// (host_test::input_value is not exact, so its sums depend on the order; these do not.)
int quarter_of(uint64_t seed, int rank, int64_t index) {
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(rank) * 0xbf58476d1ce4e5b9ull +
               static_cast<uint64_t>(index) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  x *= 0xd6e8feb86659fd93ull;
  x ^= x >> 32;
  return static_cast<int>(x % 63) - 31;
}

// k / 4 (|k| <= 124) as a float; every dtype holds it exactly, so host_test::encode is exact.
float quarters(int k) { return static_cast<float>(k) / 4.0f; }

// ------------------------------------------------------------------ a barrier with a deadline

// Threads that are ranks meet here during bootstrap and teardown. A rank that failed cannot
// arrive, so waiting has a deadline and throws instead of hanging the test.
class DeadlineBarrier {
 public:
  explicit DeadlineBarrier(int parties) : parties_(parties) {}
  void arrive_and_wait(double timeout_s) {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t phase = phase_;
    if (++arrived_ == parties_) {
      arrived_ = 0;
      ++phase_;
      changed_.notify_all();
      return;
    }
    const bool passed = changed_.wait_for(lock, std::chrono::duration<double>(timeout_s),
                                          [&] { return phase_ != phase || broken_; });
    if (!passed || broken_) throw std::runtime_error("a rank did not reach the barrier");
  }
  // A failed rank breaks the barrier so the others stop waiting for it at once.
  void break_it() {
    std::lock_guard<std::mutex> lock(mutex_);
    broken_ = true;
    changed_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  int parties_;
  int arrived_ = 0;
  uint64_t phase_ = 0;
  bool broken_ = false;
};

// ------------------------------------------------------------------ the group of rank threads

struct RankResult {
  std::string error;  // the exception that stopped the rank, if any
  int calls_done = 0;
  int wrong_calls = 0;
  std::string first_wrong;
};

// Shared by the ranks of one group. Rank r's thread writes only element r, before the barrier;
// peers read it after. The group owns the workspaces so that none is destroyed while a rank
// that failed early still has peers running (with shared mappings they would read freed pages).
struct Group {
  explicit Group(int world) : barrier(world), names(world), owned(world), workspaces(world) {}
  DeadlineBarrier barrier;
  std::vector<std::string> names;
  std::vector<std::unique_ptr<HostShmWorkspace>> owned;
  std::vector<HostShmWorkspace*> workspaces;
};

// Ranks that are threads of one process share one mapping per segment (see the file comment).
void connect(HostShmWorkspace& ws, const Group& group) {
  ws.open_peers_in_process(group.workspaces);
}

void check_call(const Workload& w, int index, int rank, const std::vector<uint8_t>& input,
                const std::vector<uint8_t>& output, RankResult& result) {
  const CallCase& c = w.calls[index];
  const int elem = plan::dtype_bytes(c.dtype);
  const std::vector<uint8_t>& out = c.in_place ? input : output;
  std::string wrong;
  if (!host_test::guards_intact(c, input, output)) wrong = "wrote past the message";
  uint8_t want[4];
  for (int64_t i = 0; i < c.numel && wrong.empty(); ++i) {
    int sum = 0;
    for (int r = 0; r < w.world; ++r) sum += quarter_of(c.seed, r, i);
    encode(c.dtype, quarters(sum), want);
    if (std::memcmp(want, &out[i * elem], elem) != 0) {
      wrong = "element " + std::to_string(i) + " differs from the exact sum " +
              std::to_string(sum / 4.0);
    }
  }
  if (wrong.empty()) return;
  if (result.wrong_calls++ == 0) {
    result.first_wrong =
        "rank " + std::to_string(rank) + ": " + describe_call(w, index) + ": " + wrong;
  }
}

// One rank's life, on its own thread.
void rank_main(const Workload& w, const plan::Layout& layout, Group& group, int rank,
               RankResult& result) {
  try {
    group.owned[rank] =
        std::make_unique<HostShmWorkspace>(layout, rank, /*initial_gen=*/0, kWaitTimeoutS);
    HostShmWorkspace& ws = *group.owned[rank];
    group.names[rank] = ws.segment_name();
    group.workspaces[rank] = &ws;
    group.barrier.arrive_and_wait(kWaitTimeoutS);
    connect(ws, group);
    group.barrier.arrive_and_wait(kWaitTimeoutS);  // everyone has mapped everyone
    ws.retire_token();

    const std::vector<int> programs = host_test::add_programs(ws, w, rank);
    const size_t max_bytes = static_cast<size_t>(layout.max_numel) * 4;
    std::vector<uint8_t> input(max_bytes + host_test::kGuardBytes);
    std::vector<uint8_t> output(max_bytes + host_test::kGuardBytes);
    for (int i = 0; i < static_cast<int>(w.calls.size()); ++i) {
      const CallCase& c = w.calls[i];
      uint8_t* out = host_test::prepare_call(
          c, [&](int64_t e) { return quarters(quarter_of(c.seed, rank, e)); }, input, output);
      host_test::run_case(ws, w, programs, c, input.data(), out);
      check_call(w, i, rank, input, output, result);
      result.calls_done = i + 1;
    }

    ws.close_peers();
    group.barrier.arrive_and_wait(kWaitTimeoutS);  // nobody reads our segment any more
    ws.release();
  } catch (const std::exception& e) {
    result.error = e.what();
    group.barrier.break_it();
  }
}

// Runs `w` with one thread per rank over a layout for messages up to max_numel elements.
void run_threads(const Workload& w, int64_t max_numel) {
  const plan::Layout layout =
      plan::make_layout(max_numel, w.world, 4, HostShmWorkspace::kMaxBlocks);
  Group group(w.world);
  std::vector<RankResult> results(w.world);
  const double start = host_test::now_s();
  {
    std::vector<std::jthread> threads;
    for (int r = 0; r < w.world; ++r) {
      threads.emplace_back(rank_main, std::cref(w), std::cref(layout), std::ref(group), r,
                           std::ref(results[r]));
    }
  }  // joins
  const double seconds = host_test::now_s() - start;
  for (int r = 0; r < w.world; ++r) {
    const RankResult& res = results[r];
    EXPECT_EQ(res.error, "") << "rank " << r << " stopped after " << res.calls_done << " calls";
    EXPECT_EQ(res.calls_done, static_cast<int>(w.calls.size())) << "rank " << r;
    EXPECT_EQ(res.wrong_calls, 0) << res.first_wrong;
  }
  std::printf("    world %d, %zu tactics, %zu calls per rank thread: %.2f s\n", w.world,
              w.tactics.size(), w.calls.size(), seconds);
}

// Every buildable tactic x dtype, sizes and block counts changing from call to call (LL calls
// within the LL slots' capacity), in place every third call; kRounds passes.
Workload make_workload(int world, const std::vector<int>& island_of, int64_t max_numel) {
  Workload w;
  w.world = world;
  w.island_of = island_of;
  w.tactics = all_tactics(world, island_of);
  const int64_t ll_capacity = plan::make_layout(max_numel, world, 4).ll_capacity_bytes;
  const int64_t vec_counts[] = {1, 2, 3, 7, 37, 64, 65, 129, 515, 1 << 20};
  const int block_cycle[] = {1, 2, 3, 5, 8, 1, 4};
  int n = 0;
  for (int round = 0; round < kRounds; ++round) {
    for (int t = 0; t < static_cast<int>(w.tactics.size()); ++t) {
      const bool ll = plan::flag_in_data(w.tactics[t].tactic.protocol);
      for (DType dtype : plan::kAllDTypes) {
        const int64_t lanes = plan::kVectorBytes / plan::dtype_bytes(dtype);
        int64_t limit = max_numel;
        if (ll) limit = std::min(limit, ll_capacity / plan::dtype_bytes(dtype));
        // Three sizes per (tactic, dtype), a different three every round.
        for (int k = 0; k < 3; ++k) {
          const int64_t vecs = vec_counts[(round * 3 + k + t) % std::size(vec_counts)];
          const int64_t numel = std::min(vecs * lanes, limit / lanes * lanes);
          w.calls.push_back(
              CallCase{t, dtype, numel, block_cycle[n % 7], n % 3 == 1, 1000u * world + n});
          ++n;
        }
      }
    }
  }
  return w;
}

class HostThreads : public ::testing::TestWithParam<GroupParam> {};

TEST_P(HostThreads, EveryTacticMatchesTheExactSum) {
  const GroupParam& p = GetParam();
  constexpr int64_t kMaxNumel = 6000;
  const Workload w = make_workload(p.world, p.island_of, kMaxNumel);
  ASSERT_FALSE(w.tactics.empty());
  run_threads(w, kMaxNumel);
}

INSTANTIATE_TEST_SUITE_P(
    Threads, HostThreads,
    ::testing::Values(GroupParam{"flat_w2", 2, {}}, GroupParam{"flat_w3", 3, {}},
                      GroupParam{"flat_w4", 4, {}}, GroupParam{"islands_2x2", 4, halves(4)},
                      GroupParam{"interleaved_2x2", 4, interleaved(4)}),
    [](const ::testing::TestParamInfo<GroupParam>& info) { return info.param.name; });

// Two independent groups at once in one process: workspaces share no hidden state.
TEST(HostThreadsGroups, TwoGroupsRunConcurrently) {
  const Workload a = make_workload(2, {}, 2048);
  const Workload b = make_workload(3, {}, 1000);
  std::thread other([&] { run_threads(b, 1000); });
  run_threads(a, 2048);
  other.join();
}

}  // namespace
}  // namespace pcie_ar::transport

namespace pcie_ar::transport {
namespace {

// ------------------------------------------------------------------ reduce-scatter, all-gather

// One rank of a reduce-scatter and all-gather workload: every buildable tactic of both x dtype,
// the one-chunk tensors between guards and addressed from chunk 0 of the message (as the
// Communicator addresses them). The reduce-scatter must be the design's expression bit for bit,
// the all-gather every rank's bits.
void collective_rank(int world, const std::vector<int>& island_of, const plan::Layout& layout,
                     Group& group, int rank, RankResult& result) {
  try {
    group.owned[rank] =
        std::make_unique<HostShmWorkspace>(layout, rank, /*initial_gen=*/0, kWaitTimeoutS);
    HostShmWorkspace& ws = *group.owned[rank];
    group.workspaces[rank] = &ws;
    group.barrier.arrive_and_wait(kWaitTimeoutS);
    connect(ws, group);
    group.barrier.arrive_and_wait(kWaitTimeoutS);
    ws.retire_token();
    constexpr int64_t kChunkVecs = 37;
    int calls = 0;
    for (const plan::Collective collective :
         {plan::Collective::kReduceScatter, plan::Collective::kAllGather}) {
      const bool scatter = collective == plan::Collective::kReduceScatter;
      for (const plan::Tactic& built : plan::buildable_tactics(world, island_of, collective)) {
        const plan::Schedule schedule =
            plan::build_schedule(built.algorithm, built.direction, built.staged, world, island_of,
                                 built.protocol, collective);
        const int program = ws.add_program(plan::encode_program(schedule, rank));
        for (DType dtype : plan::kAllDTypes) {
          const int elem = plan::dtype_bytes(dtype);
          const int64_t chunk = kChunkVecs * plan::kVectorBytes / elem;
          const size_t chunk_bytes = static_cast<size_t>(chunk) * elem;
          const uint64_t seed = 7001 + calls;
          std::vector<uint8_t> whole(world * chunk_bytes, 0x5A);
          std::vector<uint8_t> piece(3 * chunk_bytes, host_test::kGuardByte);  // guard|chunk|guard
          uint8_t* mine = piece.data() + chunk_bytes;
          const auto shifted = [&](uint8_t* p) {
            return reinterpret_cast<uint8_t*>(reinterpret_cast<uintptr_t>(p) - rank * chunk_bytes);
          };
          const auto value = [&](int r, int64_t e) {
            return host_test::input_value(seed, r, e, dtype);
          };
          if (scatter) {
            for (int64_t e = 0; e < world * chunk; ++e)
              encode(dtype, value(rank, e), &whole[e * elem]);
          } else {
            for (int64_t e = 0; e < chunk; ++e)
              encode(dtype, value(rank, rank * chunk + e), &mine[e * elem]);
          }
          plan::Tactic tactic = built;
          tactic.blocks = 1 + calls % 3;
          host_test::run_call(ws, program, dtype, tactic.blocks,
                              scatter ? whole.data() : shifted(mine),
                              scatter ? shifted(mine) : whole.data(), world * chunk,
                              plan::call_signature(dtype, tactic, false, collective));
          std::string wrong;
          for (size_t i = 0; i < chunk_bytes && wrong.empty(); ++i) {
            if (piece[i] != host_test::kGuardByte ||
                piece[2 * chunk_bytes + i] != host_test::kGuardByte) {
              wrong = "wrote outside its one-chunk tensor";
            }
          }
          uint8_t want[4];
          for (int64_t i = 0; i < (scatter ? chunk : world * chunk) && wrong.empty(); ++i) {
            const int64_t index = scatter ? rank * chunk + i : i;
            const float v =
                scatter ? host_test::expected_element(seed, world, island_of, index, dtype).value
                        : value(static_cast<int>(i / chunk), i);
            encode(dtype, v, want);
            if (std::memcmp(want, (scatter ? mine : whole.data()) + i * elem, elem) != 0) {
              wrong = "element " + std::to_string(i) + " is wrong";
            }
          }
          if (!wrong.empty() && result.wrong_calls++ == 0) {
            result.first_wrong = "rank " + std::to_string(rank) + " " +
                                 std::string(plan::collective_name(collective)) + " " +
                                 plan::tactic_label(tactic) + " " +
                                 std::string(plan::dtype_name(dtype)) + ": " + wrong;
          }
          result.calls_done = ++calls;
        }
      }
    }
    ws.close_peers();
    group.barrier.arrive_and_wait(kWaitTimeoutS);
    ws.release();
  } catch (const std::exception& e) {
    result.error = e.what();
    group.barrier.break_it();
  }
}

TEST_P(HostThreads, CollectivesMatchTheDesignsExpressionAndMoveEveryBit) {
  const GroupParam& p = GetParam();
  const plan::Layout layout =
      plan::make_layout(p.world * 37 * 4, p.world, 4, HostShmWorkspace::kMaxBlocks);
  Group group(p.world);
  std::vector<RankResult> results(p.world);
  {
    std::vector<std::jthread> threads;
    for (int r = 0; r < p.world; ++r) {
      threads.emplace_back(collective_rank, p.world, std::cref(p.island_of), std::cref(layout),
                           std::ref(group), r, std::ref(results[r]));
    }
  }
  for (int r = 0; r < p.world; ++r) {
    EXPECT_EQ(results[r].error, "") << "rank " << r;
    EXPECT_GT(results[r].calls_done, 20) << "rank " << r;
    EXPECT_EQ(results[r].wrong_calls, 0) << results[r].first_wrong;
  }
}

}  // namespace
}  // namespace pcie_ar::transport
