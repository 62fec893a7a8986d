"""Tests of scripts/fit_gemm_efficiency.py --profile: a calibration fitted to a moelab calibrate profile.

    /usr/bin/python3 -m unittest -v test_fit_profile      (from scripts/tests)

The profiles are synthetic: made from known parameters with the fit's own models, so the fit
must give the parameters back.
"""
import copy
import json
import math
import os
import subprocess
import sys
import tempfile
import unittest

import fixtures

SCRIPT = os.path.join(fixtures.SCRIPTS, "fit_gemm_efficiency.py")
PEAKS = {"bf16": 989e12, "tf32": 495e12, "fp32": 67e12}
PEAKS_ARG = "bf16=989e12,tf32=495e12,fp32=67e12"
ELEM = {"bf16": 2, "tf32": 4, "fp32": 4}
MEM_BW = 2.7e12
LAUNCH = 6e-6
# (gemm_max, gemm_half_dim) per precision and path; fp32 only as single-GEMM samples.
CURVES = {"bf16": {"loop": (0.9, 100.0), "strided_batched": (0.95, 60.0), "grouped": (0.35, 40.0)},
          "tf32": {"loop": (0.85, 120.0), "strided_batched": (0.9, 80.0), "grouped": (0.4, 50.0)}}
FP32 = (0.77, 90.0)
COPIES = {"h2d": (50e9, 10e-6), "d2h": (45e9, 12e-6), "d2d": (1.35e12, 5e-6)}
EXCHANGE = (600e9, 20e-6)
PERMUTE_BW = 2.0e12
UNPERMUTE_BW = 1.5e12
# elements/s per (activation, direction, dtype); the samples take launch_latency + elements / rate.
ACTIVATIONS = {("gelu", "forward", "bf16"): 4e11, ("gelu", "backward", "bf16"): 2.5e11, ("relu", "forward", "fp32"): 3e11}
INTERFERENCE = [("compute", "h2d", 0.93), ("compute", "d2h", 0.95), ("h2d", "compute", 0.97),
                ("d2h", "compute", 1.02), ("compute", "compute", 0.5), ("h2d", "d2h", 0.6)]
TABLE_EXTRA = {"source": "cublas sweep", "max_padding_waste": 0.125, "tie_tolerance": 0.02}


def compute_s(m, n, k, prec, gmax, half):
    d = min(m, n, k)
    return max(2.0 * m * n * k / (PEAKS[prec] * gmax * d / (d + half)),
               ELEM[prec] * (m * k + k * n + m * n) / MEM_BW)


def shape(op, dm, dh, rows):
    return {"fwd": (rows, dh, dm), "dgrad": (rows, dm, dh), "wgrad": (dm, dh, rows)}[op]


class Noise:
    """A deterministic ±`amp` multiplicative factor, different from one figure to the next."""

    def __init__(self, amp):
        self.amp, self.i = amp, 0

    def __call__(self):
        self.i += 1
        return 1.0 + self.amp * math.sin(self.i * 2.399963)


def profile(noise=0.0):
    nz = Noise(noise)
    points = []
    for prec, paths in CURVES.items():
        for op in ("fwd", "dgrad", "wgrad"):
            for dm, dh, experts in ((768, 3072, 8), (2048, 8192, 8), (1024, 4096, 64)):
                for rows in (64, 128, 256, 512, 1024, 2048, 4096, 8192):
                    m, n, k = shape(op, dm, dh, rows)
                    flops = experts * 2.0 * m * n * k
                    tf = {}
                    for path, (gmax, half) in paths.items():
                        if path == "loop":
                            call = experts * (LAUNCH + compute_s(m, n, k, prec, gmax, half))
                        else:
                            call = LAUNCH + experts * compute_s(m, n, k, prec, gmax, half)
                        tf[path] = flops / (call * nz()) / 1e12
                    points.append({"precision": prec, "op": op, "d_model": dm, "d_hidden": dh, "experts": experts,
                                   "rows": rows, "tflops": tf})
    gemm = []
    for m, n, k in ((128, 3072, 768), (768, 3072, 128), (512, 512, 512), (1024, 4096, 1024), (2048, 2048, 2048),
                    (4096, 4096, 4096), (256, 8192, 2048), (8192, 2048, 8192), (64, 1024, 1024), (96, 96, 96)):
        gemm.append({"m": m, "n": n, "k": k, "dtype": "fp32", "seconds": (LAUNCH + compute_s(m, n, k, "fp32", *FP32)) * nz()})
        # bf16 samples: not fitted (the loop figures are), checked against the curve.
        gemm.append({"m": m, "n": n, "k": k, "dtype": "bf16",
                     "seconds": (LAUNCH + compute_s(m, n, k, "bf16", *CURVES["bf16"]["loop"])) * nz()})
    sizes = [10 ** e for e in range(3, 10)] + [3 * 10 ** e for e in range(3, 9)]
    copies = [{"kind": kind, "bytes": b, "seconds": (lat + b / bw) * nz()}
              for kind, (bw, lat) in COPIES.items() for b in sizes]
    dispatch = []
    for rows in (256, 1024, 4096, 16384):
        b = 2 * rows * 2048 * 2
        dispatch.append({"op": "permute", "rows": rows, "width": 2048, "dtype": "bf16", "bytes": b,
                         "seconds": (LAUNCH + b / PERMUTE_BW) * nz()})
    dispatch += [{"op": "exchange", "ranks": 1, "bytes": b, "seconds": (EXCHANGE[1] + b / EXCHANGE[0]) * nz()} for b in sizes]
    for rows in (256, 1024, 4096, 16384):
        b = 2 * rows * 2048 * 2
        dispatch.append({"op": "unpermute", "rows": rows, "width": 2048, "dtype": "bf16", "bytes": b,
                         "seconds": (LAUNCH + b / UNPERMUTE_BW) * nz()})
    activations = [{"activation": a, "direction": d, "dtype": t, "elements": n, "seconds": (LAUNCH + n / rate) * nz()}
                   for (a, d, t), rate in ACTIVATIONS.items() for n in (1 << 20, 1 << 22, 1 << 24, 1 << 26)]
    return {
        "schema": "moelab.profile/1", "name": "synthetic", "mode": "measured", "backend": "cuda",
        "device": "NVIDIA H100 80GB HBM3", "date": "2026-11-22T20:06:46Z", "commit": "0123456789ab",
        "gemm": gemm,
        "h2d_bw": 50e9, "d2h_bw": 45e9, "d2d_bw": MEM_BW, "elementwise_bw": 2.4e12, "launch_latency": 5.5e-6,
        "collectives": [],
        "gemm_paths": dict(TABLE_EXTRA, points=points),
        "copies": copies,
        "overheads": {"launch_latency": 5.5e-6, "event_record": 2e-6, "sync_roundtrip": 9e-6, "stream_wait": 1.5e-6},
        "interference": [{"victim": v, "aggressor": a, "alone_s": 1e-3 * f, "together_s": 1e-3, "factor": f}
                         for v, a, f in INTERFERENCE],
        "dispatch": dispatch,
        "activations": activations,
    }


class Base(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="fit_profile_test.")
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def run_fit(self, prof, *extra, peaks=PEAKS_ARG, out="out.json"):
        """Writes prof to p.json in the temporary folder and fits it from there (relative paths)."""
        with open(os.path.join(self.dir, "p.json"), "w") as f:
            f.write(prof if isinstance(prof, str) else json.dumps(prof))
        args = [sys.executable, SCRIPT, "--profile", "p.json", "--out", out, "--name", "synthetic", *extra]
        if peaks:
            args += ["--peaks", peaks]
        p = subprocess.run(args, cwd=self.dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        doc = None
        if p.returncode == 0:
            with open(os.path.join(self.dir, out)) as f:
                doc = json.load(f)
        return p, doc

    def assertNear(self, got, want, rel, what):
        self.assertLessEqual(abs(got / want - 1), rel, f"{what}: got {got}, want {want}")

    def check_recovery(self, doc, rel):
        self.assertNear(doc["launch_latency"], LAUNCH, rel, "launch_latency")
        self.assertEqual(doc["mem_bw"], MEM_BW)
        for prec, paths in CURVES.items():
            for path, (gmax, half) in paths.items():
                c = doc["curves"][prec] if path == "loop" else doc["paths"][path][prec]
                self.assertNear(c["gemm_max"], gmax, rel, f"{path} {prec} gemm_max")
                self.assertNear(c["gemm_half_dim"], half, rel, f"{path} {prec} gemm_half_dim")
        self.assertNear(doc["curves"]["fp32"]["gemm_max"], FP32[0], rel, "fp32 gemm_max")
        self.assertNear(doc["curves"]["fp32"]["gemm_half_dim"], FP32[1], rel, "fp32 gemm_half_dim")
        for kind, (bw, lat) in COPIES.items():
            self.assertNear(doc["copies"][kind]["bw"], bw, rel, f"copies {kind} bw")
            self.assertNear(doc["copies"][kind]["latency"], lat, rel, f"copies {kind} latency")
        self.assertNear(doc["dispatch"]["exchange"]["bw"], EXCHANGE[0], rel, "exchange bw")
        self.assertNear(doc["dispatch"]["exchange"]["latency"], EXCHANGE[1], rel, "exchange latency")
        self.assertNear(doc["dispatch"]["permute_bw"], PERMUTE_BW, rel, "permute_bw")
        self.assertNear(doc["dispatch"]["permute_mem_efficiency"], PERMUTE_BW / MEM_BW, rel, "permute_mem_efficiency")
        self.assertNear(doc["dispatch"]["unpermute_bw"], UNPERMUTE_BW, rel, "unpermute_bw")
        rates = {(r["activation"], r["direction"], r["dtype"]): r["elements_per_s"] for r in doc["activations"]["rates"]}
        self.assertEqual(sorted(rates), sorted(ACTIVATIONS))
        for key, rate in ACTIVATIONS.items():
            self.assertNear(rates[key], rate, rel, f"activation {key}")


class Recovery(Base):
    def test_exact_profile_gives_the_parameters_back(self):
        p, doc = self.run_fit(profile())
        self.assertEqual(p.returncode, 0, p.stderr)
        self.check_recovery(doc, 1e-3)
        self.assertLess(doc["fit"]["bf16"]["max_abs_relative_error"], 1e-3)
        self.assertLess(doc["fit"]["bf16_validation_on_gemm_samples"]["max_abs_relative_error"], 1e-3)
        self.assertLess(doc["copies"]["fit"]["h2d"]["max_abs_relative_error"], 1e-3)

    def test_noisy_profile_within_a_few_percent(self):
        p, doc = self.run_fit(profile(noise=0.01))
        self.assertEqual(p.returncode, 0, p.stderr)
        self.check_recovery(doc, 0.05)
        for s in (doc["fit"]["bf16"], doc["fit"]["tf32"], doc["fit"]["fp32"], doc["paths"]["fit"]["grouped"]["bf16"],
                  doc["copies"]["fit"]["d2h"], doc["dispatch"]["fit"]["exchange"], doc["dispatch"]["fit"]["permute"],
                  doc["activations"]["fit"]["gelu backward bf16"]):
            self.assertLess(s["max_abs_relative_error"], 0.02)


class Sections(Base):
    def test_table_copied_verbatim(self):
        prof = profile(noise=0.01)
        p, doc = self.run_fit(prof)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(doc["gemm_paths"], prof["gemm_paths"])
        self.assertEqual(doc["overheads"], dict(prof["overheads"], source="p.json overheads (copied)"))

    def test_interference_factors(self):
        # compute beside copies: the least of 0.93 and 0.95; copies beside compute: min(1, 0.97, 1.02);
        # compute beside compute (0.5) and copy beside copy (0.6) do not count.
        p, doc = self.run_fit(profile())
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(doc["interference"]["compute_beside_memcpy"], 0.93)
        self.assertEqual(doc["interference"]["memcpy_beside_compute"], 0.97)
        prof = profile()
        for e in prof["interference"]:
            if e["aggressor"] == "compute" and e["victim"] != "compute":
                e["factor"] = 1.05
            del e["alone_s"], e["together_s"]
        p, doc = self.run_fit(prof)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(doc["interference"]["memcpy_beside_compute"], 1.0)  # capped
        # Without "factor", alone_s / together_s.
        prof = profile()
        for e in prof["interference"]:
            del e["factor"]
        p, doc = self.run_fit(prof)
        self.assertEqual(doc["interference"]["compute_beside_memcpy"], 0.93)

    def test_sources_name_the_profile_as_given(self):
        p, doc = self.run_fit(profile())
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(doc["schema"], "moelab.gemm_calibration/1")
        self.assertEqual(doc["name"], "synthetic")
        self.assertEqual(doc["device"], "NVIDIA H100 80GB HBM3")
        self.assertEqual(doc["fit"]["data"], ["p.json"])
        for src in ([c["source"] for c in doc["curves"].values()] +
                    [doc[k]["source"] for k in ("paths", "copies", "interference", "overheads", "dispatch", "activations")]):
            self.assertIn("p.json", src)
            self.assertNotIn(self.dir, src)
        self.assertIn("loop path", doc["curves"]["bf16"]["source"])
        self.assertIn("GEMM samples", doc["curves"]["fp32"]["source"])
        self.assertIn("held", doc["curves"]["fp32"]["source"])
        self.assertIn("given with --peaks", doc["fit"]["peaks"])

    def test_missing_sections_are_left_out_and_named(self):
        prof = profile()
        for key in ("copies", "interference", "overheads", "dispatch", "gemm_paths", "activations"):
            del prof[key]
        p, doc = self.run_fit(prof)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("not in the profile (left out): gemm_paths, copies, overheads, interference, dispatch, activations",
                      p.stdout)
        for key in ("copies", "interference", "overheads", "dispatch", "gemm_paths", "paths", "activations"):
            self.assertNotIn(key, doc)
        # Without the loop figures the bf16 samples give the curve, launch_latency free with it.
        self.assertEqual(sorted(doc["curves"]), ["bf16", "fp32"])
        self.assertIn("tf32: a peak but no GEMM data", p.stdout)
        self.assertNear(doc["curves"]["bf16"]["gemm_max"], 0.9, 1e-3, "bf16 gemm_max from samples")
        self.assertNear(doc["launch_latency"], LAUNCH, 1e-3, "launch from samples")

    def test_cpu_profile_fp32_peak_only(self):
        prof = profile()
        prof["backend"], prof["device"] = "cpu", "AMD EPYC (2 threads, OpenBLAS)"
        del prof["gemm_paths"]
        p, doc = self.run_fit(prof, peaks="fp32=67e12")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(list(doc["curves"]), ["fp32"])
        self.assertIn("bf16: GEMM data but no peak given", p.stdout)
        self.assertNear(doc["curves"]["fp32"]["gemm_max"], FP32[0], 1e-3, "fp32 gemm_max")
        self.assertNear(doc["launch_latency"], LAUNCH, 1e-3, "launch from fp32 samples")

    def test_loop_only_table_gives_neither_paths_nor_table(self):
        # A cpu profile measures the loop alone: its curves, and no "paths" or "gemm_paths"
        # (the sim's loader takes the two together or neither).
        prof = profile()
        for pt in prof["gemm_paths"]["points"]:
            pt["tflops"] = {"loop": pt["tflops"]["loop"]}
        p, doc = self.run_fit(prof)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("bf16", doc["curves"])
        self.assertNotIn("paths", doc)
        self.assertNotIn("gemm_paths", doc)
        self.assertIn("no table (every call is priced as the loop)", p.stdout)

    def test_curve_out_of_range_is_left_out(self):
        # A bf16 peak 10x too low: gemm_max would be about 9; that curve and its paths are left out.
        p, doc = self.run_fit(profile(), peaks="bf16=98.9e12,tf32=495e12,fp32=67e12")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(sorted(doc["curves"]), ["fp32", "tf32"])
        self.assertEqual(sorted(doc["paths"]["grouped"]), ["tf32"])
        self.assertIn("bf16: the fit gives gemm_max", p.stdout)
        self.assertNear(doc["curves"]["tf32"]["gemm_max"], 0.85, 1e-3, "tf32 gemm_max")

    def test_gpu_peaks(self):
        p, doc = self.run_fit(profile(), "--gpu", "H100-SXM5-80GB", peaks=None)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertNear(doc["curves"]["bf16"]["gemm_max"], 0.9, 1e-3, "bf16 gemm_max with --gpu")
        self.assertIn("H100-SXM5-80GB", doc["fit"]["peaks"])

    def test_check_against_written_file(self):
        p, _ = self.run_fit(profile())
        self.assertEqual(p.returncode, 0, p.stderr)
        p, _ = self.run_fit(profile(), "--check")
        self.assertEqual(p.returncode, 0, p.stderr)
        p, _ = self.run_fit(profile(noise=0.01), "--check")
        self.assertEqual(p.returncode, 1)


class BadInputs(Base):
    def assertRejected(self, prof, field, *extra, peaks=PEAKS_ARG):
        # An OUT already there stays as it was; a fresh one is not created; no temporary is left.
        with open(os.path.join(self.dir, "old.json"), "w") as f:
            f.write("old\n")
        for out in ("out.json", "old.json"):
            p, _ = self.run_fit(prof, *extra, peaks=peaks, out=out)
            self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
            lines = p.stderr.splitlines()
            self.assertEqual(len(lines), 1, p.stderr)
            self.assertTrue(lines[0].startswith("fit_gemm_efficiency.py: p.json: "), lines[0])
            if field:
                self.assertIn(f"field {field}: ", lines[0])
            self.assertEqual(sorted(os.listdir(self.dir)), ["old.json", "p.json"])
            with open(os.path.join(self.dir, "old.json")) as f:
                self.assertEqual(f.read(), "old\n")
        return lines[0]

    def test_unreadable_and_malformed(self):
        self.assertIn("not JSON", self.assertRejected('{"schema": ', None))
        self.assertIn("top level", self.assertRejected("[1, 2]", None))
        p = subprocess.run([sys.executable, SCRIPT, "--profile", "missing.json", "--peaks", PEAKS_ARG, "--out", "o.json"],
                           cwd=self.dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertEqual(p.returncode, 2)
        self.assertEqual(p.stderr, "fit_gemm_efficiency.py: missing.json: cannot read: No such file or directory\n")
        self.assertFalse(os.path.exists(os.path.join(self.dir, "o.json")))

    def test_wrong_schema(self):
        prof = profile()
        prof["schema"] = "moelab.result/1"
        self.assertRejected(prof, "schema")
        del prof["schema"]
        self.assertRejected(prof, "schema")

    def test_wrong_types(self):
        cases = [
            (lambda d: d["gemm_paths"]["points"][3].__setitem__("rows", "64"), "gemm_paths.points[3].rows"),
            (lambda d: d["gemm_paths"]["points"][0]["tflops"].__setitem__("grouped", None), "gemm_paths.points[0].tflops.grouped"),
            (lambda d: d["gemm_paths"]["points"][1].__setitem__("op", "bwd"), "gemm_paths.points[1].op"),
            (lambda d: d["gemm_paths"].__setitem__("points", {}), "gemm_paths.points"),
            (lambda d: d.__setitem__("gemm_paths", []), "gemm_paths"),
            (lambda d: d["gemm"][2].__setitem__("m", 1.5), "gemm[2].m"),
            (lambda d: d["gemm"][0].__setitem__("dtype", "fp16"), "gemm[0].dtype"),
            (lambda d: d.__setitem__("copies", {"h2d": 1}), "copies"),
            (lambda d: d["copies"][4].__setitem__("bytes", True), "copies[4].bytes"),
            (lambda d: d["interference"][0].__setitem__("factor", "0.9"), "interference[0].factor"),
            (lambda d: d["overheads"].__setitem__("event_record", [1]), "overheads.event_record"),
            (lambda d: d["dispatch"][5].__setitem__("ranks", 0), "dispatch[5].ranks"),
            (lambda d: d.__setitem__("activations", {"gelu": 1}), "activations"),
            (lambda d: d["activations"][1].__setitem__("direction", "up"), "activations[1].direction"),
            (lambda d: d["activations"][0].__setitem__("dtype", "fp16"), "activations[0].dtype"),
            (lambda d: d["activations"][2].__setitem__("activation", "swish"), "activations[2].activation"),
            (lambda d: d["activations"][3].pop("elements"), "activations[3].elements"),
            (lambda d: d.__setitem__("d2d_bw", "fast"), "d2d_bw"),
            (lambda d: d.pop("d2d_bw"), "d2d_bw"),
            (lambda d: d.pop("device"), "device"),
        ]
        for edit, field in cases:
            with self.subTest(field=field):
                prof = profile()
                edit(prof)
                self.assertRejected(prof, field)

    def test_non_positive_figures(self):
        cases = [
            (lambda d: d["gemm"][1].__setitem__("seconds", 0), "gemm[1].seconds"),
            (lambda d: d["copies"][2].__setitem__("seconds", -1e-6), "copies[2].seconds"),
            (lambda d: d["dispatch"][0].__setitem__("seconds", 0.0), "dispatch[0].seconds"),
            (lambda d: d["activations"][4].__setitem__("seconds", -1.0), "activations[4].seconds"),
            (lambda d: d["gemm_paths"]["points"][5]["tflops"].__setitem__("loop", -3.0), "gemm_paths.points[5].tflops.loop"),
            (lambda d: d["gemm_paths"]["points"][7].__setitem__("tflops", {"loop": 0, "strided_batched": 0, "grouped": 0}),
             "gemm_paths.points[7].tflops"),
        ]
        for edit, field in cases:
            with self.subTest(field=field):
                prof = profile()
                edit(prof)
                self.assertRejected(prof, field)

    def test_no_gemm_data_for_a_precision_with_a_peak(self):
        prof = profile()
        prof["gemm"] = [s for s in prof["gemm"] if s["dtype"] == "bf16"]
        del prof["gemm_paths"]
        self.assertIn("no GEMM samples", self.assertRejected(prof, "gemm", peaks="fp32=67e12"))


class Committed(unittest.TestCase):
    def test_committed_calibrations_still_match(self):
        p = subprocess.run([sys.executable, SCRIPT, "--check"], cwd=fixtures.ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)


@unittest.skipUnless(os.environ.get("MOELAB"), "set MOELAB to a moelab binary")
class LoadedBySim(Base):
    """What the fit writes is what the simulator reads: a cluster file naming the fitted
    calibration (as scripts/validate_sim.sh writes one) runs, and prices a grouped call on the
    path the table picks (the op's detail names it)."""

    def test_fitted_calibration_runs_in_the_sim(self):
        p, doc = self.run_fit(profile(), "--gpu", "H100-SXM5-80GB", peaks=None)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("paths", doc)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        with open(os.path.join(root, "experiments", "hardware", "clusters", "h100x1.json")) as f:
            cluster = json.load(f)
        cluster["efficiency"] = {"calibration": "out.json", "mem": 0.9, "source": "test"}
        cluster["name"] = "h100x1-fitted"
        with open(os.path.join(self.dir, "cluster.json"), "w") as f:
            json.dump(cluster, f)
        with open(os.path.join(self.dir, "w.json"), "w") as f:
            json.dump({"name": "w", "model": {"d_model": 768, "d_hidden": 3072, "num_experts": 8, "top_k": 1,
                                              "capacity_factor": 0, "activation": "gelu", "dtype": "bf16"},
                       "tokens_per_rank": 2048, "steps": 2, "warmup": 1, "seed": 1}, f)
        for options in ("{}", '{"expert_layout": "padded"}'):
            run = subprocess.run([os.environ["MOELAB"], "run", "--workload", "w.json", "--impl", "fastmoe",
                                  "--impl-options", options, "--backend", "sim", "--cluster", "./cluster.json",
                                  "--ranks", "1", "--out", "r.json", "--trace", "t.json"],
                                 cwd=self.dir, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.assertEqual(run.returncode, 0, run.stderr)
            with open(os.path.join(self.dir, "t.json")) as f:
                events = json.load(f)["traceEvents"]
            details = [e.get("args", {}).get("detail", "") for e in events if e.get("name") == "fc1"]
            self.assertTrue(details and all(any(p in d for p in ("loop", "strided_batched", "grouped")) for d in details),
                            details[:3])
            with open(os.path.join(self.dir, "r.json")) as f:
                res = json.load(f)
            self.assertEqual(res["metrics"]["floor_gemm_library"], "GEMM (cost model), strided-batched curve")
            # The fitted kernel rates: the bf16 GeLU at most its measured elements/s (forward and
            # backward were measured), the permutations at their measured rates.
            detail = {e["name"]: e.get("args", {}).get("detail", "") for e in events if e.get("ph") == "X"}
            self.assertIn("measured elements/s", detail["gelu"])
            self.assertIn("measured elements/s", detail["gelu_bwd"])
            self.assertIn("measured rate", detail["permute"])
            self.assertIn("measured rate", detail["unpermute"])
