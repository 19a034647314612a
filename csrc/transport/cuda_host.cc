// cuda_host: pinned shared segments under the CUDA executor; see cuda_host.h.
#include "transport/cuda_host.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "transport/memory/cuda_device.h"
#include "transport/memory/cuda_host_registrar.h"
#include "transport/memory/cuda_memory.h"

namespace pcie_ar::transport {

CudaHostWorkspace::CudaHostWorkspace(const plan::Layout& layout, int rank, int device,
                                     uint32_t initial_gen, double timeout_s, bool pdl)
    : CudaKernelWorkspace(layout, rank, device, timeout_s, pdl) {
  DeviceGuard guard(device);
  memory_ = std::make_unique<SharedPinnedSegments>(layout, rank, initial_gen,
                                                   std::make_unique<CudaHostRegistrar>(device));
  try {
    view_.counters[rank] = allocate_device_counters(layout, initial_gen);
  } catch (...) {
    memory_.reset();  // unpins, unmaps, unlinks
    throw;
  }
  view_.bases[rank] = memory_->device_base(rank);
  view_.slots_in_host_memory = true;
}

CudaHostWorkspace::~CudaHostWorkspace() { teardown(); }

std::string CudaHostWorkspace::local_token() const {
  if (memory_ == nullptr) throw std::logic_error("local_token(): the workspace was freed");
  return memory_->local_token();
}

void CudaHostWorkspace::open_peers(const std::vector<std::string>& tokens) {
  if (memory_ == nullptr) throw std::logic_error("open_peers(): the workspace was freed");
  if (peers_open_) throw std::logic_error("open_peers(): the peers are already open");
  memory_->open_peers(tokens);
  for (int r = 0; r < layout().world; ++r) view_.bases[r] = memory_->device_base(r);
  peers_open_ = true;
}

void CudaHostWorkspace::retire_token() noexcept {
  if (memory_ != nullptr) memory_->retire_token();
}

void CudaHostWorkspace::close_peers() {
  for (int r = 0; r < plan::kMaxWorld; ++r) {
    if (r != rank()) view_.bases[r] = nullptr;
  }
  peers_open_ = false;
  if (memory_ != nullptr) memory_->close_peers();
}

void CudaHostWorkspace::release_memory(std::string& errors) {
  if (view_.counters[rank()] != nullptr) {
    const cudaError_t err = cudaFree(view_.counters[rank()]);
    if (err != cudaSuccess) errors += " generation counters: " + cuda_error_text(err) + ";";
    view_.counters[rank()] = nullptr;
  }
  std::unique_ptr<SharedPinnedSegments> memory = std::move(memory_);
  if (memory != nullptr) {
    try {
      memory->release();
    } catch (const std::exception& e) {
      errors += std::string(" ") + e.what() + ";";
    }
  }
}

}  // namespace pcie_ar::transport
