// harness/metrics/trace.hpp — a run's timeline as Chrome trace JSON, to open in Perfetto
// (ui.perfetto.dev) or chrome://tracing. Written by `moelab run --trace trace.json`.
//
// The same format on every backend, so that a measured and a simulated timeline open side
// by side:
//   pid = rank ("rank R"), tid = stream id (named after the stream: compute, dispatch, ...)
//   "X" events  one per op: name, ts and dur in microseconds, cat = phase, args = phase,
//               kind, the op's cost descriptor (flops, bytes, comm_bytes) and, in a pipeline,
//               the schedule node ("F3.1") it belongs to
//   "C" events  counter "memory": MiB in use per memory category, one sample per change
#pragma once
#include <vector>

#include <nlohmann/json.hpp>

#include "harness/runtime/timeline.hpp"
#include "harness/runtime/memory.hpp"

namespace moelab {

// {"traceEvents": [...], "displayTimeUnit": "ms"} for one rank. Times are taken as they
// are (seconds on the backend clock); shift them first to start the trace at zero.
// Several ranks' traces merge by concatenating their "traceEvents".
nlohmann::json chrome_trace(const std::vector<OpRecord>& ops, const std::vector<MemSample>& memory, int rank);

}  // namespace moelab
