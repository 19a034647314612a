// The one hash of the plan layer: 64-bit FNV-1a. Layout, tuning-table and topology hashes are
// compared across ranks and written into cache keys, so they must be the same function on
// every rank, build and machine; FNV-1a is tiny, fixed by its spec, and good enough for keys
// that are never adversarial.
#pragma once

#include <cstdint>
#include <string_view>

namespace pcie_ar::plan {

inline constexpr uint64_t kFnv1aOffset = 14695981039346656037ull;
inline constexpr uint64_t kFnv1aPrime = 1099511628211ull;

// Continues a hash over `bytes`; start from kFnv1aOffset.
inline uint64_t fnv1a(std::string_view bytes, uint64_t h = kFnv1aOffset) {
  for (const char c : bytes) {
    h ^= static_cast<unsigned char>(c);
    h *= kFnv1aPrime;
  }
  return h;
}

// Continues a hash over the 8 little-endian bytes of `value`.
inline uint64_t fnv1a_u64(uint64_t value, uint64_t h = kFnv1aOffset) {
  for (int i = 0; i < 8; ++i) {
    h ^= (value >> (8 * i)) & 0xFF;
    h *= kFnv1aPrime;
  }
  return h;
}

}  // namespace pcie_ar::plan
