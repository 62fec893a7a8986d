// harness/tests/cuda_blocks_reference.hpp — a plain float64 reference of the transformer-block
// ops (harness/runtime/backend.hpp, "transformer-block ops"), written from the formulas and
// sharing no code with any backend: attention keeps the whole [S,S] score matrix of a head,
// every sum is a loop. cuda_blocks_test.cpp checks each backward here against central finite
// differences, and the cuda kernels against these functions.
//
// Layouts as in backend.hpp: T = B*S tokens (token t at position t mod S), row-major
// tensors as flat vectors; qkv [T,(Hq+2Hkv)*D] packed per token as the query heads, the key
// heads, then the value heads; out [T,Hq*D]; lse [B,Hq,S].
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "harness/runtime/op_types.hpp"

namespace moelab::cuda_ref {

using Vec = std::vector<double>;
using i64 = std::int64_t;

// ---- embedding ---------------------------------------------------------------------------
// out[t] = wte[ids[t]] (+ wpe[t mod S])                              wte [V,M], wpe [P,M]
inline Vec embedding_forward(const std::vector<std::int32_t>& ids, const Vec& wte, const Vec* wpe, i64 S, i64 M) {
  const i64 T = static_cast<i64>(ids.size());
  Vec out(static_cast<std::size_t>(T * M));
  for (i64 t = 0; t < T; ++t)
    for (i64 c = 0; c < M; ++c)
      out[t * M + c] = wte[ids[t] * M + c] + (wpe ? (*wpe)[(t % S) * M + c] : 0.0);
  return out;
}
// d_wte[ids[t]] += d_out[t]; d_wpe[t mod S] += d_out[t]
inline void embedding_backward(const Vec& d_out, const std::vector<std::int32_t>& ids, i64 S, i64 M, Vec& d_wte,
                               Vec* d_wpe) {
  const i64 T = static_cast<i64>(ids.size());
  for (i64 t = 0; t < T; ++t)
    for (i64 c = 0; c < M; ++c) {
      d_wte[ids[t] * M + c] += d_out[t * M + c];
      if (d_wpe) (*d_wpe)[(t % S) * M + c] += d_out[t * M + c];
    }
}

// ---- layernorm / rmsnorm -----------------------------------------------------------------
struct Norm {
  Vec y, mean, rstd;  // [T,M], [T], [T]
};
inline Norm norm_forward(NormKind kind, double eps, const Vec& x, const Vec& gamma, const Vec* beta, i64 T, i64 M) {
  Norm n{Vec(x.size()), Vec(static_cast<std::size_t>(T)), Vec(static_cast<std::size_t>(T))};
  for (i64 t = 0; t < T; ++t) {
    double mu = 0, ss = 0;
    if (kind == NormKind::layernorm) {
      for (i64 c = 0; c < M; ++c) mu += x[t * M + c];
      mu /= static_cast<double>(M);
    }
    for (i64 c = 0; c < M; ++c) ss += (x[t * M + c] - mu) * (x[t * M + c] - mu);
    const double r = 1.0 / std::sqrt(ss / static_cast<double>(M) + eps);
    n.mean[t] = mu;
    n.rstd[t] = r;
    for (i64 c = 0; c < M; ++c)
      n.y[t * M + c] = (x[t * M + c] - mu) * r * gamma[c] + (beta && kind == NormKind::layernorm ? (*beta)[c] : 0.0);
  }
  return n;
}
// dx (returned); d_gamma += sum_t dy*xhat; d_beta += sum_t dy (layernorm)
inline Vec norm_backward(NormKind kind, double eps, const Vec& x, const Vec& gamma, const Vec& dy, i64 T, i64 M,
                         Vec& d_gamma, Vec& d_beta) {
  const Norm n = norm_forward(kind, eps, x, gamma, nullptr, T, M);
  Vec dx(x.size());
  const bool ln = kind == NormKind::layernorm;
  for (i64 t = 0; t < T; ++t) {
    const double mu = n.mean[t], r = n.rstd[t];
    double sum_g = 0, sum_gx = 0;
    for (i64 c = 0; c < M; ++c) {
      const double g = dy[t * M + c] * gamma[c], xhat = (x[t * M + c] - mu) * r;
      sum_g += g;
      sum_gx += g * xhat;
      d_gamma[c] += dy[t * M + c] * xhat;
      if (ln) d_beta[c] += dy[t * M + c];
    }
    for (i64 c = 0; c < M; ++c) {
      const double g = dy[t * M + c] * gamma[c], xhat = (x[t * M + c] - mu) * r;
      dx[t * M + c] = r * (g - (ln ? sum_g / static_cast<double>(M) : 0.0) - xhat * sum_gx / static_cast<double>(M));
    }
  }
  return dx;
}

// ---- rotary embedding --------------------------------------------------------------------
// In place on the Hq query and Hkv key heads: pair (i, i + D/2) rotated by (t mod S) theta^(-2i/D).
inline void rope(Vec& qkv, const AttentionShape& a, double theta, bool inverse) {
  const i64 D = a.head_dim, W = a.qkv_width(), half = D / 2;
  for (i64 t = 0; t < a.tokens(); ++t)
    for (i64 h = 0; h < a.heads + a.kv_heads; ++h)
      for (i64 i = 0; i < half; ++i) {
        const double ang = static_cast<double>(t % a.seq) * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(D));
        const double c = std::cos(ang), s = inverse ? -std::sin(ang) : std::sin(ang);
        double& x1 = qkv[t * W + h * D + i];
        double& x2 = qkv[t * W + h * D + i + half];
        const double a1 = x1, a2 = x2;
        x1 = a1 * c - a2 * s;
        x2 = a2 * c + a1 * s;
      }
}

// ---- attention ---------------------------------------------------------------------------
struct Attention {
  Vec out, lse;  // [T,Hq*D], [B,Hq,S]
};
namespace detail {
struct Heads {  // where head h's q, and its kv head's k and v, start within a token's row
  i64 W, D, q, k, v;
};
inline Heads heads(const AttentionShape& a, i64 h) {
  const i64 g = h / (a.heads / a.kv_heads);
  return {a.qkv_width(), a.head_dim, h * a.head_dim, (a.heads + g) * a.head_dim,
          (a.heads + a.kv_heads + g) * a.head_dim};
}
// Row i's probabilities over keys j (0 for masked keys) and its log-sum-exp.
inline double probabilities(const Vec& qkv, const AttentionShape& a, const Heads& hd, i64 b, i64 i, Vec& p) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd.D));
  const i64 S = a.seq, last = a.causal ? i : S - 1;
  double m = -std::numeric_limits<double>::infinity();
  for (i64 j = 0; j < S; ++j) {
    p[j] = 0;
    if (j > last) continue;
    double s = 0;
    for (i64 d = 0; d < hd.D; ++d) s += qkv[(b * S + i) * hd.W + hd.q + d] * qkv[(b * S + j) * hd.W + hd.k + d];
    p[j] = s * scale;
    m = std::max(m, p[j]);
  }
  double sum = 0;
  for (i64 j = 0; j <= last; ++j) sum += std::exp(p[j] - m);
  const double lse = m + std::log(sum);
  for (i64 j = 0; j <= last; ++j) p[j] = std::exp(p[j] - lse);
  return lse;
}
}  // namespace detail

inline Attention attention_forward(const Vec& qkv, const AttentionShape& a) {
  const i64 S = a.seq, D = a.head_dim, Hq = a.heads;
  Attention r{Vec(static_cast<std::size_t>(a.tokens() * Hq * D)), Vec(static_cast<std::size_t>(a.tokens() * Hq))};
  Vec p(static_cast<std::size_t>(S));
  for (i64 b = 0; b < a.batch; ++b)
    for (i64 h = 0; h < Hq; ++h) {
      const auto hd = detail::heads(a, h);
      for (i64 i = 0; i < S; ++i) {
        r.lse[(b * Hq + h) * S + i] = detail::probabilities(qkv, a, hd, b, i, p);
        for (i64 d = 0; d < D; ++d) {
          double o = 0;
          for (i64 j = 0; j < S; ++j) o += p[j] * qkv[(b * S + j) * hd.W + hd.v + d];
          r.out[((b * S + i) * Hq + h) * D + d] = o;
        }
      }
    }
  return r;
}

// d_qkv [T,(Hq+2Hkv)*D] from d_out [T,Hq*D]: dV = P^T dO, dP = dO V^T, dS = P o (dP - rowsum(P o dP)),
// dQ = dS K / sqrt(D), dK = dS^T Q / sqrt(D) (GQA: a kv head sums over its query heads).
inline Vec attention_backward(const Vec& qkv, const Vec& d_out, const AttentionShape& a) {
  const i64 S = a.seq, D = a.head_dim, Hq = a.heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  Vec dqkv(qkv.size(), 0.0), p(static_cast<std::size_t>(S)), dp(static_cast<std::size_t>(S));
  for (i64 b = 0; b < a.batch; ++b)
    for (i64 h = 0; h < Hq; ++h) {
      const auto hd = detail::heads(a, h);
      for (i64 i = 0; i < S; ++i) {
        detail::probabilities(qkv, a, hd, b, i, p);
        const double* dO = &d_out[((b * S + i) * Hq + h) * D];
        double rowsum = 0;
        for (i64 j = 0; j < S; ++j) {
          dp[j] = 0;
          for (i64 d = 0; d < D; ++d) dp[j] += dO[d] * qkv[(b * S + j) * hd.W + hd.v + d];
          rowsum += p[j] * dp[j];
        }
        for (i64 j = 0; j < S; ++j) {
          const double ds = p[j] * (dp[j] - rowsum);
          for (i64 d = 0; d < D; ++d) {
            dqkv[(b * S + i) * hd.W + hd.q + d] += scale * ds * qkv[(b * S + j) * hd.W + hd.k + d];
            dqkv[(b * S + j) * hd.W + hd.k + d] += scale * ds * qkv[(b * S + i) * hd.W + hd.q + d];
            dqkv[(b * S + j) * hd.W + hd.v + d] += p[j] * dO[d];
          }
        }
      }
    }
  return dqkv;
}

// ---- SwiGLU, add -------------------------------------------------------------------------
inline double silu(double x) { return x / (1.0 + std::exp(-x)); }
// h [T,2F] = [gate | up] -> out [T,F] = silu(gate) * up
inline Vec swiglu_forward(const Vec& h, i64 T, i64 F) {
  Vec out(static_cast<std::size_t>(T * F));
  for (i64 t = 0; t < T; ++t)
    for (i64 f = 0; f < F; ++f) out[t * F + f] = silu(h[t * 2 * F + f]) * h[t * 2 * F + F + f];
  return out;
}
inline Vec swiglu_backward(const Vec& h, const Vec& d_out, i64 T, i64 F) {
  Vec dh(h.size());
  for (i64 t = 0; t < T; ++t)
    for (i64 f = 0; f < F; ++f) {
      const double g = h[t * 2 * F + f], u = h[t * 2 * F + F + f], dy = d_out[t * F + f];
      const double sg = 1.0 / (1.0 + std::exp(-g));
      dh[t * 2 * F + f] = dy * u * (sg + g * sg * (1.0 - sg));
      dh[t * 2 * F + F + f] = dy * silu(g);
    }
  return dh;
}

// ---- softmax cross-entropy ---------------------------------------------------------------
struct CrossEntropy {
  Vec losses, lse;  // [T], [T]
};
inline CrossEntropy cross_entropy_forward(const Vec& logits, const std::vector<std::int32_t>& targets, i64 T, i64 V) {
  CrossEntropy r{Vec(static_cast<std::size_t>(T)), Vec(static_cast<std::size_t>(T))};
  for (i64 t = 0; t < T; ++t) {
    double m = -std::numeric_limits<double>::infinity(), sum = 0;
    for (i64 v = 0; v < V; ++v) m = std::max(m, logits[t * V + v]);
    for (i64 v = 0; v < V; ++v) sum += std::exp(logits[t * V + v] - m);
    r.lse[t] = m + std::log(sum);
    r.losses[t] = targets[t] < 0 ? 0.0 : r.lse[t] - logits[t * V + targets[t]];
  }
  return r;
}
// d_logits = scale * (softmax - onehot) for counted rows, 0 for ignored ones: the gradient of
// scale * sum_t losses[t].
inline Vec cross_entropy_backward(const Vec& logits, const std::vector<std::int32_t>& targets, double scale, i64 T,
                                  i64 V) {
  const auto f = cross_entropy_forward(logits, targets, T, V);
  Vec d(logits.size(), 0.0);
  for (i64 t = 0; t < T; ++t) {
    if (targets[t] < 0) continue;
    for (i64 v = 0; v < V; ++v)
      d[t * V + v] = scale * (std::exp(logits[t * V + v] - f.lse[t]) - (v == targets[t] ? 1.0 : 0.0));
  }
  return d;
}

// ---- optimizer step ----------------------------------------------------------------------
// SGD: w -= lr (g + wd w). Adam/AdamW: m, v moments, bias-corrected, decoupled decay.
inline void optimizer_step(OptimizerKind kind, Vec& w, const Vec& g, Vec& m, Vec& v, double lr, double beta1,
                           double beta2, double eps, double wd, i64 step) {
  for (std::size_t k = 0; k < w.size(); ++k) {
    if (kind == OptimizerKind::sgd) {
      w[k] -= lr * (g[k] + wd * w[k]);
      continue;
    }
    m[k] = beta1 * m[k] + (1 - beta1) * g[k];
    v[k] = beta2 * v[k] + (1 - beta2) * g[k] * g[k];
    const double mhat = m[k] / (1 - std::pow(beta1, static_cast<double>(step)));
    const double vhat = v[k] / (1 - std::pow(beta2, static_cast<double>(step)));
    w[k] -= lr * (mhat / (std::sqrt(vhat) + eps) + wd * w[k]);
  }
}

}  // namespace moelab::cuda_ref
