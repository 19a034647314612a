// Every rank's workspace in POSIX shared memory, pinned for this process's GPU: the memory of the
// cuda_host transport (GPUs without peer-to-peer). The segments are the host transport's
// (ShmSegments creates, names, sizes, protects, maps and unlinks them, and reclaims those of
// dead creators); this class adds the pinning, through a HostRegistrar, so that what is pinned
// when, what a failure undoes and the teardown order are plain C++ that tests check without a
// GPU (tests/cpp/transport/test_shared_pinned.cc). cuda_host_registrar.h is the CUDA registrar.
//
// One segment per rank rather than one for the group: each rank creates (and first-touches) its
// own, so on a two-socket host a rank's slots and flags sit in its own socket's memory, and the
// naming, size check and orphan reclaim of the host transport apply unchanged.
//
// Lifecycle (collective, as transport/workspace.h): construct (creates and pins our segment),
// gather local_token(), open_peers() (maps and pins every peer's), barrier, retire_token() (the
// name is unlinked: nothing left in /dev/shm), ... close_peers() (unpins, then unmaps the
// peers'), barrier, release().
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "plan/layout.h"
#include "transport/memory/shm_segments.h"

namespace pcie_ar::transport {

// Pins host memory for one GPU. The CUDA one calls cudaHostRegister (mapped, portable) and
// cudaHostGetDevicePointer; tests substitute one that records and fails on demand.
class HostRegistrar {
 public:
  virtual ~HostRegistrar() = default;
  // Pins [host, host + bytes) and returns the address kernels use for it. Throws
  // std::runtime_error saying why it cannot.
  virtual uint8_t* pin(uint8_t* host, uint64_t bytes) = 0;
  // Undoes pin(host): "" on success, else why not. Never throws.
  virtual std::string unpin(uint8_t* host) noexcept = 0;
};

class SharedPinnedSegments {
 public:
  // Creates our segment (ShmSegments: control area at initial_gen, data zeroed) and pins
  // it. If pinning fails the segment is unmapped and unlinked and the error names this rank.
  SharedPinnedSegments(const plan::Layout& layout, int rank, uint32_t initial_gen,
                       std::unique_ptr<HostRegistrar> registrar);
  ~SharedPinnedSegments();  // best-effort release(); never throws
  SharedPinnedSegments(const SharedPinnedSegments&) = delete;
  SharedPinnedSegments& operator=(const SharedPinnedSegments&) = delete;

  const plan::Layout& layout() const { return shm_.layout(); }
  int rank() const { return shm_.rank(); }
  std::string local_token() const { return shm_.name(); }

  // Maps every peer's segment (tokens[r] is rank r's local_token()), then pins each. Throws
  // naming the peer whose segment cannot be mapped or pinned; before it does, everything
  // pinned and mapped here is undone and our own name is unlinked (this rank will not reach
  // the barrier, and a peer that has not mapped us yet fails at once instead of waiting).
  // std::logic_error if the peers are open already.
  void open_peers(const std::vector<std::string>& tokens);
  void retire_token() noexcept { shm_.unlink(); }
  // Unpins every peer's segment, then unmaps them. Throws listing the peers whose unpin failed,
  // after every one was attempted (the mappings go regardless).
  void close_peers();
  // close_peers(), then unpins, unmaps and unlinks our own segment. Idempotent; throws like
  // close_peers() after finishing.
  void release();

  // Rank r's segment as the GPU addresses it (pinned), or null when it is not.
  uint8_t* device_base(int r) const;
  // Rank r's segment as this process maps it, or null.
  uint8_t* host_base(int r) const { return shm_.base(r); }

 private:
  // Unpins rank r's segment (every peer's) if pinned; appends failures to `errors`.
  void unpin(int r, std::string& errors) noexcept;
  void unpin_peers(std::string& errors) noexcept;
  void throw_unpin_errors(const std::string& errors) const;

  ShmSegments shm_;
  std::unique_ptr<HostRegistrar> registrar_;
  std::vector<uint8_t*> device_;  // device_[r]: rank r's segment as pinned, or null
};

}  // namespace pcie_ar::transport
