// The floating-point environment the host executor computes in: IEEE round-to-nearest-even with
// subnormals, the GPU's __fadd_rn, whatever mode the calling thread set.
//
// The host executor sums in the caller's thread, and torch.set_flush_denormal(True) turns on x86's
// flush-to-zero (FTZ: a subnormal result becomes a zero of its sign) and denormals-are-zero (DAZ:
// a subnormal operand counts as zero) in that thread. Under them a bf16 or fp32 sum would lose
// its subnormals, and a negative subnormal sum would come out -0, which a lamport writer stores as
// +0 (plan::ll_dense_word): the chunk's owner would keep -0 and its peers receive +0. A rounding
// mode other than nearest (fesetround) would change every fp32 add. So a call runs in the default
// environment and gives the caller's back: on x86 one read of MXCSR when the caller's mode is the
// default (the usual case), a write and a restore when it is not; elsewhere the C library's
// default environment (fesetenv), kept and restored around the call.
#pragma once

#include <cfenv>
#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace pcie_ar::transport {

class DefaultFloatEnv {
 public:
#if defined(__x86_64__) || defined(__i386__)
  // MXCSR's control bits: DAZ (6), the exception masks (7-12), rounding (13-14), FTZ (15). Bits
  // 0-5 are the sticky exception flags, which the call may set and the caller keeps.
  static constexpr unsigned kControl = 0xffc0u;
  static constexpr unsigned kDefault = 0x1f80u;  // every exception masked, nearest, no FTZ/DAZ

  DefaultFloatEnv() : saved_(_mm_getcsr()) {
    if ((saved_ & kControl) != kDefault) _mm_setcsr((saved_ & ~kControl) | kDefault);
  }
  ~DefaultFloatEnv() {
    if ((saved_ & kControl) != kDefault)
      _mm_setcsr((_mm_getcsr() & ~kControl) | (saved_ & kControl));
  }

 private:
  unsigned saved_;
#else
  DefaultFloatEnv() {
    std::fegetenv(&saved_);
    std::fesetenv(FE_DFL_ENV);
  }
  ~DefaultFloatEnv() { std::fesetenv(&saved_); }

 private:
  std::fenv_t saved_;
#endif

 public:
  DefaultFloatEnv(const DefaultFloatEnv&) = delete;
  DefaultFloatEnv& operator=(const DefaultFloatEnv&) = delete;
};

}  // namespace pcie_ar::transport
