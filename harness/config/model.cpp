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

#include <algorithm>
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

// The "vision" object (a hierarchical vision transformer, VisionConfig), read after d_model: it
// sets the fields a vision model derives (num_layers, seq_len, vocab_size, num_heads, the MoE
// layers), which the file may not give.
void read_vision(const Fields& f, const json& v, TransformerConfig& t) {
  const std::string& origin = t.origin;
  for (const char* k : {"moe_layers", "rope_theta"})
    if (const json* given = f.find(k))
      fail(origin, std::string(k) + " = " + show(*given) + " is given, but a vision model (\"vision\") has no such field: "
                   "its MoE layers are the stages' moe_blocks, its positions none (remove the field)");
  if (!v.is_object()) f.wrong_type("vision", v, "an object");
  Fields vf(v, origin, "vision.", {"image_size", "patch_size", "in_channels", "num_classes", "window", "stages"});
  VisionConfig& c = t.vision;
  c.enabled = true;
  constexpr std::int64_t kMaxSide = std::int64_t{1} << 16;
  c.image_size = vf.integer("image_size", 1, kMaxSide);
  c.patch_size = vf.integer("patch_size", 1, kMaxSide);
  if (c.image_size % c.patch_size != 0)
    vf.bad_value("patch_size", "does not divide image_size = " + std::to_string(c.image_size) + " (the patches tile the image)");
  c.in_channels = vf.integer("in_channels", 1, kMaxSide);
  if (!(Checked(c.patch_size) * c.patch_size * c.in_channels).ok() || c.patch_values() > limits::kMaxHidden)
    fail(origin, "vision: patch_size² × in_channels (the values of one patch) exceeds " + std::to_string(limits::kMaxHidden));
  c.num_classes = vf.integer("num_classes", 1, limits::kMaxVocab);
  c.window = vf.integer("window", 1, kMaxSide);
  const json& st = vf.require("stages");
  constexpr std::size_t kMaxStages = 16;
  if (!st.is_array() || st.empty() || st.size() > kMaxStages)
    vf.wrong_type("stages", st, "an array of 1 to 16 stages");
  const std::int64_t side = c.image_size / c.patch_size;
  if (side * side > limits::kMaxSeqLen)
    fail(origin, "vision: (image_size / patch_size)² = " + std::to_string(side * side) + " tokens per image exceeds " +
                     std::to_string(limits::kMaxSeqLen) + " (seq_len's bound)");
  int layers = 0;
  t.moe_mask.clear();
  for (std::size_t i = 0; i < st.size(); ++i) {
    const std::string pre = "vision.stages[" + std::to_string(i) + "]";
    if (!st[i].is_object()) fail(origin, pre + ": expected an object with depth, num_heads and moe_blocks, got " + show(st[i]));
    Fields sf(st[i], origin, pre + ".", {"depth", "num_heads", "moe_blocks"});
    VisionConfig::Stage g;
    g.depth = static_cast<int>(sf.integer("depth", 1, limits::kMaxLayers));
    g.num_heads = static_cast<int>(sf.integer("num_heads", 1, limits::kMaxDModel));
    const int s = static_cast<int>(i);
    if (s > 0 && (side >> (s - 1)) % 2 != 0)
      fail(origin, pre + ": stage " + std::to_string(s - 1) + "'s feature map is " + std::to_string(side >> (s - 1)) + " × " +
                       std::to_string(side >> (s - 1)) + " tokens, odd, but patch merging halves it (image_size / "
                       "patch_size = " + std::to_string(side) + " must be divisible by 2^" + std::to_string(s) + ")");
    if (t.d_model > (limits::kMaxDModel >> s))
      fail(origin, pre + ": its width d_model × 2^" + std::to_string(s) + " exceeds " + std::to_string(limits::kMaxDModel));
    const std::int64_t width = t.d_model << s;
    if (width % g.num_heads != 0)
      sf.bad_value("num_heads", "does not divide the stage's width " + std::to_string(width) + " (d_model × 2^" +
                                    std::to_string(s) + ")");
    const std::int64_t grid = side >> s, w = std::min(c.window, grid);
    if (w < grid && grid % w != 0)
      fail(origin, "vision.window = " + std::to_string(c.window) + " does not divide stage " + std::to_string(s) +
                       "'s feature map side " + std::to_string(grid) + " (windows tile the map)");
    std::vector<char> mask(static_cast<std::size_t>(g.depth), 0);
    if (const json* mb = sf.find("moe_blocks")) {
      if (!mb->is_array()) sf.wrong_type("moe_blocks", *mb, "an array of block indices within the stage ([] for none)");
      for (std::size_t k = 0; k < mb->size(); ++k) {
        const std::string key = "moe_blocks[" + std::to_string(k) + "]";
        const std::int64_t b = sf.integer(key.c_str(), (*mb)[k], 0, g.depth - 1);
        if (!g.moe_blocks.empty() && b <= g.moe_blocks.back())
          sf.bad_value("moe_blocks", "is not increasing (each block once, in order)");
        g.moe_blocks.push_back(static_cast<int>(b));
        mask[static_cast<std::size_t>(b)] = 1;
      }
    }
    layers += g.depth;
    if (layers > limits::kMaxLayers)
      fail(origin, "vision.stages: the depths sum to more than " + std::to_string(limits::kMaxLayers) + " layers");
    t.moe_mask.insert(t.moe_mask.end(), mask.begin(), mask.end());
    c.stages.push_back(std::move(g));
  }
  t.num_layers = layers;
  t.seq_len = side * side;
  t.vocab_size = c.num_classes;
  t.num_heads = t.num_kv_heads = c.stages[0].num_heads;
  t.positions = PositionKind::none;
  t.tie_embeddings = false;
  // The fields a vision model derives may be written out (a result's "model" has them), but
  // only as derived.
  const std::pair<const char*, json> derived[] = {
      {"num_layers", t.num_layers}, {"seq_len", t.seq_len},         {"vocab_size", t.vocab_size},
      {"num_heads", t.num_heads},   {"num_kv_heads", t.num_kv_heads}, {"positions", "none"},
      {"tie_embeddings", false}};
  for (const auto& [k, want] : derived)
    if (const json* given = f.find(k); given && *given != want)
      fail(origin, std::string(k) + " = " + show(*given) + ", but a vision model (\"vision\") derives " + show(want) +
                       " (num_layers: the stages' depths summed; seq_len: (image_size / patch_size)²; vocab_size: "
                       "num_classes; num_heads: stage 0's; positions none; embeddings untied): remove the field");
  const bool any_moe = std::find(t.moe_mask.begin(), t.moe_mask.end(), 1) != t.moe_mask.end();
  t.moe_layers = any_moe ? MoELayers::listed : MoELayers::none;
  if (!any_moe) t.moe_mask.clear();
}

// A width given for stage 0 of a vision model, doubled per stage, must stay within `hi`.
void check_stage_width(const TransformerConfig& t, const char* field, std::int64_t width, std::int64_t hi) {
  if (!t.vision.enabled) return;
  const int last = static_cast<int>(t.vision.stages.size()) - 1;
  if (width > (hi >> last))
    fail(t.origin, std::string(field) + " = " + std::to_string(width) + " (stage 0's) doubles to more than " +
                       std::to_string(hi) + " at stage " + std::to_string(last));
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

// Stage s of a vision model as a plain stack of its layers (its widths, its MoE blocks only), for
// the counts and sizes the plain code computes.
TransformerConfig stage_stack(const TransformerConfig& t, int s) {
  const int first = t.vision.first_layer(s);
  TransformerConfig c = t.layer_config(first);
  c.vision.enabled = false;
  c.num_layers = t.vision.stages[static_cast<std::size_t>(s)].depth;
  c.moe_mask.clear();
  if (!t.moe_mask.empty()) c.moe_mask.assign(t.moe_mask.begin() + first, t.moe_mask.begin() + first + c.num_layers);
  c.moe_layers = MoELayers::listed;
  if (c.num_moe_layers() == 0) c.moe_layers = MoELayers::none;
  return c;
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
  return m == MoELayers::all ? "all" : m == MoELayers::every_second ? "every_second" : m == MoELayers::listed ? "listed" : "none";
}
const char* shortcut_position_name(ShortcutPosition p) {
  return p == ShortcutPosition::pos1 ? "pos1" : p == ShortcutPosition::pos3 ? "pos3" : "pos2";
}
const char* shortcut_combine_name(ShortcutCombine c) {
  return c == ShortcutCombine::add ? "add" : c == ShortcutCombine::cg2 ? "cg2" : "cg1";
}

int VisionConfig::stage_of(int layer) const {
  int end = 0;
  for (std::size_t s = 0; s < stages.size(); ++s) {
    end += stages[s].depth;
    if (layer < end) return static_cast<int>(s);
  }
  return static_cast<int>(stages.size()) - 1;
}

int VisionConfig::first_layer(int stage) const {
  int first = 0;
  for (int s = 0; s < stage; ++s) first += stages[static_cast<std::size_t>(s)].depth;
  return first;
}

TransformerConfig TransformerConfig::layer_config(int layer) const {
  if (!vision.enabled) return *this;
  const int s = vision.stage_of(layer);
  TransformerConfig c = *this;
  const std::int64_t w = vision.window_of(s);
  c.d_model = d_model << s;
  c.num_heads = c.num_kv_heads = vision.stages[static_cast<std::size_t>(s)].num_heads;
  c.d_ffn = d_ffn << s;
  c.shared_expert_hidden = shared_expert_hidden << s;
  c.moe.d_model = c.d_model;
  c.moe.d_hidden = moe.d_hidden << s;
  c.seq_len = w * w;
  c.grid = vision.grid(s);
  return c;
}

int TransformerConfig::num_moe_layers() const {
  switch (moe_layers) {
    case MoELayers::listed: {
      int n = 0;
      for (char m : moe_mask) n += m ? 1 : 0;
      return n;
    }
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
  if (vision.enabled && grid == 0) {
    // Stage by stage from the layers' own configurations; the patch embedding W [P,C] and its
    // norm, the merging layers' W [4C,2C] and norms over 4C, the classifier W [C_last,K].
    const auto count = [&](const Checked& c, const char* what) {
      if (!c.ok()) too_large(origin, what, "summed over the stages");
      return c.value();
    };
    const std::int64_t norm_params = norm == NormKind::layernorm ? 2 : 1;
    ParamCounts p;
    Checked attention_c(0), dense_c(0), experts_c(0), gates_c(0), norms_c(Checked(norm_params) * d_model), merging_c(0);
    for (int s = 0; s < static_cast<int>(vision.stages.size()); ++s) {
      const TransformerConfig c = stage_stack(*this, s);
      const ParamCounts q = c.parameter_counts();
      attention_c = attention_c + q.attention;
      dense_c = dense_c + q.dense_mlp;
      experts_c = experts_c + q.experts;
      gates_c = gates_c + q.gates;
      norms_c = norms_c + Checked(q.norms - norm_params * c.d_model);  // the stack's final norm is the merge's or the head's
      if (s > 0) {
        merging_c = merging_c + Checked(4) * (d_model << (s - 1)) * c.d_model;
        norms_c = norms_c + Checked(norm_params) * 4 * (d_model << (s - 1));
      }
    }
    const std::int64_t last = d_model << (vision.stages.size() - 1);
    p.embedding = count(Checked(vision.patch_values()) * d_model + Checked(last) * vision.num_classes,
                        "the patch embedding's and classifier's parameter count");
    norms_c = norms_c + Checked(norm_params) * last;  // the head's final norm
    p.attention = count(attention_c, "the attention parameter count");
    p.dense_mlp = count(dense_c, "the dense MLP parameter count");
    p.experts = count(experts_c, "the routed experts' parameter count");
    p.gates = count(gates_c, "the gates' parameter count");
    p.norms = count(norms_c, "the norms' parameter count");
    p.merging = count(merging_c, "the patch merging parameter count");
    p.total = count(Checked(p.embedding) + p.attention + p.dense_mlp + p.experts + p.gates + p.norms + p.merging,
                    "the total parameter count");
    return p;
  }
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
  if (vision.enabled && grid == 0) {
    // The largest of each size over the stages (stage 0 has the most tokens, later stages the
    // widest experts), and the classifier's logits [B,K].
    ActivationSizes a;
    for (int s = 0; s < static_cast<int>(vision.stages.size()); ++s) {
      const TransformerConfig c = stage_stack(*this, s);
      const std::int64_t windows = (c.grid / vision.window_of(s)) * (c.grid / vision.window_of(s));
      const Checked wb = Checked(batch) * windows;
      if (!wb.ok()) too_large(origin, "the windows of a batch", "batch × windows per image");
      const ActivationSizes q = c.activation_sizes(wb.value());
      for (auto [dst, src] : {std::pair{&a.tokens, q.tokens}, {&a.hidden, q.hidden}, {&a.qkv, q.qkv}, {&a.lse, q.lse},
                              {&a.mlp_hidden, q.mlp_hidden}, {&a.gate_logits, q.gate_logits},
                              {&a.routed_slots, q.routed_slots}, {&a.expert_hidden, q.expert_hidden},
                              {&a.shared_hidden, q.shared_hidden}})
        *dst = std::max(*dst, src);
    }
    const Checked logits = Checked(batch) * vision.num_classes;
    if (!logits.ok()) too_large(origin, "the size of the classifier's logits", "batch × num_classes");
    a.logits = logits.value();
    return a;
  }
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
            "allow_tf32", "moe_layers", "moe", "scmoe", "vision"});
  TransformerConfig t;
  t.origin = origin;
  t.name = f.string_or("name", stem_of(origin));
  (void)f.string_or("description", "");
  t.source = f.string("source");
  t.d_model = f.integer("d_model", 1, limits::kMaxDModel);
  const json* vision = f.find("vision");
  if (vision) read_vision(f, *vision, t);
  else t.num_heads = static_cast<int>(f.integer("num_heads", 1, limits::kMaxDModel));
  if (t.d_model % t.num_heads != 0)
    fail(origin, "num_heads = " + std::to_string(t.num_heads) + " does not divide d_model = " +
                     std::to_string(t.d_model) + " (every head has d_model / num_heads dimensions)");
  if (!vision) t.num_kv_heads = static_cast<int>(f.integer_or("num_kv_heads", t.num_heads, 1, limits::kMaxDModel));
  if (t.num_heads % t.num_kv_heads != 0)
    fail(origin, "num_kv_heads = " + std::to_string(t.num_kv_heads) + " does not divide num_heads = " +
                     std::to_string(t.num_heads) +
                     " (grouped-query attention: each key/value head serves num_heads / num_kv_heads query heads)");
  t.d_ffn = f.integer("d_ffn", 1, limits::kMaxHidden);
  check_stage_width(t, "d_ffn", t.d_ffn, limits::kMaxHidden);
  if (!vision) {
    t.num_layers = static_cast<int>(f.integer("num_layers", 1, limits::kMaxLayers));
    t.seq_len = f.integer("seq_len", 1, limits::kMaxSeqLen);
    t.vocab_size = f.integer("vocab_size", 1, limits::kMaxVocab);
  }
  t.norm = parse_norm(f.choice_or("norm", norm_name(t.norm), {"layernorm", "rmsnorm"}));
  t.norm_eps = positive_float(f, "norm_eps", t.norm_eps, 1.0);
  t.mlp = parse_mlp(f.choice_or("mlp", mlp_name(t.mlp), {"gelu", "swiglu"}));
  if (!vision)
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
  t.causal = f.choice_or("attention", vision ? "bidirectional" : "causal", {"causal", "bidirectional"}) == "causal";
  if (vision && t.causal)
    fail(origin, "attention = \"causal\", but a vision model's windows attend both ways (\"bidirectional\", the default "
                 "with \"vision\")");
  if (!vision) t.tie_embeddings = f.boolean_or("tie_embeddings", t.tie_embeddings);
  t.dtype = parse_dtype(f.choice_or("dtype", dtype_name(t.dtype), {"fp32", "bf16"}));
  t.allow_tf32 = f.boolean_or("allow_tf32", t.allow_tf32);
  if (t.allow_tf32 && t.dtype != DType::f32)
    fail(origin, "allow_tf32 = true applies to fp32 GEMMs, but dtype = \"" + std::string(dtype_name(t.dtype)) + "\"");

  if (!vision)
    t.moe_layers = parse_moe_layers(f.choice_or("moe_layers", moe_layers_name(t.moe_layers), {"none", "all", "every_second"}));
  const json* moe = f.find("moe");
  const std::string layers = vision ? std::string(t.moe_layers == MoELayers::none ? "no stage of vision.stages lists moe_blocks"
                                                                                   : "vision.stages list moe_blocks")
                                    : std::string("moe_layers = \"") + moe_layers_name(t.moe_layers) + "\"";
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
    check_stage_width(t, "moe.d_hidden", t.moe.d_hidden, limits::kMaxHidden);
    check_stage_width(t, "moe.shared_expert_hidden", t.shared_expert_hidden, limits::kMaxHidden);
  }
  if (const json* sc = f.find("scmoe")) read_scmoe(f, *sc, moe, t);
  if (vision && t.scmoe.span() == 2) {
    // Each pair is (Block-MLP l, Block-MoE l+1) of one stage: a patch merging between them
    // would change the width the shortcut carries.
    for (int l = 0; l < t.num_layers; ++l) {
      if (!t.is_moe(l)) continue;
      const int s = t.vision.stage_of(l), b = l - t.vision.first_layer(s);
      const std::string blk = "vision.stages[" + std::to_string(s) + "] block " + std::to_string(b);
      if (b == 0)
        fail(origin, "scmoe.position = \"" + std::string(shortcut_position_name(t.scmoe.position)) + "\" pairs each MoE block "
                     "with the dense block before it, but " + blk + " is an MoE block that starts its stage (use \"pos1\", "
                     "or a dense block first)");
      if (t.is_moe(l - 1))
        fail(origin, "scmoe.position = \"" + std::string(shortcut_position_name(t.scmoe.position)) + "\" pairs each MoE block "
                     "with the dense block before it, but " + blk + " follows another MoE block (use \"pos1\")");
    }
  }
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
  if (t.vision.enabled) {
    j.erase("moe_layers");  // the stages' moe_blocks; the other derived fields stay, as derived
    const VisionConfig& v = t.vision;
    json stages = json::array();
    for (const auto& s : v.stages) stages.push_back({{"depth", s.depth}, {"num_heads", s.num_heads}, {"moe_blocks", s.moe_blocks}});
    j["vision"] = {{"image_size", v.image_size}, {"patch_size", v.patch_size}, {"in_channels", v.in_channels},
                   {"num_classes", v.num_classes}, {"window", v.window}, {"stages", stages}};
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
