// Shared by the host_shm tests (test_host_shm.cc, test_host_chaos.cc): one process per rank,
// forked from the test; each child builds its own HostShmWorkspace, the children exchange
// segment names through an anonymous shared page created before fork, and report back through
// the same page. The parent reaps them under a deadline (a hung child fails the test) and checks
// /dev/shm afterwards. Also the test-side number model (an independent reference for every
// schedule's result, in operand order) and the call workloads.
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <ostream>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/schedule.h"
#include "plan/tactic.h"
#include "transport/host_shm.h"
#include "transport/workspace.h"

namespace pcie_ar::transport::host_test {

using plan::Algorithm;
using plan::Direction;
using plan::DType;

inline constexpr int kMaxWorld = plan::kMaxWorld;

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <size_t N>
inline void set_text(char (&dst)[N], const std::string& text) {
  const size_t n = std::min(text.size(), N - 1);
  std::memcpy(dst, text.data(), n);
  dst[n] = '\0';
}

// One all-reduce through the transport interface, as the communicator issues it.
inline void run_call(Workspace& ws, int program, DType dtype, int blocks, const void* input,
                     void* output, int64_t numel, uint32_t signature) {
  Call call;
  call.program = program;
  call.dtype = dtype;
  call.blocks = blocks;
  call.input = input;
  call.output = output;
  call.numel = numel;
  call.signature = signature;
  ws.run(call);
}

// ------------------------------------------------------------------ numbers (test-side)
// An independent model of the three formats: values are doubles rounded with nearbyint at the
// format's last mantissa bit, so it shares no code (and no bit tricks) with the executor.

struct Format {
  int precision;  // significant bits, implicit bit included
  int min_exp;    // exponent of the smallest normal
  int max_exp;    // exponent of the largest binade
};

inline Format format_of(DType dtype) {
  switch (dtype) {
    case DType::kBF16:
      return {8, -126, 127};
    case DType::kFP16:
      return {11, -14, 15};
    case DType::kFP32:
      return {24, -126, 127};
  }
  return {};
}

// Rounds v to the nearest value of the format, ties to even (nearbyint in the default mode).
inline double round_to(DType dtype, double v) {
  if (v == 0.0 || !std::isfinite(v)) return v;
  const Format f = format_of(dtype);
  int exponent = 0;
  std::frexp(v, &exponent);  // |v| in [2^(exponent-1), 2^exponent)
  const int lsb = std::max(exponent - 1, f.min_exp) - (f.precision - 1);
  const double r = std::ldexp(std::nearbyint(std::ldexp(v, -lsb)), lsb);
  const double max_finite = std::ldexp(2.0 - std::ldexp(1.0, 1 - f.precision), f.max_exp);
  if (std::fabs(r) > max_finite) return std::copysign(INFINITY, v);
  return r;
}

inline double unit_roundoff(DType dtype) { return std::ldexp(1.0, -format_of(dtype).precision); }
inline double min_subnormal(DType dtype) {
  const Format f = format_of(dtype);
  return std::ldexp(1.0, f.min_exp - (f.precision - 1));
}

// Encodes a value the format represents exactly.
inline void encode(DType dtype, float value, uint8_t* out) {
  switch (dtype) {
    case DType::kFP32:
      std::memcpy(out, &value, 4);
      return;
    case DType::kBF16: {
      const auto bits = static_cast<uint16_t>(std::bit_cast<uint32_t>(value) >> 16);
      std::memcpy(out, &bits, 2);
      return;
    }
    case DType::kFP16: {
      uint16_t bits = std::signbit(value) ? 0x8000 : 0;
      const double a = std::fabs(static_cast<double>(value));
      if (std::isnan(a)) {
        bits |= 0x7e00;
      } else if (std::isinf(a)) {
        bits |= 0x7c00;
      } else if (a != 0.0) {
        int exponent = 0;
        std::frexp(a, &exponent);
        if (exponent - 1 >= -14) {
          const auto mantissa = static_cast<uint16_t>(std::ldexp(a, 11 - exponent) - 1024.0);
          bits |= static_cast<uint16_t>((exponent - 1 + 15) << 10) | mantissa;
        } else {
          bits |= static_cast<uint16_t>(std::ldexp(a, 24));
        }
      }
      std::memcpy(out, &bits, 2);
      return;
    }
  }
}

inline double decode(DType dtype, const uint8_t* in) {
  switch (dtype) {
    case DType::kFP32: {
      float f;
      std::memcpy(&f, in, 4);
      return f;
    }
    case DType::kBF16: {
      uint16_t bits;
      std::memcpy(&bits, in, 2);
      return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
    }
    case DType::kFP16: {
      uint16_t bits;
      std::memcpy(&bits, in, 2);
      const double sign = (bits & 0x8000) ? -1.0 : 1.0;
      const int exponent = (bits >> 10) & 0x1f;
      const int mantissa = bits & 0x3ff;
      if (exponent == 0x1f) return mantissa ? NAN : sign * INFINITY;
      if (exponent == 0) return sign * std::ldexp(mantissa, -24);
      return sign * std::ldexp(1024 + mantissa, exponent - 25);
    }
  }
  return NAN;
}

inline uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Random, never zero, different per rank; mostly in [2^-5, 2^3), one in 16 near or below the
// smallest normal so subnormal rounding is exercised too.
inline float input_value(uint64_t seed, int rank, int64_t index, DType dtype) {
  const uint64_t h = mix(seed ^ mix(static_cast<uint64_t>(rank) + 1) ^
                         mix(static_cast<uint64_t>(index) * 0x9e3779b97f4a7c15ull + 7));
  const double mantissa = 1.0 + static_cast<double>(h & 0xfffff) / 1048576.0;
  int exponent = static_cast<int>((h >> 20) % 8) - 5;
  if (((h >> 24) & 15) == 0) {
    exponent = format_of(dtype).min_exp + 2 - static_cast<int>((h >> 28) % 12);
  }
  const double v = (((h >> 40) & 1) ? -1.0 : 1.0) * std::ldexp(mantissa, exponent);
  const auto r = static_cast<float>(round_to(dtype, v));
  return r == 0.0f ? 0.5f : r;
}

inline uint64_t fnv1a(const uint8_t* data, size_t bytes) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < bytes; ++i) {
    h ^= data[i];
    h *= 1099511628211ull;
  }
  return h;
}

// ------------------------------------------------------------------ the expected expression
// What the design promises, written without the step lists: one reduction order per group,
// whatever the tactic. Where the group has two equal islands of two or more ranks, each island's
// sum (rank order, fp32 from +0) is rounded, then the two partials (the island holding rank 0
// first) are added from +0 and rounded again; elsewhere every rank in rank order from +0, rounded
// once. Starting from +0 makes every sum of zeros +0.

struct Expected {
  float value;     // bitwise expectation
  double exact;    // double-precision sum
  double abs_sum;  // sum of magnitudes, for the tolerance
};

// True when the group's tree has two groups: two islands of equal size >= 2.
inline bool two_equal_islands(int world, const std::vector<int>& island_of) {
  if (static_cast<int>(island_of.size()) != world) return false;
  const std::set<int> ids(island_of.begin(), island_of.end());
  const auto first = std::count(island_of.begin(), island_of.end(), island_of[0]);
  return ids.size() == 2 && first * 2 == world && first >= 2;
}

// The group's sum of `x` (one value per rank), rounded as the tree rounds it.
inline float expected_sum(const std::vector<float>& x, const std::vector<int>& island_of,
                          DType dtype) {
  const int world = static_cast<int>(x.size());
  if (!two_equal_islands(world, island_of)) {
    float flat = 0.0f;
    for (float v : x) flat += v;
    return static_cast<float>(round_to(dtype, flat));
  }
  float side_sum[2] = {0.0f, 0.0f};
  for (int q = 0; q < world; ++q) side_sum[island_of[q] == island_of[0] ? 0 : 1] += x[q];
  const auto p0 = static_cast<float>(round_to(dtype, side_sum[0]));
  const auto p1 = static_cast<float>(round_to(dtype, side_sum[1]));
  return static_cast<float>(round_to(dtype, 0.0f + p0 + p1));
}

inline Expected expected_element(uint64_t seed, int world, const std::vector<int>& island_of,
                                 int64_t index, DType dtype) {
  Expected e{0.0f, 0.0, 0.0};
  std::vector<float> x(world);
  for (int q = 0; q < world; ++q) {
    x[q] = input_value(seed, q, index, dtype);
    e.exact += x[q];
    e.abs_sum += std::fabs(x[q]);
  }
  e.value = expected_sum(x, island_of, dtype);
  return e;
}

// ------------------------------------------------------------------ process groups

enum Outcome : int { kNotStarted = 0, kRunning = 1, kReturned = 2, kThrew = 3 };
enum ErrorType : int { kNoError = 0, kTransportError = 1, kInvalidArgument = 2, kOtherError = 3 };

// What a child tells the parent. Plain words only: it lives in shared anonymous memory.
struct RankReport {
  int outcome;
  int error_type;
  plan::Diagnostic diagnostic;
  double failure_elapsed_s;  // how long the failing call ran
  int calls_done;
  int check_failures;
  int scenario_ok;  // scenario-specific: set by bodies that check something extra
  char message[1024];
  char check_message[1024];
};

struct Arena {
  int barrier_count;  // atomic_ref; a deadline barrier, so one dead child cannot hang the rest
  char names[kMaxWorld][128];
  RankReport reports[kMaxWorld];
};

struct GroupSpec {
  int world = 2;
  plan::Layout layout;
  uint32_t initial_gen = 0;
  double timeout_s = 20.0;   // the executor's wait deadline
  double deadline_s = 90.0;  // the parent's: past this every child is killed
  size_t num_calls = 0;      // hash slots per rank
};

struct ChildEnv {
  int rank;
  Arena* arena;
  RankReport* report;
  uint64_t* hashes;  // hashes[call * kMaxWorld + rank]
};

using ChildBody = std::function<void(HostShmWorkspace&, ChildEnv&)>;

struct GroupResult {
  bool hung = false;
  std::vector<pid_t> pids;
  std::vector<int> status;
  std::vector<RankReport> reports;
  std::vector<std::string> names;
  std::vector<std::string> leaked;
  std::vector<uint64_t> hashes;
};

class SharedPages {
 public:
  explicit SharedPages(size_t bytes) : bytes_(std::max<size_t>(bytes, 1)) {
    ptr_ = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (ptr_ == MAP_FAILED) throw std::runtime_error("mmap of the test arena failed");
  }
  ~SharedPages() { munmap(ptr_, bytes_); }
  SharedPages(const SharedPages&) = delete;
  SharedPages& operator=(const SharedPages&) = delete;
  void* get() const { return ptr_; }

 private:
  size_t bytes_;
  void* ptr_;
};

inline void arrive_and_wait(Arena* arena, int target, double timeout_s) {
  std::atomic_ref<int> count(arena->barrier_count);
  count.fetch_add(1, std::memory_order_acq_rel);
  const double deadline = now_s() + timeout_s;
  while (count.load(std::memory_order_acquire) < target) {
    if (now_s() > deadline) throw std::runtime_error("test bootstrap barrier timed out");
    usleep(200);
  }
}

inline void mark(RankReport* report, Outcome outcome) {
  std::atomic_ref<int>(report->outcome).store(outcome, std::memory_order_release);
}

inline Outcome outcome_of(Arena* arena, int rank) {
  return static_cast<Outcome>(
      std::atomic_ref<int>(arena->reports[rank].outcome).load(std::memory_order_acquire));
}

inline void record_exception(RankReport* report, const std::exception& e) {
  if (const auto* failure = dynamic_cast<const TransportFailure*>(&e)) {
    report->error_type = kTransportError;
    report->diagnostic = failure->diagnostic();
  } else if (dynamic_cast<const std::invalid_argument*>(&e) != nullptr) {
    report->error_type = kInvalidArgument;
  } else {
    report->error_type = kOtherError;
  }
  set_text(report->message, e.what());
}

[[noreturn]] inline void child_main(const GroupSpec& spec, int rank, Arena* arena, uint64_t* hashes,
                                    const ChildBody& body) {
  RankReport* report = &arena->reports[rank];
  mark(report, kRunning);
  try {
    HostShmWorkspace ws(spec.layout, rank, spec.initial_gen, spec.timeout_s);
    set_text(arena->names[rank], ws.segment_name());
    arrive_and_wait(arena, spec.world, 30.0);
    std::vector<std::string> names;
    for (int r = 0; r < spec.world; ++r) names.emplace_back(arena->names[r]);
    ws.open_peers(names);
    arrive_and_wait(arena, 2 * spec.world, 30.0);  // everyone has mapped everyone
    ws.retire_token();
    ChildEnv env{rank, arena, report, hashes};
    body(ws, env);
    mark(report, kReturned);
  } catch (const std::exception& e) {
    record_exception(report, e);
    mark(report, kThrew);
  } catch (...) {
    set_text(report->message, "unknown exception");
    mark(report, kThrew);
  }
  _exit(0);  // never return into the test runner
}

// Names of /dev/shm entries a process created: "/dev/shm/pcie_ar.<pid>.*".
inline std::vector<std::string> segments_of(pid_t pid) {
  std::vector<std::string> found;
  const std::string prefix = "pcie_ar." + std::to_string(pid) + ".";
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) == 0) found.push_back("/" + name);
  }
  return found;
}

inline bool segment_exists(const std::string& name) {
  return !name.empty() && access(("/dev/shm" + name).c_str(), F_OK) == 0;
}

// One group of processes in flight: its shared pages, its children and how far reaping got.
struct LaunchedGroup {
  std::unique_ptr<SharedPages> arena_pages;
  std::unique_ptr<SharedPages> hash_pages;
  double deadline = 0.0;
  std::vector<bool> reaped;
  int remaining = 0;
  GroupResult result;
};

inline std::unique_ptr<LaunchedGroup> launch_group(const GroupSpec& spec, const ChildBody& body) {
  auto group = std::make_unique<LaunchedGroup>();
  group->arena_pages = std::make_unique<SharedPages>(sizeof(Arena));
  group->hash_pages = std::make_unique<SharedPages>(spec.num_calls * kMaxWorld * sizeof(uint64_t));
  auto* arena = static_cast<Arena*>(group->arena_pages->get());
  auto* hashes = static_cast<uint64_t*>(group->hash_pages->get());
  GroupResult& result = group->result;
  std::fflush(nullptr);  // children _exit without flushing, but must not inherit pending output
  for (int rank = 0; rank < spec.world; ++rank) {
    const pid_t pid = fork();
    if (pid == 0) child_main(spec, rank, arena, hashes, body);
    if (pid < 0) {
      ADD_FAILURE() << "fork failed: " << std::strerror(errno);
      for (pid_t started : result.pids) kill(started, SIGKILL);
      break;
    }
    result.pids.push_back(pid);
  }
  const int launched = static_cast<int>(result.pids.size());
  result.status.assign(launched, -1);
  group->reaped.assign(launched, false);
  group->remaining = launched;
  group->deadline = now_s() + spec.deadline_s;
  return group;
}

// Reaps whatever of `group` has exited; past the deadline kills the rest (the group hung).
// Returns true when every child is reaped.
inline bool poll_group(LaunchedGroup& group) {
  GroupResult& result = group.result;
  const int launched = static_cast<int>(result.pids.size());
  for (int r = 0; r < launched; ++r) {
    if (group.reaped[r]) continue;
    int status = 0;
    if (waitpid(result.pids[r], &status, WNOHANG) == result.pids[r]) {
      group.reaped[r] = true;
      result.status[r] = status;
      --group.remaining;
    }
  }
  if (group.remaining > 0 && now_s() >= group.deadline) {
    for (int r = 0; r < launched; ++r) {
      if (group.reaped[r]) continue;
      result.hung = true;
      kill(result.pids[r], SIGKILL);
      waitpid(result.pids[r], &result.status[r], 0);
      group.reaped[r] = true;
    }
    group.remaining = 0;
  }
  return group.remaining == 0;
}

// Collects the reports of a fully reaped group and checks /dev/shm for what it left behind.
inline GroupResult finish_group(LaunchedGroup& group, const GroupSpec& spec) {
  GroupResult result = std::move(group.result);
  const auto* arena = static_cast<const Arena*>(group.arena_pages->get());
  const auto* hashes = static_cast<const uint64_t*>(group.hash_pages->get());
  for (int r = 0; r < spec.world; ++r) {
    result.reports.push_back(arena->reports[r]);
    result.names.emplace_back(arena->names[r]);
  }
  result.hashes.assign(hashes, hashes + spec.num_calls * kMaxWorld);

  // Whatever the product left behind is a failure; remove it so one failure does not leak
  // into the next test or the machine.
  std::vector<std::string> candidates = result.names;
  for (pid_t pid : result.pids) {
    for (const std::string& name : segments_of(pid)) candidates.push_back(name);
  }
  for (const std::string& name : candidates) {
    if (!segment_exists(name)) continue;
    if (std::find(result.leaked.begin(), result.leaked.end(), name) == result.leaked.end()) {
      result.leaked.push_back(name);
    }
    shm_unlink(name.c_str());
  }
  return result;
}

// Runs groups[i] = (specs[i], bodies[i]), at most `max_parallel` groups at a time (a new one
// starts as soon as one ends); results in the order of `specs`.
inline std::vector<GroupResult> run_groups(const std::vector<GroupSpec>& specs,
                                           const std::vector<ChildBody>& bodies, int max_parallel) {
  std::vector<GroupResult> results(specs.size());
  std::vector<std::pair<size_t, std::unique_ptr<LaunchedGroup>>> active;
  size_t next = 0;
  while (next < specs.size() || !active.empty()) {
    while (next < specs.size() && static_cast<int>(active.size()) < std::max(max_parallel, 1)) {
      active.emplace_back(next, launch_group(specs[next], bodies[next]));
      ++next;
    }
    bool progressed = false;
    for (size_t a = 0; a < active.size();) {
      if (poll_group(*active[a].second)) {
        results[active[a].first] = finish_group(*active[a].second, specs[active[a].first]);
        active.erase(active.begin() + static_cast<std::ptrdiff_t>(a));
        progressed = true;
      } else {
        ++a;
      }
    }
    if (!progressed) usleep(1000);
  }
  return results;
}

inline GroupResult run_group(const GroupSpec& spec, const ChildBody& body) {
  return std::move(run_groups({spec}, {body}, 1).front());
}

inline std::string describe_child(const GroupResult& g, int r) {
  const RankReport& rep = g.reports[r];
  std::string text = "rank " + std::to_string(r) + ": outcome " + std::to_string(rep.outcome) +
                     ", calls done " + std::to_string(rep.calls_done);
  if (rep.message[0] != '\0') text += ", error: " + std::string(rep.message);
  if (rep.check_failures > 0) {
    text += ", " + std::to_string(rep.check_failures) +
            " wrong calls, first: " + std::string(rep.check_message);
  }
  const int status = g.status[r];
  if (WIFSIGNALED(status)) text += ", killed by signal " + std::to_string(WTERMSIG(status));
  return text;
}

// The common end of every test: nobody hung, nothing left in /dev/shm.
inline void expect_clean(const GroupResult& g) {
  EXPECT_FALSE(g.hung) << "a child did not finish before the deadline and was killed";
  EXPECT_TRUE(g.leaked.empty()) << "left in /dev/shm: " << (g.leaked.empty() ? "" : g.leaked[0]);
  for (const std::string& name : g.names) {
    EXPECT_FALSE(segment_exists(name)) << name;
  }
}

inline void expect_all_returned(const GroupResult& g) {
  expect_clean(g);
  for (int r = 0; r < static_cast<int>(g.reports.size()); ++r) {
    const RankReport& rep = g.reports[r];
    EXPECT_EQ(rep.outcome, kReturned) << describe_child(g, r);
    EXPECT_EQ(rep.check_failures, 0) << describe_child(g, r);
    EXPECT_TRUE(WIFEXITED(g.status[r]) && WEXITSTATUS(g.status[r]) == 0) << describe_child(g, r);
  }
}

// ------------------------------------------------------------------ call workloads

struct TacticCase {
  plan::Tactic tactic;  // blocks come from each call
  plan::Schedule schedule;
  bool fused = false;  // schedule went through plan::fuse_forwarding_copies (what hosts run)
};

struct CallCase {
  int tactic = 0;
  DType dtype = DType::kFP32;
  int64_t numel = 0;
  int blocks = 1;
  bool in_place = false;
  uint64_t seed = 0;
};

struct Workload {
  int world = 2;
  std::vector<int> island_of;
  std::vector<TacticCase> tactics;
  std::vector<CallCase> calls;
};

// The tactic a call runs: its tactic case's, with the call's block count.
inline plan::Tactic call_tactic(const Workload& w, const CallCase& call) {
  plan::Tactic t = w.tactics[call.tactic].tactic;
  t.blocks = call.blocks;
  return t;
}

inline std::string describe_call(const Workload& w, int index) {
  const CallCase& c = w.calls[index];
  const plan::Tactic t = call_tactic(w, c);
  return "call " + std::to_string(index) + " (" + plan::tactic_label(t) +
         (w.tactics[c.tactic].fused ? "+fused " : " ") + std::string(plan::dtype_name(c.dtype)) +
         " numel " + std::to_string(c.numel) + (c.in_place ? " in-place" : "") + ")";
}

// Every tactic the builders accept for this world and island map, as built (what GPUs run) and,
// where fusing changes it, as fused (what the host communicator runs).
inline std::vector<TacticCase> all_tactics(int world, const std::vector<int>& island_of) {
  std::vector<TacticCase> tactics;
  for (const plan::Tactic& tactic : plan::buildable_tactics(world, island_of)) {
    plan::Schedule built = plan::build_schedule(tactic.algorithm, tactic.direction, tactic.staged,
                                                world, island_of, tactic.protocol);
    plan::Schedule fused = plan::fuse_forwarding_copies(built);
    size_t built_steps = 0, fused_steps = 0;  // fusing removes the copies it folds in
    for (const auto& program : built.programs) built_steps += program.size();
    for (const auto& program : fused.programs) fused_steps += program.size();
    const bool changed = fused_steps != built_steps;
    tactics.push_back(TacticCase{tactic, std::move(built), false});
    if (changed) tactics.push_back(TacticCase{tactic, std::move(fused), true});
  }
  return tactics;
}

inline void check_output(const Workload& w, const CallCase& call, int rank, int call_index,
                         const uint8_t* out, RankReport* report) {
  const bool islands = two_equal_islands(w.world, w.island_of);
  const int elem = plan::dtype_bytes(call.dtype);
  const double tolerance_factor =
      (islands ? 3.0 : 1.0) * unit_roundoff(call.dtype) + w.world * std::ldexp(1.0, -24);
  uint8_t want[4];
  for (int64_t i = 0; i < call.numel; ++i) {
    const Expected e = expected_element(call.seed, w.world, w.island_of, i, call.dtype);
    encode(call.dtype, e.value, want);
    const uint8_t* got = out + i * elem;
    const double got_value = decode(call.dtype, got);
    const double tolerance = tolerance_factor * e.abs_sum + 2 * min_subnormal(call.dtype);
    const bool bitwise = std::memcmp(got, want, elem) == 0;
    const bool close = std::fabs(got_value - e.exact) <= tolerance;
    if (bitwise && close) continue;
    if (report->check_failures++ == 0) {
      char text[512];
      std::snprintf(text, sizeof(text),
                    "%s: rank %d element %lld is %.9g, expected %.9g bitwise (double-precision "
                    "sum %.9g, tolerance %.3g)",
                    describe_call(w, call_index).c_str(), rank, static_cast<long long>(i),
                    got_value, static_cast<double>(e.value), e.exact, tolerance);
      set_text(report->check_message, text);
    }
    return;
  }
}

inline constexpr size_t kGuardBytes = 64;
inline constexpr uint8_t kGuardByte = 0xA5;

// Registers every tactic case's program for `rank`; the ids in the order of w.tactics.
inline std::vector<int> add_programs(Workspace& ws, const Workload& w, int rank) {
  std::vector<int> programs;
  for (const TacticCase& t : w.tactics) {
    programs.push_back(ws.add_program(plan::encode_program(t.schedule, rank)));
  }
  return programs;
}

// Prepares one call's buffers (each at least the message plus kGuardBytes): input element e is
// value(e) (a float the dtype holds exactly), guards after the message in both buffers, NaN in
// the output. Returns where the result goes: the input when the call is in place.
template <typename ValueOf>
inline uint8_t* prepare_call(const CallCase& call, ValueOf&& value, std::vector<uint8_t>& input,
                             std::vector<uint8_t>& output) {
  const int elem = plan::dtype_bytes(call.dtype);
  const size_t bytes = static_cast<size_t>(call.numel) * elem;
  for (int64_t e = 0; e < call.numel; ++e) encode(call.dtype, value(e), &input[e * elem]);
  std::memset(input.data() + bytes, kGuardByte, kGuardBytes);
  std::memset(output.data(), 0xFF, bytes);  // NaN in every dtype: unwritten elements show
  std::memset(output.data() + bytes, kGuardByte, kGuardBytes);
  return call.in_place ? input.data() : output.data();
}

// Issues call `call` of `w` on prepared buffers; programs from add_programs.
inline void run_case(Workspace& ws, const Workload& w, const std::vector<int>& programs,
                     const CallCase& call, const void* input, void* out) {
  run_call(ws, programs[call.tactic], call.dtype, call.blocks, input, out, call.numel,
           plan::call_signature(call.dtype, call_tactic(w, call)));
}

// Whether the guards prepare_call wrote after the message are still there.
inline bool guards_intact(const CallCase& call, const std::vector<uint8_t>& input,
                          const std::vector<uint8_t>& output) {
  const size_t bytes = static_cast<size_t>(call.numel) * plan::dtype_bytes(call.dtype);
  const auto intact = [&](const std::vector<uint8_t>& buffer) {
    return std::all_of(buffer.begin() + bytes, buffer.begin() + bytes + kGuardBytes,
                       [](uint8_t b) { return b == kGuardByte; });
  };
  return intact(input) && intact(output);
}

// The child's side of a workload: every call in order, each output checked elementwise.
// before_call(i), if given, runs just before call i (after its buffers are prepared).
inline void run_workload(const Workload& w, HostShmWorkspace& ws, ChildEnv& env,
                         const std::function<void(int call_index)>& before_call = {}) {
  const std::vector<int> programs = add_programs(ws, w, env.rank);
  const size_t max_bytes = static_cast<size_t>(ws.layout().max_numel) * 4;
  std::vector<uint8_t> input(max_bytes + kGuardBytes);
  std::vector<uint8_t> output(max_bytes + kGuardBytes);
  for (int i = 0; i < static_cast<int>(w.calls.size()); ++i) {
    const CallCase& call = w.calls[i];
    const size_t bytes = static_cast<size_t>(call.numel) * plan::dtype_bytes(call.dtype);
    uint8_t* out = prepare_call(
        call, [&](int64_t e) { return input_value(call.seed, env.rank, e, call.dtype); }, input,
        output);
    if (before_call) before_call(i);
    run_case(ws, w, programs, call, input.data(), out);
    if (!guards_intact(call, input, output) && env.report->check_failures++ == 0) {
      set_text(env.report->check_message, describe_call(w, i) + ": wrote past the message");
    }
    env.hashes[i * kMaxWorld + env.rank] = fnv1a(out, bytes);
    check_output(w, call, env.rank, i, out, env.report);
    env.report->calls_done = i + 1;
  }
}

// Runs the workload on one process per rank; checks results, cross-rank bitwise identity,
// hangs and leaks.
inline void run_and_check(const Workload& w, int64_t max_numel, uint32_t initial_gen = 0) {
  GroupSpec spec;
  spec.world = w.world;
  spec.layout = plan::make_layout(max_numel, w.world, 4);
  spec.initial_gen = initial_gen;
  spec.num_calls = w.calls.size();
  const double start = now_s();
  const GroupResult g =
      run_group(spec, [&](HostShmWorkspace& ws, ChildEnv& env) { run_workload(w, ws, env); });
  expect_all_returned(g);
  int differing = 0;
  for (size_t i = 0; i < w.calls.size(); ++i) {
    for (int r = 1; r < w.world; ++r) {
      if (g.hashes[i * kMaxWorld + r] != g.hashes[i * kMaxWorld]) {
        if (differing++ == 0) {
          ADD_FAILURE() << describe_call(w, static_cast<int>(i)) << ": rank " << r
                        << "'s output differs bitwise from rank 0's";
        }
      }
    }
  }
  EXPECT_EQ(differing, 0) << "calls whose outputs differ across ranks";
  std::printf("    world %d, %zu tactics, %zu calls: %.2f s\n", w.world, w.tactics.size(),
              w.calls.size(), now_s() - start);
}

// Sizes that hit the edges: one vector, fewer vectors than chunks x blocks, odd counts, the max.
inline std::vector<int64_t> sizes_for(DType dtype, int64_t max_numel) {
  const int64_t lanes = plan::kVectorBytes / plan::dtype_bytes(dtype);
  std::vector<int64_t> sizes;
  for (int64_t vecs : {1, 3, 37, 515}) {
    if (vecs * lanes < max_numel) sizes.push_back(vecs * lanes);
  }
  sizes.push_back(max_numel);
  return sizes;
}

// ------------------------------------------------------------------ group parameters

struct GroupParam {
  std::string name;
  int world;
  std::vector<int> island_of;
};

inline void PrintTo(const GroupParam& param, std::ostream* os) { *os << param.name; }

inline std::vector<int> halves(int world) {
  std::vector<int> map(world);
  for (int r = 0; r < world; ++r) map[r] = r < world / 2 ? 0 : 1;
  return map;
}

inline std::vector<int> interleaved(int world, int first = 0) {
  std::vector<int> map(world);
  for (int r = 0; r < world; ++r) map[r] = (r + first) % 2;
  return map;
}

inline plan::Tactic make_tactic(Algorithm algorithm, Direction direction, bool staged,
                                int blocks = 1, plan::Protocol protocol = plan::Protocol::kFlag) {
  plan::Tactic t;
  t.algorithm = algorithm;
  t.direction = direction;
  t.staged = staged;
  t.protocol = protocol;
  t.blocks = blocks;
  return t;
}

inline plan::Tactic ll_tactic(Algorithm algorithm, int blocks = 1) {
  return make_tactic(algorithm, Direction::kPush, false, blocks, plan::Protocol::kLL);
}

}  // namespace pcie_ar::transport::host_test
