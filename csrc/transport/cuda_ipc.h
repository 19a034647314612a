// The CUDA IPC transport: executes a rank's step list (plan::Program) on the GPU over slabs that
// peers map with CUDA IPC handles.
//
// The machine it is for: GPUs that talk only over PCIe, usually through a CPU root complex and
// often across a socket link. A peer transfer is a posted write (push) or a read round trip
// (pull) of a few microseconds, so one kernel runs the whole all-reduce: a grid of `blocks`
// CTAs per rank, CTA b owning slice b of every chunk and its own flags, so CTAs never wait on
// each other inside a rank and no grid-wide barrier is needed. The generation that orders the
// calls lives in the workspace and is advanced by the kernel itself, so a launch has no host
// state and can be captured in a CUDA graph and replayed.
//
// Loopback: N virtual ranks on one GPU in one process, launched as one grid (gridDim.y = ranks),
// with peer pointers that are plain device pointers. It runs the same kernel, so every schedule
// can be checked on a single GPU; it measures protocol overhead, not PCIe.
//
// This header compiles with a plain C++ compiler (the CUDA runtime API and plan headers only).
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/schedule.h"
#include "plan/step.h"
#include "plan/tactic.h"

namespace pcie_ar::transport {

inline constexpr int kMaxThreads = 1024;  // the executor's __launch_bounds__
inline constexpr int kWarpThreads = 32;

// What the host knows about an uploaded program (the kernel reads the program itself).
struct ProgramInfo {
  int rank = -1;
  int world = 0;
  int num_chunks = 0;
  int num_steps = 0;
  bool loads_peer_slots = false;   // some kReduce reads a peer's slot (pull schedules only)
  bool stores_peer_slots = false;  // some kReduce writes a peer's slot (push schedules)
};

// Checks that every step of `program` addresses only memory the layout has: owners < world,
// slots < num_slots, flags < num_flags, chunks < num_chunks, 1..kMaxSources operands, input and
// output of the program's own rank only, and flags owned by the rank itself or by the step's
// peer (the end-of-call flag refresh relies on that). Throws std::invalid_argument naming the
// step and the bad field.
ProgramInfo inspect_program(const plan::Program& program, const plan::Layout& layout);

// Everything one launch needs, passed to the kernel by value. Arrays are indexed by rank; a
// real rank fills only its own entries of inputs/outputs/programs, loopback fills every rank.
struct LaunchParams {
  plan::Layout layout;
  uint8_t* bases[plan::kMaxWorld] = {};  // every rank's slab, as this process addresses it
  const void* inputs[plan::kMaxWorld] = {};
  void* outputs[plan::kMaxWorld] = {};
  const plan::Program* programs[plan::kMaxWorld] = {};  // device copies
  ProgramInfo infos[plan::kMaxWorld] = {};              // host facts about those programs
  plan::Diagnostic* diag = nullptr;                     // mapped host memory (device address)
  uint32_t* claim = nullptr;  // device word: the first failing CTA records, others trap
  int64_t numel = 0;
  uint64_t timeout_ns = 0;  // per wait; 0 waits forever
  uint32_t signature = 0;   // plan::call_signature(dtype, tactic)
  plan::DType dtype = plan::DType::kBF16;
  plan::Direction direction = plan::Direction::kPush;
  int blocks = 0;           // gridDim.x
  int threads = 0;          // blockDim.x
  int first_rank = 0;       // rank of blockIdx.y == 0
  int ranks_in_launch = 0;  // gridDim.y
};

// The fixed half of a workspace's launches: where the slabs are and where failures go.
struct WorkspaceView {
  plan::Layout layout;
  std::array<uint8_t*, plan::kMaxWorld> bases{};
  plan::Diagnostic* diag = nullptr;
  uint32_t* claim = nullptr;
  uint64_t timeout_ns = 0;
};

// One schedule's uploaded programs by rank (null where this process runs no such rank).
struct ProgramSet {
  std::array<const plan::Program*, plan::kMaxWorld> device{};
  std::array<ProgramInfo, plan::kMaxWorld> info{};
};

// Pure host: the parameters of one launch. `inputs`/`outputs` are indexed by rank and hold at
// least first_rank + ranks_in_launch entries. Does not validate (validate_launch() does).
LaunchParams make_launch_params(const WorkspaceView& workspace, const ProgramSet& programs,
                                plan::DType dtype, const plan::Tactic& tactic,
                                const void* const* inputs, void* const* outputs, int64_t numel,
                                uint32_t signature, int first_rank, int ranks_in_launch);

// Pure host logic. Throws std::invalid_argument saying what was wrong and what was expected.
void validate_launch(const LaunchParams& p);

// Seconds to the kernel's nanoseconds; throws std::invalid_argument if negative or not finite.
uint64_t timeout_to_ns(double timeout_s);

// Throws std::runtime_error "CUDA was requested but no CUDA device is visible (...)" when no
// GPU is usable, and std::invalid_argument when `device` is not one of the visible devices.
void require_device(int device);

// How many CTAs of each executor instantiation the GPU keeps resident at once, by thread count:
// measured at construction so that launches (possibly under graph capture) only look it up.
struct ResidencyTable {
  int ctas[3][2][kMaxThreads / kWarpThreads] = {};  // [dtype][direction][threads / 32 - 1]
  int at(plan::DType dtype, plan::Direction direction, int threads) const {
    return ctas[static_cast<int>(dtype)][static_cast<int>(direction)][threads / kWarpThreads - 1];
  }
};

// One real rank's workspace: a cudaMalloc slab exported with a CUDA IPC handle, the peers'
// slabs mapped into this process, the programs uploaded once, and a failure record in mapped
// host memory. Teardown is collective: close_peers() on every rank, a barrier, free_slab().
class CudaIpcWorkspace {
 public:
  CudaIpcWorkspace(const plan::Layout& layout, int rank, int device, uint32_t initial_gen,
                   double timeout_s);
  ~CudaIpcWorkspace();  // best-effort close_peers() + free_slab(); never throws
  CudaIpcWorkspace(const CudaIpcWorkspace&) = delete;
  CudaIpcWorkspace& operator=(const CudaIpcWorkspace&) = delete;

  std::vector<uint8_t> export_handle() const;  // cudaIpcMemHandle_t bytes of our slab
  // handles[r] is rank r's export_handle(); ours is ignored. Maps every peer's slab.
  void open_peers(const std::vector<std::vector<uint8_t>>& handles);
  void close_peers();  // collective teardown step 1: peers unmap before owners free
  void free_slab();    // step 2, after a barrier; idempotent

  // Uploads once (construction time, never on the hot path); returns an id for launch().
  int add_program(const plan::Program& program);

  // Enqueues one all-reduce on `stream`: no host sync, no allocation, no per-call host state
  // (safe under CUDA-graph capture). Throws std::invalid_argument for a bad call.
  void launch(int program_id, plan::DType dtype, const plan::Tactic& tactic, const void* input,
              void* output, int64_t numel, uint32_t signature, cudaStream_t stream);

  // The record a failed kernel left in mapped host memory; nullopt if none.
  std::optional<plan::Diagnostic> failure() const;

  // P2P write-and-verify, because drivers report P2P that does not work (zeroed buffers,
  // silent corruption under IOMMU/ACS). Collective, before the first launch: every rank runs
  // probe_write() (a kernel stores a pattern into each peer's slab with ordinary peer
  // stores), then a barrier, then probe_read(), which returns the ranks whose pattern did not
  // arrive intact in this rank's slab.
  void probe_write(uint32_t nonce);
  std::vector<int> probe_read(uint32_t nonce) const;

  const plan::Layout& layout() const { return view_.layout; }
  int rank() const { return rank_; }
  int device() const { return device_; }
  uint64_t bytes() const { return view_.layout.total_bytes; }

 private:
  WorkspaceView view_;
  int rank_ = 0;
  int device_ = 0;
  ResidencyTable residency_;
  bool peers_open_ = false;
  uint8_t* slab_ = nullptr;
  std::array<uint8_t*, plan::kMaxWorld> opened_{};  // peers' slabs we mapped
  plan::Diagnostic* diag_host_ = nullptr;
  std::vector<ProgramSet> programs_;
};

// N virtual ranks on one GPU in one process (tests and the device check program).
class CudaLoopback {
 public:
  CudaLoopback(const plan::Layout& layout, int device, uint32_t initial_gen, double timeout_s);
  ~CudaLoopback();
  CudaLoopback(const CudaLoopback&) = delete;
  CudaLoopback& operator=(const CudaLoopback&) = delete;

  // Uploads the schedule's programs for every rank; returns an id.
  int add_schedule(const plan::Schedule& schedule);

  // Launches ranks [first_rank, first_rank + count) in ONE kernel (gridDim.y = count); count
  // -1 means the rest. count < world withholds ranks (the timeout test). inputs/outputs are
  // indexed by rank (size world; withheld ranks' entries are ignored). All CTAs of the launch
  // wait on each other, so they must be resident at once: throws std::runtime_error otherwise.
  void launch(int schedule_id, plan::DType dtype, const plan::Tactic& tactic,
              const std::vector<const void*>& inputs, const std::vector<void*>& outputs,
              int64_t numel, uint32_t signature, cudaStream_t stream, int first_rank = 0,
              int count = -1);

  // The most CTAs of this kernel the GPU keeps resident at once (blocks × ranks must fit).
  int max_resident_blocks(plan::DType dtype, plan::Direction direction, int threads) const;

  std::optional<plan::Diagnostic> failure() const;
  const plan::Layout& layout() const { return view_.layout; }

 private:
  struct Uploaded {
    plan::Schedule schedule;
    ProgramSet programs;
  };
  WorkspaceView view_;
  int device_ = 0;
  ResidencyTable residency_;
  std::array<uint8_t*, plan::kMaxWorld> slabs_{};
  plan::Diagnostic* diag_host_ = nullptr;
  std::vector<Uploaded> schedules_;
};

}  // namespace pcie_ar::transport
