// The scalar reference reducer and the run-time choice among the reducers (reduce.h).
#include "transport/executors/host/reduce.h"

#include <atomic>
#include <bit>
#include <cstring>
#include <stdexcept>
#include <string>

#include "plan/layout.h"
#include "transport/executors/host/reduce_simd.h"

namespace pcie_ar::transport {
namespace {

// ---------------------------------------------------------------- element codecs
// Each codec turns one element into fp32 and back with a single round-to-nearest-even, done
// with integer arithmetic so the result never depends on compiler flags or CPU features. The
// special cases are selects rather than branches so the compiler vectorises the tile loops.

struct Bf16Codec {
  using Bits = uint16_t;
  static float to_float(Bits h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }
  static Bits from_float(float f) {
    const uint32_t x = std::bit_cast<uint32_t>(f);
    // Adding 0x7fff plus the lowest kept bit rounds half to even; a carry into the exponent
    // is the correct rounding up to the next binade or to infinity.
    const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    // NaN: keep sign and top payload, force quiet so the rounding cannot turn it into inf.
    const uint32_t nan = (x >> 16) | 0x0040u;
    return static_cast<Bits>((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  }
};

struct Fp16Codec {
  using Bits = uint16_t;
  static float to_float(Bits h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t magnitude = h & 0x7fffu;
    const uint32_t exponent = magnitude >> 10;
    // Normal: rebias the exponent (15 -> 127). Inf/NaN: all-ones exponent, payload kept.
    // Zero/subnormal: mantissa * 2^-24 is exact in fp32.
    const uint32_t normal = (magnitude << 13) + (112u << 23);
    const uint32_t special = (magnitude << 13) | 0x7f800000u;
    const uint32_t tiny = std::bit_cast<uint32_t>(static_cast<float>(magnitude) * 0x1p-24f);
    const uint32_t bits = exponent == 0x1fu ? special : (exponent == 0 ? tiny : normal);
    return std::bit_cast<float>(sign | bits);
  }
  static Bits from_float(float f) {
    const uint32_t x = std::bit_cast<uint32_t>(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t magnitude = x & 0x7fffffffu;
    // NaN: quiet, top payload bits kept.
    const uint32_t nan = 0x7e00u | ((magnitude >> 13) & 0x3ffu);
    // Below the smallest normal half (2^-14): adding 0.5 leaves an fp32 whose ulp is 2^-24,
    // the fp16 subnormal step, so the hardware add rounds to nearest even for us and the low
    // bits are the subnormal mantissa (0x400 = rounded up to the smallest normal).
    const uint32_t tiny =
        std::bit_cast<uint32_t>(std::bit_cast<float>(magnitude) + 0.5f) - 0x3f000000u;
    // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits half to even.
    const uint32_t normal = (magnitude - (112u << 23) + 0xfffu + ((magnitude >> 13) & 1u)) >> 13;
    uint32_t bits = magnitude < 0x38800000u ? tiny : normal;
    bits = magnitude >= 0x477ff000u ? 0x7c00u : bits;  // >= 65520 rounds to infinity
    bits = magnitude > 0x7f800000u ? nan : bits;
    return static_cast<Bits>(sign | bits);
  }
};

struct Fp32Codec {
  using Bits = float;
  static float to_float(Bits f) { return f; }
  static Bits from_float(float f) { return f; }
};

// A NaN sum becomes the canonical quiet NaN, as the GPU's adds make it: which operand's payload
// an add keeps is the compiler's choice of operand order, so without this the result bits
// would depend on the build.
inline float canonical_nan(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  return std::bit_cast<float>((x & 0x7fffffffu) > 0x7f800000u ? kCanonicalNaN : x);
}

// dst[0, kElems) = sum of srcs in order, accumulated in fp32 and rounded once. Every source is
// loaded before dst is stored, so dst may alias a source elementwise (in-place).
template <typename Codec, int kElems>
inline void reduce_tile(uint8_t* dst, const uint8_t* const* srcs, int num_srcs, int64_t offset) {
  using Bits = typename Codec::Bits;
  Bits lanes[kElems];
  float acc[kElems];
  std::memcpy(lanes, srcs[0] + offset, sizeof(lanes));
  for (int i = 0; i < kElems; ++i) acc[i] = Codec::to_float(lanes[i]);
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
