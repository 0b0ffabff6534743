// Sparse task-aligned assigner on the CPU (DESIGN §2.1); the spec is reference.tal_assign_ref.
//
// The reference builds ~10 dense (B, M, A) tensors: at B=2, 640 px, 1,000 GT/img that is 16.8M elements
// each. Here nothing of size B*M*A exists. Work is O(sum of candidates + B*A), memory O(B*M*k + B*A):
//   1. per real GT (parallel over B*M): its candidates are one index rectangle per anchor-grid block
//      (binary search on the block's sorted coordinates with the exact predicate); keep its top-k by align.
//      Exact bounds (CIoU <= iou - rho2/c2) skip the aspect term and the pow of candidates whose CIoU is
//      provably <= 0 or that cannot enter the top-k;
//   2. per image: count how many GTs selected each anchor;
//   3. per anchor selected by >= 2 GTs: the best-overlap candidate GT among the image's GTs near it (a
//      16 x 16 cell index of the widened boxes);
//   4. per image: pos_align / pos_overlap of every GT over its final positives;
//   5. per anchor (parallel over B*A): write every output element once (target_scores rows included).
// Overlaps and aligns are bit-identical to the reference's: same operation order, no FMA contraction, atan
// from at::atan and pow from the SLEEF function that ATen's pow uses (tal_assign_math.h).
// First: cpu_common.h selects the ISA of at::vec::Vectorized, which must precede any ATen header.
#include "cpu_common.h"

#include <ATen/Parallel.h>
#include <torch/library.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "op_checks.h"
#include "tal_assign_geometry.h"
#include "tal_assign_math.h"
#include "tal_assign_simd.h"

namespace yolofast {
namespace tal {
namespace {

using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

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

// The assigner's score of anchor a of image b for class c, read from (B, A, C) probabilities as given.
template <typename T>
struct ProbScores {
  static constexpr bool kInUnitRange = false;  // any value the caller passes
  const T* p;
  int64_t A, C;
  T operator()(int64_t b, int64_t a, int64_t c) const { return p[(b * A + a) * C + c]; }
};

// The same score from the head's class logits where they lie (level l: map (B, 4R + C, H_l, W_l), pixel
// a - a0[l]), through the sigmoid: only the candidates' scores are ever computed (b16/320: ~20k of the
// 2.7M that a sigmoid of every logit costs, 9.4 ms -> ~2 ms for the decode that feeds this on AVX2).
// The sigmoid is evaluated in double and rounded once: within an ulp of torch.sigmoid's float result.
template <typename T>
struct MapLogits {
  static constexpr int kMaxLevels = 8;
  static constexpr bool kInUnitRange = true;  // a sigmoid
  const T* cls[kMaxLevels];  // channel 4R of image 0
  int64_t sb[kMaxLevels], sc[kMaxLevels], a0[kMaxLevels + 1];
  int levels = 0;
  T operator()(int64_t b, int64_t a, int64_t c) const {
    int l = 0;
    while (l + 1 < levels && a >= a0[l + 1]) ++l;
    const double x = static_cast<double>(cls[l][b * sb[l] + c * sc[l] + (a - a0[l])]);
    return static_cast<T>(1.0 / (1.0 + std::exp(-x)));
  }
};

template <typename T, typename Scores>
void assign(const Scores& score, int64_t B, int64_t A, int64_t C, const at::Tensor& pbox_t,
            const at::Tensor& anc_t, const at::Tensor& labels_t, const at::Tensor& gt_t, const at::Tensor& real_t,
            const at::Tensor& pd_atan_t, const at::Tensor& gt_atan_t, int64_t topk,
            double alpha, double beta, double eps, at::Tensor& out_labels, at::Tensor& out_boxes,
            at::Tensor& out_scores, at::Tensor& out_fg, at::Tensor& out_idx) {
  const int64_t M = gt_t.size(1);
  const T* pbox = pbox_t.data_ptr<T>();
  const T* anc = anc_t.data_ptr<T>();
  const int64_t* labels = labels_t.data_ptr<int64_t>();
  const T* gtb = gt_t.data_ptr<T>();
  const bool* real = real_t.data_ptr<bool>();
  const T* pd_atan = pd_atan_t.data_ptr<T>();
  const T* gt_atan = gt_atan_t.data_ptr<T>();

  // Python floats enter the reference's float32 arithmetic rounded to float32; so here.
  Params<T> P;
  P.eps = static_cast<T>(eps);
  P.ciou_eps = static_cast<T>(1e-7);
  P.one_plus_ciou_eps = static_cast<T>(1.0 + 1e-7);
  P.four_over_pi2 = static_cast<T>(4.0 / (M_PI * M_PI));
  P.alpha = static_cast<T>(alpha);
  P.beta = static_cast<T>(beta);
  P.prune = P.beta > T(0);
  P.pow = math_fns<T>().pow;
  P.pow_many = math_fns<T>().pow_many;
  const T small_side = static_cast<T>(16.0);
  const bool score_le_one = Scores::kInUnitRange && P.alpha > T(0);
  const int64_t k = std::min<int64_t>(topk, A);

  // Parallel regions only where the work pays for the fork/join: on a shared 2-core machine every
  // barrier can wait out a scheduler slice, so small scenes run inline (single chunk).
  const std::vector<Block<T>> blocks = infer_blocks(anc, A);
  const bool grid = blocks.size() <= kMaxBlocks;
  const size_t n_blocks = grid ? blocks.size() : 0;

  // 0. per GT: the label that reads the scores (clamped like the reference's labels_c), the widened box
  // of the candidate test, the CIoU terms of the un-widened box and its candidate rectangle per block.
  const int64_t BM = B * M;
  std::vector<int64_t> lab_c(BM);
  std::vector<Box<T>> wide(BM);
  std::vector<GtTerms<T>> terms(BM);
  std::vector<int64_t> rects(BM * n_blocks * 4);  // x0, x1, y0, y1 (half-open) per GT and block
  int64_t work = 0;  // candidates to visit
  for (int64_t i = 0; i < BM; ++i) {
    lab_c[i] = std::min(std::max(labels[i], int64_t(0)), C - 1);
    const Box<T> b{gtb[4 * i], gtb[4 * i + 1], gtb[4 * i + 2], gtb[4 * i + 3]};
    wide[i] = widen_small(b, small_side);
    terms[i] = gt_terms(b, P.ciou_eps, gt_atan[i]);
    if (!real[i]) continue;
    if (!grid) work += A;
    for (size_t j = 0; j < n_blocks; ++j) {
      int64_t* r = &rects[(i * n_blocks + j) * 4];
      inside_range(blocks[j].xs, wide[i].x1, wide[i].x2, P.eps, r[0], r[1]);
      inside_range(blocks[j].ys, wide[i].y1, wide[i].y2, P.eps, r[2], r[3]);
      work += (r[1] - r[0]) * (r[3] - r[2]);
    }
  }

  // 1. candidates and top-k per real GT.
  std::vector<Pick<T>> picks(static_cast<size_t>(BM * std::max<int64_t>(k, 1)));
  std::vector<int64_t> n_picks(BM, 0);
  auto one_gt = [&](int64_t i) {
    const int64_t b = i / M;
    const GtTerms<T>& g = terms[i];
    const Box<T>& e = wide[i];
    const int64_t lab = lab_c[i];
    const T* pb = pbox + b * A * 4;
    const T* pa = pd_atan + b * A;
    Pick<T>* buf = picks.data() + i * k;
    int64_t n = 0;
    // A candidate is taken in two steps: prepare decides from its bounds whether it can enter the top-k and,
    // if so, gives it its score term and overlap (pick.align = s_pow for now); commit raises a whole row of
    // prepared overlaps to beta in one pow_many call and pushes them in anchor order. prepare reads the top-k
    // as it stood before the row's commits, so it may prepare a candidate that the sequential order would
    // have skipped; every skip is exact (the candidate's align is strictly below the k-th best), so commit's
    // topk_push then rejects it: the same top-k as one candidate at a time.
    auto prepare = [&](int64_t a, const Ciou<T>& c, Pick<T>& pick) -> bool {
      const T ub = c.upper();
      // ciou <= ub <= 0 -> overlap 0 -> align 0: never picked. Exact, so no tie can change. (A NaN ub is
      // not pruned: the reference's NaN align outranks everything and takes a top-k slot.)
      if (P.prune && c.proper && ub <= T(0)) return false;
      // Scores in [0, 1] and alpha > 0 give s_pow <= 1: the bound below, without reading the score (for
      // logits a sigmoid, the largest share of a big GT's candidates once its top-k is full).
      if (score_le_one && P.prune && c.proper && n == k &&
          pow_upper(ub, P.beta) * T(1.0001) + std::numeric_limits<T>::min() < buf[k - 1].align)
        return false;
      const T s_pow = pow_like_torch(score(b, a, lab), P.alpha, P.pow);
      if (P.prune && c.proper && n == k) {
        // Strictly below the k-th best even at overlap = ub: skip the CIoU tail and the pow. A later anchor
        // loses ties, so "<" is all that needs excluding.
        const T bound = s_pow * pow_upper(ub, P.beta) * T(1.0001) + std::numeric_limits<T>::min();
        if (bound < buf[k - 1].align) return false;
      }
      pick.a = static_cast<int32_t>(a);
      pick.overlap = std::max(c.value(g, pa[a], P.one_plus_ciou_eps, P.four_over_pi2), T(0));  // keeps NaN
      pick.align = s_pow;
      return true;
    };
    constexpr int64_t W = CiouLanes<T>::W;
    auto commit = [&](Pick<T>* row, int64_t m) {
      T ov[W], pw[W];
      for (int64_t j = 0; j < m; ++j) ov[j] = row[j].overlap;
      pow_like_torch_many(ov, P.beta, pw, m, P.pow_many);
      for (int64_t j = 0; j < m; ++j) {
        row[j].align *= pw[j];  // s_pow * overlap^beta
        // align <= 0 is never selected; NaN outranks everything in the reference's sort, so it holds a
        // top-k slot (and is dropped below).
        if (row[j].align > T(0) || std::isnan(row[j].align)) topk_push(buf, n, k, row[j]);
      }
    };
    Pick<T> row[W];
    if (grid) {
      // A candidate row is consecutive anchors: their CIoU bounds are computed a vector at a time.
      CiouLanes<T> lanes;
      for (size_t j = 0; j < n_blocks; ++j) {
        const int64_t* r = &rects[(i * n_blocks + j) * 4];
        const Block<T>& blk = blocks[j];
        for (int64_t iy = r[2]; iy < r[3]; ++iy)
          for (int64_t ix = r[0]; ix < r[1]; ix += W) {
            const int64_t a0 = blk.start + iy * blk.w + ix;
            const int cnt = static_cast<int>(std::min<int64_t>(W, r[1] - ix));
            lanes.compute(g, pb + 4 * a0, cnt, P.ciou_eps);
            int64_t m = 0;
            for (int l = 0; l < cnt; ++l) m += prepare(a0 + l, lanes.lane(g, l), row[m]);
            if (m > 0) commit(row, m);
          }
      }
    } else {
      for (int64_t a = 0; a < A; ++a)
        if (centre_inside(anc[2 * a], anc[2 * a + 1], e, P.eps) &&
            prepare(a, Ciou<T>(g, pb + 4 * a, P.ciou_eps), row[0]))
          commit(row, 1);
    }
    int64_t kept = 0;  // drop the NaN placeholders, keep the order
    for (int64_t j = 0; j < n; ++j)
      if (buf[j].align > T(0)) buf[kept++] = buf[j];
    n_picks[i] = kept;
  };
  // One parallel region does the top-k of every GT and zeroes target_scores (B*A*C, most of the output
  // bytes; step 5 writes only the positives). GT costs differ by 1000x (a 4 px box has ~6 candidates, a
  // 600 px box ~7,000) and parallel_for gives each thread one contiguous range of tasks, so the GTs are
  // dealt round-robin over many tasks. At ~20 ns per candidate and ~0.3 ns per zeroed float, below ~16k
  // candidates and 4M floats one thread beats a fork/join.
  // Per-anchor scores (out_scores (B, A), tal_assign.maps with dense_scores = false) are written whole in
  // step 5: nothing to zero here.
  T* o_sc = out_scores.data_ptr<T>();
  const bool dense = out_scores.dim() == 3;
  const int64_t n_scores = dense ? B * A * C : 0;
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(BM, 64 * at::get_num_threads()));
  const bool small = (k > 0 ? work : 0) < 16384 && n_scores < (int64_t(1) << 22);
  at::parallel_for(0, tasks, small ? tasks : 1, [&](int64_t lo, int64_t hi) {
    note_thread();
    std::fill(o_sc + n_scores * lo / tasks, o_sc + n_scores * hi / tasks, T(0));
    for (int64_t t = lo; t < hi && k > 0; ++t)
      for (int64_t i = t; i < BM; i += tasks)
        if (real[i]) one_gt(i);
  });

  // 2. per anchor: how many GTs selected it, and (for one) that GT with its align and overlap.
  std::vector<int32_t> n_sel(B * A, 0), gt_of(B * A, 0);
  std::vector<T> align_of(B * A, T(0)), overlap_of(B * A, T(0));
  for (int64_t i = 0; i < BM; ++i)
    for (int64_t j = 0; j < n_picks[i]; ++j) {
      const Pick<T>& p = picks[i * k + j];
      const int64_t ba = (i / M) * A + p.a;
      if (n_sel[ba]++ == 0) {
        gt_of[ba] = static_cast<int32_t>(i % M);
        align_of[ba] = p.align;
        overlap_of[ba] = p.overlap;
      }
    }

  // 3. conflicts: the candidate GT (among ALL real GTs of the image) with the largest overlap, the first
  // one on ties like argmax; then its align with the anchor, which it may not have selected.
  std::vector<int64_t> conflicted;
  std::vector<char> image_has(B, 0);
  for (int64_t ba = 0; ba < B * A; ++ba)
    if (n_sel[ba] > 1) {
      conflicted.push_back(ba);
      image_has[ba / A] = 1;
    }
  // A negative eps admits anchors just outside a box, which the cell ranges would miss: scan all GTs.
  const bool use_index = !conflicted.empty() && P.eps >= T(0) && M > 32;
  std::vector<CellIndex> index(use_index ? B : 0);
  if (use_index) {
    double x0 = anc[0], x1 = anc[0], y0 = anc[1], y1 = anc[1];
    for (int64_t a = 1; a < A; ++a) {
      x0 = std::min<double>(x0, anc[2 * a]);
      x1 = std::max<double>(x1, anc[2 * a]);
      y0 = std::min<double>(y0, anc[2 * a + 1]);
      y1 = std::max<double>(y1, anc[2 * a + 1]);
    }
    for (int64_t b = 0; b < B; ++b)
      if (image_has[b]) build_index(index[b], wide.data() + b * M, real + b * M, M, x0, y0, x1, y1);
  }
  // ~1 us per conflicted anchor (a few CIoUs): parallel only for dense scenes.
  at::parallel_for(0, static_cast<int64_t>(conflicted.size()), 512, [&](int64_t lo, int64_t hi) {
    std::vector<int32_t> all;
    for (int64_t c = lo; c < hi; ++c) {
      const int64_t ba = conflicted[c], b = ba / A, a = ba % A;
      const T ax = anc[2 * a], ay = anc[2 * a + 1];
      const T* pb = pbox + ba * 4;
      const int32_t* gts;
      int64_t n_gts;
      if (use_index) {
        const CellIndex& ix = index[b];
        const int64_t cell = ix.cell(ay, ix.y0, ix.inv_ch) * ix.g + ix.cell(ax, ix.x0, ix.inv_cw);
        gts = ix.gts.data() + ix.start[cell];
        n_gts = ix.start[cell + 1] - ix.start[cell];
      } else {
        if (all.empty())
          for (int32_t m = 0; m < M; ++m) all.push_back(m);
        gts = all.data();
        n_gts = M;
      }
      int64_t best = -1;
      T best_ov = T(-1);
      for (int64_t j = 0; j < n_gts; ++j) {
        const int64_t i = b * M + gts[j];
        if (!real[i] || !centre_inside(ax, ay, wide[i], P.eps)) continue;
        const Ciou<T> ci(terms[i], pb, P.ciou_eps);
        // overlap <= max(ub, 0) and best_ov >= 0: a GT with ub <= best_ov cannot take the anchor.
        if (best >= 0 && ci.proper && ci.upper() <= best_ov) continue;
        const T ov = std::max(ci.value(terms[i], pd_atan[ba], P.one_plus_ciou_eps, P.four_over_pi2), T(0));
        if (best < 0 || ranks_above(ov, best_ov)) {
          best = gts[j];
          best_ov = ov;
        }
      }
      // The GTs that selected the anchor pass the same predicate, so best >= 0; the check only guarantees
      // that an inconsistency could never index outside the arrays.
      if (best < 0) continue;
      const int64_t i = b * M + best;
      gt_of[ba] = static_cast<int32_t>(best);
      overlap_of[ba] = best_ov;
      const T s_pow = pow_like_torch(score(b, a, lab_c[i]), P.alpha, P.pow);
      align_of[ba] = s_pow * pow_like_torch(best_ov, P.beta, P.pow);
    }
  });

  // 4. fg = selected and align with the assigned GT > 0; per GT the max align / overlap of its positives.
  std::vector<T> pos_align(BM, T(0)), pos_overlap(BM, T(0));
  for (int64_t ba = 0; ba < B * A; ++ba) {
    if (n_sel[ba] == 0 || !(align_of[ba] > T(0))) {
      n_sel[ba] = 0;  // from here on: n_sel > 0 <=> foreground
      continue;
    }
    const int64_t i = (ba / A) * M + gt_of[ba];
    pos_align[i] = std::max(pos_align[i], align_of[ba]);
    pos_overlap[i] = std::max(pos_overlap[i], overlap_of[ba]);
  }

  // 5. the per-anchor outputs and the positives' scores (the zeros were written in step 1).
  int64_t* o_lab = out_labels.data_ptr<int64_t>();
  T* o_box = out_boxes.data_ptr<T>();
  bool* o_fg = out_fg.data_ptr<bool>();
  int64_t* o_idx = out_idx.data_ptr<int64_t>();
  for (int64_t ba = 0; ba < B * A; ++ba) {
    const bool fg = n_sel[ba] > 0;
    const int64_t m = fg ? gt_of[ba] : 0;
    const int64_t i = (ba / A) * M + m;
    o_fg[ba] = fg;
    o_idx[ba] = m;
    o_lab[ba] = std::max(labels[i], int64_t(0));
    for (int j = 0; j < 4; ++j) o_box[4 * ba + j] = gtb[4 * i + j];
    const T sc = fg ? (align_of[ba] * pos_overlap[i]) / (pos_align[i] + P.eps) : T(0);
    if (!dense)
      o_sc[ba] = sc;
    else if (fg)
      o_sc[ba * C + lab_c[i]] = sc;
  }
}

// atan(w / h) of every box for CIoU's aspect term, exactly as reference.bbox_ciou computes it: w = x2 - x1,
// h = (y2 - y1) + 1e-7 (the same IEEE operations as ATen's sub/add/div), then ATen's atan (MKL VML here,
// which differs from libm by an ulp on ~2% of inputs). Slices of <= 32768 elements (ATen's grain) so that
// ATen runs each inline instead of forking threads for ~0.1 ms of work. O(B*A + B*M) values.
template <typename T>
at::Tensor aspect_atan(const at::Tensor& box) {
  const int64_t n = box.numel() / 4;
  at::Tensor out = at::empty({n}, box.options());
  const T* b = box.data_ptr<T>();
  T* r = out.data_ptr<T>();
  const T eps = static_cast<T>(1e-7);
  for (int64_t i = 0; i < n; ++i) r[i] = (b[4 * i + 2] - b[4 * i]) / ((b[4 * i + 3] - b[4 * i + 1]) + eps);
  for (int64_t s = 0; s < n; s += 32768) out.narrow(0, s, std::min<int64_t>(32768, n - s)).atan_();
  return out;
}

// target_scores' shape: (B, A, C), or (B, A) per anchor (dense_scores = false, see run).
std::vector<int64_t> score_sizes(int64_t B, int64_t A, int64_t C, bool dense_scores) {
  return dense_scores ? std::vector<int64_t>{B, A, C} : std::vector<int64_t>{B, A};
}

// Everything after the score source: allocates the outputs in the compute type, runs assign, casts back.
// make_scores(T) -> the score reader for compute type T; out_dtype: the dtype of target_scores.
// dense_scores = false: target_scores is (B, A), each anchor's one non-zero score (0 off the foreground),
// the class being min(target_labels, C - 1): the (B, A, C) tensor is that row one-hot, and at b8/640 its
// 21.5 MB of mostly zeros are written here and read again by the loss.
template <typename MakeScores>
Outputs run(const MakeScores& make_scores, bool f64, int64_t B, int64_t A, int64_t C, const at::Tensor& pbox,
            const at::Tensor& anc, const at::Tensor& labels, const at::Tensor& gt, const at::Tensor& real,
            const at::Tensor& gt_bboxes, at::ScalarType out_dtype, int64_t topk, double alpha, double beta,
            double eps, bool dense_scores = true) {
  const auto ct = f64 ? at::kDouble : at::kFloat;
  auto opts = pbox.options();
  at::Tensor o_lab = at::empty({B, A}, opts.dtype(at::kLong));
  at::Tensor o_box = at::empty({B, A, 4}, opts.dtype(ct));
  at::Tensor o_sc = at::empty(score_sizes(B, A, C, dense_scores), opts.dtype(ct));
  at::Tensor o_fg = at::empty({B, A}, opts.dtype(at::kBool));
  at::Tensor o_idx = at::empty({B, A}, opts.dtype(at::kLong));
  const at::Tensor pd_atan = f64 ? aspect_atan<double>(pbox) : aspect_atan<float>(pbox);
  const at::Tensor gt_atan = f64 ? aspect_atan<double>(gt) : aspect_atan<float>(gt);
  if (f64)
    assign<double>(make_scores(double(0)), B, A, C, pbox, anc, labels, gt, real, pd_atan, gt_atan, topk, alpha,
                   beta, eps, o_lab, o_box, o_sc, o_fg, o_idx);
  else
    assign<float>(make_scores(float(0)), B, A, C, pbox, anc, labels, gt, real, pd_atan, gt_atan, topk, alpha,
                  beta, eps, o_lab, o_box, o_sc, o_fg, o_idx);
  // Casting back is exact for the boxes (they came from gt_bboxes) and rounds the scores once, like the
  // reference's final .to(pd_scores.dtype).
  return {o_lab, o_box.to(gt_bboxes.scalar_type()), o_sc.to(out_dtype), o_fg, o_idx};
}

// DESIGN §2.1 step 6: no GT slot at all, everything is background of class C.
Outputs no_gt_slots(int64_t B, int64_t A, int64_t C, const at::Tensor& gt_bboxes, at::ScalarType score_dtype,
                    bool dense_scores = true) {
  const auto opt = gt_bboxes.options();
  return {at::full({B, A}, C, opt.dtype(at::kLong)), at::zeros({B, A, 4}, opt),
          at::zeros(score_sizes(B, A, C, dense_scores), opt.dtype(score_dtype)),
          at::zeros({B, A}, opt.dtype(at::kBool)),
          at::zeros({B, A}, opt.dtype(at::kLong))};
}

Outputs tal_assign_cpu(const at::Tensor& pd_scores, const at::Tensor& pd_bboxes, const at::Tensor& anc_points,
                       const at::Tensor& gt_labels, const at::Tensor& gt_bboxes, const at::Tensor& mask_gt,
                       int64_t topk, double alpha, double beta, double eps) {
  yolofast_checks::tal_assign_shapes(pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt, topk);
  const int64_t B = pd_scores.size(0), A = pd_scores.size(1), C = pd_scores.size(2), M = gt_bboxes.size(1);
  if (M == 0) return no_gt_slots(B, A, C, gt_bboxes, pd_scores.scalar_type());
  const auto in =
      yolofast_checks::tal_assign_inputs(pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt);
  const at::Tensor& scores = in.scores;
  auto make = [&](auto zero) {
    using T = decltype(zero);
    return ProbScores<T>{scores.const_data_ptr<T>(), A, C};
  };
  return run(make, in.f64, B, A, C, in.pbox, in.anc, in.labels, in.gt, in.real, gt_bboxes,
             pd_scores.scalar_type(), topk, alpha, beta, eps);
}

// tal_assign.maps: the scores are sigmoid(class logits) read from the head's maps in place (see MapLogits);
// otherwise the same as tal_assign on maps_to_rows(feats)[1].sigmoid(). target_scores has the maps'
// promoted dtype, as that (B, A, C) tensor would; with dense_scores = false it is (B, A) (see run).
Outputs tal_assign_maps_cpu(at::TensorList feats, int64_t reg_max, const at::Tensor& pd_bboxes,
                            const at::Tensor& anc_points, const at::Tensor& gt_labels, const at::Tensor& gt_bboxes,
                            const at::Tensor& mask_gt, int64_t topk, double alpha, double beta, double eps,
                            bool dense_scores) {
  bool maps_f64 = false;
  // No fixed per-bin arrays here: any reg_max >= 2 will do.
  auto maps = yolofast_checks::head_maps(feats, reg_max, std::numeric_limits<int32_t>::max(),
                                         "yolofast::tal_assign.maps", maps_f64);
  TORCH_CHECK(maps.size() <= static_cast<size_t>(MapLogits<float>::kMaxLevels), "yolofast::tal_assign.maps: at most ",
              MapLogits<float>::kMaxLevels, " maps, got ", maps.size());
  const int64_t B = feats[0].size(0), C = feats[0].size(1) - 4 * reg_max;
  int64_t A = 0;
  at::ScalarType out_dtype = feats[0].scalar_type();
  for (const auto& f : feats) A += f.size(2) * f.size(3), out_dtype = at::promote_types(out_dtype, f.scalar_type());
  // A zero-stride stand-in for the (B, A, C) scores: the shape checks read only its sizes and dtype.
  yolofast_checks::tal_assign_shapes(at::empty_strided({B, A, C}, {0, 0, 0}, feats[0].options()), pd_bboxes,
                                     anc_points, gt_labels, gt_bboxes, mask_gt, topk);
  const int64_t M = gt_bboxes.size(1);
  if (M == 0) return no_gt_slots(B, A, C, gt_bboxes, out_dtype, dense_scores);
  // The compute type as tal_assign's: float64 when the scores (here the maps), pred or GT boxes are.
  const auto in =
      yolofast_checks::tal_assign_box_inputs(maps_f64, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt);
  for (auto& m : maps) m = m.to(in.f64 ? at::kDouble : at::kFloat);
  auto make = [&](auto zero) {
    using T = decltype(zero);
    MapLogits<T> s;
    s.levels = static_cast<int>(maps.size()), s.a0[0] = 0;
    for (int l = 0; l < s.levels; ++l) {
      const auto& m = maps[l];
      s.cls[l] = m.const_data_ptr<T>() + 4 * reg_max * m.stride(1);
      s.sb[l] = m.stride(0), s.sc[l] = m.stride(1);
      s.a0[l + 1] = s.a0[l] + m.size(2) * m.size(3);
    }
    return s;
  };
  return run(make, in.f64, B, A, C, in.pbox, in.anc, in.labels, in.gt, in.real, gt_bboxes, out_dtype, topk, alpha,
             beta, eps, dense_scores);
}

}  // namespace
}  // namespace tal
}  // namespace yolofast

TORCH_LIBRARY_IMPL(yolofast, CPU, m) {
  m.impl("tal_assign", &yolofast::tal::tal_assign_cpu);
  m.impl("tal_assign.maps", &yolofast::tal::tal_assign_maps_cpu);
}
