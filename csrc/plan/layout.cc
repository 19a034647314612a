#include "plan/layout.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "plan/hash.h"

namespace pcie_ar::plan {
namespace {

uint64_t align_up(uint64_t value) { return (value + kAlignBytes - 1) / kAlignBytes * kAlignBytes; }

}  // namespace

Layout make_layout(int64_t max_numel, int world, int elem_bytes, int max_blocks) {
  if (world < 2 || world > kMaxWorld) {
    throw std::invalid_argument("workspace world size must be in 2.." + std::to_string(kMaxWorld) +
                                ", got " + std::to_string(world));
  }
  if (elem_bytes != 2 && elem_bytes != 4) {
    throw std::invalid_argument("workspace element size must be 2 or 4 bytes, got " +
                                std::to_string(elem_bytes));
  }
  if (max_numel <= 0 || (max_numel * elem_bytes) % kVectorBytes != 0) {
    throw std::invalid_argument("max_numel must be positive and hold a multiple of 16 bytes (" +
                                std::to_string(kVectorBytes / elem_bytes) +
                                " elements of this size), got " + std::to_string(max_numel));
  }
  if (max_numel > 0xFFFFFFFFll) {
    throw std::invalid_argument("max_numel must fit in 32 bits (flags carry it), got " +
                                std::to_string(max_numel));
  }
  if (max_blocks < 1 || max_blocks > 1024) {
    throw std::invalid_argument("max_blocks must be in 1..1024, got " + std::to_string(max_blocks));
  }
  Layout l;
  l.max_numel = max_numel;
  l.world = world;
  l.elem_bytes = elem_bytes;
  l.max_blocks = max_blocks;
  l.num_slots = num_slots_for(world);
  l.num_flags = num_flags_for(world);
  l.gen_offset = 0;
  l.flags_offset = align_up(static_cast<uint64_t>(max_blocks) * sizeof(uint64_t));
  l.flag_block_stride = align_up(static_cast<uint64_t>(l.num_flags) * sizeof(FlagWord));
  l.flag_parity_stride = l.flag_block_stride * static_cast<uint64_t>(max_blocks);
  l.slot_bytes = align_up(static_cast<uint64_t>(max_numel) * elem_bytes);
  l.ll_capacity_bytes = std::min<int64_t>(max_numel * elem_bytes, kMaxLLPayloadBytes);
  l.ll_header_offset_base = align_up(l.flags_offset + 2 * l.flag_parity_stride);
  const uint64_t header_bytes = 2ull * l.num_slots * kMaxWorld * max_blocks * kLLHeaderBytes;
  l.ll_offset = align_up(l.ll_header_offset_base + header_bytes);
  l.ll_slot_bytes = align_up(static_cast<uint64_t>(l.ll_capacity_bytes) * kLLExpansion);
  l.ll_parity_stride = l.ll_slot_bytes * static_cast<uint64_t>(l.num_slots);
  l.control_bytes = l.ll_offset + 2 * l.ll_parity_stride;
  l.data_offset = align_up(l.control_bytes);
  l.data_parity_stride = l.slot_bytes * static_cast<uint64_t>(l.num_slots);
  l.total_bytes = l.data_offset + 2 * l.data_parity_stride;
  return l;
}

void check_layout(const Layout& layout) {
  if (layout.world < 2 || layout.world > kMaxWorld || layout.max_blocks < 1 ||
      layout.total_bytes == 0 || layout.control_bytes > layout.data_offset ||
      layout.ll_offset + 2 * layout.ll_parity_stride > layout.control_bytes ||
      layout.ll_header_offset(1, layout.num_slots - 1, kMaxWorld - 1, layout.max_blocks - 1) +
              kLLHeaderBytes >
          layout.ll_offset ||
      layout.ll_slot_bytes < static_cast<uint64_t>(layout.ll_capacity_bytes) * kLLExpansion ||
      layout.num_slots < num_slots_for(layout.world) ||
      layout.num_flags < num_flags_for(layout.world)) {
    throw std::invalid_argument(
        "the workspace layout is not one plan::make_layout() produces (world " +
        std::to_string(layout.world) + ", max_blocks " + std::to_string(layout.max_blocks) + ", " +
        std::to_string(layout.total_bytes) + " bytes)");
  }
}

void initialize_control(void* control, const Layout& layout, uint64_t initial_gen) {
  auto* bytes = static_cast<unsigned char*>(control);
  std::memset(bytes, 0, layout.control_bytes);
  for (int b = 0; b < layout.max_blocks; ++b) {
    std::memcpy(bytes + layout.gen_counter_offset(b), &initial_gen, sizeof(initial_gen));
    for (int parity = 0; parity < 2; ++parity) {
      for (int f = 0; f < layout.num_flags; ++f) {
        FlagWord word{initial_gen, 0, 0};
        std::memcpy(bytes + layout.flag_offset(parity, b, f), &word, sizeof(word));
      }
    }
  }
  // Every LL header and slot word empty: nothing has arrived, in either format.
  for (uint64_t at = layout.ll_header_offset_base; at < layout.control_bytes; at += 4) {
    std::memcpy(bytes + at, &kLLEmpty, sizeof(kLLEmpty));
  }
}

uint64_t layout_hash(const Layout& layout) {
  // FNV-1a over the fields that decide addresses; equal on every rank or the handshake fails.
  const uint64_t fields[] = {static_cast<uint64_t>(layout.max_numel),
                             static_cast<uint64_t>(layout.world),
                             static_cast<uint64_t>(layout.elem_bytes),
                             static_cast<uint64_t>(layout.max_blocks),
                             static_cast<uint64_t>(layout.num_slots),
                             static_cast<uint64_t>(layout.num_flags),
                             layout.flags_offset,
                             layout.ll_header_offset_base,
                             layout.ll_offset,
                             layout.ll_slot_bytes,
                             static_cast<uint64_t>(layout.ll_capacity_bytes),
                             layout.data_offset,
                             layout.slot_bytes,
                             layout.total_bytes};
  uint64_t h = kFnv1aOffset;
  for (uint64_t f : fields) h = fnv1a_u64(f, h);
  return h;
}

}  // namespace pcie_ar::plan
