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

// The instantiation a GPU runs (executor_bound), or options.executor_bound's.
template <typename T>
std::function<void()> kernel_of(const LaunchParams& p, const DeviceOptions& options) {
  using plan::Direction;
  if (p.direction == Direction::kPull) {  // one instantiation: executor_bound's kMaxThreads
    return [&p] { kernels::executor_kernel<T, Direction::kPull, kMaxThreads>(p); };
  }
  const int bound =
      options.executor_bound != 0 ? options.executor_bound : executor_bound(p.direction, p.threads);
  if (bound == kDecodeThreads && p.threads <= kDecodeThreads) {
    return [&p] { kernels::executor_kernel<T, Direction::kPush, kDecodeThreads>(p); };
  }
  if (bound != kMaxThreads) {
    throw std::invalid_argument(
        "cpu device: no executor instantiation bounded to " + std::to_string(bound) +
        " threads runs a push launch of " + std::to_string(p.threads) +
        " threads (bounds: " + std::to_string(kDecodeThreads) +
        ", for push launches of at most that many, and " + std::to_string(kMaxThreads) + ")");
  }
  return [&p] { kernels::executor_kernel<T, Direction::kPush, kMaxThreads>(p); };
}

}  // namespace

LaunchStatus launch_executor(const LaunchParams& p, const DeviceOptions& options) {
  std::function<void()> kernel;
  switch (p.dtype) {
    case plan::DType::kBF16:
      kernel = kernel_of<Bf16>(p, options);
      break;
    case plan::DType::kFP16:
      kernel = kernel_of<Fp16>(p, options);
      break;
    case plan::DType::kFP32:
      kernel = kernel_of<float>(p, options);
      break;
    default:
      throw std::invalid_argument("cpu device: unknown dtype code " +
                                  std::to_string(static_cast<int>(p.dtype)));
  }
  return launch(Dim3{static_cast<unsigned>(p.blocks), static_cast<unsigned>(p.ranks_in_launch), 1},
                Dim3{static_cast<unsigned>(p.threads), 1, 1}, options, kernel);
}

}  // namespace pcie_ar::transport::cpu_device
