// harness/cli/main.cpp — the moelab command line: subcommands and what an error does.
//
//   moelab run --workload experiments/workloads/tiny.json --impl fastmoe --backend cpu
//   mpirun -n 2 moelab run --workload experiments/workloads/tiny.json --impl fastmoe --backend cpu
//   moelab list
//   moelab schedule --schedule group-interleaved --pp 4 --microbatches 8
//   moelab --help, moelab run --help
//
// Exit status: 0 success; 2 bad input (a workload file, a flag, an implementation's option, a
// request the backend cannot serve), found before any work starts and with nothing written;
// 3 out of memory (the run cannot fit: found before any work where it can be, else an
// allocation that failed); 1 a failure during the run, after which every rank is aborted (a
// rank left waiting in a collective would hang). An error found before any work is agreed by
// every rank, so every rank exits with the same status and rank 0 alone prints it. A failure
// during the run of one process among several is printed and aborts the world at once
// (cli::abort_run), before the run's objects wait on the device; a rank stopped by a signal
// (mpirun's SIGTERM after another rank's abort, Ctrl-C) first removes the output locks, staged
// files and folders it made (RunOutputs).
#include <algorithm>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <new>
#include <string>
#include <vector>

#include "harness/cli/run_common.hpp"
#include "harness/comm/world.hpp"
#include "harness/config/json_fields.hpp"
#include "harness/config/model.hpp"
#include "harness/nn/moe_impl.hpp"
#include "harness/sim/cluster.hpp"
#include "harness/runtime/error.hpp"

namespace moelab::cli {

// harness/cli/run.cpp
int run_command(const std::vector<std::string>& args);
int calibrate_command(const std::vector<std::string>& args);
int schedule_command(const std::vector<std::string>& args);  // harness/cli/schedule_cmd.cpp
void print_run_help(std::FILE* to);

namespace {

void print_help(std::FILE* to) {
  std::fputs(
      "moelab — reference implementations and a benchmark harness for MoE training systems\n"
      "\n"
      "usage: moelab <command> [options]\n"
      "\n"
      "commands:\n"
      "  run    run one workload with one implementation on one backend, print the per-phase\n"
      "         table and write the result file (JSON)\n"
      "  list   the implementations, backends, cluster models and model files (with their\n"
      "         parameter counts) this binary knows\n"
      "  calibrate  measure this device and write a profile for the sim backend\n"
      "  schedule   a pipeline schedule as data: each stage's order, its timing estimate and\n"
      "         activation memory, with PipeOffload's offload pass\n"
      "\n"
      "`moelab <command> --help` shows a command's options. Several ranks (expert parallelism)\n"
      "are launched with mpirun (or srun): mpirun -n 4 moelab run ...\n",
      to);
}

int list_command(const std::vector<std::string>& args) {
  if (!args.empty() && (args[0] == "--help" || args[0] == "-h")) {
    std::puts(
        "usage: moelab list\n\nThe implementations (--impl) and backends (--backend) of this binary, the cluster\n"
        "models (--cluster) and the model files of experiments/models/ with their parameter counts.");
    return 0;
  }
  if (!args.empty()) throw ConfigError("moelab list takes no arguments, got \"" + shown(args[0]) + "\"");
  if (world_rank() != 0) return 0;
  std::puts("implementations (--impl):");
  for (const auto& name : impl_names()) std::printf("  %s\n", name.c_str());
  std::puts("backends (--backend):");
  std::printf("  cpu    %s\n", make_backend("cpu")->device_name().c_str());
#ifdef MOELAB_HAVE_CUDA
  if (cuda_available()) {
    std::string device = "a CUDA device";
    try {
      device = make_backend("cuda")->device_name();
    } catch (const std::exception& e) {
      device = std::string("present, but it failed to start: ") + e.what();
    }
    std::printf("  cuda   available: %s\n", device.c_str());
  } else {
    std::puts("  cuda   built, but no CUDA device is available on this machine");
  }
#else
  std::puts("  cuda   not built (needs nvcc and NCCL at configure time)");
#endif
  std::puts("  sim    a simulated cluster (--cluster NAME), every rank in this process");
  std::puts("cluster models (--cluster, for --backend sim):");
  for (const auto& name : sim::cluster_names()) {
    const auto m = sim::load_cluster(name);
    std::printf("  %-12s %d x %s, %s\n", name.c_str(), m.world_size(), m.gpu.name.c_str(), m.description.c_str());
  }
  // Parameters as moelab builds the model (harness/config/model.hpp, ParamCounts).
  const std::filesystem::path models = std::filesystem::path(sim::experiments_dir()) / "models";
  std::vector<std::filesystem::path> files;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(models, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().extension() == ".json") files.push_back(it->path());
  std::sort(files.begin(), files.end());
  std::printf("models (%s), parameters:\n", models.string().c_str());
  for (const auto& f : files) {
    const ParamCounts p = load_transformer(f.string()).parameter_counts();
    std::printf("  %-18s %11lld = embedding %lld + attention %lld + dense MLP %lld + experts %lld + gates %lld + norms %lld",
                f.stem().string().c_str(), static_cast<long long>(p.total), static_cast<long long>(p.embedding),
                static_cast<long long>(p.attention), static_cast<long long>(p.dense_mlp),
                static_cast<long long>(p.experts), static_cast<long long>(p.gates), static_cast<long long>(p.norms));
    if (p.merging > 0) std::printf(" + patch merging %lld", static_cast<long long>(p.merging));
    std::printf("\n");
  }
  return 0;
}

int dispatch(const std::vector<std::string>& args) {
  if (args.empty()) {
    print_help(stderr);
    return 2;
  }
  const std::string& cmd = args[0];
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  if (cmd == "--help" || cmd == "-h" || cmd == "help") {
    if (cmd == "help" && !rest.empty() && rest[0] == "run")
      print_run_help(stdout);
    else
      print_help(stdout);
    return 0;
  }
  if (cmd == "run") return run_command(rest);
  if (cmd == "list") return list_command(rest);
  if (cmd == "calibrate") return calibrate_command(rest);
  if (cmd == "schedule") return schedule_command(rest);
  throw ConfigError("unknown command \"" + shown(cmd) + "\" (commands: run, list, calibrate, schedule; see moelab --help)");
}

}  // namespace
}  // namespace moelab::cli

int main(int argc, char** argv) {
  using namespace moelab;
  init_world(&argc, &argv);
  const std::vector<std::string> args(argv + 1, argv + argc);
  int code = 0;
  try {
    register_builtin_impls();
    code = cli::dispatch(args);
  } catch (const ConfigError& e) {
    // Bad input is found the same way on every rank (run agrees on it across ranks before
    // any collective), so every rank exits 2 and one of them says why.
    if (world_rank() == 0) std::fprintf(stderr, "moelab: error: %s\n", e.what());
    code = 2;
  } catch (const Unsupported& e) {
    if (world_rank() == 0) std::fprintf(stderr, "moelab: error: %s\n", e.what());
    code = 2;
  } catch (const cli::AgreedOutOfMemory& e) {
    // Found before any work and agreed by every rank (cli::start_run): no rank is left waiting.
    if (world_rank() == 0) std::fprintf(stderr, "moelab: error: %s\n", e.what());
    code = 3;
  } catch (const OutOfMemory& e) {
    // The configuration does not fit: exit 3 (scripts record such a point as out of memory).
    std::fprintf(stderr, "moelab: error: %s\n", e.what());
    std::fflush(stderr);
    if (world_size() > 1) abort_world(3);
    code = 3;
  } catch (const std::bad_alloc&) {
    // An allocation the preflight did not foresee (memory other processes took meanwhile,
    // say): still out of memory, exit 3, not a crash.
    std::fprintf(stderr, "moelab: error (rank %d): %s\n", world_rank(), cli::kBadAllocMessage);
    std::fflush(stderr);
    if (world_size() > 1) abort_world(3);
    code = 3;
  } catch (const std::exception& e) {
    // CommError and everything else: this rank cannot go on, and the others may be
    // waiting for it in a collective, so the whole world is stopped.
    std::fprintf(stderr, "moelab: error (rank %d): %s\n", world_rank(), e.what());
    std::fflush(stderr);
    abort_world(1);
  }
  std::fflush(stdout);
  finalize_world();
  return code;
}
