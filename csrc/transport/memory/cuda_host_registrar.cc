// How host memory is pinned for a GPU; see cuda_host_registrar.h.
#include "transport/memory/cuda_host_registrar.h"

#include <cuda_runtime.h>

#include <exception>
#include <string>

#include "transport/memory/cuda_device.h"

namespace pcie_ar::transport {

uint8_t* CudaHostRegistrar::pin(uint8_t* host, uint64_t bytes) {
  DeviceGuard guard(device_);
  check(cudaHostRegister(host, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable),
        "cudaHostRegister(mapped | portable) on GPU " + std::to_string(device_));
  void* device_view = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&device_view, host, 0);
  if (err != cudaSuccess) {
    cudaHostUnregister(host);
    check(err, "cudaHostGetDevicePointer on GPU " + std::to_string(device_));
  }
  return static_cast<uint8_t*>(device_view);
}

std::string CudaHostRegistrar::unpin(uint8_t* host) noexcept {
  try {
    DeviceGuard guard(device_);
    check(cudaHostUnregister(host), "cudaHostUnregister");
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

}  // namespace pcie_ar::transport
