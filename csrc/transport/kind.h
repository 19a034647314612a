// The transports by name: one enum for every layer that has to say which transport it means.
// Canonical names are the transports' own (their files: host_shm, cuda_ipc, cuda_host); the
// aliases are the names callers used before, accepted wherever a name is parsed. Values cross
// into Python and logs: explicit and append-only.
#pragma once

#include <cstdint>

#include "plan/names.h"

namespace pcie_ar::transport {

enum class Kind : uint8_t {
  kHostShm = 0,   // CPU processes over POSIX shared memory (CPU tensors)
  kCudaIpc = 1,   // CUDA kernels over cudaMalloc slabs mapped with CUDA IPC (P2P)
  kCudaHost = 2,  // the same kernels over shared pinned host memory (GPUs without P2P)
};

inline constexpr auto kKindNames =
    plan::name_table<Kind>("transport", {
                                            {Kind::kHostShm, "host_shm", {"host"}},
                                            {Kind::kCudaIpc, "cuda_ipc", {"cuda", "p2p"}},
                                            {Kind::kCudaHost, "cuda_host", {"hostmem"}},
                                        });

}  // namespace pcie_ar::transport
