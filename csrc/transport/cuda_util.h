// Host-side helpers the CUDA transports share (cuda_ipc.cc, cuda_host.cc): error text, a scoped
// current device, and device memory for generation counters. Plain C++ over the runtime API.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "plan/layout.h"

namespace pcie_ar::transport {

inline std::string cuda_error_text(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

// Throws std::runtime_error "<what> failed (<error>)" unless err is cudaSuccess.
inline void check(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) throw std::runtime_error(what + " failed (" + cuda_error_text(err) + ")");
}

// Makes `device` current for a scope and restores the caller's device: the torch layer owns the
// current device, we only borrow it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) {
      check(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
    }
  }
  ~DeviceGuard() {
    int current = previous_;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// Device memory holding one rank's generation counters at initial_gen, addressed like a slab
// (plan::Layout::gen_counter_offset from the returned pointer): for a slab far from the GPU.
// Free it with cudaFree.
uint8_t* allocate_device_counters(const plan::Layout& layout, uint64_t initial_gen);

}  // namespace pcie_ar::transport
