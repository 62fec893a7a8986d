#!/usr/bin/python3
"""plots/mpipemoe_memory.py — the memory model (Eq. 1-6) against the allocator, for every MPipeMoE run.

    /usr/bin/python3 plots/mpipemoe_memory.py                      # every mpipemoe result under results/
    /usr/bin/python3 plots/mpipemoe_memory.py --results DIR --tolerance 0.05

For each MPipeMoE result file (the suite's grid, strategies, schedules, timeline and
single-GPU runs; simulated and measured alike) it takes the tracked allocator's activations +
buffers at the peak (metrics.peak_memory_bytes.by_category_at_peak) and the memory model's
prediction for the same run (impl_report.memory_model.predicted_act_plus_buf_bytes: Eq. 4-5
for the run's n and strategy plus the layout terms of impls/mpipemoe/memory_model.cpp), and
prints a markdown table of measured / predicted per (mode, cluster or device, dtype, strategy):
runs, min, median, max, and how many lie outside the tolerance; then every run outside it.
Writes nothing. Exit code 0 (a report, not a check: the test MemoryModel.* in
impls/mpipemoe/mpipemoe_test.cpp is the check). Standard library only.
"""
import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import moelab_results as mr  # noqa: E402


def collect(results):
    rows = []
    for d, _, files in os.walk(results):
        if os.path.basename(d) in ("workloads", "candidate"):
            continue
        for f in sorted(files):
            if not f.endswith(".json") or f.endswith(".trace.json"):
                continue
            path = os.path.join(d, f)
            try:
                with open(path) as fh:
                    res = json.load(fh)
            except (OSError, json.JSONDecodeError):
                continue
            if not isinstance(res, dict) or res.get("impl") != "mpipemoe":
                continue
            mm = (res.get("impl_report") or {}).get("memory_model") or {}
            pred = mm.get("predicted_act_plus_buf_bytes")
            at = res["metrics"]["peak_memory_bytes"].get("by_category_at_peak", {})
            meas = at.get("activations", 0) + at.get("buffers", 0)
            if not pred:
                continue
            rep = res["impl_report"]
            where = (res.get("cluster") or {}).get("name") if res["mode"] == "simulated" else res.get("device")
            rows.append({"file": os.path.relpath(path, results), "mode": res["mode"], "where": where or "?",
                         "dtype": mr.dtype_label(res), "strategy": rep.get("last_strategy", "?"), "n": rep.get("last_n"),
                         "ranks": res.get("world_size"), "measured": meas, "predicted": pred, "ratio": meas / pred})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", default=os.path.join(ROOT, "results"))
    ap.add_argument("--tolerance", type=float, default=0.05)
    a = ap.parse_args()
    if not os.path.isdir(a.results):
        sys.exit(f"mpipemoe_memory.py: no folder {a.results}")
    rows = collect(a.results)
    if not rows:
        print(f"mpipemoe_memory.py: no MPipeMoE results with a memory-model prediction under {a.results}")
        return
    groups = {}
    for r in rows:
        groups.setdefault((r["mode"], r["where"], r["dtype"], r["strategy"]), []).append(r)
    out = [r for r in rows if abs(r["ratio"] - 1) > a.tolerance]
    print(f"Memory model against the allocator: activations + buffers at the peak, measured / predicted, "
          f"{len(rows)} MPipeMoE runs under {os.path.relpath(a.results, ROOT)}; "
          f"{len(rows) - len(out)} within {a.tolerance:.0%}\n")
    print("| mode | cluster or device | dtype | strategy | runs | min | median | max | outside |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (mode, where, dt, st), rs in sorted(groups.items()):
        v = [r["ratio"] for r in rs]
        n_out = sum(1 for x in v if abs(x - 1) > a.tolerance)
        print(f"| {mode} | {where} | {dt} | {st} | {len(rs)} | {min(v):.3f} | {statistics.median(v):.3f} | "
              f"{max(v):.3f} | {n_out} |")
    if out:
        print(f"\nOutside {a.tolerance:.0%}:\n")
        print("| file | ranks | n | strategy | measured MiB | predicted MiB | ratio |")
        print("|---|---|---|---|---|---|---|")
        for r in sorted(out, key=lambda r: -abs(r["ratio"] - 1)):
            print(f"| {r['file']} | {r['ranks']} | {r['n']} | {r['strategy']} | {r['measured'] / 2**20:.1f} | "
                  f"{r['predicted'] / 2**20:.1f} | {r['ratio']:.3f} |")


if __name__ == "__main__":
    main()
