// Helpers shared by the CPU kernels of yolofast: explicit SIMD (ATen's Vectorized for the ISA the build
// targets), a thread probe (for the test that the kernels really run on the threads torch has) and float
// exp/log1p that the compiler can vectorise. Include this header before any other: see the SIMD note.
#pragma once

// SIMD: ATen's at::vec::Vectorized<T> (one source for AVX2, AVX-512 and NEON) picks its AVX2/AVX-512 code
// with the macros CPU_CAPABILITY_AVX2 / CPU_CAPABILITY_AVX512, which ATen's own build sets for each of its
// per-ISA kernel copies. An extension that does not set them gets the generic Vectorized (a plain array
// that the optimiser may or may not vectorise). They are set here from what -march (YOLOFAST_CPU_ARCH,
// yolofast/ops/_build.py) enables: x86-64-v3 -> AVX2 (8 floats), x86-64-v4 / native on an AVX-512 CPU ->
// AVX-512 (16 floats); on aarch64 vec128 uses NEON from __aarch64__ alone (4 floats). The namespace stays
// at::vec::CPU_CAPABILITY (the macro CPU_CAPABILITY is left undefined), which is none of libtorch's own
// (DEFAULT, AVX2, AVX512), so no inline function of this library binds to a libtorch copy or vice versa.
#if defined(VECTOR_WIDTH) && !defined(YOLOFAST_SIMD_SELECTED)
#error "include cpu_common.h before any ATen/cpu/vec header: it selects the ISA of at::vec::Vectorized"
#endif
#define YOLOFAST_SIMD_SELECTED 1
#if !defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif
#endif

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace yolofast {

// Bit i set when OpenMP thread i ran a chunk of some kernel's parallel_for. Read and cleared by the
// debug op yolofast::_threads_seen. Without -fopenmp, at::parallel_for (whose OpenMP loop is inlined
// from the header into this extension) silently runs everything on thread 0: this is how a test sees it.
inline std::atomic<uint64_t>& threads_seen_mask() {
  static std::atomic<uint64_t> mask{0};
  return mask;
}

// Floats per SIMD register in this build (16 AVX-512, 8 AVX2, 4 NEON): the debug op yolofast::_simd_lanes
// reports it so a test can check that a build for an ISA really uses that ISA's vectors.
constexpr int64_t simd_float_lanes() { return at::vec::Vectorized<float>::size(); }

// One relaxed atomic OR per parallel_for chunk: negligible next to a chunk's work (>= 1e4 elements).
inline void note_thread() {
  threads_seen_mask().fetch_or(uint64_t{1} << (at::get_thread_num() & 63), std::memory_order_relaxed);
}

// YOLOFAST_POISON_OUTPUTS=1 makes kernels fill their fresh outputs with NaN before computing, so a test
// sees any element a kernel forgets to write (fresh pages from the OS are zero and would hide it). One
// getenv per call: ~100 ns next to a multi-millisecond kernel.
inline bool poison_outputs() {
  const char* v = std::getenv("YOLOFAST_POISON_OUTPUTS");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

// exp(z) for z <= 0, ~1 ulp (Cephes expf: range reduction by ln 2 split into hi + lo, degree-5 polynomial,
// 2^n from the exponent bits). Written so that gcc/clang vectorise loops calling it without -ffast-math:
// std::exp calls libm per element, and gcc 12 does not vectorise floorf without -fno-trapping-math, hence
// rounding by adding and subtracting 1.5 * 2^23. Inputs below -87 are clamped (exp(-87) = 1.6e-38: the
// true value is smaller still, an absolute error nobody can see in a loss term).
inline float exp_nonpos(float z) {
  z = std::max(z, -87.0f);
  const float fx = (z * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(z / ln 2)
  float r = z - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fx) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// log1p(e) for e in [0, 1] as 2*atanh(s), s = e / (2 + e) in [0, 1/3]: the odd series to s^15 leaves a
// relative error < (1/9)^8 / 17 = 1.4e-9, and unlike log(1 + e) it keeps full relative precision for tiny e
// (e = exp(-|x|) is ~1e-4 for a confident background logit; log(1 + e) would lose ~3 digits there).
inline float log1p_unit(float e) {
  const float s = e / (2.0f + e);
  const float s2 = s * s;
  float q = 1.0f / 15.0f;
  q = q * s2 + 1.0f / 13.0f;
  q = q * s2 + 1.0f / 11.0f;
  q = q * s2 + 1.0f / 9.0f;
  q = q * s2 + 1.0f / 7.0f;
  q = q * s2 + 1.0f / 5.0f;
  q = q * s2 + 1.0f / 3.0f;
  q = q * s2 + 1.0f;
  return 2.0f * s * q;
}

}  // namespace yolofast
