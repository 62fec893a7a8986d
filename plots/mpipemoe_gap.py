#!/usr/bin/python3
"""plots/mpipemoe_gap.py — where MPipeMoE's speed-up gap goes: PipeMoE's simulated speed-up
over FastMoE and FasterMoE at each stage of scripts/gap_decomposition.py (the cluster model's
terms switched on one after another, the baselines as published, host time swept), beside the
paper's figures.

    /usr/bin/python3 plots/mpipemoe_gap.py [--data results/simulated/mpipemoe/gap-decomposition.json]
        [--out results/figures/mpipemoe-gap-decomposition.png]
"""
import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=os.path.join(ROOT, "results", "simulated", "mpipemoe", "gap-decomposition.json"))
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "figures", "mpipemoe-gap-decomposition.png"))
    a = ap.parse_args()
    with open(a.data) as f:
        d = json.load(f)
    pts = d["points"]
    fig, axes = plt.subplots(1, len(pts), figsize=(6.4 * len(pts), 5.2), sharey=True, squeeze=False)
    paper = d.get("paper", {})
    lines = [("pipemoe-speedup-vs-fastmoe-max", "vs FastMoE", "#1f77b4"),
             ("pipemoe-speedup-vs-fastermoe-mean", "vs FasterMoE", "#d62728"),
             ("pipemoe-speedup-vs-fastermoe-max", "vs FasterMoE", "#d62728")]
    for ax, pt in zip(axes[0], pts):
        st = pt["stages"]
        x = list(range(len(st)))
        w = 0.38
        fm = [s["speedup"]["vs_FastMoE"] for s in st]
        fr = [s["speedup"]["vs_FasterMoE"] for s in st]
        ax.bar([i - w / 2 for i in x], fm, w, color="#1f77b4", label="PipeMoE / FastMoE (simulated)")
        ax.bar([i + w / 2 for i in x], fr, w, color="#d62728", label="PipeMoE / FasterMoE (simulated)")
        for i in x:
            ax.text(i - w / 2, fm[i] + 0.03, f"{fm[i]:.2f}", ha="center", va="bottom", fontsize=6.5, rotation=90)
            ax.text(i + w / 2, fr[i] + 0.03, f"{fr[i]:.2f}", ha="center", va="bottom", fontsize=6.5, rotation=90)
        for cid, what, colour in lines:
            if cid in paper:
                stat = "max" if cid.endswith("max") else "mean"
                ax.axhline(paper[cid]["value"], color=colour, ls="--" if stat == "max" else ":", lw=1)
                ax.text(len(st) - 0.5, paper[cid]["value"], f"paper {what}, {stat} {paper[cid]['value']:g}x",
                        ha="right", va="bottom", fontsize=7, color=colour)
        ax.axhline(1.0, color="#555555", lw=0.6)
        n_model = sum(1 for s in st if not s["as_published"])
        ax.axvspan(n_model - 0.5, n_model + 0.5, color="#f2e6c9", zorder=0)
        ax.axvspan(n_model + 0.5, len(st) - 0.5, color="#e3eef7", zorder=0)
        ax.set_xticks(x)
        ax.set_xticklabels([s["label"] for s in st], rotation=60, ha="right", fontsize=7.5)
        ax.set_title(f"{pt['workload']} on {d['cluster']}\n"
                     "(white: cluster model terms; tan: baselines as published; blue: host time, swept)", fontsize=8.5)
        ax.set_ylabel("PipeMoE speed-up (step time ratio)")
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Where the gap goes: each white or tan stage adds one term to the one before; the blue ones are points "
                 f"of the host-time sweep on the tan stage (simulated, "
                 f"moelab {', '.join(c[:12] for c in d['commit'])}); best of n = "
                 f"{', '.join(map(str, d['pipemoe_partitions']))} partitions", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    fig.savefig(a.out, dpi=130)
    print(f"wrote {os.path.relpath(a.out, ROOT)}")


if __name__ == "__main__":
    main()
