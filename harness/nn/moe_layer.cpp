// harness/nn/moe_layer.cpp — the expert-parallel MoE layer (see moe_layer.hpp for the data
// flow and notation). Every op is issued on a stream; the only host synchronisation is the
// one the algorithm needs: reading the per-expert counts to size the all-to-all-v.
#include "harness/nn/moe_layer.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "harness/runtime/error.hpp"
#include "harness/runtime/gemm_paths.hpp"
#include "harness/runtime/parallel.hpp"
#include "harness/runtime/random.hpp"

namespace moelab {

MoEChannels::MoEChannels(Backend& b, Communicator& comm, Communicator* tp)
    : b_(b), tp_(tp && tp->size() > 1 ? tp : nullptr), dispatch_comm_(comm.dup()), combine_comm_(comm.dup()) {
  compute_ = &b_.default_stream();
  dispatch_ = &b_.create_stream(StreamRole::dispatch, "dispatch");
  combine_ = &b_.create_stream(StreamRole::combine, "combine");
}

Stream& MoEChannels::host_to_device() {
  if (!h2d_) h2d_ = &b_.create_stream(StreamRole::h2d, "h2d");
  return *h2d_;
}

Stream& MoEChannels::gather() {
  MOELAB_CHECK(tp_ != nullptr, "MoEChannels::gather: the channels have no tensor-parallel group");
  if (!gather_) gather_ = &b_.create_stream(StreamRole::aux, "tp_gather");
  return *gather_;
}

Communicator& MoEChannels::gather_comm() {
  MOELAB_CHECK(tp_ != nullptr, "MoEChannels::gather_comm: the channels have no tensor-parallel group");
  // Collective over the TP group: its ranks build the same layers in the same order, and a
  // layer that uses the lane asks for it when it is built.
  if (!gather_comm_) gather_comm_ = tp_->dup();
  return *gather_comm_;
}

Stream& MoEChannels::device_to_host() {
  if (!d2h_) d2h_ = &b_.create_stream(StreamRole::d2h, "d2h");
  return *d2h_;
}

MoELayer::MoELayer(Backend& backend, Communicator& comm, const ModelConfig& cfg, MoEChannels* channels)
    : b_(backend), comm_(comm), cfg_(cfg), events_(backend) {
  const int ep = comm.size();
  if (cfg.num_experts % ep != 0)
    throw ConfigError("model.num_experts = " + std::to_string(cfg.num_experts) +
                      " is not divisible by the expert-parallel degree " + std::to_string(ep));
  local_experts_ = cfg.num_experts / ep;
  if (!channels) own_channels_ = std::make_unique<MoEChannels>(b_, comm);
  channels_ = channels ? channels : own_channels_.get();
  compute_ = &channels_->compute();
  dispatch_ = &channels_->dispatch();
  combine_ = &channels_->combine();
  dispatch_comm_ = &channels_->dispatch_comm();
  combine_comm_ = &channels_->combine_comm();

  const std::int64_t M = cfg.d_model, H = cfg.d_hidden, E = cfg.num_experts, El = local_experts_;
  auto alloc_pair = [&](Tensor MoEParams::*field, std::vector<std::int64_t> shape) {
    params_.*field = b_.empty(shape, cfg.dtype, MemCategory::weights, *compute_);
    grads_.*field = b_.empty(shape, cfg.dtype, MemCategory::gradients, *compute_);
  };
  alloc_pair(&MoEParams::w_gate, {M, E});
  if (cfg.noisy_gate) alloc_pair(&MoEParams::w_noise, {M, E});
  alloc_pair(&MoEParams::w1, {El, M, H});
  alloc_pair(&MoEParams::w2, {El, H, M});
  // Zeros from the start, every slice written: until the layer's own zero_grad (a model zeroes
  // its gradients itself), the weight-gradient GEMMs accumulate.
  for (Tensor* t : {&grads_.w_gate, &grads_.w_noise, &grads_.w1, &grads_.w2})
    if (t->defined()) b_.fill_zero(*compute_, *t);
}

// Queued work may still wait on events of the pool: let it drain before they go.
MoELayer::~MoELayer() {
  try {
    b_.synchronize();
  } catch (...) {  // a failed op was reported to whoever synchronised last; nothing to add
  }
}

void MoELayer::init_parameters(std::uint64_t seed) {
  if (!b_.has_data()) return;
  const std::int64_t M = cfg_.d_model, H = cfg_.d_hidden, E = cfg_.num_experts, El = local_experts_;
  auto fill = [](std::vector<float>& v, std::size_t at, std::size_t n, Rng rng, double fan_in) {
    const double a = 1.0 / std::sqrt(fan_in);
    parallel_for(n, std::size_t{1} << 16, [&](std::size_t begin, std::size_t end) {
      Rng r = rng;
      r.skip(begin);  // uniform() draws one
      for (std::size_t i = begin; i < end; ++i) v[at + i] = static_cast<float>(r.uniform(-a, a));
    });
  };
  std::vector<float> g(static_cast<std::size_t>(M * E));
  fill(g, 0, g.size(), Rng(Rng::mix(seed, 1)), static_cast<double>(M));
  b_.upload(g, params_.w_gate);
  if (cfg_.noisy_gate) {
    fill(g, 0, g.size(), Rng(Rng::mix(seed, 2)), static_cast<double>(M));
    b_.upload(g, params_.w_noise);
  }
  const std::int64_t first = comm_.rank() * El;  // global id of local expert 0
  std::vector<float> w1(static_cast<std::size_t>(El * M * H)), w2(w1.size());
  for (std::int64_t l = 0; l < El; ++l) {
    const auto at = static_cast<std::size_t>(l * M * H), n = static_cast<std::size_t>(M * H);
    fill(w1, at, n, Rng(Rng::mix(seed, 3, static_cast<std::uint64_t>(first + l))), static_cast<double>(M));
    fill(w2, at, n, Rng(Rng::mix(seed, 4, static_cast<std::uint64_t>(first + l))), static_cast<double>(H));
  }
  b_.upload(w1, params_.w1);
  b_.upload(w2, params_.w2);
}

namespace {
// Whether a step's GEMMs over chunk ch compute local expert l: it brings l rows, or the padded
// layout makes every expert a problem (per_expert below).
bool chunk_computes(const Chunk& ch, std::size_t l) { return ch.stride > 0 || ch.rows[l] > 0; }
}  // namespace

void MoELayer::zero_grad() {
  for (Tensor* t : {&grads_.w_gate, &grads_.w_noise})
    if (t->defined()) b_.fill_zero(*compute_, *t);
  if (!grads_.w1.defined()) return;
  unwritten_w1_.assign(static_cast<std::size_t>(local_experts_), 1);
  unwritten_w2_.assign(static_cast<std::size_t>(local_experts_), 1);
}

void MoELayer::set_wgrad_beta(Stream& c, std::vector<GemmProblem>& ps, const std::vector<std::int64_t>& experts,
                              std::vector<char>& unwritten, const Tensor& grads) {
  MOELAB_CHECK(ps.size() == experts.size(), "set_wgrad_beta: one expert per problem");
  if (unwritten.empty()) return;  // no zero_grad since the gradients were made: accumulate
  // One rule per call as expert_gemm issues them: all problems at once, or each alone.
  const std::size_t per_call = gemm_per_expert_ ? 1 : ps.size();
  for (std::size_t b = 0; b < ps.size(); b += per_call) {
    const std::size_t e = b + per_call;
    const bool write = std::all_of(experts.begin() + b, experts.begin() + e,
                                   [&](std::int64_t l) { return unwritten[static_cast<std::size_t>(l)] != 0; });
    for (std::size_t i = b; i < e; ++i) {
      char& u = unwritten[static_cast<std::size_t>(experts[i])];
      if (u && !write) {
        Tensor g = grads.select(experts[i]);
        b_.fill_zero(c, g);
      }
      u = 0;
      ps[i].beta = write ? 0.0f : 1.0f;
    }
  }
}

void MoELayer::zero_unrouted_expert_grads(Stream& c, const ChunkPlan& plan) {
  if (!grads_.w1.defined() || unwritten_w1_.empty()) return;
  for (std::int64_t l = 0; l < local_experts_; ++l) {
    const bool computed = std::any_of(plan.chunks.begin(), plan.chunks.end(), [&](const Chunk& ch) {
      return chunk_computes(ch, static_cast<std::size_t>(l));
    });
    if (computed) continue;
    for (auto [unwritten, grads] : {std::pair{&unwritten_w1_, &grads_.w1}, std::pair{&unwritten_w2_, &grads_.w2}}) {
      char& u = (*unwritten)[static_cast<std::size_t>(l)];
      if (!u) continue;
      Tensor g = grads->select(l);
      b_.fill_zero(c, g);
      u = 0;
    }
  }
}

namespace {
// The grouped GEMM of one step over the local experts: per expert l, rows [off_l, off_l+r_l)
// of the row-wise operands. `make` builds the problem for one expert from its row views. In
// the padded layout (Chunk::stride) every expert is a problem, those without a row too, each
// with the stride as its token stride (GemmProblem::token_stride).
template <class F>
std::vector<GemmProblem> per_expert(const Chunk& ch, bool include_empty, F make) {
  std::vector<GemmProblem> ps;
  for (std::size_t l = 0; l < ch.rows.size(); ++l)
    if (include_empty || chunk_computes(ch, l)) {
      ps.push_back(make(static_cast<std::int64_t>(l), ch.offset[l], ch.rows[l]));
      ps.back().token_stride = ch.stride;
    }
  return ps;
}
}  // namespace

void MoELayer::expert_gemm(Stream& c, const std::vector<GemmProblem>& ps, const char* name, GemmEpilogue ep) {
  const auto issue = [&](std::span<const GemmProblem> call) {
    if (ep == GemmEpilogue::none)
      b_.grouped_gemm(c, call, name);
    else
      b_.grouped_gemm_epilogue(c, call, ep, cfg_.activation, name);
  };
  if (!gemm_per_expert_) {
    issue(ps);
    return;
  }
  for (const GemmProblem& p : ps) issue(std::span<const GemmProblem>(&p, 1));
}

void MoELayer::host_wait(Stream& s, const std::string& what) {
  b_.synchronize(s);
  host_waits_.push_back(what);
}

// ---- route: logits [T,E] -> probs, top-k, capacity, slots -----------------------------------
// Fills the gate part of sv and routing_. The layer's one host synchronisation is here: the
// counts size the all-to-all-v.
void MoELayer::route(Stream& c, MoESaved& sv) {
  const Tensor& x = sv.x;
  const std::int64_t T = x.dim(0), M = cfg_.d_model, E = cfg_.num_experts;
  const int k = cfg_.top_k;
  PhaseScope ph(b_, "gate");
  Tensor logits = b_.empty({T, E}, DType::f32, MemCategory::buffers, c);
  b_.gemm(c, {false, false, T, E, M, x, params_.w_gate, logits, 1.0f, 0.0f}, "gate_logits");
  if (cfg_.noisy_gate) {
    sv.noise_raw = b_.empty({T, E}, DType::f32, MemCategory::activations, c);
    b_.gemm(c, {false, false, T, E, M, x, params_.w_noise, sv.noise_raw, 1.0f, 0.0f}, "gate_noise_logits");
    sv.eps = b_.empty({T, E}, DType::f32, MemCategory::activations, c);
    if (b_.has_data()) {  // the noise is drawn on the host so that tests can replay it
      Rng rng(Rng::mix(noise_seed_, noise_rank(), work_seed(sv.key)));
      sv.eps_host.resize(static_cast<std::size_t>(T * E));
      for (auto& v : sv.eps_host) v = static_cast<float>(rng.normal());
      b_.upload(sv.eps_host, sv.eps);
      last_eps_ = sv.eps_host;
    }
    Tensor noisy = b_.empty({T, E}, DType::f32, MemCategory::buffers, c);
    b_.noisy_logits(c, logits, sv.noise_raw, sv.eps, noisy);
    logits = noisy;
  }
  GateForward g;
  g.logits = logits;
  g.top_k = k;
  g.capacity = cfg_.capacity(T);
  g.renormalize = cfg_.renormalize;
  g.probs = sv.probs = b_.empty({T, E}, DType::f32, MemCategory::activations, c);
  g.topk_idx = sv.topk_idx = b_.empty({T, k}, DType::i32, MemCategory::activations, c);
  g.topk_w = sv.topk_w = b_.empty({T, k}, DType::f32, MemCategory::activations, c);
  g.slot = sv.slot = b_.empty({T, k}, DType::i32, MemCategory::activations, c);
  g.counts = b_.empty({E}, DType::i32, MemCategory::buffers, c);
  g.routed_frac = sv.routed_frac = b_.empty({E}, DType::f32, MemCategory::activations, c);
  g.aux_loss = sv.aux_loss = b_.empty({1}, DType::f32, MemCategory::activations, c);
  if (seq_group_) g.prob_mean = sv.prob_mean = b_.empty({E}, DType::f32, MemCategory::activations, c);
  b_.gate_forward(c, g);
  // The one host synchronisation of the layer: the counts size the all-to-all-v.
  const auto counts = b_.download_i32(g.counts);
  // f_e * T * k is exact in fp32 for any T*k below 2^24
  const auto frac = b_.download(g.routed_frac);
  routing_.routed_per_expert.assign(static_cast<std::size_t>(E), 0);
  for (std::size_t e = 0; e < frac.size(); ++e)
    routing_.routed_per_expert[e] = std::llround(static_cast<double>(frac[e]) * static_cast<double>(T * k));
  if (routed_totals_.size() != static_cast<std::size_t>(E)) routed_totals_.assign(static_cast<std::size_t>(E), 0);
  for (std::size_t e = 0; e < routed_totals_.size(); ++e) routed_totals_[e] += routing_.routed_per_expert[e];
  routing_.capacity = g.capacity;
  sv.sent.assign(counts.begin(), counts.end());
  routing_.sent_per_expert = sv.sent;
  const std::int64_t kept = std::accumulate(sv.sent.begin(), sv.sent.end(), std::int64_t{0});
  routing_.dropped = T * k - kept;
  if (seq_group_) {
    // The sequence's f_e = (slots the group routed to e) / (T_g·k), T_g = n·T rows in all; as
    // the gate's f (whose backward divides by this rank's T) the rank keeps f_e·T/T_g, so that
    // its aux term E·Σ_e f_e·(Σ_{t∈rank} p[t,e])/T_g and gradient grad_aux·E·f_e/T_g are the
    // rank's share of the unsplit batch's (Megatron-Core, moe_utils.py, with
    // sequence_partition_group). The counts come back from f_e·T·k within fp32 rounding. A
    // rank with no rows still joins the sum (with f = 0).
    const double n = seq_group_->size(), Tk = static_cast<double>(T) * k;
    Tensor routed = b_.empty({E}, DType::f32, MemCategory::buffers, c);  // [E] slots routed to e
    b_.scale(c, sv.routed_frac, static_cast<float>(Tk), routed);
    seq_group_->all_reduce(c, routed);
    b_.scale(c, routed, Tk > 0 ? static_cast<float>(1.0 / (n * n * Tk)) : 0.0f, sv.routed_frac);
  }
}

// (layer, microbatch, step) -> one word, equal to step for layer 0, microbatch 0: the lone
// layer's noise stream, Rng(mix(noise_seed, rank, step)), is unchanged by the keys. For other
// (layer, microbatch) the steps are shifted by a pseudo-random offset, so streams do not repeat.
std::uint64_t MoELayer::work_seed(const WorkKey& k) {
  const auto offset = [](int layer, int mb) {
    return Rng::mix(static_cast<std::uint64_t>(layer), static_cast<std::uint64_t>(mb));
  };
  return k.step + (offset(k.layer, k.microbatch) - offset(0, 0));
}

// ---- dispatch_preprocess: permute x -> T_I [N,M]; counts; the chunk plan --------------------
Tensor MoELayer::dispatch_preprocess(Stream& c, MoESaved& sv) {
  PhaseScope ph(b_, "dispatch");
  const std::int64_t N = std::accumulate(sv.sent.begin(), sv.sent.end(), std::int64_t{0});
  const bool keep = keeps_t_i(sv);
  Tensor t_i = b_.empty({N, cfg_.d_model}, cfg_.dtype, keep ? MemCategory::activations : MemCategory::buffers, c);
  b_.permute(c, sv.x, sv.slot, t_i);
  if (keep) sv.t_i = t_i;
  sv.plan = plan_chunks(sv);
  // What the chunks bring to the local experts, for reports and the GEMM yardstick.
  routing_.recv_per_local.assign(static_cast<std::size_t>(local_experts_), 0);
  last_chunk_rows_.clear();
  for (const Chunk& ch : sv.plan.chunks) {
    for (std::size_t l = 0; l < ch.rows.size(); ++l) routing_.recv_per_local[l] += ch.rows[l];
    last_chunk_rows_.push_back(ch.rows);
  }
  zero_unrouted_expert_grads(c, sv.plan);
  if (offload_ != ExpertOffload::none) migrate_experts(c);
  return t_i;
}

ChunkPlan MoELayer::plan_chunks(MoESaved& sv) {
  // recv[p*El + l]: rows rank p sends to my local expert l
  const auto recv = comm_.exchange_counts(sv.sent);
  std::vector<int> everyone(static_cast<std::size_t>(comm_.size()));
  std::iota(everyone.begin(), everyone.end(), 0);
  ChunkPlan plan;
  std::int64_t stride = 0;
  if (layout_ != ExpertLayout::packed) {
    std::vector<std::int64_t> rows(static_cast<std::size_t>(local_experts_), 0);
    for (std::int64_t l = 0; l < local_experts_; ++l)
      for (int p = 0; p < comm_.size(); ++p) rows[static_cast<std::size_t>(l)] += recv[static_cast<std::size_t>(p * local_experts_ + l)];
    stride = padded_stride(rows, layout_ == ExpertLayout::automatic ? GemmPathTable{}.max_padding_waste : 1.0);
  }
  plan.chunks.push_back(peer_chunk(sv.sent, recv, local_experts_, cfg_.d_model, everyone, everyone, stride));
  plan.dispatch = {dispatch_, dispatch_comm_};
  plan.combine = {combine_, combine_comm_};
  plan.one_in_flight = true;
  return plan;
}

void MoELayer::exchange(Stream& s, Communicator& comm, const Chunk& ch, const Tensor& src, Tensor& dst, bool reverse) {
  if (reverse)
    comm.all_to_all_v(s, src, ch.recvs, dst, ch.sends);
  else
    comm.all_to_all_v(s, src, ch.sends, dst, ch.recvs);
}

void MoELayer::dispatch(Stream& s, Communicator& comm, const Tensor& t_i, const Chunk& ch, Tensor& t_di) {
  PhaseScope ph(b_, "dispatch");
  exchange(s, comm, ch, t_i, t_di, false);
}

// ---- experts, forward: per local expert l, rows [off_l, off_l + r_l) ------------------------
// T_M = T_DI·W1_l [r,H]; A = act(T_M) (a temporary); T_DO = A·W2_l [r,M]. With a fused
// epilogue, FC1 writes T_M and A in one op.
void MoELayer::experts(Stream& c, const Chunk& ch, const Tensor& t_di, Tensor& t_m, Tensor& t_do) {
  const std::int64_t M = cfg_.d_model, H = cfg_.d_hidden, R = t_di.dim(0);
  PhaseScope ph(b_, "experts");
  Tensor a = b_.empty({R, H}, cfg_.dtype, MemCategory::buffers, c);
  if (fused_epilogue()) {
    // A's padding rows stay zero (act(0) = 0) whichever path FC1 takes: FC2 may read them.
    if (ch.stride > 0) b_.fill_zero(c, a);
    expert_fc1(c, ch, t_di, t_m, "fc1", &a);
    expert_linear_done(c);
  } else {
    expert_fc1(c, ch, t_di, t_m);
    expert_linear_done(c);
    b_.activation_forward(c, cfg_.activation, t_m, a);
  }
  expert_gemm(c, per_expert(ch, false, [&](std::int64_t l, std::int64_t o, std::int64_t r) {
    return GemmProblem{false, false, r, M, H, a.rows(o, r), expert_w2(l), t_do.rows(o, r), 1, 0};
  }), "fc2");
  expert_linear_done(c);
}

void MoELayer::expert_fc1(Stream& c, const Chunk& ch, const Tensor& t_di, Tensor& t_m, const char* name,
                          Tensor* act) {
  const std::int64_t M = cfg_.d_model, H = cfg_.d_hidden;
  PhaseScope ph(b_, "experts");
  if (offload_ == ExpertOffload::async && resident_.w1.defined()) b_.wait(c, *copies_done_);  // the experts' weights are in
  if (act) {  // the epilogue: C = act(T_DI·W1) into act, the product itself into t_m (aux)
    expert_gemm(c, per_expert(ch, false, [&](std::int64_t l, std::int64_t o, std::int64_t r) {
      GemmProblem p{false, false, r, H, M, t_di.rows(o, r), expert_w1(l), act->rows(o, r), 1, 0};
      p.aux = t_m.rows(o, r);
      return p;
    }), name, GemmEpilogue::act_aux);
    return;
  }
  expert_gemm(c, per_expert(ch, false, [&](std::int64_t l, std::int64_t o, std::int64_t r) {
    return GemmProblem{false, false, r, H, M, t_di.rows(o, r), expert_w1(l), t_m.rows(o, r), 1, 0};
  }), name);
}

void MoELayer::combine(Stream& s, Communicator& comm, const Chunk& ch, const Tensor& t_do, Tensor& t_o) {
  PhaseScope ph(b_, "combine");
  exchange(s, comm, ch, t_do, t_o, true);
}

void MoELayer::combine_postprocess(Stream& c, const MoESaved& sv, Tensor& y) {
  PhaseScope ph(b_, "combine");
  b_.unpermute(c, sv.t_o, sv.slot, sv.topk_w, y);
  resident_ = {};  // the experts have run (earlier on c): their device copies go, stream-ordered
}

// ---- expert offloading ------------------------------------------------------------------------
const char* MoELayer::expert_offload_name(ExpertOffload m) {
  return m == ExpertOffload::sync ? "sync" : m == ExpertOffload::async ? "async" : "none";
}

const char* MoELayer::expert_layout_name(ExpertLayout l) {
  return l == ExpertLayout::padded ? "padded" : l == ExpertLayout::automatic ? "auto" : "packed";
}

void MoELayer::set_expert_layout(ExpertLayout layout) {
  if (layout != ExpertLayout::packed && offload_ != ExpertOffload::none)
    throw ConfigError("expert_layout: the padded expert layout runs every local expert's GEMM, and the experts are offloaded");
  layout_ = layout;
}

void MoELayer::offload_experts(ExpertOffload mode) {
  if (mode == offload_) return;
  if (mode != ExpertOffload::none && layout_ != ExpertLayout::packed)
    throw ConfigError("--offload-experts: the padded expert layout (expert_layout) runs every local expert's GEMM; "
                      "offloading brings only the experts the plan sends rows to");
  if (!steps_drivable())
    throw ConfigError("--offload-experts: the MoE layer's schedule runs a pass of its own (MPipeMoE); expert offloading "
                      "needs a layer whose steps the model drives (fastmoe, fastermoe, top1, top2, their pipelined forms, ScMoE)");
  MOELAB_CHECK(offload_ == ExpertOffload::none, "MoELayer::offload_experts: the experts are offloaded already");
  Stream& c = *compute_;
  for (Tensor MoEParams::*w : {&MoEParams::w1, &MoEParams::w2}) {
    Tensor host = b_.empty((params_.*w).shape(), cfg_.dtype, MemCategory::host_pinned, c, MemSpace::host_pinned);
    b_.copy(c, params_.*w, host);
    params_.*w = host;  // the device copy goes (stream-ordered, after the copy)
  }
  grads_ = {};
  b_.synchronize(c);
  offload_ = mode;
  copies_start_ = b_.create_event();
  copies_done_ = b_.create_event();
}

// The experts the plan brings rows to, copied host -> device: on the host-to-device stream once
// the compute stream has made their buffer (async), or on the compute stream (sync).
void MoELayer::migrate_experts(Stream& c) {
  const std::int64_t M = cfg_.d_model, H = cfg_.d_hidden;
  Resident r;
  r.slot.assign(static_cast<std::size_t>(local_experts_), -1);
  std::int64_t n = 0;
  for (std::int64_t l = 0; l < local_experts_; ++l)
    if (routing_.recv_per_local[static_cast<std::size_t>(l)] > 0) r.slot[static_cast<std::size_t>(l)] = n++;
  if (n == 0) {
    resident_ = std::move(r);
    return;
  }
  PhaseScope ph(b_, "migrate");
  r.w1 = b_.empty({n, M, H}, cfg_.dtype, MemCategory::weights, c);  // [n,M,H]
  r.w2 = b_.empty({n, H, M}, cfg_.dtype, MemCategory::weights, c);  // [n,H,M]
  Stream& s = offload_ == ExpertOffload::async ? channels_->host_to_device() : c;
  if (&s != &c) {
    b_.record(*copies_start_, c);
    b_.wait(s, *copies_start_);
  }
  for (std::int64_t l = 0; l < local_experts_; ++l) {
    const std::int64_t at = r.slot[static_cast<std::size_t>(l)];
    if (at < 0) continue;
    Tensor d1 = r.w1.select(at), d2 = r.w2.select(at);
    b_.copy(s, params_.w1.select(l), d1);
    b_.copy(s, params_.w2.select(l), d2);
  }
  if (&s != &c) b_.record(*copies_done_, s);
  resident_ = std::move(r);
}

Tensor MoELayer::expert_w1(std::int64_t l) const {
  if (offload_ == ExpertOffload::none) return params_.w1.select(l);
  const std::int64_t at = resident_.slot.empty() ? -1 : resident_.slot[static_cast<std::size_t>(l)];
  MOELAB_CHECK(at >= 0, "MoE layer: expert " + std::to_string(l) + " has rows but is not resident (offloaded)");
  return resident_.w1.select(at);
}

Tensor MoELayer::expert_w2(std::int64_t l) const {
  if (offload_ == ExpertOffload::none) return params_.w2.select(l);
  const std::int64_t at = resident_.slot.empty() ? -1 : resident_.slot[static_cast<std::size_t>(l)];
  MOELAB_CHECK(at >= 0, "MoE layer: expert " + std::to_string(l) + " has rows but is not resident (offloaded)");
  return resident_.w2.select(at);
}

// ---- backward steps ---------------------------------------------------------------------------
void MoELayer::combine_postprocess_backward(Stream& c, const MoESaved& sv, const Tensor& dy, Tensor& d_t_o,
                                            Tensor& d_w) {
  MOELAB_CHECK(offload_ == ExpertOffload::none, "MoE layer: backward with the experts offloaded (inference only)");
  PhaseScope ph(b_, "combine");
  b_.unpermute_backward(c, dy, sv.t_o, sv.slot, sv.topk_w, d_t_o, d_w);
}

void MoELayer::combine_backward(Stream& s, Communicator& comm, const Chunk& ch, const Tensor& d_t_o, Tensor& d_t_do) {
  PhaseScope ph(b_, "combine");
  exchange(s, comm, ch, d_t_o, d_t_do, false);
}

// ---- experts, backward: the mirror of experts(), A recomputed from T_M ----------------------
// dA = dT_DO·W2^T; dW2 += A^T·dT_DO; dT_M = dA * act'(T_M); dW1 += T_DI^T·dT_M;
// dT_DI = dT_M·W1^T.
void MoELayer::experts_backward(Stream& c, const Chunk& ch, const Tensor& t_di, const Tensor& t_m,
                                const Tensor& d_t_do, Tensor& d_t_di, MoESaved::ExpertWgrad* defer) {
  const std::int64_t M = cfg_.d_model, H = cfg_.d_hidden, R = t_di.dim(0);
  PhaseScope ph(b_, "experts");
  Tensor a = b_.empty({R, H}, cfg_.dtype, MemCategory::buffers, c);
  b_.activation_forward(c, cfg_.activation, t_m, a);
  Tensor d_a = b_.empty({R, H}, cfg_.dtype, MemCategory::buffers, c);
  if (ch.stride > 0) b_.fill_zero(c, d_a);  // its padding rows stay zero whichever path dA's GEMM takes
  // dA = dT_DO · W2^T                [r,M]x[M,H]
  // (fused: dT_M = (dT_DO · W2^T) * act'(T_M) by the epilogue, into the same buffer)
  const bool fused = fused_epilogue();
  expert_gemm(c, per_expert(ch, false, [&](std::int64_t l, std::int64_t o, std::int64_t r) {
    GemmProblem p{false, true, r, H, M, d_t_do.rows(o, r), params_.w2.select(l), d_a.rows(o, r), 1, 0};
    if (fused) p.aux = t_m.rows(o, r);
    return p;
  }), "fc2_dgrad", fused ? GemmEpilogue::dact : GemmEpilogue::none);
  if (!defer) fc2_wgrad(c, ch, a, d_t_do);
  expert_linear_done(c);
  // dT_M = dA * act'(T_M), in place
  if (!fused) b_.activation_backward(c, cfg_.activation, t_m, d_a, d_a);
  if (!defer) fc1_wgrad(c, ch, t_di, d_a);
  // dT_DI = dT_M · W1^T              [r,H]x[H,M]
  expert_gemm(c, per_expert(ch, false, [&](std::int64_t l, std::int64_t o, std::int64_t r) {
    return GemmProblem{false, true, r, M, H, d_a.rows(o, r), params_.w1.select(l), d_t_di.rows(o, r), 1, 0};
  }), "fc1_dgrad");
  expert_linear_done(c);
  if (defer) {
    defer->t_di = t_di;
    defer->a = a;
    defer->d_t_m = d_a;
    defer->d_t_do = d_t_do;
  }
}

// dW2 += A^T · dT_DO               [H,r]x[r,M]  (= where zero_grad left dW2_l unwritten)
void MoELayer::fc2_wgrad(Stream& c, const Chunk& ch, const Tensor& a, const Tensor& d_t_do) {
  const std::int64_t M = cfg_.d_model, H = cfg_.d_hidden;
  std::vector<std::int64_t> experts;
  std::vector<GemmProblem> ps = per_expert(ch, false, [&](std::int64_t l, std::int64_t o, std::int64_t r) {
    experts.push_back(l);
    return GemmProblem{true, false, H, M, r, a.rows(o, r), d_t_do.rows(o, r), grads_.w2.select(l), 1, 1};
  });
  set_wgrad_beta(c, ps, experts, unwritten_w2_, grads_.w2);
  expert_gemm(c, ps, "fc2_wgrad");
}

// dW1 += T_DI^T · dT_M             [M,r]x[r,H]  (= where zero_grad left dW1_l unwritten)
void MoELayer::fc1_wgrad(Stream& c, const Chunk& ch, const Tensor& t_di, const Tensor& d_t_m) {
  const std::int64_t M = cfg_.d_model, H = cfg_.d_hidden;
  std::vector<std::int64_t> experts;
  std::vector<GemmProblem> ps = per_expert(ch, false, [&](std::int64_t l, std::int64_t o, std::int64_t r) {
    experts.push_back(l);
    return GemmProblem{true, false, M, H, r, t_di.rows(o, r), d_t_m.rows(o, r), grads_.w1.select(l), 1, 1};
  });
  set_wgrad_beta(c, ps, experts, unwritten_w1_, grads_.w1);
  expert_gemm(c, ps, "fc1_wgrad");
}

void MoELayer::dispatch_backward(Stream& s, Communicator& comm, const Chunk& ch, const Tensor& d_t_di, Tensor& d_t_i) {
  PhaseScope ph(b_, "dispatch");
  exchange(s, comm, ch, d_t_di, d_t_i, true);
}

void MoELayer::dispatch_preprocess_backward(Stream& c, const MoESaved& sv, const Tensor& d_t_i, Tensor& dx) {
  PhaseScope ph(b_, "dispatch");
  b_.permute_backward(c, d_t_i, sv.slot, dx);
}

// ---- route backward: d_logits, then dWg, dWn and the gate's share of dx (accumulated) -------
void MoELayer::route_backward(Stream& c, MoESaved& sv, const Tensor& d_w, float grad_aux, Tensor& dx, bool defer) {
  const std::int64_t T = sv.x.dim(0), M = cfg_.d_model, E = cfg_.num_experts;
  PhaseScope ph(b_, "gate");
  GateBackward g;
  g.probs = sv.probs;
  g.topk_idx = sv.topk_idx;
  g.topk_w = sv.topk_w;
  g.routed_frac = sv.routed_frac;
  g.renormalize = cfg_.renormalize;
  g.d_topk_w = d_w;
  g.grad_aux = grad_aux;
  g.d_logits = b_.empty({T, E}, DType::f32, MemCategory::buffers, c);
  b_.gate_backward(c, g);
  // The gate GEMMs run in the layer's dtype (bf16 gradients as under autocast).
  auto in_dtype = [&](const Tensor& f32) {
    if (cfg_.dtype == DType::f32) return f32;
    Tensor t = b_.empty(f32.shape(), cfg_.dtype, MemCategory::buffers, c);
    b_.copy(c, f32, t);
    return t;
  };
  const Tensor d_logits = in_dtype(g.d_logits);
  if (defer)
    sv.gate_d_logits = d_logits;
  else
    b_.gemm(c, {true, false, M, E, T, sv.x, d_logits, grads_.w_gate, 1, 1}, "gate_wgrad");
  b_.gemm(c, {false, true, T, M, E, d_logits, params_.w_gate, dx, 1, 1}, "gate_dgrad");
  if (cfg_.noisy_gate) {
    Tensor d_noise = b_.empty({T, E}, DType::f32, MemCategory::buffers, c);
    b_.noisy_logits_backward(c, g.d_logits, sv.noise_raw, sv.eps, d_noise);
    const Tensor d_noise_x = in_dtype(d_noise);
    if (defer)
      sv.gate_d_noise = d_noise_x;
    else
      b_.gemm(c, {true, false, M, E, T, sv.x, d_noise_x, grads_.w_noise, 1, 1}, "gate_noise_wgrad");
    b_.gemm(c, {false, true, T, M, E, d_noise_x, params_.w_noise, dx, 1, 1}, "gate_noise_dgrad");
  }
}

// ---- the deferred weight gradients (zero-bubble "W") ---------------------------------------
void MoELayer::weight_gradients(Stream& c, MoESaved& sv) {
  const std::int64_t T = sv.x.dim(0), M = cfg_.d_model, E = cfg_.num_experts;
  for (auto& w : sv.expert_wgrad) {
    if (!w.a.defined()) continue;  // a chunk without experts work
    PhaseScope ph(b_, "experts");
    const Chunk& ch = sv.plan.chunks[w.chunk];
    fc2_wgrad(c, ch, w.a, w.d_t_do);
    fc1_wgrad(c, ch, w.t_di, w.d_t_m);
  }
  sv.expert_wgrad.clear();
  PhaseScope ph(b_, "gate");
  if (sv.gate_d_logits.defined())
    b_.gemm(c, {true, false, M, E, T, sv.x, sv.gate_d_logits, grads_.w_gate, 1, 1}, "gate_wgrad");
  if (sv.gate_d_noise.defined())
    b_.gemm(c, {true, false, M, E, T, sv.x, sv.gate_d_noise, grads_.w_noise, 1, 1}, "gate_noise_wgrad");
  sv.gate_d_logits = sv.gate_d_noise = Tensor();
}

void MoELayer::check_input(const Tensor& x) const {
  const std::int64_t M = cfg_.d_model;
  if (x.ndim() != 2 || x.dim(1) != M || x.dtype() != cfg_.dtype)
    throw ConfigError("MoE layer input " + x.describe() + " does not match d_model = " + std::to_string(M) +
                      ", dtype " + dtype_name(cfg_.dtype));
}

void MoELayer::check_output_grad(const MoESaved& sv, const Tensor& dy) const {
  const std::int64_t T = sv.x.dim(0), M = cfg_.d_model;
  if (dy.ndim() != 2 || dy.dim(0) != T || dy.dim(1) != M || dy.dtype() != cfg_.dtype)
    throw ConfigError("MoE layer output gradient " + dy.describe() + " does not match the forward's output [" +
                      std::to_string(T) + ", " + std::to_string(M) + "]");
}

// ---- the steps of a forward and a backward; the schedule is the plan ----------------------------
Forwarded MoELayer::forward(const Tensor& x, const WorkKey& key) { return run_forward(x, std::make_unique<MoESaved>(key)); }

Forwarded MoELayer::run_forward(const Tensor& x, std::unique_ptr<MoESaved> saved, ChunkHooks* hooks) {
  const std::int64_t T = x.dim(0), M = cfg_.d_model;
  check_input(x);
  MicrobatchScope mb(b_, saved->key.microbatch);
  MoESaved& sv = *saved;
  Stream& c = *compute_;
  sv.x = x;
  route(c, sv);
  const Tensor t_i = dispatch_preprocess(c, sv);  // [N,M]
  Tensor y;                                        // [T,M]
  if (sv.plan.output_first) y = b_.empty({T, M}, cfg_.dtype, MemCategory::activations, c);
  PassBuffers pass = issue_forward(*this, sv, t_i, hooks);
  if (pipeline_buffers_go_first(sv.plan)) pass = {};
  if (!y.defined()) y = b_.empty({T, M}, cfg_.dtype, MemCategory::activations, c);
  combine_postprocess(c, sv, y);
  return {y, std::move(saved)};
}  // T_I and the other buffers go here, ordered after the unpermute on the compute stream

// A pipelined schedule that makes the output after its pipeline (MPipeMoE) releases the
// pipeline's buffers first, so that the output may take their memory (the M_buf^pipe of
// MPipeMoE's memory model, §III-C); FastMoE and FasterMoE hold them to the end of the pass.
bool MoELayer::pipeline_buffers_go_first(const ChunkPlan& plan) { return !plan.one_in_flight && !plan.output_first; }

Tensor MoELayer::backward_pass(MoESaved& sv, const Tensor& dy, float grad_aux, bool defer) {
  return run_backward(sv, dy, grad_aux, defer);
}

Tensor MoELayer::run_backward(MoESaved& sv, const Tensor& dy, float grad_aux, bool defer, ChunkHooks* hooks) {
  const std::int64_t T = sv.x.dim(0), M = cfg_.d_model, N = sv.t_o.dim(0);
  Stream& c = *compute_;
  Tensor d_w = b_.empty({T, cfg_.top_k}, DType::f32, MemCategory::buffers, c);  // [T,k]
  Tensor d_t_o = b_.empty({N, M}, cfg_.dtype, MemCategory::buffers, c);         // [N,M]
  combine_postprocess_backward(c, sv, dy, d_t_o, d_w);
  Tensor dx;  // [T,M]
  if (sv.plan.output_first) dx = b_.empty({T, M}, cfg_.dtype, MemCategory::activations, c);
  PassBuffers pass = issue_backward(*this, sv, d_t_o, defer, hooks);
  if (pipeline_buffers_go_first(sv.plan)) pass.chunks.clear();
  if (!dx.defined()) dx = b_.empty({T, M}, cfg_.dtype, MemCategory::activations, c);
  dispatch_preprocess_backward(c, sv, pass.d_t_i, dx);
  if (sv.plan.one_in_flight) pass.d_t_i = Tensor();  // one in flight: dT_I too goes once used
  route_backward(c, sv, d_w, grad_aux, dx, defer);
  return dx;
}  // the buffers, dT_O and dw go here, ordered after the gate's backward on the compute stream

// ---- the handle API and the one-in-flight wrapper --------------------------------------------
Tensor MoELayer::backward_input(Saved& s, const Tensor& dy, float grad_aux) {
  MoESaved& sv = saved_as<MoESaved>(s, "MoE layer");
  MOELAB_CHECK(!sv.input_done, "MoE layer: backward_input called twice on one saved state");
  check_output_grad(sv, dy);
  MicrobatchScope mb(b_, sv.key.microbatch);
  const bool defer = defers_weight_gradients();
  Tensor dx = backward_pass(sv, dy, grad_aux, defer);
  sv.input_done = true;
  sv.weight_done = !defer;
  return dx;
}

void MoELayer::backward_weight(Saved& s) {
  MoESaved& sv = saved_as<MoESaved>(s, "MoE layer");
  MOELAB_CHECK(sv.input_done, "MoE layer: backward_weight before backward_input");
  if (sv.weight_done) return;
  MicrobatchScope mb(b_, sv.key.microbatch);
  weight_gradients(*compute_, sv);
  sv.weight_done = true;
}

float MoELayer::aux_loss(const Saved& s) {
  const auto* sv = dynamic_cast<const MoESaved*>(&s);
  MOELAB_CHECK(sv != nullptr, "MoE layer: aux_loss given a saved state of another layer");
  if (!b_.has_data()) return 0.0f;
  if (sv->prob_mean.defined()) {  // partition_sequence: this rank's share, E·Σ_e f_e·P_e
    const auto f = b_.download(sv->routed_frac), p = b_.download(sv->prob_mean);
    double sum = 0.0;
    for (std::size_t e = 0; e < f.size(); ++e) sum += static_cast<double>(f[e]) * p[e];
    return static_cast<float>(static_cast<double>(f.size()) * sum);
  }
  return b_.download(sv->aux_loss)[0];
}

const std::vector<float>& MoELayer::noise(const Saved& s) const {
  const auto* sv = dynamic_cast<const MoESaved*>(&s);
  MOELAB_CHECK(sv != nullptr, "MoE layer: noise given a saved state of another layer");
  return sv->eps_host;
}

Tensor MoELayer::forward(const Tensor& x) {
  held_.reset();  // a forward without its backward: its state goes first
  Forwarded f = forward(x, WorkKey{0, 0, ++step_});
  held_ = std::move(f.saved);
  return f.y;
}

Tensor MoELayer::backward(const Tensor& dy, float grad_aux) {
  MOELAB_CHECK(held_ != nullptr, "MoELayer::backward called without a forward");
  MoESaved& sv = saved_as<MoESaved>(*held_, "MoE layer");
  check_output_grad(sv, dy);
  Tensor dx;
  {
    MicrobatchScope mb(b_, sv.key.microbatch);
    dx = backward_pass(sv, dy, grad_aux, false);
  }
  held_.reset();  // frees the activations, ordered after everything above on the compute stream
  return dx;
}

float MoELayer::aux_loss() {
  MOELAB_CHECK(held_ != nullptr, "MoELayer::aux_loss: no forward to read it from");
  return aux_loss(*held_);
}

std::vector<float> MoELayer::last_noise() { return last_eps_; }

namespace {
// A zero-filled [r, cols] buffer for a yardstick's GEMMs: defined values, so no NaN or
// denormal slow paths in the timing.
Tensor yardstick_scratch(Backend& b, Stream& c, DType dt, std::int64_t r, std::int64_t cols) {
  Tensor t = b.empty({r, cols}, dt, MemCategory::buffers, c);
  b.fill_zero(c, t);
  return t;
}
}  // namespace

std::vector<GemmProblem> MoELayer::expert_gemm_problems(bool per_chunk) {
  const std::int64_t M = cfg_.d_model, H = cfg_.d_hidden;
  Stream& c = *compute_;
  std::vector<GemmProblem> ps;
  auto scratch = [&](std::int64_t r, std::int64_t cols) { return yardstick_scratch(b_, c, cfg_.dtype, r, cols); };
  const auto rows_sets = per_chunk ? last_chunk_rows_ : std::vector<std::vector<std::int64_t>>{routing_.recv_per_local};
  // Inference (the gradients released): the forward GEMMs only. Offloaded experts: device
  // weights of their shape, as the forward's resident copies are (the yardstick is the GEMM
  // library on device operands).
  const bool training = grads_.w1.defined();
  const bool offloaded = offload_ != ExpertOffload::none;
  const Tensor w1s = offloaded ? scratch(M, H) : Tensor(), w2s = offloaded ? scratch(H, M) : Tensor();
  const auto w1 = [&](std::int64_t l) { return offloaded ? w1s : params_.w1.select(l); };
  const auto w2 = [&](std::int64_t l) { return offloaded ? w2s : params_.w2.select(l); };
  for (const auto& rows : rows_sets)
    for (std::size_t l = 0; l < rows.size(); ++l) {
      const std::int64_t r = rows[l];
      if (r == 0) continue;
      const auto li = static_cast<std::int64_t>(l);
      Tensor t_di = scratch(r, M), t_m = scratch(r, H), t_do = scratch(r, M);
      ps.push_back({false, false, r, H, M, t_di, w1(li), t_m, 1, 0});  // fc1
      ps.push_back({false, false, r, M, H, t_m, w2(li), t_do, 1, 0});  // fc2
      if (!training) continue;
      ps.push_back({false, true, r, H, M, t_do, params_.w2.select(li), scratch(r, H), 1, 0});  // fc2 dgrad
      ps.push_back({true, false, H, M, r, t_m, t_do, grads_.w2.select(li), 1, 1});          // fc2 wgrad
      ps.push_back({true, false, M, H, r, t_di, t_m, grads_.w1.select(li), 1, 1});          // fc1 wgrad
      ps.push_back({false, true, r, M, H, t_m, params_.w1.select(li), scratch(r, M), 1, 0});  // fc1 dgrad
    }
  return ps;
}

std::vector<GemmProblem> MoELayer::expert_floor_problems() {
  const std::int64_t M = cfg_.d_model, H = cfg_.d_hidden, El = local_experts_;
  std::int64_t R = 0;
  for (std::int64_t r : routing_.recv_per_local) R += r;
  if (R == 0 || El == 0) return {};
  const std::int64_t t = (R + El - 1) / El;
  Stream& c = *compute_;
  auto scratch = [&](std::int64_t r, std::int64_t cols) { return yardstick_scratch(b_, c, cfg_.dtype, r, cols); };
  const bool training = grads_.w1.defined();
  // Offloaded experts: one device weight of each shape for every expert, as in
  // expert_gemm_problems (stride 0: the batch reads it El times).
  const bool offloaded = offload_ != ExpertOffload::none;
  const Tensor w1s = offloaded ? scratch(M, H) : Tensor(), w2s = offloaded ? scratch(H, M) : Tensor();
  const auto w1 = [&](std::int64_t l) { return offloaded ? w1s : params_.w1.select(l); };
  const auto w2 = [&](std::int64_t l) { return offloaded ? w2s : params_.w2.select(l); };
  // [El·t, ·]: expert l's rows are [l·t, (l+1)·t).
  const Tensor x = scratch(El * t, M), h = scratch(El * t, H), y = scratch(El * t, M);
  const Tensor dh = training ? scratch(El * t, H) : Tensor(), dx = training ? scratch(El * t, M) : Tensor();
  std::vector<GemmProblem> ps;
  const auto batch = [&](auto make) {
    for (std::int64_t l = 0; l < El; ++l) ps.push_back(make(l, l * t));
  };
  batch([&](std::int64_t l, std::int64_t o) { return GemmProblem{false, false, t, H, M, x.rows(o, t), w1(l), h.rows(o, t), 1, 0}; });
  batch([&](std::int64_t l, std::int64_t o) { return GemmProblem{false, false, t, M, H, h.rows(o, t), w2(l), y.rows(o, t), 1, 0}; });
  if (!training) return ps;
  batch([&](std::int64_t l, std::int64_t o) {  // fc2 dgrad
    return GemmProblem{false, true, t, H, M, y.rows(o, t), params_.w2.select(l), dh.rows(o, t), 1, 0};
  });
  batch([&](std::int64_t l, std::int64_t o) {  // fc2 wgrad
    return GemmProblem{true, false, H, M, t, h.rows(o, t), y.rows(o, t), grads_.w2.select(l), 1, 1};
  });
  batch([&](std::int64_t l, std::int64_t o) {  // fc1 wgrad
    return GemmProblem{true, false, M, H, t, x.rows(o, t), h.rows(o, t), grads_.w1.select(l), 1, 1};
  });
  batch([&](std::int64_t l, std::int64_t o) {  // fc1 dgrad
    return GemmProblem{false, true, t, M, H, h.rows(o, t), params_.w1.select(l), dx.rows(o, t), 1, 0};
  });
  return ps;
}

}  // namespace moelab
