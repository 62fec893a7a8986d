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
table; first, the claims of every suite in one table. Then what was measured on GPUs, per
device class (RESULTS/measured/cuda/<device>/, RESULTS/validation/<device>/): moelab's layer
beside the PyTorch peer and the GEMM floor (peers/torch-moe.jsonl), the cuda runs, the MPipeMoE
runs against their simulated counterparts (mpipemoe/comparison.json, plots/mpipemoe_gpu.py)
and the simulator's validation on that GPU, each saying which device and commit measured it.
The text depends only on its inputs (no date of its own), so rerunning on the same results
changes nothing.

A suite without a summary is an error naming the file (exit code 2): run the suite first or
leave it out with --suite. Standard library only; the figures are made by plots/figures.py.
"""
import argparse
import contextlib
import glob
import json
import os
import statistics
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
                     f"{mr.calibration_words(summary.get('calibration'))} "
                     f"({summary.get('routing_model') or 'uniform'} routing)")
    return "; ".join(parts) or "nothing ran"


def claims_table(rows, with_suite):
    # Two more columns where some claim has them: ours against the baseline as its published
    # code ran, and how a memory figure counts the peak.
    pub = any(r.get("published") for r in rows)
    counts = any(r.get("counts") for r in rows)
    head = ((["suite"] if with_suite else []) + ["claim", "source", "paper", "ours", "over", "measured or simulated",
                                                 "direction agrees", "size agrees"]
            + (["against the as-published baseline"] if pub else []) + (["memory counted"] if counts else []))
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = (([r["suite"]] if with_suite else []) + [r["claim"], r["source"], r["paper"], r["ours"],
                                                         f"{r['on']}, {r['points']} points", r["mode"],
                                                         r["direction"], r["size"]]
                 + ([r.get("published") or "-"] if pub else []) + ([r.get("counts") or "-"] if counts else []))
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
                + f"; size agrees when ours is within {100 * tol:.0f}% of the paper's figure, a speed-up's gain "
                  "(speed-up - 1) within that share of the paper's gain"
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
            dev = r["device"] if r["mode"] == "measured" else mr.calibration_words(r.get('calibration'))
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
            dev = r["device"] if r["mode"] == "measured" else mr.calibration_words(r.get('calibration'))
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
        first = labels[0] if labels else "the first implementation"
        out += ["### Grid points (simulated)", "", "<details><summary>step time (ms) of every implementation, "
                f"partitions chosen, speed-ups and memory savings: {len(s['points'])} points</summary>", "",
                f"{first} comm/comp: its all-to-all time (the union of its intervals) over its compute stream's busy "
                f"time; bound: (comm + comp) / max(comm, comp), the most any overlap of the two can gain over "
                f"{first}'s serial step.", "",
                "| cluster | model | dtype | tokens per GPU | tokens per rank | " + " | ".join(labels) +
                f" | {first} comm/comp | bound | speed-up | memory saving |",
                "|---|---|---|---|---|" + "---|" * len(labels) + "---|---|---|---|"]
        for p in s["points"]:
            cells = []
            for l in labels:
                f = p["results"].get(l)
                if f is None:
                    cells.append("out of memory" if l in p.get("out_of_memory", {}) else "-")
                    continue
                cells.append(ms(f["step_time_s"]) + (f" (n={f['partitions']})" if "partitions" in f else ""))
            b = p["results"].get(first) or {}  # (none when no point has a result)
            comm, comp = b.get("comm_s"), b.get("compute_busy_s")
            if comm and comp:
                cells += [f"{comm / comp:.2f}", f"{(comm + comp) / max(comm, comp):.2f}x"]
            else:
                cells += ["-", "-"]
            sp = ", ".join(f"{k.replace('_vs_', '/')} {v:.2f}x" for k, v in p["speedup"].items())
            msv = ", ".join(f"{k.replace('_vs_', '/')} {100 * v:+.0f}%" for k, v in p["memory_saving"].items())
            out.append(f"| {p['cluster']} | {p['model']} | {p['dtype']} | {p.get('tokens_per_gpu', '')} | "
                       f"{p['tokens_per_rank']} | " + " | ".join(cells) + f" | {sp} | {msv} |")
        out += ["", "</details>", ""]
    out += gap_section(os.path.join(os.path.dirname(summary_file), "gap-decomposition.json"), report_dir)
    return out


@contextlib.contextmanager
def reading(what):
    """Files the report reads without a schema checker of their own (the gap decomposition, a GPU
    folder's comparisons and peer lines): a missing or mistyped field is a SchemaError naming
    the file or folder (exit code 2, no report written), not a traceback."""
    try:
        yield
    except (KeyError, TypeError, IndexError, ValueError, AttributeError) as e:
        raise mr.SchemaError(f"{what}: malformed ({type(e).__name__}: {e})") from None


def gap_section(path, report_dir):
    """scripts/gap_decomposition.py's stages, where a suite has them: PipeMoE's speed-up with the
    cluster model's terms added one by one, then the baselines as published, then host time."""
    if not os.path.exists(path):
        return []
    with reading(path):
        return _gap_section(mr.load_json(path), path, report_dir)


def _gap_section(g, path, report_dir):
    out = ["### Where the gap goes (simulated)", "",
           f"`scripts/gap_decomposition.py` on {g['cluster']} (moelab {', '.join(c[:12] for c in g['commit'])}, "
           f"{g['date']}; {link(path, report_dir, 'data')}): each stage adds one term to the one before; PipeMoE is "
           f"the fastest of n = {', '.join(map(str, g['pipemoe_partitions']))} partitions. Host-time stages are "
           "points of a sweep of swept parameters, not estimates. Step times in ms.", ""]
    papers = "; ".join(f"{v['text']} ({v['value']:g}x)" for v in g.get("paper", {}).values())
    if papers:
        out += [f"The paper: {papers}.", ""]
    for pt in g["points"]:
        out += [f"**{pt['workload']}**", "",
                "| stage | what changes | FastMoE | FasterMoE | PipeMoE (n) | PipeMoE / FastMoE | PipeMoE / FasterMoE |",
                "|---|---|---|---|---|---|---|"]
        for r in pt["stages"]:
            st = r["step_s"]
            out.append(f"| {r['label']} | {r['changes'].replace('|', '/')} | {ms(st['FastMoE'])} | "
                       f"{ms(st['FasterMoE'])} | {ms(st['PipeMoE'])} ({r['pipemoe_n']}) | "
                       f"{r['speedup']['vs_FastMoE']:.2f}x | {r['speedup']['vs_FasterMoE']:.2f}x |")
        out.append("")
        be = pt.get("break_even") or {}
        if be:
            out += ["What host time alone would have to cost for PipeMoE to reach the paper's figure over the "
                    "as-published baseline (a straight line through the sweep's points of one term, the other at 0):",
                    "", "| host term | paper figure | baseline | value needed | times the baseline's step pays it | "
                    "times PipeMoE's step pays it |",
                    "|---|---|---|---|---|---|"]
            names = {"sync_latency": "latency per host synchronisation",
                     "issue_overhead": "host time per issued operation"}
            for term, res in be.items():
                if term == "all_to_all_factor":
                    continue
                for cid, v in res.items():
                    if not isinstance(v, dict):
                        continue
                    need = ("never: the term slows PipeMoE at least as fast" if v["value_s"] is None
                            else f"{v['value_s'] * 1e6:.0f} µs")
                    out.append(f"| {names.get(term, term)} | {v['paper']:g}x ({cid}) | {v['baseline']} | {need} | "
                               f"{v['baseline_s_per_unit']:.1f} | {v['pipemoe_s_per_unit']:.1f} |")
            out.append("")
            for cid, v in (be.get("all_to_all_factor") or {}).items():
                out.append(f"- Or the all-to-all: {v['baseline']}'s all-to-all time ({ms(v['comm_s'])} ms) would have "
                           f"to be {v['factor']:.1f}x longer, " + ("at least (part of it is hidden), " if v["lower_bound"]
                                                                   else "none of it hidden, ")
                           + f"for the paper's {v['paper']:g}x ({cid}).")
            if be.get("all_to_all_factor"):
                out.append("")
    return out


# ---- measured on GPUs -----------------------------------------------------------------------

def read_jsonl(path):
    """The JSON objects of a .jsonl file, one a line (blank lines skipped)."""
    out = []
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    out.append(json.loads(line))
                except ValueError as e:
                    raise mr.SchemaError(f"{path}: line {i}: malformed JSON: {e}")
    return out


def cuda_results(device_dir):
    """Every measured cuda result under a device folder, by path relative to it."""
    out = {}
    for path in sorted(glob.glob(os.path.join(device_dir, "**", "*.json"), recursive=True)):
        if path.endswith(".trace.json") or os.path.basename(path) == "comparison.json":
            continue
        r = mr.load_result(path)
        if r["mode"] == "measured" and r["backend"] == "cuda":
            out[os.path.relpath(path, device_dir)] = r
    return out


def shape_of(r):
    m = r["workload"]["model"]
    return (m["d_model"], m["d_hidden"], m["num_experts"], r["workload"]["tokens_per_rank"], m["top_k"])


def joined(values):
    return ", ".join(sorted({v for v in values if v})) or "unknown"


def ratio_range(vals):
    lo, hi = min(vals), max(vals)
    return f"{lo:.2f}x" if abs(hi - lo) < 0.005 else f"{lo:.2f}x to {hi:.2f}x"


def tflops(v):
    return "-" if v is None else f"{v:.0f}"


def times(v):
    return "-" if v is None else f"{v:.2f}x"


def expected_cuda_files(experiments, device_slug):
    """Result paths (relative to the device folder) of every suite's single-rank cuda runs."""
    out = []
    for p in mr.registered_suites(experiments):
        s = mr.load_suite(p, experiments)
        for r in s.get("runs", []):
            if r["backend"] != "cuda" or "workloads" not in r:
                continue
            for w in r["workloads"]:
                for label in mr.run_labels(r):
                    for n in r["ranks"]:
                        if n == "hostfile":
                            continue
                        rel = r["path"].format(device=device_slug, workload=w, impl=label, ranks=n) + ".json"
                        prefix = f"measured/cuda/{device_slug}/"
                        if rel.startswith(prefix):
                            out.append((s["name"], r["id"], rel[len(prefix):]))
    return out


def peer_table(peers, runs, device_dir, report_dir):
    """moelab (FastMoE, bf16, one rank) beside the PyTorch peer and the GEMM floor, shape by shape."""
    moelab = {}
    for rel, r in runs.items():
        if r["impl"] == "fastmoe" and r["world_size"] == 1 and mr.dtype_label(r) == "bf16":
            moelab.setdefault(shape_of(r), (rel, r))
    out = ["| d_model / FFN / experts / tokens (top-k) | moelab FastMoE (ms) | PyTorch grouped (ms) | PyTorch loop (ms) "
           "| GEMM floor (ms) | moelab / PyTorch grouped | moelab / floor | PyTorch grouped / floor |",
           "|---|---|---|---|---|---|---|---|"]
    slower, faster, commits = [], [], set()
    f = lambda v: "-" if v is None else f"{v:.2f}"
    x = lambda a, b: "-" if a is None or not b else f"{a / b:.2f}x"
    for p in peers:
        shape = (p["M"], p["H"], p["E"], p["tokens"], p["k"])
        rel, r = moelab.get(shape, (None, None))
        m = r["metrics"]["step_time_s"]["median"] * 1e3 if r else None
        g, loop, floor = p.get("torch_grouped_mm_ms"), p.get("torch_loop_ms"), p.get("floor_ms")
        if r:
            commits.add(r["commit"])
            if g:
                (slower if m > g else faster).append(m / g)
        cell = (f"{m:.2f} ({link(os.path.join(device_dir, rel), report_dir, 'json')})" if r
                else "not run (no moelab workload of this shape)")
        out.append(f"| {p['M']} / {p['H']} / {p['E']} / {p['tokens']} ({p['k']}) | {cell} | "
                   f"{f(g) if g else p.get('torch_grouped_mm_error', '-')} | {f(loop) if loop else p.get('torch_loop_error', '-')} "
                   f"| {f(floor)} | {x(m, g)} | {x(m, floor)} | {x(g, floor)} |")
    return out, slower, faster, commits


def gpu_device_section(results, experiments, device_dir, report_dir, cuda_skipped=True):
    slug = os.path.basename(device_dir)
    runs = cuda_results(device_dir)
    vdir = os.path.join(results, "validation", slug)
    vcomp = os.path.join(vdir, "comparison.json")
    validation = mr.load_json(vcomp) if os.path.exists(vcomp) else None
    devices = {mr.device_class(r["device"]) for r in runs.values()}
    if validation:
        devices.add(mr.device_class(validation["device"]))
    commits = joined([r["commit"] for r in runs.values()] + ([validation["commit"]] if validation else []))
    dates = sorted({r["date"][:10] for r in runs.values()} | ({validation["date"][:10]} if validation else set()))
    where = f"one {joined(devices)}"
    out = [f"### {joined(devices)}", "",
           f"Measured on {where} at commit {commits} ({', '.join(dates) or 'no date'}) with `scripts/gpu.sh run` "
           "(docs/GPU.md)."
           + (" The suite sections below list cuda runs as not run: their summaries were written on a machine "
              "without a GPU." if cuda_skipped else ""), ""]

    peers_file = os.path.join(device_dir, "peers", "torch-moe.jsonl")
    if os.path.exists(peers_file):
        peers = read_jsonl(peers_file)
        table, slower, faster, mcommits = peer_table(peers, runs, device_dir, report_dir)
        torch_v = joined(p.get("torch") for p in peers)
        pcommits = {p["commit"] for p in peers if p.get("commit")}
        out += ["#### moelab against PyTorch and the GEMM floor", "",
                f"The whole MoE layer, forward + backward, bf16, every expert on the one GPU, measured on {where}: "
                f"moelab's FastMoE layer at commit {joined(mcommits)} (the cuda runs below), a plain PyTorch "
                f"{torch_v} layer with the same routing (softmax top-k, no capacity limit) using `torch._grouped_mm`, "
                "the same with a Python loop over the experts, and the GEMM floor: the experts' forward and backward "
                "FLOPs as perfectly balanced batched GEMMs (`torch.bmm`), nothing else "
                f"({link(peers_file, report_dir, 'peers/torch-moe.jsonl')}, "
                f"{link(os.path.join(device_dir, 'peers', 'README.md'), report_dir, 'how it was measured')}; "
                "`scripts/peers/torch_moe.py`" + (f", peer commit {joined(pcommits)}" if pcommits else
                                                  ", measured beside the moelab runs") + ").", ""]
        out += table + [""]
        said = []
        if slower:
            said.append(f"**moelab is slower than PyTorch's grouped layer** on {len(slower)} of "
                        f"{len(slower) + len(faster)} shapes measured by both ({ratio_range(slower)} PyTorch's time)")
        if faster:
            said.append(("faster" if slower else "moelab is faster than PyTorch's grouped layer") +
                        f" on {len(faster)}" + ("" if slower else f" of {len(faster)} shapes measured by both") +
                        f" ({ratio_range(faster)} PyTorch's time)")
        if said:
            out += ["; ".join(said) + ". The floor is what no layer can beat with these libraries on this GPU.", ""]
        if any(p.get("peer") != "torch" for p in peers):
            out += ["Lines without `\"peer\": \"torch\"` were measured before `scripts/peers/torch_moe.py`: they "
                    "accumulate weight gradients across steps, and their loop variant indexes one stacked weight tensor "
                    "per expert, whose backward produces a gradient of the whole stack for every expert (the loop "
                    "figures at 64 experts are mostly that).", ""]

    if runs:
        top = {rel: r for rel, r in runs.items() if os.sep not in rel}
        nested = sorted({os.path.dirname(rel) for rel in runs if os.sep in rel})
        out += ["#### The cuda runs", ""]
        if top:
            out += ["| result | workload | implementation | dtype | expert GEMM path | step (ms) | expert GEMMs (TFLOP/s) | "
                    "expert GEMMs / the same GEMMs alone in cuBLAS | peak memory (MiB) | commit |",
                    "|---|---|---|---|---|---|---|---|---|---|"]
            for rel, r in top.items():
                m = r["metrics"]
                # Forced (moelab run --gemm-path), chosen per call from the crossover table, or not
                # recorded: a build before the choice (every call on cublasGemmGroupedBatchedEx).
                path = (f"`{m['gemm_path_forced']}` (forced)" if m.get("gemm_path_forced") else
                        "chosen per call" if m.get("gemm_path_table") else "not recorded")
                out.append(f"| {link(os.path.join(device_dir, rel), report_dir, rel)} | {r['workload']['name']} | "
                           f"{r['impl']} | {mr.dtype_label(r)} | {path} | {ms(m['step_time_s']['median'])} | "
                           f"{tflops(m.get('expert_gemm_tflops'))} | {times(m.get('expert_vs_bare_ratio'))} | "
                           f"{mib(m['peak_memory_bytes']['device_total'])} | {r['commit']} |")
            out.append("")
            out += path_choice_lines(top)
        for d in nested:
            n = sum(1 for rel in runs if os.path.dirname(rel) == d)
            out.append(f"`{d}/`: {n} runs, in the comparison with their simulated counterparts below.")
        all_expected = expected_cuda_files(experiments, slug)
        missing = [(suite, rid, rel) for suite, rid, rel in all_expected if rel not in runs]
        out += ["" if nested else None,
                f"{len(all_expected) - len(missing)} of the {len(all_expected)} single-GPU cuda runs of the suites "
                "measured" + ("; not measured: " + ", ".join(f"{suite} `{rid}` {os.path.basename(rel)[:-5]}"
                                                             for suite, rid, rel in missing) if missing else "") + ".",
                ""]
        out = [l for l in out if l is not None]

    comp_file = os.path.join(device_dir, "mpipemoe", "comparison.json")
    if os.path.exists(comp_file):
        c = mr.load_json(comp_file)
        sr = c.get("step_ratio") or {}
        out += ["#### MPipeMoE's single-GPU runs against their simulated counterparts", "",
                f"{c['pairs']} runs measured on {where} (commit {joined(c['measured_commits'])}) beside the same runs "
                f"simulated on one GPU of the {c['cluster_model']} model ({joined(c.get('calibration') or [])} "
                f"calibration, commit {joined(c['simulated_commits'])}): step time measured / simulated median "
                + (f"{sr['median']:.2f}, range {sr['min']:.2f}-{sr['max']:.2f}" if sr else "-")
                + f" (> 1: the simulator is optimistic). {link(comp_file, report_dir, 'comparison.json')}, "
                "`plots/mpipemoe_gpu.py`.", ""]
        out += gemm_paths_agree_lines(c)
        extra = {}
        for es in c.get("restore_costs", {}).values():
            for e in es:
                rt = (e.get("extra_step_s") or {}).get("ratio")
                if rt is not None and e["impl"] == f"n4-{e['strategy']}":
                    extra.setdefault(e["strategy"], []).append(rt)
        if extra:
            out += ["What each restore strategy adds to the step at n = 4 (step - step of n4 without reuse), "
                    "measured / simulated: " + ", ".join(f"{st} {ratio_range(v)}" for st, v in sorted(extra.items()))
                    + ".", ""]
        picks = []
        for wl, e in c.get("eq10", {}).items():
            singles = sorted(x["strategy"] for x in c.get("restore_costs", {}).get(wl, [])
                             if x["impl"] in ("n4-S1", "n4-S2", "n4-S3", "n4-S4"))
            picks.append(f"{wl}: " + (f"Eq. 10 picks {e['measured_pick']}" if "measured_pick" in e
                                      else "Eq. 10's pick not measured")
                         + f", fastest measured {e.get('fastest_measured', '-')} (of {', '.join(singles) or '-'})")
        if picks:
            out += ["Restore strategies at n = 4 (Eq. 10's pick against the fastest single strategy measured): "
                    + "; ".join(picks) + ".", ""]
        out += ["<details><summary>every pair: step, peak memory, expert GEMM rate, host copy time</summary>", "",
                "| workload | impl | n | strategy | step ms measured | simulated | measured / simulated | peak GiB measured "
                "| simulated | GEMM TFLOP/s measured | simulated | expert GEMMs / cuBLAS alone | host copy ms measured "
                "| simulated |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        g = lambda v: "-" if v is None else f"{v / 2**30:.2f}"
        for r in c["rows"]:
            m = runs.get(os.path.join("mpipemoe", os.path.basename(r["files"]["measured"])))
            bare = m["metrics"].get("expert_vs_bare_ratio") if m else None
            out.append(f"| {r['workload']} | {r['impl']} | {r['partitions']} | {r['strategy']} | "
                       f"{ms(r['step_s']['measured'])} | {ms(r['step_s']['simulated'])} | "
                       f"{times(r['step_s']['ratio'])} | {g(r['peak_memory_bytes']['measured'])} | "
                       f"{g(r['peak_memory_bytes']['simulated'])} | {tflops(r['expert_gemm_tflops']['measured'])} | "
                       f"{tflops(r['expert_gemm_tflops']['simulated'])} | {times(bare)} | "
                       f"{ms(r['host_copy_s']['measured'])} | {ms(r['host_copy_s']['simulated'])} |")
        out += ["", "</details>", ""]

    if validation:
        v = validation
        # A comparison made by a fitted calibration (gemm_calibration, from the profile by
        # scripts/fit_gemm_efficiency.py --profile) says so; older ones simulated with the profile.
        fitted = v.get("gemm_calibration")
        how = (f"the GEMM calibration fitted to it ({link(os.path.join(vdir, fitted), report_dir, fitted)}) and the "
               f"interference, host copy and memory rates fitted with it" if fitted else "that profile")
        out += ["#### The simulator on this GPU", "",
                f"`scripts/validate_sim.sh --backend cuda`: this GPU calibrated into a profile "
                f"({link(os.path.join(vdir, 'profile.json'), report_dir, 'profile.json')}, calibration "
                f"`{v['calibration']}`), then {len(v['configurations'])} single-GPU layer configurations measured "
                f"on {where} at commit {v['commit']} and simulated on the {v['cluster_model']} model with "
                f"{how}: **median step-time error {100 * v['median_step_error']:.1f}%, worst "
                f"{100 * v['worst_step_error']:.1f}%** ({link(vcomp, report_dir, 'comparison.json')}).", "",
                "| configuration | measured (ms) | simulated (ms) | step error | experts error | dispatch error |",
                "|---|---|---|---|---|---|"]
        pct = lambda e: "-" if e is None else f"{100 * e:.1f}%"
        for cf in v["configurations"]:
            out.append(f"| {cf['workload']} | {ms(cf['measured_step_s'])} | {ms(cf['simulated_step_s'])} | "
                       f"{pct(cf['step_error'])} | {pct(cf['phases']['experts']['error'])} | "
                       f"{pct(cf['phases']['dispatch']['error'])} |")
        out.append("")
        out += gemm_paths_agree_lines(v)
    out += hindcast_lines(vdir, report_dir)
    return out


def gemm_paths_agree_lines(v):
    """Whether the sim priced each expert GEMM call on the path the GPU ran it on: the
    gemm_paths_agree of plots/compare_sim.py (per configuration) or plots/mpipemoe_gpu.py (per
    run); absent where a side did not count its paths."""
    a = v.get("gemm_paths_agree")
    if not a:
        return []
    differ = [" ".join(x for x in (cf["workload"], cf.get("impl"), op) if x)
              for cf in v.get("configurations", v.get("rows", []))
              for op in (cf.get("gemm_paths") or {}).get("differ", {})]
    what = "configurations" if "configurations" in v else "runs"
    return [f"Expert GEMM paths: the sim priced every call on the cuBLAS path the GPU ran it on in {a['agree']} of "
            f"{a['configurations']} {what}" + (f"; not in {', '.join(differ)}" if differ else "") + ".", ""]


def path_choice_lines(top):
    """What choosing the cuBLAS path per call gains: each run forced to one path (moelab run
    --gemm-path: the foundation suite's cuda-grouped run, `<workload>-<impl>-<path>-np<ranks>`)
    beside the run of the same name without the path (`<workload>-<impl>-np<ranks>`), which
    chose its paths, measured on the same device."""
    pairs = []
    for rel, r in top.items():
        forced = r["metrics"].get("gemm_path_forced")
        c = top.get(rel.replace(f"-{forced}-np", "-np")) if forced else None
        if c is None or c["metrics"].get("gemm_path_forced"):
            continue
        f_s, c_s = r["metrics"]["step_time_s"]["median"], c["metrics"]["step_time_s"]["median"]
        pairs.append(f"{os.path.basename(rel)[:-5]}: {ms(f_s)} ms against {ms(c_s)} ms with the paths chosen per call "
                     f"({f_s / c_s:.2f}x)")
    if not pairs:
        return []
    return ["Every expert call on one path against the paths chosen per call (step time, the same device): "
            + "; ".join(sorted(pairs)) + ".", ""]


def hindcast_lines(vdir, report_dir):
    """The same measurements simulated again by a later model (scripts/resimulate.py for the
    layer set, run_suite.py --gemm-path with plots/mpipemoe_gpu.py --out for the MPipeMoE runs):
    VDIR/hindcast-*/comparison.json, each said with the commit and model that simulated it."""
    out = []
    for path in sorted(glob.glob(os.path.join(vdir, "hindcast-*", "comparison.json"))):
        h = mr.load_json(path)
        forced = h.get("gemm_path_forced") or ", ".join(h.get("simulated_gemm_path_forced") or []) or None
        path_txt = (f", the expert GEMM calls forced to the `{forced}` path: priced on it where the calibration has its "
                    f"curve for the call's precision, as the loop elsewhere" if forced else "")
        if h.get("schema") == "moelab.sim-validation/1":
            exp = [c["phases"]["experts"]["error"] for c in h["configurations"] if c["phases"]["experts"]["error"] is not None]
            exp_txt = f"; the experts phase {100 * min(exp):.1f}-{100 * max(exp):.1f}%" if exp else ""
            out += [f"Re-simulated at commit {h.get('simulated_commit', '?')} by the catalogue's {h['cluster_model']} model "
                    f"(GEMM calibration `{h.get('gemm_calibration')}`{path_txt}; `scripts/resimulate.py`), the same "
                    f"{len(h['configurations'])} measured configurations: median step-time error "
                    f"{100 * h['median_step_error']:.1f}%, worst {100 * h['worst_step_error']:.1f}%{exp_txt} "
                    f"({link(path, report_dir, os.path.relpath(path, vdir))}).", ""]
            out += gemm_paths_agree_lines(h)
        elif h.get("schema") == "moelab.gpu-comparison/1":
            rows = h["rows"]
            same = [r["step_s"]["ratio"] for r in rows
                    if r["dtype"] == "bf16" and r["strategy"] in ("none", "S4") and r["step_s"]["ratio"]]
            err = sorted(abs(1 / x - 1) for x in same)
            sub = (f"; of them the {len(same)} bf16 runs that copy nothing to the host (no restore strategy, or S4): "
                   f"median |simulated - measured| / measured {100 * statistics.median(err):.1f}%, worst {100 * err[-1]:.1f}%"
                   if same else "")
            out += [f"The {h['pairs']} MPipeMoE runs above re-simulated at commit {', '.join(h['simulated_commits'])} by the "
                    f"catalogue's {h['cluster_model']} model{path_txt} (`run_suite.py --gemm-path`, `plots/mpipemoe_gpu.py "
                    f"--out`): measured / simulated step time median {h['step_ratio']['median']:.2f}, range "
                    f"{h['step_ratio']['min']:.2f}-{h['step_ratio']['max']:.2f}{sub} "
                    f"({link(path, report_dir, os.path.relpath(path, vdir))}).", ""]
    return out


def gpu_section(results, experiments, report_dir, summaries=()):
    """Everything measured on GPUs, one subsection per device class; nothing when there is none."""
    slugs = sorted({os.path.basename(os.path.dirname(p)) for p in glob.glob(os.path.join(results, "measured", "cuda", "*", ""))}
                   | {os.path.basename(os.path.dirname(p))
                      for p in glob.glob(os.path.join(results, "validation", "*", "comparison.json"))
                      if mr.load_json(p).get("backend") == "cuda"})
    if not slugs:
        return []
    out = ["## Measured on GPUs", "",
           "Real measurements of the cuda backend, per device class; each table names the device and the commit "
           "it measured.", ""]
    # whether a suite summary lists a cuda run as not run (written where no GPU was)
    cuda_skipped = any(r.get("backend") == "cuda" and "results" not in r
                       for _, summ, _ in summaries for r in summ.get("runs", []))
    for slug in slugs:
        with reading(f"the GPU results of {slug} (results/measured/cuda/{slug}/, results/validation/{slug}/)"):
            out += gpu_device_section(results, experiments, os.path.join(results, "measured", "cuda", slug),
                                      report_dir, cuda_skipped)
    return out


def build(suites, results, figures_dir, report_path, experiments=mr.EXPERIMENTS):
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
    gpu = gpu_section(results, experiments, report_dir, summaries)
    if gpu:
        out += ["Measured on real GPUs, beside a PyTorch peer and the simulator's prediction: "
                "[Measured on GPUs](#measured-on-gpus).", ""]
    rows = [r for _, summ, _ in summaries for r in mr.claim_rows(summ)]
    out += ["## Paper claims against ours", ""]
    if rows:
        out += claims_table(rows, True) + [""]
    else:
        out += ["No suite in this report states a paper claim.", ""]
    out += gpu
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
        text = build(suites, results, os.path.abspath(a.figures or os.path.join(results, "figures")), a.out,
                     a.experiments)
    except mr.SchemaError as e:
        print(f"report.py: {e}", file=sys.stderr)
        return 2
    mr.write_text(a.out, text)
    print(f"report.py: wrote {a.out} ({len(suites)} suite(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
