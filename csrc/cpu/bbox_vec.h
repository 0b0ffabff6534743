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

// log1p(e) for e in [0, 1] (e = exp(-|x|) in the class loss). float: 2*atanh(s), s = e / (2 + e) in
// [0, 1/3], odd series to s^15 (relative error < (1/9)^8 / 17 = 1.4e-9, full relative precision for tiny
// e, ~2x cheaper than Sleef's log1pf); double: Sleef's log1p (1 ulp), which gradcheck's fp64 needs.
template <typename T>
inline Vec<T> log1p_unit(const Vec<T>& e) {
  if constexpr (std::is_same_v<T, float>) {
    const Vec<T> s = e / (Vec<T>(2.0f) + e);
    const Vec<T> s2 = s * s;
    Vec<T> q(1.0f / 15.0f);
    q = at::vec::fmadd(q, s2, Vec<T>(1.0f / 13.0f));
    q = at::vec::fmadd(q, s2, Vec<T>(1.0f / 11.0f));
    q = at::vec::fmadd(q, s2, Vec<T>(1.0f / 9.0f));
    q = at::vec::fmadd(q, s2, Vec<T>(1.0f / 7.0f));
    q = at::vec::fmadd(q, s2, Vec<T>(1.0f / 5.0f));
    q = at::vec::fmadd(q, s2, Vec<T>(1.0f / 3.0f));
    q = at::vec::fmadd(q, s2, Vec<T>(1.0f));
    return Vec<T>(2.0f) * s * q;
  } else {
    return e.log1p();
  }
}

// BCE-with-logits pieces of x: sp = max(x, 0) + log1p(exp(-|x|)) (the loss is sp - x*t) and
// sig = sigmoid(x) (the gradient is sig - t), from one exp.
template <typename T>
inline void softplus_sigmoid(const Vec<T>& x, Vec<T>& sp, Vec<T>& sig) {
  const Vec<T> zero(T(0)), one(T(1));
  const Vec<T> e = x.abs().neg().exp_u20();
  sp = at::vec::maximum(x, zero) + log1p_unit<T>(e);
  sig = Vec<T>::blendv(e, one, x >= zero) / (one + e);
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
