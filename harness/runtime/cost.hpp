// harness/runtime/cost.hpp — the one cost descriptor of every op.
//
// Each op's FLOPs and bytes are computed here and nowhere else. The sim backend turns a
// descriptor into virtual time; the real backends divide it by measured time to report
// achieved TFLOP/s and GB/s. Conventions (docs/PERFORMANCE.md):
//   GEMM [m,k]x[k,n]: flops = 2mnk; bytes read = (mk + kn [+ mn if beta != 0]) * elem;
//                     bytes written = mn * elem_c.
//   elementwise / gather / scatter: flops ~ 0 (or a few per element), bytes as moved.
//   collectives: comm_bytes = bytes this rank sends to other ranks (self excluded).
#pragma once
#include <cstdint>
#include <span>
#include <string>

#include "harness/runtime/dtype.hpp"
#include "harness/runtime/op_types.hpp"

namespace moelab {

enum class OpKind { gemm, elementwise, gate, permute, copy_d2d, copy_h2d, copy_d2h, collective, host };
const char* op_kind_name(OpKind k);

struct OpCost {
  OpKind kind = OpKind::host;
  double flops = 0;          // floating point operations
  double bytes_read = 0;     // from device memory
  double bytes_written = 0;  // to device memory
  double comm_bytes = 0;     // sent to other ranks (collectives only)
  std::int64_t launches = 1; // kernels / library calls this op issues (launch overhead)
};

struct GemmProblem;
OpCost cost_grouped_gemm(std::span<const GemmProblem> problems);
OpCost cost_elementwise(std::int64_t elements, DType dtype, int inputs, int outputs, double flops_per_elem);
OpCost cost_gate_forward(std::int64_t tokens, std::int64_t experts, int top_k);
OpCost cost_gate_backward(std::int64_t tokens, std::int64_t experts, int top_k);
// permute / unpermute move rows of width `width`: rows_in read, rows_out written.
OpCost cost_rows(OpKind kind, std::int64_t rows_read, std::int64_t rows_written, std::int64_t width, DType dtype,
                 double flops_per_elem);
OpCost cost_copy(OpKind kind, std::int64_t bytes);
// A fill (memset): `bytes` written, nothing read.
OpCost cost_fill(std::int64_t bytes);
OpCost cost_activation_forward(Activation a, std::int64_t elements, DType dtype);
OpCost cost_activation_backward(Activation a, std::int64_t elements, DType dtype);
// Flops per element of an activation (forward) or of its derivative times d_out (backward).
double activation_flops(Activation a, bool backward);
// A grouped GEMM with its activation fused into the epilogue (Backend::grouped_gemm_epilogue):
// the GEMMs, the epilogue's flops and its auxiliary matrix (written by act_aux, read by dact).
OpCost cost_grouped_gemm_epilogue(std::span<const GemmProblem> problems, GemmEpilogue ep, Activation a);

// Transformer-block ops (Backend, "transformer-block ops"; docs/PERFORMANCE.md, "Block ops").
// T tokens, M width, V vocabulary.
OpCost cost_embedding_forward(std::int64_t tokens, std::int64_t width, bool learned_positions, DType dtype);
OpCost cost_embedding_backward(std::int64_t tokens, std::int64_t width, bool learned_positions, DType dtype);
OpCost cost_norm_forward(NormKind kind, std::int64_t tokens, std::int64_t width, DType dtype);
OpCost cost_norm_backward(NormKind kind, std::int64_t tokens, std::int64_t width, DType dtype);
OpCost cost_rope(const AttentionShape& a, DType dtype);
// Tiled attention: the FLOPs of QK^T and PV (halved, tile-exactly, when causal) and the bytes
// of reading K and V once per query tile of kAttentionTileRows rows — the same formula on
// every backend whatever tile its kernel really uses.
constexpr std::int64_t kAttentionTileRows = 128;
OpCost cost_attention_forward(const AttentionShape& a, DType dtype);
OpCost cost_attention_backward(const AttentionShape& a, DType dtype);
OpCost cost_swiglu_forward(std::int64_t tokens, std::int64_t width, DType dtype);  // width = F (output)
OpCost cost_swiglu_backward(std::int64_t tokens, std::int64_t width, DType dtype);
OpCost cost_add(std::int64_t elements, DType dtype);
OpCost cost_scale(std::int64_t elements, DType dtype);
// The gated sum of two branches (Backend::gated_combine_*): T rows of width M, G gate logits per
// row; backward writes db only when asked (G = 1 may leave it to the caller).
OpCost cost_gated_combine_forward(std::int64_t tokens, std::int64_t width, int gates, DType dtype);
OpCost cost_gated_combine_backward(std::int64_t tokens, std::int64_t width, int gates, bool writes_db, DType dtype);
OpCost cost_cross_entropy_forward(std::int64_t tokens, std::int64_t vocab, DType dtype);
OpCost cost_cross_entropy_combine(std::int64_t tokens, std::int64_t shards);
OpCost cost_cross_entropy_backward(std::int64_t tokens, std::int64_t vocab, DType dtype);
OpCost cost_optimizer_step(OptimizerKind kind, std::int64_t elements, DType param_dtype, bool master_copy);
OpCost cost_collective(double bytes_sent_to_others, double bytes_local);

}  // namespace moelab
