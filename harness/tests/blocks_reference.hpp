// harness/tests/blocks_reference.hpp — a float64 reference of every transformer-block op
// (Backend, "transformer-block ops"), written the plain way and sharing no code with any
// backend: attention materialises the whole [S,S] score matrix and its backward uses
// dS = P∘(dP − rowsum(P∘dP)) (not the FlashAttention identity rowsum(dO∘O)); the norms'
// backward is the explicit Jacobian-vector product. Checked by central finite differences
// in blocks_ops_test.cpp. Shapes as in backend.hpp: T = B*S tokens, M width, V vocabulary.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "harness/runtime/op_types.hpp"

namespace moelab::blocks_ref {

using Vec = std::vector<double>;
using Ids = std::vector<std::int32_t>;

// ---- embedding -------------------------------------------------------------------------------
// out [T,M] = wte[ids[t]] (+ wpe[t mod S]); wpe empty = no learned positions.
inline Vec embedding_forward(const Ids& ids, const Vec& wte, const Vec& wpe, std::int64_t M, std::int64_t S) {
  const auto T = static_cast<std::int64_t>(ids.size());
  Vec out(static_cast<std::size_t>(T * M));
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t c = 0; c < M; ++c)
      out[static_cast<std::size_t>(t * M + c)] =
          wte[static_cast<std::size_t>(ids[static_cast<std::size_t>(t)] * M + c)] +
          (wpe.empty() ? 0.0 : wpe[static_cast<std::size_t>((t % S) * M + c)]);
  return out;
}

// Gradients of Σ d_out·out with respect to wte [V,M] and wpe [P,M] (fresh, not accumulated).
inline void embedding_backward(const Ids& ids, const Vec& d_out, std::int64_t M, std::int64_t S, Vec& d_wte,
                               Vec& d_wpe) {
  for (std::size_t t = 0; t < ids.size(); ++t)
    for (std::int64_t c = 0; c < M; ++c) {
      const double g = d_out[t * static_cast<std::size_t>(M) + static_cast<std::size_t>(c)];
      d_wte[static_cast<std::size_t>(ids[t] * M + c)] += g;
      if (!d_wpe.empty()) d_wpe[static_cast<std::size_t>((static_cast<std::int64_t>(t) % S) * M + c)] += g;
    }
}

// ---- layernorm / rmsnorm ---------------------------------------------------------------------
struct Norm {
  Vec y, mean, rstd;  // [T,M], [T], [T]
};

inline Norm norm_forward(NormKind kind, double eps, const Vec& x, std::int64_t M, const Vec& gamma, const Vec& beta) {
  const std::size_t m = static_cast<std::size_t>(M), T = x.size() / m;
  Norm n{Vec(x.size()), Vec(T), Vec(T)};
  for (std::size_t t = 0; t < T; ++t) {
    double mu = 0, var = 0;
    if (kind == NormKind::layernorm) {
      for (std::size_t c = 0; c < m; ++c) mu += x[t * m + c];
      mu /= static_cast<double>(m);
    }
    for (std::size_t c = 0; c < m; ++c) var += (x[t * m + c] - mu) * (x[t * m + c] - mu);
    const double r = 1.0 / std::sqrt(var / static_cast<double>(m) + eps);
    for (std::size_t c = 0; c < m; ++c)
      n.y[t * m + c] = (x[t * m + c] - mu) * r * gamma[c] + (beta.empty() || kind == NormKind::rmsnorm ? 0.0 : beta[c]);
    n.mean[t] = mu;
    n.rstd[t] = r;
  }
  return n;
}

// Gradients of Σ dy·y: dx by the explicit Jacobian of one row (∂x̂_c/∂x_k summed against
// dy_c·γ_c), dγ and dβ fresh.
inline void norm_backward(NormKind kind, double eps, const Vec& x, std::int64_t M, const Vec& gamma, const Vec& dy,
                          Vec& dx, Vec& d_gamma, Vec& d_beta) {
  const std::size_t m = static_cast<std::size_t>(M), T = x.size() / m;
  const bool ln = kind == NormKind::layernorm;
  const double dm = static_cast<double>(m);
  const Norm n = norm_forward(kind, eps, x, M, gamma, {});
  dx.assign(x.size(), 0.0);
  d_gamma.assign(m, 0.0);
  d_beta.assign(m, 0.0);
  for (std::size_t t = 0; t < T; ++t) {
    const double r = n.rstd[t], mu = n.mean[t];
    for (std::size_t k = 0; k < m; ++k) {
      const double uk = x[t * m + k] - mu;
      double acc = 0;
      for (std::size_t c = 0; c < m; ++c) {
        const double uc = x[t * m + c] - mu;
        // x̂_c = u_c r, u = x − mean (mean ≡ 0 for rmsnorm); ∂r/∂x_k = −r³ u_k / m
        const double du_c = (c == k ? 1.0 : 0.0) - (ln ? 1.0 / dm : 0.0);
        const double jac = du_c * r - uc * r * r * r * uk / dm;
        acc += dy[t * m + c] * gamma[c] * jac;
      }
      dx[t * m + k] = acc;
    }
    for (std::size_t c = 0; c < m; ++c) {
      d_gamma[c] += dy[t * m + c] * (x[t * m + c] - mu) * r;
      d_beta[c] += dy[t * m + c];
    }
  }
}

// ---- rotary position embedding ------------------------------------------------------------------
// Rotates the query and key heads of qkv [T,(Hq+2Hkv)*D]: dimension i with i + D/2 by
// angle (t mod S)·θ^(−2i/D) (by minus that angle when inverse).
inline Vec rope(const AttentionShape& a, double theta, bool inverse, Vec qkv) {
  const std::int64_t W = a.qkv_width(), D = a.head_dim, half = D / 2;
  for (std::int64_t t = 0; t < a.tokens(); ++t)
    for (std::int64_t h = 0; h < a.heads + a.kv_heads; ++h)
      for (std::int64_t i = 0; i < half; ++i) {
        const double ang =
            static_cast<double>(t % a.seq) * std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(D));
        const double c = std::cos(ang), s = inverse ? -std::sin(ang) : std::sin(ang);
        double& x0 = qkv[static_cast<std::size_t>(t * W + h * D + i)];
        double& x1 = qkv[static_cast<std::size_t>(t * W + h * D + i + half)];
        const double a0 = x0, a1 = x1;
        x0 = a0 * c - a1 * s;
        x1 = a1 * c + a0 * s;
      }
  return qkv;
}

// ---- attention -------------------------------------------------------------------------------
// softmax(Q K^T / sqrt(D) [+ causal mask]) V per (sequence, query head), query head h on
// key/value head h / (Hq/Hkv). out [T,Hq*D], lse [B,Hq,S].
struct Attention {
  Vec out, lse;
};

namespace detail {
struct AttnIndex {
  const AttentionShape& a;
  std::size_t q(std::int64_t b, std::int64_t i, std::int64_t h, std::int64_t d) const {
    return static_cast<std::size_t>((b * a.seq + i) * a.qkv_width() + h * a.head_dim + d);
  }
  std::size_t k(std::int64_t b, std::int64_t j, std::int64_t h, std::int64_t d) const {
    return static_cast<std::size_t>((b * a.seq + j) * a.qkv_width() +
                                    (a.heads + h / (a.heads / a.kv_heads)) * a.head_dim + d);
  }
  std::size_t v(std::int64_t b, std::int64_t j, std::int64_t h, std::int64_t d) const {
    return k(b, j, h, d) + static_cast<std::size_t>(a.kv_heads * a.head_dim);
  }
  std::size_t o(std::int64_t b, std::int64_t i, std::int64_t h, std::int64_t d) const {
    return static_cast<std::size_t>((b * a.seq + i) * a.heads * a.head_dim + h * a.head_dim + d);
  }
};
// The full probability matrix P [S,S] of one (sequence, head) and each row's log-sum-exp.
inline void probabilities(const AttentionShape& a, const Vec& qkv, std::int64_t b, std::int64_t h, Vec& P, Vec& lse) {
  const AttnIndex ix{a};
  const std::int64_t S = a.seq, D = a.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  P.assign(static_cast<std::size_t>(S * S), 0.0);
  lse.assign(static_cast<std::size_t>(S), 0.0);
  for (std::int64_t i = 0; i < S; ++i) {
    const std::int64_t last = a.causal ? i : S - 1;
    double mx = -std::numeric_limits<double>::infinity();
    for (std::int64_t j = 0; j <= last; ++j) {
      double s = 0;
      for (std::int64_t d = 0; d < D; ++d) s += qkv[ix.q(b, i, h, d)] * qkv[ix.k(b, j, h, d)];
      P[static_cast<std::size_t>(i * S + j)] = s * scale;
      mx = std::max(mx, s * scale);
    }
    double sum = 0;
    for (std::int64_t j = 0; j <= last; ++j) sum += std::exp(P[static_cast<std::size_t>(i * S + j)] - mx);
    lse[static_cast<std::size_t>(i)] = mx + std::log(sum);
    for (std::int64_t j = 0; j <= last; ++j)
      P[static_cast<std::size_t>(i * S + j)] =
          std::exp(P[static_cast<std::size_t>(i * S + j)] - lse[static_cast<std::size_t>(i)]);
  }
}
}  // namespace detail

inline Attention attention_forward(const AttentionShape& a, const Vec& qkv) {
  const detail::AttnIndex ix{a};
  const std::int64_t S = a.seq, D = a.head_dim;
  Attention r{Vec(static_cast<std::size_t>(a.tokens() * a.heads * D)),
              Vec(static_cast<std::size_t>(a.batch * a.heads * S))};
  Vec P, lse;
  for (std::int64_t b = 0; b < a.batch; ++b)
    for (std::int64_t h = 0; h < a.heads; ++h) {
      detail::probabilities(a, qkv, b, h, P, lse);
      for (std::int64_t i = 0; i < S; ++i) {
        r.lse[static_cast<std::size_t>((b * a.heads + h) * S + i)] = lse[static_cast<std::size_t>(i)];
        for (std::int64_t d = 0; d < D; ++d) {
          double acc = 0;
          for (std::int64_t j = 0; j < S; ++j) acc += P[static_cast<std::size_t>(i * S + j)] * qkv[ix.v(b, j, h, d)];
          r.out[ix.o(b, i, h, d)] = acc;
        }
      }
    }
  return r;
}

// d_qkv [T,(Hq+2Hkv)*D], the gradient of Σ d_out·out.
inline Vec attention_backward(const AttentionShape& a, const Vec& qkv, const Vec& d_out) {
  const detail::AttnIndex ix{a};
  const std::int64_t S = a.seq, D = a.head_dim;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  Vec g(qkv.size(), 0.0), P, lse, dP(static_cast<std::size_t>(S * S));
  for (std::int64_t b = 0; b < a.batch; ++b)
    for (std::int64_t h = 0; h < a.heads; ++h) {
      detail::probabilities(a, qkv, b, h, P, lse);
      for (std::int64_t i = 0; i < S; ++i)
        for (std::int64_t j = 0; j < S; ++j) {
          double acc = 0;  // dP = dO V^T
          for (std::int64_t d = 0; d < D; ++d) acc += d_out[ix.o(b, i, h, d)] * qkv[ix.v(b, j, h, d)];
          dP[static_cast<std::size_t>(i * S + j)] = acc;
        }
      for (std::int64_t i = 0; i < S; ++i) {
        double row = 0;  // softmax backward: dS = P∘(dP − Σ_j P∘dP)
        for (std::int64_t j = 0; j < S; ++j)
          row += P[static_cast<std::size_t>(i * S + j)] * dP[static_cast<std::size_t>(i * S + j)];
        for (std::int64_t j = 0; j < S; ++j) {
          const double p = P[static_cast<std::size_t>(i * S + j)];
          const double ds = p * (dP[static_cast<std::size_t>(i * S + j)] - row) * scale;
          for (std::int64_t d = 0; d < D; ++d) {
            g[ix.q(b, i, h, d)] += ds * qkv[ix.k(b, j, h, d)];
            g[ix.k(b, j, h, d)] += ds * qkv[ix.q(b, i, h, d)];
            g[ix.v(b, j, h, d)] += p * d_out[ix.o(b, i, h, d)];
          }
        }
      }
    }
  return g;
}

// ---- SwiGLU ----------------------------------------------------------------------------------
// h [T,2F] = [gate | up] -> out [T,F] = silu(gate)·up
inline Vec swiglu_forward(const Vec& h, std::int64_t F) {
  const std::size_t f = static_cast<std::size_t>(F), T = h.size() / (2 * f);
  Vec out(T * f);
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t c = 0; c < f; ++c) {
      const double g = h[t * 2 * f + c], u = h[t * 2 * f + f + c];
      out[t * f + c] = g / (1.0 + std::exp(-g)) * u;
    }
  return out;
}

inline Vec swiglu_backward(const Vec& h, const Vec& d_out, std::int64_t F) {
  const std::size_t f = static_cast<std::size_t>(F), T = h.size() / (2 * f);
  Vec dh(h.size());
  for (std::size_t t = 0; t < T; ++t)
    for (std::size_t c = 0; c < f; ++c) {
      const double g = h[t * 2 * f + c], u = h[t * 2 * f + f + c], dy = d_out[t * f + c];
      const double e = std::exp(-g), sig = 1.0 / (1.0 + e);
      // d/dg [g·σ(g)] = σ + g·e/(1+e)²
      dh[t * 2 * f + c] = dy * u * (sig + g * e / ((1.0 + e) * (1.0 + e)));
      dh[t * 2 * f + f + c] = dy * g * sig;
    }
  return dh;
}

// ---- gated combine (ScMoE's CG-1 / CG-2) ----------------------------------------------------------
// z [T,G]: G = 1: c_a = 1/(1 + e^−z), c_b = 1; G = 2: c_a = e^z0/(e^z0 + e^z1), c_b = 1 − c_a.
// out [T,M] = c_a·a + c_b·b.
inline void combine_coefficients(const Vec& z, std::size_t t, std::size_t G, double& ca, double& cb) {
  if (G == 1) {
    ca = 1.0 / (1.0 + std::exp(-z[t]));
    cb = 1.0;
  } else {
    ca = 1.0 / (1.0 + std::exp(z[2 * t + 1] - z[2 * t]));
    cb = 1.0 - ca;
  }
}

inline Vec gated_combine_forward(const Vec& z, const Vec& a, const Vec& b, std::size_t G) {
  const std::size_t T = z.size() / G, M = a.size() / T;
  Vec out(a.size());
  for (std::size_t t = 0; t < T; ++t) {
    double ca, cb;
    combine_coefficients(z, t, G, ca, cb);
    for (std::size_t c = 0; c < M; ++c) out[t * M + c] = ca * a[t * M + c] + cb * b[t * M + c];
  }
  return out;
}

// The gradients of Σ dy·out: da, db [T,M] and dz [T,G], by the chain rule through c_a, c_b.
inline void gated_combine_backward(const Vec& z, const Vec& a, const Vec& b, const Vec& dy, std::size_t G, Vec& da,
                                   Vec& db, Vec& dz) {
  const std::size_t T = z.size() / G, M = a.size() / T;
  da.assign(a.size(), 0.0);
  db.assign(a.size(), 0.0);
  dz.assign(z.size(), 0.0);
  for (std::size_t t = 0; t < T; ++t) {
    double ca, cb, pa = 0, pb = 0;
    combine_coefficients(z, t, G, ca, cb);
    for (std::size_t c = 0; c < M; ++c) {
      da[t * M + c] = ca * dy[t * M + c];
      db[t * M + c] = cb * dy[t * M + c];
      pa += dy[t * M + c] * a[t * M + c];
      pb += dy[t * M + c] * b[t * M + c];
    }
    if (G == 1) {
      dz[t] = pa * ca * (1 - ca);  // σ' = σ(1 − σ)
    } else {  // ∂c_a/∂z0 = c_a c_b = −∂c_a/∂z1, and c_b = 1 − c_a
      dz[2 * t] = (pa - pb) * ca * cb;
      dz[2 * t + 1] = -(pa - pb) * ca * cb;
    }
  }
}

// ---- cross-entropy -------------------------------------------------------------------------------
struct CrossEntropy {
  Vec losses, lse;  // [T], [T]
};

inline CrossEntropy cross_entropy_forward(const Vec& logits, const Ids& targets, std::int64_t V) {
  const std::size_t v = static_cast<std::size_t>(V), T = targets.size();
  CrossEntropy r{Vec(T), Vec(T)};
  for (std::size_t t = 0; t < T; ++t) {
    const double mx = *std::max_element(logits.begin() + static_cast<std::ptrdiff_t>(t * v),
                                        logits.begin() + static_cast<std::ptrdiff_t>((t + 1) * v));
    double sum = 0;
    for (std::size_t c = 0; c < v; ++c) sum += std::exp(logits[t * v + c] - mx);
    r.lse[t] = mx + std::log(sum);
    r.losses[t] = targets[t] < 0 ? 0.0 : r.lse[t] - logits[t * v + static_cast<std::size_t>(targets[t])];
  }
  return r;
}

// The gradient of scale · Σ_t losses[t].
inline Vec cross_entropy_backward(const Vec& logits, const Ids& targets, std::int64_t V, double scale) {
  const std::size_t v = static_cast<std::size_t>(V);
  const CrossEntropy f = cross_entropy_forward(logits, targets, V);
  Vec d(logits.size(), 0.0);
  for (std::size_t t = 0; t < targets.size(); ++t) {
    if (targets[t] < 0) continue;
    for (std::size_t c = 0; c < v; ++c)
      d[t * v + c] =
          scale * (std::exp(logits[t * v + c] - f.lse[t]) - (static_cast<std::int32_t>(c) == targets[t] ? 1.0 : 0.0));
  }
  return d;
}

// ---- optimizers -----------------------------------------------------------------------------------
// One step, in place. SGD: p −= lr (g + wd p). Adam with decoupled weight decay (Loshchilov &
// Hutter 2019): bias-corrected moments, step t from 1.
struct AdamState {
  Vec m, v;
};

inline void sgd_step(Vec& p, const Vec& g, double lr, double wd) {
  for (std::size_t i = 0; i < p.size(); ++i) p[i] -= lr * (g[i] + wd * p[i]);
}

inline void adam_step(Vec& p, const Vec& g, AdamState& s, std::int64_t t, double lr, double b1, double b2, double eps,
                      double wd) {
  if (s.m.empty()) s.m.assign(p.size(), 0.0), s.v.assign(p.size(), 0.0);
  for (std::size_t i = 0; i < p.size(); ++i) {
    s.m[i] = b1 * s.m[i] + (1 - b1) * g[i];
    s.v[i] = b2 * s.v[i] + (1 - b2) * g[i] * g[i];
    const double mh = s.m[i] / (1 - std::pow(b1, static_cast<double>(t)));
    const double vh = s.v[i] / (1 - std::pow(b2, static_cast<double>(t)));
    p[i] -= lr * (mh / (std::sqrt(vh) + eps) + wd * p[i]);
  }
}

}  // namespace moelab::blocks_ref
