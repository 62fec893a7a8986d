// harness/fuzz/fuzz_parallel_layout.cpp — libFuzzer target: the input is a --parallel layout
// spec ("tp=2,pp=2,dp=4,ep=8,etp=1", harness/comm/groups.hpp), parsed by ParallelLayout::parse
// and then checked as a run checks it: against several world sizes and nodes of 8 GPUs, with
// no model and with a MoE model's dimensions; a layout that checks out must place every rank
// it is asked about (coordinates, group members, the split's colour and key) consistently and
// pass check_nodes on uniform nodes. A spec given in full must survive to_string and parse
// again unchanged. See fuzz_common.hpp for the oracle, docs/FUZZING.md for runs.
#include <algorithm>
#include <optional>

#include "harness/comm/groups.hpp"
#include "harness/fuzz/fuzz_common.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  using namespace moelab;
  const std::string spec = fuzz::as_text(data, size);
  fuzz::expect_input_errors([&] {
    const ParallelLayout l = ParallelLayout::parse(spec);
    if (l.dp != 0) {
      const ParallelLayout again = ParallelLayout::parse(l.to_string());
      if (again.tp != l.tp || again.pp != l.pp || again.dp != l.dp || again.ep != l.ep || again.etp != l.etp)
        fuzz::finding("a layout that does not survive to_string and parse", l.to_string());
    }
    ModelDims moe;  // GPT-3 XL with 64 experts in every second layer
    moe.num_layers = 24;
    moe.num_heads = moe.num_kv_heads = 16;
    moe.d_ffn = 8192;
    moe.num_experts = 64;
    moe.expert_hidden = 8192;
    for (const int world : {1, 8, 64, 4096})
      for (const std::optional<ModelDims>& model : {std::optional<ModelDims>(), std::optional<ModelDims>(moe)})
        fuzz::expect_input_errors([&] {
          const GroupLayout g = check_layout(l, world, 8, model);
          if (g.tp * g.pp * g.dp != world) fuzz::finding("a checked layout that does not multiply out", g.to_string());
          (void)g.to_json().dump();
          check_nodes(g, NodeMap::uniform(world, std::min(world, 8)));
          for (const int r : {0, world / 2, world - 1}) {
            const RankCoords c = g.coords(r);
            for (const Group grp : kAllGroups) {
              const std::vector<int> m = g.members(grp, r);
              if (static_cast<int>(m.size()) != g.size(grp) || c[grp] < 0 || c[grp] >= g.size(grp) ||
                  m[static_cast<std::size_t>(c[grp])] != r)
                fuzz::finding("a rank placed inconsistently in its group", g.to_string() + " rank " + std::to_string(r));
              (void)g.color_key(grp, r);
            }
          }
        });
  });
  return 0;
}
