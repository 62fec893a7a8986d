// harness/nn/blocks.hpp — the blocks of a transformer, forward and backward, each a
// composition of Backend ops (harness/runtime/backend.hpp) issued on one compute stream.
//
// A decoder (or encoder) layer is two blocks, pre-norm as in GPT-2/3 and LLaMA:
//   AttentionBlock   y = x + Wo · attention(rope(norm(x) · Wqkv))
//   FfnBlock         y = x + ffn(norm(x)),  ffn = a dense MLP (GELU or SwiGLU)
//                                            or an MoE layer (+ a shared dense expert)
// and a model is Embedding → layers → Head (final norm, LM head, cross-entropy).
//
// Every block follows harness/nn/saved.hpp: forward returns its saved state; backward runs
// as backward_input ("B": the input gradient, and the norms' own small parameter gradients)
// and backward_weight ("W": the weight-gradient GEMMs, which zero-bubble schedules defer).
// Parameter gradients accumulate (+=) until zero_grad.
//
// Notation: T = B·S tokens of a microbatch, M d_model, F FFN width, V vocabulary,
// Hq/Hkv query/key-value heads of width D, Q = (Hq + 2·Hkv)·D the packed qkv width.
// Linear weights are [in, out] row-major: y = x · W. There are no linear biases (as in
// PaLM and LLaMA); LayerNorm has its bias.
//
// Tensor parallelism (harness/nn/tensor_parallel.hpp; Megatron-LM, Shoeybi et al. 2019, §3):
// with a TP group of size t, attention splits its heads (W_qkv by columns: Hq/t query and
// Hkv/t key/value heads per rank; W_o by rows) and the MLP its width (W_1 by columns, W_2 by
// rows, F/t per rank); each block enters its region before the column-parallel GEMM and
// leaves it after the row-parallel one. The embedding table and the LM head are split by the
// vocabulary (V/t rows, or logit columns, per rank; see Embedding and Head). With sequence
// parallelism (Korthikanti et al. 2022) a block's input and output are the rank's T/t rows and
// the norms, residuals and MoE layers work on those rows only.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/config/model.hpp"
#include "harness/nn/moe_impl.hpp"
#include "harness/nn/saved.hpp"
#include "harness/nn/tensor_parallel.hpp"
#include "harness/runtime/backend.hpp"

namespace moelab {

// A parameter and its gradient, and where the gradient must be summed
// (harness/nn/grad_sync.hpp does it):
//   replicated   the same on every rank of the data-parallel group, which sums its gradient;
//                false for the experts, summed over the expert-data-parallel group instead
//   tp_partial   every TP rank saw other tokens (sequence parallelism: the norms, the gate),
//                so the gradient is also summed over the TP group (Megatron-LM's
//                allreduce of the layernorm grads)
//   grad_copies  how many ranks of those sums saw each token: the experts without sequence
//                parallelism, whose TP ranks all route the same tokens (grad_sync.hpp)
//   shard        how a tensor-parallel parameter is cut from the full one
struct Param {
  std::string name;
  Tensor value, grad;
  bool replicated = true;
  bool tp_partial = false;
  int grad_copies = 1;
  TpShard shard;
};

class Block {
 public:
  virtual ~Block() = default;
  // The block kind, which is also the timeline phase of its ops: "embedding", "attention",
  // "mlp", "moe" (the MoE layer's own ops carry gate / dispatch / experts / combine), "head".
  virtual const char* kind() const = 0;
  virtual Forwarded forward(const Tensor& x, const WorkKey& key) = 0;
  virtual Tensor backward_input(Saved& saved, const Tensor& dy) = 0;
  virtual void backward_weight(Saved& saved) = 0;
  virtual void init_parameters(std::uint64_t seed) = 0;
  virtual void collect(std::vector<Param*>& out) = 0;
};

// ---- shared pieces -------------------------------------------------------------------------

// C = op(A)·op(B) (beta 0) or C += op(A)·op(B) (beta 1) on [in, out] row-major operands: the
// one spelling of the blocks' GEMMs (blocks.cpp, vision.cpp, ScMoE's pair).
GemmProblem block_gemm(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, const Tensor& a, const Tensor& b,
                       const Tensor& c, float beta);
// ConfigError unless x is [T, width] of `dtype`, naming `who`.
void require_rows(const Tensor& x, std::int64_t width, DType dtype, const std::string& who);

// Parameters are made in the model dtype under `weights`, their gradients under `gradients`.
Param make_param(Backend& b, Stream& s, std::string name, std::vector<std::int64_t> shape, DType dtype,
                 bool replicated = true);
// Deterministic initialisation from (seed, tag): N(0, std^2), or a constant. A split
// parameter gets its part of the full tensor's draw, so that a tensor-parallel model starts
// exactly where the unsplit one does.
void init_normal(Backend& b, Param& p, std::uint64_t seed, std::uint64_t tag, double stddev);
void init_constant(Backend& b, Param& p, float value);

// LayerNorm or RMSNorm over the last dimension, with its statistics kept for backward.
// Under sequence parallelism it sees the rank's rows only: its gradients are TP-partial.
class Norm {
 public:
  Norm(Backend& b, Stream& s, const TransformerConfig& cfg, std::string name, const TensorParallel& tp = {});
  struct State {
    Tensor x, mean, rstd;  // [T,M], [T] fp32 (mean: layernorm only)
  };
  Tensor forward(const Tensor& x, State& st);              // [T,M] -> [T,M]
  Tensor backward(const State& st, const Tensor& dy);       // dx; d_gamma, d_beta +=
  void init_parameters();
  void collect(std::vector<Param*>& out);

 private:
  Backend& b_;
  Stream& s_;
  NormKind kind_;
  float eps_;
  Param gamma_, beta_;  // [M]; beta undefined for rmsnorm
};

// The dense feed-forward network without norm or residual: GELU: g = gelu(b·W1) [T,F];
// SwiGLU: g = silu(h_gate) * h_up with [h_gate | h_up] = b·W1 [T,2F]; m = g·W2 [T,M]. The
// activation output g is recomputed from h in backward (as the MoE layer does with T_M).
// Tensor-parallel (Megatron's MLP): F/t columns of W1 (of each SwiGLU half) and rows of W2 per
// rank, one region from W1 to W2; its input and output are the rank's rows under sequence
// parallelism ([T/t,M]), and the input is gathered again for dW1 rather than kept whole
// (Korthikanti et al. 2022, §4.2.2).
class FeedForward {
 public:
  FeedForward(Backend& b, Stream& s, const TransformerConfig& cfg, std::int64_t width, std::string name,
              const TensorParallel& tp = {});
  struct State {
    Tensor in, h;        // forward: [T,M] input (the rank's rows under SP), [T,F/t or 2F/t] pre-activation
    Tensor g, d_h, d_m;  // B -> W: recomputed activation, its input gradient, the output gradient [T,M]
  };
  Tensor forward(const Tensor& in, State& st);
  Tensor backward_input(State& st, const Tensor& d_m);
  void backward_weight(State& st);
  void init_parameters(std::uint64_t seed, std::uint64_t tag, int num_layers);
  void collect(std::vector<Param*>& out);

 private:
  Backend& b_;
  Stream& s_;
  MlpKind kind_;
  TensorParallel tp_;
  std::int64_t width_;  // this rank's F/t
  Param w1_, w2_;  // [M,F/t] (SwiGLU [M,2F/t]), [F/t,M]
};

// Destination row of every token when `images` images of grid × grid tokens are regrouped into
// window × window windows (window order: image, window row, window column, then the token's
// row and column inside its window). A permutation of [0, images·grid²).
std::vector<std::int32_t> window_slots(std::int64_t images, std::int64_t grid, std::int64_t window);
// Index tensors of a row regrouping, one per token count (a block sees the training microbatch
// and, for evaluation, other batch sizes), made on first use and kept.
class RowIndexCache {
 public:
  RowIndexCache(Backend& b, Stream& s) : b_(b), s_(s) {}
  // The [n, k] int32 tensor of `make()`'s values for `key`, made when first asked for.
  template <class Make>
  const Tensor& get(std::int64_t key, std::int64_t n, std::int64_t k, Make make) {
    auto it = cache_.find(key);
    if (it != cache_.end()) return it->second;
    Tensor t = b_.empty({n, k}, DType::i32, MemCategory::buffers, s_);
    if (b_.has_data()) b_.upload_i32(make(), t);
    return cache_.emplace(key, std::move(t)).first->second;
  }

 private:
  Backend& b_;
  Stream& s_;
  std::map<std::int64_t, Tensor> cache_;
};

// ---- the blocks ----------------------------------------------------------------------------

// Token embedding (+ learned positions): ids [T] int32 -> [T,M]. Its only gradient is the
// weights', so backward_input keeps dy and returns nothing; backward_weight scatters it.
// With tied embeddings the Head adds the LM head's gradient into the same wte gradient.
// Under tensor parallelism the table is split by rows of the vocabulary (Megatron-LM's
// VocabParallelEmbedding; the vocabulary padded to a multiple of t as Megatron pads it): each
// rank looks up the ids in its V/t rows, zeros for the others', and the block leaves the
// region with the sum (an all-reduce, or a reduce-scatter to the rank's rows under sequence
// parallelism). Learned positions are whole on every rank, added by TP rank 0 only.
class Embedding final : public Block {
 public:
  Embedding(Backend& b, Stream& s, const TransformerConfig& cfg, const TensorParallel& tp = {});
  const char* kind() const override { return "embedding"; }
  Forwarded forward(const Tensor& ids, const WorkKey& key) override;
  Tensor backward_input(Saved& saved, const Tensor& dy) override;
  void backward_weight(Saved& saved) override;
  void init_parameters(std::uint64_t seed) override;
  void collect(std::vector<Param*>& out) override;
  Param& wte() { return wte_; }

 private:
  Backend& b_;
  Stream& s_;
  TransformerConfig cfg_;
  TensorParallel tp_;
  Param wte_, wpe_;  // [V/t,M] (V padded to a multiple of t), [S,M] (learned positions only)
};

// Tensor-parallel as Megatron's self-attention: rank r of t computes query heads
// [r·Hq/t, (r+1)·Hq/t) and key/value heads [r·Hkv/t, (r+1)·Hkv/t) (grouped-query attention
// keeps its grouping: Hq/Hkv query heads per key/value head on every rank).
class AttentionBlock final : public Block {
 public:
  AttentionBlock(Backend& b, Stream& s, const TransformerConfig& cfg, int layer, const TensorParallel& tp = {});
  const char* kind() const override { return "attention"; }
  Forwarded forward(const Tensor& x, const WorkKey& key) override;
  Tensor backward_input(Saved& saved, const Tensor& dy) override;
  void backward_weight(Saved& saved) override;
  void init_parameters(std::uint64_t seed) override;
  void collect(std::vector<Param*>& out) override;
  // Selective recomputation of the norm (Korthikanti et al. 2022 §5, for the cheap layers):
  // forward keeps only the block input (the norm's own state) instead of also the normed
  // [T,M] activation, and W recomputes it. Saves one [T,M] per block between F and W.
  void set_recompute_norm(bool on) { recompute_norm_ = on; }

 private:
  AttentionShape shape(std::int64_t tokens) const;  // this rank's heads over the microbatch's T tokens
  // A vision model's stage with several windows per image: the rows' window order for T tokens
  // (window_slots); null when attention runs over whole sequences (one window per image).
  const Tensor* windows(std::int64_t tokens);

  Backend& b_;
  Stream& s_;
  TransformerConfig cfg_;
  int layer_;
  TensorParallel tp_;
  Norm norm_;
  Param wqkv_, wo_;  // [M,Q/t], [Hq·D/t,M]
  bool recompute_norm_ = false;
  RowIndexCache window_slots_;
};

// y = x + ffn(norm(x)) where ffn is a dense MLP, or an MoE layer served by an MoEImpl
// (FastMoE, FasterMoE, MPipeMoE, ...) plus, when the model has one, a shared dense expert
// on the same input (DeepSpeed-MoE's residual MoE, Rajbhandari et al. 2022; ScMoE's shared
// expert). `aux_loss_coef` weighs the MoE layer's auxiliary loss in the objective.
// Under tensor parallelism the dense MLP and the shared expert are split (FeedForward); the
// MoE layer is not (expert-TP = 1, DeepSpeed-MoE's semantics): each TP rank routes the tokens
// it holds through the expert-parallel group — the same tokens on every TP rank, or its own
// T/t rows under sequence parallelism.
class FfnBlock final : public Block {
 public:
  // Dense MLP block.
  FfnBlock(Backend& b, Stream& s, const TransformerConfig& cfg, int layer, const TensorParallel& tp = {});
  // MoE block: `moe` serves the routed experts.
  FfnBlock(Backend& b, Stream& s, const TransformerConfig& cfg, int layer, std::unique_ptr<MoEImpl> moe,
           float aux_loss_coef, const TensorParallel& tp = {});
  ~FfnBlock() override;
  const char* kind() const override { return moe_ ? "moe" : "mlp"; }
  Forwarded forward(const Tensor& x, const WorkKey& key) override;
  Tensor backward_input(Saved& saved, const Tensor& dy) override;
  void backward_weight(Saved& saved) override;
  void init_parameters(std::uint64_t seed) override;
  void collect(std::vector<Param*>& out) override;
  MoEImpl* moe() { return moe_.get(); }
  // The auxiliary loss of a forward's MoE layer (0 for a dense block; under sequence
  // parallelism this rank's share of the sequence's); synchronises.
  float aux_loss(const Saved& saved);
  // dL/d aux_loss used by backward_input: aux_loss_coef times the saved state's loss scale.
  void set_aux_grad_scale(float s) { aux_grad_scale_ = s; }
  // As AttentionBlock's, for a dense MLP block (an MoE layer keeps its input for the gate's
  // backward, so recomputing the norm there saves nothing): no effect on MoE blocks.
  void set_recompute_norm(bool on) { recompute_norm_ = on && !moe_; }

 private:
  Backend& b_;
  Stream& s_;
  TransformerConfig cfg_;
  int layer_;
  Norm norm_;
  std::unique_ptr<FeedForward> mlp_;  // dense MLP, or the shared expert of an MoE block
  std::unique_ptr<MoEImpl> moe_;
  float aux_loss_coef_ = 0.0f;
  float aux_grad_scale_ = 1.0f;
  bool recompute_norm_ = false;
};

// Final norm, LM head (wte^T when tied, else its own [M,V]) and the cross-entropy loss
// against the targets given to forward. forward's y is the per-token loss [T] fp32 (0 for
// ignored targets); backward_input's dy is unused: the gradient is loss_scale · dCE.
// Under tensor parallelism the LM head is column-parallel over the vocabulary (each rank's
// V/t logit columns; tied: its rows of the embedding table) and the loss is Megatron's
// vocabulary-parallel cross-entropy: every rank's loss and log-sum-exp over its columns,
// all-gathered and combined (Backend::cross_entropy_combine), so every TP rank holds the
// whole per-token loss. The region starts at the LM head: under sequence parallelism the
// final norm works on the rank's rows, gathered before the GEMM (and again for its weight
// gradient).
class Head final : public Block {
 public:
  Head(Backend& b, Stream& s, const TransformerConfig& cfg, Param* tied_wte, const TensorParallel& tp = {});
  const char* kind() const override { return "head"; }
  void set_targets(const Tensor& targets, float loss_scale) {
    targets_ = targets;
    loss_scale_ = loss_scale;
  }
  Forwarded forward(const Tensor& x, const WorkKey& key) override;
  Tensor backward_input(Saved& saved, const Tensor& dy) override;
  void backward_weight(Saved& saved) override;
  void init_parameters(std::uint64_t seed) override;
  void collect(std::vector<Param*>& out) override;

 private:
  Backend& b_;
  Stream& s_;
  TransformerConfig cfg_;
  TensorParallel tp_;
  Norm norm_;
  Param own_w_;           // [M,V/t] when not tied
  Param* tied_ = nullptr; // the embedding's wte [V,M] when tied
  Tensor targets_;
  float loss_scale_ = 1.0f;
};

}  // namespace moelab
