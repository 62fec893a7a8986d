// harness/tests/moe_layer_test.cpp — the expert-parallel MoE layer against a float64 dense
// reference, forward and backward, on fresh random inputs; a finite-difference check; the
// permute/unpermute round trip; several microbatches in flight on one layer (every schedule:
// the same outputs, noise and summed gradients as one after the other, memory returned per
// microbatch). Runs on cpu always, on cuda (fp32 and bf16) when a device is present.
//   ctest --test-dir build -R moe_layer_test      (MOELAB_TEST_SEED=<n> replays a seed)
#include <gtest/gtest.h>

#include <limits>
#include <map>

#include "harness/comm/communicator.hpp"
#include "harness/nn/moe_impl.hpp"
#include "harness/nn/moe_layer.hpp"
#include "harness/nn/moe_schedule.hpp"
#include "harness/runtime/gemm_paths.hpp"
#include "harness/tests/moe_reference.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab {
namespace {

struct Case {
  std::string name;
  std::int64_t T, M, H, E;
  int k;
  double cf;
  Activation act;
  bool noisy, renorm;
};

struct Target {
  std::string backend;
  DType dtype;
  double rtol;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }
void PrintTo(const Target& t, std::ostream* os) { *os << t.backend << "/" << dtype_name(t.dtype); }

std::string case_name(const Case& c, const Target& t) { return c.name + "_" + t.backend + "_" + dtype_name(t.dtype); }

class MoELayerVsReference : public ::testing::TestWithParam<std::tuple<Case, Target>> {};

TEST_P(MoELayerVsReference, ForwardAndBackward) {
  const auto& [c, tgt] = GetParam();
  if (tgt.backend == "cuda" && !cuda_available()) GTEST_SKIP() << "no CUDA device";
  auto b = make_backend(tgt.backend);
  auto comm = make_self_communicator(*b);
  ModelConfig cfg;
  cfg.d_model = c.M;
  cfg.d_hidden = c.H;
  cfg.num_experts = c.E;
  cfg.top_k = c.k;
  cfg.capacity_factor = c.cf;
  cfg.activation = c.act;
  cfg.noisy_gate = c.noisy;
  cfg.renormalize = c.renorm;
  cfg.dtype = tgt.dtype;

  std::uint64_t seed = test::fresh_seed();
  for (int attempt = 0; attempt < 20; ++attempt, seed = Rng::mix(seed, 99)) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    MoELayer layer(*b, *comm, cfg);
    layer.init_parameters(seed);
    layer.set_noise_seed(Rng::mix(seed, 5));
    // Whatever the gradients held (NaN here) is gone after zero_grad: it zeroes the gate's,
    // and the step writes the experts' (their first weight-gradient GEMM, or the forward for
    // an expert without rows; MoELayer::zero_grad).
    for (Tensor* g : {&layer.grads().w_gate, &layer.grads().w1, &layer.grads().w2})
      b->upload(std::vector<float>(static_cast<std::size_t>(g->numel()), std::numeric_limits<float>::quiet_NaN()), *g);
    layer.zero_grad();
    Stream& s = layer.compute_stream();
    Tensor x = b->empty({c.T, c.M}, cfg.dtype, MemCategory::activations, s);
    Tensor dy = b->empty({c.T, c.M}, cfg.dtype, MemCategory::activations, s);
    b->upload(test::uniform(static_cast<std::size_t>(c.T * c.M), Rng::mix(seed, 1)), x);
    b->upload(test::uniform(static_cast<std::size_t>(c.T * c.M), Rng::mix(seed, 2)), dy);
    const float grad_aux = 0.37f;

    Tensor y = layer.forward(x);
    const float aux = layer.aux_loss();
    Tensor dx = layer.backward(dy, grad_aux);
    b->synchronize();

    // The reference sees exactly the values the layer holds (bf16-rounded where bf16).
    const ref::Params P = test::reference_params(*b, layer);
    const auto xd = test::to_double(b->download(x));
    const auto dyd = test::to_double(b->download(dy));
    const auto eps = test::to_double(layer.last_noise());
    ref::Grads G;
    G.init(P, c.T);
    const ref::Result R = ref::forward_backward(cfg, P, xd, eps, &dyd, grad_aux, &G);
    // A near-tie: fp32 may legitimately route differently; redraw. fp32 logits put a
    // probability within ~1e-7 of float64's, so 1e-5 leaves a wide margin; 1e-4 was met by
    // 78% of the "wide" case's draws (406 gaps), and 20 draws in a row by 0.7% of seeds.
    if (R.min_topk_gap < 1e-5) continue;

    // Routing: identical decisions, an exact statement.
    ASSERT_EQ(layer.routing().sent_per_expert, R.counts);
    ASSERT_EQ(layer.routing().recv_per_local, R.counts);
    const double rtol = tgt.rtol;
    EXPECT_NEAR(aux, R.aux, rtol * std::abs(R.aux) + 1e-6);
    EXPECT_TRUE(test::all_close("y", b->download(y), R.y, rtol));
    EXPECT_TRUE(test::all_close("dx", b->download(dx), G.dx, rtol));
    EXPECT_TRUE(test::all_close("dW_gate", b->download(layer.grads().w_gate), G.dwg, rtol));
    if (c.noisy) {
      EXPECT_TRUE(test::all_close("dW_noise", b->download(layer.grads().w_noise), G.dwn, rtol));
    }
    EXPECT_TRUE(test::all_close("dW1", b->download(layer.grads().w1), G.dw1, rtol));
    EXPECT_TRUE(test::all_close("dW2", b->download(layer.grads().w2), G.dw2, rtol));
    return;
  }
  FAIL() << "could not draw inputs without a near-tie in 20 attempts";
}

const Case kCases[] = {
    // name            T    M   H   E  k  cf    act               noisy  renorm
    {"top1_nodrop", 37, 16, 24, 4, 1, 0.0, Activation::gelu, false, false},
    {"top2_overflow", 53, 8, 20, 6, 2, 1.0, Activation::relu, false, true},
    {"top2_heavydrop_noisy", 29, 12, 16, 5, 2, 0.5, Activation::gelu, true, false},
    {"idle_experts", 5, 8, 12, 16, 1, 0.0, Activation::gelu, false, false},  // most experts get 0 tokens
    {"k_equals_E", 1, 9, 7, 3, 3, 0.0, Activation::gelu, true, true},
    {"wide", 203, 32, 64, 8, 2, 1.25, Activation::gelu, false, false},
    // the tanh GeLU: fused into the experts' GEMMs (Backend::grouped_gemm_epilogue) on cpu and
    // cuda; H = 32 takes cuBLASLt's GELU epilogues, H = 20 (not a multiple of 8) its fallback
    {"tanh_fused", 61, 16, 32, 6, 2, 1.0, Activation::gelu_tanh, false, false},
    {"tanh_ragged_noisy", 23, 12, 20, 5, 1, 0.0, Activation::gelu_tanh, true, false},
};
const Target kTargets[] = {
    {"cpu", DType::f32, 1e-4},
    {"cuda", DType::f32, 1e-4},
    {"cuda", DType::bf16, 4e-2},
};

INSTANTIATE_TEST_SUITE_P(Cases, MoELayerVsReference,
                         ::testing::Combine(::testing::ValuesIn(kCases), ::testing::ValuesIn(kTargets)),
                         [](const auto& tp) {
                           return case_name(std::get<0>(tp.param), std::get<1>(tp.param));
                         });

// The float64 reference's own gradients against central differences (it is the yardstick,
// so it is checked too), with every gate feature on.
TEST(MoEReference, FiniteDifferences) {
  ModelConfig cfg;
  cfg.d_model = 5;
  cfg.d_hidden = 6;
  cfg.num_experts = 4;
  cfg.top_k = 2;
  cfg.capacity_factor = 1.0;
  cfg.noisy_gate = true;
  cfg.renormalize = true;
  const std::int64_t T = 7;
  Rng rng(test::fresh_seed());
  auto draw = [&](std::size_t n) {
    std::vector<double> v(n);
    for (auto& x : v) x = rng.uniform(-1, 1);
    return v;
  };
  const double ga = 0.7;
  ref::Params P;
  std::vector<double> x, eps, dy;
  ref::Grads G;
  // A step of h = 1e-6 moves a probability by far less than 1e-4, but about 1% of draws have
  // two top-k probabilities closer than that: redraw them (as the layer tests do).
  for (int attempt = 0;; ++attempt) {
    ASSERT_LT(attempt, 100) << "no input without a near-tie";
    P = {cfg.d_model, cfg.d_hidden, cfg.num_experts, draw(20), draw(20), draw(4 * 30), draw(4 * 30)};
    x = draw(static_cast<std::size_t>(T * 5));
    eps = draw(static_cast<std::size_t>(T * 4));
    dy = draw(static_cast<std::size_t>(T * 5));
    G.init(P, T);
    if (ref::forward_backward(cfg, P, x, eps, &dy, ga, &G).min_topk_gap > 1e-4) break;
  }
  auto loss = [&]() {
    auto r = ref::forward_backward(cfg, P, x, eps, nullptr, 0, nullptr);
    double l = ga * r.aux;
    for (std::size_t i = 0; i < dy.size(); ++i) l += dy[i] * r.y[i];
    return l;
  };
  auto check = [&](const char* what, std::vector<double>& v, const std::vector<double>& g) {
    for (std::size_t i = 0; i < v.size(); ++i) {
      const double h = 1e-6, keep = v[i];
      v[i] = keep + h;
      const double lp = loss();
      v[i] = keep - h;
      const double lm = loss();
      v[i] = keep;
      const double fd = (lp - lm) / (2 * h);
      EXPECT_NEAR(g[i], fd, 1e-6 + 1e-5 * std::abs(fd)) << what << "[" << i << "]";
    }
  };
  check("x", x, G.dx);
  check("W_gate", P.wg, G.dwg);
  check("W_noise", P.wn, G.dwn);
  check("W1", P.w1, G.dw1);
  check("W2", P.w2, G.dw2);
}

// The reference's activations and their derivatives: act_grad against central differences of
// act, and the two GeLUs close to each other (the tanh form approximates the erf form to within
// about 5e-4 in absolute value: Hendrycks & Gimpel 2016), which a swapped formula would fail.
TEST(MoEReference, ActivationDerivatives) {
  Rng rng(test::fresh_seed());
  for (Activation a : {Activation::gelu, Activation::relu, Activation::gelu_tanh})
    for (int i = 0; i < 200; ++i) {
      const double x = rng.uniform(-5, 5), h = 1e-6;
      if (a == Activation::relu && std::abs(x) < 1e-3) continue;  // the kink
      const double fd = (ref::act(a, x + h) - ref::act(a, x - h)) / (2 * h);
      EXPECT_NEAR(ref::act_grad(a, x), fd, 1e-7 + 1e-6 * std::abs(fd)) << activation_name(a) << " at " << x;
    }
  double worst = 0;
  for (int i = -5000; i <= 5000; ++i) {
    const double x = i * 1e-3;
    worst = std::max(worst, std::abs(ref::act(Activation::gelu_tanh, x) - ref::act(Activation::gelu, x)));
  }
  EXPECT_GT(worst, 1e-5);  // a different function
  EXPECT_LT(worst, 1e-3);  // but an approximation of the erf GeLU
}

// The layer itself (fp32, cpu) against central differences of its own forward, along a
// random direction per parameter: L = <dy, y> + ga * aux.
TEST(MoELayer, FiniteDifferenceDirectional) {
  auto b = make_backend("cpu");
  auto comm = make_self_communicator(*b);
  ModelConfig cfg;
  cfg.d_model = 6;
  cfg.d_hidden = 10;
  cfg.num_experts = 4;
  cfg.top_k = 2;
  cfg.renormalize = true;
  const std::int64_t T = 9;
  std::uint64_t seed = test::fresh_seed();
  MoELayer layer(*b, *comm, cfg);
  Stream& s = layer.compute_stream();
  Tensor x = b->empty({T, 6}, DType::f32, MemCategory::activations, s);
  Tensor dy = b->empty({T, 6}, DType::f32, MemCategory::activations, s);
  // The loss jumps where a perturbation flips a routing decision: draw inputs whose top-k
  // probabilities are all well apart (checked with the float64 reference). A step of h along
  // d moves a probability by about p * h * |x·d| ~ 3e-4 here, so 2e-3 leaves a wide margin.
  for (int attempt = 0;; ++attempt, seed = Rng::mix(seed, 31)) {
    ASSERT_LT(attempt, 200) << "no input without a near-tie";
    layer.init_parameters(seed);
    b->upload(test::uniform(T * 6, Rng::mix(seed, 1)), x);
    const ref::Params P = test::reference_params(*b, layer);
    if (ref::forward_backward(cfg, P, test::to_double(b->download(x)), {}, nullptr, 0, nullptr).min_topk_gap > 2e-3)
      break;
  }
  const auto dyh = test::uniform(T * 6, Rng::mix(seed, 2));
  b->upload(dyh, dy);
  const float ga = 0.5f;
  auto loss = [&]() {
    Tensor y = layer.forward(x);
    const auto yh = b->download(y);
    double l = ga * layer.aux_loss();
    for (std::size_t i = 0; i < yh.size(); ++i) l += static_cast<double>(dyh[i]) * yh[i];
    return l;
  };
  layer.zero_grad();
  layer.forward(x);
  Tensor dx = layer.backward(dy, ga);
  b->synchronize();
  struct Item {
    const char* name;
    Tensor value, grad;
  };
  std::vector<Item> items = {{"x", x, dx},
                             {"W_gate", layer.params().w_gate, layer.grads().w_gate},
                             {"W1", layer.params().w1, layer.grads().w1},
                             {"W2", layer.params().w2, layer.grads().w2}};
  for (auto& it : items) {
    const auto v0 = b->download(it.value);
    const auto g = b->download(it.grad);
    const auto d = test::uniform(v0.size(), Rng::mix(seed, 7));
    double analytic = 0;
    for (std::size_t i = 0; i < g.size(); ++i) analytic += static_cast<double>(g[i]) * d[i];
    const double h = 1e-3;
    auto shifted = [&](double sgn) {
      std::vector<float> v(v0.size());
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(v0[i] + sgn * h * d[i]);
      b->upload(v, it.value);
      return loss();
    };
    const double fd = (shifted(+1) - shifted(-1)) / (2 * h);
    b->upload(v0, it.value);
    EXPECT_NEAR(analytic, fd, 2e-3 * std::max(1.0, std::abs(fd))) << it.name;
  }
}

// permute -> unpermute returns the input, and the backward pair returns the gradient, bit for
// bit (weights 1 for k = 1; 0.5 + 0.5 for k = 2, exact in binary), on cpu and cuda.
class PermuteRoundTrip : public ::testing::TestWithParam<std::string> {};

TEST_P(PermuteRoundTrip, Exact) {
  if (GetParam() == "cuda" && !cuda_available()) GTEST_SKIP() << "no CUDA device";
  auto b = make_backend(GetParam());
  Stream& s = b->default_stream();
  const std::uint64_t seed = test::fresh_seed();
  for (int k : {1, 2}) {
    const std::int64_t T = 41, M = 13, E = 5;
    Tensor logits = b->empty({T, E}, DType::f32, MemCategory::buffers, s);
    b->upload(test::uniform(T * E, Rng::mix(seed, k)), logits);
    GateForward g;
    g.logits = logits;
    g.top_k = k;
    g.probs = b->empty({T, E}, DType::f32, MemCategory::buffers, s);
    g.topk_idx = b->empty({T, k}, DType::i32, MemCategory::buffers, s);
    g.topk_w = b->empty({T, k}, DType::f32, MemCategory::buffers, s);
    g.slot = b->empty({T, k}, DType::i32, MemCategory::buffers, s);
    g.counts = b->empty({E}, DType::i32, MemCategory::buffers, s);
    g.routed_frac = b->empty({E}, DType::f32, MemCategory::buffers, s);
    g.aux_loss = b->empty({1}, DType::f32, MemCategory::buffers, s);
    b->gate_forward(s, g);
    Tensor w = b->empty({T, k}, DType::f32, MemCategory::buffers, s);
    b->upload(std::vector<float>(static_cast<std::size_t>(T * k), k == 1 ? 1.0f : 0.5f), w);
    const auto xh = test::uniform(T * M, Rng::mix(seed, 10 + k));
    Tensor x = b->empty({T, M}, DType::f32, MemCategory::buffers, s);
    b->upload(xh, x);
    Tensor perm = b->empty({T * k, M}, DType::f32, MemCategory::buffers, s);
    b->permute(s, x, g.slot, perm);
    Tensor back = b->empty({T, M}, DType::f32, MemCategory::buffers, s);
    b->unpermute(s, perm, g.slot, w, back);
    // backward: unpermute_backward then permute_backward returns dy
    Tensor d_perm = b->empty({T * k, M}, DType::f32, MemCategory::buffers, s);
    Tensor dw = b->empty({T, k}, DType::f32, MemCategory::buffers, s);
    b->unpermute_backward(s, x, perm, g.slot, w, d_perm, dw);
    Tensor dx = b->empty({T, M}, DType::f32, MemCategory::buffers, s);
    b->permute_backward(s, d_perm, g.slot, dx);
    b->synchronize();
    EXPECT_EQ(b->download(back), xh) << "k=" << k;
    // k = 2: d_perm rows are 0.5*x, and 0.5x + 0.5x == x exactly
    EXPECT_EQ(b->download(dx), xh) << "k=" << k;
    // dw[t,j] = <x[t], perm[slot]> = |x[t]|^2
    const auto dwh = b->download(dw);
    for (std::int64_t t = 0; t < T; ++t) {
      double n2 = 0;
      for (std::int64_t m = 0; m < M; ++m) n2 += static_cast<double>(xh[static_cast<std::size_t>(t * M + m)]) * xh[static_cast<std::size_t>(t * M + m)];
      for (int j = 0; j < k; ++j) EXPECT_NEAR(dwh[static_cast<std::size_t>(t * k + j)], n2, 1e-5 * n2);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, PermuteRoundTrip, ::testing::Values("cpu", "cuda"));

}  // namespace
}  // namespace moelab

namespace moelab {
namespace {

// A small cpu layer (M 8, H 12, 4 experts, top-2, no capacity limit) and 17 tokens of input
// and output gradient on fresh seeds.
struct SmallLayer {
  std::unique_ptr<Backend> b = make_backend("cpu");
  std::unique_ptr<Communicator> comm = make_self_communicator(*b);
  ModelConfig cfg = [] {
    ModelConfig c;
    c.d_model = 8;
    c.d_hidden = 12;
    c.num_experts = 4;
    c.top_k = 2;
    c.noisy_gate = false;
    return c;
  }();
  std::uint64_t seed = test::fresh_seed();
  MoELayer layer{*b, *comm, cfg};
  Tensor x, dy;  // [17, 8]
  SmallLayer() {
    layer.init_parameters(seed);
    Stream& s = layer.compute_stream();
    x = b->empty({17, 8}, DType::f32, MemCategory::activations, s);
    dy = b->empty({17, 8}, DType::f32, MemCategory::activations, s);
    b->upload(test::uniform(17 * 8, Rng::mix(seed, 1)), x);
    b->upload(test::uniform(17 * 8, Rng::mix(seed, 2)), dy);
  }
  void step() {
    layer.forward(x);
    layer.backward(dy, 0.1f);
    b->synchronize();
  }
};

// backward() accumulates into the gradients (as autograd does): two identical steps give
// twice the gradients of one; zero_grad() starts again from zero.
TEST(MoELayer, GradientsAccumulateAcrossBackwardCalls) {
  SmallLayer t;
  auto& b = t.b;
  auto& layer = t.layer;
  auto step = [&] { t.step(); };
  step();
  std::vector<std::vector<float>> once;
  for (Tensor* g : {&layer.grads().w_gate, &layer.grads().w1, &layer.grads().w2}) once.push_back(b->download(*g));
  step();
  int i = 0;
  for (Tensor* g : {&layer.grads().w_gate, &layer.grads().w1, &layer.grads().w2}) {
    std::vector<double> twice;
    for (float v : once[static_cast<std::size_t>(i)]) twice.push_back(2.0 * v);
    EXPECT_TRUE(test::all_close("accumulated grad " + std::to_string(i), b->download(*g), twice, 1e-5));
    ++i;
  }
  layer.zero_grad();
  step();
  EXPECT_TRUE(test::all_close("after zero_grad", b->download(layer.grads().w1), test::to_double(once[1]), 1e-5));
}

// zero_grad does not pass over the experts' gradients (MoELayer::zero_grad): no op of a step
// after it zeroes a whole weight's gradient, and the step's gradients are those of the same
// step from zeroed gradients, the stale ones gone.
TEST(MoELayer, ZeroGradLeavesTheExpertGradientsToTheBackward) {
  SmallLayer t;
  auto& b = t.b;
  auto& layer = t.layer;
  t.step();
  const auto w1 = b->download(layer.grads().w1), w2 = b->download(layer.grads().w2);
  t.step();  // stale gradients: twice the step's
  layer.zero_grad();
  b->clear_timeline();
  t.step();
  const double whole = static_cast<double>(layer.grads().w1.nbytes());
  for (const OpRecord& r : b->timeline())
    EXPECT_FALSE(r.name == "fill_zero" && r.cost.bytes_written >= whole) << "a whole gradient zeroed";
  EXPECT_TRUE(test::all_close("dW1", b->download(layer.grads().w1), test::to_double(w1), 1e-6));
  EXPECT_TRUE(test::all_close("dW2", b->download(layer.grads().w2), test::to_double(w2), 1e-6));
}

// The GEMM floor (MoELayer::expert_floor_problems): the six expert GEMMs of the last step, each
// one balanced batch of ceil(R/El) rows per expert whose operands are at fixed strides (one
// strided batch per weight GEMM), with the layer's FLOPs up to that rounding; timing it leaves
// the gradients as they were (its weight-gradient GEMMs add products of zeros).
TEST(MoELayer, GemmFloorIsBalancedStridedBatchesOfTheSameWork) {
  SmallLayer sl;
  auto& b = sl.b;
  auto& layer = sl.layer;
  sl.step();
  std::int64_t R = 0;
  for (std::int64_t r : layer.routing().recv_per_local) R += r;
  ASSERT_EQ(R, 17 * 2);  // no capacity limit: every token-slot
  const std::int64_t El = 4, t = (R + El - 1) / El, M = 8, H = 12;
  const auto floor = layer.expert_floor_problems();
  ASSERT_EQ(floor.size(), 6u * El);
  const double extra = 6.0 * 2.0 * static_cast<double>(M * H * (El * t - R));
  EXPECT_DOUBLE_EQ(cost_grouped_gemm(floor).flops, cost_grouped_gemm(layer.expert_gemm_problems()).flops + extra);
  std::vector<GemmOperands> ops;
  for (const auto& p : floor) {
    ops.push_back(gemm_operands(p));
    EXPECT_EQ(ops.back().shape.rows(), t);
  }
  const auto runs = strided_runs(ops);
  ASSERT_EQ(runs.size(), 6u);
  for (const auto& r : runs) EXPECT_EQ(r.size(), static_cast<std::size_t>(El));
  const auto w1 = b->download(layer.grads().w1), w2 = b->download(layer.grads().w2);
  EXPECT_GT(b->time_batched_gemms(floor, 1), 0.0);
  EXPECT_EQ(b->download(layer.grads().w1), w1);
  EXPECT_EQ(b->download(layer.grads().w2), w2);
}

}  // namespace
}  // namespace moelab

// ---- several microbatches in flight (harness/nn/saved.hpp) ---------------------------------

namespace moelab {
namespace {

struct InFlightCase {
  std::string impl;
  nlohmann::json options;
  bool defers;  // backward_input leaves the weight gradients to backward_weight
};
void PrintTo(const InFlightCase& c, std::ostream* os) { *os << c.impl << " " << c.options.dump(); }

ModelConfig in_flight_config() {
  ModelConfig cfg;
  cfg.d_model = 12;
  cfg.d_hidden = 20;
  cfg.num_experts = 6;
  cfg.top_k = 2;
  cfg.capacity_factor = 1.0;  // some slots are dropped
  cfg.noisy_gate = true;      // the noise must follow the work's key, not the order of calls
  cfg.renormalize = true;
  return cfg;
}

// What one schedule of two microbatches produced.
struct TwoMicrobatches {
  std::vector<float> y[2], dx[2], eps[2];
  std::vector<float> dwg, dwn, dw1, dw2;
  bool weight_grads_after_input = false;  // any dW1 entry nonzero right after both backward_inputs
  std::size_t in_use_in_flight[2] = {0, 0};  // device bytes charged to each microbatch, both in flight
  std::map<int, std::size_t> in_use_after;   // ... once every Saved and output is gone
};

constexpr std::int64_t kTokens[2] = {29, 18};
const WorkKey kKeys[2] = {{3, 0, 7}, {3, 1, 7}};  // layer 3, microbatches 0 and 1, step 7

// interleaved: forward 0, forward 1, backward_input 1, backward_input 0, backward_weight 1,
// backward_weight 0; else each microbatch's forward and backward one after the other, the
// second microbatch first when `reverse`.
TwoMicrobatches run_two(const InFlightCase& ic, std::uint64_t seed, bool interleaved, bool reverse = false) {
  auto b = make_backend("cpu");
  auto comm = make_self_communicator(*b);
  register_builtin_impls();
  const ModelConfig cfg = in_flight_config();
  auto impl = make_impl(ic.impl, *b, *comm, cfg, ic.options);
  impl->init_parameters(seed);
  impl->layer().set_noise_seed(Rng::mix(seed, 5));
  Stream& s = b->default_stream();
  TwoMicrobatches r;
  {
    Tensor x[2], dy[2];
    for (int m = 0; m < 2; ++m) {
      x[m] = b->empty({kTokens[m], cfg.d_model}, cfg.dtype, MemCategory::activations, s);
      dy[m] = b->empty({kTokens[m], cfg.d_model}, cfg.dtype, MemCategory::activations, s);
      b->upload(test::uniform(static_cast<std::size_t>(kTokens[m] * cfg.d_model), Rng::mix(seed, 10 + m)), x[m]);
      b->upload(test::uniform(static_cast<std::size_t>(kTokens[m] * cfg.d_model), Rng::mix(seed, 20 + m)), dy[m]);
    }
    Forwarded f[2];
    Tensor dx[2];
    auto fwd = [&](int m) {
      f[m] = impl->forward(x[m], kKeys[m]);
      r.eps[m] = impl->layer().noise(*f[m].saved);
    };
    auto bwd_input = [&](int m) { dx[m] = impl->backward_input(*f[m].saved, dy[m], 0.3f); };
    if (interleaved) {
      fwd(0);
      fwd(1);
      b->synchronize();
      const auto mb = b->memory().microbatch_in_use();
      for (int m = 0; m < 2; ++m) r.in_use_in_flight[m] = mb.count(m) ? mb.at(m) : 0;
      bwd_input(1);
      bwd_input(0);
      b->synchronize();
      for (float v : b->download(impl->grads().w1)) r.weight_grads_after_input |= v != 0.0f;
      impl->backward_weight(*f[1].saved);
      impl->backward_weight(*f[0].saved);
    } else {
      for (int m : reverse ? std::vector<int>{1, 0} : std::vector<int>{0, 1}) {
        fwd(m);
        bwd_input(m);
        impl->backward_weight(*f[m].saved);
      }
    }
    b->synchronize();
    for (int m = 0; m < 2; ++m) {
      r.y[m] = b->download(f[m].y);
      r.dx[m] = b->download(dx[m]);
    }
  }  // every Saved, output and input gone
  b->synchronize();
  r.in_use_after = b->memory().microbatch_in_use();
  r.dwg = b->download(impl->grads().w_gate);
  r.dwn = b->download(impl->grads().w_noise);
  r.dw1 = b->download(impl->grads().w1);
  r.dw2 = b->download(impl->grads().w2);
  return r;
}

class MicrobatchesInFlight : public ::testing::TestWithParam<InFlightCase> {};

TEST_P(MicrobatchesInFlight, SameAsOneAfterTheOtherAndTheFloat64Reference) {
  const InFlightCase& ic = GetParam();
  const ModelConfig cfg = in_flight_config();
  std::uint64_t seed = test::fresh_seed();
  // Inputs whose top-k probabilities are well apart (fp32 and float64 route alike).
  auto b = make_backend("cpu");
  auto self = make_self_communicator(*b);
  ref::Params P;
  std::vector<double> eps_ref[2];
  for (int attempt = 0;; ++attempt, seed = Rng::mix(seed, 41)) {
    ASSERT_LT(attempt, 50) << "no input without a near-tie";
    MoELayer single(*b, *self, cfg);
    single.init_parameters(seed);
    P = test::reference_params(*b, single);
    bool ok = true;
    for (int m = 0; m < 2 && ok; ++m) {
      // The noise of (layer, microbatch, step): Rng(mix(noise_seed, rank, work_seed(key))).
      Rng nr(Rng::mix(Rng::mix(seed, 5), 0, MoELayer::work_seed(kKeys[m])));
      eps_ref[m].resize(static_cast<std::size_t>(kTokens[m] * cfg.num_experts));
      for (auto& v : eps_ref[m]) v = static_cast<float>(nr.normal());
      const auto x = test::to_double(test::uniform(static_cast<std::size_t>(kTokens[m] * cfg.d_model), Rng::mix(seed, 10 + m)));
      ok = ref::forward_backward(cfg, P, x, eps_ref[m], nullptr, 0, nullptr).min_topk_gap > 1e-4;
    }
    if (ok) break;
  }
  SCOPED_TRACE("seed " + std::to_string(seed));

  const TwoMicrobatches a = run_two(ic, seed, true), s = run_two(ic, seed, false), r = run_two(ic, seed, false, true);
  for (int m = 0; m < 2; ++m) {
    SCOPED_TRACE("microbatch " + std::to_string(m));
    // The noise is the key's, whatever the order the work was issued in.
    EXPECT_EQ(a.eps[m], s.eps[m]);
    EXPECT_EQ(r.eps[m], s.eps[m]);
    EXPECT_EQ(test::to_double(a.eps[m]), eps_ref[m]);
    // Each microbatch's forward and input gradient depend on nothing else in flight.
    EXPECT_EQ(a.y[m], s.y[m]);
    EXPECT_EQ(a.dx[m], s.dx[m]);
    EXPECT_EQ(r.y[m], s.y[m]);
    // Memory: charged to the microbatch while in flight, all of it returned once its Saved went.
    EXPECT_GT(a.in_use_in_flight[m], 0u);
    for (const TwoMicrobatches* t : {&a, &s, &r})
      EXPECT_EQ(t->in_use_after.count(m) ? t->in_use_after.at(m) : 0, 0u);
  }
  EXPECT_NE(a.eps[0], std::vector<float>(a.eps[0].size(), a.eps[0][0]));
  EXPECT_NE(std::vector<float>(a.eps[0].begin(), a.eps[0].begin() + 10),
            std::vector<float>(a.eps[1].begin(), a.eps[1].begin() + 10));  // different microbatches, different noise
  EXPECT_EQ(a.weight_grads_after_input, !ic.defers);
  // Summed gradients: the same sums in another order.
  EXPECT_TRUE(test::all_close("dW_gate", a.dwg, test::to_double(s.dwg), 1e-5));
  EXPECT_TRUE(test::all_close("dW_noise", a.dwn, test::to_double(s.dwn), 1e-5));
  EXPECT_TRUE(test::all_close("dW1", a.dw1, test::to_double(s.dw1), 1e-5));
  EXPECT_TRUE(test::all_close("dW2", a.dw2, test::to_double(s.dw2), 1e-5));

  // The float64 reference, microbatch by microbatch, the parameter gradients summed.
  ref::Grads G;
  G.init(P, 0);
  for (int m = 0; m < 2; ++m) {
    ref::Grads g;
    g.init(P, kTokens[m]);
    g.dwg = G.dwg, g.dwn = G.dwn, g.dw1 = G.dw1, g.dw2 = G.dw2;
    const auto x = test::to_double(test::uniform(static_cast<std::size_t>(kTokens[m] * cfg.d_model), Rng::mix(seed, 10 + m)));
    const auto dy = test::to_double(test::uniform(static_cast<std::size_t>(kTokens[m] * cfg.d_model), Rng::mix(seed, 20 + m)));
    const ref::Result R = ref::forward_backward(cfg, P, x, eps_ref[m], &dy, 0.3, &g);
    EXPECT_TRUE(test::all_close("y" + std::to_string(m), a.y[m], R.y, 1e-4));
    EXPECT_TRUE(test::all_close("dx" + std::to_string(m), a.dx[m], g.dx, 1e-4));
    G.dwg = g.dwg, G.dwn = g.dwn, G.dw1 = g.dw1, G.dw2 = g.dw2;
  }
  EXPECT_TRUE(test::all_close("dW_gate vs float64", a.dwg, G.dwg, 1e-4));
  EXPECT_TRUE(test::all_close("dW_noise vs float64", a.dwn, G.dwn, 1e-4));
  EXPECT_TRUE(test::all_close("dW1 vs float64", a.dw1, G.dw1, 1e-4));
  EXPECT_TRUE(test::all_close("dW2 vs float64", a.dw2, G.dw2, 1e-4));
}

INSTANTIATE_TEST_SUITE_P(Impls, MicrobatchesInFlight,
                         ::testing::Values(InFlightCase{"fastmoe", nlohmann::json::object(), true},
                                           InFlightCase{"fastermoe", {{"group_size", 1}}, true},
                                           InFlightCase{"mpipemoe", {{"partitions", 3}}, false},
                                           InFlightCase{"mpipemoe", {{"partitions", 2}, {"strategy", "S2"}}, false},
                                           InFlightCase{"mpipemoe", {{"partitions", 3}, {"strategy", "S3"}}, false},
                                           InFlightCase{"mpipemoe",
                                                        {{"partitions", 3}, {"strategy", "S1"}, {"t_m_buffers", 2}},
                                                        false}),
                         [](const auto& tp) {
                           std::string n = tp.param.impl + "_" + std::to_string(tp.index);
                           return n;
                         });

// The MoE layers of a model share one set of streams and communicators: layers 0 and 1 (a
// FastMoE and an MPipeMoE layer, made through the registry) on one MoEChannels, their work
// interleaved, compute what each computes alone.
TEST(MoELayer, LayersShareOneSetOfChannels) {
  register_builtin_impls();
  const ModelConfig cfg = in_flight_config();
  const std::uint64_t seed = test::fresh_seed();
  const std::int64_t T = 21;
  const nlohmann::json opts[2] = {nlohmann::json::object(), {{"partitions", 2}, {"strategy", "S2"}}};
  const char* names[2] = {"fastmoe", "mpipemoe"};
  auto run = [&](bool shared) {
    auto b = make_backend("cpu");
    auto comm = make_self_communicator(*b);
    std::unique_ptr<MoEChannels> channels;
    if (shared) channels = std::make_unique<MoEChannels>(*b, *comm);
    std::unique_ptr<MoEImpl> layer[2];
    for (int l = 0; l < 2; ++l) {
      layer[l] = make_impl(names[l], *b, *comm, cfg, opts[l], channels.get());
      layer[l]->init_parameters(Rng::mix(seed, l));
      layer[l]->layer().set_noise_seed(Rng::mix(seed, 5));
      if (shared) {
        EXPECT_EQ(&layer[l]->layer().channels(), channels.get());
      }
    }
    if (!shared) {
      EXPECT_NE(&layer[0]->layer().channels(), &layer[1]->layer().channels());
    }
    Stream& s = b->default_stream();
    Tensor x = b->empty({T, cfg.d_model}, cfg.dtype, MemCategory::activations, s);
    b->upload(test::uniform(static_cast<std::size_t>(T * cfg.d_model), seed), x);
    std::vector<std::vector<float>> out;
    Forwarded f0 = layer[0]->forward(x, {0, 0, 1});
    Forwarded f1 = layer[1]->forward(f0.y, {1, 0, 1});
    Tensor d1 = layer[1]->backward_input(*f1.saved, f1.y, 0.1f);
    layer[1]->backward_weight(*f1.saved);
    Tensor d0 = layer[0]->backward_input(*f0.saved, d1, 0.1f);
    layer[0]->backward_weight(*f0.saved);
    b->synchronize();
    for (const Tensor* t : {&f0.y, &f1.y, &d1, &d0}) out.push_back(b->download(*t));
    for (int l = 0; l < 2; ++l)
      for (Tensor* g : {&layer[l]->grads().w_gate, &layer[l]->grads().w1, &layer[l]->grads().w2})
        out.push_back(b->download(*g));
    return out;
  };
  const auto alone = run(false), shared = run(true);
  ASSERT_EQ(alone.size(), shared.size());
  for (std::size_t i = 0; i < alone.size(); ++i) EXPECT_EQ(alone[i], shared[i]) << "tensor " << i;
}

// The one-in-flight API keys its work {layer 0, microbatch 0, step} with the step counted per
// forward, and work_seed of that key is the step: the gate noise is Rng(mix(noise_seed, rank,
// step)), the stream the layer has always drawn.
TEST(MoELayer, OneInFlightNoiseIsTheStepsStream) {
  auto b = make_backend("cpu");
  auto comm = make_self_communicator(*b);
  ModelConfig cfg = in_flight_config();
  const std::uint64_t seed = test::fresh_seed();
  MoELayer layer(*b, *comm, cfg);
  layer.init_parameters(seed);
  layer.set_noise_seed(Rng::mix(seed, 5));
  Tensor x = b->empty({9, cfg.d_model}, cfg.dtype, MemCategory::activations, layer.compute_stream());
  b->upload(test::uniform(static_cast<std::size_t>(9 * cfg.d_model), seed), x);
  for (std::uint64_t step = 1; step <= 3; ++step) {
    EXPECT_EQ(MoELayer::work_seed({0, 0, step}), step);
    layer.forward(x);
    Rng rng(Rng::mix(Rng::mix(seed, 5), 0, step));
    std::vector<float> want(static_cast<std::size_t>(9 * cfg.num_experts));
    for (auto& v : want) v = static_cast<float>(rng.normal());
    EXPECT_EQ(layer.last_noise(), want) << "step " << step;
    // ... and the same key through the handle API draws the same numbers.
    const Forwarded f = layer.forward(x, {0, 0, step});
    EXPECT_EQ(layer.noise(*f.saved), want) << "step " << step;
  }
  EXPECT_NE(MoELayer::work_seed({0, 1, 1}), MoELayer::work_seed({0, 0, 1}));
  EXPECT_NE(MoELayer::work_seed({1, 0, 1}), MoELayer::work_seed({0, 0, 1}));
}

// The padded layout's stride: the busiest expert's rows; "auto" (max_waste 12.5%) packs a step
// whose padding is above it; and peer_chunk lays the experts out at that stride.
TEST(PaddedLayout, StrideAndChunk) {
  EXPECT_EQ(padded_stride({64, 60, 64, 62, 64, 64, 60, 58}, 0.125), 64);  // 3.1% padding
  EXPECT_EQ(padded_stride({64, 32, 64, 32}, 0.125), 0);                   // 25%: packed
  EXPECT_EQ(padded_stride({64, 32, 64, 32}, 0.25), 64);                   // the threshold itself pads
  EXPECT_EQ(padded_stride({64, 32, 64, 32}, 1.0), 64);                    // "padded": always
  EXPECT_EQ(padded_stride({0, 0}, 1.0), 0);                               // nothing to lay out
  EXPECT_EQ(padded_stride({}, 1.0), 0);
  // Two ranks, two local experts each: rank p sends recv[p*2 + l] rows to my expert l.
  const std::vector<std::int64_t> sent = {3, 1, 2, 2}, recv = {3, 1, 4, 0};
  const std::vector<int> both = {0, 1};
  const std::int64_t M = 5;
  const Chunk packed = peer_chunk(sent, recv, 2, M, both, both);
  EXPECT_EQ(packed.rows, (std::vector<std::int64_t>{7, 1}));
  EXPECT_EQ(packed.offset, (std::vector<std::int64_t>{0, 7}));
  EXPECT_EQ(packed.R, 8);
  EXPECT_EQ(packed.stride, 0);
  const Chunk padded = peer_chunk(sent, recv, 2, M, both, both, 7);
  EXPECT_EQ(padded.rows, packed.rows);
  EXPECT_EQ(padded.offset, (std::vector<std::int64_t>{0, 7}));
  EXPECT_EQ(padded.R, 14);
  EXPECT_EQ(padded.stride, 7);
  // Expert 1's rows from rank 0 land at its padded first row (7), in elements of M.
  ASSERT_EQ(padded.recvs.size(), 4u);
  EXPECT_EQ(padded.recvs[1].offset, 7 * M);
  EXPECT_EQ(padded.recvs[2].offset, 3 * M);  // expert 0's rows from rank 1 after rank 0's 3
  EXPECT_THROW(peer_chunk(sent, recv, 2, M, both, both, 6), std::exception);  // a stride below the busiest
}

}  // namespace
}  // namespace moelab
