"""Tests of the result store's formats (scripts/moelab_results.py).

    /usr/bin/python3 -m unittest -v test_results_schema      (from scripts/tests)

With MOELAB set to a moelab binary (CTest sets it), the real binary writes a simulated and a
measured result that must validate; without it those two tests are skipped.
"""
import copy
import json
import os
import subprocess
import tempfile
import unittest

import fixtures
import moelab_results as mr


class ResultSchema(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="schema_test.")
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def write(self, obj, name="r.json"):
        path = os.path.join(self.dir, name)
        with open(path, "w") as f:
            f.write(obj if isinstance(obj, str) else json.dumps(obj, indent=2))
        return path

    def rejected(self, obj, *fragments):
        path = self.write(obj)
        with self.assertRaises(mr.SchemaError) as cm:
            mr.load_result(path)
        msg = str(cm.exception)
        self.assertIn(path, msg)
        for f in fragments:
            self.assertIn(f, msg)
        return msg

    def test_valid_results_load(self):
        for mode in ("simulated", "measured"):
            r = fixtures.result(mode)
            self.assertEqual(mr.load_result(self.write(r)), r)

    def test_round_trip(self):
        r = fixtures.result()
        path = os.path.join(self.dir, "sub", "r.json")
        mr.write_json(path, r)
        once = mr.load_result(path)
        mr.write_json(path, once)
        self.assertEqual(mr.load_result(path), r)
        self.assertEqual(os.listdir(os.path.dirname(path)), ["r.json"])  # no temporary file left

    def test_truncated_file(self):
        text = json.dumps(fixtures.result(), indent=2)
        self.rejected(text[: len(text) // 2], "malformed JSON", "truncated")

    def test_empty_file(self):
        self.rejected("", "empty file")

    def test_missing_mode(self):
        r = fixtures.result()
        del r["mode"]
        self.rejected(r, 'field "mode": missing')

    def test_wrong_type(self):
        r = fixtures.result()
        r["metrics"]["step_time_s"]["median"] = "fast"
        self.rejected(r, 'field "metrics.step_time_s.median"', 'expected a number, got "fast"')
        r = fixtures.result()
        r["metrics"]["peak_memory_bytes"]["by_category_at_peak"]["buffers"] = 1.5
        self.rejected(r, 'field "metrics.peak_memory_bytes.by_category_at_peak.buffers"', "expected an integer")

    def test_device_pool_is_optional_and_checked(self):
        r = fixtures.result("measured")
        r["metrics"]["peak_memory_bytes"]["device_pool"] = {"used_high": 3 << 20, "reserved_high": 4 << 20, "rank": 0}
        self.assertEqual(mr.load_result(self.write(r)), r)
        r["metrics"]["peak_memory_bytes"]["device_pool"]["used_high"] = -1
        self.rejected(r, 'field "metrics.peak_memory_bytes.device_pool.used_high"')
        del r["metrics"]["peak_memory_bytes"]["device_pool"]["used_high"]
        self.rejected(r, 'field "metrics.peak_memory_bytes.device_pool.used_high": missing')

    def test_gemm_floor_is_optional_and_checked(self):
        r = fixtures.result("measured")
        r["metrics"].update({"floor_gemm_s": 0.0021, "floor_gemm_library": "cublasGemmStridedBatchedEx",
                             "moe_layer_s": 0.0052, "expert_vs_floor_ratio": 1.86, "layer_vs_floor_ratio": 2.48})
        self.assertEqual(mr.load_result(self.write(r)), r)
        # No expert had a row: no floor, the ratios null.
        r["metrics"].update({"floor_gemm_s": 0.0, "expert_vs_floor_ratio": None, "layer_vs_floor_ratio": None})
        self.assertEqual(mr.load_result(self.write(r)), r)
        r["metrics"]["layer_vs_floor_ratio"] = "fast"
        self.rejected(r, 'field "metrics.layer_vs_floor_ratio"', "expected a number")
        r["metrics"]["layer_vs_floor_ratio"] = None
        r["metrics"]["floor_gemm_s"] = -1.0
        self.rejected(r, 'field "metrics.floor_gemm_s"', "expected a number >= 0")
        r["metrics"]["floor_gemm_s"] = 0.0
        r["metrics"]["floor_gemm_library"] = 7
        self.rejected(r, 'field "metrics.floor_gemm_library"')

    def test_gemm_paths_are_optional_and_checked(self):
        r = fixtures.result("measured")
        r["metrics"].update({"gemm_path_table": "profile \"p.json\": moelab calibrate --backend cuda on H100",
                             "gemm_paths_taken": {"experts.fc1": {"strided_batched": 7, "loop": 2}}})
        self.assertEqual(mr.load_result(self.write(r)), r)
        r["metrics"]["gemm_paths_taken"]["experts.fc1"]["bmm"] = 3
        self.rejected(r, 'field "metrics.gemm_paths_taken.experts.fc1"')
        r["metrics"]["gemm_paths_taken"] = {"experts.fc1": {"loop": 0}}
        self.rejected(r, 'field "metrics.gemm_paths_taken.experts.fc1"')
        r["metrics"]["gemm_paths_taken"] = [1]
        self.rejected(r, 'field "metrics.gemm_paths_taken"')
        r["metrics"]["gemm_paths_taken"] = {}
        r["metrics"]["gemm_path_table"] = 3
        self.rejected(r, 'field "metrics.gemm_path_table"')

    def test_host_pool_is_optional_and_checked(self):
        r = fixtures.result("measured")
        r["metrics"]["host_pool"] = {"timed_requests": 48, "timed_driver_allocations": 0, "timed_driver_releases": 0,
                                     "peak_bytes_held": 1 << 30}
        self.assertEqual(mr.load_result(self.write(r)), r)
        r["metrics"]["host_pool"]["timed_driver_allocations"] = -1
        self.rejected(r, 'field "metrics.host_pool.timed_driver_allocations"')
        del r["metrics"]["host_pool"]["timed_driver_allocations"]
        self.rejected(r, 'field "metrics.host_pool.timed_driver_allocations"')
        r["metrics"]["host_pool"] = [0]
        self.rejected(r, 'field "metrics.host_pool"')

    def test_unknown_schema(self):
        r = fixtures.result()
        r["schema"] = "moelab.result/9"
        self.rejected(r, 'field "schema"', 'unknown schema "moelab.result/9"')

    def test_not_an_object(self):
        self.rejected("[1, 2]", "expected a JSON object")

    def test_mode_and_provenance_agree(self):
        r = fixtures.result("measured")
        r["calibration"] = "datasheet"
        self.rejected(r, 'field "calibration"', "measured result has no calibration")
        r = fixtures.result("simulated")
        r["cluster"] = None
        self.rejected(r, 'field "cluster"', "needs its cluster model")
        r = fixtures.result("simulated")
        r["backend"] = "cpu"
        self.rejected(r, 'field "mode"', "does not go with backend")
        r = fixtures.result()
        r["date"] = "yesterday"
        self.rejected(r, 'field "date"')

    def test_pipelined_model_runs(self):
        for mode in ("simulated", "measured"):
            r = fixtures.model_result(mode)
            self.assertEqual(mr.load_result(self.write(r)), r)
        r = fixtures.model_result()
        r["parallel"]["stages"][1]["bubble"] = 1.5
        self.rejected(r, 'field "parallel.stages[1].bubble"', "ratio in [0, 1]")
        r = fixtures.model_result()
        r["parallel"]["stages"].pop()
        self.rejected(r, 'field "parallel.stages"', "1 entries for pp = 2")
        r = fixtures.model_result()
        r["parallel"]["link_bytes"] = None
        self.rejected(r, 'field "parallel.link_bytes"', "simulated result counts the bytes")
        r = fixtures.model_result("measured")
        r["parallel"]["stages"][0]["link_bytes"] = {"nvlink": 1, "pcie": 0, "nic": 0}
        self.rejected(r, 'field "parallel.stages[0].link_bytes"', "only the sim")
        r = fixtures.model_result()
        r["parallel"]["layout"]["dp"] = 4
        self.rejected(r, 'field "parallel.layout"', "is not world_size 4")
        r = fixtures.model_result()
        r["parallel"]["schedule"]["name"] = "zb-h2"
        self.rejected(r, 'field "parallel.schedule.name"')
        r = fixtures.model_result()
        r["training"]["layers"] = [0, 3]
        self.rejected(r, 'field "training.layers"')
        r = fixtures.model_result()
        del r["model"]["num_layers"]
        self.rejected(r, 'field "model.num_layers": missing')

    def test_atomic_write_leaves_nothing_on_failure(self):
        path = os.path.join(self.dir, "keep.json")
        mr.write_json(path, {"a": 1})
        with self.assertRaises(TypeError):
            mr.write_json(path, {"a": {1, 2}})  # not serialisable: fails before anything is written
        self.assertEqual(mr.load_json(path), {"a": 1})
        self.assertEqual(os.listdir(self.dir), ["keep.json"])


class SummaryAndSuiteSchema(unittest.TestCase):
    def test_summary(self):
        s = fixtures.summary()
        self.assertIs(mr.check_summary(s, "s.json"), s)
        s["claims"][0]["metric"] = "latency"
        with self.assertRaises(mr.SchemaError) as cm:
            mr.check_summary(s, "s.json")
        self.assertIn('s.json: field "claims[0].metric"', str(cm.exception))
        s = fixtures.summary()
        del s["runs"][0]["results"]
        with self.assertRaises(mr.SchemaError) as cm:
            mr.check_summary(s, "s.json")
        self.assertIn('field "runs[0].results": missing', str(cm.exception))

    def test_claim_parts_the_report_prints_are_checked(self):
        # A claim's as-published comparison and other memory counting, and a result's optimizer
        # peaks: accepted malformed, they crashed the report (KeyError) or the suite run.
        s = fixtures.summary()
        ok = {"versus": "Base-pub", "compared_on": "paper_setup", "verdict": "agrees",
              "ours": {"paper_setup": {"points": 1, "value": 2.0}}}
        s["claims"][0]["as_published"] = ok
        s["claims"][0]["other_counting"] = {"memory_counts": "with_optimizer_state", "verdict": "agrees",
                                            "ours": {"paper_setup": {"points": 0}}}
        s["claims"][0]["compared_on"] = "paper_setup"
        self.assertIs(mr.check_summary(s, "s.json"), s)
        for part, change, fragment in (
                ("as_published", lambda p: p.pop("ours"), 'field "claims[0].as_published.ours": missing'),
                ("as_published", lambda p: p.pop("versus"), 'field "claims[0].as_published.versus": missing'),
                ("as_published", lambda p: p["ours"]["paper_setup"].pop("value"),
                 'field "claims[0].as_published.ours.paper_setup.value": missing'),
                ("other_counting", lambda p: p.update(memory_counts="peak"),
                 'field "claims[0].other_counting.memory_counts"')):
            t = copy.deepcopy(s)
            change(t["claims"][0][part])
            with self.assertRaises(mr.SchemaError, msg=fragment) as cm:
                mr.check_summary(t, "s.json")
            self.assertIn(fragment, str(cm.exception))
        r = fixtures.result()
        r["metrics"]["peak_memory_bytes"]["optimizer_state"] = {"with": 2.0e9, "without": 1.0e9}
        self.assertIs(mr.check_result(r, "r.json"), r)
        r["metrics"]["peak_memory_bytes"]["optimizer_state"] = {"source": "x"}
        with self.assertRaises(mr.SchemaError) as cm:
            mr.check_result(r, "r.json")
        self.assertIn('field "metrics.peak_memory_bytes.optimizer_state.with": missing', str(cm.exception))

    def test_registered_suites_load(self):
        names = [mr.load_suite(p)["name"] for p in mr.registered_suites()]
        self.assertIn("mpipemoe", names)
        self.assertIn("foundation", names)

    def test_suite_cross_references(self):
        s = fixtures.suite()
        self.assertIs(mr.check_suite(s, "x.json"), s)
        cases = [
            (lambda s: s["grid"]["sweeps"][0]["clusters"].append("nosuch"),
             'field "grid.sweeps[0].clusters[1]": "nosuch" is not in grid.clusters'),
            (lambda s: s["runs"][0]["impls"].append("Nobody"),
             'field "runs[0].impls[1]": "Nobody" is not a label'),
            (lambda s: s["claims"]["items"][0].update(system="Nobody"),
             'field "claims.items[0].system"'),
            (lambda s: s["claims"]["items"][0].update(metric="speedup", paper=0.9),
             'field "claims.items[0].paper": a speedup claim is judged as a gain over 1 (faster), got 0.9'),
            (lambda s: s["runs"][1].update(ranks=[0]), 'field "runs[1].ranks[0]"'),
            (lambda s: s["runs"][0].update(path="/abs/path"), 'field "runs[0].path"'),
            (lambda s: s["impls"].append(dict(s["impls"][0])), 'field "impls": duplicate names: "Base"'),
            (lambda s: s.update(schema="moelab.suite/1"), 'unknown schema "moelab.suite/1"'),
            (lambda s: s["runs"][1].update(gemm_path="fastest"),
             'field "runs[1].gemm_path": expected one of loop, strided_batched, grouped, got "fastest"'),
            (lambda s: s["runs"][1].update(backend="cpu", gemm_path="grouped"),
             'field "runs[1].gemm_path": a GEMM path is a cuBLAS one (cuda, or its pricing on sim), this run is on "cpu"'),
        ]
        for ok in ("loop", "strided_batched", "grouped"):  # on cuda and on sim
            s = fixtures.suite()
            s["runs"][0]["gemm_path"] = s["runs"][1]["gemm_path"] = ok
            self.assertIs(mr.check_suite(s, "x.json"), s)
        for change, fragment in cases:
            s = fixtures.suite()
            change(s)
            with self.assertRaises(mr.SchemaError, msg=fragment) as cm:
                mr.check_suite(s, "x.json")
            self.assertIn(fragment, str(cm.exception))


@unittest.skipUnless(os.environ.get("MOELAB"), "set MOELAB to a moelab binary")
class RealBinary(unittest.TestCase):
    """What moelab run writes is a valid moelab.result/1, and survives load -> write -> load."""

    def run_moelab(self, out, *args):
        tiny = os.path.join(fixtures.ROOT, "experiments", "workloads", "tiny.json")
        p = subprocess.run([os.environ["MOELAB"], "run", "--workload", tiny, "--impl", "fastmoe", "--steps", "1",
                            "--out", out] + list(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.assertEqual(p.returncode, 0, p.stdout)
        return mr.load_result(out)

    def test_simulated_and_measured(self):
        with tempfile.TemporaryDirectory() as d:
            sim = self.run_moelab(os.path.join(d, "sim.json"), "--backend", "sim", "--cluster", "dgx-a100x1",
                                  "--ranks", "2")
            self.assertEqual((sim["mode"], sim["backend"], sim["world_size"]), ("simulated", "sim", 2))
            self.assertEqual(sim["cluster"]["name"], "dgx-a100x1")
            cpu = self.run_moelab(os.path.join(d, "cpu.json"), "--backend", "cpu")
            self.assertEqual((cpu["mode"], cpu["calibration"]), ("measured", None))
            for r in (sim, cpu):
                path = os.path.join(d, "again.json")
                mr.write_json(path, r)
                self.assertEqual(mr.load_result(path), r)


if __name__ == "__main__":
    unittest.main()
