// host_shm: shared-memory segments plus the host executor; see host_shm.h.
#include "transport/host_shm.h"

#include <string>

namespace pcie_ar::transport {

HostShmWorkspace::HostShmWorkspace(const plan::Layout& layout, int rank, uint32_t initial_gen,
                                   double timeout_s)
    : Workspace(layout, rank), executor_(timeout_s), segments_(layout, rank, initial_gen) {}

void HostShmWorkspace::open_peers(const std::vector<std::string>& tokens) {
  segments_.open_peers(tokens);
}

void HostShmWorkspace::open_peers_in_process(const std::vector<HostShmWorkspace*>& peers) {
  std::vector<const ShmSegments*> segments;
  for (const HostShmWorkspace* peer : peers) {
    segments.push_back(peer != nullptr ? &peer->segments_ : nullptr);
  }
  segments_.open_peers_in_process(segments);
}

void HostShmWorkspace::run(const Call& call) {
  if (const auto& failed = executor_.failure()) {
    throw TransportFailure(*failed, "rank " + std::to_string(rank()) +
                                        ": the host_shm workspace is out of step with its "
                                        "peers after an earlier failure (" +
                                        plan::describe_failure(*failed, executor_.timeout_s()) +
                                        "); recreate it on every rank");
  }
  executor_.run(segments_.bases(), layout(), rank(), call);
}

}  // namespace pcie_ar::transport
