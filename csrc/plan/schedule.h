// Schedules: an all-reduce algorithm for one world size and island map, as data. A schedule
// is one program (an ordered list of Steps) per rank; chunks are fractions of the message, so
// a schedule is size-free. Builders emit; the verifier (verify.h) proves; encode_program()
// turns one rank's program into the POD both transports execute.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "plan/step.h"
#include "plan/tactic.h"

namespace pcie_ar::plan {

// Thrown when a builder is asked for something it does not build; what() says why.
class UnsupportedSchedule : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct Schedule {
  Algorithm algorithm = Algorithm::kOneshot;
  Direction direction = Direction::kPush;
  bool staged = true;
  Protocol protocol = Protocol::kFlag;
  int world = 0;
  int num_chunks = 1;
  int num_stages = 0;
  // rank -> island; every rank in island 0 for a flat topology. Island algorithms need two
  // equal islands; flat algorithms use the map only to count cross-island traffic.
  std::vector<int> island_of;
  std::vector<std::vector<Step>> programs;  // programs[rank]
  // What the schedule computes (plan/tactic.h). Reduce-scatter and all-gather cut the message
  // into `world` chunks; chunk r of the reduce-scatter's output and of the all-gather's input is
  // rank r's tensor, and their programs touch no other chunk of it (the verifier proves it).
  Collective collective = Collective::kAllReduce;
  // Every program ends with the fused epilogue (with_epilogue): the verifier proves each rank's
  // output whole before it.
  bool epilogue = false;
};

// Why `algorithm` cannot be built for this world and island map, or nullopt when it can.
// World sizes 2..8; island algorithms need exactly two islands of equal size >= 2.
std::optional<std::string> why_unsupported(Algorithm algorithm, int world,
                                           const std::vector<int>& island_of);

// Why the (algorithm, direction, staging, protocol) of `tactic` cannot be built here, or
// nullopt. Besides the above: LL is push-only (a pull reader would poll the writer's memory
// across the fabric) and unstaged (data is read where it lands, as soon as it lands); a
// reduce-scatter or all-gather is built from the two-shot algorithms only (one-shot has no half
// that is one); an all-gather is not built on lamport, which stores -0 as +0 (an all-gather
// moves every bit, and every rank's copy of a chunk must be the owner's).
std::optional<std::string> why_unsupported(const Tactic& tactic, int world,
                                           const std::vector<int>& island_of,
                                           Collective collective = Collective::kAllReduce);

// The group's one reduction order: every tactic and collective of a group computes each output
// element as this tree, so a table may mix them freely without changing a bit. Where the island
// algorithms build (two equal islands of >= 2 ranks), two groups — the island holding rank 0, then
// the other, each in ascending rank order — whose sums are rounded to the dtype before they are
// added (what an island tactic stores and sends across the socket link); elsewhere one group, every
// rank in ascending order. Flat tactics on an islanded group make the same two roundings in
// registers (Step::split); they send no more bytes for it.
std::vector<std::vector<int>> canonical_groups(int world, const std::vector<int>& island_of);

// Every (algorithm, direction, staging, protocol) the builders accept for this world and
// island map, in a fixed order; blocks and threads keep their defaults.
std::vector<Tactic> buildable_tactics(int world, const std::vector<int>& island_of,
                                      Collective collective = Collective::kAllReduce);

// Throws UnsupportedSchedule with the reason from why_unsupported(). An empty island_of means
// flat (one island).
Schedule build_schedule(Algorithm algorithm, Direction direction, bool staged, int world,
                        const std::vector<int>& island_of = {}, Protocol protocol = Protocol::kFlag,
                        Collective collective = Collective::kAllReduce);

// Fuses each copy that forwards a sum's result (the copy reads, for the same chunk, the buffer
// the sum just wrote) into that sum as its second destination, when nothing in between waits
// or touches either buffer: one pass writes both, instead of writing the result and reading it
// back. Two-shot's all-gather sends (push) and the pull ranks' copy of their published chunk
// fuse this way. LL steps never fuse. The result must be verified like any schedule.
Schedule fuse_forwarding_copies(Schedule schedule);

// The schedule of the fused call (plan/epilogue.h): every rank's program, unchanged, followed by
// one StepKind::kEpilogue step. The epilogue reads and writes only the rank's own tensors, so it
// adds no transfer, flag or wait between ranks; the verifier proves every chunk of the rank's
// output holds the sum before it. Throws std::invalid_argument for a schedule that has one, or
// that is not an all-reduce.
Schedule with_epilogue(Schedule schedule);

// The POD a transport executes for `rank`. Throws std::length_error if the program does not
// fit (it always does for schedules the builders emit).
Program encode_program(const Schedule& schedule, int rank);

// The program of a call that took another path (the group's own all-reduce): no steps, so an
// executor only ends the call, and every generation counter takes the next generation, as for a
// call that ran. A rank runs it for every call it sends to the fallback, so every rank's
// generation counts every call whatever path each took. Without it, a rank that declined a call
// its peer ran on the kernels would, at its next call of the same shape, find the peer's data of
// the abandoned call waiting under the very generation it expects, and sum it.
Program skip_program(int rank, int world);

// Human-readable names for diagnostics and to_dict().
std::string describe_step(const Step& step);

}  // namespace pcie_ar::plan
