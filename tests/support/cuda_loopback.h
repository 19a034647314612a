// Test support: N virtual ranks of the CUDA executor on one GPU in one process, launched as one
// grid (gridDim.y = ranks), with peer pointers that are plain device pointers. It runs the same
// kernel as the CUDA transports, so every schedule can be checked on a single GPU
// (tests/gpu/loopback_check.cu, the device check); it measures protocol overhead, not PCIe.
// Built into pcie_test_support, never into the extension module.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/schedule.h"
#include "plan/tactic.h"
#include "transport/executors/cuda/kernel_params.h"
#include "transport/executors/cuda/launch.h"
#include "transport/executors/cuda/residency.h"
#include "transport/executors/cuda/stream_order.h"

namespace pcie_ar::transport {

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
  // `epilogue`, one per rank, for a schedule with the fused epilogue (plan::with_epilogue).
  // Each virtual rank's calls are ordered across streams like a real rank's; launches of
  // disjoint ranks on different streams run concurrently (the failure tests rely on it).
  void launch(int schedule_id, plan::DType dtype, const plan::Tactic& tactic,
              const std::vector<const void*>& inputs, const std::vector<void*>& outputs,
              int64_t numel, uint32_t signature, cudaStream_t stream, int first_rank = 0,
              int count = -1, const std::vector<plan::EpilogueArgs>* epilogue = nullptr);

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
