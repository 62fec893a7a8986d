// harness/cli/calibrate.cpp — `moelab calibrate`: measure the device this process runs on and
// write a calibration profile that the sim backend can use instead of datasheet curves.
//
//   moelab calibrate --backend cuda --out experiments/profiles/h100.json
//   moelab calibrate --backend cpu --out /tmp/cpu-profile.json --quick
//
// Measured, each as the median of several repetitions after a warm-up:
//   GEMM      a grid of shapes (the paper models' expert shapes and partition sizes) in every
//             dtype the backend supports, through Backend::time_bare_gemms (cuBLAS / cblas)
//   copies    pinned host->device and device->host, device->device (bytes read + written)
//   kernels   an elementwise kernel's bandwidth (GeLU: one read, one write) and the time of
//             a tiny op (launch latency)
//   comm      with several ranks (mpirun), all-to-all-v of several sizes: recorded for
//             reference (the cluster models keep the link figures)
#include <algorithm>
#include <array>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/cli/run_common.hpp"
#include "harness/comm/world.hpp"
#include "harness/metrics/results.hpp"
#include "harness/runtime/error.hpp"
#include "harness/sim/cluster.hpp"

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
          "Measures GEMM throughput over a grid of shapes and dtypes, host<->device and device copy\n"
          "bandwidth, elementwise bandwidth and launch latency (and all-to-all-v under mpirun), and\n"
          "writes a calibration profile for `moelab run --backend sim --profile FILE`.");
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
        for (Tensor* x : {&A, &B, &C}) b->fill_zero(s, *x);
        const GemmProblem p{false, false, m, n, k, A, B, C, 1.0f, 0.0f};
        const double sec = b->time_bare_gemms({&p, 1}, reps);
        gemm.push_back({{"m", m}, {"n", n}, {"k", k}, {"dtype", dtype_name(t)}, {"seconds", sec}});
        if (comm->rank() == 0)
          std::printf("gemm %-5s %6lld x %5lld x %5lld  %9.3f ms  %8.2f TFLOP/s\n", dtype_name(t),
                      static_cast<long long>(m), static_cast<long long>(k), static_cast<long long>(n), sec * 1e3,
                      2.0 * static_cast<double>(m * n * k) / sec / 1e12);
      }

  // ---- copies --------------------------------------------------------------------------------
  const std::int64_t elems = (cpu ? 16 : 64) * (1 << 20) / (quick ? 4 : 1);  // floats
  Tensor dev = b->empty({elems}, DType::f32, MemCategory::buffers, s);
  Tensor dev2 = b->empty({elems}, DType::f32, MemCategory::buffers, s);
  Tensor host = b->empty({elems}, DType::f32, MemCategory::buffers, s, MemSpace::host_pinned);
  for (Tensor* x : {&dev, &dev2, &host}) b->fill_zero(s, *x);
  const double bytes = static_cast<double>(dev.nbytes());
  const double h2d = bytes / time_it(*b, reps, [&] { b->copy(s, host, dev); });
  const double d2h = bytes / time_it(*b, reps, [&] { b->copy(s, dev, host); });
  const double d2d = 2.0 * bytes / time_it(*b, reps, [&] { b->copy(s, dev, dev2); });
  const double elementwise =
      2.0 * bytes / time_it(*b, reps, [&] { b->activation_forward(s, Activation::gelu, dev, dev2); });
  Tensor tiny = b->empty({1}, DType::f32, MemCategory::buffers, s);
  const int launches = 200;
  const double launch = time_it(*b, reps, [&] {
                          for (int i = 0; i < launches; ++i) b->fill_zero(s, tiny);
                        }) /
                        launches;
  if (comm->rank() == 0)
    std::printf("copies  h2d %.1f GB/s, d2h %.1f GB/s, d2d %.1f GB/s; elementwise %.1f GB/s; launch %.2f us\n",
                h2d / 1e9, d2h / 1e9, d2d / 1e9, elementwise / 1e9, launch * 1e6);

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
                  {"collectives", collectives}};
  outputs.stage(out, profile);
  outputs.commit();
  std::printf("profile %s\n", out.c_str());
  return 0;
}

}  // namespace moelab::cli
