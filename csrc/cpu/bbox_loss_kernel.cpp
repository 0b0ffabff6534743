// Fused CIoU box loss + DFL + BCE class loss with their gradients (DESIGN §2.2), CPU.
//
// yolofast::bbox_loss(pred_dist (B,A,4R), pred_scores (B,A,C), anchor_points (A,2), target_bboxes (B,A,4),
//                     target_scores (B,A,C), fg_mask (B,A))
//   -> (losses (3,) [L_box, L_cls, L_dfl] divided by S,
//       grad_dist_box (B,A,4R), grad_dist_dfl (B,A,4R), grad_scores (B,A,C), inv_s ())
// The three gradients are those of S*L_box, S*L_dfl and S*L_cls (i.e. not yet divided by S): backward
// multiplies them by grad_output[i] * inv_s, the same product autograd forms for the reference, so nothing
// needs a second pass here. Box and DFL grads are kept apart because L_box and L_dfl get their own gains.
//
// Compute type: double when pred_dist or pred_scores is double (gradcheck), float otherwise (bf16/fp16
// inputs are upcast, as the reference does). One pass over blocks of anchors; every block writes its
// partial sums (double) to its own slot and the slots are added in block order afterwards, so the result
// does not depend on the number of threads or on scheduling (run-to-run and thread-count deterministic).
// The formulas and their order follow yolofast/ops/reference.py (bbox_ciou, bbox_loss_ref).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "cpu_common.h"
#include "op_checks.h"

namespace yolofast {
namespace {

// 32 anchors x 80 classes = 2560 class logits per block: big enough that the per-block bookkeeping is
// noise, small enough that 2 threads split 8400 anchors evenly (263 blocks per image).
constexpr int64_t kAnchorsPerBlock = 32;
constexpr int kMaxRegMax = 64;

// Lanes of the float class-loss sums: a fixed-width array of partial sums that the compiler maps onto one
// AVX-512 (or two AVX2) registers, added in a fixed order -> vectorised yet deterministic, without the
// reassociation licence (-ffast-math) a plain float reduction loop would need to vectorise.
constexpr int kLanes = 16;

inline float bce_elem(float xi, float ti, float* gi) {
  const float e = exp_nonpos(-std::fabs(xi));
  *gi = (xi >= 0.0f ? 1.0f : e) / (1.0f + e) - ti;  // sigmoid(x) - t
  return std::max(xi, 0.0f) - xi * ti + log1p_unit(e);
}

// Unnormalised BCE-with-logits over n elements: loss += sum l(x, t), tsum += sum t, g = sigmoid(x) - t,
// with l(x, t) = max(x, 0) - x*t + log1p(exp(-|x|)). Each lane sums <= n/16 terms in float (n <= 2560
// per block: 160 terms, relative error ~1e-7) before the double block sums take over.
__attribute__((noinline)) void bce_span(const float* __restrict x, const float* __restrict t,
                                        float* __restrict g, int64_t n, double& loss, double& tsum) {
  float la[kLanes] = {}, sa[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      la[j] += bce_elem(x[i + j], t[i + j], g + i + j);
      sa[j] += t[i + j];
    }
  }
  double l = 0.0, s = 0.0;
  for (; i < n; ++i) {
    l += bce_elem(x[i], t[i], g + i);
    s += t[i];
  }
  for (int j = 0; j < kLanes; ++j) {
    l += la[j];
    s += sa[j];
  }
  loss += l;
  tsum += s;
}

inline void bce_span(const double* x, const double* t, double* g, int64_t n, double& loss, double& tsum) {
  for (int64_t i = 0; i < n; ++i) {
    const double xi = x[i], ti = t[i];
    const double e = std::exp(-std::fabs(xi));
    loss += (xi > 0.0 ? xi : 0.0) - xi * ti + std::log1p(e);
    tsum += ti;
    g[i] = (xi >= 0.0 ? 1.0 : e) / (1.0 + e) - ti;
  }
}

// d min(a, b) / d a as torch.minimum's backward has it: 1 if a < b, 1/2 on a tie, 0 otherwise.
template <typename T>
inline T d_min(T a, T b) {
  return a < b ? T(1) : (a == b ? T(0.5) : T(0));
}
template <typename T>
inline T d_max(T a, T b) {
  return a > b ? T(1) : (a == b ? T(0.5) : T(0));
}

// Box (CIoU) and DFL losses of one foreground anchor, weighted by w, and their gradients w.r.t. the
// 4*R logits z (unnormalised: the gradients of (1 - CIoU)*w and mean_sides(dfl)*w).
template <typename T>
void box_dfl_anchor(const T* z, int R, T ax, T ay, const T* tb, T w, T* gbox, T* gdfl, double& lbox,
                    double& ldfl) {
  T p[4][kMaxRegMax];
  T E[4], logz[4], zmax[4];
  for (int k = 0; k < 4; ++k) {
    const T* zk = z + k * R;
    T mx = zk[0];
    for (int j = 1; j < R; ++j) mx = zk[j] > mx ? zk[j] : mx;
    T sum = 0;
    for (int j = 0; j < R; ++j) {
      p[k][j] = std::exp(zk[j] - mx);
      sum += p[k][j];
    }
    T ex = 0;
    for (int j = 0; j < R; ++j) {
      p[k][j] = p[k][j] / sum;
      ex += p[k][j] * T(j);
    }
    E[k] = ex;
    zmax[k] = mx;
    logz[k] = std::log(sum);
  }

  // ---- CIoU(pred = box 1, target = box 2), forward in the reference's order.
  constexpr T eps = T(1e-7);
  constexpr T four_over_pi2 = T(4.0 / (M_PI * M_PI));
  const T x1 = ax - E[0], y1 = ay - E[1], x2 = ax + E[2], y2 = ay + E[3];
  const T X1 = tb[0], Y1 = tb[1], X2 = tb[2], Y2 = tb[3];
  const T w1 = x2 - x1, h1 = y2 - y1 + eps;
  const T w2 = X2 - X1, h2 = Y2 - Y1 + eps;
  const T ihx = std::min(x2, X2), ilx = std::max(x1, X1);
  const T ihy = std::min(y2, Y2), ily = std::max(y1, Y1);
  const T iw_raw = ihx - ilx, ih_raw = ihy - ily;
  const T iw = iw_raw > T(0) ? iw_raw : T(0);
  const T ih = ih_raw > T(0) ? ih_raw : T(0);
  const T inter = iw * ih;
  const T uni = w1 * h1 + w2 * h2 - inter + eps;
  const T iou = inter / uni;
  const T cw = std::max(x2, X2) - std::min(x1, X1);
  const T ch = std::max(y2, Y2) - std::min(y1, Y1);
  const T c2 = cw * cw + ch * ch + eps;
  const T dx = (X1 + X2) - (x1 + x2), dy = (Y1 + Y2) - (y1 + y2);
  const T rho2 = (dx * dx + dy * dy) / T(4);
  const T q1 = w1 / h1;
  const T da = std::atan(w2 / h2) - std::atan(q1);
  const T v = four_over_pi2 * da * da;
  const T alpha = v / (v - iou + (T(1) + eps));  // a constant in the gradient
  const T ciou = iou - (rho2 / c2 + v * alpha);
  lbox += double((T(1) - ciou) * w);

  // ---- CIoU backward: g = d[(1 - ciou) * w] / d ciou. Subgradients as autograd's: clamp(min=0) passes
  // the gradient at exactly 0, minimum/maximum split it evenly on a tie.
  const T g = -w;
  const T g_inter_iou = g / uni;        // d iou / d inter (direct)
  const T g_union = -g * iou / uni;     // d iou / d union
  const T g_inter = g_inter_iou - g_union;
  T g_w1 = g_union * h1, g_h1 = g_union * w1;
  const T g_iwr = iw_raw >= T(0) ? g_inter * ih : T(0);
  const T g_ihr = ih_raw >= T(0) ? g_inter * iw : T(0);
  T g_x1 = -g_iwr * d_max(x1, X1), g_x2 = g_iwr * d_min(x2, X2);
  T g_y1 = -g_ihr * d_max(y1, Y1), g_y2 = g_ihr * d_min(y2, Y2);
  const T g_c2 = g * rho2 / (c2 * c2);
  const T g_cw = g_c2 * T(2) * cw, g_ch = g_c2 * T(2) * ch;
  g_x2 += g_cw * d_max(x2, X2);
  g_x1 -= g_cw * d_min(x1, X1);
  g_y2 += g_ch * d_max(y2, Y2);
  g_y1 -= g_ch * d_min(y1, Y1);
  const T g_rho2 = -g / c2;
  const T g_dx = g_rho2 * dx / T(2), g_dy = g_rho2 * dy / T(2);
  g_x1 -= g_dx;
  g_x2 -= g_dx;
  g_y1 -= g_dy;
  g_y2 -= g_dy;
  const T g_v = -g * alpha;
  const T g_q1 = -(g_v * four_over_pi2 * T(2) * da) / (T(1) + q1 * q1);  // d atan(q)/dq = 1/(1+q^2)
  g_w1 += g_q1 / h1;
  g_h1 -= g_q1 * w1 / (h1 * h1);
  g_x2 += g_w1;
  g_x1 -= g_w1;
  g_y2 += g_h1;
  g_y1 -= g_h1;
  const T gE[4] = {-g_x1, -g_y1, g_x2, g_y2};
  for (int k = 0; k < 4; ++k)
    for (int j = 0; j < R; ++j) gbox[k * R + j] = gE[k] * p[k][j] * (T(j) - E[k]);

  // ---- DFL: targets clamped to [0, R - 1 - 0.01] so that bin tl + 1 exists.
  const T hi = static_cast<T>(static_cast<double>(R) - 1 - 0.01);
  const T td[4] = {ax - X1, ay - Y1, X2 - ax, Y2 - ay};
  const T cd = w / T(4);  // mean over the 4 sides, times the weight
  T dfl = 0;
  for (int k = 0; k < 4; ++k) {
    const T t = std::min(std::max(td[k], T(0)), hi);
    const T tlf = std::floor(t);
    const int tl = static_cast<int>(tlf);
    const T wl = (tlf + T(1)) - t;
    const T wr = T(1) - wl;
    const T base = zmax[k] + logz[k];
    dfl += wl * (z[k * R + tl] - base) + wr * (z[k * R + tl + 1] - base);
    T* gk = gdfl + k * R;
    const T wsum = wl + wr;
    for (int j = 0; j < R; ++j) gk[j] = cd * wsum * p[k][j];
    gk[tl] -= cd * wl;
    gk[tl + 1] -= cd * wr;
  }
  ldfl += double(-dfl / T(4) * w);
}

template <typename T>
std::vector<double> run(const at::Tensor& pd, const at::Tensor& ps, const at::Tensor& anc, const at::Tensor& tb,
                        const at::Tensor& ts, const at::Tensor& fg, at::Tensor& gbox, at::Tensor& gdfl,
                        at::Tensor& gcls) {
  const int64_t B = pd.size(0), A = pd.size(1), R4 = pd.size(2), C = ps.size(2);
  const int R = static_cast<int>(R4 / 4);
  const int64_t N = B * A;
  const int64_t nblocks = (N + kAnchorsPerBlock - 1) / kAnchorsPerBlock;
  std::vector<double> partial(static_cast<size_t>(nblocks) * 4, 0.0);

  const T* pd_p = pd.const_data_ptr<T>();
  const T* ps_p = ps.const_data_ptr<T>();
  const T* anc_p = anc.const_data_ptr<T>();
  const T* tb_p = tb.const_data_ptr<T>();
  const T* ts_p = ts.const_data_ptr<T>();
  const bool* fg_p = fg.const_data_ptr<bool>();
  T* gb_p = gbox.mutable_data_ptr<T>();
  T* gd_p = gdfl.mutable_data_ptr<T>();
  T* gc_p = gcls.mutable_data_ptr<T>();

  at::parallel_for(0, nblocks, 1, [&](int64_t blk0, int64_t blk1) {
    note_thread();
    for (int64_t blk = blk0; blk < blk1; ++blk) {
      const int64_t n0 = blk * kAnchorsPerBlock, n1 = std::min(N, n0 + kAnchorsPerBlock);
      double lbox = 0, lcls = 0, ldfl = 0, tsum = 0;
      bce_span(ps_p + n0 * C, ts_p + n0 * C, gc_p + n0 * C, (n1 - n0) * C, lcls, tsum);
      for (int64_t n = n0; n < n1; ++n) {
        T* gb = gb_p + n * R4;
        T* gd = gd_p + n * R4;
        if (!fg_p[n]) {
          std::fill(gb, gb + R4, T(0));
          std::fill(gd, gd + R4, T(0));
          continue;
        }
        const T* tsn = ts_p + n * C;
        T w = 0;
        for (int64_t c = 0; c < C; ++c) w += tsn[c];
        const int64_t a = n % A;
        box_dfl_anchor<T>(pd_p + n * R4, R, anc_p[2 * a], anc_p[2 * a + 1], tb_p + n * 4, w, gb, gd, lbox, ldfl);
      }
      double* out = partial.data() + blk * 4;
      out[0] = lbox;
      out[1] = lcls;
      out[2] = ldfl;
      out[3] = tsum;
    }
  });

  std::vector<double> sums(4, 0.0);
  for (int64_t blk = 0; blk < nblocks; ++blk)
    for (int i = 0; i < 4; ++i) sums[i] += partial[blk * 4 + i];
  return sums;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bbox_loss_cpu(
    const at::Tensor& pred_dist, const at::Tensor& pred_scores, const at::Tensor& anchor_points,
    const at::Tensor& target_bboxes, const at::Tensor& target_scores, const at::Tensor& fg_mask) {
  yolofast_checks::bbox_loss_shapes(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask,
                                    kMaxRegMax);
  const int64_t B = pred_dist.size(0), A = pred_dist.size(1), R4 = pred_dist.size(2), C = pred_scores.size(2);

  const auto in =
      yolofast_checks::bbox_loss_inputs(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask);
  const bool dbl = in.f64;
  const at::Tensor &pd = in.pd, &ps = in.ps, &anc = in.anc, &tb = in.tb, &ts = in.ts, &fg = in.fg;
  const auto opt = pd.options();
  auto gbox = at::empty({B, A, R4}, opt);
  auto gdfl = at::empty({B, A, R4}, opt);
  auto gcls = at::empty({B, A, C}, opt);
  if (poison_outputs()) {
    for (auto* t : {&gbox, &gdfl, &gcls}) t->fill_(std::numeric_limits<double>::quiet_NaN());
  }

  const auto sums = dbl ? run<double>(pd, ps, anc, tb, ts, fg, gbox, gdfl, gcls)
                        : run<float>(pd, ps, anc, tb, ts, fg, gbox, gdfl, gcls);
  const double S = std::max(sums[3], 1.0);
  auto losses = at::empty({3}, opt.device(at::kCPU));
  auto inv_s = at::empty({}, opt.device(at::kCPU));
  if (dbl) {
    auto* l = losses.mutable_data_ptr<double>();
    l[0] = sums[0] / S, l[1] = sums[1] / S, l[2] = sums[2] / S;
    *inv_s.mutable_data_ptr<double>() = 1.0 / S;
  } else {
    auto* l = losses.mutable_data_ptr<float>();
    l[0] = float(sums[0] / S), l[1] = float(sums[1] / S), l[2] = float(sums[2] / S);
    *inv_s.mutable_data_ptr<float>() = float(1.0 / S);
  }
  return {losses, gbox, gdfl, gcls, inv_s};
}

}  // namespace

TORCH_LIBRARY_IMPL(yolofast, CPU, m) { m.impl("bbox_loss", &bbox_loss_cpu); }

}  // namespace yolofast
