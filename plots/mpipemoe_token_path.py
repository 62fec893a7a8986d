#!/usr/bin/python3
"""plots/mpipemoe_token_path.py — one token through MPipeMoE's pipelined layer, forward and
backward: which buffer holds it after each step, and each arrow's function and stream.

    /usr/bin/python3 plots/mpipemoe_token_path.py [--out impls/mpipemoe/token-path.png]

A drawing of the code (impls/mpipemoe/mpipemoe.cpp, harness/nn/moe_layer.hpp), not of a
result: token t of rank a, routed (top-1) to expert e on rank b, in partition p of n (tokens
[p·T/n, (p+1)·T/n) of rank a). Buffers: T_I [N,M] (rank a, expert-major), T_DI[p mod 2] and
T_M[p mod n_m] (rank b, MPipeMoE's rotating buffers, section III-C), T_DO (rank b), T_O (rank a).
Streams: compute (the backend's default), dispatch and combine (each with its own
communicator), d2h and h2d (host copies). Restore strategies (section III-D): T_DI comes back by
an h2d copy (S1, S3) or by re-running S_p from the kept T_I (S2, S4); T_M by an h2d copy (S1,
S2) or by recomputing FC1 from the restored T_DI (S3, S4).
"""
import argparse
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyBboxPatch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STREAM_COLOURS = {"compute": "#1f77b4", "dispatch": "#d62728", "combine": "#2ca02c", "d2h": "#9467bd",
                  "h2d": "#8c564b"}


BOXES = {}


def box(ax, x, y, text, w=1.9, h=0.62, fc="#f4f4f4", ec="#333333"):
    ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.04", fc=fc, ec=ec, lw=1.0))
    ax.text(x, y, text, ha="center", va="center", fontsize=7.6)
    BOXES[(id(ax), x, y)] = (w, h)


def edge(ax, a, b):
    """The point of box a's border an arrow to box b leaves from: the side facing b."""
    w, h = BOXES.get((id(ax), a[0], a[1]), (0, 0))
    if abs(a[1] - b[1]) < 1e-9:
        return (a[0] + (w / 2 + 0.06) * (1 if b[0] > a[0] else -1), a[1])
    return (a[0], a[1] + (h / 2 + 0.06) * (1 if b[1] > a[1] else -1))


def arrow(ax, a, b, label, stream, dy=0.13, rad=0.0, ha="center"):
    c = STREAM_COLOURS[stream]
    pa, pb = edge(ax, a, b), edge(ax, b, a)
    ax.annotate("", xy=pb, xytext=pa, arrowprops=dict(arrowstyle="-|>", color=c, lw=1.4,
                                                      connectionstyle=f"arc3,rad={rad}", shrinkA=0, shrinkB=0))
    mx, my = (pa[0] + pb[0]) / 2, (pa[1] + pb[1]) / 2 + dy
    ax.text(mx, my, label, ha=ha, va="bottom" if dy >= 0 else "top", fontsize=6.6, color=c)


def lanes(ax, title, host=False):
    ax.set_xlim(-0.3, 16.3)
    ax.set_ylim(-0.2 if host else 0.6, 5.4)
    ax.axis("off")
    ax.set_title(title, fontsize=9.5, weight="bold", loc="left")
    rows = [(3.3, 5.3, "rank a (token t's rank)"), (0.7 if not host else 1.2, 3.1, "rank b (expert e's rank)")]
    if host:
        rows.append((-0.15, 1.0, "pinned host memory of rank b"))
    for y0, y1, name in rows:
        ax.add_patch(plt.Rectangle((-0.25, y0), 16.5, y1 - y0, fc="#fafafa", ec="#dddddd", lw=0.8))
        ax.text(-0.15, y1 - 0.08, name, fontsize=7.2, va="top", color="#666666")


def draw(out):
    fig, (fw, bw) = plt.subplots(2, 1, figsize=(14, 9.6))
    A, B, Hst = 4.2, 2.05, 0.45  # lane centres: rank a, rank b, host

    # ---- forward -------------------------------------------------------------------------
    lanes(fw, "Forward: token t of rank a, routed to expert e on rank b, in partition p of n", host=True)
    box(fw, 0.8, A, "x[t]  [T,M]", w=1.3)
    box(fw, 4.0, A, "T_I row [N,M]\n(in partition p's segment)", w=2.4, h=0.7)
    box(fw, 6.6, B, "T_DI[p mod 2] row\n[r_max,M]", w=1.9, h=0.7)
    box(fw, 9.4, B, "T_M[p mod n_m] row\n[r_max,H]", w=1.9, h=0.7)
    box(fw, 12.0, B, "T_DO row [R_p,M]", w=1.8, h=0.7)
    box(fw, 13.4, A, "T_O row [N,M]", w=1.6)
    box(fw, 15.6, A, "y[t]", w=0.9)
    box(fw, 6.6, Hst, "host_di[p] [R_p,M]", w=1.9, h=0.45, fc="#f3eef8")
    box(fw, 9.4, Hst, "host_m[p] [R_p,H]", w=1.9, h=0.45, fc="#f3eef8")
    arrow(fw, (0.8, A), (4.0, A), "route (gate, top-k),\ndispatch_preprocess (permute)\ncompute", "compute", dy=0.12)
    arrow(fw, (4.0, A), (6.6, B), "dispatch: S_p, all-to-all-v\nof plan_chunks' segments\ndispatch stream", "dispatch",
          dy=0.1, ha="left")
    arrow(fw, (6.6, B), (9.4, B), "expert_fc1: T_DI·W1,\nactivation in place\ncompute", "compute", dy=0.42)
    arrow(fw, (9.4, B), (12.0, B), "experts: FC2,\nact(T_M)·W2\ncompute", "compute", dy=0.42)
    arrow(fw, (12.0, B), (13.4, A), "combine: R_p,\nall-to-all-v back\ncombine stream", "combine", dy=-0.25,
          ha="left")
    arrow(fw, (13.4, A), (15.6, A), "combine_postprocess\n(unpermute × gate w)\ncompute", "compute", dy=0.12)
    arrow(fw, (6.6, B), (6.6, Hst), "  ReuseForward::after (S1, S3)\n  d2h", "d2h", dy=-0.1, ha="left")
    arrow(fw, (9.4, B), (9.4, Hst), "  ReuseForward::after (S1, S2)\n  d2h", "d2h", dy=-0.1, ha="left")
    fw.text(13.0, 0.45, "T_DI[p mod 2] is overwritten by partition p+2,\nT_M[p mod n_m] by p+n_m (memory reuse, "
            "section III-C):\nbackward gets them back by offload or by\nre-communication / recomputation "
            "(section III-D)", fontsize=7, va="center", ha="center", color="#444444")

    # ---- backward ------------------------------------------------------------------------
    lanes(bw, "Backward: the mirror, plus the restore of T_DI and T_M (restore strategy S1–S4)")
    box(bw, 0.8, A, "dy[t]", w=0.9)
    box(bw, 3.2, A, "dT_O row [N,M]", w=1.7)
    box(bw, 5.6, B, "dT_DO row [R_p,M]", w=1.8, h=0.6)
    box(bw, 8.6, 1.15, "T_DI, T_M of p restored\ninto the rotating buffers", w=2.3, h=0.6, fc="#fff6e8")
    box(bw, 11.6, B, "dT_DI row [R_p,M]", w=1.8, h=0.6)
    box(bw, 13.4, A, "dT_I row [N,M]", w=1.6)
    box(bw, 15.5, A, "dx[t]", w=1.0)
    arrow(bw, (0.8, A), (3.2, A), "combine_postprocess\n_backward, compute", "compute", dy=0.12)
    arrow(bw, (3.2, A), (5.6, B), "combine_backward: R'_p,\nall-to-all-v, combine stream", "combine", dy=0.1,
          ha="left")
    bw.text(9.9, 1.15, "ReuseBackward::restore_di: h2d copy (S1, S3) or S_p re-run from\nthe kept T_I on the "
            "dispatch stream (S2, S4); restore_m: h2d copy (S1, S2)\nor expert_fc1 recomputed on compute (S3, S4)",
            fontsize=6.8, ha="left", va="center", color=STREAM_COLOURS["h2d"])
    arrow(bw, (8.6, 1.15), (8.6, B - 0.03), "", "h2d", dy=0)
    arrow(bw, (5.6, B), (11.6, B), "experts_backward: dT_M = (dT_DO·W2ᵀ) ⊙ act'(T_M),\n"
          "dT_DI = dT_M·W1ᵀ; dW2, dW1 accumulate; compute", "compute", dy=0.5)
    arrow(bw, (11.6, B), (13.4, A), "dispatch_backward: S'_p,\nall-to-all-v back\ndispatch stream", "dispatch",
          dy=-0.25, ha="left")
    arrow(bw, (13.4, A), (15.5, A), "dispatch_preprocess\n_backward, route\n_backward, compute", "compute", dy=0.12)

    handles = [plt.Line2D([0], [0], color=c, lw=2, label=f"{s} stream") for s, c in STREAM_COLOURS.items()]
    bw.legend(handles=handles, loc="lower center", ncol=5, fontsize=7.5, frameon=False, bbox_to_anchor=(0.5, -0.1))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    print(f"mpipemoe_token_path.py: wrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", default=os.path.join(ROOT, "impls", "mpipemoe", "token-path.png"))
    draw(ap.parse_args().out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
