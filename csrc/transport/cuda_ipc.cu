// How the CUDA IPC transport sets up slabs, uploads programs, checks launches and picks one of
// the six executor instantiations (dtype × direction). See cuda_ipc.h for what it guarantees.
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "transport/cuda_ipc.h"
#include "transport/kernels/executor.cuh"

namespace pcie_ar::transport {
namespace {

std::string cuda_error_text(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

void check(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) throw std::runtime_error(what + " failed (" + cuda_error_text(err) + ")");
}

std::string str(int64_t v) { return std::to_string(v); }

// Makes `device` current for a scope and restores the caller's device: the torch layer owns the
// current device, we only borrow it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice(" + str(device) + ")");
  }
  ~DeviceGuard() {
    int current = previous_;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

using Kernel = void (*)(LaunchParams);

Kernel kernel_for(plan::DType dtype, plan::Direction direction) {
  using plan::Direction;
  const bool push = direction == Direction::kPush;
  switch (dtype) {
    case plan::DType::kBF16:
      return push ? kernels::executor_kernel<__nv_bfloat16, Direction::kPush>
                  : kernels::executor_kernel<__nv_bfloat16, Direction::kPull>;
    case plan::DType::kFP16:
      return push ? kernels::executor_kernel<__half, Direction::kPush>
                  : kernels::executor_kernel<__half, Direction::kPull>;
    case plan::DType::kFP32:
      return push ? kernels::executor_kernel<float, Direction::kPush>
                  : kernels::executor_kernel<float, Direction::kPull>;
  }
  throw std::invalid_argument("unknown dtype code " + str(static_cast<int>(dtype)));
}

int resident_per_sm(plan::DType dtype, plan::Direction direction, int threads) {
  int per_sm = 0;
  check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &per_sm, reinterpret_cast<const void*>(kernel_for(dtype, direction)), threads, 0),
        "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
  return per_sm;
}

ResidencyTable measure_residency(int device) {
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute(MultiProcessorCount)");
  ResidencyTable table;
  for (plan::DType dtype : plan::kAllDTypes) {
    for (plan::Direction dir : {plan::Direction::kPush, plan::Direction::kPull}) {
      for (int t = kWarpThreads; t <= kMaxThreads; t += kWarpThreads) {
        table.ctas[static_cast<int>(dtype)][static_cast<int>(dir)][t / kWarpThreads - 1] =
            sms * resident_per_sm(dtype, dir, t);
      }
    }
  }
  return table;
}

// Enqueues the executor; capture-safe (cudaLaunchKernel is a stream operation).
void launch_kernel(const LaunchParams& p, cudaStream_t stream) {
  void* args[] = {const_cast<LaunchParams*>(&p)};
  check(cudaLaunchKernel(reinterpret_cast<const void*>(kernel_for(p.dtype, p.direction)),
                         dim3(p.blocks, p.ranks_in_launch), dim3(p.threads), args, 0, stream),
        "launching the all-reduce executor (" + std::string(plan::dtype_name(p.dtype)) + ", " +
            std::string(plan::direction_name(p.direction)) + ", grid " + str(p.blocks) + "x" +
            str(p.ranks_in_launch) + ", " + str(p.threads) + " threads)");
}

// A fresh slab: counters and flags at initial_gen (the first call expects initial_gen + 1),
// data zeroed so nothing stale from a previous owner of the memory can be reduced.
uint8_t* allocate_slab(const plan::Layout& layout, uint32_t initial_gen) {
  uint8_t* slab = nullptr;
  check(cudaMalloc(&slab, layout.total_bytes), "cudaMalloc of the " +
                                                   str(static_cast<int64_t>(layout.total_bytes)) +
                                                   "-byte all-reduce workspace");
  try {
    std::vector<uint8_t> control(layout.control_bytes);
    plan::initialize_control(control.data(), layout, initial_gen);
    check(cudaMemcpy(slab, control.data(), control.size(), cudaMemcpyHostToDevice),
          "initialising the workspace control area");
    check(cudaMemset(slab + layout.control_bytes, 0, layout.total_bytes - layout.control_bytes),
          "zeroing the workspace data slots");
  } catch (...) {
    cudaFree(slab);
    throw;
  }
  return slab;
}

// Mapped host memory the kernel writes a Diagnostic into; readable after the context dies.
plan::Diagnostic* allocate_diag(plan::Diagnostic** device_view) {
  void* host = nullptr;
  check(cudaHostAlloc(&host, sizeof(plan::Diagnostic), cudaHostAllocMapped),
        "cudaHostAlloc of the failure record");
  std::memset(host, 0, sizeof(plan::Diagnostic));
  void* device = nullptr;
  const cudaError_t err = cudaHostGetDevicePointer(&device, host, 0);
  if (err != cudaSuccess) {
    cudaFreeHost(host);
    check(err, "cudaHostGetDevicePointer of the failure record");
  }
  *device_view = static_cast<plan::Diagnostic*>(device);
  return static_cast<plan::Diagnostic*>(host);
}

uint32_t* allocate_claim() {
  uint32_t* claim = nullptr;
  check(cudaMalloc(&claim, sizeof(uint32_t)), "cudaMalloc of the failure claim word");
  const cudaError_t err = cudaMemset(claim, 0, sizeof(uint32_t));
  if (err != cudaSuccess) {
    cudaFree(claim);
    check(err, "zeroing the failure claim word");
  }
  return claim;
}

const plan::Program* upload_program(const plan::Program& program) {
  plan::Program* device = nullptr;
  check(cudaMalloc(&device, sizeof(plan::Program)), "cudaMalloc of a step list");
  const cudaError_t err =
      cudaMemcpy(device, &program, sizeof(plan::Program), cudaMemcpyHostToDevice);
  if (err != cudaSuccess) {
    cudaFree(device);
    check(err, "uploading a step list");
  }
  return device;
}

std::optional<plan::Diagnostic> read_diag(const plan::Diagnostic* host) {
  if (host == nullptr) return std::nullopt;
  const volatile plan::Diagnostic* record = host;
  if (record->kind == static_cast<uint32_t>(plan::FailureKind::kNone)) return std::nullopt;
  plan::Diagnostic copy;
  const volatile uint32_t* words = reinterpret_cast<const volatile uint32_t*>(record);
  uint32_t* out = reinterpret_cast<uint32_t*>(&copy);
  for (size_t i = 0; i < sizeof(plan::Diagnostic) / sizeof(uint32_t); ++i) out[i] = words[i];
  return copy;
}

void check_layout(const plan::Layout& layout) {
  if (layout.world < 2 || layout.world > plan::kMaxWorld || layout.max_blocks < 1 ||
      layout.total_bytes == 0 || layout.num_slots < plan::num_slots_for(layout.world) ||
      layout.num_flags < plan::num_flags_for(layout.world)) {
    throw std::invalid_argument(
        "the workspace layout is not one plan::make_layout() produces (world " + str(layout.world) +
        ", max_blocks " + str(layout.max_blocks) + ", " +
        str(static_cast<int64_t>(layout.total_bytes)) + " bytes)");
  }
}

bool aligned16(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; }

// Words of the P2P probe that rank `src` writes into rank `dst`'s slab: every word differs
// per (nonce, src, dst, index), so a dropped, zeroed or misdirected write cannot pass.
__host__ __device__ uint32_t probe_word(uint32_t nonce, int src, int dst, int i) {
  uint32_t x = nonce ^ (static_cast<uint32_t>(src) * 0x9E3779B1u) ^
               (static_cast<uint32_t>(dst) * 0x85EBCA77u) ^
               (static_cast<uint32_t>(i) * 0xC2B2AE3Du);
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

constexpr int kProbeWords = 32;  // 128 bytes: one aligned line, and slots are never smaller

// Ordinary SM stores into peer memory: the path the all-reduce kernels use.
__global__ void probe_kernel(uint32_t* dst, uint32_t nonce, int src, int dst_rank) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < kProbeWords) dst[i] = probe_word(nonce, src, dst_rank, i);
}

}  // namespace

// ------------------------------------------------------------------ pure host logic

ProgramInfo inspect_program(const plan::Program& program, const plan::Layout& layout) {
  check_layout(layout);
  const int world = layout.world;
  const int rank = program.rank;
  const std::string who = "rank " + str(rank) + "'s program";
  if (program.world != world) {
    throw std::invalid_argument(who + " is for world " + str(program.world) +
                                " but the workspace layout is for world " + str(world));
  }
  if (rank >= world) {
    throw std::invalid_argument(who + ": rank must be below world " + str(world));
  }
  if (program.num_steps < 1 || program.num_steps > plan::kMaxSteps) {
    throw std::invalid_argument(who + " has " + str(program.num_steps) + " steps; expected 1.." +
                                str(plan::kMaxSteps));
  }
  if (program.num_chunks < 1) throw std::invalid_argument(who + " has zero chunks");
  ProgramInfo info;
  info.rank = rank;
  info.world = world;
  info.num_chunks = program.num_chunks;
  info.num_steps = program.num_steps;
  for (int s = 0; s < program.num_steps; ++s) {
    const plan::Step& step = program.steps[s];
    const std::string at = who + ", step " + str(s) + " (" + plan::describe_step(step) + "): ";
    auto check_ref = [&](const plan::BufRef& ref, bool is_dst) {
      switch (ref.space) {
        case plan::Space::kInput:
          if (is_dst) throw std::invalid_argument(at + "writes the caller's input");
          [[fallthrough]];
        case plan::Space::kOutput:
          if (ref.owner != rank) {
            throw std::invalid_argument(at + "names rank " + str(ref.owner) +
                                        "'s input/output; a rank can only touch its own tensors");
          }
          return;
        case plan::Space::kSlot:
          if (ref.owner >= world || ref.slot >= layout.num_slots) {
            throw std::invalid_argument(at + "slot " + str(ref.slot) + " of rank " +
                                        str(ref.owner) + " is outside the layout (" +
                                        str(layout.num_slots) + " slots, world " + str(world) +
                                        ")");
          }
          if (ref.owner != rank) (is_dst ? info.stores_peer_slots : info.loads_peer_slots) = true;
          return;
      }
      throw std::invalid_argument(at + "unknown buffer space " + str(static_cast<int>(ref.space)));
    };
    switch (step.kind) {
      case plan::StepKind::kReduce:
        if (step.chunk >= program.num_chunks) {
          throw std::invalid_argument(at + "chunk " + str(step.chunk) + " of " +
                                      str(program.num_chunks));
        }
        if (step.num_srcs < 1 || step.num_srcs > plan::kMaxSources) {
          throw std::invalid_argument(at + str(step.num_srcs) + " operands; expected 1.." +
                                      str(plan::kMaxSources));
        }
        check_ref(step.dst, true);
        for (int i = 0; i < step.num_srcs; ++i) check_ref(step.srcs[i], false);
        break;
      case plan::StepKind::kSignal:
      case plan::StepKind::kWait:
        if (step.peer >= world || step.flag_owner >= world || step.flag >= layout.num_flags) {
          throw std::invalid_argument(at + "peer " + str(step.peer) + ", flag " + str(step.flag) +
                                      " of rank " + str(step.flag_owner) +
                                      " is outside the layout (" + str(layout.num_flags) +
                                      " flags, world " + str(world) + ")");
        }
        if (step.flag_owner != rank && step.flag_owner != step.peer) {
          throw std::invalid_argument(
              at +
              "the flag must live with this rank or with the step's peer; a third rank's "
              "flag cannot be kept generation-fresh by its owner");
        }
        break;
      default:
        throw std::invalid_argument(at + "unknown step kind " + str(static_cast<int>(step.kind)));
    }
  }
  return info;
}

LaunchParams make_launch_params(const WorkspaceView& workspace, const ProgramSet& programs,
                                plan::DType dtype, const plan::Tactic& tactic,
                                const void* const* inputs, void* const* outputs, int64_t numel,
                                uint32_t signature, int first_rank, int ranks_in_launch) {
  LaunchParams p;
  p.layout = workspace.layout;
  for (int r = 0; r < plan::kMaxWorld; ++r) {
    p.bases[r] = workspace.bases[r];
    p.programs[r] = programs.device[r];
    p.infos[r] = programs.info[r];
  }
  for (int r = first_rank; r >= 0 && r < first_rank + ranks_in_launch && r < plan::kMaxWorld; ++r) {
    p.inputs[r] = inputs[r];
    p.outputs[r] = outputs[r];
  }
  p.diag = workspace.diag;
  p.claim = workspace.claim;
  p.numel = numel;
  p.timeout_ns = workspace.timeout_ns;
  p.signature = signature;
  p.dtype = dtype;
  p.direction = tactic.direction;
  p.blocks = tactic.blocks;
  p.threads = tactic.threads;
  p.first_rank = first_rank;
  p.ranks_in_launch = ranks_in_launch;
  return p;
}

void validate_launch(const LaunchParams& p) {
  auto bad = [](const std::string& what) {
    throw std::invalid_argument("all-reduce launch: " + what);
  };
  const plan::Layout& layout = p.layout;
  if (layout.world < 2 || layout.world > plan::kMaxWorld || layout.max_blocks < 1) {
    bad("layout world " + str(layout.world) + " / max_blocks " + str(layout.max_blocks) +
        " is not a workspace layout (world 2.." + str(plan::kMaxWorld) + ", max_blocks >= 1)");
  }
  const int dtype_code = static_cast<int>(p.dtype);
  if (dtype_code < 0 || dtype_code > static_cast<int>(plan::DType::kFP32)) {
    bad("unknown dtype code " + str(dtype_code));
  }
  if (p.direction != plan::Direction::kPush && p.direction != plan::Direction::kPull) {
    bad("unknown direction code " + str(static_cast<int>(p.direction)));
  }
  if (p.blocks < 1 || p.blocks > layout.max_blocks) {
    bad("blocks must be in 1.." + str(layout.max_blocks) + " (the workspace's max_blocks), got " +
        str(p.blocks));
  }
  if (p.threads < kWarpThreads || p.threads > kMaxThreads || p.threads % kWarpThreads != 0) {
    bad("threads must be a multiple of " + str(kWarpThreads) + " in " + str(kWarpThreads) + ".." +
        str(kMaxThreads) + ", got " + str(p.threads));
  }
  const int elem = plan::dtype_bytes(p.dtype);
  if (elem > layout.elem_bytes) {
    bad(std::string(plan::dtype_name(p.dtype)) + " elements are " + str(elem) +
        " bytes but the workspace holds " + str(layout.elem_bytes) + "-byte elements");
  }
  if (p.numel <= 0) bad("numel must be positive, got " + str(p.numel));
  if (p.numel > layout.max_numel) {
    bad("numel " + str(p.numel) + " exceeds the workspace's max_numel " + str(layout.max_numel));
  }
  if (p.numel * elem % plan::kVectorBytes != 0) {
    bad("the message must be a multiple of " + str(plan::kVectorBytes) + " bytes (" +
        str(plan::kVectorBytes / elem) + " " + std::string(plan::dtype_name(p.dtype)) +
        " elements), got numel " + str(p.numel));
  }
  if (p.first_rank < 0 || p.ranks_in_launch < 1 ||
      p.first_rank + p.ranks_in_launch > layout.world) {
    bad("ranks [" + str(p.first_rank) + ", " + str(p.first_rank + p.ranks_in_launch) +
        ") must be a non-empty range inside world " + str(layout.world));
  }
  for (int r = 0; r < layout.world; ++r) {
    if (p.bases[r] == nullptr || !aligned16(p.bases[r])) {
      bad("rank " + str(r) + "'s workspace base is " +
          (p.bases[r] ? "not 16-byte aligned" : "missing (have the peers been opened?)"));
    }
  }
  if (p.diag == nullptr || p.claim == nullptr) bad("the failure record is missing");
  const int64_t bytes = p.numel * elem;
  for (int r = p.first_rank; r < p.first_rank + p.ranks_in_launch; ++r) {
    const std::string who = "rank " + str(r) + "'s ";
    if (p.inputs[r] == nullptr || !aligned16(p.inputs[r])) {
      bad(who + "input must be a non-null 16-byte aligned pointer, got " +
          (p.inputs[r] ? "a misaligned one" : "null"));
    }
    if (p.outputs[r] == nullptr || !aligned16(p.outputs[r])) {
      bad(who + "output must be a non-null 16-byte aligned pointer, got " +
          (p.outputs[r] ? "a misaligned one" : "null"));
    }
    const auto in = reinterpret_cast<uintptr_t>(p.inputs[r]);
    const auto out = reinterpret_cast<uintptr_t>(p.outputs[r]);
    if (in != out && in < out + bytes && out < in + bytes) {
      bad(who +
          "input and output overlap without being the same buffer; pass the same "
          "pointer for an in-place all-reduce");
    }
    if (p.programs[r] == nullptr) bad(who + "program is missing");
    const ProgramInfo& info = p.infos[r];
    if (info.rank != r) {
      bad(who + "program slot holds rank " + str(info.rank) + "'s program");
    }
    if (info.world != layout.world) {
      bad(who + "program is for world " + str(info.world) + " but the workspace is world " +
          str(layout.world));
    }
    if (info.num_steps < 1 || info.num_steps > plan::kMaxSteps) {
      bad(who + "program has " + str(info.num_steps) + " steps; expected 1.." +
          str(plan::kMaxSteps));
    }
    if (p.direction == plan::Direction::kPush && info.loads_peer_slots) {
      bad(who +
          "program reads a peer's slot but the tactic is push (push kernels read only "
          "local memory); use the pull tactic for this schedule");
    }
  }
}

uint64_t timeout_to_ns(double timeout_s) {
  if (!std::isfinite(timeout_s) || timeout_s < 0) {
    throw std::invalid_argument(
        "the all-reduce timeout must be a finite number of seconds >= 0 "
        "(0 waits forever), got " +
        std::to_string(timeout_s));
  }
  const double ns = timeout_s * 1e9;
  return ns >= 1.8e19 ? 0 : static_cast<uint64_t>(ns);  // beyond 570 years: forever
}

void require_device(int device) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // not sticky: leave no error for the caller's next CUDA call
    throw std::runtime_error(
        "CUDA was requested but no CUDA device is visible (cudaGetDeviceCount: " +
        cuda_error_text(err) + ")");
  }
  if (count == 0) {
    throw std::runtime_error(
        "CUDA was requested but no CUDA device is visible (cudaGetDeviceCount: 0 devices)");
  }
  if (device < 0 || device >= count) {
    throw std::invalid_argument("CUDA device " + str(device) + " does not exist: " + str(count) +
                                " device(s) are visible (check CUDA_VISIBLE_DEVICES and the "
                                "local rank)");
  }
}

// ------------------------------------------------------------------ CudaIpcWorkspace

CudaIpcWorkspace::CudaIpcWorkspace(const plan::Layout& layout, int rank, int device,
                                   uint32_t initial_gen, double timeout_s)
    : rank_(rank), device_(device) {
  require_device(device);
  check_layout(layout);
  if (rank < 0 || rank >= layout.world) {
    throw std::invalid_argument("rank " + str(rank) + " is outside world " + str(layout.world));
  }
  view_.layout = layout;
  view_.timeout_ns = timeout_to_ns(timeout_s);
  DeviceGuard guard(device);
  try {
    slab_ = allocate_slab(layout, initial_gen);
    view_.bases[rank] = slab_;
    diag_host_ = allocate_diag(&view_.diag);
    view_.claim = allocate_claim();
    residency_ = measure_residency(device);
    // Initialisation ran on the legacy stream; callers launch on their own (non-blocking) ones.
    check(cudaDeviceSynchronize(), "initialising the all-reduce workspace");
  } catch (...) {
    try {
      free_slab();
    } catch (...) {
    }
    if (diag_host_ != nullptr) cudaFreeHost(diag_host_);
    throw;
  }
}

CudaIpcWorkspace::~CudaIpcWorkspace() {
  try {
    close_peers();
  } catch (...) {
  }
  try {
    free_slab();
  } catch (...) {
  }
  if (diag_host_ != nullptr) cudaFreeHost(diag_host_);
}

std::vector<uint8_t> CudaIpcWorkspace::export_handle() const {
  if (slab_ == nullptr) throw std::logic_error("export_handle(): the workspace was freed");
  DeviceGuard guard(device_);
  cudaIpcMemHandle_t handle;
  check(cudaIpcGetMemHandle(&handle, slab_), "cudaIpcGetMemHandle");
  const auto* bytes = reinterpret_cast<const uint8_t*>(&handle);
  return std::vector<uint8_t>(bytes, bytes + sizeof(handle));
}

void CudaIpcWorkspace::open_peers(const std::vector<std::vector<uint8_t>>& handles) {
  const int world = view_.layout.world;
  if (static_cast<int>(handles.size()) != world) {
    throw std::invalid_argument("open_peers(): expected one handle per rank (" + str(world) +
                                "), got " + str(static_cast<int64_t>(handles.size())));
  }
  if (peers_open_) throw std::logic_error("open_peers(): the peers are already open");
  if (slab_ == nullptr) throw std::logic_error("open_peers(): the workspace was freed");
  DeviceGuard guard(device_);
  for (int r = 0; r < world; ++r) {
    if (r == rank_) continue;
    try {
      if (handles[r].size() != sizeof(cudaIpcMemHandle_t)) {
        throw std::invalid_argument("open_peers(): rank " + str(r) + "'s handle has " +
                                    str(static_cast<int64_t>(handles[r].size())) +
                                    " bytes; a cudaIpcMemHandle_t has " +
                                    str(sizeof(cudaIpcMemHandle_t)));
      }
      cudaIpcMemHandle_t handle;
      std::memcpy(&handle, handles[r].data(), sizeof(handle));
      void* mapped = nullptr;
      // Lazy peer access: the driver enables P2P for exactly the pairs that map each other.
      check(cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess),
            "cudaIpcOpenMemHandle of rank " + str(r) + "'s workspace on rank " + str(rank_));
      opened_[r] = static_cast<uint8_t*>(mapped);
      view_.bases[r] = opened_[r];
    } catch (...) {
      try {
        close_peers();
      } catch (...) {
      }
      throw;
    }
  }
  peers_open_ = true;
}

void CudaIpcWorkspace::close_peers() {
  std::string errors;
  DeviceGuard guard(device_);
  for (int r = 0; r < plan::kMaxWorld; ++r) {
    if (opened_[r] == nullptr) continue;
    const cudaError_t err = cudaIpcCloseMemHandle(opened_[r]);
    if (err != cudaSuccess) errors += " rank " + str(r) + ": " + cuda_error_text(err) + ";";
    opened_[r] = nullptr;
    view_.bases[r] = nullptr;
  }
  peers_open_ = false;
  if (!errors.empty())
    throw std::runtime_error("close_peers(): cudaIpcCloseMemHandle failed:" + errors);
}

void CudaIpcWorkspace::free_slab() {
  std::string errors;
  DeviceGuard guard(device_);
  auto release = [&](void* ptr, const char* what) {
    if (ptr == nullptr) return;
    const cudaError_t err = cudaFree(ptr);
    if (err != cudaSuccess) errors += std::string(" ") + what + ": " + cuda_error_text(err) + ";";
  };
  for (ProgramSet& set : programs_) {
    release(const_cast<plan::Program*>(set.device[rank_]), "step list");
    set.device[rank_] = nullptr;
  }
  release(view_.claim, "claim word");
  view_.claim = nullptr;
  release(slab_, "workspace");
  slab_ = nullptr;
  view_.bases[rank_] = nullptr;
  if (!errors.empty()) throw std::runtime_error("free_slab(): cudaFree failed:" + errors);
}

int CudaIpcWorkspace::add_program(const plan::Program& program) {
  if (program.rank != rank_) {
    throw std::invalid_argument("add_program(): the program is rank " + str(program.rank) +
                                "'s, this workspace is rank " + str(rank_) + "'s");
  }
  if (slab_ == nullptr) throw std::logic_error("add_program(): the workspace was freed");
  ProgramSet set;
  set.info[rank_] = inspect_program(program, view_.layout);
  DeviceGuard guard(device_);
  set.device[rank_] = upload_program(program);
  programs_.push_back(set);
  return static_cast<int>(programs_.size()) - 1;
}

void CudaIpcWorkspace::launch(int program_id, plan::DType dtype, const plan::Tactic& tactic,
                              const void* input, void* output, int64_t numel, uint32_t signature,
                              cudaStream_t stream) {
  if (program_id < 0 || program_id >= static_cast<int>(programs_.size())) {
    throw std::invalid_argument("launch(): unknown program id " + str(program_id));
  }
  if (slab_ == nullptr) throw std::logic_error("launch(): the workspace was freed");
  if (!peers_open_) throw std::logic_error("launch(): open_peers() has not run");
  const void* inputs[plan::kMaxWorld] = {};
  void* outputs[plan::kMaxWorld] = {};
  inputs[rank_] = input;
  outputs[rank_] = output;
  const LaunchParams p = make_launch_params(view_, programs_[program_id], dtype, tactic, inputs,
                                            outputs, numel, signature, rank_, 1);
  validate_launch(p);
  // Peers' CTA b waits for ours: a CTA that never becomes resident would stall them.
  const int resident = residency_.at(dtype, tactic.direction, tactic.threads);
  if (tactic.blocks > resident) {
    throw std::invalid_argument("launch(): " + str(tactic.blocks) + " blocks of " +
                                str(tactic.threads) +
                                " threads do not fit on the GPU at once "
                                "(at most " +
                                str(resident) + ")");
  }
  DeviceGuard guard(device_);
  launch_kernel(p, stream);
}

std::optional<plan::Diagnostic> CudaIpcWorkspace::failure() const { return read_diag(diag_host_); }

void CudaIpcWorkspace::probe_write(uint32_t nonce) {
  if (!peers_open_) throw std::logic_error("probe_write(): open_peers() has not run");
  DeviceGuard guard(device_);
  const plan::Layout& l = view_.layout;
  for (int p = 0; p < l.world; ++p) {
    if (p == rank_) continue;
    auto* dst =
        reinterpret_cast<uint32_t*>(view_.bases[p] + l.slot_offset(0, plan::slot_from_rank(rank_)));
    probe_kernel<<<1, kProbeWords>>>(dst, nonce, rank_, p);
    check(cudaGetLastError(), "launching the P2P probe to rank " + str(p));
  }
  check(cudaDeviceSynchronize(), "the P2P probe writes from rank " + str(rank_));
}

std::vector<int> CudaIpcWorkspace::probe_read(uint32_t nonce) const {
  DeviceGuard guard(device_);
  const plan::Layout& l = view_.layout;
  std::vector<int> failed;
  for (int q = 0; q < l.world; ++q) {
    if (q == rank_) continue;
    uint32_t words[kProbeWords];
    check(cudaMemcpy(words, slab_ + l.slot_offset(0, plan::slot_from_rank(q)), sizeof(words),
                     cudaMemcpyDeviceToHost),
          "reading the P2P probe from rank " + str(q));
    for (int i = 0; i < kProbeWords; ++i) {
      if (words[i] != probe_word(nonce, q, rank_, i)) {
        failed.push_back(q);
        break;
      }
    }
  }
  return failed;
}

// ------------------------------------------------------------------ CudaLoopback

CudaLoopback::CudaLoopback(const plan::Layout& layout, int device, uint32_t initial_gen,
                           double timeout_s)
    : device_(device) {
  require_device(device);
  check_layout(layout);
  view_.layout = layout;
  view_.timeout_ns = timeout_to_ns(timeout_s);
  DeviceGuard guard(device);
  try {
    for (int r = 0; r < layout.world; ++r) {
      slabs_[r] = allocate_slab(layout, initial_gen);
      view_.bases[r] = slabs_[r];
    }
    diag_host_ = allocate_diag(&view_.diag);
    view_.claim = allocate_claim();
    residency_ = measure_residency(device);
    check(cudaDeviceSynchronize(), "initialising the loopback workspaces");
  } catch (...) {
    for (uint8_t*& slab : slabs_) {
      if (slab != nullptr) cudaFree(slab);
      slab = nullptr;
    }
    if (view_.claim != nullptr) cudaFree(view_.claim);
    if (diag_host_ != nullptr) cudaFreeHost(diag_host_);
    throw;
  }
}

CudaLoopback::~CudaLoopback() {
  int previous = 0;
  const bool restore = cudaGetDevice(&previous) == cudaSuccess;
  cudaSetDevice(device_);
  for (Uploaded& up : schedules_) {
    for (const plan::Program* program : up.programs.device) {
      if (program != nullptr) cudaFree(const_cast<plan::Program*>(program));
    }
  }
  for (uint8_t* slab : slabs_) {
    if (slab != nullptr) cudaFree(slab);
  }
  if (view_.claim != nullptr) cudaFree(view_.claim);
  if (diag_host_ != nullptr) cudaFreeHost(diag_host_);
  if (restore) cudaSetDevice(previous);
}

int CudaLoopback::add_schedule(const plan::Schedule& schedule) {
  const int world = view_.layout.world;
  if (schedule.world != world) {
    throw std::invalid_argument("add_schedule(): the schedule is for world " + str(schedule.world) +
                                ", the loopback workspace for world " + str(world));
  }
  Uploaded up;
  up.schedule = schedule;
  std::vector<plan::Program> programs;
  for (int r = 0; r < world; ++r) {
    programs.push_back(plan::encode_program(schedule, r));
    up.programs.info[r] = inspect_program(programs.back(), view_.layout);
  }
  DeviceGuard guard(device_);
  try {
    for (int r = 0; r < world; ++r) up.programs.device[r] = upload_program(programs[r]);
  } catch (...) {
    for (const plan::Program* program : up.programs.device) {
      if (program != nullptr) cudaFree(const_cast<plan::Program*>(program));
    }
    throw;
  }
  schedules_.push_back(std::move(up));
  return static_cast<int>(schedules_.size()) - 1;
}

int CudaLoopback::max_resident_blocks(plan::DType dtype, plan::Direction direction,
                                      int threads) const {
  if (threads < kWarpThreads || threads > kMaxThreads || threads % kWarpThreads != 0) return 0;
  return residency_.at(dtype, direction, threads);
}

void CudaLoopback::launch(int schedule_id, plan::DType dtype, const plan::Tactic& tactic,
                          const std::vector<const void*>& inputs, const std::vector<void*>& outputs,
                          int64_t numel, uint32_t signature, cudaStream_t stream, int first_rank,
                          int count) {
  const int world = view_.layout.world;
  if (schedule_id < 0 || schedule_id >= static_cast<int>(schedules_.size())) {
    throw std::invalid_argument("loopback launch: unknown schedule id " + str(schedule_id));
  }
  const Uploaded& up = schedules_[schedule_id];
  if (tactic.algorithm != up.schedule.algorithm || tactic.direction != up.schedule.direction ||
      tactic.staged != up.schedule.staged) {
    throw std::invalid_argument("loopback launch: the tactic (" + plan::tactic_label(tactic) +
                                ") is not the schedule's algorithm/direction/staging (" +
                                std::string(plan::algorithm_name(up.schedule.algorithm)) + "/" +
                                std::string(plan::direction_name(up.schedule.direction)) +
                                (up.schedule.staged ? "/staged" : "/unstaged") + ")");
  }
  if (static_cast<int>(inputs.size()) != world || static_cast<int>(outputs.size()) != world) {
    throw std::invalid_argument(
        "loopback launch: inputs and outputs must hold one pointer per "
        "rank (" +
        str(world) + "), got " + str(static_cast<int64_t>(inputs.size())) + " and " +
        str(static_cast<int64_t>(outputs.size())));
  }
  if (count < 0) count = world - first_rank;
  if (first_rank < 0 || count < 1 || first_rank + count > world) {
    throw std::invalid_argument("loopback launch: ranks [" + str(first_rank) + ", " +
                                str(first_rank + count) +
                                ") must be a non-empty range inside "
                                "world " +
                                str(world));
  }
  const LaunchParams p = make_launch_params(view_, up.programs, dtype, tactic, inputs.data(),
                                            outputs.data(), numel, signature, first_rank, count);
  validate_launch(p);
  const int resident = max_resident_blocks(dtype, tactic.direction, tactic.threads);
  if (tactic.blocks * count > resident) {
    throw std::runtime_error("loopback launch: " + str(tactic.blocks) + " blocks x " + str(count) +
                             " ranks = " + str(tactic.blocks * count) +
                             " CTAs must all be resident at once (they wait on each "
                             "other), but this GPU holds at most " +
                             str(resident) + " CTAs of " + str(tactic.threads) +
                             " threads; use fewer blocks or threads");
  }
  DeviceGuard guard(device_);
  launch_kernel(p, stream);
}

std::optional<plan::Diagnostic> CudaLoopback::failure() const { return read_diag(diag_host_); }

}  // namespace pcie_ar::transport
