// host_shm: the transport over POSIX shared memory between CPU processes.
//
// Each rank owns one segment laid out by plan::Layout (generation counters, flags, data slots)
// and maps every peer's segment, so a peer's slots and flags are plain pointers. The executor
// walks the same per-rank step list the CUDA kernel runs, with the same flag protocol
// (plan/protocol.h) and the same named pieces (run_reduce, raise_flag, wait_flag,
// finish_call): it is both the CPU all-reduce for CPU tensors and the vehicle that exercises
// every schedule and the flag protocol with real concurrency on machines without GPUs.
//
// Lifecycle: see transport/workspace.h. The local token is the segment's name.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/step.h"
#include "transport/workspace.h"

namespace pcie_ar::transport {

// One rank's shared-memory workspace and the executor that runs step lists over it.
// Not thread-safe: one call at a time. Neither copyable nor movable (peers hold pointers into
// the mapping for as long as it lives).
class HostShmWorkspace final : public Workspace {
 public:
  // The host walks a rank's slices in turn on one thread, so a few are plenty.
  static constexpr int kMaxBlocks = 8;

  // Creates this rank's segment with a unique name ("/pcie_ar.<pid>.<64-bit random hex>.r<rank>"),
  // mode 0600, sized layout.total_bytes (space is reserved up front, so a too-small /dev/shm
  // fails here with a clear error instead of SIGBUS later), and initialises the control area so
  // the first call uses generation initial_gen + 1.
  // timeout_s: the deadline of every wait, in seconds; 0 waits forever.
  // Throws std::invalid_argument for a bad rank or timeout, std::runtime_error if the segment
  // cannot be created.
  HostShmWorkspace(const plan::Layout& layout, int rank, uint32_t initial_gen, double timeout_s);
  ~HostShmWorkspace() override;  // unmaps everything; unlinks our segment if still linked

  int device() const override { return -1; }
  const std::string& segment_name() const { return segment_name_; }

  std::string local_token() const override { return segment_name_; }
  // Maps every peer's segment; tokens[r] is rank r's segment name and tokens[rank] must be ours.
  // Throws std::runtime_error naming the peer rank if a segment cannot be opened or its size is
  // not layout.total_bytes (both sizes in the message), std::invalid_argument for a wrong name
  // count, std::logic_error if called twice. Whatever was mapped is released by the destructor.
  void open_peers(const std::vector<std::string>& tokens) override;
  // Unlinks our segment's name (every rank has mapped it); peers keep their mappings.
  void retire_token() noexcept override;

  // One all-reduce (see Call). The `blocks` slices of every chunk run in turn, each with its
  // own flags and generation counter, so any block count gives the same result. Throws
  // TransportFailure on a timeout or a peer call mismatch, and after one refuses every call.
  void run(const Call& call) override;
  std::optional<plan::Diagnostic> failure() const override;

  void close_peers() override;  // unmaps the peers' segments
  void release() override;      // unmaps and unlinks our own segment

 private:
  int install(const plan::Program& program) override;
  void create_segment(uint32_t initial_gen);
  void size_segment(int fd) const;

  double timeout_s_ = 0.0;
  std::string segment_name_;
  bool linked_ = false;
  bool peers_open_ = false;
  std::optional<plan::Diagnostic> failure_;
  std::vector<uint8_t*> bases_;  // bases_[r]: rank r's segment as mapped here (ours included)
  std::vector<plan::Program> programs_;
};

}  // namespace pcie_ar::transport
