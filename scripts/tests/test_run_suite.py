"""Tests of the suite runner (scripts/run_suite.py): expanding suites, and with MOELAB set to a
moelab binary, a small suite end to end: results, summary, skips listed, a planted change in the
committed results kept aside until --update-baseline.

    MOELAB=build/harness/moelab /usr/bin/python3 -m unittest -v test_run_suite   (from scripts/tests)
"""
import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import fixtures
import moelab_results as mr
import run_suite

RUNNER = os.path.join(fixtures.SCRIPTS, "run_suite.py")


def fake_suite(folder, change=None):
    s = fixtures.suite()
    if change:
        change(s)
    path = os.path.join(folder, "experiments", s["name"], "suite.json")
    mr.write_json(path, s)
    return path


class Expand(unittest.TestCase):
    def test_registered_quick_subsets_are_in_the_full_runs(self):
        for path in mr.registered_suites():
            s = mr.load_suite(path)
            run_suite.check_quick_subset(s)
            full = {j.get("path_template", "") + str(j.get("dest")) + j["workload"] + j["impl"]["label"]
                    + str(j["cluster"]) + str(j["ranks"]) for j in run_suite.expand(s, False)}
            for j in run_suite.expand(s, True):
                key = (j.get("path_template", "") + str(j.get("dest")) + j["workload"] + j["impl"]["label"]
                       + str(j["cluster"]) + str(j["ranks"]))
                self.assertIn(key, full, f"{s['name']}: a quick run that the full run lacks")

    def test_quick_overrides(self):
        s = mr.load_suite("foundation")
        cpu = [j for j in run_suite.expand(s, True) if j.get("run") == "cpu"]
        self.assertEqual({j["workload"] for j in cpu}, {"tiny"})
        self.assertEqual(sorted(j["ranks"] for j in cpu), [1, 4])

    def test_quick_point_outside_the_full_run_is_an_error(self):
        with tempfile.TemporaryDirectory() as d:
            path = fake_suite(d, lambda s: s["grid"]["quick_sweeps"][0].update(tokens_per_gpu=[512]))
            with self.assertRaises(mr.SchemaError) as cm:
                run_suite.check_quick_subset(mr.load_suite(path))
            self.assertIn("grid.quick_sweeps", str(cm.exception))
            p = subprocess.run([sys.executable, RUNNER, "--suite", path, "--list"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
            self.assertEqual(p.returncode, 2)
            self.assertIn("is not a point of grid.sweeps", p.stderr)

    def test_list(self):
        with tempfile.TemporaryDirectory() as d:
            p = subprocess.run([sys.executable, RUNNER, "--suite", fake_suite(d), "--list", "--quick"],
                               stdout=subprocess.PIPE, text=True)
            self.assertEqual(p.returncode, 0)
            self.assertIn("fake: 3 runs (quick)", p.stdout)

    def test_select_runs(self):
        s = mr.load_suite(fake_suite(self.tmp()))
        plan = [(s, run_suite.expand(s, False))]
        kept = run_suite.select_runs(plan, ["sim"], False)
        self.assertEqual([(j["kind"], j["run"]) for _, js in kept for j in js], [("run", "sim")])
        with self.assertRaises(mr.SchemaError) as cm:
            run_suite.select_runs(plan, ["nope"], False)
        self.assertIn("--run nope: no run with this id", str(cm.exception))
        self.assertIn("fake:gpu, fake:sim", str(cm.exception))
        with self.assertRaises(mr.SchemaError) as cm:
            run_suite.select_runs([(s, run_suite.expand(s, True))], ["gpu"], True)
        self.assertIn("not in the quick subset", str(cm.exception))

    def test_list_one_run(self):
        p = subprocess.run([sys.executable, RUNNER, "--suite", fake_suite(self.tmp()), "--list", "--run", "gpu"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("fake: 1 runs (full, --run gpu)", p.stdout)
        p = subprocess.run([sys.executable, RUNNER, "--suite", fake_suite(self.tmp()), "--list", "--run", "x"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--run x: no run with this id", p.stderr)

    def test_second_run_into_one_folder_is_refused(self):
        out = self.tmp()
        with open(os.path.join(out, ".run_suite.lock"), "w") as held:
            held.write("4242")
            held.flush()
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.makedirs(os.path.join(out, "candidate", "x"))
            p = subprocess.run([sys.executable, RUNNER, "--suite", fake_suite(self.tmp()), "--out", out,
                                "--moelab", shutil.which("true")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        self.assertIn("another run_suite.py (pid 4242) is writing into " + out, p.stderr)
        self.assertTrue(os.path.isdir(os.path.join(out, "candidate", "x")))  # the first run's staging is untouched

    def test_mpipemoe_gpu_runs_pair_with_their_simulated_counterparts(self):
        """plots/mpipemoe_gpu.py pairs the gpu run's files with the gpu-sim run's by name."""
        s = mr.load_suite("mpipemoe")
        runs = {r["id"]: r for r in s["runs"]}
        gpu, sim = runs["gpu"], runs["gpu-sim"]
        self.assertEqual((gpu["backend"], gpu["ranks"], sim["backend"], sim["ranks"]), ("cuda", [1], "sim", [1]))
        self.assertEqual((gpu["workloads"], gpu["impls"]), (sim["workloads"], sim["impls"]))
        self.assertEqual(sorted(sim["clusters"]), ["h100x1", "h200x1"])
        self.assertEqual(gpu["path"], "measured/cuda/{device}/mpipemoe/{workload}-{impl}")
        self.assertEqual(sim["path"], "simulated/{cluster}/mpipemoe/{workload}-{impl}")
        self.assertFalse(sim.get("quick", False))

    def tmp(self):
        d = tempfile.TemporaryDirectory()
        self.addCleanup(d.cleanup)
        return d.name


@unittest.skipUnless(os.environ.get("MOELAB"), "set MOELAB to a moelab binary")
class EndToEnd(unittest.TestCase):
    def run_suite(self, *extra):
        p = subprocess.run([sys.executable, RUNNER, "--suite", self.suite, "--out", self.results, "--backends", "sim,cpu",
                            "--moelab", os.environ["MOELAB"]] + list(extra),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return p.returncode, p.stdout

    def test_run_rerun_plant_accept(self):
        with tempfile.TemporaryDirectory() as d:
            self.suite = fake_suite(d)
            self.results = os.path.join(d, "results")
            rc, out = self.run_suite()
            self.assertEqual(rc, 0, out)
            self.assertRegex(out, r"\[fake full 5/5 \| all 5/5\] .*elapsed .* left")
            grid = os.path.join(self.results, "simulated/fake/dgx-a100x1/M-fp32-T256-Base.json")
            self.assertEqual(mr.load_result(grid)["mode"], "simulated")
            self.assertTrue(os.path.exists(os.path.join(self.results, "simulated/dgx-a100x1/tiny-Base.trace.json")))
            s = mr.load_summary(os.path.join(self.results, "simulated/fake/summary.json"))
            self.assertEqual((s["subset"], s["mode"], len(s["points"])), ("full", "simulated", 2))
            self.assertEqual(s["claims"][0]["compared_on"], "paper_setup")
            self.assertIn("backend cuda not selected", [r for r in s["runs"] if r["id"] == "gpu"][0]["skipped"])
            self.assertIn("skipped gpu (1 runs): backend cuda not selected", out)

            rc, out = self.run_suite()
            self.assertEqual(rc, 0, out)
            self.assertIn("0 differ", out)

            planted = mr.load_json(grid)
            true_step = planted["metrics"]["step_time_s"]["median"]
            planted["metrics"]["step_time_s"]["median"] = true_step * 1.01
            mr.write_json(grid, planted)
            rc, out = self.run_suite()
            self.assertEqual(rc, 1, out)
            self.assertIn("DIFFERS simulated/fake/dgx-a100x1/M-fp32-T256-Base.json", out)
            self.assertIn("metrics.step_time_s.median", out)
            self.assertIn("rerun with --update-baseline", out)
            self.assertEqual(mr.load_json(grid)["metrics"]["step_time_s"]["median"], true_step * 1.01)
            self.assertTrue(os.path.exists(os.path.join(self.results, "candidate/simulated/fake/dgx-a100x1/"
                                                                      "M-fp32-T256-Base.json")))

            rc, out = self.run_suite("--update-baseline")
            self.assertEqual(rc, 0, out)
            self.assertEqual(mr.load_json(grid)["metrics"]["step_time_s"]["median"], true_step)
            self.assertFalse(os.path.exists(os.path.join(self.results, "candidate")))

    def test_one_run_writes_its_results_and_no_summary(self):
        with tempfile.TemporaryDirectory() as d:
            self.suite = fake_suite(d)
            self.results = os.path.join(d, "results")
            rc, out = self.run_suite("--run", "sim")
            self.assertEqual(rc, 0, out)
            self.assertRegex(out, r"\[fake full 1/1 \| all 1/1\]")
            self.assertEqual(mr.load_result(os.path.join(self.results, "simulated/dgx-a100x1/tiny-Base.json"))["mode"],
                             "simulated")
            self.assertFalse(os.path.exists(os.path.join(self.results, "simulated/fake/summary.json")))
            self.assertFalse(os.path.exists(os.path.join(self.results, "simulated/fake/dgx-a100x1")))
            self.assertIn("summary: not written (--run sim: a partial run)", out)


if __name__ == "__main__":
    unittest.main()
