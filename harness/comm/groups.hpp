// harness/comm/groups.hpp — the process groups of a parallel layout: tensor (TP), pipeline
// (PP) and data (DP) parallelism for the dense part of a model, expert (EP), expert-tensor
// (expert-TP) and expert-data (expert-DP) parallelism for its MoE layers, all over one world.
//
// The rank order is Megatron-Core's (megatron/core/parallel_state.py, RankGenerator with
// order "tp-dp-pp" for the dense part and "tp-ep-dp-pp" for the experts):
//
//   dense:   rank = tp + TP·(dp + DP·pp)                      TP innermost, PP outermost
//   experts: rank = etp + ETP·(ep + EP·edp) + TP·DP·pp        the same pipeline stages,
//            EDP = TP·DP / (EP·ETP)                           their TP·DP ranks regrouped
//
// so a TP group is TP consecutive ranks (inside a node when TP divides the GPUs per node;
// launchers fill nodes in rank order), a DP group strides by TP and a PP group by TP·DP.
// Megatron's example: 16 GPUs, TP = 2, PP = 4 (so DP = 2) give TP groups [0,1], [2,3], ...,
// DP groups [0,2], [1,3], [4,6], ... and PP groups [0,4,8,12], [1,5,9,13], ...
// (tested in harness/tests/groups_test.cpp). With fewer experts than EP·ETP·EDP ranks the
// experts are replicated over expert-DP: EP ranks hold E/EP experts each.
//
// Three layers, so that a command line or a fuzzer can check a layout without any rank:
//   ParallelLayout::parse   "tp=2,pp=2,dp=4,ep=8,etp=1" -> sizes (ConfigError)
//   check_layout            sizes × world × GPUs per node × model -> GroupLayout (ConfigError,
//                           a pure function: coordinates and member lists of every rank)
//   ProcessGroups           GroupLayout × world communicator -> this rank's communicators
//                           (split from the world; nodes checked before the first split)
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/comm/communicator.hpp"

namespace moelab {

struct TransformerConfig;

// The sizes as written. 0 for dp: inferred from the world size as world / (tp · pp).
struct ParallelLayout {
  int tp = 1, pp = 1, dp = 0, ep = 1, etp = 1;

  // "tp=2,pp=2,dp=4,ep=8,etp=1": keys tp, pp, dp, ep, etp in any order, each at most once;
  // omitted sizes are 1 except dp (inferred); "" is all defaults. ConfigError (one line,
  // naming `what` and the item) for an unknown key (with the closest known one), a repeated
  // key, a missing '=', or a value that is not an integer in [1, 2^20].
  static ParallelLayout parse(const std::string& spec, const std::string& what = "--parallel");
  std::string to_string() const;  // the canonical spec ("dp=?" when inferred)
};

// What a layout must divide in a model (0: the model has none of it).
struct ModelDims {
  int num_layers = 0;
  int num_heads = 0, num_kv_heads = 0;
  std::int64_t d_ffn = 0;                 // 0: no dense layer (every layer is MoE)
  std::int64_t num_experts = 0;           // 0: no MoE layer
  std::int64_t expert_hidden = 0;         // moe.d_hidden
  std::int64_t shared_expert_hidden = 0;  // 0: no shared expert
};
ModelDims model_dims(const TransformerConfig& t);

enum class Group { tp, pp, dp, ep, etp, edp };
inline constexpr std::array<Group, 6> kAllGroups = {Group::tp, Group::pp, Group::dp, Group::ep, Group::etp, Group::edp};
const char* group_name(Group g);  // "tp", "pp", "dp", "ep", "etp", "edp"

// A rank's index in each of its groups.
struct RankCoords {
  int tp = 0, pp = 0, dp = 0, ep = 0, etp = 0, edp = 0;
  int operator[](Group g) const;
  bool operator==(const RankCoords&) const = default;
};

// Which node every world rank sits on, and its index among the node's ranks (in rank order).
struct NodeMap {
  std::vector<int> node, local;   // by world rank
  std::vector<std::string> names; // by node: host names, or "node<i>"
  int nodes() const { return static_cast<int>(names.size()); }
  // Nodes of gpus_per_node consecutive ranks (the sim's cluster model; launchers that fill
  // nodes in rank order).
  static NodeMap uniform(int world, int gpus_per_node);
  // Ranks with the same host name share a node; nodes numbered in order of first rank.
  static NodeMap from_hosts(const std::vector<std::string>& host_by_rank);
};
// NodeMap::from_hosts of every rank's host name (collective over the world communicator).
NodeMap gather_nodes(Communicator& world);

// A layout checked against a world: every size known, every rank's place computable.
struct GroupLayout {
  int world = 1;
  int tp = 1, pp = 1, dp = 1, ep = 1, etp = 1, edp = 1;
  bool dp_inferred = false;

  int size(Group g) const;
  RankCoords coords(int rank) const;
  // The world ranks of `rank`'s group g, in the group's rank order.
  std::vector<int> members(Group g, int rank) const;
  // The split() arguments that form those groups: color = the group's index, key = the
  // rank's coordinate in it.
  std::pair<int, int> color_key(Group g, int rank) const;
  std::string to_string() const;  // "tp=2,pp=4,dp=2,ep=1,etp=1,edp=4"
  nlohmann::json to_json() const;
};

// Every layout of a world of `world` ranks that multiplies out (dp inferred, ep·etp dividing
// each stage), by pp, tp, ep, etp; no model or node constraint applied (check_layout does).
std::vector<ParallelLayout> enumerate_layouts(int world);

// Checks a layout before anything is built, and resolves dp. ConfigError (one line, naming
// the sizes and the value they disagree with) when:
//   tp·pp·dp != world (dp given), or tp·pp does not divide world (dp inferred);
//   ep·etp does not divide tp·dp (the ranks of one pipeline stage);
//   with a model: pp > num_layers; ep does not divide num_experts; ep or etp > 1 without MoE
//   layers; tp does not divide num_heads, num_kv_heads, d_ffn (when a layer is dense) or
//   shared_expert_hidden; etp does not divide the experts' d_hidden;
//   a TP or expert-TP group spans two nodes of gpus_per_node ranks (check_nodes).
GroupLayout check_layout(const ParallelLayout& l, int world, int gpus_per_node, const std::optional<ModelDims>& model);
GroupLayout check_layout(const ParallelLayout& l, int world, int gpus_per_node, const TransformerConfig& model);
// ConfigError when a TP or expert-TP group of `l` holds ranks of two nodes of `nodes`.
void check_nodes(const GroupLayout& l, const NodeMap& nodes);

// This rank's communicators for a checked layout. Collective over `world` (a world
// communicator: its ranks are world ranks): check_nodes first (every rank throws the same
// ConfigError before any communicator is built), then six splits of the world, in the order
// of kAllGroups. nodes: NodeMap::uniform(world, the cluster model's GPUs per node) on sim,
// gather_nodes(world) on cpu and cuda.
class ProcessGroups {
 public:
  ProcessGroups(Communicator& world, const GroupLayout& layout, NodeMap nodes);

  const GroupLayout& layout() const { return layout_; }
  const NodeMap& nodes() const { return nodes_; }
  int rank() const { return rank_; }                // world rank
  const RankCoords& coords() const { return coords_; }
  int node() const { return nodes_.node[static_cast<std::size_t>(rank_)]; }
  int local_rank() const { return nodes_.local[static_cast<std::size_t>(rank_)]; }

  Communicator& group(Group g) const { return *comms_[static_cast<std::size_t>(g)]; }
  Communicator& tp() const { return group(Group::tp); }
  Communicator& pp() const { return group(Group::pp); }
  Communicator& dp() const { return group(Group::dp); }
  Communicator& ep() const { return group(Group::ep); }
  Communicator& etp() const { return group(Group::etp); }
  Communicator& edp() const { return group(Group::edp); }

  // For reports: the layout, this rank's node and, per group, its coordinate and members.
  nlohmann::json to_json() const;

 private:
  GroupLayout layout_;
  NodeMap nodes_;
  int rank_ = 0;
  RankCoords coords_;
  std::array<std::unique_ptr<Communicator>, 6> comms_;
};

}  // namespace moelab
