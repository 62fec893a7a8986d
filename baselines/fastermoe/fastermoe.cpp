// baselines/fastermoe/fastermoe.cpp — FasterMoE's smart schedule on the harness's MoELayer
// (see fastermoe.hpp for the schedule, README.md for paper section -> code and a timeline).
//   ctest --test-dir build -R "fastermoe|moe_layer_mpi"
//
// Notation as in harness/nn/moe_layer.hpp: T tokens, M d_model, H d_hidden, El local experts,
// N dispatched rows (T_I), W ranks, G group size, n_g = W / G steps, R_i rows received in
// step i (T_DI_i). Only the exchange and the expert compute are stepped; T_I and T_O stay
// global (one permute, one unpermute), so the gate and the row order of T_I are the base
// layer's and every step reads or fills a disjoint set of T_I / T_O rows.
#include "baselines/fastermoe/fastermoe.hpp"

#include <algorithm>
#include <limits>
#include <numeric>
#include <string>

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
  if (!options.is_null() && !options.is_object())
    throw ConfigError("fastermoe options must be a JSON object such as {\"group_size\": 4}, got " + options.dump());
  if (options.is_object()) {
    for (const auto& [key, value] : options.items())
      if (key != "group_size")
        throw ConfigError("fastermoe: unknown option \"" + key + "\" = " + value.dump() +
                          " (the only option is group_size)");
    if (options.contains("group_size")) {
      const auto& g = options.at("group_size");
      if (!g.is_number_integer() || g.get<std::int64_t>() <= 0)
        throw ConfigError("fastermoe option group_size = " + g.dump() + " must be a positive integer");
      p.requested = static_cast<int>(std::min<std::int64_t>(g.get<std::int64_t>(), std::numeric_limits<int>::max()));
      shown = g.dump();
    }
  }
  p.group_size = std::min(p.requested, world);  // a world smaller than G is one group
  if (world % p.group_size != 0)
    throw ConfigError("fastermoe option group_size = " + shown + " does not divide the expert-parallel world size " +
                      std::to_string(world));
  p.steps = world / p.group_size;
  return p;
}

// ---- the layer ---------------------------------------------------------------------------
class FasterMoELayer final : public MoELayer {
 public:
  FasterMoELayer(Backend& b, Communicator& c, const ModelConfig& m, int group_size)
      : MoELayer(b, c, m), G_(group_size), n_g_(c.size() / group_size) {
    for (int i = 0; i < n_g_; ++i) {
      ev_arrived_.push_back(b_.create_event());
      ev_computed_.push_back(b_.create_event());
    }
    ev_ready_ = b_.create_event();
    ev_returned_ = b_.create_event();
  }

  Forwarded forward(const Tensor& x, const WorkKey& key) override;
  // The six expert GEMMs per local expert and step, with the last forward's per-step rows.
  std::vector<GemmProblem> step_gemm_problems();

 private:
  // Group-wise exchange (§4): the peers and rows of one step.
  struct Step : Chunk {
    Tensor t_di;                       // [R_i,M] saved for backward
    Tensor t_m;                        // [R_i,H] saved for backward (FC1 output before the activation)
  };
  Tensor backward_pass(MoESaved& sv, const Tensor& dy, float grad_aux, bool defer) override;
  bool defers_weight_gradients() const override { return false; }
  void plan_steps(const std::vector<std::int64_t>& sent, const std::vector<std::int64_t>& recv);

  const int G_, n_g_;
  std::vector<Step> steps_;
  std::vector<std::unique_ptr<Event>> ev_arrived_;   // [n_g] the step's rows are in (S_i, or R'_i in backward)
  std::vector<std::unique_ptr<Event>> ev_computed_;  // [n_g] C_i done
  std::unique_ptr<Event> ev_ready_;     // compute -> communication: the exchange buffers exist and T_I is permuted
  std::unique_ptr<Event> ev_returned_;  // communication -> compute: the last exchange is done
};

// Step i: my group g sends to group (g + i) mod n_g and receives from group (g - i) mod n_g.
void FasterMoELayer::plan_steps(const std::vector<std::int64_t>& sent, const std::vector<std::int64_t>& recv) {
  const int g = comm_.rank() / G_;
  steps_.assign(static_cast<std::size_t>(n_g_), Step{});
  for (int i = 0; i < n_g_; ++i) {
    const int target = (g + i) % n_g_, source = (g - i + n_g_) % n_g_;
    std::vector<int> to, from;
    for (int k = 0; k < G_; ++k) {
      to.push_back(target * G_ + k);
      from.push_back(source * G_ + k);
    }
    static_cast<Chunk&>(steps_[static_cast<std::size_t>(i)]) = peer_chunk(sent, recv, local_experts_, cfg_.d_model, to, from);
  }
}

Forwarded FasterMoELayer::forward(const Tensor& x, const WorkKey& key) {
  const std::int64_t T = x.dim(0), M = cfg_.d_model, H = cfg_.d_hidden, El = local_experts_;
  check_input(x);
  MicrobatchScope mb(b_, key.microbatch);
  Stream& c = *compute_;
  Stream& cs = *dispatch_;            // FasterMoE's communication stream: every S and R, in order
  Communicator& cc = *dispatch_comm_;
  auto saved = std::make_unique<MoESaved>(key);
  MoESaved& sv = *saved;
  sv.x = x;

  route(c, sv);

  // ---- dispatch preparation: permute to T_I [N,M], exchange counts, plan the n_g steps ----
  Tensor t_i;
  {
    PhaseScope ph(b_, "dispatch");
    const auto& sent = routing_.sent_per_expert;
    const std::int64_t N = std::accumulate(sent.begin(), sent.end(), std::int64_t{0});
    t_i = b_.empty({N, M}, cfg_.dtype, MemCategory::buffers, c);
    b_.permute(c, x, sv.slot, t_i);
    const auto recv = comm_.exchange_counts(sent);
    plan_steps(sent, recv);
    routing_.recv_per_local.assign(static_cast<std::size_t>(El), 0);
    for (const Step& st : steps_)
      for (std::int64_t l = 0; l < El; ++l)
        routing_.recv_per_local[static_cast<std::size_t>(l)] += st.rows[static_cast<std::size_t>(l)];
  }

  // Every buffer the communication stream touches is allocated on the compute stream before
  // ev_ready_ (stream-ordered memory): T_DI_i [R_i,M], T_O [N,M]. T_M_i [R_i,H] and
  // T_DO_i [R_i,M] are the experts' (compute stream).
  std::vector<Tensor> t_do(static_cast<std::size_t>(n_g_));
  for (int i = 0; i < n_g_; ++i) {
    Step& st = steps_[static_cast<std::size_t>(i)];
    st.t_di = b_.empty({st.R, M}, cfg_.dtype, MemCategory::activations, c);
    st.t_m = b_.empty({st.R, H}, cfg_.dtype, MemCategory::activations, c);
    t_do[static_cast<std::size_t>(i)] = b_.empty({st.R, M}, cfg_.dtype, MemCategory::buffers, c);
  }
  sv.t_o = b_.empty({t_i.dim(0), M}, cfg_.dtype, MemCategory::activations, c);
  Tensor y = b_.empty({T, M}, cfg_.dtype, MemCategory::activations, c);
  b_.record(*ev_ready_, c);
  b_.wait(cs, *ev_ready_);

  // S_i: T_I rows for the target group -> T_DI_i from the source group.
  auto dispatch_step = [&](int i) {
    Step& st = steps_[static_cast<std::size_t>(i)];
    dispatch(cs, cc, t_i, st, st.t_di);
    b_.record(*ev_arrived_[static_cast<std::size_t>(i)], cs);
  };
  // C_i: the experts on the step's rows.
  auto expert_step = [&](int i) {
    Step& st = steps_[static_cast<std::size_t>(i)];
    b_.wait(c, *ev_arrived_[static_cast<std::size_t>(i)]);
    if (st.R > 0) experts(c, st, st.t_di, st.t_m, t_do[static_cast<std::size_t>(i)]);
    b_.record(*ev_computed_[static_cast<std::size_t>(i)], c);
  };
  // R_i: T_DO_i back to the source group's T_O rows (the segments of S_i reversed).
  auto combine_step = [&](int i) {
    Step& st = steps_[static_cast<std::size_t>(i)];
    b_.wait(cs, *ev_computed_[static_cast<std::size_t>(i)]);
    combine(cs, cc, st, t_do[static_cast<std::size_t>(i)], sv.t_o);
  };
  // Communication stream: S_0, S_1, R_0, S_2, R_1, ..., R_{n_g-1}; compute stream: C_0, C_1, ...
  dispatch_step(0);
  for (int i = 0; i < n_g_; ++i) {
    if (i + 1 < n_g_) dispatch_step(i + 1);
    expert_step(i);
    combine_step(i);
  }

  // ---- combine: unpermute T_O [N,M] with the gate weights -> y [T,M] ------------------------
  b_.record(*ev_returned_, cs);
  b_.wait(c, *ev_returned_);
  combine_postprocess(c, sv, y);
  return {y, std::move(saved)};  // t_i and T_DO_i are freed here, after the compute stream waited for the last R
}

// Weight gradients in the combined pass (defer is not taken up).
Tensor FasterMoELayer::backward_pass(MoESaved& sv, const Tensor& dy, float grad_aux, bool) {
  const std::int64_t T = sv.x.dim(0), M = cfg_.d_model, N = sv.t_o.dim(0);
  const int k = cfg_.top_k;
  Stream& c = *compute_;
  Stream& cs = *dispatch_;
  Communicator& cc = *dispatch_comm_;

  // ---- combine backward, local part: dT_O [N,M] and dw [T,k] from dy ------------------------
  Tensor d_w = b_.empty({T, k}, DType::f32, MemCategory::buffers, c);
  Tensor d_t_o = b_.empty({N, M}, cfg_.dtype, MemCategory::buffers, c);
  combine_postprocess_backward(c, sv, dy, d_t_o, d_w);
  std::vector<Tensor> d_t_do(static_cast<std::size_t>(n_g_)), d_t_di(static_cast<std::size_t>(n_g_));
  for (int i = 0; i < n_g_; ++i) {
    const std::int64_t R = steps_[static_cast<std::size_t>(i)].R;
    d_t_do[static_cast<std::size_t>(i)] = b_.empty({R, M}, cfg_.dtype, MemCategory::buffers, c);  // [R_i,M]
    d_t_di[static_cast<std::size_t>(i)] = b_.empty({R, M}, cfg_.dtype, MemCategory::buffers, c);  // [R_i,M]
  }
  Tensor d_t_i = b_.empty({N, M}, cfg_.dtype, MemCategory::buffers, c);
  Tensor dx = b_.empty({T, M}, cfg_.dtype, MemCategory::activations, c);
  b_.record(*ev_ready_, c);
  b_.wait(cs, *ev_ready_);

  // R'_i: dT_O rows of the step's target group -> dT_DO_i from its source group.
  auto combine_back_step = [&](int i) {
    Step& st = steps_[static_cast<std::size_t>(i)];
    combine_backward(cs, cc, st, d_t_o, d_t_do[static_cast<std::size_t>(i)]);
    b_.record(*ev_arrived_[static_cast<std::size_t>(i)], cs);
  };
  // C'_i: experts backward on the step's rows; dW1, dW2 accumulate (beta = 1) over steps.
  auto expert_back_step = [&](int i) {
    Step& st = steps_[static_cast<std::size_t>(i)];
    b_.wait(c, *ev_arrived_[static_cast<std::size_t>(i)]);
    if (st.R > 0) experts_backward(c, st, st.t_di, st.t_m, d_t_do[static_cast<std::size_t>(i)], d_t_di[static_cast<std::size_t>(i)]);
    b_.record(*ev_computed_[static_cast<std::size_t>(i)], c);
  };
  // S'_i: dT_DI_i back to the source group's dT_I rows.
  auto dispatch_back_step = [&](int i) {
    Step& st = steps_[static_cast<std::size_t>(i)];
    b_.wait(cs, *ev_computed_[static_cast<std::size_t>(i)]);
    dispatch_backward(cs, cc, st, d_t_di[static_cast<std::size_t>(i)], d_t_i);
  };
  // Communication stream: R'_0, R'_1, S'_0, R'_2, S'_1, ..., S'_{n_g-1}; compute: C'_0, C'_1, ...
  combine_back_step(0);
  for (int i = 0; i < n_g_; ++i) {
    if (i + 1 < n_g_) combine_back_step(i + 1);
    expert_back_step(i);
    dispatch_back_step(i);
  }

  // ---- dispatch backward, local part: dT_I [N,M] -> dx [T,M]; then the gate ----------------
  b_.record(*ev_returned_, cs);
  b_.wait(c, *ev_returned_);
  dispatch_preprocess_backward(c, sv, d_t_i, dx);
  route_backward(c, sv, d_w, grad_aux, dx);
  // Frees the steps' saved activations (T_DI_i, T_M_i), ordered after everything above on the
  // compute stream. The plan (segments, rows) stays for step_gemm_problems().
  for (Step& st : steps_) st.t_di = st.t_m = Tensor();
  return dx;
}

std::vector<GemmProblem> FasterMoELayer::step_gemm_problems() {
  // The base layer builds the six GEMMs per local expert from routing_.recv_per_local: let it
  // do so once per step with that step's rows (one formula for the problems, not two).
  const std::vector<std::int64_t> total = routing_.recv_per_local;
  std::vector<GemmProblem> ps;
  for (const Step& st : steps_) {
    routing_.recv_per_local = st.rows;
    auto p = expert_gemm_problems();
    ps.insert(ps.end(), p.begin(), p.end());
  }
  routing_.recv_per_local = total;
  return ps;
}

// ---- the MoEImpl adapter -----------------------------------------------------------------
class FasterMoE final : public LayerBackedImpl<FasterMoELayer> {
 public:
  FasterMoE(Backend& b, Communicator& c, const ModelConfig& m, const GroupPlan& plan)
      : LayerBackedImpl(b, c, m, plan.group_size), plan_(plan) {}
  std::string name() const override { return "fastermoe"; }
  std::vector<GemmProblem> expert_gemms() override { return layer_.step_gemm_problems(); }
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

}  // namespace

std::unique_ptr<MoEImpl> make_fastermoe(Backend& b, Communicator& c, const ModelConfig& m,
                                        const nlohmann::json& options) {
  const GroupPlan plan = parse_options(options, c.size());  // before any work
  return std::make_unique<FasterMoE>(b, c, m, plan);
}

void register_fastermoe() { register_impl("fastermoe", make_fastermoe); }

}  // namespace moelab
