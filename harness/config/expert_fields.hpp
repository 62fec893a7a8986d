// harness/config/expert_fields.hpp — the fields of an MoE layer's experts and gate, read with
// one set of checks from a workload's "model" object (workload.cpp) and a model file's "moe"
// object (model.cpp).
#pragma once
#include <string>
#include <vector>

#include "harness/config/json_fields.hpp"
#include "harness/config/workload.hpp"

namespace moelab::expert_fields {

// d_hidden, num_experts, top_k, capacity_factor, activation, noisy_gate, renormalize.
const std::vector<std::string>& names();

// Reads those fields of `f` into m with their ranges (limits.hpp) and the checks between
// them (top_k <= num_experts; the layer's expert weights, num_experts × 2 × d_model ×
// d_hidden, in checked arithmetic). m.d_model must be set: `d_model_path` is how messages
// name it ("model.d_model" in a workload, "d_model" in a model file).
void read(const json_fields::Fields& f, const std::string& d_model_path, ModelConfig& m);

}  // namespace moelab::expert_fields
