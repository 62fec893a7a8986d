"""Tests of the report generator (plots/report.py) on a fixture: a suite, its summary, a figure.

    /usr/bin/python3 -m unittest -v test_report      (from plots/tests)
"""
import json
import os
import shutil
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

    def report_text(self):
        """The report written for the fixture results (the run must succeed)."""
        p = self.report()
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(self.out) as f:
            return f.read()

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
        self.assertIn("**simulated** on the cluster models dgx-a100x1, dgx-a100x8 with the cluster-file models, no measured profile", text)
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
                      '(8 GPUs) | simulated (cluster-file models, no measured profile) | 8.000 | 10% | 50% | 80% |', text)
        self.assertIn("| r | tiny-moe | all | top2 | inference | pcie-a30x1 (? GPUs) | not run: no --inference |", text)
        # the claim on runs: which runs, and the points used; one system's range
        self.assertIn("| fakemodels | 1.3x faster than top-2 | Fake et al., abstract | 1.30x | 1.25x | runs "
                      "(pcie-a30x1; training; every model): pcie-a30x1 training tiny-moe: 1.25x, 1 points | "
                      "simulated | yes | yes |", text)
        self.assertIn("| 70% to 100% | not run |", text)
        self.assertIn("a claim on runs lists the runs it used", text)

    def gpu_fixture(self, step, grouped):
        """A measured cuda result of the fixture suite's "gpu" run (tiny, Base, one rank), a peer
        line of its shape and one of a shape no workload has, and a validation comparison."""
        dev = os.path.join(self.results, "measured", "cuda", "nvidia-h100-80gb-hbm3")
        r = fixtures.result("measured", step=step, device="NVIDIA H100 80GB HBM3 (79.2 GiB)")
        r.update(backend="cuda", impl="fastmoe", world_size=1, commit="e25e2a0bc39d")
        r["metrics"]["gemm_path_table"] = "the built-in H100 table"
        r["workload"]["model"].update(dtype="bf16", capacity_factor=0, top_k=1)
        mr.write_json(os.path.join(dev, "tiny-Base-np1.json"), r)
        line = {"floor_ms": 1.0, "torch_grouped_mm_ms": grouped, "torch_loop_ms": 9.0, "M": 64, "H": 256, "E": 8,
                "tokens": 512, "k": 1, "expert_tflop": 1e-4, "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0"}
        other = dict(line, M=32, torch_grouped_mm_ms=None, torch_grouped_mm_error="no sm_90 kernel")
        del other["torch_grouped_mm_ms"]
        os.makedirs(os.path.join(dev, "peers"))
        with open(os.path.join(dev, "peers", "torch-moe.jsonl"), "w") as f:
            f.write(json.dumps(line) + "\n" + json.dumps(dict(other, peer="torch", commit="abc")) + "\n")
        conf = {"workload": "c1", "measured_step_s": 0.002, "simulated_step_s": 0.0025, "step_error": 0.25,
                "phases": {p: {"measured_s": 1e-3, "simulated_s": 1e-3, "error": 0.1}
                           for p in ("gate", "dispatch", "experts", "combine")}}
        mr.write_json(os.path.join(self.results, "validation", "nvidia-h100-80gb-hbm3", "comparison.json"),
                      {"schema": "moelab.sim-validation/1", "mode": "comparison of measured and simulated",
                       "device": "NVIDIA H100 80GB HBM3 (79.2 GiB)", "backend": "cuda", "commit": "e25e2a0bc39d",
                       "date": "2026-11-22T20:06:49Z", "cluster_model": "h100x1", "calibration": "cuda-vm",
                       "median_step_error": 0.225, "worst_step_error": 0.397, "configurations": [conf]})

    def test_gpu_measurements(self):
        self.gpu_fixture(step=0.003, grouped=2.0)
        p = self.report()
        self.assertEqual(p.returncode, 0, p.stderr)
        with open(self.out) as f:
            text = f.read()
        self.assertIn("[Measured on GPUs](#measured-on-gpus)", text)
        self.assertIn("### NVIDIA H100 80GB HBM3", text)
        self.assertIn("Measured on one NVIDIA H100 80GB HBM3 at commit e25e2a0bc39d (2026-11-22)", text)
        # moelab, PyTorch grouped, PyTorch loop, floor, and the ratios; the shape without a workload
        self.assertIn("| 64 / 256 / 8 / 512 (1) | 3.00 ([json](../results/measured/cuda/nvidia-h100-80gb-hbm3/"
                      "tiny-Base-np1.json)) | 2.00 | 9.00 | 1.00 | 1.50x | 3.00x | 2.00x |", text)
        self.assertIn("| 32 / 256 / 8 / 512 (1) | not run (no moelab workload of this shape) | no sm_90 kernel |", text)
        self.assertIn("**moelab is slower than PyTorch's grouped layer** on 1 of 1 shapes measured by both "
                      "(1.50x PyTorch's time)", text)
        self.assertIn("PyTorch 2.11.0 layer", text)
        self.assertIn("Lines without `\"peer\": \"torch\"`", text)
        # the runs, which suite runs were measured, the validation
        self.assertIn("| [tiny-Base-np1.json](../results/measured/cuda/nvidia-h100-80gb-hbm3/tiny-Base-np1.json) | "
                      "tiny | fastmoe | bf16 | chosen per call | 3.000 | 13 | 1.11x |", text)
        self.assertIn("1 of the 1 single-GPU cuda runs of the suites measured.", text)
        self.assertIn("**median step-time error 22.5%, worst 39.7%**", text)
        self.assertIn("| c1 | 2.000 | 2.500 | 25.0% | 10.0% | 10.0% |", text)

    def test_the_path_choice_against_a_forced_path(self):
        # A run forced to one cuBLAS path (<workload>-<impl>-<path>-np<ranks>, the foundation
        # suite's cuda-grouped) is set beside the run of the same name that chose its paths.
        self.gpu_fixture(step=0.003, grouped=2.0)
        dev = os.path.join(self.results, "measured", "cuda", "nvidia-h100-80gb-hbm3")
        r = mr.load_result(os.path.join(dev, "tiny-Base-np1.json"))
        r["metrics"]["step_time_s"] = {k: 0.0045 for k in ("median", "mean", "min", "max")}
        r["metrics"]["step_time_s"]["all"] = [0.0045]
        r["metrics"]["gemm_path_forced"] = "grouped"
        mr.write_json(os.path.join(dev, "tiny-Base-grouped-np1.json"), r)
        text = self.report_text()
        self.assertIn("| tiny | fastmoe | bf16 | `grouped` (forced) | 4.500 |", text)
        # A result from before the path choice records no table: its path is not recorded.
        del r["metrics"]["gemm_path_forced"], r["metrics"]["gemm_path_table"]
        mr.write_json(os.path.join(dev, "tiny-Base-old-np1.json"), r)
        self.assertIn("| tiny | fastmoe | bf16 | not recorded | 4.500 |", self.report_text())
        self.assertIn("Every expert call on one path against the paths chosen per call (step time, the same device): "
                      "tiny-Base-grouped-np1: 4.500 ms against 3.000 ms with the paths chosen per call (1.50x).", text)

    def test_gpu_re_simulations(self):
        # A validation set re-simulated by a later model (scripts/resimulate.py) and the MPipeMoE
        # runs re-simulated likewise: each said with the commit, model and forced path, the
        # MPipeMoE figure also over the bf16 runs that copy nothing to the host.
        self.gpu_fixture(step=0.003, grouped=2.0)
        vdir = os.path.join(self.results, "validation", "nvidia-h100-80gb-hbm3")
        conf = lambda name, err, exp: {"workload": name, "measured_step_s": 1.0, "simulated_step_s": 1.0 + err,
                                       "step_error": err,
                                       "phases": {p: {"measured_s": 1e-3, "simulated_s": 1e-3,
                                                      "error": exp if p == "experts" else 0.5}
                                                  for p in ("gate", "dispatch", "experts", "combine")}}
        mr.write_json(os.path.join(vdir, "hindcast-a", "comparison.json"),
                      {"schema": "moelab.sim-validation/1", "mode": "comparison of measured and simulated",
                       "device": "NVIDIA H100 80GB HBM3 (79.2 GiB)", "backend": "cuda", "commit": "e25e2a0bc39d",
                       "date": "2026-11-22T20:06:49Z", "cluster_model": "h100x1", "calibration": "datasheet",
                       "gemm_calibration": "h100-sxm5", "simulated_commit": "128d4b624c60", "gemm_path_forced": "grouped",
                       "median_step_error": 0.145, "worst_step_error": 0.285,
                       "gemm_paths_agree": {"configurations": 2, "agree": 1},
                       "configurations": [dict(conf("c1", 0.145, 0.021), gemm_paths={"agree": True, "differ": {}}),
                                          dict(conf("c2", 0.285, 0.114), gemm_paths={"agree": False, "differ": {
                                              "experts.fc1": {"measured": {"grouped": 3},
                                                              "simulated": {"loop": 3}}}})]})
        row = lambda dtype, strategy, ratio: {"dtype": dtype, "strategy": strategy, "step_s": {"ratio": ratio}}
        mr.write_json(os.path.join(vdir, "hindcast-b", "comparison.json"),
                      {"schema": "moelab.gpu-comparison/1", "cluster_model": "h100x1", "pairs": 4,
                       "simulated_commits": ["128d4b624c60"], "simulated_gemm_path_forced": ["grouped"],
                       "step_ratio": {"median": 2.0, "min": 0.8, "max": 16.0},
                       "rows": [row("bf16", "none", 0.8), row("bf16", "S4", 1.25), row("tf32", "none", 2.0),
                                row("bf16", "S1", 16.0)]})
        text = self.report_text()
        self.assertIn("Re-simulated at commit 128d4b624c60 by the catalogue's h100x1 model (GEMM calibration "
                      "`h100-sxm5`, the expert GEMM calls forced to the `grouped` path", text)
        self.assertIn("median step-time error 14.5%, worst 28.5%; the experts phase 2.1-11.4%", text)
        # compare_sim.py's path check: which configurations the sim priced on the GPU's paths
        self.assertIn("Expert GEMM paths: the sim priced every call on the cuBLAS path the GPU ran it on in 1 of 2 "
                      "configurations; not in c2 experts.fc1.", text)
        # |1/0.8 - 1| = 25%, |1/1.25 - 1| = 20%: median 22.5%, worst 25.0%; tf32 and S1 left out
        self.assertIn("The 4 MPipeMoE runs above re-simulated at commit 128d4b624c60", text)
        self.assertIn("of them the 2 bf16 runs that copy nothing to the host (no restore strategy, or S4): "
                      "median |simulated - measured| / measured 22.5%, worst 25.0%", text)

    def test_gemm_path_agreement_lines(self):
        # plots/mpipemoe_gpu.py's per-run rows name the run's impl; compare_sim.py's
        # configurations only their workload; nothing without a count.
        sys.path.insert(0, os.path.join(ROOT, "plots"))
        import report
        differ = {"agree": False, "differ": {"fc1_dgrad": {"measured": {"grouped": 5}, "simulated": {"loop": 5}}}}
        runs = {"gemm_paths_agree": {"configurations": 2, "agree": 1},
                "rows": [{"workload": "w", "impl": "n4", "gemm_paths": differ}, {"workload": "w", "impl": "n16"}]}
        self.assertEqual(report.gemm_paths_agree_lines(runs),
                         ["Expert GEMM paths: the sim priced every call on the cuBLAS path the GPU ran it on in 1 of 2 "
                          "runs; not in w n4 fc1_dgrad.", ""])
        confs = {"gemm_paths_agree": {"configurations": 1, "agree": 1},
                 "configurations": [{"workload": "c1", "gemm_paths": {"agree": True, "differ": {}}}]}
        self.assertEqual(report.gemm_paths_agree_lines(confs),
                         ["Expert GEMM paths: the sim priced every call on the cuBLAS path the GPU ran it on in 1 of 1 "
                          "configurations.", ""])
        self.assertEqual(report.gemm_paths_agree_lines({"rows": []}), [])

    def test_gpu_measurements_faster_and_absent(self):
        self.gpu_fixture(step=0.001, grouped=2.0)
        self.assertEqual(self.report().returncode, 0)
        with open(self.out) as f:
            text = f.read()
        self.assertNotIn("moelab is slower", text)
        self.assertIn("moelab is faster than PyTorch's grouped layer on 1 of 1 shapes measured by both "
                      "(0.50x PyTorch's time)", text)
        shutil.rmtree(os.path.join(self.results, "measured", "cuda"))
        shutil.rmtree(os.path.join(self.results, "validation"))
        self.assertEqual(self.report().returncode, 0)
        with open(self.out) as f:
            self.assertNotIn("Measured on GPUs", f.read())

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
