// The calls a communicator makes of its workspace's kernels: planning a call (whole, or streamed
// through the workspace in rounds), running each round, and the skip call a fallback takes.
#include <ATen/core/Tensor.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cstdint>

#include "comm/communicator.h"
#include "comm/staged.h"
#include "plan/epilogue.h"
#include "plan/layout.h"
#include "plan/rounds.h"
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

}  // namespace

// A message the workspace holds runs as one call. A larger one (admission let it through up to
// stream_max_numel) streams through the workspace in rounds, each decided by its own size; the
// rounds have at most two sizes (plan::split_rounds).
// - All-reduce: rounds of whole vectors of the message, or the fused call's whole rows.
// - Reduce-scatter and all-gather: round k is the same slice [o_k, o_k + m_k) of every rank's
//   chunk, a call over a message of world * m_k elements whose chunks lie the whole message's
//   chunk length apart in the tensors (transport::Call::chunk_stride). Each round is still a
//   reduce-scatter (all-gather) of its slices, so every element is the group's one tree.
Communicator::CallPlan Communicator::plan_call(Op op, const Admission& a, const at::Tensor& inp) {
  CallPlan plan;
  if (a.message <= options_.max_numel) {
    plan.whole = &decisions_.decide(op, a.dtype, a.bytes());
    plan.reason = plan.whole->reason;
    return plan;
  }
  const int64_t elem = plan::dtype_bytes(a.dtype);
  const int64_t lanes = plan::kVectorBytes / elem;
  const int64_t shares = op.collective == plan::Collective::kAllReduce ? 1 : options_.world;
  if (shares > 1) {
    plan.chunk = a.message / shares;
    plan.rounds = plan::split_rounds(plan.chunk, options_.max_numel / shares, lanes);
  } else {
    const int64_t unit = has_epilogue(op) ? inp.size(-1) : lanes;
    plan.rounds = plan::split_rounds(a.message, options_.max_numel, unit);
  }
  for (const plan::Round& round : plan.rounds) {
    const Decision& d = decisions_.decide(op, a.dtype, round.numel * shares * elem);
    plan.decisions.push_back(&d);
    // A round the self-test took from its tactic says so, ahead of one the table declines.
    if (d.fallback() && plan.reason != Decline::kSelfTest) plan.reason = d.reason;
  }
  if (plan.rounds.empty()) plan.reason = Decline::kTable;
  return plan;
}

void Communicator::run_kernels(Op op, const CallPlan& plan, const Admission& admission,
                               const Staged& s) {
  if (plan.whole != nullptr) {
    run_round(op, *plan.whole, plan::Round{0, admission.message}, -1, 0, admission, s);
  } else {
    for (size_t k = 0; k < plan.rounds.size(); ++k) {
      run_round(op, *plan.decisions[k], plan.rounds[k], static_cast<int>(k), plan.chunk, admission,
                s);
    }
  }
  // One call, counted under the tactic of its first round.
  const Decision& decision = plan.first();
  ++*decision.calls;
  if (decision.contained_calls != nullptr) ++*decision.contained_calls;
}

// `round` is in the message's elements, or (chunk != 0: a streamed collective) in each chunk's.
// The kernels address a one-chunk tensor (the reduce-scatter's output, the all-gather's input)
// from chunk `rank` of the message: its base goes in `rank` chunk strides before it. The programs
// touch only chunk `rank` of it (plan::verify proves it), so no byte outside the tensor is read or
// written; the address is formed as an integer, never dereferenced below the tensor.
void Communicator::run_round(Op op, const Decision& decision, plan::Round round, int index,
                             int64_t chunk, const Admission& admission, const Staged& s) {
  const int64_t elem = plan::dtype_bytes(admission.dtype);
  const int64_t world = options_.world;
  const int64_t numel = chunk != 0 ? round.numel * world : round.numel;
  const int64_t stride = chunk != 0 ? chunk : numel / world;  // where chunk c starts, per c
  const auto at = [&](const at::Tensor& t) {
    return static_cast<void*>(static_cast<uint8_t*>(t.data_ptr()) + round.offset * elem);
  };
  const auto chunk_base = [&](const at::Tensor& t) {
    const auto below = static_cast<uintptr_t>(options_.rank * stride * elem);
    return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(at(t)) - below);
  };
  transport::Call call;
  call.program = decision.program->id;
  call.dtype = admission.dtype;
  call.blocks = decision.tactic.blocks;
  call.threads = decision.tactic.threads;
  call.input = input_is_chunk(op) ? chunk_base(s.inp) : at(s.inp);
  call.output = output_is_chunk(op) ? chunk_base(s.out) : at(s.sum);
  call.numel = numel;
  call.chunk_stride = chunk;
  call.signature = decision.signature;
  call.stream = current_stream(workspace_->device());
  if (has_epilogue(op)) {
    plan::EpilogueArgs& e = call.epilogue;
    e.residual = has_residual(op) ? at(s.residual) : nullptr;
    e.residual_out = at(s.residual_out);
    e.weight = s.weight.data_ptr();
    e.hidden = s.inp.size(-1);
    // y_q has one byte an element (FP8) or two elements a byte (NVFP4): the round's rows start
    // round.offset bytes in, or half that. NVFP4's block scales are placed by row index.
    e.y = is_quantised(op) ? nullptr : at(s.out);
    e.y_q = is_quantised(op) ? static_cast<uint8_t*>(s.out.data_ptr()) +
                                   (is_nvfp4(op) ? round.offset / 2 : round.offset)
                             : nullptr;
    e.scale = is_quantised(op) ? s.scale.data_ptr<float>() : nullptr;
    e.quant = op.quant;
    if (is_nvfp4(op)) {
      e.block_scale = static_cast<uint8_t*>(s.block_scale.data_ptr());
      e.first_row = round.offset / e.hidden;
      e.total_rows = admission.message / e.hidden;
    }
    e.eps = static_cast<float>(s.eps);
    e.weight_offset = static_cast<float>(s.weight_offset);
    // Ranks that disagree on the epilogue's form, eps, weight offset or row length fail at
    // once, naming each other.
    call.signature = plan::epilogue_signature(decision.signature, e);
  }
  if (index >= 0) call.signature = plan::round_signature(call.signature, admission.message, index);
  try {
    workspace_->run(call);
  } catch (const transport::TransportFailure& e) {
    transport_failed(e);
  }
  counters_.sent(decision.program->sent_fraction, numel * elem);
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

}  // namespace pcie_ar::comm
