// yolofast::ns_orthogonalize(Tensor[] mats, int steps, float eps, bool fp32) -> Tensor[], CPU: Muon's
// Newton–Schulz over a whole list of matrices in one op (the work: csrc/common/ns_groups.h; the spec:
// yolofast/ops/reference.py ns_orthogonalize_ref).
//
// Why a C++ op when the work is ATen's batched matmuls: the loop over shape groups, the gathers and the
// 15 matmuls of a group cost ~20 Python-level dispatches each (yolo26n: 41 groups, ~800 a step, ~10 us
// each); here they are C++ calls, and a MuSGD step dispatches ~30 ops from Python in all. The matmuls run
// on ATen's CPU GEMM (oneDNN: AVX512-BF16/AMX where the CPU has them), threaded by torch's pool.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <vector>

#include "../common/ns_groups.h"

namespace yolofast {
namespace {

std::vector<at::Tensor> ns_orthogonalize_cpu(at::TensorList mats, int64_t steps, double eps, bool fp32) {
  TORCH_CHECK(steps >= 0, "ns_orthogonalize: steps must be >= 0, got ", steps);
  for (size_t i = 0; i < mats.size(); ++i)
    TORCH_CHECK(mats[i].device().is_cpu(), "ns_orthogonalize (CPU): tensor ", i, " is on ", mats[i].device());
  return yolofast_ns::orthogonalize_all(mats, steps, eps, fp32);
}

}  // namespace

TORCH_LIBRARY_IMPL(yolofast, CPU, m) { m.impl("ns_orthogonalize", &ns_orthogonalize_cpu); }

}  // namespace yolofast
