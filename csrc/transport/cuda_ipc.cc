// How the CUDA IPC transport sets up slabs, uploads programs and launches the executor: plain
// C++ over the CUDA runtime API. The kernels and the launch calls that need their symbols are
// kernels/launch.cu. See cuda_ipc.h for what it guarantees.
#include "transport/cuda_ipc.h"

#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

#include "plan/program_check.h"
#include "transport/cuda_util.h"

namespace pcie_ar::transport {
namespace {

std::string str(int64_t v) { return std::to_string(v); }

ResidencyTable measure_residency(int device) {
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute(MultiProcessorCount)");
  ResidencyTable table;
  for (plan::DType dtype : plan::kAllDTypes) {
    for (plan::Direction dir : {plan::Direction::kPush, plan::Direction::kPull}) {
      for (int t = kWarpThreads; t <= kMaxThreads; t += kWarpThreads) {
        table.ctas[static_cast<int>(dtype)][static_cast<int>(dir)][t / kWarpThreads - 1] =
            sms * executor_ctas_per_sm(dtype, dir, t);
      }
    }
  }
  return table;
}

// Counters and flags at initial_gen (the first call expects initial_gen + 1), every LL word
// tagged stale, data zeroed so nothing stale from a previous owner of the memory can be reduced.
// `slab` is any device-addressable memory of layout.total_bytes.
void initialize_slab(uint8_t* slab, const plan::Layout& layout, uint64_t initial_gen) {
  std::vector<uint8_t> control(layout.control_bytes);
  plan::initialize_control(control.data(), layout, initial_gen);
  check(cudaMemcpy(slab, control.data(), control.size(), cudaMemcpyHostToDevice),
        "initialising the workspace control area");
  check(cudaMemset(slab + layout.control_bytes, 0, layout.total_bytes - layout.control_bytes),
        "zeroing the workspace data slots");
}

uint8_t* allocate_slab(const plan::Layout& layout, uint64_t initial_gen) {
  uint8_t* slab = nullptr;
  check(cudaMalloc(&slab, layout.total_bytes), "cudaMalloc of the " +
                                                   str(static_cast<int64_t>(layout.total_bytes)) +
                                                   "-byte all-reduce workspace");
  try {
    initialize_slab(slab, layout, initial_gen);
  } catch (...) {
    cudaFree(slab);
    throw;
  }
  return slab;
}

// Mapped host memory the kernel writes a Diagnostic into; readable after the context dies.
// `bytes` of mapped pinned host memory (free with cudaFreeHost); *device_view is its address
// for kernels.
void* allocate_mapped(uint64_t bytes, void** device_view, const std::string& what) {
  void* host = nullptr;
  check(cudaHostAlloc(&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable),
        "cudaHostAlloc of " + what);
  const cudaError_t err = cudaHostGetDevicePointer(device_view, host, 0);
  if (err != cudaSuccess) {
    cudaFreeHost(host);
    check(err, "cudaHostGetDevicePointer of " + what);
  }
  return host;
}

plan::Diagnostic* allocate_diag(plan::Diagnostic** device_view) {
  void* device = nullptr;
  void* host = allocate_mapped(sizeof(plan::Diagnostic), &device, "the failure record");
  std::memset(host, 0, sizeof(plan::Diagnostic));
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

}  // namespace

uint8_t* allocate_device_counters(const plan::Layout& layout, uint64_t initial_gen) {
  std::vector<uint8_t> control(layout.control_bytes);
  plan::initialize_control(control.data(), layout, initial_gen);
  const uint64_t bytes = layout.gen_counter_offset(layout.max_blocks);
  uint8_t* counters = nullptr;
  check(cudaMalloc(&counters, bytes), "cudaMalloc of the generation counters");
  const cudaError_t err = cudaMemcpy(counters, control.data(), bytes, cudaMemcpyHostToDevice);
  if (err != cudaSuccess) {
    cudaFree(counters);
    check(err, "initialising the generation counters");
  }
  return counters;
}

// ------------------------------------------------------------------ pure host logic

LaunchParams make_launch_params(const WorkspaceView& workspace, const ProgramSet& programs,
                                plan::DType dtype, int blocks, int threads,
                                const void* const* inputs, void* const* outputs, int64_t numel,
                                uint32_t signature, int first_rank, int ranks_in_launch) {
  LaunchParams p;
  p.layout = workspace.layout;
  for (int r = 0; r < plan::kMaxWorld; ++r) {
    p.bases[r] = workspace.bases[r];
    p.counters[r] = workspace.counters[r] != nullptr ? workspace.counters[r] : workspace.bases[r];
    p.programs[r] = programs.device[r];
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
  p.direction = programs.direction;
  p.blocks = blocks;
  p.threads = threads;
  p.first_rank = first_rank;
  p.ranks_in_launch = ranks_in_launch;
  p.pdl = workspace.pdl;
  p.slots_in_host_memory = workspace.slots_in_host_memory;
  return p;
}

std::optional<std::string> why_kernels_cannot_run(const plan::Tactic& tactic, int ctas,
                                                  const ResidencyTable& residency) {
  if (tactic.threads < kWarpThreads || tactic.threads > kMaxThreads ||
      tactic.threads % kWarpThreads != 0) {
    return "threads must be a multiple of " + str(kWarpThreads) + " in " + str(kWarpThreads) +
           ".." + str(kMaxThreads) + ", got " + str(tactic.threads);
  }
  for (plan::DType dtype : plan::kAllDTypes) {
    const int resident = residency.at(dtype, tactic.direction, tactic.threads);
    if (ctas > resident) {
      return str(ctas) + " CTAs of " + str(tactic.threads) +
             " threads do not fit on the GPU at once (at most " + str(resident) + " for " +
             std::string(plan::dtype_name(dtype)) + ")";
    }
  }
  return std::nullopt;
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

bool pdl_enabled(int device) {
  int major = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
        "cudaDeviceGetAttribute(ComputeCapabilityMajor)");
  return major >= 9 && executor_waits_for_previous_grid();
}

bool use_pdl(bool requested, int device) { return requested && pdl_enabled(device); }

// ------------------------------------------------------------------ StreamOrder

namespace {

bool capturing(cudaStream_t stream, bool* known) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(stream, &status);
  *known = err == cudaSuccess;
  if (!*known) cudaGetLastError();  // not sticky; leave nothing for the caller's next call
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace

StreamOrder::~StreamOrder() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}

void StreamOrder::before_call(cudaStream_t stream) {
  if (have_last_ && stream == last_) return;  // the common case costs nothing
  bool known = false;
  // A captured call is not ordered, and does not count as the last eager call.
  if (capturing(stream, &known) || !known) return;
  if (have_last_) {
    // Recording into a stream that is capturing now would join its graph; skip it then.
    const bool last_capturing = capturing(last_, &known);
    if (known && !last_capturing) {
      if (event_ == nullptr) {
        check(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming),
              "creating the all-reduce stream-order event");
      }
      check(cudaEventRecord(event_, last_), "recording the previous all-reduce stream");
      check(cudaStreamWaitEvent(stream, event_, 0),
            "ordering the all-reduce after the previous stream's calls");
    }
  }
  last_ = stream;
  have_last_ = true;
}

// ------------------------------------------------------------------ CudaKernelWorkspace

CudaKernelWorkspace::CudaKernelWorkspace(const plan::Layout& layout, int rank, int device,
                                         double timeout_s, bool pdl)
    : Workspace(layout, rank), device_(device) {
  require_device(device);
  plan::check_layout(layout);
  if (rank < 0 || rank >= layout.world) {
    throw std::invalid_argument("rank " + str(rank) + " is outside world " + str(layout.world));
  }
  view_.layout = layout;
  view_.timeout_ns = timeout_to_ns(timeout_s);
  DeviceGuard guard(device);
  try {
    diag_host_ = allocate_diag(&view_.diag);
    view_.claim = allocate_claim();
    residency_ = measure_residency(device);
    view_.pdl = use_pdl(pdl, device);
  } catch (...) {
    if (view_.claim != nullptr) cudaFree(view_.claim);
    if (diag_host_ != nullptr) cudaFreeHost(diag_host_);
    throw;
  }
}

CudaKernelWorkspace::~CudaKernelWorkspace() {
  try {
    std::string ignored;
    DeviceGuard guard(device_);
    release_kernel_state(ignored);
  } catch (...) {
  }
  if (diag_host_ != nullptr) cudaFreeHost(diag_host_);
}

void CudaKernelWorkspace::teardown() noexcept {
  try {
    close_peers();
  } catch (...) {
  }
  try {
    release();
  } catch (...) {
  }
}

void CudaKernelWorkspace::release() {
  std::string errors;
  DeviceGuard guard(device_);
  release_kernel_state(errors);
  release_memory(errors);
  view_.bases[rank()] = nullptr;
  view_.counters[rank()] = nullptr;
  if (!errors.empty()) throw std::runtime_error("release():" + errors);
}

void CudaKernelWorkspace::release_kernel_state(std::string& errors) {
  auto free_one = [&](void* ptr, const char* what) {
    if (ptr == nullptr) return;
    const cudaError_t err = cudaFree(ptr);
    if (err != cudaSuccess) errors += std::string(" ") + what + ": " + cuda_error_text(err) + ";";
  };
  for (ProgramSet& set : programs_) {
    free_one(const_cast<plan::Program*>(set.device[rank()]), "step list");
    set.device[rank()] = nullptr;
  }
  free_one(view_.claim, "claim word");
  view_.claim = nullptr;
}

int CudaKernelWorkspace::install(const plan::Program& program) {
  if (view_.bases[rank()] == nullptr || view_.claim == nullptr) {
    throw std::logic_error("add_program(): the workspace was freed");
  }
  // The kernels sit at their register budget; a second store pointer in the reduce loop
  // spills at eight operands, so fused schedules (plan::fuse_forwarding_copies) are host-only.
  for (int i = 0; i < program.num_steps; ++i) {
    if (program.steps[i].num_dsts != 1) {
      throw std::invalid_argument("rank " + std::to_string(rank()) + "'s program, step " +
                                  std::to_string(i) +
                                  ": the CUDA executor writes one destination per step; run the "
                                  "schedule unfused");
    }
  }
  ProgramSet set;
  set.direction = program.direction;
  DeviceGuard guard(device_);
  set.device[rank()] = upload_program(program);
  programs_.push_back(set);
  return static_cast<int>(programs_.size()) - 1;
}

std::optional<std::string> CudaKernelWorkspace::transport_limits(const plan::Tactic& tactic) const {
  return why_kernels_cannot_run(tactic, tactic.blocks, residency_);
}

void CudaKernelWorkspace::run(const Call& call) {
  const void* inputs[plan::kMaxWorld] = {};
  void* outputs[plan::kMaxWorld] = {};
  inputs[rank()] = call.input;
  outputs[rank()] = call.output;
  const LaunchParams p =
      make_launch_params(view_, programs_[call.program], call.dtype, call.blocks, call.threads,
                         inputs, outputs, call.numel, call.signature, rank(), 1);
  DeviceGuard guard(device_);
  const auto stream = static_cast<cudaStream_t>(call.stream);
  order_.before_call(stream);
  if (!launch_executor(p, stream)) view_.pdl = false;  // refused: launched plainly, stay plain
}

std::optional<plan::Diagnostic> CudaKernelWorkspace::failure() const {
  return read_diag(diag_host_);
}

void CudaKernelWorkspace::probe_write(uint32_t nonce) {
  if (!peers_open_) throw std::logic_error("probe_write(): open_peers() has not run");
  DeviceGuard guard(device_);
  const plan::Layout& l = view_.layout;
  for (int p = 0; p < l.world; ++p) {
    if (p == rank()) continue;
    auto* dst = reinterpret_cast<uint32_t*>(view_.bases[p] +
                                            l.slot_offset(0, plan::slot_from_rank(rank())));
    check(launch_probe(dst, nonce, rank(), p), "launching the P2P probe to rank " + str(p));
  }
  check(cudaDeviceSynchronize(), "the P2P probe writes from rank " + str(rank()));
}

std::vector<int> CudaKernelWorkspace::probe_read(uint32_t nonce) const {
  if (view_.bases[rank()] == nullptr)
    throw std::logic_error("probe_read(): the workspace was freed");
  DeviceGuard guard(device_);
  const plan::Layout& l = view_.layout;
  std::vector<int> failed;
  for (int q = 0; q < l.world; ++q) {
    if (q == rank()) continue;
    uint32_t words[kProbeWords];
    // cudaMemcpyDefault: the slab is device memory (cuda_ipc) or mapped host memory (cuda_host).
    check(cudaMemcpy(words, view_.bases[rank()] + l.slot_offset(0, plan::slot_from_rank(q)),
                     sizeof(words), cudaMemcpyDefault),
          "reading the P2P probe from rank " + str(q));
    for (int i = 0; i < kProbeWords; ++i) {
      if (words[i] != probe_word(nonce, q, rank(), i)) {
        failed.push_back(q);
        break;
      }
    }
  }
  return failed;
}

// ------------------------------------------------------------------ CudaIpcWorkspace

CudaIpcWorkspace::CudaIpcWorkspace(const plan::Layout& layout, int rank, int device,
                                   uint64_t initial_gen, double timeout_s, bool pdl)
    : CudaKernelWorkspace(layout, rank, device, timeout_s, pdl) {
  DeviceGuard guard(device);
  slab_ = allocate_slab(layout, initial_gen);
  view_.bases[rank] = slab_;
  // Initialisation ran on the legacy stream; callers launch on their own (non-blocking) ones.
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    cudaFree(slab_);
    check(err, "initialising the all-reduce workspace");
  }
}

CudaIpcWorkspace::~CudaIpcWorkspace() { teardown(); }

std::string CudaIpcWorkspace::local_token() const {
  if (slab_ == nullptr) throw std::logic_error("local_token(): the workspace was freed");
  DeviceGuard guard(device());
  cudaIpcMemHandle_t handle;
  check(cudaIpcGetMemHandle(&handle, slab_), "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

void CudaIpcWorkspace::open_peers(const std::vector<std::string>& tokens) {
  const int world = view_.layout.world;
  if (static_cast<int>(tokens.size()) != world) {
    throw std::invalid_argument("open_peers(): expected one handle per rank (" + str(world) +
                                "), got " + str(static_cast<int64_t>(tokens.size())));
  }
  if (peers_open_) throw std::logic_error("open_peers(): the peers are already open");
  if (slab_ == nullptr) throw std::logic_error("open_peers(): the workspace was freed");
  DeviceGuard guard(device());
  for (int r = 0; r < world; ++r) {
    if (r == rank()) continue;
    try {
      if (tokens[r].size() != sizeof(cudaIpcMemHandle_t)) {
        throw std::invalid_argument("open_peers(): rank " + str(r) + "'s handle has " +
                                    str(static_cast<int64_t>(tokens[r].size())) +
                                    " bytes; a cudaIpcMemHandle_t has " +
                                    str(sizeof(cudaIpcMemHandle_t)));
      }
      cudaIpcMemHandle_t handle;
      std::memcpy(&handle, tokens[r].data(), sizeof(handle));
      void* mapped = nullptr;
      // Lazy peer access: the driver enables P2P for exactly the pairs that map each other.
      check(cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess),
            "cudaIpcOpenMemHandle of rank " + str(r) + "'s workspace on rank " + str(rank()));
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
  DeviceGuard guard(device());
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

void CudaIpcWorkspace::release_memory(std::string& errors) {
  if (slab_ != nullptr) {
    const cudaError_t err = cudaFree(slab_);
    if (err != cudaSuccess) errors += " workspace: " + cuda_error_text(err) + ";";
  }
  slab_ = nullptr;
}

// ------------------------------------------------------------------ CudaLoopback

CudaLoopback::CudaLoopback(const plan::Layout& layout, int device, uint64_t initial_gen,
                           double timeout_s, bool pdl)
    : device_(device), initial_gen_(initial_gen) {
  require_device(device);
  plan::check_layout(layout);
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
    view_.pdl = use_pdl(pdl, device);
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
  for (int r = 0; r < plan::kMaxWorld; ++r) free_slab(r);
  if (view_.claim != nullptr) cudaFree(view_.claim);
  if (diag_host_ != nullptr) cudaFreeHost(diag_host_);
  if (restore) cudaSetDevice(previous);
}

void CudaLoopback::use_external_slab(int rank, uint8_t* slab, uint64_t initial_gen) {
  if (rank < 0 || rank >= view_.layout.world || slab == nullptr) {
    throw std::invalid_argument("use_external_slab(): rank " + str(rank) + " of world " +
                                str(view_.layout.world) + " with a " +
                                (slab == nullptr ? "null" : "non-null") + " slab");
  }
  DeviceGuard guard(device_);
  initialize_slab(slab, view_.layout, initial_gen);
  check(cudaDeviceSynchronize(), "initialising an external loopback workspace");
  free_slab(rank);
  slabs_[rank] = slab;
  slab_kind_[rank] = SlabKind::kCaller;
  view_.bases[rank] = slab;
  view_.slots_in_host_memory = true;  // the caller's slabs are host memory (cuda_ipc.h)
}

void CudaLoopback::use_host_memory() {
  DeviceGuard guard(device_);
  const plan::Layout& layout = view_.layout;
  const uint64_t initial_gen = initial_gen_;
  for (int r = 0; r < layout.world; ++r) {
    if (slab_kind_[r] == SlabKind::kPinned) continue;
    void* device_view = nullptr;
    void* host = allocate_mapped(layout.total_bytes, &device_view, "a loopback workspace");
    auto* slab = static_cast<uint8_t*>(device_view);
    initialize_slab(slab, layout, initial_gen);
    free_slab(r);
    slabs_[r] = static_cast<uint8_t*>(host);  // what cudaFreeHost takes
    slab_kind_[r] = SlabKind::kPinned;
    view_.bases[r] = slab;
    view_.counters[r] = allocate_device_counters(layout, initial_gen);
  }
  view_.slots_in_host_memory = true;
  check(cudaDeviceSynchronize(), "initialising the loopback workspaces in host memory");
}

void CudaLoopback::free_slab(int rank) noexcept {
  if (slabs_[rank] != nullptr) {
    if (slab_kind_[rank] == SlabKind::kPinned) cudaFreeHost(slabs_[rank]);
    if (slab_kind_[rank] == SlabKind::kDevice) cudaFree(slabs_[rank]);
  }
  if (view_.counters[rank] != nullptr) cudaFree(view_.counters[rank]);
  slabs_[rank] = nullptr;
  view_.counters[rank] = nullptr;
  view_.bases[rank] = nullptr;
}

int CudaLoopback::add_schedule(const plan::Schedule& schedule) {
  const int world = view_.layout.world;
  if (schedule.world != world) {
    throw std::invalid_argument("add_schedule(): the schedule is for world " + str(schedule.world) +
                                ", the loopback workspace for world " + str(world));
  }
  Uploaded up;
  up.schedule = schedule;
  up.programs.direction = schedule.direction;
  std::vector<plan::Program> programs;
  for (int r = 0; r < world; ++r) {
    programs.push_back(plan::encode_program(schedule, r));
    plan::check_program(programs.back(), view_.layout, r);
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

void CudaLoopback::check_launch_args(const Uploaded& up, const plan::Tactic& tactic, size_t inputs,
                                     size_t outputs, int first_rank, int count) const {
  const int world = view_.layout.world;
  if (tactic.algorithm != up.schedule.algorithm || tactic.direction != up.schedule.direction ||
      tactic.staged != up.schedule.staged) {
    throw std::invalid_argument("loopback launch: the tactic (" + plan::tactic_label(tactic) +
                                ") is not the schedule's algorithm/direction/staging (" +
                                std::string(plan::algorithm_name(up.schedule.algorithm)) + "/" +
                                std::string(plan::direction_name(up.schedule.direction)) +
                                (up.schedule.staged ? "/staged" : "/unstaged") + ")");
  }
  if (static_cast<int>(inputs) != world || static_cast<int>(outputs) != world) {
    throw std::invalid_argument(
        "loopback launch: inputs and outputs must hold one pointer per "
        "rank (" +
        str(world) + "), got " + str(static_cast<int64_t>(inputs)) + " and " +
        str(static_cast<int64_t>(outputs)));
  }
  if (first_rank < 0 || count < 1 || first_rank + count > world) {
    throw std::invalid_argument("loopback launch: ranks [" + str(first_rank) + ", " +
                                str(first_rank + count) +
                                ") must be a non-empty range inside world " + str(world));
  }
  // Every CTA of every launched rank waits on the others: all must be resident at once.
  if (auto why = why_kernels_cannot_run(tactic, tactic.blocks * count, residency_)) {
    throw std::runtime_error("loopback launch of " + str(count) + " ranks x " + str(tactic.blocks) +
                             " blocks: " + *why + "; use fewer blocks or threads");
  }
}

void CudaLoopback::launch(int schedule_id, plan::DType dtype, const plan::Tactic& tactic,
                          const std::vector<const void*>& inputs, const std::vector<void*>& outputs,
                          int64_t numel, uint32_t signature, cudaStream_t stream, int first_rank,
                          int count) {
  if (schedule_id < 0 || schedule_id >= static_cast<int>(schedules_.size())) {
    throw std::invalid_argument("loopback launch: unknown schedule id " + str(schedule_id));
  }
  const Uploaded& up = schedules_[schedule_id];
  if (count < 0) count = view_.layout.world - first_rank;
  check_launch_args(up, tactic, inputs.size(), outputs.size(), first_rank, count);
  const LaunchParams p =
      make_launch_params(view_, up.programs, dtype, tactic.blocks, tactic.threads, inputs.data(),
                         outputs.data(), numel, signature, first_rank, count);
  DeviceGuard guard(device_);
  for (int r = first_rank; r < first_rank + count; ++r) order_[r].before_call(stream);
  if (!launch_executor(p, stream)) view_.pdl = false;  // refused: launched plainly, stay plain
}

std::optional<plan::Diagnostic> CudaLoopback::failure() const { return read_diag(diag_host_); }

}  // namespace pcie_ar::transport
