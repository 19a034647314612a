// The protocols both transports speak.
//
// Flag protocol. Generations are 64-bit counters that only grow, one per block and rank; at 2^64
// they never wrap, so a flag nobody touched for a long time simply reads as "not reached", no
// flag ever needs a reset or a refresh, and CUDA-graph replay is safe. Each flag has exactly one
// writer per generation; data slots and flags are double buffered by generation parity, so a
// fast rank never overwrites what a slow peer still reads.
//
// LL (flag-in-data) protocol. Every 8-byte word a writer stores into an LL slot is {4 bytes of
// payload, 32-bit tag}; the tag is ll_tag(gen, numel, signature), so it names this generation
// AND this call. A 16-byte vector is stored as {d0, tag, d1, tag}: each 8-byte half validates
// itself, so a write torn at 8 bytes (PCIe) is harmless. The reader polls its own memory until
// both tags of a vector match, uses the payload, and then writes the vector back as empty
// (kLLEmpty in every 32-bit word), which no tag ever equals. That reset is what makes a 32-bit
// tag safe forever: without it, a word that a large call once wrote and no later call touched
// would read as valid again when the low 32 bits of the generation (or the call's hash) came
// round, and silently hand stale data to a reader.
//
// Lamport (dense flag-in-data) protocol: the same slots, steps and resets, but no tag. A slot
// holds the payload itself, one 16-byte vector per 16 payload bytes (half of LL's bytes on the
// link), and a 32-bit word has arrived when it is no longer kLLEmpty. A writer never stores
// kLLEmpty: it writes every negative zero as positive zero (ll_dense_word), which changes a sum
// only where every operand of it was -0. 32-bit words are single-copy atomic (a .v2.u64 access
// is two 64-bit ones by the PTX rule), so a word is either empty or the writer's value. What the
// payload no longer says, the call it belongs to, travels in one header per (slot, chunk, block)
// (Layout::ll_header_offset): an LL vector {0, tag, 0, tag} the writer stores beside its data and
// the reader awaits and resets like any LL vector, so a peer in another call is still named
// (kLLMismatch) rather than summed. Because both formats reset to kLLEmpty everywhere they read,
// a slot is all kLLEmpty between calls, whichever format the last call used.
#pragma once

#include <cstdint>
#include <string>

#include "plan/host_device.h"
#include "plan/step.h"

namespace pcie_ar::plan {

// One flag, 16 bytes: the generation and the call identity travel in one store and are read by
// one load. The writer releases it after its data; the reader acquires it and checks that the
// peer entered this generation with the same call.
struct alignas(16) FlagWord {
  uint64_t gen;
  uint32_t numel;
  uint32_t signature;
};
static_assert(sizeof(FlagWord) == 16);

// True when `seen` is at or past `expected`.
PCIE_AR_HD bool gen_reached(uint64_t seen, uint64_t expected) { return seen >= expected; }

PCIE_AR_HD int gen_parity(uint64_t gen) { return static_cast<int>(gen & 1u); }

// What every 32-bit word of an LL slot (and of an LL header) holds when nothing is in it: the
// reset both formats write after they read, and the state initialisation leaves. It is the bits
// of fp32 -0 and of the 16-bit pair {+0, -0}, which a Lamport writer never stores
// (ll_dense_word), and no ll_tag() equals it.
inline constexpr uint32_t kLLEmpty = 0x80000000u;

// The tag of every LL word of a call: the low 32 bits of the generation with a 31-bit hash of
// the call folded in above the parity bit, so bit 0 is always the generation's parity. A peer
// that entered this generation with a different call writes a different tag (the reader reports
// a mismatch instead of reducing garbage). kLLEmpty (parity 0) is moved aside, parity kept.
PCIE_AR_HD uint32_t ll_tag(uint64_t gen, uint32_t numel, uint32_t signature) {
  uint32_t h = numel * 0x9E3779B1u ^ signature;
  h ^= h >> 15;
  h *= 0x2C1B3C6Du;
  h ^= h >> 13;
  const uint32_t tag = static_cast<uint32_t>(gen) ^ (h << 1);
  return tag == kLLEmpty ? tag ^ 2u : tag;
}

// A Lamport payload word as a writer stores it: a 16-bit or 32-bit negative zero becomes
// positive zero, so no stored word is kLLEmpty. `elem_bytes` is 2 (bf16, fp16) or 4 (fp32).
PCIE_AR_HD uint32_t ll_dense_word(uint32_t word, int elem_bytes) {
  if (elem_bytes == 4) return word == 0x80000000u ? 0u : word;
  // Branch-free, per 16-bit half: m is zero exactly in the -0 halves; `nonzero` has the top
  // bit of every half where m is not zero (the low 15 bits added to 0x7FFF carry into it, or
  // it was set already); the -0 halves lose their sign bit, the others keep every bit.
  const uint32_t m = word ^ 0x80008000u;
  const uint32_t nonzero = (((m & 0x7FFF7FFFu) + 0x7FFF7FFFu) | m) & 0x80008000u;
  return word & (nonzero | 0x7FFF7FFFu);
}

// True when a Lamport vector (four 32-bit words) has fully arrived.
PCIE_AR_HD bool ll_dense_arrived(uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  return (a != kLLEmpty) & (b != kLLEmpty) & (c != kLLEmpty) & (d != kLLEmpty);
}

// One LL word, as the host stores it with a single 64-bit atomic: payload low, tag high.
PCIE_AR_HD uint64_t ll_word(uint32_t payload, uint32_t tag) {
  return static_cast<uint64_t>(payload) | (static_cast<uint64_t>(tag) << 32);
}
PCIE_AR_HD uint32_t ll_word_tag(uint64_t word) { return static_cast<uint32_t>(word >> 32); }
PCIE_AR_HD uint32_t ll_word_payload(uint64_t word) { return static_cast<uint32_t>(word); }

// A tag of this slot's parity that is neither the expected one nor empty: a peer wrote this
// generation's slot for a different call (or from a different generation: the ranks fell out of
// step).
PCIE_AR_HD bool ll_foreign(uint32_t seen, uint32_t expected) {
  return seen != expected && seen != kLLEmpty && ((seen ^ expected) & 1u) == 0;
}

enum class FailureKind : uint32_t {
  kNone = 0,
  kTimeout = 1,      // a flag never reached this generation
  kMismatch = 2,     // a flag reached it, but for a different call (or a later generation)
  kLLTimeout = 3,    // an LL vector never arrived
  kLLMismatch = 4,   // an LL vector arrived tagged for a different call or generation
  kInterrupted = 5,  // this rank abandoned the call in a wait (a signal: Ctrl-C); host only
  // The group's own collective (the fallback of a call the kernels declined) did not complete in
  // time: a peer took the kernels for this call, or is gone. Recorded by the communicator only.
  kFallbackTimeout = 6,
};
inline constexpr auto kFailureKindNames =
    name_table<FailureKind>("failure kind", {{FailureKind::kNone, "none"},
                                             {FailureKind::kTimeout, "timeout"},
                                             {FailureKind::kMismatch, "mismatch"},
                                             {FailureKind::kLLTimeout, "ll_timeout"},
                                             {FailureKind::kLLMismatch, "ll_mismatch"},
                                             {FailureKind::kInterrupted, "interrupted"},
                                             {FailureKind::kFallbackTimeout, "fallback_timeout"}});
// A diagnostic's peer when no one peer can be named (the group's collective does not say which
// rank it waits for).
inline constexpr uint32_t kUnknownRank = 0xFFFFFFFFu;

// What an executor records before it fails, where the host can read it (mapped host memory on
// the GPU). All fields are plain words so a kernel can write them without a format.
// LL failures: flag is the LL slot, flag_owner this rank, gen_seen the tag seen and
// peer_signature the tag expected (peer_numel is 0: an LL word carries no call identity).
struct alignas(16) Diagnostic {
  uint32_t kind;  // FailureKind
  uint32_t rank;
  uint32_t peer;
  uint32_t step;
  uint32_t stage;
  uint32_t block;
  uint32_t flag;
  uint32_t flag_owner;
  uint64_t gen_seen;
  uint64_t gen_expected;
  uint32_t numel;           // this rank's call
  uint32_t signature;       // this rank's call
  uint32_t peer_numel;      // what the peer's flag carried
  uint32_t peer_signature;  // what the peer's flag carried
};
static_assert(sizeof(Diagnostic) == 64);

// Where one executor (a CTA on the GPU, a slice loop on the host) stands in a call: the part
// of a diagnostic that does not depend on the step that failed.
struct CallPosition {
  uint32_t rank;
  uint32_t block;
  uint64_t gen;        // the generation this call runs
  uint32_t numel;      // this rank's call
  uint32_t signature;  // this rank's call (call_signature)
};

// What a wait saw in the flag it was polling.
struct FlagSeen {
  uint64_t gen;
  uint32_t numel = 0;      // mismatch only: what the peer's flag carried
  uint32_t signature = 0;  // mismatch only
};

// The record both executors write before they fail, so a host timeout and a trapped kernel
// read the same to the user.
PCIE_AR_HD Diagnostic make_diagnostic(FailureKind kind, const CallPosition& at, int step_index,
                                      const Step& step, const FlagSeen& seen) {
  Diagnostic d{};
  d.kind = static_cast<uint32_t>(kind);
  d.rank = at.rank;
  d.peer = step.peer;
  d.step = static_cast<uint32_t>(step_index);
  d.stage = step.stage;
  d.block = at.block;
  d.flag = step.flag;
  d.flag_owner = step.flag_owner;
  d.gen_seen = seen.gen;
  d.gen_expected = at.gen;
  d.numel = at.numel;
  d.signature = at.signature;
  d.peer_numel = seen.numel;
  d.peer_signature = seen.signature;
  return d;
}

// True when a wait that reached its generation must still fail: the peer entered it with a
// different call, or it is already past this generation (the ranks fell out of step).
PCIE_AR_HD bool is_mismatch(const CallPosition& at, const FlagSeen& seen) {
  return seen.numel != at.numel || seen.signature != at.signature || seen.gen != at.gen;
}

// The LL record: the step's LL operand `src` never arrived (`seen` is its tag) or arrived
// tagged for another call.
PCIE_AR_HD Diagnostic make_ll_diagnostic(FailureKind kind, const CallPosition& at, int step_index,
                                         const Step& step, const BufRef& src, uint32_t seen,
                                         uint32_t expected) {
  Diagnostic d = make_diagnostic(kind, at, step_index, step, FlagSeen{seen, 0, expected});
  d.peer = src.writer;
  d.flag = src.slot;
  d.flag_owner = src.owner;
  return d;
}

// End of every call (both executors): every generation counter of the finishing block's residue
// class (blocks b, b + blocks, b + 2*blocks, ... < max_blocks) takes this call's generation, so
// the next call starts from the same value whatever its block count, and every block of a call
// uses the same parity. Flags need nothing: a 64-bit generation never comes round again.

// One sentence for an error message: who failed, where, waiting for whom, what was seen and
// what was expected, e.g. "rank 0 timed out after 30 s at step 4 (stage 1, block 0) waiting for
// rank 2 to raise flag 9: generation seen 6, expected 7". A mismatch names both calls, and
// says so when the peer is already at a later generation (the ranks fell out of step).
std::string describe_failure(const Diagnostic& diagnostic, double timeout_s = 0.0);

}  // namespace pcie_ar::plan
