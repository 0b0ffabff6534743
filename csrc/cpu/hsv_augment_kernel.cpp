// yolofast::hsv_augment(Tensor img, Tensor lut, bool rgb, int step) -> Tensor, CPU (hsv_augment_: in place):
// the training HSV augmentation of one BGR uint8 image (..., 3) in one pass (the work and its arithmetic:
// hsv_augment_core.h; the reference: yolofast/data/augment.py augment_hsv's OpenCV path, cvtColor BGR->HSV,
// a 3-channel LUT, cvtColor HSV->RGB/BGR). lut (256, 3) uint8: the hue (< 180), saturation and value
// tables. Returns a new image of img's shape (hsv_augment_: img itself), RGB when rgb else BGR, the same bytes
// as the OpenCV path; step: OpenCV's pixels per vector step on this CPU (64 AVX-512, 32 AVX2, 16 SSE), which
// decides the pixels it converts in scalar code.
//
// Rows of pixels are split across torch's threads in chunks of >= 64 K pixels (a loader worker has one
// thread: the whole image is one chunk). 640x640: ~0.5 ms on one AMD EPYC Zen 4 core against ~1.7 ms for
// the three OpenCV passes.
#include "hsv_augment_core.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>

namespace yolofast {
namespace {

constexpr int64_t kHsvGrain = 1 << 16;  // pixels per parallel chunk: ~30 us of work, >> a task's overhead

// The checks, the tables, then the runs from src to dst (dst == src: in place, safe because every block of
// pixels is read into planar temporaries before its bytes are written, hsv_augment_core.h).
void hsv_augment_into(const at::Tensor& img, const at::Tensor& src, const at::Tensor& lut, bool rgb,
                      int64_t step, uint8_t* dp) {
  const at::Tensor tab = lut.contiguous();
  const uint8_t* lp = tab.data_ptr<uint8_t>();
  for (int i = 0; i < 256; ++i)  // OpenCV's 8-bit hue is in [0, 180): a larger one has no sector
    TORCH_CHECK(lp[3 * i] < 180, "hsv_augment: hue table entry ", i, " is ", int(lp[3 * i]), " (must be < 180)");
  yolofast_hsv::Tables t;
  yolofast_hsv::make_tables(t, lp);
  const uint8_t* sp = src.data_ptr<uint8_t>();
  // OpenCV converts row by row, `step` pixels per vector step (64 with its AVX-512 code): the last w % step
  // pixels of each row go through its scalar code, which rounds (hsv_augment_core.h). Rows of a multiple of
  // step (640, 320 px): one flat run.
  const int64_t n = src.numel() / 3, w = img.dim() >= 2 ? img.size(-2) : n, body = w - w % step;
  if (body == w || n == 0) {
    at::parallel_for(0, n, kHsvGrain, [&](int64_t p0, int64_t p1) {
      yolofast_hsv::hsv_augment_run(sp + 3 * p0, dp + 3 * p0, p1 - p0, t, rgb);
    });
  } else {
    at::parallel_for(0, n / w, std::max<int64_t>(1, kHsvGrain / w), [&](int64_t r0, int64_t r1) {
      for (int64_t row = r0; row < r1; ++row) {
        const int64_t p = row * w;
        yolofast_hsv::hsv_augment_run(sp + 3 * p, dp + 3 * p, body, t, rgb);
        yolofast_hsv::hsv_augment_run(sp + 3 * (p + body), dp + 3 * (p + body), w - body, t, rgb, true);
      }
    });
  }
}

void check_args(const at::Tensor& img, const at::Tensor& lut, int64_t step) {
  TORCH_CHECK(step >= 1, "hsv_augment: step (OpenCV's pixels per vector step) must be >= 1, got ", step);
  TORCH_CHECK(img.device().is_cpu() && lut.device().is_cpu(), "hsv_augment: CPU tensors expected");
  TORCH_CHECK(img.scalar_type() == at::kByte && img.dim() >= 1 && img.size(-1) == 3,
              "hsv_augment: img must be uint8 (..., 3) BGR, got ", img.scalar_type(), " ", img.sizes());
  TORCH_CHECK(lut.scalar_type() == at::kByte && lut.dim() == 2 && lut.size(0) == 256 && lut.size(1) == 3,
              "hsv_augment: lut must be uint8 (256, 3), got ", lut.scalar_type(), " ", lut.sizes());
}

at::Tensor hsv_augment_cpu(const at::Tensor& img, const at::Tensor& lut, bool rgb, int64_t step) {
  check_args(img, lut, step);
  const at::Tensor src = img.contiguous();
  at::Tensor out = at::empty_like(src);
  hsv_augment_into(img, src, lut, rgb, step, out.data_ptr<uint8_t>());
  return out;
}

// In place: a loader's freshly warped mosaic is its own scratch. Writing the result over it saves a new
// 1.2 MB image per 640 px sample, which the worker must fault in or pull into cache before writing.
at::Tensor& hsv_augment_cpu_(at::Tensor& img, const at::Tensor& lut, bool rgb, int64_t step) {
  check_args(img, lut, step);
  TORCH_CHECK(img.is_contiguous(), "hsv_augment_: img must be contiguous to be written in place");
  hsv_augment_into(img, img, lut, rgb, step, img.data_ptr<uint8_t>());
  return img;
}

}  // namespace

// Registered only for x86-64 builds with AVX2 + FMA (x86-64-v3, native on a recent CPU), the builds tested
// byte for byte against OpenCV here and faster than it (AVX-512: 0.55 ms, AVX2: 1.1 ms, OpenCV 1.6 ms at
// 640x640): a generic x86-64 build has no FMA instruction (std::fma in software: 10 ms), and on aarch64
// OpenCV's NEON arithmetic is untested. Without the kernel the loader runs the OpenCV path.
#if defined(__x86_64__) && defined(__AVX2__) && defined(__FMA__)
TORCH_LIBRARY_IMPL(yolofast, CPU, m) {
  m.impl("hsv_augment", &hsv_augment_cpu);
  m.impl("hsv_augment_", &hsv_augment_cpu_);
}
#endif

}  // namespace yolofast
