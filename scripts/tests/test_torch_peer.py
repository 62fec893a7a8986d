"""Tests of the PyTorch peer (scripts/peers/torch_moe.py) that need neither torch nor a GPU.

    /usr/bin/python3 -m unittest -v test_torch_peer      (from scripts/tests)

Its shapes are the cuda runs' workload shapes; it skips cleanly (exit 0, nothing written)
without torch and with a torch that sees no CUDA device; --list and bad --shape input.
"""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import unittest

import fixtures
import moelab_results as mr

SCRIPT = os.path.join(fixtures.SCRIPTS, "peers", "torch_moe.py")
COMMITTED = os.path.join(fixtures.ROOT, "results", "measured", "cuda", "nvidia-h100-80gb-hbm3", "peers",
                         "torch-moe.jsonl")


def load_peer():
    spec = importlib.util.spec_from_file_location("torch_moe", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def workload_shape(path):
    w = mr.load_json(path)
    m = w["model"]
    return (m["d_model"], m["d_hidden"], m["num_experts"], w["tokens_per_rank"], m["top_k"])


class Shapes(unittest.TestCase):
    def setUp(self):
        self.peer = load_peer()
        self.shapes = {s[1:] for s in self.peer.SHAPES}

    def test_named_shapes_are_their_workloads(self):
        named = [s for s in self.peer.SHAPES if s[0]]
        self.assertGreaterEqual(len(named), 3)
        for w, *shape in named:
            path = os.path.join(fixtures.ROOT, "experiments", "workloads", w + ".json")
            self.assertTrue(os.path.exists(path), path)
            self.assertEqual(tuple(shape), workload_shape(path), w)
            model = mr.load_json(path)["model"]
            self.assertEqual(model["dtype"], "bf16", w)  # the peer runs bf16
            self.assertEqual(model.get("capacity_factor", 0), 0, w)  # and drops no tokens

    def test_every_capacity_free_cuda_workload_has_its_shape(self):
        """Each workload a suite runs on the cuda backend without a capacity limit (bf16 or tf32)
        has a peer shape; capacity-limited ones ("small") have none by design."""
        seen = 0
        for p in mr.registered_suites():
            suite = mr.load_suite(p)
            for run in suite.get("runs", []):
                if run["backend"] != "cuda":
                    continue
                for w in run.get("workloads", []):
                    path = os.path.join(fixtures.ROOT, "experiments", "workloads", w + ".json")
                    if mr.load_json(path)["model"].get("capacity_factor", 0) != 0:
                        continue
                    seen += 1
                    self.assertIn(workload_shape(path), self.shapes, f"{suite['name']} run {run['id']}: {w}")
        self.assertGreater(seen, 0, "no cuda run found in the suites")

    def test_committed_peer_lines_are_peer_shapes(self):
        """Every line of the committed peer file is a shape the script measures, with its FLOPs."""
        with open(COMMITTED) as f:
            lines = [json.loads(l) for l in f if l.strip()]
        self.assertTrue(lines)
        for r in lines:
            shape = (r["M"], r["H"], r["E"], r["tokens"], r["k"])
            self.assertIn(shape, self.shapes)
            self.assertAlmostEqual(r["expert_tflop"], self.peer.expert_tflop(r["M"], r["H"], r["tokens"], r["k"]))
            for key in ("floor_ms", "torch_grouped_mm_ms", "torch_loop_ms", "device", "torch"):
                self.assertIn(key, r)


class Skips(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="torch_peer_test.")
        self.out = os.path.join(self.tmp.name, "out", "torch-moe.jsonl")

    def tearDown(self):
        self.tmp.cleanup()

    def run_with(self, fake_torch, *args):
        """The script with a stand-in torch first on the path (a module that fails to import, or
        one without a device), so the test means the same on a machine that has torch."""
        fake = os.path.join(self.tmp.name, "fake")
        os.makedirs(os.path.join(fake, "torch"), exist_ok=True)
        with open(os.path.join(fake, "torch", "__init__.py"), "w") as f:
            f.write(fake_torch)
        env = dict(os.environ, PYTHONPATH=fake, PYTHONDONTWRITEBYTECODE="1")
        return subprocess.run([sys.executable, SCRIPT, "--out", self.out] + list(args), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)

    def test_without_torch(self):
        p = self.run_with("raise ImportError('No module named torch')\n")
        self.assertEqual(p.returncode, 0, p.stdout)
        self.assertIn("skipped: PyTorch cannot be imported", p.stdout)
        self.assertFalse(os.path.exists(self.out))

    def test_without_cuda_device(self):
        p = self.run_with("__version__ = '9.9'\nclass cuda:\n    @staticmethod\n    def is_available():\n"
                          "        return False\n")
        self.assertEqual(p.returncode, 0, p.stdout)
        self.assertIn("skipped: PyTorch 9.9 sees no CUDA device", p.stdout)
        self.assertFalse(os.path.exists(self.out))

    def test_list_and_bad_shape(self):
        p = self.run_with("raise ImportError('no torch')\n", "--list")
        self.assertEqual(p.returncode, 0, p.stdout)
        self.assertIn("gpt3-xl-e64-16k", p.stdout)
        self.assertEqual(len(p.stdout.strip().splitlines()), len(load_peer().SHAPES))
        p = self.run_with("raise ImportError('no torch')\n", "--shape", "2048,8192,64")
        self.assertEqual(p.returncode, 2)
        self.assertIn("--shape '2048,8192,64'", p.stdout)
        p = self.run_with("raise ImportError('no torch')\n", "--shape", "64,128,2,100,3")
        self.assertEqual(p.returncode, 2)
        self.assertIn("top_k <= experts", p.stdout)


if __name__ == "__main__":
    unittest.main()
