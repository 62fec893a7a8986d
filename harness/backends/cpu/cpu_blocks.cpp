// harness/backends/cpu/cpu_blocks.cpp — the cpu backend's transformer-block ops: embedding,
// layernorm / rmsnorm, RoPE, tiled attention, SwiGLU, add, scale, gated combine, fused
// cross-entropy, SGD / Adam.
//
// The reference semantics of Backend's "transformer-block ops" (backend.hpp): fp32 data,
// plain loops, reductions in fp32; attention is the one op with GEMMs inside (cpu_sgemm on
// packed tiles). Each op is one task on its stream (CpuBackend::enqueue) carrying the op's
// cost descriptor from harness/runtime/cost.cpp. Checked against the float64 reference in
// harness/tests/blocks_reference.hpp by harness/tests/blocks_ops_test.cpp:
//   ctest --test-dir build -R blocks_ops --output-on-failure
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "harness/backends/cpu/cpu_backend.hpp"
#include "harness/runtime/error.hpp"

namespace moelab {

namespace {

void require_shape(const Tensor& t, std::initializer_list<std::int64_t> shape, const char* op, const char* what) {
  MOELAB_CHECK(t.defined() && t.shape() == std::vector<std::int64_t>(shape),
               std::string(op) + ": " + what + " should be " + shape_str(shape) + ", got " +
                   (t.defined() ? t.describe() : std::string("undefined")));
}

void require_i32(const Tensor& t, std::int64_t n, const char* op, const char* what) {
  MOELAB_CHECK(t.defined() && t.dtype() == DType::i32 && t.numel() == n,
               std::string(op) + ": " + what + " should be [" + std::to_string(n) + "] int32, got " +
                   (t.defined() ? t.describe() : std::string("undefined")));
}

// The vocabulary a table of `rows` rows is a shard of: [start, start + rows) of total.
struct Vocab {
  std::int64_t start, rows, total;
  bool known(std::int64_t id) const { return id >= 0 && id < total; }
  bool mine(std::int64_t id) const { return id >= start && id < start + rows; }
};
Vocab vocab_of(const VocabShard& shard, std::int64_t rows, const char* op) {
  const Vocab v{shard.start, rows, shard.total > 0 ? shard.total : rows};
  MOELAB_CHECK(v.start >= 0 && v.start + rows <= v.total,
               std::string(op) + ": rows [" + std::to_string(v.start) + ", " + std::to_string(v.start + rows) +
                   ") are not in a vocabulary of " + std::to_string(v.total));
  return v;
}

// Optional tensors (wpe, beta, d_beta, ...) are null pointers when undefined.
template <class T>
T* ptr_or_null(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}

}  // namespace

// ---- embedding -------------------------------------------------------------------------------

void CpuBackend::embedding_forward(Stream& s, const Tensor& ids, const Tensor& wte, const Tensor& wpe,
                                   std::int64_t seq_len, Tensor& out, const VocabShard& shard) {
  cpu_require_f32(wte, "embedding_forward");
  const std::int64_t T = ids.numel(), M = wte.dim(1);
  const Vocab vocab = vocab_of(shard, wte.dim(0), "embedding_forward");
  require_i32(ids, T, "embedding_forward", "ids");
  require_shape(out, {T, M}, "embedding_forward", "out");
  MOELAB_CHECK(seq_len >= 1, "embedding_forward: seq_len " + std::to_string(seq_len));
  if (wpe.defined()) {
    cpu_require_f32(wpe, "embedding_forward");
    MOELAB_CHECK(wpe.ndim() == 2 && wpe.dim(1) == M && wpe.dim(0) >= std::min(seq_len, T),
                 "embedding_forward: wpe " + wpe.describe() + " for seq_len " + std::to_string(seq_len));
  }
  const std::int32_t* id = ids.data<std::int32_t>();
  const float *te = wte.data<float>(), *pe = ptr_or_null<float>(wpe);
  float* o = out.data<float>();
  enqueue(s, "embedding", cost_embedding_forward(T, M, pe != nullptr, DType::f32), [=] {
    for (std::int64_t t = 0; t < T; ++t) {
      if (!vocab.known(id[t]))
        throw ConfigError("embedding: token id " + std::to_string(id[t]) + " at position " + std::to_string(t) +
                          " is outside the vocabulary of " + std::to_string(vocab.total));
      float* y = o + t * M;
      if (!vocab.mine(id[t])) {  // another shard's row: zeros (+ the position)
        for (std::int64_t c = 0; c < M; ++c) y[c] = pe ? pe[(t % seq_len) * M + c] : 0.0f;
        continue;
      }
      const float* row = te + (id[t] - vocab.start) * M;
      if (pe) {
        const float* pos = pe + (t % seq_len) * M;
        for (std::int64_t c = 0; c < M; ++c) y[c] = row[c] + pos[c];
      } else {
        std::memcpy(y, row, static_cast<std::size_t>(M) * sizeof(float));
      }
    }
  });
}

void CpuBackend::embedding_backward(Stream& s, const Tensor& d_out, const Tensor& ids, std::int64_t seq_len,
                                    Tensor& d_wte, Tensor& d_wpe, const VocabShard& shard) {
  cpu_require_f32(d_out, "embedding_backward");
  const std::int64_t T = ids.numel(), M = d_wte.dim(1);
  const Vocab vocab = vocab_of(shard, d_wte.dim(0), "embedding_backward");
  require_i32(ids, T, "embedding_backward", "ids");
  require_shape(d_out, {T, M}, "embedding_backward", "d_out");
  MOELAB_CHECK(seq_len >= 1, "embedding_backward: seq_len " + std::to_string(seq_len));
  if (d_wpe.defined())
    MOELAB_CHECK(d_wpe.ndim() == 2 && d_wpe.dim(1) == M && d_wpe.dim(0) >= std::min(seq_len, T),
                 "embedding_backward: d_wpe " + d_wpe.describe() + " for seq_len " + std::to_string(seq_len));
  const std::int32_t* id = ids.data<std::int32_t>();
  const float* g = d_out.data<float>();
  float *dte = d_wte.data<float>(), *dpe = ptr_or_null<float>(d_wpe);
  enqueue(s, "embedding_bwd", cost_embedding_backward(T, M, dpe != nullptr, DType::f32), [=] {
    for (std::int64_t t = 0; t < T; ++t) {
      if (!vocab.known(id[t]))
        throw ConfigError("embedding: token id " + std::to_string(id[t]) + " at position " + std::to_string(t) +
                          " is outside the vocabulary of " + std::to_string(vocab.total));
      const float* row = g + t * M;
      if (vocab.mine(id[t])) {
        float* dw = dte + (id[t] - vocab.start) * M;
        for (std::int64_t c = 0; c < M; ++c) dw[c] += row[c];
      }
      if (dpe) {
        float* dp = dpe + (t % seq_len) * M;
        for (std::int64_t c = 0; c < M; ++c) dp[c] += row[c];
      }
    }
  });
}

// ---- layernorm / rmsnorm -------------------------------------------------------------------
// Layernorm (Ba et al. 2016) normalises by the row's mean and biased variance; RMSNorm (Zhang &
// Sennrich 2019) by the root mean square only. Backward with x̂ = (x − mean)·rstd (x·rstd for
// RMSNorm) and g = dy·γ:
//   layernorm  dx = rstd · (g − mean(g) − x̂ · mean(g·x̂))
//   rmsnorm    dx = rstd · (g − x̂ · mean(g·x̂))
//   dγ += Σ_t dy·x̂,  dβ += Σ_t dy

void CpuBackend::norm_forward(Stream& s, NormKind kind, float eps, const Tensor& x, const Tensor& gamma,
                              const Tensor& beta, Tensor& y, Tensor& mean, Tensor& rstd) {
  cpu_require_f32(x, "norm_forward");
  const std::int64_t T = x.dim(0), M = x.dim(1);
  const bool ln = kind == NormKind::layernorm;
  require_shape(gamma, {M}, "norm_forward", "gamma");
  if (beta.defined()) require_shape(beta, {M}, "norm_forward", "beta");
  require_shape(y, {T, M}, "norm_forward", "y");
  require_shape(rstd, {T}, "norm_forward", "rstd");
  if (ln) require_shape(mean, {T}, "norm_forward", "mean");
  const float *xp = x.data<float>(), *gp = gamma.data<float>(), *bp = ln ? ptr_or_null<float>(beta) : nullptr;
  float *yp = y.data<float>(), *mp = ln ? mean.data<float>() : nullptr, *rp = rstd.data<float>();
  enqueue(s, norm_name(kind), cost_norm_forward(kind, T, M, DType::f32), [=] {
    const float inv_m = 1.0f / static_cast<float>(M);
    for (std::int64_t t = 0; t < T; ++t) {
      const float* row = xp + t * M;
      float mu = 0.0f;
      if (ln) {
        for (std::int64_t c = 0; c < M; ++c) mu += row[c];
        mu *= inv_m;
      }
      float ss = 0.0f;  // Σ (x − mean)² (two passes: no cancellation)
      for (std::int64_t c = 0; c < M; ++c) ss += (row[c] - mu) * (row[c] - mu);
      const float r = 1.0f / std::sqrt(ss * inv_m + eps);
      float* out = yp + t * M;
      for (std::int64_t c = 0; c < M; ++c) out[c] = (row[c] - mu) * r * gp[c] + (bp ? bp[c] : 0.0f);
      if (mp) mp[t] = mu;
      rp[t] = r;
    }
  });
}

void CpuBackend::norm_backward(Stream& s, NormKind kind, const Tensor& x, const Tensor& gamma, const Tensor& mean,
                               const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor& d_gamma, Tensor& d_beta) {
  cpu_require_f32(x, "norm_backward");
  const std::int64_t T = x.dim(0), M = x.dim(1);
  const bool ln = kind == NormKind::layernorm;
  require_shape(gamma, {M}, "norm_backward", "gamma");
  require_shape(rstd, {T}, "norm_backward", "rstd");
  if (ln) require_shape(mean, {T}, "norm_backward", "mean");
  require_shape(dy, {T, M}, "norm_backward", "dy");
  require_shape(dx, {T, M}, "norm_backward", "dx");
  if (d_gamma.defined()) require_shape(d_gamma, {M}, "norm_backward", "d_gamma");
  if (d_beta.defined()) require_shape(d_beta, {M}, "norm_backward", "d_beta");
  const float *xp = x.data<float>(), *gp = gamma.data<float>(), *mp = ln ? mean.data<float>() : nullptr,
              *rp = rstd.data<float>(), *dyp = dy.data<float>();
  float *dxp = dx.data<float>(), *dgp = ptr_or_null<float>(d_gamma), *dbp = ptr_or_null<float>(d_beta);
  enqueue(s, std::string(norm_name(kind)) + "_bwd", cost_norm_backward(kind, T, M, DType::f32), [=] {
    const float inv_m = 1.0f / static_cast<float>(M);
    for (std::int64_t t = 0; t < T; ++t) {
      const float *row = xp + t * M, *g = dyp + t * M;
      const float mu = mp ? mp[t] : 0.0f, r = rp[t];
      float sum_g = 0.0f, sum_gx = 0.0f;
      for (std::int64_t c = 0; c < M; ++c) {
        const float gc = g[c] * gp[c], xh = (row[c] - mu) * r;
        sum_g += gc;
        sum_gx += gc * xh;
      }
      const float mean_g = ln ? sum_g * inv_m : 0.0f, mean_gx = sum_gx * inv_m;
      float* out = dxp + t * M;
      for (std::int64_t c = 0; c < M; ++c) {
        const float xh = (row[c] - mu) * r;
        if (dgp) dgp[c] += g[c] * xh;
        if (dbp) dbp[c] += g[c];
        out[c] = r * (g[c] * gp[c] - mean_g - xh * mean_gx);  // after reading g: dx may alias dy
      }
    }
  });
}

// ---- rotary position embedding ---------------------------------------------------------------
// RoFormer (Su et al. 2021, Eq. 34) with LLaMA's pairing: dimension i of a head turns with
// dimension i + D/2 by the angle p·θ^(−2i/D), p the token's position in its sequence. The
// angles are computed in float64: p·freq in fp32 would be off by ~1e-4 rad at p = 2048.

void CpuBackend::rope(Stream& s, const AttentionShape& a, float theta, bool inverse, Tensor& qkv) {
  cpu_require_f32(qkv, "rope");
  const std::int64_t T = a.tokens(), W = a.qkv_width(), S = a.seq;
  const int D = a.head_dim, heads = a.heads + a.kv_heads;
  require_shape(qkv, {T, W}, "rope", "qkv");
  MOELAB_CHECK(D % 2 == 0, "rope: head_dim " + std::to_string(D) + " must be even");
  float* q = qkv.data<float>();
  const double th = theta;
  enqueue(s, inverse ? "rope_inverse" : "rope", cost_rope(a, DType::f32), [=] {
    const auto half = static_cast<std::size_t>(D / 2);
    std::vector<double> freq(half);
    for (std::size_t i = 0; i < half; ++i) freq[i] = std::pow(th, -2.0 * static_cast<double>(i) / D);
    std::vector<float> cs(half), sn(half);
    for (std::int64_t t = 0; t < T; ++t) {
      const double p = static_cast<double>(t % S);
      for (std::size_t i = 0; i < half; ++i) {
        const double ang = p * freq[i];
        cs[i] = static_cast<float>(std::cos(ang));
        sn[i] = static_cast<float>(inverse ? -std::sin(ang) : std::sin(ang));
      }
      for (int h = 0; h < heads; ++h) {  // the query heads, then the key heads
        float* v = q + t * W + static_cast<std::int64_t>(h) * D;
        for (std::size_t i = 0; i < half; ++i) {
          const float x0 = v[i], x1 = v[i + half], c = cs[i], sv = sn[i];
          v[i] = x0 * c - x1 * sv;
          v[i + half] = x1 * c + x0 * sv;
        }
      }
    }
  });
}

// ---- attention ---------------------------------------------------------------------------------
// FlashAttention (Dao et al. 2022, Alg. 1) forward and FlashAttention-2 (Dao 2023, Alg. 2)
// backward, one (sequence, query head) at a time. Query tiles of kTile rows meet key tiles of
// kTile columns; a tile's scores live only in a [kTile, kTile] scratch, softmax runs online
// (a running max m and sum l per query row, the output rescaled by exp(m_old − m_new) whenever
// the max grows), and the forward keeps lse = m + log l for the backward, which recomputes
// P = exp(S − lse) tile by tile. The GEMMs inside a tile are cpu_sgemm on packed copies of the
// tile's rows (the packed qkv rows are strided).

namespace {

constexpr std::int64_t kTile = kAttentionTileRows;

// Where one (sequence b, head) sits in the packed qkv [T, (Hq+2Hkv)*D] tensor.
struct Heads {
  const AttentionShape& a;
  std::int64_t width() const { return a.qkv_width(); }
  std::int64_t group() const { return a.heads / a.kv_heads; }
  std::int64_t q_col(int h) const { return static_cast<std::int64_t>(h) * a.head_dim; }
  std::int64_t k_col(int h) const { return (a.heads + h / group()) * static_cast<std::int64_t>(a.head_dim); }
  std::int64_t v_col(int h) const {
    return (a.heads + a.kv_heads + h / group()) * static_cast<std::int64_t>(a.head_dim);
  }
};

// rows [r0, r0+n) of the D columns at `col` of a row-major matrix of row stride `ld`, packed.
void pack(const float* m, std::int64_t ld, std::int64_t col, std::int64_t r0, std::int64_t n, std::int64_t D,
          float* out) {
  for (std::int64_t r = 0; r < n; ++r)
    std::memcpy(out + r * D, m + (r0 + r) * ld + col, static_cast<std::size_t>(D) * sizeof(float));
}

// The key range a query tile [i0, i0+rows) visits: all keys, or those up to its last row.
std::int64_t keys_visited(const AttentionShape& a, std::int64_t i0, std::int64_t rows) {
  return a.causal ? i0 + rows : a.seq;
}

void check_attention(const AttentionShape& a, const char* op) {
  MOELAB_CHECK(a.batch >= 1 && a.seq >= 1 && a.head_dim >= 1 && a.kv_heads >= 1 && a.heads % a.kv_heads == 0,
               std::string(op) + ": bad shape B=" + std::to_string(a.batch) + " S=" + std::to_string(a.seq) + " Hq=" +
                   std::to_string(a.heads) + " Hkv=" + std::to_string(a.kv_heads) + " D=" + std::to_string(a.head_dim));
}

}  // namespace

void CpuBackend::attention_forward(Stream& s, const AttentionShape& a, const Tensor& qkv, Tensor& out, Tensor& lse) {
  check_attention(a, "attention_forward");
  cpu_require_f32(qkv, "attention_forward");
  const std::int64_t T = a.tokens(), S = a.seq, D = a.head_dim, Hq = a.heads;
  require_shape(qkv, {T, a.qkv_width()}, "attention_forward", "qkv");
  require_shape(out, {T, Hq * D}, "attention_forward", "out");
  require_shape(lse, {a.batch, Hq, S}, "attention_forward", "lse");
  // Scratch of one query tile, independent of S: Q, K, V tiles, scores, output accumulator,
  // running max and sum. It lives inside the op, as a GPU kernel's tiles live in shared
  // memory and registers: not tracked, so that attention's memory (inputs, outputs, the saved
  // lse) is the same on every backend.
  const std::int64_t tile_d = kTile * D;
  const auto scratch_floats = static_cast<std::size_t>(4 * tile_d + kTile * kTile + 2 * kTile);
  const float* x = qkv.data<float>();
  float *o = out.data<float>(), *lp = lse.data<float>();
  enqueue(s, "attention", cost_attention_forward(a, DType::f32), [=] {
    std::vector<float> scratch(scratch_floats);
    float* ws = scratch.data();
    const Heads hd{a};
    const std::int64_t W = hd.width();
    const float scale = 1.0f / std::sqrt(static_cast<float>(D)), neg_inf = -std::numeric_limits<float>::infinity();
    float *qt = ws, *kt = qt + tile_d, *vt = kt + tile_d, *acc = vt + tile_d, *sc = acc + tile_d,
          *mx = sc + kTile * kTile, *sum = mx + kTile;
    for (std::int64_t b = 0; b < a.batch; ++b)
      for (int h = 0; h < Hq; ++h) {
        const float* xb = x + b * S * W;
        for (std::int64_t i0 = 0; i0 < S; i0 += kTile) {
          const std::int64_t rows = std::min(kTile, S - i0), kv_end = keys_visited(a, i0, rows);
          pack(xb, W, hd.q_col(h), i0, rows, D, qt);
          std::fill(acc, acc + rows * D, 0.0f);
          std::fill(mx, mx + rows, neg_inf);
          std::fill(sum, sum + rows, 0.0f);
          for (std::int64_t j0 = 0; j0 < kv_end; j0 += kTile) {
            const std::int64_t cols = std::min(kTile, kv_end - j0);
            pack(xb, W, hd.k_col(h), j0, cols, D, kt);
            pack(xb, W, hd.v_col(h), j0, cols, D, vt);
            cpu_sgemm(false, true, rows, cols, D, scale, qt, kt, 0.0f, sc);  // S = Q K^T / sqrt(D)
            for (std::int64_t r = 0; r < rows; ++r) {
              float* srow = sc + r * cols;
              // causal: key j0+c is visible to query i0+r iff j0+c <= i0+r
              const std::int64_t visible = a.causal ? std::clamp<std::int64_t>(i0 + r - j0 + 1, 0, cols) : cols;
              float m_new = mx[r];
              for (std::int64_t c = 0; c < visible; ++c) m_new = std::max(m_new, srow[c]);
              if (m_new == neg_inf) {  // nothing visible yet in this row
                std::fill(srow, srow + cols, 0.0f);
                continue;
              }
              float row_sum = 0.0f;
              for (std::int64_t c = 0; c < visible; ++c) row_sum += (srow[c] = std::exp(srow[c] - m_new));
              std::fill(srow + visible, srow + cols, 0.0f);
              const float corr = std::exp(mx[r] - m_new);  // 0 when mx was -inf
              sum[r] = sum[r] * corr + row_sum;
              mx[r] = m_new;
              for (std::int64_t d = 0; d < D; ++d) acc[r * D + d] *= corr;
            }
            cpu_sgemm(false, false, rows, D, cols, 1.0f, sc, vt, 1.0f, acc);  // O += P V
          }
          for (std::int64_t r = 0; r < rows; ++r) {
            const std::int64_t t = b * S + i0 + r;
            float* orow = o + t * Hq * D + h * D;
            for (std::int64_t d = 0; d < D; ++d) orow[d] = acc[r * D + d] / sum[r];
            lp[(b * Hq + h) * S + i0 + r] = mx[r] + std::log(sum[r]);
          }
        }
      }
  });
}

void CpuBackend::attention_backward(Stream& s, const AttentionShape& a, const Tensor& qkv, const Tensor& out,
                                    const Tensor& lse, const Tensor& d_out, Tensor& d_qkv) {
  check_attention(a, "attention_backward");
  cpu_require_f32(qkv, "attention_backward");
  const std::int64_t T = a.tokens(), S = a.seq, D = a.head_dim, Hq = a.heads, W = a.qkv_width();
  require_shape(qkv, {T, W}, "attention_backward", "qkv");
  require_shape(out, {T, Hq * D}, "attention_backward", "out");
  require_shape(lse, {a.batch, Hq, S}, "attention_backward", "lse");
  require_shape(d_out, {T, Hq * D}, "attention_backward", "d_out");
  require_shape(d_qkv, {T, W}, "attention_backward", "d_qkv");
  // Scratch: K, V, dK, dV of one key tile, Q and dO of one query tile, P and dP of one tile
  // pair, and, per query head, D = rowsum(dO∘O) [S] and the dQ accumulator [S, D].
  // Not tracked, as in the forward.
  const std::int64_t tile_d = kTile * D;
  const auto scratch_floats = static_cast<std::size_t>(6 * tile_d + 2 * kTile * kTile + S + S * D);
  const float *x = qkv.data<float>(), *o = out.data<float>(), *lp = lse.data<float>(), *dop = d_out.data<float>();
  float* dx = d_qkv.data<float>();
  enqueue(s, "attention_bwd", cost_attention_backward(a, DType::f32), [=] {
    std::vector<float> scratch(scratch_floats);
    float* ws = scratch.data();
    const Heads hd{a};
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    float *kt = ws, *vt = kt + tile_d, *dkt = vt + tile_d, *dvt = dkt + tile_d, *qt = dvt + tile_d, *dot = qt + tile_d,
          *p = dot + tile_d, *dp = p + kTile * kTile, *dsum = dp + kTile * kTile, *dq = dsum + S;
    std::fill(dx, dx + T * W, 0.0f);  // d_qkv is overwritten; K/V heads gather from their query heads
    for (std::int64_t b = 0; b < a.batch; ++b)
      for (int h = 0; h < Hq; ++h) {
        // sequence b: qkv and d_qkv rows of stride W, out and d_out rows of stride Hq*D
        const float *xb = x + b * S * W, *ob = o + b * S * Hq * D, *dob = dop + b * S * Hq * D;
        const float* lrow = lp + (b * Hq + h) * S;
        float* dxb = dx + b * S * W;
        for (std::int64_t i = 0; i < S; ++i) {  // D_i = rowsum(dO ∘ O) (FlashAttention-2, Alg. 2 line 4)
          const float *dor = dob + i * Hq * D + h * D, *orow = ob + i * Hq * D + h * D;
          float acc = 0.0f;
          for (std::int64_t d = 0; d < D; ++d) acc += dor[d] * orow[d];
          dsum[i] = acc;
        }
        std::fill(dq, dq + S * D, 0.0f);
        for (std::int64_t j0 = 0; j0 < S; j0 += kTile) {  // key tiles outside, query tiles inside
          const std::int64_t cols = std::min(kTile, S - j0);
          pack(xb, W, hd.k_col(h), j0, cols, D, kt);
          pack(xb, W, hd.v_col(h), j0, cols, D, vt);
          std::fill(dkt, dkt + cols * D, 0.0f);
          std::fill(dvt, dvt + cols * D, 0.0f);
          // causal: query tiles before key tile j0's diagonal tile see none of its keys
          for (std::int64_t i0 = a.causal ? j0 : 0; i0 < S; i0 += kTile) {
            const std::int64_t rows = std::min(kTile, S - i0);
            pack(xb, W, hd.q_col(h), i0, rows, D, qt);
            pack(dob, Hq * D, h * D, i0, rows, D, dot);
            cpu_sgemm(false, true, rows, cols, D, scale, qt, kt, 0.0f, p);  // S = Q K^T / sqrt(D)
            for (std::int64_t r = 0; r < rows; ++r) {                       // P = exp(S − lse)
              const std::int64_t visible = a.causal ? std::clamp<std::int64_t>(i0 + r - j0 + 1, 0, cols) : cols;
              float* prow = p + r * cols;
              for (std::int64_t c = 0; c < visible; ++c) prow[c] = std::exp(prow[c] - lrow[i0 + r]);
              std::fill(prow + visible, prow + cols, 0.0f);
            }
            cpu_sgemm(true, false, cols, D, rows, 1.0f, p, dot, 1.0f, dvt);  // dV += P^T dO
            cpu_sgemm(false, true, rows, cols, D, 1.0f, dot, vt, 0.0f, dp);  // dP = dO V^T
            for (std::int64_t r = 0; r < rows; ++r)                          // dS = P ∘ (dP − D)
              for (std::int64_t c = 0; c < cols; ++c)
                dp[r * cols + c] = p[r * cols + c] * (dp[r * cols + c] - dsum[i0 + r]);
            cpu_sgemm(false, false, rows, D, cols, scale, dp, kt, 1.0f, dq + i0 * D);  // dQ += dS K / sqrt(D)
            cpu_sgemm(true, false, cols, D, rows, scale, dp, qt, 1.0f, dkt);           // dK += dS^T Q / sqrt(D)
          }
          for (std::int64_t c = 0; c < cols; ++c) {
            float *dk = dxb + (j0 + c) * W + hd.k_col(h), *dv = dxb + (j0 + c) * W + hd.v_col(h);
            for (std::int64_t d = 0; d < D; ++d) {
              dk[d] += dkt[c * D + d];
              dv[d] += dvt[c * D + d];
            }
          }
        }
        for (std::int64_t i = 0; i < S; ++i)
          std::memcpy(dxb + i * W + hd.q_col(h), dq + i * D, static_cast<std::size_t>(D) * sizeof(float));
      }
  });
}

// ---- SwiGLU, add ---------------------------------------------------------------------------
// SwiGLU (Shazeer 2020, Eq. 6 without biases): out = silu(g)·u, silu(g) = g·σ(g); so
// du = dy·silu(g) and dg = dy·u·σ(g)·(1 + g·(1 − σ(g))).

void CpuBackend::swiglu_forward(Stream& s, const Tensor& h, Tensor& out) {
  cpu_require_f32(h, "swiglu_forward");
  const std::int64_t T = h.dim(0), F = h.dim(1) / 2;
  MOELAB_CHECK(h.dim(1) == 2 * F, "swiglu_forward: h " + h.describe() + " must have an even width");
  require_shape(out, {T, F}, "swiglu_forward", "out");
  const float* hp = h.data<float>();
  float* op = out.data<float>();
  enqueue(s, "swiglu", cost_swiglu_forward(T, F, DType::f32), [=] {
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t f = 0; f < F; ++f) {
        const float g = hp[t * 2 * F + f], u = hp[t * 2 * F + F + f];
        op[t * F + f] = g / (1.0f + std::exp(-g)) * u;
      }
  });
}

void CpuBackend::swiglu_backward(Stream& s, const Tensor& h, const Tensor& d_out, Tensor& d_h) {
  cpu_require_f32(h, "swiglu_backward");
  const std::int64_t T = h.dim(0), F = h.dim(1) / 2;
  require_shape(d_out, {T, F}, "swiglu_backward", "d_out");
  require_shape(d_h, {T, 2 * F}, "swiglu_backward", "d_h");
  const float *hp = h.data<float>(), *dy = d_out.data<float>();
  float* dh = d_h.data<float>();
  enqueue(s, "swiglu_bwd", cost_swiglu_backward(T, F, DType::f32), [=] {
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t f = 0; f < F; ++f) {
        const float g = hp[t * 2 * F + f], u = hp[t * 2 * F + F + f], d = dy[t * F + f];
        const float sig = 1.0f / (1.0f + std::exp(-g));
        dh[t * 2 * F + f] = d * u * sig * (1.0f + g * (1.0f - sig));
        dh[t * 2 * F + F + f] = d * g * sig;
      }
  });
}

void CpuBackend::add(Stream& s, const Tensor& a, const Tensor& b, Tensor& out) {
  cpu_require_f32(a, "add");
  MOELAB_CHECK(a.numel() == b.numel() && a.numel() == out.numel() && b.dtype() == a.dtype() && out.dtype() == a.dtype(),
               "add " + a.describe() + " + " + b.describe() + " -> " + out.describe());
  const float *ap = a.data<float>(), *bp = b.data<float>();
  float* op = out.data<float>();
  const std::int64_t n = a.numel();
  enqueue(s, "add", cost_add(n, DType::f32), [=] {
    for (std::int64_t i = 0; i < n; ++i) op[i] = ap[i] + bp[i];
  });
}

// ---- gated combine (ScMoE's CG-1 / CG-2) ----------------------------------------------------------
// The gate values of a row from its logits: G = 1 sigmoid and 1, G = 2 a softmax of two (the
// larger logit subtracted, so exp never overflows).
namespace {
void combine_coefficients(const float* z, std::int64_t G, float& ca, float& cb) {
  if (G == 1) {
    ca = 1.0f / (1.0f + std::exp(-z[0]));
    cb = 1.0f;
  } else {
    const float m = std::max(z[0], z[1]), ea = std::exp(z[0] - m), eb = std::exp(z[1] - m);
    ca = ea / (ea + eb);
    cb = eb / (ea + eb);
  }
}

std::int64_t combine_gates(const Tensor& z, std::int64_t T, const char* op) {
  MOELAB_CHECK(z.defined() && z.dtype() == DType::f32 && z.ndim() == 2 && z.dim(0) == T && (z.dim(1) == 1 || z.dim(1) == 2),
               std::string(op) + ": z should be [" + std::to_string(T) + ",1 or 2] fp32, got " +
                   (z.defined() ? z.describe() : std::string("undefined")));
  return z.dim(1);
}
}  // namespace

void CpuBackend::gated_combine_forward(Stream& s, const Tensor& z, const Tensor& a, const Tensor& b, Tensor& out) {
  cpu_require_f32(a, "gated_combine_forward");
  MOELAB_CHECK(a.ndim() == 2, "gated_combine_forward: a " + a.describe() + " should be [T,M]");
  const std::int64_t T = a.dim(0), M = a.dim(1), G = combine_gates(z, T, "gated_combine_forward");
  require_shape(b, {T, M}, "gated_combine_forward", "b");
  require_shape(out, {T, M}, "gated_combine_forward", "out");
  const float *zp = z.data<float>(), *ap = a.data<float>(), *bp = b.data<float>();
  float* op = out.data<float>();
  enqueue(s, "gated_combine", cost_gated_combine_forward(T, M, static_cast<int>(G), DType::f32), [=] {
    for (std::int64_t t = 0; t < T; ++t) {
      float ca = 0, cb = 0;
      combine_coefficients(zp + t * G, G, ca, cb);
      for (std::int64_t c = 0; c < M; ++c) op[t * M + c] = ca * ap[t * M + c] + cb * bp[t * M + c];
    }
  });
}

void CpuBackend::gated_combine_backward(Stream& s, const Tensor& z, const Tensor& a, const Tensor& b,
                                        const Tensor& d_out, Tensor& da, Tensor& db, Tensor& dz) {
  cpu_require_f32(a, "gated_combine_backward");
  MOELAB_CHECK(a.ndim() == 2, "gated_combine_backward: a " + a.describe() + " should be [T,M]");
  const std::int64_t T = a.dim(0), M = a.dim(1), G = combine_gates(z, T, "gated_combine_backward");
  require_shape(d_out, {T, M}, "gated_combine_backward", "d_out");
  require_shape(da, {T, M}, "gated_combine_backward", "da");
  require_shape(dz, {T, G}, "gated_combine_backward", "dz");
  MOELAB_CHECK(G == 1 || (b.defined() && db.defined()), "gated_combine_backward: a softmax gate needs b and db");
  if (db.defined()) require_shape(db, {T, M}, "gated_combine_backward", "db");
  if (G == 2) require_shape(b, {T, M}, "gated_combine_backward", "b");
  const float *zp = z.data<float>(), *ap = a.data<float>(), *bp = ptr_or_null<float>(b), *dy = d_out.data<float>();
  float *dap = da.data<float>(), *dbp = ptr_or_null<float>(db), *dzp = dz.data<float>();
  enqueue(s, "gated_combine_bwd", cost_gated_combine_backward(T, M, static_cast<int>(G), db.defined(), DType::f32), [=] {
    for (std::int64_t t = 0; t < T; ++t) {
      float ca = 0, cb = 0;
      combine_coefficients(zp + t * G, G, ca, cb);
      float pa = 0, pb = 0;  // <d_out, a>, <d_out, b>
      for (std::int64_t c = 0; c < M; ++c) {
        pa += dy[t * M + c] * ap[t * M + c];
        if (G == 2) pb += dy[t * M + c] * bp[t * M + c];
      }
      for (std::int64_t c = 0; c < M; ++c) {
        const float d = dy[t * M + c];  // read before writing: da or db may alias d_out
        dap[t * M + c] = ca * d;
        if (dbp) dbp[t * M + c] = cb * d;
      }
      if (G == 1) {
        dzp[t] = ca * (1.0f - ca) * pa;
      } else {
        const float mean = ca * pa + cb * pb;
        dzp[t * 2] = ca * (pa - mean);
        dzp[t * 2 + 1] = cb * (pb - mean);
      }
    }
  });
}

void CpuBackend::scale(Stream& s, const Tensor& x, float alpha, Tensor& out) {
  cpu_require_f32(x, "scale");
  MOELAB_CHECK(x.numel() == out.numel() && out.dtype() == x.dtype(), "scale " + x.describe() + " -> " + out.describe());
  const float* xp = x.data<float>();
  float* op = out.data<float>();
  const std::int64_t n = x.numel();
  enqueue(s, "scale", cost_scale(n, DType::f32), [=] {
    for (std::int64_t i = 0; i < n; ++i) op[i] = alpha * xp[i];
  });
}

// ---- cross-entropy -----------------------------------------------------------------------------
// Fused as in llm.c: loss = lse − logit[target] with lse = max + log Σ exp(logit − max), so no
// exponential overflows whatever the logits' size; the backward recomputes softmax from lse.
// Vocabulary-parallel (Megatron-LM's cross-entropy over column shards of the logits): each
// shard's lse and its own target's loss, combined as lse = log Σ_p exp(lse_p) — the shards'
// maxima stay inside each lse_p, so nothing overflows here either.

namespace {
void check_target(std::int32_t target, std::int64_t row, std::int64_t V) {
  if (target >= V)
    throw ConfigError("cross_entropy: target " + std::to_string(target) + " of row " + std::to_string(row) +
                      " is outside the vocabulary of " + std::to_string(V));
}
}  // namespace

void CpuBackend::cross_entropy_forward(Stream& s, const Tensor& logits, const Tensor& targets, Tensor& losses,
                                       Tensor& lse, const VocabShard& shard) {
  cpu_require_f32(logits, "cross_entropy_forward");
  const std::int64_t T = logits.dim(0), V = logits.dim(1);
  const Vocab vocab = vocab_of(shard, V, "cross_entropy_forward");
  require_i32(targets, T, "cross_entropy_forward", "targets");
  require_shape(losses, {T}, "cross_entropy_forward", "losses");
  require_shape(lse, {T}, "cross_entropy_forward", "lse");
  const float* lg = logits.data<float>();
  const std::int32_t* tg = targets.data<std::int32_t>();
  float *lo = losses.data<float>(), *ls = lse.data<float>();
  enqueue(s, "cross_entropy", cost_cross_entropy_forward(T, V, DType::f32), [=] {
    for (std::int64_t t = 0; t < T; ++t) {
      const float* row = lg + t * V;
      check_target(tg[t], t, vocab.total);
      const float mx = *std::max_element(row, row + V);
      float sum = 0.0f;
      for (std::int64_t v = 0; v < V; ++v) sum += std::exp(row[v] - mx);
      ls[t] = mx + std::log(sum);
      lo[t] = vocab.mine(tg[t]) ? ls[t] - row[tg[t] - vocab.start] : 0.0f;
    }
  });
}

void CpuBackend::cross_entropy_backward(Stream& s, const Tensor& logits, const Tensor& targets, const Tensor& lse,
                                        float scale, Tensor& d_logits, const VocabShard& shard) {
  cpu_require_f32(logits, "cross_entropy_backward");
  const std::int64_t T = logits.dim(0), V = logits.dim(1);
  const Vocab vocab = vocab_of(shard, V, "cross_entropy_backward");
  require_i32(targets, T, "cross_entropy_backward", "targets");
  require_shape(lse, {T}, "cross_entropy_backward", "lse");
  require_shape(d_logits, {T, V}, "cross_entropy_backward", "d_logits");
  const float *lg = logits.data<float>(), *ls = lse.data<float>();
  const std::int32_t* tg = targets.data<std::int32_t>();
  float* dl = d_logits.data<float>();
  enqueue(s, "cross_entropy_bwd", cost_cross_entropy_backward(T, V, DType::f32), [=] {
    for (std::int64_t t = 0; t < T; ++t) {
      const float* row = lg + t * V;
      float* d = dl + t * V;
      check_target(tg[t], t, vocab.total);
      if (tg[t] < 0) {
        std::fill(d, d + V, 0.0f);
        continue;
      }
      const std::int64_t y = tg[t] - vocab.start;  // outside [0, V): another shard's column
      for (std::int64_t v = 0; v < V; ++v) d[v] = scale * (std::exp(row[v] - ls[t]) - (v == y ? 1.0f : 0.0f));
    }
  });
}

void CpuBackend::cross_entropy_combine(Stream& s, const Tensor& parts, const Tensor& targets, std::int64_t shard_rows,
                                       Tensor& losses, Tensor& lse) {
  const std::int64_t T = targets.numel();
  MOELAB_CHECK(parts.dtype() == DType::f32 && T > 0 && parts.numel() % (2 * T) == 0 && shard_rows >= 1,
               "cross_entropy_combine: parts " + parts.describe() + " for " + std::to_string(T) + " targets");
  const std::int64_t P = parts.numel() / (2 * T);
  require_i32(targets, T, "cross_entropy_combine", "targets");
  require_shape(losses, {T}, "cross_entropy_combine", "losses");
  require_shape(lse, {T}, "cross_entropy_combine", "lse");
  const float* pp = parts.data<float>();
  const std::int32_t* tg = targets.data<std::int32_t>();
  float *lo = losses.data<float>(), *ls = lse.data<float>();
  enqueue(s, "cross_entropy_combine", cost_cross_entropy_combine(T, P), [=] {
    for (std::int64_t t = 0; t < T; ++t) {
      check_target(tg[t], t, P * shard_rows);
      float mx = -std::numeric_limits<float>::infinity();
      for (std::int64_t p = 0; p < P; ++p) mx = std::max(mx, pp[(2 * p + 1) * T + t]);
      float sum = 0.0f;
      for (std::int64_t p = 0; p < P; ++p) sum += std::exp(pp[(2 * p + 1) * T + t] - mx);
      ls[t] = mx + std::log(sum);
      if (tg[t] < 0) {
        lo[t] = 0.0f;
        continue;
      }
      const std::int64_t owner = tg[t] / shard_rows;
      const float logit = pp[(2 * owner + 1) * T + t] - pp[2 * owner * T + t];
      lo[t] = ls[t] - logit;
    }
  });
}

// ---- optimizer step ------------------------------------------------------------------------------
// See OptimizerStep (backend.hpp). The bias corrections 1 − β^t are computed once per call in
// float64 (β2^t for large t is close to 1 and fp32 powers drift).

void CpuBackend::optimizer_step(Stream& s, const OptimizerStep& st) {
  cpu_require_f32(st.param, "optimizer_step");
  const std::int64_t n = st.param.numel();
  const bool adam = st.kind == OptimizerKind::adam, master = st.master.defined();
  MOELAB_CHECK(st.grad.numel() == n, "optimizer_step: grad " + st.grad.describe() + " for " + st.param.describe());
  if (master)
    MOELAB_CHECK(st.master.numel() == n && st.master.dtype() == DType::f32,
                 "optimizer_step: master " + st.master.describe());
  if (adam) {
    MOELAB_CHECK(st.m.defined() && st.v.defined() && st.m.numel() == n && st.v.numel() == n &&
                     st.m.dtype() == DType::f32 && st.v.dtype() == DType::f32,
                 "optimizer_step: Adam needs fp32 m and v of " + std::to_string(n) + " elements");
    MOELAB_CHECK(st.step >= 1, "optimizer_step: Adam step " + std::to_string(st.step) + " (counts from 1)");
  }
  float* param = st.param.data<float>();
  const float* grad = st.grad.data<float>();
  float* w = master ? st.master.data<float>() : param;
  float *m = adam ? st.m.data<float>() : nullptr, *v = adam ? st.v.data<float>() : nullptr;
  const float lr = st.lr, b1 = st.beta1, b2 = st.beta2, eps = st.eps, wd = st.weight_decay;
  const double t = static_cast<double>(st.step);
  const float bc1 = adam ? static_cast<float>(1.0 - std::pow(static_cast<double>(b1), t)) : 1.0f;
  const float bc2 = adam ? static_cast<float>(1.0 - std::pow(static_cast<double>(b2), t)) : 1.0f;
  enqueue(s, adam ? "adam" : "sgd", cost_optimizer_step(st.kind, n, DType::f32, master), [=] {
    if (adam) {
      for (std::int64_t i = 0; i < n; ++i) {
        m[i] = b1 * m[i] + (1.0f - b1) * grad[i];
        v[i] = b2 * v[i] + (1.0f - b2) * grad[i] * grad[i];
        w[i] -= lr * (m[i] / bc1 / (std::sqrt(v[i] / bc2) + eps) + wd * w[i]);
      }
    } else {
      for (std::int64_t i = 0; i < n; ++i) w[i] -= lr * (grad[i] + wd * w[i]);
    }
    if (master) std::copy(w, w + n, param);  // the parameter in its dtype (fp32 on cpu)
  });
}

}  // namespace moelab
