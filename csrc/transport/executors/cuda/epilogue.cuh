// The CUDA executor's fused epilogue (plan/epilogue.h): after the all-reduce and the barrier of
// the rank's CTAs (executor.cuh, meet_rank_ctas), each CTA normalises whole rows of its rank's
// output, and writes y and its quantised form (FP8 or NVFP4, plan/quant.h) when asked for. The
// same source runs on a GPU and on the CPU device (primitives.cuh picks the machine).
#pragma once

#include <cstdint>

#include "plan/epilogue.h"
#include "plan/quant.h"
#include "transport/executors/cuda/kernel_params.h"
#include "transport/executors/cuda/primitives.cuh"

namespace pcie_ar::transport::kernels {

// Pass 2's y of vector v of a row (`base`: the row's first vector): a holds (r * rstd) * w in
// fp32, and y rounded to the dtype is returned, after it is stored to y when y is asked for.
template <typename T>
__device__ __forceinline__ uint4 y_vector(const uint4* residual_out, const uint4* weight, uint4* y,
                                          int64_t base, int v, float rstd, float addend,
                                          float (&a)[VecMath<T>::kElems]) {
  using M = VecMath<T>;
  constexpr int kElems = M::kElems;
  float w[kElems];
  M::widen(load_cg(residual_out + base + v), a);
  M::widen(load_cg(weight + v), w);
#pragma unroll
  for (int e = 0; e < kElems; ++e) a[e] = mul_rn(mul_rn(a[e], rstd), add_rn(w[e], addend));
  const uint4 y_vec = M::narrow(a);
  if (y != nullptr) store_cg(y + base + v, y_vec);
  return y_vec;
}

// NVFP4's amax of a block (plan/quant.h: the largest magnitude, NaNs ignored, NaN only when all
// 16 are NaN), folded in on the bits: for magnitudes that are not NaN the order of the bits is
// the order of the values, so a NaN counts as 0 and every other magnitude as its bits + 1; a
// maximum of 0 means the block is all NaN. Max is exact, so the order of the folds changes
// nothing (the host takes another).
template <int N>
__device__ __forceinline__ uint32_t nvfp4_fold_amax(uint32_t top, const float (&v)[N]) {
#pragma unroll
  for (int k = 0; k < N; ++k) {
    uint32_t bits = 0;
    __builtin_memcpy(&bits, &v[k], sizeof(bits));
    const uint32_t a = bits & 0x7fffffffu;
    const uint32_t rank = a > 0x7f800000u ? 0u : a + 1u;
    top = rank > top ? rank : top;
  }
  return top;
}
__device__ __forceinline__ float nvfp4_amax(uint32_t top) {
  const uint32_t bits = top == 0 ? 0x7fc00000u : top - 1u;
  float amax = 0.0f;
  __builtin_memcpy(&amax, &bits, sizeof(amax));
  return amax;
}

// What NVFP4 needs of the call beside the row: the whole tensor's block scales and G.
struct Nvfp4Out {
  uint8_t* block_scale;  // the tensor's, [nvfp4_padded_rows(total_rows), 4 * k_tiles]
  int k_tiles;           // 128x4 tiles across a row (plan::nvfp4_k_tiles: at most 1024)
  int columns;           // block columns of a row: hidden / 16 (the rest of the last tile: 0)
  float global_scale;    // G
  float inv_global_scale;
};

// The block scales' four bytes of block columns 4g .. 4g + 3 of a row: c % 4 is the layout's
// innermost index, so they are one aligned 32-bit word (plan::nvfp4_scale_offset).
__device__ __forceinline__ uint8_t* nvfp4_scale_word(const Nvfp4Out& q, int64_t row, int g) {
  return q.block_scale + plan::nvfp4_scale_offset(row, 4 * g, q.k_tiles);
}

// Pass 2 of one row in NVFP4 (bf16 or fp16 rows, as vLLM's scaled_fp4_quant): thread j takes the
// groups of 4 block columns (64 elements) g = j, j + blockDim.x, ...; of each block, y (stored
// when asked for), its amax, scale and e2m1 codes (one 8-byte store), and the group's 4 scale
// bytes as one 32-bit store, where the columns past the row's last (padding) hold 0. `row` is
// the row's index in the whole tensor; y_q the row's first byte of codes. One block at a time,
// its y held as its two vectors (8 registers) until its scale is known: the kernel runs at its
// register budget (__launch_bounds__, shared by every step).
template <typename T>
__device__ __forceinline__ void nvfp4_row(const uint4* residual_out, const uint4* weight, uint4* y,
                                          int64_t base, float rstd, float addend, const Nvfp4Out& q,
                                          int64_t row, uint8_t* y_q) {
  using M = VecMath<T>;
  constexpr int kElems = M::kElems;
  static_assert(kElems == 8, "NVFP4 quantises 2-byte dtypes: two vectors a block");
  for (int g = thread_index(); g < q.k_tiles; g += blockDim.x) {
    uint32_t scales = 0;
#pragma unroll 1
    for (int b = 0; b < 4; ++b) {
      const int col = 4 * g + b;
      if (col >= q.columns) break;  // the rest of the group is padding: its bytes stay 0
      uint4 y_vecs[2];
      uint32_t top = 0;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float a[kElems];
        y_vecs[i] = y_vector<T>(residual_out, weight, y, base, 2 * col + i, rstd, addend, a);
        M::widen(y_vecs[i], a);  // NVFP4 quantises the y stored, rounded to the dtype
        top = nvfp4_fold_amax(top, a);
      }
      const plan::Nvfp4Scale sf =
          plan::nvfp4_block_scale(nvfp4_amax(top), q.global_scale, q.inv_global_scale);
      // Codes two a byte, the even element in the low nibble: vector i's 8 codes are word i of
      // the block's 8 bytes, element e in nibble e.
      uint32_t codes[2] = {0, 0};
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float a[kElems];
        M::widen(y_vecs[i], a);
#pragma unroll
        for (int e = 0; e < kElems; ++e) {
          const uint32_t code = plan::e2m1_from_float(mul_rn(a[e], sf.out_scale));
          codes[i] |= code << (4 * e);
        }
      }
      store_cg_v2_u32(y_q + col * (plan::kNvfp4Block / 2), codes[0], codes[1]);
      scales |= static_cast<uint32_t>(sf.byte) << (8 * b);
    }
    store_cg_u32(nvfp4_scale_word(q, row, g), scales);
  }
}

// The block scales' padding rows (total_rows .. nvfp4_padded_rows(total_rows) - 1, every column)
// take 0: written by the call that holds the tensor's last row, one 32-bit word a thread, spread
// over the rank's CTAs. At most 127 x 1024 words: 32-bit indices.
__device__ __forceinline__ void nvfp4_padding_rows(const Nvfp4Out& q, int64_t total_rows,
                                                   int block) {
  const int words = static_cast<int>(plan::nvfp4_padded_rows(total_rows) - total_rows) * q.k_tiles;
  const int stride = static_cast<int>(gridDim.x * blockDim.x);
  for (int i = block * static_cast<int>(blockDim.x) + thread_index(); i < words; i += stride) {
    store_cg_u32(nvfp4_scale_word(q, total_rows + i / q.k_tiles, i % q.k_tiles), 0u);
  }
}

// Rows block, block + gridDim.x, ... of rank `rank`'s output (plan/epilogue.h): the CTA owns a
// row. Vector position j (of kNormPartials / elements-per-vector) holds the partials of elements
// j * kElems + e, so thread j's accumulators are exactly partials q = j * kElems + e, summed over
// the row's vectors j, j + positions, ... in ascending order; the tree runs in shared memory. In
// pass 2 a thread reads residual_out where pass 1 stored it (its own vectors; NVFP4's groups of
// 64 elements also other threads'), past the tree's barriers.
// The form (residual or not, y stored or not, quantised or not) is the call's, the same for every
// thread: its branches are uniform. FP8's output is one byte per element, so a vector's goes out
// as one 8-byte store (bf16, fp16) or one 4-byte store (fp32); NVFP4's is nvfp4_row's.
template <typename T, bool kNvfp4>
__device__ __forceinline__ void epilogue_rows_of(const LaunchParams& p, int rank, int block,
                                                 float* partials) {
  using M = VecMath<T>;
  constexpr int kElems = M::kElems;
  constexpr int kPositions = plan::kNormPartials / kElems;
  static_assert(kElems == 8 || kElems == 4);
  const int row_vecs =
      static_cast<int>(p.hidden * static_cast<int64_t>(sizeof(T)) / plan::kVectorBytes);
  const int64_t rows = p.numel / p.hidden;
  const EpilogueTensors& tensors = p.epilogue[rank];
  uint4* out = static_cast<uint4*>(p.outputs[rank]);
  const uint4* residual = static_cast<const uint4*>(tensors.residual);
  uint4* residual_out = static_cast<uint4*>(tensors.residual_out);
  const uint4* weight = static_cast<const uint4*>(tensors.weight);
  uint4* y = static_cast<uint4*>(tensors.y);
  uint8_t* y_q = static_cast<uint8_t*>(tensors.y_q);
  const float addend = plan::weight_addend(p.weight_offset);
  const bool fp8 = !kNvfp4 && p.quant == plan::Quant::kFp8E4m3;
  // vLLM's 1 / scale (FP8), NVFP4's G and 1 / G: one division per CTA (the same bits in every CTA
  // and on the host).
  const float inv_scale = fp8 || kNvfp4 ? div_rn(1.0f, *tensors.scale) : 0.0f;
  const Nvfp4Out nv{tensors.block_scale, static_cast<int>(plan::nvfp4_k_tiles(p.hidden)),
                    static_cast<int>(p.hidden / plan::kNvfp4Block), kNvfp4 ? *tensors.scale : 0.0f,
                    inv_scale};
  for (int64_t row = block; row < rows; row += gridDim.x) {
    const int64_t base = row * row_vecs;
    for (int j = thread_index(); j < kPositions; j += blockDim.x) {
      float acc[kElems];
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[e] = 0.0f;
      for (int v = j; v < row_vecs; v += kPositions) {
        float a[kElems];
        uint4 r = load_cg(out + base + v);
        if (residual != nullptr) {
          float b[kElems];
          M::widen(r, a);
          M::widen(load_cg(residual + base + v), b);
#pragma unroll
          for (int e = 0; e < kElems; ++e) a[e] = add_rn(a[e], b[e]);
          r = M::narrow(a);
          store_cg(residual_out + base + v, r);
        }
        M::widen(r, a);
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[e] = add_rn(acc[e], mul_rn(a[e], a[e]));
      }
#pragma unroll
      for (int e = 0; e < kElems; ++e) partials[j * kElems + e] = acc[e];
    }
    __syncthreads();
    for (int h = plan::kNormPartials / 2; h >= 1; h /= 2) {
      for (int q = thread_index(); q < h; q += blockDim.x) {
        partials[q] = add_rn(partials[q], partials[q + h]);
      }
      __syncthreads();
    }
    const float mean = div_rn(partials[0], static_cast<float>(p.hidden));
    const float rstd = div_rn(1.0f, sqrt_rn(add_rn(mean, p.eps)));
    if constexpr (kNvfp4) {
      nvfp4_row<T>(residual_out, weight, y, base, rstd, addend, nv, p.first_row + row,
                   y_q + row * (p.hidden / 2));
    } else {
      for (int j = thread_index(); j < kPositions; j += blockDim.x) {
        for (int v = j; v < row_vecs; v += kPositions) {
          float a[kElems];
          const uint4 y_vec = y_vector<T>(residual_out, weight, y, base, v, rstd, addend, a);
          if (!fp8) continue;
          M::widen(y_vec, a);  // the y stored: rounded to the dtype, then widened (exact)
          uint32_t q[kElems / 4];
#pragma unroll
          for (int i = 0; i < kElems / 4; ++i) {
            q[i] = 0;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const float scaled = mul_rn(a[4 * i + k], inv_scale);
              const uint8_t code = plan::fp8_e4m3_from_float(plan::fp8_e4m3_clamp(scaled));
              q[i] |= static_cast<uint32_t>(code) << (8 * k);
            }
          }
          uint8_t* dst = y_q + (base + v) * kElems;
          if constexpr (kElems == 8) {
            store_cg_v2_u32(dst, q[0], q[1]);
          } else {
            store_cg_u32(dst, q[0]);
          }
        }
      }
    }
    __syncthreads();  // partials[0] read by every thread before the next row's partials
  }
  if (kNvfp4 && p.first_row + rows == p.total_rows) {
    nvfp4_padding_rows(nv, p.total_rows, block);
  }
}

// NVFP4 and the other forms are two instances of the rows' code (one shared memory tree), so
// neither holds the other's values through its loops: the kernel runs at its register budget.
// NVFP4 is compiled for bf16 and fp16 only (set_epilogue refuses fp32, as the ops do): fp32's
// kernel has no room left in its register budget.
template <typename T>
__device__ __forceinline__ void epilogue_rows(const LaunchParams& p, int rank, int block) {
  __shared__ float partials[plan::kNormPartials];
  if constexpr (VecMath<T>::kElems == 8) {
    if (p.quant == plan::Quant::kNvfp4) {
      epilogue_rows_of<T, true>(p, rank, block, partials);
      return;
    }
  }
  epilogue_rows_of<T, false>(p, rank, block, partials);
}

}  // namespace pcie_ar::transport::kernels
