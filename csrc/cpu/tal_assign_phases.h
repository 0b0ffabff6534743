// The sparse assigner's phases, in DESIGN §2.1's order: candidates, top-k, conflicts, (second top-k),
// targets. Each phase is one function that reads the Problem and the previous phase's result and returns
// its own; nothing of size B*M*A exists (see tal_assign_kernel.cpp for the costs that shaped them).
// Overlaps and aligns are bit-identical to the reference's: same operation order, no FMA contraction, atan
// from at::atan and pow from the SLEEF function that ATen's pow uses (tal_assign_math.h).
#pragma once

#include "cpu_common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "constants.h"
#include "tal_assign_geometry.h"
#include "tal_assign_math.h"
#include "tal_assign_simd.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace yolofast {
namespace tal {

// More blocks than this means the anchors are not a few grids (e.g. arbitrary points): scanning all A
// anchors per GT is then cheaper than a binary search per block.
constexpr size_t kMaxBlocks = 64;

template <typename T>
struct Pick {
  int32_t a;
  T align, overlap;
};

// "x ranks above y" for top-k: larger align first (NaN largest, like torch.sort), then lower anchor index.
template <typename T>
inline bool better(const Pick<T>& x, const Pick<T>& y) {
  if (ranks_above(x.align, y.align)) return true;
  if (ranks_above(y.align, x.align)) return false;
  return x.a < y.a;
}

// Keeps the best k picks sorted best-first in buf[0..n); k is small (10), so insertion is cheapest.
template <typename T>
inline void topk_push(Pick<T>* buf, int64_t& n, int64_t k, const Pick<T>& p) {
  if (n == k && !better(p, buf[n - 1])) return;
  int64_t i = (n < k) ? n++ : n - 1;
  while (i > 0 && better(p, buf[i - 1])) {
    buf[i] = buf[i - 1];
    --i;
  }
  buf[i] = p;
}

template <typename T>
struct Params {
  T eps, ciou_eps, one_plus_ciou_eps, four_over_pi2, alpha, beta;
  T (*pow)(T, T);
  void (*pow_many)(const T*, T, T*, int64_t);
  bool prune;  // beta > 0: align is 0 when overlap is 0 and grows with overlap, so bounds may skip work
};

// Python floats enter the reference's float32 arithmetic rounded to float32; so here.
template <typename T>
inline Params<T> make_params(double alpha, double beta, double eps) {
  Params<T> P;
  P.eps = static_cast<T>(eps);
  P.ciou_eps = static_cast<T>(kCiouEps);
  P.one_plus_ciou_eps = static_cast<T>(1.0 + kCiouEps);
  P.four_over_pi2 = static_cast<T>(kFourOverPi2);
  P.alpha = static_cast<T>(alpha);
  P.beta = static_cast<T>(beta);
  P.prune = P.beta > T(0);
  P.pow = math_fns<T>().pow;
  P.pow_many = math_fns<T>().pow_many;
  return P;
}

// An upper bound of pow(x, beta) for x >= 0, cheap for the usual integer beta (6): the product's rounding
// error (a few ulps) is far inside the 1e-4 margin applied by the caller.
template <typename T>
inline T pow_upper(T x, T beta) {
  const int n = static_cast<int>(beta);
  if (static_cast<T>(n) != beta || n < 1 || n > 16) return std::pow(x, beta);
  T r = T(1), b = x;
  for (int e = n; e; e >>= 1, b *= b)
    if (e & 1) r *= b;
  return r;
}

// The inputs of one assignment, read by every phase. k2 = topk2 (0: no second top-k).
template <typename T, typename Scores>
struct Problem {
  const Scores* score;
  int64_t B, A, C, M, k, k2;
  const T* pbox;  // (B, A, 4) predicted boxes
  const T* anc;   // (A, 2) anchor centres
  const int64_t* labels;
  const T* gtb;  // (B, M, 4)
  const bool* real;
  const T* pd_atan;  // (B, A) atan(w / h) of the predictions
  const T* gt_atan;  // (B, M) the same of the GTs
  Params<T> P;
};

// ------------------------------------------------------------------------------------------ candidates
// Per GT: the label that reads the scores (clamped like the reference's labels_c), the widened box of the
// candidate test, the CIoU terms of the un-widened box and its candidate rectangle per anchor block.
template <typename T>
struct Candidates {
  std::vector<int64_t> lab_c;
  std::vector<Box<T>> wide;
  std::vector<GtTerms<T>> terms;
  std::vector<Block<T>> blocks;
  bool grid = false;
  size_t n_blocks = 0;
  std::vector<int64_t> rects;  // x0, x1, y0, y1 (half-open) per GT and block
  int64_t work = 0;            // candidates to visit

  const int64_t* rect(int64_t i, size_t j) const { return &rects[(i * n_blocks + j) * 4]; }
};

template <typename T, typename S>
Candidates<T> find_candidates(const Problem<T, S>& pr) {
  Candidates<T> cs;
  const int64_t BM = pr.B * pr.M;
  cs.blocks = infer_blocks(pr.anc, pr.A);
  cs.grid = cs.blocks.size() <= kMaxBlocks;
  cs.n_blocks = cs.grid ? cs.blocks.size() : 0;
  cs.lab_c.resize(BM);
  cs.wide.resize(BM);
  cs.terms.resize(BM);
  cs.rects.resize(BM * cs.n_blocks * 4);
  const T small_side = static_cast<T>(kSmallGtSide);
  const T* gtb = pr.gtb;
  for (int64_t i = 0; i < BM; ++i) {
    cs.lab_c[i] = std::min(std::max(pr.labels[i], int64_t(0)), pr.C - 1);
    const Box<T> b{gtb[4 * i], gtb[4 * i + 1], gtb[4 * i + 2], gtb[4 * i + 3]};
    cs.wide[i] = widen_small(b, small_side);
    cs.terms[i] = gt_terms(b, pr.P.ciou_eps, pr.gt_atan[i]);
    if (!pr.real[i]) continue;
    if (!cs.grid) cs.work += pr.A;
    for (size_t j = 0; j < cs.n_blocks; ++j) {
      int64_t* r = &cs.rects[(i * cs.n_blocks + j) * 4];
      inside_range(cs.blocks[j].xs, cs.wide[i].x1, cs.wide[i].x2, pr.P.eps, r[0], r[1]);
      inside_range(cs.blocks[j].ys, cs.wide[i].y1, cs.wide[i].y2, pr.P.eps, r[2], r[3]);
      cs.work += (r[1] - r[0]) * (r[3] - r[2]);
    }
  }
  return cs;
}

// ----------------------------------------------------------------------------------------------- top-k
// Each real GT's top-k picks by align (best first, align > 0), picks[i * k .. i * k + n[i]).
template <typename T>
struct TopK {
  std::vector<Pick<T>> picks;
  std::vector<int64_t> n;
};

// The top-k scan of one GT over its candidates. A candidate is taken in two steps: prepare decides from its
// bounds whether it can enter the top-k and, if so, gives it its score term and overlap (pick.align =
// s_pow for now); commit raises a whole row of prepared overlaps to beta in one pow_many call and pushes
// them in anchor order. prepare reads the top-k as it stood before the row's commits, so it may prepare a
// candidate that the sequential order would have skipped; every skip is exact (the candidate's align is
// strictly below the k-th best), so commit's topk_push then rejects it: the same top-k as one candidate at
// a time.
template <typename T, typename S>
struct GtScan {
  const Problem<T, S>& pr;
  const Candidates<T>& cs;
  int64_t i, b, lab;
  const GtTerms<T>& g;
  const T* pb;  // this image's predicted boxes
  const T* pa;  // and their atan terms
  Pick<T>* buf;
  int64_t n = 0;

  GtScan(const Problem<T, S>& pr_, const Candidates<T>& cs_, int64_t i_, Pick<T>* buf_)
      : pr(pr_), cs(cs_), i(i_), b(i_ / pr_.M), lab(cs_.lab_c[i_]), g(cs_.terms[i_]),
        pb(pr_.pbox + b * pr_.A * 4), pa(pr_.pd_atan + b * pr_.A), buf(buf_) {}

  inline bool prepare(int64_t a, const Ciou<T>& c, Pick<T>& pick) {
    const Params<T>& P = pr.P;
    const int64_t k = pr.k;
    const T ub = c.upper();
    const bool bounded = P.prune && c.proper;  // a NaN ub is never pruned: a NaN align takes a slot
    // The skips below that do not compute the score need s^alpha in [0, 1]: a score in [0, 1] (checked
    // on the raw value, a load; the sigmoid and pow are what cost) and alpha > 0. A NaN (or negative,
    // or infinite) score gives a NaN align even at overlap 0, which the reference's sort ranks above
    // every number: such a candidate takes the exact path.
    if (bounded && (ub <= T(0) || (S::kScoreFreeBound && n == k)) && P.alpha > T(0) &&
        pr.score->in_unit(b, a, lab)) {
      // ciou <= ub <= 0 -> overlap 0 -> align 0: never picked. Exact, so no tie can change.
      if (ub <= T(0)) return false;
      // s_pow <= 1: the bound below without the score (for logits a sigmoid, the largest share of a big
      // GT's candidates once its top-k is full).
      if (pow_upper(ub, P.beta) * T(1.0001) + std::numeric_limits<T>::min() < buf[k - 1].align) return false;
    }
    const T s_pow = pow_like_torch((*pr.score)(b, a, lab), P.alpha, P.pow);
    // Overlap 0 and a finite s_pow: align (+-)0, never picked (the exact path of the first skip above).
    if (bounded && ub <= T(0) && std::isfinite(s_pow)) return false;
    if (bounded && n == k) {
      // Strictly below the k-th best even at overlap = ub: skip the CIoU tail and the pow. A later anchor
      // loses ties, so "<" is all that needs excluding.
      const T bound = s_pow * pow_upper(ub, P.beta) * T(1.0001) + std::numeric_limits<T>::min();
      if (bound < buf[k - 1].align) return false;
    }
    pick.a = static_cast<int32_t>(a);
    pick.overlap = std::max(c.value(g, pa[a], P.one_plus_ciou_eps, P.four_over_pi2), T(0));  // keeps NaN
    pick.align = s_pow;
    // Overlap (+-)0 and beta > 0: pow(0, beta) = 0, so align = s_pow * 0 is (+-)0 for a finite s_pow and never
    // selected: skip its pow. Exact; it matters where the bounds above cannot apply: predicted boxes with a
    // negative side (raw distances of a reg_max 1 head early in training: ~20x fewer pows at b16/320).
    if (P.prune && pick.overlap == T(0) && std::isfinite(s_pow)) return false;
    return true;
  }

  inline void commit(Pick<T>* row, int64_t m) {
    constexpr int64_t W = CiouLanes<T>::W;
    T ov[W], pw[W];
    for (int64_t j = 0; j < m; ++j) ov[j] = row[j].overlap;
    pow_like_torch_many(ov, pr.P.beta, pw, m, pr.P.pow_many);
    for (int64_t j = 0; j < m; ++j) {
      row[j].align *= pw[j];  // s_pow * overlap^beta
      // align <= 0 is never selected; NaN outranks everything in the reference's sort, so it holds a
      // top-k slot (and is dropped in finish).
      if (row[j].align > T(0) || std::isnan(row[j].align)) topk_push(buf, n, pr.k, row[j]);
    }
  }

  // A candidate row is consecutive anchors: their CIoU bounds are computed a vector at a time.
  void scan_blocks() {
    constexpr int64_t W = CiouLanes<T>::W;
    Pick<T> row[W];
    CiouLanes<T> lanes;
    for (size_t j = 0; j < cs.n_blocks; ++j) {
      const int64_t* r = cs.rect(i, j);
      const Block<T>& blk = cs.blocks[j];
      for (int64_t iy = r[2]; iy < r[3]; ++iy)
        for (int64_t ix = r[0]; ix < r[1]; ix += W) {
          const int64_t a0 = blk.start + iy * blk.w + ix;
          const int cnt = static_cast<int>(std::min<int64_t>(W, r[1] - ix));
          lanes.compute(g, pb + 4 * a0, cnt, pr.P.ciou_eps);
          int64_t m = 0;
          for (int l = 0; l < cnt; ++l) m += prepare(a0 + l, lanes.lane(g, l), row[m]);
          if (m > 0) commit(row, m);
        }
    }
  }

  // Anchors that are not a few grids: every anchor is tested.
  void scan_all() {
    Pick<T> row[1];
    const Box<T>& e = cs.wide[i];
    for (int64_t a = 0; a < pr.A; ++a)
      if (centre_inside(pr.anc[2 * a], pr.anc[2 * a + 1], e, pr.P.eps) &&
          prepare(a, Ciou<T>(g, pb + 4 * a, pr.P.ciou_eps), row[0]))
        commit(row, 1);
  }

  // Drops the NaN placeholders, keeps the order; returns the number of picks.
  int64_t finish() {
    int64_t kept = 0;
    for (int64_t j = 0; j < n; ++j)
      if (buf[j].align > T(0)) buf[kept++] = buf[j];
    return kept;
  }
};

// One parallel region does the top-k of every GT and zeroes scores[0, n_scores) (target_scores (B, A, C),
// most of the output bytes; the targets phase writes only the positives). GT costs differ by 1000x (a 4 px
// box has ~6 candidates, a 600 px box ~7,000) and parallel_for gives each thread one contiguous range of
// tasks, so the GTs are dealt round-robin over many tasks. At ~20 ns per candidate and ~0.3 ns per zeroed
// float, below ~16k candidates and 4M floats one thread beats a fork/join (on a shared 2-core machine every
// barrier can wait out a scheduler slice).
template <typename T, typename S>
TopK<T> topk_per_gt(const Problem<T, S>& pr, const Candidates<T>& cs, T* scores, int64_t n_scores) {
  const int64_t BM = pr.B * pr.M, k = pr.k;
  TopK<T> tk;
  tk.picks.resize(static_cast<size_t>(BM * std::max<int64_t>(k, 1)));
  tk.n.assign(BM, 0);
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(BM, 64 * at::get_num_threads()));
  const bool small = (k > 0 ? cs.work : 0) < 16384 && n_scores < (int64_t(1) << 22);
  at::parallel_for(0, tasks, small ? tasks : 1, [&](int64_t lo, int64_t hi) {
    note_thread();
    std::fill(scores + n_scores * lo / tasks, scores + n_scores * hi / tasks, T(0));
    for (int64_t t = lo; t < hi && k > 0; ++t)
      for (int64_t i = t; i < BM; i += tasks) {
        if (!pr.real[i]) continue;
        GtScan<T, S> scan(pr, cs, i, tk.picks.data() + i * k);
        if (cs.grid)
          scan.scan_blocks();
        else
          scan.scan_all();
        tk.n[i] = scan.finish();
      }
  });
  return tk;
}

// ------------------------------------------------------------------------------------------- conflicts
// Per anchor (b * A + a): how many GTs selected it (after the conflicts: > 0 <=> foreground), the GT it
// goes to, and that GT's align and overlap with it.
template <typename T>
struct AnchorState {
  std::vector<int32_t> n_sel, gt_of;
  std::vector<T> align_of, overlap_of;
};

template <typename T, typename S>
AnchorState<T> count_picks(const Problem<T, S>& pr, const TopK<T>& tk) {
  const int64_t BA = pr.B * pr.A, BM = pr.B * pr.M;
  AnchorState<T> st;
  st.n_sel.assign(BA, 0);
  st.gt_of.assign(BA, 0);
  st.align_of.assign(BA, T(0));
  st.overlap_of.assign(BA, T(0));
  for (int64_t i = 0; i < BM; ++i)
    for (int64_t j = 0; j < tk.n[i]; ++j) {
      const Pick<T>& p = tk.picks[i * pr.k + j];
      const int64_t ba = (i / pr.M) * pr.A + p.a;
      if (st.n_sel[ba]++ == 0) {
        st.gt_of[ba] = static_cast<int32_t>(i % pr.M);
        st.align_of[ba] = p.align;
        st.overlap_of[ba] = p.overlap;
      }
    }
  return st;
}

// Spatial hash of one image's real GTs by their widened boxes, so that the conflict step tests only the
// GTs near an anchor instead of all M (3,000 GTs x 4,500 conflicted anchors = 13.5M tests otherwise).
struct CellIndex {
  int64_t g = 0;
  double x0 = 0, y0 = 0, inv_cw = 0, inv_ch = 0;
  std::vector<int32_t> start, gts;  // CSR: gts[start[c] .. start[c + 1]) ascending GT index

  // The cell coordinate is floor((v - origin) / size), monotone in v, so an anchor strictly inside a box
  // always lies in a cell of the box's cell range.
  inline int64_t cell(double v, double origin, double inv) const {
    const double c = std::floor((v - origin) * inv);
    if (!(c > 0)) return 0;  // NaN too (a NaN anchor is inside no box, so any cell will do)
    return c >= static_cast<double>(g - 1) ? g - 1 : static_cast<int64_t>(c);
  }
  inline int64_t cell_of(double x, double y) const { return cell(y, y0, inv_ch) * g + cell(x, x0, inv_cw); }
};

template <typename T>
void build_index(CellIndex& ix, const Box<T>* wide, const bool* real, int64_t M, double x0, double y0,
                 double x1, double y1) {
  ix.g = 16;  // 256 cells: ~64 px cells at 1024 px, a few GTs per cell in dense scenes
  ix.x0 = x0;
  ix.y0 = y0;
  ix.inv_cw = x1 > x0 ? ix.g / (x1 - x0) : 0.0;
  ix.inv_ch = y1 > y0 ? ix.g / (y1 - y0) : 0.0;
  const int64_t n_cells = ix.g * ix.g;
  std::vector<int64_t> lo_x(M), hi_x(M), lo_y(M), hi_y(M);
  std::vector<int32_t> count(n_cells + 1, 0);
  for (int64_t m = 0; m < M; ++m) {
    const Box<T>& e = wide[m];
    const bool ok =
        real[m] && !std::isnan(e.x1) && !std::isnan(e.x2) && !std::isnan(e.y1) && !std::isnan(e.y2);
    if (!ok) {  // never contains an anchor
      lo_x[m] = 1;
      hi_x[m] = 0;
      continue;
    }
    lo_x[m] = ix.cell(e.x1, x0, ix.inv_cw);
    hi_x[m] = ix.cell(e.x2, x0, ix.inv_cw);
    lo_y[m] = ix.cell(e.y1, y0, ix.inv_ch);
    hi_y[m] = ix.cell(e.y2, y0, ix.inv_ch);
    for (int64_t cy = lo_y[m]; cy <= hi_y[m]; ++cy)
      for (int64_t cx = lo_x[m]; cx <= hi_x[m]; ++cx) ++count[cy * ix.g + cx + 1];
  }
  ix.start.assign(n_cells + 1, 0);
  for (int64_t c = 0; c < n_cells; ++c) ix.start[c + 1] = ix.start[c] + count[c + 1];
  ix.gts.resize(ix.start[n_cells]);
  std::vector<int32_t> fill(ix.start.begin(), ix.start.end() - 1);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t cy = lo_y[m]; lo_x[m] <= hi_x[m] && cy <= hi_y[m]; ++cy)
      for (int64_t cx = lo_x[m]; cx <= hi_x[m]; ++cx)
        ix.gts[fill[cy * ix.g + cx]++] = static_cast<int32_t>(m);
}

// One cell index per image with a conflicted anchor (empty when the GTs are few or eps < 0: a negative eps
// admits anchors just outside a box, which the cell ranges would miss, so then every GT is tested).
template <typename T, typename S>
std::vector<CellIndex> conflict_index(const Problem<T, S>& pr, const Candidates<T>& cs,
                                      const std::vector<int64_t>& conflicted) {
  if (conflicted.empty() || !(pr.P.eps >= T(0)) || pr.M <= 32) return {};
  std::vector<char> image_has(pr.B, 0);
  for (int64_t ba : conflicted) image_has[ba / pr.A] = 1;
  const T* anc = pr.anc;
  double x0 = anc[0], x1 = anc[0], y0 = anc[1], y1 = anc[1];
  for (int64_t a = 1; a < pr.A; ++a) {
    x0 = std::min<double>(x0, anc[2 * a]);
    x1 = std::max<double>(x1, anc[2 * a]);
    y0 = std::min<double>(y0, anc[2 * a + 1]);
    y1 = std::max<double>(y1, anc[2 * a + 1]);
  }
  std::vector<CellIndex> index(pr.B);
  for (int64_t b = 0; b < pr.B; ++b)
    if (image_has[b]) build_index(index[b], cs.wide.data() + b * pr.M, pr.real + b * pr.M, pr.M, x0, y0, x1, y1);
  return index;
}

// The candidate GT of anchor ba among gts[0, n) with the largest overlap, the first one on ties like
// argmax; -1 when none (cannot happen for an anchor some GT selected: that GT passes the same predicate).
template <typename T, typename S>
int64_t best_overlap_gt(const Problem<T, S>& pr, const Candidates<T>& cs, int64_t ba, const int32_t* gts,
                        int64_t n_gts, T& best_ov) {
  const int64_t b = ba / pr.A, a = ba % pr.A;
  const T ax = pr.anc[2 * a], ay = pr.anc[2 * a + 1];
  const T* pb = pr.pbox + ba * 4;
  int64_t best = -1;
  best_ov = T(-1);
  for (int64_t j = 0; j < n_gts; ++j) {
    const int64_t i = b * pr.M + gts[j];
    if (!pr.real[i] || !centre_inside(ax, ay, cs.wide[i], pr.P.eps)) continue;
    const Ciou<T> ci(cs.terms[i], pb, pr.P.ciou_eps);
    // overlap <= max(ub, 0) and best_ov >= 0: a GT with ub <= best_ov cannot take the anchor.
    if (best >= 0 && ci.proper && ci.upper() <= best_ov) continue;
    const T ov =
        std::max(ci.value(cs.terms[i], pr.pd_atan[ba], pr.P.one_plus_ciou_eps, pr.P.four_over_pi2), T(0));
    if (best < 0 || ranks_above(ov, best_ov)) {
      best = gts[j];
      best_ov = ov;
    }
  }
  return best;
}

// An anchor selected by >= 2 GTs goes to the candidate GT (among ALL real GTs of the image) with the largest
// overlap; then its align with the anchor, which it may not have selected. ~1 us per conflicted anchor (a
// few CIoUs): parallel only for dense scenes.
template <typename T, typename S>
void resolve_conflicts(const Problem<T, S>& pr, const Candidates<T>& cs, AnchorState<T>& st) {
  std::vector<int64_t> conflicted;
  for (int64_t ba = 0; ba < pr.B * pr.A; ++ba)
    if (st.n_sel[ba] > 1) conflicted.push_back(ba);
  const std::vector<CellIndex> index = conflict_index(pr, cs, conflicted);
  at::parallel_for(0, static_cast<int64_t>(conflicted.size()), 512, [&](int64_t lo, int64_t hi) {
    std::vector<int32_t> all;
    for (int64_t c = lo; c < hi; ++c) {
      const int64_t ba = conflicted[c], b = ba / pr.A, a = ba % pr.A;
      const int32_t* gts;
      int64_t n_gts;
      if (!index.empty()) {
        const CellIndex& ix = index[b];
        const int64_t cell = ix.cell_of(pr.anc[2 * a], pr.anc[2 * a + 1]);
        gts = ix.gts.data() + ix.start[cell];
        n_gts = ix.start[cell + 1] - ix.start[cell];
      } else {
        if (all.empty())
          for (int32_t m = 0; m < pr.M; ++m) all.push_back(m);
        gts = all.data();
        n_gts = pr.M;
      }
      T best_ov;
      const int64_t best = best_overlap_gt(pr, cs, ba, gts, n_gts, best_ov);
      if (best < 0) continue;  // never indexes outside the arrays, even were the scan inconsistent
      const int64_t i = b * pr.M + best;
      st.gt_of[ba] = static_cast<int32_t>(best);
      st.overlap_of[ba] = best_ov;
      const T s_pow = pow_like_torch((*pr.score)(b, a, cs.lab_c[i]), pr.P.alpha, pr.P.pow);
      st.align_of[ba] = s_pow * pow_like_torch(best_ov, pr.P.beta, pr.P.pow);
    }
  });
  // fg = selected and align with the assigned GT > 0: from here on n_sel > 0 <=> foreground.
  for (int64_t ba = 0; ba < pr.B * pr.A; ++ba)
    if (st.n_sel[ba] > 0 && !(st.align_of[ba] > T(0))) st.n_sel[ba] = 0;
}

// ---------------------------------------------------------------------------------------- second top-k
// YOLO26's one-to-one branch (topk2): after the conflicts, each GT keeps only the k2 of its positives with
// the largest raw align (ties to the lower anchor index, as the top-k), its own picks and the anchors it
// won by overlap alike; the others become background. One pass over the anchors with a k2-entry buffer
// per GT: O(B*A + B*M*k2) time and memory, never (B, M, A).
template <typename T, typename S>
void second_topk(const Problem<T, S>& pr, AnchorState<T>& st) {
  if (pr.k2 <= 0) return;
  const int64_t BM = pr.B * pr.M, k2 = pr.k2;
  std::vector<Pick<T>> keep(static_cast<size_t>(BM * k2));
  std::vector<int64_t> n(BM, 0);
  for (int64_t ba = 0; ba < pr.B * pr.A; ++ba) {
    if (st.n_sel[ba] == 0) continue;
    const int64_t i = (ba / pr.A) * pr.M + st.gt_of[ba];
    topk_push(keep.data() + i * k2, n[i], k2, Pick<T>{static_cast<int32_t>(ba % pr.A), st.align_of[ba], T(0)});
    st.n_sel[ba] = 0;  // set again below for the kept ones
  }
  for (int64_t i = 0; i < BM; ++i)
    for (int64_t j = 0; j < n[i]; ++j) st.n_sel[(i / pr.M) * pr.A + keep[i * k2 + j].a] = 1;
}

// --------------------------------------------------------------------------------------------- targets
// Per GT over its final positives: the max align and the max overlap.
template <typename T>
struct PosMax {
  std::vector<T> align, overlap;
};

template <typename T, typename S>
PosMax<T> positive_maxima(const Problem<T, S>& pr, const AnchorState<T>& st) {
  PosMax<T> pm;
  pm.align.assign(pr.B * pr.M, T(0));
  pm.overlap.assign(pr.B * pr.M, T(0));
  for (int64_t ba = 0; ba < pr.B * pr.A; ++ba) {
    if (st.n_sel[ba] == 0) continue;
    const int64_t i = (ba / pr.A) * pr.M + st.gt_of[ba];
    pm.align[i] = std::max(pm.align[i], st.align_of[ba]);
    pm.overlap[i] = std::max(pm.overlap[i], st.overlap_of[ba]);
  }
  return pm;
}

// The outputs (B, A) / (B, A, 4) and the positives' scores (the zeros were written by topk_per_gt);
// scores is (B, A, C) when dense, else (B, A) with every anchor's one score written here.
template <typename T>
struct OutPtrs {
  int64_t* labels;
  T* boxes;
  T* scores;
  bool* fg;
  int64_t* gt_idx;
  bool dense;
};

template <typename T, typename S>
void write_targets(const Problem<T, S>& pr, const Candidates<T>& cs, const AnchorState<T>& st,
                   const PosMax<T>& pm, const OutPtrs<T>& o) {
  for (int64_t ba = 0; ba < pr.B * pr.A; ++ba) {
    const bool fg = st.n_sel[ba] > 0;
    const int64_t m = fg ? st.gt_of[ba] : 0;
    const int64_t i = (ba / pr.A) * pr.M + m;
    o.fg[ba] = fg;
    o.gt_idx[ba] = m;
    o.labels[ba] = std::max(pr.labels[i], int64_t(0));
    for (int j = 0; j < 4; ++j) o.boxes[4 * ba + j] = pr.gtb[4 * i + j];
    const T sc = fg ? (st.align_of[ba] * pm.overlap[i]) / (pm.align[i] + pr.P.eps) : T(0);
    if (!o.dense)
      o.scores[ba] = sc;
    else if (fg)
      o.scores[ba * pr.C + cs.lab_c[i]] = sc;
  }
}

}  // namespace tal
}  // namespace yolofast
