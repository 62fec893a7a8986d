// harness/tests/sim_backend_test.cpp — the sim backend running the unchanged MoE layer:
// analytic collective times, the NIC bound across nodes, the virtual allocator against the
// cpu backend's, determinism, the routing model, and errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <numeric>

#include "harness/backends/sim/sim_backend.hpp"
#include "harness/nn/moe_layer.hpp"
#include "harness/runtime/error.hpp"
#include "harness/tests/sim_test_util.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab {
namespace {

using test::toy_cluster;  // harness/tests/sim_test_util.hpp

// Every rank sends `bytes_per_peer` to every other rank in one all-to-all-v; returns each
// rank's [arrive, done] from its timeline.
std::vector<OpRecord> one_all_to_all(const sim::ClusterModel& m, std::int64_t floats_per_peer) {
  SimOptions o;
  o.cluster = m;
  SimCluster cluster(o);
  const int n = cluster.size();
  std::vector<OpRecord> out(static_cast<std::size_t>(n));
  cluster.run([&](Backend& b, Communicator& c) {
    Stream& s = b.default_stream();
    Tensor send = b.empty({n * floats_per_peer}, DType::f32, MemCategory::buffers, s);
    Tensor recv = b.empty({n * floats_per_peer}, DType::f32, MemCategory::buffers, s);
    std::vector<Segment> segs;
    for (int p = 0; p < n; ++p)
      if (p != c.rank()) segs.push_back({p, p * floats_per_peer, floats_per_peer});
    c.barrier();
    b.clear_timeline();
    c.all_to_all_v(s, send, segs, recv, segs);
    b.synchronize();
    c.barrier();
    const auto tl = b.timeline();
    ASSERT_EQ(tl.size(), 1u);
    out[static_cast<std::size_t>(c.rank())] = tl[0];
  });
  return out;
}

TEST(SimCollectives, AllToAllMatchesAlphaBeta) {
  for (int n : {2, 4, 8}) {
    const double bw = 100e9, lat = 3e-6;
    const std::int64_t f = 1 << 20;  // 4 MiB to each peer
    const auto recs = one_all_to_all(toy_cluster(n, bw, lat), f);
    const double expect = lat + static_cast<double>(n - 1) * 4.0 * static_cast<double>(f) / bw;
    for (const auto& r : recs) EXPECT_NEAR(r.end - r.start, expect, 1e-12 * expect) << "n=" << n;
    EXPECT_EQ(recs[0].cost.comm_bytes, 4.0 * static_cast<double>(f) * (n - 1));
  }
}

TEST(SimCollectives, TwoNodeAllToAllIsBoundedByTheNic) {
  // 2 nodes x 4 GPUs; NVLink 10x faster than a NIC: the inter-node bytes through each GPU's
  // NIC (4 peers on the other node) set the time.
  const double nv = 250e9, nic = 25e9;
  const std::int64_t f = 1 << 18;
  const auto recs = one_all_to_all(toy_cluster(4, nv, 0, 2, nic, 0), f);
  const double bytes = 4.0 * static_cast<double>(f);
  const double nic_bound = 4 * bytes / nic;  // each GPU sends to 4 remote peers over its NIC
  for (const auto& r : recs) {
    EXPECT_GE(r.end - r.start, nic_bound * (1 - 1e-9));
    EXPECT_LE(r.end - r.start, nic_bound * 1.05);
  }
}

ModelConfig small_model() {
  ModelConfig m;
  m.d_model = 64;
  m.d_hidden = 256;
  m.num_experts = 8;
  m.top_k = 2;
  m.capacity_factor = 0;  // no dropping: buffer sizes do not depend on the routing
  return m;
}

// The same layer program, on a backend and a communicator.
std::size_t layer_peak(Backend& b, Communicator& c, const ModelConfig& m, std::int64_t T) {
  MoELayer layer(b, c, m);
  layer.init_parameters(1);
  Tensor x = b.empty({T, m.d_model}, DType::f32, MemCategory::activations, layer.compute_stream());
  Tensor dy = b.empty({T, m.d_model}, DType::f32, MemCategory::activations, layer.compute_stream());
  b.fill_zero(layer.compute_stream(), x);
  b.fill_zero(layer.compute_stream(), dy);
  Tensor y = layer.forward(x);
  Tensor dx = layer.backward(dy, 0.01f);
  b.synchronize();
  return b.memory().peak_device();
}

TEST(SimBackend, VirtualPeakEqualsTheCpuBackendsPeak) {
  const ModelConfig m = small_model();
  auto cpu = make_backend("cpu");
  auto self = make_self_communicator(*cpu);
  const std::size_t cpu_peak = layer_peak(*cpu, *self, m, 333);
  SimOptions o;
  o.cluster = toy_cluster(8, 100e9, 1e-6);
  o.ranks = 1;
  SimCluster cluster(o);
  std::size_t sim_peak = 0;
  cluster.run([&](Backend& b, Communicator& c) { sim_peak = layer_peak(b, c, m, 333); });
  EXPECT_EQ(sim_peak, cpu_peak);
  EXPECT_GT(sim_peak, 0u);
}

// A forward+backward of the layer on 8 simulated ranks; the timeline of rank 0.
std::vector<OpRecord> layer_timeline(const RoutingModel& routing, double* step = nullptr) {
  SimOptions o;
  o.cluster = toy_cluster(4, 100e9, 2e-6, 2, 25e9, 5e-6);
  o.cluster.efficiency.launch_latency = 4e-6;
  o.routing = routing;
  SimCluster cluster(o);
  std::vector<OpRecord> tl0;
  cluster.run([&](Backend& b, Communicator& c) {
    ModelConfig m = small_model();
    m.capacity_factor = 1.25;
    MoELayer layer(b, c, m);
    Tensor x = b.empty({4096, m.d_model}, DType::f32, MemCategory::activations, layer.compute_stream());
    c.barrier();
    const double t0 = b.now();
    Tensor y = layer.forward(x);
    Tensor dx = layer.backward(y, 0.0f);
    b.synchronize();
    c.barrier();
    if (c.rank() == 0) {
      tl0 = b.timeline();
      if (step) *step = b.now() - t0;
    }
  });
  return tl0;
}

TEST(SimBackend, DeterministicAndCoversEveryPhase) {
  double s1 = 0, s2 = 0;
  const auto a = layer_timeline(RoutingModel::parse("zipf:1.1", 7), &s1);
  const auto b = layer_timeline(RoutingModel::parse("zipf:1.1", 7), &s2);
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].name, b[i].name);
    EXPECT_EQ(a[i].start, b[i].start);  // bit for bit
    EXPECT_EQ(a[i].end, b[i].end);
  }
  EXPECT_EQ(s1, s2);
  EXPECT_GT(s1, 0.0);
  std::map<std::string, int> phases;
  for (const auto& r : a) ++phases[r.phase];
  for (const char* p : {"gate", "dispatch", "experts", "combine"}) EXPECT_GT(phases[p], 0) << p;
  // Stream order holds: no op on a stream starts before the previous one on it ended.
  std::map<int, double> last_end;
  for (const auto& r : a) {
    EXPECT_GE(r.start, last_end[r.stream_id] - 1e-15) << r.name;
    last_end[r.stream_id] = r.end;
  }
}

TEST(RoutingModel, SameSeedSameRoutingAndZipfIsSkewed) {
  const auto u = RoutingModel::parse("uniform", 3);
  EXPECT_EQ(u.draw(2, 5, 1000, 2, 16), RoutingModel::parse("uniform", 3).draw(2, 5, 1000, 2, 16));
  EXPECT_NE(u.draw(2, 5, 1000, 2, 16), u.draw(3, 5, 1000, 2, 16));
  const auto z = RoutingModel::parse("zipf:1.5", 3).draw(0, 0, 20000, 1, 16);
  std::int64_t total = 0, top = 0;
  for (auto c : z) {
    total += c;
    top = std::max(top, c);
  }
  EXPECT_EQ(total, 20000);
  EXPECT_GT(static_cast<double>(top) / static_cast<double>(total), 0.3);  // 1/H(16,1.5) ~ 0.41
  for (auto c : u.draw(0, 0, 16000, 2, 16)) EXPECT_NEAR(static_cast<double>(c), 2000.0, 200.0);
  EXPECT_THROW(RoutingModel::parse("zipf:-1", 1), ConfigError);
  EXPECT_THROW(RoutingModel::parse("normal", 1), ConfigError);
  EXPECT_THROW(RoutingModel::parse("trace:/nonexistent.json", 1), ConfigError);
}

// machine_rates' all-to-all rate (Eq. 10's W_comm) in closed form on catalogue clusters: the
// largest of the per-link terms, each at the rate NCCL's Simple protocol reaches on it.
TEST(SimBackend, AllToAllRateIsTheSlowestLinkAtNcclsEfficiency) {
  auto rate = [](const std::string& name) {
    SimOptions o;
    o.cluster = sim::load_cluster(name);
    SimCluster cluster(o);
    return cluster.backend(0).machine_rates(1024, 1024, 1024, DType::bf16).a2a_bytes;
  };
  // 64 ranks on 8 DGX A100: 56/64 of the bytes leave through the GPU's NIC (25 GB/s at the
  // p2p model's 0.92) and its PCIe link (24 GB/s, GPUDirect: full rate); 7/64 on NVLink.
  const sim::ClusterModel x8 = sim::load_cluster("dgx-a100x8");
  const sim::NodeSpec& nd = x8.node;
  const double nic = (56.0 / 64) / (nd.nic_bw * nd.p2p.net_efficiency);
  const double gdr = (56.0 / 64) / nd.pcie_bw;
  const double nvl = (7.0 / 64) / (nd.nvlink_bw * nd.p2p.intra_efficiency);
  EXPECT_NEAR(rate("dgx-a100x8"), 1.0 / std::max({nic, gdr, nvl}), 1e-6 * rate("dgx-a100x8"));
  EXPECT_LT(nd.p2p.net_efficiency, 1.0);  // the efficiency is what the test is about
  // One node: NVLink alone, (g-1)/g of the bytes at the intra-node efficiency.
  EXPECT_NEAR(rate("dgx-a100x1"), (8.0 / 7) * nd.nvlink_bw * nd.p2p.intra_efficiency, 1e-6 * rate("dgx-a100x1"));
  // A PCIe node: the GPU's link carries its 7/8, the switch uplink p(g-p)/g at the intra
  // efficiency; the larger binds.
  const sim::NodeSpec& pn = sim::load_cluster("pcie-a30x1").node;
  const double g = pn.gpus, p = pn.gpus_per_pcie_switch;
  const double link = ((g - 1) / g) / (pn.pcie_bw * pn.p2p.intra_efficiency);
  const double up = p > 0 && g > p ? p * (g - p) / g / (pn.pcie_switch_uplink_bw * pn.p2p.intra_efficiency) : 0.0;
  EXPECT_NEAR(rate("pcie-a30x1"), 1.0 / std::max(link, up), 1e-6 * rate("pcie-a30x1"));

  // The links a topology-aware model reads (MoNTA's) at the same efficiencies as the
  // collectives are charged: NVLink at the intra-node share, each NIC at the network's.
  SimOptions o;
  o.cluster = sim::load_cluster("a800x2");
  SimCluster cluster(o);
  const MachineRates r = cluster.backend(0).machine_rates(1024, 1024, 1024, DType::bf16);
  const sim::NodeSpec& an = o.cluster.node;
  EXPECT_DOUBLE_EQ(r.intra_bw, an.nvlink_bw * an.p2p.intra_efficiency);
  EXPECT_DOUBLE_EQ(r.nic_bw, an.nic_bw * an.p2p.net_efficiency);
  EXPECT_LT(an.p2p.intra_efficiency, 1.0);
}

// a2a_bytes_among against what the sim charges: every group of a layout exchanges at once (an
// expert-parallel layer's groups do), each member sending the same bytes to each member; the
// seconds per send byte from two sizes (the fixed latencies cancel). The world's own group gives
// machine_rates' a2a_bytes; a group on one node runs at NVLink's rate, several times the world's.
TEST(SimBackend, AllToAllRateAmongAGroupIsWhatTheSimCharges) {
  struct Case {
    const char* cluster;
    int (*color)(int);
    const char* what;
    int ranks = 0;  // 0: the cluster's GPUs
  };
  const Case cases[] = {
      {"a800x2", [](int r) { return r / 8; }, "one group per node (ScMoE's ep=8 on 16 ranks)"},
      {"a800x2", [](int r) { return r % 8; }, "one member per node, 8 groups, a NIC each"},
      {"a800x2-nic4", [](int r) { return r % 8; }, "one member per node, two groups behind each NIC"},
      {"dgx-a100x2", [](int r) { return (r % 8) / 4; }, "4 members on each of 2 nodes"},
      {"pcie-a30x1", [](int r) { return r % 2; }, "every member behind its own PCIe switch, 2 groups"},
      {"pcie-a30x1", [](int r) { return r / 4; }, "2 switches per group"},
      {"dgx-a100x2", [](int) { return 0; }, "the world"},
      {"a800x2", [](int) { return 0; }, "a world of 12 ranks: the second node's 4 carry 8/12 through each NIC", 12},
  };
  for (const Case& k : cases) {
    SimOptions o;
    o.cluster = sim::load_cluster(k.cluster);
    if (k.ranks) o.ranks = k.ranks;
    SimCluster cluster(o);
    double per_byte = 0, among = 0, world_rate = 0, rates_a2a = 0;
    int group_size = 0;
    cluster.run([&](Backend& b, Communicator& world) {
      auto g = world.split(k.color(world.rank()), world.rank());
      const int n = g->size();
      const std::int64_t f = 1 << 20;  // floats to each member at the larger size
      Stream& s = b.default_stream();
      Tensor send = b.empty({n * f}, DType::f32, MemCategory::buffers, s);
      Tensor recv = b.empty({n * f}, DType::f32, MemCategory::buffers, s);
      double took[2] = {0, 0};
      for (int i = 0; i < 2; ++i) {
        const std::int64_t c = f / (2 - i);
        std::vector<Segment> segs;
        for (int p = 0; p < n; ++p) segs.push_back({p, p * c, c});
        b.synchronize();
        world.barrier();  // the sim prices an epoch when every rank reaches a barrier
        const double t0 = b.now();
        g->all_to_all_v(s, send, segs, recv, segs);
        b.synchronize();
        world.barrier();
        took[i] = b.now() - t0;
      }
      if (world.rank() == 0) {
        per_byte = (took[1] - took[0]) / (4.0 * static_cast<double>(n) * static_cast<double>(f / 2));
        among = b.a2a_bytes_among(g->world_ranks());
        rates_a2a = b.machine_rates(1024, 1024, 1024, DType::bf16).a2a_bytes;
        std::vector<int> all(static_cast<std::size_t>(world.size()));
        std::iota(all.begin(), all.end(), 0);
        world_rate = b.a2a_bytes_among(all);
        group_size = n;
      }
    });
    ASSERT_GT(per_byte, 0.0) << k.cluster << ": " << k.what;
    EXPECT_NEAR(among * per_byte, 1.0, 1e-9) << k.cluster << ": " << k.what << " (" << group_size << " members): "
                                             << among / 1e9 << " GB/s, the sim charged " << 1e-9 / per_byte;
    EXPECT_DOUBLE_EQ(world_rate, rates_a2a) << k.cluster;
  }
  // The rate is the group's, not the world's: one node of a800x2 at NVLink's rate (8/7 of a
  // GPU's link at the intra-node efficiency), the world's bound by the NICs.
  SimOptions o;
  o.cluster = sim::load_cluster("a800x2");
  SimCluster cluster(o);
  const Backend& b = cluster.backend(0);
  const std::vector<int> node0{0, 1, 2, 3, 4, 5, 6, 7};
  const sim::NodeSpec& nd = o.cluster.node;
  EXPECT_NEAR(b.a2a_bytes_among(node0), (8.0 / 7) * nd.nvlink_bw * nd.p2p.intra_efficiency, 1e-9 * nd.nvlink_bw);
  EXPECT_GT(b.a2a_bytes_among(node0), 3 * b.machine_rates(1, 1, 1, DType::bf16).a2a_bytes);
  EXPECT_EQ(b.a2a_bytes_among(std::vector<int>{3}), 0.0);  // one member: no exchange
  EXPECT_THROW(b.a2a_bytes_among(std::vector<int>{0, 0}), std::invalid_argument);
  EXPECT_THROW(b.a2a_bytes_among(std::vector<int>{0, 16}), std::invalid_argument);
}

// machine_rates' host-copy rates against what the sim charges: every rank of the node copies
// the same bytes to the host at once (as MPipeMoE's offload and ScMoE's expert migration do),
// and each copy takes bytes / host_copy_bytes_all_ranks; one rank alone takes bytes /
// host_copy_bytes. On a DGX A100 two GPUs share a PCIe switch's uplink, so with both copying
// each gets half of it; the A800 node declares no switches and keeps its own link's rate.
TEST(SimBackend, HostCopyRatesAreWhatTheSimChargesAloneAndWithEveryRankCopying) {
  const std::int64_t n = 1 << 24;  // 64 MiB of f32
  // Seconds per byte: a copy of 2n elements less one of n (the fixed latencies cancel).
  auto copy_seconds = [&](const std::string& name, int ranks) {
    SimOptions o;
    o.cluster = sim::load_cluster(name);
    o.ranks = ranks;
    SimCluster cluster(o);
    double seconds = 0;
    MachineRates r;
    cluster.run([&](Backend& b, Communicator& c) {
      Stream& s = b.default_stream();
      Tensor src = b.empty({2 * n}, DType::f32, MemCategory::buffers, s);
      Tensor dst = b.empty({2 * n}, DType::f32, MemCategory::buffers, s, MemSpace::host_pinned);
      b.fill_zero(s, src);
      double took[2] = {0, 0};
      for (int i = 0; i < 2; ++i) {
        Tensor from = src.rows(0, (i + 1) * n), to = dst.rows(0, (i + 1) * n);
        b.synchronize();
        c.barrier();  // the sim prices an epoch when every rank reaches a barrier
        const double t0 = b.now();
        b.copy(s, from, to);
        b.synchronize();
        c.barrier();
        took[i] = b.now() - t0;
      }
      if (c.rank() == 0) {
        seconds = (took[1] - took[0]) / (4.0 * static_cast<double>(n));
        r = b.machine_rates(1024, 1024, 1024, DType::f32);
      }
    });
    return std::make_pair(seconds, r);
  };
  const sim::NodeSpec dgx = sim::load_cluster("dgx-a100x1").node;
  ASSERT_GE(dgx.gpus_per_pcie_switch, 2);
  const auto [alone, r1] = copy_seconds("dgx-a100x1", 1);
  const auto [shared, r8] = copy_seconds("dgx-a100x1", 8);
  EXPECT_DOUBLE_EQ(r1.host_copy_bytes, r1.host_copy_bytes_all_ranks);  // one rank: nothing shared
  EXPECT_DOUBLE_EQ(r8.host_copy_bytes, r1.host_copy_bytes);
  EXPECT_DOUBLE_EQ(r8.host_copy_bytes_all_ranks,
                   std::min(dgx.host_copy_bw, dgx.pcie_switch_uplink_bw / dgx.gpus_per_pcie_switch));
  EXPECT_NEAR(alone * r1.host_copy_bytes, 1.0, 1e-6);
  EXPECT_NEAR(shared * r8.host_copy_bytes_all_ranks, 1.0, 1e-6);
  EXPECT_GT(shared, 1.5 * alone);
  // A PCIe node: the switch uplink again.
  const auto [pcie, rp] = copy_seconds("pcie-a30x1", 8);
  EXPECT_LT(rp.host_copy_bytes_all_ranks, rp.host_copy_bytes);
  EXPECT_NEAR(pcie * rp.host_copy_bytes_all_ranks, 1.0, 1e-6);
  // No switches declared (the H100 node): every rank keeps its own link.
  ASSERT_EQ(sim::load_cluster("h100x1").node.gpus_per_pcie_switch, 0);
  const auto [own, ra] = copy_seconds("h100x1", 8);
  EXPECT_DOUBLE_EQ(ra.host_copy_bytes_all_ranks, ra.host_copy_bytes);
  EXPECT_NEAR(own * ra.host_copy_bytes, 1.0, 1e-6);
}

// Ring collectives as NCCL runs them. On 2 DGX A100 nodes a 16-rank all-reduce moves
// 2(n-1)/n of the buffer over each ring edge; the two edges between the nodes are striped over
// the 8 NICs (one ring per channel, each leaving its node through another GPU's NIC), so the
// bytes' time is those bytes over 8 NICs at NCCL's network efficiency, the slowest link of the
// ring (a GPU's NVLink at the intra-node efficiency carries its whole edge). And no member
// leaves before the last one has arrived: rank 5 arrives late, every rank ends after it, all
// at once.
TEST(SimBackend, RingAllReduceStripesTheEdgesBetweenNodesAndWaitsForEveryMember) {
  SimOptions o;
  o.cluster = sim::load_cluster("dgx-a100x2");
  const sim::NodeSpec& nd = o.cluster.node;
  ASSERT_EQ(nd.nics, 8);
  SimCluster cluster(o);
  const int n = 16;
  const std::int64_t elems = 1 << 22;  // 16 MiB of f32
  std::vector<double> took(2 * n), arrive(n), end(n);
  cluster.run([&](Backend& b, Communicator& c) {
    Stream& s = b.default_stream();
    Tensor buf = b.empty({2 * elems}, DType::f32, MemCategory::buffers, s);
    b.fill_zero(s, buf);
    for (int i = 0; i < 2; ++i) {  // S and 2S: the difference is the bytes' time
      Tensor x = buf.rows(0, (i + 1) * elems);
      b.synchronize();
      c.barrier();
      const double t0 = b.now();
      c.all_reduce(s, x);
      b.synchronize();
      c.barrier();
      took[static_cast<std::size_t>(i * n + c.rank())] = b.now() - t0;
    }
    // A late member: rank 5 zeroes the whole buffer 8 times first (HBM-bound work).
    b.synchronize();
    c.barrier();
    b.clear_timeline();
    if (c.rank() == 5)
      for (int k = 0; k < 8; ++k) b.fill_zero(s, buf);
    Tensor x = buf.rows(0, elems);
    c.all_reduce(s, x);
    b.synchronize();
    c.barrier();
    for (const OpRecord& r : b.timeline())
      if (r.name == "all_reduce") {
        arrive[static_cast<std::size_t>(c.rank())] = r.start;
        end[static_cast<std::size_t>(c.rank())] = r.end;
      }
  });
  const double S = 4.0 * static_cast<double>(elems), edge = 2.0 * (n - 1) / n * S;
  const double per_nic = nd.nic_bw * nd.p2p.net_efficiency;
  ASSERT_LT(edge / (8 * per_nic), edge / (nd.nvlink_bw * nd.p2p.intra_efficiency) * 1.5);
  for (int r = 0; r < n; ++r)
    EXPECT_NEAR(took[static_cast<std::size_t>(n + r)] - took[static_cast<std::size_t>(r)], edge / (8 * per_nic),
                1e-3 * edge / (8 * per_nic)) << "rank " << r;
  const double late = *std::max_element(arrive.begin(), arrive.end());
  EXPECT_EQ(late, arrive[5]);
  for (int r = 0; r < n; ++r) EXPECT_GE(end[static_cast<std::size_t>(r)], late + edge / (8 * per_nic)) << "rank " << r;
  // ... and all leave together, when the ring's last step ends.
  EXPECT_LT(*std::max_element(end.begin(), end.end()) - *std::min_element(end.begin(), end.end()), 1e-9);
}

// mark_untimed: a stretch every rank marks takes no virtual time and leaves what follows
// exactly as it would be; one rank's mark alone changes nothing.
TEST(SimBackend, UntimedStretchIsNotPricedAndLeavesTheNextStepAlone) {
  const std::int64_t f = 1 << 18;
  // marks: which ranks mark the first stretch. Returns, per rank, the virtual time after the
  // first stretch and the duration of the second (same work).
  auto run = [&](const std::vector<bool>& marks) {
    SimOptions o;
    o.cluster = toy_cluster(4, 100e9, 3e-6);
    SimCluster cluster(o);
    std::vector<std::pair<double, double>> out(4);
    cluster.run([&](Backend& b, Communicator& c) {
      Stream& s = b.default_stream();
      Tensor send = b.empty({4 * f}, DType::f32, MemCategory::buffers, s);
      Tensor recv = b.empty({4 * f}, DType::f32, MemCategory::buffers, s);
      std::vector<Segment> segs;
      for (int p = 0; p < 4; ++p)
        if (p != c.rank()) segs.push_back({p, p * f, f});
      auto stretch = [&] {
        b.fill_zero(s, send);
        c.all_to_all_v(s, send, segs, recv, segs);
        b.synchronize();
      };
      c.barrier();
      const double t0 = b.now();
      stretch();
      if (marks[static_cast<std::size_t>(c.rank())]) b.mark_untimed();
      c.barrier();
      const double t1 = b.now();
      stretch();
      c.barrier();
      out[static_cast<std::size_t>(c.rank())] = {t1 - t0, b.now() - t1};
    });
    return out;
  };
  const auto priced = run({false, false, false, false});
  const auto skipped = run({true, true, true, true});
  const auto one = run({false, true, false, false});
  for (int r = 0; r < 4; ++r) {
    EXPECT_GT(priced[r].first, 0.0);
    EXPECT_EQ(skipped[r].first, 0.0) << "rank " << r;
    EXPECT_NEAR(skipped[r].second, priced[r].second, 1e-12 * priced[r].second) << "rank " << r;
    EXPECT_EQ(one[r].first, priced[r].first) << "rank " << r;
    EXPECT_EQ(priced[r].first, priced[r].second) << "rank " << r;  // the same work twice
  }
}

TEST(SimCluster, AFailingRankStopsTheOthersWithAClearError) {
  SimOptions o;
  o.cluster = toy_cluster(4, 100e9, 1e-6);
  SimCluster cluster(o);
  try {
    cluster.run([&](Backend&, Communicator& c) {
      if (c.rank() == 2) throw ConfigError("planted failure on rank 2");
      c.barrier();  // the others would wait here forever without the abort
    });
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("planted failure on rank 2"), std::string::npos);
  }
}

}  // namespace
}  // namespace moelab
