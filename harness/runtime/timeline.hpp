// harness/runtime/timeline.hpp — the record of every op a backend ran: which stream, which
// phase, when, and its cost descriptor. One format on every backend; the Chrome trace
// writer, the per-phase table and the overlap metrics are all views of it.
#pragma once
#include <mutex>
#include <string>
#include <vector>

#include "harness/runtime/cost.hpp"

namespace moelab {

struct OpRecord {
  int rank = 0;
  int stream_id = 0;
  std::string stream_name;
  std::string name;   // "fc1", "dispatch_a2a", ...
  std::string phase;  // "gate", "dispatch", "experts", "combine", ... (see PhaseScope)
  std::string node;   // the pipeline schedule node it belongs to ("F3.1"; see NodeScope), or ""
  std::string detail; // how the backend ran it, where it chose (cuda GEMMs: the path and why), or ""
  OpCost cost;
  double start = 0;   // seconds on the backend clock
  double end = 0;
};

class Timeline {
 public:
  void add(OpRecord r);
  std::vector<OpRecord> records() const;
  void clear();

 private:
  mutable std::mutex mu_;
  std::vector<OpRecord> records_;
};

}  // namespace moelab
