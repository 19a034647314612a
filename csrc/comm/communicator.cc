#include "comm/communicator.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <stdexcept>

#include "comm/fallback.h"
#include "comm/staged.h"
#include "plan/epilogue.h"
#include "plan/verify.h"
#include "transport/workspace.h"

namespace pcie_ar::comm {
namespace {

// Counts the forks this process has come out of as the child: a communicator remembers the count
// it was made under, so a child's use is told apart with one relaxed load per call (no getpid()
// system call on the decode path).
std::atomic<uint64_t> forks_survived{0};

uint64_t fork_generation() {
  static std::once_flag registered;
  std::call_once(registered, [] {
    pthread_atfork(nullptr, nullptr,
                   [] { forks_survived.fetch_add(1, std::memory_order_relaxed); });
  });
  return forks_survived.load(std::memory_order_relaxed);
}

// Where a decline of `op` is counted, as stats() shows it.
std::string counted_in(Op op) {
  if (op == kAllReduce) return "stats()['declines']";
  if (has_epilogue(op)) return "stats()['fused_declines']";
  return "stats()['collectives']['" + std::string(op_name(op)) + "']['declines']";
}

}  // namespace

void log(const Options& options, int level, const std::string& message) {
  if (options.log_level < level) return;
  std::fprintf(stderr, "[pcie_allreduce] rank %d: %s\n", options.rank, message.c_str());
}

Communicator::Communicator(Options options)
    : options_(std::move(options)),
      counters_(options_.world),
      decisions_(options_, counters_),
      fork_generation_(fork_generation()),
      creator_pid_(getpid()) {
  if (options_.rank < 0 || options_.rank >= std::max(options_.world, 1)) {
    throw std::invalid_argument("rank " + std::to_string(options_.rank) + " is outside world " +
                                std::to_string(options_.world));
  }
  if (enabled() && (options_.world < 2 || options_.world > plan::kMaxWorld)) {
    options_.disabled = Decline::kWorldSize;
    options_.disabled_detail = "world size " + std::to_string(options_.world) + " is outside 2.." +
                               std::to_string(plan::kMaxWorld);
  }
  if (options_.dtypes.empty()) throw std::invalid_argument("at least one dtype must be admitted");
  if (!enabled()) {
    log(options_, 1,
        "disabled (" + std::string(decline_name(options_.disabled)) +
            "): " + options_.disabled_detail + "; every all-reduce uses the fallback");
    return;
  }
  transport::WorkspaceOptions w;
  w.transport = options_.transport;
  w.max_numel = options_.max_numel;
  w.world = options_.world;
  w.elem_bytes = 2;
  for (plan::DType d : options_.dtypes) w.elem_bytes = std::max(w.elem_bytes, plan::dtype_bytes(d));
  w.max_blocks = options_.max_blocks;
  w.rank = options_.rank;
  w.device = options_.device;
  w.initial_gen = options_.initial_gen;
  w.timeout_s = options_.timeout_s;
  w.pdl = options_.pdl;
  workspace_ = transport::make_workspace(w);
  device_ = workspace_->device();
  decisions_.use_workspace(*workspace_);
}

Communicator::~Communicator() = default;

std::string Communicator::local_token() const {
  return workspace_ ? workspace_->local_token() : "";
}

bool Communicator::forked() const {
  return forks_survived.load(std::memory_order_relaxed) != fork_generation_;
}

// Its peers know the process that created it as this rank; a forked child sharing the parent's
// mappings would race the parent on the same slots and flags. Refused, as torch's own process
// groups refuse a child.
void Communicator::check_process() const {
  if (!forked()) return;
  throw std::runtime_error(
      "this pcie_allreduce communicator (rank " + std::to_string(options_.rank) +
      ") was created in process " + std::to_string(creator_pid_) + "; process " +
      std::to_string(getpid()) +
      " is a child forked from it and cannot use it (its peers know only the parent as rank " +
      std::to_string(options_.rank) +
      "): create a new communicator in the child, on its own process group, or start workers "
      "with the spawn method");
}

void Communicator::connect(const std::vector<std::string>& tokens) {
  check_process();
  if (!enabled()) return;
  if (static_cast<int>(tokens.size()) != options_.world) {
    throw std::invalid_argument("connect() needs one token per rank (" +
                                std::to_string(options_.world) + "), got " +
                                std::to_string(tokens.size()));
  }
  workspace_->open_peers(tokens);
}

void Communicator::retire_token() {
  if (workspace_) workspace_->retire_token();
  connected_ = enabled();
  if (connected_ && skip_program_ < 0) {
    skip_program_ = workspace_->add_program(plan::skip_program(options_.rank, options_.world));
  }
}

// ------------------------------------------------------------------ admission and decisions

// Raises on a second call that enters while one is running: the communicator's generations
// and workspace serve one call at a time (one communicator, one thread, one stream).
class Communicator::CallGuard {
 public:
  explicit CallGuard(const Communicator& c, std::atomic<bool>& busy) : busy_(busy) {
    c.check_process();
    if (busy_.exchange(true, std::memory_order_acquire)) {
      throw std::runtime_error(
          "two calls (all-reduce, fused, reduce-scatter or all-gather) entered one "
          "pcie_allreduce communicator at once (threads sharing it?); a communicator serves one "
          "thread at a time: give each thread its own, or serialise the calls");
    }
  }
  ~CallGuard() { busy_.store(false, std::memory_order_release); }
  CallGuard(const CallGuard&) = delete;
  CallGuard& operator=(const CallGuard&) = delete;

 private:
  std::atomic<bool>& busy_;
};

Gate Communicator::gate() const {
  return Gate{options_, device(), failure_.has_value(), connected_};
}

Decline Communicator::supports(const at::Tensor& t) const {
  return admit(kAllReduce, t, nullptr, gate()).decline;
}

Decline Communicator::decline_reason(Op op, const at::Tensor& inp, const at::Tensor* weight) {
  const Admission a = admit(op, inp, weight, gate());
  if (a.decline != Decline::kNone) return a.decline;
  return plan_call(op, a, inp).reason;
}

std::string Communicator::chosen_tactic(Op op, const at::Tensor& inp, const at::Tensor* weight) {
  const Admission a = admit(op, inp, weight, gate());
  if (a.decline != Decline::kNone) return std::string(fallback_label(op));
  const CallPlan plan = plan_call(op, a, inp);
  return plan.fallback() ? std::string(fallback_label(op))
                         : plan::tactic_label(plan.first().tactic);
}

int Communicator::prepare() {
  const CallGuard guard(*this, busy_);
  return enabled() ? decisions_.prepare(options_.dtypes) : decisions_.installed();
}

void Communicator::set_table(const std::string& text, const std::string& source) {
  const CallGuard guard(*this, busy_);
  decisions_.set_table(plan::TuningTable::parse(text, source));
  options_.table_text = text;
  options_.table_source = source;
}

// ------------------------------------------------------------------ the call path

Decline Communicator::run(Op op, OpArgs args, OnDecline on_decline) {
  const CallGuard guard(*this, busy_);
  raise_if_failed();
  if (has_epilogue(op) && (!args.weight || !args.residual_out)) {
    throw std::invalid_argument(std::string(op_name(op)) +
                                " needs weight and residual_out tensors");
  }
  if (is_nvfp4(op) && !args.block_scale) {
    throw std::invalid_argument(std::string(op_name(op)) + " needs a block_scale tensor");
  }
  if (on_decline == OnDecline::kReturn && at::GradMode::is_enabled() &&
      tracked_read(op, args) != nullptr) {
    const at::NoGradGuard untracked;  // every other argument error still raises;
                                      // nothing is allocated for the decline
    check(op, args);
    return Decline::kAutograd;
  }
  if (!args.out.defined()) {  // the all-reduce's is shaped like its input: no sizes to build
    if (is_nvfp4(op) && args.inp.dim() >= 1) {  // y_q: two e2m1 codes a byte
      std::vector<int64_t> sizes = args.inp.sizes().vec();
      sizes.back() /= 2;
      args.out = at::empty(sizes, args.inp.options().dtype(at::kByte));
    } else if (is_quantised(op)) {  // y_q
      args.out = at::empty(args.inp.sizes(), args.inp.options().dtype(at::kFloat8_e4m3fn));
    } else if (op.collective == plan::Collective::kAllReduce) {
      args.out = at::empty(args.inp.sizes(), args.inp.options());
    } else {
      std::vector<int64_t> sizes = args.inp.sizes().vec();
      if (!sizes.empty()) sizes[0] = output_rows(op, sizes[0], std::max(options_.world, 1));
      args.out = at::empty(sizes, args.inp.options());
    }
  }
  if (has_epilogue(op) && !args.residual_out->defined()) {
    *args.residual_out = at::empty(args.inp.sizes(), args.inp.options());
  }
  if (is_nvfp4(op) && !args.block_scale->defined() && args.inp.dim() >= 1) {
    *args.block_scale =
        at::empty(nvfp4_scale_sizes(args.inp), args.inp.options().dtype(at::kFloat8_e4m3fn));
  }
  check(op, args);
  return execute(op, args, on_decline);
}

Decline Communicator::execute(Op op, const OpArgs& args, OnDecline on_decline) {
  const Admission admission = admit(op, args.inp, args.weight, gate());
  Decline decline = admission.decline;
  CallPlan plan;
  if (decline == Decline::kNone) {
    plan = plan_call(op, admission, args.inp);
    decline = plan.reason;
  }
  if (decline != Decline::kNone && on_decline == OnDecline::kReturn) return decline;
  const Staged staged(op, args);
  if (staged.any) counters_.staged();
  if (decline == Decline::kNone) {
    run_kernels(op, plan, admission, staged);
  } else {
    note_decline(op, decline, args.inp);
    run_fallback(op, staged);
  }
  staged.copy_back(args);
  return decline;
}

void Communicator::run_fallback(Op op, const Staged& s) {
  if (has_epilogue(op)) {
    // The all-reduce as this communicator does it (kernels or the group's; an empty one meets no
    // one), then the add and the norm with the fused kernels' rounding points.
    at::Tensor sum = s.sum;
    execute(kAllReduce, OpArgs{s.inp, sum}, OnDecline::kFallback);
    rms_norm_in_order(
        sum, {s.residual, s.weight, s.scale, s.eps, s.weight_offset, op.quant, s.block_scale},
        s.out, s.residual_out);
    return;
  }
  // A call takes a generation only once it has met its peers, so that no rank is ever two calls
  // ahead of a peer (the slots' parity double buffer relies on it): an empty call exchanges
  // nothing and meets no one, so no rank takes one; any other takes it after the group's own
  // collective completed, which every peer must have entered, so every peer has finished the
  // call before. One whose collective raised took none (on every rank, when it raised alike).
  if (s.inp.numel() == 0) return;
  const Group group{options_.group_name, options_.world, options_.timeout_s, &interrupt_check_};
  const GroupWait waited = run_group_collective(op, group, s.inp, s.out);
  if (waited != GroupWait::kDone) group_failed(waited);
  skip_call();
}

void Communicator::group_failed(GroupWait waited) {
  plan::Diagnostic d{};
  d.kind = static_cast<uint32_t>(waited == GroupWait::kInterrupted
                                     ? plan::FailureKind::kInterrupted
                                     : plan::FailureKind::kFallbackTimeout);
  d.rank = static_cast<uint32_t>(options_.rank);
  d.peer = plan::kUnknownRank;
  failure_ = d;  // the group's collective is still pending: the ranks are out of step
  const std::string message = plan::describe_failure(d, options_.timeout_s);
  if (waited == GroupWait::kInterrupted) throw Interrupted(d, message);
  throw Failure(d, message);
}

void Communicator::note_decline(Op op, Decline decline, const at::Tensor& t) {
  if (!counters_.decline(op, decline)) return;
  const std::string what = op == kAllReduce ? "a " : "a " + std::string(op_name(op)) + " of a ";
  log(options_, 1,
      "declines " + what + describe(t) + " tensor (" + std::string(decline_name(decline)) +
          (decline == Decline::kDisabled && !options_.disabled_detail.empty()
               ? ": " + options_.disabled_detail
               : "") +
          ") and uses the " + std::string(fallback_label(op)) + (has_epilogue(op) ? " path" : "") +
          "; later declines for this reason are only counted in " + counted_in(op));
}

// ------------------------------------------------------------------ failures

void Communicator::transport_failed(const transport::TransportFailure& e) {
  if (e.diagnostic().kind == static_cast<uint32_t>(plan::FailureKind::kInterrupted)) {
    failure_ = e.diagnostic();  // the ranks are out of step now, as after a timeout
    throw Interrupted(e.diagnostic(), e.what());
  }
  fail(e.diagnostic());
}

void Communicator::fail(const plan::Diagnostic& diagnostic) {
  failure_ = diagnostic;
  throw Failure(diagnostic, plan::describe_failure(diagnostic, options_.timeout_s));
}

void Communicator::raise_if_failed() {
  if (failure_) {
    throw Failure(*failure_, plan::describe_failure(*failure_, options_.timeout_s) +
                                 " (this communicator failed earlier; recreate it on every rank)");
  }
  if (workspace_) {
    if (auto d = workspace_->failure()) fail(*d);
  }
}

void Communicator::set_interrupt_check(std::function<bool()> check) {
  interrupt_check_ = check;  // the fallback's waits ask it too
  if (workspace_) workspace_->set_interrupt_check(std::move(check));
}

std::optional<plan::Diagnostic> Communicator::failure() const {
  if (failure_) return failure_;
  return workspace_ ? workspace_->failure() : std::nullopt;
}

// ------------------------------------------------------------------ lifecycle

void Communicator::probe_write(uint32_t nonce) {
  check_process();
  if (workspace_ && enabled()) workspace_->probe_write(nonce);
}

std::vector<int> Communicator::probe_read(uint32_t nonce) const {
  if (workspace_ && enabled()) return workspace_->probe_read(nonce);
  return {};
}

void Communicator::disable(Decline reason, std::string detail) {
  if (!enabled()) return;
  options_.disabled = reason;
  options_.disabled_detail = std::move(detail);
  connected_ = false;
  log(options_, 1,
      "disabled (" + std::string(decline_name(reason)) + "): " + options_.disabled_detail +
          "; every all-reduce uses the fallback");
}

void Communicator::close_peers() {
  check_process();
  if (workspace_) workspace_->close_peers();
}

void Communicator::release() {
  if (released_) return;
  released_ = true;
  connected_ = false;
  // A child leaves the parent's workspace alone (its mappings end with it); the parent, whose
  // peers still use it, releases it.
  if (workspace_ && !forked()) workspace_->release();
  if (enabled()) {
    options_.disabled = Decline::kDisabled;
    options_.disabled_detail = "destroy() was called";
  }
}

uint64_t Communicator::layout_hash() const {
  return workspace_ ? plan::layout_hash(workspace_->layout()) : 0;
}

int64_t Communicator::workspace_bytes() const {
  return workspace_ && !released_ ? static_cast<int64_t>(workspace_->layout().total_bytes) : 0;
}

}  // namespace pcie_ar::comm
