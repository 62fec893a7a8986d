#!/usr/bin/python3
"""plots/pipeoffload.py — the PipeOffload suite's figures: schedule pictures, peak activation
memory against the number of stages, and throughput against peak memory.

    /usr/bin/python3 plots/pipeoffload.py schedules --schedules A.json B.json ... --out pipeoffload-schedules.png
    /usr/bin/python3 plots/pipeoffload.py memory   --summary results/simulated/pipeoffload/summary.json --out pipeoffload-memory-vs-p.png
    /usr/bin/python3 plots/pipeoffload.py tradeoff --summary results/simulated/pipeoffload/summary.json --out pipeoffload-throughput-vs-memory.png

schedules: `moelab schedule --json` files (impls/pipeoffload/schedule-p4-*.json, written by the
commands in impls/pipeoffload/README.md): one row per stage, each F/B/W node at its estimated
start and end (unit costs), coloured by kind and shaded by chunk, labelled with its microbatch;
offload and reload nodes on a thin lane under their stage (PipeOffload's copy stream).
memory: every pipelined run without offload or recomputation, the highest stage's peak
activation bytes (the simulated allocator) against p, a line per schedule; dashed beside it the
closed form (docs/pipeline-memory.md, the result's expected_peak_activation_ma of that stage)
times M_a, with M_a = the saved bytes of one microbatch through every layer = the offload
runs' saved_bytes_per_layer x (3p - 2) (the same model and p on the same cluster; the embedding
and the head are left out). The offload and recomputation runs are drawn as markers only.
tradeoff: every run at p = 8 and p = 16 (the TP runs at 8 GPUs): tokens per second against the
highest rank's peak device memory, one panel per cluster and p.
Every figure is titled simulated, with the cluster models, the calibration and the commit.
Needs matplotlib (Debian: apt-get install python3-matplotlib).
"""
import argparse
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import moelab_results as mr  # noqa: E402

CLUSTERS = {"dgx-a100-80gbx4": "32 x A100-80GB", "h100x4": "32 x H100-80GB"}
LINES = {"1f1b": "#7f7f7f", "interleaved": "#1f77b4", "zb-h1": "#2ca02c", "gi-half": "#ff7f0e", "gi-full": "#d62728"}
MARKS = {"gi-half-off1": ("#ff7f0e", "v"), "gi-half-offall": ("#ff7f0e", "X"), "gi-full-off1": ("#d62728", "v"),
         "gi-full-offall": ("#d62728", "X"), "interleaved-rc-sel": ("#1f77b4", "s"),
         "interleaved-rc-full": ("#1f77b4", "D"), "tp8": ("#000000", "*"), "tp4-pp2": ("#555555", "P"),
         "tp2-pp4": ("#999999", "p")}
KINDS = {"F": "#4c72b0", "B": "#dd8452", "W": "#55a868", "offload": "#8172b3", "reload": "#c44e52"}


def fail(msg):
    print(f"pipeoffload.py: {msg}", file=sys.stderr)
    sys.exit(2)


def load(path):
    if not os.path.exists(path):
        fail(f"{path}: no such file (run scripts/run_suite.py --suite pipeoffload first)")
    try:
        return mr.load_summary(path)
    except mr.SchemaError as e:
        fail(str(e))


def done(summary):
    return [r for r in summary.get("runs", []) if r.get("run_mode") and "results" in r]


def p_of(model):
    m = re.search(r"-p(\d+)$", model)
    return int(m.group(1)) if m else None


def title(summary, what):
    return (f"{what}\nsimulated: {', '.join(f'{k} ({v})' for k, v in CLUSTERS.items())}, "
            f"{mr.calibration_words(summary.get('calibration'))}, commit {summary.get('commit') or 'unknown'}")


def figure_schedules(paths, plt):
    docs = []
    for p in paths:
        try:
            docs.append(mr.load_json(p))
        except (OSError, ValueError) as e:
            fail(f"{p}: {e}")
    fig, axes = plt.subplots(len(docs), 1, figsize=(13, 2.3 * len(docs) + 0.6), squeeze=False)
    for ax, d in zip(axes[:, 0], docs):
        stages = d["per_stage"]
        v = d.get("chunks") or 1
        for s, st in enumerate(stages):
            y = s * 1.5
            for n in st["nodes"]:
                k = n["kind"]
                if k not in KINDS or n["end"] <= n["start"]:
                    continue
                copy = k in ("offload", "reload")
                h, y0 = (0.3, y + 0.75) if copy else (0.7, y)
                alpha = 1.0 - 0.5 * (n.get("chunk", 0) / max(v - 1, 1)) if v > 1 else 1.0
                ax.broken_barh([(n["start"], n["end"] - n["start"])], (y0, h), facecolors=KINDS[k], alpha=alpha,
                               edgecolor="white", linewidth=0.4)
                if not copy:
                    ax.text((n["start"] + n["end"]) / 2, y0 + h / 2, str(n["microbatch"]), ha="center",
                            va="center", fontsize=6, color="white")
        ax.set_yticks([s * 1.5 + 0.35 for s in range(len(stages))])
        ax.set_yticklabels([f"stage {s}" for s in range(len(stages))])
        ax.invert_yaxis()
        name = d["schedule"] + (f", v = {v}" if v > 1 else "") + (f", g = {d['group']}" if d.get("group") else "") + \
            (f", offload chunks < {d['offload_chunks']}" if d.get("offload_chunks") else "")
        ax.set_title(f"{name}: makespan {d['makespan']:g} (F = B = W = 1), mean bubble {d['mean_bubble']:.2f}",
                     fontsize=9)
        ax.set_xlim(0, d["makespan"])
    axes[-1, 0].set_xlabel("estimated time (unit costs; moelab schedule)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in KINDS.values()]
    fig.legend(handles, ["F", "B (input gradient)", "W (weight gradient)", "offload (D2H)", "reload (H2D)"],
               loc="lower center", ncol=5, fontsize=8)
    # Not a run: the schedule's own timing estimate (moelab schedule --json), at the commit that
    # last wrote the files drawn.
    try:
        commit = subprocess.run(["git", "-C", ROOT, "log", "-1", "--format=%h", "--", *paths], capture_output=True,
                                text=True, check=True).stdout.strip() or "uncommitted"
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    fig.suptitle("Pipeline schedules at p = 4, 8 microbatches (darker: earlier chunk; numbers: microbatch)\n"
                 f"estimated by the schedules' timing model at unit costs (moelab schedule --json), not measured or "
                 f"simulated runs; schedule files of commit {commit}", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    return fig


def m_a(runs):
    """(cluster, p) -> M_a in bytes: saved bytes per layer x layers, from any run reporting them."""
    out = {}
    for r in runs:
        off = r["results"].get("offload") or {}
        p = p_of(r["model"])
        if off.get("saved_bytes_per_layer") and p:
            out[(r["cluster"], p)] = off["saved_bytes_per_layer"] * (3 * p - 2)
    return out


def figure_memory(summary, plt):
    runs = [r for r in done(summary) if r.get("pipeline") and r["label"] in list(LINES) + list(MARKS)
            and not r["label"].startswith("tp")]
    ma = m_a(runs)
    fig, axes = plt.subplots(1, len(CLUSTERS), figsize=(6.2 * len(CLUSTERS), 4.6), sharey=True)
    for ax, cl in zip(axes, CLUSTERS):
        for label, col in LINES.items():
            pts = sorted((p_of(r["model"]), r["results"]) for r in runs if r["cluster"] == cl and r["label"] == label)
            pts = [(p, f) for p, f in pts if p and "peak_activation_bytes" in f]
            if not pts:
                continue
            ax.plot([p for p, _ in pts], [f["peak_activation_bytes"] / 2**30 for _, f in pts], "o-", color=col,
                    label=label)
            cf = [(p, max(f["stage_expected_peak_activation_ma"]) * ma[(cl, p)]) for p, f in pts
                  if f.get("stage_expected_peak_activation_ma") and (cl, p) in ma]
            if cf:
                ax.plot([p for p, _ in cf], [b / 2**30 for _, b in cf], "--", color=col, alpha=0.7)
        for label, (col, mk) in MARKS.items():
            pts = sorted((p_of(r["model"]), r["results"]) for r in runs if r["cluster"] == cl and r["label"] == label)
            pts = [(p, f) for p, f in pts if p and "peak_activation_bytes" in f]
            if pts:
                ax.plot([p for p, _ in pts], [f["peak_activation_bytes"] / 2**30 for _, f in pts], mk, color=col,
                        label=label, linestyle="none", alpha=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks([4, 8, 16, 32])
        ax.set_xticklabels(["4", "8", "16", "32"])
        ax.set_xlabel("pipeline stages p (3p - 2 layers, 2p microbatches)")
        ax.set_title(f"{cl} ({CLUSTERS[cl]})", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("peak activation memory, highest stage (GiB)")
    axes[-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(title(summary, "Peak activation memory per device against p (solid: simulated allocator; "
                                "dashed: closed form x M_a)"), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    return fig


def figure_tradeoff(summary, plt):
    runs = done(summary)
    ps = [8, 16]
    fig, axes = plt.subplots(len(CLUSTERS), len(ps), figsize=(6 * len(ps), 4.4 * len(CLUSTERS)), squeeze=False)
    for i, cl in enumerate(CLUSTERS):
        for j, p in enumerate(ps):
            ax = axes[i, j]
            for r in runs:
                f = r["results"]
                if r["cluster"] != cl or p_of(r["model"]) != p or "tokens_per_s" not in f:
                    continue
                col, mk = (LINES[r["label"]], "o") if r["label"] in LINES else MARKS.get(r["label"], ("#000000", "."))
                ax.plot(f["peak_memory_bytes"] / 2**30, f["tokens_per_s"] / 1e3, mk, color=col, markersize=8)
                ax.annotate(r["label"], (f["peak_memory_bytes"] / 2**30, f["tokens_per_s"] / 1e3), fontsize=6,
                            xytext=(3, 3), textcoords="offset points")
            ax.set_title(f"{cl} ({CLUSTERS[cl]}), p = {p} ({p} GPUs)", fontsize=9)
            ax.set_xlabel("peak device memory, highest rank (GiB)")
            ax.set_ylabel("throughput (thousand tokens/s)")
            ax.grid(alpha=0.3)
    fig.suptitle(title(summary, "Throughput against peak memory, every run at p = 8 and 16"), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return fig


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("figure", choices=["schedules", "memory", "tradeoff"])
    ap.add_argument("--summary")
    ap.add_argument("--schedules", nargs="+")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.figure == "schedules" and not a.schedules:
        fail("schedules: --schedules FILE... (moelab schedule --json output) is required")
    if a.figure != "schedules" and not a.summary:
        fail(f"{a.figure}: --summary FILE is required")
    plt = mr.pyplot("pipeoffload.py")
    fig = figure_schedules(a.schedules, plt) if a.figure == "schedules" else \
        {"memory": figure_memory, "tradeoff": figure_tradeoff}[a.figure](load(a.summary), plt)
    mr.save_figure(fig, a.out, 120)
    print(f"pipeoffload.py: wrote {a.out}")


if __name__ == "__main__":
    main()
