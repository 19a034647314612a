// host_shm: the plan executor over POSIX shared memory between CPU processes.
//
// Each rank owns one segment laid out by plan::Layout (generation counters, flags, data slots)
// and maps every peer's segment, so a peer's slots and flags are plain pointers. The executor
// walks the same per-rank step list the CUDA kernel runs, with the same flag protocol
// (plan/protocol.h): it is both the CPU all-reduce backend for CPU tensors and the vehicle that
// exercises every schedule and the flag protocol with real concurrency on machines without GPUs.
//
// Lifecycle (collective: every rank does each step):
//   HostShmWorkspace ws(layout, rank, initial_gen, timeout_s);   // creates our segment
//   exchange ws.name() with every rank (the caller's process group)
//   ws.open_peers(names);                                        // maps every peer's segment
//   barrier                                                      // everyone has mapped us
//   ws.unlink_own();                                             // nothing left in /dev/shm
//   ws.run(program, dtype, blocks, input, output, numel, signature);  // any number of times
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/step.h"
#include "plan/tactic.h"

namespace pcie_ar::transport {

// Thrown when an executor fails (a bounded wait expired, or a peer entered the same generation
// with a different call). Carries the diagnostic the plan layer defines so callers can name the
// peer that never arrived.
class TransportFailure : public std::runtime_error {
 public:
  TransportFailure(const plan::Diagnostic& diagnostic, std::string message);
  const plan::Diagnostic& diagnostic() const { return diagnostic_; }

 private:
  plan::Diagnostic diagnostic_;
};

// One rank's shared-memory workspace and the executor that runs step lists over it.
// Not thread-safe: one call at a time per workspace. Neither copyable nor movable (peers hold
// pointers into the mapping for as long as it lives).
class HostShmWorkspace {
 public:
  // Creates this rank's segment with a unique name ("/pcie_ar.<pid>.<64-bit random hex>.r<rank>"),
  // mode 0600, sized layout.total_bytes (space is reserved up front, so a too-small /dev/shm
  // fails here with a clear error instead of SIGBUS later), and initialises the control area so
  // the first call uses generation initial_gen + 1.
  // timeout_s: the deadline of every wait, in seconds; 0 waits forever.
  // Throws std::invalid_argument for a bad rank or timeout, std::runtime_error if the segment
  // cannot be created.
  HostShmWorkspace(const plan::Layout& layout, int rank, uint32_t initial_gen, double timeout_s);
  ~HostShmWorkspace();  // unmaps everything; unlinks our segment if still linked. Never throws.

  HostShmWorkspace(const HostShmWorkspace&) = delete;
  HostShmWorkspace& operator=(const HostShmWorkspace&) = delete;

  const std::string& name() const { return name_; }
  const plan::Layout& layout() const { return layout_; }
  int rank() const { return rank_; }

  // Maps every peer's segment; names[r] is rank r's name() and names[rank] must be ours.
  // Throws std::runtime_error naming the peer rank if a segment cannot be opened or its size is
  // not layout.total_bytes (both sizes in the message), std::invalid_argument for a wrong name
  // count, std::logic_error if called twice. Whatever was mapped is released by the destructor.
  void open_peers(const std::vector<std::string>& names);

  // Unlinks our segment's name; call once every rank has mapped it. Peers keep their mappings.
  // Idempotent.
  void unlink_own() noexcept;

  // One all-reduce of `numel` elements of `dtype`, executing `program` (this rank's compiled
  // step list). input and output are this process's buffers; they may be the same buffer
  // (in-place) but must not partially overlap. The `blocks` slices of every chunk run in turn,
  // each with its own flags and generation counter, so any block count gives the same result.
  // `signature` (plan::call_signature) travels with every flag so peers detect a different call.
  //
  // Throws std::invalid_argument when the call cannot run on this workspace (numel * dtype bytes
  // not a multiple of 16, numel > layout.max_numel, dtype wider than the layout's elements,
  // blocks outside 1..layout.max_blocks, a program for another rank, world or layout), and
  // std::logic_error before open_peers(). Neither touches shared memory.
  // Throws TransportFailure on a timeout or a peer call mismatch. After that the ranks are out of
  // step and the workspace refuses every further call (TransportFailure with the original
  // diagnostic): recreate it with every rank.
  void run(const plan::Program& program, plan::DType dtype, int blocks, const void* input,
           void* output, int64_t numel, uint32_t signature);

 private:
  void validate_call(const plan::Program& program, plan::DType dtype, int blocks, const void* input,
                     const void* output, int64_t numel) const;
  [[noreturn]] void fail(const plan::Diagnostic& diagnostic);

  plan::Layout layout_;
  int rank_ = 0;
  double timeout_s_ = 0.0;
  std::string name_;
  bool linked_ = false;
  bool peers_open_ = false;
  bool failed_ = false;
  plan::Diagnostic failure_{};
  std::vector<uint8_t*> bases_;  // bases_[r]: rank r's segment as mapped here (ours included)
};

}  // namespace pcie_ar::transport
