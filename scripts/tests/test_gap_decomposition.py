"""Tests of scripts/gap_decomposition.py's derived figures and of the report's table of them.

    /usr/bin/python3 -m unittest -v test_gap_decomposition      (from scripts/tests)
"""
import json
import os
import subprocess
import sys
import tempfile
import unittest

import fixtures  # noqa: F401  (puts scripts/ on the path)
import gap_decomposition as gd

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "plots"))
import report  # noqa: E402

US = 1e-6
PAPER = {"pipemoe-speedup-vs-fastmoe-max": {"value": 3.7, "text": "t", "source": "s"},
         "pipemoe-speedup-vs-fastermoe-mean": {"value": 2.26, "text": "t", "source": "s"}}


def stage(sid, host, fast, faster, pipe):
    return {"id": sid, "label": sid, "changes": "c", "as_published": host is not None or sid == "published",
            "host": host, "step_s": {"FastMoE": fast, "FasterMoE": faster, "PipeMoE": pipe}, "pipemoe_n": 4,
            "comm_s": {"FastMoE": 4e-3, "FasterMoE": 5e-3, "PipeMoE": 4e-3},
            "speedup": {"vs_FastMoE": fast / pipe, "vs_FasterMoE": faster / pipe}}


def linear_stages(b0, kb, f0, kf, p0, kp):
    """Steps linear in the sync latency s (issue overhead 0) and in the issue overhead h (sync 0),
    with the same slopes for both terms: baseline b0 + kb·x, FasterMoE f0 + kf·x, PipeMoE p0 + kp·x."""
    rows = [stage("pcie", None, b0, f0, p0), stage("published", None, b0, f0, p0)]
    for s, h in ((10 * US, 0.0), (50 * US, 0.0), (0.0, 5 * US), (0.0, 20 * US), (50 * US, 20 * US)):
        x = s + h
        rows.append(stage(f"host-{s}-{h}", {"sync_latency": s, "issue_overhead": h},
                          b0 + kb * x, f0 + kf * x, p0 + kp * x))
    return rows


class BreakEven(unittest.TestCase):
    def test_closed_form(self):
        # baseline 10 ms + 20·x, PipeMoE 5 ms + 2·x: 10e-3 + 20x = 3.7 (5e-3 + 2x) at x = 8.5e-3 / 12.6.
        be = gd.break_even(linear_stages(10e-3, 20, 12e-3, 30, 5e-3, 2), PAPER)
        for term in ("sync_latency", "issue_overhead"):
            v = be[term]["pipemoe-speedup-vs-fastmoe-max"]
            self.assertAlmostEqual(v["value_s"], 8.5e-3 / 12.6, places=12)
            self.assertAlmostEqual(v["baseline_s_per_unit"], 20, places=9)
            self.assertAlmostEqual(v["pipemoe_s_per_unit"], 2, places=9)
            # FasterMoE: 12e-3 + 30x = 2.26 (5e-3 + 2x) at x = (11.3e-3 - 12e-3) / (30 - 4.52) < 0: reached at 0.
            self.assertEqual(be[term]["pipemoe-speedup-vs-fastermoe-mean"]["value_s"], 0.0)
        # The all-to-all: 10e-3 - 4e-3 + k·4e-3 = 3.7·5e-3 at k = 12.5e-3 / 4e-3; FasterMoE's already reached: 1.
        a2a = be["all_to_all_factor"]
        self.assertAlmostEqual(a2a["pipemoe-speedup-vs-fastmoe-max"]["factor"], 12.5 / 4, places=12)
        self.assertFalse(a2a["pipemoe-speedup-vs-fastmoe-max"]["lower_bound"])
        self.assertEqual(a2a["pipemoe-speedup-vs-fastermoe-mean"]["factor"], 1.0)
        self.assertTrue(a2a["pipemoe-speedup-vs-fastermoe-mean"]["lower_bound"])
        # The combined point (both terms set) is not on either line and is left out.
        self.assertEqual(be["sync_latency"]["points_s"], [0.0, 10 * US, 50 * US])

    def test_never_when_pipemoe_pays_as_often(self):
        # PipeMoE pays the term 8 times per step, the baseline 20: 20 < 3.7·8, the lines never meet.
        be = gd.break_even(linear_stages(10e-3, 20, 12e-3, 30, 5e-3, 8), PAPER)
        self.assertIsNone(be["issue_overhead"]["pipemoe-speedup-vs-fastmoe-max"]["value_s"])

    def test_report_renders_the_stages_and_break_even(self):
        rows = linear_stages(10e-3, 20, 12e-3, 30, 5e-3, 2)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "gap-decomposition.json")
            d = {"cluster": "dgx-a100x8", "commit": ["abc"], "date": "d", "pipemoe_partitions": [2, 4, 8],
                 "paper": PAPER, "points": [{"point": "XL-2K", "workload": "W", "stages": rows,
                                             "break_even": gd.break_even(rows, PAPER)}]}
            with open(path, "w") as f:
                json.dump(d, f)
            text = "\n".join(report.gap_section(path, tmp))
            # a malformed file is a SchemaError naming it (the report exits 2), not a traceback
            del d["points"][0]["stages"][0]["step_s"]
            with open(path, "w") as f:
                json.dump(d, f)
            with self.assertRaises(report.mr.SchemaError) as cm:
                report.gap_section(path, tmp)
            self.assertIn(f"{path}: malformed (KeyError: 'step_s')", str(cm.exception))
        self.assertIn("### Where the gap goes (simulated)", text)
        self.assertIn("| published | c | 10.000 | 12.000 | 5.000 (4) | 2.00x | 2.40x |", text)
        self.assertIn(f"| {8.5e-3 / 12.6 * 1e6:.0f} µs |", text)
        self.assertIn("all-to-all time (4.000 ms) would have to be 3.1x longer, none of it hidden", text)
        self.assertEqual(report.gap_section(os.path.join(tmp, "absent.json"), tmp), [])

    def test_merge_adds_points_in_order_and_refuses_other_binaries(self):
        old = {"commit": ["abc"], "cluster": "dgx-a100x8", "points": [{"point": "XL-16K", "v": 1}, {"point": "S-2K", "v": 1}]}
        new = {"commit": ["abc"], "cluster": "dgx-a100x8", "date": "d2", "points": [{"point": "XL-2K", "v": 2},
                                                                                 {"point": "S-2K", "v": 2}]}
        m = gd.merge(old, new)
        self.assertEqual([(p["point"], p["v"]) for p in m["points"]], [("XL-2K", 2), ("XL-16K", 1), ("S-2K", 2)])
        self.assertEqual(m["command"], "scripts/gap_decomposition.py --points XL-2K,XL-16K,S-2K")
        self.assertEqual(m["date"], "d2")
        with self.assertRaisesRegex(ValueError, "moelab"):
            gd.merge(old, {**new, "commit": ["def"]})
        with self.assertRaisesRegex(ValueError, "h100x1"):
            gd.merge(old, {**new, "cluster": "h100x1"})

    def test_datasheet_stage_is_the_loaders_default_curve(self):
        stages = gd.model_stages()
        self.assertEqual([s[0] for s in stages], ["datasheet", "gemm", "interference", "nccl", "pcie"])
        ds = stages[0][3]
        self.assertNotIn("calibration", ds["efficiency"])
        self.assertNotIn("p2p", ds["node"])
        self.assertNotIn("gpus_per_pcie_switch", ds["node"])
        self.assertIsNone(stages[-1][3])  # the catalogue cluster itself

    def test_derive_rewrites_in_place(self):
        rows = linear_stages(10e-3, 20, 12e-3, 30, 5e-3, 2)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "g.json")
            with open(path, "w") as f:
                json.dump({"paper": PAPER, "points": [{"stages": rows}]}, f)
            p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gap_decomposition.py"), "--derive", path],
                               capture_output=True, text=True)
            self.assertEqual(p.returncode, 0, p.stderr)
            with open(path) as f:
                d = json.load(f)
        self.assertAlmostEqual(d["points"][0]["break_even"]["sync_latency"]["pipemoe-speedup-vs-fastmoe-max"]["value_s"],
                               8.5e-3 / 12.6, places=12)


if __name__ == "__main__":
    unittest.main()
