#!/usr/bin/python3
"""scripts/run_suite.py — run an experiment suite (experiments/<paper>/suite.json) on the sim backend.

    /usr/bin/python3 scripts/run_suite.py                      # the MPipeMoE suite, every point
    /usr/bin/python3 scripts/run_suite.py --quick              # its reduced subset (about a minute)
    /usr/bin/python3 scripts/run_suite.py --suite FILE --out DIR --moelab build/harness/moelab
    /usr/bin/python3 scripts/run_suite.py --list               # the points, without running them

For every point (sweep x cluster x model x dtype x tokens per GPU) and every implementation of
the suite it writes the workload file (DIR/workloads/), runs

    moelab run --backend sim --cluster C --workload W --impl I --impl-options O --steps 1 --out F

and keeps the result at DIR/<cluster>/<model>-<dtype>-T<tokens per rank>-<label>.json. Then it
writes DIR/summary.json: per point the step time, peak memory, overlap ratio and chosen number
of partitions of every implementation, the speed-ups and memory savings of the paper's systems
against the baselines, and the table of the paper's claims against ours.

An implementation entry with "requires_option": K is probed first (a one-rank run of a tiny
layer with the entry's options); if the installed moelab rejects option K, every point of that
entry is skipped and listed, with the entry's "skip_note", on stdout and in summary.json.
Nothing is skipped silently. A failing moelab run stops the suite with its exit code and the
end of its output. Standard library only.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def die(msg, code=1):
    print(f"run_suite.py: {msg}", file=sys.stderr)
    sys.exit(code)


def write_json(path, obj):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.chmod(tmp, 0o644)  # mkstemp creates 0600
    os.replace(tmp, path)


def rel(path):
    p = os.path.relpath(path, ROOT)
    return path if p.startswith("..") else p


def fmt_s(s):
    s = int(round(s))
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


# ---- the suite ------------------------------------------------------------------------------

def load_suite(path):
    try:
        with open(path) as f:
            suite = json.load(f)
    except OSError as e:
        die(f"cannot read the suite {path}: {e.strerror}", 2)
    except json.JSONDecodeError as e:
        die(f"{path}: malformed JSON: {e}", 2)
    for key in ("name", "models", "impls", "sweeps", "clusters", "workload_defaults"):
        if key not in suite:
            die(f"{path}: missing field \"{key}\"", 2)
    labels = [i["label"] for i in suite["impls"]]
    if len(set(labels)) != len(labels):
        die(f"{path}: impls: labels must be unique, got {labels}", 2)
    return suite


def points_of(suite, quick):
    """Every (sweep, cluster, model, dtype, tokens per GPU) of the run, in order."""
    models = {m["name"]: m for m in suite["models"]}
    clusters = {c["name"]: c for c in suite["clusters"]}
    sweeps = [suite["quick"]] if quick else suite["sweeps"]
    as_gpus = suite.get("global_tokens_as_gpus")
    pts = []
    for sw in sweeps:
        for cname in sw["clusters"]:
            if cname not in clusters:
                die(f"sweep {sw['name']}: cluster {cname} is not in the suite's \"clusters\"", 2)
            gpus = clusters[cname]["gpus"]
            for mname in sw["models"]:
                if mname not in models:
                    die(f"sweep {sw['name']}: model {mname} is not in the suite's \"models\"", 2)
                for dtype in sw["dtypes"]:
                    for b in sw["tokens_per_gpu"]:
                        tpr = b * as_gpus // gpus if as_gpus else b
                        if as_gpus and (b * as_gpus) % gpus:
                            die(f"sweep {sw['name']}: {b} * {as_gpus} tokens do not split over {gpus} GPUs", 2)
                        pts.append({"sweep": sw["name"], "cluster": cname, "gpus": gpus, "model": mname,
                                    "dtype": dtype, "tokens_per_gpu": b, "tokens_per_rank": tpr,
                                    "global_tokens": tpr * gpus})
    return pts, models


def workload_for(suite, model, dtype, tokens_per_rank):
    d = suite["workload_defaults"]
    name = f"{model['name']}-{dtype}-T{tokens_per_rank}"
    return name, {
        "name": name,
        "description": (f"{suite['name']} suite: {model['name']} (d_model {model['d_model']}, d_hidden "
                        f"{model['d_hidden']}), {d['num_experts']} experts, top-{d['top_k']}, "
                        + ("no capacity limit" if not d["capacity_factor"] else f"capacity factor {d['capacity_factor']}")
                        + f", {dtype}, {tokens_per_rank} tokens per rank. Written by scripts/run_suite.py "
                        f"from experiments/{suite['name']}/suite.json."),
        "model": {"name": model["name"], "d_model": model["d_model"], "d_hidden": model["d_hidden"],
                  "num_experts": d["num_experts"], "top_k": d["top_k"], "capacity_factor": d["capacity_factor"],
                  "activation": d["activation"], "dtype": dtype},
        "tokens_per_rank": tokens_per_rank,
        "steps": d["steps"],
        "warmup": d["warmup"],
        "seed": d["seed"],
        "expert_parallel": d["expert_parallel"],
    }


# ---- running moelab -------------------------------------------------------------------------

def run_moelab(moelab, args):
    try:
        p = subprocess.run([moelab, "run"] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    except OSError as e:
        die(f"cannot start {moelab}: {e.strerror}")
    return p


def fail_run(cmd, p, what):
    tail = "\n".join((p.stdout.strip().splitlines() + p.stderr.strip().splitlines())[-15:])
    die(f"moelab failed on {what} (exit code {p.returncode}):\n  {' '.join(cmd)}\n{tail}", p.returncode or 1)


def probe(moelab, impl, tmpdir, cluster):
    """Does the installed moelab accept impl's options? A one-rank run of a tiny layer."""
    wl = os.path.join(tmpdir, "probe.json")
    write_json(wl, {"name": "probe", "model": {"d_model": 16, "d_hidden": 64, "num_experts": 8, "top_k": 1,
                                                "capacity_factor": 0, "dtype": "fp32"},
                    "tokens_per_rank": 256, "steps": 1, "warmup": 1, "seed": 1})
    args = ["--workload", wl, "--impl", impl["impl"], "--impl-options", json.dumps(impl["options"]),
            "--backend", "sim", "--cluster", cluster, "--ranks", "1", "--out", os.path.join(tmpdir, "probe-out.json")]
    p = run_moelab(moelab, args)
    if p.returncode == 0:
        return True, ""
    msg = (p.stderr.strip() or p.stdout.strip()).splitlines()
    msg = msg[-1] if msg else ""
    key = impl["requires_option"]
    if p.returncode == 2 and f'"{key}"' in msg:
        return False, msg
    fail_run([moelab, "run"] + args, p, f"the probe of {impl['label']}")


# ---- the summary ----------------------------------------------------------------------------

def figures(res):
    m = res["metrics"]
    rep = res.get("impl_report") or {}
    n = rep.get("last_n", rep.get("partitions"))
    out = {"step_time_s": m["step_time_s"]["median"],
           "peak_memory_bytes": m["peak_memory_bytes"]["device_total"],
           "overlap_ratio": m["overlap_ratio"],
           "comm_s": m["comm_s"],
           "compute_busy_s": m["compute_busy_s"],
           "exposed_comm_s": m["exposed_comm_s"],
           "overlap_limit_s": m["overlap_limit_s"],
           "phases_s": m["phases_s"]}
    if n is not None:
        out["partitions"] = n
    strategy = rep.get("last_strategy", rep.get("strategy"))  # the one used when "auto"
    if strategy is not None:
        out["strategy"] = strategy
    return out


def comparisons(results, systems, baselines):
    sp, ms = {}, {}
    for s in systems:
        for b in baselines:
            if s in results and b in results:
                sp[f"{s}_vs_{b}"] = results[b]["step_time_s"] / results[s]["step_time_s"]
                ms[f"{s}_vs_{b}"] = 1.0 - results[s]["peak_memory_bytes"] / results[b]["peak_memory_bytes"]
    return sp, ms


def claims_table(suite, points):
    c = suite.get("claims")
    if not c:
        return []
    tol = c.get("size_tolerance", 0.25)
    paper_cluster = suite["clusters"][0]["name"]
    rows = []
    for item in c["items"]:
        key = f"{item['system']}_vs_{item['versus']}"
        field = "speedup" if item["metric"] == "speedup" else "memory_saving"
        row = dict(item)
        row["ours"] = {}
        for scope, keep in (("paper_setup", lambda p: p["cluster"] == paper_cluster and p["dtype"] == "fp32"),
                            ("all_points", lambda p: True)):
            vals = [p[field][key] for p in points if keep(p) and key in p[field]]
            if not vals:
                row["ours"][scope] = {"points": 0}
                continue
            v = max(vals) if item["stat"] == "max" else sum(vals) / len(vals)
            row["ours"][scope] = {"points": len(vals), "value": v, "max": max(vals),
                                  "mean": sum(vals) / len(vals), "min": min(vals)}
        best = row["ours"]["paper_setup"] if row["ours"]["paper_setup"]["points"] else row["ours"]["all_points"]
        row["compared_on"] = "paper_setup" if row["ours"]["paper_setup"]["points"] else "all_points"
        if not best["points"]:
            row["direction_agrees"] = None
            row["size_agrees"] = None
            row["verdict"] = f"not run ({item['system']} has no result in this run)"
        else:
            v = best["value"]
            up = v > 1.0 if field == "speedup" else v > 0.0
            row["direction_agrees"] = up
            row["size_agrees"] = abs(v - item["paper"]) <= tol * item["paper"]
            ratio = v / item["paper"]
            row["verdict"] = ("agrees in direction and size" if row["size_agrees"] and up else
                              f"agrees in direction, ours is {ratio:.2f}x the paper's figure" if up else
                              "disagrees in direction")
        rows.append(row)
    return rows


def print_claims(rows):
    if not rows:
        return
    print("\nclaims (paper vs ours; ours on the paper's setup, dgx-a100x8 fp32, when run, else on every point):")
    print(f"  {'claim':60} {'paper':>7} {'ours':>7} {'pts':>4}  verdict")
    for r in rows:
        o = r["ours"][r["compared_on"]]
        fmtv = (lambda v: f"{v:.2f}x") if r["metric"] == "speedup" else (lambda v: f"{100 * v:.0f}%")
        ours = fmtv(o["value"]) if o["points"] else "-"
        print(f"  {r['text'][:60]:60} {fmtv(r['paper']):>7} {ours:>7} {o['points']:>4}  {r['verdict']}")


# ---- main -----------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default=os.path.join(ROOT, "experiments", "mpipemoe", "suite.json"))
    ap.add_argument("--quick", action="store_true", help="the suite's reduced subset (its \"quick\" sweep)")
    ap.add_argument("--out", help="output folder (default results/simulated/<suite name>)")
    ap.add_argument("--moelab", default=os.environ.get("MOELAB", os.path.join(ROOT, "build", "harness", "moelab")),
                    help="the moelab binary (default $MOELAB, else build/harness/moelab)")
    ap.add_argument("--list", action="store_true", help="print the points and exit")
    a = ap.parse_args()

    suite = load_suite(a.suite)
    out = os.path.abspath(a.out or os.path.join(ROOT, "results", "simulated", suite["name"]))
    pts, models = points_of(suite, a.quick)
    impls = suite["impls"]
    subset = "quick" if a.quick else "full"
    if a.list:
        for p in pts:
            print(f"{p['sweep']:14} {p['cluster']:11} {p['model']:12} {p['dtype']:5} B={p['tokens_per_gpu']:<6} "
                  f"tokens/rank={p['tokens_per_rank']}")
        print(f"{len(pts)} points x {len(impls)} implementations")
        return
    if not (os.path.isfile(a.moelab) and os.access(a.moelab, os.X_OK)):
        die(f"no moelab binary at {a.moelab}: build it (cmake --build build --target moelab) or pass --moelab PATH", 2)

    # Probe the entries that need an option the binary may not have.
    skip = {}
    with tempfile.TemporaryDirectory(prefix="run_suite.") as tmp:
        for impl in impls:
            if impl.get("requires_option"):
                ok, msg = probe(a.moelab, impl, tmp, pts[0]["cluster"])
                if not ok:
                    skip[impl["label"]] = f"{impl.get('skip_note', 'skipped')} (moelab said: {msg})"
    for label, why in skip.items():
        print(f"[{suite['name']}] {label}: {why}")

    jobs, skipped = [], []
    for p in pts:
        for impl in impls:
            (skipped if impl["label"] in skip else jobs).append((p, impl))
    total = len(jobs)
    print(f"[{suite['name']} {subset}] {len(pts)} points x {len(impls)} implementations: {total} runs, "
          f"{len(skipped)} skipped; moelab {a.moelab}; results under {rel(out)}")

    wl_dir = os.path.join(out, "workloads")
    start = time.time()
    cost = {}  # (cluster, impl label) -> host seconds of the runs so far
    results = {}
    for i, (p, impl) in enumerate(jobs):
        wname, wl = workload_for(suite, models[p["model"]], p["dtype"], p["tokens_per_rank"])
        wl_path = os.path.join(wl_dir, wname + ".json")
        if not os.path.exists(wl_path) or json.load(open(wl_path)) != wl:
            write_json(wl_path, wl)
        dest = os.path.join(out, p["cluster"], f"{wname}-{impl['label']}.json")
        args = ["--workload", wl_path, "--impl", impl["impl"], "--backend", "sim", "--cluster", p["cluster"],
                "--steps", str(suite["workload_defaults"]["steps"]), "--out", dest]
        if impl["options"]:
            args[4:4] = ["--impl-options", json.dumps(impl["options"], separators=(",", ":"))]
        t0 = time.time()
        proc = run_moelab(a.moelab, args)
        dt = time.time() - t0
        if proc.returncode != 0:
            fail_run([a.moelab, "run"] + args, proc,
                     f"{p['cluster']} {wname} {impl['label']} (run {i + 1} of {total})")
        cost.setdefault((p["cluster"], impl["label"]), []).append(dt)
        with open(dest) as f:
            res = json.load(f)
        fig = figures(res)
        fig["file"] = rel(dest)
        results.setdefault(id(p), {})[impl["label"]] = fig
        p.setdefault("_meta", {"commit": res.get("commit"), "calibration": res.get("calibration"),
                               "routing_model": res.get("routing_model"), "date": res.get("date")})
        # time left: the mean host time of each (cluster, impl) so far, else of all runs
        elapsed = time.time() - start
        mean_all = elapsed / (i + 1)
        left = 0.0
        for q, im in jobs[i + 1:]:
            c = cost.get((q["cluster"], im["label"]))
            left += sum(c) / len(c) if c else mean_all
        n = f", n={fig['partitions']}" if "partitions" in fig and impl["impl"] == "mpipemoe" else ""
        print(f"[{suite['name']} {subset} {i + 1}/{total}] {p['cluster']} {wname} {impl['label']}: "
              f"step {fig['step_time_s'] * 1e3:.2f} ms, peak {fig['peak_memory_bytes'] / 2**30:.2f} GiB{n} "
              f"({dt:.1f} s) | elapsed {fmt_s(elapsed)}, about {fmt_s(left)} left", flush=True)

    # ---- summary.json
    systems = [i["label"] for i in impls if i["impl"] == "mpipemoe"]
    baselines = [i["label"] for i in impls if i["impl"] != "mpipemoe"]
    rows, meta = [], {}
    for p in pts:
        r = results.get(id(p), {})
        meta = p.pop("_meta", meta)
        sp, ms = comparisons(r, systems, baselines)
        rows.append({**p, "results": r, "speedup": sp, "memory_saving": ms,
                     "skipped": [im["label"] for im in impls if im["label"] in skip]})
    claims = claims_table(suite, rows)
    summary = {
        "schema": "moelab.suite-summary/1",
        "suite": suite["name"],
        "suite_file": rel(os.path.abspath(a.suite)),
        "subset": subset,
        "mode": "simulated",
        "backend": "sim",
        "calibration": meta.get("calibration"),
        "routing_model": meta.get("routing_model"),
        "commit": meta.get("commit"),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "host_seconds": round(time.time() - start, 1),
        "definitions": {
            "speedup": "step time of the baseline / step time of the system (one forward + backward of the MoE layer, slowest rank)",
            "memory_saving": "1 - peak device memory of the system / that of the baseline (the highest rank's peak over the timed step as the tracked allocator counts it: weights, gradients, activations and buffers; no optimizer states, which the paper's M_ms includes for Adam)",
            "partitions": "n used in the timed step (impl_report.last_n); chosen by the online granularity search for \"partitions\": \"auto\"",
            "overlap_ratio": "communication hidden behind computation / all communication, summed over ranks",
        },
        "dtype_notes": suite.get("dtypes"),
        "tokens_rule": suite.get("tokens_rule"),
        "skipped": [{"impl": label, "reason": why,
                     "points": sum(1 for q, im in skipped if im["label"] == label)} for label, why in skip.items()],
        "points": rows,
        "claims": claims,
    }
    sum_path = os.path.join(out, "summary.json")
    write_json(sum_path, summary)

    # ---- the table on stdout
    print(f"\n{'cluster':11} {'model':12} {'dtype':5} {'B':>6}  " +
          "  ".join(f"{l:>9}" for l in [i['label'] for i in impls if i['label'] not in skip]) +
          "   ms/step; speed-up and memory saving vs FastMoE / FasterMoE")
    for r in rows:
        ts = "  ".join(f"{r['results'][l]['step_time_s'] * 1e3:9.2f}" if l in r["results"] else f"{'-':>9}"
                       for l in [i["label"] for i in impls if i["label"] not in skip])
        ext = "; ".join(f"{k.replace('_vs_', '/')} {v:.2f}x {100 * r['memory_saving'][k]:+.0f}%"
                        for k, v in r["speedup"].items())
        print(f"{r['cluster']:11} {r['model']:12} {r['dtype']:5} {r['tokens_per_gpu']:>6}  {ts}   {ext}")
    print_claims(claims)
    if skipped:
        print(f"\nskipped {len(skipped)} runs: " + "; ".join(f"{l} ({s['points']} points)" for l, s in
                                                            ((s['impl'], s) for s in summary['skipped'])))
    print(f"\nsummary: {rel(sum_path)} ({total} runs in {fmt_s(time.time() - start)})")


if __name__ == "__main__":
    main()
