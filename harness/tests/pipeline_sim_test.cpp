// harness/tests/pipeline_sim_test.cpp — the pipeline executor on the sim backend: with equal
// stage costs, 1F1B on 4 stages idles (p-1)/(m+p-1) of the step as the timeline shows it
// (Narayanan et al. 2021 §2.2.1); GPipe idles as much but holds every microbatch; 1F1B's
// first stage holds p microbatches' activations, its last one; interleaving and ZB-H1 idle
// less. The bubble comes from the ops' node labels (F, B, W) in each rank's timeline.
//   ctest --test-dir build -R pipeline_sim_test
#include <gtest/gtest.h>

#include <map>
#include <mutex>

#include "harness/backends/sim/sim_backend.hpp"
#include "harness/comm/groups.hpp"
#include "harness/pipeline/executor.hpp"
#include "harness/runtime/error.hpp"
#include "harness/tests/sim_test_util.hpp"

namespace moelab {
namespace {

// One NVSwitch node of `gpus` GPUs without launch overheads, so that equal layers cost the
// same on every stage (the toy cluster of harness/tests/sim_test_util.hpp, a faster GPU).
sim::ClusterModel toy_cluster(int gpus) {
  sim::ClusterModel m = test::toy_cluster(gpus, 300e9, 1e-6);
  m.gpu.flops_bf16 = 300e12;
  m.gpu.flops_tf32 = 150e12;
  return m;
}

// A dense model whose embedding and head are negligible beside its layers (vocabulary 128, no
// learned positions, 4 layers per stage of 4), so that every stage costs the same.
TransformerConfig dense() {
  TransformerConfig c;
  c.name = "dense-16";
  c.origin = "<test>";
  c.d_model = 2048;
  c.num_heads = 16;
  c.num_kv_heads = 16;
  c.d_ffn = 8192;
  c.num_layers = 16;
  c.seq_len = 1024;
  c.positions = PositionKind::none;
  c.vocab_size = 128;
  c.dtype = DType::bf16;
  c.tie_embeddings = false;
  return c;
}

struct Figures {
  std::vector<double> bubble;             // per stage
  std::vector<std::size_t> peak_act;      // per stage: the activations' peak (saved for backward)
  std::vector<std::vector<OpRecord>> ops;  // per stage: the measured step's timeline
  std::vector<std::string> compute;        // per stage: its compute stream's name
};

// PipeOffload's options of a run: the offload pass (every transfer, copies placed as if
// free) and the pinned host memory a stage may hold.
struct Offload {
  int chunks = 0;
  int group = 0;
  double host_capacity = 0;
};

Figures run(const std::string& schedule, int p, int m, int chunks = 0,
            pipeline::Recompute recompute = pipeline::Recompute::none, const Offload& off = {}) {
  SimOptions o;
  o.cluster = toy_cluster(p);
  SimCluster cluster(o);
  const TransformerConfig cfg = dense();
  std::vector<pipeline::StageWork> work(static_cast<std::size_t>(p));
  Figures f;
  f.peak_act.resize(static_cast<std::size_t>(p));
  f.ops.resize(static_cast<std::size_t>(p));
  f.compute.resize(static_cast<std::size_t>(p));
  std::mutex mu;
  cluster.run([&](Backend& b, Communicator& c) {
    ParallelLayout spec;
    spec.pp = p;
    const GroupLayout l = check_layout(spec, p, p, cfg);
    ProcessGroups pg(c, l, NodeMap::uniform(p, p));
    pipeline::Schedule s = pipeline::make_schedule(schedule, p, m, chunks, off.group);
    if (off.chunks > 0) pipeline::add_offload(s, {.chunks = off.chunks, .d2h = 0, .h2d = 0, .costs = {}, .lifespan = false});
    pipeline::PipelineOptions po;
    po.tokens = cfg.seq_len;
    po.recompute = recompute;
    po.host_capacity_bytes = off.host_capacity;
    pipeline::PipelineStage st(b, cfg, s, pg.pp(), pg.ep(), po);
    st.init_parameters(1);
    std::vector<Batch> data(static_cast<std::size_t>(m));
    for (auto& x : data) {
      x.input = b.empty({po.tokens}, DType::i32, MemCategory::activations, b.default_stream());
      x.targets = b.empty({po.tokens}, DType::i32, MemCategory::activations, b.default_stream());
      x.loss_scale = 1.0f / static_cast<float>(po.tokens * m);
    }
    st.step(data, 1);  // warm-up
    b.synchronize();
    c.barrier();
    b.clear_timeline();
    b.memory().reset_peak();
    const double t0 = b.now();
    st.step(data, 2);
    b.synchronize();
    c.barrier();
    const double t1 = b.now();
    std::vector<std::string> transfer;
    for (const Stream* x : st.transfer_streams()) transfer.push_back(x->name());
    const auto w = pipeline::stage_work(b.timeline(), {{t0, t1}}, transfer);
    const auto peak = b.memory().peak_per_category();
    std::lock_guard lk(mu);
    work[static_cast<std::size_t>(st.stage())] = w.at(0);
    f.peak_act[static_cast<std::size_t>(st.stage())] = peak[static_cast<int>(MemCategory::activations)];
    f.ops[static_cast<std::size_t>(st.stage())] = b.timeline();
    f.compute[static_cast<std::size_t>(st.stage())] = st.stream().name();
  });
  double first = work[0].first, last = work[0].last;
  for (const auto& w : work) first = std::min(first, w.first), last = std::max(last, w.last);
  for (const auto& w : work) f.bubble.push_back(1.0 - w.busy / (last - first));
  return f;
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}

TEST(PipelineSim, OneFOneBBubbleMatchesTheFormula) {
  const int p = 4, m = 8;
  const double want = static_cast<double>(p - 1) / (m + p - 1);
  const Figures f = run("1f1b", p, m);
  for (int s = 0; s < p; ++s)
    EXPECT_NEAR(f.bubble[static_cast<std::size_t>(s)], want, 0.02 * want) << "stage " << s;
  // 1F1B's stage s holds p - s microbatches' activations at its peak (beside them, the one
  // forward under way and the next microbatch's received input).
  for (int s = 0; s < p; ++s)
    EXPECT_NEAR(static_cast<double>(f.peak_act[static_cast<std::size_t>(s)]) / static_cast<double>(f.peak_act[3]), p - s, 0.1 * (p - s))
        << "stage " << s;
}

// Recomputation trades time for memory: selective (the norms) holds less than none at each
// stage's peak, and full (only each chunk's input per microbatch in flight) less again where
// a stage holds several microbatches.
TEST(PipelineSim, RecomputationHoldsLessActivationMemory) {
  const int p = 4, m = 8;
  const Figures none = run("1f1b", p, m), sel = run("1f1b", p, m, 0, pipeline::Recompute::selective),
                full = run("1f1b", p, m, 0, pipeline::Recompute::full);
  for (int s = 0; s < p; ++s) {
    const auto i = static_cast<std::size_t>(s);
    EXPECT_LT(sel.peak_act[i], none.peak_act[i]) << "stage " << s;
    // The last stage holds one microbatch: full recomputation rebuilds all of it, so it saves
    // nothing there; the others hold p - s microbatches, of which full keeps only the inputs.
    if (s < p - 1)
      EXPECT_LT(full.peak_act[i], sel.peak_act[i]) << "stage " << s;
    else
      EXPECT_LE(static_cast<double>(full.peak_act[i]), 1.01 * static_cast<double>(none.peak_act[i])) << "stage " << s;
  }
}

TEST(PipelineSim, GPipeIdlesAsMuchButHoldsEveryMicrobatch) {
  const int p = 4, m = 8;
  const Figures g = run("gpipe", p, m), o = run("1f1b", p, m);
  EXPECT_NEAR(mean(g.bubble), mean(o.bubble), 0.02 * mean(o.bubble));
  for (int s = 0; s < p; ++s) EXPECT_GT(g.peak_act[static_cast<std::size_t>(s)], o.peak_act[static_cast<std::size_t>(s)]) << s;
}

TEST(PipelineSim, InterleavingAndZeroBubbleIdleLess) {
  const int p = 4, m = 8;
  const double one = mean(run("1f1b", p, m).bubble);
  const double inter = mean(run("interleaved", p, m, 2).bubble);
  const double zb = mean(run("zb-h1", p, m).bubble);
  EXPECT_LT(inter, 0.8 * one);
  EXPECT_LT(zb, 0.8 * one);
}

// Group-interleaved 1F1B's activation peaks follow their closed form (docs/pipeline-memory.md),
// stage against stage; offloading every chunk leaves on each stage about what the schedule's
// resident count says (one F's activations until their copy ends, a reloaded one for its B),
// a fraction of the peak without it.
TEST(PipelineSim, GroupInterleavedPeaksFollowTheClosedFormAndOffloadCutsThem) {
  const int p = 4, m = 8, v = 2, g = 2;
  const pipeline::Schedule s = pipeline::make_schedule("group-interleaved", p, m, v, g);
  const std::vector<double> form = pipeline::expected_peak_activation(s);
  const Figures none = run("group-interleaved", p, m, v, pipeline::Recompute::none, {.group = g});
  const Figures full = run("group-interleaved", p, m, v, pipeline::Recompute::none, {.chunks = v, .group = g});
  pipeline::Schedule o = s;
  pipeline::add_offload(o, {.chunks = v, .d2h = 0, .h2d = 0, .costs = {}, .lifespan = false});
  const pipeline::ScheduleAnalysis a = pipeline::validate(o);
  for (int st = 0; st < p; ++st) {
    const auto i = static_cast<std::size_t>(st);
    // Measured peaks in the ratio of the forms (within one chunk-microbatch's share).
    const double measured = static_cast<double>(none.peak_act[i]) / static_cast<double>(none.peak_act[p - 1]);
    EXPECT_NEAR(measured, form[i] / form[p - 1], 1.0 / (form[p - 1] * p * v)) << "stage " << st;
    // With full offload: the resident count's share of the peak in flight, plus what is being
    // received (one chunk's input).
    const double kept = static_cast<double>(full.peak_act[i]) / static_cast<double>(none.peak_act[i]);
    const double want = static_cast<double>(a.peak_resident[i]) / static_cast<double>(a.peak_in_flight[i]);
    EXPECT_LT(full.peak_act[i], none.peak_act[i]) << "stage " << st;
    EXPECT_NEAR(kept, want, 1.0 / a.peak_in_flight[i]) << "stage " << st;
  }
}

// A reload is issued when the compute stream reaches its node (the schedule's place for it):
// its copy starts no earlier than the end of the compute node before it in the stage's list
// (the host runs ahead of the device, so a copy ordered only after its offload would start as
// soon as that ends and bring the activations back for most of their life), and the B that
// needs it starts after it ends.
TEST(PipelineSim, AReloadStartsWhereTheScheduleIssuesIt) {
  const int p = 4, m = 8, v = 2, g = 2;
  const Figures full = run("group-interleaved", p, m, v, pipeline::Recompute::none, {.chunks = v, .group = g});
  pipeline::Schedule o = pipeline::make_schedule("group-interleaved", p, m, v, g);
  pipeline::add_offload(o, {.chunks = v, .d2h = 0, .h2d = 0, .costs = {}, .lifespan = false});
  int reloads = 0;
  for (int st = 0; st < p; ++st) {
    const auto i = static_cast<std::size_t>(st);
    // Each compute node's span on the compute stream, by label; each reload's copies.
    std::map<std::string, std::pair<double, double>> span, copy;
    auto widen = [](std::map<std::string, std::pair<double, double>>& into, const OpRecord& r) {
      auto [it, fresh] = into.try_emplace(r.node, r.start, r.end);
      if (!fresh) it->second = {std::min(it->second.first, r.start), std::max(it->second.second, r.end)};
    };
    for (const OpRecord& r : full.ops[i]) {
      if (r.node.empty()) continue;
      if (r.stream_name == full.compute[i]) widen(span, r);
      else if (pipeline::label_kind(r.node) == "RL") widen(copy, r);
    }
    std::string before;  // the last compute node before this point of the list
    for (const pipeline::Node& n : o.nodes[i]) {
      const std::string label = pipeline::node_label(n);
      if (n.kind == pipeline::NodeKind::forward || n.kind == pipeline::NodeKind::backward_input ||
          n.kind == pipeline::NodeKind::backward_weight) {
        before = label;
        continue;
      }
      if (n.kind != pipeline::NodeKind::reload || before.empty()) continue;
      ASSERT_TRUE(copy.count(label)) << "stage " << st << ": no copy for " << label;
      ASSERT_TRUE(span.count(before)) << "stage " << st << ": " << before << " not on the compute stream";
      EXPECT_GE(copy[label].first, span[before].second - 1e-12) << "stage " << st << ": " << label << " before " << before << " ends";
      const std::string b = pipeline::node_label({pipeline::NodeKind::backward_input, n.microbatch, n.chunk});
      ASSERT_TRUE(span.count(b)) << b;
      EXPECT_GE(span[b].first, copy[label].second - 1e-12) << "stage " << st << ": " << b << " before its reload ends";
      ++reloads;
    }
  }
  EXPECT_GT(reloads, p);  // the check ran
}

// Host memory is finite: a stage whose offloads would hold more pinned memory than it may
// stops with OutOfMemory naming the stage and the bytes.
TEST(PipelineSim, OffloadBeyondTheHostMemoryStopsNamingTheStage) {
  try {
    run("group-interleaved", 4, 8, 2, pipeline::Recompute::none, {.chunks = 2, .group = 2, .host_capacity = 64.0 * (1 << 20)});
    FAIL() << "no error";
  } catch (const OutOfMemory& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("pipeline stage"), std::string::npos) << msg;
    EXPECT_NE(msg.find("GiB of pinned host memory"), std::string::npos) << msg;
  }
}

// The uneven split (PipeOffload's --allow-padding-num-layers): ceil(L/V) layers per virtual
// stage, one fewer on the last, then the first, second, ... for each layer short; 3p - 2
// layers over 3p virtual stages leave the embedding and the head virtual stages of their own.
TEST(UnevenSplit, OneFewerOnTheLastThenTheFirstStages) {
  auto sizes = [](int L, int V) {
    TransformerConfig c = dense();
    c.num_layers = L;
    std::vector<int> out;
    int next = 0;
    for (int v = 0; v < V; ++v) {
      const pipeline::LayerRange r = pipeline::virtual_stage_layers(c, V, v, true);
      EXPECT_EQ(r.first, next) << "L=" << L << " V=" << V << " v=" << v;
      next = r.last;
      out.push_back(r.last - r.first);
    }
    EXPECT_EQ(next, L);
    return out;
  };
  EXPECT_EQ(sizes(10, 4), (std::vector<int>{2, 3, 3, 2}));
  EXPECT_EQ(sizes(5, 4), (std::vector<int>{1, 1, 2, 1}));
  EXPECT_EQ(sizes(12, 4), (std::vector<int>{3, 3, 3, 3}));
  std::vector<int> want(24, 1);
  want.front() = want.back() = 0;
  EXPECT_EQ(sizes(22, 24), want);  // p = 8, v = 3: the public configuration
  TransformerConfig c = dense();
  c.num_layers = 2;  // 8 virtual stages: six left empty, some neither embedding nor head
  EXPECT_THROW(pipeline::check_pipeline(c, pipeline::make_schedule("interleaved", 4, 4, 2), true), ConfigError);
  c.num_layers = 10;  // without the padding: Megatron's even split only
  EXPECT_THROW(pipeline::check_pipeline(c, pipeline::make_schedule("1f1b", 4, 4)), ConfigError);
}

}  // namespace
}  // namespace moelab

