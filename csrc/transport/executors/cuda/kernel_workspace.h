// The CUDA executor as a workspace: a rank's step lists run by one kernel on the GPU, over memory
// its subclass owns (cuda_ipc: a cudaMalloc slab mapped by peers over CUDA IPC; cuda_host: shared
// pinned host memory).
//
// The machine it is for: GPUs that talk only over PCIe, usually through a CPU root complex and
// often across a socket link. A peer transfer is a posted write (push) or a read round trip
// (pull) of a few microseconds, so one kernel runs the whole all-reduce: a grid of `blocks`
// CTAs per rank, CTA b owning slice b of every chunk and its own flags, so CTAs never wait on
// each other inside a rank and no grid-wide barrier is needed. The generation that orders the
// calls lives in the workspace and is advanced by the kernel itself, so a launch has no host
// state and can be captured in a CUDA graph and replayed. Calls on different streams are ordered
// by StreamOrder (stream_order.h); launches may use programmatic dependent launch
// (kernel_params.h).
//
// Host code only (plain C++ and the CUDA runtime API); the kernels are launch.cu.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/step.h"
#include "plan/tactic.h"
#include "transport/executors/cuda/kernel_params.h"
#include "transport/executors/cuda/launch.h"
#include "transport/executors/cuda/residency.h"
#include "transport/executors/cuda/stream_order.h"
#include "transport/workspace.h"

namespace pcie_ar::transport {

// What both CUDA transports share: the programs uploaded once, the launches, the failure record
// in mapped host memory, the residency limits and the write-and-verify probe. A subclass owns the
// memory: it fills view_.bases (its own slab and, in open_peers(), the peers') and, when its slab
// is far from the GPU, view_.counters[rank].
class CudaKernelWorkspace : public Workspace {
 public:
  ~CudaKernelWorkspace() override;  // frees what the base allocated; never throws

  int device() const override { return device_; }
  // add_program() refuses two-destination steps: the reduce loop sits at the register budget,
  // and a second store pointer spills at eight operands (cuda_executor_no_spills).
  bool runs_multi_destination_steps() const override { return false; }

  // A kernel stores a pattern into each peer's slab with ordinary stores (the path the
  // all-reduce kernels use) and our own pattern into our own slab; probe_read() checks what
  // arrived in our slab, then has a kernel load each peer's own pattern out of the peer's slab
  // with the pull kernels' loads: a peer fails if either direction did not arrive intact.
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
  // Where the P2P probe's words from `writer` live in `owner`'s slab (writer's slot, parity 0).
  uint32_t* probe_words(int owner, int writer) const;
  std::optional<std::string> transport_limits(const plan::Tactic& tactic) const override;
  // Frees the uploaded programs and the claim word; appends what failed to `errors`.
  void release_kernel_state(std::string& errors);

  int device_ = 0;
  ResidencyTable residency_;
  plan::Diagnostic* diag_host_ = nullptr;
  std::vector<ProgramSet> programs_;
  StreamOrder order_;
};

}  // namespace pcie_ar::transport
