#include "comm/communicator.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <stdexcept>

#include "comm/fallback.h"
#include "plan/epilogue.h"
#include "plan/verify.h"
#include "transport/workspace.h"

namespace pcie_ar::comm {
namespace {

// The stream a GPU transport enqueues on: the caller's current stream, as torch sees it.
void* current_stream(int device) {
  if (device < 0) return nullptr;
  const c10::Device d(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
  const auto* impl = c10::impl::getDeviceGuardImpl(d.type());
  return impl->getStreamNativeHandle(impl->getStream(d));
}

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
  return plan_call(op, a, inp).fallback ? Decline::kTable : Decline::kNone;
}

std::string Communicator::chosen_tactic(Op op, const at::Tensor& inp, const at::Tensor* weight) {
  const Admission a = admit(op, inp, weight, gate());
  if (a.decline != Decline::kNone) return std::string(fallback_label(op));
  const CallPlan plan = plan_call(op, a, inp);
  return plan.fallback ? std::string(fallback_label(op)) : plan::tactic_label(plan.first().tactic);
}

Communicator::CallPlan Communicator::plan_call(Op op, const Admission& a, const at::Tensor& inp) {
  CallPlan plan;
  if (a.message <= options_.max_numel) {
    plan.whole = &decisions_.decide(op, a.dtype, a.bytes());
    plan.fallback = plan.whole->fallback;
    return plan;
  }
  // Streamed (admission let only all-reduces through): whole vectors, or the fused call's whole
  // rows, each round decided by its own size. The rounds have at most two sizes.
  const int64_t elem = plan::dtype_bytes(a.dtype);
  const int64_t unit = has_epilogue(op) ? inp.size(-1) : plan::kVectorBytes / elem;
  plan.rounds = plan::split_rounds(a.message, options_.max_numel, unit);
  for (const plan::Round& round : plan.rounds) {
    const Decision& d = decisions_.decide(op, a.dtype, round.numel * elem);
    plan.decisions.push_back(&d);
    plan.fallback |= d.fallback;
  }
  plan.fallback |= plan.rounds.empty();
  return plan;
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

// The tensors the executors (or the fallback) address: each of the call's own, or a contiguous
// copy where its layout would not do. A tensor's own layout never changes the path.
struct Communicator::Staged {
  at::Tensor inp, out, residual, weight, residual_out;
  bool any = false;

  Staged(Op op, const OpArgs& a) {
    const auto input = [this](const at::Tensor& t) {
      if (executor_ready(t)) return t;
      any = true;
      return t.clone(at::MemoryFormat::Contiguous);
    };
    const auto output = [this](const at::Tensor& t, const at::Tensor& in_place_of,
                               const at::Tensor& staged_input) {
      if (t.is_same(in_place_of)) return staged_input;
      if (executor_ready(t)) return t;
      any = true;
      return at::empty(t.sizes(), t.options());
    };
    inp = input(a.inp);
    out = output(a.out, a.inp, inp);
    if (has_epilogue(op)) {
      residual = input(*a.residual);
      weight = input(*a.weight);
      residual_out = output(*a.residual_out, *a.residual, residual);
    }
  }

  void copy_back(const OpArgs& a) const {
    if (!out.is_same(a.out)) a.out.copy_(out);
    if (residual_out.defined() && !residual_out.is_same(*a.residual_out)) {
      a.residual_out->copy_(residual_out);
    }
  }
};

Decline Communicator::run(Op op, OpArgs args, OnDecline on_decline) {
  const CallGuard guard(*this, busy_);
  raise_if_failed();
  if (has_epilogue(op) && (!args.residual || !args.weight || !args.residual_out)) {
    throw std::invalid_argument(std::string(op_name(op)) +
                                " needs residual, weight and residual_out tensors");
  }
  if (on_decline == OnDecline::kReturn && at::GradMode::is_enabled() &&
      tracked_read(op, args) != nullptr) {
    const at::NoGradGuard untracked;  // every other argument error still raises;
                                      // nothing is allocated for the decline
    check(op, args);
    return Decline::kAutograd;
  }
  if (!args.out.defined()) {  // the all-reduce's is shaped like its input: no sizes to build
    if (op.collective == plan::Collective::kAllReduce) {
      args.out = at::empty(args.inp.sizes(), args.inp.options());
    } else {
      std::vector<int64_t> sizes = args.inp.sizes().vec();
      if (!sizes.empty()) sizes[0] = output_rows(op, sizes[0], std::max(options_.world, 1));
      args.out = at::empty(sizes, args.inp.options());
    }
  }
  if (has_epilogue(op) && !args.residual_out->defined()) {
    *args.residual_out = at::empty(args.residual->sizes(), args.residual->options());
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
    if (plan.fallback) decline = Decline::kTable;
  }
  if (decline != Decline::kNone && on_decline == OnDecline::kReturn) return decline;
  const Staged staged(op, args);
  if (staged.any) counters_.staged();
  if (decline == Decline::kNone) {
    run_kernels(op, plan, admission, staged, args.eps);
  } else {
    note_decline(op, decline, args.inp);
    run_fallback(op, staged, args.eps);
  }
  staged.copy_back(args);
  return decline;
}

// The kernels address a one-chunk tensor (the reduce-scatter's output, the all-gather's input)
// from chunk `rank` of the message: its base goes in `rank` chunks before it. The programs touch
// only chunk `rank` of it (plan::verify proves it), so no byte outside the tensor is read or
// written; the address is formed as an integer, never dereferenced below the tensor.
void Communicator::run_kernels(Op op, const CallPlan& plan, const Admission& admission,
                               const Staged& s, double eps) {
  if (plan.whole != nullptr) {
    run_round(op, *plan.whole, plan::Round{0, admission.message}, -1, admission, s, eps);
  } else {
    for (size_t k = 0; k < plan.rounds.size(); ++k) {
      run_round(op, *plan.decisions[k], plan.rounds[k], static_cast<int>(k), admission, s, eps);
    }
  }
  // One call, counted under the tactic of its first round.
  const Decision& decision = plan.first();
  ++*decision.calls;
  if (decision.contained_calls != nullptr) ++*decision.contained_calls;
}

void Communicator::run_round(Op op, const Decision& decision, plan::Round round, int index,
                             const Admission& admission, const Staged& s, double eps) {
  const int64_t elem = plan::dtype_bytes(admission.dtype);
  const auto at = [&](const at::Tensor& t) {
    return static_cast<void*>(static_cast<uint8_t*>(t.data_ptr()) + round.offset * elem);
  };
  const auto chunk_base = [&](const at::Tensor& t) {
    const auto below = static_cast<uintptr_t>(options_.rank * (admission.bytes() / options_.world));
    return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(t.data_ptr()) - below);
  };
  transport::Call call;
  call.program = decision.program->id;
  call.dtype = admission.dtype;
  call.blocks = decision.tactic.blocks;
  call.threads = decision.tactic.threads;
  call.input = input_is_chunk(op) ? chunk_base(s.inp) : at(s.inp);
  call.output = output_is_chunk(op) ? chunk_base(s.out) : at(s.out);
  call.numel = round.numel;
  call.signature = decision.signature;
  call.stream = current_stream(workspace_->device());
  if (has_epilogue(op)) {
    call.epilogue.residual = at(s.residual);
    call.epilogue.residual_out = at(s.residual_out);
    call.epilogue.weight = s.weight.data_ptr();
    call.epilogue.hidden = s.inp.size(-1);
    call.epilogue.eps = static_cast<float>(eps);
    // Ranks that disagree on eps or the row length fail at once, naming each other.
    call.signature =
        plan::epilogue_signature(decision.signature, call.epilogue.eps, call.epilogue.hidden);
  }
  if (index >= 0) call.signature = plan::round_signature(call.signature, admission.message, index);
  try {
    workspace_->run(call);
  } catch (const transport::TransportFailure& e) {
    transport_failed(e);
  }
  counters_.sent(decision.program->sent_fraction, round.numel * elem);
}

void Communicator::run_fallback(Op op, const Staged& s, double eps) {
  if (has_epilogue(op)) {
    // The all-reduce as this communicator does it (kernels or the group's; an empty one meets no
    // one), then the add and the norm with the fused kernels' rounding points.
    at::Tensor sum = s.out;
    execute(kAllReduce, OpArgs{s.inp, sum}, OnDecline::kFallback);
    add_rms_norm_in_order(sum, s.residual, s.weight, eps, s.out, s.residual_out);
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

// Every call takes a generation on every rank whatever its path, so a peer's data of a call this
// rank sent to the fallback can never pass for a later call's (plan::skip_program). Costs a
// kernel launch on a GPU (a few microseconds beside the group's own all-reduce), a few stores on
// the host.
void Communicator::skip_call() {
  if (!connected_ || !enabled()) return;
  transport::Call call;
  call.program = skip_program_;
  call.blocks = 1;
  call.threads = 32;
  call.stream = current_stream(workspace_->device());
  try {
    workspace_->run(call);
  } catch (const transport::TransportFailure& e) {
    transport_failed(e);
  }
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
