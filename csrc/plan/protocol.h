// The flag protocol both transports speak. Flags are 32-bit generations that only grow and are
// compared modulo 2^32, so they never need a reset (CUDA-graph replay is safe) and survive the
// wrap. Each flag has exactly one writer per generation; data slots and flags are double
// buffered by generation parity, so a fast rank never overwrites what a slow peer still reads.
#pragma once

#include <cstdint>
#include <string>

#include "plan/host_device.h"

namespace pcie_ar::plan {

// One flag. The writer stores numel and signature, then release-stores gen; the reader
// acquire-loads gen and then checks that the peer entered this generation with the same call.
struct alignas(16) FlagWord {
  uint32_t gen;
  uint32_t numel;
  uint32_t signature;
  uint32_t writer;  // rank that wrote it, for diagnostics
};
static_assert(sizeof(FlagWord) == 16);

// True when `seen` is at or past `expected`, modulo 2^32.
PCIE_AR_HD bool gen_reached(uint32_t seen, uint32_t expected) {
  return static_cast<int32_t>(seen - expected) >= 0;
}

PCIE_AR_HD int gen_parity(uint32_t gen) { return static_cast<int>(gen & 1u); }

enum class FailureKind : uint32_t { kNone = 0, kTimeout = 1, kMismatch = 2 };

// What an executor records before it fails, where the host can read it (mapped host memory on
// the GPU). All fields are plain words so a kernel can write them without a format.
struct alignas(16) Diagnostic {
  uint32_t kind;  // FailureKind
  uint32_t rank;
  uint32_t peer;
  uint32_t step;
  uint32_t stage;
  uint32_t block;
  uint32_t flag;
  uint32_t flag_owner;
  uint32_t gen_seen;
  uint32_t gen_expected;
  uint32_t numel;           // this rank's call
  uint32_t signature;       // this rank's call
  uint32_t peer_numel;      // what the peer's flag carried
  uint32_t peer_signature;  // what the peer's flag carried
  uint32_t reserved[2];
};
static_assert(sizeof(Diagnostic) == 64);

// One sentence for an error message: who failed, where, waiting for whom, what was seen and
// what was expected, e.g. "rank 0 timed out after 30 s at step 4 (stage 1, block 0) waiting for
// rank 2 to raise flag 9: generation seen 6, expected 7".
std::string describe_failure(const Diagnostic& diagnostic, double timeout_s = 0.0);

}  // namespace pcie_ar::plan
