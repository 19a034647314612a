// The CUDA runtime as the CUDA memory and executor use it: errors as exceptions that name the
// call, the device a workspace needs, and a scoped current device. Plain C++ over the runtime API.
#pragma once

#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

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

// Throws std::runtime_error "CUDA was requested but no CUDA device is visible (...)" when no
// GPU is usable, and std::invalid_argument when `device` is not one of the visible devices.
void require_device(int device);

}  // namespace pcie_ar::transport
