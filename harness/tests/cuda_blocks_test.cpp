// harness/tests/cuda_blocks_test.cpp — the cuda backend's transformer-block ops (embedding,
// layernorm/rmsnorm, rope, tiled attention, SwiGLU, add, scale, gated combine, fused cross-entropy
// and its vocabulary-parallel form, SGD/Adam) in
// fp32 and bf16, forward and backward, against the float64 reference of
// cuda_blocks_reference.hpp on fresh random inputs (MOELAB_TEST_SEED replays one) and awkward
// sizes: S = 1, 37, 130 (tiles of 32 with ragged edges), B = 1, 3, heads 4/4, 4/1, 6/3, head
// dims 16, 64, 128, widths 7 and 1000; plus the pinned host pool under an offloading pattern.
//
// The reference's own backward passes are checked by central finite differences first; those
// tests run everywhere. Every test of the cuda backend skips without a CUDA device.
//   ctest --test-dir build -R cuda_blocks_test --output-on-failure
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <ostream>
#include <set>
#include <sstream>
#include <string>
#include <tuple>

#include "harness/backends/cuda/cuda_backend.hpp"
#include "harness/comm/communicator.hpp"
#include "harness/nn/moe_impl.hpp"
#include "harness/runtime/error.hpp"
#include "harness/tests/blocks_reference.hpp"
#include "harness/tests/cuda_blocks_reference.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab {
namespace {

using cuda_ref::Vec;
using i64 = std::int64_t;
using test::all_close;
using test::fresh_seed;
using test::uniform;

// Relative tolerances (test_util's all_close: per element, on the tensor's scale). fp32:
// fp32 arithmetic on exact inputs, sums of up to a thousand terms. bf16: inputs are exact
// (the reference reads the stored values), fp32 inside, one rounding to 8 mantissa bits on
// the way out (2^-9 relative), a little more where the backward reads a bf16 forward output.
double tol(DType t) { return t == DType::bf16 ? 2e-2 : 1e-4; }
double tol_backward(DType t) { return t == DType::bf16 ? 3e-2 : 1e-4; }
constexpr double kTolStats = 2e-5;  // fp32 outputs (mean, rstd, lse, losses) in either dtype

// What a value becomes once stored in `t` (the reference's inputs are these).
std::vector<float> stored(std::vector<float> v, DType t) {
  if (t == DType::bf16)
    for (auto& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}
Vec dbl(const std::vector<float>& v) { return {v.begin(), v.end()}; }
// Columns [begin, begin + count) of a row-major [rows, width] matrix.
template <class V>
V columns(const V& m, i64 width, i64 begin, i64 count) {
  const i64 rows = static_cast<i64>(m.size()) / width;
  V out;
  out.reserve(static_cast<std::size_t>(rows * count));
  for (i64 r = 0; r < rows; ++r)
    for (i64 c = 0; c < count; ++c) out.push_back(m[static_cast<std::size_t>(r * width + begin + c)]);
  return out;
}
std::string dtype_label(DType t) { return t == DType::bf16 ? "bf16" : "fp32"; }

// ==== the reference checked by finite differences (no device needed) =====================

// L(x) = sum_i w_i f(x)_i; checks dL/dx = `analytic` by central differences on every element
// (the shapes here are small).
void expect_gradient(const std::string& what, const std::function<Vec(const Vec&)>& f, Vec x, const Vec& w,
                     const Vec& analytic) {
  ASSERT_EQ(analytic.size(), x.size()) << what;
  auto L = [&](const Vec& v) {
    const Vec y = f(v);
    double s = 0;
    for (std::size_t i = 0; i < y.size(); ++i) s += w[i] * y[i];
    return s;
  };
  const double h = 1e-5;
  for (std::size_t k = 0; k < x.size(); ++k) {
    const double keep = x[k];
    x[k] = keep + h;
    const double up = L(x);
    x[k] = keep - h;
    const double down = L(x);
    x[k] = keep;
    const double fd = (up - down) / (2 * h);
    ASSERT_NEAR(analytic[k], fd, 1e-6 * (1 + std::abs(fd))) << what << "[" << k << "]";
  }
}

Vec rand_vec(std::size_t n, std::uint64_t seed, double lo = -1, double hi = 1) { return dbl(uniform(n, seed, lo, hi)); }

TEST(CudaBlocksReference, NormBackwardIsTheGradient) {
  const std::uint64_t seed = fresh_seed();
  const i64 T = 3, M = 7;
  const double eps = 1e-5;
  for (NormKind kind : {NormKind::layernorm, NormKind::rmsnorm}) {
    const Vec x = rand_vec(T * M, seed, -2, 2), gamma = rand_vec(M, seed + 1, 0.5, 1.5), beta = rand_vec(M, seed + 2);
    const Vec w = rand_vec(T * M, seed + 3);
    Vec d_gamma(M, 0.0), d_beta(M, 0.0);
    const Vec dx = cuda_ref::norm_backward(kind, eps, x, gamma, w, T, M, d_gamma, d_beta);
    const std::string k = norm_name(kind);
    expect_gradient(k + " dx", [&](const Vec& v) { return cuda_ref::norm_forward(kind, eps, v, gamma, &beta, T, M).y; },
                    x, w, dx);
    expect_gradient(k + " d_gamma",
                    [&](const Vec& v) { return cuda_ref::norm_forward(kind, eps, x, v, &beta, T, M).y; }, gamma, w,
                    d_gamma);
    if (kind == NormKind::layernorm)
      expect_gradient(k + " d_beta",
                      [&](const Vec& v) { return cuda_ref::norm_forward(kind, eps, x, gamma, &v, T, M).y; }, beta, w,
                      d_beta);
  }
}

TEST(CudaBlocksReference, AttentionBackwardIsTheGradient) {
  const std::uint64_t seed = fresh_seed();
  for (bool causal : {true, false}) {
    const AttentionShape a{2, 5, 4, 2, 4, causal};
    const Vec qkv = rand_vec(static_cast<std::size_t>(a.tokens() * a.qkv_width()), seed, -1.5, 1.5);
    const Vec w = rand_vec(static_cast<std::size_t>(a.tokens() * a.heads * a.head_dim), seed + 1);
    expect_gradient(causal ? "attention (causal)" : "attention",
                    [&](const Vec& v) { return cuda_ref::attention_forward(v, a).out; }, qkv, w,
                    cuda_ref::attention_backward(qkv, w, a));
    // lse is the log of the softmax denominator: exp(s_ij - lse_i) sums to 1 over visible keys.
    const auto f = cuda_ref::attention_forward(qkv, a);
    for (double l : f.lse) EXPECT_TRUE(std::isfinite(l));
  }
}

TEST(CudaBlocksReference, RopeInverseIsItsBackward) {
  const std::uint64_t seed = fresh_seed();
  const AttentionShape a{2, 3, 2, 1, 6, true};
  const std::size_t n = static_cast<std::size_t>(a.tokens() * a.qkv_width());
  const Vec x = rand_vec(n, seed), w = rand_vec(n, seed + 1);
  Vec grad = w;
  cuda_ref::rope(grad, a, 100.0, true);  // a rotation's gradient is its transpose, the inverse rotation
  expect_gradient("rope", [&](const Vec& v) { Vec y = v; cuda_ref::rope(y, a, 100.0, false); return y; }, x, w,
                  grad);
  Vec back = x;
  cuda_ref::rope(back, a, 100.0, false);
  EXPECT_NE(back, x);
  cuda_ref::rope(back, a, 100.0, true);
  for (std::size_t i = 0; i < n; ++i) EXPECT_NEAR(back[i], x[i], 1e-12);
}

TEST(CudaBlocksReference, SwigluAndCrossEntropyBackwardsAreTheGradients) {
  const std::uint64_t seed = fresh_seed();
  const i64 T = 3, F = 4, V = 6;
  const Vec h = rand_vec(T * 2 * F, seed, -3, 3), w = rand_vec(T * F, seed + 1);
  expect_gradient("swiglu", [&](const Vec& v) { return cuda_ref::swiglu_forward(v, T, F); }, h, w,
                  cuda_ref::swiglu_backward(h, w, T, F));
  const Vec logits = rand_vec(T * V, seed + 2, -4, 4);
  const std::vector<std::int32_t> targets{2, -1, 5};
  const double scale = 0.5;
  expect_gradient("cross_entropy",
                  [&](const Vec& v) { return cuda_ref::cross_entropy_forward(v, targets, T, V).losses; }, logits,
                  Vec(T, scale), cuda_ref::cross_entropy_backward(logits, targets, scale, T, V));
}

TEST(CudaBlocksReference, EmbeddingBackwardIsTheGradient) {
  const std::uint64_t seed = fresh_seed();
  const i64 S = 3, M = 2, V = 4;
  const std::vector<std::int32_t> ids{1, 3, 1, 0, 1, 1};  // two sequences, repeated ids
  const Vec wte = rand_vec(V * M, seed), wpe = rand_vec((S + 1) * M, seed + 1), w = rand_vec(ids.size() * M, seed + 2);
  Vec d_wte(wte.size(), 0.0), d_wpe(wpe.size(), 0.0);
  cuda_ref::embedding_backward(w, ids, S, M, d_wte, &d_wpe);
  expect_gradient("embedding wte", [&](const Vec& v) { return cuda_ref::embedding_forward(ids, v, &wpe, S, M); },
                  wte, w, d_wte);
  expect_gradient("embedding wpe", [&](const Vec& v) { return cuda_ref::embedding_forward(ids, wte, &v, S, M); },
                  wpe, w, d_wpe);
}

// ==== the cuda backend =====================================================================

class CudaBlocks : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
    b = make_cuda_backend(0);
    s = &b->default_stream();
  }
  Tensor make(std::vector<i64> shape, DType dt, const std::vector<float>& values,
              MemCategory c = MemCategory::activations) {
    Tensor t = b->empty(std::move(shape), dt, c, *s);
    b->upload(values, t);
    return t;
  }
  Tensor make_i32(std::vector<i64> shape, const std::vector<std::int32_t>& values) {
    Tensor t = b->empty(std::move(shape), DType::i32, MemCategory::buffers, *s);
    b->upload_i32(values, t);
    return t;
  }
  // Filled with a value no op produces, so that an element an op fails to write shows.
  Tensor poisoned(std::vector<i64> shape, DType dt) {
    i64 n = 1;
    for (i64 d : shape) n *= d;
    return make(std::move(shape), dt, std::vector<float>(static_cast<std::size_t>(n), 777.0f));
  }
  std::unique_ptr<Backend> b;
  Stream* s = nullptr;
};

// ---- embedding --------------------------------------------------------------------------

struct EmbedCase {
  i64 B, S, M;
  bool learned;
  int skew_pct = 0;  // this share of the tokens (percent) is one id: a run across several 256-token segments
};
std::ostream& operator<<(std::ostream& o, const EmbedCase& c) {
  o << "B" << c.B << "_S" << c.S << "_M" << c.M << (c.learned ? "_learned" : "_nopos");
  if (c.skew_pct) o << "_skew" << c.skew_pct;
  return o;
}
class CudaEmbedding : public CudaBlocks, public ::testing::WithParamInterface<std::tuple<EmbedCase, DType>> {};

TEST_P(CudaEmbedding, ForwardBackward) {
  const auto [c, dt] = GetParam();
  const std::uint64_t seed = fresh_seed();
  const i64 T = c.B * c.S, V = 50, P = c.S + 3;  // V small: ids repeat, the backward's runs are long
  Rng r(seed);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(T));
  for (auto& id : ids)
    id = static_cast<std::int32_t>(static_cast<int>(r.next() % 100) < c.skew_pct ? 3 : r.next() % V);
  ids.front() = static_cast<std::int32_t>(V - 1);
  const auto wte = stored(uniform(V * c.M, seed + 1), dt), wpe = stored(uniform(P * c.M, seed + 2), dt);
  const auto d_out = stored(uniform(T * c.M, seed + 3), dt);
  const auto d_wte0 = stored(uniform(V * c.M, seed + 4), dt), d_wpe0 = stored(uniform(P * c.M, seed + 5), dt);

  Tensor t_ids = make_i32({T}, ids), t_wte = make({V, c.M}, dt, wte), t_wpe, out = poisoned({T, c.M}, dt);
  if (c.learned) t_wpe = make({P, c.M}, dt, wpe);
  b->embedding_forward(*s, t_ids, t_wte, t_wpe, c.S, out);
  const Vec wpe_d = dbl(wpe);
  EXPECT_TRUE(all_close("out", b->download(out),
                        cuda_ref::embedding_forward(ids, dbl(wte), c.learned ? &wpe_d : nullptr, c.S, c.M), tol(dt)));

  Tensor t_dout = make({T, c.M}, dt, d_out), d_wte = make({V, c.M}, dt, d_wte0), d_wpe;
  if (c.learned) d_wpe = make({P, c.M}, dt, d_wpe0);
  b->embedding_backward(*s, t_dout, t_ids, c.S, d_wte, d_wpe);
  Vec ref_wte = dbl(d_wte0), ref_wpe = dbl(d_wpe0);
  cuda_ref::embedding_backward(dbl(d_out), ids, c.S, c.M, ref_wte, c.learned ? &ref_wpe : nullptr);
  EXPECT_TRUE(all_close("d_wte", b->download(d_wte), ref_wte, tol(dt)));
  if (c.learned) {
    EXPECT_TRUE(all_close("d_wpe", b->download(d_wpe), ref_wpe, tol(dt)));
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaEmbedding,
                         ::testing::Combine(::testing::Values(EmbedCase{1, 1, 7, true}, EmbedCase{3, 37, 1000, true},
                                                              EmbedCase{1, 130, 7, false},
                                                              EmbedCase{3, 130, 1000, false},
                                                              EmbedCase{4, 300, 300, false, 60},
                                                              EmbedCase{2, 1024, 33, true, 20}),
                                            ::testing::Values(DType::f32, DType::bf16)),
                         [](const auto& i) {
                           std::ostringstream o;
                           o << std::get<0>(i.param) << "_" << dtype_label(std::get<1>(i.param));
                           return o.str();
                         });

// ---- layernorm / rmsnorm ----------------------------------------------------------------

class CudaNorm : public CudaBlocks,
                 public ::testing::WithParamInterface<std::tuple<NormKind, std::pair<i64, i64>, DType>> {};

TEST_P(CudaNorm, ForwardBackward) {
  const auto [kind, tm, dt] = GetParam();
  const auto [T, M] = tm;
  const bool ln = kind == NormKind::layernorm;
  const std::uint64_t seed = fresh_seed();
  const float eps = 1e-5f;
  const auto x = stored(uniform(T * M, seed, 1.0, 4.0), dt);  // off-centre: the mean matters
  const auto gamma = stored(uniform(M, seed + 1, 0.5, 1.5), dt), beta = stored(uniform(M, seed + 2), dt);
  const auto dy = stored(uniform(T * M, seed + 3), dt);
  const auto dg0 = stored(uniform(M, seed + 4), dt), db0 = stored(uniform(M, seed + 5), dt);

  Tensor tx = make({T, M}, dt, x), tg = make({M}, dt, gamma, MemCategory::weights);
  Tensor tb = ln ? make({M}, dt, beta, MemCategory::weights) : Tensor();
  Tensor y = poisoned({T, M}, dt), mean = ln ? poisoned({T}, DType::f32) : Tensor(), rstd = poisoned({T}, DType::f32);
  b->norm_forward(*s, kind, eps, tx, tg, tb, y, mean, rstd);
  const Vec beta_d = dbl(beta);
  const auto ref = cuda_ref::norm_forward(kind, eps, dbl(x), dbl(gamma), ln ? &beta_d : nullptr, T, M);
  EXPECT_TRUE(all_close("y", b->download(y), ref.y, tol(dt)));
  EXPECT_TRUE(all_close("rstd", b->download(rstd), ref.rstd, kTolStats));
  if (ln) {
    EXPECT_TRUE(all_close("mean", b->download(mean), ref.mean, kTolStats));
  }

  Tensor tdy = make({T, M}, dt, dy), dx = poisoned({T, M}, dt);
  Tensor dg = make({M}, dt, dg0, MemCategory::gradients), db = ln ? make({M}, dt, db0, MemCategory::gradients) : Tensor();
  b->norm_backward(*s, kind, tx, tg, mean, rstd, tdy, dx, dg, db);
  Vec ref_dg = dbl(dg0), ref_db = dbl(db0);
  const Vec ref_dx = cuda_ref::norm_backward(kind, eps, dbl(x), dbl(gamma), dbl(dy), T, M, ref_dg, ref_db);
  EXPECT_TRUE(all_close("dx", b->download(dx), ref_dx, tol_backward(dt)));
  EXPECT_TRUE(all_close("d_gamma (accumulated)", b->download(dg), ref_dg, tol_backward(dt)));
  if (ln) {
    EXPECT_TRUE(all_close("d_beta (accumulated)", b->download(db), ref_db, tol_backward(dt)));
  }

  // In place (dx over dy, as the cpu backend allows): the parameter gradients read dy before
  // dx overwrites it, so both come out as above.
  Tensor dyx = make({T, M}, dt, dy);
  Tensor dg2 = make({M}, dt, dg0, MemCategory::gradients), db2 = ln ? make({M}, dt, db0, MemCategory::gradients) : Tensor();
  b->norm_backward(*s, kind, tx, tg, mean, rstd, dyx, dyx, dg2, db2);
  EXPECT_TRUE(all_close("dx (in place over dy)", b->download(dyx), ref_dx, tol_backward(dt)));
  EXPECT_TRUE(all_close("d_gamma (dx over dy)", b->download(dg2), ref_dg, tol_backward(dt)));
  if (ln) {
    EXPECT_TRUE(all_close("d_beta (dx over dy)", b->download(db2), ref_db, tol_backward(dt)));
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaNorm,
                         ::testing::Combine(::testing::Values(NormKind::layernorm, NormKind::rmsnorm),
                                            ::testing::Values(std::pair<i64, i64>{1, 7},
                                                              std::pair<i64, i64>{37, 1000},
                                                              std::pair<i64, i64>{130, 7},
                                                              std::pair<i64, i64>{130, 1000},
                                                              // more rows than one pass of the capped
                                                              // grid (8192 blocks of 8 warps) covers
                                                              std::pair<i64, i64>{65536 + 37, 7}),
                                            ::testing::Values(DType::f32, DType::bf16)),
                         [](const auto& i) {
                           return std::string(norm_name(std::get<0>(i.param))) + "_T" +
                                  std::to_string(std::get<1>(i.param).first) + "_M" +
                                  std::to_string(std::get<1>(i.param).second) + "_" +
                                  dtype_label(std::get<2>(i.param));
                         });

// ---- rope and attention -----------------------------------------------------------------

std::ostream& operator<<(std::ostream& o, const AttentionShape& a) {
  return o << "B" << a.batch << "_S" << a.seq << "_H" << a.heads << "x" << a.kv_heads << "_D" << a.head_dim
           << (a.causal ? "_causal" : "_bidir");
}
class CudaAttention : public CudaBlocks, public ::testing::WithParamInterface<std::tuple<AttentionShape, DType>> {};

TEST_P(CudaAttention, RopeForwardAndInverse) {
  const auto [a, dt] = GetParam();
  const std::uint64_t seed = fresh_seed();
  const i64 T = a.tokens(), W = a.qkv_width();
  const auto x = stored(uniform(T * W, seed), dt);
  Tensor t = make({T, W}, dt, x);
  b->rope(*s, a, 10000.0f, false, t);
  Vec ref = dbl(x);
  cuda_ref::rope(ref, a, 10000.0, false);
  const auto rotated = b->download(t);
  EXPECT_TRUE(all_close("rope", rotated, ref, tol(dt)));
  // The value heads are untouched, bit for bit.
  const i64 vcol = static_cast<i64>(a.heads + a.kv_heads) * a.head_dim, vw = static_cast<i64>(a.kv_heads) * a.head_dim;
  EXPECT_EQ(columns(rotated, W, vcol, vw), columns(x, W, vcol, vw));
  b->rope(*s, a, 10000.0f, true, t);
  EXPECT_TRUE(all_close("rope then inverse", b->download(t), dbl(x), dt == DType::bf16 ? 2 * tol(dt) : 1e-5));
}

TEST_P(CudaAttention, ForwardBackward) {
  const auto [a, dt] = GetParam();
  const std::uint64_t seed = fresh_seed();
  const i64 T = a.tokens(), W = a.qkv_width(), HD = static_cast<i64>(a.heads) * a.head_dim;
  const auto qkv = stored(uniform(T * W, seed, -2.0, 2.0), dt);
  const auto d_out = stored(uniform(T * HD, seed + 1), dt);

  Tensor tq = make({T, W}, dt, qkv), out = poisoned({T, HD}, dt), lse = poisoned({a.batch, a.heads, a.seq}, DType::f32);
  b->attention_forward(*s, a, tq, out, lse);
  const auto ref = cuda_ref::attention_forward(dbl(qkv), a);
  EXPECT_TRUE(all_close("out", b->download(out), ref.out, tol(dt)));
  EXPECT_TRUE(all_close("lse", b->download(lse), ref.lse, kTolStats));

  Tensor tdo = make({T, HD}, dt, d_out), dqkv = poisoned({T, W}, dt);
  b->attention_backward(*s, a, tq, out, lse, tdo, dqkv);
  const Vec ref_d = cuda_ref::attention_backward(dbl(qkv), dbl(d_out), a);
  const auto got = b->download(dqkv);
  const i64 kv = static_cast<i64>(a.kv_heads) * a.head_dim;
  if (a.seq > 1) {
    EXPECT_TRUE(all_close("dQ", columns(got, W, 0, HD), columns(ref_d, W, 0, HD), tol_backward(dt)));
  } else {
    // One key per query: the softmax is constant and dQ is 0 exactly; the kernel's D_i =
    // rowsum(dO o O) (from the stored O) leaves a rounding residue, small on dV's scale.
    double dq = 0, dv = 0;
    for (float x : columns(got, W, 0, HD)) dq = std::max(dq, std::abs(static_cast<double>(x)));
    for (double x : columns(ref_d, W, HD + kv, kv)) dv = std::max(dv, std::abs(x));
    EXPECT_LE(dq, tol_backward(dt) * dv) << "dQ with a single key";
  }
  EXPECT_TRUE(all_close("dK", columns(got, W, HD, kv), columns(ref_d, W, HD, kv), tol_backward(dt)));
  EXPECT_TRUE(all_close("dV", columns(got, W, HD + kv, kv), columns(ref_d, W, HD + kv, kv), tol_backward(dt)));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaAttention,
    ::testing::Combine(::testing::Values(AttentionShape{1, 1, 4, 4, 16, true}, AttentionShape{3, 37, 4, 1, 64, true},
                                         AttentionShape{1, 130, 6, 3, 128, true},
                                         AttentionShape{3, 130, 4, 4, 64, false},
                                         AttentionShape{1, 37, 6, 3, 128, false},
                                         AttentionShape{3, 1, 4, 1, 16, false}, AttentionShape{3, 37, 6, 3, 16, true}),
                       ::testing::Values(DType::f32, DType::bf16)),
    [](const auto& i) {
      std::ostringstream o;
      o << std::get<0>(i.param) << "_" << dtype_label(std::get<1>(i.param));
      return o.str();
    });

TEST_F(CudaBlocks, AttentionRejectsHeadDimOver128) {
  const AttentionShape a{1, 4, 2, 2, 160, true};
  Tensor qkv = b->empty({4, a.qkv_width()}, DType::f32, MemCategory::activations, *s);
  Tensor out = b->empty({4, 2 * 160}, DType::f32, MemCategory::activations, *s);
  Tensor lse = b->empty({1, 2, 4}, DType::f32, MemCategory::activations, *s);
  try {
    b->attention_forward(*s, a, qkv, out, lse);
    FAIL() << "head_dim 160 accepted";
  } catch (const Unsupported& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim 160"), std::string::npos) << e.what();
  }
  EXPECT_THROW(b->attention_backward(*s, a, qkv, out, lse, out, qkv), Unsupported);
}

// ---- SwiGLU, add ------------------------------------------------------------------------

class CudaElementwise : public CudaBlocks,
                        public ::testing::WithParamInterface<std::tuple<std::pair<i64, i64>, DType>> {};

TEST_P(CudaElementwise, SwigluForwardBackward) {
  const auto [tf, dt] = GetParam();
  const auto [T, F] = tf;
  const std::uint64_t seed = fresh_seed();
  const auto h = stored(uniform(T * 2 * F, seed, -4.0, 4.0), dt), d_out = stored(uniform(T * F, seed + 1), dt);
  Tensor th = make({T, 2 * F}, dt, h), out = poisoned({T, F}, dt);
  b->swiglu_forward(*s, th, out);
  EXPECT_TRUE(all_close("swiglu", b->download(out), cuda_ref::swiglu_forward(dbl(h), T, F), tol(dt)));
  Tensor tdo = make({T, F}, dt, d_out), dh = poisoned({T, 2 * F}, dt);
  b->swiglu_backward(*s, th, tdo, dh);
  EXPECT_TRUE(
      all_close("swiglu d_h", b->download(dh), cuda_ref::swiglu_backward(dbl(h), dbl(d_out), T, F), tol_backward(dt)));
}

TEST_P(CudaElementwise, AddInPlace) {
  const auto [tf, dt] = GetParam();
  const i64 n = tf.first * tf.second;
  const std::uint64_t seed = fresh_seed();
  const auto x = stored(uniform(n, seed), dt), y = stored(uniform(n, seed + 1), dt);
  Tensor tx = make({n}, dt, x), ty = make({n}, dt, y), out = poisoned({n}, dt);
  b->add(*s, tx, ty, out);
  Vec ref(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < ref.size(); ++i) ref[i] = static_cast<double>(x[i]) + y[i];
  EXPECT_TRUE(all_close("a + b", b->download(out), ref, tol(dt)));
  b->add(*s, tx, ty, tx);  // residual stream: out aliases a
  EXPECT_EQ(b->download(tx), b->download(out));
}

// ScMoE's combine gates (Backend::gated_combine_*), G = 1 and 2, against the float64 reference
// of blocks_reference.hpp (checked by finite differences in blocks_ops_test).
TEST_P(CudaElementwise, GatedCombineForwardBackward) {
  const auto [tf, dt] = GetParam();
  const auto [T, M] = tf;
  const std::uint64_t seed = fresh_seed();
  for (i64 G : {1, 2}) {
    SCOPED_TRACE("G=" + std::to_string(G));
    const auto z = uniform(T * G, seed, -6.0, 6.0);
    const auto a = stored(uniform(T * M, seed + 1), dt), bb = stored(uniform(T * M, seed + 2), dt);
    const auto d_out = stored(uniform(T * M, seed + 3), dt);
    Tensor tz = make({T, G}, DType::f32, z), ta = make({T, M}, dt, a), tb = make({T, M}, dt, bb), tdo = make({T, M}, dt, d_out);
    Tensor out = poisoned({T, M}, dt), da = poisoned({T, M}, dt), db = poisoned({T, M}, dt), dz = poisoned({T, G}, DType::f32);
    Tensor none;
    b->gated_combine_forward(*s, tz, ta, tb, out);
    b->gated_combine_backward(*s, tz, ta, G == 2 ? tb : none, tdo, da, G == 2 ? db : none, dz);
    Vec rda, rdb, rdz;
    blocks_ref::gated_combine_backward(dbl(z), dbl(a), dbl(bb), dbl(d_out), static_cast<std::size_t>(G), rda, rdb, rdz);
    EXPECT_TRUE(all_close("out", b->download(out),
                          blocks_ref::gated_combine_forward(dbl(z), dbl(a), dbl(bb), static_cast<std::size_t>(G)), tol(dt)));
    EXPECT_TRUE(all_close("da", b->download(da), rda, tol_backward(dt)));
    if (G == 2) {
      EXPECT_TRUE(all_close("db", b->download(db), rdb, tol_backward(dt)));
    }
    EXPECT_TRUE(all_close("dz", b->download(dz), rdz, tol_backward(dt)));

    // In place, as the backend allows: out over a, and da (db) over d_out.
    Tensor a2 = make({T, M}, dt, a), do2 = make({T, M}, dt, d_out), dz2 = poisoned({T, G}, DType::f32);
    b->gated_combine_forward(*s, tz, a2, tb, a2);
    EXPECT_EQ(b->download(a2), b->download(out));
    Tensor a3 = make({T, M}, dt, a);
    b->gated_combine_backward(*s, tz, a3, G == 2 ? tb : none, do2, do2, G == 2 ? db : none, dz2);
    EXPECT_EQ(b->download(do2), b->download(da));
    EXPECT_EQ(b->download(dz2), b->download(dz));
  }
}

TEST_P(CudaElementwise, ScaleInPlace) {
  const auto [tf, dt] = GetParam();
  const i64 n = tf.first * tf.second;
  const std::uint64_t seed = fresh_seed();
  const auto x = stored(uniform(n, seed), dt);
  const float alpha = 0.25f;  // a power of two: exact in bf16 too
  Tensor tx = make({n}, dt, x), out = poisoned({n}, dt);
  b->scale(*s, tx, alpha, out);
  Vec ref(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < ref.size(); ++i) ref[i] = static_cast<double>(alpha) * x[i];
  EXPECT_TRUE(all_close("alpha * x", b->download(out), ref, tol(dt)));
  b->scale(*s, tx, alpha, tx);  // a gradient scaled where it is: out aliases x
  EXPECT_EQ(b->download(tx), b->download(out));
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaElementwise,
                         ::testing::Combine(::testing::Values(std::pair<i64, i64>{1, 7}, std::pair<i64, i64>{37, 1000},
                                                              std::pair<i64, i64>{130, 7},
                                                              // over 2^21 elements: a second pass of the
                                                              // capped grid (8192 blocks of 256 threads)
                                                              std::pair<i64, i64>{2100, 1000},
                                                              // over 8192 rows: a block of the combine
                                                              // kernels takes a second row
                                                              std::pair<i64, i64>{9000, 7}),
                                            ::testing::Values(DType::f32, DType::bf16)),
                         [](const auto& i) {
                           return "T" + std::to_string(std::get<0>(i.param).first) + "_F" +
                                  std::to_string(std::get<0>(i.param).second) + "_" + dtype_label(std::get<1>(i.param));
                         });

// ---- cross-entropy ----------------------------------------------------------------------

class CudaCrossEntropy : public CudaBlocks,
                         public ::testing::WithParamInterface<std::tuple<std::pair<i64, i64>, DType>> {};

TEST_P(CudaCrossEntropy, ForwardBackwardIgnoringNegativeTargets) {
  const auto [tv, dt] = GetParam();
  const auto [T, V] = tv;
  const std::uint64_t seed = fresh_seed();
  const auto logits = stored(uniform(T * V, seed, -5.0, 5.0), dt);
  Rng r(seed + 1);
  std::vector<std::int32_t> targets(static_cast<std::size_t>(T));
  int counted = 0;
  for (auto& y : targets) {
    y = r.uniform() < 0.2 ? -1 : static_cast<std::int32_t>(r.next() % V);
    counted += y >= 0;
  }
  const float scale = 1.0f / static_cast<float>(std::max(counted, 1));

  Tensor tl = make({T, V}, dt, logits), tt = make_i32({T}, targets);
  Tensor losses = poisoned({T}, DType::f32), lse = poisoned({T}, DType::f32);
  b->cross_entropy_forward(*s, tl, tt, losses, lse);
  const auto ref = cuda_ref::cross_entropy_forward(dbl(logits), targets, T, V);
  EXPECT_TRUE(all_close("losses", b->download(losses), ref.losses, kTolStats));
  EXPECT_TRUE(all_close("lse", b->download(lse), ref.lse, kTolStats));

  Tensor d = poisoned({T, V}, dt);
  b->cross_entropy_backward(*s, tl, tt, lse, scale, d);
  const Vec ref_d = cuda_ref::cross_entropy_backward(dbl(logits), targets, scale, T, V);
  const auto got = b->download(d);
  EXPECT_TRUE(all_close("d_logits", got, ref_d, tol_backward(dt)));
  b->cross_entropy_backward(*s, tl, tt, lse, scale, tl);  // in place over the logits, as llm.c does
  EXPECT_EQ(b->download(tl), got);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaCrossEntropy,
                         ::testing::Combine(::testing::Values(std::pair<i64, i64>{1, 7}, std::pair<i64, i64>{37, 1000},
                                                              std::pair<i64, i64>{130, 7},
                                                              std::pair<i64, i64>{130, 1000},
                                                              // more rows than the capped grid's 8192
                                                              // blocks: a block reuses its shared
                                                              // merge buffer for a second row
                                                              std::pair<i64, i64>{8192 + 37, 7}),
                                            ::testing::Values(DType::f32, DType::bf16)),
                         [](const auto& i) {
                           return "T" + std::to_string(std::get<0>(i.param).first) + "_V" +
                                  std::to_string(std::get<0>(i.param).second) + "_" + dtype_label(std::get<1>(i.param));
                         });

// Vocabulary-parallel (Megatron-LM): P shards of the table and of the logit columns, each op
// with its VocabShard; the embeddings summed, the gradients laid side by side and the shards'
// (loss, lse) combined give the whole vocabulary's reference.
TEST_P(CudaCrossEntropy, VocabularyShardsCombineToTheWholeRow) {
  const auto [tv, dt] = GetParam();
  const auto [T, V] = tv;
  const i64 P = V % 2 == 0 ? 2 : 7, R = V / P, M = 5, S = 1;
  const std::uint64_t seed = fresh_seed();
  const auto logits = stored(uniform(T * V, seed, -5.0, 5.0), dt), wte = stored(uniform(V * M, seed + 2), dt);
  const auto d_out = stored(uniform(T * M, seed + 3), dt);
  Rng r(seed + 1);
  std::vector<std::int32_t> targets(static_cast<std::size_t>(T)), ids(static_cast<std::size_t>(T));
  for (auto& y : targets) y = r.uniform() < 0.2 ? -1 : static_cast<std::int32_t>(r.next() % V);
  for (auto& id : ids) id = static_cast<std::int32_t>(r.next() % V);
  const float scale = 0.5f;
  Tensor tt = make_i32({T}, targets), tid = make_i32({T}, ids), tdo = make({T, M}, dt, d_out);
  Tensor parts = poisoned({P, 2, T}, DType::f32);
  Vec emb(static_cast<std::size_t>(T * M), 0.0), d_wte, d_logits(static_cast<std::size_t>(T * V));
  std::vector<Tensor> shard_logits;
  for (i64 p = 0; p < P; ++p) {
    const VocabShard sh{p * R, V};
    Tensor tl = make({T, R}, dt, columns(logits, V, p * R, R));
    Tensor part = parts.select(p), loss = part.select(0), lse = part.select(1);
    b->cross_entropy_forward(*s, tl, tt, loss, lse, sh);
    shard_logits.push_back(tl);
    Tensor tw = make({R, M}, dt, std::vector<float>(wte.begin() + p * R * M, wte.begin() + (p + 1) * R * M));
    Tensor out = poisoned({T, M}, dt), dw = make({R, M}, dt, std::vector<float>(static_cast<std::size_t>(R * M), 0.0f));
    Tensor no_pos;
    b->embedding_forward(*s, tid, tw, Tensor(), S, out, sh);
    b->embedding_backward(*s, tdo, tid, S, dw, no_pos, sh);
    const auto o = b->download(out), g = b->download(dw);
    for (std::size_t i = 0; i < o.size(); ++i) emb[i] += o[i];
    d_wte.insert(d_wte.end(), g.begin(), g.end());
  }
  EXPECT_TRUE(all_close("embedding", std::vector<float>(emb.begin(), emb.end()),
                        cuda_ref::embedding_forward(ids, dbl(wte), nullptr, S, M), tol(dt)));
  Vec ref_wte(static_cast<std::size_t>(V * M), 0.0);
  cuda_ref::embedding_backward(dbl(d_out), ids, S, M, ref_wte, nullptr);
  EXPECT_TRUE(all_close("d_wte", std::vector<float>(d_wte.begin(), d_wte.end()), ref_wte, tol(dt)));
  Tensor losses = poisoned({T}, DType::f32), lse = poisoned({T}, DType::f32);
  b->cross_entropy_combine(*s, parts, tt, R, losses, lse);
  const auto ref = cuda_ref::cross_entropy_forward(dbl(logits), targets, T, V);
  EXPECT_TRUE(all_close("losses", b->download(losses), ref.losses, kTolStats));
  EXPECT_TRUE(all_close("lse", b->download(lse), ref.lse, kTolStats));
  for (i64 p = 0; p < P; ++p) {
    Tensor d = poisoned({T, R}, dt);
    b->cross_entropy_backward(*s, shard_logits[static_cast<std::size_t>(p)], tt, lse, scale, d, VocabShard{p * R, V});
    const auto dv = b->download(d);
    for (i64 t = 0; t < T; ++t)
      for (i64 c = 0; c < R; ++c) d_logits[static_cast<std::size_t>(t * V + p * R + c)] = dv[static_cast<std::size_t>(t * R + c)];
  }
  EXPECT_TRUE(all_close("d_logits", std::vector<float>(d_logits.begin(), d_logits.end()),
                        cuda_ref::cross_entropy_backward(dbl(logits), targets, scale, T, V), tol_backward(dt)));
}

// ---- optimizer step ---------------------------------------------------------------------

struct OptCase {
  OptimizerKind kind;
  DType param;   // grad has the same dtype
  bool master;   // an fp32 master copy (required for bf16)
  i64 n;
};
std::ostream& operator<<(std::ostream& o, const OptCase& c) {
  return o << (c.kind == OptimizerKind::adam ? "adam" : "sgd") << "_" << dtype_label(c.param)
           << (c.master ? "_master" : "") << "_n" << c.n;
}
class CudaOptimizer : public CudaBlocks, public ::testing::WithParamInterface<OptCase> {};

TEST_P(CudaOptimizer, OneStepMatchesFloat64) {
  const OptCase c = GetParam();
  const bool adam = c.kind == OptimizerKind::adam;
  const std::uint64_t seed = fresh_seed();
  const auto w0 = uniform(c.n, seed), g = stored(uniform(c.n, seed + 1), c.param);
  const auto m0 = uniform(c.n, seed + 2, -0.1, 0.1), v0 = uniform(c.n, seed + 3, 0.0, 0.01);
  OptimizerStep o;
  o.kind = c.kind;
  o.lr = 1e-2f;
  o.weight_decay = 0.1f;
  o.step = 7;
  o.param = make({c.n}, c.param, c.master ? stored(w0, c.param) : w0, MemCategory::weights);
  o.grad = make({c.n}, c.param, g, MemCategory::gradients);
  if (c.master) o.master = make({c.n}, DType::f32, w0, MemCategory::optimizer);
  if (adam) {
    o.m = make({c.n}, DType::f32, m0, MemCategory::optimizer);
    o.v = make({c.n}, DType::f32, v0, MemCategory::optimizer);
  }
  b->optimizer_step(*s, o);

  Vec w = dbl(w0), m = dbl(m0), v = dbl(v0);
  cuda_ref::optimizer_step(c.kind, w, dbl(g), m, v, o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, o.step);
  const double t32 = 1e-5;
  EXPECT_TRUE(all_close("weights", b->download(c.master ? o.master : o.param), w, t32));
  if (c.master) {
    EXPECT_TRUE(all_close("param (from master)", b->download(o.param), w, tol(c.param)));
  }
  if (adam) {
    EXPECT_TRUE(all_close("m", b->download(o.m), m, t32));
    EXPECT_TRUE(all_close("v", b->download(o.v), v, t32));
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, CudaOptimizer,
                         ::testing::Values(OptCase{OptimizerKind::sgd, DType::f32, false, 7},
                                           OptCase{OptimizerKind::adam, DType::f32, false, 4811},
                                           OptCase{OptimizerKind::adam, DType::f32, true, 7},
                                           OptCase{OptimizerKind::sgd, DType::bf16, true, 4811},
                                           OptCase{OptimizerKind::adam, DType::bf16, true, 4811}),
                         [](const auto& i) {
                           std::ostringstream o;
                           o << i.param;
                           return o.str();
                         });

// ---- every op is one timed record ---------------------------------------------------------

TEST_F(CudaBlocks, EachOpIsOneTimelineRecord) {
  const AttentionShape a{1, 5, 2, 1, 16, true};
  const i64 T = a.tokens(), M = 8, V = 11, W = a.qkv_width();
  Tensor ids = make_i32({T}, {1, 2, 3, 4, 5}), wte = make({V, M}, DType::f32, uniform(V * M, 1));
  Tensor x = b->empty({T, M}, DType::f32, MemCategory::activations, *s);
  Tensor gamma = make({M}, DType::f32, uniform(M, 2)), y = b->empty({T, M}, DType::f32, MemCategory::activations, *s);
  Tensor mean = b->empty({T}, DType::f32, MemCategory::activations, *s);
  Tensor rstd = b->empty({T}, DType::f32, MemCategory::activations, *s);
  Tensor qkv = make({T, W}, DType::f32, uniform(T * W, 3)), out = b->empty({T, 32}, DType::f32, MemCategory::activations, *s);
  Tensor lse = b->empty({1, 2, 5}, DType::f32, MemCategory::activations, *s), none;
  b->clear_timeline();
  b->embedding_forward(*s, ids, wte, none, 5, x);
  b->norm_forward(*s, NormKind::layernorm, 1e-5f, x, gamma, none, y, mean, rstd);
  b->rope(*s, a, 10000.0f, false, qkv);
  b->attention_forward(*s, a, qkv, out, lse);
  b->add(*s, x, y, x);
  b->synchronize();
  std::vector<std::string> names;
  for (const auto& r : b->timeline()) names.push_back(r.name);
  EXPECT_EQ(names, (std::vector<std::string>{"embedding", "layernorm", "rope", "attention", "add"}));
}

// ---- the pinned host pool ---------------------------------------------------------------

// An offloading step as PipeOffload-style schedules issue it: in forward, each layer's
// activation is copied to a fresh pinned buffer on the d2h stream; in backward, each is
// copied back on the h2d stream and its pinned buffer freed (ordered after the copy by an
// event). After the first step the pool holds every buffer the step needs, so the second
// step makes no cudaHostAlloc at all, while the tracker still counts logical bytes.
TEST_F(CudaBlocks, PinnedPoolSecondOffloadStepAllocatesNothing) {
  Stream& d2h = b->create_stream(StreamRole::d2h, "d2h");
  Stream& h2d = b->create_stream(StreamRole::h2d, "h2d");
  const std::vector<std::pair<i64, DType>> layers{{37 * 1000, DType::f32}, {130 * 7, DType::bf16},
                                                  {300'000, DType::bf16}, {37 * 1000, DType::f32}};
  std::size_t logical = 0;
  for (auto [n, dt] : layers) logical += static_cast<std::size_t>(n) * dtype_size(dt);
  const std::uint64_t seed = fresh_seed();

  auto step = [&] {
    std::vector<Tensor> acts, pinned;
    auto fwd = b->create_event(), bwd = b->create_event();
    for (std::size_t l = 0; l < layers.size(); ++l) {
      const auto [n, dt] = layers[l];
      acts.push_back(make({n}, dt, stored(uniform(n, seed + l), dt)));
      b->record(*fwd, *s);
      b->wait(d2h, *fwd);
      pinned.push_back(b->empty({n}, dt, MemCategory::activations, d2h, MemSpace::host_pinned));
      b->copy(d2h, acts.back(), pinned.back());
    }
    EXPECT_EQ(b->memory().in_use(MemCategory::host_pinned), logical);
    b->record(*fwd, d2h);
    b->wait(h2d, *fwd);
    for (std::size_t l = layers.size(); l-- > 0;) {
      const auto [n, dt] = layers[l];
      Tensor back = b->empty({n}, dt, MemCategory::activations, h2d);
      b->copy(h2d, pinned[l], back);
      b->record(*bwd, h2d);
      b->wait(d2h, *bwd);  // the free below is ordered on d2h, after the copy that reads it
      pinned.pop_back();
      b->synchronize(h2d);
      EXPECT_EQ(b->download(back), b->download(acts[l])) << "layer " << l;
    }
    EXPECT_EQ(b->memory().in_use(MemCategory::host_pinned), 0u);
    b->synchronize();
  };

  const auto before = cuda_host_pool_stats(*b);
  step();
  const auto warm = cuda_host_pool_stats(*b);
  EXPECT_GE(warm.raw_allocs - before.raw_allocs, layers.size());
  step();
  const auto second = cuda_host_pool_stats(*b);
  EXPECT_EQ(second.raw_allocs, warm.raw_allocs) << "the second step called cudaHostAlloc";
  EXPECT_EQ(second.raw_releases, before.raw_releases) << "cudaFreeHost before empty_cache";
  EXPECT_EQ(second.requests - warm.requests, warm.requests - before.requests);
  EXPECT_EQ(second.bytes_in_use, before.bytes_in_use);
  EXPECT_GE(second.bytes_held, logical);
  EXPECT_EQ(b->memory().peak_per_category()[static_cast<std::size_t>(MemCategory::host_pinned)], logical);

  b->release_cached_host_memory();
  const auto emptied = cuda_host_pool_stats(*b);
  EXPECT_EQ(emptied.bytes_held, emptied.bytes_in_use);
  EXPECT_EQ(emptied.raw_releases - before.raw_releases, warm.raw_allocs - before.raw_allocs);
}

// MPipeMoE's granularity search times a forward at every candidate n; with an offloading
// strategy each trial pins buffers of its own n's sizes, and they return to the pool when the
// next trial begins. Once the search has chosen, the layer gives the pool's cache back: after
// the searching forward the pool holds only what its saved state still uses.
TEST_F(CudaBlocks, MPipeMoESearchGivesItsTrialsPinnedMemoryBack) {
  register_builtin_impls();
  auto comm = make_self_communicator(*b);
  const ModelConfig m{.d_model = 64, .d_hidden = 128, .num_experts = 4, .top_k = 2, .dtype = DType::f32};
  const i64 T = 512;  // min_partition_tokens 64: n = 1, 2, 4, 8 are candidates
  auto layer = make_impl("mpipemoe", *b, *comm, m, {{"partitions", "auto"}, {"strategy", "S1"}});
  layer->init_parameters(fresh_seed());
  Tensor x = make({T, m.d_model}, DType::f32, uniform(T * m.d_model, fresh_seed()));
  const auto before = cuda_host_pool_stats(*b);
  Tensor y = layer->forward(x);
  b->synchronize();
  const nlohmann::json search = layer->report()["granularity_search"];
  ASSERT_NE(search.dump().find("\"how\":\"trials\""), std::string::npos) << search.dump();
  const auto after = cuda_host_pool_stats(*b);
  EXPECT_GT(after.raw_allocs, before.raw_allocs) << "the S1 trials pinned nothing: " << search.dump();
  EXPECT_GT(after.bytes_in_use, 0u) << "the chosen forward's offloaded buffers";
  // The trials held more than the chosen forward keeps: what the release below must give back.
  EXPECT_GT(after.peak_bytes_held, after.bytes_in_use) << search.dump();
  EXPECT_EQ(after.bytes_held, after.bytes_in_use) << "the trials' blocks stayed cached: " << search.dump();
  layer->backward(y, 0.1f);
  b->synchronize();
  EXPECT_EQ(cuda_host_pool_stats(*b).bytes_in_use, 0u);
}

}  // namespace
}  // namespace moelab
