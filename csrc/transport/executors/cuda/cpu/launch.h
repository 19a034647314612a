// The CUDA executor launched on the CPU device: the kernel source of executors/cuda/executor.cuh,
// compiled by the host compiler (launch.cc), run by the CPU device (device.h).
#pragma once

#include "transport/executors/cuda/cpu/device.h"
#include "transport/executors/cuda/kernel_params.h"

namespace pcie_ar::transport::cpu_device {

// Runs the executor instantiation for (p.dtype, p.direction, executor_bound(p.direction,
// p.threads)), or options.executor_bound's, as one synchronous launch of grid
// (p.blocks, p.ranks_in_launch) with p.threads threads per CTA, as executors/cuda/launch.cu
// launches it on a GPU. kTrapped when a wait failed: the executor recorded why in *p.diag first.
LaunchStatus launch_executor(const LaunchParams& p, const DeviceOptions& options);

}  // namespace pcie_ar::transport::cpu_device
