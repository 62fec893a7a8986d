// harness/cli/schedule_cmd.cpp — `moelab schedule`: one pipeline schedule as data, without
// running it: each stage's order, the timing estimate, the activation memory against the
// closed forms of docs/pipeline-memory.md, and PipeOffload's offload pass.
//
//   moelab schedule --schedule group-interleaved --pp 4 --microbatches 8 --chunks 2 --group 2
//   moelab schedule --schedule interleaved --pp 8 --microbatches 16 --offload-chunks 1
//          --offload-time 0.5 --reload-time 0.5 --json interleaved-offload.json
//   bash harness/tests/cli_schedule_test.sh build/harness/moelab /tmp/cli_schedule
//
// Times are in the unit of --forward/--backward/--weight (default 1 each: one slot of the
// papers' drawings). Memory is counted in (microbatch, chunk) activations, each M_a/(p·v) of
// the activations M_a one microbatch leaves in the whole model.
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/cli/run_common.hpp"
#include "harness/metrics/results.hpp"
#include "harness/pipeline/schedule.hpp"
#include "harness/runtime/error.hpp"

namespace moelab::cli {

using nlohmann::json;

namespace {

void print_schedule_help() {
  std::puts(
      "usage: moelab schedule --schedule NAME --pp P --microbatches M [options]\n"
      "\n"
      "Builds a pipeline schedule and prints, per stage, its order (F2.1: forward of microbatch 2,\n"
      "chunk 1; B backward (input gradient), W weight gradient, o offload, r reload), the timing\n"
      "estimate (makespan, bubble, compute time lost waiting for reloads) and the activations\n"
      "resident on the device and on the host beside the closed form of docs/pipeline-memory.md.\n"
      "\n"
      "  --schedule NAME       gpipe, 1f1b, interleaved, zb-h1, zb-v, group-interleaved\n"
      "  --pp P                pipeline stages\n"
      "  --microbatches M      microbatches per step\n"
      "  --chunks V            model chunks per stage (interleaved, group-interleaved; default 2)\n"
      "  --group G             group-interleaved: microbatches per group, ceil(P/2) (default) to P\n"
      "  --offload-chunks K    PipeOffload: offload the activations of chunks < K (K >= V: all)\n"
      "  --offload-time X      time to copy one chunk's activations to the host (default 0)\n"
      "  --reload-time Y       time to copy them back (default 0)\n"
      "  --no-lifespan         keep offloads that lower no stage's peak\n"
      "  --forward F --backward B --weight W   times of F, B and W of one chunk (default 1 each)\n"
      "  --p2p T               time of a send between stages (default 0)\n"
      "  --json FILE           also write everything (every node's kind, microbatch, chunk, start,\n"
      "                        end per stage; the offload plan) as JSON\n"
      "  --help                this text\n"
      "\n"
      "Exit status: 0 success, 2 bad input (nothing written).");
}

// A flag's value as a number in [lo, hi] (an integer when `integer`); ConfigError naming it.
double number_flag(const std::string& flag, const std::string& v, double lo, double hi, bool integer) {
  char* end = nullptr;
  errno = 0;
  const double x = integer ? static_cast<double>(std::strtoll(v.c_str(), &end, 10)) : std::strtod(v.c_str(), &end);
  if (v.empty() || errno || *end || !std::isfinite(x) || x < lo || x > hi) {
    const std::string what = integer ? "an integer" : "a number";
    throw ConfigError(flag + " = \"" + shown(v) + "\": expected " + what + " from " + strf("%g", lo) + " to " + strf("%g", hi));
  }
  return x;
}

std::string node_text(const pipeline::Node& n) {
  using pipeline::NodeKind;
  const char* k = n.kind == NodeKind::offload ? "o" : n.kind == NodeKind::reload ? "r" : pipeline::node_kind_name(n.kind);
  return std::string(k) + std::to_string(n.microbatch) + "." + std::to_string(n.chunk);
}

bool shown_in_order(pipeline::NodeKind k) {
  using pipeline::NodeKind;
  return k == NodeKind::forward || k == NodeKind::backward_input || k == NodeKind::backward_weight ||
         k == NodeKind::offload || k == NodeKind::reload;
}

}  // namespace

int schedule_command(const std::vector<std::string>& args) {
  std::string name, json_path;
  int pp = 0, microbatches = 0, chunks = 0, group = 0;
  pipeline::OffloadOptions off;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string& flag = args[i];
    auto take = [&]() -> std::string {
      if (i + 1 >= args.size()) throw ConfigError(flag + " needs a value (see moelab schedule --help)");
      return args[++i];
    };
    auto integer = [&](double lo, double hi) { return static_cast<int>(number_flag(flag, take(), lo, hi, true)); };
    auto time = [&]() { return number_flag(flag, take(), 0, 1e12, false); };
    if (flag == "--help" || flag == "-h") {
      print_schedule_help();
      return 0;
    } else if (flag == "--schedule") {
      name = take();
    } else if (flag == "--pp") {
      pp = integer(1, 1024);
    } else if (flag == "--microbatches") {
      microbatches = integer(1, 1 << 16);
    } else if (flag == "--chunks") {
      chunks = integer(1, 64);
    } else if (flag == "--group") {
      group = integer(1, 1024);
    } else if (flag == "--offload-chunks") {
      off.chunks = integer(0, 64);
    } else if (flag == "--offload-time") {
      off.d2h = off.costs.offload = time();
    } else if (flag == "--reload-time") {
      off.h2d = off.costs.reload = time();
    } else if (flag == "--forward") {
      off.costs.forward = number_flag(flag, take(), 1e-12, 1e12, false);
    } else if (flag == "--backward") {
      off.costs.backward_input = number_flag(flag, take(), 1e-12, 1e12, false);
    } else if (flag == "--weight") {
      off.costs.backward_weight = number_flag(flag, take(), 1e-12, 1e12, false);
    } else if (flag == "--p2p") {
      off.costs.p2p = time();
    } else if (flag == "--no-lifespan") {
      off.lifespan = false;
    } else if (flag == "--json") {
      json_path = take();
    } else {
      throw ConfigError("unknown option \"" + shown(flag) + "\" for moelab schedule (see moelab schedule --help)");
    }
  }
  if (name.empty()) throw ConfigError("missing --schedule NAME (see moelab schedule --help)");
  if (pp == 0) throw ConfigError("missing --pp P");
  if (microbatches == 0) throw ConfigError("missing --microbatches M");
  if (!json_path.empty()) {
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path path(json_path), folder = path.has_parent_path() ? path.parent_path() : fs::path(".");
    if (fs::is_directory(path, ec)) throw ConfigError("--json " + shown(json_path) + ": is a folder; give a file name");
    if (!fs::is_directory(folder, ec)) throw ConfigError("--json " + shown(json_path) + ": " + shown(folder.string()) + " is not a folder");
  }

  const pipeline::Schedule plain = pipeline::make_schedule(name, pp, microbatches, chunks, group);
  pipeline::Schedule s = plain;
  pipeline::OffloadPlan plan;
  if (off.chunks > 0) plan = pipeline::add_offload(s, off);
  const pipeline::ScheduleAnalysis a = pipeline::validate(s);
  const pipeline::ScheduleEstimate e = pipeline::estimate(s, off.costs);
  std::vector<double> closed;
  std::string no_form;
  try {
    closed = pipeline::expected_peak_activation(plain, off.chunks);
  } catch (const ConfigError& x) {
    no_form = x.what();
  }
  const int p = s.stages, v = s.chunks;
  const double unit = p * v;  // (microbatch, chunk) activations per M_a

  std::printf("%s: p = %d, m = %d, v = %d", s.name.c_str(), p, s.microbatches, v);
  if (s.group > 0) std::printf(", g = %d", s.group);
  std::printf("; F %g, B %g, W %g, p2p %g", off.costs.forward, off.costs.backward_input, off.costs.backward_weight, off.costs.p2p);
  if (off.chunks > 0)
    std::printf("; offload chunks < %d, d2h %g, h2d %g%s", off.chunks, off.d2h, off.h2d, off.lifespan ? "" : ", no lifespan rule");
  std::printf("\n\n");
  for (int st = 0; st < p; ++st) {
    std::printf("stage %d:", st);
    for (const auto& n : s.nodes[static_cast<std::size_t>(st)])
      if (shown_in_order(n.kind)) std::printf(" %s", node_text(n).c_str());
    std::printf("\n");
  }
  std::printf("\nmakespan %.4g, mean bubble %.2f%%\n", e.makespan, 100 * e.mean_bubble());
  std::printf("%5s %8s %8s %8s %9s %9s %6s %14s", "stage", "bubble%", "exposed", "in_flt", "resident", "host", "form", "form (M_a)");
  if (off.chunks > 0) std::printf(" %7s %5s %5s %5s", "planned", "kept", "gap", "peak");
  std::printf("\n");
  for (int st = 0; st < p; ++st) {
    const std::size_t i = static_cast<std::size_t>(st);
    std::printf("%5d %8.2f %8.4g %8d %9d %9d", st, 100 * e.bubble[i], e.exposed[i], a.peak_in_flight[i], a.peak_resident[i],
                a.peak_host[i]);
    if (closed.empty())
      std::printf(" %6s %14s", "-", "-");
    else
      std::printf(" %6.4g %14.4f", closed[i] * unit, closed[i]);
    if (off.chunks > 0)
      std::printf(" %7d %5d %5d %5d", plan.planned[i], plan.kept[i], plan.skipped_gap[i], plan.skipped_peak[i]);
    std::printf("\n");
  }
  if (!no_form.empty()) std::printf("closed form: none (%s)\n", no_form.c_str());
  else if (off.chunks > 0)
    std::printf("form: what stays on the device; the copies add up to 2 (docs/pipeline-memory.md)\n");

  if (!json_path.empty()) {
    json stages = json::array();
    for (int st = 0; st < p; ++st) {
      const std::size_t i = static_cast<std::size_t>(st);
      json nodes = json::array();
      const auto& l = s.nodes[i];
      for (std::size_t j = 0; j < l.size(); ++j)
        nodes.push_back({{"kind", pipeline::node_kind_name(l[j].kind)},
                         {"microbatch", l[j].microbatch},
                         {"chunk", l[j].chunk},
                         {"start", e.times[i][j].first},
                         {"end", e.times[i][j].second}});
      json row = {{"stage", st},
                  {"busy", e.busy[i]},
                  {"bubble", e.bubble[i]},
                  {"exposed", e.exposed[i]},
                  {"d2h_busy", e.d2h_busy[i]},
                  {"h2d_busy", e.h2d_busy[i]},
                  {"peak_in_flight", a.peak_in_flight[i]},
                  {"peak_resident", a.peak_resident[i]},
                  {"peak_host", a.peak_host[i]},
                  {"closed_form_m_a", closed.empty() ? json(nullptr) : json(closed[i])},
                  {"nodes", nodes}};
      if (off.chunks > 0)
        row["offload"] = {{"planned", plan.planned[i]},
                          {"kept", plan.kept[i]},
                          {"skipped_gap", plan.skipped_gap[i]},
                          {"skipped_peak", plan.skipped_peak[i]}};
      stages.push_back(row);
    }
    const json out = {{"schema", "moelab.schedule/1"},
                      {"schedule", s.name},
                      {"stages", p},
                      {"microbatches", s.microbatches},
                      {"chunks", v},
                      {"group", s.group},
                      {"placement", pipeline::placement_name(s.placement)},
                      {"split_backward", s.split_backward},
                      {"costs",
                       {{"forward", off.costs.forward},
                        {"backward_input", off.costs.backward_input},
                        {"backward_weight", off.costs.backward_weight},
                        {"p2p", off.costs.p2p},
                        {"offload", off.costs.offload},
                        {"reload", off.costs.reload}}},
                      {"offload_chunks", off.chunks},
                      {"lifespan", off.lifespan},
                      {"makespan", e.makespan},
                      {"mean_bubble", e.mean_bubble()},
                      {"closed_form", no_form.empty() ? json("docs/pipeline-memory.md") : json(no_form)},
                      {"per_stage", stages}};
    write_json_atomic(json_path, out);
    std::printf("wrote %s\n", json_path.c_str());
  }
  return 0;
}

}  // namespace moelab::cli
