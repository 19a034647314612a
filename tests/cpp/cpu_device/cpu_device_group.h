// Ranks of the CUDA executor on the CPU device, for the tests: every rank's workspace in this
// process's memory (the GPU loopback check's shape: all ranks in one launch, or any subset in
// its own launch), laid out and initialised as the CUDA transports lay out and initialise theirs,
// in either placement:
//   kDevice  the cuda_ipc placement: generation counters inside each rank's slab
//   kHost    the cuda_host placement: counters apart from the slab (device memory there),
//            slots_in_host_memory set, so push reads take the host-memory path
// A cross-process rank (ranks as processes over POSIX shared memory, like cuda_host) builds its
// LaunchParams with make_launch_params() over the mapped segments instead.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/schedule.h"
#include "plan/tactic.h"
#include "transport/executors/cuda/cpu/device.h"
#include "transport/executors/cuda/kernel_params.h"

namespace pcie_ar::transport::cpu_device_test {

enum class Placement : uint8_t { kDevice, kHost };

// Zeroes `bytes` of workspace and writes its control area at initial_gen, as the CUDA
// transports initialise a slab.
void initialize_workspace(uint8_t* slab, const plan::Layout& layout, uint64_t initial_gen);

// Generation counters apart from the slab, addressed like one (plan::Layout::gen_counter_offset).
std::vector<uint64_t> separate_counters(const plan::Layout& layout, uint64_t initial_gen);

class CpuDeviceGroup {
 public:
  CpuDeviceGroup(const plan::Layout& layout, Placement placement, uint64_t initial_gen = 0,
                 double timeout_s = 30.0);

  const plan::Layout& layout() const { return layout_; }
  // Encodes and checks (plan::check_program) every rank's program; returns an id.
  int add_schedule(const plan::Schedule& schedule);
  // Every rank's plan::skip_program (what a rank runs for a call it sends to the fallback).
  int add_skip();
  const plan::Schedule& schedule(int id) const { return schedules_[id].schedule; }

  // One launch of ranks [first_rank, first_rank + count) (count -1: the rest). inputs/outputs
  // hold one pointer per rank of the world. signature 0: plan::call_signature(dtype, tactic).
  // `epilogue`, one per rank of the world, for a schedule with the fused epilogue.
  // `chunk_stride`: transport::Call::chunk_stride (elements; 0: the message's own chunking), for
  // a streamed collective's round.
  cpu_device::LaunchStatus launch(int schedule_id, const plan::Tactic& tactic, plan::DType dtype,
                                  const std::vector<const void*>& inputs,
                                  const std::vector<void*>& outputs, int64_t numel,
                                  const cpu_device::DeviceOptions& options, int first_rank = 0,
                                  int count = -1, uint32_t signature = 0,
                                  const std::vector<plan::EpilogueArgs>* epilogue = nullptr,
                                  int64_t chunk_stride = 0);

  // The record a failed launch left (kind != kNone), or nullopt. clear_failure() forgets it.
  std::optional<plan::Diagnostic> failure() const;
  void clear_failure();

  uint8_t* slab(int rank) { return slabs_[rank].get(); }
  uint64_t generation(int rank, int block) const;

 private:
  struct Uploaded {
    plan::Schedule schedule;
    std::vector<plan::Program> programs;
  };
  struct FreeAligned {
    void operator()(uint8_t* p) const;
  };

  plan::Layout layout_;
  Placement placement_;
  double timeout_s_;
  std::vector<std::unique_ptr<uint8_t, FreeAligned>> slabs_;
  std::vector<std::vector<uint64_t>> counters_;  // kHost only
  std::vector<Uploaded> schedules_;
  plan::Diagnostic diag_{};
  uint32_t claim_ = 0;
};

}  // namespace pcie_ar::transport::cpu_device_test
