// harness/metrics/overlap.hpp — communication/computation overlap of one rank's timeline.
//
// Definitions (the same on every backend; docs/PERFORMANCE.md):
//   compute busy   length of the union of the intervals of compute ops (every op that is not
//                  a collective or a host<->device copy), over all streams
//   comm time      length of the union of the intervals of collective ops
//   hidden comm    length of (comm union) ∩ (compute union)
//   overlap ratio  hidden comm / comm time (1 when there is no communication)
//   exposed comm   step time − compute busy (per step), as the papers define it
//   overlap limit  max(comm, compute): no schedule of these ops can beat it; the ratio
//                  limit / step says how close a schedule came
#pragma once
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/runtime/timeline.hpp"

namespace moelab {

struct OverlapFigures {
  double compute_busy = 0;  // seconds over the window
  double comm_time = 0;
  double hidden_comm = 0;
  double copy_time = 0;     // host <-> device copies (offload traffic)
  double overlap_ratio() const { return comm_time > 0 ? hidden_comm / comm_time : 1.0; }
};

OverlapFigures overlap_figures(const std::vector<OpRecord>& ops);

// Union length of intervals [a, b).
double union_length(std::vector<std::pair<double, double>> intervals);

}  // namespace moelab
