// host_shm with real processes and real shared memory: every test forks one child per rank,
// each child builds its own HostShmWorkspace, the children exchange segment names through an
// anonymous shared page created before fork, and report back through the same page. The parent
// reaps them under a deadline (a hung child fails the test) and checks /dev/shm afterwards.
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
#include <regex>
#include <stdexcept>
#include <string>
#include <vector>

#include "plan/layout.h"
#include "plan/protocol.h"
#include "plan/schedule.h"
#include "plan/tactic.h"
#include "transport/host_shm.h"
#include "transport/workspace.h"

namespace pcie_ar::transport {
namespace {

using plan::Algorithm;
using plan::Direction;
using plan::DType;

constexpr int kMaxWorld = plan::kMaxWorld;

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <size_t N>
void set_text(char (&dst)[N], const std::string& text) {
  const size_t n = std::min(text.size(), N - 1);
  std::memcpy(dst, text.data(), n);
  dst[n] = '\0';
}

// One all-reduce through the transport interface, as the communicator issues it.
void run_call(Workspace& ws, int program, DType dtype, int blocks, const void* input, void* output,
              int64_t numel, uint32_t signature) {
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

Format format_of(DType dtype) {
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
double round_to(DType dtype, double v) {
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

double unit_roundoff(DType dtype) { return std::ldexp(1.0, -format_of(dtype).precision); }
double min_subnormal(DType dtype) {
  const Format f = format_of(dtype);
  return std::ldexp(1.0, f.min_exp - (f.precision - 1));
}

// Encodes a value the format represents exactly.
void encode(DType dtype, float value, uint8_t* out) {
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

double decode(DType dtype, const uint8_t* in) {
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

uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Random, never zero, different per rank; mostly in [2^-5, 2^3), one in 16 near or below the
// smallest normal so subnormal rounding is exercised too.
float input_value(uint64_t seed, int rank, int64_t index, DType dtype) {
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

uint64_t fnv1a(const uint8_t* data, size_t bytes) {
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < bytes; ++i) {
    h ^= data[i];
    h *= 1099511628211ull;
  }
  return h;
}

// ------------------------------------------------------------------ the expected expression
// What the design promises, written without the step lists: flat algorithms sum every rank in
// rank order in fp32 and round once; island algorithms round each island's rank-ordered fp32
// sum, then add the two partials (the island holding rank 0 first) and round again.

struct Expected {
  float value;     // bitwise expectation
  double exact;    // double-precision sum
  double abs_sum;  // sum of magnitudes, for the tolerance
};

Expected expected_element(uint64_t seed, int world, const std::vector<int>& island_of,
                          bool island_algorithm, int64_t index, DType dtype) {
  Expected e{0.0f, 0.0, 0.0};
  float flat = 0.0f;
  float side_sum[2] = {0.0f, 0.0f};
  bool side_started[2] = {false, false};
  for (int q = 0; q < world; ++q) {
    const float x = input_value(seed, q, index, dtype);
    e.exact += x;
    e.abs_sum += std::fabs(x);
    flat = q == 0 ? x : flat + x;
    const int side = island_of.empty() || island_of[q] == island_of[0] ? 0 : 1;
    side_sum[side] = side_started[side] ? side_sum[side] + x : x;
    side_started[side] = true;
  }
  if (!island_algorithm) {
    e.value = static_cast<float>(round_to(dtype, flat));
  } else {
    const auto p0 = static_cast<float>(round_to(dtype, side_sum[0]));
    const auto p1 = static_cast<float>(round_to(dtype, side_sum[1]));
    e.value = static_cast<float>(round_to(dtype, p0 + p1));
  }
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

void arrive_and_wait(Arena* arena, int target, double timeout_s) {
  std::atomic_ref<int> count(arena->barrier_count);
  count.fetch_add(1, std::memory_order_acq_rel);
  const double deadline = now_s() + timeout_s;
  while (count.load(std::memory_order_acquire) < target) {
    if (now_s() > deadline) throw std::runtime_error("test bootstrap barrier timed out");
    usleep(200);
  }
}

void mark(RankReport* report, Outcome outcome) {
  std::atomic_ref<int>(report->outcome).store(outcome, std::memory_order_release);
}

Outcome outcome_of(Arena* arena, int rank) {
  return static_cast<Outcome>(
      std::atomic_ref<int>(arena->reports[rank].outcome).load(std::memory_order_acquire));
}

void record_exception(RankReport* report, const std::exception& e) {
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

[[noreturn]] void child_main(const GroupSpec& spec, int rank, Arena* arena, uint64_t* hashes,
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
std::vector<std::string> segments_of(pid_t pid) {
  std::vector<std::string> found;
  const std::string prefix = "pcie_ar." + std::to_string(pid) + ".";
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind(prefix, 0) == 0) found.push_back("/" + name);
  }
  return found;
}

bool segment_exists(const std::string& name) {
  return !name.empty() && access(("/dev/shm" + name).c_str(), F_OK) == 0;
}

GroupResult run_group(const GroupSpec& spec, const ChildBody& body) {
  SharedPages arena_pages(sizeof(Arena));
  auto* arena = static_cast<Arena*>(arena_pages.get());
  SharedPages hash_pages(spec.num_calls * kMaxWorld * sizeof(uint64_t));
  auto* hashes = static_cast<uint64_t*>(hash_pages.get());

  GroupResult result;
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
  std::vector<bool> reaped(launched, false);
  int remaining = launched;
  const double deadline = now_s() + spec.deadline_s;
  while (remaining > 0 && now_s() < deadline) {
    for (int r = 0; r < launched; ++r) {
      if (reaped[r]) continue;
      int status = 0;
      if (waitpid(result.pids[r], &status, WNOHANG) == result.pids[r]) {
        reaped[r] = true;
        result.status[r] = status;
        --remaining;
      }
    }
    if (remaining > 0) usleep(1000);
  }
  for (int r = 0; r < launched; ++r) {
    if (reaped[r]) continue;
    result.hung = true;
    kill(result.pids[r], SIGKILL);
    waitpid(result.pids[r], &result.status[r], 0);
  }

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

std::string describe_child(const GroupResult& g, int r) {
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
void expect_clean(const GroupResult& g) {
  EXPECT_FALSE(g.hung) << "a child did not finish before the deadline and was killed";
  EXPECT_TRUE(g.leaked.empty()) << "left in /dev/shm: " << (g.leaked.empty() ? "" : g.leaked[0]);
  for (const std::string& name : g.names) {
    EXPECT_FALSE(segment_exists(name)) << name;
  }
}

void expect_all_returned(const GroupResult& g) {
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

std::string describe_call(const Workload& w, int index) {
  const CallCase& c = w.calls[index];
  plan::Tactic t = w.tactics[c.tactic].tactic;
  t.blocks = c.blocks;
  return "call " + std::to_string(index) + " (" + plan::tactic_label(t) + " " +
         std::string(plan::dtype_name(c.dtype)) + " numel " + std::to_string(c.numel) +
         (c.in_place ? " in-place" : "") + ")";
}

// Every tactic the builders accept for this world and island map.
std::vector<TacticCase> all_tactics(int world, const std::vector<int>& island_of) {
  std::vector<TacticCase> tactics;
  for (const plan::Tactic& tactic : plan::buildable_tactics(world, island_of)) {
    tactics.push_back(
        TacticCase{tactic, plan::build_schedule(tactic.algorithm, tactic.direction, tactic.staged,
                                                world, island_of, tactic.protocol)});
  }
  return tactics;
}

void check_output(const Workload& w, const CallCase& call, int rank, int call_index,
                  const uint8_t* out, RankReport* report) {
  const Algorithm algorithm = w.tactics[call.tactic].tactic.algorithm;
  const bool island = plan::is_island_algorithm(algorithm);
  const int elem = plan::dtype_bytes(call.dtype);
  const double tolerance_factor =
      (island ? 3.0 : 1.0) * unit_roundoff(call.dtype) + w.world * std::ldexp(1.0, -24);
  uint8_t want[4];
  for (int64_t i = 0; i < call.numel; ++i) {
    const Expected e = expected_element(call.seed, w.world, w.island_of, island, i, call.dtype);
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

constexpr size_t kGuardBytes = 64;
constexpr uint8_t kGuardByte = 0xA5;

// The child's side of a workload: every call in order, each output checked elementwise.
void run_workload(const Workload& w, HostShmWorkspace& ws, ChildEnv& env) {
  std::vector<int> programs;
  for (const TacticCase& t : w.tactics) {
    programs.push_back(ws.add_program(plan::encode_program(t.schedule, env.rank)));
  }
  const size_t max_bytes = static_cast<size_t>(ws.layout().max_numel) * 4;
  std::vector<uint8_t> input(max_bytes + kGuardBytes);
  std::vector<uint8_t> output(max_bytes + kGuardBytes);
  for (int i = 0; i < static_cast<int>(w.calls.size()); ++i) {
    const CallCase& call = w.calls[i];
    const int elem = plan::dtype_bytes(call.dtype);
    const size_t bytes = static_cast<size_t>(call.numel) * elem;
    for (int64_t e = 0; e < call.numel; ++e) {
      encode(call.dtype, input_value(call.seed, env.rank, e, call.dtype), &input[e * elem]);
    }
    std::memset(input.data() + bytes, kGuardByte, kGuardBytes);
    std::memset(output.data(), 0xFF, bytes);  // NaN in every dtype: unwritten elements show
    std::memset(output.data() + bytes, kGuardByte, kGuardBytes);
    uint8_t* out = call.in_place ? input.data() : output.data();
    plan::Tactic tactic = w.tactics[call.tactic].tactic;
    tactic.blocks = call.blocks;
    run_call(ws, programs[call.tactic], call.dtype, call.blocks, input.data(), out, call.numel,
             plan::call_signature(call.dtype, tactic));
    const bool guards_intact =
        std::all_of(input.begin() + bytes, input.begin() + bytes + kGuardBytes,
                    [](uint8_t b) { return b == kGuardByte; }) &&
        std::all_of(output.begin() + bytes, output.begin() + bytes + kGuardBytes,
                    [](uint8_t b) { return b == kGuardByte; });
    if (!guards_intact && env.report->check_failures++ == 0) {
      set_text(env.report->check_message, describe_call(w, i) + ": wrote past the message");
    }
    env.hashes[i * kMaxWorld + env.rank] = fnv1a(out, bytes);
    check_output(w, call, env.rank, i, out, env.report);
    env.report->calls_done = i + 1;
  }
}

// Runs the workload on one process per rank; checks results, cross-rank bitwise identity,
// hangs and leaks.
void run_and_check(const Workload& w, int64_t max_numel, uint32_t initial_gen = 0) {
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
std::vector<int64_t> sizes_for(DType dtype, int64_t max_numel) {
  const int64_t lanes = plan::kVectorBytes / plan::dtype_bytes(dtype);
  std::vector<int64_t> sizes;
  for (int64_t vecs : {1, 3, 37, 515}) {
    if (vecs * lanes < max_numel) sizes.push_back(vecs * lanes);
  }
  sizes.push_back(max_numel);
  return sizes;
}

// ------------------------------------------------------------------ the schedule matrix

struct GroupParam {
  std::string name;
  int world;
  std::vector<int> island_of;
};

void PrintTo(const GroupParam& param, std::ostream* os) { *os << param.name; }

class HostShmScheduleMatrix : public ::testing::TestWithParam<GroupParam> {};

// Every tactic x dtype x size on one set of processes, switching tactic, dtype, size, block
// count and in-place between consecutive calls (as a communicator does).
TEST_P(HostShmScheduleMatrix, EveryScheduleMatchesTheReferenceOnEveryRank) {
  const GroupParam& p = GetParam();
  constexpr int64_t kMaxNumel = 6000;  // not a power of two; a multiple of 8 elements
  Workload w;
  w.world = p.world;
  w.island_of = p.island_of;
  w.tactics = all_tactics(p.world, p.island_of);
  ASSERT_FALSE(w.tactics.empty());
  const int block_cycle[] = {1, 2, 3, 5, 8, 1, 4};
  uint64_t seed = 1000 * p.world;
  int n = 0;
  for (int t = 0; t < static_cast<int>(w.tactics.size()); ++t) {
    for (DType dtype : plan::kAllDTypes) {
      for (int64_t numel : sizes_for(dtype, kMaxNumel)) {
        w.calls.push_back(CallCase{t, dtype, numel, block_cycle[n % 7], n % 3 == 1, ++seed});
        ++n;
      }
    }
  }
  run_and_check(w, kMaxNumel);
}

std::vector<int> halves(int world) {
  std::vector<int> map(world);
  for (int r = 0; r < world; ++r) map[r] = r < world / 2 ? 0 : 1;
  return map;
}

std::vector<int> interleaved(int world, int first = 0) {
  std::vector<int> map(world);
  for (int r = 0; r < world; ++r) map[r] = (r + first) % 2;
  return map;
}

INSTANTIATE_TEST_SUITE_P(
    HostShm, HostShmScheduleMatrix,
    ::testing::Values(GroupParam{"flat_w2", 2, {}}, GroupParam{"flat_w3", 3, {}},
                      GroupParam{"flat_w4", 4, {}}, GroupParam{"flat_w5", 5, {}},
                      GroupParam{"flat_w6", 6, {}}, GroupParam{"flat_w7", 7, {}},
                      GroupParam{"flat_w8", 8, {}}, GroupParam{"islands_2x2", 4, halves(4)},
                      GroupParam{"islands_2x3", 6, halves(6)},
                      GroupParam{"islands_2x4", 8, halves(8)},
                      GroupParam{"interleaved_2x2", 4, interleaved(4)},
                      GroupParam{"interleaved_2x2_rank0_in_island1", 4, interleaved(4, 1)},
                      GroupParam{"interleaved_2x3", 6, interleaved(6)},
                      GroupParam{"interleaved_2x4", 8, interleaved(8)}),
    [](const ::testing::TestParamInfo<GroupParam>& info) { return info.param.name; });

// ------------------------------------------------------------------ focused behaviours

TEST(HostShm, LargeMessagesAtMaxNumelAreCorrect) {
  constexpr int64_t kMaxNumel = 100000;  // 400 KB of fp32, not a power of two
  Workload w;
  w.world = 4;
  w.island_of = halves(4);
  w.tactics = all_tactics(w.world, w.island_of);
  uint64_t seed = 77;
  int n = 0;
  // LL tactics carry at most the LL slots' capacity: they run at exactly that size.
  const int64_t ll_capacity = plan::make_layout(kMaxNumel, w.world, 4).ll_capacity_bytes;
  ASSERT_LT(ll_capacity, kMaxNumel * 4);
  for (int t = 0; t < static_cast<int>(w.tactics.size()); ++t) {
    const DType dtype = plan::kAllDTypes[t % 3];
    const bool ll = w.tactics[t].tactic.protocol == plan::Protocol::kLL;
    const int64_t numel = ll ? ll_capacity / plan::dtype_bytes(dtype) : kMaxNumel;
    w.calls.push_back(CallCase{t, dtype, numel, 1 + (n % 4) * 3, n % 2 == 1, ++seed});
    ++n;
  }
  w.calls.push_back(CallCase{0, DType::kBF16, kMaxNumel - 8, 7, false, ++seed});
  run_and_check(w, kMaxNumel);
}

TEST(HostShm, BlockCountsChangingBetweenCallsStayCorrect) {
  Workload w;
  w.world = 4;
  w.tactics = all_tactics(w.world, {});
  uint64_t seed = 500;
  // Up, down, past the vector count, the maximum, and back to 1: counters of every block stay
  // equal, so whichever flags the next call uses expect the right generation.
  const int blocks[] = {1, 7, 2, 64, 3, 1, 16, 5, 64, 1};
  for (int t = 0; t < static_cast<int>(w.tactics.size()); ++t) {
    for (int b : blocks) {
      w.calls.push_back(CallCase{t, DType::kBF16, 8 * 41, b, false, ++seed});
    }
  }
  run_and_check(w, 4096);
}

TEST(HostShm, InPlaceIsCorrectForEverySchedule) {
  for (const auto& [world, island_of] :
       std::vector<std::pair<int, std::vector<int>>>{{3, {}}, {8, interleaved(8)}}) {
    SCOPED_TRACE("world " + std::to_string(world));
    Workload w;
    w.world = world;
    w.island_of = island_of;
    w.tactics = all_tactics(world, island_of);
    uint64_t seed = 900;
    for (int t = 0; t < static_cast<int>(w.tactics.size()); ++t) {
      for (DType dtype : plan::kAllDTypes) {
        w.calls.push_back(CallCase{t, dtype, 8 * 53, 1 + t % 3, true, ++seed});
      }
    }
    run_and_check(w, 1024);
  }
}

TEST(HostShm, GenerationWrapAroundIsSeamless) {
  for (const auto& [world, island_of] :
       std::vector<std::pair<int, std::vector<int>>>{{3, {}}, {4, halves(4)}}) {
    SCOPED_TRACE("world " + std::to_string(world));
    Workload w;
    w.world = world;
    w.island_of = island_of;
    w.tactics = all_tactics(world, island_of);
    for (int i = 0; i < 20; ++i) {
      // Tactics and block counts rotate so both parities of several flag sets cross the wrap.
      w.calls.push_back(CallCase{i % static_cast<int>(w.tactics.size()), plan::kAllDTypes[i % 3],
                                 8 * (5 + i), 1 + i % 3, i % 4 == 3,
                                 3000 + static_cast<uint64_t>(i)});
    }
    run_and_check(w, 1024, 0xFFFFFFFFu - 5);
  }
}

// One call of `numel` fp32 elements with `tactic`, timed; TransportFailure recorded in the
// report (the body returns normally).
void timed_call(HostShmWorkspace& ws, ChildEnv& env, const plan::Tactic& tactic, int world,
                int64_t numel) {
  const int program = ws.add_program(
      plan::encode_program(plan::build_schedule(tactic.algorithm, tactic.direction, tactic.staged,
                                                world, {}, tactic.protocol),
                           env.rank));
  std::vector<float> data(static_cast<size_t>(numel));
  for (int64_t i = 0; i < numel; ++i) data[i] = input_value(9, env.rank, i, DType::kFP32);
  std::vector<float> out(data.size());
  const double start = now_s();
  try {
    run_call(ws, program, DType::kFP32, tactic.blocks, data.data(), out.data(), numel,
             plan::call_signature(DType::kFP32, tactic));
    set_text(env.report->message, "the call returned instead of failing");
  } catch (const TransportFailure& e) {
    env.report->failure_elapsed_s = now_s() - start;
    record_exception(env.report, e);
    // The ranks are out of step now: the next call must be refused at once, not hang.
    const double retry = now_s();
    try {
      run_call(ws, program, DType::kFP32, tactic.blocks, data.data(), out.data(), numel,
               plan::call_signature(DType::kFP32, tactic));
    } catch (const TransportFailure&) {
      env.report->scenario_ok = now_s() - retry < 0.1 ? 1 : 0;
    }
  }
}

plan::Tactic make_tactic(Algorithm algorithm, Direction direction, bool staged, int blocks = 1,
                         plan::Protocol protocol = plan::Protocol::kFlag) {
  plan::Tactic t;
  t.algorithm = algorithm;
  t.direction = direction;
  t.staged = staged;
  t.protocol = protocol;
  t.blocks = blocks;
  return t;
}

plan::Tactic ll_tactic(Algorithm algorithm, int blocks = 1) {
  return make_tactic(algorithm, Direction::kPush, false, blocks, plan::Protocol::kLL);
}

// Rank 2 of a world-3 group: mapped, then silent until ranks 0 and 1 have given up (at most
// 15 s), so they can only time out waiting for it.
void stay_silent_while_others_run(ChildEnv& env) {
  const double deadline = now_s() + 15.0;
  while (now_s() < deadline &&
         (outcome_of(env.arena, 0) == kRunning || outcome_of(env.arena, 1) == kRunning)) {
    usleep(1000);
  }
}

constexpr double kShortTimeoutS = 0.5;
// Two cores and up to eight processes: a failing call may end a little after its deadline.
constexpr double kSchedulingSlackS = 2.5;

// A group whose waits give up after kShortTimeoutS, its first call at initial_gen + 1.
GroupSpec short_timeout_group(int world, uint32_t initial_gen) {
  GroupSpec spec;
  spec.world = world;
  spec.layout = plan::make_layout(256, world, 4);
  spec.initial_gen = initial_gen;
  spec.timeout_s = kShortTimeoutS;
  spec.deadline_s = 20.0;
  return spec;
}

TEST(HostShm, TimeoutNamesThePeerThatNeverCalled) {
  constexpr uint32_t kInitialGen = 41;
  const GroupSpec spec = short_timeout_group(3, kInitialGen);
  const auto tactic = make_tactic(Algorithm::kOneshot, Direction::kPush, false);
  const GroupResult g = run_group(spec, [&](HostShmWorkspace& ws, ChildEnv& env) {
    if (env.rank == 2) return stay_silent_while_others_run(env);
    timed_call(ws, env, tactic, 3, 64);
  });
  expect_clean(g);
  bool someone_named_rank2 = false;
  for (int r = 0; r < 2; ++r) {
    const RankReport& rep = g.reports[r];
    SCOPED_TRACE(describe_child(g, r));
    ASSERT_EQ(rep.error_type, kTransportError);
    EXPECT_EQ(rep.diagnostic.kind, static_cast<uint32_t>(plan::FailureKind::kTimeout));
    EXPECT_EQ(rep.diagnostic.rank, static_cast<uint32_t>(r));
    EXPECT_NE(rep.diagnostic.peer, static_cast<uint32_t>(r));
    EXPECT_EQ(rep.diagnostic.gen_expected, kInitialGen + 1);
    EXPECT_EQ(rep.diagnostic.gen_seen, kInitialGen);
    EXPECT_EQ(rep.diagnostic.numel, 64u);
    someone_named_rank2 |= rep.diagnostic.peer == 2;
    const std::string message = rep.message;
    EXPECT_NE(message.find("rank " + std::to_string(r)), std::string::npos);
    EXPECT_NE(message.find("rank " + std::to_string(rep.diagnostic.peer)), std::string::npos);
    EXPECT_GE(rep.failure_elapsed_s, kShortTimeoutS * 0.9);
    EXPECT_LE(rep.failure_elapsed_s, kShortTimeoutS + kSchedulingSlackS);
    EXPECT_EQ(rep.scenario_ok, 1) << "a call after the failure was not refused at once";
  }
  EXPECT_TRUE(someone_named_rank2);
  EXPECT_EQ(g.reports[2].outcome, kReturned) << describe_child(g, 2);
}

TEST(HostShm, KilledPeerIsReportedAndLeavesNothingInDevShm) {
  constexpr int kCallsBeforeDeath = 5;
  GroupSpec spec;
  spec.world = 2;
  spec.layout = plan::make_layout(256, 2, 4);
  spec.timeout_s = kShortTimeoutS;
  spec.deadline_s = 20.0;
  const auto tactic = make_tactic(Algorithm::kTwoshot, Direction::kPush, true);
  const plan::Schedule schedule =
      plan::build_schedule(Algorithm::kTwoshot, Direction::kPush, true, 2);
  const GroupResult g = run_group(spec, [&](HostShmWorkspace& ws, ChildEnv& env) {
    const int program = ws.add_program(plan::encode_program(schedule, env.rank));
    std::vector<float> data(64, 1.0f + env.rank);
    for (int i = 0; i < kCallsBeforeDeath; ++i) {
      run_call(ws, program, DType::kFP32, 1, data.data(), data.data(), 64,
               plan::call_signature(DType::kFP32, tactic));
      env.report->calls_done = i + 1;
    }
    if (env.rank == 1) kill(getpid(), SIGKILL);  // mid-sequence, no destructor, no cleanup
    timed_call(ws, env, tactic, 2, 64);
  });
  expect_clean(g);
  ASSERT_EQ(g.status.size(), 2u);
  EXPECT_TRUE(WIFSIGNALED(g.status[1]) && WTERMSIG(g.status[1]) == SIGKILL) << describe_child(g, 1);
  const RankReport& rep = g.reports[0];
  SCOPED_TRACE(describe_child(g, 0));
  ASSERT_EQ(rep.error_type, kTransportError);
  EXPECT_EQ(rep.diagnostic.kind, static_cast<uint32_t>(plan::FailureKind::kTimeout));
  EXPECT_EQ(rep.diagnostic.peer, 1u);
  EXPECT_EQ(rep.diagnostic.gen_expected, static_cast<uint32_t>(kCallsBeforeDeath + 1));
  EXPECT_LE(rep.failure_elapsed_s, kShortTimeoutS + kSchedulingSlackS);
  EXPECT_TRUE(segments_of(g.pids[0]).empty());
  EXPECT_TRUE(segments_of(g.pids[1]).empty());
}

// Ranks that enter the same generation with different calls must fail fast on every rank.
void expect_disagreement_fails(int world, const std::vector<plan::Tactic>& tactic_of,
                               const std::vector<int64_t>& numel_of, bool expect_mismatch) {
  GroupSpec spec;
  spec.world = world;
  spec.layout = plan::make_layout(1024, world, 4);
  spec.timeout_s = kShortTimeoutS;
  spec.deadline_s = 20.0;
  const GroupResult g = run_group(spec, [&](HostShmWorkspace& ws, ChildEnv& env) {
    timed_call(ws, env, tactic_of[env.rank], world, numel_of[env.rank]);
  });
  expect_clean(g);
  int mismatches = 0;
  for (int r = 0; r < world; ++r) {
    const RankReport& rep = g.reports[r];
    SCOPED_TRACE(describe_child(g, r));
    ASSERT_EQ(rep.error_type, kTransportError);
    EXPECT_LE(rep.failure_elapsed_s, kShortTimeoutS + kSchedulingSlackS);
    EXPECT_EQ(rep.scenario_ok, 1) << "a call after the failure was not refused at once";
    if (rep.diagnostic.kind == static_cast<uint32_t>(plan::FailureKind::kMismatch)) {
      ++mismatches;
      const int peer = static_cast<int>(rep.diagnostic.peer);
      ASSERT_LT(peer, world);
      EXPECT_EQ(rep.diagnostic.numel, static_cast<uint32_t>(numel_of[r]));
      EXPECT_EQ(rep.diagnostic.peer_numel, static_cast<uint32_t>(numel_of[peer]));
      EXPECT_EQ(rep.diagnostic.peer_signature, plan::call_signature(DType::kFP32, tactic_of[peer]));
      EXPECT_NE(std::string(rep.message).find("disagree"), std::string::npos);
    } else {
      // An LL reader waits for data instead of a flag: it times out (or sees a foreign tag).
      const auto kind = static_cast<plan::FailureKind>(rep.diagnostic.kind);
      EXPECT_TRUE(kind == plan::FailureKind::kTimeout || kind == plan::FailureKind::kLLTimeout ||
                  kind == plan::FailureKind::kLLMismatch)
          << rep.message;
    }
  }
  if (expect_mismatch) {
    EXPECT_GE(mismatches, 1);
  }
}

TEST(HostShm, DifferentNumelOnTwoRanksIsAMismatchNotAHang) {
  const auto oneshot = make_tactic(Algorithm::kOneshot, Direction::kPush, false);
  expect_disagreement_fails(2, {oneshot, oneshot}, {64, 128}, true);
  const auto twoshot = make_tactic(Algorithm::kTwoshot, Direction::kPull, true, 2);
  expect_disagreement_fails(4, {twoshot, twoshot, twoshot, twoshot}, {256, 256, 256, 96}, true);
}

TEST(HostShm, DifferentAlgorithmsOnTwoRanksFailWithinTheTimeout) {
  const auto oneshot = make_tactic(Algorithm::kOneshot, Direction::kPush, true);
  const auto twoshot = make_tactic(Algorithm::kTwoshot, Direction::kPush, true);
  expect_disagreement_fails(3, {oneshot, twoshot, oneshot}, {64, 64, 64}, false);
  const auto pull = make_tactic(Algorithm::kOneshot, Direction::kPull, false);
  expect_disagreement_fails(2, {oneshot, pull}, {64, 64}, false);
}

TEST(HostShm, LLTimeoutNamesTheWriterThatNeverCalled) {
  constexpr uint32_t kInitialGen = 0xFFFFFFFFu;  // the first call's tag crosses 2^32
  const GroupSpec spec = short_timeout_group(3, kInitialGen);
  const auto tactic = ll_tactic(Algorithm::kOneshot);
  const GroupResult g = run_group(spec, [&](HostShmWorkspace& ws, ChildEnv& env) {
    if (env.rank == 2) return stay_silent_while_others_run(env);
    timed_call(ws, env, tactic, 3, 64);
  });
  expect_clean(g);
  for (int r = 0; r < 2; ++r) {
    const RankReport& rep = g.reports[r];
    SCOPED_TRACE(describe_child(g, r));
    ASSERT_EQ(rep.error_type, kTransportError);
    EXPECT_EQ(rep.diagnostic.kind, static_cast<uint32_t>(plan::FailureKind::kLLTimeout));
    EXPECT_EQ(rep.diagnostic.peer, 2u);  // the only rank whose data never lands
    EXPECT_EQ(rep.diagnostic.flag_owner, static_cast<uint32_t>(r));
    EXPECT_EQ(rep.diagnostic.gen_expected, uint64_t{kInitialGen} + 1);
    EXPECT_EQ(
        rep.diagnostic.peer_signature,
        plan::ll_tag(uint64_t{kInitialGen} + 1, 64, plan::call_signature(DType::kFP32, tactic)));
    EXPECT_NE(std::string(rep.message).find("waiting for rank 2's data in LL slot 2"),
              std::string::npos)
        << rep.message;
    EXPECT_GE(rep.failure_elapsed_s, kShortTimeoutS * 0.9);
    EXPECT_LE(rep.failure_elapsed_s, kShortTimeoutS + kSchedulingSlackS);
    EXPECT_EQ(rep.scenario_ok, 1) << "a call after the failure was not refused at once";
  }
}

TEST(HostShm, LLCallsThatDisagreeAreAMismatchNotGarbage) {
  // Same generation, different numel: the tags differ, so the reader refuses the data at once.
  GroupSpec spec;
  spec.world = 2;
  spec.layout = plan::make_layout(1024, 2, 4);
  spec.timeout_s = kShortTimeoutS;
  spec.deadline_s = 20.0;
  const auto tactic = ll_tactic(Algorithm::kOneshot);
  const int64_t numel_of[] = {64, 128};
  const GroupResult g = run_group(spec, [&](HostShmWorkspace& ws, ChildEnv& env) {
    timed_call(ws, env, tactic, 2, numel_of[env.rank]);
  });
  expect_clean(g);
  int mismatches = 0;
  for (int r = 0; r < 2; ++r) {
    const RankReport& rep = g.reports[r];
    SCOPED_TRACE(describe_child(g, r));
    ASSERT_EQ(rep.error_type, kTransportError);
    EXPECT_LE(rep.failure_elapsed_s, kShortTimeoutS + kSchedulingSlackS);
    if (rep.diagnostic.kind == static_cast<uint32_t>(plan::FailureKind::kLLMismatch)) {
      ++mismatches;
      EXPECT_EQ(rep.diagnostic.peer, static_cast<uint32_t>(1 - r));
      EXPECT_NE(std::string(rep.message).find("disagree"), std::string::npos) << rep.message;
    } else {
      EXPECT_EQ(rep.diagnostic.kind, static_cast<uint32_t>(plan::FailureKind::kLLTimeout));
    }
  }
  EXPECT_GE(mismatches, 1);
  // An LL rank and a flag rank in one generation: nobody reduces garbage, both fail in time.
  expect_disagreement_fails(
      2,
      {ll_tactic(Algorithm::kOneshot), make_tactic(Algorithm::kOneshot, Direction::kPush, false)},
      {64, 64}, false);
}

TEST(HostShm, LLAndFlagTacticsInterleaveAcrossManyCallsOfChangingSize) {
  // Large LL calls leave words far into the slots that the small calls in between never touch;
  // every read resets its words, so nothing stale is taken for data when a large call returns.
  Workload w;
  w.world = 3;
  w.tactics = all_tactics(3, {});
  std::vector<int> ll_index;
  for (int t = 0; t < static_cast<int>(w.tactics.size()); ++t) {
    if (w.tactics[t].tactic.protocol == plan::Protocol::kLL) ll_index.push_back(t);
  }
  ASSERT_EQ(ll_index.size(), 2u);  // oneshot and twoshot
  for (int i = 0; i < 60; ++i) {
    const bool large = i % 10 == 0;
    const int tactic =
        i % 3 == 2 ? i % static_cast<int>(w.tactics.size()) : ll_index[i % ll_index.size()];
    w.calls.push_back(CallCase{tactic, plan::kAllDTypes[i % 3], large ? 1024 : 8 * (1 + i % 4),
                               1 + i % 4, i % 5 == 4, 7000 + static_cast<uint64_t>(i)});
  }
  run_and_check(w, 1024, 0xFFFFFFFFu - 30);
}

// A sum with +0.0 must give back every fp16 and bf16 value exactly (-0 becomes +0, NaN stays
// NaN): pins the fp32 conversions both ways, subnormals and infinities included.
TEST(HostShm, EveryHalfPrecisionValueSurvivesASumWithZero) {
  constexpr int64_t kNumel = 65536;
  GroupSpec spec;
  spec.world = 2;
  spec.layout = plan::make_layout(kNumel, 2, 2);
  const auto tactic = make_tactic(Algorithm::kOneshot, Direction::kPush, false);
  const plan::Schedule schedule =
      plan::build_schedule(Algorithm::kOneshot, Direction::kPush, false, 2);
  const GroupResult g = run_group(spec, [&](HostShmWorkspace& ws, ChildEnv& env) {
    const int program = ws.add_program(plan::encode_program(schedule, env.rank));
    std::vector<uint16_t> input(kNumel);
    std::vector<uint16_t> output(kNumel);
    for (DType dtype : {DType::kFP16, DType::kBF16}) {
      for (int64_t i = 0; i < kNumel; ++i) {
        input[i] = env.rank == 0 ? static_cast<uint16_t>(i) : 0;
      }
      std::fill(output.begin(), output.end(), 0x1234);
      run_call(ws, program, dtype, 3, input.data(), output.data(), kNumel,
               plan::call_signature(dtype, tactic));
      for (int64_t i = 0; i < kNumel; ++i) {
        const auto bits = static_cast<uint16_t>(i);
        uint8_t bytes[4] = {};  // decode() reads up to 4 bytes
        std::memcpy(bytes, &bits, 2);
        const double in = decode(dtype, bytes);
        std::memcpy(bytes, &output[i], 2);
        const double out = decode(dtype, bytes);
        bool ok = false;
        if (std::isnan(in)) {
          ok = std::isnan(out);
        } else if (bits == 0x8000) {
          ok = output[i] == 0;
        } else {
          ok = output[i] == bits;
        }
        if (!ok && env.report->check_failures++ == 0) {
          char text[256];
          std::snprintf(text, sizeof(text), "%s: 0x%04x + 0 gave 0x%04x",
                        std::string(plan::dtype_name(dtype)).c_str(), bits, output[i]);
          set_text(env.report->check_message, text);
        }
      }
      env.report->calls_done += 1;
    }
  });
  expect_all_returned(g);
}

// The edges of rounding that random inputs rarely reach: overflow to infinity, the tie at the
// largest finite value, ties to even near 1, NaN and inf - inf.
TEST(HostShm, OverflowTiesAndNaNRoundAsIeeeSays) {
  struct Case {
    DType dtype;
    double a;  // rank 0's element
    double b;  // rank 1's element
    double want;
  };
  const double inf = INFINITY;
  const double nan = NAN;
  const std::vector<Case> cases = {
      {DType::kFP16, 60000, 60000, inf},
      {DType::kFP16, -60000, -60000, -inf},
      {DType::kFP16, 65504, 8, 65504},           // below the halfway point to 65536
      {DType::kFP16, 65504, 16, inf},            // exactly halfway: even is 65536, i.e. inf
      {DType::kFP16, 1, std::ldexp(1, -11), 1},  // tie, 1.0 is even
      {DType::kFP16, 1 + std::ldexp(1, -10), std::ldexp(1, -11), 1 + std::ldexp(1, -9)},
      {DType::kFP16, std::ldexp(1, -24), std::ldexp(1, -24), std::ldexp(1, -23)},  // subnormals
      {DType::kFP16, inf, -inf, nan},
      {DType::kFP16, nan, 1, nan},
      {DType::kBF16, std::ldexp(1.5, 127), std::ldexp(1.5, 127), inf},
      {DType::kBF16, 1, std::ldexp(1, -8), 1},
      {DType::kBF16, 1 + std::ldexp(1, -7), std::ldexp(1, -8), 1 + std::ldexp(1, -6)},
      {DType::kBF16, inf, -inf, nan},
      {DType::kBF16, nan, 1, nan},
      {DType::kFP32, std::ldexp(1.5, 127), std::ldexp(1.5, 127), inf},
      {DType::kFP32, nan, 1, nan},
  };
  GroupSpec spec;
  spec.world = 2;
  spec.layout = plan::make_layout(1024, 2, 4);
  const auto tactic = make_tactic(Algorithm::kOneshot, Direction::kPush, false);
  const plan::Schedule schedule =
      plan::build_schedule(Algorithm::kOneshot, Direction::kPush, false, 2);
  const GroupResult g = run_group(spec, [&](HostShmWorkspace& ws, ChildEnv& env) {
    const int program = ws.add_program(plan::encode_program(schedule, env.rank));
    for (DType dtype : plan::kAllDTypes) {
      const int elem = plan::dtype_bytes(dtype);
      std::vector<const Case*> mine;
      for (const Case& c : cases) {
        if (c.dtype == dtype) mine.push_back(&c);
      }
      const int64_t numel = 16;  // a multiple of 16 bytes in every dtype; the rest is 1 + 1
      std::vector<uint8_t> input(numel * elem);
      std::vector<uint8_t> output(numel * elem, 0xFF);
      for (int64_t i = 0; i < numel; ++i) {
        const double v =
            i < static_cast<int64_t>(mine.size()) ? (env.rank == 0 ? mine[i]->a : mine[i]->b) : 1.0;
        encode(dtype, static_cast<float>(v), &input[i * elem]);
      }
      run_call(ws, program, dtype, 1, input.data(), output.data(), numel,
               plan::call_signature(dtype, tactic));
      for (int64_t i = 0; i < numel; ++i) {
        const double want = i < static_cast<int64_t>(mine.size()) ? mine[i]->want : 2.0;
        const double got = decode(dtype, &output[i * elem]);
        const bool ok = std::isnan(want) ? std::isnan(got) : got == want;
        if (!ok && env.report->check_failures++ == 0) {
          char text[256];
          std::snprintf(text, sizeof(text), "%s element %lld: got %.9g, expected %.9g",
                        std::string(plan::dtype_name(dtype)).c_str(), static_cast<long long>(i),
                        got, want);
          set_text(env.report->check_message, text);
        }
      }
      env.report->calls_done += 1;
    }
  });
  expect_all_returned(g);
}

// ------------------------------------------------------------------ single-process behaviours

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

template <typename Exception, typename F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const Exception& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("wrong exception type: ") + e.what();
  }
  return "no exception";
}

// What the workspace itself refuses: bad peers, programs that fail plan::check_program, and
// tactics outside the layout. Calls are admitted by the communicator (tests/python), so run()
// re-checks nothing.
TEST(HostShm, RejectsInvalidSetupSayingWhatWasExpected) {
  const plan::Layout layout = plan::make_layout(1024, 2, 4);
  std::string names[2];
  {
    HostShmWorkspace ws0(layout, 0, 0, 1.0);
    HostShmWorkspace ws1(layout, 1, 0, 1.0);
    names[0] = ws0.segment_name();
    names[1] = ws1.segment_name();
    EXPECT_EQ(ws0.local_token(), names[0]);
    const plan::Program program = plan::encode_program(
        plan::build_schedule(Algorithm::kOneshot, Direction::kPush, false, 2), 0);

    EXPECT_TRUE(contains(message_of<std::invalid_argument>([&] { ws0.open_peers({names[0]}); }),
                         "one segment"));
    EXPECT_TRUE(contains(message_of<std::invalid_argument>([&] {
                           ws0.open_peers({names[1], names[0]});
                         }),
                         "own segment"));
    ws0.open_peers({names[0], names[1]});
    EXPECT_TRUE(contains(message_of<std::logic_error>([&] {
                           ws0.open_peers({names[0], names[1]});
                         }),
                         "already"));

    // None of these may touch shared memory: rank 1 never runs, so a wait would time out.
    plan::Tactic tactic;
    tactic.blocks = 0;
    EXPECT_TRUE(contains(ws0.why_not(tactic).value_or("accepted"),
                         "blocks must be in 1..64 (the workspace's max_blocks), got 0"));
    tactic.blocks = 65;
    EXPECT_TRUE(contains(ws0.why_not(tactic).value_or("accepted"),
                         "blocks must be in 1..64 (the workspace's max_blocks), got 65"));
    tactic.blocks = 64;
    EXPECT_EQ(ws0.why_not(tactic), std::nullopt);
    const plan::Program other_rank = plan::encode_program(
        plan::build_schedule(Algorithm::kOneshot, Direction::kPush, false, 2), 1);
    EXPECT_TRUE(contains(message_of<std::invalid_argument>([&] { ws0.add_program(other_rank); }),
                         "program is for rank 1"));
    plan::Program peer_input = program;
    peer_input.steps[0].kind = plan::StepKind::kReduce;
    peer_input.steps[0].chunk = 0;
    peer_input.steps[0].num_srcs = 1;
    peer_input.steps[0].dst = plan::BufRef{plan::Space::kOutput, 0, 0, 0};
    peer_input.steps[0].srcs[0] = plan::BufRef{plan::Space::kInput, 1, 0, 0};
    EXPECT_TRUE(contains(message_of<std::invalid_argument>([&] { ws0.add_program(peer_input); }),
                         "only the executing rank's own tensors are local"));
    EXPECT_EQ(ws0.add_program(program), 0);
  }
  EXPECT_FALSE(segment_exists(names[0]));
  EXPECT_FALSE(segment_exists(names[1]));

  EXPECT_TRUE(
      contains(message_of<std::invalid_argument>([&] { HostShmWorkspace bad(layout, 2, 0, 1.0); }),
               "rank must be 0..1, got 2"));
  EXPECT_TRUE(
      contains(message_of<std::invalid_argument>([&] { HostShmWorkspace bad(layout, 0, 0, -1.0); }),
               "timeout_s must be >= 0"));
  EXPECT_TRUE(segments_of(getpid()).empty());
}

TEST(HostShm, TheFactoryCapsHostBlocksAndRejectsUnknownTransports) {
  WorkspaceOptions options;
  options.max_numel = 1024;
  options.world = 2;
  options.elem_bytes = 4;
  const auto ws = make_workspace(options);
  EXPECT_EQ(ws->device(), -1);
  EXPECT_EQ(ws->layout().max_blocks, HostShmWorkspace::kMaxBlocks);
  options.transport = "infiniband";
  EXPECT_TRUE(contains(message_of<std::invalid_argument>([&] { make_workspace(options); }),
                       "transport must be 'host' or 'cuda', got 'infiniband'"));
}

TEST(HostShm, OpenPeersRejectsAPeerBuiltWithAnotherLayout) {
  const plan::Layout small = plan::make_layout(1024, 2, 4);
  const plan::Layout large = plan::make_layout(2048, 2, 4);
  std::string names[2];
  {
    HostShmWorkspace ws0(small, 0, 0, 1.0);
    HostShmWorkspace ws1(large, 1, 0, 1.0);
    names[0] = ws0.segment_name();
    names[1] = ws1.segment_name();
    const std::string message = message_of<std::runtime_error>([&] {
      ws0.open_peers({names[0], names[1]});
    });
    EXPECT_TRUE(contains(message, "rank 1")) << message;
    EXPECT_TRUE(contains(message, std::to_string(large.total_bytes))) << message;
    EXPECT_TRUE(contains(message, std::to_string(small.total_bytes))) << message;

    const std::string missing = message_of<std::runtime_error>([&] {
      ws0.open_peers({names[0], "/pcie_ar.0.0000000000000000.r1"});
    });
    EXPECT_TRUE(contains(missing, "rank 1")) << missing;
  }
  EXPECT_FALSE(segment_exists(names[0]));
  EXPECT_FALSE(segment_exists(names[1]));
}

TEST(HostShm, SegmentNamesAreUniquePrivateAndUnlinked) {
  const plan::Layout layout = plan::make_layout(512, 4, 2);
  const std::regex pattern("/pcie_ar\\.[0-9]+\\.[0-9a-f]{16}\\.r3");
  std::string first;
  {
    HostShmWorkspace a(layout, 3, 0, 0.0);
    HostShmWorkspace b(layout, 3, 0, 0.0);
    first = a.segment_name();
    EXPECT_TRUE(std::regex_match(a.segment_name(), pattern)) << a.segment_name();
    EXPECT_TRUE(contains(a.segment_name(), "." + std::to_string(getpid()) + "."));
    EXPECT_NE(a.segment_name(), b.segment_name());
    struct stat info {};
    ASSERT_EQ(stat(("/dev/shm" + a.segment_name()).c_str(), &info), 0);
    EXPECT_EQ(info.st_mode & 0777, 0600u);
    EXPECT_EQ(static_cast<uint64_t>(info.st_size), layout.total_bytes);
    a.retire_token();
    a.retire_token();  // idempotent
    EXPECT_FALSE(segment_exists(a.segment_name()));
    EXPECT_TRUE(segment_exists(b.segment_name()));
  }
  EXPECT_FALSE(segment_exists(first));
  EXPECT_TRUE(segments_of(getpid()).empty());
}

}  // namespace
}  // namespace pcie_ar::transport
