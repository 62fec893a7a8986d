// baselines/fastmoe/fastmoe.cpp — see fastmoe.hpp.
#include "baselines/fastmoe/fastmoe.hpp"

#include "harness/runtime/error.hpp"

namespace moelab {
namespace {

class FastMoE final : public LayerBackedImpl<MoELayer> {
 public:
  using LayerBackedImpl::LayerBackedImpl;
  std::string name() const override { return "fastmoe"; }
  std::vector<GemmProblem> expert_gemms() override { return layer_.expert_gemm_problems(); }
  nlohmann::json report() override { return {{"schedule", "unpipelined expert parallelism"}}; }
};

std::unique_ptr<MoEImpl> make(Backend& b, Communicator& c, const ModelConfig& m, const nlohmann::json& options,
                              MoEChannels* channels) {
  if (!options.is_null() && !options.empty())
    throw ConfigError("fastmoe takes no options, got " + options.dump());
  return std::make_unique<FastMoE>(b, c, m, channels);
}

}  // namespace

std::unique_ptr<MoEImpl> make_fastmoe(Backend& b, Communicator& c, const ModelConfig& m, const nlohmann::json& options) {
  return make(b, c, m, options, nullptr);
}

void register_fastmoe() { register_impl("fastmoe", make); }

}  // namespace moelab
