// harness/backends/cpu/cpu_backend.hpp — the cpu backend: real fp32 data, OpenBLAS GEMM,
// one worker thread per stream so that streams really run concurrently, wall-clock time.
//
// Every op is a task queued on its stream's worker; events are generation counters that a
// worker sets when it reaches the record and another worker waits on. Frees are deferred
// until every stream has finished the work issued before the free, so a buffer is never
// reclaimed while a queued op may still read it.
#pragma once
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "harness/runtime/backend.hpp"

namespace moelab {

class CpuBackend final : public Backend {
 public:
  CpuBackend();
  ~CpuBackend() override;

  std::string name() const override { return "cpu"; }
  std::string device_name() const override;
  bool supports(DType t) const override { return t != DType::bf16; }
  double now() const override;

  Stream& create_stream(StreamRole role, const std::string& name) override;
  std::unique_ptr<Event> create_event() override;
  void record(Event& e, Stream& s) override;
  void wait(Stream& s, Event& e) override;
  void synchronize(Stream& s) override;
  void synchronize() override;

  void upload(std::span<const float> host, Tensor& dst) override;
  // Every allocation from now on starts as NaN (all bits set) instead of whatever the heap
  // held: a test sets it so that a read of memory nobody wrote shows (cpu_poison_new_memory).
  void poison_new_memory(bool on) { poison_ = on; }
  // A padded call (GemmProblem::token_stride) runs over the padded rows; with this set only the
  // weight gradients do, the others over the problems' own rows: what a GPU does when its
  // table picks the strided batch for the weight gradients alone, which leaves the padding rows
  // of the other GEMMs' outputs unwritten (cpu_pad_only_weight_gradients; tests).
  void pad_only_weight_gradients(bool on) { pad_only_wgrad_ = on; }
  std::vector<float> download(const Tensor& src) override;
  void upload_i32(std::span<const std::int32_t> host, Tensor& dst) override;
  std::vector<std::int32_t> download_i32(const Tensor& src) override;

  void copy(Stream& s, const Tensor& src, Tensor& dst) override;
  void fill_zero(Stream& s, Tensor& t) override;
  void grouped_gemm(Stream& s, std::span<const GemmProblem> problems, const char* name) override;
  // The tanh GeLU in the GEMM's op, as the cuda backend fuses it (the other activations: the
  // default's separate ops, which the layer then issues itself).
  void grouped_gemm_epilogue(Stream& s, std::span<const GemmProblem> problems, GemmEpilogue ep, Activation act,
                             const char* name) override;
  bool fuses_gemm_epilogue(Activation act, DType) const override { return act == Activation::gelu_tanh; }
  void noisy_logits(Stream& s, const Tensor& clean, const Tensor& noise_raw, const Tensor& eps,
                    Tensor& logits) override;
  void noisy_logits_backward(Stream& s, const Tensor& d_logits, const Tensor& noise_raw, const Tensor& eps,
                             Tensor& d_noise_raw) override;
  void gate_forward(Stream& s, GateForward& g) override;
  void gate_backward(Stream& s, GateBackward& g) override;
  void permute(Stream& s, const Tensor& x, const Tensor& slot, Tensor& out) override;
  void permute_backward(Stream& s, const Tensor& d_out, const Tensor& slot, Tensor& dx) override;
  void unpermute(Stream& s, const Tensor& y_perm, const Tensor& slot, const Tensor& w, Tensor& y) override;
  void unpermute_backward(Stream& s, const Tensor& dy, const Tensor& y_perm, const Tensor& slot, const Tensor& w,
                          Tensor& d_y_perm, Tensor& dw) override;
  void activation_forward(Stream& s, Activation a, const Tensor& in, Tensor& out) override;
  void activation_backward(Stream& s, Activation a, const Tensor& in, const Tensor& d_out,
                           Tensor& d_in) override;

  // Transformer-block ops: cpu_blocks.cpp.
  void embedding_forward(Stream& s, const Tensor& ids, const Tensor& wte, const Tensor& wpe, std::int64_t seq_len,
                         Tensor& out, const VocabShard& shard) override;
  void embedding_backward(Stream& s, const Tensor& d_out, const Tensor& ids, std::int64_t seq_len, Tensor& d_wte,
                          Tensor& d_wpe, const VocabShard& shard) override;
  void norm_forward(Stream& s, NormKind kind, float eps, const Tensor& x, const Tensor& gamma, const Tensor& beta,
                    Tensor& y, Tensor& mean, Tensor& rstd) override;
  void norm_backward(Stream& s, NormKind kind, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                     const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor& d_gamma, Tensor& d_beta) override;
  void rope(Stream& s, const AttentionShape& a, float theta, bool inverse, Tensor& qkv) override;
  void attention_forward(Stream& s, const AttentionShape& a, const Tensor& qkv, Tensor& out, Tensor& lse) override;
  void attention_backward(Stream& s, const AttentionShape& a, const Tensor& qkv, const Tensor& out, const Tensor& lse,
                          const Tensor& d_out, Tensor& d_qkv) override;
  void swiglu_forward(Stream& s, const Tensor& h, Tensor& out) override;
  void swiglu_backward(Stream& s, const Tensor& h, const Tensor& d_out, Tensor& d_h) override;
  void add(Stream& s, const Tensor& a, const Tensor& b, Tensor& out) override;
  void gated_combine_forward(Stream& s, const Tensor& z, const Tensor& a, const Tensor& b, Tensor& out) override;
  void gated_combine_backward(Stream& s, const Tensor& z, const Tensor& a, const Tensor& b, const Tensor& d_out,
                              Tensor& da, Tensor& db, Tensor& dz) override;
  void scale(Stream& s, const Tensor& x, float alpha, Tensor& out) override;
  void cross_entropy_forward(Stream& s, const Tensor& logits, const Tensor& targets, Tensor& losses, Tensor& lse,
                             const VocabShard& shard) override;
  void cross_entropy_backward(Stream& s, const Tensor& logits, const Tensor& targets, const Tensor& lse, float scale,
                              Tensor& d_logits, const VocabShard& shard) override;
  void cross_entropy_combine(Stream& s, const Tensor& parts, const Tensor& targets, std::int64_t shard_rows,
                             Tensor& losses, Tensor& lse) override;
  void optimizer_step(Stream& s, const OptimizerStep& o) override;

  double time_bare_gemms(std::span<const GemmProblem> problems, int reps) override;

  std::vector<OpRecord> timeline() override { return timeline_.records(); }
  void clear_timeline() override { timeline_.clear(); }

  // Queue host work on a stream as one timed op (used by the ops above and by the MPI
  // communicator). The phase is taken now, at issue time.
  void enqueue(Stream& s, std::string name, OpCost cost, std::function<void()> fn);

 protected:
  void* raw_alloc(std::size_t bytes, MemSpace space, Stream& s) override;
  void raw_free(void* p, std::size_t bytes, MemSpace space, Stream& s) override;

 private:
  struct Worker;
  struct PendingFree {
    void* ptr;
    std::vector<std::uint64_t> fence;  // per-stream issued-task count at free time
  };
  Worker& worker(Stream& s);
  void reclaim();  // frees whose fences have passed

  std::chrono::steady_clock::time_point t0_;
  std::vector<std::unique_ptr<Worker>> workers_;
  std::mutex free_mu_;
  std::vector<PendingFree> pending_;
  Timeline timeline_;
  bool poison_ = false;
  bool pad_only_wgrad_ = false;
};

// CpuBackend::poison_new_memory on a backend that make_backend("cpu") made; throws
// std::invalid_argument if it is not a cpu backend.
void cpu_poison_new_memory(Backend& b, bool on);
void cpu_pad_only_weight_gradients(Backend& b, bool on);

// Throws Unsupported unless t is fp32 (the cpu backend's only float dtype).
void cpu_require_f32(const Tensor& t, const char* what);

// Single-threaded fp32 GEMM used by the cpu backend (cblas_sgemm, or a plain loop when
// built without BLAS). Row-major, see GemmProblem.
void cpu_sgemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
               const float* a, const float* b, float beta, float* c);

}  // namespace moelab
