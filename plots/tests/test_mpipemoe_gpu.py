"""Tests of plots/mpipemoe_gpu.py (measured MPipeMoE GPU runs against their simulated counterparts)
on fixtures: a measured and a simulated result tree under a temporary folder.

    /usr/bin/python3 -m unittest -v test_mpipemoe_gpu      (from plots/tests)
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "scripts", "tests"))
import fixtures  # noqa: E402
import moelab_results as mr  # noqa: E402

SCRIPT = os.path.join(ROOT, "plots", "mpipemoe_gpu.py")
DEVICE = "NVIDIA H100 80GB HBM3 (79.1 GiB)"
DEVICE_DIR = "measured/cuda/nvidia-h100-80gb-hbm3/mpipemoe"
WL = "wl-e8-tf32"

# label: (n, strategy, measured step, simulated step, measured GEMM TFLOP/s, simulated, host copy m, s, peak)
RUNS = {
    "FastMoE": (None, None, 0.010, 0.008, 300.0, 320.0, 0.0, 0.0, 4000),
    "n1": (1, "none", 0.010, 0.008, 300.0, 320.0, 0.0, 0.0, 4200),
    "n4": (4, "none", 0.012, 0.010, 250.0, 300.0, 0.0, 0.0, 3000),
    "n16": (16, "none", 0.018, 0.012, 150.0, 240.0, 0.0, 0.0, 2800),
    "n4-S1": (4, "S1", 0.040, 0.030, 240.0, 290.0, 0.025, 0.020, 2000),
    "n4-S3": (4, "S3", 0.015, 0.012, 245.0, 295.0, 0.004, 0.003, 2000),
    "n4-S4": (4, "S4", 0.014, 0.0105, 250.0, 300.0, 0.0, 0.0, 2200),
    "n4-auto": (4, "S3", 0.015, 0.012, 245.0, 295.0, 0.004, 0.003, 2000),
}


def make(label, measured):
    n, strat, ms, ss, mt, st, mh, sh, peak = RUNS[label]
    r = fixtures.result("measured" if measured else "simulated", step=ms if measured else ss,
                        device=DEVICE if measured else "simulated H100-SXM5-80GB in h100x1")
    if measured:
        r["backend"] = "cuda"
    else:
        r["cluster"] = {"name": "h100x1", "nodes": 1,
                        "node": {"gpu": {"name": "H100-SXM5-80GB", "flops_tf32": 495e12, "flops_bf16": 989e12}}}
    r["workload"]["name"] = WL
    r["workload"]["tokens_per_rank"] = 65536
    r["workload"]["model"].update(num_experts=8, top_k=1, dtype="fp32", allow_tf32=True)
    r["impl"] = "fastmoe" if n is None else "mpipemoe"
    if n is None:
        r["impl_report"] = {"schedule": "unpipelined expert parallelism"}
    else:
        r["impl_report"] = {"partitions": n, "last_n": n, "strategy": "auto" if label.endswith("auto") else strat,
                            "last_strategy": strat,
                            "memory_model": {"predicted_act_plus_buf_bytes": 150.0 + n,
                                             "paper_act_plus_buf_bytes": 140.0}}
    m = r["metrics"]
    m["expert_gemm_tflops"] = mt if measured else st
    m["host_copy_s"] = mh if measured else sh
    m["peak_memory_bytes"]["device_total"] = peak
    if measured:
        m["peak_memory_bytes"]["device_pool"] = {"used_high": peak + 500, "reserved_high": peak + 900, "rank": 0}
    return r


class MPipeMoEGpu(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="mpipemoe_gpu_test.")
        self.results = os.path.join(self.tmp.name, "out", "results")
        self.simulated = os.path.join(self.tmp.name, "repo", "results")

    def tearDown(self):
        self.tmp.cleanup()

    def plant(self, labels=RUNS, sim_labels=None):
        for label in labels:
            mr.write_json(os.path.join(self.results, DEVICE_DIR, f"{WL}-{label}.json"), make(label, True))
        for label in (labels if sim_labels is None else sim_labels):
            mr.write_json(os.path.join(self.simulated, "simulated/h100x1/mpipemoe", f"{WL}-{label}.json"),
                          make(label, False))

    def compare(self, *extra):
        return subprocess.run([sys.executable, SCRIPT, "--results", self.results, "--simulated", self.simulated]
                              + list(extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def test_figures(self):
        self.plant()
        p = self.compare()
        self.assertEqual(p.returncode, 0, p.stderr)
        c = mr.load_json(os.path.join(self.results, DEVICE_DIR, "comparison.json"))
        self.assertEqual((c["schema"], c["cluster_model"], c["device"], c["pairs"]),
                         ("moelab.gpu-comparison/1", "h100x1", DEVICE, len(RUNS)))
        self.assertEqual(c["missing_simulated"], [])
        rows = {r["impl"]: r for r in c["rows"]}
        self.assertEqual([r["impl"] for r in c["rows"]],
                         ["FastMoE", "n1", "n4", "n16", "n4-S1", "n4-S3", "n4-S4", "n4-auto"])
        self.assertAlmostEqual(rows["n16"]["step_s"]["ratio"], 0.018 / 0.012)
        self.assertAlmostEqual(rows["n4"]["expert_gemm_tflops"]["ratio"], 250.0 / 300.0)
        self.assertEqual(rows["n4-S1"]["act_buf_at_peak_bytes"]["model_predicted"], 154.0)
        self.assertEqual(rows["n4-S1"]["peak_memory_bytes"], {"measured": 2000, "simulated": 2000, "ratio": 1.0})
        self.assertEqual(rows["FastMoE"]["act_buf_at_peak_bytes"]["model_predicted"], None)
        self.assertEqual(rows["n4-S1"]["device_pool_bytes"], {"used_high": 2500, "reserved_high": 2900})
        # GEMM efficiency: no-reuse runs by n, rows per expert GEMM = 65536 / (8 n), fraction of 495 TFLOP/s
        g = c["gemm_efficiency"][WL]
        self.assertEqual([(x["impl"], x["partitions"], x["rows_per_expert_gemm"]) for x in g],
                         [("FastMoE", 1, 8192), ("n1", 1, 8192), ("n4", 4, 2048), ("n16", 16, 512)])
        self.assertAlmostEqual(g[3]["measured_fraction_of_peak"], 150.0 / 495.0)
        # restore cost = step(n4-Sx) - step(n4)
        rc = {e["impl"]: e for e in c["restore_costs"][WL]}
        self.assertEqual(list(rc), ["n4-S1", "n4-S3", "n4-S4", "n4-auto"])
        self.assertAlmostEqual(rc["n4-S1"]["extra_step_s"]["measured"], 0.028)
        self.assertAlmostEqual(rc["n4-S1"]["extra_step_s"]["simulated"], 0.020)
        self.assertAlmostEqual(rc["n4-S1"]["extra_step_s"]["ratio"], 1.4)
        self.assertEqual(rc["n4-S1"]["host_copy_s"], {"measured": 0.025, "simulated": 0.020})
        self.assertEqual(rc["n4-S3"]["memory_saved_bytes"], {"measured": 1000, "simulated": 1000})
        # Eq. 10 picked S3 on both sides; S4 is the fastest on both
        self.assertEqual(c["eq10"][WL], {"measured_pick": "S3", "simulated_pick": "S3",
                                         "fastest_measured": "S4", "fastest_simulated": "S4"})
        self.assertAlmostEqual(c["step_ratio"]["max"], 0.018 / 0.012)
        # the printed tables carry the same figures
        self.assertIn("| wl-e8-tf32 | n16 | 16 | none | 18.00 | 12.00 | 1.50 |", p.stdout)
        self.assertIn("| wl-e8-tf32 | n4-S1 | S1 | 28.00 | 20.00 | 1.40 | 25.00 | 20.00 |", p.stdout)
        self.assertIn("| wl-e8-tf32 | n16 | 16 | 512 | 150 | 240 | 0.62 | 30% |", p.stdout)

    def test_gemm_paths_are_compared_where_both_count_them(self):
        # n4: the sim priced fc1's data gradient on the loop where the GPU ran it grouped; n16:
        # the same paths; the others record no counts (an older build): not compared.
        self.plant()
        counts = {"n4": ({"fc1": {"loop": 5}, "fc1_dgrad": {"grouped": 5}}, {"fc1": {"loop": 5}, "fc1_dgrad": {"loop": 5}}),
                  "n16": ({"fc1": {"strided_batched": 17}}, {"fc1": {"strided_batched": 17}})}
        for label, (mt, st) in counts.items():
            for path, taken in ((os.path.join(self.results, DEVICE_DIR, f"{WL}-{label}.json"), mt),
                                (os.path.join(self.simulated, "simulated/h100x1/mpipemoe", f"{WL}-{label}.json"), st)):
                r = mr.load_json(path)
                r["metrics"]["gemm_paths_taken"] = taken
                mr.write_json(path, r)
        p = self.compare()
        self.assertEqual(p.returncode, 0, p.stderr)
        c = mr.load_json(os.path.join(self.results, DEVICE_DIR, "comparison.json"))
        rows = {r["impl"]: r for r in c["rows"]}
        self.assertEqual(c["gemm_paths_agree"], {"configurations": 2, "agree": 1})
        self.assertEqual(rows["n16"]["gemm_paths"], {"agree": True, "differ": {}, "calls_differ": []})
        self.assertEqual(rows["n4"]["gemm_paths"]["differ"],
                         {"fc1_dgrad": {"measured": {"grouped": 5}, "simulated": {"loop": 5}}})
        self.assertNotIn("gemm_paths", rows["n1"])
        self.assertIn("expert GEMM paths: the sim priced every call on the measured path in 1 of 2 runs", p.stdout)
        self.assertIn("wl-e8-tf32 n4: fc1_dgrad measured {'grouped': 5}, simulated {'loop': 5}", p.stdout)

    def test_missing_counterpart_is_listed(self):
        self.plant(sim_labels=["n4", "n4-S3"])
        p = self.compare()
        self.assertEqual(p.returncode, 0, p.stderr)
        c = mr.load_json(os.path.join(self.results, DEVICE_DIR, "comparison.json"))
        self.assertEqual(c["pairs"], 2)
        self.assertIn("simulated/h100x1/mpipemoe/wl-e8-tf32-n4-S1.json", c["missing_simulated"])
        self.assertIn("no simulated counterpart: simulated/h100x1/mpipemoe/wl-e8-tf32-n4-S1.json", p.stdout)

    def test_no_measured_results(self):
        os.makedirs(self.results)
        p = self.compare()
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("no measured MPipeMoE GPU results", p.stdout)
        self.assertIn("nothing written", p.stdout)
        written = [os.path.join(d, f) for d, _, fs in os.walk(self.tmp.name) for f in fs]
        self.assertEqual(written, [])

    def test_unknown_device_class_is_skipped(self):
        r = make("n4", True)
        r["device"] = "NVIDIA A100-SXM4-40GB (39.4 GiB)"
        mr.write_json(os.path.join(self.results, "measured/cuda/nvidia-a100-sxm4-40gb/mpipemoe", f"{WL}-n4.json"), r)
        p = self.compare()
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("no simulated counterpart for this device class", p.stdout)
        self.assertFalse(os.path.exists(os.path.join(self.results, "measured/cuda/nvidia-a100-sxm4-40gb/mpipemoe",
                                                     "comparison.json")))

    def test_a_simulated_file_among_the_measured_is_an_error(self):
        self.plant(labels=["n4"])
        mr.write_json(os.path.join(self.results, DEVICE_DIR, f"{WL}-n4.json"), make("n4", False))
        p = self.compare()
        self.assertEqual(p.returncode, 1)
        self.assertIn("expected a measured cuda result", p.stderr)
        self.assertNotIn("Traceback", p.stderr)


if __name__ == "__main__":
    unittest.main()
