// harness/config/model.hpp — a transformer model as data (experiments/models/*.json).
//
//   {
//     "name": "GPT3-MoE-XL", "source": "where the sizes come from (paper, table)",
//     "d_model": 2048, "num_heads": 16, "num_kv_heads": 16, "d_ffn": 8192,
//     "num_layers": 24, "seq_len": 2048, "vocab_size": 50257,
//     "norm": "layernorm", "norm_eps": 1e-5, "mlp": "gelu", "positions": "learned",
//     "rope_theta": 10000, "attention": "causal", "tie_embeddings": true, "dtype": "bf16",
//     "moe_layers": "every_second",
//     "moe": { "num_experts": 8, "d_hidden": 8192, "top_k": 2, "capacity_factor": 1.25,
//              "activation": "gelu", "noisy_gate": false, "renormalize": false,
//              "shared_expert_hidden": 0 },
//     "scmoe": { "position": "pos2", "combine": "cg1", "expert_slot": "auto", "chunks": "auto" }
//   }
// Every problem is a ConfigError naming the file, the field and the value (exit 2), exactly
// as for workload files. MoE layers use the layer configuration of harness/config/workload.hpp
// (ModelConfig), filled from "moe" and the model's d_model and dtype.
//
// Required: source, d_model, num_heads, d_ffn, num_layers, seq_len, vocab_size; "moe" exactly
// when moe_layers is not "none". Defaults: name = the file's stem, num_kv_heads = num_heads,
// norm "layernorm", norm_eps 1e-5, mlp "gelu", positions "learned", rope_theta 10000 (only
// with positions "rotary"), attention "causal", tie_embeddings true, dtype "fp32",
// moe_layers "none". Checks: num_heads divides d_model, num_kv_heads divides num_heads,
// head_dim even with rotary positions, top_k <= num_experts, norm_eps in (0, 1], rope_theta
// in (0, 1e12] (and only with rotary positions), and the bounds of
// harness/config/limits.hpp (d_model <= 2^20, d_ffn and d_hidden <= 2^22, num_layers <=
// 4096, vocab_size <= 2^24, seq_len <= 2^22, num_experts <= 2^16); every derived size (the
// parameter counts, one layer's tensors for a batch) is computed in checked arithmetic and
// must stay within 2^56. Files: experiments/models/. Tested by harness/tests/model_config_test.cpp.
//
// "scmoe" (optional) makes every MoE block a ScMoE block (Cai et al., "Shortcut-connected Expert
// Parallelism for Accelerating Mixture of Experts", arXiv 2404.05019; impls/scmoe builds it):
// a shared expert (a dense MLP, moe.shared_expert_hidden wide, default d_ffn) on the block's own
// representation and the top-1 routed MoE on an earlier one taken through a shortcut.
// position "pos1" | "pos2" | "pos3": the routed MoE's input is the MoE block's input, the
// output of the dense block's attention, or the dense block's input; default "pos2", and with
// moe_layers "all" (no dense block) "pos1", the only one allowed there. combine "add" | "cg1" (default: sigmoid gate on the shared expert) | "cg2" (a
// 2-way softmax weighing both). expert_slot: where the routed experts run among the window's
// compute (an integer from 0 to the window's blocks, or "auto": the cost model's choice);
// chunks: pieces of each all-to-all (1 to 64, or "auto": 1 unless communication exceeds the
// window). Checks: moe_layers not "none", moe.top_k = 1, moe.shared_expert_hidden not 0.
//
// "vision" (optional) makes the model a hierarchical vision transformer (VisionConfig below):
//   "vision": { "image_size": 192, "patch_size": 4, "in_channels": 3, "num_classes": 21841,
//               "window": 12, "stages": [ {"depth": 2, "num_heads": 3, "moe_blocks": []}, ... ] }
// It derives num_layers (the depths' sum), seq_len (tokens per image at stage 0: (image_size /
// patch_size)²), vocab_size (num_classes), num_heads (stage 0's) and moe_layers (the listed
// blocks): those fields may not be given; positions are "none", attention "bidirectional",
// embeddings untied. d_model, d_ffn, moe.d_hidden and moe.shared_expert_hidden are stage 0's.
// Checks: patch_size divides image_size; every stage's feature map halves evenly into the next
// (an even side before each patch merging); a window smaller than a stage's side divides it;
// every stage's head count divides its width; moe_blocks in [0, depth), increasing; "moe"
// exactly when a block is listed; with "scmoe" at pos2 or pos3, each MoE block's predecessor is
// a dense block of the same stage (the pair may not straddle a patch merging).
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "harness/config/workload.hpp"
#include "harness/runtime/backend.hpp"

namespace moelab {

enum class MlpKind { gelu, swiglu };
enum class PositionKind { learned, rotary, none };
// every_second: layers 1, 3, 5, ... (as Megatron's moe_layer_freq = 2); listed: the blocks a
// vision model's stages name (VisionConfig::Stage::moe_blocks).
enum class MoELayers { none, all, every_second, listed };

// ScMoE's shortcut (see the file comment; impls/scmoe/README.md maps the paper to the code).
enum class ShortcutPosition { pos1, pos2, pos3 };
enum class ShortcutCombine { add, cg1, cg2 };
struct ShortcutConfig {
  bool enabled = false;
  ShortcutPosition position = ShortcutPosition::pos2;
  ShortcutCombine combine = ShortcutCombine::cg1;
  int expert_slot = -1;  // -1: chosen from the cost model
  int chunks = 0;        // 0: chosen from the cost model
  // Layers of one block pair as the model builds it: 2 (Block-MLP l, Block-MoE l+1) at pos2 and
  // pos3; 1 at pos1, whose routed input is the MoE block's own input.
  int span() const { return !enabled ? 0 : position == ShortcutPosition::pos1 ? 1 : 2; }
  // Main-stream blocks the all-to-alls can hide behind (the paper's overlap window): pos1
  // attention and shared expert; pos2 also the dense MLP; pos3 also the dense block's attention.
  int window_blocks() const { return position == ShortcutPosition::pos1 ? 2 : position == ShortcutPosition::pos2 ? 3 : 4; }
  int gate_width() const {  // combine gate logits per token (W_cg's columns)
    return !enabled ? 0 : combine == ShortcutCombine::cg1 ? 1 : combine == ShortcutCombine::cg2 ? 2 : 0;
  }
};
const char* shortcut_position_name(ShortcutPosition p);
const char* shortcut_combine_name(ShortcutCombine c);

// A hierarchical vision transformer (Swin, Liu et al. 2021, ICCV; its MoE variant Swin-MoE,
// Hwang et al. 2023, "Tutel", and the Swin Transformer repository's swinmoe configurations):
// the image is cut into patch_size² patches (a linear patch embedding, then a norm), and the
// model is a sequence of stages at halving resolution and doubling width. Stage s (from 0) has
// a feature map of grid(s)² tokens per image, width d_model·2^s, its own head count, depth
// blocks, window attention over window(s)² tokens (the attention of its blocks runs over
// non-overlapping windows: grid(s)/window(s) squared per image), and the MoE blocks it lists
// (block indices within the stage, as the Swin-MoE configs' MOE_BLOCKS). Between stages a patch
// merging layer concatenates each 2 × 2 group of tokens and maps 4C to 2C. The head is a final
// norm, the mean over each image's tokens and a linear classifier over num_classes. The MLP and
// expert widths scale with the width (the top-level d_ffn, moe.d_hidden and
// moe.shared_expert_hidden are stage 0's; mlp_ratio stays fixed as in Swin).
// Not modelled, each an elementwise or per-window term beside the GEMMs and attention priced
// here: the shifted windows of every second block (a cyclic shift of the rows and a mask at
// the border: moelab's blocks all use regular windows), the relative position bias, SwinV2's
// scaled cosine attention and post-norm placement.
struct VisionConfig {
  struct Stage {
    int depth = 0;
    int num_heads = 0;
    std::vector<int> moe_blocks;  // indices in [0, depth)
  };
  bool enabled = false;
  std::int64_t image_size = 0, patch_size = 0, in_channels = 0, num_classes = 0;
  std::int64_t window = 0;  // before clipping to the feature map
  std::vector<Stage> stages;

  std::int64_t grid(int stage) const { return (image_size / patch_size) >> stage; }
  std::int64_t window_of(int stage) const { return window < grid(stage) ? window : grid(stage); }
  std::int64_t patch_values() const { return patch_size * patch_size * in_channels; }  // P
  int stage_of(int layer) const;   // the stage holding a global layer index
  int first_layer(int stage) const;
};

// Parameters of the model as moelab builds it (no biases in linear layers: its GEMMs have
// none; layernorm has a scale and a shift, rmsnorm a scale). Counts, not bytes.
struct ParamCounts {
  std::int64_t embedding = 0;  // token embedding [V,M], learned positions [S,M], untied output layer [V,M]
  std::int64_t attention = 0;  // per layer W_qkv [M,(Hq+2Hkv)·D] and W_o [Hq·D,M]
  std::int64_t dense_mlp = 0;  // dense layers' MLPs (gelu: 2·M·F; swiglu: 3·M·F) and MoE layers' shared experts
  std::int64_t experts = 0;    // routed experts of every MoE layer, all E of them (global): E·2·M·H per layer
  std::int64_t gates = 0;      // per MoE layer W_g [M,E] (and W_noise [M,E] with a noisy gate)
  std::int64_t norms = 0;      // two per layer and the final one
  std::int64_t merging = 0;    // vision: the patch merging layers' W [4C,2C]; the patch embedding and classifier count as embedding
  std::int64_t total = 0;
};

// Element counts of one layer's tensors for a microbatch of B sequences (T = B·S tokens).
struct ActivationSizes {
  std::int64_t tokens = 0;         // T
  std::int64_t hidden = 0;         // [T,M]: the residual stream, a norm's output, attention's output
  std::int64_t qkv = 0;            // [T,(Hq+2Hkv)·D]
  std::int64_t lse = 0;            // [B,Hq,S] fp32 (attention's saved log-sum-exp)
  std::int64_t mlp_hidden = 0;     // [T,F] (gelu) or [T,2F] (swiglu: gate | up); 0 when no layer is dense
  std::int64_t gate_logits = 0;    // [T,E]; 0 without MoE layers
  std::int64_t routed_slots = 0;   // T·k
  std::int64_t expert_hidden = 0;  // [T·k,H]: every expert's rows together
  std::int64_t shared_hidden = 0;  // [T,Hs] (gelu) or [T,2Hs] (swiglu); 0 without a shared expert
  std::int64_t logits = 0;         // [T,V]
};

struct TransformerConfig {
  std::string name;
  std::string source;  // citation of the sizes
  std::string origin;  // file path (or "<string>") for messages
  std::int64_t d_model = 0;       // M
  int num_heads = 0;              // Hq
  int num_kv_heads = 0;           // Hkv (GQA when < Hq; Hq % Hkv == 0)
  std::int64_t d_ffn = 0;         // dense MLP width F (SwiGLU: F per branch)
  int num_layers = 0;
  std::int64_t seq_len = 0;       // S
  std::int64_t vocab_size = 0;    // V
  NormKind norm = NormKind::layernorm;
  float norm_eps = 1e-5f;
  MlpKind mlp = MlpKind::gelu;
  PositionKind positions = PositionKind::learned;
  float rope_theta = 10000.0f;
  bool causal = true;             // "attention": "causal" | "bidirectional"
  bool tie_embeddings = true;     // LM head = token embedding^T
  DType dtype = DType::f32;
  bool allow_tf32 = false;
  MoELayers moe_layers = MoELayers::none;
  ModelConfig moe;                       // the MoE layers' configuration (d_model, dtype filled in)
  std::int64_t shared_expert_hidden = 0; // a dense shared expert beside the routed ones (0: none)
  ShortcutConfig scmoe;                  // ScMoE's block pairs (disabled unless "scmoe" is given)
  VisionConfig vision;                   // a hierarchical vision model (disabled unless "vision" is given)
  std::vector<char> moe_mask;            // moe_layers == listed: per layer, whether it is an MoE layer
  // A vision model's layer configuration (layer_config): the stage's feature-map side; 0 otherwise.
  std::int64_t grid = 0;

  int head_dim() const { return static_cast<int>(d_model / num_heads); }
  bool is_moe(int layer) const {
    if (moe_layers == MoELayers::listed)
      return layer >= 0 && static_cast<std::size_t>(layer) < moe_mask.size() && moe_mask[static_cast<std::size_t>(layer)];
    return moe_layers == MoELayers::all || (moe_layers == MoELayers::every_second && layer % 2 == 1);
  }
  // The configuration the blocks of `layer` are built from: the model itself, or for a vision
  // model its stage's (d_model, heads, MLP and expert widths scaled; seq_len the window's tokens,
  // so that attention runs over windows; grid the feature map's side).
  TransformerConfig layer_config(int layer) const;
  AttentionShape attention(std::int64_t batch) const {
    return {batch, seq_len, num_heads, num_kv_heads, head_dim(), causal};
  }
  int num_moe_layers() const;
  // In checked arithmetic; a loaded model's counts are known to fit (load checks them), so
  // these throw ConfigError only for a config built or edited in code.
  ParamCounts parameter_counts() const;
  // ConfigError naming `batch` when it is < 1 or a size exceeds 2^56 elements.
  ActivationSizes activation_sizes(std::int64_t batch) const;
};

TransformerConfig load_transformer(const std::string& path);
// overrides: a JSON object merged over the file's fields before checking (RFC 7386 merge
// patch; a suite's "layers = 3p - 2" arrives this way). null or {} changes nothing.
TransformerConfig load_transformer(const std::string& path, const nlohmann::json& overrides);
TransformerConfig parse_transformer(const nlohmann::json& j, const std::string& origin);
// The JSON of a model file (from `path`) with `overrides` merged over it, as load_transformer
// reads it (and the model file's fuzz target, harness/fuzz/fuzz_model.cpp, feeds it).
TransformerConfig parse_transformer(nlohmann::json j, const std::string& path, const nlohmann::json& overrides);
nlohmann::json to_json(const TransformerConfig& t);
const char* mlp_name(MlpKind k);
const char* positions_name(PositionKind k);
const char* moe_layers_name(MoELayers m);

}  // namespace moelab
