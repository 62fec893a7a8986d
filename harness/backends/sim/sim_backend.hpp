// harness/backends/sim/sim_backend.hpp — the sim backend: the same implementation code on a
// virtual cluster.
//
// Every rank of the simulated cluster runs the unchanged program (the MoE layer, `moelab
// run`'s loop) on its own host thread, against a SimBackend and a SimCommunicator. Tensors
// carry shapes, not data (small tensors — counts, scalars, routing metadata — keep real
// bytes so that routing decisions reach the host as they would from a real gate). Every op
// becomes a task of a dependency graph: its stream's previous op, the events it waits on and
// the host's last synchronisation; its cost descriptor becomes demands on the cluster's
// resources (harness/sim/cluster.hpp). Collectives become point-to-point flows over the
// topology; a communicator split into groups runs its collectives among its members' GPUs
// only. The discrete-event engine (harness/sim/engine.hpp) turns the graph into times at
// every barrier over all ranks (the world communicator or a dup of it); if every rank was
// idle there, the times are final and the graph starts afresh from that instant.
//
// Tokens per expert come from a routing model instead of a real gate: uniform, Zipf skew,
// or a trace recorded from a real run (`moelab run --record-routing`). Same seed, same
// routing, same times: the simulation is deterministic.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/comm/communicator.hpp"
#include "harness/runtime/backend.hpp"
#include "harness/sim/cluster.hpp"

namespace moelab {

struct RoutingModel {
  enum class Kind { uniform, zipf, trace };
  Kind kind = Kind::uniform;
  double zipf_s = 1.0;          // Zipf exponent: expert of popularity rank i gets weight 1/i^s
  std::uint64_t seed = 1;
  std::string trace_path;
  // trace[call][rank][expert]: slots routed (before capacity) by gate call `call` of `rank`
  std::vector<std::vector<std::vector<std::int64_t>>> trace;

  // "uniform", "zipf:1.2", "trace:FILE". Throws ConfigError.
  static RoutingModel parse(const std::string& spec, std::uint64_t seed);
  std::string describe() const;
  // Slots routed to each of `experts` experts when `tokens` tokens each choose `top_k`
  // distinct experts, for the `call`-th gate call of `rank`.
  std::vector<std::int64_t> draw(int rank, std::int64_t call, std::int64_t tokens, int top_k,
                                 std::int64_t experts) const;
};

// Records what a real gate routed, per call and rank, as a trace the routing model replays.
nlohmann::json routing_trace_json(const std::vector<std::vector<std::vector<std::int64_t>>>& per_call_rank_expert,
                                  const nlohmann::json& workload);

struct SimOptions {
  sim::ClusterModel cluster;
  std::optional<sim::Profile> profile;
  RoutingModel routing;
  int ranks = 0;  // 0: the whole cluster; else the first `ranks` GPUs of it
  // Every grouped GEMM priced on this path where it can run (sim::Topology::force_gemm_path);
  // nullopt: the calibration's crossover table chooses, as the cuda backend's does.
  std::optional<GemmPath> gemm_path;
  // Shapes only (moelab run's preflight of a cpu/cuda run: input checks and memory): nothing
  // here is timed, so work that would time itself on a group (Backend::clock_moves_in_group)
  // runs with the clock as it is instead of being refused.
  bool shapes_only = false;
};

class SimCluster {
 public:
  explicit SimCluster(SimOptions options);
  ~SimCluster();
  SimCluster(const SimCluster&) = delete;
  SimCluster& operator=(const SimCluster&) = delete;

  int size() const;
  const SimOptions& options() const;
  // Runs program(backend, world communicator) once per rank, each on its own thread. If a
  // rank throws, the others are released from any rendezvous with a CommError and the first
  // failure is rethrown here after every thread has stopped.
  void run(const std::function<void(Backend&, Communicator&)>& program);
  Backend& backend(int rank);
  // Bytes `rank` sent over each link class (NVLink, PCIe, NIC) by the collectives in its
  // timeline: counted where the times become final and reset by clear_timeline(), so they
  // describe the same ops as timeline(). A flow inside a GPU (to itself) crosses no link.
  sim::LinkBytes link_bytes(int rank) const;
  std::string calibration() const;  // profile name, or "datasheet"

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// SimCluster::link_bytes for the rank that `b` simulates, from inside a program; Unsupported
// for a backend other than sim.
sim::LinkBytes sim_link_bytes(const Backend& b);
// The same bytes split by collective ("all_to_all", "all_reduce", "all_gather",
// "reduce_scatter", "send_recv"): which traffic crossed which links.
std::map<std::string, sim::LinkBytes> sim_link_bytes_by_collective(const Backend& b);

}  // namespace moelab
