// baselines/fastmoe/fastmoe.cpp — see fastmoe.hpp.
#include "baselines/fastmoe/fastmoe.hpp"

#include "harness/runtime/error.hpp"

namespace moelab {
namespace {

class FastMoE final : public MoEImpl {
 public:
  FastMoE(Backend& b, Communicator& c, const ModelConfig& m) : layer_(b, c, m) {}
  std::string name() const override { return "fastmoe"; }
  void init_parameters(std::uint64_t seed) override { layer_.init_parameters(seed); }
  void zero_grad() override { layer_.zero_grad(); }
  Tensor forward(const Tensor& x) override { return layer_.forward(x); }
  Tensor backward(const Tensor& dy, float grad_aux) override { return layer_.backward(dy, grad_aux); }
  float aux_loss() override { return layer_.aux_loss(); }
  MoEParams& params() override { return layer_.params(); }
  MoEParams& grads() override { return layer_.grads(); }
  const RoutingStats& routing() const override { return layer_.routing(); }
  std::vector<GemmProblem> expert_gemms() override { return layer_.expert_gemm_problems(); }
  MoELayer& layer() override { return layer_; }
  nlohmann::json report() override { return {{"schedule", "unpipelined expert parallelism"}}; }

 private:
  MoELayer layer_;
};

}  // namespace

std::unique_ptr<MoEImpl> make_fastmoe(Backend& b, Communicator& c, const ModelConfig& m, const nlohmann::json& options) {
  if (!options.is_null() && !options.empty())
    throw ConfigError("fastmoe takes no options, got " + options.dump());
  return std::make_unique<FastMoE>(b, c, m);
}

void register_fastmoe() { register_impl("fastmoe", make_fastmoe); }

}  // namespace moelab
