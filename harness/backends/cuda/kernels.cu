// harness/backends/cuda/kernels.cu — the hand-written kernels of the cuda backend: the
// top-k gate (softmax, top-k, GShard capacity assignment, aux loss) and its backward, the
// noisy-logit transform, the dispatch/combine row movers (permute, unpermute and their
// backwards) and the FFN activations.
//
// Everything here is memory bound. Napkin math for a typical layer (T=8192 tokens,
// E=64 experts, k=2, M=4096, bf16) on an H100 (~3 TB/s):
//   gate forward    reads T*E*4 = 2 MiB of logits, writes 2 MiB of probs       ~ 2 us + launches
//   permute         T*k rows of M*2 bytes read and written: 2 * 128 MiB       ~ 90 us
//   unpermute       same bytes plus the weights                               ~ 90 us
// so the row movers use one block per row with coalesced column loops, and the gate's
// capacity assignment is a CUB radix sort of T*k keys rather than anything clever.
//
// The reference semantics are the cpu backend's; routing decisions (top-k choice, slots,
// counts) must match it exactly, floating-point results to rounding.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cub/cub.cuh>
#include <initializer_list>
#include <stdexcept>
#include <string>

#include "harness/backends/cuda/device_common.cuh"
#include "harness/backends/cuda/kernels.hpp"

namespace moelab::cuda_kernels {
namespace {

// ---- noisy logits --------------------------------------------------------------------

// Same formulas as the cpu backend: softplus(x) = log1p(e^x), linear past 20 where e^x
// would dominate; sigmoid folded into the division.
__device__ __forceinline__ float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

__global__ void noisy_logits_kernel(const float* __restrict__ clean, const float* __restrict__ noise,
                                    const float* __restrict__ eps, float* __restrict__ out, i64 n) {
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < n; i += static_cast<i64>(gridDim.x) * blockDim.x)
    out[i] = clean[i] + eps[i] * softplus(noise[i]);
}

__global__ void noisy_logits_backward_kernel(const float* __restrict__ dl, const float* __restrict__ noise,
                                             const float* __restrict__ eps, float* __restrict__ dn, i64 n) {
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < n; i += static_cast<i64>(gridDim.x) * blockDim.x)
    dn[i] = dl[i] * eps[i] / (1.0f + expf(-noise[i]));
}

// ---- gate forward --------------------------------------------------------------------
// One warp per token: softmax over E, then k rounds of a warp arg-max over the probabilities
// (ties to the lower expert index). Each choice j of token t also becomes the sort pair
// (key = expert, value = j*T + t): the j-major flattening is what gives GShard's priority
// (all first choices before any second choice, lower token first within a choice) once the
// pairs are stably sorted by expert.
__global__ void gate_softmax_topk_kernel(const float* __restrict__ logits, i64 T, int E, int k, bool renorm,
                                         float* __restrict__ probs, int* __restrict__ topk_idx,
                                         float* __restrict__ topk_w, unsigned* __restrict__ keys,
                                         int* __restrict__ vals) {
  const int lane = threadIdx.x % kWarp;
  const i64 warps = static_cast<i64>(gridDim.x) * blockDim.x / kWarp;
  for (i64 t = (blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x) / kWarp; t < T; t += warps) {
    const float* row = logits + t * E;
    float* prow = probs + t * E;
    float mx = -INFINITY;
    for (int e = lane; e < E; e += kWarp) mx = fmaxf(mx, row[e]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int e = lane; e < E; e += kWarp) sum += expf(row[e] - mx);
    sum = warp_sum(sum);
    for (int e = lane; e < E; e += kWarp) prow[e] = expf(row[e] - mx) / sum;
    __syncwarp();  // each lane re-reads only its own columns, but keep the order explicit

    int chosen[kMaxTopK];
    float chosen_p[kMaxTopK];
    for (int j = 0; j < k; ++j) {
      float bv = -INFINITY;
      int be = INT_MAX;
      for (int e = lane; e < E; e += kWarp) {
        bool taken = false;
        for (int c = 0; c < j; ++c) taken |= (chosen[c] == e);
        if (taken) continue;
        const float v = prow[e];
        if (v > bv) {  // columns ascend within a lane, so '>' already keeps the lower index on ties
          bv = v;
          be = e;
        }
      }
      for (int off = kWarp / 2; off > 0; off /= 2) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, off);
        const int oe = __shfl_xor_sync(0xffffffffu, be, off);
        if (ov > bv || (ov == bv && oe < be)) {
          bv = ov;
          be = oe;
        }
      }
      if (be == INT_MAX) {  // only with NaN logits: take the lowest free expert, stay in bounds
        be = 0;
        for (bool clash = true; clash;) {
          clash = false;
          for (int c = 0; c < j; ++c) clash |= (chosen[c] == be);
          if (clash) ++be;
        }
        bv = prow[be];
      }
      chosen[j] = be;
      chosen_p[j] = bv;
    }
    if (lane == 0) {
      float denom = 1.0f;
      if (renorm) {
        denom = 0.0f;
        for (int j = 0; j < k; ++j) denom += chosen_p[j];
      }
      for (int j = 0; j < k; ++j) {
        topk_idx[t * k + j] = chosen[j];
        topk_w[t * k + j] = renorm ? chosen_p[j] / denom : chosen_p[j];
        const i64 flat = static_cast<i64>(j) * T + t;
        keys[flat] = static_cast<unsigned>(chosen[j]);
        vals[flat] = static_cast<int>(flat);
      }
    }
  }
}

// Column sums of probs, in deterministic partial blocks: partial[g, e] = sum over the g-th
// run of rows. A block is 32 experts wide (coalesced) and 8 rows tall. Accumulated in
// double, as the cpu backend does, so that the aux loss agrees to fp32 rounding.
constexpr int kColX = 32, kColY = 8;
__global__ void gate_colsum_partial_kernel(const float* __restrict__ probs, i64 T, int E, i64 rows_per_block,
                                           double* __restrict__ partial) {
  __shared__ double sh[kColY][kColX + 1];
  const int e = blockIdx.x * kColX + threadIdx.x;
  const i64 r0 = blockIdx.y * rows_per_block;
  const i64 r1 = min(T, r0 + rows_per_block);
  double acc = 0.0;
  if (e < E)
    for (i64 t = r0 + threadIdx.y; t < r1; t += kColY) acc += probs[t * E + e];
  sh[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && e < E) {
    double s = 0.0;
    for (int y = 0; y < kColY; ++y) s += sh[y][threadIdx.x];
    partial[static_cast<i64>(blockIdx.y) * E + e] = s;
  }
}

// The per-expert layout, one block: from the pre-drop histogram, each expert's segment start
// in the sorted pairs (exclusive scan of pre-drop counts), its kept count (clamped to the
// capacity), the buffer offset (exclusive scan of kept counts), f_e, and the aux loss
// E * sum_e f_e * P_e with P_e the column mean of probs (and P_e itself when asked).
constexpr int kLayoutThreads = 256;
__global__ void gate_layout_kernel(const int* __restrict__ hist, const double* __restrict__ partial, int groups,
                                   i64 T, int k, int E, i64 capacity, int* __restrict__ seg_start,
                                   int* __restrict__ counts, int* __restrict__ offset,
                                   float* __restrict__ routed_frac, float* __restrict__ aux_loss,
                                   float* __restrict__ prob_mean) {
  using Scan = cub::BlockScan<int, kLayoutThreads>;
  using Reduce = cub::BlockReduce<double, kLayoutThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ typename Reduce::TempStorage reduce_tmp;
  __shared__ int carry_pre, carry_kept;
  if (threadIdx.x == 0) carry_pre = carry_kept = 0;
  __syncthreads();
  double aux_part = 0.0;
  for (int base = 0; base < E; base += kLayoutThreads) {
    const int e = base + static_cast<int>(threadIdx.x);
    const int pre = e < E ? hist[e] : 0;
    const int kept = (capacity > 0 && pre > capacity) ? static_cast<int>(capacity) : pre;
    int ex_pre, agg_pre, ex_kept, agg_kept;
    Scan(scan_tmp).ExclusiveSum(pre, ex_pre, agg_pre);
    __syncthreads();
    Scan(scan_tmp).ExclusiveSum(kept, ex_kept, agg_kept);
    if (e < E) {
      seg_start[e] = carry_pre + ex_pre;
      counts[e] = kept;
      offset[e] = carry_kept + ex_kept;
      const float f = static_cast<float>(static_cast<double>(pre) / static_cast<double>(T * k));
      routed_frac[e] = f;
      double col = 0.0;
      for (int g = 0; g < groups; ++g) col += partial[static_cast<i64>(g) * E + e];
      aux_part += static_cast<double>(f) * (col / static_cast<double>(T));
      if (prob_mean) prob_mean[e] = static_cast<float>(col / static_cast<double>(T));
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      carry_pre += agg_pre;
      carry_kept += agg_kept;
    }
    __syncthreads();
  }
  const double total = Reduce(reduce_tmp).Sum(aux_part);
  if (threadIdx.x == 0) *aux_loss = static_cast<float>(static_cast<double>(E) * total);
}

// Sorted pair i of expert e sits at position i - seg_start[e] of that expert's queue; it is
// kept iff that position is under the capacity, at buffer row offset[e] + position.
__global__ void gate_assign_kernel(const unsigned* __restrict__ keys_sorted, const int* __restrict__ vals_sorted,
                                   i64 n, i64 T, int k, i64 capacity, const int* __restrict__ seg_start,
                                   const int* __restrict__ offset, int* __restrict__ slot) {
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < n; i += static_cast<i64>(gridDim.x) * blockDim.x) {
    const int e = static_cast<int>(keys_sorted[i]);
    const i64 pos = i - seg_start[e];
    const i64 flat = vals_sorted[i];
    const i64 j = flat / T, t = flat - j * T;
    slot[t * k + j] = (capacity <= 0 || pos < capacity) ? static_cast<int>(offset[e] + pos) : -1;
  }
}

// ---- gate backward -------------------------------------------------------------------
// One warp per token. dL/dp[t,e] collects
//   - the gate weights: w_j = p_j (or p_j / S with S = sum of the chosen p when renormalised,
//     giving dp_{idx_l} = (dw_l - sum_j dw_j w_j) / S),
//   - the aux loss E * sum_e f_e * mean_t p[t,e] with f_e held constant: grad_aux*E*f_e/T,
// and the softmax backward turns it into d_logits = p * (dp - sum_e p*dp).
__global__ void gate_backward_kernel(const float* __restrict__ probs, const int* __restrict__ topk_idx,
                                     const float* __restrict__ topk_w, const float* __restrict__ routed_frac,
                                     const float* __restrict__ d_topk_w, i64 T, int E, int k, bool renorm,
                                     float grad_aux, float* __restrict__ d_logits) {
  const int lane = threadIdx.x % kWarp;
  const i64 warps = static_cast<i64>(gridDim.x) * blockDim.x / kWarp;
  for (i64 t = (blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x) / kWarp; t < T; t += warps) {
    const float* prow = probs + t * E;
    const int* idx = topk_idx + t * k;
    const float* dw = d_topk_w + t * k;
    float s_chosen = 1.0f, dot = 0.0f;
    if (renorm) {
      s_chosen = 0.0f;
      for (int j = 0; j < k; ++j) {
        s_chosen += prow[idx[j]];
        dot += dw[j] * topk_w[t * k + j];
      }
    }
    auto dp_of = [&](int e) {
      float g = grad_aux * static_cast<float>(E) * routed_frac[e] / static_cast<float>(T);
      for (int j = 0; j < k; ++j)
        if (idx[j] == e) g += renorm ? (dw[j] - dot) / s_chosen : dw[j];
      return g;
    };
    float s = 0.0f;
    for (int e = lane; e < E; e += kWarp) s += prow[e] * dp_of(e);
    s = warp_sum(s);
    for (int e = lane; e < E; e += kWarp) d_logits[t * E + e] = prow[e] * (dp_of(e) - s);
  }
}

// ---- row movers ----------------------------------------------------------------------
constexpr int kRowThreads = 128;

// out[slot[t,j]] = x[t]: a pure copy, so rows move as 16-byte vectors when they allow it.
template <class V>
__global__ void permute_kernel(const V* __restrict__ x, const int* __restrict__ slot, V* __restrict__ out, i64 T,
                               int k, i64 width_v, i64 rows_n) {
  for (i64 r = blockIdx.x; r < T * k; r += gridDim.x) {
    const int s = slot[r];
    if (s < 0 || s >= rows_n) continue;
    const V* src = x + (r / k) * width_v;
    V* dst = out + static_cast<i64>(s) * width_v;
    for (i64 c = threadIdx.x; c < width_v; c += blockDim.x) dst[c] = src[c];
  }
}

// The row and elementwise kernels below are templates over P, a Pack of N elements: N = 1
// (any width, any alignment) or 16 bytes' worth (rows of whole packs on 16-byte aligned
// tensors; `rows_vectorize` below). Widths are counted in packs. An output element is computed
// in fp32 in the same order either way; only unpermute_backward's dw, a block sum, adds its
// terms in another order.

// dx[t] = sum_j d_out[slot[t,j]] over kept slots, accumulated in fp32.
template <class P>
__global__ void permute_backward_kernel(const P* __restrict__ d_out, const int* __restrict__ slot,
                                        P* __restrict__ dx, i64 T, int k, i64 width_p, i64 rows_n) {
  for (i64 t = blockIdx.x; t < T; t += gridDim.x) {
    const int* sl = slot + t * k;
    for (i64 c = threadIdx.x; c < width_p; c += blockDim.x) {
      float acc[P::n] = {};
      for (int j = 0; j < k; ++j) {
        const int s = sl[j];
        if (s < 0 || s >= rows_n) continue;
        const P v = d_out[static_cast<i64>(s) * width_p + c];
#pragma unroll
        for (int e = 0; e < P::n; ++e) acc[e] += ld(&v.v[e]);
      }
      P o;
#pragma unroll
      for (int e = 0; e < P::n; ++e) st(&o.v[e], acc[e]);
      dx[t * width_p + c] = o;
    }
  }
}

// y[t] = sum_j w[t,j] * y_perm[slot[t,j]] over kept slots (the combine).
template <class P>
__global__ void unpermute_kernel(const P* __restrict__ y_perm, const int* __restrict__ slot,
                                 const float* __restrict__ w, P* __restrict__ y, i64 T, int k, i64 width_p,
                                 i64 rows_n) {
  for (i64 t = blockIdx.x; t < T; t += gridDim.x) {
    const int* sl = slot + t * k;
    const float* wt = w + t * k;
    for (i64 c = threadIdx.x; c < width_p; c += blockDim.x) {
      float acc[P::n] = {};
      for (int j = 0; j < k; ++j) {
        const int s = sl[j];
        if (s < 0 || s >= rows_n) continue;
        const P v = y_perm[static_cast<i64>(s) * width_p + c];
#pragma unroll
        for (int e = 0; e < P::n; ++e) acc[e] += wt[j] * ld(&v.v[e]);
      }
      P o;
#pragma unroll
      for (int e = 0; e < P::n; ++e) st(&o.v[e], acc[e]);
      y[t * width_p + c] = o;
    }
  }
}

// d_y_perm[slot] = w * dy[t] and dw[t,j] = <dy[t], y_perm[slot]> (a block reduction per
// token-slot); a dropped slot gets dw = 0 and writes no row. d_y_perm may alias y_perm: each
// thread reads its pack of y_perm before it writes it.
template <class P>
__global__ void unpermute_backward_kernel(const P* __restrict__ dy, const P* y_perm, const int* __restrict__ slot,
                                          const float* __restrict__ w, P* d_y_perm, float* __restrict__ dw, i64 T,
                                          int k, i64 width_p, i64 rows_n) {
  using Reduce = cub::BlockReduce<float, kRowThreads>;
  __shared__ typename Reduce::TempStorage tmp;
  for (i64 t = blockIdx.x; t < T; t += gridDim.x) {
    for (int j = 0; j < k; ++j) {
      const int s = slot[t * k + j];
      if (s < 0 || s >= rows_n) {
        if (threadIdx.x == 0) dw[t * k + j] = 0.0f;
        continue;  // uniform across the block: no thread reaches the reduction below
      }
      const float wj = w[t * k + j];
      float acc = 0.0f;
      for (i64 c = threadIdx.x; c < width_p; c += blockDim.x) {
        const P g = dy[t * width_p + c];
        const P yp = y_perm[static_cast<i64>(s) * width_p + c];  // read before the write
        P o;
#pragma unroll
        for (int e = 0; e < P::n; ++e) {
          const float ge = ld(&g.v[e]);
          acc += ge * ld(&yp.v[e]);
          st(&o.v[e], wj * ge);
        }
        d_y_perm[static_cast<i64>(s) * width_p + c] = o;
      }
      const float total = Reduce(tmp).Sum(acc);
      if (threadIdx.x == 0) dw[t * k + j] = total;
      __syncthreads();  // tmp is reused by the next reduction
    }
  }
}

// ---- activations ---------------------------------------------------------------------
constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

constexpr float kSqrt2OverPi = 0.79788456080286536f;  // the tanh GeLU's sqrt(2/pi)
constexpr float kGeluTanhCubic = 0.044715f;            // and its cubic's coefficient

__device__ __forceinline__ float act(Act a, float x) {
  if (a == Act::gelu) return 0.5f * x * (1.0f + erff(x * kInvSqrt2));
  if (a == Act::gelu_tanh) return 0.5f * x * (1.0f + tanhf(kSqrt2OverPi * (x + kGeluTanhCubic * x * x * x)));
  return fmaxf(x, 0.0f);
}
// d_out * act'(x), in the cpu backend's order of operations; ReLU selects rather than
// multiplies so that an inf/NaN gradient at x <= 0 stays 0.
__device__ __forceinline__ float act_backward(Act a, float x, float dy) {
  if (a == Act::relu) return x > 0.0f ? dy : 0.0f;
  if (a == Act::gelu_tanh) {
    const float t = tanhf(kSqrt2OverPi * (x + kGeluTanhCubic * x * x * x));
    const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluTanhCubic * x * x);
    return dy * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du);
  }
  const float cdf = 0.5f * (1.0f + erff(x * kInvSqrt2));
  const float pdf = kInvSqrt2Pi * expf(-0.5f * x * x);
  return dy * (cdf + x * pdf);
}

// n packs of P (the launcher runs the vector packs, then any tail as packs of one).
template <class P>
__global__ void activation_forward_kernel(Act a, const P* __restrict__ in, P* __restrict__ out, i64 n) {
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < n; i += static_cast<i64>(gridDim.x) * blockDim.x) {
    const P x = in[i];
    P y;
#pragma unroll
    for (int e = 0; e < P::n; ++e) st(&y.v[e], act(a, ld(&x.v[e])));
    out[i] = y;
  }
}

// d_in may alias d_out (exactly: one thread reads a pack, then writes it): no __restrict__ on
// those two.
template <class P>
__global__ void activation_backward_kernel(Act a, const P* __restrict__ in, const P* d_out, P* d_in, i64 n) {
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < n; i += static_cast<i64>(gridDim.x) * blockDim.x) {
    const P x = in[i];
    const P g = d_out[i];
    P d;
#pragma unroll
    for (int e = 0; e < P::n; ++e) st(&d.v[e], act_backward(a, ld(&x.v[e]), ld(&g.v[e])));
    d_in[i] = d;
  }
}

}  // namespace

// ---- launchers -----------------------------------------------------------------------

void noisy_logits(cudaStream_t stream, const float* clean, const float* noise_raw, const float* eps, float* logits,
                  std::int64_t n) {
  if (n <= 0) return;
  noisy_logits_kernel<<<grid_for(n, kElemThreads), kElemThreads, 0, stream>>>(clean, noise_raw, eps, logits, n);
  check_launch("noisy_logits kernel");
}

void noisy_logits_backward(cudaStream_t stream, const float* d_logits, const float* noise_raw, const float* eps,
                           float* d_noise_raw, std::int64_t n) {
  if (n <= 0) return;
  noisy_logits_backward_kernel<<<grid_for(n, kElemThreads), kElemThreads, 0, stream>>>(d_logits, noise_raw, eps,
                                                                                        d_noise_raw, n);
  check_launch("noisy_logits_backward kernel");
}

void gate_forward(cudaStream_t stream, const GateForwardArgs& a) {
  const i64 T = a.tokens;
  const int E = a.experts, k = a.top_k;
  if (E <= 0) return;
  if (T == 0) {
    check(cudaMemsetAsync(a.counts, 0, sizeof(int) * E, stream), "cudaMemsetAsync");
    check(cudaMemsetAsync(a.routed_frac, 0, sizeof(float) * E, stream), "cudaMemsetAsync");
    check(cudaMemsetAsync(a.aux_loss, 0, sizeof(float), stream), "cudaMemsetAsync");
    if (a.prob_mean) check(cudaMemsetAsync(a.prob_mean, 0, sizeof(float) * E, stream), "cudaMemsetAsync");
    return;
  }
  const i64 n = T * k;
  int end_bit = 1;
  while ((1LL << end_bit) < E) ++end_bit;  // keys are < E: sort only the bits that can differ

  // Column-sum partials: up to 256 row groups keep the final per-expert sum short.
  const i64 groups = std::min<i64>(256, (T + 255) / 256);
  const i64 rows_per_group = (T + groups - 1) / groups;

  std::size_t hist_tmp = 0, sort_tmp = 0;
  check(cub::DeviceHistogram::HistogramEven(nullptr, hist_tmp, static_cast<const unsigned*>(nullptr),
                                            static_cast<int*>(nullptr), E + 1, 0u, static_cast<unsigned>(E),
                                            static_cast<int>(n), stream),
        "cub::DeviceHistogram (size query)");
  check(cub::DeviceRadixSort::SortPairs(nullptr, sort_tmp, static_cast<const unsigned*>(nullptr),
                                        static_cast<unsigned*>(nullptr), static_cast<const int*>(nullptr),
                                        static_cast<int*>(nullptr), static_cast<int>(n), 0, end_bit, stream),
        "cub::DeviceRadixSort (size query)");
  const std::size_t tmp_bytes = std::max(hist_tmp, sort_tmp);

  // One workspace: pairs in and out, histogram, segment starts, offsets, column partials, CUB.
  const std::size_t b_pairs = align_up(sizeof(unsigned) * static_cast<std::size_t>(n));
  const std::size_t b_e = align_up(sizeof(int) * static_cast<std::size_t>(E));
  const std::size_t b_part = align_up(sizeof(double) * static_cast<std::size_t>(groups * E));
  Workspace ws(4 * b_pairs + 3 * b_e + b_part + align_up(tmp_bytes), stream);
  char* p = ws.get();
  auto take = [&p](std::size_t b) {
    char* q = p;
    p += b;
    return q;
  };
  auto* keys_in = reinterpret_cast<unsigned*>(take(b_pairs));
  auto* keys_out = reinterpret_cast<unsigned*>(take(b_pairs));
  auto* vals_in = reinterpret_cast<int*>(take(b_pairs));
  auto* vals_out = reinterpret_cast<int*>(take(b_pairs));
  auto* hist = reinterpret_cast<int*>(take(b_e));
  auto* seg_start = reinterpret_cast<int*>(take(b_e));
  auto* offset = reinterpret_cast<int*>(take(b_e));
  auto* partial = reinterpret_cast<double*>(take(b_part));
  void* cub_tmp = take(align_up(tmp_bytes));

  constexpr int kThreads = 256;
  gate_softmax_topk_kernel<<<grid_for(T, kThreads / kWarp), kThreads, 0, stream>>>(
      a.logits, T, E, k, a.renormalize, a.probs, a.topk_idx, a.topk_w, keys_in, vals_in);
  check_launch("gate softmax/top-k kernel");

  const dim3 cgrid(static_cast<unsigned>((E + kColX - 1) / kColX), static_cast<unsigned>(groups));
  gate_colsum_partial_kernel<<<cgrid, dim3(kColX, kColY), 0, stream>>>(a.probs, T, E, rows_per_group, partial);
  check_launch("gate column-sum kernel");

  std::size_t tb = hist_tmp;
  check(cub::DeviceHistogram::HistogramEven(cub_tmp, tb, static_cast<const unsigned*>(keys_in), hist, E + 1, 0u,
                                            static_cast<unsigned>(E), static_cast<int>(n), stream),
        "cub::DeviceHistogram");
  tb = sort_tmp;
  check(cub::DeviceRadixSort::SortPairs(cub_tmp, tb, static_cast<const unsigned*>(keys_in), keys_out,
                                        static_cast<const int*>(vals_in), vals_out, static_cast<int>(n), 0, end_bit,
                                        stream),
        "cub::DeviceRadixSort");

  gate_layout_kernel<<<1, kLayoutThreads, 0, stream>>>(hist, partial, static_cast<int>(groups), T, k, E, a.capacity,
                                                       seg_start, a.counts, offset, a.routed_frac, a.aux_loss,
                                                       a.prob_mean);
  check_launch("gate layout kernel");

  gate_assign_kernel<<<grid_for(n, kElemThreads), kElemThreads, 0, stream>>>(keys_out, vals_out, n, T, k, a.capacity,
                                                                             seg_start, offset, a.slot);
  check_launch("gate slot-assignment kernel");
}

void gate_backward(cudaStream_t stream, const GateBackwardArgs& a) {
  if (a.tokens <= 0 || a.experts <= 0) return;
  constexpr int kThreads = 256;
  gate_backward_kernel<<<grid_for(a.tokens, kThreads / kWarp), kThreads, 0, stream>>>(
      a.probs, a.topk_idx, a.topk_w, a.routed_frac, a.d_topk_w, a.tokens, a.experts, a.top_k, a.renormalize,
      a.grad_aux, a.d_logits);
  check_launch("gate backward kernel");
}

void permute(cudaStream_t stream, Elem e, const void* x, const std::int32_t* slot, void* out, std::int64_t tokens,
             int top_k, std::int64_t width, std::int64_t rows_n) {
  if (tokens <= 0 || top_k <= 0 || width <= 0) return;
  const std::size_t row_bytes = static_cast<std::size_t>(width) * (e == Elem::f32 ? 4 : 2);
  const unsigned grid = grid_for(tokens * top_k, 1);
  const bool vec = row_bytes % 16 == 0 && reinterpret_cast<std::uintptr_t>(x) % 16 == 0 &&
                   reinterpret_cast<std::uintptr_t>(out) % 16 == 0;
  if (vec) {
    permute_kernel<<<grid, kRowThreads, 0, stream>>>(static_cast<const uint4*>(x), slot, static_cast<uint4*>(out),
                                                     tokens, top_k, static_cast<i64>(row_bytes / 16), rows_n);
  } else if (e == Elem::f32) {
    permute_kernel<<<grid, kRowThreads, 0, stream>>>(static_cast<const float*>(x), slot, static_cast<float*>(out),
                                                     tokens, top_k, width, rows_n);
  } else {
    permute_kernel<<<grid, kRowThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x), slot,
                                                     static_cast<__nv_bfloat16*>(out), tokens, top_k, width, rows_n);
  }
  check_launch("permute kernel");
}

// Whether rows of `width` elements of e on these tensors can move as 16-byte packs.
static bool rows_vectorize(Elem e, std::int64_t width, std::initializer_list<const void*> tensors) {
  if (width * (e == Elem::f32 ? 4 : 2) % 16 != 0) return false;
  for (const void* p : tensors)
    if (!aligned16(p)) return false;
  return true;
}

void permute_backward(cudaStream_t stream, Elem e, const void* d_out, const std::int32_t* slot, void* dx,
                      std::int64_t tokens, int top_k, std::int64_t width, std::int64_t rows_n) {
  if (tokens <= 0 || width <= 0) return;
  const unsigned grid = grid_for(tokens, 1);
  const bool vec = rows_vectorize(e, width, {d_out, dx});
  with_elem(e, [&](auto t) {
    const auto run = [&](auto pack) {
      using P = decltype(pack);
      permute_backward_kernel<<<grid, kRowThreads, 0, stream>>>(static_cast<const P*>(d_out), slot,
                                                                static_cast<P*>(dx), tokens, top_k, width / P::n,
                                                                rows_n);
    };
    if (vec) run(Pack<decltype(t)>{});
    else run(Pack<decltype(t), 1>{});
  });
  check_launch("permute_backward kernel");
}

void unpermute(cudaStream_t stream, Elem e, const void* y_perm, const std::int32_t* slot, const float* w, void* y,
               std::int64_t tokens, int top_k, std::int64_t width, std::int64_t rows_n) {
  if (tokens <= 0 || width <= 0) return;
  const unsigned grid = grid_for(tokens, 1);
  const bool vec = rows_vectorize(e, width, {y_perm, y});
  with_elem(e, [&](auto t) {
    const auto run = [&](auto pack) {
      using P = decltype(pack);
      unpermute_kernel<<<grid, kRowThreads, 0, stream>>>(static_cast<const P*>(y_perm), slot, w, static_cast<P*>(y),
                                                         tokens, top_k, width / P::n, rows_n);
    };
    if (vec) run(Pack<decltype(t)>{});
    else run(Pack<decltype(t), 1>{});
  });
  check_launch("unpermute kernel");
}

void unpermute_backward(cudaStream_t stream, Elem e, const void* dy, const void* y_perm, const std::int32_t* slot,
                        const float* w, void* d_y_perm, float* dw, std::int64_t tokens, int top_k,
                        std::int64_t width, std::int64_t rows_n) {
  if (tokens <= 0 || top_k <= 0) return;
  const unsigned grid = grid_for(tokens, 1);
  const bool vec = rows_vectorize(e, width, {dy, y_perm, d_y_perm});
  with_elem(e, [&](auto t) {
    const auto run = [&](auto pack) {
      using P = decltype(pack);
      unpermute_backward_kernel<<<grid, kRowThreads, 0, stream>>>(static_cast<const P*>(dy),
                                                                  static_cast<const P*>(y_perm), slot, w,
                                                                  static_cast<P*>(d_y_perm), dw, tokens, top_k,
                                                                  width / P::n, rows_n);
    };
    if (vec) run(Pack<decltype(t)>{});
    else run(Pack<decltype(t), 1>{});
  });
  check_launch("unpermute_backward kernel");
}

// Whole 16-byte packs when every tensor is 16-byte aligned, then the tail (fewer elements than
// a pack) one by one; one by one throughout otherwise.
void activation_forward(cudaStream_t stream, Elem e, Act a, const void* in, void* out, std::int64_t n) {
  if (n <= 0) return;
  with_elem(e, [&](auto t) {
    using T_ = decltype(t);
    using V = Pack<T_>;
    using S = Pack<T_, 1>;
    const i64 packs = aligned16(in) && aligned16(out) ? n / V::n : 0, done = packs * V::n;
    if (packs > 0) {
      activation_forward_kernel<<<grid_for(packs, kElemThreads), kElemThreads, 0, stream>>>(
          a, static_cast<const V*>(in), static_cast<V*>(out), packs);
      check_launch("activation_forward kernel");
    }
    if (n > done) {
      activation_forward_kernel<<<grid_for(n - done, kElemThreads), kElemThreads, 0, stream>>>(
          a, static_cast<const S*>(in) + done, static_cast<S*>(out) + done, n - done);
      check_launch("activation_forward kernel");
    }
  });
}

void activation_backward(cudaStream_t stream, Elem e, Act a, const void* in, const void* d_out, void* d_in,
                         std::int64_t n) {
  if (n <= 0) return;
  with_elem(e, [&](auto t) {
    using T_ = decltype(t);
    using V = Pack<T_>;
    using S = Pack<T_, 1>;
    const i64 packs = aligned16(in) && aligned16(d_out) && aligned16(d_in) ? n / V::n : 0, done = packs * V::n;
    if (packs > 0) {
      activation_backward_kernel<<<grid_for(packs, kElemThreads), kElemThreads, 0, stream>>>(
          a, static_cast<const V*>(in), static_cast<const V*>(d_out), static_cast<V*>(d_in), packs);
      check_launch("activation_backward kernel");
    }
    if (n > done) {
      activation_backward_kernel<<<grid_for(n - done, kElemThreads), kElemThreads, 0, stream>>>(
          a, static_cast<const S*>(in) + done, static_cast<const S*>(d_out) + done, static_cast<S*>(d_in) + done,
          n - done);
      check_launch("activation_backward kernel");
    }
  });
}

// fp32 <-> bf16 conversion (round to nearest even), for the bf16 layer's gate GEMMs whose
// gradients come out of the fp32 gate.
__global__ void convert_f32_to_bf16_kernel(const float* __restrict__ in, __nv_bfloat16* __restrict__ out, i64 n) {
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < n; i += static_cast<i64>(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16_rn(in[i]);
}
__global__ void convert_bf16_to_f32_kernel(const __nv_bfloat16* __restrict__ in, float* __restrict__ out, i64 n) {
  for (i64 i = blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; i < n; i += static_cast<i64>(gridDim.x) * blockDim.x)
    out[i] = __bfloat162float(in[i]);
}

void convert(cudaStream_t stream, Elem from, const void* in, void* out, std::int64_t n) {
  if (n <= 0) return;
  const unsigned grid = grid_for(n, kElemThreads);
  if (from == Elem::f32)
    convert_f32_to_bf16_kernel<<<grid, kElemThreads, 0, stream>>>(static_cast<const float*>(in),
                                                                   static_cast<__nv_bfloat16*>(out), n);
  else
    convert_bf16_to_f32_kernel<<<grid, kElemThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(in),
                                                                   static_cast<float*>(out), n);
  check_launch("convert kernel");
}

}  // namespace moelab::cuda_kernels
