// impls/scmoe/scmoe_test_util.hpp — what scmoe_test.cpp and scmoe_mpi_test.cpp share: the
// small, awkward pair configurations, parameter draws and the routed MoE's keyed noise.
#pragma once
#include <cmath>
#include <functional>
#include <ostream>
#include <string>

#include <nlohmann/json.hpp>

#include "harness/config/model.hpp"
#include "harness/nn/moe_layer.hpp"
#include "harness/runtime/random.hpp"
#include "impls/scmoe/pair_reference.hpp"

namespace moelab::scmoe_test {

using nlohmann::json;

// A pair small and awkward enough for the float64 reference: T = 3 sequences of 7 tokens,
// heads of 5 (GPT) or 6 (LLaMA, rotary) dimensions with grouped-query attention, 4 experts.
struct Variant {
  ShortcutPosition position = ShortcutPosition::pos2;
  ShortcutCombine combine = ShortcutCombine::cg1;
  bool llama = false;          // rmsnorm, SwiGLU, rotary; else layernorm, GELU
  bool noisy = true;
  double capacity = 1.0;       // 0: no dropping
  std::string impl = "fastmoe";
  json options = json::object();
  int expert_slot = -1, chunks = 0;
  std::string label;
};

// gtest names a failing case by its label.
inline void PrintTo(const Variant& v, std::ostream* os) { *os << v.label; }

inline TransformerConfig pair_config(const Variant& v) {
  TransformerConfig c;
  c.name = "scmoe-test";
  c.origin = "<test>";
  c.d_model = v.llama ? 24 : 20;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.d_ffn = 28;
  c.num_layers = 2;
  c.seq_len = 7;
  c.vocab_size = 40;
  c.norm = v.llama ? NormKind::rmsnorm : NormKind::layernorm;
  c.mlp = v.llama ? MlpKind::swiglu : MlpKind::gelu;
  c.positions = v.llama ? PositionKind::rotary : PositionKind::learned;
  c.dtype = DType::f32;
  c.moe_layers = v.position == ShortcutPosition::pos1 && v.llama ? MoELayers::all : MoELayers::every_second;
  c.moe.name = c.name;
  c.moe.d_model = c.d_model;
  c.moe.d_hidden = 16;
  c.moe.num_experts = 4;
  c.moe.top_k = 1;
  c.moe.capacity_factor = v.capacity;
  c.moe.noisy_gate = v.noisy;
  c.moe.activation = Activation::gelu;
  c.moe.dtype = DType::f32;
  c.shared_expert_hidden = 12;
  c.scmoe.enabled = true;
  c.scmoe.position = v.position;
  c.scmoe.combine = v.combine;
  c.scmoe.expert_slot = v.expert_slot;
  c.scmoe.chunks = v.chunks;
  return c;
}
// The pair's first layer: the MoE layer 1 at Pos-1 (its own pair), else the dense layer 0.
inline int first_layer(const TransformerConfig& c) { return c.scmoe.span() == 2 ? 0 : 1; }
inline int moe_layer(const TransformerConfig&) { return 1; }

constexpr std::int64_t kT = 21;  // 3 sequences of 7

// Parameter values drawn at a scale where every path matters (norm gains near 1, linear layers
// U(-1,1)/sqrt(fan-in)), so that a wrong gradient anywhere shows.
inline pair_ref::Vec draw_param(const std::string& name, const std::vector<std::int64_t>& shape, std::uint64_t seed) {
  std::size_t n = 1;
  for (auto d : shape) n *= static_cast<std::size_t>(d);
  Rng r(Rng::mix(seed, std::hash<std::string>{}(name)));
  pair_ref::Vec v(n);
  const bool gamma = name.find(".gamma") != std::string::npos, beta = name.find(".beta") != std::string::npos;
  const double fan_in = shape.size() >= 2 ? static_cast<double>(shape[shape.size() - 2]) : 1.0;
  for (auto& x : v) {
    const double u = r.uniform(-1.0, 1.0);
    x = static_cast<float>(gamma ? 1.0 + 0.2 * u : beta ? 0.2 * u : u / std::sqrt(fan_in));
  }
  return v;
}

// The noise the routed MoE draws for a piece of work: Rng(mix(noise_seed, rank, work_seed(key))),
// fp32 normals (MoELayer::route).
inline pair_ref::Vec keyed_noise(std::uint64_t seed, const WorkKey& k, std::int64_t T, std::int64_t E, int rank = 0) {
  Rng nr(Rng::mix(Rng::mix(seed, 5), static_cast<std::uint64_t>(rank), MoELayer::work_seed(k)));
  pair_ref::Vec eps(static_cast<std::size_t>(T * E));
  for (auto& e : eps) e = static_cast<float>(nr.normal());
  return eps;
}

}  // namespace moelab::scmoe_test
