// harness/backends/cuda/device_common.cuh — what both device translation units of the cuda
// backend (kernels.cu, block_kernels.cu) share: error checks, launch geometry, fp32/bf16
// loads and stores, warp reductions, stream-ordered scratch. Included by .cu files only.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "harness/backends/cuda/kernels.hpp"

namespace moelab::cuda_kernels {

using i64 = long long;
constexpr int kWarp = 32;
constexpr int kElemThreads = 256;

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("cuda: ") + what + " failed: " + cudaGetErrorString(err));
}
inline void check_launch(const char* kernel) { check(cudaGetLastError(), kernel); }

// Grid for a grid-stride loop over `work` items handled `per_block` at a time. Capped: the
// loops stride, and more blocks than ~16 per SM buy nothing.
inline unsigned grid_for(i64 work, i64 per_block) {
  i64 b = (work + per_block - 1) / per_block;
  if (b < 1) b = 1;
  if (b > 8192) b = 8192;
  return static_cast<unsigned>(b);
}

// Runs f(T{}) with T the C++ element type of e (float or __nv_bfloat16): one launch site
// per kernel serves both dtypes.
template <class F>
void with_elem(Elem e, F&& f) {
  if (e == Elem::f32)
    f(float{});
  else
    f(__nv_bfloat16{});
}

__device__ __forceinline__ float ld(const float* p) { return *p; }
__device__ __forceinline__ float ld(const __nv_bfloat16* p) { return __bfloat162float(*p); }
__device__ __forceinline__ void st(float* p, float v) { *p = v; }
__device__ __forceinline__ void st(__nv_bfloat16* p, float v) { *p = __float2bfloat16_rn(v); }

// N elements moved as one access: one (any address), or sixteen bytes' worth (4 fp32 or 8
// bf16, one 128-bit access). The elementwise and row kernels read and write memory-bound
// [rows, width] tensors, and 2-byte accesses leave the HBM rate on the table; their launchers
// take the 16-byte packs where every pointer (and row width) allows it.
template <class T, int N = 16 / static_cast<int>(sizeof(T))>
struct alignas(sizeof(T) * N) Pack {
  static constexpr int n = N;
  T v[N];
};
inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

__device__ __forceinline__ float warp_sum(float v) {
  for (int off = kWarp / 2; off > 0; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int off = kWarp / 2; off > 0; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

// Stream-ordered scratch from the device's pool, returned on the same stream.
class Workspace {
 public:
  Workspace(std::size_t bytes, cudaStream_t s) : s_(s) {
    if (bytes) check_alloc(cudaMallocAsync(&p_, bytes, s), "cudaMallocAsync (workspace)", bytes);
  }
  ~Workspace() {
    if (p_) cudaFreeAsync(p_, s_);  // cannot throw from here; a failure resurfaces at the next sync
  }
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;
  char* get() const { return static_cast<char*>(p_); }

 private:
  void* p_ = nullptr;
  cudaStream_t s_;
};

inline std::size_t align_up(std::size_t n) { return (n + 255) / 256 * 256; }

}  // namespace moelab::cuda_kernels
