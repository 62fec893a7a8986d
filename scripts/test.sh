#!/usr/bin/env bash
# scripts/test.sh — install what is missing, build everything, run every test, then the
# regression check of the simulated results and the micro-benchmark comparison.
#
#   scripts/test.sh                 # build in ./build, ctest, regression check, benchmarks
#   BUILD_DIR=/tmp/b scripts/test.sh
#   scripts/test.sh -R moe_layer    # extra arguments go to ctest (and skip the two checks below)
#
# Regression check: the quick subset of every suite's simulated runs (scripts/run_suite.py
# --quick --backends sim) is run into a temporary folder with the binary just built and
# compared with the committed results (scripts/compare_results.py): any figure that moved by
# more than 1e-9 relative, or a file the committed results lack, fails, naming the file, the
# figure, old and new values. To accept an intended change: scripts/reproduce.sh
# --update-baseline (or scripts/run_suite.py --update-baseline), then commit results/.
# Fuzz smoke run: where clang with libFuzzer is available, scripts/fuzz.sh builds the fuzz
# targets (harness/fuzz) in $BUILD_DIR-fuzz and runs them for 60 s in all; a finding fails, and
# so does code that does not compile with clang. Without clang it is skipped, saying so.
# MOELAB_FUZZ_SMOKE=0 skips it.
# Benchmarks: moelab_bench_cpu runs briefly and is compared with results/bench/cpu_blocks.json;
# informational only (machines are noisy), it never fails.
#
# The cuda backend is compiled whenever nvcc is present; its tests skip without a device.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build}"
jobs="${JOBS:-$(nproc)}"
py=/usr/bin/python3
[ -x "$py" ] || py=python3

"$root/scripts/setup.sh"

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DMOELAB_WERROR=ON
cmake --build "$build" -j "$jobs"
ctest --test-dir "$build" --output-on-failure -j "$jobs" "$@"

if [ $# -gt 0 ]; then
  echo "test.sh: ctest was filtered; the regression check and the benchmarks are skipped"
  exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo
echo "== regression check: quick simulated suites against the committed results"
rc=0
"$py" "$root/scripts/run_suite.py" --quick --backends sim --out "$work/results" --moelab "$build/harness/moelab" \
  >"$work/run.log" 2>&1 || { cat "$work/run.log"; rc=1; }
grep -E '^\[.* (quick|full) [0-9]+/[0-9]+ \| all ' "$work/run.log" | tail -n 1 || true
if [ -d "$work/results" ]; then
  "$py" "$root/scripts/compare_results.py" "$root/results" "$work/results" || rc=1
fi
if [ "$rc" != 0 ]; then
  echo "test.sh: the simulated results differ from the committed ones (above: file, figure, old -> new)." >&2
  echo "  If the change is intended: scripts/reproduce.sh --update-baseline (and --suite mpipemoe --extended" >&2
  echo "  --update-baseline for MPipeMoE, whose committed summary is the extended one), then commit results/." >&2
fi

echo
echo "== fuzz smoke run: every input reader under libFuzzer with ASan and UBSan, 60 s in all"
# Only where clang with libFuzzer is installed (scripts/fuzz.sh --check); its own build folder
# beside the main one. MOELAB_FUZZ_SMOKE=0 skips it. Long runs: scripts/fuzz.sh, docs/FUZZING.md.
if [ "${MOELAB_FUZZ_SMOKE:-1}" = 0 ]; then
  echo "test.sh: MOELAB_FUZZ_SMOKE=0: the fuzz smoke run is skipped"
elif "$root/scripts/fuzz.sh" --check; then
  fuzz_rc=0
  FUZZ_BUILD_DIR="${FUZZ_BUILD_DIR:-$build-fuzz}" JOBS="$jobs" "$root/scripts/fuzz.sh" --seconds 60 || fuzz_rc=$?
  case "$fuzz_rc" in
    0) ;;
    3) echo "test.sh: the fuzz targets did not build with clang (above: the errors)" >&2; rc=1 ;;
    *) echo "test.sh: the fuzz smoke run found a problem (above: the target, its log and the input that causes it)" >&2
       rc=1 ;;
  esac
else
  echo "test.sh: no clang with libFuzzer here (scripts/fuzz.sh --check): the fuzz smoke run is skipped;" \
    "apt-get install clang to run it"
fi

echo
echo "== cpu micro-benchmarks against results/bench/cpu_blocks.json (informational)"
if [ -x "$build/harness/moelab_bench_cpu" ]; then
  "$build/harness/moelab_bench_cpu" --benchmark_min_time=0.01 --benchmark_context=mode=measured \
    --benchmark_out="$work/cpu_blocks.json" --benchmark_out_format=json >/dev/null 2>&1 &&
    "$py" "$root/scripts/compare_results.py" --bench "$root/results/bench/cpu_blocks.json" "$work/cpu_blocks.json" ||
    echo "test.sh: the benchmark comparison did not run (informational)"
else
  echo "test.sh: moelab_bench_cpu not built (Google Benchmark missing): skipped"
fi
exit $rc
