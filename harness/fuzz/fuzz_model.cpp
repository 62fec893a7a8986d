// harness/fuzz/fuzz_model.cpp — libFuzzer target: the input is a model file
// (experiments/models/*.json), optionally followed by a NUL byte and a --model-override
// object, read as `moelab run --model FILE --model-override JSON` reads them; a model that
// loads must also give its parameter counts and activation sizes and serialise. See
// fuzz_common.hpp for the oracle, docs/FUZZING.md for runs.
#include "harness/config/json_fields.hpp"
#include "harness/config/model.hpp"
#include "harness/fuzz/fuzz_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace moelab;
  const std::string all = fuzz::as_text(data, size), origin = "m.json";
  const std::size_t nul = all.find('\0');
  const std::string file = all.substr(0, nul);
  fuzz::expect_input_errors([&] {
    const nlohmann::json overrides = nul == std::string::npos
                                         ? nlohmann::json::object()
                                         : json_fields::parse_options(all.substr(nul + 1), "--model-override");
    const TransformerConfig t = json_fields::reading(
        origin, [&] { return parse_transformer(json_fields::parse_text(file, origin), origin, overrides); });
    (void)t.parameter_counts();
    // Every layer's configuration (a vision model's stages; the first layers of a deep model).
    for (int l = 0; l < t.num_layers && l < 64; ++l) (void)t.layer_config(l).head_dim();
    for (std::int64_t batch : {1, 8, 1 << 20}) fuzz::expect_input_errors([&] { (void)t.activation_sizes(batch); });
    (void)to_json(t).dump();
  });
  return 0;
}
