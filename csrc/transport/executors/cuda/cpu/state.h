// What the CPU device keeps per CTA and per thread while a launch runs: the part of the
// execution model (device.cc) that the memory model (memory.cc) also reads. Internal to the
// CPU device.
#pragma once

#include <ucontext.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

#include "transport/executors/cuda/cpu/device.h"

namespace pcie_ar::transport::cpu_device::detail {

// One buffered piece of a store: `bytes` (4 or 8) bytes of `value` at `addr`.
struct Piece {
  uintptr_t addr;
  uint64_t value;
};

// xorshift64*: cheap, and a seed reproduces a CTA's delivery order.
class Random {
 public:
  explicit Random(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull | 1u) {}
  uint64_t next() {
    state_ ^= state_ >> 12;
    state_ ^= state_ << 25;
    state_ ^= state_ >> 27;
    return state_ * 0x2545F4914F6CDD1Dull;
  }
  bool one_in(uint32_t n) { return next() % n == 0; }

 private:
  uint64_t state_;
};

struct Grid {
  Dim3 dim;
  Dim3 block;
  DeviceOptions options;
  const std::function<void()>* kernel = nullptr;
  std::atomic<bool> trapped{false};
};

enum class Run : uint8_t { kRunnable, kAtBarrier, kDone };

struct Thread {
  Dim3 idx;
  Run run = Run::kRunnable;
  ucontext_t context{};
  void* stack = nullptr;
  void* sanitizer_fiber = nullptr;  // ThreadSanitizer's fiber, when built with it
  std::vector<Piece> pending;       // weak modes: stores not yet in memory
};

struct Cta {
  Grid* grid = nullptr;
  Dim3 idx;
  std::vector<Thread> threads;
  Thread* running = nullptr;
  ucontext_t scheduler{};
  void* scheduler_fiber = nullptr;
  const void* scheduler_stack_bottom = nullptr;
  size_t scheduler_stack_size = 0;
  void* fake_stack = nullptr;  // AddressSanitizer's, for the switch under way
  int piece_bytes = 8;
  bool weak = false;
  // Pieces every thread of the CTA has observed (handed over at a barrier) but memory has not.
  std::unordered_map<uintptr_t, uint64_t> observed;
  // Pieces of threads that ended: nobody observed them, they land in their own time.
  std::vector<Piece> orphaned;
  Random random{1};
};

// The CTA the calling OS thread runs, or null outside a launch.
Cta* current_cta();

// Memory-model hooks the execution model calls (memory.cc).
void deliver_some(Cta& cta, Thread& thread);  // the thread polls or waits at a barrier
void deliver_some_observed(Cta& cta);         // between two turns of the CTA's threads
void hand_over_at_barrier(Cta& cta);          // every thread passed the barrier
void hand_over_at_exit(Cta& cta, Thread& thread);
void deliver_everything(Cta& cta);  // the CTA ended: nothing stays buffered
// A trap ends a GPU grid at once, not at each CTA's next poll: a thread that reaches a system
// fence after another CTA trapped ends there (never returns), its later stores never made.
void stop_if_trapped();

}  // namespace pcie_ar::transport::cpu_device::detail
