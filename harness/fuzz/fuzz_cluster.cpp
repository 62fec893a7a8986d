// harness/fuzz/fuzz_cluster.cpp — libFuzzer target: the input is a cluster file
// (experiments/hardware/clusters/*.json), loaded by path as `moelab run --cluster FILE` loads
// it (its node and GPU names resolved in the shipped catalogue). A cluster that loads and is
// small enough is then turned into the engine's resources and priced: a GEMM, a transfer
// between every kind of pair, host copies, all run by the event engine, whose times must be
// finite. See fuzz_common.hpp for the oracle, docs/FUZZING.md for runs.
#include <cmath>

#include "harness/fuzz/fuzz_common.hpp"
#include "harness/sim/cluster.hpp"
#include "harness/sim/engine.hpp"

namespace {

void simulate(const moelab::sim::ClusterModel& m) {
  using namespace moelab::sim;
  Engine e;
  const Topology topo(m, e);
  const int world = m.world_size();
  auto add = [&](const Route& r, double bytes, WorkClass cls) {
    Task t;
    t.name = "transfer";
    t.cls = cls;
    t.latency = r.latency;
    for (int res : r.resources) t.demands.push_back({res, bytes});
    e.add_task(t);
  };
  Task g;
  g.name = "gemm";
  g.gpu = 0;
  g.cls = WorkClass::compute;
  g.latency = topo.launch_latency();
  g.demands = {{topo.sm(0), topo.gemm_seconds(4096, 4096, 4096, moelab::DType::bf16)}};
  e.add_task(g);
  if (world > 1) add(topo.p2p(0, 1), 1 << 20, WorkClass::comm);
  if (world > 1) add(topo.p2p(world - 1, 0), 1 << 20, WorkClass::comm);  // across nodes when there are several
  add(topo.host_to_device(0), 1 << 20, WorkClass::memcpy);
  add(topo.device_to_host(world - 1), 1 << 20, WorkClass::memcpy);
  e.run();
  for (std::size_t i = 0; i < e.num_tasks(); ++i)
    if (!std::isfinite(e.task(static_cast<int>(i)).end))
      moelab::fuzz::finding("a simulated time that is not finite", e.task(static_cast<int>(i)).name);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace moelab;
  const std::string path = fuzz::write_file(fuzz::scratch_dir() / "cluster.json", fuzz::as_text(data, size));
  fuzz::expect_input_errors([&] {
    const sim::ClusterModel m = sim::load_cluster(path);
    (void)sim::to_json(m).dump();
    if (m.world_size() <= 64) simulate(m);  // every GPU is a set of resources: keep an execution short
  });
  return 0;
}
