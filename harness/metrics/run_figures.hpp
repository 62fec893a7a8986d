// harness/metrics/run_figures.hpp — what one rank measured over a run's timed window, and
// the figures of the whole run made from every rank's (the slowest rank's step, the
// highest rank's memory, overlap summed over ranks). `moelab run` fills a RankFigures on
// every rank, gathers them on rank 0 (encode/decode), aggregates, prints and records.
// Definitions of each figure: docs/PERFORMANCE.md.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/runtime/backend.hpp"

namespace moelab {

struct RankFigures {
  std::string device;
  std::vector<double> step_s;                    // each timed step
  // Per step, from the timeline: summed op time per phase and per stream (phases that
  // overlap on different streams can add up to more than the step).
  std::map<std::string, double> phases_s;
  std::map<std::string, double> stream_busy_s;
  double expert_flops = 0, expert_gemm_s = 0;    // the experts' GEMMs
  double compute_busy_s = 0, comm_s = 0, hidden_comm_s = 0, copy_s = 0;  // overlap.hpp
  double flops = 0;                              // every op's FLOPs
  // Memory over the window (the tracked allocator; the device pool where there is one).
  std::size_t peak_device = 0;
  CategoryBytes at_peak{}, peak_per_category{};
  std::map<int, std::size_t> microbatch_at_peak;  // bytes each microbatch held at the peak
  std::optional<Backend::DevicePoolPeak> pool;
  // Routing of the MoE layers (summed over a model's MoE layers).
  std::int64_t dropped = 0, capacity = 0;
  std::vector<std::int64_t> recv_per_local;
  std::vector<std::vector<std::int64_t>> routed;  // every gate call (--record-routing)
  double bare_gemm_s = 0;                          // the experts' GEMMs issued bare (one library call each)
  double floor_gemm_s = 0;                         // the same FLOPs as balanced batched GEMMs (the floor)

  std::string encode() const;
  static RankFigures decode(const std::string& s);
};

// Timeline part of a rank's figures (phases listed in `phases` appear even when empty).
void add_timeline_figures(RankFigures& f, const std::vector<OpRecord>& ops, int steps,
                          const std::vector<std::string>& phases);
// Memory part, from the backend's tracker and pool.
void add_memory_figures(RankFigures& f, const Backend& b);

struct RunFigures {
  std::vector<double> steps;  // per timed step, the slowest rank's time
  double step_median = 0, step_mean = 0, step_min = 0, step_max = 0;
  std::map<std::string, double> phases_s, stream_busy_s;  // the highest rank's
  double expert_tflops = 0, expert_gemm_tflops = 0;       // averaged over ranks
  double expert_gemm_s = 0, bare_gemm_s = 0, expert_vs_bare = 0;
  double floor_gemm_s = 0, expert_vs_floor = 0;  // the slowest rank's floor; expert_gemm_s over it
  // The MoE layer's own time per step, set by the caller (a layer run: its step; a model run:
  // the layers' phases), and its ratio to the floor (0 when there is no floor).
  double layer_s = 0, layer_vs_floor = 0;
  double comm_s = 0, compute_busy_s = 0, exposed_comm_s = 0, overlap_ratio = 1, overlap_limit_s = 0, copy_s = 0;
  double flops_per_rank_max = 0;
  std::size_t peak_rank = 0;           // the rank with the highest device peak
  std::optional<Backend::DevicePoolPeak> pool;  // the most any rank had in use, and held
  std::size_t pool_rank = 0;                     // the rank with the most in use
  std::int64_t dropped = 0;
  std::vector<std::int64_t> recv_per_local;  // every rank's, in rank order
  std::string device;                        // distinct device names joined by " | "
};

RunFigures aggregate(const std::vector<RankFigures>& ranks);
// Sets f.layer_s and f.layer_vs_floor.
void set_layer_time(RunFigures& f, double layer_s);

// The record's "metrics" object for these figures (docs/RESULTS-SCHEMA.md). gemm_library
// names what timed bare_gemm_s, floor_library what timed floor_gemm_s. param_elem_bytes: the
// bytes of one parameter element (0: unknown), for the peak with Adam's state
// (peak_memory_bytes.optimizer_state: the run's own optimizer's, or Adam's added).
nlohmann::json metrics_json(const RunFigures& f, const std::vector<RankFigures>& ranks, double tokens_per_s,
                            const std::string& gemm_library, const std::string& floor_library,
                            int param_elem_bytes = 0);
// Bytes of Adam's state per byte of parameters of param_elem_bytes each: fp32 parameters keep
// two fp32 moments (8 bytes per 4-byte parameter: 2); 16-bit parameters under mixed precision
// keep an fp32 master copy and two fp32 moments (12 bytes per parameter, ZeRO (Rajbhandari et
// al., SC'20) §3.1: K = 12; 12 / 2 = 6). 0 for other sizes.
double adam_state_factor(int param_elem_bytes);
nlohmann::json category_json(const CategoryBytes& b);

double median(std::vector<double> v);

}  // namespace moelab
