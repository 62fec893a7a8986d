// harness/metrics/run_figures.cpp — see run_figures.hpp.
#include "harness/metrics/run_figures.hpp"

#include <algorithm>
#include <numeric>

#include "harness/metrics/overlap.hpp"

namespace moelab {

using nlohmann::json;

namespace {

json pool_json(const std::optional<Backend::DevicePoolPeak>& p) {
  if (!p) return nullptr;
  return {{"used_high", p->used_high}, {"reserved_high", p->reserved_high}};
}

CategoryBytes category_from(const json& j) {
  CategoryBytes b{};
  for (int c = 0; c < kNumMemCategories; ++c)
    b[static_cast<std::size_t>(c)] = j.at(category_name(static_cast<MemCategory>(c))).get<std::size_t>();
  return b;
}

}  // namespace

json category_json(const CategoryBytes& b) {
  json j = json::object();
  for (int c = 0; c < kNumMemCategories; ++c) j[category_name(static_cast<MemCategory>(c))] = b[static_cast<std::size_t>(c)];
  return j;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// ---- one rank --------------------------------------------------------------------------------

std::string RankFigures::encode() const {
  json j;
  j["device"] = device;
  j["step_s"] = step_s;
  j["phases_s"] = phases_s;
  j["stream_busy_s"] = stream_busy_s;
  j["expert"] = {expert_flops, expert_gemm_s};
  j["overlap"] = {compute_busy_s, comm_s, hidden_comm_s, copy_s};
  j["flops"] = flops;
  j["peak_device"] = peak_device;
  j["at_peak"] = category_json(at_peak);
  j["peak_per_category"] = category_json(peak_per_category);
  json mb = json::object();
  for (const auto& [k, v] : microbatch_at_peak) mb[std::to_string(k)] = v;
  j["microbatch_at_peak"] = mb;
  j["pool"] = pool_json(pool);
  j["routing"] = {{"dropped", dropped}, {"capacity", capacity}, {"recv_per_local", recv_per_local}, {"routed", routed}};
  j["bare_gemm_s"] = bare_gemm_s;
  j["floor_gemm_s"] = floor_gemm_s;
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

RankFigures RankFigures::decode(const std::string& s) {
  const json j = json::parse(s);
  RankFigures f;
  f.device = j.at("device").get<std::string>();
  f.step_s = j.at("step_s").get<std::vector<double>>();
  f.phases_s = j.at("phases_s").get<std::map<std::string, double>>();
  f.stream_busy_s = j.at("stream_busy_s").get<std::map<std::string, double>>();
  f.expert_flops = j.at("expert")[0].get<double>();
  f.expert_gemm_s = j.at("expert")[1].get<double>();
  f.compute_busy_s = j.at("overlap")[0].get<double>();
  f.comm_s = j.at("overlap")[1].get<double>();
  f.hidden_comm_s = j.at("overlap")[2].get<double>();
  f.copy_s = j.at("overlap")[3].get<double>();
  f.flops = j.at("flops").get<double>();
  f.peak_device = j.at("peak_device").get<std::size_t>();
  f.at_peak = category_from(j.at("at_peak"));
  f.peak_per_category = category_from(j.at("peak_per_category"));
  for (const auto& [k, v] : j.at("microbatch_at_peak").items()) f.microbatch_at_peak[std::stoi(k)] = v.get<std::size_t>();
  if (!j.at("pool").is_null())
    f.pool = Backend::DevicePoolPeak{j["pool"]["used_high"].get<std::uint64_t>(), j["pool"]["reserved_high"].get<std::uint64_t>()};
  const json& r = j.at("routing");
  f.dropped = r.at("dropped").get<std::int64_t>();
  f.capacity = r.at("capacity").get<std::int64_t>();
  f.recv_per_local = r.at("recv_per_local").get<std::vector<std::int64_t>>();
  f.routed = r.at("routed").get<std::vector<std::vector<std::int64_t>>>();
  f.bare_gemm_s = j.at("bare_gemm_s").get<double>();
  f.floor_gemm_s = j.at("floor_gemm_s").get<double>();
  return f;
}

// Phase time = summed duration of the phase's ops over every stream, per step. Phases that
// overlap on different streams can therefore add up to more than the step: that is the
// overlap the schedules are after.
void add_timeline_figures(RankFigures& f, const std::vector<OpRecord>& ops, int steps,
                          const std::vector<std::string>& phases) {
  std::map<std::string, double> ph;
  for (const auto& p : phases) ph[p] = 0.0;
  std::map<int, std::string> stream_names;
  std::map<std::string, int> name_uses;
  for (const auto& op : ops)
    if (stream_names.emplace(op.stream_id, op.stream_name).second) ++name_uses[op.stream_name];
  std::map<std::string, double> streams;
  double expert_flops = 0.0, expert_gemm_s = 0.0, flops = 0.0;
  for (const auto& op : ops) {
    const double d = op.end - op.start;
    ph[op.phase] += d;
    const std::string key =
        name_uses[op.stream_name] > 1 ? op.stream_name + "#" + std::to_string(op.stream_id) : op.stream_name;
    streams[key] += d;
    flops += op.cost.flops;
    if (op.phase == "experts" && op.cost.kind == OpKind::gemm) {
      expert_flops += op.cost.flops;
      expert_gemm_s += d;
    }
  }
  const double n = static_cast<double>(steps);
  f.phases_s.clear();
  for (const auto& [k, v] : ph) f.phases_s[k] = v / n;
  f.stream_busy_s.clear();
  for (const auto& [k, v] : streams) f.stream_busy_s[k] = v / n;
  f.expert_flops = expert_flops / n;
  f.expert_gemm_s = expert_gemm_s / n;
  f.flops = flops / n;
  const OverlapFigures o = overlap_figures(ops);
  f.compute_busy_s = o.compute_busy / n;
  f.comm_s = o.comm_time / n;
  f.hidden_comm_s = o.hidden_comm / n;
  f.copy_s = o.copy_time / n;
}

void add_memory_figures(RankFigures& f, const Backend& b) {
  const MemoryTracker& mem = b.memory();
  f.peak_device = mem.peak_device();
  f.at_peak = mem.at_peak();
  f.peak_per_category = mem.peak_per_category();
  f.microbatch_at_peak = mem.at_peak_microbatches();
  f.pool = b.device_pool_peak();
}

// ---- the run -----------------------------------------------------------------------------------

RunFigures aggregate(const std::vector<RankFigures>& ranks) {
  RunFigures a;
  const std::size_t world = ranks.size();
  const std::size_t steps = ranks.empty() ? 0 : ranks[0].step_s.size();
  a.steps.assign(steps, 0.0);
  for (const auto& r : ranks)
    for (std::size_t i = 0; i < steps; ++i) a.steps[i] = std::max(a.steps[i], r.step_s[i]);
  if (steps > 0) {
    a.step_median = median(a.steps);
    a.step_mean = std::accumulate(a.steps.begin(), a.steps.end(), 0.0) / static_cast<double>(steps);
    a.step_min = *std::min_element(a.steps.begin(), a.steps.end());
    a.step_max = *std::max_element(a.steps.begin(), a.steps.end());
  }
  for (const auto& r : ranks) {
    for (const auto& [k, v] : r.phases_s) a.phases_s[k] = std::max(a.phases_s[k], v);
    for (const auto& [k, v] : r.stream_busy_s) a.stream_busy_s[k] = std::max(a.stream_busy_s[k], v);
  }
  // Achieved TFLOP/s of one device: its experts' GEMM FLOPs over its experts phase time,
  // averaged over the ranks; the same FLOPs over the GEMMs' own time show how much of the
  // phase is not GEMM (activation, copies).
  const double w = static_cast<double>(world);
  for (const auto& r : ranks) {
    const auto it = r.phases_s.find("experts");
    const double t = it == r.phases_s.end() ? 0.0 : it->second, tg = r.expert_gemm_s;
    if (t > 0) a.expert_tflops += r.expert_flops / t / 1e12 / w;
    if (tg > 0) a.expert_gemm_tflops += r.expert_flops / tg / 1e12 / w;
    a.expert_gemm_s = std::max(a.expert_gemm_s, r.expert_gemm_s);
    a.bare_gemm_s = std::max(a.bare_gemm_s, r.bare_gemm_s);
    a.floor_gemm_s = std::max(a.floor_gemm_s, r.floor_gemm_s);
    a.flops_per_rank_max = std::max(a.flops_per_rank_max, r.flops);
  }
  a.expert_vs_bare = a.bare_gemm_s > 0 ? a.expert_gemm_s / a.bare_gemm_s : 0.0;
  a.expert_vs_floor = a.floor_gemm_s > 0 ? a.expert_gemm_s / a.floor_gemm_s : 0.0;

  // Overlap: summed over ranks for the ratio; the slowest rank's for times.
  double comm_sum = 0, hidden_sum = 0, compute_busy_min = 1e300, compute_busy_max = 0;
  for (const auto& r : ranks) {
    comm_sum += r.comm_s;
    hidden_sum += r.hidden_comm_s;
    a.comm_s = std::max(a.comm_s, r.comm_s);
    a.copy_s = std::max(a.copy_s, r.copy_s);
    compute_busy_min = std::min(compute_busy_min, r.compute_busy_s);
    compute_busy_max = std::max(compute_busy_max, r.compute_busy_s);
  }
  a.compute_busy_s = compute_busy_min;
  a.overlap_ratio = comm_sum > 0 ? hidden_sum / comm_sum : 1.0;
  a.exposed_comm_s = std::max(0.0, a.step_median - compute_busy_min);
  a.overlap_limit_s = std::max(a.comm_s, compute_busy_max);

  for (std::size_t r = 1; r < world; ++r)
    if (ranks[r].peak_device > ranks[a.peak_rank].peak_device) a.peak_rank = r;
  if (world > 0 && ranks[0].pool) {
    for (std::size_t r = 1; r < world; ++r)
      if (ranks[r].pool && ranks[r].pool->used_high > ranks[a.pool_rank].pool->used_high) a.pool_rank = r;
    a.pool = ranks[a.pool_rank].pool;
    for (const auto& r : ranks)
      if (r.pool) a.pool->reserved_high = std::max(a.pool->reserved_high, r.pool->reserved_high);
  }

  std::vector<std::string> devices;
  for (const auto& r : ranks) {
    a.dropped += r.dropped;
    a.recv_per_local.insert(a.recv_per_local.end(), r.recv_per_local.begin(), r.recv_per_local.end());
    if (std::find(devices.begin(), devices.end(), r.device) == devices.end()) devices.push_back(r.device);
  }
  for (const auto& d : devices) a.device += (a.device.empty() ? "" : " | ") + d;
  return a;
}

void set_layer_time(RunFigures& f, double layer_s) {
  f.layer_s = layer_s;
  f.layer_vs_floor = f.floor_gemm_s > 0 ? layer_s / f.floor_gemm_s : 0.0;
}

double adam_state_factor(int param_elem_bytes) {
  if (param_elem_bytes == 4) return 2.0;   // m, v in fp32
  if (param_elem_bytes == 2) return 6.0;   // fp32 master, m, v: 12 bytes per 2-byte parameter
  return 0.0;
}

json metrics_json(const RunFigures& f, const std::vector<RankFigures>& ranks, double tokens_per_s,
                  const std::string& gemm_library, const std::string& floor_library, int param_elem_bytes) {
  const RankFigures& pk = ranks[f.peak_rank];
  json m;
  m["step_time_s"] = {{"median", f.step_median}, {"mean", f.step_mean}, {"min", f.step_min}, {"max", f.step_max},
                      {"all", f.steps}};
  m["tokens_per_s"] = tokens_per_s;
  m["phases_s"] = f.phases_s;
  m["stream_busy_s"] = f.stream_busy_s;
  m["comm_s"] = f.comm_s;
  m["compute_busy_s"] = f.compute_busy_s;
  m["exposed_comm_s"] = f.exposed_comm_s;
  m["overlap_ratio"] = f.overlap_ratio;
  m["overlap_limit_s"] = f.overlap_limit_s;
  m["host_copy_s"] = f.copy_s;
  m["expert_tflops"] = f.expert_tflops;
  m["expert_gemm_tflops"] = f.expert_gemm_tflops;
  m["expert_gemm_s"] = f.expert_gemm_s;
  m["bare_gemm_s"] = f.bare_gemm_s;
  m["bare_gemm_library"] = gemm_library;
  m["expert_vs_bare_ratio"] = f.expert_vs_bare;
  // The floor and the ratios to it; null where no expert had a row (no floor to compare with).
  const bool floor = f.floor_gemm_s > 0;
  m["floor_gemm_s"] = f.floor_gemm_s;
  m["floor_gemm_library"] = floor_library;
  m["moe_layer_s"] = f.layer_s;
  m["expert_vs_floor_ratio"] = floor ? json(f.expert_vs_floor) : json(nullptr);
  m["layer_vs_floor_ratio"] = floor ? json(f.layer_vs_floor) : json(nullptr);
  m["peak_memory_bytes"] = {{"device_total", pk.peak_device},
                            {"rank", f.peak_rank},
                            {"by_category_at_peak", category_json(pk.at_peak)},
                            {"peak_per_category", category_json(pk.peak_per_category)}};
  // The peak with and without the optimizer's state. A run with an optimizer tracks it (its
  // category at the peak); a run without one (an MoE layer's forward + backward) gets Adam's
  // state for the rank's parameters added: it lives through the whole step, so it adds to the
  // peak exactly.
  {
    const auto at = [](const CategoryBytes& b, MemCategory c) { return b[static_cast<std::size_t>(c)]; };
    const double total = static_cast<double>(pk.peak_device);
    json o;
    if (at(pk.at_peak, MemCategory::optimizer) > 0) {
      const double opt = static_cast<double>(at(pk.at_peak, MemCategory::optimizer));
      o = {{"with", total}, {"without", total - opt}, {"state_bytes", opt},
           {"source", "the run's optimizer, tracked (its category at the peak)"}};
    } else if (const double k = adam_state_factor(param_elem_bytes); k > 0) {
      const double state = k * static_cast<double>(at(pk.peak_per_category, MemCategory::weights));
      o = {{"with", total + state}, {"without", total}, {"state_bytes", state},
           {"source", param_elem_bytes == 4
                          ? "Adam added (no optimizer in the run): fp32 m and v, 2 x the parameters' bytes"
                          : "Adam added (no optimizer in the run): mixed precision, fp32 master copy, m and v = "
                            "12 bytes per 16-bit parameter (ZeRO, Rajbhandari et al. SC'20, section 3.1)"}};
    }
    if (!o.is_null()) m["peak_memory_bytes"]["optimizer_state"] = o;
  }
  // The device allocator's own high-water marks (cuda), the highest rank's.
  if (f.pool) {
    json pool = pool_json(ranks[f.pool_rank].pool);
    pool["rank"] = f.pool_rank;
    m["peak_memory_bytes"]["device_pool"] = pool;
  }
  m["routing"] = {{"dropped", f.dropped}, {"capacity", ranks[0].capacity}, {"recv_per_local_expert", f.recv_per_local}};
  return m;
}

}  // namespace moelab
