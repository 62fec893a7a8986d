// impls/monta/monta_test.cpp — MoNTA's volume model against the bytes the simulated
// communicators move, per link class and collective (2 × 8 A800 with NVLink and 8 NICs per
// node; TP and EP groups in Megatron's order), for every strategy the layer runs, forward and
// backward; and the time model's choices (the candidates, "auto").
//   ctest --test-dir build -R monta_test
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "baselines/deepspeed_tp_ep/deepspeed_tp_ep.hpp"
#include "harness/backends/sim/sim_backend.hpp"
#include "harness/nn/moe_impl.hpp"
#include "impls/monta/strategy.hpp"

namespace moelab {
namespace {

ModelConfig config() {
  ModelConfig c;
  c.d_model = 1024;
  c.d_hidden = 4096;
  c.num_experts = 16;
  c.top_k = 2;
  c.capacity_factor = 1.0;  // C = ceil(2 · 1000 / 16) = 125: not a multiple of t·n, so padding shows
  c.dtype = DType::bf16;
  return c;
}
constexpr std::int64_t kTokens = 1000;

struct Layout {
  int tp, ep;
};
struct Strat {
  std::string impl;
  nlohmann::json options;
  monta::Strategy s;
  int chunks;
};

// Bytes each rank moved in one forward and in one backward, by collective.
struct Moved {
  std::map<std::string, sim::LinkBytes> fwd, bwd;
};

std::vector<Moved> run_layer(const Layout& lay, const Strat& st) {
  SimOptions o;
  o.cluster = sim::load_cluster("a800x2");
  SimCluster cluster(std::move(o));
  std::vector<Moved> out(16);
  cluster.run([&](Backend& b, Communicator& world) {
    register_builtin_impls();
    const int r = world.rank();
    auto tp = world.split(r / lay.tp, r);
    auto ep = world.split(r / lay.ep, r);
    MoEChannels ch(b, *ep, tp.get());
    auto impl = make_impl(st.impl, b, *ep, config(), st.options, &ch);
    Stream& s = b.default_stream();
    Tensor x = b.empty({kTokens, 1024}, DType::bf16, MemCategory::activations, s);
    Tensor dy = b.empty({kTokens, 1024}, DType::bf16, MemCategory::activations, s);
    world.barrier();
    b.clear_timeline();
    Forwarded f = impl->forward(x, {0, 0, 1});
    b.synchronize();
    world.barrier();
    out[static_cast<std::size_t>(r)].fwd = sim_link_bytes_by_collective(b);
    b.clear_timeline();
    impl->backward_input(*f.saved, dy, 0.0f);
    impl->backward_weight(*f.saved);
    b.synchronize();
    world.barrier();
    out[static_cast<std::size_t>(r)].bwd = sim_link_bytes_by_collective(b);
  });
  return out;
}

monta::Layer model_layer(const Layout& lay, int rank) {
  monta::Layer l;
  const ModelConfig c = config();
  l.E = c.num_experts;
  l.C = c.capacity(kTokens);
  l.M = c.d_model;
  l.H = c.d_hidden;
  l.bytes = 2;
  l.t = lay.tp;
  const int first = rank / lay.ep * lay.ep;
  for (int p = first; p < first + lay.ep; ++p) l.ep_ranks.push_back(p);
  l.rank = rank;
  return l;
}

monta::Links a800x2_links() {
  const sim::ClusterModel m = sim::load_cluster("a800x2");
  monta::Links k;
  k.gpus_per_node = m.node.gpus;
  k.intra_bw = m.node.nvlink_bw;
  k.intra_latency = m.node.nvlink_latency;
  k.nic_bw = m.node.nic_bw;
  k.nic_latency = m.node.nic_latency + m.fabric_latency;
  k.nics = m.node.nics;
  k.gemm_flops = 0.8 * m.gpu.flops_bf16;
  k.launch = m.efficiency.launch_latency;
  return k;
}

class VolumeMatchesTheSimulator : public ::testing::TestWithParam<std::tuple<Layout, Strat>> {};

// Forward and backward each run two all-to-alls (dispatch and combine, or their mirrors) and,
// deduplicated with TP > 1, one all-gather over the TP group.
TEST_P(VolumeMatchesTheSimulator, EveryRankEveryLinkClass) {
  const auto [lay, st] = GetParam();
  const auto moved = run_layer(lay, st);
  const monta::Links k = a800x2_links();
  for (int r = 0; r < 16; ++r) {
    const monta::Layer l = model_layer(lay, r);
    const monta::Volume a = monta::all_to_all_volume(l, k, st.s, st.chunks);
    const monta::Volume g = monta::all_gather_volume(l, k, st.s, st.chunks);
    for (const auto* pass : {&moved[static_cast<std::size_t>(r)].fwd, &moved[static_cast<std::size_t>(r)].bwd}) {
      const sim::LinkBytes a2a = pass->count("all_to_all") ? pass->at("all_to_all") : sim::LinkBytes{};
      const sim::LinkBytes ag = pass->count("all_gather") ? pass->at("all_gather") : sim::LinkBytes{};
      EXPECT_DOUBLE_EQ(a2a.nvlink, 2 * a.intra) << "rank " << r;
      EXPECT_DOUBLE_EQ(a2a.nic, 2 * a.nic) << "rank " << r;
      EXPECT_DOUBLE_EQ(ag.nvlink, g.intra) << "rank " << r;
      EXPECT_DOUBLE_EQ(ag.nic, 0.0) << "rank " << r;
      // The A800 node's PCIe switches: every byte to or from another node crosses the GPU's
      // PCIe link to its switch and NIC (GPUDirect RDMA); nothing else touches PCIe.
      EXPECT_DOUBLE_EQ(a2a.pcie, a2a.nic) << "rank " << r;
      EXPECT_EQ(ag.pcie, 0.0) << "rank " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, VolumeMatchesTheSimulator,
    ::testing::Combine(::testing::Values(Layout{8, 16}, Layout{2, 16}, Layout{4, 8}, Layout{2, 4}),
                       ::testing::Values(Strat{"deepspeed-tp", nlohmann::json::object(), monta::Strategy::flat, 1},
                                         Strat{"deepspeed-drop", nlohmann::json::object(), monta::Strategy::dedup, 1},
                                         Strat{"monta", {{"chunks", 2}}, monta::Strategy::dedup, 2},
                                         Strat{"monta", {{"chunks", 3}}, monta::Strategy::dedup, 3},
                                         Strat{"hierarchical", nlohmann::json::object(), monta::Strategy::hierarchical, 1})),
    [](const auto& p) {
      const Layout l = std::get<0>(p.param);
      const Strat& s = std::get<1>(p.param);
      std::string n = "tp" + std::to_string(l.tp) + "_ep" + std::to_string(l.ep) + "_" + s.impl + "_" + std::to_string(s.chunks);
      std::replace(n.begin(), n.end(), '-', '_');
      return n;
    });

// The formulas of the paper's §3: deduplication divides the bytes on the network by t (where
// t·n divides the capacity), the all-gather moves (t-1)/t of the whole set, the two-level
// exchange keeps the NIC bytes of the flat one.
TEST(VolumeModel, DedupDividesByTpAndTheGatherRebuilds) {
  monta::Layer l;
  l.E = 16;
  l.C = 256;
  l.M = 1024;
  l.bytes = 2;
  l.t = 8;
  for (int p = 0; p < 16; ++p) l.ep_ranks.push_back(p);
  l.rank = 3;
  const monta::Links k = a800x2_links();
  const monta::Volume flat = monta::all_to_all_volume(l, k, monta::Strategy::flat, 1);
  const monta::Volume dd = monta::all_to_all_volume(l, k, monta::Strategy::dedup, 4);
  const double per_peer = 1.0 * 256 * 1024 * 2;  // El = 1
  EXPECT_DOUBLE_EQ(flat.intra, 7 * per_peer);
  EXPECT_DOUBLE_EQ(flat.nic, 8 * per_peer);
  EXPECT_DOUBLE_EQ(dd.nic, flat.nic / 8);
  EXPECT_DOUBLE_EQ(dd.intra, flat.intra / 8);
  EXPECT_DOUBLE_EQ(monta::all_gather_volume(l, k, monta::Strategy::dedup, 4).intra, 7.0 / 8 * 16 * 256 * 1024 * 2);
  EXPECT_DOUBLE_EQ(monta::all_gather_volume(l, k, monta::Strategy::flat, 1).intra, 0.0);
  const monta::Volume hier = monta::all_to_all_volume(l, k, monta::Strategy::hierarchical, 1);
  EXPECT_DOUBLE_EQ(hier.nic, flat.nic);
  EXPECT_DOUBLE_EQ(hier.intra, flat.intra + flat.nic * 7 / 8);
  // Padding: C = 250 rounds up to 256 for t·n = 8·4 = 32.
  l.C = 250;
  EXPECT_EQ(monta::padded_capacity(l, monta::Strategy::dedup, 4), 256);
  EXPECT_EQ(monta::padded_capacity(l, monta::Strategy::flat, 4), 250);
}

// The candidates: with TP > 1 the deduplicated ones beat the flat one on two nodes, a slower
// network makes every exchange slower, "auto" is the fastest deduplicated candidate; without TP
// there is nothing to deduplicate.
TEST(TimeModel, CandidatesAndTheAutomaticChunks) {
  monta::Layer l = model_layer({8, 16}, 0);
  monta::Links k = a800x2_links();
  const auto c = monta::candidates(l, k, 16);
  ASSERT_FALSE(c.empty());
  for (std::size_t i = 1; i < c.size(); ++i) EXPECT_LE(c[i - 1].seconds, c[i].seconds);
  double flat = 0, best_dedup = 1e30;
  int best_n = 0;
  for (const auto& p : c) {
    if (p.strategy == monta::Strategy::flat) flat = p.seconds;
    if (p.strategy == monta::Strategy::dedup && p.seconds < best_dedup) {
      best_dedup = p.seconds;
      best_n = p.chunks;
    }
  }
  EXPECT_LT(best_dedup, flat);
  EXPECT_EQ(monta::best_chunks(l, k, 16), best_n);
  monta::Links slow = k;
  slow.nic_bw /= 8;
  EXPECT_GT(monta::predict(l, slow, monta::Strategy::flat, 1).all_to_all_s, monta::predict(l, k, monta::Strategy::flat, 1).all_to_all_s);
  l.t = 1;
  for (const auto& p : monta::candidates(l, k, 16)) EXPECT_NE(p.strategy, monta::Strategy::dedup);
  monta::Links none;
  EXPECT_FALSE(none.known());
}

// MoNTA's own mechanism, in the layer's timeline (not the model): with n chunks, the TP
// all-gather of chunk i runs on its own lane (tp_gather) while chunk i+1's combine all-to-all
// is in flight (§3, step 4: the two use different links). A gather issued on the compute
// stream, or held until the whole pass is done, fails here, whatever the bytes.
TEST(Pipeline, EachChunksGatherOverlapsTheNextChunksAllToAll) {
  for (const int n : {2, 4}) {
    SCOPED_TRACE("chunks " + std::to_string(n));
    SimOptions o;
    o.cluster = sim::load_cluster("a800x2");
    SimCluster cluster(std::move(o));
    std::vector<OpRecord> gathers, combines;
    cluster.run([&](Backend& b, Communicator& world) {
      register_builtin_impls();
      const int r = world.rank();
      auto tp = world.split(r / 8, r);
      auto ep = world.split(r / 16, r);
      MoEChannels ch(b, *ep, tp.get());
      auto impl = make_impl("monta", b, *ep, config(), {{"chunks", n}}, &ch);
      Stream& s = b.default_stream();
      Tensor x = b.empty({kTokens, 1024}, DType::bf16, MemCategory::activations, s);
      world.barrier();
      b.clear_timeline();
      Forwarded f = impl->forward(x, {0, 0, 1});
      b.synchronize();
      world.barrier();  // the times become final at a barrier of every rank
      if (r != 0) return;
      for (const OpRecord& rec : b.timeline()) {
        if (rec.stream_name == "tp_gather") gathers.push_back(rec);
        if (rec.stream_name == "combine") combines.push_back(rec);
      }
    });
    ASSERT_EQ(gathers.size(), static_cast<std::size_t>(n));
    ASSERT_EQ(combines.size(), static_cast<std::size_t>(n));
    for (int i = 0; i + 1 < n; ++i) {
      const OpRecord &g = gathers[static_cast<std::size_t>(i)], &c = combines[static_cast<std::size_t>(i + 1)];
      EXPECT_LT(g.start, c.end) << "gather " << i << " after chunk " << i + 1 << "'s all-to-all";
      EXPECT_LT(c.start, g.end) << "gather " << i << " done before chunk " << i + 1 << "'s all-to-all began";
      EXPECT_GE(g.start, combines[static_cast<std::size_t>(i)].end) << "gather " << i << " before its own combine";
    }
  }
}

// A prediction's volumes (bytes per exchange), times of each part alone and the whole (seconds).
void expect_prediction(const monta::Prediction& p, double intra, double nic, double gather, double all_to_all_s,
                       double all_gather_s, double experts_s, double seconds) {
  EXPECT_DOUBLE_EQ(p.a2a.intra, intra);
  EXPECT_DOUBLE_EQ(p.a2a.nic, nic);
  EXPECT_DOUBLE_EQ(p.gather.intra, gather);
  EXPECT_DOUBLE_EQ(p.all_to_all_s, all_to_all_s);
  EXPECT_DOUBLE_EQ(p.all_gather_s, all_gather_s);
  EXPECT_DOUBLE_EQ(p.experts_s, experts_s);
  EXPECT_DOUBLE_EQ(p.seconds, seconds);
}

// The time model by hand, on round numbers: 2 nodes of 4 GPUs with 2 NICs each (a GPU's NIC is
// shared by 2), NVLink 64 B/s + 1 s a step, NIC 32 B/s + 2 s a message, 32768 FLOP/s, 0.25 s a
// launch. Rank 0 with TP t = 2 and the EP group {0, 2, 4, 6}: one peer on its node, two off it.
// E = 8 (2 local), C = 10, M = 16, H = 32, bf16.
TEST(TimeModel, PredictionsByHand) {
  const monta::Links k{.gpus_per_node = 4, .intra_bw = 64, .intra_latency = 1, .nic_bw = 32, .nic_latency = 2,
                       .nics = 2, .gemm_flops = 32768, .gemm_flops_at = {}, .launch = 0.25};
  monta::Layer l{.E = 8, .C = 10, .M = 16, .H = 32, .bytes = 2, .t = 2, .ep_ranks = {0, 2, 4, 6}, .rank = 0};
  // Flat: 2 experts × 10 rows × 16 × 2 B = 640 B to each peer. One exchange: NVLink 1 + 640/64
  // = 11 s beside the NICs' 2 + 1280 · 2 / 32 = 82 s -> 82 s. The experts: 2 × 2 FLOPs × 80
  // rows × 16 × 32 / 32768 = 5 s + 2 × 2 launches = 6 s. A pass (one chunk): dispatch 82, the
  // experts 6, combine 82 = 170 s; backward with twice the experts' work 176 s.
  expect_prediction(monta::predict(l, k, monta::Strategy::flat, 1), 640, 1280, 0, 82, 0, 6, 170 + 176);
  // Two-level: the NIC's rows for the other local index cross NVLink first, (g-1)/g = 1/2 of
  // them: 640 + 640 B over NVLink (1 + 20 = 21 s), then the NICs (82 s), one after the other.
  expect_prediction(monta::predict(l, k, monta::Strategy::hierarchical, 1), 1280, 1280, 0, 103, 0, 6,
                    (2 * 103 + 6) + (2 * 103 + 12));
  // Deduplicated in 2 chunks: C padded to t·n = 4 -> 12, each TP rank sends its 6 rows per
  // expert: 384 B to each peer, a chunk half of it. A chunk's exchange: NVLink 1 + 192/64 = 4 s,
  // NICs 2 + 384 · 2 / 32 = 26 s -> 26 s. Its all-gather: (t-1) = 1 step, 8 experts × 6 rows ×
  // 16 × 2 B = 1536 B, a chunk's 768 B: 1 + 12 = 13 s. Its experts: 2 × 4 × 6 / 2 = 24 rows:
  // 1.5 s + 1 s of launches. Forward: dispatches end at 26 and 52; chunk 0's experts 26–28.5,
  // its combine 52–78, its gather 78–91; chunk 1's experts 52–54.5, combine 78–104, gather
  // 104–117. Backward (experts 5 s): the same ends, 117.
  EXPECT_EQ(monta::padded_capacity(l, monta::Strategy::dedup, 2), 12);
  expect_prediction(monta::predict(l, k, monta::Strategy::dedup, 2), 384, 768, 1536, 52, 26, 5, 117 + 117);
  // Experts that outlast the exchanges: at 32768 / 16 FLOP/s a chunk's experts take 24 + 1 s
  // forward. Chunk 0's run 26–51, chunk 1's wait for its dispatch: 52–77; the combines 52–78 and
  // 78–104, the last gather 104–117. Backward, 50 s each: chunk 0's 26–76, its combine 76–102,
  // chunk 1's 76–126, its combine 126–152, its gather 152–165.
  monta::Links slow = k;
  slow.gemm_flops = 32768.0 / 16;
  EXPECT_DOUBLE_EQ(monta::predict(l, slow, monta::Strategy::dedup, 2).seconds, 117 + 165);
  // The ring all-gather over t = 4 ranks pays t - 1 steps: EP group {0, 4}, 2 of the 8 experts
  // local, C = 10 padded to 12, 3 rows each per TP rank: 3 × 8 × 3 × 16 × 2 B = 2304 B,
  // 3 · 1 + 2304 / 64 = 39 s.
  l.t = 4;
  l.ep_ranks = {0, 4};
  EXPECT_DOUBLE_EQ(monta::predict(l, k, monta::Strategy::dedup, 1).all_gather_s, 39);
}

// One layout's figures by hand: 4 GPUs of one node, E = 4, M = 1024, H = 2048, 4096 tokens
// top-2 at capacity factor 1 (C = 2048), bf16, 3 MoE layers. TP must divide the 2 KV heads: no
// TP 4.
TEST(TimeModel, LayoutTermsByHand) {
  monta::LayoutQuery q{.world = 4, .heads = 8, .kv_heads = 2, .E = 4, .M = 1024, .H = 2048, .tokens = 4096,
                       .top_k = 2, .capacity_factor = 1.0, .bytes = 2, .device_memory = 0, .moe_layers = 3};
  monta::Links k = a800x2_links();
  const auto r = monta::rank_layouts(q, k);
  ASSERT_EQ(r.size(), 2u * 3u);  // tp 1, 2 × ep 1, 2, 4
  const monta::LayoutPrediction* p = nullptr;
  for (const auto& x : r) {
    EXPECT_NE(x.tp, 4);
    if (x.tp == 2 && x.ep == 2) p = &x;
  }
  ASSERT_NE(p, nullptr);
  // Its best candidate is the layer's: EP group {0, 1}, TP 2, C = 2048.
  const monta::Layer l{.E = 4, .C = 2048, .M = 1024, .H = 2048, .bytes = 2, .t = 2, .ep_ranks = {0, 1}};
  EXPECT_DOUBLE_EQ(p->best.seconds, monta::candidates(l, k, q.max_chunks).front().seconds);
  ASSERT_EQ(p->best.strategy, monta::Strategy::dedup);
  // A TP group of 2 routes the 4096 tokens once for both ranks: 2 GPU-seconds per step.
  EXPECT_DOUBLE_EQ(p->seconds_per_token, p->best.seconds * 2 / 4096);
  // Memory: 2 experts of 2 × 1024 × 2048 weights in 3 layers at 2 + 2 + 12 bytes each (bf16
  // weights and gradients, Adam's fp32 master, m and v); the padded rows (2048 of each of 4
  // experts) for the input, the all-gather and T_DI, [8192, 1024] bf16 each; T_M [4096, 2048]
  // for this TP rank's half of the rows.
  EXPECT_DOUBLE_EQ(p->memory_bytes, 3.0 * 2 * 2 * 1024 * 2048 * 16 + 3.0 * 8192 * 1024 * 2 + 4096.0 * 2048 * 2);
  q.kv_heads = 4;
  EXPECT_EQ(monta::rank_layouts(q, k).size(), 3u * 3u);
}

// The layouts "where asked": every TP degree of a node and EP degree of the world, ranked by
// the MoE layer's GPU time per token; with TP > 1 deduplication wins; a device too small for
// the experts' states fits nothing.
TEST(TimeModel, LayoutsRankedWithinMemory) {
  monta::LayoutQuery q;
  q.world = 16;
  q.heads = q.kv_heads = 8;
  q.E = 16;
  q.M = 8192;
  q.H = 5376;
  q.tokens = 8192;
  q.top_k = 2;
  q.capacity_factor = 1.0;
  q.device_memory = 80.0 * (1 << 30);
  q.moe_layers = 24;  // MoNTA-2x70B at the suite's 24 layers
  const auto r = monta::rank_layouts(q, a800x2_links());
  ASSERT_EQ(r.size(), 4u * 5u);  // tp 1, 2, 4, 8 × ep 1, 2, 4, 8, 16
  for (std::size_t i = 1; i < r.size(); ++i)
    if (r[i - 1].fits == r[i].fits) {
      EXPECT_LE(r[i - 1].seconds_per_token, r[i].seconds_per_token);
    }
  for (const auto& p : r) {
    if (p.tp > 1) {
      EXPECT_EQ(p.best.strategy, monta::Strategy::dedup) << p.tp << " " << p.ep;
    }
    // Fewer EP ranks hold more experts: ep 1 holds all 16 of 24 layers with their Adam states
    // (1.41e9 parameters a layer × 16 bytes × 24 = 541 GB).
    if (p.ep == 1) {
      EXPECT_FALSE(p.fits);
    }
  }
  EXPECT_TRUE(r.front().fits);
  q.device_memory = 1e9;
  for (const auto& p : monta::rank_layouts(q, a800x2_links())) EXPECT_FALSE(p.fits);
}

}  // namespace
}  // namespace moelab
