// The byte layout of one rank's workspace and how a message is cut into chunks and slices.
// Every rank computes the same layout from the same (max_numel, world, dtype, max_blocks), and
// the construction handshake checks that they agree, so peers can address each other's slabs.
//
//   [generation counters: uint64 per block]          128-byte aligned
//   [flags: FlagWord[2 parities][max_blocks][num_flags]]
//   [LL headers: 32 bytes[2 parities][num_slots][kMaxWorld chunks][max_blocks]]   lamport only
//   [LL:    ll_slot_bytes[2 parities][num_slots]]    LL words: 8 payload bytes per 16
//   [data:  slot_bytes[2 parities][num_slots]]       each slot holds a whole message
// Counters, flags, LL headers and LL slots are the control area: initialisation writes all of it.
#pragma once

#include <cstdint>

#include "plan/host_device.h"
#include "plan/protocol.h"
#include "plan/step.h"
#include "plan/tactic.h"

namespace pcie_ar::plan {

inline constexpr int kVectorBytes = 16;  // every access is one 16-byte vector
inline constexpr int kAlignBytes = 128;
inline constexpr int kDefaultMaxBlocks = 64;
inline constexpr int kFlagsPerWriter = 4;  // signals one rank sends into one flag array per call
// The largest message an LL slot holds (it takes twice this in the workspace). LL pays only for
// small messages; the tuner decides where it stops paying, below this.
inline constexpr int64_t kMaxLLPayloadBytes = 256 * 1024;
inline constexpr int kLLExpansion = 2;  // an LL slot stores 8 payload bytes per 16
inline constexpr int kLLHeaderBytes = kLLExpansion * kVectorBytes;  // a lamport slice's header
// Slot roles. Slot s < world holds rank s's contribution; the rest have one job each.
PCIE_AR_HD int slot_from_rank(int rank) { return rank; }
PCIE_AR_HD int slot_staged_input(int world) { return world; }  // pull: own input, readable
PCIE_AR_HD int slot_partial(int world) { return world + 1; }   // this rank's island sum
PCIE_AR_HD int slot_gather(int world) { return world + 2; }    // reduced chunks, all-gathered
PCIE_AR_HD int num_slots_for(int world) { return world + 3; }
PCIE_AR_HD int num_flags_for(int world) { return world * kFlagsPerWriter; }

struct Layout {
  int64_t max_numel = 0;
  int world = 0;
  int elem_bytes = 0;  // widest dtype the workspace must hold
  int max_blocks = 0;
  int num_slots = 0;
  int num_flags = 0;
  uint64_t gen_offset = 0;
  uint64_t flags_offset = 0;
  uint64_t flag_parity_stride = 0;
  uint64_t flag_block_stride = 0;
  uint64_t ll_header_offset_base = 0;
  uint64_t ll_offset = 0;
  uint64_t ll_slot_bytes = 0;  // kLLExpansion * ll_capacity_bytes
  uint64_t ll_parity_stride = 0;
  int64_t ll_capacity_bytes = 0;  // the largest message an LL tactic can carry
  uint64_t data_offset = 0;
  uint64_t slot_bytes = 0;
  uint64_t data_parity_stride = 0;
  uint64_t control_bytes = 0;  // counters, flags, LL headers and slots: what initialisation writes
  uint64_t total_bytes = 0;

  PCIE_AR_HD uint64_t gen_counter_offset(int block) const {
    return gen_offset + static_cast<uint64_t>(block) * sizeof(uint64_t);
  }
  PCIE_AR_HD uint64_t flag_offset(int parity, int block, int flag) const {
    return flags_offset + static_cast<uint64_t>(parity) * flag_parity_stride +
           static_cast<uint64_t>(block) * flag_block_stride +
           static_cast<uint64_t>(flag) * sizeof(FlagWord);
  }
  PCIE_AR_HD uint64_t ll_slot_offset(int parity, int slot) const {
    return ll_offset + static_cast<uint64_t>(parity) * ll_parity_stride +
           static_cast<uint64_t>(slot) * ll_slot_bytes;
  }
  // The header of the slice of LL slot `slot` that block `block` of chunk `chunk` writes under
  // the lamport protocol (plan/protocol.h): one LL payload vector (two LL vectors), one writer
  // per call.
  PCIE_AR_HD uint64_t ll_header_offset(int parity, int slot, int chunk, int block) const {
    const uint64_t index =
        ((static_cast<uint64_t>(parity) * num_slots + slot) * kMaxWorld + chunk) * max_blocks +
        block;
    return ll_header_offset_base + index * kLLHeaderBytes;
  }
  PCIE_AR_HD uint64_t slot_offset(int parity, int slot) const {
    return data_offset + static_cast<uint64_t>(parity) * data_parity_stride +
           static_cast<uint64_t>(slot) * slot_bytes;
  }
  bool operator==(const Layout&) const = default;
};

// Throws std::invalid_argument naming the bad value and the accepted range.
Layout make_layout(int64_t max_numel, int world, int elem_bytes,
                   int max_blocks = kDefaultMaxBlocks);

// Throws std::invalid_argument unless `layout` is one make_layout() produces (a hand-built or
// zeroed Layout would send executors outside their memory).
void check_layout(const Layout& layout);

// Writes the control area of a fresh workspace: every generation counter and every flag set
// to `initial_gen`, so the first call expects initial_gen + 1 (tests start near 2^32 to cross
// the wrap of the LL tags' 32 bits), and every word of the LL headers and slots kLLEmpty.
// `control` points at control_bytes bytes.
void initialize_control(void* control, const Layout& layout, uint64_t initial_gen);

// Stable text for the cross-rank handshake and the tests.
uint64_t layout_hash(const Layout& layout);

// Half-open range of 16-byte vectors.
struct VecRange {
  int64_t begin;
  int64_t end;
};

// The vectors of chunk `chunk` of `num_chunks` that block `block` of `num_blocks` owns.
// Chunks and slices are split as evenly as whole vectors allow; every vector belongs to
// exactly one (chunk, block).
PCIE_AR_HD VecRange slice_range(int64_t num_vecs, int num_chunks, int chunk, int num_blocks,
                                int block) {
  const int64_t c0 = num_vecs * chunk / num_chunks;
  const int64_t c1 = num_vecs * (chunk + 1) / num_chunks;
  const int64_t len = c1 - c0;
  return VecRange{c0 + len * block / num_blocks, c0 + len * (block + 1) / num_blocks};
}

// Vectors to add to message vector v of chunk `chunk` to address it in a tensor whose chunks lie
// `stride_vecs` vectors apart (transport::Call::chunk_stride) instead of where the message's own
// chunking puts them (slice_range with one block). 0: the message's own chunking, no shift. A
// nonzero stride is used only where every chunk holds num_vecs / num_chunks vectors exactly (a
// streamed reduce-scatter's or all-gather's round), so chunk c starts at c * num_vecs / num_chunks.
PCIE_AR_HD int64_t chunk_shift(int64_t num_vecs, int num_chunks, int chunk, int64_t stride_vecs) {
  return stride_vecs == 0 ? 0 : chunk * (stride_vecs - num_vecs / num_chunks);
}

}  // namespace pcie_ar::plan
