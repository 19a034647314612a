// The boundary between the CUDA executor's host code (plain C++: kernel_workspace.cc and the
// files beside it) and its kernels (launch.cu, the only file nvcc compiles): the few host
// functions that need the kernels' symbols. What one launch carries is kernel_params.h. Compiles
// with a plain C++ compiler.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "plan/host_device.h"
#include "plan/tactic.h"
#include "transport/executors/cuda/kernel_params.h"

namespace pcie_ar::transport {

// Enqueues the executor instantiation for (p.dtype, p.direction, executor_bound(p.direction,
// p.threads)) on `stream`: capture-safe.
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

// CTAs of the instantiation a launch of `threads` threads runs that one SM keeps resident.
int executor_ctas_per_sm(plan::DType dtype, plan::Direction direction, int threads);

// Whether launches on `device` (the current device) may use programmatic dependent launch:
// compute capability 9.0 or newer, and every executor instantiation compiled for it (a kernel
// JIT-compiled from older PTX would not wait for the previous grid).
bool pdl_enabled(int device);
// Whether a workspace launches with PDL: its option asks for it (asking nothing of the device
// when not) and pdl_enabled(device).
bool use_pdl(bool requested, int device);

// P2P probe: the words rank `src` writes into rank `dst`'s slab. Every word differs per
// (nonce, src, dst, index), so a dropped, zeroed or misdirected write cannot pass.
inline constexpr int kProbeWords = 32;  // 128 bytes: one aligned line; slots are never smaller
static_assert(kProbeWords % 4 == 0, "the read probe moves 16-byte vectors");
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
// Enqueues one CTA that loads kProbeWords words at `src` (a peer's slab) with the loads the pull
// kernels use and stores them at `dst` (this GPU's memory), on the legacy stream: pull tactics
// read peer memory, and a fabric may carry writes and break reads.
cudaError_t launch_probe_read(const uint32_t* src, uint32_t* dst);

}  // namespace pcie_ar::transport
