// The transport interface's shared half (program checks, tactic limits) and the factory: the
// only place in the tree that asks whether this build has CUDA.
#include "transport/workspace.h"

#include <algorithm>
#include <utility>

#include "plan/program_check.h"
#include "transport/host_shm.h"

#if defined(PCIE_AR_HAVE_CUDA)
#include "transport/cuda_host.h"
#include "transport/cuda_ipc.h"
#endif

namespace pcie_ar::transport {

TransportFailure::TransportFailure(const plan::Diagnostic& diagnostic, std::string message)
    : std::runtime_error(std::move(message)), diagnostic_(diagnostic) {}

Workspace::Workspace(const plan::Layout& layout, int rank) : layout_(layout), rank_(rank) {}

int Workspace::add_program(const plan::Program& program) {
  plan::check_program(program, layout_, rank_);
  return install(program);
}

std::optional<std::string> Workspace::why_not(const plan::Tactic& tactic) const {
  if (tactic.blocks < 1 || tactic.blocks > layout_.max_blocks) {
    return "blocks must be in 1.." + std::to_string(layout_.max_blocks) +
           " (the workspace's max_blocks), got " + std::to_string(tactic.blocks);
  }
  return transport_limits(tactic);
}

std::unique_ptr<Workspace> make_workspace(const WorkspaceOptions& o) {
  const auto layout = [&](int max_blocks) {
    return plan::make_layout(o.max_numel, o.world, o.elem_bytes, max_blocks);
  };
  switch (o.transport) {
    case Kind::kHostShm:
      return std::make_unique<HostShmWorkspace>(
          layout(std::min(o.max_blocks, HostShmWorkspace::kMaxBlocks)), o.rank, o.initial_gen,
          o.timeout_s);
    case Kind::kCudaIpc:
    case Kind::kCudaHost:
#if defined(PCIE_AR_HAVE_CUDA)
      if (o.transport == Kind::kCudaIpc) {
        return std::make_unique<CudaIpcWorkspace>(layout(o.max_blocks), o.rank, o.device,
                                                  o.initial_gen, o.timeout_s, o.pdl);
      }
      return std::make_unique<CudaHostWorkspace>(layout(o.max_blocks), o.rank, o.device,
                                                 o.initial_gen, o.timeout_s, o.pdl);
#else
      throw std::runtime_error("the " + std::string(kKindNames.name_of(o.transport)) +
                               " transport was requested but pcie_allreduce was built without "
                               "CUDA");
#endif
  }
  throw std::invalid_argument("unknown transport code " +
                              std::to_string(static_cast<int>(o.transport)) + "; expected one of " +
                              kKindNames.list());
}

}  // namespace pcie_ar::transport
