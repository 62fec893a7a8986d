// harness/tests/moe_layer_mpi_test.cpp — every MoE implementation (FastMoE, FasterMoE,
// MPipeMoE, ...) on N MPI ranks (expert parallelism EP = N, cpu backend, Open MPI) gives the
// same outputs and gradients as the single-process layer and the float64 reference, with one
// microbatch and with two in flight.
//   mpirun --oversubscribe -np 4 build/harness/tests/moe_layer_mpi_test
// Every rank holds different tokens (and a different, awkward count of them). Since inputs
// and parameters are functions of the seed, each rank can rebuild every other rank's tokens
// and compute, in-process, what its outputs and its experts' gradients must be.
#include <gtest/gtest.h>

#include <algorithm>

#include "harness/comm/world.hpp"
#include "harness/nn/moe_impl.hpp"
#include "harness/nn/moe_layer.hpp"
#include "harness/tests/moe_reference.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab {
namespace {

std::uint64_t g_seed = 0;  // agreed across ranks in main()

ModelConfig config(bool noisy) {
  ModelConfig cfg;
  cfg.d_model = 12;
  cfg.d_hidden = 20;
  cfg.num_experts = 8;
  cfg.top_k = 2;
  cfg.capacity_factor = 1.0;  // with 2 tokens/expert on average, some overflow
  cfg.activation = Activation::gelu;
  cfg.noisy_gate = noisy;
  return cfg;
}

std::int64_t tokens_of(int rank) { return 23 + 11 * rank; }  // different and odd on each rank

// (implementation, its options): every schedule must compute the same function.
struct ImplCase {
  std::string name;
  nlohmann::json options;
};
const std::vector<ImplCase>& impl_cases() {
  static const std::vector<ImplCase> cases = {
      {"fastmoe", nlohmann::json::object()},
      {"fastmoe", {{"expert_layout", "padded"}}},
      {"fastermoe", {{"group_size", 2}}},
      {"fastermoe", {{"group_size", 1}}},
        {"mpipemoe", {{"partitions", 1}}},
      {"mpipemoe", {{"partitions", 3}}},
      {"mpipemoe", {{"partitions", "auto"}, {"min_partition_tokens", 4}}},
      {"mpipemoe", {{"partitions", 2}, {"strategy", "S1"}}},
      {"mpipemoe", {{"partitions", 2}, {"strategy", "S2"}}},
      {"mpipemoe", {{"partitions", 2}, {"strategy", "S3"}}},
      {"mpipemoe", {{"partitions", 2}, {"strategy", "S4"}}},
      {"mpipemoe", {{"partitions", 3}, {"strategy", "S1"}, {"t_m_buffers", 2}}},
      {"mpipemoe", {{"partitions", 3}, {"strategy", "S2"}, {"t_m_buffers", 2}}},
      {"mpipemoe", {{"partitions", 2}, {"strategy", "auto"}}},
      {"top2", nlohmann::json::object()},
      {"top2-pipelined", {{"chunks", 3}}},
  };
  return cases;
}

// gtest names allow letters, digits and underscores only ("top2-pipelined" -> "top2_pipelined").
std::string test_name(std::string impl) {
  std::replace(impl.begin(), impl.end(), '-', '_');
  return impl;
}

class MoELayerMpi : public ::testing::TestWithParam<std::tuple<bool, std::size_t>> {};

// fp32 and float64 may route a token differently when two of its gate probabilities are
// within rounding of each other. Every rank can rebuild every rank's inputs, so all ranks
// derive, without communicating, the same first seed after g_seed whose inputs have no such
// near-tie anywhere.
std::vector<double> reference_noise(std::uint64_t seed, int r, const ModelConfig& cfg) {
  std::vector<double> eps;
  if (!cfg.noisy_gate) return eps;
  Rng nr(Rng::mix(Rng::mix(seed, 5), static_cast<std::uint64_t>(r), 1));
  eps.resize(static_cast<std::size_t>(tokens_of(r) * cfg.num_experts));
  for (auto& e : eps) e = static_cast<float>(nr.normal());  // the layer draws fp32 noise
  return eps;
}

std::uint64_t agreed_seed_without_near_ties(const ModelConfig& cfg, int size) {
  auto b = make_backend("cpu");
  auto self = make_self_communicator(*b);
  std::uint64_t seed = g_seed;
  for (;; seed = Rng::mix(seed, 77)) {
    MoELayer single(*b, *self, cfg);
    single.init_parameters(seed);
    const ref::Params P = test::reference_params(*b, single);
    bool ok = true;
    for (int r = 0; r < size && ok; ++r) {
      const auto x = test::to_double(test::uniform(static_cast<std::size_t>(tokens_of(r) * cfg.d_model), Rng::mix(seed, 100 + r)));
      ok = ref::forward_backward(cfg, P, x, reference_noise(seed, r, cfg), nullptr, 0, nullptr).min_topk_gap > 1e-6;
    }
    if (ok) return seed;
  }
}

TEST_P(MoELayerMpi, MatchesSingleProcessAndFloat64Reference) {
  const bool noisy = std::get<0>(GetParam());
  const ImplCase& ic = impl_cases()[std::get<1>(GetParam())];
  SCOPED_TRACE(ic.name + " " + ic.options.dump());
  const ModelConfig cfg = config(noisy);
  const int rank = world_rank(), size = world_size();
  const std::uint64_t seed = agreed_seed_without_near_ties(cfg, size);
  auto b = make_backend("cpu");
  b->set_rank(rank);
  auto comm = make_world_communicator(*b);
  ASSERT_EQ(comm->size(), size);

  // ---- the expert-parallel layer on all ranks ------------------------------------------
  auto impl = make_impl(ic.name, *b, *comm, cfg, ic.options);
  MoEImpl& layer = *impl;
  layer.init_parameters(seed);
  layer.layer().set_noise_seed(Rng::mix(seed, 5));
  Stream& s = b->default_stream();
  const std::int64_t T = tokens_of(rank), M = cfg.d_model;
  auto x_of = [&](int r) { return test::uniform(static_cast<std::size_t>(tokens_of(r) * M), Rng::mix(seed, 100 + r)); };
  auto dy_of = [&](int r) { return test::uniform(static_cast<std::size_t>(tokens_of(r) * M), Rng::mix(seed, 200 + r)); };
  Tensor x = b->empty({T, M}, cfg.dtype, MemCategory::activations, s);
  Tensor dy = b->empty({T, M}, cfg.dtype, MemCategory::activations, s);
  b->upload(x_of(rank), x);
  b->upload(dy_of(rank), dy);
  const float ga = 0.25f;
  Tensor y = layer.forward(x);
  const float aux = layer.aux_loss();
  Tensor dx = layer.backward(dy, ga);
  b->synchronize();
  const auto y_h = b->download(y), dx_h = b->download(dx);
  const auto dwg_h = b->download(layer.grads().w_gate), dw1_h = b->download(layer.grads().w1),
             dw2_h = b->download(layer.grads().w2);

  // ---- in-process references: a single-process layer (EP = 1) and float64 --------------
  auto b1 = make_backend("cpu");
  auto self = make_self_communicator(*b1);
  MoELayer single(*b1, *self, cfg);
  single.init_parameters(seed);
  const ref::Params P = test::reference_params(*b1, single);
  ref::Grads sum;  // expert gradients summed over the tokens of every rank
  sum.init(P, 0);
  ref::Result mine;
  ref::Grads my_grads;
  std::vector<float> single_y, single_dx;
  for (int r = 0; r < size; ++r) {
    // The noise the rank-r layer drew: same seed scheme, keyed on its rank and step 1.
    const std::vector<double> eps = reference_noise(seed, r, cfg);
    ref::Grads G;
    G.init(P, tokens_of(r));
    const auto xd = test::to_double(x_of(r)), dyd = test::to_double(dy_of(r));
    const auto R = ref::forward_backward(cfg, P, xd, eps, &dyd, ga, &G);
    for (std::size_t i = 0; i < sum.dw1.size(); ++i) sum.dw1[i] += G.dw1[i];
    for (std::size_t i = 0; i < sum.dw2.size(); ++i) sum.dw2[i] += G.dw2[i];
    if (r == rank) {
      mine = R;
      my_grads = G;
      if (noisy) {
        EXPECT_EQ(test::to_double(layer.layer().last_noise()), eps);
      }
      // the single-process layer on this rank's tokens
      Stream& s1 = single.compute_stream();
      Tensor x1 = b1->empty({T, M}, cfg.dtype, MemCategory::activations, s1);
      Tensor dy1 = b1->empty({T, M}, cfg.dtype, MemCategory::activations, s1);
      b1->upload(x_of(r), x1);
      b1->upload(dy_of(r), dy1);
      single.set_noise_seed(Rng::mix(seed, 5));
      if (!noisy) {  // (its noise would be keyed on rank 0, so compare it only without noise)
        Tensor y1 = single.forward(x1);
        Tensor dx1 = single.backward(dy1, ga);
        b1->synchronize();
        single_y = b1->download(y1);
        single_dx = b1->download(dx1);
      }
    }
  }

  EXPECT_EQ(layer.routing().sent_per_expert, mine.counts);
  EXPECT_NEAR(aux, mine.aux, 1e-5 * std::abs(mine.aux) + 1e-6);
  EXPECT_TRUE(test::all_close("y", y_h, mine.y, 1e-4));
  EXPECT_TRUE(test::all_close("dx", dx_h, my_grads.dx, 1e-4));
  EXPECT_TRUE(test::all_close("dW_gate", dwg_h, my_grads.dwg, 1e-4));
  // this rank's experts: a slice of the global expert gradients
  const std::int64_t El = layer.layer().local_experts(), H = cfg.d_hidden;
  const auto off = static_cast<std::ptrdiff_t>(rank * El * M * H), len = static_cast<std::ptrdiff_t>(El * M * H);
  EXPECT_TRUE(test::all_close("dW1", dw1_h, {sum.dw1.begin() + off, sum.dw1.begin() + off + len}, 1e-4));
  EXPECT_TRUE(test::all_close("dW2", dw2_h, {sum.dw2.begin() + off, sum.dw2.begin() + off + len}, 1e-4));
  if (!noisy) {
    EXPECT_TRUE(test::all_close("y vs single-process", y_h, test::to_double(single_y), 1e-5));
    EXPECT_TRUE(test::all_close("dx vs single-process", dx_h, test::to_double(single_dx), 1e-5));
  }
}

INSTANTIATE_TEST_SUITE_P(Impls, MoELayerMpi,
                         ::testing::Combine(::testing::Values(false, true),
                                            ::testing::Range(std::size_t{0}, impl_cases().size())),
                         [](const auto& tp) {
                           std::string n = test_name(impl_cases()[std::get<1>(tp.param)].name) + "_" +
                                           std::to_string(std::get<1>(tp.param)) +
                                           (std::get<0>(tp.param) ? "_noisy" : "_plain");
                           return n;
                         });

// ---- two microbatches in flight on every rank ------------------------------------------------
// forward 0, forward 1, backward_input 1, backward_input 0, backward_weight 1, backward_weight 0
// (the gate noise keyed by (layer, microbatch, step)): the outputs, input gradients and summed
// parameter gradients of the float64 reference over every rank's tokens of both microbatches,
// and every microbatch's memory returned once its Saved is gone.
class MicrobatchesInFlightMpi : public ::testing::TestWithParam<std::size_t> {};

std::int64_t mb_tokens(int rank, int mb) { return mb == 0 ? 23 + 11 * rank : 13 + 7 * rank; }
const WorkKey kMbKeys[2] = {{2, 0, 5}, {2, 1, 5}};

std::vector<double> keyed_noise(std::uint64_t seed, int r, int mb, const ModelConfig& cfg) {
  Rng nr(Rng::mix(Rng::mix(seed, 5), static_cast<std::uint64_t>(r), MoELayer::work_seed(kMbKeys[mb])));
  std::vector<double> eps(static_cast<std::size_t>(mb_tokens(r, mb) * cfg.num_experts));
  for (auto& e : eps) e = static_cast<float>(nr.normal());  // the layer draws fp32 noise
  return eps;
}
std::vector<float> mb_input(std::uint64_t seed, int r, int mb, std::int64_t M, int what) {
  return test::uniform(static_cast<std::size_t>(mb_tokens(r, mb) * M), Rng::mix(seed, 300 + 100 * what + 10 * r + mb));
}

TEST_P(MicrobatchesInFlightMpi, MatchFloat64ReferenceAndReturnTheirMemory) {
  const ImplCase& ic = impl_cases()[GetParam()];
  SCOPED_TRACE(ic.name + " " + ic.options.dump());
  const ModelConfig cfg = config(true);
  const int rank = world_rank(), size = world_size();
  const std::int64_t M = cfg.d_model;
  // Every rank derives, without communicating, the same first seed whose inputs have no near-tie.
  std::uint64_t seed = g_seed;
  ref::Params P;
  {
    auto b1 = make_backend("cpu");
    auto self = make_self_communicator(*b1);
    for (;; seed = Rng::mix(seed, 78)) {
      MoELayer single(*b1, *self, cfg);
      single.init_parameters(seed);
      P = test::reference_params(*b1, single);
      bool ok = true;
      for (int r = 0; r < size && ok; ++r)
        for (int m = 0; m < 2 && ok; ++m)
          ok = ref::forward_backward(cfg, P, test::to_double(mb_input(seed, r, m, M, 0)), keyed_noise(seed, r, m, cfg),
                                     nullptr, 0, nullptr)
                   .min_topk_gap > 1e-6;
      if (ok) break;
    }
  }
  auto b = make_backend("cpu");
  b->set_rank(rank);
  auto comm = make_world_communicator(*b);
  auto impl = make_impl(ic.name, *b, *comm, cfg, ic.options);
  impl->init_parameters(seed);
  impl->layer().set_noise_seed(Rng::mix(seed, 5));
  Stream& s = b->default_stream();
  const float ga = 0.25f;
  std::vector<float> y_h[2], dx_h[2];
  {
    Tensor x[2], dy[2], dx[2];
    Forwarded f[2];
    for (int m = 0; m < 2; ++m) {
      x[m] = b->empty({mb_tokens(rank, m), M}, cfg.dtype, MemCategory::activations, s);
      dy[m] = b->empty({mb_tokens(rank, m), M}, cfg.dtype, MemCategory::activations, s);
      b->upload(mb_input(seed, rank, m, M, 0), x[m]);
      b->upload(mb_input(seed, rank, m, M, 1), dy[m]);
    }
    f[0] = impl->forward(x[0], kMbKeys[0]);
    f[1] = impl->forward(x[1], kMbKeys[1]);
    dx[1] = impl->backward_input(*f[1].saved, dy[1], ga);
    dx[0] = impl->backward_input(*f[0].saved, dy[0], ga);
    impl->backward_weight(*f[1].saved);
    impl->backward_weight(*f[0].saved);
    b->synchronize();
    for (int m = 0; m < 2; ++m) {
      y_h[m] = b->download(f[m].y);
      dx_h[m] = b->download(dx[m]);
    }
  }
  b->synchronize();
  const auto in_use = b->memory().microbatch_in_use();
  for (int m = 0; m < 2; ++m) EXPECT_EQ(in_use.count(m) ? in_use.at(m) : 0, 0u) << "microbatch " << m;

  ref::Grads sum, mine;  // expert gradients over every rank's tokens; this rank's gate gradient
  sum.init(P, 0);
  mine.init(P, 0);
  for (int r = 0; r < size; ++r)
    for (int m = 0; m < 2; ++m) {
      ref::Grads G;
      G.init(P, mb_tokens(r, m));
      const auto dyd = test::to_double(mb_input(seed, r, m, M, 1));
      const auto R = ref::forward_backward(cfg, P, test::to_double(mb_input(seed, r, m, M, 0)),
                                           keyed_noise(seed, r, m, cfg), &dyd, ga, &G);
      for (std::size_t i = 0; i < sum.dw1.size(); ++i) sum.dw1[i] += G.dw1[i];
      for (std::size_t i = 0; i < sum.dw2.size(); ++i) sum.dw2[i] += G.dw2[i];
      if (r != rank) continue;
      for (std::size_t i = 0; i < mine.dwg.size(); ++i) mine.dwg[i] += G.dwg[i];
      const std::string mb = " of microbatch " + std::to_string(m);
      EXPECT_TRUE(test::all_close("y" + mb, y_h[m], R.y, 1e-4));
      EXPECT_TRUE(test::all_close("dx" + mb, dx_h[m], G.dx, 1e-4));
    }
  EXPECT_TRUE(test::all_close("dW_gate", b->download(impl->grads().w_gate), mine.dwg, 1e-4));
  const std::int64_t El = impl->layer().local_experts(), H = cfg.d_hidden;
  const auto off = static_cast<std::ptrdiff_t>(rank * El * M * H), len = static_cast<std::ptrdiff_t>(El * M * H);
  EXPECT_TRUE(test::all_close("dW1", b->download(impl->grads().w1), {sum.dw1.begin() + off, sum.dw1.begin() + off + len}, 1e-4));
  EXPECT_TRUE(test::all_close("dW2", b->download(impl->grads().w2), {sum.dw2.begin() + off, sum.dw2.begin() + off + len}, 1e-4));
}

INSTANTIATE_TEST_SUITE_P(Impls, MicrobatchesInFlightMpi, ::testing::Range(std::size_t{0}, impl_cases().size()),
                         [](const auto& tp) { return test_name(impl_cases()[tp.param].name) + "_" + std::to_string(tp.param); });

}  // namespace
}  // namespace moelab

int main(int argc, char** argv) {
  moelab::init_world(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  moelab::register_builtin_impls();
  // One seed for all ranks, fresh each run (rank 0 draws it).
  {
    auto b = moelab::make_backend("cpu");
    auto comm = moelab::make_world_communicator(*b);
    const double s = moelab::world_rank() == 0 ? static_cast<double>(moelab::test::fresh_seed() >> 12) : 0.0;
    moelab::g_seed = static_cast<std::uint64_t>(comm->all_reduce_sum(s));
    if (moelab::world_rank() == 0) std::printf("seed %llu on %d ranks\n", static_cast<unsigned long long>(moelab::g_seed), moelab::world_size());
  }
  // Only rank 0 prints the gtest report; every rank's result decides the exit code.
  if (moelab::world_rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int rc = RUN_ALL_TESTS();
  {
    auto b = moelab::make_backend("cpu");
    auto comm = moelab::make_world_communicator(*b);
    rc = static_cast<int>(comm->all_reduce_max(rc));
  }
  moelab::finalize_world();
  return rc;
}
