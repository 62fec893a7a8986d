// harness/config/model.cpp — reading and checking model files (see model.hpp), and the sizes
// a model implies: parameter counts and one layer's tensors for a batch.
//
// Messages are one line naming the file, the field and the value, from the same field
// readers as workload files (harness/config/json_fields.hpp); the MoE layer's expert fields
// are read by the same function as a workload's (harness/config/expert_fields.hpp). Every
// size derived from the fields is computed with Checked (harness/config/limits.hpp), so no
// parameter count or tensor size can wrap.
// Tested by harness/tests/model_config_test.cpp (ctest -R model_config).
#include "harness/config/model.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "harness/config/expert_fields.hpp"
#include "harness/config/json_fields.hpp"
#include "harness/config/limits.hpp"
#include "harness/runtime/error.hpp"

namespace moelab {

using nlohmann::json;

namespace {

using json_fields::fail;
using json_fields::Fields;
using json_fields::quote;
using json_fields::show;

// Rotary bases in use run from 10^4 (LLaMA 2) to 10^6 and beyond; the bound keeps the value
// a finite float.
constexpr double kMaxRopeTheta = 1e12;

std::string stem_of(const std::string& origin) {
  const std::string stem = std::filesystem::path(origin).stem().string();
  return stem.empty() || stem[0] == '<' ? "model" : stem;
}

MlpKind parse_mlp(const std::string& s) { return s == "swiglu" ? MlpKind::swiglu : MlpKind::gelu; }
PositionKind parse_positions(const std::string& s) {
  return s == "rotary" ? PositionKind::rotary : s == "none" ? PositionKind::none : PositionKind::learned;
}
MoELayers parse_moe_layers(const std::string& s) {
  return s == "all" ? MoELayers::all : s == "every_second" ? MoELayers::every_second : MoELayers::none;
}

// "auto" (-> fallback) or an integer in [lo, hi].
int auto_or_integer(const Fields& f, const char* key, int fallback, std::int64_t lo, std::int64_t hi) {
  const json* v = f.find(key);
  if (!v || (v->is_string() && v->get<std::string>() == "auto")) return fallback;
  if (!v->is_number()) f.wrong_type(key, *v, ("\"auto\" or an integer from " + std::to_string(lo) + " to " + std::to_string(hi)).c_str());
  const std::int64_t n = f.integer(key, *v, lo, hi);
  return static_cast<int>(n);
}

// The "scmoe" object (ScMoE's block pairs), read after "moe": it needs the MoE layers, top-1
// routing and a shared expert.
void read_scmoe(const Fields& f, const json& sc, const json* moe, TransformerConfig& t) {
  const std::string& origin = t.origin;
  if (t.moe_layers == MoELayers::none)
    fail(origin, "scmoe = " + show(sc) + " is given but moe_layers = \"none\" (ScMoE shortcuts the routed MoE of the MoE "
                 "blocks: set moe_layers and moe, or remove \"scmoe\")");
  if (!sc.is_object()) f.wrong_type("scmoe", sc, "an object");
  Fields sf(sc, origin, "scmoe.", {"position", "combine", "expert_slot", "chunks"});
  ShortcutConfig& c = t.scmoe;
  c.enabled = true;
  // The paper's default is Pos-2; with an MoE in every block it uses Pos-1.
  const std::string pos = sf.choice_or("position", t.moe_layers == MoELayers::all ? "pos1" : "pos2", {"pos1", "pos2", "pos3"});
  c.position = pos == "pos1" ? ShortcutPosition::pos1 : pos == "pos3" ? ShortcutPosition::pos3 : ShortcutPosition::pos2;
  const std::string comb = sf.choice_or("combine", "cg1", {"add", "cg1", "cg2"});
  c.combine = comb == "add" ? ShortcutCombine::add : comb == "cg2" ? ShortcutCombine::cg2 : ShortcutCombine::cg1;
  if (t.moe_layers == MoELayers::all && c.position != ShortcutPosition::pos1)
    fail(origin, "scmoe.position = \"" + pos + "\" takes the routed MoE's input from the dense block before each MoE "
                 "block, but moe_layers = \"all\" has none: use \"pos1\" (ScMoE's choice when every block has an MoE)");
  c.expert_slot = auto_or_integer(sf, "expert_slot", -1, 0, c.window_blocks());
  c.chunks = auto_or_integer(sf, "chunks", 0, 1, 64);
  if (t.moe.top_k != 1)
    fail(origin, "moe.top_k = " + std::to_string(t.moe.top_k) +
                     ": ScMoE's routed MoE sends each token to one expert (with \"scmoe\", moe.top_k must be 1)");
  if (!moe->contains("shared_expert_hidden"))
    t.shared_expert_hidden = t.d_ffn;  // the shared expert is a dense MLP
  else if (t.shared_expert_hidden == 0)
    fail(origin, "moe.shared_expert_hidden = 0, but ScMoE's MoE block always has a shared expert (leave the field out "
                 "for one as wide as d_ffn)");
}

// A float field in (0, hi].
float positive_float(const Fields& f, const char* key, float fallback, double hi) {
  if (!f.find(key)) return fallback;
  const double v = f.number(key);
  if (!(v > 0 && v <= hi)) f.bad_value(key, "must be > 0 and <= " + json_fields::number_text(hi));
  return static_cast<float>(v);
}

// The shortest decimal that reads back as the same float, so that 1e-5f is written as 1e-05
// rather than 9.999999747378752e-06.
json float_json(float x) {
  char buf[32];
  for (int digits = 1; digits <= 9; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, static_cast<double>(x));
    if (std::strtof(buf, nullptr) == x) break;
  }
  return std::strtod(buf, nullptr);
}

// The one-line message for a derived size beyond the bound.
[[noreturn]] void too_large(const std::string& origin, const std::string& what, const std::string& formula) {
  fail(origin, what + " (" + formula + ") exceeds 2^56 (see harness/config/limits.hpp)");
}

}  // namespace

const char* mlp_name(MlpKind k) { return k == MlpKind::swiglu ? "swiglu" : "gelu"; }
const char* positions_name(PositionKind k) {
  return k == PositionKind::rotary ? "rotary" : k == PositionKind::none ? "none" : "learned";
}
const char* moe_layers_name(MoELayers m) {
  return m == MoELayers::all ? "all" : m == MoELayers::every_second ? "every_second" : "none";
}
const char* shortcut_position_name(ShortcutPosition p) {
  return p == ShortcutPosition::pos1 ? "pos1" : p == ShortcutPosition::pos3 ? "pos3" : "pos2";
}
const char* shortcut_combine_name(ShortcutCombine c) {
  return c == ShortcutCombine::add ? "add" : c == ShortcutCombine::cg2 ? "cg2" : "cg1";
}

int TransformerConfig::num_moe_layers() const {
  switch (moe_layers) {
    case MoELayers::all:
      return num_layers;
    case MoELayers::every_second:
      return num_layers / 2;  // layers 1, 3, 5, ...
    case MoELayers::none:
      break;
  }
  return 0;
}

ParamCounts TransformerConfig::parameter_counts() const {
  const std::int64_t M = d_model, D = head_dim();
  const int moe_count = num_moe_layers(), dense = num_layers - moe_count;
  const int mlp_mats = mlp == MlpKind::swiglu ? 3 : 2;  // SwiGLU: W1 [M,2F] (gate | up) and W2 [F,M]
  const auto count = [&](const Checked& c, const char* what, const std::string& formula) {
    if (!c.ok()) too_large(origin, what, formula);
    return c.value();
  };
  ParamCounts p;
  p.embedding = count(Checked(vocab_size) * M + Checked(positions == PositionKind::learned ? seq_len : 0) * M +
                          Checked(tie_embeddings ? 0 : vocab_size) * M,
                      "the embedding's parameter count",
                      "vocab_size × d_model, + seq_len × d_model for learned positions, + vocab_size × d_model untied");
  p.attention = count(Checked(num_layers) * (Checked(M) * (num_heads + 2 * static_cast<std::int64_t>(num_kv_heads)) * D +
                                             Checked(num_heads) * D * M),
                      "the attention parameter count",
                      "num_layers × d_model × (2 × num_heads + 2 × num_kv_heads) × head_dim");
  p.dense_mlp = count(Checked(dense) * mlp_mats * M * d_ffn + Checked(moe_count) * mlp_mats * M * shared_expert_hidden,
                      "the dense MLP parameter count",
                      "dense layers × d_model × d_ffn, + MoE layers × d_model × moe.shared_expert_hidden, × 2 (gelu) or 3 "
                      "(swiglu); num_layers = " + std::to_string(num_layers));
  p.experts = count(Checked(moe_count) * moe.num_experts * 2 * M * moe.d_hidden,
                    "the routed experts' parameter count",
                    "MoE layers × moe.num_experts × 2 × d_model × moe.d_hidden; num_layers = " +
                        std::to_string(num_layers) + ", moe_layers = \"" + moe_layers_name(moe_layers) + "\"");
  // ScMoE adds per MoE layer its combine gate W_cg [M,1] or [M,2] and the routed MoE's own norm.
  p.gates = count(Checked(moe_count) * ((moe.noisy_gate ? 2 : 1) * moe.num_experts + scmoe.gate_width()) * M,
                  "the gates' parameter count", "MoE layers × d_model × moe.num_experts, × 2 with moe.noisy_gate");
  p.norms = count((Checked(2) * num_layers + 1 + (scmoe.enabled ? moe_count : 0)) * (norm == NormKind::layernorm ? 2 : 1) * M,
                  "the norms' parameter count", "(2 × num_layers + 1) × d_model, × 2 for layernorm");
  p.total = count(Checked(p.embedding) + p.attention + p.dense_mlp + p.experts + p.gates + p.norms,
                  "the total parameter count", "embedding + attention + dense MLP + experts + gates + norms");
  return p;
}

ActivationSizes TransformerConfig::activation_sizes(std::int64_t batch) const {
  if (batch < 1) fail(origin, "batch = " + std::to_string(batch) + " must be >= 1");
  const std::string of = "batch = " + std::to_string(batch) + ", seq_len = " + std::to_string(seq_len);
  const auto size = [&](const Checked& c, const char* what) {
    if (!c.ok()) too_large(origin, std::string("the size of one layer's ") + what, of);
    return c.value();
  };
  const bool has_moe = num_moe_layers() > 0;
  const int mlp_width = mlp == MlpKind::swiglu ? 2 : 1;  // SwiGLU's first GEMM writes gate | up
  ActivationSizes a;
  a.tokens = size(Checked(batch) * seq_len, "tokens");
  a.hidden = size(Checked(a.tokens) * d_model, "hidden states [T,M]");
  a.qkv = size(Checked(a.tokens) * (num_heads + 2 * static_cast<std::int64_t>(num_kv_heads)) * head_dim(),
               "packed q, k, v [T,(Hq+2Hkv)·D]");
  a.lse = size(Checked(batch) * num_heads * seq_len, "attention log-sum-exp [B,Hq,S]");
  a.mlp_hidden = num_layers > num_moe_layers() ? size(Checked(a.tokens) * mlp_width * d_ffn, "MLP hidden [T,F]") : 0;
  a.logits = size(Checked(a.tokens) * vocab_size, "logits [T,V]");
  if (has_moe) {
    a.gate_logits = size(Checked(a.tokens) * moe.num_experts, "gate logits [T,E]");
    a.routed_slots = size(Checked(a.tokens) * moe.top_k, "routed slots T·k");
    if (a.routed_slots > limits::kMaxRoutedSlots)
      fail(origin, "the routed slots of one layer, batch × seq_len × moe.top_k = " + std::to_string(a.routed_slots) +
                       ", are more than 2^31 - 1 (routing indices are int32; " + of + ")");
    a.expert_hidden = size(Checked(a.routed_slots) * moe.d_hidden, "experts' hidden [T·k,H]");
    a.shared_hidden = size(Checked(a.tokens) * mlp_width * shared_expert_hidden, "shared expert's hidden [T,Hs]");
  }
  return a;
}

TransformerConfig parse_transformer(const json& j, const std::string& origin) {
  if (!j.is_object()) fail(origin, "expected a JSON object at the top level, got " + show(j));
  Fields f(j, origin, "",
           {"name", "description", "source", "d_model", "num_heads", "num_kv_heads", "d_ffn", "num_layers", "seq_len",
            "vocab_size", "norm", "norm_eps", "mlp", "positions", "rope_theta", "attention", "tie_embeddings", "dtype",
            "allow_tf32", "moe_layers", "moe", "scmoe"});
  TransformerConfig t;
  t.origin = origin;
  t.name = f.string_or("name", stem_of(origin));
  (void)f.string_or("description", "");
  t.source = f.string("source");
  t.d_model = f.integer("d_model", 1, limits::kMaxDModel);
  t.num_heads = static_cast<int>(f.integer("num_heads", 1, limits::kMaxDModel));
  if (t.d_model % t.num_heads != 0)
    fail(origin, "num_heads = " + std::to_string(t.num_heads) + " does not divide d_model = " +
                     std::to_string(t.d_model) + " (every head has d_model / num_heads dimensions)");
  t.num_kv_heads = static_cast<int>(f.integer_or("num_kv_heads", t.num_heads, 1, limits::kMaxDModel));
  if (t.num_heads % t.num_kv_heads != 0)
    fail(origin, "num_kv_heads = " + std::to_string(t.num_kv_heads) + " does not divide num_heads = " +
                     std::to_string(t.num_heads) +
                     " (grouped-query attention: each key/value head serves num_heads / num_kv_heads query heads)");
  t.d_ffn = f.integer("d_ffn", 1, limits::kMaxHidden);
  t.num_layers = static_cast<int>(f.integer("num_layers", 1, limits::kMaxLayers));
  t.seq_len = f.integer("seq_len", 1, limits::kMaxSeqLen);
  t.vocab_size = f.integer("vocab_size", 1, limits::kMaxVocab);
  t.norm = parse_norm(f.choice_or("norm", norm_name(t.norm), {"layernorm", "rmsnorm"}));
  t.norm_eps = positive_float(f, "norm_eps", t.norm_eps, 1.0);
  t.mlp = parse_mlp(f.choice_or("mlp", mlp_name(t.mlp), {"gelu", "swiglu"}));
  t.positions = parse_positions(f.choice_or("positions", positions_name(t.positions), {"learned", "rotary", "none"}));
  if (t.positions == PositionKind::rotary) {
    t.rope_theta = positive_float(f, "rope_theta", t.rope_theta, kMaxRopeTheta);
    if (t.head_dim() % 2 != 0)
      fail(origin, "head_dim = d_model / num_heads = " + std::to_string(t.d_model) + " / " +
                       std::to_string(t.num_heads) + " = " + std::to_string(t.head_dim()) +
                       " is odd, but positions = \"rotary\" rotates pairs of dimensions");
  } else if (const json* v = f.find("rope_theta")) {
    fail(origin, "rope_theta = " + show(*v) + " is only used with positions = \"rotary\" (this model has positions = \"" +
                     positions_name(t.positions) + "\")");
  }
  t.causal = f.choice_or("attention", "causal", {"causal", "bidirectional"}) == "causal";
  t.tie_embeddings = f.boolean_or("tie_embeddings", t.tie_embeddings);
  t.dtype = parse_dtype(f.choice_or("dtype", dtype_name(t.dtype), {"fp32", "bf16"}));
  t.allow_tf32 = f.boolean_or("allow_tf32", t.allow_tf32);
  if (t.allow_tf32 && t.dtype != DType::f32)
    fail(origin, "allow_tf32 = true applies to fp32 GEMMs, but dtype = \"" + std::string(dtype_name(t.dtype)) + "\"");

  t.moe_layers = parse_moe_layers(f.choice_or("moe_layers", moe_layers_name(t.moe_layers), {"none", "all", "every_second"}));
  const json* moe = f.find("moe");
  const std::string layers = std::string("moe_layers = \"") + moe_layers_name(t.moe_layers) + "\"";
  if (t.moe_layers == MoELayers::none) {
    if (moe)
      fail(origin, "moe = " + show(*moe) + " is given but " + layers +
                       " (no layer uses it: set moe_layers to \"all\" or \"every_second\", or remove \"moe\")");
  } else {
    if (!moe) fail(origin, "missing field \"moe\" (" + layers + " has MoE layers, and \"moe\" describes them)");
    if (t.num_moe_layers() == 0)
      fail(origin, layers + " with num_layers = 1 has no MoE layer (layers 1, 3, 5, ... are the MoE ones)");
    if (!moe->is_object()) f.wrong_type("moe", *moe, "an object");
    std::vector<std::string> known = expert_fields::names();
    known.push_back("shared_expert_hidden");
    Fields mf(*moe, origin, "moe.", known);
    t.moe.name = t.name;
    t.moe.d_model = t.d_model;
    t.moe.dtype = t.dtype;
    t.moe.allow_tf32 = t.allow_tf32;
    expert_fields::read(mf, "d_model", t.moe);
    t.shared_expert_hidden = mf.integer_or("shared_expert_hidden", 0, 0, limits::kMaxHidden);
  }
  if (const json* sc = f.find("scmoe")) read_scmoe(f, *sc, moe, t);
  // Every derived size, now, so that a loaded model never fails later.
  (void)t.parameter_counts();
  (void)t.activation_sizes(1);
  return t;
}

TransformerConfig load_transformer(const std::string& path) { return load_transformer(path, json()); }

TransformerConfig load_transformer(const std::string& path, const json& overrides) {
  return json_fields::reading(path, [&] { return parse_transformer(json_fields::read_file(path, "model file"), path, overrides); });
}

TransformerConfig parse_transformer(json j, const std::string& path, const json& overrides) {
  if (overrides.is_null() || (overrides.is_object() && overrides.empty())) return parse_transformer(j, path);
  // A field that came from the overrides is not in the file: the messages say so.
  const std::string origin = path + " with overrides " + show(overrides);
  if (!overrides.is_object()) fail(origin, "overrides: expected an object of fields, got " + show(overrides));
  j.merge_patch(overrides);  // RFC 7386: null removes a field, objects merge, the rest replaces
  return parse_transformer(j, origin);
}

json to_json(const TransformerConfig& t) {
  json j = {{"name", t.name},
            {"source", t.source},
            {"d_model", t.d_model},
            {"num_heads", t.num_heads},
            {"num_kv_heads", t.num_kv_heads},
            {"d_ffn", t.d_ffn},
            {"num_layers", t.num_layers},
            {"seq_len", t.seq_len},
            {"vocab_size", t.vocab_size},
            {"norm", norm_name(t.norm)},
            {"norm_eps", float_json(t.norm_eps)},
            {"mlp", mlp_name(t.mlp)},
            {"positions", positions_name(t.positions)},
            {"attention", t.causal ? "causal" : "bidirectional"},
            {"tie_embeddings", t.tie_embeddings},
            {"dtype", dtype_name(t.dtype)},
            {"moe_layers", moe_layers_name(t.moe_layers)}};
  if (t.positions == PositionKind::rotary) j["rope_theta"] = float_json(t.rope_theta);
  if (t.allow_tf32) j["allow_tf32"] = true;
  if (t.moe_layers != MoELayers::none) {
    json moe = to_json(t.moe);
    for (const char* k : {"name", "d_model", "dtype", "allow_tf32"}) moe.erase(k);  // the model's own
    moe["shared_expert_hidden"] = t.shared_expert_hidden;
    j["moe"] = moe;
  }
  if (t.scmoe.enabled) {
    const ShortcutConfig& c = t.scmoe;
    j["scmoe"] = {{"position", shortcut_position_name(c.position)},
                  {"combine", shortcut_combine_name(c.combine)},
                  {"expert_slot", c.expert_slot < 0 ? json("auto") : json(c.expert_slot)},
                  {"chunks", c.chunks < 1 ? json("auto") : json(c.chunks)}};
  }
  return j;
}

}  // namespace moelab
