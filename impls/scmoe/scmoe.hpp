// impls/scmoe/scmoe.hpp — ScMoE's block pair (Cai, Jiang, Qin, Cui, Kim, Huang,
// "Shortcut-connected Expert Parallelism for Accelerating Mixture of Experts", arXiv 2404.05019,
// ICML 2025) as a LayerGroup of the model (harness/nn/layer_group.hpp), and its overlap schedule.
//
// The pair (Block-MLP l, Block-MoE l+1), pre-norm; at Pos-2 (§3, the paper's equations):
//   H_l^MH     = H_{l-1} + MHA_l(H_{l-1})
//   H_l^MLP    = H_l^MH + MLP_l(H_l^MH)
//   H_{l+1}^MH = H_l^MLP + MHA_{l+1}(H_l^MLP)
//   H_{l+1}    = H_{l+1}^MH + combine(SE(n(H_{l+1}^MH)), Σ_i G(n'(H_l^MH))_i · E_i(n'(H_l^MH)))
// with n, n' the shared expert's and the routed MoE's own norms; Pos-1 feeds the routed MoE
// the MoE block's input H_l^MLP, Pos-3 the dense block's input H_{l-1}. combine is a sum, CG-1
// (coef = sigmoid(n(x)·W_cg), out = coef·SE + MoE) or CG-2 (a 2-way softmax of n(x)·W_cg
// weighing both), Backend::gated_combine_*. The routed MoE is top-1, served by any MoEImpl.
//
// Schedule (§4; README.md has the timelines): the main (compute) stream runs attention, MLP
// and the shared expert; the routed MoE's dispatch and combine all-to-alls run on their own
// streams and communicators (MoEChannels). Gate and permute as soon as the shortcut's input
// exists, unpermute as late as possible; the experts in the slot of the window that
// schedule.hpp's rule picks from the cost model's times (or the model file's expert_slot); the
// all-to-alls cut into chunks (Tutel style, split_chunk on the chunk issuer) when communication
// exceeds the window. Backward mirrors it: the combine's backward all-to-all overlaps the
// backward of the later blocks, the dispatch's the earlier. The choices are in the MoE layer's
// report (`impl_report.scmoe` of a result).
//
// Saved state is a value (several microbatches in flight); the gate noise is keyed by
// WorkKey {MoE layer, microbatch, step}; backward_input is B (input gradients, norms' own
// parameter gradients), backward_weight W (every weight-gradient GEMM of the pair).
//   ctest --test-dir build -R scmoe          (impls/scmoe/scmoe_test.cpp, scmoe_mpi_test.cpp)
#pragma once
#include <memory>

#include "harness/nn/layer_group.hpp"

namespace moelab {

// The pair of the model's layers [args.first_layer, + cfg.scmoe.span()).
std::unique_ptr<LayerGroup> make_scmoe_pair(LayerGroupArgs args);
// Registers make_scmoe_pair as the model's shortcut pair (called from impls/registry.cpp).
void register_scmoe();

}  // namespace moelab
