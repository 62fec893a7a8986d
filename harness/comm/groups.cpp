// harness/comm/groups.cpp — see groups.hpp.
#include "harness/comm/groups.hpp"

#include <unistd.h>

#include <algorithm>
#include <map>

#include "harness/config/json_fields.hpp"
#include "harness/config/model.hpp"
#include "harness/runtime/error.hpp"

namespace moelab {
namespace {

constexpr int kMaxSize = 1 << 20;  // limits::kMaxWorld: no group is larger than the world
const std::vector<std::string> kKeys = {"tp", "pp", "dp", "ep", "etp"};

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

[[noreturn]] void bad(const std::string& prefix, const std::string& what) { throw ConfigError(prefix + ": " + what); }

std::string rank_range(const std::vector<int>& ranks) {
  if (ranks.size() == 1) return "rank " + std::to_string(ranks.front());
  return "ranks " + std::to_string(ranks.front()) + " to " + std::to_string(ranks.back());
}

}  // namespace

// ---- parsing -------------------------------------------------------------------------------

ParallelLayout ParallelLayout::parse(const std::string& spec, const std::string& what) {
  ParallelLayout l;
  const std::string prefix = what + " " + json_fields::quote(spec);
  if (trim(spec).empty()) return l;
  std::map<std::string, int> seen;
  std::size_t at = 0;
  for (;;) {
    const std::size_t comma = spec.find(',', at);
    const std::string item = trim(spec.substr(at, comma == std::string::npos ? std::string::npos : comma - at));
    if (item.empty()) bad(prefix, "empty item (expected key=value, e.g. tp=2,pp=2)");
    const std::size_t eq = item.find('=');
    if (eq == std::string::npos) bad(prefix, "item " + json_fields::quote(item) + " is not key=value");
    const std::string key = trim(item.substr(0, eq)), value = trim(item.substr(eq + 1));
    if (std::find(kKeys.begin(), kKeys.end(), key) == kKeys.end()) {
      std::string msg = "unknown key " + json_fields::quote(key);
      if (const std::string best = json_fields::closest(key, kKeys); !best.empty())
        msg += " (did you mean " + json_fields::quote(best) + "?)";
      else
        msg += " (known keys: tp, pp, dp, ep, etp)";
      bad(prefix, msg);
    }
    if (seen.count(key)) bad(prefix, key + " is given twice");
    // Digits only: no sign, no exponent, no fraction; at most 7 of them before the range check.
    const bool digits = !value.empty() && value.size() <= 7 &&
                        std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; });
    const long v = digits ? std::stol(value) : 0;
    if (!digits || v < 1 || v > kMaxSize)
      bad(prefix, key + " = " + json_fields::quote(value) + " is not an integer in [1, " + std::to_string(kMaxSize) + "]");
    seen[key] = static_cast<int>(v);
    if (comma == std::string::npos) break;
    at = comma + 1;
  }
  for (const auto& [k, v] : seen) {
    if (k == "tp") l.tp = v;
    if (k == "pp") l.pp = v;
    if (k == "dp") l.dp = v;
    if (k == "ep") l.ep = v;
    if (k == "etp") l.etp = v;
  }
  return l;
}

std::string ParallelLayout::to_string() const {
  return "tp=" + std::to_string(tp) + ",pp=" + std::to_string(pp) + ",dp=" + (dp ? std::to_string(dp) : "?") +
         ",ep=" + std::to_string(ep) + ",etp=" + std::to_string(etp);
}

ModelDims model_dims(const TransformerConfig& t) {
  ModelDims d;
  d.num_layers = t.num_layers;
  d.num_heads = t.num_heads;
  d.num_kv_heads = t.num_kv_heads;
  d.d_ffn = t.num_moe_layers() < t.num_layers ? t.d_ffn : 0;
  if (t.moe_layers != MoELayers::none) {
    d.num_experts = t.moe.num_experts;
    d.expert_hidden = t.moe.d_hidden;
    d.shared_expert_hidden = t.shared_expert_hidden;
  }
  return d;
}

// Indexed by Group, in its order.
const char* group_name(Group g) {
  static constexpr const char* names[] = {"tp", "pp", "dp", "ep", "etp", "edp"};
  return names[static_cast<std::size_t>(g)];
}

int RankCoords::operator[](Group g) const { return std::array{tp, pp, dp, ep, etp, edp}[static_cast<std::size_t>(g)]; }

// ---- nodes ---------------------------------------------------------------------------------

NodeMap NodeMap::uniform(int world, int gpus_per_node) {
  MOELAB_CHECK(world >= 1 && gpus_per_node >= 1, "NodeMap::uniform: world and GPUs per node must be positive");
  NodeMap m;
  for (int r = 0; r < world; ++r) {
    m.node.push_back(r / gpus_per_node);
    m.local.push_back(r % gpus_per_node);
  }
  for (int n = 0; n <= (world - 1) / gpus_per_node; ++n) m.names.push_back("node" + std::to_string(n));
  return m;
}

NodeMap NodeMap::from_hosts(const std::vector<std::string>& host_by_rank) {
  NodeMap m;
  std::vector<int> count;
  for (const auto& h : host_by_rank) {
    const auto it = std::find(m.names.begin(), m.names.end(), h);
    const int n = static_cast<int>(it - m.names.begin());
    if (it == m.names.end()) {
      m.names.push_back(h);
      count.push_back(0);
    }
    m.node.push_back(n);
    m.local.push_back(count[static_cast<std::size_t>(n)]++);
  }
  return m;
}

NodeMap gather_nodes(Communicator& world) {
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) != 0) throw CommError("gethostname failed");
  return NodeMap::from_hosts(world.all_gather_strings(host));
}

// ---- the layout ----------------------------------------------------------------------------

int GroupLayout::size(Group g) const { return std::array{tp, pp, dp, ep, etp, edp}[static_cast<std::size_t>(g)]; }

std::vector<ParallelLayout> enumerate_layouts(int world) {
  std::vector<ParallelLayout> out;
  for (int pp = 1; pp <= world; ++pp) {
    if (world % pp) continue;
    const int stage = world / pp;
    for (int tp = 1; tp <= stage; ++tp) {
      if (stage % tp) continue;
      for (int ep = 1; ep <= stage; ++ep)
        for (int etp = 1; etp <= stage / ep; ++etp) {
          if (stage % (ep * etp)) continue;
          ParallelLayout l;
          l.tp = tp;
          l.pp = pp;
          l.ep = ep;
          l.etp = etp;
          out.push_back(l);
        }
    }
  }
  return out;
}

RankCoords GroupLayout::coords(int rank) const {
  MOELAB_CHECK(rank >= 0 && rank < world, "GroupLayout::coords: rank outside the world");
  const int stage = tp * dp;  // ranks of one pipeline stage
  const int within = rank % stage;
  RankCoords c;
  c.pp = rank / stage;
  c.tp = within % tp;
  c.dp = within / tp;
  c.etp = within % etp;
  c.ep = within / etp % ep;
  c.edp = within / (etp * ep);
  return c;
}

std::pair<int, int> GroupLayout::color_key(Group g, int rank) const {
  const RankCoords c = coords(rank);
  switch (g) {
    case Group::tp: return {rank / tp, c.tp};
    case Group::dp: return {c.tp + tp * c.pp, c.dp};
    case Group::pp: return {c.tp + tp * c.dp, c.pp};
    case Group::etp: return {rank / etp, c.etp};
    case Group::ep: return {c.etp + etp * (c.edp + edp * c.pp), c.ep};
    case Group::edp: return {c.etp + etp * (c.ep + ep * c.pp), c.edp};
  }
  return {0, 0};
}

std::vector<int> GroupLayout::members(Group g, int rank) const {
  const RankCoords c = coords(rank);
  const int stage = tp * dp;
  std::vector<int> m;
  for (int i = 0; i < size(g); ++i) {
    switch (g) {
      case Group::tp: m.push_back(i + tp * (c.dp + dp * c.pp)); break;
      case Group::dp: m.push_back(c.tp + tp * (i + dp * c.pp)); break;
      case Group::pp: m.push_back(c.tp + tp * (c.dp + dp * i)); break;
      case Group::etp: m.push_back(i + etp * (c.ep + ep * c.edp) + stage * c.pp); break;
      case Group::ep: m.push_back(c.etp + etp * (i + ep * c.edp) + stage * c.pp); break;
      case Group::edp: m.push_back(c.etp + etp * (c.ep + ep * i) + stage * c.pp); break;
    }
  }
  return m;
}

std::string GroupLayout::to_string() const {
  return "tp=" + std::to_string(tp) + ",pp=" + std::to_string(pp) + ",dp=" + std::to_string(dp) +
         ",ep=" + std::to_string(ep) + ",etp=" + std::to_string(etp) + ",edp=" + std::to_string(edp);
}

nlohmann::json GroupLayout::to_json() const {
  return {{"world", world}, {"tp", tp}, {"pp", pp}, {"dp", dp}, {"dp_inferred", dp_inferred},
          {"ep", ep},       {"etp", etp}, {"edp", edp}};
}

namespace {

void check_nodes(const GroupLayout& l, const NodeMap& nodes, const std::string& hint) {
  MOELAB_CHECK(static_cast<int>(nodes.node.size()) == l.world, "check_nodes: the node map is not of this world");
  // TP and expert-TP groups are consecutive ranks: the tensor-parallel collectives of every
  // layer must stay on the node's NVLink (Megatron-LM's advice for its rank order).
  for (Group g : {Group::tp, Group::etp}) {
    for (int first = 0; first < l.world; first += l.size(g)) {
      const std::vector<int> m = l.members(g, first);
      const auto other = std::find_if(m.begin(), m.end(), [&](int r) {
        return nodes.node[static_cast<std::size_t>(r)] != nodes.node[static_cast<std::size_t>(m.front())];
      });
      if (other == m.end()) continue;
      const std::string G = g == Group::tp ? "TP" : "expert-TP";
      throw ConfigError("parallel layout " + l.to_string() + ": " + group_name(g) + " = " +
                        std::to_string(l.size(g)) + ": " + G + " group " + std::to_string(first / l.size(g)) + " (" +
                        rank_range(m) + ") spans " + nodes.names[static_cast<std::size_t>(nodes.node[static_cast<std::size_t>(m.front())])] +
                        " and " + nodes.names[static_cast<std::size_t>(nodes.node[static_cast<std::size_t>(*other)])] + hint +
                        ": a " + G + " group must sit inside a node");
    }
  }
}

}  // namespace

void check_nodes(const GroupLayout& l, const NodeMap& nodes) { check_nodes(l, nodes, ""); }

GroupLayout check_layout(const ParallelLayout& p, int world, int gpus_per_node, const std::optional<ModelDims>& model) {
  MOELAB_CHECK(world >= 1 && gpus_per_node >= 1, "check_layout: world and GPUs per node must be positive");
  const std::string prefix = "parallel layout " + p.to_string() + " on " + std::to_string(world) + " ranks";
  auto fail = [&](const std::string& what) { bad(prefix, what); };
  for (int v : {p.tp, p.pp, p.ep, p.etp})
    if (v < 1 || v > kMaxSize) fail("every size must be in [1, " + std::to_string(kMaxSize) + "]");
  if (p.dp < 0 || p.dp > kMaxSize) fail("dp must be in [1, " + std::to_string(kMaxSize) + "] or omitted");

  GroupLayout l;
  l.world = world;
  l.tp = p.tp;
  l.pp = p.pp;
  l.ep = p.ep;
  l.etp = p.etp;
  const long long tp_pp = static_cast<long long>(p.tp) * p.pp;
  if (p.dp == 0) {
    if (world % tp_pp != 0)
      fail("tp × pp = " + std::to_string(tp_pp) + " does not divide the world of " + std::to_string(world) +
           " ranks (dp is omitted, so it is inferred as world / (tp × pp))");
    l.dp = static_cast<int>(world / tp_pp);
    l.dp_inferred = true;
  } else {
    if (tp_pp * p.dp != world)
      fail("tp × pp × dp = " + std::to_string(tp_pp * p.dp) + " does not match the world of " + std::to_string(world) +
           " ranks");
    l.dp = p.dp;
  }
  const long long stage = static_cast<long long>(l.tp) * l.dp, ep_etp = static_cast<long long>(l.ep) * l.etp;
  if (stage % ep_etp != 0)
    fail("ep × etp = " + std::to_string(ep_etp) + " does not divide tp × dp = " + std::to_string(stage) +
         " (the ranks of one pipeline stage, which the MoE layers regroup)");
  l.edp = static_cast<int>(stage / ep_etp);

  if (model) {
    const ModelDims& m = *model;
    if (l.pp > m.num_layers)
      fail("pp = " + std::to_string(l.pp) + " exceeds num_layers = " + std::to_string(m.num_layers) +
           " (every pipeline stage needs a layer)");
    if (m.num_experts == 0 && (l.ep > 1 || l.etp > 1))
      fail((l.ep > 1 ? "ep = " + std::to_string(l.ep) : "etp = " + std::to_string(l.etp)) +
           " but the model has no MoE layers");
    if (m.num_experts > 0 && m.num_experts % l.ep != 0)
      fail("ep = " + std::to_string(l.ep) + " does not divide the model's " + std::to_string(m.num_experts) +
           " experts (moe.num_experts)");
    auto divides = [&](const char* size_name, int size, const char* field, std::int64_t value) {
      if (value > 0 && value % size != 0)
        fail(std::string(size_name) + " = " + std::to_string(size) + " does not divide " + field + " = " +
             std::to_string(value));
    };
    divides("tp", l.tp, "num_heads", m.num_heads);
    divides("tp", l.tp, "num_kv_heads", m.num_kv_heads);
    divides("tp", l.tp, "d_ffn", m.d_ffn);
    divides("tp", l.tp, "moe.shared_expert_hidden", m.shared_expert_hidden);
    if (l.etp > 1) divides("etp", l.etp, "moe.d_hidden", m.expert_hidden);
  }
  check_nodes(l, NodeMap::uniform(world, gpus_per_node), " (" + std::to_string(gpus_per_node) + " GPUs per node)");
  return l;
}

GroupLayout check_layout(const ParallelLayout& l, int world, int gpus_per_node, const TransformerConfig& model) {
  return check_layout(l, world, gpus_per_node, model_dims(model));
}

// ---- the communicators ---------------------------------------------------------------------

ProcessGroups::ProcessGroups(Communicator& world, const GroupLayout& layout, NodeMap nodes)
    : layout_(layout), nodes_(std::move(nodes)), rank_(world.rank()) {
  MOELAB_CHECK(world.size() == layout_.world, "ProcessGroups: the layout was checked for another world size");
  check_nodes(layout_, nodes_);
  coords_ = layout_.coords(rank_);
  const std::vector<int> world_of = world.world_ranks();
  for (Group g : kAllGroups) {
    const auto [color, key] = layout_.color_key(g, rank_);
    auto c = world.split(color, key);
    std::vector<int> expect;
    for (int r : layout_.members(g, rank_)) expect.push_back(world_of[static_cast<std::size_t>(r)]);
    MOELAB_CHECK(c && c->size() == layout_.size(g) && c->rank() == coords_[g] && c->world_ranks() == expect,
                 std::string("ProcessGroups: the ") + group_name(g) + " split does not match the layout");
    comms_[static_cast<std::size_t>(g)] = std::move(c);
  }
}

nlohmann::json ProcessGroups::to_json() const {
  nlohmann::json groups = nlohmann::json::object();
  for (Group g : kAllGroups)
    groups[group_name(g)] = {{"rank", coords_[g]}, {"size", layout_.size(g)}, {"members", this->group(g).world_ranks()}};
  return {{"layout", layout_.to_json()},
          {"rank", rank_},
          {"node", node()},
          {"node_name", nodes_.names[static_cast<std::size_t>(node())]},
          {"local_rank", local_rank()},
          {"groups", groups}};
}

}  // namespace moelab
