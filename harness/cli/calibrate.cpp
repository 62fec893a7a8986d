// harness/cli/calibrate.cpp — `moelab calibrate`: measure the device this process runs on and
// write a calibration profile (schema moelab.profile/1) that the sim backend can use instead
// of datasheet curves, and from which scripts/fit_gemm_efficiency.py --profile fits a GEMM
// calibration (docs/PERFORMANCE.md, "Fitting a calibration from moelab calibrate").
//
//   moelab calibrate --backend cuda --out experiments/profiles/h100.json
//   moelab calibrate --backend cpu --out /tmp/cpu-profile.json --quick
//
// Measured, each as the median of several repetitions after a warm-up:
//   gemm        single GEMMs over a grid of shapes (the paper models' expert shapes) in every
//               dtype the backend supports, through Backend::time_bare_gemms (cuBLAS / cblas)
//   gemm_paths  the experts' grouped call (E equal problems, fwd / dgrad / wgrad) against rows
//               per expert, on each library path the backend has (cuda: a loop of
//               cublasGemmEx, cublasGemmStridedBatchedEx, cublasGemmGroupedBatchedEx; cpu: the
//               loop), as the crossover table the cuda backend chooses its path by
//               (harness/runtime/gemm_paths.hpp; `moelab run --backend cuda --profile FILE`)
//   copies      pinned host->device, device->host and device->device against size (the largest
//               size's rates are the profile's h2d_bw, d2h_bw and d2d_bw)
//   overheads   kernel launch (back-to-back tiny kernels), event record, a host
//               synchronisation's round trip, a cross-stream wait
//   interference  a large GEMM beside pinned copies and the copies beside it: the rate each
//               keeps (alone / together)
//   dispatch    the single-device dispatch path: the token permutation (scatter to expert
//               order) and the exchange of one rank with itself, against size
//   activations each activation kernel (GeLU, ReLU, tanh GeLU) forward and backward, per dtype,
//               against size (the profile's elementwise bandwidth: the fp32 GeLU forward's largest)
//   epilogues   where the backend fuses the tanh GeLU into a GEMM: one expert's FC1 and FC2
//               dgrad as the GEMM alone, the GEMM then the activation, and the fused op (a
//               shape the library runs unfused is left out, with a note on stderr)
//   comm        with several ranks (mpirun), all-to-all-v of several sizes: recorded for
//               reference (the cluster models keep the link figures)
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/cli/run_common.hpp"
#include "harness/comm/world.hpp"
#include "harness/metrics/results.hpp"
#include "harness/runtime/error.hpp"
#include "harness/runtime/gemm_paths.hpp"
#include "harness/sim/cluster.hpp"
#ifdef MOELAB_HAVE_CUDA
#include "harness/backends/cuda/cuda_backend.hpp"
#endif

namespace moelab::cli {

using nlohmann::json;

namespace {

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <class F>
double time_it(Backend& b, int reps, F&& body) {
  body();
  b.synchronize();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const double t0 = b.now();
    body();
    b.synchronize();
    t.push_back(b.now() - t0);
  }
  return median_of(t);
}

// Median seconds of one `body()`: after a warm-up, one timed call estimates its length, and
// each of `reps` repetitions then runs it back to back as often as fills `target` seconds, so
// that calls of a few microseconds are not lost in the host's synchronisation round trip.
template <class F>
double time_per_call(Backend& b, int reps, double target, F&& body) {
  body();
  b.synchronize();
  double t0 = b.now();
  body();
  b.synchronize();
  const double one = std::max(b.now() - t0, 1e-9);
  const int iters = static_cast<int>(std::clamp(std::ceil(target / one), 1.0, 2000.0));
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    t0 = b.now();
    for (int i = 0; i < iters; ++i) body();
    b.synchronize();
    t.push_back((b.now() - t0) / iters);
  }
  b.clear_timeline();  // thousands of timed ops: nothing reads them
  return median_of(t);
}

// GEMM operands get values, not zeros: a GPU multiplying zeros draws less power and may clock
// higher than it does on a model's data. A block of uniform(-1, 1) values is uploaded once and
// copied on the device over the rest of the tensor (doubling), so that large operands cost a
// few device copies rather than host work.
void fill_values(Backend& b, Stream& s, Tensor& t) {
  const std::int64_t n = t.numel();
  if (n == 0) return;
  Tensor flat = t.reshape({n});
  const std::int64_t block = std::min<std::int64_t>(n, std::int64_t{1} << 20);
  // Drawn once per process (the same values every call: a fixed seed); calibrate fills some
  // 700 operands, and drawing 2^20 values for each kept the GPU idle for seconds.
  static const std::vector<float> values = [] {
    std::vector<float> v(std::size_t{1} << 20);
    std::mt19937 rng(20261124);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (float& x : v) x = u(rng);
    return v;
  }();
  Tensor first = flat.rows(0, block);
  b.upload(std::span<const float>(values.data(), static_cast<std::size_t>(block)), first);
  b.synchronize();
  for (std::int64_t done = block; done < n;) {
    const std::int64_t len = std::min(done, n - done);
    Tensor dst = flat.rows(done, len);
    b.copy(s, flat.rows(0, len), dst);
    done += len;
  }
}

struct Plan {
  bool cpu = false, quick = false;
  int reps = 7;
  bool print = true;  // rank 0 prints what it measures
};

std::string precision_of(DType t, bool tf32) { return t == DType::bf16 ? "bf16" : (tf32 ? "tf32" : "fp32"); }

// ---- the experts' grouped call on each GEMM path ---------------------------------------------
// One call of E equal problems, the layer's packed layout: the tokens of expert e are rows
// [e·R, (e+1)·R) of one buffer, the weights [E, d_model, d_hidden] at fixed strides, so every
// call is one strided batch (docs/GPU.md, "The layer's layout"). fwd: X_e·W_e; dgrad:
// dY_e·W_eᵀ; wgrad: X_eᵀ·dY_e accumulated into the gradient (β = 1), as a model run and a later
// partition issue it (a layer run's first wgrad call after its zero_grad has β = 0).
json measure_gemm_paths(Backend& b, Stream& s, const Plan& plan, const std::string& device) {
  struct Width {
    std::int64_t d_model, d_hidden;
  };
  std::vector<Width> widths = plan.cpu ? std::vector<Width>{{256, 1024}, {512, 2048}} : std::vector<Width>{{768, 3072}, {2048, 8192}};
  std::vector<std::int64_t> experts = plan.cpu ? std::vector<std::int64_t>{4, 16} : std::vector<std::int64_t>{8, 64};
  const std::int64_t min_rows = plan.cpu ? 16 : 64, max_rows = plan.cpu ? 256 : 16384;
  const std::int64_t max_tokens = plan.cpu ? 2048 : 131072;  // E · rows per call
  std::vector<std::pair<DType, bool>> precisions;
  if (b.supports(DType::bf16)) precisions.push_back({DType::bf16, false});
  precisions.push_back({DType::f32, !plan.cpu});  // cuda: fp32 on TF32 tensor cores; cpu: exact fp32
  if (plan.quick) {
    widths.resize(1);
    experts.resize(1);
    precisions.resize(1);
  }
  std::vector<GemmPath> paths = {GemmPath::loop};
#ifdef MOELAB_HAVE_CUDA
  if (is_cuda_backend(b)) paths = {GemmPath::loop, GemmPath::strided_batched, GemmPath::grouped};
#endif
  const bool tf32_before = b.allow_tf32();
  json points = json::array();
  for (auto [dtype, tf32] : precisions) {
    b.set_allow_tf32(tf32);
    const std::string prec = precision_of(dtype, tf32);
    for (const Width& w : widths)
      for (std::int64_t E : experts)
        for (std::int64_t R = min_rows; R <= max_rows && E * R <= max_tokens; R *= plan.quick ? 4 : 2) {
          const std::int64_t M = w.d_model, H = w.d_hidden;
          Tensor X = b.empty({E * R, M}, dtype, MemCategory::buffers, s), Y = b.empty({E * R, H}, dtype, MemCategory::buffers, s),
                 DX = b.empty({E * R, M}, dtype, MemCategory::buffers, s), W = b.empty({E, M, H}, dtype, MemCategory::buffers, s),
                 DW = b.empty({E, M, H}, dtype, MemCategory::buffers, s);
          for (Tensor* t : {&X, &Y, &DX, &W, &DW}) fill_values(b, s, *t);
          for (GemmOp op : {GemmOp::fwd, GemmOp::dgrad, GemmOp::wgrad}) {
            std::vector<GemmProblem> problems;
            for (std::int64_t e = 0; e < E; ++e) {
              const Tensor x = X.rows(e * R, R), y = Y.rows(e * R, R), dx = DX.rows(e * R, R), we = W.select(e), dwe = DW.select(e);
              if (op == GemmOp::fwd) problems.push_back({false, false, R, H, M, x, we, y, 1.0f, 0.0f});
              if (op == GemmOp::dgrad) problems.push_back({false, true, R, M, H, y, we, dx, 1.0f, 0.0f});
              if (op == GemmOp::wgrad) problems.push_back({true, false, M, H, R, x, y, dwe, 1.0f, 1.0f});
            }
            const double flops = 2.0 * static_cast<double>(E * R) * static_cast<double>(M * H);
            json tflops = json::object();  // a path not measured (none here, or refused) is absent
            for (GemmPath path : paths) {
              const std::string name = std::string("calibrate.") + gemm_path_name(path);
#ifdef MOELAB_HAVE_CUDA
              std::int64_t before = 0;
              if (is_cuda_backend(b)) {
                cuda_force_gemm_path(b, path);
                for (const auto& u : cuda_gemm_path_uses(b))
                  if (u.op == name && u.path == path) before = u.calls;
              }
#endif
              const double sec = time_per_call(b, plan.reps, plan.cpu ? 0.02 : 2e-3,
                                               [&] { b.grouped_gemm(s, problems, name.c_str()); });
              bool ran = true;
#ifdef MOELAB_HAVE_CUDA
              if (is_cuda_backend(b)) {  // a path the library refused ran as the loop: not this path's figure
                std::int64_t after = 0;
                for (const auto& u : cuda_gemm_path_uses(b))
                  if (u.op == name && u.path == path) after = u.calls;
                ran = after > before;
                cuda_force_gemm_path(b, std::nullopt);
              }
#endif
              if (ran) tflops[gemm_path_name(path)] = flops / sec / 1e12;
            }
            points.push_back({{"precision", prec}, {"op", gemm_op_name(op)}, {"d_model", M}, {"d_hidden", H},
                              {"experts", E}, {"rows", R}, {"tflops", tflops}});
            const auto rate = [&](const char* k) { return tflops.contains(k) ? tflops[k].get<double>() : 0.0; };
            if (plan.print) std::printf("paths %-4s %-5s %5lld/%-5lld E=%-3lld rows %5lld  loop %8.3f  strided %8.3f  grouped %8.3f TFLOP/s\n",
                        prec.c_str(), gemm_op_name(op), static_cast<long long>(M), static_cast<long long>(H),
                        static_cast<long long>(E), static_cast<long long>(R), rate("loop"), rate("strided_batched"),
                        rate("grouped"));
          }
        }
  }
  b.set_allow_tf32(tf32_before);
  const GemmPathTable defaults;
  return {{"source", "moelab calibrate --backend " + b.name() + " on " + device + " at commit " + build_commit() +
                         ": one call of E equal problems per point (the layer's packed layout, wgrad with beta = 1), "
                         "each path forced in turn, median of " + std::to_string(plan.reps) +
                         " repetitions; a path is absent where the backend has no such path or the library refused it"},
          {"max_padding_waste", defaults.max_padding_waste},
          {"tie_tolerance", defaults.tie_tolerance},
          {"points", points}};
}

// ---- copies against size -----------------------------------------------------------------------
json measure_copies(Backend& b, Stream& s, const Plan& plan) {
  std::vector<std::int64_t> sizes = plan.cpu ? std::vector<std::int64_t>{1 << 16, 1 << 20, 1 << 24}
                                             : std::vector<std::int64_t>{1 << 16, 1 << 20, 1 << 24, 1 << 26, 1 << 28};
  if (plan.quick) sizes = {sizes.front(), sizes.back()};  // the largest gives the profile's rates
  json out = json::array();
  for (std::int64_t bytes : sizes) {
    const std::int64_t elems = bytes / 4;
    Tensor dev = b.empty({elems}, DType::f32, MemCategory::buffers, s), dev2 = b.empty({elems}, DType::f32, MemCategory::buffers, s);
    Tensor host = b.empty({elems}, DType::f32, MemCategory::buffers, s, MemSpace::host_pinned);
    for (Tensor* x : {&dev, &dev2, &host}) b.fill_zero(s, *x);
    const double target = plan.cpu ? 0.02 : 2e-3;
    const double h2d = time_per_call(b, plan.reps, target, [&] { b.copy(s, host, dev); });
    const double d2h = time_per_call(b, plan.reps, target, [&] { b.copy(s, dev, host); });
    const double d2d = time_per_call(b, plan.reps, target, [&] { b.copy(s, dev, dev2); });
    for (auto [kind, sec] : {std::pair{"h2d", h2d}, std::pair{"d2h", d2h}, std::pair{"d2d", d2d}})
      out.push_back({{"kind", kind}, {"bytes", bytes}, {"seconds", sec}});
    if (plan.print) std::printf("copies %9lld B  h2d %7.2f GB/s  d2h %7.2f GB/s  d2d %7.2f GB/s (one way)\n", static_cast<long long>(bytes),
                static_cast<double>(bytes) / h2d / 1e9, static_cast<double>(bytes) / d2h / 1e9,
                static_cast<double>(bytes) / d2d / 1e9);
  }
  return out;
}

// ---- host-side overheads -------------------------------------------------------------------------
json measure_overheads(Backend& b, Stream& s, const Plan& plan, double launch) {
  Tensor tiny = b.empty({1}, DType::f32, MemCategory::buffers, s);
  b.fill_zero(s, tiny);
  Stream& other = b.create_stream(StreamRole::aux, "calibrate.aux");
  auto ev = b.create_event();
  const int n = 200;
  // Issuing n event records on an idle stream, per record.
  const double record = time_it(b, plan.reps, [&] {
                          for (int i = 0; i < n; ++i) b.record(*ev, s);
                        }) / n;
  // A tiny op issued and waited for by the host: the round trip of one synchronisation.
  std::vector<double> rt;
  for (int r = 0; r < std::max(plan.reps, 20); ++r) {
    const double t0 = b.now();
    b.fill_zero(s, tiny);
    b.synchronize(s);
    rt.push_back(b.now() - t0);
  }
  // A record on one stream and a wait on another, then a tiny op there: per pair.
  const double wait = time_it(b, plan.reps, [&] {
                        for (int i = 0; i < n; ++i) {
                          b.record(*ev, s);
                          b.wait(other, *ev);
                          b.fill_zero(other, tiny);
                        }
                      }) / n -
                      launch;
  b.clear_timeline();
  if (plan.print) std::printf("overheads  launch %.2f us, event record %.2f us, sync round trip %.2f us, cross-stream wait %.2f us\n",
              launch * 1e6, record * 1e6, median_of(rt) * 1e6, std::max(wait, 0.0) * 1e6);
  return {{"launch_latency", launch}, {"event_record", record}, {"sync_roundtrip", median_of(rt)},
          {"stream_wait", std::max(wait, 0.0)}};
}

// ---- copy / GEMM interference ----------------------------------------------------------------------
// The victim's work runs alone, then beside an aggressor issued at the same moment on another
// stream and sized to outlast it; the victim's rate beside the aggressor over its rate alone is
// the factor the sim's interference matrix holds (harness/sim/cluster.hpp, Interference).
json measure_interference(Backend& b, Stream& s, const Plan& plan) {
  const DType t = b.supports(DType::bf16) ? DType::bf16 : DType::f32;
  const std::int64_t d = plan.cpu ? 384 : 8192;
  const std::int64_t copy_bytes = plan.cpu ? (8 << 20) : (std::int64_t{256} << 20);
  Tensor A = b.empty({d, d}, t, MemCategory::buffers, s), B = b.empty({d, d}, t, MemCategory::buffers, s),
         C = b.empty({d, d}, t, MemCategory::buffers, s);
  Tensor dev = b.empty({copy_bytes / 4}, DType::f32, MemCategory::buffers, s);
  Tensor host = b.empty({copy_bytes / 4}, DType::f32, MemCategory::buffers, s, MemSpace::host_pinned);
  for (Tensor* x : {&A, &B, &C}) fill_values(b, s, *x);
  for (Tensor* x : {&dev, &host}) b.fill_zero(s, *x);
  Stream& h2d = b.create_stream(StreamRole::h2d, "calibrate.h2d");
  Stream& d2h = b.create_stream(StreamRole::d2h, "calibrate.d2h");
  const GemmProblem p{false, false, d, d, d, A, B, C, 1.0f, 0.0f};
  const auto gemm = [&] { b.grouped_gemm(s, {&p, 1}, "calibrate.gemm"); };
  const auto copy_on = [&](Stream& cs, bool to_device) { to_device ? b.copy(cs, host, dev) : b.copy(cs, dev, host); };
  const int reps = std::max(3, plan.reps / 2);
  const double t_gemm = time_per_call(b, reps, plan.cpu ? 0.05 : 0.01, gemm);
  json out = json::array();
  for (bool to_device : {true, false}) {
    Stream& cs = to_device ? h2d : d2h;
    const char* cname = to_device ? "h2d" : "d2h";
    const double t_copy = time_per_call(b, reps, plan.cpu ? 0.05 : 0.01, [&] { copy_on(cs, to_device); });
    // victim compute: n_g GEMMs beside copies that last ~1.5x as long
    const int n_g = static_cast<int>(std::clamp(std::ceil((plan.cpu ? 0.1 : 0.05) / t_gemm), 2.0, 500.0));
    const int n_c_for_g = static_cast<int>(std::ceil(1.5 * n_g * t_gemm / t_copy)) + 1;
    // victim copy: n_c copies beside GEMMs that last ~1.5x as long
    const int n_c = static_cast<int>(std::clamp(std::ceil((plan.cpu ? 0.1 : 0.05) / t_copy), 2.0, 500.0));
    const int n_g_for_c = static_cast<int>(std::ceil(1.5 * n_c * t_copy / t_gemm)) + 1;
    std::vector<double> gemm_together, copy_together;
    for (int r = 0; r < reps; ++r) {
      b.synchronize();
      double t0 = b.now();
      for (int i = 0; i < n_c_for_g; ++i) copy_on(cs, to_device);
      for (int i = 0; i < n_g; ++i) gemm();
      b.synchronize(s);
      gemm_together.push_back((b.now() - t0) / n_g);
      b.synchronize();
      t0 = b.now();
      for (int i = 0; i < n_g_for_c; ++i) gemm();
      for (int i = 0; i < n_c; ++i) copy_on(cs, to_device);
      b.synchronize(cs);
      copy_together.push_back((b.now() - t0) / n_c);
      b.synchronize();
      b.clear_timeline();
    }
    const double g2 = median_of(gemm_together), c2 = median_of(copy_together);
    out.push_back({{"victim", "compute"}, {"aggressor", cname}, {"alone_s", t_gemm}, {"together_s", g2}, {"factor", t_gemm / g2}});
    out.push_back({{"victim", cname}, {"aggressor", "compute"}, {"alone_s", t_copy}, {"together_s", c2}, {"factor", t_copy / c2}});
    if (plan.print) std::printf("interference  GEMM beside %s keeps %.3f of its rate; %s beside GEMM keeps %.3f\n", cname, t_gemm / g2, cname,
                t_copy / c2);
  }
  return out;
}

// ---- the single-device dispatch path ---------------------------------------------------------------
// The layer's dispatch on one device: the gate's slots scatter the tokens into expert order
// (Backend::permute), then the exchange of a rank with itself (the world communicator at one
// rank); the combine gathers them back (unpermute). Random slots, as routing makes them.
json measure_dispatch(Backend& b, Stream& s, const Plan& plan, Communicator& comm) {
  const DType t = b.supports(DType::bf16) ? DType::bf16 : DType::f32;
  const std::int64_t width = plan.cpu ? 256 : 2048;
  std::vector<std::int64_t> tokens = plan.cpu ? std::vector<std::int64_t>{512, 4096} : std::vector<std::int64_t>{1024, 8192, 65536};
  if (plan.quick) tokens.resize(1);
  json out = json::array();
  std::mt19937 rng(12345);
  for (std::int64_t T : tokens) {
    Tensor x = b.empty({T, width}, t, MemCategory::buffers, s), y = b.empty({T, width}, t, MemCategory::buffers, s);
    Tensor slot = b.empty({T, 1}, DType::i32, MemCategory::buffers, s), w = b.empty({T, 1}, DType::f32, MemCategory::buffers, s);
    for (Tensor* z : {&x, &y, &w}) b.fill_zero(s, *z);
    std::vector<std::int32_t> perm(static_cast<std::size_t>(T));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    b.upload_i32(perm, slot);
    const double bytes = 2.0 * static_cast<double>(x.nbytes());
    const double target = plan.cpu ? 0.02 : 2e-3;
    const double permute = time_per_call(b, plan.reps, target, [&] { b.permute(s, x, slot, y); });
    const double unpermute = time_per_call(b, plan.reps, target, [&] { b.unpermute(s, y, slot, w, x); });
    out.push_back({{"op", "permute"}, {"rows", T}, {"width", width}, {"dtype", dtype_name(t)}, {"bytes", bytes}, {"seconds", permute}});
    out.push_back({{"op", "unpermute"}, {"rows", T}, {"width", width}, {"dtype", dtype_name(t)}, {"bytes", bytes}, {"seconds", unpermute}});
    if (plan.print) std::printf("dispatch %6lld x %lld %s  permute %7.2f GB/s  unpermute %7.2f GB/s\n", static_cast<long long>(T),
                static_cast<long long>(width), dtype_name(t), bytes / permute / 1e9, bytes / unpermute / 1e9);
  }
  if (comm.size() == 1) {
    std::vector<std::int64_t> sizes = plan.cpu ? std::vector<std::int64_t>{1 << 16, 1 << 22} : std::vector<std::int64_t>{1 << 16, 1 << 20, 1 << 24, 1 << 27};
    if (plan.quick) sizes.resize(1);
    for (std::int64_t bytes : sizes) {
      Tensor a = b.empty({bytes / 4}, DType::f32, MemCategory::buffers, s), c = b.empty({bytes / 4}, DType::f32, MemCategory::buffers, s);
      b.fill_zero(s, a);
      const Segment seg{0, 0, bytes / 4};
      const double sec = time_per_call(b, plan.reps, plan.cpu ? 0.02 : 2e-3,
                                       [&] { comm.all_to_all_v(s, a, {&seg, 1}, c, {&seg, 1}); });
      out.push_back({{"op", "exchange"}, {"ranks", 1}, {"bytes", bytes}, {"seconds", sec}});
      if (plan.print) std::printf("dispatch exchange with itself %9lld B  %.2f us  %.2f GB/s\n", static_cast<long long>(bytes), sec * 1e6,
                  static_cast<double>(bytes) / sec / 1e9);
    }
  }
  return out;
}

// ---- activations ----------------------------------------------------------------------------------
// Each activation kernel (the erf GeLU, ReLU, the tanh GeLU) forward (in -> out) and backward
// (in, d_out -> d_in), per dtype, on uniform values in [-1, 1) at a few sizes: the sim prices
// an activation at the elements/s the fit draws from these where it is slower than moving its
// bytes (on a CPU the exact-erf GeLU is bound by arithmetic; docs/PERFORMANCE.md, "Kernel rates
// in the sim").
json measure_activations(Backend& b, Stream& s, const Plan& plan) {
  std::vector<std::int64_t> sizes = plan.cpu ? std::vector<std::int64_t>{1 << 20, 1 << 22, 1 << 24}
                                             : std::vector<std::int64_t>{1 << 22, 1 << 24, 1 << 26};
  if (plan.quick) sizes = {sizes.front(), sizes.back()};
  std::vector<DType> types = {DType::f32};
  if (b.supports(DType::bf16)) types.push_back(DType::bf16);
  const double target = plan.cpu ? 0.02 : 2e-3;
  json out = json::array();
  for (DType t : types)
    for (std::int64_t n : sizes) {
      Tensor in = b.empty({n}, t, MemCategory::buffers, s), d_out = b.empty({n}, t, MemCategory::buffers, s);
      Tensor res = b.empty({n}, t, MemCategory::buffers, s);
      for (Tensor* x : {&in, &d_out}) fill_values(b, s, *x);
      for (Activation a : {Activation::gelu, Activation::relu, Activation::gelu_tanh}) {
        const double fwd = time_per_call(b, plan.reps, target, [&] { b.activation_forward(s, a, in, res); });
        const double bwd = time_per_call(b, plan.reps, target, [&] { b.activation_backward(s, a, in, d_out, res); });
        for (const auto& [dir, sec] : {std::pair<const char*, double>{"forward", fwd}, {"backward", bwd}})
          out.push_back({{"activation", activation_name(a)}, {"direction", dir}, {"dtype", dtype_name(t)},
                         {"elements", n}, {"seconds", sec}});
        if (plan.print)
          std::printf("activation %-9s %s %9lld elements  forward %8.3f Gelem/s  backward %8.3f Gelem/s\n",
                      activation_name(a), dtype_name(t), static_cast<long long>(n), static_cast<double>(n) / fwd / 1e9,
                      static_cast<double>(n) / bwd / 1e9);
      }
    }
  b.clear_timeline();
  return out;
}

// ---- fused epilogues --------------------------------------------------------------------------
// Where the backend fuses the tanh GeLU into a GEMM (Backend::fuses_gemm_epilogue; docs/GPU.md,
// "Fused epilogues"): one expert's FC1 (X·W1, then GeLU) and FC2 dgrad (dY·W2ᵀ, then GeLU'), each
// timed three ways at a few rows: the GEMM alone, the unfused pair (the GEMM, then the activation
// op), and the fused op. What the fusion saves per call, and how close the fused op comes to its
// GEMM alone (the sim prices it as the GEMM plus its auxiliary matrix's bytes: docs/PERFORMANCE.md,
// "Fused epilogues in the sim").
json measure_epilogues(Backend& b, Stream& s, const Plan& plan) {
  json out = json::array();
  const Activation act = Activation::gelu_tanh;
  const std::int64_t M = plan.cpu ? 256 : 2048, H = plan.cpu ? 1024 : 8192;
  std::vector<std::int64_t> rows = plan.cpu ? std::vector<std::int64_t>{256, 1024} : std::vector<std::int64_t>{1024, 8192};
  if (plan.quick) rows = {rows.front()};
  const double target = plan.cpu ? 0.02 : 2e-3;
  std::vector<DType> types = {DType::f32};
  if (b.supports(DType::bf16)) types.insert(types.begin(), DType::bf16);
  for (DType t : types) {
    if (!b.fuses_gemm_epilogue(act, t)) continue;
    Tensor w1 = b.empty({M, H}, t, MemCategory::buffers, s), w2 = b.empty({H, M}, t, MemCategory::buffers, s);
    fill_values(b, s, w1);
    fill_values(b, s, w2);
    for (std::int64_t r : rows) {
      Tensor x = b.empty({r, M}, t, MemCategory::buffers, s), dy = b.empty({r, M}, t, MemCategory::buffers, s);
      Tensor pre = b.empty({r, H}, t, MemCategory::buffers, s), y = b.empty({r, H}, t, MemCategory::buffers, s);
      for (Tensor* v : {&x, &dy}) fill_values(b, s, *v);
      GemmProblem fwd{false, false, r, H, M, x, w1, pre, 1, 0};
      GemmProblem dgrad{false, true, r, H, M, dy, w2, y, 1, 0};
      GemmProblem fwd_fused = fwd, dgrad_fused = dgrad;
      fwd_fused.c = y;
      fwd_fused.aux = pre;
      dgrad_fused.aux = pre;
      b.gemm(s, fwd, "fc1");  // pre = X·W1: the dgrad's saved pre-activation
      for (const bool backward : {false, true}) {
        const GemmProblem& plain = backward ? dgrad : fwd;
        const GemmProblem& fused = backward ? dgrad_fused : fwd_fused;
        const auto run_fused = [&] {
          b.grouped_gemm_epilogue(s, {&fused, 1}, backward ? GemmEpilogue::dact : GemmEpilogue::act_aux, act, "fused");
        };
        // A shape the library has no fused kernel for runs unfused (the cuda backend counts it,
        // and its op detail says "k of n unfused"): that is no sample of the fused op, so it is
        // left out.
        b.clear_timeline();
        [[maybe_unused]] std::int64_t unfused_before = 0;
#ifdef MOELAB_HAVE_CUDA
        if (is_cuda_backend(b)) unfused_before = cuda_unfused_epilogues(b);
#endif
        run_fused();
        b.synchronize();
        bool ran_unfused = false;
#ifdef MOELAB_HAVE_CUDA
        if (is_cuda_backend(b)) ran_unfused = cuda_unfused_epilogues(b) > unfused_before;
#endif
        std::string refused = "no fused kernel";
        for (const OpRecord& rec : b.timeline())
          if (rec.name == "fused" && !rec.detail.empty()) refused = rec.detail;
        if (ran_unfused) {
          std::fprintf(stderr, "calibrate: epilogue %s %s %lld rows not sampled: it did not run fused (%s)\n",
                       backward ? "dgrad" : "fwd", dtype_name(t), static_cast<long long>(r), refused.c_str());
          continue;
        }
        const double gemm_s = time_per_call(b, plan.reps, target, [&] { b.gemm(s, plain, "gemm"); });
        const double unfused_s = time_per_call(b, plan.reps, target, [&] {
          b.gemm(s, plain, "gemm");
          if (backward)
            b.activation_backward(s, act, pre, y, y);
          else
            b.activation_forward(s, act, pre, y);
        });
        const double fused_s = time_per_call(b, plan.reps, target, run_fused);
        out.push_back({{"op", backward ? "dgrad" : "fwd"}, {"activation", activation_name(act)}, {"dtype", dtype_name(t)},
                       {"rows", r}, {"d_model", M}, {"d_hidden", H}, {"gemm_s", gemm_s}, {"unfused_s", unfused_s},
                       {"fused_s", fused_s}});
        if (plan.print)
          std::printf("epilogue %-5s %s %6lld rows  gemm %8.3f ms  gemm+%s %8.3f ms  fused %8.3f ms\n",
                      backward ? "dgrad" : "fwd", dtype_name(t), static_cast<long long>(r), gemm_s * 1e3,
                      activation_name(act), unfused_s * 1e3, fused_s * 1e3);
      }
    }
  }
  b.clear_timeline();
  return out;
}

}  // namespace

int calibrate_command(const std::vector<std::string>& args) {
  std::string backend_name, out, name;
  bool quick = false;
  for (std::size_t i = 0; i < args.size(); ++i) {
    auto value = [&]() -> std::string {
      if (i + 1 >= args.size()) throw ConfigError(args[i] + " needs a value (see moelab calibrate --help)");
      return args[++i];
    };
    if (args[i] == "--backend")
      backend_name = value();
    else if (args[i] == "--out")
      out = value();
    else if (args[i] == "--name")
      name = value();
    else if (args[i] == "--quick")
      quick = true;
    else if (args[i] == "--help" || args[i] == "-h") {
      std::puts(
          "usage: moelab calibrate --backend cpu|cuda --out FILE [--name NAME] [--quick]\n\n"
          "Measures GEMM throughput over a grid of shapes and dtypes, the experts' grouped GEMM call\n"
          "on each library path against rows per expert, copy bandwidth against size, launch, event\n"
          "and synchronisation overheads, copy/GEMM interference, the single-device dispatch path\n"
          "(permutation and the exchange with itself), each activation's rate forward and backward\n"
          "(the GeLU's gives the elementwise bandwidth), the fused GEMM epilogue against the GEMM and\n"
          "the GEMM-then-activation pair (where the backend fuses), all-to-all-v under mpirun, and\n"
          "writes a calibration profile for `moelab run --backend sim --profile FILE`,\n"
          "`moelab run --backend cuda --profile FILE` (its GEMM-path table) and\n"
          "scripts/fit_gemm_efficiency.py --profile FILE (a fitted GEMM calibration).");
      return 0;
    } else {
      throw ConfigError("unknown option \"" + shown(args[i]) + "\" for moelab calibrate (see moelab calibrate --help)");
    }
  }
  if (backend_name.empty()) throw ConfigError("missing --backend cpu|cuda");
  if (backend_name == "sim") throw ConfigError("--backend sim: calibrate measures a real device (cpu or cuda)");
  if (out.empty()) throw ConfigError("missing --out FILE");
  // The profile is written after minutes of measuring: its path is checked (and locked, as
  // `moelab run` does) before any of it, on every rank alike.
  RunOptions paths;
  paths.out = out;
  std::string local_error;
  try {
    RunOutputs::check(paths);
  } catch (const ConfigError& e) {
    if (world_size() == 1) throw;
    local_error = e.what();
  }
  auto b = make_backend(backend_name);
  b->set_rank(world_rank());
  auto comm = make_world_communicator(*b);
  RunOutputs outputs;
  if (comm->rank() == 0 && local_error.empty()) {
    try {
      outputs.lock(paths);
    } catch (const ConfigError& e) {
      if (comm->size() == 1) throw;
      local_error = e.what();
    }
  }
  if (comm->size() > 1) agree_on_errors(*comm, local_error);
  Stream& s = b->default_stream();
  const int reps = quick ? 3 : 7;
  const bool cpu = b->name() == "cpu";

  // ---- GEMMs: experts' shapes [rows, d_model] x [d_model, d_hidden] and back ----------------
  std::vector<std::int64_t> rows = cpu ? std::vector<std::int64_t>{64, 256, 1024}
                                       : std::vector<std::int64_t>{128, 512, 2048, 8192, 16384};
  std::vector<std::pair<std::int64_t, std::int64_t>> mk =
      cpu ? std::vector<std::pair<std::int64_t, std::int64_t>>{{256, 1024}, {1024, 256}, {512, 2048}}
          : std::vector<std::pair<std::int64_t, std::int64_t>>{{768, 3072}, {3072, 768},   {1024, 4096},
                                                               {4096, 1024}, {2048, 8192}, {8192, 2048}};
  if (quick) {
    rows.resize(2);
    mk.resize(2);
  }
  std::vector<DType> dtypes = {DType::f32};
  if (b->supports(DType::bf16)) dtypes.push_back(DType::bf16);
  json gemm = json::array();
  // Each expert GEMM appears in two shapes: [rows, k] x [k, n] (forward, data gradients) and
  // [k, rows] x [rows, n] (weight gradients, inner dimension = rows).
  std::vector<std::array<std::int64_t, 3>> shapes;
  for (auto r : rows)
    for (auto [k, n] : mk) {
      shapes.push_back({r, n, k});
      shapes.push_back({k, n, r});
    }
  for (DType t : dtypes)
    for (auto [m, n, k] : shapes) {
        Tensor A = b->empty({m, k}, t, MemCategory::buffers, s), B = b->empty({k, n}, t, MemCategory::buffers, s),
               C = b->empty({m, n}, t, MemCategory::buffers, s);
        for (Tensor* x : {&A, &B, &C}) fill_values(*b, s, *x);
        const GemmProblem p{false, false, m, n, k, A, B, C, 1.0f, 0.0f};
        const double sec = b->time_bare_gemms({&p, 1}, reps);
        gemm.push_back({{"m", m}, {"n", n}, {"k", k}, {"dtype", dtype_name(t)}, {"seconds", sec}});
        if (comm->rank() == 0)
          std::printf("gemm %-5s %6lld x %5lld x %5lld  %9.3f ms  %8.2f TFLOP/s\n", dtype_name(t),
                      static_cast<long long>(m), static_cast<long long>(k), static_cast<long long>(n), sec * 1e3,
                      2.0 * static_cast<double>(m * n * k) / sec / 1e12);
      }

  // ---- copies against size; the profile's scalar rates from the largest ------------------------
  // Rank 0 alone prints; every rank measures its own device alike (the profile is rank 0's).
  const Plan plan{cpu, quick, reps, comm->rank() == 0};
  const json copies = measure_copies(*b, s, plan);
  double h2d = 0, d2h = 0, d2d = 0;  // bytes/s; d2d counts bytes read + written
  for (const json& c : copies) {
    const double rate = c["bytes"].get<double>() / c["seconds"].get<double>();
    const std::string kind = c["kind"];
    (kind == "h2d" ? h2d : kind == "d2h" ? d2h : d2d) = kind == "d2d" ? 2.0 * rate : rate;  // the sweep ends largest
  }
  Tensor tiny = b->empty({1}, DType::f32, MemCategory::buffers, s);
  const int launches = 200;
  const double launch = time_it(*b, reps, [&] {
                          for (int i = 0; i < launches; ++i) b->fill_zero(s, tiny);
                        }) /
                        launches;
  if (comm->rank() == 0)
    std::printf("copies  h2d %.1f GB/s, d2h %.1f GB/s, d2d %.1f GB/s; launch %.2f us\n", h2d / 1e9, d2h / 1e9,
                d2d / 1e9, launch * 1e6);

  // ---- the GEMM paths, overheads, interference, dispatch ----------------------------------------
  const json gemm_paths = measure_gemm_paths(*b, s, plan, b->device_name());
  const json overheads = measure_overheads(*b, s, plan, launch);
  const json interference = measure_interference(*b, s, plan);
  const json dispatch = measure_dispatch(*b, s, plan, *comm);
  const json activations = measure_activations(*b, s, plan);
  const json epilogues = measure_epilogues(*b, s, plan);
  // The profile's elementwise bandwidth: the fp32 GeLU forward at its largest size (one read,
  // one write of 4 bytes per element).
  double elementwise = 0;
  std::int64_t at = 0;
  for (const json& a : activations)
    if (a["activation"] == "gelu" && a["direction"] == "forward" && a["dtype"] == "fp32" && a["elements"].get<std::int64_t>() >= at) {
      at = a["elements"].get<std::int64_t>();
      elementwise = 8.0 * static_cast<double>(at) / a["seconds"].get<double>();
    }

  // ---- collectives (several ranks) ------------------------------------------------------------
  json collectives = json::array();
  if (comm->size() > 1) {
    for (std::int64_t per_peer : {std::int64_t{1} << 12, std::int64_t{1} << 16, std::int64_t{1} << 20}) {
      const int n = comm->size();
      Tensor a = b->empty({per_peer * n}, DType::f32, MemCategory::buffers, s);
      Tensor c = b->empty({per_peer * n}, DType::f32, MemCategory::buffers, s);
      b->fill_zero(s, a);
      std::vector<Segment> segs;
      for (int p = 0; p < n; ++p) segs.push_back({p, p * per_peer, per_peer});
      comm->barrier();
      const double t = comm->all_reduce_max(time_it(*b, reps, [&] { comm->all_to_all_v(s, a, segs, c, segs); }));
      const double sent = static_cast<double>(per_peer) * 4.0 * (n - 1);
      collectives.push_back({{"op", "all_to_all_v"}, {"ranks", n}, {"bytes_per_peer", per_peer * 4}, {"seconds", t},
                             {"busbw", sent / t}});
      if (comm->rank() == 0)
        std::printf("all_to_all_v %d ranks, %lld B per peer: %.3f ms, busbw %.2f GB/s\n", n,
                    static_cast<long long>(per_peer * 4), t * 1e3, sent / t / 1e9);
    }
  }

  if (comm->rank() != 0) return 0;
  json profile = {{"schema", "moelab.profile/1"},
                  {"name", name.empty() ? b->name() + "-" + std::to_string(comm->size()) + "rank" : name},
                  {"mode", "measured"},
                  {"backend", b->name()},
                  {"device", b->device_name()},
                  {"date", utc_now_iso8601()},
                  {"commit", build_commit()},
                  {"gemm", gemm},
                  {"h2d_bw", h2d},
                  {"d2h_bw", d2h},
                  {"d2d_bw", d2d},
                  {"elementwise_bw", elementwise},
                  {"launch_latency", launch},
                  {"collectives", collectives},
                  {"gemm_paths", gemm_paths},
                  {"copies", copies},
                  {"overheads", overheads},
                  {"interference", interference},
                  {"dispatch", dispatch},
                  {"activations", activations},
                  {"epilogues", epilogues}};
  outputs.stage(out, profile);
  outputs.commit();
  std::printf("profile %s\n", out.c_str());
  return 0;
}

}  // namespace moelab::cli
