// harness/backends/cuda/kernels.hpp — launchers for the few kernels the cuda backend writes
// by hand (everything else is cuBLAS, CUB, NCCL or the copy engines).
//
// Plain C++ declarations: cuda_backend.cpp includes this with the host compiler and only
// kernels.cu is compiled by nvcc, which keeps the build to one device translation unit.
// Every launcher is asynchronous on `stream` and throws std::runtime_error if the launch
// (or a stream-ordered workspace allocation) fails.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "harness/runtime/error.hpp"

namespace moelab::cuda_kernels {

// An allocation's result, for the backend's own scratch and staging (its tracked tensors go
// through raw_alloc): out of memory is OutOfMemory (exit code 3, as tracked allocations report
// it), with the error cleared (an allocation failure is not sticky, and a later launch check
// must not report it against a kernel); any other error is thrown as std::runtime_error.
inline void check_alloc(cudaError_t err, const char* what, std::size_t bytes) {
  if (err == cudaSuccess) return;
  cudaGetLastError();
  if (err == cudaErrorMemoryAllocation)
    throw OutOfMemory(std::string("cuda: ") + what + ": cannot allocate " + std::to_string(bytes) + " bytes: " +
                      cudaGetErrorString(err));
  throw std::runtime_error(std::string("cuda: ") + what + " failed: " + cudaGetErrorString(err));
}

// Element type of row data (activations, dispatch buffers). Gate tensors are always fp32.
enum class Elem { f32, bf16 };
// The activation (moelab::Activation's order): the exact erf GeLU, ReLU, the tanh GeLU.
enum class Act { gelu, relu, gelu_tanh };

// logits = clean + eps * softplus(noise_raw), n elements.
void noisy_logits(cudaStream_t stream, const float* clean, const float* noise_raw, const float* eps, float* logits,
                  std::int64_t n);
// d_noise_raw = d_logits * eps * sigmoid(noise_raw).
void noisy_logits_backward(cudaStream_t stream, const float* d_logits, const float* noise_raw, const float* eps,
                           float* d_noise_raw, std::int64_t n);

struct GateForwardArgs {
  const float* logits = nullptr;  // [T,E]
  std::int64_t tokens = 0;        // T
  int experts = 0;                // E
  int top_k = 1;                  // k (<= kMaxTopK)
  std::int64_t capacity = 0;      // <= 0: unlimited
  bool renormalize = false;
  float* probs = nullptr;         // [T,E]
  std::int32_t* topk_idx = nullptr;  // [T,k]
  float* topk_w = nullptr;        // [T,k]
  std::int32_t* slot = nullptr;   // [T,k]
  std::int32_t* counts = nullptr; // [E]
  float* routed_frac = nullptr;   // [E]
  float* aux_loss = nullptr;      // [1]
  float* prob_mean = nullptr;     // [E] mean_t probs[t,e]; null: not written
};
constexpr int kMaxTopK = 32;
void gate_forward(cudaStream_t stream, const GateForwardArgs& a);

struct GateBackwardArgs {
  const float* probs = nullptr;         // [T,E]
  const std::int32_t* topk_idx = nullptr;  // [T,k]
  const float* topk_w = nullptr;        // [T,k]
  const float* routed_frac = nullptr;   // [E]
  const float* d_topk_w = nullptr;      // [T,k]
  std::int64_t tokens = 0;
  int experts = 0;
  int top_k = 1;
  bool renormalize = false;
  float grad_aux = 0.0f;
  float* d_logits = nullptr;            // [T,E]
};
void gate_backward(cudaStream_t stream, const GateBackwardArgs& a);

// Row movers between token order [T,M] and the expert-sorted dispatch buffer [N,M].
// Slots < 0 are dropped; slots >= rows_n are ignored (never written out of bounds).
void permute(cudaStream_t stream, Elem e, const void* x, const std::int32_t* slot, void* out, std::int64_t tokens,
             int top_k, std::int64_t width, std::int64_t rows_n);
void permute_backward(cudaStream_t stream, Elem e, const void* d_out, const std::int32_t* slot, void* dx,
                      std::int64_t tokens, int top_k, std::int64_t width, std::int64_t rows_n);
void unpermute(cudaStream_t stream, Elem e, const void* y_perm, const std::int32_t* slot, const float* w, void* y,
               std::int64_t tokens, int top_k, std::int64_t width, std::int64_t rows_n);
void unpermute_backward(cudaStream_t stream, Elem e, const void* dy, const void* y_perm, const std::int32_t* slot,
                        const float* w, void* d_y_perm, float* dw, std::int64_t tokens, int top_k,
                        std::int64_t width, std::int64_t rows_n);

// out = act(in); d_in = d_out * act'(in) (d_in may alias d_out). n elements.
void activation_forward(cudaStream_t stream, Elem e, Act a, const void* in, void* out, std::int64_t n);
void activation_backward(cudaStream_t stream, Elem e, Act a, const void* in, const void* d_out, void* d_in,
                         std::int64_t n);

// out = in converted from `from` to the other element type (fp32 <-> bf16), n elements,
// device memory.
void convert(cudaStream_t stream, Elem from, const void* in, void* out, std::int64_t n);

}  // namespace moelab::cuda_kernels
