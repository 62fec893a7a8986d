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
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/comm/world.hpp"
#include "harness/config/json_fields.hpp"
#include "harness/config/workload.hpp"
#include "harness/metrics/results.hpp"
#include "harness/metrics/run_figures.hpp"
#include "harness/metrics/overlap.hpp"
#include "harness/metrics/trace.hpp"
#include "harness/nn/moe_impl.hpp"
#include "harness/runtime/error.hpp"
#include "harness/runtime/random.hpp"
#include "harness/backends/sim/sim_backend.hpp"
#include "harness/cli/run_common.hpp"
#include "harness/sim/cluster.hpp"
#ifdef MOELAB_HAVE_CUDA
#include "harness/backends/cuda/cuda_backend.hpp"
#endif

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
      "  --profile FILE    sim: calibration profile from `moelab calibrate` (default: datasheet);\n"
      "                    cuda: the expert GEMMs choose their cuBLAS path by the profile's\n"
      "                    measured gemm_paths table (default: the built-in H100 table)\n"
      "  --routing SPEC    sim: tokens per expert: uniform, zipf:S or trace:FILE (default uniform)\n"
      "  --gemm-path PATH  cuda and sim: run (or price) the experts' GEMM calls on one cuBLAS path\n"
      "                    where it can run them: loop, strided_batched or grouped (default auto:\n"
      "                    the crossover table chooses per call; the sim needs per-path data)\n"
      "  --ranks N         sim: simulate the first N GPUs of the cluster (default: all)\n"
      "  --record-routing FILE  write the gate's routing of every step as a trace for --routing\n"
      "  --out FILE        result JSON (default results/run-<impl>-<backend>.json)\n"
      "  --trace FILE      also write a Chrome trace of the timed steps (open in ui.perfetto.dev)\n"
      "  --steps N         timed steps (default: the workload's \"steps\")\n"
      "  --model FILE      a whole model (experiments/models/*.json) instead of --workload, with\n"
      "                    --layers A:B, --micro-batch N, --microbatches N, --warmup N, --seed N,\n"
      "                    --optimizer adam|sgd|none, --lr X, --model-override JSON, and:\n"
      "  --parallel SPEC   the ranks' layout, e.g. tp=1,pp=2,dp=2,ep=2 (dp inferred when left out);\n"
      "                    runs the model as a pipeline of pp stages on the layout's process groups\n"
      "  --schedule NAME   pipeline schedule: gpipe, 1f1b (default), interleaved, zb-h1, zb-v,\n"
      "                    group-interleaved (PipeOffload's)\n"
      "  --chunks V        model chunks per stage for interleaved (default 2)\n"
      "  --group G         group-interleaved's group size, ceil(pp/2) (default) .. pp\n"
      "  --offload-chunks K  offload the saved activations of chunks < K to pinned host memory\n"
      "                    (PipeOffload; \"all\": full offload); transfers the gap between F and B\n"
      "                    cannot hide or that save nothing at a stage's peak are skipped, unless\n"
      "                    --offload-all-lifespans (every transfer, placed as if the copies were free)\n"
      "  --pad-layers      split layers unevenly when pp x chunks does not divide them (one fewer\n"
      "                    on the last and first virtual stages, PipeOffload's Megatron fork)\n"
      "  --recompute MODE  activation recomputation: none (default), selective (norms) or full\n"
      "  --sequence-parallel  with tp > 1: norms, residuals and MoE layers on T/tp tokens per rank\n"
      "  --zero1           shard Adam's states over the data-parallel groups (ZeRO stage 1)\n"
      "  --grad-bucket N   elements per gradient bucket (default 40000000, Megatron-Core's)\n"
      "  --inference       forward passes only (full-sequence batches, no backward, no optimizer),\n"
      "                    each block's activations released once the next has them; --parallel\n"
      "                    may place the ranks (dp and ep only: e.g. ep=8 on 16 GPUs)\n"
      "  --data SPEC       training tokens: a text file read as bytes (several joined by ','; the last\n"
      "                    tenth held out), or markov:K (a Markov source of entropy rate ln K); default:\n"
      "                    the synthetic successor language\n"
      "  --eval-every N    with --data: the validation loss every N steps (and before the first)\n"
      "  --eval-batches N  microbatches of held-out windows per evaluation (default 4)\n"
      "  --offload-experts MODE  with --inference: the routed experts' weights in pinned host memory,\n"
      "                    each forward's selected experts copied in: async (beside compute; ScMoE's\n"
      "                    expert offloading), sync (in the compute stream's path) or none (default)\n"
      "  --help            this text\n"
      "\n"
      "Exit status: 0 success, 2 bad input (nothing written), 3 out of memory, 1 failure during the run\n"
      "(under mpirun, a failure on one rank stops every rank).\n"
      "\n"
      "Environment: MOELAB_COLLECTIVE_TIMEOUT_S  cuda under mpirun: an NCCL op pending this many seconds\n"
      "                    stops every rank (default 600; 0: no limit)\n",
      to);
}

namespace {

const char* const kPhases[] = {"gate", "dispatch", "experts", "combine"};

}  // namespace

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

namespace {
std::int64_t integer_flag(const std::string& flag, const std::string& v, std::int64_t lo, std::int64_t hi) {
  char* end = nullptr;
  errno = 0;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || errno || *end || n < lo || n > hi)
    throw ConfigError(flag + " = \"" + shown(v) + "\": expected an integer from " + std::to_string(lo) + " to " +
                      std::to_string(hi));
  return n;
}
}  // namespace

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
    else if (flag == "--gemm-path") {
      const std::string v = take();
      GemmPath p{};
      if (v != "auto" && !parse_gemm_path(v, p))
        throw ConfigError("--gemm-path = \"" + shown(v) + "\": expected auto, loop, strided_batched or grouped");
      if (v != "auto") o.gemm_path = p;
    }
    else if (flag == "--record-routing")
      o.record_routing = take();
    else if (flag == "--impl-options")
      o.impl_options = json_fields::parse_options(take(), "--impl-options");
    else if (flag == "--ranks")
      o.ranks = static_cast<int>(integer_flag(flag, take(), 1, 1000000));
    else if (flag == "--steps")
      o.steps = static_cast<int>(integer_flag(flag, take(), 1, 1000000));
    else if (flag == "--model")
      o.model = take();
    else if (flag == "--model-override")
      o.model_override = json_fields::parse_options(take(), "--model-override");
    else if (flag == "--layers") {
      const std::string v = take();
      const auto colon = v.find(':');
      if (colon == std::string::npos) throw ConfigError("--layers = \"" + shown(v) + "\": expected A:B (layers A to B-1)");
      o.first_layer = static_cast<int>(integer_flag(flag, v.substr(0, colon), 0, 1 << 20));
      o.last_layer = static_cast<int>(integer_flag(flag, v.substr(colon + 1), 1, 1 << 20));
      if (o.first_layer >= o.last_layer) throw ConfigError("--layers = \"" + shown(v) + "\": A must be below B");
    } else if (flag == "--micro-batch")
      o.micro_batch = integer_flag(flag, take(), 1, 1 << 20);
    else if (flag == "--microbatches")
      o.microbatches = static_cast<int>(integer_flag(flag, take(), 1, 1 << 16));
    else if (flag == "--warmup")
      o.warmup = static_cast<int>(integer_flag(flag, take(), 0, 1000000));
    else if (flag == "--seed")
      o.seed = static_cast<std::uint64_t>(integer_flag(flag, take(), 0, std::numeric_limits<std::int64_t>::max()));
    else if (flag == "--optimizer") {
      o.optimizer = take();
      if (o.optimizer != "adam" && o.optimizer != "sgd" && o.optimizer != "none")
        throw ConfigError("--optimizer = \"" + shown(o.optimizer) + "\": expected adam, sgd or none");
    } else if (flag == "--parallel")
      o.parallel = take();
    else if (flag == "--schedule")
      o.schedule = take();
    else if (flag == "--chunks")
      o.chunks = static_cast<int>(integer_flag(flag, take(), 1, 64));
    else if (flag == "--group")
      o.group = static_cast<int>(integer_flag(flag, take(), 1, 4096));
    else if (flag == "--offload-chunks") {
      const std::string v = take();
      o.offload_chunks = v == "all" ? -1 : static_cast<int>(integer_flag(flag, v, 1, 64));
    } else if (flag == "--offload-all-lifespans")
      o.offload_lifespan = false;
    else if (flag == "--pad-layers")
      o.pad_layers = true;
    else if (flag == "--recompute") {
      o.recompute = take();
      if (o.recompute != "none" && o.recompute != "full" && o.recompute != "selective")
        throw ConfigError("--recompute = \"" + shown(o.recompute) + "\": expected none, selective or full");
    } else if (flag == "--sequence-parallel") {
      o.sequence_parallel = true;
    } else if (flag == "--zero1") {
      o.zero1 = true;
    } else if (flag == "--data") {
      o.data = take();
    } else if (flag == "--eval-every") {
      o.eval_every = static_cast<int>(integer_flag(flag, take(), 1, 1000000));
    } else if (flag == "--eval-batches") {
      o.eval_batches = static_cast<int>(integer_flag(flag, take(), 1, 4096));
    } else if (flag == "--inference") {
      o.inference = true;
    } else if (flag == "--offload-experts") {
      o.offload_experts = take();
      if (o.offload_experts != "none" && o.offload_experts != "sync" && o.offload_experts != "async")
        throw ConfigError("--offload-experts = \"" + shown(o.offload_experts) + "\": expected none, sync or async");
    } else if (flag == "--grad-bucket") {
      o.grad_bucket = integer_flag(flag, take(), 1, std::int64_t{1} << 40);
    } else if (flag == "--lr") {
      const std::string v = take();
      char* end = nullptr;
      errno = 0;
      o.lr = std::strtod(v.c_str(), &end);
      if (errno || *end || !(o.lr > 0) || o.lr > 10) throw ConfigError("--lr = \"" + shown(v) + "\": expected a number in (0, 10]");
    } else {
      throw ConfigError("unknown option \"" + shown(args[i]) + "\" for moelab run (see moelab run --help)");
    }
  }
  if (o.help) return o;
  if (!o.workload.empty() && !o.model.empty())
    throw ConfigError("--workload (one MoE layer) and --model (a whole model) exclude each other");
  if (o.workload.empty() && o.model.empty())
    throw ConfigError("missing --workload FILE (one MoE layer, e.g. experiments/workloads/tiny.json) or --model FILE "
                      "(e.g. experiments/models/tiny-moe.json)");
  const bool model_only = !o.model_override.empty() || o.first_layer != 0 || o.last_layer != -1 || o.micro_batch != 1 ||
                          o.microbatches != 1 || o.warmup != -1 || o.seed != 1 || o.optimizer != "adam" || o.lr != 1e-3 ||
                          o.pipelined() || o.inference || !o.data.empty() || o.eval_every != 0;
  if (!o.workload.empty() && model_only)
    throw ConfigError("--model-override, --layers, --micro-batch, --microbatches, --warmup, --seed, --optimizer, --lr, "
                      "--parallel, --schedule, --chunks, --group, --offload-chunks, --pad-layers, --recompute, "
                      "--sequence-parallel, --zero1, --grad-bucket, --inference, --data and --eval-every apply to --model runs (a workload file sets its own)");
  if (o.inference && o.pipelined())
    throw ConfigError("--inference runs the forward pass of the whole model on every rank (--parallel may place the ranks as "
                      "dp x ep replicas); --schedule, --chunks, --group, --offload-chunks, --pad-layers, --recompute, "
                      "--sequence-parallel, --zero1 and --grad-bucket are for training");
  if (o.inference && (o.optimizer != "adam" || o.lr != 1e-3))
    throw ConfigError("--inference has no optimizer: leave out --optimizer and --lr");
  if (o.eval_every != 0 && (o.data.empty() || o.inference || o.pipelined()))
    throw ConfigError("--eval-every needs --data (the held-out text or the Markov source), training, and no --parallel "
                      "(the validation forward runs on the whole model of every rank)");
  if (!o.data.empty() && o.backend == "sim")
    throw ConfigError("--data: the sim backend computes no values (shapes and times only); train on cpu or cuda");
  if (o.offload_experts != "none" && !o.inference)
    throw ConfigError("--offload-experts " + o.offload_experts + " needs --inference (the experts' weights live on the host; "
                      "training would need them and their gradients on the device)");
  if (!o.parallel.empty() && (o.first_layer != 0 || o.last_layer != -1))
    throw ConfigError("--layers and --parallel exclude each other: the pipeline assigns the layers to its stages");
  if (!o.model.empty() && !o.record_routing.empty())
    throw ConfigError("--record-routing applies to --workload runs");
  if (o.impl.empty()) throw ConfigError("missing --impl NAME (moelab list shows the implementations)");
  if (o.backend.empty()) throw ConfigError("missing --backend cpu|cuda|sim");
  if (o.backend != "cpu" && o.backend != "cuda" && o.backend != "sim")
    throw ConfigError("--backend \"" + shown(o.backend) + "\" is not a backend (cpu, cuda or sim)");
  if (o.backend == "sim" && o.cluster.empty())
    throw ConfigError("--backend sim needs --cluster NAME (moelab list shows the cluster models)");
  if (o.backend != "sim" && (!o.cluster.empty() || o.ranks > 0 || o.routing != "uniform"))
    throw ConfigError("--cluster, --routing and --ranks apply to --backend sim only");
  if (o.backend == "cpu" && o.gemm_path)
    throw ConfigError("--gemm-path applies to --backend cuda (cuBLAS's paths) and sim (their pricing), not cpu");
  if (o.backend == "cpu" && !o.profile.empty())
    throw ConfigError("--profile applies to --backend sim (the time model) and cuda (its GEMM-path table), not cpu");
  if (o.out.empty()) o.out = "results/run-" + std::string(o.model.empty() ? "" : "model-") + o.impl + "-" + o.backend + ".json";
  return o;  // the output paths are checked against each other and the file system by RunOutputs::check
}

// ---- 2. inputs ---------------------------------------------------------------------------

namespace {
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
}  // namespace

// "activations 12.0, buffers 3.5" (MiB), the categories in use.
std::string category_list(const CategoryBytes& b) {
  std::string cats;
  for (int c = 0; c < kNumMemCategories; ++c)
    if (b[static_cast<std::size_t>(c)] > 0)
      cats += strf("%s%s %.1f", cats.empty() ? "" : ", ", category_name(static_cast<MemCategory>(c)),
                   static_cast<double>(b[static_cast<std::size_t>(c)]) / kMiB);
  return cats;
}

std::string gemm_library(const Backend& b) {
  if (b.name() == "cuda") return "cuBLAS";
  if (b.name() == "sim") return "GEMM (cost model)";
  if (b.name() == "cpu")
    return b.device_name().find("OpenBLAS") != std::string::npos ? "cblas_sgemm" : "cpu_sgemm (no BLAS)";
  return b.name() + " GEMM";
}

void add_gemm_path_metrics(json& metrics, const Backend& b, std::optional<GemmPath> forced) {
  if (forced) metrics["gemm_path_forced"] = gemm_path_name(*forced);
#ifdef MOELAB_HAVE_CUDA
  if (is_cuda_backend(b)) metrics["gemm_path_table"] = cuda_gemm_path_table(b).source;
#endif
  // cuda: the paths run; sim with per-path data: the paths priced (Backend::gemm_path_uses).
  const std::vector<GemmPathUse> uses = b.gemm_path_uses();
  if (uses.empty() && b.name() != "cuda") return;
  json taken = json::object();
  for (const GemmPathUse& u : uses) taken[u.op][gemm_path_name(u.path)] = u.calls;
  metrics["gemm_paths_taken"] = taken;
}

HostPoolMark host_pool_window(const HostPoolMark& start, const HostPoolMark& end) {
  if (!start.valid || !end.valid) return {};
  return {true, end.requests - start.requests, end.raw_allocs - start.raw_allocs, end.raw_releases - start.raw_releases};
}

void warn_host_pool(const Backend& b, const HostPoolMark& w) {
  if (w.valid && (w.raw_allocs > 0 || w.raw_releases > 0))
    std::fprintf(stderr,
                 "moelab: warning (rank %d): the pinned host pool called the driver in the timed steps (%llu "
                 "cudaHostAlloc, %llu cudaFreeHost): the warm-up left it short, and the step times include "
                 "page-locking (more --warmup steps avoid it)\n",
                 b.rank(), static_cast<unsigned long long>(w.raw_allocs), static_cast<unsigned long long>(w.raw_releases));
}

HostPoolMark host_pool_mark(const Backend& b) {
  HostPoolMark m;
#ifdef MOELAB_HAVE_CUDA
  if (!is_cuda_backend(b)) return m;
  const HostPool::Stats st = cuda_host_pool_stats(b);
  m = {true, st.requests, st.raw_allocs, st.raw_releases};
#else
  (void)b;
#endif
  return m;
}

void add_host_pool_metrics(json& metrics, const Backend& b, const HostPoolMark& w) {
#ifdef MOELAB_HAVE_CUDA
  if (!w.valid || !is_cuda_backend(b)) return;
  metrics["host_pool"] = {{"timed_requests", w.requests},
                          {"timed_driver_allocations", w.raw_allocs},
                          {"timed_driver_releases", w.raw_releases},
                          {"peak_bytes_held", cuda_host_pool_stats(b).peak_bytes_held}};
#else
  (void)metrics, (void)b, (void)w;
#endif
}

std::string floor_gemm_library(const Backend& b) {
  if (b.name() == "cuda") return "cublasGemmStridedBatchedEx";
  if (b.prices_gemm_paths()) return "GEMM (cost model), strided-batched curve";
  return gemm_library(b) + ", one by one";
}

double floor_gemm_seconds(Backend& b, MoELayer& layer, double layer_flops, int reps) {
  const std::vector<GemmProblem> floor = layer.expert_floor_problems();
  const double floor_flops = cost_grouped_gemm(floor).flops;
  if (!(floor_flops > 0)) return 0.0;
  return b.time_batched_gemms(floor, reps) * layer_flops / floor_flops;
}

int run_on_rank(Backend& b, Communicator& c, const RunOptions& opt, const WorkloadConfig& w, const Platform& platform,
                RunOutputs* outputs, bool preflight = false);

int run_command(const std::vector<std::string>& args) {
  const RunOptions opt = parse_run_options(args);
  if (opt.help) {
    if (world_rank() == 0) print_run_help(stdout);
    return 0;
  }
  if (!opt.model.empty()) return run_model_command(opt);
  const int world = world_size();

  // ---- 1. validation: nothing below this block writes a file or starts work unless all of
  //         it passed on every rank.
  check_impl_name(opt.impl);
  if (opt.backend == "sim") {
    // A simulated cluster: every rank is a thread of this one process. Everything that can be
    // checked is checked before the cluster is built (a large one takes a while to build).
    if (world > 1) throw ConfigError("--backend sim runs every simulated rank in one process: start it without mpirun");
    WorkloadConfig w = load_workload(opt.workload);
    if (opt.steps > 0) w.steps = opt.steps;
    SimOptions so;
    so.cluster = sim::load_cluster(opt.cluster);
    const int n = sim_world_size(so.cluster, opt.ranks);
    validate_for_world(w, n);
    check_impl_options(opt.impl, opt.impl_options, {w.model, n, w.tokens_per_rank});
    if (!opt.profile.empty()) so.profile = sim::load_profile(opt.profile);
    so.routing = RoutingModel::parse(opt.routing, w.seed);
    so.ranks = opt.ranks;
    sim::check_forced_gemm_path(so.cluster, opt.gemm_path);
    so.gemm_path = opt.gemm_path;
    RunOutputs outputs;
    RunOutputs::check(opt);
    outputs.lock(opt);
    SimCluster cluster(std::move(so));
    Platform platform{sim::to_json(cluster.options().cluster), cluster.calibration(),
                      cluster.options().routing.describe()};
    int rc = 0;
    // A ConfigError met by the implementation on a simulated rank (an option that does not
    // fit the run) stops every rank of this one process: exit 2, one message (main.cpp).
    cluster.run([&](Backend& b, Communicator& c) {
      if (!b.supports(w.model.dtype))
        throw Unsupported(shown(w.origin) + ": model.dtype = \"" + std::string(dtype_name(w.model.dtype)) + "\" is not supported by the sim backend");
      const int r = run_on_rank(b, c, opt, w, platform, c.rank() == 0 ? &outputs : nullptr);
      if (c.rank() == 0) rc = r;
    });
    return rc;
  }

  WorkloadConfig w;
  StartedRun run;
  start_run(
      run, opt,
      [&] {
        w = load_workload(opt.workload);
        if (opt.steps > 0) w.steps = opt.steps;
        validate_for_world(w, world);
        check_impl_options(opt.impl, opt.impl_options, {w.model, world, w.tokens_per_rank});
      },
      [&](const Backend& b) {
        if (b.supports(w.model.dtype)) return std::string();
        return shown(w.origin) + ": model.dtype = \"" + dtype_name(w.model.dtype) + "\" is not supported by the " + b.name() +
               " backend" + (b.name() == "cpu" ? " (it computes in fp32; use --backend cuda)" : "");
      },
      [&](Backend& b, Communicator& c) {
        WorkloadConfig one = w;  // one step, no warm-up: the preflight (run_common.hpp)
        one.steps = 1;
        one.warmup = 0;
        run_on_rank(b, c, opt, one, Platform{}, nullptr, true);
      });
  return run_on_rank(*run.backend, *run.comm, opt, w, Platform{}, world_rank() == 0 ? &run.outputs : nullptr);
}

// ---- 2.-5. the run on one rank (a process on cpu/cuda, a thread on sim) --------------------
// outputs: where rank 0 stages its files (null on the other ranks). preflight: stop after the
// steps (start_run's check on a simulated copy of the world).
int run_on_rank(Backend& b, Communicator& c, const RunOptions& opt, const WorkloadConfig& w, const Platform& platform,
                RunOutputs* outputs, bool preflight) {
  Backend* backend = &b;
  Communicator* comm = &c;
  const int rank = c.rank(), world = c.size();
  backend->set_allow_tf32(w.model.allow_tf32);

  // From here on every rank has accepted the input; an error is a failure of the run. The
  // layer outlives the handler below (abort_run): its destructor waits for the device.
  std::unique_ptr<MoEImpl> impl;
  try {
    impl = make_impl(opt.impl, *backend, *comm, w.model, opt.impl_options);
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
    if (w.warmup > 0) backend->mark_untimed();  // the warm-up's times are cleared below
    comm->barrier();
    backend->clear_timeline();
    backend->memory().reset_peak();  // the current use (weights, gradients, inputs) stays the base
    backend->reset_device_pool_peak();
    const HostPoolMark pool_start = host_pool_mark(*backend);
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
    const HostPoolMark pool_window = host_pool_window(pool_start, host_pool_mark(*backend));
    warn_host_pool(*backend, pool_window);

    if (preflight) return 0;

    // ---- 4. what this rank measured (memory first: the yardstick allocates) ----------------
    const std::vector<MemSample> mem_samples = backend->memory().timeline();
    std::vector<OpRecord> ops = backend->timeline();
    RankFigures local;
    add_timeline_figures(local, ops, w.steps, {std::begin(kPhases), std::end(kPhases)});
    add_memory_figures(local, *backend);
    local.device = backend->device_name();
    local.step_s = step_s;
    const RoutingStats& routing = impl->routing();
    local.dropped = routing.dropped;
    local.capacity = routing.capacity;
    local.recv_per_local = routing.recv_per_local;
    local.routed = routed;
    double layer_flops = 0;
    {  // the bare GEMMs' scratch goes before the floor's is made
      const std::vector<GemmProblem> gemms = impl->expert_gemms();
      layer_flops = cost_grouped_gemm(gemms).flops;
      local.bare_gemm_s = backend->time_bare_gemms(gemms, 5);
    }
    local.floor_gemm_s = floor_gemm_seconds(*backend, impl->layer(), layer_flops, 5);

    std::vector<RankFigures> ranks;
    for (const auto& s : comm->all_gather_strings(local.encode())) ranks.push_back(RankFigures::decode(s));

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

    // ---- the run's figures: the slowest rank's step, the highest rank's memory -----------------
    RunFigures fig = aggregate(ranks);
    set_layer_time(fig, fig.step_median);  // the step is the layer's forward and backward
    const double step_med = fig.step_median;
    const double global_tokens = static_cast<double>(w.tokens_per_rank) * world;
    const double tokens_per_s = step_med > 0 ? global_tokens / step_med : 0.0;
    const RankFigures& pk = ranks[fig.peak_rank];
    const std::int64_t capacity = ranks[0].capacity;
    const std::string library = gemm_library(*backend);
    const std::string& device = fig.device;

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
    std::printf("step       %.3f ms median, %.3f ms mean (min %.3f, max %.3f)%s\n\n", step_med * 1e3,
                fig.step_mean * 1e3, fig.step_min * 1e3, fig.step_max * 1e3, world > 1 ? ", slowest rank" : "");
    std::printf("%-10s %10s %10s\n", "phase", "ms/step", "% of step");
    auto phase_row = [&](const std::string& p) {
      const auto it = fig.phases_s.find(p);
      const double t = it == fig.phases_s.end() ? 0.0 : it->second;
      std::printf("%-10s %10.3f %9.1f%%\n", p.c_str(), t * 1e3, step_med > 0 ? 100.0 * t / step_med : 0.0);
    };
    for (const char* p : kPhases) phase_row(p);
    for (const auto& [k, v] : fig.phases_s)
      if (std::find(std::begin(kPhases), std::end(kPhases), k) == std::end(kPhases)) phase_row(k);
    std::printf("(summed op time per phase over all streams; overlapping phases can exceed 100%%)\n\n");
    std::printf("experts: %.3f ms of GEMMs vs bare %s %.3f ms for the same GEMMs (ratio %.2f)\n",
                fig.expert_gemm_s * 1e3, library.c_str(), fig.bare_gemm_s * 1e3, fig.expert_vs_bare);
    if (fig.floor_gemm_s > 0)
      std::printf("floor:   %.3f ms, the same FLOPs as balanced batched GEMMs (%s): experts at %.2fx, the layer at "
                  "%.2fx of it\n",
                  fig.floor_gemm_s * 1e3, floor_gemm_library(*backend).c_str(), fig.expert_vs_floor, fig.layer_vs_floor);
    std::printf("expert TFLOP/s  %.3f per device over the experts phase, %.3f over its GEMMs\n", fig.expert_tflops,
                fig.expert_gemm_tflops);
    std::printf("communication   %.3f ms/step, %.1f%% hidden behind compute; exposed %.3f ms (step - compute busy "
                "%.3f ms); bound max(comm, compute) = %.3f ms, step at %.2fx of it\n",
                fig.comm_s * 1e3, 100.0 * fig.overlap_ratio, fig.exposed_comm_s * 1e3, fig.compute_busy_s * 1e3,
                fig.overlap_limit_s * 1e3, fig.overlap_limit_s > 0 ? step_med / fig.overlap_limit_s : 0.0);
    std::string busy;
    for (const auto& [k, v] : fig.stream_busy_s)
      busy += strf("%s%s %.3f ms", busy.empty() ? "" : ", ", k.c_str(), v * 1e3);
    std::printf("stream busy     %s\n", busy.c_str());
    std::printf("peak memory     %.1f MiB%s: %s MiB\n", static_cast<double>(pk.peak_device) / kMiB,
                world > 1 ? strf(" (rank %zu, the highest)", fig.peak_rank).c_str() : "",
                category_list(pk.at_peak).c_str());
    if (fig.pool)
      std::printf("device pool     %.1f MiB in use at most, %.1f MiB held from the driver (cudaMallocAsync pool)\n",
                  static_cast<double>(fig.pool->used_high) / kMiB, static_cast<double>(fig.pool->reserved_high) / kMiB);
    const double slots = global_tokens * m.top_k;
    std::printf("routing         %lld of %.0f token-slots dropped (%s)\n", static_cast<long long>(fig.dropped), slots,
                capacity > 0 ? strf("capacity %lld per expert", static_cast<long long>(capacity)).c_str()
                             : "no capacity limit");

    // ---- the record ------------------------------------------------------------------------
    json metrics = metrics_json(fig, ranks, tokens_per_s, library, floor_gemm_library(*backend),
                                static_cast<int>(dtype_size(m.dtype)));
    add_gemm_path_metrics(metrics, *backend, opt.gemm_path);
    add_host_pool_metrics(metrics, *backend, pool_window);

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
    result["impl_options"] = opt.impl_options;  // as given (--impl-options; {}: the defaults)
    result["impl_report"] = impl->report();
    result["metrics"] = std::move(metrics);

    if (!opt.record_routing.empty()) {
      // calls[call][rank][expert]: what the gate routed in each step (before capacity)
      std::vector<std::vector<std::vector<std::int64_t>>> calls(static_cast<std::size_t>(w.warmup + w.steps));
      for (const auto& r : ranks)
        for (std::size_t i = 0; i < calls.size(); ++i) calls[i].push_back(r.routed[i]);
      outputs->stage(opt.record_routing, routing_trace_json(calls, to_json(w)));
    }
    if (!opt.trace.empty()) {
      // The trace says how it was obtained, like every result (Perfetto ignores the key).
      trace["otherData"] = {{"mode", result["mode"]},         {"backend", result["backend"]},
                            {"device", result["device"]},     {"cluster", platform.cluster.is_null() ? json(nullptr) : platform.cluster["name"]},
                            {"calibration", result["calibration"]}, {"commit", result["commit"]},
                            {"date", result["date"]},         {"workload", w.name},
                            {"impl", opt.impl}};
      outputs->stage(opt.trace, trace, -1);
    }
    outputs->stage(opt.out, result);
    outputs->commit();
    if (!opt.record_routing.empty()) std::printf("routing trace   %s\n", opt.record_routing.c_str());
    if (!opt.trace.empty()) std::printf("trace           %s\n", opt.trace.c_str());
    std::printf("result          %s\n", opt.out.c_str());
    return 0;
  } catch (const std::exception& e) {
    // Past validation, a process among several may fail alone: exit 2 is only safe when every
    // rank agrees, so every rank is stopped now (exit 1; 3 out of memory). The ranks of a
    // simulated cluster are threads of one process, which stops as one: there the error stays
    // what it is (a ConfigError exits 2).
    if (world > 1 && b.name() != "sim") abort_run(rank, e, outputs);
    throw;
  }
}

}  // namespace moelab::cli
