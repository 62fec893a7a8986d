// harness/comm/communicator.cpp
#include "harness/comm/communicator.hpp"

#include <algorithm>
#include <numeric>
#include <string>

#include "harness/runtime/error.hpp"

namespace moelab {

std::vector<SelfCopy> self_copies(std::span<const Segment* const> sends, std::span<const Segment* const> recvs) {
  MOELAB_CHECK(sends.size() == recvs.size(), "self_copies: send and receive segment lists differ");
  std::vector<SelfCopy> out;
  for (std::size_t i = 0; i < sends.size(); ++i) {
    const Segment &s = *sends[i], &r = *recvs[i];
    MOELAB_CHECK(s.count == r.count && s.count > 0 && s.offset >= 0 && r.offset >= 0,
                 "self_copies: segment " + std::to_string(i) + " is empty, negative or unmatched");
    if (!out.empty() && s.offset == out.back().from + out.back().count && r.offset == out.back().to + out.back().count)
      out.back().count += s.count;
    else
      out.push_back({s.offset, r.offset, s.count});
  }
  return out;
}

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
