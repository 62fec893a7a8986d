// harness/config/workload.hpp — workload and model configuration files (JSON).
//
// A workload file names a model and how to drive it:
//   {
//     "name": "tiny",
//     "model": { "d_model": 64, "d_hidden": 256, "num_experts": 8, "top_k": 2,
//                "capacity_factor": 1.25, "activation": "gelu", "noisy_gate": false,
//                "renormalize": false, "dtype": "fp32" },
//     "tokens_per_rank": 1000, "steps": 5, "warmup": 1, "seed": 1,
//     "expert_parallel": 0          // 0 or absent: the number of ranks launched
//   }
// "activation" is the experts' activation: "gelu" (the exact erf form, the default), "relu",
// or "gelu_tanh" (GeLU's tanh approximation, which the cuda backend fuses into the experts'
// GEMMs: Backend::grouped_gemm_epilogue).
// Every problem (malformed JSON, a missing or mistyped field, a non-positive size, top_k
// larger than num_experts, num_experts not divisible by the expert-parallel degree, ...)
// throws ConfigError with one message naming the file, the field and the value. Sizes have
// upper bounds (harness/config/limits.hpp: d_model <= 2^20, d_hidden <= 2^22, num_experts
// <= 2^16, tokens_per_rank <= 2^24, capacity_factor <= 2^16), and the sizes derived from
// them (expert weights, routed slots, activations) are checked before anything is built.
#pragma once
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "harness/runtime/backend.hpp"

namespace moelab {

struct ModelConfig {
  std::string name = "moe";
  std::int64_t d_model = 0;      // M
  std::int64_t d_hidden = 0;     // H (expert FFN width)
  std::int64_t num_experts = 0;  // E (global)
  int top_k = 1;                 // k
  double capacity_factor = 0.0;  // <= 0: no capacity limit (no token dropping)
  Activation activation = Activation::gelu;
  bool noisy_gate = false;       // Shazeer noisy top-k: logits += N(0,1) * softplus(x W_noise)
  bool renormalize = false;      // gate weights renormalised over the k chosen experts
  DType dtype = DType::f32;
  // fp32 GEMMs may run on TF32 tensor cores (PyTorch's torch.backends.cuda.matmul.allow_tf32,
  // True by default until PyTorch 1.12): cuda uses CUBLAS_COMPUTE_32F_FAST_TF32, the sim
  // prices them at the GPU's TF32 peak, cpu computes fp32 exactly (TF32 is not emulated).
  bool allow_tf32 = false;

  // Per-expert capacity for T tokens on a rank: ceil(cf * k * T / E) clamped to T (an expert
  // never receives more), or 0 (unlimited).
  std::int64_t capacity(std::int64_t tokens) const;
};

struct WorkloadConfig {
  std::string name;
  std::string description;
  std::string origin;  // file path (or "<string>") for messages
  ModelConfig model;
  std::int64_t tokens_per_rank = 0;
  int steps = 1;
  int warmup = 0;
  std::uint64_t seed = 1;
  int expert_parallel = 0;  // 0: world size
};

WorkloadConfig load_workload(const std::string& path);
WorkloadConfig parse_workload(const nlohmann::json& j, const std::string& origin);
ModelConfig parse_model(const nlohmann::json& j, const std::string& origin);  // the "model" object
// Checks that depend on the launch: the expert-parallel degree must equal the world size
// and divide num_experts (each rank holds num_experts / world experts).
void validate_for_world(const WorkloadConfig& w, int world_size);

nlohmann::json to_json(const ModelConfig& m);
nlohmann::json to_json(const WorkloadConfig& w);

}  // namespace moelab
