// The fiber scheduler behind cuda_runtime.h's CPU emulation of CUDA launches (see there).
#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_runtime.h"

dim3 threadIdx, blockIdx, blockDim, gridDim;

namespace yf_emu {
namespace {

enum State { kRunnable, kAtBlock, kAtWarp, kDone };

struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  State state = kRunnable;
  unsigned tid = 0;
};

constexpr size_t kStack = 64 * 1024;
constexpr size_t kMaxSmem = 48 * 1024;  // the default dynamic shared memory limit of a launch

ucontext_t g_main;
std::vector<Fiber> g_fibers;
size_t g_cur = 0;
std::function<void()>* g_body = nullptr;
std::vector<unsigned char> g_smem;
std::vector<uint64_t> g_warp_slots;
int g_count[2] = {0, 0};
std::vector<int> g_count_phase;  // per thread: which of g_count its next __syncthreads_count uses
cudaError_t g_last_error = cudaSuccess;

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "yolofast CUDA emulation: %s (block %u,%u; thread %u)\n", what, blockIdx.x, blockIdx.y,
               threadIdx.x);
  std::abort();
}

void fiber_entry() {
  (*g_body)();
  g_fibers[g_cur].state = kDone;
  swapcontext(&g_fibers[g_cur].ctx, &g_main);
}

void wait_as(State s) {
  g_fibers[g_cur].state = s;
  swapcontext(&g_fibers[g_cur].ctx, &g_main);
}

void run_block() {
  const size_t n = g_fibers.size();
  for (size_t i = 0; i < n; ++i) {
    Fiber& f = g_fibers[i];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
    f.state = kRunnable;
    f.tid = static_cast<unsigned>(i);
    g_count_phase[i] = 0;
  }
  g_count[0] = g_count[1] = 0;
  for (;;) {
    for (size_t i = 0; i < n; ++i) {
      if (g_fibers[i].state != kRunnable) continue;
      g_cur = i;
      threadIdx = dim3(g_fibers[i].tid);
      swapcontext(&g_main, &g_fibers[i].ctx);
    }
    // Everyone waits or is done: release full warps at a shuffle, else the block at __syncthreads.
    bool released = false, any_block = false, any_done = false, all_done = true;
    for (size_t w = 0; w < n; w += 32) {
      int at_warp = 0, done = 0;
      for (size_t i = w; i < w + 32 && i < n; ++i) {
        at_warp += g_fibers[i].state == kAtWarp;
        done += g_fibers[i].state == kDone;
      }
      if (at_warp && at_warp + done == 32 && done) die("a warp shuffle with exited lanes");
      if (at_warp == 32) {
        for (size_t i = w; i < w + 32; ++i) g_fibers[i].state = kRunnable;
        released = true;
      }
    }
    if (released) continue;
    for (const Fiber& f : g_fibers) {
      any_block |= f.state == kAtBlock;
      any_done |= f.state == kDone;
      all_done &= f.state == kDone;
    }
    if (all_done) return;
    if (any_block && any_done) die("__syncthreads() after some threads of the block exited");
    bool all_block = true;
    for (const Fiber& f : g_fibers) all_block &= f.state == kAtBlock;
    if (!all_block) die("deadlock: threads wait at different barriers (divergent __syncthreads or shuffle)");
    for (Fiber& f : g_fibers) f.state = kRunnable;
  }
}

}  // namespace

unsigned char* dynamic_smem() { return g_smem.data(); }
void block_barrier() { wait_as(kAtBlock); }
void warp_barrier() { wait_as(kAtWarp); }
uint64_t* warp_slots() { return g_warp_slots.data() + (threadIdx.x / 32) * 32; }

int block_count(int pred) {
  int& phase = g_count_phase[g_cur];
  const int i = phase;
  phase ^= 1;
  g_count[i] += pred != 0;
  block_barrier();
  const int r = g_count[i];
  g_count[i ^ 1] = 0;  // the next call's counter: nobody can be adding to it before the barrier below
  block_barrier();
  return r;
}

void launch(dim3 grid, dim3 block, size_t smem, cudaStream_t, std::function<void()> body) {
  const unsigned long long nthreads = 1ull * block.x * block.y * block.z;
  if (block.y != 1 || block.z != 1 || grid.z != 1 || nthreads == 0 || nthreads > 1024 || nthreads % 32 ||
      grid.y > 65535 || smem > kMaxSmem) {
    g_last_error = cudaErrorInvalidConfiguration;  // (the emulation also insists on whole warps)
    return;
  }
  if (grid.x == 0 || grid.y == 0) {
    g_last_error = cudaErrorInvalidConfiguration;
    return;
  }
  g_fibers.resize(nthreads);
  for (Fiber& f : g_fibers) f.stack.resize(kStack);
  g_count_phase.assign(nthreads, 0);
  g_warp_slots.assign(nthreads, 0);
  g_smem.assign(smem + 16, 0xCD);  // garbage, as on a GPU
  g_body = &body;
  blockDim = block;
  gridDim = grid;
  for (unsigned y = 0; y < grid.y; ++y)
    for (unsigned x = 0; x < grid.x; ++x) {
      blockIdx = dim3(x, y);
      run_block();
    }
  g_body = nullptr;
}

}  // namespace yf_emu

cudaError_t cudaGetLastError() {
  const cudaError_t e = yf_emu::g_last_error;
  yf_emu::g_last_error = cudaSuccess;
  return e;
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
  }
  return "unknown error";
}

cudaError_t cudaMemsetAsync(void* p, int value, size_t n, cudaStream_t) {
  std::memset(p, value, n);
  return cudaSuccess;
}
