// harness/config/workload.cpp — reading and checking workload files (see workload.hpp).
//
// Every message is one line, "<file>: <field path> ... <value>", because the person reading
// it is looking at that file: `tiny.json: model.top_k = 9 must be <= model.num_experts = 8`.
// Unknown fields are errors, not warnings: a misspelt optional field ("topk") would
// otherwise silently fall back to its default and change the experiment. The field readers
// are shared with the other input files (harness/config/json_fields.hpp).
// Tested by harness/tests/config_test.cpp (ctest -R config).
#include "harness/config/workload.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>

#include "harness/config/expert_fields.hpp"
#include "harness/config/json_fields.hpp"
#include "harness/config/limits.hpp"
#include "harness/runtime/error.hpp"

namespace moelab {

using nlohmann::json;

namespace {

using json_fields::fail;
using json_fields::Fields;
using json_fields::show;

constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();
constexpr std::int64_t kInt64Max = std::numeric_limits<std::int64_t>::max();

ModelConfig parse_model_at(const json& j, const std::string& origin, const std::string& prefix) {
  const std::string name = prefix.empty() ? "the model" : prefix.substr(0, prefix.size() - 1);
  if (!j.is_object()) fail(origin, name + ": expected an object, got " + show(j));
  std::vector<std::string> known = {"name", "description", "d_model"};
  known.insert(known.end(), expert_fields::names().begin(), expert_fields::names().end());
  known.insert(known.end(), {"dtype", "allow_tf32"});
  Fields f(j, origin, prefix, known);
  ModelConfig m;
  m.name = f.string_or("name", m.name);
  (void)f.string_or("description", "");
  m.d_model = f.integer("d_model", 1, limits::kMaxDModel);
  expert_fields::read(f, f.path("d_model"), m);
  m.dtype = parse_dtype(f.choice_or("dtype", dtype_name(m.dtype), {"fp32", "bf16"}));
  m.allow_tf32 = f.boolean_or("allow_tf32", m.allow_tf32);
  if (m.allow_tf32 && m.dtype != DType::f32)
    fail(origin, f.path("allow_tf32") + " = true applies to fp32 GEMMs, but " + f.path("dtype") + " = \"" +
                     dtype_name(m.dtype) + "\"");
  return m;
}

// The sizes one rank's MoE layer derives from the workload, checked before anything is
// built: routed slots T·k (int32 indices), the dispatched tokens [T·k,M] and the experts'
// hidden activations [T·k,H] (every expert's rows together), the gate logits [T,E].
void check_derived_sizes(const WorkloadConfig& w) {
  const ModelConfig& m = w.model;
  const std::string T = "tokens_per_rank = " + std::to_string(w.tokens_per_rank);
  const Checked slots = Checked(w.tokens_per_rank) * m.top_k;
  if (!slots.ok() || slots.value() > limits::kMaxRoutedSlots)
    fail(w.origin, "tokens_per_rank × model.top_k = " + std::to_string(w.tokens_per_rank) + " × " +
                       std::to_string(m.top_k) + " routed slots is more than 2^31 - 1 (routing indices are int32)");
  const std::pair<Checked, const char*> sizes[] = {
      {slots * std::max(m.d_model, m.d_hidden), "tokens_per_rank × model.top_k × max(model.d_model, model.d_hidden)"},
      {Checked(w.tokens_per_rank) * m.num_experts, "tokens_per_rank × model.num_experts"},
  };
  for (const auto& [n, what] : sizes)
    if (!n.ok()) fail(w.origin, std::string(what) + " exceeds 2^56 elements (" + T + "; see harness/config/limits.hpp)");
}

// "experiments/workloads/tiny.json" -> "tiny": the default name of a workload.
std::string stem_of(const std::string& origin) {
  const std::string stem = std::filesystem::path(origin).stem().string();
  return stem.empty() || stem[0] == '<' ? "workload" : stem;
}

}  // namespace

const std::vector<std::string>& expert_fields::names() {
  static const std::vector<std::string> n = {"d_hidden",   "num_experts", "top_k",      "capacity_factor",
                                             "activation", "noisy_gate",  "renormalize"};
  return n;
}

void expert_fields::read(const Fields& f, const std::string& d_model_path, ModelConfig& m) {
  const std::string& origin = f.origin();
  m.d_hidden = f.integer("d_hidden", 1, limits::kMaxHidden);
  m.num_experts = f.integer("num_experts", 1, limits::kMaxExperts);
  m.top_k = static_cast<int>(f.integer("top_k", 1, limits::kMaxExperts));
  if (m.top_k > m.num_experts)
    fail(origin, f.path("top_k") + " = " + std::to_string(m.top_k) + " must be <= " + f.path("num_experts") + " = " +
                     std::to_string(m.num_experts));
  m.capacity_factor = f.number_or("capacity_factor", m.capacity_factor);
  if (!(m.capacity_factor >= 0.0) || !std::isfinite(m.capacity_factor))
    f.bad_value("capacity_factor", "must be a finite number >= 0 (0 means no capacity limit)");
  if (m.capacity_factor > limits::kMaxCapacityFactor)
    f.bad_value("capacity_factor", "is too large (at most " + json_fields::number_text(limits::kMaxCapacityFactor) +
                                       ": a factor of num_experts / top_k already lets every expert take every token)");
  m.activation = parse_activation(f.choice_or("activation", activation_name(m.activation), activation_names()));
  m.noisy_gate = f.boolean_or("noisy_gate", m.noisy_gate);
  m.renormalize = f.boolean_or("renormalize", m.renormalize);
  // One layer's experts, W1 [E,M,H] and W2 [E,H,M]: every tensor of the layer is smaller.
  if (!(Checked(m.num_experts) * 2 * m.d_model * m.d_hidden).ok())
    fail(origin, "the expert weights of one layer, " + f.path("num_experts") + " × 2 × " + d_model_path + " × " +
                     f.path("d_hidden") + " = " + std::to_string(m.num_experts) + " × 2 × " +
                     std::to_string(m.d_model) + " × " + std::to_string(m.d_hidden) +
                     ", exceed 2^56 elements (see harness/config/limits.hpp)");
}

// ceil(cf * k * T / E). A product that lands within rounding error of an integer is taken
// as that integer, so that cf = 1.1 with k*T/E = 100 gives 110 slots, not 111.
// An expert receives at most T slots (a token's k experts are distinct), so a capacity of T
// or more changes no routing: it is clamped there, which also keeps any factor (1e17, inf)
// from wrapping to a negative capacity in the conversion to an integer.
std::int64_t ModelConfig::capacity(std::int64_t tokens) const {
  if (!(capacity_factor > 0.0) || num_experts <= 0 || tokens <= 0) return 0;
  const double x =
      capacity_factor * static_cast<double>(top_k) * static_cast<double>(tokens) / static_cast<double>(num_experts);
  if (!(x < static_cast<double>(tokens))) return tokens;
  const double r = std::round(x);
  if (std::abs(x - r) <= 1e-9 * std::max(1.0, r)) return static_cast<std::int64_t>(r);
  return static_cast<std::int64_t>(std::ceil(x));
}

ModelConfig parse_model(const json& j, const std::string& origin) { return parse_model_at(j, origin, "model."); }

WorkloadConfig parse_workload(const json& j, const std::string& origin) {
  if (!j.is_object()) fail(origin, "expected a JSON object at the top level, got " + show(j));
  Fields f(j, origin, "",
           {"name", "description", "model", "tokens_per_rank", "steps", "warmup", "seed", "expert_parallel"});
  WorkloadConfig w;
  w.origin = origin;
  w.name = f.string_or("name", stem_of(origin));
  w.description = f.string_or("description", "");
  w.model = parse_model_at(f.require("model"), origin, "model.");
  w.tokens_per_rank = f.integer("tokens_per_rank", 1, limits::kMaxTokensPerRank);
  check_derived_sizes(w);
  w.steps = static_cast<int>(f.integer_or("steps", w.steps, 1, kIntMax));
  w.warmup = static_cast<int>(f.integer_or("warmup", w.warmup, 0, kIntMax));
  if (const json* s = f.find("seed")) {
    if (s->is_number_unsigned())
      w.seed = s->get<std::uint64_t>();
    else
      w.seed = static_cast<std::uint64_t>(f.integer("seed", *s, 0, kInt64Max));
  }
  w.expert_parallel = static_cast<int>(f.integer_or("expert_parallel", w.expert_parallel, 0, kIntMax));
  return w;
}

WorkloadConfig load_workload(const std::string& path) {
  return json_fields::reading(path, [&] { return parse_workload(json_fields::read_file(path, "workload file"), path); });
}

void validate_for_world(const WorkloadConfig& w, int world_size) {
  MOELAB_CHECK(world_size >= 1, "world size " + std::to_string(world_size));
  const int ep = w.expert_parallel > 0 ? w.expert_parallel : world_size;
  if (ep != world_size)
    fail(w.origin, "expert_parallel = " + std::to_string(w.expert_parallel) + " but " + std::to_string(world_size) +
                       (world_size == 1 ? " rank was" : " ranks were") +
                       " launched (expert parallelism spans every rank: launch " + std::to_string(ep) +
                       " ranks, or set expert_parallel to 0)");
  // Without a capacity limit one rank's experts may receive every rank's routed slots.
  if (!(Checked(world_size) * w.tokens_per_rank * w.model.top_k * std::max(w.model.d_model, w.model.d_hidden)).ok())
    fail(w.origin, "the rows one rank can receive, " + std::to_string(world_size) +
                       " ranks × tokens_per_rank × model.top_k = " + std::to_string(world_size) + " × " +
                       std::to_string(w.tokens_per_rank) + " × " + std::to_string(w.model.top_k) +
                       ", times max(model.d_model, model.d_hidden) exceed 2^56 elements (see harness/config/limits.hpp)");
  if (w.model.num_experts % ep != 0) {
    std::string msg = "model.num_experts = " + std::to_string(w.model.num_experts) +
                      " is not divisible by the expert-parallel degree " + std::to_string(ep);
    if (ep > w.model.num_experts)
      msg += " (more ranks than experts: every rank holds at least one expert, so launch at most " +
             std::to_string(w.model.num_experts) + " ranks)";
    else
      msg += " (every rank must hold the same number of experts)";
    fail(w.origin, msg);
  }
}

json to_json(const ModelConfig& m) {
  json j = {{"name", m.name},
          {"d_model", m.d_model},
          {"d_hidden", m.d_hidden},
          {"num_experts", m.num_experts},
          {"top_k", m.top_k},
          {"capacity_factor", m.capacity_factor},
          {"activation", activation_name(m.activation)},
          {"noisy_gate", m.noisy_gate},
          {"renormalize", m.renormalize},
          {"dtype", dtype_name(m.dtype)}};
  if (m.allow_tf32) j["allow_tf32"] = true;  // only when set: older result files stay as they were
  return j;
}

json to_json(const WorkloadConfig& w) {
  return {{"name", w.name},
          {"description", w.description},
          {"model", to_json(w.model)},
          {"tokens_per_rank", w.tokens_per_rank},
          {"steps", w.steps},
          {"warmup", w.warmup},
          {"seed", w.seed},
          {"expert_parallel", w.expert_parallel}};
}

}  // namespace moelab
