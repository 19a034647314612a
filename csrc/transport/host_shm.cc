// host_shm: how the plan executor runs over POSIX shared memory. The protocol itself (flags,
// LL words, generations, parity double buffer, diagnostics) is plan/protocol.h and the
// arithmetic is host_reduce.h; this file only maps memory, moves 16-byte vectors and polls
// flags.
#include "transport/host_shm.h"

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <utility>

#include "transport/host_reduce.h"

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
static_assert(std::atomic_ref<uint64_t>::is_always_lock_free);

// LL operands are decoded into (and LL destinations encoded from) tiles of this many vectors
// on the stack: 1 KiB of payload, in L1 while the reduce uses it.
constexpr int64_t kLLTileVecs = 64;
constexpr int kWordsPerVec = plan::kVectorBytes / sizeof(uint32_t);  // one LL word per payload word
// A reduce with two destinations sums this many vectors (8 KiB: operands and result stay in a
// 32 KiB L1) into the first, then copies them to the second.
constexpr int64_t kFusedTileVecs = 512;

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

// Every segment name starts with this (tests/python/conftest.py scans /dev/shm for it), followed
// by the creator's pid and a '.': "/pcie_ar.<pid>.<64-bit random hex>.r<rank>".
constexpr char kSegmentPrefix[] = "pcie_ar.";
// Where glibc's shm_open() keeps its names (Linux).
constexpr char kShmDirectory[] = "/dev/shm";

// The creator pid of a /dev/shm entry named "pcie_ar.<pid>.<anything>", or 0 when the name does
// not have that form (no digits, leading zero, no '.' after them, a pid that cannot be one).
pid_t creator_of(const char* entry) {
  const size_t prefix = sizeof(kSegmentPrefix) - 1;
  if (std::strncmp(entry, kSegmentPrefix, prefix) != 0) return 0;
  const char* p = entry + prefix;
  if (*p < '1' || *p > '9') return 0;  // also rules out pid 0 (kill(0, ...) is our own group)
  long long pid = 0;
  for (; *p >= '0' && *p <= '9'; ++p) {
    pid = pid * 10 + (*p - '0');
    if (pid > 0x7fffffff) return 0;
  }
  if (*p != '.' || p[1] == '\0') return 0;
  return static_cast<pid_t>(pid);
}

std::string make_segment_name(int rank) {
  std::random_device device;
  const uint64_t random = (static_cast<uint64_t>(device()) << 32) ^ device();
  char buffer[96];
  std::snprintf(buffer, sizeof(buffer), "/pcie_ar.%ld.%016llx.r%d", static_cast<long>(getpid()),
                static_cast<unsigned long long>(random), rank);
  return buffer;
}
}  // namespace

// ---------------------------------------------------------------- segment lifecycle

int HostShmWorkspace::reclaim_orphaned_segments() noexcept {
  DIR* dir = opendir(kShmDirectory);
  if (dir == nullptr) return 0;  // not Linux, or no /dev/shm: nothing we can find
  const uid_t me = geteuid();
  int reclaimed = 0;
  while (const dirent* entry = readdir(dir)) {
    const pid_t creator = creator_of(entry->d_name);
    if (creator <= 0) continue;
    struct stat info {};
    if (fstatat(dirfd(dir), entry->d_name, &info, AT_SYMLINK_NOFOLLOW) != 0) continue;
    if (!S_ISREG(info.st_mode) || info.st_uid != me) continue;  // never another user's
    // ESRCH only: EPERM means the pid is alive (another user's process, maybe a recycled pid).
    // A zombie still counts as alive until it is reaped. A recycled pid keeps an orphan until
    // that process ends too: leaking for a while is acceptable, unlinking a live segment is not.
    if (kill(creator, 0) == 0 || errno != ESRCH) continue;
    const std::string name = std::string("/") + entry->d_name;
    if (shm_unlink(name.c_str()) == 0) ++reclaimed;
  }
  closedir(dir);
  return reclaimed;
}

HostShmWorkspace::HostShmWorkspace(const plan::Layout& layout, int rank, uint32_t initial_gen,
                                   double timeout_s)
    : Workspace(layout, rank), timeout_s_(timeout_s), creator_pid_(getpid()) {
  plan::check_layout(layout);
  if (rank < 0 || rank >= layout.world) {
    throw std::invalid_argument("rank must be 0.." + std::to_string(layout.world - 1) + ", got " +
                                std::to_string(rank));
  }
  if (!(timeout_s >= 0.0)) {
    throw std::invalid_argument("timeout_s must be >= 0 (0 waits forever), got " +
                                std::to_string(timeout_s));
  }
  bases_.assign(layout.world, nullptr);
  reclaim_orphaned_segments();
  create_segment(initial_gen);
}

// Sizes our fresh segment and reserves its pages.
void HostShmWorkspace::size_segment(int fd) const {
  const auto size = static_cast<off_t>(layout().total_bytes);
  int truncated = 0;
  do {
    truncated = ftruncate(fd, size);
  } while (truncated != 0 && errno == EINTR);
  if (truncated != 0) {
    const int err = errno;
    throw std::runtime_error("rank " + std::to_string(rank()) + ": ftruncate(" + segment_name_ +
                             ", " + std::to_string(layout().total_bytes) +
                             " bytes) failed: " + errno_text(err));
  }
  // tmpfs hands out pages lazily; reserving them now turns a too-small /dev/shm (Docker's
  // default is 64 MiB) into this error instead of a SIGBUS in the middle of an all-reduce.
  int reserve = 0;
  do {
    reserve = posix_fallocate(fd, 0, size);
  } while (reserve == EINTR);
  if (reserve != 0 && reserve != EOPNOTSUPP && reserve != EINVAL) {
    throw std::runtime_error("rank " + std::to_string(rank()) + ": cannot reserve " +
                             std::to_string(layout().total_bytes) + " bytes of shared memory for " +
                             segment_name_ + ": " + errno_text(reserve) +
                             "; enlarge /dev/shm (docker run --shm-size) or lower max_numel");
  }
}

// Creates, sizes and maps our segment under a fresh unique name, then writes its control area.
void HostShmWorkspace::create_segment(uint32_t initial_gen) {
  int fd = -1;
  // 64 random bits make a collision practically impossible; retrying covers the remainder
  // instead of failing on a stale segment from a crashed process with a recycled pid.
  for (int attempt = 0; attempt < 8 && fd < 0; ++attempt) {
    segment_name_ = make_segment_name(rank());
    fd = shm_open(segment_name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 && errno != EEXIST) {
      const int err = errno;
      throw std::runtime_error("rank " + std::to_string(rank()) + ": shm_open(" + segment_name_ +
                               ") failed: " + errno_text(err) +
                               "; is /dev/shm mounted and writable?");
    }
  }
  if (fd < 0) {
    throw std::runtime_error("rank " + std::to_string(rank()) +
                             ": could not find an unused shared-memory name after 8 attempts");
  }
  linked_ = true;

  try {
    size_segment(fd);
    void* base = mmap(nullptr, layout().total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
      const int err = errno;
      throw std::runtime_error("rank " + std::to_string(rank()) + ": mmap(" + segment_name_ + ", " +
                               std::to_string(layout().total_bytes) +
                               " bytes) failed: " + errno_text(err));
    }
    bases_[rank()] = static_cast<uint8_t*>(base);
    close(fd);
    fd = -1;
    plan::initialize_control(base, layout(), initial_gen);
  } catch (...) {
    if (fd >= 0) close(fd);
    if (bases_[rank()] != nullptr) munmap(bases_[rank()], layout().total_bytes);
    shm_unlink(segment_name_.c_str());
    linked_ = false;
    throw;
  }
}

HostShmWorkspace::~HostShmWorkspace() { release(); }

void HostShmWorkspace::retire_token() noexcept {
  if (!linked_) return;
  // A forked child that inherited this object must not unlink its parent's segment.
  if (getpid() == creator_pid_) shm_unlink(segment_name_.c_str());
  linked_ = false;
}

void HostShmWorkspace::open_peers(const std::vector<std::string>& tokens) {
  if (peers_open_) {
    throw std::logic_error("rank " + std::to_string(rank()) + ": open_peers() was already called");
  }
  // This rank cannot reach the barrier after a failure here: unmap what was mapped and unlink our
  // name now, so nothing is left in /dev/shm even if this object lives on (a Python exception
  // keeps its frame alive), and a peer that has not opened us yet fails at once.
  try {
    if (static_cast<int>(tokens.size()) != layout().world) {
      throw std::invalid_argument("open_peers needs one segment name per rank (" +
                                  std::to_string(layout().world) + "), got " +
                                  std::to_string(tokens.size()));
    }
    if (tokens[rank()] != segment_name_) {
      throw std::invalid_argument("open_peers: tokens[" + std::to_string(rank()) + "] is '" +
                                  tokens[rank()] + "', expected this rank's own segment '" +
                                  segment_name_ + "'; were the names gathered in rank order?");
    }
    close_peers();  // a previous attempt may have failed half-way: start from a clean slate
    for (int peer = 0; peer < layout().world; ++peer) {
      if (peer == rank()) continue;
      const std::string& peer_name = tokens[peer];
      const std::string who = "rank " + std::to_string(rank()) + ": rank " + std::to_string(peer) +
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
      if (static_cast<uint64_t>(info.st_size) != layout().total_bytes) {
        close(fd);
        throw std::runtime_error(who + " holds " + std::to_string(info.st_size) +
                                 " bytes, expected " + std::to_string(layout().total_bytes) +
                                 " (layout.total_bytes): the ranks built different layouts");
      }
      void* base = mmap(nullptr, layout().total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      const int err = errno;
      close(fd);
      if (base == MAP_FAILED) {
        throw std::runtime_error(who + " cannot be mapped: " + errno_text(err));
      }
      bases_[peer] = static_cast<uint8_t*>(base);
    }
  } catch (...) {
    close_peers();
    retire_token();
    throw;
  }
  peers_open_ = true;
}

void HostShmWorkspace::open_peers_in_process(const std::vector<HostShmWorkspace*>& peers) {
  if (peers_open_) {
    throw std::logic_error("rank " + std::to_string(rank()) + ": open_peers() was already called");
  }
  if (static_cast<int>(peers.size()) != layout().world || peers[rank()] != this) {
    throw std::invalid_argument("open_peers_in_process needs one workspace per rank (" +
                                std::to_string(layout().world) + ") with this one at [" +
                                std::to_string(rank()) + "]");
  }
  for (int peer = 0; peer < layout().world; ++peer) {
    const HostShmWorkspace* other = peers[peer];
    if (other == nullptr || other->rank() != peer || !(other->layout() == layout()) ||
        other->bases_[peer] == nullptr) {
      throw std::invalid_argument("open_peers_in_process: entry " + std::to_string(peer) +
                                  " is not rank " + std::to_string(peer) +
                                  "'s live workspace of the same layout");
    }
  }
  close_peers();
  for (int peer = 0; peer < layout().world; ++peer) {
    if (peer != rank()) bases_[peer] = peers[peer]->bases_[peer];
  }
  peers_borrowed_ = true;
  peers_open_ = true;
}

void HostShmWorkspace::close_peers() {
  for (int peer = 0; peer < static_cast<int>(bases_.size()); ++peer) {
    if (peer != rank() && bases_[peer] != nullptr) {
      if (!peers_borrowed_) munmap(bases_[peer], layout().total_bytes);
      bases_[peer] = nullptr;
    }
  }
  peers_borrowed_ = false;
  peers_open_ = false;
}

void HostShmWorkspace::release() {
  close_peers();
  if (!bases_.empty() && bases_[rank()] != nullptr) {
    munmap(bases_[rank()], layout().total_bytes);
    bases_[rank()] = nullptr;
  }
  retire_token();
}

int HostShmWorkspace::install(const plan::Program& program) {
  programs_.push_back(program);
  return static_cast<int>(programs_.size()) - 1;
}

std::optional<plan::Diagnostic> HostShmWorkspace::failure() const { return failure_; }

// ---------------------------------------------------------------- the executor
namespace {

// How long a wait may poll: the deadline of every wait, or none.
struct WaitBudget {
  double seconds;  // as configured, for messages; 0 waits forever
  bool bounded;
  std::chrono::steady_clock::duration timeout;

  explicit WaitBudget(double timeout_s)
      : seconds(timeout_s),
        bounded(timeout_s > 0.0 && timeout_s < kMaxFiniteTimeoutS),
        timeout(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
            std::chrono::duration<double>(bounded ? timeout_s : 0.0))) {}
};

// Polls `load()` until `done(value)`: spins briefly, then yields (ranks may outnumber cores),
// calling `idle()` once per yield (the test hook). Returns the last value seen, which is not
// done only if the budget ran out.
template <typename Load, typename Done, typename Idle>
auto await_value(const Load& load, const Done& done, const WaitBudget& budget, const Idle& idle) {
  auto seen = load();
  for (int poll = 0; !done(seen) && poll < kSpinPolls; ++poll) {
    cpu_relax();
    seen = load();
  }
  if (done(seen)) return seen;
  const auto deadline = std::chrono::steady_clock::now() + budget.timeout;
  for (int poll = 1; !done(seen); ++poll) {
    idle();
    sched_yield();
    seen = load();
    if (budget.bounded && poll % kPollsPerClockCheck == 0 &&
        std::chrono::steady_clock::now() >= deadline) {
      return load();  // one last look
    }
  }
  return seen;
}

// One block's pass over a rank's step list: the host counterpart of the CUDA executor's CTA,
// with the same named pieces. Block b owns slice b of every chunk and its own flags.
class BlockPass {
 public:
  using StepHook = HostShmWorkspace::StepHook;

  BlockPass(const std::vector<uint8_t*>& bases, const plan::Layout& layout,
            const plan::Program& program, const Call& call, int rank, int block,
            const WaitBudget& budget, const StepHook* hook)
      : bases_(bases),
        layout_(layout),
        program_(program),
        call_(call),
        rank_(rank),
        block_(block),
        budget_(budget),
        hook_(hook) {
    // The generation lives in the workspace and only this executor advances it.
    const uint64_t gen =
        std::atomic_ref<uint64_t>(counter(block)).load(std::memory_order_relaxed) + 1;
    at_ = plan::CallPosition{static_cast<uint32_t>(rank), static_cast<uint32_t>(block), gen,
                             static_cast<uint32_t>(call.numel), call.signature};
    parity_ = plan::gen_parity(gen);
    tag_ = plan::ll_tag(gen, at_.numel, at_.signature);
    num_vecs_ = call.numel * plan::dtype_bytes(call.dtype) / plan::kVectorBytes;
  }

  void run_steps(ReduceFn reduce) const {
    for (int index = 0; index < program_.num_steps; ++index) {
      if (hook_ != nullptr) [[unlikely]] {
        (*hook_)(HostShmWorkspace::StepPoint{block_, index, false});
      }
      const Step& step = program_.steps[index];
      switch (step.kind) {
        case StepKind::kReduce:
          run_reduce(index, step, reduce);
          break;
        case StepKind::kSignal:
          raise_flag(step);
          break;
        case StepKind::kWait:
          wait_flag(index, step);
          break;
      }
    }
  }

  // End of the call (plan/protocol.h): the counters of this block's residue class take this
  // generation. Flags need nothing.
  void finish_call() const {
    for (int other = block_; other < layout_.max_blocks; other += call_.blocks) {
      std::atomic_ref<uint64_t>(counter(other)).store(at_.gen, std::memory_order_relaxed);
    }
  }

 private:
  uint64_t& counter(int block) const {
    return *reinterpret_cast<uint64_t*>(bases_[rank_] + layout_.gen_counter_offset(block));
  }

  uint8_t* resolve(const BufRef& ref, int64_t first_vec) const {
    uint8_t* base = nullptr;
    switch (ref.space) {
      case Space::kInput:
        base = static_cast<uint8_t*>(const_cast<void*>(call_.input));
        break;
      case Space::kOutput:
        base = static_cast<uint8_t*>(call_.output);
        break;
      case Space::kSlot:
        base = bases_[ref.owner] + layout_.slot_offset(parity_, ref.slot);
        break;
      case Space::kLL:
        return bases_[ref.owner] + layout_.ll_slot_offset(parity_, ref.slot) +
               first_vec * plan::kVectorBytes * plan::kLLExpansion;
    }
    return base + first_vec * plan::kVectorBytes;
  }

  static bool touches_ll(const Step& step) {
    if (step.dst.space == Space::kLL) return true;
    for (int s = 0; s < step.num_srcs; ++s) {
      if (step.srcs[s].space == Space::kLL) return true;
    }
    return false;
  }

  FlagWord* flag_word(const Step& step) const {
    return reinterpret_cast<FlagWord*>(bases_[step.flag_owner] +
                                       layout_.flag_offset(parity_, block_, step.flag));
  }

  void run_reduce(int index, const Step& step, ReduceFn reduce) const {
    const plan::VecRange range =
        plan::slice_range(num_vecs_, program_.num_chunks, step.chunk, call_.blocks, block_);
    if (range.end <= range.begin) return;
    if (touches_ll(step)) {
      for (int64_t v = range.begin; v < range.end; v += kLLTileVecs) {
        run_ll_tile(index, step, reduce, v, std::min(kLLTileVecs, range.end - v));
      }
      return;
    }
    uint8_t* dst = resolve(step.dst, range.begin);
    const uint8_t* srcs[plan::kMaxSources];
    for (int s = 0; s < step.num_srcs; ++s) srcs[s] = resolve(step.srcs[s], range.begin);
    const int64_t count = range.end - range.begin;
    if (step.num_dsts != 2) {
      combine(dst, srcs, step.num_srcs, count, reduce);
      return;
    }
    // Two destinations in one pass: each tile is summed into dst, then copied on to dst2 while
    // it is still in L1, instead of reading the whole result back from further away.
    uint8_t* dst2 = resolve(step.dst2, range.begin);
    for (int64_t v = 0; v < count; v += kFusedTileVecs) {
      const int64_t n = std::min(kFusedTileVecs, count - v);
      const int64_t at = v * plan::kVectorBytes;
      const uint8_t* tile[plan::kMaxSources];
      for (int s = 0; s < step.num_srcs; ++s) tile[s] = srcs[s] + at;
      combine(dst + at, tile, step.num_srcs, n, reduce);
      std::memcpy(dst2 + at, dst + at, n * plan::kVectorBytes);
    }
  }

  // dst = the sum of srcs; a copy moves bits untouched (NaN payloads included), in place is a
  // no-op.
  static void combine(uint8_t* dst, const uint8_t* const* srcs, int num_srcs, int64_t count,
                      ReduceFn reduce) {
    if (num_srcs == 1) {
      if (dst != srcs[0]) std::memmove(dst, srcs[0], count * plan::kVectorBytes);
    } else {
      reduce(dst, srcs, num_srcs, count);
    }
  }

  // One tile of a reduce that touches LL slots: every LL operand is awaited and decoded into a
  // stack tile (and its tags reset), the sum is formed as usual, and an LL destination is
  // written tagged. A single-operand step decodes or encodes in one pass.
  void run_ll_tile(int index, const Step& step, ReduceFn reduce, int64_t first,
                   int64_t count) const {
    alignas(64) uint8_t decoded[plan::kMaxSources][kLLTileVecs * plan::kVectorBytes];
    alignas(64) uint8_t summed[kLLTileVecs * plan::kVectorBytes];
    const bool ll_dst = step.dst.space == Space::kLL;
    const bool copy = step.num_srcs == 1;
    uint8_t* out = ll_dst ? summed : resolve(step.dst, first);
    const uint8_t* srcs[plan::kMaxSources];
    for (int s = 0; s < step.num_srcs; ++s) {
      const BufRef& src = step.srcs[s];
      if (src.space != Space::kLL) {
        srcs[s] = resolve(src, first);
        continue;
      }
      uint8_t* into = copy && !ll_dst ? out : decoded[s];
      await_ll(index, step, src, resolve(src, first), into, count);
      srcs[s] = into;
    }
    if (copy && ll_dst) {
      store_ll(srcs[0], resolve(step.dst, first), count);
      return;
    }
    if (!(copy && srcs[0] == out)) combine(out, srcs, step.num_srcs, count, reduce);
    if (ll_dst) store_ll(out, resolve(step.dst, first), count);
  }

  // Writes `count` payload vectors as LL words: one 64-bit release store per payload word (a
  // plain store on x86), so a reader that sees the tag sees the payload beside it.
  void store_ll(const uint8_t* payload, uint8_t* ll, int64_t count) const {
    const auto* words = reinterpret_cast<const uint32_t*>(payload);
    auto* out = reinterpret_cast<uint64_t*>(ll);
    for (int64_t i = 0; i < count * kWordsPerVec; ++i) {
      std::atomic_ref<uint64_t>(out[i]).store(plan::ll_word(words[i], tag_),
                                              std::memory_order_release);
    }
  }

  // Waits for `count` payload vectors of LL slot `src` (this rank's memory, at `ll`), copies
  // their payload to `payload`, and resets each word's tag to the stale parity.
  void await_ll(int index, const Step& step, const BufRef& src, uint8_t* ll, uint8_t* payload,
                int64_t count) const {
    auto* words = reinterpret_cast<uint64_t*>(ll);
    auto* out = reinterpret_cast<uint32_t*>(payload);
    const uint64_t stale = plan::ll_word(0, plan::ll_stale(tag_));
    // The writer stores the tile in order: wait for its last word first, so this core does not
    // chase the writer's core cache line by cache line. Every word is still checked below.
    const int64_t last = count * kWordsPerVec - 1;
    if (plan::ll_word_tag(std::atomic_ref<uint64_t>(words[last]).load(std::memory_order_acquire)) !=
        tag_) {
      await_ll_word(index, step, src, std::atomic_ref<uint64_t>(words[last]));
    }
    for (int64_t i = 0; i <= last; ++i) {
      const std::atomic_ref<uint64_t> word(words[i]);
      uint64_t seen = word.load(std::memory_order_acquire);
      if (plan::ll_word_tag(seen) != tag_) seen = await_ll_word(index, step, src, word);
      out[i] = plan::ll_word_payload(seen);
      word.store(stale, std::memory_order_relaxed);
    }
  }

  uint64_t await_ll_word(int index, const Step& step, const BufRef& src,
                         const std::atomic_ref<uint64_t>& word) const {
    const uint32_t expected = tag_;
    const uint64_t seen = await_value([&] { return word.load(std::memory_order_acquire); },
                                      [expected](uint64_t w) {
                                        const uint32_t tag = plan::ll_word_tag(w);
                                        return tag == expected || plan::ll_foreign(tag, expected);
                                      },
                                      budget_, [&] { idle(index); });
    const uint32_t tag = plan::ll_word_tag(seen);
    if (tag == expected) return seen;
    const auto kind = plan::ll_foreign(tag, expected) ? plan::FailureKind::kLLMismatch
                                                      : plan::FailureKind::kLLTimeout;
    fail(plan::make_ll_diagnostic(kind, at_, index, step, src, tag, expected));
  }

  void raise_flag(const Step& step) const {
    FlagWord* flag = flag_word(step);
    std::atomic_ref<uint32_t>(flag->numel).store(at_.numel, std::memory_order_relaxed);
    std::atomic_ref<uint32_t>(flag->signature).store(at_.signature, std::memory_order_relaxed);
    // Release: the payload stores above (data and call identity) happen-before any reader
    // that acquires this generation.
    std::atomic_ref<uint64_t>(flag->gen).store(at_.gen, std::memory_order_release);
  }

  void wait_flag(int index, const Step& step) const {
    FlagWord* flag = flag_word(step);
    const std::atomic_ref<uint64_t> gen(flag->gen);
    const uint64_t expected = at_.gen;
    plan::FlagSeen seen{
        await_value([&] { return gen.load(std::memory_order_acquire); },
                    [expected](uint64_t g) { return plan::gen_reached(g, expected); }, budget_,
                    [&] { idle(index); })};
    if (!plan::gen_reached(seen.gen, at_.gen)) {
      fail(plan::make_diagnostic(plan::FailureKind::kTimeout, at_, index, step, seen));
    }
    // Ordered after the acquire: the writer stored these before releasing gen.
    seen.numel = std::atomic_ref<uint32_t>(flag->numel).load(std::memory_order_relaxed);
    seen.signature = std::atomic_ref<uint32_t>(flag->signature).load(std::memory_order_relaxed);
    if (plan::is_mismatch(at_, seen)) {
      fail(plan::make_diagnostic(plan::FailureKind::kMismatch, at_, index, step, seen));
    }
  }

  // A wait of step `index` yields: the test hook, if any, may act.
  void idle(int index) const {
    if (hook_ != nullptr) [[unlikely]] {
      (*hook_)(HostShmWorkspace::StepPoint{block_, index, true});
    }
  }

  [[noreturn]] void fail(const plan::Diagnostic& d) const {
    throw TransportFailure(d, plan::describe_failure(d, budget_.seconds));
  }

  const std::vector<uint8_t*>& bases_;
  const plan::Layout& layout_;
  const plan::Program& program_;
  const Call& call_;
  int rank_;
  int block_;
  const WaitBudget& budget_;
  const StepHook* hook_;  // nullptr unless a test installed one
  plan::CallPosition at_{};
  int parity_ = 0;
  uint32_t tag_ = 0;  // every LL word of this call carries it
  int64_t num_vecs_ = 0;
};

}  // namespace

void HostShmWorkspace::run(const Call& call) {
  if (failure_) {
    throw TransportFailure(*failure_, "rank " + std::to_string(rank()) +
                                          ": the host_shm workspace is out of step with its "
                                          "peers after an earlier failure (" +
                                          plan::describe_failure(*failure_, timeout_s_) +
                                          "); recreate it on every rank");
  }
  const ReduceFn reduce = reducer_for(call.dtype);
  const WaitBudget budget(timeout_s_);
  const StepHook* hook = step_hook_ ? &step_hook_ : nullptr;
  try {
    for (int block = 0; block < call.blocks; ++block) {
      const BlockPass pass(bases_, layout(), programs_[call.program], call, rank(), block, budget,
                           hook);
      pass.run_steps(reduce);
      pass.finish_call();
    }
  } catch (const TransportFailure& e) {
    failure_ = e.diagnostic();
    throw;
  }
}

}  // namespace pcie_ar::transport
