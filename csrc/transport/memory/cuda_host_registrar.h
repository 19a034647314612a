// The CUDA HostRegistrar (memory/shared_pinned.h): pins host memory for one GPU with
// cudaHostRegister(mapped | portable) and hands out the address kernels use for it.
#pragma once

#include <cstdint>
#include <string>

#include "transport/memory/shared_pinned.h"

namespace pcie_ar::transport {

class CudaHostRegistrar final : public HostRegistrar {
 public:
  explicit CudaHostRegistrar(int device) : device_(device) {}
  uint8_t* pin(uint8_t* host, uint64_t bytes) override;
  std::string unpin(uint8_t* host) noexcept override;

 private:
  int device_;
};

}  // namespace pcie_ar::transport
