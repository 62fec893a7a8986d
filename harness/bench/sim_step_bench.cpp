// harness/bench/sim_step_bench.cpp — how long the simulator takes to simulate one
// forward+backward step of the MoE layer on a paper-scale cluster (host seconds, not
// simulated ones).
//
//   build/harness/moelab_bench_sim --benchmark_out=results/bench/sim.json --benchmark_out_format=json
//
// The case of record: 8 x DGX A100 (64 ranks), 64 experts, M=2048, H=8192, top-1, 16k tokens
// per rank, every rank a thread of this process. Counters: simulated step time (ms) and the
// number of engine tasks.
#include <benchmark/benchmark.h>

#include "harness/backends/sim/sim_backend.hpp"
#include "harness/nn/moe_layer.hpp"

namespace moelab {
namespace {

void BM_SimulateMoEStep(benchmark::State& state) {
  const std::string cluster_name = state.range(0) == 64 ? "dgx-a100x8" : "dgx-a100x1";
  ModelConfig m;
  m.d_model = 2048;
  m.d_hidden = 8192;
  m.num_experts = 64;
  m.top_k = 1;
  m.dtype = DType::bf16;
  const std::int64_t T = state.range(1);
  double simulated = 0;
  for (auto _ : state) {
    SimOptions o;
    o.cluster = sim::load_cluster(cluster_name);
    SimCluster cluster(std::move(o));
    cluster.run([&](Backend& b, Communicator& c) {
      MoELayer layer(b, c, m);
      Tensor x = b.empty({T, m.d_model}, m.dtype, MemCategory::activations, layer.compute_stream());
      c.barrier();
      const double t0 = b.now();
      Tensor y = layer.forward(x);
      Tensor dx = layer.backward(y, 0.0f);
      b.synchronize();
      c.barrier();
      if (c.rank() == 0) simulated = b.now() - t0;
    });
  }
  state.counters["simulated_step_ms"] = simulated * 1e3;
  state.counters["ranks"] = static_cast<double>(state.range(0));
}
BENCHMARK(BM_SimulateMoEStep)->Args({8, 16384})->Args({64, 16384})->Unit(benchmark::kMillisecond)->Iterations(3);

}  // namespace
}  // namespace moelab

BENCHMARK_MAIN();
