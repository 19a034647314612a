// The device check of the CUDA IPC transport (target pcie_gpu_check; tests/gpu/run.sh runs it).
// On one GPU, in loopback (N virtual ranks in one grid), it runs every schedule the builders
// accept for world 2, 4 and 8 (flat, two islands of halves, and odd/even islands for world 8)
// × push/pull × staged/unstaged × flag/LL protocol × bf16/fp16/fp32 × message sizes (LL up to
// the layout's LL capacity) × launch shapes, and checks every rank's output against a float64
// reference and bitwise across ranks. Then it captures one all-reduce per tactic in a CUDA
// graph, replays it 1000 times with inputs that change on every replay, and prints a latency
// table. Loopback measures kernel and protocol overhead on one GPU, not PCIe; a second table
// puts virtual rank 0's whole workspace in mapped pinned host memory, so every flag and LL
// word it waits on, and everything peers send it, crosses the PCIe link. A last pass puts every
// virtual rank's workspace in mapped pinned host memory with the generation counters on the
// GPU, the placement of the cuda_host transport (GPUs without P2P), and runs every schedule ×
// dtype × size × shape with inputs that change on every call, graph replay, and (worlds 2 and
// 4) a third latency table.
//
//   pcie_gpu_check                     correctness, graph replay, latency; exit 1 on failure
//   pcie_gpu_check --quick             fewer sizes and shapes, no latency tables, no host-memory
//                                      passes
//   pcie_gpu_check --hostmem-only      only the every-workspace-in-host-memory pass (with
//                                      --no-latency or --quick: without its latency table)
//   pcie_gpu_check --timeout-test      world 2, rank 1 withheld: expects a flag timeout
//   pcie_gpu_check --mismatch-test     rank 0 reduces bf16, rank 1 fp16: expects a mismatch
//   pcie_gpu_check --ll-timeout-test   the same two with the LL protocol: expects an LL
//   pcie_gpu_check --ll-mismatch-test  timeout / an LL mismatch
// The failure tests end with a trapped kernel, which kills the CUDA context: run each in its
// own process. PCIE_ALLREDUCE_PDL=0 turns programmatic dependent launch off (this program reads
// it and passes the choice on; the library reads no environment).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "jsonl.h"
#include "plan/epilogue.h"
#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/quant.h"
#include "plan/schedule.h"
#include "plan/tactic.h"
#include "support/cuda_loopback.h"
#include "transport/executors/host/epilogue.h"
#include "transport/memory/cuda_device.h"

namespace {

namespace plan = pcie_ar::plan;
using pcie_ar::transport::CudaLoopback;
using plan::Algorithm;
using plan::Direction;
using plan::DType;
using plan::Protocol;

constexpr double kTimeoutS = 10.0;  // a protocol bug traps instead of hanging
// The first 256 calls of a world cross 2^32: the LL tags carry the low 32 bits of the
// generation, so this is where a tag comes round.
constexpr uint64_t kInitialGen = 0xFFFFFF00u;
constexpr int64_t kGuardBytes = 256;  // poisoned tail after every output
constexpr int kGraphReplays = 1000;
constexpr int kMaxReportedFailures = 40;
constexpr const char* kProgram = "gpu_check";  // the JSON lines' program (jsonl.h)

// Programmatic dependent launch unless PCIE_ALLREDUCE_PDL=0, read once.
bool pdl_requested() {
  static const bool requested = [] {
    const char* env = std::getenv("PCIE_ALLREDUCE_PDL");
    return env == nullptr || std::strcmp(env, "0") != 0;
  }();
  return requested;
}

// ------------------------------------------------------------------ bookkeeping

struct Tally {
  int pass = 0;
  int fail = 0;
  int skip = 0;
};
std::map<std::string, Tally> g_tally;  // "world 4 | correctness" -> counts
std::vector<std::string> g_tally_order;
int g_reported = 0;
const CudaLoopback* g_loopback = nullptr;  // whose diagnostic to print if a kernel traps

Tally& tally(const std::string& key) {
  if (!g_tally.count(key)) g_tally_order.push_back(key);
  return g_tally[key];
}

void report(const std::string& line) {
  if (++g_reported <= kMaxReportedFailures) std::printf("FAIL %s\n", line.c_str());
  if (g_reported == kMaxReportedFailures) std::printf("(further failures not printed)\n");
}

int print_summary() {
  int fails = 0;
  std::printf("\n==== summary ====\n%-40s %7s %7s %7s\n", "check", "pass", "fail", "skip");
  for (const std::string& key : g_tally_order) {
    const Tally& t = g_tally[key];
    std::printf("%-40s %7d %7d %7d\n", key.c_str(), t.pass, t.fail, t.skip);
    fails += t.fail;
  }
  std::printf("RESULT: %s (%d failure%s)\n", fails ? "FAIL" : "PASS", fails, fails == 1 ? "" : "s");
  return fails;
}

// A CUDA error here is fatal: after a trapped kernel the context is gone. Print what the
// kernel recorded, the summary so far, and stop.
void check_cuda(cudaError_t err, const char* what, int line) {
  if (err == cudaSuccess) return;
  std::printf("FATAL: CUDA error at loopback_check.cu:%d: %s: %s (%s)\n", line, what,
              cudaGetErrorName(err), cudaGetErrorString(err));
  if (g_loopback != nullptr) {
    if (auto d = g_loopback->failure()) {
      std::printf("kernel diagnostic: %s\n", plan::describe_failure(*d, kTimeoutS).c_str());
    }
  }
  tally("fatal CUDA error").fail++;
  print_summary();
  std::exit(1);
}
#define CHECK_CUDA(expr) check_cuda((expr), #expr, __LINE__)

// ------------------------------------------------------------------ dtypes on the host

double unit_roundoff(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return std::ldexp(1.0, -8);
    case DType::kFP16:
      return std::ldexp(1.0, -11);
    case DType::kFP32:
      return std::ldexp(1.0, -24);
  }
  return 1.0;
}

float decode(DType dtype, const uint8_t* data, int64_t i) {
  switch (dtype) {
    case DType::kBF16: {
      uint16_t bits;
      std::memcpy(&bits, data + 2 * i, 2);
      const uint32_t wide = static_cast<uint32_t>(bits) << 16;
      float f;
      std::memcpy(&f, &wide, 4);
      return f;
    }
    case DType::kFP16: {
      __half h;
      std::memcpy(&h, data + 2 * i, 2);
      return __half2float(h);
    }
    case DType::kFP32: {
      float f;
      std::memcpy(&f, data + 4 * i, 4);
      return f;
    }
  }
  return 0.0f;
}

void encode(DType dtype, uint8_t* data, int64_t i, float v) {
  switch (dtype) {
    case DType::kBF16: {
      const __nv_bfloat16 b = __float2bfloat16_rn(v);
      std::memcpy(data + 2 * i, &b, 2);
      return;
    }
    case DType::kFP16: {
      const __half h = __float2half_rn(v);
      std::memcpy(data + 2 * i, &h, 2);
      return;
    }
    case DType::kFP32:
      std::memcpy(data + 4 * i, &v, 4);
      return;
  }
}

std::string size_label(int64_t bytes) {
  char buf[32];
  if (bytes >= (1 << 20) && bytes % (1 << 20) == 0) {
    std::snprintf(buf, sizeof(buf), "%lldMiB", static_cast<long long>(bytes >> 20));
  } else if (bytes >= 1024 && bytes % 1024 == 0) {
    std::snprintf(buf, sizeof(buf), "%lldKiB", static_cast<long long>(bytes >> 10));
  } else {
    std::snprintf(buf, sizeof(buf), "%lldB", static_cast<long long>(bytes));
  }
  return buf;
}

// ------------------------------------------------------------------ schedules under test

struct Case {
  plan::Schedule schedule;
  std::string label;  // "island_twoshot/pull/staged/flag islands 01010101"
  bool island = false;
  bool interleaved = false;
  bool ll = false;  // carries at most layout.ll_capacity_bytes
};

std::string islands_text(const std::vector<int>& islands) {
  std::string text;
  for (int i : islands) text += static_cast<char>('0' + i);
  return text;
}

std::vector<Case> cases_for(int world) {
  std::vector<std::vector<int>> maps = {{}};
  if (world >= 4) {
    std::vector<int> halves(world), odd_even(world);
    for (int r = 0; r < world; ++r) {
      halves[r] = r < world / 2 ? 0 : 1;
      odd_even[r] = r % 2;
    }
    maps.push_back(halves);
    if (world == 8) maps.push_back(odd_even);
  }
  std::vector<Case> cases;
  for (size_t m = 0; m < maps.size(); ++m) {
    for (const plan::Tactic& t : plan::buildable_tactics(world, maps[m])) {
      const bool island = plan::is_island_algorithm(t.algorithm);
      if (island == maps[m].empty()) continue;  // flat algorithms once, islands per map
      Case c;
      c.schedule =
          plan::build_schedule(t.algorithm, t.direction, t.staged, world, maps[m], t.protocol);
      c.label = std::string(plan::algorithm_name(t.algorithm)) + "/" +
                std::string(plan::direction_name(t.direction)) +
                (t.staged ? "/staged/" : "/unstaged/") +
                std::string(plan::protocol_name(t.protocol));
      if (island) c.label += " islands " + islands_text(maps[m]);
      c.island = island;
      c.interleaved = m == 2;
      c.ll = plan::flag_in_data(t.protocol);
      cases.push_back(std::move(c));
    }
  }
  return cases;
}

plan::Tactic tactic_of(const Case& c, int blocks, int threads) {
  plan::Tactic t;
  t.algorithm = c.schedule.algorithm;
  t.direction = c.schedule.direction;
  t.staged = c.schedule.staged;
  t.protocol = c.schedule.protocol;
  t.blocks = blocks;
  t.threads = threads;
  return t;
}

// ------------------------------------------------------------------ device buffers

struct Buffers {
  int world = 0;
  int64_t max_bytes = 0;
  std::vector<uint8_t*> in, out;  // device, max_bytes + kGuardBytes each
  std::vector<uint8_t*> host;     // pinned, one per rank
  cudaStream_t stream = nullptr;

  Buffers(int w, int64_t bytes) : world(w), max_bytes(bytes), in(w), out(w), host(w) {
    for (int r = 0; r < w; ++r) {
      CHECK_CUDA(cudaMalloc(&in[r], bytes + kGuardBytes));
      CHECK_CUDA(cudaMalloc(&out[r], bytes + kGuardBytes));
      CHECK_CUDA(cudaMallocHost(&host[r], bytes + kGuardBytes));
    }
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
  ~Buffers() {
    for (int r = 0; r < world; ++r) {
      cudaFree(in[r]);
      cudaFree(out[r]);
      cudaFreeHost(host[r]);
    }
    cudaStreamDestroy(stream);
  }
  std::vector<const void*> inputs() const { return {in.begin(), in.end()}; }
  std::vector<void*> outputs() const { return {out.begin(), out.end()}; }
};

// Random inputs for one (world, dtype, size), never zero, and their float64 reference.
struct Data {
  DType dtype = DType::kBF16;
  int64_t numel = 0;
  int64_t bytes = 0;
  std::vector<std::vector<uint8_t>> inputs;  // per rank, dtype bits
  std::vector<double> sum, abs_sum;          // exact sum of the rounded inputs, in rank order

  Data(int world, DType d, int64_t nbytes, uint64_t seed)
      : dtype(d), numel(nbytes / plan::dtype_bytes(d)), bytes(nbytes), inputs(world) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> magnitude(1.0f / 32, 1.0f);
    sum.assign(numel, 0.0);
    abs_sum.assign(numel, 0.0);
    for (int r = 0; r < world; ++r) {
      inputs[r].resize(bytes);
      for (int64_t i = 0; i < numel; ++i) {
        const float v = (rng() & 1 ? 1.0f : -1.0f) * magnitude(rng);
        encode(d, inputs[r].data(), i, v);
        const double rounded = decode(d, inputs[r].data(), i);
        sum[i] += rounded;
        abs_sum[i] += std::fabs(rounded);
      }
    }
  }
};

// ------------------------------------------------------------------ correctness

struct Shape {
  int blocks;
  int threads;
};

// Threads per CTA a timed call of `c` launches: LL and lamport at the seed's decode shape, which
// runs the decode-shaped kernels (kDecodeThreads: every operand in one look); the flag protocol
// at 512 (the large-message kernels).
int timed_threads(const Case& c) { return c.ll ? pcie_ar::transport::kDecodeThreads : 512; }

// Runs one all-reduce and checks it: rank 0 against the reference within the rounding the
// algorithm allows, every other rank bitwise equal to rank 0, the guard tails untouched.
bool run_and_check(CudaLoopback& lb, int schedule_id, const Case& c, const Data& data, Buffers& buf,
                   Shape shape, bool in_place, const std::string& what) {
  const int world = buf.world;
  const int64_t bytes = data.bytes;
  const plan::Tactic tactic = tactic_of(c, shape.blocks, shape.threads);
  for (int r = 0; r < world; ++r) {
    CHECK_CUDA(cudaMemsetAsync(buf.out[r], 0xFF, bytes + kGuardBytes, buf.stream));  // NaN
    if (in_place) {
      CHECK_CUDA(
          cudaMemcpyAsync(buf.out[r], buf.in[r], bytes, cudaMemcpyDeviceToDevice, buf.stream));
    }
  }
  const std::vector<const void*> inputs =
      in_place ? std::vector<const void*>(buf.out.begin(), buf.out.end()) : buf.inputs();
  lb.launch(schedule_id, data.dtype, tactic, inputs, buf.outputs(), data.numel,
            plan::call_signature(data.dtype, tactic), buf.stream);
  CHECK_CUDA(cudaStreamSynchronize(buf.stream));
  for (int r = 0; r < world; ++r) {
    CHECK_CUDA(cudaMemcpyAsync(buf.host[r], buf.out[r], bytes + kGuardBytes, cudaMemcpyDeviceToHost,
                               buf.stream));
  }
  CHECK_CUDA(cudaStreamSynchronize(buf.stream));

  const double u = unit_roundoff(data.dtype);
  const double accumulate = world * std::ldexp(1.0, -23);  // fp32 accumulation, generous
  const uint8_t* out0 = buf.host[0];
  for (int64_t i = 0; i < data.numel; ++i) {
    const double got = decode(data.dtype, out0, i);
    const double want = data.sum[i];
    // One rounding of the result; island algorithms also round each island's partial.
    const double tol =
        u * std::fabs(want) + (c.island ? u * data.abs_sum[i] : 0.0) + accumulate * data.abs_sum[i];
    if (!(std::fabs(got - want) <= tol)) {
      char line[256];
      std::snprintf(line, sizeof(line), ": rank 0 element %lld = %.9g, expected %.9g (tol %.3g)",
                    static_cast<long long>(i), got, want, tol);
      report(what + line);
      return false;
    }
  }
  for (int r = 1; r < world; ++r) {
    if (std::memcmp(buf.host[r], out0, bytes) != 0) {
      int64_t i = 0;
      const int eb = plan::dtype_bytes(data.dtype);
      while (i < data.numel && std::memcmp(buf.host[r] + i * eb, out0 + i * eb, eb) == 0) ++i;
      char line[256];
      std::snprintf(line, sizeof(line),
                    ": rank %d differs from rank 0 at element %lld (%.9g vs %.9g)", r,
                    static_cast<long long>(i), decode(data.dtype, buf.host[r], i),
                    decode(data.dtype, out0, i));
      report(what + line);
      return false;
    }
  }
  for (int r = 0; r < world; ++r) {
    for (int64_t b = bytes; b < bytes + kGuardBytes; ++b) {
      if (buf.host[r][b] != 0xFF) {
        report(what + ": rank " + std::to_string(r) + " wrote past the message (byte " +
               std::to_string(b) + ")");
        return false;
      }
    }
  }
  return true;
}

std::vector<Shape> shapes_for(const CudaLoopback& lb, const Case& c, DType dtype, int world,
                              bool quick) {
  std::vector<Shape> shapes = {{1, 256}, {3, 96}, {16, 512}};
  if (quick) shapes = {{3, 96}, {16, 512}};
  // The widest grid that fits: every CTA of every virtual rank must be resident at once.
  const int resident = lb.max_resident_blocks(dtype, c.schedule.direction, 1024);
  for (int blocks : {64, 32, 16, 8}) {
    if (blocks * world <= resident) {
      shapes.push_back({blocks, 1024});
      break;
    }
  }
  return shapes;
}

void check_correctness(CudaLoopback& lb, const std::vector<Case>& cases,
                       const std::vector<int>& ids, Buffers& buf, const std::vector<int64_t>& sizes,
                       bool quick) {
  const int world = buf.world;
  const std::string key = "world " + std::to_string(world) + " | correctness";
  const std::string key_in_place = "world " + std::to_string(world) + " | in-place";
  const std::string key_inputs = "world " + std::to_string(world) + " | inputs untouched";
  for (DType dtype : plan::kAllDTypes) {
    for (int64_t bytes : sizes) {
      const Data data(world, dtype, bytes,
                      0x5EED0000ull + world * 1000 + bytes + static_cast<uint64_t>(dtype) * 7919);
      for (int r = 0; r < world; ++r) {
        CHECK_CUDA(cudaMemcpy(buf.in[r], data.inputs[r].data(), bytes, cudaMemcpyHostToDevice));
      }
      for (size_t k = 0; k < cases.size(); ++k) {
        const Case& c = cases[k];
        if (c.ll && bytes > lb.layout().ll_capacity_bytes) {  // the communicator declines it
          tally(key).skip++;
          continue;
        }
        for (Shape shape : shapes_for(lb, c, dtype, world, quick)) {
          const std::string what = "world " + std::to_string(world) + " " + c.label + " " +
                                   std::string(plan::dtype_name(dtype)) + " " + size_label(bytes) +
                                   " b" + std::to_string(shape.blocks) + " t" +
                                   std::to_string(shape.threads);
          (run_and_check(lb, ids[k], c, data, buf, shape, false, what) ? tally(key).pass
                                                                       : tally(key).fail)++;
        }
        const Shape shape{16, 512};
        const std::string what = "world " + std::to_string(world) + " " + c.label + " " +
                                 std::string(plan::dtype_name(dtype)) + " " + size_label(bytes) +
                                 " in-place";
        (run_and_check(lb, ids[k], c, data, buf, shape, true, what) ? tally(key_in_place).pass
                                                                    : tally(key_in_place).fail)++;
      }
      // No schedule may write the caller's input.
      bool untouched = true;
      for (int r = 0; r < world; ++r) {
        CHECK_CUDA(cudaMemcpy(buf.host[r], buf.in[r], bytes, cudaMemcpyDeviceToHost));
        if (std::memcmp(buf.host[r], data.inputs[r].data(), bytes) != 0) {
          report("world " + std::to_string(world) + " " + std::string(plan::dtype_name(dtype)) +
                 " " + size_label(bytes) + ": rank " + std::to_string(r) +
                 "'s input was modified by a non-in-place all-reduce");
          untouched = false;
        }
      }
      (untouched ? tally(key_inputs).pass : tally(key_inputs).fail)++;
    }
    std::printf("world %d %s: done\n", world, std::string(plan::dtype_name(dtype)).c_str());
    std::fflush(stdout);
  }
}

// Correctness with inputs that change on every call, for workspaces whose slots outlive a call
// (every pass, but it matters most where the memory is far away). kVariants inputs per (dtype,
// size), call n (counted across the whole pass) using variant n % kVariants: calls alternate
// the workspace parity, so the call two before, whose slots, flags and LL words this one
// reuses, always had other inputs (kVariants is odd), and a read of what it left there cannot
// pass, as it could with check_correctness's one input per (dtype, size). Every schedule ×
// dtype × size × shape (shapes_for) plus an in-place call; a shape is skipped only when its
// CTAs cannot all be resident.
void check_correctness_changing_inputs(CudaLoopback& lb, const std::vector<Case>& cases,
                                       const std::vector<int>& ids, Buffers& buf,
                                       const std::vector<int64_t>& sizes,
                                       const std::string& where) {
  constexpr int kVariants = 3;
  const int world = buf.world;
  const std::string prefix = "world " + std::to_string(world) + where;
  const std::string key = prefix + " | correctness";
  const std::string key_in_place = prefix + " | in-place";
  const std::string key_inputs = prefix + " | inputs untouched";
  uint64_t call = 0;
  for (DType dtype : plan::kAllDTypes) {
    const std::string dtype_name(plan::dtype_name(dtype));
    for (int64_t bytes : sizes) {
      std::vector<Data> variants;
      variants.reserve(kVariants);
      for (int v = 0; v < kVariants; ++v) {
        variants.emplace_back(world, dtype, bytes,
                              0xC4A9E000ull + world * 1000 + bytes +
                                  static_cast<uint64_t>(dtype) * 7919 + v * 104729ull);
      }
      int last = -1;  // the variant buf.in holds
      // Stream-ordered uploads: the launch that follows on buf.stream sees them.
      auto next_inputs = [&]() -> const Data& {
        last = static_cast<int>(call++ % kVariants);
        for (int r = 0; r < world; ++r) {
          CHECK_CUDA(cudaMemcpyAsync(buf.in[r], variants[last].inputs[r].data(), bytes,
                                     cudaMemcpyHostToDevice, buf.stream));
        }
        return variants[last];
      };
      for (size_t k = 0; k < cases.size(); ++k) {
        const Case& c = cases[k];
        if (c.ll && bytes > lb.layout().ll_capacity_bytes) {  // the communicator declines it
          tally(key).skip++;
          continue;
        }
        std::vector<std::pair<Shape, bool>> runs;  // (shape, in place)
        for (Shape shape : shapes_for(lb, c, dtype, world, false)) runs.push_back({shape, false});
        runs.push_back({Shape{16, 512}, true});
        for (const auto& [shape, in_place] : runs) {
          const std::string& k_tally = in_place ? key_in_place : key;
          if (shape.blocks * world >
              lb.max_resident_blocks(dtype, c.schedule.direction, shape.threads)) {
            tally(k_tally).skip++;
            continue;
          }
          const Data& data = next_inputs();
          const std::string what = prefix + " " + c.label + " " + dtype_name + " " +
                                   size_label(bytes) + " b" + std::to_string(shape.blocks) + " t" +
                                   std::to_string(shape.threads) + (in_place ? " in-place" : "") +
                                   " call " + std::to_string(call - 1);
          (run_and_check(lb, ids[k], c, data, buf, shape, in_place, what) ? tally(k_tally).pass
                                                                          : tally(k_tally).fail)++;
        }
      }
      if (last < 0) continue;
      // No schedule may write the caller's input (the last call's is still there).
      bool untouched = true;
      for (int r = 0; r < world; ++r) {
        CHECK_CUDA(
            cudaMemcpyAsync(buf.host[r], buf.in[r], bytes, cudaMemcpyDeviceToHost, buf.stream));
      }
      CHECK_CUDA(cudaStreamSynchronize(buf.stream));
      for (int r = 0; r < world; ++r) {
        if (std::memcmp(buf.host[r], variants[last].inputs[r].data(), bytes) != 0) {
          report(prefix + " " + dtype_name + " " + size_label(bytes) + ": rank " +
                 std::to_string(r) + "'s input was modified by a non-in-place all-reduce");
          untouched = false;
        }
      }
      (untouched ? tally(key_inputs).pass : tally(key_inputs).fail)++;
    }
    std::printf("%s %s: done (%llu calls so far)\n", prefix.c_str(), dtype_name.c_str(),
                static_cast<unsigned long long>(call));
    std::fflush(stdout);
  }
}

// ------------------------------------------------------------------ graph replay

struct RankPointers {
  void* p[plan::kMaxWorld];
};

// An exactly representable value m/16, m in ±[1, 15], for rank r, element i, replay k: sums
// of up to 8 of them (and island partials) are exact in bf16, so results compare exactly.
__host__ __device__ int graph_sixteenths(int r, int64_t i, uint32_t k) {
  uint64_t h = (static_cast<uint64_t>(k) << 40) ^ (static_cast<uint64_t>(r) << 32) ^
               static_cast<uint64_t>(i);
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ull;
  h ^= h >> 33;
  const int m = static_cast<int>(h % 30) - 15;
  return m >= 0 ? m + 1 : m;
}

// Captured before the all-reduce: rewrites every rank's input from the replay counter.
__global__ void fill_inputs(RankPointers inputs, int world, int64_t numel,
                            const uint32_t* counter) {
  const uint32_t k = *counter;
  const int64_t total = numel * world;
  for (int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; j < total;
       j += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int r = static_cast<int>(j / numel);
    const int64_t i = j % numel;
    static_cast<__nv_bfloat16*>(inputs.p[r])[i] =
        __float2bfloat16_rn(graph_sixteenths(r, i, k) / 16.0f);
  }
}

// Captured after the all-reduce: the next replay sees new inputs.
__global__ void bump(uint32_t* counter) { *counter += 1; }

// `where` ("" or " hostmem") goes into the tally key and the failure lines.
void check_graph_replay(CudaLoopback& lb, const std::vector<Case>& cases,
                        const std::vector<int>& ids, Buffers& buf, const std::string& where = "") {
  const int world = buf.world;
  const std::string key = "world " + std::to_string(world) + where + " | graph replay x1000";
  const int64_t bytes = 96 * 1024;
  const int64_t numel = bytes / 2;
  uint32_t* counter = nullptr;
  CHECK_CUDA(cudaMalloc(&counter, sizeof(uint32_t)));
  RankPointers inputs{};
  for (int r = 0; r < world; ++r) inputs.p[r] = buf.in[r];
  const std::vector<int> checkpoints = {0, 1, 2, 3, 254, 255, 256, 257, 500, 998, 999};
  for (size_t k = 0; k < cases.size(); ++k) {
    const Case& c = cases[k];
    const plan::Tactic tactic = tactic_of(c, 8, 256);
    const std::string what = "world " + std::to_string(world) + where + " " + c.label + " graph";
    CHECK_CUDA(cudaMemset(counter, 0, sizeof(uint32_t)));
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    CHECK_CUDA(cudaStreamBeginCapture(buf.stream, cudaStreamCaptureModeThreadLocal));
    try {
      fill_inputs<<<256, 256, 0, buf.stream>>>(inputs, world, numel, counter);
      lb.launch(ids[k], DType::kBF16, tactic, buf.inputs(), buf.outputs(), numel,
                plan::call_signature(DType::kBF16, tactic), buf.stream);
      bump<<<1, 1, 0, buf.stream>>>(counter);
    } catch (const std::exception& e) {
      cudaStreamEndCapture(buf.stream, &graph);
      if (graph != nullptr) cudaGraphDestroy(graph);
      report(what + ": capture failed: " + e.what());
      tally(key).fail++;
      continue;
    }
    CHECK_CUDA(cudaStreamEndCapture(buf.stream, &graph));
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    bool ok = true;
    size_t next = 0;
    for (int replay = 0; replay < kGraphReplays && ok; ++replay) {
      CHECK_CUDA(cudaGraphLaunch(exec, buf.stream));
      if (next < checkpoints.size() && checkpoints[next] == replay) {
        ++next;
        CHECK_CUDA(cudaStreamSynchronize(buf.stream));
        std::vector<int> want(numel, 0);
        for (int q = 0; q < world; ++q) {
          for (int64_t i = 0; i < numel; ++i) want[i] += graph_sixteenths(q, i, replay);
        }
        for (int r = 0; r < world && ok; ++r) {
          CHECK_CUDA(cudaMemcpy(buf.host[r], buf.out[r], bytes, cudaMemcpyDeviceToHost));
          for (int64_t i = 0; i < numel; ++i) {
            const float got = decode(DType::kBF16, buf.host[r], i);
            if (got != want[i] / 16.0f) {
              char line[160];
              std::snprintf(line, sizeof(line),
                            ": replay %d rank %d element %lld = %g, expected %g", replay, r,
                            static_cast<long long>(i), got, want[i] / 16.0);
              report(what + line);
              ok = false;
              break;
            }
          }
        }
      }
    }
    CHECK_CUDA(cudaStreamSynchronize(buf.stream));
    CHECK_CUDA(cudaGraphExecDestroy(exec));
    CHECK_CUDA(cudaGraphDestroy(graph));
    (ok ? tally(key).pass : tally(key).fail)++;
  }
  CHECK_CUDA(cudaFree(counter));
}

// ------------------------------------------------------------------ latency

struct LatencyRow {
  std::string label;
  std::vector<std::string> cells;
};

// Median microseconds per call: kCalls launches captured in one graph, replayed kReps times.
double time_per_call_us(CudaLoopback& lb, int schedule_id, const plan::Tactic& tactic,
                        int64_t numel, Buffers& buf,
                        const std::vector<plan::EpilogueArgs>* epilogue = nullptr) {
  constexpr int kCalls = 20;
  constexpr int kWarmup = 3;
  constexpr int kReps = 25;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  CHECK_CUDA(cudaStreamBeginCapture(buf.stream, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < kCalls; ++i) {
    lb.launch(schedule_id, DType::kBF16, tactic, buf.inputs(), buf.outputs(), numel,
              plan::call_signature(DType::kBF16, tactic), buf.stream, 0, -1, epilogue);
  }
  CHECK_CUDA(cudaStreamEndCapture(buf.stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<double> samples;
  for (int rep = 0; rep < kWarmup + kReps; ++rep) {
    CHECK_CUDA(cudaEventRecord(start, buf.stream));
    CHECK_CUDA(cudaGraphLaunch(exec, buf.stream));
    CHECK_CUDA(cudaEventRecord(stop, buf.stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    if (rep >= kWarmup) samples.push_back(1000.0 * ms / kCalls);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  std::nth_element(samples.begin(), samples.begin() + samples.size() / 2, samples.end());
  return samples[samples.size() / 2];
}

// One table: a row per tactic (interleaved islands left out: same code path as the halves),
// a column per size, each cell the best of blocks 4/16/32 at timed_threads(). LL rows stop at the
// layout's LL capacity.
void measure_latency(CudaLoopback& lb, const std::vector<Case>& cases, const std::vector<int>& ids,
                     Buffers& buf, const std::vector<int64_t>& sizes, const std::string& where,
                     std::vector<std::string>& table) {
  const int world = buf.world;
  const std::string key = "world " + std::to_string(world) + " | latency " + where;
  char line[512];
  std::snprintf(line, sizeof(line),
                "\nworld %d, %s, bf16, us per call (best of blocks 4/16/32; LL and lamport 256 "
                "threads, flag 512; median "
                "of 25 graph replays of 20 calls; PDL %s)",
                world, where.c_str(), lb.pdl() ? "on" : "off");
  table.push_back(line);
  std::string header = "  tactic                                            ";
  for (int64_t bytes : sizes) {
    std::snprintf(line, sizeof(line), " %13s", size_label(bytes).c_str());
    header += line;
  }
  table.push_back(header);
  for (size_t k = 0; k < cases.size(); ++k) {
    const Case& c = cases[k];
    if (c.interleaved) continue;
    std::snprintf(line, sizeof(line), "  %-50s", c.label.c_str());
    std::string row = line;
    for (int64_t bytes : sizes) {
      if (c.ll && bytes > lb.layout().ll_capacity_bytes) {
        std::snprintf(line, sizeof(line), " %13s", "-");
        row += line;
        continue;
      }
      double best = 0;
      int best_blocks = 0;
      for (int blocks : {4, 16, 32}) {
        const plan::Tactic tactic = tactic_of(c, blocks, timed_threads(c));
        if (blocks * world >
            lb.max_resident_blocks(DType::kBF16, tactic.direction, tactic.threads)) {
          tally(key).skip++;
          continue;
        }
        const double us = time_per_call_us(lb, ids[k], tactic, bytes / 2, buf);
        tally(key).pass++;
        if (best_blocks == 0 || us < best) {
          best = us;
          best_blocks = blocks;
        }
      }
      std::snprintf(line, sizeof(line), " %7.1f (b%2d)", best, best_blocks);
      row += line;
      if (best_blocks > 0) {
        pcie_gpu::record(kProgram, "latency",
                         "\"world\": %d, \"where\": \"%s\", \"pdl\": %s, \"tactic\": \"%s\", "
                         "\"bytes\": %lld, \"blocks\": %d, \"threads\": %d, \"us\": %.3f",
                         world, where.c_str(), lb.pdl() ? "true" : "false", c.label.c_str(),
                         static_cast<long long>(bytes), best_blocks, timed_threads(c), best);
      }
    }
    table.push_back(row);
  }
}

// ------------------------------------------------------------------ one world

// ------------------------------------------------------------------ the fused epilogue

// The epilogue's forms (plan/epilogue.h): what vLLM's fusion pass matches after the all-reduce.
struct FusedForm {
  const char* name;
  bool residual;        // residual add; without one residual_out is the call's output itself
  bool y;               // y stored (with a residual: into the call's output; else its own tensor)
  float weight_offset;  // Gemma: 1
  plan::Quant quant;
  float scale;  // FP8's static scale, NVFP4's global scale G (y is about -3..3 here)
};
constexpr FusedForm kFusedForms[] = {
    {"add+norm", true, true, 0.0f, plan::Quant::kNone, 0.0f},
    {"norm", false, true, 0.0f, plan::Quant::kNone, 0.0f},
    {"add+norm gemma", true, true, 1.0f, plan::Quant::kNone, 0.0f},
    {"add+norm fp8", true, true, 0.0f, plan::Quant::kFp8E4m3, 0.01f},
    {"add+norm fp8 y_q only", true, false, 0.0f, plan::Quant::kFp8E4m3, 0.37f},
    {"norm gemma fp8 y_q only", false, false, 1.0f, plan::Quant::kFp8E4m3, 0.01f},
    {"add+norm nvfp4 y_q only", true, false, 0.0f, plan::Quant::kNvfp4, 1000.0f},
    {"norm gemma nvfp4 y_q only", false, false, 1.0f, plan::Quant::kNvfp4, 1000.0f},
};

// One rank's tensors of a fused call, on the GPU or (the reference) on the host.
struct FusedTensors {
  void* out;  // the all-reduce's output: the sum, y in place with a residual
  const void* residual;
  void* residual_out;
  const void* weight;
  void* y_own;  // y's own tensor (no residual)
  void* y_q;
  const float* scale;
  uint8_t* block_scale;
};

plan::EpilogueArgs fused_args(const FusedForm& f, const FusedTensors& t, int64_t hidden,
                              int64_t rows) {
  plan::EpilogueArgs a{};
  a.residual = f.residual ? t.residual : nullptr;
  a.residual_out = f.residual ? t.residual_out : t.out;
  a.weight = t.weight;
  a.y = f.y ? (f.residual ? t.out : t.y_own) : nullptr;
  a.quant = f.quant;
  if (f.quant != plan::Quant::kNone) {
    a.y_q = t.y_q;
    a.scale = t.scale;
  }
  if (f.quant == plan::Quant::kNvfp4) {
    a.block_scale = t.block_scale;
    a.first_row = 0;
    a.total_rows = rows;
  }
  a.hidden = hidden;
  a.eps = 1e-6f;
  a.weight_offset = f.weight_offset;
  return a;
}

// Every tactic with plan::with_epilogue, bf16 and fp32, every form of kFusedForms, 3 rows of
// hidden 4096 on 4 CTAs of 256 threads, out of place: every tensor the form writes (the output,
// residual_out, y, y_q, NVFP4's block scales with their padding rows) must equal, bit for bit, the
// plain all-reduce of the same inputs followed by the host executor's epilogue (what the CPU
// device checks in CI, here on the GPU's own memory model). Then, at decode size (1 row), the
// fused call's time beside the plain all-reduce's, the best tactic of each, for the plain, FP8
// and NVFP4 forms.
void check_fused(CudaLoopback& lb, const std::vector<Case>& cases, Buffers& buf,
                 std::vector<std::string>& latency_table) {
  const int world = buf.world;
  const int64_t hidden = 4096;
  const int64_t rows = 3;
  const int64_t numel = rows * hidden;
  const int64_t scale_bytes = plan::nvfp4_padded_rows(rows) * 4 * plan::nvfp4_k_tiles(hidden);
  Tally& t = tally("world " + std::to_string(world) + " | fused epilogue");
  std::vector<FusedTensors> dev(world);
  for (int r = 0; r < world; ++r) {
    FusedTensors& d = dev[r];
    d.out = buf.out[r];
    void* p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, numel * 4));
    d.residual = p;
    CHECK_CUDA(cudaMalloc(&d.residual_out, numel * 4));
    CHECK_CUDA(cudaMalloc(&p, hidden * 4));
    d.weight = p;
    CHECK_CUDA(cudaMalloc(&d.y_own, numel * 4));
    CHECK_CUDA(cudaMalloc(&d.y_q, numel));
    CHECK_CUDA(cudaMalloc(&p, sizeof(float)));
    d.scale = static_cast<const float*>(p);
    CHECK_CUDA(cudaMalloc(&d.block_scale, scale_bytes));
  }
  // The bytes of one device tensor, and a device fill so nothing is left from the last form.
  const auto fetch = [](const void* p, int64_t n) {
    std::vector<uint8_t> v(n);
    CHECK_CUDA(cudaMemcpy(v.data(), p, n, cudaMemcpyDeviceToHost));
    return v;
  };
  const auto poison = [](void* p, int64_t n) { CHECK_CUDA(cudaMemset(p, 0xA5, n)); };
  constexpr int kTimedForms = 3;  // add+norm, add+norm fp8, add+norm nvfp4 y_q only
  const int timed_forms[kTimedForms] = {0, 3, 6};
  double best_plain = 1e30, best_fused[kTimedForms] = {1e30, 1e30, 1e30};
  std::string plain_label, fused_label[kTimedForms];
  for (const Case& c : cases) {
    if (c.interleaved) continue;
    const int plain = lb.add_schedule(c.schedule);
    const int fused = lb.add_schedule(plan::with_epilogue(c.schedule));
    for (DType dtype : {DType::kBF16, DType::kFP32}) {
      const int eb = plan::dtype_bytes(dtype);
      const int64_t bytes = numel * eb;
      if (c.ll && bytes > lb.layout().ll_capacity_bytes) continue;
      const Data data(world, dtype, bytes, 77 + world);
      const Data side(2, dtype, bytes, 91);  // [0]: the residual, [1]: row 0 is the weight
      const plan::Tactic tactic = tactic_of(c, 4, 256);
      for (int r = 0; r < world; ++r) {
        CHECK_CUDA(cudaMemcpy(buf.in[r], data.inputs[r].data(), bytes, cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaMemcpy(const_cast<void*>(dev[r].residual), side.inputs[0].data(), bytes,
                              cudaMemcpyHostToDevice));
        CHECK_CUDA(cudaMemcpy(const_cast<void*>(dev[r].weight), side.inputs[1].data(), hidden * eb,
                              cudaMemcpyHostToDevice));
      }
      lb.launch(plain, dtype, tactic, buf.inputs(), buf.outputs(), numel,
                plan::call_signature(dtype, tactic), buf.stream);
      CHECK_CUDA(cudaStreamSynchronize(buf.stream));
      std::vector<std::vector<uint8_t>> sum(world);
      for (int r = 0; r < world; ++r) sum[r] = fetch(buf.out[r], bytes);
      for (const FusedForm& form : kFusedForms) {
        const bool quantised = form.quant != plan::Quant::kNone;
        const bool nvfp4 = form.quant == plan::Quant::kNvfp4;
        const int64_t y_q_bytes = nvfp4 ? numel / 2 : numel;
        std::vector<plan::EpilogueArgs> args(world);
        for (int r = 0; r < world; ++r) {
          CHECK_CUDA(cudaMemcpy(const_cast<float*>(dev[r].scale), &form.scale, sizeof(float),
                                cudaMemcpyHostToDevice));
          poison(dev[r].residual_out, bytes);
          poison(dev[r].y_own, bytes);
          poison(dev[r].y_q, numel);
          poison(dev[r].block_scale, scale_bytes);
          args[r] = fused_args(form, dev[r], hidden, rows);
        }
        const std::string what = "world " + std::to_string(world) + " fused " + form.name + " " +
                                 plan::tactic_label(tactic) + " " +
                                 std::string(plan::dtype_name(dtype));
        lb.launch(fused, dtype, tactic, buf.inputs(), buf.outputs(), numel,
                  plan::call_signature(dtype, tactic), buf.stream, 0, -1, &args);
        CHECK_CUDA(cudaStreamSynchronize(buf.stream));
        bool ok = true;
        for (int r = 0; r < world && ok; ++r) {
          // The reference: this rank's plain all-reduce, then the host executor's epilogue.
          std::vector<uint8_t> out = sum[r], res_out(bytes, 0xA5), y_own(bytes, 0xA5),
                               y_q(numel, 0xA5), block_scale(scale_bytes, 0xA5);
          const FusedTensors host{out.data(),     side.inputs[0].data(),
                                  res_out.data(), side.inputs[1].data(),
                                  y_own.data(),   y_q.data(),
                                  &form.scale,    block_scale.data()};
          pcie_ar::transport::run_epilogue(dtype, out.data(), numel,
                                           fused_args(form, host, hidden, rows));
          const auto differs = [&](const char* name, const void* got,
                                   const std::vector<uint8_t>& want, int64_t n) {
            if (fetch(got, n) == std::vector<uint8_t>(want.begin(), want.begin() + n)) return false;
            report(what + ": rank " + std::to_string(r) + " " + name +
                   " differs from the plain all-reduce + the host epilogue");
            return true;
          };
          ok = !differs("output", buf.out[r], out, bytes) &&
               !(form.residual && differs("residual_out", dev[r].residual_out, res_out, bytes)) &&
               !(!form.residual && form.y && differs("y", dev[r].y_own, y_own, bytes)) &&
               !(quantised && differs("y_q", dev[r].y_q, y_q, y_q_bytes)) &&
               !(nvfp4 && differs("block scales", dev[r].block_scale, block_scale, scale_bytes));
        }
        ok ? t.pass++ : t.fail++;
      }
      if (dtype != DType::kBF16) continue;
      // Decode size: one row of hidden 4096 bf16 (8 KiB), plain vs each timed form, graph-timed.
      const plan::Tactic timed = tactic_of(c, 4, timed_threads(c));
      const double tp = time_per_call_us(lb, plain, timed, hidden, buf);
      if (tp < best_plain) best_plain = tp, plain_label = plan::tactic_label(timed);
      for (int k = 0; k < kTimedForms; ++k) {
        const FusedForm& form = kFusedForms[timed_forms[k]];
        std::vector<plan::EpilogueArgs> args(world);
        for (int r = 0; r < world; ++r) {
          CHECK_CUDA(cudaMemcpy(const_cast<float*>(dev[r].scale), &form.scale, sizeof(float),
                                cudaMemcpyHostToDevice));
          args[r] = fused_args(form, dev[r], hidden, 1);
        }
        const double tf = time_per_call_us(lb, fused, timed, hidden, buf, &args);
        if (tf < best_fused[k]) best_fused[k] = tf, fused_label[k] = plan::tactic_label(timed);
      }
    }
  }
  for (int r = 0; r < world; ++r) {
    const FusedTensors& d = dev[r];
    for (const void* p :
         {d.residual, static_cast<const void*>(d.residual_out), d.weight,
          static_cast<const void*>(d.y_own), static_cast<const void*>(d.y_q),
          static_cast<const void*>(d.scale), static_cast<const void*>(d.block_scale)}) {
      cudaFree(const_cast<void*>(p));
    }
  }
  char line[256];
  std::snprintf(line, sizeof(line), "\nworld %d, 1 row of 4096 bf16: plain all-reduce %.2f us (%s)",
                world, best_plain, plain_label.c_str());
  latency_table.push_back(line);
  pcie_gpu::record(kProgram, "fused_decode",
                   "\"world\": %d, \"form\": \"plain all-reduce\", \"tactic\": \"%s\", "
                   "\"us\": %.3f",
                   world, plain_label.c_str(), best_plain);
  for (int k = 0; k < kTimedForms; ++k) {
    pcie_gpu::record(kProgram, "fused_decode",
                     "\"world\": %d, \"form\": \"%s\", \"tactic\": \"%s\", \"us\": %.3f", world,
                     kFusedForms[timed_forms[k]].name, fused_label[k].c_str(), best_fused[k]);
    std::snprintf(line, sizeof(line), "  fused %-24s %.2f us (%s): fused/plain %.2fx",
                  kFusedForms[timed_forms[k]].name, best_fused[k], fused_label[k].c_str(),
                  best_fused[k] / best_plain);
    latency_table.push_back(line);
  }
}

// Reduce-scatter and all-gather: every buildable tactic of each, flat and (world >= 4)
// two halves, bf16 and fp32, a 96 KiB message (12 KiB for LL tactics). The one-chunk tensors are
// addressed as the Communicator addresses them, from `rank` chunks below the tensor. The
// reduce-scatter's chunk must equal, bit for bit, chunk r of the all-reduce of the same
// algorithm family, tactic and inputs; the all-gather must return every rank's bytes; the bytes
// after the one-chunk output must stay as they were. Then, graph-timed at 12 KiB and 96 KiB
// (bf16): the best of each beside the best all-reduce.
void check_collectives(CudaLoopback& lb, const std::vector<Case>& cases,
                       const std::vector<int>& ids, Buffers& buf,
                       std::vector<std::string>& latency_table) {
  const int world = buf.world;
  Tally& t = tally("world " + std::to_string(world) + " | reduce-scatter, all-gather");
  std::vector<std::vector<int>> maps = {{}};
  if (world >= 4) {
    std::vector<int> halves(world);
    for (int r = 0; r < world; ++r) halves[r] = r < world / 2 ? 0 : 1;
    maps.push_back(halves);
  }
  const auto below = [](uint8_t* p, int r, int64_t chunk_bytes) {
    return reinterpret_cast<uint8_t*>(reinterpret_cast<uintptr_t>(p) - r * chunk_bytes);
  };
  std::map<int64_t, double> best[3];  // collective -> message bytes -> us
  std::map<int64_t, std::string> best_label[3];
  const std::vector<int64_t> timed_sizes = {12 * 1024, 96 * 1024};
  for (size_t i = 0; i < cases.size(); ++i) {  // the all-reduce's best, for the ratio
    const Case& c = cases[i];
    if (c.interleaved) continue;
    for (int64_t bytes : timed_sizes) {
      if (c.ll && bytes > lb.layout().ll_capacity_bytes) continue;
      const plan::Tactic timed = tactic_of(c, 4, timed_threads(c));
      const double us = time_per_call_us(lb, ids[i], timed, bytes / 2, buf);
      if (!best[0].count(bytes) || us < best[0][bytes]) {
        best[0][bytes] = us;
        best_label[0][bytes] = plan::tactic_label(timed);
      }
    }
  }
  for (const plan::Collective collective :
       {plan::Collective::kReduceScatter, plan::Collective::kAllGather}) {
    const int k = static_cast<int>(collective);
    const bool scatter = collective == plan::Collective::kReduceScatter;
    for (const auto& island_of : maps) {
      for (const plan::Tactic& built : plan::buildable_tactics(world, island_of, collective)) {
        if (plan::is_island_algorithm(built.algorithm) == island_of.empty()) continue;
        const plan::Schedule schedule =
            plan::build_schedule(built.algorithm, built.direction, built.staged, world, island_of,
                                 built.protocol, collective);
        const int id = lb.add_schedule(schedule);
        const int ar = lb.add_schedule(plan::build_schedule(
            built.algorithm, built.direction, built.staged, world, island_of, built.protocol));
        const bool ll = plan::flag_in_data(built.protocol);
        plan::Tactic tactic = built;
        tactic.blocks = 4;
        tactic.threads = 256;
        for (DType dtype : {DType::kBF16, DType::kFP32}) {
          const int64_t bytes = ll ? 12 * 1024 : 96 * 1024;
          const int64_t numel = bytes / plan::dtype_bytes(dtype);
          const int64_t chunk_bytes = bytes / world;
          if (chunk_bytes % plan::kVectorBytes != 0) continue;
          const Data data(world, dtype, bytes, 311 + world + k);
          const std::string what = "world " + std::to_string(world) + " " +
                                   std::string(plan::collective_name(collective)) + " " +
                                   plan::tactic_label(tactic) + " " +
                                   std::string(plan::dtype_name(dtype));
          std::vector<std::vector<uint8_t>> want(world);
          std::vector<const void*> inputs(world);
          std::vector<void*> outputs(world);
          if (scatter) {
            for (int r = 0; r < world; ++r) {
              CHECK_CUDA(
                  cudaMemcpy(buf.in[r], data.inputs[r].data(), bytes, cudaMemcpyHostToDevice));
            }
            lb.launch(ar, dtype, tactic, buf.inputs(), buf.outputs(), numel,
                      plan::call_signature(dtype, tactic), buf.stream);
            CHECK_CUDA(cudaStreamSynchronize(buf.stream));
            for (int r = 0; r < world; ++r) {
              want[r].resize(chunk_bytes);
              CHECK_CUDA(cudaMemcpy(want[r].data(), buf.out[r] + r * chunk_bytes, chunk_bytes,
                                    cudaMemcpyDeviceToHost));
              CHECK_CUDA(cudaMemset(buf.out[r], 0xA5, chunk_bytes + kGuardBytes));
              inputs[r] = buf.in[r];
              outputs[r] = below(buf.out[r], r, chunk_bytes);
            }
          } else {
            for (int r = 0; r < world; ++r) {
              CHECK_CUDA(cudaMemcpy(buf.in[r], data.inputs[r].data(), chunk_bytes,
                                    cudaMemcpyHostToDevice));
              CHECK_CUDA(cudaMemset(buf.out[r], 0xA5, bytes + kGuardBytes));
              inputs[r] = below(buf.in[r], r, chunk_bytes);
              outputs[r] = buf.out[r];
            }
          }
          lb.launch(id, dtype, tactic, inputs, outputs, numel,
                    plan::call_signature(dtype, tactic, false, collective), buf.stream);
          CHECK_CUDA(cudaStreamSynchronize(buf.stream));
          bool ok = true;
          const int64_t written = scatter ? chunk_bytes : bytes;
          for (int r = 0; r < world && ok; ++r) {
            std::vector<uint8_t> got(written + kGuardBytes);
            CHECK_CUDA(cudaMemcpy(got.data(), buf.out[r], got.size(), cudaMemcpyDeviceToHost));
            for (int64_t i = written; i < static_cast<int64_t>(got.size()) && ok; ++i) {
              if (got[i] != 0xA5) {
                report(what + ": rank " + std::to_string(r) + " wrote past its output");
                ok = false;
              }
            }
            for (int q = 0; q < (scatter ? 1 : world) && ok; ++q) {
              const uint8_t* expect = scatter ? want[r].data() : data.inputs[q].data();
              if (std::memcmp(got.data() + (scatter ? 0 : q * chunk_bytes), expect, chunk_bytes) !=
                  0) {
                report(what + ": rank " + std::to_string(r) +
                       (scatter ? " differs from chunk r of the all-reduce"
                                : " chunk " + std::to_string(q) + " is not rank " +
                                      std::to_string(q) + "'s input"));
                ok = false;
              }
            }
          }
          ok ? t.pass++ : t.fail++;
        }
        for (int64_t bytes : timed_sizes) {
          if (ll && bytes > lb.layout().ll_capacity_bytes) continue;
          plan::Tactic timed = built;
          timed.blocks = 4;
          timed.threads = 512;
          const double us = time_per_call_us(lb, id, timed, bytes / 2, buf);
          if (!best[k].count(bytes) || us < best[k][bytes]) {
            best[k][bytes] = us;
            best_label[k][bytes] = plan::tactic_label(timed);
          }
        }
      }
    }
  }
  for (int64_t bytes : timed_sizes) {
    char line[512];
    std::snprintf(line, sizeof(line),
                  "\nworld %d, %s bf16 message: all-reduce %.2f us (%s); reduce-scatter %.2f us "
                  "(%s), %.2fx; all-gather %.2f us (%s), %.2fx",
                  world, size_label(bytes).c_str(), best[0][bytes], best_label[0][bytes].c_str(),
                  best[1][bytes], best_label[1][bytes].c_str(), best[1][bytes] / best[0][bytes],
                  best[2][bytes], best_label[2][bytes].c_str(), best[2][bytes] / best[0][bytes]);
    latency_table.push_back(line);
  }
}

void run_world(int world, bool quick, bool latency, std::vector<std::string>& latency_table) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t max_bytes = 1024 * 1024;
  // elem_bytes 4 so one workspace serves every dtype; max_numel counts bf16 elements.
  CudaLoopback lb(plan::make_layout(max_bytes / 2, world, 4), 0, kInitialGen, kTimeoutS,
                  pdl_requested());
  g_loopback = &lb;
  const int64_t ll_capacity = lb.layout().ll_capacity_bytes;  // the largest LL message
  std::vector<int64_t> sizes = {
      16,     1024 + 16,   12 * 1024,  96 * 1024,
      159744, ll_capacity, 384 * 1024, 1024 * 1024};  // 159744 = 13 rows of hidden 6144
  if (quick) sizes = {16, 1024 + 16, 159744};
  Buffers buf(world, max_bytes);
  const std::vector<Case> cases = cases_for(world);
  std::vector<int> ids;
  for (const Case& c : cases) ids.push_back(lb.add_schedule(c.schedule));
  std::printf("world %d: %zu schedules, LL capacity %s, PDL %s\n", world, cases.size(),
              size_label(ll_capacity).c_str(), lb.pdl() ? "on" : "off");
  std::fflush(stdout);

  check_correctness(lb, cases, ids, buf, sizes, quick);
  check_graph_replay(lb, cases, ids, buf);
  check_fused(lb, cases, buf, latency_table);
  check_collectives(lb, cases, ids, buf, latency_table);
  if (latency) {
    measure_latency(lb, cases, ids, buf, {1024, 12 * 1024, 96 * 1024, 384 * 1024, 1024 * 1024},
                    "device memory", latency_table);
  }
  g_loopback = nullptr;
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("world %d finished in %.1f s\n", world, s);
  std::fflush(stdout);
}

// The same world with virtual rank 0's workspace in mapped pinned host memory: its flags and
// LL slots are polled across PCIe and every peer's stores to it are PCIe writes, as between
// real GPUs. A short correctness pass (bf16), then the latency table at 1/12/96 KiB.
void run_world_host_mapped(int world, std::vector<std::string>& latency_table) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t max_bytes = 96 * 1024;
  const plan::Layout layout = plan::make_layout(max_bytes / 2, world, 2);
  void* host = nullptr;
  CHECK_CUDA(cudaHostAlloc(&host, layout.total_bytes, cudaHostAllocMapped | cudaHostAllocPortable));
  void* device_view = nullptr;
  CHECK_CUDA(cudaHostGetDevicePointer(&device_view, host, 0));
  {
    CudaLoopback lb(layout, 0, kInitialGen, kTimeoutS, pdl_requested());
    lb.use_external_slab(0, static_cast<uint8_t*>(device_view), kInitialGen);
    g_loopback = &lb;
    Buffers buf(world, max_bytes);
    std::vector<Case> cases;
    for (Case& c : cases_for(world)) {
      if (!c.interleaved) cases.push_back(std::move(c));
    }
    std::vector<int> ids;
    for (const Case& c : cases) ids.push_back(lb.add_schedule(c.schedule));
    std::printf("world %d, rank 0 in host memory: %zu schedules\n", world, cases.size());
    std::fflush(stdout);

    const std::string key = "world " + std::to_string(world) + " | host-mapped correctness";
    for (int64_t bytes : {int64_t{1024 + 16}, max_bytes}) {
      const Data data(world, DType::kBF16, bytes, 0x4057ull + world * 1000 + bytes);
      for (int r = 0; r < world; ++r) {
        CHECK_CUDA(cudaMemcpy(buf.in[r], data.inputs[r].data(), bytes, cudaMemcpyHostToDevice));
      }
      for (size_t k = 0; k < cases.size(); ++k) {
        const std::string what = "world " + std::to_string(world) + " " + cases[k].label +
                                 " bf16 " + size_label(bytes) + " rank 0 in host memory";
        (run_and_check(lb, ids[k], cases[k], data, buf, Shape{4, 512}, false, what)
             ? tally(key).pass
             : tally(key).fail)++;
      }
    }
    measure_latency(lb, cases, ids, buf, {1024, 12 * 1024, 96 * 1024}, "rank 0 in host memory",
                    latency_table);
    g_loopback = nullptr;
  }
  CHECK_CUDA(cudaFreeHost(host));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("world %d (rank 0 in host memory) finished in %.1f s\n", world, s);
  std::fflush(stdout);
}

// Sets g_loopback for one pass and clears it however the pass ends.
struct LoopbackScope {
  explicit LoopbackScope(const CudaLoopback& lb) { g_loopback = &lb; }
  ~LoopbackScope() { g_loopback = nullptr; }
  LoopbackScope(const LoopbackScope&) = delete;
  LoopbackScope& operator=(const LoopbackScope&) = delete;
};

// Every virtual rank's workspace where the cuda_host transport (GPUs without peer-to-peer) puts
// a real rank's: the slab in mapped pinned host memory, the generation counters in device
// memory (CudaLoopback::use_host_memory()). Every flag, LL word and data slot then crosses the
// GPU's PCIe link, both ways; the kernels are the same. Correctness for every schedule × dtype
// × size × shape with inputs that change on every call (check_correctness_changing_inputs),
// graph replay ×1000 per schedule, then (with `latency`) the latency table at 1/12/96/384 KiB.
void run_world_hostmem(int world, bool latency, std::vector<std::string>& table) {
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t max_bytes = 384 * 1024;  // the latency table's largest message
  // elem_bytes 4 so one workspace serves every dtype; max_numel counts bf16 elements.
  CudaLoopback lb(plan::make_layout(max_bytes / 2, world, 4), 0, kInitialGen, kTimeoutS,
                  pdl_requested());
  lb.use_host_memory();  // before any schedule or launch
  const LoopbackScope scope(lb);
  const int64_t ll_capacity = lb.layout().ll_capacity_bytes;
  std::vector<int64_t> sizes = {16, 1024 + 16, 12 * 1024, 96 * 1024};
  if (ll_capacity <= max_bytes &&
      std::find(sizes.begin(), sizes.end(), ll_capacity) == sizes.end()) {
    sizes.push_back(ll_capacity);  // the largest LL message
  }
  Buffers buf(world, max_bytes);
  const std::vector<Case> cases = cases_for(world);
  std::vector<int> ids;
  for (const Case& c : cases) ids.push_back(lb.add_schedule(c.schedule));
  std::printf(
      "world %d, every workspace in host memory (%.1f MiB each): %zu schedules, LL capacity %s, "
      "PDL %s\n",
      world, static_cast<double>(lb.layout().total_bytes) / (1 << 20), cases.size(),
      size_label(ll_capacity).c_str(), lb.pdl() ? "on" : "off");
  std::fflush(stdout);

  check_correctness_changing_inputs(lb, cases, ids, buf, sizes, " hostmem");
  check_graph_replay(lb, cases, ids, buf, " hostmem");
  if (latency) {
    measure_latency(lb, cases, ids, buf, {1024, 12 * 1024, 96 * 1024, 384 * 1024},
                    "every workspace in host memory (cuda_host)", table);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("world %d (every workspace in host memory) finished in %.1f s\n", world, s);
  std::fflush(stdout);
}

// ------------------------------------------------------------------ failure paths

plan::Tactic two_rank_tactic(Protocol protocol, int blocks) {
  plan::Tactic tactic;
  tactic.algorithm = Algorithm::kOneshot;
  tactic.direction = Direction::kPush;
  tactic.staged = protocol == Protocol::kFlag;  // LL is unstaged
  tactic.protocol = protocol;
  tactic.blocks = blocks;
  tactic.threads = 128;
  return tactic;
}

plan::Schedule two_rank_schedule(const plan::Tactic& tactic) {
  return plan::build_schedule(tactic.algorithm, tactic.direction, tactic.staged, 2, {},
                              tactic.protocol);
}

// World 2 with only rank 0 launched: rank 0 must time out waiting for rank 1 (its flag, or its
// LL data), record it naming rank 1, and trap.
int timeout_test(Protocol protocol) {
  constexpr uint64_t kGen = 0x1FFFFFFF0ull;  // past 2^32: the diagnostic carries 64 bits
  constexpr double kTimeout = 1.0;
  CudaLoopback lb(plan::make_layout(1024, 2, 4), 0, kGen, kTimeout, pdl_requested());
  const plan::Tactic tactic = two_rank_tactic(protocol, 2);
  const int id = lb.add_schedule(two_rank_schedule(tactic));
  Buffers buf(2, 1024 * 4);
  const auto t0 = std::chrono::steady_clock::now();
  lb.launch(id, DType::kBF16, tactic, buf.inputs(), buf.outputs(), 1024,
            plan::call_signature(DType::kBF16, tactic), buf.stream, /*first_rank=*/0,
            /*count=*/1);
  const cudaError_t err = cudaStreamSynchronize(buf.stream);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("kernel ended after %.2f s with %s (%s)\n", s, cudaGetErrorName(err),
              cudaGetErrorString(err));
  const auto d = lb.failure();
  if (!d) {
    std::printf("FAIL: no diagnostic was recorded\n");
    return 1;
  }
  std::printf("diagnostic: %s\n", plan::describe_failure(*d, kTimeout).c_str());
  const plan::FailureKind want =
      plan::flag_in_data(protocol) ? plan::FailureKind::kLLTimeout : plan::FailureKind::kTimeout;
  bool ok = err != cudaSuccess && d->kind == static_cast<uint32_t>(want) && d->rank == 0 &&
            d->peer == 1 && d->gen_expected == kGen + 1 && s >= 0.9 * kTimeout;
  if (plan::flag_in_data(protocol)) {
    // The LL slot (lamport: its header) rank 1 writes in rank 0's memory; the tag expected is
    // this call's, and what was seen is the empty word (nothing of this call arrived).
    const uint32_t tag = plan::ll_tag(kGen + 1, 1024, plan::call_signature(DType::kBF16, tactic));
    ok = ok && d->flag_owner == 0 && d->peer_signature == tag &&
         static_cast<uint32_t>(d->gen_seen) != tag;
  }
  std::printf(
      "%s: expected kind %s timeout, rank 0, peer 1, generation expected %llu, after >= "
      "%.1f s\n",
      ok ? "PASS" : "FAIL", std::string(plan::protocol_name(protocol)).c_str(),
      static_cast<unsigned long long>(kGen + 1), 0.9 * kTimeout);
  return ok ? 0 : 1;
}

// Ranks 0 and 1 launched separately (two streams, so they run at once) with different dtypes:
// whoever looks first must report the disagreement instead of reducing garbage. Flag: the
// flag's signature differs; LL: the tag of the peer's data names another call.
int mismatch_test(Protocol protocol) {
  constexpr uint64_t kGen = 7;
  CudaLoopback lb(plan::make_layout(1024, 2, 4), 0, kGen, 5.0, pdl_requested());
  const plan::Tactic tactic = two_rank_tactic(protocol, 1);
  const int id = lb.add_schedule(two_rank_schedule(tactic));
  Buffers buf(2, 1024 * 4);
  cudaStream_t other = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking));
  const uint32_t sig_bf16 = plan::call_signature(DType::kBF16, tactic);
  const uint32_t sig_fp16 = plan::call_signature(DType::kFP16, tactic);
  lb.launch(id, DType::kBF16, tactic, buf.inputs(), buf.outputs(), 1024, sig_bf16, buf.stream, 0,
            1);
  lb.launch(id, DType::kFP16, tactic, buf.inputs(), buf.outputs(), 1024, sig_fp16, other, 1, 1);
  const cudaError_t err = cudaStreamSynchronize(buf.stream);
  cudaStreamSynchronize(other);
  std::printf("kernels ended with %s (%s)\n", cudaGetErrorName(err), cudaGetErrorString(err));
  const auto d = lb.failure();
  if (!d) {
    std::printf("FAIL: no diagnostic was recorded\n");
    return 1;
  }
  std::printf("diagnostic: %s\n", plan::describe_failure(*d, 5.0).c_str());
  bool ok = err != cudaSuccess && d->gen_expected == kGen + 1 && d->numel == 1024;
  if (protocol == Protocol::kFlag) {
    const bool pair_ok =
        (d->rank == 0 && d->peer == 1 && d->signature == sig_bf16 &&
         d->peer_signature == sig_fp16) ||
        (d->rank == 1 && d->peer == 0 && d->signature == sig_fp16 && d->peer_signature == sig_bf16);
    ok = ok && d->kind == static_cast<uint32_t>(plan::FailureKind::kMismatch) && pair_ok &&
         d->peer_numel == 1024;
  } else {
    // make_ll_diagnostic: gen_seen is the tag seen (the peer's call), peer_signature the tag
    // this rank expected.
    const uint32_t tag_bf16 = plan::ll_tag(kGen + 1, 1024, sig_bf16);
    const uint32_t tag_fp16 = plan::ll_tag(kGen + 1, 1024, sig_fp16);
    const bool pair_ok =
        (d->rank == 0 && d->peer == 1 && d->signature == sig_bf16 &&
         d->peer_signature == tag_bf16 && static_cast<uint32_t>(d->gen_seen) == tag_fp16) ||
        (d->rank == 1 && d->peer == 0 && d->signature == sig_fp16 &&
         d->peer_signature == tag_fp16 && static_cast<uint32_t>(d->gen_seen) == tag_bf16);
    ok = ok && d->kind == static_cast<uint32_t>(plan::FailureKind::kLLMismatch) && pair_ok;
  }
  std::printf("%s: expected kind %s mismatch between ranks 0 and 1 (signatures 0x%08x / 0x%08x)\n",
              ok ? "PASS" : "FAIL", std::string(plan::protocol_name(protocol)).c_str(), sig_bf16,
              sig_fp16);
  return ok ? 0 : 1;
}

void print_device() {
  int device = 0;
  CHECK_CUDA(cudaGetDevice(&device));
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, device));
  int driver = 0, runtime = 0;
  CHECK_CUDA(cudaDriverGetVersion(&driver));
  CHECK_CUDA(cudaRuntimeGetVersion(&runtime));
  std::printf("device %d: %s, sm_%d%d, %d SMs, driver %d, runtime %d\n", device, prop.name,
              prop.major, prop.minor, prop.multiProcessorCount, driver, runtime);
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  bool latency = true;
  bool hostmem_only = false;
  bool worlds_given = false;
  std::vector<int> worlds = {2, 4, 8};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    try {
      if (arg == "--timeout-test") return timeout_test(Protocol::kFlag);
      if (arg == "--mismatch-test") return mismatch_test(Protocol::kFlag);
      if (arg == "--ll-timeout-test") return timeout_test(Protocol::kLL);
      if (arg == "--ll-mismatch-test") return mismatch_test(Protocol::kLL);
      if (arg == "--lamport-timeout-test") return timeout_test(Protocol::kLamport);
      if (arg == "--lamport-mismatch-test") return mismatch_test(Protocol::kLamport);
    } catch (const std::exception& e) {
      std::printf("FAIL: %s\n", e.what());
      return 1;
    }
    if (arg == "--quick") {
      quick = true;
      latency = false;
    } else if (arg == "--no-latency") {
      latency = false;
    } else if (arg == "--hostmem-only") {
      hostmem_only = true;
    } else if (arg.rfind("--world=", 0) == 0) {
      worlds = {std::atoi(arg.c_str() + 8)};
      worlds_given = true;
    } else {
      std::printf(
          "usage: %s [--quick] [--no-latency] [--world=N] [--hostmem-only] | --timeout-test | "
          "--mismatch-test | --ll-timeout-test | --ll-mismatch-test\n",
          argv[0]);
      return 2;
    }
  }
  try {
    pcie_ar::transport::require_device(0);
    print_device();
    std::vector<std::string> latency_table;
    std::vector<std::string> host_table;
    if (!hostmem_only) {
      for (int world : worlds) run_world(world, quick, latency, latency_table);
      if (latency) {
        for (int world : worlds) run_world_host_mapped(world, host_table);
      }
    }
    if (!latency_table.empty()) {
      std::printf(
          "\n==== latency (loopback on one GPU: kernel + protocol overhead, not PCIe) ====");
      for (const std::string& line : latency_table) std::printf("%s\n", line.c_str());
    }
    if (!host_table.empty()) {
      std::printf(
          "\n==== latency, virtual rank 0's workspace in mapped host memory (its flags, LL "
          "slots and incoming data cross PCIe) ====");
      for (const std::string& line : host_table) std::printf("%s\n", line.c_str());
    }
    // Every workspace in host memory (the cuda_host placement), after the tables above are
    // printed (a trap here ends the process): not in --quick runs unless asked for; world 8's
    // latency table (the slowest) only with --world=8.
    std::vector<std::string> hostmem_table;
    if (!quick || hostmem_only) {
      std::fflush(stdout);
      for (int world : worlds) {
        try {
          run_world_hostmem(world, latency && (world <= 4 || worlds_given), hostmem_table);
        } catch (const std::exception& e) {  // a CUDA error exits in CHECK_CUDA instead
          std::printf("FATAL (world %d, every workspace in host memory): %s\n", world, e.what());
          tally("world " + std::to_string(world) + " hostmem | fatal exception").fail++;
        }
      }
    }
    if (!hostmem_table.empty()) {
      std::printf(
          "\n==== latency, every workspace in mapped host memory (the cuda_host transport's "
          "placement: all flags, LL words and data cross PCIe) ====");
      for (const std::string& line : hostmem_table) std::printf("%s\n", line.c_str());
    }
  } catch (const std::exception& e) {
    std::printf("FATAL: %s\n", e.what());
    tally("fatal exception").fail++;
  }
  return print_summary() == 0 ? 0 : 1;
}
