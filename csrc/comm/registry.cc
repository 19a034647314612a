#include "comm/registry.h"

#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

namespace pcie_ar::comm {
namespace {
std::mutex registry_mutex;
std::unordered_map<int64_t, std::shared_ptr<Communicator>>& registry() {
  static auto* map = new std::unordered_map<int64_t, std::shared_ptr<Communicator>>();
  return *map;
}
int64_t next_handle = 1;
}  // namespace

int64_t register_communicator(std::shared_ptr<Communicator> communicator) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  const int64_t handle = next_handle++;
  registry()[handle] = std::move(communicator);
  return handle;
}

std::shared_ptr<Communicator> lookup_communicator(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find(handle);
  if (it == registry().end()) {
    throw std::invalid_argument("no pcie_allreduce communicator has handle " +
                                std::to_string(handle) + " (was it destroyed?)");
  }
  return it->second;
}

void unregister_communicator(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry().erase(handle);
}

}  // namespace pcie_ar::comm
