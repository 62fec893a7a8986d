// harness/backends/cuda/cuda_backend.cpp — CudaBackend: streams, events, the stream-ordered
// allocator and the pinned host pool, cuBLAS GEMMs (each grouped call on the path
// choose_gemm_path picks: a loop of cublasGemmEx, cublasGemmStridedBatchedEx or
// cublasGemmGroupedBatchedEx; docs/GPU.md, "Expert GEMM paths"), copies, the timeline of
// timed ops, and the launch of the hand-written kernels (kernels.cu: gate, row movers,
// activations; block_kernels.cu: the transformer-block ops).
//
// Host code only (compiled by the host compiler); the device code lives in the .cu files.
#include "harness/backends/cuda/cuda_backend.hpp"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <set>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "harness/backends/cuda/block_kernels.hpp"
#include "harness/backends/cuda/combine_kernels.hpp"
#include "harness/backends/cuda/kernels.hpp"
#include "harness/runtime/error.hpp"

namespace moelab {

namespace {

void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("cuda: ") + what + " failed: " + cudaGetErrorName(err) + " (" +
                             cudaGetErrorString(err) + ")");
}

void cublas_check(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS)
    throw std::runtime_error(std::string("cublas: ") + what + " failed: " + cublasGetStatusString(st));
}

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::f32: return CUDA_R_32F;
    case DType::bf16: return CUDA_R_16BF;
    default: break;
  }
  throw Unsupported(std::string("the cuda backend's GEMM does not support ") + dtype_name(t));
}

cuda_kernels::Elem elem_of(const Tensor& t) {
  switch (t.dtype()) {
    case DType::f32: return cuda_kernels::Elem::f32;
    case DType::bf16: return cuda_kernels::Elem::bf16;
    default: break;
  }
  throw Unsupported(std::string("the cuda backend's row and activation kernels take fp32 or bf16, not ") +
                    dtype_name(t.dtype()));
}

cuda_kernels::Act act_of(Activation a) {
  switch (a) {
    case Activation::gelu: return cuda_kernels::Act::gelu;
    case Activation::relu: return cuda_kernels::Act::relu;
    case Activation::gelu_tanh: return cuda_kernels::Act::gelu_tanh;
  }
  throw Unsupported("the cuda backend has no kernel for this activation");
}

int to_int(std::int64_t v, const char* what) {
  MOELAB_CHECK(v >= 0 && v <= std::numeric_limits<int>::max(), std::string(what) + " out of int range");
  return static_cast<int>(v);
}

// The (T, k) of a [T,k] slot / top-k tensor.
std::pair<std::int64_t, int> rows_and_k(const Tensor& slot) {
  MOELAB_CHECK(slot.ndim() == 2 && slot.dtype() == DType::i32, "slot must be [T,k] int32, got " + slot.describe());
  return {slot.dim(0), to_int(slot.dim(1), "top-k")};
}

std::int64_t width_of(const Tensor& t) { return t.ndim() == 0 ? 1 : t.dim(-1); }
std::int64_t rows_of(const Tensor& t) {
  const std::int64_t w = width_of(t);
  return w ? t.numel() / w : 0;
}

const float* f32p(const Tensor& t) { return t.data<float>(); }
float* f32p(Tensor& t) { return t.data<float>(); }
const std::int32_t* i32p(const Tensor& t) { return t.data<std::int32_t>(); }

void require_f32(const Tensor& t, const char* what) {
  MOELAB_CHECK(t.defined() && t.dtype() == DType::f32, std::string(what) + " must be fp32, got " +
                                                           (t.defined() ? t.describe() : std::string("undefined")));
}

}  // namespace

// ---- streams and events --------------------------------------------------------------

class CudaStream final : public Stream {
 public:
  CudaStream(int id, StreamRole role, std::string name, cudaStream_t s) : Stream(id, role, std::move(name)), native(s) {}
  cudaStream_t native;
  cublasHandle_t blas = nullptr;  // one handle per stream: a handle's workspace is not shareable across streams
  void* lt_workspace = nullptr;   // cuBLASLt's workspace for this stream's fused-epilogue GEMMs (cudaMalloc)
};

class CudaEvent final : public Event {
 public:
  CudaEvent() { cuda_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreate"); }
  ~CudaEvent() override { cudaEventDestroy(ev); }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;
  cudaEvent_t ev = nullptr;
};

// A timing event whose host-clock time is known; op times are measured against the latest
// one so that cudaEventElapsedTime (float milliseconds) keeps sub-microsecond resolution.
struct ClockAnchor {
  cudaEvent_t ev = nullptr;
  double host_time = 0;
  ~ClockAnchor() {
    if (ev) cudaEventDestroy(ev);
  }
};

struct CudaOpTicket {
  OpRecord rec;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, end = nullptr;
  std::shared_ptr<ClockAnchor> anchor;
};

// Small pinned host buffers for the grouped GEMM's pointer arrays: a buffer is reused only
// once the copy that last read it has completed (its event), so issuing never blocks.
class PinnedStaging {
 public:
  ~PinnedStaging() {
    for (auto& c : chunks_) {
      cudaEventDestroy(c.done);
      cudaFreeHost(c.ptr);
    }
  }
  // A buffer of at least `bytes`; call release(…) with the stream that reads it.
  std::size_t acquire(std::size_t bytes) {
    for (std::size_t i = 0; i < chunks_.size(); ++i) {
      auto& c = chunks_[i];
      if (c.bytes < bytes) continue;
      if (c.in_flight) {
        const cudaError_t err = cudaEventQuery(c.done);
        if (err == cudaErrorNotReady) {
          // No error: clear it, so that the next launch check does not read it as its own
          // (as PyTorch's event and stream queries do).
          cudaGetLastError();
          continue;
        }
        cuda_check(err, "cudaEventQuery (staging)");
      }
      c.in_flight = false;
      return i;
    }
    Chunk c;
    c.bytes = std::max<std::size_t>(bytes, 4096);
    cuda_kernels::check_alloc(cudaMallocHost(&c.ptr, c.bytes), "cudaMallocHost (staging)", c.bytes);
    cuda_check(cudaEventCreateWithFlags(&c.done, cudaEventDisableTiming), "cudaEventCreate");
    chunks_.push_back(c);
    return chunks_.size() - 1;
  }
  void* ptr(std::size_t i) { return chunks_[i].ptr; }
  void release(std::size_t i, cudaStream_t s) {
    cuda_check(cudaEventRecord(chunks_[i].done, s), "cudaEventRecord");
    chunks_[i].in_flight = true;
  }

 private:
  struct Chunk {
    void* ptr = nullptr;
    std::size_t bytes = 0;
    cudaEvent_t done = nullptr;
    bool in_flight = false;
  };
  std::vector<Chunk> chunks_;
};

// ---- the backend ---------------------------------------------------------------------

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const CudaOptions& opt) : opt_(opt), t0_(std::chrono::steady_clock::now()) {
    cuda_check(cudaSetDevice(opt_.device), "cudaSetDevice");
    cudaDeviceProp prop{};
    cuda_check(cudaGetDeviceProperties(&prop, opt_.device), "cudaGetDeviceProperties");
    char mem[32];
    std::snprintf(mem, sizeof mem, " (%.1f GiB)", static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024 * 1024));
    device_name_ = std::string(prop.name) + mem;
    device_memory_bytes_ = static_cast<double>(prop.totalGlobalMem);

    // The pool keeps freed blocks instead of returning them to the driver at every sync:
    // cudaMallocAsync then costs ~1 us in steady state, like a caching allocator.
    cudaMemPool_t pool;
    cuda_check(cudaDeviceGetDefaultMemPool(&pool, opt_.device), "cudaDeviceGetDefaultMemPool");
    std::uint64_t threshold = std::numeric_limits<std::uint64_t>::max();
    cuda_check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold),
               "cudaMemPoolSetAttribute(release threshold)");

    cuda_check(cudaStreamCreateWithFlags(&clock_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    anchor_ = make_anchor();
    host_pool_ = std::make_unique<HostPool>(host_pool_callbacks());
  }

  ~CudaBackend() override {
    cudaSetDevice(opt_.device);
    for (auto& s : streams_) cudaStreamSynchronize(s->native);
    host_pool_.reset();  // every stream has drained: the pinned blocks go back to the driver
    for (auto e : marker_events_) cudaEventDestroy(e);
    for (auto& s : streams_) {
      if (s->blas) cublasDestroy(s->blas);
      if (s->lt_workspace) cudaFree(s->lt_workspace);
      cudaStreamDestroy(s->native);
    }
    if (lt_) cublasLtDestroy(lt_);
    if (bare_blas_) cublasDestroy(bare_blas_);
    if (bare_stream_) cudaStreamDestroy(bare_stream_);
    for (auto& p : pending_) {
      cudaEventDestroy(p->start);
      cudaEventDestroy(p->end);
    }
    pending_.clear();
    for (auto e : free_timing_events_) cudaEventDestroy(e);
    anchor_.reset();
    staging_.reset();
    cudaStreamDestroy(clock_stream_);
  }

  std::string name() const override { return "cuda"; }
  std::string device_name() const override { return device_name_; }
  // The device's memory; rates are measured by whoever needs them (time_bare_gemms).
  MachineRates machine_rates(std::int64_t, std::int64_t, std::int64_t, DType) const override {
    MachineRates r;
    r.device_memory_bytes = device_memory_bytes_;
    r.source = "cudaGetDeviceProperties (memory only)";
    return r;
  }
  // The default pool serves every cudaMallocAsync of this backend (tensors, workspaces).
  std::optional<DevicePoolPeak> device_pool_peak() const override {
    cudaMemPool_t pool;
    cuda_check(cudaDeviceGetDefaultMemPool(&pool, opt_.device), "cudaDeviceGetDefaultMemPool");
    DevicePoolPeak p;
    cuda_check(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &p.used_high),
               "cudaMemPoolGetAttribute(UsedMemHigh)");
    cuda_check(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &p.reserved_high),
               "cudaMemPoolGetAttribute(ReservedMemHigh)");
    return p;
  }
  // The high-water marks can only be set to zero; the driver then tracks from the current use.
  void reset_device_pool_peak() override {
    cudaMemPool_t pool;
    cuda_check(cudaDeviceGetDefaultMemPool(&pool, opt_.device), "cudaDeviceGetDefaultMemPool");
    std::uint64_t zero = 0;
    cuda_check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero),
               "cudaMemPoolSetAttribute(UsedMemHigh)");
    cuda_check(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero),
               "cudaMemPoolSetAttribute(ReservedMemHigh)");
  }
  bool supports(DType t) const override {
    return t == DType::f32 || t == DType::bf16 || t == DType::i32 || t == DType::i64;
  }
  double now() const override {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
  }
  int device() const { return opt_.device; }

  // ---- streams and events ----------------------------------------------------------
  Stream& create_stream(StreamRole role, const std::string& name) override {
    set_device();
    cudaStream_t s;
    cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    std::lock_guard lock(mu_);
    streams_.push_back(std::make_unique<CudaStream>(static_cast<int>(streams_.size()), role, name, s));
    return *streams_.back();
  }
  std::unique_ptr<Event> create_event() override {
    set_device();
    return std::make_unique<CudaEvent>();
  }
  void record(Event& e, Stream& s) override {
    cuda_check(cudaEventRecord(ev(e), native(s)), "cudaEventRecord");
  }
  void wait(Stream& s, Event& e) override {
    cuda_check(cudaStreamWaitEvent(native(s), ev(e), 0), "cudaStreamWaitEvent");
  }
  void synchronize(Stream& s) override {
    const cudaError_t err = cudaStreamSynchronize(native(s));
    if (err != cudaSuccess)
      throw std::runtime_error("cuda: stream '" + s.name() + "' failed: " + cudaGetErrorName(err) + " (" +
                               cudaGetErrorString(err) + ")");
  }
  void synchronize() override {
    std::vector<CudaStream*> all;
    {
      std::lock_guard lock(mu_);
      for (auto& s : streams_) all.push_back(s.get());
    }
    for (auto* s : all) synchronize(*s);
    // Re-anchor the clock now and then, while the device is idle and an anchor is cheap.
    double anchored;
    {
      std::lock_guard lock(mu_);
      anchored = anchor_->host_time;
    }
    if (now() - anchored > 1.0) {
      auto a = make_anchor();
      std::lock_guard lock(mu_);
      anchor_ = std::move(a);
    }
  }

  // ---- memory ----------------------------------------------------------------------
  void upload(std::span<const float> host, Tensor& dst) override {
    MOELAB_CHECK(host.size() == static_cast<std::size_t>(dst.numel()),
                 "upload of " + std::to_string(host.size()) + " values into " + dst.describe());
    switch (dst.dtype()) {
      case DType::f32: write_blocking(dst, host.data()); break;
      case DType::bf16: {
        std::vector<std::uint16_t> b(host.size());
        for (std::size_t i = 0; i < b.size(); ++i) b[i] = f32_to_bf16(host[i]);
        write_blocking(dst, b.data());
        break;
      }
      case DType::i32: {
        std::vector<std::int32_t> b(host.size());
        for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::int32_t>(host[i]);
        write_blocking(dst, b.data());
        break;
      }
      case DType::i64: {
        std::vector<std::int64_t> b(host.size());
        for (std::size_t i = 0; i < b.size(); ++i) b[i] = static_cast<std::int64_t>(host[i]);
        write_blocking(dst, b.data());
        break;
      }
      default: throw Unsupported(std::string("upload to ") + dtype_name(dst.dtype()) + " on the cuda backend");
    }
  }
  std::vector<float> download(const Tensor& src) override {
    const std::size_t n = static_cast<std::size_t>(src.numel());
    std::vector<float> out(n);
    switch (src.dtype()) {
      case DType::f32: read_blocking(src, out.data()); break;
      case DType::bf16: {
        std::vector<std::uint16_t> b(n);
        read_blocking(src, b.data());
        for (std::size_t i = 0; i < n; ++i) out[i] = bf16_to_f32(b[i]);
        break;
      }
      case DType::i32: {
        std::vector<std::int32_t> b(n);
        read_blocking(src, b.data());
        for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(b[i]);
        break;
      }
      case DType::i64: {
        std::vector<std::int64_t> b(n);
        read_blocking(src, b.data());
        for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(b[i]);
        break;
      }
      default: throw Unsupported(std::string("download of ") + dtype_name(src.dtype()) + " on the cuda backend");
    }
    return out;
  }
  void upload_i32(std::span<const std::int32_t> host, Tensor& dst) override {
    MOELAB_CHECK(dst.dtype() == DType::i32, "upload_i32 into " + dst.describe());
    MOELAB_CHECK(host.size() == static_cast<std::size_t>(dst.numel()),
                 "upload_i32 of " + std::to_string(host.size()) + " values into " + dst.describe());
    write_blocking(dst, host.data());
  }
  std::vector<std::int32_t> download_i32(const Tensor& src) override {
    MOELAB_CHECK(src.dtype() == DType::i32, "download_i32 of " + src.describe());
    std::vector<std::int32_t> out(static_cast<std::size_t>(src.numel()));
    read_blocking(src, out.data());
    return out;
  }

  // ---- ops -------------------------------------------------------------------------
  void copy(Stream& s, const Tensor& src, Tensor& dst) override {
    MOELAB_CHECK(src.numel() == dst.numel(), "copy " + src.describe() + " -> " + dst.describe());
    if (src.dtype() != dst.dtype()) {  // fp32 <-> bf16 conversion, on the device
      const bool f2b = src.dtype() == DType::f32 && dst.dtype() == DType::bf16;
      const bool b2f = src.dtype() == DType::bf16 && dst.dtype() == DType::f32;
      MOELAB_CHECK((f2b || b2f) && src.space() == MemSpace::device && dst.space() == MemSpace::device,
                   "copy with conversion " + src.describe() + " -> " + dst.describe());
      CudaOpScope op(*this, s, "convert",
                     cost_elementwise(src.numel(), DType::f32, 1, 1, 1));
      cuda_kernels::convert(native(s), f2b ? cuda_kernels::Elem::f32 : cuda_kernels::Elem::bf16, src.raw(),
                            dst.raw(), src.numel());
      return;
    }
    const bool from_dev = src.space() == MemSpace::device, to_dev = dst.space() == MemSpace::device;
    const OpKind kind = from_dev == to_dev ? OpKind::copy_d2d : (to_dev ? OpKind::copy_h2d : OpKind::copy_d2h);
    const auto bytes = static_cast<std::int64_t>(src.nbytes());
    CudaOpScope op(*this, s, "copy", cost_copy(kind, bytes));
    if (bytes == 0) return;
    cuda_check(cudaMemcpyAsync(dst.raw(), src.raw(), src.nbytes(), cudaMemcpyDefault, native(s)), "cudaMemcpyAsync");
  }

  void fill_zero(Stream& s, Tensor& t) override {
    CudaOpScope op(*this, s, "fill_zero", cost_fill(static_cast<std::int64_t>(t.nbytes())));
    if (t.nbytes() == 0) return;
    cuda_check(cudaMemsetAsync(t.raw(), 0, t.nbytes(), native(s)), "cudaMemsetAsync");
  }

  void grouped_gemm(Stream& s, std::span<const GemmProblem> problems, const char* name) override;
  // cuBLASLt's GELU epilogues (CUBLASLT_EPILOGUE_GELU_AUX, CUBLASLT_EPILOGUE_DGELU) compute the
  // tanh GeLU: that activation is fused, the others run as the default's separate ops.
  void grouped_gemm_epilogue(Stream& s, std::span<const GemmProblem> problems, GemmEpilogue ep, Activation act,
                             const char* name) override;
  bool fuses_gemm_epilogue(Activation act, DType t) const override {
    return act == Activation::gelu_tanh && (t == DType::bf16 || t == DType::f32);
  }

  void noisy_logits(Stream& s, const Tensor& clean, const Tensor& noise_raw, const Tensor& eps,
                    Tensor& logits) override {
    require_f32(clean, "noisy_logits clean");
    require_f32(noise_raw, "noisy_logits noise_raw");
    require_f32(eps, "noisy_logits eps");
    require_f32(logits, "noisy_logits logits");
    const std::int64_t n = clean.numel();
    MOELAB_CHECK(noise_raw.numel() == n && eps.numel() == n && logits.numel() == n,
                 "noisy_logits shapes " + clean.describe() + ", " + noise_raw.describe() + ", " + eps.describe() +
                     " -> " + logits.describe());
    CudaOpScope op(*this, s, "noisy_logits", cost_elementwise(n, DType::f32, 3, 1, 6));
    cuda_kernels::noisy_logits(native(s), f32p(clean), f32p(noise_raw), f32p(eps), f32p(logits), n);
  }

  void noisy_logits_backward(Stream& s, const Tensor& d_logits, const Tensor& noise_raw, const Tensor& eps,
                             Tensor& d_noise_raw) override {
    require_f32(d_logits, "noisy_logits_backward d_logits");
    require_f32(noise_raw, "noisy_logits_backward noise_raw");
    require_f32(eps, "noisy_logits_backward eps");
    require_f32(d_noise_raw, "noisy_logits_backward d_noise_raw");
    const std::int64_t n = d_logits.numel();
    MOELAB_CHECK(noise_raw.numel() == n && eps.numel() == n && d_noise_raw.numel() == n,
                 "noisy_logits_backward shapes");
    CudaOpScope op(*this, s, "noisy_logits_bwd", cost_elementwise(n, DType::f32, 3, 1, 5));
    cuda_kernels::noisy_logits_backward(native(s), f32p(d_logits), f32p(noise_raw), f32p(eps), f32p(d_noise_raw), n);
  }

  void gate_forward(Stream& s, GateForward& g) override {
    require_f32(g.logits, "gate logits");
    MOELAB_CHECK(g.logits.ndim() == 2, "gate logits must be [T,E], got " + g.logits.describe());
    const std::int64_t T = g.logits.dim(0);
    const int E = to_int(g.logits.dim(1), "experts");
    const int k = g.top_k;
    MOELAB_CHECK(k >= 1 && k <= E && k <= cuda_kernels::kMaxTopK,
                 "top_k = " + std::to_string(k) + " with " + std::to_string(E) + " experts");
    MOELAB_CHECK(T * k <= std::numeric_limits<int>::max(), "T*k out of int range");
    require_f32(g.probs, "gate probs");
    require_f32(g.topk_w, "gate topk_w");
    require_f32(g.routed_frac, "gate routed_frac");
    require_f32(g.aux_loss, "gate aux_loss");
    MOELAB_CHECK(g.probs.numel() == T * E && g.topk_w.numel() == T * k && g.topk_idx.numel() == T * k &&
                     g.slot.numel() == T * k && g.counts.numel() == E && g.routed_frac.numel() == E &&
                     g.aux_loss.numel() == 1 && g.topk_idx.dtype() == DType::i32 && g.slot.dtype() == DType::i32 &&
                     g.counts.dtype() == DType::i32,
                 "gate_forward output shapes/dtypes for logits " + g.logits.describe());
    CudaOpScope op(*this, s, "gate", cost_gate_forward(T, E, k));
    cuda_kernels::GateForwardArgs a;
    a.logits = f32p(g.logits);
    a.tokens = T;
    a.experts = E;
    a.top_k = k;
    a.capacity = g.capacity;
    a.renormalize = g.renormalize;
    a.probs = f32p(g.probs);
    a.topk_idx = g.topk_idx.data<std::int32_t>();
    a.topk_w = f32p(g.topk_w);
    a.slot = g.slot.data<std::int32_t>();
    a.counts = g.counts.data<std::int32_t>();
    a.routed_frac = f32p(g.routed_frac);
    a.aux_loss = f32p(g.aux_loss);
    if (g.prob_mean.defined()) {
      require_f32(g.prob_mean, "gate prob_mean");
      MOELAB_CHECK(g.prob_mean.numel() == E, "gate prob_mean must be [E], got " + g.prob_mean.describe());
      a.prob_mean = f32p(g.prob_mean);
    }
    cuda_kernels::gate_forward(native(s), a);
  }

  void gate_backward(Stream& s, GateBackward& g) override {
    require_f32(g.probs, "gate_backward probs");
    MOELAB_CHECK(g.probs.ndim() == 2, "gate_backward probs must be [T,E], got " + g.probs.describe());
    const std::int64_t T = g.probs.dim(0);
    const int E = to_int(g.probs.dim(1), "experts");
    const auto [tk, k] = rows_and_k(g.topk_idx);
    MOELAB_CHECK(tk == T && g.topk_w.numel() == T * k && g.d_topk_w.numel() == T * k && g.routed_frac.numel() == E &&
                     g.d_logits.numel() == T * E,
                 "gate_backward shapes for probs " + g.probs.describe());
    require_f32(g.topk_w, "gate_backward topk_w");
    require_f32(g.d_topk_w, "gate_backward d_topk_w");
    require_f32(g.routed_frac, "gate_backward routed_frac");
    require_f32(g.d_logits, "gate_backward d_logits");
    CudaOpScope op(*this, s, "gate_bwd", cost_gate_backward(T, E, k));
    cuda_kernels::GateBackwardArgs a;
    a.probs = f32p(g.probs);
    a.topk_idx = i32p(g.topk_idx);
    a.topk_w = f32p(g.topk_w);
    a.routed_frac = f32p(g.routed_frac);
    a.d_topk_w = f32p(g.d_topk_w);
    a.tokens = T;
    a.experts = E;
    a.top_k = k;
    a.renormalize = g.renormalize;
    a.grad_aux = g.grad_aux;
    a.d_logits = f32p(g.d_logits);
    cuda_kernels::gate_backward(native(s), a);
  }

  void permute(Stream& s, const Tensor& x, const Tensor& slot, Tensor& out) override {
    const auto [T, k] = rows_and_k(slot);
    const std::int64_t M = width_of(x), N = rows_of(out);
    MOELAB_CHECK(x.dtype() == out.dtype() && rows_of(x) == T && width_of(out) == M,
                 "permute " + x.describe() + " by " + slot.describe() + " -> " + out.describe());
    CudaOpScope op(*this, s, "permute", cost_rows(OpKind::permute, N, N, M, x.dtype(), 0));
    cuda_kernels::permute(native(s), elem_of(x), x.raw(), i32p(slot), out.raw(), T, k, M, N);
  }

  void permute_backward(Stream& s, const Tensor& d_out, const Tensor& slot, Tensor& dx) override {
    const auto [T, k] = rows_and_k(slot);
    const std::int64_t M = width_of(dx), N = rows_of(d_out);
    MOELAB_CHECK(d_out.dtype() == dx.dtype() && rows_of(dx) == T && width_of(d_out) == M,
                 "permute_backward " + d_out.describe() + " by " + slot.describe() + " -> " + dx.describe());
    CudaOpScope op(*this, s, "permute_bwd", cost_rows(OpKind::permute, N, T, M, dx.dtype(), 1));
    cuda_kernels::permute_backward(native(s), elem_of(dx), d_out.raw(), i32p(slot), dx.raw(), T, k, M, N);
  }

  void unpermute(Stream& s, const Tensor& y_perm, const Tensor& slot, const Tensor& w, Tensor& y) override {
    const auto [T, k] = rows_and_k(slot);
    const std::int64_t M = width_of(y), N = rows_of(y_perm);
    require_f32(w, "unpermute weights");
    MOELAB_CHECK(y_perm.dtype() == y.dtype() && rows_of(y) == T && width_of(y_perm) == M && w.numel() == T * k,
                 "unpermute " + y_perm.describe() + " by " + slot.describe() + " -> " + y.describe());
    CudaOpScope op(*this, s, "unpermute", cost_rows(OpKind::permute, N, T, M, y.dtype(), 2));
    cuda_kernels::unpermute(native(s), elem_of(y), y_perm.raw(), i32p(slot), f32p(w), y.raw(), T, k, M, N);
  }

  void unpermute_backward(Stream& s, const Tensor& dy, const Tensor& y_perm, const Tensor& slot, const Tensor& w,
                          Tensor& d_y_perm, Tensor& dw) override {
    const auto [T, k] = rows_and_k(slot);
    const std::int64_t M = width_of(dy), N = rows_of(y_perm);
    require_f32(w, "unpermute_backward weights");
    require_f32(dw, "unpermute_backward dw");
    MOELAB_CHECK(dy.dtype() == y_perm.dtype() && dy.dtype() == d_y_perm.dtype() && rows_of(dy) == T &&
                     width_of(y_perm) == M && rows_of(d_y_perm) == N && width_of(d_y_perm) == M &&
                     w.numel() == T * k && dw.numel() == T * k,
                 "unpermute_backward " + dy.describe() + ", " + y_perm.describe() + " -> " + d_y_perm.describe());
    // Reads dy once per slot and y_perm's N rows; writes N rows of d_y_perm.
    CudaOpScope op(*this, s, "unpermute_bwd", cost_rows(OpKind::permute, N + T, N, M, dy.dtype(), 3));
    cuda_kernels::unpermute_backward(native(s), elem_of(dy), dy.raw(), y_perm.raw(), i32p(slot), f32p(w),
                                     d_y_perm.raw(), f32p(dw), T, k, M, N);
  }

  void activation_forward(Stream& s, Activation a, const Tensor& in, Tensor& out) override {
    MOELAB_CHECK(in.dtype() == out.dtype() && in.numel() == out.numel(),
                 "activation " + in.describe() + " -> " + out.describe());
    CudaOpScope op(*this, s, std::string(activation_name(a)),
                   cost_activation_forward(a, in.numel(), in.dtype()));
    cuda_kernels::activation_forward(native(s), elem_of(in), act_of(a), in.raw(), out.raw(), in.numel());
  }

  void activation_backward(Stream& s, Activation a, const Tensor& in, const Tensor& d_out, Tensor& d_in) override {
    MOELAB_CHECK(in.dtype() == d_out.dtype() && in.dtype() == d_in.dtype() && in.numel() == d_out.numel() &&
                     in.numel() == d_in.numel(),
                 "activation_backward " + in.describe() + ", " + d_out.describe() + " -> " + d_in.describe());
    CudaOpScope op(*this, s, std::string(activation_name(a)) + "_bwd",
                   cost_activation_backward(a, in.numel(), in.dtype()));
    cuda_kernels::activation_backward(native(s), elem_of(in), act_of(a), in.raw(), d_out.raw(),
                                      d_in.raw(), in.numel());
  }

  // ---- transformer-block ops (block_kernels.cu; definitions below the class) ----------
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
  double time_batched_gemms(std::span<const GemmProblem> problems, int reps) override;

  // ---- GEMM paths (cuda_backend.hpp) -------------------------------------------------
  void set_gemm_path_table(GemmPathTable t) {
    std::lock_guard lock(mu_);
    gemm_paths_ = std::move(t);
  }
  GemmPathTable gemm_path_table() const {
    std::lock_guard lock(mu_);
    return gemm_paths_;
  }
  void force_gemm_path(std::optional<GemmPath> p) {
    std::lock_guard lock(mu_);
    forced_path_ = p;
  }
  std::vector<GemmPathUse> gemm_path_uses() const override { return path_uses_.uses(); }
  std::int64_t unfused_epilogues() const { return unfused_epilogues_.load(std::memory_order_relaxed); }

  // ---- timeline --------------------------------------------------------------------
  std::vector<OpRecord> timeline() override {
    std::lock_guard lock(mu_);
    resolve_locked();
    return done_;
  }
  void clear_timeline() override {
    {
      std::lock_guard lock(mu_);
      for (auto& p : pending_) {
        free_timing_events_.push_back(p->start);
        free_timing_events_.push_back(p->end);
      }
      pending_.clear();
      done_.clear();
    }
    auto a = make_anchor();
    std::lock_guard lock(mu_);
    anchor_ = std::move(a);
  }

  // ---- timed ops (CudaOpScope) -----------------------------------------------------
  std::unique_ptr<CudaOpTicket> begin_op(Stream& s, std::string name, const OpCost& cost) {
    set_device();
    auto t = std::make_unique<CudaOpTicket>();
    t->rec.rank = rank_;
    t->rec.stream_id = s.id();
    t->rec.stream_name = s.name();
    t->rec.name = std::move(name);
    t->rec.phase = phase_;
    t->rec.node = node_;
    t->rec.cost = cost;
    t->stream = native(s);
    {
      std::lock_guard lock(mu_);
      t->start = take_timing_event_locked();
      t->end = take_timing_event_locked();
      t->anchor = anchor_;
    }
    const cudaError_t err = cudaEventRecord(t->start, t->stream);
    if (err != cudaSuccess) {
      std::lock_guard lock(mu_);
      free_timing_events_.push_back(t->start);
      free_timing_events_.push_back(t->end);
      cuda_check(err, "cudaEventRecord (op start)");
    }
    return t;
  }
  // Never throws: runs in CudaOpScope's destructor, possibly during unwinding.
  void end_op(std::unique_ptr<CudaOpTicket> t) noexcept {
    if (!t) return;
    const cudaError_t err = cudaEventRecord(t->end, t->stream);
    std::lock_guard lock(mu_);
    if (err != cudaSuccess) {  // the op cannot be timed; its error surfaces at the next sync
      free_timing_events_.push_back(t->start);
      free_timing_events_.push_back(t->end);
      return;
    }
    pending_.push_back(std::move(t));
  }

 protected:
  void* raw_alloc(std::size_t bytes, MemSpace space, Stream& s) override {
    set_device();
    void* p = nullptr;
    cudaError_t err = cudaSuccess;
    if (space == MemSpace::device)
      err = cudaMallocAsync(&p, bytes, native(s));
    else
      p = host_pool_->allocate(bytes);
    if (err != cudaSuccess || !p) {
      cudaGetLastError();  // an allocation failure is not sticky; clear it
      throw OutOfMemory("rank " + std::to_string(rank()) + ": cuda: cannot allocate " + std::to_string(bytes) +
                        " bytes of " + (space == MemSpace::device ? "device" : "pinned host") + " memory on " +
                        device_name_ + " (" + std::to_string(memory_.device_in_use()) + " bytes tracked in use): " +
                        (err != cudaSuccess ? cudaGetErrorString(err) : "cudaHostAlloc refused"));
    }
    return p;
  }
  void raw_free(void* p, std::size_t, MemSpace space, Stream& s) override {
    // Called from a tensor's destructor: report, never throw.
    if (space == MemSpace::host_pinned) {
      try {
        host_pool_->free(p, &s);  // reusable once s has passed this point
      } catch (const std::exception& e) {
        std::fprintf(stderr, "moelab cuda: freeing pinned memory failed: %s\n", e.what());
      }
      return;
    }
    const cudaError_t err = cudaFreeAsync(p, native(s));
    if (err != cudaSuccess) std::fprintf(stderr, "moelab cuda: freeing memory failed: %s\n", cudaGetErrorString(err));
  }

 public:
  HostPool& host_pool() { return *host_pool_; }
  const HostPool& host_pool() const { return *host_pool_; }
  void release_cached_host_memory() override {
    synchronize();  // every block freed so far is then ready: none stays cached for a pending copy
    host_pool_->empty_cache();
  }

 private:
  // The pinned host pool's driver (harness/runtime/host_pool.hpp): cudaHostAlloc /
  // cudaFreeHost, and recycled cudaEvents recorded on the freeing tensor's allocation
  // stream as completion markers. The pool calls these under its own lock.
  HostPool::Callbacks host_pool_callbacks() {
    HostPool::Callbacks cb;
    cb.allocate = [this](std::size_t bytes) -> void* {
      set_device();
      void* p = nullptr;
      if (cudaHostAlloc(&p, bytes, cudaHostAllocDefault) != cudaSuccess) {
        cudaGetLastError();
        return nullptr;
      }
      return p;
    };
    cb.release = [](void* p) {
      const cudaError_t err = cudaFreeHost(p);
      if (err != cudaSuccess) std::fprintf(stderr, "moelab cuda: cudaFreeHost failed: %s\n", cudaGetErrorString(err));
    };
    cb.record = [this](HostPool::StreamHandle h) -> HostPool::Marker {
      const cudaStream_t st = native(*const_cast<Stream*>(static_cast<const Stream*>(h)));
      cudaEvent_t e = nullptr;
      if (!marker_events_.empty()) {
        e = marker_events_.back();
        marker_events_.pop_back();
      } else if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) {
        e = nullptr;
      }
      if (e && cudaEventRecord(e, st) == cudaSuccess) return e;
      // No marker to be had: wait for the stream here, so that the block is free at once.
      if (e) marker_events_.push_back(e);
      cudaGetLastError();
      cudaStreamSynchronize(st);
      return nullptr;
    };
    cb.done = [](HostPool::Marker m) {
      if (cudaEventQuery(static_cast<cudaEvent_t>(m)) == cudaSuccess) return true;
      cudaGetLastError();  // cudaErrorNotReady is no error; a real one resurfaces at the next sync
      return false;
    };
    cb.drop = [this](HostPool::Marker m) { marker_events_.push_back(static_cast<cudaEvent_t>(m)); };
    return cb;
  }

  void set_device() const {
    int cur = -1;
    if (cudaGetDevice(&cur) != cudaSuccess || cur != opt_.device) cuda_check(cudaSetDevice(opt_.device), "cudaSetDevice");
  }
  static cudaStream_t native(Stream& s) { return cuda_native_stream(s); }
  static cudaEvent_t ev(Event& e) {
    auto* ce = dynamic_cast<CudaEvent*>(&e);
    MOELAB_CHECK(ce != nullptr, "event of another backend passed to the cuda backend");
    return ce->ev;
  }
  CudaStream& cstream(Stream& s) {
    auto* cs = dynamic_cast<CudaStream*>(&s);
    MOELAB_CHECK(cs != nullptr, "stream of another backend passed to the cuda backend");
    return *cs;
  }
  cublasHandle_t blas(Stream& s) {
    CudaStream& cs = cstream(s);
    if (!cs.blas) {
      cublasStatus_t st = cublasCreate(&cs.blas);
      if (st == CUBLAS_STATUS_ALLOC_FAILED && trim_device_pool()) st = cublasCreate(&cs.blas);
      cublas_check(st, "cublasCreate");
      cublas_check(cublasSetStream(cs.blas, cs.native), "cublasSetStream");
    }
    return cs.blas;
  }

  // Device memory taken outside the stream-ordered pool (a cuBLAS handle's workspace, the
  // cuBLASLt workspace) is taken lazily, at a stream's first GEMM, and by then the pool may
  // keep a step's peak in free blocks (its release threshold is unlimited, above). When such
  // an allocation fails: hand the pool's free blocks back to the driver (cudaMemPoolTrimTo
  // keeps what backs allocations still outstanding, so no wait for the device is needed, and
  // none is made: a device-wide wait could hold this rank on NCCL calls whose peers wait for
  // it), and say whether the caller should try once more.
  bool trim_device_pool() {
    cudaGetLastError();  // the failed allocation's error is not sticky
    cudaMemPool_t pool;
    if (cudaDeviceGetDefaultMemPool(&pool, opt_.device) != cudaSuccess) return false;
    return cudaMemPoolTrimTo(pool, 0) == cudaSuccess;
  }
  void* malloc_outside_pool(std::size_t bytes, const char* what) {
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err == cudaErrorMemoryAllocation && trim_device_pool()) err = cudaMalloc(&p, bytes);
    cuda_kernels::check_alloc(err, what, bytes);
    return p;
  }

  // The stream a tensor's allocation is ordered on (blocking transfers use it).
  cudaStream_t tensor_stream(const Tensor& t) { return t.stream() ? native(*t.stream()) : clock_stream_; }

  // Blocking transfers wait for the work issued on the tensor's own stream, as backend.hpp
  // states and the cpu and sim backends do; work on other streams is the caller's to order.
  // Not a device-wide wait: the MoE layer downloads its routing counts in every forward, and
  // waiting for every stream there would drain the offload copies and pipeline transfers in
  // flight (exposing what the schedule overlaps). A tensor without a stream waits for all.
  void wait_for_tensor(const Tensor& t, const char* what) {
    if (!t.stream()) {
      synchronize();
      return;
    }
    cuda_check(cudaStreamSynchronize(native(*t.stream())), what);
  }
  void write_blocking(Tensor& dst, const void* src) {
    if (dst.nbytes() == 0) return;
    wait_for_tensor(dst, "upload (waiting for the tensor's stream)");
    if (dst.space() == MemSpace::host_pinned) {
      std::memcpy(dst.raw(), src, dst.nbytes());
      return;
    }
    const cudaStream_t st = tensor_stream(dst);
    cuda_check(cudaMemcpyAsync(dst.raw(), src, dst.nbytes(), cudaMemcpyHostToDevice, st), "cudaMemcpyAsync (upload)");
    cuda_check(cudaStreamSynchronize(st), "upload");
  }
  void read_blocking(const Tensor& src, void* dst) {
    if (src.nbytes() == 0) return;
    wait_for_tensor(src, "download (waiting for the tensor's stream)");
    if (src.space() == MemSpace::host_pinned) {
      std::memcpy(dst, src.raw(), src.nbytes());
      return;
    }
    const cudaStream_t st = tensor_stream(src);
    cuda_check(cudaMemcpyAsync(dst, src.raw(), src.nbytes(), cudaMemcpyDeviceToHost, st), "cudaMemcpyAsync (download)");
    cuda_check(cudaStreamSynchronize(st), "download");
  }

  std::shared_ptr<ClockAnchor> make_anchor() {
    set_device();
    auto a = std::make_shared<ClockAnchor>();
    cuda_check(cudaEventCreate(&a->ev), "cudaEventCreate (clock)");
    const double before = now();
    cuda_check(cudaEventRecord(a->ev, clock_stream_), "cudaEventRecord (clock)");
    cuda_check(cudaEventSynchronize(a->ev), "cudaEventSynchronize (clock)");
    a->host_time = 0.5 * (before + now());
    return a;
  }

  cudaEvent_t take_timing_event_locked() {
    if (!free_timing_events_.empty()) {
      cudaEvent_t e = free_timing_events_.back();
      free_timing_events_.pop_back();
      return e;
    }
    cudaEvent_t e;
    cuda_check(cudaEventCreate(&e), "cudaEventCreate (timing)");
    return e;
  }

  // Moves every op whose end event has completed from pending_ to done_. An op that cannot
  // be timed (its stream failed) is dropped; the first such error is rethrown at the end,
  // with pending_ and the event pool left consistent.
  void resolve_locked() {
    std::vector<std::unique_ptr<CudaOpTicket>> still;
    cudaError_t first_error = cudaSuccess;
    for (auto& p : pending_) {
      cudaError_t err = cudaEventQuery(p->end);
      if (err == cudaErrorNotReady) {
        cudaGetLastError();  // no error (as in PinnedStaging::acquire)
        still.push_back(std::move(p));
        continue;
      }
      float from_anchor = 0, duration = 0;
      if (err == cudaSuccess) err = cudaEventElapsedTime(&from_anchor, p->anchor->ev, p->start);
      if (err == cudaSuccess) err = cudaEventElapsedTime(&duration, p->start, p->end);
      if (err == cudaSuccess) {
        OpRecord r = std::move(p->rec);
        r.start = p->anchor->host_time + 1e-3 * static_cast<double>(from_anchor);
        r.end = r.start + 1e-3 * static_cast<double>(duration);
        done_.push_back(std::move(r));
      } else if (first_error == cudaSuccess) {
        first_error = err;
      }
      free_timing_events_.push_back(p->start);
      free_timing_events_.push_back(p->end);
    }
    pending_ = std::move(still);
    cuda_check(first_error, "timing an op of the timeline");
  }

  // GEMM helpers (see grouped_gemm).
  cublasComputeType_t compute_type(DType ab) const {
    return (ab == DType::f32 && (opt_.allow_tf32 || allow_tf32_)) ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  }
  void gemm_one(cublasHandle_t h, const GemmProblem& p);
  cublasStatus_t gemm_strided(cublasHandle_t h, std::span<const GemmProblem* const> run, const StridedRun& r);
  cublasStatus_t gemm_grouped(cublasHandle_t h, cudaStream_t st, std::span<const GemmProblem* const> list);
  // Whether every matrix of the problems starts on 16 bytes, as the grouped call needs.
  static bool grouped_pointers_aligned(std::span<const GemmProblem* const> list);
  // Whether no two problems write overlapping outputs: one grouped call gives its problems no
  // order, so two that accumulate into one C (beta = 1) would race there; the loop runs them
  // in order.
  static bool outputs_disjoint(std::span<const GemmProblem* const> list);
  // The path of a call of several problems of one type combination (A/B in `ab`): the table's
  // choice among the paths that can run (strided: one equal batch; grouped: the library has it
  // for these types), or the forced path (force_gemm_path) where it can run.
  GemmPathChoice choose_path(std::span<const GemmProblem* const> list, DType ab, bool strided, bool grouped);
  // A single problem's reason (`why`: its one library call), saying so when a path is forced
  // (force_gemm_path: only the loop can run one problem), as the sim's chooser says it.
  std::string one_problem_why(const GemmProblem& p, std::string why);
  // A padded call (harness/runtime/backend.hpp, GemmProblem::token_stride) as one strided batch
  // over its padded rows, when the table (or a forced strided path) picks that: the padded
  // problems, their run and why; nullopt: the problems' own rows, as for any call.
  struct PaddedBatch {
    std::vector<GemmProblem> problems;
    std::vector<const GemmProblem*> list;  // into problems
    StridedRun run;
    std::string why;
  };
  std::optional<PaddedBatch> padded_batch(std::span<const GemmProblem> problems, bool grouped_available);
  void note_path(const std::string& op, GemmPath path, const std::string& why);
  // One cublasLtMatmul with the epilogue: `batch` problems from `p` at the given element
  // strides (1: p alone). NOT_SUPPORTED when cuBLASLt has no kernel for it (the caller runs it
  // unfused); the heuristic's answer is cached per shape, types, strides and alignments. The
  // descriptor and layouts are made per call, as PyTorch's cuBLASLt calls make theirs
  // (aten/src/ATen/cuda/CUDABlas.cpp), which also ask the heuristic every call.
  struct LtStrides {
    int batch = 1;
    std::int64_t a = 0, b = 0, c = 0, aux = 0;
  };
  cublasStatus_t lt_matmul(Stream& s, const GemmProblem& p, GemmEpilogue ep, const LtStrides& st);
  // The same problem unfused: its GEMM (cublasGemmEx), then the activation kernel.
  void unfused_epilogue(Stream& s, const GemmProblem& p, GemmEpilogue ep, Activation act);
  std::atomic<std::int64_t> unfused_epilogues_{0};  // cuda_unfused_epilogues
  template <class F>
  double time_on_bare_stream(int reps, F&& run_all);

  CudaOptions opt_;
  std::chrono::steady_clock::time_point t0_;
  std::string device_name_;
  double device_memory_bytes_ = 0;
  mutable std::mutex mu_;
  std::vector<std::unique_ptr<CudaStream>> streams_;
  cudaStream_t clock_stream_ = nullptr;
  std::shared_ptr<ClockAnchor> anchor_;
  std::vector<cudaEvent_t> free_timing_events_;
  std::vector<std::unique_ptr<CudaOpTicket>> pending_;
  std::vector<OpRecord> done_;
  std::unique_ptr<PinnedStaging> staging_ = std::make_unique<PinnedStaging>();
  std::set<std::pair<int, int>> grouped_unsupported_;  // (A/B type, C type) the grouped API refused
  std::set<std::pair<int, int>> strided_unsupported_;  // ... and the strided-batched one
  GemmPathTable gemm_paths_ = default_gemm_path_table();
  std::optional<GemmPath> forced_path_;
  GemmPathLedger path_uses_;
  cudaStream_t bare_stream_ = nullptr;
  cublasHandle_t bare_blas_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;  // created on the first fused-epilogue GEMM
  std::map<std::vector<std::int64_t>, std::optional<cublasLtMatmulAlgo_t>> lt_algos_;  // under mu_
  std::vector<cudaEvent_t> marker_events_;  // idle completion markers of the host pool
  std::unique_ptr<HostPool> host_pool_;
};

// ---- GEMM ----------------------------------------------------------------------------
//
// moelab's GEMMs are row-major and cuBLAS is column-major. A row-major [r,c] matrix is the
// column-major [c,r] matrix of its transpose, so C = op(A) op(B) is computed as
// C^T = op(B)^T op(A)^T with B as cuBLAS's first operand and A as its second:
//   first  (B): N with ld n when B is [k,n];  T with ld k when B is [n,k] (trans_b)
//   second (A): N with ld k when A is [m,k];  T with ld m when A is [k,m] (trans_a)
//   C: [n,m] column-major, ld n.
namespace {

struct ColMajor {
  cublasOperation_t op_first, op_second;
  int m, n, k;  // cuBLAS's: m = our n, n = our m
  int ld_first, ld_second, ldc;
};

ColMajor col_major(const GemmProblem& p) {
  ColMajor c;
  c.op_first = p.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  c.op_second = p.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  c.m = to_int(p.n, "gemm n");
  c.n = to_int(p.m, "gemm m");
  c.k = to_int(p.k, "gemm k");
  c.ld_first = p.trans_b ? c.k : c.m;
  c.ld_second = p.trans_a ? c.n : c.k;
  c.ldc = c.m;
  return c;
}

void check_problem(const GemmProblem& p) {
  MOELAB_CHECK(p.m >= 0 && p.n >= 0 && p.k >= 0, "negative GEMM dimension");
  MOELAB_CHECK(p.c.defined() && p.c.numel() >= p.m * p.n, "GEMM C too small: " + p.c.describe());
  if (p.m == 0 || p.n == 0 || p.k == 0) return;
  MOELAB_CHECK(p.a.defined() && p.b.defined() && p.a.dtype() == p.b.dtype(),
               "GEMM A and B must share a dtype: " + p.a.describe() + " vs " + p.b.describe());
  MOELAB_CHECK(p.c.dtype() == p.a.dtype() || p.c.dtype() == DType::f32,
               "GEMM C must be A's dtype or fp32: " + p.c.describe());
  MOELAB_CHECK(p.a.numel() >= p.m * p.k && p.b.numel() >= p.k * p.n,
               "GEMM operands too small for [" + std::to_string(p.m) + "x" + std::to_string(p.k) + "]x[" +
                   std::to_string(p.k) + "x" + std::to_string(p.n) + "]: " + p.a.describe() + ", " + p.b.describe());
}

std::vector<GemmOperands> operands_of(std::span<const GemmProblem* const> list) {
  std::vector<GemmOperands> ops;
  ops.reserve(list.size());
  for (const auto* p : list) ops.push_back(gemm_operands(*p));
  return ops;
}

// The crossover table's precision of a GEMM with A/B in `ab`.
std::string gemm_precision(DType ab, bool tf32) {
  if (ab == DType::bf16) return "bf16";
  return tf32 ? "tf32" : "fp32";
}

// The problems that multiply (m, n, k > 0); `empty_product(p)` is called for each with an output
// but nothing to multiply (k = 0).
template <class F>
std::vector<const GemmProblem*> live_problems(std::span<const GemmProblem> problems, F&& empty_product) {
  std::vector<const GemmProblem*> live;
  for (const auto& p : problems) {
    if (p.m == 0 || p.n == 0) continue;
    if (p.k > 0)
      live.push_back(&p);
    else
      empty_product(p);
  }
  return live;
}

// The problems by (A/B type, C type): the grouped, strided-batched and cuBLASLt calls take one
// type combination each.
std::map<std::pair<int, int>, std::vector<const GemmProblem*>> by_types(const std::vector<const GemmProblem*>& list) {
  std::map<std::pair<int, int>, std::vector<const GemmProblem*>> out;
  for (const auto* p : list) out[{static_cast<int>(p->a.dtype()), static_cast<int>(p->c.dtype())}].push_back(p);
  return out;
}

}  // namespace

void CudaBackend::gemm_one(cublasHandle_t h, const GemmProblem& p) {
  const ColMajor c = col_major(p);
  cublas_check(cublasGemmEx(h, c.op_first, c.op_second, c.m, c.n, c.k, &p.alpha, p.b.raw(), cuda_type(p.b.dtype()),
                            c.ld_first, p.a.raw(), cuda_type(p.a.dtype()), c.ld_second, &p.beta, p.c.raw(),
                            cuda_type(p.c.dtype()), c.ldc, compute_type(p.a.dtype()), CUBLAS_GEMM_DEFAULT),
               "cublasGemmEx");
}

void CudaBackend::grouped_gemm(Stream& s, std::span<const GemmProblem> problems, const char* name) {
  for (const auto& p : problems) check_problem(p);
  CudaOpScope op(*this, s, name ? name : "gemm", cost_grouped_gemm(problems));
  cublasHandle_t h = blas(s);
  const cudaStream_t st = native(s);

  // A padded layout (every problem with the same token stride, MoELayer::set_expert_layout): one
  // strided batch over the padded rows when the table's estimate for it wins (padding waste
  // within max_padding_waste); otherwise the problems' own rows below, as for any call.
  const std::string op_name = name ? name : "gemm";
  if (problems.size() > 1 && common_token_stride(problems) > 0)
    if (std::optional<PaddedBatch> pb = padded_batch(problems, true)) {
      const GemmProblem& f = pb->problems.front();
      const std::pair<int, int> types{static_cast<int>(f.a.dtype()), static_cast<int>(f.c.dtype())};
      const cublasStatus_t status = gemm_strided(h, pb->list, pb->run);
      if (status == CUBLAS_STATUS_NOT_SUPPORTED) {
        std::lock_guard lock(mu_);
        strided_unsupported_.insert(types);
      }
      if (status != CUBLAS_STATUS_NOT_SUPPORTED && status != CUBLAS_STATUS_INVALID_VALUE) {
        cublas_check(status, "cublasGemmStridedBatchedEx (padded)");
        note_path(op_name, GemmPath::strided_batched, pb->why);
        op.set_detail(pb->why);
        return;
      }
    }

  // k == 0: C = beta * C (nothing to multiply). beta == 0 must not read C (it may hold NaN).
  const std::vector<const GemmProblem*> live = live_problems(problems, [&](const GemmProblem& p) {
    const std::size_t bytes = static_cast<std::size_t>(p.m * p.n) * dtype_size(p.c.dtype());
    if (p.beta == 0.0f) {
      cuda_check(cudaMemsetAsync(p.c.raw(), 0, bytes, st), "cudaMemsetAsync (gemm k=0)");
    } else if (p.beta != 1.0f) {
      cublas_check(cublasScalEx_64(h, p.m * p.n, &p.beta, CUDA_R_32F, p.c.raw(), cuda_type(p.c.dtype()), 1, CUDA_R_32F),
                   "cublasScalEx (gemm k=0)");
    }
  });
  if (live.empty()) return;

  // One choice per (A/B type, C type).
  std::string detail;
  for (auto& [types, list] : by_types(live)) {
    if (list.size() == 1) {  // the chooser's answer, without its work (every dense GEMM comes here)
      gemm_one(h, *list.front());
      const std::string why = one_problem_why(*list.front(), "one problem: one cublasGemmEx");
      note_path(op_name, GemmPath::loop, why);
      detail += (detail.empty() ? "" : " | ") + why;
      continue;
    }
    const std::vector<StridedRun> runs = strided_runs(operands_of(list));
    bool strided = false, grouped = false;
    {
      std::lock_guard lock(mu_);
      strided = runs.size() == 1 && strided_unsupported_.count(types) == 0;
      grouped = grouped_unsupported_.count(types) == 0 && grouped_pointers_aligned(list) && outputs_disjoint(list);
    }
    const GemmPathChoice choice = choose_path(list, static_cast<DType>(types.first), strided, grouped);
    // Not every type combination has a grouped or strided kernel (bf16 inputs with an fp32 C,
    // say): a refusal runs the loop instead (cublasGemmEx rejects loudly whatever is really
    // invalid), and a type combination refused as unsupported is not tried again.
    GemmPath ran = choice.path;
    const auto refused = [&](cublasStatus_t status, std::set<std::pair<int, int>>& unsupported, const char* api) {
      if (status == CUBLAS_STATUS_NOT_SUPPORTED) {
        std::lock_guard lock(mu_);
        unsupported.insert(types);
      }
      if (status == CUBLAS_STATUS_NOT_SUPPORTED || status == CUBLAS_STATUS_INVALID_VALUE) return true;
      cublas_check(status, api);
      return false;
    };
    if (ran == GemmPath::strided_batched &&
        refused(gemm_strided(h, list, runs.front()), strided_unsupported_, "cublasGemmStridedBatchedEx"))
      ran = GemmPath::loop;
    if (ran == GemmPath::grouped && refused(gemm_grouped(h, st, list), grouped_unsupported_, "cublasGemmGroupedBatchedEx"))
      ran = GemmPath::loop;
    if (ran == GemmPath::loop)
      for (const auto* p : list) gemm_one(h, *p);
    std::string why = ran == choice.path ? choice.why
                                         : std::string(gemm_path_name(ran)) + " (the library refused " +
                                               gemm_path_name(choice.path) + "); " + choice.why;
    note_path(op_name, ran, why);
    detail += (detail.empty() ? "" : " | ") + why;
  }
  if (!detail.empty()) op.set_detail(std::move(detail));
}

std::string CudaBackend::one_problem_why(const GemmProblem& p, std::string why) {
  std::lock_guard lock(mu_);
  if (!forced_path_) return why;
  GemmCall call;
  call.problems.push_back({p.trans_a, p.trans_b, p.m, p.n, p.k});
  GemmPathChoice choice;  // the loop
  choice.why = std::move(why);
  return moelab::force_gemm_path(std::move(choice), *forced_path_, call).why;
}

GemmPathChoice CudaBackend::choose_path(std::span<const GemmProblem* const> list, DType ab, bool strided,
                                        bool grouped) {
  GemmCall call;
  for (const auto* p : list) call.problems.push_back({p->trans_a, p->trans_b, p->m, p->n, p->k});
  call.precision = gemm_precision(ab, ab == DType::f32 && (opt_.allow_tf32 || allow_tf32_));
  call.strided = strided && list.size() > 1;
  call.grouped_available = grouped;
  std::lock_guard lock(mu_);
  GemmPathChoice choice = choose_gemm_path(call, gemm_paths_);
  return forced_path_ ? moelab::force_gemm_path(std::move(choice), *forced_path_, call) : choice;
}

std::optional<CudaBackend::PaddedBatch> CudaBackend::padded_batch(std::span<const GemmProblem> problems,
                                                                  bool grouped_available) {
  PaddedBatch pb;
  for (const auto& p : problems) pb.problems.push_back(padded_problem(p));
  for (const auto& p : pb.problems) pb.list.push_back(&p);
  const std::vector<StridedRun> runs = strided_runs(operands_of(pb.list));
  if (runs.size() != 1) return std::nullopt;  // not one equally strided batch: the problems' own rows
  const GemmProblem& f = pb.problems.front();
  const std::pair<int, int> types{static_cast<int>(f.a.dtype()), static_cast<int>(f.c.dtype())};
  const DType ab = f.a.dtype();
  GemmCall call = padded_gemm_call(problems, gemm_precision(ab, ab == DType::f32 && (opt_.allow_tf32 || allow_tf32_)));
  if (call.problems.empty()) return std::nullopt;
  std::lock_guard lock(mu_);
  if (strided_unsupported_.count(types)) return std::nullopt;
  call.grouped_available = grouped_available && grouped_unsupported_.count(types) == 0;
  GemmPathChoice choice = choose_gemm_path(call, gemm_paths_);
  if (forced_path_) {
    if (*forced_path_ != GemmPath::strided_batched) return std::nullopt;  // the forced path runs the problems' own rows
    choice = force_padded_batch(std::move(choice), call.padded_rows);
  }
  if (choice.path != GemmPath::strided_batched) return std::nullopt;
  pb.run = runs.front();
  pb.why = choice.why;
  return pb;
}

void CudaBackend::note_path(const std::string& op, GemmPath path, const std::string& why) {
  path_uses_.note(op, path, why);
}

// The run of equal problems as one cublasGemmStridedBatchedEx: the first problem's operands
// and the run's strides (B is cuBLAS's first operand, see col_major).
cublasStatus_t CudaBackend::gemm_strided(cublasHandle_t h, std::span<const GemmProblem* const> run, const StridedRun& r) {
  const GemmProblem& p = *run.front();
  const ColMajor c = col_major(p);
  return cublasGemmStridedBatchedEx(h, c.op_first, c.op_second, c.m, c.n, c.k, &p.alpha, p.b.raw(),
                                    cuda_type(p.b.dtype()), c.ld_first, r.stride_b, p.a.raw(), cuda_type(p.a.dtype()),
                                    c.ld_second, r.stride_a, &p.beta, p.c.raw(), cuda_type(p.c.dtype()), c.ldc,
                                    r.stride_c, to_int(static_cast<std::int64_t>(run.size()), "gemm batch"),
                                    compute_type(p.a.dtype()), CUBLAS_GEMM_DEFAULT);
}

// cublasGemmGroupedBatchedEx reads its matrix pointers from device memory, so it cannot check
// their alignment as cublasGemmEx and the strided-batched call do; for 16-bit types and the
// FAST compute types cuBLAS documents that they must be aligned (ideally to 16 bytes) or the
// kernels may fault with a misaligned access, a sticky error that ends the process's CUDA
// context. Row views of the MoE layer's buffers start at row offsets that are not 16-byte
// aligned when a row is not a multiple of 16 bytes (a width of 20 in bf16, say): such a call
// takes the loop or the strided batch instead, whatever the types (fp32 rows of a width that
// is a multiple of 4 are always aligned, so nothing is lost there).
bool CudaBackend::grouped_pointers_aligned(std::span<const GemmProblem* const> list) {
  const auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  return std::all_of(list.begin(), list.end(),
                     [&](const GemmProblem* p) { return aligned(p->a.raw()) && aligned(p->b.raw()) && aligned(p->c.raw()); });
}

bool CudaBackend::outputs_disjoint(std::span<const GemmProblem* const> list) {
  std::vector<std::pair<std::uintptr_t, std::uintptr_t>> spans;  // [first byte, last byte + 1) of each C
  for (const auto* p : list) {
    const auto at = reinterpret_cast<std::uintptr_t>(p->c.raw());
    spans.emplace_back(at, at + p->c.nbytes());
  }
  std::sort(spans.begin(), spans.end());
  for (std::size_t i = 1; i < spans.size(); ++i)
    if (spans[i].first < spans[i - 1].second) return false;
  return true;
}

// The problems (one type combination) as one cublasGemmGroupedBatchedEx, one group per
// distinct shape and scalars, so that equal-sized experts share a group.
cublasStatus_t CudaBackend::gemm_grouped(cublasHandle_t h, cudaStream_t st, std::span<const GemmProblem* const> list) {
  using Key = std::tuple<int, int, int, int, int, float, float>;
  std::map<Key, std::vector<const GemmProblem*>> groups;
  for (const auto* p : list) {
    const ColMajor c = col_major(*p);
    groups[Key{c.op_first, c.op_second, c.m, c.n, c.k, p->alpha, p->beta}].push_back(p);
  }
  const std::size_t G = groups.size(), P = list.size();
  std::vector<cublasOperation_t> op_first, op_second;
  std::vector<int> m, n, k, ld_first, ld_second, ldc, group_size;
  std::vector<float> alpha, beta;
  std::vector<const void*> first_ptrs, second_ptrs;
  std::vector<void*> c_ptrs;
  for (auto& [key, ps] : groups) {
    const ColMajor c = col_major(*ps.front());
    op_first.push_back(c.op_first);
    op_second.push_back(c.op_second);
    m.push_back(c.m);
    n.push_back(c.n);
    k.push_back(c.k);
    ld_first.push_back(c.ld_first);
    ld_second.push_back(c.ld_second);
    ldc.push_back(c.ldc);
    alpha.push_back(ps.front()->alpha);
    beta.push_back(ps.front()->beta);
    group_size.push_back(static_cast<int>(ps.size()));
    for (const auto* p : ps) {
      first_ptrs.push_back(p->b.raw());
      second_ptrs.push_back(p->a.raw());
      c_ptrs.push_back(p->c.raw());
    }
  }
  // The three pointer arrays must be in device memory (the scalars and shapes stay on the
  // host): stage them through pinned memory and a stream-ordered allocation.
  const std::size_t bytes = 3 * P * sizeof(void*);
  void* dev = nullptr;
  cuda_kernels::check_alloc(cudaMallocAsync(&dev, bytes, st), "cudaMallocAsync (gemm pointers)", bytes);
  // Given back on the stream whatever happens below (a staging or copy failure throws).
  struct FreeOnExit {
    void* p;
    cudaStream_t s;
    ~FreeOnExit() { cudaFreeAsync(p, s); }
  } free_on_exit{dev, st};
  {
    std::lock_guard lock(mu_);
    const std::size_t chunk = staging_->acquire(bytes);
    auto* host = static_cast<const void**>(staging_->ptr(chunk));
    std::copy(first_ptrs.begin(), first_ptrs.end(), host);
    std::copy(second_ptrs.begin(), second_ptrs.end(), host + P);
    std::copy(c_ptrs.begin(), c_ptrs.end(), host + 2 * P);
    cuda_check(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, st), "cudaMemcpyAsync (gemm pointers)");
    staging_->release(chunk, st);
  }
  auto** dptr = static_cast<void**>(dev);
  const GemmProblem& f = *list.front();
  const DType ab = f.a.dtype(), ct = f.c.dtype();
  const cublasStatus_t status = cublasGemmGroupedBatchedEx(
      h, op_first.data(), op_second.data(), m.data(), n.data(), k.data(), alpha.data(),
      const_cast<const void* const*>(dptr), cuda_type(ab), ld_first.data(),
      const_cast<const void* const*>(dptr + P), cuda_type(ab), ld_second.data(), beta.data(), dptr + 2 * P,
      cuda_type(ct), ldc.data(), static_cast<int>(G), group_size.data(), compute_type(ab));
  return status;
}

// ---- GEMMs with a fused epilogue (cuBLASLt) -------------------------------------------
//
// cuBLASLt has no grouped matmul, so a call runs as one strided batch (its operands, aux
// included, equally strided, or the padded layout's rows) or as a loop of single matmuls, as the
// crossover table picks between those two; whatever cuBLASLt refuses (a leading dimension or
// alignment its GELU kernels do not take, a type combination) runs unfused, that problem's
// GEMM and then the activation kernel, and the op's detail says so.
namespace {

// The largest power of two (at most 256, cuBLASLt's default requirement) dividing `bytes`.
std::uint32_t alignment_of(std::uint64_t bytes) {
  std::uint32_t a = 256;
  while (a > 1 && bytes % a != 0) a /= 2;
  return a;
}

// cuBLAS's default workspace on Hopper (cuBLAS documentation, cublasSetWorkspace: 32 MiB for
// Hopper, 4 MiB before it); the same for cuBLASLt's fused GEMMs, per stream.
constexpr std::size_t kLtWorkspaceBytes = 32u << 20;

struct LtLayouts {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  ~LtLayouts() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

cublasStatus_t lt_layout(cublasLtMatrixLayout_t* out, cudaDataType_t t, int rows, int cols, int ld, int batch,
                         std::int64_t stride) {
  cublasStatus_t st = cublasLtMatrixLayoutCreate(out, t, static_cast<std::uint64_t>(rows),
                                                 static_cast<std::uint64_t>(cols), ld);
  if (st != CUBLAS_STATUS_SUCCESS || batch <= 1) return st;
  st = cublasLtMatrixLayoutSetAttribute(*out, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch));
  if (st != CUBLAS_STATUS_SUCCESS) return st;
  return cublasLtMatrixLayoutSetAttribute(*out, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride));
}

// The stride (elements) between consecutive aux matrices of `list`, or -1 when they are not
// equally strided at whole elements of at least one product apart.
std::int64_t aux_stride(std::span<const GemmProblem* const> list) {
  if (list.size() < 2) return 0;
  const auto addr = [](const GemmProblem* p) { return reinterpret_cast<std::uintptr_t>(p->aux.raw()); };
  const std::size_t es = dtype_size(list.front()->aux.dtype());
  const std::int64_t d = static_cast<std::int64_t>(addr(list[1])) - static_cast<std::int64_t>(addr(list[0]));
  if (d % static_cast<std::int64_t>(es) != 0) return -1;
  for (std::size_t i = 1; i < list.size(); ++i)
    if (static_cast<std::int64_t>(addr(list[i])) - static_cast<std::int64_t>(addr(list[i - 1])) != d) return -1;
  const std::int64_t stride = d / static_cast<std::int64_t>(es);
  return stride >= list.front()->m * list.front()->n ? stride : -1;
}

}  // namespace

cublasStatus_t CudaBackend::lt_matmul(Stream& s, const GemmProblem& p, GemmEpilogue ep, const LtStrides& sd) {
  CudaStream& cs = cstream(s);
  const ColMajor c = col_major(p);
  // cuBLASLt's GELU aux: leading dimension and batch stride divisible by 8 (cublasLt.h,
  // CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD / _AUX_BATCH_STRIDE).
  if (c.ldc % 8 != 0 || (sd.batch > 1 && sd.aux % 8 != 0)) return CUBLAS_STATUS_NOT_SUPPORTED;
  {
    std::lock_guard lock(mu_);
    if (!lt_) {
      const cublasStatus_t st = cublasLtCreate(&lt_);
      if (st != CUBLAS_STATUS_SUCCESS) return st;
    }
  }
  if (!cs.lt_workspace)
    cs.lt_workspace = malloc_outside_pool(kLtWorkspaceBytes, "cudaMalloc (cuBLASLt workspace)");
  const DType ab = p.a.dtype(), ct = p.c.dtype();
  const cublasComputeType_t compute = compute_type(ab);
  LtLayouts L;
  cublasStatus_t st = cublasLtMatmulDescCreate(&L.op, compute, CUDA_R_32F);
  const cublasLtEpilogue_t epi = ep == GemmEpilogue::act_aux ? CUBLASLT_EPILOGUE_GELU_AUX : CUBLASLT_EPILOGUE_DGELU;
  const void* aux_ptr = p.aux.raw();
  const std::int64_t aux_ld = c.ldc;
  const auto set = [&](cublasLtMatmulDescAttributes_t attr, const void* v, std::size_t n) {
    if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulDescSetAttribute(L.op, attr, v, n);
  };
  set(CUBLASLT_MATMUL_DESC_TRANSA, &c.op_first, sizeof(c.op_first));
  set(CUBLASLT_MATMUL_DESC_TRANSB, &c.op_second, sizeof(c.op_second));
  set(CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
  set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux_ptr, sizeof(aux_ptr));
  set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld));
  if (sd.batch > 1) set(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE, &sd.aux, sizeof(sd.aux));
  // cuBLAS's first operand is our B, its second our A (col_major).
  const bool first_n = c.op_first == CUBLAS_OP_N, second_n = c.op_second == CUBLAS_OP_N;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = lt_layout(&L.a, cuda_type(p.b.dtype()), first_n ? c.m : c.k, first_n ? c.k : c.m, c.ld_first, sd.batch, sd.b);
  if (st == CUBLAS_STATUS_SUCCESS)
    st = lt_layout(&L.b, cuda_type(ab), second_n ? c.k : c.n, second_n ? c.n : c.k, c.ld_second, sd.batch, sd.a);
  if (st == CUBLAS_STATUS_SUCCESS) st = lt_layout(&L.c, cuda_type(ct), c.m, c.n, c.ldc, sd.batch, sd.c);
  if (st != CUBLAS_STATUS_SUCCESS) return st;

  // The alignments the kernels may assume: each matrix's address and, in a batch, its stride.
  const auto align = [&](const void* ptr, std::int64_t stride, DType t) {
    std::uint32_t a = alignment_of(reinterpret_cast<std::uintptr_t>(ptr));
    if (sd.batch > 1) a = std::min(a, alignment_of(static_cast<std::uint64_t>(stride) * dtype_size(t)));
    return a;
  };
  const std::uint32_t al_a = align(p.b.raw(), sd.b, p.b.dtype()), al_b = align(p.a.raw(), sd.a, ab),
                      al_c = align(p.c.raw(), sd.c, ct), al_aux = align(aux_ptr, sd.aux, ct);
  const std::vector<std::int64_t> key{static_cast<int>(ep), static_cast<int>(ab), static_cast<int>(ct), compute,
                                      c.op_first, c.op_second, c.m, c.n, c.k, c.ld_first, c.ld_second, c.ldc,
                                      sd.batch, sd.a, sd.b, sd.c, sd.aux, al_a, al_b, al_c, al_aux};
  std::optional<cublasLtMatmulAlgo_t> algo;
  bool known = false;
  {
    std::lock_guard lock(mu_);
    if (auto it = lt_algos_.find(key); it != lt_algos_.end()) {
      known = true;
      algo = it->second;
    }
  }
  if (!known) {
    cublasLtMatmulPreference_t pref = nullptr;
    st = cublasLtMatmulPreferenceCreate(&pref);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    const std::uint64_t ws = kLtWorkspaceBytes;
    // Every preference must hold: the alignments default to 256 bytes, and a heuristic asked
    // without ours could answer with a kernel that assumes more alignment than a row view has.
    const auto pref_set = [&](cublasLtMatmulPreferenceAttributes_t attr, const void* v, std::size_t n) {
      if (st == CUBLAS_STATUS_SUCCESS) st = cublasLtMatmulPreferenceSetAttribute(pref, attr, v, n);
    };
    pref_set(CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
    pref_set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a));
    pref_set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b));
    pref_set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c));
    pref_set(CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c));
    if (st != CUBLAS_STATUS_SUCCESS) {
      cublasLtMatmulPreferenceDestroy(pref);
      return st;
    }
    cublasLtMatmulHeuristicResult_t result{};
    int returned = 0;
    st = cublasLtMatmulAlgoGetHeuristic(lt_, L.op, L.a, L.b, L.c, L.c, pref, 1, &result, &returned);
    cublasLtMatmulPreferenceDestroy(pref);
    if (st == CUBLAS_STATUS_SUCCESS && returned > 0 && result.state == CUBLAS_STATUS_SUCCESS) algo = result.algo;
    else if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE)
      return st;
    std::lock_guard lock(mu_);
    lt_algos_[key] = algo;
  }
  if (!algo) return CUBLAS_STATUS_NOT_SUPPORTED;
  const float alpha = 1.0f, beta = 0.0f;
  return cublasLtMatmul(lt_, L.op, &alpha, p.b.raw(), L.a, p.a.raw(), L.b, &beta, p.c.raw(), L.c, p.c.raw(), L.c,
                        &*algo, cs.lt_workspace, kLtWorkspaceBytes, cs.native);
}

void CudaBackend::unfused_epilogue(Stream& s, const GemmProblem& p, GemmEpilogue ep, Activation act) {
  unfused_epilogues_.fetch_add(1, std::memory_order_relaxed);
  cublasHandle_t h = blas(s);
  const std::int64_t n = p.m * p.n;
  if (ep == GemmEpilogue::act_aux) {
    GemmProblem q = p;
    q.c = p.aux;
    gemm_one(h, q);
    cuda_kernels::activation_forward(native(s), elem_of(p.c), act_of(act), p.aux.raw(), p.c.raw(), n);
  } else {
    gemm_one(h, p);
    cuda_kernels::activation_backward(native(s), elem_of(p.c), act_of(act), p.aux.raw(), p.c.raw(), p.c.raw(), n);
  }
}

void CudaBackend::grouped_gemm_epilogue(Stream& s, std::span<const GemmProblem> problems, GemmEpilogue ep,
                                        Activation act, const char* name) {
  check_gemm_epilogue(problems, ep);
  for (const auto& p : problems) check_problem(p);
  if (act != Activation::gelu_tanh) {  // cuBLASLt's GELU is the tanh form: the rest run unfused
    Backend::grouped_gemm_epilogue(s, problems, ep, act, name);
    return;
  }
  const std::string op_name = name ? name : "gemm";
  CudaOpScope op(*this, s, op_name, cost_grouped_gemm_epilogue(problems, ep, act));
  const std::string fused = std::string(" + ") + activation_name(act) + " epilogue (cuBLASLt " +
                            (ep == GemmEpilogue::act_aux ? "GELU_AUX" : "DGELU") + ")";
  const auto lt_ok = [&](cublasStatus_t st) {
    if (st == CUBLAS_STATUS_SUCCESS) return true;
    if (st == CUBLAS_STATUS_NOT_SUPPORTED || st == CUBLAS_STATUS_INVALID_VALUE) return false;
    cublas_check(st, "cublasLtMatmul");
    return false;
  };

  // The padded layout: one batch over the padded rows when the table picks the strided path
  // (cuBLASLt has no grouped matmul to weigh against it).
  if (problems.size() > 1 && common_token_stride(problems) > 0)
    if (std::optional<PaddedBatch> pb = padded_batch(problems, false)) {
      const std::int64_t sa = aux_stride(pb->list);
      const StridedRun& r = pb->run;
      if (sa >= 0 && lt_ok(lt_matmul(s, pb->problems.front(), ep,
                                     {static_cast<int>(pb->list.size()), r.stride_a, r.stride_b, r.stride_c, sa}))) {
        note_path(op_name, GemmPath::strided_batched, pb->why + fused);
        op.set_detail(pb->why + fused);
        return;
      }
    }

  // k == 0: the product is zero, and so are GeLU(0) and 0 · GeLU'(aux).
  const std::vector<const GemmProblem*> live = live_problems(problems, [&](const GemmProblem& p) {
    const std::size_t bytes = static_cast<std::size_t>(p.m * p.n) * dtype_size(p.c.dtype());
    cuda_check(cudaMemsetAsync(p.c.raw(), 0, bytes, native(s)), "cudaMemsetAsync (gemm k=0)");
    if (ep == GemmEpilogue::act_aux)
      cuda_check(cudaMemsetAsync(p.aux.raw(), 0, bytes, native(s)), "cudaMemsetAsync (gemm k=0)");
  });
  std::string detail;
  for (auto& [types, list] : by_types(live)) {
    GemmPathChoice choice;
    choice.path = GemmPath::loop;
    if (list.size() == 1) choice.why = one_problem_why(*list.front(), "one problem: one cublasLtMatmul");
    const std::vector<StridedRun> runs = strided_runs(operands_of(list));
    const std::int64_t sa = aux_stride(list);
    if (list.size() > 1)  // no grouped path: cuBLASLt has no grouped matmul
      choice = choose_path(list, static_cast<DType>(types.first), runs.size() == 1 && sa >= 0, false);
    GemmPath ran = choice.path;
    int unfused = 0;
    if (ran == GemmPath::strided_batched) {
      const StridedRun& r = runs.front();
      if (!lt_ok(lt_matmul(s, *list.front(), ep, {static_cast<int>(list.size()), r.stride_a, r.stride_b, r.stride_c, sa})))
        ran = GemmPath::loop;
    }
    if (ran == GemmPath::loop)
      for (const auto* p : list)
        if (!lt_ok(lt_matmul(s, *p, ep, {}))) {
          unfused_epilogue(s, *p, ep, act);
          ++unfused;
        }
    std::string why = choice.why + fused;
    if (ran != choice.path) why = "loop (cuBLASLt refused the batch); " + why;
    if (unfused > 0)
      why += "; " + std::to_string(unfused) + " of " + std::to_string(list.size()) +
             " unfused (cuBLASLt has no GELU kernel for them: cublasGemmEx, then the activation kernel)";
    note_path(op_name, ran, why);
    detail += (detail.empty() ? "" : " | ") + why;
  }
  if (!detail.empty()) op.set_detail(std::move(detail));
}

// ---- transformer-block ops -----------------------------------------------------------
//
// Shapes are checked here (MOELAB_CHECK: a wrong shape is a bug of the caller), dtypes and
// sizes the kernels cannot serve are Unsupported; then each op is one CudaOpScope around its
// launcher(s) in block_kernels.cu, costed by its one function in cost.cpp.
namespace {

const void* raw_or_null(const Tensor& t) { return t.defined() ? t.raw() : nullptr; }
void* raw_or_null(Tensor& t) { return t.defined() ? t.raw() : nullptr; }

// `t` is defined, has `numel` elements and dtype `dt`.
void require(const Tensor& t, std::int64_t numel, DType dt, const std::string& what) {
  MOELAB_CHECK(t.defined() && t.numel() == numel && t.dtype() == dt,
               what + ": expected " + std::to_string(numel) + " elements of " + dtype_name(dt) + ", got " +
                   (t.defined() ? t.describe() : std::string("undefined")));
}

// A shard of `rows` rows (or columns) inside its vocabulary.
void check_shard(const VocabShard& shard, std::int64_t rows, const char* op) {
  const std::int64_t total = shard.total > 0 ? shard.total : rows;
  MOELAB_CHECK(shard.start >= 0 && shard.start + rows <= total,
               std::string(op) + ": rows [" + std::to_string(shard.start) + ", " + std::to_string(shard.start + rows) +
                   ") are not in a vocabulary of " + std::to_string(total));
}

// What the tiled attention kernels serve (block_kernels.cu): head_dim up to 128 (a lane keeps
// 4 output columns in registers), at most 65535 sequences and 65535 query heads (grid
// dimensions).
void check_attention(const AttentionShape& a, const char* op) {
  if (a.head_dim > cuda_kernels::kMaxHeadDim)
    throw Unsupported(std::string(op) + " on the cuda backend: head_dim " + std::to_string(a.head_dim) +
                      " exceeds the tiled kernel's maximum of " + std::to_string(cuda_kernels::kMaxHeadDim));
  if (a.batch > 65535)
    throw Unsupported(std::string(op) + " on the cuda backend: batch " + std::to_string(a.batch) +
                      " exceeds 65535 sequences per call (a grid dimension)");
  if (a.heads > 65535)
    throw Unsupported(std::string(op) + " on the cuda backend: " + std::to_string(a.heads) +
                      " query heads exceed 65535 per call (a grid dimension)");
  MOELAB_CHECK(a.batch >= 0 && a.seq >= 0 && a.head_dim >= 1 && a.heads >= 1 && a.kv_heads >= 1 &&
                   a.heads % a.kv_heads == 0,
               std::string(op) + ": bad attention shape (batch " + std::to_string(a.batch) + ", seq " +
                   std::to_string(a.seq) + ", heads " + std::to_string(a.heads) + "/" + std::to_string(a.kv_heads) +
                   ", head_dim " + std::to_string(a.head_dim) + ")");
}

}  // namespace

void CudaBackend::embedding_forward(Stream& s, const Tensor& ids, const Tensor& wte, const Tensor& wpe,
                                    std::int64_t seq_len, Tensor& out, const VocabShard& shard) {
  const std::int64_t T = ids.numel(), M = width_of(wte), V = rows_of(wte);
  check_shard(shard, V, "embedding_forward");
  MOELAB_CHECK(ids.dtype() == DType::i32 && wte.ndim() == 2, "embedding_forward ids " + ids.describe() + ", wte " +
                                                                  wte.describe());
  require(out, T * M, wte.dtype(), "embedding_forward out");
  if (wpe.defined())
    MOELAB_CHECK(wpe.dtype() == wte.dtype() && width_of(wpe) == M && seq_len >= 1 && rows_of(wpe) >= seq_len,
                 "embedding_forward wpe " + wpe.describe() + " for seq_len " + std::to_string(seq_len));
  CudaOpScope op(*this, s, "embedding", cost_embedding_forward(T, M, wpe.defined(), wte.dtype()));
  cuda_kernels::embedding_forward(native(s), elem_of(wte), i32p(ids), wte.raw(), raw_or_null(wpe), out.raw(), T, M,
                                  std::max<std::int64_t>(seq_len, 1), V, shard.start);
}

void CudaBackend::embedding_backward(Stream& s, const Tensor& d_out, const Tensor& ids, std::int64_t seq_len,
                                     Tensor& d_wte, Tensor& d_wpe, const VocabShard& shard) {
  const std::int64_t T = ids.numel(), M = width_of(d_out);
  MOELAB_CHECK(ids.dtype() == DType::i32 && d_out.numel() == T * M,
               "embedding_backward d_out " + d_out.describe() + ", ids " + ids.describe());
  MOELAB_CHECK(T <= std::numeric_limits<int>::max(), "embedding_backward: T out of int range");
  std::int64_t V = 0;
  if (d_wte.defined()) {
    MOELAB_CHECK(d_wte.dtype() == d_out.dtype() && width_of(d_wte) == M,
                 "embedding_backward d_wte " + d_wte.describe() + " for d_out " + d_out.describe());
    V = rows_of(d_wte);
    check_shard(shard, V, "embedding_backward");
  }
  if (d_wpe.defined())
    MOELAB_CHECK(d_wpe.dtype() == d_out.dtype() && width_of(d_wpe) == M && seq_len >= 1 &&
                     rows_of(d_wpe) >= seq_len && T % seq_len == 0,
                 "embedding_backward d_wpe " + d_wpe.describe() + " for " + std::to_string(T) +
                     " tokens of seq_len " + std::to_string(seq_len));
  CudaOpScope op(*this, s, "embedding_bwd", cost_embedding_backward(T, M, d_wpe.defined(), d_out.dtype()));
  cuda_kernels::embedding_backward(native(s), elem_of(d_out), d_out.raw(), i32p(ids), raw_or_null(d_wte),
                                   raw_or_null(d_wpe), T, M, std::max<std::int64_t>(seq_len, 1), V, shard.start);
}

void CudaBackend::norm_forward(Stream& s, NormKind kind, float eps, const Tensor& x, const Tensor& gamma,
                               const Tensor& beta, Tensor& y, Tensor& mean, Tensor& rstd) {
  const std::int64_t T = rows_of(x), M = width_of(x);
  const bool rms = kind == NormKind::rmsnorm;
  require(gamma, M, x.dtype(), "norm_forward gamma");
  if (beta.defined() && !rms) require(beta, M, x.dtype(), "norm_forward beta");
  require(y, T * M, x.dtype(), "norm_forward y");
  require(rstd, T, DType::f32, "norm_forward rstd");
  if (!rms) require(mean, T, DType::f32, "norm_forward mean");
  CudaOpScope op(*this, s, norm_name(kind), cost_norm_forward(kind, T, M, x.dtype()));
  cuda_kernels::norm_forward(native(s), elem_of(x), rms, eps, x.raw(), gamma.raw(), rms ? nullptr : raw_or_null(beta),
                             y.raw(), rms ? nullptr : f32p(mean), f32p(rstd), T, M);
}

void CudaBackend::norm_backward(Stream& s, NormKind kind, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                                const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor& d_gamma, Tensor& d_beta) {
  const std::int64_t T = rows_of(x), M = width_of(x);
  const bool rms = kind == NormKind::rmsnorm;
  require(gamma, M, x.dtype(), "norm_backward gamma");
  require(rstd, T, DType::f32, "norm_backward rstd");
  if (!rms) require(mean, T, DType::f32, "norm_backward mean");
  require(dy, T * M, x.dtype(), "norm_backward dy");
  require(dx, T * M, x.dtype(), "norm_backward dx");
  if (d_gamma.defined()) require(d_gamma, M, x.dtype(), "norm_backward d_gamma");
  if (d_beta.defined() && !rms) require(d_beta, M, x.dtype(), "norm_backward d_beta");
  CudaOpScope op(*this, s, std::string(norm_name(kind)) + "_bwd", cost_norm_backward(kind, T, M, x.dtype()));
  cuda_kernels::norm_backward(native(s), elem_of(x), rms, x.raw(), gamma.raw(), rms ? nullptr : f32p(mean),
                              f32p(rstd), dy.raw(), dx.raw(), raw_or_null(d_gamma),
                              rms ? nullptr : raw_or_null(d_beta), T, M);
}

void CudaBackend::rope(Stream& s, const AttentionShape& a, float theta, bool inverse, Tensor& qkv) {
  check_attention(a, "rope");
  if (a.head_dim % 2 != 0)
    throw Unsupported("rope on the cuda backend: head_dim " + std::to_string(a.head_dim) +
                      " is odd (dimension i pairs with i + head_dim/2)");
  require(qkv, a.tokens() * a.qkv_width(), qkv.dtype(), "rope qkv");
  CudaOpScope op(*this, s, inverse ? "rope_inv" : "rope", cost_rope(a, qkv.dtype()));
  cuda_kernels::rope(native(s), elem_of(qkv), a, theta, inverse, qkv.raw());
}

void CudaBackend::attention_forward(Stream& s, const AttentionShape& a, const Tensor& qkv, Tensor& out, Tensor& lse) {
  check_attention(a, "attention_forward");
  const std::int64_t T = a.tokens();
  require(qkv, T * a.qkv_width(), qkv.dtype(), "attention_forward qkv");
  require(out, T * a.heads * a.head_dim, qkv.dtype(), "attention_forward out");
  require(lse, T * a.heads, DType::f32, "attention_forward lse [B,Hq,S]");
  CudaOpScope op(*this, s, "attention", cost_attention_forward(a, qkv.dtype()));
  cuda_kernels::attention_forward(native(s), elem_of(qkv), a, qkv.raw(), out.raw(), f32p(lse));
}

void CudaBackend::attention_backward(Stream& s, const AttentionShape& a, const Tensor& qkv, const Tensor& out,
                                     const Tensor& lse, const Tensor& d_out, Tensor& d_qkv) {
  check_attention(a, "attention_backward");
  const std::int64_t T = a.tokens();
  require(qkv, T * a.qkv_width(), qkv.dtype(), "attention_backward qkv");
  require(out, T * a.heads * a.head_dim, qkv.dtype(), "attention_backward out");
  require(lse, T * a.heads, DType::f32, "attention_backward lse [B,Hq,S]");
  require(d_out, T * a.heads * a.head_dim, qkv.dtype(), "attention_backward d_out");
  require(d_qkv, T * a.qkv_width(), qkv.dtype(), "attention_backward d_qkv");
  CudaOpScope op(*this, s, "attention_bwd", cost_attention_backward(a, qkv.dtype()));
  cuda_kernels::attention_backward(native(s), elem_of(qkv), a, qkv.raw(), out.raw(), f32p(lse), d_out.raw(),
                                   d_qkv.raw());
}

void CudaBackend::swiglu_forward(Stream& s, const Tensor& h, Tensor& out) {
  const std::int64_t T = rows_of(out), F = width_of(out);
  MOELAB_CHECK(width_of(h) == 2 * F, "swiglu_forward h " + h.describe() + " -> out " + out.describe());
  require(h, T * 2 * F, out.dtype(), "swiglu_forward h");
  CudaOpScope op(*this, s, "swiglu", cost_swiglu_forward(T, F, out.dtype()));
  cuda_kernels::swiglu_forward(native(s), elem_of(out), h.raw(), out.raw(), T, F);
}

void CudaBackend::swiglu_backward(Stream& s, const Tensor& h, const Tensor& d_out, Tensor& d_h) {
  const std::int64_t T = rows_of(d_out), F = width_of(d_out);
  MOELAB_CHECK(width_of(h) == 2 * F, "swiglu_backward h " + h.describe() + ", d_out " + d_out.describe());
  require(h, T * 2 * F, d_out.dtype(), "swiglu_backward h");
  require(d_h, T * 2 * F, d_out.dtype(), "swiglu_backward d_h");
  CudaOpScope op(*this, s, "swiglu_bwd", cost_swiglu_backward(T, F, d_out.dtype()));
  cuda_kernels::swiglu_backward(native(s), elem_of(d_out), h.raw(), d_out.raw(), d_h.raw(), T, F);
}

void CudaBackend::add(Stream& s, const Tensor& a, const Tensor& b, Tensor& out) {
  require(b, a.numel(), a.dtype(), "add b");
  require(out, a.numel(), a.dtype(), "add out");
  CudaOpScope op(*this, s, "add", cost_add(a.numel(), a.dtype()));
  cuda_kernels::add(native(s), elem_of(a), a.raw(), b.raw(), out.raw(), a.numel());
}

void CudaBackend::gated_combine_forward(Stream& s, const Tensor& z, const Tensor& a, const Tensor& b, Tensor& out) {
  const std::int64_t T = rows_of(a), M = width_of(a), G = width_of(z);
  MOELAB_CHECK(G == 1 || G == 2, "gated_combine_forward z " + z.describe() + ": 1 or 2 gate logits per row");
  require(z, T * G, DType::f32, "gated_combine_forward z");
  require(b, T * M, a.dtype(), "gated_combine_forward b");
  require(out, T * M, a.dtype(), "gated_combine_forward out");
  CudaOpScope op(*this, s, "gated_combine", cost_gated_combine_forward(T, M, static_cast<int>(G), a.dtype()));
  cuda_kernels::gated_combine_forward(native(s), elem_of(a), f32p(z), static_cast<int>(G), a.raw(), b.raw(), out.raw(),
                                      T, M);
}

void CudaBackend::gated_combine_backward(Stream& s, const Tensor& z, const Tensor& a, const Tensor& b,
                                         const Tensor& d_out, Tensor& da, Tensor& db, Tensor& dz) {
  const std::int64_t T = rows_of(a), M = width_of(a), G = width_of(z);
  MOELAB_CHECK(G == 1 || G == 2, "gated_combine_backward z " + z.describe() + ": 1 or 2 gate logits per row");
  MOELAB_CHECK(G == 1 || (b.defined() && db.defined()), "gated_combine_backward: a softmax gate needs b and db");
  require(z, T * G, DType::f32, "gated_combine_backward z");
  require(d_out, T * M, a.dtype(), "gated_combine_backward d_out");
  require(da, T * M, a.dtype(), "gated_combine_backward da");
  require(dz, T * G, DType::f32, "gated_combine_backward dz");
  if (db.defined()) require(db, T * M, a.dtype(), "gated_combine_backward db");
  if (G == 2) require(b, T * M, a.dtype(), "gated_combine_backward b");
  CudaOpScope op(*this, s, "gated_combine_bwd",
                 cost_gated_combine_backward(T, M, static_cast<int>(G), db.defined(), a.dtype()));
  cuda_kernels::gated_combine_backward(native(s), elem_of(a), f32p(z), static_cast<int>(G), a.raw(),
                                       b.defined() ? b.raw() : nullptr, d_out.raw(), da.raw(),
                                       db.defined() ? db.raw() : nullptr, f32p(dz), T, M);
}

void CudaBackend::scale(Stream& s, const Tensor& x, float alpha, Tensor& out) {
  require(out, x.numel(), x.dtype(), "scale out");
  CudaOpScope op(*this, s, "scale", cost_scale(x.numel(), x.dtype()));
  cuda_kernels::scale(native(s), elem_of(x), x.raw(), alpha, out.raw(), x.numel());
}

void CudaBackend::cross_entropy_forward(Stream& s, const Tensor& logits, const Tensor& targets, Tensor& losses,
                                        Tensor& lse, const VocabShard& shard) {
  const std::int64_t T = rows_of(logits), V = width_of(logits);
  check_shard(shard, V, "cross_entropy_forward");
  require(targets, T, DType::i32, "cross_entropy_forward targets");
  require(losses, T, DType::f32, "cross_entropy_forward losses");
  require(lse, T, DType::f32, "cross_entropy_forward lse");
  CudaOpScope op(*this, s, "cross_entropy", cost_cross_entropy_forward(T, V, logits.dtype()));
  cuda_kernels::cross_entropy_forward(native(s), elem_of(logits), logits.raw(), i32p(targets), f32p(losses),
                                      f32p(lse), T, V, shard.start, shard.total > 0 ? shard.total : V);
}

void CudaBackend::cross_entropy_combine(Stream& s, const Tensor& parts, const Tensor& targets, std::int64_t shard_rows,
                                        Tensor& losses, Tensor& lse) {
  const std::int64_t T = targets.numel();
  MOELAB_CHECK(parts.dtype() == DType::f32 && T > 0 && parts.numel() % (2 * T) == 0 && shard_rows >= 1,
               "cross_entropy_combine parts " + parts.describe() + " for " + std::to_string(T) + " targets");
  require(targets, T, DType::i32, "cross_entropy_combine targets");
  require(losses, T, DType::f32, "cross_entropy_combine losses");
  require(lse, T, DType::f32, "cross_entropy_combine lse");
  const std::int64_t P = parts.numel() / (2 * T);
  CudaOpScope op(*this, s, "cross_entropy_combine", cost_cross_entropy_combine(T, P));
  cuda_kernels::cross_entropy_combine(native(s), f32p(parts), i32p(targets), f32p(losses), f32p(lse), T, P,
                                      shard_rows);
}

void CudaBackend::cross_entropy_backward(Stream& s, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                                         float scale, Tensor& d_logits, const VocabShard& shard) {
  const std::int64_t T = rows_of(logits), V = width_of(logits);
  check_shard(shard, V, "cross_entropy_backward");
  require(targets, T, DType::i32, "cross_entropy_backward targets");
  require(lse, T, DType::f32, "cross_entropy_backward lse");
  require(d_logits, T * V, logits.dtype(), "cross_entropy_backward d_logits");
  CudaOpScope op(*this, s, "cross_entropy_bwd", cost_cross_entropy_backward(T, V, logits.dtype()));
  cuda_kernels::cross_entropy_backward(native(s), elem_of(logits), logits.raw(), i32p(targets), f32p(lse), scale,
                                       d_logits.raw(), T, V, shard.start, shard.total > 0 ? shard.total : V);
}

void CudaBackend::optimizer_step(Stream& s, const OptimizerStep& o) {
  const std::int64_t n = o.param.numel();
  const bool adam = o.kind == OptimizerKind::adam;
  MOELAB_CHECK(o.grad.defined() && o.grad.numel() == n,
               "optimizer_step grad " + (o.grad.defined() ? o.grad.describe() : std::string("undefined")) +
                   " for param " + o.param.describe());
  if (o.master.defined())
    require(o.master, n, DType::f32, "optimizer_step master");
  else
    MOELAB_CHECK(o.param.dtype() == DType::f32,
                 "optimizer_step: a " + std::string(dtype_name(o.param.dtype())) + " parameter needs an fp32 master");
  if (adam) {
    require(o.m, n, DType::f32, "optimizer_step m");
    require(o.v, n, DType::f32, "optimizer_step v");
    MOELAB_CHECK(o.step >= 1, "optimizer_step: Adam step counts from 1, got " + std::to_string(o.step));
  }
  cuda_kernels::OptimizerArgs k;
  k.adam = adam;
  k.param_elem = elem_of(o.param);
  k.grad_elem = elem_of(o.grad);
  k.param = o.param.raw();
  k.grad = o.grad.raw();
  k.master = o.master.defined() ? o.master.data<float>() : nullptr;
  k.m = adam ? o.m.data<float>() : nullptr;
  k.v = adam ? o.v.data<float>() : nullptr;
  k.n = n;
  k.lr = o.lr;
  k.beta1 = o.beta1;
  k.beta2 = o.beta2;
  k.eps = o.eps;
  k.weight_decay = o.weight_decay;
  if (adam) {  // 1 - beta^t in double: beta2^t creeps towards 1 slowly and fp32 would lose it
    const double t = static_cast<double>(o.step);
    k.bias_correction1 = static_cast<float>(1.0 - std::pow(static_cast<double>(o.beta1), t));
    k.bias_correction2 = static_cast<float>(1.0 - std::pow(static_cast<double>(o.beta2), t));
  }
  CudaOpScope op(*this, s, adam ? "adam" : "sgd",
                 cost_optimizer_step(o.kind, n, o.param.dtype(), o.master.defined()));
  cuda_kernels::optimizer_step(native(s), k);
}

// Median seconds of `run_all` (issued on the bare stream with its own cuBLAS handle) over
// `reps` repetitions after one warm-up, in which cuBLAS picks and loads its kernels.
template <class F>
double CudaBackend::time_on_bare_stream(int reps, F&& run_all) {
  reps = std::max(reps, 1);
  synchronize();
  set_device();
  if (!bare_stream_) {
    cuda_check(cudaStreamCreateWithFlags(&bare_stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    cublas_check(cublasCreate(&bare_blas_), "cublasCreate");
    cublas_check(cublasSetStream(bare_blas_, bare_stream_), "cublasSetStream");
  }
  cudaEvent_t a, b;
  cuda_check(cudaEventCreate(&a), "cudaEventCreate");
  cuda_check(cudaEventCreate(&b), "cudaEventCreate");
  std::vector<double> t;
  try {
    run_all();
    for (int r = 0; r < reps; ++r) {
      cuda_check(cudaEventRecord(a, bare_stream_), "cudaEventRecord");
      run_all();
      cuda_check(cudaEventRecord(b, bare_stream_), "cudaEventRecord");
      cuda_check(cudaEventSynchronize(b), "cudaEventSynchronize");
      float ms = 0;
      cuda_check(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
      t.push_back(1e-3 * static_cast<double>(ms));
    }
  } catch (...) {
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    throw;
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];  // the cpu backend's median convention
}

double CudaBackend::time_bare_gemms(std::span<const GemmProblem> problems, int reps) {
  for (const auto& p : problems) check_problem(p);
  return time_on_bare_stream(reps, [&] {
    for (const auto& p : problems)
      if (p.m > 0 && p.n > 0 && p.k > 0) gemm_one(bare_blas_, p);
  });
}

// The floor: each strided run as one cublasGemmStridedBatchedEx (a run of one, or a type
// combination without a strided kernel, as cublasGemmEx).
double CudaBackend::time_batched_gemms(std::span<const GemmProblem> problems, int reps) {
  for (const auto& p : problems) check_problem(p);
  std::vector<const GemmProblem*> live;
  for (const auto& p : problems)
    if (p.m > 0 && p.n > 0 && p.k > 0) live.push_back(&p);
  const std::vector<StridedRun> runs = strided_runs(operands_of(live));
  return time_on_bare_stream(reps, [&] {
    for (const StridedRun& r : runs) {
      const std::span<const GemmProblem* const> run(live.data() + r.begin, r.size());
      if (r.size() > 1) {
        const cublasStatus_t status = gemm_strided(bare_blas_, run, r);
        if (status != CUBLAS_STATUS_NOT_SUPPORTED && status != CUBLAS_STATUS_INVALID_VALUE) {
          cublas_check(status, "cublasGemmStridedBatchedEx");
          continue;
        }
      }
      for (const auto* p : run) gemm_one(bare_blas_, *p);
    }
  });
}

// ---- public functions ----------------------------------------------------------------

namespace {
// The visible devices; 0 on any CUDA error (no driver, driver too old), which is cleared.
int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // leave no sticky error behind for whoever calls CUDA next
    return 0;
  }
  return n;
}
}  // namespace

bool cuda_device_present() { return device_count() > 0; }

int local_device(int devices, const char* (*getenv)(const char*)) {
  if (devices <= 1) return 0;
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID",
                          "LOCAL_RANK"}) {
    const char* v = getenv(var);
    if (!v || !*v) continue;
    char* end = nullptr;
    const long r = std::strtol(v, &end, 10);
    if (*end != '\0' || r < 0)
      throw ConfigError(std::string(var) + "=\"" + v + "\": expected the process's node-local rank (a non-negative integer)");
    return static_cast<int>(r % devices);
  }
  return 0;
}

int local_device() {
  return local_device(device_count(), [](const char* name) -> const char* { return std::getenv(name); });
}

std::unique_ptr<Backend> make_cuda_backend(int device) {
  CudaOptions o;
  o.device = device;
  return make_cuda_backend(o);
}

std::unique_ptr<Backend> make_cuda_backend(const CudaOptions& options) {
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw Unsupported(std::string("the cuda backend needs a CUDA device: ") + cudaGetErrorString(err));
  }
  if (n <= 0) throw Unsupported("the cuda backend needs a CUDA device: none found");
  if (options.device < 0 || options.device >= n)
    throw Unsupported("CUDA device " + std::to_string(options.device) + " does not exist (" + std::to_string(n) +
                      " present)");
  return std::make_unique<CudaBackend>(options);
}

bool is_cuda_backend(const Backend& b) { return dynamic_cast<const CudaBackend*>(&b) != nullptr; }

int cuda_device_of(const Backend& b) {
  const auto* cb = dynamic_cast<const CudaBackend*>(&b);
  if (!cb) throw std::invalid_argument("not a cuda backend: " + b.name());
  return cb->device();
}

HostPool::Stats cuda_host_pool_stats(const Backend& b) {
  auto* cb = dynamic_cast<const CudaBackend*>(&b);
  if (!cb) throw std::invalid_argument("not a cuda backend: " + b.name());
  return cb->host_pool().stats();
}

cudaStream_t cuda_native_stream(Stream& s) {
  auto* cs = dynamic_cast<CudaStream*>(&s);
  if (!cs) throw std::invalid_argument("stream '" + s.name() + "' is not a cuda stream");
  return cs->native;
}

CudaOpScope::CudaOpScope(Backend& cuda_backend, Stream& s, std::string name, const OpCost& cost)
    : backend_(cuda_backend) {
  auto* cb = dynamic_cast<CudaBackend*>(&backend_);
  if (!cb) throw std::invalid_argument("CudaOpScope on a " + backend_.name() + " backend");
  ticket_ = cb->begin_op(s, std::move(name), cost);
}

CudaOpScope::~CudaOpScope() { static_cast<CudaBackend&>(backend_).end_op(std::move(ticket_)); }

void CudaOpScope::set_detail(std::string detail) {
  if (ticket_) ticket_->rec.detail = std::move(detail);
}

namespace {
CudaBackend& cuda_of(Backend& b) {
  auto* cb = dynamic_cast<CudaBackend*>(&b);
  if (!cb) throw std::invalid_argument("not a cuda backend: " + b.name());
  return *cb;
}
}  // namespace

void cuda_set_gemm_path_table(Backend& b, GemmPathTable table) { cuda_of(b).set_gemm_path_table(std::move(table)); }

GemmPathTable cuda_gemm_path_table(const Backend& b) {
  auto* cb = dynamic_cast<const CudaBackend*>(&b);
  if (!cb) throw std::invalid_argument("not a cuda backend: " + b.name());
  return cb->gemm_path_table();
}

void cuda_force_gemm_path(Backend& b, std::optional<GemmPath> path) { cuda_of(b).force_gemm_path(path); }

std::vector<CudaGemmPathUse> cuda_gemm_path_uses(const Backend& b) {
  auto* cb = dynamic_cast<const CudaBackend*>(&b);
  if (!cb) throw std::invalid_argument("not a cuda backend: " + b.name());
  return cb->gemm_path_uses();
}

std::int64_t cuda_unfused_epilogues(const Backend& b) {
  auto* cb = dynamic_cast<const CudaBackend*>(&b);
  if (!cb) throw std::invalid_argument("not a cuda backend: " + b.name());
  return cb->unfused_epilogues();
}

}  // namespace moelab
