// The host executor's reduce kernels as the layers above choose them: by name, process-wide. The
// choice changes speed, never results (every kernel set is bit-identical to the scalar
// reference), so ranks may differ. What the kernels are is executors/host/reduce.h.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace pcie_ar::transport {

// The kernels CPU all-reduces use now: "scalar", "avx2" or "avx512".
std::string host_reduce_isa();
// The kernels this CPU and build run, narrowest first ("scalar" always).
std::vector<std::string> host_reduce_isas();
// Chooses the kernels of later CPU all-reduces in this process. Throws std::invalid_argument
// for an unknown name ("host reduce kernels must be scalar, avx2 or avx512, got 'x'") or for
// kernels this CPU does not run (naming what it runs).
void set_host_reduce_isa(std::string_view name);

}  // namespace pcie_ar::transport
