// harness/tests/pipeline_mpi_test.cpp — the pipeline executor on the cpu backend with MPI
// ranks as stages: every schedule (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V), with and
// without full recomputation, gives the loss and every parameter's gradient of the
// unpipelined model run one microbatch after another in one process; with data parallelism
// beside the pipeline, and tensor (and sequence) parallelism inside each stage, too; and
// optimizer steps keep the pipelined parameters (the head's copy of tied embeddings included)
// equal to the unpipelined ones.
//   mpirun --oversubscribe -np 4 build/harness/tests/pipeline_mpi_test
// A tiny 8-layer model (every second layer MoE, tied embeddings) on fresh seeds.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <ostream>

#include "harness/comm/groups.hpp"
#include "harness/comm/world.hpp"
#include "harness/nn/data.hpp"
#include "harness/nn/model.hpp"
#include "harness/pipeline/executor.hpp"
#include "harness/tests/parallel_test_util.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab {
namespace {

std::uint64_t g_seed = 0;  // agreed across ranks in main()

TransformerConfig tiny(bool tied) {
  TransformerConfig c;
  c.name = "tiny-pipeline";
  c.origin = "<test>";
  c.d_model = 32;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.d_ffn = 48;
  c.num_layers = 8;
  c.seq_len = 16;
  c.vocab_size = 40;
  c.dtype = DType::f32;
  c.tie_embeddings = tied;
  c.moe_layers = MoELayers::every_second;
  c.moe.name = "tiny-moe";
  c.moe.d_model = c.d_model;
  c.moe.d_hidden = 40;
  c.moe.num_experts = 4;
  c.moe.top_k = 2;
  c.moe.capacity_factor = 0.0;
  c.moe.dtype = DType::f32;
  return c;
}

constexpr std::int64_t kSeqs = 2;  // sequences per microbatch

// The unpipelined model in this process: every data-parallel rank's microbatches one after the
// other, the loss (sum of the microbatches' mean cross-entropies) and the gradients by name.
struct Reference {
  std::unique_ptr<Backend> b;
  std::unique_ptr<Communicator> self;
  std::unique_ptr<Model> model;
  std::unique_ptr<Optimizer> opt;
  std::vector<std::int32_t> next;
  std::uint64_t seed;
  Reference(const TransformerConfig& cfg, std::uint64_t seed_, float aux_coef) : seed(seed_) {
    b = make_backend("cpu");
    self = make_self_communicator(*b);
    model = std::make_unique<Model>(*b, *self, cfg, ModelOptions{.aux_loss_coef = aux_coef});
    model->init_parameters(seed);
    next = synthetic_successor(cfg.vocab_size, seed);
  }
  double step(int microbatches, int dp, std::uint64_t step_no, float scale) {
    model->zero_grad();
    double loss = 0;
    for (int r = 0; r < dp; ++r)
      for (int mb = 0; mb < microbatches; ++mb) {
        const auto tb = synthetic_batch(next, kSeqs, model->config().seq_len, seed, step_no, mb, r);
        Batch x;
        const auto T = static_cast<std::int64_t>(tb.ids.size());
        x.input = b->empty({T}, DType::i32, MemCategory::activations, b->default_stream());
        x.targets = b->empty({T}, DType::i32, MemCategory::activations, b->default_stream());
        b->upload_i32(tb.ids, x.input);
        b->upload_i32(tb.targets, x.targets);
        x.loss_scale = scale;
        Forwarded f = model->forward(x, {0, mb, step_no});
        loss += model->loss(*f.saved);
        model->backward_input(*f.saved, Tensor());
        model->backward_weight(*f.saved);
      }
    if (opt) opt->step();
    b->synchronize();
    return loss;
  }
  std::map<std::string, std::vector<float>> by_name(bool grads) {
    std::map<std::string, std::vector<float>> m;
    for (auto& p : model->parameters()) m[p.name] = b->download(grads ? p.grad : p.value);
    return m;
  }
};

double rel_diff(const std::vector<float>& a, const std::vector<float>& ref) {
  double scale = 1e-12, worst = 0;
  for (float v : ref) scale = std::max(scale, static_cast<double>(std::abs(v)));
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(static_cast<double>(a[i]) - ref[i]) / scale);
  return worst;
}

struct Case {
  std::string schedule;
  int chunks = 0;
  pipeline::Recompute recompute = pipeline::Recompute::none;
  int dp = 1;  // data-parallel degree beside the pipeline (pp = world / (dp·tp))
  std::int64_t bucket = 0;  // > 0: the bucketed synchroniser with buckets of this many elements
  bool zero1 = false;       // ZeRO-1 on the synchroniser (untied embeddings)
  int group = 0;            // group-interleaved's g (0: ceil(p/2))
  int offload = 0;          // PipeOffload: offload chunks < offload (-1: all), every transfer kept
  bool pad = false;         // the uneven split: p·v - 2 layers, the embedding and head chunks alone
  int tp = 1;               // tensor parallelism inside every stage (pp = world / (dp·tp))
  bool sp = false;          // with sequence parallelism
};

void PrintTo(const Case& k, std::ostream* os) {
  *os << k.schedule << " chunks " << k.chunks << " recompute " << pipeline::recompute_name(k.recompute) << " dp " << k.dp
      << " bucket " << k.bucket << (k.zero1 ? " zero1" : "") << " group " << k.group << " offload " << k.offload
      << (k.pad ? " pad" : "") << " tp " << k.tp << (k.sp ? " sp" : "");
}

// Each MoE layer's slots routed to each expert over every forward it ran (routed_totals), by
// MoE layer of the whole model (-1 where this rank holds no chunk with that layer); under
// sequence parallelism summed over the TP group (each TP rank routes its own rows).
std::vector<std::int64_t> routing(const TransformerConfig& cfg, const std::vector<Model*>& chunks, Communicator* tp) {
  std::vector<int> moe_index(static_cast<std::size_t>(cfg.num_layers), -1);  // layer -> its index among MoE layers
  int moes = 0;
  for (int l = 0; l < cfg.num_layers; ++l)
    if (cfg.is_moe(l)) moe_index[static_cast<std::size_t>(l)] = moes++;
  const auto E = static_cast<std::size_t>(cfg.moe.num_experts);
  std::vector<std::int64_t> r(static_cast<std::size_t>(moes) * E, -1);
  for (Model* c : chunks) {
    const auto layers = c->moe_layers();
    std::size_t i = 0;
    for (int l = c->first_layer(); l < cfg.num_layers && i < layers.size(); ++l) {
      if (!cfg.is_moe(l)) continue;
      auto routed = layers[i++]->layer().routed_totals();
      for (std::size_t e = 0; e < E; ++e) {
        if (tp) routed[e] = std::llround(tp->all_reduce_sum(static_cast<double>(routed[e])));
        r[static_cast<std::size_t>(moe_index[static_cast<std::size_t>(l)]) * E + e] = routed[e];
      }
    }
  }
  return r;
}

// One pipelined step (or `steps` optimizer steps) of layout pp = world/(dp·tp) against the
// reference. With tensor parallelism, fp32 sums in another order may move a gate probability
// across a near-tie and flip a token's expert: the ranks then agree on another seed (at most
// three more) whose step routes as the reference's did, and compare in full.
void check(const Case& k, int steps) {
  auto b = make_backend("cpu");
  auto world = make_world_communicator(*b);
  const int n = world->size(), w = world->rank();
  if (n % (k.dp * k.tp) != 0) GTEST_SKIP() << "dp " << k.dp << " × tp " << k.tp << " does not divide " << n << " ranks";
  TransformerConfig cfg = tiny(!k.zero1);
  ParallelLayout spec;
  spec.pp = n / (k.dp * k.tp);
  spec.dp = k.dp;
  spec.tp = k.tp;
  const GroupLayout l = check_layout(spec, n, n, cfg);
  ProcessGroups pg(*world, l, gather_nodes(*world));
  const int p = l.pp, m = 2 * p;
  pipeline::Schedule s = pipeline::make_schedule(k.schedule, p, m, k.chunks, k.group);
  if (k.pad) cfg.num_layers = std::max(s.virtual_stages() - 2, 1);  // 3p - 2 at v = 3, as the authors
  int kept = 0;
  if (k.offload != 0) {
    pipeline::OffloadOptions oo;
    oo.chunks = k.offload < 0 ? s.chunks : k.offload;
    oo.lifespan = false;  // every transfer: the most data moved and brought back
    const pipeline::OffloadPlan plan = pipeline::add_offload(s, oo);
    kept = plan.kept[static_cast<std::size_t>(pg.coords().pp)];
    // Only chunks with layers save activations (an embedding-only chunk keeps just its ids).
    bool layers = false;
    for (int c = 0; c < oo.chunks; ++c) {
      const auto r = pipeline::virtual_stage_layers(cfg, s.virtual_stages(), s.virtual_stage(pg.coords().pp, c), k.pad);
      layers = layers || r.last > r.first;
    }
    if (!layers) kept = 0;
  }
  pipeline::PipelineOptions po;
  po.tokens = kSeqs * cfg.seq_len;
  po.recompute = k.recompute;
  po.pad_layers = k.pad;
  po.model.tp = k.tp > 1 ? &pg.tp() : nullptr;
  po.model.sequence_parallel = k.sp;
  std::uint64_t seed = g_seed;
  for (int attempt = 0;; ++attempt, seed = Rng::mix(seed, 99)) {
    pipeline::PipelineStage st(*b, cfg, s, pg.pp(), pg.ep(), po);
    st.init_parameters(seed);
    st.set_gradient_sync(&pg.dp(), &pg.edp());
    if (k.bucket > 0) st.use_bucketed_sync({.bucket_elems = k.bucket, .zero1 = k.zero1});
    Reference ref(cfg, seed, po.model.aux_loss_coef);
    std::unique_ptr<Optimizer> opt;
    if (steps > 1) {
      // SGD: an update proportional to the gradient (Adam's normalisation would turn fp32
      // rounding of near-zero gradients into full-size steps of either sign).
      OptimizerConfig oc;
      oc.kind = OptimizerKind::sgd;
      oc.lr = 0.5f;
      if (k.bucket > 0) {
        st.make_optimizer(oc);  // per chunk on its synchroniser
      } else {
        opt = std::make_unique<Optimizer>(*b, st.stream(), st.parameters(), oc);
        st.set_optimizer(opt.get());
      }
      ref.opt = std::make_unique<Optimizer>(*ref.b, ref.model->stream(), ref.model->parameters(), oc);
    }
    const float scale = 1.0f / static_cast<float>(po.tokens * m * k.dp);
    const auto next = synthetic_successor(cfg.vocab_size, seed);
    bool retry = false;
    for (int step_no = 1; step_no <= steps; ++step_no) {
      std::vector<Batch> data(static_cast<std::size_t>(m));
      for (int mb = 0; mb < m; ++mb) {
        const auto tb = synthetic_batch(next, kSeqs, cfg.seq_len, seed, static_cast<std::uint64_t>(step_no), mb, pg.coords().dp);
        Batch& x = data[static_cast<std::size_t>(mb)];
        x.input = b->empty({po.tokens}, DType::i32, MemCategory::activations, b->default_stream());
        x.targets = b->empty({po.tokens}, DType::i32, MemCategory::activations, b->default_stream());
        b->upload_i32(tb.ids, x.input);
        b->upload_i32(tb.targets, x.targets);
        x.loss_scale = scale;
      }
      st.step(data, static_cast<std::uint64_t>(step_no));
      b->synchronize();
      // The schedule's transfers ran: every kept one moved bytes there and back (the stage's
      // embedding-only chunk saves nothing but its ids, which stay).
      if (kept > 0) {
        EXPECT_GT(st.offload_stats().transfers, 0) << "stage " << st.stage();
        EXPECT_GT(st.offload_stats().bytes, 0u) << "stage " << st.stage();
        EXPECT_LE(st.offload_stats().transfers, kept);
      }
      const double ref_loss = ref.step(m, k.dp, static_cast<std::uint64_t>(step_no), scale);
      if (k.tp > 1) {
        const auto got = routing(cfg, st.chunks(), k.sp ? &pg.tp() : nullptr);
        const auto want = routing(cfg, {ref.model.get()}, nullptr);
        // Full recomputation routes every forward again in its backward.
        const std::int64_t times = k.recompute == pipeline::Recompute::full ? 2 : 1;
        bool same = true;
        for (std::size_t i = 0; i < got.size(); ++i) same = same && (got[i] < 0 || got[i] == times * want[i]);
        if (world->all_reduce_max(same ? 0.0 : 1.0) != 0.0) {
          retry = attempt < 3;
          EXPECT_TRUE(retry) << "routing differs from the reference on every seed tried";
          break;
        }
      }
      // The per-token losses of the head stage of every data-parallel replica (on each of its
      // TP ranks: the vocabulary-parallel cross-entropy gives each the whole microbatch's).
      double loss = 0;
      for (const Tensor& t : st.losses()) {
        double sum = 0;
        for (float v : b->download(t)) sum += v;
        loss += sum / static_cast<double>(po.tokens);
      }
      loss = world->all_reduce_sum(pg.coords().tp == 0 ? loss : 0.0);
      EXPECT_NEAR(loss, ref_loss, 1e-5 * std::abs(ref_loss)) << "step " << step_no << " (seed " << seed << ")";
    }
    if (retry) continue;
    // Gradients (one step) or values (after SGD steps), every parameter by name, a TP-split
    // one put back together from its TP ranks' parts.
    const auto want = ref.by_name(steps == 1);
    int compared = 0;
    for (auto& prm : st.parameters()) {
      const auto it = want.find(prm.name);
      ASSERT_NE(it, want.end()) << prm.name;
      const auto got = test::full_tensor(*b, prm, steps == 1 ? prm.grad : prm.value, pg.tp(), pg.ep());
      ASSERT_EQ(got.size(), it->second.size()) << prm.name;
      EXPECT_LT(rel_diff(got, it->second), 2e-5)
          << prm.name << " on rank " << w << " (stage " << st.stage() << ", seed " << seed << ")";
      ++compared;
    }
    EXPECT_GT(compared, 0);
    // Every parameter of the model is on some stage.
    const double held = world->all_reduce_sum(pg.coords().dp == 0 && pg.coords().tp == 0 ? compared : 0);
    EXPECT_GE(held, static_cast<double>(want.size()));
    world->barrier();
    return;
  }
}

class PipelineMpi : public ::testing::TestWithParam<Case> {};

TEST_P(PipelineMpi, GivesTheLossAndGradientsOfTheUnpipelinedModel) { check(GetParam(), 1); }

INSTANTIATE_TEST_SUITE_P(
    Schedules, PipelineMpi,
    ::testing::Values(Case{"gpipe"}, Case{"1f1b"}, Case{"interleaved", 2}, Case{"zb-h1"}, Case{"zb-v"},
                      Case{"1f1b", 0, pipeline::Recompute::full}, Case{"interleaved", 2, pipeline::Recompute::full},
                      Case{"zb-v", 0, pipeline::Recompute::full}, Case{"1f1b", 0, pipeline::Recompute::selective},
                      Case{"zb-h1", 0, pipeline::Recompute::selective}, Case{"1f1b", 0, pipeline::Recompute::none, 2},
                      Case{"zb-h1", 0, pipeline::Recompute::none, 2},
                      // PipeOffload: group-interleaved, offloads of every schedule, the uneven split.
                      Case{.schedule = "group-interleaved", .chunks = 2},
                      Case{.schedule = "group-interleaved", .chunks = 3, .pad = true},
                      Case{.schedule = "group-interleaved", .chunks = 2, .offload = -1},
                      Case{.schedule = "group-interleaved", .chunks = 3, .offload = 1, .pad = true},
                      Case{.schedule = "group-interleaved", .chunks = 2, .offload = -1, .pad = true},
                      Case{.schedule = "interleaved", .chunks = 2, .offload = -1},
                      Case{.schedule = "interleaved", .chunks = 2, .pad = true},
                      Case{.schedule = "1f1b", .offload = -1}, Case{.schedule = "gpipe", .offload = -1},
                      Case{.schedule = "zb-h1", .offload = -1}, Case{.schedule = "zb-v", .offload = -1},
                      Case{.schedule = "1f1b", .recompute = pipeline::Recompute::selective, .offload = -1},
                      Case{.schedule = "group-interleaved", .chunks = 2, .dp = 2, .offload = -1},
                      // Tensor (and sequence) parallelism inside the stages.
                      Case{.schedule = "1f1b", .tp = 2}, Case{.schedule = "1f1b", .tp = 2, .sp = true},
                      Case{.schedule = "1f1b", .recompute = pipeline::Recompute::full, .tp = 2, .sp = true},
                      Case{.schedule = "interleaved", .chunks = 2, .tp = 2, .sp = true},
                      Case{.schedule = "zb-v", .tp = 2},
                      Case{.schedule = "group-interleaved", .chunks = 2, .offload = -1, .tp = 2, .sp = true}),
    [](const auto& i) {
      std::string s = i.param.schedule;
      for (auto& ch : s)
        if (ch == '-') ch = '_';
      if (i.param.recompute == pipeline::Recompute::full) s += "_recompute";
      if (i.param.recompute == pipeline::Recompute::selective) s += "_selective";
      if (i.param.dp > 1) s += "_dp" + std::to_string(i.param.dp);
      if (i.param.chunks > 2) s += "_v" + std::to_string(i.param.chunks);
      if (i.param.offload != 0) s += i.param.offload < 0 ? "_offload" : "_offload" + std::to_string(i.param.offload);
      if (i.param.pad) s += "_pad";
      if (i.param.tp > 1) s += "_tp" + std::to_string(i.param.tp);
      if (i.param.sp) s += "_sp";
      return s;
    });

// Three SGD steps: the stages' parameters (both copies of the tied embeddings) stay the
// unpipelined model's.
TEST(PipelineMpiTraining, OptimizerStepsKeepTheParametersOfTheUnpipelinedModel) { check({"interleaved", 2}, 3); }
// The same with every activation offloaded and brought back each step.
TEST(PipelineMpiTraining, OffloadedStepsKeepTheParametersOfTheUnpipelinedModel) {
  check({.schedule = "group-interleaved", .chunks = 2, .offload = -1}, 3);
}

// The bucketed synchroniser in the pipeline (buckets reduced while the last W passes run, one
// synchroniser per chunk), with awkward bucket sizes; and ZeRO-1's sharded optimizer, whose
// summed gradients exist only in each rank's shard, so parameters after steps are compared.
TEST(PipelineMpiTraining, BucketedGradientSyncGivesTheUnpipelinedGradients) {
  check({"1f1b", 0, pipeline::Recompute::none, 2, 1000}, 1);
  check({"interleaved", 2, pipeline::Recompute::none, 1, 1}, 1);
  check({"zb-h1", 0, pipeline::Recompute::none, 1, 40'000'000}, 1);
}
TEST(PipelineMpiTraining, ZeroOneStepsKeepTheParametersOfTheUnpipelinedModel) {
  check({"1f1b", 0, pipeline::Recompute::none, 2, 1000, true}, 3);
  check({"interleaved", 2, pipeline::Recompute::none, 1, 7, true}, 3);
}

}  // namespace
}  // namespace moelab

int main(int argc, char** argv) {
  moelab::init_world(&argc, &argv);
  moelab::register_builtin_impls();
  ::testing::InitGoogleTest(&argc, argv);
  {
    auto b = moelab::make_backend("cpu");
    auto comm = moelab::make_world_communicator(*b);
    const double s = moelab::world_rank() == 0 ? static_cast<double>(moelab::test::fresh_seed() >> 12) : 0.0;
    moelab::g_seed = static_cast<std::uint64_t>(comm->all_reduce_sum(s));
    if (moelab::world_rank() == 0)
      std::printf("seed %llu on %d ranks (MOELAB_TEST_SEED=<seed << 12> replays)\n",
                  static_cast<unsigned long long>(moelab::g_seed), moelab::world_size());
  }
  if (moelab::world_rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int rc = RUN_ALL_TESTS();
  {
    auto b = moelab::make_backend("cpu");
    auto comm = moelab::make_world_communicator(*b);
    rc = static_cast<int>(comm->all_reduce_max(rc));
  }
  moelab::finalize_world();
  return rc;
}
