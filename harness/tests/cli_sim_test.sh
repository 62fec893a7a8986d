#!/usr/bin/env bash
# harness/tests/cli_sim_test.sh — the simulated path through the real command line:
# calibrate (cpu) -> profile -> sim run with it; a routing trace recorded on cpu replayed
# by the sim; determinism of simulated results; bad cluster/profile input.
#   bash harness/tests/cli_sim_test.sh build/harness/moelab /tmp/workdir
set -u
moelab="$1"
work="$2"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
tiny="$root/experiments/workloads/tiny.json"
small="$root/experiments/workloads/small.json"
rm -rf "$work" && mkdir -p "$work"
pass=0
fail=0
ok() { pass=$((pass + 1)); echo "ok   $1"; }
bad() { fail=$((fail + 1)); echo "FAIL $1"; }
py=/usr/bin/python3
jget() { "$py" -c "import json,sys; d=json.load(open(sys.argv[1])); print(eval('d' + sys.argv[2]))" "$1" "$2"; }

# 1. calibrate the cpu backend, run the sim with the profile
if "$moelab" calibrate --backend cpu --quick --name cpu-test --out "$work/profile.json" >"$work/cal.log" 2>&1 &&
   [ "$(jget "$work/profile.json" "['schema']")" = "moelab.profile/1" ]; then ok "calibrate writes a profile"; else bad "calibrate"; cat "$work/cal.log"; fi
if "$moelab" run --workload "$tiny" --impl fastmoe --backend sim --cluster dgx-a100x1 --profile "$work/profile.json" \
     --out "$work/sim-prof.json" >"$work/simprof.log" 2>&1 &&
   [ "$(jget "$work/sim-prof.json" "['mode']")" = "simulated" ] &&
   [ "$(jget "$work/sim-prof.json" "['calibration']")" = "cpu-test" ]; then ok "sim run with a profile is labelled simulated + calibration"; else bad "sim with profile"; cat "$work/simprof.log"; fi

# 1b. the profile's measured sections (moelab calibrate's header comment): on cpu the GEMM
# paths are the loop alone, every section has positive figures
if "$py" - "$work/profile.json" >"$work/sections.log" 2>&1 <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))
pts = p["gemm_paths"]["points"]
assert pts and all(list(q["tflops"]) == ["loop"] and q["tflops"]["loop"] > 0 for q in pts), pts
assert {q["op"] for q in pts} == {"fwd", "dgrad", "wgrad"}
rows = sorted({q["rows"] for q in pts}); assert len(rows) >= 2, rows
assert {c["kind"] for c in p["copies"]} == {"h2d", "d2h", "d2d"} and all(c["seconds"] > 0 for c in p["copies"])
assert all(p["overheads"][k] >= 0 for k in ("launch_latency", "event_record", "sync_roundtrip", "stream_wait"))
pairs = {(i["victim"], i["aggressor"]) for i in p["interference"]}
assert pairs == {("compute", "h2d"), ("h2d", "compute"), ("compute", "d2h"), ("d2h", "compute")}, pairs
for i in p["interference"]:
    assert abs(i["factor"] - i["alone_s"] / i["together_s"]) < 1e-9 * i["factor"], i
ops = {d["op"] for d in p["dispatch"]}; assert ops == {"permute", "unpermute", "exchange"}, ops
PY
then ok "the profile has the GEMM paths, copies, overheads, interference and dispatch sections"; else bad "profile sections"; cat "$work/sections.log"; fi

# 2. a routing trace recorded on cpu, replayed by the sim on one rank: same tokens per expert
"$moelab" run --workload "$tiny" --impl fastmoe --backend cpu --record-routing "$work/trace.json" --out "$work/cpu.json" >"$work/rec.log" 2>&1
"$moelab" run --workload "$tiny" --impl fastmoe --backend sim --cluster dgx-a100x1 --ranks 1 --routing "trace:$work/trace.json" \
  --out "$work/replay.json" >"$work/replay.log" 2>&1
a=$(jget "$work/cpu.json" "['metrics']['routing']['recv_per_local_expert']" 2>/dev/null)
b=$(jget "$work/replay.json" "['metrics']['routing']['recv_per_local_expert']" 2>/dev/null)
if [ -n "$a" ] && [ "$a" = "$b" ]; then ok "recorded routing replays exactly ($a)"; else bad "routing replay: cpu $a vs sim $b"; cat "$work/rec.log" "$work/replay.log"; fi

# 3. determinism: two simulated runs, identical metrics
for i in 1 2; do
  "$moelab" run --workload "$small" --impl fastmoe --backend sim --cluster dgx-a100x2 --routing zipf:1.2 \
    --trace "$work/t$i.json" --out "$work/det$i.json" >/dev/null 2>&1
done
if [ "$(jget "$work/det1.json" "['metrics']")" = "$(jget "$work/det2.json" "['metrics']")" ] &&
   [ "$(jget "$work/t1.json" "['traceEvents']")" = "$(jget "$work/t2.json" "['traceEvents']")" ] &&
   [ "$(jget "$work/t1.json" "['otherData']['mode']")" = "simulated" ]; then ok "simulated results and traces are deterministic (traces say simulated)"; else bad "determinism"; fi
if [ "$(jget "$work/det1.json" "['world_size']")" = "16" ] && [ "$(jget "$work/det1.json" "['cluster']['name']")" = "dgx-a100x2" ]; then
  ok "result records the cluster model and 16 ranks"; else bad "cluster in result"; fi

# 4. bad input: exit 2, a message naming the thing, no result file
expect_2() {  # name, grep pattern, args...
  local name="$1" pat="$2"
  shift 2
  rm -f "$work/bad.json"
  "$moelab" run --workload "$tiny" --impl fastmoe --out "$work/bad.json" "$@" >"$work/bad.out" 2>"$work/bad.err"
  local rc=$?
  if [ $rc -eq 2 ] && grep -q -- "$pat" "$work/bad.err" && [ ! -e "$work/bad.json" ]; then ok "$name"; else bad "$name (rc $rc: $(cat "$work/bad.err"))"; fi
}
expect_2 "unknown cluster" "dgx-a100x8" --backend sim --cluster nosuch
expect_2 "sim without a cluster" "--cluster" --backend sim
echo '{"schema": "moelab.profile/1", "gemm": "x"}' >"$work/badprof.json"
expect_2 "malformed profile" "badprof.json" --backend sim --cluster dgx-a100x1 --profile "$work/badprof.json"
expect_2 "bad routing model" "zipf" --backend sim --cluster dgx-a100x1 --routing zipf:-2
# --profile: sim and cuda only; on cuda the profile must carry a GEMM-path table (checked
# before the device starts, so this holds without a GPU)
expect_2 "--profile on cpu" "not cpu" --backend cpu --profile "$work/profile.json"
"$py" -c "import json,sys; p=json.load(open(sys.argv[1])); del p['gemm_paths']; json.dump(p, open(sys.argv[2], 'w'))" \
  "$work/profile.json" "$work/nopaths.json"
expect_2 "cuda --profile without gemm_paths" "gemm_paths: missing" --backend cuda --profile "$work/nopaths.json"
expect_2 "cuda --profile malformed" "badprof.json" --backend cuda --profile "$work/badprof.json"
expect_2 "more ranks than the cluster" "--ranks" --backend sim --cluster dgx-a100x1 --ranks 9
expect_2 "cluster flags without sim" "sim" --backend cpu --cluster dgx-a100x1
# --gemm-path: cuda and sim only, a known path, and on sim a calibration with per-path data
expect_2 "--gemm-path on cpu" "not cpu" --backend cpu --gemm-path loop
expect_2 "--gemm-path unknown" "expected auto, loop, strided_batched or grouped" --backend sim --cluster h100x1 --gemm-path fast
expect_2 "--gemm-path without per-path data" "cluster dgx-a100x1 has no per-path GEMM data" --backend sim --cluster dgx-a100x1 \
  --ranks 1 --gemm-path grouped

# 4b. --gemm-path on sim: the result says which path was forced, and the forced paths price
# differently (h100x1's calibration has bf16 curves for every path)
cat >"$work/gp.json" <<'JSON'
{"name": "gp", "model": {"d_model": 256, "d_hidden": 1024, "num_experts": 8, "top_k": 2, "dtype": "bf16"},
 "tokens_per_rank": 4096, "steps": 2, "warmup": 1}
JSON
for p in loop grouped; do
  "$moelab" run --workload "$work/gp.json" --impl fastmoe --backend sim --cluster h100x1 --ranks 1 --gemm-path $p \
    --out "$work/gp-$p.json" >"$work/gp-$p.log" 2>&1 || bad "--gemm-path $p run failed: $(tail -1 "$work/gp-$p.log")"
done
"$moelab" run --workload "$work/gp.json" --impl fastmoe --backend sim --cluster h100x1 --ranks 1 \
  --out "$work/gp-auto.json" >"$work/gp-auto.log" 2>&1 || bad "auto run failed: $(tail -1 "$work/gp-auto.log")"
fl=$(jget "$work/gp-loop.json" "['metrics']['gemm_path_forced']" 2>/dev/null)
fg=$(jget "$work/gp-grouped.json" "['metrics']['gemm_path_forced']" 2>/dev/null)
fa=$(jget "$work/gp-auto.json" "['metrics'].get('gemm_path_forced')" 2>/dev/null)
el=$(jget "$work/gp-loop.json" "['metrics']['phases_s']['experts']" 2>/dev/null)
eg=$(jget "$work/gp-grouped.json" "['metrics']['phases_s']['experts']" 2>/dev/null)
if [ "$fl" = loop ] && [ "$fg" = grouped ] && [ "$fa" = None ] && [ -n "$el" ] && [ "$el" != "$eg" ]; then
  ok "--gemm-path recorded (loop, grouped, none for auto) and priced per path (experts $el s vs $eg s)"
else bad "--gemm-path: forced $fl/$fg/$fa, experts $el vs $eg"; fi

# 5. a configuration that does not fit the simulated GPU's memory: exit 3, the rank and the
# capacity named, no result file. One A100-40GB rank holding 64 experts of 8192x32768 fp32
# weights (2 x 64 x 1 GiB) cannot even hold its parameters.
cat >"$work/huge.json" <<'JSON'
{"name": "huge", "model": {"d_model": 8192, "d_hidden": 32768, "num_experts": 64, "top_k": 1, "dtype": "fp32"},
 "tokens_per_rank": 1024}
JSON
rm -f "$work/oom.json"
"$moelab" run --workload "$work/huge.json" --impl fastmoe --backend sim --cluster dgx-a100x1 --ranks 1 \
  --out "$work/oom.json" >"$work/oom.out" 2>"$work/oom.err"
rc=$?
if [ $rc -eq 3 ] && grep -q "rank 0: out of device memory" "$work/oom.err" && grep -q "A100-SXM4-40GB" "$work/oom.err" &&
   [ ! -e "$work/oom.json" ]; then ok "out of simulated device memory: exit 3, no file"; else bad "oom (rc $rc: $(cat "$work/oom.err"))"; fi

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
