// The CUDA executor's fused epilogue on the CPU device: every buildable tactic with
// plan::with_epilogue, each dtype, both launch shapes, strict and weak memory, both placements,
// out of place and in place, worlds 2, 3 and 4 (two islands), in every form of plan/epilogue.h
// (with and without the residual add, weight offset 0 and 1, y alone, y and its fp8 or NVFP4 form,
// the fp8 or NVFP4 form alone; NVFP4 in bf16 and fp16 only, at a hidden size of its own, a multiple
// of 16, some launches as two streamed rounds of rows). The fused call must give, bit for bit, what
// the plain all-reduce of the same inputs followed by the host executor's epilogue
// (executors/host/epilogue.cc) gives: the two executors' epilogues agree, and the CUDA one reads
// whole rows only after every CTA of its rank has finished its slices (weak memory delivers the
// others' stores late otherwise). Nothing is written that the form does not name: y where none is
// asked for, bytes around y, y_q and the block scales. NVFP4's block scales are compared whole,
// padding rows and columns included (the tensor starts as garbage, so padding the call leaves
// unwritten shows).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "cpu_device_group.h"
#include "cpu_device_workload.h"
#include "plan/epilogue.h"
#include "plan/layout.h"
#include "plan/quant.h"
#include "plan/schedule.h"
#include "transport/executors/element_codecs.h"
#include "transport/executors/host/epilogue.h"

namespace pcie_ar::transport::cpu_device_test {
namespace {

using plan::DType;

// Element i of a dtype tensor, as fp32 (set: rounded to the dtype).
void set_element(DType dtype, uint8_t* data, int64_t i, float f) {
  if (dtype == DType::kFP32) {
    std::memcpy(data + 4 * i, &f, 4);
  } else {
    const uint16_t h = dtype == DType::kBF16 ? Bf16Codec::from_float(f) : Fp16Codec::from_float(f);
    std::memcpy(data + 2 * i, &h, 2);
  }
}
float get_element(DType dtype, const uint8_t* data, int64_t i) {
  if (dtype == DType::kFP32) {
    float f;
    std::memcpy(&f, data + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, data + 2 * i, 2);
  return dtype == DType::kBF16 ? Bf16Codec::to_float(h) : Fp16Codec::to_float(h);
}

// Elements of `dtype` for values in [-2, 2): a row's mean of squares is order one, so y is too.
std::vector<uint8_t> random_elements(DType dtype, int64_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> dist(-2.0f, 2.0f);
  std::vector<uint8_t> out(n * plan::dtype_bytes(dtype));
  for (int64_t i = 0; i < n; ++i) set_element(dtype, out.data(), i, dist(rng));
  return out;
}

constexpr uint8_t kGuard = 0xA5;
constexpr uint8_t kUnwritten = 0x5A;  // what a tensor the call writes holds before it

// A tensor's bytes between 64 guard bytes on either side that no launch may touch.
class Guarded {
 public:
  explicit Guarded(size_t bytes) : bytes_(bytes), all_(bytes + 2 * kGuardBytes, kGuard) {
    std::fill(all_.begin() + kGuardBytes, all_.end() - kGuardBytes, kUnwritten);
  }
  uint8_t* data() { return all_.data() + kGuardBytes; }
  const std::vector<uint8_t>& all() const { return all_; }
  // "" when both guards hold kGuard only; else where one does not.
  std::string guards_intact() const {
    for (size_t i = 0; i < kGuardBytes; ++i) {
      if (all_[i] != kGuard) return "byte " + std::to_string(i) + " before the tensor changed";
      if (all_[kGuardBytes + bytes_ + i] != kGuard) {
        return "byte " + std::to_string(i) + " after the tensor changed";
      }
    }
    return "";
  }

 private:
  static constexpr size_t kGuardBytes = 64;  // keeps the data 16-byte aligned
  size_t bytes_;
  std::vector<uint8_t> all_;
};

// The forms of the fused epilogue (plan/epilogue.h): with the residual add or without,
// weight offset 0 or 1 (Gemma), and what comes out: y; y and its fp8 form; the fp8 form alone
// (y never stored); the same two with NVFP4. With a residual y goes to the output (where the sum
// was), without one to a tensor of its own (the output keeps the sum, which is residual_out).
enum class Outputs : uint8_t { kY, kYAndFp8, kFp8Only, kYAndNvfp4, kNvfp4Only };
struct Form {
  bool residual;
  float weight_offset;
  Outputs outputs;
};
constexpr int kForms = 20;
Form form_of(int index) {
  return Form{index % 2 == 0, (index / 2) % 2 == 1 ? 1.0f : 0.0f, static_cast<Outputs>(index / 4)};
}
bool is_nvfp4(const Form& f) {
  return f.outputs == Outputs::kYAndNvfp4 || f.outputs == Outputs::kNvfp4Only;
}
std::string form_name(const Form& f) {
  const char* outputs[] = {"y", "y+fp8", "fp8 only", "y+nvfp4", "nvfp4 only"};
  return std::string(f.residual ? "residual" : "no residual") + ", offset " +
         (f.weight_offset != 0.0f ? "1" : "0") + ", " + outputs[static_cast<int>(f.outputs)];
}
// Static fp8 scales: y / scale saturates (0.01), lands in e4m3's subnormals and zeros (50), or
// spreads over the normal range (0.37, not a power of two: 1 / scale rounds).
constexpr float kScales[] = {0.01f, 50.0f, 0.37f};
// NVFP4's global scales G: every block scale underflows to 0 (its codes are then all ±0), the usual
// range (vLLM's G is 2688 / amax of the tensor), every block scale saturates at 448.
constexpr float kNvfp4Scales[] = {0.001f, 900.0f, 1e5f};

bool is_fp8_subnormal(uint8_t code) { return (code & 0x78) == 0 && (code & 0x07) != 0; }

struct WorldCase {
  int world;
  std::vector<int> island_of;
  const char* name;
};

struct EpilogueCase {
  WorldCase world;
  Mode mode;
  int mode_index;
};

std::vector<EpilogueCase> cases() {
  const WorldCase worlds[] = {{2, {0, 0}, "w2"}, {4, {0, 0, 1, 1}, "w4_islands"}, {3, {}, "w3"}};
  std::vector<EpilogueCase> out;
  for (const WorldCase& w : worlds) {
    int index = 0;
    for (const Mode& m : all_modes()) out.push_back({w, m, index++});
  }
  return out;
}

class CpuDeviceEpilogue : public testing::TestWithParam<EpilogueCase> {};

// Every tactic, dtype and launch shape, each launch in one of the forms: in turn per dtype, so
// every dtype runs every form in every world and mode (both memory models, both placements). Some
// launches carry a row with an infinite sum (its y is NaN where r is infinite, fp8 +448 there)
// and a row dominated by one element whose weight is large (fp16's y overflows to infinity).
TEST_P(CpuDeviceEpilogue, EqualsThePlainAllReduceThenTheHostEpilogueBitForBit) {
  const EpilogueCase& c = GetParam();
  const int world = c.world.world;
  // 2056 elements: past kNormPartials (the partials wrap), whole 16-byte vectors in every dtype;
  // 3 rows over 2 or 3 CTAs. NVFP4 needs whole blocks of 16: 2064 elements, 129 block columns
  // (the last 4-column group holds one, then padding), and 4 rows (the rest of the 128-row tile
  // is padding).
  static_assert(2056 > plan::kNormPartials && 2064 % plan::kNvfp4Block == 0);
  const plan::Layout layout = plan::make_layout(4 * 2064, world, 4);
  CpuDeviceGroup group(layout, c.mode.placement, 0, 5.0);
  cpu_device::DeviceOptions options;
  options.memory = c.mode.memory;
  std::mt19937 rng(7 + c.mode_index);
  int launches = 0;
  int saturated = 0, subnormal = 0, nonfinite_y = 0;
  int nvfp4_scales[4] = {};  // NVFP4 block scales: 0, saturated (448), NaN, other
  std::set<std::pair<DType, int>> forms_run;
  const std::vector<host_test::TacticCase> tactics = gpu_tactics(world, c.world.island_of);
  for (size_t ti = 0; ti < tactics.size(); ++ti) {
    const host_test::TacticCase& t = tactics[ti];
    const int plain = group.add_schedule(t.schedule);
    const int fused = group.add_schedule(plan::with_epilogue(t.schedule));
    for (int dtype_index = 0; dtype_index < static_cast<int>(plan::kAllDTypes.size());
         ++dtype_index) {
      const DType dtype = plan::kAllDTypes[dtype_index];
      for (int shape = 0; shape < 2; ++shape) {
        const bool in_place = shape == 1;
        const int index = static_cast<int>(2 * ti) + shape + 5 * c.mode_index;
        // NVFP4 quantises bf16 or fp16 (set_epilogue refuses fp32): fp32 runs the FP8 form instead.
        const int form_index = dtype == DType::kFP32 && is_nvfp4(form_of(index % kForms))
                                   ? index % kForms - 8
                                   : index % kForms;
        const Form form = form_of(form_index);
        const bool nvfp4 = is_nvfp4(form);
        const bool fp8 = form.outputs == Outputs::kYAndFp8 || form.outputs == Outputs::kFp8Only;
        const bool quantised = fp8 || nvfp4;
        const bool y_stored =
            form.outputs != Outputs::kFp8Only && form.outputs != Outputs::kNvfp4Only;
        const int64_t hidden = nvfp4 ? 2064 : 2056;
        const int64_t rows = nvfp4 ? 4 : 3;
        const int64_t numel = rows * hidden;
        const int64_t elem = plan::dtype_bytes(dtype);
        const int64_t y_q_bytes = nvfp4 ? numel / 2 : numel;
        const int64_t k_tiles = plan::nvfp4_k_tiles(hidden);
        const int64_t scale_bytes = nvfp4 ? plan::nvfp4_padded_rows(rows) * 4 * k_tiles : 0;
        const bool y_in_output = form.residual && y_stored;
        const bool y_apart = !form.residual && y_stored;
        // The scale and the extreme rows vary across the forms' turns, dtypes and modes.
        const int salt = static_cast<int>(ti) + dtype_index + c.mode_index;
        const float scale = nvfp4 ? kNvfp4Scales[salt % 3] : kScales[salt % 3];
        const bool extreme = (salt + shape) % 2 == 0;
        const int64_t bytes = numel * elem;
        if (plan::flag_in_data(t.tactic.protocol) && bytes > layout.ll_capacity_bytes) continue;
        // Some NVFP4 launches run as two streamed rounds, rows [0, 1) then [1, rows): the second
        // starts at first_row 1 and holds the last row, so it writes the padding rows.
        const bool in_rounds = nvfp4 && ti % 2 == 1;
        plan::Tactic tactic = t.tactic;
        tactic.blocks = kShapes[shape].blocks;
        tactic.threads = kShapes[shape].threads;
        std::vector<std::vector<uint8_t>> in(world), res(world), w(world), sum(world), out(world),
            res_out(world), expect_out(world), expect_res(world);
        std::vector<Guarded> y, y_q, expect_y, expect_y_q, block_scale, expect_block_scale;
        std::vector<const void*> inputs(world), plain_in(world);
        std::vector<void*> outputs(world), sums(world);
        std::vector<plan::EpilogueArgs> args(world);
        // The residual stream and the weight are replicated: every rank holds the same.
        const std::vector<uint8_t> residual = random_elements(dtype, numel, rng);
        std::vector<uint8_t> weight = random_elements(dtype, hidden, rng);
        if (extreme) set_element(dtype, weight.data(), 5, 30000.0f);
        for (int r = 0; r < world; ++r) {
          in[r] = random_elements(dtype, numel, rng);
          if (extreme && r == 0) {
            set_element(dtype, in[r].data(), hidden + 17, std::numeric_limits<float>::infinity());
            set_element(dtype, in[r].data(), 2 * hidden + 5, 200.0f);
            // NVFP4's fourth row is all NaN: every block's amax is NaN.
            if (nvfp4) {
              set_element(dtype, in[r].data(), 3 * hidden + 1,
                          std::numeric_limits<float>::quiet_NaN());
            }
          }
          res[r] = residual;
          w[r] = weight;
          sum[r].assign(bytes, 0);
          out[r] = in_place ? in[r] : std::vector<uint8_t>(bytes, kUnwritten);
          res_out[r].assign(bytes, kUnwritten);
          expect_res[r].assign(bytes, kUnwritten);
          y.emplace_back(bytes);
          expect_y.emplace_back(bytes);
          y_q.emplace_back(y_q_bytes);
          expect_y_q.emplace_back(y_q_bytes);
          block_scale.emplace_back(scale_bytes);
          expect_block_scale.emplace_back(scale_bytes);
          plain_in[r] = in[r].data();
          sums[r] = sum[r].data();
          inputs[r] = in_place ? out[r].data() : in[r].data();
          outputs[r] = out[r].data();
          plan::EpilogueArgs& a = args[r];
          a.residual = form.residual ? res[r].data() : nullptr;
          a.residual_out = form.residual ? (in_place ? res[r].data() : res_out[r].data())
                                         : static_cast<void*>(out[r].data());
          a.weight = w[r].data();
          a.y = y_in_output ? static_cast<void*>(out[r].data())
                            : (y_apart ? static_cast<void*>(y[r].data()) : nullptr);
          a.y_q = quantised ? y_q[r].data() : nullptr;
          a.scale = quantised ? &scale : nullptr;
          a.hidden = hidden;
          a.eps = 1e-6f;
          a.weight_offset = form.weight_offset;
          a.quant =
              fp8 ? plan::Quant::kFp8E4m3 : (nvfp4 ? plan::Quant::kNvfp4 : plan::Quant::kNone);
          if (nvfp4) {
            a.block_scale = block_scale[r].data();
            a.total_rows = rows;
          }
        }
        const std::string what =
            plan::tactic_label(tactic) + " " + std::string(plan::dtype_name(dtype)) +
            (in_place ? " in place" : "") + mode_name(c.mode) + " (" + form_name(form) +
            ", scale " + std::to_string(scale) + (extreme ? ", extreme rows" : "") +
            (in_rounds ? ", two rounds" : "") + ")";
        // The plain all-reduce's sum, then the host epilogue on it: the expected bits.
        ASSERT_EQ(group.launch(plain, tactic, dtype, plain_in, sums, numel, options),
                  cpu_device::LaunchStatus::kCompleted)
            << what;
        for (int r = 0; r < world; ++r) {
          expect_out[r] = sum[r];
          plan::EpilogueArgs host = args[r];
          host.residual_out = form.residual ? static_cast<void*>(expect_res[r].data())
                                            : static_cast<void*>(expect_out[r].data());
          host.y = y_in_output ? static_cast<void*>(expect_out[r].data())
                               : (y_apart ? static_cast<void*>(expect_y[r].data()) : nullptr);
          host.y_q = quantised ? expect_y_q[r].data() : nullptr;
          host.block_scale = nvfp4 ? expect_block_scale[r].data() : nullptr;
          run_epilogue(dtype, expect_out[r].data(), numel, host);
        }
        const uint32_t signature =
            plan::epilogue_signature(plan::call_signature(dtype, tactic, true), args[0]);
        // Rows [first, first + count) as one call: every tensor from that row on, the block
        // scales whole (placed by row index).
        const auto launch_rows = [&](int64_t first, int64_t count) {
          const int64_t at = first * hidden;
          std::vector<const void*> round_in(world);
          std::vector<void*> round_out(world);
          std::vector<plan::EpilogueArgs> round_args = args;
          const auto shift = [](auto* ptr, int64_t by) {
            return ptr == nullptr
                       ? ptr
                       : reinterpret_cast<decltype(ptr)>(reinterpret_cast<uintptr_t>(ptr) + by);
          };
          for (int r = 0; r < world; ++r) {
            round_in[r] = shift(inputs[r], at * elem);
            round_out[r] = shift(outputs[r], at * elem);
            plan::EpilogueArgs& a = round_args[r];
            a.residual = shift(a.residual, at * elem);
            a.residual_out = shift(a.residual_out, at * elem);
            a.y = shift(a.y, at * elem);
            a.y_q = shift(a.y_q, nvfp4 ? at / 2 : at);
            a.first_row = first;
          }
          return group.launch(fused, tactic, dtype, round_in, round_out, count * hidden, options, 0,
                              -1, signature, &round_args);
        };
        for (const auto& [first, count] :
             in_rounds ? std::vector<std::pair<int64_t, int64_t>>{{0, 1}, {1, rows - 1}}
                       : std::vector<std::pair<int64_t, int64_t>>{{0, rows}}) {
          ASSERT_EQ(launch_rows(first, count), cpu_device::LaunchStatus::kCompleted)
              << what << ", rows " << first << ".." << first + count - 1 << ": "
              << (group.failure() ? plan::describe_failure(*group.failure(), 1.0) : "no record");
        }
        ++launches;
        forms_run.insert({dtype, form_index});
        for (int r = 0; r < world; ++r) {
          const std::string rank = what + ": rank " + std::to_string(r) + "'s ";
          ASSERT_EQ(out[r], expect_out[r]) << rank << (y_in_output ? "y" : "output (the sum)");
          if (!y_in_output) {
            ASSERT_EQ(out[r], sum[r]) << rank << "output: not the sum";
          }
          if (form.residual) {
            const std::vector<uint8_t>& got_res = in_place ? res[r] : res_out[r];
            ASSERT_EQ(got_res, expect_res[r]) << rank << "residual_out";
          }
          ASSERT_EQ(y[r].guards_intact(), "") << rank << "y";
          if (y_apart) {
            ASSERT_EQ(y[r].all(), expect_y[r].all()) << rank << "y";
            ASSERT_EQ(y[r].all(), y[0].all()) << what << ": ranks 0 and " << r << "'s y differ";
          } else {
            // Nothing handed this tensor to the call: it stays as it was.
            ASSERT_EQ(y[r].all(), Guarded(bytes).all()) << rank << "unused y tensor";
          }
          ASSERT_EQ(y_q[r].guards_intact(), "") << rank << "y_q";
          ASSERT_EQ(y_q[r].all(), expect_y_q[r].all()) << rank << "y_q";
          ASSERT_EQ(y_q[r].all(), y_q[0].all()) << what << ": ranks 0 and " << r << "'s y_q differ";
          ASSERT_EQ(block_scale[r].guards_intact(), "") << rank << "block scales";
          ASSERT_EQ(block_scale[r].all(), expect_block_scale[r].all()) << rank << "block scales";
          ASSERT_EQ(out[r], out[0]) << what << ": ranks 0 and " << r << "'s outputs differ";
        }
        // What the data reached, from rank 0's expected results.
        if (fp8) {
          for (int64_t i = 0; i < numel; ++i) {
            const uint8_t code = expect_y_q[0].data()[i];
            saturated += (code & 0x7f) == 0x7e;
            subnormal += is_fp8_subnormal(code);
          }
        }
        if (nvfp4) {  // the block scales of the real rows and columns
          for (int64_t row = 0; row < rows; ++row) {
            for (int64_t col = 0; col < hidden / plan::kNvfp4Block; ++col) {
              const uint8_t sf =
                  expect_block_scale[0].data()[plan::nvfp4_scale_offset(row, col, k_tiles)];
              nvfp4_scales[sf == 0 ? 0 : (sf == 0x7e ? 1 : (sf == 0x7f ? 2 : 3))] += 1;
            }
          }
        }
        if (y_stored) {
          const uint8_t* y_bytes = y_in_output ? expect_out[0].data() : expect_y[0].data();
          for (int64_t i = 0; i < numel; ++i)
            nonfinite_y += !std::isfinite(get_element(dtype, y_bytes, i));
        }
      }
    }
  }
  EXPECT_GT(launches, 0);
  // Every dtype ran every form here (so every form ran under both memory models, in both
  // placements, in every world), and the data hit e4m3's saturation, its subnormals, and a y that
  // is not finite.
  for (DType dtype : plan::kAllDTypes) {
    for (int f = 0; f < kForms; ++f) {
      if (dtype == DType::kFP32 && is_nvfp4(form_of(f))) continue;
      EXPECT_TRUE(forms_run.count({dtype, f}) == 1)
          << plan::dtype_name(dtype) << ": " << form_name(form_of(f)) << " never ran";
    }
  }
  EXPECT_GT(saturated, 0);
  EXPECT_GT(subnormal, 0);
  EXPECT_GT(nonfinite_y, 0);
  // NVFP4's block scales underflowed, saturated, were NaN (a block all NaN) and in range.
  for (int k = 0; k < 4; ++k) EXPECT_GT(nvfp4_scales[k], 0) << "NVFP4 block scale kind " << k;
}

void PrintTo(const EpilogueCase& c, std::ostream* os) { *os << c.world.name << mode_name(c.mode); }

INSTANTIATE_TEST_SUITE_P(Fused, CpuDeviceEpilogue, testing::ValuesIn(cases()),
                         [](const testing::TestParamInfo<EpilogueCase>& info) {
                           return std::string(info.param.world.name) + mode_name(info.param.mode);
                         });

// Rows whose only non-zero elements share one partial (every 2048th): a row's total is that
// partial, so one rounding of one of its 32 terms more or less (a multiply-add contracted into an
// FMA, another order) changes rstd and every y of the row. In the matrix above such a difference
// is usually lost in the total's own rounding. fp32, so the squares are inexact; the test first
// checks that its data tells an FMA from a multiply and an add.
TEST(CpuDeviceEpilogueOrder, RowsHeldByOnePartialShowEveryRounding) {
  const int world = 2;
  const int64_t hidden = 32 * plan::kNormPartials;
  const int64_t rows = 8;
  const int64_t numel = rows * hidden;
  const plan::Layout layout = plan::make_layout(numel, world, 4);
  CpuDeviceGroup group(layout, Placement::kDevice);
  const plan::Schedule plain_schedule =
      plan::build_schedule(plan::Algorithm::kOneshot, plan::Direction::kPush, false, world);
  const int plain = group.add_schedule(plain_schedule);
  const int fused = group.add_schedule(plan::with_epilogue(plain_schedule));
  plan::Tactic tactic;
  tactic.algorithm = plan::Algorithm::kOneshot;
  tactic.blocks = 2;
  tactic.threads = 64;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<float>> in(world, std::vector<float>(numel, 0.0f));
  for (auto& x : in) {
    for (int64_t i = 0; i < numel; i += plan::kNormPartials) x[i] = normal(rng);
  }
  int sensitive_rows = 0;  // rows whose partial differs when its terms are fused
  for (int64_t row = 0; row < rows; ++row) {
    float apart = 0.0f, fused_terms = 0.0f;
    for (int64_t i = row * hidden; i < (row + 1) * hidden; i += plan::kNormPartials) {
      volatile float r = in[0][i] + in[1][i];
      volatile float square = r * r;
      apart = apart + square;
      fused_terms = std::fma(static_cast<float>(r), static_cast<float>(r), fused_terms);
    }
    sensitive_rows += apart != fused_terms;
  }
  ASSERT_GT(sensitive_rows, 0) << "the data cannot tell an FMA from a multiply and an add";
  const std::vector<float> residual(numel, 0.0f), weight(hidden, 1.0f);
  std::vector<std::vector<float>> sum(world, std::vector<float>(numel)),
      out(world, std::vector<float>(numel)), res_out(world, std::vector<float>(numel));
  std::vector<const void*> inputs{in[0].data(), in[1].data()};
  std::vector<void*> sums{sum[0].data(), sum[1].data()}, outputs{out[0].data(), out[1].data()};
  std::vector<plan::EpilogueArgs> args(world);
  for (int r = 0; r < world; ++r) {
    args[r] = plan::EpilogueArgs{.residual = residual.data(),
                                 .residual_out = res_out[r].data(),
                                 .weight = weight.data(),
                                 .y = out[r].data(),
                                 .hidden = hidden,
                                 .eps = 1e-6f};
  }
  const cpu_device::DeviceOptions options;
  ASSERT_EQ(group.launch(plain, tactic, DType::kFP32, inputs, sums, numel, options),
            cpu_device::LaunchStatus::kCompleted);
  ASSERT_EQ(
      group.launch(fused, tactic, DType::kFP32, inputs, outputs, numel, options, 0, -1, 0, &args),
      cpu_device::LaunchStatus::kCompleted);
  std::vector<float> expect_res(numel);
  plan::EpilogueArgs host = args[0];
  host.residual_out = expect_res.data();
  host.y = sum[0].data();
  run_epilogue(DType::kFP32, sum[0].data(), numel, host);
  EXPECT_EQ(std::memcmp(out[0].data(), sum[0].data(), numel * 4), 0) << "y";
  EXPECT_EQ(std::memcmp(res_out[0].data(), expect_res.data(), numel * 4), 0) << "residual_out";
}

}  // namespace
}  // namespace pcie_ar::transport::cpu_device_test
