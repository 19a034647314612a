// Reduce-scatter and all-gather (plan::Collective) run by the CUDA executor's own source on the
// CPU device: every buildable tactic x dtype, flat at world 2 and 3 and two islands of two at
// world 4, in the strict and weak memory models and both placements, two calls in a row (both
// parities). The one-chunk tensors (the reduce-scatter's output, the all-gather's input) are
// addressed as the Communicator addresses them, from `rank` chunks below the tensor, and sit
// between guard bytes that no launch may touch. The reduce-scatter must give, bit for bit, the
// group's one expression (host_test_util.h: island partials rounded first where the group has two
// equal islands, whatever the tactic); the all-gather every rank's bits, -0 included.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../transport/host_test_util.h"
#include "cpu_device_group.h"
#include "plan/layout.h"
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
using plan::Collective;
using plan::DType;

constexpr uint8_t kGuard = 0xA5;

// A one-chunk tensor with a chunk of guard bytes on each side.
struct Guarded {
  explicit Guarded(size_t chunk_bytes) : bytes(chunk_bytes), buffer(3 * chunk_bytes, kGuard) {}
  uint8_t* data() { return buffer.data() + bytes; }
  bool guards_intact() const {
    for (size_t i = 0; i < bytes; ++i) {
      if (buffer[i] != kGuard || buffer[2 * bytes + i] != kGuard) return false;
    }
    return true;
  }
  size_t bytes;
  std::vector<uint8_t> buffer;
};

// The address the executors take for a one-chunk tensor of rank r: chunk 0 of the message.
template <typename T>
T* from_chunk_zero(T* tensor, int rank, size_t chunk_bytes) {
  return reinterpret_cast<T*>(reinterpret_cast<uintptr_t>(tensor) - rank * chunk_bytes);
}

struct GroupCase {
  int world;
  std::vector<int> island_of;
};

int run_collective_matrix(const GroupCase& g, Collective collective) {
  const int world = g.world;
  // 9 vectors per chunk: two blocks split it unevenly.
  constexpr int64_t kChunkVecs = 9;
  const plan::Layout layout = plan::make_layout(world * kChunkVecs * 4, world, 4, 2);
  int checked = 0;
  for (const Placement placement : {Placement::kDevice, Placement::kHost}) {
    CpuDeviceGroup group(layout, placement, 0, 5.0);
    for (const plan::Tactic& built : plan::buildable_tactics(world, g.island_of, collective)) {
      const plan::Schedule schedule =
          plan::build_schedule(built.algorithm, built.direction, built.staged, world, g.island_of,
                               built.protocol, collective);
      const int id = group.add_schedule(schedule);
      plan::Tactic tactic = built;
      tactic.blocks = 2;
      tactic.threads = 32;
      for (DType dtype : plan::kAllDTypes) {
        const int elem = plan::dtype_bytes(dtype);
        const int64_t chunk = kChunkVecs * plan::kVectorBytes / elem;
        const int64_t numel = world * chunk;
        const size_t chunk_bytes = static_cast<size_t>(chunk) * elem;
        const uint32_t signature = plan::call_signature(dtype, tactic, false, collective);
        for (int call = 0; call < 2; ++call) {
          const MemoryModel memory = call == 0 ? MemoryModel::kWeak : MemoryModel::kStrict;
          const uint64_t seed = 977 * checked + 13;
          const std::string what =
              std::string(plan::collective_name(collective)) + " " + plan::tactic_label(tactic) +
              " " + std::string(plan::dtype_name(dtype)) + " call " + std::to_string(call) +
              (placement == Placement::kHost ? " host" : " device");
          std::vector<std::vector<uint8_t>> whole(world);           // RS inputs / AG outputs
          std::vector<Guarded> piece(world, Guarded(chunk_bytes));  // RS outputs / AG inputs
          std::vector<const void*> inputs;
          std::vector<void*> outputs;
          for (int r = 0; r < world; ++r) {
            whole[r].assign(numel * elem, 0x5A);
            if (collective == Collective::kReduceScatter) {
              for (int64_t e = 0; e < numel; ++e) {
                host_test::encode(dtype, host_test::input_value(seed, r, e, dtype),
                                  &whole[r][e * elem]);
              }
              inputs.push_back(whole[r].data());
              outputs.push_back(from_chunk_zero(piece[r].data(), r, chunk_bytes));
            } else {
              // Raw bits, NaN payloads and all: an all-gather moves them untouched.
              for (size_t b = 0; b < chunk_bytes; ++b) {
                piece[r].data()[b] = static_cast<uint8_t>(host_test::mix(seed + r * 7919 + b));
              }
              // And -0, which the lamport protocol cannot carry (it is the empty word's half).
              for (int64_t e : {int64_t{0}, int64_t{3}, chunk - 1}) {
                host_test::encode(dtype, -0.0f, piece[r].data() + e * elem);
              }
              inputs.push_back(from_chunk_zero(piece[r].data(), r, chunk_bytes));
              outputs.push_back(whole[r].data());
            }
          }
          EXPECT_EQ(group.launch(id, tactic, dtype, inputs, outputs, numel,
                                 DeviceOptions{memory, seed}, 0, -1, signature),
                    LaunchStatus::kCompleted)
              << what;
          for (int r = 0; r < world; ++r) {
            EXPECT_TRUE(piece[r].guards_intact()) << what << ": rank " << r << " wrote outside";
            if (collective == Collective::kReduceScatter) {
              for (int64_t e = 0; e < chunk; ++e) {
                const int64_t index = r * chunk + e;
                const host_test::Expected want =
                    host_test::expected_element(seed, world, g.island_of, index, dtype);
                std::vector<uint8_t> bits(elem);
                host_test::encode(dtype, want.value, bits.data());
                const bool same = std::memcmp(piece[r].data() + e * elem, bits.data(), elem) == 0;
                EXPECT_TRUE(same) << what << " rank " << r << " element " << e;
                if (!same) return checked;
              }
            } else {
              for (int q = 0; q < world; ++q) {
                const bool same = std::memcmp(whole[r].data() + q * chunk_bytes, piece[q].data(),
                                              chunk_bytes) == 0;
                EXPECT_TRUE(same) << what << " rank " << r << " chunk " << q;
                if (!same) return checked;
              }
            }
          }
          ++checked;
        }
      }
    }
  }
  return checked;
}

TEST(CpuDeviceCollectives, ReduceScatterFlatWorldTwoAndThree) {
  EXPECT_GT(run_collective_matrix({2, {}}, Collective::kReduceScatter), 30);
  EXPECT_GT(run_collective_matrix({3, {}}, Collective::kReduceScatter), 30);
}

TEST(CpuDeviceCollectives, ReduceScatterTwoIslandsOfTwo) {
  EXPECT_GT(run_collective_matrix({4, host_test::halves(4)}, Collective::kReduceScatter), 60);
}

TEST(CpuDeviceCollectives, AllGatherFlatWorldTwoAndThree) {
  EXPECT_GT(run_collective_matrix({2, {}}, Collective::kAllGather), 30);
  EXPECT_GT(run_collective_matrix({3, {}}, Collective::kAllGather), 30);
}

TEST(CpuDeviceCollectives, AllGatherTwoIslandsOfTwo) {
  EXPECT_GT(run_collective_matrix({4, host_test::halves(4)}, Collective::kAllGather), 60);
}

}  // namespace
}  // namespace pcie_ar::transport
