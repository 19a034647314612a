// The scalar reference reducer and the run-time choice among the reducers (reduce.h).
#include "transport/executors/host/reduce.h"

#include <atomic>
#include <bit>
#include <cstring>
#include <stdexcept>
#include <string>

#include "plan/layout.h"
#include "transport/executors/element_codecs.h"
#include "transport/executors/host/reduce_simd.h"

namespace pcie_ar::transport {
namespace {

// dst[0, kElems) = sum of srcs in order, accumulated in fp32 from +0 (so no sum is -0: the
// same bits whichever protocol carried the operands, plan::Step::split) and rounded once. Every
// source is loaded before dst is stored, so dst may alias a source elementwise (in-place).
template <typename Codec, int kElems>
inline void reduce_tile(uint8_t* dst, const uint8_t* const* srcs, int num_srcs, int64_t offset) {
  using Bits = typename Codec::Bits;
  Bits lanes[kElems];
  float acc[kElems];
  std::memcpy(lanes, srcs[0] + offset, sizeof(lanes));
  for (int i = 0; i < kElems; ++i) acc[i] = 0.0f + Codec::to_float(lanes[i]);
  for (int s = 1; s < num_srcs; ++s) {
    std::memcpy(lanes, srcs[s] + offset, sizeof(lanes));
    for (int i = 0; i < kElems; ++i) acc[i] += Codec::to_float(lanes[i]);
  }
  for (int i = 0; i < kElems; ++i) lanes[i] = Codec::from_float(canonical_nan(acc[i]));
  std::memcpy(dst + offset, lanes, sizeof(lanes));
}

// Tiles of several vectors give the compiler fixed-length loops to vectorise; the tail runs
// one 16-byte vector at a time.
template <typename Codec>
void reduce_vectors(uint8_t* dst, const uint8_t* const* srcs, int num_srcs, int64_t num_vecs) {
  constexpr int kLanes = plan::kVectorBytes / static_cast<int>(sizeof(typename Codec::Bits));
  constexpr int kTileVecs = 8;
  int64_t v = 0;
  for (; v + kTileVecs <= num_vecs; v += kTileVecs) {
    reduce_tile<Codec, kTileVecs * kLanes>(dst, srcs, num_srcs, v * plan::kVectorBytes);
  }
  for (; v < num_vecs; ++v) {
    reduce_tile<Codec, kLanes>(dst, srcs, num_srcs, v * plan::kVectorBytes);
  }
}

}  // namespace

namespace detail {
ReduceFn scalar_reducer(plan::DType dtype) {
  switch (dtype) {
    case plan::DType::kBF16:
      return &reduce_vectors<Bf16Codec>;
    case plan::DType::kFP16:
      return &reduce_vectors<Fp16Codec>;
    case plan::DType::kFP32:
      return &reduce_vectors<Fp32Codec>;
  }
  return nullptr;
}
}  // namespace detail

namespace {
// Asked once: CPUID traps to the hypervisor in a VM, far too slow for every call.
struct IsaSupport {
  bool avx2 = detail::avx2_reducer(plan::DType::kFP32) != nullptr && detail::cpu_runs_avx2();
  bool avx512 = detail::avx512_reducer(plan::DType::kFP32) != nullptr && detail::cpu_runs_avx512();
};
const IsaSupport& isa_support() {
  static const IsaSupport support;
  return support;
}
}  // namespace

bool reduce_isa_available(ReduceIsa isa) {
  switch (isa) {
    case ReduceIsa::kScalar:
      return true;
    case ReduceIsa::kAvx2:
      return isa_support().avx2;
    case ReduceIsa::kAvx512:
      return isa_support().avx512;
  }
  return false;
}

ReduceIsa best_reduce_isa() {
  return reduce_isa_available(ReduceIsa::kAvx512) ? ReduceIsa::kAvx512
         : reduce_isa_available(ReduceIsa::kAvx2) ? ReduceIsa::kAvx2
                                                  : ReduceIsa::kScalar;
}

namespace {
// -1: not chosen, use best_reduce_isa().
std::atomic<int> chosen_isa{-1};
}  // namespace

ReduceIsa active_reduce_isa() {
  const int chosen = chosen_isa.load(std::memory_order_relaxed);
  return chosen < 0 ? best_reduce_isa() : static_cast<ReduceIsa>(chosen);
}

void set_reduce_isa(ReduceIsa isa) {
  if (!reduce_isa_available(isa)) {
    throw std::invalid_argument("the " + std::string(reduce_isa_name(isa)) +
                                " reducer is not available on this CPU (or build); it runs " +
                                std::string(reduce_isa_name(best_reduce_isa())) +
                                " at best, scalar always");
  }
  chosen_isa.store(static_cast<int>(isa), std::memory_order_relaxed);
}

ReduceFn reducer_for(plan::DType dtype, ReduceIsa isa) {
  if (!reduce_isa_available(isa)) return nullptr;
  switch (isa) {
    case ReduceIsa::kScalar:
      return detail::scalar_reducer(dtype);
    case ReduceIsa::kAvx2:
      return detail::avx2_reducer(dtype);
    case ReduceIsa::kAvx512:
      return detail::avx512_reducer(dtype);
  }
  return nullptr;
}

ReduceFn reducer_for(plan::DType dtype) { return reducer_for(dtype, active_reduce_isa()); }

}  // namespace pcie_ar::transport
