// yolofast::ns_orthogonalize on CUDA (ns_orthogonalize_cuda.cpp): declared here for the registration in
// cuda_ops.cpp. ATen only (cuBLAS batched GEMMs): no kernel of its own, hence not in cuda_launchers.h.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace yolofast {
namespace cuda {

std::vector<at::Tensor> ns_orthogonalize_cuda(at::TensorList mats, int64_t steps, double eps, bool fp32);

}  // namespace cuda
}  // namespace yolofast
