// impls/monta/strategy.cpp — MoNTA's volume and time model and the choice from it (see
// strategy.hpp).
//   ctest --test-dir build -R monta
#include "impls/monta/strategy.hpp"

#include <algorithm>
#include <cmath>

#include "harness/runtime/error.hpp"

namespace moelab::monta {

const char* strategy_name(Strategy s) {
  return s == Strategy::flat ? "flat" : s == Strategy::dedup ? "dedup" : "hierarchical";
}

nlohmann::json Volume::to_json() const { return {{"intra", intra}, {"nic", nic}}; }

std::int64_t padded_capacity(const Layer& l, Strategy s, int chunks) {
  if (s != Strategy::dedup) return l.C;
  const std::int64_t unit = static_cast<std::int64_t>(l.t) * chunks;
  return (l.C + unit - 1) / unit * unit;
}

namespace {

int node_of(int world_rank, const Links& k) { return world_rank / std::max(k.gpus_per_node, 1); }

// Rows per expert each TP rank sends (its slice; the whole capacity without deduplication).
double rows_per_expert(const Layer& l, Strategy s, int chunks) {
  const double cp = static_cast<double>(padded_capacity(l, s, chunks));
  return s == Strategy::dedup ? cp / l.t : cp;
}

}  // namespace

Volume all_to_all_volume(const Layer& l, const Links& k, Strategy s, int chunks) {
  MOELAB_CHECK(!l.ep_ranks.empty() && l.E % static_cast<std::int64_t>(l.ep_ranks.size()) == 0,
               "monta::all_to_all_volume: E must divide over the EP group");
  const double El = static_cast<double>(l.E) / static_cast<double>(l.ep_ranks.size());
  const double per_peer = El * rows_per_expert(l, s, chunks) * static_cast<double>(l.M) * l.bytes;
  Volume v;
  const int me = node_of(l.rank, k);
  int local_peers = 0, remote_peers = 0;
  for (int p : l.ep_ranks) {
    if (p == l.rank) continue;
    (node_of(p, k) == me ? local_peers : remote_peers)++;
  }
  v.intra = local_peers * per_peer;
  v.nic = remote_peers * per_peer;
  if (s == Strategy::hierarchical && remote_peers > 0) {
    // Step 1 moves, to each local peer j, the rows for local index j on the other nodes (and
    // its own): the remote rows whose destination's local index is not this rank's go over
    // NVLink first. With g GPUs per node in the group, (g-1)/g of them.
    const double g = static_cast<double>(local_peers + 1);
    v.intra += v.nic * (g - 1) / g;
  }
  return v;
}

Volume all_gather_volume(const Layer& l, const Links&, Strategy s, int chunks) {
  Volume v;
  if (s != Strategy::dedup || l.t <= 1) return v;
  // Each TP rank's slice of every expert, to each of the t-1 others (the TP group is inside a
  // node: Megatron's order puts TP innermost).
  v.intra = (l.t - 1) * static_cast<double>(l.E) * rows_per_expert(l, s, chunks) * static_cast<double>(l.M) * l.bytes;
  return v;
}

namespace {

// One exchange of `v` bytes split into `pieces` equal pieces: the time of one piece.
double exchange_seconds(const Volume& v, const Links& k, double pieces, bool hierarchical) {
  double intra = v.intra > 0 ? k.intra_latency + v.intra / pieces / k.intra_bw : 0.0;
  double nic = 0;
  if (v.nic > 0) {
    // GPU i uses NIC i % nics: every GPU of the node sending at once shares its NIC with
    // gpus/nics others. A rail-aggregated exchange sends g times fewer messages.
    const double share = static_cast<double>(k.gpus_per_node) / std::max(k.nics, 1);
    nic = k.nic_latency + v.nic / pieces * share / k.nic_bw;
  }
  // The flat exchange runs its NVLink and NIC transfers at once; the two-level one in two steps.
  return hierarchical ? intra + nic : std::max(intra, nic);
}

}  // namespace

Prediction predict(const Layer& l, const Links& k, Strategy s, int chunks) {
  MOELAB_CHECK(k.known(), "monta::predict: the machine's link rates are unknown");
  MOELAB_CHECK(chunks >= 1, "monta::predict: chunks must be positive");
  Prediction p;
  p.strategy = s;
  p.chunks = s == Strategy::dedup ? chunks : 1;
  p.impl = s == Strategy::flat ? "deepspeed-tp" : s == Strategy::hierarchical ? "hierarchical"
                                                                              : p.chunks == 1 ? "deepspeed-drop" : "monta";
  const int n = p.chunks;
  p.a2a = all_to_all_volume(l, k, s, n);
  p.gather = all_gather_volume(l, k, s, n);
  const double pieces = n;
  const double a = exchange_seconds(p.a2a, k, pieces, s == Strategy::hierarchical);
  // Ring all-gather over t ranks: t-1 steps of one rank's block.
  const double g = p.gather.intra > 0
                       ? (l.t - 1) * k.intra_latency + p.gather.intra / pieces / k.intra_bw
                       : 0.0;
  // The experts of one chunk: FC1 and FC2 over the rows that reach this rank's experts
  // (El experts, P sources, each the rows per expert a source sends), plus their launches.
  const double P = static_cast<double>(l.ep_ranks.size()), El = static_cast<double>(l.E) / P;
  const double rows = El * P * rows_per_expert(l, s, n) / pieces;
  const double rate = k.gemm_flops_at ? k.gemm_flops_at(static_cast<std::int64_t>(P * rows_per_expert(l, s, n) / pieces))
                                      : k.gemm_flops;
  const double x = 2.0 * 2.0 * rows * static_cast<double>(l.M) * static_cast<double>(l.H) / rate + 2 * El * k.launch;
  p.all_to_all_s = a * pieces;
  p.all_gather_s = g * pieces;
  p.experts_s = x * pieces;
  // The list schedule of one pass: issue order first(0) [first(i+1), experts(i), second(i),
  // gather(i)]; the network serves dispatch and combine in that order.
  auto pass = [&](double xc) {
    double net = 0, gpu = 0, link = 0;
    std::vector<double> first_done(static_cast<std::size_t>(n));
    auto first = [&](int i) { first_done[static_cast<std::size_t>(i)] = net = net + a; };
    const int lead = n > 1 ? 1 : 0;
    for (int i = 0; i < lead; ++i) first(i);
    double end = 0;
    for (int i = 0; i < n; ++i) {
      if (i + lead < n) first(i + lead);
      gpu = std::max(gpu, first_done[static_cast<std::size_t>(i)]) + xc;
      net = std::max(net, gpu) + a;
      link = g > 0 ? std::max(link, net) + g : net;
      end = std::max(end, link);
    }
    return end;
  };
  p.seconds = pass(x) + pass(2 * x);
  return p;
}

std::vector<Prediction> candidates(const Layer& l, const Links& k, int max_chunks) {
  std::vector<Prediction> out;
  out.push_back(predict(l, k, Strategy::flat, 1));
  if (l.t > 1)
    for (int n = 1; n <= max_chunks; n *= 2) out.push_back(predict(l, k, Strategy::dedup, n));
  out.push_back(predict(l, k, Strategy::hierarchical, 1));
  std::stable_sort(out.begin(), out.end(), [](const Prediction& a, const Prediction& b) { return a.seconds < b.seconds; });
  return out;
}

int best_chunks(const Layer& l, const Links& k, int max_chunks) {
  int best = 1;
  double t = 0;
  for (int n = 1; n <= max_chunks; n *= 2) {
    const double s = predict(l, k, Strategy::dedup, n).seconds;
    if (n == 1 || s < t) {
      best = n;
      t = s;
    }
  }
  return best;
}

std::vector<LayoutPrediction> rank_layouts(const LayoutQuery& q, const Links& k) {
  MOELAB_CHECK(q.world >= 1 && q.E >= 1 && q.tokens >= 1 && q.top_k >= 1, "monta::rank_layouts: an empty query");
  std::vector<LayoutPrediction> out;
  const int g = std::min(std::max(k.gpus_per_node, 1), q.world);
  for (int tp = 1; tp <= g; ++tp) {
    if (g % tp || q.world % tp || (q.heads > 0 && q.heads % tp) || (q.kv_heads > 0 && q.kv_heads % tp)) continue;
    for (int ep = 1; ep <= q.world; ++ep) {
      if (q.world % ep || q.E % ep) continue;
      Layer l;
      l.E = q.E;
      const double c = q.capacity_factor * q.top_k * static_cast<double>(q.tokens) / static_cast<double>(q.E);
      l.C = std::max<std::int64_t>(1, static_cast<std::int64_t>(std::ceil(c - 1e-9)));
      l.M = q.M;
      l.H = q.H;
      l.bytes = q.bytes;
      l.t = tp;
      for (int p = 0; p < ep; ++p) l.ep_ranks.push_back(p);
      l.rank = 0;
      LayoutPrediction p;
      p.tp = tp;
      p.ep = ep;
      p.best = candidates(l, k, q.max_chunks).front();
      p.seconds_per_token = p.best.seconds * tp / static_cast<double>(q.tokens);
      // Its experts (weights and gradients in the model's dtype, Adam's fp32 master, m, v) and
      // the padded buffers of one pass (the slice or whole tensor, the all-gather, T_DI and T_M).
      const double experts = static_cast<double>(q.E / ep) * 2.0 * static_cast<double>(q.M) * static_cast<double>(q.H);
      const double rows = static_cast<double>(padded_capacity(l, p.best.strategy, p.best.chunks)) * static_cast<double>(q.E);
      p.memory_bytes = q.moe_layers * experts * (2.0 * q.bytes + 12.0) + rows * static_cast<double>(q.M) * q.bytes * 3.0 +
                       rows / (p.best.strategy == Strategy::dedup ? tp : 1) * static_cast<double>(q.H) * q.bytes;
      p.fits = q.device_memory <= 0 || p.memory_bytes <= q.device_memory;
      out.push_back(std::move(p));
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const LayoutPrediction& a, const LayoutPrediction& b) {
    return a.fits != b.fits ? a.fits : a.seconds_per_token < b.seconds_per_token;
  });
  return out;
}

nlohmann::json LayoutPrediction::to_json() const {
  return {{"tp", tp}, {"ep", ep}, {"impl", best.impl}, {"chunks", best.chunks}, {"seconds", best.seconds},
          {"seconds_per_token", seconds_per_token}, {"memory_bytes", memory_bytes}, {"fits", fits}};
}

nlohmann::json Prediction::to_json() const {
  return {{"impl", impl},           {"strategy", strategy_name(strategy)}, {"chunks", chunks},
          {"seconds", seconds},     {"all_to_all_s", all_to_all_s},        {"all_gather_s", all_gather_s},
          {"experts_s", experts_s}, {"a2a_bytes", a2a.to_json()},          {"gather_bytes", gather.to_json()}};
}

}  // namespace moelab::monta
