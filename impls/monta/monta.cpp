// impls/monta/monta.cpp — MoNTA's chunked, TP-deduplicated all-to-all as an implementation
// (see monta.hpp; the layer is baselines/deepspeed_tp_ep's CapacityTpLayer with n chunks).
//   ctest --test-dir build -R monta
#include "impls/monta/monta.hpp"

#include "baselines/deepspeed_tp_ep/deepspeed_tp_ep.hpp"
#include "harness/config/json_fields.hpp"
#include "harness/nn/moe_impl.hpp"
#include "harness/runtime/error.hpp"

namespace moelab {
namespace {

// The authors' code (a change to DeepSpeed's sharded_moe.py) fixes the chunk count at 4.
constexpr int kDefaultChunks = 4;
constexpr int kMaxChunks = 64;

int parse_chunks(const nlohmann::json& options) {
  const json_fields::Options o(options, "monta", {"chunks"});
  return static_cast<int>(o.positive_int("chunks", kDefaultChunks, kMaxChunks));
}

class Monta final : public LayerBackedImpl<CapacityTpLayer> {
 public:
  Monta(Backend& b, Communicator& c, const ModelConfig& m, MoEChannels* channels, int chunks)
      : LayerBackedImpl(b, c, m, channels, TpDispatch{true, chunks}) {}
  std::string name() const override { return "monta"; }
  std::vector<GemmProblem> expert_gemms() override { return layer_.expert_gemm_problems(layer_.dispatch_mode().chunks > 1); }
  bool tp_deduplicated() const override { return true; }
  nlohmann::json report() override {
    const CapacityGeometry& g = layer_.geometry();
    return {{"schedule", "MoNTA: TP-deduplicated all-to-all, chunked along the capacity, each chunk's all-gather "
                         "over TP beside the next chunk's all-to-all"},
            {"tp", layer_.tp_size()},
            {"capacity", g.C},
            {"padded_capacity", g.Cp},
            {"chunks", layer_.dispatch_mode().chunks}};
  }
};

}  // namespace

void register_monta() {
  register_impl(
      "monta",
      [](Backend& b, Communicator& c, const ModelConfig& m, const nlohmann::json& options, MoEChannels* channels) {
        const int chunks = parse_chunks(options);
        return std::unique_ptr<MoEImpl>(std::make_unique<Monta>(b, c, m, channels, chunks));
      },
      [](const nlohmann::json& options, const ImplCheckContext& run) {
        (void)parse_chunks(options);
        check_capacity_model("monta", run.model);
      });
}

}  // namespace moelab
