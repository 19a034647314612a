// The CPU device's memory model (memory.h): per-thread store buffers delivered late and out of
// order in the weak modes, immediate accesses in the strict one.
#include "transport/executors/cuda/cpu/memory.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

#include "transport/executors/cuda/cpu/state.h"

namespace pcie_ar::transport::cpu_device {
namespace {

using detail::Cta;
using detail::Piece;
using detail::Thread;

static_assert(std::atomic_ref<uint64_t>::is_always_lock_free);
static_assert(std::atomic_ref<uint32_t>::is_always_lock_free);

// A thread holds at most this many pieces: past it, random pieces land until half remain, so a
// long loop without a poll still moves its stores out (late, but never never).
constexpr size_t kMaxPending = 48;

void require_words(const void* addr, int bytes) {
  if (bytes <= 0 || bytes % 8 != 0 || reinterpret_cast<uintptr_t>(addr) % 8 != 0) {
    throw std::logic_error("cpu device: memory is accessed in aligned 8-byte words, got " +
                           std::to_string(bytes) + " bytes at an address " +
                           std::to_string(reinterpret_cast<uintptr_t>(addr) % 8) +
                           " bytes past an 8-byte boundary");
  }
}

uint64_t read_piece(uintptr_t addr, int piece_bytes, std::memory_order order) {
  if (piece_bytes == 8)
    return std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(addr)).load(order);
  return std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(addr)).load(order);
}

void write_piece(uintptr_t addr, uint64_t value, int piece_bytes, std::memory_order order) {
  if (piece_bytes == 8) {
    std::atomic_ref<uint64_t>(*reinterpret_cast<uint64_t*>(addr)).store(value, order);
  } else {
    std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(addr))
        .store(static_cast<uint32_t>(value), order);
  }
}

uint64_t piece_of(const uint8_t* bytes, int piece_bytes) {
  uint64_t v = 0;
  std::memcpy(&v, bytes, piece_bytes);
  return v;
}

// Every piece lands as a release store and every load acquires, so a reader that sees a piece
// also sees everything that landed before it from the same OS thread: the order of landing is
// the order the weak mode chose, and C++ then keeps it (and ThreadSanitizer sees it).
void land(const Cta& cta, const Piece& piece) {
  write_piece(piece.addr, piece.value, cta.piece_bytes, std::memory_order_release);
}

// Delivers the pieces of `pending` for which `pick` says so, in random order.
template <typename Pick>
void deliver_list(Cta& cta, std::vector<Piece>& pending, Pick pick) {
  for (size_t i = pending.size(); i > 1; --i) {  // shuffle: delivery order is random
    std::swap(pending[i - 1], pending[cta.random.next() % i]);
  }
  size_t kept = 0;
  for (size_t i = 0; i < pending.size(); ++i) {
    if (pick()) {
      land(cta, pending[i]);
    } else {
      pending[kept++] = pending[i];
    }
  }
  pending.resize(kept);
}

template <typename Pick>
void deliver_observed(Cta& cta, Pick pick) {
  for (auto it = cta.observed.begin(); it != cta.observed.end();) {
    if (pick()) {
      land(cta, Piece{it->first, it->second});
      it = cta.observed.erase(it);
    } else {
      ++it;
    }
  }
}

// Everything this thread stored, and everything its CTA handed over at a barrier, lands.
void deliver_for_release(Cta& cta, Thread& thread) {
  deliver_list(cta, thread.pending, [] { return true; });
  deliver_observed(cta, [] { return true; });
}

// The weak CTA of the calling thread, or null (strict mode, or outside a kernel).
Cta* weak_cta() {
  Cta* cta = detail::current_cta();
  return cta != nullptr && cta->weak ? cta : nullptr;
}

void buffer(Cta& cta, Thread& thread, uintptr_t addr, uint64_t value) {
  cta.observed.erase(addr);  // superseded: this thread's newer store comes after it
  for (Piece& piece : thread.pending) {
    if (piece.addr == addr) {
      piece.value = value;
      return;
    }
  }
  thread.pending.push_back(Piece{addr, value});
  if (thread.pending.size() > kMaxPending) {
    size_t excess = thread.pending.size() - kMaxPending / 2;
    deliver_list(cta, thread.pending, [&] {
      if (excess == 0) return false;
      --excess;
      return true;
    });
  }
}

// The newest value of the piece at `addr` this thread may see before memory has it.
bool forwarded(const Cta& cta, const Thread& thread, uintptr_t addr, uint64_t& value) {
  for (const Piece& piece : thread.pending) {
    if (piece.addr == addr) {
      value = piece.value;
      return true;
    }
  }
  if (const auto it = cta.observed.find(addr); it != cta.observed.end()) {
    value = it->second;
    return true;
  }
  return false;
}

// Strict mode, or outside a kernel: every word lands at once, in order.
void write_now(uintptr_t base, const uint8_t* in, int bytes) {
  for (int i = 0; i < bytes; i += 8) {
    write_piece(base + i, piece_of(in + i, 8), 8, std::memory_order_release);
  }
}

}  // namespace

void store(void* addr, const void* value, int bytes) {
  require_words(addr, bytes);
  const auto* in = static_cast<const uint8_t*>(value);
  const auto base = reinterpret_cast<uintptr_t>(addr);
  Cta* cta = weak_cta();
  if (cta == nullptr) return write_now(base, in, bytes);
  for (int i = 0; i < bytes; i += cta->piece_bytes) {
    buffer(*cta, *cta->running, base + i, piece_of(in + i, cta->piece_bytes));
  }
}

void store_u32(void* addr, uint32_t value) {
  const auto base = reinterpret_cast<uintptr_t>(addr);
  if (base % 4 != 0) {
    throw std::logic_error("cpu device: a 4-byte store at an address " + std::to_string(base % 4) +
                           " bytes past a 4-byte boundary");
  }
  Cta* cta = weak_cta();
  if (cta == nullptr) return write_piece(base, value, 4, std::memory_order_release);
  if (cta->piece_bytes == 4) return buffer(*cta, *cta->running, base, value);
  const uintptr_t word = base & ~uintptr_t{7};
  if (const auto it = cta->observed.find(word); it != cta->observed.end()) {
    land(*cta, Piece{it->first, it->second});
    cta->observed.erase(it);
  }
  std::vector<Piece>& pending = cta->running->pending;
  for (auto it = pending.begin(); it != pending.end(); ++it) {
    if (it->addr == word) {
      land(*cta, *it);
      pending.erase(it);
      break;
    }
  }
  write_piece(base, value, 4, std::memory_order_release);
}

void store_release(void* addr, const void* value, int bytes) {
  require_words(addr, bytes);
  const auto* in = static_cast<const uint8_t*>(value);
  const auto base = reinterpret_cast<uintptr_t>(addr);
  Cta* cta = weak_cta();
  if (cta == nullptr) return write_now(base, in, bytes);
  deliver_for_release(*cta, *cta->running);
  // The pieces of one release land in random order: only 8 bytes are single-copy atomic.
  const int n = bytes / cta->piece_bytes;
  const int first = static_cast<int>(cta->random.next() % n);
  for (int k = 0; k < n; ++k) {
    const int i = ((first + k) % n) * cta->piece_bytes;
    cta->observed.erase(base + i);
    write_piece(base + i, piece_of(in + i, cta->piece_bytes), cta->piece_bytes,
                std::memory_order_release);
  }
}

void load(const void* addr, void* out, int bytes) {
  require_words(addr, bytes);
  auto* dst = static_cast<uint8_t*>(out);
  const auto base = reinterpret_cast<uintptr_t>(addr);
  Cta* cta = weak_cta();
  const int piece_bytes = cta != nullptr ? cta->piece_bytes : 8;
  for (int i = 0; i < bytes; i += 8) {
    // Memory is read 8 bytes at a time (an 8-byte load is single-copy atomic), then whatever
    // this thread may see early replaces its pieces.
    uint64_t word = read_piece(base + i, 8, std::memory_order_acquire);
    if (cta != nullptr) {
      for (int j = 0; j < 8; j += piece_bytes) {
        uint64_t piece = 0;
        if (forwarded(*cta, *cta->running, base + i + j, piece)) {
          std::memcpy(reinterpret_cast<uint8_t*>(&word) + j, &piece, piece_bytes);
        }
      }
    }
    std::memcpy(dst + i, &word, 8);
  }
}

void fence_system() {
  if (Cta* cta = weak_cta()) deliver_for_release(*cta, *cta->running);
  if (const Cta* cta = detail::current_cta(); cta != nullptr && cta->grid->options.fence_ns != 0) {
    std::this_thread::sleep_for(std::chrono::nanoseconds(cta->grid->options.fence_ns));
  }
  detail::stop_if_trapped();  // another CTA's trap, landed while the fence took its time
}

uint32_t atomic_cas(uint32_t* addr, uint32_t compare, uint32_t value) {
  std::atomic_ref<uint32_t>(*addr).compare_exchange_strong(compare, value,
                                                           std::memory_order_seq_cst);
  return compare;  // the old value: compare_exchange writes it back on failure
}

namespace detail {

void deliver_some(Cta& cta, Thread& thread) {
  if (cta.weak) deliver_list(cta, thread.pending, [&] { return cta.random.one_in(2); });
}

void deliver_some_observed(Cta& cta) {
  if (!cta.weak) return;
  deliver_observed(cta, [&] { return cta.random.one_in(4); });
  deliver_list(cta, cta.orphaned, [&] { return cta.random.one_in(4); });
}

void hand_over_at_barrier(Cta& cta) {
  if (!cta.weak) return;
  for (Thread& thread : cta.threads) {
    for (const Piece& piece : thread.pending) cta.observed[piece.addr] = piece.value;
    thread.pending.clear();
  }
}

void hand_over_at_exit(Cta& cta, Thread& thread) {
  cta.orphaned.insert(cta.orphaned.end(), thread.pending.begin(), thread.pending.end());
  thread.pending.clear();
}

void deliver_everything(Cta& cta) {
  for (Thread& thread : cta.threads) deliver_list(cta, thread.pending, [] { return true; });
  deliver_observed(cta, [] { return true; });
  deliver_list(cta, cta.orphaned, [] { return true; });
}

}  // namespace detail
}  // namespace pcie_ar::transport::cpu_device
