// baselines/fastmoe/fastmoe_test.cpp — FastMoE, ideal and {"as_published": true}:
//   1. cpu, one rank: the as-published variant computes what the ideal one does (outputs and
//      every gradient, two forward+backward passes), and its host waits come in the order of
//      laekov/fastmoe v1.0.0 (README.md, "As published");
//   2. bad options are a ConfigError naming the option;
//   3. sim, dgx-a100x1 (8 ranks, El = E / W local experts): per forward+backward, the
//      collectives (1 count exchange + one per local expert per exchange) in their order on
//      the communication stream, one GEMM call per expert and linear, and no overlap of
//      communication and expert GEMMs; the ideal form: four all-to-alls, grouped GEMM calls.
//   ctest --test-dir build -R fastmoe_test      (MOELAB_TEST_SEED=<n> replays a seed)
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <map>

#include "baselines/fastmoe/fastmoe.hpp"
#include "harness/backends/cpu/cpu_backend.hpp"
#include "harness/backends/sim/sim_backend.hpp"
#include "harness/runtime/error.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab {
namespace {

using nlohmann::json;

ModelConfig small_config() {
  ModelConfig cfg;
  cfg.d_model = 12;
  cfg.d_hidden = 20;
  cfg.num_experts = 8;
  cfg.top_k = 2;
  cfg.capacity_factor = 1.0;
  cfg.activation = Activation::gelu;
  return cfg;
}

struct Passes {
  std::vector<float> y, dx, dwg, dw1, dw2, aux;
  json report;
};

Passes two_passes(const json& options, std::uint64_t seed, bool poison = false, bool pad_only_wgrad = false,
                  Activation act = Activation::gelu) {
  ModelConfig cfg = small_config();
  cfg.activation = act;
  auto b = make_backend("cpu");
  cpu_poison_new_memory(*b, poison);
  cpu_pad_only_weight_gradients(*b, pad_only_wgrad);
  auto comm = make_self_communicator(*b);
  auto impl = make_fastmoe(*b, *comm, cfg, options);
  impl->init_parameters(seed);
  // Stale gradients (NaN) that zero_grad must make no matter: the first pass's weight-gradient
  // calls write the experts' slices (one call per expert as published, one for all ideally).
  for (Tensor* g : {&impl->grads().w_gate, &impl->grads().w1, &impl->grads().w2})
    b->upload(std::vector<float>(static_cast<std::size_t>(g->numel()), std::numeric_limits<float>::quiet_NaN()), *g);
  impl->zero_grad();
  Stream& s = impl->layer().compute_stream();
  const std::int64_t T = 41, M = cfg.d_model;
  Passes r;
  for (int pass = 0; pass < 2; ++pass) {
    Tensor x = b->empty({T, M}, cfg.dtype, MemCategory::activations, s);
    Tensor dy = b->empty({T, M}, cfg.dtype, MemCategory::activations, s);
    b->upload(test::uniform(static_cast<std::size_t>(T * M), Rng::mix(seed, 10 + pass)), x);
    b->upload(test::uniform(static_cast<std::size_t>(T * M), Rng::mix(seed, 20 + pass)), dy);
    Tensor y = impl->forward(x);
    r.aux.push_back(impl->aux_loss());
    Tensor dx = impl->backward(dy, 0.3f);
    b->synchronize();
    const auto yh = b->download(y), dxh = b->download(dx);
    r.y.insert(r.y.end(), yh.begin(), yh.end());
    r.dx.insert(r.dx.end(), dxh.begin(), dxh.end());
  }
  r.dwg = b->download(impl->grads().w_gate);
  r.dw1 = b->download(impl->grads().w1);
  r.dw2 = b->download(impl->grads().w2);
  r.report = impl->report();
  return r;
}

// The host waits of one forward and its backward, as v1.0.0 issues them: prepare_forward's
// (fmoe/functions.py:28-75), then global_scatter's (cuda/global_exchange.h:55), one per linear
// (cuda/parallel_linear.cuh:87), global_gather's (:101); backward MOEGather.backward's
// global_scatter (functions.py:184), the two linears' (:160), MOEScatter.backward's
// global_gather (functions.py:132). The issuer names an exchange by its step: the combine
// backward is "combine", the dispatch backward "dispatch".
std::vector<std::string> published_host_waits() {
  std::vector<std::string> w = fastmoe_published_prepare_forward_waits();
  for (const char* s : {"dispatch", "linear", "linear", "combine", "combine", "linear", "linear", "dispatch"})
    w.push_back(s);
  return w;
}

TEST(FastMoEAsPublished, SameNumbersAsTheIdealForm) {
  const std::uint64_t seed = test::fresh_seed();
  const Passes ideal = two_passes(json::object(), seed);
  const Passes pub = two_passes({{"as_published", true}}, seed);
  // The same GEMMs on the same rows, in the same order per element: bit-identical.
  EXPECT_EQ(pub.y, ideal.y);
  EXPECT_EQ(pub.dx, ideal.dx);
  EXPECT_EQ(pub.aux, ideal.aux);
  EXPECT_EQ(pub.dwg, ideal.dwg);
  EXPECT_EQ(pub.dw1, ideal.dw1);
  EXPECT_EQ(pub.dw2, ideal.dw2);
  EXPECT_EQ(pub.report["as_published"], "laekov/fastmoe v1.0.0");
  EXPECT_EQ(pub.report["host_waits"].get<std::vector<std::string>>(), published_host_waits());
  EXPECT_FALSE(ideal.report.contains("as_published"));
  EXPECT_EQ(two_passes({{"as_published", false}}, seed).y, ideal.y);
}

// The padded expert layout computes what the packed one does: the cpu backend runs a padded
// call over the padded rows (as one strided batch on a GPU would), so a padding row that is not
// zero would show in the weight gradients.
// Equal up to fp32 summation order: the padded GEMMs are longer.
TEST(FastMoEPadded, SameNumbersAsThePackedLayout) {
  const std::uint64_t seed = test::fresh_seed();
  // Fresh memory starts as NaN, so that a padding row left unwritten shows as NaN. Both ways
  // a GPU may run the calls: every GEMM over the padded rows, or only the weight gradients
  // (the others over their own rows leave their outputs' padding rows unwritten).
  // The tanh GeLU runs in the GEMMs' epilogue (FC1 writes T_M and A, FC2's dgrad dT_M): its
  // outputs' padding rows too must come out zero.
  for (const Activation act : {Activation::gelu, Activation::gelu_tanh})
  for (const bool only_wgrad : {false, true}) {
    SCOPED_TRACE(std::string(activation_name(act)) + (only_wgrad ? ": only the weight gradients padded" : ": every GEMM padded"));
    const Passes packed = two_passes(json::object(), seed, true, false, act);
    const Passes padded = two_passes({{"expert_layout", "padded"}}, seed, true, only_wgrad, act);
    const auto near = [](const std::vector<float>& a, const std::vector<float>& b, const char* what) {
      ASSERT_EQ(a.size(), b.size()) << what;
      for (std::size_t i = 0; i < a.size(); ++i)
        ASSERT_NEAR(a[i], b[i], 1e-5f * (1.0f + std::abs(b[i]))) << what << "[" << i << "]";
    };
    near(padded.y, packed.y, "y");
    near(padded.dx, packed.dx, "dx");
    near(padded.dwg, packed.dwg, "dw_gate");
    near(padded.dw1, packed.dw1, "dw1");
    near(padded.dw2, packed.dw2, "dw2");
    EXPECT_EQ(padded.report["expert_layout"], "padded");
    EXPECT_FALSE(packed.report.contains("expert_layout"));
  }
}

TEST(FastMoEOptions, BadOptionsAreAConfigErrorNamingThem) {
  auto b = make_backend("cpu");
  auto comm = make_self_communicator(*b);
  for (const json& bad : {json{{"as_published", 1}}, json{{"as_publish", true}}, json{{"group_size", 2}},
                          json::array({true}), json{{"expert_layout", "pad"}},
                          json{{"as_published", true}, {"expert_layout", "padded"}}}) {
    SCOPED_TRACE(bad.dump());
    try {
      make_fastmoe(*b, *comm, small_config(), bad);
      ADD_FAILURE() << "accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("fastmoe"), std::string::npos) << e.what();
    }
  }
}

// ---- 3. sim ------------------------------------------------------------------------------
struct SimRun {
  std::string comm_order;                 // rank 0's collectives by start: D dispatch, C combine
  int collectives = 0;
  std::map<std::string, int> gemm_calls;  // experts-phase GEMM ops of rank 0 by name
  std::map<std::string, std::int64_t> gemm_launches;
  bool overlap = false;                   // a collective intersects an experts GEMM (any rank)
  std::int64_t nonempty = 0;              // local experts of rank 0 with rows
  json report;
};

SimRun sim_run(const json& options, ModelConfig& m) {
  SimOptions o;
  o.cluster = sim::load_cluster("dgx-a100x1");
  SimCluster cluster(o);
  SimRun out;
  std::vector<std::vector<OpRecord>> tl(static_cast<std::size_t>(cluster.size()));
  m.d_model = 1024;
  m.d_hidden = 4096;
  m.num_experts = 16;
  m.top_k = 2;
  m.capacity_factor = 1.25;
  cluster.run([&](Backend& b, Communicator& c) {
    auto impl = make_fastmoe(b, c, m, options);
    Stream& s = impl->layer().compute_stream();
    Tensor x = b.empty({8192, m.d_model}, DType::f32, MemCategory::activations, s);
    c.barrier();
    b.clear_timeline();
    Tensor y = impl->forward(x);
    Tensor dx = impl->backward(y, 0.0f);
    b.synchronize();
    c.barrier();
    tl[static_cast<std::size_t>(c.rank())] = b.timeline();
    if (c.rank() == 0) {
      out.report = impl->report();
      for (auto r : impl->layer().routing().recv_per_local) out.nonempty += r > 0;
    }
  });
  std::vector<OpRecord> coll;
  for (const auto& a : tl[0]) {
    if (a.cost.kind == OpKind::collective) coll.push_back(a);
    if (a.cost.kind == OpKind::gemm && a.phase == "experts") {
      ++out.gemm_calls[a.name];
      out.gemm_launches[a.name] += a.cost.launches;
    }
  }
  std::stable_sort(coll.begin(), coll.end(), [](const OpRecord& a, const OpRecord& b) { return a.start < b.start; });
  for (const auto& a : coll) out.comm_order += a.phase == "dispatch" ? 'D' : a.phase == "combine" ? 'C' : '?';
  out.collectives = static_cast<int>(coll.size());
  for (const auto& r : tl)
    for (const auto& a : r)
      if (a.cost.kind == OpKind::collective)
        for (const auto& g : r)
          if (g.cost.kind == OpKind::gemm && g.phase == "experts" && std::max(a.start, g.start) < std::min(a.end, g.end))
            out.overlap = true;
  return out;
}

TEST(FastMoEAsPublishedSim, CollectivesGemmCallsAndOrderAreThePublishedOnes) {
  ModelConfig m;
  const SimRun pub = sim_run({{"as_published", true}}, m);
  const int W = 8;
  const int El = static_cast<int>(m.num_experts / W);
  ASSERT_EQ(El, 2);
  // Forward: the count exchange, then El groups of the scatter and El of the gather; backward:
  // El of the gather-backward's scatter, El of the scatter-backward's gather.
  EXPECT_EQ(pub.collectives, 1 + 4 * El);
  EXPECT_EQ(pub.comm_order, "D" + std::string(El, 'D') + std::string(El, 'C') + std::string(El, 'C') + std::string(El, 'D'));
  // One GEMM call per expert with rows, per linear (forward fc1, fc2; backward four).
  ASSERT_GT(pub.nonempty, 0);
  for (const char* n : {"fc1", "fc2", "fc2_dgrad", "fc2_wgrad", "fc1_wgrad", "fc1_dgrad"}) {
    EXPECT_EQ(pub.gemm_calls.count(n) ? pub.gemm_calls.at(n) : 0, pub.nonempty) << n;
    EXPECT_EQ(pub.gemm_launches.count(n) ? pub.gemm_launches.at(n) : 0, pub.nonempty) << n;
  }
  EXPECT_FALSE(pub.overlap);
  std::vector<std::string> waits = fastmoe_published_prepare_forward_waits();
  for (const char* s : {"dispatch", "linear", "linear", "combine", "combine", "linear", "linear", "dispatch"})
    waits.push_back(s);
  EXPECT_EQ(pub.report["host_waits"].get<std::vector<std::string>>(), waits);

  ModelConfig m2;
  const SimRun ideal = sim_run(json::object(), m2);
  EXPECT_EQ(ideal.collectives, 4);
  EXPECT_EQ(ideal.comm_order, "DCCD");
  for (const char* n : {"fc1", "fc2", "fc2_dgrad", "fc2_wgrad", "fc1_wgrad", "fc1_dgrad"}) {
    EXPECT_EQ(ideal.gemm_calls.count(n) ? ideal.gemm_calls.at(n) : 0, 1) << n;  // one grouped call
    EXPECT_EQ(ideal.gemm_launches.count(n) ? ideal.gemm_launches.at(n) : 0, ideal.nonempty) << n;
  }
  EXPECT_FALSE(ideal.overlap);
}

}  // namespace
}  // namespace moelab
