// The fused epilogue of a decoder layer: after the all-reduce,
//   residual_out = sum + residual                 (no residual: r = sum, left where it is)
//   y            = rms_norm(residual_out) * (weight + weight_offset)
//   y_q          = quantise(y)                    (when a quantised output is asked for)
// per row of `hidden` elements, where `sum` is the all-reduce's result as the schedule forms it.
// These are the forms vLLM's all-reduce fusion pass matches: with and without the residual add,
// the Gemma weight convention (weight_offset 1: the engine's `weight.float() + 1.0`), and a
// static-scale FP8 output.
// Both executors (host: executors/host/epilogue.cc; CUDA: cuda/epilogue.cuh) and the unfused path
// (comm/fallback.cc, in ATen) compute exactly this, so a row's result is the same on every
// rank, on every path that rounds the same, and whatever other rows share the batch:
//
//   r_i   = round(float(sum_i) + float(residual_i))         rounded once to the dtype
//   sq_i  = float(r_i) * float(r_i)                         fp32, no FMA anywhere
//   part_q = sq_q + sq_{q+Q} + sq_{q+2Q} + ...              Q = kNormPartials partials, each
//                                                           summed in ascending element order
//   total = tree(part): for h = Q/2, Q/4, ..., 1: part_q = part_q + part_{q+h}  (q < h)
//   rstd  = 1 / sqrt(total / hidden + eps)                  fp32, each operation rounded once
//   w_i   = float(weight_i) + weight_addend(weight_offset)  fp32; offset 0 adds -0, which
//                                                           leaves every value as it is
//   y_i   = round((float(r_i) * rstd) * w_i)                rounded once to the dtype
//   y_q_i = e4m3(clamp(float(y_i) * (1 / scale), ±448))    plan/quant.h: vLLM's static FP8
//                                                           quantisation of the rounded y
//   or NVFP4: e2m1 codes and e4m3 block scales of the rounded y (plan/quant.h)
//
// Without a residual r_i = sum_i exactly: it is round(sum_i + 0) with the sum never -0 (design.md,
// "One reduction order per group"), so the no-residual form is the residual form with zeros.
// The order of the mean of squares depends only on `hidden` (never on the tactic's blocks or
// threads, nor on the batch), and every fp32 operation is a single IEEE operation (the GPU uses
// __fmul_rn/__fadd_rn/__fdiv_rn/__fsqrt_rn, so nothing contracts into an FMA). The partials are
// per element position so that a CTA's threads (or a CPU's SIMD lanes) each own some of them.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "plan/host_device.h"

namespace pcie_ar::plan {

// Partials of the mean of squares, in elements: a power of two. A row shorter than this leaves
// the rest at zero (0 + x is exact, so they change nothing).
inline constexpr int kNormPartials = 2048;
static_assert((kNormPartials & (kNormPartials - 1)) == 0);

// Rows are whole 16-byte vectors, so every vector of a row is one load; and a row's partials are
// formed by one CTA, so a row fits the executors' per-row loops. Engines' hidden sizes (896 ..
// 16384) are far inside.
inline constexpr int64_t kMaxEpilogueHidden = 65536;

// The quantised output of the epilogue (append-only: part of the call's signature).
enum class Quant : uint8_t {
  kNone = 0,
  kFp8E4m3 = 1,  // float8_e4m3fn, one static fp32 scale for the whole tensor (plan/quant.h)
  kNvfp4 = 2,    // e2m1 in blocks of 16, e4m3 block scales, a global fp32 scale (plan/quant.h)
};

// What the epilogue adds to every weight, in fp32: the offset, or for offset 0 the one addend that
// changes no value at all (x + -0 is x for every x, -0 and NaN included; x + +0 would turn a -0
// weight into +0, and y's zero signs with it), so weight_offset 0 is exactly the plain weight.
PCIE_AR_HD float weight_addend(float weight_offset) {
  return weight_offset == 0.0f ? -0.0f : weight_offset;
}

// What an epilogue call carries beside the all-reduce's input and output. Every pointer is
// 16-byte aligned; row tensors are [numel / hidden, hidden].
struct EpilogueArgs {
  // The dtype of the call. Null: no add (r = sum), and residual_out is the call's output itself,
  // where the all-reduce left the sum.
  const void* residual = nullptr;
  void* residual_out = nullptr;  // may be `residual` (in place); else never another operand
  const void* weight = nullptr;  // [hidden], the dtype of the call
  // Where y goes, the dtype of the call: the call's output (with a residual) or a tensor of its
  // own; null when only y_q is asked for (then y is never stored anywhere).
  void* y = nullptr;
  // quant != kNone: the quantised y of this call's rows, [rows, hidden] bytes (kFp8E4m3) or
  // [rows, hidden / 2] (kNvfp4: two e2m1 codes a byte, the even element in the low nibble).
  void* y_q = nullptr;
  // One fp32 on the device: kFp8E4m3's static scale, kNvfp4's global scale G.
  const float* scale = nullptr;
  // kNvfp4: the block scales of the whole tensor (never offset by a streamed round: the layout
  // places a row by its index), [nvfp4_padded_rows(total_rows), 4 * nvfp4_k_tiles(hidden)]
  // bytes in plan/quant.h's swizzled layout. This call's rows are rows first_row.. of the
  // tensor; the call that holds its last row also writes the padding rows' zeros.
  uint8_t* block_scale = nullptr;
  int64_t first_row = 0;
  int64_t total_rows = 0;
  int64_t hidden = 0;  // elements per row; 0: the call has no epilogue
  float eps = 0.0f;
  float weight_offset = 0.0f;  // added to every weight in fp32 (Gemma: 1)
  Quant quant = Quant::kNone;
};

// The fused call's signature (plan::call_signature with fused=true) with its form mixed into the
// low 20 bits: ranks that pass different eps, weight offsets, quantised outputs or residual
// presence, or split the same message into rows of different lengths, would each compute a
// different y; their flags, LL tags and lamport headers now disagree, so they fail at once naming
// each other. The top byte (the kind of call) and the dtype are kept.
inline uint32_t epilogue_signature(uint32_t signature, const EpilogueArgs& args) {
  uint32_t eps_bits = 0;
  uint32_t offset_bits = 0;
  __builtin_memcpy(&eps_bits, &args.eps, sizeof(eps_bits));
  __builtin_memcpy(&offset_bits, &args.weight_offset, sizeof(offset_bits));
  const uint64_t form =
      static_cast<uint64_t>(args.quant) | (args.residual != nullptr ? 0x100u : 0u);
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the form's words
  for (const uint64_t word : {static_cast<uint64_t>(eps_bits), static_cast<uint64_t>(args.hidden),
                              static_cast<uint64_t>(offset_bits), form}) {
    for (int byte = 0; byte < 8; ++byte) {
      h = (h ^ ((word >> (8 * byte)) & 0xFFu)) * 1099511628211ull;
    }
  }
  return signature ^ (static_cast<uint32_t>(h ^ (h >> 32)) & 0x000FFFFFu);
}

}  // namespace pcie_ar::plan
