#!/usr/bin/python3
"""plots/runs.py — every run of a suite summary: step time and its phases, one panel per platform.

    /usr/bin/python3 plots/runs.py --summary results/foundation/summary.json --out results/figures/foundation-steps.png

Reads the "runs" of a summary written by scripts/run_suite.py. One panel per backend (or
cluster) and workload, each titled "measured: <device>" or "simulated: <cluster>,
<calibration> calibration"; in a panel one row per run (implementation, ranks): a grey bar for the step time and, beneath it,
the phases' summed op time stacked (overlapping phases can add up to more than the step).
Runs that were skipped are listed under the figure. Needs matplotlib (Debian:
apt-get install python3-matplotlib).
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import moelab_results as mr  # noqa: E402

PHASE_COLOURS = {"gate": "#8c8c8c", "dispatch": "#1f77b4", "experts": "#ff7f0e", "combine": "#2ca02c",
                 "offload": "#9467bd", "fetch": "#d62728", "other": "#c7c7c7"}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--summary", required=True, help="a suite summary (moelab.suite-summary/1)")
    ap.add_argument("--out", required=True, help="PNG to write")
    a = ap.parse_args()
    plt = mr.pyplot("runs.py")
    from matplotlib.patches import Patch
    if not os.path.exists(a.summary):
        print(f"runs.py: {a.summary}: no such file (run scripts/run_suite.py first)", file=sys.stderr)
        return 2
    try:
        s = mr.load_summary(a.summary)
    except mr.SchemaError as e:
        print(f"runs.py: {e}", file=sys.stderr)
        return 2
    runs = [r for r in s.get("runs", []) if "results" in r]
    skipped = [r for r in s.get("runs", []) if "results" not in r]
    if not runs:
        sys.exit(f"runs.py: {a.summary} has no runs with results")

    panels = {}
    for r in runs:
        if r["mode"] == "simulated":
            key = f"simulated: {r['cluster']}, {mr.calibration_words(r.get('calibration'))}"
        else:
            key = f"measured: {r['backend']} backend, {r['device']}"
        key += f" — workload {r['workload']}"
        panels.setdefault(key, []).append(r)
    heights = [len(v) for v in panels.values()]
    fig, axes = plt.subplots(len(panels), 1, squeeze=False,
                             figsize=(11, 1.6 + sum(0.42 * h + 0.9 for h in heights)),
                             gridspec_kw={"height_ratios": heights})
    seen = []
    for ax, (title, rs) in zip(axes[:, 0], panels.items()):
        labels = []
        for i, r in enumerate(rs):
            y = len(rs) - 1 - i
            f = r["results"]
            ms = f["step_time_s"] * 1e3
            ax.barh(y + 0.18, ms, 0.34, color="#555555", edgecolor="black", linewidth=0.4)
            ax.text(ms, y + 0.18, f" {ms:.0f} ms" if ms >= 100 else f" {ms:.3g} ms", va="center", fontsize=7)
            left = 0.0
            order = [p for p in PHASE_COLOURS if p in f["phases_s"]] + \
                [p for p in f["phases_s"] if p not in PHASE_COLOURS]
            for ph, t in ((p, f["phases_s"][p]) for p in order):
                if t <= 0:
                    continue
                ax.barh(y - 0.18, t * 1e3, 0.34, left=left, color=PHASE_COLOURS.get(ph, "#17becf"),
                        edgecolor="black", linewidth=0.3)
                left += t * 1e3
                if ph not in seen:
                    seen.append(ph)
            where = f"{r['world_size']} ranks" if r["world_size"] > 1 else "1 rank"
            label = f"{r['impl']}, {where}"
            if sum(1 for q in rs if (q["impl"], q["world_size"]) == (r["impl"], r["world_size"])) > 1:
                label += f" [{r['id']}]"  # the same run in two entries of the suite
            labels.append((y, label))
        ax.set_yticks([y for y, _ in labels])
        ax.set_yticklabels([t for _, t in labels], fontsize=8)
        ax.set_ylim(-0.6, len(rs) - 0.4)
        ax.set_xlim(0, ax.get_xlim()[1] * 1.12)
        ax.set_xlabel("ms per step (grey: step time; colours: summed op time per phase)", fontsize=8)
        ax.grid(axis="x", linestyle=":", linewidth=0.6)
        ax.set_title(title, loc="left", fontsize=9)
    fig.suptitle(f"suite {s['suite']} ({s['subset']} run), commit {s.get('commit') or 'unknown'}, {s['date'][:10]}",
                 x=0.01, ha="left", fontsize=10)
    fig.legend(handles=[Patch(facecolor=PHASE_COLOURS.get(p, "#17becf"), edgecolor="black", label=p) for p in seen],
               loc="upper right", ncol=max(1, len(seen)), fontsize=8, frameon=False)
    note = ""
    if skipped:
        note = "not run here: " + "; ".join(sorted({f"{r['id']} ({r['skipped'].split(' (')[0]})" for r in skipped}))
        fig.text(0.01, 0.005, note, fontsize=7, color="#d62728", ha="left", va="bottom", wrap=True)
    fig.tight_layout(rect=(0, 0.03 if note else 0, 1, 0.97))
    mr.save_figure(fig, a.out, 110)
    print(f"runs.py: wrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
