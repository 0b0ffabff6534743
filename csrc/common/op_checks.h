// Argument checks and input preparation shared by the CPU kernels (csrc/cpu) and the CUDA bindings
// (csrc/cuda/cuda_ops.cpp): one text per op, so the two backends refuse the same inputs with the same
// message and compute in the same type.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

namespace yolofast_checks {

// Shapes of tal_assign's inputs (DESIGN §2.1); returns nothing, throws with the argument's name.
inline void tal_assign_shapes(const at::Tensor& pd_scores, const at::Tensor& pd_bboxes,
                              const at::Tensor& anc_points, const at::Tensor& gt_labels,
                              const at::Tensor& gt_bboxes, const at::Tensor& mask_gt, int64_t topk) {
  TORCH_CHECK(pd_scores.dim() == 3, "tal_assign: pd_scores must be (B, A, C), got ", pd_scores.sizes());
  const int64_t B = pd_scores.size(0), A = pd_scores.size(1);
  TORCH_CHECK(pd_bboxes.dim() == 3 && pd_bboxes.size(0) == B && pd_bboxes.size(1) == A &&
                  pd_bboxes.size(2) == 4,
              "tal_assign: pd_bboxes must be (B, A, 4) = (", B, ", ", A, ", 4), got ", pd_bboxes.sizes());
  TORCH_CHECK(anc_points.dim() == 2 && anc_points.size(0) == A && anc_points.size(1) == 2,
              "tal_assign: anc_points must be (A, 2) = (", A, ", 2), got ", anc_points.sizes());
  TORCH_CHECK(gt_bboxes.dim() == 3 && gt_bboxes.size(0) == B && gt_bboxes.size(2) == 4,
              "tal_assign: gt_bboxes must be (B, M, 4) with B = ", B, ", got ", gt_bboxes.sizes());
  const int64_t M = gt_bboxes.size(1);
  TORCH_CHECK(gt_labels.numel() == B * M && (gt_labels.dim() < 1 || gt_labels.size(0) == B),
              "tal_assign: gt_labels must be (B, M, 1) = (", B, ", ", M, ", 1), got ", gt_labels.sizes());
  TORCH_CHECK(mask_gt.numel() == B * M && (mask_gt.dim() < 1 || mask_gt.size(0) == B),
              "tal_assign: mask_gt must be (B, M, 1) = (", B, ", ", M, ", 1), got ", mask_gt.sizes());
  TORCH_CHECK(topk >= 0, "tal_assign: topk must be >= 0, got ", topk);
  TORCH_CHECK(A < std::numeric_limits<int32_t>::max() && M < std::numeric_limits<int32_t>::max(),
              "tal_assign: A and M must be below 2^31, got A = ", A, ", M = ", M);
  TORCH_CHECK(at::isFloatingType(pd_scores.scalar_type()),
              "tal_assign: pd_scores must be floating point (sigmoid scores), got ", pd_scores.scalar_type());
}

// The second top-k of YOLO26's one-to-one branch (topk2, spec §4.3): 0 = off. It applies only when it
// differs from topk (Ultralytics' rule), so topk2 == topk is off too; returns the k2 the kernels use.
inline int64_t tal_assign_topk2(int64_t topk, int64_t topk2) {
  TORCH_CHECK(topk2 >= 0, "tal_assign: topk2 must be >= 0 (0: no second top-k), got ", topk2);
  return topk2 != topk ? topk2 : 0;
}

// Shapes and dtypes of bbox_loss's inputs (DESIGN §2.2); reg_max must fit the kernels' fixed arrays.
inline void bbox_loss_shapes(const at::Tensor& pred_dist, const at::Tensor& pred_scores,
                             const at::Tensor& anchor_points, const at::Tensor& target_bboxes,
                             const at::Tensor& target_scores, const at::Tensor& fg_mask, int64_t max_reg_max) {
  TORCH_CHECK(pred_dist.dim() == 3 && pred_dist.size(2) % 4 == 0,
              "yolofast::bbox_loss: pred_dist must be (B, A, 4*reg_max), got ", pred_dist.sizes());
  const int64_t B = pred_dist.size(0), A = pred_dist.size(1), R = pred_dist.size(2) / 4;
  TORCH_CHECK(R >= 2 && R <= max_reg_max, "yolofast::bbox_loss: reg_max must be in [2, ", max_reg_max,
              "], got ", R);
  TORCH_CHECK(pred_scores.dim() == 3 && pred_scores.size(0) == B && pred_scores.size(1) == A,
              "yolofast::bbox_loss: pred_scores must be (B, A, C) = (", B, ", ", A, ", C), got ",
              pred_scores.sizes());
  TORCH_CHECK(anchor_points.dim() == 2 && anchor_points.size(0) == A && anchor_points.size(1) == 2,
              "yolofast::bbox_loss: anchor_points must be (A, 2) = (", A, ", 2), got ", anchor_points.sizes());
  TORCH_CHECK(target_bboxes.dim() == 3 && target_bboxes.size(0) == B && target_bboxes.size(1) == A &&
                  target_bboxes.size(2) == 4,
              "yolofast::bbox_loss: target_bboxes must be (B, A, 4), got ", target_bboxes.sizes());
  TORCH_CHECK(target_scores.sizes() == pred_scores.sizes(), "yolofast::bbox_loss: target_scores ",
              target_scores.sizes(), " must have pred_scores' shape ", pred_scores.sizes());
  TORCH_CHECK(fg_mask.dim() == 2 && fg_mask.size(0) == B && fg_mask.size(1) == A,
              "yolofast::bbox_loss: fg_mask must be (B, A), got ", fg_mask.sizes());
  TORCH_CHECK(pred_dist.is_floating_point() && pred_scores.is_floating_point(),
              "yolofast::bbox_loss: pred_dist and pred_scores must be floating point");
}

// bbox_loss for reg_max 1 (raw distances, YOLO26): pred_dist (B, A, 4) and stride_tensor with A values (each
// anchor's stride, for the L1 term), the other inputs as bbox_loss_shapes has them.
inline void bbox_loss_l1_shapes(const at::Tensor& pred_dist, const at::Tensor& pred_scores,
                                const at::Tensor& anchor_points, const at::Tensor& target_bboxes,
                                const at::Tensor& target_scores, const at::Tensor& fg_mask,
                                const at::Tensor& stride_tensor, double img_h, double img_w) {
  TORCH_CHECK(pred_dist.dim() == 3 && pred_dist.size(2) == 4,
              "yolofast::bbox_loss.l1: pred_dist must be (B, A, 4) raw distances (reg_max 1), got ",
              pred_dist.sizes());
  const int64_t A = pred_dist.size(1);
  // The rest as the DFL op checks it, with a (B, A, 8) meta stand-in for pred_dist (reg_max 2: in range;
  // meta: no memory, no kernel).
  const at::Tensor stand_in = at::empty({pred_dist.size(0), A, 8}, pred_dist.options().device(at::kMeta));
  bbox_loss_shapes(stand_in, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask, 2);
  TORCH_CHECK(stride_tensor.numel() == A && stride_tensor.is_floating_point(),
              "yolofast::bbox_loss.l1: stride_tensor must hold one floating stride per anchor (A = ", A,
              "), got ", stride_tensor.sizes(), " ", stride_tensor.scalar_type());
  TORCH_CHECK(img_h > 0 && img_w > 0, "yolofast::bbox_loss.l1: the batch image size (img_h, img_w) must be > 0, got (",
              img_h, ", ", img_w, ")");
}

// tal_assign's inputs as both kernels read them: contiguous, in the compute type -- float64 when any of
// scores / pred boxes / GT boxes is float64, else float32 (bf16/fp16 upcast, as the reference does) --
// labels as int64 (B, M) and the GT mask as bool (B, M). Call after tal_assign_shapes.
struct TalAssignInputs {
  bool f64;
  at::Tensor scores, pbox, anc, gt, labels, real;
};

// scores_f64: whether the scores are float64; `scores` is left undefined (the caller reads its own).
inline TalAssignInputs tal_assign_box_inputs(bool scores_f64, const at::Tensor& pd_bboxes,
                                             const at::Tensor& anc_points, const at::Tensor& gt_labels,
                                             const at::Tensor& gt_bboxes, const at::Tensor& mask_gt) {
  const int64_t B = pd_bboxes.size(0), M = gt_bboxes.size(1);
  const bool f64 =
      scores_f64 || pd_bboxes.scalar_type() == at::kDouble || gt_bboxes.scalar_type() == at::kDouble;
  const auto ct = f64 ? at::kDouble : at::kFloat;
  return {f64,
          at::Tensor(),
          pd_bboxes.to(ct).contiguous(),
          anc_points.to(ct).contiguous(),
          gt_bboxes.to(ct).contiguous(),
          gt_labels.reshape({B, M}).to(at::kLong).contiguous(),
          mask_gt.reshape({B, M}).gt(0).contiguous()};
}

inline TalAssignInputs tal_assign_inputs(const at::Tensor& pd_scores, const at::Tensor& pd_bboxes,
                                         const at::Tensor& anc_points, const at::Tensor& gt_labels,
                                         const at::Tensor& gt_bboxes, const at::Tensor& mask_gt) {
  auto in = tal_assign_box_inputs(pd_scores.scalar_type() == at::kDouble, pd_bboxes, anc_points, gt_labels,
                                  gt_bboxes, mask_gt);
  in.scores = pd_scores.to(in.f64 ? at::kDouble : at::kFloat).contiguous();
  return in;
}

// bbox_loss's inputs as both kernels read them: contiguous, float64 when pred_dist or pred_scores is
// float64, else float32 (bf16/fp16 upcast); fg_mask as bool. Call after bbox_loss_shapes.
struct BboxLossInputs {
  bool f64;
  at::Tensor pd, ps, anc, tb, ts, fg;
};

inline BboxLossInputs bbox_loss_inputs(const at::Tensor& pred_dist, const at::Tensor& pred_scores,
                                       const at::Tensor& anchor_points, const at::Tensor& target_bboxes,
                                       const at::Tensor& target_scores, const at::Tensor& fg_mask) {
  const bool f64 = pred_dist.scalar_type() == at::kDouble || pred_scores.scalar_type() == at::kDouble;
  const auto ct = f64 ? at::kDouble : at::kFloat;
  return {f64,
          pred_dist.to(ct).contiguous(),
          pred_scores.to(ct).contiguous(),
          anchor_points.to(ct).contiguous(),
          target_bboxes.to(ct).contiguous(),
          target_scores.to(ct).contiguous(),
          fg_mask.to(at::kBool).contiguous()};
}

// bbox_loss_maps' inputs (the Detect head's maps read in place): every map (B, 4*reg_max + C, H, W) of one
// floating dtype family, in the compute type (float64 if any map is float64, else float32), with its pixels
// on one axis of stride 1 (a map that is not is copied once: channels_last or a crop); targets as
// bbox_loss_inputs with A = sum H*W.
struct BboxLossMapsInputs {
  bool f64;
  int64_t B, no, A, C;
  std::vector<at::Tensor> maps;
  at::Tensor anc, tb, ts, fg;
  at::Tensor lab;  // defined for per-anchor (B, A) target_scores
};

inline std::vector<at::Tensor> head_maps(at::TensorList feats, int64_t reg_max, int64_t max_reg_max,
                                         const char* op, bool& f64) {
  TORCH_CHECK(!feats.empty(), op, ": feats must hold at least one (B, 4*reg_max + C, H, W) map");
  // reg_max 1: raw distances (YOLO26); the class channels start at 4 either way.
  TORCH_CHECK(reg_max >= 1 && reg_max <= max_reg_max, op, ": reg_max must be in [1, ", max_reg_max, "], got ",
              reg_max);
  const int64_t B = feats[0].size(0), no = feats[0].dim() == 4 ? feats[0].size(1) : -1;
  f64 = false;
  for (size_t i = 0; i < feats.size(); ++i) {
    const auto& f = feats[i];
    TORCH_CHECK(f.dim() == 4 && f.size(0) == B && f.size(1) == no, op, ": feats[", i,
                "] must be (B, 4*reg_max + C, H, W) like feats[0] ", feats[0].sizes(), ", got ", f.sizes());
    TORCH_CHECK(f.is_floating_point(), op, ": feats[", i, "] must be floating point, got ", f.scalar_type());
    f64 = f64 || f.scalar_type() == at::kDouble;
  }
  TORCH_CHECK(no > 4 * reg_max, op, ": maps have ", no, " channels, need 4*reg_max + nc with nc >= 1 (reg_max ",
              reg_max, ")");
  std::vector<at::Tensor> maps;
  for (const auto& f : feats) {
    auto m = f.to(f64 ? at::kDouble : at::kFloat);
    if (m.stride(3) != 1 || m.stride(2) != m.size(3)) m = m.contiguous();
    maps.push_back(m);
  }
  return maps;
}

inline BboxLossMapsInputs bbox_loss_maps_inputs(at::TensorList feats, const at::Tensor& anchor_points,
                                                const at::Tensor& target_bboxes, const at::Tensor& target_scores,
                                                const at::Tensor& fg_mask, int64_t reg_max, int64_t max_reg_max,
                                                const std::optional<at::Tensor>& target_labels = std::nullopt) {
  BboxLossMapsInputs in;
  in.maps = head_maps(feats, reg_max, max_reg_max, "yolofast::bbox_loss_maps", in.f64);
  in.B = feats[0].size(0), in.no = feats[0].size(1), in.C = in.no - 4 * reg_max, in.A = 0;
  for (const auto& m : in.maps) in.A += m.size(2) * m.size(3);
  const int64_t B = in.B, A = in.A, C = in.C;
  TORCH_CHECK(anchor_points.dim() == 2 && anchor_points.size(0) == A && anchor_points.size(1) == 2,
              "yolofast::bbox_loss_maps: anchor_points must be (A, 2) with A = sum H*W = ", A, ", got ",
              anchor_points.sizes());
  TORCH_CHECK(target_bboxes.dim() == 3 && target_bboxes.size(0) == B && target_bboxes.size(1) == A &&
                  target_bboxes.size(2) == 4,
              "yolofast::bbox_loss_maps: target_bboxes must be (B, A, 4) = (", B, ", ", A, ", 4), got ",
              target_bboxes.sizes());
  const bool per_anchor = target_scores.dim() == 2;
  TORCH_CHECK(target_scores.size(0) == B && target_scores.size(1) == A &&
                  ((target_scores.dim() == 3 && target_scores.size(2) == C) || per_anchor),
              "yolofast::bbox_loss_maps: target_scores must be (B, A, nc) = (", B, ", ", A, ", ", C,
              ") or, with target_labels, (B, A) per anchor; got ", target_scores.sizes());
  TORCH_CHECK(!per_anchor || (target_labels.has_value() && target_labels->dim() == 2 &&
                              target_labels->size(0) == B && target_labels->size(1) == A &&
                              !at::isFloatingType(target_labels->scalar_type())),
              "yolofast::bbox_loss_maps: (B, A) target_scores hold one class per anchor: pass its class as "
              "target_labels, an integer (B, A) = (", B, ", ", A, ") tensor (tal_assign's first output)");
  if (per_anchor) in.lab = target_labels->to(at::kLong).contiguous();
  TORCH_CHECK(fg_mask.dim() == 2 && fg_mask.size(0) == B && fg_mask.size(1) == A,
              "yolofast::bbox_loss_maps: fg_mask must be (B, A) = (", B, ", ", A, "), got ", fg_mask.sizes());
  const auto ct = in.f64 ? at::kDouble : at::kFloat;
  in.anc = anchor_points.to(ct).contiguous();
  in.tb = target_bboxes.to(ct).contiguous();
  in.ts = target_scores.to(ct).contiguous();
  in.fg = fg_mask.to(at::kBool).contiguous();
  return in;
}

}  // namespace yolofast_checks
