"""Tests of plots/mpipemoe_memory.py (the memory model against the allocator) on fixtures.

    /usr/bin/python3 -m unittest -v test_mpipemoe_memory      (from plots/tests)
"""
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

SCRIPT = os.path.join(ROOT, "plots", "mpipemoe_memory.py")
MiB = 2**20


def make(act, buf, predicted, strategy="S3", impl="mpipemoe"):
    r = fixtures.result("simulated")
    r["impl"] = impl
    r["impl_report"]["last_strategy"] = strategy
    r["impl_report"]["memory_model"] = {"predicted_act_plus_buf_bytes": predicted}
    r["metrics"]["peak_memory_bytes"]["by_category_at_peak"].update(activations=act, buffers=buf)
    return r


class MemoryTable(unittest.TestCase):
    def run_script(self, results):
        return subprocess.run([sys.executable, SCRIPT, "--results", results], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)

    def test_ratios_groups_and_outliers(self):
        with tempfile.TemporaryDirectory() as d:
            mr.write_json(os.path.join(d, "simulated/x/a.json"), make(60 * MiB, 40 * MiB, 100 * MiB))
            mr.write_json(os.path.join(d, "simulated/x/b.json"), make(70 * MiB, 40 * MiB, 100 * MiB))
            mr.write_json(os.path.join(d, "simulated/x/c.json"), make(50 * MiB, 52 * MiB, 100 * MiB, "none"))
            mr.write_json(os.path.join(d, "simulated/x/f.json"), make(1, 1, 1, impl="fastmoe"))  # not MPipeMoE
            mr.write_json(os.path.join(d, "simulated/x/workloads/w.json"), {"name": "w"})
            p = self.run_script(d)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("3 MPipeMoE runs", p.stdout)
        self.assertIn("2 within 5%", p.stdout)
        self.assertIn("| simulated | dgx-a100x1 | fp32 | S3 | 2 | 1.000 | 1.050 | 1.100 | 1 |", p.stdout)
        self.assertIn("| simulated | dgx-a100x1 | fp32 | none | 1 | 1.020 | 1.020 | 1.020 | 0 |", p.stdout)
        self.assertIn("| simulated/x/b.json | 2 | 2 | S3 | 110.0 | 100.0 | 1.100 |", p.stdout)
        self.assertNotIn("a.json", p.stdout)

    def test_nothing_to_report(self):
        with tempfile.TemporaryDirectory() as d:
            p = self.run_script(d)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("no MPipeMoE results with a memory-model prediction", p.stdout)


if __name__ == "__main__":
    unittest.main()
