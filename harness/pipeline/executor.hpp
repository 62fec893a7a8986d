// harness/pipeline/executor.hpp — one executor for every pipeline schedule: this rank's stage
// of a pipeline, its model chunks, and the loop that runs its node list (schedule.hpp) on any
// backend (cpu: MPI ranks as stages; cuda; sim).
//
//   Schedule s = make_schedule("1f1b", pg.layout().pp, 8);
//   PipelineStage st(b, cfg, s, pg.pp(), pg.ep(), {.model = {.impl = "fastmoe"}, .tokens = T});
//   st.init_parameters(seed);
//   st.set_gradient_sync(&pg.dp(), &pg.edp());
//   Optimizer opt(b, st.stream(), st.parameters(), {});
//   st.set_optimizer(&opt);
//   st.step(batches, step_no);   // batches[mb]: token ids, targets, loss scale
//   ctest --test-dir build -R 'pipeline_(schedule|sim|mpi)'
//
// Layers, embedding and head (Megatron's rule, megatron/core/transformer/transformer_block.py):
// the L layers are cut into p·v virtual stages of L/(p·v) consecutive layers each (an error
// when that does not divide), in model order; virtual stage 0 also holds the embedding, the
// last one the final norm, LM head and loss. Each (stage, chunk) is a Model over its layer
// range (harness/nn/model.hpp), so a chunk's forward returns its saved state and any number
// of microbatches are in flight. With tied embeddings and the head away from the embedding,
// the head's chunk holds a copy of the word embeddings; the stages holding the two copies form
// an embedding group (a split of the pipeline communicator) that copies the embedding into the
// copy at init and sums the two gradients before the optimizer step, as Megatron's
// embedding-group all-reduce does (both on one stage: a local add).
//
// Transfers: a send or receive runs on its own stream with its own communicator, one per
// (activation or gradient, direction around the ring of stages, colour of the sending stage),
// the colours chosen so that no rank sends and receives on one communicator (one
// communicator per stream, communicator.hpp): a send never blocks the compute stream, a
// receive blocks only what needs its value. A receive's buffer is allocated on the compute
// stream (charged to its microbatch) and the receive waits for that point; a sent tensor is
// kept until the schedule shows it has arrived (ScheduleAnalysis::send_done_at), then the
// compute stream waits for the send and lets it go, so that a stream-ordered allocator never
// hands its memory out while the send still reads it.
//
// Activation recomputation (Chen et al. 2016; Korthikanti et al. 2022 §5): `full` keeps only a
// chunk's input after its forward and runs the forward again right before its B (recomputed
// ops carry the node label "R"). `selective` recomputes only the cheap layers: the attention
// and dense MLP blocks keep their input instead of also its normed copy and run the norm
// again for their weight gradients (ModelOptions::recompute_norms), one [T,M] less per block
// in flight; every block already recomputes its activation function's output in backward.
//
// Activation offloading (PipeOffload, Wan et al. 2025, arXiv 2503.01328 §3): at an offload
// node (schedule.hpp's add_offload puts one right after an F) every tensor that F left alive
// for its backward (found by a storage capture around the forward, Backend::start_capture,
// plus the chunk's received input) moves to pinned host memory on the stage's device-to-host
// copy stream, its device bytes freed there after the copy; at the reload node it comes back
// on the host-to-device stream into device memory charged to its microbatch, and the B waits
// for that copy only. The chunk's output (being sent) and losses stay. A stage whose offloads
// would hold more pinned host memory than its share of the node's (host_capacity_bytes) stops
// with OutOfMemory naming the stage and the bytes, at the first offload that would not fit.
//
// Every op issued for a node carries its label in the timeline (Backend::NodeScope):
// "F3.1" forward of microbatch 3 chunk 1, "B", "W", "R" (recompute), "SA"/"RA" activation
// send/receive, "SG"/"RG" gradient send/receive, "OFF"/"RL" offload/reload copies, "OPT"
// gradient sync and optimizer step.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "harness/nn/model.hpp"
#include "harness/nn/moe_schedule.hpp"
#include "harness/pipeline/schedule.hpp"

namespace moelab::pipeline {

enum class Recompute { none, full, selective };
Recompute parse_recompute(const std::string& s);  // "none" | "selective" | "full"; ConfigError otherwise
const char* recompute_name(Recompute r);

// Megatron's rule: the layers [first, last) of virtual stage `vstage` of `virtual_stages`.
struct LayerRange {
  int first = 0, last = 0;
};
// With `pad` (the authors' --allow-padding-num-layers of PipeOffload's Megatron fork,
// megatron/legacy/model/transformer.py get_offset): when the virtual stages do not divide L,
// each holds ceil(L / (p·v)) layers but the last, then the first, second, ... hold one fewer,
// one for each layer short, so the stages holding the embedding and the head do less
// transformer work (with L = 3p - 2 and one layer per virtual stage: the embedding and the
// head get a virtual stage of their own). A virtual stage left with no layers must hold the
// embedding or the head.
LayerRange virtual_stage_layers(const TransformerConfig& cfg, int virtual_stages, int vstage, bool pad = false);
// ConfigError when the schedule's virtual stages do not divide the model's layers (with
// `pad`: when the padded split leaves a virtual stage with nothing).
void check_pipeline(const TransformerConfig& cfg, const Schedule& s, bool pad = false);

// The timeline label of a node ("F3.1", "OPT") and its kind back from a label ("F").
std::string node_label(const Node& n);
std::string label_kind(const std::string& label);

struct PipelineOptions {
  ModelOptions model;         // every chunk's (impl, impl_options, aux loss, tp); layers set per chunk
  std::int64_t tokens = 0;    // T: rows of one microbatch's activations [T,M]
  Recompute recompute = Recompute::none;
  bool pad_layers = false;    // the uneven split (virtual_stage_layers)
  // Pinned host memory this rank may hold in offloaded activations; 0: the backend's
  // MachineRates::host_memory_bytes (sim: the node's memory over its GPUs), unknown = no limit.
  double host_capacity_bytes = 0;
};

// What the offload and reload nodes of one step moved on this stage.
struct OffloadStats {
  int transfers = 0;                  // (microbatch, chunk) activations offloaded
  std::size_t bytes = 0;              // device -> host (the same come back)
  std::size_t peak_host_bytes = 0;    // most held on the host at once
  std::vector<std::size_t> chunk_bytes;  // per chunk: the bytes one microbatch's offload moved (0: none)
};

class PipelineStage {
 public:
  // Collective over `pp` (communicator duplicates, the embedding group) and, through the
  // chunks' MoE layers, over `ep`. pp's rank is this rank's stage.
  PipelineStage(Backend& b, const TransformerConfig& cfg, const Schedule& s, Communicator& pp, Communicator& ep,
                const PipelineOptions& opt);
  ~PipelineStage();

  // Every chunk's parameters from `seed` (as the unpipelined model's), then the embedding
  // group makes the head's copy of tied embeddings equal to the embedding.
  void init_parameters(std::uint64_t seed);
  // Data parallelism: at the optimizer node the replicated parameters' gradients are summed
  // over `dp` (Model::all_reduce_gradients) and the experts' over `edp` (experts replicated
  // when EP is below the stage's ranks). Null or size 1: nothing.
  void set_gradient_sync(Communicator* dp, Communicator* edp);
  // The same sums by the bucketed synchroniser (harness/nn/grad_sync.hpp), one per chunk: a
  // chunk's buckets are reduced on their own stream while the step's last weight-gradient
  // passes still run (armed before the chunk's last W node), finished at the optimizer node.
  // With `zero1`, Adam's states are sharded over each group (make_optimizer builds one
  // optimizer per chunk on its synchroniser). After set_gradient_sync and init_parameters;
  // before the optimizer is made. ZeRO-1 with tied embeddings split across stages is refused
  // (the embedding group would have to sum a sharded gradient).
  void use_bucketed_sync(const GradSyncOptions& opt);
  GradSync* grad_sync(int chunk) const {
    return syncs_.empty() ? nullptr : syncs_[static_cast<std::size_t>(chunk)].get();
  }
  void set_optimizer(Optimizer* o) { optimizer_ = o; }
  // The stage's own optimizer(s) over every chunk's parameters (per chunk on its synchroniser
  // when use_bucketed_sync was called); used at the optimizer node instead of set_optimizer's.
  void make_optimizer(const OptimizerConfig& oc);

  // One step of the schedule: zero_grad, this stage's node list, every send released.
  // data[mb]: token ids (read by virtual stage 0), targets (the last virtual stage) and the
  // loss scale; asynchronous like any op (synchronize to read results).
  void step(const std::vector<Batch>& data, std::uint64_t step);

  int stage() const { return stage_; }
  const Schedule& schedule() const { return s_; }
  const ScheduleAnalysis& analysis() const { return analysis_; }
  const OffloadStats& offload_stats() const { return offload_stats_; }
  std::vector<Param> parameters();  // every chunk's, chunk order (tied copies included)
  std::vector<Model*> chunks();
  Model& chunk(int c) { return *chunks_[static_cast<std::size_t>(c)]; }
  bool has_embedding() const;
  bool has_head() const;
  // [T] fp32 per-token losses of each microbatch of the last step (the stage with the head).
  const std::vector<Tensor>& losses() const { return losses_; }
  Stream& stream() { return b_.default_stream(); }
  // The streams this stage sends and receives on (for reports: their time is not work).
  std::vector<const Stream*> transfer_streams() const;

 private:
  struct Channel {
    Communicator* comm = nullptr;
    Stream* stream = nullptr;
    int peer = 0;
  };
  struct Slot;  // one (microbatch, chunk) in flight
  Channel& channel(bool gradient, bool send, int peer);
  void sync_tied(bool values);
  void sync_gradients();
  void run_node(int pos, const Node& n, const std::vector<Batch>& data, std::uint64_t step);
  void offload(const Node& n, Slot& x);
  void reload(const Node& n, Slot& x);

  Backend& b_;
  TransformerConfig cfg_;
  Schedule s_;
  ScheduleAnalysis analysis_;
  Communicator& pp_;
  PipelineOptions opt_;
  int stage_ = 0;
  std::vector<std::unique_ptr<Model>> chunks_;
  std::map<std::tuple<int, int, int>, std::unique_ptr<Communicator>> comms_;  // (gradient, up, colour)
  std::map<std::tuple<int, int, int>, Channel> channels_;                    // (gradient, send, peer)
  std::unique_ptr<Communicator> embedding_group_;
  Communicator* dp_ = nullptr;
  Communicator* edp_ = nullptr;
  Optimizer* optimizer_ = nullptr;
  std::vector<std::unique_ptr<GradSync>> syncs_;        // per chunk (use_bucketed_sync)
  std::vector<std::unique_ptr<Optimizer>> optimizers_;  // make_optimizer
  std::vector<int> last_w_;                             // per chunk: position of its last W node
  EventPool events_;
  std::vector<std::unique_ptr<Slot>> slots_;  // [mb * chunks + chunk]
  struct PendingSend {
    Tensor t;
    Event* done = nullptr;
  };
  std::map<int, PendingSend> pending_;  // by the send's position
  std::vector<Tensor> losses_;
  // Activation offloading (the schedule's offload / reload nodes; PipeOffload, Wan et al. 2025).
  std::vector<char> offloaded_;       // [mb * chunks + chunk]: the schedule offloads it on this stage
  Stream* d2h_ = nullptr;
  Stream* h2d_ = nullptr;
  double host_capacity_ = 0;
  std::size_t host_bytes_ = 0;
  OffloadStats offload_stats_;
};

// Per timed step, what one rank's timeline says about its pipeline work: the union of the
// intervals of ops labelled F, B, W or R (recompute) on any stream but the transfer streams,
// and the first start and last end of such ops.
struct StageWork {
  double busy = 0, first = 0, last = 0;
};
std::vector<StageWork> stage_work(const std::vector<OpRecord>& ops, const std::vector<std::pair<double, double>>& steps,
                                  const std::vector<std::string>& transfer_stream_names);

}  // namespace moelab::pipeline
