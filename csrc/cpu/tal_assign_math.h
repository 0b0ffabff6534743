// pow exactly as the reference gets it from ATen, so the assigner's aligns are bit-identical to
// reference.tal_assign_ref's and its top-k decisions cannot differ on a near-tie. (atan, the other
// transcendental of CIoU, depends on one box only, so the kernel takes it from at::atan on whole tensors.)
//
// ATen evaluates torch.pow(t, 6.0) on CPU with SLEEF's vector pow (u10), not libm: here libm's powf differs
// from it in 1.8% of inputs by an ulp, which overlap^6 turns into score differences up to ~1e-6 relative.
// libtorch_cpu exports the SLEEF functions; they are looked up at run time (never linked, so a torch without
// them still loads this extension) and the variant that reproduces at::pow on a probe tensor is used. When
// none does (another platform or torch), libm is used and aligns may differ from the reference by an ulp.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) && defined(__linux__)
#include <dlfcn.h>
#include <immintrin.h>
#define YOLOFAST_SLEEF_LOOKUP 1
#endif

namespace yolofast {
namespace tal {

template <typename T>
struct MathFns {
  T (*pow)(T, T) = nullptr;
  const char* pow_name = "libm";
};

namespace detail {

template <typename T>
T libm_pow(T x, T e) {
  return std::pow(x, e);
}

#ifdef YOLOFAST_SLEEF_LOOKUP
// One slot per SLEEF variant; each scalar wrapper broadcasts x into a vector, calls SLEEF, takes lane 0.
inline void*& slot(int i) {
  static void* slots[4] = {};
  return slots[i];
}
enum Slot { kPowF16, kPowF8, kPowD8, kPowD4 };

__attribute__((target("avx512f"))) inline float pow_f16(float x, float e) {
  auto f = reinterpret_cast<__m512 (*)(__m512, __m512)>(slot(kPowF16));
  return _mm512_cvtss_f32(f(_mm512_set1_ps(x), _mm512_set1_ps(e)));
}
__attribute__((target("avx2"))) inline float pow_f8(float x, float e) {
  auto f = reinterpret_cast<__m256 (*)(__m256, __m256)>(slot(kPowF8));
  return _mm256_cvtss_f32(f(_mm256_set1_ps(x), _mm256_set1_ps(e)));
}
__attribute__((target("avx512f"))) inline double pow_d8(double x, double e) {
  auto f = reinterpret_cast<__m512d (*)(__m512d, __m512d)>(slot(kPowD8));
  return _mm512_cvtsd_f64(f(_mm512_set1_pd(x), _mm512_set1_pd(e)));
}
__attribute__((target("avx2"))) inline double pow_d4(double x, double e) {
  auto f = reinterpret_cast<__m256d (*)(__m256d, __m256d)>(slot(kPowD4));
  return _mm256_cvtsd_f64(f(_mm256_set1_pd(x), _mm256_set1_pd(e)));
}

// The library that defines at::get_num_threads is libtorch_cpu; SLEEF lives there.
inline void* torch_cpu_handle() {
  Dl_info info;
  if (!dladdr(reinterpret_cast<void*>(&at::get_num_threads), &info) || !info.dli_fname) return nullptr;
  return dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
}

inline void lookup_all() {
  static const bool done = [] {
    void* h = torch_cpu_handle();
    if (!h) return true;
    const bool avx512 = __builtin_cpu_supports("avx512f");
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const char* names[4] = {"Sleef_powf16_u10", "Sleef_powf8_u10", "Sleef_powd8_u10", "Sleef_powd4_u10"};
    for (int i = 0; i < 4; ++i) {
      const bool wide = i == kPowF16 || i == kPowD8;
      if (wide ? avx512 : avx2) slot(i) = dlsym(h, names[i]);
    }
    return true;
  }();
  (void)done;
}
#endif

// Probe values like the arguments the assigner passes to pow: overlaps in (0, 1]. 4096 elements, a multiple
// of ATen's vector loop step, so at::pow computes every one of them with its vector code.
template <typename T>
std::vector<T> probe_values() {
  std::vector<T> v;
  for (int i = 0; i < 4096; ++i) v.push_back(static_cast<T>((i + 0.37) / 4096.0));
  return v;
}

template <typename T, typename F>
int64_t mismatches(const std::vector<T>& x, const at::Tensor& want, F f) {
  const T* w = want.data_ptr<T>();
  int64_t n = 0;
  for (size_t i = 0; i < x.size(); ++i) n += !(f(x[i]) == w[i]);
  return n;
}

}  // namespace detail

// The pow that reproduces ATen's pow(tensor, scalar) here, found once per dtype (thread-safe static init).
template <typename T>
const MathFns<T>& math_fns() {
  static const MathFns<T> fns = [] {
    MathFns<T> m;
    m.pow = &detail::libm_pow<T>;
#ifdef YOLOFAST_SLEEF_LOOKUP
    detail::lookup_all();
    using Pow = T (*)(T, T);
    struct Cand {
      const char* name;
      int slot;
      Pow pow;
    };
    std::vector<Cand> cands;
    if constexpr (sizeof(T) == 4)
      cands = {{"sleef_f16", detail::kPowF16, &detail::pow_f16},
               {"sleef_f8", detail::kPowF8, &detail::pow_f8}};
    else
      cands = {{"sleef_d8", detail::kPowD8, &detail::pow_d8},
               {"sleef_d4", detail::kPowD4, &detail::pow_d4}};
    at::NoGradGuard no_grad;
    const std::vector<T> x = detail::probe_values<T>();
    const auto dtype = sizeof(T) == 4 ? at::kFloat : at::kDouble;
    const at::Tensor want = at::pow(at::tensor(at::ArrayRef<T>(x), at::TensorOptions().dtype(dtype)), 6.0);
    auto pow6 = [](Pow p) { return [p](T v) { return p(v, T(6)); }; };
    int64_t best = detail::mismatches(x, want, pow6(m.pow));
    for (const Cand& c : cands) {
      if (!best || !detail::slot(c.slot)) continue;
      const int64_t n = detail::mismatches(x, want, pow6(c.pow));
      if (n < best) best = n, m.pow = c.pow, m.pow_name = c.name;
    }
    if (std::getenv("YOLOFAST_TAL_DEBUG"))
      std::fprintf(stderr, "yolofast tal_assign: pow (%s) from %s, %lld/4096 probe mismatches vs at::pow\n",
                   sizeof(T) == 4 ? "float32" : "float64", m.pow_name, static_cast<long long>(best));
#endif
    return m;
  }();
  return fns;
}

}  // namespace tal
}  // namespace yolofast
