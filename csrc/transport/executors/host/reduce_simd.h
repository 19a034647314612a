// Internal to the host reduce (reduce.cc, reduce_x86.cc): the per-ISA reducer tables.
#pragma once

#include "transport/executors/host/reduce.h"

namespace pcie_ar::transport::detail {

// The portable reference; the vector reducers also run it on their last few vectors.
ReduceFn scalar_reducer(plan::DType dtype);

// nullptr when this build has no such code (not x86-64); callers check the CPU first.
ReduceFn avx2_reducer(plan::DType dtype);
ReduceFn avx512_reducer(plan::DType dtype);

// What this CPU and OS run: AVX2 with F16C, and AVX-512 F/BW/VL (registers saved by the OS).
bool cpu_runs_avx2();
bool cpu_runs_avx512();

}  // namespace pcie_ar::transport::detail
