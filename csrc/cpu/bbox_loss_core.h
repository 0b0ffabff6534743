// The per-block work of the fused CPU box/class loss (DESIGN §2.2), explicitly vectorised with
// at::vec::Vectorized<T> (bbox_vec.h). Shared by yolofast::bbox_loss ((B, A, .) tensors) and
// yolofast::bbox_loss_maps (the head's (B, no, H, W) maps read in place): both describe each input and
// output by element strides (batch, channel, anchor), so one code reads either layout.
//
// Vectorisation: the class loss runs along whichever axis is contiguous (anchors in a map, classes in a
// (B, A, C) tensor). The box + DFL part gathers the foreground anchors of a block into groups of
// Vec<T>::size() and puts one anchor in each lane, so softmax, expectation, CIoU and DFL are lane-wise:
// no horizontal sums inside an anchor, and each anchor's value does not depend on its group.
// Determinism: every block returns its own double partial sums (lanes added in lane order); the caller adds
// blocks in block order, and blocks depend on the shapes only, never on the number of threads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "bbox_vec.h"
#include "constants.h"

namespace yolofast {

constexpr int kMaxRegMax = 64;

// One tensor seen as [b][channel][anchor] with element strides.
template <typename P>
struct Strided {
  P* p = nullptr;
  int64_t sb = 0, sc = 0, sa = 0;
  P* at(int64_t b, int64_t c, int64_t a) const { return p + b * sb + c * sc + a * sa; }
};

// One level of the head (or the whole (B, A, .) tensor): n anchors starting at global anchor a0.
// The box and DFL gradients go either to gbox / gdfl (every anchor, zero off the foreground) or, when
// compact is set, compactly: the k-th foreground anchor of a block gets row row0 + k of fg_rows (N, 2, 4R)
// = [box, DFL] and its global index b*A + a in fg_index.
template <typename T>
struct LossLevel {
  Strided<const T> dist, score;   // 4R DFL logits, C class logits
  Strided<T> gbox, gdfl, gcls;    // gradients of S*L_box, S*L_dfl (4R channels each), S*L_cls (C)
  int64_t n = 0, a0 = 0;
  bool compact = false, rows_by_anchor = false;  // rows_by_anchor: row row0 + (i - i0), not the k-th
  T* fg_rows = nullptr;
  int64_t* fg_index = nullptr;
  // Final gradients (bbox_loss_maps given the weights of its three terms): k = weights / S, the factors the
  // backward would apply. gcls then gets (sigmoid - t) * k[1] and gmap, the box channels of the same
  // gradient map, box * k[0] + DFL * k[2] (0 off the foreground); compact rows are still written.
  const T* k = nullptr;
  Strided<T> gmap;
  // reg_max 1 (YOLO26): the 4 channels are raw distances and the third loss is L1 of the distances x the
  // level's stride over the batch image's width / height (reference.bbox_loss_ref); DFL otherwise.
  T l1_stride = T(0), l1_w = T(0), l1_h = T(0);
};

// Where box_dfl_group writes one lane's box and DFL gradient rows (channel stride sc).
template <typename T>
struct GradRows {
  T* box[Vec<T>::size()];
  T* dfl[Vec<T>::size()];
  int64_t sc = 1;
};

// Per-anchor targets, contiguous: anchors (A, 2), boxes (B, A, 4) grid units, scores (B, A, C), fg (B, A).
// With lab set the scores are per anchor instead, ts (B, A): the anchor's one non-zero target, of class
// min(max(lab, 0), C - 1) (tal_assign.maps with dense_scores = false), the rest of its row zero.
template <typename T>
struct LossTargets {
  const T *anc, *tb, *ts;
  const bool* fg;
  int64_t A, C;
  int R;
  const int64_t* lab = nullptr;
};

template <typename T>
inline T reduce_add(const Vec<T>& v) {
  return at::vec::vec_reduce_all<T>([](Vec<T>& a, Vec<T>& b) { return a + b; }, v);
}

// d min(a, b) / d a as torch.minimum's backward has it: 1 if a < b, 1/2 on a tie, 0 otherwise.
template <typename T>
inline Vec<T> d_min(const Vec<T>& a, const Vec<T>& b) {
  const Vec<T> tie = Vec<T>::blendv(Vec<T>(T(0)), Vec<T>(T(0.5)), a == b);
  return Vec<T>::blendv(tie, Vec<T>(T(1)), a < b);
}
template <typename T>
inline Vec<T> d_max(const Vec<T>& a, const Vec<T>& b) {
  const Vec<T> tie = Vec<T>::blendv(Vec<T>(T(0)), Vec<T>(T(0.5)), a == b);
  return Vec<T>::blendv(tie, Vec<T>(T(1)), a > b);
}

// reg_max 1: the end of box_dfl_group for raw distances E (the box gradient gE is then the distances'
// own) and the L1 term instead of DFL: t = (ax - x1, ay - y1, x2 - ax, y2 - ay) unclamped, d = p*s/D - t*s/D
// per side (D = image W for l, r and H for t, b), l1 = mean |d| (in the reference's order: l, t, r, b);
// gradient of l1 * w: w/4 * sign(d) * s/D (abs' subgradient 0 at 0, as autograd's). lane[0..6] = ax, ay,
// X1, Y1, X2, Y2, w; lane[7] the box losses.
template <typename T>
void box_l1_tail(const LossLevel<T>& L, const Vec<T> gE[4], const Vec<T> E[4], T (*lane)[Vec<T>::size()], int n,
                 const GradRows<T>& out, double& lbox, double& ll1) {
  using V = Vec<T>;
  constexpr int W = V::size();
  const V zero(T(0)), one(T(1)), four(T(4)), s(L.l1_stride);
  const V ax = V::loadu(lane[0]), ay = V::loadu(lane[1]);
  const V X1 = V::loadu(lane[2]), Y1 = V::loadu(lane[3]), X2 = V::loadu(lane[4]), Y2 = V::loadu(lane[5]);
  const V w = V::loadu(lane[6]);
  const V td[4] = {ax - X1, ay - Y1, X2 - ax, Y2 - ay};
  const V D[4] = {V(L.l1_w), V(L.l1_h), V(L.l1_w), V(L.l1_h)};
  const V cd = w / four;
  alignas(64) T gb[4][W], gl[4][W];
  V l1 = zero;
  for (int k = 0; k < 4; ++k) {
    const V d = (E[k] * s) / D[k] - (td[k] * s) / D[k];
    l1 = l1 + d.abs();
    const V sign = V::blendv(V::blendv(zero, one, d > zero), one.neg(), d < zero);
    ((cd * sign) * s / D[k]).store(gl[k]);
    gE[k].store(gb[k]);
  }
  ((l1 / four) * w).store(lane[8]);
  for (int l = 0; l < n; ++l) {
    lbox += double(lane[7][l]);
    ll1 += double(lane[8][l]);
    for (int k = 0; k < 4; ++k) {
      out.box[l][k * out.sc] = gb[k][l];
      out.dfl[l][k * out.sc] = gl[k][l];
    }
  }
}

// Box (CIoU) and DFL losses of up to W = Vec<T>::size() foreground anchors idx[0..n) of level L in image
// b, one per lane, and their gradients (unnormalised: of (1 - CIoU)*w and mean_sides(dfl)*w), written to
// out's rows. w[l] is the anchor's weight sum_c target_scores. Unused lanes compute on a dummy
// anchor and are neither written nor summed.
template <typename T>
void box_dfl_group(const LossLevel<T>& L, const LossTargets<T>& tg, int64_t b, const int64_t* idx,
                   const T* wts, int n, const GradRows<T>& out, double& lbox, double& ldfl) {
  using V = Vec<T>;
  constexpr int W = V::size();
  const int R = tg.R, R4 = 4 * R;
  alignas(64) T z[4 * kMaxRegMax * W];   // logits, [channel][lane]
  alignas(64) T p[4 * kMaxRegMax * W];   // softmax, then reused for the DFL gradient
  alignas(64) T gb[4 * kMaxRegMax * W];  // box gradient
  alignas(64) T lane[10][W];             // ax, ay, X1, Y1, X2, Y2, w, then outputs
  for (int l = 0; l < W; ++l) {
    if (l < n) {
      const int64_t i = idx[l], a = L.a0 + i;
      const T* zi = L.dist.at(b, 0, i);
      for (int ch = 0; ch < R4; ++ch) z[ch * W + l] = zi[ch * L.dist.sc];
      const T* t = tg.tb + (b * tg.A + a) * 4;
      lane[0][l] = tg.anc[2 * a], lane[1][l] = tg.anc[2 * a + 1];
      lane[2][l] = t[0], lane[3][l] = t[1], lane[4][l] = t[2], lane[5][l] = t[3];
      lane[6][l] = wts[l];
    } else {  // a well-formed dummy: anchor (0.5, 0.5), target (0, 0, 1, 1), weight 0
      for (int ch = 0; ch < R4; ++ch) z[ch * W + l] = T(0);
      lane[0][l] = lane[1][l] = T(0.5);
      lane[2][l] = lane[3][l] = T(0), lane[4][l] = lane[5][l] = T(1);
      lane[6][l] = T(0);
    }
  }

  V E[4], base[4];
  for (int k = 0; k < 4 && R == 1; ++k) E[k] = V::loadu(z + k * W);  // raw distances: no softmax
  for (int k = 0; k < 4 && R > 1; ++k) {
    const T* zk = z + k * R * W;
    T* pk = p + k * R * W;
    V mx = V::loadu(zk);
    for (int j = 1; j < R; ++j) mx = at::vec::maximum(mx, V::loadu(zk + j * W));
    V sum(T(0));
    for (int j = 0; j < R; ++j) {
      const V e = exp_nonpositive<T>(V::loadu(zk + j * W) - mx);
      e.store(pk + j * W);
      sum = sum + e;
    }
    V ex(T(0));
    for (int j = 0; j < R; ++j) {
      const V pj = V::loadu(pk + j * W) / sum;
      pj.store(pk + j * W);
      ex = at::vec::fmadd(pj, V(T(j)), ex);
    }
    E[k] = ex;
    base[k] = mx + sum.log();
  }

  // ---- CIoU(pred = box 1, target = box 2), forward in the reference's order (reference.bbox_ciou).
  const V zero(T(0)), one(T(1)), two(T(2)), four(T(4));
  const V eps(static_cast<T>(kCiouEps)), four_over_pi2(static_cast<T>(kFourOverPi2));
  const V ax = V::loadu(lane[0]), ay = V::loadu(lane[1]);
  const V X1 = V::loadu(lane[2]), Y1 = V::loadu(lane[3]), X2 = V::loadu(lane[4]), Y2 = V::loadu(lane[5]);
  const V w = V::loadu(lane[6]);
  const V x1 = ax - E[0], y1 = ay - E[1], x2 = ax + E[2], y2 = ay + E[3];
  const V w1 = x2 - x1, h1 = (y2 - y1) + eps;
  const V w2 = X2 - X1, h2 = (Y2 - Y1) + eps;
  const V iw_raw = at::vec::minimum(x2, X2) - at::vec::maximum(x1, X1);
  const V ih_raw = at::vec::minimum(y2, Y2) - at::vec::maximum(y1, Y1);
  const V iw = V::blendv(zero, iw_raw, iw_raw > zero), ih = V::blendv(zero, ih_raw, ih_raw > zero);
  const V inter = iw * ih;
  const V uni = ((w1 * h1 + w2 * h2) - inter) + eps;
  const V iou = inter / uni;
  const V cw = at::vec::maximum(x2, X2) - at::vec::minimum(x1, X1);
  const V ch = at::vec::maximum(y2, Y2) - at::vec::minimum(y1, Y1);
  const V c2 = (cw * cw + ch * ch) + eps;
  const V dx = (X1 + X2) - (x1 + x2), dy = (Y1 + Y2) - (y1 + y2);
  const V rho2 = (dx * dx + dy * dy) / four;
  const V q1 = w1 / h1;
  const V da = (w2 / h2).atan() - q1.atan();
  const V v = four_over_pi2 * (da * da);
  const V alpha = v / ((v - iou) + (one + eps));  // a constant in the gradient
  const V ciou = iou - (rho2 / c2 + v * alpha);
  ((one - ciou) * w).store(lane[7]);

  // ---- CIoU backward: g = d[(1 - ciou) * w] / d ciou. Subgradients as autograd's: clamp(min=0) passes
  // the gradient at exactly 0, minimum/maximum split it evenly on a tie.
  const V g = w.neg();
  const V g_union = (g.neg() * iou) / uni;
  const V g_inter = g / uni - g_union;
  V g_w1 = g_union * h1, g_h1 = g_union * w1;
  const V g_iwr = V::blendv(zero, g_inter * ih, iw_raw >= zero);
  const V g_ihr = V::blendv(zero, g_inter * iw, ih_raw >= zero);
  V g_x1 = g_iwr.neg() * d_max(x1, X1), g_x2 = g_iwr * d_min(x2, X2);
  V g_y1 = g_ihr.neg() * d_max(y1, Y1), g_y2 = g_ihr * d_min(y2, Y2);
  const V g_c2 = g * rho2 / (c2 * c2);
  const V g_cw = g_c2 * two * cw, g_ch = g_c2 * two * ch;
  g_x2 = g_x2 + g_cw * d_max(x2, X2);
  g_x1 = g_x1 - g_cw * d_min(x1, X1);
  g_y2 = g_y2 + g_ch * d_max(y2, Y2);
  g_y1 = g_y1 - g_ch * d_min(y1, Y1);
  const V g_rho2 = g.neg() / c2;
  const V g_dx = g_rho2 * dx / two, g_dy = g_rho2 * dy / two;
  g_x1 = g_x1 - g_dx;
  g_x2 = g_x2 - g_dx;
  g_y1 = g_y1 - g_dy;
  g_y2 = g_y2 - g_dy;
  const V g_v = g.neg() * alpha;
  const V g_q1 = (g_v * four_over_pi2 * two * da).neg() / (one + q1 * q1);  // d atan(q)/dq = 1/(1+q^2)
  g_w1 = g_w1 + g_q1 / h1;
  g_h1 = g_h1 - g_q1 * w1 / (h1 * h1);
  g_x2 = g_x2 + g_w1;
  g_x1 = g_x1 - g_w1;
  g_y2 = g_y2 + g_h1;
  g_y1 = g_y1 - g_h1;
  const V gE[4] = {g_x1.neg(), g_y1.neg(), g_x2, g_y2};
  if (R == 1) return box_l1_tail<T>(L, gE, E, lane, n, out, lbox, ldfl);
  for (int k = 0; k < 4; ++k)
    for (int j = 0; j < R; ++j) {
      const int ch_ = (k * R + j) * W;
      (gE[k] * V::loadu(p + ch_) * (V(T(j)) - E[k])).store(gb + ch_);
    }

  // ---- DFL: targets clamped to [0, R - 1 - 0.01] so that bin tl + 1 exists. The two bins differ per
  // lane, so their logits are picked per lane; the dense part of the gradient is lane-wise.
  const V hi(static_cast<T>(static_cast<double>(R) - 1 - 0.01));
  const V td[4] = {ax - X1, ay - Y1, X2 - ax, Y2 - ay};
  const V cd = w / four;  // mean over the 4 sides, times the weight
  alignas(64) T tlf_l[4][W], wl_l[4][W], wr_l[4][W], base_l[4][W], cd_l[W], w_l[W];
  for (int k = 0; k < 4; ++k) {
    const V t = at::vec::minimum(at::vec::maximum(td[k], zero), hi);
    const V tlf = t.floor();
    const V wl = (tlf + one) - t;
    const V wr = one - wl;
    tlf.store(tlf_l[k]);
    wl.store(wl_l[k]);
    wr.store(wr_l[k]);
    base[k].store(base_l[k]);
    const V cs = cd * (wl + wr);
    T* pk = p + k * R * W;
    for (int j = 0; j < R; ++j) (cs * V::loadu(pk + j * W)).store(pk + j * W);
  }
  cd.store(cd_l);
  w.store(w_l);
  for (int l = 0; l < n; ++l) {
    T dfl = 0;
    for (int k = 0; k < 4; ++k) {
      const int tl = static_cast<int>(tlf_l[k][l]);
      const T* zk = z + k * R * W;
      const T wl = wl_l[k][l], wr = wr_l[k][l], bs = base_l[k][l];
      dfl += wl * (zk[tl * W + l] - bs) + wr * (zk[(tl + 1) * W + l] - bs);
      p[(k * R + tl) * W + l] -= cd_l[l] * wl;
      p[(k * R + tl + 1) * W + l] -= cd_l[l] * wr;
    }
    ldfl += double(-dfl / T(4) * w_l[l]);
    lbox += double(lane[7][l]);
    T* gbi = out.box[l];
    T* gdi = out.dfl[l];
    for (int ch_ = 0; ch_ < R4; ++ch_) {
      gbi[ch_ * out.sc] = gb[ch_ * W + l];
      gdi[ch_ * out.sc] = p[ch_ * W + l];
    }
  }
}

// Zeroes channels [0, nch) of anchors [i0, i1) of image b, along the contiguous axis.
template <typename T>
void zero_rows(const Strided<T>& g, int64_t b, int64_t nch, int64_t i0, int64_t i1) {
  if (g.sc == 1 && g.sa == nch) {  // (B, A, nch) rows: the block is one run (one memset, not one a row)
    std::fill(g.at(b, 0, i0), g.at(b, 0, i1), T(0));
  } else if (g.sa == 1) {
    for (int64_t c = 0; c < nch; ++c) std::fill(g.at(b, c, i0), g.at(b, c, i1), T(0));
  } else {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t c = 0; c < nch; ++c) *g.at(b, c, i) = T(0);
  }
}

// sum_c t[c] of one anchor's target row (its weight w in the box and DFL terms).
template <typename T>
inline T row_sum(const T* t, int64_t C) {
  using V = Vec<T>;
  constexpr int W = V::size();
  V s(T(0));
  int64_t c = 0;
  for (; c + W <= C; c += W) s = s + V::loadu(t + c);
  if (c < C) s = s + V::loadu(t + c, static_cast<int>(C - c));  // the other lanes load as 0
  return reduce_add<T>(s);
}

// The weight sum_c t[c] of anchor ba = b*A + a in the box and DFL terms.
template <typename T>
inline T target_weight(const LossTargets<T>& tg, int64_t ba) {
  return tg.lab ? tg.ts[ba] : row_sum<T>(tg.ts + ba * tg.C, tg.C);
}

// sigmoid(x) as lane 0 of softplus_sigmoid: bit for bit what the vector loop gives that logit.
template <typename T>
inline T sigmoid_as_vector(T x) {
  Vec<T> sp, sig;
  softplus_sigmoid<T>(Vec<T>(x), sp, sig);
  alignas(64) T out[Vec<T>::size()];
  sig.store(out);
  return out[0];
}

// Class loss of anchors [i0, i1) of image b when the class logits run along the anchors (a head map):
// sum sp(x) row by row (one class per row, vectorised along the anchors), then one sweep over the block's
// targets (contiguous (i1 - i0) * C values) sums t and, for the lanes where t != 0 (the assigner's targets
// are non-zero on the few foreground anchors only), subtracts x*t from the loss and t from the gradient.
template <typename T>
void bce_anchor_rows(const LossLevel<T>& L, const LossTargets<T>& tg, int64_t b, int64_t i0, int64_t i1,
                     double& loss, double& tsum) {
  using V = Vec<T>;
  constexpr int W = V::size();
  const int64_t C = tg.C;
  const bool scaled = L.k != nullptr;
  const V k1(scaled ? L.k[1] : T(1));
  for (int64_t c = 0; c < C; ++c) {
    const T* x = L.score.at(b, c, 0);
    T* g = L.gcls.at(b, c, 0);
    V acc(T(0));
    int64_t i = i0;
    for (; i + W <= i1; i += W) {
      V sp, sig;
      softplus_sigmoid<T>(V::loadu(x + i), sp, sig);
      (scaled ? sig * k1 : sig).store(g + i);
      acc = acc + sp;
    }
    if (i < i1) {
      const int cnt = static_cast<int>(i1 - i);
      V sp, sig;
      softplus_sigmoid<T>(V::loadu(x + i, cnt), sp, sig);
      (scaled ? sig * k1 : sig).store(g + i, cnt);
      acc = acc + V::set(V(T(0)), sp, cnt);
    }
    loss += double(reduce_add<T>(acc));
  }
  if (tg.lab) {  // per-anchor targets: one class each, the sums in anchor order
    const int64_t ba0 = b * tg.A + L.a0;
    double xt = 0, s = 0;
    for (int64_t i = i0; i < i1; ++i) {
      const T t = tg.ts[ba0 + i];
      if (t == T(0)) continue;
      const int64_t c = std::min(std::max(tg.lab[ba0 + i], int64_t(0)), C - 1);
      const T x = *L.score.at(b, c, i);
      xt += double(x * t);
      T* g = L.gcls.at(b, c, i);
      if (scaled)  // (sigmoid - t) * k1, rounded as the unscaled gradient times k1 in backward would be
        *g = (sigmoid_as_vector<T>(x) - t) * L.k[1];
      else
        *g -= t;
      s += double(t);
    }
    tsum += s;
    loss -= xt;
    return;
  }
  const T* t = tg.ts + (b * tg.A + L.a0 + i0) * C;
  const int64_t n = (i1 - i0) * C;
  V s(T(0));
  double xt = 0;
  alignas(64) T tl[W];
  for (int64_t k = 0; k < n; k += W) {
    const int cnt = static_cast<int>(std::min<int64_t>(W, n - k));
    const V tv = V::loadu(t + k, cnt);
    s = s + tv;
    if (V::set(V(T(0)), tv, cnt).zero_mask() == (1 << W) - 1) continue;  // all lanes 0: background
    tv.store(tl, cnt);
    for (int l = 0; l < cnt; ++l) {
      if (tl[l] == T(0)) continue;
      const int64_t i = i0 + (k + l) / C, c = (k + l) % C;
      xt += double(*L.score.at(b, c, i) * tl[l]);
      *L.gcls.at(b, c, i) -= tl[l];
    }
  }
  tsum += double(reduce_add<T>(s));
  loss -= xt;
}

// Class loss of anchors [i0, i1) of image b when the class logits run along the classes ((B, A, C));
// dense targets only (per-anchor targets come with the maps):
// the whole BCE l = sp(x) - x*t and g = sigmoid(x) - t, vectorised along the classes; the lane sums run
// over the whole block and are reduced once at its end.
template <typename T>
void bce_class_rows(const LossLevel<T>& L, const LossTargets<T>& tg, int64_t b, int64_t i0, int64_t i1,
                    double& loss, double& tsum) {
  using V = Vec<T>;
  constexpr int W = V::size();
  const int64_t C = tg.C;
  V acc(T(0)), s(T(0));
  for (int64_t i = i0; i < i1; ++i) {
    const T* x = L.score.at(b, 0, i);
    T* g = L.gcls.at(b, 0, i);
    const T* t = tg.ts + (b * tg.A + L.a0 + i) * C;
    int64_t c = 0;
    for (; c + W <= C; c += W) {
      const V xv = V::loadu(x + c), tv = V::loadu(t + c);
      V sp, sig;
      softplus_sigmoid<T>(xv, sp, sig);
      (sig - tv).store(g + c);
      acc = acc + (sp - xv * tv);
      s = s + tv;
    }
    if (c < C) {
      const int cnt = static_cast<int>(C - c);
      const V xv = V::loadu(x + c, cnt), tv = V::loadu(t + c, cnt);
      V sp, sig;
      softplus_sigmoid<T>(xv, sp, sig);
      (sig - tv).store(g + c, cnt);
      acc = acc + V::set(V(T(0)), sp - xv * tv, cnt);
      s = s + tv;
    }
  }
  loss += double(reduce_add<T>(acc));
  tsum += double(reduce_add<T>(s));
}

// The box channels of the final gradient map for anchors [i0, i1): k0*0 + k2*0 (NaN if a weight is not
// finite, as the product would be) and, at the foreground, box*k0 + DFL*k2 from the block's compact rows:
// the arithmetic of the backward's _bbox_loss_maps_scale, so the values are the same.
template <typename T>
void final_box_grads(const LossLevel<T>& L, int64_t b, const bool* fg, int64_t i0, int64_t i1, int64_t row0,
                     int64_t R4) {
  const T k0 = L.k[0], k2 = L.k[2];
  const T bg = k0 * T(0) + k2 * T(0);
  for (int64_t ch = 0; ch < R4; ++ch) std::fill(L.gmap.at(b, ch, i0), L.gmap.at(b, ch, i1), bg);
  int64_t row = row0;
  for (int64_t i = i0; i < i1; ++i) {
    if (!fg[i]) continue;
    const T* r = L.fg_rows + (L.rows_by_anchor ? row0 + (i - i0) : row++) * 2 * R4;
    for (int64_t ch = 0; ch < R4; ++ch) *L.gmap.at(b, ch, i) = r[ch] * k0 + r[R4 + ch] * k2;
  }
}

// All the work of anchors [i0, i1) of level L in image b: out = {S*L_box, S*L_cls, S*L_dfl, sum t}.
// row0: the block's first compact foreground row (used when L.compact).
template <typename T>
void loss_block(const LossLevel<T>& L, const LossTargets<T>& tg, int64_t b, int64_t i0, int64_t i1,
                int64_t row0, double out[4]) {
  constexpr int W = Vec<T>::size();
  double lbox = 0, lcls = 0, ldfl = 0, tsum = 0;
  const bool* fg = tg.fg + b * tg.A + L.a0;
  // In (B, A, .) tensors the foreground anchors' 4R logits and target boxes are rows scattered over tens
  // of MB: each a miss to DRAM, ~40 % of box_dfl_group's time at b8/640 in a perf profile. Ask for them
  // before the block's class loss, which then runs while they arrive.
  if (L.dist.sc == 1 && L.dist.sa != 1) {
    constexpr int64_t kLine = 64 / sizeof(T);
    for (int64_t i = i0; i < i1; ++i) {
      if (!fg[i]) continue;
      for (int64_t c = 0; c < 4 * tg.R; c += kLine) __builtin_prefetch(L.dist.at(b, c, i));
      __builtin_prefetch(tg.tb + (b * tg.A + L.a0 + i) * 4);
    }
  }
  if (L.score.sa == 1)
    bce_anchor_rows<T>(L, tg, b, i0, i1, lcls, tsum);
  else
    bce_class_rows<T>(L, tg, b, i0, i1, lcls, tsum);
  const bool compact = L.compact;
  if (!compact) {
    zero_rows<T>(L.gbox, b, 4 * tg.R, i0, i1);
    zero_rows<T>(L.gdfl, b, 4 * tg.R, i0, i1);
  }
  // In a map the 4R logits of one anchor lie 4R rows apart: ask for the block's DFL rows in one sweep
  // first, so the per-anchor gathers below hit cache instead of waiting on ~4R misses each.
  if (L.dist.sa == 1 && std::any_of(fg + i0, fg + i1, [](bool f) { return f; })) {
    constexpr int64_t kLine = 64 / sizeof(T);
    for (int64_t c = 0; c < 4 * tg.R; ++c)
      for (int64_t i = i0; i < i1; i += kLine) __builtin_prefetch(L.dist.at(b, c, i));
  }
  int64_t idx[W];
  T w[W];
  GradRows<T> rows;
  rows.sc = compact ? 1 : L.gbox.sc;  // (B, A, 4R) rows and maps: gbox and gdfl share their strides
  const int64_t R4 = 4 * tg.R;
  int n = 0;
  int64_t row = row0;
  for (int64_t i = i0; i < i1; ++i) {
    if (!fg[i]) continue;
    idx[n] = i, w[n] = target_weight<T>(tg, b * tg.A + L.a0 + i);
    if (compact) {
      const int64_t r = L.rows_by_anchor ? row0 + (i - i0) : row++;
      rows.box[n] = L.fg_rows + r * 2 * R4;
      rows.dfl[n] = rows.box[n] + R4;
      L.fg_index[r] = b * tg.A + L.a0 + i;
    } else {
      rows.box[n] = L.gbox.at(b, 0, i);
      rows.dfl[n] = L.gdfl.at(b, 0, i);
    }
    if (++n == W) box_dfl_group<T>(L, tg, b, idx, w, n, rows, lbox, ldfl), n = 0;
  }
  if (n > 0) box_dfl_group<T>(L, tg, b, idx, w, n, rows, lbox, ldfl);
  if (L.k) final_box_grads<T>(L, b, fg, i0, i1, row0, R4);
  out[0] = lbox, out[1] = lcls, out[2] = ldfl, out[3] = tsum;
}

}  // namespace yolofast
