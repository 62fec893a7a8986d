// impls/mpipemoe/mpipemoe.cpp — see mpipemoe.hpp. Sections follow the data:
//   1. the partition plan: which rows of T_I each partition sends where (host)
//   2. forward: S_p / C_p / R_p on three streams
//   3. backward: the mirror
//   4. options, the granularity search, registration
#include "impls/mpipemoe/mpipemoe.hpp"

#include <algorithm>
#include <numeric>

#include "harness/runtime/error.hpp"
#include "impls/mpipemoe/granularity.hpp"

namespace moelab {
namespace {

// ---- 1. the partition plan ----------------------------------------------------------------
// Partition p holds tokens [p*T/n, (p+1)*T/n). In T_I (expert-major; within an expert, by
// choice j then token t) the rows of one (partition, expert, choice) are contiguous, so a
// partition's dispatch is a list of contiguous segments of the global T_I: no extra copy.
struct Partition {
  std::vector<Segment> sends, recvs;          // dispatch segments (combine: the same, reversed)
  std::vector<std::int64_t> rows, offset;     // [El] rows per local expert in T_DI_p, and offsets
  std::int64_t R = 0;                         // rows this rank's experts receive
  Tensor t_di, t_m;                           // saved for backward
};

struct Plan {
  int n = 1;
  std::vector<Partition> parts;
};

}  // namespace

class MPipeMoE final : public MoELayer, public MoEImpl {
 public:
  MPipeMoE(Backend& b, Communicator& c, const ModelConfig& m, int fixed_n, int max_n, std::int64_t min_rows)
      : MoELayer(b, c, m), fixed_n_(fixed_n), search_(max_n, min_rows) {}

  // ---- MoEImpl ------------------------------------------------------------------------------
  std::string name() const override { return "mpipemoe"; }
  void init_parameters(std::uint64_t seed) override { MoELayer::init_parameters(seed); }
  void zero_grad() override { MoELayer::zero_grad(); }
  float aux_loss() override { return MoELayer::aux_loss(); }
  MoEParams& params() override { return MoELayer::params(); }
  MoEParams& grads() override { return MoELayer::grads(); }
  const RoutingStats& routing() const override { return MoELayer::routing(); }
  std::vector<GemmProblem> expert_gemms() override { return expert_gemm_problems(); }
  MoELayer& layer() override { return *this; }
  nlohmann::json report() override {
    return {{"schedule", "MPipeMoE pipelining (no memory reuse)"},
            {"partitions", fixed_n_ > 0 ? nlohmann::json(fixed_n_) : nlohmann::json("auto")},
            {"last_n", plan_.n},
            {"granularity_search", search_.report()}};
  }

  Tensor forward(const Tensor& x) override {
    const std::int64_t T = x.dim(0);
    int n = fixed_n_;
    if (n <= 0) {
      // Trials are forward passes too; they must not advance the gate noise of training.
      const std::uint64_t step = step_;
      n = search_.choose(T, [&](int trial_n) { return trial(x, trial_n); });
      step_ = step;
    }
    if (n > std::max<std::int64_t>(T, 1))
      throw ConfigError("mpipemoe: partitions = " + std::to_string(n) + " leaves partitions without a token for " +
                        std::to_string(T) + " tokens per rank");
    return pipelined_forward(x, n);
  }

  Tensor backward(const Tensor& dy, float grad_aux) override;

 private:
  Tensor pipelined_forward(const Tensor& x, int n);
  void make_plan(int n, std::int64_t T);
  // One timed forward at n (the granularity search's trial), the same on every rank.
  double trial(const Tensor& x, int n) {
    comm_.barrier();
    const double t0 = b_.now();
    pipelined_forward(x, n);
    b_.synchronize();
    comm_.barrier();
    return comm_.all_reduce_max(b_.now() - t0);
  }
  // `to` waits for everything issued on `from` so far. Events come from a pool reused from
  // step to step: a queued wait keeps its own generation of an event (CUDA semantics), so
  // re-recording an event never disturbs an earlier wait on it.
  void stream_event_order(Stream& from, Stream& to) {
    if (next_event_ == events_.size()) events_.push_back(b_.create_event());
    Event& e = *events_[next_event_++];
    b_.record(e, from);
    b_.wait(to, e);
  }

  int fixed_n_;
  GranularitySearch search_;
  Plan plan_;
  std::vector<std::unique_ptr<Event>> events_;  // one per ordering edge of a pass, reused
  std::size_t next_event_ = 0;
};

// Builds plan_ for n partitions from the gate's routing (saved_: topk_idx, slot) — on a backend
// without data (sim) each expert's rows are split evenly across the partitions.
void MPipeMoE::make_plan(int n, std::int64_t T) {
  const std::int64_t E = cfg_.num_experts, El = local_experts_, M = cfg_.d_model;
  const int k = cfg_.top_k, ep = comm_.size();
  const auto& sent = routing_.sent_per_expert;
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
    const auto idx = b_.download_i32(saved_->topk_idx), slot = b_.download_i32(saved_->slot);
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

  plan_ = Plan{};
  plan_.n = n;
  plan_.parts.resize(static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) {
    Partition& P = plan_.parts[static_cast<std::size_t>(p)];
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
}

// ---- 2. forward -----------------------------------------------------------------------------
Tensor MPipeMoE::pipelined_forward(const Tensor& x, int n) {
  const std::int64_t T = x.dim(0), M = cfg_.d_model, H = cfg_.d_hidden;
  if (x.ndim() != 2 || x.dim(1) != M || x.dtype() != cfg_.dtype)
    throw ConfigError("MoE layer input " + x.describe() + " does not match d_model = " + std::to_string(M));
  Stream& c = *compute_;
  saved_ = std::make_unique<Saved>();
  Saved& sv = *saved_;
  sv.x = x;
  ++step_;
  next_event_ = 0;
  gate_phase(x);

  const auto& sent = routing_.sent_per_expert;
  const std::int64_t N = std::accumulate(sent.begin(), sent.end(), std::int64_t{0});
  Tensor t_i;
  std::vector<Tensor> t_do(static_cast<std::size_t>(n));
  {
    PhaseScope ph(b_, "dispatch");
    make_plan(n, T);
    t_i = b_.empty({N, M}, cfg_.dtype, MemCategory::buffers, c);
    b_.permute(c, x, sv.slot, t_i);
    // Every buffer the other streams touch is allocated here, before the event they wait on
    // (stream-ordered allocation).
    sv.t_o = b_.empty({N, M}, cfg_.dtype, MemCategory::activations, c);
    for (int p = 0; p < n; ++p) {
      Partition& P = plan_.parts[static_cast<std::size_t>(p)];
      P.t_di = b_.empty({P.R, M}, cfg_.dtype, MemCategory::activations, c);
      P.t_m = b_.empty({P.R, H}, cfg_.dtype, MemCategory::activations, c);
      t_do[static_cast<std::size_t>(p)] = b_.empty({P.R, M}, cfg_.dtype, MemCategory::buffers, c);
    }
    stream_event_order(c, *dispatch_);
  }
  for (int p = 0; p < n; ++p) {
    Partition& P = plan_.parts[static_cast<std::size_t>(p)];
    {
      PhaseScope ph(b_, "dispatch");  // S_p
      dispatch_comm_->all_to_all_v(*dispatch_, t_i, P.sends, P.t_di, P.recvs);
      stream_event_order(*dispatch_, c);
    }
    {
      PhaseScope ph(b_, "experts");  // C_p
      experts_forward(c, P.t_di, P.rows, P.offset, P.t_m, t_do[static_cast<std::size_t>(p)]);
      stream_event_order(c, *combine_);
    }
    {
      PhaseScope ph(b_, "combine");  // R_p
      combine_comm_->all_to_all_v(*combine_, t_do[static_cast<std::size_t>(p)], P.recvs, sv.t_o, P.sends);
    }
  }
  Tensor y = b_.empty({T, M}, cfg_.dtype, MemCategory::activations, c);
  {
    PhaseScope ph(b_, "combine");
    stream_event_order(*combine_, c);
    stream_event_order(*dispatch_, c);  // t_i is freed on the compute stream after its last reader
    b_.unpermute(c, sv.t_o, sv.slot, sv.topk_w, y);
  }
  routing_.recv_per_local.assign(static_cast<std::size_t>(local_experts_), 0);
  for (const auto& P : plan_.parts)
    for (std::size_t l = 0; l < P.rows.size(); ++l) routing_.recv_per_local[l] += P.rows[l];
  return y;
}

// ---- 3. backward: per partition, combine-backward exchange, experts backward, dispatch-backward
Tensor MPipeMoE::backward(const Tensor& dy, float grad_aux) {
  MOELAB_CHECK(saved_ != nullptr, "MPipeMoE::backward called without a forward");
  Saved& sv = *saved_;
  const std::int64_t T = sv.x.dim(0), M = cfg_.d_model, N = sv.t_o.dim(0);
  const int k = cfg_.top_k, n = plan_.n;
  Stream& c = *compute_;
  next_event_ = 0;
  Tensor d_w = b_.empty({T, k}, DType::f32, MemCategory::buffers, c);
  Tensor d_t_o = b_.empty({N, M}, cfg_.dtype, MemCategory::buffers, c);
  Tensor d_t_i = b_.empty({N, M}, cfg_.dtype, MemCategory::buffers, c);
  std::vector<Tensor> d_t_do(static_cast<std::size_t>(n)), d_t_di(static_cast<std::size_t>(n));
  for (int p = 0; p < n; ++p) {
    const std::int64_t R = plan_.parts[static_cast<std::size_t>(p)].R;
    d_t_do[static_cast<std::size_t>(p)] = b_.empty({R, M}, cfg_.dtype, MemCategory::buffers, c);
    d_t_di[static_cast<std::size_t>(p)] = b_.empty({R, M}, cfg_.dtype, MemCategory::buffers, c);
  }
  {
    PhaseScope ph(b_, "combine");
    b_.unpermute_backward(c, dy, sv.t_o, sv.slot, sv.topk_w, d_t_o, d_w);
    stream_event_order(c, *combine_);
    stream_event_order(c, *dispatch_);
  }
  for (int p = 0; p < n; ++p) {
    Partition& P = plan_.parts[static_cast<std::size_t>(p)];
    {
      PhaseScope ph(b_, "combine");  // R'_p: output gradients to the experts
      combine_comm_->all_to_all_v(*combine_, d_t_o, P.sends, d_t_do[static_cast<std::size_t>(p)], P.recvs);
      stream_event_order(*combine_, c);
    }
    {
      PhaseScope ph(b_, "experts");  // C'_p
      experts_backward(c, P.t_di, P.t_m, d_t_do[static_cast<std::size_t>(p)], P.rows, P.offset,
                       d_t_di[static_cast<std::size_t>(p)]);
      stream_event_order(c, *dispatch_);
    }
    {
      PhaseScope ph(b_, "dispatch");  // S'_p: input gradients back to the tokens' ranks
      dispatch_comm_->all_to_all_v(*dispatch_, d_t_di[static_cast<std::size_t>(p)], P.recvs, d_t_i, P.sends);
    }
  }
  Tensor dx = b_.empty({T, M}, cfg_.dtype, MemCategory::activations, c);
  {
    PhaseScope ph(b_, "dispatch");
    stream_event_order(*dispatch_, c);
    stream_event_order(*combine_, c);
    b_.permute_backward(c, d_t_i, sv.slot, dx);
  }
  gate_backward_phase(d_w, grad_aux, dx);
  saved_.reset();
  for (auto& P : plan_.parts) P.t_di = P.t_m = Tensor();
  return dx;
}

// ---- 4. options and registration --------------------------------------------------------------
namespace {
int int_option(const nlohmann::json& o, const char* key, int dflt, int lo) {
  if (!o.contains(key)) return dflt;
  const auto& v = o[key];
  if (!v.is_number_integer() || v.get<std::int64_t>() < lo || v.get<std::int64_t>() > 1 << 20)
    throw ConfigError(std::string("mpipemoe: ") + key + " = " + v.dump() + ": expected an integer >= " +
                      std::to_string(lo));
  return v.get<int>();
}
}  // namespace

std::unique_ptr<MoEImpl> make_mpipemoe(Backend& b, Communicator& c, const ModelConfig& m, const nlohmann::json& options) {
  const nlohmann::json o = options.is_null() ? nlohmann::json::object() : options;
  if (!o.is_object()) throw ConfigError("mpipemoe: options must be a JSON object, got " + o.dump());
  for (const auto& [key, v] : o.items())
    if (key != "partitions" && key != "max_partitions" && key != "min_partition_tokens")
      throw ConfigError("mpipemoe: unknown option \"" + key + "\" (known: partitions, max_partitions, min_partition_tokens)");
  int n = 0;  // auto
  if (o.contains("partitions") && !(o["partitions"].is_string() && o["partitions"] == "auto"))
    n = int_option(o, "partitions", 0, 1);
  const int max_n = int_option(o, "max_partitions", 16, 1);
  const int min_rows = int_option(o, "min_partition_tokens", 64, 1);
  return std::make_unique<MPipeMoE>(b, c, m, n, max_n, min_rows);
}

void register_mpipemoe() { register_impl("mpipemoe", make_mpipemoe); }

}  // namespace moelab
