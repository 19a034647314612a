// The memory of the cuda_host transport without a GPU: SharedPinnedSegments over real POSIX
// shared memory, with a registrar that records every pin and unpin (and checks that the memory
// is still mapped when it is unpinned) and fails on demand. What is pinned when, what a failure
// undoes, the teardown order and /dev/shm afterwards are the same code the GPU runs; only
// cudaHostRegister is replaced.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "host_test_util.h"
#include "plan/layout.h"
#include "transport/memory/shared_pinned.h"

namespace pcie_ar::transport {
namespace {

// What the fake registrar saw, shared by every rank's registrar of a test.
struct PinLog {
  std::map<uint8_t*, uint64_t> pinned;  // host address -> bytes, while pinned
  std::vector<std::string> events;      // "pin" / "unpin", in order
  int pins_until_failure = -1;          // the pin that fails (0 = the next one); -1: none
  bool fail_unpins = false;
  bool unpinned_unmapped_memory = false;
};

// The device address a pin hands out: distinct from the host address, so a test can tell them
// apart, and derivable back.
constexpr uintptr_t kDeviceOffset = uintptr_t{1} << 44;

bool mapped(const void* address) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  void* start = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(address) & ~(page - 1));
  return msync(start, page, MS_ASYNC) == 0;  // ENOMEM once the range is unmapped
}

class FakeRegistrar final : public HostRegistrar {
 public:
  explicit FakeRegistrar(PinLog* log) : log_(log) {}
  uint8_t* pin(uint8_t* host, uint64_t bytes) override {
    if (log_->pins_until_failure == 0) {
      log_->pins_until_failure = -1;
      throw std::runtime_error("cudaHostRegister failed (cudaErrorHostMemoryAlreadyRegistered)");
    }
    if (log_->pins_until_failure > 0) --log_->pins_until_failure;
    if (log_->pinned.count(host) != 0) throw std::runtime_error("pinned twice");
    log_->pinned[host] = bytes;
    log_->events.push_back("pin");
    return host + kDeviceOffset;
  }
  std::string unpin(uint8_t* host) noexcept override {
    if (!mapped(host)) log_->unpinned_unmapped_memory = true;
    log_->events.push_back("unpin");
    if (log_->pinned.erase(host) == 0) return "not pinned";
    return log_->fail_unpins ? "cudaHostUnregister failed (cudaErrorUnknown)" : "";
  }

 private:
  PinLog* log_;
};

plan::Layout small_layout(int world) { return plan::make_layout(4096, world, 2, 4); }

std::unique_ptr<SharedPinnedSegments> make_rank(const plan::Layout& layout, int rank, PinLog* log) {
  return std::make_unique<SharedPinnedSegments>(layout, rank, 0,
                                                std::make_unique<FakeRegistrar>(log));
}

std::vector<std::string> tokens_of(
    const std::vector<std::unique_ptr<SharedPinnedSegments>>& ranks) {
  std::vector<std::string> tokens;
  for (const auto& r : ranks) tokens.push_back(r->local_token());
  return tokens;
}

std::vector<std::unique_ptr<SharedPinnedSegments>> make_group(const plan::Layout& layout,
                                                              PinLog* log) {
  std::vector<std::unique_ptr<SharedPinnedSegments>> ranks;
  for (int r = 0; r < layout.world; ++r) ranks.push_back(make_rank(layout, r, log));
  return ranks;
}

TEST(SharedPinnedSegments, EveryRankPinsItsOwnSegmentAndThenEveryPeers) {
  const plan::Layout layout = small_layout(3);
  PinLog log;
  auto ranks = make_group(layout, &log);
  EXPECT_EQ(log.pinned.size(), 3u);  // each its own, at construction
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(ranks[r]->device_base(r), ranks[r]->host_base(r) + kDeviceOffset);
    EXPECT_EQ(log.pinned.at(ranks[r]->host_base(r)), layout.total_bytes);
    EXPECT_EQ(ranks[r]->device_base((r + 1) % 3), nullptr);  // peers: not before open_peers
  }
  const auto tokens = tokens_of(ranks);
  for (auto& r : ranks) r->open_peers(tokens);
  EXPECT_EQ(log.pinned.size(), 9u);  // every rank pins all three segments in its process
  // Rank 1's view of rank 2's segment is rank 2's memory: a write through one mapping is read
  // through the other (the GPU addresses the same bytes through device_base).
  std::memcpy(ranks[1]->host_base(2) + layout.control_bytes, "hello", 6);
  EXPECT_STREQ(reinterpret_cast<const char*>(ranks[2]->host_base(2) + layout.control_bytes),
               "hello");
  EXPECT_EQ(ranks[1]->device_base(2), ranks[1]->host_base(2) + kDeviceOffset);
  for (auto& r : ranks) r->retire_token();
  EXPECT_TRUE(host_test::segments_of(getpid()).empty()) << "names left in /dev/shm";
  for (auto& r : ranks) r->close_peers();
  EXPECT_EQ(log.pinned.size(), 3u);
  for (auto& r : ranks) r->release();
  EXPECT_TRUE(log.pinned.empty());
  EXPECT_FALSE(log.unpinned_unmapped_memory) << "memory was unmapped before it was unpinned";
}

TEST(SharedPinnedSegments, ReleaseWithoutClosePeersUnpinsEverythingBeforeUnmapping) {
  const plan::Layout layout = small_layout(2);
  PinLog log;
  {
    auto ranks = make_group(layout, &log);
    const auto tokens = tokens_of(ranks);
    for (auto& r : ranks) r->open_peers(tokens);
    ranks[0]->release();
    ranks[0]->release();  // idempotent
  }                       // rank 1 by its destructor
  EXPECT_TRUE(log.pinned.empty());
  EXPECT_FALSE(log.unpinned_unmapped_memory);
  EXPECT_TRUE(host_test::segments_of(getpid()).empty());
}

TEST(SharedPinnedSegments, OwnSegmentThatCannotBePinnedLeavesNothingBehind) {
  const plan::Layout layout = small_layout(2);
  PinLog log;
  log.pins_until_failure = 0;
  try {
    make_rank(layout, 1, &log);
    FAIL() << "construction succeeded";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 1: its own"), std::string::npos) << what;
    EXPECT_NE(what.find("cannot be pinned"), std::string::npos) << what;
    EXPECT_NE(what.find("cudaErrorHostMemoryAlreadyRegistered"), std::string::npos) << what;
  }
  EXPECT_TRUE(log.pinned.empty());
  EXPECT_TRUE(host_test::segments_of(getpid()).empty()) << "the segment was left in /dev/shm";
}

TEST(SharedPinnedSegments, PeerThatCannotBePinnedIsNamedAndEverythingIsUndone) {
  const plan::Layout layout = small_layout(3);
  PinLog log;
  auto ranks = make_group(layout, &log);
  const auto tokens = tokens_of(ranks);
  ranks[0]->open_peers(tokens);
  log.pins_until_failure = 1;  // rank 1 pins rank 0's segment, then fails on rank 2's
  try {
    ranks[1]->open_peers(tokens);
    FAIL() << "open_peers succeeded";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 1: rank 2's workspace segment cannot be pinned"), std::string::npos)
        << what;
  }
  // Rank 1 holds only its own pin again, mapped no peer, and its name is gone, so a peer that
  // has not mapped it yet fails at once instead of waiting at the barrier.
  EXPECT_EQ(ranks[1]->device_base(0), nullptr);
  EXPECT_EQ(ranks[1]->host_base(0), nullptr);
  EXPECT_EQ(ranks[1]->device_base(1), ranks[1]->host_base(1) + kDeviceOffset);
  EXPECT_FALSE(host_test::segment_exists(tokens[1]));
  EXPECT_THROW(ranks[2]->open_peers(tokens), std::runtime_error);
  EXPECT_EQ(log.pinned.size(), 3u + 2u);  // three own segments, rank 0's two peers
  EXPECT_FALSE(log.unpinned_unmapped_memory);
  ranks.clear();
  EXPECT_TRUE(log.pinned.empty());
  EXPECT_TRUE(host_test::segments_of(getpid()).empty());
}

TEST(SharedPinnedSegments, UnpinFailuresAreReportedAfterEveryPeerWasLetGo) {
  const plan::Layout layout = small_layout(3);
  PinLog log;
  auto ranks = make_group(layout, &log);
  const auto tokens = tokens_of(ranks);
  for (auto& r : ranks) r->open_peers(tokens);
  for (auto& r : ranks) r->retire_token();
  log.fail_unpins = true;
  try {
    ranks[0]->close_peers();
    FAIL() << "close_peers hid the unpin failures";
  } catch (const std::runtime_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 1's segment: cudaHostUnregister failed"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 2's segment: cudaHostUnregister failed"), std::string::npos) << what;
  }
  EXPECT_EQ(ranks[0]->host_base(1), nullptr);  // unmapped regardless
  EXPECT_EQ(ranks[0]->device_base(2), nullptr);
  log.fail_unpins = false;
  ranks.clear();
  EXPECT_TRUE(log.pinned.empty());
  EXPECT_FALSE(log.unpinned_unmapped_memory);
}

TEST(SharedPinnedSegments, OpeningPeersTwiceIsRefused) {
  const plan::Layout layout = small_layout(2);
  PinLog log;
  auto ranks = make_group(layout, &log);
  const auto tokens = tokens_of(ranks);
  ranks[0]->open_peers(tokens);
  EXPECT_THROW(ranks[0]->open_peers(tokens), std::logic_error);
  EXPECT_EQ(log.pinned.size(), 3u);  // nothing pinned twice
}

}  // namespace
}  // namespace pcie_ar::transport
