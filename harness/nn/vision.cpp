// harness/nn/vision.cpp — patch embedding, patch merging and the classifier head of a
// hierarchical vision transformer (see vision.hpp).
//   ctest --test-dir build -R vision_test
#include "harness/nn/vision.hpp"

#include <cmath>
#include <string>

#include "harness/runtime/error.hpp"

namespace moelab {

namespace {

constexpr double kInitStd = 0.02;  // Swin's trunc_normal_(std=.02) for linear layers
// Initialisation tags of these blocks: layer 0's range, beside the LM's embedding (1, 2) and head (3).
constexpr std::uint64_t kTagPatchEmbed = 4, kTagClassifier = 5, kTagMergeBase = 8;

// A configuration whose norms are `width` wide (a Norm reads its width from d_model).
TransformerConfig with_width(TransformerConfig c, std::int64_t width) {
  c.d_model = width;
  return c;
}

}  // namespace

std::vector<std::int32_t> window_slots(std::int64_t images, std::int64_t grid, std::int64_t window) {
  MOELAB_CHECK(window >= 1 && grid % window == 0, "window_slots: the window must divide the feature map");
  const std::int64_t per = grid / window, area = grid * grid, w2 = window * window;
  std::vector<std::int32_t> slot(static_cast<std::size_t>(images * area));
  std::size_t t = 0;
  for (std::int64_t b = 0; b < images; ++b)
    for (std::int64_t i = 0; i < grid; ++i)
      for (std::int64_t j = 0; j < grid; ++j)
        slot[t++] = static_cast<std::int32_t>(b * area + ((i / window) * per + j / window) * w2 + (i % window) * window +
                                              j % window);
  return slot;
}

std::vector<std::int32_t> merge_slots(std::int64_t images, std::int64_t grid) {
  MOELAB_CHECK(grid % 2 == 0, "merge_slots: patch merging needs an even feature map");
  const std::int64_t half = grid / 2, area = grid * grid;
  std::vector<std::int32_t> slot(static_cast<std::size_t>(images * area));
  std::size_t t = 0;
  for (std::int64_t b = 0; b < images; ++b)
    for (std::int64_t i = 0; i < grid; ++i)
      for (std::int64_t j = 0; j < grid; ++j) {
        const std::int64_t out_row = b * half * half + (i / 2) * half + j / 2;
        slot[t++] = static_cast<std::int32_t>(out_row * 4 + (i % 2) + 2 * (j % 2));
      }
  return slot;
}

// ---- PatchEmbed ----------------------------------------------------------------------------

namespace {
struct PatchEmbedSaved final : Saved {
  using Saved::Saved;
  Tensor pixels;     // [T,P] (dW)
  Norm::State norm;  // the projection [T,C]
  Tensor d_h;        // B -> W [T,C]
};
}  // namespace

PatchEmbed::PatchEmbed(Backend& b, Stream& s, const TransformerConfig& cfg)
    : b_(b), s_(s), cfg_(cfg), norm_(b, s, cfg, "patch_embed.norm") {
  w_ = make_param(b, s, "patch_embed.w", {cfg.vision.patch_values(), cfg.d_model}, cfg.dtype);
}

void PatchEmbed::init_parameters(std::uint64_t seed) {
  norm_.init_parameters();
  init_normal(b_, w_, seed, kTagPatchEmbed, kInitStd);
}

void PatchEmbed::collect(std::vector<Param*>& out) {
  out.push_back(&w_);
  norm_.collect(out);
}

Forwarded PatchEmbed::forward(const Tensor& pixels, const WorkKey& key) {
  const std::int64_t P = cfg_.vision.patch_values(), C = cfg_.d_model;
  require_rows(pixels, P, cfg_.dtype, "patch embedding");
  if (pixels.dim(0) % cfg_.seq_len != 0)
    throw ConfigError("patch embedding: " + std::to_string(pixels.dim(0)) + " patches are not whole images of " +
                      std::to_string(cfg_.seq_len));
  MicrobatchScope mb(b_, key.microbatch);
  PhaseScope ph(b_, kind());
  auto sv = std::make_unique<PatchEmbedSaved>(key);
  const std::int64_t T = pixels.dim(0);
  sv->pixels = pixels;
  Tensor h = b_.empty({T, C}, cfg_.dtype, MemCategory::activations, s_);  // [T,C], the norm's saved input
  b_.gemm(s_, block_gemm(false, false, T, C, P, pixels, w_.value, h, 0), "patch_embed");
  Tensor y = norm_.forward(h, sv->norm);
  return {y, std::move(sv)};
}

Tensor PatchEmbed::backward_input(Saved& saved, const Tensor& dy) {
  auto& sv = saved_as<PatchEmbedSaved>(saved, "patch embedding");
  MicrobatchScope mb(b_, sv.key.microbatch);
  PhaseScope ph(b_, kind());
  sv.d_h = norm_.backward(sv.norm, dy);
  sv.norm = Norm::State{};
  sv.input_done = true;
  return Tensor();
}

void PatchEmbed::backward_weight(Saved& saved) {
  auto& sv = saved_as<PatchEmbedSaved>(saved, "patch embedding");
  MicrobatchScope mb(b_, sv.key.microbatch);
  PhaseScope ph(b_, kind());
  const std::int64_t T = sv.pixels.dim(0), P = sv.pixels.dim(1), C = cfg_.d_model;
  b_.gemm(s_, block_gemm(true, false, P, C, T, sv.pixels, sv.d_h, w_.grad, 1), "patch_embed_wgrad");  // dW += X^T · dh
  sv.pixels = sv.d_h = Tensor();
  sv.weight_done = true;
}

// ---- PatchMerging --------------------------------------------------------------------------

namespace {
struct MergeSaved final : Saved {
  using Saved::Saved;
  Norm::State norm;  // the regrouped input [T/4,4C]
  Tensor hn;         // [T/4,4C] normed (dW)
  Tensor dy;         // B -> W [T/4,2C]
};
}  // namespace

PatchMerging::PatchMerging(Backend& b, Stream& s, const TransformerConfig& cfg, int stage)
    : b_(b), s_(s), cfg_(cfg), stage_(stage),
      norm_(b, s, with_width(cfg, 4 * cfg.d_model), "merge" + std::to_string(stage) + ".norm"), slots_(b, s) {
  MOELAB_CHECK(cfg.grid > 0 && cfg.grid % 2 == 0, "patch merging needs a stage's even feature map");
  w_ = make_param(b, s, "merge" + std::to_string(stage) + ".w", {4 * cfg.d_model, 2 * cfg.d_model}, cfg.dtype);
}

void PatchMerging::init_parameters(std::uint64_t seed) {
  norm_.init_parameters();
  init_normal(b_, w_, seed, kTagMergeBase + static_cast<std::uint64_t>(stage_), kInitStd);
}

void PatchMerging::collect(std::vector<Param*>& out) {
  norm_.collect(out);
  out.push_back(&w_);
}

Forwarded PatchMerging::forward(const Tensor& x, const WorkKey& key) {
  const std::int64_t C = cfg_.d_model, g = cfg_.grid, area = g * g;
  require_rows(x, C, cfg_.dtype, "patch merging into stage " + std::to_string(stage_));
  const std::int64_t T = x.dim(0);
  if (T % area != 0)
    throw ConfigError("patch merging into stage " + std::to_string(stage_) + ": " + std::to_string(T) +
                      " tokens are not whole " + std::to_string(g) + " × " + std::to_string(g) + " feature maps");
  MicrobatchScope mb(b_, key.microbatch);
  PhaseScope ph(b_, kind());
  auto sv = std::make_unique<MergeSaved>(key);
  const Tensor& slot = slots_.get(T, T, 1, [&] { return merge_slots(T / area, g); });
  Tensor grouped = b_.empty({T, C}, cfg_.dtype, MemCategory::activations, s_);  // [T,C] in 2 × 2 groups
  b_.permute(s_, x, slot, grouped);
  sv->hn = norm_.forward(grouped.reshape({T / 4, 4 * C}), sv->norm);            // [T/4,4C]
  Tensor y = b_.empty({T / 4, 2 * C}, cfg_.dtype, MemCategory::activations, s_);
  b_.gemm(s_, block_gemm(false, false, T / 4, 2 * C, 4 * C, sv->hn, w_.value, y, 0), "merge");
  return {y, std::move(sv)};
}

Tensor PatchMerging::backward_input(Saved& saved, const Tensor& dy) {
  auto& sv = saved_as<MergeSaved>(saved, "patch merging");
  const std::int64_t R = dy.dim(0), C = cfg_.d_model, T = 4 * R;
  MicrobatchScope mb(b_, sv.key.microbatch);
  PhaseScope ph(b_, kind());
  Tensor d_hn = b_.empty({R, 4 * C}, cfg_.dtype, MemCategory::buffers, s_);  // dhn = dy · W^T
  b_.gemm(s_, block_gemm(false, true, R, 4 * C, 2 * C, dy, w_.value, d_hn, 0), "merge_dgrad");
  const Tensor d_grouped = norm_.backward(sv.norm, d_hn);                     // [T/4,4C]
  Tensor dx = b_.empty({T, C}, cfg_.dtype, MemCategory::buffers, s_);
  b_.permute_backward(s_, d_grouped.reshape({T, C}), slots_.get(T, T, 1, [&] { return merge_slots(T / (cfg_.grid * cfg_.grid), cfg_.grid); }), dx);
  sv.norm = Norm::State{};
  sv.dy = dy;
  sv.input_done = true;
  return dx;
}

void PatchMerging::backward_weight(Saved& saved) {
  auto& sv = saved_as<MergeSaved>(saved, "patch merging");
  MicrobatchScope mb(b_, sv.key.microbatch);
  PhaseScope ph(b_, kind());
  const std::int64_t R = sv.dy.dim(0), C = cfg_.d_model;
  b_.gemm(s_, block_gemm(true, false, 4 * C, 2 * C, R, sv.hn, sv.dy, w_.grad, 1), "merge_wgrad");  // dW += hn^T · dy
  sv.hn = sv.dy = Tensor();
  sv.weight_done = true;
}

// ---- ClassifierHead ------------------------------------------------------------------------

namespace {
struct ClassifierSaved final : Saved {
  using Saved::Saved;
  Norm::State norm;
  Tensor hn;               // [T,C] normed (the mean's backward)
  Tensor pooled;           // [B,C] (dW)
  Tensor logits, lse;      // [B,K], [B] fp32
  Tensor targets, losses;  // [B] int32, [B] fp32
  Tensor d_logits;         // B -> W [B,K]
  float scale = 1.0f;
};
}  // namespace

ClassifierHead::ClassifierHead(Backend& b, Stream& s, const TransformerConfig& cfg)
    : b_(b), s_(s), cfg_(cfg), norm_(b, s, cfg, "final_norm"), slots_(b, s) {
  w_ = make_param(b, s, "classifier.w", {cfg.d_model, cfg.vision.num_classes}, cfg.dtype);
}

void ClassifierHead::init_parameters(std::uint64_t seed) {
  norm_.init_parameters();
  init_normal(b_, w_, seed, kTagClassifier, kInitStd);
}

void ClassifierHead::collect(std::vector<Param*>& out) {
  norm_.collect(out);
  out.push_back(&w_);
}

Forwarded ClassifierHead::forward(const Tensor& x, const WorkKey& key) {
  const std::int64_t C = cfg_.d_model, K = cfg_.vision.num_classes, N = cfg_.grid * cfg_.grid;
  require_rows(x, C, cfg_.dtype, "classifier head");
  const std::int64_t T = x.dim(0), B = T / N;
  if (T % N != 0 || !targets_.defined() || targets_.ndim() != 1 || targets_.dim(0) != B || targets_.dtype() != DType::i32)
    throw ConfigError("classifier head: " + std::to_string(T) + " tokens of " + std::to_string(N) +
                      " per image need targets [" + std::to_string(T / N) + "] int32, got " +
                      (targets_.defined() ? targets_.describe() : std::string("none")));
  MicrobatchScope mb(b_, key.microbatch);
  PhaseScope ph(b_, kind());
  auto sv = std::make_unique<ClassifierSaved>(key);
  sv->hn = norm_.forward(x, sv->norm);
  // The mean over each image's N rows: the combine's weighted gather with N slots of weight 1/N.
  const Tensor& slot = slots_.get(B, B, N, [&] {
    std::vector<std::int32_t> v(static_cast<std::size_t>(T));
    for (std::int64_t t = 0; t < T; ++t) v[static_cast<std::size_t>(t)] = static_cast<std::int32_t>(t);
    return v;
  });
  auto it = mean_.find(B);
  if (it == mean_.end()) {
    Tensor w = b_.empty({B, N}, DType::f32, MemCategory::buffers, s_);
    if (b_.has_data()) b_.upload(std::vector<float>(static_cast<std::size_t>(T), 1.0f / static_cast<float>(N)), w);
    it = mean_.emplace(B, std::move(w)).first;
  }
  sv->pooled = b_.empty({B, C}, cfg_.dtype, MemCategory::activations, s_);
  b_.unpermute(s_, sv->hn, slot, it->second, sv->pooled);
  sv->logits = b_.empty({B, K}, cfg_.dtype, MemCategory::activations, s_);
  b_.gemm(s_, block_gemm(false, false, B, K, C, sv->pooled, w_.value, sv->logits, 0), "classifier");
  sv->losses = b_.empty({B}, DType::f32, MemCategory::activations, s_);
  sv->lse = b_.empty({B}, DType::f32, MemCategory::activations, s_);
  sv->targets = targets_;
  sv->scale = loss_scale_;
  b_.cross_entropy_forward(s_, sv->logits, sv->targets, sv->losses, sv->lse);
  Tensor losses = sv->losses;
  return {losses, std::move(sv)};
}

Tensor ClassifierHead::backward_input(Saved& saved, const Tensor&) {
  auto& sv = saved_as<ClassifierSaved>(saved, "classifier head");
  const std::int64_t B = sv.targets.dim(0), C = cfg_.d_model, K = cfg_.vision.num_classes, T = sv.hn.dim(0), N = T / B;
  MicrobatchScope mb(b_, sv.key.microbatch);
  PhaseScope ph(b_, kind());
  sv.d_logits = b_.empty({B, K}, cfg_.dtype, MemCategory::buffers, s_);
  b_.cross_entropy_backward(s_, sv.logits, sv.targets, sv.lse, sv.scale, sv.d_logits);
  sv.logits = Tensor();
  Tensor d_pooled = b_.empty({B, C}, cfg_.dtype, MemCategory::buffers, s_);  // dpooled = dlogits · W^T
  b_.gemm(s_, block_gemm(false, true, B, C, K, sv.d_logits, w_.value, d_pooled, 0), "classifier_dgrad");
  Tensor d_hn = b_.empty({T, C}, cfg_.dtype, MemCategory::buffers, s_);
  Tensor d_mean = b_.empty({B, N}, DType::f32, MemCategory::buffers, s_);  // the weights' gradient, unused
  b_.unpermute_backward(s_, d_pooled, sv.hn, slots_.get(B, B, N, [&] { return std::vector<std::int32_t>(); }),
                        mean_.at(B), d_hn, d_mean);
  Tensor dx = norm_.backward(sv.norm, d_hn);
  sv.norm = Norm::State{};
  sv.hn = Tensor();
  sv.input_done = true;
  return dx;
}

void ClassifierHead::backward_weight(Saved& saved) {
  auto& sv = saved_as<ClassifierSaved>(saved, "classifier head");
  MicrobatchScope mb(b_, sv.key.microbatch);
  PhaseScope ph(b_, kind());
  const std::int64_t B = sv.pooled.dim(0), C = cfg_.d_model, K = cfg_.vision.num_classes;
  b_.gemm(s_, block_gemm(true, false, C, K, B, sv.pooled, sv.d_logits, w_.grad, 1), "classifier_wgrad");  // dW += pooled^T · dlogits
  sv.pooled = sv.d_logits = Tensor();
  sv.weight_done = true;
}

}  // namespace moelab
