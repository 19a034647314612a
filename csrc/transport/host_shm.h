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
//
// Nothing outlives its creator in /dev/shm. A segment's name is linked only between its
// creation and retire_token() (every peer has mapped it by then); every failure on the way
// (constructor, open_peers, destructor) unlinks it too. A process killed inside that window
// cannot clean up, so the name carries the creator's pid and every new workspace first removes
// the names of creators that no longer exist (reclaim_orphaned_segments()).
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
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

  // First reclaims orphaned segments (reclaim_orphaned_segments()), then creates this rank's
  // segment with a unique name ("/pcie_ar.<pid>.<64-bit random hex>.r<rank>"), mode 0600, sized
  // layout.total_bytes (space is reserved up front, so a too-small /dev/shm fails here with a clear
  // error instead of SIGBUS later), and initialises the control area so the first call uses
  // generation initial_gen + 1. timeout_s: the deadline of every wait, in seconds; 0 waits forever.
  // Throws std::invalid_argument for a bad rank or timeout, std::runtime_error if the segment
  // cannot be created.
  HostShmWorkspace(const plan::Layout& layout, int rank, uint32_t initial_gen, double timeout_s);
  ~HostShmWorkspace() override;  // unmaps everything; unlinks our segment if still linked

  int device() const override { return -1; }
  const std::string& segment_name() const { return segment_name_; }
  // Rank r's segment as mapped in this process (ours from construction, peers' from
  // open_peers()), or null. Other transports reuse these segments (transport/shared_pinned.h).
  uint8_t* mapped_base(int r) const {
    return r >= 0 && r < static_cast<int>(bases_.size()) ? bases_[r] : nullptr;
  }

  std::string local_token() const override { return segment_name_; }
  // Maps every peer's segment; tokens[r] is rank r's segment name and tokens[rank] must be ours.
  // Throws std::runtime_error naming the peer rank if a segment cannot be opened or its size is
  // not layout.total_bytes (both sizes in the message), std::invalid_argument for a wrong name
  // count or order, std::logic_error if called twice. Every failure but the last unmaps whatever
  // was mapped and unlinks our own segment's name at once: this rank will not reach the barrier,
  // so the connection has failed anyway, and a peer that has not opened us yet fails now.
  void open_peers(const std::vector<std::string>& tokens) override;
  // Unlinks our segment's name (every rank has mapped it); peers keep their mappings. Only the
  // creating process unlinks: a forked child that inherited the workspace never does.
  void retire_token() noexcept override;
  // open_peers() for ranks that are threads of this process (tests/cpp/test_host_threads.cc):
  // maps nothing, but reuses each peer workspace's own mapping of its segment, so the same
  // bytes have one address in the process and ThreadSanitizer, which tracks memory by address,
  // sees every cross-rank access and its synchronisation. peers[r] is rank r's workspace
  // (peers[rank()] is this one); each must stay alive and keep its segment mapped until this
  // workspace's close_peers(). Throws std::logic_error if peers are open already,
  // std::invalid_argument for a wrong count, a wrong own entry, or a peer of another layout.
  void open_peers_in_process(const std::vector<HostShmWorkspace*>& peers);

  // Unlinks every /dev/shm entry "pcie_ar.<pid>.*" that this user (effective uid) owns and
  // whose creator <pid> no longer exists (kill(pid, 0) fails with ESRCH). Best effort and
  // silent: entries of live processes, of other users, or with unparsable names are left alone,
  // and errors are ignored. Returns how many names it unlinked. The constructor calls it.
  // Limitation: a pid is only meaningful inside one pid namespace. Containers that share
  // /dev/shm (docker --ipc=host, a bind-mounted /dev/shm) but not the pid namespace see each
  // other's pids as absent, so a live creator's segment can be unlinked before its peers open
  // it (they then fail to connect, loudly; mappings already made are unaffected). Run ranks
  // that share /dev/shm in one pid namespace, or give each container its own /dev/shm.
  static int reclaim_orphaned_segments() noexcept;

  // One all-reduce (see Call). The `blocks` slices of every chunk run in turn, each with its
  // own flags and generation counter, so any block count gives the same result. Throws
  // TransportFailure on a timeout or a peer call mismatch, and after one refuses every call.
  void run(const Call& call) override;
  std::optional<plan::Diagnostic> failure() const override;

  void close_peers() override;  // unmaps the peers' segments
  void release() override;      // unmaps and unlinks our own segment

  // ---- fault injection, FOR TESTS ONLY (tests/cpp/test_host_chaos.cc)
  // Where the executor stands when it calls the step hook.
  struct StepPoint {
    int block;     // the slice being walked, 0..call.blocks - 1 (slices run in turn)
    int step;      // index of the step in this rank's program
    bool in_wait;  // false: just before the step runs; true: inside the step's flag or LL wait,
                   // once per poll after the initial spin (the wait's deadline keeps running)
  };
  using StepHook = std::function<void(const StepPoint&)>;
  // Installs `hook` (an empty function removes it). run() calls it before every step of every
  // slice and while a wait yields, so a test can delay this rank at chosen points or end the
  // process there (_exit) to play a crashed peer. An exception thrown by the hook leaves run()
  // as it is (the workspace is not marked failed) and the ranks out of step. Unset, it costs
  // one well-predicted branch per step.
  void set_step_hook_for_testing(StepHook hook) { step_hook_ = std::move(hook); }

 private:
  int install(const plan::Program& program) override;
  void create_segment(uint32_t initial_gen);
  void size_segment(int fd) const;

  double timeout_s_ = 0.0;
  pid_t creator_pid_ = 0;  // the process that created the segment (and alone may unlink it)
  std::string segment_name_;
  bool linked_ = false;
  bool peers_open_ = false;
  bool peers_borrowed_ = false;  // peers' bases_ are their owners' mappings: never unmapped here
  std::optional<plan::Diagnostic> failure_;
  std::vector<uint8_t*> bases_;  // bases_[r]: rank r's segment as mapped here (ours included)
  std::vector<plan::Program> programs_;
  StepHook step_hook_;  // tests only; empty otherwise
};

}  // namespace pcie_ar::transport
