// baselines/deepspeed_tp_ep/deepspeed_tp_ep.hpp — DeepSpeed-MoE's expert-parallel layer under
// tensor parallelism (Rajbhandari et al., "DeepSpeed-MoE", ICML 2022; deepspeed/moe/
// sharded_moe.py), as a planner on the MoE layer's public steps, and the TP-deduplicated
// all-to-all that MoNTA (impls/monta) pipelines.
//
// DeepSpeed dispatches a padded capacity tensor: every expert gets C rows from every rank
// (C = ceil(k·cf·T/E), unused rows zero), so the all-to-all always moves E·C·M values per rank
// whatever the routing, and the experts compute on the padding too. Under tensor parallelism
// (TP = t, no sequence parallelism) the t ranks of a TP group hold the same tokens:
//
//   deepspeed-tp    every TP rank sends the whole [E,C,M] (DeepSpeed-MoE as published): the
//                   same bytes cross the network t times and the experts see each token t
//                   times (their gradients are averaged over the copies, grad_sync.hpp)
//   deepspeed-drop  DeepSpeed's later order (drop_tokens / gather_tokens): TP rank r keeps
//                   its 1/t slice of the capacity, rows [r·Cp/t, (r+1)·Cp/t) of every expert
//                   (Cp: C rounded up to a multiple of t), before the all-to-all; the
//                   experts see each token once; after the combine's all-to-all an all-gather
//                   over the TP group rebuilds the whole [E,Cp,M] on every TP rank. Backward
//                   mirrors it: the output gradient, the same on every TP rank, is sliced, and
//                   the input gradient all-gathered after the dispatch's backward.
//
// The gate's capacity C decides which tokens are kept on every strategy; Cp only pads, so
// every strategy computes the same function (and tests compare them row for row).
//
// Layout (this rank, n chunks along the capacity, Cs = Cp / (t·n) rows per expert per chunk):
//   T_I   [N,M]        the kept rows, expert-major (the layer's dispatch_preprocess)
//   T_Is  [n·E·Cs,M]   this TP rank's slice, chunk-major: row (c·E + e)·Cs + j is position
//                      r·Cp/t + c·Cs + j of expert e's capacity (zero where no token is)
//   T_DI_c [El·P·Cs,M] chunk c at the experts: local expert l, source rank q at (l·P + q)·Cs
//   T_Os  [n·E·Cs,M]   the experts' outputs back, laid out as T_Is
//   G     [n·t·E·Cs,M] the all-gather of T_Os over the TP group, chunk by chunk: row
//                      ((c·t + r)·E + e)·Cs + j
//   T_O   [N,M]        the kept rows' outputs, gathered back from G (or T_Os when t = 1)
// Chunk c's all-gather runs on the TP lane (MoEChannels::gather) as soon as its combine
// all-to-all is done, beside chunk c+1's exchanges: MoNTA's pipelining (impls/monta). With
// one chunk it follows the whole exchange (DeepSpeed's order).
//   ctest --test-dir build -R "monta|deepspeed"
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/nn/moe_layer.hpp"

namespace moelab {

struct TpDispatch {
  bool dedup = false;  // drop to this TP rank's slice before the all-to-all
  int chunks = 1;      // pieces along the capacity (MoNTA); 1: unchunked
  // Chooses the chunk count of a forward from the capacity it pads to and the tokens it routes
  // (MoNTA's "auto"), and says why (logged in the report); null: `chunks`.
  std::function<int(std::int64_t capacity, std::int64_t tokens, nlohmann::json& why)> choose;
  // Each exchange in two steps (the two-level, "2DH" all-to-all of Tutel, Hwang et al., MLSys
  // 2023, §3.4): inside the node to the peer with the destination's local index, then between
  // nodes among the ranks of that index (the rails), so that each pair of nodes exchanges one
  // aggregated message per rail instead of one per GPU pair.
  bool two_level = false;
};

// The geometry of one forward: C the capacity padded to (the largest gate capacity of the EP
// group's ranks), t the TP ranks the capacity is sliced
// over (1 without deduplication), r this rank's slice, Cp = C rounded up to t·n, Cs = Cp / (t·n).
struct CapacityGeometry {
  std::int64_t E = 0, C = 0, Cp = 0, Cs = 0;
  int t = 1, r = 0, n = 1;
  std::int64_t slice_rows() const { return static_cast<std::int64_t>(n) * E * Cs; }  // rows of T_Is
  static CapacityGeometry make(std::int64_t experts, std::int64_t capacity, int t, int r, int chunks);
};

// Where each kept row of T_I goes: map_in[i] its row in T_Is (-1: another TP rank's slice),
// map_out[i] its row in G (or in T_Os when t = 1). sent[e]: kept rows of expert e (T_I is
// expert-major).
std::vector<std::int32_t> slice_rows_of(const CapacityGeometry& g, const std::vector<std::int64_t>& sent);
std::vector<std::int32_t> gathered_rows_of(const CapacityGeometry& g, const std::vector<std::int64_t>& sent);

class CapacityTpLayer : public MoELayer {
 public:
  // ep: the expert-parallel group; channels: the model's, with its TP group (none: t = 1).
  CapacityTpLayer(Backend& b, Communicator& ep, const ModelConfig& cfg, MoEChannels* channels, TpDispatch how);
  Forwarded forward(const Tensor& x, const WorkKey& key) override;
  // Every TP rank must route alike: the noise is keyed on the TP group's first world rank.
  std::uint64_t noise_rank() const override;
  bool steps_drivable() const override { return false; }  // its own pass (slice, pass, gather)
  const TpDispatch& dispatch_mode() const { return how_; }
  void set_dispatch_mode(TpDispatch how) { how_ = std::move(how); }
  int tp_size() const { return tp_ ? tp_->size() : 1; }
  // Of the last forward: its geometry, and why its chunk count (with a chooser).
  const CapacityGeometry& geometry() const { return last_geometry_; }
  const nlohmann::json& chunk_choice() const { return last_choice_; }
  std::vector<int> ep_world_ranks() const { return comm_.world_ranks(); }

 protected:
  Tensor backward_pass(MoESaved& sv, const Tensor& dy, float grad_aux, bool defer) override;
  ChunkPlan plan_chunks(MoESaved& sv) override;
  void exchange(Stream& s, Communicator& comm, const Chunk& ch, const Tensor& src, Tensor& dst, bool reverse) override;
  // The two-level exchange's groups per lane: this rank's node (g ranks) and its rail (one rank
  // of each node, the same local index).
  struct Levels {
    std::unique_ptr<Communicator> node, rail;
  };
  Levels dispatch_levels_, combine_levels_;
  int gpus_per_node_ = 0;
  Communicator* tp_ = nullptr;  // the TP group (null: none)
  TpDispatch how_;
  CapacityGeometry last_geometry_;
  nlohmann::json last_choice_ = nlohmann::json::object();
};

// The options of deepspeed-tp / deepspeed-drop (none) and of monta ({"chunks": n}), checked
// before any work; ConfigError naming the option. Capacity must be finite: DeepSpeed pads to it.
void check_capacity_model(const std::string& impl, const ModelConfig& m);

void register_deepspeed_tp_ep();

}  // namespace moelab
