// How the host executor walks a step list: 16-byte vectors, flags and LL words over plain
// pointers into every rank's memory. The protocol itself (flags, LL words, generations, parity
// double buffer, diagnostics) is plan/protocol.h and the arithmetic is reduce.h; see executor.h.
#include "transport/executors/host/executor.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>

#include "transport/executors/host/epilogue.h"
#include "transport/executors/host/float_env.h"
#include "transport/executors/host/reduce.h"

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
static_assert(plan::kLLHeaderBytes == plan::kLLExpansion * plan::kVectorBytes,
              "a lamport header is one tagged LL payload vector");
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
// A wait that has given its core away asks the interrupt check this often (an operator's Ctrl-C
// surfaces within it); a wait that ends within its spin never asks.
constexpr auto kInterruptCheckEvery = std::chrono::milliseconds(20);

// Tells the core a spin-wait is in progress (frees pipeline resources for a sibling
// hyperthread, which may be the peer we wait for).
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// How long a wait may poll: the deadline of every wait, or none, and what may end it early.
struct WaitBudget {
  double seconds;  // as configured, for messages; 0 waits forever
  bool bounded;
  std::chrono::steady_clock::duration timeout;
  const HostExecutor::InterruptCheck* interrupt;  // nullptr when none is installed

  WaitBudget(double timeout_s, const HostExecutor::InterruptCheck* interrupt_check)
      : seconds(timeout_s),
        bounded(timeout_s > 0.0 && timeout_s < kMaxFiniteTimeoutS),
        timeout(std::chrono::duration_cast<std::chrono::steady_clock::duration>(
            std::chrono::duration<double>(bounded ? timeout_s : 0.0))),
        interrupt(interrupt_check) {}
};

// Polls `load()` until `done(value)`: spins briefly, then yields (ranks may outnumber cores),
// calling `idle()` once per yield (the test hook). Every few yields it reads the clock, for the
// deadline and, every kInterruptCheckEvery, for the interrupt check: `interrupted()` (which does
// not return) when the check says stop. Returns the last value seen, which is not done only if
// the budget ran out.
template <typename Load, typename Done, typename Idle, typename Interrupted>
auto await_value(const Load& load, const Done& done, const WaitBudget& budget, const Idle& idle,
                 const Interrupted& interrupted) {
  auto seen = load();
  for (int poll = 0; !done(seen) && poll < kSpinPolls; ++poll) {
    cpu_relax();
    seen = load();
  }
  if (done(seen)) return seen;
  const bool clocked = budget.bounded || budget.interrupt != nullptr;
  auto now = std::chrono::steady_clock::now();
  const auto deadline = now + budget.timeout;
  auto next_interrupt_check = now;
  for (int poll = 1; !done(seen); ++poll) {
    idle();
    sched_yield();
    seen = load();
    if (!clocked || poll % kPollsPerClockCheck != 0) continue;
    now = std::chrono::steady_clock::now();
    if (budget.bounded && now >= deadline) return load();  // one last look
    if (budget.interrupt != nullptr && now >= next_interrupt_check) {
      next_interrupt_check = now + kInterruptCheckEvery;
      if ((*budget.interrupt)()) interrupted();
    }
  }
  return seen;
}

// One block's pass over a rank's step list: the host counterpart of the CUDA executor's CTA,
// with the same named pieces. Block b owns slice b of every chunk and its own flags.
class BlockPass {
 public:
  using StepHook = HostExecutor::StepHook;

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
    dense_ = program.ll_format == plan::LLFormat::kDense;
    elem_bytes_ = plan::dtype_bytes(call.dtype);
    num_vecs_ = call.numel * plan::dtype_bytes(call.dtype) / plan::kVectorBytes;
    stride_vecs_ = call.chunk_stride * plan::dtype_bytes(call.dtype) / plan::kVectorBytes;
  }

  void run_steps(ReduceFn reduce) const {
    for (int index = 0; index < program_.num_steps; ++index) {
      if (hook_ != nullptr) [[unlikely]] {
        (*hook_)(HostExecutor::StepPoint{block_, index, false});
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
        case StepKind::kEpilogue:
          break;  // HostExecutor::run, once every slice is done (the slices run in turn)
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

  // Where message vector first_vec of chunk `chunk` (the step's) lives in `ref`'s space. The
  // call's tensors may hold their chunks chunk_stride apart (a streamed collective's round).
  uint8_t* resolve(const BufRef& ref, int64_t first_vec, int chunk) const {
    uint8_t* base = nullptr;
    switch (ref.space) {
      case Space::kInput:
      case Space::kOutput:
        base = static_cast<uint8_t*>(ref.space == Space::kInput ? const_cast<void*>(call_.input)
                                                                : call_.output);
        first_vec += plan::chunk_shift(num_vecs_, program_.num_chunks, chunk, stride_vecs_);
        break;
      case Space::kSlot:
        base = bases_[ref.owner] + layout_.slot_offset(parity_, ref.slot);
        break;
      case Space::kLL:
        return bases_[ref.owner] + layout_.ll_slot_offset(parity_, ref.slot) +
               first_vec * plan::kVectorBytes * (dense_ ? 1 : plan::kLLExpansion);
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
      if (dense_) exchange_headers(index, step);
      for (int64_t v = range.begin; v < range.end; v += kLLTileVecs) {
        run_ll_tile(index, step, reduce, v, std::min(kLLTileVecs, range.end - v));
      }
      return;
    }
    uint8_t* dst = resolve(step.dst, range.begin, step.chunk);
    const uint8_t* srcs[plan::kMaxSources];
    for (int s = 0; s < step.num_srcs; ++s)
      srcs[s] = resolve(step.srcs[s], range.begin, step.chunk);
    const int64_t count = range.end - range.begin;
    if (step.num_dsts != 2) {
      combine(dst, srcs, step, count, reduce);
      return;
    }
    // Two destinations in one pass: each tile is summed into dst, then copied on to dst2 while
    // it is still in L1, instead of reading the whole result back from further away.
    uint8_t* dst2 = resolve(step.dst2, range.begin, step.chunk);
    for (int64_t v = 0; v < count; v += kFusedTileVecs) {
      const int64_t n = std::min(kFusedTileVecs, count - v);
      const int64_t at = v * plan::kVectorBytes;
      const uint8_t* tile[plan::kMaxSources];
      for (int s = 0; s < step.num_srcs; ++s) tile[s] = srcs[s] + at;
      combine(dst + at, tile, step, n, reduce);
      std::memcpy(dst2 + at, dst + at, n * plan::kVectorBytes);
    }
  }

  // dst = the sum of srcs as `step` associates it (plan::Step::split); a copy moves bits
  // untouched (NaN payloads included), in place is a no-op.
  static void combine(uint8_t* dst, const uint8_t* const* srcs, const Step& step, int64_t count,
                      ReduceFn reduce) {
    if (step.num_srcs == 1) {
      if (dst != srcs[0]) std::memmove(dst, srcs[0], count * plan::kVectorBytes);
    } else if (step.split == 0) {
      reduce(dst, srcs, step.num_srcs, count);
    } else {
      sum_split(dst, srcs, step.num_srcs, step.split, count, reduce);
    }
  }

  // A split sum, a tile at a time: each group's sum is rounded into an L1 tile by the same
  // reducer (a group of one is its operand), then the two tiles are summed into dst — what an
  // island tactic computes through its partial slot, bit for bit. Both tiles are whole before
  // dst is stored, so dst may alias a source.
  static void sum_split(uint8_t* dst, const uint8_t* const* srcs, int num_srcs, int split,
                        int64_t count, ReduceFn reduce) {
    alignas(64) uint8_t partials[2][kFusedTileVecs * plan::kVectorBytes];
    for (int64_t v = 0; v < count; v += kFusedTileVecs) {
      const int64_t n = std::min(kFusedTileVecs, count - v);
      const int64_t at = v * plan::kVectorBytes;
      const uint8_t* tile[plan::kMaxSources];
      for (int s = 0; s < num_srcs; ++s) tile[s] = srcs[s] + at;
      const uint8_t* sums[2];
      const int first[2] = {0, split};
      const int size[2] = {split, num_srcs - split};
      for (int g = 0; g < 2; ++g) {
        if (size[g] == 1) {
          sums[g] = tile[first[g]];
          continue;
        }
        reduce(partials[g], tile + first[g], size[g], n);
        sums[g] = partials[g];
      }
      reduce(dst + at, sums, 2, n);
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
    uint8_t* out = ll_dst ? summed : resolve(step.dst, first, step.chunk);
    const uint8_t* srcs[plan::kMaxSources];
    for (int s = 0; s < step.num_srcs; ++s) {
      const BufRef& src = step.srcs[s];
      if (src.space != Space::kLL) {
        srcs[s] = resolve(src, first, step.chunk);
        continue;
      }
      uint8_t* into = copy && !ll_dst ? out : decoded[s];
      await_ll(index, step, src, resolve(src, first, step.chunk), into, count, dense_);
      srcs[s] = into;
    }
    if (copy && ll_dst) {
      store_ll(srcs[0], resolve(step.dst, first, step.chunk), count, dense_);
      return;
    }
    if (!(copy && srcs[0] == out)) combine(out, srcs, step, count, reduce);
    if (ll_dst) store_ll(out, resolve(step.dst, first, step.chunk), count, dense_);
  }

  // Writes `count` payload vectors as LL words: one 64-bit release store per payload word (a
  // plain store on x86), so a reader that sees the tag sees the payload beside it. `dense`
  // (lamport): the payload words themselves, none of them kLLEmpty (plan::ll_dense_word).
  void store_ll(const uint8_t* payload, uint8_t* ll, int64_t count, bool dense) const {
    const auto* words = reinterpret_cast<const uint32_t*>(payload);
    if (dense) {
      auto* out = reinterpret_cast<uint32_t*>(ll);
      for (int64_t i = 0; i < count * kWordsPerVec; ++i) {
        std::atomic_ref<uint32_t>(out[i]).store(plan::ll_dense_word(words[i], elem_bytes_),
                                                std::memory_order_release);
      }
      return;
    }
    auto* out = reinterpret_cast<uint64_t*>(ll);
    for (int64_t i = 0; i < count * kWordsPerVec; ++i) {
      std::atomic_ref<uint64_t>(out[i]).store(plan::ll_word(words[i], tag_),
                                              std::memory_order_release);
    }
  }

  // Waits for `count` payload vectors of LL slot `src` (this rank's memory, at `ll`), copies
  // their payload to `payload`, and leaves every word it read kLLEmpty.
  void await_ll(int index, const Step& step, const BufRef& src, uint8_t* ll, uint8_t* payload,
                int64_t count, bool dense) const {
    auto* out = reinterpret_cast<uint32_t*>(payload);
    // The writer stores the tile in order: wait for its last word first, so this core does not
    // chase the writer's core cache line by cache line. Every word is still checked below.
    const int64_t last = count * kWordsPerVec - 1;
    if (dense) {
      auto* words = reinterpret_cast<uint32_t*>(ll);
      if (std::atomic_ref<uint32_t>(words[last]).load(std::memory_order_acquire) ==
          plan::kLLEmpty) {
        await_dense_word(index, step, src, std::atomic_ref<uint32_t>(words[last]));
      }
      for (int64_t i = 0; i <= last; ++i) {
        const std::atomic_ref<uint32_t> word(words[i]);
        uint32_t seen = word.load(std::memory_order_acquire);
        if (seen == plan::kLLEmpty) seen = await_dense_word(index, step, src, word);
        out[i] = seen;
        word.store(plan::kLLEmpty, std::memory_order_relaxed);
      }
      return;
    }
    auto* words = reinterpret_cast<uint64_t*>(ll);
    const uint64_t empty = plan::ll_word(plan::kLLEmpty, plan::kLLEmpty);
    if (plan::ll_word_tag(std::atomic_ref<uint64_t>(words[last]).load(std::memory_order_acquire)) !=
        tag_) {
      await_ll_word(index, step, src, std::atomic_ref<uint64_t>(words[last]));
    }
    for (int64_t i = 0; i <= last; ++i) {
      const std::atomic_ref<uint64_t> word(words[i]);
      uint64_t seen = word.load(std::memory_order_acquire);
      if (plan::ll_word_tag(seen) != tag_) seen = await_ll_word(index, step, src, word);
      out[i] = plan::ll_word_payload(seen);
      word.store(empty, std::memory_order_relaxed);
    }
  }

  // Lamport, before a step's data (plan/protocol.h): a step that writes an LL slot stores the
  // header of its slice, a zero payload vector as tagged LL words; a step that reads one awaits
  // each operand's header and resets it like any tagged LL vector, so a peer in another call
  // fails the step here instead of being summed.
  void exchange_headers(int index, const Step& step) const {
    alignas(16) uint8_t header[plan::kVectorBytes] = {};
    if (step.dst.space == Space::kLL) {
      store_ll(header, header_of(step.dst, step.chunk), 1, /*dense=*/false);
    }
    for (int s = 0; s < step.num_srcs; ++s) {
      const BufRef& src = step.srcs[s];
      if (src.space == Space::kLL) {
        await_ll(index, step, src, header_of(src, step.chunk), header, 1, /*dense=*/false);
      }
    }
  }

  uint8_t* header_of(const BufRef& ref, int chunk) const {
    return bases_[ref.owner] + layout_.ll_header_offset(parity_, ref.slot, chunk, block_);
  }

  // A Lamport word carries no tag: it either arrives or times out (the header names a call).
  uint32_t await_dense_word(int index, const Step& step, const BufRef& src,
                            const std::atomic_ref<uint32_t>& word) const {
    const uint32_t seen =
        await_value([&] { return word.load(std::memory_order_acquire); },
                    [](uint32_t w) { return w != plan::kLLEmpty; }, budget_, [&] { idle(index); },
                    [&] { interrupted(index, step, src.writer); });
    if (seen != plan::kLLEmpty) return seen;
    fail(
        plan::make_ll_diagnostic(plan::FailureKind::kLLTimeout, at_, index, step, src, seen, tag_));
  }

  uint64_t await_ll_word(int index, const Step& step, const BufRef& src,
                         const std::atomic_ref<uint64_t>& word) const {
    const uint32_t expected = tag_;
    const uint64_t seen =
        await_value([&] { return word.load(std::memory_order_acquire); },
                    [expected](uint64_t w) {
                      const uint32_t tag = plan::ll_word_tag(w);
                      return tag == expected || plan::ll_foreign(tag, expected);
                    },
                    budget_, [&] { idle(index); }, [&] { interrupted(index, step, src.writer); });
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
                    [&] { idle(index); }, [&] { interrupted(index, step, step.peer); })};
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
      (*hook_)(HostExecutor::StepPoint{block_, index, true});
    }
  }

  // The interrupt check said stop while step `index` waited for rank `awaited` (the flag's
  // raiser, or the LL data's writer).
  [[noreturn]] void interrupted(int index, const Step& step, uint32_t awaited) const {
    plan::Diagnostic d =
        plan::make_diagnostic(plan::FailureKind::kInterrupted, at_, index, step, {});
    d.peer = awaited;
    fail(d);
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
  uint32_t tag_ = 0;    // every LL word (and Lamport header) of this call carries it
  bool dense_ = false;  // the program's LL slots are Lamport (plan::LLFormat::kDense)
  int elem_bytes_ = 0;
  int64_t num_vecs_ = 0;
  int64_t stride_vecs_ = 0;  // Call::chunk_stride in vectors; 0: the message's own chunks
};

// HostExecutor::Mutant's program: the sums' operands dropped or reversed.
plan::Program mutated(plan::Program program, HostExecutor::Mutant mutant) {
  for (int i = 0; i < program.num_steps; ++i) {
    plan::Step& s = program.steps[i];
    if (s.kind != StepKind::kReduce || s.num_srcs < 2) continue;
    if (mutant == HostExecutor::Mutant::kDropOperand) {
      --s.num_srcs;
      if (s.split >= s.num_srcs) s.split = 0;
    } else {
      const int split = s.split;
      std::reverse(s.srcs, s.srcs + (split > 0 ? split : s.num_srcs));
      if (split > 0) std::reverse(s.srcs + split, s.srcs + s.num_srcs);
    }
  }
  return program;
}

}  // namespace

HostExecutor::HostExecutor(double timeout_s) : timeout_s_(timeout_s) {
  if (!(timeout_s >= 0.0)) {
    throw std::invalid_argument("timeout_s must be >= 0 (0 waits forever), got " +
                                std::to_string(timeout_s));
  }
}

int HostExecutor::install(const plan::Program& program) {
  programs_.push_back(program);
  return static_cast<int>(programs_.size()) - 1;
}

void HostExecutor::run(const std::vector<uint8_t*>& bases, const plan::Layout& layout, int rank,
                       const Call& call) {
  const DefaultFloatEnv float_env;  // the GPU's arithmetic, whatever mode the caller set
  const ReduceFn reduce = reducer_for(call.dtype);
  const WaitBudget budget(timeout_s_, interrupt_check_ ? &interrupt_check_ : nullptr);
  const StepHook* hook = step_hook_ ? &step_hook_ : nullptr;
  std::optional<plan::Program> mutant;  // tests only
  if (mutant_ != Mutant::kNone) [[unlikely]] {
    mutant = mutated(programs_[call.program], mutant_);
  }
  const plan::Program& program = mutant ? *mutant : programs_[call.program];
  try {
    for (int block = 0; block < call.blocks; ++block) {
      const BlockPass pass(bases, layout, program, call, rank, block, budget, hook);
      pass.run_steps(reduce);
      pass.finish_call();
    }
    if (program.num_steps > 0 && program.steps[program.num_steps - 1].kind == StepKind::kEpilogue) {
      run_epilogue(call.dtype, call.output, call.numel, call.epilogue);
    }
  } catch (const TransportFailure& e) {
    failure_ = e.diagnostic();
    throw;
  }
}

}  // namespace pcie_ar::transport
