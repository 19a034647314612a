// The x86-64 vector reducers: AVX2 (+F16C) and AVX-512 (F/BW/VL), each compiled for its own ISA
// with target attributes, so one build runs on any x86-64 CPU and the dispatcher
// (reduce.cc) picks what the CPU runs. Each mirrors the scalar reference exactly:
//   - operands are widened to fp32 exactly (bf16: zero words interleaved below each element;
//     fp16: the hardware conversion, exact for every half value) and added in operand order
//     to +0, one IEEE add per operand, as the scalar loop does;
//   - a NaN sum becomes the canonical NaN (reduce.h);
//   - bf16 is rounded with the scalar codec's integer formula (x + 0x7fff + lsb) >> 16;
//   - fp16 is rounded by the hardware (round to nearest even, exceptions suppressed), whose
//     results on overflow and subnormals equal the scalar codec's.
// Every operand of a group is loaded before the group is stored, so dst may alias a source.
// The last vectors that do not fill a group run through the scalar reducer.
#include "transport/executors/host/reduce_simd.h"

#if defined(__x86_64__)

// GCC 12 reports the intrinsics' own _mm*_undefined_*() pass-through operands as
// maybe-uninitialized once they are inlined at -O3 (GCC bug 105593), inside its headers.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include <cpuid.h>
#include <immintrin.h>

#include "plan/layout.h"

#define PCIE_AR_AVX2 __attribute__((target("avx2,f16c")))
#define PCIE_AR_AVX2_INLINE __attribute__((target("avx2,f16c"), always_inline)) inline
#define PCIE_AR_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define PCIE_AR_AVX512_INLINE \
  __attribute__((target("avx512f,avx512bw,avx512vl"), always_inline)) inline

namespace pcie_ar::transport::detail {
namespace {

using plan::DType;
using plan::kVectorBytes;

// The reduce loop, written once per ISA (a target attribute cannot be a template parameter).
// Ops describes one group: kBytes of memory that widen into a Pair of fp32 registers.
#define PCIE_AR_REDUCE_LOOP(Ops, add, zero)                                        \
  const int64_t bytes = num_vecs * kVectorBytes;                                   \
  int64_t at = 0;                                                                  \
  /* two groups per pass: independent add chains while an operand streams in */    \
  for (; at + 2 * Ops::kBytes <= bytes; at += 2 * Ops::kBytes) {                   \
    auto a0 = add(zero(), Ops::load(srcs[0] + at));                                \
    auto a1 = add(zero(), Ops::load(srcs[0] + at + Ops::kBytes));                  \
    for (int s = 1; s < num_srcs; ++s) {                                           \
      a0 = add(a0, Ops::load(srcs[s] + at));                                       \
      a1 = add(a1, Ops::load(srcs[s] + at + Ops::kBytes));                         \
    }                                                                              \
    Ops::store(dst + at, a0);                                                      \
    Ops::store(dst + at + Ops::kBytes, a1);                                        \
  }                                                                                \
  for (; at + Ops::kBytes <= bytes; at += Ops::kBytes) {                           \
    auto a = add(zero(), Ops::load(srcs[0] + at));                                 \
    for (int s = 1; s < num_srcs; ++s) a = add(a, Ops::load(srcs[s] + at));        \
    Ops::store(dst + at, a);                                                       \
  }                                                                                \
  if (at < bytes) {                                                                \
    const uint8_t* rest[plan::kMaxSources];                                        \
    for (int s = 0; s < num_srcs; ++s) rest[s] = srcs[s] + at;                     \
    scalar_reducer(kDType)(dst + at, rest, num_srcs, (bytes - at) / kVectorBytes); \
  }

// ---------------------------------------------------------------- AVX2: 2 x 8 fp32 lanes

struct Avx2Pair {
  __m256 lo, hi;
};

PCIE_AR_AVX2_INLINE Avx2Pair avx2_add(Avx2Pair a, Avx2Pair b) {
  return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
}

PCIE_AR_AVX2_INLINE Avx2Pair avx2_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }

PCIE_AR_AVX2_INLINE __m256 avx2_nan_lanes(__m256 v) { return _mm256_cmp_ps(v, v, _CMP_UNORD_Q); }

PCIE_AR_AVX2_INLINE __m256 avx2_canonical_nan(__m256 v) {
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(kCanonicalNaN)));
  return _mm256_blendv_ps(v, nan, avx2_nan_lanes(v));
}

struct Avx2F32 {
  static constexpr int kBytes = 64;
  PCIE_AR_AVX2_INLINE static Avx2Pair load(const uint8_t* p) {
    return {_mm256_loadu_ps(reinterpret_cast<const float*>(p)),
            _mm256_loadu_ps(reinterpret_cast<const float*>(p + 32))};
  }
  PCIE_AR_AVX2_INLINE static void store(uint8_t* p, Avx2Pair v) {
    _mm256_storeu_ps(reinterpret_cast<float*>(p), avx2_canonical_nan(v.lo));
    _mm256_storeu_ps(reinterpret_cast<float*>(p + 32), avx2_canonical_nan(v.hi));
  }
};

// bf16 is the top half of an fp32. Interleaving zero words below each element widens a
// 128-bit lane's words 0-3 (lo) and 4-7 (hi) exactly; packing the narrowed lo and hi back
// undoes that order lane by lane.
struct Avx2Bf16 {
  static constexpr int kBytes = 32;
  PCIE_AR_AVX2_INLINE static Avx2Pair load(const uint8_t* p) {
    const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i zero = _mm256_setzero_si256();
    return {_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, w)),
            _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, w))};
  }
  // The scalar codec's rounding, (x + 0x7fff + lsb) >> 16, with every NaN lane 0x7fff.
  PCIE_AR_AVX2_INLINE static __m256i narrow(__m256 v) {
    const __m256i x = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7fff)), lsb), 16);
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fff),
                              _mm256_castps_si256(avx2_nan_lanes(v)));
  }
  PCIE_AR_AVX2_INLINE static void store(uint8_t* p, Avx2Pair v) {
    // Every lane is below 2^16: the saturating pack is a plain narrowing.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm256_packus_epi32(narrow(v.lo), narrow(v.hi)));
  }
};

struct Avx2Fp16 {
  static constexpr int kBytes = 32;
  PCIE_AR_AVX2_INLINE static Avx2Pair load(const uint8_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
  }
  PCIE_AR_AVX2_INLINE static void store(uint8_t* p, Avx2Pair v) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm256_cvtps_ph(avx2_canonical_nan(v.lo), kRound));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 16),
                     _mm256_cvtps_ph(avx2_canonical_nan(v.hi), kRound));
  }
};

template <typename Ops, DType kDType>
PCIE_AR_AVX2 void avx2_reduce(uint8_t* dst, const uint8_t* const* srcs, int num_srcs,
                              int64_t num_vecs) {
  PCIE_AR_REDUCE_LOOP(Ops, avx2_add, avx2_zero)
}

// ---------------------------------------------------------------- AVX-512: 2 x 16 fp32 lanes

struct Avx512Pair {
  __m512 lo, hi;
};

PCIE_AR_AVX512_INLINE Avx512Pair avx512_add(Avx512Pair a, Avx512Pair b) {
  return {_mm512_add_ps(a.lo, b.lo), _mm512_add_ps(a.hi, b.hi)};
}

PCIE_AR_AVX512_INLINE Avx512Pair avx512_zero() {
  return {_mm512_setzero_ps(), _mm512_setzero_ps()};
}

PCIE_AR_AVX512_INLINE __mmask16 avx512_nan_lanes(__m512 v) {
  return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
}

PCIE_AR_AVX512_INLINE __m512 avx512_canonical_nan(__m512 v) {
  const __m512 nan = _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(kCanonicalNaN)));
  return _mm512_mask_blend_ps(avx512_nan_lanes(v), v, nan);
}

struct Avx512F32 {
  static constexpr int kBytes = 128;
  PCIE_AR_AVX512_INLINE static Avx512Pair load(const uint8_t* p) {
    return {_mm512_loadu_ps(p), _mm512_loadu_ps(p + 64)};
  }
  PCIE_AR_AVX512_INLINE static void store(uint8_t* p, Avx512Pair v) {
    _mm512_storeu_ps(p, avx512_canonical_nan(v.lo));
    _mm512_storeu_ps(p + 64, avx512_canonical_nan(v.hi));
  }
};

// As Avx2Bf16, on four 128-bit lanes.
struct Avx512Bf16 {
  static constexpr int kBytes = 64;
  PCIE_AR_AVX512_INLINE static Avx512Pair load(const uint8_t* p) {
    const __m512i w = _mm512_loadu_si512(p);
    const __m512i zero = _mm512_setzero_si512();
    return {_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, w)),
            _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, w))};
  }
  PCIE_AR_AVX512_INLINE static __m512i narrow(__m512 v) {
    const __m512i x = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7fff)), lsb), 16);
    return _mm512_mask_blend_epi32(avx512_nan_lanes(v), rounded, _mm512_set1_epi32(0x7fff));
  }
  PCIE_AR_AVX512_INLINE static void store(uint8_t* p, Avx512Pair v) {
    _mm512_storeu_si512(p, _mm512_packus_epi32(narrow(v.lo), narrow(v.hi)));
  }
};

struct Avx512Fp16 {
  static constexpr int kBytes = 64;
  PCIE_AR_AVX512_INLINE static Avx512Pair load(const uint8_t* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
            _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)))};
  }
  PCIE_AR_AVX512_INLINE static void store(uint8_t* p, Avx512Pair v) {
    constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(avx512_canonical_nan(v.lo), kRound));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32),
                        _mm512_cvtps_ph(avx512_canonical_nan(v.hi), kRound));
  }
};

template <typename Ops, DType kDType>
PCIE_AR_AVX512 void avx512_reduce(uint8_t* dst, const uint8_t* const* srcs, int num_srcs,
                                  int64_t num_vecs) {
  PCIE_AR_REDUCE_LOOP(Ops, avx512_add, avx512_zero)
}

#undef PCIE_AR_REDUCE_LOOP

}  // namespace

ReduceFn avx2_reducer(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return &avx2_reduce<Avx2Bf16, DType::kBF16>;
    case DType::kFP16:
      return &avx2_reduce<Avx2Fp16, DType::kFP16>;
    case DType::kFP32:
      return &avx2_reduce<Avx2F32, DType::kFP32>;
  }
  return nullptr;
}

ReduceFn avx512_reducer(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return &avx512_reduce<Avx512Bf16, DType::kBF16>;
    case DType::kFP16:
      return &avx512_reduce<Avx512Fp16, DType::kFP16>;
    case DType::kFP32:
      return &avx512_reduce<Avx512F32, DType::kFP32>;
  }
  return nullptr;
}

bool cpu_runs_avx2() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) != 0 && (ecx & bit_F16C) != 0;
  // __builtin_cpu_supports also checks that the OS saves the wider registers (XGETBV).
  return f16c && __builtin_cpu_supports("avx2");
}

bool cpu_runs_avx512() {
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

}  // namespace pcie_ar::transport::detail

#else  // not x86-64: the scalar reducer only

namespace pcie_ar::transport::detail {
ReduceFn avx2_reducer(plan::DType) { return nullptr; }
ReduceFn avx512_reducer(plan::DType) { return nullptr; }
bool cpu_runs_avx2() { return false; }
bool cpu_runs_avx512() { return false; }
}  // namespace pcie_ar::transport::detail

#endif
