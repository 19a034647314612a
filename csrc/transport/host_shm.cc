// host_shm: how the plan executor runs over POSIX shared memory. The protocol itself (flags,
// generations, parity double buffer) is plan/protocol.h; this file only maps memory, moves
// 16-byte vectors and polls flags.
#include "transport/host_shm.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <utility>

namespace pcie_ar::transport {
namespace {

using plan::BufRef;
using plan::FlagWord;
using plan::Space;
using plan::Step;
using plan::StepKind;

// Peers are separate processes: the flag protocol is only sound if these atomics never fall
// back to a process-local lock.
static_assert(std::atomic_ref<uint32_t>::is_always_lock_free);

// A few hundred polls cover a peer that is already running on another core; past that the peer
// is probably waiting for our core (CI runs 8 ranks on 2), so give it away.
constexpr int kSpinPolls = 256;
// steady_clock is cheap but not free; the deadline only needs checking every few yields (a
// yield on an oversubscribed core can cost a scheduler slice, so not too few).
constexpr int kPollsPerClockCheck = 8;
// Beyond this a timeout is indistinguishable from "forever", and the deadline arithmetic
// would overflow.
constexpr double kMaxFiniteTimeoutS = 1e9;

std::string errno_text(int err) { return std::string(std::strerror(err)); }

// Tells the core a spin-wait is in progress (frees pipeline resources for a sibling
// hyperthread, which may be the peer we wait for).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

std::string make_segment_name(int rank) {
  std::random_device device;
  const uint64_t random = (static_cast<uint64_t>(device()) << 32) ^ device();
  char buffer[96];
  std::snprintf(buffer, sizeof(buffer), "/pcie_ar.%ld.%016llx.r%d", static_cast<long>(getpid()),
                static_cast<unsigned long long>(random), rank);
  return buffer;
}

// ---------------------------------------------------------------- element codecs
// Each codec turns one element into fp32 and back with a single round-to-nearest-even, done
// with integer arithmetic so the result never depends on compiler flags or CPU features. The
// special cases are selects rather than branches so the compiler vectorises the tile loops.

struct Bf16Codec {
  using Bits = uint16_t;
  static float to_float(Bits h) { return std::bit_cast<float>(static_cast<uint32_t>(h) << 16); }
  static Bits from_float(float f) {
    const uint32_t x = std::bit_cast<uint32_t>(f);
    // Adding 0x7fff plus the lowest kept bit rounds half to even; a carry into the exponent
    // is the correct rounding up to the next binade or to infinity.
    const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    // NaN: keep sign and top payload, force quiet so the rounding cannot turn it into inf.
    const uint32_t nan = (x >> 16) | 0x0040u;
    return static_cast<Bits>((x & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
  }
};

struct Fp16Codec {
  using Bits = uint16_t;
  static float to_float(Bits h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
    const uint32_t magnitude = h & 0x7fffu;
    const uint32_t exponent = magnitude >> 10;
    // Normal: rebias the exponent (15 -> 127). Inf/NaN: all-ones exponent, payload kept.
    // Zero/subnormal: mantissa * 2^-24 is exact in fp32.
    const uint32_t normal = (magnitude << 13) + (112u << 23);
    const uint32_t special = (magnitude << 13) | 0x7f800000u;
    const uint32_t tiny = std::bit_cast<uint32_t>(static_cast<float>(magnitude) * 0x1p-24f);
    const uint32_t bits = exponent == 0x1fu ? special : (exponent == 0 ? tiny : normal);
    return std::bit_cast<float>(sign | bits);
  }
  static Bits from_float(float f) {
    const uint32_t x = std::bit_cast<uint32_t>(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t magnitude = x & 0x7fffffffu;
    // NaN: quiet, top payload bits kept.
    const uint32_t nan = 0x7e00u | ((magnitude >> 13) & 0x3ffu);
    // Below the smallest normal half (2^-14): adding 0.5 leaves an fp32 whose ulp is 2^-24,
    // the fp16 subnormal step, so the hardware add rounds to nearest even for us and the low
    // bits are the subnormal mantissa (0x400 = rounded up to the smallest normal).
    const uint32_t tiny =
        std::bit_cast<uint32_t>(std::bit_cast<float>(magnitude) + 0.5f) - 0x3f000000u;
    // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits half to even.
    const uint32_t normal = (magnitude - (112u << 23) + 0xfffu + ((magnitude >> 13) & 1u)) >> 13;
    uint32_t bits = magnitude < 0x38800000u ? tiny : normal;
    bits = magnitude >= 0x477ff000u ? 0x7c00u : bits;  // >= 65520 rounds to infinity
    bits = magnitude > 0x7f800000u ? nan : bits;
    return static_cast<Bits>(sign | bits);
  }
};

struct Fp32Codec {
  using Bits = float;
  static float to_float(Bits f) { return f; }
  static Bits from_float(float f) { return f; }
};

// dst[0, kElems) = sum of srcs in order, accumulated in fp32 and rounded once. Every source is
// loaded before dst is stored, so dst may alias a source elementwise (in-place).
template <typename Codec, int kElems>
inline void reduce_tile(uint8_t* dst, const uint8_t* const* srcs, int num_srcs, int64_t offset) {
  using Bits = typename Codec::Bits;
  Bits lanes[kElems];
  float acc[kElems];
  std::memcpy(lanes, srcs[0] + offset, sizeof(lanes));
  for (int i = 0; i < kElems; ++i) acc[i] = Codec::to_float(lanes[i]);
  for (int s = 1; s < num_srcs; ++s) {
    std::memcpy(lanes, srcs[s] + offset, sizeof(lanes));
    for (int i = 0; i < kElems; ++i) acc[i] += Codec::to_float(lanes[i]);
  }
  for (int i = 0; i < kElems; ++i) lanes[i] = Codec::from_float(acc[i]);
  std::memcpy(dst + offset, lanes, sizeof(lanes));
}

// Tiles of several vectors give the compiler fixed-length loops to vectorise; the tail runs
// one 16-byte vector at a time.
template <typename Codec>
void reduce_vectors(uint8_t* dst, const uint8_t* const* srcs, int num_srcs, int64_t num_vecs) {
  constexpr int kLanes = plan::kVectorBytes / static_cast<int>(sizeof(typename Codec::Bits));
  constexpr int kTileVecs = 8;
  int64_t v = 0;
  for (; v + kTileVecs <= num_vecs; v += kTileVecs) {
    reduce_tile<Codec, kTileVecs * kLanes>(dst, srcs, num_srcs, v * plan::kVectorBytes);
  }
  for (; v < num_vecs; ++v) {
    reduce_tile<Codec, kLanes>(dst, srcs, num_srcs, v * plan::kVectorBytes);
  }
}

using ReduceFn = void (*)(uint8_t*, const uint8_t* const*, int, int64_t);

ReduceFn reducer_for(plan::DType dtype) {
  switch (dtype) {
    case plan::DType::kBF16:
      return &reduce_vectors<Bf16Codec>;
    case plan::DType::kFP16:
      return &reduce_vectors<Fp16Codec>;
    case plan::DType::kFP32:
      return &reduce_vectors<Fp32Codec>;
  }
  return nullptr;
}

std::string step_context(int rank, int index) {
  return "step " + std::to_string(index) + " of rank " + std::to_string(rank) + "'s program";
}

void validate_buf_ref(const BufRef& ref, const plan::Layout& layout, int rank, int index,
                      const char* role) {
  const auto fail = [&](const std::string& what) {
    throw std::invalid_argument(step_context(rank, index) + ": " + role + " " + what);
  };
  if (ref.owner >= layout.world) {
    fail("names owner rank " + std::to_string(ref.owner) + ", expected 0.." +
         std::to_string(layout.world - 1));
  }
  switch (ref.space) {
    case Space::kInput:
    case Space::kOutput:
      if (ref.owner != rank) {
        fail("names rank " + std::to_string(ref.owner) +
             "'s input/output, but only the executing rank's own tensors are local");
      }
      return;
    case Space::kSlot:
      if (ref.slot >= layout.num_slots) {
        fail("names slot " + std::to_string(ref.slot) + ", expected 0.." +
             std::to_string(layout.num_slots - 1));
      }
      return;
  }
  fail("has unknown space " + std::to_string(static_cast<int>(ref.space)));
}

void validate_program(const plan::Program& program, const plan::Layout& layout, int rank) {
  if (program.world != layout.world || program.rank != rank) {
    throw std::invalid_argument("program is for rank " + std::to_string(program.rank) +
                                " of world " + std::to_string(program.world) +
                                ", but this workspace is rank " + std::to_string(rank) +
                                " of world " + std::to_string(layout.world));
  }
  if (program.num_chunks < 1 || program.num_steps > plan::kMaxSteps) {
    throw std::invalid_argument("program has " + std::to_string(program.num_chunks) +
                                " chunks and " + std::to_string(program.num_steps) +
                                " steps; expected at least 1 chunk and at most " +
                                std::to_string(plan::kMaxSteps) + " steps");
  }
  for (int i = 0; i < program.num_steps; ++i) {
    const Step& step = program.steps[i];
    switch (step.kind) {
      case StepKind::kReduce:
        if (step.chunk >= program.num_chunks) {
          throw std::invalid_argument(step_context(rank, i) + " reduces chunk " +
                                      std::to_string(step.chunk) + " of " +
                                      std::to_string(program.num_chunks));
        }
        if (step.num_srcs < 1 || step.num_srcs > plan::kMaxSources) {
          throw std::invalid_argument(step_context(rank, i) + " has " +
                                      std::to_string(step.num_srcs) + " sources, expected 1.." +
                                      std::to_string(plan::kMaxSources));
        }
        if (step.dst.space == Space::kInput) {
          throw std::invalid_argument(step_context(rank, i) +
                                      " writes the input tensor, which is read-only");
        }
        validate_buf_ref(step.dst, layout, rank, i, "destination");
        for (int s = 0; s < step.num_srcs; ++s) {
          validate_buf_ref(step.srcs[s], layout, rank, i, "source");
        }
        break;
      case StepKind::kSignal:
      case StepKind::kWait:
        if (step.flag_owner >= layout.world || step.peer >= layout.world ||
            step.flag >= layout.num_flags) {
          throw std::invalid_argument(
              step_context(rank, i) + " names flag " + std::to_string(step.flag) + " of rank " +
              std::to_string(step.flag_owner) + " (peer " + std::to_string(step.peer) +
              "); expected flags 0.." + std::to_string(layout.num_flags - 1) + " and ranks 0.." +
              std::to_string(layout.world - 1));
        }
        break;
      default:
        throw std::invalid_argument(step_context(rank, i) + " has unknown kind " +
                                    std::to_string(static_cast<int>(step.kind)));
    }
  }
}

}  // namespace

TransportFailure::TransportFailure(const plan::Diagnostic& diagnostic, std::string message)
    : std::runtime_error(std::move(message)), diagnostic_(diagnostic) {}

// ---------------------------------------------------------------- segment lifecycle

HostShmWorkspace::HostShmWorkspace(const plan::Layout& layout, int rank, uint32_t initial_gen,
                                   double timeout_s)
    : layout_(layout), rank_(rank), timeout_s_(timeout_s) {
  if (layout.world < 1 || layout.world > plan::kMaxWorld) {
    throw std::invalid_argument("layout world size must be 1.." + std::to_string(plan::kMaxWorld) +
                                ", got " + std::to_string(layout.world));
  }
  if (rank < 0 || rank >= layout.world) {
    throw std::invalid_argument("rank must be 0.." + std::to_string(layout.world - 1) + ", got " +
                                std::to_string(rank));
  }
  if (!(timeout_s >= 0.0)) {
    throw std::invalid_argument("timeout_s must be >= 0 (0 waits forever), got " +
                                std::to_string(timeout_s));
  }
  if (layout.total_bytes == 0 || layout.control_bytes > layout.total_bytes) {
    throw std::invalid_argument(
        "layout is empty or inconsistent (total_bytes " + std::to_string(layout.total_bytes) +
        ", control_bytes " + std::to_string(layout.control_bytes) + "); build it with make_layout");
  }
  bases_.assign(layout.world, nullptr);

  int fd = -1;
  // 64 random bits make a collision practically impossible; retrying covers the remainder
  // instead of failing on a stale segment from a crashed process with a recycled pid.
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    name_ = make_segment_name(rank);
    fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 && errno != EEXIST) {
      const int err = errno;
      throw std::runtime_error("rank " + std::to_string(rank) + ": shm_open(" + name_ +
                               ") failed: " + errno_text(err) +
                               "; is /dev/shm mounted and writable?");
    }
  }
  if (fd < 0) {
    throw std::runtime_error("rank " + std::to_string(rank) +
                             ": could not find an unused shared-memory name after 8 attempts");
  }
  linked_ = true;

  try {
    const auto size = static_cast<off_t>(layout.total_bytes);
    int truncated = 0;
    do {
      truncated = ftruncate(fd, size);
    } while (truncated != 0 && errno == EINTR);
    if (truncated != 0) {
      const int err = errno;
      throw std::runtime_error("rank " + std::to_string(rank) + ": ftruncate(" + name_ + ", " +
                               std::to_string(layout.total_bytes) +
                               " bytes) failed: " + errno_text(err));
    }
    // tmpfs hands out pages lazily; reserving them now turns a too-small /dev/shm (Docker's
    // default is 64 MiB) into this error instead of a SIGBUS in the middle of an all-reduce.
    int reserve = 0;
    do {
      reserve = posix_fallocate(fd, 0, size);
    } while (reserve == EINTR);
    if (reserve != 0 && reserve != EOPNOTSUPP && reserve != EINVAL) {
      throw std::runtime_error("rank " + std::to_string(rank) + ": cannot reserve " +
                               std::to_string(layout.total_bytes) + " bytes of shared memory for " +
                               name_ + ": " + errno_text(reserve) +
                               "; enlarge /dev/shm (docker run --shm-size) or lower max_numel");
    }
    void* base = mmap(nullptr, layout.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
      const int err = errno;
      throw std::runtime_error("rank " + std::to_string(rank) + ": mmap(" + name_ + ", " +
                               std::to_string(layout.total_bytes) +
                               " bytes) failed: " + errno_text(err));
    }
    bases_[rank] = static_cast<uint8_t*>(base);
    close(fd);
    fd = -1;
    plan::initialize_control(base, layout_, initial_gen);
  } catch (...) {
    if (fd >= 0) close(fd);
    if (bases_[rank] != nullptr) munmap(bases_[rank], layout_.total_bytes);
    shm_unlink(name_.c_str());
    throw;
  }
  if (layout_.world == 1) peers_open_ = true;
}

HostShmWorkspace::~HostShmWorkspace() {
  for (uint8_t* base : bases_) {
    if (base != nullptr) munmap(base, layout_.total_bytes);
  }
  unlink_own();
}

void HostShmWorkspace::unlink_own() noexcept {
  if (!linked_) return;
  shm_unlink(name_.c_str());
  linked_ = false;
}

void HostShmWorkspace::open_peers(const std::vector<std::string>& names) {
  if (peers_open_ && layout_.world > 1) {
    throw std::logic_error("rank " + std::to_string(rank_) + ": open_peers() was already called");
  }
  if (static_cast<int>(names.size()) != layout_.world) {
    throw std::invalid_argument("open_peers needs one segment name per rank (" +
                                std::to_string(layout_.world) + "), got " +
                                std::to_string(names.size()));
  }
  if (names[rank_] != name_) {
    throw std::invalid_argument("open_peers: names[" + std::to_string(rank_) + "] is '" +
                                names[rank_] + "', expected this rank's own segment '" + name_ +
                                "'; were the names gathered in rank order?");
  }
  // A previous attempt may have failed half-way: start from a clean slate.
  for (int peer = 0; peer < layout_.world; ++peer) {
    if (peer != rank_ && bases_[peer] != nullptr) {
      munmap(bases_[peer], layout_.total_bytes);
      bases_[peer] = nullptr;
    }
  }
  for (int peer = 0; peer < layout_.world; ++peer) {
    if (peer == rank_) continue;
    const std::string& peer_name = names[peer];
    const std::string who = "rank " + std::to_string(rank_) + ": rank " + std::to_string(peer) +
                            "'s segment '" + peer_name + "'";
    const int fd = shm_open(peer_name.c_str(), O_RDWR, 0);
    if (fd < 0) {
      const int err = errno;
      throw std::runtime_error(who + " cannot be opened: " + errno_text(err) +
                               " (was it unlinked before every rank had mapped it?)");
    }
    struct stat info {};
    if (fstat(fd, &info) != 0) {
      const int err = errno;
      close(fd);
      throw std::runtime_error(who + " cannot be inspected: " + errno_text(err));
    }
    if (static_cast<uint64_t>(info.st_size) != layout_.total_bytes) {
      close(fd);
      throw std::runtime_error(who + " holds " + std::to_string(info.st_size) +
                               " bytes, expected " + std::to_string(layout_.total_bytes) +
                               " (layout.total_bytes): the ranks built different layouts");
    }
    void* base = mmap(nullptr, layout_.total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    const int err = errno;
    close(fd);
    if (base == MAP_FAILED) {
      throw std::runtime_error(who + " cannot be mapped: " + errno_text(err));
    }
    bases_[peer] = static_cast<uint8_t*>(base);
  }
  peers_open_ = true;
}

// ---------------------------------------------------------------- the executor

void HostShmWorkspace::validate_call(const plan::Program& program, plan::DType dtype, int blocks,
                                     const void* input, const void* output, int64_t numel) const {
  const int elem = plan::dtype_bytes(dtype);
  const std::string what = "host_shm all-reduce of " + std::to_string(numel) + " " +
                           std::string(plan::dtype_name(dtype)) + " elements";
  if (elem > layout_.elem_bytes) {
    throw std::invalid_argument(
        what + ": the workspace holds " + std::to_string(layout_.elem_bytes) + "-byte elements, " +
        std::string(plan::dtype_name(dtype)) + " needs " + std::to_string(elem));
  }
  if (numel < 0 || numel > layout_.max_numel) {
    throw std::invalid_argument(what + ": numel must be 0.." + std::to_string(layout_.max_numel) +
                                " (the workspace's max_numel)");
  }
  if (numel > static_cast<int64_t>(UINT32_MAX)) {
    throw std::invalid_argument(what + ": numel must fit in 32 bits (flags carry it)");
  }
  if ((numel * elem) % plan::kVectorBytes != 0) {
    throw std::invalid_argument(what + ": the message must be a multiple of " +
                                std::to_string(plan::kVectorBytes) + " bytes, got " +
                                std::to_string(numel * elem) + " bytes");
  }
  if (blocks < 1 || blocks > layout_.max_blocks) {
    throw std::invalid_argument(what + ": blocks must be 1.." + std::to_string(layout_.max_blocks) +
                                ", got " + std::to_string(blocks));
  }
  if (numel > 0 && (input == nullptr || output == nullptr)) {
    throw std::invalid_argument(what + ": input and output must not be null");
  }
  if (numel > 0 && input != output) {
    const auto in = reinterpret_cast<uintptr_t>(input);
    const auto out = reinterpret_cast<uintptr_t>(output);
    const auto bytes = static_cast<uintptr_t>(numel * elem);
    if (in < out + bytes && out < in + bytes) {
      throw std::invalid_argument(what +
                                  ": input and output overlap partially; pass the same pointer "
                                  "for in-place or disjoint buffers");
    }
  }
  validate_program(program, layout_, rank_);
}

void HostShmWorkspace::fail(const plan::Diagnostic& diagnostic) {
  failed_ = true;
  failure_ = diagnostic;
  std::string message = plan::describe_failure(diagnostic, timeout_s_);
  const bool out_of_step = diagnostic.kind == static_cast<uint32_t>(plan::FailureKind::kMismatch) &&
                           diagnostic.gen_seen != diagnostic.gen_expected;
  if (out_of_step) {
    message += "; rank " + std::to_string(diagnostic.peer) + " is already at generation " +
               std::to_string(diagnostic.gen_seen) + ": the ranks fell out of step";
  }
  throw TransportFailure(diagnostic, std::move(message));
}

void HostShmWorkspace::run(const plan::Program& program, plan::DType dtype, int blocks,
                           const void* input, void* output, int64_t numel, uint32_t signature) {
  validate_call(program, dtype, blocks, input, output, numel);
  if (failed_) {
    throw TransportFailure(failure_,
                           "rank " + std::to_string(rank_) +
                               ": the host_shm workspace is out of step with its peers after an "
                               "earlier failure (" +
                               plan::describe_failure(failure_, timeout_s_) +
                               "); recreate it on every rank");
  }
  if (!peers_open_) {
    throw std::logic_error("rank " + std::to_string(rank_) +
                           ": run() before open_peers(); map every peer's segment first");
  }

  const ReduceFn reduce = reducer_for(dtype);
  const int64_t num_vecs = numel * plan::dtype_bytes(dtype) / plan::kVectorBytes;
  const auto numel32 = static_cast<uint32_t>(numel);
  const auto rank32 = static_cast<uint32_t>(rank_);
  const bool bounded = timeout_s_ > 0.0 && timeout_s_ < kMaxFiniteTimeoutS;
  const auto timeout = std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(bounded ? timeout_s_ : 0.0));
  auto* const input_bytes = static_cast<uint8_t*>(const_cast<void*>(input));
  auto* const output_bytes = static_cast<uint8_t*>(output);
  uint8_t* const own = bases_[rank_];

  for (int block = 0; block < blocks; ++block) {
    // The generation lives in the workspace and only this executor advances it.
    auto& counter = *reinterpret_cast<uint32_t*>(own + layout_.gen_counter_offset(block));
    const uint32_t gen = std::atomic_ref<uint32_t>(counter).load(std::memory_order_relaxed) + 1;
    const int parity = plan::gen_parity(gen);

    const auto resolve = [&](const BufRef& ref, int64_t first_vec) -> uint8_t* {
      uint8_t* base = nullptr;
      switch (ref.space) {
        case Space::kInput:
          base = input_bytes;
          break;
        case Space::kOutput:
          base = output_bytes;
          break;
        case Space::kSlot:
          base = bases_[ref.owner] + layout_.slot_offset(parity, ref.slot);
          break;
      }
      return base + first_vec * plan::kVectorBytes;
    };
    // What this rank records when a wait fails: where it was, whom it waited for, what it saw.
    const auto diagnose = [&](plan::FailureKind kind, int index, const Step& step, uint32_t seen,
                              uint32_t peer_numel, uint32_t peer_signature) {
      plan::Diagnostic d{};
      d.kind = static_cast<uint32_t>(kind);
      d.rank = rank32;
      d.peer = step.peer;
      d.step = static_cast<uint32_t>(index);
      d.stage = step.stage;
      d.block = static_cast<uint32_t>(block);
      d.flag = step.flag;
      d.flag_owner = step.flag_owner;
      d.gen_seen = seen;
      d.gen_expected = gen;
      d.numel = numel32;
      d.signature = signature;
      d.peer_numel = peer_numel;
      d.peer_signature = peer_signature;
      return d;
    };
    const auto flag_at = [&](const Step& step) {
      return reinterpret_cast<FlagWord*>(bases_[step.flag_owner] +
                                         layout_.flag_offset(parity, block, step.flag));
    };

    for (int index = 0; index < program.num_steps; ++index) {
      const Step& step = program.steps[index];
      switch (step.kind) {
        case StepKind::kReduce: {
          const plan::VecRange range =
              plan::slice_range(num_vecs, program.num_chunks, step.chunk, blocks, block);
          const int64_t count = range.end - range.begin;
          if (count <= 0) break;
          uint8_t* dst = resolve(step.dst, range.begin);
          const uint8_t* srcs[plan::kMaxSources];
          for (int s = 0; s < step.num_srcs; ++s) srcs[s] = resolve(step.srcs[s], range.begin);
          if (step.num_srcs == 1) {
            // A copy moves bits untouched (NaN payloads included); in-place is a no-op.
            if (dst != srcs[0]) std::memmove(dst, srcs[0], count * plan::kVectorBytes);
          } else {
            reduce(dst, srcs, step.num_srcs, count);
          }
          break;
        }
        case StepKind::kSignal: {
          FlagWord* flag = flag_at(step);
          std::atomic_ref<uint32_t>(flag->numel).store(numel32, std::memory_order_relaxed);
          std::atomic_ref<uint32_t>(flag->signature).store(signature, std::memory_order_relaxed);
          std::atomic_ref<uint32_t>(flag->writer).store(rank32, std::memory_order_relaxed);
          // Release: the payload stores above (data and call identity) happen-before any
          // reader that acquires this generation.
          std::atomic_ref<uint32_t>(flag->gen).store(gen, std::memory_order_release);
          break;
        }
        case StepKind::kWait: {
          FlagWord* flag = flag_at(step);
          const std::atomic_ref<uint32_t> flag_gen(flag->gen);
          uint32_t seen = flag_gen.load(std::memory_order_acquire);
          for (int poll = 0; !plan::gen_reached(seen, gen) && poll < kSpinPolls; ++poll) {
            cpu_relax();
            seen = flag_gen.load(std::memory_order_acquire);
          }
          if (!plan::gen_reached(seen, gen)) {
            const auto deadline = std::chrono::steady_clock::now() + timeout;
            for (int poll = 1; !plan::gen_reached(seen, gen); ++poll) {
              sched_yield();
              seen = flag_gen.load(std::memory_order_acquire);
              if (bounded && poll % kPollsPerClockCheck == 0 &&
                  std::chrono::steady_clock::now() >= deadline) {
                seen = flag_gen.load(std::memory_order_acquire);
                if (plan::gen_reached(seen, gen)) break;
                fail(diagnose(plan::FailureKind::kTimeout, index, step, seen, 0, 0));
              }
            }
          }
          // The peer entered this generation; make sure it entered it with the same call. A
          // generation past ours means the ranks fell out of step (an earlier failure).
          const uint32_t peer_numel =
              std::atomic_ref<uint32_t>(flag->numel).load(std::memory_order_relaxed);
          const uint32_t peer_signature =
              std::atomic_ref<uint32_t>(flag->signature).load(std::memory_order_relaxed);
          if (peer_numel != numel32 || peer_signature != signature || seen != gen) {
            fail(diagnose(plan::FailureKind::kMismatch, index, step, seen, peer_numel,
                          peer_signature));
          }
          break;
        }
      }
    }

    // Advance every counter of this block's residue class, so all counters stay equal
    // whatever block count the next call uses. Every own flag of this parity in those blocks
    // takes the generation too: a flag this call's schedule or block count left unused would
    // otherwise fall 2^31 generations behind during a long run of other calls and then read as
    // "reached" by the modulo-2^32 compare. Safe because every write peers make to our flags in
    // this call has landed (we waited for each), and no peer writes this parity again before
    // this rank has started the next call. The CUDA executor does the same (finish_call).
    for (int other = block; other < layout_.max_blocks; other += blocks) {
      auto& target = *reinterpret_cast<uint32_t*>(own + layout_.gen_counter_offset(other));
      std::atomic_ref<uint32_t>(target).store(gen, std::memory_order_relaxed);
      for (int f = 0; f < layout_.num_flags; ++f) {
        auto* word = reinterpret_cast<FlagWord*>(own + layout_.flag_offset(parity, other, f));
        std::atomic_ref<uint32_t>(word->gen).store(gen, std::memory_order_relaxed);
      }
    }
  }
}

}  // namespace pcie_ar::transport
