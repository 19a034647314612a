#include "comm/communicator.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "plan/verify.h"
#include "transport/workspace.h"

namespace pcie_ar::comm {
namespace {

std::optional<plan::DType> to_plan_dtype(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16:
      return plan::DType::kBF16;
    case at::kHalf:
      return plan::DType::kFP16;
    case at::kFloat:
      return plan::DType::kFP32;
    default:
      return std::nullopt;
  }
}

uint64_t decision_key(plan::DType dtype, int64_t bytes) {
  return (static_cast<uint64_t>(dtype) << 56) | static_cast<uint64_t>(bytes);
}

bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % plan::kVectorBytes == 0;
}

// What the executors can address directly: one dense, 16-byte aligned run of elements.
bool executor_ready(const at::Tensor& t) { return t.is_contiguous() && aligned16(t); }

// True when two tensors may share a byte. ATen cannot always tell for strided views of one
// storage; those count as overlapping (conservative, and the message says what to pass).
bool may_overlap(const at::Tensor& a, const at::Tensor& b) {
  switch (at::get_overlap_status(a, b)) {
    case at::MemOverlapStatus::Full:
    case at::MemOverlapStatus::Partial:
      return true;
    case at::MemOverlapStatus::TooHard:
      return a.storage().is_alias_of(b.storage());
    default:
      return false;
  }
}

// "Float [32, 32] on cpu", for messages.
std::string describe(const at::Tensor& t) {
  std::string shape = "[";
  for (int64_t i = 0; i < t.dim(); ++i) shape += (i ? ", " : "") + std::to_string(t.size(i));
  return std::string(c10::toString(t.scalar_type())) + " " + shape + "] on " + t.device().str();
}

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

}  // namespace

// One (algorithm, direction, staged) installed in the workspace for this rank, and how much it
// sends each peer.
struct Communicator::InstalledProgram {
  int id = -1;                        // the workspace's program id
  std::vector<double> sent_fraction;  // per peer, as a multiple of the message
};

Communicator::Communicator(Options options)
    : options_(std::move(options)), fork_generation_(fork_generation()), creator_pid_(getpid()) {
  table_ = options_.table_text.empty()
               ? plan::TuningTable::embedded()
               : plan::TuningTable::parse(options_.table_text, options_.table_source);
  bytes_sent_.assign(std::max(options_.world, 0), 0);
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
    log(1, "disabled (" + std::string(decline_name(options_.disabled)) +
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

Decline Communicator::supports(const at::Tensor& t) const {
  if (!enabled()) return options_.disabled;
  if (failure_) return Decline::kDisabled;
  const auto dtype = to_plan_dtype(t.scalar_type());
  if (!dtype ||
      std::find(options_.dtypes.begin(), options_.dtypes.end(), *dtype) == options_.dtypes.end()) {
    return Decline::kDtype;
  }
  // Enabled means the workspace exists; its device says where tensors must live.
  const int device = workspace_->device();
  if (device < 0 ? !t.device().is_cpu() : !(t.is_cuda() && t.device().index() == device)) {
    return Decline::kDevice;
  }
  if (t.numel() == 0) return Decline::kEmpty;
  if ((t.numel() * plan::dtype_bytes(*dtype)) % plan::kVectorBytes != 0) {
    return Decline::kNot16ByteMultiple;
  }
  if (t.numel() > options_.max_numel) return Decline::kTooLarge;
  if (!connected_) return Decline::kDisabled;
  return Decline::kNone;
}

Decline Communicator::decline_reason(const at::Tensor& t) {
  const Decline d = supports(t);
  if (d != Decline::kNone) return d;
  const auto dtype = *to_plan_dtype(t.scalar_type());
  return decide(dtype, t.numel() * plan::dtype_bytes(dtype)).fallback ? Decline::kTable
                                                                      : Decline::kNone;
}

std::string Communicator::chosen_tactic(const at::Tensor& t) {
  if (decline_reason(t) != Decline::kNone) return "fallback";
  const auto dtype = *to_plan_dtype(t.scalar_type());
  return plan::tactic_label(decide(dtype, t.numel() * plan::dtype_bytes(dtype)).tactic);
}

std::optional<std::string> Communicator::why_not_runnable(const plan::TableRow& row,
                                                          int64_t bytes) const {
  const plan::Tactic& t = row.tactic;
  if (auto why = plan::why_unsupported(t, options_.world, options_.island_of, row.collective)) {
    return why;
  }
  // The layout is agreed by every rank (handshake), so this depends only on the call's size.
  const int64_t ll_capacity = workspace_->layout().ll_capacity_bytes;
  if (plan::flag_in_data(t.protocol) && bytes > ll_capacity) {
    return "a " + std::to_string(bytes) + "-byte message exceeds the LL slots (" +
           std::to_string(ll_capacity) + " bytes)";
  }
  return workspace_->why_not(t);
}

Communicator::InstalledProgram& Communicator::program_for(const plan::Tactic& tactic, bool epilogue,
                                                          plan::Collective collective) {
  // The last field: 0 the all-reduce, 1 the fused call, 2 + collective the others.
  const int variant = collective != plan::Collective::kAllReduce ? 2 + static_cast<int>(collective)
                      : epilogue                                 ? 1
                                                                 : 0;
  const auto key =
      std::make_tuple(static_cast<int>(tactic.algorithm), static_cast<int>(tactic.direction),
                      tactic.staged ? 1 : 0, static_cast<int>(tactic.protocol), variant);
  auto it = programs_.find(key);
  if (it != programs_.end()) return *it->second;
  plan::Schedule schedule =
      plan::build_schedule(tactic.algorithm, tactic.direction, tactic.staged, options_.world,
                           options_.island_of, tactic.protocol, collective);
  // Where the executor writes a sum and its forwarded copy in one pass, fewer passes over memory.
  if (workspace_->runs_multi_destination_steps()) {
    schedule = plan::fuse_forwarding_copies(std::move(schedule));
  }
  if (epilogue) schedule = plan::with_epilogue(std::move(schedule));
  const plan::Verification v = plan::verify(schedule);
  if (!v.ok) {  // the builders are proven in CI; refuse rather than run something unproven
    throw std::logic_error("schedule " + plan::tactic_label(tactic) +
                           " failed verification: " + v.errors.front());
  }
  auto program = std::make_unique<InstalledProgram>();
  program->id = workspace_->add_program(plan::encode_program(schedule, options_.rank));
  program->sent_fraction = v.sent_to[options_.rank];
  return *programs_.emplace(key, std::move(program)).first->second;
}

Communicator::Decision& Communicator::decide(plan::DType dtype, int64_t bytes) {
  const uint64_t key = decision_key(dtype, bytes);
  auto it = decisions_.find(key);
  if (it != decisions_.end()) return it->second;
  const plan::TableChoice choice = choose(dtype, bytes, plan::Collective::kAllReduce);
  Decision d;
  d.fallback = choice.fallback;
  d.tactic = choice.tactic;
  install(d, dtype, plan::Collective::kAllReduce);
  return decisions_.emplace(key, d).first->second;
}

plan::TableChoice Communicator::choose(plan::DType dtype, int64_t bytes,
                                       plan::Collective collective) {
  const plan::TableChoice choice = table_.choose(
      options_.topology_key, options_.world, dtype, bytes,
      [this](const plan::TableRow& row, int64_t b) { return why_not_runnable(row, b); },
      collective);
  for (const auto& [line, why] : choice.skipped) {
    log(1, table_.source() + " line " + std::to_string(line) + " skipped: " + why);
  }
  return choice;
}

void Communicator::install(Decision& d, plan::DType dtype, plan::Collective collective) {
  if (d.fallback) return;
  d.program = &program_for(d.tactic, false, collective);
  d.signature = plan::call_signature(dtype, d.tactic, false, collective);
  const std::string label = plan::tactic_label(d.tactic);
  d.calls = collective == plan::Collective::kAllReduce
                ? &calls_[label]
                : &collective_calls_[std::string(plan::collective_name(collective))][label];
}

void Communicator::note_decline(Decline decline, const at::Tensor& t) {
  const auto index = static_cast<size_t>(decline);
  ++declines_[index];
  if (decline_logged_[index]) return;
  decline_logged_[index] = true;
  log(1, "declines a " + describe(t) + " tensor (" + std::string(decline_name(decline)) +
             (decline == Decline::kDisabled && !options_.disabled_detail.empty()
                  ? ": " + options_.disabled_detail
                  : "") +
             ") and uses the fallback; later declines for this reason are only counted in "
             "stats()['declines']");
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

void Communicator::run_fallback(const at::Tensor& inp, at::Tensor& out) {
  if (options_.group_name.empty()) {
    throw std::runtime_error("pcie_allreduce has no process group to fall back to");
  }
  if (!out.is_same(inp)) out.copy_(inp);
  // The group's own all-reduce (NCCL on GPUs, gloo on CPUs) through c10d's functional ops: the
  // same communicator the engine already uses, traceable, and safe under graph capture.
  static const c10::OperatorHandle& all_reduce =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::all_reduce_", "");
  static const c10::OperatorHandle& wait =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::wait_tensor", "");
  torch::jit::Stack stack{out, std::string("sum"), options_.group_name};
  all_reduce.callBoxed(&stack);
  stack = {out};
  wait.callBoxed(&stack);
}

namespace {
// A written-to tensor whose elements share memory (an expand) would be written twice.
void check_no_internal_overlap(const at::Tensor& out) {
  if (at::has_internal_overlap(out) == at::MemOverlap::Yes) {
    throw std::invalid_argument(
        "unsupported operation: more than one element of the written-to tensor refers to a "
        "single memory location (an expanded or overlapping view); clone() it first");
  }
}

// The autograd rules torch's own in-place and out= ops enforce: the op has no derivative, so
// writing into a tensor that autograd tracks would silently break its gradient.
void check_writable(const at::Tensor& out, bool in_place) {
  if (out.requires_grad() && at::GradMode::is_enabled()) {
    throw std::runtime_error(
        in_place && out.is_leaf()
            ? "a leaf Variable that requires grad is being used in an in-place operation "
              "(all_reduce_); call it under torch.no_grad() or on a tensor that does not "
              "require grad"
            : std::string(in_place ? "all_reduce_" : "all_reduce(out=)") +
                  " has no derivative, but the tensor it writes requires grad; call it under "
                  "torch.no_grad() or on a detached tensor");
  }
  if (out.is_inference() && !c10::InferenceMode::is_enabled()) {
    throw std::runtime_error(
        "Inplace update to inference tensor outside InferenceMode is not allowed: the tensor "
        "all_reduce writes was created in inference mode; call it inside "
        "torch.inference_mode() or clone() the tensor first");
  }
}
}  // namespace

void Communicator::check_call_device(const at::Tensor& inp) const {
  if (workspace_) {
    const int device = workspace_->device();
    const bool here =
        device < 0 ? inp.device().is_cpu() : inp.is_cuda() && inp.device().index() == device;
    if (!here) {
      throw std::invalid_argument(
          "the input is a " + describe(inp) + "; this communicator all-reduces tensors on " +
          (device < 0 ? std::string("cpu") : "cuda:" + std::to_string(device)));
    }
  }
}

void Communicator::check_call(const at::Tensor& inp, const at::Tensor& out) const {
  check_call_device(inp);
  if (!out.is_same(inp)) {
    if (out.scalar_type() != inp.scalar_type() || !out.sizes().equals(inp.sizes()) ||
        out.device() != inp.device()) {
      throw std::invalid_argument(
          "out must have the input's dtype, shape and device: the input "
          "is a " +
          describe(inp) + ", out a " + describe(out));
    }
    if (may_overlap(inp, out)) {
      throw std::invalid_argument(
          "out overlaps the input without being the same tensor; pass the input itself for an "
          "in-place all-reduce (all_reduce_) or a disjoint tensor");
    }
  }
  check_writable(out, out.is_same(inp));
  check_no_internal_overlap(out);
}

// Raises on a second call that enters while one is running: the communicator's generations
// and workspace serve one call at a time (one communicator, one thread, one stream).
class Communicator::CallGuard {
 public:
  explicit CallGuard(const Communicator& c, std::atomic<bool>& busy) : busy_(busy) {
    c.check_process();
    if (busy_.exchange(true, std::memory_order_acquire)) {
      throw std::runtime_error(
          "two all-reduce calls entered one pcie_allreduce communicator at once (threads sharing "
          "it?); a communicator serves one thread at a time: give each thread its own, or "
          "serialise the calls");
    }
  }
  ~CallGuard() { busy_.store(false, std::memory_order_release); }
  CallGuard(const CallGuard&) = delete;
  CallGuard& operator=(const CallGuard&) = delete;

 private:
  std::atomic<bool>& busy_;
};

void Communicator::all_reduce(const at::Tensor& inp, at::Tensor& out) {
  const CallGuard guard(*this, busy_);
  raise_if_failed();
  reduce_into(inp, out);
}

// ------------------------------------------------------------------ the fused call

namespace {
// Bad arguments of all_reduce_add_rms_norm: raised before any communication, on the rank that
// passed them.
void check_fused_args(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                      const at::Tensor& out, const at::Tensor& residual_out) {
  if (x.dim() < 1) {
    throw std::invalid_argument(
        "all_reduce_add_rms_norm needs x of at least one dimension (rows "
        "of hidden); got a " +
        describe(x));
  }
  const int64_t hidden = x.size(-1);
  auto like = [](const at::Tensor& a, const at::Tensor& b) {
    return a.scalar_type() == b.scalar_type() && a.sizes().equals(b.sizes()) &&
           a.device() == b.device();
  };
  if (!like(residual, x)) {
    throw std::invalid_argument("residual must have x's dtype, shape and device: x is a " +
                                describe(x) + ", residual a " + describe(residual));
  }
  if (weight.dim() != 1 || weight.size(0) != hidden || weight.device() != x.device()) {
    throw std::invalid_argument("weight must be [hidden] = [" + std::to_string(hidden) +
                                "] on x's device: x is a " + describe(x) + ", weight a " +
                                describe(weight));
  }
  if (!like(out, x) || !like(residual_out, x)) {
    throw std::invalid_argument(
        "out and residual_out must have x's dtype, shape and device: x is "
        "a " +
        describe(x) + ", out a " + describe(out) + ", residual_out a " + describe(residual_out));
  }
  auto apart = [](const at::Tensor& a, const at::Tensor& b) { return !may_overlap(a, b); };
  if (!(out.is_same(x) || apart(out, x)) ||
      !(residual_out.is_same(residual) || apart(residual_out, residual)) || !apart(out, residual) ||
      !apart(out, residual_out) || !apart(residual_out, x)) {
    throw std::invalid_argument(
        "all_reduce_add_rms_norm writes out and residual_out: out may be x and residual_out may "
        "be residual (in place), but they may not overlap each other or any other operand");
  }
  check_writable(out, out.is_same(x));
  check_writable(residual_out, residual_out.is_same(residual));
  check_no_internal_overlap(out);
  check_no_internal_overlap(residual_out);
}
}  // namespace

void Communicator::install_fused(Decision& d, plan::DType dtype) {
  if (d.fused_program != nullptr) return;
  d.fused_program = &program_for(d.tactic, /*epilogue=*/true);
  d.fused_signature = plan::call_signature(dtype, d.tactic, /*fused=*/true);
  d.fused_calls = &fused_calls_[plan::tactic_label(d.tactic)];
}

Decline Communicator::fused_admission(const at::Tensor& x, const at::Tensor& weight) const {
  const Decline d = supports(x);
  if (d != Decline::kNone) return d;
  if (weight.scalar_type() != x.scalar_type()) return Decline::kDtype;
  const int64_t hidden = x.size(-1);
  if (hidden > plan::kMaxEpilogueHidden ||
      (hidden * plan::dtype_bytes(*to_plan_dtype(x.scalar_type()))) % plan::kVectorBytes != 0) {
    return Decline::kHidden;
  }
  return Decline::kNone;
}

Decline Communicator::fused_decline_reason(const at::Tensor& x, const at::Tensor& residual,
                                           const at::Tensor& weight) {
  (void)residual;  // its shape and dtype are x's, or the call raises
  if (x.dim() < 1) return Decline::kEmpty;
  const Decline d = fused_admission(x, weight);
  if (d != Decline::kNone) return d;
  const auto dtype = *to_plan_dtype(x.scalar_type());
  return decide(dtype, x.numel() * plan::dtype_bytes(dtype)).fallback ? Decline::kTable
                                                                      : Decline::kNone;
}

namespace {
// The mean of squares of each row of `rf` (fp32, [..., hidden]) in plan/epilogue.h's order, as
// elementwise ATen ops (each one IEEE operation per element, on the CPU and the GPU alike; the
// divisor is a tensor, because ATen's CUDA division by a scalar multiplies by its reciprocal).
at::Tensor mean_of_squares_in_order(const at::Tensor& rf) {
  constexpr int64_t kQ = plan::kNormPartials;
  const int64_t hidden = rf.size(-1);
  const at::Tensor sq = rf.mul(rf);
  at::Tensor part = at::zeros_like(sq.narrow(-1, 0, std::min(hidden, kQ)));
  part = at::constant_pad_nd(part, {0, kQ - part.size(-1)});
  for (int64_t base = 0; base < hidden; base += kQ) {
    const int64_t n = std::min(kQ, hidden - base);
    part.narrow(-1, 0, n).add_(sq.narrow(-1, base, n));
  }
  for (int64_t h = kQ / 2; h >= 1; h /= 2) {
    part = part.narrow(-1, 0, h).add(part.narrow(-1, h, h));
  }
  return part.div(at::full_like(part, static_cast<double>(hidden)));
}
}  // namespace

// The declined fused call: the all-reduce as this communicator does it (kernels or the group's),
// then plan/epilogue.h's add and norm, operation for operation, in ATen. Given the same sum it
// is the fused kernels' result bit for bit (NaN payloads aside), so a row does not change when
// a batch that holds it is declined.
void Communicator::run_unfused(const at::Tensor& x, const at::Tensor& residual,
                               const at::Tensor& weight, double eps, at::Tensor& out,
                               at::Tensor& residual_out) {
  reduce_into(x, out);
  const at::ScalarType dtype = x.scalar_type();
  const at::Tensor r = out.to(at::kFloat).add(residual.to(at::kFloat)).to(dtype);
  const at::Tensor rf = r.to(at::kFloat);
  const at::Tensor mean = mean_of_squares_in_order(rf);
  // The square root in fp64, rounded to fp32: exactly the IEEE fp32 square root (53 >= 2 * 24 + 2
  // bits, so the double rounding is exact), where ATen's vectorised fp32 sqrt on the CPU (Sleef)
  // is not correctly rounded for about a fifth of its inputs.
  const at::Tensor root =
      at::sqrt(mean.add(static_cast<float>(eps)).to(at::kDouble)).to(at::kFloat);
  const at::Tensor rstd = at::reciprocal(root);
  const at::Tensor y = rf.mul(rstd).mul(weight.to(at::kFloat)).to(dtype);
  residual_out.copy_(r);
  out.copy_(y);
}

void Communicator::all_reduce_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                           const at::Tensor& weight, double eps, at::Tensor& out,
                                           at::Tensor& residual_out) {
  const CallGuard guard(*this, busy_);
  raise_if_failed();
  check_call(x, out);
  check_fused_args(x, residual, weight, out, residual_out);
  Decline decline = fused_admission(x, weight);
  Decision* decision = nullptr;
  plan::DType dtype{};
  if (decline == Decline::kNone) {
    dtype = *to_plan_dtype(x.scalar_type());
    decision = &decide(dtype, x.numel() * plan::dtype_bytes(dtype));
    if (decision->fallback) decline = Decline::kTable;
  }
  if (decline != Decline::kNone) {
    ++fused_declines_[std::string(decline_name(decline))];
    ++fused_calls_["unfused"];
    run_unfused(x, residual, weight, eps, out, residual_out);
    return;
  }
  install_fused(*decision, dtype);
  // Staged like all_reduce's tensors: a tensor's own layout never changes the path.
  auto ready = [](const at::Tensor& t) {
    return executor_ready(t) ? t : t.clone(at::MemoryFormat::Contiguous);
  };
  const at::Tensor src = ready(x);
  const at::Tensor res = ready(residual);
  const at::Tensor w = ready(weight);
  at::Tensor dst = out.is_same(x) ? src : executor_ready(out) ? out : at::empty_like(src);
  at::Tensor res_dst = residual_out.is_same(residual) ? res
                       : executor_ready(residual_out) ? residual_out
                                                      : at::empty_like(res);
  if (!src.is_same(x) || !dst.is_same(out) || !res.is_same(residual) ||
      !res_dst.is_same(residual_out) || !w.is_same(weight)) {
    ++staged_;
  }
  plan::EpilogueArgs epilogue;
  epilogue.residual = res.data_ptr();
  epilogue.residual_out = res_dst.data_ptr();
  epilogue.weight = w.data_ptr();
  epilogue.hidden = x.size(-1);
  epilogue.eps = static_cast<float>(eps);
  Decision fused = *decision;
  fused.program = decision->fused_program;
  fused.signature = decision->fused_signature;
  run_kernels(fused, dtype, src.data_ptr(), dst.data_ptr(), src.numel(), &epilogue);
  ++*decision->fused_calls;
  if (!dst.is_same(out)) out.copy_(dst);
  if (!res_dst.is_same(residual_out)) residual_out.copy_(res_dst);
}

// ------------------------------------------------------------------ reduce-scatter, all-gather

namespace {
// Bad arguments of reduce_scatter and all_gather: raised before any communication. `scatter`:
// out is inp with dim 0 divided by world; else multiplied.
void check_collective_args(plan::Collective collective, const at::Tensor& inp,
                           const at::Tensor& out, int world) {
  const std::string name(plan::collective_name(collective));
  const bool scatter = collective == plan::Collective::kReduceScatter;
  if (inp.dim() < 1) {
    throw std::invalid_argument(name +
                                " works along dim 0 and needs a tensor of at least one "
                                "dimension; got a " +
                                describe(inp));
  }
  if (scatter && inp.size(0) % world != 0) {
    throw std::invalid_argument(name + " needs dim 0 of the input divisible by the world size " +
                                std::to_string(world) + "; got a " + describe(inp));
  }
  std::vector<int64_t> expected = inp.sizes().vec();
  expected[0] = scatter ? expected[0] / world : expected[0] * world;
  if (out.scalar_type() != inp.scalar_type() || out.device() != inp.device() ||
      !out.sizes().equals(expected)) {
    throw std::invalid_argument(name + "'s out must have the input's dtype and device and shape " +
                                c10::str(at::IntArrayRef(expected)) + " (dim 0 " +
                                (scatter ? "divided" : "multiplied") + " by the world size " +
                                std::to_string(world) + "): the input is a " + describe(inp) +
                                ", out a " + describe(out));
  }
  if (may_overlap(inp, out)) {
    throw std::invalid_argument(name + "'s out overlaps its input; pass a disjoint tensor");
  }
  check_writable(out, false);
  check_no_internal_overlap(out);
}
}  // namespace

Decline Communicator::collective_admission(const at::Tensor& inp, int64_t message) const {
  const Decline d = supports(inp);
  if (d != Decline::kNone && d != Decline::kTooLarge && d != Decline::kNot16ByteMultiple) {
    return d;
  }
  // supports() judged the input's own size; the message is what the workspace carries.
  const int64_t elem = plan::dtype_bytes(*to_plan_dtype(inp.scalar_type()));
  const int64_t chunk = message / options_.world;
  if (message % options_.world != 0 || (chunk * elem) % plan::kVectorBytes != 0) {
    return Decline::kNot16ByteMultiple;
  }
  if (message > options_.max_numel) return Decline::kTooLarge;
  if (!connected_) return Decline::kDisabled;
  return Decline::kNone;
}

namespace {
// The message a collective's input stands for: the reduce-scatter's input is the message, the
// all-gather's input one chunk of it.
int64_t message_numel(plan::Collective collective, const at::Tensor& inp, int world) {
  return collective == plan::Collective::kAllGather ? inp.numel() * world : inp.numel();
}
}  // namespace

Communicator::Decision& Communicator::decide_collective(plan::Collective collective,
                                                        plan::DType dtype, int64_t bytes) {
  const auto key = std::make_tuple(static_cast<int>(collective), static_cast<int>(dtype), bytes);
  auto it = collective_decisions_.find(key);
  if (it != collective_decisions_.end()) return it->second;
  const plan::TableChoice choice = choose(dtype, bytes, collective);
  Decision d;
  if (choice.line != 0) {  // a row of this collective decided
    d.fallback = choice.fallback;
    d.tactic = choice.tactic;
  } else {  // none: the all-reduce's choice, in its two-shot form
    const Decision& all_reduce = decide(dtype, bytes);
    d.fallback = all_reduce.fallback;
    d.tactic = all_reduce.tactic;
    if (d.tactic.algorithm == plan::Algorithm::kOneshot) {
      d.tactic.algorithm = plan::Algorithm::kTwoshot;
    } else if (d.tactic.algorithm == plan::Algorithm::kIslandOneshot) {
      d.tactic.algorithm = plan::Algorithm::kIslandTwoshot;
    }
  }
  install(d, dtype, collective);
  return collective_decisions_.emplace(key, d).first->second;
}

Decline Communicator::collective_decline_reason(plan::Collective collective,
                                                const at::Tensor& inp) {
  if (collective == plan::Collective::kAllReduce) return decline_reason(inp);
  const int64_t message = message_numel(collective, inp, std::max(options_.world, 1));
  const Decline d = collective_admission(inp, message);
  if (d != Decline::kNone) return d;
  const auto dtype = *to_plan_dtype(inp.scalar_type());
  return decide_collective(collective, dtype, message * plan::dtype_bytes(dtype)).fallback
             ? Decline::kTable
             : Decline::kNone;
}

std::string Communicator::chosen_collective_tactic(plan::Collective collective,
                                                   const at::Tensor& inp) {
  if (collective == plan::Collective::kAllReduce) return chosen_tactic(inp);
  if (collective_decline_reason(collective, inp) != Decline::kNone) return "fallback";
  const auto dtype = *to_plan_dtype(inp.scalar_type());
  const int64_t message = message_numel(collective, inp, options_.world);
  return plan::tactic_label(
      decide_collective(collective, dtype, message * plan::dtype_bytes(dtype)).tactic);
}

void Communicator::run_collective_fallback(plan::Collective collective, const at::Tensor& inp,
                                           at::Tensor& out) {
  if (options_.group_name.empty()) {
    throw std::runtime_error("pcie_allreduce has no process group to fall back to");
  }
  // The group's own collective through c10d's functional ops, as run_fallback().
  static const c10::OperatorHandle& reduce_scatter =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::reduce_scatter_tensor", "");
  static const c10::OperatorHandle& all_gather = c10::Dispatcher::singleton().findSchemaOrThrow(
      "_c10d_functional::all_gather_into_tensor", "");
  static const c10::OperatorHandle& wait =
      c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::wait_tensor", "");
  const int64_t world = options_.world;
  torch::jit::Stack stack;
  if (collective == plan::Collective::kReduceScatter) {
    stack = {inp, std::string("sum"), world, options_.group_name};
    reduce_scatter.callBoxed(&stack);
  } else {
    stack = {inp, world, options_.group_name};
    all_gather.callBoxed(&stack);
  }
  at::Tensor result = stack.back().toTensor();
  stack = {result};
  wait.callBoxed(&stack);
  out.copy_(result.view(out.sizes()));
}

// The kernels address the one-chunk tensor (the reduce-scatter's output, the all-gather's input)
// from chunk `rank` of the message: its base goes in `rank` chunks before it. The programs touch
// only chunk `rank` of it (plan::verify proves it), so no byte outside the tensor is read or
// written; the address is formed as an integer, never dereferenced below the tensor.
void Communicator::run_collective(plan::Collective collective, const at::Tensor& inp,
                                  at::Tensor& out) {
  const std::string name(plan::collective_name(collective));
  check_collective_args(collective, inp, out, std::max(options_.world, 1));
  const at::Tensor src = executor_ready(inp) ? inp : inp.clone(at::MemoryFormat::Contiguous);
  at::Tensor dst = executor_ready(out) ? out : at::empty(out.sizes(), out.options());
  if (!src.is_same(inp) || !dst.is_same(out)) ++staged_;
  const int64_t message = message_numel(collective, src, std::max(options_.world, 1));
  Decline decline = collective_admission(src, message);
  Decision* decision = nullptr;
  plan::DType dtype{};
  if (decline == Decline::kNone) {
    dtype = *to_plan_dtype(src.scalar_type());
    decision = &decide_collective(collective, dtype, message * plan::dtype_bytes(dtype));
    if (decision->fallback) decline = Decline::kTable;
  }
  if (decline != Decline::kNone) {
    ++collective_declines_[name][std::string(decline_name(decline))];
    ++collective_calls_[name]["fallback"];
    skip_call();  // first: a fallback that raises has still taken its generation
    run_collective_fallback(collective, src, dst);
  } else {
    const int64_t chunk_bytes = message / options_.world * plan::dtype_bytes(dtype);
    const auto below = [&](const at::Tensor& t) {
      return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(t.data_ptr()) -
                                     static_cast<uintptr_t>(options_.rank * chunk_bytes));
    };
    const bool scatter = collective == plan::Collective::kReduceScatter;
    run_kernels(*decision, dtype, scatter ? src.data_ptr() : below(src),
                scatter ? below(dst) : dst.data_ptr(), message);
  }
  if (!dst.is_same(out)) out.copy_(dst);
}

void Communicator::reduce_scatter(const at::Tensor& inp, at::Tensor& out) {
  const CallGuard guard(*this, busy_);
  raise_if_failed();
  check_call_device(inp);
  run_collective(plan::Collective::kReduceScatter, inp, out);
}

void Communicator::all_gather(const at::Tensor& inp, at::Tensor& out) {
  const CallGuard guard(*this, busy_);
  raise_if_failed();
  check_call_device(inp);
  run_collective(plan::Collective::kAllGather, inp, out);
}

int Communicator::prepare() {
  const CallGuard guard(*this, busy_);
  if (!enabled()) return static_cast<int>(programs_.size());
  std::vector<int64_t> edges = {workspace_->layout().ll_capacity_bytes,
                                workspace_->layout().ll_capacity_bytes + plan::kVectorBytes};
  for (const plan::TableRow& row : table_.rows()) {
    edges.push_back(row.min_bytes);
    if (row.max_bytes > 0) edges.push_back(row.max_bytes - plan::kVectorBytes);
  }
  for (const plan::DType dtype : options_.dtypes) {
    const int64_t top = options_.max_numel * plan::dtype_bytes(dtype);
    for (int64_t bytes : edges) {
      // Admitted sizes are whole 16-byte vectors, from one vector up to the workspace.
      bytes = std::min(top, std::max<int64_t>(plan::kVectorBytes, bytes));
      bytes -= bytes % plan::kVectorBytes;
      if (bytes >= plan::kVectorBytes) {
        // The fused call's program too: a capture may hold either, and installs nothing.
        Decision& d = decide(dtype, bytes);
        if (!d.fallback) install_fused(d, dtype);
      }
      // The reduce-scatter's and all-gather's: their messages are whole vectors per rank, so
      // the admitted messages on either side of the edge.
      const int64_t per_rank = plan::kVectorBytes * options_.world;
      for (int64_t m : {bytes - bytes % per_rank, bytes - bytes % per_rank + per_rank}) {
        if (m < per_rank || m > top - top % per_rank) continue;
        for (const plan::Collective c :
             {plan::Collective::kReduceScatter, plan::Collective::kAllGather}) {
          decide_collective(c, dtype, m);
        }
      }
    }
  }
  return static_cast<int>(programs_.size());
}

void Communicator::set_table(const std::string& text, const std::string& source) {
  const CallGuard guard(*this, busy_);
  plan::TuningTable table = plan::TuningTable::parse(text, source);
  table_ = std::move(table);
  options_.table_text = text;
  options_.table_source = source;
  decisions_.clear();
}

at::Tensor Communicator::all_reduce(const at::Tensor& inp) {
  const CallGuard guard(*this, busy_);
  raise_if_failed();
  at::Tensor out = at::empty(inp.sizes(), inp.options());  // contiguous, whatever inp's strides
  reduce_into(inp, out);
  return out;
}

// The path of a call (kernels or fallback) depends only on what every rank agrees on: numel,
// dtype, the table and the enabled state. A tensor's own layout never changes it: a strided,
// offset or misaligned input or out is staged through a contiguous copy instead.
void Communicator::reduce_into(const at::Tensor& inp, at::Tensor& out) {
  check_call(inp, out);
  const bool in_place = out.is_same(inp);
  const at::Tensor src = executor_ready(inp) ? inp : inp.clone(at::MemoryFormat::Contiguous);
  at::Tensor dst = in_place ? src : executor_ready(out) ? out : at::empty_like(src);
  if (!src.is_same(inp) || !dst.is_same(out)) ++staged_;
  Decline decline = supports(src);
  Decision* decision = nullptr;
  plan::DType dtype{};
  if (decline == Decline::kNone) {
    dtype = *to_plan_dtype(src.scalar_type());
    decision = &decide(dtype, src.numel() * plan::dtype_bytes(dtype));
    if (decision->fallback) decline = Decline::kTable;
  }
  if (decline != Decline::kNone) {
    note_decline(decline, src);
    ++calls_["fallback"];
    skip_call();  // first: a fallback that raises has still taken its generation
    run_fallback(src, dst);
  } else {
    run_kernels(*decision, dtype, src.data_ptr(), dst.data_ptr(), src.numel());
  }
  if (!dst.is_same(out)) out.copy_(dst);
}

void Communicator::run_kernels(const Decision& decision, plan::DType dtype, const void* input,
                               void* output, int64_t numel, const plan::EpilogueArgs* epilogue) {
  transport::Call call;
  call.program = decision.program->id;
  call.dtype = dtype;
  call.blocks = decision.tactic.blocks;
  call.threads = decision.tactic.threads;
  call.input = input;
  call.output = output;
  call.numel = numel;
  call.signature = decision.signature;
  call.stream = current_stream(workspace_->device());
  if (epilogue != nullptr) call.epilogue = *epilogue;
  try {
    workspace_->run(call);
  } catch (const transport::TransportFailure& e) {
    transport_failed(e);
  }
  ++*decision.calls;
  const auto bytes = static_cast<double>(numel * plan::dtype_bytes(dtype));
  const auto& sent = decision.program->sent_fraction;
  for (size_t p = 0; p < sent.size(); ++p) bytes_sent_[p] += static_cast<int64_t>(sent[p] * bytes);
}

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
  if (workspace_) workspace_->set_interrupt_check(std::move(check));
}

std::optional<plan::Diagnostic> Communicator::failure() const {
  if (failure_) return failure_;
  return workspace_ ? workspace_->failure() : std::nullopt;
}

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
  log(1, "disabled (" + std::string(decline_name(reason)) + "): " + options_.disabled_detail +
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

Stats Communicator::stats() const {
  Stats s;
  for (const auto& [label, count] : calls_) {
    if (count) s.calls[label] = count;  // decisions made but never run stay out
  }
  for (size_t i = 0; i < declines_.size(); ++i) {
    if (declines_[i]) s.declines[std::string(decline_name(static_cast<Decline>(i)))] = declines_[i];
  }
  s.bytes_sent_per_peer = bytes_sent_;
  s.staged = staged_;
  for (const auto& [label, count] : fused_calls_) {
    if (count) s.fused_calls[label] = count;  // installed (prepare()) but never run: left out
  }
  s.fused_declines = fused_declines_;
  for (const auto& [name, labels] : collective_calls_) {
    for (const auto& [label, count] : labels) {
      if (count) s.collective_calls[name][label] = count;
    }
  }
  s.collective_declines = collective_declines_;
  return s;
}

void Communicator::restore_stats(const Stats& earlier) {
  for (auto& [label, count] : calls_) {  // entries stay: decisions point at them
    const auto it = earlier.calls.find(label);
    count = it == earlier.calls.end() ? 0 : it->second;
  }
  declines_.fill(0);
  for (const auto& [name, count] : earlier.declines) {
    declines_[static_cast<size_t>(parse_decline(name))] = count;
  }
  for (size_t i = 0; i < declines_.size(); ++i) {
    decline_logged_[i] = declines_[i] > 0;  // the first real decline of a reason is still said
  }
  if (earlier.bytes_sent_per_peer.size() == bytes_sent_.size()) {
    bytes_sent_ = earlier.bytes_sent_per_peer;
  }
  staged_ = earlier.staged;
}

uint64_t Communicator::layout_hash() const {
  return workspace_ ? plan::layout_hash(workspace_->layout()) : 0;
}

int64_t Communicator::workspace_bytes() const {
  return workspace_ && !released_ ? static_cast<int64_t>(workspace_->layout().total_bytes) : 0;
}

void Communicator::log(int level, const std::string& message) const {
  if (options_.log_level < level) return;
  std::fprintf(stderr, "[pcie_allreduce] rank %d: %s\n", options_.rank, message.c_str());
}

namespace {
std::mutex registry_mutex;
std::unordered_map<int64_t, std::shared_ptr<Communicator>>& registry() {
  static auto* map = new std::unordered_map<int64_t, std::shared_ptr<Communicator>>();
  return *map;
}
int64_t next_handle = 1;
}  // namespace

int64_t register_communicator(std::shared_ptr<Communicator> communicator) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  const int64_t handle = next_handle++;
  registry()[handle] = std::move(communicator);
  return handle;
}

std::shared_ptr<Communicator> lookup_communicator(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find(handle);
  if (it == registry().end()) {
    throw std::invalid_argument("no pcie_allreduce communicator has handle " +
                                std::to_string(handle) + " (was it destroyed?)");
  }
  return it->second;
}

void unregister_communicator(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry().erase(handle);
}

}  // namespace pcie_ar::comm
