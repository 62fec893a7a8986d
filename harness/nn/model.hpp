// harness/nn/model.hpp — a transformer built from a model file (harness/config/model.hpp),
// or a contiguous range of its layers (a pipeline stage), with any number of microbatches in
// flight, and the optimizer that trains it.
//
//   Model model(backend, ep_comm, cfg, {.impl = "fastmoe"});
//   model.init_parameters(seed);
//   Forwarded f = model.forward(batch, key);     // batch: ids (first stage) or [T,M]; targets
//   Tensor dx = model.backward_input(*f.saved, dy);  // dy unused on the last stage
//   model.backward_weight(*f.saved);
//
// Layers [first, last) of the model: the stage holding layer 0 starts with the embedding, the
// one holding the last layer ends with the head (final norm, LM head, loss). Each transformer
// layer is an AttentionBlock and an FfnBlock (dense MLP, or MoE where cfg.is_moe(layer)); with
// ScMoE (cfg.scmoe) each block pair is one LayerGroup instead (harness/nn/layer_group.hpp).
//
// Tensor parallelism (ModelOptions::tp, harness/nn/tensor_parallel.hpp): every TP rank of a
// group gets the same batch; the blocks split heads and FFN columns over the group and issue
// its collectives on the model's stream. With sequence parallelism the activations between
// blocks (and a stage's input and output) are the rank's [T/t,M] rows. Gradients of
// parameters every TP rank holds whole but computed from other rows (Param::tp_partial) and of
// the experts are completed by the gradient synchroniser (harness/nn/grad_sync.hpp), or by
// all_reduce_gradients.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/comm/communicator.hpp"
#include "harness/config/model.hpp"
#include "harness/nn/blocks.hpp"
#include "harness/nn/grad_sync.hpp"
#include "harness/nn/vision.hpp"

namespace moelab {

struct ModelOptions {
  std::string impl = "fastmoe";                  // the MoE layers' implementation (moelab list)
  nlohmann::json impl_options = nlohmann::json::object();
  int first_layer = 0, last_layer = -1;          // [first, last); -1: to the end
  float aux_loss_coef = 0.01f;                   // Switch Transformer's alpha (Fedus et al. 2022, §2.2)
  // Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): the group that splits attention
  // heads, the FFN and the vocabulary; null or size 1: no tensor parallelism. The model issues
  // its collectives on its stream: give it a communicator no other stream uses. With
  // sequence_parallel the TP ranks hold different tokens outside the TP regions (Korthikanti
  // et al. 2022, §4.2.2).
  Communicator* tp = nullptr;
  bool sequence_parallel = false;
  // Selective activation recomputation (Korthikanti et al. 2022 §5, the cheap layers): the
  // attention and dense MLP blocks keep their input instead of also its normed copy and make
  // the norm again for their weight gradients (AttentionBlock::set_recompute_norm).
  bool recompute_norms = false;
  // Tied embeddings (cfg.tie_embeddings) in a range that has the LM head but not the
  // embedding: the range holds its own copy of the word embeddings, zero until the pipeline
  // copies the embedding into it, and the pipeline sums the two copies' gradients every step
  // (Megatron's embedding group; harness/pipeline/executor.hpp). Without it such a range is a
  // ConfigError.
  bool tied_embedding_copy = false;
  // An empty layer range [0, 0) or [L, L): a pipeline chunk holding only the embedding or only
  // the final norm and head (the uneven split of PipelineOptions::pad_layers).
  bool allow_empty_range = false;
  // The range starts at layer 0 (ends at the last) but another chunk holds the embedding (the
  // head): with the uneven split the embedding and the head may be chunks of their own.
  bool without_embedding = false, without_head = false;
};

// One microbatch's input: token ids [T] int32 (a stage with the embedding) or activations
// [T,M]; targets [T] int32 on the last stage. Gradients are scaled by loss_scale (1/tokens of
// the whole step for a mean over it).
struct Batch {
  Tensor input;
  Tensor targets;
  float loss_scale = 1.0f;
};

class Model {
 public:
  Model(Backend& b, Communicator& ep, const TransformerConfig& cfg, const ModelOptions& opt = {});
  ~Model();

  void init_parameters(std::uint64_t seed);
  void zero_grad();

  Forwarded forward(const Batch& batch, const WorkKey& key);
  Tensor backward_input(Saved& saved, const Tensor& dy);
  void backward_weight(Saved& saved);
  // Both halves block by block (input gradient, then weight gradient of the same block, from
  // the last block to the first), as autograd orders them: each block's gradients are final
  // as early as possible, so that data parallelism's buckets (GradSync) overlap the rest of
  // backward as PyTorch's DistributedDataParallel does. The same gradients as
  // backward_input + backward_weight.
  Tensor backward(Saved& saved, const Tensor& dy);
  // Forward without training: every block's saved state is released as soon as the block has
  // run, so that only the activations in flight are held (inference over full-sequence
  // batches). y as forward's; the Forwarded has no saved state. The head's loss is computed.
  Tensor infer(const Batch& batch, const WorkKey& key);
  // Inference only: every parameter's gradient tensor given back (the memory a forward-only run
  // does not need); backward is refused afterwards.
  void release_gradients();
  // The microbatch's mean cross-entropy over its counted targets, and its summed auxiliary
  // loss over MoE layers (host values; synchronises). Last stage only for the loss. Under
  // sequence parallelism the auxiliary loss is this rank's share: the TP ranks' values sum to
  // the unsplit model's (MoELayer::partition_sequence).
  double loss(const Saved& saved);
  double aux_loss(Saved& saved);

  // Every parameter, named, in model order; the MoE layers' gate weights count as replicated,
  // their experts as sharded over the expert-parallel group.
  std::vector<Param> parameters();
  // The same, with where each lives and which block finishes its gradient (GradSync).
  std::vector<ParamSlot> param_slots();
  // Sum the replicated parameters' gradients over `dp` (data parallelism: every rank saw
  // other tokens), the experts' over `edp` (expert data parallelism: the ranks that hold the
  // same experts; null or size 1: none), the TP-partial ones over the TP group, and average
  // the experts' TP copies (grad_sync.hpp). One collective per parameter, on the compute
  // stream, after backward: GradSync does the same in buckets, overlapped with backward.
  void all_reduce_gradients(Communicator& dp, Communicator* edp);
  // The synchroniser told of every block whose backward_weight is issued (GradSync::arm
  // decides which microbatch's count); null: none.
  void set_grad_sync(GradSync* sync) { sync_ = sync; }
  const TensorParallel& tensor_parallel() const { return tp_; }

  const TransformerConfig& config() const { return cfg_; }
  bool has_embedding() const { return embedding_ != nullptr || patch_embed_ != nullptr; }
  bool has_head() const { return head_ != nullptr || classifier_ != nullptr; }
  int first_layer() const { return first_; }
  int last_layer() const { return last_; }
  const std::vector<std::unique_ptr<Block>>& blocks() const { return blocks_; }
  // The MoE layers' implementations (for reports and the bare-GEMM yardstick).
  std::vector<MoEImpl*> moe_layers();
  Stream& stream() { return s_; }
  // Model FLOPs of one forward + backward of `tokens` tokens through this range: 6·N·T for the
  // matmul parameters active per token plus attention's 12·L·S·M-style term (Narayanan et al.
  // 2021, App. / PaLM's MFU definition): the numerator of model FLOPs utilisation.
  double model_flops(std::int64_t tokens) const;

 private:
  Forwarded run_forward(const Batch& batch, const WorkKey& key, bool keep);
  double vision_flops(std::int64_t tokens) const;
  Backend& b_;
  Communicator& ep_;
  TransformerConfig cfg_;
  ModelOptions opt_;
  TensorParallel tp_;
  Stream& s_;
  GradSync* sync_ = nullptr;
  bool gradients_released_ = false;  // release_gradients(): inference only
  int first_ = 0, last_ = 0;
  std::unique_ptr<MoEChannels> channels_;  // shared by the MoE layers; outlives them (declared first)
  Param wte_copy_;                         // [V,M] the head's copy of tied embeddings (tied_embedding_copy)
  Embedding* embedding_ = nullptr;
  Head* head_ = nullptr;
  PatchEmbed* patch_embed_ = nullptr;     // a vision model's first block, in place of the embedding
  ClassifierHead* classifier_ = nullptr;  // and its last, in place of the head
  std::vector<std::unique_ptr<Block>> blocks_;  // in order: [embedding] (attention, ffn)* [head]
  std::vector<int> routed_top_k_;  // per layer of the range: the top-k its MoE layer's implementation routes (0: dense)
};

// Adam or SGD over a model's parameters: fp32 master weights (for parameters that are not
// fp32) and Adam's two moments live under MemCategory::optimizer.
struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::adam;
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.0f;
};

// With a GradSync in ZeRO-1 mode (Rajbhandari et al. 2020, §5.1) the states are made for this
// rank's shard of every bucket only, step() updates the shards and the synchroniser
// all-gathers them; without ZeRO-1 it is the per-parameter optimizer over sync's parameters.
class Optimizer {
 public:
  Optimizer(Backend& b, Stream& s, std::vector<Param> params, const OptimizerConfig& cfg);
  Optimizer(Backend& b, Stream& s, GradSync& sync, const OptimizerConfig& cfg);
  void step();  // one update of every parameter (asynchronous, on the stream)
  std::int64_t steps() const { return t_; }

 private:
  struct Slot {
    Tensor param, grad;  // [n] flat: a parameter, or a ZeRO-1 shard of a bucket
    Tensor master, m, v;
  };
  void add_slot(const Tensor& param, const Tensor& grad);
  Backend& b_;
  Stream& s_;
  OptimizerConfig cfg_;
  GradSync* zero_ = nullptr;  // ZeRO-1: the slots are its buckets' shards, in order
  std::vector<Slot> slots_;
  std::int64_t t_ = 0;
};

OptimizerKind parse_optimizer(const std::string& s);  // "adam" | "sgd"; throws ConfigError

}  // namespace moelab
