// Device helpers shared by yolofast's CUDA kernels. No torch headers here (see cuda_launchers.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace yolofast {
namespace cuda {

// Return the first launch error of a launcher (the binding turns it into a TORCH_CHECK).
#define YF_CHECK_LAUNCH()                          \
  do {                                             \
    const cudaError_t yf_err_ = cudaGetLastError(); \
    if (yf_err_ != cudaSuccess) return yf_err_;    \
  } while (0)

#define YF_RETURN_IF_ERROR(expr)                 \
  do {                                           \
    const cudaError_t yf_err_ = (expr);          \
    if (yf_err_ != cudaSuccess) return yf_err_;  \
  } while (0)

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// int64 min/max/clamp usable on host and device (CUDA's min/max overloads are ambiguous for `long`).
__host__ __device__ __forceinline__ int64_t i64min(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t i64max(int64_t a, int64_t b) { return a > b ? a : b; }
__host__ __device__ __forceinline__ int64_t i64clamp(int64_t v, int64_t lo, int64_t hi) {
  return i64min(i64max(v, lo), hi);
}

// IEEE round-to-nearest arithmetic that nvcc never contracts into an fma, whatever -fmad says: the
// assigner's top-k and conflict decisions hinge on exact ties, so its float results must equal torch's
// op-by-op rounding (one rounding per elementwise op) bit for bit.
template <typename T>
struct RN;

template <>
struct RN<float> {
  static __device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
  static __device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
  static __device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
  static __device__ __forceinline__ float div(float a, float b) { return __fdiv_rn(a, b); }
  static __device__ __forceinline__ float sqrt(float a) { return __fsqrt_rn(a); }
  static __device__ __forceinline__ float rsqrt(float a) { return ::rsqrtf(a); }
  static __device__ __forceinline__ float atan(float a) { return ::atanf(a); }
  static __device__ __forceinline__ float pow(float a, float b) { return ::powf(a, b); }
};

template <>
struct RN<double> {
  static __device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
  static __device__ __forceinline__ double sub(double a, double b) { return __dsub_rn(a, b); }
  static __device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
  static __device__ __forceinline__ double div(double a, double b) { return __ddiv_rn(a, b); }
  static __device__ __forceinline__ double sqrt(double a) { return __dsqrt_rn(a); }
  static __device__ __forceinline__ double rsqrt(double a) { return ::rsqrt(a); }
  static __device__ __forceinline__ double atan(double a) { return ::atan(a); }
  static __device__ __forceinline__ double pow(double a, double b) { return ::pow(a, b); }
};

template <typename T>
__device__ __forceinline__ bool is_nan(T x) {
  return x != x;
}

// torch.minimum / torch.maximum: NaN if either argument is NaN (fminf would drop it).
template <typename T>
__device__ __forceinline__ T nan_min(T a, T b) {
  return (is_nan(a) || is_nan(b)) ? a + b : (a < b ? a : b);
}
template <typename T>
__device__ __forceinline__ T nan_max(T a, T b) {
  return (is_nan(a) || is_nan(b)) ? a + b : (a > b ? a : b);
}

// clamp(x, min=0) as torch: NaN stays NaN.
template <typename T>
__device__ __forceinline__ T clamp0(T x) {
  return x < T(0) ? T(0) : x;
}

// The bits of x >= 0 (or NaN) as an unsigned integer that orders like x; the sign bit is cleared so that
// -0.0 and 0.0 are one key. Exact, so atomicMax on these keys is order independent.
__device__ __forceinline__ uint64_t ordered_bits(float x) {
  return static_cast<uint64_t>(static_cast<uint32_t>(__float_as_int(x)) & 0x7FFFFFFFu);
}
__device__ __forceinline__ uint64_t ordered_bits(double x) {
  return static_cast<uint64_t>(__double_as_longlong(x)) & 0x7FFFFFFFFFFFFFFFull;
}
template <typename T>
__device__ __forceinline__ T from_ordered_bits(uint64_t b);
template <>
__device__ __forceinline__ float from_ordered_bits<float>(uint64_t b) {
  return __int_as_float(static_cast<int>(static_cast<uint32_t>(b)));
}
template <>
__device__ __forceinline__ double from_ordered_bits<double>(uint64_t b) {
  return __longlong_as_double(static_cast<long long>(b));
}

__device__ __forceinline__ unsigned long long atomic_max_u64(uint64_t* p, uint64_t v) {
  return atomicMax(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
}

// Butterfly reductions over a full warp: every lane ends with the same value, and the order of the
// operations is fixed (a+b == b+a bitwise), so the result is deterministic.
template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, m);
  return v;
}
template <typename T>
__device__ __forceinline__ T warp_max(T v) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    const T o = __shfl_xor_sync(0xFFFFFFFFu, v, m);
    v = o > v ? o : v;
  }
  return v;
}

}  // namespace cuda
}  // namespace yolofast
