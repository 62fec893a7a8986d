"""Tests of the ScMoE suite's figures (plots/scmoe.py) and the all-to-all overlap of a trace
(moelab_results.all_to_all_overlap) on fixtures: a summary of whole-model runs and hand-made traces.

    /usr/bin/python3 -m unittest -v test_scmoe      (from plots/tests)
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

SCMOE = os.path.join(ROOT, "plots", "scmoe.py")


def trace(path, a2a, compute, extra_rank=None):
    """A Chrome trace of rank 0 (and optionally rank 1): compute-stream ops and all-to-alls on the
    dispatch stream, each (start, end) in microseconds."""
    ev = []
    for pid, (a, c) in enumerate([(a2a, compute)] + ([extra_rank] if extra_rank else [])):
        for tid, name in enumerate(("compute", "dispatch", "combine")):
            ev.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
            ev.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        for s, e in c:
            ev.append({"ph": "X", "name": "fc1", "cat": "experts", "pid": pid, "tid": 0, "ts": s, "dur": e - s,
                       "args": {"kind": "gemm", "phase": "experts"}})
        for s, e in a:
            ev.append({"ph": "X", "name": "all_to_all_v", "cat": "dispatch", "pid": pid, "tid": 1, "ts": s,
                       "dur": e - s, "args": {"kind": "collective", "phase": "dispatch"}})
    # the gradient all-reduce on the compute stream is communication, not compute, and not an all-to-all
    ev.append({"ph": "X", "name": "all_reduce", "cat": "grad_sync", "pid": 0, "tid": 0, "ts": 500, "dur": 100,
               "args": {"kind": "collective", "phase": "grad_sync"}})
    mr.write_json(path, {"traceEvents": ev, "otherData": {"mode": "simulated", "device": "simulated A30 in x",
                                                         "calibration": "datasheet", "commit": "abc"}})
    return path


class AllToAllOverlap(unittest.TestCase):
    def test_hidden_share_summed_over_ranks(self):
        with tempfile.TemporaryDirectory() as d:
            # rank 0: all-to-alls [0,10) and [20,30) (the second overlapping itself), compute [5,25):
            # hidden 5 + 5 of 20; rank 1: [0,10) under compute [0,100): all 10 hidden
            p = trace(os.path.join(d, "t.json"), [(0, 10), (20, 30), (22, 28)], [(5, 15), (15, 25)],
                      extra_rank=([(0, 10)], [(0, 100)]))
            self.assertAlmostEqual(mr.all_to_all_overlap(p), (10 + 10) / (20 + 10))
            # an op on the all-reduce's time does not count as compute
            p = trace(os.path.join(d, "u.json"), [(510, 520)], [(0, 5)])
            self.assertEqual(mr.all_to_all_overlap(p), 0.0)
            p = trace(os.path.join(d, "v.json"), [], [(0, 5)])
            self.assertIsNone(mr.all_to_all_overlap(p))

    def test_not_a_trace(self):
        with tempfile.TemporaryDirectory() as d:
            p = os.path.join(d, "x.json")
            mr.write_json(p, {"traceEvents": 3})
            with self.assertRaises(mr.SchemaError) as cm:
                mr.all_to_all_overlap(p)
            self.assertIn(p, str(cm.exception))


class Figures(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="scmoe_test.")
        self.d = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def summary(self):
        s = fixtures.model_summary()
        s["runs"] += [fixtures.model_row("top2", "tiny-moe", "a800x1", 0.005, share=0.2),
                      fixtures.model_row("Sc-Pos3", "tiny-moe", "a800x1", 0.006),
                      {**fixtures.model_row("top2", "big-moe", "a800x1", 0.0), "out_of_memory": True,
                       "skipped": "out of device memory: 24 GiB"},
                      fixtures.model_row("pair-Pos2", "tiny-moe", "pcie-a30x1", 0.001, layers="2:4", a2a=0.8)]
        for k in ("results", "mode", "device", "calibration", "world_size", "file"):
            s["runs"][-2].pop(k)
        path = os.path.join(self.d, "summary.json")
        mr.write_json(path, mr.check_summary(s, "(fixture)"))
        return path

    def run_scmoe(self, *args):
        return subprocess.run([sys.executable, SCMOE] + list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)

    def test_speedup_and_overlap(self):
        summary = self.summary()
        for fig in ("speedup", "overlap"):
            out = os.path.join(self.d, f"{fig}.png")
            p = self.run_scmoe(fig, "--summary", summary, "--out", out)
            self.assertEqual(p.returncode, 0, p.stderr)
            with open(out, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")

    def test_timeline_side_by_side(self):
        a = trace(os.path.join(self.d, "a.trace.json"), [(0, 10)], [(10, 20)])
        b = trace(os.path.join(self.d, "b.trace.json"), [(0, 10)], [(0, 10)])
        mr.write_json(os.path.join(self.d, "a.json"), fixtures.model_run_result())
        out = os.path.join(self.d, "t.png")
        p = self.run_scmoe("timeline", a, b, "--labels", "top-2", "Pos-2", "--crop-at", "grad_sync",
                           "--title", "{mode}: {device}, {calibration} calibration, commit {commit}", "--out", out)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertTrue(os.path.exists(out))
        p = self.run_scmoe("timeline", a, b, "--labels", "one", "--out", out)
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("2 traces but 1 labels", p.stderr)

    def test_missing_or_bad_summary(self):
        p = self.run_scmoe("speedup", "--summary", os.path.join(self.d, "none.json"), "--out", "x.png")
        self.assertEqual(p.returncode, 2)
        self.assertIn("no such file", p.stderr)
        bad = os.path.join(self.d, "bad.json")
        s = fixtures.model_summary()
        s["runs"][0]["run_mode"] = "serving"
        with open(bad, "w") as f:
            json.dump(s, f)
        p = self.run_scmoe("overlap", "--summary", bad, "--out", "x.png")
        self.assertEqual(p.returncode, 2)
        self.assertIn(f'{bad}: field "runs[0].run_mode"', p.stderr)


if __name__ == "__main__":
    unittest.main()
