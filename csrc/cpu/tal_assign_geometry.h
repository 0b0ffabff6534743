// Geometry of the sparse task-aligned assigner (DESIGN §2.1): candidate test, CIoU, anchor-grid inference.
// Every formula here repeats the reference (yolofast/ops/reference.py) operation by operation and in the
// same precision, because the integer outputs (top-k picks, conflict winners) must equal the reference's
// exactly: a one-ulp difference in an overlap can flip a near-tie.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

// The reference runs each elementwise op separately (one rounding per op). A fused multiply-add would round
// once and drift by an ulp, so contraction stays off for everything below.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace yolofast {
namespace tal {

template <typename T>
struct Box {
  T x1, y1, x2, y2;
};

// Strictly inside, written like the reference's `cx - x1 > eps` etc. (eps already rounded to T).
template <typename T>
inline bool centre_inside(T cx, T cy, const Box<T>& b, T eps) {
  return (cx - b.x1 > eps) && (cy - b.y1 > eps) && (b.x2 - cx > eps) && (b.y2 - cy > eps);
}

// Widens each side shorter than `side` (16 px) to `side` about the centre, as the reference does for the
// candidate test only: centre = (x1 + x2) / 2, new edges = centre -/+ side / 2.
template <typename T>
inline Box<T> widen_small(const Box<T>& b, T side) {
  Box<T> e = b;
  const T half = side / T(2);
  if (b.x2 - b.x1 < side) {
    const T c = (b.x1 + b.x2) / T(2);
    e.x1 = c - half;
    e.x2 = c + half;
  }
  if (b.y2 - b.y1 < side) {
    const T c = (b.y1 + b.y2) / T(2);
    e.y1 = c - half;
    e.y2 = c + half;
  }
  return e;
}

// NaN-aware "a ranks above b": torch.sort(descending) and argmax both put NaN above every number.
template <typename T>
inline bool ranks_above(T a, T b) {
  if (std::isnan(a)) return !std::isnan(b);
  if (std::isnan(b)) return false;
  return a > b;
}

// Per-GT constants of CIoU(gt, pred): the GT's own terms are the same for every anchor.
template <typename T>
struct GtTerms {
  Box<T> b;
  T w, h, atan_wh;
  bool proper;  // x2 >= x1 and y2 >= y1: what the pruning bounds below assume
};

template <typename T>
inline GtTerms<T> gt_terms(const Box<T>& b, T eps, T atan_wh) {
  GtTerms<T> g;
  g.b = b;
  g.w = b.x2 - b.x1;
  g.h = (b.y2 - b.y1) + eps;
  g.atan_wh = atan_wh;  // at::atan(w / h) of the whole GT tensor, as the reference
  g.proper = b.x2 >= b.x1 && b.y2 >= b.y1;
  return g;
}

// CIoU(gt, pred) in the reference's order of operations (reference.bbox_ciou), split in two: the cheap
// part (iou and the centre-distance term q = rho2 / c2) and the aspect term v * alpha. As v * alpha >= 0,
// the rounded result satisfies ciou <= upper() = iou - q for proper boxes (IEEE rounding is monotone:
// fl(q + va) >= q, so fl(iou - fl(q + va)) <= fl(iou - q)); the assigner uses that to skip the aspect
// term and the pow of anchors that provably cannot be picked.
template <typename T>
struct Ciou {
  T iou, q, w2, h2;
  bool proper;

  inline Ciou(const GtTerms<T>& g, const T* p, T eps) {
    const Box<T>& a = g.b;
    const T px1 = p[0], py1 = p[1], px2 = p[2], py2 = p[3];
    w2 = px2 - px1;
    h2 = (py2 - py1) + eps;
    const T iw = std::max(std::min(a.x2, px2) - std::max(a.x1, px1), T(0));
    const T ih = std::max(std::min(a.y2, py2) - std::max(a.y1, py1), T(0));
    const T inter = iw * ih;
    const T uni = ((g.w * g.h + w2 * h2) - inter) + eps;
    iou = inter / uni;
    const T cw = std::max(a.x2, px2) - std::min(a.x1, px1);
    const T ch = std::max(a.y2, py2) - std::min(a.y1, py1);
    const T c2 = (cw * cw + ch * ch) + eps;
    const T dx = (px1 + px2) - (a.x1 + a.x2);
    const T dy = (py1 + py2) - (a.y1 + a.y2);
    const T rho2 = (dx * dx + dy * dy) / T(4);
    q = rho2 / c2;
    proper = g.proper && px2 >= px1 && py2 >= py1;
  }

  // From the cheap part computed elsewhere (ciou_lanes below, lane by lane the same operations).
  inline Ciou(T iou_, T q_, T w2_, T h2_, bool proper_) : iou(iou_), q(q_), w2(w2_), h2(h2_), proper(proper_) {}

  inline T upper() const { return iou - q; }

  // atan_pred = atan(w2 / h2) of this prediction, from at::atan like the reference (libm differs by an ulp).
  inline T value(const GtTerms<T>& g, T atan_pred, T one_plus_eps, T four_over_pi2) const {
    const T da = atan_pred - g.atan_wh;
    const T v = four_over_pi2 * (da * da);
    const T alpha = v / ((v - iou) + one_plus_eps);
    return iou - (q + v * alpha);
  }
};

// torch's pow(tensor, scalar) takes exact shortcuts for these exponents (sqrt for 0.5, x*x for 2, ...);
// using the same shortcut keeps align bit-identical to the reference for the default alpha = 0.5.
// True, with out = x^e, when e is one of them; the one list both pow_like_torch and its many-value form use.
template <typename T>
inline bool pow_shortcut(T x, T e, T& out) {
  if (e == T(0)) return out = T(1), true;
  if (e == T(0.5)) return out = std::sqrt(x), true;
  if (e == T(2)) return out = x * x, true;
  if (e == T(3)) return out = x * x * x, true;
  if (e == T(1)) return out = x, true;
  if (e == T(-0.5)) return out = T(1) / std::sqrt(x), true;
  if (e == T(-1)) return out = T(1) / x, true;
  if (e == T(-2)) return out = T(1) / (x * x), true;
  return false;
}

template <typename T>
inline T pow_like_torch(T x, T e, T (*pow_fn)(T, T)) {
  T out;
  return pow_shortcut(x, e, out) ? out : pow_fn(x, e);
}

// out[i] = pow_like_torch(x[i], e) for n >= 1 values; pow_many is pow_fn over many values (MathFns).
template <typename T>
inline void pow_like_torch_many(const T* x, T e, T* out, int64_t n, void (*pow_many)(const T*, T, T*, int64_t)) {
  if (!pow_shortcut(x[0], e, out[0])) return pow_many(x, e, out, n);
  for (int64_t i = 1; i < n; ++i) pow_shortcut(x[i], e, out[i]);
}

// A rectilinear block of anchors: anchor (start + iy * w + ix) sits exactly at (xs[ix], ys[iy]), with xs and
// ys strictly increasing. make_anchors × stride gives one block per pyramid level (8400 anchors at 640 px ->
// 3 blocks); the candidates of a box are then one index rectangle per block.
template <typename T>
struct Block {
  int64_t start, w, h;
  std::vector<T> xs, ys;
};

// Splits anc (A, 2) into blocks greedily in O(A), checking every anchor against its block exactly, so the
// split is always a faithful description of anc. Arbitrary (non-grid) anchors give many tiny blocks; the
// caller then scans all anchors instead.
template <typename T>
std::vector<Block<T>> infer_blocks(const T* anc, int64_t A) {
  std::vector<Block<T>> blocks;
  int64_t i = 0;
  while (i < A) {
    Block<T> blk;
    blk.start = i;
    const T y0 = anc[2 * i + 1];
    int64_t w = 1;
    while (i + w < A && anc[2 * (i + w) + 1] == y0 && anc[2 * (i + w)] > anc[2 * (i + w - 1)]) ++w;
    blk.w = w;
    for (int64_t ix = 0; ix < w; ++ix) blk.xs.push_back(anc[2 * (i + ix)]);
    blk.ys.push_back(y0);
    // Further rows: the same xs, one constant y, above the previous row.
    while (i + (int64_t)(blk.ys.size() + 1) * w <= A) {
      const int64_t r0 = i + (int64_t)blk.ys.size() * w;
      const T yr = anc[2 * r0 + 1];
      if (!(yr > blk.ys.back())) break;
      bool ok = true;
      for (int64_t ix = 0; ix < w && ok; ++ix)
        ok = anc[2 * (r0 + ix)] == blk.xs[ix] && anc[2 * (r0 + ix) + 1] == yr;
      if (!ok) break;
      blk.ys.push_back(yr);
    }
    blk.h = (int64_t)blk.ys.size();
    i += blk.w * blk.h;
    blocks.push_back(std::move(blk));
  }
  return blocks;
}

// Index range [lo, hi) of sorted coordinates c with (c - lo_edge > eps) && (hi_edge - c > eps). Both
// differences are monotone in c (IEEE subtraction is monotone), so two binary searches give exactly the
// anchors that the elementwise predicate accepts, edge cells included.
template <typename T>
inline void inside_range(const std::vector<T>& c, T lo_edge, T hi_edge, T eps, int64_t& lo, int64_t& hi) {
  lo = std::partition_point(c.begin(), c.end(), [&](T v) { return !(v - lo_edge > eps); }) - c.begin();
  hi = std::partition_point(c.begin() + lo, c.end(), [&](T v) { return hi_edge - v > eps; }) - c.begin();
}

}  // namespace tal
}  // namespace yolofast
