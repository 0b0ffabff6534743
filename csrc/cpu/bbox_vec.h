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

// The bits of a float vector as int32 lanes (no conversion): one register reinterpreted on x86; at::vec's
// generic bit cast elsewhere.
inline Vec<int32_t> float_bits(const Vec<float>& v) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_castps_si512(v);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_castps_si256(v);
#else
  return at::vec::cast<int32_t>(v);
#endif
}

// exp(y) for y <= 0 (or NaN): every exp on the loss path is of -|x| (the class loss, one per logit: 5.4M
// at b8/640) or of z - max(z) (the DFL softmax, the head decode). double: Sleef's exp (1 ulp), which
// gradcheck's fp64 needs. float: 12 vector operations where at::vec's exp_u20 takes ~20 (it also handles
// y > 0, overflow and underflow to 0). y is clamped to -86 (exp(-86) = 4.5e-38, the smallest value
// returned, so that 2^n below stays a normal float: log1p and sigmoid of anything smaller are 0 to float
// precision anyway). n = round(y / ln 2) comes from the low mantissa bits of y * log2(e) + 1.5 * 2^23 (the
// sum rounds to an integer there), which shifted left by 23 are the exponent bits of 2^n once 127 is added
// to the constant; r = y - n ln 2 with ln 2 split in two (n ln2_hi is exact), in [-ln2/2, ln2/2]; exp(r) a
// degree-5 fit 1 + r(c1 + r(c2 + ...)), minimax in relative error (Lawson's weighted least squares).
// Measured in float against exp in double over 2.1M values of y in [-86, 0]: relative error <= 1.7e-7
// (2.7 ulp).
template <typename T>
inline Vec<T> exp_nonpositive(const Vec<T>& y) {
  return y.exp();
}

template <>
inline Vec<float> exp_nonpositive<float>(const Vec<float>& y) {
  using V = Vec<float>;
  const V magic(12582912.0f + 127.0f);                              // 1.5 * 2^23, + the exponent bias
  const V yc = at::vec::clamp_min(y, V(-86.0f));                     // NaN stays NaN
  const V t = at::vec::fmadd(yc, V(1.44269504088896341f), magic);    // magic + n
  const V n = t - magic;
  V r = at::vec::fmadd(n, V(-0.693145751953125f), yc);               // ln2_hi: 12 zero low bits
  r = at::vec::fmadd(n, V(-1.428606765330187e-06f), r);              // ln2_lo
  V p(0.00829031505f);
  p = at::vec::fmadd(p, r, V(0.0418979302f));
  p = at::vec::fmadd(p, r, V(0.166676357f));
  p = at::vec::fmadd(p, r, V(0.499991506f));
  p = at::vec::fmadd(p, r, V(0.999999702f));
  p = at::vec::fmadd(p, r, V(1.0f));
  const V two_n = at::vec::cast<float>(float_bits(t) << Vec<int32_t>(23));  // (n + 127) << 23
  return p * two_n;
}

// BCE-with-logits pieces of x: sp = max(x, 0) + log1p(exp(-|x|)) (the loss is sp - x*t) and
// sig = sigmoid(x) (the gradient is sig - t), from one exp. The class loss runs this on every logit
// (B*A*C, 5.4M at b8/640), so its cost is counted in instructions and divisions: on Zen 4 a vdivps ymm
// occupies the divider ~5 cycles, and the class loop's whole work is 46 instructions a vector (AVX2).
// float: log1p(e) for e = exp(-|x|) in (0, 1] as 2*atanh(s) = 2s * q(s^2), s = e / (2 + e) in (0, 1/3]:
// q is a degree-4 minimax fit of atanh(s)/s on s^2 in [0, 1/9] (relative error 6.9e-8 evaluated in float,
// the same as the Taylor series to s^13 it replaces, 7.4e-8, with 4 FMAs instead of 6), and full relative
// precision for tiny e (log(1 + e) would lose ~3 digits at e ~ 1e-4); its coefficients are doubled here
// (2q, exact in float), which saves the multiplication 2s. The two quotients s = e / (2 + e) and
// sig = (x >= 0 ? 1 : e) / (1 + e) share one reciprocal r = 1 / ((1 + e)(2 + e)): one division, not two,
// for ~2 ulp more rounding in each (the tests hold gradients to 1e-5 relative).
// double: the plain formulas with Sleef's exp and log1p (1 ulp), which gradcheck's fp64 needs.
template <typename T>
inline void softplus_sigmoid(const Vec<T>& x, Vec<T>& sp, Vec<T>& sig) {
  const Vec<T> zero(T(0)), one(T(1)), two(T(2));
  const Vec<T> pos = x >= zero;  // false for NaN, so NaN reaches sp and sig via e
  if constexpr (std::is_same_v<T, float>) {
    const Vec<T> e = exp_nonpositive<T>(x | Vec<T>(T(-0.0)));  // exp(-|x|): the sign bit set, one OR
    const Vec<T> num = Vec<T>::blendv(e, one, pos);
    const Vec<T> e1 = one + e, e2 = two + e;
    const Vec<T> r = one / (e1 * e2);
    const Vec<T> s = e * e1 * r;
    const Vec<T> s2 = s * s;
    Vec<T> q2(2 * 0.14089596f);  // 2q
    q2 = at::vec::fmadd(q2, s2, Vec<T>(2 * 0.13980540f));
    q2 = at::vec::fmadd(q2, s2, Vec<T>(2 * 0.20012406f));
    q2 = at::vec::fmadd(q2, s2, Vec<T>(2 * 0.33333160f));
    q2 = at::vec::fmadd(q2, s2, Vec<T>(2 * 1.0000000f));
    sp = at::vec::fmadd(s, q2, Vec<T>::blendv(zero, x, pos));  // max(x, 0) + log1p(e)
    sig = num * e2 * r;
  } else {
    const Vec<T> e = exp_nonpositive<T>(x | Vec<T>(T(-0.0)));
    const Vec<T> num = Vec<T>::blendv(e, one, pos);
    sp = at::vec::maximum(x, zero) + e.log1p();
    sig = num / (one + e);
  }
}

// Writes of tens of MB that nothing reads back soon (a backward's fresh gradients: 38 MB at b8/640) go
// around the caches: an ordinary store first reads each line it writes (read-for-ownership), a streaming
// store does not. On a 2-core Intel Xeon (x86-64-v3 build, 1 thread) bbox_loss forward + backward at
// b8/640 went from 17.0 to 15.2 ms (7.0x -> 8.2x its reference; native build 7.1x -> 8.3x). The
// forward's class gradient is read back by the backward and stays an ordinary store (streamed, that
// forward took 25 % longer). Call stream_fence() before another thread may read what was streamed.
template <typename T>
inline void stream_vec(const Vec<T>& v, T* ptr) {  // ptr aligned to 64 bytes
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, float>) return _mm512_stream_ps(ptr, v);
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) return _mm256_stream_ps(ptr, v);
#endif
  v.store(ptr);
}

inline void stream_fence() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

// o[0, n) = x[j] * c, or = c when x is null; streamed from the first 64-byte boundary on.
template <typename T>
inline void write_streamed(T* o, int64_t n, const T* x, T c) {
  using V = Vec<T>;
  constexpr int64_t W = V::size();
  int64_t j = 0;
  for (; j < n && (reinterpret_cast<uintptr_t>(o + j) & 63); ++j) o[j] = x ? x[j] * c : c;
  const V vc(c);
  if (x)
    for (; j + W <= n; j += W) stream_vec<T>(V::loadu(x + j) * vc, o + j);
  else
    for (; j + W <= n; j += W) stream_vec<T>(vc, o + j);
  for (; j < n; ++j) o[j] = x ? x[j] * c : c;
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
