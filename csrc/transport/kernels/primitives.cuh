// Device primitives of the CUDA IPC transport: 16-byte vector loads and stores with the cache
// behaviour each direction needs, the system-scope flag operations of the generation protocol,
// the global timer that bounds every wait, and fp32 accumulation for bf16/fp16/fp32 vectors.
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

#include "plan/tactic.h"

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

__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* ptr) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ uint32_t load_relaxed_sys(const uint32_t* ptr) {
  uint32_t v;
  asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

__device__ __forceinline__ void store_release_sys(uint32_t* ptr, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

__device__ __forceinline__ void store_relaxed_sys(uint32_t* ptr, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

// Nanoseconds, comparable across SMs (unlike clock64), so a deadline means wall time.
__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ------------------------------------------------------------------ fp32 accumulation

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

// Sum of N vectors in operand order (acc = x0; acc += x1; ...), in fp32, rounded once. The
// order is the schedule's rank order: it is what makes every rank's result bitwise identical.
template <typename T, int N>
__device__ __forceinline__ uint4 sum_in_order(const uint4 (&x)[N]) {
  using M = VecMath<T>;
  float acc[M::kElems];
  M::widen(x[0], acc);
#pragma unroll
  for (int i = 1; i < N; ++i) {
    float term[M::kElems];
    M::widen(x[i], term);
#pragma unroll
    for (int e = 0; e < M::kElems; ++e) acc[e] = __fadd_rn(acc[e], term[e]);
  }
  return M::narrow(acc);
}

}  // namespace pcie_ar::transport::kernels
