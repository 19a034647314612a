// The CPU device: the execution model that lets the CUDA executor's own source run on the CPU,
// in the spirit of Triton's interpreter and Numba's CUDA simulator, so that every CI run executes
// the kernel the GPUs run.
//
//   grid   every CTA of a launch is its own OS thread, so CTAs (and the ranks of a loopback
//          launch, and ranks in other processes) really race
//   CTA    its threads are cooperative fibers on that OS thread: a fiber runs until it polls
//          (poll(): one iteration of a spin loop), reaches a barrier (sync_threads()), traps or
//          ends, so __syncthreads may sit anywhere and a spin loop never starves the thread it
//          waits for. `__shared__` memory is the OS thread's (thread_local).
//   memory what a store does before other threads see it is the memory model's
//          (cpu/memory.h): at once (strict), or late, out of order and split (weak).
//
// Launches are synchronous: launch() returns when every thread of the grid has ended, or when
// one trapped (every other CTA then stops at its next poll or barrier, as a trapped GPU context
// kills the grid). What only a GPU shows (L1/L2 behaviour, PCIe ordering of posted writes,
// timing) is not modelled.
#pragma once

#include <cstdint>
#include <functional>

namespace pcie_ar::transport::cpu_device {

struct Dim3 {
  unsigned int x = 1;
  unsigned int y = 1;
  unsigned int z = 1;
};

// How a store that the PTX memory model does not order reaches memory.
enum class MemoryModel : uint8_t {
  kStrict = 0,  // at once, in program order
  // Buffered per thread and delivered late and out of order, in 8-byte pieces (the single-copy
  // atomicity NCCL's LL and ours rely on). A release or a system fence first delivers everything
  // the thread (after a barrier: its whole CTA) stored before it.
  kWeak = 1,
  // kWeak in 4-byte pieces: breaks the atomicity LL needs. A negative control only: the LL path
  // must then fail a test, never pass one.
  kWeakTear4 = 2,
};

struct DeviceOptions {
  MemoryModel memory = MemoryModel::kStrict;
  uint64_t seed = 1;  // the weak modes' delivery order; every CTA derives its own stream
  // How long a system fence takes (microseconds over PCIe; 0: as long as delivering the buffered
  // stores). A thread whose fence outlasts another CTA's trap ends in it, as the grid would.
  uint64_t fence_ns = 0;
  // Which CUDA executor instantiation cpu/launch.cc runs, by its __launch_bounds__: 0 picks as a
  // GPU does (executor_bound in kernel_params.h); kMaxThreads runs the large-message one at any
  // shape (its LL groups at a decode shape: the CPU device has no register file to run out of);
  // kDecodeThreads the decode-shaped one (push, at most kDecodeThreads threads).
  int executor_bound = 0;
};

enum class LaunchStatus : uint8_t { kCompleted = 0, kTrapped = 1 };

// Runs `kernel` once in every thread of a grid of `grid` CTAs of `block` threads (x only: y and z
// must be 1 for block; grid x * y CTAs). Every CTA of the grid is resident at once, so CTAs may
// wait on each other. Returns kTrapped when a thread called trap(); throws std::invalid_argument
// for an empty or oversized shape, std::runtime_error when a thread cannot be started.
LaunchStatus launch(Dim3 grid, Dim3 block, const DeviceOptions& options,
                    const std::function<void()>& kernel);

// ---- inside a kernel (threadIdx, blockIdx, ... of the thread that runs)
Dim3 thread_idx();
Dim3 block_idx();
Dim3 block_dim();
Dim3 grid_dim();

// __syncthreads(): every live thread of the CTA arrives before any leaves.
void sync_threads();
// One iteration of a spin loop: lets the CTA's other threads run (and, in a weak mode, delivers
// some of this thread's pending stores).
void poll();
// trap: ends the grid. Never returns; nothing on the thread's stack is destroyed.
[[noreturn]] void trap();
// Whether the calling thread runs inside a launch (host code calling a primitive does not).
bool in_kernel();

}  // namespace pcie_ar::transport::cpu_device
