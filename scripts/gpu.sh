#!/usr/bin/env bash
# scripts/gpu.sh — the cuda backend's tests and measurements on a lent GPU machine, in one call.
#
#   scripts/gpu.sh bundle                  # here (the build machine): build build-gpu, fill build-gpu/bundle/
#   scripts/gpu.sh run [OUTDIR]            # on the GPU machine: every step below, results under OUTDIR ($OUT)
#   scripts/gpu.sh run OUTDIR --only tests,validate    # some steps only (tests, validate, suites, compare)
#   scripts/gpu.sh run OUTDIR --only suites --run gpu  # suites step with run_suite.py --run gpu (repeatable)
#   scripts/gpu.sh run OUTDIR --only memcheck           # the optional step: the tests under compute-sanitizer
#
# bundle: configures and builds a cuda-only Release build (no MPI, no OpenBLAS, no Google
# Benchmark; GoogleTest and the CUDA runtime linked statically; sm_90 for H100/H200, or
# $CUDA_ARCHS) in $BUILD_DIR (default build-gpu), nice'd with $JOBS (default 2) jobs; copies
# moelab and the test binaries that exercise the cuda backend into build-gpu/bundle/ with a
# MANIFEST (commit, flags, binaries, sizes, the shared libraries they need); checks that they
# need nothing but cuBLAS, NCCL and the C/C++ runtime, and that the bundle is well under the
# device tool's 64 MiB; prints the device call. docs/GPU.md describes the whole procedure.
#
# run: finds cuBLAS and NCCL (the toolkit's default location, else a Python environment's
# site-packages/nvidia/*/lib) and puts them on LD_LIBRARY_PATH; prints nvidia-smi and
# `moelab list`; then, each step timed, each failure reported and the next step run anyway:
#   tests     each bundled test binary, directly (not ctest), --gtest_output=xml into OUTDIR/tests/
#   validate  scripts/validate_sim.sh --backend cuda into OUTDIR/validation/<device class>/
#   suites    scripts/run_suite.py --backends cuda --out OUTDIR/results --run ID... (every suite's
#             runs on the cuda backend, or those given with --run; no suite summary is written)
#   compare   plots/mpipemoe_gpu.py: the measured MPipeMoE runs against their simulated
#             counterparts -> OUTDIR/results/measured/cuda/<device class>/mpipemoe/comparison.json
#   memcheck  (optional, only with --only ...,memcheck: slow) each bundled test binary under
#             compute-sanitizer --tool memcheck --leak-check full (out-of-bounds and misaligned
#             device accesses, leaks of device memory) into OUTDIR/memcheck/; $MEMCHECK_FILTER
#             narrows the tests (a --gtest_filter pattern), $MEMCHECK_TIMEOUT bounds each binary
# and ends with a table. Without a CUDA device every step says so and skips (exit code 0).
# Exit code 1 if any step failed. Everything printed is also in OUTDIR/gpu-run.log.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build-gpu}"
# The test binaries that run on the cuda backend (their tests skip without a device).
TESTS=(cuda_backend_test cuda_blocks_test host_pool_test moe_layer_test model_test)

die() { echo "gpu.sh: $*" >&2; exit 2; }

# ---- bundle ---------------------------------------------------------------------------------

bundle() {
  [ $# -eq 0 ] || die "bundle takes no arguments (environment: BUILD_DIR, JOBS, CUDA_ARCHS)"
  set -e
  local jobs="${JOBS:-2}" archs="${CUDA_ARCHS:-90}"
  if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
  command -v nvcc >/dev/null || die "nvcc not found: the bundle needs the CUDA toolkit on this machine"
  local flags=(-DCMAKE_BUILD_TYPE=Release -DMOELAB_WITH_CUDA=ON -DMOELAB_WITH_MPI=OFF -DMOELAB_WITH_BLAS=OFF
               -DMOELAB_WITH_BENCH=OFF -DMOELAB_WITH_TESTS=ON -DMOELAB_CUDART_STATIC=ON
               "-DCMAKE_CUDA_ARCHITECTURES=$archs")
  echo "== configure $build: ${flags[*]}"
  nice -n 19 cmake -S "$root" -B "$build" "${flags[@]}" >"$build.configure.log" 2>&1 ||
    { cat "$build.configure.log"; die "configure failed"; }
  grep -q "moelab: cuda=ON" "$build.configure.log" ||
    { grep "moelab:" "$build.configure.log"; die "the cuda backend is not configured (nvcc or NCCL missing?)"; }
  grep -q "tests are not built" "$build.configure.log" && die "GoogleTest not found: the test binaries cannot be built"
  rm -f "$build.configure.log"
  echo "== build (nice, $jobs jobs): moelab ${TESTS[*]}"
  nice -n 19 cmake --build "$build" -j "$jobs" --target moelab "${TESTS[@]}"

  local b="$build/bundle"
  rm -rf "$b"
  mkdir -p "$b"
  cp "$build/harness/moelab" "$b/"
  for t in "${TESTS[@]}"; do cp "$build/harness/tests/$t" "$b/"; done

  # What the binaries need at run time: only these may be shared libraries.
  local allowed='^(libcublas\.so\.[0-9]+|libcublasLt\.so\.[0-9]+|libcudart\.so\.[0-9]+|libnccl\.so\.[0-9]+|libstdc\+\+\.so\.6|libgcc_s\.so\.1|libm\.so\.6|libc\.so\.6|libdl\.so\.2|librt\.so\.1|libpthread\.so\.0|ld-linux-x86-64\.so\.2)$'
  local bad=0 needed
  for f in "$b"/*; do
    needed="$(readelf -d "$f" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p')"
    while read -r lib; do
      [ -z "$lib" ] && continue
      if ! [[ "$lib" =~ $allowed ]]; then echo "gpu.sh: $(basename "$f") needs $lib, which the GPU machine lacks" >&2; bad=1; fi
    done <<<"$needed"
  done
  [ "$bad" = 0 ] || die "the bundle needs libraries beyond cuBLAS, NCCL and the C/C++ runtime (see above)"

  local commit
  commit="$(git -C "$root" rev-parse --short=12 HEAD 2>/dev/null || echo unknown)"
  if [ -n "$(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null)" ]; then commit="$commit-dirty"; fi
  {
    echo "moelab GPU bundle (scripts/gpu.sh bundle; run it with scripts/gpu.sh run, docs/GPU.md)"
    echo "commit:   $commit"
    echo "built:    $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n), $(nvcc --version | tail -n 1)"
    echo "flags:    ${flags[*]}"
    echo "tests:    ${TESTS[*]}"
    echo "binaries (bytes, shared libraries needed; highest glibc / libstdc++ symbol versions):"
    for f in "$b"/*; do
      [ "$(basename "$f")" = MANIFEST ] && continue
      printf '  %-20s %10s  %s; %s\n' "$(basename "$f")" "$(stat -c %s "$f")" \
        "$(readelf -d "$f" | sed -n 's/.*Shared library: \[\(.*\)\]/\1/p' | tr '\n' ' ' | sed 's/ $//')" \
        "$(objdump -T "$f" | grep -o 'GLIBC_[0-9.]*\|GLIBCXX_[0-9.]*' | sort -uV | awk -F_ '{m[$1]=$0} END {print m["GLIBC"], m["GLIBCXX"]}')"
    done
  } >"$b/MANIFEST"
  local bytes
  bytes="$(du -sb "$b" | cut -f1)"
  echo "total:    $bytes bytes" >>"$b/MANIFEST"
  cat "$b/MANIFEST"
  [ "$bytes" -lt $((48 * 1024 * 1024)) ] || die "the bundle is $bytes bytes: too close to the device tool's 64 MiB"
  echo
  echo "bundle: ${b#"$root"/} ($((bytes / 1024)) KiB of the device tool's 64 MiB)"
  case "$commit" in *-dirty) echo "note: built from a tree with uncommitted changes; results will say $commit" ;; esac
  echo "device call (docs/GPU.md): carry [\"${b#"$root"/}\"], command \"scripts/gpu.sh run \$OUT\""
  echo "  split over calls: \"scripts/gpu.sh run \$OUT --only tests,validate\", then \"scripts/gpu.sh run \$OUT --only suites\""
}

# ---- run ------------------------------------------------------------------------------------

T0=$SECONDS
STEP_NAMES=()
STEP_STATUS=()
STEP_NOTES=()
STEP_SECS=()
FAILED=0

record() {  # name status note seconds
  STEP_NAMES+=("$1"); STEP_STATUS+=("$2"); STEP_NOTES+=("$3"); STEP_SECS+=("$4")
  [ "$2" = FAILED ] && FAILED=1
  echo "-- $1: $2${3:+ ($3)} [$4 s; $((SECONDS - T0)) s since the start]"
}

find_python() {
  local p
  for p in "${PYTHON:-}" python3 /usr/bin/python3 /opt/torch/.venv/bin/python3 /opt/torch/.venv/bin/python; do
    [ -n "$p" ] || continue
    if "$p" -c 'import json, sys; sys.exit(0 if sys.version_info >= (3, 8) else 1)' >/dev/null 2>&1; then
      command -v "$p"
      return 0
    fi
  done
  return 1
}

# Folders that may hold the CUDA libraries, most likely first: the toolkit's, the system's, then
# every Python environment's site-packages/nvidia/*/lib (the pip wheels nvidia-cublas, -nccl ...).
lib_candidates() {
  local d py sp
  for d in "${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda/lib64 /usr/local/cuda/targets/*/lib \
           /usr/local/cuda-*/lib64 /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/lib; do
    [ -d "$d" ] && echo "$d"
  done
  for py in "$PY" python3 /opt/*/.venv/bin/python3 /opt/*/bin/python3 /usr/bin/python3; do
    [ -n "$py" ] && command -v "$py" >/dev/null 2>&1 || continue
    "$py" -c 'import site, sys; print("\n".join(site.getsitepackages() + [site.getusersitepackages()]))' 2>/dev/null
  done | sort -u | while read -r sp; do
    for d in "$sp"/nvidia/*/lib "$sp"/nvidia/*/lib64 "$sp"/torch/lib; do [ -d "$d" ] && echo "$d"; done
  done
  for d in /opt/*/.venv/lib/python3*/site-packages/nvidia/*/lib /usr/local/lib/python3*/dist-packages/nvidia/*/lib; do
    [ -d "$d" ] && echo "$d"
  done
}

find_libs() {
  local want=() lib d found path=""
  # The sonames the bundle was linked against (MANIFEST; cuBLAS 13 and NCCL 2 with CUDA 13),
  # and cuBLASLt, which cuBLAS loads.
  if [ -f "$BUNDLE/MANIFEST" ]; then
    mapfile -t want < <(grep -o 'lib\(cublas\|cudart\|nccl\)[A-Za-z]*\.so\.[0-9]*' "$BUNDLE/MANIFEST" |
                        sed 'p; s/^libcublas\./libcublasLt./' | sort -u)
  fi
  [ ${#want[@]} -gt 0 ] || want=(libcublas.so.13 libcublasLt.so.13 libnccl.so.2)
  local cands
  mapfile -t cands < <(lib_candidates | awk '!seen[$0]++')
  for lib in "${want[@]}"; do
    found=""
    for d in "${cands[@]}"; do
      if [ -e "$d/$lib" ]; then found="$d"; break; fi
    done
    if [ -z "$found" ]; then  # last resort: search the file systems
      found="$(timeout 60 find / -xdev \( -path /proc -o -path /sys \) -prune -o -name "$lib" -print 2>/dev/null | head -n 1)"
      found="${found%/*}"
    fi
    if [ -n "$found" ]; then
      echo "  $lib: $found/$lib"
      case ":$path:" in *":$found:"*) ;; *) path="${path:+$path:}$found" ;; esac
    else
      echo "  $lib: NOT FOUND"
    fi
  done
  export LD_LIBRARY_PATH="$path${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  echo "  LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
}

xml_counts() {  # a gtest XML file -> "N tests, F failed, S skipped"
  "$PY" - "$1" <<'PY' 2>/dev/null || echo "no XML report"
import sys, xml.etree.ElementTree as ET
r = ET.parse(sys.argv[1]).getroot()
tests = failed = skipped = 0
for case in r.iter("testcase"):
    tests += 1
    if case.find("failure") is not None or case.find("error") is not None:
        failed += 1
    elif case.find("skipped") is not None or case.get("result") == "skipped" or case.get("status") == "notrun":
        skipped += 1
print(f"{tests} tests, {failed} failed, {skipped} skipped")
PY
}

step_tests() {
  local t0 t rc counts
  mkdir -p "$OUTDIR/tests"
  for t in "${TESTS[@]}"; do
    t0=$SECONDS
    if [ ! -x "$BUNDLE/$t" ]; then record "tests/$t" FAILED "not in the bundle" 0; continue; fi
    timeout "${TEST_TIMEOUT:-300}" "$BUNDLE/$t" --gtest_output="xml:$OUTDIR/tests/$t.xml" >"$OUTDIR/tests/$t.log" 2>&1
    rc=$?
    counts="$(xml_counts "$OUTDIR/tests/$t.xml")"
    [ -n "$DEVICE" ] || [ "$LIST_FAILED" = 1 ] || counts="$counts; no CUDA device: the cuda tests skip"
    if [ "$rc" = 0 ]; then
      record "tests/$t" passed "$counts" $((SECONDS - t0))
    else
      [ "$rc" = 124 ] && counts="timed out after ${TEST_TIMEOUT:-300} s; $counts"
      record "tests/$t" FAILED "exit code $rc; $counts; log: tests/$t.log" $((SECONDS - t0))
      grep -E "^\[  FAILED  \]|Failure|error" "$OUTDIR/tests/$t.log" | head -n 20
    fi
  done
}

step_memcheck() {
  local t t0 rc cs
  if [ -z "$DEVICE" ]; then record memcheck skipped "no CUDA device" 0; return; fi
  cs="$(command -v compute-sanitizer || true)"
  [ -n "$cs" ] || [ ! -x /usr/local/cuda/bin/compute-sanitizer ] || cs=/usr/local/cuda/bin/compute-sanitizer
  if [ -z "$cs" ]; then record memcheck skipped "compute-sanitizer not found (CUDA toolkit's bin/)" 0; return; fi
  mkdir -p "$OUTDIR/memcheck"
  for t in "${TESTS[@]}"; do
    t0=$SECONDS
    timeout "${MEMCHECK_TIMEOUT:-540}" "$cs" --tool memcheck --leak-check full --error-exitcode 1 \
      "$BUNDLE/$t" --gtest_filter="${MEMCHECK_FILTER:-*}" >"$OUTDIR/memcheck/$t.log" 2>&1
    rc=$?
    if [ "$rc" = 0 ]; then
      record "memcheck/$t" passed "$(grep -m 1 'ERROR SUMMARY' "$OUTDIR/memcheck/$t.log")" $((SECONDS - t0))
    else
      record "memcheck/$t" FAILED "exit code $rc; log: memcheck/$t.log" $((SECONDS - t0))
      grep -E "ERROR SUMMARY|Invalid|Leaked|FAILED" "$OUTDIR/memcheck/$t.log" | head -n 20
    fi
  done
}

step_validate() {
  local t0=$SECONDS dir
  if [ -z "$DEVICE" ]; then record validate skipped "no CUDA device" 0; return; fi
  dir="$OUTDIR/validation/$DEVICE_SLUG"
  if MOELAB="$BUNDLE/moelab" PYTHON="$PY" "$root/scripts/validate_sim.sh" --backend cuda --out "$dir"; then
    VALIDATION="$("$PY" - "$dir/comparison.json" <<'PY' 2>/dev/null || echo "no comparison.json"
import json, sys
c = json.load(open(sys.argv[1]))
print("median step error %.1f%%, worst %.1f%% (%s, %s calibration, %d configurations)" % (
    100 * c["median_step_error"], 100 * c["worst_step_error"], c["cluster_model"], c["calibration"],
    len(c["configurations"])))
PY
)"
    record validate passed "$VALIDATION; validation/$DEVICE_SLUG/" $((SECONDS - t0))
  else
    record validate FAILED "scripts/validate_sim.sh failed (above)" $((SECONDS - t0))
  fi
}

step_suites() {
  local t0=$SECONDS rc args=() id ids=("${RUN_IDS[@]}")
  if [ ${#ids[@]} -eq 0 ]; then
    # Every suite's runs on the cuda backend (by id; the grids are simulated): only those run,
    # and no suite summary is written (one of a cuda-only run would list everything else as skipped).
    mapfile -t ids < <("$PY" -c 'import sys; sys.path.insert(0, sys.argv[1]); import moelab_results as mr
print("\n".join(sorted({r["id"] for p in mr.registered_suites() for r in mr.load_suite(p).get("runs", [])
                         if r["backend"] == "cuda"})))' "$root/scripts")
    [ ${#ids[@]} -gt 0 ] || { record suites FAILED "no cuda runs found in experiments/*/suite.json" 0; return; }
  fi
  for id in "${ids[@]}"; do args+=(--run "$id"); done
  echo "$PY scripts/run_suite.py --backends cuda --out $OUTDIR/results --moelab $BUNDLE/moelab ${args[*]}"
  "$PY" "$root/scripts/run_suite.py" --backends cuda --out "$OUTDIR/results" --moelab "$BUNDLE/moelab" "${args[@]}" \
    2>&1 | tee "$OUTDIR/run_suite.log"
  rc=${PIPESTATUS[0]}
  local done_line skipped
  done_line="$(sed -n 's/^run_suite.py: \([0-9]* runs in [^;]*; [0-9]* failed\).*/\1/p' "$OUTDIR/run_suite.log" | tail -n 1)"
  skipped="$(grep -c '^ *\[.*\] skipped ' "$OUTDIR/run_suite.log" 2>/dev/null)"
  CUDA_RUNS="${done_line:-none} (runs ${ids[*]}); $(find "$OUTDIR/results" -path '*/measured/cuda/*' -name '*.json' \
    ! -name '*.trace.json' ! -name 'comparison.json' 2>/dev/null | wc -l) result file(s) under results/measured/cuda/"
  local note="$CUDA_RUNS; $skipped skip line(s)"
  [ -n "$DEVICE" ] || note="$note (no CUDA device: the cuda runs are listed as skipped)"
  if [ "$rc" = 0 ]; then
    record suites passed "$note" $((SECONDS - t0))
  else
    record suites FAILED "run_suite.py exit code $rc; $CUDA_RUNS cuda result file(s); log: run_suite.log" $((SECONDS - t0))
  fi
}

step_compare() {
  local t0=$SECONDS
  if "$PY" "$root/plots/mpipemoe_gpu.py" --results "$OUTDIR/results" --simulated "$root/results"; then
    record compare passed "$(ls "$OUTDIR"/results/measured/cuda/*/mpipemoe/comparison.json 2>/dev/null | wc -l) comparison.json written" $((SECONDS - t0))
  else
    record compare FAILED "plots/mpipemoe_gpu.py failed (above)" $((SECONDS - t0))
  fi
}

run() {
  OUTDIR="${OUT:-}"
  local only="tests,validate,suites,compare"
  BUNDLE="$root/build-gpu/bundle"
  RUN_IDS=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --only) only="$2"; shift ;;
      --only=*) only="${1#--only=}" ;;
      --run) RUN_IDS+=("$2"); shift ;;
      --bundle) BUNDLE="$2"; shift ;;
      -h|--help) sed -n '2,32p' "$0"; exit 0 ;;
      -*) die "run: unknown option $1" ;;
      *) OUTDIR="$1" ;;
    esac
    shift
  done
  [ -n "$OUTDIR" ] || die "run: give OUTDIR (or set OUT)"
  local s
  for s in ${only//,/ }; do
    case "$s" in tests|validate|suites|compare|memcheck) ;; *) die "--only: unknown step \"$s\" (tests, validate, suites, compare, memcheck)" ;; esac
  done
  case ",$only," in *,suites,*) case ",$only," in *,compare,*) ;; *) only="$only,compare" ;; esac ;; esac
  mkdir -p "$OUTDIR" || die "cannot create $OUTDIR"
  OUTDIR="$(cd "$OUTDIR" && pwd)"
  [ -d "$BUNDLE" ] || die "no bundle at $BUNDLE: run scripts/gpu.sh bundle on the build machine and carry it (docs/GPU.md)"
  BUNDLE="$(cd "$BUNDLE" && pwd)"
  [ -x "$BUNDLE/moelab" ] || die "no moelab in $BUNDLE"
  exec > >(tee -a "$OUTDIR/gpu-run.log") 2>&1

  echo "== gpu.sh run: steps $only; bundle $BUNDLE; results under $OUTDIR; $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n)"
  [ -f "$BUNDLE/MANIFEST" ] && sed -n '2,4p' "$BUNDLE/MANIFEST"
  PY="$(find_python)" || { echo "gpu.sh: no python3 (3.8+) found: the validate, suites and compare steps need one"; PY=python3; }
  echo "python: $PY ($("$PY" --version 2>&1))"
  export MOELAB_EXPERIMENTS="$root/experiments" PYTHONDONTWRITEBYTECODE=1
  echo "== CUDA libraries"
  find_libs
  if ldd "$BUNDLE/moelab" | grep -q "not found"; then
    echo "gpu.sh: moelab cannot start, libraries missing:"; ldd "$BUNDLE/moelab" | grep "not found"
  else
    ldd "$BUNDLE/moelab" | grep -E "cublas|nccl|cudart|libstdc"
  fi
  echo "== nvidia-smi"
  if command -v nvidia-smi >/dev/null; then timeout 60 nvidia-smi || true; else echo "nvidia-smi not found"; fi

  echo "== moelab list"
  LIST_FAILED=0
  local t0=$SECONDS
  "$BUNDLE/moelab" list >"$OUTDIR/moelab-list.txt" 2>&1
  local rc=$?
  cat "$OUTDIR/moelab-list.txt"
  DEVICE="$(sed -n 's/^ *cuda   available: //p' "$OUTDIR/moelab-list.txt")"
  DEVICE_SLUG=""
  if [ -n "$DEVICE" ]; then
    DEVICE_SLUG="$("$PY" -c 'import sys; sys.path.insert(0, sys.argv[1]); import moelab_results as mr
print(mr.slug(mr.device_class(sys.argv[2])))' "$root/scripts" "$DEVICE")"
  fi
  if [ "$rc" != 0 ]; then
    record list FAILED "moelab list exit code $rc: the bundled moelab does not start here" $((SECONDS - t0))
    LIST_FAILED=1
  elif [[ "$DEVICE" == "present, but it failed to start"* ]]; then
    record list FAILED "the CUDA device $DEVICE" $((SECONDS - t0))
    LIST_FAILED=1
  else
    record list passed "${DEVICE:-no CUDA device}${DEVICE_SLUG:+ -> $DEVICE_SLUG}" $((SECONDS - t0))
  fi

  VALIDATION="-"
  CUDA_RUNS="-"
  for s in tests validate suites compare memcheck; do
    case ",$only," in *",$s,"*) ;; *) continue ;; esac
    echo
    echo "== step $s ($((SECONDS - T0)) s so far)"
    if [ "$LIST_FAILED" = 1 ] && [ "$s" != tests ]; then
      record "$s" FAILED "not run: moelab does not start (see list)" 0
      continue
    fi
    "step_$s"
  done

  echo
  echo "== gpu.sh run: summary ($((SECONDS - T0)) s in all; device: ${DEVICE:-none})"
  printf '%-28s %-8s %6s  %s\n' step status seconds note
  local i
  for i in "${!STEP_NAMES[@]}"; do
    printf '%-28s %-8s %6s  %s\n' "${STEP_NAMES[$i]}" "${STEP_STATUS[$i]}" "${STEP_SECS[$i]}" "${STEP_NOTES[$i]}"
  done
  echo "validation: $VALIDATION"
  echo "cuda runs:  $CUDA_RUNS"
  if [ $((SECONDS - T0)) -gt 480 ]; then
    echo "note: $((SECONDS - T0)) s is close to the device tool's 600 s per command: split the work with --only (docs/GPU.md)"
  fi
  if [ -n "$DEVICE" ]; then
    echo "to commit (docs/GPU.md): results/measured/cuda/$DEVICE_SLUG/ and results/validation/$DEVICE_SLUG/ from $OUTDIR"
  fi
  exit "$FAILED"
}

case "${1:-}" in
  bundle) shift; bundle "$@" ;;
  run) shift; run "$@" ;;
  -h|--help) sed -n '2,32p' "$0" ;;
  "") sed -n '2,32p' "$0"; exit 2 ;;
  *) die "unknown command \"$1\" (bundle, run)" ;;
esac
