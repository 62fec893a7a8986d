#!/usr/bin/env python3
"""Fit the sim backend's GEMM time model to measurements and write calibration files.

The model (harness/sim/cluster.cpp, Topology::gemm_seconds; docs/PERFORMANCE.md, "GEMM
efficiency against size"), for one GEMM [m,k] x [k,n] of a precision with peak P:

    d      = min(m, n, k)
    eff    = gemm_max * d / (d + gemm_half_dim)
    t_gemm = max(2 m n k / (P * eff),  elem_bytes * (m k + k n + m n) / mem_bw)
    t_call = launch_latency + t_gemm        (the sim adds launch_latency as the task's latency)

Free parameters per device: launch_latency (s), and per precision gemm_max and gemm_half_dim.
mem_bw is not fitted: it is the measured device-copy rate of the same GPU.

Fit: least squares on log(t_model / t_measured) (relative errors; every size counts alike),
Levenberg-Marquardt on the logs of the parameters (so they stay positive), pure Python.

Writes experiments/hardware/calibration/h100-sxm5.json and a100-sxm4.json. Run from the
repository root: python3 scripts/fit_gemm_efficiency.py [--check] (--check: fail if the files
on disk differ from what the fit gives).

With --profile, fits one calibration to a `moelab calibrate` profile (moelab.profile/1) instead:

    fit_gemm_efficiency.py --profile P.json (--peaks bf16=989e12,tf32=495e12,fp32=67e12 | --gpu KEY)
                           [--name NAME] --out OUT.json [--check]

--gpu takes the peaks from experiments/hardware/gpus.json; --peaks may name any subset (a cpu
profile: fp32 only). Only precisions with a peak and data get a curve. The loop path of the
profile's gemm_paths (one call per problem, per-problem time = call time / experts), or failing
that its single-GEMM "gemm" samples, gives "curves" and launch_latency (fitted free, jointly over
the precisions with loop figures; a precision with samples only is fitted with it held). The
strided_batched and grouped figures give "paths": one call of E equal problems takes

    t_call = launch_latency + E * max(2 m n k / (P * eff_path), elem_bytes * (m k + k n + m n) / mem_bw)

with launch_latency held. Also written, each when the profile has the data: "gemm_paths" (the
profile's table, verbatim), "copies" (t = latency + bytes / bw per kind, least squares on the
relative error), "interference" (the least alone/together factors of compute beside h2d/d2h copies
and of copies beside compute, the latter capped at 1), "overheads" (copied) and "dispatch"
(permute_bw and unpermute_bw: t = launch_latency + bytes / bw, as the sim prices the op, fitted to the permute and
unpermute samples with launch_latency held; permute_mem_efficiency =
permute_bw / mem_bw; exchange bw and latency fitted like copies) and "activations" (per activation,
direction and dtype, t = launch_latency + elements / elements_per_s, fitted alike). Sections missing from the
profile are named on stdout and left out. Bad input: one line on stderr naming the file and the
field, exit 2, and OUT is left as it was (the file is written whole or not at all).
"""
import argparse
import json
import math
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = "results/measured/cuda/nvidia-h100-80gb-hbm3/peers/cublas-gemm-paths.jsonl"
PROFILE = "results/validation/nvidia-h100-80gb-hbm3/profile.json"
INTERF = "results/measured/cuda/nvidia-h100-80gb-hbm3/peers/torch-interference-and-blocks.jsonl"
OUT = "experiments/hardware/calibration"

# Datasheet peaks (experiments/hardware/gpus.json).
H100 = {"bf16": 989e12, "tf32": 495e12, "fp32": 67e12}
# What a catalogue calibration says of its "hbm_bw" (GemmCalibration::hbm_bw, docs/PERFORMANCE.md).
HBM_BW_NOTE = (" hbm_bw: the {dev} datasheet HBM rate (experiments/hardware/gpus.json), the device mem_bw was taken on; a cluster "
               "of another part of the same architecture scales mem_bw by its GPU's hbm_bw over it (the same fraction of a "
               "faster HBM).")
A100 = {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}
ELEM = {"bf16": 2, "tf32": 4, "fp32": 4}


def model(p, m, n, k, peak, elem, mem_bw):
    launch, gmax, half = p
    d = min(m, n, k)
    eff = gmax * d / (d + half)
    return launch + max(2.0 * m * n * k / (peak * eff), elem * (m * k + k * n + m * n) / mem_bw)


def solve(a, b):
    """Gauss-Jordan; a parameter the residuals do not depend on (a zero column) gets step 0."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for i in range(n):
        piv = max(range(i, n), key=lambda q: abs(m[q][i]))
        m[i], m[piv] = m[piv], m[i]
        if m[i][i] == 0:
            continue
        for q in range(n):
            if q != i:
                f = m[q][i] / m[i][i]
                for c in range(i, n + 1):
                    m[q][c] -= f * m[i][c]
    return [m[i][n] / m[i][i] if m[i][i] else 0.0 for i in range(n)]


def lm(res, p0, free):
    """Levenberg-Marquardt on the residuals res(p) over the logs of the parameters p (they stay
    positive); `free` marks the parameters that are fitted. Returns (p, res(p))."""
    x = [math.log(v) for v in p0]
    idx = [i for i, f in enumerate(free) if f]

    def resx(xv):
        return res([math.exp(v) for v in xv])

    r = resx(x)
    cost = sum(v * v for v in r)
    lam = 1e-3
    for _ in range(500):
        jac = []
        for i in idx:
            xx = list(x)
            xx[i] += 1e-7
            jac.append([(a - b) / 1e-7 for a, b in zip(resx(xx), r)])
        a = [[sum(u * v for u, v in zip(ji, jj)) for jj in jac] for ji in jac]
        g = [sum(u * v for u, v in zip(ji, r)) for ji in jac]
        improved = False
        while lam < 1e10:
            b = [[a[i][j] + (lam * a[i][i] if i == j else 0.0) for j in range(len(idx))] for i in range(len(idx))]
            step = solve(b, [-v for v in g])
            xn = list(x)
            for s, i in zip(step, idx):
                xn[i] += s
            try:
                rn = resx(xn)
                cn = sum(v * v for v in rn)
            except (OverflowError, ZeroDivisionError):  # a step far out of range: a smaller one
                cn = math.inf
            if cn < cost:
                converged = cost - cn < 1e-14 * max(cost, 1e-30)
                x, r, cost = xn, rn, cn
                lam = max(lam / 3, 1e-12)
                improved = not converged
                break
            lam *= 4
        if not improved:
            break
    p = [math.exp(v) for v in x]
    return p, r


def fit(points, peak, elem, mem_bw, p0, free):
    """One precision's curve: least squares on log(t_model / t) over (m, n, k, t) points."""
    return lm(lambda p: [math.log(model(p, m, n, k, peak, elem, mem_bw) / t) for m, n, k, t in points], p0, free)


def summary(r):
    n = len(r)
    return {
        "points": n,
        "rms_log_residual": round(math.sqrt(sum(v * v for v in r) / n), 4),
        "max_abs_log_residual": round(max(abs(v) for v in r), 4),
        "median_abs_relative_error": round(sorted(abs(math.exp(v) - 1) for v in r)[n // 2], 4),
        "max_abs_relative_error": round(max(abs(math.exp(v) - 1) for v in r), 4),
        "note": "residual = log(t_model / t_measured); relative error = t_model / t_measured - 1",
    }


def rd(x, sig=4):
    return float(f"{x:.{sig}g}")


def peer_calls():
    """The cuBLAS microbenchmark's lines (PEERS): op, M, H, E, rows, path, ms, tflops each."""
    with open(os.path.join(ROOT, PEERS)) as f:
        return [json.loads(line) for line in f]


def h100_points():
    """Per-call times of the cublasGemmEx loop: one GEMM per expert, E back-to-back calls."""
    per = {}
    for r in peer_calls():
        if r["path"] != "loop_gemmex":
            continue
        E = r["E"]
        shape = gemm_shape(r["op"], r["M"], r["H"], r["rows"])
        per.setdefault((r["op"],) + shape, []).append((E, r["ms"] * 1e-3 / E))
    points, dropped = [], []
    # A shape is measured at E = 8 and E = 64; a call more than 2x slower than the same
    # shape's other measurement is an outlier of that run (a slow algorithm pick), not a size effect.
    for key, meas in sorted(per.items()):
        for E, t in meas:
            others = [u for e, u in meas if e != E]
            if others and t > 2.0 * min(others):
                dropped.append({"op": key[0], "m": key[1], "n": key[2], "k": key[3], "E": E,
                                "us_per_call": round(t * 1e6, 2), "other_E_us_per_call": round(min(others) * 1e6, 2)})
                continue
            points.append(key[1:] + (t,))
    return points, dropped


def h100_path_calls(path):
    """Per-call times of one batched path (strided_batched, grouped_1group): (m, n, k, E, seconds)."""
    return [gemm_shape(r["op"], r["M"], r["H"], r["rows"]) + (r["E"], r["ms"] * 1e-3)
            for r in peer_calls() if r["path"] == path]


def h100_path_table():
    """The crossover table of the same microbenchmark, in a profile's gemm_paths format: per op,
    shape, experts and rows, the TFLOP/s of the loop, the strided batch and the grouped call (one
    group of E problems, as the layer issues it). The cuda backend's built-in table
    (harness/runtime/gemm_paths.cpp, default_gemm_path_table) holds the same figures."""
    key_of = {"loop_gemmex": "loop", "strided_batched": "strided_batched", "grouped_1group": "grouped"}
    points = {}
    for r in peer_calls():
        if r["path"] not in key_of:
            continue
        k = (OPS.index(r["op"]), r["M"], r["H"], r["E"], r["rows"])
        points.setdefault(k, {})[key_of[r["path"]]] = r["tflops"]
    return {
        "source": f"measured on one NVIDIA H100 80GB HBM3, cuBLAS 13, bf16 (fp32 accumulate): a loop of cublasGemmEx, "
                  f"cublasGemmStridedBatchedEx and cublasGemmGroupedBatchedEx (one group) over the experts' fwd/dgrad/wgrad "
                  f"GEMMs, d_model/d_hidden 768/3072 and 2048/8192, 8 and 64 experts, 64-8192 rows each, median of 20 ({PEERS})",
        "points": [{"precision": "bf16", "op": OPS[o], "d_model": M, "d_hidden": H, "experts": E, "rows": rows_,
                    "tflops": {q: v[q] for q in PATHS if q in v}}
                   for (o, M, H, E, rows_), v in sorted(points.items())],
    }


def profile_points(dtype):
    p = json.load(open(os.path.join(ROOT, PROFILE)))
    return [(s["m"], s["n"], s["k"], s["seconds"]) for s in p["gemm"] if s["dtype"] == dtype], p


def residuals(points, p, peak, elem, mem_bw):
    return [math.log(model(p, m, n, k, peak, elem, mem_bw) / t) for m, n, k, t in points]


def interference():
    first = json.loads(open(os.path.join(ROOT, INTERF)).readline())
    slow = max(first["d2h"]["gemm_slowdown_with_copy"], first["h2d"]["gemm_slowdown_with_copy"])
    copy_keep = min(1.0, min(first[d]["copy_GBps_with_gemm"] / first[d]["copy_GBps_alone"] for d in ("d2h", "h2d")))
    return slow, copy_keep, first


def build():
    prof_bf16, prof = profile_points("bf16")
    prof_fp32, _ = profile_points("fp32")
    mem_bw = prof["d2d_bw"]
    launch_profile = prof["launch_latency"]
    points, dropped = h100_points()

    # H100 bf16: launch latency, gemm_max and gemm_half_dim from the cuBLAS loop.
    p_bf16, r_bf16 = fit(points, H100["bf16"], ELEM["bf16"], mem_bw, [7e-6, 0.9, 128], [True, True, True])
    launch = p_bf16[0]
    # H100 strict fp32: the profile's fp32 samples, the launch latency held at the bf16 fit's.
    p_fp32, r_fp32 = fit(prof_fp32, H100["fp32"], ELEM["fp32"], mem_bw, [launch, 0.8, 128], [False, True, True])
    val_bf16 = residuals(prof_bf16, p_bf16, H100["bf16"], ELEM["bf16"], mem_bw)

    slow, copy_keep, interf = interference()

    # The batched paths of the same microbenchmark: one call of E equal problems, launch held.
    paths, path_stats = {}, {}
    for q, name in (("strided_batched", "strided_batched"), ("grouped", "grouped_1group")):
        pts = h100_path_calls(name)
        pp, rr = lm(lambda v: [math.log(call_model(v, m, n, k, E, H100["bf16"], ELEM["bf16"], mem_bw) / t)
                               for m, n, k, E, t in pts], [launch, 0.8, 128.0], [False, True, True])
        paths[q] = {"bf16": {"gemm_max": rd(pp[1]), "gemm_half_dim": rd(pp[2])}}
        path_stats[q] = {"bf16": dict(summary(rr), data=f"{PEERS}, path {name}")}

    h100 = {
        "schema": "moelab.gemm_calibration/1",
        "name": "h100-sxm5",
        "device": "NVIDIA H100 80GB HBM3 (SXM5, 700 W)",
        "model": "t_call = launch_latency + max(2mnk / (peak(precision) * eff), elem_bytes * (mk + kn + mn) / mem_bw); "
                 "eff = gemm_max * d / (d + gemm_half_dim), d = min(m, n, k) (docs/PERFORMANCE.md, \"GEMM efficiency against size\")",
        "launch_latency": rd(launch),
        "mem_bw": rd(mem_bw),
        "hbm_bw": 3350e9,  # experiments/hardware/gpus.json H100-SXM5-80GB
        "curves": {
            "bf16": {
                "gemm_max": rd(p_bf16[1]), "gemm_half_dim": rd(p_bf16[2]),
                "source": f"Least-squares fit to {len(points)} per-call times of a cublasGemmEx loop ({PEERS}, path loop_gemmex: "
                          "fwd/dgrad/wgrad of rows 64..8192 x 768/3072 and 2048/8192, 8 and 64 experts); launch_latency fitted with it.",
            },
            "fp32": {
                "gemm_max": rd(p_fp32[1]), "gemm_half_dim": rd(p_fp32[2]),
                "source": f"Least-squares fit to the {len(prof_fp32)} strict-fp32 GEMM samples of {PROFILE} (moelab calibrate, cuBLAS), "
                          "launch_latency held at the bf16 fit's.",
            },
            "tf32": {
                "gemm_max": rd(p_bf16[1]), "gemm_half_dim": rd(p_bf16[2]),
                "gemm_half_dim_range": [64, 512],
                "source": "No TF32 GEMM is measured on this GPU in the repository: the bf16 fit's curve, applied to the TF32 peak "
                          "(a proxy; gemm_half_dim is a swept parameter within gemm_half_dim_range).",
            },
        },
        "paths": {
            "source": f"Least-squares fits to the cublasGemmStridedBatchedEx and cublasGemmGroupedBatchedEx (one group) "
                      f"per-call times of {PEERS} (96 calls each), launch_latency held at the loop fit's. bf16 only: no "
                      f"TF32 or strict-fp32 call of these paths is measured, so such calls are priced as the loop.",
            "model": "one call of E equal problems on a path: t_call = launch_latency + E * max(2mnk / (peak(precision) * eff_path), "
                     "elem_bytes * (mk + kn + mn) / mem_bw), eff_path = gemm_max_path * d / (d + gemm_half_dim_path), d = min(m, n, k); "
                     "the loop path (one call per problem) is \"curves\"",
            **paths,
            "fit": path_stats,
        },
        "gemm_paths": h100_path_table(),
        "fit": {
            "method": "Levenberg-Marquardt least squares on log(t_model / t_measured) over the parameters' logs (scripts/fit_gemm_efficiency.py)",
            "data": [PEERS, PROFILE],
            "peaks": "experiments/hardware/gpus.json H100-SXM5-80GB: bf16 989e12, tf32 495e12, fp32 67e12 FLOP/s",
            "mem_bw_source": f"{PROFILE} d2d_bw (a device-to-device copy, bytes read + written per second)." + HBM_BW_NOTE.format(dev="H100-SXM5-80GB"),
            "bf16": summary(r_bf16),
            "bf16_dropped_outliers": dropped,
            "bf16_validation_on_profile_samples": dict(summary(val_bf16), data=PROFILE,
                                                      note="not fitted: the moelab calibrate bf16 samples, predicted by the bf16 curve"),
            "fp32": summary(r_fp32),
            "launch_latency_profile": rd(launch_profile),
            "launch_latency_note": f"{PROFILE} measures {launch_profile * 1e6:.2f} us per launch (200 back-to-back tiny kernels); "
                                   f"the fit's per-call floor is {launch * 1e6:.2f} us",
        },
        "interference_measured": {
            "data": INTERF,
            "gemm_slowdown_with_copy": {"d2h": rd(interf["d2h"]["gemm_slowdown_with_copy"]), "h2d": rd(interf["h2d"]["gemm_slowdown_with_copy"])},
            "compute_beside_memcpy": rd(1.0 / slow),
            "memcpy_beside_compute": rd(copy_keep),
            "note": "compute_beside_memcpy = 1 / the larger GEMM slowdown beside 1 GiB pinned copies; memcpy_beside_compute = "
                    "copy GB/s with GEMM / alone, capped at 1 (the copies did not slow)",
        },
        "source": "Measured on one H100 80GB HBM3 (results/measured/cuda/nvidia-h100-80gb-hbm3/peers/README.md); fitted by scripts/fit_gemm_efficiency.py.",
    }

    # A100: public measurements.
    # (a) Strict fp32, square GEMMs m = n = k = 512 .. 8192, cupyx.time.repeat GPU times on an A100
    #     (https://github.com/cupy/cupy/pull/3810, comment by anaruse, "compute_type: None").
    a100_fp32 = [(512, 512, 512, 54.128e-6), (1024, 1024, 1024, 209.142e-6), (2048, 2048, 2048, 1438.858e-6),
                 (4096, 4096, 4096, 10256.822e-6), (8192, 8192, 8192, 64494.774e-6)]
    # (b) TF32: one 10240^3 GEMM in 0.016 s on an A100 (PyTorch docs, notes/cuda.rst, "TensorFloat-32 (TF32) on
    #     Ampere (and later) devices"; https://github.com/pytorch/pytorch/pull/40800).
    a100_tf32 = [(10240, 10240, 10240, 0.016)]
    a100_mem_bw = 1555e9 * 0.9  # see "mem_bw_source"
    p_a_fp32, r_a_fp32 = fit(a100_fp32, A100["fp32"], ELEM["fp32"], a100_mem_bw, [launch, 0.9, 128], [False, True, True])
    half_tf32 = p_bf16[2]
    # gemm_max from the one large point with the half-size held at the proxy: t = L + 2mnk / (P gmax d/(d+h)).
    m = n = k = 10240
    t = a100_tf32[0][3]
    gmax_tf32 = 2.0 * m * n * k / (A100["tf32"] * (t - launch)) * (k + half_tf32) / k
    r_a_tf32 = residuals(a100_tf32, [launch, gmax_tf32, half_tf32], A100["tf32"], ELEM["tf32"], a100_mem_bw)

    a100 = {
        "schema": "moelab.gemm_calibration/1",
        "name": "a100-sxm4",
        "device": "NVIDIA A100-SXM4 (40GB and 80GB; A800-SXM4 has the same SMs and clocks)",
        "model": h100["model"],
        "launch_latency": rd(launch),
        "mem_bw": rd(a100_mem_bw),
        "hbm_bw": 1555e9,  # experiments/hardware/gpus.json A100-SXM4-40GB
        "curves": {
            "tf32": {
                "gemm_max": rd(gmax_tf32), "gemm_half_dim": rd(half_tf32),
                "gemm_half_dim_range": [64, 512],
                "source": "gemm_max: a 10240^3 fp32 matmul on an A100 takes 0.016 s with TF32 (PyTorch documentation, notes/cuda.rst, "
                          "'TensorFloat-32 (TF32) on Ampere (and later) devices', https://pytorch.org/docs/stable/notes/cuda.html; "
                          "added in https://github.com/pytorch/pytorch/pull/40800): one point, solved for gemm_max with gemm_half_dim "
                          "held. gemm_half_dim: no public A100 TF32 measurement against size was found; the H100 bf16 fit's value is "
                          "used as a proxy and is a swept parameter within gemm_half_dim_range.",
            },
            "fp32": {
                "gemm_max": rd(p_a_fp32[1]), "gemm_half_dim": rd(p_a_fp32[2]),
                "source": "Least-squares fit to 5 square strict-fp32 GEMMs (512..8192) timed on an A100 with cupyx.time.repeat "
                          "(GPU times; https://github.com/cupy/cupy/pull/3810, results attached by the author, 'compute_type: None'). "
                          "Five points: the curve is only as good as that.",
            },
            "bf16": {
                "gemm_max": rd(p_bf16[1]), "gemm_half_dim": rd(p_bf16[2]),
                "gemm_half_dim_range": [64, 512],
                "source": "No public A100 bf16 GEMM measurement against size was found: the H100 bf16 fit's curve applied to the A100's "
                          "bf16 peak (a proxy; gemm_half_dim is a swept parameter within gemm_half_dim_range).",
            },
        },
        "fit": {
            "method": h100["fit"]["method"],
            "data": ["https://github.com/cupy/cupy/pull/3810", "https://pytorch.org/docs/stable/notes/cuda.html"],
            "peaks": "experiments/hardware/gpus.json A100-SXM4-40GB: bf16 312e12, tf32 156e12, fp32 19.5e12 FLOP/s",
            "mem_bw_source": "0.9 x the A100-SXM4-40GB datasheet HBM rate 1555 GB/s (the fraction a device copy reached on the H100: "
                             "2.70 of 3.35 TB/s is 0.81, on H100 and H200 about 0.9 per docs/PERFORMANCE.md); only the roofline term "
                             "of small GEMMs uses it." + HBM_BW_NOTE.format(dev="A100-SXM4-40GB"),
            "fp32": summary(r_a_fp32),
            "fp32_points": [{"m": m, "n": n, "k": k, "seconds": t} for m, n, k, t in a100_fp32],
            "tf32": dict(summary(r_a_tf32), note="one point, solved exactly"),
            "launch_latency_note": "no public A100 per-launch figure found: the H100 fit's (the same CUDA launch path; a proxy)",
        },
        "source": "Public A100 measurements (see each curve); fitted by scripts/fit_gemm_efficiency.py.",
    }
    return h100, a100


# --- Fitting a calibration to a `moelab calibrate` profile (--profile) -------------------------

PROFILE_SCHEMA = "moelab.profile/1"
PRECISIONS = ("bf16", "tf32", "fp32")
OPS = ("fwd", "dgrad", "wgrad")
PATHS = ("loop", "strided_batched", "grouped")
COPY_KINDS = ("h2d", "d2h", "d2d")
INTERF_SIDES = ("compute", "h2d", "d2h")
DISPATCH_OPS = ("permute", "unpermute", "exchange")
ACTIVATIONS = ("gelu", "relu", "gelu_tanh")
DIRECTIONS = ("forward", "backward")
ACT_DTYPES = ("fp32", "bf16")
GPUS = "experiments/hardware/gpus.json"
PROG = "fit_gemm_efficiency.py"
# The range a calibration's curve may take (harness/config/limits.hpp: kMinFraction, kMaxGemmHalfDim).
MIN_GEMM_MAX = 1e-3
MAX_HALF_DIM = 1 << 20


class BadInput(Exception):
    """One line for the user: `field` names the offending field (None: the file itself)."""

    def __init__(self, field, what):
        super().__init__(f"field {field}: {what}" if field else what)


def _kind(v):
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    return {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number"}[type(v)]


def _show(v):
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."


def get_number(obj, key, where, positive=True, required=True):
    """A finite number; positive (> 0) or else non-negative. None when absent and not required."""
    field = where + key
    if key not in obj:
        if required:
            raise BadInput(field, "missing")
        return None
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadInput(field, f"expected a number, got {_kind(v)} {_show(v)}")
    if not math.isfinite(v) or (v <= 0 if positive else v < 0):
        raise BadInput(field, f"expected a {'positive' if positive else 'non-negative'} number, got {_show(v)}")
    return float(v)


def get_int(obj, key, where):
    field = where + key
    if key not in obj:
        raise BadInput(field, "missing")
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 1:
        raise BadInput(field, f"expected a positive integer, got {_kind(v)} {_show(v)}")
    return int(v)


def get_choice(obj, key, where, choices):
    field = where + key
    if key not in obj:
        raise BadInput(field, "missing")
    v = obj[key]
    if not isinstance(v, str):
        raise BadInput(field, f"expected a string, got {_kind(v)} {_show(v)}")
    if v not in choices:
        raise BadInput(field, f"{_show(v)} is not one of {', '.join(choices)}")
    return v


def get_list(obj, key, what):
    """A present array of objects, or None when the key is absent."""
    if key not in obj:
        return None
    v = obj[key]
    if not isinstance(v, list):
        raise BadInput(key, f"expected an array of {what}, got {_kind(v)}")
    for i, e in enumerate(v):
        if not isinstance(e, dict):
            raise BadInput(f"{key}[{i}]", f"expected an object ({what}), got {_kind(e)} {_show(e)}")
    return v


def gemm_shape(op, d_model, d_hidden, rows):
    """(m, n, k) of one expert's GEMM C[m,n] = A[m,k] B[k,n] for a gemm_paths point."""
    return {"fwd": (rows, d_hidden, d_model), "dgrad": (rows, d_model, d_hidden), "wgrad": (d_model, d_hidden, rows)}[op]


def read_profile(path):
    """The profile's figures, checked: raises BadInput naming the field on anything malformed."""
    try:
        with open(path) as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(None, f"cannot read: {getattr(e, 'strerror', None) or e}")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(None, f"not JSON: {e}")
    if not isinstance(doc, dict):
        raise BadInput(None, f"expected a JSON object at the top level, got {_kind(doc)}")
    if doc.get("schema") != PROFILE_SCHEMA:
        raise BadInput("schema", f"expected {json.dumps(PROFILE_SCHEMA)}, got "
                                 f"{_show(doc['schema']) if 'schema' in doc else 'none'}")
    if not isinstance(doc.get("device"), str):
        raise BadInput("device", "missing" if "device" not in doc else f"expected a string, got {_kind(doc['device'])}")
    prof = {"raw": doc, "device": doc["device"], "missing": []}
    prof["d2d_bw"] = get_number(doc, "d2d_bw", "")
    prof["launch_latency"] = get_number(doc, "launch_latency", "", required=False)

    prof["gemm"] = []
    for i, s in enumerate(get_list(doc, "gemm", "GEMM samples") or []):
        w = f"gemm[{i}]."
        prof["gemm"].append((get_choice(s, "dtype", w, PRECISIONS), get_int(s, "m", w), get_int(s, "n", w),
                             get_int(s, "k", w), get_number(s, "seconds", w)))

    prof["points"] = None
    if "gemm_paths" in doc:
        gp = doc["gemm_paths"]
        if not isinstance(gp, dict):
            raise BadInput("gemm_paths", f"expected an object, got {_kind(gp)}")
        pts = gp.get("points")
        if not isinstance(pts, list):
            raise BadInput("gemm_paths.points", "missing" if "points" not in gp else f"expected an array, got {_kind(pts)}")
        prof["points"] = []
        for i, p in enumerate(pts):
            w = f"gemm_paths.points[{i}]."
            if not isinstance(p, dict):
                raise BadInput(w[:-1], f"expected an object, got {_kind(p)} {_show(p)}")
            pt = {"precision": get_choice(p, "precision", w, PRECISIONS), "op": get_choice(p, "op", w, OPS)}
            for key in ("d_model", "d_hidden", "experts", "rows"):
                pt[key] = get_int(p, key, w)
            tf = p.get("tflops")
            if not isinstance(tf, dict):
                raise BadInput(w + "tflops", "missing" if "tflops" not in p else f"expected an object, got {_kind(tf)}")
            pt["tflops"] = {path: get_number(tf, path, w + "tflops.", positive=False, required=False) or 0.0
                            for path in PATHS}
            if not any(pt["tflops"].values()):
                raise BadInput(w + "tflops", "no path measured (every figure 0 or absent)")
            prof["points"].append(pt)
    else:
        prof["missing"].append("gemm_paths")

    prof["copies"] = None
    copies = get_list(doc, "copies", "copy samples")
    if copies is None:
        prof["missing"].append("copies")
    else:
        prof["copies"] = [(get_choice(c, "kind", f"copies[{i}].", COPY_KINDS), get_number(c, "bytes", f"copies[{i}]."),
                           get_number(c, "seconds", f"copies[{i}].")) for i, c in enumerate(copies)]

    prof["overheads"] = None
    if "overheads" in doc:
        ov = doc["overheads"]
        if not isinstance(ov, dict):
            raise BadInput("overheads", f"expected an object, got {_kind(ov)}")
        for key in ov:
            get_number(ov, key, "overheads.", positive=False)
        prof["overheads"] = ov
    else:
        prof["missing"].append("overheads")

    prof["interference"] = None
    inter = get_list(doc, "interference", "interference samples")
    if inter is None:
        prof["missing"].append("interference")
    else:
        prof["interference"] = []
        for i, e in enumerate(inter):
            w = f"interference[{i}]."
            victim, aggressor = get_choice(e, "victim", w, INTERF_SIDES), get_choice(e, "aggressor", w, INTERF_SIDES)
            alone = get_number(e, "alone_s", w, required=False)
            together = get_number(e, "together_s", w, required=False)
            factor = get_number(e, "factor", w, required=alone is None or together is None)
            prof["interference"].append((victim, aggressor, factor if factor is not None else alone / together))

    prof["dispatch"] = None
    disp = get_list(doc, "dispatch", "dispatch samples")
    if disp is None:
        prof["missing"].append("dispatch")
    else:
        prof["dispatch"] = []
        for i, e in enumerate(disp):
            w = f"dispatch[{i}]."
            op = get_choice(e, "op", w, DISPATCH_OPS)
            if op == "exchange":
                get_int(e, "ranks", w)
            prof["dispatch"].append((op, get_number(e, "bytes", w), get_number(e, "seconds", w),
                                     e.get("ranks")))

    prof["activations"] = None
    acts = get_list(doc, "activations", "activation samples")
    if acts is None:
        prof["missing"].append("activations")
    else:
        prof["activations"] = []
        for i, e in enumerate(acts):
            w = f"activations[{i}]."
            prof["activations"].append((get_choice(e, "activation", w, ACTIVATIONS), get_choice(e, "direction", w, DIRECTIONS),
                                        get_choice(e, "dtype", w, ACT_DTYPES), get_number(e, "elements", w),
                                        get_number(e, "seconds", w)))
    return prof


def parse_peaks(text):
    peaks = {}
    for item in text.split(","):
        key, eq, val = item.strip().partition("=")
        if not eq or key not in PRECISIONS:
            raise BadInput(None, f"--peaks: {_show(item)} is not precision=FLOP/s with precision one of {', '.join(PRECISIONS)}")
        try:
            v = float(val)
        except ValueError:
            v = float("nan")
        if not (math.isfinite(v) and v > 0):
            raise BadInput(None, f"--peaks: {key}: expected a positive number of FLOP/s, got {_show(val)}")
        peaks[key] = v
    return peaks


def gpu_peaks(key):
    path = os.path.join(ROOT, GPUS)
    gpus = json.load(open(path))["gpus"]
    if key not in gpus:
        raise BadInput(None, f"--gpu: {_show(key)} is not a GPU of {GPUS} (known: {', '.join(sorted(gpus))})")
    return {p: float(gpus[key][f"flops_{p}"]) for p in PRECISIONS if gpus[key].get(f"flops_{p}")}


def flops_text(v):
    return f"{v / 1e12:g}e12"


def call_model(p, m, n, k, experts, peak, elem, mem_bw):
    """One call of `experts` equal problems on a batched path: launch + E * max(compute, memory)."""
    launch, gmax, half = p
    d = min(m, n, k)
    eff = gmax * d / (d + half)
    return launch + experts * max(2.0 * m * n * k / (peak * eff), elem * (m * k + k * n + m * n) / mem_bw)


def fit_linear_latency(samples):
    """t = latency + bytes / bw, least squares on the relative error t_model / t - 1 (linear in latency
    and 1/bw). Returns (bw, latency, log residuals) or None when the samples cannot give both."""
    if len({b for b, _ in samples}) < 2:
        return None
    # Minimise sum (lat / t + b * inv / t - 1)^2 over lat, inv.
    s11 = sum(1 / t ** 2 for _, t in samples)
    s12 = sum(b / t ** 2 for b, t in samples)
    s22 = sum(b * b / t ** 2 for b, t in samples)
    r1 = sum(1 / t for _, t in samples)
    r2 = sum(b / t for b, t in samples)
    det = s11 * s22 - s12 * s12
    lat = (r1 * s22 - r2 * s12) / det
    inv = (s11 * r2 - s12 * r1) / det
    if lat < 0:  # no latency to be seen: the rate alone
        lat, inv = 0.0, r2 / s22
    if inv <= 0:
        return None
    return 1 / inv, lat, [math.log((lat + b * inv) / t) for b, t in samples]


def fit_rate_held(samples, latency):
    """t = latency + x / rate with the latency held (the calibration's launch latency, which the sim
    charges every op): least squares on the relative error, closed form in 1 / rate. Returns
    (rate, log residuals), or None when the latency alone exceeds the times."""
    den = sum(x * x / t ** 2 for x, t in samples)
    inv = sum(x / t * (1 - latency / t) for x, t in samples) / den if den > 0 else 0
    if inv <= 0:
        return None
    return 1 / inv, [math.log((latency + x * inv) / t) for x, t in samples]


def describe_points(pts):
    ops = sorted({p["op"] for p in pts}, key=OPS.index)
    rows = sorted({p["rows"] for p in pts})
    sizes = sorted({(p["d_model"], p["d_hidden"]) for p in pts})
    experts = sorted({p["experts"] for p in pts})
    return (f"{'/'.join(ops)} of rows {rows[0]}..{rows[-1]} x " + ", ".join(f"{a}/{b}" for a, b in sizes) +
            f", {'/'.join(str(e) for e in experts)} experts")


def build_from_profile(path, peaks, peaks_text, name):
    """The calibration document for a profile, and lines to print."""
    prof = read_profile(path)
    notes = []
    mem_bw = prof["d2d_bw"]
    points = prof["points"] or []

    loop, batched, samples = {}, {q: {} for q in PATHS[1:]}, {}
    for pt in points:
        m, n, k = gemm_shape(pt["op"], pt["d_model"], pt["d_hidden"], pt["rows"])
        flops = 2.0 * m * n * k
        E = pt["experts"]
        for q in PATHS:
            tf = pt["tflops"][q]
            if not tf:
                continue
            call = E * flops / (tf * 1e12)
            if q == "loop":
                loop.setdefault(pt["precision"], []).append(((m, n, k, call / E), pt))
            else:
                batched[q].setdefault(pt["precision"], []).append(((m, n, k, E, call), pt))
    for dtype, m, n, k, t in prof["gemm"]:
        samples.setdefault(dtype, []).append((m, n, k, t))

    fitted = [p for p in PRECISIONS if p in peaks and (p in loop or p in samples)]
    for p in PRECISIONS:
        if p in peaks and p not in fitted:
            notes.append(f"{p}: a peak but no GEMM data in the profile: no curve")
        if p not in peaks and (p in loop or p in samples):
            notes.append(f"{p}: GEMM data but no peak given: no curve")
    if not fitted:
        raise BadInput("gemm", "no GEMM samples or gemm_paths loop figures for any precision with a peak "
                               f"({', '.join(p for p in PRECISIONS if p in peaks)})")

    # The loop path (one call per problem): launch_latency free, jointly over the precisions
    # with loop figures; without any, over the single-GEMM samples.
    base = [p for p in fitted if p in loop] or fitted
    data = {p: ([x for x, _ in loop[p]] if p in loop else samples[p]) for p in fitted}
    launch0 = prof["launch_latency"] or 5e-6

    def joint(par):
        out = []
        for i, p in enumerate(base):
            out += [math.log(model([par[0], par[1 + 2 * i], par[2 + 2 * i]], m, n, k, peaks[p], ELEM[p], mem_bw) / t)
                    for m, n, k, t in data[p]]
        return out

    par, r = lm(joint, [launch0] + [0.8, 128.0] * len(base), [True] * (1 + 2 * len(base)))
    launch = par[0]
    curves, stats, res = {}, {}, {}
    at = 0
    for i, p in enumerate(base):
        curves[p] = (par[1 + 2 * i], par[2 + 2 * i])
        res[p] = r[at:at + len(data[p])]
        at += len(data[p])
    for p in fitted:
        if p not in base:
            pp, res[p] = fit(data[p], peaks[p], ELEM[p], mem_bw, [launch, 0.8, 128.0], [False, True, True])
            curves[p] = (pp[1], pp[2])

    def compute_bound(pts, peak, elem, gmax, half):
        """How many of (m, n, k, ...) points the compute term binds at the fitted curve."""
        return sum(1 for m, n, k, *_ in pts
                   if 2.0 * m * n * k / (peak * gmax * min(m, n, k) / (min(m, n, k) + half)) >
                   elem * (m * k + k * n + m * n) / mem_bw)

    def unusable(pts, peak, elem, gmax, half):
        """Why a fitted curve is no curve (None when it is one)."""
        if compute_bound(pts, peak, elem, gmax, half) < 2:
            return "fewer than two of its GEMMs are compute-bound (the rest move memory): the curve is not determined"
        if not (MIN_GEMM_MAX <= gmax <= 1.0 and half <= MAX_HALF_DIM):
            return (f"the fit gives gemm_max {rd(gmax)}, gemm_half_dim {rd(half)}, outside what a calibration accepts "
                    f"(gemm_max in [{MIN_GEMM_MAX:g}, 1], gemm_half_dim at most {MAX_HALF_DIM}; is the peak "
                    f"{flops_text(peak)} FLOP/s right?)")
        return None

    doc_curves = {}
    for p in list(fitted):
        gmax, half = curves[p]
        why = unusable(data[p], peaks[p], ELEM[p], gmax, half)
        if why:
            notes.append(f"{p}: {why}: no curve")
            fitted.remove(p)
            continue
        if p in loop:
            pts = [pt for _, pt in loop[p]]
            src = (f"Least-squares fit to {len(pts)} per-problem times of the loop path (one call per problem) of "
                   f"{path}'s gemm_paths ({describe_points(pts)}; per-problem time = call time / experts)")
        else:
            src = f"Least-squares fit to the {len(samples[p])} {p} GEMM samples of {path} (moelab calibrate, one call each)"
        if p in base:
            others = [q for q in base if q != p]
            src += "; launch_latency fitted with it" + (f" (jointly with the {', '.join(others)} curve)" if others else "") + "."
        else:
            src += ", launch_latency held at the loop fit's."
        doc_curves[p] = {"gemm_max": rd(gmax), "gemm_half_dim": rd(half), "source": src}
        stats[p] = summary(res[p])
        if p in loop and p in samples:
            val = residuals(samples[p], [launch, gmax, half], peaks[p], ELEM[p], mem_bw)
            stats[f"{p}_validation_on_gemm_samples"] = dict(
                summary(val), note=f"not fitted: the profile's {p} single-GEMM samples, predicted by the {p} curve")

    if not doc_curves:
        raise BadInput("gemm", "no precision with a peak gives a curve (" +
                       "; ".join(n for n in notes if n.endswith(": no curve")) + ")")
    doc = {
        "schema": "moelab.gemm_calibration/1",
        "name": name,
        "device": prof["device"],
        "model": "t_call = launch_latency + max(2mnk / (peak(precision) * eff), elem_bytes * (mk + kn + mn) / mem_bw); "
                 "eff = gemm_max * d / (d + gemm_half_dim), d = min(m, n, k) (docs/PERFORMANCE.md, \"GEMM efficiency against size\")",
        "launch_latency": rd(launch),
        "mem_bw": rd(mem_bw),
        "curves": doc_curves,
    }
    fit_doc = {
        "method": "Levenberg-Marquardt least squares on log(t_model / t_measured) over the parameters' logs (scripts/fit_gemm_efficiency.py)",
        "data": [path],
        "peaks": peaks_text,
        "mem_bw_source": f"{path} d2d_bw (a device-to-device copy, bytes read + written per second)",
    }
    fit_doc.update(stats)
    if prof["launch_latency"] is not None:
        fit_doc["launch_latency_profile"] = rd(prof["launch_latency"])

    # Batched paths: one call of E equal problems, launch_latency held.
    paths, path_stats = {}, {}
    for q in PATHS[1:]:
        for p in PRECISIONS:
            if p not in batched[q]:
                continue
            if p not in peaks:
                notes.append(f"{q} {p}: figures but no peak given: no curve")
                continue
            pts = [x for x, _ in batched[q][p]]
            pp, rr = lm(lambda v: [math.log(call_model(v, m, n, k, E, peaks[p], ELEM[p], mem_bw) / t)
                                   for m, n, k, E, t in pts], [launch, 0.8, 128.0], [False, True, True])
            why = unusable(pts, peaks[p], ELEM[p], pp[1], pp[2])
            if why:
                notes.append(f"{q} {p}: {why}: left out")
                continue
            paths.setdefault(q, {})[p] = {"gemm_max": rd(pp[1]), "gemm_half_dim": rd(pp[2])}
            path_stats.setdefault(q, {})[p] = summary(rr)
    if paths:
        doc["paths"] = {
            "source": f"Least-squares fits to the strided_batched and grouped figures of {path}'s gemm_paths, "
                      "launch_latency held at the loop fit's.",
            "model": "one call of E equal problems on a path: t_call = launch_latency + E * max(2mnk / (peak(precision) * eff_path), "
                     "elem_bytes * (mk + kn + mn) / mem_bw), eff_path = gemm_max_path * d / (d + gemm_half_dim_path), d = min(m, n, k); "
                     "the loop path (one call per problem) is \"curves\"",
            **paths,
            "fit": path_stats,
        }
    elif points:
        notes.append("gemm_paths: no strided_batched or grouped figures for a precision with a peak: no \"paths\" "
                     "and no table (every call is priced as the loop)")
    # The table comes with the curves of the paths it chooses (a calibration holds both or
    # neither, harness/sim/cluster.cpp): a profile of the loop alone gives only "curves".
    if prof["points"] is not None and paths:
        doc["gemm_paths"] = prof["raw"]["gemm_paths"]

    if prof["copies"] is not None:
        copies, cstats = {}, {}
        for kind in COPY_KINDS:
            got = fit_linear_latency([(b, t) for k2, b, t in prof["copies"] if k2 == kind])
            if got is None:
                notes.append(f"copies {kind}: fewer than two sizes (or times that do not grow with size): not fitted")
                continue
            copies[kind] = {"bw": rd(got[0]), "latency": rd(got[1])}
            cstats[kind] = summary(got[2])
        if copies:
            doc["copies"] = dict(copies, source=f"Least-squares fit (relative errors) of t = latency + bytes / bw to the copy "
                                                f"size sweep of {path} (bytes copied one way)", fit=cstats)

    if prof["interference"] is not None:
        cm = [f for v, a, f in prof["interference"] if v == "compute" and a in ("h2d", "d2h")]
        mc = [f for v, a, f in prof["interference"] if v in ("h2d", "d2h") and a == "compute"]
        inter = {}
        if cm:
            inter["compute_beside_memcpy"] = rd(min(1.0, min(cm)))  # > 1 is noise; the cluster needs (0, 1]
        if mc:
            inter["memcpy_beside_compute"] = rd(min(1.0, min(mc)))
        if inter:
            inter["source"] = (f"{path} interference (factor = time alone / time together): compute_beside_memcpy the least over "
                               "the compute victim beside h2d/d2h copies, memcpy_beside_compute the least over h2d/d2h victims "
                               "beside compute, each capped at 1")
            doc["interference"] = inter
        else:
            notes.append("interference: no compute/copy pair: not fitted")

    if prof["overheads"] is not None:
        doc["overheads"] = dict(prof["overheads"], source=f"{path} overheads (copied)")

    if prof["dispatch"] is not None:
        disp, dstats = {}, {}
        for kind in ("permute", "unpermute"):
            perm = [(b, t) for op, b, t, _ in prof["dispatch"] if op == kind]
            got = fit_rate_held(perm, launch) if perm else None
            if got:
                bw, res = got
                disp[f"{kind}_bw"] = rd(bw)
                disp[f"{kind}_mem_efficiency"] = rd(bw / mem_bw)
                dstats[kind] = summary(res)
            elif perm:
                notes.append(f"dispatch: the {kind} samples take less than the launch latency: not fitted")
            else:
                notes.append(f"dispatch: no {kind} samples")
        exch = [(b, t) for op, b, t, _ in prof["dispatch"] if op == "exchange"]
        got = fit_linear_latency(exch) if exch else None
        if got:
            disp["exchange"] = {"bw": rd(got[0]), "latency": rd(got[1]),
                                "ranks": sorted({r for op, _, _, r in prof["dispatch"] if op == "exchange"})}
            dstats["exchange"] = summary(got[2])
        else:
            notes.append("dispatch: fewer than two exchange sizes: exchange not fitted")
        if disp:
            doc["dispatch"] = dict(disp, source=f"{path} dispatch: t = launch_latency + bytes / permute_bw, as the sim prices "
                                                "the op, least squares on the relative error over the permute samples (bytes read + "
                                                "written) with launch_latency held at the loop fit's; permute_mem_efficiency = "
                                                "permute_bw / mem_bw; unpermute (the combine's gather) alike; exchange (the world "
                                                "communicator's all-to-all with itself): t = latency + bytes / bw fitted like copies",
                                   fit=dstats)

    if prof["activations"] is not None:
        rates, astats = [], {}
        keys = sorted({(a, d, t) for a, d, t, _, _ in prof["activations"]},
                      key=lambda x: (ACTIVATIONS.index(x[0]), DIRECTIONS.index(x[1]), ACT_DTYPES.index(x[2])))
        for a, d, t in keys:
            pts = [(n, sec) for a2, d2, t2, n, sec in prof["activations"] if (a2, d2, t2) == (a, d, t)]
            got = fit_rate_held(pts, launch)
            if not got:
                notes.append(f"activations {a} {d} {t}: the samples take less than the launch latency: not fitted")
                continue
            rate, res = got
            rates.append({"activation": a, "direction": d, "dtype": t, "elements_per_s": rd(rate)})
            astats[f"{a} {d} {t}"] = summary(res)
        if rates:
            doc["activations"] = {"rates": rates, "fit": astats,
                                  "source": f"{path} activations: per activation, direction and dtype, t = launch_latency + "
                                            "elements / elements_per_s, as the sim prices the op where this rate binds, least "
                                            "squares on the relative error with launch_latency held at the loop fit's"}

    if prof["missing"]:
        notes.insert(0, f"not in the profile (left out): {', '.join(prof['missing'])}")
        fit_doc["not_in_profile"] = prof["missing"]
    doc["fit"] = fit_doc
    doc["source"] = f"Fitted by scripts/fit_gemm_efficiency.py to the moelab calibrate profile {path}."
    return doc, notes


def write_atomic(path, text):
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix="." + os.path.basename(path) + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main_profile(args):
    try:
        if args.peaks:
            peaks = parse_peaks(args.peaks)
            peaks_text = "given with --peaks: " + ", ".join(f"{p} {flops_text(peaks[p])}" for p in PRECISIONS if p in peaks) + " FLOP/s"
        else:
            peaks = gpu_peaks(args.gpu)
            peaks_text = f"{GPUS} {args.gpu}: " + ", ".join(f"{p} {flops_text(peaks[p])}" for p in PRECISIONS if p in peaks) + " FLOP/s"
    except BadInput as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    try:
        doc, notes = build_from_profile(args.profile, peaks, peaks_text,
                                        args.name or os.path.splitext(os.path.basename(args.out))[0])
    except BadInput as e:
        print(f"{PROG}: {args.profile}: {e}", file=sys.stderr)
        return 2
    text = json.dumps(doc, indent=2) + "\n"
    if args.check:
        try:
            same = open(args.out).read() == text
        except OSError:
            same = False
        if not same:
            print(f"{args.out} differs from the fit", file=sys.stderr)
            return 1
        return 0
    try:
        write_atomic(args.out, text)
    except OSError as e:
        print(f"{PROG}: {args.out}: cannot write: {e.strerror or e}", file=sys.stderr)
        return 2
    for line in notes:
        print(line)
    print(f"{doc['name']}: launch {doc['launch_latency'] * 1e6:.2f} us; " +
          "; ".join(f"{k} gemm_max {v['gemm_max']} half {v['gemm_half_dim']}" for k, v in doc["curves"].items()))
    for q in PATHS[1:]:
        for p, c in doc.get("paths", {}).get(q, {}).items():
            print(f"  {q} {p}: gemm_max {c['gemm_max']} half {c['gemm_half_dim']}")
    for kind in COPY_KINDS:
        if kind in doc.get("copies", {}):
            c = doc["copies"][kind]
            print(f"  copy {kind}: {c['bw'] / 1e9:.4g} GB/s, latency {c['latency'] * 1e6:.3g} us")
    print(f"wrote {args.out}")
    return 0


def main():
    ap = argparse.ArgumentParser(
        prog=PROG, description="Fit the sim backend's GEMM time model. Without --profile: the committed calibrations "
                               "of experiments/hardware/calibration/ from the committed measurements.")
    ap.add_argument("--check", action="store_true", help="fail if the file(s) on disk differ from what the fit gives")
    ap.add_argument("--profile", metavar="P.json", help="a moelab calibrate profile (moelab.profile/1) to fit")
    peaks = ap.add_mutually_exclusive_group()
    peaks.add_argument("--peaks", metavar="bf16=F,tf32=F,fp32=F", help="peak FLOP/s per precision (any subset)")
    peaks.add_argument("--gpu", metavar="KEY", help=f"take the peaks from {GPUS} (for example H100-SXM5-80GB)")
    ap.add_argument("--name", help="the calibration's name (default: OUT's file name without .json)")
    ap.add_argument("--out", metavar="OUT.json", help="the calibration file to write")
    args = ap.parse_args()
    if args.profile:
        if not args.out:
            ap.error("--profile needs --out")
        if not (args.peaks or args.gpu):
            ap.error("--profile needs --peaks or --gpu")
        return main_profile(args)
    if args.peaks or args.gpu or args.name or args.out:
        ap.error("--peaks, --gpu, --name and --out go with --profile")
    return main_committed(args.check)


def main_committed(check):
    h100, a100 = build()
    status = 0
    for doc in (h100, a100):
        path = os.path.join(ROOT, OUT, doc["name"] + ".json")
        text = json.dumps(doc, indent=2) + "\n"
        if check:
            if not os.path.exists(path) or open(path).read() != text:
                print(f"{path} differs from the fit", file=sys.stderr)
                status = 1
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        c = doc["curves"]
        print(f"{doc['name']}: launch {doc['launch_latency'] * 1e6:.2f} us; " +
              "; ".join(f"{k} gemm_max {v['gemm_max']} half {v['gemm_half_dim']}" for k, v in c.items()))
        for k in ("bf16", "fp32", "tf32", "bf16_validation_on_profile_samples"):
            if k in doc["fit"]:
                s = doc["fit"][k]
                print(f"  {k}: n={s['points']} rms log {s['rms_log_residual']} max {s['max_abs_log_residual']} "
                      f"median |rel| {s['median_abs_relative_error']}")
    return status


if __name__ == "__main__":
    sys.exit(main())
