// harness/runtime/cost.cpp — the FLOP and byte counts of every op (see cost.hpp).
#include "harness/runtime/cost.hpp"

#include <algorithm>

#include "harness/runtime/backend.hpp"

namespace moelab {

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::gemm: return "gemm";
    case OpKind::elementwise: return "elementwise";
    case OpKind::gate: return "gate";
    case OpKind::permute: return "permute";
    case OpKind::copy_d2d: return "copy_d2d";
    case OpKind::copy_h2d: return "copy_h2d";
    case OpKind::copy_d2h: return "copy_d2h";
    case OpKind::collective: return "collective";
    case OpKind::host: return "host";
  }
  return "?";
}

OpCost cost_grouped_gemm(std::span<const GemmProblem> problems) {
  OpCost c;
  c.kind = OpKind::gemm;
  c.launches = 0;
  for (const auto& p : problems) {
    const double m = static_cast<double>(p.m), n = static_cast<double>(p.n), k = static_cast<double>(p.k);
    const double ea = static_cast<double>(dtype_size(p.a.defined() ? p.a.dtype() : DType::f32));
    const double ec = static_cast<double>(dtype_size(p.c.defined() ? p.c.dtype() : DType::f32));
    c.flops += 2.0 * m * n * k;
    c.bytes_read += (m * k + k * n) * ea + (p.beta != 0.0f ? m * n * ec : 0.0);
    c.bytes_written += m * n * ec;
    if (p.m > 0 && p.n > 0) ++c.launches;
  }
  return c;
}

OpCost cost_elementwise(std::int64_t elements, DType dtype, int inputs, int outputs, double flops_per_elem) {
  const double e = static_cast<double>(elements), b = static_cast<double>(dtype_size(dtype));
  return {OpKind::elementwise, e * flops_per_elem, e * b * inputs, e * b * outputs, 0, 1};
}

// Gate forward: softmax (~5 flops/elem incl. exp), top-k scan (k passes over E), capacity
// assignment (sort of T*k keys), aux statistics. Reads logits, writes probs and small
// per-token outputs.
OpCost cost_gate_forward(std::int64_t tokens, std::int64_t experts, int top_k) {
  const double te = static_cast<double>(tokens * experts), tk = static_cast<double>(tokens * top_k);
  return {OpKind::gate, te * (5.0 + top_k), te * 4.0 * (1 + top_k), te * 4.0 + tk * 12.0, 0, 3};
}

OpCost cost_gate_backward(std::int64_t tokens, std::int64_t experts, int top_k) {
  const double te = static_cast<double>(tokens * experts), tk = static_cast<double>(tokens * top_k);
  return {OpKind::gate, te * 4.0, te * 4.0 + tk * 12.0, te * 4.0, 0, 1};
}

OpCost cost_rows(OpKind kind, std::int64_t rows_read, std::int64_t rows_written, std::int64_t width, DType dtype,
                 double flops_per_elem) {
  const double w = static_cast<double>(width), b = static_cast<double>(dtype_size(dtype));
  return {kind, static_cast<double>(rows_read) * w * flops_per_elem, static_cast<double>(rows_read) * w * b,
          static_cast<double>(rows_written) * w * b, 0, 1};
}

OpCost cost_copy(OpKind kind, std::int64_t bytes) {
  const double b = static_cast<double>(bytes);
  return {kind, 0, b, b, 0, 1};
}

OpCost cost_fill(std::int64_t bytes) { return {OpKind::elementwise, 0, 0, static_cast<double>(bytes), 0, 1}; }

// GeLU (exact erf form): ~8 flops per element forward (erf counted as a few), 12 backward
// (the cdf and the pdf); tanh GeLU: the cubic 4, tanh counted as a few, the rest 3 forward, and
// 12 backward (1 - t², the cubic's derivative and the products); ReLU one compare. Backward reads
// the input and d_out.
double activation_flops(Activation a, bool backward) {
  if (a == Activation::relu) return 1;
  return backward ? 12 : 8;
}

OpCost cost_activation_forward(Activation a, std::int64_t elements, DType dtype) {
  return cost_elementwise(elements, dtype, 1, 1, activation_flops(a, false));
}

OpCost cost_activation_backward(Activation a, std::int64_t elements, DType dtype) {
  return cost_elementwise(elements, dtype, 2, 1, activation_flops(a, true));
}

// The GEMMs as cost_grouped_gemm counts them, plus the epilogue: per output element the
// activation's flops, and the auxiliary [m,n] matrix in C's dtype, written (act_aux: the
// pre-activation) or read (dact: the saved pre-activation). No activation pass of its own.
OpCost cost_grouped_gemm_epilogue(std::span<const GemmProblem> problems, GemmEpilogue ep, Activation a) {
  OpCost c = cost_grouped_gemm(problems);
  if (ep == GemmEpilogue::none) return c;
  for (const auto& p : problems) {
    const double mn = static_cast<double>(p.m) * static_cast<double>(p.n);
    const double ec = static_cast<double>(dtype_size(p.c.defined() ? p.c.dtype() : DType::f32));
    c.flops += mn * activation_flops(a, ep == GemmEpilogue::dact);
    (ep == GemmEpilogue::act_aux ? c.bytes_written : c.bytes_read) += mn * ec;
  }
  return c;
}

// ---- transformer-block ops (docs/PERFORMANCE.md, "Block ops") -------------------------------

namespace {
constexpr double kIdBytes = 4.0;    // int32 token ids and targets
constexpr double kStatBytes = 4.0;  // fp32 per-row statistics (mean, rstd, lse, losses)
double elem(DType t) { return static_cast<double>(dtype_size(t)); }
}  // namespace

// A gather of T rows of wte (and of wpe), one add per element with learned positions.
OpCost cost_embedding_forward(std::int64_t tokens, std::int64_t width, bool learned_positions, DType dtype) {
  const double T = static_cast<double>(tokens), tm = T * static_cast<double>(width);
  const double tables = learned_positions ? 2 : 1;
  return {OpKind::permute, learned_positions ? tm : 0.0, T * kIdBytes + tables * tm * elem(dtype), tm * elem(dtype),
          0, 1};
}

// A scatter-add: each of the T rows of d_out read once, and each table row it lands on read
// and written (a repeated id counted every time, as an atomic add does).
OpCost cost_embedding_backward(std::int64_t tokens, std::int64_t width, bool learned_positions, DType dtype) {
  const double T = static_cast<double>(tokens), tm = T * static_cast<double>(width);
  const double tables = learned_positions ? 2 : 1;
  return {OpKind::permute, tables * tm, T * kIdBytes + (1 + tables) * tm * elem(dtype), tables * tm * elem(dtype), 0,
          1};
}

// Per element, layernorm: mean 1, variance 3, normalise and affine 4; rmsnorm: square-sum 2,
// scale and gain 2. Reads x and the [M] parameters, writes y and the [T] statistics.
OpCost cost_norm_forward(NormKind kind, std::int64_t tokens, std::int64_t width, DType dtype) {
  const bool ln = kind == NormKind::layernorm;
  const double T = static_cast<double>(tokens), M = static_cast<double>(width), e = elem(dtype);
  return {OpKind::elementwise, (ln ? 8.0 : 4.0) * T * M, T * M * e + (ln ? 2.0 : 1.0) * M * e,
          T * M * e + (ln ? 2.0 : 1.0) * T * kStatBytes, 0, 1};
}

// Per element, layernorm: x̂ 2, dy·γ 1, two row sums 4, dx 4, dγ 2, dβ 1; rmsnorm: x̂ 1, dy·γ 1,
// one row sum 2, dx 3, dγ 2. Reads x, dy, γ and the statistics, reads and writes the [M]
// parameter gradients (accumulated), writes dx.
OpCost cost_norm_backward(NormKind kind, std::int64_t tokens, std::int64_t width, DType dtype) {
  const bool ln = kind == NormKind::layernorm;
  const double T = static_cast<double>(tokens), M = static_cast<double>(width), e = elem(dtype);
  const double params = ln ? 2.0 : 1.0;
  return {OpKind::elementwise, (ln ? 14.0 : 9.0) * T * M,
          2.0 * T * M * e + M * e + params * T * kStatBytes + params * M * e, T * M * e + params * M * e, 0, 1};
}

// The Hq query and Hkv key heads rotated in place: per element 3 flops (x cos -/+ y sin).
OpCost cost_rope(const AttentionShape& a, DType dtype) {
  const double n = static_cast<double>(a.tokens()) * (a.heads + a.kv_heads) * a.head_dim;
  return {OpKind::elementwise, 3.0 * n, n * elem(dtype), n * elem(dtype), 0, 1};
}

namespace {
// What a tiled attention kernel visits for one (sequence, query head), with query tiles of
// kAttentionTileRows rows and key tiles of as many columns: every tile pair when
// bidirectional, the pairs at or below the diagonal when causal (key tile j <= query tile i).
//   scores: Σ over visited pairs of rows_i · cols_j (the score entries computed)
//   kv_rows: Σ over query tiles of the key rows they read
struct AttentionTiles {
  double scores = 0, kv_rows = 0;
};
AttentionTiles attention_tiles(std::int64_t seq, bool causal) {
  const std::int64_t tile = kAttentionTileRows;
  AttentionTiles t;
  for (std::int64_t i0 = 0; i0 < seq; i0 += tile) {
    const std::int64_t rows = std::min(tile, seq - i0);
    const std::int64_t cols = causal ? std::min(i0 + tile, seq) : seq;  // key tiles 0..i, or all
    t.scores += static_cast<double>(rows) * static_cast<double>(cols);
    t.kv_rows += static_cast<double>(cols);
  }
  return t;
}
}  // namespace

// FlashAttention (Dao et al. 2022): two GEMM-like products per tile pair, S = QK^T and O += PV,
// 2·D flops per score entry each; the softmax's exponentials are not counted (as FLOP counts
// of attention conventionally do). Each query tile streams the K and V rows it visits; Q is
// read and O and the LSE written once. Query heads sharing a K/V head (GQA) each stream it.
OpCost cost_attention_forward(const AttentionShape& a, DType dtype) {
  const AttentionTiles t = attention_tiles(a.seq, a.causal);
  const double bh = static_cast<double>(a.batch) * a.heads, D = a.head_dim, e = elem(dtype);
  const double q = static_cast<double>(a.tokens()) * a.heads * D;  // elements of Q (and of O)
  return {OpKind::gemm, 4.0 * bh * D * t.scores, q * e + 2.0 * bh * D * t.kv_rows * e,
          q * e + bh * static_cast<double>(a.seq) * kStatBytes, 0, 1};
}

// FlashAttention-2's backward (Dao 2023, Alg. 2 and §4.1): five GEMM-like products per tile
// pair (S = QK^T recomputed, dV += P^T dO, dP = dO V^T, dQ += dS K, dK += dS^T Q) against the
// forward's two, so 2.5× its FLOPs. Bytes follow the forward's pattern: Q, O, dO and the LSE
// once, K and V once per query tile that visits them, d_qkv written once; a second launch
// computes D = rowsum(dO∘O) first.
OpCost cost_attention_backward(const AttentionShape& a, DType dtype) {
  const AttentionTiles t = attention_tiles(a.seq, a.causal);
  const double bh = static_cast<double>(a.batch) * a.heads, D = a.head_dim, e = elem(dtype);
  const double q = static_cast<double>(a.tokens()) * a.heads * D;
  return {OpKind::gemm, 2.5 * 4.0 * bh * D * t.scores,
          3.0 * q * e + bh * static_cast<double>(a.seq) * kStatBytes + 2.0 * bh * D * t.kv_rows * e,
          static_cast<double>(a.tokens()) * static_cast<double>(a.qkv_width()) * e, 0, 2};
}

// silu(g)·u: sigmoid (exp, add, divide), two multiplies per output element.
OpCost cost_swiglu_forward(std::int64_t tokens, std::int64_t width, DType dtype) {
  return cost_elementwise(tokens * width, dtype, 2, 1, 5);
}

// d_up = dy·silu(g), d_gate = dy·u·σ(g)(1 + g(1 − σ(g))): reads h and dy, writes d_h [T,2F].
OpCost cost_swiglu_backward(std::int64_t tokens, std::int64_t width, DType dtype) {
  return cost_elementwise(tokens * width, dtype, 3, 2, 10);
}

OpCost cost_add(std::int64_t elements, DType dtype) { return cost_elementwise(elements, dtype, 2, 1, 1); }

OpCost cost_scale(std::int64_t elements, DType dtype) { return cost_elementwise(elements, dtype, 1, 1, 1); }

// Gated sum: per row G gate values (an exponential, an add and a divide each: 4), per element two
// multiplies and an add; reads a, b and the fp32 logits, writes out.
OpCost cost_gated_combine_forward(std::int64_t tokens, std::int64_t width, int gates, DType dtype) {
  const double T = static_cast<double>(tokens), TM = T * static_cast<double>(width), G = gates;
  return {OpKind::elementwise, 3.0 * TM + 4.0 * G * T, 2.0 * TM * elem(dtype) + G * T * kStatBytes,
          TM * elem(dtype), 0, 1};
}

// Backward: G row dot products <d_out, a> (and <d_out, b>) of 2 flops per element, the branch
// gradients one multiply per element each, the logits' gradient ~8 per gate; reads d_out and
// the G branches it dots with, writes da (and db) and dz.
OpCost cost_gated_combine_backward(std::int64_t tokens, std::int64_t width, int gates, bool writes_db, DType dtype) {
  const double T = static_cast<double>(tokens), TM = T * static_cast<double>(width), G = gates;
  const double outs = writes_db ? 2.0 : 1.0;
  return {OpKind::elementwise, 2.0 * G * TM + outs * TM + 8.0 * G * T, (1.0 + G) * TM * elem(dtype) + G * T * kStatBytes,
          outs * TM * elem(dtype) + G * T * kStatBytes, 0, 1};
}

// Fused softmax cross-entropy: per logit a max, a subtract, an exponential and a sum; reads the
// logits and targets once, writes the losses and the LSE.
OpCost cost_cross_entropy_forward(std::int64_t tokens, std::int64_t vocab, DType dtype) {
  const double T = static_cast<double>(tokens), TV = T * static_cast<double>(vocab);
  return {OpKind::elementwise, 4.0 * TV, TV * elem(dtype) + T * kIdBytes, 2.0 * T * kStatBytes, 0, 1};
}

// Per token: the log-sum-exp of the P shards' lse (a max, P exponentials and a log, ~4 per
// shard) and one subtraction; reads the P shards' (loss, lse) and the target, writes loss and lse.
OpCost cost_cross_entropy_combine(std::int64_t tokens, std::int64_t shards) {
  const double T = static_cast<double>(tokens), P = static_cast<double>(shards);
  return {OpKind::elementwise, 4.0 * P * T, 2.0 * P * T * kStatBytes + T * kIdBytes, 2.0 * T * kStatBytes, 0, 1};
}

// d_logits = scale·(exp(logit − lse) − onehot): subtract, exponential, multiply per logit.
OpCost cost_cross_entropy_backward(std::int64_t tokens, std::int64_t vocab, DType dtype) {
  const double T = static_cast<double>(tokens), TV = T * static_cast<double>(vocab);
  return {OpKind::elementwise, 3.0 * TV, TV * elem(dtype) + T * (kIdBytes + kStatBytes), TV * elem(dtype), 0, 1};
}

// Per element, SGD: wd·p, + g, · lr, subtract = 4 flops; Adam: m 3, v 4, the two bias
// corrections 2, sqrt, + eps, divide, wd·p 2, · lr, subtract = 16. Reads the gradient and the
// fp32 master (or the parameter itself), plus m and v for Adam; writes the master and the
// parameter (only the parameter without a master), plus m and v.
OpCost cost_optimizer_step(OptimizerKind kind, std::int64_t elements, DType param_dtype, bool master_copy) {
  const double n = static_cast<double>(elements), p = elem(param_dtype), f = 4.0;
  const bool adam = kind == OptimizerKind::adam;
  const double state = adam ? 2.0 * n * f : 0.0;
  const double weights = master_copy ? n * f : n * p;
  return {OpKind::elementwise, (adam ? 16.0 : 4.0) * n, n * p + weights + state,
          weights + (master_copy ? n * p : 0.0) + state, 0, 1};
}

OpCost cost_collective(double bytes_sent_to_others, double bytes_local) {
  return {OpKind::collective, 0, bytes_sent_to_others + bytes_local, bytes_sent_to_others + bytes_local,
          bytes_sent_to_others, 1};
}

}  // namespace moelab
