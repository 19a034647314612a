// How many CTAs fit, and which tactics the kernels can therefore run; see residency.h.
#include "transport/executors/cuda/residency.h"

#include <cuda_runtime.h>

#include "transport/memory/cuda_device.h"

namespace pcie_ar::transport {

ResidencyTable measure_residency(int device) {
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute(MultiProcessorCount)");
  ResidencyTable table;
  for (plan::DType dtype : plan::kAllDTypes) {
    for (plan::Direction dir : {plan::Direction::kPush, plan::Direction::kPull}) {
      for (int t = kWarpThreads; t <= kMaxThreads; t += kWarpThreads) {
        table.ctas[static_cast<int>(dtype)][static_cast<int>(dir)][t / kWarpThreads - 1] =
            sms * executor_ctas_per_sm(dtype, dir, t);
      }
    }
  }
  return table;
}

std::optional<std::string> why_kernels_cannot_run(const plan::Tactic& tactic, int ctas,
                                                  const ResidencyTable& residency) {
  if (tactic.threads < kWarpThreads || tactic.threads > kMaxThreads ||
      tactic.threads % kWarpThreads != 0) {
    return "threads must be a multiple of " + std::to_string(kWarpThreads) + " in " +
           std::to_string(kWarpThreads) + ".." + std::to_string(kMaxThreads) + ", got " +
           std::to_string(tactic.threads);
  }
  for (plan::DType dtype : plan::kAllDTypes) {
    const int resident = residency.at(dtype, tactic.direction, tactic.threads);
    if (ctas > resident) {
      return std::to_string(ctas) + " CTAs of " + std::to_string(tactic.threads) +
             " threads do not fit on the GPU at once (at most " + std::to_string(resident) +
             " for " + std::string(plan::dtype_name(dtype)) + ")";
    }
  }
  return std::nullopt;
}

}  // namespace pcie_ar::transport
