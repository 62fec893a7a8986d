// harness/tests/sim_host_test.cpp — the sim backend's host time (docs/PERFORMANCE.md, "Host
// time") against closed forms on one idle GPU, K GEMMs of d seconds each on one stream:
//   * issue overhead h, no synchronisation: GEMM i is issued at (i+1)·h and starts at
//     max((i+1)·h, end of GEMM i−1), so start_i − start_0 = i·max(h, d);
//   * sync latency s, a stream synchronisation after every GEMM: start_i − start_0 = i·(d + s);
//   * both zero: the GEMMs run back to back, as before the terms existed.
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "harness/backends/sim/sim_backend.hpp"
#include "harness/tests/sim_test_util.hpp"

namespace moelab {
namespace {

// One toy GPU (harness/tests/sim_test_util.hpp: no launch latency, so that a GEMM's time is
// its work alone) with the host terms under test.
sim::ClusterModel one_gpu(double sync_latency, double issue_overhead) {
  sim::ClusterModel m = test::toy_cluster(1, 300e9, 3e-6);
  m.host.sync_latency = sync_latency;
  m.host.issue_overhead = issue_overhead;
  m.host.source = "test";
  return m;
}

// K bf16 GEMMs [n,n]x[n,n] on the default stream, a synchronisation after each when
// `sync_each`; the timeline's GEMM records in issue order.
std::vector<OpRecord> gemms(const sim::ClusterModel& m, int K, std::int64_t n, bool sync_each) {
  SimOptions o;
  o.cluster = m;
  SimCluster cluster(o);
  std::vector<OpRecord> out;
  cluster.run([&](Backend& b, Communicator& c) {
    Stream& s = b.default_stream();
    Tensor A = b.empty({n, n}, DType::bf16, MemCategory::buffers, s);
    Tensor B = b.empty({n, n}, DType::bf16, MemCategory::buffers, s);
    Tensor C = b.empty({n, n}, DType::bf16, MemCategory::buffers, s);
    b.synchronize();
    c.barrier();
    b.clear_timeline();
    for (int i = 0; i < K; ++i) {
      b.gemm(s, {false, false, n, n, n, A, B, C, 1.0f, 0.0f}, "g");
      if (sync_each) b.synchronize(s);
    }
    b.synchronize();
    c.barrier();  // the evaluation that fills the timeline
    for (const OpRecord& r : b.timeline())
      if (r.name == "g") out.push_back(r);
  });
  return out;
}

constexpr int K = 6;
constexpr std::int64_t N = 2048;

double gemm_seconds() {
  const auto base = gemms(one_gpu(0, 0), 1, N, false);
  EXPECT_EQ(base.size(), 1u);
  return base.empty() ? 0.0 : base[0].end - base[0].start;
}

TEST(SimHost, NoHostTermsRunsBackToBack) {
  const double d = gemm_seconds();
  ASSERT_GT(d, 0);
  for (bool sync_each : {false, true}) {
    const auto r = gemms(one_gpu(0, 0), K, N, sync_each);
    ASSERT_EQ(r.size(), static_cast<std::size_t>(K));
    for (int i = 0; i < K; ++i) EXPECT_NEAR(r[i].start - r[0].start, i * d, 1e-12) << "gemm " << i;
  }
}

TEST(SimHost, IssueOverheadPacesTheStream) {
  const double d = gemm_seconds();
  ASSERT_GT(d, 0);
  // The host slower than the GPU (h = 3d) and faster (h = d/4): the stream runs at the slower.
  for (double h : {3 * d, d / 4}) {
    const auto r = gemms(one_gpu(0, h), K, N, false);
    ASSERT_EQ(r.size(), static_cast<std::size_t>(K));
    for (int i = 0; i < K; ++i)
      EXPECT_NEAR(r[i].start - r[0].start, i * std::max(h, d), 1e-12) << "h " << h << " gemm " << i;
  }
}

TEST(SimHost, SyncLatencyFollowsEveryHostWait) {
  const double d = gemm_seconds();
  ASSERT_GT(d, 0);
  const double s = 2.5 * d;
  const auto r = gemms(one_gpu(s, 0), K, N, true);
  ASSERT_EQ(r.size(), static_cast<std::size_t>(K));
  for (int i = 0; i < K; ++i) EXPECT_NEAR(r[i].start - r[0].start, i * (d + s), 1e-12) << "gemm " << i;
  // Without the waits the latency costs nothing: nothing on the GPU waits for the host.
  const auto free_run = gemms(one_gpu(s, 0), K, N, false);
  for (int i = 0; i < K; ++i) EXPECT_NEAR(free_run[i].start - free_run[0].start, i * d, 1e-12);
}

TEST(SimHost, BothTermsAdd) {
  const double d = gemm_seconds();
  ASSERT_GT(d, 0);
  const double h = d / 2, s = d;
  // Each GEMM: issued h after the host's last point, runs d, the host resumes s after its end.
  const auto r = gemms(one_gpu(s, h), K, N, true);
  ASSERT_EQ(r.size(), static_cast<std::size_t>(K));
  for (int i = 0; i < K; ++i) EXPECT_NEAR(r[i].start - r[0].start, i * (h + d + s), 1e-12) << "gemm " << i;
}

}  // namespace
}  // namespace moelab
