// harness/backends/cuda/combine_kernels.hpp — launchers for the gated combine of two branch
// outputs (Backend::gated_combine_forward / _backward: ScMoE's CG-1 and CG-2), in
// combine_kernels.cu. Plain C++ declarations for the host compiler; asynchronous on `stream`,
// std::runtime_error if a launch fails. a, b, out and the gradients are fp32 or bf16 (Elem) rows
// of width M; the gate logits z and dz are fp32 [T,G], G = 1 (sigmoid) or 2 (softmax); the row
// dot products accumulate in fp32.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "harness/backends/cuda/kernels.hpp"

namespace moelab::cuda_kernels {

// out[t] = c_a·a[t] + c_b·b[t]; out may alias a or b.
void gated_combine_forward(cudaStream_t stream, Elem e, const float* z, int gates, const void* a, const void* b,
                           void* out, std::int64_t tokens, std::int64_t width);
// da = c_a·d_out, db = c_b·d_out (db may be null when gates = 1, and b is then not read), dz [T,G].
void gated_combine_backward(cudaStream_t stream, Elem e, const float* z, int gates, const void* a, const void* b,
                            const void* d_out, void* da, void* db, float* dz, std::int64_t tokens, std::int64_t width);

}  // namespace moelab::cuda_kernels
