#!/usr/bin/python3
"""plots/report.py — docs/RESULTS.md from the suite summaries and the figures.

    /usr/bin/python3 plots/report.py                                  # results/ -> docs/RESULTS.md
    /usr/bin/python3 plots/report.py --results /tmp/r --out /tmp/r/RESULTS.md --suite foundation

For every suite (experiments/*/suite.json, or those named with --suite) it reads the summary
(RESULTS/<suite out>/summary.json, written by scripts/run_suite.py) and writes: the suite's
provenance (measured or simulated, backends, devices and cluster models, calibration,
commit, date, the run's subset), every figure its "figures" entries name that exists under
the figures folder (embedded with links relative to the report, each with its caption and
whether it is measured or simulated), its runs and grid points, and the claim-versus-ours
table; first, the claims of every suite in one table. The text depends only on its inputs
(no date of its own), so rerunning on the same results changes nothing.

A suite without a summary is an error naming the file (exit code 2): run the suite first or
leave it out with --suite. Standard library only; the figures are made by plots/figures.py.
"""
import argparse
import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import moelab_results as mr  # noqa: E402


def ms(v):
    return f"{v * 1e3:.3f}"


def mib(v):
    return f"{v / 2**20:.1f}"


def rel_link(path, report_dir):
    """A link target relative to the report; absolute when the report lies elsewhere."""
    r = os.path.relpath(path, report_dir)
    return os.path.abspath(path) if r.startswith("../..") else r


def link(path, report_dir, text=None):
    return f"[{text or os.path.basename(path)}]({rel_link(path, report_dir)})"


def where_of(r):
    if r.get("cluster"):
        return f"{r['cluster']} ({r.get('world_size', '?')} GPUs)"
    n = r.get("world_size") or r.get("ranks")
    return f"{n} rank{'s' if n != 1 else ''}" if n else ""


def mode_line(summary):
    """How the suite's numbers were obtained, in words."""
    parts = []
    runs = [r for r in summary.get("runs", []) if "results" in r]
    devices = sorted({f"{r['backend']} backend, {r['device']}" for r in runs if r["mode"] == "measured"})
    if devices:
        parts.append("**measured** on " + "; ".join(devices))
    clusters = sorted({p["cluster"] for p in summary["points"]} |
                      {r["cluster"] for r in runs if r["mode"] == "simulated"})
    if clusters:
        parts.append(f"**simulated** on the cluster models {', '.join(clusters)} with the "
                     f"{summary.get('calibration') or 'datasheet'} calibration "
                     f"({summary.get('routing_model') or 'uniform'} routing)")
    return "; ".join(parts) or "nothing ran"


def claims_table(rows, with_suite):
    head = (["suite"] if with_suite else []) + ["claim", "source", "paper", "ours", "over", "measured or simulated",
                                                "direction agrees", "size agrees"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = ([r["suite"]] if with_suite else []) + [r["claim"], r["source"], r["paper"], r["ours"],
                                                        f"{r['on']}, {r['points']} points", r["mode"],
                                                        r["direction"], r["size"]]
        out.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return out


def figures_of(suite, figures_dir, report_dir):
    out, missing = [], []
    for fg in suite.get("figures", []):
        files = []
        for pat in fg["files"]:
            for f in sorted(glob.glob(os.path.join(figures_dir, pat))):
                if f not in files:
                    files.append(f)
        if not files:
            missing.append(fg["id"])
            continue
        out.append(f"**{fg['id']}** ({fg['mode']}). {fg['caption']}")
        out.append("")
        for f in files:
            out.append(f"![{suite['name']} {fg['id']}: {os.path.basename(f)}]({os.path.relpath(f, report_dir)})")
            out.append("")
    if missing:
        out.append(f"Not made in this results folder: {', '.join(missing)} (plots/figures.py makes them; their "
                   "runs may not have run on this machine).")
        out.append("")
    return out


def suite_section(suite, summary, summary_file, results, figures_dir, report_dir):
    s = summary
    out = [f"## Suite `{suite['name']}`", "", suite["description"], ""]
    paper = suite.get("paper")
    out += ["| | |", "|---|---|"]
    if paper:
        out.append(f"| paper | {paper['title']} ({paper.get('venue', '')}) |")
    out += [f"| how obtained | {mode_line(s)} |",
            f"| run | {s['subset']} subset, {s.get('host_seconds', '?')} s of host time |",
            f"| commit, date | {s.get('commit') or 'unknown'}, {s['date']} |",
            f"| suite file | {link(os.path.join(ROOT, s.get('suite_file') or suite['_path']), report_dir, s.get('suite_file'))} |",
            f"| summary | {link(summary_file, report_dir, os.path.relpath(summary_file, os.path.dirname(results)))} |"]
    for sk in s.get("skipped", []):
        what = f"impl {sk['impl']}" if "impl" in sk else f"run {sk.get('run', '?')}"
        out.append(f"| skipped | {what} ({sk.get('count', sk.get('points', '?'))}): {sk['reason'].replace('|', '/')} |")
    out.append("")
    figs = figures_of(suite, figures_dir, report_dir)
    if figs:
        out += ["### Figures", ""] + figs
    rows = mr.claim_rows(s)
    if rows:
        tol = (suite.get("claims") or {}).get("size_tolerance")
        out += ["### Claims against ours", ""]
        out += claims_table(rows, False)
        on_runs = any(r["scope"] == "runs" for r in rows)
        items = (suite.get("claims") or {}).get("items", [])
        stats = "max or mean" if all(it.get("stat") in ("max", "mean") for it in items) else "max, mean or min"
        out += ["", f"Ours is the {stats} over the points the claim names, on the paper's setup when the run has it"
                + ("; a claim on runs lists the runs it used (each system run paired with the baseline's run of the "
                   "same model, layers, cluster and mode)" if on_runs else "")
                + f"; size agrees when ours is within {100 * tol:.0f}% of the paper's figure"
                + (" (or of its range)" if any(it.get("paper_range") for it in items) else "") + ". "
                    f"Source of the claims: {suite['claims'].get('source', 'see the suite file')}.", ""]
    model_runs = [r for r in s.get("runs", []) if r.get("run_mode")]
    if model_runs:
        out += ["### Whole-model runs", "",
                "| run | model file | layers | variant | training or inference | where | measured or simulated | "
                "step (ms) | overlap | all-to-all / MoE time | all-to-all hidden | exposed comm (ms) | "
                "peak memory (MiB) | result |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in model_runs:
            ov = f" with `{json.dumps(r['override'], separators=(',', ':'))}`" if r.get("override") else ""
            head = (f"| {r['id']} | {r['model_file']}{ov.replace('|', '/')} | {r.get('layers') or 'all'} | {r['label']} | "
                    f"{r['run_mode']} | {where_of(r)} |")
            if "results" not in r:
                out.append(f"{head} not run: {r['skipped'].replace('|', '/')} | | | | | | | |")
                continue
            f = r["results"]
            dev = r["device"] if r["mode"] == "measured" else f"{r.get('calibration') or 'datasheet'} calibration"
            pct = (lambda k: f"{100 * f[k]:.0f}%" if k in f else "-")
            out.append(f"{head} {r['mode']} ({dev}) | {ms(f['step_time_s'])} | {100 * f['overlap_ratio']:.0f}% | "
                       f"{pct('all_to_all_share')} | {pct('all_to_all_overlap')} | {ms(f['exposed_comm_s'])} | "
                       f"{mib(f['peak_memory_bytes'])} | {link(os.path.join(results, r['file']), report_dir, 'json')} |")
        out.append("")
    runs = [r for r in s.get("runs", []) if not r.get("run_mode")]
    if runs:
        out += ["### Runs", "",
                "| run | workload | implementation | backend | where | measured or simulated | step (ms) | "
                "overlap | exposed comm (ms) | peak memory (MiB) | result |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in runs:
            if "results" not in r:
                out.append(f"| {r['id']} | {r['workload']} | {r['impl']} | {r['backend']} | {where_of(r)} | "
                           f"not run: {r['skipped'].replace('|', '/')} | | | | | |")
                continue
            f = r["results"]
            dev = r["device"] if r["mode"] == "measured" else f"{r.get('calibration') or 'datasheet'} calibration"
            out.append(f"| {r['id']} | {r['workload']} | {r['impl']} | {r['backend']} | {where_of(r)} | "
                       f"{r['mode']} ({dev}) | {ms(f['step_time_s'])} | {100 * f['overlap_ratio']:.0f}% | "
                       f"{ms(f['exposed_comm_s'])} | {mib(f['peak_memory_bytes'])} | "
                       f"{link(os.path.join(results, r['file']), report_dir, 'json')} |")
        out.append("")
    if s["points"]:
        labels = []
        for p in s["points"]:
            for l in p["results"]:
                if l not in labels:
                    labels.append(l)
        out += ["### Grid points (simulated)", "", "<details><summary>step time (ms) of every implementation, "
                f"partitions chosen, speed-ups and memory savings: {len(s['points'])} points</summary>", "",
                "| cluster | model | dtype | tokens per GPU | tokens per rank | " + " | ".join(labels) +
                " | speed-up | memory saving |",
                "|---|---|---|---|---|" + "---|" * len(labels) + "---|---|"]
        for p in s["points"]:
            cells = []
            for l in labels:
                f = p["results"].get(l)
                if f is None:
                    cells.append("out of memory" if l in p.get("out_of_memory", {}) else "-")
                    continue
                cells.append(ms(f["step_time_s"]) + (f" (n={f['partitions']})" if "partitions" in f else ""))
            sp = ", ".join(f"{k.replace('_vs_', '/')} {v:.2f}x" for k, v in p["speedup"].items())
            msv = ", ".join(f"{k.replace('_vs_', '/')} {100 * v:+.0f}%" for k, v in p["memory_saving"].items())
            out.append(f"| {p['cluster']} | {p['model']} | {p['dtype']} | {p.get('tokens_per_gpu', '')} | "
                       f"{p['tokens_per_rank']} | " + " | ".join(cells) + f" | {sp} | {msv} |")
        out += ["", "</details>", ""]
    return out


def build(suites, results, figures_dir, report_path):
    report_dir = os.path.dirname(os.path.abspath(report_path))
    summaries = []
    for s in suites:
        path = mr.summary_path(s, results)
        if not os.path.exists(path):
            raise mr.SchemaError(f"{path}: missing: suite {s['name']} has no summary in {results} "
                                 f"(run scripts/run_suite.py --suite {s['name']}, or leave it out with --suite)")
        summaries.append((s, mr.load_summary(path), path))
    out = ["# Results", "",
           "Generated by `plots/report.py` from the suite summaries and figures in "
           f"`{os.path.relpath(results, ROOT) if not os.path.relpath(results, ROOT).startswith('..') else results}` "
           "(`scripts/reproduce.sh` runs it; do not edit by hand). Every figure and table says whether its numbers "
           "were **measured** (on which device) or **simulated** (on which cluster model, with which calibration). "
           "The file formats are described in "
           f"{link(os.path.join(ROOT, 'docs', 'RESULTS-SCHEMA.md'), report_dir, 'RESULTS-SCHEMA.md')}.", ""]
    out += ["| suite | subset | how obtained | commit | date |", "|---|---|---|---|---|"]
    for s, summ, _ in summaries:
        out.append(f"| [{s['name']}](#suite-{s['name']}) | {summ['subset']} | {mode_line(summ)} | "
                   f"{summ.get('commit') or 'unknown'} | {summ['date']} |")
    out.append("")
    rows = [r for _, summ, _ in summaries for r in mr.claim_rows(summ)]
    out += ["## Paper claims against ours", ""]
    if rows:
        out += claims_table(rows, True) + [""]
    else:
        out += ["No suite in this report states a paper claim.", ""]
    for s, summ, path in summaries:
        out += suite_section(s, summ, path, results, figures_dir, report_dir)
    return "\n".join(out).rstrip() + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--results", default=mr.RESULTS, help="the results folder (default results/)")
    ap.add_argument("--figures", help="the figures folder (default RESULTS/figures)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "RESULTS.md"), help="the report (default docs/RESULTS.md)")
    ap.add_argument("--suite", action="append", help="a suite (repeatable; default every registered suite)")
    ap.add_argument("--experiments", default=mr.EXPERIMENTS, help="the experiments folder (default experiments/)")
    a = ap.parse_args()
    results = os.path.abspath(a.results)
    try:
        suites = [mr.load_suite(s, a.experiments) for s in (a.suite or mr.registered_suites(a.experiments))]
        if not suites:
            raise mr.SchemaError(f"{a.experiments}: no suites (experiments/<name>/suite.json)")
        text = build(suites, results, os.path.abspath(a.figures or os.path.join(results, "figures")), a.out)
    except mr.SchemaError as e:
        print(f"report.py: {e}", file=sys.stderr)
        return 2
    mr.write_text(a.out, text)
    print(f"report.py: wrote {a.out} ({len(suites)} suite(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
