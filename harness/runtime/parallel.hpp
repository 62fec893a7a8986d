// harness/runtime/parallel.hpp — a plain parallel loop for host-side set-up work (drawing a
// model's initial parameters: a billion values take tens of seconds on one thread).
#pragma once
#include <algorithm>
#include <cstddef>
#include <thread>
#include <vector>

namespace moelab {

// body(begin, end) over [0, n) in contiguous chunks of at least `grain` elements, on up to
// hardware_concurrency() threads (the calling one included). The chunks cover [0, n) exactly
// once, so a body whose result for an element depends only on its index (a random stream
// skipped to it: Rng::skip) gives the same values as one serial loop.
template <class F>
void parallel_for(std::size_t n, std::size_t grain, F&& body) {
  const std::size_t hw = std::max<std::size_t>(1, std::thread::hardware_concurrency());
  const std::size_t chunks = std::min(hw, std::max<std::size_t>(1, n / std::max<std::size_t>(grain, 1)));
  if (chunks <= 1) {
    body(std::size_t{0}, n);
    return;
  }
  const std::size_t per = (n + chunks - 1) / chunks;
  std::vector<std::thread> threads;
  threads.reserve(chunks - 1);
  for (std::size_t c = 1; c < chunks; ++c) {
    const std::size_t b = std::min(n, c * per), e = std::min(n, b + per);
    if (b < e) threads.emplace_back([&body, b, e] { body(b, e); });
  }
  body(std::size_t{0}, std::min(n, per));
  for (auto& t : threads) t.join();
}

}  // namespace moelab
