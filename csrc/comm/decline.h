// Why a call does not go to the kernels: the reason codes every decline carries into stats(),
// logs and users' dashboards.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "plan/names.h"

namespace pcie_ar::comm {

// Explicit and append-only: the names reach stats(), logs and users' dashboards.
enum class Decline : uint8_t {
  kNone = 0,           // the kernels run it
  kDisabled = 1,       // the backend is off (env flag, handshake disagreement, earlier failure)
  kWorldSize = 2,      // world size outside 2..8
  kDtype = 3,          // not bf16/fp16/fp32 or not in the admitted set
  kDevice = 4,         // not on this communicator's device
  kNotContiguous = 5,  // no longer used: strided views are staged through a contiguous copy
  kNot16ByteMultiple = 6,
  kTooLarge = 7,  // numel > max_numel (streamed all-reduces: > stream_max_numel)
  kEmpty = 8,
  kNvLink = 9,       // NVLink peers: the engine's own custom all-reduce is faster
  kNoP2P = 10,       // a pair failed the write-and-verify P2P test
  kTable = 11,       // the tuning table chose the fallback for this size
  kMisaligned = 12,  // no longer used: misaligned tensors are staged like strided ones
  kMultiHost = 13,   // the group spans hosts (hostname or boot id differ): no shared memory
  // The fused call only (all_reduce_add_rms_norm): a row (the last dimension) that is not whole
  // 16-byte vectors or is longer than plan::kMaxEpilogueHidden.
  kHidden = 14,
  // try_run (OnDecline::kReturn) only: grad mode is on and an operand the call reads requires
  // grad. The forms that write given tensors have no derivative, so the caller's own path, which
  // keeps the graph, runs the call (the torch ops raise instead: their caller has no other path).
  kAutograd = 15,
  // A quantised fused form this communicator's executor does not run. No longer given (every
  // executor runs every form since the CUDA executor runs NVFP4); kept: the enum is append-only
  // and the stats count by code.
  kQuant = 16,
  // The tactic the table chose failed the self-test before serving on some rank (its result
  // differed, bit for bit, from the host's reference of the same known data): every rank sends
  // its calls to the fallback (comm/self_test.h).
  kSelfTest = 17,
};
inline constexpr auto kDeclineNames = plan::name_table<Decline>(
    "decline reason", {{Decline::kNone, "none"},
                       {Decline::kDisabled, "disabled"},
                       {Decline::kWorldSize, "world_size"},
                       {Decline::kDtype, "dtype"},
                       {Decline::kDevice, "device"},
                       {Decline::kNotContiguous, "not_contiguous"},
                       {Decline::kNot16ByteMultiple, "not_16_byte_multiple"},
                       {Decline::kTooLarge, "too_large"},
                       {Decline::kEmpty, "empty"},
                       {Decline::kNvLink, "nvlink"},
                       {Decline::kNoP2P, "no_p2p"},
                       {Decline::kTable, "table"},
                       {Decline::kMisaligned, "misaligned"},
                       {Decline::kMultiHost, "multi_host"},
                       {Decline::kHidden, "hidden"},
                       {Decline::kAutograd, "autograd"},
                       {Decline::kQuant, "quant"},
                       {Decline::kSelfTest, "self_test"}});
inline constexpr size_t kDeclineCount = kDeclineNames.entries.size();

// "unknown" for a value outside the enum.
inline std::string_view decline_name(Decline decline) {
  return kDeclineNames.name_of(decline, "unknown");
}
// The inverse of decline_name(); throws std::invalid_argument naming the unknown reason and the
// known ones.
inline Decline parse_decline(std::string_view name) { return kDeclineNames.parse(name); }

}  // namespace pcie_ar::comm
