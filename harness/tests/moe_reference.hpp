// harness/tests/moe_reference.hpp — a plain float64 reference of the MoE layer.
//
// Dense and direct: each token goes through its chosen experts one by one, no permutation,
// no all-to-all, no grouped GEMM. It shares no code with the layer it checks. Routing
// follows the documented semantics: softmax, top-k (ties -> lower index), capacity in GShard
// priority (all first choices before any second choice, lower token first), Switch aux loss.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "harness/config/workload.hpp"

namespace moelab::ref {

struct Params {
  std::int64_t M = 0, H = 0, E = 0;
  std::vector<double> wg, wn;  // [M,E]
  std::vector<double> w1;      // [E,M,H] all experts (global ids)
  std::vector<double> w2;      // [E,H,M]
};

struct Grads {
  std::vector<double> dx, dwg, dwn, dw1, dw2;
  void init(const Params& p, std::int64_t T) {
    dx.assign(static_cast<std::size_t>(T * p.M), 0.0);
    dwg.assign(p.wg.size(), 0.0);
    dwn.assign(p.wn.size(), 0.0);
    dw1.assign(p.w1.size(), 0.0);
    dw2.assign(p.w2.size(), 0.0);
  }
};

struct Result {
  std::vector<double> y;            // [T,M]
  double aux = 0;
  std::vector<int> idx;             // [T,k]
  std::vector<bool> kept;           // [T,k]
  std::vector<std::int64_t> counts; // [E] kept per expert
  double min_topk_gap = 1e9;        // smallest p_(k) - p_(k+1) over tokens (near-tie detector)
};

// The tanh GeLU's inner function u(x) = sqrt(2/pi)·(x + 0.044715·x³) (Hendrycks & Gimpel 2016).
inline double gelu_tanh_u(double x) { return std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x); }
inline double act(Activation a, double x) {
  switch (a) {
    case Activation::gelu: return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0)));
    case Activation::gelu_tanh: return 0.5 * x * (1.0 + std::tanh(gelu_tanh_u(x)));
    case Activation::relu: break;
  }
  return x > 0 ? x : 0.0;
}
inline double act_grad(Activation a, double x) {
  switch (a) {
    case Activation::gelu:
      return 0.5 * (1.0 + std::erf(x / std::sqrt(2.0))) + x * std::exp(-0.5 * x * x) / std::sqrt(2.0 * M_PI);
    case Activation::gelu_tanh: {
      const double t = std::tanh(gelu_tanh_u(x));
      return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * std::sqrt(2.0 / M_PI) * (1.0 + 3.0 * 0.044715 * x * x);
    }
    case Activation::relu: break;
  }
  return x > 0 ? 1.0 : 0.0;
}

// Forward, and (when g != nullptr) backward of L = <dy, y> + grad_aux * aux, accumulating
// into g (dx is overwritten). x [T,M]; eps [T,E] (noisy gate only).
inline Result forward_backward(const ModelConfig& cfg, const Params& P, const std::vector<double>& x,
                               const std::vector<double>& eps, const std::vector<double>* dy, double grad_aux,
                               Grads* g) {
  const std::int64_t M = P.M, H = P.H, E = P.E, T = static_cast<std::int64_t>(x.size()) / M;
  const int k = cfg.top_k;
  auto at = [](std::int64_t i) { return static_cast<std::size_t>(i); };
  Result r;
  // gate
  std::vector<double> nr(at(T * E), 0.0), logits(at(T * E), 0.0), p(at(T * E));
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t e = 0; e < E; ++e) {
      double c = 0, n = 0;
      for (std::int64_t m = 0; m < M; ++m) {
        c += x[at(t * M + m)] * P.wg[at(m * E + e)];
        if (cfg.noisy_gate) n += x[at(t * M + m)] * P.wn[at(m * E + e)];
      }
      nr[at(t * E + e)] = n;
      logits[at(t * E + e)] = c + (cfg.noisy_gate ? eps[at(t * E + e)] * std::log1p(std::exp(n)) : 0.0);
    }
  for (std::int64_t t = 0; t < T; ++t) {
    double mx = -1e300, s = 0;
    for (std::int64_t e = 0; e < E; ++e) mx = std::max(mx, logits[at(t * E + e)]);
    for (std::int64_t e = 0; e < E; ++e) s += (p[at(t * E + e)] = std::exp(logits[at(t * E + e)] - mx));
    for (std::int64_t e = 0; e < E; ++e) p[at(t * E + e)] /= s;
  }
  r.idx.assign(at(T * k), -1);
  std::vector<double> w(at(T * k));
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<int> order(at(E));
    for (int e = 0; e < E; ++e) order[at(e)] = e;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return p[at(t * E + a)] > p[at(t * E + b)]; });
    double S = 0;
    for (int j = 0; j < k; ++j) {
      r.idx[at(t * k + j)] = order[at(j)];
      S += p[at(t * E + order[at(j)])];
    }
    if (k < E) r.min_topk_gap = std::min(r.min_topk_gap, p[at(t * E + order[at(k - 1)])] - p[at(t * E + order[at(k)])]);
    for (int j = 1; j < k; ++j)
      r.min_topk_gap = std::min(r.min_topk_gap, p[at(t * E + order[at(j - 1)])] - p[at(t * E + order[at(j)])]);
    for (int j = 0; j < k; ++j) w[at(t * k + j)] = p[at(t * E + order[at(j)])] / (cfg.renormalize ? S : 1.0);
  }
  const std::int64_t cap = cfg.capacity(T);
  std::vector<std::int64_t> routed(at(E), 0);
  r.kept.assign(at(T * k), false);
  for (int j = 0; j < k; ++j)
    for (std::int64_t t = 0; t < T; ++t) {
      const int e = r.idx[at(t * k + j)];
      r.kept[at(t * k + j)] = cap <= 0 || routed[at(e)] < cap;
      ++routed[at(e)];
    }
  r.counts.assign(at(E), 0);
  for (std::int64_t i = 0; i < T * k; ++i)
    if (r.kept[at(i)]) ++r.counts[at(r.idx[at(i)])];
  std::vector<double> f(at(E));
  for (std::int64_t e = 0; e < E; ++e) {
    f[at(e)] = static_cast<double>(routed[at(e)]) / static_cast<double>(T * k);
    double pe = 0;
    for (std::int64_t t = 0; t < T; ++t) pe += p[at(t * E + e)];
    r.aux += f[at(e)] * pe / static_cast<double>(T);
  }
  r.aux *= static_cast<double>(E);

  // experts, token by token
  r.y.assign(at(T * M), 0.0);
  std::vector<double> dw(at(T * k), 0.0);
  if (g) std::fill(g->dx.begin(), g->dx.end(), 0.0);
  std::vector<double> h(at(H)), a(at(H)), o(at(M)), da(at(H));
  for (std::int64_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      if (!r.kept[at(t * k + j)]) continue;
      const std::int64_t e = r.idx[at(t * k + j)];
      const double* W1 = &P.w1[at(e * M * H)];
      const double* W2 = &P.w2[at(e * H * M)];
      for (std::int64_t c = 0; c < H; ++c) {
        double s = 0;
        for (std::int64_t m = 0; m < M; ++m) s += x[at(t * M + m)] * W1[m * H + c];
        h[at(c)] = s;
        a[at(c)] = act(cfg.activation, s);
      }
      for (std::int64_t m = 0; m < M; ++m) {
        double s = 0;
        for (std::int64_t c = 0; c < H; ++c) s += a[at(c)] * W2[c * M + m];
        o[at(m)] = s;
        r.y[at(t * M + m)] += w[at(t * k + j)] * s;
      }
      if (!g) continue;
      const double wt = w[at(t * k + j)];
      double dot = 0;
      for (std::int64_t m = 0; m < M; ++m) dot += (*dy)[at(t * M + m)] * o[at(m)];
      dw[at(t * k + j)] = dot;
      for (std::int64_t c = 0; c < H; ++c) {
        double s = 0;
        for (std::int64_t m = 0; m < M; ++m) {
          const double dom = wt * (*dy)[at(t * M + m)];
          g->dw2[at(e * H * M + c * M + m)] += a[at(c)] * dom;
          s += W2[c * M + m] * dom;
        }
        da[at(c)] = s * act_grad(cfg.activation, h[at(c)]);
      }
      for (std::int64_t m = 0; m < M; ++m) {
        double s = 0;
        for (std::int64_t c = 0; c < H; ++c) {
          g->dw1[at(e * M * H + m * H + c)] += x[at(t * M + m)] * da[at(c)];
          s += W1[m * H + c] * da[at(c)];
        }
        g->dx[at(t * M + m)] += s;
      }
    }
  if (!g) return r;

  // gate backward
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<double> dp(at(E));
    for (std::int64_t e = 0; e < E; ++e)
      dp[at(e)] = grad_aux * static_cast<double>(E) * f[at(e)] / static_cast<double>(T);
    double S = 0, wdot = 0;
    for (int j = 0; j < k; ++j) {
      S += p[at(t * E + r.idx[at(t * k + j)])];
      wdot += dw[at(t * k + j)] * w[at(t * k + j)];
    }
    for (int j = 0; j < k; ++j)
      dp[at(r.idx[at(t * k + j)])] += cfg.renormalize ? (dw[at(t * k + j)] - wdot) / S : dw[at(t * k + j)];
    double pd = 0;
    for (std::int64_t e = 0; e < E; ++e) pd += p[at(t * E + e)] * dp[at(e)];
    for (std::int64_t e = 0; e < E; ++e) {
      const double dl = p[at(t * E + e)] * (dp[at(e)] - pd);
      const double dn = cfg.noisy_gate ? dl * eps[at(t * E + e)] / (1.0 + std::exp(-nr[at(t * E + e)])) : 0.0;
      for (std::int64_t m = 0; m < M; ++m) {
        g->dwg[at(m * E + e)] += x[at(t * M + m)] * dl;
        g->dx[at(t * M + m)] += dl * P.wg[at(m * E + e)];
        if (cfg.noisy_gate) {
          g->dwn[at(m * E + e)] += x[at(t * M + m)] * dn;
          g->dx[at(t * M + m)] += dn * P.wn[at(m * E + e)];
        }
      }
    }
  }
  return r;
}

}  // namespace moelab::ref
