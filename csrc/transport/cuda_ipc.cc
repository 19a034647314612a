// cuda_ipc: a slab, its IPC handle and the peers' mappings; see cuda_ipc.h.
#include "transport/cuda_ipc.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "transport/memory/cuda_device.h"
#include "transport/memory/cuda_memory.h"

namespace pcie_ar::transport {

CudaIpcWorkspace::CudaIpcWorkspace(const plan::Layout& layout, int rank, int device,
                                   uint64_t initial_gen, double timeout_s, bool pdl)
    : CudaKernelWorkspace(layout, rank, device, timeout_s, pdl) {
  DeviceGuard guard(device);
  slab_ = allocate_slab(layout, initial_gen);
  view_.bases[rank] = slab_;
  // Initialisation ran on the legacy stream; callers launch on their own (non-blocking) ones.
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    cudaFree(slab_);
    check(err, "initialising the all-reduce workspace");
  }
}

CudaIpcWorkspace::~CudaIpcWorkspace() { teardown(); }

std::string CudaIpcWorkspace::local_token() const {
  if (slab_ == nullptr) throw std::logic_error("local_token(): the workspace was freed");
  DeviceGuard guard(device());
  return ipc_token(slab_);
}

void CudaIpcWorkspace::open_peers(const std::vector<std::string>& tokens) {
  const int world = view_.layout.world;
  if (static_cast<int>(tokens.size()) != world) {
    throw std::invalid_argument("open_peers(): expected one handle per rank (" +
                                std::to_string(world) + "), got " +
                                std::to_string(static_cast<int64_t>(tokens.size())));
  }
  if (peers_open_) throw std::logic_error("open_peers(): the peers are already open");
  if (slab_ == nullptr) throw std::logic_error("open_peers(): the workspace was freed");
  DeviceGuard guard(device());
  for (int r = 0; r < world; ++r) {
    if (r == rank()) continue;
    try {
      opened_[r] = open_ipc_token(tokens[r], r, rank());
      view_.bases[r] = opened_[r];
    } catch (...) {
      try {
        close_peers();
      } catch (...) {
      }
      throw;
    }
  }
  peers_open_ = true;
}

void CudaIpcWorkspace::close_peers() {
  std::string errors;
  DeviceGuard guard(device());
  for (int r = 0; r < plan::kMaxWorld; ++r) {
    if (opened_[r] == nullptr) continue;
    const cudaError_t err = cudaIpcCloseMemHandle(opened_[r]);
    if (err != cudaSuccess)
      errors += " rank " + std::to_string(r) + ": " + cuda_error_text(err) + ";";
    opened_[r] = nullptr;
    view_.bases[r] = nullptr;
  }
  peers_open_ = false;
  if (!errors.empty())
    throw std::runtime_error("close_peers(): cudaIpcCloseMemHandle failed:" + errors);
}

void CudaIpcWorkspace::release_memory(std::string& errors) {
  if (slab_ != nullptr) {
    const cudaError_t err = cudaFree(slab_);
    if (err != cudaSuccess) errors += " workspace: " + cuda_error_text(err) + ";";
  }
  slab_ = nullptr;
}

}  // namespace pcie_ar::transport
