// The interface between the CUDA kernels (*.cu, compiled by nvcc WITHOUT torch headers) and their
// at::Tensor bindings (cuda_ops.cpp, compiled by the host compiler with torch headers).
//
// Why the split: nvcc spends most of its time on torch's headers; plain kernels + launchers taking raw
// pointers, sizes and a stream build ~3x faster here. Every launcher enqueues its kernels on `stream`,
// checks cudaGetLastError() after each launch and returns the first error (cudaSuccess = 0 when all went
// well); the binding turns a non-zero code into a TORCH_CHECK naming the op. Sizes and offsets are int64.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace yolofast {
namespace cuda {

// ------------------------------------------------------------------------------------------ tal_assign
// The sparse task-aligned assigner (DESIGN §2.1, spec reference.tal_assign_ref); see tal_assign_kernel.cu.
constexpr int kTalMaxTopk = 1024;  // the per-GT top-k buffer lives in shared memory (<= 44 KB at fp64)

struct TalShape {
  int64_t B, A, C, M, k;  // k = min(topk, A) >= 0
  int64_t k2;             // the second top-k (YOLO26's topk2), 0 = off
  double alpha, beta, eps;
};

// Inputs, all contiguous on one device, in the compute type T (float or double; the binding converts):
// scores (B,A,C), pbox (B,A,4), anc (A,2), gt (B,M,4); labels (B,M) int64 (as gt_labels.long()); real
// (B,M) bool (mask_gt > 0). Outputs: labels (B,A) int64, boxes (B,A,4) T, scores (B,A,C) T, fg (B,A) bool,
// gt_idx (B,A) int64. `workspace` holds tal_assign_workspace_bytes(...) bytes (contents need not be zero).
struct TalArgs {
  const void* scores;
  const void* pbox;
  const void* anc;
  const int64_t* labels;
  const void* gt;
  const bool* real;
  int64_t* out_labels;
  void* out_boxes;
  void* out_scores;
  bool* out_fg;
  int64_t* out_gt_idx;
  void* workspace;
};

size_t tal_assign_workspace_bytes(const TalShape& s, bool f64);
cudaError_t tal_assign_launch(const TalShape& s, const TalArgs& a, bool f64, cudaStream_t stream);

// ------------------------------------------------------------------------------------------- bbox_loss
// Fused CIoU + DFL + BCE with the logits' gradients (DESIGN §2.2, spec reference.bbox_loss_ref); see
// bbox_loss_kernel.cu. All tensors contiguous, in the compute type T (float or double):
// pd (B,A,4R), ps (B,A,C), anc (A,2), tb (B,A,4), ts (B,A,C), fg (B,A) bool. Outputs: losses (3,) T,
// gd_box/gd_dfl (B,A,4R) T (gradients of S*L_box and S*L_dfl), gs (B,A,C) T (of S*L_cls), inv_s () T.
constexpr int kBboxMaxRegMax = 64;

struct BboxShape {
  int64_t B, A, C, R;
};

struct BboxArgs {
  const void* pd;
  const void* ps;
  const void* anc;
  const void* tb;
  const void* ts;
  const bool* fg;
  void* losses;
  void* gd_box;
  void* gd_dfl;
  void* gs;
  void* inv_s;
  void* workspace;  // bbox_loss_workspace_bytes(...) bytes: the per-block partial sums
};

size_t bbox_loss_workspace_bytes(const BboxShape& s);
cudaError_t bbox_loss_launch(const BboxShape& s, const BboxArgs& a, bool f64, cudaStream_t stream);

// reg_max 1 (YOLO26, R = 1): pd (B,A,4) raw distances; the third loss and gd_dfl are the L1 term's
// (YOLO11_YOLO26.md §4.2). stride: (A,) T, each anchor's stride; img_h, img_w: the batch image's size.
struct BboxL1 {
  const void* stride;
  double img_h, img_w;
};
cudaError_t bbox_loss_l1_launch(const BboxShape& s, const BboxArgs& a, const BboxL1& l1, bool f64,
                                cudaStream_t stream);

// bbox_loss_maps for reg_max 1 (YOLO26): the Detect head's maps read in place (anchor a of level l is pixel
// a - a0_l of map l, levels in order). Maps (B, 4 + C, H_l, W_l) in T with image stride sb, channel stride
// sc and pixel stride 1; anc (A,2), tb (B,A,4) T; ts (B,A,C) T, or (B,A) T with lab (B,A) int64 (each
// anchor's one target of class lab clamped to [0, C - 1]); fg (B,A) bool; stride: each map's stride,
// img_h x img_w the batch image. Outputs: losses (3,) [L_box, L_cls, L_l1], gcls[l] (B, C, H_l, W_l)
// contiguous (gradient of S*L_cls), rows (B*A, 2, 4) (gradients of S*L_box and S*L_l1 w.r.t. the 4 raw
// distances, zero off the foreground), inv_s ().
constexpr int kMapsMaxLevels = 8;

struct BboxMapsShape {
  int64_t B, A, C;
  int L;  // maps, 1..kMapsMaxLevels
};

struct BboxMapsArgs {
  const void* map[kMapsMaxLevels];
  void* gcls[kMapsMaxLevels];
  int64_t sb[kMapsMaxLevels], sc[kMapsMaxLevels], hw[kMapsMaxLevels];
  double stride[kMapsMaxLevels];
  double img_h, img_w;
  const void* anc;
  const void* tb;
  const void* ts;
  const int64_t* lab;  // nullptr: ts is (B, A, C)
  const bool* fg;
  void* losses;
  void* rows;
  void* inv_s;
  void* workspace;  // bbox_loss_maps_workspace_bytes(...) bytes
};

size_t bbox_loss_maps_workspace_bytes(const BboxMapsShape& s);
cudaError_t bbox_loss_maps_l1_launch(const BboxMapsShape& s, const BboxMapsArgs& a, bool f64, cudaStream_t stream);

// _bbox_loss_maps_scale (bbox_loss_maps' backward), any reg_max: out[l] (B, R4 + C, H_l, W_l) contiguous =
// gcls[l] (B, C, H_l, W_l) * c[1] in the class channels; in the box channels rows[k, 0] * c[0] +
// rows[k, 1] * c[2] at the anchor index[k] of each of the nfg rows (B*A, 2, R4) and c[0]*0 + c[2]*0
// elsewhere. rows with nfg == B*A are the static layout (row b*A + a) and index is not read. c: (3,) T on
// the device.
struct BboxMapsScale {
  int64_t B, A, C, R4, nfg;
  int L;
  const void* gcls[kMapsMaxLevels];
  void* out[kMapsMaxLevels];
  int64_t hw[kMapsMaxLevels];
  const void* rows;
  const int64_t* index;
  const void* c;
};

cudaError_t bbox_loss_maps_scale_launch(const BboxMapsScale& s, bool f64, cudaStream_t stream);

// ------------------------------------------------------------------------------------------ ema_update
// In place ema = lerp(ema, model, w), w = 1 - decay (DESIGN §2.3, spec reference.ema_update_ref).
enum class EmaType : int { kFloat = 0, kDouble = 1, kHalf = 2, kBFloat16 = 3 };

// Where w comes from. A device pointer keeps the update free of host syncs (CUDA-graph capturable).
enum class EmaWeight : int {
  kHost = 0,        // w_host, already 1 - d in the decay's precision
  kDecayF32 = 1,    // float d at ptr: w = 1.0f - d
  kDecayF64 = 2,    // double d at ptr: w = 1.0 - d
  kWeightF64 = 3,   // double w at ptr (w formed by torch in a low-precision decay's dtype)
};

struct EmaArgs {
  void* ema;
  const void* model;
  int64_t n;
  EmaType ema_type;
  EmaType model_type;  // == ema_type, or the compute type (float for half/bf16 ema)
  EmaWeight weight_kind;
  const void* weight_ptr;
  double w_host;
};

cudaError_t ema_update_launch(const EmaArgs& a, cudaStream_t stream);

}  // namespace cuda
}  // namespace yolofast
