// harness/runtime/backend.hpp — the one interface every system is written against.
//
// A system is plain stream-based C++: allocate tensors, issue ops on streams, record events
// and wait on them. The same code runs on three backends:
//   cpu   real fp32 data, OpenBLAS GEMM, each stream a worker thread, wall clock
//   cuda  real fp32/bf16 data, cuBLAS, CUDA streams/events, cudaMallocAsync pools
//   sim   shapes only; ops become nodes of a discrete-event model of a cluster
// Ops are asynchronous with respect to the host (as CUDA kernels are): they run in issue
// order on their stream. Memory follows CUDA's stream-ordered rules: a tensor's bytes are
// freed on the stream it was allocated on, so any other stream that uses it must be ordered
// before that point with an event.
//
// Shapes in comments: T tokens on this rank, M d_model, H d_hidden, E experts (global),
// k top-k, N dispatched rows (kept token-slots), El local experts.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "harness/runtime/timeline.hpp"
#include "harness/runtime/cost.hpp"
#include "harness/runtime/gemm_paths.hpp"
#include "harness/runtime/memory.hpp"
#include "harness/runtime/tensor.hpp"

namespace moelab {

enum class StreamRole { compute, dispatch, combine, h2d, d2h, aux };
const char* stream_role_name(StreamRole r);

class Stream {
 public:
  Stream(int id, StreamRole role, std::string name) : id_(id), role_(role), name_(std::move(name)) {}
  virtual ~Stream() = default;
  int id() const { return id_; }
  StreamRole role() const { return role_; }
  const std::string& name() const { return name_; }

 private:
  int id_;
  StreamRole role_;
  std::string name_;
};

class Event {
 public:
  virtual ~Event() = default;
};


// One GEMM of a grouped call: C = alpha * op(A) * op(B) + beta * C, all row-major.
// op(A) is [m,k] (A is [k,m] when trans_a), op(B) is [k,n] (B is [n,k] when trans_b).
// A and B share a dtype; C is that dtype or fp32. Problems with m, n or k == 0 are legal:
// (k == 0 scales C by beta).
struct GemmProblem {
  bool trans_a = false, trans_b = false;
  std::int64_t m = 0, n = 0, k = 0;
  Tensor a, b, c;
  float alpha = 1.0f, beta = 0.0f;
  // > 0: the token dimension (k of a weight gradient, A transposed; m otherwise) sits in a
  // layout of this many rows per problem whose rows past the problem's own are zero (the MoE
  // layer's padded expert layout, MoELayer::set_expert_layout): a call whose problems all carry the
  // same stride may be computed over the padded rows instead (padded_problem), one strided
  // batch of equal problems. 0: the problem's rows only.
  std::int64_t token_stride = 0;
  // The epilogue's auxiliary matrix [m,n] in C's dtype, laid out as C (Backend::
  // grouped_gemm_epilogue): the pre-activation it writes (act_aux) or reads (dact).
  Tensor aux{};
};

// The problem over its token_stride rows: the token dimension set to token_stride and the
// operands that carry it (A and C, or for a weight gradient A and B) widened to that many rows
// from the same first row (Tensor::widen_rows). Requires 0 <= rows <= token_stride.
GemmProblem padded_problem(const GemmProblem& p);
// The token stride every problem of a call shares, or 0 (none, or not all alike).
std::int64_t common_token_stride(std::span<const GemmProblem> problems);
// Throws (MOELAB_CHECK) unless every problem is one grouped_gemm_epilogue takes (see there).
void check_gemm_epilogue(std::span<const GemmProblem> problems, GemmEpilogue ep);

// Top-k gate, forward. Capacity follows GShard's priority: every token's first choice is
// placed before any second choice; within one choice rank, lower token index first. A slot
// past its expert's capacity is dropped (slot = -1, it contributes nothing to the output).
struct GateForward {
  Tensor logits;      // in  [T,E] fp32 (noise already added)
  int top_k = 1;
  std::int64_t capacity = 0;  // per expert; <= 0 means unlimited (no dropping)
  bool renormalize = false;   // weights = p / sum of the k chosen p (GShard top-2 style)
  Tensor probs;       // out [T,E] fp32 softmax(logits)
  Tensor topk_idx;    // out [T,k] int32 chosen experts, best first (ties: lower index)
  Tensor topk_w;      // out [T,k] fp32 gate weights
  Tensor slot;        // out [T,k] int32 row in the expert-sorted dispatch buffer, or -1
  Tensor counts;      // out [E] int32 kept slots per expert (rows of the buffer per expert)
  Tensor routed_frac; // out [E] fp32 f_e = slots routed to e before dropping / (T*k)
  Tensor aux_loss;    // out [1] fp32 E * sum_e f_e * P_e, P_e = mean_t probs[t,e]
  Tensor prob_mean;   // out [E] fp32 P_e (optional: undefined, nothing written)
};

// Top-k gate, backward: d_logits from the gradient of the gate weights and of the aux loss.
struct GateBackward {
  Tensor probs, topk_idx, topk_w;  // from the forward
  Tensor routed_frac;              // from the forward
  bool renormalize = false;
  Tensor d_topk_w;                 // in  [T,k] fp32
  float grad_aux = 0.0f;           // dL/d aux_loss
  Tensor d_logits;                 // out [T,E] fp32
};

// One optimizer step. SGD: p -= lr * (g + wd * p). Adam/AdamW (Kingma & Ba 2015; decoupled
// weight decay, Loshchilov & Hutter 2019): m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
// p -= lr * (m / (1-b1^t) / (sqrt(v / (1-b2^t)) + eps) + wd * p). Master weights and m, v
// are fp32 tensors in MemCategory::optimizer.
struct OptimizerStep {
  using Kind = OptimizerKind;
  Kind kind = Kind::adam;
  Tensor param;   // [n] in the model dtype (updated)
  Tensor grad;    // [n] in the model dtype (read)
  Tensor master;  // [n] fp32 master copy, or undefined when param is fp32
  Tensor m, v;    // [n] fp32 Adam moments (undefined for SGD)
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.0f;
  std::int64_t step = 1;  // t, from 1 (bias correction)
};

// What a backend knows of its machine, for cost models that choose a schedule (MPipeMoE's
// Eq. 10, §III-E). Every field 0 = unknown; `source` says where the known ones come from.
// sim: its cluster model (and calibration profile); cuda: the device's memory; cpu: nothing.
struct MachineRates {
  double gemm_flops = 0;       // FLOP/s of the asked GEMM shape and dtype, alone on the device
  double peak_flops = 0;       // the device's dense peak FLOP/s for that dtype (datasheet): MFU's denominator
  double a2a_bytes = 0;        // one rank's send bytes per second in an all-to-all over the world
                               // (over a smaller group: Backend::a2a_bytes_among)
  double host_copy_bytes = 0;  // pinned host <-> device, bytes/s per rank and direction, the rank alone
  // The same when every rank of the node copies at once (what a layer whose ranks all copy in
  // the same phase sees: GPUs behind one PCIe switch share its uplink). Equal to
  // host_copy_bytes where no link is shared; 0 = unknown.
  double host_copy_bytes_all_ranks = 0;
  double sigma = 0, mu = 0, eta = 0;  // interference: rate kept by compute / network / host copies
  double device_memory_bytes = 0;     // capacity of one device
  double host_memory_bytes = 0;       // host memory per rank (the node's / its GPUs)
  // The links, for a topology-aware model (impls/monta/strategy.hpp); 0 where the backend does
  // not know them (the sim backend takes them from its cluster model, at the share of each
  // link's rate its collectives reach: the node's p2p efficiencies).
  int gpus_per_node = 0, nics_per_node = 0;
  bool intra_pcie = false;                   // the node's GPUs talk over PCIe, not NVLink
  double intra_bw = 0, intra_latency = 0;    // one GPU's intra-node link, per direction
  double nic_bw = 0, nic_latency = 0;        // one NIC per direction; per message, fabric included
  double launch_latency = 0;                 // s per kernel / library call
  int world = 0;                             // ranks of the machine the rates describe (0: unknown)
  std::string source;
};

class Backend {
 public:
  virtual ~Backend() = default;

  virtual std::string name() const = 0;         // "cpu", "cuda", "sim"
  virtual std::string device_name() const = 0;  // "AMD EPYC ... (2 threads)", "NVIDIA H100 ..."
  virtual bool has_data() const { return true; }  // false on sim
  virtual bool supports(DType t) const = 0;
  virtual double now() const = 0;               // seconds; wall clock or virtual
  // Whether now() moves when `ranks` ranks synchronise among themselves (a barrier over their
  // group, then synchronize), so that they can time work they run: a device's clock always
  // does; the sim's only at a barrier of every rank of the run, where its engine runs.
  virtual bool clock_moves_in_group(int ranks) const {
    (void)ranks;
    return true;
  }

  // ---- streams and events ------------------------------------------------------------
  virtual Stream& create_stream(StreamRole role, const std::string& name) = 0;
  virtual std::unique_ptr<Event> create_event() = 0;
  virtual void record(Event& e, Stream& s) = 0;  // e completes when s reaches this point
  virtual void wait(Stream& s, Event& e) = 0;    // s waits for e's last record
  virtual void synchronize(Stream& s) = 0;       // host waits; rethrows a failed op's error
  virtual void synchronize() = 0;                // all streams
  Stream& default_stream();                      // the first compute stream (created on demand)

  // ---- memory --------------------------------------------------------------------------
  // Uninitialised tensor, charged to `category`, ordered on stream s.
  Tensor empty(std::vector<std::int64_t> shape, DType dtype, MemCategory category, Stream& s,
               MemSpace space = MemSpace::device);
  MemoryTracker& memory() { return memory_; }
  const MemoryTracker& memory() const { return memory_; }
  // The device allocator's own high-water marks since reset_device_pool_peak(), beside the
  // tracked allocator's count (memory()): cuda reads its stream-ordered pool (bytes in use,
  // and bytes the pool holds from the driver), which also sees what the tracker does not
  // (cuBLAS/CUB workspaces, GEMM pointer arrays, fragmentation). cpu and sim have none.
  struct DevicePoolPeak {
    std::uint64_t used_high = 0;
    std::uint64_t reserved_high = 0;
  };
  virtual std::optional<DevicePoolPeak> device_pool_peak() const { return std::nullopt; }
  virtual void reset_device_pool_peak() {}
  // Waits for every stream, then gives the cached pinned host blocks back to the driver (cuda:
  // HostPool::empty_cache; releasing pinned memory synchronises the device anyway, so call it
  // only where a one-off stall is acceptable, e.g. after a search's trial runs). Blocks in use
  // stay. cpu and sim cache no pinned memory: nothing to do, and no wait.
  virtual void release_cached_host_memory() {}

  // Blocking host<->tensor transfers for set-up, checks and tests (fp32 on the host side;
  // converted to/from the tensor's dtype). Each first waits for the work already issued on
  // the tensor's own stream (Tensor::stream()); work on other streams must be synchronised
  // by the caller. No-ops on sim.
  virtual void upload(std::span<const float> host, Tensor& dst) = 0;
  virtual std::vector<float> download(const Tensor& src) = 0;
  virtual void upload_i32(std::span<const std::int32_t> host, Tensor& dst) = 0;
  virtual std::vector<std::int32_t> download_i32(const Tensor& src) = 0;

  // ---- ops (asynchronous, in stream order) ---------------------------------------------
  // dst = src: same numel, any memory spaces; when the dtypes differ (fp32 <-> bf16) the
  // values are converted (round to nearest even).
  virtual void copy(Stream& s, const Tensor& src, Tensor& dst) = 0;
  virtual void fill_zero(Stream& s, Tensor& t) = 0;
  virtual void grouped_gemm(Stream& s, std::span<const GemmProblem> problems, const char* name) = 0;
  void gemm(Stream& s, const GemmProblem& p, const char* name) { grouped_gemm(s, {&p, 1}, name); }
  // The grouped GEMM with the activation fused into its epilogue (GemmEpilogue): act_aux writes
  // each problem's product to its aux and act(product) to its C; dact writes product ·
  // act'(aux) to C. Every problem has alpha 1, beta 0, A not transposed (the token rows are m)
  // and an aux of C's shape and dtype. This default runs it unfused, as ops of their own: the
  // GEMMs (into aux for act_aux), then the activation over each problem's rows; a backend that
  // runs it as one op (cuda: cuBLASLt's GELU epilogues, for gelu_tanh) overrides it and says so
  // in fuses_gemm_epilogue, which a layer asks before it issues this instead of the pair.
  virtual void grouped_gemm_epilogue(Stream& s, std::span<const GemmProblem> problems, GemmEpilogue ep,
                                     Activation act, const char* name);
  virtual bool fuses_gemm_epilogue(Activation act, DType t) const {
    (void)act, (void)t;
    return false;
  }

  // logits = clean + eps * softplus(noise_raw)                       all [T,E] fp32
  virtual void noisy_logits(Stream& s, const Tensor& clean, const Tensor& noise_raw, const Tensor& eps,
                            Tensor& logits) = 0;
  // d_noise_raw = d_logits * eps * sigmoid(noise_raw)                 all [T,E] fp32
  virtual void noisy_logits_backward(Stream& s, const Tensor& d_logits, const Tensor& noise_raw,
                                     const Tensor& eps, Tensor& d_noise_raw) = 0;
  virtual void gate_forward(Stream& s, GateForward& g) = 0;
  virtual void gate_backward(Stream& s, GateBackward& g) = 0;

  // out[slot[t,j]] = x[t] for every kept slot             x [T,M], slot [T,k], out [N,M]
  virtual void permute(Stream& s, const Tensor& x, const Tensor& slot, Tensor& out) = 0;
  // dx[t] = sum_j d_out[slot[t,j]] over kept slots (overwrites dx)
  virtual void permute_backward(Stream& s, const Tensor& d_out, const Tensor& slot, Tensor& dx) = 0;
  // y[t] = sum_j w[t,j] * y_perm[slot[t,j]] over kept slots    y_perm [N,M], w [T,k] fp32, y [T,M]
  virtual void unpermute(Stream& s, const Tensor& y_perm, const Tensor& slot, const Tensor& w, Tensor& y) = 0;
  // d_y_perm[slot[t,j]] = w[t,j] * dy[t];  dw[t,j] = <dy[t], y_perm[slot[t,j]]> (0 if dropped)
  virtual void unpermute_backward(Stream& s, const Tensor& dy, const Tensor& y_perm, const Tensor& slot,
                                  const Tensor& w, Tensor& d_y_perm, Tensor& dw) = 0;

  // out = act(in);  d_in = d_out * act'(in)  (d_in may alias d_out). gelu is the exact erf form,
  // gelu_tanh its tanh approximation (op_types.hpp).
  virtual void activation_forward(Stream& s, Activation a, const Tensor& in, Tensor& out) = 0;
  virtual void activation_backward(Stream& s, Activation a, const Tensor& in, const Tensor& d_out,
                                   Tensor& d_in) = 0;

  // ---- transformer-block ops (harness/nn/blocks.hpp composes them) -------------------
  // Shapes: T = B*S tokens of a microbatch (B sequences of S tokens, token t at position
  // t mod S), M d_model, V vocabulary, Hq query heads, Hkv key/value heads, D head_dim.
  // Reductions (norm statistics, softmax, loss) accumulate in fp32 whatever the dtype.
  // Input-gradient ops overwrite their output; parameter-gradient outputs accumulate (+=).

  // out[t] = wte[ids[t]] (+ wpe[t mod S] when wpe is defined: learned positions)
  //   ids [T] int32, wte [V,M], wpe [P,M] (P >= S) or undefined, out [T,M]
  // With a shard, wte holds rows [start, start + V) of the vocabulary: an id outside them gives
  // a row of zeros (+ wpe), so that the shards' outputs sum to the whole table's.
  virtual void embedding_forward(Stream& s, const Tensor& ids, const Tensor& wte, const Tensor& wpe,
                                 std::int64_t seq_len, Tensor& out, const VocabShard& shard = {});
  // d_wte[ids[t]] += d_out[t]; d_wpe[t mod S] += d_out[t] (when d_wpe is defined); with a
  // shard, d_wte[ids[t] - start] for the ids in it only.
  virtual void embedding_backward(Stream& s, const Tensor& d_out, const Tensor& ids, std::int64_t seq_len,
                                  Tensor& d_wte, Tensor& d_wpe, const VocabShard& shard = {});

  // y = (x - mean) * rstd * gamma + beta  (layernorm; beta may be undefined = 0)
  // y = x * rstd * gamma                  (rmsnorm: rstd = 1/sqrt(mean(x^2) + eps))
  //   x, y [T,M]; gamma, beta [M]; mean (layernorm only), rstd [T] fp32, saved for backward
  virtual void norm_forward(Stream& s, NormKind kind, float eps, const Tensor& x, const Tensor& gamma,
                            const Tensor& beta, Tensor& y, Tensor& mean, Tensor& rstd);
  // dx = d(norm)/dx^T dy (overwrites dx); d_gamma += ..., d_beta += ... (when defined)
  virtual void norm_backward(Stream& s, NormKind kind, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                             const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor& d_gamma, Tensor& d_beta);

  // Rotary position embedding (RoFormer, Su et al. 2021; LLaMA's pairing of dimension i with
  // i + D/2) applied in place to the query and key heads of a packed qkv [T,(Hq+2Hkv)*D]
  // tensor, angle (t mod S) * theta^(-2i/D). inverse = true rotates back (its backward).
  virtual void rope(Stream& s, const AttentionShape& a, float theta, bool inverse, Tensor& qkv);

  // Scaled dot-product attention, tiled with an online softmax (FlashAttention, Dao et al.
  // 2022): no [S,S] score matrix is ever stored. qkv [T,(Hq+2Hkv)*D] packed per token as
  // the Hq query heads, then the Hkv key heads, then the Hkv value heads; query head h reads
  // key/value head h / (Hq/Hkv) (grouped-query attention; Hkv = Hq is multi-head).
  // out [T,Hq*D]; lse [B,Hq,S] fp32, the log-sum-exp of each score row, saved for backward.
  virtual void attention_forward(Stream& s, const AttentionShape& a, const Tensor& qkv, Tensor& out, Tensor& lse);
  // d_qkv [T,(Hq+2Hkv)*D] (overwritten) from d_out, recomputing the scores tile by tile.
  virtual void attention_backward(Stream& s, const AttentionShape& a, const Tensor& qkv, const Tensor& out,
                                  const Tensor& lse, const Tensor& d_out, Tensor& d_qkv);

  // SwiGLU (Shazeer 2020): h [T,2F] = [gate | up] -> out [T,F] = silu(gate) * up
  virtual void swiglu_forward(Stream& s, const Tensor& h, Tensor& out);
  virtual void swiglu_backward(Stream& s, const Tensor& h, const Tensor& d_out, Tensor& d_h);

  // out = a + b (elementwise, same shape and dtype; out may alias a or b): residual adds and
  // gradient accumulation.
  virtual void add(Stream& s, const Tensor& a, const Tensor& b, Tensor& out);
  // out = alpha * x (same numel and dtype; out may alias x): a gradient averaged over the
  // copies that summed it (harness/nn/grad_sync.hpp).
  virtual void scale(Stream& s, const Tensor& x, float alpha, Tensor& out);

  // The gated sum of two branch outputs (ScMoE's combine gates, Cai et al., arXiv 2404.05019,
  // §3: CG-1 and CG-2; DeepSpeed's code weighs its Residual-MoE's two branches by a CG-2 softmax,
  // which the `residual-moe` baseline does not: it adds them). z [T,G] fp32 holds each
  // token's gate logits:
  //   G = 1: c_a = sigmoid(z[t,0]), c_b = 1;     G = 2: (c_a, c_b) = softmax(z[t,0], z[t,1])
  //   out[t] = c_a·a[t] + c_b·b[t]                a, b, out [T,M] (out may alias a or b)
  virtual void gated_combine_forward(Stream& s, const Tensor& z, const Tensor& a, const Tensor& b, Tensor& out);
  // da = c_a·d_out, db = c_b·d_out [T,M] (overwritten; either may alias d_out; with G = 1, db may
  // be undefined: it would be d_out, and b is then not read); dz [T,G] fp32 (overwritten), with
  // p_i = <d_out[t], x_i[t]>:
  //   G = 1: dz = c_a·(1 − c_a)·p_a;              G = 2: dz_i = c_i·(p_i − c_a·p_a − c_b·p_b)
  virtual void gated_combine_backward(Stream& s, const Tensor& z, const Tensor& a, const Tensor& b,
                                      const Tensor& d_out, Tensor& da, Tensor& db, Tensor& dz);

  // Softmax cross-entropy, fused (llm.c style): logits [T,V] (any float dtype), targets [T]
  // int32 (a target < 0 is ignored: loss 0, no gradient). losses [T] fp32, lse [T] fp32.
  // With a shard the logits are columns [start, start + V) of a vocabulary of `total`: lse is
  // the shard's own, and losses[t] = lse[t] - logits[t, target - start] for a target in the
  // shard, 0 for one outside it (cross_entropy_combine makes the whole row's loss of the shards').
  virtual void cross_entropy_forward(Stream& s, const Tensor& logits, const Tensor& targets, Tensor& losses,
                                     Tensor& lse, const VocabShard& shard = {});
  // d_logits = scale * (softmax(logits) - onehot(target)) per counted row (0 for ignored rows);
  // with a shard, lse is the whole row's (cross_entropy_combine) and the one-hot is 1 only for
  // a target in the shard.
  virtual void cross_entropy_backward(Stream& s, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                                      float scale, Tensor& d_logits, const VocabShard& shard = {});
  // The whole vocabulary's loss from P equal shards of `shard_rows` columns each (Megatron's
  // vocabulary-parallel cross-entropy): parts [P,2,T] fp32 holds every shard's cross_entropy_forward
  // losses (row 0) and lse (row 1), as an all-gather stacks them. lse[t] = log Σ_p exp(lse_p[t]);
  // losses[t] = lse[t] - logit of the target, read from its own shard p = target / shard_rows as
  // lse_p[t] - losses_p[t] (0 for an ignored target). targets [T] int32, losses and lse [T] fp32.
  virtual void cross_entropy_combine(Stream& s, const Tensor& parts, const Tensor& targets, std::int64_t shard_rows,
                                     Tensor& losses, Tensor& lse);

  // One optimizer step on one parameter tensor (see OptimizerStep). Reads grad, updates the
  // fp32 master copy (or the parameter itself when it is fp32 and master is undefined), the
  // state, then writes the parameter in its dtype.
  virtual void optimizer_step(Stream& s, const OptimizerStep& o);

  // Seconds (median of `reps`) that the backend's GEMM library needs for exactly these GEMMs
  // issued one by one with nothing of moelab around them: the yardstick for the experts'
  // time (cpu: cblas_sgemm; cuda: cublasGemmEx). Synchronises the device.
  virtual double time_bare_gemms(std::span<const GemmProblem> problems, int reps) = 0;
  // The same, but each run of equal problems whose operands sit at fixed strides
  // (strided_runs, harness/runtime/gemm_paths.hpp) issued as one batched library call: the
  // GEMM floor's yardstick (cuda: cublasGemmStridedBatchedEx). A backend without a batched
  // path times them one by one, as time_bare_gemms does (cpu: cblas_sgemm; sim: its cost model).
  virtual double time_batched_gemms(std::span<const GemmProblem> problems, int reps) {
    return time_bare_gemms(problems, reps);
  }
  // sim: its GEMM calibration prices each library path (then time_batched_gemms prices
  // strided runs on the strided-batched curve); false elsewhere.
  virtual bool prices_gemm_paths() const { return false; }
  // The library path of each grouped_gemm decision so far, per op name (GemmPathLedger):
  // cuda, the path each ran on; sim, where its calibration prices paths, the path each was
  // priced on (the cuda backend's choice from the same table, or the loop where the
  // calibration has no curve for the chosen path); empty elsewhere.
  virtual std::vector<GemmPathUse> gemm_path_uses() const { return {}; }

  // The machine's rates (see MachineRates); gemm_flops for an [m,k]x[k,n] GEMM in dtype t.
  virtual MachineRates machine_rates(std::int64_t m, std::int64_t n, std::int64_t k, DType t) const {
    (void)m, (void)n, (void)k, (void)t;
    return {};
  }

  // MachineRates::a2a_bytes for an all-to-all among `world_ranks` only (a group's members,
  // Communicator::world_ranks()): one member's send bytes per second, the slowest member's,
  // with the bytes spread evenly over the group. An expert-parallel group smaller than the
  // world (expert data parallelism) may stay on one node's NVLink where the world's crosses
  // the NICs. 0 = unknown (cpu, cuda); the sim gives it from its cluster model.
  virtual double a2a_bytes_among(std::span<const int> world_ranks) const {
    (void)world_ranks;
    return 0;
  }

  // fp32 GEMMs on TF32 tensor cores (ModelConfig::allow_tf32): cuda switches cuBLAS's compute
  // type, sim prices them at the TF32 peak, cpu ignores it (exact fp32).
  virtual void set_allow_tf32(bool on) { allow_tf32_ = on; }
  bool allow_tf32() const { return allow_tf32_; }

  // ---- moving saved activations between device and pinned host memory ------------------
  // (PipeOffload, Wan et al. 2025: a pipeline stage offloads what a forward saved for its
  // backward and reloads it before the backward; harness/pipeline/executor.cpp.)
  // While a capture is started, every storage Backend::empty makes is recorded (weakly), so a
  // caller can find what a forward left alive without the layers listing their saved tensors.
  // Captures do not nest: start_capture throws while one is running.
  void start_capture();
  std::vector<std::weak_ptr<Storage>> stop_capture();
  // Moves the bytes of `st` to `space` (device <-> host_pinned), charged to `category` and to
  // the storage's own microbatch: the new bytes are allocated ordered on `alloc_on`, copied on
  // `copy_on` (which the caller has ordered after every op that wrote them), and every handle
  // of the storage (views included) then refers to the new bytes; the old bytes are freed
  // ordered on `copy_on`, after the copy. Bit for bit: the copy reinterprets nothing. The caller
  // orders every later use of the storage after `copy_on`'s copy (an event).
  void relocate(const std::shared_ptr<Storage>& st, MemSpace space, MemCategory category, Stream& alloc_on,
                Stream& copy_on);

  // ---- timeline ------------------------------------------------------------------------
  // Ops issued while a PhaseScope is alive carry its label in the timeline.
  void set_phase(std::string phase) { phase_ = std::move(phase); }
  const std::string& phase() const { return phase_; }
  // Ops issued while a NodeScope is alive carry the pipeline schedule node they belong to
  // ("F3.1": the forward of microbatch 3, chunk 1; harness/pipeline/executor.hpp), so that a
  // timeline can be drawn and measured per node.
  void set_node(std::string node) { node_ = std::move(node); }
  const std::string& node() const { return node_; }
  // Allocations made while a microbatch is current are charged to it as well (see
  // MemoryTracker); MicrobatchScope sets it for a block of code.
  void set_microbatch(int mb) { microbatch_ = mb; }
  int microbatch() const { return microbatch_; }
  void set_rank(int rank) { rank_ = rank; }
  int rank() const { return rank_; }
  // All ops completed so far (call after synchronize()).
  virtual std::vector<OpRecord> timeline() = 0;
  virtual void clear_timeline() = 0;
  // No figure reads the times of what this rank issued since the backend last fixed times
  // (the warm-up's last stretch, before clear_timeline). A real backend runs it as issued; the
  // sim backend, deterministic and without caches to warm, may leave it unpriced when every
  // rank marked it and the world is synchronized at the next barrier: it then takes no virtual
  // time. Memory and routing are unaffected (they follow the order of issue, not time).
  virtual void mark_untimed() {}

 protected:
  virtual void* raw_alloc(std::size_t bytes, MemSpace space, Stream& s) = 0;
  virtual void raw_free(void* p, std::size_t bytes, MemSpace space, Stream& s) = 0;

  MemoryTracker memory_;
  std::string phase_ = "other";
  std::string node_;
  int microbatch_ = kNoMicrobatch;
  int rank_ = 0;
  bool allow_tf32_ = false;
  Stream* default_stream_ = nullptr;
  bool capturing_ = false;
  std::vector<std::weak_ptr<Storage>> captured_;
};

class PhaseScope {
 public:
  PhaseScope(Backend& b, std::string phase) : b_(b), saved_(b.phase()) { b_.set_phase(std::move(phase)); }
  ~PhaseScope() { b_.set_phase(saved_); }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  Backend& b_;
  std::string saved_;
};

class NodeScope {
 public:
  NodeScope(Backend& b, std::string node) : b_(b), saved_(b.node()) { b_.set_node(std::move(node)); }
  ~NodeScope() { b_.set_node(saved_); }
  NodeScope(const NodeScope&) = delete;
  NodeScope& operator=(const NodeScope&) = delete;

 private:
  Backend& b_;
  std::string saved_;
};

class MicrobatchScope {
 public:
  MicrobatchScope(Backend& b, int mb) : b_(b), saved_(b.microbatch()) { b_.set_microbatch(mb); }
  ~MicrobatchScope() { b_.set_microbatch(saved_); }
  MicrobatchScope(const MicrobatchScope&) = delete;
  MicrobatchScope& operator=(const MicrobatchScope&) = delete;

 private:
  Backend& b_;
  int saved_;
};

// Backends by name: "cpu" (always), "cuda" (when built with CUDA). Throws ConfigError for
// an unknown or unavailable name.
std::unique_ptr<Backend> make_backend(const std::string& name);
bool cuda_available();  // built with CUDA and a device is present

}  // namespace moelab
