// Muon's Newton–Schulz orthogonalisation over a whole list of matrices (YOLO11_YOLO26.md §5.3-5.4), as
// ATen calls: shared by the CPU op (csrc/cpu/ns_orthogonalize_kernel.cpp) and usable by any backend whose
// batched matmul is ATen's (cuBLAS on CUDA). Spec: yolofast/ops/reference.py ns_orthogonalize_ref.
//
// Why grouped by exact shape: a YOLO model's 88-136 Muon matrices have only 37-41 distinct shapes, so each
// shape is ONE batched call per matmul instead of one call per matrix (yolo26n: 41 x 15 calls a step
// instead of 126 x 15), and no FLOP is spent on padding (Ultralytics pads rows to batch unequal shapes:
// 22.1 instead of 9.5 GFLOP a step for yolo26n, 176 instead of 75 for yolo26s). Every matrix of a group
// has its own (unpadded) orientation, which is what makes the result equal to the reference bit for bit:
// the batched bmm/baddbmm compute each matrix of a batch exactly as they compute it alone.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

namespace yolofast_ns {

constexpr double kA = 3.4445, kB = -4.7750, kC = 2.0315;  // reference.NS_COEFFS

// The input indices of each distinct (rows, cols, dtype) in order of first appearance. rows = size(0),
// cols = the product of the other dims (a conv weight (out, in, kh, kw) -> out x in*kh*kw).
inline std::vector<std::vector<int64_t>> shape_groups(at::TensorList mats) {
  std::map<std::tuple<int64_t, int64_t, int>, size_t> where;
  std::vector<std::vector<int64_t>> groups;
  for (size_t i = 0; i < mats.size(); ++i) {
    const at::Tensor& u = mats[i];
    TORCH_CHECK(u.dim() >= 2, "ns_orthogonalize: tensor ", i, " has shape ", u.sizes(),
                "; Muon orthogonalises matrices and conv weights (ndim >= 2): give the others to SGD");
    TORCH_CHECK(u.is_floating_point(), "ns_orthogonalize: tensor ", i, " is ", u.scalar_type(),
                "; expected a floating-point gradient/momentum");
    TORCH_CHECK(u.device() == mats[0].device(), "ns_orthogonalize: tensor ", i, " is on ", u.device(),
                " but tensor 0 on ", mats[0].device(), "; orthogonalise one device's tensors per call");
    const int64_t r = u.size(0), c = u.numel() / std::max<int64_t>(r, 1);
    const auto key = std::make_tuple(r, c, static_cast<int>(u.scalar_type()));
    auto it = where.find(key);
    if (it == where.end()) {
      where.emplace(key, groups.size());
      groups.push_back({static_cast<int64_t>(i)});
    } else {
      groups[it->second].push_back(static_cast<int64_t>(i));
    }
  }
  return groups;
}

// NS5 of a (G, r, c) batch in its dtype, in place of x's values; returns the result (a view or new tensor).
inline at::Tensor newton_schulz(at::Tensor x, int64_t steps, double eps) {
  const int64_t r = x.size(1), c = x.size(2);
  x = x.div_(at::linalg_vector_norm(x, 2, at::IntArrayRef{-2, -1}, true).add_(eps));
  if (r > c) x = x.transpose(-2, -1);  // X Xᵀ is then the smaller Gram matrix (c x c)
  for (int64_t s = 0; s < steps; ++s) {
    const at::Tensor gram = at::bmm(x, x.transpose(-2, -1));
    const at::Tensor poly = at::baddbmm(gram, gram, gram, kB, kC);
    x = at::baddbmm(x, poly, x, kA, 1.0);
  }
  return r > c ? x.transpose(-2, -1) : x;
}

// NS5(mat(u)) for every u, in u's dtype and shape (contiguous); computed in bf16 (fp32: float32).
inline std::vector<at::Tensor> orthogonalize_all(at::TensorList mats, int64_t steps, double eps, bool fp32) {
  std::vector<at::Tensor> out(mats.size());
  const auto cdt = fp32 ? at::kFloat : at::kBFloat16;
  for (const auto& idx : shape_groups(mats)) {
    const at::Tensor& first = mats[idx[0]];
    const int64_t g = static_cast<int64_t>(idx.size()), r = first.size(0), c = first.numel() / std::max<int64_t>(r, 1);
    at::Tensor x = at::empty({g, r, c}, first.options().dtype(cdt));
    // One copy per matrix gathers it into the batch in logical (NCHW) order, whatever its strides
    // (channels_last, a transposed view), and casts it to the compute dtype.
    for (int64_t j = 0; j < g; ++j) x.select(0, j).view(mats[idx[j]].sizes()).copy_(mats[idx[j]]);
    if (r * c == 0) {
      for (int64_t j = 0; j < g; ++j) out[idx[j]] = at::empty_like(mats[idx[j]], at::MemoryFormat::Contiguous);
      continue;
    }
    const at::Tensor y = newton_schulz(x, steps, eps);
    for (int64_t j = 0; j < g; ++j) {
      const at::Tensor& u = mats[idx[j]];
      at::Tensor o = at::empty(u.sizes(), u.options().memory_format(at::MemoryFormat::Contiguous));
      o.view({r, c}).copy_(y.select(0, j));
      out[idx[j]] = std::move(o);
    }
  }
  return out;
}

}  // namespace yolofast_ns
