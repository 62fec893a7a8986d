// harness/sim/cluster.cpp — loading cluster models and calibration profiles, and the
// topology that maps a cluster onto the event engine's resources (see cluster.hpp).
//
// The files are data with a source for every figure (experiments/hardware/). All numbers
// in them are SI: FLOP/s, bytes, bytes/s per direction, seconds — the same units as the
// structs, so a file, the struct and to_json() read alike and round-trip exactly. Each
// figure lies in a physical range (harness/config/limits.hpp: FLOP/s, bandwidths, memory,
// latencies, fractions), so that every time the simulation derives stays finite. Every
// problem is a ConfigError of one line naming the file, the field path and the value
// (harness/config/json_fields.hpp). Fields that the model would ignore for a node's kind
// (nvlink_bw on a PCIe node, nic_bw on a node without NICs) are rejected too: a figure
// that silently does nothing is a figure someone believes is being used.
// Formulas and routes: docs/PERFORMANCE.md, "Cluster models and the cost of each op".
// Tested by harness/tests/sim_cluster_test.cpp.
#include "harness/sim/cluster.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <stdexcept>

#include "harness/config/json_fields.hpp"
#include "harness/config/limits.hpp"
#include "harness/runtime/backend.hpp"
#include "harness/runtime/error.hpp"

namespace moelab::sim {

namespace fs = std::filesystem;
using nlohmann::json;
using json_fields::Fields;
using json_fields::fail;
using json_fields::join;
using json_fields::quote;
using json_fields::show;

namespace {

// A catalogue reference is a name ("dgx-a100x8", "a100-sxm4"); one with a '/' or ending in
// ".json" is a path (load_cluster, load_gemm_calibration, and to_json writing one back).
bool is_path_ref(const std::string& ref) {
  return ref.find('/') != std::string::npos || (ref.size() > 5 && ref.ends_with(".json"));
}

constexpr const char* kGpusSchema = "moelab.gpus/1";
constexpr const char* kNodesSchema = "moelab.nodes/1";
constexpr const char* kClusterSchema = "moelab.cluster/1";
constexpr const char* kProfileSchema = "moelab.profile/1";
constexpr const char* kGemmCalibrationSchema = "moelab.gemm_calibration/1";
// NCCL's LL protocol carries a message in 8-byte lines through buffers of at most a few MiB
// (src/init.cc DEFAULT_LL_BUFFSIZE); a threshold above 1 GiB per peer is a typing error.
constexpr double kMaxLlThreshold = 1073741824.0;

// ---- field readers with the ranges the model needs ------------------------------------

void check_schema(const Fields& f, const char* expected, bool required) {
  if (!required && !f.find("schema")) return;
  const std::string s = f.string("schema");
  if (s != expected) f.bad_value("schema", std::string("is not ") + quote(expected));
}

// A figure in its physical range [lo, hi] (harness/config/limits.hpp); `unit` for the message.
// The sign is checked first and said plainly ("must be > 0"), the magnitude then.
enum class Sign { positive, non_negative, fraction };
double in_range(const Fields& f, const char* key, Sign sign, double lo, double hi, const char* unit) {
  const double v = f.number(key);
  if (sign == Sign::positive && !(v > 0)) f.bad_value(key, "must be > 0");
  if (sign == Sign::non_negative && !(v >= 0)) f.bad_value(key, "must be >= 0");
  if (sign == Sign::fraction && !(v > 0 && v <= 1)) f.bad_value(key, "must be in (0, 1]");
  if (!(v >= lo && v <= hi))
    f.bad_value(key, std::string("is outside [") + json_fields::number_text(lo) + ", " + json_fields::number_text(hi) +
                         "] " + unit + " (see harness/config/limits.hpp)");
  return v;
}
double flops(const Fields& f, const char* key) {
  return in_range(f, key, Sign::positive, limits::kMinFlops, limits::kMaxFlops, "FLOP/s");
}
double bandwidth(const Fields& f, const char* key) {
  return in_range(f, key, Sign::positive, limits::kMinBandwidth, limits::kMaxBandwidth, "bytes/s");
}
double memory(const Fields& f, const char* key) {
  return in_range(f, key, Sign::positive, limits::kMinMemoryBytes, limits::kMaxMemoryBytes, "bytes");
}
double seconds(const Fields& f, const char* key) {
  return in_range(f, key, Sign::positive, limits::kMinSeconds, limits::kMaxSeconds, "s");
}
double latency(const Fields& f, const char* key) {
  return in_range(f, key, Sign::non_negative, 0.0, limits::kMaxLatency, "s");
}
double latency_or(const Fields& f, const char* key, double fallback) {
  return f.find(key) ? latency(f, key) : fallback;
}
// A measured rate of a profile: 0 or absent means not measured.
double measured_bandwidth_or_zero(const Fields& f, const char* key) {
  if (!f.find(key)) return 0.0;
  if (f.number(key) == 0) return 0.0;
  return in_range(f, key, Sign::non_negative, limits::kMinBandwidth, limits::kMaxBandwidth, "bytes/s");
}
// An efficiency or interference factor.
double fraction_or(const Fields& f, const char* key, double fallback) {
  return f.find(key) ? in_range(f, key, Sign::fraction, limits::kMinFraction, 1.0, "(a fraction)") : fallback;
}
// An array field of objects: each element's Fields (prefix "key[i].") handed to `each`.
template <class Each>
void for_each_object(const Fields& f, const char* key, const char* expected, Each each) {
  const json* a = f.find(key);
  if (!a) return;
  if (!a->is_array()) f.wrong_type(key, *a, expected);
  for (std::size_t i = 0; i < a->size(); ++i) {
    const json& e = (*a)[i];
    const std::string at = f.path(key) + "[" + std::to_string(i) + "]";
    if (!e.is_object()) fail(f.origin(), at + ": expected an object, got " + show(e));
    each(e, at + ".");
  }
}

// A field that has no meaning for this object; `why` says when it would.
void reject_if_present(const Fields& f, const char* key, const std::string& why) {
  if (f.find(key)) fail(f.origin(), f.path(key) + " = " + show(*f.find(key)) + " is " + why);
}

std::string stem_of(const std::string& path) { return fs::path(path).stem().string(); }

// ---- the catalogue ---------------------------------------------------------------------

// A catalogue file (gpus.json or nodes.json): {"schema", "description", "<section>": {name: entry}}.
struct Catalogue {
  std::string origin;
  json doc;
  const json* entries = nullptr;

  Catalogue(const Catalogue&) = delete;  // `entries` points into `doc`
  Catalogue& operator=(const Catalogue&) = delete;
  Catalogue(const std::string& path, const char* schema, const char* section) : origin(path) {
    doc = json_fields::read_file(path, std::string(section) == "gpus" ? "GPU catalogue" : "node catalogue");
    if (!doc.is_object()) fail(origin, "expected a JSON object at the top level, got " + show(doc));
    Fields f(doc, origin, "", {"schema", "description", section});
    check_schema(f, schema, true);
    (void)f.string_or("description", "");
    entries = &f.require(section);
    if (!entries->is_object()) f.wrong_type(section, *entries, "an object of named entries");
  }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [k, v] : entries->items()) out.push_back(k);
    return out;
  }
};

std::string hardware_dir() { return (fs::path(experiments_dir()) / "hardware").string(); }

GpuSpec parse_gpu(const json& j, const std::string& origin, const std::string& prefix, const std::string* key_name) {
  const std::string obj = prefix.substr(0, prefix.size() - 1);
  if (!j.is_object()) fail(origin, obj + ": expected an object, got " + show(j));
  std::vector<std::string> known = {"description", "flops_bf16", "flops_tf32", "flops_fp32",
                                    "memory_bytes", "hbm_bw", "source"};
  if (!key_name) known.insert(known.begin(), "name");  // an inline GPU names itself
  Fields f(j, origin, prefix, known);
  GpuSpec g;
  g.name = key_name ? *key_name : f.string("name");
  (void)f.string_or("description", "");
  g.flops_bf16 = flops(f, "flops_bf16");
  g.flops_tf32 = flops(f, "flops_tf32");
  g.flops_fp32 = flops(f, "flops_fp32");
  g.memory_bytes = memory(f, "memory_bytes");
  g.hbm_bw = bandwidth(f, "hbm_bw");
  g.source = f.string("source");
  return g;
}

// The GPU a node names: a catalogue name, or an inline object (what to_json writes).
GpuSpec resolve_gpu(const Fields& node, const json& v) {
  if (v.is_object()) return parse_gpu(v, node.origin(), node.path("gpu") + ".", nullptr);
  if (!v.is_string()) node.wrong_type("gpu", v, "a GPU name or a GPU object");
  const std::string name = v.get<std::string>();
  const Catalogue cat((fs::path(hardware_dir()) / "gpus.json").string(), kGpusSchema, "gpus");
  auto it = cat.entries->find(name);
  if (it == cat.entries->end()) {
    std::string msg = node.path("gpu") + " = " + show(v) + " is not a GPU of " + cat.origin;
    const std::vector<std::string> known = cat.names();
    if (const std::string best = json_fields::closest(name, known); !best.empty())
      msg += " (did you mean " + quote(best) + "?)";
    fail(node.origin(), msg + " (known GPUs: " + join(known) + ")");
  }
  return parse_gpu(*it, cat.origin, "gpus." + name + ".", &name);
}

// A "p2p" object: NCCL's all-to-all terms. In a node every figure is required (each has its
// source); in a cluster file (`all = false`) any subset overrides the node's.
P2pModel parse_p2p(const json& j, const std::string& origin, const std::string& prefix, P2pModel p, bool all) {
  Fields f(j, origin, prefix,
           {"base_latency_simple", "base_latency_ll", "ll_threshold", "ll_efficiency", "intra_efficiency",
            "net_efficiency", "intra_peer_overhead", "net_peer_overhead", "source"});
  const auto lat = [&](const char* k, double& v) {
    if (all || f.find(k)) v = latency(f, k);
  };
  const auto frac = [&](const char* k, double& v) {
    if (all || f.find(k)) v = in_range(f, k, Sign::fraction, limits::kMinFraction, 1.0, "(a fraction of the link's rate)");
  };
  lat("base_latency_simple", p.base_latency_simple);
  lat("base_latency_ll", p.base_latency_ll);
  if (all || f.find("ll_threshold"))
    p.ll_threshold = in_range(f, "ll_threshold", Sign::non_negative, 0.0, kMaxLlThreshold, "bytes per peer");
  frac("ll_efficiency", p.ll_efficiency);
  frac("intra_efficiency", p.intra_efficiency);
  frac("net_efficiency", p.net_efficiency);
  lat("intra_peer_overhead", p.intra_peer_overhead);
  lat("net_peer_overhead", p.net_peer_overhead);
  p.source = f.string("source");
  return p;
}

NodeSpec parse_node(const json& j, const std::string& origin, const std::string& prefix, const std::string* key_name,
                    GpuSpec& gpu_out) {
  const std::string obj = prefix.substr(0, prefix.size() - 1);
  if (!j.is_object()) fail(origin, obj + ": expected an object, got " + show(j));
  std::vector<std::string> known = {"description", "gpu", "gpus", "intra", "nvlink_bw", "nvlink_latency",
                                    "gpus_per_pcie_switch", "pcie_bw", "pcie_switch_uplink_bw", "pcie_latency",
                                    "nics", "nic_bw", "nic_latency", "host_memory_bytes", "host_copy_bw", "p2p", "source"};
  if (!key_name) known.insert(known.begin(), "name");
  Fields f(j, origin, prefix, known);
  NodeSpec n;
  n.name = key_name ? *key_name : f.string("name");
  (void)f.string_or("description", "");
  n.gpus = static_cast<int>(f.integer("gpus", 1, limits::kMaxGpusPerNode));
  (void)f.require("intra");
  n.intra = f.choice_or("intra", n.intra, {"nvswitch", "pcie"});
  const std::string only_nvswitch = "only used with intra = \"nvswitch\" (this node has intra = \"pcie\")";
  const auto pcie_switches = [&] {
    n.gpus_per_pcie_switch = static_cast<int>(f.integer("gpus_per_pcie_switch", 1, limits::kMaxGpusPerNode));
    if (n.gpus % n.gpus_per_pcie_switch != 0)
      fail(origin, f.path("gpus") + " = " + std::to_string(n.gpus) + " is not divisible by " +
                       f.path("gpus_per_pcie_switch") + " = " + std::to_string(n.gpus_per_pcie_switch) +
                       " (every PCIe switch holds the same number of GPUs)");
    n.pcie_bw = bandwidth(f, "pcie_bw");
    n.pcie_switch_uplink_bw = bandwidth(f, "pcie_switch_uplink_bw");
  };
  if (n.intra == "nvswitch") {
    n.nvlink_bw = bandwidth(f, "nvlink_bw");
    n.nvlink_latency = latency(f, "nvlink_latency");
    // Optional on an NVSwitch node: the PCIe switches its GPUs and NICs share (all three
    // fields or none).
    const char* keys[] = {"gpus_per_pcie_switch", "pcie_bw", "pcie_switch_uplink_bw"};
    int given = 0;
    for (const char* k : keys) given += f.find(k) ? 1 : 0;
    if (given > 0) {
      for (const char* k : keys)
        if (!f.find(k))
          fail(origin, f.path(k) + " is missing: an NVSwitch node that models its PCIe switches needs all of "
                                   "gpus_per_pcie_switch, pcie_bw and pcie_switch_uplink_bw");
      pcie_switches();
    }
  } else {
    for (const char* k : {"nvlink_bw", "nvlink_latency"}) reject_if_present(f, k, only_nvswitch);
    pcie_switches();
  }
  // Host copies cross PCIe on every node, so every node has a PCIe latency.
  n.pcie_latency = latency(f, "pcie_latency");
  n.nics = static_cast<int>(f.integer_or("nics", 0, 0, limits::kMaxNicsPerNode));
  if (n.nics > 0) {
    n.nic_bw = bandwidth(f, "nic_bw");
    n.nic_latency = latency(f, "nic_latency");
  } else {
    for (const char* k : {"nic_bw", "nic_latency"}) reject_if_present(f, k, "only used when nics > 0");
  }
  n.host_memory_bytes = memory(f, "host_memory_bytes");
  n.host_copy_bw = bandwidth(f, "host_copy_bw");
  if (const json* p = f.find("p2p")) {
    if (!p->is_object()) f.wrong_type("p2p", *p, "an object (docs/PERFORMANCE.md, \"All-to-all as NCCL runs it\")");
    n.p2p = parse_p2p(*p, origin, f.path("p2p") + ".", n.p2p, true);
  }
  n.source = f.string("source");
  // Last, so that the node's own fields are checked before another file is read.
  const json& g = f.require("gpu");
  gpu_out = resolve_gpu(f, g);
  n.gpu = gpu_out.name;
  return n;
}

NodeSpec resolve_node(const Fields& cluster, const json& v, GpuSpec& gpu_out) {
  if (v.is_object()) return parse_node(v, cluster.origin(), cluster.path("node") + ".", nullptr, gpu_out);
  if (!v.is_string()) cluster.wrong_type("node", v, "a node name or a node object");
  const std::string name = v.get<std::string>();
  const Catalogue cat((fs::path(hardware_dir()) / "nodes.json").string(), kNodesSchema, "nodes");
  auto it = cat.entries->find(name);
  if (it == cat.entries->end()) {
    std::string msg = cluster.path("node") + " = " + show(v) + " is not a node of " + cat.origin;
    const std::vector<std::string> known = cat.names();
    if (const std::string best = json_fields::closest(name, known); !best.empty())
      msg += " (did you mean " + quote(best) + "?)";
    fail(cluster.origin(), msg + " (known nodes: " + join(known) + ")");
  }
  return parse_node(*it, cat.origin, "nodes." + name + ".", &name, gpu_out);
}

std::string calibration_dir() { return (fs::path(hardware_dir()) / "calibration").string(); }

double half_dim(const Fields& f, const char* key) {
  return in_range(f, key, Sign::non_negative, 0.0, limits::kMaxGemmHalfDim, "(a GEMM dimension)");
}

GemmCurve parse_curve(const Fields& parent, const char* key) {
  const json& j = parent.require(key);
  if (!j.is_object()) parent.wrong_type(key, j, "an object {gemm_max, gemm_half_dim, source}");
  Fields f(j, parent.origin(), parent.path(key) + ".", {"gemm_max", "gemm_half_dim", "gemm_half_dim_range", "source"});
  GemmCurve c;
  c.gemm_max = in_range(f, "gemm_max", Sign::fraction, limits::kMinFraction, 1.0, "(a fraction)");
  c.gemm_half_dim = half_dim(f, "gemm_half_dim");
  if (const json* r = f.find("gemm_half_dim_range")) {
    if (!r->is_array() || r->size() != 2 || !(*r)[0].is_number() || !(*r)[1].is_number())
      f.wrong_type("gemm_half_dim_range", *r, "an array [lo, hi] of two numbers");
    c.half_dim_lo = (*r)[0].get<double>();
    c.half_dim_hi = (*r)[1].get<double>();
    if (!(c.half_dim_lo >= 0 && c.half_dim_lo <= c.gemm_half_dim && c.gemm_half_dim <= c.half_dim_hi &&
          c.half_dim_hi <= limits::kMaxGemmHalfDim))
      f.bad_value("gemm_half_dim_range", "must be [lo, hi] with 0 <= lo <= gemm_half_dim = " +
                                             json_fields::number_text(c.gemm_half_dim) + " <= hi");
  }
  c.source = f.string("source");
  return c;
}

// A batched path's curve: {gemm_max, gemm_half_dim, source?} (the "paths" object's source
// covers the curves that give none).
GemmCurve parse_path_curve(const Fields& parent, const char* key) {
  const json& j = parent.require(key);
  if (!j.is_object()) parent.wrong_type(key, j, "an object {gemm_max, gemm_half_dim}");
  Fields f(j, parent.origin(), parent.path(key) + ".", {"gemm_max", "gemm_half_dim", "source"});
  GemmCurve c;
  c.gemm_max = in_range(f, "gemm_max", Sign::fraction, limits::kMinFraction, 1.0, "(a fraction)");
  c.gemm_half_dim = half_dim(f, "gemm_half_dim");
  c.source = f.string_or("source", "");
  return c;
}

// "paths.<path>": {"bf16", "fp32", "tf32"}, each optional (absent: no curve of that precision).
PathCurves parse_path_curves(const Fields& paths, const char* key) {
  PathCurves pc;
  const json* j = paths.find(key);
  if (!j) return pc;
  if (!j->is_object()) paths.wrong_type(key, *j, "an object {bf16, fp32, tf32} of curves");
  Fields f(*j, paths.origin(), paths.path(key) + ".", {"bf16", "fp32", "tf32"});
  if (f.find("bf16")) pc.bf16 = parse_path_curve(f, "bf16");
  if (f.find("fp32")) pc.fp32 = parse_path_curve(f, "fp32");
  if (f.find("tf32")) pc.tf32 = parse_path_curve(f, "tf32");
  return pc;
}

// The optional per-path data: "paths" (the batched paths' curves) and "gemm_paths" (the
// crossover table, a profile's format), both or neither.
std::optional<GemmPathPricing> parse_path_pricing(const Fields& f) {
  const json* pj = f.find("paths");
  const json* tj = f.find("gemm_paths");
  if (!pj && !tj) return std::nullopt;
  if (!pj)
    fail(f.origin(), "missing field \"paths\" (the curves of the paths that \"gemm_paths\" chooses; the two come together)");
  if (!tj)
    fail(f.origin(), "missing field \"gemm_paths\" (the crossover table that chooses among the \"paths\"; the two come together)");
  if (!pj->is_object()) f.wrong_type("paths", *pj, "an object {source, strided_batched, grouped}");
  // "model" and "fit" say how the curves were made (scripts/fit_gemm_efficiency.py --profile).
  Fields pf(*pj, f.origin(), "paths.", {"source", "model", "strided_batched", "grouped", "fit"});
  GemmPathPricing pp;
  pp.source = pf.string("source");
  (void)pf.string_or("model", "");
  if (const json* x = pf.find("fit"); x && !x->is_object()) pf.wrong_type("fit", *x, "an object");
  pp.strided_batched = parse_path_curves(pf, "strided_batched");
  pp.grouped = parse_path_curves(pf, "grouped");
  pp.table = gemm_path_table_from_json(*tj, f.origin(), "gemm_paths.");
  return pp;
}

// A ratio of two measured rates (a kernel's rate over the memory rate): positive, not bounded by 1.
double rate_ratio(const Fields& f, const char* key) { return in_range(f, key, Sign::positive, 1e-6, 1e6, "(a ratio)"); }

// The optional "dispatch" object: {permute_bw, permute_mem_efficiency?, unpermute_bw,
// unpermute_mem_efficiency?, exchange?: {bw, latency, ranks}, source, fit?}; and
// "activations": {source, rates: [{activation, direction, dtype, elements_per_s}], fit?}
// (scripts/fit_gemm_efficiency.py --profile writes both).
KernelRates parse_kernel_rates(const Fields& f) {
  KernelRates k;
  if (const json* d = f.find("dispatch")) {
    if (!d->is_object()) f.wrong_type("dispatch", *d, "an object {permute_bw, unpermute_bw, exchange, source}");
    Fields df(*d, f.origin(), "dispatch.",
              {"permute_bw", "permute_mem_efficiency", "unpermute_bw", "unpermute_mem_efficiency", "exchange", "source",
               "fit"});
    if (df.find("permute_bw")) k.permute_bw = bandwidth(df, "permute_bw");
    if (df.find("unpermute_bw")) k.unpermute_bw = bandwidth(df, "unpermute_bw");
    for (const char* key : {"permute_mem_efficiency", "unpermute_mem_efficiency"})
      if (df.find(key)) (void)rate_ratio(df, key);
    if (const json* x = df.find("exchange")) {
      if (!x->is_object()) df.wrong_type("exchange", *x, "an object {bw, latency, ranks}");
      Fields ef(*x, f.origin(), "dispatch.exchange.", {"bw", "latency", "ranks"});
      ExchangeFit e;
      e.bw = bandwidth(ef, "bw");
      e.latency = latency(ef, "latency");
      const json& r = ef.require("ranks");
      if (!r.is_array() || r.empty()) ef.wrong_type("ranks", r, "a non-empty array of world sizes");
      for (const json& n : r) {
        if (!n.is_number_integer() || n.get<std::int64_t>() < 1 || n.get<std::int64_t>() > limits::kMaxWorld)
          ef.bad_value("ranks", "holds " + show(n) + ", not a world size in [1, " + std::to_string(limits::kMaxWorld) + "]");
        e.ranks.push_back(n.get<int>());
      }
      k.exchange = e;
    }
    if (const json* x = df.find("fit"); x && !x->is_object()) df.wrong_type("fit", *x, "an object");
    k.dispatch_source = df.string("source");
  }
  if (const json* a = f.find("activations")) {
    if (!a->is_object()) f.wrong_type("activations", *a, "an object {source, rates}");
    Fields af(*a, f.origin(), "activations.", {"source", "rates", "fit"});
    if (const json* x = af.find("fit"); x && !x->is_object()) af.wrong_type("fit", *x, "an object");
    (void)af.require("rates");
    for_each_object(af, "rates", "an array of {activation, direction, dtype, elements_per_s}",
                    [&](const json& e, const std::string& pre) {
                      Fields rf(e, f.origin(), pre, {"activation", "direction", "dtype", "elements_per_s"});
                      ActivationRate r;
                      (void)rf.require("activation");
                      r.activation = parse_activation(rf.choice_or("activation", "gelu", activation_names()));
                      (void)rf.require("direction");
                      r.backward = rf.choice_or("direction", "forward", {"forward", "backward"}) == "backward";
                      (void)rf.require("dtype");
                      r.dtype = parse_dtype(rf.choice_or("dtype", "fp32", {"fp32", "bf16"}));
                      r.elements_per_s = in_range(rf, "elements_per_s", Sign::positive, 1.0, limits::kMaxFlops, "elements/s");
                      if (k.activation(r.activation, r.backward, r.dtype))
                        fail(f.origin(), pre + "activation: a second rate for " + activation_name(r.activation) + " " +
                                             (r.backward ? "backward" : "forward") + " " + dtype_name(r.dtype));
                      k.activations.push_back(r);
                    });
    k.activations_source = af.string("source");
  }
  return k;
}

GemmCalibration parse_gemm_calibration(const json& j, const std::string& origin) {
  if (!j.is_object()) fail(origin, "expected a JSON object at the top level, got " + show(j));
  // "fit" and "interference_measured" record how the figures were made (residuals, data);
  // "copies", "interference" and "overheads" (scripts/fit_gemm_efficiency.py --profile) are
  // the device's other fitted figures, which a cluster file carries where the sim uses them
  // (scripts/validate_sim.sh writes one): the model reads none of them. It reads "dispatch"
  // and "activations" (KernelRates).
  Fields f(j, origin, "",
           {"schema", "name", "description", "device", "model", "launch_latency", "mem_bw", "hbm_bw", "curves", "paths",
            "gemm_paths", "fit", "interference_measured", "copies", "interference", "overheads", "dispatch",
            "activations", "source"});
  for (const char* k : {"copies", "interference", "overheads"})
    if (const json* x = f.find(k); x && !x->is_object()) f.wrong_type(k, *x, "an object");
  check_schema(f, kGemmCalibrationSchema, true);
  GemmCalibration c;
  c.origin = origin;
  c.name = f.string_or("name", stem_of(origin));
  c.device = f.string("device");
  (void)f.string_or("description", "");
  (void)f.string_or("model", "");
  c.launch_latency = latency(f, "launch_latency");
  c.mem_bw = bandwidth(f, "mem_bw");
  if (f.find("hbm_bw")) c.hbm_bw = bandwidth(f, "hbm_bw");
  const json& curves = f.require("curves");
  if (!curves.is_object()) f.wrong_type("curves", curves, "an object {bf16, fp32, tf32} of curves");
  // A precision the device was not measured in has no curve (a cpu profile: fp32 alone); a
  // GEMM of it is then an error naming the calibration (GemmCalibration::curve).
  Fields cf(curves, origin, "curves.", {"bf16", "fp32", "tf32"});
  if (curves.empty()) f.bad_value("curves", "needs a curve for at least one of bf16, fp32, tf32");
  if (cf.find("bf16")) c.bf16 = parse_curve(cf, "bf16");
  if (cf.find("fp32")) c.fp32 = parse_curve(cf, "fp32");
  if (cf.find("tf32")) c.tf32 = parse_curve(cf, "tf32");
  c.paths = parse_path_pricing(f);
  c.kernels = parse_kernel_rates(f);
  c.source = f.string("source");
  return c;
}

Efficiency parse_efficiency(const Fields& cluster) {
  Efficiency e;
  const json* j = cluster.find("efficiency");
  if (!j) return e;
  if (!j->is_object()) cluster.wrong_type("efficiency", *j, "an object");
  Fields f(*j, cluster.origin(), "efficiency.",
           {"calibration", "gemm_max", "gemm_half_dim", "mem", "launch_latency", "source"});
  if (const json* c = f.find("calibration")) {
    if (!c->is_string()) f.wrong_type("calibration", *c, "a calibration name or path");
    // The calibration replaces these figures: one that stayed would silently do nothing.
    for (const char* k : {"gemm_max", "gemm_half_dim", "launch_latency"})
      reject_if_present(f, k, "replaced by efficiency.calibration (remove it, or remove the calibration)");
    e.calibration_ref = c->get<std::string>();
    try {
      e.calibration = load_gemm_calibration(e.calibration_ref);
    } catch (const ConfigError& err) {
      fail(cluster.origin(), f.path("calibration") + " = " + show(*c) + ": " + err.what());
    }
    e.launch_latency = e.calibration->launch_latency;
  } else {
    e.gemm_max = fraction_or(f, "gemm_max", e.gemm_max);
    e.gemm_half_dim = f.find("gemm_half_dim") ? half_dim(f, "gemm_half_dim") : e.gemm_half_dim;
    e.launch_latency = latency_or(f, "launch_latency", e.launch_latency);
  }
  e.mem = fraction_or(f, "mem", e.mem);
  e.source = f.string_or("source", "");
  return e;
}

constexpr const char* kClassKeys[3] = {"compute", "comm", "memcpy"};

// Either the single-factor form {"sigma", "mu", "eta"} (one factor per victim) or the matrix
// {"<victim>": {"<aggressor>": factor}} (victims and aggressors: compute, comm, memcpy); a
// victim named in both forms is an error. Absent entries are 1 (no slowdown).
Interference parse_interference(const Fields& cluster) {
  Interference in;
  const json* j = cluster.find("interference");
  if (!j) return in;
  if (!j->is_object()) cluster.wrong_type("interference", *j, "an object");
  Fields f(*j, cluster.origin(), "interference.", {"sigma", "mu", "eta", "compute", "comm", "memcpy", "source"});
  const char* single[3] = {"sigma", "mu", "eta"};
  for (int v = 0; v < 3; ++v) {
    if (f.find(single[v])) {
      if (f.find(kClassKeys[v]))
        fail(cluster.origin(), f.path(single[v]) + " and " + f.path(kClassKeys[v]) +
                                   " both set the interference of " + kClassKeys[v] + ": give one");
      in.set_victim(v, fraction_or(f, single[v], 1.0));
    }
    if (const json* row = f.find(kClassKeys[v])) {
      if (!row->is_object())
        f.wrong_type(kClassKeys[v], *row, "an object {aggressor: factor} (aggressors: compute, comm, memcpy)");
      std::vector<std::string> aggressors;
      for (int a = 0; a < 3; ++a)
        if (a != v) aggressors.emplace_back(kClassKeys[a]);
      Fields rf(*row, cluster.origin(), f.path(kClassKeys[v]) + ".", aggressors);
      for (int a = 0; a < 3; ++a)
        if (a != v) in.set(v, a, fraction_or(rf, kClassKeys[a], 1.0));
    }
  }
  in.source = f.string_or("source", "");
  return in;
}

// The "host" object: {"sync_latency", "issue_overhead", "source"}, seconds; absent = 0.
HostModel parse_host(const Fields& cluster) {
  HostModel h;
  const json* j = cluster.find("host");
  if (!j) return h;
  if (!j->is_object()) cluster.wrong_type("host", *j, "an object {sync_latency, issue_overhead, source}");
  Fields f(*j, cluster.origin(), "host.", {"sync_latency", "issue_overhead", "source"});
  h.sync_latency = latency_or(f, "sync_latency", 0.0);
  h.issue_overhead = latency_or(f, "issue_overhead", 0.0);
  h.source = f.string_or("source", "");
  if (h.modelled() && h.source.empty())
    fail(cluster.origin(), "host.source is missing: a host time term needs its source or the sweep it belongs to");
  return h;
}

ClusterModel parse_cluster(const json& j, const std::string& origin) {
  if (!j.is_object()) fail(origin, "expected a JSON object at the top level, got " + show(j));
  Fields f(j, origin, "",
           {"schema", "name", "description", "node", "nodes", "fabric", "fabric_latency", "efficiency",
            "interference", "p2p", "host", "source"});
  check_schema(f, kClusterSchema, false);
  ClusterModel m;
  m.origin = origin;
  m.name = f.string_or("name", stem_of(origin));
  m.description = f.string_or("description", "");
  m.nodes = static_cast<int>(f.integer("nodes", 1, limits::kMaxNodes));
  m.fabric = f.choice_or("fabric", m.fabric, {"infiniband", "ethernet"});
  m.fabric_latency = latency_or(f, "fabric_latency", 0.0);
  m.efficiency = parse_efficiency(f);
  m.interference = parse_interference(f);
  m.host = parse_host(f);
  m.source = f.string("source");
  m.node = resolve_node(f, f.require("node"), m.gpu);
  // A cluster's "p2p" overrides the node's figures one by one (a fabric's own NCCL tuning).
  if (const json* p = f.find("p2p")) {
    if (!p->is_object()) f.wrong_type("p2p", *p, "an object of the node's p2p fields to override");
    m.node.p2p = parse_p2p(*p, origin, "p2p.", m.node.p2p, false);
  }
  // Every GPU becomes a simulated rank with its own resources (and thread): the world size
  // is bounded, and computed where it cannot wrap.
  if (const Checked world = Checked(m.nodes) * m.node.gpus; !world.ok() || world.value() > limits::kMaxWorld)
    fail(origin, "nodes × node.gpus = " + std::to_string(m.nodes) + " × " + std::to_string(m.node.gpus) +
                     " GPUs is more than " + std::to_string(limits::kMaxWorld) + " (see harness/config/limits.hpp)");
  if (m.nodes > 1 && m.node.nics == 0)
    fail(origin, "nodes = " + std::to_string(m.nodes) + " but node " + quote(m.node.name) +
                     " has no NICs (nics = 0): a multi-node cluster needs a node with nics > 0");
  return m;
}

json to_json(const GpuSpec& g) {
  return {{"name", g.name},
          {"flops_bf16", g.flops_bf16},
          {"flops_tf32", g.flops_tf32},
          {"flops_fp32", g.flops_fp32},
          {"memory_bytes", g.memory_bytes},
          {"hbm_bw", g.hbm_bw},
          {"source", g.source}};
}

// Only the fields that apply to the node's kind: load_cluster rejects the others.
json to_json(const NodeSpec& n, const GpuSpec& g) {
  json j = {{"name", n.name}, {"gpu", to_json(g)}, {"gpus", n.gpus}, {"intra", n.intra}};
  if (n.intra == "nvswitch") {
    j["nvlink_bw"] = n.nvlink_bw;
    j["nvlink_latency"] = n.nvlink_latency;
  }
  if (n.intra == "pcie" || n.pcie_switches()) {
    j["gpus_per_pcie_switch"] = n.gpus_per_pcie_switch;
    j["pcie_bw"] = n.pcie_bw;
    j["pcie_switch_uplink_bw"] = n.pcie_switch_uplink_bw;
  }
  j["pcie_latency"] = n.pcie_latency;
  j["nics"] = n.nics;
  if (n.nics > 0) {
    j["nic_bw"] = n.nic_bw;
    j["nic_latency"] = n.nic_latency;
  }
  j["host_memory_bytes"] = n.host_memory_bytes;
  j["host_copy_bw"] = n.host_copy_bw;
  if (!n.p2p.ideal())
    j["p2p"] = {{"base_latency_simple", n.p2p.base_latency_simple},
                {"base_latency_ll", n.p2p.base_latency_ll},
                {"ll_threshold", n.p2p.ll_threshold},
                {"ll_efficiency", n.p2p.ll_efficiency},
                {"intra_efficiency", n.p2p.intra_efficiency},
                {"net_efficiency", n.p2p.net_efficiency},
                {"intra_peer_overhead", n.p2p.intra_peer_overhead},
                {"net_peer_overhead", n.p2p.net_peer_overhead},
                {"source", n.p2p.source}};
  j["source"] = n.source;
  return j;
}

json to_json(const Efficiency& e) {
  json j = json::object();
  if (e.calibration) {
    // A catalogue calibration by its name (it resolves in any checkout, and a result file
    // holds no path of the machine that wrote it); one given by path, by its path.
    const std::string& ref = e.calibration_ref;
    j["calibration"] = !ref.empty() && !is_path_ref(ref) ? ref : e.calibration->origin;
  } else {
    j["gemm_max"] = e.gemm_max;
    j["gemm_half_dim"] = e.gemm_half_dim;
    j["launch_latency"] = e.launch_latency;
  }
  j["mem"] = e.mem;
  j["source"] = e.source;
  return j;
}

json to_json(const Interference& in) {
  json j = json::object();
  for (int v = 0; v < 3; ++v) {
    json row = json::object();
    for (int a = 0; a < 3; ++a)
      if (a != v) row[kClassKeys[a]] = in.factor[v][a];
    j[kClassKeys[v]] = row;
  }
  j["source"] = in.source;
  return j;
}

}  // namespace

void Interference::set(int victim, int aggressor, double f) {
  factor[victim][aggressor] = f;
  double lo = 1.0;
  for (int a = 0; a < 3; ++a)
    if (a != victim) lo = std::min(lo, factor[victim][a]);
  (victim == 0 ? sigma : victim == 1 ? mu : eta) = lo;
}

void Interference::set_victim(int victim, double f) {
  for (int a = 0; a < 3; ++a)
    if (a != victim) set(victim, a, f);
}

const GemmCurve& GemmCalibration::curve(DType t, bool on_tf32) const {
  const std::optional<GemmCurve>* c = t == DType::f32 ? (on_tf32 ? &tf32 : &fp32) : t == DType::bf16 ? &bf16 : nullptr;
  if (c && *c) return **c;
  std::string has;
  for (auto [n, x] : {std::pair{"bf16", &bf16}, std::pair{"fp32", &fp32}, std::pair{"tf32", &tf32}})
    if (*x) has += (has.empty() ? "" : ", ") + std::string(n);
  throw Unsupported("GEMM calibration " + quote(name) + " (" + origin + "): no curve for " +
                    (t == DType::f32 && on_tf32 ? std::string("tf32") : std::string(dtype_name(t))) +
                    " GEMMs (it has " + has + ")");
}

const GemmCurve* PathCurves::curve(const std::string& precision) const {
  const std::optional<GemmCurve>* c = precision == "bf16" ? &bf16 : precision == "fp32" ? &fp32 : precision == "tf32" ? &tf32 : nullptr;
  return c && *c ? &**c : nullptr;
}

const PathCurves* GemmPathPricing::curves(GemmPath p) const {
  if (p == GemmPath::strided_batched) return &strided_batched;
  if (p == GemmPath::grouped) return &grouped;
  return nullptr;
}

GemmCalibration load_gemm_calibration(const std::string& name_or_path) {
  const bool is_path = is_path_ref(name_or_path);
  std::string path = name_or_path;
  if (!is_path) {
    const fs::path dir = calibration_dir();
    path = (dir / (name_or_path + ".json")).string();
    std::error_code ec;
    if (name_or_path.empty() || !fs::is_regular_file(path, ec)) {
      std::vector<std::string> known;
      for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
        if (it->path().extension() == ".json") known.push_back(it->path().stem().string());
      std::sort(known.begin(), known.end());
      std::string msg = "unknown GEMM calibration " + quote(json_fields::one_line(name_or_path));
      if (const std::string best = json_fields::closest(name_or_path, known); !best.empty())
        msg += " (did you mean " + quote(best) + "?)";
      throw ConfigError(msg + "; known: " + (known.empty() ? std::string("none") : join(known)) + " (in " +
                        dir.string() + ")");
    }
  }
  return json_fields::reading(path, [&] {
    return parse_gemm_calibration(json_fields::read_file(path, "GEMM calibration"), path);
  });
}

// ---- ClusterModel ------------------------------------------------------------------------

double ClusterModel::peak_flops(DType t) const {
  switch (t) {
    case DType::bf16:
      return gpu.flops_bf16;
    case DType::f32:
      return gpu.flops_fp32;
    default:
      throw Unsupported(std::string("cluster model ") + quote(name) + ": no peak FLOP/s for " + dtype_name(t) +
                        " GEMMs (the catalogue has bf16, tf32 and fp32 rates)");
  }
}

std::string experiments_dir() {
  if (const char* e = std::getenv("MOELAB_EXPERIMENTS"); e && *e) return e;
#ifdef MOELAB_SOURCE_DIR
  return std::string(MOELAB_SOURCE_DIR) + "/experiments";
#else
  return "experiments";  // relative to the working directory: a build without the source path
#endif
}

std::vector<std::string> cluster_names() {
  std::vector<std::string> names;
  std::error_code ec;
  const fs::path dir = fs::path(hardware_dir()) / "clusters";
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().extension() == ".json" && it->is_regular_file(ec)) names.push_back(it->path().stem().string());
  std::sort(names.begin(), names.end());
  return names;
}

// A name has no '/' and no ".json"; anything else is a path.
ClusterModel load_cluster(const std::string& name_or_path) {
  const bool is_path = is_path_ref(name_or_path);
  std::string path = name_or_path;
  if (!is_path) {
    const fs::path dir = fs::path(hardware_dir()) / "clusters";
    path = (dir / (name_or_path + ".json")).string();
    std::error_code ec;
    if (name_or_path.empty() || !fs::is_regular_file(path, ec)) {
      const auto known = cluster_names();
      std::string msg = "unknown cluster " + quote(json_fields::one_line(name_or_path));
      if (const std::string best = json_fields::closest(name_or_path, known); !best.empty())
        msg += " (did you mean " + quote(best) + "?)";
      msg += known.empty() ? "; no cluster files in " + dir.string()
                           : "; known clusters: " + join(known) + " (from " + dir.string() + ")";
      throw ConfigError(msg + "; or give the path of a cluster file");
    }
  }
  return json_fields::reading(path, [&] { return parse_cluster(json_fields::read_file(path, "cluster file"), path); });
}

nlohmann::json to_json(const ClusterModel& m) {
  json j = {{"schema", kClusterSchema},
            {"name", m.name},
            {"description", m.description},
            {"node", to_json(m.node, m.gpu)},
            {"nodes", m.nodes},
            {"fabric", m.fabric},
            {"fabric_latency", m.fabric_latency},
            {"efficiency", to_json(m.efficiency)},
            {"interference", to_json(m.interference)},
            {"source", m.source}};
  // Only a cluster that models host time names it: the default (0, 0) leaves results as they were.
  if (m.host.modelled())
    j["host"] = {{"sync_latency", m.host.sync_latency}, {"issue_overhead", m.host.issue_overhead},
                 {"source", m.host.source}};
  return j;
}

// ---- calibration profiles ----------------------------------------------------------------

namespace {

// A positive byte count of a measurement (it may be a mean, so not necessarily whole).
double measured_bytes(const Fields& f, const char* key) {
  return in_range(f, key, Sign::positive, 0.0, static_cast<double>(limits::kMaxDerived), "bytes");
}

// The fields `moelab calibrate` records for scripts/fit_gemm_efficiency.py (cluster.hpp:
// CopySample and the others); the sim's time model reads none of them.
void parse_profile_samples(const Fields& f, Profile& p) {
  const std::string& path = f.origin();
  for_each_object(f, "copies", "an array of {kind, bytes, seconds}", [&](const json& e, const std::string& pre) {
    Fields cf(e, path, pre, {"kind", "bytes", "seconds"});
    CopySample c;
    (void)cf.require("kind");
    c.kind = cf.choice_or("kind", "", {"h2d", "d2h", "d2d"});
    c.bytes = cf.integer("bytes", 1, limits::kMaxDerived);
    c.seconds = seconds(cf, "seconds");
    p.copies.push_back(c);
  });
  if (const json* o = f.find("overheads")) {
    if (!o->is_object())
      f.wrong_type("overheads", *o, "an object {launch_latency, event_record, sync_roundtrip, stream_wait} of seconds");
    Fields of(*o, path, "overheads.", {"launch_latency", "event_record", "sync_roundtrip", "stream_wait"});
    ProfileOverheads ov;
    const auto opt = [&](const char* key, std::optional<double>& v) {
      if (of.find(key)) v = latency(of, key);
    };
    opt("launch_latency", ov.launch_latency);
    opt("event_record", ov.event_record);
    opt("sync_roundtrip", ov.sync_roundtrip);
    opt("stream_wait", ov.stream_wait);
    p.overheads = ov;
  }
  const std::vector<std::string> classes = {"compute", "h2d", "d2h"};
  for_each_object(f, "interference", "an array of {victim, aggressor, alone_s, together_s, factor}",
                  [&](const json& e, const std::string& pre) {
                    Fields inf(e, path, pre, {"victim", "aggressor", "alone_s", "together_s", "factor"});
                    InterferenceSample x;
                    (void)inf.require("victim");
                    x.victim = inf.choice_or("victim", "", classes);
                    (void)inf.require("aggressor");
                    x.aggressor = inf.choice_or("aggressor", "", classes);
                    x.alone_s = seconds(inf, "alone_s");
                    x.together_s = seconds(inf, "together_s");
                    // A ratio of the two times: not bounded by 1 (noise can put it above).
                    x.factor = inf.number("factor");
                    if (!(x.factor > 0) || !std::isfinite(x.factor)) inf.bad_value("factor", "must be a finite number > 0");
                    p.interference.push_back(x);
                  });
  for_each_object(f, "dispatch", "an array of {op: \"permute\" | \"unpermute\" | \"exchange\", ...}", [&](const json& e,
                                                                                            const std::string& pre) {
    // The op decides the other fields: read it first, then check the object against them.
    DispatchSample d;
    {
      Fields opf(e, path, pre, {"op", "rows", "width", "dtype", "ranks", "bytes", "seconds"});
      (void)opf.require("op");
      d.op = opf.choice_or("op", "", {"permute", "unpermute", "exchange"});
    }
    if (d.op != "exchange") {
      Fields df(e, path, pre, {"op", "rows", "width", "dtype", "bytes", "seconds"});
      d.rows = df.integer("rows", 1, limits::kMaxDerived);
      d.width = df.integer("width", 1, limits::kMaxDerived);
      (void)df.require("dtype");
      d.dtype = df.choice_or("dtype", "", {"fp32", "bf16"});
      d.bytes = measured_bytes(df, "bytes");
      d.seconds = seconds(df, "seconds");
    } else {
      Fields df(e, path, pre, {"op", "ranks", "bytes", "seconds"});
      d.ranks = df.integer("ranks", 1, limits::kMaxWorld);
      d.bytes = measured_bytes(df, "bytes");
      d.seconds = seconds(df, "seconds");
    }
    p.dispatch.push_back(d);
  });
  for_each_object(f, "activations", "an array of {activation, direction, dtype, elements, seconds}",
                  [&](const json& e, const std::string& pre) {
                    Fields af(e, path, pre, {"activation", "direction", "dtype", "elements", "seconds"});
                    ActivationSample a;
                    (void)af.require("activation");
                    a.activation = af.choice_or("activation", "", activation_names());
                    (void)af.require("direction");
                    a.direction = af.choice_or("direction", "", {"forward", "backward"});
                    (void)af.require("dtype");
                    a.dtype = af.choice_or("dtype", "", {"fp32", "bf16"});
                    a.elements = af.integer("elements", 1, limits::kMaxDerived);
                    a.seconds = seconds(af, "seconds");
                    p.activations.push_back(a);
                  });
  for_each_object(f, "epilogues",
                  "an array of {op, activation, dtype, rows, d_model, d_hidden, gemm_s, unfused_s, fused_s}",
                  [&](const json& e, const std::string& pre) {
                    Fields ef(e, path, pre,
                              {"op", "activation", "dtype", "rows", "d_model", "d_hidden", "gemm_s", "unfused_s", "fused_s"});
                    EpilogueSample x;
                    (void)ef.require("op");
                    x.op = ef.choice_or("op", "", {"fwd", "dgrad"});
                    (void)ef.require("activation");
                    x.activation = ef.choice_or("activation", "", activation_names());
                    (void)ef.require("dtype");
                    x.dtype = ef.choice_or("dtype", "", {"fp32", "bf16"});
                    x.rows = ef.integer("rows", 1, limits::kMaxTokensPerRank);
                    x.d_model = ef.integer("d_model", 1, limits::kMaxDModel);
                    x.d_hidden = ef.integer("d_hidden", 1, limits::kMaxHidden);
                    x.gemm_s = seconds(ef, "gemm_s");
                    x.unfused_s = seconds(ef, "unfused_s");
                    x.fused_s = seconds(ef, "fused_s");
                    p.epilogues.push_back(x);
                  });
}

Profile parse_profile(const json& j, const std::string& path) {
  if (!j.is_object()) fail(path, "expected a JSON object at the top level, got " + show(j));
  Fields f(j, path, "",
           {"schema", "name", "mode", "backend", "device", "date", "commit", "gemm", "h2d_bw", "d2h_bw", "d2d_bw",
            "elementwise_bw", "launch_latency", "collectives", "gemm_paths", "copies", "overheads", "interference",
            "dispatch", "activations", "epilogues"});
  check_schema(f, kProfileSchema, true);
  Profile p;
  p.origin = path;
  p.name = f.string_or("name", stem_of(path));
  (void)f.choice_or("mode", "measured", {"measured"});
  (void)f.string_or("backend", "");
  p.device = f.string("device");
  p.date = f.string_or("date", "");
  p.commit = f.string_or("commit", "");
  if (const json* g = f.find("gemm")) {
    if (!g->is_array()) f.wrong_type("gemm", *g, "an array of {m, n, k, dtype, seconds}");
    for (std::size_t i = 0; i < g->size(); ++i) {
      const json& s = (*g)[i];
      const std::string prefix = "gemm[" + std::to_string(i) + "].";
      if (!s.is_object()) fail(path, prefix.substr(0, prefix.size() - 1) + ": expected an object, got " + show(s));
      Fields sf(s, path, prefix, {"m", "n", "k", "dtype", "seconds"});
      GemmSample smp;
      smp.m = sf.integer("m", 1, limits::kMaxGemmDim);
      smp.n = sf.integer("n", 1, limits::kMaxGemmDim);
      smp.k = sf.integer("k", 1, limits::kMaxGemmDim);
      (void)sf.require("dtype");
      smp.dtype = parse_dtype(sf.choice_or("dtype", "fp32", {"fp32", "bf16"}));
      smp.seconds = seconds(sf, "seconds");
      // The sample's achieved rate scales every GEMM time the sim derives from it.
      const double rate = 2.0 * static_cast<double>(smp.m) * static_cast<double>(smp.n) * static_cast<double>(smp.k) /
                          smp.seconds;
      if (!(rate >= limits::kMinFlops && rate <= limits::kMaxFlops))
        fail(path, prefix + "seconds = " + show(sf.require("seconds")) + " for a " + std::to_string(smp.m) + " x " +
                       std::to_string(smp.n) + " x " + std::to_string(smp.k) + " GEMM is " +
                       json_fields::number_text(rate) + " FLOP/s, outside [" + json_fields::number_text(limits::kMinFlops) +
                       ", " + json_fields::number_text(limits::kMaxFlops) + "] (see harness/config/limits.hpp)");
      p.gemm.push_back(smp);
    }
  }
  // Measured collectives are checked but not used by the time model: links are modelled from
  // the catalogue, and these figures are what a simulated collective is validated against.
  if (const json* c = f.find("collectives")) {
    if (!c->is_array()) f.wrong_type("collectives", *c, "an array of {op, ranks, bytes_per_peer, seconds, busbw}");
    for (std::size_t i = 0; i < c->size(); ++i) {
      const json& s = (*c)[i];
      const std::string prefix = "collectives[" + std::to_string(i) + "].";
      if (!s.is_object()) fail(path, prefix.substr(0, prefix.size() - 1) + ": expected an object, got " + show(s));
      Fields cf(s, path, prefix, {"op", "ranks", "bytes_per_peer", "seconds", "busbw"});
      (void)cf.string("op");
      (void)cf.integer("ranks", 1, limits::kMaxWorld);
      (void)cf.integer("bytes_per_peer", 0, limits::kMaxDerived);
      (void)seconds(cf, "seconds");
      if (cf.find("busbw")) (void)in_range(cf, "busbw", Sign::non_negative, 0.0, limits::kMaxBandwidth, "bytes/s");
    }
  }
  // 0 or absent: not measured (the datasheet figure is used instead).
  p.h2d_bw = measured_bandwidth_or_zero(f, "h2d_bw");
  p.d2h_bw = measured_bandwidth_or_zero(f, "d2h_bw");
  p.d2d_bw = measured_bandwidth_or_zero(f, "d2d_bw");
  p.elementwise_bw = measured_bandwidth_or_zero(f, "elementwise_bw");
  p.launch_latency = latency_or(f, "launch_latency", 0.0);
  if (const json* g = f.find("gemm_paths")) p.gemm_paths = gemm_path_table_from_json(*g, path);
  parse_profile_samples(f, p);
  return p;
}

}  // namespace

GemmPathTable gemm_path_table_from_json(const json& j, const std::string& origin, const std::string& prefix) {
  const std::string where = prefix.empty() ? std::string("the table") : prefix.substr(0, prefix.size() - 1);
  if (!j.is_object()) fail(origin, where + ": expected an object {source, max_padding_waste, tie_tolerance, points}, got " + show(j));
  Fields f(j, origin, prefix, {"source", "max_padding_waste", "tie_tolerance", "points"});
  GemmPathTable t;
  t.source = f.string_or("source", "");
  if (f.find("max_padding_waste")) t.max_padding_waste = in_range(f, "max_padding_waste", Sign::non_negative, 0.0, 1.0, "(a share)");
  if (f.find("tie_tolerance")) t.tie_tolerance = in_range(f, "tie_tolerance", Sign::non_negative, 0.0, 1.0, "(relative)");
  const json& pts = f.require("points");
  if (!pts.is_array()) f.wrong_type("points", pts, "an array of {precision, op, d_model, d_hidden, experts, rows, tflops}");
  for (std::size_t i = 0; i < pts.size(); ++i) {
    const json& e = pts[i];
    const std::string pp = prefix + "points[" + std::to_string(i) + "].";
    if (!e.is_object()) fail(origin, pp.substr(0, pp.size() - 1) + ": expected an object, got " + show(e));
    Fields pf(e, origin, pp, {"precision", "op", "d_model", "d_hidden", "experts", "rows", "tflops"});
    GemmPathPoint pt;
    (void)pf.require("precision");
    pt.precision = pf.choice_or("precision", "bf16", {"bf16", "fp32", "tf32"});
    (void)pf.require("op");
    (void)parse_gemm_op(pf.choice_or("op", "fwd", {"fwd", "dgrad", "wgrad"}), pt.op);
    pt.d_model = pf.integer("d_model", 1, limits::kMaxDModel);
    pt.d_hidden = pf.integer("d_hidden", 1, limits::kMaxHidden);
    pt.experts = pf.integer("experts", 1, limits::kMaxExperts);
    pt.rows = pf.integer("rows", 1, limits::kMaxTokensPerRank);
    const json& tf = pf.require("tflops");
    if (!tf.is_object()) pf.wrong_type("tflops", tf, "an object {loop, strided_batched, grouped} of TFLOP/s");
    Fields ff(tf, origin, pp + "tflops.", {"loop", "strided_batched", "grouped"});
    bool any = false;
    for (GemmPath path : {GemmPath::loop, GemmPath::strided_batched, GemmPath::grouped}) {
      const char* key = gemm_path_name(path);
      if (!ff.find(key)) continue;
      // TFLOP/s; the FLOP/s range of every other rate (limits.hpp).
      pt.tflops[static_cast<std::size_t>(path)] =
          in_range(ff, key, Sign::positive, limits::kMinFlops / 1e12, limits::kMaxFlops / 1e12, "TFLOP/s");
      any = true;
    }
    if (!any) fail(origin, pp + "tflops: expected at least one of loop, strided_batched, grouped");
    t.points.push_back(std::move(pt));
  }
  return t;
}

json to_json(const GemmPathTable& t) {
  json pts = json::array();
  for (const auto& p : t.points) {
    json tf = json::object();
    for (GemmPath path : {GemmPath::loop, GemmPath::strided_batched, GemmPath::grouped})
      if (p.tflops[static_cast<std::size_t>(path)] > 0) tf[gemm_path_name(path)] = p.tflops[static_cast<std::size_t>(path)];
    pts.push_back({{"precision", p.precision},
                   {"op", gemm_op_name(p.op)},
                   {"d_model", p.d_model},
                   {"d_hidden", p.d_hidden},
                   {"experts", p.experts},
                   {"rows", p.rows},
                   {"tflops", tf}});
  }
  return {{"source", t.source}, {"max_padding_waste", t.max_padding_waste}, {"tie_tolerance", t.tie_tolerance},
          {"points", pts}};
}

Profile load_profile(const std::string& path) {
  return json_fields::reading(path, [&] { return parse_profile(json_fields::read_file(path, "calibration profile"), path); });
}

nlohmann::json to_json(const Profile& p) {
  json gemm = json::array();
  for (const auto& s : p.gemm)
    gemm.push_back({{"m", s.m}, {"n", s.n}, {"k", s.k}, {"dtype", dtype_name(s.dtype)}, {"seconds", s.seconds}});
  json j = {{"schema", kProfileSchema},
          {"name", p.name},
          {"device", p.device},
          {"date", p.date},
          {"commit", p.commit},
          {"gemm", gemm},
          {"h2d_bw", p.h2d_bw},
          {"d2h_bw", p.d2h_bw},
          {"d2d_bw", p.d2d_bw},
          {"elementwise_bw", p.elementwise_bw},
          {"launch_latency", p.launch_latency}};
  if (p.gemm_paths) j["gemm_paths"] = to_json(*p.gemm_paths);
  // Only what was measured: a profile without these fields is written as before.
  if (!p.copies.empty()) {
    json a = json::array();
    for (const auto& c : p.copies) a.push_back({{"kind", c.kind}, {"bytes", c.bytes}, {"seconds", c.seconds}});
    j["copies"] = a;
  }
  if (p.overheads) {
    json o = json::object();
    const auto put = [&](const char* key, const std::optional<double>& v) {
      if (v) o[key] = *v;
    };
    put("launch_latency", p.overheads->launch_latency);
    put("event_record", p.overheads->event_record);
    put("sync_roundtrip", p.overheads->sync_roundtrip);
    put("stream_wait", p.overheads->stream_wait);
    j["overheads"] = o;
  }
  if (!p.interference.empty()) {
    json a = json::array();
    for (const auto& x : p.interference)
      a.push_back({{"victim", x.victim},
                   {"aggressor", x.aggressor},
                   {"alone_s", x.alone_s},
                   {"together_s", x.together_s},
                   {"factor", x.factor}});
    j["interference"] = a;
  }
  if (!p.dispatch.empty()) {
    json a = json::array();
    for (const auto& d : p.dispatch) {
      json e = {{"op", d.op}};
      if (d.op != "exchange") {
        e["rows"] = d.rows;
        e["width"] = d.width;
        e["dtype"] = d.dtype;
      } else {
        e["ranks"] = d.ranks;
      }
      e["bytes"] = d.bytes;
      e["seconds"] = d.seconds;
      a.push_back(e);
    }
    j["dispatch"] = a;
  }
  if (!p.activations.empty()) {
    json a = json::array();
    for (const auto& x : p.activations)
      a.push_back({{"activation", x.activation},
                   {"direction", x.direction},
                   {"dtype", x.dtype},
                   {"elements", x.elements},
                   {"seconds", x.seconds}});
    j["activations"] = a;
  }
  if (!p.epilogues.empty()) {
    json a = json::array();
    for (const auto& x : p.epilogues)
      a.push_back({{"op", x.op},
                   {"activation", x.activation},
                   {"dtype", x.dtype},
                   {"rows", x.rows},
                   {"d_model", x.d_model},
                   {"d_hidden", x.d_hidden},
                   {"gemm_s", x.gemm_s},
                   {"unfused_s", x.unfused_s},
                   {"fused_s", x.fused_s}});
    j["epilogues"] = a;
  }
  return j;
}

// ---- Topology ----------------------------------------------------------------------------

namespace {

// A ClusterModel built in code rather than loaded must still be consistent, or the index
// arithmetic below divides by zero.
void check_model(const ClusterModel& m) {
  const auto bad = [&](const std::string& what) {
    throw std::invalid_argument("Topology: cluster model " + quote(m.name) + ": " + what);
  };
  if (m.nodes < 1 || m.node.gpus < 1) bad("needs at least one node and one GPU per node");
  if (static_cast<std::int64_t>(m.nodes) * m.node.gpus > limits::kMaxWorld)  // both are ints: no wrap in int64
    bad("nodes × gpus is more than " + std::to_string(limits::kMaxWorld) + " GPUs");
  if (m.node.intra != "nvswitch" && m.node.intra != "pcie") bad("intra must be \"nvswitch\" or \"pcie\"");
  if (m.node.intra == "pcie" && (m.node.gpus_per_pcie_switch < 1 || m.node.gpus % m.node.gpus_per_pcie_switch != 0))
    bad("gpus per node must be a multiple of gpus_per_pcie_switch");
  if (m.node.intra == "nvswitch" && m.node.pcie_switches() &&
      (m.node.gpus % m.node.gpus_per_pcie_switch != 0 || !(m.node.pcie_bw > 0) || !(m.node.pcie_switch_uplink_bw > 0)))
    bad("an NVSwitch node's PCIe switches need gpus divisible by gpus_per_pcie_switch and rates > 0");
  const P2pModel& p = m.node.p2p;
  for (double e : {p.ll_efficiency, p.intra_efficiency, p.net_efficiency})
    if (!(e > 0 && e <= 1)) bad("p2p efficiencies must be in (0, 1]");
  for (double l : {p.base_latency_simple, p.base_latency_ll, p.intra_peer_overhead, p.net_peer_overhead, p.ll_threshold})
    if (!(l >= 0) || !std::isfinite(l)) bad("p2p latencies, overheads and the LL threshold must be finite and >= 0");
  if (m.nodes > 1 && m.node.nics < 1) bad("a multi-node cluster needs NICs");
  if (!(m.efficiency.gemm_max > 0) || !(m.efficiency.mem > 0)) bad("efficiencies must be > 0");
}

void check_profile(const Profile& p) {
  for (const auto& s : p.gemm)
    if (s.m < 1 || s.n < 1 || s.k < 1 || !(s.seconds > 0))
      throw std::invalid_argument("Topology: profile " + quote(p.name) + " has a GEMM sample with a size < 1 or seconds <= 0");
}

std::string rank_name(int r) { return "rank" + std::to_string(r); }

}  // namespace

Topology::Topology(const ClusterModel& m, Engine& e, const Profile* profile) : m_(m), profile_(profile) {
  check_model(m);
  if (profile) check_profile(*profile);
  const NodeSpec& nd = m.node;
  const int world = m.world_size();
  for (int r = 0; r < world; ++r) {
    sm_.push_back(e.add_resource(rank_name(r) + ".sm", 1.0));
    hbm_.push_back(e.add_resource(rank_name(r) + ".hbm", m.gpu.hbm_bw));
  }
  // Each PCIe switch's uplink to the CPU, both directions, numbered across nodes (a PCIe node's
  // switches, and an NVSwitch node's that declares them).
  const auto add_pcie_switches = [&] {
    const int switches = nd.gpus / nd.gpus_per_pcie_switch;
    for (int n = 0; n < m.nodes; ++n)
      for (int s = 0; s < switches; ++s) {
        const std::string sw = "node" + std::to_string(n) + ".switch" + std::to_string(s);
        switch_up_.push_back(e.add_resource(sw + ".up", nd.pcie_switch_uplink_bw));
        switch_down_.push_back(e.add_resource(sw + ".down", nd.pcie_switch_uplink_bw));
      }
  };
  if (nd.intra == "nvswitch") {
    // A measured host-copy rate replaces the datasheet one: the link is the GPU's alone.
    const double h2d = profile && profile->h2d_bw > 0 ? profile->h2d_bw : nd.host_copy_bw;
    const double d2h = profile && profile->d2h_bw > 0 ? profile->d2h_bw : nd.host_copy_bw;
    for (int r = 0; r < world; ++r) {
      link_out_.push_back(e.add_resource(rank_name(r) + ".nvlink_out", nd.nvlink_bw));
      link_in_.push_back(e.add_resource(rank_name(r) + ".nvlink_in", nd.nvlink_bw));
      // host_link_[2r]: host -> device, host_link_[2r + 1]: device -> host.
      host_link_.push_back(e.add_resource(rank_name(r) + ".h2d", h2d));
      host_link_.push_back(e.add_resource(rank_name(r) + ".d2h", d2h));
    }
    // The PCIe switches of a DGX-style node: each GPU's x16 link to its switch (host copies
    // and GPUDirect RDMA to and from the NIC), each switch's uplink to the CPU (host copies).
    if (nd.pcie_switches()) {
      for (int r = 0; r < world; ++r) {
        gpu_pcie_up_.push_back(e.add_resource(rank_name(r) + ".pcie_up", nd.pcie_bw));
        gpu_pcie_down_.push_back(e.add_resource(rank_name(r) + ".pcie_down", nd.pcie_bw));
      }
      add_pcie_switches();
    }
  } else {
    for (int r = 0; r < world; ++r) {
      link_out_.push_back(e.add_resource(rank_name(r) + ".pcie_up", nd.pcie_bw));
      link_in_.push_back(e.add_resource(rank_name(r) + ".pcie_down", nd.pcie_bw));
    }
    add_pcie_switches();
  }
  // NICs carry only traffic between nodes, so a single node has none to register.
  if (m.nodes > 1)
    for (int n = 0; n < m.nodes; ++n)
      for (int i = 0; i < nd.nics; ++i) {
        const std::string nic = "node" + std::to_string(n) + ".nic" + std::to_string(i);
        nic_out_.push_back(e.add_resource(nic + ".out", nd.nic_bw));
        nic_in_.push_back(e.add_resource(nic + ".in", nd.nic_bw));
      }
}

namespace {

void check_rank(int rank, int world, const char* what) {
  if (rank < 0 || rank >= world)
    throw std::invalid_argument(std::string("Topology::") + what + ": rank " + std::to_string(rank) +
                                " is outside the cluster's " + std::to_string(world) + " GPUs");
}

}  // namespace

int Topology::sm(int rank) const {
  check_rank(rank, m_.world_size(), "sm");
  return sm_[static_cast<std::size_t>(rank)];
}

int Topology::hbm(int rank) const {
  check_rank(rank, m_.world_size(), "hbm");
  return hbm_[static_cast<std::size_t>(rank)];
}

int Topology::switch_of(int rank) const {
  // Switches are numbered across nodes: node n's switch s is n * (gpus / per switch) + s.
  const NodeSpec& nd = m_.node;
  const int switches = nd.gpus / nd.gpus_per_pcie_switch;
  return m_.node_of(rank) * switches + (rank % nd.gpus) / nd.gpus_per_pcie_switch;
}

Route Topology::p2p(int src, int dst) const {
  const int world = m_.world_size();
  check_rank(src, world, "p2p");
  check_rank(dst, world, "p2p");
  if (src == dst) throw std::invalid_argument("Topology::p2p: source and destination are both rank " + std::to_string(src));
  const NodeSpec& nd = m_.node;
  const auto at = [](const std::vector<int>& v, int i) { return v[static_cast<std::size_t>(i)]; };
  const int node_src = m_.node_of(src), node_dst = m_.node_of(dst);
  const int local_src = src % nd.gpus, local_dst = dst % nd.gpus;
  const bool pcie = nd.intra == "pcie";
  Route r;
  const auto add = [&](int res, LinkClass c) {
    r.resources.push_back(res);
    r.resource_links.push_back(c);
  };
  if (node_src == node_dst) {
    const LinkClass c = pcie ? LinkClass::pcie : LinkClass::nvlink;
    add(at(link_out_, src), c);
    r.links = {c};
    if (pcie) {
      const int sw_src = switch_of(src), sw_dst = switch_of(dst);
      if (sw_src != sw_dst) {
        add(at(switch_up_, sw_src), c);
        add(at(switch_down_, sw_dst), c);
      }
      r.latency = nd.pcie_latency;
    } else {
      r.latency = nd.nvlink_latency;
    }
    add(at(link_in_, dst), c);
    return r;
  }
  // Rail-optimised: GPU i of a node sends and receives through NIC i % nics, by GPUDirect
  // RDMA over the GPU's PCIe link (a PCIe node's, or an NVSwitch node's that models its
  // PCIe switches; the NIC sits on the GPU's switch, so the switch uplink is not crossed).
  r.inter_node = true;
  const bool gdr = pcie || nd.pcie_switches();
  if (gdr) add(pcie ? at(link_out_, src) : at(gpu_pcie_up_, src), LinkClass::pcie);
  add(at(nic_out_, node_src * nd.nics + local_src % nd.nics), LinkClass::nic);
  add(at(nic_in_, node_dst * nd.nics + local_dst % nd.nics), LinkClass::nic);
  if (gdr) add(pcie ? at(link_in_, dst) : at(gpu_pcie_down_, dst), LinkClass::pcie);
  r.latency = nd.nic_latency + m_.fabric_latency;
  r.links = gdr ? std::vector<LinkClass>{LinkClass::pcie, LinkClass::nic} : std::vector<LinkClass>{LinkClass::nic};
  return r;
}

const char* link_class_name(LinkClass c) {
  switch (c) {
    case LinkClass::nvlink: return "nvlink";
    case LinkClass::pcie: return "pcie";
    case LinkClass::nic: return "nic";
  }
  return "?";
}

double& LinkBytes::operator[](LinkClass c) {
  return c == LinkClass::nvlink ? nvlink : c == LinkClass::pcie ? pcie : nic;
}
double LinkBytes::operator[](LinkClass c) const {
  return c == LinkClass::nvlink ? nvlink : c == LinkClass::pcie ? pcie : nic;
}
LinkBytes& LinkBytes::operator+=(const LinkBytes& o) {
  nvlink += o.nvlink;
  pcie += o.pcie;
  nic += o.nic;
  return *this;
}
nlohmann::json LinkBytes::to_json() const { return {{"nvlink", nvlink}, {"pcie", pcie}, {"nic", nic}}; }

Route Topology::host_to_device(int rank) const {
  check_rank(rank, m_.world_size(), "host_to_device");
  const NodeSpec& nd = m_.node;
  const auto i = static_cast<std::size_t>(rank);
  Route r;
  r.latency = nd.pcie_latency;
  r.links = {LinkClass::pcie};  // the host link is PCIe on both kinds of node
  const auto sw = static_cast<std::size_t>(nd.pcie_switches() ? switch_of(rank) : 0);
  if (nd.intra == "nvswitch") {
    r.resources = {host_link_[2 * i]};
    if (nd.pcie_switches()) r.resources.insert(r.resources.end(), {switch_down_[sw], gpu_pcie_down_[i]});
  } else {
    r.resources = {switch_down_[sw], link_in_[i]};
  }
  r.resource_links.assign(r.resources.size(), LinkClass::pcie);
  return r;
}

Route Topology::device_to_host(int rank) const {
  check_rank(rank, m_.world_size(), "device_to_host");
  const NodeSpec& nd = m_.node;
  const auto i = static_cast<std::size_t>(rank);
  Route r;
  r.latency = nd.pcie_latency;
  r.links = {LinkClass::pcie};  // the host link is PCIe on both kinds of node
  const auto sw = static_cast<std::size_t>(nd.pcie_switches() ? switch_of(rank) : 0);
  if (nd.intra == "nvswitch") {
    r.resources = {host_link_[2 * i + 1]};
    if (nd.pcie_switches()) r.resources.insert(r.resources.end(), {gpu_pcie_up_[i], switch_up_[sw]});
  } else {
    r.resources = {link_out_[i], switch_up_[sw]};
  }
  r.resource_links.assign(r.resources.size(), LinkClass::pcie);
  return r;
}

double Topology::gemm_seconds(std::int64_t m, std::int64_t n, std::int64_t k, DType t, bool tf32) const {
  if (m < 0 || n < 0 || k < 0)
    throw std::invalid_argument("Topology::gemm_seconds: negative size " + std::to_string(m) + "x" + std::to_string(n) +
                                "x" + std::to_string(k));
  if (m == 0 || n == 0 || k == 0) return 0.0;
  const double dm = static_cast<double>(m), dn = static_cast<double>(n), dk = static_cast<double>(k);
  const double flops = 2.0 * dm * dn * dk;
  const bool on_tf32 = tf32 && t == DType::f32;
  if (profile_ && !on_tf32) {
    // The measured shape nearest in log space: GEMM efficiency depends on the ratios of the
    // sizes, not their differences, so 512 is as far from 256 as 8192 is from 4096.
    const GemmSample* best = nullptr;
    double best_d = std::numeric_limits<double>::infinity();
    for (const auto& s : profile_->gemm) {
      if (s.dtype != t) continue;
      const double a = std::log(dm / static_cast<double>(s.m));
      const double b = std::log(dn / static_cast<double>(s.n));
      const double c = std::log(dk / static_cast<double>(s.k));
      const double d = a * a + b * b + c * c;
      if (d < best_d) {  // strict: the first of equally near samples wins, in file order
        best_d = d;
        best = &s;
      }
    }
    if (best) {
      const double sample_flops =
          2.0 * static_cast<double>(best->m) * static_cast<double>(best->n) * static_cast<double>(best->k);
      return best->seconds * (flops / sample_flops);  // the sample's achieved FLOP/s, this shape's FLOPs
    }
  }
  const double d = static_cast<double>(std::min({m, n, k}));
  const double peak = on_tf32 ? m_.gpu.flops_tf32 : m_.peak_flops(t);
  if (const auto& cal = m_.efficiency.calibration) {
    // docs/PERFORMANCE.md, "GEMM efficiency against size": the fitted curve of this precision,
    // or the time to move the operands and the result once, whichever is longer.
    const GemmCurve& c = cal->curve(t, on_tf32);
    const double eff = c.gemm_max * d / (d + c.gemm_half_dim);
    const double bytes = static_cast<double>(dtype_size(t)) * (dm * dk + dk * dn + dm * dn);
    return std::max(flops / (peak * eff), bytes / gemm_mem_bw());
  }
  const double eff = m_.efficiency.gemm_max * d / (d + m_.efficiency.gemm_half_dim);
  return flops / (peak * eff);
}

bool Topology::prices_gemm_paths() const {
  const auto& cal = m_.efficiency.calibration;
  return cal && cal->paths.has_value();
}

void check_forced_gemm_path(const ClusterModel& m, std::optional<GemmPath> path) {
  if (path && *path != GemmPath::loop && !(m.efficiency.calibration && m.efficiency.calibration->paths))
    throw ConfigError("--gemm-path " + std::string(gemm_path_name(*path)) + ": cluster " + m.name +
                      " has no per-path GEMM data (its efficiency.calibration has no \"paths\" and \"gemm_paths\"), so "
                      "only the loop can be priced there");
}

void Topology::force_gemm_path(std::optional<GemmPath> path) {
  check_forced_gemm_path(m_, path);
  forced_path_ = path;
}

double Topology::path_gemm_seconds(const GemmCurve& curve, std::int64_t m, std::int64_t n, std::int64_t k, DType ab,
                                   bool on_tf32) const {
  const double peak = on_tf32 ? m_.gpu.flops_tf32 : m_.peak_flops(ab);
  const double elem = static_cast<double>(dtype_size(ab));
  const double dm = static_cast<double>(m), dn = static_cast<double>(n), dk = static_cast<double>(k);
  const double d = static_cast<double>(std::min({m, n, k}));
  const double eff = curve.gemm_max * d / (d + curve.gemm_half_dim);
  return std::max(2.0 * dm * dn * dk / (peak * eff), elem * (dm * dk + dk * dn + dm * dn) / gemm_mem_bw());
}

double Topology::batched_gemm_seconds(std::span<const GemmProblem> problems, bool tf32) const {
  const auto ab_type = [](const GemmProblem& p) { return p.a.defined() ? p.a.dtype() : DType::f32; };
  const auto same = [&](const GemmProblem& p, const GemmProblem& q) {
    return p.trans_a == q.trans_a && p.trans_b == q.trans_b && p.m == q.m && p.n == q.n && p.k == q.k &&
           p.alpha == q.alpha && p.beta == q.beta && ab_type(p) == ab_type(q) &&
           (p.c.defined() ? p.c.dtype() : DType::f32) == (q.c.defined() ? q.c.dtype() : DType::f32);
  };
  double seconds = 0;
  for (std::size_t i = 0; i < problems.size();) {
    std::size_t j = i + 1;
    while (j < problems.size() && same(problems[j], problems[i])) ++j;
    const GemmProblem& p = problems[i];
    const DType ab = ab_type(p);
    const bool on_tf32 = tf32 && ab == DType::f32;
    const GemmCurve* curve = nullptr;
    if (j - i > 1 && prices_gemm_paths() && p.m > 0 && p.n > 0 && p.k > 0 && (ab == DType::bf16 || ab == DType::f32))
      curve = m_.efficiency.calibration->paths->strided_batched.curve(ab == DType::bf16 ? "bf16" : on_tf32 ? "tf32" : "fp32");
    for (std::size_t q = i; q < j; ++q)
      seconds += curve ? path_gemm_seconds(*curve, p.m, p.n, p.k, ab, on_tf32) : gemm_seconds(problems[q].m, problems[q].n, problems[q].k, ab, tf32);
    i = j;
  }
  return seconds;
}

Topology::GroupedGemmPrice Topology::grouped_gemm(std::span<const GemmProblem> problems, bool tf32,
                                                  bool grouped_available) const {
  GroupedGemmPrice out;
  const auto ab_type = [](const GemmProblem& p) { return p.a.defined() ? p.a.dtype() : DType::f32; };
  const auto c_type = [](const GemmProblem& p) { return p.c.defined() ? p.c.dtype() : DType::f32; };
  if (!prices_gemm_paths()) {
    // The loop of single GEMMs: every problem with an output a launch.
    for (const auto& p : problems) {
      out.seconds += gemm_seconds(p.m, p.n, p.k, ab_type(p), tf32);
      if (p.m > 0 && p.n > 0) ++out.launches;
    }
    return out;
  }
  const GemmCalibration& cal = *m_.efficiency.calibration;
  const GemmPathPricing& pricing = *cal.paths;
  // A forced strided_batched over padded rows where the calibration has no strided curve for the
  // precision: cuda runs that batch; the sim can only price the problems as the loop, and says so.
  std::optional<GemmPathChoice> forced_padded;
  // A padded layout (every problem with the same token stride, MoELayer::set_expert_layout): one
  // strided batch over the padded rows where the table picks it, as CudaBackend::grouped_gemm
  // does; otherwise the problems' own rows below.
  if (const std::int64_t S = common_token_stride(problems); S > 0 && problems.size() > 1) {
    const GemmProblem& f = problems.front();
    const DType ab = ab_type(f);
    const bool on_tf32 = tf32 && ab == DType::f32;
    bool alike = ab == DType::bf16 || ab == DType::f32;
    for (const auto& p : problems)
      alike = alike && p.trans_a == f.trans_a && p.trans_b == f.trans_b && p.alpha == f.alpha && p.beta == f.beta &&
              ab_type(p) == ab && c_type(p) == c_type(f) && ((p.trans_a && !p.trans_b) ? p.m == f.m : p.k == f.k) &&
              p.n == f.n;
    GemmCall call = padded_gemm_call(problems, ab == DType::bf16 ? "bf16" : on_tf32 ? "tf32" : "fp32");
    call.grouped_available = grouped_available;
    const GemmCurve* curve = pricing.strided_batched.curve(call.precision);
    // A forced path other than strided_batched runs the problems' own rows, as on cuda
    // (CudaBackend::padded_batch); a forced strided_batched takes the padded batch.
    if (alike && !call.problems.empty() && (!forced_path_ || *forced_path_ == GemmPath::strided_batched)) {
      GemmPathChoice choice = choose_gemm_path(call, pricing.table);
      if (forced_path_) choice = force_padded_batch(std::move(choice), call.padded_rows);
      if (forced_path_ && !curve) forced_padded = choice;
      if (choice.path == GemmPath::strided_batched && curve) {
        const bool wgrad = f.trans_a && !f.trans_b;
        for (std::size_t i = 0; i < problems.size(); ++i)
          out.seconds += path_gemm_seconds(*curve, wgrad ? f.m : S, f.n, wgrad ? S : f.k, ab, on_tf32);
        out.launches = 1;
        out.detail = choice.why;
        out.decisions.emplace_back(GemmPath::strided_batched, choice.why);
        return out;
      }
    }
  }
  // As the cuda backend runs the call (CudaBackend::grouped_gemm): a problem with k = 0 only
  // fills (beta = 0) or scales C, one kernel unless beta = 1; the others go in one call per
  // combination of A/B and C types, each on the path choose_gemm_path picks.
  std::map<std::pair<int, int>, std::vector<const GemmProblem*>> by_type;
  bool all_live = true;
  for (const auto& p : problems) {
    if (p.m < 0 || p.n < 0 || p.k < 0) (void)gemm_seconds(p.m, p.n, p.k, ab_type(p), tf32);  // throws
    if (p.m == 0 || p.n == 0 || p.k == 0) {
      all_live = false;
      if (p.m > 0 && p.n > 0 && p.beta != 1.0f) ++out.launches;
      continue;
    }
    by_type[{static_cast<int>(ab_type(p)), static_cast<int>(c_type(p))}].push_back(&p);
  }
  // The cuda backend batches equal problems into one strided call when their operands sit at
  // fixed strides, which it reads from their addresses (strided_runs). The sim's tensors have
  // no addresses, but the MoE layer's layout decides it: its buffers are packed
  // local-expert-major and its weights sit at fixed strides, so its calls are strided exactly
  // when every local expert got the same rows, none zero (docs/GPU.md, "The layer's layout"),
  // i.e. when every problem of the call has the same shape and scalars.
  bool equal = problems.size() > 1 && all_live;
  for (const auto& p : problems) {
    const GemmProblem& f = problems.front();
    equal = equal && p.trans_a == f.trans_a && p.trans_b == f.trans_b && p.m == f.m && p.n == f.n && p.k == f.k &&
            p.alpha == f.alpha && p.beta == f.beta && ab_type(p) == ab_type(f) && c_type(p) == c_type(f);
  }
  for (const auto& [types, list] : by_type) {
    const auto ab = static_cast<DType>(types.first);
    const bool on_tf32 = tf32 && ab == DType::f32;
    GemmCall call;
    for (const auto* p : list) call.problems.push_back({p->trans_a, p->trans_b, p->m, p->n, p->k});
    call.precision = ab == DType::bf16 ? "bf16" : on_tf32 ? "tf32" : "fp32";
    call.strided = equal;
    call.grouped_available = grouped_available;
    // (A forced padded batch without a curve keeps its choice: priced as the loop below.)
    GemmPathChoice choice = forced_padded ? *forced_padded : choose_gemm_path(call, pricing.table);
    if (forced_path_ && !forced_padded) choice = moelab::force_gemm_path(std::move(choice), *forced_path_, call);
    std::string why = choice.why;
    const GemmCurve* curve = nullptr;
    if (choice.path != GemmPath::loop) {
      if (ab == DType::bf16 || ab == DType::f32) curve = pricing.curves(choice.path)->curve(call.precision);
      if (!curve)
        why += std::string("; priced as the loop: the calibration has no ") + gemm_path_name(choice.path) + " curve for " +
               call.precision;
    }
    if (curve) {
      // One launch; each problem at the path's curve, or the time to move its operands and
      // result once, whichever is longer (docs/PERFORMANCE.md, "GEMM paths in the sim").
      for (const auto* p : list) out.seconds += path_gemm_seconds(*curve, p->m, p->n, p->k, ab, on_tf32);
      ++out.launches;
    } else {
      for (const auto* p : list) out.seconds += gemm_seconds(p->m, p->n, p->k, ab, tf32);
      out.launches += static_cast<std::int64_t>(list.size());
    }
    out.decisions.emplace_back(curve ? choice.path : GemmPath::loop, why);
    out.detail += (out.detail.empty() ? "" : " | ") + why;
  }
  return out;
}

double Topology::gemm_mem_bw() const {
  const auto& cal = m_.efficiency.calibration;
  MOELAB_CHECK(cal.has_value(), "gemm_mem_bw: cluster " + m_.name + " has no GEMM calibration");
  return cal->mem_bw * calibration_hbm_scale();
}

double Topology::calibration_hbm_scale() const {
  const auto& cal = m_.efficiency.calibration;
  return cal && cal->hbm_bw > 0 && m_.gpu.hbm_bw > 0 ? m_.gpu.hbm_bw / cal->hbm_bw : 1.0;
}

double Topology::mem_bw_effective() const {
  if (profile_ && profile_->elementwise_bw > 0) return profile_->elementwise_bw;
  return m_.gpu.hbm_bw * m_.efficiency.mem;
}

const KernelRates* Topology::kernel_rates() const {
  return m_.efficiency.calibration ? &m_.efficiency.calibration->kernels : nullptr;
}

const ActivationRate* KernelRates::activation(Activation a, bool backward, DType t) const {
  for (const auto& r : activations)
    if (r.activation == a && r.backward == backward && r.dtype == t) return &r;
  return nullptr;
}

double Topology::launch_latency() const {
  if (profile_ && profile_->launch_latency > 0) return profile_->launch_latency;
  // With a calibration, load_cluster sets this to the calibration's launch latency; a model
  // edited in code (a test setting 0) keeps its own.
  return m_.efficiency.launch_latency;
}

}  // namespace moelab::sim
