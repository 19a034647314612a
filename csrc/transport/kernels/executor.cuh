// The executor: one kernel that runs a rank's step list (plan::Program), the same list the CPU
// verifier proved. Grid: dim3(blocks, ranks_in_launch); blockIdx.y picks the (virtual) rank,
// CTA b owns slice b of every chunk and its own flags and generation counter.
//
// Thread i of a CTA always handles the vectors slice.begin + i + k * blockDim.x of whatever
// chunk a step names, so a step that reads what an earlier step of the same rank wrote to the
// same chunk reads the thread's own stores: consecutive steps need no barrier. Barriers sit
// only where the protocol needs them: before a signal (the whole slice is written) and after a
// wait (the whole CTA may read).
#pragma once

#include <cstddef>

#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/step.h"
#include "transport/kernels/launch.h"
#include "transport/kernels/primitives.cuh"

namespace pcie_ar::transport::kernels {

static_assert(offsetof(plan::Program, steps) % 4 == 0 && sizeof(plan::Step) % 4 == 0,
              "the program is staged into shared memory as 32-bit words");
static_assert(sizeof(plan::Program) % 4 == 0);

// Polls of a flag between two looks at the clock: a poll is a round trip to L2 or over PCIe,
// so the deadline is still checked every few microseconds.
inline constexpr uint32_t kPollsPerClockCheck = 16;

// What every step of one CTA needs to know about the call.
struct Call {
  int rank;
  int block;
  uint32_t gen;
  int parity;
  int64_t num_vecs;
  int num_chunks;
};

__device__ __forceinline__ uint4* resolve(const LaunchParams& p, const Call& c,
                                          const plan::BufRef& ref) {
  switch (ref.space) {
    case plan::Space::kInput:  // check_program(): programs name only their own tensors
      return const_cast<uint4*>(static_cast<const uint4*>(p.inputs[c.rank]));
    case plan::Space::kOutput:
      return static_cast<uint4*>(p.outputs[c.rank]);
    default:
      return reinterpret_cast<uint4*>(p.bases[ref.owner] +
                                      p.layout.slot_offset(c.parity, ref.slot));
  }
}

__device__ __forceinline__ plan::FlagWord* flag_word(const LaunchParams& p, const Call& c,
                                                     int owner, int flag) {
  return reinterpret_cast<plan::FlagWord*>(p.bases[owner] +
                                           p.layout.flag_offset(c.parity, c.block, flag));
}

// dst[v] = src0[v] + ... + src{N-1}[v] over this thread's vectors of the slice. All operands
// are loaded before the store, so dst may alias any source elementwise (the in-place op).
template <typename T, plan::Direction D, int N>
__device__ __forceinline__ void reduce_slice(const LaunchParams& p, const Call& c,
                                             const plan::Step& step, plan::VecRange range) {
  const uint4* src[N];
#pragma unroll
  for (int i = 0; i < N; ++i) src[i] = resolve(p, c, step.srcs[i]);
  uint4* dst = resolve(p, c, step.dst);
  for (int64_t v = range.begin + threadIdx.x; v < range.end; v += blockDim.x) {
    uint4 x[N];
#pragma unroll
    for (int i = 0; i < N; ++i) x[i] = load_operand<D>(src[i] + v);
    if constexpr (N == 1) {
      store_cg(dst + v, x[0]);  // a copy moves bits; it never rounds
    } else {
      store_cg(dst + v, sum_in_order<T, N>(x));
    }
  }
}

template <typename T, plan::Direction D>
__device__ __forceinline__ void run_reduce(const LaunchParams& p, const Call& c,
                                           const plan::Step& step) {
  const plan::VecRange range =
      plan::slice_range(c.num_vecs, c.num_chunks, step.chunk, static_cast<int>(gridDim.x), c.block);
  // One instantiation per operand count keeps every operand array in registers.
  switch (step.num_srcs) {
    case 1:
      return reduce_slice<T, D, 1>(p, c, step, range);
    case 2:
      return reduce_slice<T, D, 2>(p, c, step, range);
    case 3:
      return reduce_slice<T, D, 3>(p, c, step, range);
    case 4:
      return reduce_slice<T, D, 4>(p, c, step, range);
    case 5:
      return reduce_slice<T, D, 5>(p, c, step, range);
    case 6:
      return reduce_slice<T, D, 6>(p, c, step, range);
    case 7:
      return reduce_slice<T, D, 7>(p, c, step, range);
    default:
      static_assert(plan::kMaxSources == 8);
      return reduce_slice<T, D, 8>(p, c, step, range);
  }
}

// Records the first failure of the launch where the host can read it after the context dies,
// then traps. The claim is a device-memory CAS: atomics on mapped host memory are not atomic
// over PCIe, and only one CTA's record must land.
__device__ __forceinline__ void fail(const LaunchParams& p, const plan::Diagnostic& d) {
  if (atomicCAS(p.claim, 0u, 1u) == 0u) {
    const auto* words = reinterpret_cast<const uint32_t*>(&d);
    volatile uint32_t* record = reinterpret_cast<volatile uint32_t*>(p.diag);
    static_assert(offsetof(plan::Diagnostic, kind) == 0);
    for (int i = 1; i < static_cast<int>(sizeof(plan::Diagnostic) / 4); ++i) record[i] = words[i];
    __threadfence_system();  // the fields reach host memory before the kind that publishes them
    record[0] = words[0];
    __threadfence_system();
  }
  asm volatile("trap;");
}

__device__ __forceinline__ plan::CallPosition position(const LaunchParams& p, const Call& c) {
  return plan::CallPosition{static_cast<uint32_t>(c.rank), static_cast<uint32_t>(c.block), c.gen,
                            static_cast<uint32_t>(p.numel), p.signature};
}

// Thread 0 only. Spins until the flag reaches this call's generation, then checks that the
// peer entered it with the same call. Bounded by p.timeout_ns measured on the global timer.
__device__ __forceinline__ void wait_flag(const LaunchParams& p, const Call& c, int step_index,
                                          const plan::Step& step) {
  plan::FlagWord* word = flag_word(p, c, step.flag_owner, step.flag);
  plan::FlagSeen seen{load_acquire_sys(&word->gen)};
  if (!plan::gen_reached(seen.gen, c.gen)) {
    const uint64_t start = global_timer_ns();
    uint32_t polls = 0;
    do {
      if (++polls == kPollsPerClockCheck) {
        polls = 0;
        if (p.timeout_ns != 0 && global_timer_ns() - start > p.timeout_ns) {
          fail(p, plan::make_diagnostic(plan::FailureKind::kTimeout, position(p, c), step_index,
                                        step, seen));
        }
      }
      seen.gen = load_acquire_sys(&word->gen);
    } while (!plan::gen_reached(seen.gen, c.gen));
  }
  // Ordered after the acquire: the writer stored these before releasing gen.
  seen.numel = load_relaxed_sys(&word->numel);
  seen.signature = load_relaxed_sys(&word->signature);
  if (plan::is_mismatch(position(p, c), seen)) {
    fail(p, plan::make_diagnostic(plan::FailureKind::kMismatch, position(p, c), step_index, step,
                                  seen));
  }
}

// Thread 0 only, after a barrier: the CTA's stores to the slice happen before the release.
__device__ __forceinline__ void raise_flag(const LaunchParams& p, const Call& c,
                                           const plan::Step& step) {
  plan::FlagWord* word = flag_word(p, c, step.flag_owner, step.flag);
  store_relaxed_sys(&word->numel, static_cast<uint32_t>(p.numel));
  store_relaxed_sys(&word->signature, p.signature);
  store_relaxed_sys(&word->writer, static_cast<uint32_t>(c.rank));
  store_release_sys(&word->gen, c.gen);
}

// End of the call, own workspace only: the flag refresh of plan/protocol.h, spread over the
// CTA's threads.
__device__ __forceinline__ void finish_call(const LaunchParams& p, const Call& c) {
  const int stride = static_cast<int>(gridDim.x);
  const int my_blocks = (p.layout.max_blocks - c.block + stride - 1) / stride;
  const int num_flags = p.layout.num_flags;
  uint8_t* own = p.bases[c.rank];
  for (int i = threadIdx.x; i < my_blocks * num_flags; i += blockDim.x) {
    const int b = c.block + (i / num_flags) * stride;
    auto* word =
        reinterpret_cast<plan::FlagWord*>(own + p.layout.flag_offset(c.parity, b, i % num_flags));
    store_relaxed_sys(&word->gen, c.gen);
  }
  for (int i = threadIdx.x; i < my_blocks; i += blockDim.x) {
    *reinterpret_cast<volatile uint32_t*>(own + p.layout.gen_counter_offset(c.block + i * stride)) =
        c.gen;
  }
}

template <typename T, plan::Direction D>
__global__ void __launch_bounds__(kMaxThreads)
    executor_kernel(const __grid_constant__ LaunchParams p) {
  // The program is read by every thread at every step: stage it once in shared memory.
  __shared__ uint32_t staged_program[sizeof(plan::Program) / 4];

  Call c;
  c.rank = p.first_rank + static_cast<int>(blockIdx.y);
  c.block = static_cast<int>(blockIdx.x);
  const auto* program_words = reinterpret_cast<const uint32_t*>(p.programs[c.rank]);
  const int num_steps = p.programs[c.rank]->num_steps;
  const int num_words =
      static_cast<int>((offsetof(plan::Program, steps) + num_steps * sizeof(plan::Step)) / 4);
  for (int i = threadIdx.x; i < num_words; i += blockDim.x) {
    staged_program[i] = __ldg(program_words + i);
  }
  // Written only by this CTA at the end of the previous call (an earlier kernel).
  c.gen = *reinterpret_cast<const volatile uint32_t*>(p.bases[c.rank] +
                                                      p.layout.gen_counter_offset(c.block)) +
          1u;
  c.parity = plan::gen_parity(c.gen);
  c.num_vecs = p.numel * static_cast<int64_t>(sizeof(T)) / plan::kVectorBytes;
  __syncthreads();
  const auto& program = *reinterpret_cast<const plan::Program*>(staged_program);
  c.num_chunks = program.num_chunks;

  for (int s = 0; s < num_steps; ++s) {
    const plan::Step& step = program.steps[s];
    switch (step.kind) {
      case plan::StepKind::kReduce:
        run_reduce<T, D>(p, c, step);
        break;
      case plan::StepKind::kSignal:
        __syncthreads();
        if (threadIdx.x == 0) raise_flag(p, c, step);
        break;
      case plan::StepKind::kWait:
        if (threadIdx.x == 0) wait_flag(p, c, s, step);
        __syncthreads();
        break;
    }
  }
  __syncthreads();
  finish_call(p, c);
}

}  // namespace pcie_ar::transport::kernels
