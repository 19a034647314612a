// The primitives the CUDA executor (executor.cuh) is written against, for the machine it is
// compiled for: this header picks the implementation, so the executor's source is the same for
// every machine. Each defines, in pcie_ar::transport::kernels, with the same meaning: load_cg,
// load_cv, store_cg, store_cg_v2_u32, store_cg_u32, load_operand<D>, FlagBits,
// load_flag_acquire_sys, store_flag_release_sys, load_volatile_u64, store_volatile_u64, load_ll,
// store_ll, store_ll_vector, store_ll_payload, wait_for_previous_grid, allow_dependent_grids,
// global_timer_ns, kLLGroup, kLLDenseGroup, thread_index, opaque_u32, opaque_f32, claim_first,
// fence_system, trap_kernel, load_read_only, add_rn, mul_rn, div_rn, sqrt_rn and VecMath<T>.
//
//   primitives_gpu.cuh  a GPU: PTX loads, stores and fences (nvcc)
//   cpu/primitives.h    the CPU device: C++ atomics over its execution and memory models (a host
//                       compiler; cpu/device.h says what it is and what it leaves to a GPU)
#pragma once

#if defined(__CUDACC__)
#include "transport/executors/cuda/primitives_gpu.cuh"
#else
#include "transport/executors/cuda/cpu/primitives.h"
#endif
