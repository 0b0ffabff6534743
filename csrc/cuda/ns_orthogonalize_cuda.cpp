// yolofast::ns_orthogonalize(Tensor[] mats, int steps, float eps, bool fp32) -> Tensor[], CUDA: Muon's
// Newton–Schulz over a whole list of matrices (spec: yolofast/ops/reference.py ns_orthogonalize_ref).
//
// The same grouping and NS5 as the CPU op (csrc/common/ns_groups.h: one batch per distinct shape, no
// padding, each matrix in its own orientation), with the GEMMs on cuBLAS through at::bmm/at::baddbmm in
// the compute dtype (bf16 inputs, fp32 accumulation, one rounding per product). What differs is the data
// movement around them, which on a GPU is launches: the gather into the per-shape batches and the scatter
// back are ONE multi-tensor copy each over the whole list (at::_foreach_copy_, casting on the fly), not
// one copy kernel per matrix. yolo26n (126 matrices, 41 shapes), ATen kernel calls per op call counted with
// torch.profiler on this file's CPU emulation: 789 (2 multi-tensor copies, 8 transposed copies for the tall
// groups, 41 x 3 norm ops, 615 matmuls, 41 other copies, one per group in both ops) against 1031 with the
// CPU op's per-matrix gathers and scatters (252 copies).
//
// CUDA-graph capturable: shapes come from the tensors' metadata only, nothing is read back to the host, and
// every buffer comes from the caching allocator.
//
// Device-generic apart from the guard and the device check: the CPU emulation of the CUDA sources
// (tests/ops/cuda_emulation.py) runs this very file on CPU tensors, so its grouping, gathers, strides and
// scatters are tested without a GPU.
#include "ns_orthogonalize_cuda.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <vector>

#include "ns_groups.h"

namespace yolofast {
namespace cuda {
namespace {

// NS5(mat(u)) for every u, each returned fresh, contiguous, in u's shape and dtype.
std::vector<at::Tensor> orthogonalize_grouped(at::TensorList mats, int64_t steps, double eps, bool fp32) {
  const auto cdt = fp32 ? at::kFloat : at::kBFloat16;
  const auto groups = yolofast_ns::shape_groups(mats);
  std::vector<at::Tensor> out(mats.size()), batches(groups.size()), dst, src;
  dst.reserve(mats.size());
  src.reserve(mats.size());
  // Gather: batch k holds its group's matrices in logical (NCHW) order whatever their strides (a
  // channels_last or transposed input takes _foreach_copy_'s per-tensor path, same values).
  for (size_t k = 0; k < groups.size(); ++k) {
    const at::Tensor& first = mats[groups[k][0]];
    const int64_t g = static_cast<int64_t>(groups[k].size()), r = first.size(0);
    const int64_t c = first.numel() / std::max<int64_t>(r, 1);
    batches[k] = at::empty({g, r, c}, first.options().dtype(cdt));
    if (r * c == 0) continue;
    for (int64_t j = 0; j < g; ++j) {
      const at::Tensor& u = mats[groups[k][j]];
      dst.push_back(batches[k].select(0, j).view(u.sizes()));
      src.push_back(u);
    }
  }
  if (!dst.empty()) at::_foreach_copy_(dst, src);
  dst.clear();
  src.clear();
  for (size_t k = 0; k < groups.size(); ++k) {
    const auto& idx = groups[k];
    const int64_t r = batches[k].size(1), c = batches[k].size(2);
    for (const int64_t i : idx)
      out[i] = at::empty(mats[i].sizes(), mats[i].options().memory_format(at::MemoryFormat::Contiguous));
    if (r * c == 0) continue;
    // A tall group iterates on its transpose and comes back as a transposed view: one copy makes the
    // matrices contiguous so that the scatter below is a plain (fast-path) multi-tensor copy.
    at::Tensor y = yolofast_ns::newton_schulz(batches[k], steps, eps);
    if (!y.is_contiguous()) y = y.contiguous();
    for (size_t j = 0; j < idx.size(); ++j) {
      dst.push_back(out[idx[j]].view({r, c}));
      src.push_back(y.select(0, static_cast<int64_t>(j)));
    }
  }
  if (!dst.empty()) at::_foreach_copy_(dst, src);  // scatter, cast to each input's dtype
  return out;
}

}  // namespace

std::vector<at::Tensor> ns_orthogonalize_cuda(at::TensorList mats, int64_t steps, double eps, bool fp32) {
  TORCH_CHECK(steps >= 0, "ns_orthogonalize: steps must be >= 0, got ", steps);
  if (mats.empty()) return {};
  for (size_t i = 0; i < mats.size(); ++i) {
    const at::Tensor& u = mats[i];
    TORCH_CHECK(u.is_cuda(), "ns_orthogonalize (CUDA): tensor ", i, " is on ", u.device(),
                "; orthogonalise one device's tensors per call");
  }
  const c10::cuda::CUDAGuard guard(mats[0].device());
  return orthogonalize_grouped(mats, steps, eps, fp32);
}

}  // namespace cuda
}  // namespace yolofast
