// impls/monta/monta.cpp — MoNTA's chunked, TP-deduplicated all-to-all as an implementation
// (see monta.hpp; the layer is baselines/deepspeed_tp_ep's CapacityTpLayer with n chunks).
//   ctest --test-dir build -R monta
#include "impls/monta/monta.hpp"

#include <algorithm>
#include <map>
#include <memory>

#include "baselines/deepspeed_tp_ep/deepspeed_tp_ep.hpp"
#include "harness/config/json_fields.hpp"
#include "harness/nn/moe_impl.hpp"
#include "harness/runtime/error.hpp"
#include "impls/monta/strategy.hpp"

namespace moelab {
namespace {

// The authors' code (a change to DeepSpeed's sharded_moe.py) fixes the chunk count at 4.
constexpr int kDefaultChunks = 4;
constexpr int kMaxChunks = 64;
constexpr int kMaxAutoChunks = 16;  // "auto" tries 1, 2, 4, 8, 16

// {"chunks": n | "auto", "layouts": bool}: n, or 0 for "auto".
int parse_chunks(const nlohmann::json& options) {
  if (options.is_object() && options.contains("chunks") && options["chunks"] == "auto") {
    nlohmann::json rest = options;
    rest.erase("chunks");
    (void)json_fields::Options(rest, "monta", {"chunks", "layouts"});
    return 0;
  }
  const json_fields::Options o(options, "monta", {"chunks", "layouts"});
  return static_cast<int>(o.positive_int("chunks", kDefaultChunks, kMaxChunks));
}

// {"layouts": true}: rank the TP and EP degrees too (with "auto"; monta::rank_layouts).
bool parse_layouts(const nlohmann::json& options) {
  if (!options.is_object() || !options.contains("layouts")) return false;
  const nlohmann::json& v = options["layouts"];
  if (!v.is_boolean()) throw ConfigError("monta: layouts = " + json_fields::show(v) + ": expected true or false");
  if (v.get<bool>() && !(options.contains("chunks") && options["chunks"] == "auto"))
    throw ConfigError("monta: layouts = true ranks the parallel layouts with the model that \"chunks\": \"auto\" uses: "
                      "give both");
  return v.get<bool>();
}

// The machine's links as the volume and time model needs them, from the backend (the sim
// backend's cluster model; unknown elsewhere).
monta::Links links_of(Backend& b, const ModelConfig& m, std::int64_t rows_per_expert) {
  const MachineRates r = b.machine_rates(std::max<std::int64_t>(rows_per_expert, 1), m.d_hidden, m.d_model, m.dtype);
  monta::Links k;
  k.gpus_per_node = r.gpus_per_node;
  k.intra_is_pcie = r.intra_pcie;
  k.intra_bw = r.intra_bw;
  k.intra_latency = r.intra_latency;
  k.nic_bw = r.nic_bw;
  k.nic_latency = r.nic_latency;
  k.nics = r.nics_per_node;
  k.gemm_flops = r.gemm_flops;
  // The experts' GEMMs at a chunk's rows per expert, from the same machine model.
  k.gemm_flops_at = [&b, m](std::int64_t rows) {
    return b.machine_rates(std::max<std::int64_t>(rows, 1), m.d_hidden, m.d_model, m.dtype).gemm_flops;
  };
  k.launch = r.launch_latency;
  return k;
}

// chunks 0 ("auto"): the model's pick at each forward (Monta); the authors' 4 until then.
TpDispatch dispatch_of(int chunks) {
  TpDispatch d{true, chunks == 0 ? kDefaultChunks : chunks, {}, false};
  return d;
}

// "auto": the chunk count the model predicts fastest for a forward of `tokens` rows padded to
// `capacity` on this machine, every candidate logged (and, asked, the layouts ranked); the
// authors' 4 where the machine's links are unknown (cpu, cuda).
int choose(CapacityTpLayer& L, bool layouts, std::int64_t capacity, std::int64_t tokens, nlohmann::json& why) {
  const ModelConfig& cfg = L.config();
  monta::Layer l;
  l.E = cfg.num_experts;
  l.C = capacity;
  l.M = cfg.d_model;
  l.H = cfg.d_hidden;
  l.bytes = static_cast<int>(dtype_size(cfg.dtype));
  l.t = L.tp_size();
  l.ep_ranks = L.ep_world_ranks();
  l.rank = l.ep_ranks.front();  // the same pick on every rank of the group
  const monta::Links k = links_of(L.backend(), cfg, capacity);
  if (!k.known()) {
    why = {{"source", "default: the machine's link rates are unknown to this backend (the authors' 4)"}};
    return kDefaultChunks;
  }
  nlohmann::json cands = nlohmann::json::array();
  for (const auto& p : monta::candidates(l, k, kMaxAutoChunks)) cands.push_back(p.to_json());
  const int n = monta::best_chunks(l, k, kMaxAutoChunks);
  why = {{"source", "volume and time model (impls/monta/strategy.hpp)"}, {"chunks", n}, {"candidates", cands}};
  const MachineRates r = L.backend().machine_rates(1, 1, 1, cfg.dtype);
  if (layouts && r.world > 0) {
    monta::LayoutQuery q;
    q.world = r.world;
    q.heads = q.kv_heads = 0;  // attention's heads are the model's, not known to the layer: not checked
    q.E = cfg.num_experts;
    q.M = cfg.d_model;
    q.H = cfg.d_hidden;
    q.tokens = tokens;
    q.top_k = cfg.top_k;
    q.capacity_factor = cfg.capacity_factor;
    q.bytes = l.bytes;
    q.device_memory = r.device_memory_bytes;  // one MoE layer's (the layer does not know the model's count)
    q.max_chunks = kMaxAutoChunks;
    nlohmann::json ranked = nlohmann::json::array();
    for (const auto& p : monta::rank_layouts(q, k)) ranked.push_back(p.to_json());
    why["layouts"] = {{"world", q.world}, {"this", {{"tp", l.t}, {"ep", static_cast<int>(l.ep_ranks.size())}}},
                      {"ranked", ranked}};
  }
  return n;
}

class Monta final : public LayerBackedImpl<CapacityTpLayer> {
 public:
  Monta(Backend& b, Communicator& c, const ModelConfig& m, MoEChannels* channels, int chunks, bool layouts)
      : LayerBackedImpl(b, c, m, channels, dispatch_of(chunks)), auto_(chunks == 0) {
    if (!auto_) return;
    CapacityTpLayer& L = layer_;
    TpDispatch d = L.dispatch_mode();
    // The model is evaluated once per (capacity, tokens): a training run sees the same shapes
    // every step, and each evaluation asks the machine model for dozens of GEMM rates.
    auto memo = std::make_shared<std::map<std::pair<std::int64_t, std::int64_t>, std::pair<int, nlohmann::json>>>();
    d.choose = [&L, layouts, memo](std::int64_t capacity, std::int64_t tokens, nlohmann::json& why) {
      if (auto it = memo->find({capacity, tokens}); it != memo->end()) {
        why = it->second.second;
        return it->second.first;
      }
      const int n = choose(L, layouts, capacity, tokens, why);
      memo->emplace(std::make_pair(capacity, tokens), std::make_pair(n, why));
      return n;
    };
    L.set_dispatch_mode(std::move(d));
  }
  std::string name() const override { return "monta"; }
  std::vector<GemmProblem> expert_gemms() override { return layer_.expert_gemm_problems(layer_.geometry().n > 1); }
  bool tp_deduplicated() const override { return true; }
  nlohmann::json report() override {
    const CapacityGeometry& g = layer_.geometry();
    return {{"schedule", "MoNTA: TP-deduplicated all-to-all, chunked along the capacity, each chunk's all-gather "
                         "over TP beside the next chunk's all-to-all"},
            {"tp", layer_.tp_size()},
            {"capacity", g.C},
            {"padded_capacity", g.Cp},
            {"chunks", g.n},
            {"chunks_choice", auto_ ? layer_.chunk_choice() : nlohmann::json("given")}};
  }

 private:
  bool auto_;
};

}  // namespace

void register_monta() {
  register_impl(
      "monta",
      [](Backend& b, Communicator& c, const ModelConfig& m, const nlohmann::json& options, MoEChannels* channels) {
        const int chunks = parse_chunks(options);
        return std::unique_ptr<MoEImpl>(std::make_unique<Monta>(b, c, m, channels, chunks, parse_layouts(options)));
      },
      [](const nlohmann::json& options, const ImplCheckContext& run) {
        (void)parse_chunks(options);
        (void)parse_layouts(options);
        check_capacity_model("monta", run.model);
      });
}

}  // namespace moelab
