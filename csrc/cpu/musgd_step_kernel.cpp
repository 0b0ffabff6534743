// yolofast::ns_orthogonalize.musgd(...) -> bool, CPU: a whole MuSGD step (YOLO11_YOLO26.md §5.3; the
// semantics: yolofast/optim/musgd.py's multi-tensor path, which this equals bit for bit) in one op call:
//   pass 1 (parallel over all tensors): Muon M <- mu*M + (1-mu)*g and the Nesterov look-ahead
//           U = mu*M + (1-mu)*g written, cast to the compute dtype, straight into its shape group's batch
//           (in NCHW column order whatever the strides); plain SGD for the non-Muon groups;
//   NS5 of every shape group (csrc/common/ns_groups.h: the norm, the bmm/baddbmm products, ATen's GEMM);
//   pass 2 (parallel): p <- p - lr*muon*sigma*O, then the SGD part on the updated p with its own buffer V.
// Why: the same step as 11 torch._foreach_* calls plus the op's per-matrix gathers and scatters reads and
// writes the 2.55 M Muon values of yolo26n ~25 times (~30 ms a step at 1 thread on the AMD EPYC Zen 4, next
// to ~70 ms of matmuls); here each value of p, g, M, V is read once or twice and written at most twice.
//
// Every product and sum rounds as the ATen op it replaces: mul_(mu) one rounding, add_(x, alpha) one fma
// (ATen's CPU add with alpha is fma(x, alpha, self), tails included), scalars rounded to float from the
// Python double (-(lr * weight) formed in double). Returns false, touching nothing, where this fast path
// does not apply (a tensor not float32, not dense, strides that differ between p, g and the buffers, a
// Muon tensor whose rows are not blocks of memory): the caller then runs the multi-tensor path.
// No contraction of a product and a sum into one fma in this file: the step's V <- mu*V + g' rounds twice
// (the reference's mul_ then add_), and GCC's default -ffp-contract=fast would fuse it (also in vector
// code, whose operators GCC sees as plain arithmetic), moving the buffers by an ulp from the second step on.
// Before every include, so the inlined ATen vector operators are compiled under the same setting.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "cpu_common.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "../common/ns_groups.h"

namespace yolofast {
namespace {

using Vec = at::vec::Vectorized<float>;
using VecB = at::vec::Vectorized<at::BFloat16>;
// 32 Ki elements per thread at least: below that the fork/join of the OpenMP team costs more than the pass.
constexpr int64_t kGrain = 1 << 15;

// One tensor's constants, rounded to float as ATen rounds a Python scalar for a float32 tensor.
struct Coeffs {
  float mu = 0, one_minus_mu = 0, decay = 0, lr_muon = 0, lr_sgd = 0, sigma = 1;  // lr_*: -(lr * weight)
  bool nesterov = false, has_decay = false;
};

struct Item {
  float* p = nullptr;
  const float* g = nullptr;
  float* m = nullptr;  // momentum_buffer
  float* v = nullptr;  // Muon: momentum_buffer_SGD
  int64_t n = 0, rows = 0, cols = 0;
  std::vector<int32_t> perm;  // Muon, rows not in NCHW order: in-row memory offset -> NCHW column
  Coeffs k;
  int64_t batch = -1, slot = 0;  // Muon: its shape group and its place there
};

// The NCHW column of each in-row memory offset of a tensor whose rows are blocks of memory (channels_last:
// (kh, kw, in) -> in*kh*kw + ...); empty when that is the identity.
std::vector<int32_t> row_permutation(const at::Tensor& t) {
  const int64_t d = t.dim(), cols = t.numel() / t.size(0);
  bool identity = true;
  for (int64_t k = d - 1, want = 1; k >= 1; --k) {
    if (t.size(k) != 1 && t.stride(k) != want) identity = false;
    want *= t.size(k);
  }
  if (identity) return {};
  std::vector<int32_t> perm(cols);
  std::vector<int64_t> idx(d, 0);
  for (int64_t col = 0; col < cols; ++col) {  // col in NCHW order; idx its index over dims 1..d-1
    int64_t mem = 0;
    for (int64_t k = 1; k < d; ++k) mem += idx[k] * t.stride(k);
    perm[mem] = static_cast<int32_t>(col);
    for (int64_t k = d - 1; k >= 1 && ++idx[k] == t.size(k); --k) idx[k] = 0;
  }
  return perm;
}

bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  return b.layout() == at::kStrided && b.device().is_cpu() && b.scalar_type() == at::kFloat &&
         b.sizes() == a.sizes() && b.strides() == a.strides();
}

// Whether a tensor can be swept in memory order: float32, dense; a Muon one with rows as memory blocks.
bool fits(const at::Tensor& p, bool muon) {
  if (p.layout() != at::kStrided || !p.device().is_cpu() || p.scalar_type() != at::kFloat) return false;
  if (!p.is_non_overlapping_and_dense()) return false;
  if (!muon || p.numel() == 0) return true;
  return p.dim() >= 2 && (p.size(0) == 1 || p.stride(0) == p.numel() / p.size(0)) &&
         p.numel() / p.size(0) <= INT32_MAX;
}

// ---------------------------------------------------------------------------------------- pass 1
template <typename X>
inline void store_x(X* dst, const Vec& a, const Vec& b) {
  if constexpr (std::is_same_v<X, float>) {
    a.store(dst);
    b.store(dst + Vec::size());
  } else {
    at::vec::convert_from_float<at::BFloat16>(a, b).store(dst);
  }
}

// Muon momentum over memory offsets [lo, hi) of item t; U goes to x (its group's batch, contiguous).
template <typename X>
void momentum_span(const Item& t, X* x, int64_t lo, int64_t hi) {
  const Coeffs& k = t.k;
  const Vec mu(k.mu), omm(k.one_minus_mu);
  for (int64_t off = lo; off < hi;) {
    const int64_t r = off / t.cols, a = off - r * t.cols, b = std::min(hi - r * t.cols, t.cols);
    const float* g = t.g + r * t.cols;
    float* m = t.m + r * t.cols;
    X* xr = x + (t.slot * t.rows + r) * t.cols;
    int64_t i = a;
    if (t.perm.empty()) {
      for (; i + 2 * Vec::size() <= b; i += 2 * Vec::size()) {
        Vec u[2];
        for (int h = 0; h < 2; ++h) {
          const int64_t j = i + h * Vec::size();
          const Vec gv = Vec::loadu(g + j);
          const Vec mv = at::vec::fmadd(gv, omm, Vec::loadu(m + j) * mu);
          mv.store(m + j);
          u[h] = k.nesterov ? at::vec::fmadd(gv, omm, mv * mu) : mv;
        }
        store_x(xr + i, u[0], u[1]);
      }
    }
    for (; i < b; ++i) {
      const float mv = std::fma(g[i], k.one_minus_mu, m[i] * k.mu);
      m[i] = mv;
      const float u = k.nesterov ? std::fma(g[i], k.one_minus_mu, mv * k.mu) : mv;
      xr[t.perm.empty() ? i : t.perm[i]] = static_cast<X>(u);
    }
    off = r * t.cols + b;
  }
}

// p <- p + lr_sgd*(g' + mu*V) with g' = g + decay*p, V <- mu*V + g' (Nesterov; V itself without), over
// [lo, hi) of p, g, V: the SGD step of a plain group (V = momentum_buffer) and of a Muon group (after O).
// kMuon: first p <- p + lr_muon*(sigma*O) (O: the Newton–Schulz result of this Muon tensor).
template <bool kMuon>
inline void sgd_vec(const Coeffs& k, float* p, const float* g, float* v, int64_t i, const Vec& o) {
  Vec pv = Vec::loadu(p + i);
  if constexpr (kMuon) pv = at::vec::fmadd(k.sigma != 1.f ? o * Vec(k.sigma) : o, Vec(k.lr_muon), pv);
  const Vec gv = Vec::loadu(g + i);
  const Vec gd = k.has_decay ? at::vec::fmadd(pv, Vec(k.decay), gv) : gv;
  const Vec vv = Vec::loadu(v + i) * Vec(k.mu) + gd;
  vv.store(v + i);
  const Vec step = k.nesterov ? at::vec::fmadd(vv, Vec(k.mu), gd) : vv;
  at::vec::fmadd(step, Vec(k.lr_sgd), pv).store(p + i);
}

template <bool kMuon>
inline void sgd_one(const Coeffs& k, float* p, const float* g, float* v, int64_t i, float o) {
  float pv = p[i];
  if constexpr (kMuon) pv = std::fma(k.sigma != 1.f ? o * k.sigma : o, k.lr_muon, pv);
  const float gd = k.has_decay ? std::fma(pv, k.decay, g[i]) : g[i];
  const float vv = v[i] * k.mu + gd;
  v[i] = vv;
  const float step = k.nesterov ? std::fma(vv, k.mu, gd) : vv;
  p[i] = std::fma(step, k.lr_sgd, pv);
}

void sgd_span(const Item& t, int64_t lo, int64_t hi) {
  int64_t i = lo;
  const Vec unused(0.f);
  for (; i + Vec::size() <= hi; i += Vec::size()) sgd_vec<false>(t.k, t.p, t.g, t.m, i, unused);
  for (; i < hi; ++i) sgd_one<false>(t.k, t.p, t.g, t.m, i, 0.f);
}

// ---------------------------------------------------------------------------------------- pass 2
// O of item t read from its group's result y (a (G, r, c) tensor or its transposed view), then the update.
template <typename X>
void update_span(const Item& t, const at::Tensor& y, int64_t lo, int64_t hi) {
  const X* yb = y.const_data_ptr<X>() + t.slot * y.stride(0);
  const int64_t s1 = y.stride(1), s2 = y.stride(2);
  const bool direct = t.perm.empty() && s2 == 1;
  for (int64_t off = lo; off < hi;) {
    const int64_t r = off / t.cols, a = off - r * t.cols, b = std::min(hi - r * t.cols, t.cols);
    const int64_t base = r * t.cols;
    const X* yr = yb + r * s1;
    int64_t i = a;
    if (direct) {
      for (; i + 2 * Vec::size() <= b; i += 2 * Vec::size()) {
        Vec o0, o1;
        if constexpr (std::is_same_v<X, float>) {
          o0 = Vec::loadu(yr + i);
          o1 = Vec::loadu(yr + i + Vec::size());
        } else {
          std::tie(o0, o1) = at::vec::convert_to_float<at::BFloat16>(VecB::loadu(yr + i));
        }
        sgd_vec<true>(t.k, t.p + base, t.g + base, t.v + base, i, o0);
        sgd_vec<true>(t.k, t.p + base, t.g + base, t.v + base, i + Vec::size(), o1);
      }
    }
    for (; i < b; ++i) {
      const int64_t col = t.perm.empty() ? i : t.perm[i];
      sgd_one<true>(t.k, t.p + base, t.g + base, t.v + base, i, static_cast<float>(yr[col * s2]));
    }
    off = base + b;
  }
}

// Runs fn(item, lo, hi) over the elements of `items`, cut into one contiguous range per thread.
template <typename F>
void sweep(const std::vector<const Item*>& items, const F& fn) {
  sweep_ranges(items.size(), [&](size_t i) { return items[i]->n; }, kGrain,
               [&](size_t i, int64_t lo, int64_t hi) { fn(*items[i], lo, hi); });
}

Coeffs coeffs_of(double lr, double mu, double decay, bool nesterov, double weight_muon, double weight_sgd,
                 double sigma) {
  Coeffs k;
  k.mu = static_cast<float>(mu);
  k.one_minus_mu = static_cast<float>(1.0 - mu);
  k.decay = static_cast<float>(decay);
  k.has_decay = decay != 0.0;
  k.lr_muon = static_cast<float>(-(lr * weight_muon));
  k.lr_sgd = static_cast<float>(-(lr * weight_sgd));
  k.sigma = static_cast<float>(sigma);
  k.nesterov = nesterov;
  return k;
}

struct Hyper {
  at::IntArrayRef counts;
  at::ArrayRef<double> lr, momentum, decay;
  at::IntArrayRef nesterov, use_muon;  // 0/1 per group
  double muon, sgd;
};

// The items of the step, or false when a tensor does not fit the fast path (nothing touched yet).
bool collect(at::TensorList params, at::TensorList grads, at::TensorList bufs, at::TensorList bufs_sgd,
             const Hyper& h, std::vector<Item>& items, std::vector<at::Tensor>& muon_p) {
  const size_t ng = h.counts.size();
  TORCH_CHECK(h.lr.size() == ng && h.momentum.size() == ng && h.decay.size() == ng && h.nesterov.size() == ng &&
              h.use_muon.size() == ng, "ns_orthogonalize.musgd: one lr, momentum, weight_decay, nesterov and "
              "use_muon per group (", ng, " counts)");
  TORCH_CHECK(grads.size() == params.size() && bufs.size() == params.size(),
              "ns_orthogonalize.musgd: params, grads and bufs differ in length");
  size_t at_p = 0, at_v = 0;
  for (size_t gi = 0; gi < ng; ++gi) {
    const bool muon = h.use_muon[gi] != 0;
    for (int64_t j = 0; j < h.counts[gi]; ++j, ++at_p) {
      TORCH_CHECK(at_p < params.size() && (!muon || at_v < bufs_sgd.size()),
                  "ns_orthogonalize.musgd: the group counts exceed the tensors given");
      const at::Tensor& p = params[at_p];
      if (!fits(p, muon) || !same_layout(p, grads[at_p]) || !same_layout(p, bufs[at_p])) return false;
      Item t;
      if (muon && !same_layout(p, bufs_sgd[at_v])) return false;
      if (muon) t.v = bufs_sgd[at_v++].mutable_data_ptr<float>();
      t.p = p.mutable_data_ptr<float>();
      t.g = grads[at_p].const_data_ptr<float>();
      t.m = bufs[at_p].mutable_data_ptr<float>();
      t.n = p.numel();
      const double sigma = muon ? std::sqrt(std::max(1.0, static_cast<double>(p.size(-2)) /
                                                          static_cast<double>(p.size(-1)))) : 1.0;
      t.k = coeffs_of(h.lr[gi], h.momentum[gi], h.decay[gi], h.nesterov[gi] != 0, muon ? h.muon : 0.0,
                      muon ? h.sgd : 1.0, sigma);
      if (muon) {
        if (t.n == 0) continue;
        t.rows = p.size(0);
        t.cols = t.n / t.rows;
        t.perm = row_permutation(p);
        t.batch = static_cast<int64_t>(muon_p.size());  // the index in muon_p until the groups are known
        muon_p.push_back(p);
      }
      items.push_back(std::move(t));
    }
  }
  TORCH_CHECK(at_p == params.size() && at_v == bufs_sgd.size(),
              "ns_orthogonalize.musgd: the group counts cover ", at_p, " of ", params.size(), " tensors and ",
              at_v, " of ", bufs_sgd.size(), " second buffers");
  return true;
}

// NS5 of every group. With several threads, whole groups run side by side, one per thread (largest first,
// each taking the next when done), their products single-threaded, instead of each product being split
// across the threads: yolo26n's 41 groups are 615 products of 16x27 to 256x1152, and splitting each one
// costs a fork/join and a copy per call (baddbmm copies its addend) that, on the 2-core AMD EPYC Zen 4,
// made the step at 2 threads 1.34x the 2-thread bmm floor in CPU time. A group costing more than
// 1/(2 x threads) of the whole (none in yolo26n/s) still runs alone on all threads first. The products
// are the same whatever the thread count (oneDNN's bf16 GEMM over every YOLO11/YOLO26 Muon shape, 1 vs
// 2 threads: equal bit for bit), so this changes no value.
std::vector<at::Tensor> orthogonalize_groups(const std::vector<at::Tensor>& batches, int64_t steps, double eps) {
  const int64_t n = static_cast<int64_t>(batches.size()), threads = at::get_num_threads();
  std::vector<at::Tensor> ys(n);
  std::vector<double> cost(n);
  double total = 0;
  for (int64_t k = 0; k < n; ++k) {
    const double m = static_cast<double>(std::min(batches[k].size(1), batches[k].size(2)));
    const double w = static_cast<double>(std::max(batches[k].size(1), batches[k].size(2)));
    cost[k] = static_cast<double>(batches[k].size(0)) * (20 * m * m * w + 10 * m * m * m);
    total += cost[k];
  }
  std::vector<int64_t> order;
  for (int64_t k = 0; k < n; ++k) {
    if (threads <= 1 || at::in_parallel_region() || cost[k] * 2 * threads > total)
      ys[k] = yolofast_ns::newton_schulz(batches[k], steps, eps);
    else
      order.push_back(k);
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::atomic<size_t> next{0};
  at::parallel_for(0, std::min<int64_t>(threads, static_cast<int64_t>(order.size())), 1, [&](int64_t, int64_t) {
    note_thread();
    for (size_t i; (i = next.fetch_add(1)) < order.size();)
      ys[order[i]] = yolofast_ns::newton_schulz(batches[order[i]], steps, eps);
  });
  return ys;
}

template <typename X>
void run_step(std::vector<Item>& items, const std::vector<at::Tensor>& muon_p, int64_t steps, double eps) {
  // Shape groups of the Muon tensors (as ns_orthogonalize groups them) and each one's batch.
  const auto groups = yolofast_ns::shape_groups(muon_p);
  std::vector<std::pair<int64_t, int64_t>> where(muon_p.size());
  std::vector<at::Tensor> batches(groups.size());
  for (size_t k = 0; k < groups.size(); ++k) {
    const at::Tensor& first = muon_p[groups[k][0]];
    const int64_t r = first.size(0);
    batches[k] = at::empty({static_cast<int64_t>(groups[k].size()), r, first.numel() / r},
                           first.options().dtype(c10::CppTypeToScalarType<X>::value));
    for (size_t j = 0; j < groups[k].size(); ++j) where[groups[k][j]] = {static_cast<int64_t>(k), j};
  }
  std::vector<const Item*> all, muon;
  for (Item& t : items) {
    if (t.batch >= 0) {
      std::tie(t.batch, t.slot) = where[t.batch];
      muon.push_back(&t);
    }
    all.push_back(&t);
  }
  sweep(all, [&](const Item& t, int64_t lo, int64_t hi) {
    if (t.batch >= 0)
      momentum_span<X>(t, batches[t.batch].mutable_data_ptr<X>(), lo, hi);
    else
      sgd_span(t, lo, hi);
  });
  const std::vector<at::Tensor> ys = orthogonalize_groups(batches, steps, eps);
  sweep(muon, [&](const Item& t, int64_t lo, int64_t hi) { update_span<X>(t, ys[t.batch], lo, hi); });
}

bool musgd_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList bufs, at::TensorList bufs_sgd,
                    at::IntArrayRef counts, at::ArrayRef<double> lr, at::ArrayRef<double> momentum,
                    at::ArrayRef<double> weight_decay, at::IntArrayRef nesterov, at::IntArrayRef use_muon,
                    double muon, double sgd, int64_t steps, double eps, bool fp32) {
  TORCH_CHECK(steps >= 0, "ns_orthogonalize.musgd: steps must be >= 0, got ", steps);
  std::vector<Item> items;
  std::vector<at::Tensor> muon_p;
  items.reserve(params.size());
  if (!collect(params, grads, bufs, bufs_sgd, Hyper{counts, lr, momentum, weight_decay, nesterov, use_muon,
                                                    muon, sgd}, items, muon_p))
    return false;
  if (fp32)
    run_step<float>(items, muon_p, steps, eps);
  else
    run_step<at::BFloat16>(items, muon_p, steps, eps);
  // As in-place ATen ops would: autograd's saved-tensor check sees that these tensors changed.
  for (at::TensorList list : {params, bufs, bufs_sgd})
    for (const at::Tensor& t : list)
      if (!t.is_inference()) torch::autograd::impl::bump_version(t);
  return true;
}

}  // namespace

TORCH_LIBRARY_IMPL(yolofast, CPU, m) { m.impl("ns_orthogonalize.musgd", &musgd_step_cpu); }

}  // namespace yolofast
