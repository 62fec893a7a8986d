// harness/tests/blocks_ops_test.cpp — the transformer-block ops (Backend, "transformer-block
// ops"): the float64 reference (blocks_reference.hpp) checked by central finite differences;
// the cpu backend's forward and backward against it on fresh random seeds and awkward sizes;
// attention's memory staying O(S·D); the vocabulary-parallel embedding and cross-entropy over
// shards against the whole vocabulary's reference; Adam and SGD against hand-computed steps; and every op's
// timeline record, on cpu and on sim, carrying exactly its cost function's figures.
//   ctest --test-dir build -R blocks_ops --output-on-failure
//   MOELAB_TEST_SEED=<n> build/harness/tests/blocks_ops_test --gtest_filter='*Attention*'
//
// Tolerances compare fp32 results with float64 ones (all_close: |got − ref| <= rtol·(max|ref| +
// |ref|)); each is about ten times the worst error seen over many seeds:
//   embedding, add, scale, rope                1e-6 (a copy, one add or multiply, or one rotation)
//   gated combine: out, da, db; dz             1e-6; 1e-5 (row dot products of up to 300 terms)
//   swiglu                                     2e-6
//   norms: y, mean, rstd, dγ, dβ               5e-6 (rows of up to 1000, sums over 37 rows)
//   norms: dx                                  1e-5 of max rstd·|dy·γ|, the size of the terms
//                                              whose difference it is (see the test)
//   attention: out, lse, d_qkv                 1e-5, 2e-6, 1e-5 (fp32 sums over up to 257 keys)
//   cross-entropy: losses, lse, d_logits       1e-5, 2e-6, 1e-6; d_logits 2e-4 at logits ~1e3
//                                              (an fp32 logit there is only good to 6e-5)
//   optimizers                                 1e-6 after five steps
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "harness/backends/sim/sim_backend.hpp"
#include "harness/runtime/backend.hpp"
#include "harness/runtime/error.hpp"
#include "harness/tests/blocks_reference.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab {
namespace {

using blocks_ref::Ids;
using blocks_ref::Vec;
using test::all_close;
using test::to_double;

// ---- helpers ------------------------------------------------------------------------------------

std::vector<float> random_floats(std::size_t n, std::uint64_t seed, std::uint64_t key, double lo = -1, double hi = 1) {
  return test::uniform(n, Rng::mix(seed, key), lo, hi);
}

Ids random_ids(std::size_t n, std::uint64_t seed, std::uint64_t key, std::int32_t lo, std::int32_t hi) {
  Rng r(Rng::mix(seed, key));
  Ids v(n);
  for (auto& x : v) x = lo + static_cast<std::int32_t>(r.next() % static_cast<std::uint64_t>(hi - lo + 1));
  return v;
}

using Cpu = test::Cpu;

// Central differences of a scalar function at up to `samples` entries of x, against `grad`.
::testing::AssertionResult matches_finite_differences(const std::string& what,
                                                      const std::function<double(const Vec&)>& L, Vec x,
                                                      const Vec& grad, std::uint64_t seed, int samples = 40) {
  const double h = 1e-5;
  double scale = 1e-12;
  for (double g : grad) scale = std::max(scale, std::abs(g));
  Rng r(seed);
  const auto count = std::min(x.size(), static_cast<std::size_t>(samples));  // every entry, or random ones
  for (std::size_t n = 0; n < count; ++n) {
    const std::size_t i = count == x.size() ? n : static_cast<std::size_t>(r.next() % x.size());
    const double x0 = x[i];
    x[i] = x0 + h;
    const double up = L(x);
    x[i] = x0 - h;
    const double down = L(x);
    x[i] = x0;
    const double fd = (up - down) / (2 * h);
    if (std::abs(fd - grad[i]) > 1e-6 * scale + 1e-6 * std::abs(grad[i]))
      return ::testing::AssertionFailure() << what << "[" << i << "]: finite difference " << fd << ", gradient "
                                           << grad[i] << " (gradient scale " << scale << ")";
  }
  return ::testing::AssertionSuccess();
}

// Every element within an absolute tolerance (for results that are small differences of large
// terms, judged on the terms' scale).
::testing::AssertionResult within(const std::string& what, const std::vector<float>& got, const Vec& ref, double atol) {
  if (got.size() != ref.size())
    return ::testing::AssertionFailure() << what << ": size " << got.size() << " vs " << ref.size();
  for (std::size_t i = 0; i < got.size(); ++i)
    if (!(std::abs(got[i] - ref[i]) <= atol))
      return ::testing::AssertionFailure() << what << "[" << i << "] = " << got[i] << ", reference " << ref[i]
                                           << " (absolute tolerance " << atol << ")";
  return ::testing::AssertionSuccess();
}

double dot(const Vec& a, const Vec& b) {
  double s = 0;
  for (std::size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

Vec dvec(std::size_t n, std::uint64_t seed, std::uint64_t key, double lo = -1, double hi = 1) {
  return to_double(random_floats(n, seed, key, lo, hi));
}

// ---- the float64 reference against finite differences -----------------------------------------------

TEST(BlocksReference, EmbeddingGradientsMatchFiniteDifferences) {
  const std::uint64_t seed = test::fresh_seed();
  const std::int64_t V = 5, M = 3, S = 4, T = 8;
  const Ids ids = random_ids(T, seed, 1, 0, V - 1);
  const Vec wte = dvec(V * M, seed, 2), wpe = dvec(S * M, seed, 3), w = dvec(T * M, seed, 4);
  Vec d_wte(wte.size(), 0.0), d_wpe(wpe.size(), 0.0);
  blocks_ref::embedding_backward(ids, w, M, S, d_wte, d_wpe);
  EXPECT_TRUE(matches_finite_differences(
      "d_wte", [&](const Vec& p) { return dot(w, blocks_ref::embedding_forward(ids, p, wpe, M, S)); }, wte, d_wte,
      seed));
  EXPECT_TRUE(matches_finite_differences(
      "d_wpe", [&](const Vec& p) { return dot(w, blocks_ref::embedding_forward(ids, wte, p, M, S)); }, wpe, d_wpe,
      seed));
}

TEST(BlocksReference, NormGradientsMatchFiniteDifferences) {
  const std::uint64_t seed = test::fresh_seed();
  for (NormKind kind : {NormKind::layernorm, NormKind::rmsnorm}) {
    SCOPED_TRACE(norm_name(kind));
    const std::int64_t T = 3, M = 6;
    const double eps = 1e-5;
    const Vec x = dvec(T * M, seed, 1, -2, 2), gamma = dvec(M, seed, 2, 0.5, 1.5), beta = dvec(M, seed, 3),
              w = dvec(T * M, seed, 4);
    Vec dx, dg, db;
    blocks_ref::norm_backward(kind, eps, x, M, gamma, w, dx, dg, db);
    auto L = [&](const Vec& xx, const Vec& g, const Vec& bb) {
      return dot(w, blocks_ref::norm_forward(kind, eps, xx, M, g, bb).y);
    };
    EXPECT_TRUE(matches_finite_differences(
        "dx", [&](const Vec& p) { return L(p, gamma, beta); }, x, dx, seed));
    EXPECT_TRUE(matches_finite_differences(
        "dgamma", [&](const Vec& p) { return L(x, p, beta); }, gamma, dg, seed));
    if (kind == NormKind::layernorm) {
      EXPECT_TRUE(matches_finite_differences(
          "dbeta", [&](const Vec& p) { return L(x, gamma, p); }, beta, db, seed));
    }
  }
}

TEST(BlocksReference, RopeBackwardIsTheInverseRotation) {
  const std::uint64_t seed = test::fresh_seed();
  AttentionShape a{.batch = 2, .seq = 3, .heads = 2, .kv_heads = 1, .head_dim = 4};
  const Vec x = dvec(static_cast<std::size_t>(a.tokens() * a.qkv_width()), seed, 1);
  const Vec w = dvec(x.size(), seed, 2);
  const Vec grad = blocks_ref::rope(a, 100.0, true, w);
  EXPECT_TRUE(matches_finite_differences(
      "d_qkv", [&](const Vec& p) { return dot(w, blocks_ref::rope(a, 100.0, false, p)); }, x, grad, seed, 60));
}

TEST(BlocksReference, AttentionGradientsMatchFiniteDifferences) {
  const std::uint64_t seed = test::fresh_seed();
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "bidirectional");
    AttentionShape a{.batch = 2, .seq = 5, .heads = 4, .kv_heads = 2, .head_dim = 3, .causal = causal};
    const Vec qkv = dvec(static_cast<std::size_t>(a.tokens() * a.qkv_width()), seed, 1, -2, 2);
    const Vec w = dvec(static_cast<std::size_t>(a.tokens() * a.heads * a.head_dim), seed, 2);
    const Vec grad = blocks_ref::attention_backward(a, qkv, w);
    EXPECT_TRUE(matches_finite_differences(
        "d_qkv", [&](const Vec& p) { return dot(w, blocks_ref::attention_forward(a, p).out); }, qkv, grad, seed, 80));
  }
}

TEST(BlocksReference, SwigluAndCrossEntropyGradientsMatchFiniteDifferences) {
  const std::uint64_t seed = test::fresh_seed();
  const std::int64_t T = 4, F = 5, V = 6;
  const Vec h = dvec(T * 2 * F, seed, 1, -4, 4), w = dvec(T * F, seed, 2);
  EXPECT_TRUE(matches_finite_differences(
      "d_h", [&](const Vec& p) { return dot(w, blocks_ref::swiglu_forward(p, F)); }, h,
      blocks_ref::swiglu_backward(h, w, F), seed));
  const Vec logits = dvec(T * V, seed, 3, -3, 3);
  const Ids targets = {2, -1, 0, 5};
  const double scale = 0.7;
  auto L = [&](const Vec& p) {
    double s = 0;
    for (double l : blocks_ref::cross_entropy_forward(p, targets, V).losses) s += scale * l;
    return s;
  };
  EXPECT_TRUE(matches_finite_differences("d_logits", L, logits,
                                         blocks_ref::cross_entropy_backward(logits, targets, V, scale), seed));
}

TEST(BlocksReference, GatedCombineGradientsMatchFiniteDifferences) {
  const std::uint64_t seed = test::fresh_seed();
  const std::int64_t T = 3, M = 4;
  for (std::size_t G : {1u, 2u}) {
    SCOPED_TRACE("G=" + std::to_string(G));
    const Vec z = dvec(static_cast<std::size_t>(T) * G, seed, 1, -3, 3), a = dvec(T * M, seed, 2), b = dvec(T * M, seed, 3);
    const Vec w = dvec(T * M, seed, 4);
    Vec da, db, dz;
    blocks_ref::gated_combine_backward(z, a, b, w, G, da, db, dz);
    const auto L = [&](const Vec& zz, const Vec& aa, const Vec& bb) { return dot(w, blocks_ref::gated_combine_forward(zz, aa, bb, G)); };
    EXPECT_TRUE(matches_finite_differences("dz", [&](const Vec& p) { return L(p, a, b); }, z, dz, seed));
    EXPECT_TRUE(matches_finite_differences("da", [&](const Vec& p) { return L(z, p, b); }, a, da, seed));
    EXPECT_TRUE(matches_finite_differences("db", [&](const Vec& p) { return L(z, a, p); }, b, db, seed));
  }
}

// ---- cpu against the reference: attention ---------------------------------------------------------

struct AttnCase {
  std::int64_t batch, seq;
  int heads, kv_heads, head_dim;
  bool causal;
};

std::string attn_name(const ::testing::TestParamInfo<AttnCase>& i) {
  const AttnCase& c = i.param;
  return "B" + std::to_string(c.batch) + "_S" + std::to_string(c.seq) + "_H" + std::to_string(c.heads) + "kv" +
         std::to_string(c.kv_heads) + "_D" + std::to_string(c.head_dim) + (c.causal ? "_causal" : "_bidir");
}

std::vector<AttnCase> attention_cases() {
  std::vector<AttnCase> v;
  for (std::int64_t S : {1, 37, 130, 257})
    for (std::int64_t B : {1, 3})
      for (auto [hq, hkv] : {std::pair{4, 4}, {4, 2}, {4, 1}, {6, 3}})
        for (int D : {8, 16, 64})
          for (bool causal : {true, false}) v.push_back({B, S, hq, hkv, D, causal});
  return v;
}

class AttentionVsReference : public ::testing::TestWithParam<AttnCase> {};

TEST_P(AttentionVsReference, ForwardAndBackward) {
  const AttnCase& c = GetParam();
  const AttentionShape a{c.batch, c.seq, c.heads, c.kv_heads, c.head_dim, c.causal};
  const std::uint64_t seed = test::fresh_seed();
  const std::int64_t T = a.tokens(), W = a.qkv_width(), HD = static_cast<std::int64_t>(c.heads) * c.head_dim;
  // Scores of a few units (|q·k|/sqrt(D) up to ~4): sharp enough that the online max matters.
  const auto qkv = random_floats(static_cast<std::size_t>(T * W), seed, 1, -2, 2);
  const auto dout = random_floats(static_cast<std::size_t>(T * HD), seed, 2);
  Cpu cpu;
  Tensor tq = cpu.f32({T, W}, qkv), tout = cpu.zeros({T, HD}), tlse = cpu.zeros({a.batch, a.heads, a.seq});
  Tensor tdo = cpu.f32({T, HD}, dout), tdq = cpu.f32({T, W}, std::vector<float>(static_cast<std::size_t>(T * W), 7.0f));
  cpu.b->attention_forward(cpu.s, a, tq, tout, tlse);
  cpu.b->attention_backward(cpu.s, a, tq, tout, tlse, tdo, tdq);  // d_qkv is overwritten (not += 7)
  const auto ref = blocks_ref::attention_forward(a, to_double(qkv));
  EXPECT_TRUE(all_close("out", cpu.get(tout), ref.out, 1e-5));
  EXPECT_TRUE(all_close("lse", cpu.get(tlse), ref.lse, 2e-6));
  EXPECT_TRUE(
      all_close("d_qkv", cpu.get(tdq), blocks_ref::attention_backward(a, to_double(qkv), to_double(dout)), 1e-5));
}

INSTANTIATE_TEST_SUITE_P(Shapes, AttentionVsReference, ::testing::ValuesIn(attention_cases()), attn_name);

// A causal row's output at position p depends on keys 0..p only: changing the last token's
// key and value leaves every earlier output unchanged (bit for bit: the earlier tiles never
// read it).
TEST(Attention, CausalOutputsIgnoreLaterTokens) {
  const std::uint64_t seed = test::fresh_seed();
  const AttentionShape a{.batch = 1, .seq = 200, .heads = 2, .kv_heads = 1, .head_dim = 8, .causal = true};
  const std::int64_t T = a.tokens(), W = a.qkv_width();
  auto qkv = random_floats(static_cast<std::size_t>(T * W), seed, 1);
  Cpu cpu;
  Tensor tq = cpu.f32({T, W}, qkv), o1 = cpu.zeros({T, 16}), o2 = cpu.zeros({T, 16}), lse = cpu.zeros({1, 2, 200});
  cpu.b->attention_forward(cpu.s, a, tq, o1, lse);
  for (std::int64_t c = 2 * 8; c < W; ++c) qkv[static_cast<std::size_t>((T - 1) * W + c)] += 1.0f;
  Tensor tq2 = cpu.f32({T, W}, qkv);
  cpu.b->attention_forward(cpu.s, a, tq2, o2, lse);
  const auto v1 = cpu.get(o1), v2 = cpu.get(o2);
  for (std::int64_t i = 0; i < (T - 1) * 16; ++i)
    ASSERT_EQ(v1[static_cast<std::size_t>(i)], v2[static_cast<std::size_t>(i)]) << i;
}

// No [S,S] score matrix, and attention's memory is the same formula on every backend: its
// inputs, outputs and saved lse, nothing else tracked (its tiles live inside the op, as a GPU
// kernel's live in shared memory), at S = 2048 as at any S.
TEST(Attention, MemoryStaysLinearInSequenceLength) {
  const AttentionShape a{.batch = 1, .seq = 2048, .heads = 1, .kv_heads = 1, .head_dim = 16, .causal = true};
  const std::int64_t T = a.tokens(), W = a.qkv_width(), S = a.seq, D = a.head_dim;
  Cpu cpu;
  Tensor tq = cpu.f32({T, W}, random_floats(static_cast<std::size_t>(T * W), 1, 1)), tout = cpu.zeros({T, D});
  Tensor tlse = cpu.zeros({1, 1, S}), tdo = cpu.f32({T, D}, random_floats(static_cast<std::size_t>(T * D), 1, 2));
  Tensor tdq = cpu.zeros({T, W});
  cpu.b->synchronize();
  const std::size_t before = cpu.b->memory().device_in_use();
  cpu.b->memory().reset_peak();
  cpu.b->attention_forward(cpu.s, a, tq, tout, tlse);
  cpu.b->attention_backward(cpu.s, a, tq, tout, tlse, tdo, tdq);
  cpu.b->synchronize();
  const std::size_t extra = cpu.b->memory().peak_device() - before;
  EXPECT_EQ(extra, 0u) << "attention allocated tracked memory beyond its outputs";
  const auto o = cpu.get(tout);
  for (float v : o) ASSERT_TRUE(std::isfinite(v));
}

// ---- cpu against the reference: the other ops -------------------------------------------------------

TEST(Rope, ForwardAndInverseMatchReference) {
  const std::uint64_t seed = test::fresh_seed();
  for (const AttentionShape& a : {AttentionShape{.batch = 3, .seq = 37, .heads = 6, .kv_heads = 3, .head_dim = 16},
                                  AttentionShape{.batch = 1, .seq = 257, .heads = 4, .kv_heads = 1, .head_dim = 64}}) {
    SCOPED_TRACE("S=" + std::to_string(a.seq));
    const std::int64_t T = a.tokens(), W = a.qkv_width();
    const auto x = random_floats(static_cast<std::size_t>(T * W), seed, 1);
    Cpu cpu;
    Tensor t = cpu.f32({T, W}, x);
    cpu.b->rope(cpu.s, a, 10000.0f, false, t);
    const auto fwd = cpu.get(t);
    EXPECT_TRUE(all_close("rope", fwd, blocks_ref::rope(a, 10000.0, false, to_double(x)), 1e-6));
    cpu.b->rope(cpu.s, a, 10000.0f, true, t);
    EXPECT_TRUE(all_close("rope_inverse", cpu.get(t), blocks_ref::rope(a, 10000.0, true, to_double(fwd)), 1e-6));
    EXPECT_TRUE(all_close("round trip", cpu.get(t), to_double(x), 1e-6));  // value heads untouched too
  }
}

TEST(Norm, ForwardAndBackwardMatchReference) {
  const std::uint64_t seed = test::fresh_seed();
  for (NormKind kind : {NormKind::layernorm, NormKind::rmsnorm})
    for (std::int64_t M : {1, 7, 1000})
      for (bool with_beta : {true, false}) {
        SCOPED_TRACE(std::string(norm_name(kind)) + " M=" + std::to_string(M) + (with_beta ? " beta" : ""));
        const std::int64_t T = 37;
        const float eps = 1e-5f;
        const auto x = random_floats(static_cast<std::size_t>(T * M), seed, 1, -3, 5);  // off-centre rows
        const auto g = random_floats(static_cast<std::size_t>(M), seed, 2, 0.5, 1.5);
        const auto bt = random_floats(static_cast<std::size_t>(M), seed, 3);
        const auto dy = random_floats(static_cast<std::size_t>(T * M), seed, 4);
        const auto dg0 = random_floats(static_cast<std::size_t>(M), seed, 5),
                   db0 = random_floats(static_cast<std::size_t>(M), seed, 6);
        Cpu cpu;
        Tensor tx = cpu.f32({T, M}, x), tg = cpu.f32({M}, g), tb = with_beta ? cpu.f32({M}, bt) : Tensor();
        Tensor ty = cpu.zeros({T, M}), tm = cpu.zeros({T}), tr = cpu.zeros({T});
        Tensor tdy = cpu.f32({T, M}, dy), tdx = cpu.zeros({T, M}), tdg = cpu.f32({M}, dg0), tdb = cpu.f32({M}, db0);
        cpu.b->norm_forward(cpu.s, kind, eps, tx, tg, tb, ty, tm, tr);
        cpu.b->norm_backward(cpu.s, kind, tx, tg, tm, tr, tdy, tdx, tdg, tdb);
        const Vec beta_ref = with_beta ? to_double(bt) : Vec{};
        const auto ref = blocks_ref::norm_forward(kind, eps, to_double(x), M, to_double(g), beta_ref);
        EXPECT_TRUE(all_close("y", cpu.get(ty), ref.y, 5e-6));
        EXPECT_TRUE(all_close("rstd", cpu.get(tr), ref.rstd, 5e-6));
        if (kind == NormKind::layernorm) {
          EXPECT_TRUE(all_close("mean", cpu.get(tm), ref.mean, 5e-6));
        }
        Vec dx, dg, db;
        blocks_ref::norm_backward(kind, eps, to_double(x), M, to_double(g), to_double(dy), dx, dg, db);
        for (std::size_t i = 0; i < dg.size(); ++i) dg[i] += dg0[i], db[i] += db0[i];  // accumulated
        // dx = rstd·(dy·γ − ...) cancels almost completely for rmsnorm at M = 1 (it is then
        // rstd·dy·γ·eps/(x² + eps)): judged against the size of the cancelling terms.
        double terms = 0;
        for (std::int64_t t = 0; t < T; ++t)
          for (std::int64_t c = 0; c < M; ++c)
            terms =
                std::max(terms, ref.rstd[static_cast<std::size_t>(t)] *
                                    std::abs(dy[static_cast<std::size_t>(t * M + c)] * g[static_cast<std::size_t>(c)]));
        const auto gdx = cpu.get(tdx);
        EXPECT_TRUE(within("dx", gdx, dx, 1e-5 * terms));
        // d_gamma and d_beta are sums over the T rows (plus what they held), which may cancel to
        // far less than their terms: judged against the sum of the terms' sizes, as fp32
        // summation errs (at M = 1 a d_beta of 0.014 from terms of size ~1 once failed a
        // relative tolerance with an error of 2e-7).
        double g_terms = 0, b_terms = 0;
        for (std::int64_t c = 0; c < M; ++c) {
          double sg = std::abs(dg0[static_cast<std::size_t>(c)]), sb = std::abs(db0[static_cast<std::size_t>(c)]);
          for (std::int64_t t = 0; t < T; ++t) {
            const auto i = static_cast<std::size_t>(t * M + c), r = static_cast<std::size_t>(t);
            const double mean = kind == NormKind::layernorm ? ref.mean[r] : 0.0;
            sg += std::abs(dy[i] * (x[i] - mean) * ref.rstd[r]);
            sb += std::abs(dy[i]);
          }
          g_terms = std::max(g_terms, sg);
          b_terms = std::max(b_terms, sb);
        }
        EXPECT_TRUE(within("d_gamma", cpu.get(tdg), dg, 5e-6 * g_terms));
        EXPECT_TRUE(within("d_beta", cpu.get(tdb), db, 5e-6 * b_terms));
      }
}

TEST(Embedding, RepeatedIdsAccumulate) {
  const std::uint64_t seed = test::fresh_seed();
  for (bool learned : {true, false}) {
    SCOPED_TRACE(learned ? "learned positions" : "no positions");
    const std::int64_t V = 7, M = 16, S = 5, B = 3, T = B * S;  // 15 ids over 7 rows: repeats
    const Ids ids = random_ids(T, seed, 1, 0, V - 1);
    const auto wte = random_floats(static_cast<std::size_t>(V * M), seed, 2),
               wpe = random_floats(static_cast<std::size_t>(S * M), seed, 3);
    const auto dy = random_floats(static_cast<std::size_t>(T * M), seed, 4);
    const auto dte0 = random_floats(wte.size(), seed, 5), dpe0 = random_floats(wpe.size(), seed, 6);
    Cpu cpu;
    Tensor tid = cpu.i32(ids), tte = cpu.f32({V, M}, wte), tpe = learned ? cpu.f32({S, M}, wpe) : Tensor();
    Tensor tout = cpu.zeros({T, M}), tdy = cpu.f32({T, M}, dy), tdte = cpu.f32({V, M}, dte0);
    Tensor tdpe = learned ? cpu.f32({S, M}, dpe0) : Tensor();
    cpu.b->embedding_forward(cpu.s, tid, tte, tpe, S, tout);
    cpu.b->embedding_backward(cpu.s, tdy, tid, S, tdte, tdpe);
    EXPECT_TRUE(all_close("out", cpu.get(tout),
                          blocks_ref::embedding_forward(ids, to_double(wte), learned ? to_double(wpe) : Vec{}, M, S),
                          1e-6));
    Vec dte = to_double(dte0), dpe = learned ? to_double(dpe0) : Vec{};
    blocks_ref::embedding_backward(ids, to_double(dy), M, S, dte, dpe);
    EXPECT_TRUE(all_close("d_wte", cpu.get(tdte), dte, 1e-6));
    if (learned) {
      EXPECT_TRUE(all_close("d_wpe", cpu.get(tdpe), dpe, 1e-6));
    }
  }
}

TEST(Embedding, AnIdOutsideTheVocabularyIsAnError) {
  Cpu cpu;
  Tensor tid = cpu.i32({0, 3}), tte = cpu.zeros({3, 2}), tout = cpu.zeros({2, 2});
  cpu.b->embedding_forward(cpu.s, tid, tte, Tensor(), 2, tout);
  EXPECT_THROW(cpu.b->synchronize(), ConfigError);
}

TEST(Swiglu, ForwardAndBackwardMatchReference) {
  const std::uint64_t seed = test::fresh_seed();
  for (std::int64_t F : {1, 7, 130}) {
    SCOPED_TRACE("F=" + std::to_string(F));
    const std::int64_t T = 37;
    const auto h = random_floats(static_cast<std::size_t>(T * 2 * F), seed, 1, -6, 6);
    const auto dy = random_floats(static_cast<std::size_t>(T * F), seed, 2);
    Cpu cpu;
    Tensor th = cpu.f32({T, 2 * F}, h), tout = cpu.zeros({T, F}), tdy = cpu.f32({T, F}, dy),
           tdh = cpu.zeros({T, 2 * F});
    cpu.b->swiglu_forward(cpu.s, th, tout);
    cpu.b->swiglu_backward(cpu.s, th, tdy, tdh);
    EXPECT_TRUE(all_close("out", cpu.get(tout), blocks_ref::swiglu_forward(to_double(h), F), 2e-6));
    EXPECT_TRUE(all_close("d_h", cpu.get(tdh), blocks_ref::swiglu_backward(to_double(h), to_double(dy), F), 2e-6));
  }
}

TEST(Add, ElementwiseAndInPlace) {
  const std::uint64_t seed = test::fresh_seed();
  const std::int64_t n = 1001;
  const auto x = random_floats(n, seed, 1), y = random_floats(n, seed, 2);
  Cpu cpu;
  Tensor tx = cpu.f32({n}, x), ty = cpu.f32({n}, y), tz = cpu.zeros({n});
  cpu.b->add(cpu.s, tx, ty, tz);
  cpu.b->add(cpu.s, tx, ty, tx);  // out aliases a: gradient accumulation
  Vec ref(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < ref.size(); ++i) ref[i] = static_cast<double>(x[i]) + y[i];
  EXPECT_TRUE(all_close("out", cpu.get(tz), ref, 1e-6));
  EXPECT_TRUE(all_close("in place", cpu.get(tx), ref, 1e-6));
}

// ScMoE's combine gates: G = 1 (sigmoid, db left to the caller) and 2 (softmax), awkward
// widths; out may alias a.
TEST(GatedCombine, ForwardAndBackwardMatchReference) {
  const std::uint64_t seed = test::fresh_seed();
  for (std::int64_t M : {1, 7, 300})
    for (std::int64_t G : {1, 2}) {
      SCOPED_TRACE("M=" + std::to_string(M) + " G=" + std::to_string(G));
      const std::int64_t T = 37;
      const auto z = random_floats(static_cast<std::size_t>(T * G), seed, 1, -6, 6);
      const auto a = random_floats(static_cast<std::size_t>(T * M), seed, 2), b = random_floats(static_cast<std::size_t>(T * M), seed, 3);
      const auto dy = random_floats(static_cast<std::size_t>(T * M), seed, 4);
      Cpu cpu;
      Tensor tz = cpu.f32({T, G}, z), ta = cpu.f32({T, M}, a), tb = cpu.f32({T, M}, b), tdy = cpu.f32({T, M}, dy);
      Tensor out = cpu.zeros({T, M}), da = cpu.zeros({T, M}), db = cpu.zeros({T, M}), dz = cpu.zeros({T, G}), none;
      cpu.b->gated_combine_forward(cpu.s, tz, ta, tb, out);
      cpu.b->gated_combine_backward(cpu.s, tz, ta, G == 2 ? tb : none, tdy, da, G == 2 ? db : none, dz);
      Vec rda, rdb, rdz;
      blocks_ref::gated_combine_backward(to_double(z), to_double(a), to_double(b), to_double(dy), static_cast<std::size_t>(G),
                                         rda, rdb, rdz);
      const Vec ref = blocks_ref::gated_combine_forward(to_double(z), to_double(a), to_double(b), static_cast<std::size_t>(G));
      EXPECT_TRUE(all_close("out", cpu.get(out), ref, 1e-6));
      EXPECT_TRUE(all_close("da", cpu.get(da), rda, 1e-6));
      if (G == 2) {
        EXPECT_TRUE(all_close("db", cpu.get(db), rdb, 1e-6));
      }
      EXPECT_TRUE(all_close("dz", cpu.get(dz), rdz, 1e-5));
      cpu.b->gated_combine_forward(cpu.s, tz, ta, tb, ta);  // out aliases a
      EXPECT_EQ(cpu.get(ta), cpu.get(out));
    }
}

TEST(Scale, ElementwiseAndInPlace) {
  const std::uint64_t seed = test::fresh_seed();
  const std::int64_t n = 1001;
  const auto x = random_floats(n, seed, 1);
  const float alpha = 1.0f / 3.0f;  // the mean over three copies
  Cpu cpu;
  Tensor tx = cpu.f32({n}, x), tz = cpu.zeros({n});
  cpu.b->scale(cpu.s, tx, alpha, tz);
  cpu.b->scale(cpu.s, tx, alpha, tx);  // out aliases x: a gradient scaled where it is
  Vec ref(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < ref.size(); ++i) ref[i] = static_cast<double>(alpha) * x[i];
  EXPECT_TRUE(all_close("out", cpu.get(tz), ref, 1e-6));
  EXPECT_TRUE(all_close("in place", cpu.get(tx), ref, 1e-6));
}

TEST(CrossEntropy, IgnoredTargetsAndLargeLogits) {
  const std::uint64_t seed = test::fresh_seed();
  struct C {
    std::int64_t V;
    double offset, spread, rtol_grad;
  };
  // offset 1000: exp(logit) overflows fp32 (max ~ exp(88.7)) unless shifted by the row max.
  for (const C c : {C{1, 0, 3, 1e-6}, C{7, 0, 3, 1e-6}, C{1000, 0, 8, 1e-6}, C{300, 1000, 30, 2e-4}}) {
    SCOPED_TRACE("V=" + std::to_string(c.V) + " offset " + std::to_string(c.offset));
    const std::int64_t T = 37, V = c.V;
    const auto logits =
        random_floats(static_cast<std::size_t>(T * V), seed, 1, c.offset - c.spread, c.offset + c.spread);
    Ids targets = random_ids(T, seed, 2, -1, static_cast<std::int32_t>(V - 1));
    targets[0] = -1;  // at least one ignored row
    targets[1] = static_cast<std::int32_t>(V - 1);
    const float scale = 1.0f / 30.0f;
    Cpu cpu;
    Tensor tl = cpu.f32({T, V}, logits), tt = cpu.i32(targets), tloss = cpu.zeros({T}), tlse = cpu.zeros({T});
    Tensor td = cpu.f32({T, V}, std::vector<float>(static_cast<std::size_t>(T * V), 5.0f));
    cpu.b->cross_entropy_forward(cpu.s, tl, tt, tloss, tlse);
    cpu.b->cross_entropy_backward(cpu.s, tl, tt, tlse, scale, td);
    const auto ref = blocks_ref::cross_entropy_forward(to_double(logits), targets, V);
    const auto loss = cpu.get(tloss);
    EXPECT_TRUE(all_close("losses", loss, ref.losses, 1e-5));
    EXPECT_TRUE(all_close("lse", cpu.get(tlse), ref.lse, 2e-6));
    EXPECT_EQ(loss[0], 0.0f);
    const auto d = cpu.get(td);
    EXPECT_TRUE(all_close("d_logits", d, blocks_ref::cross_entropy_backward(to_double(logits), targets, V, scale),
                          c.rtol_grad));
    for (std::int64_t v = 0; v < V; ++v) EXPECT_EQ(d[static_cast<std::size_t>(v)], 0.0f) << "ignored row, column " << v;
  }
}

// Vocabulary-parallel embedding and cross-entropy (Megatron-LM): over P equal shards of the
// vocabulary, the shards' embeddings sum to the whole table's and their gradients are its
// rows; the shards' (loss, lse), combined, and their logit gradients are the whole row's —
// against the float64 reference, awkward shard counts, ignored targets and logits near 1e3.
TEST(VocabShards, ShardsCombineToTheWholeVocabulary) {
  const std::uint64_t seed = test::fresh_seed();
  const std::int64_t V = 30, M = 6, S = 5, T = 3 * S;
  for (std::int64_t P : {1, 2, 3, 15}) {
    for (double offset : {0.0, 1000.0}) {
      SCOPED_TRACE("P=" + std::to_string(P) + " offset " + std::to_string(offset));
      const std::int64_t R = V / P;  // rows (logit columns) per shard
      const Ids ids = random_ids(T, seed, 1, 0, V - 1);
      Ids targets = random_ids(T, seed, 2, -1, V - 1);
      targets[0] = -1;
      targets[1] = static_cast<std::int32_t>(V - 1);
      const auto wte = random_floats(static_cast<std::size_t>(V * M), seed, 3),
                 wpe = random_floats(static_cast<std::size_t>(S * M), seed, 4),
                 dy = random_floats(static_cast<std::size_t>(T * M), seed, 5);
      const auto logits = random_floats(static_cast<std::size_t>(T * V), seed, 6, offset - 8, offset + 8);
      const float scale = 0.25f;
      Cpu cpu;
      Tensor tid = cpu.i32(ids), ttg = cpu.i32(targets), tpe = cpu.f32({S, M}, wpe), tdy = cpu.f32({T, M}, dy);
      Vec emb(static_cast<std::size_t>(T * M), 0.0), dte(static_cast<std::size_t>(V * M), 0.0), dlog(logits.size());
      std::vector<float> parts;  // [P,2,T] as an all-gather stacks them
      std::vector<Tensor> keep;
      for (std::int64_t p = 0; p < P; ++p) {
        const VocabShard sh{p * R, V};
        std::vector<float> rows(wte.begin() + p * R * M, wte.begin() + (p + 1) * R * M), cols;
        for (std::int64_t t = 0; t < T; ++t)
          cols.insert(cols.end(), logits.begin() + t * V + p * R, logits.begin() + t * V + (p + 1) * R);
        Tensor tte = cpu.f32({R, M}, rows), out = cpu.zeros({T, M}), dw = cpu.zeros({R, M}), dpe = cpu.zeros({S, M});
        cpu.b->embedding_forward(cpu.s, tid, tte, p == 0 ? tpe : Tensor(), S, out, sh);
        cpu.b->embedding_backward(cpu.s, tdy, tid, S, dw, dpe, sh);
        const auto o = cpu.get(out), g = cpu.get(dw);
        for (std::size_t i = 0; i < o.size(); ++i) emb[i] += o[i];
        for (std::int64_t i = 0; i < R * M; ++i) dte[static_cast<std::size_t>(p * R * M + i)] = g[static_cast<std::size_t>(i)];
        Tensor tl = cpu.f32({T, R}, cols), part = cpu.zeros({2, T});
        Tensor loss = part.select(0), lse = part.select(1);
        cpu.b->cross_entropy_forward(cpu.s, tl, ttg, loss, lse, sh);
        const auto pv = cpu.get(part);
        parts.insert(parts.end(), pv.begin(), pv.end());
        keep.push_back(tl);
      }
      EXPECT_TRUE(all_close("embedding", std::vector<float>(emb.begin(), emb.end()),
                            blocks_ref::embedding_forward(ids, to_double(wte), to_double(wpe), M, S), 1e-6));
      Vec ref_dte(dte.size(), 0.0), ref_dpe;
      blocks_ref::embedding_backward(ids, to_double(dy), M, S, ref_dte, ref_dpe);
      EXPECT_TRUE(all_close("d_wte", std::vector<float>(dte.begin(), dte.end()), ref_dte, 1e-6));
      Tensor tparts = cpu.f32({P, 2, T}, parts), tloss = cpu.zeros({T}), tlse = cpu.zeros({T});
      cpu.b->cross_entropy_combine(cpu.s, tparts, ttg, R, tloss, tlse);
      const auto ref = blocks_ref::cross_entropy_forward(to_double(logits), targets, V);
      EXPECT_TRUE(all_close("losses", cpu.get(tloss), ref.losses, offset > 0 ? 2e-5 : 1e-5));
      EXPECT_TRUE(all_close("lse", cpu.get(tlse), ref.lse, 2e-6));
      for (std::int64_t p = 0; p < P; ++p) {
        Tensor d = cpu.zeros({T, R});
        cpu.b->cross_entropy_backward(cpu.s, keep[static_cast<std::size_t>(p)], ttg, tlse, scale, d, VocabShard{p * R, V});
        const auto dv = cpu.get(d);
        for (std::int64_t t = 0; t < T; ++t)
          for (std::int64_t c = 0; c < R; ++c)
            dlog[static_cast<std::size_t>(t * V + p * R + c)] = dv[static_cast<std::size_t>(t * R + c)];
      }
      EXPECT_TRUE(all_close("d_logits", std::vector<float>(dlog.begin(), dlog.end()),
                            blocks_ref::cross_entropy_backward(to_double(logits), targets, V, scale),
                            offset > 0 ? 2e-4 : 1e-6));
    }
  }
}

TEST(VocabShards, AnIdOrTargetOutsideTheWholeVocabularyIsAnError) {
  Cpu cpu;
  Tensor tid = cpu.i32({0, 6}), tte = cpu.zeros({3, 2}), tout = cpu.zeros({2, 2});
  cpu.b->embedding_forward(cpu.s, tid, tte, Tensor(), 2, tout, VocabShard{3, 6});  // 6 is outside [0, 6)
  EXPECT_THROW(cpu.b->synchronize(), ConfigError);
  Tensor tl = cpu.zeros({2, 3}), tt = cpu.i32({1, 6}), loss = cpu.zeros({2}), lse = cpu.zeros({2});
  cpu.b->cross_entropy_forward(cpu.s, tl, tt, loss, lse, VocabShard{3, 6});
  EXPECT_THROW(cpu.b->synchronize(), ConfigError);
}

// ---- optimizers ----------------------------------------------------------------------------------

// With a constant gradient g Adam's bias-corrected moments are exactly g and g², so every step
// moves p by lr·(g/(|g| + eps) + wd·p): the sequence below is computed by hand from that.
TEST(Optimizer, AdamMatchesHandComputedSteps) {
  const float lr = 0.01f, wd = 0.1f, eps = 1e-8f;
  const std::vector<float> p0 = {1.0f, -2.0f, 0.5f}, g = {0.3f, -4.0f, 1e-3f};
  for (bool master : {false, true}) {
    SCOPED_TRACE(master ? "with master copy" : "in place");
    Cpu cpu;
    Tensor p = cpu.f32({3}, p0), tg = cpu.f32({3}, g), m = cpu.zeros({3}), v = cpu.zeros({3});
    Tensor mw = master ? cpu.f32({3}, p0) : Tensor();
    Vec hand = to_double(p0);
    for (std::int64_t t = 1; t <= 5; ++t) {
      OptimizerStep o{.kind = OptimizerKind::adam,
                      .param = p,
                      .grad = tg,
                      .master = mw,
                      .m = m,
                      .v = v,
                      .lr = lr,
                      .beta1 = 0.9f,
                      .beta2 = 0.999f,
                      .eps = eps,
                      .weight_decay = wd,
                      .step = t};
      cpu.b->optimizer_step(cpu.s, o);
      for (std::size_t i = 0; i < 3; ++i) hand[i] -= lr * (g[i] / (std::abs(g[i]) + eps) + wd * hand[i]);
      EXPECT_TRUE(all_close("p after step " + std::to_string(t), cpu.get(p), hand, 1e-6));
      if (master) {
        EXPECT_TRUE(all_close("master", cpu.get(mw), hand, 1e-6));
      }
    }
  }
}

// Varying gradients over five steps against the float64 reference step.
TEST(Optimizer, AdamAndSgdMatchReferenceOverSteps) {
  const std::uint64_t seed = test::fresh_seed();
  const std::int64_t n = 257;
  for (OptimizerKind kind : {OptimizerKind::adam, OptimizerKind::sgd}) {
    SCOPED_TRACE(kind == OptimizerKind::adam ? "adam" : "sgd");
    const auto p0 = random_floats(n, seed, 1);
    Cpu cpu;
    Tensor p = cpu.f32({n}, p0), m = cpu.zeros({n}), v = cpu.zeros({n});
    Vec ref = to_double(p0);
    blocks_ref::AdamState st;
    for (std::int64_t t = 1; t <= 5; ++t) {
      const auto g = random_floats(n, seed, 10 + static_cast<std::uint64_t>(t), -2, 2);
      Tensor tg = cpu.f32({n}, g);
      OptimizerStep o;
      o.kind = kind;
      o.param = p;
      o.grad = tg;
      if (kind == OptimizerKind::adam) o.m = m, o.v = v;
      o.lr = 0.05f;
      o.weight_decay = 0.2f;
      o.step = t;
      cpu.b->optimizer_step(cpu.s, o);
      if (kind == OptimizerKind::adam)
        blocks_ref::adam_step(ref, to_double(g), st, t, 0.05, 0.9f, 0.999f, 1e-8f, 0.2f);
      else
        blocks_ref::sgd_step(ref, to_double(g), 0.05f, 0.2f);
    }
    EXPECT_TRUE(all_close("p", cpu.get(p), ref, 1e-6));
  }
}

// ---- cost descriptors --------------------------------------------------------------------------------

TEST(BlockCosts, AttentionFlopsCountTheVisitedTiles) {
  AttentionShape a{.batch = 2, .seq = 1024, .heads = 8, .kv_heads = 2, .head_dim = 64, .causal = false};
  const double full = 4.0 * 2 * 8 * 1024.0 * 1024.0 * 64;
  EXPECT_EQ(cost_attention_forward(a, DType::bf16).flops, full);
  a.causal = true;  // 8 query tiles of 128: 1 + 2 + ... + 8 = 36 of the 64 tile pairs
  EXPECT_EQ(cost_attention_forward(a, DType::bf16).flops, full * 36.0 / 64.0);
  EXPECT_EQ(cost_attention_backward(a, DType::bf16).flops, 2.5 * full * 36.0 / 64.0);
  a.seq = 130;  // two query tiles: 128 rows see 128 keys, 2 rows see all 130
  EXPECT_EQ(cost_attention_forward(a, DType::bf16).flops, 4.0 * 2 * 8 * 64 * (128.0 * 128 + 2.0 * 130));
  // K and V are read once per query tile: bidirectionally, twice at S = 130.
  a.causal = false;
  const double q = 2 * 130 * 8 * 64 * 2.0;  // Q elements · bf16 bytes
  EXPECT_EQ(cost_attention_forward(a, DType::bf16).bytes_read, q + 2 * (2 * 8 * 64 * 130.0 * 2) * 2.0);
  EXPECT_EQ(cost_attention_forward(a, DType::bf16).bytes_written, q + 2 * 8 * 130 * 4.0);
}

// Every block op issued once, with the cost its cost function gives for those arguments.
struct Expected {
  std::string name;
  OpCost cost;
};

std::vector<Expected> issue_every_block_op(Backend& b, Stream& s) {
  const std::int64_t B = 2, S = 9, M = 8, V = 11, F = 6, T = B * S;
  const AttentionShape a{.batch = B, .seq = S, .heads = 4, .kv_heads = 2, .head_dim = 4, .causal = true};
  auto zeros = [&](std::vector<std::int64_t> shape, DType t = DType::f32) {
    Tensor x = b.empty(std::move(shape), t, MemCategory::activations, s);
    if (t == DType::i32)
      b.upload_i32(std::vector<std::int32_t>(static_cast<std::size_t>(x.numel()), 0), x);
    else
      b.upload(std::vector<float>(static_cast<std::size_t>(x.numel()), 0.0f), x);
    return x;
  };
  Tensor ids = zeros({T}, DType::i32), wte = zeros({V, M}), wpe = zeros({S, M}), x = zeros({T, M}), g = zeros({M});
  Tensor mean = zeros({T}), rstd = zeros({T}), y = zeros({T, M}), qkv = zeros({T, a.qkv_width()});
  Tensor att = zeros({T, 16}), lse = zeros({B, 4, S}), h = zeros({T, 2 * F}), sw = zeros({T, F});
  Tensor logits = zeros({T, V}), losses = zeros({T}), celse = zeros({T});
  const DType f = DType::f32;
  std::vector<Expected> e;
  b.embedding_forward(s, ids, wte, wpe, S, x);
  e.push_back({"embedding", cost_embedding_forward(T, M, true, f)});
  b.embedding_backward(s, x, ids, S, wte, wpe);
  e.push_back({"embedding_bwd", cost_embedding_backward(T, M, true, f)});
  b.norm_forward(s, NormKind::layernorm, 1e-5f, x, g, g, y, mean, rstd);
  e.push_back({"layernorm", cost_norm_forward(NormKind::layernorm, T, M, f)});
  b.norm_backward(s, NormKind::rmsnorm, x, g, mean, rstd, y, x, g, g);
  e.push_back({"rmsnorm_bwd", cost_norm_backward(NormKind::rmsnorm, T, M, f)});
  b.rope(s, a, 10000.0f, false, qkv);
  e.push_back({"rope", cost_rope(a, f)});
  b.rope(s, a, 10000.0f, true, qkv);
  e.push_back({"rope_inverse", cost_rope(a, f)});
  b.attention_forward(s, a, qkv, att, lse);
  e.push_back({"attention", cost_attention_forward(a, f)});
  b.attention_backward(s, a, qkv, att, lse, att, qkv);
  e.push_back({"attention_bwd", cost_attention_backward(a, f)});
  b.swiglu_forward(s, h, sw);
  e.push_back({"swiglu", cost_swiglu_forward(T, F, f)});
  b.swiglu_backward(s, h, sw, h);
  e.push_back({"swiglu_bwd", cost_swiglu_backward(T, F, f)});
  b.add(s, x, y, x);
  e.push_back({"add", cost_add(T * M, f)});
  Tensor z1 = zeros({T, 1}), z2 = zeros({T, 2}), none;
  b.gated_combine_forward(s, z2, x, y, x);
  e.push_back({"gated_combine", cost_gated_combine_forward(T, M, 2, f)});
  b.gated_combine_backward(s, z1, x, none, y, x, none, z1);
  e.push_back({"gated_combine_bwd", cost_gated_combine_backward(T, M, 1, false, f)});
  b.scale(s, x, 0.5f, x);
  e.push_back({"scale", cost_scale(T * M, f)});
  b.cross_entropy_forward(s, logits, ids, losses, celse);
  e.push_back({"cross_entropy", cost_cross_entropy_forward(T, V, f)});
  Tensor parts = zeros({3, 2, T});
  b.cross_entropy_combine(s, parts, ids, V, losses, celse);
  e.push_back({"cross_entropy_combine", cost_cross_entropy_combine(T, 3)});
  b.cross_entropy_backward(s, logits, ids, celse, 0.5f, logits);
  e.push_back({"cross_entropy_bwd", cost_cross_entropy_backward(T, V, f)});
  b.optimizer_step(s, {.kind = OptimizerKind::adam,
                       .param = wte,
                       .grad = wte,
                       .master = zeros({V, M}),
                       .m = zeros({V * M}),
                       .v = zeros({V * M})});
  e.push_back({"adam", cost_optimizer_step(OptimizerKind::adam, V * M, f, true)});
  b.optimizer_step(s, {.kind = OptimizerKind::sgd, .param = g, .grad = g, .master = {}, .m = {}, .v = {}});
  e.push_back({"sgd", cost_optimizer_step(OptimizerKind::sgd, M, f, false)});
  return e;
}

void expect_records(const std::vector<OpRecord>& tl, const std::vector<Expected>& e) {
  ASSERT_EQ(tl.size(), e.size());
  for (std::size_t i = 0; i < e.size(); ++i) {
    SCOPED_TRACE(e[i].name);
    EXPECT_EQ(tl[i].name, e[i].name);
    EXPECT_EQ(tl[i].cost.kind, e[i].cost.kind);
    EXPECT_EQ(tl[i].cost.flops, e[i].cost.flops);
    EXPECT_EQ(tl[i].cost.bytes_read, e[i].cost.bytes_read);
    EXPECT_EQ(tl[i].cost.bytes_written, e[i].cost.bytes_written);
    EXPECT_EQ(tl[i].cost.comm_bytes, e[i].cost.comm_bytes);
    EXPECT_EQ(tl[i].cost.launches, e[i].cost.launches);
    EXPECT_GT(e[i].cost.bytes_read + e[i].cost.bytes_written, 0.0);
  }
}

TEST(BlockCosts, CpuTimelineCarriesEachOpsCostFunction) {
  Cpu cpu;
  cpu.b->clear_timeline();
  const auto e = issue_every_block_op(*cpu.b, cpu.s);
  cpu.b->synchronize();
  expect_records(cpu.b->timeline(), e);
}

// On sim every block op is one task priced from that same descriptor: attention as a GEMM of
// its FLOPs at the rate of the GEMM [B·Hq·S, D] x [D, S] on the datasheet curve, everything
// else as its bytes at the effective HBM bandwidth.
TEST(BlockCosts, SimTimelineCarriesEachOpsCostFunctionAndTime) {
  SimOptions o;
  o.cluster = sim::load_cluster("h100x1");
  o.cluster.efficiency.calibration.reset();  // the datasheet curve, whose closed form is below
  o.cluster.efficiency.launch_latency = 0;
  o.ranks = 1;
  SimCluster cluster(o);
  const sim::ClusterModel& m = cluster.options().cluster;
  cluster.run([&](Backend& b, Communicator& c) {
    Stream& s = b.default_stream();
    c.barrier();
    b.clear_timeline();
    const auto e = issue_every_block_op(b, s);
    b.synchronize();
    c.barrier();
    const auto tl = b.timeline();
    expect_records(tl, e);
    for (std::size_t i = 0; i < tl.size() && i < e.size(); ++i) {
      SCOPED_TRACE(e[i].name);
      const OpCost& k = e[i].cost;
      double expect = (k.bytes_read + k.bytes_written) / (m.gpu.hbm_bw * m.efficiency.mem);
      if (e[i].name.rfind("attention", 0) == 0) {  // d = min(B·Hq·S, S, D) = D = 4
        const double eff = m.efficiency.gemm_max * 4.0 / (4.0 + m.efficiency.gemm_half_dim);
        expect = std::max(k.flops / (m.gpu.flops_fp32 * eff), (k.bytes_read + k.bytes_written) / m.gpu.hbm_bw);
      }
      EXPECT_NEAR(tl[i].end - tl[i].start, expect, 1e-9 * expect);
    }
  });
}

}  // namespace
}  // namespace moelab
