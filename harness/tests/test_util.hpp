// harness/tests/test_util.hpp — shared helpers: the cpu backend with host-vector I/O, fresh
// seeds, closeness against a float64 reference, and the float64 reference's parameters read
// back from a layer.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "harness/comm/communicator.hpp"
#include "harness/nn/moe_layer.hpp"
#include "harness/runtime/backend.hpp"
#include "harness/runtime/random.hpp"
#include "harness/tests/moe_reference.hpp"

namespace moelab::test {

// The cpu backend with helpers to move host vectors in and out of tensors.
struct Cpu {
  std::unique_ptr<Backend> b = make_backend("cpu");
  Stream& s = b->default_stream();

  Tensor f32(std::vector<std::int64_t> shape, const std::vector<float>& v) {
    Tensor t = b->empty(std::move(shape), DType::f32, MemCategory::activations, s);
    b->upload(v, t);
    return t;
  }
  Tensor zeros(std::vector<std::int64_t> shape) {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    return f32(std::move(shape), std::vector<float>(static_cast<std::size_t>(n), 0.0f));
  }
  Tensor i32(const std::vector<std::int32_t>& v) {
    Tensor t = b->empty({static_cast<std::int64_t>(v.size())}, DType::i32, MemCategory::activations, s);
    b->upload_i32(v, t);
    return t;
  }
  std::vector<float> get(const Tensor& t) {
    b->synchronize();
    return b->download(t);
  }
};

// Fresh random inputs every run; MOELAB_TEST_SEED=<n> replays a failure.
inline std::uint64_t fresh_seed() {
  if (const char* s = std::getenv("MOELAB_TEST_SEED")) return std::strtoull(s, nullptr, 10);
  std::random_device rd;
  const std::uint64_t seed = (static_cast<std::uint64_t>(rd()) << 32) ^ rd();
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  std::printf("seed %llu (MOELAB_TEST_SEED=%llu replays it)\n", static_cast<unsigned long long>(seed),
              static_cast<unsigned long long>(seed));
  return seed;
}

inline std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

inline std::vector<float> uniform(std::size_t n, std::uint64_t seed, double lo = -1.0, double hi = 1.0) {
  Rng r(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = static_cast<float>(r.uniform(lo, hi));
  return v;
}

// Every element within atol + rtol*|ref|, with atol = rtol * max|ref| (so tiny entries of a
// large tensor are judged on the tensor's scale). Reports the worst element.
inline ::testing::AssertionResult all_close(const std::string& what, const std::vector<float>& got,
                                            const std::vector<double>& ref, double rtol) {
  if (got.size() != ref.size())
    return ::testing::AssertionFailure() << what << ": size " << got.size() << " vs reference " << ref.size();
  double scale = 0;
  for (double r : ref) scale = std::max(scale, std::abs(r));
  const double atol = rtol * scale + 1e-30;
  double worst = 0;
  std::size_t at = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i]))
      return ::testing::AssertionFailure() << what << "[" << i << "] is " << got[i];
    const double ratio = std::abs(got[i] - ref[i]) / (atol + rtol * std::abs(ref[i]));
    if (ratio > worst) {
      worst = ratio;
      at = i;
    }
  }
  if (worst <= 1.0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << "[" << at << "] = " << got[at] << ", reference " << ref[at]
                                       << " (rtol " << rtol << ", tensor scale " << scale << ")";
}

// The float64 reference's parameters, read back from a layer holding all experts (EP = 1).
inline ref::Params reference_params(Backend& b, MoELayer& layer) {
  const auto& c = layer.config();
  ref::Params p;
  p.M = c.d_model;
  p.H = c.d_hidden;
  p.E = c.num_experts;
  p.wg = to_double(b.download(layer.params().w_gate));
  if (c.noisy_gate) p.wn = to_double(b.download(layer.params().w_noise));
  p.w1 = to_double(b.download(layer.params().w1));
  p.w2 = to_double(b.download(layer.params().w2));
  return p;
}

}  // namespace moelab::test
