// harness/backends/cuda/block_kernels.cu — the transformer-block kernels of the cuda backend,
// in the order a token meets them: embedding, norm, rotary embedding, attention (forward and
// the FlashAttention-2 backward), SwiGLU, residual add, fused softmax cross-entropy, and the
// optimizer step. Each section is kernel(s), then the launcher; forward and backward sit
// together. Declarations: block_kernels.hpp; the float64 reference they are tested against:
// harness/tests/cuda_blocks_reference.hpp (harness/tests/cuda_blocks_test.cpp).
//
// Storage is fp32 or bf16; every reduction (norm statistics, softmax, dot products, loss,
// gradient sums) runs in fp32 and a bf16 value is rounded once, when stored.
//
// Napkin math (H100: ~3.3 TB/s HBM, ~60 TFLOP/s fp32 on the CUDA cores, ~990 bf16 on tensor
// cores), for T = 8192 tokens, M = 4096, bf16:
//   norm forward     reads x (64 MiB) + writes y (64 MiB)                       ~ 40 us
//   rope             q and k heads (T x 2M when Hkv = Hq: 128 MiB) read and written ~ 80 us
//   swiglu (F=11008) reads h (344 MiB), writes out (172 MiB)                    ~ 160 us
//   cross-entropy    V = 50257: reads the logits (785 MiB) once forward, once
//                    backward (+ writes d_logits)                               ~ 250 / 500 us
// all memory bound: one warp (norms) or one block (loss) per row, coalesced column loops.
// Attention is the one that computes. B = 4, S = 2048, Hq = 32, Hkv = 8, D = 128, causal:
//   FLOPs  forward 2 * 2*B*Hq*S^2*D / 2 (causal)          = 1.4e11 -> ~2.3 ms on CUDA cores
//          backward: 7 such products here (see the backward) = 4.8e11 -> ~8 ms
//   bytes  q and out once (64 MiB each); K and V of one (b, kv head) are 1 MiB, read once
//          per 32-row query tile of each of its 4 query heads (64 tiles, half of them when
//          causal): 128 MiB per (b, kv head), 4 GiB in all, served by the 50 MiB L2.
// These kernels multiply on the CUDA cores in fp32, so they are compute bound at a few
// percent of the tensor-core peak: they are written to be read (Dao et al. 2022, Alg. 1;
// Dao 2023, Alg. 1-2), not to compete with FlashAttention's own mma-based kernels.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cub/device/device_radix_sort.cuh>
#include <stdexcept>
#include <string>

#include "harness/backends/cuda/block_kernels.hpp"
#include "harness/backends/cuda/device_common.cuh"

namespace moelab::cuda_kernels {
namespace {

// The i-th thread of the whole grid and the grid's size, for grid-stride loops.
__device__ __forceinline__ i64 grid_thread() { return blockIdx.x * static_cast<i64>(blockDim.x) + threadIdx.x; }
__device__ __forceinline__ i64 grid_threads() { return static_cast<i64>(gridDim.x) * blockDim.x; }

// Warps of the grid, for loops that give each row to one warp.
__device__ __forceinline__ i64 grid_warp() { return grid_thread() / kWarp; }
__device__ __forceinline__ i64 grid_warps() { return grid_threads() / kWarp; }

constexpr int kRowWarpsPerBlock = 8;  // row kernels: 256 threads, one row per warp

// ==== embedding ===========================================================================

template <class T_>
__global__ void embedding_forward_kernel(const int* __restrict__ ids, const T_* __restrict__ wte,
                                         const T_* __restrict__ wpe, T_* __restrict__ out, i64 T, i64 M, i64 S,
                                         i64 V, i64 start) {
  for (i64 t = blockIdx.x; t < T; t += gridDim.x) {
    const i64 id = ids[t] - start;
    const bool known = id >= 0 && id < V;
    const T_* w = wte + (known ? id : 0) * M;
    const T_* p = wpe ? wpe + (t % S) * M : nullptr;
    for (i64 c = threadIdx.x; c < M; c += blockDim.x) {
      float v = known ? ld(w + c) : 0.0f;
      if (p) v += ld(p + c);
      st(out + t * M + c, v);
    }
  }
}

// d_wpe[p] += sum over the B sequences of d_out[b*S + p]: each (p, c) has exactly B
// contributions, summed by one thread in sequence order (no atomics, deterministic).
template <class T_>
__global__ void embedding_backward_wpe_kernel(const T_* __restrict__ d_out, T_* __restrict__ d_wpe, i64 B, i64 S,
                                              i64 M) {
  for (i64 i = grid_thread(); i < S * M; i += grid_threads()) {
    float acc = 0.0f;
    for (i64 b = 0; b < B; ++b) acc += ld(d_out + b * S * M + i);
    st(d_wpe + i, ld(d_wpe + i) + acc);
  }
}

// The token gradient is a scatter-add with repeated ids. Rather than atomics into an fp32
// scratch of the whole table (V*M*4 bytes: 785 MiB at V = 50257, M = 4096, and d_wte may be
// bf16, which has no exact atomic add), the (id, t) pairs are sorted by id (a stable radix
// sort of T keys), each run of equal ids is summed in fp32 in token order, and the sum is
// added into d_wte once (llm.c's encoder_backward buckets the same way). Deterministic.
//
// Runs can be long: in byte-level text the space is some 15 % of all tokens, a run of ~10,000
// at 65,536 tokens, which one thread per column would sum serially. So the sorted pairs are
// cut into segments of kEmbedSegment positions, one block per (segment, column chunk):
//   1. each segment sums its pieces of runs; a run wholly inside it goes straight into d_wte,
//      the piece of a run that began in an earlier segment into head[segment], the piece of a
//      run that begins here and goes on into tail[segment];
//   2. the segment where a crossing run begins adds its tail and the heads of the segments
//      the run covers, in order, and adds the sum into d_wte.
// No thread sums more than kEmbedSegment rows, plus one partial per segment a run spans.
// Scratch: 4 * T ints for the sort, 2 * ceil(T / kEmbedSegment) * M floats for the pieces.
__global__ void embedding_keys_kernel(const int* __restrict__ ids, i64 T, i64 V, i64 start,
                                      unsigned* __restrict__ keys, int* __restrict__ vals) {
  for (i64 t = grid_thread(); t < T; t += grid_threads()) {
    const i64 id = ids[t] - start;
    keys[t] = static_cast<unsigned>(id >= 0 && id < V ? id : V);  // V: unknown id or another shard's, skipped
    vals[t] = static_cast<int>(t);
  }
}

constexpr i64 kEmbedSegment = 256;

// Step 1. Grid (segments, column chunks); a thread is one column of one segment. The keys it
// reads are the same for the whole block.
template <class T_>
__global__ void embedding_backward_wte_pieces_kernel(const unsigned* __restrict__ keys, const int* __restrict__ vals,
                                                     const T_* __restrict__ d_out, T_* __restrict__ d_wte,
                                                     float* __restrict__ head, float* __restrict__ tail, i64 T, i64 M,
                                                     unsigned V) {
  const i64 c = static_cast<i64>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= M) return;
  const i64 g = blockIdx.x, lo = g * kEmbedSegment, hi = min(lo + kEmbedSegment, T);
  for (i64 j = lo; j < hi;) {
    const unsigned id = keys[j];
    float acc = 0.0f;
    i64 k = j;
    for (; k < hi && keys[k] == id; ++k) acc += ld(d_out + static_cast<i64>(vals[k]) * M + c);
    const bool began_before = j == lo && lo > 0 && keys[lo - 1] == id;
    const bool goes_on = k == hi && hi < T && keys[hi] == id;
    if (id < V) {
      if (began_before)
        head[g * M + c] = acc;
      else if (goes_on)
        tail[g * M + c] = acc;
      else {
        T_* dst = d_wte + static_cast<i64>(id) * M + c;
        st(dst, ld(dst) + acc);
      }
    }
    j = k;
  }
}

// Step 2. Grid (segments, column chunks): segment g works only if a run begins in it and goes
// on into segment g + 1 (uniform over the block).
template <class T_>
__global__ void embedding_backward_wte_runs_kernel(const unsigned* __restrict__ keys, T_* __restrict__ d_wte,
                                                   const float* __restrict__ head, const float* __restrict__ tail,
                                                   i64 T, i64 M, unsigned V) {
  const i64 g = blockIdx.x, lo = g * kEmbedSegment, hi = min(lo + kEmbedSegment, T);
  const unsigned id = keys[hi - 1];
  if (id >= V || hi >= T || keys[hi] != id) return;    // the last run of g ends in g
  if (lo > 0 && keys[lo] == id && keys[lo - 1] == id) return;  // it began before g: not g's to add
  const i64 c = static_cast<i64>(blockIdx.y) * blockDim.x + threadIdx.x;
  if (c >= M) return;
  float acc = tail[g * M + c];
  for (i64 h = g + 1;; ++h) {
    acc += head[h * M + c];
    const i64 h_hi = min((h + 1) * kEmbedSegment, T);
    if (h_hi >= T || keys[h_hi] != id) break;
  }
  T_* dst = d_wte + static_cast<i64>(id) * M + c;
  st(dst, ld(dst) + acc);
}

}  // namespace

void embedding_forward(cudaStream_t stream, Elem e, const std::int32_t* ids, const void* wte, const void* wpe,
                       void* out, std::int64_t tokens, std::int64_t width, std::int64_t seq_len, std::int64_t vocab,
                       std::int64_t vocab_start) {
  if (tokens <= 0 || width <= 0) return;
  with_elem(e, [&](auto tag) {
    using T_ = decltype(tag);
    embedding_forward_kernel<<<grid_for(tokens, 1), kElemThreads, 0, stream>>>(
        ids, static_cast<const T_*>(wte), static_cast<const T_*>(wpe), static_cast<T_*>(out), tokens, width, seq_len,
        vocab, vocab_start);
  });
  check_launch("embedding_forward kernel");
}

void embedding_backward(cudaStream_t stream, Elem e, const void* d_out, const std::int32_t* ids, void* d_wte,
                        void* d_wpe, std::int64_t tokens, std::int64_t width, std::int64_t seq_len,
                        std::int64_t vocab, std::int64_t vocab_start) {
  if (tokens <= 0 || width <= 0) return;
  if (d_wpe) {
    with_elem(e, [&](auto tag) {
      using T_ = decltype(tag);
      embedding_backward_wpe_kernel<<<grid_for(seq_len * width, kElemThreads), kElemThreads, 0, stream>>>(
          static_cast<const T_*>(d_out), static_cast<T_*>(d_wpe), tokens / seq_len, seq_len, width);
    });
    check_launch("embedding_backward (positions) kernel");
  }
  if (!d_wte) return;

  int end_bit = 1;
  while ((1LL << end_bit) <= vocab) ++end_bit;  // keys are <= V
  const int n = static_cast<int>(tokens);
  std::size_t sort_tmp = 0;
  check(cub::DeviceRadixSort::SortPairs(nullptr, sort_tmp, static_cast<const unsigned*>(nullptr),
                                        static_cast<unsigned*>(nullptr), static_cast<const int*>(nullptr),
                                        static_cast<int*>(nullptr), n, 0, end_bit, stream),
        "cub::DeviceRadixSort (size query)");
  const std::size_t b_pairs = align_up(sizeof(unsigned) * static_cast<std::size_t>(tokens));
  const i64 segments = (tokens + kEmbedSegment - 1) / kEmbedSegment;
  const std::size_t b_pieces = align_up(sizeof(float) * static_cast<std::size_t>(segments * width));
  Workspace ws(4 * b_pairs + 2 * b_pieces + align_up(sort_tmp), stream);
  auto* keys_in = reinterpret_cast<unsigned*>(ws.get());
  auto* keys_out = reinterpret_cast<unsigned*>(ws.get() + b_pairs);
  auto* vals_in = reinterpret_cast<int*>(ws.get() + 2 * b_pairs);
  auto* vals_out = reinterpret_cast<int*>(ws.get() + 3 * b_pairs);
  auto* head = reinterpret_cast<float*>(ws.get() + 4 * b_pairs);
  auto* tail = reinterpret_cast<float*>(ws.get() + 4 * b_pairs + b_pieces);
  void* cub_tmp = ws.get() + 4 * b_pairs + 2 * b_pieces;

  embedding_keys_kernel<<<grid_for(tokens, kElemThreads), kElemThreads, 0, stream>>>(ids, tokens, vocab, vocab_start,
                                                                                       keys_in, vals_in);
  check_launch("embedding key kernel");
  check(cub::DeviceRadixSort::SortPairs(cub_tmp, sort_tmp, static_cast<const unsigned*>(keys_in), keys_out,
                                        static_cast<const int*>(vals_in), vals_out, n, 0, end_bit, stream),
        "cub::DeviceRadixSort");
  const dim3 grid(static_cast<unsigned>(segments), static_cast<unsigned>((width + kElemThreads - 1) / kElemThreads));
  with_elem(e, [&](auto tag) {
    using T_ = decltype(tag);
    embedding_backward_wte_pieces_kernel<<<grid, kElemThreads, 0, stream>>>(
        keys_out, vals_out, static_cast<const T_*>(d_out), static_cast<T_*>(d_wte), head, tail, tokens, width,
        static_cast<unsigned>(vocab));
    check_launch("embedding_backward (token pieces) kernel");
    if (segments > 1)
      embedding_backward_wte_runs_kernel<<<grid, kElemThreads, 0, stream>>>(keys_out, static_cast<T_*>(d_wte), head,
                                                                           tail, tokens, width,
                                                                           static_cast<unsigned>(vocab));
  });
  check_launch("embedding_backward (token runs) kernel");
}

// ==== layernorm / rmsnorm =================================================================
// One warp per row: the row's statistics are two warp reductions (mean, then the centred
// sum of squares: two passes over a row that sits in L1, and no cancellation as with
// E[x^2] - E[x]^2); rmsnorm is the same code with the mean held at 0.
namespace {

template <class T_>
__global__ void norm_forward_kernel(bool rms, float eps, const T_* x, const T_* __restrict__ gamma,
                                    const T_* __restrict__ beta, T_* y, float* __restrict__ mean,
                                    float* __restrict__ rstd, i64 T, i64 M) {
  const int lane = threadIdx.x % kWarp;
  const float inv_m = 1.0f / static_cast<float>(M);
  for (i64 t = grid_warp(); t < T; t += grid_warps()) {
    const T_* xr = x + t * M;
    float mu = 0.0f;
    if (!rms) {
      float s = 0.0f;
      for (i64 c = lane; c < M; c += kWarp) s += ld(xr + c);
      mu = warp_sum(s) * inv_m;
    }
    float ss = 0.0f;
    for (i64 c = lane; c < M; c += kWarp) {
      const float d = ld(xr + c) - mu;
      ss += d * d;
    }
    const float r = 1.0f / sqrtf(warp_sum(ss) * inv_m + eps);
    // Each lane writes only the columns it read: y may alias x.
    for (i64 c = lane; c < M; c += kWarp) {
      float v = (ld(xr + c) - mu) * r * ld(gamma + c);
      if (beta) v += ld(beta + c);
      st(y + t * M + c, v);
    }
    if (lane == 0) {
      if (mean) mean[t] = mu;
      rstd[t] = r;
    }
  }
}

// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * gamma, xhat the normalised
// x (rmsnorm: without the mean(g) term). One warp per row.
template <class T_>
__global__ void norm_backward_dx_kernel(bool rms, const T_* __restrict__ x, const T_* __restrict__ gamma,
                                        const float* __restrict__ mean, const float* __restrict__ rstd,
                                        const T_* dy, T_* dx, i64 T, i64 M) {
  const int lane = threadIdx.x % kWarp;
  const float inv_m = 1.0f / static_cast<float>(M);
  for (i64 t = grid_warp(); t < T; t += grid_warps()) {
    const T_* xr = x + t * M;
    const T_* dyr = dy + t * M;
    const float mu = rms ? 0.0f : mean[t], r = rstd[t];
    float sum_g = 0.0f, sum_gx = 0.0f;
    for (i64 c = lane; c < M; c += kWarp) {
      const float g = ld(dyr + c) * ld(gamma + c);
      sum_g += g;
      sum_gx += g * (ld(xr + c) - mu) * r;
    }
    const float mean_g = rms ? 0.0f : warp_sum(sum_g) * inv_m;
    const float mean_gx = warp_sum(sum_gx) * inv_m;
    for (i64 c = lane; c < M; c += kWarp) {  // dx may alias dy: each lane reads its column before writing it
      const float xhat = (ld(xr + c) - mu) * r;
      const float g = ld(dyr + c) * ld(gamma + c);
      st(dx + t * M + c, r * (g - mean_g - xhat * mean_gx));
    }
  }
}

// d_gamma and d_beta are column sums over all T rows, in two deterministic stages (no
// atomics): stage 1, block (column chunk of 32, row group) writes fp32 partial sums of its
// group's rows; stage 2 sums the groups' partials per column and adds the total into the
// parameter gradients once (they may be bf16: a running bf16 sum would lose the small
// terms).
constexpr int kColX = 32, kColY = 8;
template <class T_>
__global__ void norm_backward_params_partial_kernel(bool rms, const T_* __restrict__ x, const float* __restrict__ mean,
                                                    const float* __restrict__ rstd, const T_* __restrict__ dy, i64 T,
                                                    i64 M, i64 rows_per_group, float* __restrict__ part_gamma,
                                                    float* __restrict__ part_beta) {
  __shared__ float sh_g[kColY][kColX + 1], sh_b[kColY][kColX + 1];
  const i64 c = static_cast<i64>(blockIdx.x) * kColX + threadIdx.x;
  const i64 r0 = static_cast<i64>(blockIdx.y) * rows_per_group;
  const i64 r1 = min(T, r0 + rows_per_group);
  float g = 0.0f, b = 0.0f;
  if (c < M)
    for (i64 t = r0 + threadIdx.y; t < r1; t += kColY) {
      const float d = ld(dy + t * M + c);
      g += d * (ld(x + t * M + c) - (rms ? 0.0f : mean[t])) * rstd[t];
      b += d;
    }
  sh_g[threadIdx.y][threadIdx.x] = g;
  sh_b[threadIdx.y][threadIdx.x] = b;
  __syncthreads();
  if (threadIdx.y == 0 && c < M) {
    for (int y = 1; y < kColY; ++y) {
      g += sh_g[y][threadIdx.x];
      b += sh_b[y][threadIdx.x];
    }
    part_gamma[blockIdx.y * M + c] = g;
    part_beta[blockIdx.y * M + c] = b;
  }
}

template <class T_>
__global__ void norm_backward_params_final_kernel(const float* __restrict__ part_gamma,
                                                  const float* __restrict__ part_beta, int groups, i64 M,
                                                  T_* __restrict__ d_gamma, T_* __restrict__ d_beta) {
  for (i64 c = grid_thread(); c < M; c += grid_threads()) {
    float g = 0.0f, b = 0.0f;
    for (int k = 0; k < groups; ++k) {
      g += part_gamma[k * M + c];
      b += part_beta[k * M + c];
    }
    if (d_gamma) st(d_gamma + c, ld(d_gamma + c) + g);
    if (d_beta) st(d_beta + c, ld(d_beta + c) + b);
  }
}

}  // namespace

void norm_forward(cudaStream_t stream, Elem e, bool rms, float eps, const void* x, const void* gamma,
                  const void* beta, void* y, float* mean, float* rstd, std::int64_t tokens, std::int64_t width) {
  if (tokens <= 0) return;
  with_elem(e, [&](auto tag) {
    using T_ = decltype(tag);
    norm_forward_kernel<<<grid_for(tokens, kRowWarpsPerBlock), kRowWarpsPerBlock * kWarp, 0, stream>>>(
        rms, eps, static_cast<const T_*>(x), static_cast<const T_*>(gamma), static_cast<const T_*>(beta),
        static_cast<T_*>(y), rms ? nullptr : mean, rstd, tokens, width);
  });
  check_launch("norm_forward kernel");
}

void norm_backward(cudaStream_t stream, Elem e, bool rms, const void* x, const void* gamma, const float* mean,
                   const float* rstd, const void* dy, void* dx, void* d_gamma, void* d_beta, std::int64_t tokens,
                   std::int64_t width) {
  if (tokens <= 0 || width <= 0) return;
  if (rms) d_beta = nullptr;  // rmsnorm has no shift
  // The parameter gradients first: they read dy, which dx may alias (as on the cpu backend).
  if (d_gamma || d_beta) {
    // About 64 rows per group, at most 128 groups: enough blocks to fill the device, and the
    // partials (2 * groups * M floats) stay small next to x.
    const i64 groups = std::min<i64>(128, (tokens + 63) / 64);
    const i64 rows_per_group = (tokens + groups - 1) / groups;
    const std::size_t b_part = align_up(sizeof(float) * static_cast<std::size_t>(groups * width));
    Workspace ws(2 * b_part, stream);  // freed stream-ordered, after its two kernels
    auto* part_gamma = reinterpret_cast<float*>(ws.get());
    auto* part_beta = reinterpret_cast<float*>(ws.get() + b_part);
    const dim3 grid(static_cast<unsigned>((width + kColX - 1) / kColX), static_cast<unsigned>(groups));
    with_elem(e, [&](auto tag) {
      using T_ = decltype(tag);
      norm_backward_params_partial_kernel<<<grid, dim3(kColX, kColY), 0, stream>>>(
          rms, static_cast<const T_*>(x), mean, rstd, static_cast<const T_*>(dy), tokens, width, rows_per_group,
          part_gamma, part_beta);
      check_launch("norm_backward (parameter partials) kernel");
      norm_backward_params_final_kernel<<<grid_for(width, kElemThreads), kElemThreads, 0, stream>>>(
          part_gamma, part_beta, static_cast<int>(groups), width, static_cast<T_*>(d_gamma), static_cast<T_*>(d_beta));
    });
    check_launch("norm_backward (parameters) kernel");
  }
  with_elem(e, [&](auto tag) {
    using T_ = decltype(tag);
    norm_backward_dx_kernel<<<grid_for(tokens, kRowWarpsPerBlock), kRowWarpsPerBlock * kWarp, 0, stream>>>(
        rms, static_cast<const T_*>(x), static_cast<const T_*>(gamma), mean, rstd, static_cast<const T_*>(dy),
        static_cast<T_*>(dx), tokens, width);
  });
  check_launch("norm_backward (input) kernel");
}

// ==== rotary position embedding ===========================================================
// One thread per (token, pair i): the angle depends on the position and i only, so its sine
// and cosine are computed once (in double: angles reach S radians, where fp32 would keep
// only ~3 digits of the phase) and applied to every query and key head of the token.
namespace {

template <class T_>
__global__ void rope_kernel(T_* qkv, i64 T, i64 S, int heads, int D, i64 width, double theta, bool inverse) {
  const int half = D / 2;
  for (i64 k = grid_thread(); k < T * half; k += grid_threads()) {
    const i64 t = k / half;
    const int i = static_cast<int>(k - t * half);
    const double angle = static_cast<double>(t % S) * pow(theta, -2.0 * i / D);
    double sd, cd;
    sincos(angle, &sd, &cd);
    const float sn = static_cast<float>(inverse ? -sd : sd), cs = static_cast<float>(cd);
    T_* row = qkv + t * width;
    for (int h = 0; h < heads; ++h) {  // the Hq query heads, then the Hkv key heads
      T_* x = row + static_cast<i64>(h) * D;
      const float x1 = ld(x + i), x2 = ld(x + i + half);
      st(x + i, x1 * cs - x2 * sn);
      st(x + i + half, x2 * cs + x1 * sn);
    }
  }
}

}  // namespace

void rope(cudaStream_t stream, Elem e, const AttentionShape& a, float theta, bool inverse, void* qkv) {
  const i64 T = a.batch * a.seq;
  const int half = a.head_dim / 2;
  if (T <= 0 || half <= 0) return;
  const i64 width = static_cast<i64>(a.heads + 2 * a.kv_heads) * a.head_dim;
  with_elem(e, [&](auto tag) {
    using T_ = decltype(tag);
    rope_kernel<<<grid_for(T * half, kElemThreads), kElemThreads, 0, stream>>>(
        static_cast<T_*>(qkv), T, a.seq, a.heads + a.kv_heads, a.head_dim, width, static_cast<double>(theta),
        inverse);
  });
  check_launch("rope kernel");
}

// ==== attention ===========================================================================
// Notation (per sequence b and query head h; g = h / (Hq/Hkv) its key/value head):
//   Q, K, V [S,D] read straight from the packed qkv rows; s_ij = q_i . k_j / sqrt(D);
//   P = softmax_j(s) (causal: j <= i); O = P V; lse_i = log sum_j exp(s_ij).
// The work is cut in tiles of kBr query rows and kBc key rows held in shared memory as fp32
// (converted once on load), with a row pitch of D + 1 floats so that 32 lanes reading 32
// different rows at the same column hit 32 different banks.
//
// Thread layout, the same in all three kernels: 8 warps; each warp owns 4 rows of the tile
// its block is responsible for (query rows in the forward and the dQ kernel, key rows in the
// dK/dV kernel), and within a warp lane j stands for row j of the *other* tile. So a score
// s_ij is one lane's dot product of length D; a softmax statistic over the 32 keys of a tile
// is a warp reduction; and a product with the other tile (P V, dS K, P^T dO, dS^T Q) is a
// loop over the 32 lanes' values broadcast by shuffles, lane l accumulating output columns
// l, l+32, l+64, l+96 (D <= 128) in registers.
namespace {

constexpr int kBr = 32;  // query rows per tile
constexpr int kBc = 32;  // key rows per tile (= warp size: lane j holds key j of the tile)
constexpr int kAttnWarps = 8;
constexpr int kAttnThreads = kAttnWarps * kWarp;
constexpr int kRowsPerWarp = kBr / kAttnWarps;  // also kBc / kAttnWarps in the dK/dV kernel
constexpr int kDChunks = kMaxHeadDim / kWarp;   // output columns per lane
static_assert(kBc == kWarp && kBr == kBc, "one lane per row of the other tile");

struct AttnParams {
  i64 S;
  int Hq, Hkv, D;
  bool causal;
  float scale;  // 1/sqrt(D)
  __device__ i64 qkv_width() const { return static_cast<i64>(Hq + 2 * Hkv) * D; }
  __device__ i64 out_width() const { return static_cast<i64>(Hq) * D; }
};

// rows [row0, row0 + n) of sequence b, columns [col, col + D) of a [B*S, width] tensor, into
// a [n, pitch] fp32 tile; rows at or past S are zero (they are masked, and zeros keep 0 * x
// from meeting garbage NaNs).
template <class T_>
__device__ void load_tile(float* tile, int pitch, const T_* src, i64 width, i64 b, i64 S, i64 row0, int n, i64 col,
                          int D) {
  for (int k = threadIdx.x; k < n * D; k += blockDim.x) {
    const int r = k / D, d = k - r * D;
    const i64 pos = row0 + r;
    tile[r * pitch + d] = pos < S ? ld(src + (b * S + pos) * width + col + d) : 0.0f;
  }
}

__device__ __forceinline__ float dot(const float* a, const float* b, int D) {
  float s = 0.0f;
#pragma unroll 8
  for (int d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

// acc[c] += x_lane' * tile[lane'][lane + 32c] summed over the 32 lanes' x (broadcast by
// shuffle): the product of one warp-row of weights with a 32-row tile.
__device__ __forceinline__ void accumulate_rows(float (&acc)[kDChunks], float x, const float* tile, int pitch, int D,
                                                int lane) {
#pragma unroll 4
  for (int j = 0; j < kWarp; ++j) {
    const float xj = __shfl_sync(0xffffffffu, x, j);
#pragma unroll
    for (int c = 0; c < kDChunks; ++c) {
      const int d = lane + c * kWarp;
      if (d < D) acc[c] += xj * tile[j * pitch + d];
    }
  }
}

std::size_t attention_smem_bytes(int tiles, int D) {
  return sizeof(float) * (static_cast<std::size_t>(tiles) * kBr * (D + 1) + 2 * kBr);
}

// Above 48 KiB of dynamic shared memory a kernel must opt in (D = 128 needs 49.5 KiB in the
// forward, 66 KiB in the backward; every GPU from sm_80 on allows 99 KiB or more).
template <class K>
void allow_smem(K* kernel, std::size_t bytes) {
  if (bytes > 48 * 1024)
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
          "cudaFuncSetAttribute (attention shared memory)");
}

// Where a block works and who a thread is: the first row of the block's tile, the sequence,
// the block's head (a query head in the forward and dQ kernels, a kv head in dK/dV), the
// warp and the lane. The warp's rr-th row of the tile is row(rr).
struct TileBlock {
  i64 row0, b;
  int head, warp, lane;
  __device__ explicit TileBlock(int tile_rows)
      : row0(static_cast<i64>(blockIdx.x) * tile_rows),
        b(blockIdx.z),
        head(static_cast<int>(blockIdx.y)),
        warp(static_cast<int>(threadIdx.x) / kWarp),
        lane(static_cast<int>(threadIdx.x) % kWarp) {}
  __device__ int tile_row(int rr) const { return warp * kRowsPerWarp + rr; }
  __device__ i64 row(int rr) const { return row0 + tile_row(rr); }
};

// The K and V tile starting at key k0, of kv head g.
template <class T_>
__device__ void load_kv(float* k_s, float* v_s, int pitch, const T_* qkv, const AttnParams& p, i64 b, i64 k0, int g) {
  load_tile(k_s, pitch, qkv, p.qkv_width(), b, p.S, k0, kBc, static_cast<i64>(p.Hq + g) * p.D, p.D);
  load_tile(v_s, pitch, qkv, p.qkv_width(), b, p.S, k0, kBc, static_cast<i64>(p.Hq + p.Hkv + g) * p.D, p.D);
}

// The keys a query tile starting at q0 sees: causal, its last row q0 + kBr - 1 sees keys up
// to itself, and later key tiles are skipped whole (the halved FLOPs of the cost functions).
__device__ __forceinline__ i64 keys_end(const AttnParams& p, i64 q0) { return p.causal ? min(p.S, q0 + kBr) : p.S; }

__device__ __forceinline__ void zero(float (&acc)[kRowsPerWarp][kDChunks]) {
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr)
#pragma unroll
    for (int c = 0; c < kDChunks; ++c) acc[rr][c] = 0.0f;
}

// dst[d] = factor * acc for this lane's columns d = lane + 32c.
template <class T_>
__device__ __forceinline__ void store_row(T_* dst, const float (&acc)[kDChunks], float factor, int D, int lane) {
#pragma unroll
  for (int c = 0; c < kDChunks; ++c) {
    const int d = lane + c * kWarp;
    if (d < D) st(dst + d, acc[c] * factor);
  }
}

// ---- forward: one block per (query tile, query head, sequence) --------------------------
// FlashAttention's online softmax (Dao et al. 2022, Alg. 1) per query row: over the key
// tiles, keep the running max m and the running sum l of exp(s - m), rescale the output
// accumulator by exp(m_old - m_new) whenever the max grows, divide by l at the end.
template <class T_>
__global__ void __launch_bounds__(kAttnThreads) attention_forward_kernel(const T_* __restrict__ qkv,
                                                                         T_* __restrict__ out,
                                                                         float* __restrict__ lse, AttnParams p) {
  extern __shared__ float smem[];
  const int D = p.D, pitch = D + 1;
  float* q_s = smem;               // [kBr, pitch]
  float* k_s = q_s + kBr * pitch;  // [kBc, pitch]
  float* v_s = k_s + kBc * pitch;  // [kBc, pitch]
  const TileBlock blk(kBr);
  const int h = blk.head, g = h / (p.Hq / p.Hkv), lane = blk.lane;

  load_tile(q_s, pitch, qkv, p.qkv_width(), blk.b, p.S, blk.row0, kBr, static_cast<i64>(h) * D, D);
  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kDChunks];
  zero(acc);
#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    m[rr] = -INFINITY;
    l[rr] = 0.0f;
  }

  for (i64 k0 = 0; k0 < keys_end(p, blk.row0); k0 += kBc) {
    __syncthreads();  // the previous K/V tile is consumed (and, the first time, q_s is loaded)
    load_kv(k_s, v_s, pitch, qkv, p, blk.b, k0, g);
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int r = blk.tile_row(rr);
      const i64 i = blk.row(rr), j = k0 + lane;
      if (i >= p.S) continue;  // the whole warp skips together: no shuffle is left waiting
      const bool visible = j < p.S && (!p.causal || j <= i);
      const float s = visible ? dot(q_s + r * pitch, k_s + lane * pitch, D) * p.scale : -INFINITY;
      const float m_new = fmaxf(m[rr], warp_max(s));
      // Key 0 is visible to every row, so m_new is finite from the first tile on; the guard
      // keeps a fully masked row at l = 0 instead of NaN.
      const float base = m_new == -INFINITY ? 0.0f : m_new;
      const float pj = visible ? expf(s - base) : 0.0f;
      const float corr = expf(m[rr] - base);  // 0 on the first tile (m = -inf)
      l[rr] = l[rr] * corr + warp_sum(pj);
#pragma unroll
      for (int c = 0; c < kDChunks; ++c) acc[rr][c] *= corr;
      accumulate_rows(acc[rr], pj, v_s, pitch, D, lane);
      m[rr] = m_new;
    }
  }

#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const i64 i = blk.row(rr);
    if (i >= p.S) continue;
    store_row(out + (blk.b * p.S + i) * p.out_width() + static_cast<i64>(h) * D, acc[rr],
              l[rr] > 0.0f ? 1.0f / l[rr] : 0.0f, D, lane);
    if (lane == 0) lse[(blk.b * p.Hq + h) * p.S + i] = m[rr] + logf(l[rr]);
  }
}

// ---- backward (FlashAttention-2, Dao 2023, Alg. 2) --------------------------------------
// With P recomputed from the saved lse (p_ij = exp(s_ij - lse_i)) and dP = dO V^T:
//   dV = P^T dO,   dS = P o (dP - D) with D_i = rowsum(dO_i o O_i),
//   dK = dS^T Q / sqrt(D),   dQ = dS K / sqrt(D).
// dK and dV of a key tile are sums over query rows, dQ of a query tile a sum over key rows.
// FlashAttention-2 runs one pass over key tiles and adds dQ with fp32 atomics into a
// [T, Hq*D] scratch. Here, for clarity, there are two passes that each own what they write:
//   1. attention_dkv_kernel: one block per (key tile, kv head, sequence) loops over the
//      query heads of its group and the query tiles that see the key tile, accumulating
//      dK, dV in registers (GQA: the group's heads sum into one kv head, no atomics);
//   2. attention_dq_kernel: one block per (query tile, query head, sequence), the mirror of
//      the forward, accumulating dQ over the key tiles.
// Cost of the choice: S = QK^T and dP = dO V^T are computed in both passes, 7 tile products
// instead of 5 (1.4x the backward's FLOPs), for deterministic gradients, no scratch and no
// atomics. D_i comes from a small preprocessing kernel first (as in FlashAttention-2).

// One warp per (token, query head) row of out and d_out [T, Hq*D]: D_i = sum_d dO[i,d] O[i,d].
template <class T_>
__global__ void attention_rowdot_kernel(const T_* __restrict__ out, const T_* __restrict__ d_out,
                                        float* __restrict__ dsum, i64 T, i64 S, int Hq, int D) {
  const int lane = threadIdx.x % kWarp;
  for (i64 row = grid_warp(); row < T * Hq; row += grid_warps()) {  // row = t*Hq + h
    float s = 0.0f;
    for (int d = lane; d < D; d += kWarp) s += ld(out + row * D + d) * ld(d_out + row * D + d);
    s = warp_sum(s);
    const i64 t = row / Hq, b = t / S, i = t - b * S;
    const int h = static_cast<int>(row - t * Hq);
    if (lane == 0) dsum[(b * Hq + h) * S + i] = s;
  }
}

// What both backward kernels read and write.
template <class T_>
struct AttnGrad {
  const T_* qkv;      // [T, (Hq+2Hkv)*D]
  const float* lse;   // [B, Hq, S]
  const float* dsum;  // [B, Hq, S]: D_i
  const T_* d_out;    // [T, Hq*D]
  T_* d_qkv;          // [T, (Hq+2Hkv)*D]
};

// The query tile and the dO tile starting at row q0, of query head h.
template <class T_>
__device__ void load_q_do(float* q_s, float* do_s, int pitch, const AttnGrad<T_>& a, const AttnParams& p, i64 b, i64 q0,
                          int h) {
  load_tile(q_s, pitch, a.qkv, p.qkv_width(), b, p.S, q0, kBr, static_cast<i64>(h) * p.D, p.D);
  load_tile(do_s, pitch, a.d_out, p.out_width(), b, p.S, q0, kBr, static_cast<i64>(h) * p.D, p.D);
}

// For one (query i, key j): p_ij = exp(q_i . k_j / sqrt(D) - lse_i) and
// ds_ij = p_ij (dO_i . v_j - D_i).
struct ProbGrad {
  float p, ds;
};
__device__ __forceinline__ ProbGrad prob_and_grad(const float* q, const float* k, const float* d_o, const float* v,
                                                  float lse, float dsum, const AttnParams& p) {
  const float pij = expf(dot(q, k, p.D) * p.scale - lse);
  return {pij, pij * (dot(d_o, v, p.D) - dsum)};
}

template <class T_>
__global__ void __launch_bounds__(kAttnThreads) attention_dq_kernel(AttnGrad<T_> a, AttnParams p) {
  extern __shared__ float smem[];
  const int D = p.D, pitch = D + 1;
  float* q_s = smem;                 // [kBr, pitch]
  float* do_s = q_s + kBr * pitch;   // [kBr, pitch]
  float* k_s = do_s + kBr * pitch;   // [kBc, pitch]
  float* v_s = k_s + kBc * pitch;    // [kBc, pitch]
  const TileBlock blk(kBr);
  const int h = blk.head, g = h / (p.Hq / p.Hkv), lane = blk.lane;
  const float* lse_h = a.lse + (blk.b * p.Hq + h) * p.S;
  const float* dsum_h = a.dsum + (blk.b * p.Hq + h) * p.S;

  load_q_do(q_s, do_s, pitch, a, p, blk.b, blk.row0, h);
  float acc[kRowsPerWarp][kDChunks];
  zero(acc);

  for (i64 k0 = 0; k0 < keys_end(p, blk.row0); k0 += kBc) {
    __syncthreads();  // the previous K/V tile is consumed (and, the first time, Q/dO are loaded)
    load_kv(k_s, v_s, pitch, a.qkv, p, blk.b, k0, g);
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < kRowsPerWarp; ++rr) {
      const int r = blk.tile_row(rr);
      const i64 i = blk.row(rr), j = k0 + lane;  // lane: key row j
      if (i >= p.S) continue;  // warp-uniform
      const bool visible = j < p.S && (!p.causal || j <= i);
      const float ds = visible ? prob_and_grad(q_s + r * pitch, k_s + lane * pitch, do_s + r * pitch,
                                               v_s + lane * pitch, lse_h[i], dsum_h[i], p).ds
                               : 0.0f;
      accumulate_rows(acc[rr], ds, k_s, pitch, D, lane);  // dQ_i += sum_j ds_ij K_j
    }
  }

#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const i64 i = blk.row(rr);
    if (i < p.S)
      store_row(a.d_qkv + (blk.b * p.S + i) * p.qkv_width() + static_cast<i64>(h) * D, acc[rr], p.scale, D, lane);
  }
}

template <class T_>
__global__ void __launch_bounds__(kAttnThreads) attention_dkv_kernel(AttnGrad<T_> a, AttnParams p) {
  extern __shared__ float smem[];
  const int D = p.D, pitch = D + 1;
  float* k_s = smem;                   // [kBc, pitch]
  float* v_s = k_s + kBc * pitch;      // [kBc, pitch]
  float* q_s = v_s + kBc * pitch;      // [kBr, pitch]
  float* do_s = q_s + kBr * pitch;     // [kBr, pitch]
  float* lse_s = do_s + kBr * pitch;   // [kBr]
  float* dsum_s = lse_s + kBr;         // [kBr]
  const TileBlock blk(kBc);
  const int g = blk.head, group = p.Hq / p.Hkv, lane = blk.lane;
  const i64 k0 = blk.row0;

  load_kv(k_s, v_s, pitch, a.qkv, p, blk.b, k0, g);
  float dk[kRowsPerWarp][kDChunks], dv[kRowsPerWarp][kDChunks];
  zero(dk);
  zero(dv);

  // Causal: query rows before k0 see none of this tile's keys.
  const i64 q_begin = p.causal ? k0 / kBr * kBr : 0;
  for (int h = g * group; h < (g + 1) * group; ++h) {
    const float* lse_h = a.lse + (blk.b * p.Hq + h) * p.S;
    const float* dsum_h = a.dsum + (blk.b * p.Hq + h) * p.S;
    for (i64 q0 = q_begin; q0 < p.S; q0 += kBr) {
      __syncthreads();  // the previous query tile is consumed (and, the first time, K/V are loaded)
      load_q_do(q_s, do_s, pitch, a, p, blk.b, q0, h);
      for (int r = threadIdx.x; r < kBr; r += blockDim.x) {
        lse_s[r] = q0 + r < p.S ? lse_h[q0 + r] : 0.0f;
        dsum_s[r] = q0 + r < p.S ? dsum_h[q0 + r] : 0.0f;
      }
      __syncthreads();
#pragma unroll
      for (int rr = 0; rr < kRowsPerWarp; ++rr) {
        const int r = blk.tile_row(rr);            // key row of the tile
        const i64 j = blk.row(rr), i = q0 + lane;  // lane: query row i
        if (j >= p.S) continue;  // warp-uniform
        const bool visible = i < p.S && (!p.causal || j <= i);
        const ProbGrad pg = visible ? prob_and_grad(q_s + lane * pitch, k_s + r * pitch, do_s + lane * pitch,
                                                    v_s + r * pitch, lse_s[lane], dsum_s[lane], p)
                                    : ProbGrad{0.0f, 0.0f};
        accumulate_rows(dv[rr], pg.p, do_s, pitch, D, lane);  // dV_j += sum_i p_ij dO_i
        accumulate_rows(dk[rr], pg.ds, q_s, pitch, D, lane);  // dK_j += sum_i ds_ij Q_i
      }
    }
  }

#pragma unroll
  for (int rr = 0; rr < kRowsPerWarp; ++rr) {
    const i64 j = blk.row(rr);
    if (j >= p.S) continue;
    T_* row = a.d_qkv + (blk.b * p.S + j) * p.qkv_width();
    store_row(row + static_cast<i64>(p.Hq + g) * D, dk[rr], p.scale, D, lane);
    store_row(row + static_cast<i64>(p.Hq + p.Hkv + g) * D, dv[rr], 1.0f, D, lane);
  }
}

AttnParams attn_params(const AttentionShape& a) {
  return AttnParams{a.seq, a.heads, a.kv_heads, a.head_dim, a.causal,
                    static_cast<float>(1.0 / std::sqrt(static_cast<double>(a.head_dim)))};
}

void check_attention_shape(const AttentionShape& a) {
  if (a.head_dim < 1 || a.head_dim > kMaxHeadDim || a.heads < 1 || a.kv_heads < 1 || a.heads % a.kv_heads != 0 ||
      a.batch > 65535 || a.heads > 65535)
    throw std::invalid_argument("attention kernel: unsupported shape (head_dim " + std::to_string(a.head_dim) +
                                ", heads " + std::to_string(a.heads) + "/" + std::to_string(a.kv_heads) +
                                ", batch " + std::to_string(a.batch) + ")");
}

}  // namespace

void attention_forward(cudaStream_t stream, Elem e, const AttentionShape& a, const void* qkv, void* out, float* lse) {
  check_attention_shape(a);
  if (a.batch <= 0 || a.seq <= 0) return;
  const AttnParams p = attn_params(a);
  const dim3 grid(static_cast<unsigned>((a.seq + kBr - 1) / kBr), static_cast<unsigned>(a.heads),
                  static_cast<unsigned>(a.batch));
  const std::size_t smem = attention_smem_bytes(3, a.head_dim);
  with_elem(e, [&](auto tag) {
    using T_ = decltype(tag);
    allow_smem(attention_forward_kernel<T_>, smem);
    attention_forward_kernel<T_><<<grid, kAttnThreads, smem, stream>>>(static_cast<const T_*>(qkv),
                                                                       static_cast<T_*>(out), lse, p);
  });
  check_launch("attention_forward kernel");
}

void attention_backward(cudaStream_t stream, Elem e, const AttentionShape& a, const void* qkv, const void* out,
                        const float* lse, const void* d_out, void* d_qkv) {
  check_attention_shape(a);
  if (a.batch <= 0 || a.seq <= 0) return;
  const AttnParams p = attn_params(a);
  const i64 T = a.batch * a.seq;

  Workspace ws(sizeof(float) * static_cast<std::size_t>(T * a.heads), stream);  // D_i, [B,Hq,S]
  auto* dsum = reinterpret_cast<float*>(ws.get());
  with_elem(e, [&](auto tag) {
    using T_ = decltype(tag);
    attention_rowdot_kernel<<<grid_for(T * a.heads, kRowWarpsPerBlock), kRowWarpsPerBlock * kWarp, 0, stream>>>(
        static_cast<const T_*>(out), static_cast<const T_*>(d_out), dsum, T, a.seq, a.heads, a.head_dim);
  });
  check_launch("attention_backward (rowsum dO*O) kernel");

  const std::size_t smem = attention_smem_bytes(4, a.head_dim);
  const dim3 grid_kv(static_cast<unsigned>((a.seq + kBc - 1) / kBc), static_cast<unsigned>(a.kv_heads),
                     static_cast<unsigned>(a.batch));
  const dim3 grid_q(static_cast<unsigned>((a.seq + kBr - 1) / kBr), static_cast<unsigned>(a.heads),
                    static_cast<unsigned>(a.batch));
  with_elem(e, [&](auto tag) {
    using T_ = decltype(tag);
    const AttnGrad<T_> args{static_cast<const T_*>(qkv), lse, dsum, static_cast<const T_*>(d_out),
                            static_cast<T_*>(d_qkv)};
    allow_smem(attention_dkv_kernel<T_>, smem);
    attention_dkv_kernel<T_><<<grid_kv, kAttnThreads, smem, stream>>>(args, p);
    check_launch("attention_backward (dK, dV) kernel");
    allow_smem(attention_dq_kernel<T_>, smem);
    attention_dq_kernel<T_><<<grid_q, kAttnThreads, smem, stream>>>(args, p);
  });
  check_launch("attention_backward (dQ) kernel");
}

// ==== SwiGLU and the residual add =========================================================
namespace {

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// out[t,f] = silu(h[t,f]) * h[t,F+f]
template <class T_>
__global__ void swiglu_forward_kernel(const T_* __restrict__ h, T_* __restrict__ out, i64 T, i64 F) {
  for (i64 k = grid_thread(); k < T * F; k += grid_threads()) {
    const i64 t = k / F, f = k - t * F;
    const float gate = ld(h + t * 2 * F + f), up = ld(h + t * 2 * F + F + f);
    st(out + k, gate * sigmoid(gate) * up);
  }
}

// d_gate = d_out * up * silu'(gate), silu'(x) = s(x) (1 + x (1 - s(x))); d_up = d_out * silu(gate).
// d_h may alias h: each thread reads its two inputs before writing them.
template <class T_>
__global__ void swiglu_backward_kernel(const T_* h, const T_* __restrict__ d_out, T_* d_h, i64 T, i64 F) {
  for (i64 k = grid_thread(); k < T * F; k += grid_threads()) {
    const i64 t = k / F, f = k - t * F;
    const i64 ig = t * 2 * F + f, iu = ig + F;
    const float gate = ld(h + ig), up = ld(h + iu), dy = ld(d_out + k);
    const float sg = sigmoid(gate);
    st(d_h + ig, dy * up * sg * (1.0f + gate * (1.0f - sg)));
    st(d_h + iu, dy * gate * sg);
  }
}

// out may alias a or b.
template <class T_>
__global__ void add_kernel(const T_* a, const T_* b, T_* out, i64 n) {
  for (i64 k = grid_thread(); k < n; k += grid_threads()) st(out + k, ld(a + k) + ld(b + k));
}

// out may alias x.
template <class T_>
__global__ void scale_kernel(const T_* x, float alpha, T_* out, i64 n) {
  for (i64 k = grid_thread(); k < n; k += grid_threads()) st(out + k, alpha * ld(x + k));
}

}  // namespace

void swiglu_forward(cudaStream_t stream, Elem e, const void* h, void* out, std::int64_t tokens, std::int64_t ffn) {
  if (tokens <= 0 || ffn <= 0) return;
  with_elem(e, [&](auto tag) {
    using T_ = decltype(tag);
    swiglu_forward_kernel<<<grid_for(tokens * ffn, kElemThreads), kElemThreads, 0, stream>>>(
        static_cast<const T_*>(h), static_cast<T_*>(out), tokens, ffn);
  });
  check_launch("swiglu_forward kernel");
}

void swiglu_backward(cudaStream_t stream, Elem e, const void* h, const void* d_out, void* d_h, std::int64_t tokens,
                     std::int64_t ffn) {
  if (tokens <= 0 || ffn <= 0) return;
  with_elem(e, [&](auto tag) {
    using T_ = decltype(tag);
    swiglu_backward_kernel<<<grid_for(tokens * ffn, kElemThreads), kElemThreads, 0, stream>>>(
        static_cast<const T_*>(h), static_cast<const T_*>(d_out), static_cast<T_*>(d_h), tokens, ffn);
  });
  check_launch("swiglu_backward kernel");
}

void add(cudaStream_t stream, Elem e, const void* a, const void* b, void* out, std::int64_t n) {
  if (n <= 0) return;
  with_elem(e, [&](auto tag) {
    using T_ = decltype(tag);
    add_kernel<<<grid_for(n, kElemThreads), kElemThreads, 0, stream>>>(static_cast<const T_*>(a),
                                                                       static_cast<const T_*>(b),
                                                                       static_cast<T_*>(out), n);
  });
  check_launch("add kernel");
}

void scale(cudaStream_t stream, Elem e, const void* x, float alpha, void* out, std::int64_t n) {
  if (n <= 0) return;
  with_elem(e, [&](auto tag) {
    using T_ = decltype(tag);
    scale_kernel<<<grid_for(n, kElemThreads), kElemThreads, 0, stream>>>(static_cast<const T_*>(x), alpha,
                                                                         static_cast<T_*>(out), n);
  });
  check_launch("scale kernel");
}

// ==== softmax cross-entropy ===============================================================
// One block per row. The forward is one pass over the logits with the online softmax's
// (max, sum) pair per thread (the same rescaling as in attention), merged across the block;
// the backward re-reads the row once with the saved lse.
namespace {

constexpr int kLossThreads = 512;

struct MaxSum {
  float m, s;  // running max, sum of exp(x - m)
};
__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  if (a.m == -INFINITY) return b;  // an empty side (also keeps -inf logits from making NaN)
  if (b.m == -INFINITY) return a;
  const float m = fmaxf(a.m, b.m);
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}
__device__ __forceinline__ MaxSum warp_merge(MaxSum v) {
  for (int off = kWarp / 2; off > 0; off /= 2)
    v = merge(v, {__shfl_xor_sync(0xffffffffu, v.m, off), __shfl_xor_sync(0xffffffffu, v.s, off)});
  return v;
}
// Every thread of the block gets the merged pair.
__device__ MaxSum block_merge(MaxSum v) {
  __shared__ MaxSum sh[kLossThreads / kWarp];
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  v = warp_merge(v);
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / kWarp) ? sh[lane] : MaxSum{-INFINITY, 0.0f};
  v = warp_merge(v);
  __syncthreads();  // sh is reused by the next row
  return v;
}

template <class T_>
__global__ void __launch_bounds__(kLossThreads) cross_entropy_forward_kernel(const T_* __restrict__ logits,
                                                                             const int* __restrict__ targets,
                                                                             float* __restrict__ losses,
                                                                             float* __restrict__ lse, i64 T, i64 V,
                                                                             i64 start, i64 total) {
  for (i64 t = blockIdx.x; t < T; t += gridDim.x) {
    const T_* row = logits + t * V;
    // The thread's own pass: one expf per logit (merge's two would make the kernel bound by
    // arithmetic at a large vocabulary); a -inf logit adds nothing, a NaN makes the sum NaN.
    MaxSum v{-INFINITY, 0.0f};
    for (i64 c = threadIdx.x; c < V; c += blockDim.x) {
      const float x = ld(row + c);
      if (x > v.m) {
        v.s = v.s * expf(v.m - x) + 1.0f;  // the first: 0 * expf(-inf) + 1
        v.m = x;
      } else if (x != -INFINITY) {
        v.s += expf(x - v.m);
      }
    }
    v = block_merge(v);
    if (threadIdx.x == 0) {
      const float row_lse = v.m + logf(v.s);
      const i64 y = targets[t], yl = y - start;
      lse[t] = row_lse;
      losses[t] = y < 0 ? 0.0f : y >= total ? NAN : (yl >= 0 && yl < V ? row_lse - ld(row + yl) : 0.0f);
    }
  }
}

// d_logits may alias logits: each element is read, then written, by one thread.
template <class T_>
__global__ void __launch_bounds__(kLossThreads) cross_entropy_backward_kernel(const T_* logits,
                                                                              const int* __restrict__ targets,
                                                                              const float* __restrict__ lse,
                                                                              float scale, T_* d_logits, i64 T,
                                                                              i64 V, i64 start, i64 total) {
  for (i64 t = blockIdx.x; t < T; t += gridDim.x) {
    const i64 y = targets[t], yl = y - start;  // yl outside [0, V): another shard's column
    const float row_lse = lse[t];
    for (i64 c = threadIdx.x; c < V; c += blockDim.x) {
      float d;
      if (y < 0)
        d = 0.0f;
      else if (y >= total)
        d = NAN;
      else
        d = scale * (expf(ld(logits + t * V + c) - row_lse) - (c == yl ? 1.0f : 0.0f));
      st(d_logits + t * V + c, d);
    }
  }
}

// One thread per token: lse = log sum_p exp(lse_p) (max first), the target's logit from its
// own shard as lse_o - loss_o.
__global__ void cross_entropy_combine_kernel(const float* __restrict__ parts, const int* __restrict__ targets,
                                             float* __restrict__ losses, float* __restrict__ lse, i64 T, i64 P,
                                             i64 rows) {
  for (i64 t = grid_thread(); t < T; t += grid_threads()) {
    float mx = -INFINITY;
    for (i64 p = 0; p < P; ++p) mx = fmaxf(mx, parts[(2 * p + 1) * T + t]);
    float sum = 0.0f;
    for (i64 p = 0; p < P; ++p) sum += expf(parts[(2 * p + 1) * T + t] - mx);
    const float row_lse = mx + logf(sum);
    const i64 y = targets[t];
    lse[t] = row_lse;
    if (y < 0) {
      losses[t] = 0.0f;
    } else if (y >= P * rows) {
      losses[t] = NAN;
    } else {
      const i64 o = y / rows;
      losses[t] = row_lse - (parts[(2 * o + 1) * T + t] - parts[2 * o * T + t]);
    }
  }
}

}  // namespace

void cross_entropy_forward(cudaStream_t stream, Elem e, const void* logits, const std::int32_t* targets,
                           float* losses, float* lse, std::int64_t tokens, std::int64_t vocab, std::int64_t vocab_start,
                           std::int64_t vocab_total) {
  if (tokens <= 0) return;
  with_elem(e, [&](auto tag) {
    using T_ = decltype(tag);
    cross_entropy_forward_kernel<<<grid_for(tokens, 1), kLossThreads, 0, stream>>>(
        static_cast<const T_*>(logits), targets, losses, lse, tokens, vocab, vocab_start, vocab_total);
  });
  check_launch("cross_entropy_forward kernel");
}

void cross_entropy_backward(cudaStream_t stream, Elem e, const void* logits, const std::int32_t* targets,
                            const float* lse, float scale, void* d_logits, std::int64_t tokens, std::int64_t vocab,
                            std::int64_t vocab_start, std::int64_t vocab_total) {
  if (tokens <= 0 || vocab <= 0) return;
  with_elem(e, [&](auto tag) {
    using T_ = decltype(tag);
    cross_entropy_backward_kernel<<<grid_for(tokens, 1), kLossThreads, 0, stream>>>(
        static_cast<const T_*>(logits), targets, lse, scale, static_cast<T_*>(d_logits), tokens, vocab, vocab_start,
        vocab_total);
  });
  check_launch("cross_entropy_backward kernel");
}

void cross_entropy_combine(cudaStream_t stream, const float* parts, const std::int32_t* targets, float* losses,
                           float* lse, std::int64_t tokens, std::int64_t shards, std::int64_t shard_rows) {
  if (tokens <= 0) return;
  cross_entropy_combine_kernel<<<grid_for(tokens, kElemThreads), kElemThreads, 0, stream>>>(
      parts, targets, losses, lse, tokens, shards, shard_rows);
  check_launch("cross_entropy_combine kernel");
}

// ==== optimizer step ======================================================================
// One thread per element: SGD or Adam/AdamW (backend.hpp, OptimizerStep) on the fp32 master
// weights (or the fp32 parameter itself), then the parameter written in its dtype. 16 to 28
// bytes per element moved (param, grad, master, m, v), a few FLOPs: memory bound.
namespace {

template <class P, class G>
__global__ void optimizer_kernel(OptimizerArgs o) {
  P* param = static_cast<P*>(o.param);
  const G* grad = static_cast<const G*>(o.grad);
  for (i64 k = grid_thread(); k < o.n; k += grid_threads()) {
    const float g = ld(grad + k);
    float w = o.master ? o.master[k] : ld(param + k);
    if (o.adam) {
      const float m = o.beta1 * o.m[k] + (1.0f - o.beta1) * g;
      const float v = o.beta2 * o.v[k] + (1.0f - o.beta2) * g * g;
      o.m[k] = m;
      o.v[k] = v;
      w -= o.lr * ((m / o.bias_correction1) / (sqrtf(v / o.bias_correction2) + o.eps) + o.weight_decay * w);
    } else {
      w -= o.lr * (g + o.weight_decay * w);
    }
    if (o.master) o.master[k] = w;
    st(param + k, w);
  }
}

}  // namespace

void optimizer_step(cudaStream_t stream, const OptimizerArgs& o) {
  if (o.n <= 0) return;
  const unsigned grid = grid_for(o.n, kElemThreads);
  with_elem(o.param_elem, [&](auto ptag) {
    with_elem(o.grad_elem, [&](auto gtag) {
      optimizer_kernel<decltype(ptag), decltype(gtag)><<<grid, kElemThreads, 0, stream>>>(o);
    });
  });
  check_launch("optimizer_step kernel");
}

}  // namespace moelab::cuda_kernels
