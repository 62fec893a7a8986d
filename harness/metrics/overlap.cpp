// harness/metrics/overlap.cpp — see overlap.hpp.
#include "harness/metrics/overlap.hpp"

#include <algorithm>

namespace moelab {

namespace {
using Intervals = std::vector<std::pair<double, double>>;

Intervals merged(Intervals v) {
  std::sort(v.begin(), v.end());
  Intervals out;
  for (const auto& [a, b] : v) {
    if (b <= a) continue;
    if (!out.empty() && a <= out.back().second)
      out.back().second = std::max(out.back().second, b);
    else
      out.push_back({a, b});
  }
  return out;
}

double length(const Intervals& m) {
  double s = 0;
  for (const auto& [a, b] : m) s += b - a;
  return s;
}

double intersection(const Intervals& x, const Intervals& y) {  // both merged
  double s = 0;
  std::size_t i = 0, j = 0;
  while (i < x.size() && j < y.size()) {
    const double a = std::max(x[i].first, y[j].first), b = std::min(x[i].second, y[j].second);
    if (b > a) s += b - a;
    (x[i].second < y[j].second) ? ++i : ++j;
  }
  return s;
}
}  // namespace

double union_length(std::vector<std::pair<double, double>> intervals) { return length(merged(std::move(intervals))); }

OverlapFigures overlap_figures(const std::vector<OpRecord>& ops) {
  Intervals compute, comm, copies;
  for (const auto& op : ops) {
    switch (op.cost.kind) {
      case OpKind::collective: comm.push_back({op.start, op.end}); break;
      case OpKind::copy_h2d:
      case OpKind::copy_d2h: copies.push_back({op.start, op.end}); break;
      case OpKind::host: break;
      default: compute.push_back({op.start, op.end});
    }
  }
  const Intervals mc = merged(std::move(compute)), mm = merged(std::move(comm));
  OverlapFigures f;
  f.compute_busy = length(mc);
  f.comm_time = length(mm);
  f.hidden_comm = intersection(mc, mm);
  f.copy_time = union_length(std::move(copies));
  return f;
}

}  // namespace moelab
