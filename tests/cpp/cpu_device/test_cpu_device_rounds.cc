// Streaming past the workspace (plan/rounds.h) on the CPU device: a message run as rounds, each
// round one ordinary call of a verified program over its own part of the tensors through a
// workspace that holds only one round, must give every rank the bits the same message gives as one
// call, and no round may touch a byte of the tensors outside its part.
//
// 1. Reduce-scatter and all-gather: round k covers elements [o_k, o_k + m_k) of every rank's chunk
//    of the whole tensor, so its message of world * m_k elements has its chunks chunk_stride apart
//    in the tensors (transport::Call::chunk_stride, the executor's plan::chunk_shift). The
//    one-chunk tensor (the reduce-scatter's output, the all-gather's input) is addressed as the
//    Communicator addresses it, from `rank` whole chunks below the round's part of it. Every
//    buildable tactic of each collective, worlds 2, 3, 4 (halves and interleaved islands), 6 and 8
//    (halves).
// 2. All-reduce (stride 0: a round is a contiguous part): every round a different tactic, as a
//    tuning table may pick per round size, since every tactic computes the group's one tree; and
//    the fused epilogue in rounds of whole rows.
//
// Values span many binades, so a sum in another order shows in the bits; the one call must also
// equal the group's tree (canonical_sum) or, for the all-gather, every rank's input bits.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "../transport/host_test_util.h"
#include "cpu_device_group.h"
#include "cpu_device_workload.h"
#include "plan/epilogue.h"
#include "plan/layout.h"
#include "plan/rounds.h"
#include "plan/schedule.h"
#include "plan/tactic.h"
#include "transport/executors/cuda/cpu/device.h"

namespace pcie_ar::transport::cpu_device_test {
namespace {

using cpu_device::DeviceOptions;
using cpu_device::LaunchStatus;
using cpu_device::MemoryModel;
using plan::Collective;
using plan::DType;

constexpr uint8_t kGuard = 0xA5;
constexpr uint8_t kUnwritten = 0x5A;  // what an output holds before any call

// A tensor's bytes between `guard` bytes on either side that no launch may touch (a multiple of 16:
// the data stays 16-byte aligned). A guard as large as the whole message holds every address a
// round of a collective forms from a one-chunk tensor's base, so a round that addressed its
// chunks wrongly is caught here rather than corrupting the heap.
class Guarded {
 public:
  explicit Guarded(size_t bytes, size_t guard = 64)
      : bytes_(bytes), guard_(guard), all_(bytes + 2 * guard, kGuard) {
    std::memset(data(), kUnwritten, bytes);
  }
  uint8_t* data() { return all_.data() + guard_; }
  const uint8_t* data() const { return all_.data() + guard_; }
  size_t bytes() const { return bytes_; }
  size_t guard() const { return guard_; }
  const std::vector<uint8_t>& all() const { return all_; }

 private:
  size_t bytes_;
  size_t guard_;
  std::vector<uint8_t> all_;
};

// Byte ranges of a tensor, [begin, end) from its first data byte.
using Windows = std::vector<std::pair<size_t, size_t>>;

// "" when `after` differs from `before` (guards included) only inside `windows`; else the first
// byte that changed outside them.
std::string changed_outside(const std::vector<uint8_t>& before, const Guarded& after,
                            const Windows& windows) {
  const std::vector<uint8_t>& now = after.all();
  for (size_t i = 0; i < now.size(); ++i) {
    if (now[i] == before[i]) continue;
    const auto at = static_cast<int64_t>(i) - static_cast<int64_t>(after.guard());
    bool inside = false;
    for (const auto& [begin, end] : windows) {
      inside |= at >= static_cast<int64_t>(begin) && at < static_cast<int64_t>(end);
    }
    if (!inside) {
      return "byte " + std::to_string(at) + " of the tensor (of " + std::to_string(after.bytes()) +
             ") changed outside the round's part";
    }
  }
  return "";
}

// An address `bytes` before `p`, formed as an integer (a one-chunk tensor's base, as the
// Communicator forms it: never dereferenced below the tensor).
template <typename T>
T* below(T* p, int64_t bytes) {
  return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(p) - static_cast<uintptr_t>(bytes));
}

// Every rank's `numel` values (and their bytes) for a summing call.
using Values = RankValues;

Values make_values(int world, int64_t numel, DType dtype, uint64_t seed) {
  return wide_values(world, numel, dtype, seed);
}

std::vector<uint8_t> tree_bits(const Values& v, const std::vector<int>& island_of, DType dtype,
                               int64_t e) {
  std::vector<float> x;
  for (const auto& rank : v.values) x.push_back(rank[e]);
  std::vector<uint8_t> bits(plan::dtype_bytes(dtype));
  host_test::encode(dtype, canonical_sum(dtype, x, island_of), bits.data());
  return bits;
}

// Whether element e's bits show the order of its sum: the group's tree differs from the flat sum
// in descending rank order. Counted, so that the data is known to tell orders apart.
bool order_shows(const Values& v, const std::vector<int>& island_of, DType dtype, int64_t e) {
  std::vector<float> descending;
  for (auto rank = v.values.rbegin(); rank != v.values.rend(); ++rank)
    descending.push_back((*rank)[e]);
  std::vector<uint8_t> flat(plan::dtype_bytes(dtype));
  host_test::encode(dtype, canonical_sum(dtype, descending, {}), flat.data());
  return tree_bits(v, island_of, dtype, e) != flat;
}

// What a run checked: launches, and elements whose bits show the order of their sum.
struct Tally {
  int launches = 0;
  int order_shows = 0;
};

struct GroupCase {
  const char* name;
  int world;
  std::vector<int> island_of;
};

std::string describe(const CpuDeviceGroup& group) {
  const auto failure = group.failure();
  return failure ? plan::describe_failure(*failure, 5.0) : "no failure recorded";
}

plan::Tactic small_launch(plan::Tactic tactic) {
  tactic.blocks = 2;
  tactic.threads = 32;
  return tactic;
}

// ---------------------------------------------------------------- 1. reduce-scatter, all-gather

// 7 vectors a chunk, through a workspace of 3 vectors a chunk: rounds of 3, 2 and 2 vectors, each
// sliced unevenly by two CTAs.
constexpr int64_t kChunkVecs = 7;
constexpr int64_t kRoundCapVecs = 3;

// One collective's every buildable tactic on one group in one placement: each dtype, weak and
// strict memory, the whole message as one call (checked against the group's tree or the inputs'
// bits) and as rounds (checked against the one call, bit for bit, and round by round for bytes
// written outside the round's part). Returns "" or the first failure; counts the launches.
std::string run_streamed_collective(const GroupCase& g, Collective collective, Placement placement,
                                    Tally& tally) {
  const int world = g.world;
  const bool scatter = collective == Collective::kReduceScatter;
  const plan::Layout whole_layout = plan::make_layout(world * kChunkVecs * 4, world, 4, 2);
  const plan::Layout round_layout = plan::make_layout(world * kRoundCapVecs * 4, world, 4, 2);
  CpuDeviceGroup whole_group(whole_layout, placement, 0, 5.0);
  CpuDeviceGroup round_group(round_layout, placement, 0, 5.0);
  const std::vector<plan::Tactic> tactics = plan::buildable_tactics(world, g.island_of, collective);
  if (tactics.empty()) return "no tactic builds";
  for (const plan::Tactic& built : tactics) {
    const plan::Schedule schedule =
        plan::build_schedule(built.algorithm, built.direction, built.staged, world, g.island_of,
                             built.protocol, collective);
    const int whole_id = whole_group.add_schedule(schedule);
    const int round_id = round_group.add_schedule(schedule);
    const plan::Tactic tactic = small_launch(built);
    for (const DType dtype : plan::kAllDTypes) {
      const int elem = plan::dtype_bytes(dtype);
      const int64_t lanes = plan::kVectorBytes / elem;
      const int64_t chunk = kChunkVecs * lanes;  // elements
      const int64_t chunk_bytes = chunk * elem;
      const int64_t numel = world * chunk;
      const std::vector<plan::Round> rounds =
          plan::split_rounds(chunk, kRoundCapVecs * lanes, lanes);
      if (rounds.size() != 3) return "the rounds are not 3, 2 and 2 vectors";
      const uint32_t signature = plan::call_signature(dtype, tactic, false, collective);
      for (const MemoryModel memory : {MemoryModel::kWeak, MemoryModel::kStrict}) {
        const uint64_t seed = 7919u * static_cast<uint64_t>(tally.launches) + 11;
        const DeviceOptions options{memory, seed};
        const std::string what =
            std::string(g.name) + " " + std::string(plan::collective_name(collective)) + " " +
            plan::tactic_label(tactic) + " " + std::string(plan::dtype_name(dtype)) +
            (memory == MemoryModel::kWeak ? " weak" : " strict") +
            (placement == Placement::kHost ? " host" : " device");
        // The whole tensors (reduce-scatter inputs, all-gather outputs) and the one-chunk ones,
        // each once for the one call and once for the rounds.
        const Values values = make_values(world, scatter ? numel : chunk, dtype, seed);
        std::vector<Guarded> whole_in, whole_out, round_in, round_out;
        for (int r = 0; r < world; ++r) {
          for (auto* in : {&whole_in, &round_in}) {
            in->emplace_back(scatter ? numel * elem : chunk_bytes, numel * elem);
            uint8_t* data = in->back().data();
            if (scatter) {
              std::memcpy(data, values.bytes[r].data(), numel * elem);
            } else {
              // Raw bits, NaN payloads and all, and a -0: an all-gather moves them untouched.
              for (int64_t b = 0; b < chunk_bytes; ++b) {
                data[b] = static_cast<uint8_t>(host_test::mix(seed + 104729u * r + b));
              }
              host_test::encode(dtype, -0.0f, data + elem);
            }
          }
          whole_out.emplace_back(scatter ? chunk_bytes : numel * elem, numel * elem);
          round_out.emplace_back(scatter ? chunk_bytes : numel * elem, numel * elem);
        }
        const std::vector<Guarded> inputs_before = round_in;
        // The one call: the message's own chunking.
        std::vector<const void*> inputs(world);
        std::vector<void*> outputs(world);
        for (int r = 0; r < world; ++r) {
          inputs[r] = scatter ? whole_in[r].data() : below(whole_in[r].data(), r * chunk_bytes);
          outputs[r] = scatter ? below(whole_out[r].data(), r * chunk_bytes) : whole_out[r].data();
        }
        if (whole_group.launch(whole_id, tactic, dtype, inputs, outputs, numel, options, 0, -1,
                               signature) != LaunchStatus::kCompleted) {
          return what + ": the one call failed: " + describe(whole_group);
        }
        ++tally.launches;
        for (int r = 0; r < world; ++r) {
          if (scatter) {
            for (int64_t e = 0; e < chunk; ++e) {
              tally.order_shows += order_shows(values, g.island_of, dtype, r * chunk + e);
              if (std::memcmp(whole_out[r].data() + e * elem,
                              tree_bits(values, g.island_of, dtype, r * chunk + e).data(),
                              elem) != 0) {
                return what + ": the one call's rank " + std::to_string(r) + " element " +
                       std::to_string(e) + " is not the group's tree";
              }
            }
          } else {
            for (int q = 0; q < world; ++q) {
              if (std::memcmp(whole_out[r].data() + q * chunk_bytes, whole_in[q].data(),
                              chunk_bytes) != 0) {
                return what + ": the one call's rank " + std::to_string(r) + " chunk " +
                       std::to_string(q) + " is not rank " + std::to_string(q) + "'s input";
              }
            }
          }
        }
        // The rounds: chunks chunk_stride (= chunk) elements apart in the tensors.
        for (size_t k = 0; k < rounds.size(); ++k) {
          const int64_t at = rounds[k].offset * elem;  // bytes into each chunk
          const int64_t part = rounds[k].numel;        // elements of each chunk
          std::vector<std::vector<uint8_t>> before;
          for (const Guarded& out : round_out) before.push_back(out.all());
          for (int r = 0; r < world; ++r) {
            if (scatter) {
              inputs[r] = round_in[r].data() + at;
              outputs[r] = below(round_out[r].data() + at, r * chunk_bytes);
            } else {
              inputs[r] = below(round_in[r].data() + at, r * chunk_bytes);
              outputs[r] = round_out[r].data() + at;
            }
          }
          const uint32_t round_signature =
              plan::round_signature(signature, numel, static_cast<int>(k));
          if (round_group.launch(round_id, tactic, dtype, inputs, outputs, world * part, options, 0,
                                 -1, round_signature, nullptr, chunk) != LaunchStatus::kCompleted) {
            return what + ": round " + std::to_string(k) + " failed: " + describe(round_group);
          }
          ++tally.launches;
          for (int r = 0; r < world; ++r) {
            Windows windows;
            for (int c = 0; c < (scatter ? 1 : world); ++c) {
              windows.emplace_back(c * chunk_bytes + at, c * chunk_bytes + at + part * elem);
            }
            const std::string stray = changed_outside(before[r], round_out[r], windows);
            if (!stray.empty()) {
              return what + ": round " + std::to_string(k) + ", rank " + std::to_string(r) +
                     "'s output: " + stray;
            }
          }
        }
        for (int r = 0; r < world; ++r) {
          if (round_out[r].all() != whole_out[r].all()) {
            return what + ": rank " + std::to_string(r) +
                   "'s output from the rounds differs from the one call's";
          }
          if (round_in[r].all() != inputs_before[r].all()) {
            return what + ": a round wrote rank " + std::to_string(r) + "'s input";
          }
        }
      }
    }
  }
  return "";
}

const std::vector<GroupCase>& collective_groups() {
  static const std::vector<GroupCase> groups = {
      {"w2", 2, {}},
      {"w3", 3, {}},
      {"w4_halves", 4, host_test::halves(4)},
      {"w4_interleaved", 4, host_test::interleaved(4)},
      {"w6_halves", 6, host_test::halves(6)},
      {"w8_halves", 8, host_test::halves(8)},
  };
  return groups;
}

// Every group in both placements: one call and three rounds per (tactic, dtype, memory model).
Tally run_streamed(Collective collective) {
  Tally total;
  for (const GroupCase& g : collective_groups()) {
    for (const Placement placement : {Placement::kDevice, Placement::kHost}) {
      Tally tally;
      const std::string failure = run_streamed_collective(g, collective, placement, tally);
      EXPECT_EQ(failure, "");
      if (failure.empty()) {  // 5+ tactics
        EXPECT_GE(tally.launches, 5 * 3 * 2 * 4) << g.name;
      }
      total.launches += tally.launches;
      total.order_shows += tally.order_shows;
    }
  }
  return total;
}

TEST(CpuDeviceRounds, ReduceScatterRoundsEqualTheOneCall) {
  const Tally tally = run_streamed(Collective::kReduceScatter);
  EXPECT_GT(tally.order_shows, 1000);
}

TEST(CpuDeviceRounds, AllGatherRoundsEqualTheOneCall) { run_streamed(Collective::kAllGather); }

// ---------------------------------------------------------------- 2. all-reduce

const std::vector<GroupCase>& all_reduce_groups() {
  static const std::vector<GroupCase> groups = {
      {"w3", 3, {}},
      {"w4_halves", 4, host_test::halves(4)},
      {"w4_interleaved", 4, host_test::interleaved(4)},
  };
  return groups;
}

// 23 vectors through a workspace of 6: rounds of 6, 6, 6 and 5 vectors.
constexpr int64_t kMessageVecs = 23;
constexpr int64_t kAllReduceCapVecs = 6;

// For every buildable tactic t (of T): the message as one call of t (checked against the group's
// tree), then as rounds, round k run by tactic t + k + 1 (mod T), in place for every other t.
std::string run_streamed_all_reduce(const GroupCase& g, Placement placement, Tally& tally) {
  const int world = g.world;
  const plan::Layout whole_layout = plan::make_layout(kMessageVecs * 4, world, 4, 2);
  const plan::Layout round_layout = plan::make_layout(kAllReduceCapVecs * 4, world, 4, 2);
  CpuDeviceGroup whole_group(whole_layout, placement, 0, 5.0);
  CpuDeviceGroup round_group(round_layout, placement, 0, 5.0);
  std::vector<plan::Tactic> tactics;
  std::vector<int> whole_ids, round_ids;
  for (const plan::Tactic& built : plan::buildable_tactics(world, g.island_of)) {
    const plan::Schedule schedule = plan::build_schedule(
        built.algorithm, built.direction, built.staged, world, g.island_of, built.protocol);
    tactics.push_back(small_launch(built));
    whole_ids.push_back(whole_group.add_schedule(schedule));
    round_ids.push_back(round_group.add_schedule(schedule));
  }
  const int num_tactics = static_cast<int>(tactics.size());
  if (num_tactics < 2) return "fewer than two tactics build";
  for (const DType dtype : plan::kAllDTypes) {
    const int elem = plan::dtype_bytes(dtype);
    const int64_t lanes = plan::kVectorBytes / elem;
    const int64_t numel = kMessageVecs * lanes;
    const std::vector<plan::Round> rounds =
        plan::split_rounds(numel, kAllReduceCapVecs * lanes, lanes);
    if (rounds.size() != 4) return "the rounds are not 6, 6, 6 and 5 vectors";
    for (const MemoryModel memory : {MemoryModel::kWeak, MemoryModel::kStrict}) {
      for (int t = 0; t < num_tactics; ++t) {
        const uint64_t seed = 6151u * static_cast<uint64_t>(tally.launches) + 5;
        const DeviceOptions options{memory, seed};
        const bool in_place = t % 2 == 1;
        const std::string what = std::string(g.name) + " from " + plan::tactic_label(tactics[t]) +
                                 " " + std::string(plan::dtype_name(dtype)) +
                                 (memory == MemoryModel::kWeak ? " weak" : " strict") +
                                 (placement == Placement::kHost ? " host" : " device") +
                                 (in_place ? " in place" : "");
        const Values values = make_values(world, numel, dtype, seed);
        std::vector<Guarded> whole_out, round_out;
        std::vector<const void*> inputs(world);
        std::vector<void*> outputs(world);
        for (int r = 0; r < world; ++r) {
          whole_out.emplace_back(numel * elem);
          round_out.emplace_back(numel * elem);
          if (in_place) std::memcpy(round_out[r].data(), values.bytes[r].data(), numel * elem);
          inputs[r] = values.bytes[r].data();
          outputs[r] = whole_out[r].data();
        }
        if (whole_group.launch(whole_ids[t], tactics[t], dtype, inputs, outputs, numel, options) !=
            LaunchStatus::kCompleted) {
          return what + ": the one call failed: " + describe(whole_group);
        }
        ++tally.launches;
        for (int64_t e = 0; e < numel; ++e) {
          tally.order_shows += order_shows(values, g.island_of, dtype, e);
        }
        for (int r = 0; r < world; ++r) {
          for (int64_t e = 0; e < numel; ++e) {
            if (std::memcmp(whole_out[r].data() + e * elem,
                            tree_bits(values, g.island_of, dtype, e).data(), elem) != 0) {
              return what + ": the one call's rank " + std::to_string(r) + " element " +
                     std::to_string(e) + " is not the group's tree";
            }
          }
        }
        for (size_t k = 0; k < rounds.size(); ++k) {
          const int u = (t + static_cast<int>(k) + 1) % num_tactics;
          const int64_t at = rounds[k].offset * elem;
          std::vector<std::vector<uint8_t>> before;
          for (const Guarded& out : round_out) before.push_back(out.all());
          for (int r = 0; r < world; ++r) {
            outputs[r] = round_out[r].data() + at;
            inputs[r] = in_place ? outputs[r] : values.bytes[r].data() + at;
          }
          const uint32_t signature = plan::round_signature(plan::call_signature(dtype, tactics[u]),
                                                           numel, static_cast<int>(k));
          if (round_group.launch(round_ids[u], tactics[u], dtype, inputs, outputs, rounds[k].numel,
                                 options, 0, -1, signature) != LaunchStatus::kCompleted) {
            return what + ": round " + std::to_string(k) + " (" + plan::tactic_label(tactics[u]) +
                   ") failed: " + describe(round_group);
          }
          ++tally.launches;
          for (int r = 0; r < world; ++r) {
            const std::string stray = changed_outside(
                before[r], round_out[r], {{at, at + static_cast<size_t>(rounds[k].numel) * elem}});
            if (!stray.empty()) {
              return what + ": round " + std::to_string(k) + ", rank " + std::to_string(r) + ": " +
                     stray;
            }
          }
        }
        for (int r = 0; r < world; ++r) {
          if (round_out[r].all() != whole_out[r].all()) {
            return what + ": rank " + std::to_string(r) + "'s rounds differ from the one call";
          }
        }
      }
    }
  }
  return "";
}

TEST(CpuDeviceRounds, AllReduceRoundsOfMixedTacticsEqualTheOneCall) {
  int order_shows = 0;
  for (const GroupCase& g : all_reduce_groups()) {
    for (const Placement placement : {Placement::kDevice, Placement::kHost}) {
      Tally tally;
      const std::string failure = run_streamed_all_reduce(g, placement, tally);
      EXPECT_EQ(failure, "");
      if (failure.empty()) {  // 10+ tactics
        EXPECT_GE(tally.launches, 10 * 3 * 2 * 5) << g.name;
      }
      order_shows += tally.order_shows;
    }
  }
  EXPECT_GT(order_shows, 1000);
}

// The fused call in rounds of whole rows, each round normalising its own: 5 rows through a
// workspace of 2 (rounds of 2, 2 and 1 rows), round k by tactic t + k + 1 (mod T), y and
// residual_out equal to the one call's bit for bit.
constexpr int64_t kHidden = 72;  // whole vectors in every dtype; 2 and 3 CTAs split it unevenly
constexpr int64_t kRows = 5;
constexpr int64_t kRoundCapRows = 2;

std::vector<uint8_t> small_values(DType dtype, int64_t n, uint64_t seed) {
  std::vector<uint8_t> out(n * plan::dtype_bytes(dtype));
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t h = host_test::mix(seed ^ host_test::mix(static_cast<uint64_t>(i)));
    const double v = (static_cast<double>(h & 0xffffff) / 16777216.0 - 0.5) * 4.0;
    host_test::encode(dtype, static_cast<float>(host_test::round_to(dtype, v)),
                      &out[i * plan::dtype_bytes(dtype)]);
  }
  return out;
}

std::string run_streamed_epilogue(const GroupCase& g, Placement placement, Tally& tally) {
  const int world = g.world;
  const int64_t numel = kRows * kHidden;
  const plan::Layout whole_layout = plan::make_layout(numel, world, 4, 2);
  const plan::Layout round_layout = plan::make_layout(kRoundCapRows * kHidden, world, 4, 2);
  CpuDeviceGroup whole_group(whole_layout, placement, 0, 5.0);
  CpuDeviceGroup round_group(round_layout, placement, 0, 5.0);
  std::vector<plan::Tactic> tactics;
  std::vector<int> whole_ids, round_ids;
  for (const plan::Tactic& built : plan::buildable_tactics(world, g.island_of)) {
    const plan::Schedule schedule = plan::with_epilogue(plan::build_schedule(
        built.algorithm, built.direction, built.staged, world, g.island_of, built.protocol));
    tactics.push_back(small_launch(built));
    whole_ids.push_back(whole_group.add_schedule(schedule));
    round_ids.push_back(round_group.add_schedule(schedule));
  }
  const int num_tactics = static_cast<int>(tactics.size());
  const float eps = 1e-5f;
  const std::vector<plan::Round> rounds =
      plan::split_rounds(numel, kRoundCapRows * kHidden, kHidden);
  if (rounds.size() != 3) return "the rounds are not 2, 2 and 1 rows";
  for (const DType dtype : plan::kAllDTypes) {
    const int elem = plan::dtype_bytes(dtype);
    const size_t bytes = numel * elem;
    const MemoryModel memory = dtype == DType::kFP16 ? MemoryModel::kStrict : MemoryModel::kWeak;
    for (int t = 0; t < num_tactics; ++t) {
      const uint64_t seed = 3571u * static_cast<uint64_t>(tally.launches) + 1;
      const DeviceOptions options{memory, seed};
      const std::string what = std::string(g.name) + " fused from " +
                               plan::tactic_label(tactics[t]) + " " +
                               std::string(plan::dtype_name(dtype)) +
                               (placement == Placement::kHost ? " host" : " device");
      // Every rank's residual and weight are the same (the replicated residual stream).
      const std::vector<uint8_t> residual = small_values(dtype, numel, seed + 1);
      const std::vector<uint8_t> weight = small_values(dtype, kHidden, seed + 2);
      std::vector<std::vector<uint8_t>> in(world);
      std::vector<Guarded> whole_y, whole_res, round_y, round_res;
      std::vector<const void*> inputs(world);
      std::vector<void*> outputs(world);
      std::vector<plan::EpilogueArgs> args(world);
      for (int r = 0; r < world; ++r) {
        in[r] = small_values(dtype, numel, seed + 10 + r);
        whole_y.emplace_back(bytes);
        whole_res.emplace_back(bytes);
        round_y.emplace_back(bytes);
        round_res.emplace_back(bytes);
        inputs[r] = in[r].data();
        outputs[r] = whole_y[r].data();
        args[r] = plan::EpilogueArgs{.residual = residual.data(),
                                     .residual_out = whole_res[r].data(),
                                     .weight = weight.data(),
                                     .y = outputs[r],
                                     .hidden = kHidden,
                                     .eps = eps};
      }
      const uint32_t fused = plan::call_signature(dtype, tactics[t], true);
      if (whole_group.launch(whole_ids[t], tactics[t], dtype, inputs, outputs, numel, options, 0,
                             -1, plan::epilogue_signature(fused, args[0]),
                             &args) != LaunchStatus::kCompleted) {
        return what + ": the one call failed: " + describe(whole_group);
      }
      ++tally.launches;
      for (size_t k = 0; k < rounds.size(); ++k) {
        const int u = (t + static_cast<int>(k) + 1) % num_tactics;
        const int64_t at = rounds[k].offset * elem;
        for (int r = 0; r < world; ++r) {
          inputs[r] = in[r].data() + at;
          outputs[r] = round_y[r].data() + at;
          args[r] = plan::EpilogueArgs{.residual = residual.data() + at,
                                       .residual_out = round_res[r].data() + at,
                                       .weight = weight.data(),
                                       .y = outputs[r],
                                       .hidden = kHidden,
                                       .eps = eps};
        }
        const uint32_t signature = plan::round_signature(
            plan::epilogue_signature(plan::call_signature(dtype, tactics[u], true), args[0]), numel,
            static_cast<int>(k));
        if (round_group.launch(round_ids[u], tactics[u], dtype, inputs, outputs, rounds[k].numel,
                               options, 0, -1, signature, &args) != LaunchStatus::kCompleted) {
          return what + ": round " + std::to_string(k) + " (" + plan::tactic_label(tactics[u]) +
                 ") failed: " + describe(round_group);
        }
        ++tally.launches;
      }
      for (int r = 0; r < world; ++r) {
        if (round_y[r].all() != whole_y[r].all()) {
          return what + ": rank " + std::to_string(r) + "'s y from the rounds differs";
        }
        if (round_res[r].all() != whole_res[r].all()) {
          return what + ": rank " + std::to_string(r) + "'s residual_out from the rounds differs";
        }
      }
    }
  }
  return "";
}

TEST(CpuDeviceRounds, FusedRoundsOfWholeRowsEqualTheOneCall) {
  for (const GroupCase& g : all_reduce_groups()) {
    Tally tally;
    const std::string failure = run_streamed_epilogue(g, Placement::kDevice, tally);
    EXPECT_EQ(failure, "");
    if (failure.empty()) {  // 10+ tactics
      EXPECT_GE(tally.launches, 10 * 3 * 4) << g.name;
    }
  }
}

}  // namespace
}  // namespace pcie_ar::transport::cpu_device_test
