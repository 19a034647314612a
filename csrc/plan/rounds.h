// A message larger than the workspace, streamed through it: a sequence of rounds, each one
// ordinary call of a verified program over its own part of the tensors. Each round takes a
// generation, so round k + 2 reuses round k's slots exactly as a call reuses those of the call two
// before it: after every peer has started round k + 1, and so finished round k (the verifier's
// heard-from-everyone rule; plan::verify_rounds simulates the rounds back to back). Every element
// is still the group's one tree (plan::canonical_groups): a row's bits do not depend on the batch
// or on how many rounds carried it.
#pragma once

#include <cstdint>
#include <vector>

#include "plan/hash.h"

namespace pcie_ar::plan {

struct Round {
  int64_t offset = 0;  // elements from the start of the message
  int64_t numel = 0;
};

// Splits `numel` elements into the fewest rounds of at most `capacity` elements, each a whole
// number of `unit`s (16-byte vectors, or the fused call's rows), as even as possible: the rounds
// have at most two sizes, one unit apart, so a table decides them alike and no round is a
// leftover sliver. numel must be a multiple of unit and capacity at least one unit.
inline std::vector<Round> split_rounds(int64_t numel, int64_t capacity, int64_t unit) {
  const int64_t units = numel / unit;
  const int64_t per_round = capacity / unit;
  if (units <= 0 || per_round <= 0) return {};
  const int64_t n = (units + per_round - 1) / per_round;
  const int64_t base = units / n;
  const int64_t extra = units % n;  // the first `extra` rounds take one unit more
  std::vector<Round> rounds;
  int64_t at = 0;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t size = (base + (k < extra ? 1 : 0)) * unit;
    rounds.push_back(Round{at, size});
    at += size;
  }
  return rounds;
}

// Round `round` of a streamed message of `total_numel` elements: its call's signature with the
// message's size and the round's index mixed into the low 20 bits (where the fused call's eps
// and row length already are), so ranks that stream different messages, or are in different
// rounds of one, fail at once naming each other instead of pairing round by round.
inline uint32_t round_signature(uint32_t signature, int64_t total_numel, int round) {
  const uint64_t h =
      fnv1a_u64(static_cast<uint64_t>(round), fnv1a_u64(static_cast<uint64_t>(total_numel)));
  // Never 0: a round never carries the signature of an unstreamed call of its size.
  return signature ^ ((static_cast<uint32_t>(h ^ (h >> 32)) & 0x000FFFFFu) | 1u);
}

}  // namespace pcie_ar::plan
