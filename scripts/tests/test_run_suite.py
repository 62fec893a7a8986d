"""Tests of the suite runner (scripts/run_suite.py): expanding suites, and with MOELAB set to a
moelab binary, a small suite end to end: results, summary, skips listed, a planted change in the
committed results kept aside until --update-baseline.

    MOELAB=build/harness/moelab /usr/bin/python3 -m unittest -v test_run_suite   (from scripts/tests)
"""
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
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
            def key(j):
                return (j.get("path_template", "") + str(j.get("dest")) + j["workload"] + j["impl"]["label"]
                        + str(j["cluster"]) + str(j["ranks"]) + json.dumps(j.get("model_run"), sort_keys=True))
            full = {key(j) for j in run_suite.expand(s, False)}
            for j in run_suite.expand(s, True):
                self.assertIn(key(j), full, f"{s['name']}: a quick run that the full run lacks")

    def test_extended_sweeps_only_on_request(self):
        s = mr.load_suite("mpipemoe")
        extended = {sw["name"] for sw in s["grid"]["sweeps"] if sw.get("extended")}
        self.assertTrue(extended)
        full = run_suite.grid_points(s, False)
        every = run_suite.grid_points(s, False, True)
        self.assertFalse({p["sweep"] for p in full} & extended)
        self.assertEqual({p["sweep"] for p in every} - {p["sweep"] for p in full}, extended)
        key = lambda p: (p["cluster"], p["model"], p["dtype"], p["tokens_per_rank"])
        self.assertLess({key(p) for p in full}, {key(p) for p in every})
        # The claims' paper setup is in the default run.
        setup = s["claims"]["paper_setup"]
        self.assertTrue(any(all(p[k] == v for k, v in setup.items()) for p in full))
        p = subprocess.run([sys.executable, RUNNER, "--suite", "mpipemoe", "--quick", "--extended", "--list"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertEqual(p.returncode, 2)
        self.assertIn("--quick and --extended", p.stderr)
        p = subprocess.run([sys.executable, RUNNER, "--suite", "mpipemoe", "--extended", "--list"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("(extended)", p.stdout)
        # A suite without extended sweeps records its extended run as full.
        self.assertEqual(run_suite.suite_subset(s, "extended"), "extended")
        self.assertEqual(run_suite.suite_subset(mr.load_suite("scmoe"), "extended"), "full")
        self.assertEqual(run_suite.suite_subset(mr.load_suite("scmoe"), "quick"), "quick")

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

    def test_select_workloads_splits_a_run(self):
        """--workload keeps the jobs of one run id's workloads, so that a run too long for one
        call on a lent GPU goes in parts."""
        s = mr.load_suite(fake_suite(self.tmp()))
        plan = run_suite.select_runs([(s, run_suite.expand(s, False))], ["sim"], False)
        names = sorted({j["workload"] for _, js in plan for j in js})
        kept = run_suite.select_workloads(plan, names[:1])
        self.assertEqual({j["workload"] for _, js in kept for j in js}, set(names[:1]))
        with self.assertRaises(mr.SchemaError) as cm:
            run_suite.select_workloads(plan, ["nope"])
        self.assertIn("--workload \"nope\": no selected run has this workload", str(cm.exception))
        self.assertIn(names[0], str(cm.exception))

    def test_extended_runs_only_on_request(self):
        def mark(s):
            s["runs"][0]["extended"] = True
            s["runs"][0].pop("quick", None)
        s = mr.load_suite(fake_suite(self.tmp(), mark))
        self.assertNotIn("sim", {j.get("run") for j in run_suite.expand(s, False)})
        self.assertIn("sim", {j.get("run") for j in run_suite.expand(s, False, True)})
        self.assertEqual(run_suite.suite_subset(s, "extended"), "extended")
        with self.assertRaises(mr.SchemaError) as cm:
            run_suite.select_runs([(s, run_suite.expand(s, False))], ["sim"], False)
        self.assertIn('--run sim: the run of suite fake is marked "extended": add --extended', str(cm.exception))
        kept = run_suite.select_runs([(s, run_suite.expand(s, False, True))], ["sim"], False, True)
        self.assertEqual({j["run"] for _, js in kept for j in js}, {"sim"})
        # An extended run is not in the default run, so not in the quick subset either.
        with self.assertRaises(mr.SchemaError) as cm:
            mr.load_suite(fake_suite(self.tmp(), lambda s: s["runs"][0].update(extended=True, quick=True)))
        self.assertIn("runs[0].extended", str(cm.exception))
        # The registered MPipeMoE suite: the 64-GPU strategies run only with --extended, its
        # results where they were (same files), the 8-GPU one in every subset.
        m = mr.load_suite("mpipemoe")
        dests = lambda jobs: {(j["cluster"], j["workload"], j["impl"]["label"]) for j in jobs if j.get("run", "").startswith("strategies")}
        full, every = dests(run_suite.expand(m, False)), dests(run_suite.expand(m, False, True))
        self.assertEqual({c for c, _, _ in full}, {"dgx-a100x1"})
        self.assertEqual({c for c, _, _ in every}, {"dgx-a100x1", "dgx-a100x8"})
        self.assertEqual(len(every), 2 * len(full))

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

    def test_mpipemoe_gpu_compares_only_the_parts_a_node_model_describes(self):
        """The SXM H100 and H200 pair with h100x1 and h200x1; PCIe and NVL parts need --cluster."""
        sys.path.insert(0, os.path.join(os.path.dirname(fixtures.SCRIPTS), "plots"))
        import mpipemoe_gpu
        for device, cluster in (("NVIDIA H100 80GB HBM3", "h100x1"), ("NVIDIA H200", "h200x1"),
                                ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None), ("NVIDIA H200 NVL", None),
                                ("NVIDIA A100-SXM4-80GB", None)):
            self.assertEqual(mpipemoe_gpu.cluster_for(mr.slug(mr.device_class(device + " (79.1 GiB)"))), cluster, device)

    def tmp(self):
        d = tempfile.TemporaryDirectory()
        self.addCleanup(d.cleanup)
        return d.name


def write_model_suite(folder, change=None):
    s = fixtures.model_suite()
    if change:
        change(s)
    path = os.path.join(folder, "experiments", s["name"], "suite.json")
    mr.write_json(path, s)
    return path


MACHINE = types.SimpleNamespace(moelab="/bin/moelab", hostfile=None, mpirun="/usr/bin/mpirun", cuda_device=None,
                                nranks=lambda job: job["ranks"])


class ModelRuns(unittest.TestCase):
    """Runs of whole models ("models"): their expansion into jobs and command lines."""

    def tmp(self):
        d = tempfile.TemporaryDirectory()
        self.addCleanup(d.cleanup)
        return d.name

    def test_expansion_and_command_lines(self):
        s = mr.load_suite(write_model_suite(self.tmp()))
        jobs = run_suite.expand(s, False)
        base = [j for j in jobs if j["run"] == "base"]
        # 2 models x 2 modes x 2 implementations x 2 clusters x 1 rank count
        self.assertEqual(len(base), 16)
        self.assertEqual(len([j for j in jobs if j["run"] == "sc"]), 8)
        dests = {run_suite.destination(j, MACHINE): j for j in jobs}
        self.assertEqual(len(dests), len(jobs))
        j = next(j for j in base if j["cluster"] == "a800x1" and j["impl"]["label"] == "top1"
                 and j["model_run"]["layers"] == "0:2" and j["model_run"]["run_mode"] == "inference")
        self.assertEqual(run_suite.destination(j, MACHINE), "simulated/a800x1/inference/tiny-dense-se-top1")
        cmd = run_suite.command(j, MACHINE, None, "/out/x")
        self.assertEqual(cmd[:6], ["/bin/moelab", "run", "--model", os.path.join(mr.EXPERIMENTS, "models",
                                                                               "tiny-scmoe.json"), "--impl", "top1"])
        self.assertEqual(json.loads(cmd[cmd.index("--model-override") + 1]), {"scmoe": None})
        for flag, value in (("--layers", "0:2"), ("--warmup", "1"), ("--cluster", "a800x1"), ("--ranks", "2"),
                            ("--steps", "1"), ("--out", "/out/x.json")):
            self.assertEqual(cmd[cmd.index(flag) + 1], value, flag)
        self.assertIn("--inference", cmd)
        self.assertNotIn("--trace", cmd)
        self.assertNotIn("--parallel", cmd)
        # the parallel layout is the cluster's: a800x1's, none on pcie-a30x1; training has no --inference
        k = next(k for k in base if k["cluster"] == "a800x1" and k["workload"] == "tiny-moe")
        cmd = run_suite.command(k, MACHINE, None, "/out/y")
        self.assertEqual(cmd[cmd.index("--parallel") + 1], "tp=1,pp=1,ep=2")
        k = next(k for k in base if k["cluster"] == "pcie-a30x1" and k["workload"] == "tiny-moe"
                 and k["model_run"]["run_mode"] == "training")
        cmd = run_suite.command(k, MACHINE, None, "/out/y")
        self.assertNotIn("--parallel", cmd)
        self.assertNotIn("--inference", cmd)
        # the ScMoE run: its label, its override, its trace, the model it is compared by
        sc = next(j for j in jobs if j["run"] == "sc" and j["workload"] == "tiny-scmoe")
        self.assertEqual((sc["model_run"]["model"], sc["model_run"]["label"]), ("tiny-moe", "Sc-Pos3"))
        cmd = run_suite.command(sc, MACHINE, None, "/out/z")
        self.assertEqual(json.loads(cmd[cmd.index("--model-override") + 1]), {"scmoe": {"position": "pos3"}})
        self.assertEqual(cmd[cmd.index("--trace") + 1], "/out/z.trace.json")
        self.assertEqual(run_suite.destination(sc, MACHINE),
                         f"simulated/{sc['cluster']}/{sc['model_run']['run_mode']}/tiny-moe-Sc-Pos3")

    def test_a_missing_model_file_skips_its_runs(self):
        s = mr.load_suite(write_model_suite(self.tmp()))
        missing = [j for j in run_suite.expand(s, False) if j["workload"] == "no-such-model"]
        self.assertEqual(len(missing), 4)
        for j in missing:
            self.assertEqual(j["model_run"]["missing"], "no model file experiments/models/no-such-model.json in "
                                                        "this checkout (the runs stay in the suite and go once it "
                                                        "exists)")
        p = subprocess.run([sys.executable, RUNNER, "--suite", write_model_suite(self.tmp()), "--list"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("no-such-model", p.stdout)
        self.assertIn("fakemodels: 24 runs (full)", p.stdout)

    def test_quick_subset(self):
        s = mr.load_suite(write_model_suite(self.tmp()))
        quick = [j for j in run_suite.expand(s, True) if j["run"] == "sc"]
        self.assertEqual({j["cluster"] for j in quick}, {"pcie-a30x1"})
        self.assertEqual(len(quick), 4)

    def test_two_runs_writing_one_file_is_an_error(self):
        path = write_model_suite(self.tmp(), lambda s: s["runs"][0].update(path="simulated/{model}-{label}"))
        with self.assertRaises(mr.SchemaError) as cm:
            run_suite.expand(mr.load_suite(path), False)
        msg = str(cm.exception)
        self.assertIn('field "runs[0].path"', msg)
        self.assertIn("gives \"simulated/tiny-moe-top2.json\" to two runs (of \"base\" and \"base\")", msg)

    def test_suite_checks_of_model_runs(self):
        cases = [
            (lambda s: s["runs"][0].update(workloads=["tiny"]), "runs[0].models", "not both"),
            (lambda s: s["runs"][0]["models"][1].update(layers="2:1"), "runs[0].models[1].layers", '"A:B" with A < B'),
            (lambda s: s["runs"][0]["models"].append("../x"), "runs[0].models[2]", "model file's name"),
            (lambda s: s["runs"][0].update(mode="serving"), "runs[0].mode", '"training", "inference"'),
            (lambda s: s["runs"][0].update(label="x"), "runs[0].label", "this run has 2"),
            (lambda s: s["runs"][1]["models"][0].update(parallel={"a800x1": 8}), "runs[1].models[0].parallel.a800x1",
             "expected a string"),
            (lambda s: s["runs"][0]["models"][1].update(parallel={"a800x1": "ep=2"}), "runs[0].models[1].parallel",
             '"layers" or "parallel", not both'),
            (lambda s: s["claims"]["items"][0].update(system="nope"), "claims.items[0].system",
             'is not the label of a run with "models" (Sc-Pos3, top1, top2)'),
            (lambda s: s["claims"]["items"][0].pop("versus"), "claims.items[0].versus", "missing"),
            (lambda s: s["claims"]["items"][1].update(versus="top2"), "claims.items[1].versus", "no baseline"),
            (lambda s: s["claims"]["items"][1].update(paper_range=[0.8, 1.0]), "claims.items[1].paper_range",
             "0 < low <= paper (0.7) <= high"),
            (lambda s: s["claims"]["items"][0]["select"].update(cluster="x"), "claims.items[0].select.cluster",
             "not a selection field"),
            (lambda s: s["claims"]["items"][0].update(stat="median"), "claims.items[0].stat", "max, mean, min"),
        ]
        for change, field, text in cases:
            path = write_model_suite(self.tmp(), change)
            with self.assertRaises(mr.SchemaError, msg=field) as cm:
                mr.load_suite(path)
            self.assertIn(f'field "{field}"', str(cm.exception))
            self.assertIn(text, str(cm.exception))

    def test_inference_probe(self):
        d = self.tmp()
        fake = os.path.join(d, "moelab")
        for script, expected in (('echo \'moelab: error: unknown option "--inference" for moelab run\' >&2; exit 2',
                                  run_suite.INFERENCE_NOTE), ("exit 0", None)):
            with open(fake, "w") as f:
                f.write("#!/bin/sh\ncase \"$*\" in *--inference*) " + script + ";; esac\nexit 0\n")
            os.chmod(fake, 0o755)
            machine = types.SimpleNamespace(moelab=fake)
            got = run_suite.probe_inference(machine, d)
            if expected is None:
                self.assertIsNone(got)
            else:
                self.assertTrue(got.startswith(expected), got)
                self.assertIn('moelab said: moelab: error: unknown option "--inference"', got)


class PipelineRuns(unittest.TestCase):
    """A run's or model entry's "pipeline" flags and a model entry's "ranks": passed to moelab,
    recorded in the summary rows; the pipelined figures and the claim metrics on them."""

    def suite(self, change=None):
        def edit(s):
            r = s["runs"][0]
            r["pipeline"] = {"schedule": "group-interleaved", "chunks": 3, "pad_layers": True, "offload_chunks": 1}
            r["models"][0] = {"file": r["models"][0] if isinstance(r["models"][0], str) else r["models"][0]["file"],
                              "ranks": 4, "pipeline": {"microbatches": 8, "group": 2, "offload_chunks": "all"}}
            if change:
                change(s)
        d = tempfile.TemporaryDirectory()
        self.addCleanup(d.cleanup)
        return mr.load_suite(write_model_suite(d.name, edit))

    def test_cuda_profile_reaches_the_cuda_runs_only(self):
        # --cuda-profile: the cuda runs choose their GEMM paths by that profile's table; the
        # sim and cpu runs take no profile from it.
        s = mr.load_suite(os.path.join(mr.EXPERIMENTS, "foundation", "suite.json"))
        jobs = run_suite.expand(s, False)
        cuda = next(j for j in jobs if j["backend"] == "cuda" and j["ranks"] == 1)
        sim = next(j for j in jobs if j["backend"] == "sim")
        with_profile = types.SimpleNamespace(**vars(MACHINE), cuda_profile="/p/profile.json")
        cmd = run_suite.command(cuda, with_profile, None, "/out/c")
        self.assertEqual(cmd[cmd.index("--backend"):cmd.index("--backend") + 4], ["--backend", "cuda", "--profile", "/p/profile.json"])
        self.assertNotIn("--profile", run_suite.command(sim, with_profile, None, "/out/s"))
        self.assertNotIn("--profile", run_suite.command(cuda, MACHINE, None, "/out/c"))

    def test_gemm_path_reaches_the_cuda_and_sim_runs(self):
        # A run's own "gemm_path" (foundation's cuda-grouped: the ablation of the path choice)
        # and run_suite.py --gemm-path over every run both become moelab run --gemm-path, on
        # cuda and sim only.
        s = mr.load_suite(os.path.join(mr.EXPERIMENTS, "foundation", "suite.json"))
        jobs = run_suite.expand(s, False)
        grouped = [j for j in jobs if j.get("run") == "cuda-grouped"]
        self.assertEqual([j["workload"] for j in grouped], ["small", "gpt3-xl-e64-16k"])
        self.assertEqual(grouped[0]["path_template"], "measured/cuda/{device}/{workload}-{impl}-grouped-np{ranks}")
        cmd = run_suite.command(grouped[0], MACHINE, None, "/out/g")
        self.assertEqual(cmd[cmd.index("--gemm-path") + 1], "grouped")
        plain = next(j for j in jobs if j.get("run") == "cuda" and j["workload"] == "gpt3-xl-e64-16k"
                     and j["impl"]["label"] == "fastmoe")
        self.assertNotIn("--gemm-path", run_suite.command(plain, MACHINE, None, "/out/c"))
        forced = types.SimpleNamespace(**vars(MACHINE), gemm_path="loop")
        for j in (plain, next(j for j in jobs if j["backend"] == "sim")):
            cmd = run_suite.command(j, forced, None, "/out/x")
            self.assertEqual(cmd[cmd.index("--gemm-path") + 1], "loop")
        cpu = next(j for j in jobs if j["backend"] == "cpu")
        self.assertNotIn("--gemm-path", run_suite.command(cpu, forced, None, "/out/p"))
        # A run's own path is kept under --gemm-path (cuda-grouped stays grouped).
        cmd = run_suite.command(grouped[0], forced, None, "/out/g")
        self.assertEqual(cmd[cmd.index("--gemm-path") + 1], "grouped")
        # The summary's run row says the path its result was pinned to (and a run that chose
        # its paths says nothing), and the schema checks the name.
        res = fixtures.result("measured")
        res["metrics"]["gemm_path_forced"] = "grouped"
        summary = run_suite.summarize(s, [{**grouped[0], "result": res, "file": "g.json"},
                                          {**plain, "result": fixtures.result("measured"), "file": "c.json"}], "full", 0)
        rows = {r["file"]: r["results"] for r in summary["runs"]}
        self.assertEqual(rows["g.json"]["gemm_path_forced"], "grouped")
        self.assertNotIn("gemm_path_forced", rows["c.json"])
        mr.check_summary(json.loads(json.dumps(summary)), "summary")
        rows["g.json"]["gemm_path_forced"] = "bmm"
        with self.assertRaisesRegex(mr.SchemaError, r"gemm_path_forced"):
            mr.check_summary(json.loads(json.dumps(summary)), "summary")
        # --gemm-path is refused without --run, with --update-baseline, and into the repository's
        # results/ (its results would take the place of the suite's own).
        for extra in (["--backends", "sim"], ["--run", "gpu-sim", "--update-baseline", "--out", "/tmp/x"],
                      ["--run", "gpu-sim"], ["--run", "gpu-sim", "--out", os.path.join(fixtures.ROOT, "results")]):
            p = subprocess.run([sys.executable, RUNNER, "--suite", "mpipemoe", "--gemm-path", "grouped", *extra],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.assertEqual(p.returncode, 2, (extra, p.stderr))
            self.assertIn("--gemm-path needs --run ID and an --out other than the repository's results/", p.stderr)

    def test_flags_merge_and_reach_the_command_line(self):
        s = self.suite()
        j = next(j for j in run_suite.expand(s, False) if j["run"] == s["runs"][0]["id"]
                 and j["model_run"]["pipeline"] and j["cluster"])
        self.assertEqual(j["ranks"], 4)
        self.assertEqual(j["model_run"]["pipeline"], {"schedule": "group-interleaved", "chunks": 3, "pad_layers": True,
                                                      "offload_chunks": "all", "microbatches": 8, "group": 2})
        cmd = run_suite.command(j, MACHINE, None, "/out/x")
        i = cmd.index("--schedule")
        self.assertEqual(cmd[i:i + 11], ["--schedule", "group-interleaved", "--chunks", "3", "--group", "2",
                                         "--microbatches", "8", "--offload-chunks", "all", "--pad-layers"])
        self.assertEqual(cmd[cmd.index("--ranks") + 1], "4")
        self.assertNotIn("--recompute", cmd)
        self.assertNotIn("--offload-all-lifespans", cmd)
        # a model entry without flags in a run without them: none on the command line, none in the row
        plain = next(j for j in run_suite.expand(s, False) if not j["model_run"]["pipeline"])
        self.assertNotIn("--schedule", run_suite.command(plain, MACHINE, None, "/out/y"))
        row = run_suite.summarize(s, [{**j, "result": None, "skipped": "not run"}], "full", 0)["runs"][0]
        self.assertEqual(row["pipeline"]["offload_chunks"], "all")
        self.assertNotIn("pipeline", run_suite.summarize(s, [{**plain, "skipped": "x"}], "full", 0)["runs"][0])

    def test_bad_flags_are_named(self):
        for bad, field in ((lambda s: s["runs"][0]["pipeline"].update(chunk=3), "pipeline.chunk"),
                           (lambda s: s["runs"][0]["pipeline"].update(offload_chunks="some"), "offload_chunks"),
                           (lambda s: s["runs"][0]["pipeline"].update(recompute="most"), "recompute"),
                           (lambda s: s["runs"][0]["models"][0].update(ranks=0), "ranks")):
            with self.assertRaises(mr.SchemaError) as e:
                self.suite(bad)
            self.assertIn(field, str(e.exception))

    def test_pipeline_figures(self):
        res = {"metrics": {"tokens_per_s": 1000.0},
               "parallel": {"bubble": 0.2, "stages": [
                   {"peak_activation_bytes": 10, "peak_device_bytes": 30, "expected_peak_activation_ma": 1.0},
                   {"peak_activation_bytes": 40, "peak_device_bytes": 50, "expected_peak_activation_ma": 0.5}],
                   "offload": {"chunks": 1, "k": 0.5, "saved_bytes_per_layer": 7, "stages": [
                       {"bytes_per_step": 0, "peak_host_bytes": 0, "planned": 8, "kept": 2},
                       {"bytes_per_step": 9, "peak_host_bytes": 3, "planned": 8, "kept": 5}]}}}
        f = mr.pipeline_figures(res)
        self.assertEqual((f["peak_activation_bytes"], f["stage_expected_peak_activation_ma"], f["tokens_per_s"]),
                         (40, [1.0, 0.5], 1000.0))
        self.assertEqual(f["offload"]["stage_bytes_per_step"], [0, 9])
        self.assertEqual(f["offload"]["saved_bytes_per_layer"], 7)
        self.assertEqual((f["offload"]["kept"], f["offload"]["planned"]), (7, 16))

    def test_a_claim_names_the_share_of_offloads_each_run_kept(self):
        """A run whose offloads the gap rule skipped says so beside its figure: "negligible
        overhead" at a point that moved nothing is no evidence for the claim."""
        runs = [fixtures.model_row("base", "m", "c", 1.0), fixtures.model_row("off", "m", "c", 1.0),
                fixtures.model_row("base", "n", "c", 1.0), fixtures.model_row("off", "n", "c", 1.25)]
        runs[1]["results"]["offload"] = {"chunks": 3, "stage_bytes_per_step": [0, 0], "planned": 48, "kept": 0}
        runs[3]["results"]["offload"] = {"chunks": 3, "stage_bytes_per_step": [0, 9], "planned": 48, "kept": 30}
        s = fixtures.model_suite()
        (t,) = run_suite.claims_table({**s, "claims": {"size_tolerance": 0.05, "items": [
            {"on": "runs", "system": "off", "versus": "base", "stat": "min", "text": "t", "source": "s",
             "id": "t", "metric": "relative_throughput", "paper": 1.0}]}}, [], runs)
        self.assertEqual(sorted(t["ours"]["runs"]["used"]),
                         ["c training m (0 of 48 planned offloads kept): 1.00x",
                          "c training n (30 of 48 planned offloads kept): 0.80x"])
        # a summary written before the counts, or a run without offload: no note
        del runs[3]["results"]["offload"]["kept"]
        self.assertEqual(mr.offload_note(runs[3]), "")
        self.assertEqual(mr.offload_note(runs[0]), "")

    def test_relative_throughput_and_activation_saving(self):
        def row(label, step, act):
            r = fixtures.model_row(label, "m", "c", step)
            r["results"]["peak_activation_bytes"] = act
            return r
        runs = [row("base", 1.0, 900), row("off", 1.02, 500)]
        s = fixtures.model_suite()
        c = {"on": "runs", "system": "off", "versus": "base", "stat": "min", "text": "t", "source": "s"}
        (t,) = run_suite.claims_table({**s, "claims": {"size_tolerance": 0.05, "items": [
            {**c, "id": "t", "metric": "relative_throughput", "paper": 1.0}]}}, [], runs)
        self.assertAlmostEqual(t["ours"]["runs"]["value"], 1 / 1.02)
        self.assertEqual((t["direction_agrees"], t["size_agrees"], t["verdict"]), (None, True, "agrees in size"))
        (a,) = run_suite.claims_table({**s, "claims": {"size_tolerance": 0.05, "items": [
            {**c, "id": "a", "metric": "activation_saving", "paper": 0.3333, "paper_range": [0.3333, 1.0]}]}}, [], runs)
        self.assertAlmostEqual(a["ours"]["runs"]["value"], 1 - 500 / 900)
        self.assertEqual((a["direction_agrees"], a["size_agrees"]), (True, True))
        self.assertEqual(mr.fmt_claim("relative_throughput", 0.98), "0.98x")


class Figures(unittest.TestCase):
    """plots/figures.py: a figure whose data is gone is not left behind for the report to embed."""

    def test_a_figure_without_its_data_is_removed_not_kept(self):
        sys.path.insert(0, os.path.join(fixtures.ROOT, "plots"))
        import figures as plot_figures
        with tempfile.TemporaryDirectory() as d:
            results, figs = os.path.join(d, "results"), os.path.join(d, "results", "figures")
            os.makedirs(figs)
            stale = os.path.join(figs, "x-gap.png")
            other = os.path.join(figs, "y.png")
            for f in (stale, other):
                open(f, "wb").close()
            suite = {"name": "x", "out": "simulated/x", "figures": [
                {"id": "gap", "script": "plots/none.py", "args": ["--data", "{out}/gap.json", "--out", "{figures}/x-gap.png"]}]}
            lines = []
            made, missing, failed = plot_figures.make(suite, results, figs, log=lines.append)
            self.assertEqual((made, missing, failed), ([], ["gap"], []))
            self.assertFalse(os.path.exists(stale))
            self.assertTrue(os.path.exists(other))  # only the figure's own output
            self.assertIn("removed x-gap.png", "\n".join(lines))


class RunClaims(unittest.TestCase):
    """Claims judged on whole-model runs (run_suite.claims_table with "on": "runs")."""

    def suite(self, *items):
        s = fixtures.model_suite()
        s["claims"]["items"] = list(items)
        return s

    def claim(self, **kw):
        c = {"id": "c", "on": "runs", "system": "Sc", "versus": "top2", "metric": "speedup", "stat": "mean",
             "paper": 1.3, "text": "1.3x", "source": "Fake"}
        c.update(kw)
        return c

    RUNS = [fixtures.model_row("top2", "m1", "pcie", 0.010), fixtures.model_row("Sc", "m1", "pcie", 0.008),
            fixtures.model_row("top2", "m2", "pcie", 0.020), fixtures.model_row("Sc", "m2", "pcie", 0.010),
            fixtures.model_row("top2", "m1", "nvl", 0.010, share=0.2), fixtures.model_row("Sc", "m1", "nvl", 0.0125),
            # paired by layers too: the pair-only run is not m1's whole model
            fixtures.model_row("Sc", "m1", "pcie", 0.001, layers="2:4"),
            # a system run without a baseline run beside it is left out
            fixtures.model_row("Sc", "m3", "pcie", 0.001),
            fixtures.model_row("Sc", "m1", "pcie", 0.004, run_mode="inference", overlap=0.9, a2a=None),
            fixtures.model_row("top2", "m1", "pcie", 0.008, run_mode="inference", overlap=0.0)]

    def table(self, *items):
        return run_suite.claims_table(self.suite(*items), [], self.RUNS)

    def test_speedup_mean_over_the_selected_pairs(self):
        (r,) = self.table(self.claim(select={"clusters": ["pcie"], "mode": "training"}, paper=1.6))
        o = r["ours"]["runs"]
        self.assertEqual(r["compared_on"], "runs")
        self.assertEqual(o["points"], 2)
        self.assertAlmostEqual(o["value"], (1.25 + 2.0) / 2)
        self.assertEqual(o["used"], ["pcie training m1: 1.25x", "pcie training m2: 2.00x"])
        self.assertEqual((r["direction_agrees"], r["size_agrees"]), (True, True))
        self.assertEqual(r["verdict"], "agrees in direction and size")
        mr.check_summary({**fixtures.model_summary(), "claims": [r]}, "(summary)")

    def test_a_claim_judged_without_a_selected_run_says_so(self):
        # A worst-point claim whose worst run ran out of memory (or whose baseline run failed)
        # would otherwise look judged on every selected point.
        claim = self.claim(select={"clusters": ["pcie"], "mode": "training"}, stat="min", paper=1.25)
        (whole,) = self.table(claim)
        self.assertNotIn("missing", whole["ours"]["runs"])
        runs = [dict(r) for r in self.RUNS]
        oom = next(r for r in runs if r["label"] == "Sc" and r["model"] == "m1" and r["cluster"] == "pcie"
                   and not r.get("layers") and r["run_mode"] == "training")
        for k in ("results", "mode", "file"):
            oom.pop(k, None)
        oom.update(skipped="out of device memory: ...", out_of_memory=True)
        failed = next(r for r in runs if r["label"] == "top2" and r["model"] == "m2")
        (r,) = run_suite.claims_table(self.suite(claim), [], runs)
        self.assertEqual(r["ours"]["runs"]["points"], 1)
        self.assertEqual(r["ours"]["runs"]["missing"], ["pcie training m1 Sc: out of device memory"])
        self.assertIn("(on 1 of 2 selected points; without pcie training m1 Sc: out of device memory)", r["verdict"])
        for k in ("results", "mode", "file"):
            failed.pop(k, None)
        failed.update(skipped="moelab failed", failed=True)
        (r,) = run_suite.claims_table(self.suite(claim), [], runs)
        self.assertEqual(r["ours"]["runs"]["points"], 0)
        self.assertEqual(r["ours"]["runs"]["missing"], ["pcie training m1 Sc: out of device memory",
                                                        "pcie training m2 top2: failed"])
        mr.check_summary({**fixtures.model_summary(), "claims": [r]}, "(summary)")
        # a missing baseline run that two systems pair with is one missing point, not two
        runs = [dict(r) for r in self.RUNS] + [fixtures.model_row("Sc2", "m1", "pcie", 0.005)]
        base = next(r for r in runs if r["label"] == "top2" and r["model"] == "m1" and r["cluster"] == "pcie"
                    and r["run_mode"] == "training")
        for k in ("results", "mode", "file"):
            base.pop(k, None)
        base.update(skipped="out of device memory: ...", out_of_memory=True)
        (r,) = run_suite.claims_table(self.suite(self.claim(system=["Sc", "Sc2"], select={"clusters": ["pcie"],
                                                                                         "mode": "training"})), [], runs)
        self.assertEqual(r["ours"]["runs"]["missing"], ["pcie training m1 top2: out of device memory"])

    def test_two_baseline_runs_a_system_run_could_pair_with_are_refused(self):
        # Paired by model, layers, cluster and run mode: two top2 runs there (other layouts) would
        # leave the pairing to the rows' order.
        runs = [dict(r) for r in self.RUNS] + [{**fixtures.model_row("top2", "m1", "pcie", 0.020), "parallel": "tp=2"}]
        with self.assertRaises(mr.SchemaError) as cm:
            run_suite.claims_table(self.suite(self.claim()), [], runs)
        self.assertIn("two top2 runs at pcie training m1", str(cm.exception))

    def test_a_claims_mode_is_that_of_the_runs_it_was_judged_on(self):
        claim = self.claim(select={"clusters": ["pcie"], "mode": "training"})
        runs = [dict(r) for r in self.RUNS] + [{**fixtures.model_row("other", "m9", "gpu", 0.01), "mode": "measured"},
                                               {**fixtures.model_row("Sc", "m7", "pcie", 0.01), "mode": "measured"}]
        (r,) = run_suite.claims_table(self.suite(claim), [], runs)
        # neither an unrelated measured run nor a system run without a baseline beside it makes it mixed
        self.assertEqual(r["mode"], "simulated")
        for x in runs:
            if x.get("cluster") == "pcie" and "results" in x:
                x["mode"] = "measured"
        (r,) = run_suite.claims_table(self.suite(claim), [], runs)
        self.assertEqual(r["mode"], "measured")
        runs[0]["mode"] = "simulated"
        (r,) = run_suite.claims_table(self.suite(claim), [], runs)
        self.assertEqual(r["mode"], "mixed")

    def test_selection_stat_and_verdicts(self):
        (r,) = self.table(self.claim(select={"clusters": ["nvl"]}, paper=1.11))
        self.assertAlmostEqual(r["ours"]["runs"]["value"], 0.8)
        self.assertEqual((r["direction_agrees"], r["verdict"]), (False, "disagrees in direction"))
        (r,) = self.table(self.claim(select={"models": ["m1"], "mode": "training"}, stat="max", paper=3.0))
        self.assertEqual((r["ours"]["runs"]["points"], r["ours"]["runs"]["value"]), (2, 1.25))
        self.assertEqual((r["direction_agrees"], r["size_agrees"]), (True, False))
        self.assertEqual(r["verdict"], "agrees in direction, ours is a +25% gain against the paper's +200%")
        (r,) = self.table(self.claim(select={"mode": "training"}, stat="min"))
        self.assertAlmostEqual(r["ours"]["runs"]["value"], 0.8)
        (r,) = self.table(self.claim(select={"mode": "inference"}))
        self.assertEqual(r["ours"]["runs"]["used"], ["pcie inference m1: 2.00x"])

    def test_one_systems_figures(self):
        share, ov, a2a = self.table(
            self.claim(id="s", system="top2", versus=None, metric="all_to_all_share", stat="mean", paper=0.6,
                       select={"clusters": ["nvl"]}),
            self.claim(id="o", metric="overlap_ratio", versus=None, stat="min", paper=0.7, paper_range=[0.7, 1.0],
                       select={"mode": "inference"}),
            self.claim(id="a", system=["Sc", "top2"], metric="all_to_all_overlap", versus=None, stat="min",
                       paper=0.7))
        self.assertEqual(share["ours"]["runs"]["value"], 0.2)
        # one system's figure: no direction; size against the paper's figure, or its range
        self.assertEqual((share["direction_agrees"], share["size_agrees"]), (None, False))
        self.assertEqual(share["verdict"], "ours is 0.33x the paper's figure")
        self.assertEqual(ov["ours"]["runs"]["value"], 0.9)
        self.assertEqual((ov["direction_agrees"], ov["size_agrees"], ov["verdict"]), (None, True, "agrees in size"))
        self.assertEqual(a2a["ours"]["runs"]["points"], 0)
        self.assertEqual(a2a["verdict"], "not run (no selected run of Sc, top2)")
        self.assertEqual(mr.claim_rows({"suite": "x", "claims": [ov]})[0]["paper"], "70% to 100%")

    def test_not_run(self):
        (r,) = self.table(self.claim(select={"clusters": ["nowhere"]}))
        self.assertEqual((r["ours"], r["direction_agrees"], r["size_agrees"]), ({"runs": {"points": 0}}, None, None))
        self.assertEqual(r["verdict"], "not run (no selected run of Sc with a top2 run beside it)")
        row = mr.claim_rows({"suite": "x", "claims": [r]})[0]
        self.assertEqual((row["ours"], row["points"]), ("not run", "0"))

    def test_grid_claims_judged_as_before(self):
        s = fixtures.suite()
        pts = fixtures.summary()["points"]
        (r,) = run_suite.claims_table(mr.check_suite(s, "x"), pts)
        self.assertEqual((r["compared_on"], r["ours"]["paper_setup"]["points"], r["ours"]["all_points"]["value"]),
                         ("paper_setup", 1, 2.0))
        self.assertEqual((r["direction_agrees"], r["size_agrees"]), (True, False))
        self.assertEqual(r["verdict"], "agrees in direction, ours is a +100% gain against the paper's +180%")

    def test_a_speedup_is_judged_on_its_gain(self):
        # 1.04x against the paper's 1.30x is within 25% of the factor (0.80x of it) but a +4%
        # gain against +30%: no agreement in size. 1.25x against 1.30x (+25% against +30%) agrees.
        # A slower system (0.95x against 1.11x) agrees in no size either.
        self.assertEqual(run_suite.judge("speedup", 1.04, 1.30, 0.25),
                         (True, False, "agrees in direction, ours is a +4% gain against the paper's +30%"))
        self.assertEqual(run_suite.judge("speedup", 1.25, 1.30, 0.25), (True, True, "agrees in direction and size"))
        self.assertEqual(run_suite.judge("all_to_all_speedup", 0.95, 1.11, 0.25), (False, False, "disagrees in direction"))
        # a range of speed-ups: its ends' gains widened by the tolerance (+10% .. +50% -> +7.5% .. +62.5%)
        self.assertTrue(run_suite.judge("speedup", 1.08, 1.3, 0.25, [1.1, 1.5])[1])
        self.assertFalse(run_suite.judge("speedup", 1.07, 1.3, 0.25, [1.1, 1.5])[1])
        self.assertTrue(run_suite.judge("speedup", 1.62, 1.3, 0.25, [1.1, 1.5])[1])
        # other figures as they are: a memory saving of 0.20 against 0.25 is within 25% of it
        self.assertEqual(run_suite.judge("memory_saving", 0.20, 0.25, 0.25), (True, True, "agrees in direction and size"))
        self.assertEqual(run_suite.judge("memory_saving", -0.01, 0.01, 5.0), (False, False, "disagrees in direction"))
        # relative throughput (a cost claimed negligible) stays a ratio, without direction
        self.assertEqual(run_suite.judge("relative_throughput", 0.97, 1.0, 0.05), (None, True, "agrees in size"))


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


@unittest.skipUnless(os.environ.get("MOELAB"), "set MOELAB to a moelab binary")
class EndToEndModels(unittest.TestCase):
    def test_model_runs_summary_and_claims(self):
        with tempfile.TemporaryDirectory() as d:
            suite = write_model_suite(d)
            results = os.path.join(d, "results")
            p = subprocess.run([sys.executable, RUNNER, "--suite", suite, "--out", results, "--quick",
                                "--moelab", os.environ["MOELAB"]], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
            self.assertEqual(p.returncode, 0, p.stdout)
            self.assertIn("no model file experiments/models/no-such-model.json", p.stdout)
            s = mr.load_summary(os.path.join(results, "simulated/fakemodels/summary.json"))
            done = [r for r in s["runs"] if "results" in r]
            self.assertTrue(done)
            for r in done:
                self.assertIn(r["run_mode"], ("training", "inference"))
                self.assertGreater(r["results"]["all_to_all_share"], 0)
                mr.load_result(os.path.join(results, r["file"]))
            sc = [r for r in done if r["label"] == "Sc-Pos3"]
            self.assertTrue(sc and all("all_to_all_overlap" in r["results"] for r in sc))
            self.assertTrue(all("--inference" in r["skipped"] or "no model file" in r["skipped"]
                                for r in s["runs"] if "results" not in r))
            claims = {c["id"]: c for c in s["claims"]}
            self.assertEqual(claims["sc-train"]["ours"]["runs"]["points"], 1)
            self.assertEqual(claims["sc-train"]["ours"]["runs"]["used"][0].split(":")[0],
                             "pcie-a30x1 training tiny-moe")


if __name__ == "__main__":
    unittest.main()
