// baselines/fastermoe/fastermoe_test.cpp — FasterMoE's smart schedule, in one process:
//   1. cpu, one rank: outputs and every gradient equal FastMoE's (same seed), over two
//      forward+backward passes (events and per-step buffers reused, gradients accumulated);
//   2. bad options (group_size 3 on 4 ranks, 0, negative, not an integer, an unknown key)
//      are a ConfigError naming group_size and the value, before any work;
//   3. sim, dgx-a100x1 (8 ranks), G = 2: communication overlaps expert GEMMs on every rank;
//      FastMoE's timeline shows no such overlap.
// Multi-rank exactness (1, 2, 4 ranks, G = 1 and 2) is in harness/tests/moe_layer_mpi_test.cpp.
//   ctest --test-dir build -R fastermoe_test      (MOELAB_TEST_SEED=<n> replays a seed)
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <stdexcept>

#include "baselines/fastermoe/fastermoe.hpp"
#include "baselines/fastmoe/fastmoe.hpp"
#include "harness/backends/sim/sim_backend.hpp"
#include "harness/runtime/error.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab {
namespace {

using nlohmann::json;

ModelConfig small_config(bool noisy) {
  ModelConfig cfg;
  cfg.d_model = 12;
  cfg.d_hidden = 20;
  cfg.num_experts = 8;
  cfg.top_k = 2;
  cfg.capacity_factor = 1.0;  // some slots overflow and are dropped
  cfg.activation = Activation::gelu;
  cfg.noisy_gate = noisy;
  return cfg;
}

// ---- 1. same function as FastMoE on one rank ---------------------------------------------
struct Passes {
  std::vector<float> y, dx, dwg, dwn, dw1, dw2;
  std::vector<float> aux;
  nlohmann::json report;
};

// Two forward+backward passes of one implementation on fresh inputs [T,M] drawn from seed.
Passes two_passes(decltype(&make_fastmoe) make, const json& options, const ModelConfig& cfg, std::uint64_t seed) {
  auto b = make_backend("cpu");
  auto comm = make_self_communicator(*b);
  auto impl = make(*b, *comm, cfg, options);
  impl->init_parameters(seed);
  impl->layer().set_noise_seed(Rng::mix(seed, 5));
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
    Tensor dx = impl->backward(dy, 0.3f);  // no zero_grad: the second pass accumulates
    b->synchronize();
    const auto yh = b->download(y), dxh = b->download(dx);
    r.y.insert(r.y.end(), yh.begin(), yh.end());
    r.dx.insert(r.dx.end(), dxh.begin(), dxh.end());
  }
  r.dwg = b->download(impl->grads().w_gate);
  if (cfg.noisy_gate) r.dwn = b->download(impl->grads().w_noise);
  r.dw1 = b->download(impl->grads().w1);
  r.dw2 = b->download(impl->grads().w2);
  r.report = impl->report();
  return r;
}

class SameAsFastMoE : public ::testing::TestWithParam<std::tuple<bool, json>> {};

TEST_P(SameAsFastMoE, OutputsAndEveryGradient) {
  const auto& [noisy, options] = GetParam();
  const ModelConfig cfg = small_config(noisy);
  const std::uint64_t seed = test::fresh_seed();
  const Passes ref = two_passes(make_fastmoe, json::object(), cfg, seed);
  const Passes got = two_passes(make_fastermoe, options, cfg, seed);
  const double rtol = 1e-5;
  EXPECT_TRUE(test::all_close("y", got.y, test::to_double(ref.y), rtol));
  EXPECT_TRUE(test::all_close("aux", got.aux, test::to_double(ref.aux), rtol));
  EXPECT_TRUE(test::all_close("dx", got.dx, test::to_double(ref.dx), rtol));
  EXPECT_TRUE(test::all_close("dW_gate", got.dwg, test::to_double(ref.dwg), rtol));
  if (noisy) {
    EXPECT_TRUE(test::all_close("dW_noise", got.dwn, test::to_double(ref.dwn), rtol));
  }
  EXPECT_TRUE(test::all_close("dW1", got.dw1, test::to_double(ref.dw1), rtol));
  EXPECT_TRUE(test::all_close("dW2", got.dw2, test::to_double(ref.dw2), rtol));
  // One rank is one group of one: a single step whatever G was asked for.
  EXPECT_EQ(got.report["schedule"], "FasterMoE smart schedule");
  EXPECT_EQ(got.report["group_size"], 1);
  EXPECT_EQ(got.report["steps"], 1);
}

INSTANTIATE_TEST_SUITE_P(Options, SameAsFastMoE,
                         ::testing::Combine(::testing::Bool(),
                                            ::testing::Values(json::object(), json{{"group_size", 1}},
                                                              json{{"as_published", true}})),
                         [](const auto& tp) {
                           const json& o = std::get<1>(tp.param);
                           return std::string(std::get<0>(tp.param) ? "noisy" : "plain") +
                                  (o.empty() ? "_default" : o.contains("as_published") ? "_as_published" : "_group_size_1");
                         });

TEST(FasterMoEReport, AWorldSmallerThanTheGroupIsOneGroupAndSaysSo) {
  auto b = make_backend("cpu");
  auto comm = make_self_communicator(*b);
  auto impl = make_fastermoe(*b, *comm, small_config(false), json::object());  // default G = 4
  const json r = impl->report();
  EXPECT_EQ(r["group_size"], 1);
  EXPECT_EQ(r["steps"], 1);
  EXPECT_EQ(r["group_size_requested"], 4);
  EXPECT_NE(r["note"].get<std::string>().find("smaller than group_size 4"), std::string::npos) << r.dump();
}

// ---- 2. bad options: ConfigError before any work -----------------------------------------
// A world of `n` ranks on which any work at all (a collective, a dup for the layer's
// channels) is a test failure: the options must be rejected before the layer is built.
class NoWorkCommunicator final : public Communicator {
 public:
  explicit NoWorkCommunicator(int n) : n_(n) {}
  int rank() const override { return 0; }
  int size() const override { return n_; }
  std::string kind() const override { return "none"; }
  std::unique_ptr<Communicator> dup() override { fail("dup"); }
  void all_to_all_v(Stream&, const Tensor&, std::span<const Segment>, Tensor&, std::span<const Segment>) override {
    fail("all_to_all_v");
  }
  void all_gather(Stream&, const Tensor&, Tensor&) override { fail("all_gather"); }
  void reduce_scatter(Stream&, const Tensor&, Tensor&) override { fail("reduce_scatter"); }
  void all_reduce(Stream&, Tensor&) override { fail("all_reduce"); }
  void send(Stream&, const Tensor&, int) override { fail("send"); }
  void recv(Stream&, Tensor&, int) override { fail("recv"); }
  void barrier() override { fail("barrier"); }
  std::vector<std::int64_t> exchange_counts(const std::vector<std::int64_t>&) override { fail("exchange_counts"); }
  double all_reduce_max(double) override { fail("all_reduce_max"); }
  double all_reduce_sum(double) override { fail("all_reduce_sum"); }
  std::vector<std::string> all_gather_strings(const std::string&) override { fail("all_gather_strings"); }

 private:
  [[noreturn]] static void fail(const char* what) {
    throw std::logic_error(std::string("work before the options were checked: ") + what);
  }
  int n_;
};

TEST(FasterMoEOptions, BadGroupSizeIsAConfigErrorNamingItBeforeAnyWork) {
  struct Bad {
    int world;
    json options;
    std::vector<std::string> says;  // substrings of the message
  };
  const std::vector<Bad> cases = {
      {4, {{"group_size", 3}}, {"group_size = 3", "does not divide", "world size 4"}},
      {8, {{"group_size", 3}}, {"group_size = 3", "world size 8"}},
      {6, json::object(), {"group_size = 4", "world size 6"}},  // the default must divide too
      {4, {{"group_size", 0}}, {"group_size = 0", "positive integer"}},
      {4, {{"group_size", -2}}, {"group_size = -2", "positive integer"}},
      {4, {{"group_size", 2.5}}, {"group_size = 2.5", "positive integer"}},
      {4, {{"group_size", "2"}}, {"group_size = \"2\"", "positive integer"}},
      {4, {{"group_size", true}}, {"group_size = true", "positive integer"}},
      {4, {{"group_size", nullptr}}, {"group_size = null", "positive integer"}},
      {4, {{"group_sise", 2}}, {"\"group_sise\" = 2", "group_size"}},
      {4, {{"group_size", 2}, {"overlap", 1}}, {"\"overlap\" = 1", "group_size"}},
      {4, json::array({2}), {"[2]", "group_size"}},
  };
  auto b = make_backend("cpu");
  for (const Bad& c : cases) {
    SCOPED_TRACE("world " + std::to_string(c.world) + ", options " + c.options.dump());
    NoWorkCommunicator comm(c.world);
    ModelConfig cfg = small_config(false);
    cfg.num_experts = 24;  // divisible by every world above
    try {
      auto impl = make_fastermoe(*b, comm, cfg, c.options);
      ADD_FAILURE() << "accepted";
    } catch (const ConfigError& e) {
      const std::string msg = e.what();
      for (const auto& s : c.says) EXPECT_NE(msg.find(s), std::string::npos) << "message: " << msg;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a ConfigError: " << e.what();
    }
    EXPECT_EQ(b->memory().in_use_total(), 0u) << "memory was allocated";
  }
  // 2.0 is the integer 2, as in every file moelab reads (JSON has one number type).
  auto self = make_self_communicator(*b);
  EXPECT_NO_THROW(make_fastermoe(*b, *self, small_config(false), {{"group_size", 2.0}}));
}

// ---- 4. sim: as published (laekov/fastmoe v1.0.0), G = 2 on 8 ranks --------------------
// Rank 0's timeline of one forward+backward: the collectives in their order, the experts'
// GEMM calls, the copies of the per-(step, expert) callbacks, the host waits.
struct PublishedRun {
  std::string comm_order;
  int collectives = 0;
  std::map<std::string, int> gemm_calls;
  int copies = 0;
  double last_s_end = 0, first_r_start = 0;  // forward: the last dispatch exchange, the first combine
  std::int64_t nonempty_chunks = 0;
  json report;
};

PublishedRun sim_published(const json& options, int El_expected) {
  SimOptions o;
  o.cluster = sim::load_cluster("dgx-a100x1");
  SimCluster cluster(o);
  PublishedRun out;
  std::vector<OpRecord> tl0;
  std::vector<std::vector<std::int64_t>> rows;
  cluster.run([&](Backend& b, Communicator& c) {
    ModelConfig m;
    m.d_model = 1024;
    m.d_hidden = 4096;
    m.num_experts = 8 * El_expected;
    m.top_k = 2;
    m.capacity_factor = 1.25;
    auto impl = make_fastermoe(b, c, m, options);
    Stream& s = impl->layer().compute_stream();
    Tensor x = b.empty({8192, m.d_model}, DType::f32, MemCategory::activations, s);
    c.barrier();
    b.clear_timeline();
    Tensor y = impl->forward(x);
    const std::vector<GemmProblem> gemms = c.rank() == 0 ? impl->expert_gemms() : std::vector<GemmProblem>{};
    b.synchronize();
    c.barrier();
    Tensor dx = impl->backward(y, 0.0f);
    b.synchronize();
    c.barrier();
    if (c.rank() == 0) {
      tl0 = b.timeline();
      out.report = impl->report();
      out.nonempty_chunks = static_cast<std::int64_t>(gemms.size()) / 6;  // six per (chunk, expert with rows)
    }
  });
  std::vector<OpRecord> coll;
  for (const auto& a : tl0) {
    if (a.cost.kind == OpKind::collective) coll.push_back(a);
    if (a.cost.kind == OpKind::gemm && a.phase == "experts") ++out.gemm_calls[a.name];
    if (a.name == "copy") ++out.copies;
  }
  std::stable_sort(coll.begin(), coll.end(), [](const OpRecord& a, const OpRecord& b) { return a.start < b.start; });
  bool seen_r = false;
  for (const auto& a : coll) {
    const char k = a.phase == "dispatch" ? 'D' : a.phase == "combine" ? 'C' : '?';
    out.comm_order += k;
    if (!seen_r && k == 'D') out.last_s_end = std::max(out.last_s_end, a.end);
    if (!seen_r && k == 'C') {
      seen_r = true;
      out.first_r_start = a.start;
    }
  }
  out.collectives = static_cast<int>(coll.size());
  return out;
}

TEST(FasterMoEAsPublishedSim, SThenCThenROnOneStreamPerStepAndExpert) {
  const int W = 8, G = 2, n_g = W / G;
  for (int El : {1, 2}) {
    SCOPED_TRACE("El = " + std::to_string(El));
    const PublishedRun pub = sim_published({{"group_size", G}, {"as_published", true}}, El);
    EXPECT_EQ(pub.report["steps"], n_g);
    const int groups = n_g * El;  // NCCL groups per exchange: one per (step, local expert)
    // Forward: the count exchange, every S, then every R; backward (gradients of the outputs
    // first): every S' (combine side), then every R' (dispatch side). smart_schedule.h:139-229, :289-374.
    EXPECT_EQ(pub.collectives, 1 + 4 * groups);
    EXPECT_EQ(pub.comm_order, "D" + std::string(groups, 'D') + std::string(groups, 'C') + std::string(groups, 'C') +
                                  std::string(groups, 'D'));
    // No R before the last S is done (one stream, S loop first).
    EXPECT_GE(pub.first_r_start, pub.last_s_end);
    // One call per linear per (step, expert) with rows, and one copy forward and one backward each.
    ASSERT_GT(pub.nonempty_chunks, 0);
    for (const char* n : {"fc1", "fc2", "fc2_dgrad", "fc2_wgrad", "fc1_wgrad", "fc1_dgrad"})
      EXPECT_EQ(pub.gemm_calls.count(n) ? pub.gemm_calls.at(n) : 0, pub.nonempty_chunks) << n;
    EXPECT_EQ(pub.copies, 2 * pub.nonempty_chunks);
    // prepare_forward's host waits only: the smart schedule has none of its own.
    EXPECT_EQ(pub.report["host_waits"].get<std::vector<std::string>>(), fastmoe_published_prepare_forward_waits());
  }
}

// ---- 3. sim: the overlap the schedule exists for -----------------------------------------
// Per rank: does some collective's interval intersect an experts-phase GEMM's interval?
// Also the communication time hidden that way, summed over the ops of rank 0.
struct Overlap {
  std::vector<bool> per_rank;
  double hidden_s = 0, comm_s = 0;
  std::string comm_order;  // rank 0's collectives in time order: D dispatch, C combine
  nlohmann::json report;
};

Overlap sim_overlap(decltype(&make_fastmoe) make, const json& options) {
  SimOptions o;
  o.cluster = sim::load_cluster("dgx-a100x1");
  SimCluster cluster(o);
  Overlap out;
  out.per_rank.assign(static_cast<std::size_t>(cluster.size()), false);
  std::vector<std::vector<OpRecord>> tl(static_cast<std::size_t>(cluster.size()));
  cluster.run([&](Backend& b, Communicator& c) {
    ModelConfig m;
    m.d_model = 1024;
    m.d_hidden = 4096;
    m.num_experts = 16;
    m.top_k = 2;
    m.capacity_factor = 1.25;
    auto impl = make(b, c, m, options);
    Stream& s = impl->layer().compute_stream();
    Tensor x = b.empty({8192, m.d_model}, DType::f32, MemCategory::activations, s);
    c.barrier();
    b.clear_timeline();
    Tensor y = impl->forward(x);
    Tensor dx = impl->backward(y, 0.0f);
    b.synchronize();
    c.barrier();
    tl[static_cast<std::size_t>(c.rank())] = b.timeline();
    if (c.rank() == 0) out.report = impl->report();
  });
  std::vector<OpRecord> coll0;
  for (const auto& a : tl[0])
    if (a.cost.kind == OpKind::collective) coll0.push_back(a);
  std::stable_sort(coll0.begin(), coll0.end(), [](const OpRecord& a, const OpRecord& b) { return a.start < b.start; });
  for (const auto& a : coll0) out.comm_order += a.phase == "dispatch" ? 'D' : a.phase == "combine" ? 'C' : '?';
  for (std::size_t r = 0; r < tl.size(); ++r) {
    for (const auto& a : tl[r]) {
      if (a.cost.kind != OpKind::collective) continue;
      if (r == 0) out.comm_s += a.end - a.start;
      for (const auto& g : tl[r]) {
        if (g.cost.kind != OpKind::gemm || g.phase != "experts") continue;
        const double lo = std::max(a.start, g.start), hi = std::min(a.end, g.end);
        if (lo < hi) {
          out.per_rank[r] = true;
          if (r == 0) out.hidden_s += hi - lo;
        }
      }
    }
  }
  return out;
}

TEST(FasterMoESim, CommunicationOverlapsExpertComputeFastMoEDoesNot) {
  const Overlap faster = sim_overlap(make_fastermoe, {{"group_size", 2}});
  EXPECT_EQ(faster.report["group_size"], 2);
  EXPECT_EQ(faster.report["steps"], 4);
  for (std::size_t r = 0; r < faster.per_rank.size(); ++r) EXPECT_TRUE(faster.per_rank[r]) << "rank " << r;
  EXPECT_GT(faster.hidden_s, 0.0);
  // The communication stream, n_g = 4. Forward S0 S1 R0 S2 R1 S3 R2 R3; backward (combine
  // backward first) R'0 R'1 S'0 R'2 S'1 R'3 S'2 S'3.
  EXPECT_EQ(faster.comm_order, "DDCDCDCC" "CCDCDCDD");
  std::printf("fastermoe G=2 on dgx-a100x1, rank 0: %.1f of %.1f us of collectives overlap expert GEMMs\n",
              faster.hidden_s * 1e6, faster.comm_s * 1e6);

  const Overlap plain = sim_overlap(make_fastmoe, json::object());
  for (std::size_t r = 0; r < plain.per_rank.size(); ++r) EXPECT_FALSE(plain.per_rank[r]) << "rank " << r;
  EXPECT_EQ(plain.comm_order, "DC" "CD");
}

}  // namespace
}  // namespace moelab
