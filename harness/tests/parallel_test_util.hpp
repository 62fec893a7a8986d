// harness/tests/parallel_test_util.hpp — what the tensor- and data-parallel MPI tests share
// (tp_mpi_test, dp_mpi_test): a batch of the synthetic language, a parameter gathered back to
// the unsplit model's shape, and the main() of an MPI test (one fresh seed for every rank,
// MOELAB_TEST_SEED replays it; rank 0 prints the report; every rank's result decides the exit).
#pragma once
#include <gtest/gtest.h>

#include <cstdio>
#include <vector>

#include "harness/comm/world.hpp"
#include "harness/nn/data.hpp"
#include "harness/nn/model.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab::test {

// `sequences` sequences of the synthetic language (data.hpp) keyed by (seed, step, microbatch,
// rank), with the loss scale given.
inline Batch token_batch(Backend& b, const TransformerConfig& cfg, const std::vector<std::int32_t>& next,
                         std::int64_t sequences, std::uint64_t seed, std::uint64_t step, int microbatch, int rank,
                         float loss_scale) {
  const TokenBatch tb = synthetic_batch(next, sequences, cfg.seq_len, seed, step, microbatch, rank);
  const auto T = static_cast<std::int64_t>(tb.ids.size());
  Batch x;
  x.input = b.empty({T}, DType::i32, MemCategory::activations, b.default_stream());    // [T]
  x.targets = b.empty({T}, DType::i32, MemCategory::activations, b.default_stream());  // [T]
  b.upload_i32(tb.ids, x.input);
  b.upload_i32(tb.targets, x.targets);
  x.loss_scale = loss_scale;
  return x;
}

// Every rank's t over c, concatenated in rank order (host copy).
inline std::vector<float> gather(Backend& b, Communicator& c, const Tensor& t) {
  if (c.size() == 1) return b.download(t);
  Stream& s = b.default_stream();
  Tensor all = b.empty({c.size() * t.numel()}, t.dtype(), MemCategory::buffers, s);  // [size·n]
  c.all_gather(s, t.reshape({t.numel()}), all);
  b.synchronize();
  return b.download(all);
}

// A parameter's tensor t (its value or gradient) in the unsplit model's shape: a TP-split one
// put together from the TP ranks' parts (TpShard), an expert tensor from the expert-parallel
// ranks' experts (EP rank r holds experts [r·E/EP, (r+1)·E/EP)).
inline std::vector<float> full_tensor(Backend& b, const Param& p, const Tensor& t, Communicator& tp,
                                      Communicator& ep) {
  if (p.shard.split()) {
    const auto parts = gather(b, tp, t);
    const std::int64_t rows = p.shard.dim == 0 ? p.shard.full : t.dim(0);
    const std::int64_t cols = p.shard.dim == 1 ? p.shard.full : t.dim(1);
    std::vector<float> full(static_cast<std::size_t>(rows * cols));
    const auto n = static_cast<std::ptrdiff_t>(t.numel());
    for (int r = 0; r < tp.size(); ++r)
      place_shard(full, rows, cols, p.shard, r, std::vector<float>(parts.begin() + r * n, parts.begin() + (r + 1) * n));
    return full;
  }
  if (!p.replicated) return gather(b, ep, t);
  return b.download(t);
}

inline int mpi_test_main(int argc, char** argv, std::uint64_t& seed) {
  init_world(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  register_builtin_impls();
  {
    auto b = make_backend("cpu");
    auto comm = make_world_communicator(*b);
    const double s = world_rank() == 0 ? static_cast<double>(fresh_seed() >> 12) : 0.0;
    seed = static_cast<std::uint64_t>(comm->all_reduce_sum(s));
    if (world_rank() == 0)
      std::printf("seed %llu on %d ranks\n", static_cast<unsigned long long>(seed), world_size());
  }
  if (world_rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int rc = RUN_ALL_TESTS();
  {
    auto b = make_backend("cpu");
    auto comm = make_world_communicator(*b);
    rc = static_cast<int>(comm->all_reduce_max(rc));
  }
  finalize_world();
  return rc;
}

}  // namespace moelab::test
