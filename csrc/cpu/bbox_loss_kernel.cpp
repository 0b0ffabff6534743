// Fused CIoU box loss + DFL + BCE class loss with their gradients (DESIGN §2.2), CPU, two entry points:
//
// yolofast::bbox_loss(pred_dist (B,A,4R), pred_scores (B,A,C), anchor_points (A,2), target_bboxes (B,A,4),
//                     target_scores (B,A,C), fg_mask (B,A))
//   -> (losses (3,) [L_box, L_cls, L_dfl] divided by S,
//       grad_dist_box (B,A,4R), grad_dist_dfl (B,A,4R), grad_scores (B,A,C), inv_s ())
// yolofast::bbox_loss_maps(feats [(B, 4R+C, H_i, W_i)], anchor_points, target_bboxes, target_scores,
//                          fg_mask, reg_max)
//   -> (losses (3,), grad_main [(B, 4R+C, H_i, W_i)], grad_dfl [(B, 4R, H_i, W_i)], inv_s ())
// The second reads the Detect head's maps where they are (anchor a of level i is pixel h*W_i + w, levels
// in order): no (B, A, .) copy of the logits is made, and the gradients come out in the maps' layout
// (grad_main holds the box gradient in its first 4R channels and the class gradient after them).
// The gradients are those of S*L_box, S*L_dfl and S*L_cls (i.e. not yet divided by S): backward
// multiplies them by grad_output[i] * inv_s, the same product autograd forms for the reference. Box and
// DFL grads are kept apart because L_box and L_dfl get their own gains.
//
// Compute type: double when a logit input is double (gradcheck), float otherwise (bf16/fp16 upcast, as
// the reference does). Blocks of anchors are fixed by the shapes; every block writes its partial sums
// (double) to its own slot and the slots are added in block order afterwards, so the result does not
// depend on the number of threads or on scheduling. The math lives in bbox_loss_core.h.

// First: it sets at::vec's CPU_CAPABILITY macros, which must precede any ATen header that pulls in vec.h.
#include "bbox_loss_core.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <tuple>
#include <vector>

#include "cpu_common.h"
#include "op_checks.h"

namespace yolofast {
namespace {

// (B,A,.) layout: 32 anchors x 80 classes = 2560 class logits per block, 263 blocks per 640 px image, so
// 2 threads split evenly. Maps: 256 anchors per block along the contiguous pixel axis (16 AVX-512 or 32
// AVX2 vectors per class row), 34 blocks per 640 px image.
constexpr int64_t kRowBlock = 32;
constexpr int64_t kMapBlock = 256;

struct Block {
  int64_t level, b, i0, i1;
};

template <typename T>
std::vector<double> run_blocks(const std::vector<LossLevel<T>>& levels, const LossTargets<T>& tg, int64_t B,
                               int64_t per_block) {
  std::vector<Block> blocks;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < static_cast<int64_t>(levels.size()); ++l)
      for (int64_t i0 = 0; i0 < levels[l].n; i0 += per_block)
        blocks.push_back({l, b, i0, std::min(levels[l].n, i0 + per_block)});
  const int64_t nb = static_cast<int64_t>(blocks.size());
  std::vector<double> partial(static_cast<size_t>(nb) * 4, 0.0);
  at::parallel_for(0, nb, 1, [&](int64_t k0, int64_t k1) {
    note_thread();
    for (int64_t k = k0; k < k1; ++k) {
      const Block& bl = blocks[k];
      loss_block<T>(levels[bl.level], tg, bl.b, bl.i0, bl.i1, partial.data() + 4 * k);
    }
  });
  std::vector<double> sums(4, 0.0);
  for (int64_t k = 0; k < nb; ++k)
    for (int i = 0; i < 4; ++i) sums[i] += partial[4 * k + i];
  return sums;
}

template <typename T>
LossTargets<T> targets_of(const at::Tensor& anc, const at::Tensor& tb, const at::Tensor& ts, const at::Tensor& fg,
                          int R) {
  return {anc.const_data_ptr<T>(), tb.const_data_ptr<T>(), ts.const_data_ptr<T>(), fg.const_data_ptr<bool>(),
          ts.size(1), ts.size(2), R};
}

std::tuple<at::Tensor, at::Tensor> losses_and_inv_s(const std::vector<double>& sums, bool dbl,
                                                    const at::TensorOptions& opt) {
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
  return {losses, inv_s};
}

void poison(std::initializer_list<at::Tensor*> ts) {
  if (!poison_outputs()) return;
  for (auto* t : ts) t->fill_(std::numeric_limits<double>::quiet_NaN());
}

template <typename T>
Strided<T> rows_of(const at::Tensor& t) {  // (B, A, K) contiguous: channel stride 1, anchor stride K
  return {const_cast<T*>(t.const_data_ptr<T>()), t.size(1) * t.size(2), 1, t.size(2)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bbox_loss_cpu(
    const at::Tensor& pred_dist, const at::Tensor& pred_scores, const at::Tensor& anchor_points,
    const at::Tensor& target_bboxes, const at::Tensor& target_scores, const at::Tensor& fg_mask) {
  yolofast_checks::bbox_loss_shapes(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask,
                                    kMaxRegMax);
  const int64_t B = pred_dist.size(0), A = pred_dist.size(1), R4 = pred_dist.size(2), C = pred_scores.size(2);
  const auto in =
      yolofast_checks::bbox_loss_inputs(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask);
  const auto opt = in.pd.options();
  auto gbox = at::empty({B, A, R4}, opt);
  auto gdfl = at::empty({B, A, R4}, opt);
  auto gcls = at::empty({B, A, C}, opt);
  poison({&gbox, &gdfl, &gcls});

  auto go = [&](auto zero) {
    using T = decltype(zero);
    LossLevel<T> L;
    const auto pd = rows_of<T>(in.pd), ps = rows_of<T>(in.ps);
    L.dist = {pd.p, pd.sb, pd.sc, pd.sa};
    L.score = {ps.p, ps.sb, ps.sc, ps.sa};
    L.gbox = rows_of<T>(gbox), L.gdfl = rows_of<T>(gdfl), L.gcls = rows_of<T>(gcls);
    L.n = A, L.a0 = 0;
    return run_blocks<T>({L}, targets_of<T>(in.anc, in.tb, in.ts, in.fg, static_cast<int>(R4 / 4)), B, kRowBlock);
  };
  const auto sums = in.f64 ? go(double(0)) : go(float(0));
  auto [losses, inv_s] = losses_and_inv_s(sums, in.f64, opt);
  return {losses, gbox, gdfl, gcls, inv_s};
}

std::tuple<at::Tensor, std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor> bbox_loss_maps_cpu(
    at::TensorList feats, const at::Tensor& anchor_points, const at::Tensor& target_bboxes,
    const at::Tensor& target_scores, const at::Tensor& fg_mask, int64_t reg_max) {
  const auto in = yolofast_checks::bbox_loss_maps_inputs(feats, anchor_points, target_bboxes, target_scores,
                                                          fg_mask, reg_max, kMaxRegMax);
  const int64_t B = in.B, R4 = 4 * reg_max, no = in.no;
  const auto opt = in.maps[0].options();
  std::vector<at::Tensor> gmain, gdfl;
  for (const auto& m : in.maps) {
    gmain.push_back(at::empty({B, no, m.size(2), m.size(3)}, opt));
    gdfl.push_back(at::empty({B, R4, m.size(2), m.size(3)}, opt));
    poison({&gmain.back(), &gdfl.back()});
  }

  auto go = [&](auto zero) {
    using T = decltype(zero);
    std::vector<LossLevel<T>> levels;
    int64_t a0 = 0;
    for (size_t l = 0; l < in.maps.size(); ++l) {
      const auto& m = in.maps[l];
      const int64_t hw = m.size(2) * m.size(3);
      const T* p = m.const_data_ptr<T>();
      LossLevel<T> L;
      // A map's pixels are one axis (bbox_loss_maps_inputs guarantees stride(2) == W * stride(3) == W).
      L.dist = {p, m.stride(0), m.stride(1), 1};
      L.score = {p + R4 * m.stride(1), m.stride(0), m.stride(1), 1};
      T* gm = gmain[l].mutable_data_ptr<T>();
      L.gbox = {gm, no * hw, hw, 1};
      L.gcls = {gm + R4 * hw, no * hw, hw, 1};
      L.gdfl = {gdfl[l].mutable_data_ptr<T>(), R4 * hw, hw, 1};
      L.n = hw, L.a0 = a0;
      a0 += hw;
      levels.push_back(L);
    }
    return run_blocks<T>(levels, targets_of<T>(in.anc, in.tb, in.ts, in.fg, static_cast<int>(reg_max)), B,
                         kMapBlock);
  };
  const auto sums = in.f64 ? go(double(0)) : go(float(0));
  auto [losses, inv_s] = losses_and_inv_s(sums, in.f64, opt);
  return {losses, gmain, gdfl, inv_s};
}

// backward of yolofast::bbox_loss in one pass: grad_pred_dist = gbox*c[0] + gdfl*c[2] and grad_pred_scores =
// gcls*c[1] (c = the incoming grads / S). The box and DFL gradients are zero off the foreground (the forward
// wrote those zeros), so a background row is written as c[0]*0 + c[2]*0 without reading its 2 x 4R inputs:
// at b8/640/50 GT 96 % of the rows, 33 MB of reads saved, and one pass instead of autograd-style
// mul + addcmul (a temporary written and read again).
template <typename T>
void scale_grads(const at::Tensor& gbox, const at::Tensor& gdfl, const at::Tensor& gcls, const bool* fg,
                 const T* c, at::Tensor& gdist, at::Tensor& gscores) {
  using V = Vec<T>;
  constexpr int64_t W = V::size();
  const int64_t rows = gbox.size(0) * gbox.size(1), R4 = gbox.size(2), C = gcls.size(2);
  const T c0 = c[0], c1 = c[1], c2 = c[2];
  const T bg = c0 * T(0) + c2 * T(0);  // NaN when an incoming grad is not finite, as gbox*c0 + gdfl*c2 is
  const T* pb = gbox.const_data_ptr<T>();
  const T* pd = gdfl.const_data_ptr<T>();
  const T* pc = gcls.const_data_ptr<T>();
  T* od = gdist.mutable_data_ptr<T>();
  T* os = gscores.mutable_data_ptr<T>();
  const V v0(c0), v1(c1), v2(c2), vbg(bg);
  // ~40 floats a row: 2048 rows (~330 KB) a chunk.
  at::parallel_for(0, rows, 2048, [&](int64_t r0, int64_t r1) {
    note_thread();
    for (int64_t r = r0; r < r1; ++r) {
      T* o = od + r * R4;
      int64_t j = 0;
      if (fg[r]) {
        const T* b = pb + r * R4;
        const T* d = pd + r * R4;
        for (; j + W <= R4; j += W) (V::loadu(b + j) * v0 + V::loadu(d + j) * v2).store(o + j);
        for (; j < R4; ++j) o[j] = b[j] * c0 + d[j] * c2;
      } else {
        for (; j + W <= R4; j += W) vbg.store(o + j);
        for (; j < R4; ++j) o[j] = bg;
      }
    }
    const T* x = pc + r0 * C;
    T* y = os + r0 * C;
    const int64_t n = (r1 - r0) * C;
    int64_t j = 0;
    for (; j + W <= n; j += W) (V::loadu(x + j) * v1).store(y + j);
    for (; j < n; ++j) y[j] = x[j] * c1;
  });
}

std::tuple<at::Tensor, at::Tensor> bbox_loss_scale_cpu(const at::Tensor& gbox, const at::Tensor& gdfl,
                                                       const at::Tensor& gcls, const at::Tensor& fg_mask,
                                                       const at::Tensor& c) {
  TORCH_CHECK(gbox.dim() == 3 && gdfl.sizes() == gbox.sizes() && gcls.dim() == 3 &&
                  gcls.size(0) == gbox.size(0) && gcls.size(1) == gbox.size(1) && fg_mask.numel() ==
                  gbox.size(0) * gbox.size(1) && c.numel() == 3,
              "yolofast::_bbox_loss_scale: expects the (B, A, 4R) box and DFL gradients, the (B, A, C) class "
              "gradient, fg_mask (B, A) and c (3,) of yolofast::bbox_loss; got ", gbox.sizes(), ", ",
              gdfl.sizes(), ", ", gcls.sizes(), ", ", fg_mask.sizes(), ", ", c.sizes());
  const auto dt = gbox.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kDouble) && gdfl.scalar_type() == dt && gcls.scalar_type() == dt,
              "yolofast::_bbox_loss_scale: the gradients must be all float32 or all float64 (bbox_loss's "
              "compute dtype)");
  const at::Tensor gb = gbox.contiguous(), gd = gdfl.contiguous(), gc = gcls.contiguous();
  const at::Tensor fg = fg_mask.to(at::kBool).contiguous();
  const at::Tensor cc = c.to(dt).contiguous();
  at::Tensor gdist = at::empty_like(gb), gscores = at::empty_like(gc);
  if (dt == at::kDouble)
    scale_grads<double>(gb, gd, gc, fg.const_data_ptr<bool>(), cc.const_data_ptr<double>(), gdist, gscores);
  else
    scale_grads<float>(gb, gd, gc, fg.const_data_ptr<bool>(), cc.const_data_ptr<float>(), gdist, gscores);
  return {gdist, gscores};
}

// Debug: the SIMD register width (bits) the loss-path kernels were built for, 0 for at::vec's generic
// scalar fallback; the tests check it matches the CPU flags the build targeted.
int64_t bbox_vec_bits_cpu(const at::Tensor&) { return vec_isa(); }

}  // namespace

TORCH_LIBRARY_IMPL(yolofast, CPU, m) {
  m.impl("bbox_loss", &bbox_loss_cpu);
  m.impl("bbox_loss_maps", &bbox_loss_maps_cpu);
  m.impl("_bbox_loss_scale", &bbox_loss_scale_cpu);
  m.impl("_bbox_vec_bits", &bbox_vec_bits_cpu);
}

}  // namespace yolofast
