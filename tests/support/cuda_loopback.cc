// How the loopback lays out N virtual ranks on one GPU and launches them as one grid; see
// cuda_loopback.h.
#include "support/cuda_loopback.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <utility>

#include "plan/program_check.h"
#include "transport/memory/cuda_device.h"
#include "transport/memory/cuda_memory.h"

namespace pcie_ar::transport {

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
    throw std::invalid_argument("use_external_slab(): rank " + std::to_string(rank) + " of world " +
                                std::to_string(view_.layout.world) + " with a " +
                                (slab == nullptr ? "null" : "non-null") + " slab");
  }
  DeviceGuard guard(device_);
  initialize_slab(slab, view_.layout, initial_gen);
  check(cudaDeviceSynchronize(), "initialising an external loopback workspace");
  free_slab(rank);
  slabs_[rank] = slab;
  slab_kind_[rank] = SlabKind::kCaller;
  view_.bases[rank] = slab;
  view_.slots_in_host_memory = true;  // the caller's slabs are host memory (cuda_loopback.h)
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
    throw std::invalid_argument("add_schedule(): the schedule is for world " +
                                std::to_string(schedule.world) +
                                ", the loopback workspace for world " + std::to_string(world));
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
        std::to_string(world) + "), got " + std::to_string(static_cast<int64_t>(inputs)) + " and " +
        std::to_string(static_cast<int64_t>(outputs)));
  }
  if (first_rank < 0 || count < 1 || first_rank + count > world) {
    throw std::invalid_argument("loopback launch: ranks [" + std::to_string(first_rank) + ", " +
                                std::to_string(first_rank + count) +
                                ") must be a non-empty range inside world " +
                                std::to_string(world));
  }
  // Every CTA of every launched rank waits on the others: all must be resident at once.
  if (auto why = why_kernels_cannot_run(tactic, tactic.blocks * count, residency_)) {
    throw std::runtime_error("loopback launch of " + std::to_string(count) + " ranks x " +
                             std::to_string(tactic.blocks) + " blocks: " + *why +
                             "; use fewer blocks or threads");
  }
}

void CudaLoopback::launch(int schedule_id, plan::DType dtype, const plan::Tactic& tactic,
                          const std::vector<const void*>& inputs, const std::vector<void*>& outputs,
                          int64_t numel, uint32_t signature, cudaStream_t stream, int first_rank,
                          int count, const std::vector<plan::EpilogueArgs>* epilogue) {
  if (schedule_id < 0 || schedule_id >= static_cast<int>(schedules_.size())) {
    throw std::invalid_argument("loopback launch: unknown schedule id " +
                                std::to_string(schedule_id));
  }
  const Uploaded& up = schedules_[schedule_id];
  if (count < 0) count = view_.layout.world - first_rank;
  check_launch_args(up, tactic, inputs.size(), outputs.size(), first_rank, count);
  LaunchParams p =
      make_launch_params(view_, up.programs, dtype, tactic.blocks, tactic.threads, inputs.data(),
                         outputs.data(), numel, signature, first_rank, count);
  for (int r = first_rank; epilogue != nullptr && r < first_rank + count; ++r) {
    set_epilogue(p, r, epilogue->at(r));
  }
  DeviceGuard guard(device_);
  for (int r = first_rank; r < first_rank + count; ++r) order_[r].before_call(stream);
  if (!launch_executor(p, stream)) view_.pdl = false;  // refused: launched plainly, stay plain
}

std::optional<plan::Diagnostic> CudaLoopback::failure() const { return read_diag(diag_host_); }

}  // namespace pcie_ar::transport
