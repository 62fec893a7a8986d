"""Tests of the comparator and of the merge of a new run into the results (scripts/compare_results.py).

    /usr/bin/python3 -m unittest -v test_compare_results      (from scripts/tests)
"""
import copy
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import fixtures
import compare_results as cr
import moelab_results as mr

SIM = "simulated/dgx-a100x1/tiny-Base.json"
MEASURED = "measured/cpu/tiny-Base-np4.json"
SUMMARY = "simulated/fake/summary.json"
WORKLOAD = "simulated/fake/workloads/M-fp32-T256.json"


class Trees(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="compare_test.")
        self.base = os.path.join(self.tmp.name, "base")
        self.new = os.path.join(self.tmp.name, "new")
        for tree in (self.base, self.new):
            mr.write_json(os.path.join(tree, SIM), fixtures.result("simulated"))
            mr.write_json(os.path.join(tree, MEASURED), fixtures.result("measured"))
            mr.write_json(os.path.join(tree, SUMMARY), fixtures.summary())
            mr.write_json(os.path.join(tree, WORKLOAD), {"name": "M-fp32-T256", "tokens_per_rank": 256})

    def tearDown(self):
        self.tmp.cleanup()

    def edit(self, rel, change, tree=None):
        path = os.path.join(tree or self.new, rel)
        obj = mr.load_json(path)
        change(obj)
        mr.write_json(path, obj)

    def compare(self, **kw):
        lines = []
        n = cr.compare_trees(self.base, self.new, log=lines.append, **kw)
        return n, "\n".join(lines)

    def test_identical_trees_pass(self):
        n, text = self.compare()
        self.assertEqual(n, 0, text)
        self.assertIn("0 differ", text)

    def test_planted_change_is_caught(self):
        old = fixtures.result()["metrics"]["step_time_s"]["median"]
        self.edit(SIM, lambda r: r["metrics"]["step_time_s"].update(median=old * (1 + 1e-6)))
        n, text = self.compare()
        self.assertEqual(n, 1)
        self.assertIn(f"DIFFERS {SIM}", text)
        self.assertIn("metrics.step_time_s.median: 0.005 -> 0.005000005", text)
        self.assertIn("relative 1e-06", text)

    def test_within_tolerance_and_provenance_pass(self):
        self.edit(SIM, lambda r: r["metrics"].update(comm_s=r["metrics"]["comm_s"] * (1 + 1e-12)))
        self.edit(SIM, lambda r: r.update(date="2027-01-01T00:00:00Z", commit="fedcba987654"))
        self.edit(SUMMARY, lambda s: s.update(date="2027-01-01T00:00:00Z", host_seconds=99.0))
        n, text = self.compare()
        self.assertEqual(n, 0, text)

    def test_rounding_of_a_zero_agrees_but_a_small_value_does_not(self):
        # 3.5e-17 against 1.8e-17 is a zero rounded two ways (relative change 0.5); 1e-9
        # against 2e-9 is a real difference of a small value.
        self.edit(SIM, lambda r: r["metrics"].update(overlap_ratio=3.540395244e-17), tree=self.base)
        self.edit(SIM, lambda r: r["metrics"].update(overlap_ratio=1.770197622e-17))
        n, text = self.compare()
        self.assertEqual(n, 0, text)
        self.edit(SIM, lambda r: r["metrics"].update(overlap_ratio=2e-9))
        n, text = self.compare()
        self.assertEqual(n, 1, text)

    def test_strings_and_structure_are_compared(self):
        self.edit(SIM, lambda r: r["impl_report"].update(last_strategy="S4"))
        self.edit(SIM, lambda r: r["impl_report"]["granularity_search"]["decisions"][0]["trials"].pop())
        n, text = self.compare()
        self.assertEqual(n, 1)
        self.assertIn('impl_report.last_strategy: "S3" -> "S4"', text)
        self.assertIn("trials (length): 2 -> 1", text)

    def test_cluster_figures_and_link_bytes_are_compared_but_not_their_prose(self):
        # A model figure of the same cluster (a rate, a switch) and the bytes a run put on each
        # link class are results of the model as much as its timings; the cluster's prose is not.
        self.edit(SIM, lambda r: r["cluster"].update(source="reworded", description="reworded too"))
        n, text = self.compare()
        self.assertEqual(n, 0, text)
        self.edit(SIM, lambda r: r["cluster"].update(node={"pcie_bw": 2.4e10}))
        n, text = self.compare()
        self.assertEqual(n, 1, text)
        self.assertIn("cluster.node: (absent) -> ", text)
        model = "simulated/dgx-a100x1/tiny-model.json"
        for tree in (self.base, self.new):
            mr.write_json(os.path.join(tree, model), fixtures.model_result())
        self.edit(SIM, lambda r: r["cluster"].pop("node"))
        self.assertEqual(self.compare()[0], 0)
        self.edit(model, lambda r: r["parallel"]["link_bytes"].update(pcie=5e8))
        n, text = self.compare()
        self.assertEqual(n, 1, text)
        self.assertIn("parallel.link_bytes.pcie: 0 -> 500000000", text)

    def test_metrics_added_later_compare_once_both_have_them(self):
        floor = {"floor_gemm_s": 0.002, "floor_gemm_library": "GEMM (cost model), one by one", "moe_layer_s": 0.005,
                 "expert_vs_floor_ratio": 1.95, "layer_vs_floor_ratio": 2.5}
        self.edit(SIM, lambda r: r["metrics"].update(floor))  # a newer binary against an older result
        n, text = self.compare()
        self.assertEqual(n, 0, text)
        self.edit(SIM, lambda r: r["metrics"].update(floor), tree=self.base)
        self.edit(SIM, lambda r: r["metrics"].update(layer_vs_floor_ratio=2.6))
        n, text = self.compare()
        self.assertEqual(n, 1, text)
        self.assertIn("metrics.layer_vs_floor_ratio: 2.5 -> 2.6", text)
        self.edit(SIM, lambda r: r["metrics"].pop("floor_gemm_s"))  # ... and dropping one is a difference
        n, text = self.compare()
        self.assertIn("metrics.floor_gemm_s: 0.002 -> (absent)", text)

    def test_measured_results_are_informational(self):
        self.edit(MEASURED, lambda r: r["metrics"]["step_time_s"].update(median=0.5))
        n, text = self.compare()
        self.assertEqual(n, 0, text)
        self.assertIn("measured, informational", text)

    def test_gpu_results_only_against_the_same_device_class(self):
        gpu = fixtures.result("measured", device="NVIDIA H100 80GB HBM3 (79.1 GiB)")
        gpu["backend"] = "cuda"
        mr.write_json(os.path.join(self.base, "measured/cuda/x.json"), gpu)
        same = copy.deepcopy(gpu)
        same["device"] = "NVIDIA H100 80GB HBM3 (79.2 GiB)"
        mr.write_json(os.path.join(self.new, "measured/cuda/x.json"), same)
        self.assertIn("step 5.000 ms -> 5.000 ms", self.compare()[1])
        other = copy.deepcopy(gpu)
        other["device"] = "NVIDIA H200 (139.8 GiB)"
        mr.write_json(os.path.join(self.new, "measured/cuda/x.json"), other)
        self.assertIn("not compared: different device class (NVIDIA H100 80GB HBM3 vs NVIDIA H200)", self.compare()[1])

    def test_extra_and_missing_files(self):
        mr.write_json(os.path.join(self.new, "simulated/dgx-a100x1/extra.json"), fixtures.result())
        n, text = self.compare()
        self.assertEqual(n, 1)
        self.assertIn("NEW     simulated/dgx-a100x1/extra.json", text)
        os.unlink(os.path.join(self.new, "simulated/dgx-a100x1/extra.json"))
        os.unlink(os.path.join(self.new, SIM))
        self.assertEqual(self.compare()[0], 0)  # a quick run need not produce everything
        n, text = self.compare(complete=True)
        self.assertEqual(n, 1)
        self.assertIn(f"MISSING {SIM}", text)

    def test_summary_figures_and_claims(self):
        self.edit(SUMMARY, lambda s: s["points"][0]["results"]["Sys"].update(step_time_s=0.0041))
        n, text = self.compare()
        self.assertEqual(n, 1)
        self.assertIn("points[dgx-a100x8 M fp32 T2048].results.Sys.step_time_s: 0.004 -> 0.0041", text)
        shutil.copy(os.path.join(self.base, SUMMARY), os.path.join(self.new, SUMMARY))
        self.edit(SUMMARY, lambda s: s["claims"][0]["ours"]["paper_setup"].update(value=2.5))
        self.assertIn("claims[sys-speedup].ours.paper_setup.value: 2 -> 2.5", self.compare()[1])
        # a claim's wording, and a claim the suite no longer makes (same subset), are differences
        shutil.copy(os.path.join(self.base, SUMMARY), os.path.join(self.new, SUMMARY))
        self.edit(SUMMARY, lambda s: s["claims"][0].update(text="another claim"))
        self.assertIn("claims[sys-speedup].text", self.compare()[1])
        shutil.copy(os.path.join(self.base, SUMMARY), os.path.join(self.new, SUMMARY))
        self.edit(SUMMARY, lambda s: s.update(claims=[]))
        n, text = self.compare()
        self.assertEqual(n, 1)
        self.assertIn("claims[sys-speedup]: \"a claim\" -> (absent)", text)
        # also a full summary against an extended one (both judge every claim); not a quick one
        old, new = fixtures.summary(), fixtures.summary()
        new.update(subset="extended", claims=[])
        self.assertIn(("claims[sys-speedup]", "a claim", "(absent)"), cr.diff_summaries(old, new, 1e-9))
        quick = fixtures.summary("quick")
        quick["claims"] = []
        self.assertNotIn(("claims[sys-speedup]", "a claim", "(absent)"), cr.diff_summaries(old, quick, 1e-9))

    def test_a_run_simulated_before_and_not_now_differs_in_any_subset(self):
        # A run of the committed summary that the new run skipped (a probe said no, a model file
        # went missing), ran out of device memory or failed is a difference, a quick run against
        # the committed full summary included; a run the new run was told to leave out
        # (--backends) and the skip reasons of runs never simulated are not.
        old = fixtures.model_summary()
        self.assertEqual(cr.diff_summaries(old, copy.deepcopy(old), 1e-9), [])
        sim = next(i for i, r in enumerate(old["runs"]) if r.get("mode") == "simulated")
        for outcome, said in (({"skipped": "the installed moelab rejects --inference"},
                               "skipped: the installed moelab rejects --inference"),
                              ({"skipped": "out of device memory: ...", "out_of_memory": True}, "out of device memory")):
            new = copy.deepcopy(old)
            new["subset"] = "quick"
            r = new["runs"][sim]
            for k in ("mode", "device", "calibration", "world_size", "file", "results"):
                r.pop(k, None)
            r.update(outcome)
            diffs = cr.diff_summaries(old, new, 1e-9)
            self.assertEqual(len(diffs), 1, diffs)
            self.assertEqual(diffs[0][1:], ("simulated", said))
        new = copy.deepcopy(old)
        r = new["runs"][sim]
        for k in ("mode", "device", "calibration", "world_size", "file", "results"):
            r.pop(k, None)
        r["skipped"] = f"backend {r['backend']} not selected (--backends cuda)"
        self.assertEqual(cr.diff_summaries(old, new, 1e-9), [])
        # a run now simulated that was not (it ran out of memory before), and a run's file
        new = copy.deepcopy(old)
        for r in new["runs"]:
            if r.get("mode") != "simulated":
                r.update(mode="simulated", file="simulated/x.json", results=old["runs"][sim]["results"])
                r.pop("skipped", None)
        new["runs"][sim]["file"] = "simulated/elsewhere.json"
        diffs = cr.diff_summaries(old, new, 1e-9)
        self.assertTrue(any(d[2] == "a simulated run" for d in diffs), diffs)
        self.assertTrue(any(d[0].endswith(".file") and d[2] == "simulated/elsewhere.json" for d in diffs), diffs)

    def test_a_whole_model_runs_identity_is_compared(self):
        model = "simulated/dgx-a100x1/tiny-model.json"
        for tree in (self.base, self.new):
            mr.write_json(os.path.join(tree, model), fixtures.model_result())
        self.edit(model, lambda r: r["model"].update(source="reworded", description="reworded"))
        self.assertEqual(self.compare()[0], 0)
        self.edit(model, lambda r: r["model"].update(num_layers=4))
        self.edit(model, lambda r: r["training"].update(lr=0.5))
        n, text = self.compare()
        self.assertEqual(n, 1, text)
        self.assertIn("model.num_layers: 2 -> 4", text)
        self.assertIn("training.lr: ", text)
        # a parallel block on one side only, the implementation's options on one side only
        shutil.copy(os.path.join(self.base, model), os.path.join(self.new, model))
        self.edit(model, lambda r: r.pop("parallel"))
        n, text = self.compare()
        self.assertEqual(n, 1, text)
        self.assertIn("parallel: ", text)
        shutil.copy(os.path.join(self.base, model), os.path.join(self.new, model))
        self.edit(model, lambda r: r.update(impl_options={"partitions": 4}))
        n, text = self.compare()
        self.assertEqual(n, 1, text)
        self.assertIn("impl_options: (absent) -> ", text)

    def test_quick_summary_against_full(self):
        mr.write_json(os.path.join(self.new, SUMMARY), fixtures.summary("quick"))
        n, text = self.compare()
        self.assertEqual(n, 0, text)  # the quick point is one of the full run's, unchanged
        mr.write_json(os.path.join(self.new, SUMMARY), fixtures.summary("quick", system_step=0.005))
        n, text = self.compare()
        self.assertEqual(n, 1)
        self.assertIn("speedup.Sys_vs_Base: 2 -> 1.6", text)

    def test_workload_files_compared_exactly(self):
        self.edit(WORKLOAD, lambda w: w.update(tokens_per_rank=512))
        n, text = self.compare()
        self.assertEqual(n, 1)
        self.assertIn("tokens_per_rank: 256 -> 512", text)

    def test_command_line(self):
        script = os.path.join(fixtures.SCRIPTS, "compare_results.py")
        p = subprocess.run([sys.executable, script, self.base, self.new], stdout=subprocess.PIPE, text=True)
        self.assertEqual(p.returncode, 0, p.stdout)
        self.edit(SIM, lambda r: r["metrics"].update(overlap_ratio=0.56))
        p = subprocess.run([sys.executable, script, self.base, self.new], stdout=subprocess.PIPE, text=True)
        self.assertEqual(p.returncode, 1)
        self.assertIn("metrics.overlap_ratio: 0.55 -> 0.56", p.stdout)
        with open(os.path.join(self.new, SIM), "w") as f:
            f.write('{"schema": "moelab.result/1", "mode": ')
        p = subprocess.run([sys.executable, script, self.base, self.new], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
        self.assertEqual(p.returncode, 2)
        self.assertIn(f"{SIM}: malformed JSON", p.stderr)


class Install(unittest.TestCase):
    """The merge of a candidate run into the results: never a silent overwrite of a simulated result."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="install_test.")
        self.base = os.path.join(self.tmp.name, "results")
        self.stage = os.path.join(self.base, "candidate")
        mr.write_json(os.path.join(self.base, SIM), fixtures.result())
        mr.write_json(os.path.join(self.base, MEASURED), fixtures.result("measured"))
        mr.write_json(os.path.join(self.base, SUMMARY), fixtures.summary())

    def tearDown(self):
        self.tmp.cleanup()

    def stage_files(self, sim_step=0.005, summary=None):
        mr.write_json(os.path.join(self.stage, SIM), fixtures.result(step=sim_step))
        with open(os.path.join(self.stage, SIM.replace(".json", ".trace.json")), "w") as f:
            json.dump({"traceEvents": []}, f)
        mr.write_json(os.path.join(self.stage, MEASURED), fixtures.result("measured", step=0.7))
        mr.write_json(os.path.join(self.stage, "simulated/dgx-a100x1/new.json"), fixtures.result())
        if summary:
            mr.write_json(os.path.join(self.stage, SUMMARY), summary)

    def install(self, accept=False):
        return cr.install(self.base, self.stage, accept=accept, log=lambda s: None)

    def value(self, rel):
        return mr.load_json(os.path.join(self.base, rel))["metrics"]["step_time_s"]["median"]

    def test_equal_new_and_measured(self):
        self.stage_files()
        c = self.install()
        self.assertEqual((c["written"], c["new"], c["unchanged"], c["differ"]), (1, 1, 1, 0))
        self.assertEqual(self.value(MEASURED), 0.7)  # measured: always written
        self.assertTrue(os.path.exists(os.path.join(self.base, "simulated/dgx-a100x1/new.json")))
        self.assertTrue(os.path.exists(os.path.join(self.base, SIM.replace(".json", ".trace.json"))))
        self.assertFalse(os.path.exists(self.stage))  # nothing left over

    def test_differing_simulated_result_is_kept_aside(self):
        self.stage_files(sim_step=0.006)
        c = self.install()
        self.assertEqual(c["differ"], 1)
        self.assertEqual(self.value(SIM), 0.005)  # the committed one is untouched
        self.assertEqual(mr.load_json(os.path.join(self.stage, SIM))["metrics"]["step_time_s"]["median"], 0.006)
        self.assertTrue(os.path.exists(os.path.join(self.stage, SIM.replace(".json", ".trace.json"))))
        self.assertEqual(self.value(MEASURED), 0.7)

    def test_update_baseline_accepts(self):
        self.stage_files(sim_step=0.006)
        c = self.install(accept=True)
        self.assertEqual(c["differ"], 1)
        self.assertEqual(self.value(SIM), 0.006)
        self.assertFalse(os.path.exists(self.stage))

    def test_quick_summary_never_replaces_a_full_one(self):
        self.stage_files(summary=fixtures.summary("quick", system_step=0.005))
        self.install(accept=True)
        self.assertEqual(mr.load_json(os.path.join(self.base, SUMMARY))["subset"], "full")

    def test_full_summary_never_replaces_an_extended_one_but_its_claims_are_compared(self):
        ext = fixtures.summary()
        ext["subset"] = "extended"
        mr.write_json(os.path.join(self.base, SUMMARY), ext)
        full = fixtures.summary()
        full["points"] = full["points"][:1]  # the extended sweep's point left out
        self.stage_files(summary=full)
        self.assertEqual(self.install(accept=True)["differ"], 0)
        self.assertEqual(mr.load_json(os.path.join(self.base, SUMMARY))["subset"], "extended")
        # A changed claim is a difference between a full and an extended run (the paper's
        # setup is in both), not between a quick and a full one.
        full["claims"][0]["ours"]["paper_setup"]["value"] = 3.0
        self.assertTrue(any(k.startswith("claims[") for k, _, _ in cr.diff_summaries(ext, full, 1e-9)))
        # Its figure over all points covers other points in each subset: not compared.
        full["claims"][0]["ours"]["paper_setup"]["value"] = ext["claims"][0]["ours"]["paper_setup"]["value"]
        full["claims"][0]["ours"]["all_points"].update(points=1, value=9.0)
        self.assertEqual(cr.diff_summaries(ext, full, 1e-9), [])
        quick = fixtures.summary("quick")
        quick["claims"][0]["ours"]["paper_setup"]["value"] = 3.0
        self.assertFalse(any(k.startswith("claims[") for k, _, _ in cr.diff_summaries(fixtures.summary(), quick, 1e-9)))


    def test_update_baseline_keeps_what_a_summary_not_rewritten_lists(self):
        # A full run accepted over the committed extended summary would write its results but
        # not the summary (it never replaces a larger one), whose points and claims would then
        # describe results no longer in the folder: the results that summary lists are kept
        # aside; another suite's, and files no summary lists, are accepted.
        listed = "simulated/fake/dgx-a100x8/M-fp32-T2048-Sys.json"
        other = "simulated/other/x.json"
        ext = fixtures.summary()
        ext["subset"] = "extended"
        mr.write_json(os.path.join(self.base, SUMMARY), ext)
        for rel in (listed, other):
            mr.write_json(os.path.join(self.base, rel), fixtures.result())
            mr.write_json(os.path.join(self.stage, rel), fixtures.result(step=0.006))
        self.stage_files(sim_step=0.006, summary=fixtures.summary(system_step=0.005))  # a shared point moved
        c = self.install(accept=True)
        self.assertEqual(c["refused"], [(SUMMARY, "full", "extended")])
        self.assertEqual(c["stale"], {SUMMARY: [listed]})
        self.assertEqual(c["kept"], 2)  # the listed result and the summary
        self.assertEqual(self.value(listed), 0.005)
        self.assertTrue(os.path.exists(os.path.join(self.stage, listed)))
        self.assertEqual(self.value(other), 0.006)  # no summary lists it: accepted
        self.assertEqual(self.value(SIM), 0.006)
        self.assertEqual(self.value(MEASURED), 0.7)  # measured files are always written
        # An unchanged full summary lets the listed results in.
        self.tearDown()
        self.setUp()
        mr.write_json(os.path.join(self.base, SUMMARY), ext)
        mr.write_json(os.path.join(self.base, listed), fixtures.result())
        mr.write_json(os.path.join(self.stage, listed), fixtures.result(step=0.006))
        self.stage_files(summary=fixtures.summary())
        c = self.install(accept=True)
        self.assertEqual((c["refused"], c["kept"]), ([], 0))
        self.assertEqual(self.value(listed), 0.006)

    def test_a_summary_that_lists_other_runs_follows_the_suite_with_update_baseline(self):
        # The same figures, one run more that this machine skips (a run added to the suite for
        # another backend): written with --update-baseline, left as it is without.
        base = fixtures.summary()
        base["mode"] = "simulated"  # a mixed summary is written anyway (its measured figures are new)
        base["runs"] = [r for r in base["runs"] if r.get("mode") != "measured"]
        mr.write_json(os.path.join(self.base, SUMMARY), base)
        grown = copy.deepcopy(base)
        extra = copy.deepcopy(grown["runs"][0])
        extra.update(id="cuda-extra", label="cuda-extra")
        grown["runs"].append(extra)
        self.stage_files(summary=copy.deepcopy(grown))
        self.install()
        self.assertEqual(len(mr.load_json(os.path.join(self.base, SUMMARY)).get("runs", [])), len(grown["runs"]) - 1)
        self.stage_files(summary=copy.deepcopy(grown))
        c = self.install(accept=True)
        self.assertEqual(c["differ"], 0)
        self.assertEqual(len(mr.load_json(os.path.join(self.base, SUMMARY))["runs"]), len(grown["runs"]))
        # and an unchanged summary is not rewritten
        self.stage_files(summary=copy.deepcopy(grown))
        self.assertEqual(self.install(accept=True)["written"], 1)  # the measured file only

    def test_a_partial_run_does_not_rewrite_what_a_committed_summary_lists(self):
        # run_suite.py --run stages no summary: a differing result the committed summary lists
        # stays aside even with --update-baseline.
        listed = "simulated/fake/dgx-a100x8/M-fp32-T2048-Base.json"
        mr.write_json(os.path.join(self.base, listed), fixtures.result())
        mr.write_json(os.path.join(self.stage, listed), fixtures.result(step=0.006))
        c = self.install(accept=True)
        self.assertEqual((c["refused"], c["stale"], c["kept"]), ([], {SUMMARY: [listed]}, 1))
        self.assertEqual(self.value(listed), 0.005)
        # ... and a full run's summary, staged beside it, lets it in
        mr.write_json(os.path.join(self.stage, SUMMARY), fixtures.summary())
        c = self.install(accept=True)
        self.assertEqual(c["kept"], 0)
        self.assertEqual(self.value(listed), 0.006)


class Bench(unittest.TestCase):
    def test_informational_comparison(self):
        def bench(t):
            return {"context": {"mode": "measured"}, "benchmarks": [
                {"name": "BM_A", "run_type": "iteration", "real_time": t, "time_unit": "ms"},
                {"name": "BM_B", "run_type": "iteration", "real_time": 1.0, "time_unit": "us"}]}
        with tempfile.TemporaryDirectory() as d:
            mr.write_json(os.path.join(d, "old.json"), bench(2.0))
            new = bench(3.0)
            new["benchmarks"].pop()
            mr.write_json(os.path.join(d, "new.json"), new)
            out = io.StringIO()
            cr.compare_bench(os.path.join(d, "old.json"), os.path.join(d, "new.json"), log=lambda s: print(s, file=out))
            self.assertIn("1.50", out.getvalue())
            self.assertIn("BM_B", out.getvalue())
            p = subprocess.run([sys.executable, os.path.join(fixtures.SCRIPTS, "compare_results.py"), "--bench",
                                os.path.join(d, "old.json"), os.path.join(d, "new.json")], stdout=subprocess.PIPE)
            self.assertEqual(p.returncode, 0)


if __name__ == "__main__":
    unittest.main()
