#!/usr/bin/python3
"""plots/scmoe_quality.py — validation-loss curves of ScMoE's quality comparison, one panel per data source.

    /usr/bin/python3 plots/scmoe_quality.py --summary results/measured/cpu/quality/summary.json \\
        --out results/measured/cpu/quality/scmoe_quality.png

Reads the summary written by scripts/quality.py. One column per source: above, the whole run;
below, its second half with the y axis zoomed to where the variants end. Each variant is its
mean over the seeds with a band from the lowest to the highest seed; for markov:K the entropy
floor ln K, which no model can beat, is a dashed line. The title says that the numbers are
measured on the cpu backend, on which device, at which commit, with which setting and data.
Needs matplotlib (Debian: apt-get install python3-matplotlib).
"""
import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import moelab_results as mr  # noqa: E402

COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]


def short_data(src):
    d = src.get("data", "")
    return d.split(" (")[0] if len(d) > 80 else d


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--summary", required=True, help="a quality summary (moelab.quality-summary/1)")
    ap.add_argument("--out", required=True, help="PNG to write")
    a = ap.parse_args()
    plt = mr.pyplot("scmoe_quality.py")
    try:
        with open(a.summary) as f:
            s = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"scmoe_quality.py: cannot read {a.summary}: {e} (run scripts/quality.py first)")
    if s.get("schema") != "moelab.quality-summary/1" or not s.get("sources"):
        sys.exit(f"scmoe_quality.py: {a.summary} is not a quality summary with sources")

    sources = list(s["sources"].items())
    fig, axes = plt.subplots(2, len(sources), squeeze=False, figsize=(5.6 * len(sources) + 0.8, 8.2),
                             gridspec_kw={"height_ratios": [1, 1]})
    labels = s.get("labels", {})
    for col, (name, src) in enumerate(sources):
        floor = src.get("entropy_floor")
        variants = list(src["variants"].items())
        for row in (0, 1):
            ax = axes[row][col]
            lows, highs = [], []
            for i, (v, e) in enumerate(variants):
                c = e["curve"]
                steps = c["steps"]
                first = len(steps) // 2 if row == 1 else 0
                x = steps[first:]
                colour = COLOURS[i % len(COLOURS)]
                f = e["final_loss"]
                label = f"{labels.get(v, v)}: {f['mean']:.3f}" + (f" ± {f['std']:.3f}" if f.get("std") is not None else "")
                ax.plot(x, c["mean"][first:], color=colour, linewidth=1.4, marker="o", markersize=2.5,
                        label=label if row == 0 else None)
                ax.fill_between(x, c["min"][first:], c["max"][first:], color=colour, alpha=0.18, linewidth=0)
                lows += c["min"][first:]
                highs += c["max"][first:]
            if floor is not None:
                ax.axhline(floor, color="black", linestyle="--", linewidth=1.0,
                           label=f"entropy floor ln K = {floor:.3f}" if row == 0 else None)
                lows.append(floor)
            if row == 1 and lows:
                pad = 0.05 * (max(highs) - min(lows) or 1.0)
                ax.set_ylim(min(lows) - pad, max(highs) + pad)
            ax.grid(linestyle=":", linewidth=0.6)
            ax.set_xlabel("training step", fontsize=8)
            ax.set_ylabel("validation loss (nats/token)", fontsize=8)
            ax.tick_params(labelsize=7)
            if row == 0:
                ax.set_title(f"{name}: {short_data(src)}", loc="left", fontsize=9)
                ax.legend(fontsize=7, title="final validation loss, mean ± std over seeds", title_fontsize=7)
            else:
                ax.set_title(f"{name}: second half, zoomed (band: min-max over seeds)", loc="left", fontsize=8)
    t = s["training"]
    commit = s["commit"] if isinstance(s["commit"], str) else ", ".join(s["commit"])
    fig.suptitle(f"ScMoE quality at test size — measured on cpu ({s['device']}), 1 rank, commit {commit}, {s['date'][:10]}\n"
                 f"setting {s['setting']}: seeds {t['seeds']}, {t['steps']} steps of {t['micro_batch']} x {t['seq_len']} tokens "
                 f"({t['tokens_per_run']:,} tokens), {t['optimizer']} lr {t['lr']}, the same for every variant",
                 x=0.01, ha="left", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    mr.save_figure(fig, a.out, 110)
    print(f"scmoe_quality.py: wrote {a.out}")


if __name__ == "__main__":
    main()
