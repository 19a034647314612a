// The CUDA executor's primitives on a GPU, in PTX: 16-byte vector loads and stores with the cache
// behaviour each direction needs, the system-scope flag operations of the generation protocol,
// the LL (flag-in-data) loads and stores, programmatic dependent launch, the global timer that
// bounds every wait, the failure claim, fence and trap, and fp32 arithmetic for bf16/fp16/fp32
// vectors. Included through primitives.cuh, never directly.
//
// Why these flavours: peers write our slots over PCIe behind the SM's back, and L1 is not
// coherent with those writes, so nothing that a peer wrote may be read through L1. Flags are
// released and acquired at system scope because the writer is another GPU (or the same GPU in
// loopback, where system scope is merely stronger than needed). Peer atomics are never used:
// PCIe peer-to-peer does not carry them on most hosts.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "plan/step.h"
#include "plan/tactic.h"
#include "transport/executors/cuda/kernel_params.h"

namespace pcie_ar::transport::kernels {

// ------------------------------------------------------------------ data movement

// L2-only load: for operands in this GPU's memory that peers or other CTAs wrote this call.
__device__ __forceinline__ uint4 load_cg(const uint4* ptr) {
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr)
               : "memory");
  return v;
}

// Uncached load: for operands that may sit in a peer's memory across PCIe; the same address
// carries new data every other call, so no cache line may ever answer for it.
__device__ __forceinline__ uint4 load_cv(const uint4* ptr) {
  uint4 v;
  asm volatile("ld.global.cv.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(ptr)
               : "memory");
  return v;
}

// L2 store, no L1 allocation: the data is for a peer (posted PCIe write) or a later step.
__device__ __forceinline__ void store_cg(uint4* ptr, const uint4& v) {
  asm volatile("st.global.cg.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w)
               : "memory");
}

// L2 stores of 8 and 4 bytes (the fused epilogue's quantised output: a vector's worth of bytes).
__device__ __forceinline__ void store_cg_v2_u32(void* ptr, uint32_t lo, uint32_t hi) {
  asm volatile("st.global.cg.v2.u32 [%0], {%1, %2};" ::"l"(ptr), "r"(lo), "r"(hi) : "memory");
}
__device__ __forceinline__ void store_cg_u32(void* ptr, uint32_t v) {
  asm volatile("st.global.cg.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

// The load flavour of a direction. Push: every operand is in this GPU's memory (the host
// rejects push programs that read a peer). Pull: operands may be a peer's slots.
template <plan::Direction D>
__device__ __forceinline__ uint4 load_operand(const uint4* ptr) {
  if constexpr (D == plan::Direction::kPush) {
    return load_cg(ptr);
  } else {
    return load_cv(ptr);
  }
}

// ------------------------------------------------------------------ flags

// A flag word as one 16-byte access: the generation and {numel, signature} packed low/high.
struct FlagBits {
  uint64_t gen;
  uint64_t call;  // numel in the low 32 bits, signature in the high 32 bits
};

// One acquire load of a whole flag word. A 16-byte access is not single-copy atomic across
// its two 8-byte halves, so `call` may belong to an older store than `gen`; callers re-read.
__device__ __forceinline__ FlagBits load_flag_acquire_sys(const void* ptr) {
  FlagBits f;
  asm volatile("ld.acquire.sys.global.v2.u64 {%0, %1}, [%2];"
               : "=l"(f.gen), "=l"(f.call)
               : "l"(ptr)
               : "memory");
  return f;
}

// A flag word written as the protocol needs it read: the call half first, then a release store
// of the generation, so everything this thread has observed (after a CTA barrier: everything the
// CTA wrote), the call half included, is visible system-wide before the generation. A reader
// that acquired this generation and reads the call half again therefore sees this generation's
// call: a 16-byte store is not single-copy atomic across its halves, so one store of both would
// let a reader see the new generation beside an old call for as long as the halves travel apart.
__device__ __forceinline__ void store_flag_release_sys(void* ptr, uint64_t gen, uint64_t call) {
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(static_cast<uint64_t*>(ptr) + 1), "l"(call)
               : "memory");
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(ptr), "l"(gen) : "memory");
}

// The generation counter: written by the CTA at the end of one call, read at the start of the
// next (a later kernel), never through L1.
__device__ __forceinline__ uint64_t load_volatile_u64(const void* ptr) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ void store_volatile_u64(void* ptr, uint64_t v) {
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

// The fused epilogue's meeting of a rank's CTAs on their generation counters (this GPU's memory,
// read by this GPU only): GPU scope is the whole audience.
__device__ __forceinline__ void store_release_gpu_u64(void* ptr, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t load_acquire_gpu_u64(const void* ptr) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
  return v;
}

// ------------------------------------------------------------------ LL (flag-in-data)

// An LL vector is {payload, tag, payload, tag}. Loads bypass L1 (peers write these words over
// PCIe) and are never merged or hoisted: each poll is a fresh look at memory. Each {payload,
// tag} pair is one 64-bit element of a .v2.u64 access: the PTX memory model treats a vector
// access as one access per element, so the pair is single-copy atomic by rule (a .v4.u32 access
// is four 32-bit ones, atomic in pairs only by what the hardware happens to do). Same SASS.
__device__ __forceinline__ uint4 load_ll(const uint4* ptr) {
  uint64_t lo, hi;
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];"
               : "=l"(lo), "=l"(hi)
               : "l"(ptr)
               : "memory");
  return make_uint4(static_cast<uint32_t>(lo), static_cast<uint32_t>(lo >> 32),
                    static_cast<uint32_t>(hi), static_cast<uint32_t>(hi >> 32));
}

__device__ __forceinline__ void store_ll(uint4* ptr, uint32_t d0, uint32_t d1, uint32_t tag) {
  const uint64_t lo = (static_cast<uint64_t>(tag) << 32) | d0;
  const uint64_t hi = (static_cast<uint64_t>(tag) << 32) | d1;
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(ptr), "l"(lo), "l"(hi) : "memory");
}

// Four words as they are (a Lamport vector): the same access as store_ll, so each 64-bit half,
// and every 32-bit word in it, is single-copy atomic.
__device__ __forceinline__ void store_ll_vector(uint4* ptr, const uint4& v) {
  const uint64_t lo = (static_cast<uint64_t>(v.y) << 32) | v.x;
  const uint64_t hi = (static_cast<uint64_t>(v.w) << 32) | v.z;
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(ptr), "l"(lo), "l"(hi) : "memory");
}

// Payload vector `v` as the two LL vectors at ll[0], ll[1], every 8-byte word tagged.
__device__ __forceinline__ void store_ll_payload(uint4* ll, const uint4& v, uint32_t tag) {
  store_ll(ll, v.x, v.y, tag);
  store_ll(ll + 1, v.z, v.w, tag);
}

// Nothing inside the kernel orders the previous kernel's writes before ours under
// programmatic dependent launch except this wait (a no-op when launched without PDL).
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel of the stream start its prologue; it still waits for our completion.
__device__ __forceinline__ void allow_dependent_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// ------------------------------------------------------------------ control

// LL operands a thread loads before it looks at their tags, all in flight at once (executor.cuh,
// gather_ll_group), by the instantiation's launch bound (kernel_params.h, executor_bound).
//
// The decode-shaped kernels (kDecodeThreads, 128 registers a thread) take every operand of a
// reduce in one look (plan::kMaxSources, LL and lamport alike): no spill, no stack frame and every
// load before the first compare on every architecture CI builds (tests/sass/check_sass.py).
//
// The large-message kernels (kMaxThreads: 64 registers a thread) take the largest group for which
// CUDA 13.0's ptxas, in all six of them, both keeps everything in registers and issues every LL
// load of a group before its first tag compare. Measured per kernel:
//   group 4: fp32 spills (4-8 bytes) on sm_86/89/120; no spill on sm_80/90/100, but ptxas gives a
//            later operand's load the registers of an earlier operand's data, so that operand's
//            tag compares move above the load (the look is half serial; sm_100 is clean only
//            without the lamport kernels in the executor);
//   group 3: on sm_120, with the fan-out copies (run_fanout) in the executor, a long-lived
//            value (the rank, the step count, the thread index: whichever one is not
//            re-derived) spills 4-8 bytes in the bf16/fp16 or fp32 push kernel; fp32 spills on
//            sm_86/89; half-serial looks on sm_80/90/100;
//   group 2: clean on sm_86/89/90/100/120; on sm_80 two of sixteen fp32 looks still compare
//            early.
// Lamport operands (4 registers each, raw, against LL's 8), measured the same way: group 4 is
// spill-free and parallel on sm_100 and sm_120; below sm_100 the LL group is kept.
template <int Bound>
inline constexpr int kLLGroup = Bound <= kDecodeThreads ? plan::kMaxSources : 2;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
template <int Bound>
inline constexpr int kLLDenseGroup = Bound <= kDecodeThreads ? plan::kMaxSources : 4;
#else
template <int Bound>
inline constexpr int kLLDenseGroup = kLLGroup<Bound>;
#endif

// This thread's index in its CTA, read from the special register at every use rather than kept
// in a register across the kernel: it is what every step starts from, so a long-lived copy is
// the value ptxas spills first when a kernel sits at its register budget (it did on sm_86/89
// once the fan-out joined the executor), and re-reading it costs one S2R per step.
__device__ __forceinline__ int thread_index() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}

// The value itself, as something new each time: the compiler can neither re-derive it from what
// it was computed from nor hoist what is computed from it out of the loop it is called in. An LL
// step's operand mask (executor.cuh) thus stays one register, tested bit by bit where it is used,
// instead of one register per operand for the whole loop. An empty asm: no instruction.
__device__ __forceinline__ uint32_t opaque_u32(uint32_t v) {
  asm volatile("" : "+r"(v));
  return v;
}
__device__ __forceinline__ float opaque_f32(float v) {
  asm volatile("" : "+f"(v));
  return v;
}

// True for the one caller that turns the word from 0 to 1 (a device-memory CAS: atomics on mapped
// host memory are not atomic over PCIe).
__device__ __forceinline__ bool claim_first(uint32_t* claim) {
  return atomicCAS(claim, 0u, 1u) == 0u;
}

// The winner of claim_first() has published its record (claim 1 -> 2); losers poll for it.
__device__ __forceinline__ void publish_claim(uint32_t* claim) { atomicExch(claim, 2u); }
__device__ __forceinline__ bool claim_published(uint32_t* claim) {
  uint32_t v;
  asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(claim) : "memory");
  return v == 2u;
}

// Every store this thread made (after a barrier: its CTA) is visible system-wide first.
__device__ __forceinline__ void fence_system() { __threadfence_system(); }

// Ends the grid: the context dies, the host learns why from the failure record.
__device__ __forceinline__ void trap_kernel() { asm volatile("trap;"); }

// Memory written once before any launch (the uploaded programs): through the read-only cache.
__device__ __forceinline__ uint32_t load_read_only(const uint32_t* ptr) { return __ldg(ptr); }

// Nanoseconds, comparable across SMs (unlike clock64), so a deadline means wall time.
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ------------------------------------------------------------------ fp32 accumulation

// One fp32 add, round to nearest even; a NaN sum is the canonical quiet NaN (0x7fffffff).
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
// The fused epilogue's other operations (plan/epilogue.h), each rounded once: never contracted.
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float sqrt_rn(float a) { return __fsqrt_rn(a); }

// How one 16-byte vector of T widens to fp32 and narrows back with one round-to-nearest-even.
template <typename T>
struct VecMath;

template <>
struct VecMath<__nv_bfloat16> {
  static constexpr int kElems = 8;
  __device__ __forceinline__ static void widen(const uint4& v, float (&out)[kElems]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // bf16 is the top half of an fp32: widening is a shift, exact.
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
    }
  }
  __device__ __forceinline__ static uint4 narrow(const float (&in)[kElems]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

template <>
struct VecMath<__half> {
  static constexpr int kElems = 8;
  __device__ __forceinline__ static void widen(const uint4& v, float (&out)[kElems]) {
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      out[2 * i] = f.x;
      out[2 * i + 1] = f.y;
    }
  }
  __device__ __forceinline__ static uint4 narrow(const float (&in)[kElems]) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2 pair = __floats2half2_rn(in[2 * i], in[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&pair);
    }
    return make_uint4(w[0], w[1], w[2], w[3]);
  }
};

template <>
struct VecMath<float> {
  static constexpr int kElems = 4;
  __device__ __forceinline__ static void widen(const uint4& v, float (&out)[kElems]) {
    out[0] = __uint_as_float(v.x);
    out[1] = __uint_as_float(v.y);
    out[2] = __uint_as_float(v.z);
    out[3] = __uint_as_float(v.w);
  }
  __device__ __forceinline__ static uint4 narrow(const float (&in)[kElems]) {
    return make_uint4(__float_as_uint(in[0]), __float_as_uint(in[1]), __float_as_uint(in[2]),
                      __float_as_uint(in[3]));
  }
};

}  // namespace pcie_ar::transport::kernels
