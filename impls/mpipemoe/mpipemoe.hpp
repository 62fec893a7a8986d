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
#pragma once
#include <memory>

#include "harness/nn/moe_impl.hpp"

namespace moelab {

std::unique_ptr<MoEImpl> make_mpipemoe(Backend& b, Communicator& c, const ModelConfig& m, const nlohmann::json& options);
void register_mpipemoe();

}  // namespace moelab
