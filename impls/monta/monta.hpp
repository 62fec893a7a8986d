// impls/monta/monta.hpp — MoNTA (Guo et al., "MoNTA: Accelerating Mixture-of-Experts Training
// with Network-Traffic-Aware Parallel Optimization", arXiv 2411.00662): the TP-deduplicated
// all-to-all of DeepSpeed's later order (baselines/deepspeed_tp_ep: each TP rank sends its 1/t
// slice of the padded capacity tensor, an all-gather over the TP group rebuilds the whole),
// pipelined along the capacity: chunk i's intra-node all-gather runs while chunk i+1's
// all-to-all is on the network, and chunk i+1's dispatch while chunk i's experts compute.
//
//   moelab run --model M --parallel tp=8,ep=16 --impl monta --impl-options '{"chunks": 4}'
//
// Options: {"chunks": n} (1 to 64; default 4, the authors' code's fixed count; "auto": the
// volume and time model's pick, impls/monta/strategy.hpp). README.md maps the paper to the code.
#pragma once

namespace moelab {

void register_monta();

}  // namespace moelab
