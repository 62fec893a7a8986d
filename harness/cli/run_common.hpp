// harness/cli/run_common.hpp — what `moelab run` shares between its two kinds of run: one
// MoE layer from a workload file (run.cpp) and a whole model from a model file
// (run_model.cpp): the options, their checks, and the platform a result records.
#pragma once
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/comm/communicator.hpp"
#include "harness/runtime/backend.hpp"

namespace moelab::cli {

constexpr double kMiB = 1024.0 * 1024.0;

struct RunOptions {
  std::string workload, model, impl, backend, out, trace;
  std::string cluster, profile, routing = "uniform", record_routing;  // sim; trace recorder
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
  bool help = false;
};

// What the run is on: for sim, the cluster model and calibration; the result records it.
struct Platform {
  nlohmann::json cluster = nullptr;  // sim: the cluster model
  std::string calibration;           // sim: profile name or "datasheet"
  std::string routing;               // sim: the routing model
};

RunOptions parse_run_options(const std::vector<std::string>& args);
// The file is written at the end: check now that it can be (exit 2 otherwise).
void check_output_path(const std::string& path, const std::string& flag);
void check_impl_name(const std::string& name);
// Bad input seen by only some ranks stops every rank the same way.
void agree_on_errors(Communicator& comm, const std::string& local_error);
std::string strf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string category_list(const CategoryBytes& b);  // "activations 12.0, buffers 3.5" (MiB)
std::string gemm_library(const Backend& b);

// `moelab run --model`: harness/cli/run_model.cpp.
int run_model_command(const RunOptions& opt);

}  // namespace moelab::cli
