// CPU emulation of the small part of CUDA that csrc/cuda/*.cu uses, so that tests/ops/test_cuda.py can
// RUN the CUDA kernels on a machine without a GPU and compare them with the reference.
//
// How: the test compiles the .cu files as C++ with this directory first on the include path (so
// <cuda_runtime.h>, <cuda_fp16.h>, ... are these files) after rewriting `k<<<grid, block, smem, st>>>(args)`
// into `yf_emu::launch(grid, block, smem, st, [&] { k(args); })`. A launch runs its blocks one after
// another; the threads of a block are fibers (ucontext) on ONE OS thread, switched at __syncthreads()
// and at every warp shuffle, so barriers, shared memory, warp butterflies and atomics behave as on a GPU
// (in one fixed interleaving). Divergent barriers and shuffles, and invalid launch configurations, abort
// with a message instead of hanging. Not for speed: ~1e6 simple thread switches per second.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

typedef void* cudaStream_t;
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
};

extern dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace yf_emu {
void launch(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, std::function<void()> body);
unsigned char* dynamic_smem();
void block_barrier();
void warp_barrier();
int block_count(int pred);
uint64_t* warp_slots();  // 32 exchange slots of the calling thread's warp
}  // namespace yf_emu

cudaError_t cudaGetLastError();
const char* cudaGetErrorString(cudaError_t e);
cudaError_t cudaMemsetAsync(void* p, int value, size_t n, cudaStream_t stream);

inline void __syncthreads() { yf_emu::block_barrier(); }
inline int __syncthreads_count(int pred) { return yf_emu::block_count(pred); }

template <typename T>
inline T __shfl_xor_sync(unsigned /*mask*/, T v, int lane_mask) {
  static_assert(sizeof(T) <= 8, "emulated shuffles move up to 8 bytes");
  uint64_t* slots = yf_emu::warp_slots();
  const int lane = static_cast<int>(threadIdx.x) & 31;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  slots[lane] = bits;
  yf_emu::warp_barrier();
  bits = slots[lane ^ lane_mask];
  yf_emu::warp_barrier();  // nobody overwrites a slot before its reader has read it
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

// Atomics: the fibers of a launch run on one OS thread, so plain read-modify-write is atomic.
inline int atomicAdd(int* p, int v) { const int o = *p; *p = o + v; return o; }
inline int atomicMax(int* p, int v) { const int o = *p; *p = o > v ? o : v; return o; }
inline int atomicMin(int* p, int v) { const int o = *p; *p = o < v ? o : v; return o; }
inline int atomicOr(int* p, int v) { const int o = *p; *p = o | v; return o; }
inline unsigned long long atomicMax(unsigned long long* p, unsigned long long v) {
  const unsigned long long o = *p; *p = o > v ? o : v; return o;
}
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
  const unsigned long long o = *p; *p = o < v ? o : v; return o;
}
inline unsigned long long __ldcg(const unsigned long long* p) { return *p; }

// Round-to-nearest arithmetic: plain operators, compiled with -ffp-contract=off (no fma contraction).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline float rsqrtf(float a) { return 1.0f / std::sqrt(a); }
inline double rsqrt(double a) { return 1.0 / std::sqrt(a); }

inline int __float_as_int(float x) { int i; std::memcpy(&i, &x, 4); return i; }
inline float __int_as_float(int i) { float x; std::memcpy(&x, &i, 4); return x; }
inline long long __double_as_longlong(double x) { long long i; std::memcpy(&i, &x, 8); return i; }
inline double __longlong_as_double(long long i) { double x; std::memcpy(&x, &i, 8); return x; }

// CUDA's device min/max for int; (int64 code uses yolofast's own helpers).
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
using std::fabs;
using std::floor;
using std::fmax;
using std::fmin;
