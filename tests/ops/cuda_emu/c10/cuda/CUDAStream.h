// CPU emulation (see ../../cuda_runtime.h): the "current stream" is a null handle.
#pragma once
#include "cuda_runtime_api.h"

namespace c10::cuda {
struct CUDAStream {
  cudaStream_t stream() const { return nullptr; }
};
inline CUDAStream getCurrentCUDAStream() { return {}; }
}  // namespace c10::cuda
