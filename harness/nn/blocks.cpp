// harness/nn/blocks.cpp — transformer blocks as compositions of Backend ops (see blocks.hpp
// for the data flow, the notation and the B/W split of backward).
//   ctest --test-dir build -R model_test
#include "harness/nn/blocks.hpp"

#include <algorithm>
#include <cmath>

#include "harness/runtime/error.hpp"
#include "harness/runtime/parallel.hpp"
#include "harness/runtime/random.hpp"

namespace moelab {

// ---- parameters ----------------------------------------------------------------------------

Param make_param(Backend& b, Stream& s, std::string name, std::vector<std::int64_t> shape, DType dtype,
                 bool replicated) {
  Param p;
  p.name = std::move(name);
  p.value = b.empty(shape, dtype, MemCategory::weights, s);
  p.grad = b.empty(shape, dtype, MemCategory::gradients, s);
  p.replicated = replicated;
  b.fill_zero(s, p.grad);
  return p;
}

void init_normal(Backend& b, Param& p, std::uint64_t seed, std::uint64_t tag, double stddev) {
  if (!b.has_data()) return;
  Rng rng(Rng::mix(seed, tag));
  const bool split = p.shard.split();
  MOELAB_CHECK(!split || p.value.ndim() == 2, p.name + ": a split parameter is a matrix");
  const std::int64_t n = split ? p.value.numel() / p.shard.local() * p.shard.full : p.value.numel();
  std::vector<float> v(static_cast<std::size_t>(n));
  parallel_for(v.size(), std::size_t{1} << 16, [&](std::size_t begin, std::size_t end) {
    Rng r = rng;
    r.skip(2 * begin);  // normal() draws two
    for (std::size_t i = begin; i < end; ++i) v[i] = static_cast<float>(r.normal() * stddev);
  });
  if (split) {  // the full tensor's draw, then this rank's part of it
    const std::int64_t rows = p.shard.dim == 0 ? p.shard.full : p.value.dim(0);
    v = take_shard(v, rows, n / rows, p.shard, p.shard.rank);
  }
  b.upload(v, p.value);
}

void init_constant(Backend& b, Param& p, float value) {
  if (!b.has_data() || !p.value.defined()) return;
  std::vector<float> v(static_cast<std::size_t>(p.value.numel()), value);
  b.upload(v, p.value);
}

namespace {

// Initialisation as GPT-2 (Radford et al. 2019) and Megatron-LM: N(0, 0.02^2) for weights,
// residual output projections scaled by 1/sqrt(2L) so that the residual stream's variance
// does not grow with depth.
constexpr double kInitStd = 0.02;
std::uint64_t tag(int layer, int what) { return static_cast<std::uint64_t>(layer) * 64 + static_cast<std::uint64_t>(what); }

}  // namespace

GemmProblem block_gemm(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, const Tensor& a, const Tensor& b,
                       const Tensor& c, float beta) {
  return GemmProblem{ta, tb, m, n, k, a, b, c, 1.0f, beta};
}

void require_rows(const Tensor& x, std::int64_t width, DType dtype, const std::string& who) {
  if (x.ndim() != 2 || x.dim(1) != width || x.dtype() != dtype)
    throw ConfigError(who + ": input " + x.describe() + " does not match width " + std::to_string(width) + ", dtype " +
                      dtype_name(dtype));
}

// ---- Norm ----------------------------------------------------------------------------------

Norm::Norm(Backend& b, Stream& s, const TransformerConfig& cfg, std::string name, const TensorParallel& tp)
    : b_(b), s_(s), kind_(cfg.norm), eps_(cfg.norm_eps) {
  gamma_ = make_param(b, s, name + ".gamma", {cfg.d_model}, cfg.dtype);
  if (kind_ == NormKind::layernorm) beta_ = make_param(b, s, name + ".beta", {cfg.d_model}, cfg.dtype);
  gamma_.tp_partial = beta_.tp_partial = tp.sp();
  init_parameters();
}

void Norm::init_parameters() {
  init_constant(b_, gamma_, 1.0f);
  init_constant(b_, beta_, 0.0f);
}

void Norm::collect(std::vector<Param*>& out) {
  out.push_back(&gamma_);
  if (beta_.value.defined()) out.push_back(&beta_);
}

Tensor Norm::forward(const Tensor& x, State& st) {
  const std::int64_t T = x.dim(0), M = x.dim(1);
  st.x = x;
  st.rstd = b_.empty({T}, DType::f32, MemCategory::activations, s_);                          // [T]
  if (kind_ == NormKind::layernorm) st.mean = b_.empty({T}, DType::f32, MemCategory::activations, s_);  // [T]
  Tensor y = b_.empty({T, M}, x.dtype(), MemCategory::activations, s_);                         // [T,M]
  b_.norm_forward(s_, kind_, eps_, x, gamma_.value, beta_.value, y, st.mean, st.rstd);
  return y;
}

Tensor Norm::backward(const State& st, const Tensor& dy) {
  Tensor dx = b_.empty(st.x.shape(), st.x.dtype(), MemCategory::activations, s_);  // [T,M]
  b_.norm_backward(s_, kind_, st.x, gamma_.value, st.mean, st.rstd, dy, dx, gamma_.grad, beta_.grad);
  return dx;
}

// ---- FeedForward ---------------------------------------------------------------------------

FeedForward::FeedForward(Backend& b, Stream& s, const TransformerConfig& cfg, std::int64_t width, std::string name,
                         const TensorParallel& tp)
    : b_(b), s_(s), kind_(cfg.mlp), tp_(tp), width_(width / tp.size()) {
  const bool swiglu = kind_ == MlpKind::swiglu;
  const std::int64_t M = cfg.d_model, F = width_, F1 = swiglu ? 2 * F : F;
  // W1 by columns (each SwiGLU half on its own, so a rank's W1 is again [gate | up]), W2 by rows.
  TpShard s1 = tp_shard(tp, 1, swiglu ? 2 * width : width,
                        swiglu ? std::vector<std::pair<std::int64_t, std::int64_t>>{{0, width}, {width, width}}
                               : std::vector<std::pair<std::int64_t, std::int64_t>>{},
                        name + " width");
  TpShard s2 = tp_shard(tp, 0, width, {}, name + " width");
  w1_ = make_param(b, s, name + ".w1", {M, F1}, cfg.dtype);
  w2_ = make_param(b, s, name + ".w2", {F, M}, cfg.dtype);
  w1_.shard = std::move(s1);
  w2_.shard = std::move(s2);
}

void FeedForward::init_parameters(std::uint64_t seed, std::uint64_t t, int num_layers) {
  init_normal(b_, w1_, seed, t, kInitStd);
  init_normal(b_, w2_, seed, t + 1, kInitStd / std::sqrt(2.0 * num_layers));
}

void FeedForward::collect(std::vector<Param*>& out) {
  out.push_back(&w1_);
  out.push_back(&w2_);
}

Tensor FeedForward::forward(const Tensor& in_mine, State& st) {
  st.in = in_mine;
  const Tensor in = tp_.enter(b_, s_, in_mine);  // [T,M]: all TP ranks' rows under SP
  const std::int64_t T = in.dim(0), M = in.dim(1), F = width_, F1 = w1_.value.dim(1);
  st.h = b_.empty({T, F1}, in.dtype(), MemCategory::activations, s_);  // [T,F/t] or [T,2F/t]
  b_.gemm(s_, block_gemm(false, false, T, F1, M, in, w1_.value, st.h, 0), "mlp_fc1");
  Tensor g = b_.empty({T, F}, in.dtype(), MemCategory::buffers, s_);   // [T,F], recomputed in backward
  if (kind_ == MlpKind::swiglu)
    b_.swiglu_forward(s_, st.h, g);
  else
    b_.activation_forward(s_, Activation::gelu, st.h, g);
  Tensor m = b_.empty({T, M}, in.dtype(), MemCategory::buffers, s_);   // [T,M], a partial sum under TP
  b_.gemm(s_, block_gemm(false, false, T, M, F, g, w2_.value, m, 0), "mlp_fc2");
  return tp_.leave(b_, s_, std::move(m));
}

Tensor FeedForward::backward_input(State& st, const Tensor& d_m_mine) {
  const Tensor d_m = tp_.leave_backward(b_, s_, d_m_mine);  // [T,M]
  const std::int64_t T = d_m.dim(0), M = d_m.dim(1), F = width_, F1 = w1_.value.dim(1);
  const DType dt = st.h.dtype();
  st.g = b_.empty({T, F}, dt, MemCategory::buffers, s_);  // g = act(h), again
  if (kind_ == MlpKind::swiglu)
    b_.swiglu_forward(s_, st.h, st.g);
  else
    b_.activation_forward(s_, Activation::gelu, st.h, st.g);
  Tensor d_g = b_.empty({T, F}, dt, MemCategory::buffers, s_);  // dg = dm · W2^T
  b_.gemm(s_, block_gemm(false, true, T, F, M, d_m, w2_.value, d_g, 0), "mlp_fc2_dgrad");
  st.d_h = b_.empty({T, F1}, dt, MemCategory::buffers, s_);
  if (kind_ == MlpKind::swiglu)
    b_.swiglu_backward(s_, st.h, d_g, st.d_h);
  else
    b_.activation_backward(s_, Activation::gelu, st.h, d_g, st.d_h);
  Tensor d_in = b_.empty({T, M}, dt, MemCategory::buffers, s_);  // d_in = dh · W1^T, a partial sum under TP
  b_.gemm(s_, block_gemm(false, true, T, M, F1, st.d_h, w1_.value, d_in, 0), "mlp_fc1_dgrad");
  st.d_m = d_m;
  st.h = Tensor();
  return tp_.enter_backward(b_, s_, std::move(d_in));
}

void FeedForward::backward_weight(State& st) {
  const std::int64_t T = st.d_m.dim(0), M = st.d_m.dim(1), F = width_, F1 = w1_.value.dim(1);
  b_.gemm(s_, block_gemm(true, false, F, M, T, st.g, st.d_m, w2_.grad, 1), "mlp_fc2_wgrad");  // dW2 += g^T · dm
  const Tensor in = tp_.enter(b_, s_, st.in);  // gathered again under SP
  b_.gemm(s_, block_gemm(true, false, M, F1, T, in, st.d_h, w1_.grad, 1), "mlp_fc1_wgrad");  // dW1 += in^T · dh
  st = State{};
}

// ---- Embedding -----------------------------------------------------------------------------

namespace {
struct EmbeddingSaved final : Saved {
  using Saved::Saved;
  Tensor ids, dy;
};
}  // namespace

Embedding::Embedding(Backend& b, Stream& s, const TransformerConfig& cfg, const TensorParallel& tp)
    : b_(b), s_(s), cfg_(cfg), tp_(tp) {
  const std::int64_t V = tp.padded_vocab(cfg.vocab_size);
  TpShard rows = tp_shard(tp, 0, V, {}, "embedding.wte vocabulary");
  wte_ = make_param(b, s, "embedding.wte", {V / tp.size(), cfg.d_model}, cfg.dtype);  // [V/t,M]
  wte_.shard = std::move(rows);
  if (cfg.positions == PositionKind::learned)
    wpe_ = make_param(b, s, "embedding.wpe", {cfg.seq_len, cfg.d_model}, cfg.dtype);
}

void Embedding::init_parameters(std::uint64_t seed) {
  init_normal(b_, wte_, seed, tag(0, 1), kInitStd);
  if (wpe_.value.defined()) init_normal(b_, wpe_, seed, tag(0, 2), kInitStd / 2);  // GPT-2: 0.01
}

void Embedding::collect(std::vector<Param*>& out) {
  out.push_back(&wte_);
  if (wpe_.value.defined()) out.push_back(&wpe_);
}

Forwarded Embedding::forward(const Tensor& ids, const WorkKey& key) {
  if (ids.ndim() != 1 || ids.dtype() != DType::i32 || ids.dim(0) % cfg_.seq_len != 0)
    throw ConfigError("embedding: token ids " + ids.describe() + " must be [B*S] int32 with S = " +
                      std::to_string(cfg_.seq_len));
  MicrobatchScope mb(b_, key.microbatch);
  PhaseScope ph(b_, kind());
  if (tp_.sp() && ids.dim(0) % tp_.size() != 0)
    throw ConfigError("embedding: " + std::to_string(ids.dim(0)) + " tokens do not split over the " +
                      std::to_string(tp_.size()) + " ranks of the tensor-parallel group (sequence parallelism)");
  auto sv = std::make_unique<EmbeddingSaved>(key);
  sv->ids = ids;
  const std::int64_t T = ids.dim(0), M = cfg_.d_model;
  // Under TP each rank looks up the ids in its rows of the vocabulary (zeros for the others')
  // and one rank adds the positions: the sum over the group is the embedding (Megatron's
  // VocabParallelEmbedding), an all-reduce, or a reduce-scatter to the rank's rows under SP.
  Tensor y = b_.empty({T, M}, cfg_.dtype, tp_.sp() ? MemCategory::buffers : MemCategory::activations, s_);  // [T,M]
  b_.embedding_forward(s_, ids, wte_.value, tp_.rank() == 0 ? wpe_.value : Tensor(), cfg_.seq_len, y,
                       tp_.vocab_shard(cfg_.vocab_size));
  return {tp_.leave(b_, s_, std::move(y), MemCategory::activations), std::move(sv)};  // [T,M] or [T/t,M]
}

Tensor Embedding::backward_input(Saved& saved, const Tensor& dy) {
  auto& sv = saved_as<EmbeddingSaved>(saved, "embedding");
  sv.dy = dy;
  sv.input_done = true;
  return Tensor();  // token ids have no gradient
}

void Embedding::backward_weight(Saved& saved) {
  auto& sv = saved_as<EmbeddingSaved>(saved, "embedding");
  MicrobatchScope mb(b_, sv.key.microbatch);
  PhaseScope ph(b_, kind());
  const Tensor dy = tp_.leave_backward(b_, s_, sv.dy);  // [T,M]: every rank's rows under SP
  // Every TP rank makes the whole d_wpe from the whole dy; its rows of d_wte.
  b_.embedding_backward(s_, dy, sv.ids, cfg_.seq_len, wte_.grad, wpe_.grad, tp_.vocab_shard(cfg_.vocab_size));
  sv.dy = Tensor();
  sv.weight_done = true;
}

// ---- AttentionBlock ------------------------------------------------------------------------

namespace {
struct AttentionSaved final : Saved {
  using Saved::Saved;
  Norm::State norm;
  Tensor a;         // [T,M] normed input (dWqkv); the rank's [T/t,M] under SP, gathered again in W
  Tensor qkv;       // [T,Q/t] after rope (attention backward)
  Tensor o, lse;    // [T,Hq·D/t] attention output (its backward, dWo); [B,Hq/t,S] fp32
  Tensor dy, d_qkv; // B -> W: dy [T,M] (gathered under SP), d_qkv [T,Q/t]
};
}  // namespace

AttentionBlock::AttentionBlock(Backend& b, Stream& s, const TransformerConfig& cfg, int layer, const TensorParallel& tp)
    : b_(b), s_(s), cfg_(cfg), layer_(layer), tp_(tp),
      norm_(b, s, cfg, "layer" + std::to_string(layer) + ".attn_norm", tp), window_slots_(b, s) {
  const std::int64_t M = cfg.d_model, D = cfg.head_dim(), t = tp.size();
  const std::int64_t Hq = cfg.num_heads, Hkv = cfg.num_kv_heads;
  const std::string p = "layer" + std::to_string(layer) + ".attn";
  if (Hq % t != 0 || Hkv % t != 0)
    throw ConfigError(cfg.origin + ": " + std::to_string(Hq) + " query and " + std::to_string(Hkv) +
                      " key/value heads do not split over tensor-parallel size " + std::to_string(t));
  // W_qkv by columns, each of its q, k, v parts on its own: a rank's W_qkv is [q | k | v] of its heads.
  TpShard sq = tp_shard(tp, 1, (Hq + 2 * Hkv) * D, {{0, Hq * D}, {Hq * D, Hkv * D}, {(Hq + Hkv) * D, Hkv * D}},
                        p + ".wqkv heads");
  TpShard so = tp_shard(tp, 0, Hq * D, {}, p + ".wo heads");
  wqkv_ = make_param(b, s, p + ".wqkv", {M, (Hq + 2 * Hkv) * D / t}, cfg.dtype);
  wo_ = make_param(b, s, p + ".wo", {Hq * D / t, M}, cfg.dtype);
  wqkv_.shard = std::move(sq);
  wo_.shard = std::move(so);
}

AttentionShape AttentionBlock::shape(std::int64_t tokens) const {
  AttentionShape a = cfg_.attention(tokens / cfg_.seq_len);
  a.heads /= tp_.size();
  a.kv_heads /= tp_.size();
  return a;
}

const Tensor* AttentionBlock::windows(std::int64_t tokens) {
  const std::int64_t g = cfg_.grid, area = g * g;
  if (g == 0 || cfg_.seq_len == area) return nullptr;  // not a vision stage, or one window per image
  const std::int64_t w = static_cast<std::int64_t>(std::lround(std::sqrt(static_cast<double>(cfg_.seq_len))));
  return &window_slots_.get(tokens, tokens, 1, [&] { return window_slots(tokens / area, g, w); });
}

void AttentionBlock::init_parameters(std::uint64_t seed) {
  norm_.init_parameters();
  init_normal(b_, wqkv_, seed, tag(layer_ + 1, 1), kInitStd);
  init_normal(b_, wo_, seed, tag(layer_ + 1, 2), kInitStd / std::sqrt(2.0 * cfg_.num_layers));
}

void AttentionBlock::collect(std::vector<Param*>& out) {
  norm_.collect(out);
  out.push_back(&wqkv_);
  out.push_back(&wo_);
}

Forwarded AttentionBlock::forward(const Tensor& x, const WorkKey& key) {
  require_rows(x, cfg_.d_model, cfg_.dtype, "attention block");
  const std::int64_t T = x.dim(0) * (tp_.sp() ? tp_.size() : 1), M = cfg_.d_model;  // tokens of the microbatch
  if (T % cfg_.seq_len != 0)
    throw ConfigError("attention block: " + std::to_string(T) + " tokens are not whole sequences of " +
                      std::to_string(cfg_.seq_len));
  const AttentionShape a = shape(T);
  const std::int64_t Q = a.qkv_width(), HD = static_cast<std::int64_t>(a.heads) * a.head_dim;
  MicrobatchScope mb(b_, key.microbatch);
  PhaseScope ph(b_, kind());
  auto sv = std::make_unique<AttentionSaved>(key);
  sv->a = norm_.forward(x, sv->norm);
  // Window attention (a vision stage): the rows regrouped window by window once here, and back
  // after the output projection; every GEMM works row by row, so the block's saved tensors
  // (a, qkv, o, and dy in B) are all in window order.
  const Tensor* win = windows(T);
  if (win) {
    Tensor a_w = b_.empty({T, M}, cfg_.dtype, MemCategory::activations, s_);
    b_.permute(s_, sv->a, *win, a_w);
    sv->a = a_w;
  }
  const Tensor a_all = tp_.enter(b_, s_, sv->a);                         // [T,M]
  sv->qkv = b_.empty({T, Q}, cfg_.dtype, MemCategory::activations, s_);  // [T,Q/t]
  b_.gemm(s_, block_gemm(false, false, T, Q, M, a_all, wqkv_.value, sv->qkv, 0), "qkv");
  if (recompute_norm_) sv->a = Tensor();  // W makes it again from the norm's input
  if (cfg_.positions == PositionKind::rotary) b_.rope(s_, a, cfg_.rope_theta, false, sv->qkv);
  sv->o = b_.empty({T, HD}, cfg_.dtype, MemCategory::activations, s_);                         // [T,Hq·D/t]
  sv->lse = b_.empty({a.batch, a.heads, a.seq}, DType::f32, MemCategory::activations, s_);     // [B,Hq/t,S]
  b_.attention_forward(s_, a, sv->qkv, sv->o, sv->lse);
  Tensor p = b_.empty({T, M}, cfg_.dtype, MemCategory::buffers, s_);  // [T,M], a partial sum under TP
  b_.gemm(s_, block_gemm(false, false, T, M, HD, sv->o, wo_.value, p, 0), "attn_out");
  if (win) {  // back to the image's row order
    Tensor p_rows = b_.empty({T, M}, cfg_.dtype, MemCategory::buffers, s_);
    b_.permute_backward(s_, p, *win, p_rows);
    p = p_rows;
  }
  p = tp_.leave(b_, s_, std::move(p));                                // [T,M] or [T/t,M]
  Tensor y = b_.empty(x.shape(), cfg_.dtype, MemCategory::activations, s_);
  b_.add(s_, x, p, y);  // residual
  return {y, std::move(sv)};
}

Tensor AttentionBlock::backward_input(Saved& saved, const Tensor& dy_mine) {
  auto& sv = saved_as<AttentionSaved>(saved, "attention block");
  Tensor dy = tp_.leave_backward(b_, s_, dy_mine);  // [T,M]
  const std::int64_t T = dy.dim(0), M = cfg_.d_model;
  const Tensor* win = windows(T);
  if (win) {  // window order, as the saved tensors
    Tensor dy_w = b_.empty({T, M}, cfg_.dtype, MemCategory::buffers, s_);
    b_.permute(s_, dy, *win, dy_w);
    dy = dy_w;
  }
  const AttentionShape a = shape(T);
  const std::int64_t Q = a.qkv_width(), HD = static_cast<std::int64_t>(a.heads) * a.head_dim;
  MicrobatchScope mb(b_, sv.key.microbatch);
  PhaseScope ph(b_, kind());
  Tensor d_o = b_.empty({T, HD}, cfg_.dtype, MemCategory::buffers, s_);  // dO = dy · Wo^T
  b_.gemm(s_, block_gemm(false, true, T, HD, M, dy, wo_.value, d_o, 0), "attn_out_dgrad");
  sv.d_qkv = b_.empty({T, Q}, cfg_.dtype, MemCategory::buffers, s_);
  b_.attention_backward(s_, a, sv.qkv, sv.o, sv.lse, d_o, sv.d_qkv);
  // The rotation is orthogonal: its gradient is the inverse rotation.
  if (cfg_.positions == PositionKind::rotary) b_.rope(s_, a, cfg_.rope_theta, true, sv.d_qkv);
  Tensor d_a = b_.empty({T, M}, cfg_.dtype, MemCategory::buffers, s_);  // da = dqkv · Wqkv^T, a partial sum under TP
  b_.gemm(s_, block_gemm(false, true, T, M, Q, sv.d_qkv, wqkv_.value, d_a, 0), "qkv_dgrad");
  if (win) {
    Tensor d_a_rows = b_.empty({T, M}, cfg_.dtype, MemCategory::buffers, s_);
    b_.permute_backward(s_, d_a, *win, d_a_rows);
    d_a = d_a_rows;
  }
  d_a = tp_.enter_backward(b_, s_, std::move(d_a));                     // [T,M] or [T/t,M]
  Tensor dx = norm_.backward(sv.norm, d_a);
  b_.add(s_, dx, dy_mine, dx);  // residual
  sv.dy = dy;
  if (!recompute_norm_) sv.norm = Norm::State{};  // what W does not need goes now
  sv.qkv = sv.lse = Tensor();
  sv.input_done = true;
  return dx;
}

void AttentionBlock::backward_weight(Saved& saved) {
  auto& sv = saved_as<AttentionSaved>(saved, "attention block");
  const std::int64_t T = sv.dy.dim(0), M = cfg_.d_model, Q = sv.d_qkv.dim(1), HD = sv.o.dim(1);
  MicrobatchScope mb(b_, sv.key.microbatch);
  PhaseScope ph(b_, kind());
  b_.gemm(s_, block_gemm(true, false, HD, M, T, sv.o, sv.dy, wo_.grad, 1), "attn_out_wgrad");  // dWo += O^T · dy
  if (!sv.a.defined()) {  // selective recomputation: the normed input again, from the norm's input
    Norm::State again;
    sv.a = norm_.forward(sv.norm.x, again);
    sv.norm = Norm::State{};
    if (const Tensor* win = windows(T)) {
      Tensor a_w = b_.empty({T, M}, cfg_.dtype, MemCategory::buffers, s_);
      b_.permute(s_, sv.a, *win, a_w);
      sv.a = a_w;
    }
  }
  const Tensor a_all = tp_.enter(b_, s_, sv.a);                                         // gathered again under SP
  b_.gemm(s_, block_gemm(true, false, M, Q, T, a_all, sv.d_qkv, wqkv_.grad, 1), "qkv_wgrad");  // dWqkv += a^T · dqkv
  sv.a = sv.o = sv.dy = sv.d_qkv = Tensor();
  sv.weight_done = true;
}

// ---- FfnBlock ------------------------------------------------------------------------------

namespace {
struct FfnSaved final : Saved {
  using Saved::Saved;
  Norm::State norm;
  FeedForward::State mlp;
  SavedPtr moe;
  float aux_grad = 0.0f;
};
}  // namespace

FfnBlock::FfnBlock(Backend& b, Stream& s, const TransformerConfig& cfg, int layer, const TensorParallel& tp)
    : b_(b), s_(s), cfg_(cfg), layer_(layer), norm_(b, s, cfg, "layer" + std::to_string(layer) + ".mlp_norm", tp) {
  mlp_ = std::make_unique<FeedForward>(b, s, cfg, cfg.d_ffn, "layer" + std::to_string(layer) + ".mlp", tp);
}

FfnBlock::FfnBlock(Backend& b, Stream& s, const TransformerConfig& cfg, int layer, std::unique_ptr<MoEImpl> moe,
                   float aux_loss_coef, const TensorParallel& tp)
    : b_(b), s_(s), cfg_(cfg), layer_(layer), norm_(b, s, cfg, "layer" + std::to_string(layer) + ".moe_norm", tp),
      moe_(std::move(moe)), aux_loss_coef_(aux_loss_coef) {
  MOELAB_CHECK(moe_ != nullptr, "an MoE block needs an MoE implementation");
  // TP without sequence parallelism: the group's ranks hold the same tokens, and their residual
  // streams stay equal only if the noisy gate routes them alike: one noise key per TP group
  // (its lowest world rank; under SP each rank's tokens are its own and keep their own key).
  if (tp.on() && !tp.sp()) {
    const std::vector<int> ranks = tp.comm->world_ranks();
    moe_->layer().share_noise_rank(static_cast<std::uint64_t>(*std::min_element(ranks.begin(), ranks.end())));
  }
  // Under SP the TP ranks route disjoint rows of the sequence: the load-balancing loss is the
  // whole sequence's (Megatron-Core's sequence-partition group), its counts summed over TP on
  // the model's stream, which the MoE layer's compute stream is.
  if (tp.sp()) {
    if (moe_->tp_deduplicated())
      throw ConfigError(moe_->name() + " deduplicates its exchange over the TP group, which needs every TP rank to hold "
                        "the same tokens: not with sequence parallelism (--sequence-parallel), where each holds its own "
                        "T/tp rows");
    MOELAB_CHECK(&moe_->layer().compute_stream() == &s_, "an MoE layer under SP must compute on its model's stream");
    moe_->layer().partition_sequence(tp.comm);
  }
  if (cfg.shared_expert_hidden > 0)
    mlp_ = std::make_unique<FeedForward>(b, s, cfg, cfg.shared_expert_hidden,
                                         "layer" + std::to_string(layer) + ".shared_expert", tp);
}

FfnBlock::~FfnBlock() = default;

void FfnBlock::init_parameters(std::uint64_t seed) {
  norm_.init_parameters();
  if (mlp_) mlp_->init_parameters(seed, tag(layer_ + 1, 8), cfg_.num_layers);
  if (moe_) moe_->init_parameters(Rng::mix(seed, tag(layer_ + 1, 16)));
}

void FfnBlock::collect(std::vector<Param*>& out) {
  norm_.collect(out);
  if (mlp_) mlp_->collect(out);
  // The MoE layer's parameters are named and grouped by the model (its gate is replicated,
  // its experts sharded); see Model::collect.
}

Forwarded FfnBlock::forward(const Tensor& x, const WorkKey& key) {
  require_rows(x, cfg_.d_model, cfg_.dtype, moe_ ? "MoE block" : "MLP block");
  MicrobatchScope mb(b_, key.microbatch);
  PhaseScope ph(b_, kind());
  auto sv = std::make_unique<FfnSaved>(key);
  const Tensor bn = norm_.forward(x, sv->norm);  // [T,M]
  Tensor out;
  if (moe_) {
    Forwarded f = moe_->forward(bn, key);
    sv->moe = std::move(f.saved);
    sv->aux_grad = aux_loss_coef_ * aux_grad_scale_;
    out = f.y;
  }
  if (mlp_) {
    Tensor m = mlp_->forward(bn, sv->mlp);
    if (recompute_norm_) sv->mlp.in = Tensor();  // W makes it again from the norm's input
    if (out.defined())
      b_.add(s_, out, m, out);  // routed + shared expert
    else
      out = m;
  }
  Tensor y = b_.empty(x.shape(), cfg_.dtype, MemCategory::activations, s_);
  b_.add(s_, x, out, y);  // residual
  return {y, std::move(sv)};
}

Tensor FfnBlock::backward_input(Saved& saved, const Tensor& dy) {
  auto& sv = saved_as<FfnSaved>(saved, "FFN block");
  MicrobatchScope mb(b_, sv.key.microbatch);
  PhaseScope ph(b_, kind());
  Tensor d_bn;
  if (moe_) d_bn = moe_->backward_input(*sv.moe, dy, sv.aux_grad);
  if (mlp_) {
    Tensor d2 = mlp_->backward_input(sv.mlp, dy);
    if (d_bn.defined())
      b_.add(s_, d_bn, d2, d_bn);
    else
      d_bn = d2;
  }
  Tensor dx = norm_.backward(sv.norm, d_bn);
  b_.add(s_, dx, dy, dx);  // residual
  if (!recompute_norm_) sv.norm = Norm::State{};
  sv.input_done = true;
  return dx;
}

void FfnBlock::backward_weight(Saved& saved) {
  auto& sv = saved_as<FfnSaved>(saved, "FFN block");
  MicrobatchScope mb(b_, sv.key.microbatch);
  PhaseScope ph(b_, kind());
  if (moe_) {
    moe_->backward_weight(*sv.moe);
    sv.moe.reset();
  }
  if (mlp_ && !sv.mlp.in.defined()) {  // selective recomputation of the norm
    Norm::State again;
    sv.mlp.in = norm_.forward(sv.norm.x, again);
    sv.norm = Norm::State{};
  }
  if (mlp_) mlp_->backward_weight(sv.mlp);
  sv.weight_done = true;
}

float FfnBlock::aux_loss(const Saved& saved) {
  if (!moe_) return 0.0f;
  const auto* sv = dynamic_cast<const FfnSaved*>(&saved);
  MOELAB_CHECK(sv != nullptr && sv->moe != nullptr, "FfnBlock::aux_loss: not the saved state of a forward");
  return moe_->aux_loss(*sv->moe);
}

// ---- Head ----------------------------------------------------------------------------------

namespace {
struct HeadSaved final : Saved {
  using Saved::Saved;
  Norm::State norm;
  Tensor h;               // [T,M] normed input (the LM head's weight gradient); [T/t,M] under SP
  Tensor logits, lse;     // [T,V/t], [T] fp32 (the whole row's)
  Tensor targets, losses; // [T] int32, [T] fp32
  Tensor d_logits;        // B -> W [T,V/t]
  float scale = 1.0f;
};
}  // namespace

Head::Head(Backend& b, Stream& s, const TransformerConfig& cfg, Param* tied_wte, const TensorParallel& tp)
    : b_(b), s_(s), cfg_(cfg), tp_(tp), norm_(b, s, cfg, "final_norm", tp),
      tied_(cfg.tie_embeddings ? tied_wte : nullptr) {
  if (!tied_) {
    const std::int64_t V = tp.padded_vocab(cfg.vocab_size);
    TpShard cols = tp_shard(tp, 1, V, {}, "lm_head.w vocabulary");
    own_w_ = make_param(b, s, "lm_head.w", {cfg.d_model, V / tp.size()}, cfg.dtype);  // [M,V/t]
    own_w_.shard = std::move(cols);
  }
}

void Head::init_parameters(std::uint64_t seed) {
  norm_.init_parameters();
  if (!tied_) init_normal(b_, own_w_, seed, tag(0, 3), kInitStd);
}

void Head::collect(std::vector<Param*>& out) {
  norm_.collect(out);
  if (!tied_) out.push_back(&own_w_);
}

Forwarded Head::forward(const Tensor& x, const WorkKey& key) {
  require_rows(x, cfg_.d_model, cfg_.dtype, "head");
  const std::int64_t T = x.dim(0) * (tp_.sp() ? tp_.size() : 1), M = cfg_.d_model;
  const std::int64_t V = tp_.padded_vocab(cfg_.vocab_size) / tp_.size();  // this rank's columns
  if (!targets_.defined() || targets_.ndim() != 1 || targets_.dim(0) != T || targets_.dtype() != DType::i32)
    throw ConfigError("head: targets must be [" + std::to_string(T) + "] int32, got " +
                      (targets_.defined() ? targets_.describe() : std::string("none")));
  MicrobatchScope mb(b_, key.microbatch);
  PhaseScope ph(b_, kind());
  auto sv = std::make_unique<HeadSaved>(key);
  sv->h = norm_.forward(x, sv->norm);
  const Tensor h = tp_.enter(b_, s_, sv->h);                                  // [T,M]
  sv->logits = b_.empty({T, V}, cfg_.dtype, MemCategory::activations, s_);  // [T,V/t]
  if (tied_)
    b_.gemm(s_, block_gemm(false, true, T, V, M, h, tied_->value, sv->logits, 0), "lm_head");
  else
    b_.gemm(s_, block_gemm(false, false, T, V, M, h, own_w_.value, sv->logits, 0), "lm_head");
  sv->losses = b_.empty({T}, DType::f32, MemCategory::activations, s_);
  sv->lse = b_.empty({T}, DType::f32, MemCategory::activations, s_);
  sv->targets = targets_;
  sv->scale = loss_scale_;
  if (!tp_.on()) {
    b_.cross_entropy_forward(s_, sv->logits, sv->targets, sv->losses, sv->lse);
  } else {
    // Megatron's vocabulary-parallel cross-entropy: each rank's loss and log-sum-exp over its
    // columns, all-gathered ([t,2,T] fp32, 8·T bytes per rank) and combined into the row's.
    Tensor part = b_.empty({2, T}, DType::f32, MemCategory::buffers, s_);               // [losses; lse]
    Tensor part_loss = part.select(0), part_lse = part.select(1);
    b_.cross_entropy_forward(s_, sv->logits, sv->targets, part_loss, part_lse, tp_.vocab_shard(cfg_.vocab_size));
    Tensor parts = b_.empty({tp_.size(), 2, T}, DType::f32, MemCategory::buffers, s_);  // [t,2,T]
    tp_.comm->all_gather(s_, part, parts);
    b_.cross_entropy_combine(s_, parts, sv->targets, V, sv->losses, sv->lse);
  }
  Tensor losses = sv->losses;
  return {losses, std::move(sv)};
}

Tensor Head::backward_input(Saved& saved, const Tensor&) {
  auto& sv = saved_as<HeadSaved>(saved, "head");
  const std::int64_t T = sv.targets.dim(0), M = cfg_.d_model, V = sv.logits.dim(1);
  MicrobatchScope mb(b_, sv.key.microbatch);
  PhaseScope ph(b_, kind());
  sv.d_logits = b_.empty({T, V}, cfg_.dtype, MemCategory::buffers, s_);  // [T,V/t]
  b_.cross_entropy_backward(s_, sv.logits, sv.targets, sv.lse, sv.scale, sv.d_logits,
                            tp_.vocab_shard(cfg_.vocab_size));
  sv.logits = Tensor();
  Tensor d_h = b_.empty({T, M}, cfg_.dtype, MemCategory::buffers, s_);  // dh = dlogits · W^T, a partial sum under TP
  if (tied_)
    b_.gemm(s_, block_gemm(false, false, T, M, V, sv.d_logits, tied_->value, d_h, 0), "lm_head_dgrad");
  else
    b_.gemm(s_, block_gemm(false, true, T, M, V, sv.d_logits, own_w_.value, d_h, 0), "lm_head_dgrad");
  d_h = tp_.enter_backward(b_, s_, std::move(d_h));  // summed over the vocabulary's shards: [T,M] or [T/t,M]
  Tensor dx = norm_.backward(sv.norm, d_h);
  sv.norm = Norm::State{};
  sv.input_done = true;
  return dx;
}

void Head::backward_weight(Saved& saved) {
  auto& sv = saved_as<HeadSaved>(saved, "head");
  const std::int64_t T = sv.d_logits.dim(0), M = cfg_.d_model, V = sv.d_logits.dim(1);
  MicrobatchScope mb(b_, sv.key.microbatch);
  PhaseScope ph(b_, kind());
  const Tensor h = tp_.enter(b_, s_, sv.h);  // [T,M], gathered again under SP
  if (tied_)  // dWte += dlogits^T · h
    b_.gemm(s_, block_gemm(true, false, V, M, T, sv.d_logits, h, tied_->grad, 1), "lm_head_wgrad");
  else  // dW += h^T · dlogits
    b_.gemm(s_, block_gemm(true, false, M, V, T, h, sv.d_logits, own_w_.grad, 1), "lm_head_wgrad");
  sv.d_logits = sv.h = Tensor();
  sv.weight_done = true;
}

}  // namespace moelab
