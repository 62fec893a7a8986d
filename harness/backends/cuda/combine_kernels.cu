// harness/backends/cuda/combine_kernels.cu — the gated combine of two branch outputs (ScMoE's
// CG-1 / CG-2; see combine_kernels.hpp and Backend::gated_combine_forward). One block per row:
// the two gate values from the row's logits, then the row; backward reduces the row's dot
// products with CUB first. Checked against the float64 reference by
// harness/tests/cuda_blocks_test.cpp where a GPU is present.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cub/cub.cuh>

#include "harness/backends/cuda/combine_kernels.hpp"
#include "harness/backends/cuda/device_common.cuh"

namespace moelab::cuda_kernels {
namespace {

constexpr int kCombineThreads = 128;

// The gate values of a row: sigmoid and 1, or a softmax of two (max subtracted).
__device__ __forceinline__ void coefficients(const float* z, int gates, float& ca, float& cb) {
  if (gates == 1) {
    ca = 1.0f / (1.0f + expf(-z[0]));
    cb = 1.0f;
  } else {
    const float m = fmaxf(z[0], z[1]), ea = expf(z[0] - m), eb = expf(z[1] - m);
    ca = ea / (ea + eb);
    cb = eb / (ea + eb);
  }
}

template <class T_>
__global__ void gated_combine_forward_kernel(const float* __restrict__ z, int gates, const T_* a, const T_* b, T_* out,
                                             i64 T, i64 width) {
  for (i64 t = blockIdx.x; t < T; t += gridDim.x) {
    float ca, cb;
    coefficients(z + t * gates, gates, ca, cb);
    for (i64 c = threadIdx.x; c < width; c += blockDim.x) {
      const i64 i = t * width + c;
      st(out + i, ca * ld(a + i) + cb * ld(b + i));
    }
  }
}

template <class T_>
__global__ void gated_combine_backward_kernel(const float* __restrict__ z, int gates, const T_* a, const T_* b,
                                              const T_* d_out, T_* da, T_* db, float* __restrict__ dz, i64 T,
                                              i64 width) {
  using Reduce = cub::BlockReduce<float, kCombineThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  __shared__ float sums[2];
  for (i64 t = blockIdx.x; t < T; t += gridDim.x) {
    float ca, cb;
    coefficients(z + t * gates, gates, ca, cb);
    float pa = 0.0f, pb = 0.0f;
    for (i64 c = threadIdx.x; c < width; c += blockDim.x) {
      const float g = ld(d_out + t * width + c);
      pa += g * ld(a + t * width + c);
      if (gates == 2) pb += g * ld(b + t * width + c);
    }
    const float ta = Reduce(tmp).Sum(pa);
    __syncthreads();
    const float tb = gates == 2 ? Reduce(tmp).Sum(pb) : 0.0f;
    if (threadIdx.x == 0) {
      sums[0] = ta;
      sums[1] = tb;
    }
    __syncthreads();  // every dot product is read before any gradient overwrites what it read
    for (i64 c = threadIdx.x; c < width; c += blockDim.x) {
      const i64 i = t * width + c;
      const float g = ld(d_out + i);
      st(da + i, ca * g);
      if (db) st(db + i, cb * g);
    }
    if (threadIdx.x == 0) {
      if (gates == 1) {
        dz[t] = ca * (1.0f - ca) * sums[0];
      } else {
        const float mean = ca * sums[0] + cb * sums[1];
        dz[t * 2] = ca * (sums[0] - mean);
        dz[t * 2 + 1] = cb * (sums[1] - mean);
      }
    }
    __syncthreads();  // tmp and sums are reused by the next row
  }
}

}  // namespace

void gated_combine_forward(cudaStream_t stream, Elem e, const float* z, int gates, const void* a, const void* b,
                           void* out, std::int64_t tokens, std::int64_t width) {
  if (tokens <= 0) return;
  const unsigned grid = grid_for(tokens, 1);
  with_elem(e, [&](auto tag) {
    using T_ = decltype(tag);
    gated_combine_forward_kernel<<<grid, kCombineThreads, 0, stream>>>(
        z, gates, static_cast<const T_*>(a), static_cast<const T_*>(b), static_cast<T_*>(out), tokens, width);
  });
  check_launch("gated_combine_forward kernel");
}

void gated_combine_backward(cudaStream_t stream, Elem e, const float* z, int gates, const void* a, const void* b,
                            const void* d_out, void* da, void* db, float* dz, std::int64_t tokens, std::int64_t width) {
  if (tokens <= 0) return;
  const unsigned grid = grid_for(tokens, 1);
  with_elem(e, [&](auto tag) {
    using T_ = decltype(tag);
    gated_combine_backward_kernel<<<grid, kCombineThreads, 0, stream>>>(
        z, gates, static_cast<const T_*>(a), static_cast<const T_*>(b), static_cast<const T_*>(d_out),
        static_cast<T_*>(da), static_cast<T_*>(db), dz, tokens, width);
  });
  check_launch("gated_combine_backward kernel");
}

}  // namespace moelab::cuda_kernels
