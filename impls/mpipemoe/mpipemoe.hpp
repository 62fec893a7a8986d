// impls/mpipemoe/mpipemoe.hpp — MPipeMoE (Zhang et al., IPDPS'23): the expert-parallel MoE
// layer pipelined along the token dimension.
//
// The tokens of a rank are split into n partitions (contiguous token ranges); each partition
// runs its own full dispatch all-to-all (S_p), expert compute (C_p) and combine all-to-all
// (R_p). S runs on the dispatch stream over its own communicator, C on the compute stream,
// R on the combine stream over another communicator, so S_{p+1}, C_p and R_{p-1} overlap
// (§III-A). The backward pass mirrors it. The gate, the permute into the expert-major T_I
// and the unpermute stay global: routing, capacity and every number computed are those of
// the unpipelined layer, and n = 1 is the FastMoE baseline exactly. The partitions are a
// chunk plan run by the harness's chunk issuer (harness/nn/moe_schedule.hpp); memory reuse and
// the restore strategies are its hooks. Any number of microbatches may be in flight (MoEImpl's
// handle API; each forward's rotating buffers and offloaded copies live in its saved value),
// but the weight gradients are done in backward_input, whose memory reuse and restore
// strategies are defined for a combined backward: backward_weight has nothing left to do.
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
//   "t_m_buffers": 1 (the paper's, default) or 2. With one T_M, offloading T_M_p (S1, S2)
//       must finish before FC1 of partition p+1 overwrites it, and its fetch in backward waits
//       for C'_{p-1}: the copies run in series with the compute, which Eq. 10 does not model.
//       Two T_M buffers let them overlap, for one more [b,H] buffer (not in the paper; S3/S4
//       recompute T_M and keep one buffer whatever this says).
//   Eq. 10's inputs, each overriding what the backend knows (Backend::machine_rates: the sim's
//       cluster model and profile; cuda: the device's memory) or measures (W_comp: the
//       partition's FC1 timed by time_bare_gemms): "comp_tflops" (GEMM TFLOP/s), "comm_gbps"
//       (all-to-all GB/s per rank), "mem_gbps" (host copy GB/s), "sigma", "mu", "eta"
//       (interference factors in (0,1]). What neither gives is assumed (default_throughputs:
//       a 25 GB/s NIC, 24 GB/s PCIe, 0.9 each); the report names each figure's source.
//   "host_memory_gb": pinned host memory a rank may use for offloads (default: the node's host
//       memory / its GPUs from the machine model, else unlimited); a strategy needing more is
//       a ConfigError before any work. "memory_gb": device memory for activations + buffers,
//       a constraint on "auto" (default: the device's capacity less what is in use).
//   Under "auto" the ranks agree: the choice is made for the largest token count over ranks
//   with the smallest rates and budgets, so every rank runs the same strategy.
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
