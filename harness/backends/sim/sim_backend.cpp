// harness/backends/sim/sim_backend.cpp — see sim_backend.hpp.
//
// Layout of this file, in the order the data flows:
//   1. routing model          tokens per expert without a real gate
//   2. per-rank graph         LocalTask, SimStream, SimEvent
//   3. SimBackend             ops -> tasks with demands on the cluster's resources
//   4. collectives            SimCommunicator: instances, flows, rendezvous
//   5. evaluation             graph of every rank -> engine -> times, at barriers
#include "harness/backends/sim/sim_backend.hpp"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>

#include "harness/config/json_fields.hpp"
#include "harness/config/limits.hpp"
#include "harness/runtime/error.hpp"
#include "harness/runtime/random.hpp"

namespace moelab {

// ============================================================================================
// 1. Routing model
// ============================================================================================

namespace {

// A routing trace (`moelab run --record-routing`, routing_trace_json below): read through the
// same JSON reader as every input file, so that a damaged or hostile file is a one-line
// ConfigError naming the file and the field, never the library's exception or a crash.
std::vector<std::vector<std::vector<std::int64_t>>> read_routing_trace(const std::string& path) {
  using json_fields::Fields;
  using json_fields::fail;
  using json_fields::show;
  return json_fields::reading(path, [&] {
    const nlohmann::json j = json_fields::read_file(path, "routing trace");
    if (!j.is_object()) fail(path, "expected a routing trace object at the top level, got " + show(j));
    Fields f(j, path, "", {"schema", "description", "workload", "calls"});
    if (f.string("schema") != "moelab.routing-trace/1")
      f.bad_value("schema", "is not \"moelab.routing-trace/1\" (a trace written by moelab run --record-routing)");
    (void)f.string_or("description", "");
    const nlohmann::json& calls = f.require("calls");
    if (!calls.is_array() || calls.empty()) f.wrong_type("calls", calls, "a non-empty array [call][rank][expert] of counts");
    std::vector<std::vector<std::vector<std::int64_t>>> out;
    out.reserve(calls.size());
    for (std::size_t c = 0; c < calls.size(); ++c) {
      const std::string at = "calls[" + std::to_string(c) + "]";
      const nlohmann::json& ranks = calls[c];
      if (!ranks.is_array() || ranks.empty())
        fail(path, at + ": expected a non-empty array of ranks, got " + show(ranks));
      auto& call = out.emplace_back();
      for (std::size_t r = 0; r < ranks.size(); ++r) {
        const std::string rat = at + "[" + std::to_string(r) + "]";
        const nlohmann::json& experts = ranks[r];
        if (!experts.is_array() || experts.empty() || experts.size() > static_cast<std::size_t>(limits::kMaxExperts))
          fail(path, rat + ": expected an array of 1 to " + std::to_string(limits::kMaxExperts) +
                         " counts (one per expert), got " + show(experts));
        auto& row = call.emplace_back();
        row.reserve(experts.size());
        for (std::size_t e = 0; e < experts.size(); ++e) {
          const nlohmann::json& v = experts[e];
          // Slots routed by one rank to one expert: at most the routed slots of a rank.
          if (!v.is_number_integer() || v.get<std::int64_t>() < 0 || v.get<std::int64_t>() > limits::kMaxRoutedSlots)
            fail(path, rat + "[" + std::to_string(e) + "]: expected a count from 0 to " +
                           std::to_string(limits::kMaxRoutedSlots) + ", got " + show(v));
          row.push_back(v.get<std::int64_t>());
        }
      }
    }
    return out;
  });
}

}  // namespace

RoutingModel RoutingModel::parse(const std::string& spec, std::uint64_t seed) {
  RoutingModel m;
  m.seed = seed;
  const std::string shown = json_fields::one_line(spec, 80);
  if (spec.empty() || spec == "uniform") return m;
  if (spec.rfind("zipf", 0) == 0) {
    m.kind = Kind::zipf;
    if (spec.size() > 4) {
      if (spec[4] != ':') throw ConfigError("--routing " + shown + ": expected zipf:S, e.g. zipf:1.2");
      char* end = nullptr;
      m.zipf_s = std::strtod(spec.c_str() + 5, &end);
      // Beyond an exponent of 100 every token already goes to the most popular experts.
      if (!end || *end || !(m.zipf_s > 0 && m.zipf_s <= 100))
        throw ConfigError("--routing " + shown + ": the Zipf exponent must be a number in (0, 100]");
    }
    return m;
  }
  if (spec.rfind("trace:", 0) == 0) {
    m.kind = Kind::trace;
    m.trace_path = spec.substr(6);
    if (m.trace_path.empty()) throw ConfigError("--routing trace: needs a file, e.g. trace:routing.json");
    m.trace = read_routing_trace(m.trace_path);
    return m;
  }
  throw ConfigError("--routing " + shown + ": unknown routing model (expected uniform, zipf:S or trace:FILE)");
}

std::string RoutingModel::describe() const {
  switch (kind) {
    case Kind::uniform: return "uniform";
    case Kind::zipf: return "zipf:" + std::to_string(zipf_s);
    case Kind::trace: return "trace:" + trace_path;
  }
  return "?";
}

std::vector<std::int64_t> RoutingModel::draw(int rank, std::int64_t call, std::int64_t tokens, int top_k,
                                             std::int64_t experts) const {
  const auto E = static_cast<std::size_t>(experts);
  std::vector<std::int64_t> routed(E, 0);
  if (kind == Kind::trace) {
    const auto& c = trace[static_cast<std::size_t>(call) % trace.size()];
    if (c.empty()) throw ConfigError(json_fields::one_line(trace_path, 160) + ": a call with no ranks");
    const auto& r = c[static_cast<std::size_t>(rank) % c.size()];
    if (r.size() != E)
      throw ConfigError(json_fields::one_line(trace_path, 160) + ": recorded " + std::to_string(r.size()) + " experts, the model has " +
                        std::to_string(experts));
    // Rescale when the trace was recorded with another token count, by largest remainders
    // (Hamilton's apportionment): every expert gets the floor of its share, and the slots left
    // go one each to the largest fractional parts (ties to the lower expert), so the counts add
    // up to tokens × top_k exactly and none is negative. (Rounding each share alone overshot:
    // [0, 1, 1] rescaled to 1 slot gave 2.)
    const std::int64_t recorded = std::accumulate(r.begin(), r.end(), std::int64_t{0});
    const std::int64_t want = tokens * top_k;
    if (recorded == want) return r;
    if (recorded == 0) {  // nothing recorded for this call and rank: the slots go to expert 0
      routed[0] = want;
      return routed;
    }
    // In integers (128-bit products): the shares are exact, so the floors never exceed want.
    __extension__ using wide = __int128;
    std::vector<std::pair<std::int64_t, std::size_t>> remainder(E);
    std::int64_t given = 0;
    for (std::size_t e = 0; e < E; ++e) {
      const wide scaled = static_cast<wide>(r[e]) * want;
      routed[e] = static_cast<std::int64_t>(scaled / recorded);
      given += routed[e];
      remainder[e] = {static_cast<std::int64_t>(scaled % recorded), e};
    }
    std::stable_sort(remainder.begin(), remainder.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
    for (std::size_t i = 0; given < want; i = (i + 1) % E, ++given) ++routed[remainder[i].second];
    return routed;
  }
  // Popularity weights: uniform, or Zipf over a seeded permutation of the experts (the same
  // permutation on every rank: which experts are popular is a property of the model).
  std::vector<double> w(E, 1.0);
  if (kind == Kind::zipf) {
    std::vector<std::size_t> perm(E);
    std::iota(perm.begin(), perm.end(), std::size_t{0});
    Rng pr(Rng::mix(seed, 0x21f, static_cast<std::uint64_t>(call)));
    for (std::size_t i = E; i > 1; --i) std::swap(perm[i - 1], perm[static_cast<std::size_t>(pr.next() % i)]);
    for (std::size_t i = 0; i < E; ++i) w[perm[i]] = 1.0 / std::pow(static_cast<double>(i + 1), zipf_s);
  }
  std::vector<double> cdf(E);
  std::partial_sum(w.begin(), w.end(), cdf.begin());
  Rng rng(Rng::mix(seed, static_cast<std::uint64_t>(rank) + 1, static_cast<std::uint64_t>(call)));
  std::vector<std::size_t> chosen(static_cast<std::size_t>(top_k));
  for (std::int64_t t = 0; t < tokens; ++t) {
    for (int j = 0; j < top_k; ++j) {  // k distinct experts, by rejection
      for (;;) {
        const double u = rng.uniform() * cdf.back();
        const auto e = static_cast<std::size_t>(std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
        const auto pick = std::min(e, E - 1);
        if (std::find(chosen.begin(), chosen.begin() + j, pick) == chosen.begin() + j) {
          chosen[static_cast<std::size_t>(j)] = pick;
          break;
        }
      }
      ++routed[chosen[static_cast<std::size_t>(j)]];
    }
  }
  return routed;
}

nlohmann::json routing_trace_json(const std::vector<std::vector<std::vector<std::int64_t>>>& calls,
                                  const nlohmann::json& workload) {
  return {{"schema", "moelab.routing-trace/1"},
          {"description", "slots the gate routed to each expert (before capacity), per gate call and rank"},
          {"workload", workload},
          {"calls", calls}};
}

// ============================================================================================
// 2. Per-rank graph
// ============================================================================================

namespace {

struct LocalTask {
  std::string name, phase, node;
  int stream = -1;           // -1: host join / marker
  OpCost cost;
  sim::WorkClass cls = sim::WorkClass::none;
  double latency = 0;
  std::vector<sim::Demand> demands;
  std::vector<int> deps;     // local ids on the same rank
  int arrive = -1;           // collectives: the local id of the matching arrive task
  bool record = false;       // appears in the timeline
  std::string detail;        // OpRecord::detail (a GEMM call's path, where the sim prices paths)
};

struct SimStream final : Stream {
  using Stream::Stream;
  int last = -1;                 // local id of the last task issued on it in this epoch
  std::vector<int> pending_waits;
  bool unsynced = false;
};

struct SimEvent final : Event {
  int task = -1;
  std::uint64_t epoch = 0;
};

// A collective call as one rank sees it.
struct Participation {
  int member = 0;                           // rank in the communicator
  int arrive = -1, done = -1;               // local task ids
  std::vector<double> bytes_to;             // all_to_all_v: bytes to each member (incl. self)
  double bytes = 0;                         // ring collectives and p2p: payload bytes
};

// barrier: a sub-communicator's barrier, which joins its members' host timelines (a world
// barrier instead runs the engine; see SimCommunicator::barrier).
enum class CollKind { all_to_all_v, all_gather, reduce_scatter, all_reduce, p2p, barrier };
const char* collective_name(CollKind k) {
  switch (k) {
    case CollKind::all_to_all_v: return "all_to_all";
    case CollKind::all_gather: return "all_gather";
    case CollKind::reduce_scatter: return "reduce_scatter";
    case CollKind::all_reduce: return "all_reduce";
    case CollKind::p2p: return "send_recv";
    case CollKind::barrier: return "barrier";
  }
  return "?";
}

struct Instance {
  CollKind kind = CollKind::p2p;
  std::vector<int> members;          // world ranks, by rank in the communicator
  std::vector<Participation> parts;  // by arrival
  int p2p_src = -1, p2p_dst = -1;    // ranks in the communicator
};

}  // namespace

class SimBackendImpl;

struct SimCluster::Impl {
  SimOptions opt;
  int n = 0;
  std::vector<std::unique_ptr<SimBackendImpl>> backends;

  // collectives and rendezvous (shared by the rank threads)
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, Instance> instances;  // key: "<comm>#<seq>" or "<comm>#p2p:a>b#k"
  struct Gather {
    std::vector<std::string> payloads;
    int arrived = 0;
    std::uint64_t generation = 0;
    std::vector<std::string> result;
  };
  std::map<std::string, Gather> gathers;  // by communicator id: each group meets on its own
  bool aborted = false;
  std::string abort_reason;
  std::uint64_t epoch = 0;
  double epoch_base = 0;     // virtual time at which the current epoch started

  // Every member of communicator `comm` (`size` of them) hands in a payload; all get the
  // payloads by rank in the communicator. evaluate: a world barrier (size == n).
  std::vector<std::string> rendezvous(const std::string& comm, int rank, int size, std::string payload, bool evaluate);
  void evaluate();  // all rank threads are parked in a rendezvous
};

// ============================================================================================
// 3. SimBackend
// ============================================================================================

class SimBackendImpl final : public Backend {
 public:
  SimBackendImpl(SimCluster::Impl& c, int rank) : c_(c), topo_engine_(), topo_(c.opt.cluster, topo_engine_,
                                                                                c.opt.profile ? &*c.opt.profile : nullptr) {
    set_rank(rank);
    topo_.force_gemm_path(c.opt.gemm_path);
  }

  std::string name() const override { return "sim"; }
  std::string device_name() const override {
    return "simulated " + c_.opt.cluster.gpu.name + " in " + c_.opt.cluster.name;
  }
  bool has_data() const override { return false; }
  bool supports(DType t) const override { return t != DType::f64; }
  double now() const override { return now_; }
  bool clock_moves_in_group(int ranks) const override { return ranks >= c_.n || c_.opt.shapes_only; }

  Stream& create_stream(StreamRole role, const std::string& nm) override {
    streams_.push_back(std::make_unique<SimStream>(static_cast<int>(streams_.size()), role, nm));
    return *streams_.back();
  }
  std::unique_ptr<Event> create_event() override { return std::make_unique<SimEvent>(); }
  void record(Event& e, Stream& s) override {
    auto& ev = dynamic_cast<SimEvent&>(e);
    ev.task = stream(s).last;
    ev.epoch = c_.epoch;
  }
  void wait(Stream& s, Event& e) override {
    auto& ev = dynamic_cast<SimEvent&>(e);
    if (ev.task >= 0 && ev.epoch == c_.epoch) stream(s).pending_waits.push_back(ev.task);
  }
  void synchronize(Stream& s) override {
    auto& st = stream(s);
    host_join({st.last}, c_.opt.cluster.host.sync_latency);
    st.unsynced = false;
  }
  void synchronize() override {
    std::vector<int> lasts;
    for (auto& s : streams_) {
      lasts.push_back(s->last);
      s->unsynced = false;
    }
    host_join(lasts, c_.opt.cluster.host.sync_latency);
  }

  void upload(std::span<const float> host, Tensor& dst) override {
    if (dst.stream()) synchronize(*dst.stream());
    if (dst.raw() && dst.dtype() == DType::f32)
      std::memcpy(dst.raw(), host.data(), std::min(host.size() * 4, dst.nbytes()));
  }
  std::vector<float> download(const Tensor& src) override {
    if (src.stream()) synchronize(*src.stream());
    std::vector<float> v(static_cast<std::size_t>(src.numel()), 0.0f);
    if (src.raw() && src.dtype() == DType::f32) std::memcpy(v.data(), src.raw(), src.nbytes());
    return v;
  }
  void upload_i32(std::span<const std::int32_t> host, Tensor& dst) override {
    if (dst.stream()) synchronize(*dst.stream());
    if (dst.raw()) std::memcpy(dst.raw(), host.data(), std::min(host.size() * 4, dst.nbytes()));
  }
  std::vector<std::int32_t> download_i32(const Tensor& src) override {
    if (src.stream()) synchronize(*src.stream());
    std::vector<std::int32_t> v(static_cast<std::size_t>(src.numel()), 0);
    if (src.raw()) std::memcpy(v.data(), src.raw(), src.nbytes());
    return v;
  }

  void copy(Stream& s, const Tensor& src, Tensor& dst) override {
    const bool h2d = src.space() == MemSpace::host_pinned && dst.space() == MemSpace::device;
    const bool d2h = src.space() == MemSpace::device && dst.space() == MemSpace::host_pinned;
    const auto bytes = static_cast<std::int64_t>(std::max(src.nbytes(), dst.nbytes()));
    if (h2d || d2h) {
      const sim::Route r = h2d ? topo_.host_to_device(rank()) : topo_.device_to_host(rank());
      LocalTask t = op("copy", cost_copy(h2d ? OpKind::copy_h2d : OpKind::copy_d2h, bytes), sim::WorkClass::memcpy);
      t.latency += r.latency;
      for (int res : r.resources) t.demands.push_back({res, static_cast<double>(bytes)});
      issue(s, std::move(t));
    } else {
      issue(s, memory_bound("copy", cost_copy(OpKind::copy_d2d, bytes)));
    }
    if (src.raw() && dst.raw() && src.dtype() == dst.dtype()) std::memmove(dst.raw(), src.raw(), src.nbytes());
  }
  void fill_zero(Stream& s, Tensor& t) override {
    issue(s, memory_bound("fill_zero", cost_fill(static_cast<std::int64_t>(t.nbytes()))));
    if (t.raw()) std::memset(t.raw(), 0, t.nbytes());
  }
  void grouped_gemm(Stream& s, std::span<const GemmProblem> problems, const char* nm) override {
    const OpCost cost = cost_grouped_gemm(problems);
    LocalTask t = op(nm, cost, sim::WorkClass::compute);
    // The loop of single GEMMs, or the library path the cuda backend would take where the
    // cluster's GEMM calibration prices paths (sim::Topology::grouped_gemm).
    const sim::Topology::GroupedGemmPrice price = topo_.grouped_gemm(problems, allow_tf32_);
    t.latency = topo_.launch_latency() * static_cast<double>(std::max<std::int64_t>(price.launches, 1));
    t.demands = {{topo_.sm(rank()), price.seconds}, {topo_.hbm(rank()), cost.bytes_read + cost.bytes_written}};
    t.detail = price.detail;
    for (const auto& [path, why] : price.decisions) path_uses_.note(nm ? nm : "gemm", path, why);
    issue(s, std::move(t));
  }
  // A GEMM with its activation in the epilogue, as the cuda backend fuses the tanh GeLU
  // (cuBLASLt, no grouped path): the GEMM's price on the path the cuda backend would take,
  // with the aux matrix's bytes in its memory demand; the epilogue's arithmetic (about ten
  // flops per output element against the main loop's 2k) is not priced (docs/PERFORMANCE.md,
  // "Fused epilogues in the sim").
  bool fuses_gemm_epilogue(Activation act, DType) const override { return act == Activation::gelu_tanh; }
  void grouped_gemm_epilogue(Stream& s, std::span<const GemmProblem> problems, GemmEpilogue ep, Activation act,
                             const char* nm) override {
    check_gemm_epilogue(problems, ep);
    if (act != Activation::gelu_tanh) {
      Backend::grouped_gemm_epilogue(s, problems, ep, act, nm);
      return;
    }
    const OpCost cost = cost_grouped_gemm_epilogue(problems, ep, act);
    LocalTask t = op(nm, cost, sim::WorkClass::compute);
    const sim::Topology::GroupedGemmPrice price = topo_.grouped_gemm(problems, allow_tf32_, false);
    t.latency = topo_.launch_latency() * static_cast<double>(std::max<std::int64_t>(price.launches, 1));
    t.demands = {{topo_.sm(rank()), price.seconds}, {topo_.hbm(rank()), cost.bytes_read + cost.bytes_written}};
    t.detail = (price.detail.empty() ? std::string() : price.detail + "; ") + activation_name(act) +
               (ep == GemmEpilogue::act_aux ? " in the epilogue" : "'s gradient in the epilogue");
    for (const auto& [path, why] : price.decisions) path_uses_.note(nm ? nm : "gemm", path, why);
    issue(s, std::move(t));
  }
  // The floor: strided-batched runs on the calibration's strided curve where it has one
  // (Topology::batched_gemm_seconds), else one by one as time_bare_gemms.
  double time_batched_gemms(std::span<const GemmProblem> problems, int) override {
    return topo_.batched_gemm_seconds(problems, allow_tf32_);
  }
  bool prices_gemm_paths() const override { return topo_.prices_gemm_paths(); }
  std::vector<GemmPathUse> gemm_path_uses() const override { return path_uses_.uses(); }
  double time_bare_gemms(std::span<const GemmProblem> problems, int) override {
    double seconds = 0;
    // Back-to-back library calls hide their launches behind the previous kernel: the GPU time.
    for (const auto& p : problems) seconds += topo_.gemm_seconds(p.m, p.n, p.k, p.a.defined() ? p.a.dtype() : DType::f32, allow_tf32_);
    return seconds;
  }
  // The all-to-all rate among `members` (world ranks): the bottleneck of the slowest member
  // whose send bytes S spread evenly over the group's n members, with every rank of the world
  // exchanging at once in a group of the same shape (the group's translates, as an
  // expert-parallel layer's groups run; where they do not tile the world, the group alone).
  // For member r with a other members on its node and n - 1 - a on other nodes: S·a/n stay on
  // NVLink (or the GPU's PCIe link), S(n-1-a)/n leave the node through r's NIC (GPU i uses NIC
  // i % nics, shared with the other ranks behind it) and, where the node models its PCIe
  // switches, over the GPU's PCIe link by GPUDirect RDMA; on a PCIe node the bytes to members
  // of the node behind other switches cross r's switch uplink, which its switch's ranks share.
  // Each link at the rate NCCL's Simple protocol reaches on it (the p2p model's efficiencies,
  // as the all-to-all's flows are priced; full rate on GPUDirect's PCIe hops): the all-to-all
  // rate a profile of the cluster would find for large messages. Latency is left out: Eq. 10
  // is a bandwidth model.
  double a2a_bytes_among(std::span<const int> members) const override {
    const sim::NodeSpec& nd = c_.opt.cluster.node;
    if (members.size() < 2) return 0;
    std::vector<int> group(members.begin(), members.end());
    std::sort(group.begin(), group.end());
    if (std::adjacent_find(group.begin(), group.end()) != group.end() || group.front() < 0 || group.back() >= c_.n)
      throw std::invalid_argument("a2a_bytes_among: the members must be distinct ranks of the " +
                                  std::to_string(c_.n) + "-rank world");
    // The groups exchanging at once: translates of this one from each lowest rank not yet covered.
    std::vector<std::vector<int>> groups;
    std::vector<char> covered(static_cast<std::size_t>(c_.n), 0);
    for (int base = 0; base < c_.n; ++base) {
      if (covered[static_cast<std::size_t>(base)]) continue;
      std::vector<int> t;
      for (int r : group) {
        const int q = r - group.front() + base;
        if (q >= c_.n || covered[static_cast<std::size_t>(q)]) break;
        t.push_back(q);
      }
      if (t.size() != group.size()) {
        groups = {group};  // no tiling: the group alone
        break;
      }
      for (int q : t) covered[static_cast<std::size_t>(q)] = 1;
      groups.push_back(std::move(t));
    }
    const double n = static_cast<double>(group.size());
    const bool pcie = nd.intra == "pcie";
    const double link = pcie ? nd.pcie_bw : nd.nvlink_bw;
    const double eff_intra = nd.p2p.intra_efficiency, eff_net = nd.p2p.net_efficiency;
    const auto node_of = [&](int r) { return c_.opt.cluster.node_of(r); };
    const auto switch_of = [&](int r) { return node_of(r) * nd.gpus + (r % nd.gpus) / nd.gpus_per_pcie_switch; };
    std::map<int, double> nic_load, uplink_load;  // send bytes per byte of S through each
    double per_byte = 0;                           // seconds per byte of S, the slowest link
    for (const auto& g : groups) {
      std::map<int, int> on_node, on_switch;
      for (int r : g) {
        ++on_node[node_of(r)];
        if (pcie) ++on_switch[switch_of(r)];
      }
      for (int r : g) {
        const int same = on_node[node_of(r)];
        const double intra = (same - 1) / n, inter = (n - same) / n;
        // The GPU's own link: its intra-node bytes, and on a PCIe node its GPUDirect bytes too.
        per_byte = std::max(per_byte, intra / (link * eff_intra) + (pcie ? inter / link : 0.0));
        if (inter > 0) {
          nic_load[node_of(r) * nd.nics + (r % nd.gpus) % nd.nics] += inter;
          if (!pcie && nd.pcie_switches()) per_byte = std::max(per_byte, inter / nd.pcie_bw);
        }
        if (pcie) uplink_load[switch_of(r)] += (same - on_switch[switch_of(r)]) / n;
      }
    }
    for (const auto& [nic, load] : nic_load) per_byte = std::max(per_byte, load / (nd.nic_bw * eff_net));
    for (const auto& [sw, load] : uplink_load)
      per_byte = std::max(per_byte, load / (nd.pcie_switch_uplink_bw * eff_intra));
    return per_byte > 0 ? 1.0 / per_byte : 0.0;
  }
  // The cluster model's rates (the profile's where it measured them); the all-to-all rate is
  // the world's (a2a_bytes_among every rank; ranks fill nodes in order).
  MachineRates machine_rates(std::int64_t m, std::int64_t n, std::int64_t k, DType t) const override {
    const sim::ClusterModel& cm = c_.opt.cluster;
    const sim::NodeSpec& nd = cm.node;
    MachineRates r;
    const double secs = topo_.gemm_seconds(m, n, k, t, allow_tf32_);
    if (secs > 0) r.gemm_flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) / secs;
    r.peak_flops = t == DType::f32 && allow_tf32_ ? cm.gpu.flops_tf32 : cm.peak_flops(t);
    const double g = std::min(nd.gpus, c_.n);
    const bool pcie = nd.intra == "pcie";
    const double link = pcie ? nd.pcie_bw : nd.nvlink_bw;
    const double eff_intra = nd.p2p.intra_efficiency, eff_net = nd.p2p.net_efficiency;
    if (!world_a2a_bytes_) {  // the cluster does not change: computed once
      std::vector<int> world(static_cast<std::size_t>(c_.n));
      std::iota(world.begin(), world.end(), 0);
      world_a2a_bytes_ = a2a_bytes_among(world);
    }
    r.a2a_bytes = *world_a2a_bytes_;
    const auto* prof = c_.opt.profile ? &*c_.opt.profile : nullptr;
    const double h2d = prof && prof->h2d_bw > 0 ? prof->h2d_bw : nd.host_copy_bw;
    const double d2h = prof && prof->d2h_bw > 0 ? prof->d2h_bw : nd.host_copy_bw;
    // Host copies take the sim's routes (Topology::host_to_device / device_to_host): on an
    // NVSwitch node the GPU's own host link, and where the node declares PCIe switches the GPU's
    // x16 link and its switch's uplink too; on a PCIe node the last two only. Alone, a rank has
    // the uplink to itself; with every rank of the node copying at once (ranks fill nodes in
    // order, so a switch holds min(gpus_per_pcie_switch, g) of them) it gets its share.
    const auto host_rate = [&](double own, double sharing) {
      double rate = pcie ? std::numeric_limits<double>::infinity() : own;
      if (pcie || nd.pcie_switches()) rate = std::min({rate, nd.pcie_bw, nd.pcie_switch_uplink_bw / sharing});
      return rate;
    };
    const double on_switch = pcie || nd.pcie_switches() ? std::min<double>(nd.gpus_per_pcie_switch, g) : 1.0;
    r.host_copy_bytes = std::min(host_rate(h2d, 1.0), host_rate(d2h, 1.0));
    r.host_copy_bytes_all_ranks = std::min(host_rate(h2d, on_switch), host_rate(d2h, on_switch));
    r.sigma = cm.interference.sigma;
    r.mu = cm.interference.mu;
    r.eta = cm.interference.eta;
    r.device_memory_bytes = cm.gpu.memory_bytes;
    r.host_memory_bytes = nd.host_memory_bytes / nd.gpus;
    r.gpus_per_node = nd.gpus;
    r.nics_per_node = nd.nics;
    r.intra_pcie = pcie;
    // The links at the share of their rate NCCL's Simple protocol reaches (the p2p efficiencies
    // the sim charges its collectives with), as a profile of the cluster would find them.
    r.intra_bw = link * eff_intra;
    r.intra_latency = pcie ? nd.pcie_latency : nd.nvlink_latency;
    r.nic_bw = nd.nic_bw * eff_net;
    r.nic_latency = nd.nic_latency + cm.fabric_latency;
    r.launch_latency = prof && prof->launch_latency > 0 ? prof->launch_latency : cm.efficiency.launch_latency;
    r.world = c_.n;
    r.source = "cluster model " + cm.name + " (" + (prof ? "profile " + prof->name : std::string("datasheet")) +
               ", " + std::to_string(c_.n) + " ranks)";
    return r;
  }
  void noisy_logits(Stream& s, const Tensor& clean, const Tensor&, const Tensor&, Tensor&) override {
    issue(s, memory_bound("noisy_logits", cost_elementwise(clean.numel(), DType::f32, 3, 1, 6)));
  }
  void noisy_logits_backward(Stream& s, const Tensor& d_logits, const Tensor&, const Tensor&, Tensor&) override {
    issue(s, memory_bound("noisy_logits_bwd", cost_elementwise(d_logits.numel(), DType::f32, 3, 1, 5)));
  }
  void gate_forward(Stream& s, GateForward& g) override {
    const std::int64_t T = g.logits.dim(0), E = g.logits.dim(1);
    issue(s, memory_bound("gate", cost_gate_forward(T, E, g.top_k)));
    // The routing model stands in for softmax + top-k: tokens per expert, then capacity.
    const auto routed = c_.opt.routing.draw(rank(), gate_calls_++, T, g.top_k, E);
    auto* counts = g.counts.data<std::int32_t>();
    auto* frac = g.routed_frac.data<float>();
    for (std::int64_t e = 0; e < E; ++e) {
      const std::int64_t r = routed[static_cast<std::size_t>(e)];
      if (counts) counts[e] = static_cast<std::int32_t>(g.capacity > 0 ? std::min(r, g.capacity) : r);
      if (frac) frac[e] = T ? static_cast<float>(static_cast<double>(r) / static_cast<double>(T * g.top_k)) : 0.0f;
    }
    if (auto* aux = g.aux_loss.data<float>()) aux[0] = 0.0f;
  }
  void gate_backward(Stream& s, GateBackward& g) override {
    issue(s, memory_bound("gate_bwd", cost_gate_backward(g.probs.dim(0), g.probs.dim(1),
                                                         static_cast<int>(g.topk_idx.dim(1)))));
  }
  void permute(Stream& s, const Tensor& x, const Tensor&, Tensor& out) override {
    issue(s, memory_bound("permute", cost_rows(OpKind::permute, out.dim(0), out.dim(0), x.dim(1), x.dtype(), 0),
                          rows_rate(true)));
  }
  void permute_backward(Stream& s, const Tensor& d_out, const Tensor&, Tensor& dx) override {
    issue(s, memory_bound("permute_bwd", cost_rows(OpKind::permute, d_out.dim(0), dx.dim(0), dx.dim(1), dx.dtype(), 1),
                          rows_rate(false)));
  }
  void unpermute(Stream& s, const Tensor& y_perm, const Tensor&, const Tensor&, Tensor& y) override {
    issue(s, memory_bound("unpermute", cost_rows(OpKind::permute, y_perm.dim(0), y.dim(0), y.dim(1), y.dtype(), 2),
                          rows_rate(false)));
  }
  void unpermute_backward(Stream& s, const Tensor& dy, const Tensor& y_perm, const Tensor&, const Tensor&,
                          Tensor&, Tensor&) override {
    issue(s, memory_bound("unpermute_bwd",
                          cost_rows(OpKind::permute, dy.dim(0) + y_perm.dim(0), y_perm.dim(0), dy.dim(1), dy.dtype(), 3),
                          rows_rate(true)));
  }
  void activation_forward(Stream& s, Activation a, const Tensor& in, Tensor&) override {
    issue(s, activation_task(activation_name(a), a, false, in, cost_activation_forward(a, in.numel(), in.dtype())));
  }
  void activation_backward(Stream& s, Activation a, const Tensor& in, const Tensor&, Tensor&) override {
    issue(s, activation_task(std::string(activation_name(a)) + "_bwd", a, true, in,
                             cost_activation_backward(a, in.numel(), in.dtype())));
  }


  // ---- transformer-block ops: no data; attention is compute-bound work on the SMs, the rest
  // memory-bound (docs/PERFORMANCE.md, "Block ops").
  void embedding_forward(Stream& s, const Tensor& ids, const Tensor& wte, const Tensor& wpe, std::int64_t, Tensor&,
                         const VocabShard&) override {
    issue(s, memory_bound("embedding", cost_embedding_forward(ids.numel(), wte.dim(1), wpe.defined(), wte.dtype())));
  }
  void embedding_backward(Stream& s, const Tensor& d_out, const Tensor& ids, std::int64_t, Tensor& d_wte,
                          Tensor& d_wpe, const VocabShard&) override {
    issue(s, memory_bound("embedding_bwd",
                          cost_embedding_backward(ids.numel(), d_wte.dim(1), d_wpe.defined(), d_out.dtype())));
  }
  void norm_forward(Stream& s, NormKind kind, float, const Tensor& x, const Tensor&, const Tensor&, Tensor&, Tensor&,
                    Tensor&) override {
    issue(s, memory_bound(norm_name(kind), cost_norm_forward(kind, x.dim(0), x.dim(1), x.dtype())));
  }
  void norm_backward(Stream& s, NormKind kind, const Tensor& x, const Tensor&, const Tensor&, const Tensor&,
                     const Tensor&, Tensor&, Tensor&, Tensor&) override {
    issue(s, memory_bound(std::string(norm_name(kind)) + "_bwd",
                          cost_norm_backward(kind, x.dim(0), x.dim(1), x.dtype())));
  }
  void rope(Stream& s, const AttentionShape& a, float, bool inverse, Tensor& qkv) override {
    issue(s, memory_bound(inverse ? "rope_inverse" : "rope", cost_rope(a, qkv.dtype())));
  }
  void attention_forward(Stream& s, const AttentionShape& a, const Tensor& qkv, Tensor&, Tensor&) override {
    issue(s, attention_task("attention", a, qkv.dtype(), cost_attention_forward(a, qkv.dtype())));
  }
  void attention_backward(Stream& s, const AttentionShape& a, const Tensor& qkv, const Tensor&, const Tensor&,
                          const Tensor&, Tensor&) override {
    issue(s, attention_task("attention_bwd", a, qkv.dtype(), cost_attention_backward(a, qkv.dtype())));
  }
  void swiglu_forward(Stream& s, const Tensor& h, Tensor& out) override {
    issue(s, memory_bound("swiglu", cost_swiglu_forward(out.dim(0), out.dim(1), h.dtype())));
  }
  void swiglu_backward(Stream& s, const Tensor& h, const Tensor& d_out, Tensor&) override {
    issue(s, memory_bound("swiglu_bwd", cost_swiglu_backward(d_out.dim(0), d_out.dim(1), h.dtype())));
  }
  void add(Stream& s, const Tensor& a, const Tensor&, Tensor&) override {
    issue(s, memory_bound("add", cost_add(a.numel(), a.dtype())));
  }
  void gated_combine_forward(Stream& s, const Tensor& z, const Tensor& a, const Tensor&, Tensor&) override {
    issue(s, memory_bound("gated_combine",
                          cost_gated_combine_forward(a.dim(0), a.dim(1), static_cast<int>(z.dim(1)), a.dtype())));
  }
  void gated_combine_backward(Stream& s, const Tensor& z, const Tensor& a, const Tensor&, const Tensor&, Tensor&,
                              Tensor& db, Tensor&) override {
    issue(s, memory_bound("gated_combine_bwd", cost_gated_combine_backward(a.dim(0), a.dim(1), static_cast<int>(z.dim(1)),
                                                                           db.defined(), a.dtype())));
  }
  void scale(Stream& s, const Tensor& x, float, Tensor&) override {
    issue(s, memory_bound("scale", cost_scale(x.numel(), x.dtype())));
  }
  void cross_entropy_forward(Stream& s, const Tensor& logits, const Tensor&, Tensor&, Tensor&,
                             const VocabShard&) override {
    issue(s, memory_bound("cross_entropy",
                          cost_cross_entropy_forward(logits.dim(0), logits.dim(1), logits.dtype())));
  }
  void cross_entropy_combine(Stream& s, const Tensor& parts, const Tensor& targets, std::int64_t, Tensor&,
                             Tensor&) override {
    const std::int64_t T = targets.numel();
    issue(s, memory_bound("cross_entropy_combine", cost_cross_entropy_combine(T, T > 0 ? parts.numel() / (2 * T) : 0)));
  }
  void cross_entropy_backward(Stream& s, const Tensor& logits, const Tensor&, const Tensor&, float, Tensor&,
                              const VocabShard&) override {
    issue(s, memory_bound("cross_entropy_bwd",
                          cost_cross_entropy_backward(logits.dim(0), logits.dim(1), logits.dtype())));
  }
  void optimizer_step(Stream& s, const OptimizerStep& o) override {
    issue(s, memory_bound(o.kind == OptimizerKind::adam ? "adam" : "sgd",
                          cost_optimizer_step(o.kind, o.param.numel(), o.param.dtype(), o.master.defined())));
  }

  std::vector<OpRecord> timeline() override { return records_; }
  void clear_timeline() override {
    records_.clear();
    link_bytes_ = {};
    link_bytes_by_collective_.clear();
  }

  // ---- used by the communicator and the evaluation ----------------------------------------
  // A collective's two tasks on stream s: `arrive` (this rank is ready) and `done` (this
  // rank's part finished); flows between ranks are added at evaluation time.
  std::pair<int, int> collective(Stream& s, const std::string& nm, const OpCost& cost) {
    LocalTask arrive = op(nm + ".arrive", {}, sim::WorkClass::none);
    arrive.record = false;
    const int a = issue(s, std::move(arrive));
    LocalTask done = op(nm, cost, sim::WorkClass::none);
    done.arrive = a;
    const int d = issue(s, std::move(done));
    return {a, d};
  }
  std::vector<LocalTask>& tasks() { return tasks_; }
  bool quiescent() const {
    return std::none_of(streams_.begin(), streams_.end(), [](const auto& s) { return s->unsynced; });
  }
  int host_task() const { return host_; }
  void mark_untimed() override { untimed_ = true; }
  bool untimed() const { return untimed_; }
  // Apply an evaluation: times (epoch-relative) of this rank's tasks.
  void commit(const std::vector<double>& start, const std::vector<double>& end, double base, bool final) {
    if (!final) {
      if (host_ >= 0) now_ = base + end[static_cast<std::size_t>(host_)];
      return;
    }
    for (std::size_t i = 0; i < tasks_.size(); ++i) {
      const LocalTask& t = tasks_[i];
      if (!t.record) continue;
      OpRecord r;
      r.rank = rank();
      r.stream_id = t.stream;
      r.stream_name = streams_[static_cast<std::size_t>(t.stream)]->name();
      r.name = t.name;
      r.phase = t.phase;
      r.node = t.node;
      r.cost = t.cost;
      r.detail = t.detail;
      r.start = base + (t.arrive >= 0 ? end[static_cast<std::size_t>(t.arrive)] : start[i]);
      r.end = base + end[i];
      records_.push_back(std::move(r));
    }
  }
  void new_epoch(double now) {
    tasks_.clear();
    host_ = -1;
    untimed_ = false;
    for (auto& s : streams_) {
      s->last = -1;
      s->pending_waits.clear();
    }
    now_ = now;
  }
  const sim::Topology& topology() const { return topo_; }
  // A host-side barrier of a sub-communicator: `arrive` is the host reaching it, `done` the
  // host leaving it; the evaluation makes `done` wait for every member's `arrive`.
  std::pair<int, int> host_barrier() {
    host_join({});
    const int a = host_;
    host_join({});
    return {a, host_};
  }
  // Bytes this rank sent by the collectives in its timeline, by link class.
  void add_link_bytes(const sim::LinkBytes& b, const std::map<std::string, sim::LinkBytes>& by_collective) {
    link_bytes_ += b;
    for (const auto& [k, v] : by_collective) link_bytes_by_collective_[k] += v;
  }
  const sim::LinkBytes& link_bytes() const { return link_bytes_; }
  const std::map<std::string, sim::LinkBytes>& link_bytes_by_collective() const { return link_bytes_by_collective_; }

 protected:
  void* raw_alloc(std::size_t bytes, MemSpace space, Stream&) override {
    // The GPU model's memory is finite: a run that would not fit on the real GPU stops here.
    const double cap = c_.opt.cluster.gpu.memory_bytes;
    if (space == MemSpace::device && static_cast<double>(memory_.device_in_use() + bytes) > cap) {
      char msg[512];
      std::snprintf(msg, sizeof msg,
                    "rank %d: out of device memory: %.3f GiB requested (phase \"%s\") with %.3f GiB in use, "
                    "more than the %.3f GiB of the simulated %s",
                    rank(), static_cast<double>(bytes) / (1 << 30), phase().c_str(),
                    static_cast<double>(memory_.device_in_use()) / (1 << 30), cap / (1 << 30),
                    c_.opt.cluster.gpu.name.c_str());
      throw OutOfMemory(msg);
    }
    // Small tensors (counts, scalars, routing fractions) keep real bytes; the rest is virtual.
    return bytes <= kRealBytes ? std::calloc(1, bytes) : nullptr;
  }
  void raw_free(void* p, std::size_t, MemSpace, Stream&) override { std::free(p); }

 private:
  static constexpr std::size_t kRealBytes = 64 * 1024;

  SimStream& stream(Stream& s) {
    auto* st = dynamic_cast<SimStream*>(&s);
    MOELAB_CHECK(st && st->id() < static_cast<int>(streams_.size()) && streams_[static_cast<std::size_t>(st->id())].get() == st,
                 "stream " + s.name() + " does not belong to this sim backend");
    return *st;
  }
  LocalTask op(std::string nm, const OpCost& cost, sim::WorkClass cls) {
    LocalTask t;
    t.name = std::move(nm);
    t.phase = phase();
    t.node = node();
    t.cost = cost;
    t.cls = cls;
    t.record = true;
    t.latency = cls == sim::WorkClass::none ? 0.0 : topo_.launch_latency();
    return t;
  }
  // A memory-bound kernel: its bytes at the effective HBM bandwidth. With a profile, data
  // movement (copies, permutes, the gate) runs at the measured device-copy rate and
  // elementwise math (activations) at the measured elementwise rate: on a GPU both are
  // memory-bound and close, on a CPU the activation's erf makes the second much lower.
  // `measured_bw`: the GEMM calibration's rate of this very kernel (KernelRates), which then
  // replaces both.
  LocalTask memory_bound(std::string nm, const OpCost& cost, std::optional<double> measured_bw = std::nullopt) {
    LocalTask t = op(std::move(nm), cost, sim::WorkClass::compute);
    const double bytes = cost.bytes_read + cost.bytes_written;
    const double hbm_bw = c_.opt.cluster.gpu.hbm_bw;
    double bw = topo_.mem_bw_effective();
    if (c_.opt.profile && cost.kind != OpKind::elementwise && c_.opt.profile->d2d_bw > 0) bw = c_.opt.profile->d2d_bw;
    if (measured_bw) {
      bw = *measured_bw;
      t.detail = "at the calibration's measured rate";
    }
    t.demands = {{topo_.hbm(rank()), bytes * hbm_bw / bw}};
    return t;
  }
  // The dispatch kernels at the calibration's measured rates where it has them: the permute's
  // for the gathers of token rows into slot order (permute, unpermute_bwd), the unpermute's
  // for the gathers that sum a token's slots (unpermute, permute_bwd); docs/PERFORMANCE.md,
  // "Kernel rates in the sim".
  std::optional<double> rows_rate(bool into_slots) const {
    const sim::KernelRates* k = topo_.kernel_rates();
    if (!k) return std::nullopt;
    const std::optional<double> bw = into_slots ? k->permute_bw : k->unpermute_bw;
    if (!bw) return std::nullopt;
    return *bw * topo_.calibration_hbm_scale();  // memory-bound: at this GPU's HBM rate
  }
  // An activation: its bytes at the memory rate and, where the calibration measured this
  // kernel, its elements at the measured rate, whichever binds (the engine takes the slower
  // demand): a GPU's activation is memory-bound, a CPU's exact-erf GeLU bound by arithmetic.
  LocalTask activation_task(std::string nm, Activation a, bool backward, const Tensor& in, const OpCost& cost) {
    LocalTask t = memory_bound(std::move(nm), cost);
    const sim::KernelRates* k = topo_.kernel_rates();
    if (const sim::ActivationRate* r = k ? k->activation(a, backward, in.dtype()) : nullptr) {
      // memory-bound on a GPU: at this GPU's HBM rate (calibration_hbm_scale)
      t.demands.push_back({topo_.sm(rank()), static_cast<double>(in.numel()) /
                                                 (r->elements_per_s * topo_.calibration_hbm_scale())});
      t.detail = "at most the calibration's measured elements/s";
    }
    return t;
  }
  // Attention (forward or backward) as a GEMM of the same FLOPs: at the rate the cluster model
  // (datasheet curve or profile) gives the GEMM [B·Hq·S, D] × [D, S], QK^T of every head at
  // once, whose smallest side — D, as in a tile's products — sets the curve's efficiency.
  LocalTask attention_task(std::string nm, const AttentionShape& a, DType t, const OpCost& cost) {
    LocalTask task = op(std::move(nm), cost, sim::WorkClass::compute);
    const std::int64_t m = a.batch * a.heads * a.seq, n = a.seq, k = a.head_dim;
    const double gemm_flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
    const double seconds = gemm_flops > 0 ? topo_.gemm_seconds(m, n, k, t, allow_tf32_) * cost.flops / gemm_flops
                                          : 0.0;
    task.latency = topo_.launch_latency() * static_cast<double>(std::max<std::int64_t>(cost.launches, 1));
    task.demands = {{topo_.sm(rank()), seconds}, {topo_.hbm(rank()), cost.bytes_read + cost.bytes_written}};
    return task;
  }
  int issue(Stream& s, LocalTask t) {
    auto& st = stream(s);
    // The host issues every recorded operation in program order, each costing it
    // issue_overhead (docs/PERFORMANCE.md, "Host time"): the operation cannot start before.
    if (const double ho = c_.opt.cluster.host.issue_overhead; ho > 0 && t.record) host_join({}, ho);
    t.stream = st.id();
    if (st.last >= 0) t.deps.push_back(st.last);
    if (host_ >= 0) t.deps.push_back(host_);
    for (int w : st.pending_waits) t.deps.push_back(w);
    st.pending_waits.clear();
    tasks_.push_back(std::move(t));
    st.last = static_cast<int>(tasks_.size()) - 1;
    st.unsynced = true;
    return st.last;
  }
  // The host's next point: after `on` and its previous point, plus `latency` of host time.
  void host_join(const std::vector<int>& on, double latency = 0) {
    LocalTask j;
    j.name = "host";
    j.latency = latency;
    for (int d : on)
      if (d >= 0) j.deps.push_back(d);
    if (host_ >= 0) j.deps.push_back(host_);
    tasks_.push_back(std::move(j));
    host_ = static_cast<int>(tasks_.size()) - 1;
  }

  SimCluster::Impl& c_;
  sim::Engine topo_engine_;  // resources registered once; ids are identical in every evaluation
  sim::Topology topo_;
  std::vector<std::unique_ptr<SimStream>> streams_;
  std::vector<LocalTask> tasks_;
  std::vector<OpRecord> records_;
  int host_ = -1;
  bool untimed_ = false;  // mark_untimed: this epoch's work need not be priced
  double now_ = 0;
  std::int64_t gate_calls_ = 0;
  sim::LinkBytes link_bytes_;
  std::map<std::string, sim::LinkBytes> link_bytes_by_collective_;
  GemmPathLedger path_uses_;  // where the calibration prices paths (Backend::gemm_path_uses)
  mutable std::optional<double> world_a2a_bytes_;  // machine_rates' a2a_bytes, once
};

// ============================================================================================
// 4. Collectives
// ============================================================================================

namespace {

// A communicator over `members` (world ranks, in rank order): the world, a dup or a split.
// Peers are numbered in the communicator; flows run between the members' GPUs, so the
// topology prices a group inside a node and one across nodes differently. Its id names its
// collectives' instances and its rendezvous: the same on every member, unique per group.
class SimCommunicator final : public Communicator {
 public:
  SimCommunicator(SimCluster::Impl& c, SimBackendImpl& b, std::string id, std::vector<int> members)
      : c_(c), b_(b), id_(std::move(id)), members_(std::move(members)) {
    const auto it = std::find(members_.begin(), members_.end(), b_.rank());
    MOELAB_CHECK(it != members_.end(), "sim communicator " + id_ + " does not contain rank " + std::to_string(b_.rank()));
    me_ = static_cast<int>(it - members_.begin());
  }
  int rank() const override { return me_; }
  int size() const override { return static_cast<int>(members_.size()); }
  std::string kind() const override { return "sim"; }
  std::unique_ptr<Communicator> dup() override {
    return std::make_unique<SimCommunicator>(c_, b_, id_ + "/" + std::to_string(dups_++), members_);
  }
  std::unique_ptr<Communicator> split(int color, int key) override {
    const auto all = c_.rendezvous(id_, me_, size(), nlohmann::json::array({color, key}).dump(), false);
    const std::string id = id_ + "/split" + std::to_string(splits_++) + ":" + std::to_string(color);
    if (color < 0) return nullptr;
    std::vector<std::pair<int, int>> color_key;
    for (const auto& a : all) {
      const auto ck = nlohmann::json::parse(a);
      color_key.emplace_back(ck[0].get<int>(), ck[1].get<int>());
    }
    std::vector<int> world;
    for (int m : split_members(color_key, color)) world.push_back(members_[static_cast<std::size_t>(m)]);
    return std::make_unique<SimCommunicator>(c_, b_, id, std::move(world));
  }
  std::vector<int> world_ranks() const override { return members_; }

  void all_to_all_v(Stream& s, const Tensor& send, std::span<const Segment> sends, Tensor&,
                    std::span<const Segment>) override {
    Participation p;
    p.bytes_to.assign(members_.size(), 0.0);
    double local = 0;
    for (const auto& sg : sends) {
      if (sg.peer < 0 || sg.peer >= size()) throw CommError("rank " + std::to_string(rank()) + ": all_to_all_v segment to rank " + std::to_string(sg.peer) + " outside the world of " + std::to_string(size()));
      const double b = static_cast<double>(sg.count) * static_cast<double>(dtype_size(send.dtype()));
      p.bytes_to[static_cast<std::size_t>(sg.peer)] += b;
      if (sg.peer == rank()) local += b;
    }
    join(s, "all_to_all_v", CollKind::all_to_all_v, std::move(p),
         cost_collective(segments_bytes_to_others(sends, rank(), send.dtype()), local));
  }
  void all_gather(Stream& s, const Tensor& send, Tensor&) override { ring(s, "all_gather", CollKind::all_gather, static_cast<double>(send.nbytes())); }
  void reduce_scatter(Stream& s, const Tensor&, Tensor& recv) override { ring(s, "reduce_scatter", CollKind::reduce_scatter, static_cast<double>(recv.nbytes())); }
  void all_reduce(Stream& s, Tensor& buf) override { ring(s, "all_reduce", CollKind::all_reduce, static_cast<double>(buf.nbytes()) / size()); }
  void send(Stream& s, const Tensor& t, int peer) override { p2p(s, t, rank(), peer, "send"); }
  void recv(Stream& s, Tensor& t, int peer) override { p2p(s, t, peer, rank(), "recv"); }

  // A barrier over every rank runs the engine (times become final there). A group's barrier
  // cannot (the other ranks are not waiting): it meets its members and joins their host
  // timelines, so that what a member issues after it starts no earlier than the last arrival.
  void barrier() override {
    if (size() == c_.n) {
      c_.rendezvous(id_, me_, size(), "", true);
      return;
    }
    auto [a, d] = b_.host_barrier();
    add_part(id_ + "#barrier" + std::to_string(barriers_++), CollKind::barrier, "barrier", part(a, d));
    c_.rendezvous(id_, me_, size(), "", false);
  }
  std::vector<std::int64_t> exchange_counts(const std::vector<std::int64_t>& send) override {
    MOELAB_CHECK(send.size() % members_.size() == 0, "exchange_counts: size not a multiple of ranks");
    const std::size_t c = send.size() / members_.size();
    const auto all = c_.rendezvous(id_, me_, size(), nlohmann::json(send).dump(), false);
    std::vector<std::int64_t> out;
    const auto me = static_cast<std::size_t>(me_);
    for (const auto& a : all) {
      const auto v = nlohmann::json::parse(a).get<std::vector<std::int64_t>>();
      out.insert(out.end(), v.begin() + static_cast<std::ptrdiff_t>(me * c),
                 v.begin() + static_cast<std::ptrdiff_t>((me + 1) * c));
    }
    return out;
  }
  double all_reduce_max(double v) override {
    double m = -INFINITY;
    for (const auto& s : c_.rendezvous(id_, me_, size(), nlohmann::json(v).dump(), false)) m = std::max(m, nlohmann::json::parse(s).get<double>());
    return m;
  }
  double all_reduce_sum(double v) override {
    double m = 0;  // summed in rank order: deterministic
    for (const auto& s : c_.rendezvous(id_, me_, size(), nlohmann::json(v).dump(), false)) m += nlohmann::json::parse(s).get<double>();
    return m;
  }
  std::vector<std::string> all_gather_strings(const std::string& s) override { return c_.rendezvous(id_, me_, size(), s, false); }

 private:
  Participation part(int arrive, int done) const {
    Participation p;
    p.member = me_;
    p.arrive = arrive;
    p.done = done;
    return p;
  }
  // Adds this rank's part to the instance `key`, which every member's call of the same
  // collective shares.
  void add_part(const std::string& key, CollKind kind, const std::string& nm, Participation p, int src = -1,
                int dst = -1) {
    std::lock_guard lk(c_.mu);
    Instance& in = c_.instances[key];
    if (!in.parts.empty() && in.kind != kind)
      throw CommError("rank " + std::to_string(rank()) + ": collective mismatch on " + id_ + ": this rank called " + nm + " where another called a different collective");
    in.kind = kind;
    in.members = members_;
    in.p2p_src = src;
    in.p2p_dst = dst;
    in.parts.push_back(std::move(p));
  }
  void join(Stream& s, const std::string& nm, CollKind kind, Participation p, const OpCost& cost) {
    auto [a, d] = b_.collective(s, nm, cost);
    Participation full = part(a, d);
    full.bytes_to = std::move(p.bytes_to);
    full.bytes = p.bytes;
    add_part(id_ + "#" + std::to_string(seq_++), kind, nm, std::move(full));
  }
  void ring(Stream& s, const std::string& nm, CollKind kind, double chunk) {
    Participation p;
    p.bytes = chunk;
    const double n = size();
    const double sent = (kind == CollKind::all_reduce ? 2.0 : 1.0) * (n - 1) * chunk;
    join(s, nm, kind, std::move(p), cost_collective(sent, chunk));
  }
  void p2p(Stream& s, const Tensor& t, int src, int dst, const std::string& nm) {
    if (src == dst || src < 0 || dst < 0 || src >= size() || dst >= size())
      throw CommError("rank " + std::to_string(rank()) + ": " + nm + " between ranks " + std::to_string(src) + " and " + std::to_string(dst));
    auto [a, d] = b_.collective(s, nm, cost_collective(nm == "send" ? static_cast<double>(t.nbytes()) : 0.0, 0.0));
    Participation p = part(a, d);
    p.bytes = static_cast<double>(t.nbytes());
    const std::string pair = std::to_string(src) + ">" + std::to_string(dst);
    add_part(id_ + "#p2p:" + pair + "#" + std::to_string(p2p_seq_[pair]++), CollKind::p2p, nm, std::move(p), src, dst);
  }

  SimCluster::Impl& c_;
  SimBackendImpl& b_;
  std::string id_;
  std::vector<int> members_;
  int me_ = 0;
  std::uint64_t seq_ = 0, barriers_ = 0;
  int dups_ = 0, splits_ = 0;
  std::map<std::string, std::uint64_t> p2p_seq_;
};

}  // namespace

// ============================================================================================
// 5. Rendezvous and evaluation
// ============================================================================================

std::vector<std::string> SimCluster::Impl::rendezvous(const std::string& comm, int rank, int size,
                                                      std::string payload, bool eval) {
  std::unique_lock lk(mu);
  if (aborted) throw CommError("rank " + std::to_string(rank) + ": " + abort_reason);
  Gather& g = gathers[comm];
  if (g.payloads.empty()) g.payloads.resize(static_cast<std::size_t>(size));
  g.payloads[static_cast<std::size_t>(rank)] = std::move(payload);
  const std::uint64_t gen = g.generation;
  if (++g.arrived == size) {
    if (eval) evaluate();
    g.result = std::move(g.payloads);
    g.payloads.assign(static_cast<std::size_t>(size), std::string());
    g.arrived = 0;
    ++g.generation;
    cv.notify_all();
    return g.result;
  }
  cv.wait(lk, [&] { return aborted || g.generation != gen; });
  if (aborted && g.generation == gen) throw CommError("rank " + std::to_string(rank) + ": " + abort_reason);
  return g.result;
}

namespace {

// One message of an all-to-all as NCCL sends it: the protocol its size picks (LL at or below
// ll_threshold bytes, as NCCL_P2P_LL_THRESHOLD), that protocol's per-call latency, and the
// share of each route resource's rate its payload gets: LL's on every link (half of each
// 16-byte line is flags), Simple's NVLink (or GPU-to-GPU PCIe) and NIC efficiencies on
// those links, and the full rate on the PCIe hops of GPUDirect RDMA (pcie_bw is already an
// achieved rate).
struct A2aMessage {
  double base_latency = 0;
  std::vector<double> efficiency;  // by route resource
};
A2aMessage a2a_message(const sim::P2pModel& p, const sim::Route& route, double bytes) {
  A2aMessage m;
  const bool ll = bytes <= p.ll_threshold;
  m.base_latency = ll ? p.base_latency_ll : p.base_latency_simple;
  for (sim::LinkClass c : route.resource_links) {
    if (ll) m.efficiency.push_back(p.ll_efficiency);
    else if (c == sim::LinkClass::nic) m.efficiency.push_back(p.net_efficiency);
    else if (c == sim::LinkClass::pcie && route.inter_node) m.efficiency.push_back(1.0);
    else m.efficiency.push_back(p.intra_efficiency);
  }
  return m;
}

// NCCL's p2p schedule (src/init.cc, ncclP2pSchedule): members are grouped per node (nodes in
// order of first appearance, local ranks in member order) into groups of G ranks, G = the
// node's ranks on one node, or gcd(8, ranks per node) across nodes (NCCL_P2P_SCHEDULE_GROUP_SIZE,
// default NCCL_MAX_DEV_WORK_P2P_PER_BATCH = 8). In round k a member of group g with local
// index l sends to local index (l + delta) % G of group (g + gd) % groups and receives from
// (l - delta) % G of group (g - gd) % groups; gd runs over the group deltas in NCCL's
// quadratic order (x² + x)/2 mod 2^ceil(log2 groups), delta over 0..G-1. send(s, d): how many
// peers of d's kind (same node as s or not) s sends to before d, counting only peers that get
// bytes; recv(d, s) likewise on d's receive side.
struct A2aPositions {
  int m = 0;
  std::vector<int> send_pos, recv_pos;  // [s * m + d]
  int send(int s, int d) const { return send_pos[static_cast<std::size_t>(s * m + d)]; }
  int recv(int d, int s) const { return recv_pos[static_cast<std::size_t>(d * m + s)]; }
};
template <class Bytes>
A2aPositions a2a_positions(const std::vector<int>& node_of, const Bytes& bytes) {
  const int m = static_cast<int>(node_of.size());
  A2aPositions out;
  out.m = m;
  out.send_pos.assign(static_cast<std::size_t>(m) * static_cast<std::size_t>(m), 0);
  out.recv_pos = out.send_pos;
  // Nodes in order of first appearance; each node's members in member order.
  std::vector<int> nodes;
  std::vector<std::vector<int>> locals;
  std::vector<int> node_index(static_cast<std::size_t>(m)), local_index(static_cast<std::size_t>(m));
  for (int i = 0; i < m; ++i) {
    const auto it = std::find(nodes.begin(), nodes.end(), node_of[static_cast<std::size_t>(i)]);
    const int n = static_cast<int>(it - nodes.begin());
    if (it == nodes.end()) {
      nodes.push_back(node_of[static_cast<std::size_t>(i)]);
      locals.emplace_back();
    }
    node_index[static_cast<std::size_t>(i)] = n;
    local_index[static_cast<std::size_t>(i)] = static_cast<int>(locals[static_cast<std::size_t>(n)].size());
    locals[static_cast<std::size_t>(n)].push_back(i);
  }
  const int n_nodes = static_cast<int>(nodes.size());
  int group = n_nodes > 1 ? 8 : static_cast<int>(locals[0].size());
  for (const auto& l : locals) {
    const int lr = static_cast<int>(l.size());
    if (lr % group != 0 || lr < group) group = std::gcd(group, lr);
  }
  // Groups in node order: group -> (node, first local index).
  std::vector<std::pair<int, int>> groups;
  std::vector<int> first_group(static_cast<std::size_t>(n_nodes));
  for (int n = 0; n < n_nodes; ++n) {
    first_group[static_cast<std::size_t>(n)] = static_cast<int>(groups.size());
    for (int g = 0; g * group < static_cast<int>(locals[static_cast<std::size_t>(n)].size()); ++g) groups.emplace_back(n, g * group);
  }
  const int n_groups = static_cast<int>(groups.size());
  int pow2 = 1;
  while (pow2 < n_groups) pow2 *= 2;
  std::vector<int> deltas;  // group deltas in NCCL's order
  for (std::uint32_t round = 0, delta = 0; round < static_cast<std::uint32_t>(pow2);) {
    if (delta < static_cast<std::uint32_t>(n_groups)) deltas.push_back(static_cast<int>(delta));
    round += 1;
    delta = (delta + round) & static_cast<std::uint32_t>(pow2 - 1);
  }
  const auto member = [&](int g, int local) {
    const auto& [n, off] = groups[static_cast<std::size_t>(g)];
    return locals[static_cast<std::size_t>(n)][static_cast<std::size_t>(off + local)];
  };
  for (int i = 0; i < m; ++i) {
    const int n = node_index[static_cast<std::size_t>(i)], li = local_index[static_cast<std::size_t>(i)];
    const int my_group = first_group[static_cast<std::size_t>(n)] + li / group, local = li % group;
    int sent[2] = {0, 0}, received[2] = {0, 0};  // [remote]
    for (int gd : deltas)
      for (int delta = 0; delta < group; ++delta) {
        const int to = member((my_group + gd) % n_groups, (local + delta) % group);
        const int from = member((my_group - gd + n_groups) % n_groups, (local - delta + group) % group);
        if (to != i && bytes(i, to) > 0) {
          const int remote = node_of[static_cast<std::size_t>(to)] != node_of[static_cast<std::size_t>(i)] ? 1 : 0;
          out.send_pos[static_cast<std::size_t>(i * m + to)] = sent[remote]++;
        }
        if (from != i && bytes(from, i) > 0) {
          const int remote = node_of[static_cast<std::size_t>(from)] != node_of[static_cast<std::size_t>(i)] ? 1 : 0;
          out.recv_pos[static_cast<std::size_t>(i * m + from)] = received[remote]++;
        }
      }
  }
  return out;
}

}  // namespace

void SimCluster::Impl::evaluate() {
  sim::Engine e;
  // The cluster's interference matrix, factor[victim][aggressor] (sim/cluster.hpp).
  constexpr sim::WorkClass kClasses[3] = {sim::WorkClass::compute, sim::WorkClass::comm, sim::WorkClass::memcpy};
  for (int v = 0; v < 3; ++v)
    for (int a = 0; a < 3; ++a)
      if (a != v) e.set_interference(kClasses[v], kClasses[a], opt.cluster.interference.factor[v][a]);
  sim::Topology topo(opt.cluster, e, opt.profile ? &*opt.profile : nullptr);
  // Global ids: rank-major in issue order, then flows in instance-key order: deterministic.
  std::vector<int> offset(static_cast<std::size_t>(n), 0);
  int total = 0;
  for (int r = 0; r < n; ++r) {
    offset[static_cast<std::size_t>(r)] = total;
    total += static_cast<int>(backends[static_cast<std::size_t>(r)]->tasks().size());
  }
  auto gid = [&](int r, int local) { return offset[static_cast<std::size_t>(r)] + local; };

  // Flows first (their ids follow the ranks' tasks), so that each rank's `done` task can be
  // added with its flows among its dependencies.
  std::vector<sim::Task> flows;
  std::map<int, std::vector<int>> done_deps;  // global id of a done task -> flow ids
  std::vector<sim::LinkBytes> sent(static_cast<std::size_t>(n));  // by the sending world rank
  std::vector<std::map<std::string, sim::LinkBytes>> sent_by(static_cast<std::size_t>(n));  // and by collective
  const char* coll = "";  // the collective whose flows are being made
  // src, dst: world ranks; deps: the tasks the flow waits for; returns its task id. `nccl`:
  // price the flow as NCCL runs it: its protocol's per-call latency and link efficiencies, the
  // protocol chosen by `message_bytes` (docs/PERFORMANCE.md, "All-to-all as NCCL runs it");
  // `hops` route latencies (a ring's steps) plus `extra_latency` (an all-to-all's per-peer term).
  const sim::ExchangeFit* self_exchange = nullptr;  // set for a one-rank all-to-all (below)
  auto add_flow = [&](int src, int dst, double bytes, std::vector<int> deps, double extra_latency,
                      const sim::P2pModel* nccl, double hops, double message_bytes) {
    sim::Task f;
    f.name = "flow";
    f.rank = src;
    f.gpu = src;
    f.cls = sim::WorkClass::comm;
    if (src == dst && self_exchange) {
      // A one-rank all-to-all: the exchange with itself the calibration measured (t = latency +
      // bytes / bw, bytes one way).
      f.latency = self_exchange->latency;
      f.demands = {{topo.hbm(src), bytes * opt.cluster.gpu.hbm_bw / (self_exchange->bw * topo.calibration_hbm_scale())}};
    } else if (src == dst) {
      f.demands = {{topo.hbm(src), 2.0 * bytes}};
    } else {
      const sim::Route route = topo.p2p(src, dst);
      f.latency = hops * route.latency + extra_latency;
      if (nccl) {
        const A2aMessage msg = a2a_message(*nccl, route, message_bytes);
        f.latency += msg.base_latency;
        for (std::size_t i = 0; i < route.resources.size(); ++i)
          f.demands.push_back({route.resources[i], bytes / msg.efficiency[i]});
      } else {
        for (int res : route.resources) f.demands.push_back({res, bytes});
      }
      for (sim::LinkClass c : route.links) {
        sent[static_cast<std::size_t>(src)][c] += bytes;
        sent_by[static_cast<std::size_t>(src)][coll][c] += bytes;
      }
    }
    f.deps = std::move(deps);
    const int id = total + static_cast<int>(flows.size());
    flows.push_back(std::move(f));
    return id;
  };
  // One message between two members: starts when both arrived, each leaves after it.
  auto flow = [&](int src, int dst, double bytes, int arrive_src, int arrive_dst, double extra_latency,
                  int done_src, int done_dst, const sim::P2pModel* nccl = nullptr) {
    const int id = add_flow(src, dst, bytes, {arrive_src, arrive_dst}, extra_latency, nccl, 1.0, bytes);
    done_deps[done_src].push_back(id);
    if (done_dst != done_src) done_deps[done_dst].push_back(id);
  };
  // Instances in key order; within one, members are numbered in the communicator and mapped
  // to world ranks (w) for the topology. (No structured binding: the lambdas below capture `in`,
  // which clang accepts only from version 16, and the fuzz build uses clang.)
  for (auto& entry : instances) {
    const auto& key = entry.first;
    auto& in = entry.second;
    const int m = static_cast<int>(in.members.size());
    const int expected = in.kind == CollKind::p2p ? 2 : m;
    if (static_cast<int>(in.parts.size()) != expected)
      throw CommError("collective " + key + " was called by " + std::to_string(in.parts.size()) + " of " +
                      std::to_string(expected) + " ranks before a barrier: every rank must issue the same collectives");
    std::vector<const Participation*> by_member(static_cast<std::size_t>(m), nullptr);
    for (const auto& p : in.parts) by_member[static_cast<std::size_t>(p.member)] = &p;
    auto w = [&](int i) { return in.members[static_cast<std::size_t>(i)]; };
    auto part = [&](int i) { return by_member[static_cast<std::size_t>(i)]; };
    auto arrive = [&](int i) { return gid(w(i), part(i)->arrive); };
    auto done = [&](int i) { return gid(w(i), part(i)->done); };
    coll = collective_name(in.kind);
    self_exchange = nullptr;
    if (in.kind == CollKind::p2p) {
      const int s = in.p2p_src, d = in.p2p_dst;
      flow(w(s), w(d), part(s)->bytes, arrive(s), arrive(d), 0.0, done(s), done(d));
    } else if (in.kind == CollKind::all_to_all_v) {
      // NCCL's rounds: each member posts its messages in its schedule's order; a message waits
      // for the peers of its kind (intra-node or remote) posted before it, on the sender's
      // side and on the receiver's, whichever is later.
      const sim::P2pModel& nccl = opt.cluster.node.p2p;
      const auto bytes = [&](int s, int d) { return part(s)->bytes_to[static_cast<std::size_t>(d)]; };
      std::vector<int> node_of(static_cast<std::size_t>(m));
      for (int i = 0; i < m; ++i) node_of[static_cast<std::size_t>(i)] = opt.cluster.node_of(w(i));
      const A2aPositions pos = a2a_positions(node_of, bytes);
      // A communicator of one rank: the calibration's fitted exchange with itself, where it was
      // measured on a world of one (docs/PERFORMANCE.md, "Kernel rates in the sim").
      if (const sim::KernelRates* k = topo.kernel_rates(); k && m == 1 && k->exchange &&
          std::find(k->exchange->ranks.begin(), k->exchange->ranks.end(), 1) != k->exchange->ranks.end())
        self_exchange = &*k->exchange;
      for (int s = 0; s < m; ++s)
        for (int d = 0; d < m; ++d) {
          const double b = bytes(s, d);
          if (!(b > 0)) continue;
          const bool remote = node_of[static_cast<std::size_t>(s)] != node_of[static_cast<std::size_t>(d)];
          const double per_peer = remote ? nccl.net_peer_overhead : nccl.intra_peer_overhead;
          const double extra = s == d ? 0.0 : per_peer * std::max(pos.send(s, d), pos.recv(d, s));
          flow(w(s), w(d), b, arrive(s), arrive(d), extra, done(s), done(d), &nccl);
        }
    } else if (in.kind == CollKind::barrier) {
      // One empty task after every member's arrival, before every member's departure.
      sim::Task j;
      j.name = "barrier";
      for (int i = 0; i < m; ++i) j.deps.push_back(arrive(i));
      const int id = total + static_cast<int>(flows.size());
      flows.push_back(std::move(j));
      for (int i = 0; i < m; ++i) done_deps[done(i)].push_back(id);
    } else if (m > 1) {
      // Ring algorithms (NCCL's for these sizes): m-1 steps (2(m-1) for all-reduce), each
      // member sends one chunk per step to its successor in the communicator's rank order;
      // modelled as one flow per ring edge. Every step waits for the one before it around the
      // whole ring, so the flows start once every member has arrived (a join task) and every
      // member leaves when the last of them ends. A flow is priced as NCCL runs it: one
      // collective's base latency plus one hop latency per step, the chunk's protocol (LL at
      // or below the LL threshold) and its share of each link's rate (the node's p2p
      // efficiencies, as for the all-to-all). An edge between two nodes is striped: NCCL runs
      // one ring per channel, and on a rail-optimised node each channel leaves the node through
      // another GPU's NIC, so the edge's bytes are split over the communicator's members on the
      // two nodes, paired in order, up to the node's NICs.
      const double steps = (in.kind == CollKind::all_reduce ? 2.0 : 1.0) * (m - 1);
      const sim::P2pModel& nccl = opt.cluster.node.p2p;
      sim::Task j;
      j.name = "ring.join";
      for (int i = 0; i < m; ++i) j.deps.push_back(arrive(i));
      const int join_id = total + static_cast<int>(flows.size());
      flows.push_back(std::move(j));
      std::map<int, std::vector<int>> on_node;  // node -> members on it, in communicator order
      for (int i = 0; i < m; ++i) on_node[opt.cluster.node_of(w(i))].push_back(i);
      std::vector<int> ring;  // the flows' task ids
      const auto ring_flow = [&](int src, int dst, double bytes) {
        // The protocol by the chunk a step moves; one route latency per step.
        ring.push_back(add_flow(src, dst, bytes, {join_id}, 0.0, &nccl, steps, part(0)->bytes));
      };
      for (int s = 0; s < m; ++s) {
        const int d = (s + 1) % m;
        const double bytes = steps * part(s)->bytes;
        const int ns = opt.cluster.node_of(w(s)), nd = opt.cluster.node_of(w(d));
        if (ns == nd) {
          ring_flow(w(s), w(d), bytes);
          continue;
        }
        const std::vector<int>& a = on_node[ns];
        const std::vector<int>& b = on_node[nd];
        const std::size_t k = std::max<std::size_t>(
            std::min({a.size(), b.size(), static_cast<std::size_t>(std::max(opt.cluster.node.nics, 1))}), 1);
        for (std::size_t c = 0; c < k; ++c) ring_flow(w(a[c]), w(b[c]), bytes / static_cast<double>(k));
      }
      for (int id : ring)
        for (int i = 0; i < m; ++i) done_deps[done(i)].push_back(id);
    }
  }

  for (int r = 0; r < n; ++r) {
    const auto& tasks = backends[static_cast<std::size_t>(r)]->tasks();
    for (std::size_t i = 0; i < tasks.size(); ++i) {
      const LocalTask& t = tasks[i];
      sim::Task g;
      g.name = t.name;
      g.rank = r;
      g.gpu = r;
      g.cls = t.cls;
      g.latency = t.latency;
      g.demands = t.demands;
      for (int d : t.deps) g.deps.push_back(gid(r, d));
      if (auto it = done_deps.find(gid(r, static_cast<int>(i))); it != done_deps.end())
        g.deps.insert(g.deps.end(), it->second.begin(), it->second.end());
      e.add_task(std::move(g));
    }
  }
  for (auto& f : flows) e.add_task(std::move(f));
  bool quiet = true, untimed = true;
  for (const auto& b : backends) {
    quiet = quiet && b->quiescent();
    untimed = untimed && b->untimed();
  }
  // Work every rank marked untimed (Backend::untimed: the warm-up's last stretch, whose times
  // no figure reads) is not priced: it takes no virtual time, and the next epoch starts where
  // this one did. Only a quiet world can skip it, so nothing later depends on its times.
  const bool priced = !(untimed && quiet);
  if (priced) e.run();

  // Every rank leaves the barrier at the latest host time (0 when unpriced).
  double barrier = 0;
  if (priced)
    for (int r = 0; r < n; ++r) {
      const int h = backends[static_cast<std::size_t>(r)]->host_task();
      if (h >= 0) barrier = std::max(barrier, e.task(gid(r, h)).end);
    }
  for (int r = 0; r < n; ++r) {
    const auto& tasks = backends[static_cast<std::size_t>(r)]->tasks();
    std::vector<double> start(tasks.size()), end(tasks.size());  // all 0 when unpriced
    if (priced)
      for (std::size_t i = 0; i < tasks.size(); ++i) {
        start[i] = e.task(gid(r, static_cast<int>(i))).start;
        end[i] = e.task(gid(r, static_cast<int>(i))).end;
      }
    backends[static_cast<std::size_t>(r)]->commit(start, end, epoch_base, quiet);
  }
  if (quiet) {
    for (int r = 0; r < n; ++r)
      backends[static_cast<std::size_t>(r)]->add_link_bytes(sent[static_cast<std::size_t>(r)], sent_by[static_cast<std::size_t>(r)]);
    epoch_base += barrier;
    ++epoch;
    instances.clear();
    for (auto& b : backends) b->new_epoch(epoch_base);
  }
}

// ============================================================================================
// SimCluster
// ============================================================================================

SimCluster::SimCluster(SimOptions options) : impl_(std::make_unique<Impl>()) {
  impl_->opt = std::move(options);
  const int world = impl_->opt.cluster.world_size();
  impl_->n = impl_->opt.ranks > 0 ? impl_->opt.ranks : world;
  if (impl_->n > world)
    throw ConfigError("--ranks " + std::to_string(impl_->n) + " exceeds the " + std::to_string(world) +
                      " GPUs of cluster " + impl_->opt.cluster.name);
  for (int r = 0; r < impl_->n; ++r) impl_->backends.push_back(std::make_unique<SimBackendImpl>(*impl_, r));
}

SimCluster::~SimCluster() = default;
int SimCluster::size() const { return impl_->n; }
const SimOptions& SimCluster::options() const { return impl_->opt; }
Backend& SimCluster::backend(int rank) { return *impl_->backends.at(static_cast<std::size_t>(rank)); }
sim::LinkBytes SimCluster::link_bytes(int rank) const { return impl_->backends.at(static_cast<std::size_t>(rank))->link_bytes(); }

sim::LinkBytes sim_link_bytes(const Backend& b) {
  const auto* s = dynamic_cast<const SimBackendImpl*>(&b);
  if (!s) throw Unsupported("link bytes are recorded by the sim backend only, not by " + b.name());
  return s->link_bytes();
}
std::map<std::string, sim::LinkBytes> sim_link_bytes_by_collective(const Backend& b) {
  const auto* s = dynamic_cast<const SimBackendImpl*>(&b);
  if (!s) throw Unsupported("link bytes are recorded by the sim backend only, not by " + b.name());
  return s->link_bytes_by_collective();
}
std::string SimCluster::calibration() const { return impl_->opt.profile ? impl_->opt.profile->name : "datasheet"; }

void SimCluster::run(const std::function<void(Backend&, Communicator&)>& program) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(impl_->n));
  std::vector<std::thread> threads;
  for (int r = 0; r < impl_->n; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::vector<int> everyone(static_cast<std::size_t>(impl_->n));
        std::iota(everyone.begin(), everyone.end(), 0);
        SimCommunicator world(*impl_, *impl_->backends[static_cast<std::size_t>(r)], "world", std::move(everyone));
        program(*impl_->backends[static_cast<std::size_t>(r)], world);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
        std::lock_guard lk(impl_->mu);
        if (!impl_->aborted) {
          impl_->aborted = true;
          impl_->abort_reason = "stopped because simulated rank " + std::to_string(r) + " failed";
        }
        impl_->cv.notify_all();
      }
    });
  }
  for (auto& t : threads) t.join();
  // The first failure that is not a consequence of another rank's.
  for (auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const CommError& ce) {
      if (std::string(ce.what()).find("stopped because simulated rank") != std::string::npos) continue;
      throw;
    }
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace moelab
