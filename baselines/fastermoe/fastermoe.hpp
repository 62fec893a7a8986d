// baselines/fastermoe/fastermoe.hpp — FasterMoE's "smart schedule" (He et al., "FasterMoE:
// Modeling and Optimizing Training of Large-Scale Dynamic Pre-Trained Models", PPoPP'22, §4):
// the all-to-all of expert parallelism split along the worker dimension into n_g steps of
// group-wise exchange, so that the exchanges of one step overlap the experts of another.
//
// Ranks form contiguous groups of G (option "group_size", default 4, as FasterMoE's
// FMOE_FASTER_GROUP_SIZE); n_g = W / G. In step i my group g sends to group (g + i) mod n_g
// and receives from group (g - i) mod n_g. Per step: S_i (dispatch exchange), C_i (experts),
// R_i (combine exchange); on two streams the communication stream runs S_0, S_1, R_0, S_2,
// R_1, ... and the compute stream C_0, C_1, ..., so S_{i+1} and R_{i-1} overlap C_i.
// Gate, permute, unpermute and the experts' math are the harness's MoELayer's, and the steps
// are issued by its chunk issuer (harness/nn/moe_schedule.hpp): this baseline is a planner
// (the steps as chunks, one communication stream, S_{i+1} queued before C_i). Outputs and
// gradients equal the unpipelined layer's up to fp32 summation order. Any number of
// microbatches may be in flight (MoEImpl's handle API); backward_weight runs the expert and
// gate weight-gradient GEMMs that backward_input deferred, as for FastMoE.
//
// Options (JSON object): {"group_size": G}, G a positive integer dividing the world size;
// a world smaller than G runs as one group of W (report() says so). Anything else is a
// ConfigError naming the option and its value, thrown before any work.
//   moelab run --workload experiments/workloads/tiny.json --impl fastermoe --backend sim --cluster dgx-a100x1
//   ctest --test-dir build -R fastermoe          (tests: baselines/fastermoe/fastermoe_test.cpp)
#pragma once
#include <memory>

#include "harness/nn/moe_impl.hpp"

namespace moelab {

std::unique_ptr<MoEImpl> make_fastermoe(Backend& b, Communicator& c, const ModelConfig& m,
                                        const nlohmann::json& options);
// Registers "fastermoe" with the MoEImpl registry (called from impls/registry.cpp).
void register_fastermoe();

}  // namespace moelab
