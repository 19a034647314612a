#include "comm/arguments.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/ScalarType.h>
#include <c10/util/StringUtil.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <vector>

#include "plan/layout.h"
#include "plan/quant.h"

namespace pcie_ar::comm {
namespace {

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

bool like(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes().equals(b.sizes()) &&
         a.device() == b.device();
}

// Messages start with the op the caller called (built only on the way to a throw: every call
// checks).
std::string name_of(Op op) { return std::string(op_name(op)); }
std::string prefix(Op op) { return name_of(op) + ": "; }

// A tensor of the call under the name the caller gave it (the fused call's signature names its
// input x); null or undefined: not passed (an output the call allocates).
struct Operand {
  const char* name;
  const at::Tensor* tensor;
  bool given() const { return tensor != nullptr && tensor->defined(); }
};

enum Slot : size_t { kInput, kOut, kResidual, kWeight, kResidualOut, kScale, kBlockScale };
constexpr size_t kSlots = 7;

std::array<Operand, kSlots> operands(Op op, const OpArgs& a) {
  return {{{has_epilogue(op) ? "x" : "the input", &a.inp},
           {"out", &a.out},
           {"residual", a.residual},
           {"weight", a.weight},
           {"residual_out", a.residual_out},
           {"scale", a.scale},
           {"block_scale", a.block_scale}}};
}

// ------------------------------------------------------------------ the device

std::string device_name(int device) {
  return device < 0 ? std::string("cpu") : "cuda:" + std::to_string(device);
}

// Every operand on the communicator's device. A tensor elsewhere is a programming error, never a
// decline; a meta tensor holds no data to communicate (and the torch ops' Meta kernels send a
// real call with one here). Without a workspace every operand must be on the input's device.
void check_devices(Op op, const OpArgs& a, std::optional<int> device) {
  for (const Operand& o : operands(op, a)) {
    if (!o.given()) continue;
    const at::Tensor& t = *o.tensor;
    const bool here =
        device ? (*device < 0 ? t.device().is_cpu() : t.is_cuda() && t.device().index() == *device)
               : t.device() == a.inp.device() && !t.is_meta();
    if (!here) {
      throw std::invalid_argument(
          prefix(op) + o.name + " is a " + describe(t) + "; this communicator runs on " +
          (device ? device_name(*device) : "the input's device (never meta)") + ": pass " + o.name +
          " there");
    }
  }
}

// ------------------------------------------------------------------ the group's dtypes

// What the group's own collective takes, which runs every call the kernels decline (comm/fallback):
// a dtype it cannot take would fail inside it after the call took a generation. The dtype is part
// of what every rank agrees on, so every rank refuses the call alike, before any communication.
// gloo (CPU tensors), measured on torch 2.14 for all_reduce_, reduce_scatter_tensor and
// all_gather_into_tensor alike: int16, uint16/32/64 and every float8 raise "Invalid scalar type".
constexpr std::array kGlooDtypes = {at::kBool,   at::kByte,         at::kChar,         at::kInt,
                                    at::kLong,   at::kHalf,         at::kBFloat16,     at::kFloat,
                                    at::kDouble, at::kComplexFloat, at::kComplexDouble};
// NCCL (CUDA tensors), conservatively: the types every NCCL that torch ships sums. float8 (e4m3fn,
// e5m2) is only moved (all-gather), never summed: torch refuses float8 NCCL reductions.
constexpr std::array kNcclDtypes = {at::kChar, at::kByte,     at::kInt,   at::kLong,
                                    at::kHalf, at::kBFloat16, at::kFloat, at::kDouble};
constexpr std::array kNcclMovedDtypes = {at::kFloat8_e4m3fn, at::kFloat8_e5m2};

template <size_t N>
bool listed(const std::array<at::ScalarType, N>& dtypes, at::ScalarType t) {
  return std::find(dtypes.begin(), dtypes.end(), t) != dtypes.end();
}

bool group_takes(Op op, at::ScalarType t, bool cuda) {
  if (!cuda) return listed(kGlooDtypes, t);
  return listed(kNcclDtypes, t) ||
         (op.collective == plan::Collective::kAllGather && listed(kNcclMovedDtypes, t));
}

std::string torch_name(at::ScalarType t) {
  return "torch." + std::string(c10::getDtypeNames(t).first);
}

template <size_t N>
void append_names(std::string& out, const std::array<at::ScalarType, N>& dtypes) {
  for (const at::ScalarType t : dtypes) out += (out.empty() ? "" : ", ") + torch_name(t);
}

void check_group_dtype(Op op, const at::Tensor& inp) {
  const bool cuda = inp.is_cuda();
  if (group_takes(op, inp.scalar_type(), cuda)) return;
  std::string accepted;
  if (!cuda) {
    append_names(accepted, kGlooDtypes);
  } else {
    append_names(accepted, kNcclDtypes);
    if (op.collective == plan::Collective::kAllGather) append_names(accepted, kNcclMovedDtypes);
  }
  throw std::invalid_argument(
      prefix(op) + (has_epilogue(op) ? "x" : "the input") + " is " + torch_name(inp.scalar_type()) +
      ", a dtype the group's own collective (" + (cuda ? "NCCL" : "gloo") +
      ": the path of every call the kernels decline) cannot take; pass one of " + accepted);
}

// ------------------------------------------------------------------ written tensors

// How the call that writes `arg` reads in messages: all_reduce_ (in place), all_reduce(out=),
// all_reduce_add_rms_norm(residual_out=residual) (in place of residual).
std::string writer(Op op, std::string_view arg, const char* in_place_of) {
  if (in_place_of != nullptr && !has_epilogue(op)) return name_of(op) + "_";
  return name_of(op) + "(" + std::string(arg) + "=" + (in_place_of ? in_place_of : "") + ")";
}

// Torch's own rules for a tensor an op writes (`arg`, in place of the operand `in_place_of` or
// null): autograd's (the op has no derivative, so writing into a tensor autograd tracks would
// silently break its gradient; std::runtime_error, torch's wording), inference mode's, and no
// element written twice (an expand).
void check_written(Op op, const at::Tensor& out, std::string_view arg, const char* in_place_of) {
  const auto what = [&] { return in_place_of ? std::string(in_place_of) : std::string(arg); };
  if (out.requires_grad() && at::GradMode::is_enabled()) {
    throw std::runtime_error(
        in_place_of && out.is_leaf()
            ? "a leaf Variable that requires grad is being used in an in-place operation (" +
                  writer(op, arg, in_place_of) +
                  "); call it under torch.no_grad() or on a tensor that does not require grad"
            : writer(op, arg, in_place_of) + " has no derivative, but " + what() +
                  ", which it writes, requires grad; call it under torch.no_grad() or on a "
                  "detached tensor");
  }
  if (out.is_inference() && !c10::InferenceMode::is_enabled()) {
    throw std::runtime_error(
        "Inplace update to inference tensor outside InferenceMode is not allowed: " +
        writer(op, arg, in_place_of) + " writes " + what() +
        ", which was created in inference mode; call it inside torch.inference_mode() or "
        "clone() the tensor first");
  }
  if (at::has_internal_overlap(out) == at::MemOverlap::Yes) {
    throw std::invalid_argument(
        prefix(op) + "unsupported operation: more than one element of the written-to tensor (" +
        what() +
        ") refers to a single memory location (an expanded or overlapping view); clone() it "
        "first");
  }
}

}  // namespace

const char* tracked_read(Op op, const OpArgs& a) {
  const auto tracked = [](const at::Tensor* t) { return t && t->defined() && t->requires_grad(); };
  if (!a.out.is_same(a.inp) && tracked(&a.inp)) return "the input";
  if (!has_epilogue(op)) return nullptr;
  if (!(a.residual_out && a.residual && a.residual_out->is_same(*a.residual)) &&
      tracked(a.residual)) {
    return "residual";
  }
  if (tracked(a.weight)) return "weight";
  return tracked(a.scale) ? "scale" : nullptr;
}

namespace {

// A form that writes given tensors has no derivative, so an operand it reads that autograd tracks
// would silently lose its gradient (torch's own out= ops refuse it too). The functional forms
// have derivatives (bindings/derivatives.cc): they reach this with grad mode off when they build
// a graph node, and with untracked operands otherwise.
void check_reads(Op op, const OpArgs& a) {
  if (const char* operand = tracked_read(op, a)) {
    throw std::runtime_error(writer(op, "out", nullptr) + " has no derivative, but " + operand +
                             ", which it reads, requires grad; call the functional form (no out=), "
                             "which has one, or call it under torch.no_grad()");
  }
}

// ------------------------------------------------------------------ each op's tensors

// The all-reduce's out: like the input, or the input itself.
void check_all_reduce(Op op, const at::Tensor& inp, const at::Tensor& out) {
  if (!out.defined()) return;
  if (!out.is_same(inp)) {
    if (!like(out, inp)) {
      throw std::invalid_argument(
          prefix(op) + "out must have the input's dtype, shape and device: the input is a " +
          describe(inp) + ", out a " + describe(out));
    }
    if (may_overlap(inp, out)) {
      throw std::invalid_argument(
          prefix(op) +
          "out overlaps the input without being the same tensor; pass the input itself for an "
          "in-place all-reduce (all_reduce_) or a disjoint tensor");
    }
  }
  check_written(op, out, "out", out.is_same(inp) ? "the input" : nullptr);
}

// One of the fused call's outputs (out, which may be x; residual_out, which may be residual;
// `may_be` is the operand it may be in place of, if any): shaped like x, of x's dtype or `dtype`,
// overlapping no input but the one it may be. The weight (and the scale) are read while both are
// written, so they overlap neither. The forms without a residual write y while their sum is still
// read, and a quantised out (y_q) has its own dtype: they are in place of nothing.
// `sizes` empty: x's. Every output is checked against every operand; the outputs against each
// other in check_fused.
void check_fused_output(Op op, const OpArgs& a, Slot output, std::optional<Slot> may_be,
                        at::ScalarType dtype, std::vector<int64_t> sizes = {}) {
  const std::array<Operand, kSlots> named = operands(op, a);
  const Operand& o = named[output];
  if (!o.given()) return;
  const at::Tensor& t = *o.tensor;
  const bool x_shaped = sizes.empty();
  if (x_shaped) sizes = a.inp.sizes().vec();
  if (t.scalar_type() != dtype || !t.sizes().equals(sizes) || t.device() != a.inp.device()) {
    const std::string what =
        dtype == a.inp.scalar_type() && x_shaped
            ? " must have x's dtype, shape and device"
            : " must be " + torch_name(dtype) + " " +
                  (x_shaped ? "with x's shape" : c10::str(at::IntArrayRef(sizes))) +
                  " on x's device";
    throw std::invalid_argument(prefix(op) + o.name + what + ": x is a " + describe(a.inp) + ", " +
                                o.name + " a " + describe(t));
  }
  const char* of = may_be ? named[*may_be].name : nullptr;
  const bool in_place = may_be && named[*may_be].given() && t.is_same(*named[*may_be].tensor);
  for (const Slot i : {kInput, kResidual, kWeight, kScale}) {  // the other output: check_fused
    if (!named[i].given() || (i == may_be && in_place) || !may_overlap(t, *named[i].tensor)) {
      continue;
    }
    throw std::invalid_argument(
        prefix(op) + o.name + " overlaps " + named[i].name +
        (i == may_be ? " without being " + std::string(of) : "") + "; " + o.name +
        (of ? " may be " + std::string(of) + " (in place) but" : "") +
        " may not overlap any other operand: pass " +
        (of ? std::string(of) + " itself or " : std::string()) + "a disjoint tensor");
  }
  check_written(op, t, o.name, in_place ? of : nullptr);
}

// A quantised form's scale: one fp32 on x's device (vLLM's per-tensor scale tensor; NVFP4's
// global scale).
void check_scale(Op op, const OpArgs& a) {
  if (a.scale == nullptr || !a.scale->defined()) {
    throw std::invalid_argument(prefix(op) +
                                "needs scale, the static per-tensor scale (one torch.float32)");
  }
  const at::Tensor& scale = *a.scale;
  if (scale.scalar_type() != at::kFloat || scale.numel() != 1) {
    throw std::invalid_argument(prefix(op) +
                                "scale must be one torch.float32 element on x's device (the "
                                "static per-tensor scale); got a " +
                                describe(scale));
  }
}

// NVFP4 quantises blocks of 16 elements of a row of bf16 or fp16, as vLLM's scaled_fp4_quant.
void check_nvfp4(Op op, const OpArgs& a) {
  const at::Tensor& x = a.inp;
  if (x.scalar_type() != at::kBFloat16 && x.scalar_type() != at::kHalf) {
    throw std::invalid_argument(prefix(op) +
                                "quantises bf16 or fp16 x to NVFP4 (as vLLM's "
                                "scaled_fp4_quant); got a " +
                                describe(x));
  }
  if (x.size(-1) % plan::kNvfp4Block != 0) {
    throw std::invalid_argument(prefix(op) + "needs hidden (x's last dimension) a multiple of " +
                                std::to_string(plan::kNvfp4Block) + ", NVFP4's block; got a " +
                                describe(x));
  }
}

void check_fused(Op op, const OpArgs& a) {
  const at::Tensor& x = a.inp;
  const bool adds = has_residual(op);
  if (adds && (a.residual == nullptr || !a.residual->defined())) {
    throw std::invalid_argument(prefix(op) + "needs a residual tensor");
  }
  if (!adds && a.residual != nullptr && a.residual->defined()) {
    throw std::invalid_argument(prefix(op) + "takes no residual (its residual_out is the sum)");
  }
  if (a.weight == nullptr || !a.weight->defined()) {
    throw std::invalid_argument(prefix(op) + "needs a weight tensor");
  }
  const at::Tensor& weight = *a.weight;
  if (x.dim() < 1) {
    throw std::invalid_argument(
        prefix(op) + "needs x of at least one dimension (rows of hidden); got a " + describe(x));
  }
  const int64_t hidden = x.size(-1);
  if (adds && !like(*a.residual, x)) {
    throw std::invalid_argument(prefix(op) +
                                "residual must have x's dtype, shape and device: x is a " +
                                describe(x) + ", residual a " + describe(*a.residual));
  }
  if (!std::isfinite(a.weight_offset)) {
    throw std::invalid_argument(prefix(op) + "weight_offset must be finite (0, or 1 for Gemma's " +
                                "weight convention); got " + std::to_string(a.weight_offset));
  }
  if (is_quantised(op)) {
    check_scale(op, a);
  } else if (a.scale != nullptr && a.scale->defined()) {
    throw std::invalid_argument(prefix(op) + "takes no scale (its output is not quantised)");
  }
  if (!is_nvfp4(op) && a.block_scale != nullptr && a.block_scale->defined()) {
    throw std::invalid_argument(prefix(op) + "takes no block_scale (only NVFP4 has block scales)");
  }
  if (weight.dim() != 1 || weight.size(0) != hidden) {
    throw std::invalid_argument(prefix(op) + "weight must be [hidden] = [" +
                                std::to_string(hidden) + "] on x's device: x is a " + describe(x) +
                                ", weight a " + describe(weight));
  }
  const std::optional<Slot> y_in_place =
      adds && !is_quantised(op) ? std::optional(kInput) : std::nullopt;
  if (is_nvfp4(op)) {
    check_nvfp4(op, a);
    std::vector<int64_t> packed = x.sizes().vec();
    packed.back() = hidden / 2;
    check_fused_output(op, a, kOut, std::nullopt, at::kByte, packed);
    check_fused_output(op, a, kBlockScale, std::nullopt, at::kFloat8_e4m3fn, nvfp4_scale_sizes(x));
  } else {
    check_fused_output(op, a, kOut, y_in_place,
                       is_quantised(op) ? at::kFloat8_e4m3fn : x.scalar_type());
  }
  check_fused_output(op, a, kResidualOut, adds ? std::optional(kResidual) : std::nullopt,
                     x.scalar_type());
  const std::array<Operand, kSlots> named = operands(op, a);
  for (const auto& [first, second] : {std::pair{kOut, kResidualOut}, std::pair{kOut, kBlockScale},
                                      std::pair{kResidualOut, kBlockScale}}) {
    if (named[first].given() && named[second].given() &&
        may_overlap(*named[first].tensor, *named[second].tensor)) {
      throw std::invalid_argument(prefix(op) + named[first].name + " overlaps " +
                                  named[second].name + "; the outputs must be disjoint");
    }
  }
}

// Reduce-scatter and all-gather: along dim 0, out is inp with dim 0 divided or multiplied by
// the world size, never in place.
void check_collective(Op op, const at::Tensor& inp, const at::Tensor& out, int world) {
  const bool scatter = output_is_chunk(op);
  if (inp.dim() < 1) {
    throw std::invalid_argument(
        prefix(op) + "works along dim 0 and needs a tensor of at least one dimension; got a " +
        describe(inp));
  }
  if (scatter && inp.size(0) % world != 0) {
    throw std::invalid_argument(prefix(op) +
                                "needs dim 0 of the input divisible by the world size " +
                                std::to_string(world) + "; got a " + describe(inp));
  }
  if (!out.defined()) return;
  const int64_t rows = output_rows(op, inp.size(0), world);
  bool shaped = out.dim() == inp.dim() && out.size(0) == rows;
  for (int64_t d = 1; shaped && d < inp.dim(); ++d) shaped = out.size(d) == inp.size(d);
  if (out.scalar_type() != inp.scalar_type() || out.device() != inp.device() || !shaped) {
    std::vector<int64_t> expected = inp.sizes().vec();
    expected[0] = rows;
    throw std::invalid_argument(
        prefix(op) + "out must have the input's dtype and device and shape " +
        c10::str(at::IntArrayRef(expected)) + " (dim 0 " + (scatter ? "divided" : "multiplied") +
        " by the world size " + std::to_string(world) + "): the input is a " + describe(inp) +
        ", out a " + describe(out));
  }
  if (may_overlap(inp, out)) {
    throw std::invalid_argument(prefix(op) + "out overlaps its input; pass a disjoint tensor");
  }
  check_written(op, out, "out", nullptr);
}

}  // namespace

void check_args(Op op, const OpArgs& a, int world, std::optional<int> device) {
  check_devices(op, a, device);
  check_group_dtype(op, a.inp);
  if (at::GradMode::is_enabled()) check_reads(op, a);
  if (op.collective != plan::Collective::kAllReduce) {
    check_collective(op, a.inp, a.out, std::max(world, 1));
  } else if (has_epilogue(op)) {
    check_fused(op, a);
  } else {
    check_all_reduce(op, a.inp, a.out);
  }
}

std::vector<int64_t> nvfp4_scale_sizes(const at::Tensor& x) {
  const int64_t hidden = x.size(-1);
  const int64_t rows = hidden == 0 ? 0 : x.numel() / hidden;
  return {plan::nvfp4_padded_rows(rows), 4 * plan::nvfp4_k_tiles(hidden)};
}

bool executor_ready(const at::Tensor& t) {
  return t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % plan::kVectorBytes == 0;
}

std::string describe(const at::Tensor& t) {
  std::string shape = "[";
  for (int64_t i = 0; i < t.dim(); ++i) shape += (i ? ", " : "") + std::to_string(t.size(i));
  return std::string(c10::toString(t.scalar_type())) + " " + shape + "] on " + t.device().str();
}

}  // namespace pcie_ar::comm
