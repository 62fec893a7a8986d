// harness/cli/run_model.cpp — `moelab run --model FILE`: training steps of a whole model (or
// of a range of its layers) on one backend, its MoE layers served by --impl.
//
//   moelab run --model experiments/models/tiny-moe.json --impl fastmoe --backend cpu --steps 20
//   moelab run --model experiments/models/gpt3-moe-xl.json --impl fastmoe --backend sim --cluster a800x1
//   mpirun -n 2 moelab run --model experiments/models/tiny-moe.json --impl mpipemoe --backend cpu
//   mpirun -n 4 moelab run --model experiments/models/tiny-moe.json --impl fastmoe --backend cpu
//       --parallel pp=2,dp=2,ep=2 --schedule 1f1b --microbatches 8      (one command line)
//
// A step: zero_grad; for each of --microbatches microbatches of --micro-batch sequences: forward,
// backward (block by block, input then weight gradients); the replicated parameters' gradients
// summed over the ranks in buckets that overlap backward (data parallelism, GradSync; the
// experts are sharded by expert parallelism over the same ranks); one optimizer step. With
// --inference a step is the forward passes alone, each block's activations released as soon
// as the next block has them. With --parallel (or --schedule, --chunks, --recompute) the layout is
// parsed and checked against the world and the model before any work (exit 2), the process
// groups are built, and each rank runs its stage of the pipeline (harness/pipeline/): the
// schedule's node list over its model chunks, gradients summed over its data-parallel group
// at the optimizer node; the result adds the layout, the schedule, per-stage figures (work,
// bubble, peak activation memory) and, on sim, the bytes sent over each link class. Inputs are the synthetic language of harness/nn/data.hpp, new tokens
// every step, uploaded before the step's clock starts (a stage without
// the embedding gets random activations, one without the head a random output gradient).
// Reported: tokens/s, step time split by block kind (attention, mlp, the MoE layer's phases,
// embedding, head, optimizer), model FLOPs utilisation where the backend knows its peak,
// memory by category and by microbatch at the peak, the loss, and the Chrome trace (--trace).
// Bad input: exit 2 on every rank before any work, nothing written.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <numeric>
#include <optional>

#include <nlohmann/json.hpp>

#include "harness/backends/sim/sim_backend.hpp"
#include "harness/cli/run_common.hpp"
#include "harness/comm/world.hpp"
#include "harness/config/model.hpp"
#include "harness/metrics/results.hpp"
#include "harness/metrics/run_figures.hpp"
#include "harness/metrics/trace.hpp"
#include "harness/nn/data.hpp"
#include "harness/nn/grad_sync.hpp"
#include "harness/comm/groups.hpp"
#include "harness/nn/model.hpp"
#include "harness/nn/text_data.hpp"
#include "harness/pipeline/executor.hpp"
#include "harness/runtime/error.hpp"
#include "harness/runtime/random.hpp"
#include "harness/sim/cluster.hpp"

namespace moelab::cli {

using nlohmann::json;

namespace {

const std::vector<std::string> kModelPhases = {"embedding", "attention", "mlp",  "moe",     "gate",
                                               "dispatch",  "migrate",   "experts", "combine", "merge",
                                               "head",      "grad_sync", "optimizer"};

// A --parallel run's layout and schedule, checked before any work.
struct PipelinePlan {
  GroupLayout layout;
  pipeline::Schedule schedule;
  pipeline::Recompute recompute = pipeline::Recompute::none;
  bool pad_layers = false;
  pipeline::OffloadOptions offload;  // chunks 0: no offloading; the copy times are set per machine
  bool sequence_parallel = false;
  GradSyncOptions sync;  // the bucketed gradient synchroniser (harness/nn/grad_sync.hpp)
};

// gpus_per_node: the cluster model's on sim; the world on cpu and cuda, whose node placement
// (host names) ProcessGroups checks once the ranks are up.
PipelinePlan plan_pipeline(const RunOptions& opt, const TransformerConfig& cfg, int world, int gpus_per_node) {
  PipelinePlan p;
  p.layout = check_layout(ParallelLayout::parse(opt.parallel), world, gpus_per_node, cfg);
  p.recompute = pipeline::parse_recompute(opt.recompute.empty() ? "none" : opt.recompute);
  p.schedule = pipeline::make_schedule(opt.schedule.empty() ? "1f1b" : opt.schedule, p.layout.pp, opt.microbatches,
                                       opt.chunks, opt.group);
  p.pad_layers = opt.pad_layers;
  pipeline::check_pipeline(cfg, p.schedule, p.pad_layers);
  if (opt.offload_chunks != 0) {
    p.offload.chunks = opt.offload_chunks < 0 ? p.schedule.chunks : opt.offload_chunks;
    if (p.offload.chunks > p.schedule.chunks)
      throw ConfigError("--offload-chunks " + std::to_string(p.offload.chunks) + " exceeds the " +
                        std::to_string(p.schedule.chunks) + " model chunks per stage of schedule " + p.schedule.name +
                        " (\"all\" offloads every chunk)");
    if (p.recompute == pipeline::Recompute::full)
      throw ConfigError("--offload-chunks with --recompute full: full recomputation keeps only each chunk's input; "
                        "offload or recompute, not both");
    p.offload.lifespan = opt.offload_lifespan;
    pipeline::Schedule dry = p.schedule;  // the pass's own checks, before any work
    pipeline::add_offload(dry, p.offload);
  }
  // The process groups have an expert-TP communicator, but no MoE implementation splits its
  // experts over it yet: refuse rather than train replicas that nothing keeps equal.
  if (p.layout.etp > 1)
    throw ConfigError("parallel layout " + p.layout.to_string() + ": etp = " + std::to_string(p.layout.etp) +
                      " (expert tensor parallelism) is not supported by the MoE implementations; use etp=1");
  p.sequence_parallel = opt.sequence_parallel;
  if (p.sequence_parallel && p.layout.tp == 1)
    throw ConfigError("--sequence-parallel needs tensor parallelism (tp > 1 in --parallel " + p.layout.to_string() + ")");
  const std::int64_t T = opt.micro_batch * cfg.seq_len;
  if (p.sequence_parallel && T % p.layout.tp != 0)
    throw ConfigError("--sequence-parallel: the " + std::to_string(T) + " tokens of a microbatch do not split over tp = " +
                      std::to_string(p.layout.tp));
  p.sync.zero1 = opt.zero1;
  if (opt.grad_bucket > 0) p.sync.bucket_elems = opt.grad_bucket;
  return p;
}

// An --inference run's --parallel: replicas of the whole model, data × expert parallel only.
std::optional<GroupLayout> replica_layout(const RunOptions& opt, const TransformerConfig& cfg, int world, int gpus_per_node) {
  if (!opt.inference || opt.parallel.empty()) return std::nullopt;
  GroupLayout l = check_layout(ParallelLayout::parse(opt.parallel), world, gpus_per_node, cfg);
  if (l.tp != 1 || l.pp != 1 || l.etp != 1)
    throw ConfigError("--inference --parallel " + l.to_string() + ": inference runs whole-model replicas; only dp and ep may "
                      "exceed 1");
  return l;
}

// What one rank trains: the model (or its --layers range) as one Model whose replicated
// gradients are summed over every rank; or, with --parallel, its stage of a pipeline.
struct Trainee {
  std::unique_ptr<ProcessGroups> groups;
  std::unique_ptr<pipeline::PipelineStage> stage;
  std::unique_ptr<Model> model;
  // Without a pipeline: the replicated parameters' gradients summed over every rank (a
  // communicator of its own, the world's members) in 25 MiB buckets overlapping backward, as
  // PyTorch's DistributedDataParallel does (Li et al., VLDB 2020); the experts are sharded
  // over the same ranks, so their group is the rank alone.
  std::unique_ptr<Communicator> dp, edp;
  std::unique_ptr<GradSync> sync;

  std::vector<Model*> chunks() { return stage ? stage->chunks() : std::vector<Model*>{model.get()}; }
  bool has_embedding() { return stage ? stage->has_embedding() : model->has_embedding(); }
  bool has_head() { return stage ? stage->has_head() : model->has_head(); }
  std::vector<Param> parameters() { return stage ? stage->parameters() : model->parameters(); }
  Stream& stream() { return stage ? stage->stream() : model->stream(); }
  std::vector<MoEImpl*> moe_layers() {
    std::vector<MoEImpl*> v;
    for (Model* m : chunks())
      for (MoEImpl* x : m->moe_layers()) v.push_back(x);
    return v;
  }
  double model_flops(std::int64_t tokens) {
    double f = 0;
    for (Model* m : chunks()) f += m->model_flops(tokens);
    return f;
  }
  int first_layer() {
    int f = 1 << 30;
    for (Model* m : chunks()) f = std::min(f, m->first_layer());
    return f;
  }
  int last_layer() {
    int l = 0;
    for (Model* m : chunks()) l = std::max(l, m->last_layer());
    return l;
  }
};

// Checks that need the world size, before anything is built.
void validate_model_for_world(const TransformerConfig& cfg, const RunOptions& opt, int world) {
  const int last = opt.last_layer < 0 ? cfg.num_layers : opt.last_layer;
  if (last > cfg.num_layers)
    throw ConfigError("--layers " + std::to_string(opt.first_layer) + ":" + std::to_string(last) + ": " + shown(cfg.origin) +
                      " has " + std::to_string(cfg.num_layers) + " layers");
  bool any_moe = false;
  for (int l = opt.first_layer; l < last; ++l) any_moe = any_moe || cfg.is_moe(l);
  if (any_moe && cfg.moe.num_experts % world != 0)
    throw ConfigError(shown(cfg.origin) + ": moe.num_experts = " + std::to_string(cfg.moe.num_experts) +
                      " is not divisible by the expert-parallel degree " + std::to_string(world) + " (the ranks)");
}

// The implementation's options checked against every MoE layer's configuration and tokens (a
// vision model's stages differ in width and tokens; a language model's layers are alike).
void check_impl_options_for(const RunOptions& opt, const TransformerConfig& cfg, int ep) {
  std::int64_t last_grid = -1;
  for (int l = 0; l < cfg.num_layers; ++l) {
    if (!cfg.is_moe(l)) continue;
    const TransformerConfig c = cfg.layer_config(l);
    if (c.grid == last_grid) continue;
    last_grid = c.grid;
    const std::int64_t tokens = opt.micro_batch * (c.grid > 0 ? c.grid * c.grid : c.seq_len);
    check_impl_options(opt.impl, opt.impl_options, {c.moe, ep, tokens, c.shared_expert_hidden});
    if (c.grid == 0) return;
  }
  if (last_grid < 0) check_impl_options(opt.impl, opt.impl_options, {cfg.moe, ep, opt.micro_batch * cfg.seq_len, cfg.shared_expert_hidden});
}

Tensor random_rows(Backend& b, std::int64_t rows, std::int64_t width, DType dt, std::uint64_t seed) {
  Tensor t = b.empty({rows, width}, dt, MemCategory::activations, b.default_stream());
  if (!b.has_data()) return t;
  Rng rng(seed);
  std::vector<float> host(static_cast<std::size_t>(t.numel()));
  for (auto& v : host) v = static_cast<float>(rng.uniform(-1.0, 1.0));
  b.upload(host, t);
  return t;
}

// outputs: where rank 0 stages its files (null on the other ranks). preflight: one step, no
// warm-up, and stop after it (start_run's check on a simulated copy of the world).
// The result's "parallel" object (docs/RESULTS-SCHEMA.md) from every rank's part: per step the
// pipeline's window is the first F/B/W start to the last end over all ranks (times from each
// rank's step start, which a barrier aligns), a stage's bubble 1 - its work / that window.
json pipeline_json(const PipelinePlan& plan, const json& parts) {
  const std::size_t steps = parts.at(0).at("work").size();
  std::vector<double> span(steps, 0.0);
  for (std::size_t i = 0; i < steps; ++i) {
    double first = 1e300, last = -1e300;
    for (const auto& r : parts) {
      first = std::min(first, r["work"][i][1].get<double>());
      last = std::max(last, r["work"][i][2].get<double>());
    }
    span[i] = std::max(last - first, 0.0);
  }
  const bool sim_links = !parts.at(0)["link_bytes"].is_null();
  json stages = json::array();
  double bubble_sum = 0;
  sim::LinkBytes total;
  std::map<std::string, sim::LinkBytes> total_by;
  const auto bytes_of = [](const json& l) {
    return sim::LinkBytes{l["nvlink"].get<double>(), l["pcie"].get<double>(), l["nic"].get<double>()};
  };
  const auto to_json = [](const std::map<std::string, sim::LinkBytes>& m) {
    json j = json::object();
    for (const auto& [k, v] : m) j[k] = v.to_json();
    return j;
  };
  for (int st = 0; st < plan.schedule.stages; ++st) {
    json ranks = json::array();
    double work = 0, own = 0, bubble = 0;
    std::size_t act = 0, buf = 0, dev = 0, n = 0;
    sim::LinkBytes links;
    std::map<std::string, sim::LinkBytes> links_by;
    int in_flight = 0;
    for (std::size_t r = 0; r < parts.size(); ++r) {
      const json& x = parts[r];
      if (x["stage"].get<int>() != st) continue;
      ranks.push_back(r);
      ++n;
      for (std::size_t i = 0; i < steps; ++i) {
        const double busy = x["work"][i][0].get<double>();
        work += busy;
        own += x["work"][i][2].get<double>() - x["work"][i][1].get<double>();
        bubble += span[i] > 0 ? 1.0 - busy / span[i] : 0.0;
      }
      act = std::max(act, x["peak_activations"].get<std::size_t>());
      buf = std::max(buf, x["peak_buffers"].get<std::size_t>());
      dev = std::max(dev, x["peak_device"].get<std::size_t>());
      in_flight = x["in_flight"].get<int>();
      if (sim_links) {
        const json& l = x["link_bytes"];
        links += bytes_of(l);
        for (const auto& [k, v] : x["link_bytes_by_collective"].items()) {
          links_by[k] += bytes_of(v);
          total_by[k] += bytes_of(v);
        }
      }
    }
    const double k = static_cast<double>(std::max<std::size_t>(n * steps, 1));
    total += links;
    bubble_sum += bubble / k;
    stages.push_back({{"stage", st},
                      {"ranks", ranks},
                      {"work_s", work / k},
                      {"span_s", own / k},
                      {"bubble", bubble / k},
                      {"peak_activation_bytes", act},
                      {"peak_buffer_bytes", buf},
                      {"peak_device_bytes", dev},
                      {"microbatches_in_flight", in_flight},
                      {"link_bytes", sim_links ? links.to_json() : json(nullptr)},
                      {"link_bytes_by_collective", sim_links ? to_json(links_by) : json(nullptr)}});
  }
  const pipeline::Schedule& s = plan.schedule;
  // The closed form of each stage's peak activation memory, in units of M_a (docs/pipeline-memory.md).
  json expected = nullptr;
  try {
    expected = pipeline::expected_peak_activation(s, plan.offload.chunks);
  } catch (const ConfigError&) {
    // no closed form for this schedule and offload (the doc says which)
  }
  for (std::size_t st = 0; st < stages.size(); ++st)
    stages[st]["expected_peak_activation_ma"] = expected.is_null() ? json(nullptr) : expected[st];
  return {{"layout", plan.layout.to_json()},
          {"spec", plan.layout.to_string()},
          {"schedule", {{"name", s.name},
                        {"stages", s.stages},
                        {"microbatches", s.microbatches},
                        {"chunks", s.chunks},
                        {"group", s.group},
                        {"pad_layers", plan.pad_layers},
                        {"placement", pipeline::placement_name(s.placement)},
                        {"recompute", pipeline::recompute_name(plan.recompute)}}},
          {"sequence_parallel", plan.sequence_parallel},
          {"gradient_sync", {{"kind", plan.sync.zero1 ? "zero1" : "bucketed_all_reduce"},
                             {"bucket_elems", plan.sync.bucket_elems}}},
          {"bubble", bubble_sum / s.stages},
          {"pipeline_window_s", median(span)},
          {"stages", stages},
          {"link_bytes", sim_links ? total.to_json() : json(nullptr)},
          {"link_bytes_by_collective", sim_links ? to_json(total_by) : json(nullptr)}};
}

// PipeOffload's cost condition (Wan et al. 2025, §3): k = the time to move one transformer
// layer's saved activations over the host link / that layer's forward + backward compute.
// Their estimate (the authors' zbpp_utils.get_offload_time): about 20 values per token and
// hidden unit saved, 16-bit, so k = 10 / (3·(6h + s)) · B_c / B_o, B_c the compute rate, B_o
// the host link's. Here B_c is the backend's rate for a [T,h]x[h,h] GEMM (a GEMM's rate, above
// the achieved training throughput the authors profiled: 220 TFLOP/s on an A100) and B_o its
// pinned copy rate (sim: the cluster model and calibration); unknown (cpu): 0, and the pass
// places the copies as if free. The placement's copy time is the authors' too: their
// --auto-offload-time sets offload_time = k / 2 (get_offload_time returns k / 2.0), and their
// add_offload times each copy (F + B + W)·offload_time, so with F, B, W one unit each a copy
// takes 1.5·k_paper units (kPlacedCopyPerK).
constexpr double kPlacedCopyPerK = 3.0 / 2.0;
struct OffloadModel {
  double bc = 0, bo = 0, k_paper = 0;
};
OffloadModel offload_model(Backend& b, const TransformerConfig& cfg, std::int64_t tokens) {
  OffloadModel m;
  const MachineRates r = b.machine_rates(tokens, cfg.d_model, cfg.d_model, cfg.dtype);
  m.bc = r.gemm_flops;
  m.bo = r.host_copy_bytes;
  if (m.bc > 0 && m.bo > 0)
    m.k_paper = 10.0 / (3.0 * (6.0 * static_cast<double>(cfg.d_model) + static_cast<double>(cfg.seq_len))) * m.bc / m.bo;
  return m;
}

// The result's "parallel"."offload" object: what was planned and moved, the cost condition k
// (the paper's estimate, and ours from the bytes our layers really saved and this run's
// compute), and the overhead the schedule's estimate predicts with our k.
json offload_json(const PipelinePlan& plan, const pipeline::OffloadPlan& op, const json& parts, const OffloadModel& om,
                  const json& par, const TransformerConfig& cfg, int microbatches, std::int64_t tokens) {
  // k of a plain transformer layer: the chunks and stages that also hold the embedding or the
  // head (the logits) save and compute more per layer, so the smallest figures are the layers'.
  json stages = json::array();
  double bytes_per_layer = 0, work_per_layer = 0;
  const auto least = [](double& at, double v) { at = at > 0 ? std::min(at, v) : v; };
  for (std::size_t st = 0; st < op.kept.size(); ++st) {
    json ranks_bytes = 0, peak_host = 0, transfers = 0;
    for (const auto& x : parts) {
      if (x["stage"].get<std::size_t>() != st) continue;
      const json& o = x["offload"];
      transfers = o["transfers"];
      ranks_bytes = o["bytes"];
      peak_host = std::max(peak_host.get<std::size_t>(), o["peak_host_bytes"].get<std::size_t>());
      for (std::size_t c = 0; c < o["chunk_bytes"].size(); ++c) {
        const double b = o["chunk_bytes"][c].get<double>(), l = o["chunk_layers"][c].get<double>();
        if (b > 0 && l > 0) least(bytes_per_layer, b / l);
      }
    }
    stages.push_back({{"stage", st},
                      {"planned", op.planned[st]},
                      {"kept", op.kept[st]},
                      {"skipped_gap", op.skipped_gap[st]},
                      {"skipped_peak", op.skipped_peak[st]},
                      {"plan_peak_resident", op.peak_resident[st]},
                      {"plan_peak_host", op.peak_host[st]},
                      {"transfers_per_step", transfers},
                      {"bytes_per_step", ranks_bytes},
                      {"peak_host_bytes", peak_host}});
  }
  // This run's compute per layer: a stage's F + B + W work per step over its microbatches'
  // layers (every rank of a stage holds the same chunks).
  for (const auto& st : par["stages"]) {
    const auto x = std::find_if(parts.begin(), parts.end(), [&](const json& r) { return r["stage"] == st["stage"]; });
    int layers = 0;
    for (const auto& l : (*x)["offload"]["chunk_layers"]) layers += l.get<int>();
    if (layers > 0) least(work_per_layer, st["work_s"].get<double>() / (layers * microbatches));
  }
  const double k = om.bo > 0 && work_per_layer > 0 && bytes_per_layer > 0 ? bytes_per_layer / om.bo / work_per_layer : 0;
  // The overhead the schedule's own estimate predicts with this k (F, B, W one unit each): the
  // schedule the run ran (placed with the paper's k, or as if free with every transfer kept),
  // its copies timed with the k measured here.
  pipeline::Schedule with = plan.schedule;
  pipeline::OffloadOptions oo = plan.offload;
  oo.d2h = oo.h2d = oo.lifespan ? kPlacedCopyPerK * om.k_paper : 0.0;
  pipeline::add_offload(with, oo);
  pipeline::NodeCosts costs;
  costs.offload = costs.reload = 3.0 * (k > 0 ? k : om.k_paper);
  const pipeline::ScheduleEstimate est = pipeline::estimate(with, costs);
  const double base = pipeline::estimate(plan.schedule, costs).makespan, off = est.makespan;
  // Per stage, the share of the step its compute would wait for reloads the gap cannot hide.
  for (std::size_t st = 0; st < stages.size() && st < est.exposed.size(); ++st)
    stages[st]["predicted_exposed_share"] = off > 0 ? est.exposed[st] / off : 0.0;
  const double paper_activation_bytes = 20.0 * 2.0 * static_cast<double>(tokens) * static_cast<double>(cfg.d_model);
  return {{"chunks", plan.offload.chunks},
          {"full", plan.offload.chunks >= plan.schedule.chunks},
          {"lifespan_rule", plan.offload.lifespan},
          {"gemm_flops", om.bc > 0 ? json(om.bc) : json(nullptr)},
          {"host_copy_bytes_per_s", om.bo > 0 ? json(om.bo) : json(nullptr)},
          {"k_paper", om.k_paper > 0 ? json(om.k_paper) : json(nullptr)},
          {"k", k > 0 ? json(k) : json(nullptr)},
          {"saved_bytes_per_layer", bytes_per_layer},
          {"paper_saved_bytes_per_layer", paper_activation_bytes},
          {"compute_per_layer_s", work_per_layer},
          {"predicted_overhead", base > 0 ? off / base - 1.0 : 0.0},
          {"stages", stages}};
}

void print_pipeline(const json& par, int steps) {
  std::printf("pipeline        bubble %.1f%% (mean over stages; window %.3f ms)\n", 100.0 * par["bubble"].get<double>(),
              par["pipeline_window_s"].get<double>() * 1e3);
  std::printf("%-6s %-14s %10s %8s %14s %14s %9s\n", "stage", "ranks", "work ms", "bubble", "activations MiB",
              "peak MiB", "in flight");
  for (const auto& st : par["stages"]) {
    std::string ranks;
    for (const auto& r : st["ranks"]) ranks += (ranks.empty() ? "" : ",") + std::to_string(r.get<int>());
    if (ranks.size() > 14) ranks = ranks.substr(0, 11) + "...";
    std::printf("%-6d %-14s %10.3f %7.1f%% %15.1f %14.1f %9d\n", st["stage"].get<int>(), ranks.c_str(),
                st["work_s"].get<double>() * 1e3, 100.0 * st["bubble"].get<double>(),
                static_cast<double>(st["peak_activation_bytes"].get<std::size_t>()) / kMiB,
                static_cast<double>(st["peak_device_bytes"].get<std::size_t>()) / kMiB,
                st["microbatches_in_flight"].get<int>());
  }
  if (par.contains("offload")) {
    const json& o = par["offload"];
    int kept = 0, planned = 0;
    double moved = 0, host = 0;
    for (const auto& st : o["stages"]) {
      kept += st["kept"].get<int>();
      planned += st["planned"].get<int>();
      moved += st["bytes_per_step"].get<double>();
      host = std::max(host, st["peak_host_bytes"].get<double>());
    }
    std::printf("offload         chunks < %d: %d of %d planned transfers kept; %.1f MiB moved per step, peak host %.1f "
                "MiB/rank\n",
                o["chunks"].get<int>(), kept, planned, moved / kMiB, host / kMiB);
    std::printf("                k = %s (our saved bytes %.1f MiB/layer), paper's estimate %s; predicted overhead %.1f%%\n",
                o["k"].is_null() ? "unknown" : strf("%.3f", o["k"].get<double>()).c_str(),
                o["saved_bytes_per_layer"].get<double>() / kMiB,
                o["k_paper"].is_null() ? "unknown" : strf("%.3f", o["k_paper"].get<double>()).c_str(),
                100.0 * o["predicted_overhead"].get<double>());
  }
  if (!par["link_bytes"].is_null()) {
    const json& l = par["link_bytes"];
    std::printf("links           per step, all ranks: NVLink %.1f MiB, PCIe %.1f MiB, NIC %.1f MiB\n",
                l["nvlink"].get<double>() / kMiB / steps, l["pcie"].get<double>() / kMiB / steps,
                l["nic"].get<double>() / kMiB / steps);
  }
}

// plan: the checked layout and schedule of a --parallel run (null: every rank holds the model).
// data: --data's source, opened and checked before the run (null: the synthetic language).
// replicas: an --inference run's --parallel layout (dp × ep; null: expert parallel over all ranks).
int run_model_on_rank(Backend& b, Communicator& c, const RunOptions& opt, const TransformerConfig& cfg,
                      const Platform& platform, RunOutputs* outputs, const PipelinePlan* plan, int gpus_per_node,
                      const TrainingData* data, const GroupLayout* replica_layout, bool preflight = false) {
  const int rank = c.rank(), world = c.size();
  const int steps = preflight ? 1 : opt.steps > 0 ? opt.steps : 3;
  const int warmup = preflight ? 0 : opt.warmup >= 0 ? opt.warmup : 1;
  ModelOptions mo;
  mo.impl = opt.impl;
  mo.impl_options = opt.impl_options;
  mo.first_layer = opt.first_layer;
  mo.last_layer = opt.last_layer;
  const std::int64_t S = cfg.seq_len, T = opt.micro_batch * S, M = cfg.d_model;
  // The model and its optimizer outlive the handler below (abort_run): their destructors wait
  // for the device.
  Trainee model;
  std::unique_ptr<Optimizer> optimizer;
  try {
    pipeline::OffloadPlan offload_plan;
    // Ranks that read different tokens (data parallelism), and whose tokens this rank reads.
    int replicas = world, data_rank = rank;
    if (plan) {
      model.groups = std::make_unique<ProcessGroups>(
          c, plan->layout, b.name() == "sim" ? NodeMap::uniform(world, gpus_per_node) : gather_nodes(c));
      mo.tp = &model.groups->tp();
      pipeline::PipelineOptions po;
      po.model = mo;
      po.tokens = T;
      po.recompute = plan->recompute;
      po.pad_layers = plan->pad_layers;
      po.model.sequence_parallel = plan->sequence_parallel;
      // The offload pass, its copies timed by this machine's k (the same on every rank) as the
      // authors' add_offload times them: (F + B + W)·k/2, F, B and W one unit each.
      pipeline::Schedule sched = plan->schedule;
      if (plan->offload.chunks > 0) {
        pipeline::OffloadOptions oo = plan->offload;
        // --offload-all-lifespans keeps every transfer: neither rule, the copies placed as if free
        // (what they cost then shows in the step time).
        oo.d2h = oo.h2d = oo.lifespan ? kPlacedCopyPerK * offload_model(b, cfg, T).k_paper : 0.0;
        offload_plan = pipeline::add_offload(sched, oo);
      }
      model.stage = std::make_unique<pipeline::PipelineStage>(b, cfg, sched, model.groups->pp(), model.groups->ep(), po);
      model.stage->set_gradient_sync(&model.groups->dp(), &model.groups->edp());
      replicas = plan->layout.dp;
      data_rank = model.groups->coords().dp;
    } else if (replica_layout) {  // --inference on dp × ep replicas: each its own tokens
      model.groups = std::make_unique<ProcessGroups>(
          c, *replica_layout, b.name() == "sim" ? NodeMap::uniform(world, gpus_per_node) : gather_nodes(c));
      model.model = std::make_unique<Model>(b, model.groups->ep(), cfg, mo);
      replicas = replica_layout->dp;
      data_rank = model.groups->coords().dp;
    } else {
      model.model = std::make_unique<Model>(b, c, cfg, mo);
    }
    if (model.stage) {
      model.stage->init_parameters(opt.seed);
      model.stage->use_bucketed_sync(plan->sync);
    } else {
      model.model->init_parameters(opt.seed);
      if (opt.inference) {
        model.model->release_gradients();
        if (opt.offload_experts != "none") {
          const auto mode = opt.offload_experts == "async" ? MoELayer::ExpertOffload::async : MoELayer::ExpertOffload::sync;
          for (MoEImpl* m : model.model->moe_layers()) m->layer().offload_experts(mode);
        }
      } else {
        model.dp = c.dup();
        model.edp = c.split(rank, 0);
        // PyTorch DDP's bucket (bucket_cap_mb = 25, which Fairseq's --bucket-cap-mb keeps): the
        // data-parallel runs these model runs stand for; the pipeline path takes Megatron's.
        GradSyncOptions ddp;
        ddp.bucket_elems = std::max<std::int64_t>((std::int64_t{25} << 20) / static_cast<std::int64_t>(dtype_size(cfg.dtype)), 1);
        model.sync = std::make_unique<GradSync>(b, model.stream(), model.model->param_slots(), *model.dp, *model.edp,
                                                TensorParallel{}, ddp);
        model.model->set_grad_sync(model.sync.get());
      }
    }
    if (opt.optimizer != "none" && !opt.inference) {
      OptimizerConfig oc;
      oc.kind = parse_optimizer(opt.optimizer);
      oc.lr = static_cast<float>(opt.lr);
      if (model.stage)
        model.stage->make_optimizer(oc);  // per chunk on its synchroniser (ZeRO-1: sharded states)
      else
        optimizer = std::make_unique<Optimizer>(b, model.stream(), *model.sync, oc);
    }
    // The step's loss is the mean over its tokens (a vision model's: over its images).
    const bool vision = cfg.vision.enabled;
    const std::int64_t samples = vision ? opt.micro_batch : T;
    const float scale = 1.0f / static_cast<float>(samples * opt.microbatches * replicas);
    const auto next = vision ? std::vector<std::int32_t>() : synthetic_successor(cfg.vocab_size, opt.seed);
    const Tensor dy = model.has_head() || model.stage || opt.inference ? Tensor() : random_rows(b, T, M, cfg.dtype, Rng::mix(opt.seed, 2, static_cast<std::uint64_t>(rank)));

    // One batch per microbatch, new tokens every step, uploaded before the step's clock starts.
    std::vector<Batch> batches(static_cast<std::size_t>(opt.microbatches));
    for (int mb = 0; mb < opt.microbatches; ++mb) {
      Batch& x = batches[static_cast<std::size_t>(mb)];
      const std::uint64_t mb_seed = Rng::mix(opt.seed, 1, Rng::mix(static_cast<std::uint64_t>(data_rank), static_cast<std::uint64_t>(mb)));
      if (vision) {
        // Synthetic images: every patch's values uniform in [-1, 1) and a label per image, the
        // same every step (a batch the model can fit, so that its loss falls).
        x.input = random_rows(b, T, cfg.vision.patch_values(), cfg.dtype, mb_seed);
        x.targets = b.empty({samples}, DType::i32, MemCategory::activations, b.default_stream());
        if (b.has_data()) {
          Rng rng(Rng::mix(mb_seed, 3));
          std::vector<std::int32_t> labels(static_cast<std::size_t>(samples));
          for (auto& y : labels) y = static_cast<std::int32_t>(rng.uniform(0.0, 1.0) * static_cast<double>(cfg.vocab_size)) % static_cast<std::int32_t>(cfg.vocab_size);
          b.upload_i32(labels, x.targets);
        }
        x.loss_scale = scale;
        continue;
      }
      if (model.has_embedding()) x.input = b.empty({T}, DType::i32, MemCategory::activations, b.default_stream());
      else if (!model.stage) x.input = random_rows(b, T, M, cfg.dtype, Rng::mix(opt.seed, 1, Rng::mix(static_cast<std::uint64_t>(rank), static_cast<std::uint64_t>(mb))));
      if (model.has_head()) x.targets = b.empty({T}, DType::i32, MemCategory::activations, b.default_stream());
      x.loss_scale = scale;
    }
    auto prepare = [&](std::uint64_t step_no) {
      if (!b.has_data() || vision) return;
      for (int mb = 0; mb < opt.microbatches; ++mb) {
        const TokenBatch tb = data ? data->train(opt.micro_batch, opt.seed, step_no, mb, data_rank)
                                   : synthetic_batch(next, opt.micro_batch, S, opt.seed, step_no, mb, data_rank);
        Batch& x = batches[static_cast<std::size_t>(mb)];
        if (model.has_embedding()) b.upload_i32(tb.ids, x.input);
        if (model.has_head()) b.upload_i32(tb.targets, x.targets);
      }
    };

    std::vector<Tensor> losses;  // [T] fp32 per microbatch of the last step
    std::uint64_t step_no = 0;
    auto step = [&] {
      ++step_no;
      if (model.stage) {  // the schedule's nodes, its optimizer node included
        model.stage->step(batches, step_no);
        losses = model.stage->losses();
        b.synchronize();
        return;
      }
      Model& m = *model.model;
      losses.clear();
      if (opt.inference) {
        for (int mb = 0; mb < opt.microbatches; ++mb) {
          const Tensor y = m.infer(batches[static_cast<std::size_t>(mb)], {0, mb, step_no});
          if (m.has_head()) losses.push_back(y);
        }
        b.synchronize();
        return;
      }
      m.zero_grad();
      for (int mb = 0; mb < opt.microbatches; ++mb) {
        Forwarded f = m.forward(batches[static_cast<std::size_t>(mb)], {0, mb, step_no});
        if (m.has_head()) losses.push_back(f.y);
        if (mb + 1 == opt.microbatches) model.sync->arm();  // the step's last gradients follow
        m.backward(*f.saved, dy);
      }
      model.sync->finish();
      if (optimizer) optimizer->step();
      b.synchronize();
    };
    auto mean_loss = [&] {  // over this rank's counted targets of the last step
      if (!b.has_data() || losses.empty()) return 0.0;
      double sum = 0;
      std::int64_t n = 0;
      for (std::size_t i = 0; i < losses.size(); ++i) {
        const auto l = b.download(losses[i]);
        const auto t = b.download_i32(batches[i].targets);
        for (std::size_t j = 0; j < l.size(); ++j)
          if (t[j] >= 0) sum += l[j], ++n;
      }
      return n ? sum / static_cast<double>(n) : 0.0;
    };

    // --eval-every: the mean loss over the held-out windows, forward only, between steps; its ops
    // are left out of the step's figures (their spans, `evals`, are cut from the timeline).
    std::vector<std::pair<double, double>> evals;
    json validation = json::array();
    auto evaluate = [&] {
      if (!data || opt.eval_every == 0 || preflight) return;
      b.synchronize();
      c.barrier();
      const double at = b.now();
      Batch v;
      v.input = b.empty({T}, DType::i32, MemCategory::activations, b.default_stream());
      v.targets = b.empty({T}, DType::i32, MemCategory::activations, b.default_stream());
      double sum = 0;
      std::int64_t n = 0;
      for (int i = 0; i < opt.eval_batches; ++i) {
        const TokenBatch tb = data->validation(opt.micro_batch, i, opt.eval_batches);
        b.upload_i32(tb.ids, v.input);
        b.upload_i32(tb.targets, v.targets);
        const auto l = b.download(model.model->infer(v, {0, 0, step_no}));
        for (std::size_t j = 0; j < l.size(); ++j) sum += l[j], ++n;
      }
      b.synchronize();
      c.barrier();
      evals.push_back({at, b.now()});
      validation.push_back({step_no, n ? sum / static_cast<double>(n) : 0.0});
    };
    auto due = [&] { return opt.eval_every > 0 && step_no % static_cast<std::uint64_t>(opt.eval_every) == 0; };

    std::vector<double> loss_curve;
    evaluate();  // before the first step
    for (int i = 0; i < warmup; ++i) {
      prepare(step_no + 1);
      step();
      loss_curve.push_back(mean_loss());
      if (due()) evaluate();
    }
    b.synchronize();
    // The warm-up's times are cleared below (with --eval-every, evaluation windows are cut
    // from the timeline by time, so those runs keep the warm-up priced).
    if (warmup > 0 && opt.eval_every == 0) b.mark_untimed();
    c.barrier();
    b.clear_timeline();
    b.memory().reset_peak();
    b.reset_device_pool_peak();
    const HostPoolMark pool_start = host_pool_mark(b);
    const double window_start = b.now();
    std::vector<double> step_s;
    std::vector<std::pair<double, double>> windows;  // each timed step's [start, end] on this rank's clock
    for (int i = 0; i < steps; ++i) {
      prepare(step_no + 1);
      c.barrier();
      const double t0 = b.now();
      step();
      c.barrier();
      windows.push_back({t0, b.now()});
      step_s.push_back(b.now() - t0);
      loss_curve.push_back(mean_loss());
      if (due() || (i + 1 == steps && opt.eval_every > 0)) evaluate();  // and after the last step
    }
    const HostPoolMark pool_window = host_pool_window(pool_start, host_pool_mark(b));
    warn_host_pool(b, pool_window);

    if (preflight) return 0;

    // ---- what this rank measured -------------------------------------------------------------
    const std::vector<MemSample> mem_samples = b.memory().timeline();
    std::vector<OpRecord> ops = b.timeline();
    std::erase_if(ops, [&](const OpRecord& r) {
      for (const auto& [from, to] : evals)
        if (r.start >= from && r.start <= to) return true;
      return false;
    });
    RankFigures local;
    // A vision model's patch merging is a phase of its own; the others have none.
    std::vector<std::string> phases = kModelPhases;
    if (!cfg.vision.enabled) std::erase(phases, std::string("merge"));
    add_timeline_figures(local, ops, steps, phases);
    add_memory_figures(local, b);
    local.device = b.device_name();
    local.step_s = step_s;
    // The yardsticks time each MoE layer's GEMMs of the last microbatch: a step runs
    // `microbatches` of them.
    std::vector<GemmProblem> gemms;
    std::vector<double> layer_flops;
    for (MoEImpl* m : model.moe_layers()) {
      const RoutingStats& r = m->routing();
      local.dropped += r.dropped;
      if (local.capacity == 0) local.capacity = r.capacity;
      local.recv_per_local.insert(local.recv_per_local.end(), r.recv_per_local.begin(), r.recv_per_local.end());
      std::vector<GemmProblem> g = m->expert_gemms();
      layer_flops.push_back(cost_grouped_gemm(g).flops);
      for (auto& p : g) gemms.push_back(std::move(p));
    }
    const double per_step = static_cast<double>(opt.microbatches);
    local.bare_gemm_s = gemms.empty() ? 0.0 : b.time_bare_gemms(gemms, 3) * per_step;
    gemms.clear();  // their scratch goes before each layer's floor is made
    const std::vector<MoEImpl*> moe = model.moe_layers();
    for (std::size_t i = 0; i < moe.size(); ++i)
      local.floor_gemm_s += floor_gemm_seconds(b, moe[i]->layer(), layer_flops[i], 3) * per_step;
    std::vector<double> rank_losses = loss_curve;
    std::vector<RankFigures> ranks;
    for (const auto& s : c.all_gather_strings(local.encode())) ranks.push_back(RankFigures::decode(s));
    // Mean over the ranks that hold the head (every rank without a pipeline).
    const double heads = c.all_reduce_sum(model.has_head() ? 1.0 : 0.0);
    std::vector<double> curve(loss_curve.size(), 0.0);
    for (std::size_t i = 0; i < curve.size(); ++i)
      curve[i] = c.all_reduce_sum(model.has_head() ? rank_losses[i] : 0.0) / std::max(heads, 1.0);
    // The pipeline's figures of every rank: its stage, its F/B/W work per step (times from the
    // step's start), its peak activation memory and, on sim, the bytes it sent per link class.
    json stage_parts = json::array();
    if (model.stage) {
      std::vector<std::string> transfer;
      for (const Stream* x : model.stage->transfer_streams()) transfer.push_back(x->name());
      const auto work = pipeline::stage_work(ops, windows, transfer);
      json w = json::array();
      for (std::size_t i = 0; i < work.size(); ++i)
        w.push_back({work[i].busy, work[i].first - windows[i].first, work[i].last - windows[i].first});
      const CategoryBytes per = b.memory().peak_per_category();
      json part = {{"stage", model.stage->stage()},
                   {"work", w},
                   {"peak_activations", per[static_cast<std::size_t>(MemCategory::activations)]},
                   {"peak_buffers", per[static_cast<std::size_t>(MemCategory::buffers)]},
                   {"peak_device", b.memory().peak_device()},
                   {"in_flight", model.stage->analysis().peak_in_flight[static_cast<std::size_t>(model.stage->stage())]}};
      const pipeline::OffloadStats& os = model.stage->offload_stats();
      json layers = json::array();
      for (Model* m : model.stage->chunks()) layers.push_back(m->last_layer() - m->first_layer());
      part["offload"] = {{"transfers", os.transfers},
                         {"bytes", os.bytes},
                         {"peak_host_bytes", os.peak_host_bytes},
                         {"chunk_bytes", os.chunk_bytes},
                         {"chunk_layers", layers},
                         {"peak_resident", model.stage->analysis().peak_resident[static_cast<std::size_t>(model.stage->stage())]},
                         {"peak_host", model.stage->analysis().peak_host[static_cast<std::size_t>(model.stage->stage())]}};
      part["link_bytes"] = b.name() == "sim" ? sim_link_bytes(b).to_json() : json(nullptr);
      json by = json::object();
      if (b.name() == "sim")
        for (const auto& [k, v] : sim_link_bytes_by_collective(b)) by[k] = v.to_json();
      part["link_bytes_by_collective"] = by;
      for (const auto& s : c.all_gather_strings(part.dump())) stage_parts.push_back(json::parse(s));
    }

    // Every rank's chunks, a step; the ranks of a TP group work on the same tokens' one model.
    const double tp_size = plan ? static_cast<double>(plan->layout.tp) : 1.0;
    // Inference: the forward third of forward + backward (2·N·T of 6·N·T, attention's term alike).
    const double pass_share = opt.inference ? 1.0 / 3.0 : 1.0;
    const double all_flops = c.all_reduce_sum(model.model_flops(T * opt.microbatches) * pass_share / tp_size);
    json trace;
    if (!opt.trace.empty()) {
      for (auto& op : ops) op.start -= window_start, op.end -= window_start;
      std::vector<MemSample> shifted = mem_samples;
      for (auto& s : shifted) s.time -= window_start;
      const auto parts =
          c.all_gather_strings(chrome_trace(ops, shifted, rank).dump(-1, ' ', false, json::error_handler_t::replace));
      trace = json::parse(parts[0]);
      for (std::size_t r = 1; r < parts.size(); ++r) {
        json part = json::parse(parts[r]);  // named: a range-for over a temporary's member would dangle
        for (auto& e : part["traceEvents"]) trace["traceEvents"].push_back(std::move(e));
      }
    }
    if (rank != 0) return 0;

    // ---- the run's figures -------------------------------------------------------------------
    RunFigures fig = aggregate(ranks);
    {  // the MoE layers' own time: their phases' summed op time (host gaps left out)
      double layer = 0;
      for (const char* p : {"gate", "dispatch", "migrate", "experts", "combine", "offload", "fetch"})
        if (const auto it = fig.phases_s.find(p); it != fig.phases_s.end()) layer += it->second;
      set_layer_time(fig, layer);
    }
    const double step_med = fig.step_median;
    const double tokens = static_cast<double>(T) * opt.microbatches * replicas;
    const double tokens_per_s = step_med > 0 ? tokens / step_med : 0.0;
    const double model_flops = all_flops / world;  // per device and step
    const double model_tflops = step_med > 0 ? model_flops / step_med / 1e12 : 0.0;
    const MachineRates rates = b.machine_rates(8192, 8192, 8192, cfg.dtype);
    const double mfu = rates.peak_flops > 0 ? model_tflops * 1e12 / rates.peak_flops : 0.0;
    const RankFigures& pk = ranks[fig.peak_rank];
    const std::string library = gemm_library(b);

    // A pipeline's stages hold the whole model between them; rank 0 its first stage.
    const int first = plan ? 0 : model.first_layer(), last = plan ? cfg.num_layers : model.last_layer();
    int moe_count = 0;
    for (int l = first; l < last; ++l) moe_count += cfg.is_moe(l) ? 1 : 0;
    std::printf("model      %s (%s), layers %d:%d of %d (%d MoE)%s%s\n", cfg.name.c_str(), cfg.origin.c_str(), first,
                last, cfg.num_layers, moe_count, plan || model.has_embedding() ? ", embedding" : "",
                plan || model.has_head() ? ", head" : "");
    std::printf("           M=%lld, heads %d/%d, FFN %lld, S=%lld, V=%lld, %s, %s, %s\n",
                static_cast<long long>(cfg.d_model), cfg.num_heads, cfg.num_kv_heads, static_cast<long long>(cfg.d_ffn),
                static_cast<long long>(S), static_cast<long long>(cfg.vocab_size), norm_name(cfg.norm),
                mlp_name(cfg.mlp), dtype_name(cfg.dtype));
    std::printf("impl       %s (MoE layers)\n", opt.impl.c_str());
    std::printf("backend    %s, %s\n", b.name().c_str(), fig.device.c_str());
    if (b.name() == "sim")
      std::printf("mode       SIMULATED: cluster model %s, calibration %s, routing %s\n",
                  platform.cluster.value("name", std::string("?")).c_str(), platform.calibration.c_str(),
                  platform.routing.c_str());
    else
      std::printf("mode       measured\n");
    if (plan)
      std::printf("ranks      %d: %s; schedule %s, %d stage%s x %d chunk%s, %d microbatches, recompute %s\n", world,
                  plan->layout.to_string().c_str(), plan->schedule.name.c_str(), plan->schedule.stages,
                  plan->schedule.stages == 1 ? "" : "s", plan->schedule.chunks, plan->schedule.chunks == 1 ? "" : "s",
                  plan->schedule.microbatches, pipeline::recompute_name(plan->recompute));
    else
      std::printf("ranks      %d (data parallel for dense layers, expert parallel for MoE layers)\n", world);
    std::printf(plan ? "batch      %d microbatches x %lld sequences x %lld tokens per pipeline, optimizer %s\n"
                     : "batch      %d microbatches x %lld sequences x %lld tokens per rank, optimizer %s\n",
                opt.microbatches, static_cast<long long>(opt.micro_batch), static_cast<long long>(S),
                opt.inference ? (opt.offload_experts == "none" ? "none (inference: forward passes only)"
                                                               : opt.offload_experts == "async"
                                                                   ? "none (inference; experts offloaded, copied in async)"
                                                                   : "none (inference; experts offloaded, copied in sync)")
                              : opt.optimizer.c_str());
    std::printf("steps      %d timed after %d warm-up\n\n", steps, warmup);
    std::printf("tokens/s   %.0f\n", tokens_per_s);
    std::printf("step       %.3f ms median (min %.3f, max %.3f)%s\n", step_med * 1e3, fig.step_min * 1e3,
                fig.step_max * 1e3, world > 1 ? ", slowest rank" : "");
    std::printf("model      %.2f TFLOP/s per device%s\n", model_tflops,
                mfu > 0 ? strf(", MFU %.1f%% of the %.0f TFLOP/s peak", 100 * mfu, rates.peak_flops / 1e12).c_str()
                        : " (MFU: the backend knows no peak)");
    if (b.has_data() && heads > 0 && !curve.empty())
      std::printf("loss       %.4f (first step) -> %.4f (last)\n", curve.front(), curve.back());
    std::printf("\n%-10s %10s %10s\n", "phase", "ms/step", "% of step");
    for (const auto& p : kModelPhases) {
      const auto it = fig.phases_s.find(p);
      const double t = it == fig.phases_s.end() ? 0.0 : it->second;
      if (t > 0) std::printf("%-10s %10.3f %9.1f%%\n", p.c_str(), t * 1e3, step_med > 0 ? 100.0 * t / step_med : 0.0);
    }
    std::printf("(summed op time per phase over all streams; the MoE layer's own ops are under gate, dispatch,\n"
                " experts and combine, its norm and residual under moe)\n\n");
    std::printf("communication   %.3f ms/step, %.1f%% hidden behind compute; exposed %.3f ms\n", fig.comm_s * 1e3,
                100.0 * fig.overlap_ratio, fig.exposed_comm_s * 1e3);
    if (fig.floor_gemm_s > 0)
      std::printf("expert floor    %.3f ms, the experts' FLOPs as balanced batched GEMMs (%s): expert GEMMs at %.2fx, "
                  "the MoE layers' ops at %.2fx of it\n",
                  fig.floor_gemm_s * 1e3, floor_gemm_library(b).c_str(), fig.expert_vs_floor, fig.layer_vs_floor);
    std::printf("peak memory     %.1f MiB%s: %s MiB\n", static_cast<double>(pk.peak_device) / kMiB,
                world > 1 ? strf(" (rank %zu, the highest)", fig.peak_rank).c_str() : "",
                category_list(pk.at_peak).c_str());
    if (!pk.microbatch_at_peak.empty()) {
      std::string mbs;
      for (const auto& [k, v] : pk.microbatch_at_peak)
        if (v > 0) mbs += strf("%smb%d %.1f", mbs.empty() ? "" : ", ", k, static_cast<double>(v) / kMiB);
      if (!mbs.empty()) std::printf("                held by microbatch at the peak: %s MiB\n", mbs.c_str());
    }

    json parallel;
    if (plan) {
      parallel = pipeline_json(*plan, stage_parts);
      if (plan->offload.chunks > 0) parallel["offload"] = offload_json(*plan, offload_plan, stage_parts, offload_model(b, cfg, T),
                                                                       parallel, cfg, opt.microbatches, T);
      print_pipeline(parallel, steps);
    }

    json metrics = metrics_json(fig, ranks, tokens_per_s, library, floor_gemm_library(b),
                                static_cast<int>(dtype_size(cfg.dtype)));
    add_gemm_path_metrics(metrics, b, opt.gemm_path);
    add_host_pool_metrics(metrics, b, pool_window);
    metrics["model_flops_per_step"] = model_flops;
    metrics["model_tflops_per_device"] = model_tflops;
    metrics["mfu"] = mfu > 0 ? json(mfu) : json(nullptr);
    metrics["peak_flops"] = rates.peak_flops > 0 ? json(rates.peak_flops) : json(nullptr);
    json mb_at_peak = json::object();
    for (const auto& [k, v] : pk.microbatch_at_peak) mb_at_peak[std::to_string(k)] = v;
    metrics["peak_memory_bytes"]["by_microbatch_at_peak"] = mb_at_peak;
    if (b.has_data() && heads > 0)
      metrics["loss"] = {{"first", curve.front()}, {"last", curve.back()}, {"all", curve}};
    {
      // Parameters per token (the quality comparison's yardstick): every parameter but the
      // routed experts a token is not sent to (k of E per MoE layer, k the implementation's).
      const ParamCounts pc = cfg.parameter_counts();
      int k = cfg.moe.top_k;
      for (MoEImpl* m : model.moe_layers()) k = m->layer().config().top_k;
      const double routed_share = cfg.moe.num_experts > 0 ? static_cast<double>(k) / static_cast<double>(cfg.moe.num_experts) : 0.0;
      metrics["parameters"] = {{"total", pc.total},
                               {"routed_experts", pc.experts},
                               {"active_per_token", static_cast<double>(pc.total - pc.experts) + routed_share * static_cast<double>(pc.experts)},
                               {"top_k", k}};
      metrics["model_flops_per_token"] = all_flops / (static_cast<double>(T * opt.microbatches) * replicas);
    }
    if (data) {
      const double h = data->entropy_rate();
      metrics["validation"] = {{"data", data->spec()},
                               {"synthetic", data->synthetic()},
                               {"entropy_rate", std::isnan(h) ? json(nullptr) : json(h)},
                               {"train_bytes", data->synthetic() ? json(nullptr) : json(data->train_bytes())},
                               {"valid_bytes", data->synthetic() ? json(nullptr) : json(data->valid_bytes())},
                               {"every", opt.eval_every},
                               {"batches", opt.eval_batches},
                               {"tokens_per_evaluation", opt.eval_batches * T},
                               {"points", validation}};
    }

    json result;
    result["schema"] = "moelab.result/1";
    const bool simulated = b.name() == "sim";
    result["mode"] = simulated ? "simulated" : "measured";
    result["backend"] = b.name();
    result["device"] = fig.device;
    result["cluster"] = platform.cluster;
    result["calibration"] = simulated ? json(platform.calibration) : json(nullptr);
    if (simulated) result["routing_model"] = platform.routing;
    result["commit"] = build_commit();
    result["date"] = utc_now_iso8601();
    result["world_size"] = world;
    result["model"] = to_json(cfg);
    result["training"] = {{"layers", {first, last}},               {"micro_batch", opt.micro_batch},
                          {"microbatches", opt.microbatches},     {"optimizer", opt.inference ? "none" : opt.optimizer},
                          {"pass", opt.inference ? "inference" : "training"},
                          {"replicas", replica_layout ? json(replica_layout->to_string()) : json(nullptr)},
                          {"offload_experts", opt.offload_experts},
                          {"lr", opt.lr},                         {"seed", opt.seed},
                          {"steps", steps},                       {"warmup", warmup}};
    if (plan) result["parallel"] = parallel;
    result["impl"] = opt.impl;
    result["impl_options"] = opt.impl_options;  // as given (--impl-options; {}: the defaults)
    json reports = json::array();
    for (MoEImpl* m : model.moe_layers()) reports.push_back(m->report());
    result["impl_report"] = reports.empty() ? json::object() : reports[0];
    result["metrics"] = std::move(metrics);
    if (!opt.trace.empty()) {
      trace["otherData"] = {{"mode", result["mode"]},       {"backend", result["backend"]},
                            {"device", result["device"]},   {"calibration", result["calibration"]},
                            {"commit", result["commit"]},   {"date", result["date"]},
                            {"model", cfg.name},            {"impl", opt.impl}};
      if (plan) {
        json stage_of_rank = json::array();
        for (const auto& part : stage_parts) stage_of_rank.push_back(part["stage"]);
        trace["otherData"]["pipeline"] = {{"schedule", plan->schedule.name},
                                          {"stages", plan->schedule.stages},
                                          {"microbatches", plan->schedule.microbatches},
                                          {"chunks", plan->schedule.chunks},
                                          {"placement", pipeline::placement_name(plan->schedule.placement)},
                                          {"recompute", pipeline::recompute_name(plan->recompute)},
                                          {"layout", plan->layout.to_string()},
                                          {"steps", steps},
                                          {"stage_of_rank", stage_of_rank}};
      }
      outputs->stage(opt.trace, trace, -1);
    }
    outputs->stage(opt.out, result);
    outputs->commit();
    if (!opt.trace.empty()) std::printf("trace           %s\n", opt.trace.c_str());
    std::printf("result          %s\n", opt.out.c_str());
    return 0;
  } catch (const std::exception& e) {
    // Past validation a process among several may fail alone: every rank is stopped now (exit
    // 1; 3 out of memory); the threads of a simulated cluster stop as one process, which keeps
    // exit 2 for a ConfigError.
    if (world > 1 && b.name() != "sim") abort_run(rank, e, outputs);
    throw;
  }
}

}  // namespace

int run_model_command(const RunOptions& opt) {
  const int world = world_size();
  check_impl_name(opt.impl);
  if (opt.backend == "sim") {
    if (world > 1) throw ConfigError("--backend sim runs every simulated rank in one process: start it without mpirun");
    const TransformerConfig cfg = load_transformer(opt.model, opt.model_override);
    SimOptions so;
    so.cluster = sim::load_cluster(opt.cluster);
    // Everything that can be checked is checked before the cluster is built.
    const int n = sim_world_size(so.cluster, opt.ranks);
    std::optional<PipelinePlan> plan;
    const std::optional<GroupLayout> replicas = replica_layout(opt, cfg, n, so.cluster.node.gpus);
    if (opt.pipelined()) plan = plan_pipeline(opt, cfg, n, so.cluster.node.gpus);
    else if (!replicas) validate_model_for_world(cfg, opt, n);
    check_impl_options_for(opt, cfg, plan ? plan->layout.ep : replicas ? replicas->ep : n);
    if (!opt.profile.empty()) so.profile = sim::load_profile(opt.profile);
    so.routing = RoutingModel::parse(opt.routing, opt.seed);
    so.ranks = opt.ranks;
    sim::check_forced_gemm_path(so.cluster, opt.gemm_path);
    so.gemm_path = opt.gemm_path;
    RunOutputs outputs;
    RunOutputs::check(opt);
    outputs.lock(opt);
    SimCluster cluster(std::move(so));
    Platform platform{sim::to_json(cluster.options().cluster), cluster.calibration(),
                      cluster.options().routing.describe()};
    int rc = 0;
    cluster.run([&](Backend& b, Communicator& c) {
      if (!b.supports(cfg.dtype))
        throw Unsupported(shown(cfg.origin) + ": dtype = \"" + std::string(dtype_name(cfg.dtype)) +
                          "\" is not supported by the sim backend");
      const int r = run_model_on_rank(b, c, opt, cfg, platform, c.rank() == 0 ? &outputs : nullptr,
                                      plan ? &*plan : nullptr, cluster.options().cluster.node.gpus, nullptr,
                                      replicas ? &*replicas : nullptr);
      if (c.rank() == 0) rc = r;
    });
    return rc;
  }

  TransformerConfig cfg;
  std::optional<PipelinePlan> plan;
  std::optional<GroupLayout> replicas;
  std::optional<TrainingData> data;
  StartedRun run;
  start_run(
      run, opt,
      [&] {
        cfg = load_transformer(opt.model, opt.model_override);
        replicas = replica_layout(opt, cfg, world, world);
        if (opt.pipelined()) plan = plan_pipeline(opt, cfg, world, world);
        else if (!replicas) validate_model_for_world(cfg, opt, world);
        check_impl_options_for(opt, cfg, plan ? plan->layout.ep : replicas ? replicas->ep : world);
        if (!opt.data.empty() && cfg.vision.enabled)
          throw ConfigError("--data " + opt.data + ": " + shown(cfg.origin) + " is a vision model (\"vision\"); --data feeds "
                            "text to a language model (a vision model trains on synthetic images)");
        if (!opt.data.empty()) data = TrainingData::open(opt.data, cfg.vocab_size, cfg.seq_len, opt.seed);
      },
      [&](const Backend& b) {
        if (b.supports(cfg.dtype)) return std::string();
        return shown(cfg.origin) + ": dtype = \"" + dtype_name(cfg.dtype) + "\" is not supported by the " + b.name() +
               " backend" +
               (b.name() == "cpu" ? " (it computes in fp32; override with --model-override '{\"dtype\": \"fp32\"}')" : "");
      },
      [&](Backend& b, Communicator& c) {
        run_model_on_rank(b, c, opt, cfg, Platform{}, nullptr, plan ? &*plan : nullptr, world, data ? &*data : nullptr,
                          replicas ? &*replicas : nullptr, true);
      });
  return run_model_on_rank(*run.backend, *run.comm, opt, cfg, Platform{}, world_rank() == 0 ? &run.outputs : nullptr,
                           plan ? &*plan : nullptr, world, data ? &*data : nullptr, replicas ? &*replicas : nullptr);
}

}  // namespace moelab::cli
