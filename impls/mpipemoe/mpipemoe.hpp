// impls/mpipemoe/mpipemoe.hpp — MPipeMoE (Zhang et al., IPDPS'23): the expert-parallel MoE
// layer pipelined along the token dimension.
//
// The tokens of a rank are split into n partitions (contiguous token ranges); each partition
// runs its own full dispatch all-to-all (S_p), expert compute (C_p) and combine all-to-all
// (R_p). S runs on the dispatch stream over its own communicator, C on the compute stream,
// R on the combine stream over another communicator, so S_{p+1}, C_p and R_{p-1} overlap
// (§III-A). The backward pass mirrors it. The gate, the permute into the expert-major T_I
// and the unpermute stay global: routing, capacity and every number computed are those of
// the unpipelined layer, and n = 1 is the FastMoE baseline exactly.
//
// Options (JSON, `moelab run --impl mpipemoe --impl-options '{...}'`):
//   "partitions": n (a positive integer) or "auto" (the online granularity search, §III-B)
//   "max_partitions": the largest n the search tries (default 16)
//   "min_partition_tokens": the fewest tokens per partition the search allows (default 64)
//   "strategy": memory reuse (§III-C) and how backward gets the reused T_DI, T_M back
//               (§III-D; impls/mpipemoe/strategy.hpp):
//       "none"  no reuse: one T_DI_p, T_M_p, T_DO_p per partition (the default)
//       "S1"    T_DI and T_M offloaded to pinned host memory (d2h stream), fetched back (h2d)
//       "S2"    T_DI re-communicated (the dispatch all-to-all re-run from the kept T_I), T_M offloaded
//       "S3"    T_DI offloaded, T_M recomputed by FC1 from the restored T_DI
//       "S4"    T_DI re-communicated, T_M recomputed
//       "auto"  the cheapest of S1–S4 by Eq. 10 that fits the memory budgets (§III-E)
//   "reuse": true  reuse buffers; without "strategy" this means "auto" (false: "none")
//   With reuse, T_DI and T_DO rotate through two buffers and T_M through one, each sized for
//   the largest partition; events order every overwrite after the buffer's previous user.
//   Reuse with n = 1 is allowed but saves nothing (the report says so).
//   Eq. 10's inputs: "comp_tflops" (GEMM TFLOP/s), "comm_gbps" (all-to-all GB/s per rank),
//       "mem_gbps" (host copy GB/s), "sigma", "mu", "eta" (interference factors in (0,1]).
//       Assumed when absent: an A100 at 156 TFLOP/s × 0.8, a 25 GB/s NIC, 24 GB/s PCIe, 0.9
//       each — datasheet figures, not measurements.
//   "host_memory_gb": pinned host memory available for offloads; a strategy needing more is a
//       ConfigError before any work (absent: unlimited). "memory_gb": device memory for
//       activations + buffers, a constraint on "auto" (absent: unlimited).
//   The report gives the strategy of the last forward, its memory model (§III-C: the paper's
//   and the predicted peak of activations + buffers, pinned host bytes, φ of Eq. 6) and, with
//   reuse, every strategy's Eq. 10 cost and the chosen one's.
#pragma once
#include <memory>

#include "harness/nn/moe_impl.hpp"

namespace moelab {

std::unique_ptr<MoEImpl> make_mpipemoe(Backend& b, Communicator& c, const ModelConfig& m, const nlohmann::json& options);
void register_mpipemoe();

}  // namespace moelab
