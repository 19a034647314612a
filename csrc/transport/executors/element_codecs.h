// bf16, fp16 and fp32 elements to fp32 and back with one round-to-nearest-even, in integer
// arithmetic, so a result never depends on compiler flags or CPU features; and the canonical
// NaN every sum becomes. The arithmetic both CPU executors share with the GPU bit for bit: the
// host reducers' scalar reference (executors/host/reduce.cc) and the CPU device's VecMath.
#pragma once

#include <bit>
#include <cstdint>

namespace pcie_ar::transport {

inline constexpr uint32_t kCanonicalNaN = 0x7fffffffu;  // fp32 bits; narrows to 0x7fff

// A NaN sum becomes the canonical quiet NaN, as the GPU's adds make it: which operand's payload
// an IEEE add keeps is the compiler's choice of operand order, so without this the result bits
// would depend on the build.
inline float canonical_nan(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  return std::bit_cast<float>((x & 0x7fffffffu) > 0x7f800000u ? kCanonicalNaN : x);
}

// The special cases are selects rather than branches so the compiler vectorises tile loops.
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

}  // namespace pcie_ar::transport
