// harness/nn/moe_layer.hpp — the expert-parallel MoE layer, forward and backward, with
// hand-written gradients for the input and every parameter. Unpipelined: this is also the
// FastMoE baseline (baselines/fastmoe), and the building block the other systems schedule
// differently.
//
// Notation (per rank): T tokens, M d_model, H d_hidden, E experts in all, El = E / EP local
// experts, k top-k, N dispatched rows (kept token-slots of this rank), R received rows.
//
// Forward, in the papers' vocabulary (MPipeMoE §II), as public steps (the split of
// Megatron-Core's token dispatcher: the pre/post steps never communicate data, so schedules
// differ only in how they issue the steps, and on which streams):
//   route                logits = x·Wg (+ eps·softplus(x·Wn))  [T,E] -> softmax, top-k, capacity
//                        -> slot [T,k], counts [E]; aux loss (Switch/GShard)
//   dispatch_preprocess  permute x -> T_I [N,M] (expert-major), exchange counts, plan the chunks
//   dispatch             all-to-all-v of a chunk: T_I rows -> T_DI_c [R_c,M] (local-expert-major,
//                        source rank within expert)
//   experts              for each local expert l: T_M = T_DI_l·W1_l [R_l,H]; A = act(T_M);
//                        T_DO_l = A·W2_l [R_l,M]
//   combine              all-to-all-v of a chunk back: T_DO_c -> its rows of T_O [N,M]
//   combine_postprocess  unpermute: y[t] = sum_j w[t,j]·T_O[slot[t,j]]
// and the mirror steps for backward. Saved for backward: x, gate outputs, T_DI, T_M
// (pre-activation), T_O. The activation A is recomputed from T_M in backward (one [R,H]
// buffer instead of two kept ones), which is the layout MPipeMoE's memory model assumes
// (M_act = 4BM + BH).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "harness/comm/communicator.hpp"
#include "harness/config/workload.hpp"
#include "harness/nn/moe_schedule.hpp"
#include "harness/runtime/backend.hpp"

namespace moelab {

struct MoEParams {
  Tensor w_gate;   // [M,E]
  Tensor w_noise;  // [M,E] (noisy gate only)
  Tensor w1;       // [El,M,H]
  Tensor w2;       // [El,H,M]
};

// What one forward routed, for reports and tests (host copies).
struct RoutingStats {
  std::vector<std::int64_t> routed_per_expert;  // [E] slots the gate routed to each expert (before capacity)
  std::vector<std::int64_t> sent_per_expert;  // [E] kept slots of this rank per global expert
  std::vector<std::int64_t> recv_per_local;   // [El] rows each local expert received
  std::int64_t dropped = 0;                   // slots dropped by capacity on this rank
  std::int64_t capacity = 0;                  // per expert, 0 = unlimited
};

// What a forward leaves for its backward.
struct MoESaved {
  Tensor x;                     // [T,M]   layer input
  Tensor noise_raw, eps;        // [T,E]   fp32, noisy gate only
  Tensor probs;                 // [T,E]   fp32
  Tensor topk_idx, topk_w;      // [T,k]   int32 / fp32
  Tensor slot;                  // [T,k]   int32 row in T_I, -1 = dropped
  Tensor routed_frac, aux_loss; // [E], [1] fp32
  std::vector<std::int64_t> sent;  // [E] kept slots per global expert (rows of T_I per expert)
  ChunkPlan plan;               // the dispatch's chunks
  Tensor t_di;                  // [R,M]   rows received by the local experts
  Tensor t_m;                   // [R,H]   FC1 output before the activation
  Tensor t_o;                   // [N,M]   expert outputs back at their source rank
};

class MoELayer {
 public:
  // comm spans the expert-parallel group (its size is EP). The layer creates its own
  // streams (compute, dispatch, combine) and duplicates comm for the dispatch and combine
  // channels so that a scheduler may overlap them.
  MoELayer(Backend& backend, Communicator& comm, const ModelConfig& cfg);
  virtual ~MoELayer();

  // Deterministic in (seed, global expert id): the same experts get the same weights
  // whatever the EP degree. PyTorch-Linear-style U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
  void init_parameters(std::uint64_t seed);
  void zero_grad();

  // x [T,M] -> y [T,M]. Issues work on the layer's streams and returns without waiting.
  // With a noisy gate, eps [T,E] is drawn from Rng(mix(noise_seed, rank, step)).
  virtual Tensor forward(const Tensor& x);
  // dy [T,M] -> dx [T,M]; accumulates into grads(). grad_aux = dL/d aux_loss.
  virtual Tensor backward(const Tensor& dy, float grad_aux);

  float aux_loss();                      // of the last forward (synchronises)
  // The six expert GEMMs per local expert of one forward+backward with the last forward's
  // row counts (FC1, FC2 forward; dA, dW2, dT_M->dT_DI, dW1 backward), on fresh scratch
  // tensors: the yardstick that `moelab run` times with Backend::time_bare_gemms.
  std::vector<GemmProblem> expert_gemm_problems();
  const RoutingStats& routing() const { return routing_; }
  std::vector<float> last_noise();       // eps of the last forward (noisy gate), host copy

  MoEParams& params() { return params_; }
  MoEParams& grads() { return grads_; }
  const ModelConfig& config() const { return cfg_; }
  std::int64_t local_experts() const { return local_experts_; }
  Stream& compute_stream() { return *compute_; }
  void set_noise_seed(std::uint64_t s) { noise_seed_ = s; }

  // ---- the steps, forward. Each issues on the stream it is given (c: the compute stream;
  //      s, comm: a communication stream and the communicator used from it) ---------------
  // Gate on sv.x: fills the gate part of sv and routing(); the layer's one host
  // synchronisation (the counts size the all-to-all-v).
  void route(Stream& c, MoESaved& sv);
  // T_I [N,M] = x permuted expert-major; exchanges the counts and plans the chunks (sv.plan).
  Tensor dispatch_preprocess(Stream& c, MoESaved& sv);
  // T_I rows of chunk ch -> t_di [R_c,M].
  void dispatch(Stream& s, Communicator& comm, const Tensor& t_i, const Chunk& ch, Tensor& t_di);
  // The experts on chunk ch's rows: t_m [R_c,H] = T_DI·W1 (kept), t_do [R_c,M] = act(t_m)·W2.
  void experts(Stream& c, const Chunk& ch, const Tensor& t_di, Tensor& t_m, Tensor& t_do);
  // FC1 alone (t_m = T_DI·W1): the first GEMM of experts(), and MPipeMoE's recomputation.
  void expert_fc1(Stream& c, const Chunk& ch, const Tensor& t_di, Tensor& t_m, const char* name = "fc1");
  // t_do [R_c,M] -> chunk ch's rows of t_o [N,M].
  void combine(Stream& s, Communicator& comm, const Chunk& ch, const Tensor& t_do, Tensor& t_o);
  // y [T,M] = unpermute(T_O) with the gate weights.
  void combine_postprocess(Stream& c, const MoESaved& sv, Tensor& y);

  // ---- the steps, backward (the mirror) -------------------------------------------------
  // dy [T,M] -> dT_O [N,M], dw [T,k] fp32.
  void combine_postprocess_backward(Stream& c, const MoESaved& sv, const Tensor& dy, Tensor& d_t_o, Tensor& d_w);
  // chunk ch's rows of dT_O -> d_t_do [R_c,M].
  void combine_backward(Stream& s, Communicator& comm, const Chunk& ch, const Tensor& d_t_o, Tensor& d_t_do);
  // dT_DO -> dT_DI [R_c,M]; dW1, dW2 accumulate.
  void experts_backward(Stream& c, const Chunk& ch, const Tensor& t_di, const Tensor& t_m, const Tensor& d_t_do,
                        Tensor& d_t_di);
  // d_t_di [R_c,M] -> chunk ch's rows of dT_I [N,M].
  void dispatch_backward(Stream& s, Communicator& comm, const Chunk& ch, const Tensor& d_t_di, Tensor& d_t_i);
  // dT_I [N,M] -> dx [T,M] (overwrites dx).
  void dispatch_preprocess_backward(Stream& c, const MoESaved& sv, const Tensor& d_t_i, Tensor& dx);
  // dw [T,k] -> d_logits -> dW_gate, dW_noise, and the gate's share added into dx.
  void route_backward(Stream& c, const MoESaved& sv, const Tensor& d_w, float grad_aux, Tensor& dx);

 protected:
  // The chunks of this layer's schedule (called by dispatch_preprocess once T_I is made):
  // FastMoE's is one chunk exchanging with every rank.
  virtual ChunkPlan plan_chunks(MoESaved& sv);

  Backend& b_;
  Communicator& comm_;
  std::unique_ptr<Communicator> dispatch_comm_, combine_comm_;
  ModelConfig cfg_;
  std::int64_t local_experts_;
  Stream* compute_;
  Stream* dispatch_;
  Stream* combine_;
  std::unique_ptr<Event> ev_a_, ev_b_;
  MoEParams params_, grads_;
  RoutingStats routing_;
  std::unique_ptr<MoESaved> saved_;
  std::uint64_t noise_seed_ = 0x5eed;
  std::uint64_t step_ = 0;
  std::vector<float> last_eps_;
};

}  // namespace moelab
