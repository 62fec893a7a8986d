// harness/tests/model_config_test.cpp — model files (experiments/models/): every shipped file
// loads, parameter counts match a hand computation, overrides merge as RFC 7386 says, and
// every bad input is one ConfigError line naming the file and the field.
//
//   ctest --test-dir build -R model_config
//   build/harness/tests/model_config_test --gtest_filter='BadModel*'
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "harness/config/model.hpp"
#include "harness/runtime/error.hpp"
#include "harness/sim/cluster.hpp"
#include "harness/tests/config_test_util.hpp"

namespace moelab {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::BadCase;
using test::error_of;
using test::expect_contains;
using test::expect_rejected;
using test::TempDir;

// The catalogue the program reads (MOELAB_EXPERIMENTS, else the source tree), wherever the test runs.
const fs::path kModels = fs::path(sim::experiments_dir()) / "models";

std::string model_path(const std::string& stem) { return (kModels / (stem + ".json")).string(); }

// tiny-moe as written in experiments/models/, so that the bad cases below edit one field of a
// file that is otherwise valid.
json tiny_moe() {
  std::ifstream in(model_path("tiny-moe"));
  return json::parse(in);
}

// ---- the shipped files ------------------------------------------------------------------------

TEST(ShippedModels, EveryFileLoadsAndRoundTrips) {
  ASSERT_TRUE(fs::is_directory(kModels)) << kModels;
  std::vector<std::string> stems;
  for (const auto& e : fs::directory_iterator(kModels)) {
    if (e.path().extension() != ".json") continue;
    stems.push_back(e.path().stem().string());
    SCOPED_TRACE(e.path().string());
    const TransformerConfig t = load_transformer(e.path().string());
    EXPECT_FALSE(t.source.empty());
    EXPECT_GT(t.parameter_counts().total, 0);
    const TransformerConfig back = parse_transformer(to_json(t), "round-trip");
    EXPECT_EQ(to_json(back), to_json(t));
    EXPECT_EQ(back.norm_eps, t.norm_eps);
    EXPECT_EQ(back.parameter_counts().total, t.parameter_counts().total);
  }
  for (const char* want : {"gpt2-moe-small", "gpt2-moe-medium", "gpt3-moe-xl", "llama2-moe", "pipeoffload-llama",
                           "tiny-moe", "tiny-dense", "swinv2-moe-s", "swinv2-moe-s-scmoe", "tiny-swin-moe"})
    EXPECT_NE(std::find(stems.begin(), stems.end(), want), stems.end()) << want;
}

TEST(ShippedModels, FieldsAsTheFilesSay) {
  const TransformerConfig xl = load_transformer(model_path("gpt3-moe-xl"));
  EXPECT_EQ(xl.name, "GPT3-MoE-XL");
  EXPECT_EQ(xl.head_dim(), 128);
  EXPECT_EQ(xl.num_moe_layers(), 12);
  EXPECT_FALSE(xl.is_moe(0));
  EXPECT_TRUE(xl.is_moe(1));
  EXPECT_EQ(xl.moe.d_model, 2048);  // from the model
  EXPECT_EQ(xl.moe.dtype, DType::bf16);
  EXPECT_EQ(xl.moe.num_experts, 8);
  EXPECT_EQ(xl.moe.top_k, 2);
  EXPECT_DOUBLE_EQ(xl.moe.capacity_factor, 2.0);

  const TransformerConfig llama = load_transformer(model_path("llama2-moe"));
  EXPECT_EQ(llama.norm, NormKind::rmsnorm);
  EXPECT_EQ(llama.mlp, MlpKind::swiglu);
  EXPECT_EQ(llama.positions, PositionKind::rotary);
  EXPECT_FLOAT_EQ(llama.rope_theta, 10000.0f);
  EXPECT_FALSE(llama.tie_embeddings);
  EXPECT_EQ(llama.num_moe_layers(), 24);

  const TransformerConfig po = load_transformer(model_path("pipeoffload-llama"));
  EXPECT_EQ(po.moe_layers, MoELayers::none);
  EXPECT_EQ(po.num_kv_heads, 8);
  EXPECT_EQ(po.attention(1).qkv_width(), (32 + 2 * 8) * 128);

  const TransformerConfig tiny = load_transformer(model_path("tiny-moe"));
  EXPECT_EQ(tiny.num_layers, 2);
  EXPECT_EQ(tiny.num_kv_heads, 2);
  EXPECT_EQ(tiny.dtype, DType::f32);
  EXPECT_TRUE(tiny.is_moe(1));
  EXPECT_EQ(load_transformer(model_path("tiny-dense")).num_moe_layers(), 0);
}

// ---- vision models ---------------------------------------------------------------------------

TEST(Vision, SwinV2MoeSDerivesItsFieldsAndStages) {
  const TransformerConfig t = load_transformer(model_path("swinv2-moe-s"));
  EXPECT_EQ(t.num_layers, 24);
  EXPECT_EQ(t.seq_len, 48 * 48);  // 192 / 4 patches per side
  EXPECT_EQ(t.vocab_size, 21841);
  EXPECT_EQ(t.num_heads, 3);
  EXPECT_FALSE(t.causal);
  EXPECT_EQ(t.positions, PositionKind::none);
  EXPECT_EQ(t.moe_layers, MoELayers::listed);
  EXPECT_EQ(t.num_moe_layers(), 10);
  for (int l = 0; l < 24; ++l) EXPECT_EQ(t.is_moe(l), (l >= 4 && l <= 21 && l % 2 == 1) || l == 23) << l;
  const int stage_of[] = {0, 0, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3};
  for (int l = 0; l < 24; ++l) EXPECT_EQ(t.vision.stage_of(l), stage_of[l]) << l;
  struct Want {
    int layer;
    std::int64_t d_model, heads, d_ffn, d_hidden, seq_len, grid;
  };
  for (const Want w : {Want{0, 96, 3, 384, 384, 144, 48}, {3, 192, 6, 768, 768, 144, 24}, {5, 384, 12, 1536, 1536, 144, 12},
                       {23, 768, 24, 3072, 3072, 36, 6}}) {
    const TransformerConfig c = t.layer_config(w.layer);
    EXPECT_EQ(c.d_model, w.d_model) << w.layer;
    EXPECT_EQ(c.num_heads, w.heads) << w.layer;
    EXPECT_EQ(c.head_dim(), 32) << w.layer;
    EXPECT_EQ(c.d_ffn, w.d_ffn) << w.layer;
    EXPECT_EQ(c.moe.d_model, w.d_model) << w.layer;
    EXPECT_EQ(c.moe.d_hidden, w.d_hidden) << w.layer;
    EXPECT_EQ(c.seq_len, w.seq_len) << w.layer;  // the window's tokens: min(12, grid)²
    EXPECT_EQ(c.grid, w.grid) << w.layer;
  }
  // By hand: attention 4C² per block, a dense MLP 2·C·4C, 8 experts of 2·C·4C and a noisy
  // gate 2·C·8 per MoE block, two layernorms (2C each) per block, the patch embedding [48,96]
  // and its norm, each merge's norm over 4C and W [4C,2C], the final norm and the classifier.
  const int depth[] = {2, 2, 18, 2}, moe[] = {0, 0, 9, 1};
  std::int64_t attention = 0, dense = 0, experts = 0, gates = 0, norms = 2 * 96 + 2 * 768, merging = 0;
  for (int s = 0; s < 4; ++s) {
    const std::int64_t C = std::int64_t{96} << s;
    attention += depth[s] * 4 * C * C;
    dense += (depth[s] - moe[s]) * 2 * C * 4 * C;
    experts += moe[s] * 8 * 2 * C * 4 * C;
    gates += moe[s] * 2 * C * 8;
    norms += depth[s] * 2 * 2 * C;
    if (s > 0) {
      merging += 4 * (C / 2) * C;
      norms += 2 * 4 * (C / 2);
    }
  }
  const ParamCounts p = t.parameter_counts();
  EXPECT_EQ(p.embedding, 48 * 96 + 768 * 21841);
  EXPECT_EQ(p.attention, attention);
  EXPECT_EQ(p.dense_mlp, dense);
  EXPECT_EQ(p.experts, experts);
  EXPECT_EQ(p.gates, gates);
  EXPECT_EQ(p.norms, norms);
  EXPECT_EQ(p.merging, merging);
  EXPECT_EQ(p.total, p.embedding + attention + dense + experts + gates + norms + merging);

  const TransformerConfig sc = load_transformer(model_path("swinv2-moe-s-scmoe"));
  EXPECT_TRUE(sc.scmoe.enabled);
  EXPECT_EQ(sc.layer_config(23).shared_expert_hidden, 3072);  // as wide as the stage's MLP
  // ScMoE adds per MoE block a shared expert, W_cg [C,1] and the routed MoE's norm.
  std::int64_t extra = 0;
  for (int s = 2; s < 4; ++s) {
    const std::int64_t C = std::int64_t{96} << s;
    extra += moe[s] * (2 * C * 4 * C + C + 2 * C);
  }
  EXPECT_EQ(sc.parameter_counts().total, p.total + extra);
}

TEST(Vision, DerivedFieldsMayBeWrittenAsDerived) {
  std::ifstream in(model_path("tiny-swin-moe"));
  json j = json::parse(in);
  j["num_layers"] = 4;
  j["seq_len"] = 64;
  j["vocab_size"] = 10;
  j["num_heads"] = 2;
  j["positions"] = "none";
  const TransformerConfig t = parse_transformer(j, "<test>");
  EXPECT_EQ(t.num_layers, 4);
  EXPECT_EQ(to_json(t)["num_layers"], 4);  // a result's "model" names them
  EXPECT_FALSE(to_json(t).contains("moe_layers"));
}

TEST(Vision, ActivationSizesTakeEachStagesLargest) {
  const TransformerConfig t = load_transformer(model_path("swinv2-moe-s"));
  const ActivationSizes a = t.activation_sizes(2);
  EXPECT_EQ(a.tokens, 2 * 2304);                    // stage 0
  EXPECT_EQ(a.hidden, std::max(2 * 2304 * 96, 2 * 36 * 768));
  EXPECT_EQ(a.lse, 2 * 16 * 3 * 144);               // [B·windows, heads, window²] of stage 0
  EXPECT_EQ(a.routed_slots, 2 * 144 * 2);           // stage 2's MoE tokens, top-2
  EXPECT_EQ(a.expert_hidden, std::max(2 * 144 * 2 * 1536, 2 * 36 * 2 * 3072));
  EXPECT_EQ(a.logits, 2 * 21841);
}

class BadVisionModel : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadVisionModel, IsRejectedNamingFieldAndValue) {
  std::ifstream in(model_path("tiny-swin-moe"));
  expect_rejected(json::parse(in), GetParam(), [](const std::string& path) { load_transformer(path); });
}

const BadCase kBadVisionCases[] = {
    {"GivesOtherNumLayers", [](json& j) { j["num_layers"] = 5; }, {"num_layers = 5, but a vision model (\"vision\") derives 4"}},
    {"GivesOtherSeqLen", [](json& j) { j["seq_len"] = 63; }, {"seq_len = 63, but a vision model", "derives 64"}},
    {"GivesMoeLayers", [](json& j) { j["moe_layers"] = "all"; }, {"moe_layers = \"all\" is given, but a vision model", "moe_blocks"}},
    {"Causal", [](json& j) { j["attention"] = "causal"; }, {"attention = \"causal\"", "attend both ways"}},
    {"PatchDoesNotDivide", [](json& j) { j["vision"]["patch_size"] = 3; }, {"vision.patch_size = 3 does not divide image_size = 16"}},
    {"WindowDoesNotDivide", [](json& j) { j["vision"]["window"] = 3; }, {"vision.window = 3 does not divide stage 0's feature map side 8"}},
    {"OddMapBeforeMerge",
     [](json& j) {
       j["vision"]["image_size"] = 12;
       j["vision"]["patch_size"] = 4;
       j["vision"]["window"] = 3;
     },
     {"vision.stages[1]: stage 0's feature map is 3 × 3 tokens, odd"}},
    {"HeadsDoNotDivideWidth", [](json& j) { j["vision"]["stages"][1]["num_heads"] = 5; }, {"vision.stages[1].num_heads = 5 does not divide the stage's width 32"}},
    {"MoeBlockOutOfRange", [](json& j) { j["vision"]["stages"][1]["moe_blocks"] = {2}; }, {"vision.stages[1].moe_blocks[0] = 2 is too large (at most 1)"}},
    {"MoeBlocksNotIncreasing", [](json& j) { j["vision"]["stages"][1]["moe_blocks"] = {1, 1}; }, {"vision.stages[1].moe_blocks = [1,1] is not increasing"}},
    {"SwinsNoneMarker", [](json& j) { j["vision"]["stages"][0]["moe_blocks"] = {-1}; }, {"vision.stages[0].moe_blocks[0]: expected"}},
    {"NoStages", [](json& j) { j["vision"]["stages"] = json::array(); }, {"vision.stages: expected an array of 1 to 16 stages"}},
    {"UnknownStageField", [](json& j) { j["vision"]["stages"][0]["heads"] = 2; }, {"unknown field \"vision.stages[0].heads\""}},
    {"MoeWithoutBlocks", [](json& j) { j["vision"]["stages"][1]["moe_blocks"] = json::array(); }, {"moe = {", "no stage of vision.stages lists moe_blocks"}},
    {"BlocksWithoutMoe", [](json& j) { j.erase("moe"); }, {"missing field \"moe\" (vision.stages list moe_blocks"}},
    {"ScmoePairAcrossTheMerge",
     [](json& j) {
       j["vision"]["stages"][1]["moe_blocks"] = {0};
       j["moe"]["top_k"] = 1;
       j["scmoe"] = json::object();
     },
     {"scmoe.position = \"pos2\" pairs each MoE block", "vision.stages[1] block 0 is an MoE block that starts its stage"}},
    {"WidthDoublesTooFar", [](json& j) { j["d_ffn"] = 4000000; }, {"d_ffn = 4000000 (stage 0's) doubles to more than"}},
};

INSTANTIATE_TEST_SUITE_P(Cases, BadVisionModel, ::testing::ValuesIn(kBadVisionCases),
                         [](const ::testing::TestParamInfo<BadCase>& p) { return p.param.name; });

// ---- parameter counts against a hand computation -----------------------------------------------

TEST(ParameterCounts, Gpt3MoeXlByHand) {
  const ParamCounts p = load_transformer(model_path("gpt3-moe-xl")).parameter_counts();
  // M = 2048, 16 heads of 128, F = H = 8192, 24 layers (12 MoE: 1, 3, ..., 23), S = 2048,
  // V = 50257, layernorm, tied embeddings, learned positions, 8 experts, noisy gate.
  EXPECT_EQ(p.embedding, 50257LL * 2048 + 2048LL * 2048);           // 102926336 + 4194304
  EXPECT_EQ(p.embedding, 107120640LL);
  EXPECT_EQ(p.attention, 24LL * (2048LL * 3 * 2048 + 2048LL * 2048));  // W_qkv + W_o = 4 M^2
  EXPECT_EQ(p.attention, 402653184LL);
  EXPECT_EQ(p.dense_mlp, 12LL * 2 * 2048 * 8192);
  EXPECT_EQ(p.dense_mlp, 402653184LL);
  EXPECT_EQ(p.experts, 12LL * 8 * 2 * 2048 * 8192);
  EXPECT_EQ(p.experts, 3221225472LL);
  EXPECT_EQ(p.gates, 12LL * 2 * 2048 * 8);  // W_g and W_noise
  EXPECT_EQ(p.gates, 393216LL);
  EXPECT_EQ(p.norms, 49LL * 2 * 2048);  // 2 per layer + final, scale and shift
  EXPECT_EQ(p.norms, 200704LL);
  EXPECT_EQ(p.total, 4134246400LL);
  // The dense GPT-3 XL (experts -> one MLP per layer, no gates) is Table 2.1's 1.3B.
  const std::int64_t dense = p.embedding + p.attention + 2 * p.dense_mlp + p.norms;
  EXPECT_EQ(dense, 1315280896LL);
}

TEST(ParameterCounts, TinyMoeByHandWithGqaAndNoNoise) {
  const ParamCounts p = load_transformer(model_path("tiny-moe")).parameter_counts();
  // M = 64, Hq = 4, Hkv = 2, D = 16, F = 256, 2 layers (layer 1 MoE), S = 32, V = 256, E = 4, H = 128.
  EXPECT_EQ(p.embedding, 256 * 64 + 32 * 64);
  EXPECT_EQ(p.attention, 2 * (64 * (4 + 2 * 2) * 16 + 64 * 64));
  EXPECT_EQ(p.dense_mlp, 1 * 2 * 64 * 256);
  EXPECT_EQ(p.experts, 1 * 4 * 2 * 64 * 128);
  EXPECT_EQ(p.gates, 64 * 4);
  EXPECT_EQ(p.norms, 5 * 2 * 64);
  EXPECT_EQ(p.total, p.embedding + p.attention + p.dense_mlp + p.experts + p.gates + p.norms);
}

TEST(ParameterCounts, SwigluRmsnormRotaryUntiedAndSharedExpert) {
  json j = tiny_moe();
  j["mlp"] = "swiglu";
  j["norm"] = "rmsnorm";
  j["positions"] = "rotary";
  j["tie_embeddings"] = false;
  j["moe_layers"] = "all";
  j["moe"]["shared_expert_hidden"] = 96;
  const ParamCounts p = parse_transformer(j, "t.json").parameter_counts();
  EXPECT_EQ(p.embedding, 2 * 256 * 64);               // no position table, an output layer
  EXPECT_EQ(p.dense_mlp, 2 * 3 * 64 * 96);            // no dense layer; a SwiGLU shared expert per MoE layer
  EXPECT_EQ(p.experts, 2 * 4 * 2 * 64 * 128);
  EXPECT_EQ(p.norms, 5 * 64);                          // scale only
}

// ScMoE's block pairs: the defaults, the shared expert as wide as d_ffn, and what the pair adds
// to the counts (a routed MoE norm and the combine gate's W_cg per MoE layer).
TEST(Scmoe, DefaultsCountsAndRoundTrip) {
  json j = tiny_moe();
  j["moe"]["top_k"] = 1;
  j["moe"].erase("shared_expert_hidden");
  j["scmoe"] = json::object();
  const TransformerConfig t = parse_transformer(j, "t.json");
  EXPECT_TRUE(t.scmoe.enabled);
  EXPECT_EQ(t.scmoe.position, ShortcutPosition::pos2);
  EXPECT_EQ(t.scmoe.combine, ShortcutCombine::cg1);
  EXPECT_EQ(t.scmoe.span(), 2);
  EXPECT_EQ(t.scmoe.window_blocks(), 3);
  EXPECT_EQ(t.scmoe.expert_slot, -1);
  EXPECT_EQ(t.scmoe.chunks, 0);
  EXPECT_EQ(t.shared_expert_hidden, 256);  // d_ffn
  j.erase("scmoe");
  j["moe"]["shared_expert_hidden"] = 256;
  const ParamCounts plain = parse_transformer(j, "t.json").parameter_counts();
  const ParamCounts p = t.parameter_counts();
  EXPECT_EQ(p.gates - plain.gates, 64);     // W_cg [M,1], one MoE layer
  EXPECT_EQ(p.norms - plain.norms, 2 * 64);  // the routed MoE's layernorm
  EXPECT_EQ(p.dense_mlp, plain.dense_mlp);
  const TransformerConfig back = parse_transformer(to_json(t), "round-trip");
  EXPECT_EQ(to_json(back), to_json(t));

  // Every block an MoE: Pos-1 by default; explicit slots and chunks survive the round trip.
  j["moe_layers"] = "all";
  j["scmoe"] = {{"combine", "cg2"}, {"expert_slot", 2}, {"chunks", 4}};
  const TransformerConfig all = parse_transformer(j, "t.json");
  EXPECT_EQ(all.scmoe.position, ShortcutPosition::pos1);
  EXPECT_EQ(all.scmoe.span(), 1);
  EXPECT_EQ(all.scmoe.gate_width(), 2);
  EXPECT_EQ(all.scmoe.expert_slot, 2);
  EXPECT_EQ(all.scmoe.chunks, 4);
  EXPECT_EQ(to_json(parse_transformer(to_json(all), "round-trip")), to_json(all));
}

TEST(ActivationSizes, Gpt3MoeXlBatchTwo) {
  const ActivationSizes a = load_transformer(model_path("gpt3-moe-xl")).activation_sizes(2);
  EXPECT_EQ(a.tokens, 4096);
  EXPECT_EQ(a.hidden, 4096LL * 2048);
  EXPECT_EQ(a.qkv, 4096LL * 3 * 2048);
  EXPECT_EQ(a.lse, 2LL * 16 * 2048);
  EXPECT_EQ(a.mlp_hidden, 4096LL * 8192);
  EXPECT_EQ(a.gate_logits, 4096LL * 8);
  EXPECT_EQ(a.routed_slots, 8192);
  EXPECT_EQ(a.expert_hidden, 8192LL * 8192);
  EXPECT_EQ(a.shared_hidden, 0);
  EXPECT_EQ(a.logits, 4096LL * 50257);
}

TEST(ActivationSizes, BadBatchesNameTheBatch) {
  const TransformerConfig t = load_transformer(model_path("gpt3-moe-xl"));
  expect_contains(error_of([&] { (void)t.activation_sizes(0); }), {"gpt3-moe-xl.json: batch = 0 must be >= 1"});
  expect_contains(error_of([&] { (void)t.activation_sizes(std::int64_t{1} << 50); }),
                  {"gpt3-moe-xl.json: the size of one layer's tokens (batch = 1125899906842624, seq_len = 2048)",
                   "exceeds 2^56"});
  expect_contains(error_of([&] { (void)t.activation_sizes(std::int64_t{1} << 40); }),
                  {"the size of one layer's hidden states [T,M] (batch = 1099511627776", "exceeds 2^56"});
  expect_contains(error_of([&] { (void)t.activation_sizes(std::int64_t{1} << 20); }),
                  {"routed slots", "more than 2^31 - 1"});
}

// ---- overrides (RFC 7386 merge patch) -------------------------------------------------------------

TEST(Overrides, ReplaceMergeAndDelete) {
  const std::string path = model_path("tiny-moe");
  EXPECT_EQ(load_transformer(path, json()).num_layers, 2);  // null: nothing changes
  EXPECT_EQ(load_transformer(path, json::object()).num_layers, 2);
  const TransformerConfig four = load_transformer(path, {{"num_layers", 4}});
  EXPECT_EQ(four.num_layers, 4);
  EXPECT_EQ(four.num_moe_layers(), 2);
  // An object merges: the other moe fields stay.
  const TransformerConfig k1 = load_transformer(path, {{"moe", {{"top_k", 1}}}});
  EXPECT_EQ(k1.moe.top_k, 1);
  EXPECT_EQ(k1.moe.num_experts, 4);
  // null deletes an optional field: num_kv_heads falls back to num_heads.
  EXPECT_EQ(load_transformer(path, {{"num_kv_heads", nullptr}}).num_kv_heads, 4);
  // ... and removing "moe" with moe_layers = "none" makes the model dense.
  const TransformerConfig dense = load_transformer(path, {{"moe", nullptr}, {"moe_layers", "none"}});
  EXPECT_EQ(dense.num_moe_layers(), 0);
  EXPECT_EQ(dense.parameter_counts().total, load_transformer(model_path("tiny-dense")).parameter_counts().total);
}

TEST(Overrides, MessagesSayTheOverridesTookPart) {
  const std::string path = model_path("tiny-moe");
  expect_contains(error_of([&] { load_transformer(path, {{"d_model", nullptr}}); }),
                  {path + " with overrides {\"d_model\":null}: missing field \"d_model\""});
  expect_contains(error_of([&] { load_transformer(path, {{"num_heads", 5}}); }),
                  {"with overrides", "num_heads = 5 does not divide d_model = 64"});
  expect_contains(error_of([&] { load_transformer(path, {{"moe", {{"topk", 1}}}}); }),
                  {"unknown field \"moe.topk\" (did you mean \"moe.top_k\"?)"});
  expect_contains(error_of([&] { load_transformer(path, json::array({1})); }),
                  {"overrides: expected an object of fields, got [1]"});
}

// ---- bad input: one line naming the file and the field --------------------------------------------

class BadModel : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadModel, IsRejectedNamingFieldAndValue) {
  expect_rejected(tiny_moe(), GetParam(), [](const std::string& path) { load_transformer(path); });
}

const BadCase kBadCases[] = {
    {"MissingDModel", [](json& j) { j.erase("d_model"); }, {"missing field \"d_model\""}},
    {"MissingSource", [](json& j) { j.erase("source"); }, {"missing field \"source\""}},
    {"MissingExperts", [](json& j) { j["moe"].erase("num_experts"); }, {"missing field \"moe.num_experts\""}},
    {"HeadsString", [](json& j) { j["num_heads"] = "4"; }, {"num_heads: expected a positive integer, got \"4\""}},
    {"LayersFraction", [](json& j) { j["num_layers"] = 2.5; }, {"num_layers: expected a positive integer, got 2.5"}},
    {"TieString", [](json& j) { j["tie_embeddings"] = "yes"; }, {"tie_embeddings: expected true or false, got \"yes\""}},
    {"MoeNotObject", [](json& j) { j["moe"] = 5; }, {"moe: expected an object, got 5"}},
    {"UnknownField", [](json& j) { j["num_head"] = 4; }, {"unknown field \"num_head\" (did you mean \"num_heads\"?)"}},
    {"UnknownMoeField", [](json& j) { j["moe"]["topk"] = 2; }, {"unknown field \"moe.topk\" (did you mean \"moe.top_k\"?)"}},
    {"HeadsDoNotDivide", [](json& j) { j["num_heads"] = 3; }, {"num_heads = 3 does not divide d_model = 64"}},
    {"KvHeadsDoNotDivide", [](json& j) { j["num_kv_heads"] = 3; }, {"num_kv_heads = 3 does not divide num_heads = 4"}},
    {"KvHeadsAboveHeads", [](json& j) { j["num_kv_heads"] = 8; }, {"num_kv_heads = 8 does not divide num_heads = 4"}},
    {"OddHeadDimWithRotary",
     [](json& j) {
       j["d_model"] = 24;
       j["num_heads"] = 8;
       j["num_kv_heads"] = 8;
       j["positions"] = "rotary";
     },
     {"head_dim = d_model / num_heads = 24 / 8 = 3 is odd", "positions = \"rotary\""}},
    {"RopeThetaWithoutRotary", [](json& j) { j["rope_theta"] = 500000; }, {"rope_theta = 500000 is only used with positions = \"rotary\""}},
    {"RopeThetaZero",
     [](json& j) {
       j["positions"] = "rotary";
       j["rope_theta"] = 0;
     },
     {"rope_theta = 0 must be > 0"}},
    {"NormEpsNegative", [](json& j) { j["norm_eps"] = -1e-5; }, {"norm_eps = -1e-05 must be > 0"}},
    {"MoeWithMoeLayersNone", [](json& j) { j["moe_layers"] = "none"; }, {"moe = {", "is given but moe_layers = \"none\""}},
    {"MoeLayersWithoutMoe", [](json& j) { j.erase("moe"); }, {"missing field \"moe\" (moe_layers = \"every_second\""}},
    {"EverySecondOfOneLayer", [](json& j) { j["num_layers"] = 1; }, {"moe_layers = \"every_second\" with num_layers = 1 has no MoE layer"}},
    {"TopKAboveExperts", [](json& j) { j["moe"]["top_k"] = 5; }, {"moe.top_k = 5 must be <= moe.num_experts = 4"}},
    {"SharedExpertNegative",
     [](json& j) { j["moe"]["shared_expert_hidden"] = -1; },
     {"moe.shared_expert_hidden: expected a non-negative integer, got -1"}},
    {"CapacityNegative", [](json& j) { j["moe"]["capacity_factor"] = -2; }, {"moe.capacity_factor = -2 must be a finite number >= 0"}},
    {"MlpTypo", [](json& j) { j["mlp"] = "swigl"; }, {"mlp = \"swigl\" is not one of gelu, swiglu (did you mean \"swiglu\"?)"}},
    {"NormTypo", [](json& j) { j["norm"] = "rmsnrom"; }, {"norm = \"rmsnrom\" is not one of layernorm, rmsnorm (did you mean \"rmsnorm\"?)"}},
    {"PositionsTypo", [](json& j) { j["positions"] = "rotray"; }, {"positions = \"rotray\"", "(did you mean \"rotary\"?)"}},
    {"AttentionTypo", [](json& j) { j["attention"] = "casual"; }, {"attention = \"casual\"", "(did you mean \"causal\"?)"}},
    {"MoeLayersTypo", [](json& j) { j["moe_layers"] = "every-second"; }, {"moe_layers = \"every-second\"", "(did you mean \"every_second\"?)"}},
    {"ExpertActivationTypo", [](json& j) { j["moe"]["activation"] = "gleu"; }, {"moe.activation = \"gleu\"", "(did you mean \"gelu\"?)"}},
    {"DtypeFp16", [](json& j) { j["dtype"] = "fp16"; }, {"dtype = \"fp16\" is not one of fp32, bf16"}},
    {"Tf32WithBf16",
     [](json& j) {
       j["dtype"] = "bf16";
       j["allow_tf32"] = true;
     },
     {"allow_tf32 = true applies to fp32 GEMMs, but dtype = \"bf16\""}},
    // Bounds (harness/config/limits.hpp).
    {"DModelBeyondBound", [](json& j) { j["d_model"] = 1048577; }, {"d_model = 1048577 is too large (at most 1048576)"}},
    {"LayersBeyondBound", [](json& j) { j["num_layers"] = 4097; }, {"num_layers = 4097 is too large (at most 4096)"}},
    {"VocabBeyondBound", [](json& j) { j["vocab_size"] = 16777217; }, {"vocab_size = 16777217 is too large (at most 16777216)"}},
    {"SeqBeyondBound", [](json& j) { j["seq_len"] = 4194305; }, {"seq_len = 4194305 is too large (at most 4194304)"}},
    {"FfnBeyondBound", [](json& j) { j["d_ffn"] = 4194305; }, {"d_ffn = 4194305 is too large (at most 4194304)"}},
    {"ExpertsBeyondBound", [](json& j) { j["moe"]["num_experts"] = 65537; }, {"moe.num_experts = 65537 is too large (at most 65536)"}},
    {"DHiddenNearInt64", [](json& j) { j["moe"]["d_hidden"] = 9223372036854775807LL; }, {"moe.d_hidden = 9223372036854775807 is too large"}},
    {"HeadsBeyondInt", [](json& j) { j["num_heads"] = 4294967296LL; }, {"num_heads = 4294967296 is too large"}},
    {"OneLayerOfExpertsBeyondBound",
     [](json& j) {
       j["d_model"] = 1048576;
       j["num_heads"] = 8192;
       j["num_kv_heads"] = 8192;
       j["moe"]["d_hidden"] = 4194304;
       j["moe"]["num_experts"] = 65536;
     },
     {"the expert weights of one layer, moe.num_experts × 2 × d_model × moe.d_hidden", "exceed 2^56"}},
    {"ParameterCountWouldOverflow",
     [](json& j) {
       // One layer's experts: 65536 × 2 × 4096 × 4194304 = 2^51, within bounds; 4096 layers of
       // them: 2^63, one past int64.
       j["d_model"] = 4096;
       j["num_heads"] = 32;
       j["num_kv_heads"] = 32;
       j["num_layers"] = 4096;
       j["moe_layers"] = "all";
       j["moe"]["d_hidden"] = 4194304;
       j["moe"]["num_experts"] = 65536;
     },
     {"the routed experts' parameter count (MoE layers × moe.num_experts × 2 × d_model × moe.d_hidden; num_layers = "
      "4096",
      "exceeds 2^56"}},
    {"TopLevelArray", [](json& j) { j = json::array({1, 2}); }, {"expected a JSON object at the top level, got [1,2]"}},
    // ScMoE's "scmoe" object (tiny-moe is top-2: the cases that should reach a later check set top_k 1).
    {"ScmoeWithoutMoe",
     [](json& j) {
       j["moe_layers"] = "none";
       j.erase("moe");
       j["scmoe"] = json::object();
     },
     {"scmoe = {} is given but moe_layers = \"none\""}},
    {"ScmoeNotObject", [](json& j) { j["scmoe"] = "pos2"; }, {"scmoe: expected an object, got \"pos2\""}},
    {"ScmoeTopTwo", [](json& j) { j["scmoe"] = json::object(); }, {"moe.top_k = 2", "moe.top_k must be 1"}},
    {"ScmoeUnknownField",
     [](json& j) {
       j["moe"]["top_k"] = 1;
       j["scmoe"] = {{"postion", "pos1"}};
     },
     {"unknown field \"scmoe.postion\" (did you mean \"scmoe.position\"?)"}},
    {"ScmoePositionTypo",
     [](json& j) {
       j["moe"]["top_k"] = 1;
       j["scmoe"] = {{"position", "pos4"}};
     },
     {"scmoe.position = \"pos4\" is not one of pos1, pos2, pos3"}},
    {"ScmoeCombineTypo",
     [](json& j) {
       j["moe"]["top_k"] = 1;
       j["scmoe"] = {{"combine", "cg3"}};
     },
     {"scmoe.combine = \"cg3\" is not one of add, cg1, cg2"}},
    {"ScmoePos2WithMoeInEveryBlock",
     [](json& j) {
       j["moe"]["top_k"] = 1;
       j["moe_layers"] = "all";
       j["scmoe"] = {{"position", "pos2"}};
     },
     {"scmoe.position = \"pos2\"", "moe_layers = \"all\"", "use \"pos1\""}},
    {"ScmoeSlotBeyondWindow",
     [](json& j) {
       j["moe"]["top_k"] = 1;
       j["scmoe"] = {{"position", "pos1"}, {"expert_slot", 3}};
     },
     {"scmoe.expert_slot = 3 is too large (at most 2)"}},
    {"ScmoeSlotWord",
     [](json& j) {
       j["moe"]["top_k"] = 1;
       j["scmoe"] = {{"expert_slot", "early"}};
     },
     {"scmoe.expert_slot: expected \"auto\" or an integer from 0 to 3, got \"early\""}},
    {"ScmoeChunksZero",
     [](json& j) {
       j["moe"]["top_k"] = 1;
       j["scmoe"] = {{"chunks", 0}};
     },
     {"scmoe.chunks: expected a positive integer, got 0"}},
    {"ScmoeChunksBeyondBound",
     [](json& j) {
       j["moe"]["top_k"] = 1;
       j["scmoe"] = {{"chunks", 65}};
     },
     {"scmoe.chunks = 65 is too large (at most 64)"}},
    {"ScmoeWithoutSharedExpert",
     [](json& j) {
       j["moe"]["top_k"] = 1;
       j["moe"]["shared_expert_hidden"] = 0;
       j["scmoe"] = json::object();
     },
     {"moe.shared_expert_hidden = 0", "always has a shared expert"}},
};

INSTANTIATE_TEST_SUITE_P(Cases, BadModel, ::testing::ValuesIn(kBadCases),
                         [](const ::testing::TestParamInfo<BadCase>& p) { return p.param.name; });

TEST(BadModelFile, MalformedJsonNamesLineAndColumn) {
  TempDir dir;
  const auto path = dir.write("broken.json", "{\n  \"d_model\": 64,,\n}\n");
  expect_contains(error_of([&] { load_transformer(path); }), {path + ": malformed JSON at line 2, column", "syntax error"});
}

TEST(BadModelFile, DuplicateKeys) {
  TempDir dir;
  const auto top = dir.write("dup.json", R"({"d_model": 64, "d_model": 32})");
  expect_contains(error_of([&] { load_transformer(top); }), {top + ": field \"d_model\" appears twice"});
  const auto nested = dir.write("dup2.json", R"({"moe": {"top_k": 1, "top_k": 2}})");
  expect_contains(error_of([&] { load_transformer(nested); }), {nested + ": field \"moe.top_k\" appears twice"});
}

TEST(BadModelFile, NumberBeyondADouble) {
  TempDir dir;
  std::string text = tiny_moe().dump();
  text.replace(text.find("\"capacity_factor\":2.0"), 21, "\"capacity_factor\":1e999");
  const auto path = dir.write("big.json", text);
  const std::string msg = error_of([&] { load_transformer(path); });
  expect_contains(msg, {path + ": moe.capacity_factor: number overflow parsing '1e999'"});
  EXPECT_EQ(msg.find("[json.exception"), std::string::npos) << msg;
}

TEST(BadModelFile, DeepNesting) {
  TempDir dir;
  const auto path = dir.write("deep.json", "{\"source\": " + std::string(100000, '[') + std::string(100000, ']') + "}");
  expect_contains(error_of([&] { load_transformer(path); }), {path + ": \"source\" nests arrays and objects more than 64"});
}

TEST(BadModelFile, MissingFile) {
  expect_contains(error_of([] { load_transformer("/nonexistent/model.json"); }),
                  {"/nonexistent/model.json: cannot open model file"});
}

}  // namespace
}  // namespace moelab
