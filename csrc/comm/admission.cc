#include "comm/admission.h"

#include <algorithm>

#include "plan/epilogue.h"
#include "plan/layout.h"

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

Decline admit_message(Op op, const at::Tensor& inp, const Gate& gate, Admission& a) {
  const Options& o = gate.options;
  if (o.disabled != Decline::kNone) return o.disabled;
  if (gate.failed) return Decline::kDisabled;
  const auto dtype = to_plan_dtype(inp.scalar_type());
  if (!dtype || std::find(o.dtypes.begin(), o.dtypes.end(), *dtype) == o.dtypes.end()) {
    return Decline::kDtype;
  }
  a.dtype = *dtype;
  const int device = gate.device.value_or(-1);
  if (device < 0 ? !inp.device().is_cpu() : !(inp.is_cuda() && inp.device().index() == device)) {
    return Decline::kDevice;
  }
  a.message = message_numel(op, inp.numel(), o.world);
  if (inp.numel() == 0) return Decline::kEmpty;
  // Every rank's share of a reduce-scatter or all-gather is one chunk: whole vectors, like the
  // all-reduce's whole message.
  const int64_t shares = op.collective == plan::Collective::kAllReduce ? 1 : o.world;
  if (a.message % shares != 0 ||
      (a.message / shares * plan::dtype_bytes(a.dtype)) % plan::kVectorBytes != 0) {
    return Decline::kNot16ByteMultiple;
  }
  // Above the workspace, every operation streams through it in rounds up to the operator's cap;
  // a reduce-scatter's or all-gather's round takes at least one vector of every rank's chunk.
  if (a.message > std::max(o.max_numel, o.stream_max_numel)) return Decline::kTooLarge;
  if (a.message > o.max_numel &&
      o.max_numel / shares * plan::dtype_bytes(a.dtype) < plan::kVectorBytes) {
    return Decline::kTooLarge;
  }
  if (!gate.connected) return Decline::kDisabled;
  return Decline::kNone;
}

}  // namespace

Admission admit(Op op, const at::Tensor& inp, const at::Tensor* weight, const Gate& gate) {
  Admission a;
  if (has_epilogue(op) && inp.dim() < 1) {  // no rows to normalise
    a.decline = Decline::kEmpty;
    return a;
  }
  a.decline = admit_message(op, inp, gate, a);
  if (a.decline != Decline::kNone || !has_epilogue(op)) return a;
  if (weight != nullptr && weight->scalar_type() != inp.scalar_type()) {
    a.decline = Decline::kDtype;
    return a;
  }
  const int64_t hidden = inp.size(-1);
  if (hidden > plan::kMaxEpilogueHidden ||
      (hidden * plan::dtype_bytes(a.dtype)) % plan::kVectorBytes != 0) {
    a.decline = Decline::kHidden;
  } else if (a.message > gate.options.max_numel && hidden > gate.options.max_numel) {
    a.decline = Decline::kTooLarge;  // a streamed round holds whole rows: not even one fits
  }
  return a;
}

}  // namespace pcie_ar::comm
