// harness/nn/data.hpp — a synthetic language for training runs and tests that need no
// dataset: every sequence starts at a random token and follows a fixed random permutation
// of the vocabulary (t_{i+1} = next[t_i]). A model learns it through the embedding, the
// layers and the head, so the loss falls from ln V towards 0; how fast says whether the
// gradients reach every parameter. Deterministic in (seed, step, microbatch, rank).
#pragma once
#include <cstdint>
#include <numeric>
#include <vector>

#include "harness/runtime/random.hpp"

namespace moelab {

struct TokenBatch {
  std::vector<std::int32_t> ids;      // [B*S]
  std::vector<std::int32_t> targets;  // [B*S]: the next token of each
};

inline std::vector<std::int32_t> synthetic_successor(std::int64_t vocab, std::uint64_t seed) {
  std::vector<std::int32_t> next(static_cast<std::size_t>(vocab));
  std::iota(next.begin(), next.end(), 0);
  Rng rng(Rng::mix(seed, 0x1a46));
  for (std::size_t i = next.size(); i > 1; --i)  // Fisher-Yates
    std::swap(next[i - 1], next[static_cast<std::size_t>(rng.next() % i)]);
  return next;
}

inline TokenBatch synthetic_batch(const std::vector<std::int32_t>& next, std::int64_t batch, std::int64_t seq,
                                  std::uint64_t seed, std::uint64_t step, int microbatch, int rank) {
  TokenBatch tb;
  tb.ids.resize(static_cast<std::size_t>(batch * seq));
  tb.targets.resize(tb.ids.size());
  Rng rng(Rng::mix(seed, step, Rng::mix(static_cast<std::uint64_t>(microbatch), static_cast<std::uint64_t>(rank))));
  const auto V = static_cast<std::uint64_t>(next.size());
  for (std::int64_t b = 0; b < batch; ++b) {
    auto t = static_cast<std::int32_t>(rng.next() % V);
    for (std::int64_t i = 0; i < seq; ++i) {
      const auto at = static_cast<std::size_t>(b * seq + i);
      tb.ids[at] = t;
      t = next[static_cast<std::size_t>(t)];
      tb.targets[at] = t;
    }
  }
  return tb;
}

}  // namespace moelab
