"""scripts/resimulate.py: a validation set's measured runs simulated again by another model.

On two of the committed H100 configurations (measured at commit e25e2a0, with their routing):
the re-simulation replays each run's own routing, prices the forced GEMM path, writes the
comparison whole; bad input and a failing run are named, exit non-zero and leave the folder as
it was. Needs MOELAB (a moelab binary); run by ctest as py_resimulate.
"""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import unittest

import fixtures

SCRIPT = os.path.join(fixtures.ROOT, "scripts", "resimulate.py")
SRC = os.path.join(fixtures.ROOT, "results", "validation", "nvidia-h100-80gb-hbm3")


def load(path):
    with open(path) as f:
        return json.load(f)


def text(path):
    with open(path) as f:
        return f.read()


@unittest.skipUnless(os.environ.get("MOELAB"), "set MOELAB to a moelab binary")
class Resimulate(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="test_resimulate.")
        self.dir = os.path.join(self.tmp, "set")
        for sub in ("workloads", "measured"):
            os.makedirs(os.path.join(self.dir, sub))
        for c in ("c1", "c3"):
            shutil.copy(os.path.join(SRC, "workloads", c + ".json"), os.path.join(self.dir, "workloads"))
            for suffix in (".json", ".routing.json"):
                shutil.copy(os.path.join(SRC, "measured", c + suffix), os.path.join(self.dir, "measured"))

    def tearDown(self):
        shutil.rmtree(self.tmp, ignore_errors=True)

    def run_it(self, *args):
        return subprocess.run([sys.executable, SCRIPT, self.dir, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)

    def leftovers(self):
        return sorted(n for n in os.listdir(self.dir) if n not in ("workloads", "measured"))

    def test_replays_the_routing_and_prices_the_forced_path(self):
        p = self.run_it("--cluster", "h100x1", "--gemm-path", "grouped", "--into", "grouped")
        self.assertEqual(p.returncode, 0, p.stderr)
        out = os.path.join(self.dir, "grouped")
        cmp_ = load(os.path.join(out, "comparison.json"))
        self.assertEqual(cmp_["schema"], "moelab.sim-validation/1")
        self.assertEqual((cmp_["cluster_model"], cmp_["gemm_path_forced"], cmp_["commit"]), ("h100x1", "grouped", "e25e2a0bc39d"))
        self.assertEqual(len(cmp_["configurations"]), 2)
        errors = []
        for c in ("c1", "c3"):
            m = load(os.path.join(self.dir, "measured", c + ".json"))
            s = load(os.path.join(out, "simulated", c + ".json"))
            self.assertEqual(s["mode"], "simulated")
            self.assertEqual(s["metrics"]["gemm_path_forced"], "grouped")
            # The measured run's own routing, replayed token for token.
            self.assertEqual(s["metrics"]["routing"]["recv_per_local_expert"], m["metrics"]["routing"]["recv_per_local_expert"])
            ms, ss = m["metrics"]["step_time_s"]["median"], s["metrics"]["step_time_s"]["median"]
            errors.append(abs(ss - ms) / ms)
        self.assertAlmostEqual(cmp_["median_step_error"], statistics.median(errors), places=12)
        self.assertAlmostEqual(cmp_["worst_step_error"], max(errors), places=12)
        self.assertEqual(self.leftovers(), ["grouped"])  # no temporary folder left

        # Again into the same folder, with a stray file beside the measured runs (not a cN):
        # the folder is replaced whole, and the stray file is no configuration.
        shutil.copy(os.path.join(self.dir, "measured", "c1.json"), os.path.join(self.dir, "measured", "c1-old.json"))
        p = self.run_it("--cluster", "h100x1", "--gemm-path", "grouped", "--into", "grouped")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(load(os.path.join(out, "comparison.json"))["configurations"], cmp_["configurations"])
        self.assertEqual(sorted(os.listdir(os.path.join(out, "simulated"))), ["c1.json", "c3.json"])
        self.assertEqual(self.leftovers(), ["grouped"])

        # The table's own choice prices the experts differently (E = 8 experts of about 1024
        # rows: the loop, faster than the grouped call there), and says no path was forced.
        p = self.run_it("--cluster", "h100x1", "--into", "auto")
        self.assertEqual(p.returncode, 0, p.stderr)
        auto = load(os.path.join(self.dir, "auto", "comparison.json"))
        self.assertNotIn("gemm_path_forced", auto)
        self.assertLess(auto["configurations"][0]["phases"]["experts"]["simulated_s"],
                        cmp_["configurations"][0]["phases"]["experts"]["simulated_s"])

    def test_replays_the_implementation_and_its_options(self):
        # A run that records its implementation and options (impl_options) is replayed with them.
        c1 = os.path.join(self.dir, "measured", "c1.json")
        doc = load(c1)
        doc["impl"], doc["impl_options"] = "mpipemoe", {"partitions": 2, "strategy": "S4"}
        with open(c1, "w") as f:
            json.dump(doc, f)
        p = self.run_it("--cluster", "h100x1", "--into", "mp")
        self.assertEqual(p.returncode, 0, p.stderr)
        s = load(os.path.join(self.dir, "mp", "simulated", "c1.json"))
        self.assertEqual((s["impl"], s["impl_options"]), ("mpipemoe", {"partitions": 2, "strategy": "S4"}))
        self.assertEqual((s["impl_report"]["last_n"], s["impl_report"]["last_strategy"]), (2, "S4"))
        s3 = load(os.path.join(self.dir, "mp", "simulated", "c3.json"))
        self.assertEqual((s3["impl"], s3["impl_options"]), ("fastmoe", {}))  # recorded nothing: fastmoe

    def test_bad_input_is_named_and_leaves_the_folder_as_it_was(self):
        os.makedirs(os.path.join(self.dir, "kept"))
        with open(os.path.join(self.dir, "kept", "comparison.json"), "w") as f:
            f.write("{}")
        cases = [
            (["--cluster", "h100x1", "--into", "measured"], "--into 'measured'"),
            (["--cluster", "h100x1", "--into", "a/b"], "--into 'a/b'"),
            # the A100 calibration has no per-path curves: moelab run refuses a forced grouped path
            (["--cluster", "dgx-a100x1", "--gemm-path", "grouped", "--into", "kept"], "has no per-path GEMM data"),
            (["--cluster", "nosuch", "--into", "kept"], "nosuch"),
        ]
        for args, fragment in cases:
            p = self.run_it(*args)
            self.assertEqual(p.returncode, 2, (args, p.stderr))
            self.assertIn(fragment, p.stderr)
            self.assertEqual(self.leftovers(), ["kept"], args)
            self.assertEqual(text(os.path.join(self.dir, "kept", "comparison.json")), "{}")
        with open(os.path.join(self.dir, "afile"), "w") as f:
            f.write("x")
        p = self.run_it("--cluster", "h100x1", "--into", "afile")
        self.assertEqual(p.returncode, 2)
        self.assertIn("exists and is not a folder", p.stderr)
        os.remove(os.path.join(self.dir, "afile"))
        # a measured run of another implementation from before impl_options were recorded: its
        # options are unknown, so no replay
        c1 = os.path.join(self.dir, "measured", "c1.json")
        doc = json.loads(text(c1))
        doc["impl"] = "mpipemoe"
        with open(c1, "w") as f:
            json.dump(doc, f)
        p = self.run_it("--cluster", "h100x1", "--into", "kept")
        self.assertEqual(p.returncode, 2)
        self.assertIn("impl = 'mpipemoe' without impl_options", p.stderr)
        self.assertEqual(self.leftovers(), ["kept"])
        doc["impl"] = "fastmoe"
        with open(c1, "w") as f:
            json.dump(doc, f)
        os.remove(os.path.join(self.dir, "measured", "c3.routing.json"))
        p = self.run_it("--cluster", "h100x1", "--into", "kept")
        self.assertEqual(p.returncode, 2)
        self.assertIn("c3.routing.json is missing", p.stderr)
        self.assertEqual(self.leftovers(), ["kept"])
        p = subprocess.run([sys.executable, SCRIPT, os.path.join(self.tmp, "none"), "--cluster", "h100x1", "--into", "x"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertEqual(p.returncode, 2)
        self.assertIn("not a folder", p.stderr)


if __name__ == "__main__":
    unittest.main()
