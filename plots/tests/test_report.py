"""Tests of the report generator (plots/report.py) on a fixture: a suite, its summary, a figure.

    /usr/bin/python3 -m unittest -v test_report      (from plots/tests)
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

REPORT = os.path.join(ROOT, "plots", "report.py")


class Report(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="report_test.")
        d = self.tmp.name
        self.experiments = os.path.join(d, "experiments")
        self.results = os.path.join(d, "results")
        self.out = os.path.join(d, "docs", "RESULTS.md")
        mr.write_json(os.path.join(self.experiments, "fake", "suite.json"), fixtures.suite())
        mr.write_json(os.path.join(self.results, "simulated", "fake", "summary.json"), fixtures.summary())
        os.makedirs(os.path.join(self.results, "figures"))
        with open(os.path.join(self.results, "figures", "fake-bars.png"), "wb") as f:
            f.write(fixtures.TINY_PNG)

    def tearDown(self):
        self.tmp.cleanup()

    def report(self):
        return subprocess.run([sys.executable, REPORT, "--experiments", self.experiments, "--results", self.results,
                               "--out", self.out], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def test_claims_figures_and_provenance(self):
        p = self.report()
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(self.out) as f:
            text = f.read()
        # the claim beside ours, with its source, and the verdict columns
        self.assertIn("| fake | up to 2.8x faster than Base | Fake et al., Figure 7 | 2.80x | 2.00x | "
                      "the paper's setup (dgx-a100x8, fp32), 1 points | simulated | yes | no |", text)
        # the figure, embedded with a link relative to the report, its caption and mode
        self.assertIn("![fake bars: fake-bars.png](../results/figures/fake-bars.png)", text)
        self.assertIn("**bars** (simulated). Bars of the fake suite.", text)
        # measured and simulated said where they apply; the skipped run is named
        self.assertIn("**measured** on cpu backend, AMD EPYC (2 threads, OpenBLAS)", text)
        self.assertIn("**simulated** on the cluster models dgx-a100x1, dgx-a100x8 with the datasheet calibration", text)
        self.assertIn("| cpu | tiny | Base | cpu | 4 ranks | measured (AMD EPYC (2 threads, OpenBLAS)) | 30.000 |", text)
        self.assertIn("not run: no CUDA device here", text)
        self.assertIn("| skipped | run gpu (1): no CUDA device here |", text)
        # the same inputs give the same text
        self.report()
        with open(self.out) as f:
            self.assertEqual(f.read(), text)

    def test_out_of_memory_point_is_named(self):
        s = fixtures.summary()
        pt2 = s["points"][1]
        del pt2["results"]["Base"]
        pt2["out_of_memory"] = {"Base": "moelab: error: rank 0: out of device memory"}
        pt2["speedup"], pt2["memory_saving"] = {}, {}
        mr.write_json(os.path.join(self.results, "simulated", "fake", "summary.json"), s)
        p = self.report()
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(self.out) as f:
            text = f.read()
        self.assertIn("| dgx-a100x1 | M | fp32 | 2048 | 16384 | out of memory | 4.000 (n=2) |", text)

    def test_whole_model_runs_and_claims_on_runs(self):
        mr.write_json(os.path.join(self.experiments, "fakemodels", "suite.json"), fixtures.model_suite())
        summ = fixtures.model_summary()
        summ["runs"][2]["override"] = {"scmoe": {"position": "pos3"}}
        mr.write_json(os.path.join(self.results, "simulated", "fakemodels", "summary.json"), summ)
        p = self.report()
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(self.out) as f:
            text = f.read()
        self.assertIn("### Whole-model runs", text)
        self.assertIn('| sc | tiny-moe with `{"scmoe":{"position":"pos3"}}` | all | Sc-Pos3 | training | pcie-a30x1 '
                      '(8 GPUs) | simulated (datasheet calibration) | 8.000 | 10% | 50% | 80% |', text)
        self.assertIn("| r | tiny-moe | all | top2 | inference | pcie-a30x1 (? GPUs) | not run: no --inference |", text)
        # the claim on runs: which runs, and the points used; one system's range
        self.assertIn("| fakemodels | 1.3x faster than top-2 | Fake et al., abstract | 1.30x | 1.25x | runs "
                      "(pcie-a30x1; training; every model): pcie-a30x1 training tiny-moe: 1.25x, 1 points | "
                      "simulated | yes | yes |", text)
        self.assertIn("| 70% to 100% | not run |", text)
        self.assertIn("a claim on runs lists the runs it used", text)

    def test_missing_figure_is_named(self):
        os.unlink(os.path.join(self.results, "figures", "fake-bars.png"))
        self.assertEqual(self.report().returncode, 0)
        with open(self.out) as f:
            self.assertIn("Not made in this results folder: bars", f.read())

    def test_missing_summary_is_a_clear_error(self):
        summary = os.path.join(self.results, "simulated", "fake", "summary.json")
        os.unlink(summary)
        p = self.report()
        self.assertEqual(p.returncode, 2)
        self.assertIn(f"report.py: {summary}: missing: suite fake has no summary", p.stderr)
        self.assertFalse(os.path.exists(self.out))

    def test_malformed_summary_is_a_clear_error(self):
        summary = os.path.join(self.results, "simulated", "fake", "summary.json")
        s = fixtures.summary()
        del s["claims"][0]["verdict"]
        mr.write_json(summary, s)
        p = self.report()
        self.assertEqual(p.returncode, 2)
        self.assertIn(f'{summary}: field "claims[0].verdict": missing', p.stderr)


if __name__ == "__main__":
    unittest.main()
