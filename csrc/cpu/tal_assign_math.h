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

#include <algorithm>
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

// pow: one value; pow_many: out[i] = pow(x[i], e) for n values (any n), from the same implementation, so
// lane for lane the same results as pow. The assigner calls pow_many once per candidate row, where one call
// of a vector pow per value cost ~30 % of its time (b16/320, 20 GT/img): SLEEF's vector pow computes all
// of a vector's lanes for the price of one.
template <typename T>
struct MathFns {
  T (*pow)(T, T) = nullptr;
  void (*pow_many)(const T* x, T e, T* out, int64_t n) = nullptr;
  const char* pow_name = "libm";
};

namespace detail {

template <typename T>
T libm_pow(T x, T e) {
  return std::pow(x, e);
}

template <typename T>
void libm_pow_many(const T* x, T e, T* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = std::pow(x[i], e);
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

// One vector of the same SLEEF functions: r[l] = pow(in[l], e) for every lane of the 64-byte aligned in/r.
__attribute__((target("avx512f"))) inline void pow_f16_vec(const float* in, float e, float* r) {
  auto f = reinterpret_cast<__m512 (*)(__m512, __m512)>(slot(kPowF16));
  _mm512_store_ps(r, f(_mm512_load_ps(in), _mm512_set1_ps(e)));
}
__attribute__((target("avx2"))) inline void pow_f8_vec(const float* in, float e, float* r) {
  auto f = reinterpret_cast<__m256 (*)(__m256, __m256)>(slot(kPowF8));
  _mm256_store_ps(r, f(_mm256_load_ps(in), _mm256_set1_ps(e)));
}
__attribute__((target("avx512f"))) inline void pow_d8_vec(const double* in, double e, double* r) {
  auto f = reinterpret_cast<__m512d (*)(__m512d, __m512d)>(slot(kPowD8));
  _mm512_store_pd(r, f(_mm512_load_pd(in), _mm512_set1_pd(e)));
}
__attribute__((target("avx2"))) inline void pow_d4_vec(const double* in, double e, double* r) {
  auto f = reinterpret_cast<__m256d (*)(__m256d, __m256d)>(slot(kPowD4));
  _mm256_store_pd(r, f(_mm256_load_pd(in), _mm256_set1_pd(e)));
}

// n values, L lanes at a time through one of the above; the lanes past n compute pow(1, e) and are dropped
// (each lane's result depends on its own input only).
template <typename T, int L, void (*PowVec)(const T*, T, T*)>
void pow_many_by(const T* x, T e, T* out, int64_t n) {
  alignas(64) T in[L], r[L];
  for (int64_t i = 0; i < n; i += L) {
    const int64_t c = std::min<int64_t>(L, n - i);
    for (int64_t l = 0; l < L; ++l) in[l] = l < c ? x[i + l] : T(1);
    PowVec(in, e, r);
    for (int64_t l = 0; l < c; ++l) out[i + l] = r[l];
  }
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
    m.pow_many = &detail::libm_pow_many<T>;
#ifdef YOLOFAST_SLEEF_LOOKUP
    detail::lookup_all();
    using Pow = T (*)(T, T);
    using PowMany = void (*)(const T*, T, T*, int64_t);
    struct Cand {
      const char* name;
      int slot;
      Pow pow;
      PowMany pow_many;
    };
    std::vector<Cand> cands;
    using detail::pow_many_by;
    if constexpr (sizeof(T) == 4)
      cands = {{"sleef_f16", detail::kPowF16, &detail::pow_f16, &pow_many_by<float, 16, detail::pow_f16_vec>},
               {"sleef_f8", detail::kPowF8, &detail::pow_f8, &pow_many_by<float, 8, detail::pow_f8_vec>}};
    else
      cands = {{"sleef_d8", detail::kPowD8, &detail::pow_d8, &pow_many_by<double, 8, detail::pow_d8_vec>},
               {"sleef_d4", detail::kPowD4, &detail::pow_d4, &pow_many_by<double, 4, detail::pow_d4_vec>}};
    at::NoGradGuard no_grad;
    const std::vector<T> x = detail::probe_values<T>();
    const auto dtype = sizeof(T) == 4 ? at::kFloat : at::kDouble;
    const at::Tensor want = at::pow(at::tensor(at::ArrayRef<T>(x), at::TensorOptions().dtype(dtype)), 6.0);
    auto pow6 = [](Pow p) { return [p](T v) { return p(v, T(6)); }; };
    const bool debug = std::getenv("YOLOFAST_TAL_DEBUG") != nullptr;
    const char* type = sizeof(T) == 4 ? "float32" : "float64";
    int64_t best = detail::mismatches(x, want, pow6(m.pow));
    // Every variant this CPU can run is probed (the first of the fewest mismatches wins), and its pow_many
    // must give its pow's value in every lane (n = 4093: whole vectors and a partial one) to be used.
    std::vector<T> many(x.size());
    for (const Cand& c : cands) {
      if (!detail::slot(c.slot)) continue;
      const int64_t n = detail::mismatches(x, want, pow6(c.pow));
      c.pow_many(x.data(), T(6), many.data(), 4093);
      int64_t lanes_differ = 0;
      for (int64_t j = 0; j < 4093; ++j) lanes_differ += !(many[j] == c.pow(x[j], T(6)));
      if (debug)
        std::fprintf(stderr, "yolofast tal_assign: pow (%s) candidate %s: %lld/4096 probe mismatches vs "
                     "at::pow, pow_many differs from pow in %lld/4093\n", type, c.name,
                     static_cast<long long>(n), static_cast<long long>(lanes_differ));
      if (lanes_differ == 0 && n < best) best = n, m.pow = c.pow, m.pow_many = c.pow_many, m.pow_name = c.name;
    }
    if (debug)
      std::fprintf(stderr, "yolofast tal_assign: pow (%s) from %s, %lld/4096 probe mismatches vs at::pow\n",
                   type, m.pow_name, static_cast<long long>(best));
#endif
    return m;
  }();
  return fns;
}

}  // namespace tal
}  // namespace yolofast
