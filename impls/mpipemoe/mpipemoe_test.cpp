// impls/mpipemoe/mpipemoe_test.cpp — MPipeMoE's pipelined layer computes exactly the
// unpipelined layer's function (n = 1 bit for bit; n > 1 to fp32 summation order), its
// granularity search follows Algorithm 1, bad options are clear errors, and on a simulated
// DGX A100 the pipeline overlaps communication with the experts.
//   ctest --test-dir build -R mpipemoe
#include <gtest/gtest.h>

#include "harness/backends/sim/sim_backend.hpp"
#include "harness/metrics/overlap.hpp"
#include "harness/nn/moe_impl.hpp"
#include "harness/runtime/error.hpp"
#include "harness/tests/test_util.hpp"
#include "impls/mpipemoe/granularity.hpp"

namespace moelab {
namespace {

ModelConfig model() {
  ModelConfig m;
  m.d_model = 12;
  m.d_hidden = 20;
  m.num_experts = 6;
  m.top_k = 2;
  m.capacity_factor = 1.0;  // some slots overflow and are dropped
  m.renormalize = true;
  return m;
}

struct Outputs {
  std::vector<float> y, dx, dwg, dw1, dw2;
};

Outputs run(const std::string& impl, const nlohmann::json& options, std::int64_t T, std::uint64_t seed) {
  auto b = make_backend("cpu");
  auto comm = make_self_communicator(*b);
  register_builtin_impls();
  auto layer = make_impl(impl, *b, *comm, model(), options);
  layer->init_parameters(seed);
  Stream& s = b->default_stream();
  Tensor x = b->empty({T, 12}, DType::f32, MemCategory::activations, s);
  Tensor dy = b->empty({T, 12}, DType::f32, MemCategory::activations, s);
  b->upload(test::uniform(static_cast<std::size_t>(T * 12), Rng::mix(seed, 1)), x);
  b->upload(test::uniform(static_cast<std::size_t>(T * 12), Rng::mix(seed, 2)), dy);
  Tensor y = layer->forward(x);
  Tensor dx = layer->backward(dy, 0.3f);
  b->synchronize();
  return {b->download(y), b->download(dx), b->download(layer->grads().w_gate), b->download(layer->grads().w1),
          b->download(layer->grads().w2)};
}

TEST(MPipeMoE, OnePartitionIsFastMoEBitForBit) {
  const std::uint64_t seed = test::fresh_seed();
  const Outputs a = run("fastmoe", {}, 37, seed), b = run("mpipemoe", {{"partitions", 1}}, 37, seed);
  EXPECT_EQ(a.y, b.y);
  EXPECT_EQ(a.dx, b.dx);
  EXPECT_EQ(a.dwg, b.dwg);
  EXPECT_EQ(a.dw1, b.dw1);
  EXPECT_EQ(a.dw2, b.dw2);
}

TEST(MPipeMoE, PartitionsComputeTheSameFunction) {
  const std::uint64_t seed = test::fresh_seed();
  const Outputs a = run("fastmoe", {}, 37, seed);
  for (int n : {2, 3, 5, 37}) {
    const Outputs b = run("mpipemoe", {{"partitions", n}}, 37, seed);
    SCOPED_TRACE("n = " + std::to_string(n));
    // Forward: the same rows through the same GEMMs, in other groupings: equal.
    EXPECT_TRUE(test::all_close("y", b.y, test::to_double(a.y), 1e-6));
    EXPECT_TRUE(test::all_close("dx", b.dx, test::to_double(a.dx), 1e-5));
    EXPECT_TRUE(test::all_close("dW_gate", b.dwg, test::to_double(a.dwg), 1e-5));
    EXPECT_TRUE(test::all_close("dW1", b.dw1, test::to_double(a.dw1), 1e-5));  // summed per partition
    EXPECT_TRUE(test::all_close("dW2", b.dw2, test::to_double(a.dw2), 1e-5));
  }
}

TEST(MPipeMoE, BadOptionsAreClearErrors) {
  auto b = make_backend("cpu");
  auto comm = make_self_communicator(*b);
  auto expect_error = [&](const nlohmann::json& o, const std::string& needle) {
    try {
      make_impl("mpipemoe", *b, *comm, model(), o);
      ADD_FAILURE() << "no error for " << o.dump();
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  register_builtin_impls();
  expect_error({{"partitions", 0}}, "partitions = 0");
  expect_error({{"partitions", "many"}}, "partitions = \"many\"");
  expect_error({{"partitons", 2}}, "unknown option \"partitons\"");
  expect_error({{"max_partitions", -4}}, "max_partitions = -4");
  // More partitions than tokens: refused when the tokens are known, before any work.
  auto layer = make_impl("mpipemoe", *b, *comm, model(), {{"partitions", 8}});
  Tensor x = b->empty({5, 12}, DType::f32, MemCategory::activations, b->default_stream());
  b->fill_zero(b->default_stream(), x);
  try {
    layer->forward(x);
    ADD_FAILURE() << "no error for 8 partitions of 5 tokens";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("partitions = 8"), std::string::npos) << e.what();
  }
}

// Algorithm 1 with a synthetic cost: t(n, B) = B/n*(1 + ...) with its best n rising with B.
TEST(GranularitySearch, TrialsOnAMissThenRangesAndCache) {
  GranularitySearch g(16, 64);
  auto cost = [](std::int64_t B) {
    return [B](int n) {  // pipelining gain vs per-partition overhead: best n ~ sqrt(B/256)
      return static_cast<double>(B) / n + 256.0 * n;
    };
  };
  const int n1 = g.choose(1024, cost(1024));  // best: n=2 (1024/2+512 = 1024 = n=1's 1280?)
  EXPECT_EQ(g.decisions().back().how, "trials");
  EXPECT_EQ(n1, 2);
  const int n2 = g.choose(16384, cost(16384));  // best 8: 2048+2048=4096 vs 4:4096+1024=5120, 16: 1024+4096
  EXPECT_EQ(n2, 8);
  // Trials for 16384 started at the lower bound set by the range below (n = 2), not at 1.
  EXPECT_EQ(g.decisions().back().trials.front().n, 2);
  EXPECT_EQ(g.choose(16384, cost(16384)), 8);
  EXPECT_EQ(g.decisions().back().how, "cache");
  const int n3 = g.choose(1100, cost(1100));  // joins the n=2 range [1024, 1100]
  EXPECT_EQ(n3, 2);
  const auto r = g.ranges();
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0][0], 1024);
  EXPECT_EQ(r[0][1], 1100);
  EXPECT_EQ(r[0][2], 2);
  EXPECT_EQ(g.choose(1050, [](int) -> double { throw std::logic_error("no trial expected"); }), 2);
  EXPECT_EQ(g.decisions().back().how, "range");
  // The fewest tokens per partition caps n: 100 tokens, 64 per partition -> n = 1.
  GranularitySearch small(16, 64);
  EXPECT_EQ(small.choose(100, [](int n) { return 1.0 / n; }), 1);
}

// On a simulated DGX A100 (8 ranks) the pipeline overlaps all-to-alls with expert GEMMs and
// shortens the step; the unpipelined layer overlaps nothing.
TEST(MPipeMoE, OverlapsCommunicationOnASimulatedCluster) {
  auto step = [](const std::string& impl, const nlohmann::json& options, double* overlap) {
    SimOptions o;
    o.cluster = sim::load_cluster("dgx-a100x1");
    SimCluster cluster(o);
    double t = 0, ov = 0;
    cluster.run([&](Backend& b, Communicator& c) {
      ModelConfig m;
      m.d_model = 1024;
      m.d_hidden = 4096;
      m.num_experts = 8;
      m.top_k = 1;
      m.dtype = DType::bf16;
      register_builtin_impls();
      auto layer = make_impl(impl, b, c, m, options);
      Tensor x = b.empty({16384, m.d_model}, m.dtype, MemCategory::activations, b.default_stream());
      c.barrier();
      b.clear_timeline();
      const double t0 = b.now();
      Tensor y = layer->forward(x);
      Tensor dx = layer->backward(y, 0.0f);
      b.synchronize();
      c.barrier();
      if (c.rank() == 0) {
        t = b.now() - t0;
        ov = overlap_figures(b.timeline()).overlap_ratio();
      }
    });
    *overlap = ov;
    return t;
  };
  double ov1 = 0, ov4 = 0;
  const double t1 = step("mpipemoe", {{"partitions", 1}}, &ov1);
  const double t4 = step("mpipemoe", {{"partitions", 4}}, &ov4);
  EXPECT_LT(ov1, 0.01);
  EXPECT_GT(ov4, 0.3);
  EXPECT_LT(t4, t1);
}

}  // namespace
}  // namespace moelab
