// baselines/fastmoe/fastmoe.cpp — see fastmoe.hpp. Published code cited as laekov/fastmoe at
// tag v1.0.0 (commit 59bcec8edf2b7fb6fa86baa0e2d561a838730e8a), file:line.
#include "baselines/fastmoe/fastmoe.hpp"

#include "harness/config/json_fields.hpp"
#include "harness/runtime/error.hpp"

namespace moelab {

std::vector<std::string> fastmoe_published_prepare_forward_waits() {
  return {
      "expert_count",             // cuda/local_exchange.cu:79 smgr->sync(1) (the gate's counts)
      "expert_exchange",          // cuda/global_exchange.cpp:32 smgr->sync(1)
      "pos_size .item()",         // fmoe/functions.py:46 lec_cum[-1].item()
      "assign_pos",               // cuda/local_exchange.cu:26 smgr->sync(1)
      "fwd_batch_size .item()",   // fmoe/functions.py:68
      "local_expert_count.cpu()", // fmoe/functions.py:71
      "global_expert_count.cpu()",// fmoe/functions.py:72
      "fwd_expert_count.cpu()",   // fmoe/functions.py:73
  };
}

void fastmoe_published_prepare_forward(MoELayer& L, Stream& lane, Communicator& lane_comm) {
  Backend& b = L.backend();
  Stream& c = L.compute_stream();
  const std::int64_t W = lane_comm.size(), El = L.local_experts();
  const auto waits = fastmoe_published_prepare_forward_waits();
  // The gate's counts: route() downloaded them already (that wait is the layer's own); the
  // published expert_count kernel is followed by a stream synchronisation.
  L.host_wait(c, waits[0]);
  // local_expert_count = torch.zeros(...) (functions.py:30), then global_expert_count: int64
  // counts, here as two f32 words each (only the bytes matter: the numbers come from
  // exchange_counts), El per peer in one group (global_exchange.cpp:14-31).
  const std::int64_t words = 2 * El;
  Tensor send = b.empty({W * words}, DType::f32, MemCategory::buffers, c);
  Tensor recv = b.empty({W * words}, DType::f32, MemCategory::buffers, c);
  b.fill_zero(c, send);
  b.fill_zero(c, recv);
  std::vector<Segment> segs;
  for (int p = 0; p < W; ++p) segs.push_back({p, p * words, words});
  L.event_pool().order(c, lane);  // the counts are made on the compute stream
  {
    PhaseScope ph(b, "dispatch");
    lane_comm.all_to_all_v(lane, send, segs, recv, segs);
  }
  L.host_wait(lane, waits[1]);
  L.host_wait(c, waits[2]);
  L.host_wait(lane, waits[3]);  // assign_pos runs on the manager's stream 0 (local_exchange.cu:24)
  for (std::size_t i = 4; i < waits.size(); ++i) L.host_wait(c, waits[i]);
}

namespace {

// ---- as published ------------------------------------------------------------------------
// The ideal layer's chunk (one, every rank), issued the way v1.0.0 issues it.
class PublishedFastMoELayer final : public MoELayer {
 public:
  PublishedFastMoELayer(Backend& b, Communicator& c, const ModelConfig& m, MoEChannels* channels)
      : MoELayer(b, c, m, channels) {
    // MOELinear: a loop over the experts, one cublasXgemm per expert and linear
    // (cuda/parallel_linear.cuh:68-86 forward, :112-159 backward: dgrad and wgrad per expert).
    gemm_per_expert_ = true;
  }

 private:
  ChunkPlan plan_chunks(MoESaved& sv) override {
    clear_host_waits();  // the log holds one forward and its backward
    // prepare_forward (fmoe/functions.py:52-75), on the stream the exchanges use
    // (smgr->stream(0), cuda/global_exchange.cpp:22,29).
    fastmoe_published_prepare_forward(*this, *dispatch_, *dispatch_comm_);
    ChunkPlan plan = MoELayer::plan_chunks(sv);
    // global_scatter and global_gather end with smgr->sync(1): the host waits for stream 0
    // (cuda/global_exchange.h:55,101; cuda/stream_manager.cpp:30-37).
    plan.host_wait_exchanges = true;
    return plan;
  }
  // One NCCL group per local expert i, each with a send to and a receive from every peer j of
  // the rows of expert i (cuda/global_exchange.h:28-53 scatter, :74-99 gather), all on stream 0.
  // The chunk lists its segments per peer in local-expert order, so expert i's are every El-th.
  void exchange(Stream& s, Communicator& comm, const Chunk& ch, const Tensor& src, Tensor& dst,
                bool reverse) override {
    const auto El = static_cast<std::size_t>(local_experts_);
    for (std::size_t i = 0; i < El; ++i) {
      std::vector<Segment> sends, recvs;
      for (std::size_t k = i; k < ch.sends.size(); k += El) sends.push_back(ch.sends[k]);
      for (std::size_t k = i; k < ch.recvs.size(); k += El) recvs.push_back(ch.recvs[k]);
      if (reverse)
        comm.all_to_all_v(s, src, recvs, dst, sends);
      else
        comm.all_to_all_v(s, src, sends, dst, recvs);
    }
  }
  // Each linear's loop ends with smgr->sync(num_expert): the host waits for the streams the
  // GEMMs ran on (cuda/parallel_linear.cuh:87 forward, :160 backward).
  void expert_linear_done(Stream& c) override { host_wait(c, "linear"); }
  // MOELinear.backward computes the weight gradients with the input gradient
  // (fmoe/linear.py:27-36, cuda/parallel_linear.cuh:134-145): nothing is deferred.
  bool defers_weight_gradients() const override { return false; }
};

template <class Layer>
class FastMoE final : public LayerBackedImpl<Layer> {
 public:
  FastMoE(Backend& b, Communicator& c, const ModelConfig& m, MoEChannels* channels, bool published)
      : LayerBackedImpl<Layer>(b, c, m, channels), published_(published) {}
  std::string name() const override { return "fastmoe"; }
  std::vector<GemmProblem> expert_gemms() override { return this->layer_.expert_gemm_problems(); }
  nlohmann::json report() override {
    nlohmann::json r = {{"schedule", "unpipelined expert parallelism"}};
    if (this->layer_.expert_layout() != MoELayer::ExpertLayout::packed)
      r["expert_layout"] = MoELayer::expert_layout_name(this->layer_.expert_layout());
    if (published_) {
      r["as_published"] = "laekov/fastmoe v1.0.0";
      r["host_waits"] = this->layer_.host_waits();
    }
    return r;
  }

 private:
  bool published_;
};

struct FastMoEOptions {
  bool as_published = false;
  MoELayer::ExpertLayout layout = MoELayer::ExpertLayout::packed;  // MoELayer::set_expert_layout
};

FastMoEOptions parse_options(const nlohmann::json& options) {
  const json_fields::Options o(options, "fastmoe", {"as_published", "expert_layout"});
  FastMoEOptions f;
  f.as_published = o.boolean("as_published", false);
  const std::string layout = o.choice("expert_layout", "packed", {"packed", "padded", "auto"});
  f.layout = layout == "padded" ? MoELayer::ExpertLayout::padded
             : layout == "auto" ? MoELayer::ExpertLayout::automatic
                                : MoELayer::ExpertLayout::packed;
  if (f.as_published && f.layout != MoELayer::ExpertLayout::packed)
    throw ConfigError("fastmoe: expert_layout \"" + layout + "\" applies to the ideal layer; laekov/fastmoe v1.0.0 "
                      "(as_published) keeps the experts' rows packed");
  return f;
}

std::unique_ptr<MoEImpl> make(Backend& b, Communicator& c, const ModelConfig& m, const nlohmann::json& options,
                              MoEChannels* channels) {
  const FastMoEOptions f = parse_options(options);
  if (f.as_published) return std::make_unique<FastMoE<PublishedFastMoELayer>>(b, c, m, channels, true);
  auto impl = std::make_unique<FastMoE<MoELayer>>(b, c, m, channels, false);
  impl->layer().set_expert_layout(f.layout);
  return impl;
}

}  // namespace

std::unique_ptr<MoEImpl> make_fastmoe(Backend& b, Communicator& c, const ModelConfig& m, const nlohmann::json& options) {
  return make(b, c, m, options, nullptr);
}

void register_fastmoe() { register_impl("fastmoe", make); }

}  // namespace moelab
