#!/usr/bin/env bash
# harness/tests/cli_pipeline_test.sh — `moelab run --model ... --parallel ...` through the real
# command line: pipelines with data and expert parallelism on cpu MPI ranks (the loss falls),
# interleaved and ZB-V schedules, a simulated 8-GPU run with its per-stage figures, link bytes,
# trace and schedule figure, every result checked against the result schema; then bad layouts
# and schedules: exit 2 with a one-line message naming the field, no result file.
#   bash harness/tests/cli_pipeline_test.sh build/harness/moelab /tmp/workdir
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
schema_ok() { PYTHONDONTWRITEBYTECODE=1 "$py" -c "import sys; sys.path.insert(0, sys.argv[2]); import moelab_results as mr; mr.load_result(sys.argv[1])" "$1" "$root/scripts"; }
have_mpi=0
command -v mpirun >/dev/null && have_mpi=1
four_layers='{"num_layers": 4}'

# 1. four cpu ranks: two stages of 1F1B, two data-parallel pipelines, experts over both (ep = 2);
#    the model learns (the loss falls), the result records the layout and both stages
if [ "$have_mpi" = 1 ] &&
   mpirun --oversubscribe -n 4 "$moelab" run --model "$models/tiny-moe.json" --impl fastmoe --backend cpu \
     --parallel pp=2,dp=2,ep=2 --schedule 1f1b --microbatches 4 --steps 30 --warmup 0 --lr 0.01 \
     --out "$work/cpu.json" >"$work/cpu.log" 2>&1 &&
   schema_ok "$work/cpu.json" &&
   [ "$(jget "$work/cpu.json" "['parallel']['layout']['pp']")" = "2" ] &&
   [ "$(jget "$work/cpu.json" "['parallel']['layout']['ep']")" = "2" ] &&
   [ "$(jget "$work/cpu.json" "['parallel']['schedule']['name']")" = "1f1b" ] &&
   "$py" -c "
import json, sys
d = json.load(open(sys.argv[1]))
p, l = d['parallel'], d['metrics']['loss']
sys.exit(0 if len(p['stages']) == 2 and p['link_bytes'] is None and l['last'] < l['first'] - 0.5 else 1)" "$work/cpu.json"; then
  ok "4 cpu ranks, pp=2 dp=2 ep=2, 1f1b: loss $(jget "$work/cpu.json" "['metrics']['loss']['first']") -> $(jget "$work/cpu.json" "['metrics']['loss']['last']")"
elif [ "$have_mpi" = 1 ]; then bad "4 cpu ranks pipeline"; cat "$work/cpu.log"; fi

# 2. two cpu ranks: interleaved 1F1B over 2 chunks with full recomputation, and ZB-V
for sched in "interleaved --chunks 2 --recompute full" "zb-v"; do
  name=${sched%% *}
  # shellcheck disable=SC2086
  if [ "$have_mpi" = 1 ] &&
     mpirun --oversubscribe -n 2 "$moelab" run --model "$models/tiny-moe.json" --model-override "$four_layers" \
       --impl fastmoe --backend cpu --parallel pp=2 --schedule $sched --microbatches 4 --steps 2 \
       --out "$work/$name.json" >"$work/$name.log" 2>&1 &&
     schema_ok "$work/$name.json" &&
     [ "$(jget "$work/$name.json" "['parallel']['schedule']['chunks']")" = "2" ]; then ok "2 cpu ranks, $sched"
  elif [ "$have_mpi" = 1 ]; then bad "2 cpu ranks, $sched"; cat "$work/$name.log"; fi
done

# 3. eight simulated A100s: pp=4 x dp=2, experts over the two data-parallel ranks, ZB-H1; the
#    pipeline's transfers and the expert all-to-alls cross NVLink; the trace draws the schedule
if "$moelab" run --model "$models/gpt3-moe-xl.json" --model-override '{"num_layers": 8}' --impl fastmoe --backend sim \
     --cluster dgx-a100x1 --parallel pp=4,dp=2,ep=2 --schedule zb-h1 --microbatches 8 --steps 1 --warmup 0 \
     --out "$work/sim.json" --trace "$work/sim.trace.json" >"$work/sim.log" 2>&1 &&
   schema_ok "$work/sim.json" &&
   [ "$(jget "$work/sim.json" "['mode']")" = "simulated" ] &&
   "$py" -c "
import json, sys
p = json.load(open(sys.argv[1]))['parallel']
assert p['layout']['pp'] == 4 and p['layout']['dp'] == 2 and p['schedule']['name'] == 'zb-h1', p['layout']
assert 0 < p['bubble'] < 0.5, p['bubble']
assert p['link_bytes']['nvlink'] > 0 and p['link_bytes']['nic'] == 0, p['link_bytes']
s = p['stages']
assert [x['ranks'] for x in s] == [[0, 1], [2, 3], [4, 5], [6, 7]], [x['ranks'] for x in s]
assert all(x['peak_activation_bytes'] > 0 and 0 <= x['bubble'] < 1 for x in s), s
" "$work/sim.json"; then
  ok "8 simulated A100s, pp=4 dp=2 ep=2, zb-h1: bubble $(jget "$work/sim.json" "['parallel']['bubble']")"
else bad "simulated pipeline"; cat "$work/sim.log"; fi
if "$py" -c "import matplotlib" 2>/dev/null; then
  if "$py" "$root/plots/pipeline_schedule.py" "$work/sim.trace.json" --title "{mode} {model}" --out "$work/sim.png" \
       >"$work/plot.log" 2>&1 && [ -s "$work/sim.png" ] && grep -q "bubble" "$work/plot.log"; then
    ok "schedule figure from the trace ($(grep -o 'bubble [0-9.]*%' "$work/plot.log"))"
  else bad "schedule figure"; cat "$work/plot.log"; fi
fi

# 4. tensor parallelism: 16 simulated A100s on two nodes, tp=2 x dp=8 with sequence parallelism,
#    ZeRO-1 and experts over all 16 ranks: the all-to-all's bytes split into NVSwitch and NIC;
#    and two cpu ranks training with tp=2 (the last ten steps' mean loss 0.3 below the first five's)
if "$moelab" run --model "$models/gpt2-moe-small.json" --model-override '{"num_layers": 2, "moe": {"num_experts": 16}}' \
     --impl fastmoe --backend sim --cluster dgx-a100x2 --parallel tp=2,dp=8,ep=16 --sequence-parallel --zero1 \
     --grad-bucket 1000000 --microbatches 2 --steps 1 --warmup 0 --out "$work/tp.json" >"$work/tp.log" 2>&1 &&
   schema_ok "$work/tp.json" &&
   "$py" -c "
import json, sys
p = json.load(open(sys.argv[1]))['parallel']
a = p['link_bytes_by_collective']['all_to_all']
assert a['nvlink'] > 0 and a['nic'] > 0, a
assert p['sequence_parallel'] and p['gradient_sync'] == {'kind': 'zero1', 'bucket_elems': 1000000}, p
assert p['layout']['tp'] == 2 and p['layout']['ep'] == 16, p['layout']
" "$work/tp.json"; then
  ok "16 simulated A100s, tp=2 dp=8 ep=16, sequence parallel, ZeRO-1: all-to-all on NVSwitch and NIC"
else bad "simulated tensor parallelism"; cat "$work/tp.log"; fi
if [ "$have_mpi" = 1 ] &&
   mpirun --oversubscribe -n 2 "$moelab" run --model "$models/tiny-moe.json" --impl fastmoe --backend cpu \
     --parallel tp=2 --sequence-parallel --microbatches 2 --steps 30 --warmup 0 --lr 0.01 \
     --out "$work/cpu_tp.json" >"$work/cpu_tp.log" 2>&1 &&
   schema_ok "$work/cpu_tp.json" &&
   "$py" -c "
import json, sys
a = json.load(open(sys.argv[1]))['metrics']['loss']['all']  # one microbatch's loss a step: noisy
sys.exit(0 if sum(a[-10:]) / 10 < sum(a[:5]) / 5 - 0.3 else 1)" "$work/cpu_tp.json"; then
  ok "2 cpu ranks, tp=2 with sequence parallelism: loss $(jget "$work/cpu_tp.json" "['metrics']['loss']['first']") -> $(jget "$work/cpu_tp.json" "['metrics']['loss']['last']")"
elif [ "$have_mpi" = 1 ]; then bad "2 cpu ranks, tp=2"; cat "$work/cpu_tp.log"; fi
# MPipeMoE's granularity search under sequence parallelism: its timed trials (as many as each
# rank's times decide) leave out the gate's sum over the TP group, which every real forward
# runs on every TP rank
if [ "$have_mpi" = 1 ]; then
  if timeout 120 mpirun --oversubscribe -n 2 "$moelab" run --model "$models/tiny-moe.json" --impl mpipemoe --backend cpu \
       --parallel tp=2 --sequence-parallel --microbatches 2 --steps 3 --warmup 1 --out "$work/cpu_tp_mpipemoe.json" \
       >"$work/cpu_tp_mpipemoe.log" 2>&1 && schema_ok "$work/cpu_tp_mpipemoe.json"; then
    ok "2 cpu ranks, mpipemoe with tp=2 and sequence parallelism"
  else bad "2 cpu ranks, mpipemoe with tp=2 and sequence parallelism"; cat "$work/cpu_tp_mpipemoe.log"; fi
fi

# 4a. tensor x pipeline parallelism with sequence parallelism: the stages pass T/tp rows, and the
#     loss is that of the same layout without it
if [ "$have_mpi" = 1 ]; then
  for sp in "" --sequence-parallel; do
    mpirun --oversubscribe -n 4 "$moelab" run --model "$models/tiny-dense.json" --model-override "$four_layers" --impl fastmoe \
      --backend cpu --parallel tp=2,pp=2 $sp --microbatches 2 --steps 2 --out "$work/tp_pp$sp.json" >"$work/tp_pp$sp.log" 2>&1 || true
  done
  a="$(grep -o 'loss .*' "$work/tp_pp.log")"; b="$(grep -o 'loss .*' "$work/tp_pp--sequence-parallel.log")"
  if [ -n "$a" ] && [ "$a" = "$b" ]; then ok "tp=2,pp=2 with sequence parallelism: the same loss"
  else bad "tp=2,pp=2 with sequence parallelism: '$a' vs '$b'"; cat "$work/tp_pp--sequence-parallel.log"; fi
fi

# 4b. PipeOffload on sim: group-interleaved with every activation offloaded, the uneven split;
#     the result records the offload plan, the bytes moved and k, and the closed forms
#     (a wider model than tiny-dense: with k near 1 the authors' gap rule keeps no transfer at all)
"$moelab" run --model "$models/tiny-dense.json" --impl fastmoe --backend sim --cluster dgx-a100x1 --ranks 4 \
  --model-override '{"num_layers": 6, "d_model": 2048, "d_ffn": 8192, "seq_len": 2048}' --parallel pp=4 \
  --schedule group-interleaved --chunks 2 --microbatches 8 \
  --pad-layers --offload-chunks all --offload-all-lifespans --steps 1 --out "$work/offload.json" >"$work/offload.log" 2>&1
if [ $? = 0 ] && schema_ok "$work/offload.json" &&
   [ "$(jget "$work/offload.json" "['parallel']['offload']['chunks']")" = 2 ] &&
   "$py" -c "import json,sys; o=json.load(open(sys.argv[1]))['parallel']; f=o['offload']
assert sum(s['bytes_per_step'] for s in f['stages']) > 0 and f['k'] > 0 and f['k_paper'] > 0
assert all(s['expected_peak_activation_ma'] is not None for s in o['stages'])
assert o['schedule']['group'] == 2 and o['schedule']['pad_layers']
assert min(s['kept'] for s in f['stages']) > 0 and 0 < f['k'] < 1" "$work/offload.json"; then ok "simulated offload"
else bad "simulated offload"; cat "$work/offload.log"; fi

# 5. bad layouts and schedules: exit 2, a message naming the field, no result file
expect_2() {
  local name="$1" want="$2"
  shift 2
  "$moelab" run "$@" --out "$work/$name.json" >"$work/$name.log" 2>&1
  local rc=$?
  if [ "$rc" = 2 ] && grep -q -- "$want" "$work/$name.log" && [ ! -e "$work/$name.json" ] &&
     [ "$(grep -c . "$work/$name.log")" -le 2 ]; then ok "$name: exit 2, names $want"
  else bad "$name: rc $rc"; cat "$work/$name.log"; fi
}
sim=(--model "$models/tiny-moe.json" --impl fastmoe --backend sim --cluster dgx-a100x1)
expect_2 layout_key "did you mean \"pp\"" "${sim[@]}" --ranks 4 --parallel "tp=1,pq=2"
expect_2 layout_world "does not divide" "${sim[@]}" --ranks 4 --parallel pp=3
expect_2 layout_layers "num_layers" "${sim[@]}" --ranks 4 --parallel pp=4
expect_2 layout_experts "num_experts" "${sim[@]}" --ranks 8 --parallel dp=8,ep=8
expect_2 layout_tp_heads "num_heads" "${sim[@]}" --ranks 8 --parallel tp=8
expect_2 layout_etp "etp = 2 (expert tensor parallelism)" "${sim[@]}" --ranks 4 --parallel tp=2,dp=2,ep=2,etp=2
expect_2 sequence_parallel_tp1 "--sequence-parallel needs tensor parallelism" "${sim[@]}" --ranks 4 --parallel dp=4 --sequence-parallel
expect_2 mpipemoe_auto_sim_group "partitions = \"auto\" times trial forwards" --model "$models/tiny-moe.json" \
  --impl mpipemoe --backend sim --cluster dgx-a100x1 --ranks 4 --parallel ep=2
expect_2 sequence_parallel_dedup "deepspeed-drop deduplicates its exchange over the TP group" --model "$models/tiny-moe.json" \
  --impl deepspeed-drop --backend sim --cluster dgx-a100x1 --ranks 4 --parallel tp=2 --sequence-parallel
expect_2 grad_bucket "--grad-bucket" "${sim[@]}" --ranks 4 --parallel dp=4 --grad-bucket 0
expect_2 schedule_name "did you mean \"zb-h1\"" "${sim[@]}" --ranks 4 --parallel pp=2 --schedule zb-h2
expect_2 schedule_layers "not divisible by the 4 virtual stages" "${sim[@]}" --ranks 4 --parallel pp=2 --schedule interleaved --chunks 2 --microbatches 4
expect_2 schedule_microbatches "multiple of pp = 2" "${sim[@]}" --ranks 4 --model-override "$four_layers" --parallel pp=2 --schedule interleaved --microbatches 3
expect_2 schedule_chunks "--chunks = 2" "${sim[@]}" --ranks 4 --parallel pp=2 --schedule 1f1b --chunks 2
expect_2 recompute_value "--recompute" "${sim[@]}" --ranks 4 --parallel pp=2 --recompute some
expect_2 layers_and_parallel "exclude each other" "${sim[@]}" --ranks 4 --parallel pp=2 --layers 0:1
expect_2 group_other_schedule "--group = 2 applies to group-interleaved only" "${sim[@]}" --ranks 4 --parallel pp=2 --schedule 1f1b --group 2
expect_2 offload_chunks "--offload-chunks 3 exceeds the 2 model chunks" "${sim[@]}" --ranks 4 --model-override "$four_layers" --parallel pp=2 --schedule interleaved --chunks 2 --microbatches 4 --offload-chunks 3
expect_2 offload_recompute "--offload-chunks with --recompute full" "${sim[@]}" --ranks 4 --model-override "$four_layers" --parallel pp=2 --schedule interleaved --chunks 2 --microbatches 4 --offload-chunks all --recompute full
expect_2 pad_layers_empty "with no layer and neither the embedding nor the head" --model "$models/tiny-dense.json" --impl fastmoe --backend sim --cluster dgx-a100x1 --ranks 4 --model-override '{"num_layers": 2}' --parallel pp=2 --schedule interleaved --chunks 4 --microbatches 4 --pad-layers
expect_2 zero1_tied_chunks "ZeRO-1 with tie_embeddings and the embedding and the LM head in different chunks" "${sim[@]}" --ranks 4 --model-override "$four_layers" --parallel dp=4 --schedule interleaved --chunks 2 --microbatches 4 --zero1
expect_2 workload_and_parallel "apply to --model runs" --workload "$root/experiments/workloads/tiny.json" --impl fastmoe --backend cpu --parallel pp=2
if [ "$have_mpi" = 1 ]; then
  mpirun --oversubscribe -n 2 "$moelab" run --model "$models/tiny-moe.json" --impl fastmoe --backend cpu --parallel pp=3 \
    --out "$work/mpi_bad.json" >"$work/mpi_bad.log" 2>&1
  rc=$?
  if [ "$rc" = 2 ] && grep -q "pp" "$work/mpi_bad.log" && [ ! -e "$work/mpi_bad.json" ]; then ok "2 cpu ranks, pp=3: exit 2 on every rank"
  else bad "2 cpu ranks, pp=3: rc $rc"; cat "$work/mpi_bad.log"; fi
fi

echo "cli_pipeline: $pass passed, $fail failed"
[ "$fail" = 0 ]
