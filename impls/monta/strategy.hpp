// impls/monta/strategy.hpp — MoNTA's communication-volume and topology model (arXiv 2411.00662,
// §3: the volumes of the TP-duplicated and deduplicated all-to-alls per link class, and the
// chunked pipeline of all-to-all and intra-node all-gather), and the choice of strategy and
// chunk count from it. Pure functions: the layer (baselines/deepspeed_tp_ep) asks for a chunk
// count ("chunks": "auto"), the tests check the volumes against the bytes the communicators
// move, and the suite compares every pick with the simulated best.
//
// Per rank, per MoE layer, one exchange (the dispatch's all-to-all; the combine's is the same
// bytes back; backward repeats both), in bytes, with P ranks in the expert-parallel group, E
// experts (El = E/P each), C the padded capacity, M d_model, b bytes per element, t = TP:
//   flat (deepspeed-tp)          to each other EP rank: El·C·M·b                         (t times
//                                                                                        the bytes)
//   deduplicated (drop, monta)   to each other EP rank: El·(Cp/t)·M·b, Cp = C rounded up to t·n;
//                                then an all-gather over the TP group: (t-1)·E·(Cp/t)·M·b sent
//   hierarchical (2D)            the flat bytes, in two steps: inside the node to the peer with
//                                the destination's local index (NVLink), then between nodes over
//                                the rails (NIC): the NIC bytes of flat, in g times fewer,
//                                larger messages (the `hierarchical` layer, TpDispatch::two_level;
//                                the model charges one latency per exchange and link class, so
//                                it does not see the fewer messages and never ranks it first)
// A peer on this rank's node is reached over the intra-node link (NVLink or PCIe), one on
// another node over the NICs (both on a PCIe machine); a self exchange moves nothing.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace moelab::monta {

enum class Strategy { flat, dedup, hierarchical };
const char* strategy_name(Strategy s);  // "flat", "dedup", "hierarchical"

// Bytes one rank sends, by link class (as the sim counts them: sim::LinkBytes).
struct Volume {
  double intra = 0;  // NVLink (or PCIe inside a PCIe node)
  double nic = 0;    // between nodes
  nlohmann::json to_json() const;
};

// The machine as the model needs it (from the cluster model, or measured).
struct Links {
  int gpus_per_node = 8;
  bool intra_is_pcie = false;  // then an inter-node byte also crosses PCIe (not modelled: time only)
  double intra_bw = 0, intra_latency = 0;  // per GPU per direction, bytes/s; s per exchange step
  double nic_bw = 0, nic_latency = 0;      // one NIC per direction; s per message (NIC + fabric)
  int nics = 0;                            // per node (GPU i on NIC i % nics)
  double gemm_flops = 0;                   // the experts' GEMM rate (FLOP/s) at their shape
  // The rate at a given number of rows per expert (a chunk's: small chunks run GEMMs below the
  // device's best); null: gemm_flops at every size.
  std::function<double(std::int64_t rows)> gemm_flops_at;
  double launch = 0;                       // s per kernel launch / library call
  bool known() const { return intra_bw > 0 && (nic_bw > 0 || nics == 0) && (gemm_flops > 0 || gemm_flops_at); }
};

// One MoE layer on one rank.
struct Layer {
  std::int64_t E = 0, C = 0, M = 0, H = 0;  // experts, capacity (the largest of the EP group), d_model, d_hidden
  int bytes = 2;                            // per element
  int t = 1;                                // TP ranks (holding the same tokens)
  std::vector<int> ep_ranks;                // world ranks of the EP group, in order
  int rank = 0;                             // this rank's world rank (in ep_ranks)
};

// The capacity each strategy pads to: C rounded up to t·n (dedup), else C.
std::int64_t padded_capacity(const Layer& l, Strategy s, int chunks);
// One exchange's all-to-all, and (dedup) the TP all-gather that follows it.
Volume all_to_all_volume(const Layer& l, const Links& k, Strategy s, int chunks);
Volume all_gather_volume(const Layer& l, const Links& k, Strategy s, int chunks);

// The predicted time of one forward + backward of the layer's exchanges and experts: a list
// schedule of chunks over three resources as the layer issues them (the network for dispatch
// and combine, the GPU for the experts, the intra-node link for the all-gathers; chunk i+1's
// dispatch before chunk i's experts), forward then backward (experts twice the forward's).
struct Prediction {
  std::string impl;   // "deepspeed-tp", "deepspeed-drop", "monta" (hierarchical: "hierarchical")
  Strategy strategy = Strategy::flat;
  int chunks = 1;
  double seconds = 0;                // forward + backward
  double all_to_all_s = 0;           // one exchange alone
  double all_gather_s = 0;           // one all-gather alone (dedup), all chunks
  double experts_s = 0;              // the forward's experts
  Volume a2a, gather;                // per exchange
  nlohmann::json to_json() const;
};
Prediction predict(const Layer& l, const Links& k, Strategy s, int chunks);

// Every candidate (flat; dedup with 1, 2, 4, ..., max_chunks chunks; hierarchical) with its
// prediction, fastest first; with t = 1 dedup is flat and is left out.
std::vector<Prediction> candidates(const Layer& l, const Links& k, int max_chunks = 16);
// The fastest deduplicated chunk count (MoNTA's "auto"), among 1, 2, 4, ..., max_chunks.
int best_chunks(const Layer& l, const Links& k, int max_chunks = 16);

// MoNTA's choice of the parallel strategy itself (§4), where asked: every TP degree (dividing
// the GPUs of a node and the heads) and EP degree (dividing the world and the experts) of a
// world, each with its best strategy and chunk count, ranked by the GPU time of the MoE layer
// per token (the cluster's t-rank TP groups each route `tokens` tokens, so a step moves
// tokens · world / t of them: seconds · t / tokens). A layout whose MoE layers do not fit the
// device (their experts' weights, gradients and Adam states, and one pass's padded buffers)
// is listed as not fitting. The MoE layers only: attention's own TP costs and memory are not in it.
struct LayoutQuery {
  int world = 0, heads = 0, kv_heads = 0;  // heads: TP must divide them (0: not checked)
  std::int64_t E = 0, M = 0, H = 0, tokens = 0;  // tokens: the MoE layer's input rows per TP group
  int top_k = 1;
  double capacity_factor = 1.0;
  int bytes = 2;
  double device_memory = 0;  // bytes; 0: not checked
  int moe_layers = 1;        // the model's MoE layers: the memory check is theirs together
  int max_chunks = 16;
};
struct LayoutPrediction {
  int tp = 1, ep = 1;
  Prediction best;
  double seconds_per_token = 0;  // GPU-seconds of the MoE layer per token
  double memory_bytes = 0;       // the MoE layer's on one GPU
  bool fits = true;
  nlohmann::json to_json() const;
};
std::vector<LayoutPrediction> rank_layouts(const LayoutQuery& q, const Links& k);

}  // namespace moelab::monta
