#!/usr/bin/python3
"""scripts/gap_decomposition.py — what each simplification of the cluster model and of the
baselines costs at MPipeMoE's paper points: PipeMoE's speed-up over FastMoE and FasterMoE with
the simulator's models switched on one after another, then the baselines as published, then
host time swept (docs/PERFORMANCE.md, "Host time"; impls/mpipemoe/README.md, "Where the gap
goes").

    /usr/bin/python3 scripts/gap_decomposition.py [--moelab build/harness/moelab] [--jobs 2]
        [--out results/simulated/mpipemoe/gap-decomposition.json] [--points XL-2K,XL-16K,S-2K]
        [--add-to FILE] [--write-clusters DIR] [--derive FILE]

Stages, cumulative (each a cluster file written to a temporary folder from the catalogue's
dgx-a100x8 and the node file; the last model stage is the catalogue cluster itself):
  datasheet     the earlier model: datasheet GEMM curve (gemm_max 0.8, half size 128, 5 us
                launch), one interference factor 0.9, ideal all-to-all flows, no PCIe switches
  +gemm         GEMM efficiency and launch latency from the A100 calibration
  +interference the victim x aggressor matrix
  +nccl         the all-to-all as NCCL runs it (the node's p2p terms)
  +pcie         the DGX A100's PCIe switches (= the catalogue cluster)
  +published    FastMoE and FasterMoE as laekov/fastmoe v1.0.0 issues their work
  host sweep    the +published setup with host time: sync latency and issue overhead swept
                (swept parameters; no value is chosen to match the paper)
PipeMoE runs at n = 2, 4 and 8 partitions in every stage and the fastest is kept (the online
search of "partitions": "auto" picks among the same n, at several times the cost).

Writes one JSON (atomically; nothing on failure) whose numbers plots/mpipemoe_gap.py draws.
"""
import argparse
import concurrent.futures as cf
import copy
import datetime
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import moelab_results as mr  # noqa: E402

CLUSTER = "dgx-a100x8"
POINTS = {  # the paper's setup (dgx-a100x8, TF32 GEMMs); tokens per GPU = the paper's B
    "XL-2K": "MoE-GPT3-XL-tf32-T2048",
    "XL-16K": "MoE-GPT3-XL-tf32-T16384",
    "S-2K": "MoE-GPT3-S-tf32-T2048",
}
PIPE_NS = (2, 4, 8)
US = 1e-6
# Host time swept on the +published setup: (sync_latency, issue_overhead) in seconds. The
# ranges are docs/PERFORMANCE.md's ("Host time"): sync 0-50 us, issue 0-20 us.
HOST_SWEEP = [(10 * US, 0.0), (50 * US, 0.0), (0.0, 5 * US), (0.0, 20 * US), (50 * US, 20 * US)]


def load(path):
    with open(path) as f:
        return json.load(f)


def model_stages():
    """The cumulative cluster variants, as (id, label, what changed, cluster JSON or None for the catalogue)."""
    hw = os.path.join(mr.EXPERIMENTS, "hardware")
    cat = load(os.path.join(hw, "clusters", CLUSTER + ".json"))
    nodes = load(os.path.join(hw, "nodes.json"))
    nodes = nodes.get("nodes", nodes)
    node = copy.deepcopy(nodes[cat["node"]])
    node["name"] = cat["node"]
    p2p = node.pop("p2p")
    for k in ("gpus_per_pcie_switch", "pcie_bw", "pcie_switch_uplink_bw"):
        node.pop(k)
    # No curve named: the loader's defaults, the datasheet curve of docs/PERFORMANCE.md ("Time of an op").
    datasheet_eff = {"mem": cat["efficiency"]["mem"],
                     "source": "the datasheet curve (the cluster loader's defaults, docs/PERFORMANCE.md 'Time of an op')"}
    single = {"sigma": 0.9, "mu": 0.9, "eta": 0.9, "source": "the single factor of earlier versions (an assumption)"}
    base = {"schema": cat["schema"], "nodes": cat["nodes"], "fabric": cat["fabric"],
            "fabric_latency": cat["fabric_latency"], "source": "scripts/gap_decomposition.py: a stage of "
            + CLUSTER + " (" + cat["description"] + ")"}

    def variant(name, eff, interf, with_p2p):
        n = copy.deepcopy(node)
        if with_p2p:
            n["p2p"] = p2p
        return {**base, "name": CLUSTER + "-" + name, "node": n, "efficiency": eff, "interference": interf}

    return [
        ("datasheet", "datasheet model", "datasheet GEMM curve, interference 0.9, ideal all-to-all, no PCIe switches",
         variant("datasheet", datasheet_eff, single, False)),
        ("gemm", "+ GEMM calibration", "GEMM efficiency and launch latency from experiments/hardware/calibration/"
         "a100-sxm4.json", variant("gemm", cat["efficiency"], single, False)),
        ("interference", "+ interference matrix", "victim x aggressor factors (docs/PERFORMANCE.md, "
         "'Interference factors')", variant("interference", cat["efficiency"], cat["interference"], False)),
        ("nccl", "+ NCCL all-to-all", "per-protocol latency, per-peer overheads, achieved link efficiency",
         variant("nccl", cat["efficiency"], cat["interference"], True)),
        ("pcie", "+ PCIe switches", "2 GPUs and 2 NICs per PCIe switch: host copies and GPUDirect traffic share "
         "links (the catalogue cluster)", None),
    ]


def with_host(sync, issue):
    cat = load(os.path.join(mr.EXPERIMENTS, "hardware", "clusters", CLUSTER + ".json"))
    cat["name"] = f"{CLUSTER}-host-s{sync / US:g}-i{issue / US:g}"
    cat["host"] = {"sync_latency": sync, "issue_overhead": issue,
                   "source": "a point of scripts/gap_decomposition.py's host-time sweep (swept parameters, "
                             "docs/PERFORMANCE.md 'Host time')"}
    return cat


def run_one(moelab, workload, impl, options, cluster, tmp):
    out = tempfile.NamedTemporaryFile(dir=tmp, suffix=".json", delete=False).name
    cmd = [moelab, "run", "--workload", workload, "--impl", impl, "--impl-options",
           json.dumps(options, separators=(",", ":")), "--backend", "sim", "--cluster", cluster, "--out", out]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {(p.stderr or p.stdout).strip()[-600:]}")
    r = load(out)
    os.unlink(out)
    m = r["metrics"]
    return {"commit": r.get("commit"), "step_s": m["step_time_s"]["mean"], "exposed_comm_s": m.get("exposed_comm_s"),
            "comm_s": m.get("comm_s"), "compute_busy_s": m.get("compute_busy_s"),
            "host_waits": len(r.get("impl_report", {}).get("host_waits", []) or [])}


def fit_line(xs, ys):
    """Least-squares y = a + b·x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return my - b * mx, b


def break_even(stages, paper):
    """Per host term, the value at which PipeMoE's speed-up over each as-published baseline would
    reach the paper's figure, by a straight line through the sweep's points with the other term
    at 0 (the +published stage is the term's 0): baseline(x) = r·PipeMoE(x) solved for x; None
    when the lines never meet at x > 0 (the term slows PipeMoE at least r times as fast)."""
    out = {}
    pub = next(r for r in stages if r["id"] == "published")
    for term, other in (("sync_latency", "issue_overhead"), ("issue_overhead", "sync_latency")):
        pts = [(0.0, pub)] + [(r["host"][term], r) for r in stages
                              if r["host"] and r["host"][other] == 0 and r["host"][term] > 0]
        if len(pts) < 2:
            continue
        xs = [x for x, _ in pts]
        pa, pb = fit_line(xs, [r["step_s"]["PipeMoE"] for _, r in pts])
        res = {"points_s": xs}
        for base, cid in (("FastMoE", "pipemoe-speedup-vs-fastmoe-max"), ("FasterMoE", "pipemoe-speedup-vs-fastermoe-mean"),
                          ("FasterMoE", "pipemoe-speedup-vs-fastermoe-max")):
            if cid not in paper:
                continue
            r_ = paper[cid]["value"]
            ba, bb = fit_line(xs, [r["step_s"][base] for _, r in pts])
            den = bb - r_ * pb
            x = (r_ * pa - ba) / den if den > 0 else None
            res[cid] = {"baseline": base + " (as published)", "paper": r_,
                        "baseline_s_per_unit": bb, "pipemoe_s_per_unit": pb,
                        "value_s": x if x is None or x > 0 else 0.0}
        out[term] = res
    # The all-to-all instead: the factor k by which an as-published baseline's all-to-all time
    # (comm_s, the union of its intervals) would have to grow, the rest of its step unchanged
    # and none of the growth hidden, for PipeMoE at its own step to be r times faster:
    # F - c + k·c = r·P. For a baseline that hides part of its all-to-all (FasterMoE) the
    # growth is not all on its step, so the k needed is larger: this is a lower bound.
    comm = pub.get("comm_s") or {}
    res = {}
    for base, cid in (("FastMoE", "pipemoe-speedup-vs-fastmoe-max"), ("FasterMoE", "pipemoe-speedup-vs-fastermoe-mean"),
                      ("FasterMoE", "pipemoe-speedup-vs-fastermoe-max")):
        c = comm.get(base)
        if cid not in paper or not c:
            continue
        r_ = paper[cid]["value"]
        F, P = pub["step_s"][base], pub["step_s"]["PipeMoE"]
        res[cid] = {"baseline": base + " (as published)", "paper": r_, "comm_s": c,
                    "factor": max(1.0, (r_ * P - F + c) / c), "lower_bound": base != "FastMoE"}
    if res:
        out["all_to_all_factor"] = res
    return out


def merge(old, new):
    """new's points added to old's (a point of the same name replaced), in POINTS order; both must
    come from the same moelab binaries on the same cluster (ValueError otherwise)."""
    if old.get("commit") != new["commit"] or old.get("cluster") != new["cluster"]:
        raise ValueError(f"written by moelab {old.get('commit')} on {old.get('cluster')}, these runs by "
                         f"{new['commit']} on {new['cluster']}: rerun every point instead")
    names = [p["point"] for p in new["points"]]
    order = list(POINTS)
    points = [p for p in old["points"] if p["point"] not in names] + new["points"]
    points.sort(key=lambda p: order.index(p["point"]) if p["point"] in order else len(order))
    return {**new, "points": points,
            "command": "scripts/gap_decomposition.py --points " + ",".join(p["point"] for p in points)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--moelab", default=os.path.join(ROOT, "build", "harness", "moelab"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--points", default="XL-2K,XL-16K,S-2K", help="comma-separated: " + ", ".join(POINTS))
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "simulated", "mpipemoe", "gap-decomposition.json"))
    ap.add_argument("--add-to", metavar="FILE", help="merge the points run now into FILE (an earlier output of the "
                    "same moelab binary), replacing points of the same name, and write FILE")
    ap.add_argument("--write-clusters", metavar="DIR", help="write the model stages' cluster files to DIR and exit "
                    "(to rerun any point on a stage: moelab run ... --cluster DIR/<stage>.json)")
    ap.add_argument("--derive", metavar="FILE", help="recompute the derived fields (break_even) of an existing "
                    "output file in place, without running anything")
    a = ap.parse_args()
    if a.write_clusters:
        os.makedirs(a.write_clusters, exist_ok=True)
        for sid, _, _, cj in model_stages():
            if cj is not None:
                with open(os.path.join(a.write_clusters, sid + ".json"), "w") as f:
                    json.dump(cj, f, indent=1)
                print(f"wrote {os.path.join(a.write_clusters, sid + '.json')}")
        return
    if a.derive:
        d = load(a.derive)
        for pt in d["points"]:
            pt["break_even"] = break_even(pt["stages"], d["paper"])
        with open(a.derive + ".tmp", "w") as f:
            json.dump(d, f, indent=1)
            f.write("\n")
        os.replace(a.derive + ".tmp", a.derive)
        print(f"gap_decomposition.py: derived fields of {a.derive} recomputed")
        return
    if not os.access(a.moelab, os.X_OK):
        sys.exit(f"gap_decomposition.py: no moelab binary at {a.moelab}: build it or pass --moelab PATH")
    points = [p.strip() for p in a.points.split(",") if p.strip()]
    for p in points:
        if p not in POINTS:
            sys.exit(f"gap_decomposition.py: --points: unknown point {p!r} (known: {', '.join(POINTS)})")
    suite = load(os.path.join(mr.EXPERIMENTS, "mpipemoe", "suite.json"))
    paper = {c["id"]: {"value": c["paper"], "text": c["text"], "source": c["source"]}
             for c in suite["claims"]["items"] if c["system"] == "PipeMoE" and c["metric"] == "speedup"}
    wl_dir = os.path.join(ROOT, "results", "simulated", "mpipemoe", "workloads")

    with tempfile.TemporaryDirectory(prefix="moelab-gap-") as tmp:
        stages = []  # (id, label, changes, cluster path, published, host)
        for sid, label, changes, cj in model_stages():
            path = CLUSTER
            if cj is not None:
                path = os.path.join(tmp, cj["name"] + ".json")
                with open(path, "w") as f:
                    json.dump(cj, f, indent=1)
            stages.append((sid, label, changes, path, False, None))
        stages.append(("published", "+ baselines as published", "FastMoE and FasterMoE issue their work as "
                       "laekov/fastmoe v1.0.0 does (baselines/*/README.md, 'As published')", CLUSTER, True, None))
        for sync, issue in HOST_SWEEP:
            cj = with_host(sync, issue)
            path = os.path.join(tmp, cj["name"] + ".json")
            with open(path, "w") as f:
                json.dump(cj, f, indent=1)
            stages.append((f"host-s{sync / US:g}-i{issue / US:g}",
                           f"+ host: sync {sync / US:g} us, issue {issue / US:g} us",
                           "host time (swept): a synchronisation's latency and a per-operation issue overhead",
                           path, True, {"sync_latency": sync, "issue_overhead": issue}))

        jobs = {}
        for p in points:
            wl = os.path.join(wl_dir, POINTS[p] + ".json")
            if not os.path.exists(wl):
                sys.exit(f"gap_decomposition.py: no workload {wl} (run scripts/run_suite.py --suite mpipemoe first)")
            for sid, _, _, path, pub, _ in stages:
                opt = {"as_published": True} if pub else {}
                jobs[(p, sid, "FastMoE")] = (wl, "fastmoe", opt, path)
                jobs[(p, sid, "FasterMoE")] = (wl, "fastermoe", opt, path)
                for n in PIPE_NS:
                    jobs[(p, sid, f"PipeMoE-n{n}")] = (wl, "mpipemoe", {"partitions": n}, path)
        # The PipeMoE runs of +published equal +pcie's (same cluster, PipeMoE unchanged): run once.
        for p in points:
            for n in PIPE_NS:
                jobs.pop((p, "published", f"PipeMoE-n{n}"))
        print(f"gap_decomposition.py: {len(jobs)} runs on {a.jobs} jobs", flush=True)
        res = {}
        with cf.ThreadPoolExecutor(max_workers=a.jobs) as ex:
            futs = {ex.submit(run_one, a.moelab, *v, tmp): k for k, v in jobs.items()}
            for i, fut in enumerate(cf.as_completed(futs), 1):
                k = futs[fut]
                try:
                    res[k] = fut.result()
                except RuntimeError as e:
                    for f in futs:
                        f.cancel()
                    sys.exit(f"gap_decomposition.py: {k[0]} {k[1]} {k[2]}: {e}")
                print(f"[{i}/{len(jobs)}] {k[0]} {k[1]} {k[2]}: {res[k]['step_s'] * 1e3:.3f} ms", flush=True)

    out = {"schema": "moelab.gap_decomposition/1", "cluster": CLUSTER, "mode": "simulated",
           "commit": sorted({v["commit"] or "unknown" for v in res.values()}),  # the moelab binary's
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
           "command": "scripts/gap_decomposition.py --points " + ",".join(points),
           "pipemoe_partitions": list(PIPE_NS), "paper": paper, "points": []}
    for p in points:
        rows = []
        for sid, label, changes, _, pub, host in stages:
            src = "pcie" if sid == "published" else sid
            pipe = {n: res[(p, src, f"PipeMoE-n{n}")]["step_s"] for n in PIPE_NS}
            best = min(pipe, key=pipe.get)
            step = {"FastMoE": res[(p, sid, "FastMoE")]["step_s"], "FasterMoE": res[(p, sid, "FasterMoE")]["step_s"],
                    "PipeMoE": pipe[best]}
            comm = {"FastMoE": res[(p, sid, "FastMoE")]["comm_s"], "FasterMoE": res[(p, sid, "FasterMoE")]["comm_s"],
                    "PipeMoE": res[(p, src, f"PipeMoE-n{best}")]["comm_s"]}
            rows.append({"id": sid, "label": label, "changes": changes, "as_published": pub, "host": host,
                         "step_s": step, "comm_s": comm, "pipemoe_n": best, "pipemoe_step_by_n": {str(n): v for n, v in pipe.items()},
                         "speedup": {"vs_FastMoE": step["FastMoE"] / step["PipeMoE"],
                                     "vs_FasterMoE": step["FasterMoE"] / step["PipeMoE"]}})
        out["points"].append({"point": p, "workload": POINTS[p], "stages": rows,
                              "break_even": break_even(rows, paper)})
    if a.add_to:
        try:
            out = merge(load(a.add_to), out)
        except ValueError as e:
            sys.exit(f"gap_decomposition.py: --add-to {a.add_to}: {e}")
        a.out = a.add_to
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    tmp_out = a.out + ".tmp"
    with open(tmp_out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")
    os.replace(tmp_out, a.out)
    for pt in out["points"]:
        print(f"\n{pt['point']} ({pt['workload']}): PipeMoE over FastMoE / FasterMoE")
        for r in pt["stages"]:
            print(f"  {r['label']:38} {r['speedup']['vs_FastMoE']:5.2f}x  {r['speedup']['vs_FasterMoE']:5.2f}x  "
                  f"(n={r['pipemoe_n']})")
    print(f"wrote {os.path.relpath(a.out, ROOT)}")


if __name__ == "__main__":
    main()
