// The host executor: runs one rank's checked step list (plan::Program) on the CPU over workspace
// memory every rank can reach (each rank's segment as mapped in this process), with the flag and
// LL protocols of plan/protocol.h and the arithmetic of reduce.h. It is the host counterpart of
// the CUDA executor (executors/cuda/executor.cuh), with the same named pieces: one pass per block
// (the CTA), run_reduce, raise_flag, wait_flag, finish_call. Unlike the CUDA executor it runs
// two-destination (fused) reduce steps, in L1-sized tiles.
//
// Waits spin briefly, then yield (ranks may outnumber cores), each bounded by the timeout.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/step.h"
#include "transport/workspace.h"

namespace pcie_ar::transport {

// Not thread-safe: one call at a time.
class HostExecutor {
 public:
  // The host walks a rank's slices in turn on one thread, so a few are plenty.
  static constexpr int kMaxBlocks = 8;

  // timeout_s: the deadline of every wait, in seconds; 0 waits forever. Throws
  // std::invalid_argument for a negative or NaN timeout.
  explicit HostExecutor(double timeout_s);

  double timeout_s() const { return timeout_s_; }
  // Keeps a program that passed plan::check_program(); returns the id a Call names.
  int install(const plan::Program& program);

  // One all-reduce (see Call) for `rank`; bases[r] is rank r's workspace as this process
  // addresses it. The `blocks` slices of every chunk run in turn, each with its own flags and
  // generation counter, so any block count gives the same result. Throws TransportFailure on a
  // timeout or a peer call mismatch and keeps its diagnostic in failure().
  void run(const std::vector<uint8_t*>& bases, const plan::Layout& layout, int rank,
           const Call& call);
  const std::optional<plan::Diagnostic>& failure() const { return failure_; }

  // ---- fault injection, FOR TESTS ONLY (tests/cpp/transport/test_host_chaos.cc)
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
  // as it is (no failure is recorded) and the ranks out of step. Unset, it costs one
  // well-predicted branch per step.
  void set_step_hook(StepHook hook) { step_hook_ = std::move(hook); }

  // A wrong executor, for the self-test's tests (comm/self_test.h): every program runs with each
  // sum of two or more operands missing its last one (the split moved so each group keeps one),
  // or with each group's operands in reverse order (wrong bits from three operands on).
  enum class Mutant : uint8_t { kNone = 0, kDropOperand = 1, kReverseOperands = 2 };
  static constexpr auto kMutantNames = plan::name_table<Mutant>(
      "host executor mutant", {{Mutant::kNone, "none"},
                               {Mutant::kDropOperand, "drop_operand"},
                               {Mutant::kReverseOperands, "reverse_operands"}});
  void set_mutant(Mutant mutant) { mutant_ = mutant; }

  // Asked by a wait that has yielded its core, every 20 ms at most (never by a wait that ends
  // within its initial spin): true abandons the call, which fails with kInterrupted at that
  // step (recorded in failure(): the ranks are out of step). The Python bindings install one
  // that runs the interpreter's signal handlers, so Ctrl-C ends a wait, whatever the timeout.
  using InterruptCheck = std::function<bool()>;
  void set_interrupt_check(InterruptCheck check) { interrupt_check_ = std::move(check); }

 private:
  double timeout_s_ = 0.0;
  std::vector<plan::Program> programs_;
  std::optional<plan::Diagnostic> failure_;
  StepHook step_hook_;             // tests only; empty otherwise
  Mutant mutant_ = Mutant::kNone;  // tests only
  InterruptCheck interrupt_check_;
};

}  // namespace pcie_ar::transport
