// harness/tests/sim_kernel_rates_test.cpp — the memory-bound kernels a GEMM calibration
// measured on its device (KernelRates: "dispatch" and "activations", written by
// scripts/fit_gemm_efficiency.py --profile), priced by the sim backend against closed forms
// (docs/PERFORMANCE.md, "Kernel rates in the sim"):
//   * an activation at max(its bytes at the memory rate, its elements at the measured rate),
//     per activation, direction and dtype; without a rate, its bytes alone, as before;
//   * the permutations at the permute's or the unpermute's measured rate;
//   * a one-rank all-to-all at the fitted exchange with itself, only where it was measured on
//     a world of one;
//   * a fill writes its bytes and reads none;
//   * the loaders check the new fields and name the offending one.
//
//   ctest --test-dir build -R sim_kernel_rates
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "harness/backends/sim/sim_backend.hpp"
#include "harness/runtime/error.hpp"
#include "harness/sim/cluster.hpp"
#include "harness/tests/sim_test_util.hpp"

namespace moelab {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

#define EXPECT_HAS(msg, part) EXPECT_NE((msg).find(part), std::string::npos) << "message: " << (msg) << "\nexpected: " << (part)

// The toy GPU (sim_test_util.hpp): HBM 2 TB/s; the default memory efficiency 0.8.
constexpr double kHbm = 2e12, kMem = 0.8 * kHbm;

sim::GemmCalibration toy_calibration() {
  sim::GemmCalibration cal;
  cal.name = "toy";
  cal.device = "toy-gpu";
  cal.launch_latency = 0;
  cal.mem_bw = kMem;
  sim::GemmCurve c;
  c.gemm_max = 0.9;
  c.gemm_half_dim = 100;
  c.source = "test";
  cal.bf16 = c;
  cal.fp32 = c;
  return cal;
}

sim::ClusterModel toy_model(const sim::KernelRates& k, bool calibrated = true) {
  sim::ClusterModel m = test::toy_cluster(1, 100e9, 0);
  if (calibrated) {
    m.efficiency.calibration = toy_calibration();
    m.efficiency.calibration->kernels = k;
  }
  return m;
}

// The GPU time of each op `body` issues, on one rank, in issue order.
std::vector<OpRecord> ops(const sim::ClusterModel& m, const std::function<void(Backend&, Communicator&, Stream&)>& body) {
  SimOptions o;
  o.cluster = m;
  SimCluster cluster(o);
  std::vector<OpRecord> out;
  cluster.run([&](Backend& b, Communicator& c) {
    Stream& s = b.default_stream();
    c.barrier();
    b.clear_timeline();
    body(b, c, s);
    b.synchronize();
    c.barrier();  // times become final at a barrier of every rank
    out = b.timeline();
  });
  return out;
}

double seconds(const OpRecord& r) { return r.end - r.start; }

sim::ActivationRate rate(Activation a, bool backward, DType t, double per_s) {
  sim::ActivationRate r;
  r.activation = a;
  r.backward = backward;
  r.dtype = t;
  r.elements_per_s = per_s;
  return r;
}

// n elements of GeLU: forward reads and writes n (f32: 8n bytes), backward reads two and
// writes one (12n). A slow measured rate binds; a fast one leaves the memory time; a dtype or
// an activation without a rate is priced by its bytes alone.
TEST(SimKernelRates, ActivationAtTheSlowerOfBytesAndMeasuredElements) {
  const std::int64_t n = 1 << 20;
  sim::KernelRates k;
  k.activations = {rate(Activation::gelu, false, DType::f32, 1e8),    // 10.5 ms, far above 8n / kMem
                   rate(Activation::gelu, true, DType::f32, 1e15),    // far faster than its bytes
                   rate(Activation::relu, false, DType::bf16, 2e8)};
  const auto run = [&](const sim::ClusterModel& m) {
    return ops(m, [&](Backend& b, Communicator&, Stream& s) {
      Tensor x = b.empty({n}, DType::f32, MemCategory::buffers, s), y = b.empty({n}, DType::f32, MemCategory::buffers, s);
      Tensor z = b.empty({n}, DType::f32, MemCategory::buffers, s);
      Tensor h = b.empty({n}, DType::bf16, MemCategory::buffers, s), g = b.empty({n}, DType::bf16, MemCategory::buffers, s);
      b.activation_forward(s, Activation::gelu, x, y);
      b.activation_backward(s, Activation::gelu, x, y, z);
      b.activation_forward(s, Activation::relu, x, y);  // no fp32 relu rate
      b.activation_forward(s, Activation::relu, h, g);  // bf16 relu at its rate
      b.activation_forward(s, Activation::gelu, h, g);  // no bf16 gelu rate
    });
  };
  const double N = static_cast<double>(n);
  const auto r = run(toy_model(k));
  ASSERT_EQ(r.size(), 5u);
  EXPECT_NEAR(seconds(r[0]), N / 1e8, 1e-12);
  EXPECT_HAS(r[0].detail, "measured elements/s");
  EXPECT_NEAR(seconds(r[1]), 12 * N / kMem, 1e-15);
  EXPECT_NEAR(seconds(r[2]), 8 * N / kMem, 1e-15);
  EXPECT_EQ(r[2].detail, "");
  EXPECT_NEAR(seconds(r[3]), N / 2e8, 1e-12);
  EXPECT_NEAR(seconds(r[4]), 4 * N / kMem, 1e-15);

  // Without a calibration, or with one that measured no activation: bytes alone, as before.
  for (const auto& m : {toy_model({}, false), toy_model({})}) {
    const auto d = run(m);
    ASSERT_EQ(d.size(), 5u);
    EXPECT_NEAR(seconds(d[0]), 8 * N / kMem, 1e-15);
    EXPECT_NEAR(seconds(d[3]), 4 * N / kMem, 1e-15);
  }
}

// The permutations of T tokens x M (bf16, top-1: T slots): each moves 2·T·M·2 bytes (unpermute
// backward reads dy and y_perm and writes d_y_perm: 3·T·M·2). permute and unpermute_bwd at the
// permute's measured rate, unpermute and permute_bwd at the unpermute's; without them, the
// memory rate.
TEST(SimKernelRates, PermutationsAtTheirMeasuredRates) {
  const std::int64_t T = 4096, M = 1024;
  sim::KernelRates k;
  k.permute_bw = 4e11;
  k.unpermute_bw = 2.5e11;
  const auto run = [&](const sim::ClusterModel& m) {
    return ops(m, [&](Backend& b, Communicator&, Stream& s) {
      Tensor x = b.empty({T, M}, DType::bf16, MemCategory::buffers, s), y = b.empty({T, M}, DType::bf16, MemCategory::buffers, s);
      Tensor d = b.empty({T, M}, DType::bf16, MemCategory::buffers, s);
      Tensor slot = b.empty({T, 1}, DType::i32, MemCategory::buffers, s);
      Tensor w = b.empty({T, 1}, DType::f32, MemCategory::buffers, s), dw = b.empty({T, 1}, DType::f32, MemCategory::buffers, s);
      b.permute(s, x, slot, y);
      b.unpermute(s, y, slot, w, x);
      b.permute_backward(s, y, slot, d);
      b.unpermute_backward(s, x, y, slot, w, d, dw);
    });
  };
  const double bytes = 2.0 * T * M * 2, bwd3 = 3.0 * T * M * 2;
  const auto r = run(toy_model(k));
  ASSERT_EQ(r.size(), 4u);
  EXPECT_NEAR(seconds(r[0]), bytes / 4e11, 1e-15);
  EXPECT_NEAR(seconds(r[1]), bytes / 2.5e11, 1e-15);
  EXPECT_NEAR(seconds(r[2]), bytes / 2.5e11, 1e-15);
  EXPECT_NEAR(seconds(r[3]), bwd3 / 4e11, 1e-15);
  const auto d = run(toy_model({}));
  ASSERT_EQ(d.size(), 4u);
  EXPECT_NEAR(seconds(d[0]), bytes / kMem, 1e-15);
  EXPECT_NEAR(seconds(d[3]), bwd3 / kMem, 1e-15);
}

// A one-rank all-to-all of S bytes: latency + S / bw of the fitted exchange where it was
// measured on a world of one; one measured on two ranks leaves the HBM copy (2·S at the
// datasheet rate, as before).
TEST(SimKernelRates, OneRankExchangeAtTheFittedRate) {
  const std::int64_t elems = 1 << 22;  // f32: 16 MiB
  const double S = 4.0 * elems;
  const auto run = [&](const sim::ClusterModel& m) {
    return ops(m, [&](Backend& b, Communicator& c, Stream& s) {
      Tensor a = b.empty({elems}, DType::f32, MemCategory::buffers, s), z = b.empty({elems}, DType::f32, MemCategory::buffers, s);
      const Segment seg{0, 0, elems};
      c.all_to_all_v(s, a, {&seg, 1}, z, {&seg, 1});
    });
  };
  sim::KernelRates k;
  k.exchange = sim::ExchangeFit{1e11, 20e-6, {1}};
  const auto r = run(toy_model(k));
  ASSERT_EQ(r.size(), 1u);
  EXPECT_NEAR(seconds(r[0]), 20e-6 + S / 1e11, 1e-12);
  k.exchange->ranks = {2};
  const auto other = run(toy_model(k));
  ASSERT_EQ(other.size(), 1u);
  EXPECT_NEAR(seconds(other[0]), 2 * S / kHbm, 1e-12);
}

// Rates measured on another part of the calibration's architecture: the kernels are
// memory-bound, so a cluster GPU with twice the calibration device's datasheet HBM rate
// (GemmCalibration::hbm_bw; an H200 priced by an H100's calibration) runs the permutations,
// a measured activation and the one-rank exchange at twice their measured rates, as the GEMM
// roofline's mem_bw is scaled (Topology::calibration_hbm_scale).
TEST(SimKernelRates, MeasuredRatesScaleWithTheClusterGpusHbm) {
  const std::int64_t T = 4096, M = 1024, n = 1 << 20;
  sim::KernelRates k;
  k.permute_bw = 4e11;
  k.unpermute_bw = 2.5e11;
  k.activations = {rate(Activation::gelu, false, DType::f32, 1e8)};
  k.exchange = sim::ExchangeFit{1e11, 20e-6, {1}};
  const auto run = [&](const sim::ClusterModel& m) {
    return ops(m, [&](Backend& b, Communicator& c, Stream& s) {
      Tensor x = b.empty({T, M}, DType::bf16, MemCategory::buffers, s), y = b.empty({T, M}, DType::bf16, MemCategory::buffers, s);
      Tensor slot = b.empty({T, 1}, DType::i32, MemCategory::buffers, s);
      Tensor w = b.empty({T, 1}, DType::f32, MemCategory::buffers, s);
      b.permute(s, x, slot, y);
      b.unpermute(s, y, slot, w, x);
      Tensor u = b.empty({n}, DType::f32, MemCategory::buffers, s), v = b.empty({n}, DType::f32, MemCategory::buffers, s);
      b.activation_forward(s, Activation::gelu, u, v);
      const Segment seg{0, 0, n};
      c.all_to_all_v(s, u, {&seg, 1}, v, {&seg, 1});
    });
  };
  const double bytes = 2.0 * T * M * 2, N = static_cast<double>(n);
  for (const double scale : {1.0, 2.0}) {
    SCOPED_TRACE(scale);
    sim::ClusterModel m = toy_model(k);
    m.efficiency.calibration->hbm_bw = kHbm / scale;  // the device the rates were measured on
    const auto r = run(m);
    ASSERT_EQ(r.size(), 4u);
    EXPECT_NEAR(seconds(r[0]), bytes / (4e11 * scale), 1e-15);
    EXPECT_NEAR(seconds(r[1]), bytes / (2.5e11 * scale), 1e-15);
    EXPECT_NEAR(seconds(r[2]), N / (1e8 * scale), 1e-12);
    EXPECT_NEAR(seconds(r[3]), 20e-6 + 4 * N / (1e11 * scale), 1e-12);
  }
}

// A fill writes its bytes and reads none: n bytes at the memory rate.
TEST(SimKernelRates, FillWritesOnly) {
  const std::int64_t elems = 1 << 24;
  const auto r = ops(toy_model({}, false), [&](Backend& b, Communicator&, Stream& s) {
    Tensor a = b.empty({elems}, DType::f32, MemCategory::buffers, s);
    b.fill_zero(s, a);
  });
  ASSERT_EQ(r.size(), 1u);
  EXPECT_NEAR(seconds(r[0]), 4.0 * elems / kMem, 1e-15);
}

// ---- the loaders -----------------------------------------------------------------------------

struct TempDir {
  fs::path dir = fs::temp_directory_path() / ("moelab-kernel-rates-" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(dir); }
  ~TempDir() { fs::remove_all(dir); }
  std::string write(const std::string& name, const json& j) const {
    const fs::path p = dir / name;
    std::ofstream(p) << j.dump(2);
    return p.string();
  }
};

json calibration_json() {
  return {{"schema", "moelab.gemm_calibration/1"},
          {"name", "t"},
          {"device", "toy"},
          {"launch_latency", 1e-6},
          {"mem_bw", 1e12},
          {"curves", {{"fp32", {{"gemm_max", 0.8}, {"gemm_half_dim", 64}, {"source", "test"}}}}},
          {"dispatch",
           {{"permute_bw", 3e11},
            {"permute_mem_efficiency", 1.4},
            {"unpermute_bw", 2e11},
            {"exchange", {{"bw", 1e11}, {"latency", 1e-5}, {"ranks", {1}}}},
            {"source", "test"},
            {"fit", json::object()}}},
          {"activations",
           {{"source", "test"},
            {"rates",
             {{{"activation", "gelu"}, {"direction", "forward"}, {"dtype", "fp32"}, {"elements_per_s", 1.4e8}},
              {{"activation", "gelu"}, {"direction", "backward"}, {"dtype", "fp32"}, {"elements_per_s", 9e7}}}}}},
          {"source", "test"}};
}

TEST(SimKernelRates, CalibrationLoadsTheRates) {
  TempDir t;
  const sim::GemmCalibration c = sim::load_gemm_calibration(t.write("c.json", calibration_json()));
  ASSERT_TRUE(c.kernels.permute_bw && c.kernels.unpermute_bw && c.kernels.exchange);
  EXPECT_EQ(*c.kernels.permute_bw, 3e11);
  EXPECT_EQ(*c.kernels.unpermute_bw, 2e11);
  EXPECT_EQ(c.kernels.exchange->bw, 1e11);
  EXPECT_EQ(c.kernels.exchange->latency, 1e-5);
  EXPECT_EQ(c.kernels.exchange->ranks, std::vector<int>{1});
  ASSERT_EQ(c.kernels.activations.size(), 2u);
  const sim::ActivationRate* b = c.kernels.activation(Activation::gelu, true, DType::f32);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->elements_per_s, 9e7);
  EXPECT_EQ(c.kernels.activation(Activation::gelu, true, DType::bf16), nullptr);
  EXPECT_EQ(c.kernels.activation(Activation::relu, false, DType::f32), nullptr);
}

TEST(SimKernelRates, BadRatesNameTheField) {
  TempDir t;
  const auto fails = [&](const std::function<void(json&)>& edit, const std::string& expect) {
    json j = calibration_json();
    edit(j);
    try {
      (void)sim::load_gemm_calibration(t.write("bad.json", j));
      ADD_FAILURE() << "accepted; expected an error with " << expect;
    } catch (const ConfigError& e) {
      EXPECT_HAS(std::string(e.what()), expect);
      EXPECT_HAS(std::string(e.what()), "bad.json");
    }
  };
  fails([](json& j) { j["activations"]["rates"][0]["elements_per_s"] = -1; }, "activations.rates[0].elements_per_s");
  fails([](json& j) { j["activations"]["rates"][1]["direction"] = "sideways"; }, "activations.rates[1].direction");
  fails([](json& j) { j["activations"]["rates"][1]["direction"] = "forward"; }, "a second rate for gelu forward fp32");
  fails([](json& j) { j["activations"]["rates"][0]["flops"] = 1; }, "activations.rates[0].flops");
  fails([](json& j) { j["activations"]["rates"][0]["latency"] = 0; }, "activations.rates[0].latency");
  fails([](json& j) { j["activations"].erase("rates"); }, "activations.rates");
  fails([](json& j) { j["activations"].erase("source"); }, "activations.source");
  fails([](json& j) { j["dispatch"]["permute_bw"] = 0; }, "dispatch.permute_bw");
  fails([](json& j) { j["dispatch"]["exchange"]["ranks"] = json::array(); }, "dispatch.exchange.ranks");
  fails([](json& j) { j["dispatch"]["exchange"]["ranks"] = {0}; }, "dispatch.exchange.ranks");
  fails([](json& j) { j["dispatch"]["exchange"].erase("bw"); }, "dispatch.exchange.bw");
  fails([](json& j) { j["dispatch"]["permute_speed"] = 1; }, "dispatch.permute_speed");
  fails([](json& j) { j["dispatch"] = 5; }, "dispatch");
}

// A profile's activation samples: read, written back, checked.
TEST(SimKernelRates, ProfileActivationSamples) {
  TempDir t;
  json p = {{"schema", "moelab.profile/1"},
            {"device", "toy"},
            {"activations",
             {{{"activation", "relu"}, {"direction", "backward"}, {"dtype", "bf16"}, {"elements", 1048576}, {"seconds", 1e-4}}}}};
  const sim::Profile got = sim::load_profile(t.write("p.json", p));
  ASSERT_EQ(got.activations.size(), 1u);
  EXPECT_EQ(got.activations[0].activation, "relu");
  EXPECT_EQ(got.activations[0].direction, "backward");
  EXPECT_EQ(got.activations[0].elements, 1048576);
  EXPECT_EQ(sim::to_json(got)["activations"], p["activations"]);
  p["activations"][0]["dtype"] = "fp8";
  try {
    (void)sim::load_profile(t.write("bad.json", p));
    ADD_FAILURE() << "accepted dtype fp8";
  } catch (const ConfigError& e) {
    EXPECT_HAS(std::string(e.what()), "activations[0].dtype");
  }
}

// A profile's fused-epilogue samples (moelab calibrate, "epilogues"): read, written back, and
// each field checked by name.
TEST(SimKernelRates, ProfileEpilogueSamples) {
  TempDir t;
  const json sample = {{"op", "dgrad"},  {"activation", "gelu_tanh"}, {"dtype", "bf16"},
                       {"rows", 8192},   {"d_model", 2048},           {"d_hidden", 8192},
                       {"gemm_s", 3e-4}, {"unfused_s", 4e-4},         {"fused_s", 3.1e-4}};
  json p = {{"schema", "moelab.profile/1"}, {"device", "toy"}, {"epilogues", json::array({sample})}};
  const sim::Profile got = sim::load_profile(t.write("p.json", p));
  ASSERT_EQ(got.epilogues.size(), 1u);
  EXPECT_EQ(got.epilogues[0].op, "dgrad");
  EXPECT_EQ(got.epilogues[0].activation, "gelu_tanh");
  EXPECT_EQ(got.epilogues[0].rows, 8192);
  EXPECT_DOUBLE_EQ(got.epilogues[0].unfused_s, 4e-4);
  EXPECT_EQ(sim::to_json(got)["epilogues"], p["epilogues"]);
  EXPECT_FALSE(sim::to_json(sim::load_profile(t.write("none.json", {{"schema", "moelab.profile/1"}, {"device", "toy"}})))
                   .contains("epilogues"));
  const auto fails = [&](const std::function<void(json&)>& edit, const std::string& part) {
    json bad = p;
    edit(bad["epilogues"][0]);
    try {
      (void)sim::load_profile(t.write("bad.json", bad));
      ADD_FAILURE() << "accepted; expected a message naming " << part;
    } catch (const ConfigError& e) {
      EXPECT_HAS(std::string(e.what()), part);
    }
  };
  fails([](json& e) { e["op"] = "wgrad"; }, "epilogues[0].op");
  fails([](json& e) { e["activation"] = "swish"; }, "epilogues[0].activation");
  fails([](json& e) { e["fused_s"] = 0; }, "epilogues[0].fused_s");
  fails([](json& e) { e.erase("gemm_s"); }, "epilogues[0].gemm_s");
  fails([](json& e) { e["rows"] = -1; }, "epilogues[0].rows");
  fails([](json& e) { e["speedup"] = 1.2; }, "epilogues[0].speedup");
}

}  // namespace
}  // namespace moelab
