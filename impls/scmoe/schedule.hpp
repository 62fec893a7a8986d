// impls/scmoe/schedule.hpp — where ScMoE's routed experts run among the main stream's compute,
// and into how many chunks its all-to-alls are cut: pure functions of estimated times, so
// that the rules are tested on their own (scmoe_test.cpp, "Placement").
//
// Cai et al., "Shortcut-connected Expert Parallelism for Accelerating Mixture of Experts"
// (arXiv 2404.05019), §4: the main stream runs the window's blocks c_0 .. c_{n-1} (attention,
// MLP, shared expert) while the dispatch all-to-all (before the experts) and the combine (after
// them) run beside it; the experts go after the first j blocks, j in [0, n], minimising
//   |Σ_{i<j} c_i − T_first| + |Σ_{i>=j} c_i − T_second|.
// When communication is longer than the window, the all-to-alls are cut into chunks on top
// (Tutel's pipelining, Hwang et al. MLSys'23 §3.3).
// Backward (designed here, the paper is silent; README "Backward"): the same rule over the
// window's backward blocks in backward order, T_first the combine's backward all-to-all and
// T_second the dispatch's.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace moelab::scmoe {

// The slot (experts after the first `slot` blocks) and each slot's cost, the smallest slot on a
// tie.
struct SlotChoice {
  int slot = 0;
  std::vector<double> cost;  // [n + 1]
};
SlotChoice choose_slot(const std::vector<double>& compute, double t_first, double t_second);

// One pass of a block pair as the schedule sees it (seconds): the window's blocks in issue
// order, the experts, the exchange before them and the one after, and what each extra chunk of
// an exchange costs (its latency: the estimate is otherwise a bandwidth model).
struct PassTimes {
  std::vector<double> compute;
  double experts = 0, first = 0, second = 0;
  double chunk_overhead = 0;
  // What the experts wait for besides the exchange, not cut into chunks: the offloaded
  // experts' weights copied in beside the pass (--offload-experts async), one set of copies
  // that every chunk's experts wait for whatever r (0: nothing).
  double ready = 0;
};

// The main stream's and the exchanges' end with the experts at `slot` and each exchange cut into
// r back-to-back chunks: chunk i's experts wait for its first exchange (and for `ready`), its
// second exchange for them; the last block and the last exchange both end the pass.
double estimate_pass(const PassTimes& t, int slot, int r);

// The chunk count for a forward and a backward pass at their slots: 1 when every exchange fits
// its side of the slot in both; else the r in {1, 2, 4, 8} whose forward + backward estimate is
// shortest (the smallest r within 1% of it).
struct ChunkChoice {
  int chunks = 1;
  std::vector<double> estimate;  // forward + backward, seconds, for r = 1, 2, 4, 8
};
ChunkChoice choose_chunks(const PassTimes& fwd, int fwd_slot, const PassTimes& bwd, int bwd_slot);
inline const std::vector<int>& chunk_candidates() {
  static const std::vector<int> c = {1, 2, 4, 8};
  return c;
}

}  // namespace moelab::scmoe
