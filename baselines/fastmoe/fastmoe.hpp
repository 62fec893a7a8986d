// baselines/fastmoe/fastmoe.hpp — FastMoE (He et al., 2021) as the papers use it: plain
// expert parallelism with no overlap. gate -> local scatter -> all-to-all-v -> per-expert
// GEMMs -> all-to-all-v -> gather. It is exactly the harness's unpipelined MoELayer (one
// chunk, one in flight), so this baseline is a thin adapter, not a copy. With several
// microbatches in flight, backward_weight really runs later: backward_input leaves the expert
// and gate weight-gradient GEMMs (and what they read) in the saved value.
//
// Options (JSON object): {"as_published": true} issues the same math the way the published
// code (laekov/fastmoe v1.0.0) issues it: the count exchange on the communication stream and
// the host waits of prepare_forward, one collective per local expert for each exchange with a
// host wait after it, one GEMM call per expert per linear with a host wait after each linear,
// and the weight gradients in backward_input (README.md, "As published", has every difference
// with its file:line). Default false: the ideal form above. Anything else is a ConfigError.
#pragma once
#include <memory>

#include "harness/nn/moe_impl.hpp"
#include "harness/nn/moe_layer.hpp"

namespace moelab {

std::unique_ptr<MoEImpl> make_fastmoe(Backend& b, Communicator& c, const ModelConfig& m, const nlohmann::json& options);
void register_fastmoe();

// FastMoE v1.0.0's prepare_forward (fmoe/functions.py:28-75) as it issues work, for the layers
// that reproduce it (fastmoe and fastermoe with "as_published"): the counts, zero-filled
// (functions.py:30), exchanged with every rank in one NCCL group of W sends and W receives of
// El int64 each on the communication stream `lane` (cuda/global_exchange.cpp:14-31), then the
// host waits the code has, in its order (logged by MoELayer::host_wait). The numbers
// themselves are the layer's Communicator::exchange_counts (every backend has them there).
// Called from plan_chunks, after the local scatter rather than before it: with a host wait
// between them either order runs the two one after the other.
void fastmoe_published_prepare_forward(MoELayer& layer, Stream& lane, Communicator& lane_comm);
// The host waits fastmoe_published_prepare_forward logs, in order (for tests).
std::vector<std::string> fastmoe_published_prepare_forward_waits();

}  // namespace moelab
