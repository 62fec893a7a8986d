#!/usr/bin/python3
"""plots/scmoe.py — the ScMoE suite's figures: speed-ups over top-2, overlap, block-pair timelines.

    /usr/bin/python3 plots/scmoe.py speedup --summary results/simulated/scmoe/summary.json --out scmoe-speedup.png
    /usr/bin/python3 plots/scmoe.py overlap --summary results/simulated/scmoe/summary.json --out scmoe-overlap.png
    /usr/bin/python3 plots/scmoe.py timeline top2.trace.json pos1.trace.json pos2.trace.json pos3.trace.json \
        --labels "top-2 MoE" "Pos-1" "Pos-2" "Pos-3" --out scmoe-pair-timeline.png

speedup: from the whole-model runs of a summary written by scripts/run_suite.py (experiments/
scmoe/suite.json), the speed-up of every variant over top-2 MoE (top-2's step time / the
variant's, the runs paired by model, layers, cluster and mode as the claims pair them), one
panel per machine, bars per model; training in the top row, inference in the bottom one (a
panel whose runs were skipped says why).
overlap: top row, the overlap ratio of every variant's training step per model, one panel per
machine; bottom row, the all-to-all's share of the MoE layers' time under top-2 per machine
(the paper's 60% on A30-PCIe and 15% on A800-NVLink marked), the all-to-all's own overlap of
the traced block pairs (the paper's 70%-100% band shaded) and the inference runs' overlap.
timeline: rank 0 of each trace (moelab run --trace) as a Gantt chart of its streams, the
panels side by side on one time axis (plots/timeline.py reads the traces); each titled with
its step time (from the result beside the trace) and its all-to-all overlap; --crop-at
grad_sync ends the axis where the gradient all-reduce begins (what follows is alike in all).
Every figure is titled simulated or measured, with the cluster models, the calibration and the
commit. Needs matplotlib (Debian: apt-get install python3-matplotlib).
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moelab_results as mr  # noqa: E402
import timeline  # noqa: E402

REFERENCE = "top2"
VARIANT_COLOURS = {"top1": "#aec7e8", "top2-pipelined": "#7f7f7f", "top1-pipelined": "#c7c7c7",
                   "residual-moe": "#bcbd22", "ScMoE": "#d62728", "ScMoE-Pos1": "#ff9896", "ScMoE-Pos3": "#9467bd",
                   "top2": "#1f77b4", "pair-top2": "#1f77b4", "pair-Pos1": "#ff9896", "pair-Pos2": "#d62728",
                   "pair-Pos3": "#9467bd"}
EXTRA = ["#8c564b", "#e377c2", "#17becf", "#2ca02c"]
CLUSTER_PAPER_SHARE = {"pcie-a30x1": 0.60, "a800x1": 0.15}  # ScMoE's all-to-all share of MoE time


def colour(label, k):
    return VARIANT_COLOURS.get(label, EXTRA[k % len(EXTRA)])


def load(path):
    if not os.path.exists(path):
        print(f"scmoe.py: {path}: no such file (run scripts/run_suite.py --suite scmoe first)", file=sys.stderr)
        sys.exit(2)
    try:
        return mr.load_summary(path)
    except mr.SchemaError as e:
        print(f"scmoe.py: {e}", file=sys.stderr)
        sys.exit(2)


def model_runs(summary):
    return [r for r in summary.get("runs", []) if r.get("run_mode")]


def provenance(summary, runs):
    """"simulated: pcie-a30x1, a800x1, datasheet calibration, commit X" (or measured on ...)."""
    done = [r for r in runs if "results" in r]
    sim = sorted({r["cluster"] for r in done if r.get("mode") == "simulated"}, key=lambda c: order(runs, c))
    meas = sorted({r.get("device", "?") for r in done if r.get("mode") == "measured"})
    parts = []
    if sim:
        parts.append(f"simulated: {', '.join(sim)}, {mr.calibration_words(summary.get('calibration'))}")
    if meas:
        parts.append(f"measured: {', '.join(meas)}")
    return "; ".join(parts or ["nothing ran"]) + f", commit {summary.get('commit') or 'unknown'}"


def order(runs, cluster):
    cl = [r.get("cluster") for r in runs]
    return cl.index(cluster) if cluster in cl else len(cl)


def point(r):
    """A model as an axis names it: with its layers (--layers) or its depth when an override cut it."""
    depth = (r.get("override") or {}).get("num_layers")
    return r["model"] + (f"\n[{r['layers']}]" if r.get("layers") else f"\n({depth} layers)" if depth else "")


def reasons(rows):
    """Why the rows of a panel did not run, once each (shortened to what a panel can show)."""
    out = []
    for r in rows:
        if "results" in r:
            continue
        why = "out of device memory" if r.get("out_of_memory") else r.get("skipped", "not run")
        why = why.split(" (moelab said")[0]
        if why not in out:
            out.append(why)
    return out


def short(why):
    """A skip reason in a few words, for a bar's place."""
    for key, text in (("no model file", "no model file"), ("--inference", "no --inference"),
                      ("out of device memory", "out of memory"), ("failed", "failed")):
        if key in why:
            return text
    return wrap(why, 20)


def wrap(text, width=60):
    words, lines, line = text.split(), [], ""
    for w in words:
        if line and len(line) + 1 + len(w) > width:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}".strip()
    return "\n".join(lines + [line] if line else lines)


def bars(ax, rows, value, labels, title, ylabel, ref_line=None):
    """Bars per model (x) and label (one colour each) of value(row) over the given rows; returns
    the labels drawn (a panel whose rows did not run says why instead)."""
    models = list(dict.fromkeys(point(r) for r in rows))
    vals = {(point(r), r["label"]): value(r) for r in rows}
    shown = [l for l in labels if any(vals.get((m, l)) is not None for m in models)]
    if not shown:
        ax.set_axis_off()
        why = reasons(rows) or ["no runs"]
        ax.text(0.5, 0.5, title + "\n\nnot run:\n" + "\n".join(wrap(w, 50) for w in why[:3]), ha="center",
                va="center", fontsize=8, transform=ax.transAxes)
        return []
    w = 0.8 / len(shown)
    top = 1.0 if ref_line else 0.0
    for k, l in enumerate(shown):
        xs = [i - 0.4 + w * (k + 0.5) for i in range(len(models))]
        vs = [vals.get((m, l)) for m in models]
        bs = ax.bar(xs, [v or 0 for v in vs], w, color=colour(l, k), edgecolor="black", linewidth=0.4, label=l)
        for b, v, m in zip(bs, vs, models):
            if v is not None:
                ax.text(b.get_x() + b.get_width() / 2, v, f"{v:.2f}", ha="center", va="bottom", fontsize=5.5,
                        rotation=90)
                top = max(top, v)
            elif any(point(r) == m and r["label"] == l and r.get("out_of_memory") for r in rows):
                ax.text(b.get_x() + b.get_width() / 2, 0.02, "OOM", ha="center", va="bottom", fontsize=6,
                        rotation=90, color="#d62728")
    for i, m in enumerate(models):  # a model none of whose runs ran: say why where its bars would be
        if all(vals.get((m, l)) is None for l in shown):
            why = reasons([r for r in rows if point(r) == m])
            ax.text(i, 0.02 * (top or 1), "not run:\n" + short(why[0] if why else "not run"), ha="center",
                    va="bottom", fontsize=6, color="#d62728")
    if ref_line is not None:
        ax.axhline(ref_line, color="black", linestyle="--", linewidth=0.8)
    ax.set_ylim(0, top * 1.2 if top else 1)
    ax.set_xticks(range(len(models)))
    ax.set_xticklabels(models, fontsize=7)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, loc="left", fontsize=9)
    return shown


def legend(fig, labels):
    """One legend for the figure: a label has the same colour in every panel."""
    from matplotlib.patches import Patch
    fig.legend(handles=[Patch(facecolor=colour(l, k), edgecolor="black", label=l) for k, l in enumerate(labels)],
               loc="lower center", ncol=min(len(labels), 8), fontsize=8, frameon=False)


def suptitle(fig, what, provenance_):
    fig.suptitle(f"{what}\n{provenance_}", x=0.01, ha="left", fontsize=10)


def figure_speedup(a, plt):
    s = load(a.summary)
    runs = model_runs(s)
    if not runs:
        sys.exit(f"scmoe.py: {a.summary} has no whole-model runs")
    clusters = list(dict.fromkeys(r["cluster"] or f"np {r['ranks']}" for r in runs))
    labels = [l for l in dict.fromkeys(r["label"] for r in runs) if l != REFERENCE]
    ref = {mr.run_key(r): r for r in runs if r["label"] == REFERENCE and "results" in r}

    def speedup(r):
        b = ref.get(mr.run_key(r))
        if "results" not in r or b is None:
            return None
        return b["results"]["step_time_s"] / r["results"]["step_time_s"]

    modes = ["training", "inference"]
    drawn = set()
    fig, axes = plt.subplots(len(modes), len(clusters), figsize=(5.2 * len(clusters), 7.6), squeeze=False)
    for i, mode in enumerate(modes):
        for k, cl in enumerate(clusters):
            rows = [r for r in runs if (r["cluster"] or f"np {r['ranks']}") == cl and r["run_mode"] == mode
                    and r["label"] != REFERENCE and any(mr.run_key(r)[:2] == mr.run_key(b)[:2] for b in runs
                                                        if b["label"] == REFERENCE)]
            drawn.update(bars(axes[i, k], rows, speedup, labels, f"{mode}, {cl}", "speed-up over top-2 (x)",
                              ref_line=1.0))
    suptitle(fig, "ScMoE and the baselines: speed-up over top-2 MoE (top-2's step time / the variant's), "
                  "whole models", provenance(s, runs))
    legend(fig, [l for l in labels if l in drawn])
    fig.tight_layout(rect=(0, 0.04, 1, 0.94))
    return fig


def figure_overlap(a, plt):
    s = load(a.summary)
    runs = model_runs(s)
    if not runs:
        sys.exit(f"scmoe.py: {a.summary} has no whole-model runs")
    full = [r for r in runs if not r["label"].startswith("pair-")]
    pairs = [r for r in runs if r["label"].startswith("pair-")]
    clusters = list(dict.fromkeys(r["cluster"] or f"np {r['ranks']}" for r in full))
    labels = list(dict.fromkeys(r["label"] for r in full))
    ncol = max(len(clusters), 3)
    fig, axes = plt.subplots(2, ncol, figsize=(5.2 * ncol, 7.6), squeeze=False)
    drawn = set()
    for k, cl in enumerate(clusters):
        rows = [r for r in full if (r["cluster"] or f"np {r['ranks']}") == cl and r["run_mode"] == "training"]
        drawn |= set(bars(axes[0, k], rows, lambda r: r["results"]["overlap_ratio"] if "results" in r else None, labels,
             f"training, {cl}: communication hidden (gradient all-reduce included)", "overlap ratio"))
    for k in range(len(clusters), ncol):
        axes[0, k].set_axis_off()

    # the all-to-all's share of the MoE layers' time under top-2, per machine and model
    ax = axes[1, 0]
    ref = [r for r in full if r["label"] == REFERENCE and r["run_mode"] == "training"]
    shares = [r for r in ref if "results" in r and "all_to_all_share" in r["results"]]
    if shares:
        models = list(dict.fromkeys(point(r) for r in shares))
        w = 0.8 / len(models)
        for j, m in enumerate(models):
            xs = [i - 0.4 + w * (j + 0.5) for i in range(len(clusters))]
            vs = [next((r["results"]["all_to_all_share"] for r in shares if point(r) == m and r["cluster"] == cl),
                       None) for cl in clusters]
            ax.bar(xs, [v or 0 for v in vs], w, color=EXTRA[j % len(EXTRA)], edgecolor="black", linewidth=0.4,
                   label=m.replace("\n", " "))
        for i, cl in enumerate(clusters):
            if cl in CLUSTER_PAPER_SHARE:
                ax.hlines(CLUSTER_PAPER_SHARE[cl], i - 0.45, i + 0.45, colors="black", linestyles="--", linewidth=1)
                ax.text(i, CLUSTER_PAPER_SHARE[cl], f"paper {100 * CLUSTER_PAPER_SHARE[cl]:.0f}%", ha="center",
                        va="bottom", fontsize=7)
        ax.set_xticks(range(len(clusters)))
        ax.set_xticklabels(clusters, fontsize=7)
        ax.set_ylim(0, 1)
        ax.set_ylabel("all-to-all / MoE op time", fontsize=8)
        ax.legend(fontsize=6, loc="upper right", frameon=False)
        ax.set_title("top-2 MoE, training: (dispatch + combine) / MoE phases", loc="left", fontsize=9)
    else:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no top-2 training run with MoE phases", ha="center", va="center", transform=ax.transAxes)

    # the all-to-all's own overlap in the traced block pairs
    ax = axes[1, 1]
    traced = [r for r in pairs if "results" in r and "all_to_all_overlap" in r["results"]]
    if traced:
        ax.axhspan(0.7, 1.0, color="#2ca02c", alpha=0.15, label="paper: 70% to 100%")
        xs = range(len(traced))
        vs = [r["results"]["all_to_all_overlap"] for r in traced]
        ax.bar(xs, vs, 0.6, color=[colour(r["label"], k) for k, r in enumerate(traced)], edgecolor="black",
               linewidth=0.4)
        for x, v in zip(xs, vs):
            ax.text(x, v, f"{100 * v:.0f}%", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"{r['label']}\n{r['cluster']}" for r in traced], fontsize=7)
        ax.set_ylim(0, 1.1)
        ax.set_ylabel("all-to-all hidden / all-to-all", fontsize=8)
        ax.legend(fontsize=6, loc="upper left", frameon=False)
        ax.set_title(f"one block pair ({traced[0]['model']} [{traced[0]['layers']}]), training: all-to-all overlap",
                     loc="left", fontsize=9)
    else:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no traced block pair in this summary", ha="center", va="center", transform=ax.transAxes)

    # inference: the only communication is the all-to-all
    rows = [r for r in full if r["run_mode"] == "inference"]
    drawn |= set(bars(axes[1, 2], rows, lambda r: r["results"]["overlap_ratio"] if "results" in r else None, labels,
                      "inference: all-to-all hidden (every machine, every model)", "overlap ratio"))
    for k in range(3, ncol):
        axes[1, k].set_axis_off()
    suptitle(fig, "ScMoE suite: overlap of communication and computation, the all-to-all's share of MoE time",
             provenance(s, runs))
    legend(fig, [l for l in labels if l in drawn])
    fig.tight_layout(rect=(0, 0.04, 1, 0.94))
    return fig


def figure_timeline(a, plt):
    from matplotlib.patches import Patch
    labels = a.labels or [os.path.basename(t) for t in a.traces]
    if len(labels) != len(a.traces):
        sys.exit(f"scmoe.py: {len(a.traces)} traces but {len(labels)} labels")
    panels = [timeline.load_rank(p, a.rank) for p in a.traces]
    titles = []
    for p, lab in zip(a.traces, labels):
        res_path = p[: -len(".trace.json")] + ".json" if p.endswith(".trace.json") else None
        t = lab
        if res_path and os.path.exists(res_path):
            try:
                m = mr.load_result(res_path)["metrics"]
            except mr.SchemaError as e:
                print(f"scmoe.py: {e}", file=sys.stderr)
                sys.exit(2)
            t += f"\nstep {m['step_time_s']['median'] * 1e3:.2f} ms"
        try:
            ov = mr.all_to_all_overlap(p)
        except mr.SchemaError as e:
            print(f"scmoe.py: {e}", file=sys.stderr)
            sys.exit(2)
        if ov is not None:
            t += f", all-to-all {100 * ov:.0f}% hidden"
        titles.append(t)
    t_end = max(max(e["ts"] + e["dur"] for e in ops) for _, _, ops in panels) / 1e3  # ms
    xlabel = "time in the step (ms)"
    if a.crop_at:
        # The first op of that phase in each panel (e.g. the gradient all-reduce after the pair's
        # backward): what comes after it is the same in every panel and would take most of the axis.
        starts = [min((e["ts"] for e in ops if (e.get("cat") or e.get("args", {}).get("phase")) == a.crop_at),
                      default=None) for _, _, ops in panels]
        if all(x is not None for x in starts):
            t_end = max(starts) / 1e3
            xlabel += f"; cut where {a.crop_at} begins"
    fig, axes = plt.subplots(1, len(panels), sharex=True, squeeze=False, figsize=(4.2 * len(panels), 3.6))
    colours = dict(timeline.PHASE_COLOURS)
    seen = []
    for k, (ax, (tids, names, ops)) in enumerate(zip(axes[0], panels)):
        timeline.draw_streams(ax, tids, names, ops, t_end, colours, seen, linewidth=0.2, fontsize=8)
        ax.set_title(titles[k], loc="left", fontsize=9)
        ax.set_xlim(0, t_end * 1.01)
        ax.set_xlabel(xlabel, fontsize=8)
    title = timeline.provenance_title(a.title, a.traces[0]) if a.title else ""
    fig.suptitle(title, x=0.01, y=0.995, ha="left", va="top", fontsize=10)
    fig.legend(handles=[Patch(facecolor=colours[p], edgecolor="black", label=p) for p in seen],
               loc="lower center", ncol=max(1, len(seen)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 0.93))
    return fig


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="figure", required=True)
    for name in ("speedup", "overlap"):
        p = sub.add_parser(name)
        p.add_argument("--summary", default=os.path.join(ROOT, "results", "simulated", "scmoe", "summary.json"))
        p.add_argument("--out", required=True, help="PNG to write")
    p = sub.add_parser("timeline")
    p.add_argument("traces", nargs="+", help="Chrome traces (moelab run --trace), one panel each")
    p.add_argument("--labels", nargs="+")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--title", default="", help="figure title; {mode}, {cluster}, {calibration}, {commit} ... "
                                               "from the first trace (plots/timeline.py)")
    p.add_argument("--crop-at", metavar="PHASE", help="end the time axis where the first op of this phase "
                                                       "(e.g. grad_sync) begins, the latest of the panels")
    p.add_argument("--out", required=True, help="PNG to write")
    a = ap.parse_args()
    plt = mr.pyplot("scmoe.py")
    fig = {"speedup": figure_speedup, "overlap": figure_overlap, "timeline": figure_timeline}[a.figure](a, plt)
    mr.save_figure(fig, a.out, 120)
    plt.close(fig)
    print(f"scmoe.py: wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
