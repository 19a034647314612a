// The unfused epilogue (comm/fallback.cc, rms_norm_in_order, in ATen) against the host executor's
// fused one (executors/host/epilogue.cc) on the same sum: every form (with and without a residual,
// weight offset 0 and 1, y plain, FP8 or NVFP4) gives the same bytes on CPU tensors, special
// values included (NaN payloads of the plain y and of residual_out aside, as plan/epilogue.h
// allows), the NVFP4 block scales in their swizzled layout with the padding zeroed, into a uint8
// or a float8_e4m3fn tensor alike.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "comm/fallback.h"
#include "plan/epilogue.h"
#include "plan/quant.h"
#include "transport/executors/host/epilogue.h"

namespace pcie_ar::comm {
namespace {

constexpr double kEps = 1e-6;

// Normal values, scaled per row over a wide range, with the odd NaN, infinity, signed zero and
// subnormal; row 1 all zeros.
at::Tensor values(int64_t rows, int64_t hidden, at::ScalarType dtype, uint64_t seed) {
  const at::Generator gen = at::detail::createCPUGenerator(seed);
  at::Tensor v = at::randn({rows, hidden}, gen, at::TensorOptions(at::kFloat));
  v = v.mul(at::exp(at::randn({rows, 1}, gen, at::TensorOptions(at::kFloat)).mul(2.0)));
  const float odd[] = {NAN, INFINITY, -INFINITY, -0.0f, 1e-40f, 3e4f};
  float* p = v.data_ptr<float>();
  for (int64_t i = 0; i < v.numel(); i += 37 + static_cast<int64_t>(seed % 11)) {
    p[i] = odd[(i / 37) % std::size(odd)];
  }
  if (rows > 1) v[1].zero_();
  return v.to(dtype);
}

bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.contiguous();
  const at::Tensor y = b.contiguous();
  return x.nbytes() == y.nbytes() && std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) == 0;
}

// Equal bit for bit, except that any two NaNs are equal.
bool same_values(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor fa = a.to(at::kFloat);
  const at::Tensor fb = b.to(at::kFloat);
  const at::Tensor nan = fa.isnan().logical_and(fb.isnan());
  return same_bytes(a.masked_fill(nan, 0), b.masked_fill(nan, 0));
}

struct Outputs {
  at::Tensor y, residual_out, block_scale;
};

// The host executor's epilogue over a copy of `sum`.
Outputs host(const at::Tensor& sum, const at::Tensor& residual, const at::Tensor& weight,
             float scale, double offset, plan::Quant quant) {
  const int64_t hidden = sum.size(-1);
  const int64_t rows = sum.numel() / hidden;
  const plan::DType dtype = sum.scalar_type() == at::kBFloat16 ? plan::DType::kBF16
                            : sum.scalar_type() == at::kHalf   ? plan::DType::kFP16
                                                               : plan::DType::kFP32;
  at::Tensor output = sum.clone();
  Outputs out;
  out.residual_out = residual.defined() ? at::empty_like(sum) : output;
  out.y = quant == plan::Quant::kNone      ? at::empty_like(sum)
          : quant == plan::Quant::kFp8E4m3 ? at::empty({rows, hidden}, at::kByte)
                                           : at::empty({rows, hidden / 2}, at::kByte);
  plan::EpilogueArgs args;
  args.residual = residual.defined() ? residual.data_ptr() : nullptr;
  args.residual_out = out.residual_out.data_ptr();
  args.weight = weight.data_ptr();
  args.y = quant == plan::Quant::kNone ? out.y.data_ptr() : nullptr;
  args.y_q = quant == plan::Quant::kNone ? nullptr : out.y.data_ptr();
  args.scale = &scale;
  if (quant == plan::Quant::kNvfp4) {
    out.block_scale =
        at::full({plan::nvfp4_padded_rows(rows), 4 * plan::nvfp4_k_tiles(hidden)}, 0xA5, at::kByte);
    args.block_scale = out.block_scale.data_ptr<uint8_t>();
  }
  args.first_row = 0;
  args.total_rows = rows;
  args.hidden = hidden;
  args.eps = static_cast<float>(kEps);
  args.weight_offset = static_cast<float>(offset);
  args.quant = quant;
  transport::run_epilogue(dtype, output.data_ptr(), sum.numel(), args);
  return out;
}

// rms_norm_in_order over a copy of `sum`, into fresh outputs (the block scales as
// `scale_dtype`, prefilled with garbage).
Outputs fallback(const at::Tensor& sum, const at::Tensor& residual, const at::Tensor& weight,
                 float scale, double offset, plan::Quant quant, at::ScalarType scale_dtype) {
  const int64_t hidden = sum.size(-1);
  const int64_t rows = sum.numel() / hidden;
  const at::Tensor s = sum.clone();
  Outputs out;
  out.residual_out = residual.defined() ? at::empty_like(sum) : s;
  out.y = quant == plan::Quant::kNone      ? at::empty_like(sum)
          : quant == plan::Quant::kFp8E4m3 ? at::empty({rows, hidden}, at::kFloat8_e4m3fn)
                                           : at::empty({rows, hidden / 2}, at::kByte);
  at::Tensor scale_tensor;
  if (quant != plan::Quant::kNone) scale_tensor = at::full({1}, scale, at::kFloat);
  if (quant == plan::Quant::kNvfp4) {
    out.block_scale =
        at::full({plan::nvfp4_padded_rows(rows), 4 * plan::nvfp4_k_tiles(hidden)}, 0xA5, at::kByte)
            .view(scale_dtype);
  }
  rms_norm_in_order(s, {residual, weight, scale_tensor, kEps, offset, quant, out.block_scale},
                    out.y, out.residual_out);
  if (out.block_scale.defined()) out.block_scale = out.block_scale.view(at::kByte);
  if (quant == plan::Quant::kFp8E4m3) out.y = out.y.view(at::kByte);
  return out;
}

std::string form(bool with_residual, double offset, plan::Quant quant) {
  return std::string(with_residual ? "residual" : "no residual") + ", offset " +
         std::to_string(offset) + ", quant " + std::to_string(static_cast<int>(quant));
}

TEST(FallbackEpilogue, EveryFormGivesTheHostExecutorsBytes) {
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    const std::vector<std::pair<int64_t, int64_t>> shapes = {
        {3, 16}, {130, 80}, {5, 2064}, {2, 4112}};
    for (const auto& [rows, hidden] : shapes) {
      const at::Tensor sum = values(rows, hidden, dtype, 1 + rows + hidden);
      const at::Tensor residual = values(rows, hidden, dtype, 2 + rows + hidden);
      at::Tensor weight = values(1, hidden, dtype, 3 + hidden).reshape({hidden});
      weight = at::where(weight.isnan(), at::ones_like(weight), weight);  // keep most rows finite
      for (const bool with_residual : {true, false}) {
        for (const double offset : {0.0, 1.0}) {
          for (const plan::Quant quant :
               {plan::Quant::kNone, plan::Quant::kFp8E4m3, plan::Quant::kNvfp4}) {
            for (const float scale : {1.0f, 0.37f, 2688.0f / 30.0f}) {
              SCOPED_TRACE(testing::Message()
                           << at::toString(dtype) << " rows " << rows << " hidden " << hidden
                           << ", " << form(with_residual, offset, quant) << ", scale " << scale);
              const at::Tensor r = with_residual ? residual : at::Tensor();
              const Outputs want = host(sum, r, weight, scale, offset, quant);
              for (const at::ScalarType scale_dtype : {at::kByte, at::kFloat8_e4m3fn}) {
                const Outputs got = fallback(sum, r, weight, scale, offset, quant, scale_dtype);
                EXPECT_TRUE(same_values(got.residual_out, want.residual_out));
                if (quant == plan::Quant::kNone) {
                  EXPECT_TRUE(same_values(got.y, want.y));
                } else {
                  EXPECT_TRUE(same_bytes(got.y, want.y));
                }
                if (quant == plan::Quant::kNvfp4) {
                  EXPECT_TRUE(same_bytes(got.block_scale, want.block_scale));
                }
              }
              if (quant == plan::Quant::kNone) break;  // the scale plays no part
            }
          }
        }
      }
    }
  }
}

// A non-contiguous block-scale tensor (a column-sliced view) receives the same bytes.
TEST(FallbackEpilogue, Nvfp4IntoANonContiguousBlockScale) {
  const int64_t rows = 9;
  const int64_t hidden = 48;
  const at::Tensor sum = values(rows, hidden, at::kBFloat16, 7);
  const at::Tensor residual = values(rows, hidden, at::kBFloat16, 8);
  const at::Tensor weight = at::ones({hidden}, at::kBFloat16);
  const Outputs want = host(sum, residual, weight, 4.0f, 0.0, plan::Quant::kNvfp4);
  const at::Tensor wide = at::full({128, 8}, 0xA5, at::kByte);
  const at::Tensor block_scale = wide.narrow(1, 2, 4);
  ASSERT_FALSE(block_scale.is_contiguous());
  const at::Tensor y_q = at::empty({rows, hidden / 2}, at::kByte);
  rms_norm_in_order(sum.clone(),
                    {residual, weight, at::full({1}, 4.0f, at::kFloat), kEps, 0.0,
                     plan::Quant::kNvfp4, block_scale},
                    y_q, at::empty_like(sum));
  EXPECT_TRUE(same_bytes(y_q, want.y));
  EXPECT_TRUE(same_bytes(block_scale.contiguous().view({-1}), want.block_scale.view({-1})));
  EXPECT_TRUE(wide.narrow(1, 0, 2).eq(0xA5).all().item<bool>()) << "wrote outside the view";
}

}  // namespace
}  // namespace pcie_ar::comm
