// The executor: one kernel that runs a rank's step list (plan::Program), the same list the CPU
// verifier proved. Grid: dim3(blocks, ranks_in_launch); blockIdx.y picks the (virtual) rank,
// CTA b owns slice b of every chunk and its own flags and generation counter.
//
// Thread i of a CTA always handles the vectors slice.begin + i + k * blockDim.x of whatever
// chunk a step names, so a step that reads what an earlier step of the same rank wrote to the
// same chunk reads the thread's own stores: consecutive steps need no barrier, and LL steps
// (which carry their own flags in the data) need none at all. Barriers sit only where the flag
// protocol needs them: before a run of signals (the whole slice is written) and after a run of
// waits (the whole CTA may read). The signals of a run go out in parallel, one thread each, and
// so do the waits of a run.
//
// Under programmatic dependent launch (sm_90+) the kernel may start while the previous one in
// the stream still runs: it stages its program (written once, at upload), then waits for the
// previous grid before it reads the generation counter, an input or anything else.

#pragma once

#include <cstddef>

#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/step.h"
#include "transport/executors/cuda/epilogue.cuh"
#include "transport/executors/cuda/kernel_params.h"
#include "transport/executors/cuda/primitives.cuh"

namespace pcie_ar::transport::kernels {

static_assert(offsetof(plan::Program, steps) % 4 == 0 && sizeof(plan::Step) % 4 == 0,
              "the program is staged into shared memory as 32-bit words");
static_assert(sizeof(plan::Program) % 4 == 0);

// Polls of a flag or an LL vector between two looks at the clock: a poll is a round trip to
// L2 or over PCIe, so the deadline is still checked every few microseconds.
inline constexpr uint32_t kPollsPerClockCheck = 16;
// Re-reads of a flag that reached this generation with another call's identity before it is
// a mismatch. The 16-byte read that saw the generation is not single-copy atomic across its
// halves, so its call half may be older; but the writer stores the call before it releases the
// generation (store_flag_release_sys), so one read after that acquire sees this generation's call.
inline constexpr int kMismatchRereads = 1;
// LL operands a thread loads before it looks at their tags (kLLGroup<Bound>) are the machine's and
// the instantiation's choice: primitives.cuh. Bound is the kernel's __launch_bounds__
// (kernel_params.h, executor_bound): the decode-shaped push kernels (kDecodeThreads) take every
// operand of a reduce in one look, the large-message ones (kMaxThreads) a few at a time.

// What every step of one CTA needs to know about the call.
struct Call {
  int rank;
  int block;
  uint64_t gen;
  int parity;
  uint32_t ll_tag;  // plan::ll_tag of this call: every LL word it writes or expects
  int64_t num_vecs;
};

// A data slot (ref.space == kSlot), the one space a peer's data lands in.
__device__ __forceinline__ uint4* resolve_slot(const LaunchParams& p, const Call& c,
                                               const plan::BufRef& ref) {
  return reinterpret_cast<uint4*>(p.bases[ref.owner] + p.layout.slot_offset(c.parity, ref.slot));
}

// Chunk `chunk`'s vectors of this rank's input or output lie `shift` vectors from where the
// message's own chunking puts them (step_shift); slots are the message's own, never shifted.
__device__ __forceinline__ uint4* resolve(const LaunchParams& p, const Call& c,
                                          const plan::BufRef& ref, int64_t shift) {
  switch (ref.space) {
    case plan::Space::kInput:  // check_program(): programs name only their own tensors
      return const_cast<uint4*>(static_cast<const uint4*>(p.inputs[c.rank])) + shift;
    case plan::Space::kOutput:
      return static_cast<uint4*>(p.outputs[c.rank]) + shift;
    default:
      return resolve_slot(p, c, ref);
  }
}

// Where a step's chunk lies in this call's tensors: a streamed collective's round holds its
// chunks p.chunk_stride_vecs apart in them (transport::Call::chunk_stride), so the step's input
// and output vectors are `shift` vectors from the message's own chunking; 0 without a stride.
// Once per step, not per vector: the stride is uniform and the chunk is the step's.
__device__ __forceinline__ int64_t step_shift(const LaunchParams& p, const Call& c,
                                              const plan::Program& program,
                                              const plan::Step& step) {
  return plan::chunk_shift(c.num_vecs, program.num_chunks, step.chunk, p.chunk_stride_vecs);
}

// The first LL vector of an LL slot: payload vector v lives at [2v, 2v + 1] (Lamport: at v).
// The parity goes through opaque_u32 so that its product with the parity stride is computed here,
// a multiply-add per operand, not hoisted out of the LL loops as a 64-bit register: with a split
// sum's first partial held through its later groups, that register made ptxas reuse an earlier
// operand's registers for a later load in fp32 on sm_90 (a half-serial first look).
__device__ __forceinline__ uint4* resolve_ll(const LaunchParams& p, const Call& c,
                                             const plan::BufRef& ref) {
  const int parity = static_cast<int>(opaque_u32(static_cast<uint32_t>(c.parity)));
  return reinterpret_cast<uint4*>(p.bases[ref.owner] + p.layout.ll_slot_offset(parity, ref.slot));
}

// The Lamport header of LL slot `ref`'s slice of `chunk` in this CTA: one tagged LL vector pair.
__device__ __forceinline__ uint4* ll_header(const LaunchParams& p, const Call& c,
                                            const plan::BufRef& ref, int chunk) {
  return reinterpret_cast<uint4*>(p.bases[ref.owner] +
                                  p.layout.ll_header_offset(c.parity, ref.slot, chunk, c.block));
}

__device__ __forceinline__ plan::FlagWord* flag_word(const LaunchParams& p, const Call& c,
                                                     int owner, int flag) {
  return reinterpret_cast<plan::FlagWord*>(p.bases[owner] +
                                           p.layout.flag_offset(c.parity, c.block, flag));
}

// How long a thread that lost the claim waits for the winner's record before it traps anyway.
inline constexpr uint64_t kRecordWaitNs = 100'000'000;

// Records the first failure of the launch where the host can read it after the context dies,
// then traps. The claim is a device-memory CAS: atomics on mapped host memory are not atomic
// over PCIe, and only one record must land. A trap ends the whole grid at once, so the threads
// that lost the claim wait until the winner has published its record (claim 2) before they
// trap: trapping at once, they could end the grid while the winner's record was still on its
// way to host memory, and the host would find no failure recorded.
__device__ __forceinline__ void fail(const LaunchParams& p, const plan::Diagnostic& d) {
  if (claim_first(p.claim)) {
    const auto* words = reinterpret_cast<const uint32_t*>(&d);
    volatile uint32_t* record = reinterpret_cast<volatile uint32_t*>(p.diag);
    static_assert(offsetof(plan::Diagnostic, kind) == 0);
    for (int i = 1; i < static_cast<int>(sizeof(plan::Diagnostic) / 4); ++i) record[i] = words[i];
    fence_system();  // the fields reach host memory before the kind that publishes them
    record[0] = words[0];
    fence_system();
    publish_claim(p.claim);
  } else {
    const uint64_t start = global_timer_ns();
    while (!claim_published(p.claim) && global_timer_ns() - start < kRecordWaitNs) {
    }
  }
  trap_kernel();
}

__device__ __forceinline__ plan::CallPosition position(const LaunchParams& p, const Call& c) {
  return plan::CallPosition{static_cast<uint32_t>(c.rank), static_cast<uint32_t>(c.block), c.gen,
                            static_cast<uint32_t>(p.numel), p.signature};
}

// ------------------------------------------------------------------ plain reduce

// The association every reduce of two or more operands computes (plan::Step::split), in fp32:
// each sum runs in operand order from +0 (((+0 + a0) + a1) + ...), so no sum is ever -0 and every
// protocol gives the same zero (a lamport writer cannot store -0); split = S splits the operands
// into two sums, [0, S) and [S, N), each rounded to the dtype before the two are added (from +0
// again: a rounded partial may be -0) and rounded once more. That is what an island tactic
// computes from two partials it stored in slots, so a flat tactic on the same group gives the same
// bits with the partials in registers. The order is the schedule's: it is what makes every rank's
// result bitwise identical.
//
// The split is a template parameter, chosen once per step (with_split), as the operand count is.
// Known at compile time, the first sum's rounding takes registers only from the split on, where
// the first operands' are free; tested at run time at every operand (a branch, or selects) it
// spilled the kernels, which sit at their register budget. Only the splits the builders emit are
// compiled: the canonical tree's two equal groups (N / 2 of an even N). Each other split would be
// another copy of the kernel's largest code (the LL reduces), in size and in compile time. A split
// of a pair is the plain sum: its groups of one are exact, so it is the same bits.

// Where every sum starts: +0, the one start that turns a -0 operand into +0 and leaves every other
// value as it is.
inline constexpr float kSumStart = 0.0f;
template <int K>
__device__ __forceinline__ void start_sum(float (&acc)[K]) {
#pragma unroll
  for (int e = 0; e < K; ++e) acc[e] = kSumStart;
}

// acc += operand x (widened: exact).
template <typename T>
__device__ __forceinline__ void add_operand(float (&acc)[VecMath<T>::kElems], const uint4& x) {
  using M = VecMath<T>;
  float term[M::kElems];
  M::widen(x, term);
#pragma unroll
  for (int e = 0; e < M::kElems; ++e) acc[e] = add_rn(acc[e], term[e]);
}

// The operand a step's second sum starts at: 0 when the step is one sum.
__device__ __forceinline__ uint32_t split_of(const plan::Step& step) { return step.split; }

template <int S>
struct Split {
  static constexpr int value = S;
};

// f(Split<S>{}) for the step's split (executor_runs_split). A split of a pair is a plain sum; a
// split the kernels do not run traps (check_program() accepts every split in [1, N); install()
// refuses those).
template <int N, typename F>
__device__ __forceinline__ void with_split(uint32_t split, const F& f) {
  if constexpr (N >= 4 && N % 2 == 0) {
    if (split == N / 2) return f(Split<N / 2>{});
  }
  if (!executor_runs_split(N, static_cast<int>(split))) trap_kernel();
  f(Split<0>{});
}

// Before operand i of a sum split at S: there, the first sum is rounded into `first` and acc
// starts again.
template <typename T, int S>
__device__ __forceinline__ void split_at(int i, float (&acc)[VecMath<T>::kElems], uint4& first) {
  if (S != 0 && i == S) {
    first = VecMath<T>::narrow(acc);
    start_sum(acc);
  }
}

// After the last operand of a sum split at S: acc = (+0 + round(first sum)) + round(second sum),
// for the caller to round.
template <typename T, int S>
__device__ __forceinline__ void join_split(float (&acc)[VecMath<T>::kElems], const uint4& first) {
  if (S != 0) {
    const uint4 second = VecMath<T>::narrow(acc);
    start_sum(acc);
    add_operand<T>(acc, first);
    add_operand<T>(acc, second);
  }
}

// The sum of N >= 2 vectors of one step split at S, rounded (see above).
template <typename T, int N, int S>
__device__ __forceinline__ uint4 sum_in_order(const uint4 (&x)[N]) {
  using M = VecMath<T>;
  float acc[M::kElems];
  uint4 first = make_uint4(0u, 0u, 0u, 0u);
  start_sum(acc);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    split_at<T, S>(i, acc, first);
    add_operand<T>(acc, x[i]);
  }
  join_split<T, S>(acc, first);
  return M::narrow(acc);
}

// dst[v] = src0[v] + ... + src{N-1}[v] (split at S) over this thread's vectors of the slice. All
// operands are loaded before the store, so dst may alias any source elementwise (the in-place op).
template <typename T, plan::Direction D, int N, int S>
__device__ __forceinline__ void reduce_slice(const LaunchParams& p, const Call& c,
                                             const plan::Step& step, int64_t shift,
                                             plan::VecRange range) {
  // The operands' and the destination's pointers advance by the stride, rather than an index
  // being added to each of them: with the split sums' code in the kernel, ptxas spilled one of
  // eight operand pointers (bf16/fp16 on sm_90 with a 32-bit index, fp32 on sm_120 with a 64-bit
  // one). 32-bit vector count: a message has fewer than 2^32 elements (make_layout refuses a
  // larger max_numel), so fewer than 2^30 vectors.
  const int begin = static_cast<int>(range.begin) + thread_index();
  const int stride = static_cast<int>(blockDim.x);
  const uint4* src[N];
#pragma unroll
  for (int i = 0; i < N; ++i) src[i] = resolve(p, c, step.srcs[i], shift) + begin;
  uint4* dst = resolve(p, c, step.dst, shift) + begin;
  const int end = static_cast<int>(range.end);
  for (int v = begin; v < end; v += stride) {
    uint4 x[N];
#pragma unroll
    for (int i = 0; i < N; ++i) {
      x[i] = load_operand<D>(src[i]);
      src[i] += stride;
    }
    if constexpr (N == 1) {
      store_cg(dst, x[0]);  // a copy moves bits; it never rounds
    } else {
      store_cg(dst, sum_in_order<T, N, S>(x));
    }
    dst += stride;
  }
}

// ------------------------------------------------------------------ LL reduce

// An LL payload vector v is the two LL vectors [2v, 2v + 1] of its slot: lo and hi, each
// {data, tag, data, tag}. True when all four tags are `tag`.
__device__ __forceinline__ bool ll_tags_are(const uint4& lo, const uint4& hi, uint32_t tag) {
  return (lo.y == tag) & (lo.w == tag) & (hi.y == tag) & (hi.w == tag);
}
// The first of the four tags that is not `tag` (the last one when the others are).
__device__ __forceinline__ uint32_t ll_seen(const uint4& lo, const uint4& hi, uint32_t tag) {
  return lo.y != tag ? lo.y : lo.w != tag ? lo.w : hi.y != tag ? hi.y : hi.w;
}
__device__ __forceinline__ uint4 ll_payload(const uint4& lo, const uint4& hi) {
  return make_uint4(lo.x, lo.z, hi.x, hi.z);
}

// Loads the LL payload vector whose two LL vectors start at `at`. True when all four tags are
// `tag`; otherwise `seen` is the first tag that is not.
__device__ __forceinline__ bool try_load_ll(const uint4* at, uint32_t tag, uint4& payload,
                                            uint32_t& seen) {
  const uint4 lo = load_ll(at);
  const uint4 hi = load_ll(at + 1);
  payload = ll_payload(lo, hi);
  seen = ll_seen(lo, hi, tag);
  return ll_tags_are(lo, hi, tag);
}

// Where payload vector v of operand `ref` of an LL step lives: an LL slot's words for it, or the
// vector of a plain buffer (the step's `shift` applies to its input and output: step_shift).
template <bool Dense>
__device__ __forceinline__ uint4* locate(const LaunchParams& p, const Call& c,
                                         const plan::BufRef& ref, int64_t shift, int v) {
  if (ref.space != plan::Space::kLL) return resolve(p, c, ref, shift) + v;
  return resolve_ll(p, c, ref) + (Dense ? v : 2 * v);
}

// A Lamport payload vector as its writer stores it: no word kLLEmpty (plan::ll_dense_word).
template <typename T>
__device__ __forceinline__ uint4 dense_words(const uint4& v) {
  constexpr int kBytes = static_cast<int>(sizeof(T));
  return make_uint4(plan::ll_dense_word(v.x, kBytes), plan::ll_dense_word(v.y, kBytes),
                    plan::ll_dense_word(v.z, kBytes), plan::ll_dense_word(v.w, kBytes));
}

__device__ __forceinline__ bool dense_arrived(const uint4& v) {
  return plan::ll_dense_arrived(v.x, v.y, v.z, v.w);
}

// The word a diagnostic names: Lamport words carry no tag, so an empty one is reported as seen.
__device__ __forceinline__ uint32_t dense_seen(const uint4& v) {
  return dense_arrived(v) ? 0u : plan::kLLEmpty;
}

// Every word an LL reader consumed goes back to kLLEmpty, in either format.
__device__ __forceinline__ void reset_ll(uint4* at) {
  store_ll(at, plan::kLLEmpty, plan::kLLEmpty, plan::kLLEmpty);
}

// Which of an LL step's N operands are LL slots: bit i for srcs[i]. Read once per step, so the
// per-vector loop tests bits of a register (uniform across the CTA): the staged step is shared
// memory, and every load's memory clobber would make the compiler read it again after each load.
template <int N>
__device__ __forceinline__ uint32_t ll_operand_mask(const plan::Step& step) {
  uint32_t mask = 0;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if (step.srcs[i].space == plan::Space::kLL) mask |= 1u << i;
  }
  return mask;
}

// Polls the LL words of operand `ref` at `at` until they say this call's data has landed: both
// tag pairs this call's tag (tagged), or no word kLLEmpty (Dense). A tag of this parity that
// names another call fails with kLLMismatch at once; nothing arriving, kLLTimeout after
// p.timeout_ns.
template <bool Dense>
__device__ __forceinline__ uint4 await_ll(const LaunchParams& p, const Call& c, int step_index,
                                          const plan::Step& step, const plan::BufRef& ref,
                                          const uint4* at) {
  const uint64_t start = global_timer_ns();
  uint32_t polls = 0;
  for (;;) {
    uint4 payload;
    uint32_t seen;
    if constexpr (Dense) {
      payload = load_ll(at);
      if (dense_arrived(payload)) return payload;
      seen = dense_seen(payload);
    } else {
      if (try_load_ll(at, c.ll_tag, payload, seen)) return payload;
      if (plan::ll_foreign(seen, c.ll_tag)) {
        fail(p, plan::make_ll_diagnostic(plan::FailureKind::kLLMismatch, position(p, c), step_index,
                                         step, ref, seen, c.ll_tag));
      }
    }
    if (++polls == kPollsPerClockCheck) {
      polls = 0;
      if (p.timeout_ns != 0 && global_timer_ns() - start > p.timeout_ns) {
        fail(p, plan::make_ll_diagnostic(plan::FailureKind::kLLTimeout, position(p, c), step_index,
                                         step, ref, seen, c.ll_tag));
      }
    }
  }
}

// Lamport, once per step and CTA, by its last thread (which at decode sizes holds no vector of
// the slice, so the data's threads do not wait for it): a step that writes an LL slot stores its
// slice's header {0, tag, 0, tag}; a step that reads LL operands awaits each one's header like
// a tagged LL vector (another call's tag: kLLMismatch) and resets it. plan/protocol.h.
__device__ __forceinline__ void exchange_headers(const LaunchParams& p, const Call& c,
                                                 int step_index, const plan::Step& step) {
  if (step.dst.space == plan::Space::kLL) {
    // The tag through opaque_u32: otherwise ptxas builds the header's {0, tag} word once, holds it
    // through the whole kernel and, at the budget (fp32 on sm_86/89), spills it.
    store_ll_payload(ll_header(p, c, step.dst, step.chunk), make_uint4(0u, 0u, 0u, 0u),
                     opaque_u32(c.ll_tag));
  }
  for (int i = 0; i < step.num_srcs; ++i) {
    const plan::BufRef& ref = step.srcs[i];
    if (ref.space != plan::Space::kLL) continue;
    uint4* header = ll_header(p, c, ref, step.chunk);
    await_ll<false>(p, c, step_index, step, ref, header);
    reset_ll(header);
    reset_ll(header + 1);
  }
}

// Operands [First, First + K) of an LL step, consumed for payload vector v: back to kLLEmpty. No
// tag and no Lamport word is kLLEmpty, so an LL word is valid exactly once per write. Addresses
// derived again from the staged step, not held from the loads.
template <bool Dense, int First, int K>
__device__ __forceinline__ void reset_ll_operands(const LaunchParams& p, const Call& c,
                                                  const plan::Step& step, int64_t shift,
                                                  uint32_t ll_mask, int v) {
#pragma unroll
  for (int k = 0; k < K; ++k) {
    if ((ll_mask >> (First + k)) & 1u) {
      uint4* ll = locate<Dense>(p, c, step.srcs[First + k], shift, v);
      reset_ll(ll);
      if constexpr (!Dense) reset_ll(ll + 1);
    }
  }
}

// One look at operands [First, First + K) of an LL step for payload vector v (`ll_mask`:
// ll_operand_mask): plain ones loaded, LL ones taken into x where their tags say this call's data
// has landed (Dense: no word is kLLEmpty). Returns the LL operands whose data had not landed (bit
// k: operand First + k); gather_ll_group waits for them.
//
// The look puts the whole group in flight before it looks at any tag: every address first, then
// every load (the LL words stay raw in lo/hi, 8 registers an LL operand), then the tag checks. A
// check between two loads would make the second wait for the first's round trip. kLookGroup is
// the largest group the machine's registers keep that way (primitives_gpu.cuh says how it was
// measured; tests/sass/check_sass.py checks the SASS). Operand addresses are derived from the
// staged step (shared memory) again where they are needed after the loads rather than held in
// registers, and the mask goes through opaque_u32 so that its bits are tested here, not hoisted
// out of the vector loop one register each.
//
// Decode (the decode-shaped kernels, whose one look takes all of up to eight operands): every
// operand's loads are unpredicated volatile loads, an LL operand's second LL vector at +1 and a
// plain operand's vector again at +0 (a local L2 hit; volatile reads at least what ld.cg does),
// and the mask picks among what was loaded. Predicated by the mask, eight operands' loads and
// their compares need more predicates than the seven a thread has, and ptxas then issues the
// last operands' loads after the first compares (a serial look: tests/sass/check_sass.py).
template <plan::Direction D, bool Dense, bool Decode, int First, int K>
__device__ __forceinline__ uint32_t look_ll_group(const LaunchParams& p, const Call& c,
                                                  const plan::Step& step, int64_t shift,
                                                  uint32_t ll_mask, int v, uint4 (&x)[K]) {
  const uint32_t tag = c.ll_tag;
  ll_mask = opaque_u32(ll_mask);
  // 1: addresses, before the first load's clobber.
  const uint4* at[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const plan::BufRef& ref = step.srcs[First + k];
    at[k] = locate<Dense>(p, c, ref, shift, v);
  }
  // 2: every load of the group in flight at once.
  uint4 lo[K];
  uint4 hi[K];
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const uint32_t ll = (ll_mask >> (First + k)) & 1u;
    if constexpr (Decode) {
      lo[k] = load_ll(at[k]);
      hi[k] = Dense ? lo[k] : load_ll(at[k] + ll);
    } else if (ll) {
      lo[k] = load_ll(at[k]);
      hi[k] = Dense ? lo[k] : load_ll(at[k] + 1);
    } else {
      lo[k] = load_operand<D>(at[k]);
      hi[k] = lo[k];
    }
  }
  // 3: the tags, once everything has been asked for.
  uint32_t pending = 0;
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const uint32_t ll = (ll_mask >> (First + k)) & 1u;
    if constexpr (Decode) {
      const bool missing = Dense ? !dense_arrived(lo[k]) : !ll_tags_are(lo[k], hi[k], tag);
      pending |= (ll & static_cast<uint32_t>(missing)) << k;
      x[k] = Dense || !ll ? lo[k] : ll_payload(lo[k], hi[k]);
    } else if (ll) {
      if (Dense ? !dense_arrived(lo[k]) : !ll_tags_are(lo[k], hi[k], tag)) pending |= 1u << k;
      x[k] = Dense ? lo[k] : ll_payload(lo[k], hi[k]);
    } else {
      x[k] = lo[k];
    }
  }
  return pending;
}

// The decode-shaped kernels' check of a look that missed, every kPollsPerClockCheck looks: the
// lowest operand still pending (bit k of `pending`: operand First + k) is loaded once more; a tag
// of this parity naming another call fails with kLLMismatch, and past p.timeout_ns since `start`
// nothing landing fails with kLLTimeout, as await_ll fails.
template <bool Dense, int First>
__device__ __forceinline__ void check_pending_ll(const LaunchParams& p, const Call& c,
                                                 int step_index, const plan::Step& step,
                                                 int64_t shift, int v, uint32_t pending,
                                                 uint64_t start) {
  int k = 0;
  while (((pending >> k) & 1u) == 0) ++k;
  const plan::BufRef& ref = step.srcs[First + k];
  const uint4* at = locate<Dense>(p, c, ref, shift, v);
  uint32_t seen;
  if constexpr (Dense) {
    const uint4 words = load_ll(at);
    if (dense_arrived(words)) return;
    seen = dense_seen(words);
  } else {
    uint4 payload;
    if (try_load_ll(at, c.ll_tag, payload, seen)) return;
    if (plan::ll_foreign(seen, c.ll_tag)) {
      fail(p, plan::make_ll_diagnostic(plan::FailureKind::kLLMismatch, position(p, c), step_index,
                                       step, ref, seen, c.ll_tag));
    }
  }
  if (p.timeout_ns != 0 && global_timer_ns() - start > p.timeout_ns) {
    fail(p, plan::make_ll_diagnostic(plan::FailureKind::kLLTimeout, position(p, c), step_index,
                                     step, ref, seen, c.ll_tag));
  }
}

// Operands [First, First + K) of an LL step for payload vector v, in x: look_ll_group's first look,
// then the slow path for any operand it missed.
//
// The large-message kernels await the missing ones in operand order, one at a time (by then the
// others have usually landed too, so each costs one more look), and reset the group's operands.
// The decode-shaped kernels (Decode) repeat the whole look until nothing is missing: one look
// after the last operand lands, where awaiting them in turn would cost a look each after the one
// before, and with every operand in the first look that look comes early and misses most of them
// when peers are late. A repeated look loads the operands that had landed again too (their words
// stay valid until the reset, after the result's store): at decode sizes a few more loads per
// thread, and the look keeps the first look's registers (a look at the pending ones only held x
// beside them, and spilled).
template <plan::Direction D, bool Dense, bool Decode, int First, int K>
__device__ __forceinline__ void gather_ll_group(const LaunchParams& p, const Call& c,
                                                int step_index, const plan::Step& step,
                                                int64_t shift, uint32_t ll_mask, int v,
                                                uint4 (&x)[K]) {
  uint32_t pending = look_ll_group<D, Dense, Decode, First, K>(p, c, step, shift, ll_mask, v, x);
  if constexpr (Decode) {
    if (pending != 0) {
      const uint64_t start = global_timer_ns();
      uint32_t polls = 0;
      do {
        if (++polls == kPollsPerClockCheck) {
          polls = 0;
          check_pending_ll<Dense, First>(p, c, step_index, step, shift, v, pending, start);
        }
        pending = look_ll_group<D, Dense, Decode, First, K>(p, c, step, shift, ll_mask, v, x);
      } while (pending != 0);
    }
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if ((pending >> k) & 1u) {
        const plan::BufRef& ref = step.srcs[First + k];
        x[k] = await_ll<Dense>(p, c, step_index, step, ref, locate<Dense>(p, c, ref, shift, v));
      }
    }
    reset_ll_operands<Dense, First, K>(p, c, step, shift, ll_mask, v);
  }
}

// Operands of an N-operand LL step a thread takes in one look, in an instantiation of Bound.
template <bool Dense, int Bound>
inline constexpr int kLookGroup = Dense ? kLLDenseGroup<Bound> : kLLGroup<Bound>;

// Adds operands [First, N) of payload vector v to acc (fp32, operand order, split at S as
// sum_in_order splits: `first` takes the rounded first sum), kLookGroup at a time.
template <typename T, plan::Direction D, bool Dense, int Bound, int N, int S, int First>
__device__ __forceinline__ void accumulate_ll(const LaunchParams& p, const Call& c, int step_index,
                                              const plan::Step& step, int64_t shift,
                                              uint32_t ll_mask, int v,
                                              float (&acc)[VecMath<T>::kElems], uint4& first) {
  using M = VecMath<T>;
  constexpr int kGroup = kLookGroup<Dense, Bound>;
  constexpr int K = N - First < kGroup ? N - First : kGroup;
  uint4 x[K];
  gather_ll_group<D, Dense, Bound == kDecodeThreads, First, K>(p, c, step_index, step, shift,
                                                               ll_mask, v, x);
#pragma unroll
  for (int k = 0; k < K; ++k) {
    split_at<T, S>(First + k, acc, first);
    add_operand<T>(acc, x[k]);
  }
  if constexpr (First + K < N) {
    // This group's sum is done before the next group's loads: otherwise the compiler may defer
    // the adds past them and hold this group's operands (4 registers each) in place of the sum.
#pragma unroll
    for (int e = 0; e < M::kElems; ++e) acc[e] = opaque_f32(acc[e]);
    accumulate_ll<T, D, Dense, Bound, N, S, First + K>(p, c, step_index, step, shift, ll_mask, v,
                                                       acc, first);
  }
}

// A reduce that reads or writes LL slots: the same sum as reduce_slice (sum_in_order; a copy
// moves bits), with LL operands awaited per vector and an LL destination written tagged (Dense:
// as it is, no word kLLEmpty, its header beside it). Nothing else: no fence, no flag, no barrier.
//
// In the decode-shaped kernels, whose one look takes every operand, the consumed LL words are reset
// after the result is stored, so the result (at decode sizes a posted write to a peer, the next
// rank's critical path) goes out first. The large-message kernels reset each group's operands
// after its look, as they did before there were two kinds (their register budget, 64, was
// measured with the resets there).
// plan::check_program() refuses an LL step whose destination is one of its LL operands, the one
// case where the order would matter.
template <typename T, plan::Direction D, bool Dense, int Bound, int N, int S>
__device__ __forceinline__ void reduce_slice_ll(const LaunchParams& p, const Call& c,
                                                int step_index, const plan::Step& step,
                                                int64_t shift, plan::VecRange range) {
  if constexpr (Dense) {
    if (thread_index() == static_cast<int>(blockDim.x) - 1 && range.begin < range.end) {
      exchange_headers(p, c, step_index, step);
    }
  }
  // LL slots hold at most plan::kMaxLLPayloadBytes: 32-bit vector indices, fewer registers.
  const int end = static_cast<int>(range.end);
  const uint32_t ll_mask = opaque_u32(ll_operand_mask<N>(step));
  // After the store: the decode-shaped kernels, whose one look takes every operand.
  constexpr bool kDecode = Bound == kDecodeThreads;
  static_assert(!kDecode || N <= kLookGroup<Dense, Bound>);
  for (int v = static_cast<int>(range.begin) + thread_index(); v < end;
       v += static_cast<int>(blockDim.x)) {
    uint4 out;
    if constexpr (N == 1) {
      uint4 x[1];
      gather_ll_group<D, Dense, kDecode, 0, 1>(p, c, step_index, step, shift, ll_mask, v, x);
      out = x[0];
    } else {
      float acc[VecMath<T>::kElems];
      uint4 first = make_uint4(0u, 0u, 0u, 0u);
      start_sum(acc);
      accumulate_ll<T, D, Dense, Bound, N, S, 0>(p, c, step_index, step, shift, ll_mask, v, acc,
                                                 first);
      join_split<T, S>(acc, first);
      out = VecMath<T>::narrow(acc);
    }
    uint4* dst = locate<Dense>(p, c, step.dst, shift, v);
    if (step.dst.space != plan::Space::kLL) {
      store_cg(dst, out);
    } else if constexpr (Dense) {
      store_ll_vector(dst, dense_words<T>(out));
    } else {
      store_ll_payload(dst, out, c.ll_tag);
    }
    if constexpr (kDecode) reset_ll_operands<Dense, 0, N>(p, c, step, shift, ll_mask, v);
  }
}

__device__ __forceinline__ bool touches_ll(const plan::Step& step) {
  bool ll = step.dst.space == plan::Space::kLL;
  for (int i = 0; i < step.num_srcs; ++i) ll |= step.srcs[i].space == plan::Space::kLL;
  return ll;
}

// One instantiation per operand count keeps every operand array in registers; one per split
// (with_split) keeps the partial sums there too.
// `dense`: the program's LL slots are Lamport (plan::LLFormat::kDense). Read from the staged
// program in shared memory once per step rather than held in a register through the whole
// kernel (one more live register spills on sm_120).
template <typename T, plan::Direction D, bool LL, int Bound>
__device__ __forceinline__ void reduce_n(const LaunchParams& p, const Call& c, int s,
                                         const plan::Step& step, bool dense, int64_t shift,
                                         plan::VecRange range) {
  static_assert(plan::kMaxSources == 8);
#define PCIE_AR_REDUCE_CASE(n)                                                               \
  case n:                                                                                    \
    return with_split<n>(split_of(step), [&](auto split) {                                   \
      constexpr int kSplit = decltype(split)::value;                                         \
      if constexpr (LL) {                                                                    \
        if (dense) {                                                                         \
          return reduce_slice_ll<T, D, true, Bound, n, kSplit>(p, c, s, step, shift, range); \
        }                                                                                    \
        return reduce_slice_ll<T, D, false, Bound, n, kSplit>(p, c, s, step, shift, range);  \
      } else {                                                                               \
        return reduce_slice<T, D, n, kSplit>(p, c, step, shift, range);                      \
      }                                                                                      \
    });
  switch (step.num_srcs) {
    PCIE_AR_REDUCE_CASE(1)
    PCIE_AR_REDUCE_CASE(2)
    PCIE_AR_REDUCE_CASE(3)
    PCIE_AR_REDUCE_CASE(4)
    PCIE_AR_REDUCE_CASE(5)
    PCIE_AR_REDUCE_CASE(6)
    PCIE_AR_REDUCE_CASE(7)
    default:
      PCIE_AR_REDUCE_CASE(8)
  }
#undef PCIE_AR_REDUCE_CASE
}

// The LL decision is per step and uniform across the CTA (every thread reads the same step).
template <typename T, plan::Direction D, int Bound>
__device__ __forceinline__ void run_reduce(const LaunchParams& p, const Call& c,
                                           const plan::Program& program, int step_index) {
  const plan::Step& step = program.steps[step_index];
  const plan::VecRange range = plan::slice_range(c.num_vecs, program.num_chunks, step.chunk,
                                                 static_cast<int>(gridDim.x), c.block);
  const int64_t shift = step_shift(p, c, program, step);
  if (touches_ll(step)) {
    // LL is push-only: check_program() refuses a pull program with LL slots, so the pull kernels
    // carry no LL code (half the instantiations, half the compile time).
    if constexpr (D == plan::Direction::kPush) {
      reduce_n<T, D, true, Bound>(p, c, step_index, step,
                                  program.ll_format == plan::LLFormat::kDense, shift, range);
    } else {
      trap_kernel();
    }
  } else if (D == plan::Direction::kPush && p.slots_in_host_memory) {
    // A push rank reads its own slots, which peers wrote this call. In device memory L2 is
    // where those writes land; in host memory (cuda_host) L2 may still hold the line from the
    // previous call of this parity, so read like pull operands: ld.cv re-fetches system-memory
    // lines. Direction only selects the loads in reduce_n.
    reduce_n<T, plan::Direction::kPull, false, Bound>(p, c, step_index, step, false, shift, range);
  } else {
    reduce_n<T, D, false, Bound>(p, c, step_index, step, false, shift, range);
  }
}

// ------------------------------------------------------------------ fan-out copies

// Delivery: a run of copy steps that send the same chunk of this rank's own
// input or output to several places (one-shot's copies to every peer, the all-gather's copies of
// a reduced chunk) is one pass: each vector is loaded once and stored to every destination,
// instead of once per step, each step waiting for its own load. The steps stay in the program
// as the verifier proved them; only the executor runs them together (fanout_length says which).
inline constexpr int kMaxFanout = plan::kMaxWorld - 1;

// How a fan-out's destinations hold data: plain slots (flag), LL words, or lamport words.
enum class Fanout { kPlain, kTagged, kDense };

// Steps s, s + 1, ... that copy step s's source to slots of the same kind (plan::is_fanout_copy,
// plan::continues_fanout). 1 when step s starts no run.
__device__ __forceinline__ int fanout_length(const plan::Program& program, int s) {
  const plan::Step& first = program.steps[s];
  if (!plan::is_fanout_copy(first)) return 1;
  int end = s + 1;
  while (end < program.num_steps && end - s < kMaxFanout &&
         plan::continues_fanout(first, program.steps[end])) {
    ++end;
  }
  return end - s;
}

// Steps [s, s + N) as one pass over their (shared) slice: one load, N stores per vector.
template <typename T, plan::Direction D, Fanout F, int N>
__device__ __forceinline__ void fanout(const LaunchParams& p, const Call& c,
                                       const plan::Program& program, int s, int64_t shift,
                                       plan::VecRange range) {
  if constexpr (F == Fanout::kDense) {
    if (thread_index() == static_cast<int>(blockDim.x) - 1 && range.begin < range.end) {
#pragma unroll
      for (int j = 0; j < N; ++j) exchange_headers(p, c, s + j, program.steps[s + j]);
    }
  }
  const uint4* src = resolve(p, c, program.steps[s].srcs[0], shift);
  // Each destination's address is derived from the staged step where it is stored, not held in
  // a register through the loop: seven 64-bit pointers beside the vector spill on sm_120. A
  // store clobbers memory, so the derivation is not hoisted either; it is a few integer
  // instructions from shared memory and the parameter bank per store, off the critical path.
  // 32-bit vector indices, fewer registers: a message has fewer than 2^32 elements (make_layout
  // refuses a larger max_numel), so fewer than 2^30 vectors.
  const int end = static_cast<int>(range.end);
#pragma unroll 1
  for (int v = static_cast<int>(range.begin) + thread_index(); v < end;
       v += static_cast<int>(blockDim.x)) {
    uint4 x = load_operand<D>(src + v);
    if constexpr (F == Fanout::kDense) x = dense_words<T>(x);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      const plan::BufRef& ref = program.steps[s + j].dst;
      if constexpr (F == Fanout::kPlain) {
        store_cg(resolve_slot(p, c, ref) + v, x);  // a copy moves bits; it never rounds
      } else if constexpr (F == Fanout::kDense) {
        store_ll_vector(resolve_ll(p, c, ref) + v, x);
      } else {
        store_ll_payload(resolve_ll(p, c, ref) + 2 * v, x, c.ll_tag);
      }
    }
  }
}

template <typename T, plan::Direction D, Fanout F>
__device__ __forceinline__ void fanout_n(const LaunchParams& p, const Call& c,
                                         const plan::Program& program, int s, int n, int64_t shift,
                                         plan::VecRange range) {
  static_assert(kMaxFanout == 7);
  switch (n) {
    case 2:
      return fanout<T, D, F, 2>(p, c, program, s, shift, range);
    case 3:
      return fanout<T, D, F, 3>(p, c, program, s, shift, range);
    case 4:
      return fanout<T, D, F, 4>(p, c, program, s, shift, range);
    case 5:
      return fanout<T, D, F, 5>(p, c, program, s, shift, range);
    case 6:
      return fanout<T, D, F, 6>(p, c, program, s, shift, range);
    default:
      return fanout<T, D, F, 7>(p, c, program, s, shift, range);
  }
}

// n >= 2 steps from s (fanout_length): uniform across the CTA, like every step decision. Push
// kernels only.
template <typename T, plan::Direction D>
__device__ __forceinline__ void run_fanout(const LaunchParams& p, const Call& c,
                                           const plan::Program& program, int s, int n) {
  const plan::Step& first = program.steps[s];
  const plan::VecRange range = plan::slice_range(c.num_vecs, program.num_chunks, first.chunk,
                                                 static_cast<int>(gridDim.x), c.block);
  // The source is this rank's input or output (is_fanout_copy); the destinations are slots.
  const int64_t shift = step_shift(p, c, program, first);
  if (first.dst.space != plan::Space::kLL) {
    fanout_n<T, D, Fanout::kPlain>(p, c, program, s, n, shift, range);
  } else if (program.ll_format == plan::LLFormat::kDense) {
    fanout_n<T, D, Fanout::kDense>(p, c, program, s, n, shift, range);
  } else {
    fanout_n<T, D, Fanout::kTagged>(p, c, program, s, n, shift, range);
  }
}

// ------------------------------------------------------------------ flags

__device__ __forceinline__ plan::FlagSeen unpack(const FlagBits& f) {
  return plan::FlagSeen{f.gen, static_cast<uint32_t>(f.call), static_cast<uint32_t>(f.call >> 32)};
}

// One thread per flag. Spins (one 16-byte acquire load per poll, of this rank's own memory)
// until the flag reaches this call's generation, then checks that the peer entered it with
// the same call. Bounded by p.timeout_ns measured on the global timer.
__device__ __forceinline__ void wait_flag(const LaunchParams& p, const Call& c, int step_index,
                                          const plan::Step& step) {
  const plan::FlagWord* word = flag_word(p, c, step.flag_owner, step.flag);
  FlagBits f = load_flag_acquire_sys(word);
  if (!plan::gen_reached(f.gen, c.gen)) {
    const uint64_t start = global_timer_ns();
    uint32_t polls = 0;
    do {
      if (++polls == kPollsPerClockCheck) {
        polls = 0;
        if (p.timeout_ns != 0 && global_timer_ns() - start > p.timeout_ns) {
          fail(p, plan::make_diagnostic(plan::FailureKind::kTimeout, position(p, c), step_index,
                                        step, plan::FlagSeen{f.gen}));
        }
      }
      f = load_flag_acquire_sys(word);
    } while (!plan::gen_reached(f.gen, c.gen));
  }
  // A torn read (new gen, older call half) resolves on the next read; a real mismatch stays.
  for (int i = 0; i < kMismatchRereads && plan::is_mismatch(position(p, c), unpack(f)); ++i) {
    f = load_flag_acquire_sys(word);
  }
  if (plan::is_mismatch(position(p, c), unpack(f))) {
    fail(p, plan::make_diagnostic(plan::FailureKind::kMismatch, position(p, c), step_index, step,
                                  unpack(f)));
  }
}

// One thread per flag, after a CTA barrier: the CTA's stores to the slice are ordered before
// the release, which carries the generation and the call in one 16-byte store.
__device__ __forceinline__ void raise_flag(const LaunchParams& p, const Call& c,
                                           const plan::Step& step) {
  plan::FlagWord* word = flag_word(p, c, step.flag_owner, step.flag);
  const uint64_t call = static_cast<uint64_t>(static_cast<uint32_t>(p.numel)) |
                        (static_cast<uint64_t>(p.signature) << 32);
  store_flag_release_sys(word, c.gen, call);
}

// Steps s, s + 1, ... of the same kind as step s: a run the CTA handles in parallel.
__device__ __forceinline__ int run_length(const plan::Program& program, int s) {
  const plan::StepKind kind = program.steps[s].kind;
  int end = s + 1;
  while (end < program.num_steps && program.steps[end].kind == kind) ++end;
  return end - s;
}

// End of the call, own counters only (plan/protocol.h): every generation counter of this CTA's
// residue class takes this call's generation. Flags need nothing.
__device__ __forceinline__ void finish_call(const LaunchParams& p, const Call& c) {
  const int stride = static_cast<int>(gridDim.x);
  const int my_blocks = (p.layout.max_blocks - c.block + stride - 1) / stride;
  uint8_t* own = p.counters[c.rank];
  for (int i = thread_index(); i < my_blocks; i += blockDim.x) {
    store_volatile_u64(own + p.layout.gen_counter_offset(c.block + i * stride), c.gen);
  }
}

// ------------------------------------------------------------------ the fused epilogue

// The epilogue's barrier, on the generation counters (this GPU's memory on every transport: only
// the rank reads them): CTA b's counter takes this call's generation once its slices of the
// output are done (the CTA barrier orders every thread's stores before thread 0's release), one
// thread per CTA acquires each other CTA's, then the CTA barrier. Nothing else reads a counter of
// [0, gridDim.x) during the call: each CTA read its own at the start, and finish_call() stores
// the same generation again. Local polls only; bounded like every wait (a CTA stuck on a peer
// times out there first, naming the peer).
__device__ __forceinline__ void meet_rank_ctas(const LaunchParams& p, const Call& c, int step_index,
                                               const plan::Step& step) {
  uint8_t* counters = p.counters[c.rank];
  __syncthreads();
  if (thread_index() == 0) {
    store_release_gpu_u64(counters + p.layout.gen_counter_offset(c.block), c.gen);
  }
  for (int b = thread_index(); b < static_cast<int>(gridDim.x); b += blockDim.x) {
    const uint8_t* word = counters + p.layout.gen_counter_offset(b);
    uint64_t seen = load_acquire_gpu_u64(word);
    const uint64_t start = global_timer_ns();
    uint32_t polls = 0;
    while (!plan::gen_reached(seen, c.gen)) {
      if (++polls == kPollsPerClockCheck) {
        polls = 0;
        if (p.timeout_ns != 0 && global_timer_ns() - start > p.timeout_ns) {
          fail(p, plan::make_diagnostic(plan::FailureKind::kTimeout, position(p, c), step_index,
                                        step, plan::FlagSeen{seen}));
        }
      }
      seen = load_acquire_gpu_u64(word);
    }
  }
  __syncthreads();
}

template <typename T>
__device__ __forceinline__ void run_epilogue(const LaunchParams& p, const Call& c,
                                             const plan::Program& program, int s) {
  meet_rank_ctas(p, c, s, program.steps[s]);
  epilogue_rows<T>(p, c.rank, c.block);
}

// Bound: executor_bound() of the launches that run this instantiation (kernel_params.h). The
// large-message kernels ask no minimum of CTAs per SM (0, as if absent): with 1, CUDA 13.0's
// ptxas allocates the fp32 push kernel differently and spills it on sm_90.
template <typename T, plan::Direction D, int Bound>
__global__ void __launch_bounds__(Bound, Bound == kMaxThreads ? 0 : kDecodeMinCtasPerSm)
    executor_kernel(const __grid_constant__ LaunchParams p) {
  static_assert(Bound == kMaxThreads || (Bound == kDecodeThreads && D == plan::Direction::kPush),
                "an instantiation executor_bound() never picks");
  // The program is read by every thread at every step: stage it once in shared memory.
  __shared__ uint32_t staged_program[sizeof(plan::Program) / 4];

  Call c;
  c.rank = p.first_rank + static_cast<int>(blockIdx.y);
  c.block = static_cast<int>(blockIdx.x);
  // Programs are written once, at upload: safe to read before the previous grid is done.
  const auto* program_words = reinterpret_cast<const uint32_t*>(p.programs[c.rank]);
  const int num_steps = p.programs[c.rank]->num_steps;
  const int num_words =
      static_cast<int>((offsetof(plan::Program, steps) + num_steps * sizeof(plan::Step)) / 4);
  for (int i = thread_index(); i < num_words; i += blockDim.x) {
    staged_program[i] = load_read_only(program_words + i);
  }
  wait_for_previous_grid();
  // Written only by this CTA at the end of the previous call (an earlier kernel). Every thread
  // reads it before the barrier below; this call writes it after its last step.
  c.gen = load_volatile_u64(p.counters[c.rank] + p.layout.gen_counter_offset(c.block)) + 1u;
  c.parity = plan::gen_parity(c.gen);
  c.ll_tag = plan::ll_tag(c.gen, static_cast<uint32_t>(p.numel), p.signature);
  c.num_vecs = p.numel * static_cast<int64_t>(sizeof(T)) / plan::kVectorBytes;
  __syncthreads();
  const auto& program = *reinterpret_cast<const plan::Program*>(staged_program);

  // The step count and the chunk count are read from the staged program where they are needed,
  // not held in registers through the kernel (at its register budget they were spilled).
  for (int s = 0; s < program.num_steps; ++s) {
    const plan::Step& step = program.steps[s];
    switch (step.kind) {
      case plan::StepKind::kReduce: {
        // Pull programs never copy one buffer to several places (writers write their own
        // slots), so pull kernels carry no fan-out code.
        const int n = D == plan::Direction::kPush ? fanout_length(program, s) : 1;
        if (n > 1) {
          if constexpr (D == plan::Direction::kPush) run_fanout<T, D>(p, c, program, s, n);
          s += n - 1;
        } else {
          run_reduce<T, D, Bound>(p, c, program, s);
        }
        break;
      }
      case plan::StepKind::kSignal: {
        const int n = run_length(program, s);
        __syncthreads();
        for (int j = thread_index(); j < n; j += blockDim.x) raise_flag(p, c, program.steps[s + j]);
        s += n - 1;
        break;
      }
      case plan::StepKind::kWait: {
        const int n = run_length(program, s);
        for (int j = thread_index(); j < n; j += blockDim.x) {
          wait_flag(p, c, s + j, program.steps[s + j]);
        }
        __syncthreads();
        s += n - 1;
        break;
      }
      case plan::StepKind::kEpilogue:
        run_epilogue<T>(p, c, program, s);
        break;
    }
  }
  allow_dependent_grids();
  finish_call(p, c);
}

}  // namespace pcie_ar::transport::kernels
