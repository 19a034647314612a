// The CUDA executor's primitives on the CPU device: the same names and meanings as the GPU's
// (executors/cuda/primitives_gpu.cuh), in C++ over the CPU device's execution and memory models
// (device.h, memory.h), and the few words of CUDA's language the executor is written in.
//
// Include it (through executors/cuda/primitives.cuh) only in the translation unit that instantiates
// the executor for the CPU device, after every other header: it defines CUDA's keywords and
// built-in variables as macros.
//
// What maps to what:
//   ld.cg / ld.cv / ld.volatile / ld.acquire.sys   memory.h load() (one 8-byte atomic per word;
//                                                  an acquire in C++ terms in every mode)
//   st.cg / st.volatile (data, LL words, counters) memory.h store(): late in the weak modes
//   st.cg.u32 (4 bytes)                            memory.h store_u32()
//   st.release.sys (flags)                         memory.h store_release()
//   __threadfence_system                           memory.h fence_system()
//   atomicCAS                                      memory.h atomic_cas()
//   polls (flag and LL loads)                      device.h poll() first: a spin loop yields
//   __syncthreads, trap                            device.h sync_threads(), trap()
//   globaltimer                                    steady_clock nanoseconds
//   griddepcontrol                                 nothing: CPU-device launches are synchronous
//   bf16/fp16/fp32 widen, narrow, add              element_codecs.h: the GPU's round-to-nearest-
//                                                  even and canonical NaN, bit for bit
// The cache flavours (cg, cv) differ only in what a GPU's caches may answer: the CPU device has
// no caches, so they are one load here.
#pragma once

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "plan/step.h"
#include "plan/tactic.h"
#include "transport/executors/cuda/cpu/device.h"
#include "transport/executors/cuda/cpu/memory.h"
#include "transport/executors/cuda/kernel_params.h"
#include "transport/executors/element_codecs.h"

// ------------------------------------------------------------------ CUDA's language
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
// Shared memory is per CTA, and a CTA is one OS thread.
#define __shared__ static thread_local
#define threadIdx (::pcie_ar::transport::cpu_device::thread_idx())
#define blockIdx (::pcie_ar::transport::cpu_device::block_idx())
#define blockDim (::pcie_ar::transport::cpu_device::block_dim())
#define gridDim (::pcie_ar::transport::cpu_device::grid_dim())
#define __syncthreads() (::pcie_ar::transport::cpu_device::sync_threads())

namespace pcie_ar::transport::cpu_device {

// The element types the CPU device's executor is instantiated for (the GPU's are __nv_bfloat16,
// __half and float): they select a VecMath, and their size is the element's.
struct Bf16 {
  uint16_t bits;
};
struct Fp16 {
  uint16_t bits;
};
static_assert(sizeof(Bf16) == 2 && sizeof(Fp16) == 2);

}  // namespace pcie_ar::transport::cpu_device

namespace pcie_ar::transport::kernels {

struct alignas(16) uint4 {
  uint32_t x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }

// ------------------------------------------------------------------ data movement

inline uint4 load_vector(const uint4* ptr) {
  uint4 v;
  cpu_device::load(ptr, &v, sizeof(v));
  return v;
}
inline uint4 load_cg(const uint4* ptr) { return load_vector(ptr); }
inline uint4 load_cv(const uint4* ptr) { return load_vector(ptr); }
inline void store_cg(uint4* ptr, const uint4& v) { cpu_device::store(ptr, &v, sizeof(v)); }
inline void store_cg_v2_u32(void* ptr, uint32_t lo, uint32_t hi) {
  const uint32_t words[2] = {lo, hi};
  cpu_device::store(ptr, words, sizeof(words));
}
inline void store_cg_u32(void* ptr, uint32_t v) { cpu_device::store_u32(ptr, v); }

template <plan::Direction D>
inline uint4 load_operand(const uint4* ptr) {
  return load_vector(ptr);
}

// ------------------------------------------------------------------ flags

struct FlagBits {
  uint64_t gen;
  uint64_t call;  // numel in the low 32 bits, signature in the high 32 bits
};

// A poll: the CTA's other threads run first. Two 8-byte loads, like the GPU's 16-byte one that
// is not single-copy atomic across its halves.
inline FlagBits load_flag_acquire_sys(const void* ptr) {
  cpu_device::poll();
  FlagBits f;
  cpu_device::load(ptr, &f, sizeof(f));
  return f;
}

// The call half, then the generation released (see the GPU's).
inline void store_flag_release_sys(void* ptr, uint64_t gen, uint64_t call) {
  cpu_device::store(static_cast<uint64_t*>(ptr) + 1, &call, sizeof(call));
  cpu_device::store_release(ptr, &gen, sizeof(gen));
}

inline uint64_t load_volatile_u64(const void* ptr) {
  uint64_t v;
  cpu_device::load(ptr, &v, sizeof(v));
  return v;
}

inline void store_volatile_u64(void* ptr, uint64_t v) { cpu_device::store(ptr, &v, sizeof(v)); }

inline void store_release_gpu_u64(void* ptr, uint64_t v) {
  cpu_device::store_release(ptr, &v, sizeof(v));
}

// A poll, like a flag load.
inline uint64_t load_acquire_gpu_u64(const void* ptr) {
  cpu_device::poll();
  uint64_t v;
  cpu_device::load(ptr, &v, sizeof(v));
  return v;
}

// ------------------------------------------------------------------ LL (flag-in-data)

// A poll, like a flag load.
inline uint4 load_ll(const uint4* ptr) {
  cpu_device::poll();
  return load_vector(ptr);
}

inline void store_ll(uint4* ptr, uint32_t d0, uint32_t d1, uint32_t tag) {
  const uint4 v{d0, tag, d1, tag};
  cpu_device::store(ptr, &v, sizeof(v));
}

inline void store_ll_vector(uint4* ptr, const uint4& v) { cpu_device::store(ptr, &v, sizeof(v)); }

inline void store_ll_payload(uint4* ll, const uint4& v, uint32_t tag) {
  store_ll(ll, v.x, v.y, tag);
  store_ll(ll + 1, v.z, v.w, tag);
}

// Launches are synchronous: the previous grid has finished, and nothing starts early.
inline void wait_for_previous_grid() {}
inline void allow_dependent_grids() {}

// ------------------------------------------------------------------ control

// No register budget, but the GPU's groups (primitives_gpu.cuh), so that what a GPU runs runs
// here: the decode-shaped kernels take every operand in one look, the large-message ones two at
// a time (a reduce of more operands runs several groups; sm_100+ takes lamport four at a time,
// the same code path as two).
template <int Bound>
inline constexpr int kLLGroup = Bound <= kDecodeThreads ? plan::kMaxSources : 2;
template <int Bound>
inline constexpr int kLLDenseGroup = kLLGroup<Bound>;

// No optimizer to keep from re-deriving it.
inline int thread_index() { return static_cast<int>(threadIdx.x); }
inline uint32_t opaque_u32(uint32_t v) { return v; }
inline float opaque_f32(float v) { return v; }

inline bool claim_first(uint32_t* claim) { return cpu_device::atomic_cas(claim, 0u, 1u) == 0u; }
inline void publish_claim(uint32_t* claim) { std::atomic_ref<uint32_t>(*claim).store(2u); }
// A poll, like a flag load.
inline bool claim_published(uint32_t* claim) {
  cpu_device::poll();
  return std::atomic_ref<uint32_t>(*claim).load() == 2u;
}
inline void fence_system() { cpu_device::fence_system(); }
[[noreturn]] inline void trap_kernel() { cpu_device::trap(); }
inline uint32_t load_read_only(const uint32_t* ptr) { return *ptr; }

inline uint64_t global_timer_ns() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
}

// ------------------------------------------------------------------ fp32 accumulation

inline float add_rn(float a, float b) { return canonical_nan(a + b); }
// Built with -ffp-contract=off (the CPU device's executor unit), so a product is never fused
// into an add, as on the GPU.
inline float mul_rn(float a, float b) { return canonical_nan(a * b); }
inline float div_rn(float a, float b) { return canonical_nan(a / b); }
inline float sqrt_rn(float a) { return canonical_nan(std::sqrt(a)); }

template <typename T>
struct VecMath;

// bf16 and fp16 vectors: 8 elements, widened exactly, narrowed with the GPU's rounding.
template <typename Codec>
struct HalfVecMath {
  static constexpr int kElems = 8;
  static void widen(const uint4& v, float (&out)[kElems]) {
    uint16_t h[kElems];
    std::memcpy(h, &v, sizeof(h));
    for (int i = 0; i < kElems; ++i) out[i] = Codec::to_float(h[i]);
  }
  static uint4 narrow(const float (&in)[kElems]) {
    uint16_t h[kElems];
    for (int i = 0; i < kElems; ++i) h[i] = Codec::from_float(in[i]);
    uint4 v;
    std::memcpy(&v, h, sizeof(v));
    return v;
  }
};

template <>
struct VecMath<cpu_device::Bf16> : HalfVecMath<Bf16Codec> {};
template <>
struct VecMath<cpu_device::Fp16> : HalfVecMath<Fp16Codec> {};

template <>
struct VecMath<float> {
  static constexpr int kElems = 4;
  static void widen(const uint4& v, float (&out)[kElems]) { std::memcpy(out, &v, sizeof(out)); }
  static uint4 narrow(const float (&in)[kElems]) {
    uint4 v;
    std::memcpy(&v, in, sizeof(v));
    return v;
  }
};

}  // namespace pcie_ar::transport::kernels
