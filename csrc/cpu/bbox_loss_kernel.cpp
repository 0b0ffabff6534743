// Fused CIoU box loss + DFL + BCE class loss with their gradients (DESIGN §2.2), CPU, two entry points:
//
// yolofast::bbox_loss(pred_dist (B,A,4R), pred_scores (B,A,C), anchor_points (A,2), target_bboxes (B,A,4),
//                     target_scores (B,A,C), fg_mask (B,A))
//   -> (losses (3,) [L_box, L_cls, L_dfl] divided by S,
//       grad_dist_box (B,A,4R), grad_dist_dfl (B,A,4R), grad_scores (B,A,C), inv_s ())
// yolofast::bbox_loss_maps(feats [(B, 4R+C, H_i, W_i)], anchor_points, target_bboxes, target_scores,
//                          fg_mask, reg_max, compact, target_labels, weights)
//   -> (losses (3,), grad_cls [(B, C, H_i, W_i)], fg_rows (N, 2, 4R), fg_index (N,), inv_s ())
// The second reads the Detect head's maps where they are (anchor a of level i is pixel h*W_i + w, levels
// in order): no (B, A, .) copy of the logits is made. Its class gradient comes out in the maps' layout and
// the box / DFL gradients of the N foreground anchors as compact rows (index b*A + a, ascending);
// yolofast::_bbox_loss_maps_scale (its backward) writes each map's whole gradient from them in one pass.
// Given weights w (3,), the incoming gradient its caller will send (DetectionLoss: its gains x batch), it
// writes the whole final gradient of w . [L_box, L_cls, L_dfl] w.r.t. each map instead of grad_cls, in the
// same pass (the backward then has nothing to write when that gradient arrives).
// N is data-dependent; compact = false gives the static shape instead (N = B*A, row b*A + a, zero rows off
// the foreground: what torch.compile and a CUDA-graph capture need, at the cost of writing them).
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
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
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

std::vector<Block> make_blocks(const std::vector<int64_t>& level_sizes, int64_t B, int64_t per_block) {
  std::vector<Block> blocks;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < static_cast<int64_t>(level_sizes.size()); ++l)
      for (int64_t i0 = 0; i0 < level_sizes[l]; i0 += per_block)
        blocks.push_back({l, b, i0, std::min(level_sizes[l], i0 + per_block)});
  return blocks;
}

// row0: each block's first compact foreground row (empty when the levels write gbox / gdfl).
template <typename T>
std::vector<double> run_blocks(const std::vector<LossLevel<T>>& levels, const LossTargets<T>& tg,
                               const std::vector<Block>& blocks, const std::vector<int64_t>& row0) {
  const int64_t nb = static_cast<int64_t>(blocks.size());
  std::vector<double> partial(static_cast<size_t>(nb) * 4, 0.0);
  at::parallel_for(0, nb, 1, [&](int64_t k0, int64_t k1) {
    note_thread();
    for (int64_t k = k0; k < k1; ++k) {
      const Block& bl = blocks[k];
      loss_block<T>(levels[bl.level], tg, bl.b, bl.i0, bl.i1, row0.empty() ? 0 : row0[k], partial.data() + 4 * k);
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
          ts.size(1), ts.dim() == 3 ? ts.size(2) : 0, R};  // C of per-anchor targets: set by the caller
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

// Where the box and DFL gradients of S*L_box, S*L_dfl go: compact (the foreground anchors' rows only, at
// b8/640/50 GT ~4 % of the anchors, so the forward no longer writes and the backward no longer reads 2 x 17 MB
// of zero rows) or, for a static shape, one zero-initialised row per anchor (row b*A + a).
struct FgRows {
  std::vector<int64_t> row0;  // each block's first row
  at::Tensor rows, index;     // (N, 2, 4R) [box, DFL], (N,) global anchor b*A + a, ascending
};

// blocks: in (b, level, anchor) order, which is ascending b*A + a; level_a0: each level's first anchor.
FgRows foreground_rows(const std::vector<Block>& blocks, const std::vector<int64_t>& level_a0, const bool* fg,
                       int64_t B, int64_t A, int64_t R4, bool compact, const at::TensorOptions& opt) {
  FgRows out;
  out.row0.resize(blocks.size());
  int64_t nfg = 0;
  for (size_t k = 0; k < blocks.size(); ++k) {
    const int64_t first = blocks[k].b * A + level_a0[blocks[k].level];
    if (!compact) {
      out.row0[k] = first + blocks[k].i0;
      continue;
    }
    out.row0[k] = nfg;
    nfg += std::count(fg + first + blocks[k].i0, fg + first + blocks[k].i1, true);
  }
  if (compact) {
    out.rows = at::empty({nfg, 2, R4}, opt);
    out.index = at::empty({nfg}, opt.dtype(at::kLong));
    poison({&out.rows});
    if (poison_outputs()) out.index.fill_(-1);
  } else {
    out.rows = at::zeros({B * A, 2, R4}, opt);
    out.index = at::arange(B * A, opt.dtype(at::kLong));
  }
  return out;
}

template <typename T>
void write_compact(LossLevel<T>& L, FgRows& r, bool compact) {
  L.compact = true, L.rows_by_anchor = !compact;
  L.fg_rows = r.rows.mutable_data_ptr<T>();
  L.fg_index = r.index.mutable_data_ptr<int64_t>();
}

// bbox_loss's CPU path: the (B, A, .) loss with the box and DFL gradients as foreground rows.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bbox_loss_rows_cpu(
    const at::Tensor& pred_dist, const at::Tensor& pred_scores, const at::Tensor& anchor_points,
    const at::Tensor& target_bboxes, const at::Tensor& target_scores, const at::Tensor& fg_mask, bool compact) {
  yolofast_checks::bbox_loss_shapes(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask,
                                    kMaxRegMax);
  const int64_t B = pred_dist.size(0), A = pred_dist.size(1), R4 = pred_dist.size(2), C = pred_scores.size(2);
  const auto in =
      yolofast_checks::bbox_loss_inputs(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask);
  const auto opt = in.pd.options();
  auto gcls = at::empty({B, A, C}, opt);
  poison({&gcls});
  const std::vector<Block> blocks = make_blocks({A}, B, kRowBlock);
  FgRows fr = foreground_rows(blocks, {0, A}, in.fg.const_data_ptr<bool>(), B, A, R4, compact, opt);

  auto go = [&](auto zero) {
    using T = decltype(zero);
    LossLevel<T> L;
    const auto pd = rows_of<T>(in.pd), ps = rows_of<T>(in.ps);
    L.dist = {pd.p, pd.sb, pd.sc, pd.sa};
    L.score = {ps.p, ps.sb, ps.sc, ps.sa};
    L.gcls = rows_of<T>(gcls);
    write_compact<T>(L, fr, compact);
    L.n = A, L.a0 = 0;
    return run_blocks<T>({L}, targets_of<T>(in.anc, in.tb, in.ts, in.fg, static_cast<int>(R4 / 4)), blocks,
                         fr.row0);
  };
  const auto sums = in.f64 ? go(double(0)) : go(float(0));
  auto [losses, inv_s] = losses_and_inv_s(sums, in.f64, opt);
  return {losses, gcls, fr.rows, fr.index, inv_s};
}

// yolofast::bbox_loss's (B, A, .) contract on the CPU, kept for callers of the op itself (the public
// bbox_loss takes bbox_loss.rows): the rows of every anchor, split into the box and DFL gradients.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bbox_loss_cpu(
    const at::Tensor& pred_dist, const at::Tensor& pred_scores, const at::Tensor& anchor_points,
    const at::Tensor& target_bboxes, const at::Tensor& target_scores, const at::Tensor& fg_mask) {
  auto [losses, gcls, rows, index, inv_s] =
      bbox_loss_rows_cpu(pred_dist, pred_scores, anchor_points, target_bboxes, target_scores, fg_mask, false);
  const auto sizes = gcls.sizes().vec();
  const std::vector<int64_t> box_sizes = {sizes[0], sizes[1], rows.size(2)};
  auto part = [&](int64_t i) { return rows.select(1, i).reshape(box_sizes).contiguous(); };
  return {losses, part(0), part(1), gcls, inv_s};
}

std::tuple<at::Tensor, std::vector<at::Tensor>, at::Tensor, at::Tensor, at::Tensor> bbox_loss_maps_cpu(
    at::TensorList feats, const at::Tensor& anchor_points, const at::Tensor& target_bboxes,
    const at::Tensor& target_scores, const at::Tensor& fg_mask, int64_t reg_max, bool compact,
    const std::optional<at::Tensor>& target_labels, const std::optional<at::Tensor>& weights,
    const std::optional<at::Tensor>& l1_scale) {
  const auto in = yolofast_checks::bbox_loss_maps_inputs(feats, anchor_points, target_bboxes, target_scores,
                                                          fg_mask, reg_max, kMaxRegMax, target_labels);
  // reg_max 1: l1_scale = (stride of each map, H, W of the batch image) for the L1 term.
  const int64_t n_maps = static_cast<int64_t>(in.maps.size());
  TORCH_CHECK(reg_max != 1 || (l1_scale.has_value() && l1_scale->numel() == n_maps + 2),
              "yolofast::bbox_loss_maps: reg_max 1 needs l1_scale (", n_maps + 2, ",) = the stride of each map "
              "and the batch image's (H, W), to normalise the L1 distances");
  std::vector<double> l1s;
  if (reg_max == 1) {
    const at::Tensor t = l1_scale->to(at::kCPU, at::kDouble).contiguous();
    l1s.assign(t.const_data_ptr<double>(), t.const_data_ptr<double>() + t.numel());
  }
  const int64_t B = in.B, R4 = 4 * reg_max, C = in.C, A = in.A, no = R4 + C;
  const bool final_grads = weights.has_value();
  TORCH_CHECK(!final_grads || (in.lab.defined() && weights->numel() == 3),
              "yolofast::bbox_loss_maps: weights (3,) need per-anchor target_scores (B, A) with target_labels");
  const auto opt = in.maps[0].options();
  std::vector<at::Tensor> gcls;  // (B, C, H, W) each, or the whole (B, 4R + C, H, W) gradients
  std::vector<int64_t> sizes;
  for (const auto& m : in.maps) {
    gcls.push_back(at::empty({B, final_grads ? no : C, m.size(2), m.size(3)}, opt));
    sizes.push_back(m.size(2) * m.size(3));
    poison({&gcls.back()});
  }
  const std::vector<Block> blocks = make_blocks(sizes, B, kMapBlock);
  std::vector<int64_t> level_a0(sizes.size() + 1, 0);
  for (size_t l = 0; l < sizes.size(); ++l) level_a0[l + 1] = level_a0[l] + sizes[l];
  FgRows fr = foreground_rows(blocks, level_a0, in.fg.const_data_ptr<bool>(), B, A, R4, compact, opt);
  // Final gradients need S = sum t before the pass: summed here as run_blocks will (per block in anchor
  // order, blocks in order, in double), so the factors are those the backward would form from its inv_s.
  double S_pre = 0;
  at::Tensor k_t;
  if (final_grads) {
    for (const Block& bl : blocks) {
      const int64_t ba0 = bl.b * A + level_a0[bl.level];
      double s_blk = 0;
      auto add = [&](auto zero) {
        using T = decltype(zero);
        const T* ts = in.ts.const_data_ptr<T>();
        for (int64_t i = bl.i0; i < bl.i1; ++i)
          if (ts[ba0 + i] != T(0)) s_blk += double(ts[ba0 + i]);
      };
      in.f64 ? add(double(0)) : add(float(0));
      S_pre += s_blk;
    }
    const double S = std::max(S_pre, 1.0);
    // c = weights.to(inv_s.dtype) * inv_s, as _bbox_loss_grad.maps_backward computes it.
    const auto ct = in.f64 ? at::kDouble : at::kFloat;
    const at::Tensor w = weights->to(at::kCPU).to(ct).contiguous();
    k_t = at::empty({3}, opt.dtype(ct));
    auto scale = [&](auto zero) {
      using T = decltype(zero);
      for (int i = 0; i < 3; ++i) {
        const T wi = w.const_data_ptr<T>()[i];
        TORCH_CHECK(std::isfinite(static_cast<double>(wi)) && wi != T(0), "yolofast::bbox_loss_maps: weights "
                    "must be finite and non-zero (the backward rescales from them for any other gradient); got ",
                    weights->cpu());
      }
      const T inv = static_cast<T>(1.0 / S);  // losses_and_inv_s' inv_s
      for (int i = 0; i < 3; ++i) k_t.mutable_data_ptr<T>()[i] = w.const_data_ptr<T>()[i] * inv;
    };
    in.f64 ? scale(double(0)) : scale(float(0));
  }

  auto go = [&](auto zero) {
    using T = decltype(zero);
    std::vector<LossLevel<T>> levels;
    for (size_t l = 0; l < in.maps.size(); ++l) {
      const auto& m = in.maps[l];
      const int64_t hw = sizes[l];
      const T* p = m.const_data_ptr<T>();
      LossLevel<T> L;
      // A map's pixels are one axis (bbox_loss_maps_inputs guarantees stride(2) == W * stride(3) == W).
      L.dist = {p, m.stride(0), m.stride(1), 1};
      L.score = {p + R4 * m.stride(1), m.stride(0), m.stride(1), 1};
      T* g = gcls[l].mutable_data_ptr<T>();
      if (final_grads) {
        L.gcls = {g + R4 * hw, no * hw, hw, 1};
        L.gmap = {g, no * hw, hw, 1};
        L.k = k_t.const_data_ptr<T>();
      } else {
        L.gcls = {g, C * hw, hw, 1};
      }
      write_compact<T>(L, fr, compact);
      L.n = hw, L.a0 = level_a0[l];
      if (reg_max == 1)  // Python floats enter the reference's float32 arithmetic rounded to T; so here
        L.l1_stride = static_cast<T>(l1s[l]), L.l1_h = static_cast<T>(l1s[n_maps]),
        L.l1_w = static_cast<T>(l1s[n_maps + 1]);
      levels.push_back(L);
    }
    LossTargets<T> tg = targets_of<T>(in.anc, in.tb, in.ts, in.fg, static_cast<int>(reg_max));
    if (in.lab.defined()) tg.lab = in.lab.const_data_ptr<int64_t>(), tg.C = C;
    return run_blocks<T>(levels, tg, blocks, fr.row0);
  };
  const auto sums = in.f64 ? go(double(0)) : go(float(0));
  TORCH_INTERNAL_ASSERT(!final_grads || sums[3] == S_pre || (std::isnan(sums[3]) && std::isnan(S_pre)),
                        "bbox_loss_maps: the target sum differs between the pre-pass and the pass");
  auto [losses, inv_s] = losses_and_inv_s(sums, in.f64, opt);
  return {losses, gcls, fr.rows, fr.index, inv_s};
}

// backward of yolofast::bbox_loss_maps: each map's gradient (B, 4R + C, H, W) written once, in one pass
// per channel row: class channels gcls*c[1]; box channels c[0]*0 + c[2]*0 (NaN when an incoming grad is
// not finite, as the dense product would give) except at the foreground anchors, which get
// box*c[0] + dfl*c[2] from their compact rows. Replaces a per-channel-scale multiply, a cat and an
// addcmul over the whole maps (b16/320, AVX2: 5.1 ms) by one write of each map.
template <typename T>
void scale_maps(const std::vector<at::Tensor>& gcls, const T* rows, const int64_t* index, int64_t nfg,
                const T* c, int64_t R4, std::vector<at::Tensor>& out) {
  const int64_t L = static_cast<int64_t>(gcls.size()), B = gcls[0].size(0), C = gcls[0].size(1);
  const int64_t no = R4 + C;
  std::vector<int64_t> a0(L + 1, 0);
  for (int64_t l = 0; l < L; ++l) a0[l + 1] = a0[l] + gcls[l].size(2) * gcls[l].size(3);
  const int64_t A = a0[L];
  const T c0 = c[0], c1 = c[1], c2 = c[2];
  const T bg = c0 * T(0) + c2 * T(0);
  // Units: one output channel row (l, b, ch), each written by one thread: no two threads share a line
  // except at row ends, and the result is the same on any number of threads.
  const int64_t units = L * B * no;
  at::parallel_for(0, units, 16, [&](int64_t u0, int64_t u1) {
    note_thread();
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t l = u / (B * no), b = (u / no) % B, ch = u % no;
      const int64_t hw = a0[l + 1] - a0[l];
      T* o = out[l].mutable_data_ptr<T>() + (b * no + ch) * hw;
      if (ch >= R4) {
        write_streamed<T>(o, hw, gcls[l].const_data_ptr<T>() + (b * C + ch - R4) * hw, c1);
        continue;
      }
      write_streamed<T>(o, hw, nullptr, bg);
      // This image and level's foreground rows: a contiguous run of the ascending index.
      const int64_t lo = b * A + a0[l], hi = lo + hw;
      const int64_t k0 = std::lower_bound(index, index + nfg, lo) - index;
      const int64_t k1 = std::lower_bound(index + k0, index + nfg, hi) - index;
      for (int64_t k = k0; k < k1; ++k) {
        const T* r = rows + k * 2 * R4;
        o[index[k] - lo] = r[ch] * c0 + r[R4 + ch] * c2;
      }
    }
    stream_fence();
  });
}

std::vector<at::Tensor> bbox_loss_maps_scale_cpu(at::TensorList grad_cls, const at::Tensor& fg_rows,
                                                 const at::Tensor& fg_index, const at::Tensor& c, int64_t reg_max) {
  TORCH_CHECK(!grad_cls.empty() && fg_rows.dim() == 3 && fg_rows.size(1) == 2 && fg_rows.size(2) == 4 * reg_max &&
                  fg_index.dim() == 1 && fg_index.size(0) == fg_rows.size(0) && c.numel() == 3,
              "yolofast::_bbox_loss_maps_scale: expects bbox_loss_maps' class gradients [(B, C, H, W)], "
              "foreground rows (N, 2, 4*reg_max), their index (N,) and c (3,); got ", fg_rows.sizes(), ", ",
              fg_index.sizes(), ", ", c.sizes());
  const auto dt = fg_rows.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kDouble, "yolofast::_bbox_loss_maps_scale: the gradients must be "
              "float32 or float64 (bbox_loss_maps' compute dtype)");
  const int64_t B = grad_cls[0].size(0), C = grad_cls[0].size(1), R4 = 4 * reg_max;
  std::vector<at::Tensor> gc, out;
  for (const auto& g : grad_cls) {
    TORCH_CHECK(g.dim() == 4 && g.size(0) == B && g.size(1) == C && g.scalar_type() == dt,
                "yolofast::_bbox_loss_maps_scale: every class gradient must be (B, C, H, W) = (", B, ", ", C,
                ", H, W) of ", dt, ", got ", g.sizes(), " ", g.scalar_type());
    gc.push_back(g.contiguous());
    out.push_back(at::empty({B, R4 + C, g.size(2), g.size(3)}, g.options()));
    poison({&out.back()});
  }
  const at::Tensor rows = fg_rows.contiguous(), index = fg_index.to(at::kLong).contiguous(), cc = c.to(dt).contiguous();
  if (dt == at::kDouble)
    scale_maps<double>(gc, rows.const_data_ptr<double>(), index.const_data_ptr<int64_t>(), rows.size(0),
                       cc.const_data_ptr<double>(), R4, out);
  else
    scale_maps<float>(gc, rows.const_data_ptr<float>(), index.const_data_ptr<int64_t>(), rows.size(0),
                      cc.const_data_ptr<float>(), R4, out);
  return out;
}

// backward of yolofast::bbox_loss.rows in one pass: grad_pred_dist is c[0]*0 + c[2]*0 (NaN when an incoming
// grad is not finite, as the dense product gives) except at the foreground rows, box*c[0] + DFL*c[2];
// grad_pred_scores = gcls*c[1]. Chunks of anchors; each finds its run of the ascending index.
template <typename T>
void scale_rows(const at::Tensor& gcls, const T* rows, const int64_t* index, int64_t nfg, const T* c,
                int64_t R4, at::Tensor& gdist, at::Tensor& gscores) {
  using V = Vec<T>;
  constexpr int64_t W = V::size();
  const int64_t n_rows = gcls.size(0) * gcls.size(1), C = gcls.size(2);
  const T c0 = c[0], c1 = c[1], c2 = c[2];
  const T bg = c0 * T(0) + c2 * T(0);
  const T* pc = gcls.const_data_ptr<T>();
  T* od = gdist.mutable_data_ptr<T>();
  T* os = gscores.mutable_data_ptr<T>();
  const V v0(c0), v2(c2);
  // ~150 floats an anchor: 2048 anchors (~1.2 MB written) a chunk.
  at::parallel_for(0, n_rows, 2048, [&](int64_t r0, int64_t r1) {
    note_thread();
    T* o = od + r0 * R4;
    write_streamed<T>(o, (r1 - r0) * R4, nullptr, bg);
    const int64_t k0 = std::lower_bound(index, index + nfg, r0) - index;
    const int64_t k1 = std::lower_bound(index + k0, index + nfg, r1) - index;
    for (int64_t k = k0; k < k1; ++k) {
      const T* b = rows + k * 2 * R4;
      const T* d = b + R4;
      T* y = od + index[k] * R4;
      int64_t i = 0;
      for (; i + W <= R4; i += W) (V::loadu(b + i) * v0 + V::loadu(d + i) * v2).store(y + i);
      for (; i < R4; ++i) y[i] = b[i] * c0 + d[i] * c2;
    }
    write_streamed<T>(os + r0 * C, (r1 - r0) * C, pc + r0 * C, c1);
    stream_fence();
  });
}

std::tuple<at::Tensor, at::Tensor> bbox_loss_rows_scale_cpu(const at::Tensor& grad_scores, const at::Tensor& fg_rows,
                                                            const at::Tensor& fg_index, const at::Tensor& c) {
  TORCH_CHECK(grad_scores.dim() == 3 && fg_rows.dim() == 3 && fg_rows.size(1) == 2 && fg_index.dim() == 1 &&
                  fg_index.size(0) == fg_rows.size(0) && c.numel() == 3,
              "yolofast::_bbox_loss_rows_scale: expects bbox_loss.rows' class gradient (B, A, C), foreground "
              "rows (N, 2, 4R), their index (N,) and c (3,); got ", grad_scores.sizes(), ", ", fg_rows.sizes(),
              ", ", fg_index.sizes(), ", ", c.sizes());
  const auto dt = grad_scores.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kDouble) && fg_rows.scalar_type() == dt,
              "yolofast::_bbox_loss_rows_scale: the gradients must be all float32 or all float64 (bbox_loss's "
              "compute dtype)");
  const int64_t B = grad_scores.size(0), A = grad_scores.size(1), R4 = fg_rows.size(2);
  const at::Tensor gc = grad_scores.contiguous(), rows = fg_rows.contiguous();
  const at::Tensor index = fg_index.to(at::kLong).contiguous(), cc = c.to(dt).contiguous();
  at::Tensor gdist = at::empty({B, A, R4}, gc.options()), gscores = at::empty_like(gc);
  if (dt == at::kDouble)
    scale_rows<double>(gc, rows.const_data_ptr<double>(), index.const_data_ptr<int64_t>(), rows.size(0),
                       cc.const_data_ptr<double>(), R4, gdist, gscores);
  else
    scale_rows<float>(gc, rows.const_data_ptr<float>(), index.const_data_ptr<int64_t>(), rows.size(0),
                      cc.const_data_ptr<float>(), R4, gdist, gscores);
  return {gdist, gscores};
}

// Debug: the SIMD register width (bits) the loss-path kernels were built for, 0 for at::vec's generic
// scalar fallback; the tests check it matches the CPU flags the build targeted.
int64_t bbox_vec_bits_cpu(const at::Tensor&) { return vec_isa(); }

}  // namespace

TORCH_LIBRARY_IMPL(yolofast, CPU, m) {
  m.impl("bbox_loss", &bbox_loss_cpu);
  m.impl("bbox_loss.rows", &bbox_loss_rows_cpu);
  m.impl("_bbox_loss_rows_scale", &bbox_loss_rows_scale_cpu);
  m.impl("bbox_loss_maps", &bbox_loss_maps_cpu);
  m.impl("_bbox_loss_maps_scale", &bbox_loss_maps_scale_cpu);
  m.impl("_bbox_vec_bits", &bbox_vec_bits_cpu);
}

}  // namespace yolofast
