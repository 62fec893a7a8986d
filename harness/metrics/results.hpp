// harness/metrics/results.hpp — result files: how a run was obtained, and what it measured.
//
// Every result JSON carries: mode ("measured" or "simulated"), backend, device (or cluster
// model), calibration profile (simulated only), commit, date (UTC, ISO 8601), the workload,
// the implementation, and the metrics. Files are written atomically (temporary file in the
// same folder, flushed, then renamed), so an interrupted run never leaves a truncated file.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace moelab {

std::string utc_now_iso8601();   // "2026-11-22T02:13:00Z"
std::string build_commit();      // the commit the binary was built from ("-dirty": with local changes)
// Writes j to path atomically (pretty-printed with `indent` spaces; -1: compact, for large
// files such as traces); creates parent folders. Throws std::runtime_error naming the path on
// any failure, leaving no file behind.
void write_json_atomic(const std::string& path, const nlohmann::json& j, int indent = 2);
// The temporary file write_json_atomic(path, …) writes before renaming it to path.
std::string write_json_atomic_temp(const std::string& path);

}  // namespace moelab
