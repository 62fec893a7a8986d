#!/usr/bin/env bash
# harness/tests/cli_model_test.sh — `moelab run --model` through the real command line: a tiny
# MoE model trains on cpu (the loss falls), the same on two MPI ranks, a 24-layer GPT3-MoE-XL
# step on eight simulated A800s, a layer range, inference (--inference), training data from a
# Markov source and a text with a validation curve (--data, --eval-every), gradient buckets
# overlapping backward, a vision model (cpu, two ranks with ScMoE, SwinV2-MoE-S on sim), and bad
# model input (exit 2, no file).
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

# 5. --inference: forward passes only. On cpu the first step's loss is the training run's first
# (same seed, same tokens, parameters not yet updated), with no optimizer, no gradients and
# less activation memory; on sim a step of GPT2-MoE-Small-ScMoE is shorter than its training step.
if "$moelab" run --model "$models/tiny-moe.json" --impl fastmoe --backend cpu --steps 1 --warmup 0 --micro-batch 4 \
     --out "$work/t1.json" >"$work/t1.log" 2>&1 &&
   "$moelab" run --model "$models/tiny-moe.json" --impl fastmoe --backend cpu --steps 1 --warmup 0 --micro-batch 4 \
     --inference --out "$work/inf.json" >"$work/inf.log" 2>&1 &&
   [ "$(jget "$work/inf.json" "['training']['pass']")" = "inference" ] &&
   [ "$(jget "$work/inf.json" "['training']['optimizer']")" = "none" ] &&
   "$py" -c "
import json, sys
t, i = (json.load(open(p))['metrics'] for p in sys.argv[1:3])
lt, li = t['loss']['first'], i['loss']['first']
act = lambda m: m['peak_memory_bytes']['peak_per_category']['activations']
pk = i['peak_memory_bytes']['peak_per_category']
ok = abs(lt - li) <= 1e-6 * abs(lt) and act(i) < act(t) and pk['optimizer'] == 0 and pk['gradients'] == 0
sys.exit(0 if ok else 1)" "$work/t1.json" "$work/inf.json"; then
  ok "--inference on cpu: the training run's first loss $(jget "$work/inf.json" "['metrics']['loss']['first']"), less activation memory, no optimizer or gradients"
else bad "--inference on cpu"; cat "$work/inf.log"; fi
if "$moelab" run --model "$models/gpt2-moe-small-scmoe.json" --impl fastmoe --backend sim --cluster pcie-a30x1 --steps 1 \
     --warmup 0 --inference --out "$work/sim_inf.json" >"$work/sim_inf.log" 2>&1 &&
   "$moelab" run --model "$models/gpt2-moe-small-scmoe.json" --impl fastmoe --backend sim --cluster pcie-a30x1 --steps 1 \
     --warmup 0 --out "$work/sim_train.json" >"$work/sim_train.log" 2>&1 &&
   "$py" -c "
import json, sys
i, t = (json.load(open(p))['metrics'] for p in sys.argv[1:3])
sys.exit(0 if 0 < i['step_time_s']['max'] < t['step_time_s']['max'] / 2 and 'optimizer' not in {k for k, v in i['phases_s'].items() if v > 0} else 1)" \
     "$work/sim_inf.json" "$work/sim_train.json"; then
  ok "--inference on sim: GPT2-MoE-Small-ScMoE $(jget "$work/sim_inf.json" "['metrics']['step_time_s']['max']") s vs training $(jget "$work/sim_train.json" "['metrics']['step_time_s']['max']") s"
else bad "--inference on sim"; cat "$work/sim_inf.log" "$work/sim_train.log"; fi

# --inference on replicas: 8 experts over 16 simulated A800s, each expert on edp = 2 ranks.
if "$moelab" run --model "$models/gpt2-moe-small.json" --impl top2 --backend sim --cluster a800x2 --parallel ep=8 \
     --steps 1 --warmup 0 --inference --out "$work/replicas.json" >"$work/replicas.log" 2>&1 &&
   jget "$work/replicas.json" "['training']['replicas']" | grep -q "ep=8,etp=1,edp=2" &&
   [ "$(jget "$work/replicas.json" "['world_size']")" = "16" ]; then ok "--inference --parallel ep=8 on 16 simulated GPUs: every expert on 2 ranks"
else bad "--inference on replicas"; cat "$work/replicas.log"; fi

# --data: a Markov source of entropy rate ln 8 and a text (README.md as bytes); the validation
# curve starts before the first step, ends after the last and falls (by over 1.5 nats from ln 256
# in 200 steps); it never goes below ln 8.
if "$moelab" run --model "$models/tiny-moe.json" --impl fastmoe --backend cpu --steps 200 --warmup 0 --lr 0.01 \
     --micro-batch 8 --data markov:8 --eval-every 100 --out "$work/markov.json" >"$work/markov.log" 2>&1 &&
   "$moelab" run --model "$models/tiny-moe.json" --impl fastmoe --backend cpu --steps 30 --warmup 0 --lr 0.01 \
     --micro-batch 2 --data "$root/README.md" --eval-every 30 --out "$work/text.json" >"$work/text.log" 2>&1 &&
   "$py" -c "
import json, math, sys
m, t = (json.load(open(p))['metrics']['validation'] for p in sys.argv[1:3])
pts = m['points']
ok = (abs(m['entropy_rate'] - math.log(8)) < 1e-12 and [p[0] for p in pts] == [0, 100, 200]
      and pts[-1][1] < pts[0][1] - 1.5 and all(p[1] > math.log(8) - 0.05 for p in pts)
      and t['entropy_rate'] is None and t['train_bytes'] > 9 * t['valid_bytes'] // 10 and len(t['points']) == 2)
sys.exit(0 if ok else 1)" "$work/markov.json" "$work/text.json"; then
  ok "--data markov:8 and a text file: validation $(jget "$work/markov.json" "['metrics']['validation']['points']")"
else bad "--data"; cat "$work/markov.log" "$work/text.log"; fi

# 6. data parallelism without a pipeline: the dense gradients are summed in buckets on their
# own stream while backward runs (PyTorch DDP's overlap): on 8 simulated A800s the step is
# shorter than the compute stream's busy time plus the synchroniser's.
if "$py" -c "
import json, sys
m = json.load(open(sys.argv[1]))['metrics']
busy = m['stream_busy_s']
sys.exit(0 if busy.get('grad_sync', 0) > 0 and m['step_time_s']['max'] < busy['compute'] + busy['grad_sync'] else 1)" "$work/xl.json"; then
  ok "gradient buckets overlap backward on sim (grad_sync stream busy $(jget "$work/xl.json" "['metrics']['stream_busy_s']['grad_sync']") s)"
else bad "gradient buckets overlapping backward"; jget "$work/xl.json" "['metrics']['stream_busy_s']"; fi

# 7. a vision model ("vision": patch embedding, window attention, patch merging, a classifier):
# tiny-swin-moe fits its synthetic images on cpu (the loss of 10 classes from ln 10 = 2.30 to
# below 1), on two MPI ranks with ScMoE's pair in its second stage, and SwinV2-MoE-S steps on 8
# simulated A30s, the patch merging and the head in the step's phases.
if "$moelab" run --model "$models/tiny-swin-moe.json" --impl fastmoe --backend cpu --steps 30 --warmup 0 --lr 3e-3 \
     --micro-batch 4 --out "$work/swin.json" >"$work/swin.log" 2>&1 &&
   "$py" -c "import json,sys; l=json.load(open(sys.argv[1]))['metrics']['loss']; sys.exit(0 if l['first'] > 2.0 and l['last'] < 1.0 else 1)" "$work/swin.json"
then ok "tiny-swin-moe trains on cpu: loss $(jget "$work/swin.json" "['metrics']['loss']['first']") -> $(jget "$work/swin.json" "['metrics']['loss']['last']")"
else bad "tiny-swin-moe on cpu"; cat "$work/swin.log"; fi
if command -v mpirun >/dev/null &&
   mpirun --oversubscribe -n 2 "$moelab" run --model "$models/tiny-swin-moe.json" --impl fastmoe \
     --model-override '{"moe": {"top_k": 1, "shared_expert_hidden": 64}, "scmoe": {"position": "pos3"}}' \
     --backend cpu --steps 3 --out "$work/swin-mpi.json" >"$work/swin-mpi.log" 2>&1 &&
   [ "$(jget "$work/swin-mpi.json" "['model']['scmoe']['position']")" = "pos3" ]; then ok "tiny-swin-moe with a ScMoE pair on 2 MPI ranks"
else bad "tiny-swin-moe ScMoE on 2 MPI ranks"; cat "$work/swin-mpi.log"; fi
if "$moelab" run --model "$models/swinv2-moe-s.json" --impl top2 --backend sim --cluster pcie-a30x1 --steps 1 --warmup 0 \
     --micro-batch 8 --out "$work/swinv2.json" >"$work/swinv2.log" 2>&1 &&
   "$py" -c "import json,sys; m=json.load(open(sys.argv[1]))['metrics']; p=m['phases_s']; sys.exit(0 if p['merge'] > 0 and p['head'] > 0 and p['dispatch'] > 0 and 0 < m['mfu'] < 1 else 1)" "$work/swinv2.json"
then ok "SwinV2-MoE-S step on 8 simulated A30s ($(grep -o 'MFU [0-9.]*%' "$work/swinv2.log"))"
else bad "SwinV2-MoE-S on sim"; cat "$work/swinv2.log"; fi

# 8. bad input: exit 2, a message naming the field, no result file
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
expect_2 gemm_path_unpriced "has no per-path GEMM data" --model "$models/tiny-moe.json" --impl fastmoe --backend sim \
  --cluster dgx-a100x1 --ranks 1 --gemm-path grouped
# A model run pins its expert GEMMs the same way, and says so.
if "$moelab" run --model "$models/tiny-moe.json" --impl fastmoe --backend sim --cluster h100x1 --ranks 1 --gemm-path grouped \
     --out "$work/gemm-path.json" >"$work/gemm-path.log" 2>&1 &&
   [ "$(jget "$work/gemm-path.json" "['metrics']['gemm_path_forced']")" = grouped ]; then
  ok "a model run records --gemm-path"
else bad "model run --gemm-path: $(tail -2 "$work/gemm-path.log")"; fi
expect_2 workload_and_model "exclude each other" --model "$models/tiny-moe.json" --workload "$root/experiments/workloads/tiny.json" --impl fastmoe --backend cpu
expect_2 model_override "num_layers" --model "$models/tiny-moe.json" --model-override '{"num_layers": 0}' --impl fastmoe --backend cpu
expect_2 inference_workload "apply to --model" --workload "$root/experiments/workloads/tiny.json" --inference --impl fastmoe --backend cpu
expect_2 inference_zero1 "for training" --model "$models/tiny-moe.json" --inference --zero1 --impl fastmoe --backend cpu
expect_2 data_missing "cannot read the file" --model "$models/tiny-moe.json" --data "$work/no-such-file" --impl fastmoe --backend cpu
expect_2 data_markov "markov:K" --model "$models/tiny-moe.json" --data markov:x --impl fastmoe --backend cpu
expect_2 data_sim "sim backend computes no values" --model "$models/tiny-moe.json" --data markov:4 --impl fastmoe --backend sim \
  --cluster dgx-a100x1 --ranks 2
expect_2 eval_without_data "needs --data" --model "$models/tiny-moe.json" --eval-every 5 --impl fastmoe --backend cpu
expect_2 inference_pp "only dp and ep" --model "$models/tiny-moe.json" --inference --parallel pp=2 --impl fastmoe --backend sim \
  --cluster dgx-a100x1 --ranks 2
expect_2 vision_layers "runs whole on every rank" --model "$models/tiny-swin-moe.json" --layers 0:2 --impl fastmoe --backend cpu
expect_2 vision_data "is a vision model" --model "$models/tiny-swin-moe.json" --data markov:4 --impl fastmoe --backend cpu
expect_2 vision_tp "not built for tensor parallelism" --model "$models/tiny-swin-moe.json" --parallel tp=2 --impl fastmoe \
  --backend sim --cluster dgx-a100x1 --ranks 2
expect_2 inference_optimizer "no optimizer" --model "$models/tiny-moe.json" --inference --optimizer sgd --impl fastmoe --backend cpu

echo "cli_model: $pass passed, $fail failed"
[ "$fail" = 0 ]
