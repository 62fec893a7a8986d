"""Tests of plots/pipeline_schedule.py (a pipeline schedule drawn from a Chrome trace) on a trace
written here: two stages, two microbatches of 1F1B with known times.

    /usr/bin/python3 -m unittest -v test_pipeline_schedule      (from plots/tests)
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SCRIPT = os.path.join(ROOT, "plots", "pipeline_schedule.py")


def op(rank, node, start_ms, dur_ms, tid=1, name="fc1"):
    return {"name": name, "ph": "X", "pid": rank, "tid": tid, "ts": start_ms * 1e3, "dur": dur_ms * 1e3,
            "args": {"phase": "mlp", "node": node}}


def trace_1f1b(steps=1):
    """2 stages, 2 microbatches, F = B = W = 1 ms, transfers free: stage 0 runs F0 F1 at 0 and 1,
    B0 W0 at 3, 4 and B1 W1 at 5, 6; stage 1 F0 B0 W0 at 1, 2, 3 and F1 B1 W1 at 4, 5, 6. Window
    0..7 ms; each stage works 6 of 7: bubble 1/7. Every node is two ops (one on another stream)."""
    events = []
    plan = {0: [("F0.0", 0), ("F1.0", 1), ("B0.0", 3), ("W0.0", 4), ("B1.0", 5), ("W1.0", 6)],
            1: [("F0.0", 1), ("B0.0", 2), ("W0.0", 3), ("F1.0", 4), ("B1.0", 5), ("W1.0", 6)]}
    for k in range(steps):
        for rank, nodes in plan.items():
            for node, t in nodes:
                events.append(op(rank, node, 10 * k + t, 0.5))
                events.append(op(rank, node, 10 * k + t + 0.5, 0.5, tid=2, name="other_stream"))
            events.append(op(rank, "SA0.0", 10 * k + 1, 3, tid=5, name="send"))  # a transfer: never drawn
    return {"traceEvents": events,
            "otherData": {"mode": "simulated", "commit": "0123456789ab", "model": "tiny",
                          "pipeline": {"schedule": "1f1b", "stages": 2, "microbatches": 2, "chunks": 1,
                                       "placement": "interleaved", "recompute": "none", "steps": steps,
                                       "stage_of_rank": [0, 1]}}}


class PipelineSchedule(unittest.TestCase):
    def run_script(self, *args):
        return subprocess.run([sys.executable, SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)

    def have_matplotlib(self):
        try:
            import matplotlib  # noqa: F401
            return True
        except ImportError:
            return False

    def test_draws_the_schedule_and_its_bubble(self):
        if not self.have_matplotlib():
            self.skipTest("matplotlib is missing")
        with tempfile.TemporaryDirectory() as d:
            t = os.path.join(d, "t.json")
            with open(t, "w") as f:
                json.dump(trace_1f1b(steps=2), f)
            out = os.path.join(d, "sub", "s.png")
            p = self.run_script(t, t, "--labels", "first", "second", "--step", "1", "--title", "{mode} at {commit}",
                                "--out", out)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("first: bubble 14.3% over 7.000 ms (1f1b: p = 2, m = 2, simulated)", p.stdout)
            with open(out, "rb") as f:
                self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
            self.assertEqual(os.listdir(os.path.dirname(out)), ["s.png"])  # written atomically

    def test_rejects_a_trace_without_a_pipeline(self):
        with tempfile.TemporaryDirectory() as d:
            t = os.path.join(d, "t.json")
            tr = trace_1f1b()
            del tr["otherData"]["pipeline"]
            with open(t, "w") as f:
                json.dump(tr, f)
            p = self.run_script(t, "--out", os.path.join(d, "s.png"))
            self.assertNotEqual(p.returncode, 0)
            self.assertIn("not the trace of a pipelined run", p.stderr)
            p = self.run_script(os.path.join(d, "missing.json"), "--out", os.path.join(d, "s.png"))
            self.assertIn("cannot read the trace", p.stderr)
            with open(t, "w") as f:
                json.dump(trace_1f1b(), f)
            p = self.run_script(t, "--step", "3", "--out", os.path.join(d, "s.png"))
            self.assertIn("--step 3: the trace has 1 timed steps", p.stderr)
            self.assertFalse(os.path.exists(os.path.join(d, "s.png")))


if __name__ == "__main__":
    unittest.main()
