// Microbenchmarks that confirm or refute the latency model the schedules are costed with
// (docs/tuning.md): what a system-scope fence costs after local and after host-memory writes,
// serial against parallel flag polls in local and in host memory, and the floor of a CUDA-graph
// launch with and without programmatic dependent launch (PDL).
//
// Host memory is pinned and mapped (cudaHostAlloc), so every access to it crosses this GPU's
// real PCIe link: the one PCIe-true measurement a single GPU can make.
//
// Last, the baseline the cuda_host transport (GPUs without P2P) must beat: a plain all-reduce
// through pinned host memory with copies, W virtual ranks on this GPU: every rank's input
// copied to the host, a CPU reduce, the result copied back to every rank; and the single round
// trips it is made of (one D2H + sync, one H2D + sync).
//
//   pcie_gpu_microbench            prints one table per experiment; exit 0 unless CUDA fails
//                                  or the copy baseline's sum is wrong
//
// PCIE_GPU_JSONL=FILE also appends every measurement to FILE as one JSON line the moment it is
// taken (tests/gpu/quick.sh; what a refit of the cost model reads): a trap or a timeout later
// keeps everything measured before it.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "jsonl.h"

namespace {

constexpr const char* kProgram = "microbench";  // the JSON lines' program (jsonl.h)

#define CHECK(call)                                                                                \
  do {                                                                                             \
    const cudaError_t err_ = (call);                                                               \
    if (err_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
      std::exit(1);                                                                                \
    }                                                                                              \
  } while (0)

constexpr int kIters = 256;   // timed repetitions inside each kernel
constexpr int kMaxPolls = 8;  // flags polled per iteration (a rank's peers)
constexpr int kGraphLaunches = 20;

__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ void store_u32(uint32_t* p, uint32_t v) {
  asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Thread 0 of every CTA: a 16-byte data write to `target` (its own line), then a system fence,
// kIters times. ns_per_iter[cta] gets the mean. The fence is the executor's (fence_system in
// primitives_gpu.cuh: __threadfence_system, fence.sc.sys), the one the cost model prices.
__global__ void fence_kernel(uint32_t* target, bool fence, uint64_t* ns_per_iter) {
  if (threadIdx.x != 0) return;
  uint32_t* mine = target + blockIdx.x * 32;  // 128 bytes apart
  const uint64_t start = now_ns();
  for (int i = 0; i < kIters; ++i) {
    for (int w = 0; w < 4; ++w) store_u32(mine + w, static_cast<uint32_t>(i));
    if (fence) __threadfence_system();
  }
  ns_per_iter[blockIdx.x] = (now_ns() - start) / kIters;
}

// Polls `count` flags (already set) kIters times: serially by thread 0, or one flag per thread
// of warp 0 in parallel. ns_per_iter[0] gets the mean.
__global__ void poll_kernel(const uint32_t* flags, int count, bool parallel,
                            uint64_t* ns_per_iter) {
  const int lane = static_cast<int>(threadIdx.x);
  if (lane >= 32) return;
  uint32_t sink = 0;
  const uint64_t start = now_ns();
  for (int i = 0; i < kIters; ++i) {
    if (parallel) {
      if (lane < count) sink += load_acquire(flags + lane * 32);
      __syncwarp();
    } else if (lane == 0) {
      for (int f = 0; f < count; ++f) sink += load_acquire(flags + f * 32);
    }
  }
  if (lane == 0) ns_per_iter[0] = (now_ns() - start) / kIters + (sink == 0xFFFFFFFFu);
}

__global__ void empty_kernel(bool wait_for_previous) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (wait_for_previous) asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#else
  (void)wait_for_previous;
#endif
}

struct Memory {
  const char* name;
  uint32_t* device_ptr;
};

uint64_t median(std::vector<uint64_t> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void fence_table(const std::vector<Memory>& memories, uint64_t* results) {
  std::printf("\n# system fence after a 16-byte write (thread 0 of each CTA; ns per write)\n");
  std::printf("%-12s %6s %12s %12s %12s\n", "memory", "CTAs", "no fence", "fence.sys",
              "fence cost");
  for (const Memory& m : memories) {
    for (int ctas : {1, 16, 128}) {
      uint64_t ns[2] = {};
      for (int fence = 0; fence < 2; ++fence) {
        fence_kernel<<<ctas, 32>>>(m.device_ptr, fence == 1, results);
        CHECK(cudaDeviceSynchronize());
        std::vector<uint64_t> host(ctas);
        CHECK(cudaMemcpy(host.data(), results, ctas * sizeof(uint64_t), cudaMemcpyDeviceToHost));
        ns[fence] = median(host);
      }
      std::printf("%-12s %6d %12llu %12llu %12lld\n", m.name, ctas,
                  static_cast<unsigned long long>(ns[0]), static_cast<unsigned long long>(ns[1]),
                  static_cast<long long>(ns[1]) - static_cast<long long>(ns[0]));
      pcie_gpu::record(
          kProgram, "system_fence",
          "\"memory\": \"%s\", \"ctas\": %d, \"no_fence_ns\": %llu, \"fence_ns\": %llu", m.name,
          ctas, static_cast<unsigned long long>(ns[0]), static_cast<unsigned long long>(ns[1]));
    }
  }
}

void poll_table(const std::vector<Memory>& memories, uint64_t* results) {
  std::printf("\n# flag polls, every flag already set (ns per round of polls)\n");
  std::printf("%-12s %6s %12s %12s\n", "memory", "flags", "serial", "parallel");
  for (const Memory& m : memories) {
    CHECK(cudaMemset(m.device_ptr, 1, kMaxPolls * 128));
    for (int count : {1, 3, 7}) {
      uint64_t ns[2] = {};
      for (int parallel = 0; parallel < 2; ++parallel) {
        poll_kernel<<<1, 32>>>(m.device_ptr, count, parallel == 1, results);
        CHECK(cudaDeviceSynchronize());
        CHECK(cudaMemcpy(&ns[parallel], results, sizeof(uint64_t), cudaMemcpyDeviceToHost));
      }
      std::printf("%-12s %6d %12llu %12llu\n", m.name, count,
                  static_cast<unsigned long long>(ns[0]), static_cast<unsigned long long>(ns[1]));
      pcie_gpu::record(
          kProgram, "flag_polls",
          "\"memory\": \"%s\", \"flags\": %d, \"serial_ns\": %llu, \"parallel_ns\": %llu", m.name,
          count, static_cast<unsigned long long>(ns[0]), static_cast<unsigned long long>(ns[1]));
    }
  }
}

// One graph of kGraphLaunches empty kernels, with or without the PDL attribute.
float graph_us_per_launch(cudaStream_t stream, bool pdl) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kGraphLaunches; ++i) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(1);
    config.blockDim = dim3(32);
    config.stream = stream;
    cudaLaunchAttribute attribute = {};
    attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute.val.programmaticStreamSerializationAllowed = 1;
    config.attrs = pdl ? &attribute : nullptr;
    config.numAttrs = pdl ? 1 : 0;
    CHECK(cudaLaunchKernelEx(&config, empty_kernel, pdl));
  }
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  for (int warm = 0; warm < 5; ++warm) CHECK(cudaGraphLaunch(exec, stream));
  constexpr int kReplays = 200;
  CHECK(cudaEventRecord(start, stream));
  for (int r = 0; r < kReplays; ++r) CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaEventRecord(stop, stream));
  CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, start, stop));
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  return ms * 1000.0f / (kReplays * kGraphLaunches);
}

void launch_table() {
  int device = 0, major = 0;
  CHECK(cudaGetDevice(&device));
  CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf("\n# empty-kernel launch floor in a CUDA graph (%d launches per graph; us each)\n",
              kGraphLaunches);
  const float plain = graph_us_per_launch(stream, false);
  std::printf("plain: %.2f\n", plain);
  pcie_gpu::record(kProgram, "graph_launch", "\"pdl\": false, \"us\": %.3f", plain);
  if (major >= 9) {
    const float pdl = graph_us_per_launch(stream, true);
    std::printf("PDL:   %.2f\n", pdl);
    pcie_gpu::record(kProgram, "graph_launch", "\"pdl\": true, \"us\": %.3f", pdl);
  } else {
    std::printf("PDL:   n/a (compute capability %d < 9)\n", major);
  }
  CHECK(cudaStreamDestroy(stream));
}

// ------------------------------------------------------------------ pinned-copy baseline

constexpr int kCopyWarmup = 20;
constexpr int kCopyCalls = 400;

struct Spread {
  double p10, median, p90;
};

// Nearest-rank percentiles of `v` (microseconds).
Spread spread(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  auto at = [&](double q) { return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1))]; };
  return {at(0.10), at(0.50), at(0.90)};
}

double us_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
}

float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, 4);
  return f;
}

uint16_t float_to_bf16(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// The CPU half of the baseline: accumulate in fp32 in rank order, round once to bf16.
void cpu_reduce_bf16(const std::vector<uint16_t*>& in, int64_t numel, uint16_t* out) {
  const int world = static_cast<int>(in.size());
  for (int64_t i = 0; i < numel; ++i) {
    float acc = bf16_to_float(in[0][i]);
    for (int r = 1; r < world; ++r) acc += bf16_to_float(in[r][i]);
    out[i] = float_to_bf16(acc);
  }
}

// Rank r's element i: m/16 with m in [-15, 15], exact in bf16, and so is a sum of up to 8.
int sixteenths(int r, int64_t i) { return static_cast<int>((r * 7 + i * 13) % 31) - 15; }

// One all-reduce of `world` virtual ranks' bf16 inputs through pinned host memory, per call:
// cudaMemcpyAsync device -> pinned host of every rank's input, stream sync, CPU reduce (fp32,
// rank order, one rounding), cudaMemcpyAsync host -> device of the result to every rank's
// output, stream sync. Returns false (after printing why) if the sum is wrong.
bool copy_baseline_row(int world, int64_t bytes, cudaStream_t stream) {
  const int64_t numel = bytes / 2;
  std::vector<uint16_t*> dev_in(world), dev_out(world), host_in(world);
  uint16_t* host_out = nullptr;
  std::vector<uint16_t> init(numel);
  for (int r = 0; r < world; ++r) {
    CHECK(cudaMalloc(&dev_in[r], bytes));
    CHECK(cudaMalloc(&dev_out[r], bytes));
    CHECK(cudaMallocHost(&host_in[r], bytes));
    for (int64_t i = 0; i < numel; ++i) init[i] = float_to_bf16(sixteenths(r, i) / 16.0f);
    CHECK(cudaMemcpy(dev_in[r], init.data(), bytes, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(dev_out[r], 0xFF, bytes));
  }
  CHECK(cudaMallocHost(&host_out, bytes));
  std::vector<double> total, d2h, reduce, h2d;
  for (int call = 0; call < kCopyWarmup + kCopyCalls; ++call) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < world; ++r) {
      CHECK(cudaMemcpyAsync(host_in[r], dev_in[r], bytes, cudaMemcpyDeviceToHost, stream));
    }
    CHECK(cudaStreamSynchronize(stream));
    const double t_d2h = us_since(t0);
    cpu_reduce_bf16(host_in, numel, host_out);
    const double t_reduce = us_since(t0);
    for (int r = 0; r < world; ++r) {
      CHECK(cudaMemcpyAsync(dev_out[r], host_out, bytes, cudaMemcpyHostToDevice, stream));
    }
    CHECK(cudaStreamSynchronize(stream));
    const double t_total = us_since(t0);
    if (call >= kCopyWarmup) {
      total.push_back(t_total);
      d2h.push_back(t_d2h);
      reduce.push_back(t_reduce - t_d2h);
      h2d.push_back(t_total - t_reduce);
    }
  }
  // Every rank's output must be the exact sum (sixteenths add exactly).
  bool ok = true;
  for (int r = 0; r < world && ok; ++r) {
    CHECK(cudaMemcpy(init.data(), dev_out[r], bytes, cudaMemcpyDeviceToHost));
    for (int64_t i = 0; i < numel; ++i) {
      int want = 0;
      for (int q = 0; q < world; ++q) want += sixteenths(q, i);
      if (bf16_to_float(init[i]) != want / 16.0f) {
        std::printf("FAIL copy baseline world %d %lld B: rank %d element %lld = %g, expected %g\n",
                    world, static_cast<long long>(bytes), r, static_cast<long long>(i),
                    bf16_to_float(init[i]), want / 16.0);
        ok = false;
        break;
      }
    }
  }
  const Spread t = spread(total);
  std::printf("%6d %9lld %9.1f %9.1f %9.1f %11.1f %11.1f %11.1f\n", world,
              static_cast<long long>(bytes), t.median, t.p10, t.p90, spread(d2h).median,
              spread(reduce).median, spread(h2d).median);
  pcie_gpu::record(
      kProgram, "copy_allreduce",
      "\"world\": %d, \"bytes\": %lld, \"median_us\": %.2f, \"p10_us\": %.2f, \"p90_us\": %.2f, "
      "\"d2h_us\": %.2f, \"reduce_us\": %.2f, \"h2d_us\": %.2f, \"sum_ok\": %s",
      world, static_cast<long long>(bytes), t.median, t.p10, t.p90, spread(d2h).median,
      spread(reduce).median, spread(h2d).median, ok ? "true" : "false");
  for (int r = 0; r < world; ++r) {
    CHECK(cudaFree(dev_in[r]));
    CHECK(cudaFree(dev_out[r]));
    CHECK(cudaFreeHost(host_in[r]));
  }
  CHECK(cudaFreeHost(host_out));
  return ok;
}

// One copy of `bytes` between a device buffer and a pinned host buffer, then a stream sync:
// microseconds per round trip.
Spread single_copy_us(int64_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  void* dev = nullptr;
  void* host = nullptr;
  CHECK(cudaMalloc(&dev, bytes));
  CHECK(cudaMallocHost(&host, bytes));
  CHECK(cudaMemset(dev, 0, bytes));
  std::memset(host, 0, bytes);
  std::vector<double> samples;
  for (int call = 0; call < kCopyWarmup + kCopyCalls; ++call) {
    const auto t0 = std::chrono::steady_clock::now();
    if (kind == cudaMemcpyDeviceToHost) {
      CHECK(cudaMemcpyAsync(host, dev, bytes, kind, stream));
    } else {
      CHECK(cudaMemcpyAsync(dev, host, bytes, kind, stream));
    }
    CHECK(cudaStreamSynchronize(stream));
    if (call >= kCopyWarmup) samples.push_back(us_since(t0));
  }
  CHECK(cudaFree(dev));
  CHECK(cudaFreeHost(host));
  return spread(samples);
}

// Sync of an idle stream: what each of the baseline's two waits costs at least.
Spread idle_sync_us(cudaStream_t stream) {
  std::vector<double> samples;
  for (int call = 0; call < kCopyWarmup + kCopyCalls; ++call) {
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(cudaStreamSynchronize(stream));
    if (call >= kCopyWarmup) samples.push_back(us_since(t0));
  }
  return spread(samples);
}

bool copy_baseline_table() {
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::printf(
      "\n# pinned-memory copy all-reduce baseline, bf16, W virtual ranks on this GPU, one stream "
      "(us per all-reduce, host clock; %d calls after %d warm-up)\n"
      "# per call: W x cudaMemcpyAsync D2H to pinned host, sync, CPU reduce (fp32, rank order, "
      "one rounding), W x cudaMemcpyAsync H2D of the result, sync\n",
      kCopyCalls, kCopyWarmup);
  std::printf("%6s %9s %9s %9s %9s %11s %11s %11s\n", "W", "bytes", "median", "p10", "p90",
              "D2H+sync", "CPU reduce", "H2D+sync");
  bool ok = true;
  for (int world : {2, 4}) {
    for (int64_t bytes : {int64_t{1024}, int64_t{12 * 1024}, int64_t{96 * 1024}}) {
      ok = copy_baseline_row(world, bytes, stream) && ok;
    }
  }
  std::printf(
      "\n# the round trips it is made of: one copy + stream sync (us, median / p10 / p90)\n");
  std::printf("%-26s %9s %9s %9s\n", "", "median", "p10", "p90");
  for (int64_t bytes : {int64_t{1024}, int64_t{12 * 1024}, int64_t{96 * 1024}}) {
    for (cudaMemcpyKind kind : {cudaMemcpyDeviceToHost, cudaMemcpyHostToDevice}) {
      const Spread t = single_copy_us(bytes, kind, stream);
      char label[64];
      std::snprintf(label, sizeof(label), "%s %lld B + sync",
                    kind == cudaMemcpyDeviceToHost ? "D2H" : "H2D", static_cast<long long>(bytes));
      std::printf("%-26s %9.1f %9.1f %9.1f\n", label, t.median, t.p10, t.p90);
      pcie_gpu::record(kProgram, "copy_round_trip",
                       "\"kind\": \"%s\", \"bytes\": %lld, \"median_us\": %.2f, \"p10_us\": %.2f, "
                       "\"p90_us\": %.2f",
                       kind == cudaMemcpyDeviceToHost ? "D2H" : "H2D",
                       static_cast<long long>(bytes), t.median, t.p10, t.p90);
    }
  }
  const Spread idle = idle_sync_us(stream);
  std::printf("%-26s %9.1f %9.1f %9.1f\n", "sync of an idle stream", idle.median, idle.p10,
              idle.p90);
  pcie_gpu::record(kProgram, "idle_sync", "\"median_us\": %.2f, \"p10_us\": %.2f, \"p90_us\": %.2f",
                   idle.median, idle.p10, idle.p90);
  CHECK(cudaStreamDestroy(stream));
  return ok;
}

}  // namespace

int main() {
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  constexpr size_t kBytes = 128 * 128;  // 128 CTAs, one 128-byte line each
  uint32_t* local = nullptr;
  uint32_t* host = nullptr;
  uint32_t* host_dev = nullptr;
  uint64_t* results = nullptr;
  CHECK(cudaMalloc(&local, kBytes));
  CHECK(cudaHostAlloc(&host, kBytes, cudaHostAllocMapped | cudaHostAllocPortable));
  CHECK(cudaHostGetDevicePointer(&host_dev, host, 0));
  CHECK(cudaMalloc(&results, 128 * sizeof(uint64_t)));
  const std::vector<Memory> memories = {{"device", local}, {"host(PCIe)", host_dev}};
  fence_table(memories, results);
  poll_table(memories, results);
  launch_table();
  CHECK(cudaFree(results));
  CHECK(cudaFreeHost(host));
  CHECK(cudaFree(local));
  const bool copies_ok = copy_baseline_table();
  return copies_ok ? 0 : 1;
}
