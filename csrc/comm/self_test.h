// The self-test before serving: every (op, dtype, tactic) the table can choose for this group runs
// once on known data through the real call path, and every output is compared, bit for bit, with
// the host's reference of the same data (the group's one reduction tree, plan::canonical_groups,
// in ATen; the fused forms through the fallback's epilogue, which gives the kernels' bits). Wrong
// hardware behaviour (a GPU, a driver, a PCIe bridge that reorders or drops a write) then becomes
// a fallback, never a wrong answer: the caller exchanges the verdicts (any rank's failure counts)
// and withdraws the failed tactics on every rank (Decline::kSelfTest).
//
// Each rank builds every rank's inputs itself from (rank, element, dtype), so the reference needs
// no exchange. The values (sign, 7 mantissa bits, exponents over 2^-20..2^20; fp16 2^-12..2^9; one
// in sixteen a zero of either sign) are exact in every dtype and make inexact fp32 sums, so a sum
// in another order or with another rounding point differs in some element.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "comm/decisions.h"

namespace pcie_ar::comm {

struct SelfTestResult {
  TacticUse use;       // use.bytes: the message size run (empty when none fits)
  bool ran = false;    // false: no message the tactic is decided for fits the op's shapes
  bool ok = false;     // every output equal to the reference, bit for bit
  std::string detail;  // what differed (or why it did not run): "out element 17: ..."
};

// `numel` known values of `dtype` (a CPU tensor) for `salt` (a rank and a role).
at::Tensor known_values(int64_t numel, uint64_t salt, plan::DType dtype);

// Every rank's known input of a case (CPU tensors): known_values, except that about one element in
// four holds a cancelling pair, +B on one rank and -B on the next (B about 2^25 times the other
// ranks' values there), so the sum is what the ranks on the far side of the pair add to: which
// side depends on the operands' order and on where the sums are rounded (the island groups).
std::vector<at::Tensor> known_inputs(int world, int64_t numel, plan::DType dtype);

// The group's one reduction tree (plan::canonical_groups) over `by_rank` (CPU tensors of one
// dtype, in rank order): each group summed in fp32 from +0 in ascending rank order and rounded to
// the dtype, then the two groups' sums, where there are two.
at::Tensor canonical_sum(const std::vector<at::Tensor>& by_rank, const std::vector<int>& island_of);

// The shape of a case's input of `numel` elements: one row for the all-reduce and the
// collectives; for the fused forms rows of at most 4096 elements, whole 16-byte vectors (NVFP4:
// whole 16-element blocks, bf16 and fp16 only). nullopt when no shape fits.
std::optional<std::pair<int64_t, int64_t>> self_test_shape(Op op, plan::DType dtype, int64_t numel);

// "" when `got` (any device) holds exactly `want`'s bytes; else the first difference.
std::string first_difference(const std::string& name, const at::Tensor& got,
                             const at::Tensor& want);

}  // namespace pcie_ar::comm
