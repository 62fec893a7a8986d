// harness/tests/parallel_test.cpp — tensor and data parallelism without MPI: how a split
// parameter is cut from the full one, the gradient buckets' boundaries on awkward sizes, and
// on a simulated two-node cluster the traffic of a tensor-parallel run (all of it on NVLink,
// none through a NIC, exactly the collectives the blocks issue) and the data-parallel
// gradient synchronisation (through the NICs, issued while backward still runs).
//   ctest --test-dir build -R parallel_test --output-on-failure
// (Numerics against the unsplit model: tp_mpi_test; training against one rank: dp_mpi_test.)
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "harness/backends/sim/sim_backend.hpp"
#include "harness/comm/groups.hpp"
#include "harness/nn/grad_sync.hpp"
#include "harness/nn/model.hpp"
#include "harness/runtime/error.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab {
namespace {

// ---- TpShard ---------------------------------------------------------------------------------

TEST(TpShard, EveryRankTakesItsPartOfEachSegmentAndThePartsRebuildTheWhole) {
  // W_qkv of 4 query and 2 key/value heads of width 3 over 2 ranks, 5 rows: columns
  // [q0 q1 q2 q3 | k0 k1 | v0 v1]; rank 1 holds [q2 q3 | k1 | v1].
  TpShard sh;
  sh.dim = 1;
  sh.full = 8 * 3;
  sh.segments = {{0, 12}, {12, 6}, {18, 6}};
  sh.size = 2;
  EXPECT_EQ(sh.pieces(1), (std::vector<std::pair<std::int64_t, std::int64_t>>{{6, 6}, {15, 3}, {21, 3}}));
  EXPECT_EQ(sh.local(), 12);
  const std::int64_t rows = 5, cols = 24;
  std::vector<float> full(static_cast<std::size_t>(rows * cols));
  std::iota(full.begin(), full.end(), 0.0f);
  const auto part = take_shard(full, rows, cols, sh, 1);
  ASSERT_EQ(part.size(), 60u);
  EXPECT_EQ(part[0], 6.0f);    // row 0, q2
  EXPECT_EQ(part[6], 15.0f);   // row 0, k1
  EXPECT_EQ(part[9], 21.0f);   // row 0, v1
  EXPECT_EQ(part[12], 30.0f);  // row 1 starts again at q2
  std::vector<float> back(full.size(), -1.0f);
  for (int r = 0; r < 2; ++r) place_shard(back, rows, cols, sh, r, take_shard(full, rows, cols, sh, r));
  EXPECT_EQ(back, full);
  // By rows: rank r of 3 holds rows [2r, 2r+2) of 6.
  TpShard rs;
  rs.dim = 0;
  rs.full = 6;
  rs.segments = {{0, 6}};
  rs.size = 3;
  std::vector<float> m(12);
  std::iota(m.begin(), m.end(), 0.0f);
  EXPECT_EQ(take_shard(m, 6, 2, rs, 2), (std::vector<float>{8, 9, 10, 11}));
}

TEST(TpShard, ASegmentThatDoesNotSplitIsAConfigError) {
  struct Two final : Communicator {  // a TP group of 2 that is never used to communicate
    int rank() const override { return 0; }
    int size() const override { return 2; }
    std::string kind() const override { return "test"; }
    std::unique_ptr<Communicator> dup() override { return nullptr; }
    void all_to_all_v(Stream&, const Tensor&, std::span<const Segment>, Tensor&, std::span<const Segment>) override {}
    void all_gather(Stream&, const Tensor&, Tensor&) override {}
    void reduce_scatter(Stream&, const Tensor&, Tensor&) override {}
    void all_reduce(Stream&, Tensor&) override {}
    void send(Stream&, const Tensor&, int) override {}
    void recv(Stream&, Tensor&, int) override {}
    void barrier() override {}
    std::vector<std::int64_t> exchange_counts(const std::vector<std::int64_t>& s) override { return s; }
    double all_reduce_max(double v) override { return v; }
    double all_reduce_sum(double v) override { return v; }
    std::vector<std::string> all_gather_strings(const std::string& s) override { return {s}; }
  } two;
  const TensorParallel tp{&two, false};
  EXPECT_NO_THROW(tp_shard(tp, 1, 12, {{0, 6}, {6, 6}}, "w1"));
  try {
    tp_shard(tp, 1, 14, {{0, 7}, {7, 7}}, "layer0.mlp width");
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()), "layer0.mlp width: 7 is not divisible by the tensor-parallel size 2");
  }
  EXPECT_FALSE(tp_shard(TensorParallel{}, 1, 14, {}, "w").split());  // no TP: whole
}

// ---- buckets ---------------------------------------------------------------------------------

// Every parameter in exactly one bucket of its kind, in reverse model order, end to end; a
// bucket closes as soon as it holds bucket_elems (so only each kind's last may hold fewer);
// padded to its group.
void check_plan(const BucketPlan& plan, const std::vector<std::int64_t>& numel, const std::vector<bool>& expert,
                std::int64_t bucket, int dense_group, int expert_group) {
  std::vector<int> seen(numel.size(), 0);
  std::size_t last_param[2] = {numel.size(), numel.size()};
  int short_buckets[2] = {0, 0};
  for (const auto& bk : plan.buckets) {
    ASSERT_FALSE(bk.entries.empty());
    std::int64_t at = 0;
    for (const auto& e : bk.entries) {
      ASSERT_LT(e.param, numel.size());
      ++seen[e.param];
      EXPECT_EQ(expert[e.param], bk.expert);
      EXPECT_EQ(e.offset, at);
      EXPECT_EQ(e.count, numel[e.param]);
      EXPECT_LT(e.param, last_param[bk.expert]) << "reverse model order";
      last_param[bk.expert] = e.param;
      at += e.count;
    }
    EXPECT_EQ(bk.elems, at);
    // Closed as soon as full: without its last parameter the bucket was below the size.
    EXPECT_LT(bk.elems - bk.entries.back().count, bucket);
    if (bk.elems < bucket) ++short_buckets[bk.expert];
    const int g = bk.expert ? expert_group : dense_group;
    EXPECT_EQ(bk.padded % g, 0);
    EXPECT_GE(bk.padded, bk.elems);
    EXPECT_LT(bk.padded - bk.elems, g);
  }
  for (std::size_t i = 0; i < numel.size(); ++i) EXPECT_EQ(seen[i], 1) << "parameter " << i;
  EXPECT_LE(short_buckets[0], 1);
  EXPECT_LE(short_buckets[1], 1);
}

TEST(Buckets, BoundariesOnAwkwardSizes) {
  const std::vector<std::int64_t> numel = {7, 1, 40, 3, 13, 1, 29, 6, 11, 2};
  const std::vector<bool> expert = {false, false, false, true, true, false, true, false, false, true};
  for (std::int64_t bucket : {1, 2, 7, 8, 13, 37, 41, 1000, 40'000'000})
    for (auto [dg, eg] : {std::pair{1, 1}, std::pair{2, 1}, std::pair{3, 4}, std::pair{8, 2}}) {
      SCOPED_TRACE("bucket " + std::to_string(bucket) + ", groups " + std::to_string(dg) + "/" + std::to_string(eg));
      check_plan(plan_buckets(numel, expert, bucket, dg, eg), numel, expert, bucket, dg, eg);
    }
  // One element per bucket: every parameter alone, in reverse order.
  const BucketPlan one = plan_buckets(numel, expert, 1, 1, 1);
  ASSERT_EQ(one.buckets.size(), numel.size());
  for (std::size_t i = 0; i < numel.size(); ++i) EXPECT_EQ(one.buckets[i].entries[0].param, numel.size() - 1 - i);
  // The default: one bucket per kind, the dense one first (it closes last, but the expert
  // parameters' bucket is made after it).
  const BucketPlan big = plan_buckets(numel, expert, 40'000'000, 4, 3);
  ASSERT_EQ(big.buckets.size(), 2u);
  EXPECT_FALSE(big.buckets[0].expert);
  EXPECT_EQ(big.buckets[0].elems, 7 + 1 + 40 + 1 + 6 + 11);
  EXPECT_EQ(big.buckets[0].padded, 68);
  EXPECT_EQ(big.buckets[1].elems, 3 + 13 + 29 + 2);
  EXPECT_EQ(big.buckets[1].padded, 48);
  // Size 13, in the order they close: dense 11+6; expert 2+29; expert 13; dense 1+40; what is
  // left: dense 1+7, expert 3.
  const BucketPlan b13 = plan_buckets(numel, expert, 13, 1, 1);
  std::vector<std::int64_t> sizes;
  for (const auto& bk : b13.buckets) sizes.push_back(bk.elems);
  EXPECT_EQ(sizes, (std::vector<std::int64_t>{17, 31, 13, 41, 8, 3}));
  EXPECT_THROW(plan_buckets(numel, expert, 0, 1, 1), ConfigError);
}

// ---- on a simulated cluster ------------------------------------------------------------------

SimOptions two_dgx() {
  SimOptions o;
  o.cluster = sim::load_cluster("dgx-a100x2");  // 2 nodes x 8 A100, NVSwitch, 8 HDR NICs per node
  return o;
}

TransformerConfig dense_model() {
  TransformerConfig c;
  c.name = "sim-dense";
  c.origin = "<test>";
  c.d_model = 1024;
  c.num_heads = 16;
  c.num_kv_heads = 16;
  c.d_ffn = 4096;
  c.num_layers = 3;
  c.seq_len = 512;
  c.vocab_size = 8192;
  c.dtype = DType::bf16;
  return c;
}

struct RankRun {
  sim::LinkBytes bytes;
  double tp_comm = 0, dp_comm = 0;       // comm_bytes of the TP collectives and of the gradient sync
  int tp_ops = 0;
  double first_sync_start = 0, last_backward_end = 0;
};

// One training step of a dense model on 16 simulated GPUs, tp = 8 (a node) and dp = 2 (the
// two nodes); with a synchroniser, its buckets of `bucket` elements.
std::vector<RankRun> sim_step(bool sp, bool with_sync, std::int64_t bucket) {
  SimCluster cluster(two_dgx());
  const TransformerConfig cfg = dense_model();
  const GroupLayout l = check_layout(ParallelLayout::parse("tp=8"), 16, 8, cfg);
  std::vector<RankRun> out(16);
  cluster.run([&](Backend& b, Communicator& world) {
    ProcessGroups pg(world, l, NodeMap::uniform(16, 8));
    ModelOptions mo;
    mo.tp = &pg.tp();
    mo.sequence_parallel = sp;
    Model model(b, pg.ep(), cfg, mo);
    std::unique_ptr<GradSync> sync;
    if (with_sync) {
      sync = std::make_unique<GradSync>(b, model.stream(), model.param_slots(), pg.dp(), pg.edp(),
                                        model.tensor_parallel(), GradSyncOptions{.bucket_elems = bucket});
      model.set_grad_sync(sync.get());
    }
    const std::int64_t T = 2 * cfg.seq_len;
    Batch x;
    x.input = b.empty({T}, DType::i32, MemCategory::activations, b.default_stream());
    x.targets = b.empty({T}, DType::i32, MemCategory::activations, b.default_stream());
    b.synchronize();
    world.barrier();
    b.clear_timeline();
    Forwarded f = model.forward(x, {0, 0, 1});
    model.backward_input(*f.saved, Tensor());
    if (sync) sync->arm();
    model.backward_weight(*f.saved);
    f.saved.reset();
    if (sync) sync->finish();
    b.synchronize();
    world.barrier();
    RankRun& r = out[static_cast<std::size_t>(world.rank())];
    r.bytes = sim_link_bytes(b);
    r.first_sync_start = 1e30;
    for (const OpRecord& op : b.timeline()) {
      if (op.stream_name == "grad_sync") {
        if (op.cost.kind == OpKind::collective) {
          r.dp_comm += op.cost.comm_bytes;
          r.first_sync_start = std::min(r.first_sync_start, op.start);
        }
        continue;
      }
      if (op.cost.kind == OpKind::collective) {
        r.tp_comm += op.cost.comm_bytes;
        ++r.tp_ops;
      } else if (op.cost.kind == OpKind::gemm) {
        r.last_backward_end = std::max(r.last_backward_end, op.end);
      }
    }
  });
  return out;
}

// Every TP collective stays inside its node on NVLink, and there are exactly the ones the
// blocks issue: per layer an all-reduce of [T,M] at each edge of the attention and the MLP in
// forward and backward (Shoeybi et al., Fig. 4: four), one after the vocabulary-parallel
// embedding and one of the LM head's input gradient, and the all-gather of the per-token
// (loss, lse) pairs [2,T] fp32 of the vocabulary-parallel cross-entropy. With sequence
// parallelism every all-reduce becomes a reduce-scatter and an all-gather, and the inputs of
// the column-parallel GEMMs (QKV, FC1, LM head) are gathered again for their weight gradients
// (Korthikanti et al. 2022, §4.2.2), as is the embedding's output gradient.
TEST(SimParallel, TensorParallelTrafficStaysOnNvlinkInsideTheNode) {
  const TransformerConfig cfg = dense_model();
  const double t = 8, T = 2.0 * static_cast<double>(cfg.seq_len), TM_bytes = T * static_cast<double>(cfg.d_model) * 2;
  const double loss_parts = (t - 1) * 2 * T * 4;  // fp32 (loss, lse) per token to every other rank
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "tensor parallel");
    const auto runs = sim_step(sp, false, 0);
    const double want = sp ? (10.0 * cfg.num_layers + 5) * (t - 1) / t * TM_bytes + loss_parts
                           : (4.0 * cfg.num_layers + 2) * 2 * (t - 1) / t * TM_bytes + loss_parts;
    for (int r = 0; r < 16; ++r) {
      const RankRun& run = runs[static_cast<std::size_t>(r)];
      EXPECT_EQ(run.tp_ops, sp ? 10 * cfg.num_layers + 6 : 4 * cfg.num_layers + 3) << r;
      EXPECT_DOUBLE_EQ(run.tp_comm, want) << r;
      EXPECT_DOUBLE_EQ(run.bytes.nvlink, want) << r;
      EXPECT_EQ(run.bytes.nic, 0.0) << r;
      EXPECT_EQ(run.bytes.pcie, 0.0) << r;
    }
  }
}

// The gradient sync of dp = 2 (ranks r and r + 8, one per node) goes through the NICs, bucket by
// bucket while the weight-gradient GEMMs still run; the TP traffic stays as it was.
TEST(SimParallel, DataParallelBucketsCrossTheNicWhileBackwardRuns) {
  const std::int64_t bucket = 1'000'000;  // a layer is 1.6M elements per rank
  const auto runs = sim_step(false, true, bucket);
  const auto plain = sim_step(false, false, 0);
  for (int r = 0; r < 16; ++r) {
    const RankRun& run = runs[static_cast<std::size_t>(r)];
    EXPECT_GT(run.dp_comm, 0.0) << r;
    EXPECT_DOUBLE_EQ(run.bytes.nic, run.dp_comm) << r;  // the DP ring of two: both edges leave the node
    EXPECT_DOUBLE_EQ(run.bytes.nvlink, plain[static_cast<std::size_t>(r)].bytes.nvlink) << r;
    EXPECT_LT(run.first_sync_start, run.last_backward_end) << r << ": no bucket overlapped backward";
  }
}

}  // namespace
}  // namespace moelab
