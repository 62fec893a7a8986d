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
// and the mirror steps for backward. A schedule is the chunk plan dispatch_preprocess makes
// (plan_chunks) and the issuer runs (harness/nn/moe_schedule.hpp); this layer's is one chunk.
// Saved for backward (a value, harness/nn/saved.hpp: any number of microbatches may be in
// flight): x, gate outputs, T_DI, T_M (pre-activation), T_O. The activation A is recomputed
// from T_M in backward (one [R,H] buffer instead of two kept ones), which is the layout
// MPipeMoE's memory model assumes (M_act = 4BM + BH).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "harness/comm/communicator.hpp"
#include "harness/config/workload.hpp"
#include "harness/nn/moe_schedule.hpp"
#include "harness/nn/saved.hpp"
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

// The streams and communicators MoE layers issue on. A model makes one set for all its MoE
// layers (L layers need not make 2L streams and duplicate the communicator 2L times) and keeps
// it alive as long as they are; a lone layer makes its own. Making one is collective (dup).
class MoEChannels {
 public:
  // compute: the backend's default stream; dispatch and combine: new streams, each with its
  // own duplicate of comm (a communicator is used from one stream, communicator.hpp).
  // tp: the tensor-parallel group of the ranks (null: none). Layers that exchange over it
  // (the TP-deduplicated all-to-all of baselines/deepspeed_tp_ep and impls/monta) get a stream
  // and a duplicate of it of their own: gather() and gather_comm(), made on first use (the
  // dup is collective over the TP group: a layer asks for it when it is built, as every rank
  // of the group does).
  MoEChannels(Backend& b, Communicator& comm, Communicator* tp = nullptr);
  Stream& compute() { return *compute_; }
  Stream& dispatch() { return *dispatch_; }
  Stream& combine() { return *combine_; }
  Communicator& dispatch_comm() { return *dispatch_comm_; }
  Communicator& combine_comm() { return *combine_comm_; }
  // Host copies (MPipeMoE's offloads and fetches), made on first use.
  Stream& host_to_device();
  Stream& device_to_host();
  // The TP group (null without one) and the stream and communicator its exchanges use.
  Communicator* tp() { return tp_; }
  Stream& gather();
  Communicator& gather_comm();

 private:
  Backend& b_;
  Communicator* tp_ = nullptr;
  std::unique_ptr<Communicator> gather_comm_;
  Stream* gather_ = nullptr;
  std::unique_ptr<Communicator> dispatch_comm_, combine_comm_;
  Stream* compute_;
  Stream* dispatch_;
  Stream* combine_;
  Stream* h2d_ = nullptr;
  Stream* d2h_ = nullptr;
};

// What a forward leaves for its backward. Destroying it frees its tensors (stream-ordered).
struct MoESaved : Saved {
  using Saved::Saved;
  Tensor x;                     // [T,M]   layer input
  Tensor noise_raw, eps;        // [T,E]   fp32, noisy gate only
  Tensor probs;                 // [T,E]   fp32
  Tensor topk_idx, topk_w;      // [T,k]   int32 / fp32
  Tensor slot;                  // [T,k]   int32 row in T_I, -1 = dropped
  Tensor routed_frac, aux_loss; // [E], [1] fp32 (routed_frac rescaled under partition_sequence)
  Tensor prob_mean;             // [E]     fp32 mean_t probs[t,e], under partition_sequence only
  std::vector<std::int64_t> sent;  // [E] kept slots per global expert (rows of T_I per expert)
  ChunkPlan plan;               // the dispatch's chunks
  struct Kept {
    Tensor t_di;                // [R_c,M] rows chunk c brought to the local experts
    Tensor t_m;                 // [R_c,H] their FC1 output before the activation
  };
  std::vector<Kept> kept;       // per chunk (empty where a schedule keeps its own buffers)
  Tensor t_o;                   // [N,M]   expert outputs back at their source rank
  Tensor t_i;                   // [N,M]   kept only where backward sends it again (MPipeMoE S2, S4)
  std::vector<float> eps_host;  // [T,E]   the gate noise drawn (noisy gate, backends with data)
  // Weight-gradient GEMMs that backward_input left for backward_weight, and what they read.
  struct ExpertWgrad {
    std::size_t chunk = 0;      // of plan.chunks
    Tensor t_di;                // [R_c,M]
    Tensor a, d_t_m;            // [R_c,H] act(T_M), dT_M
    Tensor d_t_do;              // [R_c,M]
  };
  std::vector<ExpertWgrad> expert_wgrad;
  Tensor gate_d_logits, gate_d_noise;  // [T,E] in the layer's dtype
};

class MoELayer {
 public:
  // comm spans the expert-parallel group (its size is EP). channels: the streams and
  // communicators to issue on, shared by the MoE layers of a model; none given, the layer makes
  // its own (MoEChannels).
  MoELayer(Backend& backend, Communicator& comm, const ModelConfig& cfg, MoEChannels* channels = nullptr);
  virtual ~MoELayer();

  // Deterministic in (seed, global expert id): the same experts get the same weights
  // whatever the EP degree. PyTorch-Linear-style U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
  void init_parameters(std::uint64_t seed);
  // The gate's gradients are zeroed; the experts' are left unwritten and marked zero, as
  // PyTorch's zero_grad(set_to_none=True) leaves them to the backward: the first
  // weight-gradient GEMM into an expert's slice after it writes the slice (beta = 0), later ones
  // accumulate (beta = 1), and a forward zeroes the slices of the experts its plan gives no rows
  // (whose backward writes nothing there). So a step's gradients are whole once each forward
  // since zero_grad has had its backward, and no step passes over the experts' gradients only
  // to zero them (a memset of 2·E_l·M·H elements). A model's zero_grad zeroes every gradient
  // itself (Model::zero_grad) and does not call this: its layers' weight-gradient GEMMs
  // accumulate into the zeros, as they do before a layer's first zero_grad.
  void zero_grad();

  // ---- any number of microbatches in flight (harness/nn/saved.hpp) ---------------------
  // x [T,M] -> y [T,M] and the saved state. Issues work and returns without waiting; memory
  // allocated for it is charged to key.microbatch. With a noisy gate, eps [T,E] is drawn from
  // Rng(mix(noise_seed, rank, work_seed(key))): the same numbers whatever the order of the work.
  virtual Forwarded forward(const Tensor& x, const WorkKey& key);
  // dy [T,M] -> dx [T,M]; grad_aux = dL/d aux_loss. The input gradient; the weight gradients
  // (fc1/fc2 and gate wgrad GEMMs) are deferred to backward_weight where the schedule allows it
  // (defers_weight_gradients()), else done here.
  Tensor backward_input(Saved& s, const Tensor& dy, float grad_aux);
  // The deferred weight-gradient GEMMs, accumulated into grads(); a no-op when none were left.
  void backward_weight(Saved& s);
  float aux_loss(const Saved& s);        // synchronises
  const std::vector<float>& noise(const Saved& s) const;  // eps drawn for it (host copy)

  // ---- one microbatch in flight: a handle held inside, key {0, 0, step} with the step
  //      counted per forward -----------------------------------------------------------------
  Tensor forward(const Tensor& x);
  // backward_input and backward_weight together, the weight gradients in place (as the
  // layer's op sequence has always been), then the saved state freed.
  Tensor backward(const Tensor& dy, float grad_aux);
  float aux_loss();                      // of the last forward (synchronises)
  // The six expert GEMMs per local expert of one forward+backward with the last forward's
  // row counts (FC1, FC2 forward; dA, dW2, dT_M->dT_DI, dW1 backward), on fresh scratch
  // tensors: the yardstick that `moelab run` times with Backend::time_bare_gemms.
  // per_chunk: the six per local expert and chunk of the last forward's plan, with its rows.
  std::vector<GemmProblem> expert_gemm_problems(bool per_chunk = false);
  // The GEMM floor of the same work: each of those GEMMs (forward only in inference) as one
  // balanced batch over the local experts, t = ceil(R / El) rows each (R the rows the last
  // forward brought to this rank's experts), every operand one tensor of El equal blocks
  // (the weights as they are) so that Backend::time_batched_gemms issues one strided-batched
  // call per weight GEMM, as a PyTorch torch.bmm floor does. Its FLOPs exceed the layer's by
  // the rounding of R up to El·t; empty when R = 0.
  std::vector<GemmProblem> expert_floor_problems();
  const RoutingStats& routing() const { return routing_; }
  std::vector<float> last_noise();       // eps of the last forward (noisy gate), host copy

  MoEParams& params() { return params_; }
  MoEParams& grads() { return grads_; }
  const ModelConfig& config() const { return cfg_; }
  std::int64_t local_experts() const { return local_experts_; }
  Stream& compute_stream() { return *compute_; }
  Backend& backend() { return b_; }
  MoEChannels& channels() { return *channels_; }  // to share with the model's other MoE layers
  EventPool& event_pool() { return events_; }  // the events of the layer's passes
  void set_noise_seed(std::uint64_t s) { noise_seed_ = s; }
  // A host wait a schedule issues where the code it reproduces waits (FastMoE's `.item()`,
  // `.cpu()` and stream synchronisations, baselines/fastmoe): synchronises s and logs `what`.
  // The log (for reports and tests) holds every such wait since it was last cleared; the
  // layer's own synchronisation in route() is not logged.
  void host_wait(Stream& s, const std::string& what);
  const std::vector<std::string>& host_waits() const { return host_waits_; }
  void clear_host_waits() { host_waits_.clear(); }
  // The rank the gate noise is keyed on: this rank's in the expert-parallel group, or one its
  // TP group shares (share_noise_rank: a model whose TP ranks hold the same tokens, i.e. TP
  // without sequence parallelism, must route them alike; a layer that deduplicates over TP
  // keys it on the group itself).
  virtual std::uint64_t noise_rank() const {
    return shared_noise_rank_ ? *shared_noise_rank_ : static_cast<std::uint64_t>(comm_.rank());
  }
  void share_noise_rank(std::uint64_t r) { shared_noise_rank_ = r; }
  // Sequence parallelism: the ranks of `group` route disjoint rows of one sequence batch, and
  // the load-balancing loss is the unsplit batch's (Megatron-Core's switch_load_balancing_loss
  // with a sequence-partition group): f_e from the slots every rank of the group routed to e,
  // P_e from this rank's rows, both over the group's T; the ranks' aux_loss values and their
  // gradients then sum to the unsplit model's. Every forward then all-reduces E counts over
  // `group` on the compute stream: the group's ranks must run the same forwards in the same
  // order, and no other stream may use `group` meanwhile. Null or size 1: the rank's own rows
  // (as under data parallelism).
  void partition_sequence(Communicator* group) { seq_group_ = group && group->size() > 1 ? group : nullptr; }
  Communicator* sequence_group() const { return seq_group_; }
  // [E] slots the gate routed to each expert (before capacity), summed over every forward
  // since the layer was built (tests compare whole steps' routing).
  const std::vector<std::int64_t>& routed_totals() const { return routed_totals_; }
  // Whether a caller may run this layer's forward and backward as the public steps below, with
  // the plan dispatch_preprocess makes issued by the chunk issuer (ScMoE's overlap schedule,
  // impls/scmoe, does): true for the planners (FastMoE, FasterMoE, the Tutel-style baselines);
  // false for a schedule with a pass of its own (MPipeMoE's granularity search and restore
  // strategies), which a caller runs whole (forward, backward_input, backward_weight).
  virtual bool steps_drivable() const { return true; }

  // ScMoE's expert offloading for memory-limited inference (Cai et al., ICML 2025, its "expert
  // offloading"): the local experts' weights move to pinned host memory (MemCategory::
  // host_pinned) and the gradients go; each forward copies just the experts its plan brings
  // rows to into a device buffer of that many experts, as soon as the plan is known (after the
  // gate and the count exchange: the model's real routing, not a guess), and frees the buffer
  // once the experts have run (the next MoE layer's copy can take its place while it is still
  // in use: one buffer in use, one being filled). async: the copies run on the host-to-device
  // stream, and only the experts' GEMMs wait for them (what ScMoE's shortcut gives time to
  // hide); sync: on the compute stream, in its path (the baseline). Forward only: backward is
  // refused. ConfigError for a layer whose schedule runs its own pass (steps_drivable false).
  enum class ExpertOffload { none, sync, async };
  void offload_experts(ExpertOffload mode);
  // The experts' rows in the buffers of their step. packed: expert l's rows right after expert
  // l-1's. padded (Chunk::stride): every local expert's rows in a stride of the busiest local
  // expert's rows, the padding kept zero, so that a GPU may run an expert GEMM as one strided
  // batch over the padded rows where the crossover table says it wins (docs/GPU.md, "The
  // padded layout"); the buffers then hold El·stride rows. automatic: padded in a step whose
  // padding is at most the crossover table's max_padding_waste (12.5%: above it the strided
  // batch is refused anyway), packed otherwise. For the one-chunk plan of this class (a
  // schedule with its own plan keeps the packed layout); ConfigError with expert offloading
  // (the padded batch reads every expert's weights).
  enum class ExpertLayout { packed, padded, automatic };
  void set_expert_layout(ExpertLayout layout);
  ExpertLayout expert_layout() const { return layout_; }
  static const char* expert_layout_name(ExpertLayout l);
  ExpertOffload expert_offload() const { return offload_; }
  static const char* expert_offload_name(ExpertOffload m);

  // ---- the steps, forward. Each issues on the stream it is given (c: the compute stream;
  //      s, comm: a communication stream and the communicator used from it) ---------------
  // Gate on sv.x: fills the gate part of sv and routing(); the layer's one host
  // synchronisation (the counts size the all-to-all-v).
  void route(Stream& c, MoESaved& sv);
  // The word the gate noise of a piece of work is keyed by: step for layer 0, microbatch 0.
  static std::uint64_t work_seed(const WorkKey& k);
  // T_I [N,M] = x permuted expert-major; exchanges the counts and plans the chunks (sv.plan).
  Tensor dispatch_preprocess(Stream& c, MoESaved& sv);
  // T_I rows of chunk ch -> t_di [R_c,M].
  void dispatch(Stream& s, Communicator& comm, const Tensor& t_i, const Chunk& ch, Tensor& t_di);
  // The experts on chunk ch's rows: t_m [R_c,H] = T_DI·W1 (kept), t_do [R_c,M] = act(t_m)·W2.
  void experts(Stream& c, const Chunk& ch, const Tensor& t_di, Tensor& t_m, Tensor& t_do);
  // FC1 alone (t_m = T_DI·W1): the first GEMM of experts(), and MPipeMoE's recomputation.
  // With `act` given, act(t_m) is written there too, by the GEMM's epilogue (fused_epilogue()).
  void expert_fc1(Stream& c, const Chunk& ch, const Tensor& t_di, Tensor& t_m, const char* name = "fc1",
                  Tensor* act = nullptr);
  // Whether the backend runs the activation in the experts' GEMM epilogues (Backend::
  // fuses_gemm_epilogue: the tanh GeLU on cuBLASLt): FC1 then writes T_M and act(T_M) at once,
  // and FC2's dgrad writes dT_M = dA · act'(T_M); no activation op of their own.
  bool fused_epilogue() const { return b_.fuses_gemm_epilogue(cfg_.activation, cfg_.dtype); }
  // t_do [R_c,M] -> chunk ch's rows of t_o [N,M].
  void combine(Stream& s, Communicator& comm, const Chunk& ch, const Tensor& t_do, Tensor& t_o);
  // y [T,M] = unpermute(T_O) with the gate weights.
  void combine_postprocess(Stream& c, const MoESaved& sv, Tensor& y);

  // ---- the steps, backward (the mirror) -------------------------------------------------
  // dy [T,M] -> dT_O [N,M], dw [T,k] fp32.
  void combine_postprocess_backward(Stream& c, const MoESaved& sv, const Tensor& dy, Tensor& d_t_o, Tensor& d_w);
  // chunk ch's rows of dT_O -> d_t_do [R_c,M].
  void combine_backward(Stream& s, Communicator& comm, const Chunk& ch, const Tensor& d_t_o, Tensor& d_t_do);
  // dT_DO -> dT_DI [R_c,M]; dW1, dW2 accumulate, or (defer given) what they need is kept there.
  void experts_backward(Stream& c, const Chunk& ch, const Tensor& t_di, const Tensor& t_m, const Tensor& d_t_do,
                        Tensor& d_t_di, MoESaved::ExpertWgrad* defer = nullptr);
  // d_t_di [R_c,M] -> chunk ch's rows of dT_I [N,M].
  void dispatch_backward(Stream& s, Communicator& comm, const Chunk& ch, const Tensor& d_t_di, Tensor& d_t_i);
  // dT_I [N,M] -> dx [T,M] (overwrites dx).
  void dispatch_preprocess_backward(Stream& c, const MoESaved& sv, const Tensor& d_t_i, Tensor& dx);
  // dw [T,k] -> d_logits -> dW_gate, dW_noise, and the gate's share added into dx; with defer,
  // d_logits is kept in sv for weight_gradients instead of the two wgrad GEMMs.
  void route_backward(Stream& c, MoESaved& sv, const Tensor& d_w, float grad_aux, Tensor& dx, bool defer = false);
  // The GEMMs experts_backward and route_backward left in sv: fc2_wgrad, fc1_wgrad per chunk,
  // gate_wgrad, gate_noise_wgrad.
  void weight_gradients(Stream& c, MoESaved& sv);

 protected:
  // The whole backward of a forward (input and, unless defer, weight gradients).
  virtual Tensor backward_pass(MoESaved& sv, const Tensor& dy, float grad_aux, bool defer);
  // One exchange of a chunk: src rows at the chunk's send segments to dst rows at its receive
  // segments (dispatch, combine backward), or the reverse (combine, dispatch backward). The
  // layer's is one all-to-all-v on `comm`; a schedule may route it otherwise (a two-level
  // exchange over the nodes: baselines/deepspeed_tp_ep).
  virtual void exchange(Stream& s, Communicator& comm, const Chunk& ch, const Tensor& src, Tensor& dst, bool reverse);
  // Whether backward_input may leave the weight gradients to backward_weight.
  virtual bool defers_weight_gradients() const { return true; }
  // After each expert linear's GEMMs (forward FC1, FC2; backward FC2 dgrad+wgrad, FC1
  // wgrad+dgrad): nothing here; FastMoE as published waits on the host (baselines/fastmoe).
  virtual void expert_linear_done(Stream&) {}
  // The per-expert GEMMs of one expert step: one grouped_gemm call, or (gemm_per_expert_) one
  // call per expert, as a loop of library calls over the experts issues them.
  void expert_gemm(Stream& c, const std::vector<GemmProblem>& ps, const char* name,
                   GemmEpilogue ep = GemmEpilogue::none);
  bool gemm_per_expert_ = false;
  ExpertLayout layout_ = ExpertLayout::packed;  // set_expert_layout
  void fc2_wgrad(Stream& c, const Chunk& ch, const Tensor& a, const Tensor& d_t_do);     // dW2 += A^T·dT_DO
  void fc1_wgrad(Stream& c, const Chunk& ch, const Tensor& t_di, const Tensor& d_t_m);  // dW1 += T_DI^T·dT_M
  // The experts whose gradient slices zero_grad left unwritten (see zero_grad), per weight.
  std::vector<char> unwritten_w1_, unwritten_w2_;
  // The beta of each weight-gradient problem of one call (ps[i] writes expert experts[i]'s
  // slice of grads): 0 where the call is the first writer of every slice, 1 where it is of none;
  // when it is of some only, those slices are zeroed first and all accumulate, so that the
  // call stays one batch (a backend batches only equal betas). One problem per call: each its
  // own.
  void set_wgrad_beta(Stream& c, std::vector<GemmProblem>& ps, const std::vector<std::int64_t>& experts,
                      std::vector<char>& unwritten, const Tensor& grads);
  // Zeroes the unwritten slices of the experts no chunk of `plan` computes.
  void zero_unrouted_expert_grads(Stream& c, const ChunkPlan& plan);
  void check_input(const Tensor& x) const;
  void check_output_grad(const MoESaved& sv, const Tensor& dy) const;

  // The chunks of this layer's schedule (called by dispatch_preprocess once T_I is made):
  // FastMoE's is one chunk exchanging with every rank.
  virtual ChunkPlan plan_chunks(MoESaved& sv);
  // Whether backward needs T_I again (kept in sv, an activation then).
  virtual bool keeps_t_i(const MoESaved&) const { return false; }
  // The forward of sv's work: route, dispatch_preprocess, the plan issued (issue_forward, with
  // the schedule's hooks if any), combine_postprocess.
  Forwarded run_forward(const Tensor& x, std::unique_ptr<MoESaved> saved, ChunkHooks* hooks = nullptr);
  // Its backward: combine_postprocess_backward, the plan issued backward, dispatch_preprocess_backward,
  // route_backward.
  Tensor run_backward(MoESaved& sv, const Tensor& dy, float grad_aux, bool defer, ChunkHooks* hooks = nullptr);
  static bool pipeline_buffers_go_first(const ChunkPlan& plan);

  Backend& b_;
  Communicator& comm_;
  ModelConfig cfg_;
  std::int64_t local_experts_;
  std::unique_ptr<MoEChannels> own_channels_;  // when none were given
  MoEChannels* channels_;
  Stream* compute_;
  Stream* dispatch_;
  Stream* combine_;
  Communicator* dispatch_comm_;
  Communicator* combine_comm_;
  EventPool events_;
  MoEParams params_, grads_;
  RoutingStats routing_;                 // of the last forward
  SavedPtr held_;                        // the one-in-flight API's handle
  std::uint64_t noise_seed_ = 0x5eed;
  std::optional<std::uint64_t> shared_noise_rank_;
  Communicator* seq_group_ = nullptr;  // partition_sequence
  std::vector<std::int64_t> routed_totals_;
  std::uint64_t step_ = 0;               // forwards of the one-in-flight API
  std::vector<float> last_eps_;
  std::vector<std::string> host_waits_;  // host_wait's log
  std::vector<std::vector<std::int64_t>> last_chunk_rows_;  // [chunks][El] of the last forward

  // Expert offloading: the forward's resident experts ([n,M,H], [n,H,M] on the device, n the
  // experts with rows; slot[l] their place, -1 for the others), held from the copy to the
  // unpermute.
  struct Resident {
    Tensor w1, w2;
    std::vector<std::int64_t> slot;
  };
  ExpertOffload offload_ = ExpertOffload::none;
  Resident resident_;
  std::unique_ptr<Event> copies_start_, copies_done_;
  void migrate_experts(Stream& c);  // end of dispatch_preprocess, with the plan
  Tensor expert_w1(std::int64_t l) const;  // [M,H] of local expert l where the GEMMs read it
  Tensor expert_w2(std::int64_t l) const;  // [H,M]
};

}  // namespace moelab
