#!/usr/bin/env bash
# scripts/reproduce.sh — install what is missing, build, run every registered experiment suite
# (experiments/*/suite.json), ScMoE's quality comparison, the micro-benchmarks, the figures and
# the report, and finish with the table of paper claims against ours.
#
#   scripts/reproduce.sh                    # every suite's default run (under 30 min on 2 cores, build included)
#   scripts/reproduce.sh --quick            # each suite's reduced subset (~2 min)
#   scripts/reproduce.sh --extended         # also the extended sweeps (MPipeMoE's strict fp32 and
#                                           # bf16 brackets on the 64-GPU cluster)
#   scripts/reproduce.sh --suite mpipemoe   # one suite (repeatable)
#   scripts/reproduce.sh --out DIR          # results, figures and RESULTS.md under DIR, not results/
#   scripts/reproduce.sh --update-baseline  # accept simulated results that differ from the committed ones
#   scripts/reproduce.sh --hostfile FILE    # also the suites' runs on a real cluster (see below)
#   scripts/reproduce.sh --jobs N           # simulated runs N at a time (default: the core count)
#
# What runs where (each suite says which of its runs go where):
#   sim backend   always: the paper clusters (experiments/hardware/clusters) with their files' models
#   cpu backend   always; several ranks with mpirun --oversubscribe
#   cuda backend  when `moelab list` reports a CUDA device; otherwise listed as skipped
#   a real cluster: runs whose "ranks" is "hostfile" get one rank per slot of FILE, launched
#     as `mpirun --hostfile FILE -np <slots> moelab run ...` (the binary must be at the same
#     path on every host, e.g. a shared file system); or launch one workload by hand:
#     mpirun -np 16 --hostfile hosts build/harness/moelab run --backend cuda --workload W --impl fastmoe
#
# Simulated results are deterministic. A simulated result that differs from the one under the
# results folder is not written over it: the difference is printed, the new file is kept
# under <out>/candidate/, the rest still runs, and the exit code is 1; rerun with
# --update-baseline to accept it. Measured results are always written (they vary), each run
# alone on the machine; simulated runs go --jobs at a time.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build}"
out="$root/results"
py=/usr/bin/python3
[ -x "$py" ] || py=python3
suite_args=()
run_args=()
quick=0
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1; run_args+=(--quick) ;;
    --extended) run_args+=(--extended) ;;
    --suite) suite_args+=(--suite "$2"); shift ;;
    --out) out="$(mkdir -p "$2" && cd "$2" && pwd)"; shift ;;
    --update-baseline) run_args+=(--update-baseline) ;;
    --hostfile) run_args+=(--hostfile "$2"); shift ;;
    --jobs) run_args+=(--jobs "$2"); shift ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) echo "reproduce.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done
t0=$(date +%s)

"$root/scripts/setup.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$(nproc)" --target moelab moelab_bench_cpu moelab_bench_sim
moelab="$build/harness/moelab"

echo
echo "== suites"
suites_rc=0
"$py" "$root/scripts/run_suite.py" "${suite_args[@]}" "${run_args[@]}" --out "$out" --moelab "$moelab" || suites_rc=$?

# ScMoE's quality comparison (measured on the cpu backend, written always): the default
# setting in a full run (~1 min, two runs at a time), the quick one with --quick; the long one is separate
# (scripts/quality.py --setting long, impls/scmoe/README.md "Quality").
quality_rc=0
if [ "${#suite_args[@]}" = 0 ] || printf '%s\n' "${suite_args[@]}" | grep -qx scmoe; then
  echo
  if [ "$quick" = 1 ]; then
    echo "== ScMoE quality, quick setting (measured on cpu) -> ${out#$root/}/measured/cpu/quality-quick"
    "$py" "$root/scripts/quality.py" --setting quick --moelab "$moelab" --out "$out/measured/cpu/quality-quick" || quality_rc=$?
  else
    echo "== ScMoE quality (measured on cpu) -> ${out#$root/}/measured/cpu/quality"
    "$py" "$root/scripts/quality.py" --moelab "$moelab" --out "$out/measured/cpu/quality" || quality_rc=$?
  fi
fi

echo
echo "== micro-benchmarks (measured, written always; the comparison is informational)"
mkdir -p "$out/bench"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
min_time=0.05
[ "$quick" = 1 ] && min_time=0.01
echo "[bench 1/2] cpu building blocks -> ${out#$root/}/bench/cpu_blocks.json"
"$build/harness/moelab_bench_cpu" --benchmark_min_time=$min_time --benchmark_context=mode=measured \
  --benchmark_out="$tmp/cpu_blocks.json" --benchmark_out_format=json >/dev/null 2>&1
if [ -f "$out/bench/cpu_blocks.json" ]; then
  "$py" "$root/scripts/compare_results.py" --bench "$out/bench/cpu_blocks.json" "$tmp/cpu_blocks.json" || true
fi
mv "$tmp/cpu_blocks.json" "$out/bench/cpu_blocks.json"
if [ "$quick" = 1 ]; then
  echo "[bench 2/2] simulator speed: skipped with --quick"
else
  echo "[bench 2/2] simulator speed -> ${out#$root/}/bench/sim.json"
  "$build/harness/moelab_bench_sim" --benchmark_context=mode=measured --benchmark_context=what=host_seconds_of_the_simulator \
    --benchmark_out="$tmp/sim.json" --benchmark_out_format=json >/dev/null 2>&1
  mv "$tmp/sim.json" "$out/bench/sim.json"
fi

echo
echo "== figures and report"
figures_rc=0
"$py" "$root/plots/figures.py" --results "$out" "${suite_args[@]}" || figures_rc=$?
if [ "$out" = "$root/results" ]; then
  # The committed report covers every suite (the committed summaries of those not run now).
  "$py" "$root/plots/report.py" --results "$out" --out "$root/docs/RESULTS.md" || figures_rc=$?
else
  "$py" "$root/plots/report.py" --results "$out" --out "$out/RESULTS.md" "${suite_args[@]}" || figures_rc=$?
  echo
  echo "== against the committed results (informational with --out)"
  "$py" "$root/scripts/compare_results.py" "$root/results" "$out" 2>&1 | grep -v '^MEASURED' || true
fi

"$py" "$root/scripts/claims.py" --results "$out" "${suite_args[@]}"
echo
echo "reproduce.sh: done in $(( ($(date +%s) - t0) / 60 ))m$(printf %02d $(( ($(date +%s) - t0) % 60 )))s; results under ${out#$root/}"
if [ "$suites_rc" != 0 ]; then
  echo "reproduce.sh: some runs failed or simulated results differ from those under ${out#$root/} (see above);" >&2
  echo "  the new files are under ${out#$root/}/candidate/. If the change is intended, rerun with --update-baseline" >&2
  echo "  (a suite whose committed summary is the extended one, MPipeMoE's: --suite mpipemoe --extended --update-baseline)." >&2
  exit 1
fi
[ "$figures_rc" = 0 ] || { echo "reproduce.sh: a figure or the report failed (see above)" >&2; exit 1; }
[ "$quality_rc" = 0 ] || { echo "reproduce.sh: the quality comparison failed (see above)" >&2; exit 1; }
