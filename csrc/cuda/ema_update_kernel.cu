// In-place EMA of flat weight buffers on the GPU (DESIGN §2.3); spec reference.ema_update_ref.
//
// ema = lerp(ema, model, w), w = 1 - d, exactly as torch.lerp evaluates it (CPU and CUDA alike):
// |w| < 0.5 -> fma(w, model - ema, ema), else fma(w - 1, model - ema, model); bf16/fp16 are computed in
// float and rounded once (to nearest even). One launch over the whole flat buffer: each thread moves one
// 16-byte vector of ema (read 2N, write N elements). The decay is read by the kernel from the device
// tensor, so the update needs no host sync and can live inside a captured CUDA graph.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda_common.cuh"
#include "cuda_launchers.h"

namespace yolofast {
namespace cuda {
namespace {

constexpr int kThreads = 256;

// Storage <-> compute type.
template <typename X>
struct Cvt {
  static __device__ __forceinline__ X load(X v) { return v; }
  template <typename Op>
  static __device__ __forceinline__ X store(Op v) {
    return static_cast<X>(v);
  }
};
template <>
struct Cvt<__half> {
  static __device__ __forceinline__ float load(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half store(float v) { return __float2half_rn(v); }
};
template <>
struct Cvt<__nv_bfloat16> {
  static __device__ __forceinline__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

__device__ __forceinline__ float fma_op(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fma_op(double a, double b, double c) { return fma(a, b, c); }

struct WeightSrc {
  EmaWeight kind;
  const void* ptr;
  double w_host;
};

// w = 1 - d formed in the decay's own precision, then rounded once to the compute type (as the
// reference's `(1 - decay).to(cdt)`).
template <typename Op>
__device__ __forceinline__ Op read_weight(const WeightSrc& s) {
  switch (s.kind) {
    case EmaWeight::kDecayF32:
      return static_cast<Op>(__fsub_rn(1.0f, *static_cast<const float*>(s.ptr)));
    case EmaWeight::kDecayF64:
      return static_cast<Op>(__dsub_rn(1.0, *static_cast<const double*>(s.ptr)));
    case EmaWeight::kWeightF64:
      return static_cast<Op>(*static_cast<const double*>(s.ptr));
    default:
      return static_cast<Op>(s.w_host);
  }
}

template <typename X, int N>
struct alignas(sizeof(X) * N) Pack {
  X v[N];
};

template <typename E, typename Mdl, typename Op, int VEC>
__global__ void __launch_bounds__(kThreads) ema_kernel(E* __restrict__ ema, const Mdl* __restrict__ model,
                                                       int64_t n, const WeightSrc ws) {
  const Op w = read_weight<Op>(ws);
  const bool small = fabs(w) < Op(0.5);
  const Op coeff = small ? w : w - Op(1);
  const int64_t i0 = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * VEC;
  if (i0 >= n) return;
  if (VEC > 1 && i0 + VEC <= n) {
    Pack<E, VEC> e = *reinterpret_cast<const Pack<E, VEC>*>(ema + i0);
    const Pack<Mdl, VEC> m = *reinterpret_cast<const Pack<Mdl, VEC>*>(model + i0);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const Op s = Cvt<E>::load(e.v[j]), t = static_cast<Op>(Cvt<Mdl>::load(m.v[j]));
      e.v[j] = Cvt<E>::store(fma_op(coeff, t - s, small ? s : t));
    }
    *reinterpret_cast<Pack<E, VEC>*>(ema + i0) = e;
  } else {
    for (int64_t i = i0; i < n && i < i0 + VEC; ++i) {
      const Op s = Cvt<E>::load(ema[i]), t = static_cast<Op>(Cvt<Mdl>::load(model[i]));
      ema[i] = Cvt<E>::store(fma_op(coeff, t - s, small ? s : t));
    }
  }
}

inline bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <typename E, typename Mdl, typename Op>
cudaError_t launch_typed(const EmaArgs& a, cudaStream_t st) {
  constexpr int VEC = 16 / sizeof(E);  // one 16-byte vector of ema per thread
  const WeightSrc ws{a.weight_kind, a.weight_ptr, a.w_host};
  E* ema = static_cast<E*>(a.ema);
  const Mdl* model = static_cast<const Mdl*>(a.model);
  if (aligned(ema, VEC * sizeof(E)) && aligned(model, VEC * sizeof(Mdl))) {
    const int64_t blocks = ceil_div(ceil_div(a.n, VEC), kThreads);
    ema_kernel<E, Mdl, Op, VEC><<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(ema, model, a.n, ws);
  } else {  // a view into the middle of a buffer: element by element
    const int64_t blocks = ceil_div(a.n, kThreads);
    ema_kernel<E, Mdl, Op, 1><<<static_cast<unsigned>(blocks), kThreads, 0, st>>>(ema, model, a.n, ws);
  }
  YF_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace

cudaError_t ema_update_launch(const EmaArgs& a, cudaStream_t stream) {
  if (a.n <= 0) return cudaSuccess;
  const bool same = a.model_type == a.ema_type;
  switch (a.ema_type) {
    case EmaType::kFloat:
      return launch_typed<float, float, float>(a, stream);
    case EmaType::kDouble:
      return launch_typed<double, double, double>(a, stream);
    case EmaType::kHalf:
      return same ? launch_typed<__half, __half, float>(a, stream) : launch_typed<__half, float, float>(a, stream);
    case EmaType::kBFloat16:
      return same ? launch_typed<__nv_bfloat16, __nv_bfloat16, float>(a, stream)
                  : launch_typed<__nv_bfloat16, float, float>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace cuda
}  // namespace yolofast
