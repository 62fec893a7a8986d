// harness/metrics/trace.cpp — Chrome trace JSON writer (see trace.hpp). Event format:
// https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
#include "harness/metrics/trace.hpp"

#include <array>
#include <map>
#include <string>

namespace moelab {

using nlohmann::json;

json chrome_trace(const std::vector<OpRecord>& ops, const std::vector<MemSample>& memory, int rank) {
  constexpr double kUs = 1e6;  // trace times are microseconds
  json events = json::array();

  events.push_back(
      {{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
  events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", rank}, {"args", {{"sort_index", rank}}}});

  // One track per stream, in stream-id order (compute first, as the backends create it).
  std::map<int, std::string> streams;
  for (const auto& op : ops) streams.emplace(op.stream_id, op.stream_name);
  for (const auto& [id, name] : streams) {
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank}, {"tid", id}, {"args", {{"name", name}}}});
    events.push_back(
        {{"name", "thread_sort_index"}, {"ph", "M"}, {"pid", rank}, {"tid", id}, {"args", {{"sort_index", id}}}});
  }

  for (const auto& op : ops) {
    json args = {{"phase", op.phase},
                 {"kind", op_kind_name(op.cost.kind)},
                 {"flops", op.cost.flops},
                 {"bytes", op.cost.bytes_read + op.cost.bytes_written}};
    if (op.cost.comm_bytes > 0) args["comm_bytes"] = op.cost.comm_bytes;
    if (!op.node.empty()) args["node"] = op.node;
    if (!op.detail.empty()) args["detail"] = op.detail;
    events.push_back({{"name", op.name},
                      {"cat", op.phase},
                      {"ph", "X"},
                      {"pid", rank},
                      {"tid", op.stream_id},
                      {"ts", op.start * kUs},
                      {"dur", (op.end - op.start) * kUs},
                      {"args", std::move(args)}});
  }

  // Memory counters, one series per category that is ever in use (empty categories would
  // only add flat tracks). MiB rather than bytes: the trace is for reading; the result file
  // keeps exact bytes.
  std::array<bool, kNumMemCategories> used{};
  for (const auto& s : memory)
    for (std::size_t c = 0; c < used.size(); ++c) used[c] = used[c] || s.in_use[c] > 0;
  for (const auto& s : memory) {
    json args = json::object();
    for (std::size_t c = 0; c < used.size(); ++c)
      if (used[c])
        args[category_name(static_cast<MemCategory>(c))] = static_cast<double>(s.in_use[c]) / (1024.0 * 1024.0);
    if (args.empty()) continue;
    events.push_back({{"name", "memory"}, {"ph", "C"}, {"pid", rank}, {"ts", s.time * kUs}, {"args", std::move(args)}});
  }

  return {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
}

}  // namespace moelab
