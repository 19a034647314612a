// The Communicator: one per process group. It owns the workspace (fixed at construction and
// sized for decode) and runs every operation (comm/op.h) through one path: check the arguments
// once, admit once (comm/admission.h), decide once (comm/decisions.h: one cache for every op),
// then the kernels or the op's fallback (comm/fallback.h), counted in one stats table
// (comm/stats.h). Transport-agnostic: it holds a transport::Workspace made by
// transport::make_workspace() (host_shm for CPU tensors, cuda_ipc or cuda_host for CUDA tensors).
//
// Bootstrap is driven from Python, which owns the process group:
//   Communicator c(options);             // allocates this rank's workspace
//   tokens = all_gather(c.local_token())
//   c.connect(tokens); barrier; c.retire_token();   // peers mapped; nothing left to find us by
// Teardown is collective too: close_peers(); barrier; release().
#pragma once

#include <ATen/Tensor.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "comm/admission.h"
#include "comm/arguments.h"
#include "comm/decisions.h"
#include "comm/decline.h"
#include "comm/errors.h"
#include "comm/fallback.h"
#include "comm/op.h"
#include "comm/options.h"
#include "comm/self_test.h"
#include "comm/stats.h"
#include "plan/protocol.h"
#include "plan/rounds.h"

namespace pcie_ar::transport {
class Workspace;
class TransportFailure;
}  // namespace pcie_ar::transport

namespace pcie_ar::comm {

// What run() does with a call the kernels do not take.
enum class OnDecline {
  kFallback,  // runs the op's fallback: the call always returns the correct result
  kReturn,    // returns why, touching no tensor and counting nothing: the caller runs its own
              // (with grad mode on, also a call reading an operand autograd tracks: kAutograd)
};

class Communicator {
 public:
  explicit Communicator(Options options);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // What peers need to reach this rank's workspace (a segment name, a CUDA IPC handle).
  std::string local_token() const;
  // tokens[r] is rank r's local_token(): maps every peer's workspace.
  void connect(const std::vector<std::string>& tokens);
  // Every rank has connected: drop what let peers find our workspace (unlinks the host
  // segment's name, so nothing is left in /dev/shm), and start admitting calls.
  void retire_token();

  // The one call path of every op. Bad arguments raise std::invalid_argument (std::runtime_error
  // for autograd's rules) before any communication; an undefined out (and the fused call's
  // residual_out) is allocated, contiguous. Admitted and chosen by the table: one kernel call of
  // the op's program; otherwise kFallback runs the op's fallback (the group's own collective; the
  // fused call's unfused path, with the same bits) and kReturn returns the reason. Any layout
  // works: a tensor the executors cannot address is staged through a contiguous copy (counted in
  // stats().staged), so every rank takes the same path for the same shapes and dtypes. A
  // declined input is never modified. A timeout or a peer disagreement throws Failure; a second
  // call entering while one runs (two threads) throws std::runtime_error. A failure recorded by
  // an earlier (asynchronous) call is raised before anything is allocated.
  Decline run(Op op, OpArgs args, OnDecline on_decline = OnDecline::kFallback);
  // The check run() makes before any rank talks (check_args on this communicator's world and
  // device), alone: for a caller that forms an output itself (an undefined output is one the
  // call would allocate, and is not checked). Touches nothing; raises as run() does.
  void check(Op op, const OpArgs& args) const { check_args(op, args, options_.world, device()); }

  // The plain all-reduce's admission of `t`, before the table (it says *can*, not *should*).
  // Never throws.
  Decline supports(const at::Tensor& t) const;
  // Why the kernels would not run `op` with input `inp` (and the fused call's `weight`): its
  // admission, then kTable when the table chose the fallback; kNone when they would. Never
  // throws; depends only on what every rank agrees on.
  Decline decline_reason(Op op, const at::Tensor& inp, const at::Tensor* weight = nullptr);
  // The tactic label that would run it, or fallback_label(op).
  std::string chosen_tactic(Op op, const at::Tensor& inp, const at::Tensor* weight = nullptr);

  // P2P write-and-verify (CUDA only; the host transport has nothing to probe). Collective:
  // probe_write() on every rank, a barrier, then probe_read() returns the ranks whose writes
  // did not arrive intact here.
  void probe_write(uint32_t nonce);
  std::vector<int> probe_read(uint32_t nonce) const;
  // Turns the kernels off for good (every rank must call it with the same verdict).
  void disable(Decline reason, std::string detail);

  // Both refuse a forked child (std::runtime_error), like every call; release() is the one thing
  // a child may do, and it leaves the parent's workspace alone.
  void close_peers();  // collective teardown, step 1
  void release();      // step 2, after a barrier
  // True in a child forked from the process that created this communicator.
  bool forked() const;

  // Every counter of every op.
  Stats stats() const { return counters_.snapshot(); }
  // Puts every counter back to an earlier stats(): the tuner's measurement calls are not
  // service, and an operator reading stats() must not see them.
  void restore_stats(const Stats& earlier) { counters_.restore(earlier); }
  const Options& options() const { return options_; }
  bool enabled() const { return options_.disabled == Decline::kNone; }
  uint64_t table_hash() const { return decisions_.table().hash(); }
  const std::string& table_source() const { return decisions_.table().source(); }
  // Installs, before any graph capture, every program the table can pick for an admitted
  // message of every op (each dtype at every row edge and at the LL capacity, the only sizes
  // where a choice can change), so no call inside a capture installs one. Returns the programs
  // installed. Like a call, it must not run concurrently with one.
  int prepare();
  // The self-test before serving (comm/self_test.h): prepare(), then every (op, dtype, tactic)
  // the table chose that this communicator has not tested yet (`again`: every one) runs once on
  // known data through run() and each output is compared, bit for bit, with the reference.
  // Collective: every rank runs the same cases in the same order (the table and the topology are
  // agreed). Counts nothing (stats() is as before). A timeout or a disagreeing peer raises as a
  // call does. Returns one result per case; nothing is withdrawn here.
  std::vector<SelfTestResult> self_test(bool again = false);
  // From now on `op`'s `dtype` calls that `tactic` (its label) would run go to the fallback,
  // counted as Decline::kSelfTest (Decisions::withdraw). Every rank must withdraw the same tactics.
  void withdraw(Op op, plan::DType dtype, const std::string& tactic);
  // Replaces the tuning table (the tuner, and a cache adopted after construction). Collective
  // in effect: every rank must install the same table between the same two calls, or their
  // paths part (the caller compares hashes). Throws TableError, keeping the old table, when the
  // text does not parse; forgets every decision of every op, so the next call asks the new table.
  void set_table(const std::string& text, const std::string& source);
  uint64_t layout_hash() const;
  int64_t workspace_bytes() const;
  // The failure that disabled this communicator, if any (timeouts, peer disagreement).
  std::optional<plan::Diagnostic> failure() const;
  // Polls the transport for a failure recorded asynchronously (CUDA kernels) and raises it.
  void raise_if_failed();
  // Installs what the host transport's waits ask, every 20 ms once they have yielded, whether
  // to abandon the call (transport::Workspace::set_interrupt_check). An abandoned call throws
  // Interrupted and leaves the communicator failed, like a timeout.
  void set_interrupt_check(std::function<bool()> check);
  // FOR TESTS ONLY (the self-test's mutants): the workspace, null before one exists.
  transport::Workspace* workspace_for_testing() { return workspace_.get(); }

 private:
  struct Staged;
  class CallGuard;
  Gate gate() const;
  // Where the tensors of a call must live (-1: the CPU); nullopt without a workspace.
  std::optional<int> device() const { return device_; }
  void check_process() const;  // throws in a forked child
  // run() after the call is entered and its arguments checked; the fused call's unfused path
  // runs its all-reduce through it too.
  Decline execute(Op op, const OpArgs& args, OnDecline on_decline);
  // What runs an admitted call on the kernels: one decision for a message that fits the
  // workspace, else one per round (plan/rounds.h). `fallback` when the table sends the message,
  // or any of its rounds, to the fallback. Depends only on what every rank agrees on (the op, the
  // dtype, the message and row sizes, max_numel, the table), so every rank takes the same path.
  struct CallPlan {
    const Decision* whole = nullptr;         // the message in one call, or
    std::vector<plan::Round> rounds;         // its rounds, each with
    std::vector<const Decision*> decisions;  // its decision
    int64_t chunk = 0;  // a streamed collective's chunk length: its rounds are in each chunk's
    // kNone: the kernels run it; else why the fallback does: kTable or kSelfTest.
    Decline reason = Decline::kNone;
    bool fallback() const { return reason != Decline::kNone; }
    const Decision& first() const { return whole != nullptr ? *whole : *decisions.front(); }
  };
  CallPlan plan_call(Op op, const Admission& admission, const at::Tensor& inp);
  void run_kernels(Op op, const CallPlan& plan, const Admission& admission, const Staged& s);
  // One call of the kernels over `round` of the message: the whole of it (index -1), or round
  // `index` of a streamed one (of each chunk's elements where `chunk`, CallPlan::chunk, is not 0).
  void run_round(Op op, const Decision& decision, plan::Round round, int index, int64_t chunk,
                 const Admission& admission, const Staged& s);
  void run_fallback(Op op, const Staged& s);
  // The group's own collective did not complete (timed out, or interrupted): the communicator is
  // failed, as after a kernel timeout, and the call raises Failure (Interrupted).
  [[noreturn]] void group_failed(GroupWait waited);
  // The generation a fallback call takes (plan::skip_program) on a connected workspace.
  void skip_call();
  void note_decline(Op op, Decline decline, const at::Tensor& t);
  [[noreturn]] void fail(const plan::Diagnostic& diagnostic);
  // Failure, or Interrupted for a call the interrupt check abandoned; the communicator is failed.
  [[noreturn]] void transport_failed(const transport::TransportFailure& e);

  Options options_;
  Counters counters_;
  Decisions decisions_;
  std::unique_ptr<transport::Workspace> workspace_;
  std::optional<int> device_;  // the workspace's, read once
  std::optional<plan::Diagnostic> failure_;
  std::function<bool()> interrupt_check_;  // Ctrl-C: the workspace's waits and the fallback's
  std::atomic<bool> busy_{false};
  bool connected_ = false;
  std::set<TacticKey> self_tested_;
  int skip_program_ = -1;  // plan::skip_program in the workspace, once connected
  bool released_ = false;
  uint64_t fork_generation_;  // forks this process had survived as a child when it was made
  int creator_pid_;
};

}  // namespace pcie_ar::comm
