// The Communicator: one per process group. It owns the workspace (fixed at construction and
// sized for decode), the per-call admission, the tuning-table decision and the fallback, and
// counts every call and every decline. Transport-agnostic: it holds a transport::Workspace
// made by transport::make_workspace() (host_shm for CPU tensors, cuda_ipc or cuda_host for CUDA
// tensors).
//
// Bootstrap is driven from Python, which owns the process group:
//   Communicator c(options);             // allocates this rank's workspace
//   tokens = all_gather(c.local_token())
//   c.connect(tokens); barrier; c.retire_token();   // peers mapped; nothing left to find us by
// Teardown is collective too: close_peers(); barrier; release().
#pragma once

#include <ATen/Tensor.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "plan/epilogue.h"
#include "plan/layout.h"
#include "plan/names.h"
#include "plan/protocol.h"
#include "plan/schedule.h"
#include "plan/tactic.h"
#include "plan/tuning_table.h"
#include "transport/kind.h"

namespace pcie_ar::transport {
class Workspace;
class TransportFailure;
}  // namespace pcie_ar::transport

namespace pcie_ar::comm {

// Why a tensor does not go to the kernels. Explicit and append-only: the names reach stats(),
// logs and users' dashboards.
enum class Decline : uint8_t {
  kNone = 0,           // the kernels run it
  kDisabled = 1,       // the backend is off (env flag, handshake disagreement, earlier failure)
  kWorldSize = 2,      // world size outside 2..8
  kDtype = 3,          // not bf16/fp16/fp32 or not in the admitted set
  kDevice = 4,         // not on this communicator's device
  kNotContiguous = 5,  // no longer used: strided views are staged through a contiguous copy
  kNot16ByteMultiple = 6,
  kTooLarge = 7,  // numel > max_numel: prefill-sized, NCCL's ring territory
  kEmpty = 8,
  kNvLink = 9,       // NVLink peers: the engine's own custom all-reduce is faster
  kNoP2P = 10,       // a pair failed the write-and-verify P2P test
  kTable = 11,       // the tuning table chose the fallback for this size
  kMisaligned = 12,  // no longer used: misaligned tensors are staged like strided ones
  kMultiHost = 13,   // the group spans hosts (hostname or boot id differ): no shared memory
  // The fused call only (all_reduce_add_rms_norm): a row (the last dimension) that is not whole
  // 16-byte vectors or is longer than plan::kMaxEpilogueHidden.
  kHidden = 14,
};
inline constexpr auto kDeclineNames = plan::name_table<Decline>(
    "decline reason", {{Decline::kNone, "none"},
                       {Decline::kDisabled, "disabled"},
                       {Decline::kWorldSize, "world_size"},
                       {Decline::kDtype, "dtype"},
                       {Decline::kDevice, "device"},
                       {Decline::kNotContiguous, "not_contiguous"},
                       {Decline::kNot16ByteMultiple, "not_16_byte_multiple"},
                       {Decline::kTooLarge, "too_large"},
                       {Decline::kEmpty, "empty"},
                       {Decline::kNvLink, "nvlink"},
                       {Decline::kNoP2P, "no_p2p"},
                       {Decline::kTable, "table"},
                       {Decline::kMisaligned, "misaligned"},
                       {Decline::kMultiHost, "multi_host"},
                       {Decline::kHidden, "hidden"}});
// "unknown" for a value outside the enum.
inline std::string_view decline_name(Decline decline) {
  return kDeclineNames.name_of(decline, "unknown");
}
// The inverse of decline_name(); throws std::invalid_argument naming the unknown reason and the
// known ones.
inline Decline parse_decline(std::string_view name) { return kDeclineNames.parse(name); }

struct Options {
  int rank = 0;
  int world = 0;
  int64_t max_numel = 0;
  std::vector<plan::DType> dtypes = {plan::DType::kBF16, plan::DType::kFP16, plan::DType::kFP32};
  transport::Kind transport = transport::Kind::kHostShm;
  int device = -1;                           // CUDA device index (CUDA transports)
  double timeout_s = 30.0;                   // every wait's deadline; 0 = forever
  uint32_t initial_gen = 0;                  // tests start near 2^32 to cross the wrap
  int max_blocks = plan::kDefaultMaxBlocks;  // a transport may cap it (host_shm: 8)
  // What the table's topology column matches; the legacy keys host and hostmem mean host_shm
  // and cuda_host (plan::canonical_topology_key), as in the table itself.
  std::string topology_key = "flat";
  std::vector<int> island_of;  // rank -> island; empty = flat
  std::string table_text;      // CSV; empty = the embedded seed table
  std::string table_source = "embedded seed table";
  std::string group_name;             // c10d group the fallback runs on
  Decline disabled = Decline::kNone;  // set when the backend must not run (handshake, NVLink)
  std::string disabled_detail;
  int log_level = 1;  // 0 silent, 1 one line per decline reason and skipped row, 2 verbose
  bool pdl = true;    // CUDA transports: programmatic dependent launch where the GPU allows it
};

struct Stats {
  std::map<std::string, int64_t> calls;     // tactic label (or "fallback") -> count
  std::map<std::string, int64_t> declines;  // decline name -> count
  std::vector<int64_t> bytes_sent_per_peer;
  int64_t staged = 0;  // calls whose input or out went through a contiguous copy
  // all_reduce_add_rms_norm: tactic label (or "unfused") -> count, and why calls went unfused.
  std::map<std::string, int64_t> fused_calls;
  std::map<std::string, int64_t> fused_declines;
  // reduce_scatter and all_gather: collective name -> tactic label (or "fallback") -> count, and
  // collective name -> decline name -> count. Collectives never called are left out.
  std::map<std::string, std::map<std::string, int64_t>> collective_calls;
  std::map<std::string, std::map<std::string, int64_t>> collective_declines;
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

  // The per-call admission: can the kernels run a tensor of this numel and dtype on this
  // device? Never throws. Every reason depends only on what all ranks agree on (numel, dtype,
  // max_numel, the enabled state), except kDevice, which all_reduce() raises instead of
  // declining. A strided or misaligned tensor is admitted: all_reduce() stages it.
  Decline supports(const at::Tensor& t) const;
  // supports() and then the table: kTable when the table chose the fallback.
  Decline decline_reason(const at::Tensor& t);
  // Tactic label the table picks for this tensor, or "fallback".
  std::string chosen_tactic(const at::Tensor& t);

  // Always the correct sum: kernels when admitted and chosen, the group's all-reduce otherwise.
  // `out` may be `inp` (in place); otherwise it must have inp's dtype, shape and device and not
  // overlap inp. Any layout works (strided, offset, misaligned: staged through a contiguous
  // copy, counted in stats().staged); a written-to tensor with internal overlap (expand) and
  // an input on another device raise std::invalid_argument before any communication. A
  // declined input is never modified. A timeout or a peer disagreement throws Failure; a
  // second call entering while one runs (two threads) throws std::runtime_error.
  void all_reduce(const at::Tensor& inp, at::Tensor& out);
  // The same into a new contiguous tensor. A failure recorded by an earlier (asynchronous)
  // call is raised before anything is allocated on a device that may have died with it.
  at::Tensor all_reduce(const at::Tensor& inp);

  // The end of a decoder layer, fused (plan/epilogue.h): residual_out = sum over ranks of x +
  // residual, out = rms_norm(residual_out) * weight, each row of x.size(-1) elements. residual
  // has x's shape and dtype, weight is [hidden] in x's dtype (another dtype declines), out is
  // shaped like x and residual_out like residual; out may be x and residual_out may be residual
  // (in place), no other overlap. Admitted and chosen by the table for x's numel and dtype: one
  // kernel call, the all-reduce's tactic with the epilogue. Otherwise the unfused path: this
  // communicator's all_reduce (kernels or the group's), then the add and the norm in ATen with
  // the same rounding points. Bad arguments raise std::invalid_argument before any
  // communication.
  void all_reduce_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                               const at::Tensor& weight, double eps, at::Tensor& out,
                               at::Tensor& residual_out);
  // Why the fused kernels would not run this call (supports() of x, then the weight's dtype,
  // kHidden, then the table), or kNone. Never throws; a depends only on what every rank agrees
  // on (shape, dtype, the table), like decline_reason().
  Decline fused_decline_reason(const at::Tensor& x, const at::Tensor& residual,
                               const at::Tensor& weight);

  // Reduce-scatter along dim 0 (torch's reduce_scatter_tensor, sum): inp is [world * m, ...],
  // out is [m, ...] and receives rows [rank * m, (rank + 1) * m) of the sum over ranks, formed as
  // the all-reduce forms it (fp32, rank order, rounded once).
  void reduce_scatter(const at::Tensor& inp, at::Tensor& out);
  // All-gather along dim 0 (all_gather_into_tensor): inp is [m, ...], out is [world * m, ...] and
  // receives rank q's inp at rows [q * m, (q + 1) * m), bit for bit.
  // Both: out has inp's dtype and device and does not overlap it; any layout (staged like the
  // all-reduce's). Admitted (collective_decline_reason) and chosen: one kernel call of the
  // collective's own schedule; otherwise the group's own collective. Bad arguments raise
  // std::invalid_argument before any communication.
  void all_gather(const at::Tensor& inp, at::Tensor& out);
  // Why the kernels would not run `collective` with this input, or kNone: supports() of the
  // message (the reduce-scatter's input, the all-gather's output: world times its input), then
  // kNot16ByteMultiple when a rank's chunk is not whole 16-byte vectors, then the table (kTable).
  // Never throws; depends only on what every rank agrees on. For kAllReduce: decline_reason().
  Decline collective_decline_reason(plan::Collective collective, const at::Tensor& inp);
  // The tactic label that would run it, or "fallback".
  std::string chosen_collective_tactic(plan::Collective collective, const at::Tensor& inp);

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

  Stats stats() const;
  // Puts every counter back to an earlier stats(): the tuner's measurement calls are not
  // service, and an operator reading stats() must not see them.
  void restore_stats(const Stats& earlier);
  const Options& options() const { return options_; }
  bool enabled() const { return options_.disabled == Decline::kNone; }
  uint64_t table_hash() const { return table_.hash(); }
  const std::string& table_source() const { return table_.source(); }
  // Installs, before any graph capture, every program the table can pick for an admitted
  // message (each dtype at every row edge and at the LL capacity, the only sizes where a choice
  // can change), the fused call's, the reduce-scatter's and the all-gather's included, so no
  // call inside a capture installs one. Returns the programs installed.
  // Like a call, it must not run concurrently with one.
  int prepare();
  // Replaces the tuning table (the tuner, and a cache adopted after construction). Collective
  // in effect: every rank must install the same table between the same two calls, or their
  // paths part (the caller compares hashes). Throws TableError, keeping the old table, when the
  // text does not parse; clears every cached decision, so the next call asks the new table.
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

 private:
  struct InstalledProgram;  // one (algorithm, direction, staged, protocol) in the workspace
  struct Decision {
    bool fallback = true;
    plan::Tactic tactic;
    InstalledProgram* program = nullptr;
    uint32_t signature = 0;
    int64_t* calls = nullptr;  // counter for this tactic
    // The fused call (all_reduce_add_rms_norm) of the same tactic, set by install_fused() once.
    InstalledProgram* fused_program = nullptr;
    uint32_t fused_signature = 0;
    int64_t* fused_calls = nullptr;
  };

  Decision& decide(plan::DType dtype, int64_t bytes);
  // The table's choice of `collective` for a message of `bytes`; logs the rows it skipped.
  plan::TableChoice choose(plan::DType dtype, int64_t bytes, plan::Collective collective);
  // Fills a kernel decision's program, signature and stats counter from its tactic.
  void install(Decision& d, plan::DType dtype, plan::Collective collective);
  // A reduce-scatter's or all-gather's decision for a message of `bytes` (plan/tactic.h): the
  // table's first runnable row of that collective (plan/tuning_table.h); without one, the
  // table's all-reduce choice for that message in its two-shot form (twoshot for oneshot,
  // island_twoshot for island_oneshot) with the same direction, staging, protocol and launch
  // shape, or the fallback where the all-reduce's is.
  Decision& decide_collective(plan::Collective collective, plan::DType dtype, int64_t bytes);
  InstalledProgram& program_for(const plan::Tactic& tactic, bool epilogue = false,
                                plan::Collective collective = plan::Collective::kAllReduce);
  // The decline of a reduce-scatter or all-gather whose message is `message` elements of `inp`'s
  // dtype (supports() sees `inp`), before the table.
  Decline collective_admission(const at::Tensor& inp, int64_t message) const;
  void run_collective(plan::Collective collective, const at::Tensor& inp, at::Tensor& out);
  void run_collective_fallback(plan::Collective collective, const at::Tensor& inp, at::Tensor& out);
  // Fills `d`'s fused program, signature and counter (a kernel decision) unless already set.
  void install_fused(Decision& d, plan::DType dtype);
  Decline fused_admission(const at::Tensor& x, const at::Tensor& weight) const;
  void run_unfused(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                   double eps, at::Tensor& out, at::Tensor& residual_out);
  class CallGuard;
  void check_process() const;  // throws in a forked child
  void check_call(const at::Tensor& inp, const at::Tensor& out) const;
  void check_call_device(const at::Tensor& inp) const;  // std::invalid_argument elsewhere
  void reduce_into(const at::Tensor& inp, at::Tensor& out);
  // One call of the decision's program over a message of `numel` elements from `input` to
  // `output` (the executors' addresses: chunk 0 of the message), counted in the stats.
  void run_kernels(const Decision& decision, plan::DType dtype, const void* input, void* output,
                   int64_t numel, const plan::EpilogueArgs* epilogue = nullptr);
  std::optional<std::string> why_not_runnable(const plan::TableRow& row, int64_t bytes) const;
  void run_fallback(const at::Tensor& inp, at::Tensor& out);
  // The generation a fallback call takes (plan::skip_program) on a connected workspace.
  void skip_call();
  void note_decline(Decline decline, const at::Tensor& t);
  [[noreturn]] void fail(const plan::Diagnostic& diagnostic);
  // Failure, or Interrupted for a call the interrupt check abandoned; the communicator is failed.
  [[noreturn]] void transport_failed(const transport::TransportFailure& e);
  void log(int level, const std::string& message) const;

  Options options_;
  plan::TuningTable table_;
  std::unique_ptr<transport::Workspace> workspace_;
  std::map<std::tuple<int, int, int, int, int>, std::unique_ptr<InstalledProgram>> programs_;
  std::unordered_map<uint64_t, Decision> decisions_;
  std::map<std::string, int64_t> calls_;
  std::map<std::string, int64_t> fused_calls_;
  std::map<std::string, int64_t> fused_declines_;
  std::map<std::tuple<int, int, int64_t>, Decision> collective_decisions_;
  std::map<std::string, std::map<std::string, int64_t>> collective_calls_;
  std::map<std::string, std::map<std::string, int64_t>> collective_declines_;
  std::array<int64_t, 16> declines_{};
  std::array<bool, 16> decline_logged_{};
  std::vector<int64_t> bytes_sent_;
  std::optional<plan::Diagnostic> failure_;
  int64_t staged_ = 0;
  std::atomic<bool> busy_{false};
  bool connected_ = false;
  int skip_program_ = -1;  // plan::skip_program in the workspace, once connected
  bool released_ = false;
  uint64_t fork_generation_;  // forks this process had survived as a child when it was made
  int creator_pid_;
};

// Communicators reachable from the torch ops by an integer handle.
int64_t register_communicator(std::shared_ptr<Communicator> communicator);
std::shared_ptr<Communicator> lookup_communicator(int64_t handle);
void unregister_communicator(int64_t handle);

// A peer never arrived or disagreed about the call: what every rank-level failure throws.
// The bindings translate it into pcie_allreduce.PcieAllReduceTimeout carrying the diagnostic.
class Failure : public std::runtime_error {
 public:
  Failure(const plan::Diagnostic& diagnostic, std::string message)
      : std::runtime_error(std::move(message)), diagnostic_(diagnostic) {}
  const plan::Diagnostic& diagnostic() const { return diagnostic_; }

 private:
  plan::Diagnostic diagnostic_;
};

// A call abandoned because the interrupt check said so (Ctrl-C): the communicator is failed
// (later calls raise Failure); the bindings raise the interpreter's own exception instead.
class Interrupted : public Failure {
 public:
  using Failure::Failure;
};

}  // namespace pcie_ar::comm
