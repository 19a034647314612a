// cuda_host: the CUDA executor (executors/cuda/kernel_workspace.h) over shared pinned host
// memory (memory/shared_pinned.h), for GPUs without peer-to-peer (consumer cards whose driver
// disables it, IOMMU/ACS or VMs that block it).
//
// Every rank's workspace is a POSIX shared-memory segment (memory/shm_segments.h, the host
// transport's) that each process pins with cudaHostRegister (mapped, portable) for its GPU. The
// kernels and step lists are cuda_ipc's, unchanged: a "peer write" is a posted PCIe write into
// host memory, a "peer read" a read of host DRAM, and every flag and LL word a rank polls is in
// host memory, so each poll is a PCIe round trip. What only the rank itself reads, its generation
// counters, lives in device memory instead: otherwise every call would start with a round trip
// to host memory.
//
// Same guarantees as cuda_ipc: bounded waits that name the peer, parity double buffering,
// capture-safe launches, bitwise-identical results, and nothing left in /dev/shm (the segment
// name is unlinked at retire_token(), or on any failure before it).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "plan/layout.h"
#include "transport/executors/cuda/kernel_workspace.h"
#include "transport/memory/shared_pinned.h"

namespace pcie_ar::transport {

class CudaHostWorkspace final : public CudaKernelWorkspace {
 public:
  // Requires a visible device first (nothing is created in /dev/shm without one), then creates
  // and pins this rank's segment and the device counters. `pdl`: as CudaIpcWorkspace.
  CudaHostWorkspace(const plan::Layout& layout, int rank, int device, uint32_t initial_gen,
                    double timeout_s, bool pdl);
  ~CudaHostWorkspace() override;  // best-effort close_peers() + release(); never throws

  std::string local_token() const override;  // our segment's name
  // Maps and pins every peer's segment; throws naming the peer that cannot be reached.
  void open_peers(const std::vector<std::string>& tokens) override;
  void retire_token() noexcept override;  // unlinks our segment's name
  void close_peers() override;            // unpins, then unmaps the peers' segments

 private:
  // Our segment and the device counters (view_.counters[rank]).
  void release_memory(std::string& errors) override;

  std::unique_ptr<SharedPinnedSegments> memory_;
};

}  // namespace pcie_ar::transport
