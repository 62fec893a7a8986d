// impls/scmoe/scmoe_mpi_test.cpp — ScMoE's block pair on N MPI ranks (expert parallelism EP = N
// for its routed MoE, cpu backend, Open MPI) against the float64 reference of the pair
// (pair_reference.hpp): outputs, input gradients, the rank's own gradients of the replicated
// parameters and its slice of the experts' gradients summed over every rank's tokens, for each
// position and combine gate, chunked all-to-alls and FasterMoE's stepped exchange.
//   mpirun --oversubscribe -np 4 build/impls/scmoe_mpi_test
// Every rank holds different tokens (a different number of whole sequences). Inputs and
// parameters are functions of the seed, so each rank rebuilds every rank's tokens and computes
// in-process what its outputs and its experts' gradients must be.
#include <gtest/gtest.h>

#include "harness/comm/world.hpp"
#include "harness/nn/moe_impl.hpp"
#include "harness/tests/test_util.hpp"
#include "impls/scmoe/pair_reference.hpp"
#include "impls/scmoe/scmoe.hpp"
#include "impls/scmoe/scmoe_test_util.hpp"

namespace moelab {
namespace {

using nlohmann::json;
using pair_ref::Named;
using pair_ref::Vec;
using namespace scmoe_test;

std::uint64_t g_seed = 0;  // agreed across ranks in main()

std::int64_t tokens_of(const TransformerConfig& c, int rank) { return c.seq_len * (2 + rank); }

std::vector<Variant> variants() {
  std::vector<Variant> v(5);
  v[0].label = "pos2_cg1_fastmoe";
  v[1].position = ShortcutPosition::pos3;
  v[1].combine = ShortcutCombine::cg2;
  v[1].chunks = 2;
  v[1].label = "pos3_cg2_two_chunks";
  v[2].position = ShortcutPosition::pos1;
  v[2].combine = ShortcutCombine::add;
  v[2].llama = true;
  v[2].label = "pos1_add_llama";
  v[3].impl = "fastermoe";
  v[3].options = {{"group_size", 2}};
  v[3].label = "pos2_cg1_fastermoe";
  v[4].expert_slot = 0;
  v[4].capacity = 0;
  v[4].label = "pos2_slot0_no_dropping";
  return v;
}

// A pair whose replicated parameters are drawn from the seed (the same on every rank) and whose
// experts are the layer's own initialisation (a function of the seed and the global expert id).
std::unique_ptr<LayerGroup> build(Backend& b, Communicator& c, const TransformerConfig& cfg, const Variant& v,
                                  std::uint64_t seed) {
  auto pair = make_scmoe_pair({b, b.default_stream(), cfg, first_layer(cfg),
                               make_impl(v.impl, b, c, cfg.moe, v.options, nullptr), 1.0f});
  pair->init_parameters(seed);
  pair->moe()->layer().set_noise_seed(Rng::mix(seed, 5));
  std::vector<Param*> ps;
  pair->collect(ps);
  for (Param* p : ps) {
    if (!p->replicated) continue;  // the experts
    std::vector<float> vals;
    for (double x : draw_param(p->name, p->value.shape(), seed)) vals.push_back(static_cast<float>(x));
    b.upload(vals, p->value);
  }
  return pair;
}

class PairMpi : public ::testing::TestWithParam<Variant> {};

TEST_P(PairMpi, MatchesFloat64ReferenceOverEveryRanksTokens) {
  const Variant& v = GetParam();
  const TransformerConfig cfg = pair_config(v);
  const int rank = world_rank(), size = world_size();
  const WorkKey key{first_layer(cfg), 0, 4}, moe_key{moe_layer(cfg), 0, 4};
  const std::int64_t M = cfg.d_model, E = cfg.moe.num_experts;
  const auto x_of = [&](std::uint64_t s, int r) {
    return test::uniform(static_cast<std::size_t>(tokens_of(cfg, r) * M), Rng::mix(s, 100 + r));
  };
  const auto dy_of = [&](std::uint64_t s, int r) {
    return test::uniform(static_cast<std::size_t>(tokens_of(cfg, r) * M), Rng::mix(s, 200 + r));
  };
  const auto eps_of = [&](std::uint64_t s, int r) {
    return cfg.moe.noisy_gate ? keyed_noise(s, moe_key, tokens_of(cfg, r), E, r) : Vec{};
  };

  // The reference's parameters (every expert) from a single-process pair; the first seed after
  // g_seed whose routing has no near-tie on any rank, found alike by every rank.
  auto b1 = make_backend("cpu");
  auto self = make_self_communicator(*b1);
  std::uint64_t seed = g_seed;
  Named P;
  for (;; seed = Rng::mix(seed, 77)) {
    auto ref_pair = build(*b1, *self, cfg, v, seed);
    std::vector<Param*> ps;
    ref_pair->collect(ps);
    P.clear();
    for (Param* p : ps) P[p->name] = test::to_double(b1->download(p->value));
    bool ok = true;
    for (int r = 0; r < size && ok; ++r)
      ok = pair_ref::pair(cfg, first_layer(cfg), P, test::to_double(x_of(seed, r)), eps_of(seed, r), nullptr, 0)
               .moe.min_topk_gap > 1e-5;
    if (ok) break;
  }

  auto b = make_backend("cpu");
  b->set_rank(rank);
  auto comm = make_world_communicator(*b);
  auto pair = build(*b, *comm, cfg, v, seed);
  const float ga = 0.25f;
  pair->set_aux_grad_scale(ga);
  Stream& s = b->default_stream();
  const std::int64_t T = tokens_of(cfg, rank);
  Tensor x = b->empty({T, M}, cfg.dtype, MemCategory::activations, s);
  Tensor dy = b->empty({T, M}, cfg.dtype, MemCategory::activations, s);
  b->upload(x_of(seed, rank), x);
  b->upload(dy_of(seed, rank), dy);
  Forwarded f = pair->forward(x, key);
  Tensor dx = pair->backward_input(*f.saved, dy);
  pair->backward_weight(*f.saved);
  b->synchronize();
  const auto y_h = b->download(f.y), dx_h = b->download(dx);
  if (cfg.moe.noisy_gate) {
    EXPECT_EQ(test::to_double(pair->moe()->layer().last_noise()), eps_of(seed, rank));
  }

  // Expert gradients over every rank's tokens; the rest from this rank's own.
  Named expert_sum;
  pair_ref::Result mine;
  for (int r = 0; r < size; ++r) {
    const Vec dyd = test::to_double(dy_of(seed, r));
    auto R = pair_ref::pair(cfg, first_layer(cfg), P, test::to_double(x_of(seed, r)), eps_of(seed, r), &dyd, ga);
    for (const char* w : {"moe.w1", "moe.w2"}) {
      const std::string n = "layer" + std::to_string(moe_layer(cfg)) + "." + w;
      Vec& acc = expert_sum[n];
      if (acc.empty()) acc.assign(R.grads[n].size(), 0.0);
      pair_ref::add_to(acc, R.grads[n]);
    }
    if (r == rank) mine = std::move(R);
  }
  EXPECT_TRUE(test::all_close("y", y_h, mine.y, 1e-4));
  EXPECT_TRUE(test::all_close("dx", dx_h, mine.dx, 1e-4));
  std::vector<Param*> ps;
  pair->collect(ps);
  const std::int64_t El = pair->moe()->layer().local_experts();
  for (Param* p : ps) {
    const auto got = b->download(p->grad);
    if (p->replicated) {
      EXPECT_TRUE(test::all_close(p->name, got, mine.grads.at(p->name), 1e-4)) << "seed " << seed;
    } else {  // this rank's experts: a slice of the global tensor
      const Vec& all = expert_sum.at(p->name);
      const auto len = static_cast<std::ptrdiff_t>(all.size() / static_cast<std::size_t>(E) * static_cast<std::size_t>(El));
      EXPECT_TRUE(test::all_close(p->name, got, {all.begin() + rank * len, all.begin() + (rank + 1) * len}, 1e-4))
          << "seed " << seed;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, PairMpi, ::testing::ValuesIn(variants()), [](const auto& p) { return p.param.label; });

}  // namespace
}  // namespace moelab

int main(int argc, char** argv) {
  moelab::init_world(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  moelab::register_builtin_impls();
  {  // one seed for all ranks, fresh each run (rank 0 draws it)
    auto b = moelab::make_backend("cpu");
    auto comm = moelab::make_world_communicator(*b);
    const double s = moelab::world_rank() == 0 ? static_cast<double>(moelab::test::fresh_seed() >> 12) : 0.0;
    moelab::g_seed = static_cast<std::uint64_t>(comm->all_reduce_sum(s));
    if (moelab::world_rank() == 0)
      std::printf("seed %llu on %d ranks\n", static_cast<unsigned long long>(moelab::g_seed), moelab::world_size());
  }
  if (moelab::world_rank() != 0) {  // only rank 0 prints the report; every rank's result decides the exit code
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
