// The CUDA memory a workspace is made of, allocated, initialised, exported and read back: slabs
// (a rank's layout in device memory), generation counters in device memory (for a slab far from
// the GPU), mapped pinned host memory and the failure record kernels write into it, the failure
// claim word, uploaded step lists, and CUDA IPC handles. Plain C++ over the runtime API; every
// function expects the owning device to be current and throws std::runtime_error naming what
// could not be done (memory/cuda_device.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/step.h"

namespace pcie_ar::transport {

// ------------------------------------------------------------------ slabs

// Counters and flags at initial_gen (the first call expects initial_gen + 1), every LL word
// tagged stale, data zeroed so nothing stale from a previous owner of the memory can be reduced.
// `slab` is any device-addressable memory of layout.total_bytes.
void initialize_slab(uint8_t* slab, const plan::Layout& layout, uint64_t initial_gen);
// A cudaMalloc slab of layout.total_bytes, initialised (initialize_slab). Free with cudaFree.
uint8_t* allocate_slab(const plan::Layout& layout, uint64_t initial_gen);
// Device memory holding one rank's generation counters at initial_gen, addressed like a slab
// (plan::Layout::gen_counter_offset from the returned pointer): for a slab far from the GPU.
// Free it with cudaFree.
uint8_t* allocate_device_counters(const plan::Layout& layout, uint64_t initial_gen);

// ------------------------------------------------------------------ mapped host memory

// `bytes` of mapped pinned host memory (free with cudaFreeHost); *device_view is its address for
// kernels. `what` names it in errors.
void* allocate_mapped(uint64_t bytes, void** device_view, const std::string& what);
// The failure record: a zeroed Diagnostic in mapped host memory that a failing kernel writes,
// readable after the context dies. Returns the host address (free with cudaFreeHost);
// *device_view is the kernels'.
plan::Diagnostic* allocate_diag(plan::Diagnostic** device_view);
// What a failed kernel recorded at `host` (allocate_diag), or nullopt (none yet, or null).
std::optional<plan::Diagnostic> read_diag(const plan::Diagnostic* host);

// ------------------------------------------------------------------ executor state

// A zeroed device word: the first failing CTA claims it and records, the others trap. cudaFree.
uint32_t* allocate_claim();
// A device copy of `program` (checked already: plan::check_program). Free with cudaFree.
const plan::Program* upload_program(const plan::Program& program);

// ------------------------------------------------------------------ CUDA IPC

// The cudaIpcMemHandle_t bytes of a cudaMalloc `slab`: what a peer needs to map it.
std::string ipc_token(uint8_t* slab);
// Maps rank `peer`'s slab from its ipc_token() into this process (on `rank`, for messages);
// throws std::invalid_argument for a token of the wrong size. Unmap with cudaIpcCloseMemHandle.
uint8_t* open_ipc_token(const std::string& token, int peer, int rank);

}  // namespace pcie_ar::transport
