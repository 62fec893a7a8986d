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

#include "baselines/fastmoe/fastmoe.hpp"

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
  bool published = false;  // "as_published": laekov/fastmoe v1.0.0's issue order (README.md)
};

// Validates the options against the world size W before any work (no allocation, no
// collective): a bad value is a ConfigError naming the option and the value.
GroupPlan parse_options(const nlohmann::json& options, int world) {
  GroupPlan p;
  std::string shown = "4 (the default)";
  const json_fields::Options o(options, "fastermoe", {"group_size", "as_published"});
  p.published = o.boolean("as_published", false);
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
  FasterMoELayer(Backend& b, Communicator& c, const ModelConfig& m, int group_size, bool published,
                 MoEChannels* channels)
      : MoELayer(b, c, m, channels), G_(group_size), n_g_(c.size() / group_size), published_(published) {}

 private:
  ChunkPlan plan_chunks(MoESaved& sv) override;
  // As published, each (step, expert) callback runs torch.autograd.backward over its expert,
  // weight gradients included (fmoe/fastermoe/schedule.py:80-84): nothing is deferred.
  bool defers_weight_gradients() const override { return !published_; }
  const int G_, n_g_;
  const bool published_;
};

// The part of a step's chunk that goes to or comes from local expert l: the chunk lists its
// segments per peer in local-expert order, so l's are every El-th; its T_DI holds l's rows only.
Chunk expert_part(const Chunk& ch, std::int64_t El, std::int64_t M, std::int64_t l) {
  const auto L = static_cast<std::size_t>(l), n = static_cast<std::size_t>(El);
  Chunk part;
  part.rows.assign(n, 0);
  part.offset.assign(n, 0);
  part.rows[L] = part.R = ch.rows[L];
  for (std::size_t k = L; k < ch.sends.size(); k += n) part.sends.push_back(ch.sends[k]);
  for (std::size_t k = L; k < ch.recvs.size(); k += n) {
    Segment sg = ch.recvs[k];
    sg.offset -= ch.offset[L] * M;  // rows of expert l start T_DI_c at 0
    part.recvs.push_back(sg);
  }
  return part;
}

// Step i: my group g sends to group (g + i) mod n_g and receives from group (g - i) mod n_g.
ChunkPlan FasterMoELayer::plan_chunks(MoESaved& sv) {
  if (published_) {
    clear_host_waits();  // the log holds one forward and its backward
    // prepare_forward, as FastMoE's (fmoe/fastermoe/schedule.py:117-123).
    fastmoe_published_prepare_forward(*this, *dispatch_, *dispatch_comm_);
  }
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
    const Chunk step = peer_chunk(sv.sent, recv, local_experts_, cfg_.d_model, to, from);
    if (!published_) {
      plan.chunks.push_back(step);
      continue;
    }
    // As published: one NCCL group per (step, local expert) (smart_schedule.h:140-155 S,
    // :212-228 R) and one Python callback per (step, local expert) running that expert
    // (:182-192): a chunk each, steps outer, experts inner.
    for (std::int64_t l = 0; l < local_experts_; ++l)
      plan.chunks.push_back(expert_part(step, local_experts_, cfg_.d_model, l));
  }
  // One communication stream carries every S and R, in the order S_0, S_1, R_0, S_2, R_1, ...
  plan.dispatch = plan.combine = {dispatch_, dispatch_comm_};
  plan.lookahead = 1;
  plan.output_first = true;  // as fmoe's fused forward allocates its output with its buffers
  plan.skip_empty = true;
  if (published_) {
    // smart_schedule.h issues every S (:139-157), then every C (:181-194), then every R
    // (:211-229): on its one NCCL stream (smgr->stream(0)) R_0 queues behind S_{n_g-1}.
    plan.phased = true;
    plan.lookahead = 0;
    // One event per step: C of a step waits for input_ready[step], recorded after all of the
    // step's groups (:156, :183); R for output_ready[step], after all of its callbacks (:193, :213).
    plan.group = static_cast<int>(local_experts_);
    // _expert_forward: y0 = expert_fn(x), then y.copy_(y0) into the global output buffer
    // (fmoe/fastermoe/schedule.py:38-41); backward grad_x.copy_(x.grad) (:83-84).
    plan.copy_expert_outputs = true;
  }
  return plan;
}

// ---- the MoEImpl adapter -----------------------------------------------------------------
class FasterMoE final : public LayerBackedImpl<FasterMoELayer> {
 public:
  FasterMoE(Backend& b, Communicator& c, const ModelConfig& m, const GroupPlan& plan, MoEChannels* channels)
      : LayerBackedImpl(b, c, m, plan.group_size, plan.published, channels), plan_(plan) {}
  std::string name() const override { return "fastermoe"; }
  // The six GEMMs per local expert, once per step with that step's rows.
  std::vector<GemmProblem> expert_gemms() override { return layer_.expert_gemm_problems(true); }
  nlohmann::json report() override {
    nlohmann::json r = {{"schedule", "FasterMoE smart schedule"}, {"group_size", plan_.group_size},
                        {"steps", plan_.steps}};
    if (plan_.published) {
      r["as_published"] = "laekov/fastmoe v1.0.0";
      r["host_waits"] = layer_.host_waits();
    }
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
