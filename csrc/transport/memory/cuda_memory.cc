// How the CUDA transports allocate, initialise, export and read back their memory; see
// cuda_memory.h.
#include "transport/memory/cuda_memory.h"

#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <vector>

#include "transport/memory/cuda_device.h"

namespace pcie_ar::transport {

void initialize_slab(uint8_t* slab, const plan::Layout& layout, uint64_t initial_gen) {
  std::vector<uint8_t> control(layout.control_bytes);
  plan::initialize_control(control.data(), layout, initial_gen);
  check(cudaMemcpy(slab, control.data(), control.size(), cudaMemcpyHostToDevice),
        "initialising the workspace control area");
  check(cudaMemset(slab + layout.control_bytes, 0, layout.total_bytes - layout.control_bytes),
        "zeroing the workspace data slots");
}

uint8_t* allocate_slab(const plan::Layout& layout, uint64_t initial_gen) {
  uint8_t* slab = nullptr;
  check(cudaMalloc(&slab, layout.total_bytes),
        "cudaMalloc of the " + std::to_string(layout.total_bytes) + "-byte all-reduce workspace");
  try {
    initialize_slab(slab, layout, initial_gen);
  } catch (...) {
    cudaFree(slab);
    throw;
  }
  return slab;
}

uint8_t* allocate_device_counters(const plan::Layout& layout, uint64_t initial_gen) {
  std::vector<uint8_t> control(layout.control_bytes);
  plan::initialize_control(control.data(), layout, initial_gen);
  const uint64_t bytes = layout.gen_counter_offset(layout.max_blocks);
  uint8_t* counters = nullptr;
  check(cudaMalloc(&counters, bytes), "cudaMalloc of the generation counters");
  const cudaError_t err = cudaMemcpy(counters, control.data(), bytes, cudaMemcpyHostToDevice);
  if (err != cudaSuccess) {
    cudaFree(counters);
    check(err, "initialising the generation counters");
  }
  return counters;
}

void* allocate_mapped(uint64_t bytes, void** device_view, const std::string& what) {
  void* host = nullptr;
  check(cudaHostAlloc(&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
        "cudaHostAlloc of " + what);
  const cudaError_t err = cudaHostGetDevicePointer(device_view, host, 0);
  if (err != cudaSuccess) {
    cudaFreeHost(host);
    check(err, "cudaHostGetDevicePointer of " + what);
  }
  return host;
}

plan::Diagnostic* allocate_diag(plan::Diagnostic** device_view) {
  void* device = nullptr;
  void* host = allocate_mapped(sizeof(plan::Diagnostic), &device, "the failure record");
  std::memset(host, 0, sizeof(plan::Diagnostic));
  *device_view = static_cast<plan::Diagnostic*>(device);
  return static_cast<plan::Diagnostic*>(host);
}

uint32_t* allocate_claim() {
  uint32_t* claim = nullptr;
  check(cudaMalloc(&claim, sizeof(uint32_t)), "cudaMalloc of the failure claim word");
  const cudaError_t err = cudaMemset(claim, 0, sizeof(uint32_t));
  if (err != cudaSuccess) {
    cudaFree(claim);
    check(err, "zeroing the failure claim word");
  }
  return claim;
}

const plan::Program* upload_program(const plan::Program& program) {
  plan::Program* device = nullptr;
  check(cudaMalloc(&device, sizeof(plan::Program)), "cudaMalloc of a step list");
  const cudaError_t err =
      cudaMemcpy(device, &program, sizeof(plan::Program), cudaMemcpyHostToDevice);
  if (err != cudaSuccess) {
    cudaFree(device);
    check(err, "uploading a step list");
  }
  return device;
}

std::optional<plan::Diagnostic> read_diag(const plan::Diagnostic* host) {
  if (host == nullptr) return std::nullopt;
  const volatile plan::Diagnostic* record = host;
  if (record->kind == static_cast<uint32_t>(plan::FailureKind::kNone)) return std::nullopt;
  plan::Diagnostic copy;
  const volatile uint32_t* words = reinterpret_cast<const volatile uint32_t*>(record);
  uint32_t* out = reinterpret_cast<uint32_t*>(&copy);
  for (size_t i = 0; i < sizeof(plan::Diagnostic) / sizeof(uint32_t); ++i) out[i] = words[i];
  return copy;
}

std::string ipc_token(uint8_t* slab) {
  cudaIpcMemHandle_t handle;
  check(cudaIpcGetMemHandle(&handle, slab), "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

uint8_t* open_ipc_token(const std::string& token, int peer, int rank) {
  if (token.size() != sizeof(cudaIpcMemHandle_t)) {
    throw std::invalid_argument("open_peers(): rank " + std::to_string(peer) + "'s handle has " +
                                std::to_string(token.size()) + " bytes; a cudaIpcMemHandle_t has " +
                                std::to_string(sizeof(cudaIpcMemHandle_t)));
  }
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, token.data(), sizeof(handle));
  void* mapped = nullptr;
  // Lazy peer access: the driver enables P2P for exactly the pairs that map each other.
  check(cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess),
        "cudaIpcOpenMemHandle of rank " + std::to_string(peer) + "'s workspace on rank " +
            std::to_string(rank));
  return static_cast<uint8_t*>(mapped);
}

}  // namespace pcie_ar::transport
