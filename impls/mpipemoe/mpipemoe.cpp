// impls/mpipemoe/mpipemoe.cpp — see mpipemoe.hpp. Sections follow the data:
//   1. the partition plan: which rows of T_I each partition sends where (host); the chunks the
//      harness's issuer runs as S_p / C_p / R_p on three streams (harness/nn/moe_schedule.hpp)
//   2. memory reuse (§III-C) and the restore strategies S1–S4 (§III-D): the issuer's hooks,
//      forward and backward
//   3. the layer: the granularity search (§III-B, Algorithm 1), the strategy of a forward
//      (fixed, or chosen by Eq. 10, §III-E)
//   4. options and registration
#include "impls/mpipemoe/mpipemoe.hpp"

#include <algorithm>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <span>
#include <sstream>

#include "harness/config/json_fields.hpp"
#include "harness/runtime/error.hpp"
#include "impls/mpipemoe/granularity.hpp"
#include "impls/mpipemoe/memory_model.hpp"
#include "impls/mpipemoe/strategy.hpp"

namespace moelab {
namespace {

// What a forward with n partitions leaves for its backward: the layer's (MoESaved) and, with
// memory reuse (§III-C), the rotating buffers sized for the largest partition — two for T_DI,
// one for T_M (two with t_m_buffers = 2) — and the offloaded copies, which live from forward to
// backward. Partition p uses T_DI[p % 2] and T_M[p % nm].
struct MPipeSaved final : MoESaved {
  MPipeSaved(const WorkKey& k, int parts, std::string s) : MoESaved(k), n(parts), strategy(std::move(s)) {}
  int n;
  std::string strategy;                 // "none" or S1..S4
  std::int64_t r_max = 0;               // rows of the largest partition
  Tensor t_di[2];                       // [r_max,M] activations (the restored T_DI in backward)
  Tensor t_m[2];                        // [r_max,H] activations (the restored T_M in backward)
  int nm = 1;                           // T_M buffers in use
  std::vector<Tensor> host_di, host_m;  // [R_p,M] / [R_p,H] pinned host, per partition (offload)
};

// Options of the strategy choice. Eq. 10's figures and the budgets come, in this order, from
// an explicit option, the backend's machine model (sim: the cluster model and calibration
// profile), a measurement (the GEMM rate, by time_bare_gemms), or default_throughputs().
struct StrategyOptions {
  std::string strategy = "none";    // none, S1..S4, auto
  int t_m_buffers = 1;              // 1: the paper's one T_M; 2: double-buffered when T_M is offloaded
                                    // (S1, S2; not in the paper)
  std::optional<double> comp_flops, comm_bytes, mem_bytes, sigma, mu, eta;  // options
  std::optional<double> host_bytes, device_bytes;  // host_memory_gb / memory_gb
};

// The figures Eq. 10 used for one partition size, each with where it came from.
struct Rates {
  Throughputs w;
  MemoryBudget budget;
  std::map<std::string, std::string> source;  // figure -> "option", the machine model, ...
};

}  // namespace

class MPipeMoELayer final : public MoELayer {
 public:
  MPipeMoELayer(Backend& b, Communicator& c, const ModelConfig& m, int fixed_n, int max_n, std::int64_t min_rows,
                StrategyOptions so, MoEChannels* channels)
      : MoELayer(b, c, m, channels), fixed_n_(fixed_n), search_(max_n, min_rows), so_(std::move(so)) {}

  nlohmann::json report() {
    nlohmann::json r = {{"schedule", so_.strategy == "none" ? "MPipeMoE pipelining (no memory reuse)"
                                                            : "MPipeMoE pipelining with memory reuse"},
                        {"partitions", fixed_n_ > 0 ? nlohmann::json(fixed_n_) : nlohmann::json("auto")},
                        {"last_n", last_n_},
                        {"strategy", so_.strategy},
                        {"t_m_buffers", so_.t_m_buffers},
                        {"granularity_search", search_.report()}};
    if (!strategy_.empty()) {
      r["last_strategy"] = strategy_;
      // §III-C's model for the last forward (one rank's view, B = T·k), bytes.
      r["memory_model"] = {{"paper_act_plus_buf_bytes", memory_.paper_bytes},
                           {"predicted_act_plus_buf_bytes", memory_.predicted_bytes},
                           {"host_pinned_bytes", memory_.host_bytes},
                           {"saving_ratio_phi", memory_.phi}};
    }
    if (so_.strategy != "none" && last_n_ == 1)
      r["note"] = "memory reuse with n = 1 saves nothing: one partition has nothing to rotate with";
    if (!costs_.empty()) {
      nlohmann::json all = nlohmann::json::object();
      for (const auto& c : costs_)
        all[c.strategy] = {{"cost_s", c.cost_s}, {"comp_s", c.comp_s}, {"comm_s", c.comm_s}, {"mem_s", c.mem_s},
                           {"device_bytes", c.device_bytes}, {"host_bytes", c.host_bytes}, {"fits", c.fits},
                           {"tied", c.tied}};
      r["strategy_costs"] = all;  // Eq. 10 per strategy, per partition, forward + backward
      // Ties (strategy.hpp, kTieRule): which strategies cost the chosen one's cost, and the rule
      // that picked among them.
      nlohmann::json tied = nlohmann::json::array();
      for (const auto& c : costs_)
        if (c.tied) tied.push_back(c.strategy);
      r["strategy_tie"] = {{"tied", tied}, {"rule", kTieRule}};
      for (const auto& c : costs_)
        if (c.strategy == strategy_) r["chosen_cost_s"] = c.cost_s;
      const Rates& w = rates_.at(rates_key_);
      r["throughputs"] = {{"comp_flops", w.w.comp_flops}, {"comm_bytes", w.w.comm_bytes},
                          {"mem_bytes", w.w.mem_bytes}, {"sigma", w.w.sigma}, {"mu", w.w.mu},
                          {"eta", w.w.eta}, {"source", w.source}};
      r["budget"] = {{"device_bytes", w.budget.device_bytes}, {"host_bytes", w.budget.host_bytes}};
    }
    return r;
  }

  Forwarded forward(const Tensor& x, const WorkKey& key) override {
    check_input(x);
    const std::int64_t T = x.dim(0);
    int n = fixed_n_;
    bool searched = false;  // this forward ran trials
    if (n <= 0) {
      // Ranks may hold different token counts; the search and its bounds must see one value on
      // every rank, or they would run different numbers of trials: the smallest count. Trials
      // are forwards of this very work (its key: the gate noise is the forward's).
      const auto B = static_cast<std::int64_t>(-comm_.all_reduce_max(-static_cast<double>(T)));
      n = search_.choose(B, [&](int trial_n) {
        searched = true;
        return trial(x, key, trial_n);
      });
    }
    if (n > std::max<std::int64_t>(T, 1))
      throw ConfigError("mpipemoe: partitions = " + std::to_string(n) + " leaves partitions without a token for " +
                        std::to_string(T) + " tokens per rank");
    Forwarded f = pipelined_forward(x, key, n);
    if (searched) {
      // The trials' offload buffers (pinned host memory for S1/S3, of every trial n's sizes)
      // went back to the backend's host pool, which caches them for reuse: gigabytes for a
      // large layer that no later step of this n asks for. Give them back to the driver once,
      // here, where the search has already synchronised the device several times.
      b_.release_cached_host_memory();
    }
    return f;
  }

  const StrategyOptions& options() const { return so_; }

 private:
  ChunkPlan plan_chunks(MoESaved& sv) override;
  bool keeps_t_i(const MoESaved& sv) const override {
    return recommunicates(static_cast<const MPipeSaved&>(sv).strategy);
  }
  // Weight gradients in the combined pass: the memory reuse and restore strategies are
  // defined for it (backward_weight has nothing left to do).
  bool defers_weight_gradients() const override { return false; }
  bool steps_drivable() const override { return false; }  // its own pass: search, strategies
  Tensor backward_pass(MoESaved& sv, const Tensor& dy, float grad_aux, bool defer) override;
  Forwarded pipelined_forward(const Tensor& x, const WorkKey& key, int n);
  // The strategy of this forward: the fixed one, or Eq. 10's choice; host memory checked.
  void resolve_strategy(std::int64_t T, int n);
  // Eq. 10's throughputs and the memory budgets for partitions of b rows (cached per b).
  // agree: every rank calls it at once and all take the smallest figures.
  const Rates& rates_for(std::int64_t b, bool agree);
  // One timed forward at n (the granularity search's trial), the same on every rank.
  double trial(const Tensor& x, const WorkKey& key, int n) {
    // An n at which no restore strategy fits the memory budget is no candidate, not the end of
    // the run. The verdict is the same on every rank: under "auto" the choice is made from the
    // figures the ranks agree on, before any work is issued.
    try {
      resolve_strategy(x.dim(0), n);
    } catch (const OutOfMemory&) {
      return std::numeric_limits<double>::infinity();
    }
    b_.synchronize();  // work queued before the trial (zero fills, say) is not the trial's
    comm_.barrier();
    // Under sequence parallelism each forward's gate sums its counts over the TP group, whose
    // ranks must run the same forwards; the trials are agreed over the expert-parallel group
    // only, so TP ranks in different EP groups may run different numbers of them. A trial's
    // output is discarded: it routes on this rank's rows alone.
    struct Unpartitioned {
      MoELayer& layer;
      Communicator* group;
      ~Unpartitioned() { layer.partition_sequence(group); }
    } restore{*this, sequence_group()};
    partition_sequence(nullptr);
    const double t0 = b_.now();
    trial_state_ = pipelined_forward(x, key, n).saved;
    b_.synchronize();
    comm_.barrier();
    return comm_.all_reduce_max(b_.now() - t0);
  }

  int fixed_n_;
  GranularitySearch search_;
  // What the last trial's forward saved, held until the next forward has resolved its strategy:
  // the memory budget Eq. 10's choice sees is the device's capacity less what is in use then.
  SavedPtr trial_state_;
  StrategyOptions so_;
  std::string strategy_;                 // of the last forward ("none" or S1..S4)
  int last_n_ = 1;                       // partitions of the last forward
  std::vector<StrategyCost> costs_;      // Eq. 10 of the last forward, S1–S4
  std::map<std::int64_t, Rates> rates_;  // by partition rows
  std::int64_t rates_key_ = 0;           // of the last forward
  MemoryPrediction memory_;              // the memory model of the last forward's strategy
  // The memory model of strategy s for T tokens on this rank; b_max: the largest partition's
  // rows (0: the model's ceil(T/n)·k, before the routing is known).
  MemoryPrediction predict(const std::string& s, std::int64_t T, int n, std::int64_t b_max = 0) const {
    return predict_memory({.T = T, .top_k = cfg_.top_k, .E = cfg_.num_experts, .M = cfg_.d_model,
                           .H = cfg_.d_hidden, .n = n, .strategy = s,
                           .elem_bytes = static_cast<double>(dtype_size(cfg_.dtype)), .b_max = b_max,
                           .local_experts = local_experts_, .t_m_buffers = so_.t_m_buffers,
                           .noisy_gate = cfg_.noisy_gate});
  }
};

// ---- 1. the partition plan ----------------------------------------------------------------
// Partition p holds tokens [p*T/n, (p+1)*T/n). In T_I (expert-major; within an expert, by
// choice j then token t) the rows of one (partition, expert, choice) are contiguous, so a
// partition's dispatch is a list of contiguous segments of the global T_I: no extra copy.
// From the gate's routing (sv: topk_idx, slot) — on a backend without data (sim) each expert's
// rows are split evenly across the partitions.
ChunkPlan MPipeMoELayer::plan_chunks(MoESaved& s) {
  const MPipeSaved& sv = static_cast<const MPipeSaved&>(s);
  const int n = sv.n;
  const std::int64_t T = sv.x.dim(0);
  const std::int64_t E = cfg_.num_experts, El = local_experts_, M = cfg_.d_model;
  const int k = cfg_.top_k, ep = comm_.size();
  const auto& sent = sv.sent;
  std::vector<std::int64_t> expert_start(static_cast<std::size_t>(E), 0);
  std::exclusive_scan(sent.begin(), sent.end(), expert_start.begin(), std::int64_t{0});
  auto part_of = [&](std::int64_t t) { return static_cast<int>(t * n / std::max<std::int64_t>(T, 1)); };

  // [p][e][j] -> (first row in T_I, count)
  const auto idx3 = [&](int p, std::int64_t e, int j) {
    return (static_cast<std::size_t>(p) * static_cast<std::size_t>(E) + static_cast<std::size_t>(e)) *
               static_cast<std::size_t>(k) + static_cast<std::size_t>(j);
  };
  std::vector<std::int64_t> first(static_cast<std::size_t>(n) * E * k, -1), count(first.size(), 0);
  if (b_.has_data()) {
    const auto idx = b_.download_i32(sv.topk_idx), slot = b_.download_i32(sv.slot);
    for (std::int64_t t = 0; t < T; ++t)
      for (int j = 0; j < k; ++j) {
        const std::int32_t r = slot[static_cast<std::size_t>(t * k + j)];
        if (r < 0) continue;
        const std::size_t i = idx3(part_of(t), idx[static_cast<std::size_t>(t * k + j)], j);
        if (first[i] < 0) first[i] = r;
        ++count[i];
      }
  } else {
    for (std::int64_t e = 0; e < E; ++e) {  // even split, choice 0 only (shapes only)
      std::int64_t row = expert_start[static_cast<std::size_t>(e)];
      for (int p = 0; p < n; ++p) {
        const std::int64_t c = sent[static_cast<std::size_t>(e)] * (p + 1) / n - sent[static_cast<std::size_t>(e)] * p / n;
        first[idx3(p, e, 0)] = row;
        count[idx3(p, e, 0)] = c;
        row += c;
      }
    }
  }
  // Counts to every peer: block q holds [p][l][j] for q's experts; one exchange for all p.
  std::vector<std::int64_t> send_counts;
  send_counts.reserve(static_cast<std::size_t>(ep * n * El * k));
  for (int q = 0; q < ep; ++q)
    for (int p = 0; p < n; ++p)
      for (std::int64_t l = 0; l < El; ++l)
        for (int j = 0; j < k; ++j) send_counts.push_back(count[idx3(p, q * El + l, j)]);
  const auto recv = comm_.exchange_counts(send_counts);
  auto recv_at = [&](int q, int p, std::int64_t l, int j) {
    return recv[((static_cast<std::size_t>(q) * n + static_cast<std::size_t>(p)) * static_cast<std::size_t>(El) +
                 static_cast<std::size_t>(l)) * static_cast<std::size_t>(k) + static_cast<std::size_t>(j)];
  };

  ChunkPlan plan;
  plan.chunks.resize(static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) {
    Chunk& P = plan.chunks[static_cast<std::size_t>(p)];
    P.rows.assign(static_cast<std::size_t>(El), 0);
    for (int q = 0; q < ep; ++q)
      for (std::int64_t l = 0; l < El; ++l)
        for (int j = 0; j < k; ++j) P.rows[static_cast<std::size_t>(l)] += recv_at(q, p, l, j);
    P.offset.assign(static_cast<std::size_t>(El), 0);
    std::exclusive_scan(P.rows.begin(), P.rows.end(), P.offset.begin(), std::int64_t{0});
    P.R = std::accumulate(P.rows.begin(), P.rows.end(), std::int64_t{0});
    // Both sides list, per peer, (local expert, choice) in the same order, so they match.
    std::vector<std::int64_t> fill = P.offset;
    for (int q = 0; q < ep; ++q)
      for (std::int64_t l = 0; l < El; ++l)
        for (int j = 0; j < k; ++j) {
          const std::size_t i = idx3(p, q * El + l, j);
          if (count[i] > 0) P.sends.push_back({q, first[i] * M, count[i] * M});
          const std::int64_t nr = recv_at(q, p, l, j);
          if (nr > 0) P.recvs.push_back({q, fill[static_cast<std::size_t>(l)] * M, nr * M});
          fill[static_cast<std::size_t>(l)] += nr;
        }
  }
  // S on the dispatch stream and channel, R on the combine stream and channel (§III-A).
  plan.dispatch = {dispatch_, dispatch_comm_};
  plan.combine = {combine_, combine_comm_};
  return plan;
}

// ---- 2. memory reuse (§III-C) and the restore strategies (§III-D) ------------------------------
// Partition p uses rotating buffer p % 2 of T_DI, T_DO (and in backward dT_DI, dT_DO) and
// T_M[p % nm]. A buffer is overwritten only after its previous user finished, by events:
//   forward   S_p  (dispatch) waits C_{p-2} and the offload of T_DI_{p-2}  (T_DI[p%2])
//             C_p  (compute)  waits S_p, R_{p-2} (T_DO[p%2]) and the offload of T_M_{p-nm} (T_M)
//             R_p  (combine)  waits C_p;   offloads (d2h) wait S_p / C_p
//   backward  restore T_DI_p (h2d copy or dispatch re-run) waits C'_{p-2}; restore T_M_p (h2d)
//             waits C'_{p-nm}; R'_p waits C'_{p-2} (dT_DO[p%2]); C'_p waits R'_p, the restores
//             and S'_{p-2} (dT_DI[p%2]); S'_p waits C'_p.
// Every wait points at work issued earlier, so no stream can wait on a later one. The issuer
// (harness/nn/moe_schedule.hpp) issues S, C, R and the waits on each other's events; what is
// MPipeMoE's — the buffers, the offloads and restores, the extra waits — are these hooks.
namespace {
const auto at = ChunkEvents::at;

// Forward: T_DI_p and T_M_p into the rotating buffers, offloaded where the strategy says (S1:
// both, S2: T_M, S3: T_DI) to pinned host memory on the d2h stream.
class ReuseForward final : public ChunkHooks {
 public:
  ReuseForward(MPipeMoELayer& L, MPipeSaved& sv)
      : L_(L), sv_(sv), b_(L.backend()), c_(L.compute_stream()), ev_(L.event_pool()),
        off_di_(offloads_t_di(sv.strategy)), off_m_(offloads_t_m(sv.strategy)) {}

  // (The plan exists from here on: dispatch_preprocess made it.)
  void allocate() override {
    L_.channels().host_to_device();  // the host-copy streams are made on first use, in this order
    d2h_ = &L_.channels().device_to_host();
    di_saved_.assign(sv_.plan.chunks.size(), nullptr);
    m_saved_.assign(sv_.plan.chunks.size(), nullptr);
    const ModelConfig& cfg = L_.config();
    const std::int64_t M = cfg.d_model, H = cfg.d_hidden;
    const int n = sv_.n, nb = std::min(n, 2);
    for (const Chunk& P : sv_.plan.chunks) sv_.r_max = std::max(sv_.r_max, P.R);
    for (int i = 0; i < nb; ++i) {
      sv_.t_di[i] = b_.empty({sv_.r_max, M}, cfg.dtype, MemCategory::activations, c_);  // [r_max,M]
      t_do_[i] = b_.empty({sv_.r_max, M}, cfg.dtype, MemCategory::buffers, c_);         // [r_max,M]
    }
    sv_.nm = off_m_ ? std::min(nb, L_.options().t_m_buffers) : 1;  // a second T_M helps only its offload
    for (int i = 0; i < sv_.nm; ++i)
      sv_.t_m[i] = b_.empty({sv_.r_max, H}, cfg.dtype, MemCategory::activations, c_);    // [r_max,H]
    for (const Chunk& P : sv_.plan.chunks) {  // pinned host copies, [R_p,M] / [R_p,H]
      if (off_di_)
        sv_.host_di.push_back(b_.empty({P.R, M}, cfg.dtype, MemCategory::host_pinned, c_, MemSpace::host_pinned));
      if (off_m_)
        sv_.host_m.push_back(b_.empty({P.R, H}, cfg.dtype, MemCategory::host_pinned, c_, MemSpace::host_pinned));
    }
  }
  ChunkTensors tensors(int p) override {
    const std::int64_t R = sv_.plan.chunks[static_cast<std::size_t>(p)].R;
    return {sv_.t_di[p % 2].rows(0, R), sv_.t_m[p % sv_.nm].rows(0, R), t_do_[p % 2].rows(0, R), {}, {}};
  }
  std::vector<Stream*> ready() override { return {d2h_}; }
  void before(ChunkStep step, int p, const ChunkEvents& e) override {
    if (step == ChunkStep::dispatch) {  // S_p overwrites T_DI[p%2]:
      ev_.after(*sv_.plan.dispatch.stream, at(e.computed, p - 2));  // C_{p-2} has read it
      ev_.after(*sv_.plan.dispatch.stream, at(di_saved_, p - 2));   // and its offload has copied it out
    } else if (step == ChunkStep::experts) {
      ev_.after(c_, at(e.out, p - 2));          // R_{p-2} has sent T_DO[p%2]
      ev_.after(c_, at(m_saved_, p - sv_.nm));  // the offload of T_M_{p-nm} has copied this T_M out
    }
  }
  void after(ChunkStep step, int p, const ChunkEvents& e) override {
    const auto i = static_cast<std::size_t>(p);
    if (step == ChunkStep::dispatch && off_di_) {  // S1, S3: T_DI_p -> pinned host [R_p,M]
      PhaseScope ph(b_, "offload");
      ev_.after(*d2h_, e.in[i]);
      b_.copy(*d2h_, tensors(p).t_di, sv_.host_di[i]);
      di_saved_[i] = ev_.mark(*d2h_);
    } else if (step == ChunkStep::experts && off_m_) {  // S1, S2: T_M_p -> pinned host [R_p,H]
      PhaseScope ph(b_, "offload");
      ev_.after(*d2h_, e.computed[i]);
      b_.copy(*d2h_, tensors(p).t_m, sv_.host_m[i]);
      m_saved_[i] = ev_.mark(*d2h_);
    }
  }
  std::vector<Stream*> join() override { return {d2h_}; }  // the offloads
  void finish() override { t_do_[0] = t_do_[1] = Tensor(); }

 private:
  MPipeMoELayer& L_;
  MPipeSaved& sv_;
  Backend& b_;
  Stream& c_;
  EventPool& ev_;
  const bool off_di_, off_m_;
  Stream* d2h_ = nullptr;
  Tensor t_do_[2];  // [r_max,M] rotating
  std::vector<Event*> di_saved_, m_saved_;  // per partition: its offload is done
};

// Backward: T_DI_p and T_M_p restored into the rotating buffers before C'_p — T_DI fetched from
// the host (S1, S3) or sent again from the kept T_I (S2, S4), T_M fetched (S1, S2) or recomputed
// by FC1 from the restored T_DI (S3, S4) — each restore prefetched under C'_{p-1} where its
// buffer allows.
class ReuseBackward final : public ChunkHooks {
 public:
  ReuseBackward(MPipeMoELayer& L, MPipeSaved& sv)
      : L_(L), sv_(sv), b_(L.backend()), c_(L.compute_stream()), ev_(L.event_pool()),
        h2d_(L.channels().host_to_device()), off_di_(offloads_t_di(sv.strategy)), off_m_(offloads_t_m(sv.strategy)),
        recomm_(recommunicates(sv.strategy)), recomp_(recomputes(sv.strategy)),
        prefetch_m_(off_m_ && sv.nm == 2),  // with one T_M its restore waits for C'_{p-1}
        di_back_(sv.plan.chunks.size()), m_back_(sv.plan.chunks.size()) {}

  void allocate() override {  // rotating gradient buffers [r_max,M]
    const ModelConfig& cfg = L_.config();
    for (int i = 0; i < std::min(sv_.n, 2); ++i) {
      d_t_do_[i] = b_.empty({sv_.r_max, cfg.d_model}, cfg.dtype, MemCategory::buffers, c_);
      d_t_di_[i] = b_.empty({sv_.r_max, cfg.d_model}, cfg.dtype, MemCategory::buffers, c_);
    }
  }
  ChunkTensors tensors(int p) override {
    const std::int64_t R = sv_.plan.chunks[static_cast<std::size_t>(p)].R;
    return {sv_.t_di[p % 2].rows(0, R), sv_.t_m[p % sv_.nm].rows(0, R), {}, d_t_do_[p % 2].rows(0, R),
            d_t_di_[p % 2].rows(0, R)};
  }
  std::vector<Stream*> ready() override { return {sv_.plan.dispatch.stream, &h2d_}; }
  void start(const ChunkEvents& e) override {
    restore_di(0, e);
    if (prefetch_m_) restore_m(0, e);
  }
  void before(ChunkStep step, int p, const ChunkEvents& e) override {
    if (step == ChunkStep::combine) {  // R'_p overwrites dT_DO[p%2]: C'_{p-2} has read it
      ev_.after(*sv_.plan.combine.stream, at(e.computed, p - 2));
    } else if (step == ChunkStep::experts) {
      ev_.after(c_, di_back_[static_cast<std::size_t>(p)]);
      ev_.after(c_, m_back_[static_cast<std::size_t>(p)]);
      ev_.after(c_, at(e.out, p - 2));  // S'_{p-2} has sent dT_DI[p%2]
      // S3, S4: T_M recomputed from the restored T_DI by the forward's FC1: bit for bit where
      // the forward ran FC1 alone; to rounding where it fused the activation into the GEMM's
      // epilogue (cuBLASLt's GELU_AUX, gelu_tanh on cuda: another kernel for the same product)
      if (recomp_) {
        ChunkTensors t = tensors(p);
        L_.expert_fc1(c_, sv_.plan.chunks[static_cast<std::size_t>(p)], t.t_di, t.t_m, "fc1_recompute");
      }
    }
  }
  void after(ChunkStep step, int p, const ChunkEvents& e) override {
    if (step != ChunkStep::combine) return;
    // T_M_p first where C'_p waits for it (S1: its one T_M buffer, free only once C'_{p-1} has
    // read it): on the one in-order h2d stream, a prefetch queued before it would delay C'_p.
    if (off_m_ && !prefetch_m_) restore_m(p, e);
    if (p + 1 < sv_.n) restore_di(p + 1, e);  // prefetch: overlaps C'_p
    if (prefetch_m_ && p + 1 < sv_.n) restore_m(p + 1, e);
  }
  std::vector<Stream*> join() override { return {&h2d_}; }
  void finish() override { d_t_do_[0] = d_t_do_[1] = d_t_di_[0] = d_t_di_[1] = Tensor(); }

 private:
  // T_DI_p into T_DI[p%2]: S1/S3 fetch the host copy, S2/S4 re-run S_p from the kept T_I.
  void restore_di(int p, const ChunkEvents& e) {
    const auto i = static_cast<std::size_t>(p);
    Tensor di = tensors(p).t_di;
    if (off_di_) {
      PhaseScope ph(b_, "fetch");
      ev_.after(h2d_, at(e.computed, p - 2));  // C'_{p-2} has read this buffer
      b_.copy(h2d_, sv_.host_di[i], di);
      di_back_[i] = ev_.mark(h2d_);
    } else if (recomm_) {  // the forward's S_p again
      Stream& ds = *sv_.plan.dispatch.stream;
      ev_.after(ds, at(e.computed, p - 2));
      L_.dispatch(ds, *sv_.plan.dispatch.comm, sv_.t_i, sv_.plan.chunks[i], di);
      di_back_[i] = ev_.mark(ds);
    }
  }
  // T_M_p into T_M[p%nm]: S1/S2 fetch the host copy (S3/S4 recompute it in C'_p).
  void restore_m(int p, const ChunkEvents& e) {
    const auto i = static_cast<std::size_t>(p);
    PhaseScope ph(b_, "fetch");
    ev_.after(h2d_, at(e.computed, p - sv_.nm));  // C'_{p-nm} has read this T_M
    Tensor m = tensors(p).t_m;
    b_.copy(h2d_, sv_.host_m[i], m);
    m_back_[i] = ev_.mark(h2d_);
  }

  MPipeMoELayer& L_;
  MPipeSaved& sv_;
  Backend& b_;
  Stream& c_;
  EventPool& ev_;
  Stream& h2d_;
  const bool off_di_, off_m_, recomm_, recomp_, prefetch_m_;
  Tensor d_t_do_[2], d_t_di_[2];  // [r_max,M] rotating
  std::vector<Event*> di_back_, m_back_;  // per partition: restored
};
}  // namespace

// ---- 3. the layer: a forward at n partitions, its backward, the strategy -----------------------
Forwarded MPipeMoELayer::pipelined_forward(const Tensor& x, const WorkKey& key, int n) {
  resolve_strategy(x.dim(0), n);  // before any work: a host budget that does not fit is a ConfigError
  trial_state_.reset();
  last_n_ = n;
  auto saved = std::make_unique<MPipeSaved>(key, n, strategy_);
  MPipeSaved& sv = *saved;
  Forwarded f;
  if (sv.strategy == "none") {
    f = run_forward(x, std::move(saved));
  } else {
    ReuseForward hooks(*this, sv);
    f = run_forward(x, std::move(saved), &hooks);
  }
  // The report's prediction for the partitions the routing made: the rows this rank's experts
  // received in the largest one (a sim run without data splits each expert's rows evenly,
  // the rounding of every expert in the last partition; a multi-rank run receives what the
  // peers route), not the model's ceil(T/n)·k.
  std::int64_t r_max = 0;
  for (const Chunk& P : sv.plan.chunks) r_max = std::max(r_max, P.R);
  if (r_max > 0) memory_ = predict(strategy_, x.dim(0), n, r_max);
  return f;
}

Tensor MPipeMoELayer::backward_pass(MoESaved& s, const Tensor& dy, float grad_aux, bool) {
  MPipeSaved& sv = static_cast<MPipeSaved&>(s);
  if (sv.strategy == "none") return run_backward(sv, dy, grad_aux, false);
  ReuseBackward hooks(*this, sv);
  return run_backward(sv, dy, grad_aux, false, &hooks);
}

void MPipeMoELayer::resolve_strategy(std::int64_t T_local, int n) {
  const std::int64_t M = cfg_.d_model, H = cfg_.d_hidden;
  // Every rank must run the same strategy (S2/S4 add collectives). Under "auto" the choice is
  // made for the largest token count over ranks (its memory must fit everywhere) from rates
  // the ranks agree on (rates_for); a fixed strategy needs no agreement.
  const bool agree = so_.strategy == "auto" && comm_.size() > 1;
  const std::int64_t T = agree ? static_cast<std::int64_t>(comm_.all_reduce_max(static_cast<double>(T_local))) : T_local;
  auto need = [&](const std::string& s, std::int64_t tokens) { return predict(s, tokens, n); };
  strategy_ = so_.strategy;
  costs_.clear();
  if (strategy_ == "none") {
    memory_ = need(strategy_, T_local);
    return;
  }
  // Eq. 10 for a partition of b = T·k/n rows, memory needs from the memory model: the choice
  // under "auto", and for the report under a fixed strategy.
  std::array<MemoryNeed, 4> needs;
  for (std::size_t i = 0; i < needs.size(); ++i) {
    const auto pr = need(strategy_names()[i + 1], T);
    needs[i] = {pr.predicted_bytes, pr.host_bytes};
  }
  const double b = static_cast<double>(T * cfg_.top_k) / n, eb = static_cast<double>(dtype_size(cfg_.dtype));
  const double Md = static_cast<double>(M), Hd = static_cast<double>(H);
  rates_key_ = (T * cfg_.top_k + n - 1) / n;
  const Rates& r = rates_for(rates_key_, agree);
  if (so_.strategy == "auto") {
    strategy_ = choose_strategy(r.w, b, Md, Hd, r.budget, needs, &costs_, eb);
    memory_ = need(strategy_, T_local);
    return;
  }
  choose_strategy(r.w, b, Md, Hd, MemoryBudget{}, needs, &costs_, eb);
  memory_ = need(strategy_, T_local);
  const double host = memory_.host_bytes;
  if (r.budget.host_bytes > 0 && host > r.budget.host_bytes) {
    std::ostringstream m;
    m << "mpipemoe: strategy = \"" << strategy_ << "\" offloads " << host / 1e9
      << " GB of T_DI/T_M to pinned host memory per rank, more than a rank may use: ";
    if (so_.host_bytes)
      m << "host_memory_gb = " << r.budget.host_bytes / 1e9;
    else
      m << r.budget.host_bytes / 1e9 << " GB, its share of the host's memory (" << r.source.at("host_bytes") << ")";
    throw ConfigError(m.str());
  }
}

const Rates& MPipeMoELayer::rates_for(std::int64_t b, bool agree) {
  if (auto it = rates_.find(b); it != rates_.end()) return it->second;
  const std::int64_t M = cfg_.d_model, H = cfg_.d_hidden;
  // One FC1 GEMM of the partition: its rows spread over the local experts.
  const std::int64_t rows = std::max<std::int64_t>(b / std::max<std::int64_t>(local_experts_, 1), 1);
  const MachineRates mr = b_.machine_rates(rows, H, M, cfg_.dtype);
  const Throughputs dflt = default_throughputs();
  Rates r;
  auto pick = [&](const char* fig, const std::optional<double>& opt, const char* opt_name, double machine,
                  double fallback, const std::string& fallback_src) {
    if (opt) {
      r.source[fig] = std::string("option ") + opt_name;
      return *opt;
    }
    if (machine > 0) {
      r.source[fig] = mr.source;
      return machine;
    }
    r.source[fig] = fallback_src;
    return fallback;
  };
  double measured = 0;
  std::string measured_src = "default_throughputs() (assumed)";
  if (!so_.comp_flops && !(mr.gemm_flops > 0)) {
    // The paper measures W_comp: time this rank's FC1 of one partition with the GEMM library.
    Stream& c = *compute_;
    Tensor a = b_.empty({rows, M}, cfg_.dtype, MemCategory::buffers, c);
    Tensor out = b_.empty({rows, H}, cfg_.dtype, MemCategory::buffers, c);
    b_.fill_zero(c, a);
    const GemmProblem g{false, false, rows, H, M, a, params_.w1.select(0), out, 1, 0};
    const double secs = b_.time_bare_gemms(std::span<const GemmProblem>(&g, 1), 3);
    if (secs > 0) {
      measured = 2.0 * static_cast<double>(rows) * static_cast<double>(H) * static_cast<double>(M) / secs;
      measured_src = "measured: time_bare_gemms [" + std::to_string(rows) + "," + std::to_string(M) + "]x[" +
                     std::to_string(M) + "," + std::to_string(H) + "] on " + b_.name();
    }
  }
  r.w.comp_flops = pick("comp_flops", so_.comp_flops, "comp_tflops", mr.gemm_flops,
                        measured > 0 ? measured : dflt.comp_flops, measured_src);
  if (comm_.size() == 1 && !so_.comm_bytes) {
    // One rank has no all-to-all to speak of: its "network" is a local copy, never the bottleneck.
    r.w.comm_bytes = std::numeric_limits<double>::infinity();
    r.source["comm_bytes"] = "one rank: no network traffic";
  } else {
    // The all-to-all among this layer's expert-parallel group (the world's rate where it is the world).
    r.w.comm_bytes = pick("comm_bytes", so_.comm_bytes, "comm_gbps", b_.a2a_bytes_among(comm_.world_ranks()),
                          dflt.comm_bytes, "default_throughputs() (assumed)");
  }
  // Every rank offloads in the same phase, so W_mem is a rank's share with all of them copying.
  r.w.mem_bytes = pick("mem_bytes", so_.mem_bytes, "mem_gbps", mr.host_copy_bytes_all_ranks, dflt.mem_bytes,
                       "default_throughputs() (assumed)");
  r.w.sigma = pick("sigma", so_.sigma, "sigma", mr.sigma, dflt.sigma, "default_throughputs() (assumed)");
  r.w.mu = pick("mu", so_.mu, "mu", mr.mu, dflt.mu, "default_throughputs() (assumed)");
  r.w.eta = pick("eta", so_.eta, "eta", mr.eta, dflt.eta, "default_throughputs() (assumed)");
  // Budgets: the host's memory per rank; the device's capacity less what is in use now
  // (weights, gradients, the layer's input). Unknown: unlimited.
  r.budget.host_bytes = pick("host_bytes", so_.host_bytes, "host_memory_gb", mr.host_memory_bytes, 0, "unlimited");
  // (A device already full leaves a budget of one byte: nothing fits, and "auto" says so.)
  const double free_dev = mr.device_memory_bytes > 0
                              ? std::max(mr.device_memory_bytes - static_cast<double>(b_.memory().device_in_use()), 1.0)
                              : 0;
  r.budget.device_bytes = pick("device_bytes", so_.device_bytes, "memory_gb", free_dev, 0, "unlimited");
  if (agree) {
    // A measured GEMM rate, the memory in use: they may differ between ranks. Every rank takes
    // the smallest (0, unlimited, only where every rank has no budget).
    auto least = [&](double& v) {
      v = -comm_.all_reduce_max(-(v > 0 ? v : std::numeric_limits<double>::max()));
      if (v == std::numeric_limits<double>::max()) v = 0;
    };
    for (double* v : {&r.w.comp_flops, &r.w.comm_bytes, &r.w.mem_bytes, &r.w.sigma, &r.w.mu, &r.w.eta,
                      &r.budget.device_bytes, &r.budget.host_bytes})
      least(*v);
  }
  return rates_.emplace(b, std::move(r)).first->second;
}

// ---- 4. the MoEImpl adapter, options and registration ----------------------------------------
namespace {
class MPipeMoE final : public LayerBackedImpl<MPipeMoELayer> {
 public:
  using LayerBackedImpl::LayerBackedImpl;
  std::string name() const override { return "mpipemoe"; }
  std::vector<GemmProblem> expert_gemms() override { return layer_.expert_gemm_problems(); }
  nlohmann::json report() override { return layer_.report(); }
};

std::unique_ptr<MoEImpl> make(Backend& b, Communicator& c, const ModelConfig& m, const nlohmann::json& options,
                              MoEChannels* channels) {
  const json_fields::Options o(options, "mpipemoe",
                               {"partitions", "max_partitions", "min_partition_tokens", "reuse", "strategy",
                                "comp_tflops", "comm_gbps", "mem_gbps", "sigma", "mu", "eta", "host_memory_gb",
                                "memory_gb", "t_m_buffers"});
  constexpr std::int64_t kMaxPartitions = 1 << 20;
  int n = 0;  // "auto" (absent): Algorithm 1 searches
  if (o.has("partitions")) {
    if (!o.value().at("partitions").is_string())
      n = static_cast<int>(o.positive_int("partitions", 0, kMaxPartitions));
    else if (o.value().at("partitions") != "auto")
      o.bad_value("partitions", "is not a positive integer or \"auto\"");
  }
  const int max_n = static_cast<int>(o.positive_int("max_partitions", 16, kMaxPartitions));
  const int min_rows = static_cast<int>(o.positive_int("min_partition_tokens", 64, kMaxPartitions));
  // Algorithm 1 times trial forwards, synchronised over the expert-parallel group: a clock
  // that group cannot move (the sim's, when the group is not every rank of the run) would time
  // every trial at 0 s and the search would stop at its first n.
  if (n == 0 && !b.clock_moves_in_group(c.size()))
    throw ConfigError("mpipemoe: partitions = \"auto\" times trial forwards over the expert-parallel group, but on " +
                      b.name() + " the clock moves only when every rank of the run synchronises, and this group has " +
                      std::to_string(c.size()) + " of them: give a fixed {\"partitions\": n}, or make the "
                      "expert-parallel group every rank");

  // Memory reuse and the restore strategy: "strategy" names it; "reuse": true alone means
  // reuse with the adaptive choice (Eq. 10); neither means no reuse (pipelining only).
  StrategyOptions so;
  const bool reuse = o.boolean("reuse", false);
  std::vector<std::string> strategies(strategy_names().begin(), strategy_names().end());
  strategies.push_back("auto");
  so.strategy = o.choice("strategy", reuse ? "auto" : so.strategy, strategies);
  if (o.has("reuse") && !reuse && so.strategy != "none")
    o.bad_value("strategy", "contradicts reuse = false (S1-S4 reuse buffers)");
  if (reuse && so.strategy == "none") o.bad_value("strategy", "contradicts reuse = true (no reuse)");
  so.t_m_buffers = static_cast<int>(o.positive_int("t_m_buffers", 1, kMaxPartitions));
  if (so.t_m_buffers > 2) o.bad_value("t_m_buffers", "is not 1 (the paper's) or 2");
  if (o.has("t_m_buffers") && so.strategy == "none")
    o.bad_value("t_m_buffers",
                "needs memory reuse (a strategy S1-S4 or auto): without reuse every partition keeps its T_M");
  // Eq. 10's figures and the budgets when given; otherwise the machine model's, a
  // measurement, or default_throughputs() (MPipeMoELayer::rates_for). The bounds only keep
  // the products finite: 1e9 TFLOP/s, GB/s or GB is beyond any machine.
  auto given = [&](const char* key, double scale, double hi = 1e9) -> std::optional<double> {
    const auto v = o.positive_number(key, hi);
    return v ? std::optional<double>(*v * scale) : std::nullopt;
  };
  so.comp_flops = given("comp_tflops", 1e12);
  so.comm_bytes = given("comm_gbps", 1e9);
  so.mem_bytes = given("mem_gbps", 1e9);
  // An interference factor (Eq. 10's sigma, mu, eta) is a slowdown in (0, 1].
  so.sigma = given("sigma", 1, 1);
  so.mu = given("mu", 1, 1);
  so.eta = given("eta", 1, 1);
  // Budgets: pinned host memory a rank may use for the offloads (its share of the node's),
  // and device memory for activations + buffers (used by "auto").
  so.host_bytes = given("host_memory_gb", 1e9);
  so.device_bytes = given("memory_gb", 1e9);
  return std::make_unique<MPipeMoE>(b, c, m, n, max_n, min_rows, std::move(so), channels);
}
}  // namespace

std::unique_ptr<MoEImpl> make_mpipemoe(Backend& b, Communicator& c, const ModelConfig& m, const nlohmann::json& options) {
  return make(b, c, m, options, nullptr);
}

void register_mpipemoe() { register_impl("mpipemoe", make); }

}  // namespace moelab
