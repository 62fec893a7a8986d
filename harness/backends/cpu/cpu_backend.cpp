// harness/backends/cpu/cpu_backend.cpp — the cpu backend (see cpu_backend.hpp).
//
// The ops here are the reference semantics of the Backend interface: plain loops, fp32
// data, accumulation in fp32 except where noted. The cuda backend must match them.
#include "harness/backends/cpu/cpu_backend.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <numeric>

#include "harness/runtime/error.hpp"

#ifdef MOELAB_HAVE_BLAS
#include <cblas.h>
#endif

namespace moelab {

// ---- streams and events --------------------------------------------------------------

struct CpuBackend::Worker final : Stream {
  struct Task {
    bool timed = true;  // false: event record/wait, which run even after a failure
    std::string name, phase, node;
    OpCost cost;
    std::function<void()> fn;
  };

  Worker(CpuBackend& b, int id, StreamRole role, std::string nm) : Stream(id, role, std::move(nm)), backend(b) {
    thread = std::thread([this] { loop(); });
  }
  ~Worker() override {
    {
      std::lock_guard lk(mu);
      stop = true;
    }
    cv.notify_all();
    thread.join();
  }

  void push(Task t) {
    {
      std::lock_guard lk(mu);
      q.push_back(std::move(t));
      ++submitted;
    }
    cv.notify_all();
  }

  void loop() {
    for (;;) {
      Task t;
      {
        std::unique_lock lk(mu);
        cv.wait(lk, [&] { return stop || !q.empty(); });
        if (q.empty()) return;
        t = std::move(q.front());
        q.pop_front();
      }
      if (!t.timed) {
        t.fn();
      } else if (!error) {
        OpRecord r;
        r.rank = backend.rank();
        r.stream_id = id();
        r.stream_name = name();
        r.name = std::move(t.name);
        r.phase = std::move(t.phase);
        r.node = std::move(t.node);
        r.cost = t.cost;
        r.start = backend.now();
        try {
          t.fn();
        } catch (...) {
          std::lock_guard lk(mu);
          error = std::current_exception();
        }
        r.end = backend.now();
        backend.timeline_.add(std::move(r));
      }
      {
        std::lock_guard lk(mu);
        ++completed;
      }
      done_cv.notify_all();
    }
  }

  CpuBackend& backend;
  std::thread thread;
  std::mutex mu;
  std::condition_variable cv, done_cv;
  std::deque<Task> q;
  std::uint64_t submitted = 0, completed = 0;
  std::exception_ptr error;
  bool stop = false;
};

namespace {
struct CpuEvent final : Event {
  std::mutex mu;
  std::condition_variable cv;
  std::uint64_t issued = 0, done = 0;
};
}  // namespace

CpuBackend::CpuBackend() : t0_(std::chrono::steady_clock::now()) {}

CpuBackend::~CpuBackend() {
  workers_.clear();  // joins every worker after it drains its queue
  for (auto& p : pending_) std::free(p.ptr);
}

std::string CpuBackend::device_name() const {
  std::string model = "cpu";
  std::ifstream f("/proc/cpuinfo");
  for (std::string line; std::getline(f, line);) {
    if (line.rfind("model name", 0) == 0) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  }
  model += " (" + std::to_string(std::thread::hardware_concurrency()) + " threads";
#ifdef MOELAB_HAVE_BLAS
  model += ", OpenBLAS)";
#else
  model += ", reference GEMM without BLAS)";
#endif
  return model;
}

double CpuBackend::now() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
}

Stream& CpuBackend::create_stream(StreamRole role, const std::string& name) {
  workers_.push_back(std::make_unique<Worker>(*this, static_cast<int>(workers_.size()), role, name));
  return *workers_.back();
}

CpuBackend::Worker& CpuBackend::worker(Stream& s) {
  auto* w = dynamic_cast<Worker*>(&s);
  MOELAB_CHECK(w && &w->backend == this, "stream " + s.name() + " does not belong to this cpu backend");
  return *w;
}

std::unique_ptr<Event> CpuBackend::create_event() { return std::make_unique<CpuEvent>(); }

void CpuBackend::record(Event& e, Stream& s) {
  auto& ev = dynamic_cast<CpuEvent&>(e);
  std::uint64_t gen;
  {
    std::lock_guard lk(ev.mu);
    gen = ++ev.issued;
  }
  worker(s).push({false, "", "", "", {}, [&ev, gen] {
                    {
                      std::lock_guard lk(ev.mu);
                      ev.done = std::max(ev.done, gen);
                    }
                    ev.cv.notify_all();
                  }});
}

void CpuBackend::wait(Stream& s, Event& e) {
  auto& ev = dynamic_cast<CpuEvent&>(e);
  std::uint64_t gen;
  {
    std::lock_guard lk(ev.mu);
    gen = ev.issued;
  }
  if (gen == 0) return;  // never recorded: nothing to wait for (as in CUDA)
  worker(s).push({false, "", "", "", {}, [&ev, gen] {
                    std::unique_lock lk(ev.mu);
                    ev.cv.wait(lk, [&] { return ev.done >= gen; });
                  }});
}

void CpuBackend::synchronize(Stream& s) {
  auto& w = worker(s);
  std::exception_ptr err;
  {
    std::unique_lock lk(w.mu);
    w.done_cv.wait(lk, [&] { return w.completed == w.submitted; });
    std::swap(err, w.error);
  }
  reclaim();
  if (err) std::rethrow_exception(err);
}

void CpuBackend::synchronize() {
  std::exception_ptr first;
  for (auto& w : workers_) {
    try {
      synchronize(*w);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

void CpuBackend::enqueue(Stream& s, std::string name, OpCost cost, std::function<void()> fn) {
  worker(s).push({true, std::move(name), phase(), node(), cost, std::move(fn)});
}

// ---- memory ----------------------------------------------------------------------------

void* CpuBackend::raw_alloc(std::size_t bytes, MemSpace, Stream&) {
  reclaim();
  const std::size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded);
  if (!p) throw std::bad_alloc();
  if (poison_) std::memset(p, 0xFF, rounded);  // NaN in every float format
  return p;
}

void cpu_pad_only_weight_gradients(Backend& b, bool on) {
  auto* cpu = dynamic_cast<CpuBackend*>(&b);
  if (!cpu) throw std::invalid_argument("cpu_pad_only_weight_gradients: not a cpu backend: " + b.name());
  cpu->pad_only_weight_gradients(on);
}

void cpu_poison_new_memory(Backend& b, bool on) {
  auto* cpu = dynamic_cast<CpuBackend*>(&b);
  if (!cpu) throw std::invalid_argument("cpu_poison_new_memory: not a cpu backend: " + b.name());
  cpu->poison_new_memory(on);
}

void CpuBackend::raw_free(void* p, std::size_t, MemSpace, Stream&) {
  PendingFree f{p, {}};
  for (auto& w : workers_) {
    std::lock_guard lk(w->mu);
    f.fence.push_back(w->submitted);
  }
  std::lock_guard lk(free_mu_);
  pending_.push_back(std::move(f));
}

void CpuBackend::reclaim() {
  std::vector<std::uint64_t> completed;
  for (auto& w : workers_) {
    std::lock_guard lk(w->mu);
    completed.push_back(w->completed);
  }
  std::lock_guard lk(free_mu_);
  std::erase_if(pending_, [&](const PendingFree& f) {
    for (std::size_t i = 0; i < f.fence.size(); ++i)
      if (completed[i] < f.fence[i]) return false;
    std::free(f.ptr);
    return true;
  });
}

// ---- host transfers --------------------------------------------------------------------

void cpu_require_f32(const Tensor& t, const char* what) {
  if (t.dtype() != DType::f32)
    throw Unsupported(std::string("cpu backend: ") + what + " needs fp32, got " + t.describe());
}

void CpuBackend::upload(std::span<const float> host, Tensor& dst) {
  cpu_require_f32(dst, "upload");
  if (dst.stream()) synchronize(*dst.stream());
  MOELAB_CHECK(static_cast<std::int64_t>(host.size()) == dst.numel(), "upload size mismatch for " + dst.describe());
  if (dst.numel()) std::memcpy(dst.raw(), host.data(), dst.nbytes());
}

std::vector<float> CpuBackend::download(const Tensor& src) {
  cpu_require_f32(src, "download");
  if (src.stream()) synchronize(*src.stream());
  std::vector<float> v(static_cast<std::size_t>(src.numel()));
  if (src.numel()) std::memcpy(v.data(), src.raw(), src.nbytes());
  return v;
}

void CpuBackend::upload_i32(std::span<const std::int32_t> host, Tensor& dst) {
  MOELAB_CHECK(dst.dtype() == DType::i32 && static_cast<std::int64_t>(host.size()) == dst.numel(),
               "upload_i32 mismatch for " + dst.describe());
  if (dst.stream()) synchronize(*dst.stream());
  if (dst.numel()) std::memcpy(dst.raw(), host.data(), dst.nbytes());
}

std::vector<std::int32_t> CpuBackend::download_i32(const Tensor& src) {
  MOELAB_CHECK(src.dtype() == DType::i32, "download_i32 of " + src.describe());
  if (src.stream()) synchronize(*src.stream());
  std::vector<std::int32_t> v(static_cast<std::size_t>(src.numel()));
  if (src.numel()) std::memcpy(v.data(), src.raw(), src.nbytes());
  return v;
}

// ---- ops -------------------------------------------------------------------------------

void CpuBackend::copy(Stream& s, const Tensor& src, Tensor& dst) {
  MOELAB_CHECK(src.dtype() == dst.dtype() && src.numel() == dst.numel(),
               "copy " + src.describe() + " -> " + dst.describe());
  const OpKind kind = src.space() == dst.space() ? OpKind::copy_d2d
                      : dst.space() == MemSpace::host_pinned ? OpKind::copy_d2h
                                                              : OpKind::copy_h2d;
  void* d = dst.raw();
  const void* p = src.raw();
  const std::size_t n = src.nbytes();
  enqueue(s, "copy", cost_copy(kind, static_cast<std::int64_t>(n)), [=] {
    if (n) std::memmove(d, p, n);
  });
}

void CpuBackend::fill_zero(Stream& s, Tensor& t) {
  void* d = t.raw();
  const std::size_t n = t.nbytes();
  enqueue(s, "fill_zero", cost_fill(static_cast<std::int64_t>(n)), [=] {
    if (n) std::memset(d, 0, n);
  });
}

void cpu_sgemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
               const float* a, const float* b, float beta, float* c) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // C = beta*C (BLAS implementations differ on k == 0)
    for (std::int64_t i = 0; i < m * n; ++i) c[i] = beta == 0.0f ? 0.0f : beta * c[i];
    return;
  }
  const std::int64_t lda = trans_a ? m : k, ldb = trans_b ? k : n;
#ifdef MOELAB_HAVE_BLAS
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b,
              static_cast<int>(ldb), beta, c, static_cast<int>(n));
#else
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      float acc = 0.0f;
      for (std::int64_t p = 0; p < k; ++p) {
        const float av = trans_a ? a[p * lda + i] : a[i * lda + p];
        const float bv = trans_b ? b[j * ldb + p] : b[p * ldb + j];
        acc += av * bv;
      }
      c[i * n + j] = alpha * acc + (beta == 0.0f ? 0.0f : beta * c[i * n + j]);
    }
#endif
}

namespace {
void check_gemm(const GemmProblem& p) {
  cpu_require_f32(p.a, "gemm A");
  cpu_require_f32(p.b, "gemm B");
  cpu_require_f32(p.c, "gemm C");
  MOELAB_CHECK(p.a.numel() == p.m * p.k && p.b.numel() == p.k * p.n && p.c.numel() == p.m * p.n,
               "gemm shapes: m=" + std::to_string(p.m) + " n=" + std::to_string(p.n) + " k=" + std::to_string(p.k) +
                   " A" + p.a.describe() + " B" + p.b.describe() + " C" + p.c.describe());
}
constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;
constexpr float kSqrt2OverPi = 0.79788456080286536f;  // the tanh GeLU's sqrt(2/pi)
constexpr float kGeluTanhCubic = 0.044715f;            // and its cubic's coefficient

// act(x) and d_out · act'(x), one element (the cuda kernels compute the same, in this order).
float act_forward(Activation a, float x) {
  switch (a) {
    case Activation::gelu: return 0.5f * x * (1.0f + std::erf(x * kInvSqrt2));
    case Activation::gelu_tanh: return 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * (x + kGeluTanhCubic * x * x * x)));
    case Activation::relu: break;
  }
  return x > 0.0f ? x : 0.0f;
}
float act_backward(Activation a, float x, float dy) {
  switch (a) {
    case Activation::gelu: {
      const float cdf = 0.5f * (1.0f + std::erf(x * kInvSqrt2));
      const float pdf = kInvSqrt2Pi * std::exp(-0.5f * x * x);
      return dy * (cdf + x * pdf);
    }
    case Activation::gelu_tanh: {
      const float t = std::tanh(kSqrt2OverPi * (x + kGeluTanhCubic * x * x * x));
      const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluTanhCubic * x * x);
      return dy * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du);
    }
    case Activation::relu: break;
  }
  return x > 0.0f ? dy : 0.0f;  // selects: an inf/NaN gradient at x <= 0 stays 0
}

struct GemmArgs {
  bool ta, tb;
  std::int64_t m, n, k;
  float alpha, beta;
  const float* a;
  const float* b;
  float* c;
};
}  // namespace

void CpuBackend::grouped_gemm(Stream& s, std::span<const GemmProblem> problems, const char* name) {
  std::vector<GemmArgs> args;
  args.reserve(problems.size());
  // A padded layout (every problem with the same token stride): computed over the padded rows,
  // as one strided batch on a GPU computes it, so that the layout's zero rows are exercised
  // here (a padding row that is not zero shows in the weight gradients).
  std::vector<GemmProblem> padded;
  const bool wgrad = !problems.empty() && problems.front().trans_a && !problems.front().trans_b;
  if (common_token_stride(problems) > 0 && (wgrad || !pad_only_wgrad_)) {
    for (const auto& p : problems) padded.push_back(padded_problem(p));
    problems = padded;
  }
  for (const auto& p : problems) {
    check_gemm(p);
    args.push_back({p.trans_a, p.trans_b, p.m, p.n, p.k, p.alpha, p.beta, p.a.data<float>(), p.b.data<float>(),
                    p.c.data<float>()});
  }
  enqueue(s, name, cost_grouped_gemm(problems), [args = std::move(args)] {
    for (const auto& g : args) cpu_sgemm(g.ta, g.tb, g.m, g.n, g.k, g.alpha, g.a, g.b, g.beta, g.c);
  });
}

// The epilogue in the same op as its GEMM: each problem's product, then the activation over its
// rows while they are in cache (no separate op, as cuBLASLt's epilogue runs on the GPU). A padded
// call runs over the padded rows, as grouped_gemm does.
void CpuBackend::grouped_gemm_epilogue(Stream& s, std::span<const GemmProblem> problems, GemmEpilogue ep,
                                       Activation act, const char* name) {
  check_gemm_epilogue(problems, ep);
  std::vector<GemmProblem> padded;
  if (common_token_stride(problems) > 0 && !pad_only_wgrad_) {
    for (const auto& p : problems) padded.push_back(padded_problem(p));
    problems = padded;
  }
  struct Job {
    GemmArgs g;
    float* aux;
  };
  std::vector<Job> jobs;
  for (const auto& p : problems) {
    check_gemm(p);
    cpu_require_f32(p.aux, "gemm epilogue aux");
    jobs.push_back({{p.trans_a, p.trans_b, p.m, p.n, p.k, 1.0f, 0.0f, p.a.data<float>(), p.b.data<float>(),
                     p.c.data<float>()},
                    p.aux.data<float>()});
  }
  enqueue(s, name, cost_grouped_gemm_epilogue(problems, ep, act), [jobs = std::move(jobs), ep, act] {
    for (const auto& j : jobs) {
      const GemmArgs& g = j.g;
      const std::int64_t n = g.m * g.n;
      if (ep == GemmEpilogue::act_aux) {
        cpu_sgemm(g.ta, g.tb, g.m, g.n, g.k, 1.0f, g.a, g.b, 0.0f, j.aux);
        for (std::int64_t i = 0; i < n; ++i) g.c[i] = act_forward(act, j.aux[i]);
      } else {
        cpu_sgemm(g.ta, g.tb, g.m, g.n, g.k, 1.0f, g.a, g.b, 0.0f, g.c);
        for (std::int64_t i = 0; i < n; ++i) g.c[i] = act_backward(act, j.aux[i], g.c[i]);
      }
    }
  });
}

double CpuBackend::time_bare_gemms(std::span<const GemmProblem> problems, int reps) {
  synchronize();
  for (const auto& p : problems) check_gemm(p);
  auto run = [&] {
    for (const auto& p : problems)
      cpu_sgemm(p.trans_a, p.trans_b, p.m, p.n, p.k, p.alpha, p.a.data<float>(), p.b.data<float>(), p.beta,
                p.c.data<float>());
  };
  run();  // warm-up
  std::vector<double> t;
  for (int r = 0; r < std::max(reps, 1); ++r) {
    const double t0 = now();
    run();
    t.push_back(now() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void CpuBackend::noisy_logits(Stream& s, const Tensor& clean, const Tensor& noise_raw, const Tensor& eps,
                              Tensor& logits) {
  for (const Tensor* t : {&clean, &noise_raw, &eps, static_cast<const Tensor*>(&logits)})
    cpu_require_f32(*t, "noisy_logits");
  const float *c = clean.data<float>(), *nr = noise_raw.data<float>(), *e = eps.data<float>();
  float* l = logits.data<float>();
  const std::int64_t n = clean.numel();
  enqueue(s, "noisy_logits", cost_elementwise(n, DType::f32, 3, 1, 6), [=] {
    for (std::int64_t i = 0; i < n; ++i) {
      const float x = nr[i];
      const float softplus = x > 20.0f ? x : std::log1p(std::exp(x));
      l[i] = c[i] + e[i] * softplus;
    }
  });
}

void CpuBackend::noisy_logits_backward(Stream& s, const Tensor& d_logits, const Tensor& noise_raw,
                                       const Tensor& eps, Tensor& d_noise_raw) {
  const float *dl = d_logits.data<float>(), *nr = noise_raw.data<float>(), *e = eps.data<float>();
  float* dn = d_noise_raw.data<float>();
  const std::int64_t n = d_logits.numel();
  enqueue(s, "noisy_logits_bwd", cost_elementwise(n, DType::f32, 3, 1, 5), [=] {
    for (std::int64_t i = 0; i < n; ++i) dn[i] = dl[i] * e[i] / (1.0f + std::exp(-nr[i]));
  });
}

void CpuBackend::gate_forward(Stream& s, GateForward& g) {
  const std::int64_t T = g.logits.dim(0), E = g.logits.dim(1);
  const int k = g.top_k;
  MOELAB_CHECK(k >= 1 && k <= E, "gate top_k out of range");
  const float* logits = g.logits.data<float>();
  float* probs = g.probs.data<float>();
  std::int32_t* idx = g.topk_idx.data<std::int32_t>();
  float* w = g.topk_w.data<float>();
  std::int32_t* slot = g.slot.data<std::int32_t>();
  std::int32_t* counts = g.counts.data<std::int32_t>();
  float* frac = g.routed_frac.data<float>();
  float* aux = g.aux_loss.data<float>();
  float* pmean = g.prob_mean.defined() ? g.prob_mean.data<float>() : nullptr;
  const std::int64_t cap = g.capacity;
  const bool renorm = g.renormalize;
  enqueue(s, "gate", cost_gate_forward(T, E, k), [=] {
    // softmax and top-k per token
    for (std::int64_t t = 0; t < T; ++t) {
      const float* l = logits + t * E;
      float* p = probs + t * E;
      float mx = l[0];
      for (std::int64_t e = 1; e < E; ++e) mx = std::max(mx, l[e]);
      float sum = 0.0f;
      for (std::int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(l[e] - mx));
      for (std::int64_t e = 0; e < E; ++e) p[e] /= sum;
      float chosen_sum = 0.0f;
      for (int j = 0; j < k; ++j) {
        std::int32_t best = -1;
        for (std::int64_t e = 0; e < E; ++e) {
          bool taken = false;
          for (int i = 0; i < j; ++i) taken |= idx[t * k + i] == e;
          if (!taken && (best < 0 || p[e] > p[best])) best = static_cast<std::int32_t>(e);
        }
        idx[t * k + j] = best;
        w[t * k + j] = p[best];
        chosen_sum += p[best];
      }
      if (renorm)
        for (int j = 0; j < k; ++j) w[t * k + j] /= chosen_sum;
    }
    // capacity in GShard priority: all first choices, then all second choices, ...
    std::vector<std::int64_t> routed(static_cast<std::size_t>(E), 0);
    for (int j = 0; j < k; ++j)
      for (std::int64_t t = 0; t < T; ++t) {
        const std::int64_t e = idx[t * k + j];
        const std::int64_t pos = routed[static_cast<std::size_t>(e)]++;
        slot[t * k + j] = (cap <= 0 || pos < cap) ? static_cast<std::int32_t>(pos) : -1;
      }
    std::vector<std::int64_t> offset(static_cast<std::size_t>(E), 0);
    std::int64_t run = 0;
    for (std::int64_t e = 0; e < E; ++e) {
      const std::int64_t kept = cap <= 0 ? routed[static_cast<std::size_t>(e)]
                                         : std::min(routed[static_cast<std::size_t>(e)], cap);
      counts[e] = static_cast<std::int32_t>(kept);
      offset[static_cast<std::size_t>(e)] = run;
      run += kept;
    }
    for (std::int64_t i = 0; i < T * k; ++i)
      if (slot[i] >= 0) slot[i] += static_cast<std::int32_t>(offset[static_cast<std::size_t>(idx[i])]);
    // Switch/GShard load-balancing loss: E * sum_e f_e * P_e
    double loss = 0.0;
    for (std::int64_t e = 0; e < E; ++e) {
      frac[e] = T ? static_cast<float>(static_cast<double>(routed[static_cast<std::size_t>(e)]) /
                                       static_cast<double>(T * k))
                  : 0.0f;
      double pe = 0.0;
      for (std::int64_t t = 0; t < T; ++t) pe += probs[t * E + e];
      pe = T ? pe / static_cast<double>(T) : 0.0;
      if (pmean) pmean[e] = static_cast<float>(pe);
      loss += frac[e] * pe;
    }
    aux[0] = static_cast<float>(static_cast<double>(E) * loss);
  });
}

void CpuBackend::gate_backward(Stream& s, GateBackward& g) {
  const std::int64_t T = g.probs.dim(0), E = g.probs.dim(1);
  const int k = static_cast<int>(g.topk_idx.dim(1));
  const float* probs = g.probs.data<float>();
  const std::int32_t* idx = g.topk_idx.data<std::int32_t>();
  const float* w = g.topk_w.data<float>();
  const float* frac = g.routed_frac.data<float>();
  const float* dw = g.d_topk_w.data<float>();
  float* dl = g.d_logits.data<float>();
  const float grad_aux = g.grad_aux;
  const bool renorm = g.renormalize;
  enqueue(s, "gate_bwd", cost_gate_backward(T, E, k), [=] {
    std::vector<float> dp(static_cast<std::size_t>(E));
    for (std::int64_t t = 0; t < T; ++t) {
      const float* p = probs + t * E;
      // aux loss: d/dp[t,e] of E * sum_e f_e * mean_t p[t,e]
      for (std::int64_t e = 0; e < E; ++e)
        dp[static_cast<std::size_t>(e)] = grad_aux * static_cast<float>(E) * frac[e] / static_cast<float>(T);
      if (renorm) {  // w_j = p_j / S  =>  dp_j = (dw_j - sum_i dw_i w_i) / S
        float S = 0.0f, dot = 0.0f;
        for (int j = 0; j < k; ++j) {
          S += p[idx[t * k + j]];
          dot += dw[t * k + j] * w[t * k + j];
        }
        for (int j = 0; j < k; ++j) dp[static_cast<std::size_t>(idx[t * k + j])] += (dw[t * k + j] - dot) / S;
      } else {
        for (int j = 0; j < k; ++j) dp[static_cast<std::size_t>(idx[t * k + j])] += dw[t * k + j];
      }
      float dot = 0.0f;  // softmax backward: dl = p * (dp - <p, dp>)
      for (std::int64_t e = 0; e < E; ++e) dot += p[e] * dp[static_cast<std::size_t>(e)];
      for (std::int64_t e = 0; e < E; ++e) dl[t * E + e] = p[e] * (dp[static_cast<std::size_t>(e)] - dot);
    }
  });
}

namespace {
// Unpacked into named variables where used, not by a structured binding: the ops' lambdas
// capture them, which clang accepts only from version 16.
struct RowOp {
  std::int64_t T, k, M;
};
RowOp row_op(const Tensor& x, const Tensor& slot) { return {x.dim(0), slot.dim(1), x.dim(1)}; }
}  // namespace

void CpuBackend::permute(Stream& s, const Tensor& x, const Tensor& slot, Tensor& out) {
  cpu_require_f32(x, "permute");
  const RowOp shape = row_op(x, slot);
  const std::int64_t T = shape.T, k = shape.k, M = shape.M;
  const float* xp = x.data<float>();
  const std::int32_t* sl = slot.data<std::int32_t>();
  float* o = out.data<float>();
  enqueue(s, "permute", cost_rows(OpKind::permute, out.dim(0), out.dim(0), M, DType::f32, 0), [=] {
    for (std::int64_t i = 0; i < T * k; ++i)
      if (sl[i] >= 0)
        std::memcpy(o + sl[i] * M, xp + (i / k) * M, static_cast<std::size_t>(M) * sizeof(float));
  });
}

void CpuBackend::permute_backward(Stream& s, const Tensor& d_out, const Tensor& slot, Tensor& dx) {
  const RowOp shape = row_op(dx, slot);
  const std::int64_t T = shape.T, k = shape.k, M = shape.M;
  const float* d = d_out.data<float>();
  const std::int32_t* sl = slot.data<std::int32_t>();
  float* g = dx.data<float>();
  enqueue(s, "permute_bwd", cost_rows(OpKind::permute, d_out.dim(0), T, M, DType::f32, 1), [=] {
    for (std::int64_t t = 0; t < T; ++t) {
      float* row = g + t * M;
      std::fill(row, row + M, 0.0f);
      for (std::int64_t j = 0; j < k; ++j) {
        const std::int32_t r = sl[t * k + j];
        if (r < 0) continue;
        for (std::int64_t c = 0; c < M; ++c) row[c] += d[r * M + c];
      }
    }
  });
}

void CpuBackend::unpermute(Stream& s, const Tensor& y_perm, const Tensor& slot, const Tensor& w, Tensor& y) {
  cpu_require_f32(y, "unpermute");
  const RowOp shape = row_op(y, slot);
  const std::int64_t T = shape.T, k = shape.k, M = shape.M;
  const float* yp = y_perm.data<float>();
  const std::int32_t* sl = slot.data<std::int32_t>();
  const float* wp = w.data<float>();
  float* o = y.data<float>();
  enqueue(s, "unpermute", cost_rows(OpKind::permute, y_perm.dim(0), T, M, DType::f32, 2), [=] {
    for (std::int64_t t = 0; t < T; ++t) {
      float* row = o + t * M;
      std::fill(row, row + M, 0.0f);
      for (std::int64_t j = 0; j < k; ++j) {
        const std::int32_t r = sl[t * k + j];
        if (r < 0) continue;
        const float wt = wp[t * k + j];
        for (std::int64_t c = 0; c < M; ++c) row[c] += wt * yp[r * M + c];
      }
    }
  });
}

void CpuBackend::unpermute_backward(Stream& s, const Tensor& dy, const Tensor& y_perm, const Tensor& slot,
                                    const Tensor& w, Tensor& d_y_perm, Tensor& dw) {
  const RowOp shape = row_op(dy, slot);
  const std::int64_t T = shape.T, k = shape.k, M = shape.M;
  const float *g = dy.data<float>(), *yp = y_perm.data<float>(), *wp = w.data<float>();
  const std::int32_t* sl = slot.data<std::int32_t>();
  float *dyp = d_y_perm.data<float>(), *dwp = dw.data<float>();
  enqueue(s, "unpermute_bwd", cost_rows(OpKind::permute, T + y_perm.dim(0), y_perm.dim(0), M, DType::f32, 3), [=] {
    for (std::int64_t i = 0; i < T * k; ++i) {
      const std::int32_t r = sl[i];
      const float* grow = g + (i / k) * M;
      if (r < 0) {
        dwp[i] = 0.0f;
        continue;
      }
      float dot = 0.0f;
      for (std::int64_t c = 0; c < M; ++c) {
        dyp[r * M + c] = wp[i] * grow[c];
        dot += grow[c] * yp[r * M + c];
      }
      dwp[i] = dot;
    }
  });
}


void CpuBackend::activation_forward(Stream& s, Activation a, const Tensor& in, Tensor& out) {
  cpu_require_f32(in, "activation");
  const float* x = in.data<float>();
  float* y = out.data<float>();
  const std::int64_t n = in.numel();
  enqueue(s, std::string(activation_name(a)), cost_activation_forward(a, n, DType::f32), [=] {
    for (std::int64_t i = 0; i < n; ++i) y[i] = act_forward(a, x[i]);
  });
}

void CpuBackend::activation_backward(Stream& s, Activation a, const Tensor& in, const Tensor& d_out,
                                     Tensor& d_in) {
  const float *x = in.data<float>(), *dy = d_out.data<float>();
  float* dx = d_in.data<float>();
  const std::int64_t n = in.numel();
  enqueue(s, std::string(activation_name(a)) + "_bwd", cost_activation_backward(a, n, DType::f32), [=] {
    for (std::int64_t i = 0; i < n; ++i) dx[i] = act_backward(a, x[i], dy[i]);
  });
}

}  // namespace moelab
