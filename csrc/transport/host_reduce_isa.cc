// The reduce kernels by name, over executors/host/reduce.h; see host_reduce_isa.h.
#include "transport/host_reduce_isa.h"

#include <stdexcept>

#include "transport/executors/host/reduce.h"

namespace pcie_ar::transport {

std::string host_reduce_isa() { return std::string(reduce_isa_name(active_reduce_isa())); }

std::vector<std::string> host_reduce_isas() {
  std::vector<std::string> names;
  for (const ReduceIsa isa : kAllReduceIsas) {
    if (reduce_isa_available(isa)) names.emplace_back(reduce_isa_name(isa));
  }
  return names;
}

void set_host_reduce_isa(std::string_view name) {
  const auto isa = parse_reduce_isa(name);
  if (!isa) throw std::invalid_argument(kReduceIsaNames.must_be(name));
  set_reduce_isa(*isa);
}

}  // namespace pcie_ar::transport
