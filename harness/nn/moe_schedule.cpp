// harness/nn/moe_schedule.cpp — see moe_schedule.hpp.
#include "harness/nn/moe_schedule.hpp"

#include <numeric>

#include "harness/nn/moe_layer.hpp"

namespace moelab {

Chunk peer_chunk(const std::vector<std::int64_t>& sent, const std::vector<std::int64_t>& recv, std::int64_t El,
                 std::int64_t M, std::span<const int> to, std::span<const int> from) {
  const auto at = [El](int p, std::int64_t l) { return static_cast<std::size_t>(p * El + l); };
  const auto W = static_cast<int>(sent.size() / static_cast<std::size_t>(El));
  std::vector<std::int64_t> first_row(static_cast<std::size_t>(W) + 1, 0);  // first T_I row of each peer
  for (int p = 0; p < W; ++p)
    first_row[static_cast<std::size_t>(p) + 1] =
        first_row[static_cast<std::size_t>(p)] +
        std::accumulate(sent.begin() + static_cast<std::ptrdiff_t>(at(p, 0)),
                        sent.begin() + static_cast<std::ptrdiff_t>(at(p, El)), std::int64_t{0});
  Chunk ch;
  ch.rows.assign(static_cast<std::size_t>(El), 0);
  for (int p : from)
    for (std::int64_t l = 0; l < El; ++l) ch.rows[static_cast<std::size_t>(l)] += recv[at(p, l)];
  ch.offset.assign(static_cast<std::size_t>(El), 0);
  std::exclusive_scan(ch.rows.begin(), ch.rows.end(), ch.offset.begin(), std::int64_t{0});
  ch.R = std::accumulate(ch.rows.begin(), ch.rows.end(), std::int64_t{0});
  std::vector<std::int64_t> fill = ch.offset;  // next free row of each local expert in T_DI_c
  for (std::size_t k = 0; k < to.size(); ++k) {
    std::int64_t row = first_row[static_cast<std::size_t>(to[k])];
    for (std::int64_t l = 0; l < El; ++l) {
      ch.sends.push_back({to[k], row * M, sent[at(to[k], l)] * M});
      row += sent[at(to[k], l)];
    }
    for (std::int64_t l = 0; l < El; ++l) {
      const std::int64_t nr = recv[at(from[k], l)];
      ch.recvs.push_back({from[k], fill[static_cast<std::size_t>(l)] * M, nr * M});
      fill[static_cast<std::size_t>(l)] += nr;
    }
  }
  return ch;
}

}  // namespace moelab
