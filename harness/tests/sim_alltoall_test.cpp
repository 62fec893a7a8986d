// harness/tests/sim_alltoall_test.cpp — the sim backend's all-to-all as NCCL runs it and the
// PCIe links a DGX-style node shares, against closed forms (docs/PERFORMANCE.md, "All-to-all
// as NCCL runs it" and "Resources and routes"):
//   * a uniform all-to-all of N ranks, S bytes to every peer, on an idle cluster, inside one
//     node and across nodes, in the LL (small-message) and Simple regimes;
//   * a host copy and an inter-node transfer of one GPU share its PCIe link;
//   * two GPUs behind one PCIe switch share its uplink, two behind different switches do not.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <mutex>

#include "harness/backends/sim/sim_backend.hpp"
#include "harness/runtime/error.hpp"
#include "harness/tests/sim_test_util.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab {
namespace {

// `nodes` nodes of `gpus` GPUs on an NVSwitch, one NIC per GPU, with NCCL's p2p terms p: the
// toy cluster (harness/tests/sim_test_util.hpp) at a DGX's link figures.
sim::ClusterModel nccl_cluster(int gpus, int nodes, const sim::P2pModel& p) {
  sim::ClusterModel m = test::toy_cluster(gpus, 300e9, 3e-6, nodes, 25e9, 5e-6);
  m.name = "nccl-toy";
  m.node.pcie_latency = 3e-6;
  m.node.host_copy_bw = 24e9;
  m.node.p2p = p;
  m.fabric_latency = 0.5e-6;
  return m;
}

// NCCL's A100 figures (experiments/hardware/nodes.json, dgx-a100-40gb).
sim::P2pModel a100_p2p() {
  sim::P2pModel p;
  p.base_latency_simple = 8.4e-6;
  p.base_latency_ll = 6.6e-6;
  p.ll_threshold = 16384;
  p.ll_efficiency = 0.5;
  p.intra_efficiency = 0.8;
  p.net_efficiency = 0.92;
  p.intra_peer_overhead = 0.6e-6;
  p.net_peer_overhead = 2e-6;
  return p;
}

// Every rank sends `bytes` to every other rank in one all-to-all-v (bf16 elements, so 1 KiB
// is a whole number of them); each rank's [start, end].
std::vector<OpRecord> uniform_all_to_all(const sim::ClusterModel& m, std::int64_t bytes) {
  SimOptions o;
  o.cluster = m;
  SimCluster cluster(o);
  const int n = cluster.size();
  const std::int64_t elems = bytes / 2;
  std::vector<OpRecord> out(static_cast<std::size_t>(n));
  cluster.run([&](Backend& b, Communicator& c) {
    Stream& s = b.default_stream();
    Tensor send = b.empty({n * elems}, DType::bf16, MemCategory::buffers, s);
    Tensor recv = b.empty({n * elems}, DType::bf16, MemCategory::buffers, s);
    std::vector<Segment> segs;
    for (int p = 0; p < n; ++p)
      if (p != c.rank()) segs.push_back({p, p * elems, elems});
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

// The closed form of docs/PERFORMANCE.md for a uniform all-to-all on an idle cluster of
// `nodes` x g GPUs (one NIC per GPU): per sender, its g-1 NVLink messages and its N-g remote
// ones each form a queue on one bottleneck (its NVLink port; its NIC or PCIe link), the k-th
// message of a kind starting k per-peer overheads after the first:
//   T_kind = max_k ( base + lat_kind + k·o_kind + (P_kind − k)·τ_kind ),  k = 0 .. P_kind − 1
// with τ the seconds one message occupies the bottleneck alone; T = max over the two kinds.
double closed_form(const sim::ClusterModel& m, double S) {
  const sim::NodeSpec& nd = m.node;
  const sim::P2pModel& p = nd.p2p;
  const int g = nd.gpus, N = m.nodes * g;
  const bool ll = S <= p.ll_threshold;
  const double base = ll ? p.base_latency_ll : p.base_latency_simple;
  const auto queue = [&](int peers, double lat, double o, double tau) {
    double t = 0;
    for (int k = 0; k < peers; ++k) t = std::max(t, base + lat + k * o + (peers - k) * tau);
    return t;
  };
  const double e_nv = ll ? p.ll_efficiency : p.intra_efficiency;
  double T = queue(g - 1, nd.nvlink_latency, p.intra_peer_overhead, S / e_nv / nd.nvlink_bw);
  if (N > g) {
    const double e_net = ll ? p.ll_efficiency : p.net_efficiency;
    double tau = S / e_net / nd.nic_bw;
    if (nd.pcie_switches()) tau = std::max(tau, S / (ll ? p.ll_efficiency : 1.0) / nd.pcie_bw);
    T = std::max(T, queue(N - g, nd.nic_latency + m.fabric_latency, p.net_peer_overhead, tau));
  }
  return T;
}

void expect_closed_form(const sim::ClusterModel& m, std::int64_t S, const std::string& what) {
  const double expect = closed_form(m, static_cast<double>(S));
  const auto recs = uniform_all_to_all(m, S);
  for (const auto& r : recs) EXPECT_NEAR(r.end - r.start, expect, 1e-9 * expect) << what << " S=" << S;
}

TEST(SimAllToAll, InsideOneNodeMatchesTheClosedForm) {
  for (int n : {2, 4, 8})
    for (std::int64_t S : {std::int64_t{1024}, std::int64_t{16384}, std::int64_t{65536}, std::int64_t{4} << 20})
      expect_closed_form(nccl_cluster(n, 1, a100_p2p()), S, "n=" + std::to_string(n));
}

TEST(SimAllToAll, AcrossNodesMatchesTheClosedForm) {
  for (int nodes : {2, 4})
    for (std::int64_t S : {std::int64_t{1024}, std::int64_t{16384}, std::int64_t{65536}, std::int64_t{4} << 20})
      expect_closed_form(nccl_cluster(4, nodes, a100_p2p()), S, "nodes=" + std::to_string(nodes));
}

// The small-message regime by hand: 8 GPUs, 1 KiB per peer (LL). Each message takes
// 1024 / (0.5 · 300e9) = 6.8 ns on NVLink, far below the 0.6 us between posts, so the last
// (7th) message ends 6.6 + 3 + 6 · 0.6 us + 6.8 ns after the call.
TEST(SimAllToAll, SmallMessagesPayTheirPerPeerLatency) {
  const auto recs = uniform_all_to_all(nccl_cluster(8, 1, a100_p2p()), 1024);
  const double expect = 6.6e-6 + 3e-6 + 6 * 0.6e-6 + 1024 / (0.5 * 300e9);
  for (const auto& r : recs) EXPECT_NEAR(r.end - r.start, expect, 1e-9 * expect);
  // Large messages: bandwidth-bound at 80% of NVLink; the stagger of posts hides behind the
  // transfers, so T = 8.4 + 3 us + 7 · S / (0.8 · 300e9).
  const double S = 4 << 20;
  const auto big = uniform_all_to_all(nccl_cluster(8, 1, a100_p2p()), 4 << 20);
  const double expect_big = 8.4e-6 + 3e-6 + 7 * S / (0.8 * 300e9);
  for (const auto& r : big) EXPECT_NEAR(r.end - r.start, expect_big, 1e-9 * expect_big);
}

// The catalogue's DGX A100 (its PCIe switches included: a GPU's x16 link at 24 GB/s carries
// its NIC traffic, so across nodes the link, not the NIC at 0.92 · 25 = 23 GB/s, binds).
TEST(SimAllToAll, CatalogueDgxA100MatchesTheClosedForm) {
  for (const char* name : {"dgx-a100x1", "dgx-a100x2"}) {
    const sim::ClusterModel m = sim::load_cluster(name);
    ASSERT_FALSE(m.node.p2p.ideal());
    ASSERT_TRUE(m.node.pcie_switches());
    for (std::int64_t S : {std::int64_t{1024}, std::int64_t{65536}, std::int64_t{16} << 20}) expect_closed_form(m, S, name);
  }
}

// ---- shared PCIe links ------------------------------------------------------------------

// 2 nodes x 4 GPUs, 2 GPUs per PCIe switch; PCIe slower than the NIC and the copy engines,
// every latency L.
sim::ClusterModel pcie_switched(double gpu_link, double uplink) {
  sim::ClusterModel m = nccl_cluster(4, 2, sim::P2pModel{});
  m.node.gpus_per_pcie_switch = 2;
  m.node.pcie_bw = gpu_link;
  m.node.pcie_switch_uplink_bw = uplink;
  m.node.nic_bw = 100e9;
  m.node.host_copy_bw = 200e9;
  m.node.nic_latency = 2e-6;
  m.node.pcie_latency = 2e-6;
  m.fabric_latency = 0;
  return m;
}

// Ranks `copiers` copy `bytes` device -> host on one stream while (if `to` >= 0) rank
// `sender` sends `bytes` to rank `to` on another; the [start, end] of every op by name. A
// copy's record starts after its latency, a send's when it is issued.
std::map<std::string, std::pair<double, double>> copies_and_send(const sim::ClusterModel& m, std::vector<int> copiers,
                                                                 int sender, int to, std::int64_t bytes) {
  SimOptions o;
  o.cluster = m;
  SimCluster cluster(o);
  std::map<std::string, std::pair<double, double>> out;
  std::mutex mu;
  cluster.run([&](Backend& b, Communicator& c) {
    Stream& cs = b.create_stream(StreamRole::d2h, "copy");
    Stream& ns = b.create_stream(StreamRole::dispatch, "comm");
    const std::int64_t n = bytes / 4;
    Tensor dev = b.empty({n}, DType::f32, MemCategory::buffers, cs);
    Tensor host = b.empty({n}, DType::f32, MemCategory::buffers, cs, MemSpace::host_pinned);
    Tensor msg = b.empty({n}, DType::f32, MemCategory::buffers, ns);
    c.barrier();
    b.clear_timeline();
    if (std::find(copiers.begin(), copiers.end(), c.rank()) != copiers.end()) b.copy(cs, dev, host);
    if (c.rank() == sender) c.send(ns, msg, to);
    if (c.rank() == to) c.recv(ns, msg, sender);
    b.synchronize();
    c.barrier();
    std::lock_guard lk(mu);
    for (const auto& r : b.timeline()) out[r.name + "@" + std::to_string(c.rank())] = {r.start, r.end};
  });
  return out;
}

TEST(SimPcieSwitches, HostCopyAndInterNodeTrafficShareTheGpusLink) {
  const double P = 20e9, U = 80e9, L = 2e-6;
  const std::int64_t B = 64 << 20;
  const double b = static_cast<double>(B);
  // Alone: a copy takes L + B/P, a send to the other node L + B/P (the GPU's link binds,
  // not the NIC).
  auto alone = copies_and_send(pcie_switched(P, U), {0}, -1, -1, B);
  EXPECT_NEAR(alone.at("copy@0").second - alone.at("copy@0").first, b / P, 1e-9);
  auto send_alone = copies_and_send(pcie_switched(P, U), {}, 0, 4, B);
  EXPECT_NEAR(send_alone.at("send@0").second - send_alone.at("send@0").first, L + b / P, 1e-9);
  // Together on GPU 0: both cross rank0.pcie_up, each at P/2, so both end at L + 2B/P.
  auto both = copies_and_send(pcie_switched(P, U), {0}, 0, 4, B);
  EXPECT_NEAR(both.at("copy@0").second - both.at("copy@0").first, 2 * b / P, 1e-9);
  EXPECT_NEAR(both.at("send@0").second - both.at("send@0").first, L + 2 * b / P, 1e-9);
  EXPECT_NEAR(both.at("send@0").second, both.at("copy@0").second, 1e-9);
  // The transfer into GPU 4 and a copy out of GPU 4 use opposite directions: no sharing.
  auto opposite = copies_and_send(pcie_switched(P, U), {4}, 0, 4, B);
  EXPECT_NEAR(opposite.at("copy@4").second - opposite.at("copy@4").first, b / P, 1e-9);
}

TEST(SimPcieSwitches, TwoGpusBehindOneSwitchShareItsUplink) {
  const double P = 20e9, U = 24e9, L = 2e-6;
  const std::int64_t B = 64 << 20;
  const double b = static_cast<double>(B);
  // GPUs 0 and 1 sit behind switch 0: the uplink (24 GB/s) gives each 12 GB/s.
  auto same = copies_and_send(pcie_switched(P, U), {0, 1}, -1, -1, B);
  for (const char* k : {"copy@0", "copy@1"}) EXPECT_NEAR(same.at(k).second - same.at(k).first, 2 * b / U, 1e-9) << k;
  // GPUs 0 and 2 sit behind switches 0 and 1: each copies at its own link's 20 GB/s.
  auto apart = copies_and_send(pcie_switched(P, U), {0, 2}, -1, -1, B);
  for (const char* k : {"copy@0", "copy@2"}) EXPECT_NEAR(apart.at(k).second - apart.at(k).first, b / P, 1e-9) << k;
  // An inter-node send of GPU 1 does not cross the uplink (its NIC is on its switch): GPU 0's
  // copy keeps the whole uplink (15 GB/s here), GPU 1's send its own link.
  auto gdr = copies_and_send(pcie_switched(P, 15e9), {0}, 1, 5, B);
  EXPECT_NEAR(gdr.at("copy@0").second - gdr.at("copy@0").first, b / 15e9, 1e-9);
  EXPECT_NEAR(gdr.at("send@1").second - gdr.at("send@1").first, L + b / P, 1e-9);
}

}  // namespace
}  // namespace moelab
