// Sparse task-aligned assigner on the CPU (DESIGN §2.1); the spec is reference.tal_assign_ref.
//
// The reference builds ~10 dense (B, M, A) tensors: at B=2, 640 px, 1,000 GT/img that is 16.8M elements
// each. Here nothing of size B*M*A exists. Work is O(sum of candidates + B*A), memory O(B*M*k + B*A):
// the phases of tal_assign_phases.h, in DESIGN's order:
//   candidates (find_candidates): per real GT, one index rectangle per anchor-grid block (binary search on
//      the block's sorted coordinates with the exact predicate);
//   top-k (topk_per_gt, parallel over B*M): each GT's top-k by align. Exact bounds (CIoU <= iou - rho2/c2)
//      skip the aspect term and the pow of candidates whose CIoU is provably <= 0 or that cannot enter it;
//   conflicts (count_picks, resolve_conflicts): per anchor selected by >= 2 GTs, the best-overlap candidate
//      GT among the image's GTs near it (a 16 x 16 cell index of the widened boxes);
//   second top-k (second_topk, topk2 > 0 only): each GT keeps its topk2 best positives by align;
//   targets (positive_maxima, write_targets): pos_align / pos_overlap of every GT over its final
//      positives, then every output element written once (target_scores rows included).
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
#include "tal_assign_phases.h"

namespace yolofast {
namespace tal {
namespace {

using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// The assigner's score of anchor a of image b for class c, read from (B, A, C) probabilities as given.
// in_unit(b, a, c): the score is in [0, 1] (so not NaN), read without computing it: the assigner may then
// bound s^alpha by 1 and skip the candidate unread (tal_assign_phases.h, GtScan::prepare).
template <typename T>
struct ProbScores {
  // Reading the score costs the same load as checking it: the top-k bound takes the score itself.
  static constexpr bool kScoreFreeBound = false;
  const T* p;
  int64_t A, C;
  T operator()(int64_t b, int64_t a, int64_t c) const { return p[(b * A + a) * C + c]; }
  bool in_unit(int64_t b, int64_t a, int64_t c) const {
    const T s = p[(b * A + a) * C + c];
    return s >= T(0) && s <= T(1);
  }
};

// The same score from the head's class logits where they lie (level l: map (B, 4R + C, H_l, W_l), pixel
// a - a0[l]), through the sigmoid: only the candidates' scores are ever computed (b16/320: ~20k of the
// 2.7M that a sigmoid of every logit costs, 9.4 ms -> ~2 ms for the decode that feeds this on AVX2).
// The sigmoid is evaluated in double and rounded once: within an ulp of torch.sigmoid's float result.
template <typename T>
struct MapLogits {
  static constexpr int kMaxLevels = 8;
  static constexpr bool kScoreFreeBound = true;  // the check is a load, the score a sigmoid in double
  const T* cls[kMaxLevels];  // channel 4R of image 0
  int64_t sb[kMaxLevels], sc[kMaxLevels], a0[kMaxLevels + 1];
  int levels = 0;
  T logit(int64_t b, int64_t a, int64_t c) const {
    int l = 0;
    while (l + 1 < levels && a >= a0[l + 1]) ++l;
    return cls[l][b * sb[l] + c * sc[l] + (a - a0[l])];
  }
  T operator()(int64_t b, int64_t a, int64_t c) const {
    const double x = static_cast<double>(logit(b, a, c));
    return static_cast<T>(1.0 / (1.0 + std::exp(-x)));
  }
  // The sigmoid of any logit but NaN is in [0, 1] (+-inf give exactly 1 and 0).
  bool in_unit(int64_t b, int64_t a, int64_t c) const { return !std::isnan(logit(b, a, c)); }
};

// DESIGN §2.1's phases, one after another (tal_assign_phases.h).
template <typename T, typename Scores>
void assign(const Problem<T, Scores>& pr, const OutPtrs<T>& out) {
  const Candidates<T> cs = find_candidates(pr);
  // Per-anchor scores ((B, A), dense = false) are written whole by write_targets: nothing to zero.
  const int64_t n_scores = out.dense ? pr.B * pr.A * pr.C : 0;
  const TopK<T> tk = topk_per_gt(pr, cs, out.scores, n_scores);
  AnchorState<T> st = count_picks(pr, tk);
  resolve_conflicts(pr, cs, st);
  second_topk(pr, st);
  const PosMax<T> pm = positive_maxima(pr, st);
  write_targets(pr, cs, st, pm, out);
}

// The op's hyperparameters (k2: the second top-k after the conflicts, 0 = off).
struct Hyper {
  int64_t topk, k2;
  double alpha, beta, eps;
};

using Inputs = yolofast_checks::TalAssignInputs;  // the compute-type box tensors (and scores, unused here)

// The Problem of one assignment from the op's (compute-type) tensors.
template <typename T, typename Scores>
Problem<T, Scores> make_problem(const Scores& score, int64_t B, int64_t A, int64_t C, const Inputs& in,
                                const at::Tensor& pd_atan, const at::Tensor& gt_atan, const Hyper& h) {
  Problem<T, Scores> pr;
  pr.score = &score;
  pr.B = B, pr.A = A, pr.C = C, pr.M = in.gt.size(1);
  pr.k = std::min<int64_t>(h.topk, A);
  pr.k2 = h.k2;
  pr.pbox = in.pbox.data_ptr<T>();
  pr.anc = in.anc.data_ptr<T>();
  pr.labels = in.labels.data_ptr<int64_t>();
  pr.gtb = in.gt.data_ptr<T>();
  pr.real = in.real.data_ptr<bool>();
  pr.pd_atan = pd_atan.data_ptr<T>();
  pr.gt_atan = gt_atan.data_ptr<T>();
  pr.P = make_params<T>(h.alpha, h.beta, h.eps);
  return pr;
}

// atan(w / h) of every box for CIoU's aspect term, exactly as reference.bbox_ciou computes it: w = x2 - x1,
// h = (y2 - y1) + kCiouEps (the same IEEE operations as ATen's sub/add/div), then ATen's atan (MKL VML here,
// which differs from libm by an ulp on ~2% of inputs). Slices of <= 32768 elements (ATen's grain) so that
// ATen runs each inline instead of forking threads for ~0.1 ms of work. O(B*A + B*M) values.
template <typename T>
at::Tensor aspect_atan(const at::Tensor& box) {
  const int64_t n = box.numel() / 4;
  at::Tensor out = at::empty({n}, box.options());
  const T* b = box.data_ptr<T>();
  T* r = out.data_ptr<T>();
  const T eps = static_cast<T>(kCiouEps);
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
Outputs run(const MakeScores& make_scores, const Inputs& in, int64_t B, int64_t A, int64_t C,
            const at::Tensor& gt_bboxes, at::ScalarType out_dtype, const Hyper& h, bool dense_scores = true) {
  const bool f64 = in.f64;
  const auto ct = f64 ? at::kDouble : at::kFloat;
  auto opts = in.pbox.options();
  at::Tensor o_lab = at::empty({B, A}, opts.dtype(at::kLong));
  at::Tensor o_box = at::empty({B, A, 4}, opts.dtype(ct));
  at::Tensor o_sc = at::empty(score_sizes(B, A, C, dense_scores), opts.dtype(ct));
  at::Tensor o_fg = at::empty({B, A}, opts.dtype(at::kBool));
  at::Tensor o_idx = at::empty({B, A}, opts.dtype(at::kLong));
  const at::Tensor pd_atan = f64 ? aspect_atan<double>(in.pbox) : aspect_atan<float>(in.pbox);
  const at::Tensor gt_atan = f64 ? aspect_atan<double>(in.gt) : aspect_atan<float>(in.gt);
  auto go = [&](auto zero) {
    using T = decltype(zero);
    const auto score = make_scores(zero);
    const auto pr = make_problem<T>(score, B, A, C, in, pd_atan, gt_atan, h);
    assign(pr, OutPtrs<T>{o_lab.data_ptr<int64_t>(), o_box.data_ptr<T>(), o_sc.data_ptr<T>(),
                          o_fg.data_ptr<bool>(), o_idx.data_ptr<int64_t>(), dense_scores});
  };
  if (f64)
    go(double(0));
  else
    go(float(0));
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
                       int64_t topk, double alpha, double beta, double eps, int64_t topk2) {
  yolofast_checks::tal_assign_shapes(pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt, topk);
  const int64_t k2 = yolofast_checks::tal_assign_topk2(topk, topk2);
  const int64_t B = pd_scores.size(0), A = pd_scores.size(1), C = pd_scores.size(2), M = gt_bboxes.size(1);
  if (M == 0) return no_gt_slots(B, A, C, gt_bboxes, pd_scores.scalar_type());
  const auto in =
      yolofast_checks::tal_assign_inputs(pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt);
  const at::Tensor& scores = in.scores;
  auto make = [&](auto zero) {
    using T = decltype(zero);
    return ProbScores<T>{scores.const_data_ptr<T>(), A, C};
  };
  return run(make, in, B, A, C, gt_bboxes, pd_scores.scalar_type(), Hyper{topk, k2, alpha, beta, eps});
}

// tal_assign.maps: the scores are sigmoid(class logits) read from the head's maps in place (see MapLogits);
// otherwise the same as tal_assign on maps_to_rows(feats)[1].sigmoid(). target_scores has the maps'
// promoted dtype, as that (B, A, C) tensor would; with dense_scores = false it is (B, A) (see run).
Outputs tal_assign_maps_cpu(at::TensorList feats, int64_t reg_max, const at::Tensor& pd_bboxes,
                            const at::Tensor& anc_points, const at::Tensor& gt_labels, const at::Tensor& gt_bboxes,
                            const at::Tensor& mask_gt, int64_t topk, double alpha, double beta, double eps,
                            bool dense_scores, int64_t topk2) {
  const int64_t k2 = yolofast_checks::tal_assign_topk2(topk, topk2);
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
  return run(make, in, B, A, C, gt_bboxes, out_dtype, Hyper{topk, k2, alpha, beta, eps}, dense_scores);
}

}  // namespace
}  // namespace tal
}  // namespace yolofast

TORCH_LIBRARY_IMPL(yolofast, CPU, m) {
  m.impl("tal_assign", &yolofast::tal::tal_assign_cpu);
  m.impl("tal_assign.maps", &yolofast::tal::tal_assign_maps_cpu);
}
