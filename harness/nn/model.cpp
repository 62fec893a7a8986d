// harness/nn/model.cpp — a transformer (or a range of its layers) from a model file, and its
// optimizer. See model.hpp.
//   ctest --test-dir build -R model_test
#include "harness/nn/model.hpp"

#include <cmath>
#include <numeric>

#include "harness/nn/layer_group.hpp"
#include "harness/nn/vision.hpp"
#include "harness/runtime/error.hpp"

namespace moelab {

namespace {
LayerGroupFactory& shortcut_pair_slot() {
  static LayerGroupFactory f;
  return f;
}
}  // namespace

void register_shortcut_pair(LayerGroupFactory f) { shortcut_pair_slot() = std::move(f); }
const LayerGroupFactory& shortcut_pair_factory() { return shortcut_pair_slot(); }

namespace {
struct ModelSaved final : Saved {
  using Saved::Saved;
  std::vector<SavedPtr> blocks;  // one per block, in forward order
  Tensor losses, targets;        // last stage: [T] fp32, [T] int32
};
}  // namespace

Model::Model(Backend& b, Communicator& ep, const TransformerConfig& cfg, const ModelOptions& opt)
    : b_(b), ep_(ep), cfg_(cfg), opt_(opt), tp_{opt.tp, opt.sequence_parallel}, s_(b.default_stream()) {
  first_ = opt.first_layer;
  last_ = opt.last_layer < 0 ? cfg.num_layers : opt.last_layer;
  // An empty range only for a pipeline chunk that holds the embedding or the head alone (the
  // uneven split, harness/pipeline/executor.hpp).
  const bool empty_ok = opt.allow_empty_range && first_ == last_ && (first_ == 0 || last_ == cfg.num_layers);
  if (first_ < 0 || (first_ >= last_ && !empty_ok) || last_ > cfg.num_layers)
    throw ConfigError("--layers " + std::to_string(first_) + ":" + std::to_string(last_) + " is not a range of the " +
                      std::to_string(cfg.num_layers) + " layers of " + cfg.name);
  b.set_allow_tf32(cfg.allow_tf32);
  const bool vision = cfg.vision.enabled;
  if (vision && (first_ != 0 || last_ != cfg.num_layers))
    throw ConfigError("--layers " + std::to_string(first_) + ":" + std::to_string(last_) + ": " + cfg.origin +
                      " is a vision model (\"vision\"), which runs whole on every rank (no pipeline stages: the "
                      "stages' widths differ)");
  if (vision && tp_.on())
    throw ConfigError(cfg.origin + ": a vision model (\"vision\") is not built for tensor parallelism (tp = " +
                      std::to_string(tp_.size()) + ")");
  if (first_ == 0 && vision) {
    auto e = std::make_unique<PatchEmbed>(b, s_, cfg);
    patch_embed_ = e.get();
    blocks_.push_back(std::move(e));
  } else if (first_ == 0 && !opt.without_embedding) {
    auto e = std::make_unique<Embedding>(b, s_, cfg, tp_);
    embedding_ = e.get();
    blocks_.push_back(std::move(e));
  }
  // ScMoE (cfg.scmoe): each MoE layer with the layers its shortcut reaches back into is one
  // block pair (a LayerGroup, impls/scmoe), which a layer range may not cut.
  const int span = cfg.scmoe.span();
  if (span == 2 && cfg.is_moe(first_))
    throw ConfigError("--layers " + std::to_string(first_) + ":" + std::to_string(last_) + " starts inside ScMoE's block pair (" +
                      std::to_string(first_ - 1) + ", " + std::to_string(first_) + ") of " + cfg.name);
  if (span == 2 && last_ < cfg.num_layers && cfg.is_moe(last_))
    throw ConfigError("--layers " + std::to_string(first_) + ":" + std::to_string(last_) + " ends inside ScMoE's block pair (" +
                      std::to_string(last_ - 1) + ", " + std::to_string(last_) + ") of " + cfg.name);
  if (span > 0 && tp_.on())
    throw ConfigError(cfg.origin + ": ScMoE's block pair (\"scmoe\") is not built for tensor parallelism (tp = " +
                      std::to_string(tp_.size()) + ")");
  routed_top_k_.assign(static_cast<std::size_t>(last_ - first_), 0);
  for (int l = first_; l < last_; ++l) {
    // The layer's own sizes (a vision model's stage; the model's otherwise), and a patch merging
    // before each stage but the first.
    const TransformerConfig lc = cfg.layer_config(l);
    if (vision && l > 0 && cfg.vision.stage_of(l) != cfg.vision.stage_of(l - 1))
      blocks_.push_back(std::make_unique<PatchMerging>(b, s_, cfg.layer_config(l - 1), cfg.vision.stage_of(l)));
    if (span > 0 && l + span - 1 < last_ && cfg.is_moe(l + span - 1)) {
      if (!shortcut_pair_factory())
        throw ConfigError(cfg.origin + ": \"scmoe\" needs ScMoE's block pair, which this binary does not have");
      if (!channels_) channels_ = std::make_unique<MoEChannels>(b, ep, tp_.comm);
      blocks_.push_back(shortcut_pair_factory()(
          {b, s_, lc, l, make_impl(opt.impl, b, ep, lc.moe, opt.impl_options, channels_.get()), opt.aux_loss_coef}));
      routed_top_k_[static_cast<std::size_t>(l + span - 1 - first_)] =
          static_cast<LayerGroup&>(*blocks_.back()).moe()->layer().config().top_k;
      l += span - 1;
      continue;
    }
    blocks_.push_back(std::make_unique<AttentionBlock>(b, s_, lc, l, tp_));
    if (cfg.is_moe(l)) {
      // Every MoE layer of the model issues on one set of streams and communicators: L layers
      // do not make 2L streams and 2L duplicates of the expert-parallel communicator.
      if (!channels_) channels_ = std::make_unique<MoEChannels>(b, ep, tp_.comm);
      auto impl = make_impl(opt.impl, b, ep, lc.moe, opt.impl_options, channels_.get());
      routed_top_k_[static_cast<std::size_t>(l - first_)] = impl->layer().config().top_k;  // a baseline's own k
      blocks_.push_back(std::make_unique<FfnBlock>(b, s_, lc, l, std::move(impl), opt.aux_loss_coef, tp_));
    }
    else
      blocks_.push_back(std::make_unique<FfnBlock>(b, s_, lc, l, tp_));
  }
  if (vision) {
    auto h = std::make_unique<ClassifierHead>(b, s_, cfg.layer_config(cfg.num_layers - 1));
    classifier_ = h.get();
    blocks_.push_back(std::move(h));
  } else if (last_ == cfg.num_layers && !opt.without_head) {
    // Tied embeddings across stages: the head's own copy, whose gradient the pipeline sums with
    // the embedding's (Megatron's embedding group; ModelOptions::tied_embedding_copy); within
    // one stage they are one tensor.
    if (cfg.tie_embeddings && !embedding_ && !opt.tied_embedding_copy)
      throw ConfigError(cfg.origin + ": tie_embeddings needs the embedding and the head on one stage; "
                        "this range " + std::to_string(first_) + ":" + std::to_string(last_) + " has only the head");
    if (cfg.tie_embeddings && !embedding_) {
      // The same shape and vocabulary shard as the embedding's table (tensor_parallel.hpp).
      const std::int64_t V = tp_.padded_vocab(cfg.vocab_size);
      wte_copy_ = make_param(b, s_, "embedding.wte", {V / tp_.size(), cfg.d_model}, cfg.dtype);  // [V/t,M]
      wte_copy_.shard = tp_shard(tp_, 0, V, {}, "embedding.wte vocabulary");
    }
    auto h = std::make_unique<Head>(b, s_, cfg, embedding_ ? &embedding_->wte() : &wte_copy_, tp_);
    head_ = h.get();
    blocks_.push_back(std::move(h));
  }
  if (opt.recompute_norms)
    for (auto& blk : blocks_) {
      if (auto* a = dynamic_cast<AttentionBlock*>(blk.get())) a->set_recompute_norm(true);
      if (auto* f = dynamic_cast<FfnBlock*>(blk.get())) f->set_recompute_norm(true);
    }
}

Model::~Model() = default;

void Model::init_parameters(std::uint64_t seed) {
  for (auto& blk : blocks_) blk->init_parameters(seed);
  if (wte_copy_.value.defined()) b_.fill_zero(s_, wte_copy_.value);
}

void Model::zero_grad() {
  for (auto& p : parameters()) {
    MOELAB_CHECK(p.grad.defined(), "Model::zero_grad: " + p.name + " has no gradient (released for inference)");
    b_.fill_zero(s_, p.grad);
  }
}

void Model::release_gradients() {
  for (auto& s : param_slots()) *s.grad = Tensor();
  gradients_released_ = true;
}

std::vector<MoEImpl*> Model::moe_layers() {
  std::vector<MoEImpl*> v;
  for (auto& blk : blocks_) {
    if (auto* f = dynamic_cast<FfnBlock*>(blk.get()); f && f->moe()) v.push_back(f->moe());
    if (auto* g = dynamic_cast<LayerGroup*>(blk.get()); g && g->moe()) v.push_back(g->moe());
  }
  return v;
}

std::vector<Param> Model::parameters() {
  std::vector<Param> out;
  for (auto& s : param_slots()) out.push_back(std::move(s.param));
  return out;
}

std::vector<ParamSlot> Model::param_slots() {
  std::vector<ParamSlot> out;
  int layer = first_;
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    const int block = static_cast<int>(i);
    std::vector<Param*> ps;
    auto* group = dynamic_cast<LayerGroup*>(blocks_[i].get());
    if (group) group->collect_own(ps);
    else blocks_[i]->collect(ps);
    for (Param* p : ps) out.push_back({*p, &p->value, &p->grad, block});
    auto* f = dynamic_cast<FfnBlock*>(blocks_[i].get());
    MoEImpl* m = group ? group->moe() : f ? f->moe() : nullptr;
    // A group's MoE layer is its last layer (ScMoE's Block-MoE l+1).
    const int moe_layer = group ? layer + group->num_layers() - 1 : layer;
    if (group) layer += group->num_layers();
    else if (f) ++layer;
    if (m) {
      const std::string pre = "layer" + std::to_string(moe_layer) + ".moe.";
      MoEParams& v = m->params();
      MoEParams& g = m->grads();
      auto add = [&](const char* name, Tensor& value, Tensor& grad, bool gate) {
        Param p;
        p.name = pre + name;
        p.value = value;
        p.grad = grad;
        p.replicated = gate;
        // The gate sees the rank's rows under sequence parallelism; the experts see the same
        // tokens from every TP rank without it (grad_sync.hpp).
        p.tp_partial = gate && tp_.sp();
        p.grad_copies = !gate && tp_.on() && !tp_.sp() && !m->tp_deduplicated() ? tp_.size() : 1;
        out.push_back({std::move(p), &value, &grad, block});
      };
      add("w_gate", v.w_gate, g.w_gate, true);
      if (v.w_noise.defined()) add("w_noise", v.w_noise, g.w_noise, true);
      add("w1", v.w1, g.w1, false);
      add("w2", v.w2, g.w2, false);
    }
  }
  // The head's copy of tied embeddings: final when the head's backward_weight is.
  if (wte_copy_.value.defined())
    out.push_back({wte_copy_, &wte_copy_.value, &wte_copy_.grad, static_cast<int>(blocks_.size()) - 1});
  return out;
}

Forwarded Model::forward(const Batch& batch, const WorkKey& key) { return run_forward(batch, key, true); }

Tensor Model::infer(const Batch& batch, const WorkKey& key) { return run_forward(batch, key, false).y; }

Forwarded Model::run_forward(const Batch& batch, const WorkKey& key, bool keep) {
  auto sv = std::make_unique<ModelSaved>(key);
  Tensor h = batch.input;
  // Tokens of the microbatch: the ids' count, or the residual stream's rows (under SP this
  // rank's T/tp, while the MoE layers' load-balancing loss is the whole sequence's, every TP
  // rank holding its share: MoELayer::partition_sequence). A vision model's loss is per image:
  // its MoE layers' share is the microbatch's images.
  const std::int64_t T = classifier_ ? batch.targets.numel()
                         : embedding_ ? h.dim(0)
                                      : h.dim(0) * (tp_.sp() ? tp_.size() : 1);
  int layer = first_;
  for (auto& blk : blocks_) {
    WorkKey k = key;
    k.layer = layer;
    if (blk.get() == head_) head_->set_targets(batch.targets, batch.loss_scale);
    if (blk.get() == classifier_) classifier_->set_targets(batch.targets, batch.loss_scale);
    auto* ffn = dynamic_cast<FfnBlock*>(blk.get());
    // The MoE auxiliary loss enters the objective once per microbatch, weighted like the
    // microbatch's share of the step's tokens: dL/d aux = coef · T · loss_scale.
    if (ffn) ffn->set_aux_grad_scale(static_cast<float>(T) * batch.loss_scale);
    auto* group = dynamic_cast<LayerGroup*>(blk.get());
    if (group) group->set_aux_grad_scale(static_cast<float>(T) * batch.loss_scale);
    Forwarded f = blk->forward(h, k);
    h = f.y;
    if (keep) sv->blocks.push_back(std::move(f.saved));
    if (ffn) ++layer;
    if (group) layer += group->num_layers();
  }
  if (!keep) return {h, nullptr};
  if (has_head()) {
    sv->losses = h;
    sv->targets = batch.targets;
  }
  return {h, std::move(sv)};
}

Tensor Model::backward_input(Saved& saved, const Tensor& dy) {
  MOELAB_CHECK(!gradients_released_, "model backward: the gradients were released for inference");
  auto& sv = saved_as<ModelSaved>(saved, "model");
  MOELAB_CHECK(sv.blocks.size() == blocks_.size(), "model backward: the saved state is spent");
  Tensor g = dy;
  for (std::size_t i = blocks_.size(); i-- > 0;) g = blocks_[i]->backward_input(*sv.blocks[i], g);
  sv.input_done = true;
  return g;
}

Tensor Model::backward(Saved& saved, const Tensor& dy) {
  MOELAB_CHECK(!gradients_released_, "model backward: the gradients were released for inference");
  auto& sv = saved_as<ModelSaved>(saved, "model");
  MOELAB_CHECK(!sv.input_done && sv.blocks.size() == blocks_.size(), "model backward: the saved state is spent");
  Tensor g = dy;
  for (std::size_t i = blocks_.size(); i-- > 0;) {
    g = blocks_[i]->backward_input(*sv.blocks[i], g);
    blocks_[i]->backward_weight(*sv.blocks[i]);
    sv.blocks[i].reset();
    if (sync_) sync_->block_done(static_cast<int>(i));
  }
  sv.input_done = sv.weight_done = true;
  return g;
}

void Model::backward_weight(Saved& saved) {
  auto& sv = saved_as<ModelSaved>(saved, "model");
  MOELAB_CHECK(sv.input_done && sv.blocks.size() == blocks_.size(), "model backward_weight before backward_input");
  for (std::size_t i = blocks_.size(); i-- > 0;) {
    blocks_[i]->backward_weight(*sv.blocks[i]);
    sv.blocks[i].reset();
    if (sync_) sync_->block_done(static_cast<int>(i));
  }
  sv.weight_done = true;
}

double Model::loss(const Saved& saved) {
  const auto* sv = dynamic_cast<const ModelSaved*>(&saved);
  MOELAB_CHECK(sv != nullptr && has_head(), "Model::loss: only the stage with the head has a loss");
  if (!b_.has_data()) return 0.0;
  const auto losses = b_.download(sv->losses);
  const auto targets = b_.download_i32(sv->targets);
  double sum = 0.0;
  std::int64_t counted = 0;
  for (std::size_t t = 0; t < losses.size(); ++t)
    if (targets[t] >= 0) {
      sum += losses[t];
      ++counted;
    }
  return counted ? sum / static_cast<double>(counted) : 0.0;
}

double Model::aux_loss(Saved& saved) {
  auto& sv = saved_as<ModelSaved>(saved, "model");
  double sum = 0.0;
  for (std::size_t i = 0; i < blocks_.size(); ++i)
    if (auto* f = dynamic_cast<FfnBlock*>(blocks_[i].get()); f && f->moe() && sv.blocks[i])
      sum += f->aux_loss(*sv.blocks[i]);
    else if (auto* g = dynamic_cast<LayerGroup*>(blocks_[i].get()); g && sv.blocks[i])
      sum += g->aux_loss(*sv.blocks[i]);
  return sum;
}

void Model::all_reduce_gradients(Communicator& dp, Communicator* edp) {
  PhaseScope ph(b_, "grad_sync");
  for (auto& p : parameters()) {
    if (p.grad_copies > 1) b_.scale(s_, p.grad, 1.0f / static_cast<float>(p.grad_copies), p.grad);
    if (p.tp_partial && tp_.on()) tp_.comm->all_reduce(s_, p.grad);
    if (p.replicated && dp.size() > 1) dp.all_reduce(s_, p.grad);
    if (!p.replicated && edp && edp->size() > 1) edp->all_reduce(s_, p.grad);
  }
}

double Model::model_flops(std::int64_t tokens) const {
  if (cfg_.vision.enabled) return vision_flops(tokens);
  // Matmul parameters a token meets (embedding lookups are not matmuls), times 6 for forward
  // (2) and backward (4); attention's score and value products add 6·2·S·Hq·D per token and
  // layer (PaLM, Chowdhery et al. 2022, App. B: 6N + 12·L·H·Q·T, no causal discount).
  const double M = static_cast<double>(cfg_.d_model), D = cfg_.head_dim();
  const double Hq = cfg_.num_heads, Hkv = cfg_.num_kv_heads, S = static_cast<double>(cfg_.seq_len);
  const double f1 = cfg_.mlp == MlpKind::swiglu ? 2.0 : 1.0;
  double per_token = 0.0;
  for (int l = first_; l < last_; ++l) {
    per_token += M * (Hq + 2 * Hkv) * D + Hq * D * M;  // qkv, out
    per_token += 2.0 * S * Hq * D;                     // scores and values: 12·S·Hq·D FLOPs = 6 × this
    if (cfg_.is_moe(l)) {
      const double H = static_cast<double>(cfg_.moe.d_hidden), E = static_cast<double>(cfg_.moe.num_experts);
      const std::size_t i = static_cast<std::size_t>(l - first_);
      const int k = i < routed_top_k_.size() && routed_top_k_[i] > 0 ? routed_top_k_[i] : cfg_.moe.top_k;
      per_token += M * E + k * 2.0 * M * H;  // gate; FC1 and FC2 of each chosen expert
      per_token += M * cfg_.scmoe.gate_width();           // ScMoE's combine gate W_cg
      if (cfg_.shared_expert_hidden > 0)
        per_token += f1 * M * static_cast<double>(cfg_.shared_expert_hidden) + static_cast<double>(cfg_.shared_expert_hidden) * M;
    } else {
      per_token += f1 * M * static_cast<double>(cfg_.d_ffn) + static_cast<double>(cfg_.d_ffn) * M;
    }
  }
  if (head_) per_token += M * static_cast<double>(cfg_.vocab_size);
  return 6.0 * per_token * static_cast<double>(tokens);
}

double Model::vision_flops(std::int64_t tokens) const {
  // Per image, stage by stage (tokens are stage 0's patches): each layer's matmul parameters
  // times its stage's tokens, attention over its window's S tokens, the patch embedding, the
  // merges' 4C·2C per merged token, and the classifier once per image; times 6 as above.
  const VisionConfig& v = cfg_.vision;
  double per_image = static_cast<double>(cfg_.seq_len) * static_cast<double>(v.patch_values()) * static_cast<double>(cfg_.d_model);
  for (int l = 0; l < cfg_.num_layers; ++l) {
    const TransformerConfig c = cfg_.layer_config(l);
    const double M = static_cast<double>(c.d_model), D = c.head_dim(), H = c.num_heads, S = static_cast<double>(c.seq_len);
    const double n = static_cast<double>(c.grid * c.grid);
    double per_token = M * 3 * H * D + H * D * M + 2.0 * S * H * D;
    if (c.is_moe(l)) {
      const double Hd = static_cast<double>(c.moe.d_hidden), E = static_cast<double>(c.moe.num_experts);
      const int k = routed_top_k_[static_cast<std::size_t>(l)] > 0 ? routed_top_k_[static_cast<std::size_t>(l)] : c.moe.top_k;
      per_token += M * E + k * 2.0 * M * Hd + M * c.scmoe.gate_width() + 2.0 * M * static_cast<double>(c.shared_expert_hidden);
    } else {
      per_token += 2.0 * M * static_cast<double>(c.d_ffn);
    }
    per_image += n * per_token;
    if (l + 1 < cfg_.num_layers && v.stage_of(l + 1) != v.stage_of(l)) per_image += n / 4 * (4 * M) * (2 * M);
  }
  per_image += static_cast<double>(cfg_.d_model << (v.stages.size() - 1)) * static_cast<double>(v.num_classes);
  return 6.0 * per_image * static_cast<double>(tokens) / static_cast<double>(cfg_.seq_len);
}

// ---- optimizer -----------------------------------------------------------------------------

OptimizerKind parse_optimizer(const std::string& s) {
  if (s == "adam" || s == "adamw") return OptimizerKind::adam;
  if (s == "sgd") return OptimizerKind::sgd;
  throw ConfigError("unknown optimizer \"" + s + "\" (expected adam or sgd)");
}

Optimizer::Optimizer(Backend& b, Stream& s, std::vector<Param> params, const OptimizerConfig& cfg)
    : b_(b), s_(s), cfg_(cfg) {
  for (auto& p : params) add_slot(p.value, p.grad);
}

Optimizer::Optimizer(Backend& b, Stream& s, GradSync& sync, const OptimizerConfig& cfg) : b_(b), s_(s), cfg_(cfg) {
  if (!sync.zero1()) {
    for (auto& p : sync.parameters()) add_slot(p.value, p.grad);
    return;
  }
  zero_ = &sync;
  for (std::size_t i = 0; i < sync.num_buckets(); ++i) {
    const GradSync::Shard sh = sync.shard(i);
    add_slot(sh.param, sh.grad);
  }
}

void Optimizer::add_slot(const Tensor& param, const Tensor& grad) {
  Slot sl;
  const std::vector<std::int64_t> flat{param.numel()};
  sl.param = param.reshape(flat);
  sl.grad = grad.reshape(flat);
  if (param.dtype() != DType::f32) {
    sl.master = b_.empty(flat, DType::f32, MemCategory::optimizer, s_);
    b_.copy(s_, sl.param, sl.master);
  }
  if (cfg_.kind == OptimizerKind::adam) {
    sl.m = b_.empty(flat, DType::f32, MemCategory::optimizer, s_);
    sl.v = b_.empty(flat, DType::f32, MemCategory::optimizer, s_);
    b_.fill_zero(s_, sl.m);
    b_.fill_zero(s_, sl.v);
  }
  slots_.push_back(std::move(sl));
}

void Optimizer::step() {
  ++t_;
  PhaseScope ph(b_, "optimizer");
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    Slot& sl = slots_[i];
    OptimizerStep o;
    o.kind = cfg_.kind;
    o.param = sl.param;
    o.grad = sl.grad;
    o.master = sl.master;
    o.m = sl.m;
    o.v = sl.v;
    o.lr = cfg_.lr;
    o.beta1 = cfg_.beta1;
    o.beta2 = cfg_.beta2;
    o.eps = cfg_.eps;
    o.weight_decay = cfg_.weight_decay;
    o.step = t_;
    b_.optimizer_step(s_, o);
    if (zero_) zero_->gather_parameters(i);  // this bucket's shards back to every rank of its group
  }
  if (zero_) zero_->wait_parameters();
}

}  // namespace moelab
