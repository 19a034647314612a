// The cost model (plan/cost_model.h): exact critical paths on hand-checked schedules with
// constants that are distinct powers of two (so every sum names the links it is made of), what
// each executor property is worth, the byte counts, and a sweep over every buildable tactic.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "plan/cost_model.h"
#include "plan/schedule.h"
#include "plan/verify.h"

namespace pcie_ar::plan {
namespace {

// No two sums of distinct subsets collide; bandwidth so high that it adds nothing measurable.
LatencyModel powers_of_two() {
  LatencyModel l;
  l.launch_us = 1;
  l.local_load_us = 2;
  l.posted_write_us = 4;
  l.posted_write_cross_us = 8;
  l.peer_read_us = 16;
  l.peer_read_cross_us = 32;
  l.host_read_us = 64;
  l.host_write_us = 128;
  l.fence_after_peer_writes_us = 256;
  l.fence_after_local_writes_us = 512;
  l.gpu_link_gbps = 1e12;
  l.gpu_link_fanout_gbps = 1e12;
  l.socket_link_gbps = 1e12;
  return l;
}

// An executor with a serial first look: every LL compare waits for its own load.
ExecutorModel serial() {
  ExecutorModel e;
  e.first_look_group = 8;
  e.parallel_first_look = false;
  e.parallel_relooks = false;
  e.multi_destination_copies = false;
  return e;
}

// Today's: a parallel first look, missed operands awaited one at a time.
ExecutorModel first_look_only() {
  ExecutorModel e = serial();
  e.parallel_first_look = true;
  return e;
}

// Every look parallel.
ExecutorModel parallel() {
  ExecutorModel e = first_look_only();
  e.parallel_relooks = true;
  return e;
}

std::string path_text(const CostReport& r) {
  std::string out;
  for (const auto& link : r.critical_path) out += "\n  " + link;
  return out;
}

Schedule oneshot_ll(int world, const std::vector<int>& island_of = {}) {
  return build_schedule(Algorithm::kOneshot, Direction::kPush, false, world, island_of,
                        Protocol::kLL);
}

// World 2 one-shot LL: each rank copies its input into the peer's LL slot (launch 1, counter 2,
// input 2, posted write 4: lands at 9) and then sums. Rank 0 sums (input0, LL1): one look at 5
// misses, a poll sees LL1 at 9 + 2 = 11. Rank 1 sums (LL0, input1): today the input's load waits
// for LL0's check, 11 + 2 = 13; with a parallel first look it rides along, 11.
TEST(CostModel, WorldTwoOneshotLLCriticalPathIsExact) {
  const Schedule s = oneshot_ll(2);
  ASSERT_TRUE(verify(s).ok);
  const CostReport today = model_cost(s, 4096, Placement::kDeviceMemory, powers_of_two(), serial());
  EXPECT_DOUBLE_EQ(today.latency_us, 13.0) << path_text(today);
  EXPECT_EQ(today.serial_round_trips, 5) << path_text(today);
  const CostReport fixed =
      model_cost(s, 4096, Placement::kDeviceMemory, powers_of_two(), parallel());
  EXPECT_DOUBLE_EQ(fixed.latency_us, 11.0) << path_text(fixed);
  EXPECT_EQ(fixed.serial_round_trips, 4) << path_text(fixed);
  EXPECT_EQ(fixed.critical_path.front(), "launch 1.00");
}

// The same on pinned host memory: the write lands in host DRAM (5 + 128 = 133) and every look
// is a host read (64): rank 1 sees LL0 at 133 + 64 = 197, then loads its input, 199.
TEST(CostModel, HostMemoryPaysAHostReadPerLookAndAHostWritePerStore) {
  const CostReport r =
      model_cost(oneshot_ll(2), 4096, Placement::kHostMemory, powers_of_two(), serial());
  EXPECT_DOUBLE_EQ(r.latency_us, 199.0) << path_text(r);
  EXPECT_EQ(r.serial_round_trips, 5) << path_text(r);
}

// World 2 one-shot flag, unstaged: copy (lands 9), then the signal: a system fence after fabric
// writes (5 + 256 = 261) and the flag's posted write (265); rank 0 polls its own flag (267) and
// loads both operands together (269).
TEST(CostModel, FlagProtocolPaysTheFenceAndTheFlagWrite) {
  const Schedule s = build_schedule(Algorithm::kOneshot, Direction::kPush, false, 2);
  const CostReport r = model_cost(s, 4096, Placement::kDeviceMemory, powers_of_two(), serial());
  EXPECT_DOUBLE_EQ(r.latency_us, 269.0) << path_text(r);
  EXPECT_EQ(r.serial_round_trips, 6) << path_text(r);
}

// A serial first look pays a round trip per LL operand in turn; a parallel first look takes the
// plain operands along but still awaits the missed LL operands one at a time; parallel re-looks
// see all the missing ones with one look after the last lands. (Delivery copies land one local
// load apart, so the gaps are not whole multiples; world 2 above is exact.)
TEST(CostModel, SerialLooksCostRoundTripsThatParallelLooksSave) {
  for (int world : {4, 8}) {
    const Schedule s = oneshot_ll(world);
    const auto at = [&](const ExecutorModel& e) {
      return model_cost(s, 4096, Placement::kDeviceMemory, powers_of_two(), e);
    };
    const CostReport before = at(serial()), today = at(first_look_only()), all = at(parallel());
    EXPECT_LT(today.latency_us, before.latency_us) << world << path_text(before);
    EXPECT_LT(all.latency_us, today.latency_us) << world << path_text(today);
    EXPECT_GT(before.serial_round_trips, today.serial_round_trips) << world;
    EXPECT_GT(today.serial_round_trips, all.serial_round_trips) << world;
    // With every look parallel, the reduce costs one look after the last operand landed.
    int looks = 0;
    for (const auto& link : all.critical_path)
      looks += link.find("a look sees") != std::string::npos;
    EXPECT_EQ(looks, 1) << world << path_text(all);
  }
}

// What the model assumes of today's executor is what tests/sass checks of its code.
TEST(CostModel, TodaysExecutorHasAParallelFirstLookParallelRelooksAndFanOutCopies) {
  const ExecutorModel e = current_executor();
  EXPECT_TRUE(e.parallel_first_look);
  EXPECT_TRUE(e.parallel_relooks);  // the decode-shaped kernels' relook_ll_group
  EXPECT_TRUE(e.multi_destination_copies);
  // The decode-shaped kernels' one look (kLLGroup<kDecodeThreads>; tests/sass's check (e)).
  EXPECT_EQ(e.first_look_group, kMaxSources);
  EXPECT_EQ(e.dense_first_look_group, kMaxSources);
}

// Groups bound the parallel look: with groups of 3 at world 8 the eight operands take three
// waves, each one look after its last operand landed.
TEST(CostModel, FirstLookGroupsSerialiseBetweenGroups) {
  ExecutorModel grouped = parallel();
  grouped.first_look_group = 3;
  const CostReport one =
      model_cost(oneshot_ll(8), 4096, Placement::kDeviceMemory, powers_of_two(), parallel());
  const CostReport three =
      model_cost(oneshot_ll(8), 4096, Placement::kDeviceMemory, powers_of_two(), grouped);
  EXPECT_EQ(three.serial_round_trips - one.serial_round_trips, 2) << path_text(three);
}

// Unstaged one-shot delivers with N - 1 copies of the input; each re-loads it before it stores,
// so the last copy leaves N - 2 loads late. A multi-destination copy loads it once.
TEST(CostModel, DeliveryCopiesSerialiseUnlessOneLoadFeedsEveryDestination) {
  const Schedule s = build_schedule(Algorithm::kOneshot, Direction::kPush, false, 8);
  ExecutorModel multi = serial();
  multi.multi_destination_copies = true;
  const CostReport today = model_cost(s, 4096, Placement::kDeviceMemory, powers_of_two(), serial());
  const CostReport fixed = model_cost(s, 4096, Placement::kDeviceMemory, powers_of_two(), multi);
  EXPECT_DOUBLE_EQ(today.latency_us - fixed.latency_us, 2.0 * 6) << path_text(today);
  EXPECT_EQ(today.serial_round_trips - fixed.serial_round_trips, 6);
}

// Crossing the socket link costs the cross-socket write, once, on the island path.
TEST(CostModel, IslandPartialsCrossTheSocketLinkOnce) {
  const std::vector<int> halves = {0, 0, 0, 0, 1, 1, 1, 1};
  const Schedule s =
      build_schedule(Algorithm::kIslandOneshot, Direction::kPush, false, 8, halves, Protocol::kLL);
  const CostReport r = model_cost(s, 4096, Placement::kDeviceMemory, powers_of_two(), parallel());
  int cross = 0;
  for (const auto& link : r.critical_path) cross += link.find(", across") != std::string::npos;
  EXPECT_EQ(cross, 1) << path_text(r);
}

// Bytes: LL moves its tags too (twice the payload); one-shot push sends the whole message to
// every peer, two-shot 2 (N - 1) / N of it; a flat schedule's cross-socket flows add up.
TEST(CostModel, BusiestLinkCountsLLTagsAndFanOut) {
  const int64_t n = 1 << 16;
  const LatencyModel l;  // the defaults: bandwidth matters here
  const CostReport flag =
      model_cost(build_schedule(Algorithm::kOneshot, Direction::kPush, false, 4), n,
                 Placement::kDeviceMemory, l);
  const CostReport ll = model_cost(oneshot_ll(4), n, Placement::kDeviceMemory, l);
  EXPECT_DOUBLE_EQ(flag.busiest_link_bytes, 3.0 * n) << flag.busiest_link;
  EXPECT_DOUBLE_EQ(ll.busiest_link_bytes, 6.0 * n) << ll.busiest_link;
  EXPECT_DOUBLE_EQ(flag.bandwidth_us, 3.0 * n / (l.gpu_link_fanout_gbps * 1e3));
  const CostReport two = model_cost(build_schedule(Algorithm::kTwoshot, Direction::kPush, false, 4),
                                    n, Placement::kDeviceMemory, l);
  EXPECT_DOUBLE_EQ(two.busiest_link_bytes, 2.0 * 3 * n / 4) << two.busiest_link;
  // World 2 sends to one peer: the single-stream rate.
  const CostReport pair = model_cost(oneshot_ll(2), n, Placement::kDeviceMemory, l);
  EXPECT_DOUBLE_EQ(pair.bandwidth_us, 2.0 * n / (l.gpu_link_gbps * 1e3));
  // 4 + 4, flat one-shot: each rank sends 2n to each of four peers across the sockets, 8n of
  // its own flow (socket_link_gbps is a per-rank flow rate, FlashInfer #4870), against 14n out
  // of its own link to all seven: the rank's link is the busiest, not a sum of every flow across.
  const Schedule flat_ll = oneshot_ll(8, {0, 0, 0, 0, 1, 1, 1, 1});
  const CostReport flat = model_cost(flat_ll, n, Placement::kDeviceMemory, l);
  EXPECT_EQ(flat.busiest_link, "rank 0 out") << flat.busiest_link;
  EXPECT_DOUBLE_EQ(flat.busiest_link_bytes, 7.0 * 2 * n);
  EXPECT_DOUBLE_EQ(flat.modelled_us, flat.latency_us + flat.bandwidth_us);
  // With the GPUs' own links unbounded, one rank's flow across the sockets is what bounds.
  LatencyModel fast_links = l;
  fast_links.gpu_link_gbps = fast_links.gpu_link_fanout_gbps = 1e12;
  const CostReport across = model_cost(flat_ll, n, Placement::kDeviceMemory, fast_links);
  EXPECT_EQ(across.busiest_link, "rank 0 across socket 0->1") << across.busiest_link;
  EXPECT_DOUBLE_EQ(across.busiest_link_bytes, 4.0 * 2 * n);
  EXPECT_DOUBLE_EQ(across.bandwidth_us, 4.0 * 2 * n / (l.socket_link_gbps * 1e3));
}

// Lamport moves the payload once: its busiest link carries the flag protocol's bytes, half of
// LL's, on P2P and on host memory (where each reader's resets go back over its link too), and
// its critical path is LL's link for link.
TEST(CostModel, LamportMovesHalfOfLLsBytesOnTheSamePath) {
  const int64_t n = 1 << 16;
  const LatencyModel l;
  ExecutorModel e = current_executor();
  e.dense_first_look_group = e.first_look_group;  // the same looks: only the bytes differ
  for (Placement placement : {Placement::kDeviceMemory, Placement::kHostMemory}) {
    for (Algorithm a : {Algorithm::kOneshot, Algorithm::kTwoshot}) {
      const Schedule ll_schedule = build_schedule(a, Direction::kPush, false, 4, {}, Protocol::kLL);
      const Schedule lamport =
          build_schedule(a, Direction::kPush, false, 4, {}, Protocol::kLamport);
      const CostReport ll = model_cost(ll_schedule, n, placement, l, e);
      const CostReport dense = model_cost(lamport, n, placement, l, e);
      EXPECT_DOUBLE_EQ(dense.busiest_link_bytes, ll.busiest_link_bytes / 2) << dense.busiest_link;
      EXPECT_DOUBLE_EQ(dense.latency_us, ll.latency_us) << path_text(dense);
      EXPECT_EQ(dense.critical_path, ll.critical_path);
      EXPECT_LT(dense.modelled_us, ll.modelled_us);
    }
  }
}

// Every tactic the builders accept is modelled, on both placements, with a path that starts at
// the launch and a time that grows with the message.
TEST(CostModel, EveryBuildableTacticIsModelled) {
  for (int world : {2, 4, 6, 8}) {
    std::vector<int> halves(world);
    for (int r = 0; r < world; ++r) halves[r] = r < world / 2 ? 0 : 1;
    for (const auto& islands : {std::vector<int>(world, 0), halves}) {
      for (const Tactic& t : buildable_tactics(world, islands)) {
        const Schedule s =
            build_schedule(t.algorithm, t.direction, t.staged, world, islands, t.protocol);
        for (Placement p : {Placement::kDeviceMemory, Placement::kHostMemory}) {
          const CostReport small = model_cost(s, 1024, p);
          const CostReport large = model_cost(s, 1 << 20, p);
          EXPECT_GT(small.serial_round_trips, 1) << tactic_label(t);
          EXPECT_EQ(small.critical_path.size(), static_cast<size_t>(small.serial_round_trips) + 1)
              << tactic_label(t) << path_text(small);
          EXPECT_GT(large.modelled_us, small.modelled_us) << tactic_label(t);
          EXPECT_GE(small.latency_us, LatencyModel{}.launch_us);
        }
      }
    }
  }
}

TEST(CostModel, RefusesMalformedInput) {
  Schedule broken = oneshot_ll(2);
  broken.programs.pop_back();
  EXPECT_THROW(model_cost(broken, 4096, Placement::kDeviceMemory), std::invalid_argument);
  EXPECT_THROW(model_cost(oneshot_ll(2), -1, Placement::kDeviceMemory), std::invalid_argument);
}

}  // namespace
}  // namespace pcie_ar::plan

namespace pcie_ar::plan {
namespace {

// The fused epilogue adds the rank's CTA meeting and two local passes over its rows,
// nothing that crosses the fabric: every buildable tactic, P2P and host memory, at a decode
// size, costs exactly three local loads more and moves the same bytes.
TEST(CostModel, TheFusedEpilogueAddsNoFabricRoundTrip) {
  const LatencyModel l = powers_of_two();
  const std::vector<int> islands = {0, 0, 0, 0, 1, 1, 1, 1};
  int compared = 0;
  for (const Tactic& t : buildable_tactics(8, islands)) {
    const Schedule plain =
        build_schedule(t.algorithm, t.direction, t.staged, 8, islands, t.protocol);
    const Schedule fused = with_epilogue(plain);
    for (Placement placement : {Placement::kDeviceMemory, Placement::kHostMemory}) {
      const CostReport a = model_cost(plain, 12288, placement, l, ExecutorModel{});
      const CostReport b = model_cost(fused, 12288, placement, l, ExecutorModel{});
      EXPECT_DOUBLE_EQ(b.latency_us - a.latency_us, 3 * l.local_load_us) << tactic_label(t);
      EXPECT_EQ(b.serial_round_trips - a.serial_round_trips, 3) << tactic_label(t);
      EXPECT_DOUBLE_EQ(b.bandwidth_us, a.bandwidth_us) << tactic_label(t);
      EXPECT_EQ(b.busiest_link_bytes, a.busiest_link_bytes) << tactic_label(t);
      ++compared;
    }
  }
  EXPECT_GT(compared, 20);
}

}  // namespace
}  // namespace pcie_ar::plan
