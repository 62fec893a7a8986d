// harness/nn/grad_sync.hpp — data parallelism: the gradient synchroniser that sums every
// parameter's gradient over the ranks that share the parameter, in buckets, on its own stream
// while backward still runs; and ZeRO-1's sharded optimizer states (Rajbhandari et al. 2020,
// §5.1, P_os).
//   ctest --test-dir build -R 'dp_mpi_test|tp_mpi_test|parallel_test'
//
//   GradSync sync(b, model.stream(), model.param_slots(), pg.dp(), pg.edp(), tp, {.zero1 = true});
//   model.set_grad_sync(&sync);                  // before the optimizer is made
//   Optimizer opt(b, model.stream(), sync, oc);  // shards Adam's states under ZeRO-1
//   per step: model.zero_grad(); microbatches ...; sync.arm() before the last one's
//   backward_weight; sync.finish(); opt.step();
//
// Buckets (Megatron-Core's DistributedDataParallel, megatron/core/distributed): the parameters
// are taken in reverse model order — the order backward produces their gradients — and cut
// into buckets of at least `bucket_elems` elements (a parameter is never split); dense and
// expert parameters go to separate buckets, since they are summed over different groups. Each
// bucket's gradients live in one contiguous buffer (the parameters' gradient tensors become
// views into it), so a bucket is one collective. Once armed, the model reports every block
// whose backward_weight has finished; a bucket whose last gradient is final is issued at once
// on the synchroniser's stream (phase "grad_sync" in the timeline), after an event on the
// compute stream, so that its communication overlaps the rest of backward. finish() issues
// what is left and makes the compute stream wait for all of it: the optimizer runs after.
//
// What a bucket's collective does, per parameter (Param, blocks.hpp):
//   tp_partial       all-reduce over the TP group first (the norms and the gate under
//                    sequence parallelism: Megatron-LM's allreduce of the layernorm grads)
//   grad_copies = c  scaled by 1/c first: without sequence parallelism every TP rank routes
//                    the same tokens through the experts, so the expert-parallel and
//                    expert-data-parallel sums count each token c = TP times
//   then             all-reduce over the data-parallel group (dense) or the expert-data-
//                    parallel group (experts); with ZeRO-1 a reduce-scatter instead, each
//                    rank keeping the 1/g slice of the bucket it updates
// The model's loss is scaled by 1/(tokens of the whole step) (Batch::loss_scale), so sums, not
// means, are the gradients of the step.
//
// ZeRO-1: every bucket is padded to a multiple of its group's size g; rank i of the group
// owns elements [i·n/g, (i+1)·n/g) of it. The parameters' values also become views into a
// per-bucket buffer, so that a shard of parameters is one contiguous tensor; the Optimizer
// keeps fp32 master weights (for parameters that are not fp32) and Adam's moments for its
// shards only (MemCategory::optimizer: 1/g of the unsharded bytes, plus padding), updates its
// shard, and gather_parameters() all-gathers the updated shards into the bucket. The
// reduce-scatter runs in place (Megatron-Core's distributed optimizer does the same with its
// gradient buffer): the rank's shard of the summed gradients is its slice of the bucket's
// buffer, so ZeRO-1 adds no gradient memory beyond the padding, and after finish() the other
// slices of the buffer (the other ranks' shards, in the parameters' gradient views) hold
// partial sums: only the shards are the step's gradients.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "harness/comm/communicator.hpp"
#include "harness/nn/blocks.hpp"
#include "harness/nn/tensor_parallel.hpp"
#include "harness/runtime/backend.hpp"

namespace moelab {

struct GradSyncOptions {
  // Megatron-Core's default bucket size (DistributedDataParallelConfig.bucket_size:
  // max(40M, 1M·dp) parameters; large enough that a bucket's collective is bandwidth-bound).
  std::int64_t bucket_elems = 40'000'000;
  bool zero1 = false;
};

// Where a parameter lives, so that the synchroniser can make its gradient (and under ZeRO-1
// its value) a view into a bucket: the owner reads the tensors through these pointers.
struct ParamSlot {
  Param param;            // name and reduction rules; value and grad: the current tensors
  Tensor* value = nullptr;
  Tensor* grad = nullptr;
  int block = 0;          // the block whose backward_weight finishes the gradient
};

// The buckets of a list of parameters, a pure function of their sizes (tested on its own).
struct BucketPlan {
  struct Entry {
    std::size_t param = 0;     // index into the parameter list
    std::int64_t offset = 0;   // element offset in the bucket
    std::int64_t count = 0;
  };
  struct Bucket {
    bool expert = false;             // summed over the expert-data-parallel group
    std::vector<Entry> entries;      // in the order backward makes them
    std::int64_t elems = 0;          // sum of counts
    std::int64_t padded = 0;         // elems rounded up to a multiple of the group size (ZeRO-1)
  };
  std::vector<Bucket> buckets;
};
// numel and expert by parameter in model order; group sizes for the padding (1: none).
BucketPlan plan_buckets(const std::vector<std::int64_t>& numel, const std::vector<bool>& expert,
                        std::int64_t bucket_elems, int dense_group, int expert_group);

class GradSync {
 public:
  // dp: the data-parallel group (dense parameters); edp: the expert-data-parallel group (MoE
  // experts); tp: the model's tensor parallelism. Collective over all three (each is dup'ed
  // for the synchroniser's stream). The slots' tensors are rebound to the buckets here.
  GradSync(Backend& b, Stream& compute, std::vector<ParamSlot> slots, Communicator& dp, Communicator& edp,
           const TensorParallel& tp = {}, const GradSyncOptions& opt = {});
  ~GradSync();
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  // The gradients made from now on are the step's last (the last microbatch's backward_weight
  // follows): buckets are issued as they become final.
  void arm();
  bool armed() const { return armed_; }
  // Block `block`'s backward_weight has been issued on the compute stream.
  void block_done(int block);
  // Issue every bucket not yet issued; the compute stream waits for all of them. Disarms.
  void finish();

  bool zero1() const { return opt_.zero1; }
  const BucketPlan& plan() const { return plan_; }
  std::vector<Param> parameters() const;  // with their current (bucket) tensors
  Stream& stream() { return *stream_; }

  // ZeRO-1: this rank's slice of bucket i (flat views [n/g]) and the group it is sharded over.
  struct Shard {
    Tensor param, grad;
    int group_size = 1;
  };
  std::size_t num_buckets() const { return plan_.buckets.size(); }
  Shard shard(std::size_t i);
  // After the optimizer updated bucket i's shard on the compute stream: all-gather the shards
  // into the bucket's parameters (on the synchroniser's stream).
  void gather_parameters(std::size_t i);
  // The compute stream waits for every gather issued.
  void wait_parameters();

 private:
  struct BucketState;
  void issue(std::size_t i);

  Backend& b_;
  Stream& compute_;
  Stream* stream_ = nullptr;
  std::vector<ParamSlot> slots_;
  GradSyncOptions opt_;
  BucketPlan plan_;
  std::unique_ptr<Communicator> dp_, edp_, tp_;
  std::vector<std::unique_ptr<BucketState>> state_;
  std::vector<std::vector<std::size_t>> by_block_;  // block -> buckets holding its parameters (one per parameter)
  std::unique_ptr<Event> done_;
  bool armed_ = false;
};

}  // namespace moelab
