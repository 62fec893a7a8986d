#!/usr/bin/env bash
# harness/tests/cli_model_test.sh — `moelab run --model` through the real command line: a tiny
# MoE model trains on cpu (the loss falls), the same on two MPI ranks, a 24-layer GPT3-MoE-XL
# step on eight simulated A800s, a layer range, and bad model input (exit 2, no file).
#   bash harness/tests/cli_model_test.sh build/harness/moelab /tmp/workdir
set -u
moelab="$1"
work="$2"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
models="$root/experiments/models"
rm -rf "$work" && mkdir -p "$work"
pass=0
fail=0
ok() { pass=$((pass + 1)); echo "ok   $1"; }
bad() { fail=$((fail + 1)); echo "FAIL $1"; }
py=/usr/bin/python3
jget() { "$py" -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval('d' + sys.argv[2]))" "$1" "$2"; }

# 1. tiny-moe trains 200 steps on cpu: the mean loss of the last step is far below ln V = 5.55
if "$moelab" run --model "$models/tiny-moe.json" --impl fastmoe --backend cpu --steps 200 --warmup 0 --lr 0.01 \
     --micro-batch 4 --out "$work/train.json" >"$work/train.log" 2>&1; then
  first=$(jget "$work/train.json" "['metrics']['loss']['first']")
  last=$(jget "$work/train.json" "['metrics']['loss']['last']")
  if "$py" -c "import sys; f,l=float(sys.argv[1]),float(sys.argv[2]); sys.exit(0 if f > 5.0 and l < 1.0 else 1)" "$first" "$last"; then
    ok "tiny-moe trains on cpu: loss $first -> $last"
  else bad "tiny-moe loss $first -> $last (expected > 5.0 -> < 1.0)"; fi
else bad "tiny-moe training run"; cat "$work/train.log"; fi

# 2. two MPI ranks (data parallel dense layers, expert parallel MoE layers), with mpipemoe
if command -v mpirun >/dev/null &&
   mpirun --oversubscribe -n 2 "$moelab" run --model "$models/tiny-moe.json" --impl mpipemoe --impl-options '{"partitions": 2}' \
     --backend cpu --steps 3 --microbatches 2 --out "$work/mpi.json" >"$work/mpi.log" 2>&1 &&
   [ "$(jget "$work/mpi.json" "['world_size']")" = "2" ]; then ok "2 MPI ranks, mpipemoe, 2 microbatches"
else bad "2 MPI ranks"; cat "$work/mpi.log"; fi

# 3. GPT3-MoE-XL (24 layers, MoE every second, 8 experts, bf16) on 8 simulated A800s
if "$moelab" run --model "$models/gpt3-moe-xl.json" --impl fastmoe --backend sim --cluster a800x1 --steps 1 --warmup 0 \
     --out "$work/xl.json" --trace "$work/xl.trace.json" >"$work/xl.log" 2>&1 &&
   [ "$(jget "$work/xl.json" "['mode']")" = "simulated" ] &&
   [ "$(jget "$work/xl.json" "['world_size']")" = "8" ] &&
   [ "$(jget "$work/xl.json" "['model']['num_layers']")" = "24" ] &&
   "$py" -c "import json,sys; m=json.load(open(sys.argv[1]))['metrics']; sys.exit(0 if m['phases_s']['experts'] > 0 and m['phases_s']['attention'] > 0 and 0 < m['mfu'] < 1 else 1)" "$work/xl.json"; then
  ok "GPT3-MoE-XL step on 8 simulated A800s ($(grep -o 'MFU [0-9.]*%' "$work/xl.log"))"
else bad "GPT3-MoE-XL on sim"; cat "$work/xl.log"; fi

# 4. a layer range (a pipeline stage without embedding or head)
if "$moelab" run --model "$models/gpt3-moe-xl.json" --layers 4:8 --model-override '{"tie_embeddings": false}' --impl fastmoe \
     --backend sim --cluster a800x1 --steps 1 --warmup 0 --out "$work/stage.json" >"$work/stage.log" 2>&1 &&
   [ "$(jget "$work/stage.json" "['training']['layers']")" = "[4, 8]" ]; then ok "--layers 4:8 runs a stage"
else bad "--layers"; cat "$work/stage.log"; fi

# 5. bad input: exit 2, a message naming the field, no result file
expect_2() {
  local name="$1" want="$2"
  shift 2
  "$moelab" run "$@" --out "$work/$name.json" >"$work/$name.log" 2>&1
  local rc=$?
  if [ "$rc" = 2 ] && grep -q -- "$want" "$work/$name.log" && [ ! -e "$work/$name.json" ]; then ok "$name: exit 2, names $want"
  else bad "$name: rc $rc"; cat "$work/$name.log"; fi
}
sed 's/"num_heads": 4/"num_heads": 5/' "$models/tiny-moe.json" >"$work/heads.json"
expect_2 bad_model_file "num_heads" --model "$work/heads.json" --impl fastmoe --backend cpu
printf '{"name": ' >"$work/trunc.json"
expect_2 malformed_model "trunc.json" --model "$work/trunc.json" --impl fastmoe --backend cpu
expect_2 layers_out_of_range "layers" --model "$models/tiny-moe.json" --layers 1:9 --impl fastmoe --backend cpu
expect_2 experts_not_dividing "num_experts" --model "$models/tiny-moe.json" --impl fastmoe --backend sim --cluster dgx-a100x1 --ranks 3
expect_2 workload_and_model "exclude each other" --model "$models/tiny-moe.json" --workload "$root/experiments/workloads/tiny.json" --impl fastmoe --backend cpu
expect_2 model_override "num_layers" --model "$models/tiny-moe.json" --model-override '{"num_layers": 0}' --impl fastmoe --backend cpu

echo "cli_model: $pass passed, $fail failed"
[ "$fail" = 0 ]
