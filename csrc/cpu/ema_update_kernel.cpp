// In-place EMA of the weights, CPU (DESIGN §2.3), two overloads of one op:
//   yolofast::ema_update(Tensor(a!) ema, Tensor model, Tensor decay)               one flat buffer pair
//   yolofast::ema_update.multi(Tensor(a!)[] ema, Tensor[] model, Tensor decay)     the model's own tensors
// and the class yolofast::EmaPlan (torch.classes), ModelEMA's whole CPU update step over the .multi sweep.
//
// ema = lerp(ema, model, w) with w = 1 - d, exactly as torch.lerp's vectorised CPU kernel evaluates it
// (and so ema_update_ref): |w| < 0.5 -> fma(w, model - ema, ema), else fma(w - 1, model - ema, model).
// Memory bound (read 2N + write N), so the goals are one sweep, both threads streaming, no temporary:
// explicit SIMD (at::vec, cpu_common.h) and, for .multi, one parallel region over all tensors (like
// _foreach_lerp_ and apex's multi_tensor_apply), split by element count so that each thread streams the
// same number of bytes whatever the tensor sizes. Integer tensors (BN num_batches_tracked) are copied.
// Elementwise: results do not depend on the split or the thread count. bf16/fp16 are computed in float and
// rounded once.
//
// Also here: the debug ops yolofast::_threads_seen and yolofast::_simd_lanes (cpu_common.h), used by
// tests/ops/test_build.py.
#include "cpu_common.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <bitset>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace yolofast {
namespace {

// 64 Ki elements (256 KiB of fp32 per buffer) per thread at least: below that the fork/join of the OpenMP
// team (~several us) costs more than the sweep; a yolov8s state (11.2 M) splits into 2 halves.
constexpr int64_t kGrain = 1 << 16;

template <typename T>
constexpr bool kReduced = std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>;

#if defined(__AVX2__) && defined(__FMA__)
#define YOLOFAST_EMA_YMM 1
// fp32 on x86: 256-bit vectors, in the AVX-512 build too. On the AMD EPYC Zen 4 (1 thread, yolov8s's 298
// tensors, interleaved CPU-time rounds) the same loop in 512-bit vectors took 1.10-1.12x torch's
// _foreach_lerp_ and in 256-bit vectors 0.95x: Zen 4 splits every 512-bit load and store in two, and this
// sweep is bound by the loads and stores in flight, not by arithmetic. Same fma, same result bit for bit.
// Returns the elements done (a multiple of 8); the caller's scalar tail does the rest.
template <bool kSmall>
int64_t lerp_f32_ymm(float* ema, const float* model, int64_t n, float coeff) {
  const __m256 c = _mm256_set1_ps(coeff);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 s = _mm256_loadu_ps(ema + i), t = _mm256_loadu_ps(model + i);
    _mm256_storeu_ps(ema + i, _mm256_fmadd_ps(c, _mm256_sub_ps(t, s), kSmall ? s : t));
  }
  return i;
}
#else
#define YOLOFAST_EMA_YMM 0
#endif

// ema[0, n) = lerp(ema, model, w) with coeff = w (kSmall) or w - 1. scalar_t float/double: one vector per
// step; bf16/fp16: one vector of 16-bit values -> two float vectors, computed, rounded back. model_t is
// scalar_t or (mixed dtypes) the compute type. The scalar tail uses std::fma: the same single rounding as
// the vector fmadd, so the tail equals the body bit for bit.
template <typename scalar_t, typename model_t, bool kSmall>
void lerp_span(scalar_t* ema, const model_t* model, int64_t n, at::opmath_type<scalar_t> coeff) {
  using opmath_t = at::opmath_type<scalar_t>;
  using VecO = at::vec::Vectorized<opmath_t>;
  const VecO c(coeff);
  int64_t i = 0;
#if YOLOFAST_EMA_YMM
  if constexpr (std::is_same_v<scalar_t, float> && std::is_same_v<model_t, float>) {
    i = lerp_f32_ymm<kSmall>(ema, model, n, coeff);
  } else
#endif
  if constexpr (!kReduced<scalar_t>) {
    for (; i + VecO::size() <= n; i += VecO::size()) {
      const VecO s = VecO::loadu(ema + i), t = VecO::loadu(model + i);
      at::vec::fmadd(c, t - s, kSmall ? s : t).store(ema + i);
    }
  } else {
    using VecS = at::vec::Vectorized<scalar_t>;
    for (; i + VecS::size() <= n; i += VecS::size()) {
      auto [s0, s1] = at::vec::convert_to_float<scalar_t>(VecS::loadu(ema + i));
      VecO t0, t1;
      if constexpr (std::is_same_v<model_t, scalar_t>) {
        std::tie(t0, t1) = at::vec::convert_to_float<scalar_t>(VecS::loadu(model + i));
      } else {
        t0 = VecO::loadu(model + i);
        t1 = VecO::loadu(model + i + VecO::size());
      }
      const VecO r0 = at::vec::fmadd(c, t0 - s0, kSmall ? s0 : t0);
      const VecO r1 = at::vec::fmadd(c, t1 - s1, kSmall ? s1 : t1);
      at::vec::convert_from_float<scalar_t>(r0, r1).store(ema + i);
    }
  }
  for (; i < n; ++i) {
    const opmath_t s = static_cast<opmath_t>(ema[i]), t = static_cast<opmath_t>(model[i]);
    ema[i] = static_cast<scalar_t>(std::fma(coeff, t - s, kSmall ? s : t));
  }
}

template <typename scalar_t, typename model_t>
void lerp_any(scalar_t* ema, const model_t* model, int64_t n, double w) {
  using opmath_t = at::opmath_type<scalar_t>;
  const opmath_t wt = static_cast<opmath_t>(w);
  if (std::abs(wt) < opmath_t(0.5))
    lerp_span<scalar_t, model_t, true>(ema, model, n, wt);
  else
    lerp_span<scalar_t, model_t, false>(ema, model, n, wt - opmath_t(1));
}

// One tensor pair as raw memory: ema's elements in storage order (ema is non-overlapping and dense) and the
// model's in the same order (same strides, or a copy laid out like ema).
struct Span {
  void* ema;
  const void* model;
  int64_t n;
  at::ScalarType type;        // ema's dtype
  bool model_opmath;          // the model is read at the compute precision (mixed dtypes)
  int64_t int_bytes;          // > 0: an integer tensor, copied (n * element size bytes)
};

void run_span(const Span& s, int64_t lo, int64_t hi, double w) {
  if (s.int_bytes > 0) {
    const int64_t es = s.int_bytes / std::max<int64_t>(s.n, 1);
    std::memcpy(static_cast<char*>(s.ema) + lo * es, static_cast<const char*>(s.model) + lo * es,
                (hi - lo) * es);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, s.type, "yolofast_ema_update", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    scalar_t* e = static_cast<scalar_t*>(s.ema) + lo;
    if (s.model_opmath)
      lerp_any<scalar_t, opmath_t>(e, static_cast<const opmath_t*>(s.model) + lo, hi - lo, w);
    else
      lerp_any<scalar_t, scalar_t>(e, static_cast<const scalar_t*>(s.model) + lo, hi - lo, w);
  });
}

// All spans as one sequence of elements, cut into one contiguous range per thread: equal element counts
// per thread (the spans are all fp32 in a normal model, so equal bytes too).
void run_spans(const std::vector<Span>& spans, double w) {
  sweep_ranges(spans.size(), [&](size_t i) { return spans[i].n; }, kGrain,
               [&](size_t i, int64_t lo, int64_t hi) { run_span(spans[i], lo, hi, w); });
}

// 1 - d in double is exact for a float32 d (or rounds like float32 arithmetic would), so w matches the
// reference's `1 - decay` in decay's own precision once rounded to the compute type.
double weight_of(const at::Tensor& decay) {
  TORCH_CHECK(decay.numel() == 1, "yolofast::ema_update: decay must hold one value, got shape ", decay.sizes());
  return 1.0 - decay.item<double>();
}

void ema_update_cpu(const at::Tensor& ema, const at::Tensor& model, const at::Tensor& decay) {
  TORCH_CHECK(ema.is_floating_point(), "yolofast::ema_update: ema must be floating point, got ",
              ema.scalar_type());
  TORCH_CHECK(model.is_floating_point(), "yolofast::ema_update: model must be floating point, got ",
              model.scalar_type());
  TORCH_CHECK(ema.sizes() == model.sizes(), "yolofast::ema_update: ema ", ema.sizes(), " and model ",
              model.sizes(), " differ in shape");
  TORCH_CHECK(ema.is_contiguous(), "yolofast::ema_update: ema must be contiguous (it is updated in place; "
              "keep the EMA state in one flat buffer, or pass lists of tensors)");
  const double w = weight_of(decay);
  const auto op_type = ema.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const bool same = model.scalar_type() == ema.scalar_type();
  // A model in another dtype is read at the compute precision (as the reference's model.to(...)).
  const at::Tensor m = same ? model.contiguous() : model.to(op_type).contiguous();
  run_spans({Span{ema.mutable_data_ptr(), m.const_data_ptr(), ema.numel(), ema.scalar_type(), !same, 0}}, w);
}

// The spans of one multi-tensor update, every pair checked; `keep` holds the model copies that a pair in
// another layout or dtype needs, alive until the sweep ends.
void collect_spans(at::TensorList ema, at::TensorList model, std::vector<Span>& spans,
                   std::vector<at::Tensor>& keep) {
  TORCH_CHECK(ema.size() == model.size(), "yolofast::ema_update: ", ema.size(), " ema tensors but ",
              model.size(), " model tensors; pass the same tensors of one architecture, in the same order");
  spans.clear();
  keep.clear();
  spans.reserve(ema.size());
  for (size_t i = 0; i < ema.size(); ++i) {
    const at::Tensor& e = ema[i];
    const at::Tensor& m = model[i];
    TORCH_CHECK(e.device().is_cpu() && m.device().is_cpu(), "yolofast::ema_update: tensor ", i,
                " is not on the CPU (ema ", e.device(), ", model ", m.device(), ")");
    TORCH_CHECK(e.sizes() == m.sizes(), "yolofast::ema_update: tensor ", i, ": ema ", e.sizes(), " and model ",
                m.sizes(), " differ in shape");
    TORCH_CHECK(e.is_non_overlapping_and_dense(), "yolofast::ema_update: ema tensor ", i,
                " is not dense (strides ", e.strides(), "); it is updated in place as one block of memory");
    TORCH_CHECK(e.is_floating_point() == m.is_floating_point(), "yolofast::ema_update: tensor ", i,
                ": ema is ", e.scalar_type(), " but model ", m.scalar_type());
    if (e.numel() == 0) continue;
    const bool fp = e.is_floating_point();
    const auto op_type = e.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    // The model's tensor is read where it lies when it has ema's layout and dtype (the normal case: the EMA
    // is a deep copy of the model); otherwise from one copy laid out like ema.
    const bool same_type = m.scalar_type() == e.scalar_type();
    const auto want = (same_type || !fp) ? e.scalar_type() : op_type;
    const at::Tensor* src = &m;
    if (!same_type || m.strides() != e.strides()) {
      keep.push_back(at::empty_like(e, e.options().dtype(want)));
      keep.back().copy_(m);
      src = &keep.back();
    }
    spans.push_back(Span{e.mutable_data_ptr(), src->const_data_ptr(), e.numel(), e.scalar_type(),
                         fp && !same_type, fp ? 0 : e.numel() * static_cast<int64_t>(e.element_size())});
  }
}

void ema_update_multi_cpu(at::TensorList ema, at::TensorList model, const at::Tensor& decay) {
  const double w = weight_of(decay);
  std::vector<Span> spans;
  std::vector<at::Tensor> keep;
  collect_spans(ema, model, spans, keep);
  run_spans(spans, w);
}

// ModelEMA's CPU update, prepared once per model: the whole step is one call with one argument.
// Why not ema_update.multi: a call of that op from Python converts its 2 x 355 tensors (yolov8s) into the
// dispatcher's boxed lists and, as the model's tensors are parameters that require grad, passes them through
// autograd's fallback; on the AMD EPYC Zen 4 at 1 thread those cost ~70 us + ~170 us a step, next to a
// ~3.6 ms sweep, and the Python decay (6 small tensor ops) another ~12 us. The plan keeps the two tensor
// lists (the model's own parameter objects: a tensor whose .data is replaced, as Module.to() does, is read
// from its new memory; ModelEMA rebuilds the plan when a slot holds a new object), and each step:
//   updates += 1;  d = decay * (1 - exp(-updates / tau));  ema = lerp(ema, model, 1 - d)
// with d computed in double in the order of ModelEMA.decay_tensor(), so both paths agree bit for bit.
// Every pair is re-checked each step (~5 us): cheap, and a changed shape is an error, never a bad read.
struct EmaPlan : torch::CustomClassHolder {
  std::vector<at::Tensor> ema, model;
  double decay, tau;
  std::vector<Span> spans;  // reused: no allocation per step
  std::vector<at::Tensor> keep;

  EmaPlan(std::vector<at::Tensor> ema_, std::vector<at::Tensor> model_, double decay_, double tau_)
      : ema(std::move(ema_)), model(std::move(model_)), decay(decay_), tau(tau_) {
    collect_spans(ema, model, spans, keep);  // reports a bad pair now, not at the first step
  }

  void step(const at::Tensor& updates) {
    TORCH_CHECK(updates.device().is_cpu() && updates.scalar_type() == at::kLong && updates.numel() == 1,
                "yolofast::EmaPlan.step: updates must be a 1-element int64 CPU tensor, got ",
                updates.scalar_type(), " ", updates.sizes(), " on ", updates.device());
    int64_t* u = updates.mutable_data_ptr<int64_t>();
    *u += 1;
    const double d = decay * (1.0 - std::exp(-static_cast<double>(*u) / tau));
    collect_spans(ema, model, spans, keep);
    run_spans(spans, 1.0 - d);
    keep.clear();
    // As an in-place ATen op would: autograd's saved-tensor check sees that these tensors changed.
    for (const at::Tensor& e : ema)
      if (!e.is_inference()) torch::autograd::impl::bump_version(e);
    if (!updates.is_inference()) torch::autograd::impl::bump_version(updates);
  }
};

// Number of distinct threads that ran a chunk of any kernel since the last call; clears the record.
int64_t threads_seen(const at::Tensor& /*unused: an op needs a tensor to dispatch on*/) {
  return static_cast<int64_t>(std::bitset<64>(threads_seen_mask().exchange(0)).count());
}

int64_t simd_lanes(const at::Tensor& /*unused*/) { return simd_float_lanes(); }

}  // namespace

TORCH_LIBRARY_IMPL(yolofast, CPU, m) {
  m.impl("ema_update", &ema_update_cpu);
  m.impl("ema_update.multi", &ema_update_multi_cpu);
  m.impl("_threads_seen", &threads_seen);
  m.impl("_simd_lanes", &simd_lanes);
}

TORCH_LIBRARY_FRAGMENT(yolofast, m) {
  m.class_<EmaPlan>("EmaPlan")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, double, double>())
      .def("step", &EmaPlan::step);
}

}  // namespace yolofast
