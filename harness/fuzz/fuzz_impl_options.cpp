// harness/fuzz/fuzz_impl_options.cpp — libFuzzer target: the input is the text of
// --impl-options, read as `moelab run` reads it (json_fields::parse_options: an object,
// repeated keys rejected) and then read field by field with the typed Options helper the way
// an implementation reads its options (integers with bounds, a choice, a boolean, a bounded
// number, a string), and checked through the registry's options checks of every registered
// implementation. See fuzz_common.hpp for the oracle, docs/FUZZING.md for runs.
#include "harness/config/json_fields.hpp"
#include "harness/fuzz/fuzz_common.hpp"
#include "harness/nn/moe_impl.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace moelab;
  const std::string text = fuzz::as_text(data, size);
  fuzz::expect_input_errors([&] {
    const nlohmann::json j = json_fields::parse_options(text, "--impl-options");
    // MPipeMoE's and FasterMoE's options, as a schema: every reader of the helper.
    json_fields::Options o(j, "--impl-options",
                           {"partitions", "max_partitions", "min_partition_tokens", "reuse", "strategy", "comp_tflops",
                            "sigma", "group_size", "name"});
    if (o.has("partitions") && !(j["partitions"].is_string() && j["partitions"] == "auto"))
      (void)o.positive_int("partitions", 1, 1 << 20);
    (void)o.integer("max_partitions", 16, 1, 1 << 20);
    (void)o.integer("min_partition_tokens", 64, 0, std::int64_t{1} << 40);
    (void)o.boolean("reuse", false);
    (void)o.choice("strategy", "auto", {"none", "S1", "S2", "S3", "S4", "auto"});
    (void)o.number("comp_tflops", 1.0, 1e-6, 1e6);
    (void)o.number("sigma", 1.0, 1e-3, 1.0);
    (void)o.positive_int("group_size", 1, 1 << 20);
    (void)o.string("name", "");
    ModelConfig m;
    m.d_model = 64;
    m.d_hidden = 256;
    m.num_experts = 8;
    m.top_k = 2;
    for (const auto& name : impl_names())
      fuzz::expect_input_errors([&] { check_impl_options(name, j, {m, 2, 512}); });
  });
  return 0;
}
