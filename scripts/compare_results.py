#!/usr/bin/python3
"""scripts/compare_results.py — compare a new result tree with the committed one; benchmarks too.

    /usr/bin/python3 scripts/compare_results.py results /tmp/new          # exit 1 on any difference
    /usr/bin/python3 scripts/compare_results.py results /tmp/new --complete
    /usr/bin/python3 scripts/compare_results.py --bench results/bench/cpu_blocks.json /tmp/cpu_blocks.json

Trees: every JSON file of NEW is compared with the file at the same relative path in BASE
(the committed results):

  simulated results (moelab.result/1, mode simulated): every leaf under "metrics",
    "impl_report" and "parallel" (layout, schedule, bytes per link class), the cluster's
    figures (not its source and description texts) and the identity of the run (mode,
    backend, impl, device, world size, cluster name, calibration, routing model, the workload
    without its description, a whole-model run's model without its prose and its training
    settings, the implementation's options; a "parallel", "workload", "model", "training" or
    "impl_options" block on one side only is a difference). Numbers
    agree when |new - old| <= 1e-9 * max(|old|, |new|) (--rel-tol); anything else exactly.
    Provenance (date, commit) is not compared.
  suite summaries (moelab.suite-summary/1): every figure of every point, of every simulated
    run and of every claim, matched by key (point: cluster, model, dtype, tokens per rank;
    run: what it is (id, impl, options, workload or model, backend, cluster, ranks, layers,
    label, mode, layout, override, pipeline, micro-batch, sequence parallelism, GEMM path);
    claim: id). A quick summary is compared with a
    full one on the points and runs they share; a run simulated in BASE that NEW skipped, ran
    out of device memory or failed is a difference in every subset (one NEW was told to leave
    out, run_suite.py --backends, is not).
  measured results: never a failure (they vary); the step time change is printed, for cuda
    only between results of the same device class.
  workload files and others: equal as JSON. Traces (*.trace.json) are not compared (they come
    from the same deterministic run as their result).

A file of NEW missing from BASE is a difference ("new file"); with --complete so is a result
or summary of BASE missing from NEW. Every difference is printed as file, JSON path, old,
new and the relative change; exit code 1 when there is one, 2 on a malformed file.

--bench OLD NEW prints each Google Benchmark's real time in both and the ratio. Informational:
exit code 0 whatever the times (machines are noisy), 2 only when a file cannot be read.

The library function install(BASE, NEW) is how scripts/run_suite.py merges a new run into the
results folder (see its help). Standard library only.
"""
import argparse
import json
import math
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moelab_results as mr  # noqa: E402

REL_TOL = 1e-9
SKIP_DIRS = {"candidate", "figures"}
MAX_LINES = 12  # differences printed per file


# ---- values ---------------------------------------------------------------------------------

def _num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def rel_change(old, new):
    if old == new:
        return 0.0
    if old == 0:
        return math.inf
    return (new - old) / abs(old)


# Below this, a difference is the rounding of a zero (an overlap of 3.5e-17 against 1.8e-17):
# no figure of a result (seconds >= 1e-9, bytes, ratios shown to 3 digits) is that small.
ABS_FLOOR = 1e-12


def diff_values(old, new, path, tol, out, ignore=()):
    """Appends (path, old, new) for every leaf that differs; numbers within tol (relative) or
    ABS_FLOOR (absolute) agree."""
    if _num(old) and _num(new):
        if not (old == new or abs(new - old) <= max(tol * max(abs(old), abs(new)), ABS_FLOOR)):
            out.append((path, old, new))
    elif isinstance(old, dict) and isinstance(new, dict):
        for k in sorted(set(old) | set(new), key=str):
            if k in ignore:
                continue
            p = f"{path}.{k}" if path else str(k)
            if k not in new:
                out.append((p, old[k], "(absent)"))
            elif k not in old:
                out.append((p, "(absent)", new[k]))
            else:
                diff_values(old[k], new[k], p, tol, out, ignore)
    elif isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            out.append((f"{path} (length)", len(old), len(new)))
        for i, (a, b) in enumerate(zip(old, new)):
            diff_values(a, b, f"{path}[{i}]", tol, out, ignore)
    elif old != new:
        out.append((path, old, new))
    return out


def fmt_value(v):
    if isinstance(v, float):
        return f"{v:.10g}"
    s = v if v == "(absent)" else json.dumps(v) if not isinstance(v, (int, float)) else str(v)
    return s if len(s) <= 60 else s[:57] + "..."


def fmt_diff(d):
    path, old, new = d
    ch = ""
    if _num(old) and _num(new):
        r = rel_change(old, new)
        ch = "  (new value, was 0)" if math.isinf(r) else f"  ({100 * r:+.3g}%, relative {abs(r):.3g})"
    return f"    {path}: {fmt_value(old)} -> {fmt_value(new)}{ch}"


# ---- files ----------------------------------------------------------------------------------

IDENTITY = ("schema", "mode", "backend", "impl", "device", "world_size", "calibration", "routing_model")
# Metrics recorded since a later binary (optional in the schema): a result written before them
# still compares on everything else; once both results have one, it is compared like the rest.
ADDED_METRICS = ("floor_gemm_s", "floor_gemm_library", "moe_layer_s", "expert_vs_floor_ratio", "layer_vs_floor_ratio")


def diff_results(old, new, tol):
    out = []
    for k in IDENTITY:
        if old.get(k) != new.get(k):
            out.append((k, old.get(k), new.get(k)))
    oc, nc = old.get("cluster") or {}, new.get("cluster") or {}
    if oc.get("name") != nc.get("name"):
        out.append(("cluster.name", oc.get("name"), nc.get("name")))
    elif oc and nc:  # the same cluster: its figures are the model's (their prose is not compared)
        diff_values(oc, nc, "cluster", tol, out, ignore=("source", "description"))
    # parallel: layout, schedule, bytes on each link class; model and training: a whole-model
    # run's identity (the model as built, not its prose). A block on one side only is a difference.
    for key, t, ignore in (("parallel", tol, ()), ("workload", 0.0, ("description",)),
                           ("model", 0.0, ("source", "description")), ("training", 0.0, ()),
                           ("impl_options", 0.0, ())):
        if key in old and key in new:
            diff_values(old[key], new[key], key, t, out, ignore=ignore)
        elif key in old or key in new:
            out.append((key, old.get(key, "(absent)"), new.get(key, "(absent)")))
    diff_values(old.get("impl_report"), new.get("impl_report"), "impl_report", tol, out)
    om, nm = old.get("metrics"), new.get("metrics")
    if isinstance(om, dict) and isinstance(nm, dict):
        nm = {k: v for k, v in nm.items() if k in om or k not in ADDED_METRICS}
    diff_values(om, nm, "metrics", tol, out)
    return out


def subset_rank(subset):
    """quick < full < extended (moelab_results.SUBSETS); an unknown subset ranks lowest."""
    return mr.SUBSETS.index(subset) if subset in mr.SUBSETS else -1


def _point_key(p):
    return f"{p['cluster']} {p['model']} {p['dtype']} T{p['tokens_per_rank']}"


# What names a run of a summary (run_suite.py's rows), whatever became of it: run, impl, workload
# or model, where and how it ran. A row's outcome (results, skipped, out of memory) is not in it.
RUN_IDENTITY = ("id", "impl", "options", "workload", "backend", "cluster", "ranks", "model", "model_file", "layers",
                "label", "run_mode", "parallel", "override", "pipeline", "micro_batch", "sequence_parallel",
                "gemm_path")


def run_identity(r):
    return json.dumps({k: r.get(k) for k in RUN_IDENTITY}, sort_keys=True)


def run_name(r):
    parts = [r.get("cluster") or r.get("backend"), r.get("model") or r.get("workload"), r.get("run_mode"),
             r.get("label") or r.get("impl"), r.get("id")]
    return " ".join(str(p) for p in parts if p)


def run_outcome(r):
    if r.get("mode") == "simulated":
        return "simulated"
    if r.get("out_of_memory"):
        return "out of device memory"
    if "skipped" in r:
        return "skipped: " + str(r["skipped"])
    return str(r.get("mode"))


def deselected(r):
    """A run the new run was asked to leave out (run_suite.py --backends), not one that failed to run."""
    return str(r.get("skipped", "")).startswith(f"backend {r.get('backend')} not selected")


def diff_summaries(old, new, tol):
    """Differences in the simulated figures of two summaries (measured runs are left out)."""
    out = []
    same_subset = old.get("subset") == new.get("subset")
    # The claims are judged on the points every subset but quick has (the paper's setup).
    same_claims = same_subset or "quick" not in (old.get("subset"), new.get("subset"))
    op = {_point_key(p): p for p in old["points"]}
    np_ = {_point_key(p): p for p in new["points"]}
    for k, p in np_.items():
        if k not in op:
            out.append((f"points[{k}]", "(absent)", "a point"))
            continue
        q = op[k]
        for field in ("results", "speedup", "memory_saving"):
            diff_values(q.get(field), p.get(field), f"points[{k}].{field}", tol, out, ignore=("file",))
    if same_subset:
        out += [(f"points[{k}]", "a point", "(absent)") for k in op if k not in np_]
    if "runs" in new:
        if "runs" not in old:
            if any(r.get("mode") == "simulated" for r in new["runs"]):
                out.append(("runs", "(absent)", "simulated runs"))
        else:
            # Runs matched by what they are, so that a run simulated before and skipped, out of
            # memory or failed now is a difference in every subset (a quick run against the
            # committed full summary included); measured runs are left out.
            orr = {run_identity(r): r for r in old["runs"]}
            nr = {run_identity(r): r for r in new["runs"]}
            for k, r in nr.items():
                o = orr.get(k)
                name = f"runs[{run_name(r)}]"
                if r.get("mode") == "simulated":
                    if o is None or o.get("mode") != "simulated":
                        out.append((name, "(absent)" if o is None else run_outcome(o), "a simulated run"))
                        continue
                    if o.get("file") != r.get("file"):
                        out.append((f"{name}.file", o.get("file"), r.get("file")))
                    diff_values(o["results"], r["results"], f"{name}.results", tol, out)
                elif o is not None and o.get("mode") == "simulated" and not deselected(r):
                    out.append((name, "simulated", run_outcome(r)))
            if same_subset:
                out += [(f"runs[{run_name(r)}]", "a run", "(absent)") for k, r in orr.items()
                        if k not in nr and r.get("mode") == "simulated"]
    if same_claims:
        # Across subsets (full against extended) only what is judged on the paper's setup is
        # comparable: a claim's figure over all points covers different points.
        ignore = () if same_subset else ("all_points",)
        oc = {c["id"]: c for c in old["claims"]}
        for c in new["claims"]:
            if c["id"] not in oc:
                out.append((f"claims[{c['id']}]", "(absent)", "a claim"))
                continue
            o = oc[c["id"]]
            for field in ("system", "versus", "metric", "text", "source", "paper", "ours", "direction_agrees",
                          "size_agrees", "verdict"):
                diff_values(o.get(field), c.get(field), f"claims[{c['id']}].{field}", tol, out, ignore)
        # a claim the suite no longer makes (every subset but quick judges every claim)
        nc = {c["id"] for c in new["claims"]}
        out += [(f"claims[{k}]", "a claim", "(absent)") for k in oc if k not in nc]
    return out


def measured_note(old, new):
    """One informational line comparing two measured results, or why they are not compared."""
    if old.get("backend") != new.get("backend"):
        return f"not compared: backend {old.get('backend')} vs {new.get('backend')}"
    if new.get("backend") == "cuda" and mr.device_class(old.get("device")) != mr.device_class(new.get("device")):
        return (f"not compared: different device class ({mr.device_class(old.get('device'))} vs "
                f"{mr.device_class(new.get('device'))})")
    a, b = old["metrics"]["step_time_s"]["median"], new["metrics"]["step_time_s"]["median"]
    return f"step {a * 1e3:.3f} ms -> {b * 1e3:.3f} ms ({100 * rel_change(a, b):+.1f}%; measured, informational)"


def judge(base_file, new_file, tol):
    """(status, lines, parsed new) with status: equal, differ, new, measured, trace."""
    if new_file.endswith(".trace.json"):
        return "trace", [], None
    new = mr.load_json(new_file)
    kind = mr.classify(new)
    if kind == "result":
        mr.check_result(new, new_file)
    elif kind == "summary":
        mr.check_summary(new, new_file)
    if kind == "bench" or (kind == "result" and new["mode"] == "measured"):
        if not os.path.exists(base_file):
            return "measured", ["    new (no file to compare with)"], new
        old = mr.load_json(base_file)
        if kind == "result":
            return "measured", ["    " + measured_note(mr.check_result(old, base_file), new)], new
        return "measured", [], new
    if not os.path.exists(base_file):
        return "new", [], new
    old = mr.load_json(base_file)
    if kind == "result":
        diffs = diff_results(mr.check_result(old, base_file), new, tol)
    elif kind == "summary":
        diffs = diff_summaries(mr.check_summary(old, base_file), new, tol)
    elif kind == "trace":
        return "trace", [], new
    else:
        diffs = diff_values(old, new, "", 0.0, [])
    if not diffs:
        return "equal", [], new
    lines = [fmt_diff(d) for d in diffs[:MAX_LINES]]
    if len(diffs) > MAX_LINES:
        lines.append(f"    ... and {len(diffs) - MAX_LINES} more")
    return "differ", lines, new


def json_files(tree):
    for folder, dirs, files in os.walk(tree):
        if folder == tree:
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".json"):
                yield os.path.relpath(os.path.join(folder, f), tree)


def compare_trees(base, new, tol=REL_TOL, complete=False, log=print):
    """Prints every difference of NEW against BASE; returns the number of differing files."""
    counts = {"equal": 0, "differ": 0, "new": 0, "measured": 0, "trace": 0, "missing": 0}
    for rel in json_files(new):
        status, lines, _ = judge(os.path.join(base, rel), os.path.join(new, rel), tol)
        counts[status] += 1
        if status == "differ":
            log(f"DIFFERS {rel}")
        elif status == "new":
            log(f"NEW     {rel} (not in {base})")
        elif status == "measured":
            log(f"MEASURED {rel}:{lines[0][3:] if lines else ''}")
            continue
        for line in lines:
            log(line)
    if complete:
        for rel in json_files(base):
            if rel.endswith(".trace.json") or os.path.exists(os.path.join(new, rel)):
                continue
            if mr.classify(mr.load_json(os.path.join(base, rel))) in ("result", "summary"):
                counts["missing"] += 1
                log(f"MISSING {rel} (in {base}, not produced by the new run)")
    log(f"compare_results.py: {counts['equal']} equal, {counts['differ']} differ, {counts['new']} new, "
        f"{counts['missing']} missing; {counts['measured']} measured (informational), {counts['trace']} traces "
        f"not compared; relative tolerance {tol:g}")
    return counts["differ"] + counts["new"] + counts["missing"]


# ---- merging a new run into the results folder ----------------------------------------------

def summary_files(summary):
    """The result files a summary names: each run's and each point's."""
    out = {r["file"] for r in summary.get("runs", []) if r.get("file")}
    for p in summary.get("points", []):
        out |= {v["file"] for v in (p.get("results") or {}).values() if isinstance(v, dict) and v.get("file")}
    return out


def summary_runs_changed(old, new):
    """Whether two summaries list other runs (by identity, skipped ones included) or other skips."""
    ids = lambda summ: sorted(run_identity(r) for r in summ.get("runs", []))
    return ids(old) != ids(new) or old.get("skipped") != new.get("skipped")


def install(base, stage, accept=False, tol=REL_TOL, log=print):
    """Merges the candidate tree STAGE into BASE (see scripts/run_suite.py): measured files are
    written; simulated ones when new, or when they differ and accept is set and no committed
    summary that lists them is left describing the old ones (below); equal ones are dropped;
    differing ones not written stay in STAGE ("kept"). Returns counts; prints each difference."""
    counts = {"written": 0, "unchanged": 0, "differ": 0, "new": 0, "kept": 0, "refused": [], "stale": {}}
    if not os.path.isdir(stage):
        return counts
    decided = {}  # result rel path -> "write", "drop" or "keep"
    # With accept, a differing simulated result is written only where every committed summary
    # listing it (a run's or a point's file) is rewritten by this install too, or stays
    # consistent with it: otherwise that summary's runs, points and claims would describe results
    # no longer in the folder. A summary is not rewritten by a partial run (run_suite.py --run
    # stages none) nor by a smaller subset's (quick < full < extended); where the smaller one
    # differs from it on what they share, its suite's results are kept aside (counts["refused"]),
    # the other suites' are accepted. protected: result rel path -> the summary that keeps it.
    protected = {}
    if accept:
        consistent = set()
        for rel in json_files(stage):
            if not rel.endswith("summary.json"):
                continue
            new = mr.load_json(os.path.join(stage, rel))
            if mr.classify(new) != "summary":
                continue
            if not os.path.exists(os.path.join(base, rel)):
                consistent.add(rel)
                continue
            old = mr.load_json(os.path.join(base, rel))
            if (subset_rank(old.get("subset")) > subset_rank(new.get("subset"))
                    and diff_summaries(mr.check_summary(old, os.path.join(base, rel)),
                                       mr.check_summary(new, os.path.join(stage, rel)), tol)):
                counts["refused"].append((rel, new.get("subset"), old.get("subset")))
                for f in summary_files(new):
                    protected[f] = rel
            else:
                consistent.add(rel)
        for rel in json_files(base):
            if rel.endswith("summary.json") and rel not in consistent:
                old = mr.load_json(os.path.join(base, rel))
                if mr.classify(old) == "summary":
                    for f in summary_files(old):
                        protected.setdefault(f, rel)
        for rel, small, large in counts["refused"]:
            log(f"REFUSED --update-baseline: {rel} ({small} run) differs from the committed {large} summary, "
                f"which it cannot replace; that suite's results are kept aside (rerun its {large} subset)")

    def put(rel):
        mr.copy_atomic(os.path.join(stage, rel), os.path.join(base, rel))
        os.unlink(os.path.join(stage, rel))

    traces = []
    for rel in json_files(stage):
        if rel.endswith(".trace.json"):
            traces.append(rel)
            continue
        status, lines, new = judge(os.path.join(base, rel), os.path.join(stage, rel), tol)
        kind = mr.classify(new)
        if kind == "summary" and os.path.exists(os.path.join(base, rel)):
            old = mr.load_json(os.path.join(base, rel))
            if subset_rank(old.get("subset")) > subset_rank(new["subset"]):
                if status == "differ":
                    counts["differ"] += 1
                    counts["kept"] += 1
                    log(f"DIFFERS {rel} ({new['subset']} run; the {old['subset']} summary is left as it is)")
                    for line in lines:
                        log(line)
                else:
                    os.unlink(os.path.join(stage, rel))
                    counts["unchanged"] += 1
                continue
            if new["mode"] in ("measured", "mixed") and status == "equal":
                status = "measured"  # its measured figures are new: write it
            elif accept and status == "equal" and summary_runs_changed(old, new):
                # Its simulated figures equal, but the suite lists other runs now (one added that
                # this machine skips, say): with --update-baseline the summary follows the suite.
                log(f"UPDATED {rel} (the same figures; the suite's list of runs changed)")
                put(rel)
                counts["written"] += 1
                decided[rel] = "write"
                continue
        if status == "measured":
            put(rel)
            counts["written"] += 1
            decided[rel] = "write"
        elif status == "new":
            put(rel)
            counts["new"] += 1
            decided[rel] = "write"
        elif status == "equal":
            os.unlink(os.path.join(stage, rel))
            counts["unchanged"] += 1
            decided[rel] = "drop"
        else:
            counts["differ"] += 1
            keeper = protected.get(rel) if kind == "result" else None
            take = accept and keeper is None
            log(f"DIFFERS {rel}" + (" (written: --update-baseline)" if take else
                                    f" (not written: {keeper}, which lists it, is not rewritten by this run)"
                                    if accept and keeper else ""))
            for line in lines:
                log(line)
            if take:
                put(rel)
                decided[rel] = "write"
            else:
                decided[rel] = "keep"
                counts["kept"] += 1
                if keeper:
                    counts["stale"].setdefault(keeper, []).append(rel)
    for rel in traces:
        d = decided.get(rel[:-len(".trace.json")] + ".json")
        if d == "keep":
            continue  # stays beside its result in the candidate
        if d == "write" or not os.path.exists(os.path.join(base, rel)):
            put(rel)
        else:
            os.unlink(os.path.join(stage, rel))
    for folder, _, _ in sorted(os.walk(stage), key=lambda x: -len(x[0])):
        try:
            os.rmdir(folder)
        except OSError:
            pass
    log(f"install: {counts['written']} measured file(s) written, {counts['new']} new, "
        f"{counts['unchanged']} simulated file(s) unchanged, {counts['differ']} differ"
        + (f" ({counts['kept']} kept under {stage})" if counts["kept"] else ""))
    return counts


# ---- benchmarks -----------------------------------------------------------------------------

def compare_bench(old_path, new_path, log=print):
    old, new = mr.load_json(old_path), mr.load_json(new_path)
    for p, b in ((old_path, old), (new_path, new)):
        if mr.classify(b) != "bench":
            raise mr.SchemaError(f'{p}: not Google Benchmark JSON (expected "context" and "benchmarks")')

    def times(b):
        return {x["name"]: (x["real_time"], x.get("time_unit", "ns")) for x in b["benchmarks"]
                if x.get("run_type", "iteration") == "iteration"}
    ot, nt = times(old), times(new)
    log(f"benchmarks: {new_path} against {old_path} (informational: real time, new / old)")
    log(f"  {'benchmark':58} {'old':>12} {'new':>12} {'new/old':>8}")
    for name, (t, unit) in nt.items():
        if name in ot:
            o, ou = ot[name]
            scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
            ratio = (t * scale[unit]) / (o * scale[ou]) if o else math.inf
            log(f"  {name[:58]:58} {o:10.4g}{ou:>2} {t:10.4g}{unit:>2} {ratio:8.2f}")
        else:
            log(f"  {name[:58]:58} {'-':>12} {t:10.4g}{unit:>2} {'new':>8}")
    for name in ot:
        if name not in nt:
            log(f"  {name[:58]:58} (not in the new run)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("base", help="the committed tree (or, with --bench, the committed benchmark JSON)")
    ap.add_argument("new", help="the new tree (or benchmark JSON)")
    ap.add_argument("--rel-tol", type=float, default=REL_TOL)
    ap.add_argument("--complete", action="store_true", help="also fail on results of BASE missing from NEW")
    ap.add_argument("--bench", action="store_true", help="compare two Google Benchmark JSON files (informational)")
    a = ap.parse_args()
    try:
        if a.bench:
            compare_bench(a.base, a.new)
            return 0
        for t in (a.base, a.new):
            if not os.path.isdir(t):
                raise mr.SchemaError(f"{t}: no such folder")
        return 1 if compare_trees(a.base, a.new, a.rel_tol, a.complete) else 0
    except mr.SchemaError as e:
        print(f"compare_results.py: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
