// harness/fuzz/fuzz_routing_trace.cpp — libFuzzer target: the input is a routing trace
// (`moelab run --record-routing`), loaded as `moelab run --routing trace:FILE` loads it; a
// trace that loads is then replayed by the routing model for several calls, ranks, token
// counts and expert counts (rescaled to another token count where it was recorded with one):
// every count must be >= 0 and the slots must add up. See fuzz_common.hpp for the oracle,
// docs/FUZZING.md for runs.
#include <numeric>

#include "harness/backends/sim/sim_backend.hpp"
#include "harness/fuzz/fuzz_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace moelab;
  const std::string path = fuzz::write_file(fuzz::scratch_dir() / "trace.json", fuzz::as_text(data, size));
  fuzz::expect_input_errors([&] {
    const RoutingModel m = RoutingModel::parse("trace:" + path, 1);
    (void)m.describe();
    const std::int64_t experts = static_cast<std::int64_t>(m.trace[0][0].size());
    for (const std::int64_t tokens : {std::int64_t{1}, std::int64_t{64}, std::int64_t{1} << 20})
      for (const int call : {0, 1, 7})
        for (const int rank : {0, 3})
          fuzz::expect_input_errors([&] {
            const auto r = m.draw(rank, call, tokens, 1, experts);
            for (const auto c : r)
              if (c < 0) fuzz::finding("a negative replayed count", std::to_string(c));
            if (std::accumulate(r.begin(), r.end(), std::int64_t{0}) != tokens)
              fuzz::finding("replayed slots that do not add up to tokens x top_k", std::to_string(tokens));
          });
  });
  return 0;
}
