// Marks the plan layer's small arithmetic helpers callable from CUDA kernels as well as from
// host code, without making the plan layer depend on CUDA.
#pragma once

#if defined(__CUDACC__)
#define PCIE_AR_HD __host__ __device__ __forceinline__
#else
#define PCIE_AR_HD inline
#endif
