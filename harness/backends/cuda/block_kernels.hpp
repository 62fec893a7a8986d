// harness/backends/cuda/block_kernels.hpp — launchers for the transformer-block kernels of
// the cuda backend (block_kernels.cu): embedding, layernorm/rmsnorm, rotary embedding, tiled
// attention, SwiGLU, residual add, fused softmax cross-entropy, optimizer step.
//
// Plain C++ declarations (cuda_backend.cpp includes this with the host compiler). Every
// launcher is asynchronous on `stream` and throws std::runtime_error if a launch or a
// stream-ordered workspace allocation fails. Row data is fp32 or bf16 (Elem); every
// reduction accumulates in fp32. Shapes follow harness/runtime/backend.hpp: T = B*S tokens,
// M width, V vocabulary, Hq/Hkv query/key-value heads, D head_dim.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "harness/backends/cuda/kernels.hpp"
#include "harness/runtime/op_types.hpp"

namespace moelab::cuda_kernels {

// ---- embedding -------------------------------------------------------------------------
// out[t] = wte[ids[t] - start] (+ wpe[t mod S] when wpe != nullptr): wte holds the V rows
// [start, start + V) of the vocabulary (a vocabulary-parallel shard; start 0: the whole
// table). An id outside them gives a row of zeros (nothing is read out of bounds). wte, wpe
// and out share the element type.
void embedding_forward(cudaStream_t stream, Elem e, const std::int32_t* ids, const void* wte, const void* wpe,
                       void* out, std::int64_t tokens, std::int64_t width, std::int64_t seq_len, std::int64_t vocab,
                       std::int64_t vocab_start);
// d_wte[ids[t] - start] += d_out[t]; d_wpe[p] += sum over t with t mod S = p of d_out[t] (when
// d_wpe != nullptr). Ids outside [start, start + V) contribute nothing to d_wte.
void embedding_backward(cudaStream_t stream, Elem e, const void* d_out, const std::int32_t* ids, void* d_wte,
                        void* d_wpe, std::int64_t tokens, std::int64_t width, std::int64_t seq_len,
                        std::int64_t vocab, std::int64_t vocab_start);

// ---- norms -----------------------------------------------------------------------------
// layernorm (rms = false): y = (x - mean) * rstd * gamma + beta (beta may be null);
// rmsnorm (rms = true): y = x * rstd * gamma. mean (layernorm only, else may be null) and
// rstd are fp32 [T]. x, y, gamma, beta share the element type.
void norm_forward(cudaStream_t stream, Elem e, bool rms, float eps, const void* x, const void* gamma,
                  const void* beta, void* y, float* mean, float* rstd, std::int64_t tokens, std::int64_t width);
// dx (overwritten); d_gamma += sum_t dy * xhat; d_beta += sum_t dy (each when non-null).
void norm_backward(cudaStream_t stream, Elem e, bool rms, const void* x, const void* gamma, const float* mean,
                   const float* rstd, const void* dy, void* dx, void* d_gamma, void* d_beta, std::int64_t tokens,
                   std::int64_t width);

// ---- attention -------------------------------------------------------------------------
constexpr int kMaxHeadDim = 128;

// In place on the query and key heads of qkv [T,(Hq+2Hkv)*D]; pairs (i, i + D/2), angle
// (t mod S) * theta^(-2i/D); inverse rotates by the negative angle. D even.
void rope(cudaStream_t stream, Elem e, const AttentionShape& a, float theta, bool inverse, void* qkv);

// out [T,Hq*D], lse [B,Hq,S] fp32 from qkv [T,(Hq+2Hkv)*D]. D <= kMaxHeadDim.
void attention_forward(cudaStream_t stream, Elem e, const AttentionShape& a, const void* qkv, void* out, float* lse);
// d_qkv [T,(Hq+2Hkv)*D] (overwritten) from d_out [T,Hq*D].
void attention_backward(cudaStream_t stream, Elem e, const AttentionShape& a, const void* qkv, const void* out,
                        const float* lse, const void* d_out, void* d_qkv);

// ---- elementwise -----------------------------------------------------------------------
// h [T,2F] = [gate | up] -> out [T,F] = silu(gate) * up; d_h [T,2F] (overwritten).
void swiglu_forward(cudaStream_t stream, Elem e, const void* h, void* out, std::int64_t tokens, std::int64_t ffn);
void swiglu_backward(cudaStream_t stream, Elem e, const void* h, const void* d_out, void* d_h, std::int64_t tokens,
                     std::int64_t ffn);
// out = a + b, n elements; out may alias a or b.
void add(cudaStream_t stream, Elem e, const void* a, const void* b, void* out, std::int64_t n);
// out = alpha * x, n elements; out may alias x.
void scale(cudaStream_t stream, Elem e, const void* x, float alpha, void* out, std::int64_t n);

// ---- loss ------------------------------------------------------------------------------
// The logits [T,V] are columns [start, start + V) of a vocabulary of `total` (start 0, total V:
// the whole vocabulary). losses[t] = lse[t] - logits[t, target[t] - start] for a target in the
// shard (0 for one outside it or < 0; NaN when target >= total); lse[t] = log sum_v
// exp(logits[t, v]) over the shard. losses, lse fp32 [T].
void cross_entropy_forward(cudaStream_t stream, Elem e, const void* logits, const std::int32_t* targets,
                           float* losses, float* lse, std::int64_t tokens, std::int64_t vocab, std::int64_t vocab_start,
                           std::int64_t vocab_total);
// d_logits = scale * (exp(logits - lse) - onehot(target - start)) per counted row, with lse the
// whole row's; 0 for ignored rows (NaN for target >= total); d_logits may alias logits.
void cross_entropy_backward(cudaStream_t stream, Elem e, const void* logits, const std::int32_t* targets,
                            const float* lse, float scale, void* d_logits, std::int64_t tokens, std::int64_t vocab,
                            std::int64_t vocab_start, std::int64_t vocab_total);
// The whole vocabulary's losses and lse [T] from parts [P,2,T] fp32 (each shard's losses, then
// lse) of P shards of shard_rows columns (Backend::cross_entropy_combine).
void cross_entropy_combine(cudaStream_t stream, const float* parts, const std::int32_t* targets, float* losses,
                           float* lse, std::int64_t tokens, std::int64_t shards, std::int64_t shard_rows);

// ---- optimizer -------------------------------------------------------------------------
struct OptimizerArgs {
  bool adam = true;          // false: SGD
  Elem param_elem = Elem::f32, grad_elem = Elem::f32;
  void* param = nullptr;     // [n] written from the updated fp32 weights
  const void* grad = nullptr;
  float* master = nullptr;   // [n] fp32 weights; nullptr: param itself (fp32) holds them
  float* m = nullptr;        // [n] Adam moments (unused for SGD)
  float* v = nullptr;
  std::int64_t n = 0;
  float lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  float bias_correction1 = 1, bias_correction2 = 1;  // 1 - beta^t, computed on the host in double
};
void optimizer_step(cudaStream_t stream, const OptimizerArgs& o);

}  // namespace moelab::cuda_kernels
