// baselines/deepspeed_tp_ep/deepspeed_tp_ep.cpp — DeepSpeed-MoE's padded, TP-aware expert
// parallelism as a planner on the MoE layer (see deepspeed_tp_ep.hpp).
//   ctest --test-dir build -R "monta|deepspeed"
#include "baselines/deepspeed_tp_ep/deepspeed_tp_ep.hpp"

#include <algorithm>
#include <numeric>

#include "harness/config/json_fields.hpp"
#include "harness/nn/moe_impl.hpp"
#include "harness/runtime/error.hpp"

namespace moelab {

CapacityGeometry CapacityGeometry::make(std::int64_t experts, std::int64_t capacity, int t, int r, int chunks) {
  MOELAB_CHECK(experts >= 1 && capacity >= 1 && t >= 1 && r >= 0 && r < t && chunks >= 1,
               "CapacityGeometry: experts, capacity, TP size and chunks must be positive");
  CapacityGeometry g;
  g.E = experts;
  g.C = capacity;
  g.t = t;
  g.r = r;
  g.n = chunks;
  const std::int64_t unit = static_cast<std::int64_t>(t) * chunks;
  g.Cp = (capacity + unit - 1) / unit * unit;
  g.Cs = g.Cp / unit;
  return g;
}

std::vector<std::int32_t> slice_rows_of(const CapacityGeometry& g, const std::vector<std::int64_t>& sent) {
  std::vector<std::int32_t> map;
  const std::int64_t per_rank = g.Cp / g.t, first = g.r * per_rank;
  for (std::int64_t e = 0; e < g.E; ++e) {
    MOELAB_CHECK(sent[static_cast<std::size_t>(e)] <= g.C, "slice_rows_of: an expert holds more rows than its capacity");
    for (std::int64_t i = 0; i < sent[static_cast<std::size_t>(e)]; ++i) {
      if (i < first || i >= first + per_rank) {
        map.push_back(-1);
        continue;
      }
      const std::int64_t c = (i - first) / g.Cs, j = (i - first) % g.Cs;
      map.push_back(static_cast<std::int32_t>((c * g.E + e) * g.Cs + j));
    }
  }
  return map;
}

std::vector<std::int32_t> gathered_rows_of(const CapacityGeometry& g, const std::vector<std::int64_t>& sent) {
  std::vector<std::int32_t> map;
  const std::int64_t per_rank = g.Cp / g.t;
  for (std::int64_t e = 0; e < g.E; ++e)
    for (std::int64_t i = 0; i < sent[static_cast<std::size_t>(e)]; ++i) {
      const std::int64_t r = i / per_rank, rest = i % per_rank, c = rest / g.Cs, j = rest % g.Cs;
      map.push_back(static_cast<std::int32_t>(((c * g.t + r) * g.E + e) * g.Cs + j));
    }
  return map;
}

namespace {

struct TpSaved final : MoESaved {
  using MoESaved::MoESaved;
  CapacityGeometry geo;
  Tensor map_in, map_out;  // [N,1] int32: T_I rows -> T_Is rows, G rows -> T_O rows
  std::vector<Tensor> t_di, t_m;  // per chunk, for backward
};

TpSaved& tp_saved(MoESaved& sv) {
  auto* s = dynamic_cast<TpSaved*>(&sv);
  MOELAB_CHECK(s != nullptr, "DeepSpeed TP layer: not the saved state of its own forward");
  return *s;
}

Tensor index_tensor(Backend& b, Stream& c, const std::vector<std::int32_t>& v) {
  Tensor t = b.empty({static_cast<std::int64_t>(v.size()), 1}, DType::i32, MemCategory::buffers, c);
  if (b.has_data() && !v.empty()) b.upload_i32(v, t);
  return t;
}

// The issuer's buffers for the chunks and, with a TP group to gather over, each chunk's
// all-gather issued on the TP lane as soon as the exchange that writes the chunk's rows of the
// pass's output (forward: the combine; backward: the dispatch's backward) is done.
class GatherHooks final : public ChunkHooks {
 public:
  GatherHooks(MoELayer& L, TpSaved& sv, bool backward, Communicator* tp)
      : L_(L), sv_(sv), backward_(backward), tp_(tp) {}
  void allocate() override {
    Backend& b = L_.backend();
    Stream& c = L_.compute_stream();
    const ModelConfig& cfg = L_.config();
    const std::int64_t M = cfg.d_model, H = cfg.d_hidden;
    const int n = static_cast<int>(sv_.plan.chunks.size());
    bufs_.assign(static_cast<std::size_t>(n), {});
    if (!backward_) {
      sv_.t_di.assign(static_cast<std::size_t>(n), {});
      sv_.t_m.assign(static_cast<std::size_t>(n), {});
    }
    for (int i = 0; i < n; ++i) {
      const std::int64_t R = sv_.plan.chunks[static_cast<std::size_t>(i)].R;
      ChunkTensors& t = bufs_[static_cast<std::size_t>(i)];
      if (!backward_) {
        t.t_di = sv_.t_di[static_cast<std::size_t>(i)] = b.empty({R, M}, cfg.dtype, MemCategory::activations, c);  // [R,M]
        t.t_m = sv_.t_m[static_cast<std::size_t>(i)] = b.empty({R, H}, cfg.dtype, MemCategory::activations, c);   // [R,H]
        t.t_do = b.empty({R, M}, cfg.dtype, MemCategory::buffers, c);                                            // [R,M]
      } else {
        t.t_di = sv_.t_di[static_cast<std::size_t>(i)];
        t.t_m = sv_.t_m[static_cast<std::size_t>(i)];
        t.d_t_do = b.empty({R, M}, cfg.dtype, MemCategory::buffers, c);
        t.d_t_di = b.empty({R, M}, cfg.dtype, MemCategory::buffers, c);
      }
    }
    if (tp_) gathered = b.empty({sv_.geo.slice_rows() * sv_.geo.t, M}, cfg.dtype, MemCategory::buffers, c);  // G
  }
  ChunkTensors tensors(int i) override { return bufs_[static_cast<std::size_t>(i)]; }
  void output(const Tensor& t) override { out_ = t; }
  std::vector<Stream*> ready() override { return tp_ ? std::vector<Stream*>{&L_.channels().gather()} : std::vector<Stream*>{}; }
  void after(ChunkStep step, int i, const ChunkEvents& e) override {
    if (!tp_ || step != (backward_ ? ChunkStep::dispatch : ChunkStep::combine)) return;
    Stream& gs = L_.channels().gather();
    L_.event_pool().after(gs, ChunkEvents::at(e.out, i));
    PhaseScope ph(L_.backend(), backward_ ? "dispatch" : "combine");
    const std::int64_t rows = sv_.geo.E * sv_.geo.Cs;
    Tensor dst = gathered_rows(i, rows);
    L_.channels().gather_comm().all_gather(gs, out_.rows(i * rows, rows), dst);
  }
  std::vector<Stream*> join() override { return ready(); }
  Tensor gathered;  // G [n·t·E·Cs,M]

 private:
  Tensor gathered_rows(int i, std::int64_t rows) { return gathered.rows(i * rows * sv_.geo.t, rows * sv_.geo.t); }
  MoELayer& L_;
  TpSaved& sv_;
  bool backward_;
  Communicator* tp_;
  Tensor out_;
  std::vector<ChunkTensors> bufs_;
};

}  // namespace

CapacityTpLayer::CapacityTpLayer(Backend& b, Communicator& ep, const ModelConfig& cfg, MoEChannels* channels, TpDispatch how)
    : MoELayer(b, ep, cfg, channels), how_(how) {
  MOELAB_CHECK(how.chunks >= 1, "CapacityTpLayer: chunks must be positive");
  if (!(cfg.capacity_factor > 0.0))
    throw ConfigError("moe.capacity_factor = 0: DeepSpeed's layer pads every expert to a capacity, which needs a "
                      "capacity factor > 0");
  tp_ = channels_->tp();
  if (tp_ && how.dedup) (void)channels_->gather_comm();  // collective over the TP group: now, on every rank
  if (how.two_level) {
    // Nodes of the EP group: the machine's GPUs per node (the sim's cluster model), else one node
    // (cpu and cuda runs on one host). The group must fill whole nodes in rank order.
    const int P = comm_.size();
    const int g = std::min(P, std::max(1, b.machine_rates(1, 1, 1, cfg.dtype).gpus_per_node));
    const auto ranks = comm_.world_ranks();
    for (int q = 0; q < P; ++q)
      if (P % g != 0 || ranks[static_cast<std::size_t>(q)] / g != ranks[0] / g + q / g)
        throw ConfigError("the two-level all-to-all needs the expert-parallel group to fill whole nodes of " +
                          std::to_string(g) + " GPUs in rank order (EP = " + std::to_string(P) + ")");
    gpus_per_node_ = g;
    const int me = comm_.rank();
    for (auto [lane, levels] : {std::pair{dispatch_comm_, &dispatch_levels_}, {combine_comm_, &combine_levels_}}) {
      levels->node = lane->split(me / g, me);
      levels->rail = lane->split(me % g, me);
    }
  }
}

// The two-level exchange of a chunk of the padded layout (every segment Cs rows). Forward
// (src at the send segments, dst at the receive ones): step 1 inside the node, each segment for
// peer p = (node b, local j) to local rank j, which stages it at ((b·g + i)·El + l) for source
// i, expert l; step 2 over the rail, the staged block of node b to rail peer b, which places its
// (i, l) segments where the one-step exchange would have. The reverse runs the steps backwards.
void CapacityTpLayer::exchange(Stream& s, Communicator& comm, const Chunk& ch, const Tensor& src, Tensor& dst, bool reverse) {
  if (!how_.two_level) {
    MoELayer::exchange(s, comm, ch, src, dst, reverse);
    return;
  }
  Levels& lv = &comm == dispatch_comm_ ? dispatch_levels_ : combine_levels_;
  MOELAB_CHECK(&comm == dispatch_comm_ || &comm == combine_comm_, "two-level exchange: not one of the layer's lanes");
  const int g = gpus_per_node_, P = comm_.size(), nodes = P / g;
  const std::int64_t El = local_experts_;
  MOELAB_CHECK(!ch.sends.empty() && ch.sends.size() == static_cast<std::size_t>(P * El) && ch.recvs.size() == ch.sends.size(),
               "two-level exchange: a chunk of the padded layout has El segments per peer");
  const std::int64_t n = ch.sends.front().count;
  for (const Segment& sg : ch.sends) MOELAB_CHECK(sg.count == n, "two-level exchange: segments must be equal");
  Tensor staging = b_.empty({static_cast<std::int64_t>(P) * El * n / cfg_.d_model, cfg_.d_model}, cfg_.dtype,
                            MemCategory::buffers, s);
  // Step 1's segments: to/from local rank j, node b, expert l.
  std::vector<Segment> node_flat, node_staged, rail_block, rail_flat;
  for (std::size_t k = 0; k < ch.sends.size(); ++k) {  // p-major, then l
    const int p = ch.sends[k].peer;
    node_flat.push_back({p % g, ch.sends[k].offset, n});
  }
  for (int i = 0; i < g; ++i)
    for (int b = 0; b < nodes; ++b)
      for (std::int64_t l = 0; l < El; ++l) node_staged.push_back({i, ((b * g + i) * El + l) * n, n});
  // Node b's staged block, contiguous, as the pieces the receiver places one by one (the same
  // bytes in the same order: one message per rail peer).
  for (int b = 0; b < nodes; ++b)
    for (std::int64_t k = 0; k < g * El; ++k) rail_block.push_back({b, (b * g * El + k) * n, n});
  for (const Segment& sg : ch.recvs) rail_flat.push_back({sg.peer / g, sg.offset, n});  // q-major (i within node b), then l
  if (!reverse) {
    lv.node->all_to_all_v(s, src, node_flat, staging, node_staged);
    lv.rail->all_to_all_v(s, staging, rail_block, dst, rail_flat);
  } else {
    lv.rail->all_to_all_v(s, src, rail_flat, staging, rail_block);
    lv.node->all_to_all_v(s, staging, node_staged, dst, node_flat);
  }
}

std::uint64_t CapacityTpLayer::noise_rank() const {
  if (!tp_) return MoELayer::noise_rank();
  const auto ranks = tp_->world_ranks();
  return static_cast<std::uint64_t>(*std::min_element(ranks.begin(), ranks.end()));
}

ChunkPlan CapacityTpLayer::plan_chunks(MoESaved& base) {
  const TpSaved& sv = tp_saved(base);
  const CapacityGeometry& g = sv.geo;
  const std::int64_t P = comm_.size(), El = local_experts_, M = cfg_.d_model, Cs = g.Cs;
  ChunkPlan plan;
  for (int c = 0; c < g.n; ++c) {
    Chunk ch;
    for (std::int64_t p = 0; p < P; ++p)
      for (std::int64_t l = 0; l < El; ++l) {
        const std::int64_t e = p * El + l;
        ch.sends.push_back({static_cast<int>(p), ((c * g.E + e) * Cs) * M, Cs * M});
      }
    for (std::int64_t q = 0; q < P; ++q)
      for (std::int64_t l = 0; l < El; ++l) ch.recvs.push_back({static_cast<int>(q), (l * P + q) * Cs * M, Cs * M});
    for (std::int64_t l = 0; l < El; ++l) {
      ch.rows.push_back(P * Cs);
      ch.offset.push_back(l * P * Cs);
    }
    ch.R = El * P * Cs;
    plan.chunks.push_back(std::move(ch));
  }
  plan.dispatch = {dispatch_, dispatch_comm_};
  plan.combine = {combine_, combine_comm_};
  plan.one_in_flight = false;           // the hooks make the buffers before the pipeline
  plan.lookahead = g.n > 1 ? 1 : 0;     // chunk i+1's dispatch before chunk i's experts
  return plan;
}

Forwarded CapacityTpLayer::forward(const Tensor& x, const WorkKey& key) {
  const std::int64_t T = x.dim(0), M = cfg_.d_model;
  check_input(x);
  MicrobatchScope mb(b_, key.microbatch);
  auto saved = std::make_unique<TpSaved>(key);
  TpSaved& sv = *saved;
  Stream& c = *compute_;
  sv.x = x;
  route(c, sv);
  const bool dedup = how_.dedup && tp_ != nullptr;
  // Every rank of the EP group pads to the same capacity, so that the all-to-all's pieces
  // match: the largest of theirs (ranks with more tokens have more; DeepSpeed's ranks all have
  // the same, and so the same capacity). The gate's own capacity still decides what is kept.
  const auto padded_to = static_cast<std::int64_t>(comm_.all_reduce_max(static_cast<double>(routing_.capacity)));
  int chunks = how_.chunks;
  if (how_.choose) {
    last_choice_ = nlohmann::json::object();
    // Every rank of the EP group must cut its exchanges alike: the largest pick.
    chunks = static_cast<int>(comm_.all_reduce_max(static_cast<double>(how_.choose(padded_to, T, last_choice_))));
  }
  sv.geo = CapacityGeometry::make(cfg_.num_experts, padded_to, dedup ? tp_->size() : 1, dedup ? tp_->rank() : 0,
                                  chunks);
  last_geometry_ = sv.geo;
  const Tensor t_i = dispatch_preprocess(c, sv);  // [N,M] the kept rows, expert-major; the plan
  // Drop: this TP rank's slice of the padded capacity, zero where no token is (the experts
  // compute on those rows, as DeepSpeed's do, and their gradients must not see garbage).
  sv.map_in = index_tensor(b_, c, slice_rows_of(sv.geo, sv.sent));
  sv.map_out = index_tensor(b_, c, gathered_rows_of(sv.geo, sv.sent));
  Tensor t_is = b_.empty({sv.geo.slice_rows(), M}, cfg_.dtype, MemCategory::buffers, c);  // T_Is
  {
    PhaseScope ph(b_, "dispatch");
    b_.fill_zero(c, t_is);
    b_.permute(c, t_i, sv.map_in, t_is);
  }
  GatherHooks hooks(*this, sv, false, dedup ? tp_ : nullptr);
  PassBuffers pass = issue_forward(*this, sv, t_is, &hooks);  // sv.t_o: T_Os
  pass = {};
  Tensor t_o = b_.empty({t_i.dim(0), M}, cfg_.dtype, MemCategory::activations, c);  // [N,M]
  {
    PhaseScope ph(b_, "combine");
    b_.permute_backward(c, dedup ? hooks.gathered : sv.t_o, sv.map_out, t_o);
  }
  sv.t_o = t_o;
  hooks.gathered = Tensor();
  Tensor y = b_.empty({T, M}, cfg_.dtype, MemCategory::activations, c);
  combine_postprocess(c, sv, y);
  return {y, std::move(saved)};
}

Tensor CapacityTpLayer::backward_pass(MoESaved& base, const Tensor& dy, float grad_aux, bool defer) {
  TpSaved& sv = tp_saved(base);
  const std::int64_t T = sv.x.dim(0), M = cfg_.d_model, N = sv.t_o.dim(0);
  const bool dedup = sv.geo.t > 1;
  Stream& c = *compute_;
  Tensor d_w = b_.empty({T, cfg_.top_k}, DType::f32, MemCategory::buffers, c);  // [T,k]
  Tensor d_t_os = b_.empty({sv.geo.slice_rows(), M}, cfg_.dtype, MemCategory::buffers, c);
  {
    Tensor d_t_o = b_.empty({N, M}, cfg_.dtype, MemCategory::buffers, c);  // [N,M]
    combine_postprocess_backward(c, sv, dy, d_t_o, d_w);
    // The slice of dT_O (the same on every TP rank: the mirror of the all-gather is a slice).
    PhaseScope ph(b_, "combine");
    b_.fill_zero(c, d_t_os);
    b_.permute(c, d_t_o, sv.map_in, d_t_os);
  }
  GatherHooks hooks(*this, sv, true, dedup ? tp_ : nullptr);
  PassBuffers pass = issue_backward(*this, sv, d_t_os, defer, &hooks);  // pass.d_t_i: dT_Is
  Tensor d_t_i = b_.empty({N, M}, cfg_.dtype, MemCategory::buffers, c);  // [N,M]
  {
    PhaseScope ph(b_, "dispatch");
    b_.permute_backward(c, dedup ? hooks.gathered : pass.d_t_i, sv.map_out, d_t_i);
  }
  pass = {};
  hooks.gathered = Tensor();
  sv.t_di.clear();
  sv.t_m.clear();
  Tensor dx = b_.empty({T, M}, cfg_.dtype, MemCategory::activations, c);
  dispatch_preprocess_backward(c, sv, d_t_i, dx);
  route_backward(c, sv, d_w, grad_aux, dx, defer);
  return dx;
}

void check_capacity_model(const std::string& impl, const ModelConfig& m) {
  if (!(m.capacity_factor > 0.0))
    throw ConfigError(impl + ": moe.capacity_factor = 0, but DeepSpeed's layer pads every expert to a capacity "
                      "(ceil(k·cf·T/E) rows): give the model a capacity factor > 0");
}

namespace {

// The baselines on the padded layout: one class, the variant as data.
struct Variant {
  std::string name;
  std::string schedule;  // for the report
  TpDispatch how;
};

class DeepSpeedTp final : public LayerBackedImpl<CapacityTpLayer> {
 public:
  DeepSpeedTp(Backend& b, Communicator& c, const ModelConfig& m, MoEChannels* channels, const Variant& v)
      : LayerBackedImpl(b, c, m, channels, v.how), v_(v) {}
  std::string name() const override { return v_.name; }
  std::vector<GemmProblem> expert_gemms() override { return layer_.expert_gemm_problems(false); }
  bool tp_deduplicated() const override { return v_.how.dedup; }
  nlohmann::json report() override {
    const CapacityGeometry& g = layer_.geometry();
    return {{"schedule", v_.schedule}, {"tp", layer_.tp_size()}, {"capacity", g.C}, {"padded_capacity", g.Cp}, {"chunks", 1}};
  }

 private:
  Variant v_;
};

void check_no_options(const std::string& name, const nlohmann::json& options) {
  if (!options.is_null() && !(options.is_object() && options.empty()))
    throw ConfigError(name + " takes no options, got " + json_fields::show(options));
}

}  // namespace

void register_deepspeed_tp_ep() {
  const Variant variants[] = {
      {"deepspeed-tp", "DeepSpeed-MoE under TP: every TP rank sends the whole padded capacity tensor", TpDispatch{false, 1, {}, false}},
      {"deepspeed-drop", "DeepSpeed-MoE, TP-deduplicated: drop, all-to-all, all-gather over TP (unchunked)",
       TpDispatch{true, 1, {}, false}},
      // The flat all-to-all's NIC bytes in g times fewer messages (impls/monta/strategy.hpp,
      // Strategy::hierarchical).
      {"hierarchical", "the padded capacity tensor of every TP rank in a two-level all-to-all: inside the node, then over "
                       "the rails (Tutel's 2DH)", TpDispatch{false, 1, {}, true}},
  };
  for (const Variant& v : variants)
    register_impl(
        v.name,
        [v](Backend& b, Communicator& c, const ModelConfig& m, const nlohmann::json& options, MoEChannels* channels) {
          check_no_options(v.name, options);
          return std::unique_ptr<MoEImpl>(std::make_unique<DeepSpeedTp>(b, c, m, channels, v));
        },
        [v](const nlohmann::json& options, const ImplCheckContext& run) {
          check_no_options(v.name, options);
          check_capacity_model(v.name, run.model);
        });
}

}  // namespace moelab
