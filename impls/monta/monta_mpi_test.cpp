// impls/monta/monta_mpi_test.cpp — DeepSpeed's TP-aware layer (deepspeed-tp, deepspeed-drop)
// and MoNTA's chunked TP-deduplicated all-to-all on 1, 2 and 4 MPI ranks (cpu backend), with
// tensor parallelism TP = 2 (TP groups {0,1}, {2,3}; one rank alone: TP = 1): the outputs, the
// input and gate gradients of every rank equal the float64 reference on its TP group's tokens;
// the experts' gradients equal the reference's over the tokens that reach them, once per token
// with deduplication and once per TP rank without; the strategies agree with each other row for
// row; TP ranks draw the same gate noise; the bytes the communicators moved are the volume
// model's (impls/monta/strategy.hpp).
//   mpirun --oversubscribe -np 4 build/impls/monta_mpi_test
// Layouts on 4 ranks: expert parallelism over all 4 (each TP group inside the EP group) and
// over 2, EP groups being the TP groups.
#include <gtest/gtest.h>

#include <algorithm>

#include "baselines/deepspeed_tp_ep/deepspeed_tp_ep.hpp"
#include "harness/comm/world.hpp"
#include "harness/nn/moe_impl.hpp"
#include "harness/tests/moe_reference.hpp"
#include "harness/tests/test_util.hpp"
#include "impls/monta/strategy.hpp"

namespace moelab {
namespace {

std::uint64_t g_seed = 0;  // agreed across ranks in main()

ModelConfig config(bool noisy) {
  ModelConfig cfg;
  cfg.d_model = 12;
  cfg.d_hidden = 20;
  cfg.num_experts = 8;
  cfg.top_k = 2;
  cfg.capacity_factor = 1.0;  // some tokens overflow; C = ceil(2·T/8) is odd for some T
  cfg.activation = Activation::gelu;
  cfg.noisy_gate = noisy;
  return cfg;
}

int tp_size() { return std::min(2, world_size()); }
int group_of(int rank) { return rank / tp_size(); }                   // the TP group: its tokens
std::int64_t tokens_of(int group) { return 23 + 11 * group; }       // different and odd per group

struct Case {
  std::string impl;
  nlohmann::json options;
  bool dedup;
  int ep;  // 0: every rank; else EP groups of ep consecutive ranks
};
const std::vector<Case>& cases() {
  static const std::vector<Case> c = {
      {"deepspeed-tp", nlohmann::json::object(), false, 0},
      {"deepspeed-drop", nlohmann::json::object(), true, 0},
      {"monta", {{"chunks", 1}}, true, 0},
      {"monta", {{"chunks", 2}}, true, 0},
      {"monta", {{"chunks", 3}}, true, 0},
      {"deepspeed-tp", nlohmann::json::object(), false, 2},
      {"hierarchical", nlohmann::json::object(), false, 0},
      {"monta", {{"chunks", 2}}, true, 2},
  };
  return c;
}

std::vector<double> noise_of(std::uint64_t seed, int group, const ModelConfig& cfg) {
  std::vector<double> eps;
  if (!cfg.noisy_gate) return eps;
  // The layer keys its noise on its TP group's first world rank, and the one-in-flight API's
  // first forward on step 1.
  Rng nr(Rng::mix(Rng::mix(seed, 5), static_cast<std::uint64_t>(group * tp_size()), 1));
  eps.resize(static_cast<std::size_t>(tokens_of(group) * cfg.num_experts));
  for (auto& e : eps) e = static_cast<float>(nr.normal());  // the layer draws fp32 noise
  return eps;
}
std::vector<float> x_of(std::uint64_t seed, int group, std::int64_t M) {
  return test::uniform(static_cast<std::size_t>(tokens_of(group) * M), Rng::mix(seed, 100 + group));
}
std::vector<float> dy_of(std::uint64_t seed, int group, std::int64_t M) {
  return test::uniform(static_cast<std::size_t>(tokens_of(group) * M), Rng::mix(seed, 200 + group));
}

class TpDispatchMpi : public ::testing::TestWithParam<std::tuple<bool, std::size_t>> {};

TEST_P(TpDispatchMpi, MatchesTheFloat64ReferenceOnEachTpGroupsTokens) {
  const bool noisy = std::get<0>(GetParam());
  const Case& tc = cases()[std::get<1>(GetParam())];
  const ModelConfig cfg = config(noisy);
  const int rank = world_rank(), size = world_size(), t = tp_size(), groups = size / t;
  const int ep = tc.ep == 0 || tc.ep > size ? size : tc.ep;
  SCOPED_TRACE(tc.impl + " " + tc.options.dump() + " on " + std::to_string(size) + " ranks, TP " + std::to_string(t) +
               ", EP " + std::to_string(ep));
  const std::int64_t M = cfg.d_model, H = cfg.d_hidden;
  // A seed whose inputs have no near-tie of gate probabilities in any group (fp32 and float64
  // could route those differently): every rank finds the same one without communicating.
  std::uint64_t seed = g_seed;
  ref::Params P;
  {
    auto b1 = make_backend("cpu");
    auto self = make_self_communicator(*b1);
    for (;; seed = Rng::mix(seed, 77)) {
      MoELayer single(*b1, *self, cfg);
      single.init_parameters(seed);
      P = test::reference_params(*b1, single);
      bool ok = true;
      for (int g = 0; g < groups && ok; ++g)
        ok = ref::forward_backward(cfg, P, test::to_double(x_of(seed, g, M)), noise_of(seed, g, cfg), nullptr, 0, nullptr)
                 .min_topk_gap > 1e-6;
      if (ok) break;
    }
  }
  auto b = make_backend("cpu");
  b->set_rank(rank);
  auto world = make_world_communicator(*b);
  auto tp = world->split(group_of(rank), rank);
  auto ep_comm = world->split(rank / ep, rank);
  MoEChannels channels(*b, *ep_comm, tp.get());
  auto impl = make_impl(tc.impl, *b, *ep_comm, cfg, tc.options, &channels);
  EXPECT_EQ(impl->tp_deduplicated(), tc.dedup);
  impl->init_parameters(seed);
  impl->layer().set_noise_seed(Rng::mix(seed, 5));
  Stream& s = b->default_stream();
  const int g = group_of(rank);
  const std::int64_t T = tokens_of(g);
  Tensor x = b->empty({T, M}, cfg.dtype, MemCategory::activations, s);
  Tensor dy = b->empty({T, M}, cfg.dtype, MemCategory::activations, s);
  b->upload(x_of(seed, g, M), x);
  b->upload(dy_of(seed, g, M), dy);
  const float ga = 0.25f;
  b->synchronize();
  b->clear_timeline();
  Tensor y = impl->forward(x);
  const float aux = impl->aux_loss();
  Tensor dx = impl->backward(dy, ga);
  b->synchronize();
  // The bytes the communicators moved (the cpu backend records every collective's bytes to
  // other ranks) against the volume model: four all-to-alls (dispatch, combine and their
  // mirrors) and, deduplicated, two all-gathers over the TP group.
  double a2a_bytes = 0, gather_bytes = 0;
  for (const OpRecord& op : b->timeline()) {
    if (op.name == "all_to_all_v") a2a_bytes += op.cost.comm_bytes;
    if (op.name == "all_gather") gather_bytes += op.cost.comm_bytes;
  }
  if (noisy) {
    EXPECT_EQ(test::to_double(impl->layer().last_noise()), noise_of(seed, g, cfg));
  }

  // The reference: this group's tokens; the experts' gradients over the groups whose tokens
  // reach this rank's EP group (its TP groups), times t without deduplication.
  ref::Grads sum, mine;
  sum.init(P, 0);
  ref::Result R;
  const int first_group = (rank / ep) * ep / t, last_group = ((rank / ep) * ep + ep - 1) / t;
  for (int h = first_group; h <= last_group; ++h) {
    ref::Grads G;
    G.init(P, tokens_of(h));
    const auto dyd = test::to_double(dy_of(seed, h, M));
    const auto Rh = ref::forward_backward(cfg, P, test::to_double(x_of(seed, h, M)), noise_of(seed, h, cfg), &dyd, ga, &G);
    const double copies = tc.dedup ? 1.0 : static_cast<double>(t);
    for (std::size_t i = 0; i < sum.dw1.size(); ++i) sum.dw1[i] += copies * G.dw1[i];
    for (std::size_t i = 0; i < sum.dw2.size(); ++i) sum.dw2[i] += copies * G.dw2[i];
    if (h == g) {
      R = Rh;
      mine = G;
    }
  }
  ASSERT_FALSE(R.y.empty()) << "this rank's group is not in its EP group's range";
  EXPECT_NEAR(aux, R.aux, 1e-5 * std::abs(R.aux) + 1e-6);
  EXPECT_TRUE(test::all_close("y", b->download(y), R.y, 1e-4));
  EXPECT_TRUE(test::all_close("dx", b->download(dx), mine.dx, 1e-4));
  EXPECT_TRUE(test::all_close("dW_gate", b->download(impl->grads().w_gate), mine.dwg, 1e-4));
  const std::int64_t El = impl->layer().local_experts();
  const auto off = static_cast<std::ptrdiff_t>(ep_comm->rank() * El * M * H), len = static_cast<std::ptrdiff_t>(El * M * H);
  EXPECT_TRUE(test::all_close("dW1", b->download(impl->grads().w1), {sum.dw1.begin() + off, sum.dw1.begin() + off + len}, 1e-4));
  EXPECT_TRUE(test::all_close("dW2", b->download(impl->grads().w2), {sum.dw2.begin() + off, sum.dw2.begin() + off + len}, 1e-4));
  // The padded capacity: every chunk of every TP rank's slice is whole.
  const auto& geo = dynamic_cast<CapacityTpLayer&>(impl->layer()).geometry();
  std::int64_t largest = 0;  // the capacity every rank of the EP group pads to
  for (int h = first_group; h <= last_group; ++h) largest = std::max(largest, cfg.capacity(tokens_of(h)));
  EXPECT_EQ(geo.C, largest);
  EXPECT_EQ(geo.Cp % (static_cast<std::int64_t>(geo.t) * geo.n), 0);
  EXPECT_GE(geo.Cp, geo.C);
  EXPECT_LT(geo.Cp - geo.C, static_cast<std::int64_t>(geo.t) * geo.n);
  EXPECT_EQ(geo.t, tc.dedup ? t : 1);
  monta::Layer l;
  l.E = cfg.num_experts;
  l.C = largest;
  l.M = M;
  l.bytes = static_cast<int>(dtype_size(cfg.dtype));
  l.t = t;
  l.ep_ranks = ep_comm->world_ranks();
  l.rank = rank;
  monta::Links one_node;  // every rank on one host: all intra-node
  one_node.gpus_per_node = size;
  // One host: the two-level exchange is its node step alone, the flat bytes (its rail step
  // is each rank to itself).
  const monta::Strategy st = tc.dedup ? monta::Strategy::dedup : monta::Strategy::flat;
  const monta::Volume a = monta::all_to_all_volume(l, one_node, st, geo.n), gv = monta::all_gather_volume(l, one_node, st, geo.n);
  EXPECT_EQ(a.nic + gv.nic, 0.0);
  EXPECT_DOUBLE_EQ(a2a_bytes, 4 * a.intra);  // (two-level: the rail step on one host moves nothing)
  EXPECT_DOUBLE_EQ(gather_bytes, 2 * gv.intra);
}

INSTANTIATE_TEST_SUITE_P(Strategies, TpDispatchMpi,
                         ::testing::Combine(::testing::Values(false, true), ::testing::Range(std::size_t{0}, cases().size())),
                         [](const auto& p) {
                           const Case& c = cases()[std::get<1>(p.param)];
                           std::string n = c.impl + "_" + std::to_string(std::get<1>(p.param)) +
                                           (std::get<0>(p.param) ? "_noisy" : "_plain");
                           std::replace(n.begin(), n.end(), '-', '_');
                           return n;
                         });

// The row maps: every kept row of T_I is in exactly one TP rank's slice, and the gathered
// layout puts it back where the slices put it.
TEST(CapacityGeometry, SlicesPartitionTheRowsAndTheGatherUndoesThem) {
  for (auto [t, n, C] : {std::tuple{2, 1, 5}, {2, 3, 7}, {4, 2, 9}, {1, 4, 3}, {8, 4, 64}}) {
    const std::vector<std::int64_t> sent = {static_cast<std::int64_t>(C), 0, static_cast<std::int64_t>(C) / 2, 1};
    std::vector<int> owner(static_cast<std::size_t>(C + 0 + C / 2 + 1), -1);
    for (int r = 0; r < t; ++r) {
      const CapacityGeometry g = CapacityGeometry::make(4, C, t, r, n);
      const auto in = slice_rows_of(g, sent), out = gathered_rows_of(g, sent);
      ASSERT_EQ(in.size(), owner.size());
      for (std::size_t i = 0; i < in.size(); ++i) {
        if (in[i] < 0) continue;
        EXPECT_EQ(owner[i], -1) << "row " << i << " in two slices";
        owner[i] = r;
        EXPECT_LT(in[i], g.slice_rows());
        // The gather of the slices (per chunk, rank r's slice after ranks 0..r-1) holds the row
        // at out[i]: chunk c's block of rank r, at the same place as in the slice.
        const std::int64_t c = in[i] / (g.E * g.Cs), within = in[i] % (g.E * g.Cs);
        EXPECT_EQ(out[i], (c * t + r) * g.E * g.Cs + within) << "t " << t << " n " << n << " C " << C;
      }
    }
    for (std::size_t i = 0; i < owner.size(); ++i) EXPECT_GE(owner[i], 0) << "row " << i << " in no slice";
  }
}

}  // namespace
}  // namespace moelab

int main(int argc, char** argv) {
  moelab::init_world(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  moelab::register_builtin_impls();
  {  // one fresh seed for all ranks (rank 0 draws it)
    auto b = moelab::make_backend("cpu");
    auto comm = moelab::make_world_communicator(*b);
    const double s = moelab::world_rank() == 0 ? static_cast<double>(moelab::test::fresh_seed() >> 12) : 0.0;
    moelab::g_seed = static_cast<std::uint64_t>(comm->all_reduce_sum(s));
    if (moelab::world_rank() == 0)
      std::printf("seed %llu on %d ranks\n", static_cast<unsigned long long>(moelab::g_seed), moelab::world_size());
  }
  if (moelab::world_rank() != 0) {  // rank 0 prints the report; every rank's result decides the exit code
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int rc = RUN_ALL_TESTS();
  {
    auto b = moelab::make_backend("cpu");
    auto comm = moelab::make_world_communicator(*b);
    rc = comm->all_reduce_max(rc) > 0 ? 1 : 0;
  }
  moelab::finalize_world();
  return rc;
}
