// In-place EMA of flat weight buffers, CPU: yolofast::ema_update(Tensor(a!) ema, Tensor model, Tensor decay).
//
// ema = lerp(ema, model, w) with w = 1 - d, exactly as torch.lerp's vectorised CPU kernel evaluates it
// (and so ema_update_ref): |w| < 0.5 -> fma(w, model - ema, ema), else fma(w - 1, model - ema, model).
// One pass, read 2N + write N: memory bound, so the only goals are a single sweep over contiguous
// buffers, both threads streaming, and no temporary. bf16/fp16 are computed in float and rounded once.
//
// Also here: the debug op yolofast::_threads_seen (see cpu_common.h), used by tests/ops/test_build.py.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <bitset>
#include <cmath>

#include "cpu_common.h"

namespace yolofast {
namespace {

// 64 Ki elements (256 KiB of fp32 per buffer) per chunk at least: below that the fork/join of the
// OpenMP team (~several us) costs more than the sweep; a yolov8s state (11.2 M) splits into 2 halves.
constexpr int64_t kGrain = 1 << 16;

template <typename scalar_t, typename model_t>
void ema_lerp(scalar_t* ema, const model_t* model, int64_t n, double w) {
  using opmath_t = at::opmath_type<scalar_t>;
  const opmath_t wt = static_cast<opmath_t>(w);
  const bool small = std::abs(wt) < opmath_t(0.5);
  const opmath_t coeff = small ? wt : wt - opmath_t(1);
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    note_thread();
    if (small) {
#pragma omp simd
      for (int64_t i = b; i < e; ++i) {
        const opmath_t s = static_cast<opmath_t>(ema[i]), t = static_cast<opmath_t>(model[i]);
        ema[i] = static_cast<scalar_t>(std::fma(coeff, t - s, s));
      }
    } else {
#pragma omp simd
      for (int64_t i = b; i < e; ++i) {
        const opmath_t s = static_cast<opmath_t>(ema[i]), t = static_cast<opmath_t>(model[i]);
        ema[i] = static_cast<scalar_t>(std::fma(coeff, t - s, t));
      }
    }
  });
}

void ema_update_cpu(const at::Tensor& ema, const at::Tensor& model, const at::Tensor& decay) {
  TORCH_CHECK(ema.is_floating_point(), "yolofast::ema_update: ema must be floating point, got ",
              ema.scalar_type());
  TORCH_CHECK(model.is_floating_point(), "yolofast::ema_update: model must be floating point, got ",
              model.scalar_type());
  TORCH_CHECK(ema.sizes() == model.sizes(), "yolofast::ema_update: ema ", ema.sizes(), " and model ",
              model.sizes(), " differ in shape");
  TORCH_CHECK(ema.is_contiguous(), "yolofast::ema_update: ema must be contiguous (it is updated in place; "
              "keep the EMA state in one flat buffer)");
  TORCH_CHECK(decay.numel() == 1, "yolofast::ema_update: decay must hold one value, got shape ", decay.sizes());
  // 1 - d in double is exact for a float32 d (or rounds like float32 arithmetic would), so w matches the
  // reference's `1 - decay` in decay's own precision once rounded to the compute type.
  const double w = 1.0 - decay.item<double>();
  const int64_t n = ema.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, ema.scalar_type(), "yolofast_ema_update", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    scalar_t* e = ema.mutable_data_ptr<scalar_t>();
    if (model.scalar_type() == ema.scalar_type()) {
      const auto m = model.contiguous();
      ema_lerp<scalar_t, scalar_t>(e, m.const_data_ptr<scalar_t>(), n, w);
    } else {
      // A model in another dtype is read at the compute precision (as the reference's model.to(...)).
      const auto m = model.to(c10::CppTypeToScalarType<opmath_t>::value).contiguous();
      ema_lerp<scalar_t, opmath_t>(e, m.const_data_ptr<opmath_t>(), n, w);
    }
  });
}

// Number of distinct threads that ran a chunk of any kernel since the last call; clears the record.
int64_t threads_seen(const at::Tensor& /*unused: an op needs a tensor to dispatch on*/) {
  return static_cast<int64_t>(std::bitset<64>(threads_seen_mask().exchange(0)).count());
}

}  // namespace

TORCH_LIBRARY_IMPL(yolofast, CPU, m) {
  m.impl("ema_update", &ema_update_cpu);
  m.impl("_threads_seen", &threads_seen);
}

}  // namespace yolofast
