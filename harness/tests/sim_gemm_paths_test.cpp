// harness/tests/sim_gemm_paths_test.cpp — the sim's per-path GEMM pricing: a GEMM
// calibration with "paths" and "gemm_paths" prices each grouped GEMM call on the library path
// the cuda backend would take (strided_batched, grouped or the loop, chosen from the
// calibration's crossover table), each time against its closed form; a calibration without
// them prices every call as the loop, as before; bad per-path data is a ConfigError naming
// the file and the field.
//
//   ctest --test-dir build -R sim_gemm_paths
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "harness/backends/sim/sim_backend.hpp"
#include "harness/runtime/error.hpp"
#include "harness/sim/cluster.hpp"
#include "harness/sim/engine.hpp"
#include "harness/tests/sim_test_util.hpp"

namespace moelab {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg) << "\nexpected: " << (part)

// The toy GPU of sim_test_util.hpp: bf16 100, tf32 50, fp32 20 TFLOP/s.
constexpr double kBf16 = 100e12, kTf32 = 50e12, kFp32 = 20e12;
constexpr double kMemBw = 2e12, kLaunch = 5e-6;

// A crossover table of one forward point: each path's TFLOP/s, the same at every rows and
// width (one point is held flat), so the estimates are loop sum/loop_tf, strided E·f/strided_tf,
// grouped sum/grouped_tf.
json table_json(double loop_tf, double strided_tf, double grouped_tf) {
  return {{"source", "test"},
          {"points",
           {{{"precision", "bf16"}, {"op", "fwd"}, {"d_model", 256}, {"d_hidden", 1024}, {"experts", 4}, {"rows", 512},
             {"tflops", {{"loop", loop_tf}, {"strided_batched", strided_tf}, {"grouped", grouped_tf}}}}}}};
}

// Curves of the toy calibration: the loop's (the main curves) and the batched paths' (strided:
// bf16 and tf32, no fp32; grouped: bf16 only).
sim::GemmCurve curve(double max, double half) {
  sim::GemmCurve c;
  c.gemm_max = max;
  c.gemm_half_dim = half;
  c.source = "test";
  return c;
}

sim::GemmCalibration toy_calibration(const json* table) {
  sim::GemmCalibration cal;
  cal.name = "toy";
  cal.device = "toy-gpu";
  cal.launch_latency = kLaunch;
  cal.mem_bw = kMemBw;
  cal.bf16 = curve(0.9, 100);
  cal.fp32 = curve(0.7, 80);
  cal.tf32 = curve(0.85, 90);
  if (table) {
    sim::GemmPathPricing p;
    p.source = "test";
    p.strided_batched.bf16 = curve(0.95, 60);
    p.strided_batched.tf32 = curve(0.9, 50);
    p.grouped.bf16 = curve(0.35, 40);
    p.table = sim::gemm_path_table_from_json(*table, "test");
    cal.paths = p;
  }
  return cal;
}

sim::ClusterModel toy_model(const json* table) {
  sim::ClusterModel m = test::toy_cluster(1, 100e9, 0);
  m.efficiency.calibration = toy_calibration(table);
  m.efficiency.launch_latency = kLaunch;  // what load_cluster takes from the calibration
  return m;
}

// One problem's seconds on a curve: max(2mnk / (peak · eff), elem · (mk + kn + mn) / mem_bw),
// eff = gemm_max · d / (d + gemm_half_dim), d = min(m, n, k).
double roofline(double m, double n, double k, double peak, double gemm_max, double half, double elem) {
  const double d = std::min({m, n, k});
  const double eff = gemm_max * d / (d + half);
  return std::max(2 * m * n * k / (peak * eff), elem * (m * k + k * n + m * n) / kMemBw);
}

struct Shape {
  std::int64_t m, n, k;
};

// Prices `shapes` (forward problems [m,k]x[k,n] in `dt`) with Topology::grouped_gemm, and runs
// them as one grouped_gemm op after a first op on the same stream, so that the op's timeline
// record gives its launch latency (its start minus the first op's end) and its GPU time.
struct Priced {
  sim::Topology::GroupedGemmPrice price;
  double latency = 0, gpu = 0;
  std::string detail;
  // Backend::gemm_path_uses after both ops: {op: {path: calls}}, as metrics.gemm_paths_taken.
  std::map<std::string, std::map<std::string, std::int64_t>> uses;
  std::string call_why;  // the "call" op's last reason
};

// {path: calls} of the "call" op, and the "first" op's (one problem: the loop) checked.
std::map<std::string, std::int64_t> call_paths(const Priced& p) {
  const auto f = p.uses.find("first");
  if (f != p.uses.end()) {
    EXPECT_EQ(f->second, (std::map<std::string, std::int64_t>{{"loop", 1}}));
  }
  const auto c = p.uses.find("call");
  return c == p.uses.end() ? std::map<std::string, std::int64_t>{} : c->second;
}
using PathCalls = std::map<std::string, std::int64_t>;
Priced price(const sim::ClusterModel& m, const std::vector<Shape>& shapes, DType dt, bool tf32 = false,
             std::optional<GemmPath> forced = std::nullopt) {
  Priced out;
  SimOptions o;
  o.cluster = m;
  o.gemm_path = forced;
  SimCluster cluster(o);
  cluster.run([&](Backend& b, Communicator& c) {
    b.set_allow_tf32(tf32);
    Stream& s = b.default_stream();
    std::vector<GemmProblem> ps;
    for (const Shape& sh : shapes) {
      GemmProblem p;
      p.m = sh.m;
      p.n = sh.n;
      p.k = sh.k;
      p.a = b.empty({std::max<std::int64_t>(sh.m, 1), std::max<std::int64_t>(sh.k, 1)}, dt, MemCategory::buffers, s);
      p.b = b.empty({std::max<std::int64_t>(sh.k, 1), std::max<std::int64_t>(sh.n, 1)}, dt, MemCategory::buffers, s);
      p.c = b.empty({std::max<std::int64_t>(sh.m, 1), std::max<std::int64_t>(sh.n, 1)}, dt, MemCategory::buffers, s);
      ps.push_back(p);
    }
    sim::Engine e;
    sim::Topology t(m, e);
    t.force_gemm_path(forced);
    out.price = t.grouped_gemm(ps, tf32);
    c.barrier();
    b.clear_timeline();
    b.grouped_gemm(s, {ps.data(), 1}, "first");
    b.grouped_gemm(s, ps, "call");
    b.synchronize();
    c.barrier();  // the times become final at a barrier of every rank
    const auto tl = b.timeline();
    ASSERT_EQ(tl.size(), 2u);
    out.latency = tl[1].start - tl[0].end;
    out.gpu = tl[1].end - tl[1].start;
    out.detail = tl[1].detail;
    for (const GemmPathUse& u : b.gemm_path_uses()) {
      out.uses[u.op][gemm_path_name(u.path)] = u.calls;
      if (u.op == "call") out.call_why = u.last_why;
    }
  });
  return out;
}

// Equal problems, a table where one strided batch is fastest: one launch, E times the
// strided curve's time.
TEST(SimGemmPaths, EqualProblemsTakeTheStridedBatch) {
  const json table = table_json(100, 400, 250);
  const sim::ClusterModel m = toy_model(&table);
  const std::vector<Shape> four(4, Shape{512, 1024, 256});
  const Priced p = price(m, four, DType::bf16);
  const double each = roofline(512, 1024, 256, kBf16, 0.95, 60, 2);
  EXPECT_DOUBLE_EQ(p.price.seconds, 4 * each);
  EXPECT_EQ(p.price.launches, 1);
  EXPECT_EQ(p.price.detail.rfind("strided_batched (fastest)", 0), 0u) << p.price.detail;
  // The sim backend: one launch latency, then the GEMM seconds on the GPU; the path in the
  // op's detail, as the cuda backend records it.
  EXPECT_NEAR(p.latency, kLaunch, 1e-15);
  EXPECT_NEAR(p.gpu, 4 * each, 1e-12 * each);
  EXPECT_EQ(p.detail, p.price.detail);
  // The path each call was priced on, counted as the cuda backend counts the paths it ran.
  EXPECT_EQ(call_paths(p), (PathCalls{{"strided_batched", 1}}));
  EXPECT_EQ(p.call_why, p.price.detail);
  ASSERT_EQ(p.price.decisions.size(), 1u);
  EXPECT_EQ(p.price.decisions[0].first, GemmPath::strided_batched);

  // TF32: the strided path's tf32 curve at the TF32 peak, 4-byte elements.
  const Priced t = price(m, four, DType::f32, true);
  EXPECT_DOUBLE_EQ(t.price.seconds, 4 * roofline(512, 1024, 256, kTf32, 0.9, 50, 4));
  EXPECT_EQ(t.price.launches, 1);
  EXPECT_HAS(t.price.detail, "strided_batched");
  EXPECT_HAS(t.price.detail, "tf32");
  EXPECT_EQ(call_paths(t), (PathCalls{{"strided_batched", 1}}));
}

// A padded layout (every problem with the same token stride; one expert without a row): one
// strided batch over the padded rows, every expert in it, where the table picks it; the
// problems' own rows (here: grouped, the empty one launching nothing) where the padding wastes
// more than max_padding_waste.
TEST(SimGemmPaths, PaddedCallsRunOneBatchOverThePaddedRows) {
  const json table = table_json(100, 400, 250);
  const sim::ClusterModel m = toy_model(&table);
  const auto run = [&](std::int64_t stride, const std::vector<std::int64_t>& rows,
                       std::optional<GemmPath> forced = std::nullopt, DType dt = DType::bf16) {
    sim::Engine e;
    sim::Topology t(m, e);
    t.force_gemm_path(forced);
    SimOptions o;
    o.cluster = m;
    SimCluster cluster(o);
    sim::Topology::GroupedGemmPrice price;
    cluster.run([&](Backend& b, Communicator&) {
      Stream& s = b.default_stream();
      const std::int64_t E = static_cast<std::int64_t>(rows.size());
      Tensor x = b.empty({E * stride, 256}, dt, MemCategory::buffers, s);
      Tensor w = b.empty({E, 256, 1024}, dt, MemCategory::buffers, s);
      Tensor y = b.empty({E * stride, 1024}, dt, MemCategory::buffers, s);
      std::vector<GemmProblem> ps;
      for (std::int64_t l = 0; l < E; ++l) {
        GemmProblem p{false, false, rows[static_cast<std::size_t>(l)], 1024, 256,
                      x.rows(l * stride, rows[static_cast<std::size_t>(l)]), w.select(l),
                      y.rows(l * stride, rows[static_cast<std::size_t>(l)]), 1, 0};
        p.token_stride = stride;
        ps.push_back(p);
      }
      price = t.grouped_gemm(ps, false);
    });
    return price;
  };
  // 8 experts, 7 of 512 rows and one empty: 12.5% padding, allowed.
  std::vector<std::int64_t> rows(8, 512);
  rows[5] = 0;
  const auto p = run(512, rows);
  EXPECT_EQ(p.launches, 1);
  EXPECT_DOUBLE_EQ(p.seconds, 8 * roofline(512, 1024, 256, kBf16, 0.95, 60, 2));
  EXPECT_HAS(p.detail, "padded to 512 rows");
  ASSERT_EQ(p.decisions.size(), 1u);  // one decision: the padded batch
  EXPECT_EQ(p.decisions[0].first, GemmPath::strided_batched);
  EXPECT_EQ(p.decisions[0].second, p.detail);
  // Two empty: 25%, refused; the 6 others on the grouped curve, one launch.
  rows[2] = 0;
  const auto q = run(512, rows);
  EXPECT_DOUBLE_EQ(q.seconds, 6 * roofline(512, 1024, 256, kBf16, 0.35, 40, 2));
  EXPECT_HAS(q.detail, "grouped");
  ASSERT_EQ(q.decisions.size(), 1u);
  EXPECT_EQ(q.decisions[0].first, GemmPath::grouped);
  // Forced (moelab run --gemm-path): strided_batched takes the padded batch whatever the
  // waste, as on cuda; grouped runs the problems' own rows.
  const auto fs = run(512, rows, GemmPath::strided_batched);
  EXPECT_EQ(fs.launches, 1);
  EXPECT_DOUBLE_EQ(fs.seconds, 8 * roofline(512, 1024, 256, kBf16, 0.95, 60, 2));
  EXPECT_EQ(fs.detail.rfind("strided_batched over 512 padded rows (forced); the table's choice: grouped", 0), 0u) << fs.detail;
  const auto fg = run(512, std::vector<std::int64_t>(8, 512), GemmPath::grouped);
  EXPECT_DOUBLE_EQ(fg.seconds, 8 * roofline(512, 1024, 256, kBf16, 0.35, 40, 2));
  EXPECT_EQ(fg.detail.rfind("grouped (forced)", 0), 0u) << fg.detail;
  // A forced strided batch in fp32, which the toy calibration has no strided curve for: cuda
  // would run the padded batch; the sim prices the problems' own rows as the loop and says so.
  const auto f32 = run(512, rows, GemmPath::strided_batched, DType::f32);
  EXPECT_EQ(f32.launches, 6);
  EXPECT_DOUBLE_EQ(f32.seconds, 6 * roofline(512, 1024, 256, kFp32, 0.7, 80, 4));
  EXPECT_EQ(f32.detail.rfind("strided_batched over 512 padded rows (forced)", 0), 0u) << f32.detail;
  EXPECT_HAS(f32.detail, "priced as the loop: the calibration has no strided_batched curve for fp32");
  ASSERT_EQ(f32.decisions.size(), 1u);  // counted on the path it is priced on
  EXPECT_EQ(f32.decisions[0].first, GemmPath::loop);
}

// The GEMM floor (Backend::time_batched_gemms): each run of consecutive equal problems on the
// strided curve when the calibration prices paths (its label says so), one by one on the loop
// curve otherwise; a precision without a strided curve (fp32 here) stays on the loop.
TEST(SimGemmPaths, FloorRunsOnTheStridedCurve) {
  const json table = table_json(100, 400, 250);
  for (const bool paths : {true, false}) {
    SimOptions o;
    o.cluster = toy_model(paths ? &table : nullptr);
    SimCluster cluster(o);
    cluster.run([&](Backend& b, Communicator&) {
      Stream& s = b.default_stream();
      const auto problem = [&](std::int64_t m, std::int64_t n, std::int64_t k, DType dt) {
        GemmProblem p;
        p.m = m;
        p.n = n;
        p.k = k;
        p.a = b.empty({m, k}, dt, MemCategory::buffers, s);
        p.b = b.empty({k, n}, dt, MemCategory::buffers, s);
        p.c = b.empty({m, n}, dt, MemCategory::buffers, s);
        return p;
      };
      // Two runs (three fwd problems, then two of another shape) and one fp32 run.
      std::vector<GemmProblem> ps = {problem(512, 1024, 256, DType::bf16), problem(512, 1024, 256, DType::bf16),
                                     problem(512, 1024, 256, DType::bf16), problem(256, 512, 1024, DType::bf16),
                                     problem(256, 512, 1024, DType::bf16)};
      const std::vector<GemmProblem> fp32 = {problem(512, 1024, 256, DType::f32), problem(512, 1024, 256, DType::f32)};
      const double strided = 3 * roofline(512, 1024, 256, kBf16, 0.95, 60, 2) + 2 * roofline(256, 512, 1024, kBf16, 0.95, 60, 2);
      const double loop = 3 * roofline(512, 1024, 256, kBf16, 0.9, 100, 2) + 2 * roofline(256, 512, 1024, kBf16, 0.9, 100, 2);
      EXPECT_EQ(b.prices_gemm_paths(), paths);
      EXPECT_NEAR(b.time_batched_gemms(ps, 1), paths ? strided : loop, 1e-12 * loop) << "paths " << paths;
      EXPECT_NEAR(b.time_bare_gemms(ps, 1), loop, 1e-12 * loop);  // the cublasGemmEx yardstick: the loop
      EXPECT_NEAR(b.time_batched_gemms(fp32, 1), 2 * roofline(512, 1024, 256, kFp32, 0.7, 80, 4), 1e-9);
    });
  }
}

// Unequal shapes cannot be one strided batch: grouped where the table has it beat the loop,
// the loop (a launch and the loop curve per problem) where it does not.
TEST(SimGemmPaths, UnequalShapesTakeGroupedOrTheLoop) {
  const std::vector<Shape> mixed = {{512, 1024, 256}, {256, 1024, 256}, {1024, 1024, 256}};
  double grouped = 0, loop = 0;
  for (const Shape& s : mixed) {
    const double m = static_cast<double>(s.m), n = static_cast<double>(s.n), k = static_cast<double>(s.k);
    grouped += roofline(m, n, k, kBf16, 0.35, 40, 2);
    loop += roofline(m, n, k, kBf16, 0.9, 100, 2);
  }
  const json fast_grouped = table_json(100, 400, 250);
  const Priced g = price(toy_model(&fast_grouped), mixed, DType::bf16);
  EXPECT_DOUBLE_EQ(g.price.seconds, grouped);
  EXPECT_EQ(g.price.launches, 1);
  EXPECT_EQ(g.price.detail.rfind("grouped (fastest)", 0), 0u) << g.price.detail;
  EXPECT_HAS(g.price.detail, "strided_batched: unequal shapes");
  EXPECT_NEAR(g.latency, kLaunch, 1e-15);
  EXPECT_NEAR(g.gpu, grouped, 1e-12 * grouped);
  EXPECT_EQ(call_paths(g), (PathCalls{{"grouped", 1}}));

  const json slow_grouped = table_json(100, 400, 50);
  const Priced l = price(toy_model(&slow_grouped), mixed, DType::bf16);
  EXPECT_DOUBLE_EQ(l.price.seconds, loop);
  EXPECT_EQ(l.price.launches, 3);
  EXPECT_EQ(l.price.detail.rfind("loop (fastest)", 0), 0u) << l.price.detail;
  EXPECT_NEAR(l.latency, 3 * kLaunch, 1e-15);
  EXPECT_NEAR(l.gpu, loop, 1e-12 * loop);
  EXPECT_EQ(call_paths(l), (PathCalls{{"loop", 1}}));  // one decision, as cuda counts it

  // An expert without rows breaks the layer's fixed strides: the other three, though equal,
  // go to grouped, and the empty one launches nothing.
  const std::vector<Shape> one_empty = {{512, 1024, 256}, {0, 1024, 256}, {512, 1024, 256}, {512, 1024, 256}};
  const Priced z = price(toy_model(&fast_grouped), one_empty, DType::bf16);
  EXPECT_DOUBLE_EQ(z.price.seconds, 3 * roofline(512, 1024, 256, kBf16, 0.35, 40, 2));
  EXPECT_EQ(z.price.launches, 1);
  EXPECT_EQ(z.price.detail.rfind("grouped", 0), 0u) << z.price.detail;
  EXPECT_HAS(z.price.detail, "operands not equally strided");
  EXPECT_EQ(call_paths(z), (PathCalls{{"grouped", 1}}));  // the empty problem is no decision
  // Two type combinations (bf16 and fp32 problems in one call): a decision each, as on cuda.
  // Here the fp32 pair has no grouped curve, so it is counted where it is priced: the loop.
  SimOptions o;
  o.cluster = toy_model(&fast_grouped);
  SimCluster cluster(o);
  cluster.run([&](Backend& b, Communicator&) {
    Stream& s = b.default_stream();
    std::vector<GemmProblem> ps;
    for (const auto& [rows, dt] : std::vector<std::pair<std::int64_t, DType>>{
             {512, DType::bf16}, {256, DType::bf16}, {512, DType::f32}, {256, DType::f32}}) {
      GemmProblem p;
      p.m = rows;
      p.n = 1024;
      p.k = 256;
      p.a = b.empty({rows, 256}, dt, MemCategory::buffers, s);
      p.b = b.empty({256, 1024}, dt, MemCategory::buffers, s);
      p.c = b.empty({rows, 1024}, dt, MemCategory::buffers, s);
      ps.push_back(p);
    }
    b.grouped_gemm(s, ps, "mixed");
    const std::vector<GemmPathUse> uses = b.gemm_path_uses();
    ASSERT_EQ(uses.size(), 2u);
    EXPECT_EQ(uses[0].op, "mixed");
    EXPECT_EQ(uses[0].path, GemmPath::loop);
    EXPECT_EQ(uses[0].calls, 1);
    EXPECT_HAS(uses[0].last_why, "priced as the loop: the calibration has no grouped curve for fp32");
    EXPECT_EQ(uses[1].path, GemmPath::grouped);
    EXPECT_EQ(uses[1].calls, 1);
  });
}

// moelab run --gemm-path: every call on the forced path where it can run (the rule of
// force_gemm_path, as on cuda), priced on that path's curve; the table's choice where it cannot;
// a path other than the loop needs per-path data.
TEST(SimGemmPaths, AForcedPathIsPricedOnItsCurveWhereItCanRun) {
  const json table = table_json(100, 400, 250);  // the table's choice for equal problems: strided
  const sim::ClusterModel m = toy_model(&table);
  const std::vector<Shape> four(4, Shape{512, 1024, 256});
  const Priced g = price(m, four, DType::bf16, false, GemmPath::grouped);
  EXPECT_DOUBLE_EQ(g.price.seconds, 4 * roofline(512, 1024, 256, kBf16, 0.35, 40, 2));
  EXPECT_EQ(g.price.launches, 1);
  EXPECT_EQ(g.price.detail.rfind("grouped (forced); the table's choice: strided_batched", 0), 0u) << g.price.detail;
  EXPECT_NEAR(g.gpu, g.price.seconds, 1e-12 * g.price.seconds);  // the sim backend prices it so too
  EXPECT_EQ(g.detail, g.price.detail);
  EXPECT_EQ(call_paths(g), (PathCalls{{"grouped", 1}}));
  const Priced l = price(m, four, DType::bf16, false, GemmPath::loop);
  EXPECT_DOUBLE_EQ(l.price.seconds, 4 * roofline(512, 1024, 256, kBf16, 0.9, 100, 2));
  EXPECT_EQ(l.price.launches, 4);
  EXPECT_NEAR(l.latency, 4 * kLaunch, 1e-15);
  // Unequal shapes cannot be one strided batch: the table's grouped, and the detail says so.
  const std::vector<Shape> mixed = {{512, 1024, 256}, {256, 1024, 256}};
  const Priced s = price(m, mixed, DType::bf16, false, GemmPath::strided_batched);
  EXPECT_DOUBLE_EQ(s.price.seconds, roofline(512, 1024, 256, kBf16, 0.35, 40, 2) + roofline(256, 1024, 256, kBf16, 0.35, 40, 2));
  EXPECT_EQ(s.price.detail.rfind("strided_batched forced but cannot run this call", 0), 0u) << s.price.detail;

  // Without per-path data only the loop can be forced (it is every call there anyway).
  const sim::ClusterModel plain = toy_model(nullptr);
  EXPECT_NO_THROW(sim::check_forced_gemm_path(plain, GemmPath::loop));
  EXPECT_NO_THROW(sim::check_forced_gemm_path(plain, std::nullopt));
  try {
    sim::check_forced_gemm_path(plain, GemmPath::grouped);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_HAS(std::string(e.what()), "--gemm-path grouped: cluster " + plain.name + " has no per-path GEMM data");
  }
  SimOptions o;
  o.cluster = plain;
  o.gemm_path = GemmPath::strided_batched;
  EXPECT_THROW(SimCluster{o}, ConfigError);
}

// A single problem is one cublasGemmEx; a path without a curve for the precision is priced
// as the loop (strided has no fp32 curve here).
TEST(SimGemmPaths, OneProblemAndMissingCurvesAreTheLoop) {
  const json table = table_json(100, 400, 250);
  const sim::ClusterModel m = toy_model(&table);
  const Priced one = price(m, {{512, 1024, 256}}, DType::bf16);
  EXPECT_DOUBLE_EQ(one.price.seconds, roofline(512, 1024, 256, kBf16, 0.9, 100, 2));
  EXPECT_EQ(one.price.launches, 1);
  EXPECT_EQ(one.price.detail, "one problem: one cublasGemmEx");  // the chooser's line, as cuda records it
  // Forced: still the loop, and the line says so (cuda's CudaGemmTest.OneProblemUnderAForcedPath...).
  for (GemmPath path : {GemmPath::strided_batched, GemmPath::grouped}) {
    const Priced f = price(m, {{512, 1024, 256}}, DType::bf16, false, path);
    EXPECT_EQ(f.detail, std::string(gemm_path_name(path)) +
                            " forced but cannot run this call (one problem): one problem: one cublasGemmEx");
    EXPECT_EQ(call_paths(f), (PathCalls{{"loop", 1}}));
  }
  EXPECT_EQ(price(m, {{512, 1024, 256}}, DType::bf16, false, GemmPath::loop).detail,
            "loop (forced; also the table's choice): one problem: one cublasGemmEx");

  const std::vector<Shape> four(4, Shape{512, 1024, 256});
  const Priced f = price(m, four, DType::f32);
  EXPECT_DOUBLE_EQ(f.price.seconds, 4 * roofline(512, 1024, 256, kFp32, 0.7, 80, 4));
  EXPECT_EQ(f.price.launches, 4);
  EXPECT_EQ(f.price.detail.rfind("strided_batched", 0), 0u) << f.price.detail;
  EXPECT_HAS(f.price.detail, "priced as the loop: the calibration has no strided_batched curve for fp32");
  EXPECT_NEAR(f.latency, 4 * kLaunch, 1e-15);
  // Counted on the path it was priced on, the reason saying why.
  EXPECT_EQ(call_paths(f), (PathCalls{{"loop", 1}}));
  EXPECT_EQ(f.call_why, f.price.detail);
  EXPECT_EQ(call_paths(one), (PathCalls{{"loop", 1}}));
}

// Without per-path data every call is the loop, exactly as before: the sum of gemm_seconds
// and a launch per problem with an output (k = 0 included), no detail.
TEST(SimGemmPaths, WithoutPathsEveryCallIsTheLoop) {
  const std::vector<Shape> equal(4, Shape{512, 1024, 256});
  const std::vector<Shape> mixed = {{512, 1024, 256}, {0, 1024, 256}, {64, 1024, 0}, {1024, 512, 128}};
  for (const sim::ClusterModel& m : {toy_model(nullptr), sim::load_cluster("dgx-a100x1")}) {
    SCOPED_TRACE(m.name);
    ASSERT_TRUE(m.efficiency.calibration);
    ASSERT_FALSE(m.efficiency.calibration->paths);  // the A100 calibration has none
    sim::Engine e;
    const sim::Topology t(m, e);
    EXPECT_FALSE(t.prices_gemm_paths());
    for (const auto* shapes : {&equal, &mixed}) {
      const Priced p = price(m, *shapes, DType::bf16);
      double seconds = 0;
      std::int64_t launches = 0;
      for (const Shape& s : *shapes) {
        seconds += t.gemm_seconds(s.m, s.n, s.k, DType::bf16);
        launches += s.m > 0 && s.n > 0 ? 1 : 0;
      }
      EXPECT_EQ(p.price.seconds, seconds);
      EXPECT_EQ(p.price.launches, launches);
      EXPECT_EQ(p.price.detail, "");
      EXPECT_EQ(p.detail, "");
      EXPECT_TRUE(p.price.decisions.empty());
      EXPECT_TRUE(p.uses.empty());  // no path recorded where none is priced
      EXPECT_NEAR(p.latency, static_cast<double>(launches) * m.efficiency.launch_latency, 1e-15);
    }
  }
}

// ---- the calibration file's per-path objects -------------------------------------------------

class PathFiles : public ::testing::Test {
 protected:
  void TearDown() override {
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }
  std::string write(const std::string& name, const json& j) {
    if (dir_.empty()) {
      const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
      dir_ = fs::temp_directory_path() / ("moelab_sim_gemm_paths_test_" + std::to_string(::getpid()) + "_" + info->name());
      fs::create_directories(dir_);
    }
    const fs::path p = dir_ / (name + ".json");
    std::ofstream(p) << j.dump(2);
    return p.string();
  }
  // The committed H100 calibration with per-path objects added.
  static json with_paths() {
    json j = json::parse(std::ifstream(fs::path(sim::experiments_dir()) / "hardware" / "calibration" / "h100-sxm5.json"));
    j["paths"] = {{"source", "test"},
                  {"strided_batched", {{"bf16", {{"gemm_max", 0.95}, {"gemm_half_dim", 60}}},
                                       {"tf32", {{"gemm_max", 0.9}, {"gemm_half_dim", 50}, {"source", "tf32 test"}}}}},
                  {"grouped", {{"bf16", {{"gemm_max", 0.35}, {"gemm_half_dim", 40}}}}}};
    j["gemm_paths"] = table_json(100, 400, 250);
    return j;
  }
  std::string error_of(const std::function<void(json&)>& edit) {
    json j = with_paths();
    edit(j);
    const std::string path = write("bad", j);
    try {
      (void)sim::load_gemm_calibration(path);
    } catch (const ConfigError& e) {
      return e.what();
    } catch (const std::exception& e) {
      return std::string("<not a ConfigError: ") + e.what() + ">";
    }
    return "<no error>";
  }

 private:
  fs::path dir_;
};

TEST_F(PathFiles, ReadsThePathsAndTheTable) {
  const sim::GemmCalibration c = sim::load_gemm_calibration(write("good", with_paths()));
  ASSERT_TRUE(c.paths);
  EXPECT_EQ(c.paths->source, "test");
  ASSERT_TRUE(c.paths->strided_batched.bf16);
  EXPECT_EQ(c.paths->strided_batched.bf16->gemm_max, 0.95);
  EXPECT_EQ(c.paths->strided_batched.bf16->gemm_half_dim, 60);
  EXPECT_EQ(c.paths->strided_batched.tf32->source, "tf32 test");
  EXPECT_FALSE(c.paths->strided_batched.fp32);
  EXPECT_EQ(c.paths->curves(GemmPath::strided_batched)->curve("fp32"), nullptr);
  EXPECT_EQ(c.paths->curves(GemmPath::grouped)->curve("bf16")->gemm_max, 0.35);
  EXPECT_FALSE(c.paths->grouped.tf32);
  EXPECT_EQ(c.paths->curves(GemmPath::loop), nullptr);
  ASSERT_EQ(c.paths->table.points.size(), 1u);
  EXPECT_EQ(c.paths->table.points[0].tflops[static_cast<std::size_t>(GemmPath::strided_batched)], 400);
  // The committed H100 calibration carries the cuda backend's own table (the same
  // microbenchmark: the sim chooses as the cuda backend does without a profile) and bf16
  // curves of both batched paths; the A100's, with no per-path measurement, none.
  const sim::GemmCalibration h100 = sim::load_gemm_calibration("h100-sxm5");
  ASSERT_TRUE(h100.paths);
  EXPECT_EQ(sim::to_json(h100.paths->table)["points"], sim::to_json(default_gemm_path_table())["points"]);
  EXPECT_TRUE(h100.paths->strided_batched.bf16 && h100.paths->grouped.bf16);
  EXPECT_FALSE(h100.paths->strided_batched.tf32 || h100.paths->grouped.fp32);
  EXPECT_FALSE(sim::load_gemm_calibration("a100-sxm4").paths);
}

TEST_F(PathFiles, BadPathDataNamesTheField) {
  EXPECT_HAS(error_of([](json& j) { j.erase("gemm_paths"); }), "bad.json: missing field \"gemm_paths\"");
  EXPECT_HAS(error_of([](json& j) { j.erase("paths"); }), "bad.json: missing field \"paths\"");
  EXPECT_HAS(error_of([](json& j) { j["paths"] = 3; }), "bad.json: paths: expected an object");
  EXPECT_HAS(error_of([](json& j) { j["paths"].erase("source"); }), "bad.json: missing field \"paths.source\"");
  EXPECT_HAS(error_of([](json& j) { j["paths"]["batched"] = json::object(); }), "bad.json: unknown field \"paths.batched\"");
  EXPECT_HAS(error_of([](json& j) { j["paths"]["grouped"]["fp16"] = j["paths"]["grouped"]["bf16"]; }),
             "bad.json: unknown field \"paths.grouped.fp16\"");
  EXPECT_HAS(error_of([](json& j) { j["paths"]["grouped"] = "fast"; }), "bad.json: paths.grouped: expected an object");
  EXPECT_HAS(error_of([](json& j) { j["paths"]["strided_batched"]["bf16"]["gemm_max"] = 1.5; }),
             "bad.json: paths.strided_batched.bf16.gemm_max = 1.5 must be in (0, 1]");
  EXPECT_HAS(error_of([](json& j) { j["paths"]["strided_batched"]["bf16"]["gemm_max"] = 0; }),
             "bad.json: paths.strided_batched.bf16.gemm_max = 0 must be in (0, 1]");
  EXPECT_HAS(error_of([](json& j) { j["paths"]["grouped"]["bf16"]["gemm_half_dim"] = -1; }),
             "bad.json: paths.grouped.bf16.gemm_half_dim = -1 must be >= 0");
  EXPECT_HAS(error_of([](json& j) { j["paths"]["grouped"]["bf16"].erase("gemm_half_dim"); }),
             "bad.json: missing field \"paths.grouped.bf16.gemm_half_dim\"");
  EXPECT_HAS(error_of([](json& j) { j["paths"]["grouped"]["bf16"]["half_dim"] = 3; }),
             "bad.json: unknown field \"paths.grouped.bf16.half_dim\"");
  EXPECT_HAS(error_of([](json& j) { j["gemm_paths"]["points"][0]["op"] = "bwd"; }),
             "bad.json: gemm_paths.points[0].op = \"bwd\" is not one of fwd, dgrad, wgrad");
  EXPECT_HAS(error_of([](json& j) { j["gemm_paths"].erase("points"); }), "bad.json: missing field \"gemm_paths.points\"");
  EXPECT_HAS(error_of([](json& j) { j["gemm_paths"] = 1; }), "bad.json: gemm_paths: expected an object");
}

}  // namespace
}  // namespace moelab
