// impls/scmoe/schedule.cpp — the slot and chunk rules (see schedule.hpp).
#include "impls/scmoe/schedule.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "harness/runtime/error.hpp"

namespace moelab::scmoe {

SlotChoice choose_slot(const std::vector<double>& compute, double t_first, double t_second) {
  SlotChoice c;
  const double total = std::accumulate(compute.begin(), compute.end(), 0.0);
  double before = 0;
  for (std::size_t j = 0; j <= compute.size(); ++j) {
    c.cost.push_back(std::abs(before - t_first) + std::abs(total - before - t_second));
    if (j < compute.size()) before += compute[j];
  }
  c.slot = static_cast<int>(std::min_element(c.cost.begin(), c.cost.end()) - c.cost.begin());
  return c;
}

double estimate_pass(const PassTimes& t, int slot, int r) {
  MOELAB_CHECK(slot >= 0 && slot <= static_cast<int>(t.compute.size()) && r >= 1,
               "scmoe estimate_pass: slot " + std::to_string(slot) + ", r " + std::to_string(r));
  const auto s = static_cast<std::ptrdiff_t>(slot);
  const double P = std::accumulate(t.compute.begin(), t.compute.begin() + s, 0.0);
  const double Q = std::accumulate(t.compute.begin() + s, t.compute.end(), 0.0);
  const double d = t.first / r + t.chunk_overhead, x = t.experts / r, c = t.second / r + t.chunk_overhead;
  double compute_at = P, second_at = 0;
  for (int i = 0; i < r; ++i) {
    compute_at = std::max({compute_at, (i + 1) * d, t.ready}) + x;  // chunk i's experts after its first exchange
    second_at = std::max(second_at, compute_at) + c;     // its second exchange after them
  }
  return std::max(compute_at + Q, second_at);
}

ChunkChoice choose_chunks(const PassTimes& fwd, int fwd_slot, const PassTimes& bwd, int bwd_slot) {
  ChunkChoice c;
  for (int r : chunk_candidates()) c.estimate.push_back(estimate_pass(fwd, fwd_slot, r) + estimate_pass(bwd, bwd_slot, r));
  const auto fits = [](const PassTimes& t, int slot) {
    const auto s = static_cast<std::ptrdiff_t>(slot);
    return std::max(t.first, t.ready) <= std::accumulate(t.compute.begin(), t.compute.begin() + s, 0.0) &&
           t.second <= std::accumulate(t.compute.begin() + s, t.compute.end(), 0.0);
  };
  if (fits(fwd, fwd_slot) && fits(bwd, bwd_slot)) return c;  // nothing to hide: one chunk
  const double best = *std::min_element(c.estimate.begin(), c.estimate.end());
  for (std::size_t i = 0; i < c.estimate.size(); ++i)
    if (c.estimate[i] <= best * 1.01) {
      c.chunks = chunk_candidates()[i];
      break;
    }
  return c;
}

}  // namespace moelab::scmoe
