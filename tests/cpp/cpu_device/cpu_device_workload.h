// Workloads of the CPU-device suites: every buildable tactic as built (the CUDA executor runs
// unfused programs), each dtype and two launch shapes, sizes that hit the edges, run back to
// back on one CpuDeviceGroup and checked against host_test_util.h's independent number model
// (bitwise and within tolerance of the double-precision sum) and across ranks (bitwise).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "../transport/host_test_util.h"
#include "cpu_device_group.h"
#include "transport/executors/cuda/cpu/device.h"

namespace pcie_ar::transport::cpu_device_test {

// The ways every suite runs: both memory models x both placements.
struct Mode {
  cpu_device::MemoryModel memory;
  Placement placement;
};
std::vector<Mode> all_modes();
// "_strict_device", "_weak_host", ...: a test-name suffix.
std::string mode_name(const Mode& mode);

// Two launch shapes: more than one warp per CTA, and CTAs that own uneven slices. `bound`: the
// executor instantiation (cpu_device::DeviceOptions::executor_bound): the first shape runs what
// a GPU runs at it (push: the decode-shaped kernels, every LL operand in one look), the second
// the large-message kernels (LL operands two at a time: a reduce of three or more runs several
// looks, each resetting its own operands).
struct Shape {
  int blocks;
  int threads;
  int bound;
};
inline constexpr Shape kShapes[] = {{2, 64, 0}, {3, 32, kMaxThreads}};

// Every tactic the builders accept for this world and island map, as built.
std::vector<host_test::TacticCase> gpu_tactics(int world, const std::vector<int>& island_of);

// Each (tactic, dtype, shape) `rounds` times with sizes from a cycle that hits one vector, fewer
// vectors than chunks x blocks, odd counts and a full slot; in place every third call. A call's
// `blocks` field holds its index into kShapes. `keep(tactic)` filters the tactics (all: empty).
host_test::Workload make_workload(int world, const std::vector<int>& island_of, int64_t max_numel,
                                  int rounds,
                                  const std::function<bool(const plan::Tactic&)>& keep = {});

// The tactic call `call` launches with: its shape's blocks and threads.
plan::Tactic launch_tactic(const host_test::Workload& w, const host_test::CallCase& call);

// Runs every call of `w` back to back on one group (all ranks in one launch per call); returns
// the failures as text, "" when every call of every rank was right. Stops at a trapped launch.
std::string run_workload(const host_test::Workload& w, int64_t max_numel, Placement placement,
                         const cpu_device::DeviceOptions& options, uint64_t initial_gen = 0);

// ---------------------------------------------------------------- the reduction's oracle
// Scalar, from the rule alone (plan::Step::split), sharing no code with the executors: every sum of
// two or more operands runs in fp32 in operand order from +0, ((+0 + x0) + x1) + ..., and is
// rounded once to the dtype (host_test::round_to); the values are the dtype's (exact).

// A reduce of x.size() >= 2 operands split at `split` (0: one sum): round((+0 + round(sum of
// x[0, split))) + round(sum of x[split, n))).
float split_sum(plan::DType dtype, const std::vector<float>& x, int split);

// What every rank of the group holds for one element, from each rank's value: the canonical tree
// (plan::canonical_groups). Where two equal islands of two or more ranks exist, the island holding
// rank 0 first, each in ascending rank order, split between them; elsewhere one sum of every rank
// in ascending order.
float canonical_sum(plan::DType dtype, const std::vector<float>& by_rank,
                    const std::vector<int>& island_of);

// ---------------------------------------------------------------- data that shows the order
// Element e of rank r: a random sign and mantissa over a wide range of binades, 2^-10 to 2^14 (for
// fp16 to 2^11, so that no sum of eight overflows), one in sixteen a zero of either sign; exact in
// the dtype. Every value, so every sum, is a multiple of 2^-30: no sum other than an exact zero
// rounds to a zero in any dtype (a -0 that a lamport writer would deliver as +0).
float wide_value(uint64_t seed, int rank, int64_t e, plan::DType dtype);

// Every rank's `numel` wide values, and their bytes in the dtype.
struct RankValues {
  std::vector<std::vector<float>> values;  // [rank][element]
  std::vector<std::vector<uint8_t>> bytes;
};
RankValues wide_values(int world, int64_t numel, plan::DType dtype, uint64_t seed);

}  // namespace pcie_ar::transport::cpu_device_test
