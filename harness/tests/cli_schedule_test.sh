#!/usr/bin/env bash
# harness/tests/cli_schedule_test.sh — `moelab schedule` through the real command line: a
# group-interleaved schedule with offloading printed and written as JSON (the JSON's content
# checked: every node with its times, the peaks, the offload plan), and bad input exiting 2
# with the flag named and nothing written.
#   bash harness/tests/cli_schedule_test.sh build/harness/moelab /tmp/workdir
set -u
moelab="$1"
work="$2"
rm -rf "$work" && mkdir -p "$work"
pass=0
fail=0
ok() { pass=$((pass + 1)); echo "ok   $1"; }
bad() { fail=$((fail + 1)); echo "FAIL $1"; }
py=/usr/bin/python3

# 1. a good run: p = 4, m = 8, v = 2, g = 2, chunk 0 offloaded with free copies
if "$moelab" schedule --schedule group-interleaved --pp 4 --microbatches 8 --chunks 2 --group 2 \
     --offload-chunks 1 --no-lifespan --json "$work/gis.json" >"$work/gis.out" 2>"$work/gis.err" &&
   grep -q "^stage 0: F0.0 o0.0 F1.0 o1.0 F0.1 F1.1 F2.0 o2.0" "$work/gis.out" &&
   grep -q "makespan" "$work/gis.out"; then
  ok "group-interleaved with offload prints each stage's order and the estimate"
else
  bad "good run (rc $?)"; cat "$work/gis.out" "$work/gis.err"
fi

# 2. the JSON: every stage's nodes with kind, microbatch, chunk, start, end; F/B/W counts;
# each offload right after its F; peaks against the closed form; the plan's counts
if "$py" - "$work/gis.json" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["schema"] == "moelab.schedule/1", d["schema"]
assert (d["schedule"], d["stages"], d["microbatches"], d["chunks"], d["group"]) == ("group-interleaved", 4, 8, 2, 2)
assert d["offload_chunks"] == 1 and d["lifespan"] is False
assert len(d["per_stage"]) == 4
for s in d["per_stage"]:
    nodes = s["nodes"]
    kinds = [n["kind"] for n in nodes]
    for k in ("F", "B", "W"):
        assert kinds.count(k) == 16, (s["stage"], k, kinds.count(k))
    assert kinds.count("offload") == 8 and kinds.count("reload") == 8
    assert s["offload"] == {"planned": 8, "kept": 8, "skipped_gap": 0, "skipped_peak": 0}, s["offload"]
    assert kinds[-1] == "optimizer"
    for n in nodes:
        assert set(n) == {"kind", "microbatch", "chunk", "start", "end"}, n
        assert n["end"] >= n["start"]
    for i, n in enumerate(nodes):
        if n["kind"] == "offload":
            f = nodes[i - 1]
            assert f["kind"] == "F" and (f["microbatch"], f["chunk"]) == (n["microbatch"], n["chunk"]) and f["chunk"] == 0
    compute = [n for n in nodes if n["kind"] in ("F", "B", "W")]
    assert all(a["end"] <= b["start"] + 1e-9 for a, b in zip(compute, compute[1:]))
    # what stays (chunk 1): g(v-1-k) + min(p-s, g) = min(4-s, 2); the copies add up to 2
    stays = min(4 - s["stage"], 2)
    assert abs(s["closed_form_m_a"] * 8 - stays) < 1e-9, s["closed_form_m_a"]
    assert stays <= s["peak_resident"] <= stays + 2, s["peak_resident"]
    assert s["peak_in_flight"] == 2 + 4 - s["stage"], s["peak_in_flight"]
    assert s["peak_host"] >= 1 and s["exposed"] == 0
assert d["makespan"] > 0 and 0 < d["mean_bubble"] < 1
EOF
then ok "--json holds every node with its times, the peaks and the offload plan"; else bad "--json content"; fi

# 3. transfers with a cost (lifespan rule off): the gap rule drops the pairs too close, the
# estimate names the waits
if "$moelab" schedule --schedule 1f1b --pp 8 --microbatches 32 --offload-chunks 1 --offload-time 3.4 --reload-time 3.4 --no-lifespan \
     --json "$work/1f1b.json" >"$work/1f1b.out" 2>&1 &&
   "$py" -c "
import json, sys
d = json.load(open(sys.argv[1]))
st = d['per_stage']
assert all(s['offload']['skipped_gap'] > 0 for s in st)
assert st[-1]['offload']['kept'] == 0 and st[0]['offload']['kept'] > 0
assert st[0]['exposed'] > 0 and st[0]['d2h_busy'] > 0
" "$work/1f1b.json"; then ok "costly copies: gap rule and exposed wait"; else bad "costly copies"; cat "$work/1f1b.out"; fi

# 4. bad input: exit 2, one line naming the flag, no file written
expect_2() {  # name, pattern, args...
  local name="$1" pat="$2"
  shift 2
  rm -f "$work/bad.json"
  "$moelab" schedule --json "$work/bad.json" "$@" >"$work/bad.out" 2>"$work/bad.err"
  local rc=$?
  if [ $rc -eq 2 ] && grep -q -- "$pat" "$work/bad.err" && [ "$(wc -l <"$work/bad.err")" -eq 1 ] && [ ! -e "$work/bad.json" ]; then
    ok "$name"
  else
    bad "$name (rc $rc: $(cat "$work/bad.err"))"
  fi
}
expect_2 "group out of range" "--group = 5 must be from 2 to 4" --schedule group-interleaved --pp 4 --microbatches 8 --group 5
expect_2 "group for another schedule" "--group = 2 applies to group-interleaved" --schedule interleaved --pp 4 --microbatches 8 --group 2
expect_2 "negative offload time" "--offload-time" --schedule 1f1b --pp 4 --microbatches 8 --offload-chunks 1 --offload-time -1
expect_2 "pp not a number" "--pp" --schedule 1f1b --pp four --microbatches 8
expect_2 "unknown schedule" "did you mean \"group-interleaved\"" --schedule group-interleave --pp 4 --microbatches 8

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
