// See cpu_device_group.h.
#include "cpu_device_group.h"

#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "plan/program_check.h"
#include "transport/executors/cuda/cpu/launch.h"

namespace pcie_ar::transport::cpu_device_test {

void initialize_workspace(uint8_t* slab, const plan::Layout& layout, uint64_t initial_gen) {
  std::memset(slab, 0, layout.total_bytes);
  plan::initialize_control(slab, layout, initial_gen);
}

std::vector<uint64_t> separate_counters(const plan::Layout& layout, uint64_t initial_gen) {
  std::vector<uint64_t> words((layout.gen_counter_offset(layout.max_blocks) + 7) / 8, 0);
  for (int b = 0; b < layout.max_blocks; ++b) words[layout.gen_counter_offset(b) / 8] = initial_gen;
  return words;
}

void CpuDeviceGroup::FreeAligned::operator()(uint8_t* p) const { std::free(p); }

CpuDeviceGroup::CpuDeviceGroup(const plan::Layout& layout, Placement placement,
                               uint64_t initial_gen, double timeout_s)
    : layout_(layout), placement_(placement), timeout_s_(timeout_s) {
  plan::check_layout(layout);
  const size_t bytes =
      (layout.total_bytes + plan::kAlignBytes - 1) / plan::kAlignBytes * plan::kAlignBytes;
  for (int r = 0; r < layout.world; ++r) {
    auto* slab = static_cast<uint8_t*>(std::aligned_alloc(plan::kAlignBytes, bytes));
    if (slab == nullptr) throw std::bad_alloc();
    slabs_.emplace_back(slab);
    initialize_workspace(slab, layout, initial_gen);
    if (placement == Placement::kHost) counters_.push_back(separate_counters(layout, initial_gen));
  }
}

int CpuDeviceGroup::add_schedule(const plan::Schedule& schedule) {
  if (schedule.world != layout_.world) {
    throw std::invalid_argument("add_schedule(): schedule for world " +
                                std::to_string(schedule.world) + ", group of " +
                                std::to_string(layout_.world));
  }
  Uploaded up{schedule, {}};
  for (int r = 0; r < layout_.world; ++r) {
    up.programs.push_back(plan::encode_program(schedule, r));
    plan::check_program(up.programs.back(), layout_, r);
  }
  schedules_.push_back(std::move(up));
  return static_cast<int>(schedules_.size()) - 1;
}

int CpuDeviceGroup::add_skip() {
  Uploaded up;
  up.schedule.world = layout_.world;
  for (int r = 0; r < layout_.world; ++r) {
    up.programs.push_back(plan::skip_program(r, layout_.world));
    plan::check_program(up.programs.back(), layout_, r);
  }
  schedules_.push_back(std::move(up));
  return static_cast<int>(schedules_.size()) - 1;
}

cpu_device::LaunchStatus CpuDeviceGroup::launch(
    int schedule_id, const plan::Tactic& tactic, plan::DType dtype,
    const std::vector<const void*>& inputs, const std::vector<void*>& outputs, int64_t numel,
    const cpu_device::DeviceOptions& options, int first_rank, int count, uint32_t signature,
    const std::vector<plan::EpilogueArgs>* epilogue, int64_t chunk_stride) {
  const Uploaded& up = schedules_.at(schedule_id);
  if (count < 0) count = layout_.world - first_rank;
  if (static_cast<int>(inputs.size()) != layout_.world ||
      static_cast<int>(outputs.size()) != layout_.world) {
    throw std::invalid_argument("launch(): one input and one output pointer per rank");
  }
  WorkspaceView view;
  ProgramSet programs;
  view.layout = layout_;
  for (int r = 0; r < layout_.world; ++r) {
    view.bases[r] = slabs_[r].get();
    if (placement_ == Placement::kHost) {
      view.counters[r] = reinterpret_cast<uint8_t*>(counters_[r].data());
    }
    programs.device[r] = &up.programs[r];
  }
  programs.direction = up.schedule.direction;
  view.diag = &diag_;
  view.claim = &claim_;
  view.timeout_ns = timeout_to_ns(timeout_s_);
  view.slots_in_host_memory = placement_ == Placement::kHost;
  if (signature == 0) signature = plan::call_signature(dtype, tactic);
  LaunchParams p =
      make_launch_params(view, programs, dtype, tactic.blocks, tactic.threads, inputs.data(),
                         outputs.data(), numel, signature, first_rank, count, chunk_stride);
  for (int r = first_rank; epilogue != nullptr && r < first_rank + count; ++r) {
    set_epilogue(p, r, epilogue->at(r));
  }
  return cpu_device::launch_executor(p, options);
}

std::optional<plan::Diagnostic> CpuDeviceGroup::failure() const {
  if (diag_.kind == static_cast<uint32_t>(plan::FailureKind::kNone)) return std::nullopt;
  return diag_;
}

void CpuDeviceGroup::clear_failure() {
  diag_ = plan::Diagnostic{};
  claim_ = 0;
}

uint64_t CpuDeviceGroup::generation(int rank, int block) const {
  const uint8_t* base = placement_ == Placement::kHost
                            ? reinterpret_cast<const uint8_t*>(counters_[rank].data())
                            : slabs_[rank].get();
  uint64_t gen = 0;
  std::memcpy(&gen, base + layout_.gen_counter_offset(block), sizeof(gen));
  return gen;
}

}  // namespace pcie_ar::transport::cpu_device_test
