// Microbenchmarks that confirm or refute the latency model the schedules are costed with
// (docs/tuning.md): what a system-scope fence costs after local and after host-memory writes,
// serial against parallel flag polls in local and in host memory, and the floor of a CUDA-graph
// launch with and without programmatic dependent launch (PDL).
//
// Host memory is pinned and mapped (cudaHostAlloc), so every access to it crosses this GPU's
// real PCIe link: the one PCIe-true measurement a single GPU can make.
//
//   pcie_gpu_microbench            prints one table per experiment; exit 0 unless CUDA fails
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

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
// kIters times. ns_per_iter[cta] gets the mean.
__global__ void fence_kernel(uint32_t* target, bool fence, uint64_t* ns_per_iter) {
  if (threadIdx.x != 0) return;
  uint32_t* mine = target + blockIdx.x * 32;  // 128 bytes apart
  const uint64_t start = now_ns();
  for (int i = 0; i < kIters; ++i) {
    for (int w = 0; w < 4; ++w) store_u32(mine + w, static_cast<uint32_t>(i));
    if (fence) asm volatile("fence.acq_rel.sys;" ::: "memory");
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
  std::printf("plain: %.2f\n", graph_us_per_launch(stream, false));
  if (major >= 9) {
    std::printf("PDL:   %.2f\n", graph_us_per_launch(stream, true));
  } else {
    std::printf("PDL:   n/a (compute capability %d < 9)\n", major);
  }
  CHECK(cudaStreamDestroy(stream));
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
  return 0;
}
