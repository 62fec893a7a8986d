// impls/scmoe/scmoe.cpp — ScMoE's block pair and its overlap schedule (see scmoe.hpp for the
// equations, README.md for paper section -> code and the timelines).
//   ctest --test-dir build -R scmoe
//
// Notation: T tokens of the microbatch on this rank, M d_model, G the combine gate's logits per
// token (CG-1: 1, CG-2: 2), W ranks of the expert-parallel group. The window is the list of
// main-stream blocks the all-to-alls can hide behind (ShortcutConfig::window_blocks).
#include "impls/scmoe/scmoe.hpp"

#include <cmath>
#include <functional>
#include <map>
#include <span>
#include <string>

#include "harness/runtime/error.hpp"
#include "harness/runtime/random.hpp"
#include "impls/scmoe/schedule.hpp"

namespace moelab {
namespace {

using nlohmann::json;
using scmoe::ChunkChoice;
using scmoe::PassTimes;
using scmoe::SlotChoice;
using scmoe::choose_chunks;
using scmoe::choose_slot;
using scmoe::estimate_pass;

// The main-stream blocks of a pair, in forward order.
enum class Unit { dense_attention, dense_mlp, moe_attention, shared_expert };
const char* unit_name(Unit u) {
  switch (u) {
    case Unit::dense_attention: return "attention_l";
    case Unit::dense_mlp: return "mlp_l";
    case Unit::moe_attention: return "attention_l+1";
    case Unit::shared_expert: return "shared_expert";
  }
  return "?";
}

// Each extra chunk of an all-to-all costs its latency; the rates of Backend::machine_rates
// leave latency out (a bandwidth model). NCCL's all-to-all of small messages takes some ten
// microseconds on one node (nccl-tests' alltoall_perf at 8 GPUs): assumed, not measured.
constexpr double kChunkOverhead = 10e-6;
// Where a backend knows no all-to-all rate (cpu, cuda): assumed, and the report says so.
constexpr double kAssumedA2aBytesPerS = 10e9;

// The routed MoE's implementation as the model sees it: everything is the implementation's,
// except that its report says how the pair scheduled it.
class ScheduledMoE final : public MoEImpl {
 public:
  ScheduledMoE(MoEImpl& inner, std::function<json()> schedule) : inner_(inner), schedule_(std::move(schedule)) {}
  std::string name() const override { return inner_.name(); }
  void init_parameters(std::uint64_t seed) override { inner_.init_parameters(seed); }
  void zero_grad() override { inner_.zero_grad(); }
  MoEParams& params() override { return inner_.params(); }
  MoEParams& grads() override { return inner_.grads(); }
  const RoutingStats& routing() const override { return inner_.routing(); }
  std::vector<GemmProblem> expert_gemms() override { return inner_.expert_gemms(); }
  MoELayer& layer() override { return inner_.layer(); }
  json report() override {
    json r = inner_.report();
    r["scmoe"] = schedule_();
    return r;
  }

 private:
  MoEImpl& inner_;
  std::function<json()> schedule_;
};

// What the pair's schedule decided for one token count.
struct Placement {
  std::vector<Unit> window;
  int slot_forward = 0, slot_backward = 0, chunks = 1;
  std::string chosen;  // "cost model" or "model file"
  PassTimes forward, backward;
  SlotChoice forward_choice, backward_choice;
  ChunkChoice chunk_choice;
  std::string rates;
  // Offloaded experts (inference, MoELayer::offload_experts): the seconds to copy the local
  // experts in, which the experts' slot must also cover (their weights arrive beside the
  // dispatch); 0 when the experts are resident.
  double migrate = 0.0;
  std::string offload = "none";
  json to_json() const;
};

json Placement::to_json() const {
  const auto us = [](const std::vector<double>& v) {
    json a = json::array();
    for (double x : v) a.push_back(x * 1e6);
    return a;
  };
  json names = json::array();
  for (Unit u : window) names.push_back(unit_name(u));
  json j;
  j["window"] = names;
  j["expert_slot"] = {{"forward", slot_forward}, {"backward", slot_backward}, {"chosen", chosen}};
  j["offload_experts"] = offload;
  if (offload != "none") j["migrate_us"] = migrate * 1e6;
  j["chunks"] = chunks;
  j["estimate_us"] = {{"forward", {{"window", us(forward.compute)},
                                   {"experts", forward.experts * 1e6},
                                   {"dispatch", forward.first * 1e6},
                                   {"combine", forward.second * 1e6},
                                   {"slot_cost", us(forward_choice.cost)},
                                   {"pass", estimate_pass(forward, slot_forward, chunks) * 1e6}}},
                      {"backward", {{"window", us(backward.compute)},
                                    {"experts", backward.experts * 1e6},
                                    {"combine", backward.first * 1e6},
                                    {"dispatch", backward.second * 1e6},
                                    {"slot_cost", us(backward_choice.cost)},
                                    {"pass", estimate_pass(backward, slot_backward, chunks) * 1e6}}},
                      {"chunks_forward_plus_backward", us(chunk_choice.estimate)}};
  j["rates"] = rates;
  return j;
}

struct PairSaved final : Saved {
  using Saved::Saved;
  SavedPtr dense_attention, dense_mlp, moe_attention;  // sub-blocks (the dense pair half when span 2)
  Norm::State moe_norm, se_norm;
  FeedForward::State se;
  SavedPtr moe;       // the routed MoE (a MoESaved when its steps are driven here)
  Tensor n_se;        // [T,M] the shared expert's normed input (the combine gate's input)
  Tensor s, r;        // [T,M] shared expert and routed outputs (the combine's backward)
  Tensor z;           // [T,G] fp32 combine gate logits
  Tensor dz;          // [T,G] B -> W: their gradient in the model's dtype
  float aux_grad = 0.0f;
};

class ScMoEPair final : public LayerGroup {
 public:
  explicit ScMoEPair(LayerGroupArgs a);
  ~ScMoEPair() override = default;
  const char* kind() const override { return "moe"; }
  int first_layer() const override { return first_; }
  int num_layers() const override { return sc_.span(); }
  MoEImpl* moe() override { return &scheduled_; }
  Forwarded forward(const Tensor& x, const WorkKey& key) override;
  Tensor backward_input(Saved& saved, const Tensor& dy) override;
  void backward_weight(Saved& saved) override;
  void init_parameters(std::uint64_t seed) override;
  void collect(std::vector<Param*>& out) override;
  void collect_own(std::vector<Param*>& out) override;
  float aux_loss(const Saved& saved) override;
  void set_aux_grad_scale(float s) override { aux_scale_ = s; }

 private:
  std::uint64_t tag(int what) const { return static_cast<std::uint64_t>(moe_layer_ + 1) * 64 + static_cast<std::uint64_t>(what); }
  std::string name(const char* what) const { return "layer" + std::to_string(moe_layer_) + "." + what; }
  bool drives_steps() { return impl_->layer().steps_drivable(); }
  const Placement& placement(std::int64_t T);
  double gemm_seconds(std::int64_t m, std::int64_t n, std::int64_t k);
  double a2a_seconds(std::int64_t T);
  json schedule_report();

  // The blocks' forward and backward passes, on the running hidden state h and its gradient g.
  void forward_unit(Unit u, PairSaved& sv, Tensor& h, const WorkKey& dense_key, const WorkKey& moe_key);
  void backward_unit(Unit u, PairSaved& sv, Tensor& g, const Tensor& d_s, const Tensor& d_n_se_gate);

  Backend& b_;
  Stream& s_;
  TransformerConfig cfg_;
  ShortcutConfig sc_;
  int first_, moe_layer_;
  std::unique_ptr<AttentionBlock> dense_attention_, moe_attention_;
  std::unique_ptr<FfnBlock> dense_mlp_;
  Norm moe_norm_, se_norm_;
  FeedForward se_;
  Param w_cg_;  // [M,G]
  std::unique_ptr<MoEImpl> impl_;
  ScheduledMoE scheduled_;
  std::vector<Param> moe_params_;  // the routed MoE's tensors, named: filled by collect() only
  float aux_coef_ = 0.0f, aux_scale_ = 1.0f;
  std::map<std::int64_t, Placement> placements_;  // by T
  std::int64_t last_T_ = 0;
  int issued_chunks_ = 0;  // exchanges per all-to-all in the last forward (an implementation may step its own)
  double measured_flops_ = 0;  // GEMM rate measured where the backend has no model (cpu, cuda)
};

ScMoEPair::ScMoEPair(LayerGroupArgs a)
    : b_(a.backend), s_(a.stream), cfg_(a.cfg), sc_(a.cfg.scmoe), first_(a.first_layer),
      moe_layer_(a.first_layer + a.cfg.scmoe.span() - 1),
      moe_norm_(a.backend, a.stream, a.cfg, "layer" + std::to_string(moe_layer_) + ".moe_norm"),
      se_norm_(a.backend, a.stream, a.cfg, "layer" + std::to_string(moe_layer_) + ".se_norm"),
      se_(a.backend, a.stream, a.cfg, a.cfg.shared_expert_hidden, "layer" + std::to_string(moe_layer_) + ".shared_expert"),
      impl_(std::move(a.moe)), scheduled_(*impl_, [this] { return schedule_report(); }), aux_coef_(a.aux_loss_coef) {
  MOELAB_CHECK(sc_.enabled && impl_ != nullptr && cfg_.shared_expert_hidden > 0 && cfg_.moe.top_k == 1,
               "ScMoE pair: needs cfg.scmoe, a routed MoE, a shared expert and top-1 routing");
  MOELAB_CHECK(cfg_.is_moe(moe_layer_), "ScMoE pair: layer " + std::to_string(moe_layer_) + " is not an MoE layer");
  if (impl_->layer().config().top_k != 1)
    throw ConfigError(cfg_.origin + ": --impl " + impl_->name() + " routes each token to " +
                      std::to_string(impl_->layer().config().top_k) + " experts, but ScMoE's routed MoE is top-1");
  if (sc_.span() == 2) {
    dense_attention_ = std::make_unique<AttentionBlock>(b_, s_, cfg_, first_);
    dense_mlp_ = std::make_unique<FfnBlock>(b_, s_, cfg_, first_);
  }
  moe_attention_ = std::make_unique<AttentionBlock>(b_, s_, cfg_, moe_layer_);
  if (sc_.gate_width() > 0) w_cg_ = make_param(b_, s_, name("scmoe.w_cg"), {cfg_.d_model, sc_.gate_width()}, cfg_.dtype);
}

// GPT-2 / Megatron's N(0, 0.02^2) for W_cg too (coef starts near 1/2); the other parameters as
// the plain model's blocks initialise them, the routed MoE exactly as FfnBlock's.
void ScMoEPair::init_parameters(std::uint64_t seed) {
  if (dense_attention_) dense_attention_->init_parameters(seed);
  if (dense_mlp_) dense_mlp_->init_parameters(seed);
  moe_attention_->init_parameters(seed);
  moe_norm_.init_parameters();
  se_norm_.init_parameters();
  se_.init_parameters(seed, tag(8), cfg_.num_layers);
  if (w_cg_.value.defined()) init_normal(b_, w_cg_, seed, tag(24), 0.02);
  impl_->init_parameters(Rng::mix(seed, tag(16)));
}

void ScMoEPair::collect_own(std::vector<Param*>& out) {
  if (dense_attention_) dense_attention_->collect(out);
  if (dense_mlp_) dense_mlp_->collect(out);
  moe_attention_->collect(out);
  se_norm_.collect(out);
  se_.collect(out);
  moe_norm_.collect(out);
  if (w_cg_.value.defined()) out.push_back(&w_cg_);
}

// The routed MoE's tensors as named copies of its handles, made afresh at each call (the pair's
// tests read them; a Model uses collect_own and the layer's own members).
void ScMoEPair::collect(std::vector<Param*>& out) {
  collect_own(out);
  MoEParams& v = impl_->params();
  MoEParams& g = impl_->grads();
  moe_params_.clear();
  const auto add = [&](const char* what, Tensor& value, Tensor& grad, bool gate) {
    Param p;  // the gate replicated over the data-parallel ranks, the experts sharded
    p.name = name(what);
    p.value = value;
    p.grad = grad;
    p.replicated = gate;
    moe_params_.push_back(std::move(p));
  };
  add("moe.w_gate", v.w_gate, g.w_gate, true);
  if (v.w_noise.defined()) add("moe.w_noise", v.w_noise, g.w_noise, true);
  add("moe.w1", v.w1, g.w1, false);
  add("moe.w2", v.w2, g.w2, false);
  for (Param& p : moe_params_) out.push_back(&p);
}

float ScMoEPair::aux_loss(const Saved& saved) {
  const auto* sv = dynamic_cast<const PairSaved*>(&saved);
  MOELAB_CHECK(sv != nullptr && sv->moe != nullptr, "ScMoE pair: aux_loss needs the saved state of a forward");
  return impl_->aux_loss(*sv->moe);
}

// ---- times from the cost model ---------------------------------------------------------------
// A GEMM's seconds at the backend's rate for its shape (the sim's cluster model, or its
// calibration profile when given); where the backend has no model, at the rate of this pair's
// shared-expert GEMM measured once with the GEMM library.
double ScMoEPair::gemm_seconds(std::int64_t m, std::int64_t n, std::int64_t k) {
  if (m <= 0 || n <= 0 || k <= 0) return 0.0;
  const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  const MachineRates r = b_.machine_rates(m, n, k, cfg_.dtype);
  if (r.gemm_flops > 0) return flops / r.gemm_flops;
  if (measured_flops_ <= 0) {
    const std::int64_t rows = std::max<std::int64_t>(last_T_, 1), M = cfg_.d_model, H = cfg_.shared_expert_hidden;
    Tensor a = b_.empty({rows, M}, cfg_.dtype, MemCategory::buffers, s_);
    Tensor w = b_.empty({M, H}, cfg_.dtype, MemCategory::buffers, s_);
    Tensor c = b_.empty({rows, H}, cfg_.dtype, MemCategory::buffers, s_);
    b_.fill_zero(s_, a);
    b_.fill_zero(s_, w);
    const GemmProblem p = block_gemm(false, false, rows, H, M, a, w, c, 0);
    const double secs = b_.time_bare_gemms(std::span<const GemmProblem>(&p, 1), 3);
    measured_flops_ = secs > 0 ? 2.0 * static_cast<double>(rows * M * H) / secs : 1e12;
  }
  return flops / measured_flops_;
}

// One all-to-all of the routed MoE: the send buffer of the T·k rows of M elements, over the
// machine model's all-to-all rate among the dispatch group's members (an expert-parallel group
// smaller than the world may stay on one node), which is per byte of the whole send buffer (the
// share that stays on this rank under balanced routing, 1/W, is already in it:
// Backend::a2a_bytes_among).
double ScMoEPair::a2a_seconds(std::int64_t T) {
  const Communicator& group = impl_->layer().channels().dispatch_comm();
  if (group.size() <= 1) return 0.0;
  const double bytes = static_cast<double>(T * cfg_.moe.top_k * cfg_.d_model) * static_cast<double>(dtype_size(cfg_.dtype));
  const double rate = b_.a2a_bytes_among(group.world_ranks());
  return bytes / (rate > 0 ? rate : kAssumedA2aBytesPerS);
}

// The window's blocks, the experts and the all-to-alls for T tokens, from the cost model: per
// block the GEMM time of its forward and of its input-gradient (B) pass, the projections and
// MLPs as GEMMs, attention's scores and values at the rate of the sim's attention shape
// (B·Hq·S rows of a [S,D] product); elementwise work is left out. Then the slots and chunks.
const Placement& ScMoEPair::placement(std::int64_t T) {
  if (auto it = placements_.find(T); it != placements_.end()) return it->second;
  last_T_ = T;
  Placement p;
  switch (sc_.position) {
    case ShortcutPosition::pos1: p.window = {Unit::moe_attention, Unit::shared_expert}; break;
    case ShortcutPosition::pos2: p.window = {Unit::dense_mlp, Unit::moe_attention, Unit::shared_expert}; break;
    case ShortcutPosition::pos3:
      p.window = {Unit::dense_attention, Unit::dense_mlp, Unit::moe_attention, Unit::shared_expert};
      break;
  }
  const std::int64_t M = cfg_.d_model, S = cfg_.seq_len, D = cfg_.head_dim();
  const std::int64_t Q = static_cast<std::int64_t>(cfg_.num_heads + 2 * cfg_.num_kv_heads) * D, HD = cfg_.num_heads * D;
  const int f1 = cfg_.mlp == MlpKind::swiglu ? 2 : 1;
  const AttentionShape a = cfg_.attention(std::max<std::int64_t>(T / S, 1));
  const double attn_rate_s = gemm_seconds(a.batch * a.heads * a.seq, a.seq, a.head_dim);  // seconds of 2·(B·H·S)·S·D flops
  const double attn_unit = 2.0 * static_cast<double>(a.batch * a.heads * a.seq) * static_cast<double>(a.seq * a.head_dim);
  const auto attention = [&](bool backward) {
    const double core = attn_unit > 0 ? attn_rate_s * (backward ? cost_attention_backward(a, cfg_.dtype).flops
                                                                : cost_attention_forward(a, cfg_.dtype).flops) / attn_unit
                                      : 0.0;
    return core + gemm_seconds(T, Q, M) + gemm_seconds(T, M, HD);  // qkv and out (or their dgrads)
  };
  const auto mlp = [&](std::int64_t F) { return gemm_seconds(T, f1 * F, M) + gemm_seconds(T, M, F); };
  for (Unit u : p.window) {
    const bool attn = u == Unit::dense_attention || u == Unit::moe_attention;
    const std::int64_t F = u == Unit::shared_expert ? cfg_.shared_expert_hidden : cfg_.d_ffn;
    p.forward.compute.push_back(attn ? attention(false) : mlp(F));
    p.backward.compute.insert(p.backward.compute.begin(), attn ? attention(true) : mlp(F));  // backward order
  }
  // The experts: T·k rows arrive in all under balanced routing, spread over the local experts.
  const std::int64_t El = impl_->layer().local_experts(), H = cfg_.moe.d_hidden;
  const std::int64_t rows = std::max<std::int64_t>(T * cfg_.moe.top_k / std::max<std::int64_t>(El, 1), 1);
  const double experts = static_cast<double>(El) * (gemm_seconds(rows, H, M) + gemm_seconds(rows, M, H));
  p.forward.experts = p.backward.experts = experts;  // B: fc2_dgrad and fc1_dgrad, the same shapes
  p.forward.first = p.forward.second = p.backward.first = p.backward.second = a2a_seconds(T);
  p.forward.chunk_overhead = p.backward.chunk_overhead = kChunkOverhead;
  {
    const MachineRates r = b_.machine_rates(T, M, M, cfg_.dtype);
    p.rates = r.gemm_flops > 0 ? r.source : "GEMM rate measured with " + b_.name() + "'s GEMM library";
    const Communicator& group = impl_->layer().channels().dispatch_comm();
    if (group.size() > 1 && !(b_.a2a_bytes_among(group.world_ranks()) > 0))
      p.rates += "; all-to-all " + std::to_string(kAssumedA2aBytesPerS / 1e9) + " GB/s assumed";
    // Offloaded experts: every local expert that balanced routing reaches (all of them when
    // T·k rows outnumber them) is copied in over the host link before the experts can run:
    // the experts' slot sees max(dispatch, migration) before it.
    const auto mode = impl_->layer().expert_offload();
    if (mode != MoELayer::ExpertOffload::none) {
      p.offload = MoELayer::expert_offload_name(mode);
      const std::int64_t reached = std::min<std::int64_t>(El, T * cfg_.moe.top_k);
      const double bytes = 2.0 * static_cast<double>(reached * M * H) * static_cast<double>(dtype_size(cfg_.dtype));
      // Every rank migrates its experts at once: a rank's share of the host links.
      const double host = r.host_copy_bytes_all_ranks;
      p.migrate = host > 0 ? bytes / host : 0.0;
      if (!(host > 0)) p.rates += "; host link rate unknown: the migration not priced";
      // sync: the copies are in the compute stream's path whatever the slot; async: beside it,
      // one set of copies that every chunk's experts wait for (not cut into chunks).
      if (mode == MoELayer::ExpertOffload::async) p.forward.ready = p.migrate;
    }
  }
  // The slot rule sees what must end before the experts: the dispatch, or the copies if longer.
  p.forward_choice = choose_slot(p.forward.compute, std::max(p.forward.first, p.forward.ready), p.forward.second);
  p.backward_choice = choose_slot(p.backward.compute, p.backward.first, p.backward.second);
  p.slot_forward = p.forward_choice.slot;
  p.slot_backward = p.backward_choice.slot;
  p.chosen = "cost model";
  if (sc_.expert_slot >= 0) {  // the model file's slot; backward mirrors it
    p.slot_forward = sc_.expert_slot;
    p.slot_backward = static_cast<int>(p.window.size()) - sc_.expert_slot;
    p.chosen = "model file";
  }
  p.chunk_choice = choose_chunks(p.forward, p.slot_forward, p.backward, p.slot_backward);
  p.chunks = sc_.chunks > 0 ? sc_.chunks : p.chunk_choice.chunks;
  return placements_.emplace(T, std::move(p)).first->second;
}

json ScMoEPair::schedule_report() {
  json j;
  j["position"] = shortcut_position_name(sc_.position);
  j["combine"] = shortcut_combine_name(sc_.combine);
  j["layers"] = {first_, moe_layer_};
  j["routed_steps"] = drives_steps() ? "issued by the pair (route and permute at the shortcut, unpermute at the end)"
                                     : impl_->name() + " runs its own pass, whole, in the experts' slot";
  if (auto it = placements_.find(last_T_); it != placements_.end()) {
    j["tokens"] = last_T_;
    j.update(it->second.to_json());
    if (drives_steps()) j["issued_chunks"] = issued_chunks_;
  }
  return j;
}

// ---- forward -----------------------------------------------------------------------------------
void ScMoEPair::forward_unit(Unit u, PairSaved& sv, Tensor& h, const WorkKey& dense_key, const WorkKey& moe_key) {
  Forwarded f;
  switch (u) {
    case Unit::dense_attention:
      f = dense_attention_->forward(h, dense_key);
      sv.dense_attention = std::move(f.saved);
      h = f.y;
      break;
    case Unit::dense_mlp:
      f = dense_mlp_->forward(h, dense_key);
      sv.dense_mlp = std::move(f.saved);
      h = f.y;
      break;
    case Unit::moe_attention:
      f = moe_attention_->forward(h, moe_key);
      sv.moe_attention = std::move(f.saved);
      h = f.y;
      break;
    case Unit::shared_expert: {  // h stays H_{l+1}^MH: the residual is added at the end
      PhaseScope ph(b_, kind());
      sv.n_se = se_norm_.forward(h, sv.se_norm);
      sv.s = se_.forward(sv.n_se, sv.se);
      break;
    }
  }
}

Forwarded ScMoEPair::forward(const Tensor& x, const WorkKey& key) {
  MOELAB_CHECK(x.ndim() == 2 && x.dim(1) == cfg_.d_model && x.dtype() == cfg_.dtype,
               "ScMoE pair: input " + x.describe() + " does not match d_model " + std::to_string(cfg_.d_model));
  const std::int64_t T = x.dim(0), M = cfg_.d_model;
  MicrobatchScope mb(b_, key.microbatch);
  auto sv = std::make_unique<PairSaved>(key);
  sv->aux_grad = aux_coef_ * aux_scale_;
  WorkKey dense_key = key, moe_key = key;
  dense_key.layer = first_;
  moe_key.layer = moe_layer_;
  const Placement& pl = placement(T);
  Stream& c = impl_->layer().compute_stream();
  MOELAB_CHECK(&c == &s_, "ScMoE pair: the MoE layer's compute stream is not the model's");

  Tensor h = x;
  // Pos-2 takes the shortcut after the dense block's attention, which is not in the window.
  if (sc_.position == ShortcutPosition::pos2) forward_unit(Unit::dense_attention, *sv, h, dense_key, moe_key);
  Tensor n_r;  // [T,M] the routed MoE's input
  {
    PhaseScope ph(b_, kind());
    n_r = moe_norm_.forward(h, sv->moe_norm);
  }
  const int n = static_cast<int>(pl.window.size()), slot = pl.slot_forward;
  const auto run_units = [&](int from, int to) {
    for (int i = from; i < to; ++i) forward_unit(pl.window[static_cast<std::size_t>(i)], *sv, h, dense_key, moe_key);
  };
  MoELayer& L = impl_->layer();
  if (drives_steps()) {
    auto ms = std::make_unique<MoESaved>(moe_key);
    ms->x = n_r;
    L.route(c, *ms);                                 // gate: as early as possible
    const Tensor t_i = L.dispatch_preprocess(c, *ms);  // permute, counts, the implementation's plan
    ChunkPlan& plan = ms->plan;
    if (pl.chunks > 1 && plan.chunks.size() == 1) {  // Tutel-style chunks of the one exchange
      plan.chunks = split_chunk(plan.chunks.front(), L.local_experts(), M, pl.chunks);
      plan.one_in_flight = false;
    }
    plan.lookahead = static_cast<int>(plan.chunks.size());  // every dispatch issued now
    issued_chunks_ = static_cast<int>(plan.chunks.size());
    Tensor y_r;
    if (plan.output_first) y_r = b_.empty({T, M}, cfg_.dtype, MemCategory::activations, c);
    const PassPlacement place{[&] { run_units(0, slot); }, true};
    PassBuffers pass = issue_forward(L, *ms, t_i, nullptr, &place);
    run_units(slot, n);
    b_.wait(c, *pass.done);  // the last combine: then the pass's buffers may go
    pass = {};
    if (!y_r.defined()) y_r = b_.empty({T, M}, cfg_.dtype, MemCategory::activations, c);
    L.combine_postprocess(c, *ms, y_r);  // unpermute: as late as possible
    sv->r = y_r;
    sv->moe = std::move(ms);
  } else {
    run_units(0, slot);
    Forwarded f = impl_->forward(n_r, moe_key);
    sv->r = f.y;
    sv->moe = std::move(f.saved);
    run_units(slot, n);
  }

  // combine(SE, MoE) and the MoE block's residual: y = H_{l+1}^MH + combine.
  PhaseScope ph(b_, kind());
  Tensor out = b_.empty({T, M}, cfg_.dtype, MemCategory::activations, s_);  // [T,M]
  if (sc_.combine == ShortcutCombine::add) {
    b_.add(s_, sv->s, sv->r, out);
    sv->s = sv->r = Tensor();  // the sum's backward needs neither
  } else {
    const std::int64_t G = sc_.gate_width();
    sv->z = b_.empty({T, G}, DType::f32, MemCategory::activations, s_);  // [T,G] fp32
    b_.gemm(s_, block_gemm(false, false, T, G, M, sv->n_se, w_cg_.value, sv->z, 0), "scmoe_gate");
    b_.gated_combine_forward(s_, sv->z, sv->s, sv->r, out);
    if (G == 1) sv->r = Tensor();  // CG-1's backward reads SE's output only
  }
  Tensor y = b_.empty({T, M}, cfg_.dtype, MemCategory::activations, s_);
  b_.add(s_, h, out, y);
  return {y, std::move(sv)};
}

// ---- backward ----------------------------------------------------------------------------------
// g enters as the gradient of the unit's output and leaves as that of its input. The shared
// expert's unit adds its branch to g (g is H_{l+1}^MH's gradient both sides of it): d_s is the
// combine's gradient of SE's output, d_n_se_gate that of its normed input through W_cg.
void ScMoEPair::backward_unit(Unit u, PairSaved& sv, Tensor& g, const Tensor& d_s, const Tensor& d_n_se_gate) {
  switch (u) {
    case Unit::dense_attention: g = dense_attention_->backward_input(*sv.dense_attention, g); break;
    case Unit::dense_mlp: g = dense_mlp_->backward_input(*sv.dense_mlp, g); break;
    case Unit::moe_attention: g = moe_attention_->backward_input(*sv.moe_attention, g); break;
    case Unit::shared_expert: {
      PhaseScope ph(b_, kind());
      Tensor d_n = se_.backward_input(sv.se, d_s);
      if (d_n_se_gate.defined()) b_.add(s_, d_n, d_n_se_gate, d_n);
      Tensor d_h = se_norm_.backward(sv.se_norm, d_n);
      Tensor sum = b_.empty(g.shape(), cfg_.dtype, MemCategory::buffers, s_);
      b_.add(s_, g, d_h, sum);
      g = sum;
      sv.se_norm = Norm::State{};
      break;
    }
  }
}

Tensor ScMoEPair::backward_input(Saved& saved, const Tensor& dy) {
  auto& sv = saved_as<PairSaved>(saved, "ScMoE pair");
  MOELAB_CHECK(!sv.input_done && sv.moe, "ScMoE pair: backward_input called twice on one saved state");
  const std::int64_t T = dy.dim(0), M = cfg_.d_model;
  MicrobatchScope mb(b_, sv.key.microbatch);
  const Placement& pl = placement(T);
  Stream& c = s_;

  // The combine's backward: the branches' gradients first, so that the routed MoE's backward
  // starts as early as possible.
  Tensor d_s, d_r, d_n_se_gate;
  {
    PhaseScope ph(b_, kind());
    if (sc_.combine == ShortcutCombine::add) {
      d_s = d_r = dy;
    } else {
      const std::int64_t G = sc_.gate_width();
      d_s = b_.empty({T, M}, cfg_.dtype, MemCategory::buffers, c);
      if (G == 2) d_r = b_.empty({T, M}, cfg_.dtype, MemCategory::buffers, c);
      Tensor dz = b_.empty({T, G}, DType::f32, MemCategory::buffers, c);
      b_.gated_combine_backward(c, sv.z, sv.s, sv.r, dy, d_s, d_r, dz);
      if (G == 1) d_r = dy;  // c_b = 1
      if (cfg_.dtype == DType::f32) {
        sv.dz = dz;
      } else {  // the gate's GEMMs run in the model's dtype, as the MoE gate's do
        sv.dz = b_.empty({T, G}, cfg_.dtype, MemCategory::buffers, c);
        b_.copy(c, dz, sv.dz);
      }
      d_n_se_gate = b_.empty({T, M}, cfg_.dtype, MemCategory::buffers, c);  // dz · W_cg^T
      b_.gemm(c, block_gemm(false, true, T, M, G, sv.dz, w_cg_.value, d_n_se_gate, 0), "scmoe_gate_dgrad");
      sv.s = sv.r = sv.z = Tensor();
    }
  }

  const int n = static_cast<int>(pl.window.size()), slot = pl.slot_backward;
  Tensor g = dy;  // H_{l+1}'s gradient, and H_{l+1}^MH's through the residual
  const auto run_units = [&](int from, int to) {  // the window's backward, in backward order
    for (int i = from; i < to; ++i) backward_unit(pl.window[static_cast<std::size_t>(n - 1 - i)], sv, g, d_s, d_n_se_gate);
  };
  const float grad_aux = sv.aux_grad;
  Tensor d_n_r;  // [T,M] the routed MoE's input gradient
  MoELayer& L = impl_->layer();
  if (drives_steps()) {
    auto& ms = saved_as<MoESaved>(*sv.moe, "ScMoE pair's routed MoE");
    const std::int64_t N = ms.t_o.dim(0);
    Tensor d_w = b_.empty({T, cfg_.moe.top_k}, DType::f32, MemCategory::buffers, c);  // [T,k]
    Tensor d_t_o = b_.empty({N, M}, cfg_.dtype, MemCategory::buffers, c);             // [N,M]
    L.combine_postprocess_backward(c, ms, d_r, d_t_o, d_w);
    if (ms.plan.output_first) d_n_r = b_.empty({T, M}, cfg_.dtype, MemCategory::activations, c);
    const PassPlacement place{[&] { run_units(0, slot); }, true};
    PassBuffers pass = issue_backward(L, ms, d_t_o, /*defer=*/true, nullptr, &place);
    run_units(slot, n);
    b_.wait(c, *pass.done);  // the last dispatch backward
    pass.chunks.clear();
    if (!d_n_r.defined()) d_n_r = b_.empty({T, M}, cfg_.dtype, MemCategory::activations, c);
    L.dispatch_preprocess_backward(c, ms, pass.d_t_i, d_n_r);  // as late as the shortcut's gradient allows
    pass.d_t_i = Tensor();
    L.route_backward(c, ms, d_w, grad_aux, d_n_r, /*defer=*/true);
    ms.input_done = true;
  } else {
    run_units(0, slot);
    d_n_r = impl_->backward_input(*sv.moe, d_r, grad_aux);
    run_units(slot, n);
  }
  {  // the shortcut's gradient joins where the shortcut left
    PhaseScope ph(b_, kind());
    Tensor d_short = moe_norm_.backward(sv.moe_norm, d_n_r);
    Tensor sum = b_.empty(g.shape(), cfg_.dtype, MemCategory::buffers, c);
    b_.add(c, g, d_short, sum);
    g = sum;
    sv.moe_norm = Norm::State{};
  }
  if (sc_.position == ShortcutPosition::pos2) backward_unit(Unit::dense_attention, sv, g, Tensor(), Tensor());
  sv.input_done = true;
  return g;
}

void ScMoEPair::backward_weight(Saved& saved) {
  auto& sv = saved_as<PairSaved>(saved, "ScMoE pair");
  MOELAB_CHECK(sv.input_done, "ScMoE pair: backward_weight before backward_input");
  MicrobatchScope mb(b_, sv.key.microbatch);
  if (dense_attention_) dense_attention_->backward_weight(*sv.dense_attention);
  if (dense_mlp_) dense_mlp_->backward_weight(*sv.dense_mlp);
  moe_attention_->backward_weight(*sv.moe_attention);
  {
    PhaseScope ph(b_, kind());
    se_.backward_weight(sv.se);
    if (sv.dz.defined()) {  // dW_cg += n_se^T · dz     [M,T]x[T,G]
      const std::int64_t T = sv.n_se.dim(0), M = cfg_.d_model, G = sc_.gate_width();
      b_.gemm(s_, block_gemm(true, false, M, G, T, sv.n_se, sv.dz, w_cg_.grad, 1), "scmoe_gate_wgrad");
    }
  }
  impl_->backward_weight(*sv.moe);
  sv.dense_attention.reset();
  sv.dense_mlp.reset();
  sv.moe_attention.reset();
  sv.moe.reset();
  sv.n_se = sv.dz = Tensor();
  sv.weight_done = true;
}

}  // namespace

std::unique_ptr<LayerGroup> make_scmoe_pair(LayerGroupArgs args) { return std::make_unique<ScMoEPair>(std::move(args)); }

void register_scmoe() { register_shortcut_pair(make_scmoe_pair); }

}  // namespace moelab
