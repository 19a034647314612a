// The transport interface: one rank's workspace (memory laid out by plan::Layout that peers
// can reach) and the executor that runs checked step lists over it. Every transport
// implements this class and nothing else; the communicator knows no transport by name.
//
//   host_shm   CPU processes over POSIX shared memory (CPU tensors; CI without GPUs)
//   cuda_ipc   CUDA kernels over cudaMalloc slabs that peers map with CUDA IPC handles
//   cuda_host  the same kernels over shared pinned host memory (GPUs without peer-to-peer)
//
// Each transport is memory (memory/: shm segments, CUDA slabs and IPC handles, pinned host
// memory) plus an executor (executors/host, executors/cuda), joined in one short file. A new
// transport is such a file, a Kind (kind.h) and one case in make_workspace().
//
// Lifecycle, collective (every rank does each step; the caller owns the process group):
//   auto ws = make_workspace(options);     // allocates this rank's memory
//   tokens = all_gather(ws->local_token())
//   ws->open_peers(tokens); barrier; ws->retire_token();
//   id = ws->add_program(program);         // once per schedule, checked here (plan layer)
//   ws->run(call) ...                      // any number of times
//   ws->close_peers(); barrier; ws->release();
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "plan/epilogue.h"
#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/step.h"
#include "plan/tactic.h"
#include "transport/kind.h"

namespace pcie_ar::transport {

// Thrown when an executor fails synchronously (a bounded wait expired, or a peer entered the
// same generation with a different call). Carries the diagnostic the plan layer defines so
// callers can name the peer that never arrived. Asynchronous executors (CUDA kernels) record
// the same diagnostic and report it through Workspace::failure().
class TransportFailure : public std::runtime_error {
 public:
  TransportFailure(const plan::Diagnostic& diagnostic, std::string message);
  const plan::Diagnostic& diagnostic() const { return diagnostic_; }

 private:
  plan::Diagnostic diagnostic_;
};

// One all-reduce. The communicator's admission guarantees what run() assumes and does not
// check again: `program` came from add_program(); the tactic passed why_not(); dtype fits the
// layout's elements; 0 < numel <= layout.max_numel and numel * dtype bytes is a multiple of 16;
// input and output are 16-byte aligned and either the same buffer (in place) or disjoint; an LL
// program's message fits layout.ll_capacity_bytes. A plan::skip_program() reads none of the call
// but `blocks` (1) and `stream`: it only takes the next generation.
struct Call {
  int program = -1;  // id from add_program()
  plan::DType dtype = plan::DType::kBF16;
  int blocks = 1;     // slices of every chunk, each with its own flags and generation counter
  int threads = 256;  // per CTA (GPU transports)
  const void* input = nullptr;
  void* output = nullptr;
  int64_t numel = 0;
  // A streamed reduce-scatter's or all-gather's round (comm's plan_call): chunk c of this call's
  // message lies chunk_stride * c elements from `input` / `output` (the one-chunk tensor's base
  // shifted down by rank * chunk_stride, as comm forms it), not numel * c / num_chunks (each of
  // its chunks is one slice of the whole message's chunk c). 0: the message's own chunking. A
  // nonzero stride is a whole number of vectors, at least numel / num_chunks, and numel then
  // divides into num_chunks whole-vector chunks (plan::chunk_shift).
  int64_t chunk_stride = 0;
  uint32_t signature = 0;  // plan::call_signature(dtype, tactic): travels with every flag
  void* stream = nullptr;  // cudaStream_t on GPU transports; unused on the host
  // A program that ends with the fused epilogue (plan::with_epilogue) reads these: numel is a
  // whole number of rows of epilogue.hidden, 16-byte multiples, every pointer 16-byte aligned.
  plan::EpilogueArgs epilogue;
};

class Workspace {
 public:
  virtual ~Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  const plan::Layout& layout() const { return layout_; }
  int rank() const { return rank_; }
  // Where the tensors of a call must live: -1 for host memory, else the CUDA device index.
  virtual int device() const = 0;

  // ---- bootstrap
  // Bytes a peer needs to reach this rank's memory (a segment name, an IPC handle).
  virtual std::string local_token() const = 0;
  // tokens[r] is rank r's local_token(). Maps every peer's memory. Throws naming the peer
  // whose memory cannot be reached.
  virtual void open_peers(const std::vector<std::string>& tokens) = 0;
  // Every rank has opened every peer: drop what let peers find this rank's memory (the host
  // transport unlinks its segment name, so nothing is left in /dev/shm). Idempotent.
  virtual void retire_token() noexcept {}
  // P2P write-and-verify, because drivers report P2P that does not work. Collective:
  // probe_write() on every rank, a barrier, then probe_read() returns the ranks whose writes
  // did not arrive intact here, or whose memory this rank's kernels could not read intact.
  // Transports whose peers share host memory have nothing to probe.
  virtual void probe_write(uint32_t nonce) { (void)nonce; }
  virtual std::vector<int> probe_read(uint32_t nonce) const {
    (void)nonce;
    return {};
  }

  // ---- programs and tactics
  // Checks `program` once (plan::check_program against this layout and rank) and installs it;
  // returns the id a Call names. Throws std::invalid_argument for a program that fails.
  int add_program(const plan::Program& program);
  // Why `tactic` cannot run on this workspace (blocks outside 1..layout.max_blocks, or a limit
  // of the transport such as the GPU's threads per CTA), or nullopt.
  std::optional<std::string> why_not(const plan::Tactic& tactic) const;
  // Whether the executor runs reduce steps with two destinations (the schedules of
  // plan::fuse_forwarding_copies); add_program() refuses them where it does not. The host
  // executor does, in one pass; the CUDA executor does not (its reduce loop is at the register
  // budget). The caller fuses a schedule only when this says so.
  virtual bool runs_multi_destination_steps() const { return false; }

  // ---- the call
  // Runs (host) or enqueues (GPU) one all-reduce; see Call for what it assumes. Throws
  // TransportFailure on a synchronous failure; after any failure the workspace refuses every
  // further call (the ranks are out of step: recreate it on every rank).
  virtual void run(const Call& call) = 0;
  // The failure that stopped this workspace, if any (read from mapped memory on the GPU).
  virtual std::optional<plan::Diagnostic> failure() const = 0;
  // What a host-side wait asks, now and then, whether to abandon the call (true: it fails with
  // plan::FailureKind::kInterrupted). Only the host transport waits on the host; a GPU
  // transport's waits run on the device and ignore it.
  virtual void set_interrupt_check(std::function<bool()> check) { (void)check; }

  // ---- teardown (collective): close_peers() on every rank, a barrier, release().
  virtual void close_peers() = 0;
  virtual void release() = 0;  // frees this rank's memory; idempotent

 protected:
  Workspace(const plan::Layout& layout, int rank);
  // Installs a program that passed check_program(); returns its id.
  virtual int install(const plan::Program& program) = 0;
  // Limits of the transport beyond the layout's; nullopt when the tactic fits.
  virtual std::optional<std::string> transport_limits(const plan::Tactic& tactic) const {
    (void)tactic;
    return std::nullopt;
  }

 private:
  plan::Layout layout_;
  int rank_ = 0;
};

struct WorkspaceOptions {
  Kind transport = Kind::kHostShm;
  int64_t max_numel = 0;  // the layout's (plan::make_layout)
  int world = 0;
  int elem_bytes = 2;
  int max_blocks = plan::kDefaultMaxBlocks;  // a transport may cap it
  int rank = 0;
  int device = -1;           // CUDA device index (cuda_ipc, cuda_host)
  uint32_t initial_gen = 0;  // the first call runs initial_gen + 1 (tests cross the wrap)
  double timeout_s = 30.0;   // every wait's deadline; 0 waits forever
  // CUDA transports: programmatic dependent launch wherever the GPU and the build allow it.
  bool pdl = true;
};

// The one place that knows which transports this build has. Lays the workspace out
// (plan::make_layout) with the transport's block cap. Throws std::invalid_argument for a value
// outside Kind or a bad layout, std::runtime_error for a transport this build lacks (both name
// the transport by its canonical name).
std::unique_ptr<Workspace> make_workspace(const WorkspaceOptions& options);

}  // namespace pcie_ar::transport
