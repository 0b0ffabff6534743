// Fused CIoU box loss + DFL + BCE class loss with their gradients on the GPU (DESIGN §2.2); the spec is
// reference.bbox_loss_ref and the formulas (and their derivation) follow csrc/cpu/bbox_loss_kernel.cpp.
//
// Two launches, no float atomics (run-to-run identical):
//   1. loss_kernel: one warp per anchor row (8 rows per warp, 64 per block). Lanes run over the C classes
//      (BCE and its gradient sigmoid(x) - t, coalesced) and, for a foreground row, over the 4 x R DFL bins
//      of each side (softmax and expectation by warp butterflies, so every lane holds the same sums);
//      the decoded box, CIoU and its gradient (alpha held constant) are scalar work that every lane repeats.
//      Background rows get zero box/DFL gradients. Each block writes 4 partial sums (box, cls, dfl, sum t)
//      in float64, reduced in a fixed order.
//   2. reduce_kernel (one block): adds the partials in a fixed tree order, S = max(sum t, 1), writes
//      [L_box, L_cls, L_dfl] / S and 1/S on the device (no host sync; CUDA-graph capturable).
// Gradients written are those of S*L_box, S*L_dfl (w.r.t. pred_dist) and S*L_cls (w.r.t. pred_scores);
// backward only scales them (yolofast/ops/_library.py).
// reg_max 1 (YOLO26, bbox_loss_l1_launch): the 4 values per row are raw distances (no softmax; the CIoU
// gradient is theirs), and the third loss is the L1 term of the distances x stride / (W, H) instead of DFL
// (YOLO11_YOLO26.md §4.2, the same formulas as csrc/cpu/bbox_loss_core.h's box_l1_tail).
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "constants.h"
#include "cuda_common.cuh"
#include "cuda_launchers.h"

namespace yolofast {
namespace cuda {
namespace {

constexpr int kWarps = 8;
constexpr int kRowsPerWarp = 8;
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;
constexpr int kThreads = kWarps * 32;
constexpr int kReduceThreads = 256;

template <typename T>
struct Math;
template <>
struct Math<float> {
  static __device__ __forceinline__ float exp(float x) { return ::expf(x); }
  static __device__ __forceinline__ float log(float x) { return ::logf(x); }
  static __device__ __forceinline__ float log1p(float x) { return ::log1pf(x); }
  static __device__ __forceinline__ float atan(float x) { return ::atanf(x); }
  static __device__ __forceinline__ float floor(float x) { return ::floorf(x); }
};
template <>
struct Math<double> {
  static __device__ __forceinline__ double exp(double x) { return ::exp(x); }
  static __device__ __forceinline__ double log(double x) { return ::log(x); }
  static __device__ __forceinline__ double log1p(double x) { return ::log1p(x); }
  static __device__ __forceinline__ double atan(double x) { return ::atan(x); }
  static __device__ __forceinline__ double floor(double x) { return ::floor(x); }
};

// d min(a, b) / d a as torch.minimum's backward has it: 1 if a < b, 1/2 on a tie, 0 otherwise.
template <typename T>
__device__ __forceinline__ T d_min(T a, T b) {
  return a < b ? T(1) : (a == b ? T(0.5) : T(0));
}
template <typename T>
__device__ __forceinline__ T d_max(T a, T b) {
  return a > b ? T(1) : (a == b ? T(0.5) : T(0));
}

template <typename T>
struct LossParams {
  const T* pd;
  const T* ps;
  const T* anc;
  const T* tb;
  const T* ts;
  const bool* fg;
  T* gbox;
  T* gdfl;
  T* gs;
  double* part;
  int64_t N, A, C;
  int R;
  // reg_max 1 only: each anchor's stride (A,) and the batch image's width and height (the L1 term).
  const T* l1_stride;
  T l1_w, l1_h;
};

// CIoU(pred = box 1 (x1, y1, x2, y2), target = box 2 (X1, Y1, X2, Y2)) weighted by w: adds (1 - CIoU)*w to
// lbox and writes gE, the gradient of that term w.r.t. the distances (l, t, r, b) = (ax - x1, ay - y1,
// x2 - ax, y2 - ay). Scalar work, the same in every lane that calls it.
template <typename T>
__device__ __forceinline__ void ciou_grad(T x1, T y1, T x2, T y2, T X1, T Y1, T X2, T Y2, T w, T& lbox, T gE[4]) {
  using F = Math<T>;
  const T eps = T(kCiouEps), K = T(kFourOverPi2);
  const T w1 = x2 - x1, h1 = y2 - y1 + eps;
  const T w2 = X2 - X1, h2 = Y2 - Y1 + eps;
  const T ihx = nan_min(x2, X2), ilx = nan_max(x1, X1);
  const T ihy = nan_min(y2, Y2), ily = nan_max(y1, Y1);
  const T iw_raw = ihx - ilx, ih_raw = ihy - ily;
  const T iw = iw_raw > T(0) ? iw_raw : T(0);
  const T ih = ih_raw > T(0) ? ih_raw : T(0);
  const T inter = iw * ih;
  const T uni = w1 * h1 + w2 * h2 - inter + eps;
  const T iou = inter / uni;
  const T cw = nan_max(x2, X2) - nan_min(x1, X1);
  const T ch = nan_max(y2, Y2) - nan_min(y1, Y1);
  const T c2 = cw * cw + ch * ch + eps;
  const T dx = (X1 + X2) - (x1 + x2), dy = (Y1 + Y2) - (y1 + y2);
  const T rho2 = (dx * dx + dy * dy) / T(4);
  const T q1 = w1 / h1;
  const T da = F::atan(w2 / h2) - F::atan(q1);
  const T v = K * da * da;
  const T alpha = v / (v - iou + (T(1) + eps));  // a constant in the gradient
  const T ciou = iou - (rho2 / c2 + v * alpha);
  lbox += (T(1) - ciou) * w;

  // ---- CIoU backward: g = d[(1 - ciou) * w] / d ciou. Subgradients as autograd's: clamp(min=0) passes
  // the gradient at exactly 0, minimum/maximum split it evenly on a tie.
  const T g = -w;
  const T g_inter_iou = g / uni;
  const T g_union = -g * iou / uni;
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
  const T g_q1 = -(g_v * K * T(2) * da) / (T(1) + q1 * q1);  // d atan(q)/dq = 1/(1+q^2)
  g_w1 += g_q1 / h1;
  g_h1 -= g_q1 * w1 / (h1 * h1);
  g_x2 += g_w1;
  g_x1 -= g_w1;
  g_y2 += g_h1;
  g_y1 -= g_h1;
  gE[0] = -g_x1, gE[1] = -g_y1, gE[2] = g_x2, gE[3] = g_y2;
}

// reg_max 1: the L1 term of one foreground row and its gradient, the CIoU gradient gE written as the raw
// distances' own. t = (ax - x1, ay - y1, x2 - ax, y2 - ay) unclamped (targets of enlarged small GTs can be
// negative), d = p*s/D - t*s/D per side (D = W for l, r and H for t, b), l1 = mean |d| in the reference's
// order; gradient of l1 * w: w/4 * sign(d) * s/D (abs' subgradient 0 at 0, as autograd's).
template <typename T>
__device__ __forceinline__ void l1_row(const LossParams<T>& p, int64_t n, int64_t a, const T E[4], const T gE[4],
                                       T w, int lane, T& ll1) {
  const T* tb = p.tb + 4 * n;
  const T ax = p.anc[2 * a], ay = p.anc[2 * a + 1], s = p.l1_stride[a];
  const T td[4] = {ax - tb[0], ay - tb[1], tb[2] - ax, tb[3] - ay};
  const T D[4] = {p.l1_w, p.l1_h, p.l1_w, p.l1_h};
  const T cd = w / T(4);
  T l1 = T(0);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const T d = (E[k] * s) / D[k] - (td[k] * s) / D[k];
    l1 += fabs(d);
    if (lane == k) {  // one lane per side writes the row's 4 gradients
      const T sign = d > T(0) ? T(1) : (d < T(0) ? T(-1) : T(0));
      p.gbox[n * 4 + k] = gE[k];
      p.gdfl[n * 4 + k] = (cd * sign) * s / D[k];
    }
  }
  ll1 += (l1 / T(4)) * w;
}

// Box (CIoU) and DFL terms of one foreground row, weighted by w; writes the row's 4R gradients of both
// and returns (1 - CIoU)*w and mean_sides(dfl)*w. Called by a whole warp (all lanes get the same sums).
template <typename T>
__device__ __forceinline__ void box_dfl_row(const LossParams<T>& p, int64_t n, T w, int lane, T& lbox,
                                            T& ldfl) {
  using F = Math<T>;
  const int R = p.R, R4 = 4 * R;
  const T* z = p.pd + n * R4;
  T* gb = p.gbox + n * R4;
  T* gd = p.gdfl + n * R4;

  // softmax per side over R <= 64 bins: bins lane and lane + 32 of each side live in this lane
  T pr[4][2], E[4], base[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if (R == 1) {  // raw distances (YOLO26): no bins to soften
      E[k] = z[k];
      continue;
    }
    T zv[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int j = lane + 32 * t;
      zv[t] = j < R ? z[k * R + j] : T(-INFINITY);
    }
    const T mx = warp_max(zv[0] > zv[1] ? zv[0] : zv[1]);
    T ev[2];
#pragma unroll
    for (int t = 0; t < 2; ++t) ev[t] = lane + 32 * t < R ? F::exp(zv[t] - mx) : T(0);
    const T sum = warp_sum(ev[0] + ev[1]);
    T ex = T(0);
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      pr[k][t] = ev[t] / sum;
      ex += pr[k][t] * static_cast<T>(lane + 32 * t);
    }
    E[k] = warp_sum(ex);
    base[k] = mx + F::log(sum);  // log_softmax = z - base
  }

  const int64_t a = n % p.A;
  const T ax = p.anc[2 * a], ay = p.anc[2 * a + 1];
  const T* tb = p.tb + 4 * n;

  // ---- CIoU(pred = box 1, target = box 2), forward in the reference's order, and its gradient
  const T X1 = tb[0], Y1 = tb[1], X2 = tb[2], Y2 = tb[3];
  T gE[4];
  ciou_grad(ax - E[0], ay - E[1], ax + E[2], ay + E[3], X1, Y1, X2, Y2, w, lbox, gE);
  if (R == 1) return l1_row(p, n, a, E, gE, w, lane, ldfl);

  // ---- DFL: targets clamped to [0, R - 1 - 0.01] so that bin tl + 1 exists
  const T hi = static_cast<T>(static_cast<double>(R) - 1 - 0.01);
  const T td[4] = {ax - X1, ay - Y1, X2 - ax, Y2 - ay};
  const T cd = w / T(4);  // mean over the 4 sides, times the weight
  T dfl = T(0);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    T t = td[k] < T(0) ? T(0) : td[k];
    t = t > hi ? hi : t;
    const T tlf = F::floor(t);
    const int tl = min(max(static_cast<int>(tlf), 0), R - 2);  // the clamp only guards a NaN target
    const T wl = (tlf + T(1)) - t;
    const T wr = T(1) - wl;
    dfl += wl * (z[k * R + tl] - base[k]) + wr * (z[k * R + tl + 1] - base[k]);
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int j = lane + 32 * s;
      if (j >= R) continue;
      const T pj = pr[k][s];
      gb[k * R + j] = gE[k] * pj * (static_cast<T>(j) - E[k]);
      T gj = cd * (wl + wr) * pj;
      if (j == tl) gj -= cd * wl;
      if (j == tl + 1) gj -= cd * wr;
      gd[k * R + j] = gj;
    }
  }
  ldfl += -dfl / T(4) * w;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) loss_kernel(const LossParams<T> p) {
  using F = Math<T>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + warp * kRowsPerWarp;
  const int R4 = 4 * p.R;
  T acc_cls = T(0), acc_t = T(0);  // per lane
  T acc_box = T(0), acc_dfl = T(0);  // the same in every lane
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t n = row0 + r;
    if (n >= p.N) break;  // warp-uniform
    // ---- BCE over the classes: (1 - t) x - log_sigmoid(x); gradient sigmoid(x) - t; w = sum_c t
    const T* x = p.ps + n * p.C;
    const T* tt = p.ts + n * p.C;
    T* gs = p.gs + n * p.C;
    T wl = T(0);
    for (int64_t c = lane; c < p.C; c += 32) {
      const T xi = x[c], ti = tt[c];
      const T e = F::exp(-fabs(xi));
      acc_cls += (T(1) - ti) * xi - (xi < T(0) ? xi : T(0)) + F::log1p(e);
      gs[c] = (xi >= T(0) ? T(1) : e) / (T(1) + e) - ti;
      wl += ti;
    }
    acc_t += wl;
    T* gb = p.gbox + n * R4;
    T* gd = p.gdfl + n * R4;
    if (!p.fg[n]) {
      for (int j = lane; j < R4; j += 32) gb[j] = gd[j] = T(0);
      continue;
    }
    box_dfl_row(p, n, warp_sum(wl), lane, acc_box, acc_dfl);
  }
  acc_cls = warp_sum(acc_cls);
  acc_t = warp_sum(acc_t);
  __shared__ double s_part[kWarps][4];
  if (lane == 0) {
    s_part[warp][0] = static_cast<double>(acc_box);
    s_part[warp][1] = static_cast<double>(acc_cls);
    s_part[warp][2] = static_cast<double>(acc_dfl);
    s_part[warp][3] = static_cast<double>(acc_t);
  }
  __syncthreads();
  if (threadIdx.x < 4) {
    double s = 0.0;
    for (int w = 0; w < kWarps; ++w) s += s_part[w][threadIdx.x];
    p.part[static_cast<int64_t>(blockIdx.x) * 4 + threadIdx.x] = s;
  }
}

template <typename T>
__global__ void __launch_bounds__(kReduceThreads) reduce_kernel(const double* __restrict__ part, int64_t n_part,
                                                                 T* __restrict__ losses, T* __restrict__ inv_s) {
  __shared__ double s[4][kReduceThreads];
  const int tid = threadIdx.x;
  double acc[4] = {0.0, 0.0, 0.0, 0.0};
  for (int64_t i = tid; i < n_part; i += kReduceThreads)
    for (int c = 0; c < 4; ++c) acc[c] += part[4 * i + c];
  for (int c = 0; c < 4; ++c) s[c][tid] = acc[c];
  __syncthreads();
  for (int h = kReduceThreads / 2; h > 0; h >>= 1) {
    if (tid < h)
      for (int c = 0; c < 4; ++c) s[c][tid] += s[c][tid + h];
    __syncthreads();
  }
  if (tid == 0) {
    const double S = s[3][0] > 1.0 ? s[3][0] : 1.0;
    for (int c = 0; c < 3; ++c) losses[c] = static_cast<T>(s[c][0] / S);
    *inv_s = static_cast<T>(1.0 / S);
  }
}

template <typename T>
cudaError_t launch_impl(const BboxShape& s, const BboxArgs& a, cudaStream_t st, const BboxL1* l1 = nullptr) {
  const int64_t N = s.B * s.A;
  const int64_t n_part = ceil_div(N, kRowsPerBlock);
  double* part = static_cast<double*>(a.workspace);
  if (n_part > 0) {
    LossParams<T> p;
    p.pd = static_cast<const T*>(a.pd);
    p.ps = static_cast<const T*>(a.ps);
    p.anc = static_cast<const T*>(a.anc);
    p.tb = static_cast<const T*>(a.tb);
    p.ts = static_cast<const T*>(a.ts);
    p.fg = a.fg;
    p.gbox = static_cast<T*>(a.gd_box);
    p.gdfl = static_cast<T*>(a.gd_dfl);
    p.gs = static_cast<T*>(a.gs);
    p.part = part;
    p.N = N;
    p.A = s.A;
    p.C = s.C;
    p.R = static_cast<int>(s.R);
    p.l1_stride = l1 ? static_cast<const T*>(l1->stride) : nullptr;
    p.l1_w = l1 ? static_cast<T>(l1->img_w) : T(0);
    p.l1_h = l1 ? static_cast<T>(l1->img_h) : T(0);
    loss_kernel<T><<<static_cast<unsigned>(n_part), kThreads, 0, st>>>(p);
    YF_CHECK_LAUNCH();
  }
  reduce_kernel<T><<<1, kReduceThreads, 0, st>>>(part, n_part, static_cast<T*>(a.losses),
                                                  static_cast<T*>(a.inv_s));
  YF_CHECK_LAUNCH();
  return cudaSuccess;
}


// ------------------------------------------------------------------------- bbox_loss_maps, reg_max 1
// The Detect head's reg_max 1 maps (B, 4 + C, H_l, W_l) read in place: one thread per anchor row
// n = b*A + a (a warp covers 32 neighbouring pixels of one map, so every channel load and every gradient
// store is one coalesced line), the level found from the level offsets. BCE over the classes with the
// gradient stored in the class gradient map (B, C, H_l, W_l); for a foreground row CIoU and L1 as
// box_dfl_row / l1_row (ciou_grad, the same formulas), the 8 box gradients stored in the row's static slot
// rows[n] (2, 4) (zeros off the foreground). Per-block partial sums as loss_kernel, reduced by reduce_kernel.
template <typename T>
struct MapsParams {
  const T* map[kMapsMaxLevels];
  T* gcls[kMapsMaxLevels];
  int64_t sb[kMapsMaxLevels], sc[kMapsMaxLevels], a0[kMapsMaxLevels + 1];
  T stride[kMapsMaxLevels];
  int L;
  const T* anc;
  const T* tb;
  const T* ts;
  const int64_t* lab;  // per-anchor targets: ts (B, A) of class lab (B, A); else nullptr and ts (B, A, C)
  const bool* fg;
  T* rows;
  double* part;
  int64_t N, A, C;
  T img_w, img_h;
};

template <typename T>
__global__ void __launch_bounds__(kThreads) maps_l1_kernel(const MapsParams<T> p) {
  using F = Math<T>;
  const int64_t n = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  T acc_box = T(0), acc_cls = T(0), acc_l1 = T(0), acc_t = T(0);
  if (n < p.N) {
    const int64_t b = n / p.A, a = n - b * p.A;
    // The anchor's level, its fields picked with constant indices (unrolled): a dynamic index into the
    // parameter arrays would make every thread copy them to local memory first.
    const T* mp = p.map[0];
    T* gp = p.gcls[0];
    int64_t sb = p.sb[0], sc = p.sc[0], a0 = 0, a1 = p.a0[1];
    T s = p.stride[0];
#pragma unroll
    for (int k = 1; k < kMapsMaxLevels; ++k) {
      if (k < p.L && a >= p.a0[k]) {
        mp = p.map[k], gp = p.gcls[k], sb = p.sb[k], sc = p.sc[k], a0 = p.a0[k], a1 = p.a0[k + 1];
        s = p.stride[k];
      }
    }
    const int64_t hw = a1 - a0, px = a - a0, C = p.C;
    const T* m = mp + b * sb + px;  // channel k at m[k * sc]
    T* g = gp + b * C * hw + px;    // class c at g[c * hw]
    int64_t lab = -1;
    T score = T(0);
    if (p.lab != nullptr) lab = i64clamp(p.lab[n], 0, C - 1), score = p.ts[n];
    T w = T(0);
    for (int64_t c = 0; c < C; ++c) {
      const T xi = m[(4 + c) * sc];
      const T ti = p.lab != nullptr ? (c == lab ? score : T(0)) : p.ts[n * C + c];
      const T e = F::exp(-fabs(xi));
      acc_cls += (T(1) - ti) * xi - (xi < T(0) ? xi : T(0)) + F::log1p(e);
      g[c * hw] = (xi >= T(0) ? T(1) : e) / (T(1) + e) - ti;
      w += ti;
    }
    acc_t = w;
    T* r = p.rows + n * 8;
    if (!p.fg[n]) {
#pragma unroll
      for (int k = 0; k < 8; ++k) r[k] = T(0);
    } else {
      const T* tb = p.tb + 4 * n;
      const T ax = p.anc[2 * a], ay = p.anc[2 * a + 1];
      const T E[4] = {m[0], m[sc], m[2 * sc], m[3 * sc]};
      T gE[4];
      ciou_grad(ax - E[0], ay - E[1], ax + E[2], ay + E[3], tb[0], tb[1], tb[2], tb[3], w, acc_box, gE);
      // L1 as l1_row: d = p*s/D - t*s/D, gradient w/4 * sign(d) * s/D
      const T td[4] = {ax - tb[0], ay - tb[1], tb[2] - ax, tb[3] - ay};
      const T D[4] = {p.img_w, p.img_h, p.img_w, p.img_h};
      const T cd = w / T(4);
      T l1 = T(0);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const T d = (E[k] * s) / D[k] - (td[k] * s) / D[k];
        l1 += fabs(d);
        const T sign = d > T(0) ? T(1) : (d < T(0) ? T(-1) : T(0));
        r[k] = gE[k];
        r[4 + k] = (cd * sign) * s / D[k];
      }
      acc_l1 = (l1 / T(4)) * w;
    }
  }
  // block partial sums: warp butterflies, then the warps in order (every thread reaches here)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  acc_box = warp_sum(acc_box);
  acc_cls = warp_sum(acc_cls);
  acc_l1 = warp_sum(acc_l1);
  acc_t = warp_sum(acc_t);
  __shared__ double s_part[kWarps][4];
  if (lane == 0) {
    s_part[warp][0] = static_cast<double>(acc_box);
    s_part[warp][1] = static_cast<double>(acc_cls);
    s_part[warp][2] = static_cast<double>(acc_l1);
    s_part[warp][3] = static_cast<double>(acc_t);
  }
  __syncthreads();
  if (threadIdx.x < 4) {
    double v = 0.0;
    for (int k = 0; k < kWarps; ++k) v += s_part[k][threadIdx.x];
    p.part[static_cast<int64_t>(blockIdx.x) * 4 + threadIdx.x] = v;
  }
}

// _bbox_loss_maps_scale, one level: out (B, R4 + C, hw) = class channels gcls * c1; box channels the row of
// the anchor times (c0, c2) when the rows are the static layout (N == B*A: row b*A + a), else
// c0*0 + c2*0 (NaN for a non-finite incoming grad, as the dense product) and scatter_kernel then writes the
// foreground rows. c (3,) is read on the device (no host sync). Grid: y over the B*(R4 + C) channel rows,
// x over the pixels (no 64-bit division per element), both grid-stride.
template <typename T>
__global__ void __launch_bounds__(kThreads) scale_kernel(const T* __restrict__ gcls, const T* __restrict__ rows,
                                                         const T* __restrict__ c, T* __restrict__ out, int64_t B,
                                                         int64_t C, int64_t R4, int64_t hw, int64_t a0, int64_t A,
                                                         bool static_rows) {
  const int64_t no = R4 + C;
  for (int64_t row = blockIdx.y; row < B * no; row += gridDim.y) {
    const int64_t b = row / no, ch = row - b * no;
    T* o = out + row * hw;
    for (int64_t px = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; px < hw;
         px += static_cast<int64_t>(gridDim.x) * kThreads) {
      T v;
      if (ch >= R4) {
        v = gcls[(b * C + ch - R4) * hw + px] * c[1];
      } else if (static_rows) {
        const T* r = rows + (b * A + a0 + px) * 2 * R4;
        v = r[ch] * c[0] + r[R4 + ch] * c[2];
      } else {
        v = c[0] * T(0) + c[2] * T(0);
      }
      o[px] = v;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) scatter_kernel(const T* __restrict__ rows, const int64_t* __restrict__ index,
                                                           const T* __restrict__ c, T* __restrict__ out, int64_t nfg,
                                                           int64_t C, int64_t R4, int64_t hw, int64_t a0, int64_t A) {
  const int64_t total = nfg * R4;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t k = e / R4, ch = e % R4, i = index[k], b = i / A, a = i % A;
    if (a < a0 || a >= a0 + hw) continue;  // another level's anchor
    const T* r = rows + k * 2 * R4;
    out[(b * (R4 + C) + ch) * hw + (a - a0)] = r[ch] * c[0] + r[R4 + ch] * c[2];
  }
}

template <typename T>
cudaError_t maps_launch_impl(const BboxMapsShape& s, const BboxMapsArgs& a, cudaStream_t st) {
  const int64_t N = s.B * s.A;
  const int64_t n_part = ceil_div(N, kThreads);
  double* part = static_cast<double*>(a.workspace);
  if (n_part > 0) {
    MapsParams<T> p{};
    p.L = s.L;
    p.a0[0] = 0;
    for (int l = 0; l < s.L; ++l) {
      p.map[l] = static_cast<const T*>(a.map[l]);
      p.gcls[l] = static_cast<T*>(a.gcls[l]);
      p.sb[l] = a.sb[l];
      p.sc[l] = a.sc[l];
      p.a0[l + 1] = p.a0[l] + a.hw[l];
      p.stride[l] = static_cast<T>(a.stride[l]);
    }
    p.anc = static_cast<const T*>(a.anc);
    p.tb = static_cast<const T*>(a.tb);
    p.ts = static_cast<const T*>(a.ts);
    p.lab = a.lab;
    p.fg = a.fg;
    p.rows = static_cast<T*>(a.rows);
    p.part = part;
    p.N = N;
    p.A = s.A;
    p.C = s.C;
    p.img_w = static_cast<T>(a.img_w);
    p.img_h = static_cast<T>(a.img_h);
    maps_l1_kernel<T><<<static_cast<unsigned>(n_part), kThreads, 0, st>>>(p);
    YF_CHECK_LAUNCH();
  }
  reduce_kernel<T><<<1, kReduceThreads, 0, st>>>(part, n_part, static_cast<T*>(a.losses),
                                                  static_cast<T*>(a.inv_s));
  YF_CHECK_LAUNCH();
  return cudaSuccess;
}

unsigned grid_of(int64_t total) {  // grid-stride loops: at most 65535 blocks, at least 1
  return static_cast<unsigned>(i64clamp(ceil_div(total, kThreads), 1, 65535));
}

template <typename T>
cudaError_t scale_launch_impl(const BboxMapsScale& s, cudaStream_t st) {
  const bool static_rows = s.nfg == s.B * s.A;
  int64_t a0 = 0;
  for (int l = 0; l < s.L; ++l) {
    const int64_t hw = s.hw[l];
    if (s.B * hw > 0) {
      const dim3 grid(grid_of(hw), static_cast<unsigned>(i64clamp(s.B * (s.R4 + s.C), 1, 65535)));
      scale_kernel<T><<<grid, kThreads, 0, st>>>(
          static_cast<const T*>(s.gcls[l]), static_cast<const T*>(s.rows), static_cast<const T*>(s.c),
          static_cast<T*>(s.out[l]), s.B, s.C, s.R4, hw, a0, s.A, static_rows);
      YF_CHECK_LAUNCH();
      if (!static_rows && s.nfg > 0) {
        scatter_kernel<T><<<grid_of(s.nfg * s.R4), kThreads, 0, st>>>(
            static_cast<const T*>(s.rows), s.index, static_cast<const T*>(s.c), static_cast<T*>(s.out[l]), s.nfg,
            s.C, s.R4, hw, a0, s.A);
        YF_CHECK_LAUNCH();
      }
    }
    a0 += hw;
  }
  return cudaSuccess;
}
}  // namespace

size_t bbox_loss_workspace_bytes(const BboxShape& s) {
  return static_cast<size_t>(std::max<int64_t>(ceil_div(s.B * s.A, kRowsPerBlock), 1)) * 4 * sizeof(double);
}

cudaError_t bbox_loss_launch(const BboxShape& s, const BboxArgs& a, bool f64, cudaStream_t stream) {
  return f64 ? launch_impl<double>(s, a, stream) : launch_impl<float>(s, a, stream);
}

cudaError_t bbox_loss_l1_launch(const BboxShape& s, const BboxArgs& a, const BboxL1& l1, bool f64,
                                cudaStream_t stream) {
  return f64 ? launch_impl<double>(s, a, stream, &l1) : launch_impl<float>(s, a, stream, &l1);
}

size_t bbox_loss_maps_workspace_bytes(const BboxMapsShape& s) {
  return static_cast<size_t>(std::max<int64_t>(ceil_div(s.B * s.A, kThreads), 1)) * 4 * sizeof(double);
}

cudaError_t bbox_loss_maps_l1_launch(const BboxMapsShape& s, const BboxMapsArgs& a, bool f64, cudaStream_t stream) {
  return f64 ? maps_launch_impl<double>(s, a, stream) : maps_launch_impl<float>(s, a, stream);
}

cudaError_t bbox_loss_maps_scale_launch(const BboxMapsScale& s, bool f64, cudaStream_t stream) {
  return f64 ? scale_launch_impl<double>(s, stream) : scale_launch_impl<float>(s, stream);
}

}  // namespace cuda
}  // namespace yolofast
