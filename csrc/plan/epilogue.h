// The fused epilogue of a decoder layer: after the all-reduce,
//   residual_out = sum + residual
//   y            = rms_norm(residual_out) * weight
// per row of `hidden` elements, where `sum` is the all-reduce's result as the schedule forms it.
// Both executors (host: executors/host/epilogue.cc; CUDA: executor.cuh) and the unfused path
// (comm/fallback.cc, in ATen) compute exactly this, so a row's result is the same on every
// rank, on every path that rounds the same, and whatever other rows share the batch:
//
//   r_i   = round(float(sum_i) + float(residual_i))         rounded once to the dtype
//   sq_i  = float(r_i) * float(r_i)                         fp32, no FMA anywhere
//   part_q = sq_q + sq_{q+Q} + sq_{q+2Q} + ...              Q = kNormPartials partials, each
//                                                           summed in ascending element order
//   total = tree(part): for h = Q/2, Q/4, ..., 1: part_q = part_q + part_{q+h}  (q < h)
//   rstd  = 1 / sqrt(total / hidden + eps)                  fp32, each operation rounded once
//   y_i   = round((float(r_i) * rstd) * float(weight_i))    rounded once to the dtype
//
// The order of the mean of squares depends only on `hidden` (never on the tactic's blocks or
// threads, nor on the batch), and every fp32 operation is a single IEEE operation (the GPU uses
// __fmul_rn/__fadd_rn/__fdiv_rn/__fsqrt_rn, so nothing contracts into an FMA). The partials are
// per element position so that a CTA's threads (or a CPU's SIMD lanes) each own some of them.
#pragma once

#include <cstdint>
#include <initializer_list>

namespace pcie_ar::plan {

// Partials of the mean of squares, in elements: a power of two. A row shorter than this leaves
// the rest at zero (0 + x is exact, so they change nothing).
inline constexpr int kNormPartials = 2048;
static_assert((kNormPartials & (kNormPartials - 1)) == 0);

// Rows are whole 16-byte vectors, so every vector of a row is one load; and a row's partials are
// formed by one CTA, so a row fits the executors' per-row loops. Engines' hidden sizes (896 ..
// 16384) are far inside.
inline constexpr int64_t kMaxEpilogueHidden = 65536;

// The fused call's signature (plan::call_signature with fused=true) with its eps and row length
// mixed into the low 20 bits: ranks that pass different eps, or split the same message into rows
// of different lengths, would each normalise differently and return different y; their flags,
// LL tags and lamport headers now disagree, so they fail at once naming each other. The top byte
// (the kind of call) and the dtype are kept.
inline uint32_t epilogue_signature(uint32_t signature, float eps, int64_t hidden) {
  uint32_t eps_bits = 0;
  __builtin_memcpy(&eps_bits, &eps, sizeof(eps_bits));
  uint64_t h = 1469598103934665603ull;  // FNV-1a over eps's bits and hidden's
  for (const uint64_t word : {static_cast<uint64_t>(eps_bits), static_cast<uint64_t>(hidden)}) {
    for (int byte = 0; byte < 8; ++byte) {
      h = (h ^ ((word >> (8 * byte)) & 0xFFu)) * 1099511628211ull;
    }
  }
  return signature ^ (static_cast<uint32_t>(h ^ (h >> 32)) & 0x000FFFFFu);
}

// What an epilogue call carries beside the all-reduce's input and output.
struct EpilogueArgs {
  const void* residual = nullptr;  // [numel / hidden, hidden], the dtype of the call
  void* residual_out = nullptr;    // may be `residual` (in place); never the output
  const void* weight = nullptr;    // [hidden], the dtype of the call
  int64_t hidden = 0;              // elements per row; 0: the call has no epilogue
  float eps = 0.0f;
};

}  // namespace pcie_ar::plan
