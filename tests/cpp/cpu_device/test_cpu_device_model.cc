// The CPU device's execution and memory models on their own: barriers anywhere, spin loops that
// never starve, traps that end the grid, and a weak mode whose reorderings a litmus test can
// observe (so the executor suites run in it mean something).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "transport/executors/cuda/cpu/device.h"
#include "transport/executors/cuda/cpu/memory.h"

namespace pcie_ar::transport::cpu_device {
namespace {

uint64_t load_u64(const uint64_t* p) {
  uint64_t v = 0;
  load(p, &v, 8);
  return v;
}
void store_u64(uint64_t* p, uint64_t v) { store(p, &v, 8); }
void release_u64(uint64_t* p, uint64_t v) { store_release(p, &v, 8); }

TEST(CpuDeviceModel, EveryThreadHasItsIndexAndTheShape) {
  std::vector<std::atomic<int>> seen(3 * 2 * 64);
  const auto status = launch(Dim3{3, 2, 1}, Dim3{64, 1, 1}, DeviceOptions{}, [&] {
    const Dim3 t = thread_idx(), b = block_idx(), bd = block_dim(), gd = grid_dim();
    EXPECT_EQ(bd.x, 64u);
    EXPECT_EQ(gd.x, 3u);
    EXPECT_EQ(gd.y, 2u);
    seen[(b.y * gd.x + b.x) * bd.x + t.x].fetch_add(1);
  });
  EXPECT_EQ(status, LaunchStatus::kCompleted);
  for (auto& s : seen) EXPECT_EQ(s.load(), 1);
}

TEST(CpuDeviceModel, BarriersOrderSharedMemoryAnywhereInTheCode) {
  // Each round every thread writes its slot, meets the others, then reads its neighbour's: a
  // barrier inside a loop and inside a branch that every thread takes.
  std::atomic<int> wrong{0};
  launch(Dim3{2, 1, 1}, Dim3{48, 1, 1}, DeviceOptions{}, [&] {
    static thread_local int shared[48];
    const int i = static_cast<int>(thread_idx().x);
    for (int round = 0; round < 20; ++round) {
      shared[i] = round * 100 + i;
      sync_threads();
      if (shared[(i + 1) % 48] != round * 100 + (i + 1) % 48) wrong.fetch_add(1);
      if (round % 2 == 0)
        sync_threads();
      else
        sync_threads();
    }
  });
  EXPECT_EQ(wrong.load(), 0);
}

TEST(CpuDeviceModel, ASpinLoopThatPollsNeverStarvesTheThreadItWaitsFor) {
  // Thread 0 spins on a word the last thread of the CTA writes only after its own busy work;
  // on one OS thread that works only because a poll lets the others run.
  uint64_t flag = 0;
  launch(Dim3{1, 1, 1}, Dim3{64, 1, 1}, DeviceOptions{MemoryModel::kWeak, 3}, [&] {
    const unsigned i = thread_idx().x;
    if (i == 0) {
      while (load_u64(&flag) != 7) poll();
    } else if (i == 63) {
      for (int k = 0; k < 100; ++k) poll();
      release_u64(&flag, 7);
    }
  });
  EXPECT_EQ(flag, 7u);
}

TEST(CpuDeviceModel, CtasRunConcurrentlyAndWaitOnEachOther) {
  // CTA b waits for CTA b + 1: only resident, concurrent CTAs finish this.
  std::vector<uint64_t> flags(8, 0);
  launch(Dim3{8, 1, 1}, Dim3{32, 1, 1}, DeviceOptions{MemoryModel::kWeak, 5}, [&] {
    const unsigned b = block_idx().x;
    if (thread_idx().x != 0) return;
    if (b + 1 < 8) {
      while (load_u64(&flags[b + 1]) == 0) poll();
    }
    release_u64(&flags[b], 1);
  });
  for (uint64_t f : flags) EXPECT_EQ(f, 1u);
}

TEST(CpuDeviceModel, ATrapEndsTheWholeGrid) {
  uint64_t never = 0;
  const auto status = launch(Dim3{4, 1, 1}, Dim3{32, 1, 1}, DeviceOptions{}, [&] {
    if (block_idx().x == 2 && thread_idx().x == 5) trap();
    while (load_u64(&never) == 0) poll();  // everyone else would spin forever
  });
  EXPECT_EQ(status, LaunchStatus::kTrapped);
}

TEST(CpuDeviceModel, AnExceptionInAKernelIsRethrownByTheLaunch) {
  EXPECT_THROW(launch(Dim3{2, 1, 1}, Dim3{8, 1, 1}, DeviceOptions{},
                      [&] {
                        uint64_t x = 0;
                        if (thread_idx().x == 3) store(reinterpret_cast<uint8_t*>(&x) + 4, &x, 8);
                      }),
               std::logic_error);
}

TEST(CpuDeviceModel, RejectsShapesAGpuCannotLaunch) {
  EXPECT_THROW(launch(Dim3{0, 1, 1}, Dim3{32, 1, 1}, DeviceOptions{}, [] {}),
               std::invalid_argument);
  EXPECT_THROW(launch(Dim3{1, 1, 1}, Dim3{2048, 1, 1}, DeviceOptions{}, [] {}),
               std::invalid_argument);
  EXPECT_THROW(launch(Dim3{1, 1, 1}, Dim3{32, 2, 1}, DeviceOptions{}, [] {}),
               std::invalid_argument);
}

// ---------------------------------------------------------------- the memory model

// Message passing: CTA 0 writes 16 data words, then the flag; CTA 1 waits for the flag and reads
// the data. Returns how many of `trials` launches read a stale data word. The two CTAs overlap
// for certain (the writer starts once the reader polls, and stays until it has read): a CTA that
// ends delivers everything it still holds, so a reader whose OS thread started late (as under
// TSan) would otherwise find every store landed and make the negative controls read 0.
int stale_reads(MemoryModel memory, bool release_flag, bool barrier_before_flag, int trials) {
  int stale = 0;
  for (int trial = 0; trial < trials; ++trial) {
    std::vector<uint64_t> data(16, 0);
    uint64_t flag = 0;
    std::atomic<int> bad{0};
    std::atomic<bool> reader_started{false};
    std::atomic<int> reads_done{0};
    launch(Dim3{2, 1, 1}, Dim3{16, 1, 1}, DeviceOptions{memory, static_cast<uint64_t>(trial) + 1},
           [&] {
             const unsigned i = thread_idx().x;
             if (block_idx().x == 0) {
               while (!reader_started.load()) poll();
               store_u64(&data[i], 1000 + i);
               if (barrier_before_flag) sync_threads();
               if (i == 0) {
                 for (int k = 0; k < 4; ++k) poll();  // the others' stores may still be pending
                 if (release_flag) {
                   release_u64(&flag, 1);
                 } else {
                   store_u64(&flag, 1);
                 }
                 while (reads_done.load() < 16) poll();
               }
             } else {
               reader_started.store(true);
               while (load_u64(&flag) == 0) poll();
               if (load_u64(&data[i]) != 1000 + i) bad.fetch_add(1);
               reads_done.fetch_add(1);
             }
           });
    stale += bad.load() > 0;
  }
  return stale;
}

TEST(CpuDeviceModel, StrictStoresLandInProgramOrder) {
  EXPECT_EQ(stale_reads(MemoryModel::kStrict, false, true, 30), 0);
}

TEST(CpuDeviceModel, WeakModeDeliversAnUnorderedFlagBeforeTheData) {
  // The negative control of the model itself: without a release the reader can see the flag
  // first. If this ever reads 0 the weak mode proves nothing.
  EXPECT_GT(stale_reads(MemoryModel::kWeak, false, true, 60), 0);
}

TEST(CpuDeviceModel, AReleaseAfterABarrierPublishesTheWholeCta) {
  EXPECT_EQ(stale_reads(MemoryModel::kWeak, true, true, 60), 0);
}

TEST(CpuDeviceModel, AReleaseWithoutABarrierPublishesOnlyItsOwnThread) {
  EXPECT_GT(stale_reads(MemoryModel::kWeak, true, false, 60), 0);
}

// An 8-byte word written by one store is never seen half old, half new in the weak mode; with
// 4-byte pieces it is. Returns the launches in which the reader saw a torn word.
int torn_reads(MemoryModel memory, int trials) {
  int torn = 0;
  for (int trial = 0; trial < trials; ++trial) {
    std::vector<uint64_t> words(32, 0);
    uint64_t done = 0;
    std::atomic<int> bad{0};
    launch(Dim3{2, 1, 1}, Dim3{32, 1, 1}, DeviceOptions{memory, static_cast<uint64_t>(trial) + 7},
           [&] {
             const unsigned i = thread_idx().x;
             if (block_idx().x == 0) {
               store_u64(&words[i], 0x1111111122222222ull * (i + 1));
               sync_threads();
               if (i == 0) release_u64(&done, 1);
             } else {
               for (;;) {
                 const uint64_t w = load_u64(&words[i]);
                 if (w != 0 && w != 0x1111111122222222ull * (i + 1)) bad.fetch_add(1);
                 if (w != 0 && load_u64(&done) != 0) break;
                 poll();
               }
             }
           });
    torn += bad.load() > 0;
  }
  return torn;
}

TEST(CpuDeviceModel, EightBytePiecesAreSingleCopyAtomic) {
  EXPECT_EQ(torn_reads(MemoryModel::kWeak, 40), 0);
}

TEST(CpuDeviceModel, FourBytePiecesTear) { EXPECT_GT(torn_reads(MemoryModel::kWeakTear4, 40), 0); }

TEST(CpuDeviceModel, AThreadReadsItsOwnAndItsBarrierMatesPendingStores) {
  std::vector<uint64_t> words(64, 0);
  std::atomic<int> wrong{0};
  launch(Dim3{1, 1, 1}, Dim3{64, 1, 1}, DeviceOptions{MemoryModel::kWeak, 11}, [&] {
    const unsigned i = thread_idx().x;
    store_u64(&words[i], i + 1);
    if (load_u64(&words[i]) != i + 1) wrong.fetch_add(1);  // its own store, pending or not
    sync_threads();
    if (load_u64(&words[(i + 1) % 64]) != (i + 1) % 64 + 1) wrong.fetch_add(1);
  });
  EXPECT_EQ(wrong.load(), 0);
  for (unsigned i = 0; i < 64; ++i) EXPECT_EQ(words[i], i + 1);  // all landed by the end
}

TEST(CpuDeviceModel, ANewerStoreIsNeverOvertakenByAnOlderOne) {
  // Coherence: the pending older value of a word must not land after the newer one.
  std::vector<uint64_t> words(8, 0);
  launch(Dim3{1, 1, 1}, Dim3{8, 1, 1}, DeviceOptions{MemoryModel::kWeak, 13}, [&] {
    const unsigned i = thread_idx().x;
    for (uint64_t v = 1; v <= 100; ++v) {
      store_u64(&words[i], v);
      if (v % 7 == 0) poll();
      if (v % 13 == 0) sync_threads();
    }
  });
  for (uint64_t w : words) EXPECT_EQ(w, 100u);
}

TEST(CpuDeviceModel, CompareAndSwapReturnsTheOldValue) {
  uint32_t claim = 0;
  std::atomic<int> winners{0};
  launch(Dim3{4, 1, 1}, Dim3{16, 1, 1}, DeviceOptions{MemoryModel::kWeak, 17}, [&] {
    if (atomic_cas(&claim, 0u, 1u) == 0u) winners.fetch_add(1);
  });
  EXPECT_EQ(winners.load(), 1);
  EXPECT_EQ(claim, 1u);
}

}  // namespace
}  // namespace pcie_ar::transport::cpu_device
