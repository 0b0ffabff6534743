// ATen's Vectorized<T> for the loss-path kernels. The ISA (AVX2 / AVX-512 / NEON) is selected once, in
// cpu_common.h, from what -march (YOLOFAST_CPU_ARCH) enables: without that selection Vectorized<float> is
// vec_base.h's generic array with scalar loops, at the mercy of the auto-vectoriser (gcc 12 left the old
// class-loss loop scalar on an AVX2 CPU).
#pragma once

#include "cpu_common.h"

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512)
// Fails when vec.h was included before this header without the macros (the generic 8-lane fallback).
static_assert(at::vec::Vectorized<float>::size() == 16, "include bbox_vec.h before any ATen header");
#endif

namespace yolofast {

template <typename T>
using Vec = at::vec::Vectorized<T>;

// BCE-with-logits pieces of x: sp = max(x, 0) + log1p(exp(-|x|)) (the loss is sp - x*t) and
// sig = sigmoid(x) (the gradient is sig - t), from one exp. The class loss runs this on every logit
// (B*A*C, 5.4M at b8/640), so its cost is counted in divisions: on Zen 4 a vdivps ymm occupies the divider
// ~5 cycles, as long as the rest of one vector's work.
// float: log1p(e) for e = exp(-|x|) in (0, 1] as 2*atanh(s) = 2s * q(s^2), s = e / (2 + e) in (0, 1/3]:
// q is a degree-4 minimax fit of atanh(s)/s on s^2 in [0, 1/9] (relative error 6.9e-8 evaluated in float,
// the same as the Taylor series to s^13 it replaces, 7.4e-8, with 4 FMAs instead of 6), and full relative
// precision for tiny e (log(1 + e) would lose ~3 digits at e ~ 1e-4). The two quotients s = e / (2 + e) and
// sig = (x >= 0 ? 1 : e) / (1 + e) share one reciprocal r = 1 / ((1 + e)(2 + e)): one division, not two,
// for ~2 ulp more rounding in each (the tests hold gradients to 1e-5 relative).
// double: the plain formulas with Sleef's log1p (1 ulp), which gradcheck's fp64 needs.
template <typename T>
inline void softplus_sigmoid(const Vec<T>& x, Vec<T>& sp, Vec<T>& sig) {
  const Vec<T> zero(T(0)), one(T(1)), two(T(2));
  const Vec<T> e = (x | Vec<T>(T(-0.0))).exp_u20();  // exp(-|x|): the sign bit set, one OR
  const Vec<T> pos = x >= zero;                       // false for NaN, so NaN reaches sp and sig via e
  const Vec<T> num = Vec<T>::blendv(e, one, pos);
  if constexpr (std::is_same_v<T, float>) {
    const Vec<T> e1 = one + e, e2 = two + e;
    const Vec<T> r = one / (e1 * e2);
    const Vec<T> s = e * e1 * r;
    const Vec<T> s2 = s * s;
    Vec<T> q(0.14089596f);
    q = at::vec::fmadd(q, s2, Vec<T>(0.13980540f));
    q = at::vec::fmadd(q, s2, Vec<T>(0.20012406f));
    q = at::vec::fmadd(q, s2, Vec<T>(0.33333160f));
    q = at::vec::fmadd(q, s2, Vec<T>(1.0000000f));
    sp = at::vec::fmadd(two * s, q, Vec<T>::blendv(zero, x, pos));  // max(x, 0) + log1p(e)
    sig = num * e2 * r;
  } else {
    sp = at::vec::maximum(x, zero) + e.log1p();
    sig = num / (one + e);
  }
}

// The register width (bits) of the Vectorized<T> implementation compiled in, 0 for the generic fallback.
inline int64_t vec_isa() {
#if defined(CPU_CAPABILITY_AVX512)
  return 512;
#elif defined(CPU_CAPABILITY_AVX2)
  return 256;
#elif defined(__aarch64__)
  return 128;
#else
  return 0;
#endif
}

}  // namespace yolofast
