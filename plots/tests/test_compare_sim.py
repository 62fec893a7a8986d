"""Tests of plots/compare_sim.py (measured against simulated, configuration by configuration) on
fixtures: DIR/measured/cN.json and DIR/simulated/cN.json under a temporary folder.

    /usr/bin/python3 -m unittest -v test_compare_sim      (from plots/tests)
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

SCRIPT = os.path.join(ROOT, "plots", "compare_sim.py")


class CompareSim(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="compare_sim_test.")
        self.d = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def put(self, name, measured_step, simulated_step, m_paths=None, s_paths=None):
        m = fixtures.result("measured", step=measured_step, device="NVIDIA H100 80GB HBM3 (79.1 GiB)")
        m["backend"] = "cuda"
        s = fixtures.result("simulated", step=simulated_step)
        for r, paths in ((m, m_paths), (s, s_paths)):
            if paths is not None:
                r["metrics"]["gemm_paths_taken"] = paths
        mr.write_json(os.path.join(self.d, "measured", name), m)
        mr.write_json(os.path.join(self.d, "simulated", name), s)

    def run_it(self):
        p = subprocess.run([sys.executable, SCRIPT, self.d], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(os.path.join(self.d, "comparison.json")) as f:
            return json.load(f), p.stdout

    def test_errors_and_gemm_paths(self):
        same = {"experts.fc1": {"strided_batched": 4}, "experts.fc2": {"loop": 4}}
        self.put("c1.json", 0.010, 0.011, same, same)
        # c2: the sim priced fc2's calls on the loop where the GPU ran them grouped, counted an
        # op the GPU never ran, and issued fc1 on the same path more often (more steps): only
        # fc2 is a path difference
        self.put("c2.json", 0.010, 0.008, {"experts.fc2": {"grouped": 4}, "experts.fc1": {"loop": 4, "grouped": 2}},
                 {"experts.fc2": {"loop": 3, "grouped": 1}, "gate": {"loop": 2},
                  "experts.fc1": {"loop": 8, "grouped": 4}})
        # c3: the measured run predates the path counts: not compared
        self.put("c3.json", 0.010, 0.010, None, same)
        # a stray file beside them is not a configuration
        mr.write_json(os.path.join(self.d, "measured", "c1.routing.json"), {})
        c, out = self.run_it()
        self.assertEqual(len(c["configurations"]), 3)
        errs = sorted(r["step_error"] for r in c["configurations"])
        for got, want in zip(errs, [0.0, 0.1, 0.2]):
            self.assertAlmostEqual(got, want)
        self.assertAlmostEqual(c["median_step_error"], 0.1)
        self.assertAlmostEqual(c["worst_step_error"], 0.2)
        r1, r2, r3 = c["configurations"]
        self.assertEqual(r1["gemm_paths"], {"agree": True, "differ": {}, "calls_differ": []})
        self.assertEqual(r2["gemm_paths"], {"agree": False, "differ": {
            "experts.fc2": {"measured": {"grouped": 4}, "simulated": {"loop": 3, "grouped": 1}}},
            "calls_differ": ["experts.fc1", "gate"]})
        self.assertNotIn("gemm_paths", r3)
        self.assertEqual(c["gemm_paths_agree"], {"configurations": 2, "agree": 1})
        self.assertIn("experts.fc2 priced on other GEMM paths than measured: measured {'grouped': 4}", out)
        self.assertIn("other GEMM calls issued (not a path difference): experts.fc1, gate", out)
        self.assertIn("GEMM paths: the sim priced every expert call on the measured path in 1 of 2 configurations", out)

    def test_no_path_counts_no_path_check(self):
        self.put("c1.json", 0.010, 0.012)
        c, out = self.run_it()
        self.assertNotIn("gemm_paths_agree", c)
        self.assertNotIn("gemm_paths", c["configurations"][0])
        self.assertNotIn("GEMM paths", out)

    def test_missing_simulated_run_fails(self):
        self.put("c1.json", 0.010, 0.012)
        os.remove(os.path.join(self.d, "simulated", "c1.json"))
        p = subprocess.run([sys.executable, SCRIPT, self.d], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("c1.json is missing", p.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.d, "comparison.json")))


if __name__ == "__main__":
    unittest.main()
