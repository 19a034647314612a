// The boundary between the CUDA executor's host code (plain C++: kernel_workspace.cc and the
// files beside it) and its kernels (launch.cu, the only file nvcc compiles): what one launch
// carries, and the few host functions that need the kernels' symbols. Compiles with a plain C++
// compiler.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "plan/host_device.h"
#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/step.h"
#include "plan/tactic.h"

namespace pcie_ar::transport {

inline constexpr int kMaxThreads = 1024;  // the executor's __launch_bounds__
inline constexpr int kWarpThreads = 32;

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
};

// Enqueues the executor instantiation for (p.dtype, p.direction) on `stream`: capture-safe.
// With p.pdl it launches with programmatic stream serialization. Returns false when that PDL
// launch was refused outside stream capture and the same launch went out without PDL (the
// caller should stop asking for PDL); true otherwise. Throws std::runtime_error naming the
// launch shape if the launch fails (under capture a refused PDL launch is not retried: the
// capture is already invalid).
[[nodiscard]] bool launch_executor(const LaunchParams& p, cudaStream_t stream);

// True when every executor instantiation, as the CUDA runtime will load it on the current
// device, was compiled for sm_90+ and so waits for the previous grid (griddepcontrol.wait): a
// kernel JIT-compiled from older PTX would not, and must never be launched with PDL.
bool executor_waits_for_previous_grid();

// CTAs of that instantiation one SM keeps resident with `threads` threads each.
int executor_ctas_per_sm(plan::DType dtype, plan::Direction direction, int threads);

// P2P probe: the words rank `src` writes into rank `dst`'s slab. Every word differs per
// (nonce, src, dst, index), so a dropped, zeroed or misdirected write cannot pass.
inline constexpr int kProbeWords = 32;  // 128 bytes: one aligned line; slots are never smaller
PCIE_AR_HD uint32_t probe_word(uint32_t nonce, int src, int dst, int i) {
  uint32_t x = nonce ^ (static_cast<uint32_t>(src) * 0x9E3779B1u) ^
               (static_cast<uint32_t>(dst) * 0x85EBCA77u) ^
               (static_cast<uint32_t>(i) * 0xC2B2AE3Du);
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// Enqueues kProbeWords ordinary SM stores of probe_word(nonce, src, dst_rank, i) at `dst` (a
// peer's slab: the path the all-reduce kernels use) on the legacy stream.
cudaError_t launch_probe(uint32_t* dst, uint32_t nonce, int src, int dst_rank);

}  // namespace pcie_ar::transport
