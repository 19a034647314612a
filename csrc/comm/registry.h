// Communicators reachable from the torch ops by an integer handle.
#pragma once

#include <cstdint>
#include <memory>

namespace pcie_ar::comm {

class Communicator;

int64_t register_communicator(std::shared_ptr<Communicator> communicator);
// Throws std::invalid_argument for a handle never registered or already unregistered.
std::shared_ptr<Communicator> lookup_communicator(int64_t handle);
void unregister_communicator(int64_t handle);

}  // namespace pcie_ar::comm
