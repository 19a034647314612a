// How the CUDA executor's workspace uploads programs, launches and reads failures back; see
// kernel_workspace.h.
#include "transport/executors/cuda/kernel_workspace.h"

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "transport/memory/cuda_device.h"
#include "transport/memory/cuda_memory.h"

namespace pcie_ar::transport {

CudaKernelWorkspace::CudaKernelWorkspace(const plan::Layout& layout, int rank, int device,
                                         double timeout_s, bool pdl)
    : Workspace(layout, rank), device_(device) {
  require_device(device);
  plan::check_layout(layout);
  if (rank < 0 || rank >= layout.world) {
    throw std::invalid_argument("rank " + std::to_string(rank) + " is outside world " +
                                std::to_string(layout.world));
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
  // They are compiled for the splits the builders emit (executor_runs_split), no other.
  for (int i = 0; i < program.num_steps; ++i) {
    const plan::Step& step = program.steps[i];
    if (step.num_dsts != 1) {
      throw std::invalid_argument("rank " + std::to_string(rank()) + "'s program, step " +
                                  std::to_string(i) +
                                  ": the CUDA executor writes one destination per step; run the "
                                  "schedule unfused");
    }
    if (step.kind == plan::StepKind::kReduce && !executor_runs_split(step.num_srcs, step.split)) {
      throw std::invalid_argument(
          "rank " + std::to_string(rank()) + "'s program, step " + std::to_string(i) +
          ": the CUDA executor splits a sum of " + std::to_string(step.num_srcs) +
          " operands only into two equal groups, not at operand " + std::to_string(step.split));
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
  LaunchParams p =
      make_launch_params(view_, programs_[call.program], call.dtype, call.blocks, call.threads,
                         inputs, outputs, call.numel, call.signature, rank(), 1, call.chunk_stride);
  if (call.epilogue.hidden > 0) set_epilogue(p, rank(), call.epilogue);
  DeviceGuard guard(device_);
  const auto stream = static_cast<cudaStream_t>(call.stream);
  order_.before_call(stream);
  if (!launch_executor(p, stream)) view_.pdl = false;  // refused: launched plainly, stay plain
}

std::optional<plan::Diagnostic> CudaKernelWorkspace::failure() const {
  return read_diag(diag_host_);
}

uint32_t* CudaKernelWorkspace::probe_words(int owner, int writer) const {
  return reinterpret_cast<uint32_t*>(view_.bases[owner] +
                                     view_.layout.slot_offset(0, plan::slot_from_rank(writer)));
}

void CudaKernelWorkspace::probe_write(uint32_t nonce) {
  if (!peers_open_) throw std::logic_error("probe_write(): open_peers() has not run");
  DeviceGuard guard(device_);
  // Every peer's slab, and our own (a local store, the pattern the peers' read probe loads).
  for (int p = 0; p < view_.layout.world; ++p) {
    check(launch_probe(probe_words(p, rank()), nonce, rank(), p),
          "launching the P2P probe to rank " + std::to_string(p));
  }
  check(cudaDeviceSynchronize(), "the P2P probe writes from rank " + std::to_string(rank()));
}

std::vector<int> CudaKernelWorkspace::probe_read(uint32_t nonce) const {
  if (view_.bases[rank()] == nullptr)
    throw std::logic_error("probe_read(): the workspace was freed");
  DeviceGuard guard(device_);
  const plan::Layout& l = view_.layout;
  // Where the read probe lands: a slot of ours that nothing uses during the probe.
  auto* landing = reinterpret_cast<uint32_t*>(view_.bases[rank()] +
                                              l.slot_offset(0, plan::slot_staged_input(l.world)));
  std::vector<int> failed;
  for (int q = 0; q < l.world; ++q) {
    if (q == rank()) continue;
    uint32_t words[kProbeWords];
    // cudaMemcpyDefault: the slab is device memory (cuda_ipc) or mapped host memory (cuda_host).
    check(cudaMemcpy(words, probe_words(rank(), q), sizeof(words), cudaMemcpyDefault),
          "reading the P2P probe from rank " + std::to_string(q));
    bool intact = true;
    for (int i = 0; i < kProbeWords; ++i) intact &= words[i] == probe_word(nonce, q, rank(), i);
    // The read probe: a kernel loads q's own pattern out of q's slab, as pull kernels load.
    check(launch_probe_read(probe_words(q, q), landing),
          "launching the P2P read probe of rank " + std::to_string(q));
    check(cudaDeviceSynchronize(), "the P2P read probe of rank " + std::to_string(q));
    check(cudaMemcpy(words, landing, sizeof(words), cudaMemcpyDefault),
          "reading the P2P read probe of rank " + std::to_string(q));
    for (int i = 0; i < kProbeWords; ++i) intact &= words[i] == probe_word(nonce, q, q, i);
    if (!intact) failed.push_back(q);
  }
  return failed;
}

}  // namespace pcie_ar::transport
