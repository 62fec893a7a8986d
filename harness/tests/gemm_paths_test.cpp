// harness/tests/gemm_paths_test.cpp — the per-call choice of GEMM path (harness/runtime/
// gemm_paths.hpp): each path where the table says, ties, mixed shapes, padding waste, one
// problem; the table lookup (interpolation in rows, nearest shape and expert count, precision
// fallback); the H100 table's measured crossovers; strided runs found from addresses. No GPU.
//   ctest --test-dir build -R gemm_paths_test
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "harness/runtime/backend.hpp"
#include "harness/runtime/gemm_paths.hpp"

namespace moelab {
namespace {

constexpr auto kLoop = GemmPath::loop;
constexpr auto kStrided = GemmPath::strided_batched;
constexpr auto kGrouped = GemmPath::grouped;

double at(const GemmPathChoice& c, GemmPath p) { return c.seconds[static_cast<std::size_t>(p)]; }

// A table small enough to compute by hand: fwd, d_model = d_hidden = 1000, 8 experts; at 256
// rows (the log-midpoint of 64 and 1024) loop 405, strided 500, grouped 225 TFLOP/s.
GemmPathTable toy_table() {
  GemmPathTable t;
  t.source = "test";
  t.points.push_back({"bf16", GemmOp::fwd, 1000, 1000, 8, 64, {10, 200, 150}});
  t.points.push_back({"bf16", GemmOp::fwd, 1000, 1000, 8, 1024, {800, 800, 300}});
  return t;
}

GemmShape fwd(std::int64_t rows, std::int64_t k = 1000, std::int64_t n = 1000) { return {false, false, rows, n, k}; }

GemmCall call_of(std::vector<GemmShape> ps, bool strided = false) {
  GemmCall c;
  c.problems = std::move(ps);
  c.strided = strided;
  return c;
}

// Seconds of a [rows,1000]x[1000,1000] GEMM at `tflops`.
double secs(std::int64_t rows, double tflops) { return 2.0 * static_cast<double>(rows) * 1e6 / (tflops * 1e12); }

TEST(GemmPathTable, InterpolatesInLogRowsAndHoldsFlatBeyond) {
  const GemmPathTable t = toy_table();
  EXPECT_DOUBLE_EQ(gemm_path_tflops(t, kLoop, "bf16", GemmOp::fwd, 1000000, 8, 64), 10.0);
  EXPECT_NEAR(gemm_path_tflops(t, kLoop, "bf16", GemmOp::fwd, 1000000, 8, 256), 405.0, 1e-9);
  EXPECT_NEAR(gemm_path_tflops(t, kGrouped, "bf16", GemmOp::fwd, 1000000, 8, 128), 187.5, 1e-9);
  EXPECT_DOUBLE_EQ(gemm_path_tflops(t, kLoop, "bf16", GemmOp::fwd, 1000000, 8, 1), 10.0);
  EXPECT_DOUBLE_EQ(gemm_path_tflops(t, kLoop, "bf16", GemmOp::fwd, 1000000, 8, 1 << 20), 800.0);
}

TEST(GemmPathTable, NearestShapeAndExpertsThenFallbacksNoted) {
  GemmPathTable t = toy_table();
  t.points.push_back({"bf16", GemmOp::fwd, 2000, 8000, 8, 64, {50, 60, 70}});   // width 16e6
  t.points.push_back({"bf16", GemmOp::fwd, 1000, 1000, 64, 64, {20, 30, 40}});  // 64 experts
  // Width 3e6 is nearer 1e6 than 16e6 in ratio (3 < 5.3); 4e6 is exactly between: the smaller.
  EXPECT_DOUBLE_EQ(gemm_path_tflops(t, kLoop, "bf16", GemmOp::fwd, 3000000, 8, 64), 10.0);
  EXPECT_DOUBLE_EQ(gemm_path_tflops(t, kLoop, "bf16", GemmOp::fwd, 4000000, 8, 64), 10.0);
  EXPECT_DOUBLE_EQ(gemm_path_tflops(t, kLoop, "bf16", GemmOp::fwd, 10000000, 8, 64), 50.0);
  EXPECT_DOUBLE_EQ(gemm_path_tflops(t, kLoop, "bf16", GemmOp::fwd, 1000000, 40, 64), 20.0);
  EXPECT_DOUBLE_EQ(gemm_path_tflops(t, kLoop, "bf16", GemmOp::fwd, 1000000, 16, 64), 10.0);
  std::string note;
  EXPECT_DOUBLE_EQ(gemm_path_tflops(t, kLoop, "fp32", GemmOp::wgrad, 1000000, 8, 64, &note), 10.0);
  EXPECT_NE(note.find("no fp32 figures: bf16 crossovers used"), std::string::npos) << note;
  EXPECT_NE(note.find("no wgrad figures"), std::string::npos) << note;
  // A path nobody measured has no figure.
  for (auto& p : t.points) p.tflops[static_cast<std::size_t>(kGrouped)] = 0;
  EXPECT_EQ(gemm_path_tflops(t, kGrouped, "bf16", GemmOp::fwd, 1000000, 8, 64), 0.0);
}

TEST(GemmPathShape, OpRowsAndWidthFollowTheTransposes) {
  const GemmShape f{false, false, 37, 300, 200}, d{false, true, 37, 200, 300}, w{true, false, 200, 300, 37};
  EXPECT_EQ(f.op(), GemmOp::fwd);
  EXPECT_EQ(d.op(), GemmOp::dgrad);
  EXPECT_EQ(w.op(), GemmOp::wgrad);
  EXPECT_EQ(f.rows(), 37);
  EXPECT_EQ(d.rows(), 37);
  EXPECT_EQ(w.rows(), 37);
  EXPECT_EQ(f.width(), 60000);
  EXPECT_EQ(d.width(), 60000);
  EXPECT_EQ(w.width(), 60000);
  EXPECT_EQ((GemmShape{true, true, 4, 5, 6}.op()), GemmOp::fwd);
}

TEST(GemmPathChoice, NothingAndOneProblem) {
  const GemmPathTable t = toy_table();
  const auto none = choose_gemm_path(call_of({}), t);
  EXPECT_EQ(none.path, kLoop);
  EXPECT_NE(none.why.find("nothing"), std::string::npos);
  // One problem is one cublasGemmEx whatever the table: even where grouped would be faster.
  const auto one = choose_gemm_path(call_of({fwd(64)}, true), t);
  EXPECT_EQ(one.path, kLoop);
  EXPECT_NE(one.why.find("one problem"), std::string::npos) << one.why;
  EXPECT_DOUBLE_EQ(at(one, kLoop), secs(64, 10));
  EXPECT_TRUE(std::isinf(at(one, kGrouped)));
}

TEST(GemmPathChoice, EachPathWhereTheTableSaysSo) {
  const GemmPathTable t = toy_table();
  // Large experts: the loop (800) over grouped (300); strided ties the loop but the operands
  // are not equally strided.
  auto c = choose_gemm_path(call_of(std::vector<GemmShape>(8, fwd(1024))), t);
  EXPECT_EQ(c.path, kLoop) << c.why;
  EXPECT_NEAR(at(c, kLoop), 8 * secs(1024, 800), 1e-15);
  EXPECT_NEAR(at(c, kGrouped), 8 * secs(1024, 300), 1e-15);
  EXPECT_TRUE(std::isinf(at(c, kStrided)));
  EXPECT_NE(c.why.find("not equally strided"), std::string::npos) << c.why;
  // Small experts, unstrided: grouped (150) over the loop (10).
  c = choose_gemm_path(call_of(std::vector<GemmShape>(8, fwd(64))), t);
  EXPECT_EQ(c.path, kGrouped) << c.why;
  // The same equally strided: strided (200) over grouped (150).
  c = choose_gemm_path(call_of(std::vector<GemmShape>(8, fwd(64)), true), t);
  EXPECT_EQ(c.path, kStrided) << c.why;
  EXPECT_EQ(c.strided_rows, 64);
  EXPECT_NEAR(at(c, kStrided), 8 * secs(64, 200), 1e-15);
  // Between the measured rows: 256 rows, loop 405 < strided 500, grouped 225.
  c = choose_gemm_path(call_of(std::vector<GemmShape>(8, fwd(256)), true), t);
  EXPECT_EQ(c.path, kStrided) << c.why;
  c = choose_gemm_path(call_of(std::vector<GemmShape>(8, fwd(256))), t);
  EXPECT_EQ(c.path, kLoop) << c.why;
  // No grouped kernel for the types: the loop even for small experts.
  GemmCall g = call_of(std::vector<GemmShape>(8, fwd(64)));
  g.grouped_available = false;
  c = choose_gemm_path(g, t);
  EXPECT_EQ(c.path, kLoop) << c.why;
  EXPECT_TRUE(std::isinf(at(c, kGrouped)));
  EXPECT_NE(c.why.find("no kernel"), std::string::npos) << c.why;
}

// --gemm-path: the forced path where it can run the call as it is, the table's choice (and
// why not) elsewhere; the estimates are the table's either way.
TEST(GemmPathChoice, AForcedPathRunsWhereItCan) {
  const GemmPathTable t = toy_table();
  const GemmCall strided = call_of(std::vector<GemmShape>(8, fwd(64)), true);  // the table: strided
  const GemmPathChoice table = choose_gemm_path(strided, t);
  ASSERT_EQ(table.path, kStrided);
  auto c = force_gemm_path(table, kGrouped, strided);
  EXPECT_EQ(c.path, kGrouped);
  EXPECT_EQ(c.why.rfind("grouped (forced); the table's choice: strided_batched", 0), 0u) << c.why;
  EXPECT_EQ(c.seconds, table.seconds);
  c = force_gemm_path(table, kLoop, strided);
  EXPECT_EQ(c.path, kLoop) << c.why;
  c = force_gemm_path(table, kStrided, strided);
  EXPECT_EQ(c.path, kStrided);
  EXPECT_EQ(c.why.rfind("strided_batched (forced; also the table's choice)", 0), 0u) << c.why;
  // Not equally strided: no strided batch, whatever is forced; the table's grouped instead.
  const GemmCall loose = call_of(std::vector<GemmShape>(8, fwd(64)));
  c = force_gemm_path(choose_gemm_path(loose, t), kStrided, loose);
  EXPECT_EQ(c.path, kGrouped);
  EXPECT_EQ(c.why.rfind("strided_batched forced but cannot run this call (not one equally strided batch): grouped", 0), 0u)
      << c.why;
  // No grouped kernel for the types, or a single problem: the grouped path cannot run.
  GemmCall no_kernel = loose;
  no_kernel.grouped_available = false;
  c = force_gemm_path(choose_gemm_path(no_kernel, t), kGrouped, no_kernel);
  EXPECT_EQ(c.path, kLoop);
  EXPECT_NE(c.why.find("no grouped kernel for these types"), std::string::npos) << c.why;
  const GemmCall one = call_of({fwd(64)}, true);
  c = force_gemm_path(choose_gemm_path(one, t), kGrouped, one);
  EXPECT_EQ(c.path, kLoop);
  EXPECT_NE(c.why.find("(one problem)"), std::string::npos) << c.why;
}

TEST(GemmPathChoice, TiesGoToStridedThenLoopThenGrouped) {
  GemmPathTable t = toy_table();
  // 1024 rows, strided: strided and loop both 800 -> strided.
  auto c = choose_gemm_path(call_of(std::vector<GemmShape>(8, fwd(1024)), true), t);
  EXPECT_EQ(c.path, kStrided) << c.why;
  EXPECT_EQ(c.why.rfind("strided_batched (", 0), 0u) << c.why;
  // Loop 1% slower than grouped is a tie (2%) -> the loop; 5% slower -> grouped.
  t.points = {{"bf16", GemmOp::fwd, 1000, 1000, 8, 64, {99, 0, 100}}};
  c = choose_gemm_path(call_of(std::vector<GemmShape>(8, fwd(64))), t);
  EXPECT_EQ(c.path, kLoop) << c.why;
  EXPECT_NE(c.why.find("tie within 2.0% of grouped: loop preferred"), std::string::npos) << c.why;
  t.points = {{"bf16", GemmOp::fwd, 1000, 1000, 8, 64, {95, 0, 100}}};
  c = choose_gemm_path(call_of(std::vector<GemmShape>(8, fwd(64))), t);
  EXPECT_EQ(c.path, kGrouped) << c.why;
  // Strided 1.5% slower than the loop: still strided.
  t.points = {{"bf16", GemmOp::fwd, 1000, 1000, 8, 64, {100, 98.5, 50}}};
  c = choose_gemm_path(call_of(std::vector<GemmShape>(8, fwd(64)), true), t);
  EXPECT_EQ(c.path, kStrided) << c.why;
  // No tolerance: the strict fastest.
  t.tie_tolerance = 0;
  c = choose_gemm_path(call_of(std::vector<GemmShape>(8, fwd(64)), true), t);
  EXPECT_EQ(c.path, kLoop) << c.why;
}

TEST(GemmPathChoice, MixedShapesSumEachProblemAtItsOwnRows) {
  const GemmPathTable t = toy_table();
  // One large expert and seven small ones: the loop pays 10 TFLOP/s on the small ones.
  std::vector<GemmShape> ps{fwd(1024)};
  for (int i = 0; i < 7; ++i) ps.push_back(fwd(64));
  auto c = choose_gemm_path(call_of(ps, true), t);  // `strided` means nothing for unequal shapes
  const double loop = secs(1024, 800) + 7 * secs(64, 10), grouped = secs(1024, 300) + 7 * secs(64, 150);
  EXPECT_NEAR(at(c, kLoop), loop, 1e-15);
  EXPECT_NEAR(at(c, kGrouped), grouped, 1e-15);
  EXPECT_TRUE(std::isinf(at(c, kStrided)));
  EXPECT_EQ(c.path, loop < grouped ? kLoop : kGrouped) << c.why;
  EXPECT_NE(c.why.find("unequal shapes"), std::string::npos) << c.why;
  EXPECT_NE(c.why.find("64-1024 rows"), std::string::npos) << c.why;
  // Different ops and widths in one call: each problem is priced as its own op and width.
  std::vector<GemmShape> mixed{fwd(64), GemmShape{true, false, 1000, 1000, 64}, fwd(64, 2000, 500)};
  GemmPathTable t2 = t;
  t2.points.push_back({"bf16", GemmOp::wgrad, 1000, 1000, 8, 64, {1, 1, 1}});
  c = choose_gemm_path(call_of(mixed), t2);
  EXPECT_NEAR(at(c, kLoop), 2 * secs(64, 10) + secs(64, 1), 1e-15);
  EXPECT_NE(c.why.find("mixed problems"), std::string::npos) << c.why;
}

TEST(GemmPathChoice, PaddingToAFixedRowStrideOnlyWhenTheWasteIsSmall) {
  const GemmPathTable t = toy_table();  // max_padding_waste 12.5%
  // 8 experts of 60-64 rows in a 64-row layout: 3.1% padding, strided at 64 rows wins.
  std::vector<GemmShape> ps;
  for (std::int64_t r : {64, 60, 64, 62, 64, 64, 60, 58}) ps.push_back(fwd(r));
  GemmCall c = call_of(ps);
  c.padded_rows = 64;
  auto ch = choose_gemm_path(c, t);
  EXPECT_EQ(ch.path, kStrided) << ch.why;
  EXPECT_EQ(ch.strided_rows, 64);
  EXPECT_NEAR(ch.padding_waste, 1.0 - 496.0 / 512.0, 1e-12);
  EXPECT_NEAR(at(ch, kStrided), 8 * secs(64, 200), 1e-15);  // the padded FLOPs are paid
  EXPECT_NE(ch.why.find("padded to 64 rows (3.1% padding)"), std::string::npos) << ch.why;
  // Half the experts at 32 rows: 25% padding, refused though the estimate would win.
  ps.clear();
  for (std::int64_t r : {64, 32, 64, 32, 64, 32, 64, 32}) ps.push_back(fwd(r));
  c = call_of(ps);
  c.padded_rows = 64;
  ch = choose_gemm_path(c, t);
  EXPECT_EQ(ch.path, kGrouped) << ch.why;
  EXPECT_EQ(ch.strided_rows, 0);
  EXPECT_TRUE(std::isinf(at(ch, kStrided)));
  EXPECT_NEAR(ch.padding_waste, 0.25, 1e-12);
  EXPECT_NE(ch.why.find("padding to 64 rows wastes 25.0% (above 12.5%)"), std::string::npos) << ch.why;
  // The threshold itself is allowed; just above it is not.
  GemmPathTable t25 = t;
  t25.max_padding_waste = 0.25;
  EXPECT_EQ(choose_gemm_path(c, t25).path, kStrided);
  t25.max_padding_waste = 0.2499;
  EXPECT_NE(choose_gemm_path(c, t25).path, kStrided);
  // A problem with more rows than the stride, or another width, cannot be padded.
  ps = std::vector<GemmShape>(8, fwd(64));
  ps[3] = fwd(65);
  c = call_of(ps);
  c.padded_rows = 64;
  EXPECT_TRUE(std::isinf(at(choose_gemm_path(c, t), kStrided)));
  ps[3] = fwd(64, 1000, 999);
  c = call_of(ps);
  c.padded_rows = 64;
  EXPECT_TRUE(std::isinf(at(choose_gemm_path(c, t), kStrided)));
  // wgrad pads its inner (token) dimension.
  GemmPathTable tw = t;
  for (auto& p : tw.points) p.op = GemmOp::wgrad;
  ps.clear();
  for (std::int64_t r : {64, 63, 64, 64}) ps.push_back(GemmShape{true, false, 1000, 1000, r});
  c = call_of(ps);
  c.padded_rows = 64;
  ch = choose_gemm_path(c, tw);
  EXPECT_EQ(ch.strided_rows, 64);
  EXPECT_NEAR(ch.padding_waste, 1.0 / 256.0, 1e-12);
  // Experts without a row are in the padded batch too (padded_batch): their rows are all
  // padding, counted in the waste and paid in the estimate.
  ps = std::vector<GemmShape>(7, fwd(64));
  c = call_of(ps);
  c.padded_rows = 64;
  c.padded_batch = 8;
  ch = choose_gemm_path(c, t);
  EXPECT_EQ(ch.path, kStrided) << ch.why;
  EXPECT_NEAR(ch.padding_waste, 1.0 / 8.0, 1e-12);
  EXPECT_NEAR(at(ch, kStrided), 8 * secs(64, 200), 1e-15);
  c.padded_batch = 9;  // 2 of 9 empty: 22% padding
  EXPECT_NEAR(choose_gemm_path(c, t).padding_waste, 2.0 / 9.0, 1e-12);
  EXPECT_TRUE(std::isinf(at(choose_gemm_path(c, t), kStrided)));
}

TEST(GemmPathChoice, NoFigureAtAllFallsBackToTheLoop) {
  GemmPathTable empty;
  const auto c = choose_gemm_path(call_of(std::vector<GemmShape>(4, fwd(64)), true), empty);
  EXPECT_EQ(c.path, kLoop);
  EXPECT_NE(c.why.find("no table figure"), std::string::npos) << c.why;
}

// The H100 measurements the default table holds decide as they were measured.
TEST(GemmPathChoice, TheH100TableKeepsItsMeasuredCrossovers) {
  const GemmPathTable& t = default_gemm_path_table();
  EXPECT_EQ(t.points.size(), 96u);
  EXPECT_NE(t.source.find("H100"), std::string::npos);
  auto experts = [](std::int64_t e, GemmShape s, bool strided) { return call_of(std::vector<GemmShape>(static_cast<std::size_t>(e), s), strided); };
  // GPT3-XL-like experts (2048/8192), 8 of 8192 rows: the loop (830) over grouped (329).
  auto c = choose_gemm_path(experts(8, fwd(8192, 2048, 8192), false), t);
  EXPECT_EQ(c.path, kLoop) << c.why;
  // ... and their weight gradient, 8192 rows as the inner dimension: the loop (859 vs 320).
  c = choose_gemm_path(experts(8, GemmShape{true, false, 2048, 8192, 8192}, false), t);
  EXPECT_EQ(c.path, kLoop) << c.why;
  // 64 experts of 256 rows: loop 467 over grouped 284; strided 596 when the layout allows.
  c = choose_gemm_path(experts(64, fwd(256, 2048, 8192), false), t);
  EXPECT_EQ(c.path, kLoop) << c.why;
  c = choose_gemm_path(experts(64, fwd(256, 2048, 8192), true), t);
  EXPECT_EQ(c.path, kStrided) << c.why;
  // GPT3-S-like (768/3072), 64 experts of 256 rows: grouped (279) over the loop (104) ...
  c = choose_gemm_path(experts(64, fwd(256, 768, 3072), false), t);
  EXPECT_EQ(c.path, kGrouped) << c.why;
  // ... strided (480) when equally strided; at 64 rows strided 150 still edges out grouped 146.
  c = choose_gemm_path(experts(64, fwd(256, 768, 3072), true), t);
  EXPECT_EQ(c.path, kStrided) << c.why;
  c = choose_gemm_path(experts(64, fwd(64, 768, 3072), true), t);
  EXPECT_EQ(c.path, kStrided) << c.why;
  // fp32 calls use the bf16 crossovers and say so.
  GemmCall f = experts(8, fwd(8192, 2048, 8192), false);
  f.precision = "tf32";
  c = choose_gemm_path(f, t);
  EXPECT_EQ(c.path, kLoop);
  EXPECT_NE(c.why.find("no tf32 figures: bf16 crossovers used"), std::string::npos) << c.why;
}

// ---- strided runs ---------------------------------------------------------------------------

GemmOperands operands(GemmShape s, std::uint64_t a, std::uint64_t b, std::uint64_t c, DType ab = DType::bf16,
                      DType ct = DType::bf16, float beta = 0.0f) {
  GemmOperands o;
  o.shape = s;
  o.beta = beta;
  o.ab = ab;
  o.c_type = ct;
  o.a = a;
  o.b = b;
  o.c = c;
  return o;
}

// The layer's layout with equal rows: X rows [E*r, k] packed, W [E, k, n], C rows [E*r, n].
std::vector<GemmOperands> packed(int E, std::int64_t r, std::int64_t k, std::int64_t n, std::size_t elem = 2) {
  std::vector<GemmOperands> ps;
  for (int e = 0; e < E; ++e) {
    const auto ue = static_cast<std::uint64_t>(e);
    ps.push_back(operands(fwd(r, k, n), 0x1000 + ue * static_cast<std::uint64_t>(r * k) * elem,
                          0x900000 + ue * static_cast<std::uint64_t>(k * n) * elem,
                          0x5000000 + ue * static_cast<std::uint64_t>(r * n) * elem));
  }
  return ps;
}

TEST(StridedRuns, EquallyStridedProblemsAreOneRun) {
  const auto ps = packed(6, 37, 33, 19);
  const auto runs = strided_runs(ps);
  ASSERT_EQ(runs.size(), 1u);
  EXPECT_EQ(runs[0].begin, 0u);
  EXPECT_EQ(runs[0].end, 6u);
  EXPECT_EQ(runs[0].stride_a, 37 * 33);
  EXPECT_EQ(runs[0].stride_b, 33 * 19);
  EXPECT_EQ(runs[0].stride_c, 37 * 19);
  // One weight for every problem (stride 0) is still one run; C may not repeat.
  auto shared = ps;
  for (auto& p : shared) p.b = 0x900000;
  EXPECT_EQ(strided_runs(shared).size(), 1u);
  EXPECT_EQ(strided_runs(shared)[0].stride_b, 0);
  auto same_c = ps;
  for (auto& p : same_c) p.c = 0x5000000;
  EXPECT_EQ(strided_runs(same_c).size(), 6u);
}

TEST(StridedRuns, BreaksWhereShapeScalarsTypesOrStridesChange) {
  auto ps = packed(6, 37, 33, 19);
  // An expert skipped (no rows): the weights jump by two, the packed rows do not.
  std::vector<GemmOperands> skipped;
  for (std::size_t i = 0; i < ps.size(); ++i)
    if (i != 3) skipped.push_back(ps[i]);
  for (std::size_t i = 3; i < skipped.size(); ++i) {
    skipped[i].a -= 37 * 33 * 2;
    skipped[i].c -= 37 * 19 * 2;
  }
  auto runs = strided_runs(skipped);
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0].end, 3u);
  EXPECT_EQ(runs[1].begin, 3u);
  EXPECT_EQ(runs[1].end, 5u);
  // Another shape, scalar or C type in the middle cuts the run there.
  for (int what = 0; what < 3; ++what) {
    auto v = ps;
    if (what == 0) v[2].shape.n = 18;
    if (what == 1) v[2].beta = 1.0f;
    if (what == 2) v[2].c_type = DType::f32;
    runs = strided_runs(v);
    ASSERT_EQ(runs.size(), 3u) << what;
    EXPECT_EQ(runs[0].size(), 2u);
    EXPECT_EQ(runs[1].size(), 1u);
    EXPECT_EQ(runs[1].stride_a, 0);
    EXPECT_EQ(runs[2].size(), 3u);
  }
  // C matrices that overlap (stride below m·n), operands not a whole element apart, or going
  // backwards are no strided batch.
  auto overlap = ps;
  for (std::size_t i = 0; i < overlap.size(); ++i) overlap[i].c = 0x5000000 + i * (37 * 19 - 1) * 2;
  EXPECT_EQ(strided_runs(overlap).size(), 6u);
  auto odd = ps;
  odd[1].a += 1;
  EXPECT_EQ(strided_runs(odd).front().size(), 1u);
  auto backwards = ps;
  std::swap(backwards[0], backwards[1]);
  EXPECT_EQ(strided_runs(backwards).front().size(), 1u);
  EXPECT_TRUE(strided_runs(std::vector<GemmOperands>{}).empty());
}

// A padded call as the chooser sees it: the problems that multiply (an expert without rows has
// none: m = 0 in forward, k = 0 in a weight gradient), the stride, and the whole padded batch.
TEST(PaddedGemmCall, KeepsTheProblemsThatMultiplyAndCountsTheWholeBatch) {
  std::vector<GemmProblem> ps(4);
  for (auto& p : ps) p.token_stride = 64;
  ps[0].m = 40, ps[0].n = 768, ps[0].k = 3072;                      // forward, 40 rows
  ps[1].m = 0, ps[1].n = 768, ps[1].k = 3072;                       // forward, no rows
  ps[2].trans_a = true, ps[2].m = 768, ps[2].n = 3072, ps[2].k = 0;  // weight gradient, no rows
  ps[3].trans_a = true, ps[3].m = 768, ps[3].n = 3072, ps[3].k = 64; // weight gradient, 64 rows
  const GemmCall c = padded_gemm_call(ps, "bf16");
  ASSERT_EQ(c.problems.size(), 2u);
  EXPECT_EQ(c.problems[0], (GemmShape{false, false, 40, 768, 3072}));
  EXPECT_EQ(c.problems[1], (GemmShape{true, false, 768, 3072, 64}));
  EXPECT_EQ(c.padded_rows, 64);
  EXPECT_EQ(c.padded_batch, 4);
  EXPECT_FALSE(c.strided);
  EXPECT_EQ(c.precision, "bf16");
  EXPECT_EQ(padded_gemm_call({}, "fp32").padded_rows, 0);
}

TEST(GemmPathNames, RoundTrip) {
  for (GemmPath p : {kLoop, kStrided, kGrouped}) {
    GemmPath q = kLoop;
    EXPECT_TRUE(parse_gemm_path(gemm_path_name(p), q));
    EXPECT_EQ(p, q);
  }
  GemmPath q = kLoop;
  EXPECT_FALSE(parse_gemm_path("batched", q));
  for (GemmOp o : {GemmOp::fwd, GemmOp::dgrad, GemmOp::wgrad}) {
    GemmOp r = GemmOp::fwd;
    EXPECT_TRUE(parse_gemm_op(gemm_op_name(o), r));
    EXPECT_EQ(o, r);
  }
}

}  // namespace
}  // namespace moelab
