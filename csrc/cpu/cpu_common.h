// Helpers shared by the CPU kernels of yolofast: explicit SIMD (ATen's Vectorized for the ISA the build
// targets) and a thread probe (for the test that the kernels really run on the threads torch has).
// Include this header before any other: see the SIMD note.
#pragma once

// SIMD: ATen's at::vec::Vectorized<T> (one source for AVX2, AVX-512 and NEON) picks its AVX2/AVX-512 code
// with the macros CPU_CAPABILITY_AVX2 / CPU_CAPABILITY_AVX512, which ATen's own build sets for each of its
// per-ISA kernel copies. An extension that does not set them gets the generic Vectorized (a plain array
// that the optimiser may or may not vectorise). They are set here from what -march (YOLOFAST_CPU_ARCH,
// yolofast/ops/_build.py) enables: x86-64-v3 -> AVX2 (8 floats), x86-64-v4 / native on an AVX-512 CPU ->
// AVX-512 (16 floats); on aarch64 vec128 uses NEON from __aarch64__ alone (4 floats). The namespace stays
// at::vec::CPU_CAPABILITY (the macro CPU_CAPABILITY is left undefined), which is none of libtorch's own
// (DEFAULT, AVX2, AVX512), so no inline function of this library binds to a libtorch copy or vice versa.
#if defined(VECTOR_WIDTH) && !defined(YOLOFAST_SIMD_SELECTED)
#error "include cpu_common.h before any ATen/cpu/vec header: it selects the ISA of at::vec::Vectorized"
#endif
#define YOLOFAST_SIMD_SELECTED 1
#if !defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#endif
#endif

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace yolofast {

// Bit i set when OpenMP thread i ran a chunk of some kernel's parallel_for. Read and cleared by the
// debug op yolofast::_threads_seen. Without -fopenmp, at::parallel_for (whose OpenMP loop is inlined
// from the header into this extension) silently runs everything on thread 0: this is how a test sees it.
inline std::atomic<uint64_t>& threads_seen_mask() {
  static std::atomic<uint64_t> mask{0};
  return mask;
}

// Floats per SIMD register in this build (16 AVX-512, 8 AVX2, 4 NEON): the debug op yolofast::_simd_lanes
// reports it so a test can check that a build for an ISA really uses that ISA's vectors.
constexpr int64_t simd_float_lanes() { return at::vec::Vectorized<float>::size(); }

// One relaxed atomic OR per parallel_for chunk: negligible next to a chunk's work (>= 1e4 elements).
inline void note_thread() {
  threads_seen_mask().fetch_or(uint64_t{1} << (at::get_thread_num() & 63), std::memory_order_relaxed);
}

// Runs fn(i, lo, hi) over `count` items of n_of(i) elements each, seen as one sequence cut into one
// contiguous range per thread (at least `grain` elements each): equal element counts per thread whatever
// the items' sizes (a model's tensors run from 16 to 10^6 elements). Each item's [lo, hi) is within it.
template <typename N, typename F>
void sweep_ranges(size_t count, const N& n_of, int64_t grain, const F& fn) {
  std::vector<int64_t> start(count + 1, 0);
  for (size_t i = 0; i < count; ++i) start[i + 1] = start[i] + n_of(i);
  const int64_t total = start.back();
  if (total == 0) return;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), total / grain));
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    note_thread();
    const int64_t lo = total * p0 / parts, hi = total * p1 / parts;
    size_t i = std::upper_bound(start.begin(), start.end(), lo) - start.begin() - 1;
    for (; i < count && start[i] < hi; ++i) {
      const int64_t a = std::max(lo, start[i]) - start[i], b = std::min(hi, start[i + 1]) - start[i];
      if (b > a) fn(i, a, b);
    }
  });
}

// YOLOFAST_POISON_OUTPUTS=1 makes kernels fill their fresh outputs with NaN before computing, so a test
// sees any element a kernel forgets to write (fresh pages from the OS are zero and would hide it). One
// getenv per call: ~100 ns next to a multi-millisecond kernel.
inline bool poison_outputs() {
  const char* v = std::getenv("YOLOFAST_POISON_OUTPUTS");
  return v != nullptr && v[0] != '\0' && v[0] != '0';
}

}  // namespace yolofast
