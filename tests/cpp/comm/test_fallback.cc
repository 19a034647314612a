// How the fallback awaits a CPU group's work (await_bounded): a work that completes just as a
// slice of the wait runs out is done, not timed out; a work that failed raises its own error; a
// work that never completes is abandoned at the timeout; an interrupt ends the wait at once.
// The works are scripted stand-ins for gloo's, so each interleaving happens every time.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <stdexcept>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "comm/fallback.h"

namespace pcie_ar::comm {
namespace {

// A work whose timed waits run out `slices` times before it completes; on the last of them it
// completes after the slice has already run out (the interleaving the wait must survive), with
// `failure` as its own error when given.
class ScriptedWork : public c10d::Work {
 public:
  explicit ScriptedWork(int slices, std::exception_ptr failure = nullptr)
      : slices_(slices), failure_(std::move(failure)) {}

  bool wait(std::chrono::milliseconds timeout) override {
    ++waits;
    if (timeout != ::kNoTimeout && !isCompleted()) {
      if (slices_-- == 1) finish(failure_);  // completes just after this slice ran out
      TORCH_CHECK(false, "Operation timed out!");
    }
    return Work::wait(timeout);
  }

  int waits = 0;

 private:
  int slices_;
  std::exception_ptr failure_;
};

TEST(FallbackWait, AWorkThatCompletesAsASliceRunsOutIsDone) {
  const Group group{"scripted", 2, 5.0, nullptr};
  ScriptedWork work(3);
  EXPECT_EQ(await_bounded(work, group), GroupWait::kDone);
  EXPECT_EQ(work.waits, 4);  // three slices, then the untimed look at the completed work
}

TEST(FallbackWait, AFailedWorkRaisesItsOwnError) {
  const Group group{"scripted", 2, 5.0, nullptr};
  ScriptedWork work(2, std::make_exception_ptr(std::runtime_error("peer 1 closed the pair")));
  try {
    await_bounded(work, group);
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "peer 1 closed the pair");
  }
}

TEST(FallbackWait, AWorkThatNeverCompletesIsAbandonedAtTheTimeoutOrAnInterrupt) {
  ScriptedWork never(-1);  // its slices run out forever
  const Group bounded{"scripted", 2, 0.05, nullptr};
  EXPECT_EQ(await_bounded(never, bounded), GroupWait::kTimedOut);
  int asked = 0;
  const std::function<bool()> interrupted = [&asked] { return ++asked == 2; };
  const Group interruptible{"scripted", 2, 5.0, &interrupted};
  EXPECT_EQ(await_bounded(never, interruptible), GroupWait::kInterrupted);
  EXPECT_EQ(asked, 2);
}

}  // namespace
}  // namespace pcie_ar::comm
