// What one launch of the CUDA executor carries, on every machine that runs it (a GPU:
// launch.cu; the CPU device: cpu/launch.cc), and how a workspace's fixed half and the programs
// of one schedule become it. Plain C++: no CUDA headers.
#pragma once

#include <array>
#include <cstdint>

#include "plan/epilogue.h"
#include "plan/host_device.h"
#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/step.h"
#include "plan/tactic.h"

namespace pcie_ar::transport {

inline constexpr int kMaxThreads = 1024;  // the large-message executor's __launch_bounds__
inline constexpr int kWarpThreads = 32;

// The decode-shaped executor: push launches of at most kDecodeThreads threads per CTA (every
// decode-size tactic: the seed's LL and lamport rows are 8 x 256) run an instantiation compiled
// __launch_bounds__(kDecodeThreads, kDecodeMinCtasPerSm), which leaves each thread 65536 /
// (256 x 2) = 128 registers where the large-message one's 1024 threads leave 64: room for every
// LL or lamport operand of a reduce in one look (primitives_gpu.cuh, kLLGroup). Two CTAs per SM
// keep a world-8 loopback's 64 decode CTAs resident on any GPU with 32 SMs. Pull programs carry
// no LL code: they keep one instantiation.
inline constexpr int kDecodeThreads = 256;
inline constexpr int kDecodeMinCtasPerSm = 2;

// The __launch_bounds__ of the instantiation a launch of `threads` threads per CTA runs: the
// decode-shaped one (kDecodeThreads) or the large-message one (kMaxThreads). Every rank of a
// call launches the same tactic, so every rank runs the same instantiation.
PCIE_AR_HD constexpr int executor_bound(plan::Direction direction, int threads) {
  return direction == plan::Direction::kPush && threads <= kDecodeThreads ? kDecodeThreads
                                                                          : kMaxThreads;
}

// The splits (plan::Step::split) of a reduce of num_srcs operands that the executor runs: none,
// or the canonical tree's two equal groups, the only ones the builders emit (executor.cuh says
// why no other is compiled). A pair split 1 | 1 is the same bits as no split.
PCIE_AR_HD constexpr bool executor_runs_split(int num_srcs, int split) {
  return split == 0 || (num_srcs % 2 == 0 && 2 * split == num_srcs);
}

// One rank's tensors of the fused epilogue: plan::EpilogueArgs less the form every rank shares.
struct EpilogueTensors {
  const void* residual = nullptr;  // null: no add; residual_out is then the output (the sum)
  void* residual_out = nullptr;
  const void* weight = nullptr;
  void* y = nullptr;  // null: y is never stored (only y_q is asked for)
  void* y_q = nullptr;
  const float* scale = nullptr;  // quant != kNone: one fp32, read once per CTA
  // kNvfp4: the whole tensor's block scales (plan::EpilogueArgs; where this call's rows lie in
  // it is the same on every rank: LaunchParams::first_row).
  uint8_t* block_scale = nullptr;
};

// Everything one launch needs, passed to the kernel by value. Arrays are indexed by rank; a
// real rank fills only its own entries of inputs/outputs/programs, loopback fills every rank.
// Programs passed plan::check_program() when they were uploaded; the kernel trusts them.
struct LaunchParams {
  plan::Layout layout;
  uint8_t* bases[plan::kMaxWorld] = {};  // every rank's slab, as this process addresses it
  // Where each launched rank's generation counters are (plan::Layout::gen_counter_offset from
  // here): its own slab, or device memory when the slab is far away (host memory), since only
  // the rank itself ever reads them and a read of host memory is a PCIe round trip per call.
  uint8_t* counters[plan::kMaxWorld] = {};
  const void* inputs[plan::kMaxWorld] = {};
  void* outputs[plan::kMaxWorld] = {};
  const plan::Program* programs[plan::kMaxWorld] = {};  // device copies
  plan::Diagnostic* diag = nullptr;                     // mapped host memory (device address)
  uint32_t* claim = nullptr;  // device word: the first failing CTA records, others trap
  int64_t numel = 0;
  // transport::Call::chunk_stride in 16-byte vectors: chunk c of the message lies
  // c * chunk_stride_vecs vectors from inputs[r] / outputs[r] (plan::chunk_shift, once per step);
  // 0: the message's own chunking. Slots are never shifted.
  int64_t chunk_stride_vecs = 0;
  uint64_t timeout_ns = 0;  // per wait; 0 waits forever
  uint32_t signature = 0;   // plan::call_signature(dtype, tactic)
  plan::DType dtype = plan::DType::kBF16;
  plan::Direction direction = plan::Direction::kPush;  // the programs' direction
  int blocks = 0;                                      // gridDim.x
  int threads = 0;                                     // blockDim.x
  int first_rank = 0;                                  // rank of blockIdx.y == 0
  int ranks_in_launch = 0;                             // gridDim.y
  // Programmatic dependent launch (sm_90+): the kernel may start while the previous kernel of
  // the stream finishes; it waits for it (griddepcontrol.wait) before touching memory.
  bool pdl = false;
  // Some rank's slots are in host memory (cuda_host, or a loopback slab placed there): push
  // reads of slots must not trust L2 (see run_reduce in executor.cuh).
  bool slots_in_host_memory = false;
  // The fused epilogue (plan/epilogue.h), read only by a program that ends with one: the tensors
  // per rank like inputs/outputs, the form shared by every launched rank; hidden 0 otherwise.
  EpilogueTensors epilogue[plan::kMaxWorld] = {};
  int64_t hidden = 0;
  float eps = 0.0f;
  float weight_offset = 0.0f;
  plan::Quant quant = plan::Quant::kNone;
  // kNvfp4: this call's rows are rows first_row.. of a tensor of total_rows (plan::EpilogueArgs).
  int64_t first_row = 0;
  int64_t total_rows = 0;
};
// Passed by value as a __grid_constant__ kernel parameter: within the 4 KiB every CUDA
// toolkit and architecture accepts.
static_assert(sizeof(LaunchParams) <= 4096, "the kernel's parameters exceed 4 KiB");

// The fixed half of a workspace's launches: where the slabs are and where failures go.
struct WorkspaceView {
  plan::Layout layout;
  std::array<uint8_t*, plan::kMaxWorld> bases{};
  // Where each rank's generation counters live when not in its slab (LaunchParams::counters);
  // null: the slab.
  std::array<uint8_t*, plan::kMaxWorld> counters{};
  plan::Diagnostic* diag = nullptr;
  uint32_t* claim = nullptr;
  uint64_t timeout_ns = 0;
  bool pdl = false;                   // launch with programmatic dependent launch (use_pdl())
  bool slots_in_host_memory = false;  // any rank's slab is host memory (LaunchParams)
};

// One schedule's uploaded programs by rank (null where this process runs no such rank).
struct ProgramSet {
  std::array<const plan::Program*, plan::kMaxWorld> device{};
  plan::Direction direction = plan::Direction::kPush;  // every rank's program has it
};

// The parameters of one launch. `inputs`/`outputs` are indexed by rank and hold at least
// first_rank + ranks_in_launch entries. `chunk_stride`: transport::Call::chunk_stride, in
// elements (0, or a whole number of vectors), the same for every launched rank.
LaunchParams make_launch_params(const WorkspaceView& workspace, const ProgramSet& programs,
                                plan::DType dtype, int blocks, int threads,
                                const void* const* inputs, void* const* outputs, int64_t numel,
                                uint32_t signature, int first_rank, int ranks_in_launch,
                                int64_t chunk_stride = 0);

// Gives rank `rank` of the launch the fused epilogue's tensors and the call's form (every
// launched rank the same hidden, eps, weight_offset and quant).
void set_epilogue(LaunchParams& p, int rank, const plan::EpilogueArgs& args);

// Seconds to the kernel's nanoseconds; throws std::invalid_argument if negative or not finite.
uint64_t timeout_to_ns(double timeout_s);

}  // namespace pcie_ar::transport
