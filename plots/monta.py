#!/usr/bin/python3
"""plots/monta.py — the MoNTA suite's figures: exchange time against TP, the end-to-end breakdown,
and the chunk count MoNTA's model picks against the simulated best.

    /usr/bin/python3 plots/monta.py exchange  --summary results/simulated/monta/summary.json --out monta-exchange-vs-tp.png
    /usr/bin/python3 plots/monta.py breakdown --summary results/simulated/monta/summary.json --out monta-e2e-breakdown.png
    /usr/bin/python3 plots/monta.py selection --summary results/simulated/monta/summary.json --out monta-selection.png

exchange: from the "layer" runs (two MoE blocks of MoNTA-2x70B, EP over all 16 GPUs), the MoE
layers' exchange time per training step (the all-to-all streams' and the TP all-gather lane's
busy time, summed) against the TP degree, a line per strategy, one panel per NIC count; dashed:
the all-to-alls alone.
breakdown: the "e2e" runs (MoNTA-2x70B, 24 layers, TP 8, EP 16): the step split by phase (summed
op time per phase of the slowest rank's figures) for every strategy, a group per NIC count.
selection: for every (cluster, TP) point of the "layer" runs, the step time of each chunk count
of the sweep (1 = deepspeed-drop, 2, 4, 8, 16), the one "auto" picked from the volume and time
model, and how much slower than the sweep's best it is; the same table is printed.
Every figure is titled simulated, with the cluster models, the calibration and the commit.
Needs matplotlib (Debian: apt-get install python3-matplotlib).
"""
import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import moelab_results as mr  # noqa: E402

COLOURS = {"deepspeed-tp": "#7f7f7f", "hierarchical": "#bcbd22", "deepspeed-drop": "#1f77b4", "megatron-sp": "#2ca02c", "monta": "#d62728",
           "monta-auto": "#9467bd", "monta-c2": "#ff9896", "monta-c8": "#e377c2", "monta-c16": "#8c564b"}
CLUSTERS = ["a800x2", "a800x2-nic4", "a800x2-nic1"]
NICS = {"a800x2": 8, "a800x2-nic4": 4, "a800x2-nic1": 1}
SWEEP = {"deepspeed-drop": 1, "monta-c2": 2, "monta": 4, "monta-c8": 8, "monta-c16": 16}
PHASES = ["attention", "mlp", "moe", "gate", "dispatch", "experts", "combine", "embedding", "head", "grad_sync",
          "optimizer"]


def load(path):
    if not os.path.exists(path):
        print(f"monta.py: {path}: no such file (run scripts/run_suite.py --suite monta first)", file=sys.stderr)
        sys.exit(2)
    try:
        return mr.load_summary(path)
    except mr.SchemaError as e:
        print(f"monta.py: {e}", file=sys.stderr)
        sys.exit(2)


def done(summary, run_id):
    return [r for r in summary.get("runs", []) if r.get("run_mode") and "results" in r and r.get("id") == run_id]


def tp_of(model):
    m = re.search(r"-tp(\d+)", model)
    return int(m.group(1)) if m else None


def title(summary, what):
    return (f"{what}\nsimulated: {', '.join(CLUSTERS)} (2 x 8 A800, 8/4/1 NICs per node), "
            f"{mr.calibration_words(summary.get('calibration'))}, commit {summary.get('commit') or 'unknown'}")


def figure_exchange(summary, plt):
    runs = done(summary, "layer") + done(summary, "layer-megatron")
    fig, axes = plt.subplots(1, len(CLUSTERS), figsize=(5.2 * len(CLUSTERS), 4.2), sharey=False)
    for ax, cl in zip(axes, CLUSTERS):
        for label in ["deepspeed-tp", "hierarchical", "deepspeed-drop", "monta", "monta-auto", "megatron-sp"]:
            pts = sorted((tp_of(r["model"]), r["results"].get("exchange_s"), r["results"].get("all_to_all_s"))
                         for r in runs if r["cluster"] == cl and r["label"] == label and tp_of(r["model"]))
            pts = [p for p in pts if p[1] is not None]
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [1e3 * p[1] for p in pts], "o-", color=COLOURS[label], label=label)
            if label.startswith("monta") or label == "deepspeed-drop":
                ax.plot([p[0] for p in pts], [1e3 * p[2] for p in pts], ":", color=COLOURS[label], alpha=0.7)
        ax.set_xscale("log", base=2)
        ax.set_xticks([2, 4, 8])
        ax.set_xticklabels(["2", "4", "8"])
        ax.set_xlabel("tensor-parallel degree (EP 16 over both nodes)")
        ax.set_ylabel("exchange time per step (ms)")
        ax.set_title(f"{cl}: {NICS[cl]} NIC{'s' if NICS[cl] > 1 else ''} per node", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title(summary, "MoE layers' exchange time (all-to-alls + TP all-gathers; dotted: the all-to-alls alone), "
                                "two MoE blocks of MoNTA-2x70B, one training step"), fontsize=9)
    fig.tight_layout()
    return fig


def figure_breakdown(summary, plt):
    runs = done(summary, "e2e") + done(summary, "e2e-megatron")
    labels = ["deepspeed-tp", "hierarchical", "deepspeed-drop", "monta", "monta-auto", "megatron-sp"]
    fig, ax = plt.subplots(figsize=(11, 4.8))
    cmap = plt.get_cmap("tab20")
    x, ticks, names = 0, [], []
    seen = set()
    for cl in CLUSTERS:
        for label in labels:
            r = next((r for r in runs if r["cluster"] == cl and r["label"] == label), None)
            if r is None:
                continue
            ph = r["results"].get("phases_s") or {}
            bottom = 0.0
            for k, p in enumerate(PHASES):
                v = 1e3 * ph.get(p, 0.0)
                if v <= 0:
                    continue
                ax.bar(x, v, bottom=bottom, color=cmap(k), label=p if p not in seen else None, width=0.8)
                seen.add(p)
                bottom += v
            ax.text(x, bottom, f"{1e3 * r['results']['step_time_s']:.0f}", ha="center", va="bottom", fontsize=7)
            ticks.append(x)
            names.append(f"{label}\n{NICS[cl]} NIC")
            x += 1
        x += 0.6
    ax.set_xticks(ticks)
    ax.set_xticklabels(names, fontsize=7, rotation=60)
    ax.set_ylabel("summed op time per phase (ms); the number: step time (ms)")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(title(summary, "MoNTA-2x70B (24 layers, 8K sequence) end to end on 16 A800, TP 8, EP 16"), fontsize=9)
    fig.tight_layout()
    return fig


def selection_table(summary):
    """[(cluster, tp, {chunks: step_s}, auto chunks, auto step_s, best chunks, best step_s)]."""
    runs = done(summary, "layer")
    out = []
    for cl in CLUSTERS:
        for tp in (2, 4, 8):
            pick = [r for r in runs if r["cluster"] == cl and tp_of(r["model"]) == tp]
            sweep = {SWEEP[r["label"]]: r["results"]["step_time_s"] for r in pick if r["label"] in SWEEP}
            auto = next((r for r in pick if r["label"] == "monta-auto"), None)
            if not sweep or auto is None:
                continue
            best = min(sweep, key=sweep.get)
            out.append((cl, tp, sweep, auto["results"].get("chunks"), auto["results"]["step_time_s"], best, sweep[best]))
    return out


def figure_selection(summary, plt):
    rows = selection_table(summary)
    print("cluster       tp  " + "  ".join(f"n={n:<3}" for n in sorted(SWEEP.values())) + "  auto  best  miss")
    misses = 0
    for cl, tp, sweep, an, at, bn, bt in rows:
        miss = at / bt - 1
        misses += an != bn
        print(f"{cl:12} {tp:3}  " + "  ".join(f"{1e3 * sweep.get(n, float('nan')):5.1f}" for n in sorted(SWEEP.values()))
              + f"  n={an:<3} n={bn:<3} {100 * miss:+.1f}%")
    print(f"auto picked the sweep's best in {len(rows) - misses} of {len(rows)} points")
    # The layouts (TP degree at EP 16) the model ranks against the simulated GPU time per token
    # of the two-block step (step time · TP / 8192 tokens per TP group).
    for cl in CLUSTERS:
        runs = [r for r in done(summary, "layer") if r["cluster"] == cl and r["label"] == "monta-auto" and tp_of(r["model"])
                and r["model"].endswith(f"tp{tp_of(r['model'])}")]
        sim = {tp_of(r["model"]): r["results"]["step_time_s"] * tp_of(r["model"]) / 8192 for r in runs}
        pred = {}
        for r in runs:
            lay = (r["results"].get("layouts") or {}).get("ranked") or []
            for p in lay:
                if p["ep"] == 16 and p["tp"] in sim:
                    pred[p["tp"]] = p["seconds_per_token"]
        if len(sim) < 2 or len(pred) < 2:
            continue
        best_sim, best_pred = min(sim, key=sim.get), min(pred, key=pred.get)
        print(f"{cl}: TP at EP 16, model's order {sorted(pred, key=pred.get)}, simulated order {sorted(sim, key=sim.get)}"
              f" (step GPU-time per token); pick TP {best_pred}, "
              f"{'the simulated best' if best_pred == best_sim else f'{100 * (sim[best_pred] / sim[best_sim] - 1):+.1f}% against TP {best_sim}'}")
    fig, ax = plt.subplots(figsize=(10, 4.2))
    for k, (cl, tp, sweep, an, at, bn, bt) in enumerate(rows):
        ns = sorted(sweep)
        ax.plot([k + 0.12 * (i - 2) for i in range(len(ns))], [1e3 * sweep[n] / (1e3 * bt) for n in ns], "o", color="#bbbbbb")
        ax.plot(k, at / bt, "*", color=COLOURS["monta-auto"], markersize=12, label="auto's pick" if k == 0 else None)
        ax.text(k, at / bt, f" n={an}", fontsize=7, va="bottom")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{cl}\nTP {tp}" for cl, tp, *_ in rows], fontsize=7)
    ax.set_ylabel("step time / the sweep's best")
    ax.set_title(title(summary, "MoNTA's chunk count: the model's pick (star) among the sweep (grey: 1, 2, 4, 8, 16 chunks)"),
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("figure", choices=["exchange", "breakdown", "selection"])
    ap.add_argument("--summary", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    summary = load(a.summary)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("monta.py: matplotlib is not installed (Debian: apt-get install python3-matplotlib)", file=sys.stderr)
        sys.exit(2)
    fig = {"exchange": figure_exchange, "breakdown": figure_breakdown, "selection": figure_selection}[a.figure](summary, plt)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    tmp = a.out + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, a.out)
    print(f"monta.py: wrote {a.out}")


if __name__ == "__main__":
    main()
