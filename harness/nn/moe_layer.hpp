// harness/nn/moe_layer.hpp — the expert-parallel MoE layer, forward and backward, with
// hand-written gradients for the input and every parameter. Unpipelined: this is also the
// FastMoE baseline (baselines/fastmoe), and the building block the other systems schedule
// differently.
//
// Notation (per rank): T tokens, M d_model, H d_hidden, E experts in all, El = E / EP local
// experts, k top-k, N dispatched rows (kept token-slots of this rank), R received rows.
//
// Forward, in the papers' vocabulary (MPipeMoE §II):
//   gate      logits = x·Wg (+ eps·softplus(x·Wn))  [T,E] -> softmax, top-k, capacity
//             -> slot [T,k], counts [E]; aux loss (Switch/GShard)
//   dispatch  permute x -> T_I [N,M] (expert-major), exchange counts, all-to-all-v
//             -> T_DI [R,M] (local-expert-major, source rank within expert)
//   experts   for each local expert l: T_M = T_DI_l·W1_l [R_l,H]; A = act(T_M);
//             T_DO_l = A·W2_l [R_l,M]
//   combine   all-to-all-v T_DO -> T_O [N,M] (back in T_I's order); unpermute:
//             y[t] = sum_j w[t,j]·T_O[slot[t,j]]
// Saved for backward: x, gate outputs, T_DI, T_M (pre-activation), T_O. The activation A is
// recomputed from T_M in backward (one [R,H] buffer instead of two kept ones), which is the
// layout MPipeMoE's memory model assumes (M_act = 4BM + BH).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "harness/comm/communicator.hpp"
#include "harness/config/workload.hpp"
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

 protected:
  // ---- the phases, for schedules that reorder dispatch, experts and combine (MPipeMoE,
  //      FasterMoE derive from this layer and keep its gate and experts) ------------------
  struct Saved {
    Tensor x;                     // [T,M]   layer input
    Tensor noise_raw, eps;        // [T,E]   fp32, noisy gate only
    Tensor probs;                 // [T,E]   fp32
    Tensor topk_idx, topk_w;      // [T,k]   int32 / fp32
    Tensor slot;                  // [T,k]   int32 row in T_I, -1 = dropped
    Tensor routed_frac, aux_loss; // [E], [1] fp32
    Tensor t_di;                  // [R,M]   rows received by the local experts
    Tensor t_m;                   // [R,H]   FC1 output before the activation
    Tensor t_o;                   // [N,M]   expert outputs back at their source rank
    std::vector<Segment> sends;   // dispatch: T_I segments to each (peer, local expert of peer)
    std::vector<Segment> recvs;   // dispatch: T_DI segments from each (peer, my local expert)
    std::vector<std::int64_t> rows_per_local;  // [El]
    std::vector<std::int64_t> local_offset;    // [El] first row of each local expert in T_DI
  };

  // gate on x: fills saved_ (probs, top-k, slots, routed fractions, aux loss) and routing_
  // (counts per expert, synchronising the compute stream to read them).
  void gate_phase(const Tensor& x);
  // The experts on rows [off_l, off_l + rows_l) of each local expert l, on stream c.
  void experts_forward(Stream& c, const Tensor& t_di, const std::vector<std::int64_t>& rows,
                       const std::vector<std::int64_t>& off, Tensor& t_m, Tensor& t_do);
  void experts_backward(Stream& c, const Tensor& t_di, const Tensor& t_m, const Tensor& d_t_do,
                        const std::vector<std::int64_t>& rows, const std::vector<std::int64_t>& off, Tensor& d_t_di);
  // d_w [T,k] -> d_logits -> dW_gate, dW_noise, and the gate's share added into dx.
  void gate_backward_phase(const Tensor& d_w, float grad_aux, Tensor& dx);

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
  std::unique_ptr<Saved> saved_;
  std::uint64_t noise_seed_ = 0x5eed;
  std::uint64_t step_ = 0;
  std::vector<float> last_eps_;
};

}  // namespace moelab
