// cuda_ipc: the CUDA executor (executors/cuda/kernel_workspace.h) over one cudaMalloc slab per
// rank that every peer maps with a CUDA IPC handle (memory/cuda_memory.h). Needs working
// peer-to-peer between every pair of GPUs; where it fails, cuda_host runs the same kernels over
// host memory.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "plan/layout.h"
#include "transport/executors/cuda/kernel_workspace.h"

namespace pcie_ar::transport {

// One rank's workspace: its slab exported with a CUDA IPC handle and the peers' slabs mapped into
// this process. Teardown is collective: close_peers() on every rank, a barrier, release().
class CudaIpcWorkspace final : public CudaKernelWorkspace {
 public:
  // `pdl`: programmatic dependent launch where the GPU allows it (use_pdl()).
  CudaIpcWorkspace(const plan::Layout& layout, int rank, int device, uint64_t initial_gen,
                   double timeout_s, bool pdl);
  ~CudaIpcWorkspace() override;  // best-effort close_peers() + release(); never throws

  std::string local_token() const override;  // cudaIpcMemHandle_t bytes of our slab
  // tokens[r] is rank r's local_token(); ours is ignored. Maps every peer's slab; throws naming
  // the peer whose slab cannot be mapped, after unmapping the others.
  void open_peers(const std::vector<std::string>& tokens) override;

  void close_peers() override;  // peers unmap before owners free

 private:
  void release_memory(std::string& errors) override;  // the slab

  uint8_t* slab_ = nullptr;
  std::array<uint8_t*, plan::kMaxWorld> opened_{};  // peers' slabs we mapped
};

}  // namespace pcie_ar::transport
