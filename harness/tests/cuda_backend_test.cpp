// harness/tests/cuda_backend_test.cpp — the cuda backend's ops against float64 host
// references, in fp32 and bf16, on awkward shapes (one token, 37 tokens, one expert, seven
// experts, width 33, an expert nobody picks, capacity overflow); the gate's routing
// decisions against an exact host reference; streams, events, copies, the memory tracker,
// the timeline, and the NCCL communicator in a world of one rank.
//
// Every test skips cleanly on a machine without a CUDA device.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <numbers>
#include <numeric>
#include <optional>
#include <ostream>
#include <string>
#include <thread>
#include <tuple>

#include "harness/backends/cuda/cuda_backend.hpp"
#include "harness/backends/cuda/nccl_comm.hpp"
#include "harness/comm/groups.hpp"
#include "harness/runtime/error.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab {
namespace {

using test::all_close;
using test::fresh_seed;
using test::uniform;

// Relative tolerance per dtype: fp32 results are fp32 arithmetic on exact inputs; bf16
// results are rounded to 8 mantissa bits once more at the end.
double tol(DType t) { return t == DType::bf16 ? 2e-2 : 1e-5; }

// What a value becomes once stored in `t` (the inputs of every reference are these).
std::vector<float> stored(std::vector<float> v, DType t) {
  if (t == DType::bf16)
    for (auto& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}

std::vector<double> dbl(const std::vector<float>& v) { return {v.begin(), v.end()}; }

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!moelab::cuda_device_present()) GTEST_SKIP() << "no CUDA device";
    b = make_cuda_backend(0);
    s = &b->default_stream();
  }
  Tensor make(std::vector<std::int64_t> shape, DType dt, const std::vector<float>& values,
              MemCategory c = MemCategory::activations) {
    Tensor t = b->empty(std::move(shape), dt, c, *s);
    b->upload(values, t);
    return t;
  }
  Tensor make_i32(std::vector<std::int64_t> shape, const std::vector<std::int32_t>& values) {
    Tensor t = b->empty(std::move(shape), DType::i32, MemCategory::buffers, *s);
    b->upload_i32(values, t);
    return t;
  }
  Tensor zeros(std::vector<std::int64_t> shape, DType dt) {
    Tensor t = b->empty(std::move(shape), dt, MemCategory::activations, *s);
    b->fill_zero(*s, t);
    return t;
  }
  std::unique_ptr<Backend> b;
  Stream* s = nullptr;
};

// Runs everywhere: without a device the backend refuses with Unsupported, never crashes.
TEST(CudaPresence, NoDeviceMeansUnsupported) {
  if (moelab::cuda_device_present()) {
    EXPECT_NO_THROW(make_cuda_backend(0));
    EXPECT_THROW(make_cuda_backend(1 << 20), Unsupported);
  } else {
    EXPECT_THROW(make_cuda_backend(0), Unsupported);
  }
}

// The device of each process of a node (no device needed): the launcher's node-local rank
// modulo the devices; the first launcher's variable that is set wins; a bad value is named.
TEST(CudaLocalDevice, TheLaunchersLocalRankModuloTheDevices) {
  static std::map<std::string, std::string> env;
  const auto lookup = [](const char* name) -> const char* {
    const auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  env = {};
  EXPECT_EQ(local_device(8, lookup), 0);  // no launcher
  env = {{"OMPI_COMM_WORLD_LOCAL_RANK", "5"}};
  EXPECT_EQ(local_device(8, lookup), 5);
  EXPECT_EQ(local_device(4, lookup), 1);  // more processes than devices: shared round robin
  EXPECT_EQ(local_device(1, lookup), 0);  // one visible device each (CUDA_VISIBLE_DEVICES)
  EXPECT_EQ(local_device(0, lookup), 0);
  env = {{"SLURM_LOCALID", "3"}, {"LOCAL_RANK", "6"}};
  EXPECT_EQ(local_device(8, lookup), 3);  // Slurm's before torchrun's
  env = {{"MPI_LOCALRANKID", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "7"}};
  EXPECT_EQ(local_device(8, lookup), 7);  // Open MPI's first
  env = {{"LOCAL_RANK", "two"}};
  try {
    local_device(8, lookup);
    ADD_FAILURE() << "a bad local rank was taken";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("LOCAL_RANK=\"two\""), std::string::npos) << e.what();
  }
}

TEST_F(CudaTest, DescribesItself) {
  EXPECT_EQ(b->name(), "cuda");
  EXPECT_NE(b->device_name().find("GiB"), std::string::npos) << b->device_name();
  EXPECT_TRUE(b->supports(DType::f32));
  EXPECT_TRUE(b->supports(DType::bf16));
  EXPECT_TRUE(b->supports(DType::i32));
  EXPECT_FALSE(b->supports(DType::f64));
  EXPECT_THROW(b->empty({4}, DType::f64, MemCategory::buffers, *s), Unsupported);
  EXPECT_TRUE(is_cuda_backend(*b));
  EXPECT_NE(cuda_native_stream(*s), nullptr);
}

// ---- copies, memory --------------------------------------------------------------------

class CudaCopyTest : public CudaTest, public ::testing::WithParamInterface<DType> {};

TEST_P(CudaCopyTest, HostDeviceRoundTrip) {
  const DType dt = GetParam();
  const auto v = stored(uniform(37 * 33, fresh_seed()), dt);
  Tensor host = b->empty({37, 33}, dt, MemCategory::buffers, *s, MemSpace::host_pinned);
  b->upload(v, host);
  Tensor dev = b->empty({37, 33}, dt, MemCategory::activations, *s);
  Tensor dev2 = b->empty({37, 33}, dt, MemCategory::activations, *s);
  Tensor back = b->empty({37, 33}, dt, MemCategory::buffers, *s, MemSpace::host_pinned);
  b->copy(*s, host, dev);   // h2d
  b->copy(*s, dev, dev2);   // d2d
  b->copy(*s, dev2, back);  // d2h
  b->synchronize();
  EXPECT_EQ(b->download(dev2), v);
  EXPECT_EQ(b->download(back), v);
  // A view: rows 5..9 of dev into a fresh tensor.
  Tensor part = b->empty({4, 33}, dt, MemCategory::activations, *s);
  b->copy(*s, dev.rows(5, 4), part);
  EXPECT_EQ(b->download(part), std::vector<float>(v.begin() + 5 * 33, v.begin() + 9 * 33));
  b->fill_zero(*s, dev2);
  EXPECT_EQ(b->download(dev2), std::vector<float>(v.size(), 0.0f));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaCopyTest, ::testing::Values(DType::f32, DType::bf16),
                         [](const auto& tpi) { return std::string(dtype_name(tpi.param)); });

TEST_F(CudaTest, IntegerTransfers) {
  std::vector<std::int32_t> v(101);
  std::iota(v.begin(), v.end(), -50);
  Tensor t = make_i32({101}, v);
  EXPECT_EQ(b->download_i32(t), v);
  Tensor empty = b->empty({0, 5}, DType::i32, MemCategory::buffers, *s);
  EXPECT_TRUE(b->download_i32(empty).empty());
}

// PipeOffload's offload and reload on the device: to pinned host memory on one copy stream,
// back on another, bit for bit (cudaMemcpyAsync moves bytes), the tracker following.
TEST_F(CudaTest, RelocateOffloadsAndReloadsBitForBit) {
  Stream& d2h = b->create_stream(StreamRole::d2h, "d2h");
  Stream& h2d = b->create_stream(StreamRole::h2d, "h2d");
  std::vector<std::int32_t> v(100003);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<std::int32_t>(i * 2654435761u);
  Tensor t = b->empty({static_cast<std::int64_t>(v.size())}, DType::i32, MemCategory::activations, *s);
  b->upload_i32(v, t);
  const std::size_t dev = b->memory().device_in_use();
  auto wrote = b->create_event();
  b->record(*wrote, *s);
  b->wait(d2h, *wrote);
  b->relocate(t.storage(), MemSpace::host_pinned, MemCategory::host_pinned, d2h, d2h);
  EXPECT_EQ(b->memory().device_in_use(), dev - t.nbytes());
  auto off = b->create_event();
  b->record(*off, d2h);
  b->wait(h2d, *off);
  b->relocate(t.storage(), MemSpace::device, MemCategory::activations, h2d, h2d);
  EXPECT_EQ(b->memory().device_in_use(), dev);
  b->synchronize();
  EXPECT_EQ(b->download_i32(t), v);
}

TEST_F(CudaTest, MemoryTrackerCountsAllocations) {
  const std::size_t base = b->memory().device_in_use();
  auto idx = [](MemCategory c) { return static_cast<std::size_t>(c); };
  Tensor w = b->empty({1000}, DType::f32, MemCategory::weights, *s);              // 4000 B
  Tensor pinned = b->empty({256}, DType::f32, MemCategory::buffers, *s, MemSpace::host_pinned);
  {
    Tensor a = b->empty({37, 33}, DType::bf16, MemCategory::activations, *s);     // 2442 B
    EXPECT_EQ(b->memory().device_in_use(), base + 4000 + 2442);
    EXPECT_EQ(b->memory().in_use(MemCategory::activations), 2442u);
    Tensor view = a.rows(3, 7);  // views allocate nothing
    EXPECT_EQ(b->memory().device_in_use(), base + 4000 + 2442);
  }
  EXPECT_EQ(b->memory().device_in_use(), base + 4000);
  EXPECT_EQ(b->memory().in_use(MemCategory::host_pinned), 1024u);
  EXPECT_EQ(b->memory().peak_device(), base + 4000 + 2442);
  EXPECT_EQ(b->memory().at_peak()[idx(MemCategory::weights)], 4000u);
  // The memory is real: write and read it back.
  const auto v = uniform(1000, fresh_seed());
  b->upload(v, w);
  EXPECT_EQ(b->download(w), v);
}

// The pool's own high-water mark sees an allocation that has since been freed, and only
// allocations made after the reset.
TEST_F(CudaTest, DevicePoolPeakFollowsAllocations) {
  b->synchronize();
  b->reset_device_pool_peak();
  const auto before = b->device_pool_peak();
  ASSERT_TRUE(before.has_value());
  constexpr std::size_t kBytes = 64u << 20;  // 64 MiB, well above the pool's granularity
  {
    Tensor big = b->empty({static_cast<std::int64_t>(kBytes / 4)}, DType::f32, MemCategory::activations, *s);
    b->fill_zero(*s, big);
    b->synchronize();
  }
  b->synchronize();
  const auto after = b->device_pool_peak();
  ASSERT_TRUE(after.has_value());
  EXPECT_GE(after->used_high, before->used_high + kBytes);
  EXPECT_GE(after->reserved_high, after->used_high);
  b->reset_device_pool_peak();
  EXPECT_LT(b->device_pool_peak()->used_high, after->used_high);
}
// Events order two streams: a consumer on another stream sees the producer's result.
TEST_F(CudaTest, EventsOrderStreams) {
  Stream& other = b->create_stream(StreamRole::dispatch, "dispatch");
  const std::int64_t n = 1 << 22;  // big enough that an unordered read would likely see zeros
  const auto v = stored(uniform(static_cast<std::size_t>(n), fresh_seed(), 0.5, 1.0), DType::f32);
  Tensor src = make({n}, DType::f32, v);
  Tensor mid = b->empty({n}, DType::f32, MemCategory::activations, *s);
  Tensor out = b->empty({n}, DType::f32, MemCategory::activations, other);
  auto ev = b->create_event();
  b->activation_forward(*s, Activation::relu, src, mid);
  b->record(*ev, *s);
  b->wait(other, *ev);
  b->copy(other, mid, out);
  b->synchronize(other);
  EXPECT_EQ(b->download(out), v);  // relu of positive values is the identity
  b->synchronize();
}

// ---- GEMM ------------------------------------------------------------------------------

// The calls the backend recorded for `op` on `path`: the path that really ran (an op's detail
// names every path the chooser weighed, so it cannot tell a silent fallback to the loop).
std::int64_t calls_on(const Backend& b, const std::string& op, GemmPath path) {
  for (const auto& u : cuda_gemm_path_uses(b))
    if (u.op == op && u.path == path) return u.calls;
  return 0;
}

struct GemmCase {
  DType ab, c;
  bool ta, tb;
};

void PrintTo(const GemmCase& g, std::ostream* os) {
  *os << dtype_name(g.ab) << " A/B, " << dtype_name(g.c) << " C, trans_a=" << g.ta << " trans_b=" << g.tb;
}

class CudaGemmTest : public CudaTest, public ::testing::WithParamInterface<GemmCase> {
 protected:
  struct Host {
    std::int64_t m, n, k;
    float alpha, beta;
    std::vector<float> a, b, c0;  // as stored
  };
  // C = alpha op(A) op(B) + beta C0 in float64; beta == 0 ignores C0 (it may be NaN).
  static std::vector<double> reference(const Host& h, bool ta, bool tb) {
    std::vector<double> c(static_cast<std::size_t>(h.m * h.n));
    for (std::int64_t i = 0; i < h.m; ++i)
      for (std::int64_t j = 0; j < h.n; ++j) {
        double acc = 0;
        for (std::int64_t p = 0; p < h.k; ++p) {
          const double av = ta ? h.a[static_cast<std::size_t>(p * h.m + i)] : h.a[static_cast<std::size_t>(i * h.k + p)];
          const double bv = tb ? h.b[static_cast<std::size_t>(j * h.k + p)] : h.b[static_cast<std::size_t>(p * h.n + j)];
          acc += av * bv;
        }
        const auto at = static_cast<std::size_t>(i * h.n + j);
        c[at] = h.alpha * acc + (h.beta == 0.0f ? 0.0 : h.beta * static_cast<double>(h.c0[at]));
      }
    return c;
  }
  // Tolerance scale: sum_p |a||b| is the size of the rounding a dot product can collect.
  static double magnitude(const Host& h) {
    double mx = 0;
    for (float x : h.a) mx = std::max(mx, std::abs(static_cast<double>(x)));
    double my = 0;
    for (float x : h.b) my = std::max(my, std::abs(static_cast<double>(x)));
    return std::max(1.0, mx * my * static_cast<double>(h.k));
  }

  // The problems' host values as stored, for problem i of a call seeded by `seed`.
  Host host_values(std::int64_t m, std::int64_t n, std::int64_t k, float alpha, float beta, bool nan_c,
                   std::uint64_t seed, std::uint64_t i) const {
    const GemmCase gc = GetParam();
    Host h{m, n, k, alpha, beta, {}, {}, {}};
    h.a = stored(uniform(static_cast<std::size_t>(m * k), Rng::mix(seed, i, 1)), gc.ab);
    h.b = stored(uniform(static_cast<std::size_t>(k * n), Rng::mix(seed, i, 2)), gc.ab);
    h.c0 = nan_c ? std::vector<float>(static_cast<std::size_t>(m * n), std::numeric_limits<float>::quiet_NaN())
                 : stored(uniform(static_cast<std::size_t>(m * n), Rng::mix(seed, i, 3)), gc.c);
    return h;
  }

  // Runs the problems as one grouped call (on `path` where it can run) and checks every C.
  // must_run: the forced path must have run (a library refusal falls back to the loop with the
  // right numbers, so only the recorded path shows it).
  void run_and_check(std::vector<GemmProblem>& problems, const std::vector<Host>& hosts,
                     std::optional<GemmPath> path, bool must_run = false, const std::string& op = "gemm_test") {
    const GemmCase gc = GetParam();
    const std::int64_t before = path ? calls_on(*b, op, *path) : 0;
    cuda_force_gemm_path(*b, path);
    b->grouped_gemm(*s, problems, op.c_str());
    b->synchronize();
    cuda_force_gemm_path(*b, std::nullopt);
    if (must_run && path) {
      EXPECT_EQ(calls_on(*b, op, *path), before + 1) << "forced " << gemm_path_name(*path) << " did not run";
    }
    for (std::size_t q = 0; q < problems.size(); ++q) {
      const auto got = b->download(problems[q].c);
      const auto ref = reference(hosts[q], gc.ta, gc.tb);
      const double scale = magnitude(hosts[q]);
      // TF32 rounds fp32 operands to a 10-bit mantissa (unit roundoff 2^-11) and accumulates in fp32.
      const double rt = gc.c == DType::bf16 ? tol(DType::bf16)
                        : gc.ab == DType::bf16 ? 1e-5
                        : tf32_ ? 2e-3 : tol(DType::f32);
      for (std::size_t e = 0; e < got.size(); ++e) {
        const double err = std::abs(static_cast<double>(got[e]) - ref[e]);
        ASSERT_LE(err, rt * (scale + std::abs(ref[e])))
            << "problem " << q << " (m=" << hosts[q].m << " n=" << hosts[q].n << " k=" << hosts[q].k
            << ") element " << e << ": " << got[e] << " vs " << ref[e]
            << (path ? std::string(" on path ") + gemm_path_name(*path) : std::string());
      }
    }
  }

  // Problems in tensors of their own.
  void run(const std::vector<std::tuple<std::int64_t, std::int64_t, std::int64_t, float, float, bool>>& shapes,
           std::optional<GemmPath> path = std::nullopt, bool must_run = false) {
    const GemmCase gc = GetParam();
    const std::uint64_t seed = fresh_seed();
    std::vector<Host> hosts;
    std::vector<GemmProblem> problems;
    std::uint64_t i = 0;
    for (const auto& [m, n, k, alpha, beta, nan_c] : shapes) {
      Host h = host_values(m, n, k, alpha, beta, nan_c, seed, i++);
      GemmProblem p;
      p.trans_a = gc.ta;
      p.trans_b = gc.tb;
      p.m = m;
      p.n = n;
      p.k = k;
      p.alpha = alpha;
      p.beta = beta;
      p.a = make(gc.ta ? std::vector<std::int64_t>{k, m} : std::vector<std::int64_t>{m, k}, gc.ab, h.a);
      p.b = make(gc.tb ? std::vector<std::int64_t>{n, k} : std::vector<std::int64_t>{k, n}, gc.ab, h.b);
      p.c = make({m, n}, gc.c, h.c0);
      problems.push_back(p);
      hosts.push_back(std::move(h));
    }
    run_and_check(problems, hosts, path, must_run);
  }

  // E equal problems laid out as the MoE layer lays out equal experts: each operand the
  // E blocks of one tensor (A [E*m,k], B [E*k,n], C [E*m,n]; transposed blocks when asked),
  // so that one strided batch covers them.
  void run_equally_strided(int E, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, float beta,
                           std::optional<GemmPath> path) {
    const GemmCase gc = GetParam();
    const std::uint64_t seed = fresh_seed();
    std::vector<Host> hosts;
    std::vector<float> a, bv, c;
    for (int e = 0; e < E; ++e) {
      hosts.push_back(host_values(m, n, k, alpha, beta, false, seed, static_cast<std::uint64_t>(e)));
      a.insert(a.end(), hosts.back().a.begin(), hosts.back().a.end());
      bv.insert(bv.end(), hosts.back().b.begin(), hosts.back().b.end());
      c.insert(c.end(), hosts.back().c0.begin(), hosts.back().c0.end());
    }
    const std::int64_t ar = gc.ta ? k : m, ac = gc.ta ? m : k, br = gc.tb ? n : k, bc = gc.tb ? k : n;
    Tensor A = make({E * ar, ac}, gc.ab, a), B = make({E * br, bc}, gc.ab, bv), C = make({E * m, n}, gc.c, c);
    std::vector<GemmProblem> problems;
    for (int e = 0; e < E; ++e)
      problems.push_back({gc.ta, gc.tb, m, n, k, A.rows(e * ar, ar), B.rows(e * br, br), C.rows(e * m, m), alpha, beta});
    run_and_check(problems, hosts, path);
  }
  bool tf32_ = false;  // fp32 GEMMs with TF32 allowed (Backend::set_allow_tf32)
};

TEST_P(CudaGemmTest, Single) { run({{37, 33, 19, 1.0f, 0.0f, false}}); }

TEST_P(CudaGemmTest, SingleAccumulates) { run({{37, 33, 19, 0.5f, 1.0f, false}}); }

// TF32, as the tf32 workloads run (CUBLAS_COMPUTE_32F_FAST_TF32): fp32 operands, the product
// within TF32's rounding of the float64 one, on every path.
TEST_P(CudaGemmTest, Tf32OnEveryPath) {
  const GemmCase gc = GetParam();
  if (gc.ab != DType::f32 || gc.c != DType::f32) GTEST_SKIP() << "TF32 applies to fp32 operands";
  b->set_allow_tf32(true);
  tf32_ = true;
  for (GemmPath p : {GemmPath::loop, GemmPath::strided_batched, GemmPath::grouped}) run_equally_strided(4, 96, 80, 72, 1.0f, 0.0f, p);
  tf32_ = false;
  b->set_allow_tf32(false);
}

// Two problems accumulating into one C (beta = 1, as weight gradients do): one grouped call
// gives its problems no order, so the backend runs them as the loop, in order, and C is
// c0 + A0·B0 + A1·B1.
TEST_P(CudaGemmTest, ProblemsSharingAnOutputRunInOrder) {
  const GemmCase gc = GetParam();
  const std::uint64_t seed = fresh_seed();
  const std::int64_t m = 40, n = 24, k = 32;
  Host h0 = host_values(m, n, k, 1.0f, 1.0f, false, seed, 0), h1 = host_values(m, n, k, 1.0f, 1.0f, false, seed, 1);
  Tensor c = make({m, n}, gc.c, h0.c0);
  std::vector<GemmProblem> problems;
  for (const Host* h : {&h0, &h1})
    problems.push_back({gc.ta, gc.tb, m, n, k, make(gc.ta ? std::vector<std::int64_t>{k, m} : std::vector<std::int64_t>{m, k}, gc.ab, h->a),
                        make(gc.tb ? std::vector<std::int64_t>{n, k} : std::vector<std::int64_t>{k, n}, gc.ab, h->b), c, 1.0f, 1.0f});
  const std::int64_t loops = calls_on(*b, "shared_c", GemmPath::loop), grouped = calls_on(*b, "shared_c", GemmPath::grouped);
  cuda_force_gemm_path(*b, GemmPath::grouped);
  b->grouped_gemm(*s, problems, "shared_c");
  b->synchronize();
  cuda_force_gemm_path(*b, std::nullopt);
  EXPECT_EQ(calls_on(*b, "shared_c", GemmPath::grouped), grouped);
  EXPECT_EQ(calls_on(*b, "shared_c", GemmPath::loop), loops + 1);
  // The reference in order: C0 + A0·B0 (in float64, kept as float), then that plus A1·B1.
  const std::vector<double> first = reference(h0, gc.ta, gc.tb);
  Host h1_after = h1;
  h1_after.c0.assign(first.begin(), first.end());
  const std::vector<double> want = reference(h1_after, gc.ta, gc.tb);
  const auto got = b->download(c);
  const double scale = magnitude(h0) + magnitude(h1);
  const double rt = gc.c == DType::bf16 ? tol(DType::bf16) : (gc.ab == DType::bf16 ? 1e-5 : tol(DType::f32));
  for (std::size_t e = 0; e < got.size(); ++e)
    ASSERT_LE(std::abs(static_cast<double>(got[e]) - want[e]), rt * (scale + std::abs(want[e]))) << "element " << e;
}

// One problem is one cublasGemmEx whatever path is forced; its reason says so, in the path
// record and the op's trace detail, in the words of the sim's chooser (force_gemm_path).
TEST_P(CudaGemmTest, OneProblemUnderAForcedPathIsTheLoopAndSaysSo) {
  const std::string one = "one problem: one cublasGemmEx";
  for (std::optional<GemmPath> path : {std::optional<GemmPath>{}, std::optional<GemmPath>{GemmPath::loop},
                                       std::optional<GemmPath>{GemmPath::strided_batched},
                                       std::optional<GemmPath>{GemmPath::grouped}}) {
    b->clear_timeline();
    run({{37, 33, 19, 1.0f, 0.0f, false}}, path);
    const std::string want = !path                       ? one
                             : *path == GemmPath::loop ? "loop (forced; also the table's choice): " + one
                                                       : std::string(gemm_path_name(*path)) +
                                                             " forced but cannot run this call (one problem): " + one;
    std::string why;
    for (const auto& u : cuda_gemm_path_uses(*b)) {
      if (u.op != "gemm_test") continue;
      EXPECT_EQ(u.path, GemmPath::loop);
      why = u.last_why;
    }
    EXPECT_EQ(why, want);
    std::string detail = "(no gemm_test op)";
    for (const OpRecord& r : b->timeline())
      if (r.name == "gemm_test") detail = r.detail;
    EXPECT_EQ(detail, want);
  }
}

// Several experts: equal shapes (one cuBLAS group), a zero-row expert, different shapes,
// beta = 1 accumulation, k = 0 (C scaled by beta) and beta = 0 over a C full of NaN.
TEST_P(CudaGemmTest, Grouped) {
  run({{37, 33, 19, 1.0f, 0.0f, false},
       {0, 33, 19, 1.0f, 0.0f, false},
       {37, 33, 19, 1.0f, 0.0f, false},
       {5, 33, 19, 1.0f, 1.0f, false},
       {1, 7, 64, 2.0f, 0.0f, true},
       {8, 33, 0, 1.0f, 0.5f, false},
       {8, 33, 0, 1.0f, 0.0f, true},
       {37, 33, 19, 1.0f, 1.0f, false}});
}

// The same awkward call on every path: forced where the path can run, the choice elsewhere.
// Each problem in tensors of its own (aligned allocations): the grouped call has kernels for
// A, B and C of one type (bf16 or fp32), so there it must really run.
TEST_P(CudaGemmTest, GroupedOnEveryPath) {
  const GemmCase gc = GetParam();
  for (GemmPath path : {GemmPath::loop, GemmPath::strided_batched, GemmPath::grouped})
    run({{37, 33, 19, 1.0f, 0.0f, false},
         {0, 33, 19, 1.0f, 0.0f, false},
         {37, 33, 19, 1.0f, 1.0f, false},
         {5, 33, 19, 0.5f, 1.0f, false},
         {8, 33, 0, 1.0f, 0.5f, false}},
        path, path != GemmPath::strided_batched && gc.ab == gc.c);
}

// Row views that do not start on 16 bytes (rows of 18 elements at row offsets 9 and 17, as the
// MoE layer's buffers have for a narrow width): the grouped call reads its pointers from device
// memory and cuBLAS requires them aligned, so a forced grouped path does not run there; the
// call takes another path and its numbers hold.
TEST_P(CudaGemmTest, GroupedRefusesMisalignedRowViews) {
  const GemmCase gc = GetParam();
  const std::int64_t m = 8, n = 18, k = 8;
  const std::vector<std::int64_t> offsets = {0, 9, 17};
  const std::uint64_t seed = fresh_seed();
  std::vector<Host> hosts;
  std::vector<float> c(static_cast<std::size_t>(26 * n), 0.0f);
  for (std::size_t e = 0; e < offsets.size(); ++e) {
    hosts.push_back(host_values(m, n, k, 1.0f, 1.0f, false, seed, e));
    std::copy(hosts.back().c0.begin(), hosts.back().c0.end(), c.begin() + offsets[e] * n);
  }
  Tensor C = make({26, n}, gc.c, c);
  std::vector<GemmProblem> problems;
  for (std::size_t e = 0; e < offsets.size(); ++e) {
    const Host& h = hosts[e];
    Tensor A = make(gc.ta ? std::vector<std::int64_t>{k, m} : std::vector<std::int64_t>{m, k}, gc.ab, h.a);
    Tensor B = make(gc.tb ? std::vector<std::int64_t>{n, k} : std::vector<std::int64_t>{k, n}, gc.ab, h.b);
    problems.push_back({gc.ta, gc.tb, m, n, k, A, B, C.rows(offsets[e], m), 1.0f, 1.0f});
  }
  ASSERT_NE(reinterpret_cast<std::uintptr_t>(problems[1].c.raw()) % 16, 0u);
  run_and_check(problems, hosts, GemmPath::grouped, false, "gemm_misaligned");
  EXPECT_EQ(calls_on(*b, "gemm_misaligned", GemmPath::grouped), 0);
  std::int64_t ran = 0;
  for (const auto& u : cuda_gemm_path_uses(*b))
    if (u.op == "gemm_misaligned") ran += u.calls;
  EXPECT_EQ(ran, 1);
}

// Equal experts in one tensor per operand: one strided batch covers them, on every path
// (beta = 1 is the weight gradient's accumulation).
TEST_P(CudaGemmTest, EquallyStridedExpertsOnEveryPath) {
  for (std::optional<GemmPath> path : {std::optional<GemmPath>{}, std::optional<GemmPath>{GemmPath::loop},
                                       std::optional<GemmPath>{GemmPath::strided_batched},
                                       std::optional<GemmPath>{GemmPath::grouped}}) {
    run_equally_strided(5, 37, 33, 19, 1.0f, 0.0f, path);
    run_equally_strided(3, 16, 24, 40, 1.0f, 1.0f, path);
  }
  // The forced strided path really ran strided-batched (cuBLAS has the kernel at least where
  // A, B and C share a type; elsewhere it may fall back to the loop).
  bool strided = false;
  for (const auto& u : cuda_gemm_path_uses(*b))
    if (u.op == "gemm_test" && u.path == GemmPath::strided_batched) strided = true;
  const GemmCase gc = GetParam();
  if (gc.ab == gc.c) {
    EXPECT_TRUE(strided);
  }
}

// The MoE layer's padded layout (GemmProblem::token_stride): experts of 16, 9, 0 and 13 rows at
// a stride of 16 with the padding rows zero, every expert a problem. Forced onto each path (the
// strided batch then runs over the padded rows) and chosen; every C against float64 over the
// experts' own rows. Forward (A [rows,k]), data gradient (B transposed) and weight gradient (A
// transposed: the tokens are k, C += A^T B at beta = 1).
TEST_P(CudaGemmTest, PaddedExpertsOnEveryPath) {
  const GemmCase gc = GetParam();
  if (gc.ta && gc.tb) GTEST_SKIP() << "no expert GEMM has both operands transposed";
  const bool wgrad = gc.ta;
  const std::int64_t S = 16;
  const std::vector<std::int64_t> rows = {16, 9, 0, 13};
  const auto E = static_cast<std::int64_t>(rows.size());
  const std::int64_t m = 24, n = 20, k = 12;  // the non-token dimensions (wgrad: m, n; else n, k)
  for (std::optional<GemmPath> path : {std::optional<GemmPath>{}, std::optional<GemmPath>{GemmPath::loop},
                                       std::optional<GemmPath>{GemmPath::strided_batched},
                                       std::optional<GemmPath>{GemmPath::grouped}}) {
    const std::uint64_t seed = fresh_seed();
    std::vector<Host> hosts;
    std::vector<float> a, bv, c;  // as laid out: token rows padded to S with zeros
    for (std::int64_t e = 0; e < E; ++e) {
      const std::int64_t r = rows[static_cast<std::size_t>(e)];
      Host h = wgrad ? host_values(m, n, r, 1.0f, 1.0f, false, seed, static_cast<std::uint64_t>(e))
                     : host_values(r, n, k, 1.0f, 0.0f, false, seed, static_cast<std::uint64_t>(e));
      const std::int64_t a_cols = wgrad ? m : k;  // A's row width (A is [r, m] for wgrad, [r, k] else)
      a.insert(a.end(), h.a.begin(), h.a.end());
      a.resize(static_cast<std::size_t>((e + 1) * S * a_cols), 0.0f);
      if (wgrad) {  // B [r, n] padded too; C the expert's [m, n] gradient
        bv.insert(bv.end(), h.b.begin(), h.b.end());
        bv.resize(static_cast<std::size_t>((e + 1) * S * n), 0.0f);
        c.insert(c.end(), h.c0.begin(), h.c0.end());
      } else {  // B the expert's weight; C [r, n] padded
        bv.insert(bv.end(), h.b.begin(), h.b.end());
        c.insert(c.end(), h.c0.begin(), h.c0.end());
        c.resize(static_cast<std::size_t>((e + 1) * S * n), 0.0f);
      }
      hosts.push_back(std::move(h));
    }
    const std::int64_t br = gc.tb ? n : k, bc = gc.tb ? k : n;
    Tensor A = make({E * S, wgrad ? m : k}, gc.ab, a);
    Tensor B = wgrad ? make({E * S, n}, gc.ab, bv) : make({E * br, bc}, gc.ab, bv);
    Tensor C = wgrad ? make({E * m, n}, gc.c, c) : make({E * S, n}, gc.c, c);
    std::vector<GemmProblem> problems;
    for (std::int64_t e = 0; e < E; ++e) {
      const std::int64_t r = rows[static_cast<std::size_t>(e)];
      GemmProblem p = wgrad ? GemmProblem{true, false, m, n, r, A.rows(e * S, r), B.rows(e * S, r), C.rows(e * m, m), 1.0f, 1.0f}
                            : GemmProblem{false, gc.tb, r, n, k, A.rows(e * S, r), B.rows(e * br, br), C.rows(e * S, r), 1.0f, 0.0f};
      p.token_stride = S;
      problems.push_back(p);
    }
    // The reference of the empty expert is nothing (m = 0) or C0 (k = 0, beta = 1). Forced
    // strided, the batch runs over the padded rows (cuBLAS has the kernel where A, B and C
    // share a type).
    const bool padded = path == GemmPath::strided_batched && gc.ab == gc.c;
    run_and_check(problems, hosts, path, padded, "gemm_padded");
    if (padded) {
      for (const auto& u : cuda_gemm_path_uses(*b))
        if (u.op == "gemm_padded" && u.path == GemmPath::strided_batched) {
          EXPECT_NE(u.last_why.find("padded"), std::string::npos) << u.last_why;
        }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Types, CudaGemmTest,
    ::testing::Values(GemmCase{DType::f32, DType::f32, false, false}, GemmCase{DType::f32, DType::f32, true, false},
                      GemmCase{DType::f32, DType::f32, false, true}, GemmCase{DType::f32, DType::f32, true, true},
                      GemmCase{DType::bf16, DType::bf16, false, false},
                      GemmCase{DType::bf16, DType::bf16, true, false},
                      GemmCase{DType::bf16, DType::bf16, false, true}, GemmCase{DType::bf16, DType::bf16, true, true},
                      GemmCase{DType::bf16, DType::f32, false, false}, GemmCase{DType::bf16, DType::f32, true, true}),
    [](const auto& tpi) {
      const GemmCase& g = tpi.param;
      return std::string(dtype_name(g.ab)) + "_c" + dtype_name(g.c) + (g.ta ? "_At" : "_An") + (g.tb ? "Bt" : "Bn");
    });

// The floor's timing: equal problems in one tensor per operand, one strided batch.
TEST_F(CudaTest, BatchedGemmTiming) {
  Tensor A = zeros({4 * 256, 64}, DType::bf16), B = zeros({4 * 64, 128}, DType::bf16), C = zeros({4 * 256, 128}, DType::bf16);
  std::vector<GemmProblem> ps;
  for (int e = 0; e < 4; ++e)
    ps.push_back({false, false, 256, 128, 64, A.rows(e * 256, 256), B.rows(e * 64, 64), C.rows(e * 256, 256), 1.0f, 0.0f});
  const double t = b->time_batched_gemms(ps, 5);
  EXPECT_GT(t, 0.0);
  EXPECT_LT(t, 1.0);
}

TEST_F(CudaTest, BareGemmTiming) {
  GemmProblem p;
  p.m = 256;
  p.n = 128;
  p.k = 64;
  p.a = zeros({256, 64}, DType::bf16);
  p.b = zeros({64, 128}, DType::bf16);
  p.c = zeros({256, 128}, DType::bf16);
  std::vector<GemmProblem> ps{p, p};
  const double t = b->time_bare_gemms(ps, 5);
  EXPECT_GT(t, 0.0);
  EXPECT_LT(t, 1.0);
}

// ---- gate ------------------------------------------------------------------------------

// The exact routing reference: top-k over the device's own probabilities (so that exp's
// last bit does not matter), then GShard's priority order and the capacity.
struct Routing {
  std::vector<std::int32_t> idx, slot, counts;
  std::vector<float> w, frac;
};

Routing host_route(const std::vector<float>& probs, std::int64_t T, std::int64_t E, int k, std::int64_t cap,
                   bool renorm) {
  Routing r;
  const auto tk = static_cast<std::size_t>(T * k);
  r.idx.assign(tk, -1);
  r.w.assign(tk, 0.0f);
  r.slot.assign(tk, -1);
  for (std::int64_t t = 0; t < T; ++t) {
    float sum = 0.0f;
    for (int j = 0; j < k; ++j) {
      std::int32_t best = -1;
      for (std::int64_t e = 0; e < E; ++e) {
        bool taken = false;
        for (int c = 0; c < j; ++c) taken |= r.idx[static_cast<std::size_t>(t * k + c)] == e;
        if (!taken && (best < 0 || probs[static_cast<std::size_t>(t * E + e)] >
                                       probs[static_cast<std::size_t>(t * E + best)]))
          best = static_cast<std::int32_t>(e);
      }
      r.idx[static_cast<std::size_t>(t * k + j)] = best;
      r.w[static_cast<std::size_t>(t * k + j)] = probs[static_cast<std::size_t>(t * E + best)];
      sum += r.w[static_cast<std::size_t>(t * k + j)];
    }
    if (renorm)
      for (int j = 0; j < k; ++j) r.w[static_cast<std::size_t>(t * k + j)] /= sum;
  }
  std::vector<std::int64_t> routed(static_cast<std::size_t>(E), 0);
  for (int j = 0; j < k; ++j)
    for (std::int64_t t = 0; t < T; ++t) {
      const auto i = static_cast<std::size_t>(t * k + j);
      const std::int64_t pos = routed[static_cast<std::size_t>(r.idx[i])]++;
      r.slot[i] = (cap <= 0 || pos < cap) ? static_cast<std::int32_t>(pos) : -1;
    }
  std::vector<std::int64_t> offset(static_cast<std::size_t>(E));
  std::int64_t run = 0;
  for (std::int64_t e = 0; e < E; ++e) {
    const auto u = static_cast<std::size_t>(e);
    const std::int64_t kept = cap <= 0 ? routed[u] : std::min(routed[u], cap);
    r.counts.push_back(static_cast<std::int32_t>(kept));
    r.frac.push_back(static_cast<float>(static_cast<double>(routed[u]) / static_cast<double>(T * k)));
    offset[u] = run;
    run += kept;
  }
  for (std::size_t i = 0; i < tk; ++i)
    if (r.slot[i] >= 0) r.slot[i] += static_cast<std::int32_t>(offset[static_cast<std::size_t>(r.idx[i])]);
  return r;
}

struct GateCase {
  std::int64_t T, E;
  int k;
  std::int64_t capacity;
  bool renorm;
  std::int64_t unpopular = -1;  // an expert whose logit is pushed down so it gets no tokens
};

void PrintTo(const GateCase& g, std::ostream* os) {
  *os << "T=" << g.T << " E=" << g.E << " k=" << g.k << " capacity=" << g.capacity << " renorm=" << g.renorm
      << " idle expert=" << g.unpopular;
}

class CudaGateTest : public CudaTest, public ::testing::WithParamInterface<GateCase> {};

TEST_P(CudaGateTest, ForwardMatchesHostRoutingExactly) {
  const GateCase gc = GetParam();
  const std::int64_t T = gc.T, E = gc.E;
  const int k = gc.k;
  auto logits_h = uniform(static_cast<std::size_t>(T * E), fresh_seed(), -3.0, 3.0);
  if (gc.unpopular >= 0)
    for (std::int64_t t = 0; t < T; ++t) logits_h[static_cast<std::size_t>(t * E + gc.unpopular)] = -30.0f;
  GateForward g;
  g.logits = make({T, E}, DType::f32, logits_h);
  g.top_k = k;
  g.capacity = gc.capacity;
  g.renormalize = gc.renorm;
  g.probs = b->empty({T, E}, DType::f32, MemCategory::activations, *s);
  g.topk_idx = b->empty({T, k}, DType::i32, MemCategory::activations, *s);
  g.topk_w = b->empty({T, k}, DType::f32, MemCategory::activations, *s);
  g.slot = b->empty({T, k}, DType::i32, MemCategory::activations, *s);
  g.counts = b->empty({E}, DType::i32, MemCategory::buffers, *s);
  g.routed_frac = b->empty({E}, DType::f32, MemCategory::buffers, *s);
  g.aux_loss = b->empty({1}, DType::f32, MemCategory::buffers, *s);
  g.prob_mean = b->empty({E}, DType::f32, MemCategory::buffers, *s);  // asked for under sequence parallelism
  b->gate_forward(*s, g);
  b->synchronize();

  // Softmax against float64.
  const auto probs = b->download(g.probs);
  std::vector<double> p_ref(probs.size());
  for (std::int64_t t = 0; t < T; ++t) {
    double mx = -1e300, sum = 0;
    for (std::int64_t e = 0; e < E; ++e) mx = std::max(mx, static_cast<double>(logits_h[static_cast<std::size_t>(t * E + e)]));
    for (std::int64_t e = 0; e < E; ++e) sum += std::exp(logits_h[static_cast<std::size_t>(t * E + e)] - mx);
    for (std::int64_t e = 0; e < E; ++e)
      p_ref[static_cast<std::size_t>(t * E + e)] = std::exp(logits_h[static_cast<std::size_t>(t * E + e)] - mx) / sum;
  }
  EXPECT_TRUE(all_close("probs", probs, p_ref, 1e-5));

  // Routing decisions: exactly the host's.
  const Routing r = host_route(probs, T, E, k, gc.capacity, gc.renorm);
  EXPECT_EQ(b->download_i32(g.topk_idx), r.idx);
  EXPECT_EQ(b->download_i32(g.slot), r.slot);
  EXPECT_EQ(b->download_i32(g.counts), r.counts);
  EXPECT_EQ(b->download(g.routed_frac), r.frac);
  EXPECT_TRUE(all_close("topk_w", b->download(g.topk_w), dbl(r.w), 1e-6));
  if (gc.unpopular >= 0) {
    EXPECT_EQ(r.counts[static_cast<std::size_t>(gc.unpopular)], 0);
  }

  // Kept slots are a permutation of 0..N-1.
  std::vector<std::int32_t> kept;
  for (auto x : r.slot)
    if (x >= 0) kept.push_back(x);
  std::sort(kept.begin(), kept.end());
  for (std::size_t i = 0; i < kept.size(); ++i) ASSERT_EQ(kept[i], static_cast<std::int32_t>(i));

  // Aux loss E * sum_e f_e * P_e, and P_e itself.
  double aux = 0;
  std::vector<double> p_mean;
  for (std::int64_t e = 0; e < E; ++e) {
    double pe = 0;
    for (std::int64_t t = 0; t < T; ++t) pe += p_ref[static_cast<std::size_t>(t * E + e)];
    p_mean.push_back(pe / static_cast<double>(T));
    aux += static_cast<double>(r.frac[static_cast<std::size_t>(e)]) * pe / static_cast<double>(T);
  }
  EXPECT_TRUE(all_close("aux_loss", b->download(g.aux_loss), {static_cast<double>(E) * aux}, 1e-5));
  EXPECT_TRUE(all_close("prob_mean", b->download(g.prob_mean), p_mean, 1e-5));
}

TEST_P(CudaGateTest, BackwardMatchesFloat64) {
  const GateCase gc = GetParam();
  const std::int64_t T = gc.T, E = gc.E;
  const int k = gc.k;
  const std::uint64_t seed = fresh_seed();
  // Forward outputs as the backward's inputs: probs rows from a softmax, top-k of them.
  auto logits_h = uniform(static_cast<std::size_t>(T * E), Rng::mix(seed, 1), -3.0, 3.0);
  std::vector<float> probs(logits_h.size());
  for (std::int64_t t = 0; t < T; ++t) {
    double mx = -1e300, sum = 0;
    for (std::int64_t e = 0; e < E; ++e) mx = std::max(mx, static_cast<double>(logits_h[static_cast<std::size_t>(t * E + e)]));
    for (std::int64_t e = 0; e < E; ++e) sum += std::exp(logits_h[static_cast<std::size_t>(t * E + e)] - mx);
    for (std::int64_t e = 0; e < E; ++e)
      probs[static_cast<std::size_t>(t * E + e)] =
          static_cast<float>(std::exp(logits_h[static_cast<std::size_t>(t * E + e)] - mx) / sum);
  }
  const Routing r = host_route(probs, T, E, k, gc.capacity, gc.renorm);
  const auto dw = uniform(static_cast<std::size_t>(T * k), Rng::mix(seed, 2));
  const float grad_aux = 0.37f;

  GateBackward g;
  g.probs = make({T, E}, DType::f32, probs);
  g.topk_idx = make_i32({T, k}, r.idx);
  g.topk_w = make({T, k}, DType::f32, r.w);
  g.routed_frac = make({E}, DType::f32, r.frac);
  g.renormalize = gc.renorm;
  g.d_topk_w = make({T, k}, DType::f32, dw);
  g.grad_aux = grad_aux;
  g.d_logits = b->empty({T, E}, DType::f32, MemCategory::gradients, *s);
  b->gate_backward(*s, g);

  std::vector<double> ref(static_cast<std::size_t>(T * E));
  for (std::int64_t t = 0; t < T; ++t) {
    std::vector<double> dp(static_cast<std::size_t>(E));
    for (std::int64_t e = 0; e < E; ++e)
      dp[static_cast<std::size_t>(e)] =
          grad_aux * static_cast<double>(E) * r.frac[static_cast<std::size_t>(e)] / static_cast<double>(T);
    double S = 0, dot = 0;
    for (int j = 0; j < k; ++j) {
      const auto i = static_cast<std::size_t>(t * k + j);
      S += probs[static_cast<std::size_t>(t * E + r.idx[i])];
    }
    for (int j = 0; j < k; ++j) {
      const auto i = static_cast<std::size_t>(t * k + j);
      dot += dw[i] * (probs[static_cast<std::size_t>(t * E + r.idx[i])] / S);
    }
    for (int j = 0; j < k; ++j) {
      const auto i = static_cast<std::size_t>(t * k + j);
      dp[static_cast<std::size_t>(r.idx[i])] += gc.renorm ? (dw[i] - dot) / S : dw[i];
    }
    double pdp = 0;
    for (std::int64_t e = 0; e < E; ++e) pdp += probs[static_cast<std::size_t>(t * E + e)] * dp[static_cast<std::size_t>(e)];
    for (std::int64_t e = 0; e < E; ++e)
      ref[static_cast<std::size_t>(t * E + e)] =
          probs[static_cast<std::size_t>(t * E + e)] * (dp[static_cast<std::size_t>(e)] - pdp);
  }
  EXPECT_TRUE(all_close("d_logits", b->download(g.d_logits), ref, 1e-5));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaGateTest,
    ::testing::Values(GateCase{1, 1, 1, 0, false}, GateCase{1, 7, 2, 0, true}, GateCase{37, 1, 1, 5, false},
                      GateCase{37, 7, 2, 0, false, 3}, GateCase{37, 7, 2, 6, false}, GateCase{37, 7, 2, 6, true, 4},
                      GateCase{37, 7, 1, 3, false}, GateCase{1000, 64, 2, 40, true}, GateCase{513, 300, 4, 0, false},
                      GateCase{4096, 16, 2, 300, false}),
    [](const auto& tpi) {
      const GateCase& g = tpi.param;
      return "T" + std::to_string(g.T) + "_E" + std::to_string(g.E) + "_k" + std::to_string(g.k) + "_cap" +
             std::to_string(g.capacity) + (g.renorm ? "_renorm" : "") +
             (g.unpopular >= 0 ? "_idle" + std::to_string(g.unpopular) : "");
    });

// Ties go to the lower expert index, and every first choice outranks every second choice.
TEST_F(CudaTest, GateTiesAndPriority) {
  const std::int64_t T = 5, E = 4;
  const int k = 2;
  GateForward g;
  g.logits = make({T, E}, DType::f32, std::vector<float>(static_cast<std::size_t>(T * E), 0.25f));
  g.top_k = k;
  g.capacity = 3;
  g.probs = b->empty({T, E}, DType::f32, MemCategory::activations, *s);
  g.topk_idx = b->empty({T, k}, DType::i32, MemCategory::activations, *s);
  g.topk_w = b->empty({T, k}, DType::f32, MemCategory::activations, *s);
  g.slot = b->empty({T, k}, DType::i32, MemCategory::activations, *s);
  g.counts = b->empty({E}, DType::i32, MemCategory::buffers, *s);
  g.routed_frac = b->empty({E}, DType::f32, MemCategory::buffers, *s);
  g.aux_loss = b->empty({1}, DType::f32, MemCategory::buffers, *s);
  b->gate_forward(*s, g);
  // Everyone picks experts 0 then 1; expert 0 keeps tokens 0..2 (first choices), expert 1
  // keeps tokens 0..2 of the second choice; slots 0,1,2 for expert 0 and 3,4,5 for expert 1.
  EXPECT_EQ(b->download_i32(g.topk_idx), (std::vector<std::int32_t>{0, 1, 0, 1, 0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(b->download_i32(g.slot), (std::vector<std::int32_t>{0, 3, 1, 4, 2, 5, -1, -1, -1, -1}));
  EXPECT_EQ(b->download_i32(g.counts), (std::vector<std::int32_t>{3, 3, 0, 0}));
  EXPECT_EQ(b->download(g.routed_frac), (std::vector<float>{0.5f, 0.5f, 0.0f, 0.0f}));
  EXPECT_FLOAT_EQ(b->download(g.aux_loss)[0], 1.0f);  // 4 * (0.5*0.25 + 0.5*0.25)
}

TEST_F(CudaTest, NoisyLogitsForwardBackward) {
  const std::int64_t T = 37, E = 7;
  const std::uint64_t seed = fresh_seed();
  const auto clean = uniform(static_cast<std::size_t>(T * E), Rng::mix(seed, 1));
  auto noise = uniform(static_cast<std::size_t>(T * E), Rng::mix(seed, 2), -25.0, 25.0);
  const auto eps = uniform(static_cast<std::size_t>(T * E), Rng::mix(seed, 3));
  const auto dl = uniform(static_cast<std::size_t>(T * E), Rng::mix(seed, 4));
  Tensor c = make({T, E}, DType::f32, clean), n = make({T, E}, DType::f32, noise), e = make({T, E}, DType::f32, eps);
  Tensor d = make({T, E}, DType::f32, dl);
  Tensor out = b->empty({T, E}, DType::f32, MemCategory::activations, *s);
  Tensor dn = b->empty({T, E}, DType::f32, MemCategory::gradients, *s);
  b->noisy_logits(*s, c, n, e, out);
  b->noisy_logits_backward(*s, d, n, e, dn);
  std::vector<double> ref(clean.size()), dref(clean.size());
  for (std::size_t i = 0; i < clean.size(); ++i) {
    const double x = noise[i];
    ref[i] = clean[i] + eps[i] * std::log1p(std::exp(x));
    dref[i] = dl[i] * eps[i] / (1.0 + std::exp(-x));
  }
  EXPECT_TRUE(all_close("noisy logits", b->download(out), ref, 1e-5));
  EXPECT_TRUE(all_close("d_noise_raw", b->download(dn), dref, 1e-5));
}

// ---- dispatch and combine rows -----------------------------------------------------------

struct RowCase {
  DType dt;
  std::int64_t T, E;
  int k;
  std::int64_t M, capacity;
  bool misaligned_out = false;  // every output a view one element into its allocation
};

void PrintTo(const RowCase& r, std::ostream* os) {
  *os << dtype_name(r.dt) << " T=" << r.T << " E=" << r.E << " k=" << r.k << " M=" << r.M
      << " capacity=" << r.capacity << (r.misaligned_out ? " misaligned outputs" : "");
}

class CudaRowsTest : public CudaTest, public ::testing::WithParamInterface<RowCase> {};

// permute -> unpermute round trip and both backwards, with slots from the host routing of
// random choices (so there are dropped slots and idle experts).
TEST_P(CudaRowsTest, PermuteUnpermuteAndBackward) {
  const RowCase rc = GetParam();
  const std::int64_t T = rc.T, E = rc.E, M = rc.M;
  const int k = rc.k;
  const std::uint64_t seed = fresh_seed();
  auto probs = uniform(static_cast<std::size_t>(T * E), Rng::mix(seed, 1), 0.0, 1.0);
  if (E > 2)
    for (std::int64_t t = 0; t < T; ++t) probs[static_cast<std::size_t>(t * E + 1)] = 0.0f;  // expert 1 idle
  const Routing r = host_route(probs, T, E, k, rc.capacity, false);
  const std::int64_t N = std::accumulate(r.counts.begin(), r.counts.end(), std::int64_t{0});
  const auto x = stored(uniform(static_cast<std::size_t>(T * M), Rng::mix(seed, 2)), rc.dt);
  const auto w = uniform(static_cast<std::size_t>(T * k), Rng::mix(seed, 3), 0.0, 1.0);
  const auto dy = stored(uniform(static_cast<std::size_t>(T * M), Rng::mix(seed, 4)), rc.dt);
  const auto ypv = stored(uniform(static_cast<std::size_t>(N * M), Rng::mix(seed, 5)), rc.dt);

  // An output: its own allocation, or (misaligned_out) a view one element into one, so that
  // the kernels must take their element-by-element path although the inputs allow packs.
  const auto output = [&](std::vector<std::int64_t> shape) {
    const std::int64_t n = shape[0] * shape[1];
    if (!rc.misaligned_out) return b->empty(std::move(shape), rc.dt, MemCategory::buffers, *s);
    return b->empty({n + 1}, rc.dt, MemCategory::buffers, *s).rows(1, n).reshape(std::move(shape));
  };
  Tensor xt = make({T, M}, rc.dt, x);
  Tensor slot = make_i32({T, k}, r.slot);
  Tensor wt = make({T, k}, DType::f32, w);
  Tensor perm = output({N, M});
  b->permute(*s, xt, slot, perm);
  // permute is a copy: bit-exact rows.
  const auto got_perm = b->download(perm);
  for (std::int64_t i = 0; i < T * k; ++i) {
    const std::int32_t sl = r.slot[static_cast<std::size_t>(i)];
    if (sl < 0) continue;
    for (std::int64_t c = 0; c < M; ++c)
      ASSERT_EQ(got_perm[static_cast<std::size_t>(sl * M + c)], x[static_cast<std::size_t>((i / k) * M + c)])
          << "slot " << sl << " col " << c;
  }

  // Round trip: unpermute(permute(x)) = x * sum of the kept weights.
  Tensor y = output({T, M});
  b->unpermute(*s, perm, slot, wt, y);
  std::vector<double> y_ref(static_cast<std::size_t>(T * M));
  for (std::int64_t t = 0; t < T; ++t) {
    double ws = 0;
    for (int j = 0; j < k; ++j)
      if (r.slot[static_cast<std::size_t>(t * k + j)] >= 0) ws += w[static_cast<std::size_t>(t * k + j)];
    for (std::int64_t c = 0; c < M; ++c) y_ref[static_cast<std::size_t>(t * M + c)] = ws * x[static_cast<std::size_t>(t * M + c)];
  }
  EXPECT_TRUE(all_close("unpermute(permute(x))", b->download(y), y_ref, tol(rc.dt)));

  // permute backward: dx[t] = sum over kept slots of d_out rows.
  Tensor d_out = make({N, M}, rc.dt, ypv);
  Tensor dx = output({T, M});
  b->permute_backward(*s, d_out, slot, dx);
  std::vector<double> dx_ref(static_cast<std::size_t>(T * M), 0.0);
  for (std::int64_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const std::int32_t sl = r.slot[static_cast<std::size_t>(t * k + j)];
      if (sl < 0) continue;
      for (std::int64_t c = 0; c < M; ++c)
        dx_ref[static_cast<std::size_t>(t * M + c)] += ypv[static_cast<std::size_t>(sl * M + c)];
    }
  EXPECT_TRUE(all_close("permute_backward", b->download(dx), dx_ref, tol(rc.dt)));

  // unpermute backward: d_y_perm rows and dw.
  Tensor y_perm = make({N, M}, rc.dt, ypv);
  Tensor dyt = make({T, M}, rc.dt, dy);
  Tensor d_y_perm = output({N, M});
  Tensor dw = b->empty({T, k}, DType::f32, MemCategory::gradients, *s);
  b->unpermute_backward(*s, dyt, y_perm, slot, wt, d_y_perm, dw);
  std::vector<double> dyp_ref(static_cast<std::size_t>(N * M), 0.0), dw_ref(static_cast<std::size_t>(T * k), 0.0);
  for (std::int64_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const auto i = static_cast<std::size_t>(t * k + j);
      const std::int32_t sl = r.slot[i];
      if (sl < 0) continue;
      double dot = 0;
      for (std::int64_t c = 0; c < M; ++c) {
        const double g = dy[static_cast<std::size_t>(t * M + c)];
        dyp_ref[static_cast<std::size_t>(sl * M + c)] = w[i] * g;
        dot += g * ypv[static_cast<std::size_t>(sl * M + c)];
      }
      dw_ref[i] = dot;
    }
  if (N > 0) {
    EXPECT_TRUE(all_close("d_y_perm", b->download(d_y_perm), dyp_ref, tol(rc.dt)));
  }
  // dw is fp32 accumulated from stored inputs: fp32 tolerance even for bf16 rows.
  const auto dw_got = b->download(dw);
  EXPECT_TRUE(all_close("dw", dw_got, dw_ref, 1e-5));
  for (std::size_t i = 0; i < dw_got.size(); ++i)
    if (r.slot[i] < 0) {
      EXPECT_EQ(dw_got[i], 0.0f) << "dropped slot " << i;
    }

  // In place: d_y_perm is y_perm (each y_perm element read before it is overwritten).
  if (N > 0 && !rc.misaligned_out) {
    Tensor both = make({N, M}, rc.dt, ypv);
    Tensor dw2 = b->empty({T, k}, DType::f32, MemCategory::gradients, *s);
    b->unpermute_backward(*s, dyt, both, slot, wt, both, dw2);
    EXPECT_TRUE(all_close("d_y_perm in place", b->download(both), dyp_ref, tol(rc.dt)));
    EXPECT_TRUE(all_close("dw in place", b->download(dw2), dw_ref, 1e-5));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaRowsTest,
    ::testing::Values(RowCase{DType::f32, 1, 1, 1, 33, 0}, RowCase{DType::bf16, 1, 1, 1, 33, 0},
                      RowCase{DType::f32, 37, 7, 2, 33, 6}, RowCase{DType::bf16, 37, 7, 2, 33, 6},
                      RowCase{DType::f32, 37, 7, 2, 64, 0}, RowCase{DType::bf16, 37, 7, 2, 64, 0},
                      RowCase{DType::f32, 200, 8, 2, 256, 30}, RowCase{DType::bf16, 200, 8, 2, 1000, 30},
                      // rows of 72 bytes: whole 8-byte units but not whole 16-byte packs
                      RowCase{DType::f32, 37, 7, 2, 18, 6}, RowCase{DType::bf16, 37, 7, 2, 36, 0},
                      // inputs that allow packs, outputs that do not
                      RowCase{DType::f32, 37, 7, 2, 64, 6, true}, RowCase{DType::bf16, 200, 8, 2, 256, 30, true}),
    [](const auto& tpi) {
      const RowCase& r = tpi.param;
      return std::string(dtype_name(r.dt)) + "_T" + std::to_string(r.T) + "_E" + std::to_string(r.E) + "_k" +
             std::to_string(r.k) + "_M" + std::to_string(r.M) + "_cap" + std::to_string(r.capacity) +
             (r.misaligned_out ? "_misaligned" : "");
    });

// ---- activations -------------------------------------------------------------------------

class CudaActTest : public CudaTest, public ::testing::WithParamInterface<std::tuple<DType, Activation>> {};

// act(x) and g * act'(x) in float64.
void act_reference(Activation act, const std::vector<float>& x, const std::vector<float>& g, std::vector<double>& f,
                   std::vector<double>& d) {
  f.assign(x.size(), 0.0);
  d.assign(x.size(), 0.0);
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double v = x[i];
    if (act == Activation::gelu) {
      f[i] = 0.5 * v * (1.0 + std::erf(v / std::sqrt(2.0)));
      d[i] = g[i] * (0.5 * (1.0 + std::erf(v / std::sqrt(2.0))) + v * std::exp(-0.5 * v * v) / std::sqrt(2.0 * std::numbers::pi));
    } else if (act == Activation::gelu_tanh) {
      const double c = std::sqrt(2.0 / std::numbers::pi), th = std::tanh(c * (v + 0.044715 * v * v * v));
      f[i] = 0.5 * v * (1.0 + th);
      d[i] = g[i] * (0.5 * (1.0 + th) + 0.5 * v * (1.0 - th * th) * c * (1.0 + 3.0 * 0.044715 * v * v));
    } else {
      f[i] = v > 0 ? v : 0.0;
      d[i] = v > 0 ? g[i] : 0.0;
    }
  }
}

TEST_P(CudaActTest, ForwardBackward) {
  const auto [dt, act] = GetParam();
  const std::int64_t n = 37 * 33;
  const std::uint64_t seed = fresh_seed();
  const auto x = stored(uniform(static_cast<std::size_t>(n), Rng::mix(seed, 1), -4.0, 4.0), dt);
  const auto g = stored(uniform(static_cast<std::size_t>(n), Rng::mix(seed, 2)), dt);
  Tensor in = make({37, 33}, dt, x);
  // NaN before: an element the kernels leave unwritten (a wrong tail, say) fails the check.
  Tensor out = make({37, 33}, dt, std::vector<float>(x.size(), std::numeric_limits<float>::quiet_NaN()));
  Tensor dout = make({37, 33}, dt, g);
  b->activation_forward(*s, act, in, out);
  b->activation_backward(*s, act, in, dout, dout);  // in place: d_in aliases d_out
  std::vector<double> f, d;
  act_reference(act, x, g, f, d);
  EXPECT_TRUE(all_close("forward", b->download(out), f, tol(dt)));
  EXPECT_TRUE(all_close("backward", b->download(dout), d, tol(dt)));
}

// Row views one row in: 33 elements, 66 (bf16) or 132 (fp32) bytes off the allocation, so not
// 16-byte aligned; each tensor alone so, then all three (the test above, on whole allocations,
// runs 16-byte packs and a tail). Any one misaligned pointer must send the launch element by
// element.
TEST_P(CudaActTest, ForwardBackwardOnUnalignedViews) {
  const auto [dt, act] = GetParam();
  const std::int64_t R = 37, C = 33;
  for (int offset : {1, 2, 4, 7}) {  // bits: in, out, d_out (= d_in)
    SCOPED_TRACE("offset views: " + std::to_string(offset));
    const std::uint64_t seed = fresh_seed();
    const auto x = stored(uniform(static_cast<std::size_t>(R * C), Rng::mix(seed, 1), -4.0, 4.0), dt);
    const auto g = stored(uniform(static_cast<std::size_t>(R * C), Rng::mix(seed, 2)), dt);
    const std::vector<float> nan(x.size(), std::numeric_limits<float>::quiet_NaN());
    const auto first = [&](int bit) { return (offset & bit) ? std::int64_t{1} : std::int64_t{0}; };
    Tensor in = make({R, C}, dt, x), out = make({R, C}, dt, nan), dout = make({R, C}, dt, g);
    Tensor in_v = in.rows(first(1), R - 1), out_v = out.rows(first(2), R - 1), dout_v = dout.rows(first(4), R - 1);
    b->activation_forward(*s, act, in_v, out_v);
    b->activation_backward(*s, act, in_v, dout_v, dout_v);
    const auto f = b->download(out_v), d = b->download(dout_v);
    const auto rows = [&](const std::vector<float>& v, std::int64_t r0) {
      return std::vector<float>(v.begin() + r0 * C, v.begin() + (r0 + R - 1) * C);
    };
    std::vector<double> fr, dr;
    act_reference(act, rows(x, first(1)), rows(g, first(4)), fr, dr);
    EXPECT_TRUE(all_close("forward", f, fr, tol(dt)));
    EXPECT_TRUE(all_close("backward", d, dr, tol(dt)));
    // The row outside each view is untouched.
    const auto out_all = b->download(out), dout_all = b->download(dout);
    const std::int64_t out_spare = first(2) ? 0 : R - 1, dout_spare = first(4) ? 0 : R - 1;
    for (std::int64_t i = 0; i < C; ++i) {
      ASSERT_TRUE(std::isnan(out_all[static_cast<std::size_t>(out_spare * C + i)])) << "forward wrote outside its view";
      ASSERT_EQ(dout_all[static_cast<std::size_t>(dout_spare * C + i)], g[static_cast<std::size_t>(dout_spare * C + i)])
          << "backward wrote outside its view";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, CudaActTest,
                         ::testing::Combine(::testing::Values(DType::f32, DType::bf16),
                                            ::testing::Values(Activation::gelu, Activation::relu, Activation::gelu_tanh)),
                         [](const auto& tpi) {
                           return std::string(dtype_name(std::get<0>(tpi.param))) + "_" +
                                  activation_name(std::get<1>(tpi.param));
                         });

// ---- timeline ----------------------------------------------------------------------------

TEST_F(CudaTest, TimelineHasOneRecordPerOp) {
  Stream& other = b->create_stream(StreamRole::combine, "combine");
  Tensor x = make({64, 33}, DType::f32, uniform(64 * 33, fresh_seed()));
  Tensor y = b->empty({64, 33}, DType::f32, MemCategory::activations, *s);
  Tensor z = b->empty({64, 33}, DType::f32, MemCategory::activations, other);
  b->synchronize();
  b->set_rank(3);
  b->clear_timeline();
  const double before = b->now();
  {
    PhaseScope phase(*b, "experts");
    b->activation_forward(*s, Activation::gelu, x, y);
    GemmProblem p;
    p.m = 64;
    p.n = 33;
    p.k = 33;
    p.a = x;
    p.b = b->empty({33, 33}, DType::f32, MemCategory::weights, *s);
    b->fill_zero(*s, p.b);
    p.c = y;
    b->gemm(*s, p, "fc1");
  }
  b->copy(other, x, z);
  b->synchronize();
  const double after = b->now();
  const auto tl = b->timeline();
  ASSERT_EQ(tl.size(), 4u);
  std::vector<std::string> names;
  for (const auto& r : tl) names.push_back(r.name);
  std::sort(names.begin(), names.end());
  EXPECT_EQ(names, (std::vector<std::string>{"copy", "fc1", "fill_zero", "gelu"}));
  for (const auto& r : tl) {
    EXPECT_EQ(r.rank, 3);
    EXPECT_LE(r.start, r.end) << r.name;
    EXPECT_GE(r.start, before - 1e-3) << r.name;
    EXPECT_LE(r.end, after + 1e-3) << r.name;
    if (r.name == "copy") {
      EXPECT_EQ(r.stream_name, "combine");
      EXPECT_EQ(r.phase, "other");
      EXPECT_EQ(r.cost.kind, OpKind::copy_d2d);
    } else {
      EXPECT_EQ(r.stream_name, "compute");
      EXPECT_EQ(r.phase, "experts");
    }
    if (r.name == "fc1") {
      EXPECT_DOUBLE_EQ(r.cost.flops, 2.0 * 64 * 33 * 33);
    }
  }
  // Stream order shows in the times: gelu, fill_zero, fc1 run one after another.
  auto find = [&](const std::string& n) {
    return *std::find_if(tl.begin(), tl.end(), [&](const OpRecord& r) { return r.name == n; });
  };
  EXPECT_LE(find("gelu").end, find("fill_zero").start + 1e-6);
  EXPECT_LE(find("fill_zero").end, find("fc1").start + 1e-6);
  b->clear_timeline();
  EXPECT_TRUE(b->timeline().empty());
}

// ---- NCCL in a world of one --------------------------------------------------------------

// The collective watchdog on a real communicator: an all_reduce held back on its stream (a host
// function that blocks until the test lets it go) is reported once it has been pending past
// the timeout, with the op and the communicator named; ops that complete are not.
TEST_F(CudaTest, NcclWatchdogReportsAnOpThatDoesNotComplete) {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> failures;
  NcclWatch watch;
  watch.timeout_s = 0.3;
  watch.on_failure = [&](const std::string& m) {
    std::lock_guard lock(mu);
    failures.push_back(m);
    cv.notify_all();
  };
  auto comm = make_nccl_communicator(*b, nccl_unique_id(), 0, 1, std::move(watch));
  Tensor buf = make({33}, DType::f32, uniform(33, fresh_seed()));
  comm->all_reduce(*s, buf);
  comm->barrier();
  b->synchronize();
  std::this_thread::sleep_for(std::chrono::milliseconds(700));  // past the timeout: they completed
  {
    std::lock_guard lock(mu);
    EXPECT_TRUE(failures.empty()) << failures.front();
  }

  std::atomic<bool> release{false};
  auto hold = [](void* flag) {
    while (!static_cast<std::atomic<bool>*>(flag)->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  };
  // Whatever happens below, the stream is let go before the backend waits for it.
  struct Release {
    std::atomic<bool>& flag;
    ~Release() { flag = true; }
  } guard{release};
  ASSERT_EQ(cudaLaunchHostFunc(cuda_native_stream(*s), hold, &release), cudaSuccess);
  comm->all_reduce(*s, buf);
  {
    std::unique_lock lock(mu);
    EXPECT_TRUE(cv.wait_for(lock, std::chrono::seconds(20), [&] { return !failures.empty(); }));
  }
  release = true;
  b->synchronize();
  std::lock_guard lock(mu);
  ASSERT_EQ(failures.size(), 1u);
  EXPECT_NE(failures[0].find("all_reduce on the NCCL communicator rank 0 of 1 (world ranks 0)"), std::string::npos)
      << failures[0];
  EXPECT_NE(failures[0].find("has not completed"), std::string::npos) << failures[0];
}

TEST_F(CudaTest, NcclWorldOfOne) {
  auto comm = make_nccl_communicator(*b, nccl_unique_id(), 0, 1);
  EXPECT_EQ(comm->kind(), "nccl");
  EXPECT_EQ(comm->rank(), 0);
  EXPECT_EQ(comm->size(), 1);

  // all_to_all_v with segments to self, received in listed order at other offsets.
  const auto v = stored(uniform(40, fresh_seed()), DType::bf16);
  Tensor send = make({40}, DType::bf16, v);
  Tensor recv = zeros({40}, DType::bf16);
  const std::vector<Segment> sends{{0, 0, 10}, {0, 10, 0}, {0, 10, 30}};
  const std::vector<Segment> recvs{{0, 30, 10}, {0, 0, 30}};
  b->clear_timeline();
  comm->all_to_all_v(*s, send, sends, recv, recvs);
  std::vector<float> expect(40);
  std::copy(v.begin(), v.begin() + 10, expect.begin() + 30);
  std::copy(v.begin() + 10, v.end(), expect.begin());
  EXPECT_EQ(b->download(recv), expect);
  b->synchronize();
  const auto tl = b->timeline();
  ASSERT_EQ(tl.size(), 1u);
  EXPECT_EQ(tl[0].name, "all_to_all_v");
  EXPECT_EQ(tl[0].cost.kind, OpKind::collective);
  EXPECT_EQ(tl[0].cost.comm_bytes, 0.0);

  // Adjacent segments (one copy) beside a jump on the receive side: [0,10) -> [0,10),
  // [10,20) -> [30,40), [20,40) -> [10,30).
  Tensor recv2 = zeros({40}, DType::bf16);
  const std::vector<Segment> sends2{{0, 0, 5}, {0, 5, 5}, {0, 10, 10}, {0, 20, 20}};
  const std::vector<Segment> recvs2{{0, 0, 5}, {0, 5, 5}, {0, 30, 10}, {0, 10, 20}};
  comm->all_to_all_v(*s, send, sends2, recv2, recvs2);
  std::vector<float> expect2(40);
  std::copy(v.begin(), v.begin() + 10, expect2.begin());
  std::copy(v.begin() + 10, v.begin() + 20, expect2.begin() + 30);
  std::copy(v.begin() + 20, v.end(), expect2.begin() + 10);
  EXPECT_EQ(b->download(recv2), expect2);

  // all_reduce over one rank is the identity; all_gather and reduce_scatter copy.
  const auto a = uniform(33, fresh_seed());
  Tensor buf = make({33}, DType::f32, a);
  comm->all_reduce(*s, buf);
  EXPECT_EQ(b->download(buf), a);
  Tensor gathered = zeros({33}, DType::f32);
  comm->all_gather(*s, buf, gathered);
  EXPECT_EQ(b->download(gathered), a);
  Tensor scattered = zeros({33}, DType::f32);
  comm->reduce_scatter(*s, buf, scattered);
  EXPECT_EQ(b->download(scattered), a);

  // Control plane.
  comm->barrier();
  EXPECT_EQ(comm->exchange_counts({4, 5, 6}), (std::vector<std::int64_t>{4, 5, 6}));
  EXPECT_EQ(comm->all_reduce_max(2.5), 2.5);
  EXPECT_EQ(comm->all_reduce_sum(-1.25), -1.25);
  EXPECT_EQ(comm->all_gather_strings("NVIDIA H100"), (std::vector<std::string>{"NVIDIA H100"}));
  EXPECT_EQ(comm->all_gather_strings(""), (std::vector<std::string>{""}));

  // A dup is an independent, working channel; bad segments are CommErrors.
  auto second = comm->dup();
  Tensor buf2 = make({33}, DType::f32, a);
  second->all_reduce(*s, buf2);
  EXPECT_EQ(b->download(buf2), a);
  const std::vector<Segment> bad{{1, 0, 4}};
  EXPECT_THROW(comm->all_to_all_v(*s, send, bad, recv, bad), CommError);
  EXPECT_THROW(comm->send(*s, buf, 0), CommError);
  b->synchronize();

  // Splits as the training runs make them (ncclCommSplit): a rank that leaves gets none, a
  // colour other than 0 and a split of a split work, and the process groups of a layout are
  // six splits of the world, each an NCCL communicator of this one rank.
  EXPECT_EQ(comm->split(-1, 0), nullptr);
  auto part = comm->split(7, 3);
  ASSERT_TRUE(part);
  EXPECT_EQ(part->size(), 1);
  EXPECT_EQ(part->rank(), 0);
  EXPECT_EQ(part->world_ranks(), std::vector<int>{0});
  auto sub = part->split(0, 0);
  ASSERT_TRUE(sub);
  Tensor buf3 = make({33}, DType::f32, a);
  sub->all_reduce(*s, buf3);
  EXPECT_EQ(b->download(buf3), a);
  ProcessGroups groups(*comm, check_layout(ParallelLayout{}, 1, 1, std::nullopt), gather_nodes(*comm));
  for (Group g : kAllGroups) {
    EXPECT_EQ(groups.group(g).kind(), "nccl");
    EXPECT_EQ(groups.group(g).size(), 1);
  }
  b->synchronize();
}

// The tanh GeLU in cuBLASLt's epilogues, on each path a fused call can take: E equal experts in
// one buffer (a strided batch of cublasLtMatmul) and a loop of single matmuls, FC1 (GELU_AUX:
// T_M and A) and FC2's dgrad (DGELU: dT_M), each against float64 from the values the device
// holds; the op's detail names the epilogue, so a silent fallback to the unfused pair shows.
class FusedEpilogue : public ::testing::TestWithParam<DType> {};

TEST_P(FusedEpilogue, StridedAndLoopAgainstFloat64) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  const DType t = GetParam();
  auto b = make_backend("cuda");
  Stream& s = b->default_stream();
  const std::int64_t E = 4, r = 64, M = 48, H = 96;
  const std::uint64_t seed = fresh_seed();
  SCOPED_TRACE("seed " + std::to_string(seed));
  const auto up = [&](std::vector<std::int64_t> shape, std::uint64_t salt) {
    Tensor x = b->empty(shape, t, MemCategory::buffers, s);
    b->upload(uniform(static_cast<std::size_t>(x.numel()), Rng::mix(seed, salt), -1.5, 1.5), x);
    return x;
  };
  Tensor x = up({E * r, M}, 1), w1 = up({E, M, H}, 2), w2 = up({E, H, M}, 3), dy = up({E * r, M}, 4);
  const auto host = [&](const Tensor& v) { return test::to_double(b->download(v)); };
  const std::vector<double> hx = host(x), hw1 = host(w1), hw2 = host(w2), hdy = host(dy);
  const double c = std::sqrt(2.0 / std::numbers::pi);
  const auto gelu = [&](double v) { return 0.5 * v * (1.0 + std::tanh(c * (v + 0.044715 * v * v * v))); };
  const auto dgelu = [&](double v) {
    const double th = std::tanh(c * (v + 0.044715 * v * v * v));
    return 0.5 * (1.0 + th) + 0.5 * v * (1.0 - th * th) * c * (1.0 + 3.0 * 0.044715 * v * v);
  };
  const double rtol = t == DType::bf16 ? 3e-2 : 1e-4;
  for (std::optional<GemmPath> path : {std::optional<GemmPath>(GemmPath::strided_batched), std::optional<GemmPath>(GemmPath::loop)}) {
    SCOPED_TRACE(gemm_path_name(*path));
    Tensor t_m = b->empty({E * r, H}, t, MemCategory::buffers, s), a = b->empty({E * r, H}, t, MemCategory::buffers, s);
    Tensor d_a = b->empty({E * r, H}, t, MemCategory::buffers, s);
    std::vector<GemmProblem> fc1, dgrad;
    for (std::int64_t l = 0; l < E; ++l) {
      GemmProblem p{false, false, r, H, M, x.rows(l * r, r), w1.select(l), a.rows(l * r, r), 1, 0};
      p.aux = t_m.rows(l * r, r);
      fc1.push_back(p);
      GemmProblem q{false, true, r, H, M, dy.rows(l * r, r), w2.select(l), d_a.rows(l * r, r), 1, 0};
      q.aux = t_m.rows(l * r, r);
      dgrad.push_back(q);
    }
    const std::int64_t fc1_before = calls_on(*b, "fc1", *path), dgrad_before = calls_on(*b, "fc2_dgrad", *path);
    const std::int64_t unfused_before = cuda_unfused_epilogues(*b);
    cuda_force_gemm_path(*b, path);
    b->clear_timeline();
    b->grouped_gemm_epilogue(s, fc1, GemmEpilogue::act_aux, Activation::gelu_tanh, "fc1");
    b->grouped_gemm_epilogue(s, dgrad, GemmEpilogue::dact, Activation::gelu_tanh, "fc2_dgrad");
    b->synchronize();
    cuda_force_gemm_path(*b, std::nullopt);
    const auto tl = b->timeline();
    ASSERT_EQ(tl.size(), 2u);
    EXPECT_NE(tl[0].detail.find("GELU_AUX"), std::string::npos) << tl[0].detail;
    EXPECT_NE(tl[1].detail.find("DGELU"), std::string::npos) << tl[1].detail;
    // The count calibrate reads agrees with the details: k of n unfused, summed.
    std::int64_t unfused_in_details = 0;
    for (const auto& rec : tl) {
      if (const auto at = rec.detail.find(" unfused"); at != std::string::npos) {
        const auto of = rec.detail.rfind("; ", at);
        unfused_in_details += std::stoll(rec.detail.substr(of + 2));
      }
    }
    EXPECT_EQ(cuda_unfused_epilogues(*b) - unfused_before, unfused_in_details);
    for (const auto& rec : tl) {
      std::printf("%s %s: %s\n", dtype_name(t), rec.name.c_str(), rec.detail.c_str());
      // bf16 (the GPU workloads' dtype) must take cuBLASLt's kernels, as apex's and
      // TransformerEngine's fused layers do; fp32 may fall back (its numbers are checked either way)
      if (t == DType::bf16) {
        EXPECT_EQ(rec.detail.find("unfused"), std::string::npos) << rec.detail;
      }
    }
    if (t == DType::bf16) {  // fp32 may fall back; bf16 must run on the forced path
      EXPECT_EQ(calls_on(*b, "fc1", *path), fc1_before + 1) << tl[0].detail;
      EXPECT_EQ(calls_on(*b, "fc2_dgrad", *path), dgrad_before + 1) << tl[1].detail;
    }
    const std::vector<double> gm = host(t_m), ga = host(a), gda = host(d_a);
    std::vector<double> want_m(gm.size()), want_a(gm.size()), want_da(gm.size());
    for (std::int64_t l = 0; l < E; ++l)
      for (std::int64_t i = 0; i < r; ++i)
        for (std::int64_t j = 0; j < H; ++j) {
          double pm = 0, pd = 0;
          for (std::int64_t k = 0; k < M; ++k) {
            pm += hx[static_cast<std::size_t>((l * r + i) * M + k)] * hw1[static_cast<std::size_t>((l * M + k) * H + j)];
            pd += hdy[static_cast<std::size_t>((l * r + i) * M + k)] * hw2[static_cast<std::size_t>((l * H + j) * M + k)];
          }
          const auto at = static_cast<std::size_t>((l * r + i) * H + j);
          want_m[at] = pm;
          want_a[at] = gelu(pm);
          want_da[at] = pd * dgelu(gm[at]);  // the epilogue reads T_M as the device holds it
        }
    const auto f = [](const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); };
    EXPECT_TRUE(all_close("T_M", f(gm), want_m, rtol));
    EXPECT_TRUE(all_close("A", f(ga), want_a, rtol));
    EXPECT_TRUE(all_close("dT_M", f(gda), want_da, rtol));
  }
}

INSTANTIATE_TEST_SUITE_P(DTypes, FusedEpilogue, ::testing::Values(DType::f32, DType::bf16),
                         [](const auto& tp) { return std::string(dtype_name(tp.param)); });

}  // namespace
}  // namespace moelab
