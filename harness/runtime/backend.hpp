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

#include "harness/metrics/timeline.hpp"
#include "harness/runtime/cost.hpp"
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

enum class Activation { gelu, relu };
const char* activation_name(Activation a);
Activation parse_activation(const std::string& s);  // throws ConfigError

// One GEMM of a grouped call: C = alpha * op(A) * op(B) + beta * C, all row-major.
// op(A) is [m,k] (A is [k,m] when trans_a), op(B) is [k,n] (B is [n,k] when trans_b).
// A and B share a dtype; C is that dtype or fp32. Problems with m, n or k == 0 are legal:
// (k == 0 scales C by beta).
struct GemmProblem {
  bool trans_a = false, trans_b = false;
  std::int64_t m = 0, n = 0, k = 0;
  Tensor a, b, c;
  float alpha = 1.0f, beta = 0.0f;
};

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

// What a backend knows of its machine, for cost models that choose a schedule (MPipeMoE's
// Eq. 10, §III-E). Every field 0 = unknown; `source` says where the known ones come from.
// sim: its cluster model (and calibration profile); cuda: the device's memory; cpu: nothing.
struct MachineRates {
  double gemm_flops = 0;       // FLOP/s of the asked GEMM shape and dtype, alone on the device
  double a2a_bytes = 0;        // one rank's send bytes per second in an all-to-all over the world
  double host_copy_bytes = 0;  // pinned host <-> device, bytes/s per rank and direction
  double sigma = 0, mu = 0, eta = 0;  // interference: rate kept by compute / network / host copies
  double device_memory_bytes = 0;     // capacity of one device
  double host_memory_bytes = 0;       // host memory per rank (the node's / its GPUs)
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

  // out = act(in);  d_in = d_out * act'(in)  (d_in may alias d_out). GeLU is the exact erf form.
  virtual void activation_forward(Stream& s, Activation a, const Tensor& in, Tensor& out) = 0;
  virtual void activation_backward(Stream& s, Activation a, const Tensor& in, const Tensor& d_out,
                                   Tensor& d_in) = 0;

  // Seconds (median of `reps`) that the backend's GEMM library needs for exactly these GEMMs
  // issued one by one with nothing of moelab around them: the yardstick for the experts'
  // time (cpu: cblas_sgemm; cuda: cublasGemmEx). Synchronises the device.
  virtual double time_bare_gemms(std::span<const GemmProblem> problems, int reps) = 0;

  // The machine's rates (see MachineRates); gemm_flops for an [m,k]x[k,n] GEMM in dtype t.
  virtual MachineRates machine_rates(std::int64_t m, std::int64_t n, std::int64_t k, DType t) const {
    (void)m, (void)n, (void)k, (void)t;
    return {};
  }

  // fp32 GEMMs on TF32 tensor cores (ModelConfig::allow_tf32): cuda switches cuBLAS's compute
  // type, sim prices them at the TF32 peak, cpu ignores it (exact fp32).
  virtual void set_allow_tf32(bool on) { allow_tf32_ = on; }
  bool allow_tf32() const { return allow_tf32_; }

  // ---- timeline ------------------------------------------------------------------------
  // Ops issued while a PhaseScope is alive carry its label in the timeline.
  void set_phase(std::string phase) { phase_ = std::move(phase); }
  const std::string& phase() const { return phase_; }
  void set_rank(int rank) { rank_ = rank; }
  int rank() const { return rank_; }
  // All ops completed so far (call after synchronize()).
  virtual std::vector<OpRecord> timeline() = 0;
  virtual void clear_timeline() = 0;

 protected:
  virtual void* raw_alloc(std::size_t bytes, MemSpace space, Stream& s) = 0;
  virtual void raw_free(void* p, std::size_t bytes, MemSpace space, Stream& s) = 0;

  MemoryTracker memory_;
  std::string phase_ = "other";
  int rank_ = 0;
  bool allow_tf32_ = false;
  Stream* default_stream_ = nullptr;
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

// Backends by name: "cpu" (always), "cuda" (when built with CUDA). Throws ConfigError for
// an unknown or unavailable name.
std::unique_ptr<Backend> make_backend(const std::string& name);
bool cuda_available();  // built with CUDA and a device is present

}  // namespace moelab
