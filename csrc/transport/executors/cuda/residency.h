// Which launch shapes the CUDA executor can run on a GPU: whole warps, and every CTA of a launch
// resident at once (peers' CTA b waits for ours, so a CTA that never becomes resident would stall
// them). Measured once per workspace, so that launches (possibly under graph capture) only look
// it up.
#pragma once

#include <optional>
#include <string>

#include "plan/tactic.h"
#include "transport/executors/cuda/launch.h"

namespace pcie_ar::transport {

// How many CTAs of each executor instantiation the GPU keeps resident at once, by thread count.
struct ResidencyTable {
  int ctas[3][2][kMaxThreads / kWarpThreads] = {};  // [dtype][direction][threads / 32 - 1]
  int at(plan::DType dtype, plan::Direction direction, int threads) const {
    return ctas[static_cast<int>(dtype)][static_cast<int>(direction)][threads / kWarpThreads - 1];
  }
};

// The table of `device` (current): its SM count times each instantiation's CTAs per SM.
ResidencyTable measure_residency(int device);

// Why the kernels cannot run `tactic` on a GPU with `residency`, or nullopt: threads must be
// whole warps in 32..1024, and `ctas` CTAs of every instantiation must be resident at once.
std::optional<std::string> why_kernels_cannot_run(const plan::Tactic& tactic, int ctas,
                                                  const ResidencyTable& residency);

}  // namespace pcie_ar::transport
