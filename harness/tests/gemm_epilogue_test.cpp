// harness/tests/gemm_epilogue_test.cpp — the GEMM with its activation in the epilogue
// (Backend::grouped_gemm_epilogue, GemmEpilogue), against float64 on fresh random inputs:
//   * act_aux: aux = A·B and C = act(A·B); dact: C = (A·B) · act'(aux), for the experts' FC1
//     (A·W1) and FC2 dgrad (dY·W2ᵀ) shapes, with an expert without rows among them;
//   * on cpu and, where a device is present, cuda (fp32 and bf16): cuda runs the tanh GeLU on
//     cuBLASLt's GELU_AUX / DGELU epilogues and the other activations as separate ops;
//   * the Backend's default (unfused) implementation, for every activation;
//   * the cost: the GEMMs' plus the epilogue's aux matrix and flops;
//   * the MoE layer issues no activation op of its own where the backend fuses (cpu, sim),
//     and the unfused pair elsewhere;
//   * bad calls (beta ≠ 0, A transposed, an aux of the wrong shape) are refused by name.
//
//   ctest --test-dir build -R gemm_epilogue
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "harness/backends/sim/sim_backend.hpp"
#include "harness/comm/communicator.hpp"
#include "harness/nn/moe_layer.hpp"
#include "harness/runtime/error.hpp"
#include "harness/tests/moe_reference.hpp"
#include "harness/tests/sim_test_util.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab {
namespace {

struct Target {
  std::string backend;
  DType dtype;
  double rtol;
};

std::string target_name(const Target& t) { return t.backend + "_" + dtype_name(t.dtype); }
void PrintTo(const Target& t, std::ostream* os) { *os << target_name(t); }

// Per expert: rows[e] tokens, [rows,k] x op(B) -> [rows,n]; B is [k,n] (FC1: X·W1) or, with
// trans_b, [n,k] (FC2 dgrad: dY·W2ᵀ).
struct Problems {
  std::vector<std::int64_t> rows{13, 0, 29};
  std::int64_t n = 32, k = 24;
  bool trans_b = false;
  std::vector<std::vector<double>> a, b, aux_in;  // float64 copies of what was uploaded
  std::vector<Tensor> ta, tb, tc, taux;
};

Problems make(Backend& be, Stream& s, DType t, bool trans_b, std::int64_t n, std::uint64_t seed) {
  Problems P;
  P.trans_b = trans_b;
  P.n = n;
  for (std::size_t e = 0; e < P.rows.size(); ++e) {
    const std::int64_t r = P.rows[e];
    const auto fill = [&](std::vector<std::int64_t> shape, std::uint64_t salt, std::vector<double>& keep) {
      Tensor x = be.empty(shape, t, MemCategory::buffers, s);
      std::int64_t numel = 1;
      for (auto d : shape) numel *= d;
      auto v = test::uniform(static_cast<std::size_t>(numel), Rng::mix(seed, salt + 10 * e), -2.0, 2.0);
      be.upload(v, x);
      // what the device holds (bf16 rounds): read it back as the reference's input
      keep = test::to_double(be.download(x));
      return x;
    };
    P.a.emplace_back();
    P.b.emplace_back();
    P.aux_in.emplace_back();
    P.ta.push_back(fill({r, P.k}, 1, P.a.back()));
    P.tb.push_back(trans_b ? fill({P.n, P.k}, 2, P.b.back()) : fill({P.k, P.n}, 2, P.b.back()));
    P.taux.push_back(fill({r, P.n}, 3, P.aux_in.back()));  // read by dact, overwritten by act_aux
    P.tc.push_back(be.empty({r, P.n}, t, MemCategory::buffers, s));
    std::vector<float> nan(static_cast<std::size_t>(r * P.n), std::nanf(""));
    be.upload(nan, P.tc.back());  // C is written, never read (beta 0)
  }
  return P;
}

std::vector<GemmProblem> problems_of(Problems& P) {
  std::vector<GemmProblem> ps;
  for (std::size_t e = 0; e < P.rows.size(); ++e) {
    GemmProblem p{false, P.trans_b, P.rows[e], P.n, P.k, P.ta[e], P.tb[e], P.tc[e], 1, 0};
    p.aux = P.taux[e];
    ps.push_back(p);
  }
  return ps;
}

// The float64 product of expert e, [rows,n].
std::vector<double> product(const Problems& P, std::size_t e) {
  const std::int64_t r = P.rows[e], n = P.n, k = P.k;
  std::vector<double> out(static_cast<std::size_t>(r * n), 0.0);
  for (std::int64_t i = 0; i < r; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double acc = 0;
      for (std::int64_t q = 0; q < k; ++q)
        acc += P.a[e][static_cast<std::size_t>(i * k + q)] *
               (P.trans_b ? P.b[e][static_cast<std::size_t>(j * k + q)] : P.b[e][static_cast<std::size_t>(q * n + j)]);
      out[static_cast<std::size_t>(i * n + j)] = acc;
    }
  return out;
}

// Runs the call (fused = the backend's own grouped_gemm_epilogue; otherwise the Backend's
// default, unfused) and checks every output against float64.
void check(Backend& be, const Target& tgt, GemmEpilogue ep, Activation act, bool backend_own, bool trans_b,
           std::int64_t n) {
  const std::uint64_t seed = test::fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed) + ", " + gemm_epilogue_name(ep) + ", " + activation_name(act) +
               (backend_own ? ", the backend's own" : ", the default") + ", n " + std::to_string(n));
  Stream& s = be.default_stream();
  Problems P = make(be, s, tgt.dtype, trans_b, n, seed);
  std::vector<GemmProblem> ps = problems_of(P);
  if (backend_own)
    be.grouped_gemm_epilogue(s, ps, ep, act, "fc");
  else
    be.Backend::grouped_gemm_epilogue(s, ps, ep, act, "fc");
  be.synchronize();
  for (std::size_t e = 0; e < P.rows.size(); ++e) {
    const std::vector<double> prod = product(P, e);
    std::vector<double> want_c(prod.size()), want_aux = P.aux_in[e];
    for (std::size_t i = 0; i < prod.size(); ++i) {
      if (ep == GemmEpilogue::act_aux) {
        want_aux[i] = prod[i];
        want_c[i] = ref::act(act, prod[i]);
      } else {
        want_c[i] = prod[i] * ref::act_grad(act, P.aux_in[e][i]);
      }
    }
    if (prod.empty()) continue;
    EXPECT_TRUE(test::all_close("C of expert " + std::to_string(e), be.download(P.tc[e]), want_c, tgt.rtol));
    EXPECT_TRUE(test::all_close("aux of expert " + std::to_string(e), be.download(P.taux[e]), want_aux, tgt.rtol));
  }
}

class GemmEpilogueVsFloat64 : public ::testing::TestWithParam<Target> {};

TEST_P(GemmEpilogueVsFloat64, EveryActivationBothEpiloguesBothShapes) {
  const Target& tgt = GetParam();
  if (tgt.backend == "cuda" && !cuda_available()) GTEST_SKIP() << "no CUDA device";
  auto be = make_backend(tgt.backend);
  EXPECT_TRUE(be->fuses_gemm_epilogue(Activation::gelu_tanh, tgt.dtype));
  EXPECT_FALSE(be->fuses_gemm_epilogue(Activation::gelu, tgt.dtype));
  EXPECT_FALSE(be->fuses_gemm_epilogue(Activation::relu, tgt.dtype));
  for (Activation act : {Activation::gelu_tanh, Activation::gelu, Activation::relu})
    for (GemmEpilogue ep : {GemmEpilogue::act_aux, GemmEpilogue::dact})
      for (bool trans_b : {false, true})
        for (bool own : {true, false}) {
          // n = 32 takes cuBLASLt's epilogue on cuda; n = 20 (not a multiple of 8) its fallback
          check(*be, tgt, ep, act, own, trans_b, 32);
          if (own && act == Activation::gelu_tanh) check(*be, tgt, ep, act, own, trans_b, 20);
        }
}

INSTANTIATE_TEST_SUITE_P(Backends, GemmEpilogueVsFloat64,
                         ::testing::Values(Target{"cpu", DType::f32, 1e-5}, Target{"cuda", DType::f32, 1e-4},
                                           Target{"cuda", DType::bf16, 3e-2}),
                         [](const auto& tp) { return target_name(tp.param); });

// One op: the GEMMs' cost plus the aux matrix (written by act_aux, read by dact) and the
// activation's flops per output element.
TEST(GemmEpilogue, CostIsTheGemmsPlusTheEpilogue) {
  auto be = make_backend("cpu");
  Stream& s = be->default_stream();
  Problems P = make(*be, s, DType::f32, false, 32, 7);
  const std::vector<GemmProblem> ps = problems_of(P);
  const OpCost g = cost_grouped_gemm(ps);
  double mn = 0;
  for (auto r : P.rows) mn += static_cast<double>(r * P.n);
  const OpCost f = cost_grouped_gemm_epilogue(ps, GemmEpilogue::act_aux, Activation::gelu_tanh);
  EXPECT_DOUBLE_EQ(f.bytes_written, g.bytes_written + 4 * mn);
  EXPECT_DOUBLE_EQ(f.bytes_read, g.bytes_read);
  EXPECT_DOUBLE_EQ(f.flops, g.flops + 8 * mn);
  const OpCost d = cost_grouped_gemm_epilogue(ps, GemmEpilogue::dact, Activation::gelu_tanh);
  EXPECT_DOUBLE_EQ(d.bytes_read, g.bytes_read + 4 * mn);
  EXPECT_DOUBLE_EQ(d.bytes_written, g.bytes_written);
  EXPECT_DOUBLE_EQ(d.flops, g.flops + 12 * mn);
  EXPECT_EQ(f.launches, g.launches);

  // the cpu backend runs it as one op of that cost
  be->clear_timeline();
  be->grouped_gemm_epilogue(s, ps, GemmEpilogue::act_aux, Activation::gelu_tanh, "fc1");
  be->synchronize();
  const auto tl = be->timeline();
  ASSERT_EQ(tl.size(), 1u);
  EXPECT_EQ(tl[0].name, "fc1");
  EXPECT_DOUBLE_EQ(tl[0].cost.bytes_written, f.bytes_written);
}

TEST(GemmEpilogue, BadCallsAreRefusedByName) {
  auto be = make_backend("cpu");
  Stream& s = be->default_stream();
  Problems P = make(*be, s, DType::f32, false, 32, 11);
  const auto refused = [&](std::vector<GemmProblem> ps, GemmEpilogue ep, const std::string& part) {
    try {
      be->grouped_gemm_epilogue(s, ps, ep, Activation::gelu_tanh, "fc1");
      ADD_FAILURE() << "accepted; expected a refusal naming " << part;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  auto ps = problems_of(P);
  ps[0].beta = 1;
  refused(ps, GemmEpilogue::act_aux, "beta 0");
  ps = problems_of(P);
  ps[2].aux = P.taux[0];  // 13 rows where 29 are needed
  refused(ps, GemmEpilogue::dact, "aux");
  ps = problems_of(P);
  ps[0].aux = Tensor();
  refused(ps, GemmEpilogue::act_aux, "aux");
  ps = problems_of(P);
  ps[0].trans_a = true;
  refused(ps, GemmEpilogue::act_aux, "A transposed");
  refused(problems_of(P), GemmEpilogue::none, "no epilogue");
}

// The layer's ops: where the backend fuses (the tanh GeLU), FC1's op writes T_M and A, FC2's
// dgrad writes dT_M, and the only activation op left is the backward's recomputation of A;
// the erf GeLU keeps the separate forward, recompute and backward ops.
std::vector<std::string> layer_op_names(Backend& b, Communicator& comm, Activation act) {
  ModelConfig cfg;
  cfg.d_model = 16;
  cfg.d_hidden = 32;
  cfg.num_experts = 4;
  cfg.top_k = 2;
  cfg.capacity_factor = 0;
  cfg.activation = act;
  MoELayer layer(b, comm, cfg);
  layer.init_parameters(3);
  Stream& s = layer.compute_stream();
  Tensor x = b.empty({24, 16}, cfg.dtype, MemCategory::activations, s);
  Tensor dy = b.empty({24, 16}, cfg.dtype, MemCategory::activations, s);
  b.upload(test::uniform(24 * 16, 1), x);
  b.upload(test::uniform(24 * 16, 2), dy);
  b.synchronize();
  b.clear_timeline();
  Tensor y = layer.forward(x);
  Tensor dx = layer.backward(dy, 0.1f);
  b.synchronize();
  comm.barrier();  // the sim's times become final at a barrier
  std::vector<std::string> names;
  for (const auto& r : b.timeline())
    if (r.phase == "experts") names.push_back(r.name);
  return names;
}

std::int64_t count(const std::vector<std::string>& v, const std::string& s) {
  return std::count(v.begin(), v.end(), s);
}

TEST(GemmEpilogue, TheLayerIssuesNoActivationOpWhereTheBackendFuses) {
  const auto check_backend = [](Backend& b, Communicator& comm) {
    SCOPED_TRACE(b.name());
    const auto fused = layer_op_names(b, comm, Activation::gelu_tanh);
    EXPECT_EQ(count(fused, "gelu_tanh"), 1);  // the backward's recomputation of A
    EXPECT_EQ(count(fused, "gelu_tanh_bwd"), 0);
    EXPECT_EQ(count(fused, "fc1"), 1);
    EXPECT_EQ(count(fused, "fc2_dgrad"), 1);
    const auto plain = layer_op_names(b, comm, Activation::gelu);
    EXPECT_EQ(count(plain, "gelu"), 2);
    EXPECT_EQ(count(plain, "gelu_bwd"), 1);
    EXPECT_EQ(plain.size(), fused.size() + 2);
  };
  auto cpu = make_backend("cpu");
  auto self = make_self_communicator(*cpu);
  check_backend(*cpu, *self);
  SimOptions o;
  o.cluster = test::toy_cluster(1, 100e9, 0);
  SimCluster cluster(o);
  cluster.run([&](Backend& b, Communicator& c) { check_backend(b, c); });
}

}  // namespace
}  // namespace moelab
