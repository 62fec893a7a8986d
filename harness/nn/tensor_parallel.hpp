// harness/nn/tensor_parallel.hpp — tensor parallelism as the blocks use it (Megatron-LM,
// Shoeybi et al. 2019, §3) with sequence parallelism (Korthikanti et al. 2022, §4.2.2): a
// rank's place in its TP group, the collectives at the two edges of a tensor-parallel region,
// and how a split parameter is cut from the full one.
//   ctest --test-dir build -R tp_mpi_test
//
// A region starts before a column-parallel GEMM (its weight split by output columns: every
// rank makes its own heads or FFN columns) and ends after a row-parallel GEMM (split by input
// rows: every rank holds a partial sum of the whole output). The edges are Megatron's
// conjugate operators f and g (Shoeybi et al., Fig. 3), or with sequence parallelism their
// all-gather / reduce-scatter pair (Korthikanti et al., Fig. 5, g and ḡ):
//
//                     forward                            backward
//   enter  TP         identity                 (f)       all-reduce of d_in
//          TP + SP    all-gather  [T/TP,M] -> [T,M]      reduce-scatter [T,M] -> [T/TP,M]
//   leave  TP         all-reduce of the output (g)       identity
//          TP + SP    reduce-scatter [T,M] -> [T/TP,M]   all-gather [T/TP,M] -> [T,M]
//
// With sequence parallelism the tokens outside the regions (norms, residuals, the MoE layers)
// are split: rank r holds rows [r·T/TP, (r+1)·T/TP) of the microbatch, the order all_gather
// concatenates them in. Every collective goes through the TP communicator on the stream the
// block issues on (one communicator, one stream: communicator.hpp).
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "harness/comm/communicator.hpp"
#include "harness/runtime/backend.hpp"

namespace moelab {

struct TensorParallel {
  Communicator* comm = nullptr;    // the TP group; null or size 1: no tensor parallelism
  bool sequence_parallel = false;  // ignored without tensor parallelism

  int size() const { return comm ? comm->size() : 1; }
  int rank() const { return comm ? comm->rank() : 0; }
  bool on() const { return size() > 1; }
  bool sp() const { return on() && sequence_parallel; }
  // Rows of a microbatch of T tokens this rank holds outside the regions.
  std::int64_t local_tokens(std::int64_t T) const { return sp() ? T / size() : T; }

  // The edges, issued on s. New tensors are charged to `cat` (and the caller's microbatch).
  // [T/TP,M] -> [T,M] (SP); else x
  Tensor enter(Backend& b, Stream& s, const Tensor& x, MemCategory cat = MemCategory::buffers) const;
  // partial [T,M] -> summed [T,M] (in place) or [T/TP,M]
  Tensor enter_backward(Backend& b, Stream& s, Tensor d_in, MemCategory cat = MemCategory::buffers) const;
  Tensor leave(Backend& b, Stream& s, Tensor y, MemCategory cat = MemCategory::buffers) const;
  // [T/TP,M] -> [T,M] (SP); else dy
  Tensor leave_backward(Backend& b, Stream& s, const Tensor& dy, MemCategory cat = MemCategory::buffers) const;

  // The vocabulary, rounded up to a multiple of the TP size as Megatron-LM pads it (its
  // make-vocab-size-divisible-by; the extra rows are never a token or a target, but their
  // logits enter the softmax), and this rank's shard of it: rows of the embedding table,
  // columns of the logits. Without TP: V and the whole table.
  std::int64_t padded_vocab(std::int64_t V) const { return (V + size() - 1) / size() * size(); }
  VocabShard vocab_shard(std::int64_t V) const {
    if (!on()) return {};
    return {rank() * (padded_vocab(V) / size()), padded_vocab(V)};
  }
};

// How a tensor-parallel parameter is cut from the full one. Along dimension `dim` the full
// tensor has `full` entries made of `segments` (start, length) laid end to end — the query,
// key and value heads of W_qkv, the gate and up halves of a SwiGLU W_1 — and rank r of `size`
// holds the r-th equal part of every segment, concatenated in segment order. So each rank's
// W_qkv is again [q | k | v] of its own heads and its SwiGLU W_1 again [gate | up], which the
// attention and SwiGLU ops read unchanged. dim < 0: not split (the whole tensor).
struct TpShard {
  int dim = -1;
  std::int64_t full = 0;
  std::vector<std::pair<std::int64_t, std::int64_t>> segments;
  int rank = 0, size = 1;

  bool split() const { return dim >= 0 && size > 1; }
  // The (start, length) pieces of the full dimension that rank `r` holds, in its order.
  std::vector<std::pair<std::int64_t, std::int64_t>> pieces(int r) const;
  std::int64_t local() const;  // entries of `dim` one rank holds (full / size)
};

// A split of `full` entries along `dim` made of the given segments (each divisible by tp's
// size; a ConfigError naming `what` otherwise). One segment {0, full} when none are given.
TpShard tp_shard(const TensorParallel& tp, int dim, std::int64_t full,
                 std::vector<std::pair<std::int64_t, std::int64_t>> segments, const std::string& what);

// Host copies, row-major [rows, cols] with the split along dim 0 (rows) or 1 (cols):
// rank r's part of a full tensor, and a rank's part written back into the full tensor.
std::vector<float> take_shard(const std::vector<float>& full, std::int64_t rows, std::int64_t cols, const TpShard& sh,
                              int rank);
void place_shard(std::vector<float>& full, std::int64_t rows, std::int64_t cols, const TpShard& sh, int rank,
                 const std::vector<float>& part);

}  // namespace moelab
