// See cpu_device_workload.h.
#include "cpu_device_workload.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iterator>

#include "plan/layout.h"
#include "plan/schedule.h"
#include "plan/tactic.h"

namespace pcie_ar::transport::cpu_device_test {

using cpu_device::DeviceOptions;
using cpu_device::LaunchStatus;
using host_test::CallCase;
using host_test::RankReport;
using host_test::TacticCase;
using host_test::Workload;
using plan::DType;

std::vector<Mode> all_modes() {
  std::vector<Mode> modes;
  for (auto memory : {cpu_device::MemoryModel::kStrict, cpu_device::MemoryModel::kWeak}) {
    for (Placement placement : {Placement::kDevice, Placement::kHost}) {
      modes.push_back(Mode{memory, placement});
    }
  }
  return modes;
}

std::string mode_name(const Mode& mode) {
  return std::string(mode.memory == cpu_device::MemoryModel::kStrict ? "_strict" : "_weak") +
         (mode.placement == Placement::kDevice ? "_device" : "_host");
}

std::vector<TacticCase> gpu_tactics(int world, const std::vector<int>& island_of) {
  std::vector<TacticCase> tactics;
  for (TacticCase& t : host_test::all_tactics(world, island_of)) {
    if (!t.fused) tactics.push_back(std::move(t));
  }
  return tactics;
}

Workload make_workload(int world, const std::vector<int>& island_of, int64_t max_numel, int rounds,
                       const std::function<bool(const plan::Tactic&)>& keep) {
  Workload w;
  w.world = world;
  w.island_of = island_of;
  for (TacticCase& t : gpu_tactics(world, island_of)) {
    if (!keep || keep(t.tactic)) w.tactics.push_back(std::move(t));
  }
  const int64_t ll_capacity = plan::make_layout(max_numel, world, 4).ll_capacity_bytes;
  const int64_t vec_counts[] = {1, 3, 7, 37, 130, 1 << 20};
  int n = 0;
  for (int round = 0; round < rounds; ++round) {
    for (int t = 0; t < static_cast<int>(w.tactics.size()); ++t) {
      const bool ll = plan::flag_in_data(w.tactics[t].tactic.protocol);
      for (DType dtype : plan::kAllDTypes) {
        const int64_t lanes = plan::kVectorBytes / plan::dtype_bytes(dtype);
        int64_t limit = max_numel;
        if (ll) limit = std::min(limit, ll_capacity / plan::dtype_bytes(dtype));
        for (int s = 0; s < static_cast<int>(std::size(kShapes)); ++s) {
          const int64_t vecs = vec_counts[(n + t) % std::size(vec_counts)];
          const int64_t numel = std::min(vecs * lanes, limit / lanes * lanes);
          // The shape rides in `blocks`: its index; threads come from kShapes at launch.
          w.calls.push_back(CallCase{t, dtype, numel, s, n % 3 == 1, 7000u * world + n});
          ++n;
        }
      }
    }
  }
  return w;
}

plan::Tactic launch_tactic(const Workload& w, const CallCase& call) {
  plan::Tactic t = w.tactics[call.tactic].tactic;
  t.blocks = kShapes[call.blocks].blocks;
  t.threads = kShapes[call.blocks].threads;
  return t;
}

struct Buffers {
  Buffers(int world, size_t bytes)
      : input(world, std::vector<uint8_t>(bytes + host_test::kGuardBytes)),
        output(world, std::vector<uint8_t>(bytes + host_test::kGuardBytes)) {}
  std::vector<std::vector<uint8_t>> input, output;
};

std::string run_workload(const Workload& w, int64_t max_numel, Placement placement,
                         const DeviceOptions& options, uint64_t initial_gen) {
  CpuDeviceGroup group(plan::make_layout(max_numel, w.world, 4), placement, initial_gen, 20.0);
  std::vector<int> ids;
  for (const TacticCase& t : w.tactics) ids.push_back(group.add_schedule(t.schedule));
  Buffers buf(w.world, static_cast<size_t>(max_numel) * 4);
  std::string failures;
  int failed_calls = 0;
  for (int i = 0; i < static_cast<int>(w.calls.size()); ++i) {
    const CallCase& call = w.calls[i];
    std::vector<const void*> inputs(w.world);
    std::vector<void*> outputs(w.world);
    for (int r = 0; r < w.world; ++r) {
      outputs[r] = host_test::prepare_call(
          call, [&](int64_t e) { return host_test::input_value(call.seed, r, e, call.dtype); },
          buf.input[r], buf.output[r]);
      inputs[r] = buf.input[r].data();
    }
    DeviceOptions call_options = options;
    call_options.seed = options.seed * 1000003u + i;
    call_options.executor_bound = kShapes[call.blocks].bound;
    const plan::Tactic tactic = launch_tactic(w, call);
    const LaunchStatus status = group.launch(ids[call.tactic], tactic, call.dtype, inputs, outputs,
                                             call.numel, call_options);
    std::string problem;
    if (status != LaunchStatus::kCompleted) {
      const auto d = group.failure();
      problem = "trapped: " + (d ? plan::describe_failure(*d, 20.0) : std::string("no record"));
    }
    const size_t bytes = static_cast<size_t>(call.numel) * plan::dtype_bytes(call.dtype);
    for (int r = 0; r < w.world && problem.empty(); ++r) {
      RankReport report{};
      host_test::check_output(w, call, r, i, static_cast<const uint8_t*>(outputs[r]), &report);
      if (report.check_failures != 0) problem = report.check_message;
      if (!host_test::guards_intact(call, buf.input[r], buf.output[r])) {
        problem = "rank " + std::to_string(r) + " wrote past the message";
      }
      if (r > 0 && std::memcmp(outputs[r], outputs[0], bytes) != 0) {
        problem = "rank " + std::to_string(r) + "'s output differs bitwise from rank 0's";
      }
    }
    if (!problem.empty()) {
      if (failed_calls++ < 5) {
        failures += host_test::describe_call(w, i) + " " + plan::tactic_label(tactic) + ": " +
                    problem + "\n";
      }
      if (status != LaunchStatus::kCompleted) break;  // the ranks are out of step now
    }
  }
  if (failed_calls > 5) failures += std::to_string(failed_calls - 5) + " more failed calls\n";
  return failures;
}

namespace {

float rounded_sum(DType dtype, const float* x, int n) {
  float acc = 0.0f;
  for (int i = 0; i < n; ++i) acc += x[i];
  return static_cast<float>(host_test::round_to(dtype, acc));
}

}  // namespace

float split_sum(DType dtype, const std::vector<float>& x, int split) {
  const int n = static_cast<int>(x.size());
  if (split == 0) return rounded_sum(dtype, x.data(), n);
  const float partials[2] = {rounded_sum(dtype, x.data(), split),
                             rounded_sum(dtype, x.data() + split, n - split)};
  return rounded_sum(dtype, partials, 2);
}

float canonical_sum(DType dtype, const std::vector<float>& by_rank,
                    const std::vector<int>& island_of) {
  std::vector<float> first;
  std::vector<float> second;
  for (int r = 0; r < static_cast<int>(by_rank.size()); ++r) {
    const bool with_rank0 = island_of.empty() || island_of[r] == island_of[0];
    (with_rank0 ? first : second).push_back(by_rank[r]);
  }
  if (first.size() != second.size() || first.size() < 2) return split_sum(dtype, by_rank, 0);
  const int split = static_cast<int>(first.size());
  first.insert(first.end(), second.begin(), second.end());
  return split_sum(dtype, first, split);
}

float wide_value(uint64_t seed, int rank, int64_t e, plan::DType dtype) {
  const uint64_t h =
      host_test::mix(seed ^ host_test::mix(static_cast<uint64_t>(rank) + 1) ^
                     host_test::mix(static_cast<uint64_t>(e) * 0x9e3779b97f4a7c15ull));
  const bool negative = (h >> 40) & 1;
  if (((h >> 44) & 15) == 0) return negative ? -0.0f : 0.0f;
  const int lo = -10;
  const int hi = dtype == plan::DType::kFP16 ? 11 : 14;
  const int exponent = lo + static_cast<int>((h >> 20) % static_cast<uint64_t>(hi - lo + 1));
  const double mantissa = 1.0 + static_cast<double>(h & 0xfffff) / 1048576.0;
  const double v = (negative ? -1.0 : 1.0) * std::ldexp(mantissa, exponent);
  return static_cast<float>(host_test::round_to(dtype, v));
}

RankValues wide_values(int world, int64_t numel, plan::DType dtype, uint64_t seed) {
  const int elem = plan::dtype_bytes(dtype);
  RankValues in;
  in.values.assign(world, std::vector<float>(numel));
  in.bytes.assign(world, std::vector<uint8_t>(numel * elem));
  for (int r = 0; r < world; ++r) {
    for (int64_t e = 0; e < numel; ++e) {
      in.values[r][e] = wide_value(seed, r, e, dtype);
      host_test::encode(dtype, in.values[r][e], &in.bytes[r][e * elem]);
    }
  }
  return in;
}

}  // namespace pcie_ar::transport::cpu_device_test
