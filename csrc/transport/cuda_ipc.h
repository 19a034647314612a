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
// Calls of one rank are ordered by the stream they are enqueued on; two calls running at once
// would read the same generation. So when a call arrives on a different stream than the last
// eager call, run() makes the new stream wait for everything enqueued on the previous one (an
// event, recorded at the switch). Under CUDA-graph capture nothing is ordered: the stream a
// graph is replayed on, and what else runs beside it, are the caller's responsibility, exactly
// as for any captured kernel. The previous stream must still exist when the switch happens.
//
// Programmatic dependent launch (sm_90+, unless the workspace's `pdl` option is off): the
// kernel may be scheduled while the previous kernel of the stream finishes, and waits for it on
// the GPU before it touches memory. A PDL launch the driver refuses outside capture is retried
// plainly and PDL stays off for that workspace; under capture the error propagates (turn the
// option off if a driver refuses captured PDL launches).
//
// Loopback: N virtual ranks on one GPU in one process, launched as one grid (gridDim.y = ranks),
// with peer pointers that are plain device pointers. It runs the same kernel, so every schedule
// can be checked on a single GPU; it measures protocol overhead, not PCIe.
//
// Host code only (plain C++ and the CUDA runtime API); the kernels are kernels/launch.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/schedule.h"
#include "plan/step.h"
#include "plan/tactic.h"
#include "transport/kernels/launch.h"
#include "transport/workspace.h"

namespace pcie_ar::transport {

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

// Pure host: the parameters of one launch. `inputs`/`outputs` are indexed by rank and hold at
// least first_rank + ranks_in_launch entries.
LaunchParams make_launch_params(const WorkspaceView& workspace, const ProgramSet& programs,
                                plan::DType dtype, int blocks, int threads,
                                const void* const* inputs, void* const* outputs, int64_t numel,
                                uint32_t signature, int first_rank, int ranks_in_launch);

// Seconds to the kernel's nanoseconds; throws std::invalid_argument if negative or not finite.
uint64_t timeout_to_ns(double timeout_s);

// Whether launches on `device` (the current device) may use programmatic dependent launch:
// compute capability 9.0 or newer, and every executor instantiation compiled for it (a kernel
// JIT-compiled from older PTX would not wait for the previous grid).
bool pdl_enabled(int device);
// Whether a workspace launches with PDL: its option asks for it (asking nothing of the device
// when not) and pdl_enabled(device).
bool use_pdl(bool requested, int device);

// Orders one rank's eager calls across streams (see the top of this file). Not thread-safe,
// like the workspace that owns it.
class StreamOrder {
 public:
  StreamOrder() = default;
  ~StreamOrder();
  StreamOrder(const StreamOrder&) = delete;
  StreamOrder& operator=(const StreamOrder&) = delete;

  // Before a call is enqueued on `stream` (the owner's device current): if the last eager call
  // went to another stream, `stream` waits for it. Nothing happens on the same stream, and
  // nothing while either stream is capturing.
  void before_call(cudaStream_t stream);

 private:
  cudaStream_t last_ = nullptr;
  bool have_last_ = false;
  cudaEvent_t event_ = nullptr;
};

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

// Why the kernels cannot run `tactic` on a GPU with `residency`, or nullopt: threads must be
// whole warps in 32..1024, and `ctas` CTAs of every instantiation must be resident at once
// (peers' CTA b waits for ours, so a CTA that never becomes resident would stall them).
std::optional<std::string> why_kernels_cannot_run(const plan::Tactic& tactic, int ctas,
                                                  const ResidencyTable& residency);

// What both CUDA transports share: the programs uploaded once, the launches, the failure record
// in mapped host memory, the residency limits and the write-and-verify probe. A subclass owns the
// memory: it fills view_.bases (its own slab and, in open_peers(), the peers') and, when its slab
// is far from the GPU, view_.counters[rank].
class CudaKernelWorkspace : public Workspace {
 public:
  ~CudaKernelWorkspace() override;  // frees what the base allocated; never throws

  int device() const override { return device_; }

  // A kernel stores a pattern into each peer's slab with ordinary stores (the path the
  // all-reduce kernels use); probe_read() checks what arrived in our own slab.
  void probe_write(uint32_t nonce) override;
  std::vector<int> probe_read(uint32_t nonce) const override;

  // Enqueues one all-reduce on call.stream: no host sync, no allocation (safe under CUDA-graph
  // capture). A call on another stream than the last eager one is ordered after it.
  void run(const Call& call) override;
  // The record a failed kernel left in mapped host memory; nullopt if none.
  std::optional<plan::Diagnostic> failure() const override;

  // Frees the uploaded programs, the claim word and the subclass's memory (release_memory());
  // idempotent. Throws listing what could not be freed, after freeing the rest.
  void release() final;

 protected:
  // Checks the device and the rank, allocates the failure record and claim word, measures the
  // residency table; `pdl`: programmatic dependent launch where the GPU allows it (use_pdl()).
  // Throws like require_device().
  CudaKernelWorkspace(const plan::Layout& layout, int rank, int device, double timeout_s, bool pdl);
  // The subclass's half of release(): frees its own slab (the device is current); appends what
  // failed to `errors`. Idempotent.
  virtual void release_memory(std::string& errors) = 0;
  // Best-effort close_peers() and release() for a subclass's destructor (the base destructor
  // cannot reach the subclass's overrides). Never throws.
  void teardown() noexcept;

  WorkspaceView view_;
  bool peers_open_ = false;

 private:
  int install(const plan::Program& program) override;
  std::optional<std::string> transport_limits(const plan::Tactic& tactic) const override;
  // Frees the uploaded programs and the claim word; appends what failed to `errors`.
  void release_kernel_state(std::string& errors);

  int device_ = 0;
  ResidencyTable residency_;
  plan::Diagnostic* diag_host_ = nullptr;
  std::vector<ProgramSet> programs_;
  StreamOrder order_;
};

// One real rank's workspace: a cudaMalloc slab exported with a CUDA IPC handle and the peers'
// slabs mapped into this process (needs working P2P between every pair). Teardown is
// collective: close_peers() on every rank, a barrier, release().
class CudaIpcWorkspace final : public CudaKernelWorkspace {
 public:
  CudaIpcWorkspace(const plan::Layout& layout, int rank, int device, uint64_t initial_gen,
                   double timeout_s, bool pdl);
  ~CudaIpcWorkspace() override;  // best-effort close_peers() + release(); never throws

  std::string local_token() const override;  // cudaIpcMemHandle_t bytes of our slab
  // tokens[r] is rank r's local_token(); ours is ignored. Maps every peer's slab.
  void open_peers(const std::vector<std::string>& tokens) override;

  void close_peers() override;  // peers unmap before owners free

 private:
  void release_memory(std::string& errors) override;  // the slab

  uint8_t* slab_ = nullptr;
  std::array<uint8_t*, plan::kMaxWorld> opened_{};  // peers' slabs we mapped
};

// N virtual ranks on one GPU in one process (tests and the device check program).
class CudaLoopback {
 public:
  // `pdl`: programmatic dependent launch where the GPU allows it (use_pdl()).
  CudaLoopback(const plan::Layout& layout, int device, uint64_t initial_gen, double timeout_s,
               bool pdl);
  ~CudaLoopback();
  CudaLoopback(const CudaLoopback&) = delete;
  CudaLoopback& operator=(const CudaLoopback&) = delete;

  // Checks (plan::check_program) and uploads the schedule's programs for every rank; returns
  // an id.
  int add_schedule(const plan::Schedule& schedule);

  // Launches ranks [first_rank, first_rank + count) in ONE kernel (gridDim.y = count); count
  // -1 means the rest. count < world withholds ranks (the timeout test). inputs/outputs are
  // indexed by rank (size world; withheld ranks' entries are ignored). All CTAs of the launch
  // wait on each other, so they must be resident at once: throws std::runtime_error otherwise.
  // The call itself must meet Call's contract (transport/workspace.h); it is not re-checked.
  // Each virtual rank's calls are ordered across streams like a real rank's; launches of
  // disjoint ranks on different streams run concurrently (the failure tests rely on it).
  void launch(int schedule_id, plan::DType dtype, const plan::Tactic& tactic,
              const std::vector<const void*>& inputs, const std::vector<void*>& outputs,
              int64_t numel, uint32_t signature, cudaStream_t stream, int first_rank = 0,
              int count = -1);

  // The most CTAs of this kernel the GPU keeps resident at once (blocks × ranks must fit).
  int max_resident_blocks(plan::DType dtype, plan::Direction direction, int threads) const;

  // Puts every virtual rank's workspace where the cuda_host transport puts a real rank's: the
  // slab in mapped pinned host memory (owned here), the generation counters in device memory.
  // Every flag, LL word and data slot then crosses PCIe: what GPUs without P2P pay. Call it
  // before the first launch.
  void use_host_memory();

  // Whether launches use programmatic dependent launch (use_pdl(), and no refusal yet).
  bool pdl() const { return view_.pdl; }

  // Replaces virtual rank `rank`'s slab with `slab` (device-addressable, layout.total_bytes,
  // e.g. mapped pinned host memory so that its flags and data cross PCIe) and initialises it
  // at `initial_gen`. The caller keeps ownership and frees it after this object. Every rank's
  // generation must agree: call it before the first launch, with the constructor's value.
  // External slabs are taken to be host memory: push reads of slots then bypass L2.
  void use_external_slab(int rank, uint8_t* slab, uint64_t initial_gen);

  std::optional<plan::Diagnostic> failure() const;
  const plan::Layout& layout() const { return view_.layout; }

 private:
  struct Uploaded {
    plan::Schedule schedule;
    ProgramSet programs;
  };
  // Frees virtual rank `rank`'s slab as its kind says, and its device counters.
  void free_slab(int rank) noexcept;
  void check_launch_args(const Uploaded& up, const plan::Tactic& tactic, size_t inputs,
                         size_t outputs, int first_rank, int count) const;

  WorkspaceView view_;
  int device_ = 0;
  uint64_t initial_gen_ = 0;
  ResidencyTable residency_;
  std::array<uint8_t*, plan::kMaxWorld> slabs_{};
  // Who owns slabs_[r], and so how it is freed. view_.counters[r] (use_host_memory()) is ours.
  enum class SlabKind : uint8_t { kDevice, kCaller, kPinned };
  std::array<SlabKind, plan::kMaxWorld> slab_kind_{};
  plan::Diagnostic* diag_host_ = nullptr;
  std::vector<Uploaded> schedules_;
  std::array<StreamOrder, plan::kMaxWorld> order_;  // per virtual rank
};

}  // namespace pcie_ar::transport
