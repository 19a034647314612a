// The pinning half of the cuda_host transport's memory; see shared_pinned.h.
#include "transport/memory/shared_pinned.h"

#include <stdexcept>
#include <utility>

namespace pcie_ar::transport {

SharedPinnedSegments::SharedPinnedSegments(const plan::Layout& layout, int rank,
                                           uint32_t initial_gen,
                                           std::unique_ptr<HostRegistrar> registrar)
    : shm_(layout, rank, initial_gen), registrar_(std::move(registrar)) {
  if (registrar_ == nullptr) {
    shm_.release();
    throw std::invalid_argument("SharedPinnedSegments needs a registrar");
  }
  device_.assign(layout.world, nullptr);
  try {
    device_[rank] = registrar_->pin(shm_.base(rank), layout.total_bytes);
  } catch (const std::exception& e) {
    shm_.release();  // unmaps and unlinks: nothing left in /dev/shm
    throw std::runtime_error("rank " + std::to_string(rank) + ": its own " +
                             std::to_string(layout.total_bytes) +
                             "-byte workspace segment cannot be pinned for the GPU: " + e.what());
  }
}

SharedPinnedSegments::~SharedPinnedSegments() {
  try {
    release();
  } catch (...) {
  }
}

uint8_t* SharedPinnedSegments::device_base(int r) const {
  return r >= 0 && r < static_cast<int>(device_.size()) ? device_[r] : nullptr;
}

void SharedPinnedSegments::unpin(int r, std::string& errors) noexcept {
  if (device_[r] == nullptr) return;
  device_[r] = nullptr;
  std::string why = registrar_->unpin(shm_.base(r));
  if (!why.empty()) errors += " rank " + std::to_string(r) + "'s segment: " + why + ";";
}

void SharedPinnedSegments::open_peers(const std::vector<std::string>& tokens) {
  for (int r = 0; r < static_cast<int>(device_.size()); ++r) {
    if (r != rank() && device_[r] != nullptr) {
      throw std::logic_error("rank " + std::to_string(rank()) +
                             ": open_peers() was already called");
    }
  }
  shm_.open_peers(tokens);  // maps; on failure it has undone itself and unlinked our name
  int peer = -1;
  try {
    for (peer = 0; peer < layout().world; ++peer) {
      if (peer == rank()) continue;
      device_[peer] = registrar_->pin(shm_.base(peer), layout().total_bytes);
    }
  } catch (const std::exception& e) {
    std::string ignored;
    unpin_peers(ignored);
    shm_.close_peers();
    shm_.unlink();
    throw std::runtime_error("rank " + std::to_string(rank()) + ": rank " + std::to_string(peer) +
                             "'s workspace segment cannot be pinned for the GPU: " + e.what());
  }
}

void SharedPinnedSegments::close_peers() {
  std::string errors;
  unpin_peers(errors);
  shm_.close_peers();
  throw_unpin_errors(errors);
}

void SharedPinnedSegments::release() {
  std::string errors;
  unpin_peers(errors);
  shm_.close_peers();
  if (!device_.empty()) unpin(rank(), errors);
  shm_.release();
  throw_unpin_errors(errors);
}

void SharedPinnedSegments::unpin_peers(std::string& errors) noexcept {
  for (int r = 0; r < static_cast<int>(device_.size()); ++r) {
    if (r != rank()) unpin(r, errors);  // the GPU lets go before the mapping goes
  }
}

void SharedPinnedSegments::throw_unpin_errors(const std::string& errors) const {
  if (!errors.empty()) {
    throw std::runtime_error("rank " + std::to_string(rank()) + ": unpinning failed:" + errors);
  }
}

}  // namespace pcie_ar::transport
