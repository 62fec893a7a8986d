#!/usr/bin/python3
"""plots/pipeline_schedule.py — a pipeline schedule as the papers draw it: stages by time, one box
per F, B and W of a microbatch, from the Chrome trace of a pipelined run.

    moelab run --model experiments/models/tiny-moe.json --impl fastmoe --backend sim --cluster dgx-a100x1 \
        --ranks 4 --parallel pp=4 --schedule 1f1b --microbatches 8 --trace 1f1b.trace.json --out 1f1b.json
    /usr/bin/python3 plots/pipeline_schedule.py 1f1b.trace.json --out 1f1b.png
    /usr/bin/python3 plots/pipeline_schedule.py gpipe.trace.json 1f1b.trace.json zb-h1.trace.json \
        --labels GPipe 1F1B ZB-H1 --out schedules.png

One panel per trace, one row per stage (its lowest rank), one box per schedule node: the span of
the ops that carry the node's label ("F3.1": forward of microbatch 3, chunk 1; harness/pipeline/
executor.hpp) on that rank, transfers excluded. F blue, B green, W grey, R (a recomputed forward)
orange; odd chunks in a lighter shade; the microbatch number inside the box (as Narayanan et
al. 2021, Fig. 4, and Qi et al. 2024, Fig. 3, draw them). One timed step is drawn (--step, from
0). Each panel's bubble is printed and put in its title: per stage, 1 - its F/B/W/R time over the
window from the first such op to the last of any stage, the mean over stages (moelab run's
definition, here over the drawn ranks only). The title may name the first trace's provenance: {mode}, {backend}, {device},
{cluster}, {commit}, {date}, {model}, {impl}. Needs matplotlib (Debian: python3-matplotlib).
"""
import argparse
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import moelab_results as mr  # noqa: E402

COLOURS = {"F": "#4c72b0", "B": "#55a868", "W": "#9d9d9d", "R": "#dd8452"}
LABEL = re.compile(r"^([A-Z]+)(\d+)\.(\d+)$")


def fail(msg):
    sys.exit(f"pipeline_schedule.py: {msg}")


def load(path):
    try:
        with open(path) as f:
            trace = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        fail(f"cannot read the trace {path}: {e}")
    if not isinstance(trace, dict):
        fail(f"{path} is not a Chrome trace object")
    info = trace.get("otherData", {}).get("pipeline")
    if not info:
        fail(f"{path} is not the trace of a pipelined run (no otherData.pipeline: run moelab with --parallel)")
    return trace, info


def lighten(hex_colour, f):
    rgb = [int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{int(c + (255 - c) * f):02x}" for c in rgb)


def nodes(trace, info, step):
    """{stage: [(kind, microbatch, chunk, start ms, end ms)]} of one step, the stage's lowest rank."""
    stage_of = info["stage_of_rank"]
    first_rank = {}
    for r, s in enumerate(stage_of):
        first_rank.setdefault(s, r)
    steps = max(int(info.get("steps", 1)), 1)
    if not 0 <= step < steps:
        fail(f"--step {step}: the trace has {steps} timed steps")
    by_label = {}
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        m = LABEL.match(e.get("args", {}).get("node", ""))
        if not m or m.group(1) not in COLOURS or e.get("pid") not in first_rank.values():
            continue
        by_label.setdefault((e["pid"], m.group(0)), []).append(e)
    out = {s: [] for s in first_rank}
    rank_stage = {r: s for s, r in first_rank.items()}
    for (pid, label), evs in by_label.items():
        evs.sort(key=lambda e: e["ts"])
        n = len(evs) // steps  # a node issues the same ops every step
        part = evs[step * n:(step + 1) * n] if n else []
        if not part:
            continue
        m = LABEL.match(label)
        out[rank_stage[pid]].append((m.group(1), int(m.group(2)), int(m.group(3)),
                                     min(e["ts"] for e in part) / 1e3, max(e["ts"] + e["dur"] for e in part) / 1e3))
    if not any(out.values()):
        fail("no F, B or W ops with node labels in the trace")
    return out


def bubble(per_stage):
    """Mean over stages of 1 - busy / window (busy: the union of the stage's boxes)."""
    t0 = min(b[3] for v in per_stage.values() for b in v)
    t1 = max(b[4] for v in per_stage.values() for b in v)
    ratios = []
    for v in per_stage.values():
        busy, cur_s, cur_e = 0.0, None, None
        for _, _, _, s, e in sorted(v, key=lambda b: b[3]):
            if cur_e is None or s > cur_e:
                if cur_e is not None:
                    busy += cur_e - cur_s
                cur_s, cur_e = s, e
            else:
                cur_e = max(cur_e, e)
        if cur_e is not None:
            busy += cur_e - cur_s
        ratios.append(1.0 - busy / (t1 - t0) if t1 > t0 else 0.0)
    return sum(ratios) / len(ratios), t0, t1


def provenance(title, trace):
    other = trace.get("otherData", {})
    for k in ("mode", "backend", "device", "cluster", "calibration", "commit", "date", "model", "impl"):
        v = other.get(k)
        if isinstance(v, dict):
            v = v.get("name")
        title = title.replace("{" + k + "}", str(v if v is not None else "unknown"))
    return title


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+", help="Chrome traces of pipelined runs (moelab run --parallel ... --trace)")
    ap.add_argument("--labels", nargs="+", help="one panel title per trace (default: schedule and sizes)")
    ap.add_argument("--step", type=int, default=0, help="which timed step to draw (default 0)")
    ap.add_argument("--title", default="", help="figure title ({mode}, {commit}, ... from the first trace)")
    ap.add_argument("--out", required=True, help="PNG to write")
    a = ap.parse_args()
    if a.labels and len(a.labels) != len(a.traces):
        fail(f"{len(a.traces)} traces but {len(a.labels)} labels")
    panels = []
    for i, path in enumerate(a.traces):
        trace, info = load(path)
        per_stage = nodes(trace, info, a.step)
        b, t0, t1 = bubble(per_stage)
        name = (f"{info['schedule']}: p = {info['stages']}, m = {info['microbatches']}"
                + (f", v = {info['chunks']}" if info.get("chunks", 1) > 1 else "")
                + (f", recompute {info['recompute']}" if info.get("recompute", "none") != "none" else ""))
        label = a.labels[i] if a.labels else name
        print(f"pipeline_schedule.py: {label}: bubble {100 * b:.1f}% over {t1 - t0:.3f} ms ({name}, "
              f"{trace.get('otherData', {}).get('mode', 'unknown')})")
        panels.append((label, info, per_stage, b, t0, t1, trace))

    plt = mr.pyplot("pipeline_schedule.py")
    from matplotlib.patches import Patch
    rows = [len(p[2]) for p in panels]
    fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                             figsize=(12, 1.2 + sum(0.45 * r + 0.7 for r in rows)), gridspec_kw={"height_ratios": rows})
    seen = set()
    for ax, (label, info, per_stage, b, t0, t1, _) in zip(axes[:, 0], panels):
        stages = sorted(per_stage)
        span = t1 - t0
        for s in stages:
            y = len(stages) - 1 - s
            for kind, mb, chunk, start, end in per_stage[s]:
                colour = lighten(COLOURS[kind], 0.45) if chunk % 2 else COLOURS[kind]
                seen.add(kind)
                ax.broken_barh([(start - t0, max(end - start, span * 1e-3))], (y - 0.4, 0.8), facecolors=colour,
                               edgecolors="black", linewidth=0.4)
                if end - start > span / 80:
                    ax.text((start + end) / 2 - t0, y, str(mb), ha="center", va="center", fontsize=7)
        ax.set_yticks(range(len(stages)))
        ax.set_yticklabels([f"stage {s}" for s in reversed(stages)])
        ax.set_ylim(-0.6, len(stages) - 0.4)
        ax.set_xlim(0, span * 1.005)
        ax.set_xlabel("time from the step's first forward (ms)", fontsize=8)
        ax.grid(axis="x", linestyle=":", linewidth=0.6)
        ax.set_title(f"{label}: bubble {100 * b:.1f}%, {span:.2f} ms", loc="left", fontsize=10)
    top = 1.0
    if a.title:
        fig.suptitle(provenance(a.title, panels[0][6]), x=0.01, y=0.995, ha="left", va="top", fontsize=10)
        top -= 0.35 / fig.get_figheight()
    names = {"F": "F forward", "B": "B input gradient", "W": "W weight gradient",
             "R": "R recomputed forward"}
    handles = [Patch(facecolor=COLOURS[k], edgecolor="black", label=names[k]) for k in "FBWR" if k in seen]
    if any(p[1].get("chunks", 1) > 1 for p in panels):
        handles.append(Patch(facecolor=lighten(COLOURS["F"], 0.45), edgecolor="black", label="lighter: odd chunks"))
    fig.legend(handles=handles, loc="upper left", bbox_to_anchor=(0.01, top), ncol=max(1, len(handles)), fontsize=8,
               frameon=False)
    top -= 0.35 / fig.get_figheight()
    fig.tight_layout(rect=(0, 0, 1, top))
    mr.save_figure(fig, a.out, 130)
    print(f"pipeline_schedule.py: wrote {a.out}")


if __name__ == "__main__":
    main()
