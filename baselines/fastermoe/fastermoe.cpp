// baselines/fastermoe/fastermoe.cpp — FasterMoE's smart schedule as a chunk plan for the
// harness's MoE layer (see fastermoe.hpp for the schedule, README.md for paper section -> code
// and a timeline).
//   ctest --test-dir build -R "fastermoe|moe_layer_mpi"
//
// Notation as in harness/nn/moe_layer.hpp: W ranks, G group size, n_g = W / G steps. Only the
// exchange and the expert compute are stepped; T_I and T_O stay global (one permute, one
// unpermute), so the gate and the row order of T_I are the base layer's and every step reads
// or fills a disjoint set of T_I / T_O rows.
#include "baselines/fastermoe/fastermoe.hpp"

#include <algorithm>
#include <limits>
#include <string>

#include "harness/config/json_fields.hpp"
#include "harness/runtime/error.hpp"

namespace moelab {
namespace {

// ---- options: {"group_size": G} ---------------------------------------------------------
struct GroupPlan {
  int requested = 4;  // G as asked (FasterMoE's default FMOE_FASTER_GROUP_SIZE = 4)
  int group_size = 4; // G in use: min(requested, W)
  int steps = 1;      // n_g = W / G
};

// Validates the options against the world size W before any work (no allocation, no
// collective): a bad value is a ConfigError naming the option and the value.
GroupPlan parse_options(const nlohmann::json& options, int world) {
  GroupPlan p;
  std::string shown = "4 (the default)";
  const json_fields::Options o(options, "fastermoe", {"group_size"});
  if (o.has("group_size")) {
    p.requested = static_cast<int>(o.positive_int("group_size", p.requested, std::numeric_limits<int>::max()));
    shown = std::to_string(p.requested);
  }
  p.group_size = std::min(p.requested, world);  // a world smaller than G is one group
  if (world % p.group_size != 0)
    throw ConfigError("fastermoe: group_size = " + shown + " does not divide the expert-parallel world size " +
                      std::to_string(world));
  p.steps = world / p.group_size;
  return p;
}

// ---- the planner -------------------------------------------------------------------------
// The base layer's steps, issued by the chunk issuer (harness/nn/moe_schedule.hpp): only the
// chunks, the stream assignment and the order are FasterMoE's.
class FasterMoELayer final : public MoELayer {
 public:
  FasterMoELayer(Backend& b, Communicator& c, const ModelConfig& m, int group_size, MoEChannels* channels)
      : MoELayer(b, c, m, channels), G_(group_size), n_g_(c.size() / group_size) {}

 private:
  ChunkPlan plan_chunks(MoESaved& sv) override;
  const int G_, n_g_;
};

// Step i: my group g sends to group (g + i) mod n_g and receives from group (g - i) mod n_g.
ChunkPlan FasterMoELayer::plan_chunks(MoESaved& sv) {
  const auto recv = comm_.exchange_counts(sv.sent);  // [W*El] rows each peer sends my local experts
  const int g = comm_.rank() / G_;
  ChunkPlan plan;
  for (int i = 0; i < n_g_; ++i) {
    const int target = (g + i) % n_g_, source = (g - i + n_g_) % n_g_;
    std::vector<int> to, from;
    for (int k = 0; k < G_; ++k) {
      to.push_back(target * G_ + k);
      from.push_back(source * G_ + k);
    }
    plan.chunks.push_back(peer_chunk(sv.sent, recv, local_experts_, cfg_.d_model, to, from));
  }
  // One communication stream carries every S and R, in the order S_0, S_1, R_0, S_2, R_1, ...
  plan.dispatch = plan.combine = {dispatch_, dispatch_comm_};
  plan.lookahead = 1;
  plan.output_first = true;  // as fmoe's fused forward allocates its output with its buffers
  plan.skip_empty = true;
  return plan;
}

// ---- the MoEImpl adapter -----------------------------------------------------------------
class FasterMoE final : public LayerBackedImpl<FasterMoELayer> {
 public:
  FasterMoE(Backend& b, Communicator& c, const ModelConfig& m, const GroupPlan& plan, MoEChannels* channels)
      : LayerBackedImpl(b, c, m, plan.group_size, channels), plan_(plan) {}
  std::string name() const override { return "fastermoe"; }
  // The six GEMMs per local expert, once per step with that step's rows.
  std::vector<GemmProblem> expert_gemms() override { return layer_.expert_gemm_problems(true); }
  nlohmann::json report() override {
    nlohmann::json r = {{"schedule", "FasterMoE smart schedule"}, {"group_size", plan_.group_size},
                        {"steps", plan_.steps}};
    if (plan_.group_size != plan_.requested) {
      r["group_size_requested"] = plan_.requested;
      r["note"] = "world size " + std::to_string(plan_.group_size) + " is smaller than group_size " +
                  std::to_string(plan_.requested) + ": one group of all ranks";
    }
    return r;
  }

 private:
  GroupPlan plan_;
};

std::unique_ptr<MoEImpl> make(Backend& b, Communicator& c, const ModelConfig& m, const nlohmann::json& options,
                              MoEChannels* channels) {
  const GroupPlan plan = parse_options(options, c.size());  // before any work
  return std::make_unique<FasterMoE>(b, c, m, plan, channels);
}

}  // namespace

std::unique_ptr<MoEImpl> make_fastermoe(Backend& b, Communicator& c, const ModelConfig& m,
                                        const nlohmann::json& options) {
  return make(b, c, m, options, nullptr);
}

void register_fastermoe() { register_impl("fastermoe", make); }

}  // namespace moelab
