// The CPU device's execution model (device.h): an OS thread per CTA, ucontext fibers for the
// CTA's threads, a round-robin scheduler that honours barriers and traps.
#include "transport/executors/cuda/cpu/device.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdlib>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "transport/executors/cuda/cpu/state.h"

#if defined(__SANITIZE_ADDRESS__)
#define PCIE_AR_CPU_DEVICE_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define PCIE_AR_CPU_DEVICE_ASAN 1
#endif
#endif
#if defined(__SANITIZE_THREAD__)
#define PCIE_AR_CPU_DEVICE_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define PCIE_AR_CPU_DEVICE_TSAN 1
#endif
#endif

#if defined(PCIE_AR_CPU_DEVICE_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(PCIE_AR_CPU_DEVICE_TSAN)
#include <sanitizer/tsan_interface.h>
#endif

namespace pcie_ar::transport::cpu_device {
namespace {

using detail::Cta;
using detail::Grid;
using detail::Run;
using detail::Thread;

constexpr unsigned kMaxThreadsPerCta = 1024;
constexpr unsigned kMaxCtas = 512;
// Kernel frames are small (the executor keeps a few 16-byte vectors per operand); sanitizers
// enlarge them several times. Pages are reserved lazily, so untouched stack costs nothing.
constexpr size_t kStackBytes = 256 * 1024;

thread_local Cta* tl_cta = nullptr;

// Fiber stacks outlive launches: mapping 2,048 of them per launch would dominate a small one.
class StackPool {
 public:
  void* acquire() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_.empty()) {
        void* stack = free_.back();
        free_.pop_back();
        return stack;
      }
    }
    void* stack = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (stack == MAP_FAILED) throw std::runtime_error("cpu device: cannot map a fiber stack");
    // The lowest page is a guard: an overflow faults instead of corrupting a neighbour.
    mprotect(stack, static_cast<size_t>(sysconf(_SC_PAGESIZE)), PROT_NONE);
    return stack;
  }
  void release(void* stack) {
#if defined(PCIE_AR_CPU_DEVICE_ASAN)
    // A fiber abandoned by a trap never unwound: its frames' redzones are still poisoned.
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    __asan_unpoison_memory_region(static_cast<char*>(stack) + page, kStackBytes - page);
#endif
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(stack);
  }

 private:
  std::mutex mutex_;
  std::vector<void*> free_;
};

StackPool& stacks() {
  static StackPool* pool = new StackPool();  // never destroyed: launches may run at exit
  return *pool;
}

// ---------------------------------------------------------------- switching
// The sanitizers must be told about every switch, or they take a fiber's stack for a
// corrupted one (ASan) or its accesses for another thread's (TSan).

#if defined(PCIE_AR_CPU_DEVICE_ASAN)
thread_local void* tl_scheduler_fake_stack = nullptr;
thread_local void* tl_fiber_fake_stack[kMaxThreadsPerCta];
#endif

void enter_thread(Cta& cta, Thread& thread) {
  cta.running = &thread;
#if defined(PCIE_AR_CPU_DEVICE_TSAN)
  __tsan_switch_to_fiber(thread.sanitizer_fiber, 0);
#endif
#if defined(PCIE_AR_CPU_DEVICE_ASAN)
  __sanitizer_start_switch_fiber(&tl_scheduler_fake_stack, thread.stack, kStackBytes);
#endif
  swapcontext(&cta.scheduler, &thread.context);
#if defined(PCIE_AR_CPU_DEVICE_ASAN)
  __sanitizer_finish_switch_fiber(tl_scheduler_fake_stack, nullptr, nullptr);
#endif
  cta.running = nullptr;
}

void leave_thread(Cta& cta, Thread& thread, bool for_good) {
#if defined(PCIE_AR_CPU_DEVICE_TSAN)
  __tsan_switch_to_fiber(cta.scheduler_fiber, 0);
#endif
#if defined(PCIE_AR_CPU_DEVICE_ASAN)
  void** save = for_good ? nullptr : &tl_fiber_fake_stack[thread.idx.x];
  __sanitizer_start_switch_fiber(save, cta.scheduler_stack_bottom, cta.scheduler_stack_size);
#else
  (void)for_good;
#endif
  swapcontext(&thread.context, &cta.scheduler);
#if defined(PCIE_AR_CPU_DEVICE_ASAN)
  __sanitizer_finish_switch_fiber(tl_fiber_fake_stack[thread.idx.x], &cta.scheduler_stack_bottom,
                                  &cta.scheduler_stack_size);
#endif
}

struct CtaFailure {
  std::exception_ptr error;
};
thread_local CtaFailure* tl_failure = nullptr;

void fiber_main() {
  Cta& cta = *tl_cta;
  Thread& thread = *cta.running;
#if defined(PCIE_AR_CPU_DEVICE_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &cta.scheduler_stack_bottom, &cta.scheduler_stack_size);
#endif
  try {
    (*cta.grid->kernel)();
  } catch (...) {
    // Not an exception a kernel can raise on a GPU: a bug of the device or of its caller. The
    // grid stops and launch() rethrows it.
    if (tl_failure->error == nullptr) tl_failure->error = std::current_exception();
    cta.grid->trapped.store(true);
  }
  thread.run = Run::kDone;
  leave_thread(cta, thread, true);
  std::abort();  // a finished fiber is never resumed
}

// ---------------------------------------------------------------- one CTA

void start_threads(Cta& cta) {
  const Grid& grid = *cta.grid;
  cta.threads.resize(grid.block.x);
  for (unsigned i = 0; i < grid.block.x; ++i) {
    Thread& thread = cta.threads[i];
    thread.idx = Dim3{i, 0, 0};
    thread.stack = stacks().acquire();
    getcontext(&thread.context);
    thread.context.uc_stack.ss_sp = thread.stack;
    thread.context.uc_stack.ss_size = kStackBytes;
    thread.context.uc_link = nullptr;
    makecontext(&thread.context, fiber_main, 0);
#if defined(PCIE_AR_CPU_DEVICE_TSAN)
    thread.sanitizer_fiber = __tsan_create_fiber(0);
#endif
  }
}

void stop_threads(Cta& cta) {
  for (Thread& thread : cta.threads) {
#if defined(PCIE_AR_CPU_DEVICE_TSAN)
    __tsan_destroy_fiber(thread.sanitizer_fiber);
#endif
    stacks().release(thread.stack);
  }
}

// Round robin: each runnable thread runs until it polls, reaches a barrier, ends or traps.
// A barrier opens when every thread still alive has reached it.
void schedule(Cta& cta) {
  Grid& grid = *cta.grid;
  int live = static_cast<int>(cta.threads.size());
  while (live > 0 && !grid.trapped.load(std::memory_order_relaxed)) {
    for (Thread& thread : cta.threads) {
      if (thread.run != Run::kRunnable) continue;
      enter_thread(cta, thread);
      if (thread.run == Run::kDone) {
        --live;
        detail::hand_over_at_exit(cta, thread);
      }
      if (grid.trapped.load(std::memory_order_relaxed)) return;
    }
    int at_barrier = 0;
    for (const Thread& thread : cta.threads) at_barrier += thread.run == Run::kAtBarrier;
    if (live > 0 && at_barrier == live) {
      detail::hand_over_at_barrier(cta);
      for (Thread& thread : cta.threads) {
        if (thread.run == Run::kAtBarrier) thread.run = Run::kRunnable;
      }
    }
    detail::deliver_some_observed(cta);
    // A thread waiting at a barrier still drains its stores, in no order, as a GPU's do: held
    // until every thread arrived, they could be what another CTA waits for before its threads
    // arrive at theirs (the fused epilogue's CTAs meet while peers still read their LL words).
    for (Thread& thread : cta.threads) {
      if (thread.run == Run::kAtBarrier) detail::deliver_some(cta, thread);
    }
    // Ranks and CTAs usually outnumber the cores: a pass of polls gives the core away.
    std::this_thread::yield();
  }
}

void run_cta(Grid* grid, Dim3 idx, CtaFailure* failure) {
  Cta cta;
  cta.grid = grid;
  cta.idx = idx;
  cta.weak = grid->options.memory != MemoryModel::kStrict;
  cta.piece_bytes = grid->options.memory == MemoryModel::kWeakTear4 ? 4 : 8;
  cta.random =
      detail::Random(grid->options.seed ^ (static_cast<uint64_t>(idx.y) * grid->dim.x + idx.x + 1) *
                                              0xD1B54A32D192ED03ull);
  tl_cta = &cta;
  tl_failure = failure;
#if defined(PCIE_AR_CPU_DEVICE_TSAN)
  cta.scheduler_fiber = __tsan_get_current_fiber();
#endif
  try {
    start_threads(cta);
    schedule(cta);
    if (!grid->trapped.load()) detail::deliver_everything(cta);
  } catch (...) {
    if (failure->error == nullptr) failure->error = std::current_exception();
    grid->trapped.store(true);
  }
  stop_threads(cta);
  tl_cta = nullptr;
  tl_failure = nullptr;
}

Thread& running_thread(const char* what) {
  if (tl_cta == nullptr || tl_cta->running == nullptr) {
    throw std::logic_error(std::string("cpu device: ") + what + " outside a kernel");
  }
  return *tl_cta->running;
}

}  // namespace

namespace detail {
Cta* current_cta() { return tl_cta != nullptr && tl_cta->running != nullptr ? tl_cta : nullptr; }

void stop_if_trapped() {
  Cta* cta = current_cta();
  if (cta == nullptr || !cta->grid->trapped.load()) return;
  Thread& thread = *cta->running;
  thread.run = Run::kDone;
  leave_thread(*cta, thread, true);
  std::abort();  // never resumed
}
}  // namespace detail

LaunchStatus launch(Dim3 grid, Dim3 block, const DeviceOptions& options,
                    const std::function<void()>& kernel) {
  const uint64_t ctas = static_cast<uint64_t>(grid.x) * grid.y;
  if (grid.x == 0 || grid.y == 0 || grid.z != 1 || ctas > kMaxCtas || block.x == 0 ||
      block.x > kMaxThreadsPerCta || block.y != 1 || block.z != 1) {
    throw std::invalid_argument(
        "cpu device: a launch is grid (x, y, 1) with 1..512 CTAs of (1..1024, 1, 1) threads, got "
        "grid (" +
        std::to_string(grid.x) + ", " + std::to_string(grid.y) + ", " + std::to_string(grid.z) +
        ") of (" + std::to_string(block.x) + ", " + std::to_string(block.y) + ", " +
        std::to_string(block.z) + ")");
  }
  if (tl_cta != nullptr) throw std::logic_error("cpu device: a kernel cannot launch a kernel");
  Grid state;
  state.dim = grid;
  state.block = block;
  state.options = options;
  state.kernel = &kernel;
  std::vector<CtaFailure> failures(ctas);
  std::vector<std::thread> threads;
  threads.reserve(ctas);
  try {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        threads.emplace_back(run_cta, &state, Dim3{x, y, 1}, &failures[y * grid.x + x]);
      }
    }
  } catch (const std::system_error& e) {
    state.trapped.store(true);  // the CTAs that started stop at their next turn
    for (std::thread& t : threads) t.join();
    throw std::runtime_error(std::string("cpu device: cannot start a CTA thread: ") + e.what());
  }
  for (std::thread& t : threads) t.join();
  for (const CtaFailure& failure : failures) {
    if (failure.error != nullptr) std::rethrow_exception(failure.error);
  }
  return state.trapped.load() ? LaunchStatus::kTrapped : LaunchStatus::kCompleted;
}

Dim3 thread_idx() { return running_thread("threadIdx").idx; }
Dim3 block_idx() {
  running_thread("blockIdx");
  return tl_cta->idx;
}
Dim3 block_dim() {
  running_thread("blockDim");
  return tl_cta->grid->block;
}
Dim3 grid_dim() {
  running_thread("gridDim");
  return tl_cta->grid->dim;
}
bool in_kernel() { return detail::current_cta() != nullptr; }

void poll() {
  Thread& thread = running_thread("poll()");
  detail::deliver_some(*tl_cta, thread);
  leave_thread(*tl_cta, thread, false);
}

void sync_threads() {
  Thread& thread = running_thread("__syncthreads()");
  detail::deliver_some(*tl_cta, thread);
  thread.run = Run::kAtBarrier;
  leave_thread(*tl_cta, thread, false);
}

void trap() {
  Thread& thread = running_thread("trap");
  tl_cta->grid->trapped.store(true);
  thread.run = Run::kDone;
  leave_thread(*tl_cta, thread, true);
  std::abort();  // never resumed
}

}  // namespace pcie_ar::transport::cpu_device
