#!/usr/bin/python3
"""plots/timeline.py — one rank of a Chrome trace (moelab run --trace) as a Gantt chart.

    /usr/bin/python3 plots/timeline.py TRACE.json --out timeline.png
    /usr/bin/python3 plots/timeline.py n1.trace.json n2.trace.json n4.trace.json \
        --labels "n = 1" "n = 2" "n = 4" --results n1.json n2.json n4.json --out panels.png

One row per stream of the rank (compute, dispatch, combine, ...), in the trace's stream order;
each op a bar coloured by its phase (gate, dispatch, experts, combine). Several traces become
panels stacked on one shared time axis, so their lengths compare directly. With --results (the
result JSON of each run) a panel's title gives its step time, its overlap limit
max(comm, compute) and how far above that limit the step is. The title may name the first
trace's provenance (its "otherData", written by moelab run --trace): {mode}, {backend},
{device}, {cluster}, {calibration}, {commit}, {date}, {workload}, {impl}.
Needs matplotlib (Debian: apt-get install python3-matplotlib).
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import moelab_results as mr  # noqa: E402

PHASE_COLOURS = {"gate": "#8c8c8c", "dispatch": "#1f77b4", "experts": "#ff7f0e", "combine": "#2ca02c"}
EXTRA_COLOURS = ["#9467bd", "#d62728", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]


def load_trace(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"timeline.py: cannot read the trace {path}: {e}")


def provenance_title(title, path):
    """The title with {mode}, {commit}, ... replaced from the trace's otherData."""
    trace = load_trace(path)
    other = trace.get("otherData", {}) if isinstance(trace, dict) else {}
    for k in ("mode", "backend", "device", "cluster", "calibration", "commit", "date", "workload", "impl"):
        v = other.get(k)
        if k == "calibration" and other.get("mode") == "simulated":
            v = mr.calibration_words(v)
        title = title.replace("{" + k + "}", str(v if v is not None else "unknown"))
    return title


def load_rank(path, rank):
    trace = load_trace(path)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names, order, ops = {}, {}, []
    for e in events:
        if e.get("pid") != rank:
            continue
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            names[e["tid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_sort_index":
            order[e["tid"]] = e["args"]["sort_index"]
        elif e.get("ph") == "X":
            ops.append(e)
    if not ops:
        sys.exit(f"timeline.py: {path} has no ops of rank {rank}")
    tids = sorted({e["tid"] for e in ops}, key=lambda t: (order.get(t, t), t))
    return tids, names, ops


def draw_streams(ax, tids, names, ops, t_end, colours, seen, linewidth=0.3, fontsize=None):
    """One panel: a row per stream, a bar per op coloured by its phase (colours and seen, the
    legend's phases in order of appearance, are shared by the figure's panels and grow here)."""
    row = {t: i for i, t in enumerate(tids)}
    for e in ops:
        ph = e.get("cat") or e.get("args", {}).get("phase", "other")
        if ph not in colours:
            colours[ph] = EXTRA_COLOURS[(len(colours) - len(PHASE_COLOURS)) % len(EXTRA_COLOURS)]
        if ph not in seen:
            seen.append(ph)
        y = len(tids) - 1 - row[e["tid"]]
        ax.broken_barh([(e["ts"] / 1e3, max(e["dur"] / 1e3, t_end * 1e-4))], (y - 0.38, 0.76),
                       facecolors=colours[ph], edgecolors="black", linewidth=linewidth)
    ax.set_yticks(range(len(tids)))
    ax.set_yticklabels([names.get(t, f"stream {t}") for t in reversed(tids)], fontsize=fontsize)
    ax.set_ylim(-0.6, len(tids) - 0.4)
    ax.grid(axis="x", linestyle=":", linewidth=0.6)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+", help="Chrome trace JSON files written by moelab run --trace")
    ap.add_argument("--labels", nargs="+", help="one panel title per trace (default: the file names)")
    ap.add_argument("--results", nargs="+", help="the result JSON of each run, for step time and overlap limit")
    ap.add_argument("--rank", type=int, default=0, help="which rank to draw (default 0)")
    ap.add_argument("--title", default="", help="figure title")
    ap.add_argument("--out", required=True, help="PNG to write")
    a = ap.parse_args()
    plt = mr.pyplot("timeline.py")
    from matplotlib.patches import Patch
    labels = a.labels or a.traces
    if len(labels) != len(a.traces):
        sys.exit(f"timeline.py: {len(a.traces)} traces but {len(labels)} labels")
    if a.results and len(a.results) != len(a.traces):
        sys.exit(f"timeline.py: {len(a.traces)} traces but {len(a.results)} result files")

    try:
        results = [mr.load_result(p) for p in a.results or []]
    except mr.SchemaError as e:
        print(f"timeline.py: {e}", file=sys.stderr)
        return 2
    panels = [load_rank(p, a.rank) for p in a.traces]
    t_end = max(max(e["ts"] + e["dur"] for e in ops) for _, _, ops in panels) / 1e3  # ms
    heights = [max(len(t), 1) for t, _, _ in panels]
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False,
                             figsize=(11, 1.1 + sum(0.55 * h + 0.6 for h in heights)),
                             gridspec_kw={"height_ratios": heights})
    colours = dict(PHASE_COLOURS)
    seen = []
    for k, (ax, (tids, names, ops)) in enumerate(zip(axes[:, 0], panels)):
        draw_streams(ax, tids, names, ops, t_end, colours, seen)
        title = labels[k]
        if results:
            m = results[k]["metrics"]
            step, lim = m["step_time_s"]["median"] * 1e3, m["overlap_limit_s"] * 1e3
            title += (f": step {step:.2f} ms, bound max(comm, compute) {lim:.2f} ms "
                      f"({step / lim:.2f}x of it), overlap {100 * m['overlap_ratio']:.0f}%")
        ax.set_title(title, loc="left", fontsize=10)
    axes[-1, 0].set_xlim(0, t_end * 1.01)
    axes[-1, 0].set_xlabel("time in the step (ms)")
    top = 1.0
    if a.title:
        fig.suptitle(provenance_title(a.title, a.traces[0]), x=0.01, y=0.995, ha="left", va="top", fontsize=10)
        top -= 0.35 / fig.get_figheight()
    fig.legend(handles=[Patch(facecolor=colours[p], edgecolor="black", label=f"phase: {p}") for p in seen],
               loc="upper left", bbox_to_anchor=(0.01, top), ncol=max(1, len(seen)), fontsize=9, frameon=False)
    top -= 0.35 / fig.get_figheight()
    fig.tight_layout(rect=(0, 0, 1, top))
    mr.save_figure(fig, a.out, 130)
    print(f"timeline.py: wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
