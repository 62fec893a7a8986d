// baselines/topk/topk_test.cpp — ScMoE's baselines (topk.hpp), in one process:
//   1. cpu, one rank: top2 is FastMoE on a top-2 model, top1 FastMoE on the model made top-1,
//      and the pipelined ones give their unpipelined numbers (outputs and every gradient, two
//      passes); the report names the routing, the chunks and a model's other k;
//   2. bad options and a Residual-MoE without a dense MLP: a ConfigError naming them, before
//      any work;
//   3. sim, pcie-a30x1: the pipelined baseline overlaps its all-to-alls with expert GEMMs,
//      2·r exchanges a pass, the unpipelined one does not overlap;
//   4. a model's FLOPs count the baseline's k, not the file's.
// Multi-rank exactness (1, 2, 4 ranks) is in harness/tests/moe_layer_mpi_test.cpp.
//   ctest --test-dir build -R topk_test      (MOELAB_TEST_SEED=<n> replays a seed)
#include <gtest/gtest.h>

#include <algorithm>

#include "baselines/topk/topk.hpp"
#include "harness/backends/sim/sim_backend.hpp"
#include "harness/nn/model.hpp"
#include "harness/runtime/error.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab {
namespace {

using nlohmann::json;

ModelConfig config(int top_k, bool noisy) {
  ModelConfig cfg;
  cfg.d_model = 12;
  cfg.d_hidden = 20;
  cfg.num_experts = 8;
  cfg.top_k = top_k;
  cfg.capacity_factor = 1.0;  // some slots overflow
  cfg.noisy_gate = noisy;
  return cfg;
}

struct Passes {
  std::vector<float> y, dx, dwg, dw1, dw2, aux;
  json report;
};

Passes two_passes(const std::string& impl, const json& options, const ModelConfig& cfg, std::uint64_t seed) {
  register_builtin_impls();
  auto b = make_backend("cpu");
  auto comm = make_self_communicator(*b);
  auto m = make_impl(impl, *b, *comm, cfg, options);
  m->init_parameters(seed);
  m->layer().set_noise_seed(Rng::mix(seed, 5));
  Stream& s = m->layer().compute_stream();
  const std::int64_t T = 41, M = cfg.d_model;
  Passes r;
  for (int pass = 0; pass < 2; ++pass) {
    Tensor x = b->empty({T, M}, cfg.dtype, MemCategory::activations, s);
    Tensor dy = b->empty({T, M}, cfg.dtype, MemCategory::activations, s);
    b->upload(test::uniform(static_cast<std::size_t>(T * M), Rng::mix(seed, 10 + pass)), x);
    b->upload(test::uniform(static_cast<std::size_t>(T * M), Rng::mix(seed, 20 + pass)), dy);
    Tensor y = m->forward(x);
    r.aux.push_back(m->aux_loss());
    Tensor dx = m->backward(dy, 0.3f);
    b->synchronize();
    for (auto [dst, t] : {std::pair{&r.y, y}, std::pair{&r.dx, dx}}) {
      const auto h = b->download(t);
      dst->insert(dst->end(), h.begin(), h.end());
    }
  }
  r.dwg = b->download(m->grads().w_gate);
  r.dw1 = b->download(m->grads().w1);
  r.dw2 = b->download(m->grads().w2);
  r.report = m->report();
  return r;
}

void expect_same(const Passes& got, const Passes& ref, double rtol) {
  EXPECT_TRUE(test::all_close("y", got.y, test::to_double(ref.y), rtol));
  EXPECT_TRUE(test::all_close("aux", got.aux, test::to_double(ref.aux), rtol));
  EXPECT_TRUE(test::all_close("dx", got.dx, test::to_double(ref.dx), rtol));
  EXPECT_TRUE(test::all_close("dW_gate", got.dwg, test::to_double(ref.dwg), rtol));
  EXPECT_TRUE(test::all_close("dW1", got.dw1, test::to_double(ref.dw1), rtol));
  EXPECT_TRUE(test::all_close("dW2", got.dw2, test::to_double(ref.dw2), rtol));
}

// ---- 1. the same function as FastMoE ---------------------------------------------------------
TEST(TopK, UnpipelinedIsFastMoEWithTheBaselinesK) {
  const std::uint64_t seed = test::fresh_seed();
  for (bool noisy : {false, true}) {
    SCOPED_TRACE(noisy ? "noisy" : "plain");
    const Passes top2 = two_passes("top2", json::object(), config(1, noisy), seed);  // a top-1 file, routed top-2
    expect_same(top2, two_passes("fastmoe", json::object(), config(2, noisy), seed), 0);
    EXPECT_EQ(top2.report["top_k"], 2);
    EXPECT_EQ(top2.report["model_top_k"], 1);
    const Passes top1 = two_passes("top1", json(), config(2, noisy), seed);
    expect_same(top1, two_passes("fastmoe", json::object(), config(1, noisy), seed), 0);
    EXPECT_EQ(top1.report["schedule"], "unpipelined expert parallelism");
    const Passes res = two_passes("residual-moe", json::object(), config(2, noisy), seed);
    expect_same(res, top1, 0);
  }
}

TEST(TopK, PipelinedGivesTheUnpipelinedNumbers) {
  const std::uint64_t seed = test::fresh_seed();
  for (int k : {1, 2})
    for (int chunks : {1, 3, 8}) {
      SCOPED_TRACE("k " + std::to_string(k) + ", chunks " + std::to_string(chunks));
      const std::string name = "top" + std::to_string(k);
      const Passes p = two_passes(name + "-pipelined", {{"chunks", chunks}}, config(2, true), seed);
      expect_same(p, two_passes(name, json::object(), config(2, true), seed), 1e-5);
      EXPECT_EQ(p.report["chunks"], chunks);
      EXPECT_EQ(p.report["schedule"], "Tutel-style chunked all-to-all");
    }
  EXPECT_EQ(two_passes("top2-pipelined", json::object(), config(2, false), seed).report["chunks"], 4);  // the default
}

// ---- 2. bad options ------------------------------------------------------------------------
TEST(TopK, BadOptionsAndAResidualMoEWithoutADenseMlpAreConfigErrors) {
  register_builtin_impls();
  const auto names = impl_names();
  for (const char* n : {"top1", "top2", "residual-moe", "top1-pipelined", "top2-pipelined"})
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;
  const ModelConfig m = config(2, false);
  const auto message = [&](const std::string& impl, const json& options, std::int64_t shared = 0) {
    try {
      check_impl_options(impl, options, {m, 4, 512, shared});
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const auto says = [](const std::string& msg, const std::string& part) {
    EXPECT_NE(msg.find(part), std::string::npos) << msg;
  };
  says(message("top2-pipelined", {{"chunks", 0}}), "chunks = 0");
  says(message("top2-pipelined", {{"chunks", 65}}), "chunks = 65");
  says(message("top1-pipelined", {{"chunks", "4"}}), "chunks = \"4\"");
  says(message("top1-pipelined", {{"chunk", 4}}), "unknown option \"chunk\" = 4 (did you mean \"chunks\"?)");
  says(message("top2", {{"chunks", 2}}), "top2 takes no options");
  says(message("residual-moe", json::object()), "moe.shared_expert_hidden");
  EXPECT_EQ(message("residual-moe", json::object(), 48), "accepted");
  EXPECT_EQ(message("top2-pipelined", {{"chunks", 2.0}}), "accepted");
  ModelConfig one = m;
  one.num_experts = 1;
  one.top_k = 1;
  EXPECT_THROW(check_impl_options("top2", json::object(), {one, 1, 512}), ConfigError);
  // The factory checks before it builds anything.
  auto b = make_backend("cpu");
  auto comm = make_self_communicator(*b);
  EXPECT_THROW(make_impl("top1-pipelined", *b, *comm, m, {{"chunks", -1}}), ConfigError);
  EXPECT_EQ(b->memory().in_use_total(), 0u);
}

// ---- 3. sim: the overlap the chunks exist for ---------------------------------------------
struct SimOverlap {
  double hidden_s = 0, comm_s = 0;
  int collectives = 0;
};

SimOverlap sim_overlap(const std::string& impl, const json& options) {
  SimOptions o;
  o.cluster = sim::load_cluster("pcie-a30x1");
  SimCluster cluster(o);
  SimOverlap out;
  cluster.run([&](Backend& b, Communicator& c) {
    register_builtin_impls();
    ModelConfig m = config(2, false);
    m.d_model = 768;
    m.d_hidden = 3072;
    m.capacity_factor = 2.0;
    m.dtype = DType::bf16;
    auto layer = make_impl(impl, b, c, m, options);
    Tensor x = b.empty({4096, m.d_model}, m.dtype, MemCategory::activations, layer->layer().compute_stream());
    c.barrier();
    b.clear_timeline();
    Tensor y = layer->forward(x);
    b.synchronize();
    c.barrier();
    if (c.rank() != 0) return;
    const auto tl = b.timeline();
    for (const auto& a : tl) {
      if (a.cost.kind != OpKind::collective) continue;
      ++out.collectives;
      out.comm_s += a.end - a.start;
      for (const auto& g : tl)
        if (g.cost.kind == OpKind::gemm && g.phase == "experts")
          out.hidden_s += std::max(0.0, std::min(a.end, g.end) - std::max(a.start, g.start));
    }
  });
  return out;
}

TEST(TopKSim, PipelinedOverlapsTheAllToAllsWithTheExperts) {
  const SimOverlap piped = sim_overlap("top2-pipelined", {{"chunks", 4}});
  const SimOverlap plain = sim_overlap("top2", json::object());
  std::printf("top2-pipelined (4 chunks) on pcie-a30x1, rank 0 forward: %.1f of %.1f us of all-to-all beside expert GEMMs\n",
              piped.hidden_s * 1e6, piped.comm_s * 1e6);
  EXPECT_EQ(piped.collectives, 8);
  EXPECT_EQ(plain.collectives, 2);
  EXPECT_GT(piped.hidden_s, 0.2 * piped.comm_s);
  EXPECT_EQ(plain.hidden_s, 0.0);
}

// ---- 4. model FLOPs --------------------------------------------------------------------------
TEST(TopK, ModelFlopsCountTheBaselinesK) {
  register_builtin_impls();
  TransformerConfig t;
  t.name = "topk";
  t.origin = "<test>";
  t.d_model = 16;
  t.num_heads = 2;
  t.num_kv_heads = 2;
  t.d_ffn = 32;
  t.num_layers = 2;
  t.seq_len = 8;
  t.vocab_size = 20;
  t.moe_layers = MoELayers::every_second;
  t.moe = config(2, false);
  t.moe.d_model = 16;
  auto b = make_backend("cpu");
  auto comm = make_self_communicator(*b);
  ModelOptions two, one;
  one.impl = "top1";
  const double f2 = Model(*b, *comm, t, two).model_flops(100), f1 = Model(*b, *comm, t, one).model_flops(100);
  EXPECT_NEAR(f2 - f1, 6.0 * 100 * 2.0 * 16 * 20, 1e-6 * f2);  // one expert's FC1 + FC2 less per token
}

}  // namespace
}  // namespace moelab
