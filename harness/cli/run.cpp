// harness/cli/run.cpp — `moelab run`: one workload, one implementation, one backend.
//
//   moelab run --workload experiments/workloads/tiny.json --impl fastmoe --backend cpu
//   mpirun -n 2 moelab run --workload experiments/workloads/tiny.json --impl fastmoe --backend cpu
//          --out results/tiny-fastmoe.json --trace tiny-fastmoe.trace.json --steps 10
//
// A run, in order:
//   1. check everything the user gave (flags, the workload file, the world size, the
//      implementation and backend names, the dtype, the output folders) before any work
//      starts. Bad input: exit 2 on every rank, nothing written.
//   2. build the implementation, initialise its parameters from the workload's seed, make
//      the input x [T,M] and the output gradient dy [T,M], U(-1,1) from
//      Rng(mix(seed, rank, 1)) and Rng(mix(seed, rank, 2)).
//   3. warm-up steps, then the timed steps; a step is zero_grad, forward, backward,
//      synchronize, and its time is the slowest rank's.
//   4. from the backend's timeline: time per phase (gate, dispatch, experts, combine) and per
//      stream; from the tracked allocator: the peak over the timed window, weights and
//      gradients included; the yardstick: the same expert GEMMs issued bare to the GEMM
//      library (cblas_sgemm / cuBLAS).
//   5. a table on stdout (rank 0), then the trace (--trace) and the result file, each written
//      atomically at the very end: a run that fails part-way leaves no result behind.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/comm/world.hpp"
#include "harness/config/workload.hpp"
#include "harness/metrics/results.hpp"
#include "harness/metrics/overlap.hpp"
#include "harness/metrics/trace.hpp"
#include "harness/nn/moe_impl.hpp"
#include "harness/runtime/error.hpp"
#include "harness/runtime/random.hpp"
#include "harness/backends/sim/sim_backend.hpp"
#include "harness/sim/cluster.hpp"

namespace moelab::cli {

using nlohmann::json;

void print_run_help(std::FILE* to) {
  std::fputs(
      "usage: moelab run --workload FILE --impl NAME --backend cpu|cuda|sim [options]\n"
      "\n"
      "Runs the workload's MoE layer forward and backward with one implementation on one\n"
      "backend, prints time per step, the split into gate / dispatch / experts / combine,\n"
      "expert TFLOP/s against the bare GEMM library, and peak memory by category, and writes\n"
      "the result file. Several ranks (expert parallelism): mpirun -n R moelab run ...\n"
      "\n"
      "  --workload FILE   workload JSON (experiments/workloads/*.json)\n"
      "  --impl NAME       implementation (moelab list shows them)\n"
      "  --impl-options JSON  the implementation's options, e.g. '{\"partitions\": 4}' for mpipemoe\n"
      "  --backend NAME    cpu, cuda, or sim (a simulated cluster, all ranks in this process)\n"
      "  --cluster NAME    sim: cluster model (experiments/hardware/clusters/NAME.json)\n"
      "  --profile FILE    sim: calibration profile from `moelab calibrate` (default: datasheet)\n"
      "  --routing SPEC    sim: tokens per expert: uniform, zipf:S or trace:FILE (default uniform)\n"
      "  --ranks N         sim: simulate the first N GPUs of the cluster (default: all)\n"
      "  --record-routing FILE  write the gate's routing of every step as a trace for --routing\n"
      "  --out FILE        result JSON (default results/run-<impl>-<backend>.json)\n"
      "  --trace FILE      also write a Chrome trace of the timed steps (open in ui.perfetto.dev)\n"
      "  --steps N         timed steps (default: the workload's \"steps\")\n"
      "  --help            this text\n"
      "\n"
      "Exit status: 0 success, 2 bad input (nothing written), 1 failure during the run.\n",
      to);
}

namespace {

constexpr double kMiB = 1024.0 * 1024.0;
const char* const kPhases[] = {"gate", "dispatch", "experts", "combine"};

std::string strf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string strf(const char* fmt, ...) {
  va_list ap, ap2;
  va_start(ap, fmt);
  va_copy(ap2, ap);
  const int n = std::vsnprintf(nullptr, 0, fmt, ap);
  va_end(ap);
  std::string s(static_cast<std::size_t>(std::max(n, 0)) + 1, '\0');
  std::vsnprintf(s.data(), s.size(), fmt, ap2);
  va_end(ap2);
  s.pop_back();
  return s;
}

// ---- 1. the user's input ----------------------------------------------------------------

struct RunOptions {
  std::string workload, impl, backend, out, trace;
  std::string cluster, profile, routing = "uniform", record_routing;  // sim; trace recorder
  nlohmann::json impl_options = nlohmann::json::object();
  int steps = 0;  // 0: the workload's
  int ranks = 0;  // sim: 0 = every GPU of the cluster
  bool help = false;
};

RunOptions parse_run_options(const std::vector<std::string>& args) {
  RunOptions o;
  std::vector<std::string> seen;
  for (std::size_t i = 0; i < args.size(); ++i) {
    std::string flag = args[i], value;
    bool inline_value = false;
    if (flag == "--help" || flag == "-h") {
      o.help = true;
      continue;
    }
    if (const auto eq = flag.find('='); flag.rfind("--", 0) == 0 && eq != std::string::npos) {
      value = flag.substr(eq + 1);
      flag = flag.substr(0, eq);
      inline_value = true;
    }
    auto take = [&]() -> std::string {
      if (!inline_value) {
        if (i + 1 >= args.size() || args[i + 1].rfind("--", 0) == 0)
          throw ConfigError(flag + " needs a value (see moelab run --help)");
        value = args[++i];
      }
      if (value.empty()) throw ConfigError(flag + " needs a value (see moelab run --help)");
      if (std::find(seen.begin(), seen.end(), flag) != seen.end()) throw ConfigError(flag + " is given twice");
      seen.push_back(flag);
      return value;
    };
    if (flag == "--workload")
      o.workload = take();
    else if (flag == "--impl")
      o.impl = take();
    else if (flag == "--backend")
      o.backend = take();
    else if (flag == "--out")
      o.out = take();
    else if (flag == "--trace")
      o.trace = take();
    else if (flag == "--cluster")
      o.cluster = take();
    else if (flag == "--profile")
      o.profile = take();
    else if (flag == "--routing")
      o.routing = take();
    else if (flag == "--record-routing")
      o.record_routing = take();
    else if (flag == "--impl-options") {
      const std::string v = take();
      try {
        o.impl_options = nlohmann::json::parse(v);
      } catch (const nlohmann::json::exception& e) {
        throw ConfigError("--impl-options '" + v + "': malformed JSON: " + e.what());
      }
      if (!o.impl_options.is_object()) throw ConfigError("--impl-options '" + v + "': expected a JSON object");
    }
    else if (flag == "--ranks") {
      const std::string v = take();
      char* end = nullptr;
      errno = 0;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (errno || *end || n < 1 || n > 1000000) throw ConfigError("--ranks = \"" + v + "\": expected a positive integer");
      o.ranks = static_cast<int>(n);
    }
    else if (flag == "--steps") {
      const std::string v = take();
      char* end = nullptr;
      errno = 0;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (errno || *end || n < 1 || n > 1000000)
        throw ConfigError("--steps = \"" + v + "\": expected a positive integer (at most 1000000)");
      o.steps = static_cast<int>(n);
    } else {
      throw ConfigError("unknown option \"" + args[i] + "\" for moelab run (see moelab run --help)");
    }
  }
  if (o.help) return o;
  if (o.workload.empty()) throw ConfigError("missing --workload FILE (e.g. experiments/workloads/tiny.json)");
  if (o.impl.empty()) throw ConfigError("missing --impl NAME (moelab list shows the implementations)");
  if (o.backend.empty()) throw ConfigError("missing --backend cpu|cuda|sim");
  if (o.backend == "sim" && o.cluster.empty())
    throw ConfigError("--backend sim needs --cluster NAME (moelab list shows the cluster models)");
  if (o.backend != "sim" && (!o.cluster.empty() || !o.profile.empty() || o.ranks > 0 || o.routing != "uniform"))
    throw ConfigError("--cluster, --profile, --routing and --ranks apply to --backend sim only");
  if (o.out.empty()) o.out = "results/run-" + o.impl + "-" + o.backend + ".json";
  if (!o.trace.empty() &&
      std::filesystem::path(o.trace).lexically_normal() == std::filesystem::path(o.out).lexically_normal())
    throw ConfigError("--trace and --out name the same file " + o.out);
  return o;
}

// The file is written at the end, so only check now that it can be: its folder may not
// exist yet (results/ in a fresh checkout) and is created then, so what must be a writable
// folder is the nearest part of the path that exists.
void check_output_path(const std::string& path, const std::string& flag) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) throw ConfigError(flag + " " + path + ": is a folder; give a file name");
  fs::path p = fs::absolute(path, ec).parent_path();
  while (!fs::exists(p, ec) && p.has_parent_path() && p.parent_path() != p) p = p.parent_path();
  if (!fs::is_directory(p, ec)) throw ConfigError(flag + " " + path + ": " + p.string() + " is not a folder");
  if (::access(p.c_str(), W_OK | X_OK) != 0)
    throw ConfigError(flag + " " + path + ": folder " + p.string() + " is not writable (" + std::strerror(errno) + ")");
}

void check_impl_name(const std::string& name) {
  const auto names = impl_names();
  if (std::find(names.begin(), names.end(), name) != names.end()) return;
  std::string known;
  for (const auto& n : names) known += (known.empty() ? "" : ", ") + n;
  throw ConfigError("--impl \"" + name + "\" is not a known implementation (known: " +
                    (known.empty() ? std::string("none built") : known) + ")");
}

// Bad input seen by only some ranks (a workload file missing on one node, say) must stop
// every rank the same way: a rank that went on alone would wait forever in a collective.
void agree_on_errors(Communicator& comm, const std::string& local_error) {
  const auto all = comm.all_gather_strings(local_error);
  for (std::size_t r = 0; r < all.size(); ++r)
    if (!all[r].empty()) throw ConfigError(r == 0 ? all[r] : "rank " + std::to_string(r) + ": " + all[r]);
}

// ---- 2. inputs ---------------------------------------------------------------------------

// [T,M], U(-1,1), a deterministic function of (seed, rank, key) whatever the backend.
Tensor random_tokens(Backend& b, const WorkloadConfig& w, int rank, std::uint64_t key) {
  Tensor t = b.empty({w.tokens_per_rank, w.model.d_model}, w.model.dtype, MemCategory::activations, b.default_stream());
  if (!b.has_data()) return t;  // sim: shapes only
  Rng rng(Rng::mix(w.seed, static_cast<std::uint64_t>(rank), key));
  std::vector<float> host(static_cast<std::size_t>(t.numel()));
  for (auto& v : host) v = static_cast<float>(rng.uniform(-1.0, 1.0));
  b.upload(host, t);
  return t;
}

// ---- 4. what one rank measured -------------------------------------------------------------

json category_bytes(const CategoryBytes& b) {
  json j = json::object();
  for (int c = 0; c < kNumMemCategories; ++c)
    j[category_name(static_cast<MemCategory>(c))] = b[static_cast<std::size_t>(c)];
  return j;
}

// Phase time = summed duration of the phase's ops over every stream, per step. Phases that
// overlap on different streams can therefore add up to more than the step: that is the
// overlap the schedules are after.
json timeline_figures(const std::vector<OpRecord>& ops, int steps) {
  std::map<std::string, double> phases;
  for (const char* p : kPhases) phases[p] = 0.0;
  std::map<int, std::string> stream_names;
  std::map<std::string, int> name_uses;
  for (const auto& op : ops)
    if (stream_names.emplace(op.stream_id, op.stream_name).second) ++name_uses[op.stream_name];
  std::map<std::string, double> streams;
  double expert_flops = 0.0, expert_gemm_s = 0.0;
  for (const auto& op : ops) {
    const double d = op.end - op.start;
    phases[op.phase] += d;
    const std::string key =
        name_uses[op.stream_name] > 1 ? op.stream_name + "#" + std::to_string(op.stream_id) : op.stream_name;
    streams[key] += d;
    if (op.phase == "experts" && op.cost.kind == OpKind::gemm) {
      expert_flops += op.cost.flops;
      expert_gemm_s += d;
    }
  }
  const double n = static_cast<double>(steps);
  json j;
  j["phases_s"] = json::object();
  for (const auto& [k, v] : phases) j["phases_s"][k] = v / n;
  j["stream_busy_s"] = json::object();
  for (const auto& [k, v] : streams) j["stream_busy_s"][k] = v / n;
  j["expert_flops"] = expert_flops / n;
  j["expert_gemm_s"] = expert_gemm_s / n;
  const OverlapFigures o = overlap_figures(ops);
  j["compute_busy_s"] = o.compute_busy / n;
  j["comm_s"] = o.comm_time / n;
  j["hidden_comm_s"] = o.hidden_comm / n;
  j["copy_s"] = o.copy_time / n;
  return j;
}

std::string gemm_library(Backend& b) {
  if (b.name() == "cuda") return "cuBLAS";
  if (b.name() == "sim") return "GEMM (cost model)";
  if (b.name() == "cpu")
    return b.device_name().find("OpenBLAS") != std::string::npos ? "cblas_sgemm" : "cpu_sgemm (no BLAS)";
  return b.name() + " GEMM";
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double max_over(const std::vector<json>& ranks, const char* group, const std::string& key) {
  double m = 0.0;
  for (const auto& r : ranks)
    if (r[group].contains(key)) m = std::max(m, r[group][key].get<double>());
  return m;
}

}  // namespace

// What the run is on: for sim, the cluster model and calibration; the result records it.
struct Platform {
  json cluster = nullptr;      // sim: the cluster model
  std::string calibration;     // sim: profile name or "datasheet"
  std::string routing;         // sim: the routing model
};

int run_on_rank(Backend& b, Communicator& c, const RunOptions& opt, const WorkloadConfig& w, const Platform& platform);

int run_command(const std::vector<std::string>& args) {
  const RunOptions opt = parse_run_options(args);
  if (opt.help) {
    if (world_rank() == 0) print_run_help(stdout);
    return 0;
  }
  const int rank = world_rank(), world = world_size();

  // ---- 1. validation: nothing below this block writes a file or starts work unless all of
  //         it passed on every rank.
  check_impl_name(opt.impl);
  if (opt.backend == "sim") {
    // A simulated cluster: every rank is a thread of this one process.
    if (world > 1) throw ConfigError("--backend sim runs every simulated rank in one process: start it without mpirun");
    WorkloadConfig w = load_workload(opt.workload);
    if (opt.steps > 0) w.steps = opt.steps;
    SimOptions so;
    so.cluster = sim::load_cluster(opt.cluster);
    if (!opt.profile.empty()) so.profile = sim::load_profile(opt.profile);
    so.routing = RoutingModel::parse(opt.routing, w.seed);
    so.ranks = opt.ranks;
    SimCluster cluster(std::move(so));
    validate_for_world(w, cluster.size());
    check_output_path(opt.out, "--out");
    if (!opt.trace.empty()) check_output_path(opt.trace, "--trace");
    if (!opt.record_routing.empty()) check_output_path(opt.record_routing, "--record-routing");
    Platform platform{sim::to_json(cluster.options().cluster), cluster.calibration(),
                      cluster.options().routing.describe()};
    int rc = 0;
    cluster.run([&](Backend& b, Communicator& c) {
      if (!b.supports(w.model.dtype))
        throw Unsupported(w.origin + ": model.dtype = \"" + std::string(dtype_name(w.model.dtype)) + "\" is not supported by the sim backend");
      const int r = run_on_rank(b, c, opt, w, platform);
      if (c.rank() == 0) rc = r;
    });
    return rc;
  }

  WorkloadConfig w;
  std::string local_error;
  try {
    w = load_workload(opt.workload);
    if (opt.steps > 0) w.steps = opt.steps;
    validate_for_world(w, world);
    if (rank == 0) {
      check_output_path(opt.out, "--out");
      if (!opt.trace.empty()) check_output_path(opt.trace, "--trace");
      if (!opt.record_routing.empty()) check_output_path(opt.record_routing, "--record-routing");
    }
  } catch (const ConfigError& e) {
    if (world == 1) throw;
    local_error = e.what();
  }
  auto backend = make_backend(opt.backend);
  backend->set_rank(rank);
  if (local_error.empty() && !backend->supports(w.model.dtype)) {
    const std::string msg = w.origin + ": model.dtype = \"" + dtype_name(w.model.dtype) +
                            "\" is not supported by the " + backend->name() + " backend" +
                            (backend->name() == "cpu" ? " (it computes in fp32; use --backend cuda)" : "");
    if (world == 1) throw Unsupported(msg);
    local_error = msg;
  }
  auto comm = make_world_communicator(*backend);
  if (world > 1) agree_on_errors(*comm, local_error);
  return run_on_rank(*backend, *comm, opt, w, Platform{});
}

// ---- 2.-5. the run on one rank (a process on cpu/cuda, a thread on sim) --------------------
int run_on_rank(Backend& b, Communicator& c, const RunOptions& opt, const WorkloadConfig& w, const Platform& platform) {
  Backend* backend = &b;
  Communicator* comm = &c;
  const int rank = c.rank(), world = c.size();
  backend->set_allow_tf32(w.model.allow_tf32);
  auto impl = make_impl(opt.impl, *backend, *comm, w.model, opt.impl_options);

  // From here on every rank has accepted the input; an error is a failure of the run.
  try {
    impl->init_parameters(w.seed);
    const Tensor x = random_tokens(*backend, w, rank, 1);   // [T,M]
    const Tensor dy = random_tokens(*backend, w, rank, 2);  // [T,M]

    // ---- 3. warm-up, then the timed window ------------------------------------------------
    auto step = [&] {
      impl->zero_grad();
      const Tensor y = impl->forward(x);
      const Tensor dx = impl->backward(dy, 0.01f);
      backend->synchronize();
    };
    std::vector<std::vector<std::int64_t>> routed;  // --record-routing: every gate call, warm-up included
    for (int i = 0; i < w.warmup; ++i) {
      step();
      if (!opt.record_routing.empty()) routed.push_back(impl->routing().routed_per_expert);
    }
    backend->synchronize();
    comm->barrier();
    backend->clear_timeline();
    backend->memory().reset_peak();  // the current use (weights, gradients, inputs) stays the base
    backend->reset_device_pool_peak();
    const double window_start = backend->now();
    std::vector<double> step_s;
    for (int i = 0; i < w.steps; ++i) {
      comm->barrier();  // every rank starts the step together, so the slowest rank sets its time
      const double t0 = backend->now();
      step();
      comm->barrier();  // the step ends when the slowest rank is done
      step_s.push_back(backend->now() - t0);
      if (!opt.record_routing.empty()) routed.push_back(impl->routing().routed_per_expert);
    }

    // ---- 4. what this rank measured (memory first: the yardstick allocates) ----------------
    const auto& mem = backend->memory();
    const std::vector<MemSample> mem_samples = mem.timeline();
    std::vector<OpRecord> ops = backend->timeline();
    json local = timeline_figures(ops, w.steps);
    local["device"] = backend->device_name();
    local["step_s"] = step_s;
    local["peak_device"] = mem.peak_device();
    local["at_peak"] = category_bytes(mem.at_peak());
    local["peak_per_category"] = category_bytes(mem.peak_per_category());
    if (const auto pool = backend->device_pool_peak())
      local["pool"] = {{"used_high", pool->used_high}, {"reserved_high", pool->reserved_high}};
    const RoutingStats& routing = impl->routing();
    local["dropped"] = routing.dropped;
    local["capacity"] = routing.capacity;
    local["recv_per_local"] = routing.recv_per_local;
    local["routed"] = routed;
    const std::vector<GemmProblem> gemms = impl->expert_gemms();
    local["bare_gemm_s"] = backend->time_bare_gemms(gemms, 5);

    std::vector<json> ranks;
    for (const auto& s : comm->all_gather_strings(local.dump(-1, ' ', false, json::error_handler_t::replace)))
      ranks.push_back(json::parse(s));

    json trace;
    if (!opt.trace.empty()) {
      for (auto& op : ops) {
        op.start -= window_start;
        op.end -= window_start;
      }
      std::vector<MemSample> shifted = mem_samples;
      for (auto& s : shifted) s.time -= window_start;
      const auto parts = comm->all_gather_strings(
          chrome_trace(ops, shifted, rank).dump(-1, ' ', false, json::error_handler_t::replace));
      trace = json::parse(parts[0]);
      for (std::size_t r = 1; r < parts.size(); ++r) {
        json part = json::parse(parts[r]);
        for (auto& e : part["traceEvents"]) trace["traceEvents"].push_back(std::move(e));
      }
    }
    if (rank != 0) return 0;

    // ---- the slowest rank's figures ---------------------------------------------------------
    std::vector<double> steps_max(static_cast<std::size_t>(w.steps), 0.0);
    for (const auto& r : ranks)
      for (std::size_t i = 0; i < steps_max.size(); ++i)
        steps_max[i] = std::max(steps_max[i], r["step_s"][i].get<double>());
    const double step_med = median(steps_max);
    const double step_mean = std::accumulate(steps_max.begin(), steps_max.end(), 0.0) / static_cast<double>(w.steps);
    const double step_min = *std::min_element(steps_max.begin(), steps_max.end());
    const double step_max = *std::max_element(steps_max.begin(), steps_max.end());
    const double global_tokens = static_cast<double>(w.tokens_per_rank) * world;
    const double tokens_per_s = step_med > 0 ? global_tokens / step_med : 0.0;

    json phases = json::object(), streams = json::object();
    for (const auto& r : ranks) {
      for (const auto& [k, v] : r["phases_s"].items()) phases[k] = max_over(ranks, "phases_s", k);
      for (const auto& [k, v] : r["stream_busy_s"].items()) streams[k] = max_over(ranks, "stream_busy_s", k);
    }
    // Achieved TFLOP/s of one device: its experts' GEMM FLOPs over its experts phase time,
    // averaged over the ranks; the same FLOPs over the GEMMs' own time show how much of the
    // phase is not GEMM (activation, copies).
    double tflops = 0.0, gemm_tflops = 0.0, expert_gemm_s = 0.0, bare_s = 0.0;
    for (const auto& r : ranks) {
      const double t = r["phases_s"]["experts"].get<double>(), tg = r["expert_gemm_s"].get<double>();
      const double flops = r["expert_flops"].get<double>();
      if (t > 0) tflops += flops / t / 1e12 / static_cast<double>(world);
      if (tg > 0) gemm_tflops += flops / tg / 1e12 / static_cast<double>(world);
      expert_gemm_s = std::max(expert_gemm_s, r["expert_gemm_s"].get<double>());
      bare_s = std::max(bare_s, r["bare_gemm_s"].get<double>());
    }
    const double ratio = bare_s > 0 ? expert_gemm_s / bare_s : 0.0;

    // Overlap: summed over ranks for the ratio; the slowest rank's for times.
    double comm_sum = 0, hidden_sum = 0, comm_max = 0, compute_busy_min = 1e300, copy_max = 0;
    for (const auto& r : ranks) {
      comm_sum += r["comm_s"].get<double>();
      hidden_sum += r["hidden_comm_s"].get<double>();
      comm_max = std::max(comm_max, r["comm_s"].get<double>());
      copy_max = std::max(copy_max, r["copy_s"].get<double>());
      compute_busy_min = std::min(compute_busy_min, r["compute_busy_s"].get<double>());
    }
    const double overlap_ratio = comm_sum > 0 ? hidden_sum / comm_sum : 1.0;
    const double exposed_comm = std::max(0.0, step_med - compute_busy_min);
    double compute_busy_max = 0;
    for (const auto& r : ranks) compute_busy_max = std::max(compute_busy_max, r["compute_busy_s"].get<double>());
    const double overlap_limit = std::max(comm_max, compute_busy_max);

    std::size_t peak_rank = 0;
    for (std::size_t r = 1; r < ranks.size(); ++r)
      if (ranks[r]["peak_device"].get<std::size_t>() > ranks[peak_rank]["peak_device"].get<std::size_t>())
        peak_rank = r;
    const json& pk = ranks[peak_rank];

    std::int64_t dropped = 0;
    json recv = json::array();
    std::vector<std::string> devices;
    for (const auto& r : ranks) {
      dropped += r["dropped"].get<std::int64_t>();
      for (const auto& v : r["recv_per_local"]) recv.push_back(v);
      const auto d = r["device"].get<std::string>();
      if (std::find(devices.begin(), devices.end(), d) == devices.end()) devices.push_back(d);
    }
    std::string device;
    for (const auto& d : devices) device += (device.empty() ? "" : " | ") + d;
    const std::int64_t capacity = ranks[0]["capacity"].get<std::int64_t>();
    const std::string library = gemm_library(*backend);

    // ---- 5. the table ------------------------------------------------------------------------
    const ModelConfig& m = w.model;
    std::printf("workload   %s (%s)\n", w.name.c_str(), w.origin.c_str());
    std::printf("           T=%lld tokens/rank, M=%lld, H=%lld, E=%lld, top-%d, %s, %s, %s\n",
                static_cast<long long>(w.tokens_per_rank), static_cast<long long>(m.d_model),
                static_cast<long long>(m.d_hidden), static_cast<long long>(m.num_experts), m.top_k,
                m.capacity_factor > 0 ? strf("capacity factor %g", m.capacity_factor).c_str() : "no capacity limit",
                activation_name(m.activation), dtype_name(m.dtype));
    std::printf("impl       %s\n", opt.impl.c_str());
    std::printf("backend    %s, %s\n", backend->name().c_str(), device.c_str());
    if (backend->name() == "sim")
      std::printf("mode       SIMULATED: cluster model %s, calibration %s, routing %s\n",
                  platform.cluster.value("name", std::string("?")).c_str(), platform.calibration.c_str(),
                  platform.routing.c_str());
    else
      std::printf("mode       measured\n");
    std::printf("ranks      %d (expert parallel, %lld experts per rank)\n", world,
                static_cast<long long>(m.num_experts / world));
    std::printf("steps      %d timed after %d warm-up\n\n", w.steps, w.warmup);
    std::printf("tokens/s   %.0f\n", tokens_per_s);
    std::printf("step       %.3f ms median, %.3f ms mean (min %.3f, max %.3f)%s\n\n", step_med * 1e3, step_mean * 1e3,
                step_min * 1e3, step_max * 1e3, world > 1 ? ", slowest rank" : "");
    std::printf("%-10s %10s %10s\n", "phase", "ms/step", "% of step");
    auto phase_row = [&](const std::string& p) {
      const double t = phases.contains(p) ? phases[p].get<double>() : 0.0;
      std::printf("%-10s %10.3f %9.1f%%\n", p.c_str(), t * 1e3, step_med > 0 ? 100.0 * t / step_med : 0.0);
    };
    for (const char* p : kPhases) phase_row(p);
    for (const auto& [k, v] : phases.items())
      if (std::find(std::begin(kPhases), std::end(kPhases), k) == std::end(kPhases)) phase_row(k);
    std::printf("(summed op time per phase over all streams; overlapping phases can exceed 100%%)\n\n");
    std::printf("experts: %.3f ms of GEMMs vs bare %s %.3f ms for the same GEMMs (ratio %.2f)\n", expert_gemm_s * 1e3,
                library.c_str(), bare_s * 1e3, ratio);
    std::printf("expert TFLOP/s  %.3f per device over the experts phase, %.3f over its GEMMs\n", tflops, gemm_tflops);
    std::printf("communication   %.3f ms/step, %.1f%% hidden behind compute; exposed %.3f ms (step - compute busy "
                "%.3f ms); bound max(comm, compute) = %.3f ms, step at %.2fx of it\n",
                comm_max * 1e3, 100.0 * overlap_ratio, exposed_comm * 1e3, compute_busy_min * 1e3, overlap_limit * 1e3,
                overlap_limit > 0 ? step_med / overlap_limit : 0.0);
    std::string busy;
    for (const auto& [k, v] : streams.items())
      busy += strf("%s%s %.3f ms", busy.empty() ? "" : ", ", k.c_str(), v.get<double>() * 1e3);
    std::printf("stream busy     %s\n", busy.c_str());
    std::string cats;
    for (const auto& [k, v] : pk["at_peak"].items())
      if (v.get<std::size_t>() > 0)
        cats +=
            strf("%s%s %.1f", cats.empty() ? "" : ", ", k.c_str(), static_cast<double>(v.get<std::size_t>()) / kMiB);
    std::printf("peak memory     %.1f MiB%s: %s MiB\n",
                static_cast<double>(pk["peak_device"].get<std::size_t>()) / kMiB,
                world > 1 ? strf(" (rank %zu, the highest)", peak_rank).c_str() : "", cats.c_str());
    if (ranks[0].contains("pool")) {
      std::uint64_t used = 0, held = 0;
      for (const auto& r : ranks) {
        used = std::max(used, r["pool"]["used_high"].get<std::uint64_t>());
        held = std::max(held, r["pool"]["reserved_high"].get<std::uint64_t>());
      }
      std::printf("device pool     %.1f MiB in use at most, %.1f MiB held from the driver (cudaMallocAsync pool)\n",
                  static_cast<double>(used) / kMiB, static_cast<double>(held) / kMiB);
    }
    const double slots = global_tokens * m.top_k;
    std::printf("routing         %lld of %.0f token-slots dropped (%s)\n", static_cast<long long>(dropped), slots,
                capacity > 0 ? strf("capacity %lld per expert", static_cast<long long>(capacity)).c_str()
                             : "no capacity limit");

    // ---- the record ------------------------------------------------------------------------
    json metrics;
    metrics["step_time_s"] = {
        {"median", step_med}, {"mean", step_mean}, {"min", step_min}, {"max", step_max}, {"all", steps_max}};
    metrics["tokens_per_s"] = tokens_per_s;
    metrics["phases_s"] = phases;
    metrics["stream_busy_s"] = streams;
    metrics["comm_s"] = comm_max;
    metrics["compute_busy_s"] = compute_busy_min;
    metrics["exposed_comm_s"] = exposed_comm;
    metrics["overlap_ratio"] = overlap_ratio;
    metrics["overlap_limit_s"] = overlap_limit;
    metrics["host_copy_s"] = copy_max;
    metrics["expert_tflops"] = tflops;
    metrics["expert_gemm_tflops"] = gemm_tflops;
    metrics["expert_gemm_s"] = expert_gemm_s;
    metrics["bare_gemm_s"] = bare_s;
    metrics["bare_gemm_library"] = library;
    metrics["expert_vs_bare_ratio"] = ratio;
    metrics["peak_memory_bytes"] = {{"device_total", pk["peak_device"]},
                                    {"rank", peak_rank},
                                    {"by_category_at_peak", pk["at_peak"]},
                                    {"peak_per_category", pk["peak_per_category"]}};
    // The device allocator's own high-water marks (cuda), the highest rank's.
    if (ranks[0].contains("pool")) {
      std::size_t pool_rank = 0;
      for (std::size_t r = 1; r < ranks.size(); ++r)
        if (ranks[r]["pool"]["used_high"].get<std::uint64_t>() > ranks[pool_rank]["pool"]["used_high"].get<std::uint64_t>())
          pool_rank = r;
      json pool = ranks[pool_rank]["pool"];
      pool["rank"] = pool_rank;
      metrics["peak_memory_bytes"]["device_pool"] = pool;
    }
    metrics["routing"] = {{"dropped", dropped}, {"capacity", capacity}, {"recv_per_local_expert", recv}};

    json result;
    result["schema"] = "moelab.result/1";
    const bool simulated = backend->name() == "sim";
    result["mode"] = simulated ? "simulated" : "measured";
    result["backend"] = backend->name();
    result["device"] = device;
    result["cluster"] = platform.cluster;
    result["calibration"] = simulated ? json(platform.calibration) : json(nullptr);
    if (simulated) result["routing_model"] = platform.routing;
    result["commit"] = build_commit();
    result["date"] = utc_now_iso8601();
    result["world_size"] = world;
    result["workload"] = to_json(w);
    result["impl"] = opt.impl;
    result["impl_report"] = impl->report();
    result["metrics"] = std::move(metrics);

    if (!opt.record_routing.empty()) {
      // calls[call][rank][expert]: what the gate routed in each step (before capacity)
      std::vector<std::vector<std::vector<std::int64_t>>> calls(static_cast<std::size_t>(w.warmup + w.steps));
      for (const auto& r : ranks)
        for (std::size_t i = 0; i < calls.size(); ++i)
          calls[i].push_back(r["routed"][i].get<std::vector<std::int64_t>>());
      write_json_atomic(opt.record_routing, routing_trace_json(calls, to_json(w)));
      std::printf("routing trace   %s\n", opt.record_routing.c_str());
    }
    if (!opt.trace.empty()) {
      // The trace says how it was obtained, like every result (Perfetto ignores the key).
      trace["otherData"] = {{"mode", result["mode"]},         {"backend", result["backend"]},
                            {"device", result["device"]},     {"cluster", platform.cluster.is_null() ? json(nullptr) : platform.cluster["name"]},
                            {"calibration", result["calibration"]}, {"commit", result["commit"]},
                            {"date", result["date"]},         {"workload", w.name},
                            {"impl", opt.impl}};
      write_json_atomic(opt.trace, trace, -1);
      std::printf("trace           %s\n", opt.trace.c_str());
    }
    write_json_atomic(opt.out, result);
    std::printf("result          %s\n", opt.out.c_str());
    return 0;
  } catch (const ConfigError& e) {
    // Past validation, a rank may fail alone; exit 2 is only safe when every rank agrees.
    if (world > 1) throw std::runtime_error(e.what());
    throw;
  } catch (const Unsupported& e) {
    if (world > 1) throw std::runtime_error(e.what());
    throw;
  }
}

}  // namespace moelab::cli
