// harness/bench/sim_engine_bench.cpp — Google Benchmark timings of the sim backend's event
// engine on the graph it exists for: one forward + backward step of an expert-parallel MoE
// layer on 64 simulated GPUs (8 nodes of 8), whose four all-to-alls per chunk are 64 × 63
// point-to-point flows each.
//
//   cmake --build build --target moelab_bench_sim_engine
//   build/harness/moelab_bench_sim_engine
//   build/harness/moelab_bench_sim_engine --benchmark_filter='chunks:1/skew:1'
//
// Arguments: chunks (MPipeMoE-style pipelining: each all-to-all and expert GEMM split into
// that many pieces, so communication overlaps computation and interference applies), skew
// (0: every flow of an all-to-all carries the same bytes; 1: each flow carries a random whole
// number of tokens, 0.25 to 1.75 times the mean, as a random routing gives: nearly every
// flow's end is then an event of its own, the engine's worst case), links (0: per-GPU ports
// only, 384 resources; 1: also one resource per ordered GPU pair, 4,416 resources).
// Only Engine::run() is timed; the graph is built once. Counters: tasks, resources, events
// (distinct start and end instants) and the simulated step time.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "harness/sim/engine.hpp"

namespace {

using namespace moelab::sim;

// Figures of an A100 node (SXM, NVSwitch, one 200 Gb/s NIC per GPU): only their orders of
// magnitude matter here.
constexpr int kNodes = 8, kGpusPerNode = 8, kGpus = kNodes * kGpusPerNode;
constexpr double kHbm = 1.555e12, kNvlink = 300e9, kNic = 25e9;
constexpr double kNvlinkLatency = 3e-6, kNicLatency = 6e-6, kLaunch = 5e-6;
constexpr double kFlops = 312e12 * 0.7;
constexpr double kTokens = 4096, kHidden = 4096, kFfn = 16384, kTopK = 2, kBytes = 2;

void build_step(Engine& e, int chunks, bool skew, bool pair_links) {
  e.set_interference(WorkClass::compute, 0.8);
  e.set_interference(WorkClass::comm, 0.9);
  std::vector<int> sm(kGpus), hbm(kGpus), nvl_out(kGpus), nvl_in(kGpus), nic_out(kGpus), nic_in(kGpus);
  for (int g = 0; g < kGpus; ++g) {
    const std::string p = "gpu" + std::to_string(g);
    sm[g] = e.add_resource(p + ".sm", 1.0);  // amounts: seconds of the whole GPU
    hbm[g] = e.add_resource(p + ".hbm", kHbm);
    nvl_out[g] = e.add_resource(p + ".nvlink.out", kNvlink);
    nvl_in[g] = e.add_resource(p + ".nvlink.in", kNvlink);
    nic_out[g] = e.add_resource(p + ".nic.out", kNic);
    nic_in[g] = e.add_resource(p + ".nic.in", kNic);
  }
  std::vector<int> pair(static_cast<std::size_t>(kGpus * kGpus), -1);
  if (pair_links)
    for (int s = 0; s < kGpus; ++s)
      for (int d = 0; d < kGpus; ++d)
        if (s != d)
          pair[static_cast<std::size_t>(s * kGpus + d)] =
              e.add_resource("link" + std::to_string(s) + ">" + std::to_string(d),
                             s / kGpusPerNode == d / kGpusPerNode ? kNvlink : kNic);

  // Tokens each GPU sends each other GPU per chunk (one expert per GPU, top-2 routing).
  std::mt19937_64 rng(42);
  std::vector<double> tokens(static_cast<std::size_t>(kGpus * kGpus));
  const double mean = kTokens * kTopK / kGpus / chunks;
  for (auto& t : tokens) {
    const double u = static_cast<double>(rng() >> 11) * 0x1.0p-53;
    t = skew ? std::floor(mean * (0.25 + 1.5 * u)) + 1 : mean;
  }

  std::vector<int> last_compute(kGpus, -1), last_comm(kGpus, -1);
  auto gemm = [&](const std::string& name, int g, double m, double n, double k, std::vector<int> deps) {
    Task t;
    t.name = name + "@" + std::to_string(g);
    t.gpu = g;
    t.rank = g;
    t.cls = WorkClass::compute;
    t.latency = kLaunch;
    t.demands = {{sm[g], 2 * m * n * k / kFlops}, {hbm[g], kBytes * (m * k + k * n + m * n)}};
    if (last_compute[g] >= 0) deps.push_back(last_compute[g]);
    t.deps = std::move(deps);
    return last_compute[g] = e.add_task(std::move(t));
  };
  auto elementwise = [&](const std::string& name, int g, double bytes, std::vector<int> deps) {
    Task t;
    t.name = name + "@" + std::to_string(g);
    t.gpu = g;
    t.rank = g;
    t.cls = WorkClass::compute;
    t.latency = kLaunch;
    t.demands = {{hbm[g], bytes}};
    if (last_compute[g] >= 0) deps.push_back(last_compute[g]);
    t.deps = std::move(deps);
    return last_compute[g] = e.add_task(std::move(t));
  };
  // An all-to-all on the communication streams: flow (s, d) waits for `after[s]` and for the
  // previous collective of s; a zero-work task per GPU marks its sends done (the stream's
  // next op waits for it) and one per GPU its receives (the consumer waits for it).
  auto all_to_all = [&](const std::string& name, const std::vector<int>& after, double row_bytes) {
    std::vector<std::vector<int>> sent(kGpus), received(kGpus);
    for (int s = 0; s < kGpus; ++s)
      for (int d = 0; d < kGpus; ++d) {
        if (s == d) continue;
        const bool intra = s / kGpusPerNode == d / kGpusPerNode;
        const double bytes = tokens[static_cast<std::size_t>(s * kGpus + d)] * row_bytes;
        Task t;
        t.name = name + ":" + std::to_string(s) + ">" + std::to_string(d);
        t.gpu = s;
        t.rank = s;
        t.cls = WorkClass::comm;
        t.latency = intra ? kNvlinkLatency : kNicLatency;
        if (intra)
          t.demands = {{nvl_out[s], bytes}, {nvl_in[d], bytes}};
        else
          t.demands = {{nic_out[s], bytes}, {nic_in[d], bytes}};
        if (pair_links) t.demands.push_back({pair[static_cast<std::size_t>(s * kGpus + d)], bytes});
        t.deps = {after[static_cast<std::size_t>(s)]};
        if (last_comm[s] >= 0) t.deps.push_back(last_comm[s]);
        const int id = e.add_task(std::move(t));
        sent[s].push_back(id);
        received[d].push_back(id);
      }
    std::vector<int> done(kGpus);
    for (int g = 0; g < kGpus; ++g) {
      Task s;
      s.name = name + ":sent@" + std::to_string(g);
      s.deps = sent[g];
      last_comm[g] = e.add_task(std::move(s));
      Task r;
      r.name = name + ":received@" + std::to_string(g);
      r.deps = received[g];
      done[g] = e.add_task(std::move(r));
    }
    return done;
  };

  const double row = kHidden * kBytes;
  const double rows_in = kTokens * kTopK / chunks;          // rows each GPU sends per chunk
  const double rows_expert = kTokens * kTopK / chunks;      // rows each expert receives (mean)
  std::vector<int> gate(kGpus);
  for (int g = 0; g < kGpus; ++g) gate[g] = gemm("gate", g, kTokens, kGpus, kHidden, {});

  // Forward, chunk by chunk: permute, dispatch, fc1, activation, fc2, combine, unpermute.
  std::vector<std::vector<int>> fwd_out(static_cast<std::size_t>(chunks));
  for (int c = 0; c < chunks; ++c) {
    const std::string tag = "c" + std::to_string(c);
    std::vector<int> perm(kGpus), fc2(kGpus);
    for (int g = 0; g < kGpus; ++g) perm[g] = elementwise("permute." + tag, g, 2 * rows_in * row, {gate[g]});
    const auto dispatched = all_to_all("dispatch." + tag, perm, row);
    for (int g = 0; g < kGpus; ++g) {
      gemm("fc1." + tag, g, rows_expert, kFfn, kHidden, {dispatched[g]});
      elementwise("act." + tag, g, 2 * rows_expert * kFfn * kBytes, {});
      fc2[g] = gemm("fc2." + tag, g, rows_expert, kHidden, kFfn, {});
    }
    const auto combined = all_to_all("combine." + tag, fc2, row);
    for (int g = 0; g < kGpus; ++g)
      fwd_out[static_cast<std::size_t>(c)].push_back(
          elementwise("unpermute." + tag, g, 2 * rows_in * row, {combined[g]}));
  }
  // Backward (after the whole forward, i.e. the loss), chunk by chunk: unpermute grad,
  // combine grad, fc2 grads (data and weight), activation grad, fc1 grads, dispatch grad,
  // permute grad; then the gate's backward.
  std::vector<int> last_bwd(kGpus);
  const std::vector<int>& loss = fwd_out[static_cast<std::size_t>(chunks - 1)];
  for (int c = 0; c < chunks; ++c) {
    const std::string tag = "c" + std::to_string(c);
    std::vector<int> ungrad(kGpus), fc1w(kGpus);
    for (int g = 0; g < kGpus; ++g)
      ungrad[g] = elementwise("unpermute.bwd." + tag, g, 2 * rows_in * row, {loss[static_cast<std::size_t>(g)]});
    const auto cgrad = all_to_all("combine.bwd." + tag, ungrad, row);
    for (int g = 0; g < kGpus; ++g) {
      gemm("fc2.dgrad." + tag, g, rows_expert, kFfn, kHidden, {cgrad[g]});
      gemm("fc2.wgrad." + tag, g, kFfn, kHidden, rows_expert, {});
      elementwise("act.bwd." + tag, g, 3 * rows_expert * kFfn * kBytes, {});
      gemm("fc1.dgrad." + tag, g, rows_expert, kHidden, kFfn, {});
      fc1w[g] = gemm("fc1.wgrad." + tag, g, kHidden, kFfn, rows_expert, {});
    }
    const auto dgrad = all_to_all("dispatch.bwd." + tag, fc1w, row);
    for (int g = 0; g < kGpus; ++g) last_bwd[g] = elementwise("permute.bwd." + tag, g, 2 * rows_in * row, {dgrad[g]});
  }
  for (int g = 0; g < kGpus; ++g) gemm("gate.bwd", g, kTokens, kHidden, kGpus, {last_bwd[g]});
}

void BM_MoeStep64(benchmark::State& state) {
  const auto chunks = static_cast<int>(state.range(0));
  const bool skew = state.range(1) != 0, links = state.range(2) != 0;
  Engine e;
  build_step(e, chunks, skew, links);
  for (auto _ : state) {
    e.run();
    benchmark::DoNotOptimize(e.makespan());
  }
  std::set<double> instants;
  for (std::size_t i = 0; i < e.num_tasks(); ++i) {
    instants.insert(e.task(static_cast<int>(i)).start);
    instants.insert(e.task(static_cast<int>(i)).end);
  }
  state.counters["tasks"] = static_cast<double>(e.num_tasks());
  state.counters["resources"] = static_cast<double>(e.num_resources());
  state.counters["events"] = static_cast<double>(instants.size());
  state.counters["step_ms"] = e.makespan() * 1e3;
}

BENCHMARK(BM_MoeStep64)
    ->ArgNames({"chunks", "skew", "links"})
    ->ArgsProduct({{1, 2}, {0, 1}, {0, 1}})
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
