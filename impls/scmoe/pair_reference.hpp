// impls/scmoe/pair_reference.hpp — a float64 reference of ScMoE's block pair, forward and
// backward, written the plain way from the paper's equations (scmoe.hpp) and sharing no code
// with the pair it checks: the block ops of harness/tests/blocks_reference.hpp, the MoE layer's
// dense reference (harness/tests/moe_reference.hpp, each token through its expert), and
// explicit matrix products. Checked by central finite differences in scmoe_test.cpp.
//
// Parameters by the names the pair's collect() gives them (layer l the dense block, L the MoE
// block; L = l at Pos-1, where there is no dense block):
//   layer{l}.attn_norm.gamma|beta  layer{l}.attn.wqkv [M,Q]  layer{l}.attn.wo [Hq·D,M]
//   layer{l}.mlp_norm.gamma|beta   layer{l}.mlp.w1 [M,F or 2F]  layer{l}.mlp.w2 [F,M]
//   layer{L}.attn_norm / attn.*    (the MoE block's attention)
//   layer{L}.se_norm.gamma|beta    layer{L}.shared_expert.w1|w2   layer{L}.moe_norm.gamma|beta
//   layer{L}.scmoe.w_cg [M,G]      layer{L}.moe.w_gate|w_noise [M,E]  moe.w1 [E,M,H]  moe.w2 [E,H,M]
#pragma once
#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "harness/config/model.hpp"
#include "harness/tests/blocks_reference.hpp"
#include "harness/tests/moe_reference.hpp"

namespace moelab::pair_ref {

using Vec = std::vector<double>;
using Named = std::map<std::string, Vec>;

// C [m,n] = op(A)·op(B); op(A) [m,k] (A [k,m] when ta), op(B) [k,n] (B [n,k] when tb).
inline Vec matmul(const Vec& A, const Vec& B, std::int64_t m, std::int64_t n, std::int64_t k, bool ta = false,
                  bool tb = false) {
  Vec C(static_cast<std::size_t>(m * n), 0.0);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (std::int64_t p = 0; p < k; ++p)
        s += A[static_cast<std::size_t>(ta ? p * m + i : i * k + p)] * B[static_cast<std::size_t>(tb ? j * k + p : p * n + j)];
      C[static_cast<std::size_t>(i * n + j)] = s;
    }
  return C;
}
inline void add_to(Vec& a, const Vec& b) {
  for (std::size_t i = 0; i < a.size(); ++i) a[i] += b[i];
}
inline Vec sum(Vec a, const Vec& b) {
  add_to(a, b);
  return a;
}

struct Result {
  Vec y;               // [T,M]
  double aux = 0;      // the routed MoE's auxiliary loss
  ref::Result moe;     // its routing (near-tie detector, counts)
  Vec dx;              // [T,M]
  Named grads;         // by parameter name, as collect() names them
};

// Forward, and with dy the backward of L = <dy, y> + grad_aux·aux. x [T,M]; eps [T,E] the gate
// noise the pair drew (noisy gate only).
inline Result pair(const TransformerConfig& cfg, int first_layer, const Named& P, const Vec& x, const Vec& eps,
                   const Vec* dy, double grad_aux) {
  const ShortcutConfig& sc = cfg.scmoe;
  const std::int64_t M = cfg.d_model, T = static_cast<std::int64_t>(x.size()) / M, D = cfg.head_dim();
  const std::int64_t HD = cfg.num_heads * D, Q = (cfg.num_heads + 2 * cfg.num_kv_heads) * D;
  const int l = first_layer, L = first_layer + sc.span() - 1;
  const bool ln = cfg.norm == NormKind::layernorm, swiglu = cfg.mlp == MlpKind::swiglu;
  const AttentionShape a = cfg.attention(T / cfg.seq_len);
  const auto p = [&](int layer, const std::string& what) -> const Vec& {
    static const Vec none;
    const auto it = P.find("layer" + std::to_string(layer) + "." + what);
    return it == P.end() ? none : it->second;
  };
  Result R;
  const auto grad = [&](int layer, const std::string& what) -> Vec& {
    Vec& g = R.grads["layer" + std::to_string(layer) + "." + what];
    if (g.empty()) g.assign(p(layer, what).size(), 0.0);
    return g;
  };
  const auto norm_f = [&](int layer, const std::string& nm, const Vec& in) {
    return blocks_ref::norm_forward(cfg.norm, cfg.norm_eps, in, M, p(layer, nm + ".gamma"), ln ? p(layer, nm + ".beta") : Vec{}).y;
  };
  const auto norm_b = [&](int layer, const std::string& nm, const Vec& in, const Vec& d_out) {
    Vec dx, dg, db;
    blocks_ref::norm_backward(cfg.norm, cfg.norm_eps, in, M, p(layer, nm + ".gamma"), d_out, dx, dg, db);
    add_to(grad(layer, nm + ".gamma"), dg);
    if (ln) add_to(grad(layer, nm + ".beta"), db);
    return dx;
  };
  // The attention block: y = x + attention(rope(norm(x)·Wqkv))·Wo.
  struct Attn {
    Vec in, n, qkv, o;
  };
  const auto attn_f = [&](int layer, const Vec& in, Attn& st) {
    st.in = in;
    st.n = norm_f(layer, "attn_norm", in);
    st.qkv = matmul(st.n, p(layer, "attn.wqkv"), T, Q, M);
    if (cfg.positions == PositionKind::rotary) st.qkv = blocks_ref::rope(a, cfg.rope_theta, false, st.qkv);
    st.o = blocks_ref::attention_forward(a, st.qkv).out;
    return sum(in, matmul(st.o, p(layer, "attn.wo"), T, M, HD));
  };
  const auto attn_b = [&](int layer, const Attn& st, const Vec& d) {
    add_to(grad(layer, "attn.wo"), matmul(st.o, d, HD, M, T, true));
    Vec dq = blocks_ref::attention_backward(a, st.qkv, matmul(d, p(layer, "attn.wo"), T, HD, M, false, true));
    if (cfg.positions == PositionKind::rotary) dq = blocks_ref::rope(a, cfg.rope_theta, true, dq);
    add_to(grad(layer, "attn.wqkv"), matmul(st.n, dq, M, Q, T, true));
    return sum(norm_b(layer, "attn_norm", st.in, matmul(dq, p(layer, "attn.wqkv"), T, M, Q, false, true)), d);
  };
  // The dense MLP without norm or residual: gelu(n·W1)·W2 or swiglu(n·W1)·W2.
  struct Mlp {
    Vec n, h, g;
  };
  const auto mlp_f = [&](int layer, const std::string& nm, std::int64_t F, const Vec& n, Mlp& st) {
    st.n = n;
    st.h = matmul(n, p(layer, nm + ".w1"), T, swiglu ? 2 * F : F, M);
    if (swiglu) {
      st.g = blocks_ref::swiglu_forward(st.h, F);
    } else {
      st.g = st.h;
      for (double& v : st.g) v = ref::act(Activation::gelu, v);
    }
    return matmul(st.g, p(layer, nm + ".w2"), T, M, F);
  };
  const auto mlp_b = [&](int layer, const std::string& nm, std::int64_t F, const Mlp& st, const Vec& d) {
    add_to(grad(layer, nm + ".w2"), matmul(st.g, d, F, M, T, true));
    const Vec dg = matmul(d, p(layer, nm + ".w2"), T, F, M, false, true);
    Vec dh;
    if (swiglu) {
      dh = blocks_ref::swiglu_backward(st.h, dg, F);
    } else {
      dh = dg;
      for (std::size_t i = 0; i < dh.size(); ++i) dh[i] *= ref::act_grad(Activation::gelu, st.h[i]);
    }
    const std::int64_t F1 = swiglu ? 2 * F : F;
    add_to(grad(layer, nm + ".w1"), matmul(st.n, dh, M, F1, T, true));
    return matmul(dh, p(layer, nm + ".w1"), T, M, F1, false, true);
  };

  // ---- forward ----
  Attn att_d, att_m;
  Mlp mlp_d, se;
  Vec h = x;
  if (sc.position == ShortcutPosition::pos2) h = attn_f(l, h, att_d);
  const Vec shortcut = h;  // Pos-1, Pos-3: the pair's input; Pos-2: H_l^MH
  const Vec n_r = norm_f(L, "moe_norm", shortcut);
  ref::Params mp;
  mp.M = M;
  mp.H = cfg.moe.d_hidden;
  mp.E = cfg.moe.num_experts;
  mp.wg = p(L, "moe.w_gate");
  mp.wn = p(L, "moe.w_noise");
  mp.w1 = p(L, "moe.w1");
  mp.w2 = p(L, "moe.w2");
  if (sc.position == ShortcutPosition::pos3) h = attn_f(l, h, att_d);
  Vec h_mlp_in;
  if (sc.span() == 2) {
    h_mlp_in = h;
    h = sum(h, mlp_f(l, "mlp", cfg.d_ffn, norm_f(l, "mlp_norm", h), mlp_d));
  }
  const Vec h_mh = attn_f(L, h, att_m);  // H_{l+1}^MH
  const Vec n_se = norm_f(L, "se_norm", h_mh);
  const Vec s = mlp_f(L, "shared_expert", cfg.shared_expert_hidden, n_se, se);
  // The routed MoE, with the backward of <d_r, r> + grad_aux·aux when dy is given.
  const std::int64_t G = sc.gate_width();
  const Vec z = G ? matmul(n_se, p(L, "scmoe.w_cg"), T, G, M) : Vec{};
  const auto coef = [&](std::int64_t t, double& ca, double& cb) {
    if (G == 0) {
      ca = cb = 1.0;
    } else if (G == 1) {
      ca = 1.0 / (1.0 + std::exp(-z[static_cast<std::size_t>(t)]));
      cb = 1.0;
    } else {
      const double z0 = z[static_cast<std::size_t>(2 * t)], z1 = z[static_cast<std::size_t>(2 * t + 1)];
      ca = 1.0 / (1.0 + std::exp(z1 - z0));
      cb = 1.0 - ca;
    }
  };
  Vec d_r(static_cast<std::size_t>(T * M), 0.0);
  if (dy)
    for (std::int64_t t = 0; t < T; ++t) {
      double ca, cb;
      coef(t, ca, cb);
      for (std::int64_t c = 0; c < M; ++c) d_r[static_cast<std::size_t>(t * M + c)] = cb * (*dy)[static_cast<std::size_t>(t * M + c)];
    }
  ref::Grads mg;
  mg.init(mp, T);
  R.moe = ref::forward_backward(cfg.moe, mp, n_r, eps, dy ? &d_r : nullptr, grad_aux, dy ? &mg : nullptr);
  R.aux = R.moe.aux;
  const Vec& r = R.moe.y;
  R.y = h_mh;
  for (std::int64_t t = 0; t < T; ++t) {
    double ca, cb;
    coef(t, ca, cb);
    for (std::int64_t c = 0; c < M; ++c) {
      const auto i = static_cast<std::size_t>(t * M + c);
      R.y[i] += ca * s[i] + cb * r[i];
    }
  }
  if (!dy) return R;

  // ---- backward ----
  add_to(grad(L, "moe.w_gate"), mg.dwg);
  if (cfg.moe.noisy_gate) add_to(grad(L, "moe.w_noise"), mg.dwn);
  add_to(grad(L, "moe.w1"), mg.dw1);
  add_to(grad(L, "moe.w2"), mg.dw2);
  const Vec d_short = norm_b(L, "moe_norm", shortcut, mg.dx);
  Vec d_s(static_cast<std::size_t>(T * M)), dz(static_cast<std::size_t>(T * G), 0.0);
  for (std::int64_t t = 0; t < T; ++t) {
    double ca, cb, pa = 0, pb = 0;
    coef(t, ca, cb);
    for (std::int64_t c = 0; c < M; ++c) {
      const auto i = static_cast<std::size_t>(t * M + c);
      d_s[i] = ca * (*dy)[i];
      pa += (*dy)[i] * s[i];
      pb += (*dy)[i] * r[i];
    }
    if (G == 1) dz[static_cast<std::size_t>(t)] = ca * (1 - ca) * pa;  // d sigmoid
    if (G == 2) {  // d softmax: dz_i = c_i (p_i − Σ_j c_j p_j)
      const double mean = ca * pa + cb * pb;
      dz[static_cast<std::size_t>(2 * t)] = ca * (pa - mean);
      dz[static_cast<std::size_t>(2 * t + 1)] = cb * (pb - mean);
    }
  }
  Vec d_n_se = mlp_b(L, "shared_expert", cfg.shared_expert_hidden, se, d_s);
  if (G) {
    add_to(grad(L, "scmoe.w_cg"), matmul(n_se, dz, M, G, T, true));
    add_to(d_n_se, matmul(dz, p(L, "scmoe.w_cg"), T, M, G, false, true));
  }
  Vec g = sum(*dy, norm_b(L, "se_norm", h_mh, d_n_se));  // H_{l+1}^MH
  g = attn_b(L, att_m, g);
  if (sc.span() == 2) g = sum(g, norm_b(l, "mlp_norm", h_mlp_in, mlp_b(l, "mlp", cfg.d_ffn, mlp_d, g)));
  if (sc.position == ShortcutPosition::pos3) g = attn_b(l, att_d, g);
  add_to(g, d_short);
  if (sc.position == ShortcutPosition::pos2) g = attn_b(l, att_d, g);
  R.dx = g;
  return R;
}

}  // namespace moelab::pair_ref
