// baselines/topk/topk.hpp — the MoE baselines ScMoE is measured against (Cai et al.,
// arXiv 2404.05019, evaluation), each the harness's MoE layer (harness/nn/moe_layer.hpp) with a
// plan for the shared chunk issuer (harness/nn/moe_schedule.hpp), not a copy of the layer:
//
//   top2             top-2 routing, unpipelined (the paper's reference: GShard-style top-2)
//   top1             top-1 routing, unpipelined (Switch Transformer style)
//   residual-moe     DeepSpeed-MoE's Residual-MoE (Rajbhandari et al., ICML'22, §4.1): a dense
//                    MLP beside a top-1 expert. The routed part is top1's; the dense MLP is the
//                    model's shared expert (moe.shared_expert_hidden > 0, FfnBlock), which the
//                    option check requires. The two outputs are added; DeepSpeed's code
//                    (use_residual) weighs them by a learned 2-way softmax per token instead
//                    (ScMoE's CG-2), which this baseline omits
//   top1-pipelined   top-1 and top-2 with the all-to-alls cut into chunks, Tutel style (Hwang et
//   top2-pipelined   al., MLSys'23, §3.3; split_chunk), so that chunk i's experts overlap chunk
//                    i+1's dispatch and chunk i−1's combine
//
// The routing width is the baseline's whatever the model file says (top_k = 1 or 2; the other
// MoE fields are the model's), so one model file serves every baseline. Options (JSON object):
// the pipelined ones take {"chunks": r}, r from 1 to 64, default 4; the others take none.
// Anything else is a ConfigError naming the option, before any work.
//   moelab run --model experiments/models/gpt2-moe-small.json --impl top2-pipelined
//       --impl-options '{"chunks": 4}' --backend sim --cluster pcie-a30x1         (one line)
//   ctest --test-dir build -R topk_test
#pragma once

namespace moelab {

// Registers top1, top2, residual-moe, top1-pipelined and top2-pipelined (impls/registry.cpp).
void register_topk_baselines();

}  // namespace moelab
