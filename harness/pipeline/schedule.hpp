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
  std::string name;  // "gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "group-interleaved", or a user's
  int stages = 1, microbatches = 1, chunks = 1;
  int group = 0;  // group-interleaved: microbatches per group (g)
  Placement placement = Placement::interleaved;
  // Zero-bubble schedules split the backward: B's gradient leaves before W runs. Otherwise B
  // and the W right after it are one backward pass and the gradient leaves after both.
  bool split_backward = false;
  std::vector<std::vector<Node>> nodes;  // per stage, in order

  int virtual_stages() const { return stages * chunks; }
  int virtual_stage(int stage, int chunk) const;
  std::pair<int, int> place(int vstage) const;  // (stage, chunk)
};

// The schedules by name, for p stages and m microbatches (v chunks for "interleaved" and
// "group-interleaved"; "zb-v" always has 2; g microbatches per group for "group-interleaved").
// ConfigError (one line, naming the field and value) for an unknown name (the closest known
// one suggested), sizes below 1, chunks given to a schedule that has one, interleaving with m
// not a multiple of p (Megatron's requirement), a group out of range or given to another
// schedule.
//   gpipe        all forwards, then all backwards (Huang et al. 2019)
//   1f1b         PipeDream-Flush (Narayanan et al. 2021 §2.2.1): p-s-1 warm-up forwards
//   interleaved  Megatron's interleaved 1F1B over v chunks (Narayanan et al. 2021 §2.2.2)
//   zb-h1        1F1B with B and W split and stage s's last s weight passes deferred into
//                the cool-down (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §3.1)
//   zb-v         the V-shape over 2 chunks: 1F1B order on the virtual stages with W deferred
//                (ZB-V's placement and memory, Qi et al. 2024 §6; built by the greedy
//                list scheduler below, not the paper's hand-made table)
//   group-interleaved  PipeOffload's interleaved 1F1B in groups of g microbatches (Wan et al.
//                2025; the authors' GroupBuildingBlockScheduler): a building block of 3·g·v
//                unit slots per stage, repeated every g microbatches. g from ceil(p/2) (the
//                default, the authors' smallest group) to p; any m (the last group may be
//                partial); v >= 2 (default 2). Lower activation memory than Megatron's
//                interleaving: g(v-1) + p - s chunk-microbatches on stage s
//                (docs/pipeline-memory.md)
Schedule make_schedule(const std::string& name, int stages, int microbatches, int chunks = 0, int group = 0);
std::vector<std::string> schedule_names();

// Adds send/recv nodes around the compute nodes (a receive right before the node that needs
// it, a send right after the node that made it; without split_backward, a B's gradient after
// the W that follows it) and an optimizer node at the end of every stage. Generators build
// F/B/W orders and call this.
void add_communication(Schedule& s);

// A timing model: F, B and W of one chunk take the given times, a point-to-point transfer
// `p2p`, moving one (microbatch, chunk)'s saved activations to the host `offload` and back
// `reload`. Any unit will do (the estimate answers in the same one).
struct NodeCosts {
  double forward = 1, backward_input = 1, backward_weight = 1, p2p = 0;
  double offload = 0, reload = 0;
};

// PipeOffload's pass (Wan et al. 2025; the authors' megatron/core/pipeline_parallel/
// zerobubble/scheduler/offloading.py, add_send_recv): moves the saved activations of the
// (microbatch, chunk) pairs of chunks c < `chunks` to host memory between their F and B.
// Placement, on the schedule's own estimate (`estimate(s, costs)` before the pass):
//   offload  right after its F: the device-to-host copy starts as soon as F is done.
//   reload   before the latest compute node (F, B or W; before that node's receives) of the
//            stage whose estimated start is <= B.start - B - h2d, B being costs.backward_input:
//            the host-to-device copy, issued when the compute stream reaches the reload node
//            and taking h2d, ends one B-duration before its B (the authors' "buffer for
//            robustness"). Never before its offload: without such a node, right after it.
// Dropped, in this order:
//   gap rule       B.start - B - F.end <= 3·(d2h + h2d): too little time between F and B for
//                  both copies (add_send_recv's invalid_offload_keys). Applies only when the
//                  copies take time: with d2h = h2d = 0 nothing is too close.
//   lifespan rule  (`lifespan`) an offload that lowers no peak: counting resident activations
//                  over the stage's list (F adds one, offload removes one, reload adds one back,
//                  W removes one), offloads are tried shortest off-device interval first (the
//                  estimated time from F's end to the reload's place) and dropped when the
//                  stage's peak without them is no higher. What is offloaded while the stage
//                  is below its peak saves no memory and costs two copies (the paper judges
//                  an offload strategy by the peak it leaves).
// With d2h = h2d = 0 and lifespan false every F of a chunk < chunks is offloaded. ConfigError
// for a negative option or a schedule that already has offload nodes; the result is validated.
struct OffloadOptions {
  int chunks = 0;           // offload_chunk_num: offload (mb, c) for chunks c < chunks; >= v is full offload; 0 none
  double d2h = 0, h2d = 0;  // time to move one chunk's saved activations each way, in the units of `costs`
  NodeCosts costs;          // durations of F, B, W (and p2p) used to place the transfers
  bool lifespan = true;     // skip transfers that lower no stage's peak
};
struct OffloadPlan {  // per stage
  std::vector<int> planned, kept;              // offloads asked for (chunk < chunks), kept after the rules
  std::vector<int> skipped_gap, skipped_peak;  // dropped by the gap rule / the lifespan (peak) rule
  std::vector<int> peak_resident;              // most (mb, chunk) activations on the device at once, with the offloads
  std::vector<int> peak_host;                  // most (mb, chunk) activations on the host at once
};
OffloadPlan add_offload(Schedule& s, const OffloadOptions& o);

struct ScheduleAnalysis {
  // For every send node (stage, position): the position on the same stage after which the
  // send is known to have been received (a later receive on this stage follows the peer's
  // receive of it); -1: not before the end of the step. The executor keeps a sent tensor
  // alive until then, so that a device allocator never reuses memory a send still reads.
  std::vector<std::vector<int>> send_done_at;
  // Per stage: most (microbatch, chunk) pairs between F and the end of their W at once.
  std::vector<int> peak_in_flight;
  // Per stage, over the list: most (microbatch, chunk) activations on the device at once (F
  // adds one, offload removes one, reload adds one back, W removes one; equals peak_in_flight
  // without offloads) and on the host (offload adds one, reload removes one).
  std::vector<int> peak_resident, peak_host;
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

// A timing estimate of a valid schedule: every stage runs its compute list in order as soon
// as its inputs have arrived. Each stage also has one device-to-host and one host-to-device
// copy stream, each first in, first out: an offload's copy starts at max(its F's end, the d2h
// stream free); a reload's at max(the compute stream reaching the reload node, the h2d stream
// free, its offload's copy done); the B of an offloaded (microbatch, chunk) starts no earlier
// than its reload's end. With free copies (offload = reload = 0) the copies never delay
// anything and the estimate is that of the schedule without them.
struct ScheduleEstimate {
  double makespan = 0;               // first F to the last B or W of any stage
  std::vector<double> busy;          // per stage: F + B + W time
  std::vector<double> bubble;        // per stage: 1 - busy / makespan
  std::vector<double> exposed;       // per stage: compute time spent waiting for reloads
  std::vector<double> d2h_busy, h2d_busy;  // per stage: copy stream time
  // per stage and position: start, end (for offload and reload nodes, their copy's)
  std::vector<std::vector<std::pair<double, double>>> times;
  double mean_bubble() const;
};
ScheduleEstimate estimate(const Schedule& s, const NodeCosts& c);

// The closed forms of docs/pipeline-memory.md: per stage, the peak activation memory the
// schedule's construction implies, in units of M_a (the activations one microbatch leaves in
// the whole model; one (microbatch, chunk) holds M_a/(p·v)), counted from F to the end of W
// as peak_in_flight does. Stage s:
//   gpipe m/p; 1f1b (p-s)/p; zb-h1 1 (W deferred keeps p in flight on every stage); zb-v 1;
//   interleaved (p(v-1) + 2(p-s) - 1)/(pv), on stage 0 1 + (p-1)/(pv);
//   group-interleaved (g(v-1) + p - s)/(pv), on stage 0 (g(v-1) + p)/(pv)
// (each at most m·v chunk-microbatches). With offload_chunks = k > 0: what stays on the
// device, the chunks c >= k: none for k >= v (full offload); for 0 < k < v,
//   interleaved (p(v-1-k) + min(2(p-s) - 1, p))/(pv); group-interleaved (g(v-1-k) + min(p-s, g))/(pv).
// The copies themselves hold up to two more chunk-microbatches (one F's activations until
// its offload, one reload waiting for its B): peak_resident of add_offload with free copies
// and lifespan false is exactly 2/(pv) on full offload (1/(pv) on 1F1B's last stage, where a
// B follows its F) and between the form and the form + 2/(pv) on a selective one. Exact,
// checked by pipeline_schedule_test, for m >= p (gpipe: any m), m a multiple of p for
// interleaved (at m = p every forward runs first: m·v on every stage, (v-k)·m kept), and
// m >= 2p for the offloaded forms. ConfigError for an offload of zb-h1 or
// zb-v (their deferred W keeps a reloaded microbatch on the device: ZB-H1's stage s holds
// min(s + 2, p) on full offload) and for a selective offload of gpipe or 1f1b.
std::vector<double> expected_peak_activation(const Schedule& s, int offload_chunks = 0);

}  // namespace moelab::pipeline
