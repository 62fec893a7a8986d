// harness/bench/cpu_blocks_bench.cpp — Google Benchmark timings of the cpu backend's building
// blocks: the experts' grouped GEMM (with the bare cblas_sgemm of the same shapes beside
// it), permute / unpermute, the gate, and the activation, forward and backward.
//
//   cmake --build build --target moelab_bench_cpu
//   build/harness/moelab_bench_cpu                                   every benchmark
//   build/harness/moelab_bench_cpu --benchmark_filter=Gemm --benchmark_format=json
//
// Each op is issued through the backend exactly as a system issues it (queued on a stream's
// worker thread, recorded in the timeline), so the figures include moelab's own overhead;
// the bare cblas_sgemm benchmarks show how much that is. Times are wall clock (UseRealTime)
// because the work runs on the stream's worker, not on the benchmark's thread.
// Every benchmark first checks its op once against a plain reference and reports an error
// instead of a time if the result is wrong.
// Counters (rates per second): FLOP/s for GEMMs, bytes/s for the memory-bound ops, both from
// the op's cost descriptor (harness/runtime/cost.hpp), the same figures `moelab run` uses.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <numbers>
#include <numeric>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include "harness/backends/cpu/cpu_backend.hpp"
#include "harness/runtime/random.hpp"

#ifdef MOELAB_HAVE_BLAS
#include <cblas.h>
#endif

namespace {

using namespace moelab;

// ---- shared set-up ------------------------------------------------------------------------

struct Bench {
  std::unique_ptr<Backend> b = make_backend("cpu");
  Stream& s = b->default_stream();

  Tensor tensor(std::vector<std::int64_t> shape, DType dtype = DType::f32) {
    return b->empty(std::move(shape), dtype, MemCategory::activations, s);
  }
  // U(-1,1) from a seed, uploaded; the host copy is returned for the reference.
  Tensor random(std::vector<std::int64_t> shape, std::uint64_t seed, std::vector<float>* host = nullptr) {
    Tensor t = tensor(std::move(shape));
    std::vector<float> h(static_cast<std::size_t>(t.numel()));
    Rng rng(seed);
    for (auto& v : h) v = static_cast<float>(rng.uniform(-1.0, 1.0));
    b->upload(h, t);
    if (host) *host = std::move(h);
    return t;
  }
  // The summed cost of the ops issued since the last call (from the backend's timeline).
  OpCost issued_cost() {
    b->synchronize();
    OpCost c;
    for (const auto& op : b->timeline()) {
      c.kind = op.cost.kind;
      c.flops += op.cost.flops;
      c.bytes_read += op.cost.bytes_read;
      c.bytes_written += op.cost.bytes_written;
    }
    b->clear_timeline();
    return c;
  }
};

void set_flop_rate(benchmark::State& st, const OpCost& c) {
  st.counters["FLOP/s"] = benchmark::Counter(c.flops, benchmark::Counter::kIsIterationInvariantRate);
}
void set_byte_rate(benchmark::State& st, const OpCost& c) {
  st.counters["bytes/s"] =
      benchmark::Counter(c.bytes_read + c.bytes_written, benchmark::Counter::kIsIterationInvariantRate);
}

// Largest |got - want| relative to the largest |want| (1 if all are tiny).
double max_rel_error(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0.0, scale = 1e-30;
  for (std::size_t i = 0; i < want.size(); ++i) {
    err = std::max(err, std::abs(static_cast<double>(got[i]) - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return err / std::max(scale, 1.0);
}
std::vector<double> widen(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// ---- experts: grouped GEMM ----------------------------------------------------------------
// El = 8 local experts, each receiving R rows, M = d_model, H = 4M.
//   fc1  T_M[l] [R,H] = T_DI[l] [R,M] · W1[l] [M,H]                  2·R·M·H flops per expert
//   dw1  dW1[l] [M,H] += T_DI[l]^T [M,R] · dT_M[l] [R,H]  (trans_a, beta 1: gradient accumulation)

enum class GemmKind { fc1, dw1 };
constexpr std::int64_t kLocalExperts = 8;

struct ExpertGemms {
  std::vector<GemmProblem> problems;
  std::vector<std::vector<float>> a, b, c0;  // host copies per expert (c0: C before the call)
};

ExpertGemms make_expert_gemms(Bench& x, GemmKind kind, std::int64_t M, std::int64_t R) {
  const std::int64_t H = 4 * M;
  ExpertGemms g;
  for (std::int64_t l = 0; l < kLocalExperts; ++l) {
    const auto seed = static_cast<std::uint64_t>(l) * 3;
    GemmProblem p;
    std::vector<float> a, b, c;
    if (kind == GemmKind::fc1) {
      p.m = R, p.n = H, p.k = M;
      p.a = x.random({R, M}, seed + 1, &a);
      p.b = x.random({M, H}, seed + 2, &b);
      p.c = x.random({R, H}, seed + 3, &c);  // overwritten (beta 0)
    } else {
      p.trans_a = true;
      p.m = M, p.n = H, p.k = R;
      p.a = x.random({R, M}, seed + 1, &a);
      p.b = x.random({R, H}, seed + 2, &b);
      p.c = x.random({M, H}, seed + 3, &c);  // accumulated into (beta 1)
      p.beta = 1.0f;
    }
    g.problems.push_back(p);
    g.a.push_back(std::move(a));
    g.b.push_back(std::move(b));
    g.c0.push_back(std::move(c));
  }
  return g;
}

// C = alpha·op(A)·op(B) + beta·C with the bare library call, on host copies: the reference.
std::vector<float> bare_gemm(const GemmProblem& p, const std::vector<float>& a, const std::vector<float>& b,
                             std::vector<float> c) {
  cpu_sgemm(p.trans_a, p.trans_b, p.m, p.n, p.k, p.alpha, a.data(), b.data(), p.beta, c.data());
  return c;
}

// The backend's grouped GEMM against the bare library call: both run the same sgemm, so the
// results agree to rounding (OpenBLAS may split the work differently between calls).
bool check_expert_gemms(Bench& x, ExpertGemms& g, std::string& why) {
  x.b->grouped_gemm(x.s, g.problems, "experts");
  x.b->synchronize();
  for (std::size_t l = 0; l < g.problems.size(); ++l) {
    const auto& p = g.problems[l];
    const auto want = bare_gemm(p, g.a[l], g.b[l], g.c0[l]);
    const double err = max_rel_error(x.b->download(p.c), widen(want));
    if (err > 1e-5) {
      why = "grouped GEMM differs from bare sgemm for expert " + std::to_string(l) + " (rel. error " +
            std::to_string(err) + ")";
      return false;
    }
  }
  return true;
}

void BM_GroupedGemm(benchmark::State& st, GemmKind kind) {
  Bench x;
  auto g = make_expert_gemms(x, kind, st.range(0), st.range(1));
  std::string why;
  if (!check_expert_gemms(x, g, why)) {
    st.SkipWithError(why.c_str());
    return;
  }
  const OpCost cost = x.issued_cost();
  for (auto _ : st) {
    x.b->grouped_gemm(x.s, g.problems, "experts");
    x.b->synchronize(x.s);
  }
  set_flop_rate(st, cost);
  x.b->clear_timeline();
}
BENCHMARK_CAPTURE(BM_GroupedGemm, fc1, GemmKind::fc1)
    ->ArgsProduct({{256, 512}, {64, 256, 1024, 2048}})
    ->ArgNames({"M", "rows"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_GroupedGemm, dw1, GemmKind::dw1)
    ->ArgsProduct({{256, 512}, {64, 256, 1024, 2048}})
    ->ArgNames({"M", "rows"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);

#ifdef MOELAB_HAVE_BLAS
// The same GEMMs as cblas_sgemm calls one after another on the benchmark's own thread:
// nothing of moelab around them (no queue, no worker thread, no timeline).
void BM_BareCblasSgemm(benchmark::State& st, GemmKind kind) {
  Bench x;
  auto g = make_expert_gemms(x, kind, st.range(0), st.range(1));
  std::string why;
  if (!check_expert_gemms(x, g, why)) {
    st.SkipWithError(why.c_str());
    return;
  }
  const OpCost cost = x.issued_cost();
  for (auto _ : st) {
    for (const auto& p : g.problems)
      cblas_sgemm(CblasRowMajor, p.trans_a ? CblasTrans : CblasNoTrans, p.trans_b ? CblasTrans : CblasNoTrans,
                  static_cast<int>(p.m), static_cast<int>(p.n), static_cast<int>(p.k), p.alpha, p.a.data<float>(),
                  static_cast<int>(p.trans_a ? p.m : p.k), p.b.data<float>(), static_cast<int>(p.trans_b ? p.k : p.n),
                  p.beta, p.c.data<float>(), static_cast<int>(p.n));
    benchmark::ClobberMemory();
  }
  set_flop_rate(st, cost);
}
BENCHMARK_CAPTURE(BM_BareCblasSgemm, fc1, GemmKind::fc1)
    ->ArgsProduct({{256, 512}, {64, 256, 1024, 2048}})
    ->ArgNames({"M", "rows"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_BareCblasSgemm, dw1, GemmKind::dw1)
    ->ArgsProduct({{256, 512}, {64, 256, 1024, 2048}})
    ->ArgNames({"M", "rows"})
    ->UseRealTime()
    ->Unit(benchmark::kMillisecond);
#endif

// ---- dispatch / combine: permute and unpermute --------------------------------------------
// T = 4096 tokens, M = 1024, E = 8, top-k in {1, 2}, no capacity limit (N = T·k rows).
// slot [T,k] is the expert-sorted row of each token-slot, as the gate makes it.

constexpr std::int64_t kTokens = 4096;

struct Routing {
  std::vector<std::int32_t> slot;  // [T,k]
  std::int64_t rows = 0;           // N
};

Routing random_routing(std::int64_t T, std::int64_t E, int k, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<std::int32_t> expert(static_cast<std::size_t>(T * k));
  std::vector<std::int64_t> count(static_cast<std::size_t>(E), 0);
  for (std::int64_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {  // k distinct experts per token
      std::int32_t e;
      bool taken;
      do {
        e = static_cast<std::int32_t>(rng.next() % static_cast<std::uint64_t>(E));
        taken = false;
        for (int i = 0; i < j; ++i) taken |= expert[static_cast<std::size_t>(t * k + i)] == e;
      } while (taken);
      expert[static_cast<std::size_t>(t * k + j)] = e;
      ++count[static_cast<std::size_t>(e)];
    }
  std::vector<std::int64_t> next(static_cast<std::size_t>(E), 0);
  std::partial_sum(count.begin(), count.end() - 1, next.begin() + 1);
  Routing r;
  r.slot.resize(expert.size());
  for (std::size_t i = 0; i < expert.size(); ++i)
    r.slot[i] = static_cast<std::int32_t>(next[static_cast<std::size_t>(expert[i])]++);
  r.rows = T * k;
  return r;
}

struct RowsCase {
  Bench x;
  std::int64_t T = kTokens, M = 1024;
  int k;
  Routing routing;
  Tensor slot, w;
  std::vector<float> w_host;
  explicit RowsCase(int top_k) : k(top_k), routing(random_routing(T, 8, top_k, 7)) {
    slot = x.tensor({T, k}, DType::i32);
    x.b->upload_i32(routing.slot, slot);
    w = x.random({T, k}, 8, &w_host);
  }
  std::int32_t row(std::int64_t t, int j) const { return routing.slot[static_cast<std::size_t>(t * k + j)]; }
};

void BM_Permute(benchmark::State& st) {
  RowsCase c(static_cast<int>(st.range(0)));
  std::vector<float> xh;
  Tensor xin = c.x.random({c.T, c.M}, 1, &xh);
  Tensor out = c.x.tensor({c.routing.rows, c.M});
  c.x.b->permute(c.x.s, xin, c.slot, out);
  const auto got = c.x.b->download(out);
  for (std::int64_t t = 0; t < c.T; ++t)
    for (int j = 0; j < c.k; ++j)
      if (!std::equal(xh.begin() + t * c.M, xh.begin() + (t + 1) * c.M, got.begin() + c.row(t, j) * c.M)) {
        st.SkipWithError("permute: a dispatched row is not its token's row");
        return;
      }
  const OpCost cost = c.x.issued_cost();
  for (auto _ : st) {
    c.x.b->permute(c.x.s, xin, c.slot, out);
    c.x.b->synchronize(c.x.s);
  }
  set_byte_rate(st, cost);
  c.x.b->clear_timeline();
}

void BM_PermuteBackward(benchmark::State& st) {
  RowsCase c(static_cast<int>(st.range(0)));
  std::vector<float> dh;
  Tensor d_out = c.x.random({c.routing.rows, c.M}, 2, &dh);
  Tensor dx = c.x.tensor({c.T, c.M});
  c.x.b->permute_backward(c.x.s, d_out, c.slot, dx);
  std::vector<double> want(static_cast<std::size_t>(c.T * c.M), 0.0);  // dx[t] = sum_j d_out[slot[t,j]]
  for (std::int64_t t = 0; t < c.T; ++t)
    for (int j = 0; j < c.k; ++j)
      for (std::int64_t m = 0; m < c.M; ++m)
        want[static_cast<std::size_t>(t * c.M + m)] += dh[static_cast<std::size_t>(c.row(t, j) * c.M + m)];
  if (max_rel_error(c.x.b->download(dx), want) > 1e-6) {
    st.SkipWithError("permute_backward differs from the reference");
    return;
  }
  const OpCost cost = c.x.issued_cost();
  for (auto _ : st) {
    c.x.b->permute_backward(c.x.s, d_out, c.slot, dx);
    c.x.b->synchronize(c.x.s);
  }
  set_byte_rate(st, cost);
  c.x.b->clear_timeline();
}

void BM_Unpermute(benchmark::State& st) {
  RowsCase c(static_cast<int>(st.range(0)));
  std::vector<float> yh;
  Tensor y_perm = c.x.random({c.routing.rows, c.M}, 3, &yh);
  Tensor y = c.x.tensor({c.T, c.M});
  c.x.b->unpermute(c.x.s, y_perm, c.slot, c.w, y);
  std::vector<double> want(static_cast<std::size_t>(c.T * c.M), 0.0);  // y[t] = sum_j w[t,j] y_perm[slot[t,j]]
  for (std::int64_t t = 0; t < c.T; ++t)
    for (int j = 0; j < c.k; ++j)
      for (std::int64_t m = 0; m < c.M; ++m)
        want[static_cast<std::size_t>(t * c.M + m)] +=
            static_cast<double>(c.w_host[static_cast<std::size_t>(t * c.k + j)]) *
            yh[static_cast<std::size_t>(c.row(t, j) * c.M + m)];
  if (max_rel_error(c.x.b->download(y), want) > 1e-6) {
    st.SkipWithError("unpermute differs from the reference");
    return;
  }
  const OpCost cost = c.x.issued_cost();
  for (auto _ : st) {
    c.x.b->unpermute(c.x.s, y_perm, c.slot, c.w, y);
    c.x.b->synchronize(c.x.s);
  }
  set_byte_rate(st, cost);
  c.x.b->clear_timeline();
}

void BM_UnpermuteBackward(benchmark::State& st) {
  RowsCase c(static_cast<int>(st.range(0)));
  std::vector<float> gh, yh;
  Tensor dy = c.x.random({c.T, c.M}, 4, &gh);
  Tensor y_perm = c.x.random({c.routing.rows, c.M}, 5, &yh);
  Tensor d_y_perm = c.x.tensor({c.routing.rows, c.M});
  Tensor dw = c.x.tensor({c.T, c.k});
  c.x.b->unpermute_backward(c.x.s, dy, y_perm, c.slot, c.w, d_y_perm, dw);
  // d_y_perm[slot[t,j]] = w[t,j] dy[t];  dw[t,j] = <dy[t], y_perm[slot[t,j]]>
  std::vector<double> want_dyp(static_cast<std::size_t>(c.routing.rows * c.M)),
      want_dw(static_cast<std::size_t>(c.T * c.k));
  for (std::int64_t t = 0; t < c.T; ++t)
    for (int j = 0; j < c.k; ++j) {
      const auto i = static_cast<std::size_t>(t * c.k + j);
      double dot = 0.0;
      for (std::int64_t m = 0; m < c.M; ++m) {
        const auto r = static_cast<std::size_t>(c.row(t, j) * c.M + m), g = static_cast<std::size_t>(t * c.M + m);
        want_dyp[r] = static_cast<double>(c.w_host[i]) * gh[g];
        dot += static_cast<double>(gh[g]) * yh[r];
      }
      want_dw[i] = dot;
    }
  if (max_rel_error(c.x.b->download(d_y_perm), want_dyp) > 1e-6 || max_rel_error(c.x.b->download(dw), want_dw) > 1e-5) {
    st.SkipWithError("unpermute_backward differs from the reference");
    return;
  }
  const OpCost cost = c.x.issued_cost();
  for (auto _ : st) {
    c.x.b->unpermute_backward(c.x.s, dy, y_perm, c.slot, c.w, d_y_perm, dw);
    c.x.b->synchronize(c.x.s);
  }
  set_byte_rate(st, cost);
  c.x.b->clear_timeline();
}

BENCHMARK(BM_Permute)->Arg(1)->Arg(2)->ArgName("k")->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_PermuteBackward)->Arg(1)->Arg(2)->ArgName("k")->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Unpermute)->Arg(1)->Arg(2)->ArgName("k")->UseRealTime()->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_UnpermuteBackward)->Arg(1)->Arg(2)->ArgName("k")->UseRealTime()->Unit(benchmark::kMicrosecond);

// ---- gate ----------------------------------------------------------------------------------
// T = 4096 tokens, E in {8, 64}, top-k in {1, 2}, capacity factor 1.25 (some slots dropped).

struct GateCase {
  Bench x;
  std::int64_t T = kTokens, E;
  int k;
  std::int64_t capacity;
  std::vector<float> logits_host;
  GateForward g;
  GateCase(std::int64_t experts, int top_k) : E(experts), k(top_k) {
    capacity = static_cast<std::int64_t>(std::ceil(1.25 * k * static_cast<double>(T) / static_cast<double>(E)));
    g.logits = x.random({T, E}, 11, &logits_host);
    for (auto& v : logits_host) v *= 4.0f;  // a spread like a trained gate's, so routing is skewed
    x.b->upload(logits_host, g.logits);
    g.top_k = k;
    g.capacity = capacity;
    g.probs = x.tensor({T, E});
    g.topk_idx = x.tensor({T, k}, DType::i32);
    g.topk_w = x.tensor({T, k});
    g.slot = x.tensor({T, k}, DType::i32);
    g.counts = x.tensor({E}, DType::i32);
    g.routed_frac = x.tensor({E});
    g.aux_loss = x.tensor({1});
  }
};

// Softmax in double precision; top-k (ties to the lower index) and capacity in GShard's
// priority (every first choice before any second choice, lower token first) from the
// backend's own fp32 probabilities, so that a near-tie cannot flip on rounding.
bool check_gate_forward(GateCase& c, std::string& why) {
  const auto T = c.T, E = c.E;
  const int k = c.k;
  const auto p32 = c.x.b->download(c.g.probs);
  std::vector<double> p(static_cast<std::size_t>(T * E));
  std::vector<std::int32_t> idx(static_cast<std::size_t>(T * k));
  for (std::int64_t t = 0; t < T; ++t) {
    const float* l = c.logits_host.data() + t * E;
    const double mx = *std::max_element(l, l + E);
    double sum = 0.0;
    for (std::int64_t e = 0; e < E; ++e) sum += p[static_cast<std::size_t>(t * E + e)] = std::exp(l[e] - mx);
    for (std::int64_t e = 0; e < E; ++e) p[static_cast<std::size_t>(t * E + e)] /= sum;
    std::vector<std::int32_t> order(static_cast<std::size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](std::int32_t a, std::int32_t b) {
      return p32[static_cast<std::size_t>(t * E + a)] > p32[static_cast<std::size_t>(t * E + b)];
    });
    for (int j = 0; j < k; ++j) idx[static_cast<std::size_t>(t * k + j)] = order[static_cast<std::size_t>(j)];
  }
  std::vector<std::int64_t> routed(static_cast<std::size_t>(E), 0);
  std::vector<std::int32_t> pos(static_cast<std::size_t>(T * k));
  for (int j = 0; j < k; ++j)
    for (std::int64_t t = 0; t < T; ++t) {
      const auto i = static_cast<std::size_t>(t * k + j);
      const std::int64_t n = routed[static_cast<std::size_t>(idx[i])]++;
      pos[i] = n < c.capacity ? static_cast<std::int32_t>(n) : -1;
    }
  std::vector<std::int32_t> offset(static_cast<std::size_t>(E), 0);
  for (std::int64_t e = 1; e < E; ++e)
    offset[static_cast<std::size_t>(e)] =
        offset[static_cast<std::size_t>(e - 1)] +
        static_cast<std::int32_t>(std::min(routed[static_cast<std::size_t>(e - 1)], c.capacity));

  if (max_rel_error(p32, p) > 1e-6) {
    why = "gate: softmax differs from the float64 reference";
    return false;
  }
  const auto got_idx = c.x.b->download_i32(c.g.topk_idx);
  const auto got_slot = c.x.b->download_i32(c.g.slot);
  for (std::size_t i = 0; i < idx.size(); ++i) {
    if (got_idx[i] != idx[i]) {
      why = "gate: top-k choice differs from the reference";
      return false;
    }
    const std::int32_t want = pos[i] < 0 ? -1 : pos[i] + offset[static_cast<std::size_t>(idx[i])];
    if (got_slot[i] != want) {
      why = "gate: capacity slot differs from the reference";
      return false;
    }
  }
  return true;
}

void BM_GateForward(benchmark::State& st) {
  GateCase c(st.range(0), static_cast<int>(st.range(1)));
  c.x.b->gate_forward(c.x.s, c.g);
  c.x.b->synchronize();
  std::string why;
  if (!check_gate_forward(c, why)) {
    st.SkipWithError(why.c_str());
    return;
  }
  const OpCost cost = c.x.issued_cost();
  for (auto _ : st) {
    c.x.b->gate_forward(c.x.s, c.g);
    c.x.b->synchronize(c.x.s);
  }
  set_byte_rate(st, cost);
  st.counters["tokens/s"] = benchmark::Counter(static_cast<double>(c.T), benchmark::Counter::kIsIterationInvariantRate);
  c.x.b->clear_timeline();
}

void BM_GateBackward(benchmark::State& st) {
  GateCase c(st.range(0), static_cast<int>(st.range(1)));
  c.x.b->gate_forward(c.x.s, c.g);
  std::vector<float> dwh;
  GateBackward gb;
  gb.probs = c.g.probs;
  gb.topk_idx = c.g.topk_idx;
  gb.topk_w = c.g.topk_w;
  gb.routed_frac = c.g.routed_frac;
  gb.d_topk_w = c.x.random({c.T, c.k}, 12, &dwh);
  gb.grad_aux = 0.01f;
  gb.d_logits = c.x.tensor({c.T, c.E});
  c.x.b->gate_backward(c.x.s, gb);
  c.x.b->synchronize();

  // dp[t,e] = sum_j [idx[t,j] = e] dw[t,j] + grad_aux · E · f_e / T (f_e a constant of the
  // routing, as in Switch); d_logits = p ⊙ (dp - <p, dp>): softmax backward.
  const auto p = c.x.b->download(c.g.probs);
  const auto idx = c.x.b->download_i32(c.g.topk_idx);
  const auto f = c.x.b->download(c.g.routed_frac);
  const auto E = c.E, T = c.T;
  std::vector<double> want(static_cast<std::size_t>(T * E));
  std::vector<double> dp(static_cast<std::size_t>(E));
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t e = 0; e < E; ++e)
      dp[static_cast<std::size_t>(e)] =
          0.01 * static_cast<double>(E) * f[static_cast<std::size_t>(e)] / static_cast<double>(T);
    for (int j = 0; j < c.k; ++j)
      dp[static_cast<std::size_t>(idx[static_cast<std::size_t>(t * c.k + j)])] +=
          dwh[static_cast<std::size_t>(t * c.k + j)];
    double dot = 0.0;
    for (std::int64_t e = 0; e < E; ++e)
      dot += p[static_cast<std::size_t>(t * E + e)] * dp[static_cast<std::size_t>(e)];
    for (std::int64_t e = 0; e < E; ++e)
      want[static_cast<std::size_t>(t * E + e)] =
          p[static_cast<std::size_t>(t * E + e)] * (dp[static_cast<std::size_t>(e)] - dot);
  }
  if (max_rel_error(c.x.b->download(gb.d_logits), want) > 1e-5) {
    st.SkipWithError("gate_backward differs from the reference");
    return;
  }
  c.x.issued_cost();  // drop the forward's record
  c.x.b->gate_backward(c.x.s, gb);
  const OpCost cost = c.x.issued_cost();
  for (auto _ : st) {
    c.x.b->gate_backward(c.x.s, gb);
    c.x.b->synchronize(c.x.s);
  }
  set_byte_rate(st, cost);
  st.counters["tokens/s"] = benchmark::Counter(static_cast<double>(c.T), benchmark::Counter::kIsIterationInvariantRate);
  c.x.b->clear_timeline();
}

BENCHMARK(BM_GateForward)
    ->ArgsProduct({{8, 64}, {1, 2}})
    ->ArgNames({"E", "k"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_GateBackward)
    ->ArgsProduct({{8, 64}, {1, 2}})
    ->ArgNames({"E", "k"})
    ->UseRealTime()
    ->Unit(benchmark::kMicrosecond);

// ---- experts: activation ---------------------------------------------------------------------
// On T_M [R,H] with R = 4096 rows, H = 2048. GeLU is the exact erf form.

double act_ref(Activation a, double x) {
  return a == Activation::gelu ? 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))) : std::max(x, 0.0);
}
double act_grad_ref(Activation a, double x) {
  if (a == Activation::relu) return x > 0.0 ? 1.0 : 0.0;
  return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))) + x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * std::numbers::pi);
}

void BM_Activation(benchmark::State& st, Activation a, bool backward) {
  Bench x;
  const std::int64_t R = 4096, H = 2048;
  std::vector<float> inh, gh;
  Tensor in = x.random({R, H}, 21, &inh);
  for (auto& v : inh) v *= 3.0f;  // cover the curved part of GeLU
  x.b->upload(inh, in);
  Tensor d_out = x.random({R, H}, 22, &gh);
  Tensor out = x.tensor({R, H});
  auto issue = [&] {
    if (backward)
      x.b->activation_backward(x.s, a, in, d_out, out);
    else
      x.b->activation_forward(x.s, a, in, out);
  };
  issue();
  std::vector<double> want(inh.size());
  for (std::size_t i = 0; i < inh.size(); ++i)
    want[i] = backward ? gh[i] * act_grad_ref(a, inh[i]) : act_ref(a, inh[i]);
  if (max_rel_error(x.b->download(out), want) > 1e-6) {
    st.SkipWithError("activation differs from the float64 reference");
    return;
  }
  const OpCost cost = x.issued_cost();
  for (auto _ : st) {
    issue();
    x.b->synchronize(x.s);
  }
  set_byte_rate(st, cost);
  x.b->clear_timeline();
}
BENCHMARK_CAPTURE(BM_Activation, gelu, Activation::gelu, false)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Activation, gelu_backward, Activation::gelu, true)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Activation, relu, Activation::relu, false)->UseRealTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Activation, relu_backward, Activation::relu, true)->UseRealTime()->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
