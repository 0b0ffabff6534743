// Sparse task-aligned assigner on the GPU (DESIGN §2.1); the spec is reference.tal_assign_ref.
//
// Nothing of size B*M*A exists: work O(sum of candidates + B*A), memory O(B*A + B*M*k) (the top-k lives
// in shared memory). Kernels, all on the caller's stream, no host sync (CUDA-graph capturable):
//   0. grid_kernel (1 block): infers the anchor grid on the device -- a level starts where y drops; each
//      level is checked anchor by anchor against start + (ix*sx, iy*sy). Anchors that are not a few exact
//      grids set `bad`, and every GT then scans all A anchors (same results, slower).
//   1. scan_kernel, one block per (GT, image): its candidates are one index rectangle per level (+-1 cell
//      margin; the exact `cx - x1 > eps` test decides). For each candidate: overlap (CIoU clamped at 0) and
//      align; the GT's top-k stays in shared memory (merged tile by tile, ties to the lower anchor index).
//      It also atomically maxes a per-anchor key (overlap bits << 32 | INT_MAX - GT) over ALL candidates,
//      which is the conflict winner (largest overlap, ties -> lowest GT) without any loop over GTs per
//      anchor; and for each pick: a count per anchor, the picker and its align/overlap (read only where
//      exactly one GT picked the anchor). Integer atomics only: the result does not depend on the order.
//      float64 cannot pack its overlap into 32 bits: a second scan resolves its ties with atomicMin.
//   2. resolve_kernel per anchor: winner, align (recomputed bit-identically for conflicts), fg, gt index;
//      per-GT max align / overlap over the final positives (atomicMax on float bits, exact for x >= 0).
//   3. write_kernel per 32 anchors: norm, target labels / boxes / scores (coalesced rows of C classes).
// The float math repeats the reference op by op with IEEE round-to-nearest intrinsics (never contracted to
// fma), and atan/pow/sqrt are the CUDA math functions torch's own CUDA kernels call, so overlaps and aligns
// are bit-identical to the reference on the same GPU and integer outputs are exact.
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "constants.h"
#include "cuda_common.cuh"
#include "cuda_launchers.h"

namespace yolofast {
namespace cuda {
namespace {

constexpr int kMaxLevels = 8;  // pyramid levels the grid table holds (YOLOv8 has 3); more -> full scan
constexpr int kGridThreads = 1024;
// 4 warps per GT: a 600 px box at stride 8 has ~7,000 candidates, i.e. 55 tiles of 128 per block.
constexpr int kScanThreads = 128;
constexpr int kResolveThreads = 256;
constexpr int kWriteRows = 32;
constexpr int kWriteThreads = 256;

template <typename T>
struct GridTable {
  int nlv;  // level starts found (may exceed kMaxLevels: then bad)
  int bad;  // 1: the anchors are not a few exact grids -> every GT scans all A anchors
  int64_t start[kMaxLevels], w[kMaxLevels], h[kMaxLevels];
  T x0[kMaxLevels], y0[kMaxLevels], sx[kMaxLevels], sy[kMaxLevels];
};

inline size_t align16(size_t n) { return (n + 15) & ~size_t(15); }

// Workspace layout, shared by tal_assign_workspace_bytes and the launcher. The first `zero_bytes` are
// cleared by one memset; bestg (float64 only) and t2_a are set to 0x7F7F7F7F ("none yet" for atomicMin).
struct Layout {
  size_t table, cnt, owner, best, pal, pov, t2_al, zero_bytes, bestg, t2_a, sel_al, sel_ov, total;
  Layout(const TalShape& s, bool f64) {
    const size_t BA = static_cast<size_t>(s.B * s.A), BM = static_cast<size_t>(s.B * s.M);
    const size_t t = f64 ? sizeof(double) : sizeof(float);
    size_t o = 0;
    table = o;
    o += align16(f64 ? sizeof(GridTable<double>) : sizeof(GridTable<float>));
    cnt = o;
    o += align16(BA * sizeof(int));
    owner = o;
    o += align16(BA * sizeof(int));
    best = o;
    o += align16(BA * sizeof(uint64_t));
    pal = o;
    o += align16(BM * sizeof(uint64_t));
    pov = o;
    o += align16(BM * sizeof(uint64_t));
    t2_al = o;  // per round r of the second top-k and GT: the best align bits left
    o += align16(static_cast<size_t>(s.k2) * BM * sizeof(uint64_t));
    zero_bytes = o;
    bestg = o;
    o += align16((f64 ? BA : 1) * sizeof(int));
    t2_a = o;  // ... and its anchor (0x7F7F7F7F: none)
    o += align16(static_cast<size_t>(s.k2) * BM * sizeof(int));
    sel_al = o;
    o += align16(BA * t);
    sel_ov = o;
    o += align16(BA * t);
    total = o;
  }
};

// torch.pow(tensor, scalar) on CUDA: its exact shortcuts first (fill 1, copy, sqrt, rsqrt, reciprocal,
// x*x, x*x*x, 1/(x*x) in double), else the CUDA math library's pow (what ATen's pow_ calls).
template <typename T>
__device__ __forceinline__ T pow_torch(T x, T e) {
  using R = RN<T>;
  if (e == T(0)) return T(1);
  if (e == T(1)) return x;
  if (e == T(0.5)) return R::sqrt(x);
  if (e == T(-0.5)) return R::rsqrt(x);
  if (e == T(-1)) return R::div(T(1), x);
  if (e == T(2)) return R::mul(x, x);
  if (e == T(3)) return R::mul(R::mul(x, x), x);
  if (e == T(-2)) return static_cast<T>(__ddiv_rn(1.0, static_cast<double>(R::mul(x, x))));
  return R::pow(x, e);
}

// clamp(CIoU(gt = box 1, pred = box 2), min=0) in reference.bbox_ciou's order of operations.
// g_wh = gt w * (gt h + eps) and g_atan = atan(gt w / (gt h + eps)) are the GT's own terms.
template <typename T>
__device__ __forceinline__ T overlap_of(T gx1, T gy1, T gx2, T gy2, T g_wh, T g_atan, const T* pb) {
  using R = RN<T>;
  const T eps = T(kCiouEps);
  const T px1 = pb[0], py1 = pb[1], px2 = pb[2], py2 = pb[3];
  const T w2 = R::sub(px2, px1);
  const T h2 = R::add(R::sub(py2, py1), eps);
  const T iw = clamp0(R::sub(nan_min(gx2, px2), nan_max(gx1, px1)));
  const T ih = clamp0(R::sub(nan_min(gy2, py2), nan_max(gy1, py1)));
  const T inter = R::mul(iw, ih);
  const T uni = R::add(R::sub(R::add(g_wh, R::mul(w2, h2)), inter), eps);
  const T iou = R::div(inter, uni);
  const T cw = R::sub(nan_max(gx2, px2), nan_min(gx1, px1));
  const T ch = R::sub(nan_max(gy2, py2), nan_min(gy1, py1));
  const T c2 = R::add(R::add(R::mul(cw, cw), R::mul(ch, ch)), eps);
  const T dx = R::sub(R::add(px1, px2), R::add(gx1, gx2));
  const T dy = R::sub(R::add(py1, py2), R::add(gy1, gy2));
  const T rho2 = R::mul(R::add(R::mul(dx, dx), R::mul(dy, dy)), T(0.25));  // /4, exact either way
  const T da = R::sub(R::atan(R::div(w2, h2)), g_atan);
  const T v = R::mul(T(kFourOverPi2), R::mul(da, da));
  const T alpha = R::div(v, R::add(R::sub(v, iou), T(1.0 + kCiouEps)));
  const T ciou = R::sub(iou, R::add(R::div(rho2, c2), R::mul(v, alpha)));
  return clamp0(ciou);  // keeps NaN, like torch.clamp
}

// ------------------------------------------------------------------------------------------------ grid
template <typename T>
__global__ void __launch_bounds__(kGridThreads) grid_kernel(const T* __restrict__ anc, int64_t A,
                                                             GridTable<T>* __restrict__ tab) {
  __shared__ int s_n, s_bad;
  __shared__ int64_t s_start[kMaxLevels];
  __shared__ unsigned long long s_w;
  const int tid = threadIdx.x;
  if (tid == 0) s_n = 0, s_bad = 0;
  __syncthreads();
  // (unrolled: one block walks all A anchors, so keep several loads in flight per thread)
#pragma unroll 4
  for (int64_t i = tid; i < A; i += blockDim.x) {
    if (i == 0 || anc[2 * i + 1] < anc[2 * i - 1]) {
      const int slot = atomicAdd(&s_n, 1);
      if (slot < kMaxLevels) s_start[slot] = i;
    }
  }
  __syncthreads();
  if (tid == 0) {
    if (s_n > kMaxLevels) {
      s_bad = 1;
    } else {  // a handful of starts found in any order: insertion sort
      for (int i = 1; i < s_n; ++i) {
        const int64_t v = s_start[i];
        int j = i;
        for (; j > 0 && s_start[j - 1] > v; --j) s_start[j] = s_start[j - 1];
        s_start[j] = v;
      }
    }
  }
  __syncthreads();
  const int n = s_n;
  for (int l = 0; l < n && !s_bad; ++l) {
    const int64_t s = s_start[l], e = (l + 1 < n) ? s_start[l + 1] : A, nl = e - s;
    const T x0 = anc[2 * s], y0 = anc[2 * s + 1];
    if (tid == 0) s_w = static_cast<unsigned long long>(nl);
    __syncthreads();
    // width = distance to the first anchor of the level off the first row
#pragma unroll 4
    for (int64_t i = s + 1 + tid; i < e; i += blockDim.x)
      if (anc[2 * i + 1] != y0) atomicMin(&s_w, static_cast<unsigned long long>(i - s));
    __syncthreads();
    const int64_t w = static_cast<int64_t>(s_w), h = nl / w;
    const T sx = w > 1 ? anc[2 * (s + 1)] - x0 : T(1);
    const T sy = h > 1 ? anc[2 * (s + w) + 1] - y0 : T(1);
    const bool good = w * h == nl && sx > T(0) && sy > T(0);
    bool off = false;
    // Every anchor within a quarter cell of its grid position: well inside the +-1 cell margin of the
    // scan's rectangles, so no candidate can be missed.
#pragma unroll 4
    for (int64_t i = s + tid; good && i < e; i += blockDim.x) {
      const int64_t j = i - s;
      const T xe = x0 + static_cast<T>(j % w) * sx, ye = y0 + static_cast<T>(j / w) * sy;
      const T dx = anc[2 * i] - xe, dy = anc[2 * i + 1] - ye;
      off |= !(fabs(dx) <= T(0.25) * sx && fabs(dy) <= T(0.25) * sy);
    }
    if (off) atomicOr(&s_bad, 1);
    __syncthreads();
    if (tid == 0) {
      if (!good) s_bad = 1;
      tab->start[l] = s;
      tab->w[l] = w;
      tab->h[l] = h;
      tab->x0[l] = x0;
      tab->y0[l] = y0;
      tab->sx[l] = sx;
      tab->sy[l] = sy;
    }
    __syncthreads();
  }
  if (tid == 0) {
    tab->nlv = n;
    tab->bad = s_bad;
  }
}

// Cells [i0, i1) of a row of n anchors at o + i*step that may lie inside (lo, hi): +-1 cell of margin.
template <typename T>
__device__ __forceinline__ void cell_range(T lo, T hi, T o, T step, int64_t n, int64_t& i0, int64_t& i1) {
  T q0 = (lo - o) / step, q1 = (hi - o) / step;
  const T lim = static_cast<T>(n + 2);
  q0 = is_nan(q0) ? lim : fmin(fmax(q0, T(-2)), lim);  // a NaN box gives an empty range
  q1 = is_nan(q1) ? T(-2) : fmin(fmax(q1, T(-2)), lim);
  i0 = i64max(static_cast<int64_t>(floor(q0)), 0);
  i1 = i64min(static_cast<int64_t>(floor(q1)) + 2, n);
}

// ------------------------------------------------------------------------------------------------ scan
// scan_kernel runs DESIGN §2.1's first phases for one GT, each a __device__ function below: candidates
// (gt_box, candidate_rects, rect_anchor, is_candidate), metric (overlap_of, align_of), top-k (topk_merge)
// and the GT's part of the conflicts (note_conflict over all candidates, commit_picks for its top-k).
// resolve_kernel finishes the conflicts, write_kernel writes the targets.
template <typename T>
struct ScanParams {
  const T* scores;
  const T* pbox;
  const T* anc;
  const T* gt;
  const int64_t* labels;
  const bool* real;
  const GridTable<T>* tab;
  int* cnt;
  int* owner;
  uint64_t* best;
  int* bestg;
  T* sel_al;
  T* sel_ov;
  int64_t A, C, M;
  int k;
  T alpha, beta, eps;
};

// One GT as its candidates and metric read it.
template <typename T>
struct GtBox {
  T x1, y1, x2, y2;      // the GT (CIoU's box 1)
  T ex1, ey1, ex2, ey2;  // its candidate box: sides under kSmallGtSide widened to it about the centre
  T wh, atan;            // CIoU's GT terms: w * (h + eps), atan(w / (h + eps))
  int64_t lab;           // its class, clamped to [0, C)
};

// Candidates, 1: the GT's boxes and terms (reference rule 1 for the widening).
template <typename T>
__device__ __forceinline__ GtBox<T> gt_box(const ScanParams<T>& p, int64_t bg) {
  using R = RN<T>;
  GtBox<T> o;
  o.x1 = p.gt[4 * bg], o.y1 = p.gt[4 * bg + 1], o.x2 = p.gt[4 * bg + 2], o.y2 = p.gt[4 * bg + 3];
  const T side = T(kSmallGtSide), half = T(kSmallGtSide / 2);
  const T cx = R::mul(R::add(o.x1, o.x2), T(0.5)), cy = R::mul(R::add(o.y1, o.y2), T(0.5));
  const bool wide_x = R::sub(o.x2, o.x1) < side, wide_y = R::sub(o.y2, o.y1) < side;
  o.ex1 = wide_x ? R::sub(cx, half) : o.x1, o.ex2 = wide_x ? R::add(cx, half) : o.x2;
  o.ey1 = wide_y ? R::sub(cy, half) : o.y1, o.ey2 = wide_y ? R::add(cy, half) : o.y2;
  const T g_w = R::sub(o.x2, o.x1), g_h = R::add(R::sub(o.y2, o.y1), T(kCiouEps));
  o.wh = R::mul(g_w, g_h), o.atan = R::atan(R::div(g_w, g_h));
  o.lab = i64clamp(p.labels[bg], 0, p.C - 1);
  return o;
}

// A GT's candidate anchors as index rectangles, one per level, numbered one after another: rectangle r
// holds positions [off[r], off[r + 1]) (in shared memory, written by thread 0).
struct CandRects {
  int64_t lstart[kMaxLevels], lw[kMaxLevels], ix0[kMaxLevels], iy0[kMaxLevels], rw[kMaxLevels];
  int64_t off[kMaxLevels + 1];
  int n;
};

// Candidates, 2: the rectangles of each level that may hold anchors inside the candidate box, or every
// anchor as one row when the grid table is bad.
template <typename T>
__device__ __forceinline__ void candidate_rects(const ScanParams<T>& p, const GtBox<T>& gb, CandRects& r) {
  const bool grid = !p.tab->bad && p.tab->nlv <= kMaxLevels;
  // a negative eps admits anchors just outside the box: widen the searched rectangle by it
  const T m = p.eps < T(0) ? -p.eps : T(0);
  int nl = 0;
  int64_t off = 0;
  for (int l = 0; grid && l < p.tab->nlv; ++l) {
    int64_t ix0, ix1, iy0, iy1;
    cell_range(gb.ex1 - m, gb.ex2 + m, p.tab->x0[l], p.tab->sx[l], p.tab->w[l], ix0, ix1);
    cell_range(gb.ey1 - m, gb.ey2 + m, p.tab->y0[l], p.tab->sy[l], p.tab->h[l], iy0, iy1);
    if (ix1 <= ix0 || iy1 <= iy0) continue;
    r.lstart[nl] = p.tab->start[l];
    r.lw[nl] = p.tab->w[l];
    r.ix0[nl] = ix0;
    r.iy0[nl] = iy0;
    r.rw[nl] = ix1 - ix0;
    r.off[nl] = off;
    off += (ix1 - ix0) * (iy1 - iy0);
    ++nl;
  }
  if (!grid) {  // every anchor, as one row
    r.lstart[0] = 0, r.lw[0] = p.A, r.ix0[0] = 0, r.iy0[0] = 0, r.rw[0] = p.A, r.off[0] = 0;
    off = p.A;
    nl = 1;
  }
  r.off[nl] = off;
  r.n = nl;
}

// Candidates, 3: the anchor at position pp (< r.off[nl]) of the nl = r.n rectangles.
__device__ __forceinline__ int rect_anchor(const CandRects& r, int nl, int64_t pp) {
  int l = 0;
  while (l + 1 < nl && pp >= r.off[l + 1]) ++l;
  const int64_t q = pp - r.off[l];
  return static_cast<int>(r.lstart[l] + (r.iy0[l] + q / r.rw[l]) * r.lw[l] + r.ix0[l] + q % r.rw[l]);
}

// Candidates, 4: the exact test, anchor centre strictly inside the candidate box by more than eps.
template <typename T>
__device__ __forceinline__ bool is_candidate(const ScanParams<T>& p, const GtBox<T>& gb, int a) {
  using R = RN<T>;
  const T ax = p.anc[2 * a], ay = p.anc[2 * a + 1];
  return R::sub(ax, gb.ex1) > p.eps && R::sub(ay, gb.ey1) > p.eps && R::sub(gb.ex2, ax) > p.eps &&
         R::sub(gb.ey2, ay) > p.eps;
}

// Metric: align = score^alpha * overlap^beta of the GT's class.
template <typename T>
__device__ __forceinline__ T align_of(const ScanParams<T>& p, int64_t lab, int64_t row, T ov) {
  return RN<T>::mul(pow_torch(p.scores[row * p.C + lab], p.alpha), pow_torch(ov, p.beta));
}

// Conflicts, over ALL candidates of every GT: PASS 1 maxes the anchor's key; float: (overlap bits, lowest
// GT) in one key, float64: the overlap bits, whose ties PASS 2 resolves with an atomicMin of the GT index
// (only on anchors that two or more GTs picked: the others never read it).
template <typename T, int PASS>
__device__ __forceinline__ void note_conflict(const ScanParams<T>& p, int g, int64_t row, T ov) {
  const uint64_t bits = ordered_bits(ov);
  if (PASS == 1) {
    const uint64_t key = sizeof(T) == 4 ? (bits << 32) | static_cast<uint64_t>(0x7FFFFFFF - g) : bits;
    // keys only grow: a stale read below the current value just costs an atomic that changes nothing
    if (key > __ldcg(reinterpret_cast<const unsigned long long*>(p.best + row)))
      atomic_max_u64(p.best + row, key);
  } else if (p.cnt[row] >= 2 && p.best[row] == bits) {
    atomicMin(p.bestg + row, g);
  }
}

// The top-k rank key: NaN ranks above everything (as in torch.sort), and only align > 0 or NaN enters.
template <typename T>
__device__ __forceinline__ T rank_key(T al) {
  return is_nan(al) ? T(INFINITY) : al;
}
template <typename T>
__device__ __forceinline__ bool better(T ka, int ia, T kb, int ib) {
  return ka > kb || (ka == kb && ia < ib);
}

// The GT's top-k in dynamic shared memory: the buffer (best first) in al/ov/idx[0, n), staging for a tile's
// entrants after it (cap = k + kScanThreads slots), and t_* (k slots) for the merged order.
template <typename T>
struct TopkBuf {
  T *al, *ov, *t_al, *t_ov;
  int *idx, *t_idx;
};

template <typename T>
__device__ __forceinline__ TopkBuf<T> topk_buf(unsigned char* smem, int k) {
  const int cap = k + kScanThreads;
  TopkBuf<T> t;
  t.al = reinterpret_cast<T*>(smem);
  t.ov = t.al + cap;
  t.t_al = t.ov + cap;
  t.t_ov = t.t_al + k;
  t.idx = reinterpret_cast<int*>(t.t_ov + k);
  t.t_idx = t.idx + cap;
  return t;
}

// Top-k: merges one tile's entries (this thread's: anchor a, align al, overlap ov, if cand) into the
// buffer of n_buf (block-uniform); returns the new size. Every thread of the block calls it.
template <typename T>
__device__ __forceinline__ int topk_merge(const TopkBuf<T>& t, int n_buf, int k, bool cand, int a, T al, T ov,
                                          int& s_q) {
  const int tid = threadIdx.x;
  const T key = rank_key(al);
  bool enter = false;
  if (cand && (al > T(0) || is_nan(al)))
    enter = n_buf < k || better(key, a, rank_key(t.al[n_buf - 1]), t.idx[n_buf - 1]);
  const int nq = __syncthreads_count(enter);
  if (nq == 0) return n_buf;
  if (enter) {
    const int slot = n_buf + atomicAdd(&s_q, 1);
    t.al[slot] = al;
    t.ov[slot] = ov;
    t.idx[slot] = a;
  }
  __syncthreads();
  // Rank every entry of buffer + staging in the total order (key desc, anchor asc); the k best move to
  // t_* at their rank. The buffer is sorted: its entries' own rank among it is their position, and a
  // staged entry's is found by binary search.
  const int n_all = n_buf + nq;
  for (int i = tid; i < n_all; i += kScanThreads) {
    const T ki = rank_key(t.al[i]);
    const int ii = t.idx[i];
    int rank;
    if (i < n_buf) {
      rank = i;
    } else {
      int lo = 0, hi = n_buf;
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (better(rank_key(t.al[mid]), t.idx[mid], ki, ii)) lo = mid + 1;
        else hi = mid;
      }
      rank = lo;
    }
    for (int j = n_buf; j < n_all; ++j) rank += better(rank_key(t.al[j]), t.idx[j], ki, ii);
    if (rank < k) {
      t.t_al[rank] = t.al[i];
      t.t_ov[rank] = t.ov[i];
      t.t_idx[rank] = ii;
    }
  }
  __syncthreads();
  n_buf = min(n_all, k);
  for (int i = tid; i < n_buf; i += kScanThreads) {
    t.al[i] = t.t_al[i];
    t.ov[i] = t.t_ov[i];
    t.idx[i] = t.t_idx[i];
  }
  if (tid == 0) s_q = 0;
  __syncthreads();
  return n_buf;
}

// Conflicts, the GT's picks: a count per anchor, the picker and its align/overlap (read only where exactly
// one GT picked the anchor). NaN aligns held top-k slots (as in the reference's sort) but are never picks.
template <typename T>
__device__ __forceinline__ void commit_picks(const ScanParams<T>& p, const TopkBuf<T>& t, int n_buf, int g,
                                             int64_t a_base) {
  for (int i = threadIdx.x; i < n_buf; i += kScanThreads) {
    if (!(t.al[i] > T(0))) continue;
    const int64_t row = a_base + t.idx[i];
    atomicAdd(p.cnt + row, 1);
    atomicMax(p.owner + row, g);
    p.sel_al[row] = t.al[i];
    p.sel_ov[row] = t.ov[i];
  }
}

template <typename T, int PASS>
__global__ void __launch_bounds__(kScanThreads) scan_kernel(const ScanParams<T> p) {
  const int g = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
  const int64_t bg = static_cast<int64_t>(b) * p.M + g;
  if (!p.real[bg]) return;  // block-uniform
  const int64_t a_base = static_cast<int64_t>(b) * p.A;
  __shared__ CandRects s_rects;
  __shared__ int s_q;
  const GtBox<T> gb = gt_box(p, bg);
  if (tid == 0) {
    candidate_rects(p, gb, s_rects);
    s_q = 0;
  }
  __syncthreads();
  const int nl = s_rects.n;
  const int64_t total = s_rects.off[nl];
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const TopkBuf<T> buf = topk_buf<T>(smem_raw, p.k);
  int n_buf = 0;  // block-uniform

  for (int64_t p0 = 0; p0 < total; p0 += kScanThreads) {
    const int64_t pp = p0 + tid;
    bool cand = false;
    int a = 0;
    T al = T(0), ov = T(0);
    if (pp < total) {
      a = rect_anchor(s_rects, nl, pp);
      cand = is_candidate(p, gb, a);
      if (cand) {
        const int64_t row = a_base + a;
        ov = overlap_of(gb.x1, gb.y1, gb.x2, gb.y2, gb.wh, gb.atan, p.pbox + 4 * row);
        note_conflict<T, PASS>(p, g, row, ov);
        if (PASS == 1) al = align_of(p, gb.lab, row, ov);
      }
    }
    if (PASS == 1) n_buf = topk_merge(buf, n_buf, p.k, cand, a, al, ov, s_q);
  }
  if (PASS == 1) commit_picks(p, buf, n_buf, g, a_base);
}

// --------------------------------------------------------------------------------------------- resolve
template <typename T>
struct ResolveParams {
  const T* scores;
  const int64_t* labels;
  const int* cnt;
  const int* owner;
  const uint64_t* best;
  const int* bestg;
  T* sel_al;
  T* sel_ov;
  uint64_t* pal;
  uint64_t* pov;
  bool* fg;
  int64_t* gt_idx;
  int64_t A, C, M, BA;
  T alpha, beta;
  bool defer_max;  // a second top-k follows: it takes the per-GT maxima over the positives it keeps
};

template <typename T>
__global__ void __launch_bounds__(kResolveThreads) resolve_kernel(const ResolveParams<T> p) {
  using R = RN<T>;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kResolveThreads + threadIdx.x;
  if (row >= p.BA) return;
  const int64_t b = row / p.A;
  const int c = p.cnt[row];
  int64_t g = 0;
  T al = T(0), ov = T(0);
  bool fg = false;
  if (c >= 2) {  // the best-overlap candidate GT among ALL of them, even one that did not pick the anchor
    const uint64_t key = p.best[row];
    if (sizeof(T) == 4) {
      g = 0x7FFFFFFF - static_cast<int64_t>(key & 0xFFFFFFFFull);
      ov = from_ordered_bits<T>(key >> 32);
    } else {
      g = p.bestg[row];
      ov = from_ordered_bits<T>(key);
    }
    if (g >= 0 && g < p.M) {  // always, unless the scan was inconsistent: then never index out of range
      const int64_t lab = i64clamp(p.labels[b * p.M + g], 0, p.C - 1);
      al = R::mul(pow_torch(p.scores[row * p.C + lab], p.alpha), pow_torch(ov, p.beta));
      fg = al > T(0);  // the winner of a conflict may have align 0: then the anchor is not positive
    }
  } else if (c == 1) {
    g = p.owner[row];
    al = p.sel_al[row];
    ov = p.sel_ov[row];
    fg = al > T(0);
  }
  p.fg[row] = fg;
  p.gt_idx[row] = fg ? g : 0;
  p.sel_al[row] = fg ? al : T(0);
  if (p.defer_max) {
    p.sel_ov[row] = ov;
  } else if (fg) {
    atomic_max_u64(p.pal + b * p.M + g, ordered_bits(al));
    atomic_max_u64(p.pov + b * p.M + g, ordered_bits(ov));
  }
}

// ---------------------------------------------------------------------------------------- second top-k
// YOLO26's topk2 (spec §4.3 step 4b): each GT keeps the k2 of its positives with the largest raw align
// (ties to the lower anchor index), its own picks and anchors won by overlap alike. Round r finds each
// GT's r-th best among the positives not yet kept: the max align bits (STEP 0), then the lowest anchor with
// them (STEP 1); integer atomics, so the order of the threads does not matter. Slots O(B*M*k2).
struct Topk2Params {
  bool* fg;
  int64_t* gt_idx;
  uint64_t* t2_al;
  int* t2_a;
  uint64_t* pal;
  uint64_t* pov;
  int64_t A, M, BA, BM;
  int k2;
};

// Whether anchor a is among the picks of rounds [0, r) of GT slot bg.
__device__ __forceinline__ bool kept_before(const int* t2_a, int64_t bg, int64_t BM, int r, int a) {
  for (int j = 0; j < r; ++j)
    if (t2_a[j * BM + bg] == a) return true;
  return false;
}

template <typename T, int STEP>
__global__ void __launch_bounds__(kResolveThreads) topk2_round_kernel(const Topk2Params p, const T* sel_al,
                                                                        int r) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kResolveThreads + threadIdx.x;
  if (row >= p.BA || !p.fg[row]) return;
  const int a = static_cast<int>(row % p.A);
  const int64_t bg = (row / p.A) * p.M + p.gt_idx[row];
  if (kept_before(p.t2_a, bg, p.BM, r, a)) return;
  const uint64_t bits = ordered_bits(sel_al[row]);
  if (STEP == 0)
    atomic_max_u64(p.t2_al + r * p.BM + bg, bits);
  else if (p.t2_al[r * p.BM + bg] == bits)
    atomicMin(p.t2_a + r * p.BM + bg, a);
}

// The positives no round kept become background; the kept ones give their GT's pos_align / pos_overlap.
template <typename T>
__global__ void __launch_bounds__(kResolveThreads) topk2_keep_kernel(const Topk2Params p, T* sel_al,
                                                                       const T* sel_ov) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kResolveThreads + threadIdx.x;
  if (row >= p.BA || !p.fg[row]) return;
  const int64_t bg = (row / p.A) * p.M + p.gt_idx[row];
  if (!kept_before(p.t2_a, bg, p.BM, p.k2, static_cast<int>(row % p.A))) {
    p.fg[row] = false;
    p.gt_idx[row] = 0;
    sel_al[row] = T(0);
    return;
  }
  atomic_max_u64(p.pal + bg, ordered_bits(sel_al[row]));
  atomic_max_u64(p.pov + bg, ordered_bits(sel_ov[row]));
}

// ----------------------------------------------------------------------------------------------- write
template <typename T>
struct WriteParams {
  const bool* fg;
  const int64_t* gt_idx;
  const T* sel_al;
  const uint64_t* pal;
  const uint64_t* pov;
  const int64_t* labels;
  const T* gt;
  int64_t* out_labels;
  T* out_boxes;
  T* out_scores;
  int64_t A, C, M, BA;
  T eps;
};

template <typename T>
__global__ void __launch_bounds__(kWriteThreads) write_kernel(const WriteParams<T> p) {
  using R = RN<T>;
  __shared__ T s_norm[kWriteRows];
  __shared__ int64_t s_lab[kWriteRows];
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kWriteRows;
  const int nrows = static_cast<int>(i64min(kWriteRows, p.BA - r0));
  const int tid = threadIdx.x;
  if (tid < nrows) {
    const int64_t row = r0 + tid, b = row / p.A;
    const bool fg = p.fg[row];
    const int64_t bg = b * p.M + p.gt_idx[row];
    T norm = T(0);
    if (fg) {
      const T pa = from_ordered_bits<T>(p.pal[bg]), po = from_ordered_bits<T>(p.pov[bg]);
      norm = R::div(R::mul(p.sel_al[row], po), R::add(pa, p.eps));
    }
    const int64_t lab = p.labels[bg];
    p.out_labels[row] = i64max(lab, 0);
    for (int j = 0; j < 4; ++j) p.out_boxes[4 * row + j] = p.gt[4 * bg + j];
    s_norm[tid] = norm;
    s_lab[tid] = i64clamp(lab, 0, p.C - 1);
  }
  __syncthreads();
  // the rows are contiguous: write them as one coalesced run of nrows * C values
  const int64_t n = static_cast<int64_t>(nrows) * p.C;
  T* out = p.out_scores + r0 * p.C;
  for (int64_t e = tid; e < n; e += kWriteThreads) {
    const int r = static_cast<int>(e / p.C);
    const int64_t c = e - r * p.C;
    out[e] = c == s_lab[r] ? s_norm[r] : T(0);
  }
}

// ---------------------------------------------------------------------------------------------- launch
template <typename T>
cudaError_t launch_impl(const TalShape& s, const TalArgs& a, cudaStream_t st) {
  const bool f64 = sizeof(T) == 8;
  const Layout L(s, f64);
  unsigned char* ws = static_cast<unsigned char*>(a.workspace);
  const int64_t BA = s.B * s.A;
  auto* tab = reinterpret_cast<GridTable<T>*>(ws + L.table);
  auto* cnt = reinterpret_cast<int*>(ws + L.cnt);
  auto* owner = reinterpret_cast<int*>(ws + L.owner);
  auto* best = reinterpret_cast<uint64_t*>(ws + L.best);
  auto* pal = reinterpret_cast<uint64_t*>(ws + L.pal);
  auto* pov = reinterpret_cast<uint64_t*>(ws + L.pov);
  auto* bestg = reinterpret_cast<int*>(ws + L.bestg);
  auto* sel_al = reinterpret_cast<T*>(ws + L.sel_al);
  auto* sel_ov = reinterpret_cast<T*>(ws + L.sel_ov);
  auto* t2_al = reinterpret_cast<uint64_t*>(ws + L.t2_al);
  auto* t2_a = reinterpret_cast<int*>(ws + L.t2_a);
  if (BA == 0) return cudaSuccess;

  YF_RETURN_IF_ERROR(cudaMemsetAsync(ws, 0, L.zero_bytes, st));
  if (f64) YF_RETURN_IF_ERROR(cudaMemsetAsync(bestg, 0x7F, static_cast<size_t>(BA) * sizeof(int), st));
  if (s.k2 > 0)
    YF_RETURN_IF_ERROR(cudaMemsetAsync(t2_a, 0x7F, static_cast<size_t>(s.k2 * s.B * s.M) * sizeof(int), st));
  const T* anc = static_cast<const T*>(a.anc);
  grid_kernel<T><<<1, kGridThreads, 0, st>>>(anc, s.A, tab);
  YF_CHECK_LAUNCH();

  if (s.k > 0 && s.M > 0) {
    ScanParams<T> sp;
    sp.scores = static_cast<const T*>(a.scores);
    sp.pbox = static_cast<const T*>(a.pbox);
    sp.anc = anc;
    sp.gt = static_cast<const T*>(a.gt);
    sp.labels = a.labels;
    sp.real = a.real;
    sp.tab = tab;
    sp.cnt = cnt;
    sp.owner = owner;
    sp.best = best;
    sp.bestg = bestg;
    sp.sel_al = sel_al;
    sp.sel_ov = sel_ov;
    sp.A = s.A;
    sp.C = s.C;
    sp.M = s.M;
    sp.k = static_cast<int>(s.k);
    sp.alpha = static_cast<T>(s.alpha);
    sp.beta = static_cast<T>(s.beta);
    sp.eps = static_cast<T>(s.eps);
    const int cap = sp.k + kScanThreads;
    const size_t smem = (2 * static_cast<size_t>(cap) + 2 * sp.k) * sizeof(T) + (cap + sp.k) * sizeof(int);
    const dim3 grid(static_cast<unsigned>(s.M), static_cast<unsigned>(s.B));
    scan_kernel<T, 1><<<grid, kScanThreads, smem, st>>>(sp);
    YF_CHECK_LAUNCH();
    if (f64) {
      scan_kernel<T, 2><<<grid, kScanThreads, smem, st>>>(sp);
      YF_CHECK_LAUNCH();
    }
  }

  ResolveParams<T> rp;
  rp.scores = static_cast<const T*>(a.scores);
  rp.labels = a.labels;
  rp.cnt = cnt;
  rp.owner = owner;
  rp.best = best;
  rp.bestg = bestg;
  rp.sel_al = sel_al;
  rp.sel_ov = sel_ov;
  rp.pal = pal;
  rp.pov = pov;
  rp.fg = a.out_fg;
  rp.gt_idx = a.out_gt_idx;
  rp.A = s.A;
  rp.C = s.C;
  rp.M = s.M;
  rp.BA = BA;
  rp.alpha = static_cast<T>(s.alpha);
  rp.beta = static_cast<T>(s.beta);
  rp.defer_max = s.k2 > 0;
  const unsigned n_res = static_cast<unsigned>(ceil_div(BA, kResolveThreads));
  resolve_kernel<T><<<n_res, kResolveThreads, 0, st>>>(rp);
  YF_CHECK_LAUNCH();

  if (s.k2 > 0) {
    const Topk2Params tp{a.out_fg, a.out_gt_idx, t2_al, t2_a, pal, pov, s.A, s.M, BA, s.B * s.M,
                         static_cast<int>(s.k2)};
    for (int r = 0; r < tp.k2; ++r) {
      topk2_round_kernel<T, 0><<<n_res, kResolveThreads, 0, st>>>(tp, sel_al, r);
      YF_CHECK_LAUNCH();
      topk2_round_kernel<T, 1><<<n_res, kResolveThreads, 0, st>>>(tp, sel_al, r);
      YF_CHECK_LAUNCH();
    }
    topk2_keep_kernel<T><<<n_res, kResolveThreads, 0, st>>>(tp, sel_al, sel_ov);
    YF_CHECK_LAUNCH();
  }

  WriteParams<T> wp;
  wp.fg = a.out_fg;
  wp.gt_idx = a.out_gt_idx;
  wp.sel_al = sel_al;
  wp.pal = pal;
  wp.pov = pov;
  wp.labels = a.labels;
  wp.gt = static_cast<const T*>(a.gt);
  wp.out_labels = a.out_labels;
  wp.out_boxes = static_cast<T*>(a.out_boxes);
  wp.out_scores = static_cast<T*>(a.out_scores);
  wp.A = s.A;
  wp.C = s.C;
  wp.M = s.M;
  wp.BA = BA;
  wp.eps = static_cast<T>(s.eps);
  write_kernel<T><<<static_cast<unsigned>(ceil_div(BA, kWriteRows)), kWriteThreads, 0, st>>>(wp);
  YF_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace

size_t tal_assign_workspace_bytes(const TalShape& s, bool f64) { return Layout(s, f64).total; }

cudaError_t tal_assign_launch(const TalShape& s, const TalArgs& a, bool f64, cudaStream_t stream) {
  return f64 ? launch_impl<double>(s, a, stream) : launch_impl<float>(s, a, stream);
}

}  // namespace cuda
}  // namespace yolofast
