// What one launch of the CUDA executor is made of, on the host: a workspace's fixed half (where
// the slabs are, where failures go, whether to use programmatic dependent launch) and the
// programs of one schedule, turned into the LaunchParams a kernel receives by value. Pure host
// logic apart from the PDL capability query.
//
// Programmatic dependent launch (sm_90+, unless the workspace's `pdl` option is off): the kernel
// may be scheduled while the previous kernel of the stream finishes, and waits for it on the GPU
// before it touches memory. A PDL launch the driver refuses outside capture is retried plainly
// and PDL stays off for that workspace; under capture the error propagates (turn the option off
// if a driver refuses captured PDL launches).
#pragma once

#include <array>
#include <cstdint>

#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/step.h"
#include "plan/tactic.h"
#include "transport/executors/cuda/launch.h"

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

// The parameters of one launch. `inputs`/`outputs` are indexed by rank and hold at least
// first_rank + ranks_in_launch entries.
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

}  // namespace pcie_ar::transport
