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
//              "shared_expert_hidden": 0 }
//   }
// Every problem is a ConfigError naming the file, the field and the value (exit 2), exactly
// as for workload files. MoE layers use the layer configuration of harness/config/workload.hpp
// (ModelConfig), filled from "moe" and the model's d_model and dtype.
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "harness/config/workload.hpp"
#include "harness/runtime/backend.hpp"

namespace moelab {

enum class MlpKind { gelu, swiglu };
enum class PositionKind { learned, rotary, none };
enum class MoELayers { none, all, every_second };  // every_second: layers 1, 3, 5, ... (as Megatron's moe_layer_freq = 2)

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

  int head_dim() const { return static_cast<int>(d_model / num_heads); }
  bool is_moe(int layer) const {
    return moe_layers == MoELayers::all || (moe_layers == MoELayers::every_second && layer % 2 == 1);
  }
  AttentionShape attention(std::int64_t batch) const {
    return {batch, seq_len, num_heads, num_kv_heads, head_dim(), causal};
  }
};

TransformerConfig load_transformer(const std::string& path);
// overrides: a JSON object merged over the file's fields before checking (RFC 7386 merge
// patch; a suite's "layers = 3p - 2" arrives this way). null or {} changes nothing.
TransformerConfig load_transformer(const std::string& path, const nlohmann::json& overrides);
TransformerConfig parse_transformer(const nlohmann::json& j, const std::string& origin);
nlohmann::json to_json(const TransformerConfig& t);
const char* mlp_name(MlpKind k);
const char* positions_name(PositionKind k);
const char* moe_layers_name(MoELayers m);

}  // namespace moelab
