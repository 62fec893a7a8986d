#!/usr/bin/env bash
# impls/monta/cli_monta_test.sh — MoNTA and its baselines through the real command line: tiny-moe
# trains with TP 2 on two MPI ranks with each strategy (the same loss curve), the 70B-class
# model's two MoE blocks on 16 simulated A800s (auto's candidates in the result; deduplicated
# faster than DeepSpeed as published), and bad input (exit 2, one line naming it, no file).
#   bash impls/monta/cli_monta_test.sh build/harness/moelab /tmp/workdir
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

# 1. two MPI ranks, TP 2 (the MoE layer's TP group is the pair), every strategy: the same losses
if command -v mpirun >/dev/null; then
  for impl in deepspeed-tp deepspeed-drop monta; do
    opts='{}'
    [ "$impl" = monta ] && opts='{"chunks": 2}'
    mpirun --oversubscribe -np 2 "$moelab" run --model "$models/tiny-moe.json" --impl "$impl" --impl-options "$opts" \
      --backend cpu --parallel tp=2,ep=2 --steps 5 --warmup 0 --lr 0.01 --micro-batch 2 \
      --out "$work/$impl.json" >"$work/$impl.log" 2>&1 || { bad "$impl on 2 ranks"; cat "$work/$impl.log"; }
  done
  if "$py" -c "
import json, sys
c = [json.load(open(f'$work/{i}.json'))['metrics']['loss']['all'] for i in ('deepspeed-tp', 'deepspeed-drop', 'monta')]
sys.exit(0 if all(abs(a - b) < 1e-4 * max(1, abs(a)) for x in c[1:] for a, b in zip(c[0], x)) and c[0][-1] < c[0][0] else 1)"; then
    ok "TP 2 on 2 ranks: deepspeed-tp, deepspeed-drop and monta train alike ($(jget "$work/monta.json" "['metrics']['loss']['all']"))"
  else bad "the strategies' losses differ"; fi
fi

# 2. two MoE blocks of MoNTA-2x70B at TP 8, EP 16 on 16 simulated A800s
for impl in deepspeed-tp monta; do
  "$moelab" run --model "$models/monta-2x70b.json" --model-override '{"num_layers": 2}' --impl "$impl" \
    --impl-options "$([ "$impl" = monta ] && echo '{"chunks": "auto", "layouts": true}' || echo '{}')" --backend sim --cluster a800x2 \
    --parallel tp=8,ep=16 --steps 1 --warmup 0 --out "$work/sim-$impl.json" >"$work/sim-$impl.log" 2>&1 ||
    { bad "$impl on sim"; cat "$work/sim-$impl.log"; }
done
if "$py" -c "
import json, sys
m, d = (json.load(open(f'$work/sim-{i}.json')) for i in ('monta', 'deepspeed-tp'))
c = m['impl_report']['chunks_choice']
lay = c['layouts']
ok = (c['chunks'] == m['impl_report']['chunks'] and len(c['candidates']) >= 5
      and m['metrics']['step_time_s']['median'] < d['metrics']['step_time_s']['median']
      and lay['world'] == 16 and lay['this'] == {'tp': 8, 'ep': 16} and len(lay['ranked']) == 20)
sys.exit(0 if ok else 1)"; then
  ok "MoNTA-2x70B blocks on sim: auto picked $(jget "$work/sim-monta.json" "['impl_report']['chunks']") chunks, faster than deepspeed-tp; 20 layouts ranked"
else bad "MoNTA on sim"; fi

# 3. bad input: exit 2, a message naming it, no result file
expect_2() {
  local name="$1" want="$2"
  shift 2
  "$moelab" run "$@" --out "$work/$name.json" >"$work/$name.log" 2>&1
  local rc=$?
  if [ "$rc" = 2 ] && grep -q -- "$want" "$work/$name.log" && [ ! -e "$work/$name.json" ]; then ok "$name: exit 2, names $want"
  else bad "$name: rc $rc"; cat "$work/$name.log"; fi
}
expect_2 chunks_zero "chunks" --model "$models/tiny-moe.json" --impl monta --impl-options '{"chunks": 0}' --backend cpu
expect_2 chunks_word "chunks" --model "$models/tiny-moe.json" --impl monta --impl-options '{"chunks": "sometimes"}' --backend cpu
expect_2 monta_typo "chunk" --model "$models/tiny-moe.json" --impl monta --impl-options '{"chunk": 2}' --backend cpu
expect_2 layouts_without_auto "give both" --model "$models/tiny-moe.json" --impl monta --impl-options '{"chunks": 2, "layouts": true}' --backend cpu
expect_2 deepspeed_options "takes no options" --model "$models/tiny-moe.json" --impl deepspeed-tp --impl-options '{"chunks": 2}' --backend cpu
expect_2 no_capacity "capacity_factor" --model "$models/tiny-moe.json" --model-override '{"moe": {"capacity_factor": 0}}' \
  --impl deepspeed-drop --backend cpu

echo "cli_monta: $pass passed, $fail failed"
[ "$fail" = 0 ]
