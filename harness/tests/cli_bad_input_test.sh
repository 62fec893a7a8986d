#!/usr/bin/env bash
# harness/tests/cli_bad_input_test.sh — bad input through the real `moelab run`: every case
# must exit with status 2, say on stderr which field or flag is wrong, and write nothing
# (no result file, no temporary file, not even the result's folder). One good run on the
# tiny workload must exit 0 and write a measured result.
#
#   bash harness/tests/cli_bad_input_test.sh build/harness/moelab /tmp/cli_bad_input
# CTest runs it as the test cli_bad_input (ctest --test-dir build -R cli_bad_input).
set -u

if [ $# -ne 2 ]; then
  echo "usage: $0 <path-to-moelab> <workdir>" >&2
  exit 2
fi
moelab=$1
work=$2
repo=$(cd "$(dirname "$0")/../.." && pwd)
rm -rf "$work"
mkdir -p "$work"

passed=0
failed=0
pass() { passed=$((passed + 1)); echo "ok    $1"; }
fail() {
  failed=$((failed + 1))
  echo "FAIL  $1: $2"
  [ -f "$work/$1/stderr" ] && sed 's/^/      stderr: /' "$work/$1/stderr"
}

# A valid workload, small enough for one step in well under a second.
valid='{
  "name": "cli-test",
  "model": { "d_model": 16, "d_hidden": 32, "num_experts": 4, "top_k": 2,
             "capacity_factor": 1.25, "activation": "gelu", "dtype": "fp32" },
  "tokens_per_rank": 64, "steps": 1, "warmup": 0, "seed": 1
}'

# workload CASE JSON: writes $work/CASE/w.json
workload() {
  mkdir -p "$work/$1"
  printf '%s\n' "$2" >"$work/$1/w.json"
}

# valid_with CASE SED-EXPRESSION: the valid workload with one edit
valid_with() {
  workload "$1" "$(printf '%s\n' "$valid" | sed "$2")"
}

# expect_bad CASE EXPECTED-TEXT ARGS...: `moelab run ARGS --out $work/CASE/out/result.json`
# must exit 2, print EXPECTED-TEXT on stderr, and leave no trace of an output.
expect_bad() {
  local name=$1 expected=$2
  shift 2
  local dir=$work/$name
  mkdir -p "$dir"
  "$moelab" run "$@" --out "$dir/out/result.json" >"$dir/stdout" 2>"$dir/stderr"
  local rc=$?
  if [ $rc -ne 2 ]; then
    fail "$name" "exit status $rc, expected 2"
  elif ! grep -qF -- "$expected" "$dir/stderr"; then
    fail "$name" "stderr does not mention '$expected'"
  elif ! grep -q '^moelab: error' "$dir/stderr"; then
    fail "$name" "stderr has no 'moelab: error' line"
  elif [ -e "$dir/out" ]; then
    fail "$name" "$dir/out was created"
  elif [ -n "$(find "$dir" -name '*.tmp.*')" ]; then
    fail "$name" "a temporary file was left: $(find "$dir" -name '*.tmp.*')"
  else
    pass "$name"
  fi
}

run_bad_workload() {  # CASE EXPECTED-TEXT: the workload file of CASE through fastmoe on cpu
  expect_bad "$1" "$2" --workload "$work/$1/w.json" --impl fastmoe --backend cpu
}

# ---- bad workload files ----------------------------------------------------------------------
workload malformed_json '{ "model": { "d_model": 16,, } }'
run_bad_workload malformed_json "malformed JSON at line 1"

workload missing_num_experts '{ "model": { "d_model": 16, "d_hidden": 32, "top_k": 1 }, "tokens_per_rank": 64 }'
run_bad_workload missing_num_experts "model.num_experts"

valid_with mistyped_d_model 's/"d_model": 16/"d_model": "abc"/'
run_bad_workload mistyped_d_model 'model.d_model: expected a positive integer, got "abc"'

valid_with zero_d_hidden 's/"d_hidden": 32/"d_hidden": 0/'
run_bad_workload zero_d_hidden "model.d_hidden"

valid_with negative_tokens 's/"tokens_per_rank": 64/"tokens_per_rank": -64/'
run_bad_workload negative_tokens "tokens_per_rank"

valid_with zero_steps 's/"steps": 1/"steps": 0/'
run_bad_workload zero_steps "steps"

valid_with top_k_too_large 's/"top_k": 2/"top_k": 9/'
run_bad_workload top_k_too_large "model.top_k = 9 must be <= model.num_experts = 4"

valid_with unknown_activation 's/"gelu"/"swish"/'
run_bad_workload unknown_activation 'model.activation = "swish"'

valid_with unknown_dtype 's/"fp32"/"fp16"/'
run_bad_workload unknown_dtype 'model.dtype = "fp16"'

valid_with unknown_field 's/"top_k"/"topk"/'
run_bad_workload unknown_field 'unknown field "model.topk"'

valid_with expert_parallel_mismatch 's/"seed": 1/"seed": 1, "expert_parallel": 2/'
run_bad_workload expert_parallel_mismatch "expert_parallel = 2 but 1 rank was launched"

valid_with bf16_on_cpu 's/"fp32"/"bf16"/'
run_bad_workload bf16_on_cpu "model.dtype"

mkdir -p "$work/missing_file"
expect_bad missing_file "no-such-workload.json" --workload "$work/missing_file/no-such-workload.json" \
  --impl fastmoe --backend cpu

# ---- bad flags -------------------------------------------------------------------------------
workload flags "$valid"
w=$work/flags/w.json
expect_bad unknown_impl "--impl" --workload "$w" --impl no-such-impl --backend cpu
expect_bad unknown_backend "--backend" --workload "$w" --impl fastmoe --backend no-such-backend
expect_bad missing_workload "--workload" --impl fastmoe --backend cpu
expect_bad missing_impl "--impl" --workload "$w" --backend cpu
expect_bad bad_steps "--steps" --workload "$w" --impl fastmoe --backend cpu --steps abc
expect_bad unknown_option "--bogus" --workload "$w" --impl fastmoe --backend cpu --bogus 1
expect_bad unwritable_trace "--trace" --workload "$w" --impl fastmoe --backend cpu \
  --trace /dev/null/trace.json

# --out itself in a place that cannot be a folder
name=unwritable_out
mkdir -p "$work/$name"
"$moelab" run --workload "$w" --impl fastmoe --backend cpu --out /dev/null/sub/result.json \
  >"$work/$name/stdout" 2>"$work/$name/stderr"
rc=$?
if [ $rc -ne 2 ]; then fail $name "exit status $rc, expected 2"
elif ! grep -qF -- "--out" "$work/$name/stderr"; then fail $name "stderr does not mention --out"
else pass $name
fi

# ---- one good run --------------------------------------------------------------------------
name=good_run
dir=$work/$name
mkdir -p "$dir"
"$moelab" run --workload "$repo/experiments/workloads/tiny.json" --impl fastmoe --backend cpu --steps 1 \
  --out "$dir/out/result.json" --trace "$dir/out/trace.json" >"$dir/stdout" 2>"$dir/stderr"
rc=$?
if [ $rc -ne 0 ]; then fail $name "exit status $rc, expected 0"
elif ! grep -q '"mode": "measured"' "$dir/out/result.json" 2>/dev/null; then fail $name "no measured result file"
elif ! grep -q '"traceEvents"' "$dir/out/trace.json" 2>/dev/null; then fail $name "no trace file"
elif ! grep -q '^experts: ' "$dir/stdout"; then fail $name "no experts-vs-bare line in the table"
elif [ -n "$(find "$dir" -name '*.tmp.*')" ]; then fail $name "a temporary file was left"
else pass $name
fi

echo "$passed passed, $failed failed"
[ $failed -eq 0 ]
