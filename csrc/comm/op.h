// An operation is data: a collective and what follows it on each rank's rows. One path checks,
// admits, decides, runs and counts every operation (Communicator::run); what differs between
// them is said here, once, as the traits of an Op.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

#include "plan/epilogue.h"
#include "plan/names.h"
#include "plan/tactic.h"

namespace pcie_ar::comm {

// What runs after the reduction, on this rank's own rows (plan/epilogue.h). Explicit and
// append-only.
enum class Epilogue : uint8_t {
  kNone = 0,
  kAddRmsNorm = 1,  // residual_out = sum + residual, out = rms_norm(residual_out) * weight
  kRmsNorm = 2,     // residual_out = sum, out = rms_norm(sum) * weight (a model's first layer)
};

// The epilogue's output may also be quantised (plan::Quant): then the op returns y_q, never y
// (and NVFP4's block scales).
struct Op {
  plan::Collective collective = plan::Collective::kAllReduce;
  Epilogue epilogue = Epilogue::kNone;
  plan::Quant quant = plan::Quant::kNone;

  constexpr bool operator==(const Op&) const = default;
};

inline constexpr Op kAllReduce{};
inline constexpr Op kAllReduceAddRmsNorm{plan::Collective::kAllReduce, Epilogue::kAddRmsNorm};
inline constexpr Op kReduceScatter{plan::Collective::kReduceScatter};
inline constexpr Op kAllGather{plan::Collective::kAllGather};
inline constexpr Op kAllReduceRmsNorm{plan::Collective::kAllReduce, Epilogue::kRmsNorm};
inline constexpr Op kAllReduceAddRmsNormFp8{plan::Collective::kAllReduce, Epilogue::kAddRmsNorm,
                                            plan::Quant::kFp8E4m3};
inline constexpr Op kAllReduceRmsNormFp8{plan::Collective::kAllReduce, Epilogue::kRmsNorm,
                                         plan::Quant::kFp8E4m3};
inline constexpr Op kAllReduceAddRmsNormNvfp4{plan::Collective::kAllReduce, Epilogue::kAddRmsNorm,
                                              plan::Quant::kNvfp4};
inline constexpr Op kAllReduceRmsNormNvfp4{plan::Collective::kAllReduce, Epilogue::kRmsNorm,
                                           plan::Quant::kNvfp4};

// Every operation and its public name (the torch op's and the Python API's). The position in
// this table is the op's row in the stats table and part of its decisions' key.
inline constexpr auto kOpNames =
    plan::name_table<Op>("operation", {{kAllReduce, "all_reduce"},
                                       {kAllReduceAddRmsNorm, "all_reduce_add_rms_norm"},
                                       {kReduceScatter, "reduce_scatter"},
                                       {kAllGather, "all_gather"},
                                       {kAllReduceRmsNorm, "all_reduce_rms_norm"},
                                       {kAllReduceAddRmsNormFp8, "all_reduce_add_rms_norm_fp8"},
                                       {kAllReduceRmsNormFp8, "all_reduce_rms_norm_fp8"},
                                       {kAllReduceAddRmsNormNvfp4, "all_reduce_add_rms_norm_nvfp4"},
                                       {kAllReduceRmsNormNvfp4, "all_reduce_rms_norm_nvfp4"}});
inline constexpr size_t kOpCount = kOpNames.entries.size();

constexpr size_t op_index(Op op) {
  for (size_t i = 0; i < kOpCount; ++i) {
    if (kOpNames.entries[i].value == op) return i;
  }
  return kOpCount;
}
inline std::string_view op_name(Op op) { return kOpNames.name_of(op); }
inline std::optional<Op> find_op(std::string_view name) { return kOpNames.find(name); }

constexpr bool has_epilogue(Op op) { return op.epilogue != Epilogue::kNone; }
// The fused forms that add a residual (and return residual_out = sum + residual); the others
// return the sum itself as their residual_out.
constexpr bool has_residual(Op op) { return op.epilogue == Epilogue::kAddRmsNorm; }
constexpr bool is_quantised(Op op) { return op.quant != plan::Quant::kNone; }
constexpr bool is_nvfp4(Op op) { return op.quant == plan::Quant::kNvfp4; }
// The fused form without its epilogue's options: the table row and program every fused op runs.
constexpr Op program_op(Op op) {
  return Op{op.collective, has_epilogue(op) ? Epilogue::kAddRmsNorm : Epilogue::kNone};
}

// The stats label of a call the kernels did not run: the fused call's own unfused path, or the
// group's own collective.
constexpr std::string_view fallback_label(Op op) {
  return has_epilogue(op) ? "unfused" : "fallback";
}

// The message the workspace carries for an input of `numel` elements: the all-gather's input is
// one of its `world` chunks; every other op's input is the whole message.
constexpr int64_t message_numel(Op op, int64_t numel, int world) {
  return op.collective == plan::Collective::kAllGather ? numel * world : numel;
}

// Dim 0 of the output for an input whose dim 0 is `rows`: divided (reduce-scatter) or multiplied
// (all-gather) by the world size; the all-reduce's output is shaped like its input.
constexpr int64_t output_rows(Op op, int64_t rows, int world) {
  if (op.collective == plan::Collective::kReduceScatter) return rows / world;
  if (op.collective == plan::Collective::kAllGather) return rows * world;
  return rows;
}

// The one-chunk tensor the kernels address from chunk `rank` of the message: the reduce-scatter's
// output, the all-gather's input.
constexpr bool input_is_chunk(Op op) { return op.collective == plan::Collective::kAllGather; }
constexpr bool output_is_chunk(Op op) { return op.collective == plan::Collective::kReduceScatter; }

// The code every flag, LL tag and lamport header of the call carries (plan::call_signature): a
// rank in one op and a peer in another fail as a mismatch naming each other.
inline uint32_t op_signature(Op op, plan::DType dtype, const plan::Tactic& tactic) {
  return plan::call_signature(dtype, tactic, has_epilogue(op), op.collective);
}

}  // namespace pcie_ar::comm
