#!/usr/bin/env bash
# scripts/fuzz.sh — build moelab's libFuzzer targets (harness/fuzz) with clang,
# AddressSanitizer and UndefinedBehaviorSanitizer in a build folder of their own, and run each
# for a bounded time. docs/FUZZING.md lists the targets and the last results.
#
#   scripts/fuzz.sh                            # the smoke run: 60 s in all, shared by the targets
#   scripts/fuzz.sh --seconds 300              # 300 s in all
#   scripts/fuzz.sh --seconds-per-target 600   # a long run: 600 s for each target
#   scripts/fuzz.sh --runs 1000000             # each target until a million executions (no time limit
#                                              # unless --seconds-per-target is given too)
#   scripts/fuzz.sh --targets workload,cluster # some targets only
#   scripts/fuzz.sh --check                    # exit 0 when clang with libFuzzer can build a target
#   scripts/fuzz.sh --make-corpus              # rebuild harness/fuzz/corpus/ from experiments/
#   FUZZ_BUILD_DIR=/tmp/bf JOBS=2 scripts/fuzz.sh
#
# For each target it prints the executions reached, their rate and the corpus size. A finding
# (a crash, a sanitizer report, an exception other than the input errors, a message of several
# lines, an execution over 10 s or 2 GB) stops that target, leaves the input that caused it in
# $FUZZ_BUILD_DIR/findings/<target>/ (replay: <fuzz binary> <that file>) and makes the script
# exit 1. Exit 2: a wrong argument, or no clang with libFuzzer here; exit 3: the targets did not
# build (the code must compile with clang as well as gcc). The committed seed corpus
# (harness/fuzz/corpus/<target>/) is only read: what the fuzzer learns goes to
# $FUZZ_BUILD_DIR/corpus/<target>/, kept between runs of one build folder so that long runs go
# on where the last one stopped.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${FUZZ_BUILD_DIR:-$root/build-fuzz}"
jobs="${JOBS:-$(nproc)}"
all_targets=(workload model cluster catalogue profile routing_trace impl_options parallel_layout training_data)
total=60
per_target=""
runs=-1
targets=("${all_targets[@]}")
mode=run

while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) total="$2"; shift 2 ;;
    --seconds-per-target) per_target="$2"; shift 2 ;;
    --runs) runs="$2"; shift 2 ;;
    --targets) IFS=, read -r -a targets <<<"$2"; shift 2 ;;
    --check) mode=check; shift ;;
    --make-corpus) mode=corpus; shift ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) echo "fuzz.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

cxx="${CXX_FUZZ:-clang++}"
# Can this machine build and run a libFuzzer target with the sanitizers?
have_libfuzzer() {
  command -v "$cxx" >/dev/null 2>&1 || return 1
  local t
  t="$(mktemp -d)"
  printf '#include <cstddef>\n#include <cstdint>\nextern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n' >"$t/f.cpp"
  if "$cxx" -fsanitize=fuzzer,address,undefined "$t/f.cpp" -o "$t/f" >/dev/null 2>&1 && "$t/f" -runs=1 >/dev/null 2>&1; then
    rm -rf "$t"
    return 0
  fi
  rm -rf "$t"
  return 1
}

if [ "$mode" = check ]; then
  have_libfuzzer
  exit $?
fi

if [ "$mode" = corpus ]; then
  # The seeds: every shipped file of each kind, the options of the suites, a few layouts, and a
  # profile and a routing trace written by the moelab of the normal build (scripts/test.sh
  # builds it).
  moelab="${MOELAB:-$root/build/harness/moelab}"
  [ -x "$moelab" ] || { echo "fuzz.sh: $moelab not built (cmake --build build --target moelab)" >&2; exit 2; }
  c="$root/harness/fuzz/corpus"
  rm -rf "$c"
  mkdir -p "$c"/{workload,model,cluster,catalogue,profile,routing_trace,impl_options,parallel_layout,training_data}
  cp "$root"/experiments/workloads/*.json "$c/workload/"
  cp "$root"/experiments/models/*.json "$c/model/"
  printf '\0{"num_layers": 3, "moe": {"num_experts": 8}}' | cat "$root/experiments/models/tiny-moe.json" - >"$c/model/tiny-moe-with-override"
  cp "$root"/experiments/hardware/clusters/*.json "$c/cluster/"
  cp "$root"/experiments/hardware/gpus.json "$root"/experiments/hardware/nodes.json "$c/catalogue/"
  /usr/bin/python3 - "$root" "$c/impl_options" <<'EOF'
import json, sys, pathlib
root, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
seen = set()
def walk(x):
    if isinstance(x, dict):
        for k, v in x.items():
            if k in ("options", "impl_options") and isinstance(v, dict):
                seen.add(json.dumps(v, sort_keys=True))
            walk(v)
    elif isinstance(x, list):
        for v in x:
            walk(v)
for suite in sorted(root.glob("experiments/*/suite.json")):
    walk(json.load(open(suite)))
for i, s in enumerate(sorted(seen)):
    (out / f"options-{i:02d}.json").write_text(s)
EOF
  # Layouts (no file holds one yet): the examples of harness/comm/groups.hpp and docs/architecture.md.
  i=0
  for l in "" "tp=2,pp=2,dp=4,ep=8,etp=1" "dp=8" "ep=8" "tp=8" "pp=4,ep=2" "tp=2,ep=4,etp=2" "pp=2,dp=?"; do
    printf '%s' "$l" >"$c/parallel_layout/layout-$i"
    i=$((i + 1))
  done
  # --data: a first byte (sequence length, vocabulary) and a Markov spec or a text (this README).
  printf '\020markov:8' >"$c/training_data/markov-8"
  printf '\040markov:300\n' >"$c/training_data/markov-300"
  { printf '\010'; head -c 3000 "$root/README.md"; } >"$c/training_data/text-readme"
  { printf '\210'; head -c 600 "$root/README.md"; } >"$c/training_data/text-small-vocab"
  w="$(mktemp -d)"
  "$moelab" calibrate --backend cpu --quick --name fuzz-seed --out "$c/profile/cpu-quick.json" >/dev/null
  "$moelab" run --workload "$root/experiments/workloads/tiny.json" --impl fastmoe --backend cpu \
    --record-routing "$c/routing_trace/tiny.json" --out "$w/r.json" >/dev/null
  rm -rf "$w"
  du -sh "$c"/*
  exit 0
fi

if ! have_libfuzzer; then
  echo "fuzz.sh: $cxx cannot build a libFuzzer target with -fsanitize=fuzzer,address,undefined (install clang)" >&2
  exit 2
fi

export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
echo "== building the fuzz targets in $build (clang, ASan + UBSan)"
mkdir -p "$build"
# Warnings are not errors here: the normal build (gcc, -DMOELAB_WERROR=ON) judges them, and
# clang warns of things gcc does not.
build_failed() {
  echo "fuzz.sh: the fuzz targets did not build with $cxx ($1 above): the code must compile with clang too" >&2
  exit 3
}
cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER="$cxx" -DMOELAB_FUZZ=ON \
  -DMOELAB_WERROR=OFF -DMOELAB_WITH_CUDA=OFF -DMOELAB_WITH_MPI=OFF -DMOELAB_WITH_BLAS=OFF \
  -DMOELAB_WITH_TESTS=OFF -DMOELAB_WITH_BENCH=OFF >"$build/configure.log" 2>&1 ||
  { cat "$build/configure.log"; build_failed "cmake's configure"; }
cmake --build "$build" -j "$jobs" --target moelab_fuzz || build_failed "the compiler's errors"

if [ -z "$per_target" ] && [ "$runs" -ge 0 ]; then
  per_target=0  # no time limit: the executions bound the run
elif [ -z "$per_target" ]; then
  per_target=$((total / ${#targets[@]}))
  [ "$per_target" -ge 1 ] || per_target=1
fi
echo
echo "== fuzzing: ${#targets[@]} targets, $([ "$per_target" = 0 ] && echo "no time limit" || echo "$per_target s each")$([ "$runs" -ge 0 ] && echo ", at most $runs executions each")"
# Leaks are findings too; UBSan stops at the first report (-fno-sanitize-recover at build).
export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
rc=0
printf '%-15s %12s %10s %8s  %s\n' target executions exec/s corpus result
for t in "${targets[@]}"; do
  bin="$build/harness/fuzz/fuzz_$t"
  seeds="$root/harness/fuzz/corpus/$t"
  [ -x "$bin" ] || { echo "fuzz.sh: no target $t (targets: ${all_targets[*]})" >&2; exit 2; }
  mkdir -p "$build/corpus/$t" "$build/findings/$t"
  log="$build/fuzz_$t.log"
  result=ok
  # -rss_limit_mb: a reader must not need more than this for any input of a few KB.
  if ! "$bin" "$build/corpus/$t" "$seeds" -max_total_time="$per_target" -runs="$runs" -timeout=10 -rss_limit_mb=2048 \
       -print_final_stats=1 -artifact_prefix="$build/findings/$t/" >"$log" 2>&1; then
    result="FINDING (see $log and $build/findings/$t/)"
    rc=1
  fi
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
  rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
  units=$(find "$build/corpus/$t" -type f | wc -l)
  printf '%-15s %12s %10s %8s  %s\n' "$t" "${execs:-0}" "${rate:-0}" "$units" "$result"
  [ "$result" = ok ] || grep -m 5 -E 'ERROR|finding|runtime error|SUMMARY' "$log" | sed 's/^/    /' || true
done
exit $rc
