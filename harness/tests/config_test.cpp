// harness/tests/config_test.cpp — workload files, cluster and profile figures, routing traces
// and result files: every bad input is rejected with one message naming the file, the field
// and the value; result files are written atomically; an implementation's options check is
// found through the registry.
//
//   ctest --test-dir build -R config
//   build/harness/tests/config_test --gtest_filter='BadWorkload*'
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "harness/backends/sim/sim_backend.hpp"
#include "harness/config/json_fields.hpp"
#include "harness/config/workload.hpp"
#include "harness/nn/moe_impl.hpp"
#include "harness/metrics/results.hpp"
#include "harness/runtime/error.hpp"
#include "harness/sim/cluster.hpp"
#include "harness/tests/config_test_util.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using test::BadCase;
using test::error_of;
using test::expect_contains;
using test::expect_rejected;
using test::TempDir;

json valid_workload() {
  return json::parse(R"({
    "name": "tiny",
    "description": "a test workload",
    "model": { "d_model": 64, "d_hidden": 256, "num_experts": 8, "top_k": 2,
               "capacity_factor": 1.25, "activation": "gelu", "noisy_gate": false,
               "renormalize": false, "dtype": "fp32" },
    "tokens_per_rank": 512, "steps": 3, "warmup": 1, "seed": 7, "expert_parallel": 0
  })");
}

// ---- a valid file ---------------------------------------------------------------------------

TEST(Workload, LoadsAValidFile) {
  TempDir dir;
  const auto path = dir.write("tiny.json", valid_workload().dump(2));
  const WorkloadConfig w = load_workload(path);
  EXPECT_EQ(w.name, "tiny");
  EXPECT_EQ(w.origin, path);
  EXPECT_EQ(w.model.d_model, 64);
  EXPECT_EQ(w.model.d_hidden, 256);
  EXPECT_EQ(w.model.num_experts, 8);
  EXPECT_EQ(w.model.top_k, 2);
  EXPECT_DOUBLE_EQ(w.model.capacity_factor, 1.25);
  EXPECT_EQ(w.model.activation, Activation::gelu);
  EXPECT_EQ(w.model.dtype, DType::f32);
  EXPECT_EQ(w.tokens_per_rank, 512);
  EXPECT_EQ(w.steps, 3);
  EXPECT_EQ(w.warmup, 1);
  EXPECT_EQ(w.seed, 7u);
  EXPECT_EQ(w.expert_parallel, 0);
}

TEST(Workload, OptionalFieldsTakeTheirDefaults) {
  json j = json::parse(R"({"model": {"d_model": 8, "d_hidden": 16, "num_experts": 4, "top_k": 1},
                           "tokens_per_rank": 10})");
  const WorkloadConfig w = parse_workload(j, "dir/minimal.json");
  EXPECT_EQ(w.name, "minimal");  // the file's stem
  EXPECT_EQ(w.steps, 1);
  EXPECT_EQ(w.warmup, 0);
  EXPECT_EQ(w.seed, 1u);
  EXPECT_EQ(w.expert_parallel, 0);
  EXPECT_EQ(w.model.capacity_factor, 0.0);
  EXPECT_EQ(w.model.activation, Activation::gelu);
  EXPECT_EQ(w.model.dtype, DType::f32);
}

TEST(Workload, AcceptsCommentsAndIntegralNumbers) {
  TempDir dir;
  const auto path = dir.write("c.json", R"({
    // a comment, as in the examples of workload.hpp
    "model": { "d_model": 64.0, "d_hidden": 2.56e2, "num_experts": 8, "top_k": 1,
               "activation": "relu", "dtype": "bf16" },
    "tokens_per_rank": 1e3 /* tokens */
  })");
  const WorkloadConfig w = load_workload(path);
  EXPECT_EQ(w.model.d_model, 64);
  EXPECT_EQ(w.model.d_hidden, 256);
  EXPECT_EQ(w.tokens_per_rank, 1000);
  EXPECT_EQ(w.model.activation, Activation::relu);
  EXPECT_EQ(w.model.dtype, DType::bf16);
}

TEST(Workload, ToJsonRoundTrips) {
  json j = valid_workload();
  j["model"]["noisy_gate"] = true;
  j["model"]["renormalize"] = true;
  j["model"]["activation"] = "relu";
  j["model"]["dtype"] = "bf16";
  j["seed"] = 18446744073709551615ull;  // the whole uint64 range
  j["expert_parallel"] = 2;
  const WorkloadConfig a = parse_workload(j, "a.json");
  const WorkloadConfig b = parse_workload(to_json(a), "b.json");
  EXPECT_EQ(to_json(a), to_json(b));
  EXPECT_EQ(b.name, a.name);
  EXPECT_EQ(b.model.d_model, a.model.d_model);
  EXPECT_EQ(b.model.top_k, a.model.top_k);
  EXPECT_EQ(b.model.capacity_factor, a.model.capacity_factor);
  EXPECT_EQ(b.model.activation, Activation::relu);
  EXPECT_EQ(b.model.dtype, DType::bf16);
  EXPECT_TRUE(b.model.noisy_gate);
  j["model"]["activation"] = "gelu_tanh";  // the tanh GeLU round-trips by its name
  const WorkloadConfig tanh = parse_workload(to_json(parse_workload(j, "t.json")), "t2.json");
  EXPECT_EQ(tanh.model.activation, Activation::gelu_tanh);
  EXPECT_EQ(to_json(tanh)["model"]["activation"], "gelu_tanh");
  EXPECT_TRUE(b.model.renormalize);
  EXPECT_EQ(b.seed, 18446744073709551615ull);
  EXPECT_EQ(b.expert_parallel, 2);
  EXPECT_EQ(parse_model(to_json(a.model), "m.json").d_hidden, a.model.d_hidden);
  // allow_tf32 is written only when set, and read back.
  EXPECT_FALSE(to_json(a.model).contains("allow_tf32"));
  j["model"]["dtype"] = "fp32";
  j["model"]["allow_tf32"] = true;
  const WorkloadConfig t = parse_workload(j, "t.json");
  EXPECT_TRUE(t.model.allow_tf32);
  EXPECT_TRUE(parse_workload(to_json(t), "t2.json").model.allow_tf32);
}

TEST(Workload, CapacityIsCeilOfFactorTimesFairShare) {
  ModelConfig m;
  m.num_experts = 8;
  m.top_k = 2;
  m.capacity_factor = 1.25;
  EXPECT_EQ(m.capacity(512), 160);  // 1.25 * 2 * 512 / 8
  m.top_k = 1;
  m.capacity_factor = 1.0;
  m.num_experts = 3;
  EXPECT_EQ(m.capacity(10), 4);  // ceil(3.33)
  m.num_experts = 10;
  m.capacity_factor = 1.1;
  EXPECT_EQ(m.capacity(1000), 110);  // not 111 from 1.1's rounding error
  m.capacity_factor = 0.0;
  EXPECT_EQ(m.capacity(1000), 0);  // unlimited
}

TEST(Workload, ShippedWorkloadsLoad) {
  const fs::path dir = fs::path(sim::experiments_dir()) / "workloads";
  if (!fs::is_directory(dir)) GTEST_SKIP() << "no " << dir;
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir)) {
    if (e.path().extension() != ".json") continue;
    EXPECT_NO_THROW(load_workload(e.path().string())) << e.path();
    ++n;
  }
  EXPECT_GE(n, 3);
  const WorkloadConfig tiny = load_workload((dir / "tiny.json").string());
  EXPECT_EQ(tiny.model.d_model, 64);
  EXPECT_EQ(tiny.tokens_per_rank, 512);
  const WorkloadConfig big = load_workload((dir / "gpt3-xl-e64-16k.json").string());
  EXPECT_EQ(big.model.num_experts, 64);
  EXPECT_EQ(big.model.dtype, DType::bf16);
  EXPECT_EQ(big.model.capacity(big.tokens_per_rank), 0);
}

// ---- bad files: the message names the file, the field and the value --------------------------

class BadWorkload : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadWorkload, IsRejectedNamingFieldAndValue) {
  expect_rejected(valid_workload(), GetParam(), [](const std::string& path) { load_workload(path); });
}

const BadCase kBadCases[] = {
    {"MissingNumExperts", [](json& j) { j["model"].erase("num_experts"); }, {"missing field \"model.num_experts\""}},
    {"MissingModel", [](json& j) { j.erase("model"); }, {"missing field \"model\""}},
    {"MissingTokens", [](json& j) { j.erase("tokens_per_rank"); }, {"missing field \"tokens_per_rank\""}},
    {"DModelString",
     [](json& j) { j["model"]["d_model"] = "abc"; },
     {"model.d_model: expected a positive integer, got \"abc\""}},
    {"DModelFraction", [](json& j) { j["model"]["d_model"] = 1.5; }, {"model.d_model", "1.5"}},
    {"DModelZero", [](json& j) { j["model"]["d_model"] = 0; }, {"model.d_model", "positive integer", "got 0"}},
    {"DHiddenNegative", [](json& j) { j["model"]["d_hidden"] = -3; }, {"model.d_hidden", "got -3"}},
    {"NumExpertsZero", [](json& j) { j["model"]["num_experts"] = 0; }, {"model.num_experts", "got 0"}},
    {"TokensZero", [](json& j) { j["tokens_per_rank"] = 0; }, {"tokens_per_rank", "got 0"}},
    {"TokensBool", [](json& j) { j["tokens_per_rank"] = true; }, {"tokens_per_rank", "got true"}},
    {"StepsZero", [](json& j) { j["steps"] = 0; }, {"steps: expected a positive integer, got 0"}},
    {"WarmupNegative", [](json& j) { j["warmup"] = -1; }, {"warmup: expected a non-negative integer, got -1"}},
    {"ExpertParallelNegative", [](json& j) { j["expert_parallel"] = -2; }, {"expert_parallel", "got -2"}},
    {"SeedNegative", [](json& j) { j["seed"] = -1; }, {"seed", "got -1"}},
    {"TopKTooLarge", [](json& j) { j["model"]["top_k"] = 9; }, {"model.top_k = 9 must be <= model.num_experts = 8"}},
    {"TopKZero", [](json& j) { j["model"]["top_k"] = 0; }, {"model.top_k", "got 0"}},
    {"CapacityNegative", [](json& j) { j["model"]["capacity_factor"] = -1; }, {"model.capacity_factor = -1", ">= 0"}},
    {"CapacityString",
     [](json& j) { j["model"]["capacity_factor"] = "1.25"; },
     {"model.capacity_factor: expected a number, got \"1.25\""}},
    {"UnknownActivation",
     [](json& j) { j["model"]["activation"] = "swish"; },
     {"model.activation = \"swish\" is not one of gelu, relu, gelu_tanh"}},
    {"UnknownDtype",
     [](json& j) { j["model"]["dtype"] = "fp16"; },
     {"model.dtype = \"fp16\" is not one of fp32, bf16"}},
    {"Tf32WithBf16",
     [](json& j) {
       j["model"]["dtype"] = "bf16";
       j["model"]["allow_tf32"] = true;
     },
     {"model.allow_tf32 = true applies to fp32 GEMMs", "model.dtype = \"bf16\""}},
    {"Tf32String", [](json& j) { j["model"]["allow_tf32"] = "on"; }, {"model.allow_tf32: expected true or false"}},
    {"NoisyGateString",
     [](json& j) { j["model"]["noisy_gate"] = "yes"; },
     {"model.noisy_gate: expected true or false, got \"yes\""}},
    {"UnknownModelField",
     [](json& j) { j["model"]["topk"] = 2; },
     {"unknown field \"model.topk\"", "did you mean \"model.top_k\""}},
    {"UnknownTopLevelField", [](json& j) { j["stepz"] = 3; }, {"unknown field \"stepz\"", "\"steps\""}},
    {"UnrelatedField", [](json& j) { j["colour"] = "red"; }, {"unknown field \"colour\"", "known fields"}},
    {"ModelNotObject", [](json& j) { j["model"] = 5; }, {"model: expected an object, got 5"}},
    {"NameNotString", [](json& j) { j["name"] = 3; }, {"name: expected a string, got 3"}},
    {"TopLevelArray",
     [](json& j) {
       j = json::array({1, 2});
     },
     {"expected a JSON object", "[1,2]"}},
};

INSTANTIATE_TEST_SUITE_P(Cases, BadWorkload, ::testing::ValuesIn(kBadCases),
                         [](const ::testing::TestParamInfo<BadCase>& p) { return p.param.name; });

TEST(BadWorkloadFile, MalformedJsonNamesLineAndColumn) {
  TempDir dir;
  const auto path = dir.write("broken.json", "{\n  \"model\": {\n    \"d_model\": 64,,\n  }\n}\n");
  const std::string msg = error_of([&] { load_workload(path); });
  expect_contains(msg, {path + ": malformed JSON at line 3, column", "syntax error"});
}

TEST(BadWorkloadFile, EmptyFile) {
  TempDir dir;
  const auto path = dir.write("empty.json", "");
  expect_contains(error_of([&] { load_workload(path); }), {path, "malformed JSON"});
}

TEST(BadWorkloadFile, DuplicateField) {
  TempDir dir;
  const auto path = dir.write("dup.json", R"({"model": {"d_model": 64, "d_model": 32}})");
  expect_contains(error_of([&] { load_workload(path); }), {path, "\"model.d_model\" appears twice"});
}

TEST(BadWorkloadFile, MissingFile) {
  TempDir dir;
  const auto path = dir.file("does-not-exist.json");
  expect_contains(error_of([&] { load_workload(path); }), {path, "cannot open", "No such file"});
}

TEST(BadWorkloadFile, Folder) {
  TempDir dir;
  expect_contains(error_of([&] { load_workload(dir.path().string()); }), {dir.path().string(), "folder"});
}

TEST(BadWorkloadFile, ModelFileMessagesNameTheModelFields) {
  const std::string msg = error_of([] { parse_model(json::parse(R"({"d_model": 64})"), "m.json"); });
  expect_contains(msg, {"m.json: missing field \"model.d_hidden\""});
}

// ---- checks that depend on the launch -----------------------------------------------------------

WorkloadConfig workload_with(std::int64_t experts, int expert_parallel) {
  json j = valid_workload();
  j["model"]["num_experts"] = experts;
  j["expert_parallel"] = expert_parallel;
  return parse_workload(j, "w.json");
}

TEST(ValidateForWorld, AcceptsDivisibleExpertParallelism) {
  for (int world : {1, 2, 4, 8}) EXPECT_NO_THROW(validate_for_world(workload_with(8, 0), world)) << world;
  EXPECT_NO_THROW(validate_for_world(workload_with(8, 4), 4));
}

TEST(ValidateForWorld, ExpertsNotDivisibleByRanks) {
  const std::string msg = error_of([] { validate_for_world(workload_with(6, 0), 4); });
  expect_contains(msg, {"w.json: model.num_experts = 6 is not divisible by the expert-parallel degree 4"});
}

TEST(ValidateForWorld, MoreRanksThanExperts) {
  const std::string msg = error_of([] { validate_for_world(workload_with(8, 0), 16); });
  expect_contains(msg, {"model.num_experts = 8 is not divisible by the expert-parallel degree 16",
                        "more ranks than experts", "at most 8 ranks"});
}

TEST(ValidateForWorld, RowsOneRankCanReceiveAreChecked) {
  json j = valid_workload();
  j["tokens_per_rank"] = 1 << 24;
  j["model"]["num_experts"] = 1 << 16;
  j["model"]["top_k"] = 64;
  j["model"]["d_hidden"] = 1 << 22;
  j["model"]["d_model"] = 1 << 10;
  j["expert_parallel"] = 0;
  const WorkloadConfig w = parse_workload(j, "w.json");  // 2^30 slots × 2^22 = 2^52 on one rank: accepted
  EXPECT_NO_THROW(validate_for_world(w, 1));
  expect_contains(error_of([&] { validate_for_world(w, 1 << 16); }),
                  {"w.json: the rows one rank can receive, 65536 ranks × tokens_per_rank × model.top_k", "exceed 2^56"});
}

TEST(ValidateForWorld, ExpertParallelMustMatchTheLaunch) {
  const std::string msg = error_of([] { validate_for_world(workload_with(8, 4), 2); });
  expect_contains(msg, {"w.json: expert_parallel = 4 but 2 ranks were launched"});
}

// ---- bad input never crashes: deep nesting, numbers beyond range, sizes that would wrap ---------

// {"name": [[[ ... ]]]} nested `depth` levels, written without recursion.
std::string deeply_nested(std::size_t depth) {
  return "{\"name\": " + std::string(depth, '[') + std::string(depth, ']') + "}";
}

// A cluster file on a catalogue node, with `extra` fields merged over it.
std::string cluster_text(const json& extra) {
  json j = {{"node", "dgx-a100-40gb"}, {"nodes", 2}, {"source", "test"}};
  j.update(extra);
  return j.dump();
}

TEST(BadInputNeverCrashes, DeepNestingInAWorkloadIsRejectedAtParse) {
  TempDir dir;
  const auto path = dir.write("deep.json", deeply_nested(200000));
  const std::string msg = error_of([&] { load_workload(path); });
  expect_contains(msg, {path + ": \"name\" nests arrays and objects more than 64 levels deep"});
  EXPECT_LT(msg.size(), 300u) << msg;
}

TEST(BadInputNeverCrashes, DeepNestingInAClusterFileIsRejectedAtParse) {
  TempDir dir;
  const auto path = dir.write("deep.json", deeply_nested(200000));
  const std::string msg = error_of([&] { sim::load_cluster(path); });
  expect_contains(msg, {path + ": \"name\" nests arrays and objects more than 64 levels deep"});
}

TEST(BadInputNeverCrashes, ShowQuotesAShortExcerptOfADeepValueWithoutRecursing) {
  // Built and destroyed without recursion (nlohmann frees nested values with its own stack).
  json deep = json::array();
  json* cur = &deep;
  for (int i = 0; i < 200000; ++i) cur = &cur->emplace_back(json::array());
  const std::string s = json_fields::show(deep);
  EXPECT_LE(s.size(), 60u) << s;
  EXPECT_EQ(s.rfind("[[[", 0), 0u) << s;
  // The message of a wrong type quotes the same excerpt, on one line.
  const json obj = {{"steps", json::array({1, 2})}};
  json_fields::Fields f(obj, "x.json", "", {"steps"});
  expect_contains(error_of([&] { f.wrong_type("steps", deep, "a positive integer"); }),
                  {"x.json: steps: expected a positive integer, got [[[", "..."});
  // Long strings and control characters: a short escaped excerpt.
  const std::string shown = json_fields::show(json(std::string(1 << 20, 'a') + "\n"));
  EXPECT_LE(shown.size(), 60u);
  EXPECT_EQ(json_fields::show(json("a\nb")), "\"a\\nb\"");
  EXPECT_EQ(json_fields::show(json::parse(R"({"a":[1,{"b":null}],"c":"x"})")), R"({"a":[1,{"b":null}],"c":"x"})");
}

TEST(BadInputNeverCrashes, NumberBeyondADoubleNamesFileAndField) {
  TempDir dir;
  json j = valid_workload();
  std::string text = j.dump();
  text.replace(text.find("1.25"), 4, "1e999");
  const auto path = dir.write("big.json", text);
  const std::string msg = error_of([&] { load_workload(path); });
  expect_contains(msg, {path + ": model.capacity_factor: number overflow parsing '1e999'"});
  EXPECT_EQ(msg.find("[json.exception"), std::string::npos) << msg;
}

TEST(BadInputNeverCrashes, NumberBeyondADoubleInAClusterFile) {
  TempDir dir;
  std::string text = cluster_text({{"fabric_latency", 1.5}});
  text.replace(text.find("1.5"), 3, "-1e999");
  const auto path = dir.write("big.json", text);
  const std::string msg = error_of([&] { sim::load_cluster(path); });
  expect_contains(msg, {path + ": fabric_latency: number overflow parsing '-1e999'"});
  EXPECT_EQ(msg.find("[json.exception"), std::string::npos) << msg;
}

TEST(BadInputNeverCrashes, HugeDHiddenIsRejectedBeforeAnythingIsBuilt) {
  TempDir dir;
  json j = valid_workload();
  j["model"]["d_hidden"] = 9223372036854775000ll;
  const auto path = dir.write("w.json", j.dump());
  expect_contains(error_of([&] { load_workload(path); }), {path + ": model.d_hidden = 9223372036854775000 is too large"});
}

TEST(BadInputNeverCrashes, ExpertWeightsBeyondTheBoundNameTheFields) {
  json j = valid_workload();
  j["model"]["d_model"] = 1 << 20;
  j["model"]["d_hidden"] = 1 << 22;
  j["model"]["num_experts"] = 1 << 16;
  expect_contains(error_of([&] { parse_workload(j, "w.json"); }),
                  {"w.json: the expert weights of one layer, model.num_experts × 2 × model.d_model × model.d_hidden",
                   "exceed 2^56"});
}

TEST(BadInputNeverCrashes, RoutedSlotsBeyondInt32) {
  json j = valid_workload();
  j["tokens_per_rank"] = 1 << 24;
  j["model"]["num_experts"] = 1024;
  j["model"]["top_k"] = 512;
  expect_contains(error_of([&] { parse_workload(j, "w.json"); }),
                  {"w.json: tokens_per_rank × model.top_k = 16777216 × 512 routed slots is more than 2^31 - 1"});
}

TEST(BadInputNeverCrashes, HugeCapacityFactorIsRejectedAndCapacityNeverWraps) {
  json j = valid_workload();
  j["model"]["capacity_factor"] = 1e17;
  expect_contains(error_of([&] { parse_workload(j, "w.json"); }), {"w.json: model.capacity_factor = ", "is too large"});
  ModelConfig m;
  m.num_experts = 8;
  m.top_k = 2;
  for (double cf : {1e17, 1e300, std::numeric_limits<double>::infinity()}) {
    m.capacity_factor = cf;
    EXPECT_EQ(m.capacity(512), 512) << cf;  // an expert never receives more than T slots
  }
  m.capacity_factor = 8.0;  // 8 * 2 * 512 / 8 = 1024 > T
  EXPECT_EQ(m.capacity(512), 512);
  m.capacity_factor = 1.25;
  EXPECT_EQ(m.capacity(512), 160);
}

// A node object inline in a cluster file, with `gpus` GPUs.
json inline_node(std::int64_t gpus) {
  return {{"name", "test-node"}, {"gpu", "A100-SXM4-40GB"}, {"gpus", gpus}, {"intra", "nvswitch"},
          {"nvlink_bw", 300e9}, {"nvlink_latency", 1e-6}, {"pcie_latency", 1e-6}, {"nics", 8},
          {"nic_bw", 25e9}, {"nic_latency", 5e-6}, {"host_memory_bytes", 1e12}, {"host_copy_bw", 20e9},
          {"source", "test"}};
}

TEST(BadInputNeverCrashes, ClusterNodesTimesGpusCannotWrap) {
  TempDir dir;
  const auto path = dir.write("c.json", cluster_text({{"nodes", 2147483647}}));
  expect_contains(error_of([&] { sim::load_cluster(path); }), {path + ": nodes = 2147483647 is too large (at most 65536)"});
  // Each within its bound, the product beyond the world's bound.
  const auto wide = dir.write("w.json", cluster_text({{"nodes", 65536}, {"node", inline_node(1024)}}));
  expect_contains(error_of([&] { sim::load_cluster(wide); }),
                  {wide + ": nodes × node.gpus = 65536 × 1024 GPUs is more than 1048576"});
  const auto ok = dir.write("ok.json", cluster_text({{"nodes", 1024}, {"node", inline_node(1024)}}));
  EXPECT_EQ(sim::load_cluster(ok).world_size(), 1 << 20);
}

TEST(BadInputNeverCrashes, NodeGpusBeyondTheBound) {
  TempDir dir;
  const auto path = dir.write("c.json", cluster_text({{"node", inline_node(2147483647)}}));
  expect_contains(error_of([&] { sim::load_cluster(path); }), {path + ": node.gpus = 2147483647 is too large (at most 1024)"});
}

// ---- cluster and profile figures in their physical ranges (harness/config/limits.hpp) ----------

// A one-node cluster with its node and GPU inline, every figure valid.
json inline_cluster() {
  json gpu = {{"name", "test-gpu"},  {"flops_bf16", 312e12}, {"flops_tf32", 156e12}, {"flops_fp32", 19.5e12},
              {"memory_bytes", 40e9}, {"hbm_bw", 1.5e12}, {"source", "test"}};
  json node = inline_node(8);
  node["gpu"] = gpu;
  return {{"node", node}, {"nodes", 1}, {"source", "test"},
          {"efficiency", {{"gemm_max", 0.8}, {"gemm_half_dim", 128}, {"mem", 0.8}, {"launch_latency", 5e-6}}},
          {"interference", {{"sigma", 0.9}, {"mu", 0.9}, {"eta", 0.9}}}};
}

class ClusterFigureOutOfRange : public ::testing::TestWithParam<BadCase> {};

TEST_P(ClusterFigureOutOfRange, IsRejectedNamingFieldValueAndRange) {
  expect_rejected(inline_cluster(), GetParam(), [](const std::string& p) { sim::load_cluster(p); });
}

// Each of these once passed (a finite, positive number) and made the simulation's times
// infinite or its tasks never end ("launch_latency": 1e308: "task 'fill_zero' never ended").
INSTANTIATE_TEST_SUITE_P(
    Figures, ClusterFigureOutOfRange,
    ::testing::Values(
        BadCase{"launch_latency_1e308", [](json& j) { j["efficiency"]["launch_latency"] = 1e308; },
                {"efficiency.launch_latency = 1e+308 is outside [0, 1] s"}},
        BadCase{"fabric_latency_1e6", [](json& j) { j["fabric_latency"] = 1e6; }, {"fabric_latency = 1000000.0 is outside [0, 1] s"}},
        BadCase{"nvlink_latency_huge", [](json& j) { j["node"]["nvlink_latency"] = 1e300; }, {"node.nvlink_latency = 1e+300 is outside"}},
        BadCase{"nvlink_bw_tiny", [](json& j) { j["node"]["nvlink_bw"] = 1e-300; }, {"node.nvlink_bw = 1e-300 is outside [1000, 1e+15] bytes/s"}},
        BadCase{"nic_bw_huge", [](json& j) { j["node"]["nic_bw"] = 1e300; }, {"node.nic_bw = 1e+300 is outside [1000, 1e+15] bytes/s"}},
        BadCase{"host_copy_bw_tiny", [](json& j) { j["node"]["host_copy_bw"] = 1; }, {"node.host_copy_bw = 1 is outside"}},
        BadCase{"host_memory_tiny", [](json& j) { j["node"]["host_memory_bytes"] = 1; }, {"node.host_memory_bytes = 1 is outside"}},
        BadCase{"gpu_flops_huge", [](json& j) { j["node"]["gpu"]["flops_bf16"] = 1e300; },
                {"node.gpu.flops_bf16 = 1e+300 is outside [1e+06, 1e+18] FLOP/s"}},
        BadCase{"gpu_flops_tiny", [](json& j) { j["node"]["gpu"]["flops_fp32"] = 1e-300; }, {"node.gpu.flops_fp32 = 1e-300 is outside"}},
        BadCase{"gpu_memory_huge", [](json& j) { j["node"]["gpu"]["memory_bytes"] = 1e300; }, {"node.gpu.memory_bytes = 1e+300 is outside"}},
        BadCase{"hbm_bw_tiny", [](json& j) { j["node"]["gpu"]["hbm_bw"] = 1e-300; }, {"node.gpu.hbm_bw = 1e-300 is outside"}},
        BadCase{"gemm_max_tiny", [](json& j) { j["efficiency"]["gemm_max"] = 1e-300; },
                {"efficiency.gemm_max = 1e-300 is outside [0.001, 1] (a fraction)"}},
        BadCase{"gemm_half_dim_huge", [](json& j) { j["efficiency"]["gemm_half_dim"] = 1e300; },
                {"efficiency.gemm_half_dim = 1e+300 is outside"}},
        BadCase{"sigma_tiny", [](json& j) { j["interference"]["sigma"] = 1e-9; }, {"interference.sigma = 1e-09 is outside"}}),
    [](const ::testing::TestParamInfo<BadCase>& p) { return p.param.name; });

TEST(ClusterFigures, TheShippedClustersAreInsideTheRanges) {
  for (const auto& name : sim::cluster_names()) EXPECT_NO_THROW(sim::load_cluster(name)) << name;
  TempDir dir;
  EXPECT_NO_THROW(sim::load_cluster(dir.write("c.json", inline_cluster().dump())));
}

json valid_profile() {
  return {{"schema", "moelab.profile/1"},
          {"device", "test"},
          {"gemm", json::array({{{"m", 1024}, {"n", 1024}, {"k", 1024}, {"dtype", "bf16"}, {"seconds", 1e-5}}})},
          {"h2d_bw", 20e9},
          {"launch_latency", 4e-6},
          {"collectives", json::array({{{"op", "all_to_all_v"}, {"ranks", 2}, {"bytes_per_peer", 4096},
                                         {"seconds", 1e-5}, {"busbw", 1e9}}})}};
}

class ProfileFigureOutOfRange : public ::testing::TestWithParam<BadCase> {};

TEST_P(ProfileFigureOutOfRange, IsRejectedNamingFieldValueAndRange) {
  expect_rejected(valid_profile(), GetParam(), [](const std::string& p) { sim::load_profile(p); });
}

INSTANTIATE_TEST_SUITE_P(
    Figures, ProfileFigureOutOfRange,
    ::testing::Values(
        BadCase{"launch_latency_1e308", [](json& j) { j["launch_latency"] = 1e308; }, {"launch_latency = 1e+308 is outside [0, 1] s"}},
        BadCase{"h2d_bw_huge", [](json& j) { j["h2d_bw"] = 1e300; }, {"h2d_bw = 1e+300 is outside"}},
        BadCase{"gemm_seconds_tiny", [](json& j) { j["gemm"][0]["seconds"] = 1e-300; }, {"gemm[0].seconds = 1e-300 is outside"}},
        BadCase{"gemm_rate_beyond_any_gpu", [](json& j) { j["gemm"][0]["seconds"] = 1e-11; },
                {"gemm[0].seconds = 1e-11 for a 1024 x 1024 x 1024 GEMM is", "FLOP/s, outside [1e+06, 1e+18]"}},
        BadCase{"gemm_m_huge", [](json& j) { j["gemm"][0]["m"] = 1ll << 40; }, {"gemm[0].m = 1099511627776 is too large"}},
        BadCase{"collective_seconds_zero", [](json& j) { j["collectives"][0]["seconds"] = 0; },
                {"collectives[0].seconds = 0 must be > 0"}}),
    [](const ::testing::TestParamInfo<BadCase>& p) { return p.param.name; });

TEST(ProfileFigures, ZeroMeansNotMeasured) {
  TempDir dir;
  json j = valid_profile();
  j["h2d_bw"] = 0;
  j["launch_latency"] = 0;
  const sim::Profile p = sim::load_profile(dir.write("p.json", j.dump()));
  EXPECT_EQ(p.h2d_bw, 0.0);
  EXPECT_EQ(p.launch_latency, 0.0);
}

// ---- routing traces (--routing trace:FILE) ------------------------------------------------------

TEST(RoutingTrace, ReadsWhatRecordRoutingWrites) {
  TempDir dir;
  const std::vector<std::vector<std::vector<std::int64_t>>> calls = {{{3, 1}, {2, 2}}, {{4, 0}, {0, 4}}};
  const auto path = dir.write("t.json", routing_trace_json(calls, json::object()).dump());
  EXPECT_EQ(RoutingModel::parse("trace:" + path, 1).trace, calls);
}

TEST(RoutingTrace, ARescaledReplayAddsUpAndIsNeverNegative) {
  // Found by harness/fuzz/fuzz_routing_trace: [0, 1, 1] replayed for one slot gave 2 (each share
  // rounded alone, the excess taken from expert 0 and clamped at 0).
  RoutingModel m;
  m.kind = RoutingModel::Kind::trace;
  m.trace_path = "t.json";
  m.trace = {{{0, 1, 1}}};
  EXPECT_EQ(m.draw(0, 0, 1, 1, 3), (std::vector<std::int64_t>{0, 1, 0}));
  Rng rng(test::fresh_seed());
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<std::int64_t> rec(1 + rng.next() % 9);
    for (auto& c : rec) c = static_cast<std::int64_t>(rng.next() % 5);
    m.trace = {{rec}};
    const std::int64_t tokens = 1 + static_cast<std::int64_t>(rng.next() % 100);
    const int k = 1 + static_cast<int>(rng.next() % 2);
    const auto r = m.draw(0, 0, tokens, k, static_cast<std::int64_t>(rec.size()));
    std::int64_t sum = 0;
    for (const auto c : r) {
      EXPECT_GE(c, 0);
      sum += c;
    }
    EXPECT_EQ(sum, tokens * k) << "trial " << trial;
  }
}

class BadRoutingTrace : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadRoutingTrace, IsOneLineNamingTheFileAndTheEntry) {
  const json valid = routing_trace_json({{{3, 1}, {2, 2}}}, json::object());
  expect_rejected(valid, GetParam(), [](const std::string& p) { RoutingModel::parse("trace:" + p, 1); });
}

INSTANTIATE_TEST_SUITE_P(
    Traces, BadRoutingTrace,
    ::testing::Values(
        BadCase{"wrong_schema", [](json& j) { j["schema"] = "x"; }, {"schema = \"x\" is not \"moelab.routing-trace/1\""}},
        BadCase{"unknown_field", [](json& j) { j["cals"] = 1; }, {"unknown field \"cals\""}},
        BadCase{"calls_not_array", [](json& j) { j["calls"] = "x"; }, {"calls: expected a non-empty array"}},
        BadCase{"empty_calls", [](json& j) { j["calls"] = json::array(); }, {"calls: expected a non-empty array"}},
        BadCase{"call_without_ranks", [](json& j) { j["calls"][0] = json::array(); }, {"calls[0]: expected a non-empty array of ranks"}},
        BadCase{"count_is_a_string", [](json& j) { j["calls"][0][1][0] = "2"; }, {"calls[0][1][0]: expected a count", "got \"2\""}},
        BadCase{"negative_count", [](json& j) { j["calls"][0][0][1] = -1; }, {"calls[0][0][1]: expected a count from 0"}},
        BadCase{"count_beyond_int32", [](json& j) { j["calls"][0][0][0] = 1ll << 40; }, {"calls[0][0][0]: expected a count"}},
        BadCase{"fractional_count", [](json& j) { j["calls"][0][0][0] = 1.5; }, {"calls[0][0][0]: expected a count"}}),
    [](const ::testing::TestParamInfo<BadCase>& p) { return p.param.name; });

TEST(RoutingTrace, MalformedFileAndLongSpecsAreOneShortLine) {
  TempDir dir;
  const auto path = dir.write("t.json", "{\"schema\": ");
  expect_contains(error_of([&] { RoutingModel::parse("trace:" + path, 1); }), {path + ": malformed JSON"});
  const std::string spec = "zipf:" + std::string(100000, '1') + "\nx";
  const std::string msg = error_of([&] { RoutingModel::parse(spec, 1); });
  expect_contains(msg, {"--routing zipf:111"});
  EXPECT_LT(msg.size(), 200u) << msg;
  expect_contains(error_of([] { RoutingModel::parse("zipf:1e999", 1); }), {"the Zipf exponent must be a number in (0, 100]"});
}

// ---- messages never echo a long value in full, and never compare it letter by letter ---------------

TEST(Messages, AClosestNameSearchSkipsWordsFarLongerThanEveryName) {
  // Once an edit distance over every letter of the word against each name: seconds for a file
  // pasted into --cluster. The bound on the distance makes it instant and the answer the same.
  const std::string word(50u << 20, 'a');
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(json_fields::closest(word, {"dgx-a100x1", "h100x1", "a800x2"}), "");
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), 1.0);
  EXPECT_EQ(json_fields::closest("h100x2", {"dgx-a100x1", "h100x1", "a800x2"}), "h100x1");
  const std::string msg = error_of([&] { sim::load_cluster(std::string(1 << 20, 'x') + "\nnext line"); });
  expect_contains(msg, {"unknown cluster \"xxx"});
  EXPECT_LT(msg.size(), 1000u);
}

TEST(Messages, KeysAndNamesFromTheFileAreOneShortLine) {
  // Found by harness/fuzz/fuzz_workload: a key holding "\n" (legal JSON) was quoted whole, and
  // the message spread over several lines.
  const std::string key = "a\nb" + std::string(10000, 'x');
  json j = valid_workload();
  j[key] = 1;
  std::string msg = error_of([&] { parse_workload(j, "w.json"); });
  expect_contains(msg, {"w.json: unknown field \"a\\nbxxx"});
  EXPECT_LT(msg.size(), 600u) << msg;
  const std::string twice = "{\"" + std::string("k\\n") + std::string(5000, 'y') + "\": 1, \"" + "k\\n" +
                            std::string(5000, 'y') + "\": 2}";
  msg = error_of([&] { json_fields::parse_text(twice, "t.json"); });
  expect_contains(msg, {"t.json: field \"k\\nyyy", "appears twice"});
  EXPECT_LT(msg.size(), 600u) << msg;
  // A long list of names (a catalogue of thousands of entries) is cut too.
  std::vector<std::string> names(1000, "name\nwith a break");
  const std::string list = json_fields::join(names);
  EXPECT_EQ(list.find('\n'), std::string::npos);
  EXPECT_NE(list.find("(968 more)"), std::string::npos) << list;
}

// ---- the implementations' registry: an options check beside each factory --------------------------

TEST(ImplRegistry, ARegisteredOptionsCheckSeesTheRunAndAnUnregisteredOneChecksNothing) {
  ImplCheckContext seen{ModelConfig{}, 0, 0};
  int calls = 0;
  register_impl(
      "config-test-checked", [](Backend&, Communicator&, const ModelConfig&, const json&, MoEChannels*) -> std::unique_ptr<MoEImpl> { return nullptr; },
      [&](const json& o, const ImplCheckContext& run) {
        ++calls;
        seen.world = run.world;
        seen.tokens_per_rank = run.tokens_per_rank;
        if (o.contains("partitions") && o["partitions"].get<std::int64_t>() > run.tokens_per_rank)
          throw ConfigError("config-test-checked: partitions = " + o["partitions"].dump() + " exceeds the tokens");
      });
  register_impl("config-test-unchecked",
                [](Backend&, Communicator&, const ModelConfig&, const json&, MoEChannels*) -> std::unique_ptr<MoEImpl> { return nullptr; });
  const ModelConfig m;
  EXPECT_NO_THROW(check_impl_options("config-test-checked", json{{"partitions", 4}}, {m, 8, 512}));
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(seen.world, 8);
  EXPECT_EQ(seen.tokens_per_rank, 512);
  expect_contains(error_of([&] { check_impl_options("config-test-checked", json{{"partitions", 1000}}, {m, 8, 512}); }),
                  {"partitions = 1000 exceeds the tokens"});
  EXPECT_NO_THROW(check_impl_options("config-test-unchecked", json{{"anything", 1}}, {m, 8, 512}));
  expect_contains(error_of([&] { check_impl_options("no-such-impl", json::object(), {m, 1, 1}); }), {"no-such-impl"});
}

// ---- options given on the command line (--impl-options) ------------------------------------------

TEST(ImplOptions, ParsesAnObject) {
  const json j = json_fields::parse_options(R"({"partitions": 4, "strategy": "s2"})", "--impl-options");
  EXPECT_EQ(j["partitions"], 4);
  EXPECT_EQ(json_fields::parse_options("{}", "--impl-options"), json::object());
}

TEST(ImplOptions, DuplicateKeys) {
  expect_contains(error_of([] { json_fields::parse_options(R"({"a": 1, "a": 2})", "--impl-options"); }),
                  {"--impl-options '{\"a\": 1, \"a\": 2}': field \"a\" appears twice"});
}

TEST(ImplOptions, MalformedJsonQuotesAShortEscapedExcerpt) {
  // 128 KB with line breaks, pasted by mistake: the message is one short line.
  const std::string text = "{\"partitions\": 4,\n" + std::string(128 * 1024, 'x') + "\n}";
  const std::string msg = error_of([&] { json_fields::parse_options(text, "--impl-options"); });
  expect_contains(msg, {"--impl-options '{\"partitions\": 4,\\nxxx", "...': malformed JSON at line 2"});
  EXPECT_LT(msg.size(), 400u) << msg;
  expect_contains(error_of([] { json_fields::parse_options("", "--impl-options"); }), {"--impl-options '': malformed JSON"});
  const std::string bad_string = "{\"s\": \"" + std::string(100000, 'y') + "\n\"}";  // the library quotes the token
  const std::string m2 = error_of([&] { json_fields::parse_options(bad_string, "--impl-options"); });
  expect_contains(m2, {"malformed JSON"});
  EXPECT_LT(m2.size(), 400u) << m2;
}

TEST(ImplOptions, NotAnObject) {
  expect_contains(error_of([] { json_fields::parse_options("[1, 2]", "--impl-options"); }),
                  {"--impl-options '[1, 2]': expected a JSON object such as {\"name\": value}, got [1,2]"});
  expect_contains(error_of([] { json_fields::parse_options("4", "--impl-options"); }), {"got 4"});
}

TEST(ImplOptions, NumbersBeyondADoubleAndDeepNesting) {
  expect_contains(error_of([] { json_fields::parse_options(R"({"overlap": 1e999})", "--impl-options"); }),
                  {"--impl-options '{\"overlap\": 1e999}': overlap: number overflow parsing '1e999'"});
  const std::string deep = "{\"a\": " + std::string(10000, '[') + std::string(10000, ']') + "}";
  expect_contains(error_of([&] { json_fields::parse_options(deep, "--impl-options"); }),
                  {"\"a\" nests arrays and objects more than 64 levels deep"});
}

TEST(ImplOptions, TypedFieldsAndDefaults) {
  const json j = {{"partitions", 8}, {"strategy", "s2"}, {"overlap", 0.5}, {"pinned", false}, {"label", "x"}};
  const json_fields::Options o(j, "--impl-options", {"partitions", "strategy", "overlap", "pinned", "label"});
  EXPECT_EQ(o.positive_int("partitions", 4, 1024), 8);
  EXPECT_EQ(o.choice("strategy", "auto", {"auto", "s1", "s2"}), "s2");
  EXPECT_DOUBLE_EQ(o.number("overlap", 1.0, 0.0, 1.0), 0.5);
  EXPECT_FALSE(o.boolean("pinned", true));
  EXPECT_EQ(o.string("label", ""), "x");
  EXPECT_TRUE(o.has("label"));
  const json empty = json::object();
  const json_fields::Options d(empty, "--impl-options", {"partitions", "strategy", "overlap", "pinned"});
  EXPECT_EQ(d.positive_int("partitions", 4, 1024), 4);
  EXPECT_EQ(d.integer("partitions", 7, 2, 9), 7);
  EXPECT_EQ(d.choice("strategy", "auto", {"auto", "s1"}), "auto");
  EXPECT_DOUBLE_EQ(d.number("overlap", 1.0, 0.0, 1.0), 1.0);
  EXPECT_TRUE(d.boolean("pinned", true));
  EXPECT_FALSE(d.has("pinned"));
}

TEST(ImplOptions, BadValuesNameTheOption) {
  const auto msg = [](const json& j, const std::function<void(const json_fields::Options&)>& read) {
    return error_of([&] { read(json_fields::Options(j, "--impl-options", {"partitions", "strategy", "overlap", "pinned"})); });
  };
  expect_contains(msg({{"partitons", 4}}, [](const auto&) {}),
                  {"--impl-options: unknown option \"partitons\" = 4 (did you mean \"partitions\"?)"});
  expect_contains(msg({{"colour", 4}}, [](const auto&) {}),
                  {"--impl-options: unknown option \"colour\" = 4 (known options: partitions, strategy, overlap, pinned)"});
  expect_contains(msg({{"partitions", 0}}, [](const auto& o) { o.positive_int("partitions", 4, 1024); }),
                  {"--impl-options: partitions = 0: expected a positive integer"});
  expect_contains(msg({{"partitions", 2.5}}, [](const auto& o) { o.positive_int("partitions", 4, 1024); }),
                  {"partitions = 2.5: expected a positive integer"});
  expect_contains(msg({{"partitions", "4"}}, [](const auto& o) { o.positive_int("partitions", 4, 1024); }),
                  {"partitions = \"4\": expected a positive integer"});
  expect_contains(msg({{"partitions", 5000}}, [](const auto& o) { o.positive_int("partitions", 4, 1024); }),
                  {"partitions = 5000 is too large (at most 1024)"});
  expect_contains(msg({{"partitions", 1}}, [](const auto& o) { o.integer("partitions", 4, 2, 1024); }),
                  {"partitions = 1 must be >= 2"});
  expect_contains(msg({{"pinned", "yes"}}, [](const auto& o) { o.boolean("pinned", true); }),
                  {"--impl-options: pinned = \"yes\": expected true or false"});
  expect_contains(msg({{"strategy", "atuo"}}, [](const auto& o) { o.choice("strategy", "auto", {"auto", "s1", "s2"}); }),
                  {"strategy = \"atuo\" is not one of auto, s1, s2 (did you mean \"auto\"?)"});
  expect_contains(msg({{"overlap", 1.5}}, [](const auto& o) { o.number("overlap", 1.0, 0.0, 1.0); }),
                  {"--impl-options: overlap = 1.5 must be in [0, 1]"});
  expect_contains(msg({{"overlap", "half"}}, [](const auto& o) { o.number("overlap", 1.0, 0.0, 1.0); }),
                  {"overlap = \"half\": expected a number"});
  expect_contains(error_of([] { json_fields::Options(json::array({1}), "--impl-options", {"a"}); }),
                  {"--impl-options: expected a JSON object such as {\"a\": value}, got [1]"});
}

TEST(ChoiceFields, SuggestTheClosestName) {
  json j = valid_workload();
  j["model"]["activation"] = "gleu";
  expect_contains(error_of([&] { parse_workload(j, "w.json"); }),
                  {"w.json: model.activation = \"gleu\" is not one of gelu, relu, gelu_tanh (did you mean \"gelu\"?)"});
}

// ---- result files ---------------------------------------------------------------------------------

json read_json(const std::string& path) {
  std::ifstream in(path);
  return json::parse(in);
}

TEST(WriteJsonAtomic, WritesCreatingFolders) {
  TempDir dir;
  const auto path = dir.file("results/cpu/run.json");
  const json j = {{"schema", "moelab.result/1"}, {"x", 1.5}};
  write_json_atomic(path, j);
  EXPECT_EQ(read_json(path), j);
  EXPECT_TRUE(dir.temp_files().empty());
}

TEST(WriteJsonAtomic, Overwrites) {
  TempDir dir;
  const auto path = dir.file("run.json");
  write_json_atomic(path, {{"v", 1}});
  write_json_atomic(path, {{"v", 2}});
  EXPECT_EQ(read_json(path)["v"], 2);
  EXPECT_TRUE(dir.temp_files().empty());
}

TEST(WriteJsonAtomic, FailsCleanlyWhenTheFolderCannotBeMade) {
  TempDir dir;
  dir.write("plain-file", "x");
  const auto path = dir.file("plain-file/sub/run.json");  // a file where a folder should be
  try {
    write_json_atomic(path, {{"v", 1}});
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  EXPECT_TRUE(dir.temp_files().empty());
}

TEST(WriteJsonAtomic, FailsCleanlyWhenTheRenameFails) {
  // The destination is a non-empty folder: the temporary file is written, the rename fails,
  // and the temporary file must be gone afterwards.
  TempDir dir;
  const auto path = dir.file("taken");
  fs::create_directories(path);
  dir.write("taken/keep", "x");
  try {
    write_json_atomic(path, {{"v", 1}});
    FAIL() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
  }
  EXPECT_TRUE(dir.temp_files().empty());
  EXPECT_TRUE(fs::is_directory(path));
}

TEST(WriteJsonAtomic, FailsCleanlyInAReadOnlyFolder) {
  if (::geteuid() == 0) GTEST_SKIP() << "root writes into read-only folders";
  TempDir dir;
  const auto ro = dir.file("ro");
  fs::create_directories(ro);
  fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec);
  EXPECT_THROW(write_json_atomic(ro + "/run.json", {{"v", 1}}), std::runtime_error);
  fs::permissions(ro, fs::perms::owner_all);
  EXPECT_TRUE(dir.temp_files().empty());
  EXPECT_FALSE(fs::exists(ro + "/run.json"));
}

TEST(Provenance, DateIsUtcIso8601AndCommitIsKnown) {
  EXPECT_TRUE(std::regex_match(utc_now_iso8601(), std::regex(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")))
      << utc_now_iso8601();
  EXPECT_FALSE(build_commit().empty());
}

}  // namespace
}  // namespace moelab
