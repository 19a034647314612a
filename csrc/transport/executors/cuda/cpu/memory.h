// The CPU device's memory: how the primitives' loads and stores of device-visible memory (slots,
// flags, LL words, generation counters; peers' memory too) behave under the chosen MemoryModel
// (cpu/device.h). Shared memory and kernel parameters are ordinary C++ memory and do not come
// here.
//
// Every access is to 8-byte aligned memory in whole 8-byte words (store_u32 excepted). Memory
// itself is only ever touched through lock-free atomics, so peers in other processes (POSIX shared
// memory) and ThreadSanitizer see well-defined accesses:
//   strict   a store lands at once (release order), a load reads memory (acquire order)
//   weak     a store that the PTX model does not order (st.cg, st.volatile) is buffered in its
//            thread in pieces (8 bytes; 4 in kWeakTear4) and delivered later, in random order:
//            when the buffer fills, when the thread polls or reaches a barrier, between the
//            CTA's turns. A newer store to a pending piece replaces it (coherence). A barrier
//            hands every thread's pending pieces to the CTA (what bar.sync makes every thread
//            of the CTA observe); a release store or a system fence delivers the thread's and
//            the CTA's pending pieces first, then itself. A load sees the thread's own pending
//            pieces, then the CTA's, then memory.
// Outside a kernel every access is immediate.
#pragma once

#include <cstdint>

namespace pcie_ar::transport::cpu_device {

// st.global.cg / st.volatile: ordered by nothing but the thread's later release or fence.
void store(void* addr, const void* value, int bytes);
// st.global.cg.u32: 4 bytes at a 4-byte boundary (the fused epilogue's quantised output of an
// fp32 vector). Buffered like store() where pieces are 4 bytes (kWeakTear4). Where they are 8, the
// other half of the word may be another thread's pending store, so this half cannot wait in a
// piece of its own: it lands at once, after whatever this thread and its CTA still hold for that
// word (older stores land first: coherence), one of the orders the weak modes allow.
void store_u32(void* addr, uint32_t value);
// st.release.sys: everything this thread has stored (and, past a barrier, its CTA) lands first.
// The pieces of one release store land in random order (a 16-byte store is not single-copy
// atomic across its halves).
void store_release(void* addr, const void* value, int bytes);
// Any load (ld.cg, ld.cv, ld.volatile, ld.acquire.sys).
void load(const void* addr, void* out, int bytes);
// __threadfence_system / fence.sc.sys.
void fence_system();
// atomicCAS on a 32-bit word (the failure claim): immediate, sequentially consistent.
uint32_t atomic_cas(uint32_t* addr, uint32_t compare, uint32_t value);

}  // namespace pcie_ar::transport::cpu_device
