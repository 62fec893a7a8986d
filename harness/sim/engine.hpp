// harness/sim/engine.hpp — the discrete-event engine of the sim backend.
//
// Input: a DAG of tasks. Each task waits for its dependencies, then for a fixed latency
// (kernel launch, a message's alpha), then consumes amounts of shared resources (FLOPs of a
// GPU's SMs, bytes of its HBM, of an NVLink port, a PCIe switch uplink, a NIC) that all
// progress together: it ends when its work is done. Output: every task's start and end.
//
// Sharing (a fluid model; docs/PERFORMANCE.md gives the formulas):
//   * A task alone runs at rate 1 / max_d(amount_d / capacity_d): its slowest demand binds.
//   * Concurrent tasks share each resource max-min fairly (progressive filling): no task gets
//     more of a resource than an equal share unless others cannot use theirs.
//   * Interference: a task of class v (the victim) on GPU g progresses at factor(v, a) times its
//     fair rate while g also runs a task of another class a (the aggressor; compute, comm,
//     memcpy): a matrix victim x aggressor. With two aggressor classes running, the smaller of
//     the two factors applies (the strongest aggressor binds). Factors are in (0, 1]; 1 = no
//     slowdown. MPipeMoE's sigma (compute), mu (comm) and eta (memcpy) are the single-factor
//     case: one factor per victim for either aggressor.
// Events are processed in time order; ties are broken by task id, so the same graph always
// gives the same times, bit for bit.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace moelab::sim {

enum class WorkClass { none, compute, comm, memcpy };
const char* work_class_name(WorkClass c);

struct Demand {
  int resource = 0;    // id from Engine::add_resource
  double amount = 0;   // units of the resource's capacity (FLOPs, bytes)
};

struct Task {
  std::string name;
  int rank = -1;             // for reports only
  int gpu = -1;              // GPU whose interference applies; -1: none
  WorkClass cls = WorkClass::none;
  double latency = 0;        // seconds between ready and the first unit of work
  std::vector<Demand> demands;
  std::vector<int> deps;     // ids of tasks that must end first (any order of ids)
  // filled by run()
  double ready = 0, start = 0, end = 0;  // start = ready + latency
};

class Engine {
 public:
  int add_resource(std::string name, double capacity);  // capacity > 0, units per second
  int add_task(Task t);                                 // returns its id (0, 1, 2, ...)
  // factor(victim, aggressor) for one pair; victim != aggressor, neither none.
  void set_interference(WorkClass victim, WorkClass aggressor, double factor);
  double interference(WorkClass victim, WorkClass aggressor) const;
  // The single-factor form: the same factor for both aggressors of `victim`.
  void set_interference(WorkClass victim, double factor);
  // The smallest factor of `victim` over its aggressors (its slowdown beside all other work).
  double interference(WorkClass victim) const;

  // Computes ready/start/end of every task. Throws std::invalid_argument for a dependency
  // cycle, an unknown id, a non-positive capacity or a negative amount.
  void run();

  const Task& task(int id) const { return tasks_[static_cast<std::size_t>(id)]; }
  std::size_t num_tasks() const { return tasks_.size(); }
  const std::string& resource_name(int id) const { return res_name_[static_cast<std::size_t>(id)]; }
  double resource_capacity(int id) const { return res_cap_[static_cast<std::size_t>(id)]; }
  std::size_t num_resources() const { return res_cap_.size(); }
  double makespan() const;  // latest end (0 for no tasks)
  // Busy time of a resource: total time during which at least one task used it.
  double busy_time(int resource) const;

 private:
  std::vector<std::string> res_name_;
  std::vector<double> res_cap_;
  std::vector<Task> tasks_;
  double factor_[4][4] = {{1, 1, 1, 1}, {1, 1, 1, 1}, {1, 1, 1, 1}, {1, 1, 1, 1}};  // [victim][aggressor]
  std::vector<double> res_busy_;
};

}  // namespace moelab::sim
