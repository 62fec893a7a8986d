// baselines/topk/topk.cpp — ScMoE's baselines as planners on the MoE layer (see topk.hpp).
//   ctest --test-dir build -R "topk|moe_layer_mpi"
#include "baselines/topk/topk.hpp"

#include <string>

#include "harness/config/json_fields.hpp"
#include "harness/nn/moe_impl.hpp"
#include "harness/runtime/error.hpp"

namespace moelab {
namespace {

struct Baseline {
  std::string name;
  int top_k = 1;
  bool pipelined = false;
  bool residual = false;  // needs the model's shared expert
};

constexpr int kDefaultChunks = 4;
constexpr int kMaxChunks = 64;

// The pipelined baselines' {"chunks": r}; nothing for the others. Before any work.
int parse_options(const Baseline& bl, const nlohmann::json& options) {
  if (!bl.pipelined) {
    if (!options.is_null() && !(options.is_object() && options.empty()))
      throw ConfigError(bl.name + " takes no options, got " + json_fields::show(options));
    return 1;
  }
  const json_fields::Options o(options, bl.name, {"chunks"});
  return static_cast<int>(o.positive_int("chunks", kDefaultChunks, kMaxChunks));
}

void check(const Baseline& bl, const nlohmann::json& options, const ImplCheckContext& run) {
  (void)parse_options(bl, options);
  if (run.model.num_experts < bl.top_k)
    throw ConfigError(bl.name + ": routes each token to " + std::to_string(bl.top_k) + " experts, but the model has " +
                      std::to_string(run.model.num_experts));
  if (bl.residual && run.shared_expert_hidden <= 0)
    throw ConfigError(bl.name + ": DeepSpeed's Residual-MoE adds a dense MLP beside the top-1 expert, and this run's "
                      "model has none: give it one with moe.shared_expert_hidden (e.g. --model-override "
                      "'{\"moe\": {\"shared_expert_hidden\": D_FFN}}')");
}

// The model's MoE layer routed with the baseline's k.
ModelConfig routed(const ModelConfig& m, const Baseline& bl) {
  ModelConfig c = m;
  c.top_k = bl.top_k;
  return c;
}

// The layer, its plan cut into `chunks` Tutel-style pieces (one chunk: the unpipelined plan).
class ChunkedLayer final : public MoELayer {
 public:
  ChunkedLayer(Backend& b, Communicator& c, const ModelConfig& m, int chunks, MoEChannels* channels)
      : MoELayer(b, c, m, channels), chunks_(chunks) {}

 private:
  ChunkPlan plan_chunks(MoESaved& sv) override {
    ChunkPlan plan = MoELayer::plan_chunks(sv);
    if (chunks_ == 1) return plan;
    plan.chunks = split_chunk(plan.chunks.front(), local_experts_, cfg_.d_model, chunks_);
    plan.one_in_flight = false;  // pipelined: every buffer made before the exchanges run ahead
    plan.lookahead = 1;          // chunk i+1's dispatch queued before chunk i's experts
    return plan;
  }
  const int chunks_;
};

class TopK final : public LayerBackedImpl<ChunkedLayer> {
 public:
  TopK(Backend& b, Communicator& c, const ModelConfig& m, const Baseline& bl, int chunks, MoEChannels* channels)
      : LayerBackedImpl(b, c, routed(m, bl), chunks, channels), bl_(bl), chunks_(chunks), model_k_(m.top_k) {}
  std::string name() const override { return bl_.name; }
  std::vector<GemmProblem> expert_gemms() override { return layer_.expert_gemm_problems(chunks_ > 1); }
  nlohmann::json report() override {
    nlohmann::json r = {{"schedule", bl_.pipelined ? "Tutel-style chunked all-to-all" : "unpipelined expert parallelism"},
                        {"top_k", bl_.top_k},
                        {"chunks", chunks_}};
    if (model_k_ != bl_.top_k) r["model_top_k"] = model_k_;
    if (bl_.residual) r["dense_mlp"] = "the model's shared expert (moe.shared_expert_hidden), added to the expert's output";
    return r;
  }

 private:
  Baseline bl_;
  int chunks_, model_k_;
};

void register_baseline(const Baseline& bl) {
  register_impl(
      bl.name,
      [bl](Backend& b, Communicator& c, const ModelConfig& m, const nlohmann::json& options, MoEChannels* channels) {
        const int chunks = parse_options(bl, options);  // before any work
        return std::unique_ptr<MoEImpl>(std::make_unique<TopK>(b, c, m, bl, chunks, channels));
      },
      [bl](const nlohmann::json& options, const ImplCheckContext& run) { check(bl, options, run); });
}

}  // namespace

void register_topk_baselines() {
  register_baseline({"top2", 2, false, false});
  register_baseline({"top1", 1, false, false});
  register_baseline({"residual-moe", 1, false, true});
  register_baseline({"top1-pipelined", 1, true, false});
  register_baseline({"top2-pipelined", 2, true, false});
}

}  // namespace moelab
