// Which CUDA device a workspace may use; see cuda_device.h.
#include "transport/memory/cuda_device.h"

#include <cuda_runtime.h>

namespace pcie_ar::transport {

void require_device(int device) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // not sticky: leave no error for the caller's next CUDA call
    throw std::runtime_error(
        "CUDA was requested but no CUDA device is visible (cudaGetDeviceCount: " +
        cuda_error_text(err) + ")");
  }
  if (count == 0) {
    throw std::runtime_error(
        "CUDA was requested but no CUDA device is visible (cudaGetDeviceCount: 0 devices)");
  }
  if (device < 0 || device >= count) {
    throw std::invalid_argument("CUDA device " + std::to_string(device) +
                                " does not exist: " + std::to_string(count) +
                                " device(s) are visible (check CUDA_VISIBLE_DEVICES and the "
                                "local rank)");
  }
}

}  // namespace pcie_ar::transport
