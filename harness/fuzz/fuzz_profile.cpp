// harness/fuzz/fuzz_profile.cpp — libFuzzer target: the input is a calibration profile
// (`moelab calibrate --out`), loaded by path as `moelab run --profile FILE` loads it; a
// profile that loads then prices GEMMs of several shapes and dtypes and the memory-bound and
// launch figures on a shipped cluster, which must all be finite and non-negative. See
// fuzz_common.hpp for the oracle, docs/FUZZING.md for runs.
#include <cmath>

#include "harness/fuzz/fuzz_common.hpp"
#include "harness/sim/cluster.hpp"
#include "harness/sim/engine.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace moelab;
  static const sim::ClusterModel cluster = sim::load_cluster("dgx-a100x1");
  const std::string path = fuzz::write_file(fuzz::scratch_dir() / "profile.json", fuzz::as_text(data, size));
  fuzz::expect_input_errors([&] {
    const sim::Profile p = sim::load_profile(path);
    (void)sim::to_json(p).dump();
    sim::Engine e;
    const sim::Topology topo(cluster, e, &p);
    const auto finite = [](double x, const char* what) {
      if (!(std::isfinite(x) && x >= 0)) fuzz::finding("a priced time or rate that is not finite and >= 0", what);
    };
    for (const DType t : {DType::f32, DType::bf16})
      for (const std::int64_t m : {std::int64_t{1}, std::int64_t{512}, std::int64_t{1} << 20})
        finite(topo.gemm_seconds(m, 4096, 1024, t), "gemm_seconds");
    finite(topo.gemm_seconds(1024, 1024, 1024, DType::f32, true), "gemm_seconds (tf32)");
    finite(topo.mem_bw_effective(), "mem_bw_effective");
    finite(topo.launch_latency(), "launch_latency");
  });
  return 0;
}
