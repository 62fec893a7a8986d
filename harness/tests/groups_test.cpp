// harness/tests/groups_test.cpp — the parallel layout and its process groups without MPI:
// parsing, every rank's coordinates and group members against hand-written tables
// (Megatron-LM's 16-GPU example among them), every bad layout's message, and the groups on
// the sim backend — results of each group's collectives, and a TP group inside a node on
// NVLink only while a DP group across nodes goes through the NICs.
//   build/harness/tests/groups_test
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>

#include "harness/backends/sim/sim_backend.hpp"
#include "harness/comm/groups.hpp"
#include "harness/config/model.hpp"
#include "harness/runtime/error.hpp"
#include "harness/tests/test_util.hpp"

namespace moelab {
namespace {

using Groups = std::vector<std::vector<int>>;

GroupLayout layout(const std::string& spec, int world, int gpus_per_node = 1 << 20) {
  return check_layout(ParallelLayout::parse(spec), world, gpus_per_node, std::nullopt);
}

// `expect` lists every group of kind g; each rank must find exactly its own, and its
// coordinate must be its place in it.
void expect_groups(const GroupLayout& l, Group g, const Groups& expect) {
  std::vector<int> seen(static_cast<std::size_t>(l.world), 0);
  for (const auto& members : expect) {
    ASSERT_EQ(static_cast<int>(members.size()), l.size(g)) << group_name(g);
    for (std::size_t i = 0; i < members.size(); ++i) {
      const int r = members[i];
      ++seen[static_cast<std::size_t>(r)];
      EXPECT_EQ(l.members(g, r), members) << group_name(g) << " group of rank " << r << " in " << l.to_string();
      EXPECT_EQ(l.coords(r)[g], static_cast<int>(i)) << group_name(g) << " coordinate of rank " << r;
    }
  }
  for (int r = 0; r < l.world; ++r) EXPECT_EQ(seen[static_cast<std::size_t>(r)], 1) << "rank " << r << " in " << group_name(g);
}

// ---- 1. parsing --------------------------------------------------------------------------

TEST(ParallelLayoutParse, SizesDefaultsAndInferredDp) {
  const auto l = ParallelLayout::parse("tp=2,pp=2,dp=4,ep=8,etp=1");
  EXPECT_EQ(std::vector<int>({l.tp, l.pp, l.dp, l.ep, l.etp}), std::vector<int>({2, 2, 4, 8, 1}));
  const auto d = ParallelLayout::parse("ep=4, tp = 2");  // any order, blanks around items
  EXPECT_EQ(std::vector<int>({d.tp, d.pp, d.dp, d.ep, d.etp}), std::vector<int>({2, 1, 0, 4, 1}));
  EXPECT_EQ(d.to_string(), "tp=2,pp=1,dp=?,ep=4,etp=1");
  const auto e = ParallelLayout::parse("");
  EXPECT_EQ(std::vector<int>({e.tp, e.pp, e.dp, e.ep, e.etp}), std::vector<int>({1, 1, 0, 1, 1}));
  const GroupLayout g = check_layout(d, 16, 8, std::nullopt);
  EXPECT_EQ(g.dp, 8);
  EXPECT_TRUE(g.dp_inferred);
  EXPECT_EQ(g.edp, 4);
  EXPECT_FALSE(check_layout(l, 16, 8, std::nullopt).dp_inferred);
}

struct BadSpec {
  std::string spec;
  std::vector<std::string> says;
};

TEST(ParallelLayoutParse, BadSpecsAreOneLineConfigErrors) {
  const std::vector<BadSpec> cases = {
      {"tp=2,tpp=2", {"--parallel \"tp=2,tpp=2\"", "unknown key \"tpp\"", "(did you mean \"tp\"?)"}},
      {"ept=2", {"unknown key \"ept\"", "(did you mean \"ep\"?)"}},
      {"expert=2", {"unknown key \"expert\"", "known keys: tp, pp, dp, ep, etp"}},
      {"tp=2,tp=4", {"tp is given twice"}},
      {"etp=1,pp=2,etp=2", {"etp is given twice"}},
      {"tp=two", {"tp = \"two\" is not an integer in [1, 1048576]"}},
      {"tp=2.5", {"tp = \"2.5\" is not an integer"}},
      {"dp=-4", {"dp = \"-4\" is not an integer"}},
      {"pp=0", {"pp = \"0\" is not an integer in [1, 1048576]"}},
      {"ep=1e3", {"ep = \"1e3\" is not an integer"}},
      {"tp=", {"tp = \"\" is not an integer"}},
      {"tp=99999999999", {"tp = \"99999999999\" is not an integer"}},
      {"tp=2097152", {"tp = \"2097152\" is not an integer in [1, 1048576]"}},
      {"tp2", {"item \"tp2\" is not key=value"}},
      {"tp=2,,pp=2", {"empty item"}},
      {"tp=2,", {"empty item"}},
  };
  for (const auto& c : cases) {
    try {
      ParallelLayout::parse(c.spec);
      ADD_FAILURE() << c.spec << ": accepted";
    } catch (const ConfigError& e) {
      const std::string m = e.what();
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
      for (const auto& s : c.says) EXPECT_NE(m.find(s), std::string::npos) << c.spec << ": \"" << m << "\" lacks \"" << s << "\"";
    }
  }
}

// ---- 2. coordinates and members ------------------------------------------------------------

// megatron/core/parallel_state.py, initialize_model_parallel's docstring: 16 GPUs, TP = 2,
// PP = 4 (so DP = 2).
TEST(GroupLayoutMath, MegatronSixteenGpuExample) {
  const GroupLayout l = layout("tp=2,pp=4", 16, 8);
  EXPECT_EQ(l.dp, 2);
  expect_groups(l, Group::dp, {{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}});
  expect_groups(l, Group::tp, {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}});
  expect_groups(l, Group::pp, {{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}});
  // ep = etp = 1: the expert groups degenerate to one rank (EP, expert-TP) and to the whole
  // stage (expert-DP = TP·DP = 4).
  expect_groups(l, Group::edp, {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}});
  Groups singles;
  for (int r = 0; r < 16; ++r) singles.push_back({r});
  expect_groups(l, Group::ep, singles);
  expect_groups(l, Group::etp, singles);
  // Every rank's (tp, pp, dp), by hand.
  const int table[16][3] = {{0, 0, 0}, {1, 0, 0}, {0, 0, 1}, {1, 0, 1}, {0, 1, 0}, {1, 1, 0}, {0, 1, 1}, {1, 1, 1},
                            {0, 2, 0}, {1, 2, 0}, {0, 2, 1}, {1, 2, 1}, {0, 3, 0}, {1, 3, 0}, {0, 3, 1}, {1, 3, 1}};
  for (int r = 0; r < 16; ++r) {
    const RankCoords c = l.coords(r);
    EXPECT_EQ(c.tp, table[r][0]) << r;
    EXPECT_EQ(c.pp, table[r][1]) << r;
    EXPECT_EQ(c.dp, table[r][2]) << r;
  }
}

TEST(GroupLayoutMath, ExpertParallelOverDataParallelRanks) {
  // 8 ranks, TP = 2, DP = 4; EP = 4 over the 8 ranks of the stage, so EDP = 2.
  const GroupLayout l = layout("tp=2,dp=4,ep=4", 8, 8);
  EXPECT_EQ(l.edp, 2);
  expect_groups(l, Group::tp, {{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  expect_groups(l, Group::dp, {{0, 2, 4, 6}, {1, 3, 5, 7}});
  expect_groups(l, Group::pp, {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}});
  expect_groups(l, Group::ep, {{0, 1, 2, 3}, {4, 5, 6, 7}});
  expect_groups(l, Group::edp, {{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  expect_groups(l, Group::etp, {{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}});
}

TEST(GroupLayoutMath, ExpertTensorParallelAndPipelineStages) {
  // 16 ranks: TP = 2, PP = 2, DP = 4; experts: ETP = 2, EP = 2, EDP = 2 within each stage of
  // 8 ranks. rank = etp + 2·(ep + 2·edp) + 8·pp.
  const GroupLayout l = layout("tp=2,pp=2,dp=4,ep=2,etp=2", 16, 8);
  EXPECT_EQ(l.edp, 2);
  expect_groups(l, Group::tp, {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}});
  expect_groups(l, Group::dp, {{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}});
  expect_groups(l, Group::pp, {{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}});
  expect_groups(l, Group::etp, {{0, 1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}, {12, 13}, {14, 15}});
  expect_groups(l, Group::ep, {{0, 2}, {1, 3}, {4, 6}, {5, 7}, {8, 10}, {9, 11}, {12, 14}, {13, 15}});
  expect_groups(l, Group::edp, {{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}});
  const RankCoords c = l.coords(13);  // pp 1; within the stage 5: tp 1, dp 2; etp 1, ep 0, edp 1
  EXPECT_EQ(c, (RankCoords{1, 1, 2, 0, 1, 1}));
}

TEST(GroupLayoutMath, FewerExpertsThanRanksAreReplicatedOverExpertDp) {
  // 16 ranks of pure data parallelism, 4 experts: EP = 4 groups of consecutive ranks, each
  // expert held by the 4 ranks of an expert-DP group.
  ModelDims m;
  m.num_layers = 4;
  m.num_heads = m.num_kv_heads = 4;
  m.d_ffn = 64;
  m.num_experts = 4;
  m.expert_hidden = 64;
  const GroupLayout l = check_layout(ParallelLayout::parse("ep=4"), 16, 8, m);
  EXPECT_EQ(l.dp, 16);
  EXPECT_EQ(l.edp, 4);
  expect_groups(l, Group::ep, {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}});
  expect_groups(l, Group::edp, {{0, 4, 8, 12}, {1, 5, 9, 13}, {2, 6, 10, 14}, {3, 7, 11, 15}});
}

// Every layout of every world up to 24 ranks: the groups of each kind partition the world,
// the rank formulas invert, and split_members over every rank's (color, key) — what
// Communicator::split computes — gives exactly members().
TEST(GroupLayoutMath, SplitArgumentsReproduceTheMembersForEveryLayout) {
  std::size_t layouts = 0;
  for (int world = 1; world <= 24; ++world) {
    const auto all = enumerate_layouts(world);
    layouts += all.size();
    for (const ParallelLayout& p : all) {
      const GroupLayout l = check_layout(p, world, world, std::nullopt);
      for (Group g : kAllGroups) {
        std::vector<std::pair<int, int>> ck;
        for (int r = 0; r < world; ++r) ck.push_back(l.color_key(g, r));
        for (int r = 0; r < world; ++r) {
          const auto m = l.members(g, r);
          ASSERT_EQ(split_members(ck, ck[static_cast<std::size_t>(r)].first), m)
              << l.to_string() << " " << group_name(g) << " rank " << r;
          ASSERT_EQ(m[static_cast<std::size_t>(l.coords(r)[g])], r);
        }
      }
      for (int r = 0; r < world; ++r) {
        const RankCoords c = l.coords(r);
        ASSERT_EQ(c.tp + l.tp * (c.dp + l.dp * c.pp), r);
        ASSERT_EQ(c.etp + l.etp * (c.ep + l.ep * c.edp) + l.tp * l.dp * c.pp, r);
      }
    }
  }
  EXPECT_GT(layouts, 300u);
}

TEST(GroupLayoutMath, EnumeratedLayoutsOfFourRanks) {
  // (pp, tp) with pp·tp | 4, then (ep, etp) with ep·etp | 4/pp, by hand: pp 1 (stage 4):
  // tp 1, 2, 4 × (ep, etp) in {11, 12, 14, 21, 22, 41} = 18; pp 2 (stage 2): tp 1, 2 ×
  // {11, 12, 21} = 6; pp 4: tp 1 × {11} = 1.
  std::vector<std::string> got;
  for (const auto& l : enumerate_layouts(4)) got.push_back(l.to_string());
  EXPECT_EQ(got.size(), 25u);
  EXPECT_EQ(got.front(), "tp=1,pp=1,dp=?,ep=1,etp=1");
  EXPECT_EQ(got[5], "tp=1,pp=1,dp=?,ep=4,etp=1");
  EXPECT_EQ(got.back(), "tp=1,pp=4,dp=?,ep=1,etp=1");
  EXPECT_NE(std::find(got.begin(), got.end(), "tp=4,pp=1,dp=?,ep=2,etp=2"), got.end());
  EXPECT_EQ(std::find(got.begin(), got.end(), "tp=1,pp=2,dp=?,ep=2,etp=2"), got.end());  // 4 ranks in a stage of 2
  for (const auto& l : enumerate_layouts(4)) EXPECT_NO_THROW(check_layout(l, 4, 4, std::nullopt)) << l.to_string();
}

TEST(SplitMembers, OrdersByKeyThenRankAndSkipsNegativeColors) {
  const std::vector<std::pair<int, int>> ck = {{0, 5}, {1, 0}, {0, 2}, {-1, 0}, {0, 2}, {1, -3}};
  EXPECT_EQ(split_members(ck, 0), (std::vector<int>{2, 4, 0}));
  EXPECT_EQ(split_members(ck, 1), (std::vector<int>{5, 1}));
  EXPECT_TRUE(split_members(ck, -1).empty());
}

TEST(NodeMaps, UniformAndFromHosts) {
  const NodeMap u = NodeMap::uniform(10, 4);
  EXPECT_EQ(u.node, (std::vector<int>{0, 0, 0, 0, 1, 1, 1, 1, 2, 2}));
  EXPECT_EQ(u.local, (std::vector<int>{0, 1, 2, 3, 0, 1, 2, 3, 0, 1}));
  EXPECT_EQ(u.names, (std::vector<std::string>{"node0", "node1", "node2"}));
  const NodeMap h = NodeMap::from_hosts({"b", "b", "a", "b", "a"});
  EXPECT_EQ(h.node, (std::vector<int>{0, 0, 1, 0, 1}));
  EXPECT_EQ(h.local, (std::vector<int>{0, 1, 0, 2, 1}));
  EXPECT_EQ(h.names, (std::vector<std::string>{"b", "a"}));
  // Hosts that interleave ranks put a TP group across two nodes.
  try {
    check_nodes(layout("tp=2", 4), NodeMap::from_hosts({"b", "a", "b", "a"}));
    ADD_FAILURE() << "accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("TP group 0 (ranks 0 to 1) spans b and a"), std::string::npos) << e.what();
  }
}

// ---- 3. bad layouts --------------------------------------------------------------------------

ModelDims gpt_moe() {  // GPT3-MoE-XL-like: 16 heads, d_ffn 8192, 8 experts of 8192
  ModelDims m;
  m.num_layers = 24;
  m.num_heads = 16;
  m.num_kv_heads = 16;
  m.d_ffn = 8192;
  m.num_experts = 8;
  m.expert_hidden = 8192;
  return m;
}

struct BadLayout {
  std::string name, spec;
  int world, gpus_per_node;
  std::function<void(ModelDims&)> edit;
  std::vector<std::string> says;
};

TEST(CheckLayout, EveryBadLayoutIsOneLineNamingTheSizes) {
  auto none = [](ModelDims&) {};
  const std::vector<BadLayout> cases = {
      {"ProductNotWorld", "tp=2,pp=2,dp=4", 8, 8, none,
       {"parallel layout tp=2,pp=2,dp=4,ep=1,etp=1 on 8 ranks", "tp × pp × dp = 16 does not match the world of 8 ranks"}},
      {"InferredDpDoesNotDivide", "tp=4,pp=3", 16, 8, none,
       {"tp × pp = 12 does not divide the world of 16 ranks", "dp is omitted, so it is inferred as world / (tp × pp)"}},
      {"EpTimesEtpNotDividingStage", "tp=2,dp=3,ep=4", 6, 6, none,
       {"ep × etp = 4 does not divide tp × dp = 6"}},
      {"EtpNotDividingStage", "tp=2,pp=2,ep=1,etp=8", 8, 8, none, {"ep × etp = 8 does not divide tp × dp = 4"}},
      {"EpNotDividingExperts", "ep=3", 6, 8, [](ModelDims& m) { m.num_experts = 8; },
       {"ep = 3 does not divide the model's 8 experts (moe.num_experts)"}},
      {"EpWithoutMoe", "ep=2", 8, 8, [](ModelDims& m) { m.num_experts = 0; }, {"ep = 2 but the model has no MoE layers"}},
      {"EtpWithoutMoe", "tp=2,etp=2", 8, 8, [](ModelDims& m) { m.num_experts = 0; },
       {"etp = 2 but the model has no MoE layers"}},
      {"TpNotDividingHeads", "tp=3", 12, 12, none,
       {"tp = 3 does not divide num_heads = 16"}},
      {"TpNotDividingKvHeads", "tp=4", 8, 8, [](ModelDims& m) { m.num_kv_heads = 2; },
       {"tp = 4 does not divide num_kv_heads = 2"}},
      {"TpNotDividingDffn", "tp=4", 8, 8, [](ModelDims& m) { m.d_ffn = 8190; }, {"tp = 4 does not divide d_ffn = 8190"}},
      {"TpNotDividingSharedExpert", "tp=4", 8, 8, [](ModelDims& m) { m.shared_expert_hidden = 1026; },
       {"tp = 4 does not divide moe.shared_expert_hidden = 1026"}},
      {"EtpNotDividingExpertHidden", "tp=2,etp=4", 8, 8, [](ModelDims& m) { m.expert_hidden = 8190; },
       {"etp = 4 does not divide moe.d_hidden = 8190"}},
      {"PpBeyondLayers", "pp=8", 8, 8, [](ModelDims& m) { m.num_layers = 6; },
       {"pp = 8 exceeds num_layers = 6 (every pipeline stage needs a layer)"}},
      {"TpAcrossNodes", "tp=16", 16, 8, none,
       {"tp = 16: TP group 0 (ranks 0 to 15) spans node0 and node1 (8 GPUs per node): a TP group must sit inside a node"}},
      {"TpNotDividingNode", "tp=4", 12, 6, [](ModelDims& m) { m.num_heads = m.num_kv_heads = 4; },
       {"tp = 4: TP group 1 (ranks 4 to 7) spans node0 and node1 (6 GPUs per node)"}},
      {"ExpertTpAcrossNodes", "tp=2,etp=4", 8, 2, none, {"etp = 4: expert-TP group 0 (ranks 0 to 3) spans node0 and node1"}},
  };
  for (const auto& c : cases) {
    ModelDims m = gpt_moe();
    c.edit(m);
    try {
      check_layout(ParallelLayout::parse(c.spec), c.world, c.gpus_per_node, m);
      ADD_FAILURE() << c.name << ": accepted";
    } catch (const ConfigError& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
      for (const auto& s : c.says) EXPECT_NE(msg.find(s), std::string::npos) << c.name << ": \"" << msg << "\" lacks \"" << s << "\"";
    }
  }
  // A dense d_ffn does not bind when every layer is MoE; a partly used node is no crossing.
  ModelDims all_moe = gpt_moe();
  all_moe.d_ffn = 0;
  EXPECT_NO_THROW(check_layout(ParallelLayout::parse("tp=4"), 4, 8, all_moe));
  EXPECT_NO_THROW(check_layout(ParallelLayout::parse("tp=3"), 3, 8, std::nullopt));
}

TEST(CheckLayout, ModelDimsOfATransformer) {
  TransformerConfig t;
  t.num_layers = 4;
  t.num_heads = 8;
  t.num_kv_heads = 2;
  t.d_ffn = 96;
  t.moe_layers = MoELayers::all;
  t.moe.num_experts = 6;
  t.moe.d_hidden = 40;
  t.shared_expert_hidden = 12;
  const ModelDims d = model_dims(t);
  EXPECT_EQ(d.d_ffn, 0);  // no dense layer
  EXPECT_EQ(d.num_experts, 6);
  EXPECT_EQ(d.expert_hidden, 40);
  EXPECT_EQ(d.shared_expert_hidden, 12);
  t.moe_layers = MoELayers::none;
  EXPECT_EQ(model_dims(t).num_experts, 0);
  EXPECT_EQ(model_dims(t).d_ffn, 96);
  EXPECT_THROW(check_layout(ParallelLayout::parse("ep=2"), 2, 8, t), ConfigError);
}

// ---- 4. on the sim backend -------------------------------------------------------------------

SimOptions two_dgx() {
  SimOptions o;
  o.cluster = sim::load_cluster("dgx-a100x2");  // 2 nodes x 8 A100, NVSwitch, 8 HDR NICs per node
  return o;
}

// Every group's control-plane collectives give the group's results, with different groups
// running different calls at the same moment; split with a negative color and dup work.
TEST(SimGroups, ControlPlaneResultsInsideEachGroup) {
  SimCluster cluster(two_dgx());
  const GroupLayout l = layout("tp=2,pp=2,dp=4,ep=2,etp=2", 16, 8);
  std::vector<std::string> errors(16);
  cluster.run([&](Backend&, Communicator& world) {
    ProcessGroups pg(world, l, NodeMap::uniform(16, 8));
    const int me = world.rank();
    std::string& err = errors[static_cast<std::size_t>(me)];
    auto expect = [&](bool ok, const std::string& what) {
      if (!ok && err.empty()) err = what;
    };
    expect(pg.node() == me / 8 && pg.local_rank() == me % 8, "node");
    for (Group g : kAllGroups) {
      Communicator& c = pg.group(g);
      const std::vector<int> m = l.members(g, me);
      const std::string G = group_name(g);
      expect(c.world_ranks() == m && c.rank() == l.coords(me)[g] && c.size() == l.size(g), G + " membership");
      // Odd and even groups issue their calls in different orders: each group meets alone.
      const bool odd = l.color_key(g, me).first % 2 == 1;
      double sum = 0;
      std::vector<std::string> names;
      if (odd) names = c.all_gather_strings("r" + std::to_string(me));
      sum = c.all_reduce_sum(me);
      if (!odd) names = c.all_gather_strings("r" + std::to_string(me));
      double want = 0;
      std::vector<std::string> want_names;
      for (int r : m) {
        want += r;
        want_names.push_back("r" + std::to_string(r));
      }
      expect(sum == want, G + " all_reduce_sum");
      expect(names == want_names, G + " all_gather_strings");
      expect(c.all_reduce_max(me) == *std::max_element(m.begin(), m.end()), G + " all_reduce_max");
      // exchange_counts: block p from member p holds (its world rank, mine, j).
      std::vector<std::int64_t> send;
      for (int p : m)
        for (int j = 0; j < 2; ++j) send.push_back(1000 * me + 10 * p + j);
      const auto got = c.exchange_counts(send);
      std::vector<std::int64_t> want_counts;
      for (int p : m)
        for (int j = 0; j < 2; ++j) want_counts.push_back(1000 * p + 10 * me + j);
      expect(got == want_counts, G + " exchange_counts");
      c.barrier();
      auto d = c.dup();
      const double count = d->all_reduce_sum(1.0);
      expect(d->world_ranks() == m && count == static_cast<double>(m.size()), G + " dup");
    }
    // split with colors < 0 and reversed keys: the even ranks, highest first.
    auto evens = world.split(me % 2 ? -1 : 7, -me);
    if (me % 2) {
      expect(evens == nullptr, "split color -1");
    } else {
      expect(evens && evens->world_ranks() == std::vector<int>({14, 12, 10, 8, 6, 4, 2, 0}), "split order");
      expect(evens && evens->rank() == (14 - me) / 2, "split rank");
      // A split of a split.
      auto halves = evens->split(me < 8 ? 0 : 1, me);
      expect(halves->world_ranks() == (me < 8 ? std::vector<int>{0, 2, 4, 6} : std::vector<int>{8, 10, 12, 14}),
             "split of a split");
    }
    world.barrier();
  });
  for (int r = 0; r < 16; ++r) EXPECT_EQ(errors[static_cast<std::size_t>(r)], "") << "rank " << r;
}

struct Measured {
  std::vector<double> seconds;           // by rank: the collective's duration
  std::vector<sim::LinkBytes> bytes;     // by rank
};

// One all-reduce of `floats` on every rank's group g (all groups at once).
Measured all_reduce_in(Group g, const GroupLayout& l, std::int64_t floats) {
  SimCluster cluster(two_dgx());
  Measured out;
  out.seconds.assign(16, -1);
  out.bytes.resize(16);
  cluster.run([&](Backend& b, Communicator& world) {
    ProcessGroups pg(world, l, NodeMap::uniform(16, 8));
    Stream& s = b.default_stream();
    Tensor buf = b.empty({floats}, DType::f32, MemCategory::buffers, s);
    world.barrier();
    b.clear_timeline();
    pg.group(g).all_reduce(s, buf);
    b.synchronize();
    world.barrier();
    const auto tl = b.timeline();
    ASSERT_EQ(tl.size(), 1u);
    out.seconds[static_cast<std::size_t>(world.rank())] = tl[0].end - tl[0].start;
    out.bytes[static_cast<std::size_t>(world.rank())] = sim_link_bytes(b);
    EXPECT_EQ(cluster.link_bytes(world.rank()).nvlink, sim_link_bytes(b).nvlink);
  });
  return out;
}

TEST(SimGroups, TpAllReduceStaysOnNvlinkWhileDpCrossesTheNic) {
  const sim::ClusterModel m = sim::load_cluster("dgx-a100x2");
  const GroupLayout l = layout("tp=2,dp=8,ep=8", 16, 8);
  const std::int64_t floats = 1 << 22;  // 16 MiB
  const double bytes = 4.0 * static_cast<double>(floats);

  // TP groups {2i, 2i+1}: a ring of two, 2(n-1)/n of the buffer over NVLink each way, every
  // pair at once and none sharing a port; NCCL's base latency once, a hop latency per step, and
  // NVLink at NCCL's share of its rate (docs/PERFORMANCE.md, "Ring collectives").
  const sim::P2pModel& nccl = m.node.p2p;
  const Measured tp = all_reduce_in(Group::tp, l, floats);
  for (int r = 0; r < 16; ++r) {
    const auto& b = tp.bytes[static_cast<std::size_t>(r)];
    EXPECT_DOUBLE_EQ(b.nvlink, bytes) << r;
    EXPECT_EQ(b.nic, 0.0) << r;
    EXPECT_EQ(b.pcie, 0.0) << r;
    const double expect = nccl.base_latency_simple + 2 * m.node.nvlink_latency + bytes / (m.node.nvlink_bw * nccl.intra_efficiency);
    EXPECT_NEAR(tp.seconds[static_cast<std::size_t>(r)], expect, 1e-9 * expect) << r;
  }

  // DP groups {0,2,...,14} and {1,3,...,15}: rings of 8 across both nodes. The edges 6->8 and
  // 14->0 (7->9, 15->1) leave the node; each is striped over the group's 4 members on either
  // node, paired in order (0->8, 2->10, 4->12, 6->14 and back), each through its own NIC (one
  // ring per channel). Every member sends a quarter of an edge over the network; the others'
  // edges stay on NVLink.
  const Measured dp = all_reduce_in(Group::dp, l, floats);
  const double per_rank = 2.0 * 7 / 8 * bytes;
  for (int r = 0; r < 16; ++r) {
    const auto& b = dp.bytes[static_cast<std::size_t>(r)];
    const bool crosses = r % 8 >= 6;
    EXPECT_DOUBLE_EQ(b.nic, per_rank / 4) << r;
    EXPECT_DOUBLE_EQ(b.nvlink, crosses ? 0.0 : per_rank) << r;
  }
  const double steps = 14;
  // A DGX A100 GPU reaches its NIC through its PCIe switch (GPUDirect RDMA, full rate): the
  // slower of the two links sets a stripe's rate; every member leaves when the last stripe ends.
  const double net_bw = m.node.gpus_per_pcie_switch > 0 ? std::min(m.node.nic_bw * nccl.net_efficiency, m.node.pcie_bw)
                                                        : m.node.nic_bw * nccl.net_efficiency;
  const double nic_time = nccl.base_latency_simple + steps * (m.node.nic_latency + m.fabric_latency) + per_rank / 4 / net_bw;
  const double nv_time = nccl.base_latency_simple + steps * m.node.nvlink_latency + per_rank / (m.node.nvlink_bw * nccl.intra_efficiency);
  EXPECT_GT(nic_time, nv_time);
  for (int r = 0; r < 16; ++r) EXPECT_NEAR(dp.seconds[static_cast<std::size_t>(r)], nic_time, 1e-9 * nic_time) << r;
}

TEST(SimGroups, AllToAllInsideANodeAndAcrossNodes) {
  // EP groups of 8 are the two nodes; expert-DP groups {r, r+8} pair them across.
  const GroupLayout l = layout("tp=2,dp=8,ep=8", 16, 8);
  const std::int64_t f = 1 << 16;  // floats to each peer
  SimCluster cluster(two_dgx());
  std::vector<sim::LinkBytes> ep_bytes(16), edp_bytes(16);
  cluster.run([&](Backend& b, Communicator& world) {
    ProcessGroups pg(world, l, NodeMap::uniform(16, 8));
    Stream& s = b.default_stream();
    for (Group g : {Group::ep, Group::edp}) {
      Communicator& c = pg.group(g);
      const int n = c.size();
      Tensor send = b.empty({n * f}, DType::f32, MemCategory::buffers, s);
      Tensor recv = b.empty({n * f}, DType::f32, MemCategory::buffers, s);
      std::vector<Segment> segs;
      for (int p = 0; p < n; ++p) segs.push_back({p, p * f, f});
      world.barrier();
      b.clear_timeline();
      c.all_to_all_v(s, send, segs, recv, segs);
      b.synchronize();
      world.barrier();
      (g == Group::ep ? ep_bytes : edp_bytes)[static_cast<std::size_t>(world.rank())] = sim_link_bytes(b);
    }
  });
  for (int r = 0; r < 16; ++r) {
    EXPECT_DOUBLE_EQ(ep_bytes[static_cast<std::size_t>(r)].nvlink, 7.0 * 4 * f) << r;  // the self segment stays in HBM
    EXPECT_EQ(ep_bytes[static_cast<std::size_t>(r)].nic, 0.0) << r;
    EXPECT_EQ(edp_bytes[static_cast<std::size_t>(r)].nvlink, 0.0) << r;
    EXPECT_DOUBLE_EQ(edp_bytes[static_cast<std::size_t>(r)].nic, 4.0 * f) << r;
  }
}

// A group's barrier holds its members' later work until the last member arrives, and leaves
// the other groups alone.
TEST(SimGroups, GroupBarrierOrdersTheMembersOnly) {
  SimCluster cluster(two_dgx());
  const GroupLayout l = layout("tp=2,dp=8", 16, 8);
  std::vector<OpRecord> last(16);
  double big_end = 0, t0 = 0;
  cluster.run([&](Backend& b, Communicator& world) {
    ProcessGroups pg(world, l, NodeMap::uniform(16, 8));
    Stream& s = b.default_stream();
    const int me = world.rank();
    Tensor big_a = b.empty({1 << 27}, DType::f32, MemCategory::buffers, s);  // 512 MiB
    Tensor big_b = b.empty({1 << 27}, DType::f32, MemCategory::buffers, s);
    Tensor small_a = b.empty({16}, DType::f32, MemCategory::buffers, s);
    Tensor small_b = b.empty({16}, DType::f32, MemCategory::buffers, s);
    world.barrier();
    b.clear_timeline();
    if (me == 0) t0 = b.now();
    // Rank 0 copies 512 MiB before the TP barrier; everyone copies a little after it.
    if (me == 0) {
      b.copy(s, big_a, big_b);
      b.synchronize();
    }
    pg.tp().barrier();
    b.copy(s, small_a, small_b);
    b.synchronize();
    world.barrier();
    const auto tl = b.timeline();
    last[static_cast<std::size_t>(me)] = tl.back();
    if (me == 0) big_end = tl.front().end - t0;
  });
  ASSERT_GT(big_end, 1e-4);
  EXPECT_GE(last[1].start - t0, big_end);     // rank 1 shares rank 0's TP group: it waited
  EXPECT_LT(last[2].start - t0, big_end / 10);  // rank 2 did not
}

}  // namespace
}  // namespace moelab
