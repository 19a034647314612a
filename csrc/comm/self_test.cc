#include "comm/self_test.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <map>

#include "comm/arguments.h"
#include "comm/communicator.h"
#include "comm/fallback.h"
#include "plan/layout.h"
#include "plan/quant.h"
#include "plan/schedule.h"

namespace pcie_ar::comm {
namespace {

at::ScalarType scalar_type(plan::DType dtype) {
  switch (dtype) {
    case plan::DType::kBF16:
      return at::kBFloat16;
    case plan::DType::kFP16:
      return at::kHalf;
    case plan::DType::kFP32:
      break;
  }
  return at::kFloat;
}

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Salts: a rank's input, its residual, the weight.
uint64_t salt(int rank, int role) { return (static_cast<uint64_t>(role) << 8) | rank; }
constexpr int kInputRole = 1, kResidualRole = 2, kWeightRole = 3;

constexpr double kEps = 1e-6;
constexpr int64_t kLargestBytes = 64 * 1024;
constexpr float kFp8Scale = 0.5f;    // y / 0.5 keeps most of y's range inside e4m3's
constexpr float kNvfp4Scale = 2.0f;  // the global scale G

// 2^exponent * (1 + mantissa / 128), negative where `negative`: a normal float for exponents
// -126..127.
float from_parts(bool negative, int exponent, uint32_t mantissa) {
  const uint32_t bits = (negative ? 0x80000000u : 0u) |
                        (static_cast<uint32_t>(exponent + 127) << 23) | ((mantissa & 127u) << 16);
  return std::bit_cast<float>(bits);
}

// `f` (fp32) in `dtype`: itself for fp32.
at::Tensor in_dtype(const at::Tensor& f, plan::DType dtype) {
  return dtype == plan::DType::kFP32 ? f : f.to(scalar_type(dtype));
}

// known_values before the dtype: fp32 values exact in the dtype.
at::Tensor known_floats(int64_t numel, uint64_t salt, plan::DType dtype) {
  // Exponents: fp16's top keeps a sum of eight below its largest finite value.
  const bool half = dtype == plan::DType::kFP16;
  const int low = half ? -12 : -20;
  const uint64_t span = half ? 22 : 41;
  at::Tensor f = at::empty({numel}, at::TensorOptions().dtype(at::kFloat));
  float* v = f.data_ptr<float>();
  const uint64_t seed = mix(salt);
  for (int64_t i = 0; i < numel; ++i) {
    const uint64_t h = mix(seed ^ static_cast<uint64_t>(i));
    const bool negative = (h >> 40) & 1;
    v[i] = ((h >> 44) & 15) == 0 ? (negative ? -0.0f : 0.0f)
                                 : from_parts(negative, low + static_cast<int>((h >> 8) % span),
                                              static_cast<uint32_t>(h));
  }
  return f;
}

// Every rank's known input, this rank's residual and the group's sum of the inputs, for one
// dtype: a case of fewer elements takes the first ones (a value depends only on its element and
// rank, and the sum is elementwise).
struct KnownData {
  std::vector<at::Tensor> inputs;
  at::Tensor sum, residual;
};

KnownData known_data(int world, int rank, int64_t numel, plan::DType dtype,
                     const std::vector<int>& island_of) {
  KnownData d;
  d.inputs = known_inputs(world, numel, dtype);
  d.sum = canonical_sum(d.inputs, island_of);
  d.residual = known_values(numel, salt(rank, kResidualRole), dtype);
  return d;
}

// What one rank passes to the call of one case and what the reference says it gets back.
struct Case {
  at::Tensor inp, residual, weight, scale, block_scale;
  at::Tensor want_out, want_residual_out, want_block_scale;  // CPU
};

Case make_case(Op op, plan::DType dtype, int64_t numel, std::pair<int64_t, int64_t> shape, int rank,
               int world, const KnownData& data, at::Device device) {
  const auto [rows, hidden] = shape;
  Case c;
  const auto on_device = [&](const at::Tensor& t) { return t.to(device); };
  const auto first = [&](const at::Tensor& t, int64_t n) { return t.narrow(0, 0, n); };
  if (op.collective == plan::Collective::kAllGather) {
    std::vector<at::Tensor> shares;
    for (int q = 0; q < world; ++q) shares.push_back(first(data.inputs[q], numel / world));
    c.inp = on_device(shares[rank]);
    c.want_out = at::cat(shares);
    return c;
  }
  const at::Tensor sum = first(data.sum, numel);
  if (op.collective == plan::Collective::kReduceScatter) {
    c.inp = on_device(first(data.inputs[rank], numel));
    c.want_out = sum.narrow(0, rank * (numel / world), numel / world);
    return c;
  }
  c.inp = on_device(first(data.inputs[rank], numel).view({rows, hidden}));
  if (!has_epilogue(op)) {
    c.want_out = sum.view({rows, hidden});
    return c;
  }
  // Weights in [0.5, 2): y stays inside the quantised formats' ranges, mostly.
  const at::Tensor w = known_values(hidden, salt(0, kWeightRole), plan::DType::kFP32)
                           .abs()
                           .clamp(0.5, 1.9375)
                           .to(scalar_type(dtype));
  const at::Tensor residual = first(data.residual, numel).view({rows, hidden});
  const float scale = is_nvfp4(op) ? kNvfp4Scale : kFp8Scale;
  const at::Tensor scale_cpu = at::full({1}, scale, at::TensorOptions().dtype(at::kFloat));
  c.weight = on_device(w);
  if (has_residual(op)) c.residual = on_device(residual);
  if (is_quantised(op)) c.scale = on_device(scale_cpu);
  // The outputs the reference forms, beside a poisoned block-scale tensor for each side: the
  // padding rows are compared too.
  at::Tensor y;
  if (is_nvfp4(op)) {
    y = at::empty({rows, hidden / 2}, at::TensorOptions().dtype(at::kByte));
    const std::vector<int64_t> sizes = nvfp4_scale_sizes(c.inp);
    const at::Tensor poison = at::full(sizes, 0xA5, at::TensorOptions().dtype(at::kByte));
    c.want_block_scale = poison.clone().view(at::kFloat8_e4m3fn);
    c.block_scale = on_device(poison).view(at::kFloat8_e4m3fn);
  } else if (is_quantised(op)) {
    y = at::empty({rows, hidden}, at::TensorOptions().dtype(at::kFloat8_e4m3fn));
  } else {
    y = at::empty({rows, hidden}, at::TensorOptions().dtype(scalar_type(dtype)));
  }
  const at::Tensor sum_rows = sum.view({rows, hidden});
  c.want_residual_out = has_residual(op) ? at::empty_like(sum_rows) : sum_rows.clone();
  rms_norm_in_order(sum_rows,
                    EpilogueOperands{has_residual(op) ? residual : at::Tensor(), w,
                                     is_quantised(op) ? scale_cpu : at::Tensor(), kEps, 0.0,
                                     op.quant, c.want_block_scale},
                    y, c.want_residual_out);
  c.want_out = y;
  return c;
}

// The sizes a case may run at, smallest first: each size the tactic was decided for, and the
// whole NVFP4 blocks (16 elements) on either side of it, where a decided size splits one.
std::vector<int64_t> candidate_sizes(const TacticUse& use) {
  const int64_t unit = is_nvfp4(use.op) ? plan::kNvfp4Block * plan::dtype_bytes(use.dtype) : 1;
  std::vector<int64_t> sizes;
  for (const int64_t bytes : use.bytes) {
    sizes.push_back(bytes);
    if (unit > 1 && bytes % unit != 0) {
      if (bytes > unit) sizes.push_back(bytes / unit * unit);
      sizes.push_back((bytes / unit + 1) * unit);
    }
  }
  std::sort(sizes.begin(), sizes.end());
  sizes.erase(std::unique(sizes.begin(), sizes.end()), sizes.end());
  return sizes;
}

}  // namespace

at::Tensor known_values(int64_t numel, uint64_t salt, plan::DType dtype) {
  return in_dtype(known_floats(numel, salt, dtype), dtype);
}

std::vector<at::Tensor> known_inputs(int world, int64_t numel, plan::DType dtype) {
  const bool half = dtype == plan::DType::kFP16;
  std::vector<at::Tensor> x;
  for (int q = 0; q < world; ++q) {
    at::Tensor f = known_floats(numel, salt(q, kInputRole), dtype);
    float* v = f.data_ptr<float>();
    for (int64_t i = 0; i < numel; ++i) {
      const uint64_t h = mix(mix(0x5e1f7e57ull) ^ static_cast<uint64_t>(i));
      if ((h & 3) != 0) continue;
      const int first = static_cast<int>((h >> 12) % world);
      const float big = from_parts((h >> 9) & 1, (half ? 13 : 16) + static_cast<int>((h >> 10) & 1),
                                   static_cast<uint32_t>(h >> 2));
      const float small = from_parts(false, (half ? -14 : -20) + static_cast<int>((h >> 28) & 1),
                                     static_cast<uint32_t>(h >> 20));
      v[i] =
          q == first ? big : (q == (first + 1) % world ? -big : small * static_cast<float>(q + 1));
    }
    x.push_back(in_dtype(f, dtype));
  }
  return x;
}

at::Tensor canonical_sum(const std::vector<at::Tensor>& by_rank,
                         const std::vector<int>& island_of) {
  const at::ScalarType dtype = by_rank.front().scalar_type();
  const auto zeros = [&] { return at::zeros(by_rank.front().sizes(), at::kFloat); };
  std::vector<at::Tensor> partials;
  for (const std::vector<int>& group :
       plan::canonical_groups(static_cast<int>(by_rank.size()), island_of)) {
    at::Tensor acc = zeros();  // +0, then each operand in ascending rank order
    for (const int q : group) acc = acc + by_rank[q].to(at::kFloat);
    partials.push_back(acc.to(dtype));
  }
  if (partials.size() == 1) return partials.front();
  return ((zeros() + partials[0].to(at::kFloat)) + partials[1].to(at::kFloat)).to(dtype);
}

std::optional<std::pair<int64_t, int64_t>> self_test_shape(Op op, plan::DType dtype,
                                                           int64_t numel) {
  if (!has_epilogue(op)) return std::pair<int64_t, int64_t>{1, numel};
  if (is_nvfp4(op) && dtype == plan::DType::kFP32) return std::nullopt;
  const int64_t lanes = plan::kVectorBytes / plan::dtype_bytes(dtype);
  const int64_t unit = is_nvfp4(op) ? std::max<int64_t>(lanes, plan::kNvfp4Block) : lanes;
  for (int64_t hidden = std::min<int64_t>(numel, 4096) / unit * unit; hidden >= unit;
       hidden -= unit) {
    if (numel % hidden == 0) return std::pair<int64_t, int64_t>{numel / hidden, hidden};
  }
  return std::nullopt;
}

std::string first_difference(const std::string& name, const at::Tensor& got,
                             const at::Tensor& want) {
  const at::Tensor g = got.cpu().contiguous();
  const at::Tensor w = want.contiguous();
  if (g.nbytes() != w.nbytes()) {
    return name + " holds " + std::to_string(g.nbytes()) + " bytes, expected " +
           std::to_string(w.nbytes());
  }
  const auto* a = static_cast<const uint8_t*>(g.data_ptr());
  const auto* b = static_cast<const uint8_t*>(w.data_ptr());
  const size_t size = g.element_size();
  for (size_t i = 0; i < g.nbytes(); ++i) {
    if (a[i] == b[i]) continue;
    const size_t e = i / size;
    std::string got_bits, want_bits;
    for (size_t k = size; k-- > 0;) {  // little-endian: the element's bits, high byte first
      char hex[3];
      std::snprintf(hex, sizeof(hex), "%02x", a[e * size + k]);
      got_bits += hex;
      std::snprintf(hex, sizeof(hex), "%02x", b[e * size + k]);
      want_bits += hex;
    }
    return name + " element " + std::to_string(e) + " is 0x" + got_bits + ", expected 0x" +
           want_bits;
  }
  return "";
}

std::vector<SelfTestResult> Communicator::self_test(bool again) {
  std::vector<SelfTestResult> results;
  if (!enabled() || !connected_ || failure_) return results;
  prepare();
  const Stats before = stats();
  const at::Device device = device_.value_or(-1) >= 0
                                ? at::Device(at::kCUDA, static_cast<at::DeviceIndex>(*device_))
                                : at::Device(at::kCPU);
  // What runs: per (op, dtype, tactic), of the sizes it is decided for that fit the op's rows,
  // the smallest (chunks of a few vectors, some empty) and the largest up to 64 KiB (elements
  // enough that a sum in another order shows).
  std::vector<std::vector<int64_t>> sizes;
  std::map<plan::DType, int64_t> most;  // elements of the largest case per dtype
  for (const TacticUse& use : decisions_.uses()) {
    const TacticKey key = tactic_key(use.op, use.dtype, plan::tactic_label(use.tactic));
    if (!again && self_tested_.count(key) != 0) continue;
    self_tested_.insert(key);
    std::vector<int64_t> fitting;
    for (const int64_t bytes : candidate_sizes(use)) {
      const Decision& d = decisions_.decide(use.op, use.dtype, bytes);
      if (d.fallback() || d.tactic != use.tactic) continue;
      if (self_test_shape(use.op, use.dtype, bytes / plan::dtype_bytes(use.dtype))) {
        fitting.push_back(bytes);
      }
    }
    std::vector<int64_t> run_at;
    if (!fitting.empty()) run_at.push_back(fitting.front());
    const auto last = std::upper_bound(fitting.begin(), fitting.end(), kLargestBytes);
    if (last != fitting.begin() && *(last - 1) != fitting.front()) run_at.push_back(*(last - 1));
    for (const int64_t bytes : run_at) {
      int64_t& n = most[use.dtype];
      n = std::max(n, bytes / plan::dtype_bytes(use.dtype));
    }
    SelfTestResult r;
    r.use = use;
    r.use.bytes.clear();
    results.push_back(std::move(r));
    sizes.push_back(std::move(run_at));
  }
  std::map<plan::DType, KnownData> data;
  for (const auto& [dtype, numel] : most) {
    data[dtype] = known_data(options_.world, options_.rank, numel, dtype, options_.island_of);
  }
  for (size_t k = 0; k < results.size(); ++k) {
    SelfTestResult& r = results[k];
    const Op op = r.use.op;
    std::string declined;
    for (const int64_t bytes : sizes[k]) {
      const int64_t numel = bytes / plan::dtype_bytes(r.use.dtype);
      const Case c = make_case(op, r.use.dtype, numel, *self_test_shape(op, r.use.dtype, numel),
                               options_.rank, options_.world, data[r.use.dtype], device);
      at::Tensor out, residual_out, block_scale = c.block_scale;
      const OpArgs args{c.inp,
                        out,
                        c.residual.defined() ? &c.residual : nullptr,
                        c.weight.defined() ? &c.weight : nullptr,
                        has_epilogue(op) ? &residual_out : nullptr,
                        kEps,
                        0.0,
                        c.scale.defined() ? &c.scale : nullptr,
                        is_nvfp4(op) ? &block_scale : nullptr};
      const Decline decline = run(op, args, OnDecline::kReturn);
      if (decline != Decline::kNone) {  // not this tactic's to answer
        declined = "a " + std::to_string(bytes) + "-byte message was declined (" +
                   std::string(decline_name(decline)) + ")";
        continue;
      }
      r.ran = true;
      r.use.bytes.push_back(bytes);
      std::string detail = first_difference("out", out, c.want_out);
      if (detail.empty() && has_epilogue(op)) {
        detail = first_difference("residual_out", residual_out, c.want_residual_out);
      }
      if (detail.empty() && is_nvfp4(op)) {
        detail = first_difference("block_scale", block_scale, c.want_block_scale);
      }
      // Every size runs whatever this rank saw: the calls are collective.
      if (!detail.empty() && r.detail.empty()) {
        r.detail = "a " + std::to_string(bytes) + "-byte message: " + detail;
      }
    }
    r.ok = r.ran && r.detail.empty();
    if (!r.ran) {
      r.detail = !declined.empty() ? declined
                                   : "no message it is chosen for fits this op's rows (NVFP4: "
                                     "bf16 and fp16 rows of whole 16-element blocks)";
    }
  }
  counters_.restore(before);
  return results;
}

void Communicator::withdraw(Op op, plan::DType dtype, const std::string& tactic) {
  decisions_.withdraw(op, dtype, tactic);
}

}  // namespace pcie_ar::comm
