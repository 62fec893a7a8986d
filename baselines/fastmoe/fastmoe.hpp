// baselines/fastmoe/fastmoe.hpp — FastMoE (He et al., 2021) as the papers use it: plain
// expert parallelism with no overlap. gate -> local scatter -> all-to-all-v -> per-expert
// GEMMs -> all-to-all-v -> gather. It is exactly the harness's unpipelined MoELayer (one
// chunk, one in flight), so this baseline is a thin adapter, not a copy. With several
// microbatches in flight, backward_weight really runs later: backward_input leaves the expert
// and gate weight-gradient GEMMs (and what they read) in the saved value.
#pragma once
#include <memory>

#include "harness/nn/moe_impl.hpp"

namespace moelab {

std::unique_ptr<MoEImpl> make_fastmoe(Backend& b, Communicator& c, const ModelConfig& m, const nlohmann::json& options);
void register_fastmoe();

}  // namespace moelab
