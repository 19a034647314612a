#include "plan/schedule.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>

#include "plan/layout.h"

namespace pcie_ar::plan {
namespace {

BufRef input_of(int rank) { return BufRef{Space::kInput, static_cast<uint8_t>(rank), 0, 0}; }
BufRef output_of(int rank) { return BufRef{Space::kOutput, static_cast<uint8_t>(rank), 0, 0}; }
BufRef slot_of(int owner, int slot) {
  return BufRef{Space::kSlot, static_cast<uint8_t>(owner), static_cast<uint8_t>(slot), 0};
}
BufRef ll_of(int owner, int slot, int writer) {
  return BufRef{Space::kLL, static_cast<uint8_t>(owner), static_cast<uint8_t>(slot),
                static_cast<uint8_t>(writer)};
}

// The phases of the algorithms, each with its own flag per writer: inputs delivered to the
// ranks that reduce them; island partials published and swapped across the socket link;
// reduced chunks published and gathered.
// The island reduce-scatter delivers two chunks to each island member (the partner's, then its
// own), each under its own flag: kPhaseSecond.
enum Phase : int { kPhaseDeliver = 0, kPhasePartial = 1, kPhaseGather = 2, kPhaseSecond = 3 };
static_assert(kPhaseSecond < kFlagsPerWriter);

// Flag `phase` that `writer` raises; one writer per (flag array, index) by construction.
int flag_id(int writer, int phase) { return writer * kFlagsPerWriter + phase; }

// A group of ranks that exchange among themselves (all ranks, or one island), with the
// rotation that staging uses: in stage s the member at index i sends to index i+s and
// receives from index i-s, so every stage's peer map is a permutation.
struct Group {
  std::vector<int> members;  // ascending ranks

  int size() const { return static_cast<int>(members.size()); }
  int index_of(int rank) const {
    return static_cast<int>(std::find(members.begin(), members.end(), rank) - members.begin());
  }
  int to(int rank, int s) const { return members[(index_of(rank) + s) % size()]; }
  int from(int rank, int s) const { return members[(index_of(rank) - s + size()) % size()]; }
};

class Builder {
 public:
  Builder(Algorithm algorithm, Direction direction, bool staged, Protocol protocol, int world,
          std::vector<int> island_of, int num_chunks,
          Collective collective = Collective::kAllReduce) {
    s_.collective = collective;
    s_.algorithm = algorithm;
    s_.direction = direction;
    s_.staged = staged;
    s_.protocol = protocol;
    s_.world = world;
    s_.num_chunks = num_chunks;
    s_.island_of = std::move(island_of);
    s_.programs.resize(world);
  }

  int world() const { return s_.world; }
  bool staged() const { return s_.staged; }
  bool push() const { return s_.direction == Direction::kPush; }
  bool ll() const { return flag_in_data(s_.protocol); }

  void reduce(int rank, int chunk, BufRef dst, const std::vector<BufRef>& srcs, int split = 0) {
    Step step;
    step.kind = StepKind::kReduce;
    step.chunk = static_cast<uint8_t>(chunk);
    step.num_srcs = static_cast<uint8_t>(srcs.size());
    step.split = static_cast<uint8_t>(split);
    step.dst = dst;
    std::copy(srcs.begin(), srcs.end(), step.srcs);
    emit(rank, step);
  }

  // Rank r sums `members`' operands (`own` for r, `other(q)` for a peer) as the group's canonical
  // tree orders them: by canonical group, ascending inside each, split between the groups when
  // `members` spans both (a flat tactic on an islanded group), one plain sum when it lies inside
  // one (an island's partial).
  template <typename Other>
  void reduce_members(int r, int chunk, BufRef dst, const std::vector<int>& members, BufRef own,
                      Other other) {
    std::vector<BufRef> srcs;
    int split = 0;
    for (const std::vector<int>& group : canonical_groups(s_.world, s_.island_of)) {
      const size_t before = srcs.size();
      for (int q : group) {
        if (std::find(members.begin(), members.end(), q) != members.end())
          srcs.push_back(q == r ? own : other(q));
      }
      if (before > 0 && srcs.size() > before) split = static_cast<int>(before);
    }
    reduce(r, chunk, dst, srcs, split);
  }
  void copy(int rank, int chunk, BufRef dst, BufRef src) { reduce(rank, chunk, dst, {src}); }

  // `rank` raises its flag `phase` in the flag array of `owner`, the peer that waits for it:
  // in push the rank it wrote to, in pull a rank that will read rank's slots. Every flag lives
  // in the memory of the rank that waits on it, so no wait polls a peer.
  void signal(int rank, int owner, int phase) {
    Step step;
    step.kind = StepKind::kSignal;
    step.peer = static_cast<uint8_t>(owner);
    step.flag_owner = static_cast<uint8_t>(owner);
    step.flag = static_cast<uint8_t>(flag_id(rank, phase));
    emit(rank, step);
  }

  // `rank` waits for `writer`'s flag `phase`, in its own flag array.
  void wait(int rank, int writer, int phase) {
    Step step;
    step.kind = StepKind::kWait;
    step.peer = static_cast<uint8_t>(writer);
    step.flag_owner = static_cast<uint8_t>(rank);
    step.flag = static_cast<uint8_t>(flag_id(writer, phase));
    emit(rank, step);
  }

  void next_stage() { ++stage_; }

  // One exchange phase inside groups (all ranks, or each island). Every rank r delivers
  // chunk `chunk(r, p)` to each peer p of its group. Push: r copies `push_src(r)` into slot
  // `landing(r)` of p and raises its flag `phase` there (LL: into p's LL slot, which is its own
  // flag). Pull: r must already have published the data in its own slot `published` and raised
  // flag `phase` in p's memory; p waits for it and, when `fetch`, copies it into its own slot
  // `landing(r)`. Staged: one peer per stage. Unstaged: all copies, then all signals, then all
  // waits, so each run of signals or waits can go out in parallel (one fence per run).
  // `on_recv(r, q)` runs on r once q's data is readable at received(r, q).
  struct Phase {
    int phase = 0;
    std::function<int(int, int)> chunk;
    std::function<BufRef(int)> push_src;
    std::function<int(int)> landing;
    int published = 0;
    bool fetch = false;
    std::function<void(int, int)> on_recv = [](int, int) {};
  };

  // Where rank r reads what q delivered in `phase`.
  BufRef received(const Phase& phase, int r, int q) const {
    if (ll()) return ll_of(r, phase.landing(q), q);
    if (push() || phase.fetch) return slot_of(r, phase.landing(q));
    return slot_of(q, phase.published);
  }

  void exchange(const std::vector<Group>& group_of, const Phase& phase) {
    const int n = group_of[0].size();
    auto deliver = [&](int r, int p) {
      const BufRef to = ll() ? ll_of(p, phase.landing(r), r) : slot_of(p, phase.landing(r));
      copy(r, phase.chunk(r, p), to, phase.push_src(r));
    };
    auto use = [&](int r, int q) {
      if (!push() && phase.fetch) {
        copy(r, phase.chunk(q, r), slot_of(r, phase.landing(q)), slot_of(q, phase.published));
      }
      phase.on_recv(r, q);
    };
    if (staged()) {
      for (int s = 1; s < n; ++s) {
        if (s > 1) next_stage();
        for (int r = 0; r < world(); ++r) {
          if (push()) {
            deliver(r, group_of[r].to(r, s));
            signal(r, group_of[r].to(r, s), phase.phase);
          }
          wait(r, group_of[r].from(r, s), phase.phase);
          use(r, group_of[r].from(r, s));
        }
      }
      return;
    }
    for (int r = 0; r < world(); ++r) {
      const Group& g = group_of[r];
      if (push()) {
        for (int s = 1; s < n; ++s) deliver(r, g.to(r, s));
        for (int s = 1; s < n && !ll(); ++s) signal(r, g.to(r, s), phase.phase);
      }
      for (int s = 1; s < n && !ll(); ++s) wait(r, g.from(r, s), phase.phase);
      for (int s = 1; s < n; ++s) use(r, g.from(r, s));
    }
  }

  // Pull: `rank` tells every other member of `group` that its published data is readable.
  void publish(int rank, const Group& group, int phase) {
    for (int s = 1; s < group.size(); ++s) signal(rank, group.to(rank, s), phase);
  }

  int num_chunks() const { return s_.num_chunks; }

  Schedule finish() {
    s_.num_stages = 0;
    for (const auto& program : s_.programs) {
      for (const Step& step : program) s_.num_stages = std::max(s_.num_stages, step.stage + 1);
    }
    return std::move(s_);
  }

 private:
  void emit(int rank, Step step) {
    step.stage = static_cast<uint8_t>(stage_);
    s_.programs[rank].push_back(step);
  }

  Schedule s_;
  int stage_ = 0;
};

std::vector<int> all_ranks(int world) {
  std::vector<int> ranks(world);
  for (int r = 0; r < world; ++r) ranks[r] = r;
  return ranks;
}

struct Islands {
  std::vector<Group> group_of;  // per rank: its island
  std::vector<int> partner;     // per rank: same index in the other island
  std::vector<int> index;       // per rank: index within its island
};

Islands split_islands(const std::vector<int>& island_of) {
  const int world = static_cast<int>(island_of.size());
  Group islands[2];
  for (int r = 0; r < world; ++r)
    islands[island_of[r] == island_of[0] ? 0 : 1].members.push_back(r);
  Islands out;
  out.group_of.resize(world);
  out.partner.resize(world);
  out.index.resize(world);
  for (int side = 0; side < 2; ++side) {
    for (int i = 0; i < islands[side].size(); ++i) {
      const int r = islands[side].members[i];
      out.group_of[r] = islands[side];
      out.partner[r] = islands[1 - side].members[i];
      out.index[r] = i;
    }
  }
  return out;
}

// Island 0 is the one holding rank 0: its partial is summed first on every rank.
std::vector<BufRef> island_order(int r, const std::vector<int>& island_of, BufRef own,
                                 BufRef partners) {
  return island_of[r] == island_of[0] ? std::vector<BufRef>{own, partners}
                                      : std::vector<BufRef>{partners, own};
}

std::vector<Group> partner_pairs(const Islands& isl) {
  std::vector<Group> pairs;
  for (int r = 0; r < static_cast<int>(isl.partner.size()); ++r) {
    pairs.push_back(Group{{std::min(r, isl.partner[r]), std::max(r, isl.partner[r])}});
  }
  return pairs;
}

// Phase 0 of every algorithm: chunk `chunk(sender, owner)` of each rank's input travels to the
// peers of its group that reduce it. Pull ranks first copy those chunks into their staging
// slot (the input itself is not visible to peers) and raise one flag for all of them.
Builder::Phase deliver_inputs(Builder& b, const std::vector<Group>& group_of,
                              std::function<int(int, int)> chunk, int phase = kPhaseDeliver) {
  Builder::Phase in;
  in.phase = phase;
  in.chunk = std::move(chunk);
  in.push_src = input_of;
  in.landing = slot_from_rank;
  in.published = slot_staged_input(b.world());
  in.fetch = b.staged();  // staged pull copies one peer per stage; unstaged reads in the sum
  if (!b.push()) {
    for (int r = 0; r < b.world(); ++r) {
      for (int c = 0; c < b.num_chunks(); ++c) {
        bool needed = false;
        for (int q : group_of[r].members) needed |= q != r && in.chunk(r, q) == c;
        if (needed) b.copy(r, c, slot_of(r, in.published), input_of(r));
      }
      b.publish(r, group_of[r], in.phase);
    }
  }
  b.exchange(group_of, in);
  return in;
}

// Every rank reduces chunk `chunk_of(r)` of its group's inputs, in rank order, into `dst(r)`.
void reduce_inputs(Builder& b, const std::vector<Group>& group_of, const Builder::Phase& in,
                   const std::function<int(int)>& chunk_of, const std::function<BufRef(int)>& dst) {
  for (int r = 0; r < b.world(); ++r) {
    b.reduce_members(r, chunk_of(r), dst(r), group_of[r].members, input_of(r),
                     [&](int q) { return b.received(in, r, q); });
  }
}

// Partners in the two islands swap their island partial (chunk `chunk_of(r)`), which pull
// ranks have just published under flag kPhasePartial.
Builder::Phase swap_partials(Builder& b, const Islands& isl, std::function<int(int)> chunk_of) {
  const int partial = slot_partial(b.world());
  Builder::Phase cross;
  cross.phase = kPhasePartial;
  cross.chunk = [chunk_of = std::move(chunk_of)](int sender, int) { return chunk_of(sender); };
  cross.push_src = [partial](int r) { return slot_of(r, partial); };
  cross.landing = slot_from_rank;
  cross.published = partial;
  b.exchange(partner_pairs(isl), cross);
  return cross;
}

// The last phase of the two-shot algorithms: each rank's reduced chunk (`chunk_of(r)`, in its
// output, and for pull also in its gather slot under flag kPhaseGather) reaches its group.
void gather_results(Builder& b, const std::vector<Group>& group_of,
                    const std::function<int(int)>& chunk_of) {
  const int gather = slot_gather(b.world());
  Builder::Phase ag;
  ag.phase = kPhaseGather;
  ag.chunk = [&](int owner, int) { return chunk_of(owner); };
  ag.push_src = output_of;
  ag.landing = [gather](int) { return gather; };
  ag.published = gather;
  ag.on_recv = [&](int r, int q) { b.copy(r, chunk_of(q), output_of(r), b.received(ag, r, q)); };
  b.exchange(group_of, ag);
}

// A reduced chunk (`sum(dst)` emits its reduce into dst) lands in the output; pull ranks also
// publish it for `group` to read.
void keep_reduced(Builder& b, int r, int chunk, const std::function<void(BufRef)>& sum,
                  const Group& group) {
  if (b.push()) {
    sum(output_of(r));
    return;
  }
  const BufRef gather = slot_of(r, slot_gather(b.world()));
  sum(gather);
  b.publish(r, group, kPhaseGather);
  b.copy(r, chunk, output_of(r), gather);
}

// Pull ranks tell their partner that the island partial is readable.
void publish_partials(Builder& b, const Islands& isl) {
  if (b.push()) return;
  for (int r = 0; r < b.world(); ++r) b.signal(r, isl.partner[r], kPhasePartial);
}

// Every rank receives every input and sums the whole message in the group's canonical order.
Schedule build_oneshot(Builder b) {
  const std::vector<Group> everyone(b.world(), Group{all_ranks(b.world())});
  const auto in = deliver_inputs(b, everyone, [](int, int) { return 0; });
  reduce_inputs(
      b, everyone, in, [](int) { return 0; }, output_of);
  return b.finish();
}

// Reduce-scatter (rank c owns chunk c), then all-gather.
Schedule build_twoshot(Builder b) {
  const std::vector<Group> everyone(b.world(), Group{all_ranks(b.world())});
  const auto in = deliver_inputs(b, everyone, [](int, int owner) { return owner; });
  for (int r = 0; r < b.world(); ++r) {
    const auto sum = [&](BufRef dst) {
      b.reduce_members(r, r, dst, everyone[r].members, input_of(r),
                       [&](int q) { return b.received(in, r, q); });
    };
    keep_reduced(b, r, r, sum, everyone[r]);
  }
  b.next_stage();
  gather_results(b, everyone, [](int owner) { return owner; });
  return b.finish();
}

// Oneshot inside each island, then partners swap island sums: N elements cross per partner pair.
Schedule build_island_oneshot(Builder b, const std::vector<int>& island_of) {
  const Islands isl = split_islands(island_of);
  const int partial = slot_partial(b.world());
  const auto in = deliver_inputs(b, isl.group_of, [](int, int) { return 0; });
  reduce_inputs(
      b, isl.group_of, in, [](int) { return 0; }, [partial](int r) { return slot_of(r, partial); });
  publish_partials(b, isl);
  b.next_stage();
  const auto cross = swap_partials(b, isl, [](int) { return 0; });
  for (int r = 0; r < b.world(); ++r) {
    b.reduce(r, 0, output_of(r),
             island_order(r, island_of, slot_of(r, partial), b.received(cross, r, isl.partner[r])));
  }
  return b.finish();
}

// Island reduce-scatter (island index i owns chunk i), partners swap their reduced chunk
// (1/k of the message each: N elements cross each way in all), island all-gather.
Schedule build_island_twoshot(Builder b, const std::vector<int>& island_of) {
  const Islands isl = split_islands(island_of);
  const int partial = slot_partial(b.world());
  const auto& index = isl.index;
  const auto chunk_of = [&](int r) { return index[r]; };
  const auto in = deliver_inputs(b, isl.group_of, [&](int, int owner) { return index[owner]; });
  reduce_inputs(b, isl.group_of, in, chunk_of, [partial](int r) { return slot_of(r, partial); });
  publish_partials(b, isl);
  b.next_stage();
  const auto cross = swap_partials(b, isl, chunk_of);
  for (int r = 0; r < b.world(); ++r) {
    const auto sum = [&](BufRef dst) {
      b.reduce(
          r, index[r], dst,
          island_order(r, island_of, slot_of(r, partial), b.received(cross, r, isl.partner[r])));
    };
    keep_reduced(b, r, index[r], sum, isl.group_of[r]);
  }
  b.next_stage();
  gather_results(b, isl.group_of, chunk_of);
  return b.finish();
}

// Reduce-scatter: two-shot's first half. Every rank delivers chunk c of its input to rank c,
// and rank c sums chunk c in the group's canonical order into its output (the chunk its tensor
// holds).
Schedule build_reduce_scatter(Builder b) {
  const std::vector<Group> everyone(b.world(), Group{all_ranks(b.world())});
  const auto in = deliver_inputs(b, everyone, [](int, int owner) { return owner; });
  for (int r = 0; r < b.world(); ++r) {
    b.reduce_members(r, r, output_of(r), everyone[r].members, input_of(r),
                     [&](int q) { return b.received(in, r, q); });
  }
  return b.finish();
}

// The last phase of an all-gather inside `group_of`: each rank's chunk `chunk_of(r)`, taken from
// `src(r)` (its input or its output), lands in every member's gather slot at that chunk and is
// copied on into the member's output. Pull ranks publish it first: a copy into their own gather
// slot and one flag per member.
void gather_chunks(Builder& b, const std::vector<Group>& group_of, int phase,
                   const std::function<int(int)>& chunk_of, const std::function<BufRef(int)>& src) {
  const int gather = slot_gather(b.world());
  if (!b.push()) {
    for (int r = 0; r < b.world(); ++r) {
      b.copy(r, chunk_of(r), slot_of(r, gather), src(r));
      b.publish(r, group_of[r], phase);
    }
  }
  Builder::Phase ag;
  ag.phase = phase;
  ag.chunk = [&](int owner, int) { return chunk_of(owner); };
  ag.push_src = src;
  ag.landing = [gather](int) { return gather; };
  ag.published = gather;
  ag.on_recv = [&](int r, int q) { b.copy(r, chunk_of(q), output_of(r), b.received(ag, r, q)); };
  b.exchange(group_of, ag);
}

// All-gather: two-shot's second half. Rank r's input is chunk r: it goes to its own output and
// to every peer.
Schedule build_all_gather(Builder b) {
  const std::vector<Group> everyone(b.world(), Group{all_ranks(b.world())});
  for (int r = 0; r < b.world(); ++r) b.copy(r, r, output_of(r), input_of(r));
  gather_chunks(
      b, everyone, kPhaseGather, [](int r) { return r; }, input_of);
  return b.finish();
}

// Island reduce-scatter (world chunks; rank r owns chunk r, its partner p chunk p): inside each
// island every member delivers its input's chunk p to r, which sums the island's partial of it
// and sends it across to p; then chunk r, whose island partial r sums and adds to the one p sent
// (island 0's first). One chunk in `world` of each rank's input crosses the socket link: half of
// the flat reduce-scatter's cross-island traffic at world 4, a quarter at 8.
Schedule build_island_reduce_scatter(Builder b, const std::vector<int>& island_of) {
  const Islands isl = split_islands(island_of);
  const int partial = slot_partial(b.world());
  const auto& partner = isl.partner;
  const auto sum_island = [&](const Builder::Phase& in, int chunk_of_r(int, const Islands&)) {
    for (int r = 0; r < b.world(); ++r) {
      b.reduce_members(r, chunk_of_r(r, isl), slot_of(r, partial), isl.group_of[r].members,
                       input_of(r), [&](int q) { return b.received(in, r, q); });
    }
  };
  const auto partners_chunk = [](int r, const Islands& i) { return i.partner[r]; };
  const auto own_chunk = [](int r, const Islands&) { return r; };
  const auto across =
      deliver_inputs(b, isl.group_of, [&](int, int owner) { return partner[owner]; });
  sum_island(across, partners_chunk);
  publish_partials(b, isl);
  b.next_stage();
  const auto own = deliver_inputs(
      b, isl.group_of, [](int, int owner) { return owner; }, kPhaseSecond);
  sum_island(own, own_chunk);
  b.next_stage();
  const auto cross = swap_partials(b, isl, [&](int r) { return partner[r]; });
  for (int r = 0; r < b.world(); ++r) {
    b.reduce(r, r, output_of(r),
             island_order(r, island_of, slot_of(r, partial), b.received(cross, r, partner[r])));
  }
  return b.finish();
}

// Island all-gather (world chunks): partners swap their chunks across the socket link, then each
// rank sends its own chunk and its partner's to its island. Every chunk crosses once.
Schedule build_island_all_gather(Builder b, const std::vector<int>& island_of) {
  const Islands isl = split_islands(island_of);
  const int gather = slot_gather(b.world());
  const auto& partner = isl.partner;
  for (int r = 0; r < b.world(); ++r) b.copy(r, r, output_of(r), input_of(r));
  // Across: rank r's input chunk r lands in p's gather slot (pull: p reads r's, published
  // there for p and for r's island alike).
  if (!b.push()) {
    for (int r = 0; r < b.world(); ++r) {
      b.copy(r, r, slot_of(r, gather), input_of(r));
      b.signal(r, partner[r], kPhasePartial);
      b.publish(r, isl.group_of[r], kPhaseDeliver);
    }
  }
  Builder::Phase cross;
  cross.phase = kPhasePartial;
  cross.chunk = [](int sender, int) { return sender; };
  cross.push_src = input_of;
  cross.landing = [gather](int) { return gather; };
  cross.published = gather;
  cross.on_recv = [&](int r, int q) { b.copy(r, q, output_of(r), b.received(cross, r, q)); };
  b.exchange(partner_pairs(isl), cross);
  b.next_stage();
  // Inside the island: each rank's own chunk (already published when pulling) ...
  Builder::Phase own;
  own.phase = kPhaseDeliver;
  own.chunk = [](int sender, int) { return sender; };
  own.push_src = input_of;
  own.landing = [gather](int) { return gather; };
  own.published = gather;
  own.on_recv = [&](int r, int q) { b.copy(r, q, output_of(r), b.received(own, r, q)); };
  b.exchange(isl.group_of, own);
  b.next_stage();
  // ... and its partner's, forwarded from its output.
  gather_chunks(
      b, isl.group_of, kPhaseGather, [&](int r) { return partner[r]; }, output_of);
  return b.finish();
}

}  // namespace

std::optional<std::string> why_unsupported(Algorithm algorithm, int world,
                                           const std::vector<int>& island_of) {
  if (world < 2 || world > kMaxWorld) {
    return "world size " + std::to_string(world) + " is outside 2.." + std::to_string(kMaxWorld);
  }
  if (!island_of.empty() && static_cast<int>(island_of.size()) != world) {
    return "island map has " + std::to_string(island_of.size()) + " entries for world size " +
           std::to_string(world);
  }
  if (!is_island_algorithm(algorithm)) return std::nullopt;
  if (island_of.empty()) return std::string("no islands: the topology is flat");
  std::vector<int> ids(island_of);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  if (ids.size() != 2) {
    return "island algorithms need exactly two islands, found " + std::to_string(ids.size());
  }
  const auto first = std::count(island_of.begin(), island_of.end(), ids[0]);
  if (first * 2 != world) {
    return "islands are uneven (" + std::to_string(first) + " and " +
           std::to_string(world - first) + " ranks); island algorithms need two equal islands";
  }
  if (first < 2) return std::string("islands of one rank have nothing to reduce inside");
  return std::nullopt;
}

}  // namespace pcie_ar::plan

namespace pcie_ar::plan {

std::optional<std::string> why_unsupported(const Tactic& tactic, int world,
                                           const std::vector<int>& island_of,
                                           Collective collective) {
  if (auto why = why_unsupported(tactic.algorithm, world, island_of)) return why;
  if (collective != Collective::kAllReduce && tactic.algorithm != Algorithm::kTwoshot &&
      tactic.algorithm != Algorithm::kIslandTwoshot) {
    return std::string(collective_name(collective)) + " is built from the two-shot algorithms (" +
           "twoshot, island_twoshot) only: " + std::string(algorithm_name(tactic.algorithm)) +
           " has no half that is one";
  }
  if (!flag_in_data(tactic.protocol)) return std::nullopt;
  if (collective == Collective::kAllGather && tactic.protocol == Protocol::kLamport) {
    return std::string(
        "an all_gather moves every bit, and the lamport protocol stores -0 as +0 "
        "(its empty word): the owner's chunk would keep -0 and its peers' copies "
        "would not; use ll");
  }
  const std::string name(protocol_name(tactic.protocol));
  if (tactic.direction != Direction::kPush) {
    return "the " + name +
           " protocol is push-only: a pull reader would poll the writer's memory across the "
           "fabric, vector by vector";
  }
  if (tactic.staged) {
    return "the " + name +
           " protocol is unstaged: every peer's data is read where it lands, as it lands";
  }
  return std::nullopt;
}

std::vector<std::vector<int>> canonical_groups(int world, const std::vector<int>& island_of) {
  if (why_unsupported(Algorithm::kIslandOneshot, world, island_of)) return {all_ranks(world)};
  std::vector<std::vector<int>> groups(2);
  for (int r = 0; r < world; ++r) groups[island_of[r] == island_of[0] ? 0 : 1].push_back(r);
  return groups;
}

std::vector<Tactic> buildable_tactics(int world, const std::vector<int>& island_of,
                                      Collective collective) {
  std::vector<Tactic> tactics;
  for (Algorithm algorithm : kAllAlgorithms) {
    for (Direction direction : {Direction::kPush, Direction::kPull}) {
      for (bool staged : {true, false}) {
        for (Protocol protocol : kProtocolNames.values()) {
          const Tactic tactic{algorithm, direction, staged, protocol};
          if (!why_unsupported(tactic, world, island_of, collective)) tactics.push_back(tactic);
        }
      }
    }
  }
  return tactics;
}

Schedule build_schedule(Algorithm algorithm, Direction direction, bool staged, int world,
                        const std::vector<int>& island_of, Protocol protocol,
                        Collective collective) {
  Tactic tactic;
  tactic.algorithm = algorithm;
  tactic.direction = direction;
  tactic.staged = staged;
  tactic.protocol = protocol;
  if (auto why = why_unsupported(tactic, world, island_of, collective)) {
    throw UnsupportedSchedule(std::string(algorithm_name(algorithm)) + " for world " +
                              std::to_string(world) + ": " + *why);
  }
  std::vector<int> islands = island_of.empty() ? std::vector<int>(world, 0) : island_of;
  if (collective != Collective::kAllReduce) {
    const bool scatter = collective == Collective::kReduceScatter;
    Builder b(algorithm, direction, staged, protocol, world, islands, world, collective);
    if (algorithm == Algorithm::kTwoshot)
      return scatter ? build_reduce_scatter(std::move(b)) : build_all_gather(std::move(b));
    return scatter ? build_island_reduce_scatter(std::move(b), islands)
                   : build_island_all_gather(std::move(b), islands);
  }
  switch (algorithm) {
    case Algorithm::kOneshot:
      return build_oneshot(Builder(algorithm, direction, staged, protocol, world, islands, 1));
    case Algorithm::kTwoshot:
      return build_twoshot(Builder(algorithm, direction, staged, protocol, world, islands, world));
    case Algorithm::kIslandOneshot:
      return build_island_oneshot(
          Builder(algorithm, direction, staged, protocol, world, islands, 1), islands);
    case Algorithm::kIslandTwoshot:
      return build_island_twoshot(
          Builder(algorithm, direction, staged, protocol, world, islands, world / 2), islands);
  }
  throw UnsupportedSchedule("unknown algorithm");
}

Program encode_program(const Schedule& schedule, int rank) {
  if (rank < 0 || rank >= schedule.world) {
    throw std::out_of_range("rank " + std::to_string(rank) + " is outside world " +
                            std::to_string(schedule.world));
  }
  const auto& steps = schedule.programs[rank];
  if (static_cast<int>(steps.size()) > kMaxSteps) {
    throw std::length_error("rank " + std::to_string(rank) + "'s program has " +
                            std::to_string(steps.size()) + " steps; at most " +
                            std::to_string(kMaxSteps) + " fit");
  }
  Program program;
  program.rank = static_cast<uint8_t>(rank);
  program.world = static_cast<uint8_t>(schedule.world);
  program.num_chunks = static_cast<uint8_t>(schedule.num_chunks);
  program.num_stages = static_cast<uint8_t>(schedule.num_stages);
  program.num_steps = static_cast<uint16_t>(steps.size());
  program.direction = schedule.direction;
  program.ll_format =
      schedule.protocol == Protocol::kLamport ? LLFormat::kDense : LLFormat::kTagged;
  std::copy(steps.begin(), steps.end(), program.steps);
  return program;
}

Program skip_program(int rank, int world) {
  if (world < 1 || world > kMaxWorld || rank < 0 || rank >= world) {
    throw std::out_of_range("skip_program(): rank " + std::to_string(rank) + " of world " +
                            std::to_string(world));
  }
  Program program;
  program.rank = static_cast<uint8_t>(rank);
  program.world = static_cast<uint8_t>(world);
  program.num_steps = 0;
  return program;
}

namespace {

std::string describe_buf(const BufRef& buf) {
  switch (buf.space) {
    case Space::kInput:
      return "input";
    case Space::kOutput:
      return "output";
    case Space::kSlot:
      return "r" + std::to_string(buf.owner) + ".slot" + std::to_string(buf.slot);
    case Space::kLL:
      return "r" + std::to_string(buf.owner) + ".ll" + std::to_string(buf.slot) + "(from r" +
             std::to_string(buf.writer) + ")";
  }
  return "?";
}

}  // namespace

namespace {
bool same_buffer(const BufRef& a, const BufRef& b) {
  return a.space == b.space && a.owner == b.owner &&
         (a.space == Space::kInput || a.space == Space::kOutput || a.slot == b.slot);
}

bool reads(const Step& step, const BufRef& buf) {
  if (step.kind != StepKind::kReduce) return false;
  for (int i = 0; i < step.num_srcs; ++i) {
    if (same_buffer(step.srcs[i], buf)) return true;
  }
  return false;
}

bool writes(const Step& step, const BufRef& buf) {
  return step.kind == StepKind::kReduce &&
         (same_buffer(step.dst, buf) || (step.num_dsts == 2 && same_buffer(step.dst2, buf)));
}

// The copy at `c` forwards what the sum at `r` writes (same buffer, same chunk), may move up to
// it across the steps in between (none of them a wait), stays in its stage when staged, and
// neither touches LL.
bool can_fuse(const std::vector<Step>& program, size_t r, size_t c, bool staged) {
  const Step& sum = program[r];
  const Step& copy = program[c];
  // A staged schedule talks to one peer per stage: a copy stays in its own stage.
  if (staged && copy.stage != sum.stage) return false;
  if (copy.kind != StepKind::kReduce || copy.num_srcs != 1 || copy.num_dsts != 1 ||
      copy.chunk != sum.chunk || !same_buffer(copy.srcs[0], sum.dst) ||
      copy.dst.space == Space::kLL || same_buffer(copy.dst, sum.dst) || reads(sum, copy.dst)) {
    return false;
  }
  // Writing copy.dst earlier is safe across signals (data stored sooner is still stored
  // before them) but not across a wait (it may be what frees copy.dst: the caller never
  // looks past one), nor across a step that touches copy.dst or rewrites what the copy
  // forwards.
  for (size_t i = r + 1; i < c; ++i) {
    const Step& between = program[i];
    if (reads(between, copy.dst) || writes(between, copy.dst) || writes(between, sum.dst)) {
      return false;
    }
  }
  return true;
}
}  // namespace

Schedule with_epilogue(Schedule schedule) {
  if (schedule.epilogue) throw std::invalid_argument("the schedule already ends with an epilogue");
  if (schedule.collective != Collective::kAllReduce) {
    throw std::invalid_argument("the epilogue ends an all-reduce, not a " +
                                std::string(collective_name(schedule.collective)));
  }
  for (int r = 0; r < schedule.world; ++r) {
    // Whom a timeout of its barrier names: the rank itself (its CTAs meet on its own counters).
    Step step;
    step.kind = StepKind::kEpilogue;
    step.stage = static_cast<uint8_t>(std::max(schedule.num_stages - 1, 0));
    step.peer = static_cast<uint8_t>(r);
    step.flag_owner = static_cast<uint8_t>(r);
    schedule.programs[r].push_back(step);
  }
  schedule.epilogue = true;
  return schedule;
}

Schedule fuse_forwarding_copies(Schedule schedule) {
  for (auto& program : schedule.programs) {
    for (size_t r = 0; r < program.size(); ++r) {
      const Step& sum = program[r];
      if (sum.kind != StepKind::kReduce || sum.num_srcs < 2 || sum.num_dsts != 1 ||
          sum.dst.space == Space::kLL) {
        continue;
      }
      for (size_t c = r + 1; c < program.size() && program[c].kind != StepKind::kWait; ++c) {
        if (!can_fuse(program, r, c, schedule.staged)) continue;
        program[r].num_dsts = 2;
        program[r].dst2 = program[c].dst;
        program.erase(program.begin() + static_cast<std::ptrdiff_t>(c));
        break;
      }
    }
  }
  return schedule;
}

std::string describe_step(const Step& step) {
  std::string text = "s" + std::to_string(step.stage) + " ";
  switch (step.kind) {
    case StepKind::kReduce: {
      text += describe_buf(step.dst) + "[" + std::to_string(step.chunk) + "] = ";
      if (step.num_dsts == 2)
        text += describe_buf(step.dst2) + "[" + std::to_string(step.chunk) + "] = ";
      for (int i = 0; i < step.num_srcs; ++i) {
        if (i) text += step.split != 0 && i == step.split ? " | " : " + ";
        text += describe_buf(step.srcs[i]);
      }
      return text;
    }
    case StepKind::kSignal:
      return text + "signal r" + std::to_string(step.flag_owner) + ".flag" +
             std::to_string(step.flag);
    case StepKind::kWait:
      return text + "wait r" + std::to_string(step.flag_owner) + ".flag" +
             std::to_string(step.flag) + " from r" + std::to_string(step.peer);
    case StepKind::kEpilogue:
      return text + "output = rms_norm(output + residual) * weight";
  }
  return text;
}

}  // namespace pcie_ar::plan
