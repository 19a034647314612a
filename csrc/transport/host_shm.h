// host_shm: the transport over POSIX shared memory between CPU processes, made of one rank's
// shared-memory segments (memory/shm_segments.h: naming, 0600, reserved space, unlinked once
// every rank has mapped it, orphans reclaimed) and the host executor (executors/host/executor.h:
// the same per-rank step list the CUDA kernel runs, with the same flag protocol). It is both the
// CPU all-reduce for CPU tensors and the vehicle that exercises every schedule and the flag
// protocol with real concurrency on machines without GPUs.
//
// Lifecycle: see transport/workspace.h. The local token is the segment's name.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/step.h"
#include "transport/executors/host/executor.h"
#include "transport/memory/shm_segments.h"
#include "transport/workspace.h"

namespace pcie_ar::transport {

// One rank's shared-memory workspace. Not thread-safe: one call at a time. Neither copyable nor
// movable (peers hold pointers into the mapping for as long as it lives).
class HostShmWorkspace final : public Workspace {
 public:
  static constexpr int kMaxBlocks = HostExecutor::kMaxBlocks;

  // Creates this rank's segment (ShmSegments: unique name "/pcie_ar.<pid>.<64-bit random
  // hex>.r<rank>", 0600, layout.total_bytes reserved, control area at initial_gen) after
  // reclaiming orphaned segments. timeout_s: the deadline of every wait, in seconds; 0 waits
  // forever. Throws std::invalid_argument for a bad rank or timeout (before anything is
  // created), std::runtime_error if the segment cannot be created.
  HostShmWorkspace(const plan::Layout& layout, int rank, uint32_t initial_gen, double timeout_s);
  ~HostShmWorkspace() override = default;  // unmaps everything; unlinks our segment if linked

  int device() const override { return -1; }
  // The executor runs a reduce with two destinations in one pass (plan::fuse_forwarding_copies).
  bool runs_multi_destination_steps() const override { return true; }
  const std::string& segment_name() const { return segments_.name(); }
  // Rank r's segment as mapped here (ours from construction, peers' from open_peers()), or null:
  // the CPU device's tests run the CUDA executor over the same memory.
  uint8_t* mapped_base(int r) const { return segments_.base(r); }

  std::string local_token() const override { return segments_.name(); }
  // ShmSegments::open_peers(): tokens[r] is rank r's segment name, tokens[rank] ours; every
  // failure names the peer and unlinks our name at once.
  void open_peers(const std::vector<std::string>& tokens) override;
  // Unlinks our segment's name (every rank has mapped it); peers keep their mappings. Only the
  // creating process unlinks: a forked child that inherited the workspace never does.
  void retire_token() noexcept override { segments_.unlink(); }
  // open_peers() for ranks that are threads of this process
  // (tests/cpp/transport/test_host_threads.cc): ShmSegments::open_peers_in_process() over each peer
  // workspace's segments, so ThreadSanitizer sees every cross-rank access and its synchronisation.
  // peers[r] is rank r's workspace (peers[rank()] is this one); each must stay alive until this
  // workspace's close_peers().
  void open_peers_in_process(const std::vector<HostShmWorkspace*>& peers);

  // One all-reduce (see Call; HostExecutor::run). Throws TransportFailure on a timeout or a peer
  // call mismatch, and after one refuses every call.
  void run(const Call& call) override;
  std::optional<plan::Diagnostic> failure() const override { return executor_.failure(); }
  void set_interrupt_check(std::function<bool()> check) override {
    executor_.set_interrupt_check(std::move(check));
  }

  void close_peers() override { segments_.close_peers(); }  // unmaps the peers' segments
  void release() override { segments_.release(); }          // unmaps and unlinks our own

  // ---- fault injection, FOR TESTS ONLY (tests/cpp/transport/test_host_chaos.cc): HostExecutor's
  // hook.
  using StepPoint = HostExecutor::StepPoint;
  using StepHook = HostExecutor::StepHook;
  void set_step_hook_for_testing(StepHook hook) { executor_.set_step_hook(std::move(hook)); }
  void set_mutant_for_testing(HostExecutor::Mutant mutant) { executor_.set_mutant(mutant); }

 private:
  int install(const plan::Program& program) override { return executor_.install(program); }

  HostExecutor executor_;  // first: a bad timeout is refused before a segment exists
  ShmSegments segments_;
};

}  // namespace pcie_ar::transport
