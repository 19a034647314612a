// The primitives the CUDA executor (executor.cuh) is written against, whatever machine runs it:
// this header picks the machine's implementation, so the executor's source stays the same for
// every machine. Each implementation defines, in pcie_ar::transport::kernels: load_cg, load_cv,
// store_cg, load_operand<D>, FlagBits, load_flag_acquire_sys, store_flag_release_sys,
// load_volatile_u64, store_volatile_u64, load_ll, store_ll, store_ll_payload,
// wait_for_previous_grid, allow_dependent_grids, global_timer_ns, VecMath<T> and sum_in_order<T,
// N>.
//
//   primitives_gpu.cuh  a GPU: PTX loads, stores and fences (nvcc)
#pragma once

#include "transport/executors/cuda/primitives_gpu.cuh"
