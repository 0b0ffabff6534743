// The assigner's view of the Detect head, read from the maps in place (DESIGN §2.1 inputs, §2.2 decode), CPU:
//
// yolofast::head_decode(feats [(B, 4R+C, H_i, W_i)], strides [s_i], reg_max)
//   -> (pd_scores (B, A, C) = sigmoid(class logits), pd_bboxes (B, A, 4) xyxy pixels)
// with A = sum H_i*W_i (level by level, pixel h*W_i + w), the anchor of pixel (h, w) at ((w + 0.5)*s,
// (h + 0.5)*s) and the box (ax - l, ay - t, ax + r, ay + b)*s from the DFL expectation of each side
// (softmax over the R bins, bin values 0..R-1), as reference.bbox_decode(...) * stride. No gradient.
// reg_max 1 (YOLO26): the four channels are the distances, box = (gx - l, gy - t, gx + r, gy + b) * s with
// the anchor (gx, gy) in grid units, the composed form's operations (at b16/320 ~1.2 ms -> ~0.3 ms a head).
// yolofast::head_decode.boxes(feats, strides, reg_max) -> pd_bboxes alone (the loss's assigner reads the
// class logits from the maps itself: tal_assign.maps).
// This replaces cat + transpose of the maps, a softmax, a matmul and a sigmoid over (B, A, .) tensors by
// one pass over the maps; vectorised along the pixels (contiguous in a map), one pixel per lane.

// First: it sets at::vec's CPU_CAPABILITY macros, which must precede any ATen header that pulls in vec.h.
#include "bbox_loss_core.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <tuple>
#include <vector>

#include "cpu_common.h"
#include "op_checks.h"

namespace yolofast {
namespace {

// 64 pixels per block: the (C x 64) sigmoid tile that is transposed into (64, C) rows is 20 KB at C = 80
// (fits L1); 136 blocks per 640 px image.
constexpr int64_t kDecodeBlock = 64;

template <typename T>
void decode_block(const T* map, int64_t sb, int64_t sc, int64_t Wd, int64_t i0, int64_t i1, int R, int64_t C,
                  T stride, T* scores_out, T* boxes_out) {
  using V = Vec<T>;
  constexpr int W = V::size();
  // Each channel row is streamed across the whole block before the next one (max, then exp sums, then
  // the sigmoid rows): one read stream at a time. Walking all 4R + C = 144 rows per vector instead was
  // ~5x slower than a plain sigmoid: more concurrent streams than the hardware prefetchers follow.
  alignas(64) T mx[kDecodeBlock], sum[kDecodeBlock], ex[kDecodeBlock], ltrb[4][kDecodeBlock];
  const int64_t n = i1 - i0;
  const T* base = map + sb + i0;
  auto rows = [&](auto&& body) {  // body(i, cnt) over the block's vectors
    for (int64_t i = 0; i < n; i += W) body(i, static_cast<int>(std::min<int64_t>(W, n - i)));
  };
  for (int k = 0; k < 4 && R == 1; ++k)  // reg_max 1: the channels are the distances themselves
    std::copy(base + k * sc, base + k * sc + n, ltrb[k]);
  for (int k = 0; k < 4 && R > 1; ++k) {
    const T* zk = base + k * R * sc;
    rows([&](int64_t i, int cnt) { V::loadu(zk + i, cnt).store(mx + i, cnt); });
    for (int j = 1; j < R; ++j)
      rows([&](int64_t i, int cnt) {
        at::vec::maximum(V::loadu(mx + i, cnt), V::loadu(zk + j * sc + i, cnt)).store(mx + i, cnt);
      });
    rows([&](int64_t i, int cnt) {
      V(T(0)).store(sum + i, cnt);
      V(T(0)).store(ex + i, cnt);
    });
    for (int j = 0; j < R; ++j)
      rows([&](int64_t i, int cnt) {
        const V e = exp_nonpositive<T>(V::loadu(zk + j * sc + i, cnt) - V::loadu(mx + i, cnt));
        (V::loadu(sum + i, cnt) + e).store(sum + i, cnt);
        at::vec::fmadd(e, V(T(j)), V::loadu(ex + i, cnt)).store(ex + i, cnt);
      });
    rows([&](int64_t i, int cnt) { (V::loadu(ex + i, cnt) / V::loadu(sum + i, cnt)).store(ltrb[k] + i, cnt); });
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = i0 + i;
    const T gx = T(p % Wd) + T(0.5), gy = T(p / Wd) + T(0.5);  // the anchor in grid units
    T* bo = boxes_out + i * 4;
    if (R == 1) {  // the composed form's order: the box in grid units, then x stride (bit for bit)
      bo[0] = (gx - ltrb[0][i]) * stride;
      bo[1] = (gy - ltrb[1][i]) * stride;
      bo[2] = (gx + ltrb[2][i]) * stride;
      bo[3] = (gy + ltrb[3][i]) * stride;
      continue;
    }
    const T ax = gx * stride, ay = gy * stride;
    bo[0] = ax - ltrb[0][i] * stride;
    bo[1] = ay - ltrb[1][i] * stride;
    bo[2] = ax + ltrb[2][i] * stride;
    bo[3] = ay + ltrb[3][i] * stride;
  }
  if (scores_out == nullptr) return;  // head_decode.boxes
  std::vector<T> tile(static_cast<size_t>(C * kDecodeBlock));
  const V one(T(1));
  for (int64_t c = 0; c < C; ++c) {
    const T* x = base + (4 * R + c) * sc;
    T* tc = tile.data() + c * kDecodeBlock;
    rows([&](int64_t i, int cnt) { (one / (one + V::loadu(x + i, cnt).neg().exp_u20())).store(tc + i, cnt); });
  }
  for (int64_t i = 0; i < n; ++i) {
    T* so = scores_out + i * C;
    for (int64_t c = 0; c < C; ++c) so[c] = tile[c * kDecodeBlock + i];
  }
}

// Both entry points: scores (B, A, C) when with_scores, else an undefined tensor.
std::tuple<at::Tensor, at::Tensor> decode(at::TensorList feats, at::ArrayRef<double> strides, int64_t reg_max,
                                          bool with_scores) {
  bool f64 = false;
  TORCH_CHECK(reg_max >= 1, "yolofast::head_decode: reg_max must be >= 1, got ", reg_max);
  const auto maps = yolofast_checks::head_maps(feats, reg_max, kMaxRegMax, "yolofast::head_decode", f64);
  TORCH_CHECK(strides.size() == maps.size(), "yolofast::head_decode: got ", maps.size(), " maps but ",
              strides.size(), " strides; pass one stride per map");
  const int64_t B = maps[0].size(0), C = maps[0].size(1) - 4 * reg_max;
  std::vector<int64_t> a0s;
  int64_t A = 0;
  for (const auto& m : maps) a0s.push_back(A), A += m.size(2) * m.size(3);
  const auto opt = maps[0].options();
  auto scores = with_scores ? at::empty({B, A, C}, opt) : at::Tensor();
  auto boxes = at::empty({B, A, 4}, opt);
  if (poison_outputs()) {
    if (with_scores) scores.fill_(std::numeric_limits<double>::quiet_NaN());
    boxes.fill_(std::numeric_limits<double>::quiet_NaN());
  }
  struct Blk {
    int64_t l, b, i0, i1;
  };
  std::vector<Blk> blocks;
  for (int64_t b = 0; b < B; ++b)
    for (size_t l = 0; l < maps.size(); ++l) {
      const int64_t hw = maps[l].size(2) * maps[l].size(3);
      for (int64_t i0 = 0; i0 < hw; i0 += kDecodeBlock)
        blocks.push_back({static_cast<int64_t>(l), b, i0, std::min(hw, i0 + kDecodeBlock)});
    }
  auto go = [&](auto zero) {
    using T = decltype(zero);
    T* sp = with_scores ? scores.mutable_data_ptr<T>() : nullptr;
    T* bp = boxes.mutable_data_ptr<T>();
    at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t k0, int64_t k1) {
      note_thread();
      for (int64_t k = k0; k < k1; ++k) {
        const auto& bl = blocks[k];
        const auto& m = maps[bl.l];
        const int64_t a = bl.b * A + a0s[bl.l] + bl.i0;
        decode_block<T>(m.const_data_ptr<T>(), bl.b * m.stride(0), m.stride(1), m.size(3), bl.i0, bl.i1,
                        static_cast<int>(reg_max), C, static_cast<T>(strides[bl.l]), sp ? sp + a * C : nullptr, bp + a * 4);
      }
    });
  };
  if (f64)
    go(double(0));
  else
    go(float(0));
  return {scores, boxes};
}

std::tuple<at::Tensor, at::Tensor> head_decode_cpu(at::TensorList feats, at::ArrayRef<double> strides,
                                                   int64_t reg_max) {
  return decode(feats, strides, reg_max, true);
}

// head_decode.boxes: the boxes alone, for the assigner's tal_assign.maps (which reads the logits itself).
at::Tensor head_decode_boxes_cpu(at::TensorList feats, at::ArrayRef<double> strides, int64_t reg_max) {
  return std::get<1>(decode(feats, strides, reg_max, false));
}

}  // namespace

TORCH_LIBRARY_IMPL(yolofast, CPU, m) {
  m.impl("head_decode", &head_decode_cpu);
  m.impl("head_decode.boxes", &head_decode_boxes_cpu);
}

}  // namespace yolofast
