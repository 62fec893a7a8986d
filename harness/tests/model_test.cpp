// harness/tests/model_test.cpp — the model level on the cpu backend: whole-model gradients
// against finite differences of the loss, several microbatches in flight and deferred weight
// gradients giving the same numbers as one microbatch at a time, the block-by-block backward
// giving the split one's gradients, inference giving forward's output with less held (and with
// the experts offloaded to host memory), memory
// charged to each microbatch and returned, and a tiny MoE model that trains.
//   ctest --test-dir build -R model_test
// (The block ops themselves are checked against a float64 reference in blocks_ops_test.)
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <numeric>

#include "harness/comm/communicator.hpp"
#include "harness/nn/data.hpp"
#include "harness/nn/model.hpp"
#include "harness/nn/moe_impl.hpp"
#include "harness/nn/moe_layer.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab {
namespace {

TransformerConfig tiny(bool moe, MlpKind mlp = MlpKind::gelu, PositionKind pos = PositionKind::learned,
                       NormKind norm = NormKind::layernorm) {
  TransformerConfig c;
  c.name = moe ? "tiny-moe" : "tiny-dense";
  c.origin = "<test>";
  c.d_model = 32;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.d_ffn = 48;
  c.num_layers = 2;
  c.seq_len = 16;
  c.vocab_size = 40;
  c.norm = norm;
  c.mlp = mlp;
  c.positions = pos;
  c.dtype = DType::f32;
  c.tie_embeddings = true;
  if (moe) {
    c.moe_layers = MoELayers::every_second;
    c.moe.name = "tiny-moe";
    c.moe.d_model = c.d_model;
    c.moe.d_hidden = 40;
    c.moe.num_experts = 4;
    c.moe.top_k = 2;
    c.moe.capacity_factor = 0.0;  // no dropping: the loss is smooth in the parameters
    c.moe.dtype = DType::f32;
  }
  return c;
}

struct Rig {
  std::unique_ptr<Backend> b;
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Model> model;
  std::vector<std::int32_t> next;
  Rig(const TransformerConfig& cfg, std::uint64_t seed, ModelOptions opt = {}, const std::string& backend = "cpu") {
    register_builtin_impls();
    b = make_backend(backend);
    comm = make_self_communicator(*b);
    model = std::make_unique<Model>(*b, *comm, cfg, opt);
    model->init_parameters(seed);
    next = synthetic_successor(cfg.vocab_size, seed);
  }
  Batch batch(std::int64_t sequences, std::uint64_t seed, std::uint64_t step, int mb, float scale) {
    const TransformerConfig& cfg = model->config();
    if (cfg.vision.enabled) {  // random patches and a label per image
      Batch x;
      const std::int64_t T = sequences * cfg.seq_len, P = cfg.vision.patch_values();
      x.input = b->empty({T, P}, DType::f32, MemCategory::activations, b->default_stream());
      b->upload(test::uniform(static_cast<std::size_t>(T * P), Rng::mix(seed, step, static_cast<std::uint64_t>(mb))), x.input);
      std::vector<std::int32_t> labels(static_cast<std::size_t>(sequences));
      Rng r(Rng::mix(seed, step, static_cast<std::uint64_t>(mb) + 1000));
      for (auto& y : labels) y = static_cast<std::int32_t>(r.next() % static_cast<std::uint64_t>(cfg.vocab_size));
      x.targets = b->empty({sequences}, DType::i32, MemCategory::activations, b->default_stream());
      b->upload_i32(labels, x.targets);
      x.loss_scale = scale;
      return x;
    }
    const auto tb = synthetic_batch(next, sequences, model->config().seq_len, seed, step, mb, 0);
    Batch x;
    const auto T = static_cast<std::int64_t>(tb.ids.size());
    x.input = b->empty({T}, DType::i32, MemCategory::activations, b->default_stream());
    x.targets = b->empty({T}, DType::i32, MemCategory::activations, b->default_stream());
    b->upload_i32(tb.ids, x.input);
    b->upload_i32(tb.targets, x.targets);
    x.loss_scale = scale;
    return x;
  }
  std::vector<std::vector<float>> grads() {
    b->synchronize();
    std::vector<std::vector<float>> g;
    for (auto& p : model->parameters()) g.push_back(b->download(p.grad));
    return g;
  }
};

// Loss of one microbatch (mean cross-entropy + coef · aux), forward only; `routing` gets the
// tokens each expert of each MoE layer was routed, to see whether a step flipped a choice.
double objective(Rig& r, const Batch& x, float coef, std::vector<std::int64_t>* routing = nullptr) {
  Forwarded f = r.model->forward(x, {0, 0, 1});
  const double ce = r.model->loss(*f.saved);
  const double aux = r.model->aux_loss(*f.saved);
  if (routing) {
    routing->clear();
    for (MoEImpl* m : r.model->moe_layers())
      for (auto n : m->routing().routed_per_expert) routing->push_back(n);
  }
  return ce + coef * aux;
}

// A two-stage vision model (harness/config/model.hpp "vision"): the patch embedding, window
// attention over four 2 × 2 windows per image in stage 0, a patch merging, and an MoE block in
// stage 1, whose single window is the whole 2 × 2 map.
TransformerConfig tiny_vision() {
  TransformerConfig c = tiny(true);
  c.name = "tiny-vision";
  c.d_model = 16;
  c.d_ffn = 24;
  c.positions = PositionKind::none;
  c.causal = false;
  c.tie_embeddings = false;
  c.vision.enabled = true;
  c.vision.image_size = 8;
  c.vision.patch_size = 2;
  c.vision.in_channels = 3;
  c.vision.num_classes = 6;
  c.vision.window = 2;
  c.vision.stages = {{1, 2, {}}, {2, 4, {1}}};
  c.num_layers = 3;
  c.num_heads = c.num_kv_heads = 2;
  c.seq_len = 16;
  c.vocab_size = 6;
  c.moe_layers = MoELayers::listed;
  c.moe_mask = {0, 0, 1};
  c.moe.d_model = 16;
  c.moe.d_hidden = 20;
  return c;
}

class ModelGrad : public ::testing::TestWithParam<int> {};

// The gradient of every parameter tensor, projected on a random direction, against the
// central difference of the loss along it. Checks that the blocks compose (residuals, the
// B/W split, tied embeddings, the MoE layer inside its block, the aux loss's weight).
TEST_P(ModelGrad, MatchesFiniteDifferencesOfTheLoss) {
  const int variant = GetParam();
  const TransformerConfig cfg = variant == 0   ? tiny(false)
                                : variant == 1 ? tiny(false, MlpKind::swiglu, PositionKind::rotary, NormKind::rmsnorm)
                                : variant == 2 ? tiny(true)
                                               : tiny_vision();
  const std::uint64_t seed = test::fresh_seed();
  ModelOptions opt;
  opt.aux_loss_coef = 0.1f;
  Rig r(cfg, seed, opt);
  const std::int64_t B = 2;
  Batch x = r.batch(B, seed, 1, 0, 1.0f / static_cast<float>(cfg.vision.enabled ? B : B * cfg.seq_len));
  r.model->zero_grad();
  Forwarded f = r.model->forward(x, {0, 0, 1});
  r.model->backward_input(*f.saved, Tensor());
  r.model->backward_weight(*f.saved);
  f.saved.reset();
  const auto g = r.grads();
  auto params = r.model->parameters();
  ASSERT_EQ(params.size(), g.size());
  Rng dir(Rng::mix(seed, 77));
  int unjudged = 0;
  for (std::size_t i = 0; i < params.size(); ++i) {
    auto v0 = r.b->download(params[i].value);
    std::vector<float> d(v0.size());
    double analytic = 0;
    for (std::size_t j = 0; j < d.size(); ++j) {
      d[j] = static_cast<float>(dir.uniform(-1.0, 1.0));
      analytic += static_cast<double>(d[j]) * g[i][j];
    }
    // Step sized to the tensor's scale so that fp32 rounding stays small against it.
    double scale = 0;
    for (float v : v0) scale = std::max(scale, static_cast<double>(std::abs(v)));
    std::vector<std::int64_t> base, plus, minus, far;
    auto at = [&](double s, std::vector<std::int64_t>* routing) {
      std::vector<float> v(v0);
      for (std::size_t j = 0; j < v.size(); ++j) v[j] += static_cast<float>(s * d[j]);
      r.b->upload(v, params[i].value);
      return objective(r, x, opt.aux_loss_coef, routing);
    };
    // Top-k routing is piecewise constant: a step that flips a token's choice of expert adds a
    // jump to the difference quotient, which then grows as 1/h. A quotient is taken only from
    // steps whose routing counts equal the unperturbed ones: the central one when both sides
    // keep the routing, else the one-sided second-order one, (-3 f(0) + 4 f(±h) - f(±2h)) / ±2h,
    // on a side that keeps it (a token near a tie flips on one side only). It is judged where two
    // successive step sizes (h, h/4) agree; otherwise the step shrinks. A parameter with no such
    // pair is not judged (counted).
    const double f0 = objective(r, x, opt.aux_loss_coef, &base);
    double h = 1e-2 * std::max(scale, 0.05), numeric = 0, tol = 0, prev = 0;
    bool smooth = false, prev_ok = false;
    for (int attempt = 0; attempt < 6 && !smooth; ++attempt, h /= 4) {
      const double fp = at(h, &plus), fm = at(-h, &minus);
      bool ok = true;
      double noise = 2;  // sum of the |coefficients| of the f values in the numerator
      if (plus == base && minus == base) {
        numeric = (fp - fm) / (2 * h);
      } else {
        const double side = plus == base ? 1.0 : -1.0;
        const double f1 = side > 0 ? fp : fm, f2 = at(2 * side * h, &far);
        ok = (side > 0 ? plus : minus) == base && far == base;
        numeric = (-3 * f0 + 4 * f1 - f2) / (2 * side * h);
        noise = 8;
      }
      // The loss is computed in fp32: each f carries a rounding error of up to ~2 ulps of f(0)
      // (measured: |numeric - analytic| · 2h stayed below 1.8 |f(0)| · FLT_EPSILON over 8900
      // judged quotients of this test), which the quotient divides by 2h. The bound allows 3
      // ulps per f value, plus 2% of the quotient.
      tol = 2e-2 * std::max(std::abs(numeric), 1e-3) +
            noise * 3 * std::abs(f0) * std::numeric_limits<float>::epsilon() / (2 * h);
      smooth = ok && prev_ok && std::abs(numeric - prev) <= tol;
      prev = numeric;
      prev_ok = ok;
    }
    if (!smooth) {
      ++unjudged;
      r.b->upload(v0, params[i].value);
      continue;
    }
    r.b->upload(v0, params[i].value);
    EXPECT_NEAR(analytic, numeric, tol) << params[i].name << " (seed " << seed << ")";
  }
  EXPECT_LE(unjudged, 1) << "routing flipped within every step for " << unjudged << " parameters (seed " << seed << ")";
}
INSTANTIATE_TEST_SUITE_P(Variants, ModelGrad, ::testing::Values(0, 1, 2, 3), [](const auto& p) {
  return std::string(p.param == 0 ? "gpt_dense" : p.param == 1 ? "llama_dense" : p.param == 2 ? "gpt_moe" : "vision_moe");
});

double max_rel_diff(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    double scale = 1e-6;
    for (float v : a[i]) scale = std::max(scale, static_cast<double>(std::abs(v)));
    for (std::size_t j = 0; j < a[i].size(); ++j)
      worst = std::max(worst, std::abs(static_cast<double>(a[i][j]) - b[i][j]) / scale);
  }
  return worst;
}

// Forward mb0, forward mb1, backward mb1, backward mb0, weight gradients last (a zero-bubble
// style order) gives the gradients of running them one after the other.
TEST(Model, MicrobatchesInFlightGiveTheSequentialGradients) {
  const std::uint64_t seed = test::fresh_seed();
  for (bool moe : {false, true}) {
    const TransformerConfig cfg = tiny(moe);
    Rig r(cfg, seed);
    const float scale = 1.0f / static_cast<float>(2 * 2 * cfg.seq_len);
    Batch x0 = r.batch(2, seed, 1, 0, scale), x1 = r.batch(2, seed, 1, 1, scale);
    r.model->zero_grad();
    for (int mb = 0; mb < 2; ++mb) {
      Forwarded f = r.model->forward(mb == 0 ? x0 : x1, {0, mb, 1});
      r.model->backward_input(*f.saved, Tensor());
      r.model->backward_weight(*f.saved);
    }
    const auto seq = r.grads();
    r.model->zero_grad();
    Forwarded f0 = r.model->forward(x0, {0, 0, 1});
    Forwarded f1 = r.model->forward(x1, {0, 1, 1});
    r.model->backward_input(*f1.saved, Tensor());
    r.model->backward_input(*f0.saved, Tensor());
    r.model->backward_weight(*f0.saved);
    r.model->backward_weight(*f1.saved);
    f0.saved.reset();
    f1.saved.reset();
    const auto inflight = r.grads();
    EXPECT_LT(max_rel_diff(seq, inflight), 1e-5) << (moe ? "moe" : "dense") << " seed " << seed;
  }
}

// backward() (each block's input then weight gradients, block by block) gives the gradients of
// backward_input then backward_weight, and the synchroniser hears of every block in reverse
// order; a spent saved state is refused.
TEST(Model, BlockByBlockBackwardGivesTheSplitGradients) {
  const std::uint64_t seed = test::fresh_seed();
  for (bool moe : {false, true}) {
    const TransformerConfig cfg = tiny(moe);
    Rig r(cfg, seed);
    const float scale = 1.0f / static_cast<float>(3 * cfg.seq_len);
    Batch x = r.batch(3, seed, 1, 0, scale);
    r.model->zero_grad();
    Forwarded f = r.model->forward(x, {0, 0, 1});
    r.model->backward_input(*f.saved, Tensor());
    r.model->backward_weight(*f.saved);
    f.saved.reset();
    const auto split = r.grads();
    r.model->zero_grad();
    Forwarded g = r.model->forward(x, {0, 0, 1});
    r.model->backward(*g.saved, Tensor());
    EXPECT_THROW(r.model->backward(*g.saved, Tensor()), std::exception);
    g.saved.reset();
    const auto fused = r.grads();
    EXPECT_LT(max_rel_diff(split, fused), 1e-6) << (moe ? "moe" : "dense") << " seed " << seed;
    double norm = 0;
    for (const auto& v : fused)
      for (float e : v) norm += static_cast<double>(e) * e;
    EXPECT_GT(norm, 0.0);
  }
}

// infer() computes forward's output (the head's per-token losses) while holding only what is in
// flight: its activation peak is below forward's, and nothing stays charged afterwards.
TEST(Model, InferenceGivesForwardsOutputAndHoldsLess) {
  const std::uint64_t seed = test::fresh_seed();
  for (bool moe : {false, true}) {
    const TransformerConfig cfg = tiny(moe);
    Rig r(cfg, seed);
    Batch x = r.batch(3, seed, 1, 0, 1.0f);
    r.b->synchronize();
    const std::size_t before = r.b->memory().in_use(MemCategory::activations) + r.b->memory().in_use(MemCategory::buffers);
    r.b->memory().reset_peak();
    Forwarded f = r.model->forward(x, {0, 0, 1});
    const auto trained = r.b->download(f.y);
    const auto peak_train = r.b->memory().peak_per_category();
    f = Forwarded{};
    r.b->synchronize();
    r.b->memory().reset_peak();
    std::vector<float> inferred;
    {
      const Tensor y = r.model->infer(x, {0, 0, 1});
      inferred = r.b->download(y);
    }
    const auto peak_infer = r.b->memory().peak_per_category();
    ASSERT_EQ(trained.size(), inferred.size());
    for (std::size_t i = 0; i < trained.size(); ++i) ASSERT_EQ(trained[i], inferred[i]) << "token " << i;
    const auto act = static_cast<std::size_t>(MemCategory::activations);
    EXPECT_LT(peak_infer[act], peak_train[act]) << (moe ? "moe" : "dense");
    r.b->synchronize();
    EXPECT_EQ(r.b->memory().in_use(MemCategory::activations) + r.b->memory().in_use(MemCategory::buffers), before);
  }
}

// Expert offloading (ScMoE's memory-limited inference): with the experts in pinned host memory
// and copied in per forward, sync or async, inference gives the same output; the device holds
// less weight memory at its peak (one MoE layer's experts instead of every layer's), and the
// host holds the experts.
TEST(Model, OffloadedExpertsGiveTheSameOutputWithLessDeviceMemory) {
  const std::uint64_t seed = test::fresh_seed();
  TransformerConfig cfg = tiny(true);
  cfg.num_layers = 6;  // three MoE layers: one layer's experts on the device at a time
  std::vector<float> want;
  std::size_t weights_peak = 0;
  for (auto mode : {MoELayer::ExpertOffload::none, MoELayer::ExpertOffload::sync, MoELayer::ExpertOffload::async}) {
    Rig r(cfg, seed);
    r.model->release_gradients();
    std::size_t expert_bytes = 0;
    for (MoEImpl* m : r.model->moe_layers()) {
      expert_bytes += m->params().w1.nbytes() + m->params().w2.nbytes();
      m->layer().offload_experts(mode);
      EXPECT_EQ(m->layer().expert_offload(), mode);
    }
    Batch x = r.batch(3, seed, 1, 0, 1.0f);
    r.b->synchronize();
    r.b->memory().reset_peak();
    std::vector<float> got;
    {
      const Tensor y = r.model->infer(x, {0, 0, 1});
      got = r.b->download(y);
    }
    r.b->synchronize();
    const auto peak = r.b->memory().peak_per_category();
    const std::size_t w = peak[static_cast<std::size_t>(MemCategory::weights)];
    const char* name = MoELayer::expert_offload_name(mode);
    if (mode == MoELayer::ExpertOffload::none) {
      want = got;
      weights_peak = w;
      continue;
    }
    ASSERT_EQ(got.size(), want.size());
    for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], want[i]) << name << " token " << i;
    EXPECT_LT(w, weights_peak) << name;
    EXPECT_EQ(r.b->memory().in_use(MemCategory::host_pinned), expert_bytes) << name;
    Forwarded f = r.model->forward(x, {0, 0, 2});
    EXPECT_THROW(r.model->backward(*f.saved, Tensor()), std::exception) << name << ": backward is refused";
  }
}

// Every byte a microbatch's work allocates is charged to it, and comes back when its saved
// state is destroyed; two in flight hold twice what one holds.
TEST(Model, MemoryIsChargedToEachMicrobatchAndReturned) {
  const std::uint64_t seed = test::fresh_seed();
  const TransformerConfig cfg = tiny(false);
  Rig r(cfg, seed);
  Batch x0 = r.batch(2, seed, 1, 0, 1.0f), x1 = r.batch(2, seed, 1, 1, 1.0f);
  Forwarded f0 = r.model->forward(x0, {0, 0, 1});
  auto held = r.b->memory().microbatch_in_use();
  ASSERT_GT(held[0], 0u);
  Forwarded f1 = r.model->forward(x1, {0, 1, 1});
  held = r.b->memory().microbatch_in_use();
  EXPECT_EQ(held[0], held[1]);
  r.model->backward_input(*f0.saved, Tensor());
  r.model->backward_weight(*f0.saved);
  f0 = Forwarded{};
  r.b->synchronize();
  held = r.b->memory().microbatch_in_use();
  EXPECT_EQ(held[0], 0u);
  EXPECT_GT(held[1], 0u);
  f1 = Forwarded{};
  EXPECT_EQ(r.b->memory().microbatch_in_use()[1], 0u);
}

// A 2-layer MoE model learns the synthetic language: 200 Adam steps take the loss from about
// ln V to well below it. cpu in fp32; cuda (when a GPU is present) in fp32 and bf16.
class ModelTrains : public ::testing::TestWithParam<std::pair<const char*, DType>> {};

TEST_P(ModelTrains, TinyMoEModelLearnsTheSyntheticLanguage) {
  const auto [backend, dtype] = GetParam();
  if (std::string(backend) == "cuda" && !cuda_available()) GTEST_SKIP() << "no CUDA device";
  const std::uint64_t seed = test::fresh_seed();
  TransformerConfig cfg = tiny(true);
  cfg.moe.capacity_factor = 1.25;
  cfg.dtype = cfg.moe.dtype = dtype;
  Rig r(cfg, seed, {}, backend);
  OptimizerConfig oc;
  oc.lr = 3e-3f;
  Optimizer opt(*r.b, r.model->stream(), r.model->parameters(), oc);
  const std::int64_t B = 4;
  std::vector<double> losses;
  for (int step = 1; step <= 200; ++step) {
    r.model->zero_grad();
    Batch x = r.batch(B, seed, static_cast<std::uint64_t>(step), 0, 1.0f / static_cast<float>(B * cfg.seq_len));
    Forwarded f = r.model->forward(x, {0, 0, static_cast<std::uint64_t>(step)});
    losses.push_back(r.model->loss(*f.saved));
    r.model->backward_input(*f.saved, Tensor());
    r.model->backward_weight(*f.saved);
    f.saved.reset();
    opt.step();
  }
  const double first = losses.front();
  const double last = std::accumulate(losses.end() - 10, losses.end(), 0.0) / 10.0;
  std::printf("loss %.4f -> %.4f (ln V = %.4f)\n", first, last, std::log(static_cast<double>(cfg.vocab_size)));
  EXPECT_NEAR(first, std::log(static_cast<double>(cfg.vocab_size)), 0.5);
  EXPECT_LT(last, 0.5) << "seed " << seed;
}
INSTANTIATE_TEST_SUITE_P(Backends, ModelTrains,
                         ::testing::Values(std::pair{"cpu", DType::f32}, std::pair{"cuda", DType::f32},
                                           std::pair{"cuda", DType::bf16}),
                         [](const auto& p) { return std::string(p.param.first) + "_" + dtype_name(p.param.second); });

}  // namespace
}  // namespace moelab
