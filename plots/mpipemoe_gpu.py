#!/usr/bin/python3
"""plots/mpipemoe_gpu.py — MPipeMoE measured on one GPU against the sim's prediction of the same runs.

    /usr/bin/python3 plots/mpipemoe_gpu.py                                  # results/ against results/
    /usr/bin/python3 plots/mpipemoe_gpu.py --results $OUT/results --simulated results   # as scripts/gpu.sh run

Pairs every measured result of the mpipemoe suite's "gpu" run,
RESULTS/measured/cuda/<device>/mpipemoe/<workload>-<impl>.json, with its simulated counterpart
of the "gpu-sim" run for the same device class, SIMULATED/simulated/<cluster>/mpipemoe/<same
name>.json (H100 SXM -> h100x1, H200 SXM -> h200x1; --cluster to name another), and writes
RESULTS/measured/cuda/<device>/mpipemoe/comparison.json ("moelab.gpu-comparison/1") with, per
implementation:

  - step time measured vs simulated and their ratio (measured / simulated: > 1, the sim is optimistic);
  - peak device memory (the tracked allocator's, as every backend counts it) measured vs
    simulated, activations + buffers at the peak beside the memory model's prediction
    (impl_report.memory_model, Eq. 1-6 with this layout's adjustments) and the paper's figure;
  - expert GEMM TFLOP/s (metrics.expert_gemm_tflops) measured vs simulated, and per workload the
    GEMM efficiency at every partition count n (FastMoE and n = 1, 2, 4, 8, 16, no reuse);
  - the cost of each restore strategy: step(n4-Sx) - step(n4), and host_copy_s, measured vs
    simulated; Eq. 10's pick ("n4-auto") against the fastest strategy on each side.

It prints the same as markdown tables. With no measured results it says so, writes nothing and
exits 0. Standard library only.
"""
import argparse
import glob
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import moelab_results as mr  # noqa: E402

SCHEMA = "moelab.gpu-comparison/1"
# Device class slug -> the catalogue's node model whose datasheet peaks are that part's (the
# same rule as scripts/validate_sim.sh): the SXM parts only. An H100 PCIe or NVL, or an H200
# NVL, has other clocks and power limits, so its runs are compared only with --cluster named.
CLUSTERS = (("nvidia-h200", "h200x1"), ("nvidia-h100-80gb-hbm3", "h100x1"))
GiB = 2.0 ** 30


def cluster_for(device_slug):
    for key, cluster in CLUSTERS:
        if device_slug == key or (device_slug.startswith(key + "-") and "nvl" not in device_slug.split("-")):
            return cluster
    return None


def ratio(a, b):
    return a / b if a is not None and b else None


def partitions(res):
    rep = res.get("impl_report") or {}
    n = rep.get("last_n", rep.get("partitions"))
    return n if isinstance(n, int) else 1


def strategy(res):
    rep = res.get("impl_report") or {}
    return rep.get("last_strategy", rep.get("strategy", "none"))


def impl_key(label):
    """FastMoE, n1 < n2 < ... (no reuse), then the n4 strategies, "auto" last."""
    if label == "FastMoE":
        return (0, 0, 0, "")
    head, _, rest = label.partition("-")
    n = int(head[1:]) if head[:1] == "n" and head[1:].isdigit() else 10 ** 6
    return (1 if not rest else 2, n, 2 if rest == "auto" else 1 if "-" in rest else 0, rest)


def act_buf(res):
    at = res["metrics"]["peak_memory_bytes"].get("by_category_at_peak", {})
    return at.get("activations", 0) + at.get("buffers", 0)


def peak_tflops(sim, dtype):
    """The simulated GPU's datasheet peak for the dtype (TFLOP/s), or None."""
    gpu = (((sim.get("cluster") or {}).get("node") or {}).get("gpu") or {})
    v = gpu.get({"tf32": "flops_tf32", "bf16": "flops_bf16", "fp32": "flops_fp32"}.get(dtype, ""))
    return v / 1e12 if v else None


def pair_row(label, m, s, results, simulated, m_path, s_path):
    mm, sm = m["metrics"], s["metrics"]
    mem = (m.get("impl_report") or {}).get("memory_model") or {}
    row = {
        "workload": m["workload"]["name"], "impl": label, "impl_name": m["impl"], "dtype": mr.dtype_label(m),
        "partitions": partitions(m), "strategy": strategy(m), "simulated_strategy": strategy(s),
        "step_s": {"measured": mm["step_time_s"]["median"], "simulated": sm["step_time_s"]["median"]},
        "peak_memory_bytes": {"measured": mm["peak_memory_bytes"]["device_total"],
                              "simulated": sm["peak_memory_bytes"]["device_total"]},
        "act_buf_at_peak_bytes": {"measured": act_buf(m), "simulated": act_buf(s),
                                  "model_predicted": mem.get("predicted_act_plus_buf_bytes"),
                                  "paper": mem.get("paper_act_plus_buf_bytes")},
        "host_pinned_bytes": mm["peak_memory_bytes"].get("peak_per_category", {}).get("host_pinned", 0),
        # The CUDA pool's own high-water marks (cuda results from 2026-11 on; None before).
        "device_pool_bytes": {k: (mm["peak_memory_bytes"].get("device_pool") or {}).get(k)
                              for k in ("used_high", "reserved_high")},
        "expert_gemm_tflops": {"measured": mm.get("expert_gemm_tflops"), "simulated": sm.get("expert_gemm_tflops")},
        "host_copy_s": {"measured": mm.get("host_copy_s", 0.0), "simulated": sm.get("host_copy_s", 0.0)},
        "files": {"measured": os.path.relpath(m_path, results), "simulated": os.path.relpath(s_path, simulated)},
    }
    for k in ("step_s", "peak_memory_bytes", "expert_gemm_tflops"):
        row[k]["ratio"] = ratio(row[k]["measured"], row[k]["simulated"])
    paths = mr.gemm_path_agreement(m, s)  # did the sim price each expert call on the GPU's path?
    if paths is not None:
        row["gemm_paths"] = paths
    return row


def analyse(rows, sims):
    """Per workload: GEMM efficiency by n, the restore strategies' cost, Eq. 10's pick."""
    by_wl = {}
    for r in rows:
        by_wl.setdefault(r["workload"], {})[r["impl"]] = r
    gemm, restore, eq10 = {}, {}, {}
    for wl, rs in by_wl.items():
        dtype = next(iter(rs.values()))["dtype"]
        sim = sims[wl]
        peak = peak_tflops(sim, dtype)
        tokens = sim["workload"]["tokens_per_rank"] * sim["workload"]["model"]["top_k"]
        experts = sim["workload"]["model"]["num_experts"]
        gemm[wl] = []
        for label in sorted(rs, key=impl_key):
            r = rs[label]
            if r["strategy"] not in ("none", None) or r["expert_gemm_tflops"]["measured"] is None:
                continue
            g = r["expert_gemm_tflops"]
            gemm[wl].append({"impl": label, "partitions": r["partitions"],
                             "rows_per_expert_gemm": tokens / (experts * r["partitions"]),
                             "measured_tflops": g["measured"], "simulated_tflops": g["simulated"],
                             "ratio": g["ratio"], "datasheet_peak_tflops": peak,
                             "measured_fraction_of_peak": ratio(g["measured"], peak),
                             "simulated_fraction_of_peak": ratio(g["simulated"], peak)})
        base = rs.get("n4")
        restore[wl] = []
        for label in sorted(rs, key=impl_key):
            if not label.startswith("n4-"):
                continue
            r = rs[label]
            entry = {"impl": label, "strategy": r["strategy"], "simulated_strategy": r["simulated_strategy"],
                     "step_s": r["step_s"], "host_copy_s": r["host_copy_s"],
                     "peak_memory_bytes": r["peak_memory_bytes"]}
            if base:
                m = r["step_s"]["measured"] - base["step_s"]["measured"]
                s = r["step_s"]["simulated"] - base["step_s"]["simulated"]
                entry["extra_step_s"] = {"measured": m, "simulated": s, "ratio": ratio(m, s)}
                entry["memory_saved_bytes"] = {k: base["peak_memory_bytes"][k] - r["peak_memory_bytes"][k]
                                               for k in ("measured", "simulated")}
            restore[wl].append(entry)
        singles = {l: r for l, r in rs.items() if l in ("n4-S1", "n4-S2", "n4-S3", "n4-S4")}
        if "n4-auto" in rs or singles:
            e = {}
            if "n4-auto" in rs:
                e["measured_pick"] = rs["n4-auto"]["strategy"]
                e["simulated_pick"] = rs["n4-auto"]["simulated_strategy"]
            if singles:
                e["fastest_measured"] = min(singles, key=lambda l: singles[l]["step_s"]["measured"])[3:]
                e["fastest_simulated"] = min(singles, key=lambda l: singles[l]["step_s"]["simulated"])[3:]
            eq10[wl] = e
    return gemm, restore, eq10


def compare_device(results, simulated, mdir, cluster_override):
    device_slug = os.path.basename(os.path.dirname(mdir))
    cluster = cluster_override or cluster_for(device_slug)
    files = sorted(p for p in glob.glob(os.path.join(mdir, "*.json"))
                   if not p.endswith(".trace.json") and os.path.basename(p) != "comparison.json")
    if not cluster:
        print(f"mpipemoe_gpu.py: {device_slug}: no simulated counterpart for this device class "
              f"(known: {', '.join(f'{k} -> {c}' for k, c in CLUSTERS)}; --cluster NAME to choose one); skipped")
        return None
    rows, missing, sims, device, m_commits, s_commits, dates, calib = [], [], {}, None, set(), set(), [], set()
    forced = set()  # the simulated runs' --gemm-path (None: the table chose)
    for m_path in files:
        m = mr.load_result(m_path)
        if m["mode"] != "measured" or m["backend"] != "cuda":
            raise mr.SchemaError(f"{m_path}: expected a measured cuda result, got {m['mode']} {m['backend']}")
        name = os.path.splitext(os.path.basename(m_path))[0]
        wl = m["workload"]["name"]
        if not name.startswith(wl + "-"):
            raise mr.SchemaError(f"{m_path}: the file name does not start with its workload \"{wl}\"")
        label = name[len(wl) + 1:]
        s_path = os.path.join(simulated, "simulated", cluster, "mpipemoe", name + ".json")
        if not os.path.exists(s_path):
            missing.append(os.path.relpath(s_path, simulated))
            continue
        s = mr.load_result(s_path)
        if s["mode"] != "simulated":
            raise mr.SchemaError(f"{s_path}: expected a simulated result, got {s['mode']}")
        device = device or m["device"]
        m_commits.add(m["commit"])
        s_commits.add(s["commit"])
        calib.add(s.get("calibration"))
        forced.add(s["metrics"].get("gemm_path_forced"))
        dates.append(m["date"])
        sims.setdefault(wl, s)
        rows.append(pair_row(label, m, s, results, simulated, m_path, s_path))
    rows.sort(key=lambda r: (r["workload"], impl_key(r["impl"])))
    gemm, restore, eq10 = analyse(rows, sims)
    step_ratios = [r["step_s"]["ratio"] for r in rows if r["step_s"]["ratio"] is not None]
    tally = mr.gemm_path_tally(rows)
    return {
        "schema": SCHEMA,
        "mode": "comparison of measured and simulated",
        "device": device, "device_class": device_slug, "cluster_model": cluster,
        "calibration": sorted(c for c in calib if c) or None,
        "measured_commits": sorted(m_commits), "simulated_commits": sorted(s_commits),
        **({"simulated_gemm_path_forced": sorted(f or "auto" for f in forced)} if forced - {None} else {}),
        "measured_date": max(dates) if dates else None,
        "definitions": {
            "ratio": "measured / simulated (> 1: the simulator is optimistic)",
            "peak_memory_bytes": "the tracked allocator's peak (weights, gradients, activations, buffers), counted "
                                 "the same way on every backend; CUDA's context, cuBLAS workspaces and pool "
                                 "fragmentation are not in it",
            "device_pool_bytes": "measured only: the CUDA stream-ordered pool's high-water marks over the timed "
                                 "steps, used_high (bytes in use, workspaces included) and reserved_high (bytes "
                                 "held from the driver, fragmentation included)",
            "act_buf_at_peak_bytes": "activations + buffers at the peak; model_predicted: the memory model's "
                                     "prediction (impl_report.memory_model.predicted_act_plus_buf_bytes), paper: "
                                     "Eq. 4-5 as the paper states it",
            "extra_step_s": "step(n4 with the strategy) - step(n4 without reuse): the cost of restoring",
        },
        "pairs": len(rows),
        "step_ratio": ({"median": statistics.median(step_ratios), "min": min(step_ratios), "max": max(step_ratios)}
                       if step_ratios else None),
        "missing_simulated": missing,
        **({"gemm_paths_agree": tally} if tally else {}),
        "rows": rows,
        "gemm_efficiency": gemm,
        "restore_costs": restore,
        "eq10": eq10,
    }


def ms(v):
    return "-" if v is None else f"{v * 1e3:.2f}"


def gib(v):
    return "-" if v is None else f"{v / GiB:.2f}"


def x(v):
    return "-" if v is None else f"{v:.2f}"


def tf(v):
    return "-" if v is None else f"{v:.0f}"


def print_tables(c):
    print(f"\n### {c['device']} (measured) vs {c['cluster_model']} (simulated, "
          f"{', '.join(c['calibration'] or ['?'])} calibration)\n")
    print("| workload | impl | n | strategy | step ms measured | simulated | meas/sim | peak GiB measured | simulated "
          "| CUDA pool GiB used / held | act+buf GiB measured | model | GEMM TFLOP/s measured | simulated "
          "| host copy ms measured | simulated |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in c["rows"]:
        st = r["strategy"] + ("" if r["simulated_strategy"] == r["strategy"] else f" (sim: {r['simulated_strategy']})")
        print(f"| {r['workload']} | {r['impl']} | {r['partitions']} | {st} | {ms(r['step_s']['measured'])} | "
              f"{ms(r['step_s']['simulated'])} | {x(r['step_s']['ratio'])} | "
              f"{gib(r['peak_memory_bytes']['measured'])} | {gib(r['peak_memory_bytes']['simulated'])} | "
              f"{gib(r['device_pool_bytes']['used_high'])} / {gib(r['device_pool_bytes']['reserved_high'])} | "
              f"{gib(r['act_buf_at_peak_bytes']['measured'])} | {gib(r['act_buf_at_peak_bytes']['model_predicted'])} | "
              f"{tf(r['expert_gemm_tflops']['measured'])} | {tf(r['expert_gemm_tflops']['simulated'])} | "
              f"{ms(r['host_copy_s']['measured'])} | {ms(r['host_copy_s']['simulated'])} |")
    print("\nGEMM efficiency per partition size (expert GEMMs' TFLOP/s; fraction of the datasheet peak):\n")
    print("| workload | impl | n | rows per expert GEMM | measured | simulated | meas/sim | measured / peak |")
    print("|---|---|---|---|---|---|---|---|")
    for wl, gs in c["gemm_efficiency"].items():
        for g in gs:
            frac = g["measured_fraction_of_peak"]
            print(f"| {wl} | {g['impl']} | {g['partitions']} | {g['rows_per_expert_gemm']:.0f} | "
                  f"{tf(g['measured_tflops'])} | {tf(g['simulated_tflops'])} | {x(g['ratio'])} | "
                  f"{'-' if frac is None else f'{100 * frac:.0f}%'} |")
    print("\nCost of each restore strategy at n = 4 (step - step of n4 without reuse):\n")
    print("| workload | impl | strategy | extra ms measured | simulated | meas/sim | host copy ms measured | simulated "
          "| memory saved GiB measured | simulated |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for wl, es in c["restore_costs"].items():
        for e in es:
            ex = e.get("extra_step_s", {})
            sv = e.get("memory_saved_bytes", {})
            print(f"| {wl} | {e['impl']} | {e['strategy']} | {ms(ex.get('measured'))} | {ms(ex.get('simulated'))} | "
                  f"{x(ex.get('ratio'))} | {ms(e['host_copy_s']['measured'])} | {ms(e['host_copy_s']['simulated'])} | "
                  f"{gib(sv.get('measured'))} | {gib(sv.get('simulated'))} |")
    if c["eq10"]:
        print("\nEq. 10 (n4-auto) against the fastest single-buffer strategy:\n")
        print("| workload | pick measured | pick simulated | fastest measured | fastest simulated |")
        print("|---|---|---|---|---|")
        for wl, e in c["eq10"].items():
            print(f"| {wl} | {e.get('measured_pick', '-')} | {e.get('simulated_pick', '-')} | "
                  f"{e.get('fastest_measured', '-')} | {e.get('fastest_simulated', '-')} |")
    r = c["step_ratio"]
    print(f"\n{c['pairs']} pairs; step time measured / simulated: "
          + (f"median {r['median']:.2f}, range {r['min']:.2f}-{r['max']:.2f}" if r else "-"))
    for p in c["missing_simulated"]:
        print(f"no simulated counterpart: {p} (scripts/run_suite.py --suite mpipemoe --run gpu-sim)")
    if c.get("gemm_paths_agree"):
        a = c["gemm_paths_agree"]
        print(f"expert GEMM paths: the sim priced every call on the measured path in {a['agree']} of "
              f"{a['configurations']} runs")
        for r in c["rows"]:
            for op, d in (r.get("gemm_paths") or {}).get("differ", {}).items():
                print(f"  {r['workload']} {r['impl']}: {op} measured {d['measured']}, simulated {d['simulated']}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--results", default=os.path.join(ROOT, "results"),
                    help="the results folder with measured/cuda/<device>/mpipemoe/ (default results/)")
    ap.add_argument("--simulated", help="the results folder with simulated/<cluster>/mpipemoe/ (default: --results)")
    ap.add_argument("--cluster", help="the cluster model to compare with (default: from the device class)")
    ap.add_argument("--no-write", action="store_true", help="print the tables only")
    ap.add_argument("--out", metavar="FILE",
                    help="write the comparison here instead of beside the measured results (one device's results only; "
                         "e.g. a re-simulation with run_suite.py --gemm-path)")
    a = ap.parse_args(argv)
    results = os.path.abspath(a.results)
    simulated = os.path.abspath(a.simulated or a.results)
    dirs = sorted(d for d in glob.glob(os.path.join(results, "measured", "cuda", "*", "mpipemoe"))
                  if any(not p.endswith(".trace.json") and os.path.basename(p) != "comparison.json"
                         for p in glob.glob(os.path.join(d, "*.json"))))
    if not dirs:
        print(f"mpipemoe_gpu.py: no measured MPipeMoE GPU results under {results}/measured/cuda/*/mpipemoe/: "
              f"nothing to compare, nothing written (they come from the mpipemoe suite's \"gpu\" run on a GPU: "
              f"scripts/gpu.sh run, docs/GPU.md)")
        return 0
    if a.out and len(dirs) > 1:
        print(f"mpipemoe_gpu.py: --out names one file, but {len(dirs)} devices have results under {results}", file=sys.stderr)
        return 2
    try:
        for d in dirs:
            c = compare_device(results, simulated, d, a.cluster)
            if c is None:
                continue
            print_tables(c)
            if not a.no_write:
                out = os.path.abspath(a.out) if a.out else os.path.join(d, "comparison.json")
                mr.write_json(out, c)
                print(f"\nwritten: {out}")
    except mr.SchemaError as e:
        print(f"mpipemoe_gpu.py: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
