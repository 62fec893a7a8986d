#!/usr/bin/python3
"""plots/mpipemoe.py — the MPipeMoE suite's speed-ups and memory, one figure per model.

    /usr/bin/python3 plots/mpipemoe.py                                   # results/simulated/mpipemoe/summary.json
    /usr/bin/python3 plots/mpipemoe.py --summary S.json --cluster dgx-a100x8 --out-dir results/figures

Reads the summary written by scripts/run_suite.py. Per model and cluster one PNG,
results/figures/mpipemoe-<model>.png (…-<model>-<cluster>.png for clusters other than the
paper's): one row per dtype; left, the speed-ups of PipeMoE and
MPipeMoE over FastMoE and FasterMoE per token count (bars, a dashed line at 1x); right, peak
device memory of every implementation per token count (bars, GiB). Each figure is labelled
"simulated: <cluster>, <calibration> calibration, commit <commit>". A system without results
(MPipeMoE while the binary lacks memory reuse) is named in the panel as not run.
Needs matplotlib (Debian: apt-get install python3-matplotlib).
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import moelab_results as mr  # noqa: E402
PAPER_CLUSTER = "dgx-a100x8"
IMPL_COLOURS = {"FastMoE": "#7f7f7f", "FasterMoE": "#bcbd22", "PipeMoE": "#1f77b4", "MPipeMoE": "#d62728"}
PAIR_STYLE = {  # (system, baseline) -> colour, hatch
    ("PipeMoE", "FastMoE"): ("#1f77b4", ""), ("PipeMoE", "FasterMoE"): ("#aec7e8", "//"),
    ("MPipeMoE", "FastMoE"): ("#d62728", ""), ("MPipeMoE", "FasterMoE"): ("#ff9896", "//"),
}


def token_label(b):
    return f"{b // 1024}K" if b % 1024 == 0 else str(b)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--summary", default=os.path.join(ROOT, "results", "simulated", "mpipemoe", "summary.json"))
    ap.add_argument("--cluster", action="append", help="cluster(s) to draw (default: every cluster in the summary)")
    ap.add_argument("--out-dir", default=os.path.join(ROOT, "results", "figures"))
    a = ap.parse_args()
    plt = mr.pyplot("mpipemoe.py")
    if not os.path.exists(a.summary):
        print(f"mpipemoe.py: {a.summary}: no such file (run scripts/run_suite.py first)", file=sys.stderr)
        return 2
    try:
        s = mr.load_summary(a.summary)
    except mr.SchemaError as e:
        print(f"mpipemoe.py: {e}", file=sys.stderr)
        return 2
    pts = s["points"]
    clusters = list(dict.fromkeys(p["cluster"] for p in pts))
    if a.cluster:
        missing = [c for c in a.cluster if c not in clusters]
        if missing:
            sys.exit(f"mpipemoe.py: {', '.join(missing)} not in {a.summary} (it has {', '.join(clusters)})")
        clusters = a.cluster
    labels = []
    for p in pts:
        for l in list(p["results"]) + p.get("skipped", []):
            if l not in labels:
                labels.append(l)
    systems = [l for l in ("PipeMoE", "MPipeMoE") if l in labels]
    baselines = [l for l in ("FastMoE", "FasterMoE") if l in labels]
    skipped = {x["impl"]: x["reason"] for x in s.get("skipped", []) if "impl" in x}
    os.makedirs(a.out_dir, exist_ok=True)
    commit = s.get("commit") or "unknown"
    written = []
    for cluster in clusters:
        cpts = [p for p in pts if p["cluster"] == cluster]
        gpus = cpts[0]["gpus"]
        for model in dict.fromkeys(p["model"] for p in cpts):
            mpts = [p for p in cpts if p["model"] == model]
            dtypes = list(dict.fromkeys(p["dtype"] for p in mpts))
            fig, axes = plt.subplots(len(dtypes), 2, figsize=(12, 3.6 * len(dtypes) + 0.9), squeeze=False)
            for r, dtype in enumerate(dtypes):
                dp = sorted((p for p in mpts if p["dtype"] == dtype), key=lambda p: p["tokens_per_gpu"])
                xs = list(range(len(dp)))
                xt = [token_label(p["tokens_per_gpu"]) + (f"\n({token_label(p['tokens_per_rank'])}/rank)"
                                                          if p["tokens_per_rank"] != p["tokens_per_gpu"] else "")
                      for p in dp]
                # speed-ups
                ax = axes[r, 0]
                pairs = [(sy, b) for sy in systems for b in baselines
                         if any(p["speedup"].get(f"{sy}_vs_{b}") is not None for p in dp)]
                notes = [f"{sy}: not run" + (" (this moelab lacks its options)" if sy in skipped else "")
                         for sy in systems if not any(sy in p["results"] for p in dp)]
                w = 0.8 / max(len(pairs), 1)
                top = 1.0
                for k, (sy, b) in enumerate(pairs):
                    vals = [p["speedup"].get(f"{sy}_vs_{b}") for p in dp]
                    col, hatch = PAIR_STYLE.get((sy, b), ("#333333", ""))
                    pos = [x - 0.4 + w * (k + 0.5) for x in xs]
                    bars = ax.bar(pos, [v or 0 for v in vals], w, color=col, hatch=hatch, edgecolor="black",
                                  linewidth=0.5, label=f"{sy} vs {b}")
                    for bar, v, p in zip(bars, vals, dp):
                        if v is not None:
                            ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.2f}", ha="center",
                                    va="bottom", fontsize=7)
                            top = max(top, v)
                        elif any(l in p.get("out_of_memory", {}) for l in (sy, b)):
                            ax.text(bar.get_x() + bar.get_width() / 2, 0.02, "OOM", ha="center", va="bottom",
                                    fontsize=6, rotation=90, color="#d62728")
                ax.axhline(1.0, color="black", linestyle="--", linewidth=0.8)
                ax.set_ylim(0, top * 1.3)
                nsel = ["/".join(f"{p['results'][sy]['partitions']}" for sy in systems
                                 if "partitions" in p["results"].get(sy, {})) for p in dp]
                ax.set_xticks(xs)
                ax.set_xticklabels([t + (f"\nn = {n}" if n else "") for t, n in zip(xt, nsel)], fontsize=8)
                ax.set_ylabel("speed-up (x)")
                ax.set_xlabel("tokens per GPU (B); n = partitions chosen by the search ("
                              + "/".join(sy for sy in systems if any(sy in p["results"] for p in dp)) + ")")
                ax.set_title(f"{dtype}: speed-up per MoE layer step", loc="left", fontsize=10)
                if ax.get_legend_handles_labels()[0]:  # a panel with no runs has no bars to name
                    ax.legend(fontsize=7, loc="upper left", ncol=2, frameon=False)
                if notes:
                    ax.text(0.01, 0.86, "\n".join(notes), transform=ax.transAxes, ha="left", va="top",
                            fontsize=7, color="#d62728")
                # memory
                ax = axes[r, 1]
                impls = [l for l in labels if any(l in p["results"] for p in dp)]
                notes = [f"{l}: not run" + (" (this moelab lacks its options)" if l in skipped else "")
                         for l in labels if l not in impls]
                w = 0.8 / max(len(impls), 1)
                ntop = 0.0
                for k, l in enumerate(impls):
                    vals = [p["results"][l]["peak_memory_bytes"] / 2**30 if l in p["results"] else None for p in dp]
                    pos = [x - 0.4 + w * (k + 0.5) for x in xs]
                    ax.bar(pos, [v or 0 for v in vals], w, color=IMPL_COLOURS.get(l, "#333333"), edgecolor="black",
                           linewidth=0.5, label=l)
                    ntop = max(ntop, max(v for v in vals if v is not None))
                    for x, p in zip(pos, dp):  # a run that did not fit the device: say so where its bar would be
                        if l in p.get("out_of_memory", {}):
                            ax.text(x, 0, " out of device memory", ha="center", va="bottom", fontsize=6,
                                    rotation=90, color="#d62728")
                ax.set_ylim(0, ntop * 1.3 if ntop else 1)
                ax.set_xticks(xs)
                ax.set_xticklabels(xt, fontsize=8)
                ax.set_ylabel("peak device memory (GiB)")
                ax.set_xlabel("tokens per GPU (B)")
                ax.set_title(f"{dtype}: peak memory of the highest rank", loc="left", fontsize=10)
                if impls:
                    ax.legend(fontsize=7, loc="upper left", ncol=len(impls), frameon=False)
                if notes:
                    ax.text(0.01, 0.86, "\n".join(notes), transform=ax.transAxes, ha="left", va="top",
                            fontsize=7, color="#d62728")
            fig.suptitle(f"{model} ({gpus} GPUs, 64 experts, top-1) — simulated: {cluster}, "
                         f"{mr.calibration_words(s.get('calibration'))}, commit {commit}",
                         x=0.01, ha="left", fontsize=10)
            fig.tight_layout(rect=(0, 0, 1, 0.96))
            name = f"mpipemoe-{model}.png" if cluster == PAPER_CLUSTER else f"mpipemoe-{model}-{cluster}.png"
            path = os.path.join(a.out_dir, name)
            mr.save_figure(fig, path, 110)
            plt.close(fig)
            written.append(path)
    for p in written:
        print(f"mpipemoe.py: wrote {os.path.relpath(p, ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
