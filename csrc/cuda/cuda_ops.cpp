// at::Tensor bindings of the CUDA kernels: TORCH_LIBRARY_IMPL(yolofast, CUDA, m) for the schemas defined
// in yolofast/ops/_library.py. Shapes, dtypes and outputs follow the CPU kernels (csrc/cpu/*.cpp) and the
// references (yolofast/ops/reference.py); the kernels themselves are in *.cu (no torch headers there).
//
// Every op: checks (clear messages naming the argument), a device guard, the current stream, outputs and
// workspace from the caching allocator (CUDA-graph friendly: no host sync, no cudaMalloc), and a
// TORCH_CHECK on the launcher's error code (cudaGetLastError after every launch).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdlib>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "cuda_launchers.h"
#include "ns_orthogonalize_cuda.h"
#include "op_checks.h"

namespace yolofast {
namespace cuda {
namespace {

using Outputs5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// YOLOFAST_POISON_OUTPUTS=1: fill fresh outputs with NaN / -7 / true first, so a test sees any element a
// kernel forgets to write (same switch as the CPU kernels, csrc/cpu/cpu_common.h).
bool poison_outputs() {
  const char* v = std::getenv("YOLOFAST_POISON_OUTPUTS");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

void poison(at::Tensor& t) {
  if (t.is_floating_point()) t.fill_(std::numeric_limits<double>::quiet_NaN());
  else if (t.scalar_type() == at::kBool) t.fill_(true);
  else t.fill_(-7);
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "yolofast::", op, " (CUDA): kernel launch failed: ", cudaGetErrorString(err),
              " (", static_cast<int>(err), ")");
}

void check_device(const at::Tensor& ref, std::initializer_list<std::pair<const char*, const at::Tensor*>> ts,
                  const char* op) {
  TORCH_CHECK(ref.is_cuda(), op, ": expected CUDA tensors, got ", ref.device());
  for (const auto& [name, t] : ts)
    TORCH_CHECK(t->device() == ref.device(), op, ": ", name, " is on ", t->device(), " but the other inputs on ",
                ref.device(), "; move every input to one device");
}

// ------------------------------------------------------------------------------------------ tal_assign
void tal_check_shapes(const at::Tensor& pd_scores, const at::Tensor& pd_bboxes, const at::Tensor& anc_points,
                      const at::Tensor& gt_labels, const at::Tensor& gt_bboxes, const at::Tensor& mask_gt,
                      int64_t topk) {
  yolofast_checks::tal_assign_shapes(pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt, topk);
  TORCH_CHECK(pd_scores.size(0) <= 65535,
              "tal_assign (CUDA): the batch must be <= 65535 images (one grid row each), got ", pd_scores.size(0));
}

Outputs5 tal_assign_cuda(const at::Tensor& pd_scores, const at::Tensor& pd_bboxes, const at::Tensor& anc_points,
                         const at::Tensor& gt_labels, const at::Tensor& gt_bboxes, const at::Tensor& mask_gt,
                         int64_t topk, double alpha, double beta, double eps, int64_t topk2) {
  tal_check_shapes(pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt, topk);
  const int64_t k2 = yolofast_checks::tal_assign_topk2(topk, topk2);
  TORCH_CHECK(k2 <= kTalMaxTopk, "tal_assign (CUDA): topk2 must be <= ", kTalMaxTopk, " (one pass each), got ",
              topk2);
  check_device(pd_scores,
               {{"pd_bboxes", &pd_bboxes}, {"anc_points", &anc_points}, {"gt_labels", &gt_labels},
                {"gt_bboxes", &gt_bboxes}, {"mask_gt", &mask_gt}},
               "tal_assign");
  const c10::cuda::CUDAGuard guard(pd_scores.device());
  const int64_t B = pd_scores.size(0), A = pd_scores.size(1), C = pd_scores.size(2), M = gt_bboxes.size(1);
  const auto opts = pd_scores.options();
  if (M == 0 || B * A == 0) {  // no GT slot at all: everything is background of class C (DESIGN §2.1 step 6)
    return {at::full({B, A}, C, opts.dtype(at::kLong)), at::zeros({B, A, 4}, gt_bboxes.options()),
            at::zeros({B, A, C}, opts), at::zeros({B, A}, opts.dtype(at::kBool)),
            at::zeros({B, A}, opts.dtype(at::kLong))};
  }
  TORCH_CHECK(C > 0, "tal_assign: pd_scores has no classes (C = 0)");
  const int64_t k = std::min<int64_t>(topk, A);
  TORCH_CHECK(k <= kTalMaxTopk, "tal_assign (CUDA): topk must be <= ", kTalMaxTopk,
              " (the per-GT top-k lives in shared memory), got ", topk);
  const auto in =
      yolofast_checks::tal_assign_inputs(pd_scores, pd_bboxes, anc_points, gt_labels, gt_bboxes, mask_gt);
  const bool f64 = in.f64;
  const auto ct = in.scores.scalar_type();
  const at::Tensor &scores = in.scores, &pbox = in.pbox, &anc = in.anc, &gt = in.gt, &labels = in.labels,
                   &real = in.real;

  at::Tensor o_lab = at::empty({B, A}, opts.dtype(at::kLong));
  at::Tensor o_box = at::empty({B, A, 4}, opts.dtype(ct));
  at::Tensor o_sc = at::empty({B, A, C}, opts.dtype(ct));
  at::Tensor o_fg = at::empty({B, A}, opts.dtype(at::kBool));
  at::Tensor o_idx = at::empty({B, A}, opts.dtype(at::kLong));
  if (poison_outputs())
    for (at::Tensor* t : {&o_lab, &o_box, &o_sc, &o_fg, &o_idx}) poison(*t);

  TalShape shape{B, A, C, M, k, k2, alpha, beta, eps};
  at::Tensor ws = at::empty({static_cast<int64_t>(tal_assign_workspace_bytes(shape, f64))}, opts.dtype(at::kByte));
  TalArgs args{scores.const_data_ptr(), pbox.const_data_ptr(), anc.const_data_ptr(),
               labels.const_data_ptr<int64_t>(), gt.const_data_ptr(), real.const_data_ptr<bool>(),
               o_lab.mutable_data_ptr<int64_t>(), o_box.mutable_data_ptr(), o_sc.mutable_data_ptr(),
               o_fg.mutable_data_ptr<bool>(), o_idx.mutable_data_ptr<int64_t>(), ws.mutable_data_ptr()};
  check_launch(tal_assign_launch(shape, args, f64, c10::cuda::getCurrentCUDAStream().stream()), "tal_assign");
  // Casting back is exact for the boxes (they came from gt_bboxes) and rounds the scores once, like the
  // reference's final .to(pd_scores.dtype).
  return {o_lab, o_box.to(gt_bboxes.scalar_type()), o_sc.to(pd_scores.scalar_type()), o_fg, o_idx};
}

// ------------------------------------------------------------------------------------------- bbox_loss
Outputs5 bbox_loss_cuda(const at::Tensor& pred_dist, const at::Tensor& pred_scores, const at::Tensor& anchor_points,
                        const at::Tensor& target_bboxes, const at::Tensor& target_scores, const at::Tensor& fg_mask) {
  yolofast_checks::bbox_loss_shapes(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask,
                                    kBboxMaxRegMax);
  const int64_t B = pred_dist.size(0), A = pred_dist.size(1), R4 = pred_dist.size(2), R = R4 / 4;
  const int64_t C = pred_scores.size(2);
  check_device(pred_dist,
               {{"pred_scores", &pred_scores}, {"anchor_points", &anchor_points}, {"target_bboxes", &target_bboxes},
                {"target_scores", &target_scores}, {"fg_mask", &fg_mask}},
               "yolofast::bbox_loss");
  const c10::cuda::CUDAGuard guard(pred_dist.device());

  const auto in =
      yolofast_checks::bbox_loss_inputs(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask);
  const bool f64 = in.f64;
  const at::Tensor &pd = in.pd, &ps = in.ps, &anc = in.anc, &tb = in.tb, &ts = in.ts, &fg = in.fg;
  const auto opt = pd.options();
  at::Tensor losses = at::empty({3}, opt);
  at::Tensor gbox = at::empty({B, A, R4}, opt);
  at::Tensor gdfl = at::empty({B, A, R4}, opt);
  at::Tensor gcls = at::empty({B, A, C}, opt);
  at::Tensor inv_s = at::empty({}, opt);
  if (poison_outputs())
    for (at::Tensor* t : {&losses, &gbox, &gdfl, &gcls, &inv_s}) poison(*t);

  const BboxShape shape{B, A, C, R};
  at::Tensor ws = at::empty({static_cast<int64_t>(bbox_loss_workspace_bytes(shape))}, opt.dtype(at::kByte));
  const BboxArgs args{pd.const_data_ptr(), ps.const_data_ptr(), anc.const_data_ptr(), tb.const_data_ptr(),
                      ts.const_data_ptr(), fg.const_data_ptr<bool>(), losses.mutable_data_ptr(),
                      gbox.mutable_data_ptr(), gdfl.mutable_data_ptr(), gcls.mutable_data_ptr(),
                      inv_s.mutable_data_ptr(), ws.mutable_data_ptr()};
  check_launch(bbox_loss_launch(shape, args, f64, c10::cuda::getCurrentCUDAStream().stream()), "bbox_loss");
  return {losses, gbox, gdfl, gcls, inv_s};
}

// bbox_loss for reg_max 1 (YOLO26): pred_dist (B, A, 4) raw distances, the third loss the L1 term (each
// anchor's stride from stride_tensor, the batch image's img_h x img_w); the same outputs as bbox_loss, the
// L1 gradient in the DFL gradient's place.
Outputs5 bbox_loss_l1_cuda(const at::Tensor& pred_dist, const at::Tensor& pred_scores,
                           const at::Tensor& anchor_points, const at::Tensor& target_bboxes,
                           const at::Tensor& target_scores, const at::Tensor& fg_mask,
                           const at::Tensor& stride_tensor, double img_h, double img_w) {
  yolofast_checks::bbox_loss_l1_shapes(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask,
                                       stride_tensor, img_h, img_w);
  const int64_t B = pred_dist.size(0), A = pred_dist.size(1), C = pred_scores.size(2);
  check_device(pred_dist,
               {{"pred_scores", &pred_scores}, {"anchor_points", &anchor_points}, {"target_bboxes", &target_bboxes},
                {"target_scores", &target_scores}, {"fg_mask", &fg_mask}, {"stride_tensor", &stride_tensor}},
               "yolofast::bbox_loss.l1");
  const c10::cuda::CUDAGuard guard(pred_dist.device());

  const auto in =
      yolofast_checks::bbox_loss_inputs(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask);
  const at::Tensor &pd = in.pd, &ps = in.ps, &anc = in.anc, &tb = in.tb, &ts = in.ts, &fg = in.fg;
  const auto opt = pd.options();
  const at::Tensor stride = stride_tensor.reshape({A}).to(opt.dtype()).contiguous();
  at::Tensor losses = at::empty({3}, opt);
  at::Tensor gbox = at::empty({B, A, 4}, opt);
  at::Tensor gl1 = at::empty({B, A, 4}, opt);
  at::Tensor gcls = at::empty({B, A, C}, opt);
  at::Tensor inv_s = at::empty({}, opt);
  if (poison_outputs())
    for (at::Tensor* t : {&losses, &gbox, &gl1, &gcls, &inv_s}) poison(*t);

  const BboxShape shape{B, A, C, 1};
  at::Tensor ws = at::empty({static_cast<int64_t>(bbox_loss_workspace_bytes(shape))}, opt.dtype(at::kByte));
  const BboxArgs args{pd.const_data_ptr(), ps.const_data_ptr(), anc.const_data_ptr(), tb.const_data_ptr(),
                      ts.const_data_ptr(), fg.const_data_ptr<bool>(), losses.mutable_data_ptr(),
                      gbox.mutable_data_ptr(), gl1.mutable_data_ptr(), gcls.mutable_data_ptr(),
                      inv_s.mutable_data_ptr(), ws.mutable_data_ptr()};
  const BboxL1 l1{stride.const_data_ptr(), img_h, img_w};
  check_launch(bbox_loss_l1_launch(shape, args, l1, in.f64, c10::cuda::getCurrentCUDAStream().stream()),
               "bbox_loss.l1");
  return {losses, gbox, gl1, gcls, inv_s};
}

// bbox_loss_maps for reg_max 1 (YOLO26): the Detect head's maps read in place, the outputs of the CPU op
// (csrc/cpu/bbox_loss_kernel.cpp) in its static layout: every anchor's row (B*A, 2, 4) and fg_index =
// 0..B*A-1 whatever `compact` asks (a compact layout's size is data-dependent: a host sync). weights (the
// CPU op's final gradients) need S before the pass and are refused here; the Python wrapper never passes
// them to CUDA. DFL maps take the (B, A, .) op after a cat.
using MapsOutputs = std::tuple<at::Tensor, std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor>;

MapsOutputs bbox_loss_maps_cuda(at::TensorList feats, const at::Tensor& anchor_points, const at::Tensor& target_bboxes,
                                const at::Tensor& target_scores, const at::Tensor& fg_mask, int64_t reg_max,
                                bool compact, const std::optional<at::Tensor>& target_labels,
                                const std::optional<at::Tensor>& weights, const std::optional<at::Tensor>& l1_scale) {
  (void)compact;
  TORCH_CHECK(reg_max == 1, "yolofast::bbox_loss_maps (CUDA): the maps kernel reads reg_max 1 (raw distance) maps; "
              "got reg_max ", reg_max, " (DFL maps go through yolofast::bbox_loss after a cat)");
  TORCH_CHECK(!weights.has_value(), "yolofast::bbox_loss_maps (CUDA): weights (final gradients in the forward) are a "
              "CPU-only form; pass None");
  const auto in = yolofast_checks::bbox_loss_maps_inputs(feats, anchor_points, target_bboxes, target_scores, fg_mask,
                                                          reg_max, 1, target_labels);
  const int64_t L = static_cast<int64_t>(in.maps.size());
  TORCH_CHECK(L <= kMapsMaxLevels, "yolofast::bbox_loss_maps (CUDA): at most ", kMapsMaxLevels, " maps, got ", L);
  TORCH_CHECK(l1_scale.has_value() && l1_scale->numel() == L + 2, "yolofast::bbox_loss_maps: reg_max 1 needs l1_scale (",
              L + 2, ",) = the stride of each map and the batch image's (H, W), to normalise the L1 distances");
  const at::Tensor& ref = in.maps[0];
  check_device(ref, {{"anchor_points", &in.anc}, {"target_bboxes", &in.tb}, {"target_scores", &in.ts},
                     {"fg_mask", &in.fg}},
               "yolofast::bbox_loss_maps");
  for (int64_t l = 1; l < L; ++l) check_device(ref, {{"feats[i]", &in.maps[l]}}, "yolofast::bbox_loss_maps");
  if (in.lab.defined()) check_device(ref, {{"target_labels", &in.lab}}, "yolofast::bbox_loss_maps");
  const c10::cuda::CUDAGuard guard(ref.device());
  const at::Tensor scale = l1_scale->to(at::kCPU, at::kDouble).contiguous();  // a CPU tensor: no sync
  const double* sc = scale.const_data_ptr<double>();

  const int64_t B = in.B, A = in.A, C = in.C;
  const auto opt = ref.options();
  BboxMapsArgs args{};
  std::vector<at::Tensor> gcls;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor& m = in.maps[l];
    gcls.push_back(at::empty({B, C, m.size(2), m.size(3)}, opt));
    args.map[l] = m.const_data_ptr();
    args.gcls[l] = gcls.back().mutable_data_ptr();
    args.sb[l] = m.stride(0), args.sc[l] = m.stride(1), args.hw[l] = m.size(2) * m.size(3);
    args.stride[l] = sc[l];
  }
  at::Tensor losses = at::empty({3}, opt), rows = at::empty({B * A, 2, 4}, opt), inv_s = at::empty({}, opt);
  if (poison_outputs()) {
    for (at::Tensor* t : {&losses, &rows, &inv_s}) poison(*t);
    for (at::Tensor& g : gcls) poison(g);
  }
  const at::Tensor index = at::arange(B * A, opt.dtype(at::kLong));
  const BboxMapsShape shape{B, A, C, static_cast<int>(L)};
  at::Tensor ws = at::empty({static_cast<int64_t>(bbox_loss_maps_workspace_bytes(shape))}, opt.dtype(at::kByte));
  args.img_h = sc[L], args.img_w = sc[L + 1];
  args.anc = in.anc.const_data_ptr(), args.tb = in.tb.const_data_ptr(), args.ts = in.ts.const_data_ptr();
  args.lab = in.lab.defined() ? in.lab.const_data_ptr<int64_t>() : nullptr;
  args.fg = in.fg.const_data_ptr<bool>();
  args.losses = losses.mutable_data_ptr(), args.rows = rows.mutable_data_ptr();
  args.inv_s = inv_s.mutable_data_ptr(), args.workspace = ws.mutable_data_ptr();
  check_launch(bbox_loss_maps_l1_launch(shape, args, in.f64, c10::cuda::getCurrentCUDAStream().stream()),
               "bbox_loss_maps");
  return {losses, gcls, rows, index, inv_s};
}

// backward of bbox_loss_maps (any reg_max): each map's gradient (B, 4R + C, H, W) written once.
std::vector<at::Tensor> bbox_loss_maps_scale_cuda(at::TensorList grad_cls, const at::Tensor& fg_rows,
                                                  const at::Tensor& fg_index, const at::Tensor& c, int64_t reg_max) {
  TORCH_CHECK(!grad_cls.empty() && grad_cls.size() <= static_cast<size_t>(kMapsMaxLevels) && fg_rows.dim() == 3 &&
                  fg_rows.size(1) == 2 && fg_rows.size(2) == 4 * reg_max && fg_index.dim() == 1 &&
                  fg_index.size(0) == fg_rows.size(0) && c.numel() == 3,
              "yolofast::_bbox_loss_maps_scale: expects bbox_loss_maps' class gradients [(B, C, H, W)] (at most ",
              kMapsMaxLevels, "), foreground rows (N, 2, 4*reg_max), their index (N,) and c (3,); got ",
              fg_rows.sizes(), ", ", fg_index.sizes(), ", ", c.sizes());
  const auto dt = fg_rows.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble, "yolofast::_bbox_loss_maps_scale: the gradients must be "
              "float32 or float64 (bbox_loss_maps' compute dtype)");
  check_device(fg_rows, {{"fg_index", &fg_index}, {"c", &c}}, "yolofast::_bbox_loss_maps_scale");
  const c10::cuda::CUDAGuard guard(fg_rows.device());
  const int64_t B = grad_cls[0].size(0), C = grad_cls[0].size(1), R4 = 4 * reg_max;
  BboxMapsScale s{};
  std::vector<at::Tensor> gc, out;
  int64_t A = 0;
  for (size_t l = 0; l < grad_cls.size(); ++l) {
    const at::Tensor& g = grad_cls[l];
    TORCH_CHECK(g.dim() == 4 && g.size(0) == B && g.size(1) == C && g.scalar_type() == dt,
                "yolofast::_bbox_loss_maps_scale: every class gradient must be (B, C, H, W) = (", B, ", ", C,
                ", H, W) of ", dt, ", got ", g.sizes(), " ", g.scalar_type());
    check_device(fg_rows, {{"grad_cls[i]", &g}}, "yolofast::_bbox_loss_maps_scale");
    gc.push_back(g.contiguous());
    out.push_back(at::empty({B, R4 + C, g.size(2), g.size(3)}, g.options()));
    if (poison_outputs()) poison(out.back());
    s.gcls[l] = gc.back().const_data_ptr(), s.out[l] = out.back().mutable_data_ptr();
    s.hw[l] = g.size(2) * g.size(3);
    A += s.hw[l];
  }
  const at::Tensor rows = fg_rows.contiguous(), index = fg_index.to(at::kLong).contiguous(), cc = c.to(dt).contiguous();
  s.B = B, s.A = A, s.C = C, s.R4 = R4, s.nfg = rows.size(0), s.L = static_cast<int>(grad_cls.size());
  s.rows = rows.const_data_ptr(), s.index = index.const_data_ptr<int64_t>(), s.c = cc.const_data_ptr();
  check_launch(bbox_loss_maps_scale_launch(s, dt == at::kDouble, c10::cuda::getCurrentCUDAStream().stream()),
               "_bbox_loss_maps_scale");
  return out;
}

// ------------------------------------------------------------------------------------------ ema_update
EmaType ema_type(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return EmaType::kFloat;
    case at::kDouble:
      return EmaType::kDouble;
    case at::kHalf:
      return EmaType::kHalf;
    case at::kBFloat16:
      return EmaType::kBFloat16;
    default:
      TORCH_CHECK(false, "yolofast::ema_update: ema must be float32/float64/float16/bfloat16, got ", t);
  }
}

void ema_update_cuda(const at::Tensor& ema, const at::Tensor& model, const at::Tensor& decay) {
  TORCH_CHECK(ema.is_floating_point(), "yolofast::ema_update: ema must be floating point, got ", ema.scalar_type());
  TORCH_CHECK(model.is_floating_point(), "yolofast::ema_update: model must be floating point, got ",
              model.scalar_type());
  TORCH_CHECK(ema.sizes() == model.sizes(), "yolofast::ema_update: ema ", ema.sizes(), " and model ", model.sizes(),
              " differ in shape");
  TORCH_CHECK(ema.is_contiguous(), "yolofast::ema_update: ema must be contiguous (it is updated in place; "
              "keep the EMA state in one flat buffer)");
  TORCH_CHECK(decay.numel() == 1, "yolofast::ema_update: decay must hold one value, got shape ", decay.sizes());
  check_device(ema, {{"model", &model}}, "yolofast::ema_update");
  TORCH_CHECK(decay.is_cpu() || decay.device() == ema.device(), "yolofast::ema_update: decay is on ", decay.device(),
              " but ema on ", ema.device(), "; keep the decay on ema's device (or pass a float)");
  const c10::cuda::CUDAGuard guard(ema.device());

  const EmaType et = ema_type(ema.scalar_type());
  const at::ScalarType op_type = ema.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // A model in another dtype is read at the compute precision (as the reference's model.to(...)).
  const at::Tensor m = model.scalar_type() == ema.scalar_type() ? model.contiguous() : model.to(op_type).contiguous();

  EmaArgs args{};
  args.ema = ema.mutable_data_ptr();
  args.model = m.const_data_ptr();
  args.n = ema.numel();
  args.ema_type = et;
  args.model_type = ema_type(m.scalar_type());
  at::Tensor w_dev;  // kept alive until the kernel is enqueued
  const at::ScalarType dt = decay.scalar_type();
  if (decay.is_cuda()) {  // read by the kernel: no host sync, capturable in a CUDA graph
    if (dt == at::kFloat || dt == at::kDouble) {
      args.weight_kind = dt == at::kFloat ? EmaWeight::kDecayF32 : EmaWeight::kDecayF64;
      w_dev = decay.contiguous();
    } else {  // 1 - d formed in the decay's own (low) precision, as the reference does
      args.weight_kind = EmaWeight::kWeightF64;
      w_dev = at::rsub(decay, 1).to(at::kDouble).contiguous();
    }
    args.weight_ptr = w_dev.const_data_ptr();
  } else {  // a CPU scalar: reading it costs no sync
    args.weight_kind = EmaWeight::kHost;
    if (dt == at::kFloat) args.w_host = static_cast<double>(1.0f - decay.item<float>());
    else if (dt == at::kDouble) args.w_host = 1.0 - decay.item<double>();
    else args.w_host = at::rsub(decay, 1).item<double>();
  }
  check_launch(ema_update_launch(args, c10::cuda::getCurrentCUDAStream().stream()), "ema_update");
}

}  // namespace
}  // namespace cuda
}  // namespace yolofast

TORCH_LIBRARY_IMPL(yolofast, CUDA, m) {
  m.impl("tal_assign", &yolofast::cuda::tal_assign_cuda);
  m.impl("bbox_loss", &yolofast::cuda::bbox_loss_cuda);
  m.impl("bbox_loss.l1", &yolofast::cuda::bbox_loss_l1_cuda);
  m.impl("bbox_loss_maps", &yolofast::cuda::bbox_loss_maps_cuda);
  m.impl("_bbox_loss_maps_scale", &yolofast::cuda::bbox_loss_maps_scale_cuda);
  m.impl("ema_update", &yolofast::cuda::ema_update_cuda);
  m.impl("ns_orthogonalize", &yolofast::cuda::ns_orthogonalize_cuda);
}
