// harness/runtime/gemm_paths.cpp — see gemm_paths.hpp.
#include "harness/runtime/gemm_paths.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <tuple>
#include <utility>

#include "harness/runtime/backend.hpp"

namespace moelab {

const char* gemm_path_name(GemmPath p) {
  switch (p) {
    case GemmPath::loop: return "loop";
    case GemmPath::strided_batched: return "strided_batched";
    case GemmPath::grouped: return "grouped";
  }
  return "?";
}

const char* gemm_op_name(GemmOp o) {
  switch (o) {
    case GemmOp::fwd: return "fwd";
    case GemmOp::dgrad: return "dgrad";
    case GemmOp::wgrad: return "wgrad";
  }
  return "?";
}

namespace {
// The value among `all` whose name is s.
template <class E, std::size_t N>
bool parse_named(const std::string& s, const E (&all)[N], const char* (*name)(E), E& out) {
  for (E v : all)
    if (s == name(v)) {
      out = v;
      return true;
    }
  return false;
}
}  // namespace

bool parse_gemm_path(const std::string& s, GemmPath& out) {
  constexpr GemmPath all[] = {GemmPath::loop, GemmPath::strided_batched, GemmPath::grouped};
  return parse_named(s, all, gemm_path_name, out);
}

bool parse_gemm_op(const std::string& s, GemmOp& out) {
  constexpr GemmOp all[] = {GemmOp::fwd, GemmOp::dgrad, GemmOp::wgrad};
  return parse_named(s, all, gemm_op_name, out);
}

GemmOp GemmShape::op() const {
  if (trans_a && !trans_b) return GemmOp::wgrad;
  if (!trans_a && trans_b) return GemmOp::dgrad;
  return GemmOp::fwd;
}

std::int64_t GemmShape::rows() const { return op() == GemmOp::wgrad ? k : m; }

std::int64_t GemmShape::width() const { return op() == GemmOp::wgrad ? m * n : n * k; }

// ---- the default table -----------------------------------------------------------------------
//
// A cuBLAS microbenchmark of the experts' GEMMs on one NVIDIA H100 80GB HBM3 (cuBLAS 13,
// nvcc -arch=sm_90), run beside the measurements of commit e25e2a0: for each op, shape,
// expert count and rows per expert, the same E problems through a loop of cublasGemmEx, one
// cublasGemmStridedBatchedEx, and one cublasGemmGroupedBatchedEx with a single group of E;
// bf16 A, B and C, fp32 accumulate; CUDA-event median of 20 calls. Columns: op, d_model,
// d_hidden, experts, rows per expert, TFLOP/s of {loop, strided_batched, grouped}.
namespace {

struct Row {
  GemmOp op;
  std::int64_t d_model, d_hidden, experts, rows;
  std::array<double, kNumGemmPaths> tflops;
};

constexpr Row kH100Bf16[] = {
    {GemmOp::fwd, 768, 3072, 8, 64, {35.0, 116.7, 98.9}},
    {GemmOp::fwd, 768, 3072, 8, 128, {69.6, 185.3, 137.0}},
    {GemmOp::fwd, 768, 3072, 8, 256, {146.7, 325.1, 215.2}},
    {GemmOp::fwd, 768, 3072, 8, 512, {268.2, 463.9, 249.7}},
    {GemmOp::fwd, 768, 3072, 8, 1024, {404.7, 589.5, 270.8}},
    {GemmOp::fwd, 768, 3072, 8, 2048, {517.5, 676.2, 289.0}},
    {GemmOp::fwd, 768, 3072, 8, 4096, {586.7, 710.9, 297.2}},
    {GemmOp::fwd, 768, 3072, 8, 8192, {665.0, 738.8, 301.4}},
    {GemmOp::fwd, 768, 3072, 64, 64, {38.4, 149.5, 146.0}},
    {GemmOp::fwd, 768, 3072, 64, 128, {54.2, 275.2, 235.6}},
    {GemmOp::fwd, 768, 3072, 64, 256, {103.7, 480.0, 278.6}},
    {GemmOp::fwd, 768, 3072, 64, 512, {193.8, 641.4, 296.9}},
    {GemmOp::fwd, 768, 3072, 64, 1024, {395.7, 755.4, 299.7}},
    {GemmOp::fwd, 768, 3072, 64, 2048, {541.9, 793.1, 300.3}},
    {GemmOp::fwd, 768, 3072, 64, 4096, {614.3, 793.2, 300.1}},
    {GemmOp::fwd, 768, 3072, 64, 8192, {675.1, 775.1, 303.1}},
    {GemmOp::fwd, 2048, 8192, 8, 64, {116.6, 146.4, 160.0}},
    {GemmOp::fwd, 2048, 8192, 8, 128, {248.8, 308.8, 245.7}},
    {GemmOp::fwd, 2048, 8192, 8, 256, {449.3, 552.8, 316.3}},
    {GemmOp::fwd, 2048, 8192, 8, 512, {648.9, 731.6, 325.6}},
    {GemmOp::fwd, 2048, 8192, 8, 1024, {742.2, 757.0, 324.4}},
    {GemmOp::fwd, 2048, 8192, 8, 2048, {789.0, 800.0, 320.2}},
    {GemmOp::fwd, 2048, 8192, 8, 4096, {838.3, 812.6, 328.0}},
    {GemmOp::fwd, 2048, 8192, 8, 8192, {830.3, 842.3, 328.8}},
    {GemmOp::fwd, 2048, 8192, 64, 64, {135.1, 187.6, 178.2}},
    {GemmOp::fwd, 2048, 8192, 64, 128, {258.9, 346.3, 233.9}},
    {GemmOp::fwd, 2048, 8192, 64, 256, {467.2, 596.0, 284.1}},
    {GemmOp::fwd, 2048, 8192, 64, 512, {654.3, 739.2, 302.1}},
    {GemmOp::fwd, 2048, 8192, 64, 1024, {757.2, 785.3, 299.4}},
    {GemmOp::fwd, 2048, 8192, 64, 2048, {780.0, 785.7, 309.6}},
    {GemmOp::fwd, 2048, 8192, 64, 4096, {811.1, 792.8, 308.5}},
    {GemmOp::fwd, 2048, 8192, 64, 8192, {773.0, 756.4, 299.0}},
    {GemmOp::dgrad, 768, 3072, 8, 64, {19.6, 99.1, 59.8}},
    {GemmOp::dgrad, 768, 3072, 8, 128, {50.1, 166.8, 94.9}},
    {GemmOp::dgrad, 768, 3072, 8, 256, {104.5, 284.4, 188.0}},
    {GemmOp::dgrad, 768, 3072, 8, 512, {213.0, 466.0, 218.9}},
    {GemmOp::dgrad, 768, 3072, 8, 1024, {350.4, 630.5, 305.5}},
    {GemmOp::dgrad, 768, 3072, 8, 2048, {538.5, 731.4, 324.2}},
    {GemmOp::dgrad, 768, 3072, 8, 4096, {701.5, 814.4, 340.1}},
    {GemmOp::dgrad, 768, 3072, 8, 8192, {781.7, 835.8, 352.6}},
    {GemmOp::dgrad, 768, 3072, 64, 64, {27.1, 150.5, 140.4}},
    {GemmOp::dgrad, 768, 3072, 64, 128, {73.4, 262.7, 250.6}},
    {GemmOp::dgrad, 768, 3072, 64, 256, {140.8, 457.7, 322.8}},
    {GemmOp::dgrad, 768, 3072, 64, 512, {252.7, 676.5, 332.0}},
    {GemmOp::dgrad, 768, 3072, 64, 1024, {375.6, 791.1, 347.8}},
    {GemmOp::dgrad, 768, 3072, 64, 2048, {580.1, 840.4, 341.4}},
    {GemmOp::dgrad, 768, 3072, 64, 4096, {721.8, 864.7, 351.2}},
    {GemmOp::dgrad, 768, 3072, 64, 8192, {767.8, 842.1, 351.7}},
    {GemmOp::dgrad, 2048, 8192, 8, 64, {102.6, 151.5, 135.3}},
    {GemmOp::dgrad, 2048, 8192, 8, 128, {209.5, 291.1, 263.3}},
    {GemmOp::dgrad, 2048, 8192, 8, 256, {411.4, 538.6, 333.0}},
    {GemmOp::dgrad, 2048, 8192, 8, 512, {491.8, 813.9, 339.0}},
    {GemmOp::dgrad, 2048, 8192, 8, 1024, {690.6, 636.0, 338.3}},
    {GemmOp::dgrad, 2048, 8192, 8, 2048, {847.4, 902.4, 343.3}},
    {GemmOp::dgrad, 2048, 8192, 8, 4096, {902.3, 853.2, 348.2}},
    {GemmOp::dgrad, 2048, 8192, 8, 8192, {921.2, 819.7, 346.4}},
    {GemmOp::dgrad, 2048, 8192, 64, 64, {118.2, 167.8, 167.4}},
    {GemmOp::dgrad, 2048, 8192, 64, 128, {207.7, 312.0, 275.2}},
    {GemmOp::dgrad, 2048, 8192, 64, 256, {419.2, 603.0, 295.1}},
    {GemmOp::dgrad, 2048, 8192, 64, 512, {500.4, 869.3, 316.2}},
    {GemmOp::dgrad, 2048, 8192, 64, 1024, {815.4, 858.7, 310.2}},
    {GemmOp::dgrad, 2048, 8192, 64, 2048, {805.1, 851.4, 311.4}},
    {GemmOp::dgrad, 2048, 8192, 64, 4096, {840.6, 869.3, 301.7}},
    {GemmOp::dgrad, 2048, 8192, 64, 8192, {845.0, 871.3, 263.4}},
    {GemmOp::wgrad, 768, 3072, 8, 64, {32.3, 91.7, 58.1}},
    {GemmOp::wgrad, 768, 3072, 8, 128, {71.7, 164.8, 100.3}},
    {GemmOp::wgrad, 768, 3072, 8, 256, {145.5, 274.0, 160.5}},
    {GemmOp::wgrad, 768, 3072, 8, 512, {266.3, 445.4, 237.5}},
    {GemmOp::wgrad, 768, 3072, 8, 1024, {411.3, 604.6, 293.1}},
    {GemmOp::wgrad, 768, 3072, 8, 2048, {140.6, 449.2, 258.2}},
    {GemmOp::wgrad, 768, 3072, 8, 4096, {621.7, 765.3, 344.8}},
    {GemmOp::wgrad, 768, 3072, 8, 8192, {730.4, 845.8, 348.0}},
    {GemmOp::wgrad, 768, 3072, 64, 64, {36.1, 142.9, 75.7}},
    {GemmOp::wgrad, 768, 3072, 64, 128, {83.7, 267.4, 128.7}},
    {GemmOp::wgrad, 768, 3072, 64, 256, {151.2, 462.7, 200.6}},
    {GemmOp::wgrad, 768, 3072, 64, 512, {297.6, 603.9, 275.3}},
    {GemmOp::wgrad, 768, 3072, 64, 1024, {319.1, 732.4, 314.6}},
    {GemmOp::wgrad, 768, 3072, 64, 2048, {586.3, 787.0, 324.5}},
    {GemmOp::wgrad, 768, 3072, 64, 4096, {658.4, 850.3, 310.7}},
    {GemmOp::wgrad, 768, 3072, 64, 8192, {762.3, 849.9, 273.7}},
    {GemmOp::wgrad, 2048, 8192, 8, 64, {110.2, 120.6, 78.5}},
    {GemmOp::wgrad, 2048, 8192, 8, 128, {229.8, 278.2, 140.6}},
    {GemmOp::wgrad, 2048, 8192, 8, 256, {383.8, 520.0, 213.4}},
    {GemmOp::wgrad, 2048, 8192, 8, 512, {538.9, 677.7, 283.4}},
    {GemmOp::wgrad, 2048, 8192, 8, 1024, {699.2, 806.0, 324.9}},
    {GemmOp::wgrad, 2048, 8192, 8, 2048, {807.9, 823.9, 335.5}},
    {GemmOp::wgrad, 2048, 8192, 8, 4096, {869.2, 772.0, 316.8}},
    {GemmOp::wgrad, 2048, 8192, 8, 8192, {859.3, 815.4, 319.7}},
    {GemmOp::wgrad, 2048, 8192, 64, 64, {129.1, 158.6, 83.2}},
    {GemmOp::wgrad, 2048, 8192, 64, 128, {240.7, 303.5, 145.3}},
    {GemmOp::wgrad, 2048, 8192, 64, 256, {394.3, 574.3, 216.6}},
    {GemmOp::wgrad, 2048, 8192, 64, 512, {549.3, 718.0, 271.6}},
    {GemmOp::wgrad, 2048, 8192, 64, 1024, {699.2, 746.6, 317.2}},
    {GemmOp::wgrad, 2048, 8192, 64, 2048, {792.1, 797.1, 295.5}},
    {GemmOp::wgrad, 2048, 8192, 64, 4096, {808.6, 810.7, 230.7}},
    {GemmOp::wgrad, 2048, 8192, 64, 8192, {843.2, 823.3, 165.2}},
};

GemmPathTable make_default_table() {
  GemmPathTable t;
  t.source = "measured on one NVIDIA H100 80GB HBM3, cuBLAS 13, bf16 (fp32 accumulate): a loop of "
             "cublasGemmEx, cublasGemmStridedBatchedEx and cublasGemmGroupedBatchedEx over the experts' "
             "fwd/dgrad/wgrad GEMMs, d_model/d_hidden 768/3072 and 2048/8192, 8 and 64 experts, 64-8192 rows "
             "each, median of 20";
  for (const Row& r : kH100Bf16) {
    GemmPathPoint p;
    p.precision = "bf16";
    p.op = r.op;
    p.d_model = r.d_model;
    p.d_hidden = r.d_hidden;
    p.experts = r.experts;
    p.rows = r.rows;
    p.tflops = r.tflops;
    t.points.push_back(std::move(p));
  }
  return t;
}

constexpr double kInf = std::numeric_limits<double>::infinity();

double log_distance(double a, double b) { return std::abs(std::log(std::max(a, 1.0)) - std::log(std::max(b, 1.0))); }

// Keeps the points whose key is nearest `want` in ratio (ties: the smaller key).
template <class Key>
void keep_nearest(std::vector<const GemmPathPoint*>& pts, double want, Key key) {
  double best_d = kInf, best_k = kInf;
  for (const auto* p : pts) {
    const double k = static_cast<double>(key(*p)), d = log_distance(k, want);
    if (d < best_d - 1e-12 || (std::abs(d - best_d) <= 1e-12 && k < best_k)) {
      best_d = d;
      best_k = k;
    }
  }
  std::erase_if(pts, [&](const GemmPathPoint* p) { return static_cast<double>(key(*p)) != best_k; });
}

std::string ms(double seconds) {
  if (!std::isfinite(seconds)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g ms", seconds * 1e3);
  return buf;
}

std::string percent(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", 100.0 * x);
  return buf;
}

}  // namespace

const GemmPathTable& default_gemm_path_table() {
  static const GemmPathTable t = make_default_table();
  return t;
}

namespace {

// The figures of one path for one (precision, op, width, experts), as (log rows, TFLOP/s) in
// increasing rows: the narrowing gemm_path_tflops documents.
using Curve = std::vector<std::pair<double, double>>;

Curve path_curve(const GemmPathTable& t, GemmPath path, const std::string& precision, GemmOp op, std::int64_t width,
                 std::int64_t experts, std::string* note) {
  const auto at = static_cast<std::size_t>(path);
  std::vector<const GemmPathPoint*> pts;
  for (const auto& p : t.points)
    if (p.tflops[at] > 0) pts.push_back(&p);
  if (pts.empty()) return {};
  auto narrow = [&](auto pred, const std::string& missing) {
    std::vector<const GemmPathPoint*> kept;
    for (const auto* p : pts)
      if (pred(*p)) kept.push_back(p);
    if (kept.empty()) {
      if (note && note->find(missing) == std::string::npos) *note += (note->empty() ? "" : "; ") + missing;
    } else {
      pts = std::move(kept);
    }
  };
  narrow([&](const GemmPathPoint& p) { return p.precision == precision; },
         "no " + precision + " figures: " + pts.front()->precision + " crossovers used");
  narrow([&](const GemmPathPoint& p) { return p.op == op; }, std::string("no ") + gemm_op_name(op) + " figures");
  keep_nearest(pts, static_cast<double>(width), [](const GemmPathPoint& p) { return p.d_model * p.d_hidden; });
  keep_nearest(pts, static_cast<double>(experts), [](const GemmPathPoint& p) { return p.experts; });
  Curve c;
  for (const auto* p : pts) c.push_back({std::log(static_cast<double>(std::max<std::int64_t>(p->rows, 1))), p->tflops[at]});
  std::stable_sort(c.begin(), c.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return c;
}

double on_curve(const Curve& c, std::int64_t rows) {
  if (c.empty()) return 0.0;
  const double r = std::log(static_cast<double>(std::max<std::int64_t>(rows, 1)));
  if (r <= c.front().first) return c.front().second;
  if (r >= c.back().first) return c.back().second;
  const auto hi = std::lower_bound(c.begin(), c.end(), r, [](const auto& p, double x) { return p.first < x; });
  const auto lo = hi - 1;
  return hi->first > lo->first ? lo->second + (hi->second - lo->second) * (r - lo->first) / (hi->first - lo->first)
                               : hi->second;
}

}  // namespace

double gemm_path_tflops(const GemmPathTable& t, GemmPath path, const std::string& precision, GemmOp op,
                        std::int64_t width, std::int64_t experts, std::int64_t rows, std::string* note) {
  return on_curve(path_curve(t, path, precision, op, width, experts, note), rows);
}

GemmPathChoice choose_gemm_path(const GemmCall& call, const GemmPathTable& table) {
  GemmPathChoice c;
  c.seconds.fill(kInf);
  const auto& ps = call.problems;
  if (ps.empty()) {
    c.why = "nothing to multiply";
    return c;
  }
  const auto E = static_cast<std::int64_t>(ps.size());
  std::string notes;
  // Each problem at the rate the table gives a call of E problems of its rows; one curve per
  // (path, op, width) of the call.
  std::vector<std::tuple<GemmPath, GemmOp, std::int64_t, Curve>> curves;
  auto rate = [&](GemmPath path, const GemmShape& p, std::int64_t rows) {
    for (const auto& [cp, co, cw, curve] : curves)
      if (cp == path && co == p.op() && cw == p.width()) return on_curve(curve, rows);
    curves.emplace_back(path, p.op(), p.width(), path_curve(table, path, call.precision, p.op(), p.width(), E, &notes));
    return on_curve(std::get<3>(curves.back()), rows);
  };
  auto sum_over_problems = [&](GemmPath path) {
    double s = 0;
    for (const auto& p : ps) {
      const double r = rate(path, p, p.rows());
      if (!(r > 0)) return kInf;
      s += p.flops() / (r * 1e12);
    }
    return s;
  };
  c.seconds[static_cast<std::size_t>(GemmPath::loop)] = sum_over_problems(GemmPath::loop);
  if (ps.size() == 1) {
    c.why = "one problem: one cublasGemmEx";
    return c;
  }
  if (call.grouped_available) c.seconds[static_cast<std::size_t>(GemmPath::grouped)] = sum_over_problems(GemmPath::grouped);

  // The strided path: the problems as they are, or padded to the caller's fixed row stride.
  std::int64_t min_rows = ps.front().rows(), max_rows = min_rows, total_rows = 0;
  for (const auto& p : ps) {
    min_rows = std::min(min_rows, p.rows());
    max_rows = std::max(max_rows, p.rows());
    total_rows += p.rows();
  }
  const bool equal = std::all_of(ps.begin(), ps.end(), [&](const GemmShape& p) { return p == ps.front(); });
  // Equal but for the token rows (the dimension padding changes).
  const auto with_rows = [](GemmShape s, std::int64_t r) {
    (s.op() == GemmOp::wgrad ? s.k : s.m) = r;
    return s;
  };
  const bool equal_but_rows = std::all_of(ps.begin(), ps.end(), [&](const GemmShape& p) {
    return with_rows(p, 0) == with_rows(ps.front(), 0);
  });
  std::string strided_note;
  bool padded = false;
  const std::int64_t batch = std::max(call.padded_batch, E);  // the padded batch's problems
  if (call.strided && equal) {
    c.strided_rows = ps.front().rows();
  } else if (call.padded_rows > 0 && equal_but_rows && max_rows <= call.padded_rows) {
    c.padding_waste = 1.0 - static_cast<double>(total_rows) / static_cast<double>(batch * call.padded_rows);
    padded = c.padding_waste <= table.max_padding_waste;
    if (padded)
      c.strided_rows = call.padded_rows;
    else
      strided_note = "strided_batched refused: padding to " + std::to_string(call.padded_rows) + " rows wastes " +
                     percent(c.padding_waste) + " (above " + percent(table.max_padding_waste) + ")";
  } else if (equal) {
    strided_note = "strided_batched: operands not equally strided";
  } else {
    strided_note = "strided_batched: unequal shapes";
  }
  if (c.strided_rows > 0) {
    const GemmShape s = with_rows(ps.front(), c.strided_rows);
    const double r = rate(GemmPath::strided_batched, s, c.strided_rows);
    const std::int64_t n = c.strided_rows == call.padded_rows && call.padded_rows > 0 && !(call.strided && equal) ? batch : E;
    if (r > 0) c.seconds[static_cast<std::size_t>(GemmPath::strided_batched)] = static_cast<double>(n) * s.flops() / (r * 1e12);
  }

  const double best = *std::min_element(c.seconds.begin(), c.seconds.end());
  std::string decided;
  if (!std::isfinite(best)) {
    c.path = GemmPath::loop;
    decided = "no table figure for any path: loop";
  } else {
    GemmPath strict = GemmPath::loop;
    for (GemmPath p : {GemmPath::loop, GemmPath::strided_batched, GemmPath::grouped})
      if (c.seconds[static_cast<std::size_t>(p)] == best) strict = p;
    for (GemmPath p : {GemmPath::strided_batched, GemmPath::loop, GemmPath::grouped})
      if (c.seconds[static_cast<std::size_t>(p)] <= best * (1.0 + table.tie_tolerance)) {
        c.path = p;
        break;
      }
    decided = c.path == strict ? "fastest" : std::string("tie within ") + percent(table.tie_tolerance) + " of " +
                                                 gemm_path_name(strict) + ": " + gemm_path_name(c.path) + " preferred";
  }
  const GemmShape& f = ps.front();
  c.why = std::string(gemm_path_name(c.path)) + " (" + decided + "): est. loop " +
          ms(c.seconds[static_cast<std::size_t>(GemmPath::loop)]) + ", strided_batched " +
          ms(c.seconds[static_cast<std::size_t>(GemmPath::strided_batched)]) + ", grouped " +
          ms(c.seconds[static_cast<std::size_t>(GemmPath::grouped)]) + " for " + std::to_string(E) + " " +
          (equal_but_rows ? gemm_op_name(f.op()) : "mixed") + " problems of " + std::to_string(min_rows) +
          (max_rows > min_rows ? "-" + std::to_string(max_rows) : std::string()) + " rows, " + call.precision;
  if (padded)
    c.why += ", padded to " + std::to_string(call.padded_rows) + " rows (" + percent(c.padding_waste) + " padding)";
  if (!strided_note.empty()) c.why += "; " + strided_note;
  if (!call.grouped_available) c.why += "; grouped: no kernel for these types";
  if (!notes.empty()) c.why += "; " + notes;
  return c;
}

GemmPathChoice force_gemm_path(GemmPathChoice choice, GemmPath forced, const GemmCall& call) {
  const bool several = call.problems.size() > 1;
  const bool can = forced == GemmPath::loop || (forced == GemmPath::strided_batched && call.strided && several) ||
                   (forced == GemmPath::grouped && call.grouped_available && several);
  if (forced == choice.path) {
    choice.why = std::string(gemm_path_name(forced)) + " (forced; also the table's choice): " + choice.why;
  } else if (can) {
    choice.path = forced;
    choice.why = std::string(gemm_path_name(forced)) + " (forced); the table's choice: " + choice.why;
  } else {
    choice.why = std::string(gemm_path_name(forced)) + " forced but cannot run this call (" +
                 (several ? forced == GemmPath::grouped ? "no grouped kernel for these types" : "not one equally strided batch"
                          : "one problem") +
                 "): " + choice.why;
  }
  return choice;
}

GemmPathChoice force_padded_batch(GemmPathChoice choice, std::int64_t padded_rows) {
  const std::string what = "strided_batched over " + std::to_string(padded_rows) + " padded rows";
  choice.why = what + (choice.path == GemmPath::strided_batched ? " (forced; also the table's choice): "
                                                                : " (forced); the table's choice: ") + choice.why;
  choice.path = GemmPath::strided_batched;
  return choice;
}

// ---- strided batches ----------------------------------------------------------------------------

namespace {

bool same_kind(const GemmOperands& x, const GemmOperands& y) {
  return x.shape == y.shape && x.alpha == y.alpha && x.beta == y.beta && x.ab == y.ab && x.c_type == y.c_type;
}

// The element stride from `from` to `to` (bytes), when whole and not negative.
bool element_stride(std::uint64_t from, std::uint64_t to, std::size_t elem, std::int64_t& out) {
  if (to < from) return false;
  const std::uint64_t d = to - from;
  if (d % elem != 0) return false;
  out = static_cast<std::int64_t>(d / elem);
  return true;
}

}  // namespace

std::vector<StridedRun> strided_runs(std::span<const GemmOperands> ps) {
  std::vector<StridedRun> runs;
  std::size_t i = 0;
  while (i < ps.size()) {
    StridedRun r{i, i + 1, 0, 0, 0};
    if (i + 1 < ps.size() && same_kind(ps[i], ps[i + 1])) {
      const std::size_t ea = dtype_size(ps[i].ab), ec = dtype_size(ps[i].c_type);
      const std::int64_t c_elems = ps[i].shape.m * ps[i].shape.n;
      if (element_stride(ps[i].a, ps[i + 1].a, ea, r.stride_a) && element_stride(ps[i].b, ps[i + 1].b, ea, r.stride_b) &&
          element_stride(ps[i].c, ps[i + 1].c, ec, r.stride_c) && r.stride_c >= c_elems && r.stride_c > 0) {
        const auto at = [&](std::uint64_t base, std::size_t j, std::int64_t stride, std::size_t elem) {
          return base + static_cast<std::uint64_t>(j - i) * static_cast<std::uint64_t>(stride) * elem;
        };
        std::size_t j = i + 1;
        while (j < ps.size() && same_kind(ps[i], ps[j]) && ps[j].a == at(ps[i].a, j, r.stride_a, ea) &&
               ps[j].b == at(ps[i].b, j, r.stride_b, ea) && ps[j].c == at(ps[i].c, j, r.stride_c, ec))
          ++j;
        r.end = j;
      }
    }
    if (r.size() == 1) r.stride_a = r.stride_b = r.stride_c = 0;
    runs.push_back(r);
    i = r.end;
  }
  return runs;
}

GemmCall padded_gemm_call(std::span<const GemmProblem> problems, std::string precision) {
  GemmCall call;
  for (const auto& p : problems)
    if (p.m > 0 && p.n > 0 && p.k > 0) call.problems.push_back({p.trans_a, p.trans_b, p.m, p.n, p.k});
  call.precision = std::move(precision);
  call.padded_rows = problems.empty() ? 0 : problems.front().token_stride;
  call.padded_batch = static_cast<std::int64_t>(problems.size());
  return call;
}

GemmOperands gemm_operands(const GemmProblem& p) {
  GemmOperands o;
  o.shape = {p.trans_a, p.trans_b, p.m, p.n, p.k};
  o.alpha = p.alpha;
  o.beta = p.beta;
  o.ab = p.a.defined() ? p.a.dtype() : DType::f32;
  o.c_type = p.c.defined() ? p.c.dtype() : DType::f32;
  o.a = reinterpret_cast<std::uintptr_t>(p.a.raw());
  o.b = reinterpret_cast<std::uintptr_t>(p.b.raw());
  o.c = reinterpret_cast<std::uintptr_t>(p.c.raw());
  return o;
}

void GemmPathLedger::note(const std::string& op, GemmPath path, const std::string& why) {
  std::lock_guard lock(mu_);
  GemmPathUse& u = uses_[{op, static_cast<int>(path)}];
  u.op = op;
  u.path = path;
  ++u.calls;
  u.last_why = why;
}

std::vector<GemmPathUse> GemmPathLedger::uses() const {
  std::lock_guard lock(mu_);
  std::vector<GemmPathUse> out;
  out.reserve(uses_.size());
  for (const auto& [key, use] : uses_) out.push_back(use);
  return out;
}

}  // namespace moelab
