// impls/mpipemoe/strategy.hpp — MPipeMoE's restore strategies (§III-D) and the adaptive
// choice between them (§III-E, Eq. 10). Pure functions: no backend, no communicator.
//
// With memory reuse, a partition's T_DI [b,M] and T_M [b,H] are overwritten by the next
// partition, so backward must get them back:
//   S1  T_DI offload,          T_M offload      (copies to pinned host memory and back)
//   S2  T_DI re-communicated,  T_M offload      (the dispatch all-to-all re-run from T_I)
//   S3  T_DI offload,          T_M recomputed   (FC1 re-run from the restored T_DI)
//   S4  T_DI re-communicated,  T_M recomputed
// "none" is no reuse: every partition keeps its own tensors (pipelining only).
//
// Work vectors Q = [GEMMs, all-to-alls, copies in units of b·M] (a T_M copy counts H/M = 4),
// forward and backward (mpipemoe.md, table of §III-D):
//   none [2,2,0] + [4,2,0]   S1 [2,2,5] + [4,2,5]   S2 [2,2,4] + [4,3,4]
//   S3   [2,2,1] + [5,2,1]   S4 [2,2,0] + [5,3,0]
#pragma once
#include <array>
#include <string>
#include <vector>

namespace moelab {

// Measured (or assumed) throughputs of the three kinds of work and the interference factors:
// the rate each stream keeps while the others run (σ compute, μ network, η host copies).
struct Throughputs {
  double comp_flops;  // GEMM FLOP/s (2 FLOPs per multiply-add)
  double comm_bytes;  // all-to-all bytes/s per rank (the NIC)
  double mem_bytes;   // pinned host <-> device bytes/s (PCIe)
  double sigma, mu, eta;
};

// Assumptions used when the options give no figures (documented in mpipemoe.hpp): an A100
// at 156 TFLOP/s TF32-class GEMM × 0.8, a 25 GB/s NIC (200 Gb/s HDR), 24 GB/s PCIe 4.0 copies,
// and 0.9 for each interference factor.
Throughputs default_throughputs();

inline const std::array<const char*, 5>& strategy_names() {
  static const std::array<const char*, 5> n = {"none", "S1", "S2", "S3", "S4"};
  return n;
}
bool offloads_t_di(const std::string& s);    // S1, S3
bool offloads_t_m(const std::string& s);     // S1, S2
bool recommunicates(const std::string& s);   // S2, S4 (T_I kept for backward)
bool recomputes(const std::string& s);       // S3, S4

// Q of a strategy, forward + backward summed.
std::array<double, 3> work_vector(const std::string& strategy);

// Eq. 10 for one partition of b tokens (elements of elem_bytes bytes):
//   C = max(q1·v_comp/(σ·W_comp), q2·v_comm/(μ·W_comm), q3·v_mem/(η·W_mem)),
//   v_comp = b·H·M multiply-adds (= 2·b·H·M FLOPs), v_comm = v_mem = b·M elements.
struct StrategyCost {
  std::string strategy;
  double comp_s = 0, comm_s = 0, mem_s = 0;  // the three terms
  double cost_s = 0;                         // their max
  double device_bytes = 0, host_bytes = 0;   // memory need (from memory_model)
  bool fits = true;
};
StrategyCost strategy_cost(const std::string& strategy, const Throughputs& w, double b, double M, double H,
                           double elem_bytes = 4);

// What each candidate needs and what there is.
struct MemoryNeed {
  double device_bytes = 0, host_bytes = 0;
};
struct MemoryBudget {
  double device_bytes = 0;  // <= 0: unlimited
  double host_bytes = 0;    // <= 0: unlimited
};

// The cheapest of the reuse strategies S1–S4 whose memory need fits the budget ("none" is
// the pipelining-only layer, chosen explicitly, not by "auto"). needs[i] belongs to
// strategy_names()[i + 1]. Every candidate's cost goes to *costs when given. Throws
// OutOfMemory naming the budgets and the smallest need when none fits.
std::string choose_strategy(const Throughputs& w, double b, double M, double H, const MemoryBudget& budget,
                            const std::array<MemoryNeed, 4>& needs, std::vector<StrategyCost>* costs = nullptr,
                            double elem_bytes = 4);

}  // namespace moelab
