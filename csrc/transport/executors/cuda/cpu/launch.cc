// The CPU device's instantiations of the CUDA executor (the GPU's are executors/cuda/launch.cu):
// the same source, the CPU device's primitives (executors/cuda/primitives.cuh picks them for a host
// compiler). Every header this file needs comes before executor.cuh, which brings the macros
// of CUDA's language with it.
#include "transport/executors/cuda/cpu/launch.h"

#include <functional>
#include <stdexcept>
#include <string>

#include "plan/tactic.h"
#include "transport/executors/cuda/executor.cuh"

namespace pcie_ar::transport::cpu_device {
namespace {

template <typename T>
std::function<void()> kernel_of(const LaunchParams& p) {
  if (p.direction == plan::Direction::kPush) {
    return [&p] { kernels::executor_kernel<T, plan::Direction::kPush>(p); };
  }
  return [&p] { kernels::executor_kernel<T, plan::Direction::kPull>(p); };
}

}  // namespace

LaunchStatus launch_executor(const LaunchParams& p, const DeviceOptions& options) {
  std::function<void()> kernel;
  switch (p.dtype) {
    case plan::DType::kBF16:
      kernel = kernel_of<Bf16>(p);
      break;
    case plan::DType::kFP16:
      kernel = kernel_of<Fp16>(p);
      break;
    case plan::DType::kFP32:
      kernel = kernel_of<float>(p);
      break;
    default:
      throw std::invalid_argument("cpu device: unknown dtype code " +
                                  std::to_string(static_cast<int>(p.dtype)));
  }
  return launch(Dim3{static_cast<unsigned>(p.blocks), static_cast<unsigned>(p.ranks_in_launch), 1},
                Dim3{static_cast<unsigned>(p.threads), 1, 1}, options, kernel);
}

}  // namespace pcie_ar::transport::cpu_device
