#!/usr/bin/env bash
# scripts/gpu.sh — the cuda backend's tests and measurements on a lent GPU machine, in two calls
# of the device tool (docs/GPU.md §2).
#
#   scripts/gpu.sh bundle                  # here (the build machine): build build-gpu, fill build-gpu/bundle/
#                                          # and pack it as build-gpu/bundle.tar.gz (what the device call carries)
#   scripts/gpu.sh run [OUTDIR]            # on the GPU machine: every step below -> OUTDIR/gpu-results.tar.gz
#   scripts/gpu.sh run OUTDIR --only tests,validate,peers   # some steps only (tests, validate, suites, peers, compare)
#   scripts/gpu.sh run OUTDIR --only suites --run gpu  # suites step with run_suite.py --run gpu (repeatable)
#   scripts/gpu.sh run OUTDIR --only suites --run gpu --workload W   # only those runs' jobs of workload W (repeatable)
#   scripts/gpu.sh run OUTDIR --only memcheck           # the optional step: the tests under compute-sanitizer
#   scripts/gpu.sh run OUTDIR --keep                    # also leave the unpacked files in OUTDIR
#   scripts/gpu.sh unpack ARCHIVE [DEST]   # here: a run's cuda results into DEST (default results/)
#
# bundle: configures and builds a cuda-only Release build (no MPI, no OpenBLAS, no Google
# Benchmark; GoogleTest and the CUDA runtime linked statically; sm_90 for H100/H200, or
# $CUDA_ARCHS) in $BUILD_DIR (default build-gpu), nice'd with $JOBS (default 2) jobs; copies
# moelab and the test binaries that exercise the cuda backend into build-gpu/bundle/ with a
# MANIFEST (commit, flags, binaries, sizes, the shared libraries they need); checks that they
# need nothing but cuBLAS, NCCL and the C/C++ runtime; packs the folder as build-gpu/bundle.tar.gz
# and checks that the working tree and that archive stay under the device tool's 64 MiB in all
# (what travels); prints the device calls. docs/GPU.md describes the whole procedure.
#
# run unpacks BUNDLE.tar.gz (default build-gpu/bundle.tar.gz, carried) into BUNDLE first when
# it is there.
#
# run: finds cuBLAS and NCCL (the toolkit's default location, else a Python environment's
# site-packages/nvidia/*/lib) and puts them on LD_LIBRARY_PATH; prints nvidia-smi and
# `moelab list`; then, each step timed and held to its time budget (below), each failure
# reported and the next step run anyway:
#   tests     each bundled test binary, directly (not ctest), --gtest_output=xml into OUTDIR/tests/
#   validate  scripts/validate_sim.sh --backend cuda into OUTDIR/validation/<device class>/
#   suites    scripts/run_suite.py --backends cuda --out OUTDIR/results --run ID... (every suite's
#             runs on the cuda backend, or those given with --run; no suite summary is written);
#             with the validate step's profile of this GPU when it ran first, else the profile of
#             a device of this name in the working tree (results/validation/<device class>/, an
#             earlier call's, unpacked) (--cuda-profile: the runs choose their GEMM paths by its
#             measured table); cut off by its budget, the runs that finished are kept
#   peers     scripts/peers/torch_moe.py, the PyTorch peer on the same shapes, when a python3
#             imports torch -> OUTDIR/results/measured/cuda/<device class>/peers/torch-moe.jsonl
#   compare   plots/mpipemoe_gpu.py: the measured MPipeMoE runs against their simulated
#             counterparts -> OUTDIR/results/measured/cuda/<device class>/mpipemoe/comparison.json
#   memcheck  (optional, only with --only ...,memcheck: slow) each bundled test binary under
#             compute-sanitizer --tool memcheck --leak-check full (out-of-bounds and misaligned
#             device accesses, leaks of device memory) into OUTDIR/memcheck/; $MEMCHECK_FILTER
#             narrows the tests (a --gtest_filter pattern), $MEMCHECK_TIMEOUT bounds each binary
# and ends with a table, also written to OUTDIR/summary.txt. Then it packs everything it wrote
# under OUTDIR into OUTDIR/gpu-results.tar.gz (summary and log included) and, unless --keep,
# removes the packed files, so that OUTDIR holds three files: gpu-results.tar.gz, summary.txt,
# gpu-run.log (the device tool brings back at most 8 files). Put the results back with
# `scripts/gpu.sh unpack OUTDIR/gpu-results.tar.gz`.
# Time: the device tool stops a command at 600 s, so the run keeps to $GPU_RUN_BUDGET seconds
# (default 570, packing included) and each step to its budget, $GPU_BUDGET_<STEP> (defaults
# from the times measured on one H100 at e25e2a0, docs/GPU.md): tests 120 (measured 4 for two of
# the six binaries; each binary at most $TEST_TIMEOUT, default 45), validate 180 (61 before calibrate measured the GEMM paths, copies by size, overheads, interference and dispatch, and the fit: about 25 s more expected), peers 90, compare 30; suites
# and memcheck get what is left after the budgets of the steps still to come. A step or test binary that runs out of time is stopped
# and reported TIMEOUT; one with no time left is not started. What a validate or peers step
# that failed or ran out of time wrote is renamed *.incomplete, which unpack leaves out.
# Without a CUDA device every step says so and skips (exit code 0). Exit code 1 if any step
# failed or ran out of time. Everything printed is also in OUTDIR/gpu-run.log.
#
# unpack: extracts the archive, copies its results/measured/cuda/<device class>/ and
# validation/<device class>/ into DEST/measured/cuda/ and DEST/validation/ (files of the same
# name replaced, others left), prints the run's summary and what to run next; the logs and
# test reports stay in the archive (tar -xzf ARCHIVE -C DIR). Exit code 2 if it cannot be read.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build-gpu}"
# The test binaries that run on the cuda backend (their tests skip without a device).
TESTS=(cuda_backend_test cuda_blocks_test gemm_epilogue_test host_pool_test moe_layer_test model_test)

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

  # What travels is the working tree (tracked and untracked-not-ignored files) and the carried
  # paths, 64 MiB in all: the binaries go as one compressed archive (they share the static CUDA
  # runtime, GoogleTest and the kernels), which gpu.sh run unpacks into build-gpu/bundle/.
  local tgz="$build/bundle.tar.gz" packed tree
  tar -C "$b" -cf - . | gzip -9 >"$tgz.tmp" && mv -f "$tgz.tmp" "$tgz"
  packed="$(stat -c %s "$tgz")"
  tree="$(cd "$root" && git ls-files -z --cached --others --exclude-standard |
          xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')"
  echo
  echo "bundle: ${b#"$root"/} ($((bytes / 1024)) KiB), packed as ${tgz#"$root"/} ($((packed / 1024)) KiB)"
  echo "travels: the working tree $((tree / 1024)) KiB + the archive $((packed / 1024)) KiB = $(((tree + packed) / 1024)) KiB of the device tool's 65536 KiB"
  [ $((tree + packed)) -lt $((60 * 1024 * 1024)) ] ||
    die "the working tree ($tree bytes) and ${tgz#"$root"/} ($packed bytes) are too close to the device tool's 64 MiB in all"
  case "$commit" in *-dirty) echo "note: built from a tree with uncommitted changes; results will say $commit" ;; esac
  echo "device calls (docs/GPU.md): carry [\"${tgz#"$root"/}\"], commands"
  echo "  \"scripts/gpu.sh run \$OUT --only tests,validate,suites,peers --run cuda --run cuda-grouped --run cuda-padded-strided --run gpu-stage --run gpu-stage-offall\""
  echo "  then, after scripts/gpu.sh unpack of the first archive: \"scripts/gpu.sh run \$OUT --only suites --run gpu\""
}

# ---- run ------------------------------------------------------------------------------------

T0=$SECONDS
STEP_NAMES=()
STEP_STATUS=()
STEP_NOTES=()
STEP_SECS=()
FAILED=0
WROTE=()  # what the run wrote under OUTDIR (top-level names): packed, then removed unless --keep

# Time budgets in seconds (docs/GPU.md has the measured times they come from). 0: what is left.
RUN_BUDGET="${GPU_RUN_BUDGET:-570}"
PACK_RESERVE=15
declare -A BUDGET=([tests]="${GPU_BUDGET_TESTS:-120}" [validate]="${GPU_BUDGET_VALIDATE:-180}"
                   [suites]="${GPU_BUDGET_SUITES:-0}" [peers]="${GPU_BUDGET_PEERS:-90}"
                   [compare]="${GPU_BUDGET_COMPARE:-30}" [memcheck]="${GPU_BUDGET_MEMCHECK:-0}")
STEPS=(tests validate suites peers compare memcheck)

record() {  # name status note seconds
  STEP_NAMES+=("$1"); STEP_STATUS+=("$2"); STEP_NOTES+=("$3"); STEP_SECS+=("$4")
  case "$2" in FAILED|TIMEOUT) FAILED=1 ;; esac
  echo "-- $1: $2${3:+ ($3)} [$4 s; $((SECONDS - T0)) s since the start]"
}

wrote() {  # top-level names under OUTDIR that the run wrote
  local n
  for n in "$@"; do
    case " ${WROTE[*]} " in *" $n "*) ;; *) WROTE+=("$n") ;; esac
  done
}

# Seconds the step may take: its budget, or less when the run's budget minus packing and the
# budgets of the selected steps after it that will run leaves less (suites, memcheck: all of that).
step_budget() {
  local step="$1" later=0 s after=0 left
  for s in "${STEPS[@]}"; do
    if [ "$after" = 1 ]; then
      case ",$ONLY," in *",$s,"*)
        case "$s" in validate|peers|memcheck) [ -n "$DEVICE" ] || continue ;; esac
        [ "$s" != peers ] || [ -n "$TORCH_PY" ] || continue
        later=$((later + BUDGET[$s])) ;;
      esac
    fi
    [ "$s" = "$step" ] && after=1
  done
  left=$((RUN_BUDGET - (SECONDS - T0) - PACK_RESERVE - later))
  if [ "${BUDGET[$step]}" -gt 0 ] && [ "${BUDGET[$step]}" -lt "$left" ]; then echo "${BUDGET[$step]}"; else echo "$left"; fi
}

timed_out() { [ "$1" = 124 ] || [ "$1" = 137 ]; }  # timeout's codes: stopped, or killed after -k

first_python() {  # CODE CANDIDATE...: the first candidate python that runs CODE without error
  local code="$1" p
  shift
  for p in "$@"; do
    [ -n "$p" ] || continue
    if "$p" -c "$code" >/dev/null 2>&1; then
      command -v "$p"
      return 0
    fi
  done
  return 1
}

find_python() {
  first_python 'import json, sys; sys.exit(0 if sys.version_info >= (3, 8) else 1)' \
    "${PYTHON:-}" python3 /usr/bin/python3 /opt/torch/.venv/bin/python3 /opt/torch/.venv/bin/python
}

find_torch_python() {  # a python3 that imports torch, $PY first
  first_python 'import torch' "$PY" "${PYTHON:-}" python3 /opt/torch/.venv/bin/python3 /usr/bin/python3
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
  local t0 t rc counts b end=$((SECONDS + $(step_budget tests)))
  mkdir -p "$OUTDIR/tests"
  wrote tests
  for t in "${TESTS[@]}"; do
    t0=$SECONDS
    if [ ! -x "$BUNDLE/$t" ]; then record "tests/$t" FAILED "not in the bundle" 0; continue; fi
    b=$((end - SECONDS))
    [ "${TEST_TIMEOUT:-45}" -lt "$b" ] && b="${TEST_TIMEOUT:-45}"  # one binary that hangs leaves time to the rest
    if [ "$b" -lt 2 ]; then record "tests/$t" TIMEOUT "not started: the tests' time budget is spent" 0; continue; fi
    timeout -k 5 "$b" "$BUNDLE/$t" --gtest_output="xml:$OUTDIR/tests/$t.xml" >"$OUTDIR/tests/$t.log" 2>&1
    rc=$?
    counts="$(xml_counts "$OUTDIR/tests/$t.xml")"
    [ -n "$DEVICE" ] || [ "$LIST_FAILED" = 1 ] || counts="$counts; no CUDA device: the cuda tests skip"
    if [ "$rc" = 0 ]; then
      record "tests/$t" passed "$counts" $((SECONDS - t0))
    elif timed_out "$rc"; then
      record "tests/$t" TIMEOUT "stopped after its $b s budget; log: tests/$t.log" $((SECONDS - t0))
    else
      record "tests/$t" FAILED "exit code $rc; $counts; log: tests/$t.log" $((SECONDS - t0))
      grep -E "^\[  FAILED  \]|Failure|error" "$OUTDIR/tests/$t.log" | head -n 20
    fi
  done
}

step_memcheck() {
  local t t0 rc cs b end
  if [ -z "$DEVICE" ]; then record memcheck skipped "no CUDA device" 0; return; fi
  cs="$(command -v compute-sanitizer || true)"
  [ -n "$cs" ] || [ ! -x /usr/local/cuda/bin/compute-sanitizer ] || cs=/usr/local/cuda/bin/compute-sanitizer
  if [ -z "$cs" ]; then record memcheck skipped "compute-sanitizer not found (CUDA toolkit's bin/)" 0; return; fi
  mkdir -p "$OUTDIR/memcheck"
  wrote memcheck
  end=$((SECONDS + $(step_budget memcheck)))
  for t in "${TESTS[@]}"; do
    t0=$SECONDS
    b=$((end - SECONDS))
    [ "${MEMCHECK_TIMEOUT:-540}" -lt "$b" ] && b="${MEMCHECK_TIMEOUT:-540}"
    if [ "$b" -lt 2 ]; then record "memcheck/$t" TIMEOUT "not started: no time left in the run's budget" 0; continue; fi
    timeout -k 5 "$b" "$cs" --tool memcheck --leak-check full --error-exitcode 1 \
      "$BUNDLE/$t" --gtest_filter="${MEMCHECK_FILTER:-*}" >"$OUTDIR/memcheck/$t.log" 2>&1
    rc=$?
    if [ "$rc" = 0 ]; then
      record "memcheck/$t" passed "$(grep -m 1 'ERROR SUMMARY' "$OUTDIR/memcheck/$t.log")" $((SECONDS - t0))
    elif timed_out "$rc"; then
      record "memcheck/$t" TIMEOUT "stopped after $b s; narrow it with MEMCHECK_FILTER; log: memcheck/$t.log" $((SECONDS - t0))
    else
      record "memcheck/$t" FAILED "exit code $rc; log: memcheck/$t.log" $((SECONDS - t0))
      grep -E "ERROR SUMMARY|Invalid|Leaked|FAILED" "$OUTDIR/memcheck/$t.log" | head -n 20
    fi
  done
}

step_validate() {
  local t0=$SECONDS dir b rc
  if [ -z "$DEVICE" ]; then record validate skipped "no CUDA device" 0; return; fi
  dir="$OUTDIR/validation/$DEVICE_SLUG"
  wrote validation
  b="$(step_budget validate)"
  if [ "$b" -lt 10 ]; then record validate TIMEOUT "not started: $b s left of the run's budget" 0; return; fi
  MOELAB="$BUNDLE/moelab" PYTHON="$PY" timeout -k 5 "$b" "$root/scripts/validate_sim.sh" --backend cuda --out "$dir"
  rc=$?
  if [ "$rc" = 0 ]; then
    VALIDATION="$("$PY" - "$dir/comparison.json" <<'PY' 2>/dev/null || echo "no comparison.json"
import json, sys
c = json.load(open(sys.argv[1]))
print("median step error %.1f%%, worst %.1f%% (%s, %s calibration, %d configurations)" % (
    100 * c["median_step_error"], 100 * c["worst_step_error"], c["cluster_model"], c["calibration"],
    len(c["configurations"])))
PY
)"
    record validate passed "$VALIDATION; validation/$DEVICE_SLUG/" $((SECONDS - t0))
    return
  fi
  # Not a validation (gpu.sh unpack leaves it out), and no profile for the suites step.
  [ -d "$dir" ] && rm -rf "$dir.incomplete" && mv "$dir" "$dir.incomplete"
  if timed_out "$rc"; then
    record validate TIMEOUT "stopped after its $b s budget; what it wrote: validation/$DEVICE_SLUG.incomplete/" $((SECONDS - t0))
  else
    record validate FAILED "scripts/validate_sim.sh failed (above); what it wrote: validation/$DEVICE_SLUG.incomplete/" $((SECONDS - t0))
  fi
}

step_suites() {
  local t0=$SECONDS rc b args=() id ids=("${RUN_IDS[@]}")
  if [ ${#ids[@]} -eq 0 ]; then
    # Every suite's runs on the cuda backend (by id; the grids are simulated): only those run,
    # and no suite summary is written (one of a cuda-only run would list everything else as skipped).
    mapfile -t ids < <("$PY" -c 'import sys; sys.path.insert(0, sys.argv[1]); import moelab_results as mr
print("\n".join(sorted({r["id"] for p in mr.registered_suites() for r in mr.load_suite(p).get("runs", [])
                         if r["backend"] == "cuda"})))' "$root/scripts")
    [ ${#ids[@]} -gt 0 ] || { record suites FAILED "no cuda runs found in experiments/*/suite.json" 0; return; }
  fi
  for id in "${ids[@]}"; do args+=(--run "$id"); done
  for id in "${WORKLOADS[@]}"; do args+=(--workload "$id"); done
  # The validate step's profile of this GPU (when it ran first in this run): the cuda runs
  # choose their GEMM paths by its measured table rather than the built-in H100 one.
  # Else the one an earlier call's validate step left, unpacked into the working tree here
  # (results/validation/<device class>/), when it was measured on a device of this name.
  local prof="$OUTDIR/validation/$DEVICE_SLUG/profile.json" tree_prof="$root/results/validation/$DEVICE_SLUG/profile.json"
  if ! [ -f "$prof" ] && [ -n "$DEVICE_SLUG" ] && [ -f "$tree_prof" ] && "$PY" -c '
import json, sys
p = json.load(open(sys.argv[1]))
sys.exit(0 if p.get("device") == sys.argv[2] and "gemm_paths" in p else 1)' "$tree_prof" "$DEVICE" 2>/dev/null; then
    prof="$tree_prof"
  fi
  if [ -f "$prof" ] && grep -q '"gemm_paths"' "$prof"; then
    args+=(--cuda-profile "$prof")
    echo "suites: the cuda runs choose their GEMM paths by ${prof#"$OUTDIR"/}"
  else
    echo "suites: no profile of this GPU with a GEMM-path table: the cuda runs choose by the built-in table"
  fi
  wrote results run_suite.log
  b="$(step_budget suites)"
  if [ "$b" -lt 10 ]; then record suites TIMEOUT "not started: $b s left of the run's budget" 0; return; fi
  echo "$PY scripts/run_suite.py --backends cuda --out $OUTDIR/results --moelab $BUNDLE/moelab ${args[*]} (budget $b s)"
  timeout -k 5 "$b" "$PY" "$root/scripts/run_suite.py" --backends cuda --out "$OUTDIR/results" \
    --moelab "$BUNDLE/moelab" "${args[@]}" 2>&1 | tee "$OUTDIR/run_suite.log"
  rc=${PIPESTATUS[0]}
  local done_line skipped finished planned kept=""
  if timed_out "$rc"; then
    # run_suite.py merges its candidate folder only at its end: keep the runs that finished
    # (each file complete, written atomically) as it would have.
    kept="$("$PY" - "$root/scripts" "$OUTDIR/results" <<'PY' 2>&1
import os, sys
sys.path.insert(0, sys.argv[1])
import compare_results
v = compare_results.install(sys.argv[2], os.path.join(sys.argv[2], "candidate"), log=lambda *a: None)
print(v["written"] + v["new"])
PY
)"
  fi
  done_line="$(sed -n 's/^run_suite.py: \([0-9]* runs in [^;]*; [0-9]* failed\).*/\1/p' "$OUTDIR/run_suite.log" | tail -n 1)"
  finished="$(grep -c '^\[.*\] cuda .*: measured' "$OUTDIR/run_suite.log" 2>/dev/null)"
  planned="$(sed -n 's/^run_suite.py: .*(full): \([0-9]*\) runs,.*/\1/p; s/^run_suite.py: .*(quick): \([0-9]*\) runs,.*/\1/p' \
             "$OUTDIR/run_suite.log" | head -n 1)"
  skipped="$(grep -c '^ *\[.*\] skipped ' "$OUTDIR/run_suite.log" 2>/dev/null)"
  CUDA_RUNS="${done_line:-$finished of ${planned:-?} runs measured, then cut off} (runs ${ids[*]}); $(find "$OUTDIR/results" -path '*/measured/cuda/*' -name '*.json' \
    ! -name '*.trace.json' ! -name 'comparison.json' 2>/dev/null | wc -l) result file(s) under results/measured/cuda/"
  local note="$CUDA_RUNS; $skipped skip line(s)"
  [ -n "$DEVICE" ] || note="$note (no CUDA device: the cuda runs are listed as skipped)"
  if [ "$rc" = 0 ]; then
    record suites passed "$note" $((SECONDS - t0))
  elif timed_out "$rc"; then
    record suites TIMEOUT "stopped after its $b s budget: $CUDA_RUNS ($kept kept from results/candidate/); rerun the rest with --only suites --run ID [--workload W]" $((SECONDS - t0))
  else
    record suites FAILED "run_suite.py exit code $rc; $CUDA_RUNS; log: run_suite.log" $((SECONDS - t0))
  fi
}

step_peers() {
  local t0=$SECONDS tpy="$TORCH_PY" b rc out lines
  if [ -z "$tpy" ]; then
    record peers skipped "no python3 here imports torch (python3 -c \"import torch\")" 0; return
  fi
  if [ -z "$DEVICE" ]; then record peers skipped "no CUDA device" 0; return; fi
  out="$OUTDIR/results/measured/cuda/$DEVICE_SLUG/peers/torch-moe.jsonl"
  mkdir -p "$(dirname "$out")"
  rm -f "$out"
  wrote results peers.log
  b="$(step_budget peers)"
  if [ "$b" -lt 10 ]; then record peers TIMEOUT "not started: $b s left of the run's budget" 0; return; fi
  echo "$tpy scripts/peers/torch_moe.py --out ${out#"$OUTDIR"/} (budget $b s)"
  PYTHONUNBUFFERED=1 LD_LIBRARY_PATH="$ORIG_LD_LIBRARY_PATH" timeout -k 5 "$b" "$tpy" "$root/scripts/peers/torch_moe.py" \
    --out "$out" --commit "$COMMIT" 2>&1 | tee "$OUTDIR/peers.log"
  rc=${PIPESTATUS[0]}
  lines="$([ -f "$out" ] && wc -l <"$out" || echo 0)"
  if [ "$rc" = 0 ] && [ "$lines" = 0 ] && grep -q '^torch_moe.py: skipped: ' "$OUTDIR/peers.log"; then
    record peers skipped "$(sed -n 's/^torch_moe.py: skipped: //p' "$OUTDIR/peers.log" | head -n 1)" $((SECONDS - t0))
  elif [ "$rc" = 0 ]; then
    record peers passed "$lines shape(s) into ${out#"$OUTDIR"/} (PyTorch $(sed -n 's/.*"torch": *"\([^"]*\)".*/\1/p' "$out" | head -n 1))" $((SECONDS - t0))
  else
    [ -f "$out" ] && mv -f "$out" "$out.incomplete"  # gpu.sh unpack leaves it out
    if timed_out "$rc"; then
      record peers TIMEOUT "stopped after its $b s budget; $lines shape(s) done (kept as .incomplete); log: peers.log" $((SECONDS - t0))
    else
      record peers FAILED "scripts/peers/torch_moe.py exit code $rc; log: peers.log" $((SECONDS - t0))
    fi
  fi
}

step_compare() {
  local t0=$SECONDS b rc
  b="$(step_budget compare)"
  if [ "$b" -lt 1 ]; then record compare TIMEOUT "not started: $b s left of the run's budget" 0; return; fi  # timeout 0: no limit
  timeout -k 5 "$b" "$PY" "$root/plots/mpipemoe_gpu.py" --results "$OUTDIR/results" --simulated "$root/results"
  rc=$?
  if [ "$rc" = 0 ]; then
    record compare passed "$(ls "$OUTDIR"/results/measured/cuda/*/mpipemoe/comparison.json 2>/dev/null | wc -l) comparison.json written" $((SECONDS - t0))
  elif timed_out "$rc"; then
    record compare TIMEOUT "stopped after its $b s budget" $((SECONDS - t0))
  else
    record compare FAILED "plots/mpipemoe_gpu.py failed (above)" $((SECONDS - t0))
  fi
}

summary_table() {
  local i
  printf '%-28s %-8s %6s  %s\n' step status seconds note
  for i in "${!STEP_NAMES[@]}"; do
    printf '%-28s %-8s %6s  %s\n' "${STEP_NAMES[$i]}" "${STEP_STATUS[$i]}" "${STEP_SECS[$i]}" "${STEP_NOTES[$i]}"
  done
  echo "validation: $VALIDATION"
  echo "cuda runs:  $CUDA_RUNS"
}

# OUTDIR/summary.txt, then everything the run wrote (summary and log included) into
# OUTDIR/gpu-results.tar.gz; unless --keep, the packed files are removed from OUTDIR.
pack() {
  local archive="$OUTDIR/gpu-results.tar.gz" names=() n rc
  {
    echo "moelab scripts/gpu.sh run: steps $ONLY; $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n)"
    echo "bundle commit: $COMMIT; device: ${DEVICE:-none}${DEVICE_SLUG:+ ($DEVICE_SLUG)}"
    echo "time: $((SECONDS - T0)) s of the run's $RUN_BUDGET s budget; exit code $FAILED"
    echo
    summary_table
    echo
    echo "archive: gpu-results.tar.gz (everything this run wrote; this summary and gpu-run.log included)"
    echo "unpack:  scripts/gpu.sh unpack gpu-results.tar.gz   (results/measured/cuda/, results/validation/; docs/GPU.md)"
  } >"$OUTDIR/summary.txt"
  for n in "${WROTE[@]}" summary.txt gpu-run.log; do [ -e "$OUTDIR/$n" ] && names+=("$n"); done
  # gpu-run.log is still being written (by the tee of this output): tar says so with exit code 1.
  tar -C "$OUTDIR" -czf "$archive.tmp" -- "${names[@]}" 2>/dev/null
  rc=$?
  if [ "$rc" -gt 1 ] || ! tar -tzf "$archive.tmp" >/dev/null 2>&1; then
    rm -f "$archive.tmp"
    echo "gpu.sh: packing $archive failed (tar exit code $rc); the files stay in $OUTDIR"
    FAILED=1
    return
  fi
  mv -f "$archive.tmp" "$archive"
  local bytes
  bytes="$(stat -c %s "$archive")"
  echo "archive: $archive ($((bytes / 1024)) KiB; ${names[*]})"
  [ "$bytes" -lt $((16 * 1024 * 1024)) ] || echo "note: over the device tool's 16 MiB per file: split the run with --only"
  if [ "$KEEP" = 0 ]; then
    for n in "${WROTE[@]}"; do rm -rf -- "${OUTDIR:?}/$n"; done
    echo "left in $OUTDIR: $(cd "$OUTDIR" && ls | tr '\n' ' ')(--keep leaves the unpacked files too)"
  fi
}

run() {
  OUTDIR="${OUT:-}"
  ONLY="tests,validate,suites,peers,compare"
  BUNDLE="$root/build-gpu/bundle"
  RUN_IDS=()
  WORKLOADS=()
  KEEP=0
  while [ $# -gt 0 ]; do
    case "$1" in
      --only) ONLY="$2"; shift ;;
      --only=*) ONLY="${1#--only=}" ;;
      --run) RUN_IDS+=("$2"); shift ;;
      --workload) WORKLOADS+=("$2"); shift ;;
      --bundle) BUNDLE="$2"; shift ;;
      --keep) KEEP=1 ;;
      -h|--help) usage; exit 0 ;;
      -*) die "run: unknown option $1" ;;
      *) OUTDIR="$1" ;;
    esac
    shift
  done
  [ -n "$OUTDIR" ] || die "run: give OUTDIR (or set OUT)"
  [ ${#WORKLOADS[@]} -eq 0 ] || [ ${#RUN_IDS[@]} -gt 0 ] || die "run: --workload selects among the jobs of --run ID: give the run id too"
  local s
  for s in ${ONLY//,/ }; do
    case "$s" in tests|validate|suites|peers|compare|memcheck) ;; *) die "--only: unknown step \"$s\" (${STEPS[*]})" ;; esac
  done
  for s in "${STEPS[@]}"; do
    [[ "${BUDGET[$s]}" =~ ^[0-9]+$ ]] || die "GPU_BUDGET_${s^^}=${BUDGET[$s]}: expected whole seconds"
  done
  [[ "$RUN_BUDGET" =~ ^[0-9]+$ ]] || die "GPU_RUN_BUDGET=$RUN_BUDGET: expected whole seconds"
  case ",$ONLY," in *,suites,*) case ",$ONLY," in *,compare,*) ;; *) ONLY="$ONLY,compare" ;; esac ;; esac
  mkdir -p "$OUTDIR" || die "cannot create $OUTDIR"
  OUTDIR="$(cd "$OUTDIR" && pwd)"
  # The carried archive (gpu.sh bundle: BUNDLE.tar.gz) replaces whatever bundle folder an
  # earlier call left on this machine.
  if [ -f "$BUNDLE.tar.gz" ]; then
    rm -rf "$BUNDLE" && mkdir -p "$BUNDLE" && tar -xzf "$BUNDLE.tar.gz" -C "$BUNDLE" ||
      die "cannot unpack $BUNDLE.tar.gz into $BUNDLE"
  fi
  [ -d "$BUNDLE" ] || die "no bundle at $BUNDLE (or $BUNDLE.tar.gz): run scripts/gpu.sh bundle on the build machine and carry it (docs/GPU.md)"
  BUNDLE="$(cd "$BUNDLE" && pwd)"
  [ -x "$BUNDLE/moelab" ] || die "no moelab in $BUNDLE"
  exec > >(tee -a "$OUTDIR/gpu-run.log") 2>&1

  echo "== gpu.sh run: steps $ONLY; bundle $BUNDLE; results under $OUTDIR; $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n)"
  echo "time budget: $RUN_BUDGET s in all; steps $(for s in "${STEPS[@]}"; do printf '%s %s, ' "$s" "${BUDGET[$s]/#0/what is left}"; done | sed 's/, $//')"
  COMMIT=unknown
  if [ -f "$BUNDLE/MANIFEST" ]; then
    sed -n '2,4p' "$BUNDLE/MANIFEST"
    COMMIT="$(sed -n 's/^commit: *//p' "$BUNDLE/MANIFEST" | head -n 1)"
  fi
  PY="$(find_python)" || { echo "gpu.sh: no python3 (3.8+) found: the validate, suites and compare steps need one"; PY=python3; }
  echo "python: $PY ($("$PY" --version 2>&1))"
  TORCH_PY=""
  case ",$ONLY," in
    *,peers,*) TORCH_PY="$(find_torch_python)" || TORCH_PY=""
               echo "torch:  ${TORCH_PY:-no python3 here imports torch (the peers step skips)}" ;;
  esac
  # PyTorch loads the CUDA libraries of its own wheels: it runs with the library path it was
  # found with, not the one find_libs sets for the bundle.
  ORIG_LD_LIBRARY_PATH="${LD_LIBRARY_PATH-}"
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
  timeout -k 5 60 "$BUNDLE/moelab" list >"$OUTDIR/moelab-list.txt" 2>&1
  local rc=$?
  wrote moelab-list.txt
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
  for s in "${STEPS[@]}"; do
    case ",$ONLY," in *",$s,"*) ;; *) continue ;; esac
    echo
    echo "== step $s ($((SECONDS - T0)) s so far; budget $(step_budget "$s") s)"
    if [ "$LIST_FAILED" = 1 ] && [ "$s" != tests ]; then
      record "$s" FAILED "not run: moelab does not start (see list)" 0
      continue
    fi
    "step_$s"
  done

  echo
  echo "== gpu.sh run: summary ($((SECONDS - T0)) s in all; device: ${DEVICE:-none})"
  summary_table
  if [ -n "$DEVICE" ]; then
    echo "to commit (docs/GPU.md): scripts/gpu.sh unpack gpu-results.tar.gz -> results/measured/cuda/$DEVICE_SLUG/, results/validation/$DEVICE_SLUG/"
  fi
  pack
  echo "gpu.sh run: exit code $FAILED after $((SECONDS - T0)) s"
  exit "$FAILED"
}

# ---- unpack ---------------------------------------------------------------------------------

unpack() {
  [ $# -ge 1 ] && [ $# -le 2 ] || die "unpack ARCHIVE [DEST]: DEST is a results folder (default $root/results)"
  local archive="$1" dest="${2:-$root/results}" tmp d cls n copied=0
  [ -f "$archive" ] || die "unpack: no archive $archive"
  tmp="$(mktemp -d "${TMPDIR:-/tmp}/gpu-unpack.XXXXXX")" || die "unpack: cannot make a temporary folder"
  # shellcheck disable=SC2064
  trap "rm -rf '$tmp'" EXIT
  tar -xzf "$archive" -C "$tmp" || die "unpack: $archive is not a readable .tar.gz"
  [ -f "$tmp/summary.txt" ] && cat "$tmp/summary.txt" && echo
  # A step that failed or ran out of time marked what it left as incomplete: never over the
  # complete files of an earlier run.
  while IFS= read -r n; do
    echo "not unpacked (incomplete): ${n#"$tmp"/}"
    rm -rf "$n"
  done < <(find "$tmp" -name '*.incomplete' -prune 2>/dev/null)
  for d in "$tmp"/results/measured/cuda/*/ "$tmp"/validation/*/; do
    [ -d "$d" ] || continue
    cls="$(basename "$d")"
    case "$d" in "$tmp"/validation/*) n="validation/$cls" ;; *) n="measured/cuda/$cls" ;; esac
    mkdir -p "$dest/$n"
    cp -R "$d." "$dest/$n/"
    echo "unpacked: $n/ ($(find "$d" -type f | wc -l) files) -> $dest/$n/"
    copied=$((copied + 1))
  done
  if [ "$copied" = 0 ]; then
    echo "gpu.sh unpack: no cuda results in $archive (a run without a CUDA device?); nothing copied"
    return 0
  fi
  echo "next: /usr/bin/python3 plots/mpipemoe_gpu.py; /usr/bin/python3 plots/report.py --results results --out docs/RESULTS.md"
  echo "logs and test reports: tar -xzf $archive -C DIR"
}

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

case "${1:-}" in
  bundle) shift; bundle "$@" ;;
  run) shift; run "$@" ;;
  unpack) shift; unpack "$@" ;;
  -h|--help) usage ;;
  "") usage; exit 2 ;;
  *) die "unknown command \"$1\" (bundle, run, unpack)" ;;
esac
