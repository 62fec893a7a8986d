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
      EXPECT_EQ(a2a.pcie + ag.pcie, 0.0) << "rank " << r;
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
