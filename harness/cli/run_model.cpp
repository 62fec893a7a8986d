// harness/cli/run_model.cpp — `moelab run --model FILE`: training steps of a whole model (or
// of a range of its layers) on one backend, its MoE layers served by --impl.
//
//   moelab run --model experiments/models/tiny-moe.json --impl fastmoe --backend cpu --steps 20
//   moelab run --model experiments/models/gpt3-moe-xl.json --impl fastmoe --backend sim --cluster a800x1
//   mpirun -n 2 moelab run --model experiments/models/tiny-moe.json --impl mpipemoe --backend cpu
//
// A step: zero_grad; for each of --microbatches microbatches of --micro-batch sequences: forward,
// backward (input then weight gradients); the replicated parameters' gradients summed over the
// ranks (data parallelism; the experts are sharded by expert parallelism over the same ranks);
// one optimizer step. Inputs are the synthetic language of harness/nn/data.hpp, new tokens
// every step, uploaded before the step's clock starts (a stage without
// the embedding gets random activations, one without the head a random output gradient).
// Reported: tokens/s, step time split by block kind (attention, mlp, the MoE layer's phases,
// embedding, head, optimizer), model FLOPs utilisation where the backend knows its peak,
// memory by category and by microbatch at the peak, the loss, and the Chrome trace (--trace).
// Bad input: exit 2 on every rank before any work, nothing written.
#include <algorithm>
#include <cstdio>
#include <numeric>

#include <nlohmann/json.hpp>

#include "harness/backends/sim/sim_backend.hpp"
#include "harness/cli/run_common.hpp"
#include "harness/comm/world.hpp"
#include "harness/config/model.hpp"
#include "harness/metrics/results.hpp"
#include "harness/metrics/run_figures.hpp"
#include "harness/metrics/trace.hpp"
#include "harness/nn/data.hpp"
#include "harness/nn/model.hpp"
#include "harness/runtime/error.hpp"
#include "harness/runtime/random.hpp"
#include "harness/sim/cluster.hpp"

namespace moelab::cli {

using nlohmann::json;

namespace {

const std::vector<std::string> kModelPhases = {"embedding", "attention", "mlp",  "moe",  "gate",
                                               "dispatch",  "experts",   "combine", "head", "optimizer"};

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
int run_model_on_rank(Backend& b, Communicator& c, const RunOptions& opt, const TransformerConfig& cfg,
                      const Platform& platform, RunOutputs* outputs, bool preflight = false) {
  const int rank = c.rank(), world = c.size();
  const int steps = preflight ? 1 : opt.steps > 0 ? opt.steps : 3;
  const int warmup = preflight ? 0 : opt.warmup >= 0 ? opt.warmup : 1;
  ModelOptions mo;
  mo.impl = opt.impl;
  mo.impl_options = opt.impl_options;
  mo.first_layer = opt.first_layer;
  mo.last_layer = opt.last_layer;
  try {
    Model model(b, c, cfg, mo);
    model.init_parameters(opt.seed);
    std::unique_ptr<Optimizer> optimizer;
    if (opt.optimizer != "none") {
      OptimizerConfig oc;
      oc.kind = parse_optimizer(opt.optimizer);
      oc.lr = static_cast<float>(opt.lr);
      optimizer = std::make_unique<Optimizer>(b, model.stream(), model.parameters(), oc);
    }
    const std::int64_t S = cfg.seq_len, T = opt.micro_batch * S, M = cfg.d_model;
    const float scale = 1.0f / static_cast<float>(T * opt.microbatches * world);
    const auto next = synthetic_successor(cfg.vocab_size, opt.seed);
    const Tensor dy = model.has_head() ? Tensor() : random_rows(b, T, M, cfg.dtype, Rng::mix(opt.seed, 2, static_cast<std::uint64_t>(rank)));

    // One batch per microbatch, new tokens every step, uploaded before the step's clock starts.
    std::vector<Batch> batches(static_cast<std::size_t>(opt.microbatches));
    for (int mb = 0; mb < opt.microbatches; ++mb) {
      Batch& x = batches[static_cast<std::size_t>(mb)];
      x.input = model.has_embedding() ? b.empty({T}, DType::i32, MemCategory::activations, b.default_stream())
                                      : random_rows(b, T, M, cfg.dtype, Rng::mix(opt.seed, 1, Rng::mix(static_cast<std::uint64_t>(rank), static_cast<std::uint64_t>(mb))));
      if (model.has_head()) x.targets = b.empty({T}, DType::i32, MemCategory::activations, b.default_stream());
      x.loss_scale = scale;
    }
    auto prepare = [&](std::uint64_t step_no) {
      if (!b.has_data()) return;
      for (int mb = 0; mb < opt.microbatches; ++mb) {
        const TokenBatch tb = synthetic_batch(next, opt.micro_batch, S, opt.seed, step_no, mb, rank);
        Batch& x = batches[static_cast<std::size_t>(mb)];
        if (model.has_embedding()) b.upload_i32(tb.ids, x.input);
        if (model.has_head()) b.upload_i32(tb.targets, x.targets);
      }
    };

    std::vector<Tensor> losses;  // [T] fp32 per microbatch of the last step
    std::uint64_t step_no = 0;
    auto step = [&] {
      ++step_no;
      losses.clear();
      model.zero_grad();
      for (int mb = 0; mb < opt.microbatches; ++mb) {
        Forwarded f = model.forward(batches[static_cast<std::size_t>(mb)], {0, mb, step_no});
        if (model.has_head()) losses.push_back(f.y);
        model.backward_input(*f.saved, dy);
        model.backward_weight(*f.saved);
      }
      model.all_reduce_gradients(c);
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

    std::vector<double> loss_curve;
    for (int i = 0; i < warmup; ++i) {
      prepare(step_no + 1);
      step();
      loss_curve.push_back(mean_loss());
    }
    b.synchronize();
    c.barrier();
    b.clear_timeline();
    b.memory().reset_peak();
    b.reset_device_pool_peak();
    const double window_start = b.now();
    std::vector<double> step_s;
    for (int i = 0; i < steps; ++i) {
      prepare(step_no + 1);
      c.barrier();
      const double t0 = b.now();
      step();
      c.barrier();
      step_s.push_back(b.now() - t0);
      loss_curve.push_back(mean_loss());
    }

    if (preflight) return 0;

    // ---- what this rank measured -------------------------------------------------------------
    const std::vector<MemSample> mem_samples = b.memory().timeline();
    std::vector<OpRecord> ops = b.timeline();
    RankFigures local;
    add_timeline_figures(local, ops, steps, kModelPhases);
    add_memory_figures(local, b);
    local.device = b.device_name();
    local.step_s = step_s;
    std::vector<GemmProblem> gemms;
    for (MoEImpl* m : model.moe_layers()) {
      const RoutingStats& r = m->routing();
      local.dropped += r.dropped;
      if (local.capacity == 0) local.capacity = r.capacity;
      local.recv_per_local.insert(local.recv_per_local.end(), r.recv_per_local.begin(), r.recv_per_local.end());
      for (auto& g : m->expert_gemms()) gemms.push_back(std::move(g));
    }
    local.bare_gemm_s = gemms.empty() ? 0.0 : b.time_bare_gemms(gemms, 3);
    std::vector<double> rank_losses = loss_curve;
    std::vector<RankFigures> ranks;
    for (const auto& s : c.all_gather_strings(local.encode())) ranks.push_back(RankFigures::decode(s));
    std::vector<double> curve(loss_curve.size(), 0.0);  // mean over ranks
    for (std::size_t i = 0; i < curve.size(); ++i) curve[i] = c.all_reduce_sum(rank_losses[i]) / world;

    json trace;
    if (!opt.trace.empty()) {
      for (auto& op : ops) op.start -= window_start, op.end -= window_start;
      std::vector<MemSample> shifted = mem_samples;
      for (auto& s : shifted) s.time -= window_start;
      const auto parts =
          c.all_gather_strings(chrome_trace(ops, shifted, rank).dump(-1, ' ', false, json::error_handler_t::replace));
      trace = json::parse(parts[0]);
      for (std::size_t r = 1; r < parts.size(); ++r)
        for (auto& e : json::parse(parts[r])["traceEvents"]) trace["traceEvents"].push_back(std::move(e));
    }
    if (rank != 0) return 0;

    // ---- the run's figures -------------------------------------------------------------------
    const RunFigures fig = aggregate(ranks);
    const double step_med = fig.step_median;
    const double tokens = static_cast<double>(T) * opt.microbatches * world;
    const double tokens_per_s = step_med > 0 ? tokens / step_med : 0.0;
    const double model_flops = model.model_flops(T * opt.microbatches);  // per rank and step
    const double model_tflops = step_med > 0 ? model_flops / step_med / 1e12 : 0.0;
    const MachineRates rates = b.machine_rates(8192, 8192, 8192, cfg.dtype);
    const double mfu = rates.peak_flops > 0 ? model_tflops * 1e12 / rates.peak_flops : 0.0;
    const RankFigures& pk = ranks[fig.peak_rank];
    const std::string library = gemm_library(b);

    const int last = model.last_layer();
    int moe_count = 0;
    for (int l = model.first_layer(); l < last; ++l) moe_count += cfg.is_moe(l) ? 1 : 0;
    std::printf("model      %s (%s), layers %d:%d of %d (%d MoE)%s%s\n", cfg.name.c_str(), cfg.origin.c_str(),
                model.first_layer(), last, cfg.num_layers, moe_count, model.has_embedding() ? ", embedding" : "",
                model.has_head() ? ", head" : "");
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
    std::printf("ranks      %d (data parallel for dense layers, expert parallel for MoE layers)\n", world);
    std::printf("batch      %d microbatches x %lld sequences x %lld tokens per rank, optimizer %s\n",
                opt.microbatches, static_cast<long long>(opt.micro_batch), static_cast<long long>(S),
                opt.optimizer.c_str());
    std::printf("steps      %d timed after %d warm-up\n\n", steps, warmup);
    std::printf("tokens/s   %.0f\n", tokens_per_s);
    std::printf("step       %.3f ms median (min %.3f, max %.3f)%s\n", step_med * 1e3, fig.step_min * 1e3,
                fig.step_max * 1e3, world > 1 ? ", slowest rank" : "");
    std::printf("model      %.2f TFLOP/s per device%s\n", model_tflops,
                mfu > 0 ? strf(", MFU %.1f%% of the %.0f TFLOP/s peak", 100 * mfu, rates.peak_flops / 1e12).c_str()
                        : " (MFU: the backend knows no peak)");
    if (b.has_data() && model.has_head() && !curve.empty())
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
    std::printf("peak memory     %.1f MiB%s: %s MiB\n", static_cast<double>(pk.peak_device) / kMiB,
                world > 1 ? strf(" (rank %zu, the highest)", fig.peak_rank).c_str() : "",
                category_list(pk.at_peak).c_str());
    if (!pk.microbatch_at_peak.empty()) {
      std::string mbs;
      for (const auto& [k, v] : pk.microbatch_at_peak)
        if (v > 0) mbs += strf("%smb%d %.1f", mbs.empty() ? "" : ", ", k, static_cast<double>(v) / kMiB);
      if (!mbs.empty()) std::printf("                held by microbatch at the peak: %s MiB\n", mbs.c_str());
    }

    json metrics = metrics_json(fig, ranks, tokens_per_s, library);
    metrics["model_flops_per_step"] = model_flops;
    metrics["model_tflops_per_device"] = model_tflops;
    metrics["mfu"] = mfu > 0 ? json(mfu) : json(nullptr);
    metrics["peak_flops"] = rates.peak_flops > 0 ? json(rates.peak_flops) : json(nullptr);
    json mb_at_peak = json::object();
    for (const auto& [k, v] : pk.microbatch_at_peak) mb_at_peak[std::to_string(k)] = v;
    metrics["peak_memory_bytes"]["by_microbatch_at_peak"] = mb_at_peak;
    if (b.has_data() && model.has_head())
      metrics["loss"] = {{"first", curve.front()}, {"last", curve.back()}, {"all", curve}};

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
    result["training"] = {{"layers", {model.first_layer(), last}}, {"micro_batch", opt.micro_batch},
                          {"microbatches", opt.microbatches},     {"optimizer", opt.optimizer},
                          {"lr", opt.lr},                         {"seed", opt.seed},
                          {"steps", steps},                       {"warmup", warmup}};
    result["impl"] = opt.impl;
    json reports = json::array();
    for (MoEImpl* m : model.moe_layers()) reports.push_back(m->report());
    result["impl_report"] = reports.empty() ? json::object() : reports[0];
    result["metrics"] = std::move(metrics);
    if (!opt.trace.empty()) {
      trace["otherData"] = {{"mode", result["mode"]},       {"backend", result["backend"]},
                            {"device", result["device"]},   {"calibration", result["calibration"]},
                            {"commit", result["commit"]},   {"date", result["date"]},
                            {"model", cfg.name},            {"impl", opt.impl}};
      outputs->stage(opt.trace, trace, -1);
    }
    outputs->stage(opt.out, result);
    outputs->commit();
    if (!opt.trace.empty()) std::printf("trace           %s\n", opt.trace.c_str());
    std::printf("result          %s\n", opt.out.c_str());
    return 0;
  } catch (const ConfigError& e) {
    // Past validation a process among several may fail alone (exit 1 stops them all); the
    // threads of a simulated cluster stop as one process, which keeps exit 2.
    if (world > 1 && b.name() != "sim") throw std::runtime_error(e.what());
    throw;
  } catch (const Unsupported& e) {
    if (world > 1 && b.name() != "sim") throw std::runtime_error(e.what());
    throw;
  }
}

}  // namespace

int run_model_command(const RunOptions& opt) {
  const int world = world_size();
  check_impl_name(opt.impl);
  // The tokens one forward of an MoE layer sees on a rank: a microbatch.
  const auto tokens = [&](const TransformerConfig& cfg) { return opt.micro_batch * cfg.seq_len; };
  if (opt.backend == "sim") {
    if (world > 1) throw ConfigError("--backend sim runs every simulated rank in one process: start it without mpirun");
    const TransformerConfig cfg = load_transformer(opt.model, opt.model_override);
    SimOptions so;
    so.cluster = sim::load_cluster(opt.cluster);
    // Everything that can be checked is checked before the cluster is built.
    const int n = sim_world_size(so.cluster, opt.ranks);
    validate_model_for_world(cfg, opt, n);
    check_impl_options(opt.impl, opt.impl_options, {cfg.moe, n, tokens(cfg), cfg.shared_expert_hidden});
    if (!opt.profile.empty()) so.profile = sim::load_profile(opt.profile);
    so.routing = RoutingModel::parse(opt.routing, opt.seed);
    so.ranks = opt.ranks;
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
      const int r = run_model_on_rank(b, c, opt, cfg, platform, c.rank() == 0 ? &outputs : nullptr);
      if (c.rank() == 0) rc = r;
    });
    return rc;
  }

  TransformerConfig cfg;
  StartedRun run;
  start_run(
      run, opt,
      [&] {
        cfg = load_transformer(opt.model, opt.model_override);
        validate_model_for_world(cfg, opt, world);
        check_impl_options(opt.impl, opt.impl_options, {cfg.moe, world, tokens(cfg), cfg.shared_expert_hidden});
      },
      [&](const Backend& b) {
        if (b.supports(cfg.dtype)) return std::string();
        return shown(cfg.origin) + ": dtype = \"" + dtype_name(cfg.dtype) + "\" is not supported by the " + b.name() +
               " backend" +
               (b.name() == "cpu" ? " (it computes in fp32; override with --model-override '{\"dtype\": \"fp32\"}')" : "");
      },
      [&](Backend& b, Communicator& c) { run_model_on_rank(b, c, opt, cfg, Platform{}, nullptr, true); });
  return run_model_on_rank(*run.backend, *run.comm, opt, cfg, Platform{}, world_rank() == 0 ? &run.outputs : nullptr);
}

}  // namespace moelab::cli
