// The CUDA executor's failure paths on the CPU device, and the negative controls that prove the
// suites can fail. Each failure path must leave the record a GPU leaves (tests/gpu/
// loopback_check.cu checks the same fields there) and the message the host transport gives for
// it; the LL path under 4-byte tearing must fail, never pass. Ranks that decline calls between
// kernel calls stay within one call of each other only if they meet before taking a generation.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <iterator>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../transport/host_test_util.h"
#include "cpu_device_group.h"
#include "cpu_device_workload.h"
#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/schedule.h"
#include "plan/tactic.h"
#include "transport/executors/cuda/cpu/device.h"

namespace pcie_ar::transport {
namespace {

using cpu_device::DeviceOptions;
using cpu_device::LaunchStatus;
using cpu_device::MemoryModel;
using cpu_device_test::CpuDeviceGroup;
using cpu_device_test::Placement;
using plan::DType;
using plan::FailureKind;
using plan::Protocol;

constexpr int64_t kNumel = 1024;

plan::Tactic two_rank_tactic(Protocol protocol, int blocks) {
  plan::Tactic tactic;
  tactic.algorithm = plan::Algorithm::kOneshot;
  tactic.direction = plan::Direction::kPush;
  tactic.staged = protocol == Protocol::kFlag;  // LL is unstaged
  tactic.protocol = protocol;
  tactic.blocks = blocks;
  tactic.threads = 64;
  return tactic;
}

plan::Schedule two_rank_schedule(const plan::Tactic& tactic) {
  return plan::build_schedule(tactic.algorithm, tactic.direction, tactic.staged, 2, {},
                              tactic.protocol);
}

struct Buffers {
  std::vector<std::vector<uint8_t>> bytes{2, std::vector<uint8_t>(kNumel * 4)};
  std::vector<const void*> inputs{bytes[0].data(), bytes[1].data()};
  std::vector<void*> outputs{bytes[0].data(), bytes[1].data()};  // in place
};

struct FailureParam {
  Protocol protocol;
  cpu_device_test::Mode mode;
};

std::string failure_name(const ::testing::TestParamInfo<FailureParam>& info) {
  return std::string(plan::protocol_name(info.param.protocol)) +
         cpu_device_test::mode_name(info.param.mode);
}

class CpuDeviceFailure : public ::testing::TestWithParam<FailureParam> {};

// World 2 with only rank 0 launched: rank 0 must time out waiting for rank 1 (its flag, or its LL
// data), record it naming rank 1, and trap, after the timeout and not long after.
TEST_P(CpuDeviceFailure, AMissingPeerTimesOutNamingIt) {
  const FailureParam& p = GetParam();
  constexpr uint64_t kGen = 0x1FFFFFFF0ull;  // past 2^32: the record carries 64 bits
  constexpr double kTimeout = 0.3;
  CpuDeviceGroup group(plan::make_layout(kNumel, 2, 4), p.mode.placement, kGen, kTimeout);
  const plan::Tactic tactic = two_rank_tactic(p.protocol, 2);
  const int id = group.add_schedule(two_rank_schedule(tactic));
  Buffers buf;
  const auto t0 = std::chrono::steady_clock::now();
  const LaunchStatus status = group.launch(id, tactic, DType::kBF16, buf.inputs, buf.outputs,
                                           kNumel, DeviceOptions{p.mode.memory, 3}, 0, 1);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(status, LaunchStatus::kTrapped);
  const auto d = group.failure();
  ASSERT_TRUE(d.has_value()) << "no record";
  const FailureKind want =
      plan::flag_in_data(p.protocol) ? FailureKind::kLLTimeout : FailureKind::kTimeout;
  EXPECT_EQ(d->kind, static_cast<uint32_t>(want));
  EXPECT_EQ(d->rank, 0u);
  EXPECT_EQ(d->peer, 1u);
  EXPECT_EQ(d->gen_expected, kGen + 1);
  EXPECT_GE(s, 0.9 * kTimeout);
  EXPECT_LT(s, kTimeout + 5.0);
  const std::string message = plan::describe_failure(*d, kTimeout);
  if (plan::flag_in_data(p.protocol)) {
    // The LL slot (or, lamport, its header) rank 1 writes in rank 0's memory; the tag expected
    // is this call's, and what was seen is the empty word (nothing of this call arrived).
    const uint32_t tag = plan::ll_tag(kGen + 1, kNumel, plan::call_signature(DType::kBF16, tactic));
    EXPECT_EQ(d->flag_owner, 0u);
    EXPECT_EQ(d->peer_signature, tag);
    EXPECT_NE(static_cast<uint32_t>(d->gen_seen), tag);
  } else {
    EXPECT_EQ(d->gen_seen, kGen);
  }
  EXPECT_NE(message.find("rank 0 timed out"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 1"), std::string::npos) << message;
}

// A trap ends the whole grid at once. Every CTA of rank 0 times out together
// and one thread wins the claim; while its system fences take their time (2 ms here: they cost
// microseconds over PCIe), the threads that lost must not trap, or the grid ends with the record
// half-written and the host finds no failure recorded. Repeated, since which CTA wins varies.
TEST_P(CpuDeviceFailure, CtasFailingTogetherLeaveTheWinnersWholeRecord) {
  const FailureParam& p = GetParam();
  constexpr uint64_t kGen = 77;
  constexpr double kTimeout = 0.05;
  for (int attempt = 0; attempt < 3; ++attempt) {
    SCOPED_TRACE("attempt " + std::to_string(attempt));
    CpuDeviceGroup group(plan::make_layout(kNumel, 2, 4), p.mode.placement, kGen, kTimeout);
    const plan::Tactic tactic = two_rank_tactic(p.protocol, 4);
    const int id = group.add_schedule(two_rank_schedule(tactic));
    Buffers buf;
    DeviceOptions options{p.mode.memory, 5u + static_cast<uint64_t>(attempt)};
    options.fence_ns = 2'000'000;
    const LaunchStatus status =
        group.launch(id, tactic, DType::kBF16, buf.inputs, buf.outputs, kNumel, options, 0, 1);
    ASSERT_EQ(status, LaunchStatus::kTrapped);
    const auto d = group.failure();
    ASSERT_TRUE(d.has_value()) << "no record: a losing thread ended the grid before it landed";
    EXPECT_EQ(d->kind,
              static_cast<uint32_t>(plan::flag_in_data(p.protocol) ? FailureKind::kLLTimeout
                                                                   : FailureKind::kTimeout));
    EXPECT_EQ(d->rank, 0u);
    EXPECT_EQ(d->peer, 1u);
    EXPECT_EQ(d->gen_expected, kGen + 1);
    EXPECT_LT(d->block, 4u);
  }
}

// Ranks 0 and 1 launched separately and concurrently with different dtypes: whoever looks first
// must report the disagreement instead of reducing garbage. Flag: the flag's signature differs;
// LL: the tag of the peer's data names another call; lamport: the tag of its slice's header.
TEST_P(CpuDeviceFailure, PeersThatDisagreeAboutTheCallReportAMismatch) {
  const FailureParam& p = GetParam();
  constexpr uint64_t kGen = 7;
  CpuDeviceGroup group(plan::make_layout(kNumel, 2, 4), p.mode.placement, kGen, 5.0);
  const plan::Tactic tactic = two_rank_tactic(p.protocol, 1);
  const int id = group.add_schedule(two_rank_schedule(tactic));
  Buffers buf;
  const uint32_t sig_bf16 = plan::call_signature(DType::kBF16, tactic);
  const uint32_t sig_fp16 = plan::call_signature(DType::kFP16, tactic);
  LaunchStatus other = LaunchStatus::kCompleted;
  std::thread rank1([&] {
    other = group.launch(id, tactic, DType::kFP16, buf.inputs, buf.outputs, kNumel,
                         DeviceOptions{p.mode.memory, 5}, 1, 1, sig_fp16);
  });
  const LaunchStatus mine = group.launch(id, tactic, DType::kBF16, buf.inputs, buf.outputs, kNumel,
                                         DeviceOptions{p.mode.memory, 6}, 0, 1, sig_bf16);
  rank1.join();
  EXPECT_TRUE(mine == LaunchStatus::kTrapped || other == LaunchStatus::kTrapped);
  const auto d = group.failure();
  ASSERT_TRUE(d.has_value()) << "no record";
  EXPECT_EQ(d->gen_expected, kGen + 1);
  EXPECT_EQ(d->numel, static_cast<uint32_t>(kNumel));
  const bool rank0 = d->rank == 0;
  EXPECT_EQ(d->peer, rank0 ? 1u : 0u);
  EXPECT_EQ(d->signature, rank0 ? sig_bf16 : sig_fp16);
  if (p.protocol == Protocol::kFlag) {
    EXPECT_EQ(d->kind, static_cast<uint32_t>(FailureKind::kMismatch));
    EXPECT_EQ(d->peer_signature, rank0 ? sig_fp16 : sig_bf16);
    EXPECT_EQ(d->peer_numel, static_cast<uint32_t>(kNumel));
    const std::string message = plan::describe_failure(*d, 5.0);
    EXPECT_NE(message.find("disagree"), std::string::npos) << message;
  } else {
    // make_ll_diagnostic: gen_seen is the tag seen (the peer's call), peer_signature the tag
    // this rank expected.
    const uint32_t tag_bf16 = plan::ll_tag(kGen + 1, kNumel, sig_bf16);
    const uint32_t tag_fp16 = plan::ll_tag(kGen + 1, kNumel, sig_fp16);
    EXPECT_EQ(d->kind, static_cast<uint32_t>(FailureKind::kLLMismatch));
    EXPECT_EQ(d->peer_signature, rank0 ? tag_bf16 : tag_fp16);
    EXPECT_EQ(static_cast<uint32_t>(d->gen_seen), rank0 ? tag_fp16 : tag_bf16);
  }
}

std::vector<FailureParam> failure_params() {
  std::vector<FailureParam> params;
  for (Protocol protocol : plan::kProtocolNames.values()) {
    for (const cpu_device_test::Mode& mode : cpu_device_test::all_modes()) {
      params.push_back(FailureParam{protocol, mode});
    }
  }
  return params;
}

INSTANTIATE_TEST_SUITE_P(Paths, CpuDeviceFailure, ::testing::ValuesIn(failure_params()),
                         failure_name);

// ---------------------------------------------------------------- a call only one rank ran

// On the CUDA executor: rank 0 sends a call to the fallback (it runs the skip program, as the
// communicator does) while rank 1 runs it on the kernels and times out. At the next call of the
// same shape rank 0 must not sum what rank 1 left for the abandoned call: it times out naming
// rank 1. Without the skip (the control) it returns that mixed sum.
struct DivergenceParam {
  Protocol protocol;
  MemoryModel memory;
  bool skip;
};

std::string divergence_name(const ::testing::TestParamInfo<DivergenceParam>& info) {
  const DivergenceParam& p = info.param;
  return std::string(plan::protocol_name(p.protocol)) +
         (p.memory == MemoryModel::kStrict ? "_strict" : "_weak") +
         (p.skip ? "" : "_without_the_skip");
}

class CpuDeviceDivergence : public ::testing::TestWithParam<DivergenceParam> {};

TEST_P(CpuDeviceDivergence, ACallOneRankSentToTheFallbackNeverMixesIntoTheNext) {
  const DivergenceParam& p = GetParam();
  constexpr int64_t kCount = 256;
  CpuDeviceGroup group(plan::make_layout(kCount, 2, 4), Placement::kDevice, 10, 0.3);
  const plan::Tactic tactic = two_rank_tactic(p.protocol, 1);
  const int id = group.add_schedule(two_rank_schedule(tactic));
  const int skip = group.add_skip();
  std::vector<std::vector<float>> in{std::vector<float>(kCount, 2.0f),
                                     std::vector<float>(kCount, 100.0f)};
  std::vector<std::vector<float>> out(2, std::vector<float>(kCount, 0.0f));
  const std::vector<const void*> inputs{in[0].data(), in[1].data()};
  const std::vector<void*> outputs{out[0].data(), out[1].data()};
  const DeviceOptions options{p.memory, 21};
  if (p.skip) {
    ASSERT_EQ(group.launch(skip, tactic, DType::kFP32, inputs, outputs, 0, options, 0, 1),
              LaunchStatus::kCompleted);
  }
  ASSERT_EQ(group.launch(id, tactic, DType::kFP32, inputs, outputs, kCount, options, 1, 1),
            LaunchStatus::kTrapped);  // rank 1 ran the call alone
  group.clear_failure();
  const LaunchStatus again =
      group.launch(id, tactic, DType::kFP32, inputs, outputs, kCount, options, 0, 1);
  if (p.skip) {
    ASSERT_EQ(again, LaunchStatus::kTrapped) << "rank 0 returned " << out[0][0];
    const auto d = group.failure();
    ASSERT_TRUE(d.has_value());
    EXPECT_EQ(d->rank, 0u);
    EXPECT_EQ(d->peer, 1u);
    EXPECT_EQ(d->gen_expected, 12u);  // the skipped call took generation 11
  } else {
    ASSERT_EQ(again, LaunchStatus::kCompleted);
    EXPECT_EQ(out[0][0], 102.0f);  // 2 + the 100 rank 1 left for the abandoned call
  }
}

std::vector<DivergenceParam> divergence_params() {
  std::vector<DivergenceParam> params;
  for (Protocol protocol : plan::kProtocolNames.values()) {
    for (MemoryModel memory : {MemoryModel::kStrict, MemoryModel::kWeak}) {
      for (bool skip : {true, false}) params.push_back(DivergenceParam{protocol, memory, skip});
    }
  }
  return params;
}

INSTANTIATE_TEST_SUITE_P(Skip, CpuDeviceDivergence, ::testing::ValuesIn(divergence_params()),
                         divergence_name);

// ---------------------------------------------------------------- declined calls, ranks apart

// The communicator's rule for a call it declines without the kernels (an empty tensor, a
// fallback that raises): a rank takes the call's generation (the skip program) only after the
// group's own collective, which every rank enters, so every peer has finished the call before.
// No rank is then ever two calls ahead of a peer, which the slots' generation parity assumes.
// Here every rank is its own stream (a thread that launches only its rank, as a process would:
// a launch's state is its own, and the group's one failure record is claimed atomically) and runs
// kernel all-reduces of small integers, whose exact sums change every call, with 0 to 3 declined
// calls after each; the last rank is slow. Taking the skip without meeting (the defect) must fail.

constexpr int64_t kStreamNumel = 1024;
constexpr int kRoundCalls = 32;  // kernel calls between two looks at the time budget
// Small CTAs: a launch starts an OS thread per CTA and a fiber per thread, and what these tests
// multiply is calls, not the threads of one call.
constexpr int kStreamThreads = 8;

#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
// The sanitizers make every fiber and fiber switch cost many times more: one round per case and
// no slow rank. The negative control is skipped: its 0.5 s waits would time out however the
// ranks took their generations, so its failure would prove nothing.
constexpr bool kSanitized = true;
constexpr double kBudgetS = 0.0;
constexpr int kSlowThreads = 0;
#else
constexpr bool kSanitized = false;
constexpr double kBudgetS = 1.8;  // per case
// The slow rank's CTAs run 256 threads that take turns (threads are not part of a call's
// signature: a peer cannot see them), so its reads of a call's slots stretch out while its peers
// finish the call and go on.
constexpr int kSlowThreads = 256;
#endif

// Where the rank threads meet: the group's own collective before a declined call, and the end
// of a round. A deadline, so that a rank that stopped cannot hang the others.
class Meeting {
 public:
  Meeting(int ranks, double timeout_s) : ranks_(ranks), timeout_(timeout_s) {}

  // Every rank arrives before any leaves; the last to arrive runs `last` first. False when a
  // rank gave up (abandon()) or the deadline passed.
  bool meet(const std::function<void()>& last) {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t phase = phase_;
    if (!abandoned_ && ++arrived_ == ranks_) {
      if (last) last();
      arrived_ = 0;
      ++phase_;
      opened_.notify_all();
      return true;
    }
    opened_.wait_for(lock, timeout_, [&] { return phase_ != phase || abandoned_; });
    if (phase_ == phase) abandon_locked();
    return phase_ != phase;
  }

  void abandon() {
    std::lock_guard<std::mutex> lock(mutex_);
    abandon_locked();
  }

 private:
  void abandon_locked() {
    abandoned_ = true;
    opened_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable opened_;
  const int ranks_;
  const std::chrono::duration<double> timeout_;
  int arrived_ = 0;
  uint64_t phase_ = 0;
  bool abandoned_ = false;
};

struct StreamCase {
  int world;
  std::vector<int> island_of;        // world 4: two islands, so the island algorithms run too
  std::optional<Protocol> protocol;  // the kernel calls' tactics; nullopt: every protocol's
  MemoryModel memory;
};

std::string stream_case_name(const StreamCase& c) {
  return "world " + std::to_string(c.world) + (c.island_of.empty() ? " " : " (2 islands) ") +
         (c.protocol ? std::string(plan::protocol_name(*c.protocol)) : "every protocol") +
         (c.memory == MemoryModel::kStrict ? ", strict" : ", weak");
}

struct StreamPlan {
  bool meet_first;   // the rule: the group's own collective before each skip; false: the defect
  double budget_s;   // rounds start until this much time is spent
  double timeout_s;  // every wait's, in the kernels and (doubled) at the meetings
};

// Every call's values, the same in every rank's thread: what rank `rank` adds at element e, how
// many elements the call has, and how many declined calls follow it.
int stream_value(int call, int rank, int64_t e) {
  return static_cast<int>((host_test::mix(call * 16ull + rank) + e) % 13) - 6;
}
int64_t stream_numel(int call, int64_t limit) {
  return 8 * (1 + static_cast<int64_t>(host_test::mix(call * 16ull + 8) % (limit / 8)));
}
int declined_after(int call) { return static_cast<int>(host_test::mix(call * 16ull + 9) % 4); }

// What a case's rank threads share.
class Streams {
 public:
  Streams(const StreamCase& c, const StreamPlan& plan)
      : c_(c),
        plan_(plan),
        group_(plan::make_layout(kStreamNumel, c.world, 4), Placement::kDevice, 0, plan.timeout_s),
        meeting_(c.world, 2 * plan.timeout_s) {
    for (const host_test::TacticCase& t : cpu_device_test::gpu_tactics(c.world, c.island_of)) {
      if (c.protocol && t.tactic.protocol != *c.protocol) continue;
      tactics_.push_back(t.tactic);
      ids_.push_back(group_.add_schedule(t.schedule));
    }
    skip_ = group_.add_skip();
  }

  // Rank `rank`'s stream: kernel calls (the tactics in turn, 1 or 2 CTAs, every dtype, sizes
  // that change), each followed by its declined calls, in rounds until the budget is spent.
  void run_rank(int rank);

  // The first failure a rank saw, with the failure record if a launch trapped; "" if none.
  std::string failure() const;
  int kernel_calls() const { return rounds_.load() * kRoundCalls; }  // per rank

 private:
  bool kernel_call(int rank, int call, std::vector<uint8_t>& in, std::vector<uint8_t>& out);
  bool declined_call(int rank, int call);
  bool meet(int rank, const std::function<void()>& last = {});
  void fail(const std::string& what);

  const StreamCase& c_;
  const StreamPlan& plan_;
  CpuDeviceGroup group_;
  Meeting meeting_;
  std::vector<plan::Tactic> tactics_;
  std::vector<int> ids_;
  int skip_ = -1;
  const std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::atomic<bool> go_on_{true};
  std::atomic<bool> failed_{false};
  std::atomic<int> rounds_{0};
  mutable std::mutex mutex_;
  std::string failure_;
};

void Streams::fail(const std::string& what) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (failure_.empty()) failure_ = what;
  }
  failed_.store(true);
  meeting_.abandon();
}

std::string Streams::failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto d = group_.failure();
  return d ? failure_ + "; " + plan::describe_failure(*d, plan_.timeout_s) : failure_;
}

bool Streams::meet(int rank, const std::function<void()>& last) {
  if (meeting_.meet(last)) return true;
  fail("rank " + std::to_string(rank) + " waited in vain for its peers at a meeting");
  return false;  // a rank that failed first keeps its own account
}

bool Streams::kernel_call(int rank, int call, std::vector<uint8_t>& in, std::vector<uint8_t>& out) {
  const int n = static_cast<int>(tactics_.size());
  plan::Tactic tactic = tactics_[call % n];
  tactic.blocks = 1 + (call / n) % 2;
  tactic.threads = kSlowThreads > 0 && rank == c_.world - 1 ? kSlowThreads : kStreamThreads;
  const DType dtype = plan::kAllDTypes[(call / (2 * n)) % std::size(plan::kAllDTypes)];
  const int elem = plan::dtype_bytes(dtype);
  const int64_t numel =
      stream_numel(call, plan::flag_in_data(tactic.protocol)
                             ? std::min(kStreamNumel, group_.layout().ll_capacity_bytes / elem)
                             : kStreamNumel);
  for (int64_t e = 0; e < numel; ++e) {
    host_test::encode(dtype, static_cast<float>(stream_value(call, rank, e)), &in[e * elem]);
  }
  std::fill(out.begin(), out.end(), 0xFF);  // NaN in every dtype: an element never written shows
  std::vector<const void*> inputs(c_.world, nullptr);
  std::vector<void*> outputs(c_.world, nullptr);
  inputs[rank] = in.data();
  outputs[rank] = out.data();
  const DeviceOptions options{c_.memory, call * 16ull + rank + 1};
  const std::string where = "rank " + std::to_string(rank) + ", kernel call " +
                            std::to_string(call) + " (" + plan::tactic_label(tactic) + " " +
                            std::string(plan::dtype_name(dtype)) + " numel " +
                            std::to_string(numel) + ")";
  if (group_.launch(ids_[call % n], tactic, dtype, inputs, outputs, numel, options, rank, 1) !=
      LaunchStatus::kCompleted) {
    fail(where + " trapped");
    return false;
  }
  for (int64_t e = 0; e < numel; ++e) {
    int sum = 0;
    for (int r = 0; r < c_.world; ++r) sum += stream_value(call, r, e);
    const double got = host_test::decode(dtype, &out[e * elem]);
    if (got != sum) {
      fail(where + ": element " + std::to_string(e) + " is " + std::to_string(got) +
           ", the sum is " + std::to_string(sum));
      return false;
    }
  }
  return true;
}

// A call the rank sends to the group's own collective: it takes a generation by the skip program.
bool Streams::declined_call(int rank, int call) {
  if (plan_.meet_first && !meet(rank)) return false;  // the group's own collective
  plan::Tactic shape = tactics_[0];
  shape.threads = kStreamThreads;
  const std::vector<const void*> inputs(c_.world, nullptr);
  const std::vector<void*> outputs(c_.world, nullptr);
  if (failed_.load()) return false;
  if (group_.launch(skip_, shape, DType::kFP32, inputs, outputs, 0, DeviceOptions{c_.memory, 1},
                    rank, 1) != LaunchStatus::kCompleted) {
    fail("rank " + std::to_string(rank) + "'s skip after kernel call " + std::to_string(call) +
         " trapped");
    return false;
  }
  return true;
}

void Streams::run_rank(int rank) {
  std::vector<uint8_t> in(kStreamNumel * 4), out(kStreamNumel * 4);
  const auto decide = [this] {
    rounds_.fetch_add(1);
    const std::chrono::duration<double> spent = std::chrono::steady_clock::now() - start_;
    go_on_.store(spent.count() < plan_.budget_s);
  };
  for (int call = 0;; ++call) {
    if (call % kRoundCalls == 0 && call > 0 && (!meet(rank, decide) || !go_on_.load())) return;
    if (failed_.load() || !kernel_call(rank, call, in, out)) return;
    for (int d = 0; d < declined_after(call); ++d) {
      if (!declined_call(rank, call)) return;
    }
  }
}

struct StreamResult {
  std::string failure;  // "" when every call of every rank was exact
  int kernel_calls;     // per rank, in the rounds every rank finished
  int declined_calls;   // per rank, after those kernel calls
  double seconds;
};

StreamResult run_streams(const StreamCase& c, const StreamPlan& plan) {
  const auto t0 = std::chrono::steady_clock::now();
  Streams streams(c, plan);
  std::vector<std::thread> ranks;
  for (int r = 0; r < c.world; ++r) ranks.emplace_back([&streams, r] { streams.run_rank(r); });
  for (std::thread& t : ranks) t.join();
  const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - t0;
  StreamResult result{streams.failure(), streams.kernel_calls(), 0, seconds.count()};
  for (int call = 0; call < result.kernel_calls; ++call) {
    result.declined_calls += declined_after(call);
  }
  return result;
}

TEST(CpuDeviceDivergence, DeclinedCallsThatMeetFirstKeepEveryRankWithinOneCall) {
  for (const StreamCase& c : {StreamCase{2, {}, std::nullopt, MemoryModel::kStrict},
                              StreamCase{2, {}, std::nullopt, MemoryModel::kWeak},
                              StreamCase{3, {}, std::nullopt, MemoryModel::kStrict},
                              StreamCase{3, {}, std::nullopt, MemoryModel::kWeak},
                              StreamCase{4, {0, 0, 1, 1}, std::nullopt, MemoryModel::kStrict},
                              StreamCase{4, {0, 0, 1, 1}, std::nullopt, MemoryModel::kWeak}}) {
    const StreamResult r = run_streams(c, StreamPlan{true, kBudgetS, 10.0});
    EXPECT_EQ(r.failure, "") << stream_case_name(c);
    std::printf("    %s: %d kernel and %d declined calls per rank in %.2f s\n",
                stream_case_name(c).c_str(), r.kernel_calls, r.declined_calls, r.seconds);
  }
}

// The defect: a rank that takes a declined call's generation alone runs ahead into the next
// kernel call of the same parity while the slow rank still reads the last one's flags and slots.
// Each protocol alone at world 2, every protocol in turn at worlds 3 and 4.
TEST(CpuDeviceDivergence, DeclinedCallsWithoutMeetingLetARankRunTwoCallsAhead) {
  if (kSanitized) GTEST_SKIP() << "a negative control needs the ranks at full speed";
  std::vector<StreamCase> cases;
  for (MemoryModel memory : {MemoryModel::kStrict, MemoryModel::kWeak}) {
    for (Protocol protocol : plan::kProtocolNames.values()) {
      cases.push_back(StreamCase{2, {}, protocol, memory});
    }
    cases.push_back(StreamCase{3, {}, std::nullopt, memory});
    cases.push_back(StreamCase{4, {0, 0, 1, 1}, std::nullopt, memory});
  }
  for (const StreamCase& c : cases) {
    const StreamResult r = run_streams(c, StreamPlan{false, 3.0, 0.5});
    EXPECT_NE(r.failure, "") << stream_case_name(c) << ": the defect went unseen in "
                             << r.kernel_calls << " kernel calls per rank";
    std::printf("    %s: failed after %.2f s: %s\n", stream_case_name(c).c_str(), r.seconds,
                r.failure.c_str());
  }
}

// ---------------------------------------------------------------- negative control: tearing

// LL relies on 8-byte single-copy atomicity ({payload, tag} land together). With 4-byte pieces a
// reader can see a tag before its payload: the LL suite must then fail (a wrong element, a
// mismatch or a timeout), or it proves nothing about the atomicity it relies on.
TEST(CpuDeviceNegativeControl, FourByteTearingMakesTheLLSuiteFail) {
  constexpr int64_t kMaxNumel = 2100;
  const auto ll_only = [](const plan::Tactic& t) { return t.protocol == Protocol::kLL; };
  const host_test::Workload w = cpu_device_test::make_workload(4, {}, kMaxNumel, 3, ll_only);
  ASSERT_FALSE(w.tactics.empty());
  int failing_runs = 0;
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    const std::string failures = cpu_device_test::run_workload(
        w, kMaxNumel, Placement::kDevice, DeviceOptions{MemoryModel::kWeakTear4, seed});
    if (!failures.empty()) ++failing_runs;
    if (seed == 1) std::printf("    first failures with tearing:\n%s", failures.c_str());
  }
  EXPECT_EQ(failing_runs, 3) << "an LL suite that passes with torn words checks nothing";
}

// Lamport words are checked one 32-bit word at a time: the same 4-byte tearing that breaks LL
// must leave every lamport result right (the atomicity it relies on is exactly that).
TEST(CpuDeviceNegativeControl, LamportNeedsOnlyFourByteAtomicity) {
  constexpr int64_t kMaxNumel = 2100;
  const auto lamport_only = [](const plan::Tactic& t) { return t.protocol == Protocol::kLamport; };
  const host_test::Workload w = cpu_device_test::make_workload(4, {}, kMaxNumel, 3, lamport_only);
  ASSERT_FALSE(w.tactics.empty());
  for (uint64_t seed = 1; seed <= 3; ++seed) {
    EXPECT_EQ(cpu_device_test::run_workload(w, kMaxNumel, Placement::kDevice,
                                            DeviceOptions{MemoryModel::kWeakTear4, seed}),
              "")
        << "seed " << seed;
  }
}

}  // namespace
}  // namespace pcie_ar::transport
