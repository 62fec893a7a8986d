// harness/fuzz/fuzz_workload.cpp — libFuzzer target: the input is a workload file
// (experiments/workloads/*.json), read as `moelab run --workload` reads it: parsed, checked,
// then checked against several world sizes; a workload that loads must also serialise and
// give its expert capacity. See fuzz_common.hpp for the oracle, docs/FUZZING.md for runs.
#include "harness/config/json_fields.hpp"
#include "harness/config/workload.hpp"
#include "harness/fuzz/fuzz_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace moelab;
  const std::string text = fuzz::as_text(data, size), origin = "w.json";
  fuzz::expect_input_errors([&] {
    const WorkloadConfig w =
        json_fields::reading(origin, [&] { return parse_workload(json_fields::parse_text(text, origin), origin); });
    (void)to_json(w).dump();
    (void)w.model.capacity(w.tokens_per_rank);
    for (int world : {1, 2, 3, 8, 4096, 1 << 20}) fuzz::expect_input_errors([&] { validate_for_world(w, world); });
  });
  return 0;
}
