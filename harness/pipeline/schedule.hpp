// harness/pipeline/schedule.hpp — a pipeline schedule as data: per stage, the ordered list of
// what that stage does (forward, backward split into input and weight gradients, the sends and
// receives between stages, offload placeholders, the optimizer step), for every microbatch
// and model chunk. Generators for the published schedules, a validator, and a timing estimate.
//
//   Schedule s = make_schedule("1f1b", /*stages*/ 4, /*microbatches*/ 8);
//   ScheduleAnalysis a = validate(s);          // ConfigError naming the node when it is wrong
//   ScheduleEstimate e = estimate(s, {1, 1, 1});  // unit costs: bubble (p-1)/(m+p-1)
//   ctest --test-dir build -R pipeline_schedule_test
//
// Vocabulary (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
// Clusters Using Megatron-LM", §2.2): p stages (one per pipeline rank), m microbatches per
// step, v model chunks per stage. The model's layers are cut into p·v virtual stages, run in
// order; a placement says which stage and chunk hold each virtual stage:
//   interleaved  virtual stage c·p + s is chunk c of stage s (Megatron; v = 1: plain 1F1B)
//   vshape       chunk 0 of stage s is virtual stage s, chunk 1 is 2p-1-s (Qi et al. 2024,
//                "Pipeline Parallelism with Controllable Memory", the V-shape of ZB-V)
// Virtual stage 0 holds the embedding, virtual stage p·v-1 the LM head and loss.
//
// Node kinds, with the letters the papers draw them with:
//   F  forward of (microbatch, chunk)            B  input gradient ("backward")
//   W  weight gradient (zero-bubble schedules run it later than B; others right after)
//   send_act / recv_act    the forward's output to / from the stage of the next virtual stage
//   send_grad / recv_grad  B's input gradient to / from the stage of the previous one
//   offload / reload       placeholders for activation offloading (PipeOffload, Wan et al.
//                          2025): the executor calls hooks there, no-ops by default
//   optimizer              gradient synchronisation and the optimizer step
// When two consecutive virtual stages sit on one stage (V-shape's turn, or p = 1) the value
// is handed over locally: no send or receive.
//
// The semantics the validator checks and the executor implements: a stage runs its list in
// order; a send never blocks (it is queued on its own stream); a receive blocks until the
// matching send has run. Sends and receives of one kind between two stages match in order
// (the k-th receive gets the k-th send, as MPI's non-overtaking rule).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace moelab::pipeline {

enum class NodeKind { forward, backward_input, backward_weight, send_act, recv_act, send_grad, recv_grad, offload, reload, optimizer };
const char* node_kind_name(NodeKind k);  // "F", "B", "W", "send_act", ..., "optimizer"

struct Node {
  NodeKind kind = NodeKind::forward;
  int microbatch = -1;  // -1 for the optimizer step
  int chunk = 0;        // the stage's model chunk (0 .. v-1)
  bool operator==(const Node&) const = default;
};
// "F mb 3 chunk 1"; "optimizer".
std::string describe(const Node& n);

enum class Placement { interleaved, vshape };
const char* placement_name(Placement p);

struct Schedule {
  std::string name;  // "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", or a user's
  int stages = 1, microbatches = 1, chunks = 1;
  Placement placement = Placement::interleaved;
  // Zero-bubble schedules split the backward: B's gradient leaves before W runs. Otherwise B
  // and the W right after it are one backward pass and the gradient leaves after both.
  bool split_backward = false;
  std::vector<std::vector<Node>> nodes;  // per stage, in order

  int virtual_stages() const { return stages * chunks; }
  int virtual_stage(int stage, int chunk) const;
  std::pair<int, int> place(int vstage) const;  // (stage, chunk)
};

// The schedules by name, for p stages and m microbatches (v chunks for "interleaved"; "zb-v"
// always has 2). ConfigError (one line, naming the field and value) for an unknown name (the
// closest known one suggested), sizes below 1, chunks given to a schedule that has one, or
// interleaving with m not a multiple of p (Megatron's requirement).
//   gpipe        all forwards, then all backwards (Huang et al. 2019)
//   1f1b         PipeDream-Flush (Narayanan et al. 2021 §2.2.1): p-s-1 warm-up forwards
//   interleaved  Megatron's interleaved 1F1B over v chunks (Narayanan et al. 2021 §2.2.2)
//   zb-h1        1F1B with B and W split and stage s's last s weight passes deferred into
//                the cool-down (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §3.1)
//   zb-v         the V-shape over 2 chunks: 1F1B order on the virtual stages with W deferred
//                (ZB-V's placement and memory, Qi et al. 2024 §6; built by the greedy
//                list scheduler below, not the paper's hand-made table)
Schedule make_schedule(const std::string& name, int stages, int microbatches, int chunks = 0);
std::vector<std::string> schedule_names();

// Adds send/recv nodes around the compute nodes (a receive right before the node that needs
// it, a send right after the node that made it; without split_backward, a B's gradient after
// the W that follows it) and an optimizer node at the end of every stage. Generators build
// F/B/W orders and call this.
void add_communication(Schedule& s);
// PipeOffload's pass (placeholders only): for every F of a chunk < `chunks`, an offload right
// after it and a reload right before its B.
void add_offload(Schedule& s, int chunks);

struct ScheduleAnalysis {
  // For every send node (stage, position): the position on the same stage after which the
  // send is known to have been received (a later receive on this stage follows the peer's
  // receive of it); -1: not before the end of the step. The executor keeps a sent tensor
  // alive until then, so that a device allocator never reuses memory a send still reads.
  std::vector<std::vector<int>> send_done_at;
  // Per stage: most (microbatch, chunk) pairs between F and the end of their W at once.
  std::vector<int> peak_in_flight;
};

// Rejects, with a one-line ConfigError naming the node (stage, position, kind, microbatch,
// chunk): a node outside the schedule's sizes; a value used before it exists (B before its F,
// W before its B, F without its input received, a send before what it sends was made, a
// reload without offload); a receive with no matching send (the previous virtual stage is on
// the same stage, or the k-th send between the two stages is another microbatch's); a
// schedule that deadlocks (simulated: every stage blocked in a receive); work done twice; a
// microbatch left unfinished (an F, B or W missing, a value never sent); nodes after the
// optimizer step.
ScheduleAnalysis validate(const Schedule& s);

// A timing estimate of a valid schedule: every stage runs its nodes in order as soon as their
// inputs have arrived; F, B and W of one chunk take the given times, a transfer `p2p`.
struct NodeCosts {
  double forward = 1, backward_input = 1, backward_weight = 1, p2p = 0;
};
struct ScheduleEstimate {
  double makespan = 0;               // first F to the last B or W of any stage
  std::vector<double> busy;          // per stage: F + B + W time
  std::vector<double> bubble;        // per stage: 1 - busy / makespan
  std::vector<std::vector<std::pair<double, double>>> times;  // per stage and position: start, end
  double mean_bubble() const;
};
ScheduleEstimate estimate(const Schedule& s, const NodeCosts& c);

}  // namespace moelab::pipeline
