// impls/mpipemoe/granularity.hpp — MPipeMoE's online granularity search (Algorithm 1).
//
// The best number of partitions n grows with the tokens per rank B (finer partitions add
// launch overhead and lower GEMM efficiency; coarser ones overlap less), and the paper
// assumes it grows monotonically. So the search keeps disjoint token ranges [lo, hi] -> n in
// an ordered map (O(log) lookup) plus a cache keyed on B:
//   * B cached, or inside a known range: that n, no trial;
//   * otherwise the neighbouring ranges bound n (monotonicity): trial runs time a forward pass
//     at candidate n (powers of two between the bounds), hill-climbing from the lower bound
//     while the time improves; every rank times the same candidates and the ranks agree on
//     each time with an all-reduce (max), so all choose the same n;
//   * B then joins a neighbouring range with the same n, or starts a new one.
#pragma once
#include <cstdint>
#include <functional>
#include <array>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace moelab {

class GranularitySearch {
 public:
  struct Trial {
    int n;
    double seconds;
  };
  struct Decision {
    std::int64_t tokens;
    int n;
    std::string how;  // "cache", "range", "trials"
    std::vector<Trial> trials;
  };

  // max_n: the largest n to try; min_rows: the fewest tokens a partition may get.
  GranularitySearch(int max_n, std::int64_t min_rows) : max_n_(max_n), min_rows_(min_rows) {}

  // time(n) runs one timed trial at n and returns the time every rank agreed on, or infinity
  // where n does not fit in memory (the climb then goes on to finer partitions until one fits).
  int choose(std::int64_t tokens, const std::function<double(int)>& time);

  const std::vector<Decision>& decisions() const { return decisions_; }
  // The ordered map as [lo, hi, n] triples.
  std::vector<std::array<std::int64_t, 3>> ranges() const;
  nlohmann::json report() const;

 private:
  int max_n_;
  std::int64_t min_rows_;
  std::map<std::int64_t, std::pair<std::int64_t, int>> ranges_;  // lo -> (hi, n)
  std::map<std::int64_t, int> cache_;
  std::vector<Decision> decisions_;
};

}  // namespace moelab
