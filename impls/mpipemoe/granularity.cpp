// impls/mpipemoe/granularity.cpp — see granularity.hpp.
#include "impls/mpipemoe/granularity.hpp"

#include <algorithm>
#include <array>
#include <cmath>

namespace moelab {

int GranularitySearch::choose(std::int64_t tokens, const std::function<double(int)>& time) {
  if (auto it = cache_.find(tokens); it != cache_.end()) {
    decisions_.push_back({tokens, it->second, "cache", {}});
    return it->second;
  }
  // The range at or below `tokens`, and the one above.
  auto above = ranges_.upper_bound(tokens);
  auto below = above == ranges_.begin() ? ranges_.end() : std::prev(above);
  if (below != ranges_.end() && tokens <= below->second.first) {
    const int n = below->second.second;
    cache_[tokens] = n;
    decisions_.push_back({tokens, n, "range", {}});
    return n;
  }
  // Bounds from monotonicity; at least min_rows tokens per partition.
  int lo = below != ranges_.end() ? below->second.second : 1;
  int hi = above != ranges_.end() ? above->second.second : max_n_;
  while (hi > 1 && tokens / hi < std::max<std::int64_t>(min_rows_, 1)) hi /= 2;
  lo = std::min(lo, hi);
  Decision d{tokens, lo, "trials", {}};
  double best = time(lo);
  d.trials.push_back({lo, best});
  for (int n = lo * 2; n <= hi; n *= 2) {  // hill-climb while the time improves
    const double t = time(n);
    d.trials.push_back({n, t});
    if (t < best) {
      best = t;
      d.n = n;
    } else if (std::isfinite(best)) {
      break;
    }
    // else: no n so far fits in memory (an infinite trial): finer partitions may.
  }
  // Join a neighbour with the same n, else start a new range.
  if (below != ranges_.end() && below->second.second == d.n) {
    below->second.first = tokens;
  } else if (above != ranges_.end() && above->second.second == d.n) {
    const std::int64_t hi_tokens = above->second.first;
    ranges_.erase(above);
    ranges_[tokens] = {hi_tokens, d.n};
  } else {
    ranges_[tokens] = {tokens, d.n};
  }
  cache_[tokens] = d.n;
  decisions_.push_back(d);
  return d.n;
}

std::vector<std::array<std::int64_t, 3>> GranularitySearch::ranges() const {
  std::vector<std::array<std::int64_t, 3>> v;
  for (const auto& [lo, r] : ranges_) v.push_back({lo, r.first, r.second});
  return v;
}

nlohmann::json GranularitySearch::report() const {
  nlohmann::json j = nlohmann::json::array();
  for (const auto& d : decisions_) {
    nlohmann::json t = nlohmann::json::array();
    for (const auto& tr : d.trials) {
      if (std::isfinite(tr.seconds))
        t.push_back({{"n", tr.n}, {"seconds", tr.seconds}});
      else
        t.push_back({{"n", tr.n}, {"seconds", nullptr}, {"fits", false}});
    }
    j.push_back({{"tokens", d.tokens}, {"n", d.n}, {"how", d.how}, {"trials", t}});
  }
  nlohmann::json r = nlohmann::json::array();
  for (const auto& x : ranges()) r.push_back({{"lo", x[0]}, {"hi", x[1]}, {"n", x[2]}});
  return {{"decisions", j}, {"ranges", r}};
}

}  // namespace moelab
