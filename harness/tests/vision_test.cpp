// harness/tests/vision_test.cpp — the blocks of a hierarchical vision model (harness/nn/
// vision.hpp) on the cpu backend: the row regroupings against their definition, the patch
// embedding, patch merging and classifier head forward and backward against a float64
// reference (blocks_reference.hpp's norm, plain loops for the rest), and window attention
// equal to attention over rows regrouped window by window (the plain attention block is
// itself checked against the float64 reference in blocks_ops_test and model_test).
//   ctest --test-dir build -R vision_test --output-on-failure
//   MOELAB_TEST_SEED=<n> build/harness/tests/vision_test
//
// Tolerances: fp32 against float64, sums of at most 64 products: 1e-5 (2e-5 for the norms'
// input gradients, differences of terms of the size rstd·|dy·γ|, as blocks_ops_test says).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "harness/nn/vision.hpp"
#include "harness/runtime/backend.hpp"
#include "harness/tests/blocks_reference.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab {
namespace {

using blocks_ref::Vec;
using test::all_close;
using test::to_double;

constexpr double kTol = 1e-5, kNormDxTol = 2e-5;

using test::Cpu;

// A stage's configuration as TransformerConfig::layer_config makes it, written out.
TransformerConfig stage_cfg(std::int64_t width, int heads, std::int64_t grid, std::int64_t window, std::int64_t classes = 7) {
  TransformerConfig c;
  c.name = "vision-test";
  c.origin = "<test>";
  c.d_model = width;
  c.num_heads = c.num_kv_heads = heads;
  c.d_ffn = 4 * width;
  c.num_layers = 2;
  c.seq_len = window * window;
  c.vocab_size = classes;
  c.positions = PositionKind::none;
  c.causal = false;
  c.tie_embeddings = false;
  c.dtype = DType::f32;
  c.grid = grid;
  c.vision.enabled = true;
  c.vision.patch_size = 2;
  c.vision.in_channels = 3;
  c.vision.num_classes = classes;
  c.vision.window = window;
  return c;
}

// Random values for every parameter of a block (its own initialisation is too tame for norms:
// gamma 1, beta 0), returned in collect() order.
std::vector<std::vector<float>> randomise(Cpu& c, Block& blk, std::uint64_t seed) {
  std::vector<Param*> ps;
  blk.collect(ps);
  std::vector<std::vector<float>> out;
  for (std::size_t i = 0; i < ps.size(); ++i) {
    auto v = test::uniform(static_cast<std::size_t>(ps[i]->value.numel()), Rng::mix(seed, 100 + i), -0.8, 0.8);
    c.b->upload(v, ps[i]->value);
    out.push_back(v);
  }
  return out;
}

std::vector<std::vector<float>> grads(Cpu& c, Block& blk) {
  std::vector<Param*> ps;
  blk.collect(ps);
  std::vector<std::vector<float>> out;
  for (Param* p : ps) out.push_back(c.get(p->grad));
  return out;
}

// C [m,n] = A [m,k] · B [k,n], or with A or B read transposed.
Vec matmul(const Vec& a, const Vec& b, std::size_t m, std::size_t n, std::size_t k, bool ta = false, bool tb = false) {
  Vec c(m * n, 0.0);
  for (std::size_t i = 0; i < m; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      double acc = 0;
      for (std::size_t p = 0; p < k; ++p) acc += (ta ? a[p * m + i] : a[i * k + p]) * (tb ? b[j * k + p] : b[p * n + j]);
      c[i * n + j] = acc;
    }
  return c;
}

// ---- the row regroupings ------------------------------------------------------------------

TEST(RowRegrouping, WindowOrderIsTheSwinPartition) {
  // window_partition(x, w) of Swin: [B,H,W,C] -> [B, H/w, w, W/w, w, C] -> permute(0,1,3,2,4,5):
  // the rows of window (r, c) of image b follow each other, row by row inside the window.
  for (auto [images, grid, window] : {std::tuple{2, 8, 4}, {1, 12, 3}, {3, 6, 6}, {1, 48, 12}}) {
    const auto slot = window_slots(images, grid, window);
    std::vector<std::int32_t> expect(slot.size(), -1);
    std::int32_t next = 0;
    for (int b = 0; b < images; ++b)
      for (int wr = 0; wr < grid / window; ++wr)
        for (int wc = 0; wc < grid / window; ++wc)
          for (int i = 0; i < window; ++i)
            for (int j = 0; j < window; ++j)
              expect[static_cast<std::size_t>(b * grid * grid + (wr * window + i) * grid + wc * window + j)] = next++;
    EXPECT_EQ(slot, expect) << images << " images of " << grid << "², window " << window;
  }
}

TEST(RowRegrouping, MergeOrderIsSwinsConcatenation) {
  // PatchMerging of Swin: x0 = x[:, 0::2, 0::2], x1 = x[:, 1::2, 0::2], x2 = x[:, 0::2, 1::2],
  // x3 = x[:, 1::2, 1::2], cat(x0, x1, x2, x3) along channels.
  const int offsets[4][2] = {{0, 0}, {1, 0}, {0, 1}, {1, 1}};
  for (auto [images, grid] : {std::pair{2, 4}, {1, 6}, {3, 2}}) {
    const auto slot = merge_slots(images, grid);
    std::vector<std::int32_t> expect(slot.size(), -1);
    const int half = grid / 2;
    for (int b = 0; b < images; ++b)
      for (int i = 0; i < half; ++i)
        for (int j = 0; j < half; ++j)
          for (int q = 0; q < 4; ++q) {
            const int row = b * half * half + i * half + j;
            expect[static_cast<std::size_t>(b * grid * grid + (2 * i + offsets[q][0]) * grid + 2 * j + offsets[q][1])] = row * 4 + q;
          }
    EXPECT_EQ(slot, expect) << images << " images of " << grid << "²";
  }
}

// ---- patch embedding ----------------------------------------------------------------------

TEST(PatchEmbed, MatchesTheFloat64Reference) {
  const std::uint64_t seed = test::fresh_seed();
  Cpu c;
  TransformerConfig cfg = stage_cfg(8, 2, 4, 4);
  cfg.seq_len = 16;  // the model's: tokens per image
  const std::int64_t B = 3, T = B * 16, P = cfg.vision.patch_values(), C = 8;
  PatchEmbed blk(*c.b, c.s, cfg);
  const auto w = randomise(c, blk, seed);  // W [P,C], gamma, beta
  const auto x = test::uniform(static_cast<std::size_t>(T * P), Rng::mix(seed, 1));
  const auto dy = test::uniform(static_cast<std::size_t>(T * C), Rng::mix(seed, 2));
  Forwarded f = blk.forward(c.f32({T, P}, x), {0, 0, 1});
  EXPECT_FALSE(blk.backward_input(*f.saved, c.f32({T, C}, dy)).defined());
  blk.backward_weight(*f.saved);
  const Vec h = matmul(to_double(x), to_double(w[0]), T, C, P);
  const auto n = blocks_ref::norm_forward(NormKind::layernorm, cfg.norm_eps, h, C, to_double(w[1]), to_double(w[2]));
  EXPECT_TRUE(all_close("y", c.get(f.y), n.y, kTol));
  Vec dh, dg, db;
  blocks_ref::norm_backward(NormKind::layernorm, cfg.norm_eps, h, C, to_double(w[1]), to_double(dy), dh, dg, db);
  const auto g = grads(c, blk);
  EXPECT_TRUE(all_close("dW", g[0], matmul(to_double(x), dh, P, C, T, true), kNormDxTol));
  EXPECT_TRUE(all_close("d_gamma", g[1], dg, kTol));
  EXPECT_TRUE(all_close("d_beta", g[2], db, kTol));
}

// ---- patch merging ------------------------------------------------------------------------

TEST(PatchMerging, MatchesTheFloat64Reference) {
  const std::uint64_t seed = test::fresh_seed();
  Cpu c;
  const std::int64_t B = 2, g = 4, C = 6, T = B * g * g, R = T / 4;
  const TransformerConfig cfg = stage_cfg(C, 2, g, g);
  PatchMerging blk(*c.b, c.s, cfg, 1);
  const auto w = randomise(c, blk, seed);  // gamma [4C], beta [4C], W [4C,2C]
  const auto x = test::uniform(static_cast<std::size_t>(T * C), Rng::mix(seed, 1));
  const auto dy = test::uniform(static_cast<std::size_t>(R * 2 * C), Rng::mix(seed, 2));
  Forwarded f = blk.forward(c.f32({T, C}, x), {0, 0, 1});
  const Tensor dx = blk.backward_input(*f.saved, c.f32({R, 2 * C}, dy));
  blk.backward_weight(*f.saved);

  // cat(x0, x1, x2, x3) of each 2 × 2 group, written from Swin's slicing.
  const int offsets[4][2] = {{0, 0}, {1, 0}, {0, 1}, {1, 1}};
  auto source = [&](std::int64_t row, int q, std::int64_t ch) {  // the input element of a concatenated value
    const std::int64_t b = row / ((g / 2) * (g / 2)), i = row / (g / 2) % (g / 2), j = row % (g / 2);
    return (b * g * g + (2 * i + offsets[q][0]) * g + 2 * j + offsets[q][1]) * C + ch;
  };
  Vec cat(static_cast<std::size_t>(R * 4 * C));
  for (std::int64_t r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q)
      for (std::int64_t ch = 0; ch < C; ++ch) cat[static_cast<std::size_t>((r * 4 + q) * C + ch)] = x[static_cast<std::size_t>(source(r, q, ch))];
  const auto n = blocks_ref::norm_forward(NormKind::layernorm, cfg.norm_eps, cat, 4 * C, to_double(w[0]), to_double(w[1]));
  EXPECT_TRUE(all_close("y", c.get(f.y), matmul(n.y, to_double(w[2]), R, 2 * C, 4 * C), kTol));
  const Vec d_hn = matmul(to_double(dy), to_double(w[2]), R, 4 * C, 2 * C, false, true);
  Vec d_cat, dg, db;
  blocks_ref::norm_backward(NormKind::layernorm, cfg.norm_eps, cat, 4 * C, to_double(w[0]), d_hn, d_cat, dg, db);
  Vec dx_ref(x.size());
  for (std::int64_t r = 0; r < R; ++r)
    for (int q = 0; q < 4; ++q)
      for (std::int64_t ch = 0; ch < C; ++ch) dx_ref[static_cast<std::size_t>(source(r, q, ch))] = d_cat[static_cast<std::size_t>((r * 4 + q) * C + ch)];
  EXPECT_TRUE(all_close("dx", c.get(dx), dx_ref, kNormDxTol));
  const auto gr = grads(c, blk);
  EXPECT_TRUE(all_close("d_gamma", gr[0], dg, kTol));
  EXPECT_TRUE(all_close("d_beta", gr[1], db, kTol));
  EXPECT_TRUE(all_close("dW", gr[2], matmul(n.y, to_double(dy), 4 * C, 2 * C, R, true), kTol));
}

// ---- classifier head ----------------------------------------------------------------------

TEST(ClassifierHead, MatchesTheFloat64Reference) {
  const std::uint64_t seed = test::fresh_seed();
  Cpu c;
  const std::int64_t B = 4, g = 3, N = g * g, C = 8, K = 5, T = B * N;
  const TransformerConfig cfg = stage_cfg(C, 2, g, g, K);
  ClassifierHead blk(*c.b, c.s, cfg);
  const auto w = randomise(c, blk, seed);  // gamma, beta, W [C,K]
  const auto x = test::uniform(static_cast<std::size_t>(T * C), Rng::mix(seed, 1), -2, 2);
  std::vector<std::int32_t> labels = {3, -1, 0, 4};  // image 1 not counted
  Tensor targets = c.b->empty({B}, DType::i32, MemCategory::activations, c.s);
  c.b->upload_i32(labels, targets);
  const float scale = 0.37f;
  blk.set_targets(targets, scale);
  Forwarded f = blk.forward(c.f32({T, C}, x), {0, 0, 1});
  const Tensor dx = blk.backward_input(*f.saved, Tensor());
  blk.backward_weight(*f.saved);

  const auto n = blocks_ref::norm_forward(NormKind::layernorm, cfg.norm_eps, to_double(x), C, to_double(w[0]), to_double(w[1]));
  Vec pooled(static_cast<std::size_t>(B * C), 0.0);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t ch = 0; ch < C; ++ch) pooled[static_cast<std::size_t>((t / N) * C + ch)] += n.y[static_cast<std::size_t>(t * C + ch)] / N;
  const Vec logits = matmul(pooled, to_double(w[2]), B, K, C);
  Vec loss(B, 0.0), d_logits(static_cast<std::size_t>(B * K), 0.0);
  for (std::int64_t b = 0; b < B; ++b) {
    const double* l = &logits[static_cast<std::size_t>(b * K)];
    const double mx = *std::max_element(l, l + K);
    double z = 0;
    for (std::int64_t k = 0; k < K; ++k) z += std::exp(l[k] - mx);
    const double lse = mx + std::log(z);
    if (labels[static_cast<std::size_t>(b)] < 0) continue;
    loss[static_cast<std::size_t>(b)] = lse - l[labels[static_cast<std::size_t>(b)]];
    for (std::int64_t k = 0; k < K; ++k)
      d_logits[static_cast<std::size_t>(b * K + k)] = scale * (std::exp(l[k] - lse) - (k == labels[static_cast<std::size_t>(b)] ? 1.0 : 0.0));
  }
  EXPECT_TRUE(all_close("losses", c.get(f.y), loss, kTol));
  const Vec d_pooled = matmul(d_logits, to_double(w[2]), B, C, K, false, true);
  Vec d_hn(static_cast<std::size_t>(T * C));
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t ch = 0; ch < C; ++ch) d_hn[static_cast<std::size_t>(t * C + ch)] = d_pooled[static_cast<std::size_t>((t / N) * C + ch)] / N;
  Vec dx_ref, dg, db;
  blocks_ref::norm_backward(NormKind::layernorm, cfg.norm_eps, to_double(x), C, to_double(w[0]), d_hn, dx_ref, dg, db);
  EXPECT_TRUE(all_close("dx", c.get(dx), dx_ref, kNormDxTol));
  const auto gr = grads(c, blk);
  EXPECT_TRUE(all_close("d_gamma", gr[0], dg, kTol));
  EXPECT_TRUE(all_close("d_beta", gr[1], db, kTol));
  EXPECT_TRUE(all_close("dW", gr[2], matmul(pooled, d_logits, C, K, B, true), kTol));
}

// ---- window attention ---------------------------------------------------------------------

// The vision stage's attention block on image-ordered rows equals the plain block (attention
// over whole sequences of window² tokens) on the same rows regrouped window by window: output
// and input gradient regrouped alike, parameter gradients equal. The plain block's numerics
// are the float64 reference's (blocks_ops_test, model_test).
TEST(WindowAttention, IsAttentionOverRowsRegroupedByWindow) {
  const std::uint64_t seed = test::fresh_seed();
  Cpu c;
  const std::int64_t B = 2, g = 8, w = 4, M = 16, T = B * g * g;
  const TransformerConfig windowed = stage_cfg(M, 2, g, w);
  TransformerConfig plain = windowed;
  plain.grid = 0;
  plain.vision = VisionConfig{};
  AttentionBlock a(*c.b, c.s, windowed, 0), p(*c.b, c.s, plain, 0);
  const auto params = randomise(c, a, seed);
  {
    std::vector<Param*> ps;
    p.collect(ps);
    for (std::size_t i = 0; i < ps.size(); ++i) c.b->upload(params[i], ps[i]->value);
  }
  const auto x = test::uniform(static_cast<std::size_t>(T * M), Rng::mix(seed, 1));
  const auto dy = test::uniform(static_cast<std::size_t>(T * M), Rng::mix(seed, 2));
  // Row t of the image order is row order[t] of the window order (Swin's partition, written out).
  std::vector<std::size_t> order(static_cast<std::size_t>(T));
  std::size_t next = 0;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t wr = 0; wr < g / w; ++wr)
      for (std::int64_t wc = 0; wc < g / w; ++wc)
        for (std::int64_t i = 0; i < w; ++i)
          for (std::int64_t j = 0; j < w; ++j) order[static_cast<std::size_t>(b * g * g + (wr * w + i) * g + wc * w + j)] = next++;
  auto to_windows = [&](const std::vector<float>& rows) {
    std::vector<float> out(rows.size());
    for (std::size_t t = 0; t < order.size(); ++t)
      std::copy_n(rows.begin() + static_cast<std::ptrdiff_t>(t * M), M, out.begin() + static_cast<std::ptrdiff_t>(order[t] * M));
    return out;
  };
  Forwarded fa = a.forward(c.f32({T, M}, x), {0, 0, 1});
  Forwarded fp = p.forward(c.f32({T, M}, to_windows(x)), {0, 0, 1});
  const Tensor dxa = a.backward_input(*fa.saved, c.f32({T, M}, dy));
  const Tensor dxp = p.backward_input(*fp.saved, c.f32({T, M}, to_windows(dy)));
  a.backward_weight(*fa.saved);
  p.backward_weight(*fp.saved);
  EXPECT_TRUE(all_close("y", to_windows(c.get(fa.y)), to_double(c.get(fp.y)), 1e-6));
  EXPECT_TRUE(all_close("dx", to_windows(c.get(dxa)), to_double(c.get(dxp)), 1e-6));
  const auto ga = grads(c, a), gp = grads(c, p);
  ASSERT_EQ(ga.size(), gp.size());
  for (std::size_t i = 0; i < ga.size(); ++i) EXPECT_TRUE(all_close("param " + std::to_string(i), ga[i], to_double(gp[i]), 1e-5));
  // And the window order matters: the plain block on image-ordered rows is another function.
  AttentionBlock q(*c.b, c.s, plain, 0);
  {
    std::vector<Param*> ps;
    q.collect(ps);
    for (std::size_t i = 0; i < ps.size(); ++i) c.b->upload(params[i], ps[i]->value);
  }
  Forwarded fq = q.forward(c.f32({T, M}, x), {0, 0, 1});
  EXPECT_FALSE(all_close("y", c.get(fq.y), to_double(c.get(fa.y)), 1e-3));
}

}  // namespace
}  // namespace moelab
