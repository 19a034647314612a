// Throughput of the host reducers (scalar reference, AVX2, AVX-512) per dtype and operand
// count, on one core, at L1/L2-resident and DRAM-sized spans. Run with interleaving so the
// machine's fast and slow phases hit every variant alike:
//   build/cmake/pcie_bench_host_reduce --benchmark_enable_random_interleaving=true
//       --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
// bytes_per_second counts the operand bytes read (num_srcs x span).
#include <benchmark/benchmark.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "plan/layout.h"
#include "plan/step.h"
#include "plan/tactic.h"
#include "transport/executors/host/reduce.h"

namespace {

using pcie_ar::plan::DType;
using pcie_ar::transport::ReduceIsa;

void reduce(benchmark::State& state, DType dtype, ReduceIsa isa) {
  const int num_srcs = static_cast<int>(state.range(0));
  const int64_t bytes = state.range(1);
  const auto fn = pcie_ar::transport::reducer_for(dtype, isa);
  if (fn == nullptr) {
    state.SkipWithError("this CPU does not run this ISA");
    return;
  }
  std::vector<std::vector<uint8_t>> operands(num_srcs, std::vector<uint8_t>(bytes));
  for (int s = 0; s < num_srcs; ++s) {
    for (int64_t i = 0; i < bytes; ++i) operands[s][i] = static_cast<uint8_t>(i * 7 + s) & 0x3f;
  }
  std::vector<uint8_t> out(bytes);
  const uint8_t* srcs[pcie_ar::plan::kMaxSources];
  for (int s = 0; s < num_srcs; ++s) srcs[s] = operands[s].data();
  const int64_t vecs = bytes / pcie_ar::plan::kVectorBytes;
  for (auto _ : state) {
    fn(out.data(), srcs, num_srcs, vecs);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * bytes * num_srcs);
}

void args(benchmark::internal::Benchmark* b) {
  for (const int64_t bytes : {16 << 10, 256 << 10, 8 << 20}) {
    for (const int srcs : {2, 4}) b->Args({srcs, bytes});
  }
}

#define PCIE_AR_REDUCE_BENCH(dtype, isa) \
  BENCHMARK_CAPTURE(reduce, dtype##_##isa, DType::k##dtype, ReduceIsa::k##isa)->Apply(args)

PCIE_AR_REDUCE_BENCH(BF16, Scalar);
PCIE_AR_REDUCE_BENCH(BF16, Avx2);
PCIE_AR_REDUCE_BENCH(BF16, Avx512);
PCIE_AR_REDUCE_BENCH(FP16, Scalar);
PCIE_AR_REDUCE_BENCH(FP16, Avx2);
PCIE_AR_REDUCE_BENCH(FP16, Avx512);
PCIE_AR_REDUCE_BENCH(FP32, Scalar);
PCIE_AR_REDUCE_BENCH(FP32, Avx2);
PCIE_AR_REDUCE_BENCH(FP32, Avx512);

}  // namespace

BENCHMARK_MAIN();
