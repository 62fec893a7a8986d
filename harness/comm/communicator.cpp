// harness/comm/communicator.cpp
#include "harness/comm/communicator.hpp"

#include <algorithm>
#include <numeric>

#include "harness/runtime/error.hpp"

namespace moelab {

double segments_bytes_to_others(std::span<const Segment> sends, int self, DType dtype) {
  double b = 0;
  for (const auto& s : sends)
    if (s.peer != self) b += static_cast<double>(s.count) * static_cast<double>(dtype_size(dtype));
  return b;
}

std::unique_ptr<Communicator> Communicator::split(int, int) {
  throw Unsupported("communicator \"" + kind() + "\" cannot be split");
}

std::vector<int> Communicator::world_ranks() const {
  std::vector<int> r(static_cast<std::size_t>(size()));
  std::iota(r.begin(), r.end(), 0);
  return r;
}

int Communicator::world_rank(int rank) const {
  const auto w = world_ranks();
  MOELAB_CHECK(rank >= 0 && rank < static_cast<int>(w.size()), "world_rank: rank outside the communicator");
  return w[static_cast<std::size_t>(rank)];
}

std::vector<int> split_members(std::span<const std::pair<int, int>> color_key, int color) {
  std::vector<int> members;
  if (color < 0) return members;
  for (std::size_t r = 0; r < color_key.size(); ++r)
    if (color_key[r].first == color) members.push_back(static_cast<int>(r));
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
    return color_key[static_cast<std::size_t>(a)].second < color_key[static_cast<std::size_t>(b)].second;
  });
  return members;
}

}  // namespace moelab
