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
// Work vectors Q = [GEMMs, all-to-alls, copies in units of b·M], forward and backward
// (MPipeMoE §III-D, its table of Q). A T_DI copy [b,M] counts 1 and a T_M copy [b,H] counts
// r = H/M; the paper's table writes r = 4 (its models all have H = 4M), here r is the model's:
//   none [2,2,0] + [4,2,0]       S1 [2,2,1+r] + [4,2,1+r]   S2 [2,2,r] + [4,3,r]
//   S3   [2,2,1] + [5,2,1]       S4 [2,2,0]   + [5,3,0]
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

// Q of a strategy, forward + backward summed; h_over_m = H/M sizes a T_M copy (the paper's 4).
std::array<double, 3> work_vector(const std::string& strategy, double h_over_m = 4);

// Eq. 10 for one partition of b tokens (elements of elem_bytes bytes):
//   C = max(q1·v_comp/(σ·W_comp), q2·v_comm/(μ·W_comm), q3·v_mem/(η·W_mem)),
//   v_comp = b·H·M multiply-adds (= 2·b·H·M FLOPs), v_comm = v_mem = b·M elements.
struct StrategyCost {
  std::string strategy;
  double comp_s = 0, comm_s = 0, mem_s = 0;  // the three terms
  double cost_s = 0;                         // their max
  double device_bytes = 0, host_bytes = 0;   // memory need (from memory_model)
  bool fits = true;
  bool tied = false;  // fits and costs the chosen strategy's cost (within kCostTieTolerance)
};

// Ties. Eq. 10 often prices two strategies alike: when the GEMMs bind, S3 and S4 both cost
// q1 = 7 GEMMs. Costs within this relative tolerance of the cheapest count as tied, and the
// tie is broken by kTieRule (choose_strategy): the strategy whose second-busiest stream, then
// third, has the least work wins, because the terms Eq. 10 leaves out (latencies, interference
// a busier stream causes, the phases where the pipeline is not full) land on those streams;
// then the smaller device memory need, then the smaller host memory need; then the order S1..S4.
inline constexpr double kCostTieTolerance = 1e-9;
inline constexpr const char* kTieRule =
    "equal cost (relative 1e-9): least second-largest term, then least third term, then least device memory, "
    "then least host memory, then S1..S4 order";
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
// strategy_names()[i + 1]. Ties are broken by kTieRule and marked in *costs (`tied`).
// Every candidate's cost goes to *costs when given. Throws
// OutOfMemory naming the budgets and the smallest need when none fits.
std::string choose_strategy(const Throughputs& w, double b, double M, double H, const MemoryBudget& budget,
                            const std::array<MemoryNeed, 4>& needs, std::vector<StrategyCost>* costs = nullptr,
                            double elem_bytes = 4);

}  // namespace moelab
