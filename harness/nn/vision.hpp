// harness/nn/vision.hpp — the blocks a hierarchical vision transformer adds to the transformer
// blocks of blocks.hpp (Swin, Liu et al. 2021; its MoE form Swin-MoE, Hwang et al. 2023; the
// model file's "vision" object, harness/config/model.hpp):
//
//   PatchEmbed       pixels [T,P] -> [T,C]: the patch_size × patch_size convolution with stride
//                    patch_size, which is a linear map of each patch's P = patch² · channels
//                    values (no overlap), then a norm (Swin's patch_norm)
//   PatchMerging     [B·g²,C] -> [B·(g/2)²,2C]: each 2 × 2 group of tokens concatenated (Swin's
//                    x0 | x1 | x2 | x3 order), a norm over 4C, a linear map 4C -> 2C
//   ClassifierHead   [B·N,C] -> per-image loss [B]: a norm, the mean over each image's N tokens,
//                    a linear classifier, cross-entropy against the image's label
//
// Rows are tokens in row-major image order (image, row, column). Regrouping rows (the merge's
// 2 × 2 groups, attention's windows, the head's mean) uses the backend's row movers, permute
// and unpermute, with index tensors made once per token count (window_slots, merge_slots).
// Like the other blocks: saved state as a value, backward split into B (input gradient) and
// W (weight gradients). No tensor parallelism.
#pragma once
#include <cstdint>
#include <map>
#include <vector>

#include "harness/nn/blocks.hpp"

namespace moelab {

// Destination row of every token for patch merging: the 2 × 2 group of token (i, j) is output
// row (i/2, j/2) of its image, and the token is part (i % 2) + 2·(j % 2) of it, so that the
// regrouped [B·g², C] read as [B·(g/2)², 4C] is Swin's cat(x0, x1, x2, x3).
std::vector<std::int32_t> merge_slots(std::int64_t images, std::int64_t grid);

class PatchEmbed final : public Block {
 public:
  // cfg: the model's (stage 0's width d_model).
  PatchEmbed(Backend& b, Stream& s, const TransformerConfig& cfg);
  const char* kind() const override { return "embedding"; }
  Forwarded forward(const Tensor& pixels, const WorkKey& key) override;  // [B·G²,P] in the model dtype
  Tensor backward_input(Saved& saved, const Tensor& dy) override;         // pixels have no gradient: undefined
  void backward_weight(Saved& saved) override;
  void init_parameters(std::uint64_t seed) override;
  void collect(std::vector<Param*>& out) override;

 private:
  Backend& b_;
  Stream& s_;
  TransformerConfig cfg_;
  Norm norm_;
  Param w_;  // [P,C]
};

class PatchMerging final : public Block {
 public:
  // cfg: the configuration of the stage before the merge (layer_config of its last layer).
  PatchMerging(Backend& b, Stream& s, const TransformerConfig& cfg, int stage);
  const char* kind() const override { return "merge"; }
  Forwarded forward(const Tensor& x, const WorkKey& key) override;  // [B·g²,C] -> [B·(g/2)²,2C]
  Tensor backward_input(Saved& saved, const Tensor& dy) override;
  void backward_weight(Saved& saved) override;
  void init_parameters(std::uint64_t seed) override;
  void collect(std::vector<Param*>& out) override;

 private:
  Backend& b_;
  Stream& s_;
  TransformerConfig cfg_;
  int stage_;  // the stage the merge leads into
  Norm norm_;  // over 4C
  Param w_;    // [4C,2C]
  RowIndexCache slots_;
};

class ClassifierHead final : public Block {
 public:
  // cfg: the last stage's configuration (layer_config of the last layer).
  ClassifierHead(Backend& b, Stream& s, const TransformerConfig& cfg);
  const char* kind() const override { return "head"; }
  // targets [B] int32 class labels (negative: not counted); the gradient is loss_scale · dCE.
  void set_targets(const Tensor& targets, float loss_scale) {
    targets_ = targets;
    loss_scale_ = loss_scale;
  }
  Forwarded forward(const Tensor& x, const WorkKey& key) override;  // y: the per-image loss [B] fp32
  Tensor backward_input(Saved& saved, const Tensor& dy) override;   // dy unused
  void backward_weight(Saved& saved) override;
  void init_parameters(std::uint64_t seed) override;
  void collect(std::vector<Param*>& out) override;

 private:
  Backend& b_;
  Stream& s_;
  TransformerConfig cfg_;
  Norm norm_;
  Param w_;  // [C,K]
  Tensor targets_;
  float loss_scale_ = 1.0f;
  RowIndexCache slots_;                  // [B,N]: image b's rows
  std::map<std::int64_t, Tensor> mean_;  // [B,N] fp32 1/N, per B
};

}  // namespace moelab
