// A tactic: which algorithm runs a reduction, in which direction, staged or not, and with
// what launch shape. Enum values cross the ABI into kernels, shared memory and tuning files:
// they are explicit and append-only.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "plan/names.h"

namespace pcie_ar::plan {

enum class DType : uint8_t { kBF16 = 0, kFP16 = 1, kFP32 = 2 };

enum class Algorithm : uint8_t {
  kOneshot = 0,        // every rank receives every input and reduces the whole message
  kTwoshot = 1,        // reduce-scatter, then all-gather
  kIslandOneshot = 2,  // oneshot inside each island, then partners exchange island sums
  kIslandTwoshot = 3,  // island reduce-scatter, partner exchange, island all-gather
};

// Push: writers store into the reader's workspace (posted writes; root-complex hosts like it).
// Pull: readers load from the writer's workspace (some switch fabrics collapse on peer writes).
enum class Direction : uint8_t { kPush = 0, kPull = 1 };

// How a reader learns that data has arrived. Flag: the writer stores the data, then releases a
// separate flag word (a system fence per signal); fits any size. LL (NCCL's low-latency idea):
// every 8-byte word a writer stores carries 4 bytes of payload and a tag derived from the call's
// generation, so the data is its own flag: no fence, no flag word, the reader polls its own
// memory per vector. Half the payload per byte moved, so it pays only for small messages.
// Lamport (the sentinel idea of TensorRT-LLM's and FlashInfer's one-shot kernels): the same
// steps and slots as LL, but the payload is stored as it is and a word has arrived when it is no
// longer the empty pattern the reader left there; one tagged header per slice names the call.
// Every payload byte moved once (plan/protocol.h).
enum class Protocol : uint8_t { kFlag = 0, kLL = 1, kLamport = 2 };

// What a call computes. All-reduce: every rank's output is the sum of every rank's input.
// Reduce-scatter (torch's reduce_scatter_tensor along dim 0): the message is cut into `world`
// equal chunks and rank r's output, one chunk long, is chunk r of the sum. All-gather
// (all_gather_into_tensor): rank r's input, one chunk long, becomes chunk r of every rank's
// output. Reduce-scatter and all-gather are two-shot's two halves: they are built from the
// two-shot algorithms (flat and island) only.
enum class Collective : uint8_t { kAllReduce = 0, kReduceScatter = 1, kAllGather = 2 };

// True for the protocols whose data carries its own arrival (LL slots, no flags): LL and Lamport.
constexpr bool flag_in_data(Protocol p) { return p == Protocol::kLL || p == Protocol::kLamport; }

// The names of each enum (plan/names.h): what tuning tables, Python and messages call them.
inline constexpr auto kDTypeNames = name_table<DType>(
    "dtype", {{DType::kBF16, "bf16"}, {DType::kFP16, "fp16"}, {DType::kFP32, "fp32"}});
inline constexpr auto kAlgorithmNames =
    name_table<Algorithm>("algorithm", {{Algorithm::kOneshot, "oneshot"},
                                        {Algorithm::kTwoshot, "twoshot"},
                                        {Algorithm::kIslandOneshot, "island_oneshot"},
                                        {Algorithm::kIslandTwoshot, "island_twoshot"}});
inline constexpr auto kDirectionNames =
    name_table<Direction>("direction", {{Direction::kPush, "push"}, {Direction::kPull, "pull"}});
inline constexpr auto kProtocolNames = name_table<Protocol>(
    "protocol",
    {{Protocol::kFlag, "flag"}, {Protocol::kLL, "ll"}, {Protocol::kLamport, "lamport"}});

inline constexpr auto kCollectiveNames =
    name_table<Collective>("collective", {{Collective::kAllReduce, "all_reduce"},
                                          {Collective::kReduceScatter, "reduce_scatter"},
                                          {Collective::kAllGather, "all_gather"}});

inline constexpr auto kAllAlgorithms = kAlgorithmNames.values();
inline constexpr auto kAllDTypes = kDTypeNames.values();

struct Tactic {
  Algorithm algorithm = Algorithm::kOneshot;
  Direction direction = Direction::kPush;
  bool staged = true;
  Protocol protocol = Protocol::kFlag;
  int blocks = 1;     // CTAs per rank on the GPU; slices processed in turn on the host
  int threads = 256;  // threads per CTA (GPU only)

  bool operator==(const Tactic&) const = default;
};

int dtype_bytes(DType dtype);
bool is_island_algorithm(Algorithm algorithm);

// The tables' names ("?" for a value outside the enum) and parsers (std::nullopt for any other
// name), by enum.
inline std::string_view dtype_name(DType dtype) { return kDTypeNames.name_of(dtype); }
inline std::string_view algorithm_name(Algorithm a) { return kAlgorithmNames.name_of(a); }
inline std::string_view direction_name(Direction d) { return kDirectionNames.name_of(d); }
inline std::string_view protocol_name(Protocol p) { return kProtocolNames.name_of(p); }
inline std::string_view collective_name(Collective c) { return kCollectiveNames.name_of(c); }
inline std::optional<Collective> parse_collective(std::string_view name) {
  return kCollectiveNames.find(name);
}
inline std::optional<DType> parse_dtype(std::string_view name) { return kDTypeNames.find(name); }
inline std::optional<Algorithm> parse_algorithm(std::string_view name) {
  return kAlgorithmNames.find(name);
}
inline std::optional<Direction> parse_direction(std::string_view name) {
  return kDirectionNames.find(name);
}
inline std::optional<Protocol> parse_protocol(std::string_view name) {
  return kProtocolNames.find(name);
}

// The same tactic as `collective`, a half of an all-reduce: twoshot for oneshot, island_twoshot
// for island_oneshot (a one-shot all-reduce is a two-shot's reduce-scatter and all-gather
// fused), every other field kept; except that an all-gather takes lamport's LL twin (the same
// steps), since lamport stores -0 as +0 and an all-gather moves every bit. Two-shot algorithms
// are their own form.
Tactic two_shot_form(Tactic tactic, Collective collective);

// "oneshot/push/staged/flag/b16/t256": stable, used as the stats key.
std::string tactic_label(const Tactic& tactic);

// A 32-bit code for (numel, dtype, tactic) written beside every flag, so a reader detects a
// peer that entered the same generation with a different call instead of reducing garbage.
// `fused`: the call is all_reduce_add_rms_norm (top byte 0xF5, else 0xA5), so a rank in the fused
// call and a peer in the plain all-reduce of the same tensor fail as a mismatch naming each
// other, instead of each returning something the other did not compute. `collective`: a
// reduce-scatter (0xB5) or all-gather (0xC5) likewise never pairs up with another collective.
uint32_t call_signature(DType dtype, const Tactic& tactic, bool fused = false,
                        Collective collective = Collective::kAllReduce);

}  // namespace pcie_ar::plan
