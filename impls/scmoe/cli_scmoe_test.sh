#!/usr/bin/env bash
# impls/scmoe/cli_scmoe_test.sh — ScMoE models through the real command line: tiny-scmoe
# trains on cpu (the loss falls), on two MPI ranks with chunked all-to-alls, GPT2-MoE-Small-ScMoE
# and four layers of LLaMA2-MoE-ScMoE on eight simulated A30s over PCIe (the pair's schedule in
# the result), the baselines by name, offloaded inference (cpu: the same loss; one simulated A30:
# the device peak and sync against async copies), and bad input (exit 2, one line naming it, no
# file).
#   bash impls/scmoe/cli_scmoe_test.sh build/harness/moelab /tmp/workdir
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

# 1. tiny-scmoe trains 200 steps on cpu: the mean loss falls far below ln V = 5.55
if "$moelab" run --model "$models/tiny-scmoe.json" --impl fastmoe --backend cpu --steps 200 --warmup 0 --lr 0.01 \
     --micro-batch 4 --out "$work/train.json" >"$work/train.log" 2>&1; then
  first=$(jget "$work/train.json" "['metrics']['loss']['first']")
  last=$(jget "$work/train.json" "['metrics']['loss']['last']")
  pos=$(jget "$work/train.json" "['impl_report']['scmoe']['position']")
  if "$py" -c "import sys; f,l=float(sys.argv[1]),float(sys.argv[2]); sys.exit(0 if f > 5.0 and l < 2.5 else 1)" "$first" "$last" &&
     [ "$pos" = "pos2" ]; then
    ok "tiny-scmoe trains on cpu: loss $first -> $last"
  else bad "tiny-scmoe loss $first -> $last, position $pos"; fi
else bad "tiny-scmoe training run"; cat "$work/train.log"; fi

# 2. two MPI ranks, Pos-3, CG-2, two chunks per all-to-all, FasterMoE serving the routed part
if command -v mpirun >/dev/null &&
   mpirun --oversubscribe -n 2 "$moelab" run --model "$models/tiny-scmoe.json" \
     --model-override '{"scmoe": {"position": "pos3", "combine": "cg2", "chunks": 2}}' --impl fastermoe \
     --backend cpu --steps 3 --microbatches 2 --out "$work/mpi.json" >"$work/mpi.log" 2>&1 &&
   [ "$(jget "$work/mpi.json" "['world_size']")" = "2" ] &&
   [ "$(jget "$work/mpi.json" "['impl_report']['scmoe']['chunks']")" = "2" ]; then ok "2 MPI ranks, pos3, cg2, 2 chunks, fastermoe"
else bad "2 MPI ranks"; cat "$work/mpi.log"; fi

# 3. GPT2-MoE-Small-ScMoE (Pos-2, CG-1) on 8 simulated A30s: the schedule's choice in the result
if "$moelab" run --model "$models/gpt2-moe-small-scmoe.json" --impl fastmoe --backend sim --cluster pcie-a30x1 \
     --steps 1 --warmup 1 --out "$work/small.json" >"$work/small.log" 2>&1 &&
   [ "$(jget "$work/small.json" "['impl_report']['scmoe']['position']")" = "pos2" ] &&
   [ "$(jget "$work/small.json" "['impl_report']['scmoe']['expert_slot']['chosen']")" = "cost model" ] &&
   "$py" -c "import json,sys; m=json.load(open(sys.argv[1]))['metrics']; sys.exit(0 if m['phases_s']['experts'] > 0 and 'overlap_ratio' in json.dumps(m) else 1)" "$work/small.json"; then
  ok "GPT2-MoE-Small-ScMoE on pcie-a30x1: experts in slot $(jget "$work/small.json" "['impl_report']['scmoe']['expert_slot']['forward']") of $(jget "$work/small.json" "['impl_report']['scmoe']['window']")"
else bad "GPT2-MoE-Small-ScMoE on sim"; cat "$work/small.log"; fi

# 4. LLaMA2-MoE-ScMoE (Pos-1, every block an MoE), four layers on the same machine
if "$moelab" run --model "$models/llama2-moe-scmoe.json" --layers 0:4 --impl fastmoe --backend sim --cluster pcie-a30x1 \
     --steps 1 --warmup 0 --out "$work/llama.json" >"$work/llama.log" 2>&1 &&
   [ "$(jget "$work/llama.json" "['impl_report']['scmoe']['position']")" = "pos1" ] &&
   [ "$(jget "$work/llama.json" "['impl_report']['scmoe']['layers']")" = "[0, 0]" ]; then ok "LLaMA2-MoE-ScMoE layers 0:4 on pcie-a30x1"
else bad "LLaMA2-MoE-ScMoE on sim"; cat "$work/llama.log"; fi

# 5. the baselines run by name on the reference model
for impl in top2 top1 top2-pipelined; do
  if "$moelab" run --model "$models/gpt2-moe-small.json" --impl "$impl" --backend sim --cluster pcie-a30x1 --steps 1 \
       --warmup 0 --out "$work/$impl.json" >"$work/$impl.log" 2>&1 &&
     [ "$(jget "$work/$impl.json" "['impl']")" = "$impl" ]; then ok "baseline $impl on pcie-a30x1"
  else bad "baseline $impl"; cat "$work/$impl.log"; fi
done
if "$moelab" run --model "$models/gpt2-moe-small.json" --model-override '{"moe": {"shared_expert_hidden": 3072}}' \
     --impl residual-moe --backend sim --cluster pcie-a30x1 --steps 1 --warmup 0 --out "$work/residual.json" \
     >"$work/residual.log" 2>&1; then ok "baseline residual-moe with the model's dense MLP"
else bad "baseline residual-moe"; cat "$work/residual.log"; fi

# 6. offloaded inference (the paper's memory-limited inference): the routed experts in host memory. On cpu the loss
# is the resident run's; on one simulated A30 the device peak falls, and copying the selected
# experts in beside the pair's compute (async) is faster than in the compute stream's path (sync).
# (tiny-scmoe with two pairs: one pair's experts on the device at a time.)
if "$moelab" run --model "$models/tiny-scmoe.json" --model-override '{"num_layers": 4}' --impl fastmoe --backend cpu \
     --steps 1 --warmup 0 --inference --out "$work/inf_none.json" >"$work/inf_none.log" 2>&1 &&
   "$moelab" run --model "$models/tiny-scmoe.json" --model-override '{"num_layers": 4}' --impl fastmoe --backend cpu \
     --steps 1 --warmup 0 --inference --offload-experts async --out "$work/inf_async.json" >"$work/inf_async.log" 2>&1 &&
   "$py" -c "
import json, sys
n, a = (json.load(open(p))['metrics'] for p in sys.argv[1:3])
pk = lambda m: m['peak_memory_bytes']
ok = (abs(n['loss']['first'] - a['loss']['first']) <= 1e-6 * abs(n['loss']['first'])
      and pk(a)['peak_per_category']['host_pinned'] > 0 and pk(a)['device_total'] < pk(n)['device_total']
      and pk(n)['peak_per_category']['gradients'] == 0)
sys.exit(0 if ok else 1)" "$work/inf_none.json" "$work/inf_async.json"; then
  ok "offloaded inference on cpu: the resident run's loss, less device memory"
else bad "offloaded inference on cpu"; cat "$work/inf_async.log"; fi
for mode in none sync async; do
  "$moelab" run --model "$models/gpt2-moe-small-scmoe.json" --impl fastmoe --backend sim --cluster pcie-a30x1 --ranks 1 \
    --micro-batch 4 --steps 1 --warmup 0 --inference --offload-experts "$mode" --out "$work/off_$mode.json" \
    >"$work/off_$mode.log" 2>&1 ||
    { bad "offloaded inference on sim ($mode)"; cat "$work/off_$mode.log"; }
done
if "$py" -c "
import json, sys
n, s, a = (json.load(open(p))['metrics'] for p in sys.argv[1:4])
t = lambda m: m['step_time_s']['max']
d = lambda m: m['peak_memory_bytes']['device_total']
print(f'peak {d(n)/2**20:.0f} -> {d(a)/2**20:.0f} MiB; sync {t(s)*1e3:.2f} ms, async {t(a)*1e3:.2f} ms, resident {t(n)*1e3:.2f} ms')
slot = json.load(open(sys.argv[3]))['impl_report']['scmoe']
sys.exit(0 if d(a) < d(n) and t(s) > t(a) >= t(n) and a['host_copy_s'] > 0 and slot['migrate_us'] > 0 else 1)" \
     "$work/off_none.json" "$work/off_sync.json" "$work/off_async.json" >"$work/off.txt" 2>&1; then
  ok "offloaded inference of GPT2-MoE-Small-ScMoE on one simulated A30: $(cat "$work/off.txt")"
else bad "offloaded inference on sim: $(cat "$work/off.txt")"; fi

# 7. bad input: exit 2, a message naming it, no result file
expect_2() {
  local name="$1" want="$2"
  shift 2
  "$moelab" run "$@" --out "$work/$name.json" >"$work/$name.log" 2>&1
  local rc=$?
  if [ "$rc" = 2 ] && grep -q -- "$want" "$work/$name.log" && [ ! -e "$work/$name.json" ]; then ok "$name: exit 2, names $want"
  else bad "$name: rc $rc"; cat "$work/$name.log"; fi
}
expect_2 top2_on_scmoe "top-1" --model "$models/tiny-scmoe.json" --impl top2 --backend cpu
expect_2 split_pair "inside ScMoE's block pair" --model "$models/tiny-scmoe.json" --layers 1:2 --impl fastmoe --backend cpu
expect_2 position_typo "scmoe.position" --model "$models/tiny-scmoe.json" --model-override '{"scmoe": {"position": "pos5"}}' \
  --impl fastmoe --backend cpu
expect_2 scmoe_top2_file "moe.top_k" --model "$models/tiny-moe.json" --model-override '{"scmoe": {}}' --impl fastmoe --backend cpu
expect_2 residual_without_mlp "shared_expert_hidden" --model "$models/tiny-moe.json" --impl residual-moe --backend cpu
expect_2 chunks_option "chunks" --model "$models/tiny-moe.json" --impl top2-pipelined --impl-options '{"chunks": 0}' --backend cpu
expect_2 offload_training "needs --inference" --model "$models/tiny-scmoe.json" --offload-experts async --impl fastmoe --backend cpu
expect_2 offload_mode "--offload-experts" --model "$models/tiny-scmoe.json" --inference --offload-experts later --impl fastmoe --backend cpu
expect_2 offload_mpipemoe "pass of its own" --model "$models/tiny-moe.json" --inference --offload-experts sync --impl mpipemoe --backend cpu

echo "cli_scmoe: $pass passed, $fail failed"
[ "$fail" = 0 ]
