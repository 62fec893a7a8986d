// harness/cli/run_common.hpp — what `moelab run` shares between its two kinds of run: one
// MoE layer from a workload file (run.cpp) and a whole model from a model file
// (run_model.cpp): the options, the checks before any work (run_checks.cpp), the files a run
// writes, and the platform a result records.
#pragma once
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/comm/communicator.hpp"
#include "harness/runtime/backend.hpp"
#include "harness/runtime/error.hpp"
#include "harness/sim/cluster.hpp"

namespace moelab {
class MoELayer;
}

namespace moelab::cli {

constexpr double kMiB = 1024.0 * 1024.0;

struct RunOptions {
  std::string workload, model, impl, backend, out, trace;
  std::string cluster, profile, routing = "uniform", record_routing;  // sim; trace recorder
  // --gemm-path: the experts' grouped GEMMs pinned to one path where it can run (cuda and sim;
  // harness/runtime/gemm_paths.hpp, force_gemm_path); nullopt ("auto"): the table chooses.
  std::optional<GemmPath> gemm_path;
  nlohmann::json impl_options = nlohmann::json::object();
  int steps = 0;  // 0: the workload's (model runs: 3)
  int ranks = 0;  // sim: 0 = every GPU of the cluster
  // --model runs
  nlohmann::json model_override = nlohmann::json::object();  // merge patch over the model file
  int first_layer = 0, last_layer = -1;                       // --layers A:B
  std::int64_t micro_batch = 1;                                // sequences per microbatch
  int microbatches = 1;                                        // per step (gradient accumulation)
  int warmup = -1;                                             // -1: the workload's (model runs: 1)
  std::uint64_t seed = 1;
  std::string optimizer = "adam";                              // adam, sgd or none
  double lr = 1e-3;
  // Parallel layout and pipeline (harness/comm/groups.hpp, harness/pipeline/): any of them set
  // runs the model through the pipeline executor on the layout's process groups.
  std::string parallel;                                        // --parallel tp=..,pp=..,dp=..,ep=..,etp=..
  std::string schedule;                                        // --schedule (default 1f1b)
  int chunks = 0;                                              // --chunks v (interleaved)
  std::string recompute;                                       // --recompute none|full
  int group = 0;                                               // --group g (group-interleaved; 0: ceil(pp/2))
  int offload_chunks = 0;                                      // --offload-chunks k (PipeOffload; -1: all)
  bool offload_lifespan = true;                                // --offload-all-lifespans turns the peak rule off
  bool pad_layers = false;                                     // --pad-layers: the uneven split
  bool sequence_parallel = false;                              // --sequence-parallel (with tp > 1)
  bool zero1 = false;                                          // --zero1: Adam's states sharded over DP
  std::int64_t grad_bucket = 0;                                // --grad-bucket N elements (0: 40M)
  bool inference = false;                                      // --inference: forward passes only
  std::string offload_experts = "none";                        // --offload-experts none|sync|async (inference)
  std::string data;                                            // --data FILE[,FILE...]|markov:K (harness/nn/text_data.hpp)
  int eval_every = 0;                                          // --eval-every N steps: validation loss (0: never)
  int eval_batches = 4;                                        // --eval-batches N microbatches per evaluation
  // Training through the pipeline executor. With --inference, --parallel only places the ranks
  // (data × expert parallel replicas of the whole model; run_model.cpp).
  bool pipelined() const {
    return (!parallel.empty() && !inference) || !schedule.empty() || chunks != 0 || !recompute.empty() ||
           sequence_parallel || zero1 || grad_bucket != 0 || group != 0 || offload_chunks != 0 || pad_layers ||
           !offload_lifespan;
  }
  bool help = false;
};

// What the run is on: for sim, the cluster model and calibration; the result records it.
struct Platform {
  nlohmann::json cluster = nullptr;  // sim: the cluster model
  std::string calibration;           // sim: profile name or "datasheet"
  std::string routing;               // sim: the routing model
};

RunOptions parse_run_options(const std::vector<std::string>& args);
void check_impl_name(const std::string& name);
std::string strf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string category_list(const CategoryBytes& b);  // "activations 12.0, buffers 3.5" (MiB)
std::string gemm_library(const Backend& b);
std::string floor_gemm_library(const Backend& b);
// cuda: metrics.gemm_path_table (the crossover table's source) and metrics.gemm_paths_taken
// ({op name: {path: calls}}, warm-up included: harness/runtime/gemm_paths.hpp); others: nothing.
// Both cuda and sim, with --gemm-path: metrics.gemm_path_forced (the path's name).
void add_gemm_path_metrics(nlohmann::json& metrics, const Backend& b, std::optional<GemmPath> forced);
// cuda: the pinned host pool's counters (harness/runtime/host_pool.hpp) at the start and the
// end of the timed window, and from them metrics.host_pool (this rank's, rank 0's in the
// result): the pinned allocations the timed steps asked for, how many of them the pool had to
// get from the driver (cudaHostAlloc) and how many blocks it gave back (cudaFreeHost, which
// synchronises the device), and the most it held. A steady state gets nothing from the driver;
// a count above 0 (also warned on stderr, by every rank) says the warm-up left the pool short
// and the step times include page-locking. Others: nothing.
struct HostPoolMark {
  bool valid = false;
  std::uint64_t requests = 0, raw_allocs = 0, raw_releases = 0;
};
HostPoolMark host_pool_mark(const Backend& b);
// What the pool did between two marks (invalid unless both are).
HostPoolMark host_pool_window(const HostPoolMark& start, const HostPoolMark& end);
void warn_host_pool(const Backend& b, const HostPoolMark& window);
void add_host_pool_metrics(nlohmann::json& metrics, const Backend& b, const HostPoolMark& window);
// The GEMM floor of one MoE layer's last forward+backward (MoELayer::expert_floor_problems,
// timed by Backend::time_batched_gemms), scaled to `layer_flops`, the FLOPs of its
// expert_gemm_problems: the floor's time for exactly the layer's expert FLOPs. 0 without rows.
double floor_gemm_seconds(Backend& b, MoELayer& layer, double layer_flops, int reps);
// A user's value (a path, a flag's text) as one short line for a message.
std::string shown(const std::string& value);

// ---- the checks before a run (harness/cli/run_checks.cpp) ----------------------------------

// Bad input seen by only some ranks stops every rank the same way: ConfigError (exit 2) on
// every rank, or AgreedOutOfMemory (exit 3) when the first failing rank's error was
// `out_of_memory`. Rank 0 alone prints (main.cpp).
void agree_on_errors(Communicator& comm, const std::string& local_error, bool out_of_memory = false);
// A failure during the run of one process among several (cpu or cuda under mpirun): prints it
// naming the rank and aborts every rank at once (exit 3 if out of memory, else 1), before the
// run's objects are destroyed: their destructors wait for the device, which may be waiting in
// a collective the other ranks will never join. Call it from a handler whose try block does
// not own those objects. outputs (rank 0's, or null): its staged files, locks and new folders
// are removed first, as its destructor would.
class RunOutputs;
[[noreturn]] void abort_run(int rank, const std::exception& e, RunOutputs* outputs);
// What a std::bad_alloc is reported as (main.cpp, abort_run).
inline constexpr const char* kBadAllocMessage =
    "out of host memory: an allocation failed (std::bad_alloc); the run needs more memory than this machine could "
    "give it";
// Found before any work and agreed by every rank: exit 3 everywhere, no abort, one message.
struct AgreedOutOfMemory : OutOfMemory {
  using OutOfMemory::OutOfMemory;
};

// The files a run writes (--out, --trace, --record-routing), from validation to the end.
//   check()   before any work: the paths resolved (symlinks, "..") name different files, none
//             is a folder or a device, and a file can be created in each one's folder (a
//             temporary file is made and removed: access(2) tells root yes on /proc).
//   lock()    for the whole run, after every check passed: flock on "<file>.lock" of each
//             output, so that a second run into the same files fails at once (exit 2, naming
//             the first's pid) instead of mixing its files with the first's. The folders are
//             created here, and removed again when the run ends without its files. The lock
//             files are removed at the end.
//   stage()   writes a file under a unique temporary name beside its destination;
//   commit()  renames every staged file at the very end (the result last). A run that fails
//             before leaves none of them: the destructor removes what was staged.
class RunOutputs {
 public:
  RunOutputs() = default;
  RunOutputs(const RunOutputs&) = delete;
  RunOutputs& operator=(const RunOutputs&) = delete;
  ~RunOutputs();

  static void check(const RunOptions& opt);
  void lock(const RunOptions& opt);
  void stage(const std::string& path, const nlohmann::json& j, int indent = 2);
  void commit();
  // Removes what was staged and not committed, the locks and the folders lock() made (empty
  // ones only); the destructor does the same.
  void abandon();

 private:
  // Hands the paths to remove to the handler of SIGTERM, SIGINT and SIGHUP (run_checks.cpp).
  void publish() const;
  struct Held {
    std::string path;
    int fd;
  };
  std::vector<Held> locks_;
  std::vector<std::pair<std::string, std::string>> staged_;  // (temporary, destination)
  std::vector<std::filesystem::path> created_;                // folders lock() made, deepest first
};

// The ranks a simulated run has: --ranks, or the whole cluster (ConfigError beyond it).
int sim_world_size(const sim::ClusterModel& cluster, int ranks);

// A cpu or cuda run (one process per rank), started only once every check passed on every
// rank, in an order that keeps the ranks in step:
//   1. validate(): the input as this rank sees it (a file may be missing on one node only);
//      unsupported(backend): why this backend cannot serve the run, "" when it can;
//   2. agreement over the world communicator;
//   3. rank 0: the run's own program cut to one step (one_step) on a simulated copy of this
//      world, shapes only: an implementation's options meet the run exactly as they will
//      (bad ones are ConfigErrors found here, before any rank allocates), and the memory one
//      rank holds is measured; on cpu, that times the ranks on this host must fit in the
//      memory the machine has available (exit 3 otherwise, naming the sizes); the outputs
//      are locked;
//   4. agreement again.
// Bad input: ConfigError or AgreedOutOfMemory on every rank, rank 0 prints.
struct StartedRun {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Communicator> comm;
  RunOutputs outputs;  // locked on rank 0
};
// --profile on --backend cuda: the profile's measured GEMM-path table becomes the table the
// cuda backend chooses each grouped call's cuBLAS path by (harness/runtime/gemm_paths.hpp).
// read_gemm_path_profile: ConfigError for a bad profile file or one without "gemm_paths";
// install_gemm_path_table: ConfigError for a profile measured on another device (its "device"
// differs from Backend::device_name).
sim::Profile read_gemm_path_profile(const std::string& profile_path);
void install_gemm_path_table(Backend& b, const sim::Profile& p, const std::string& profile_path);

void start_run(StartedRun& run, const RunOptions& opt, const std::function<void()>& validate,
               const std::function<std::string(const Backend&)>& unsupported,
               const std::function<void(Backend&, Communicator&)>& one_step);

// What the machine can still give: MemAvailable (/proc/meminfo; sysconf elsewhere), less
// where the process's cgroup sets a lower limit. 0: unknown.
std::uint64_t host_memory_available();

// `moelab run --model`: harness/cli/run_model.cpp.
int run_model_command(const RunOptions& opt);

}  // namespace moelab::cli
