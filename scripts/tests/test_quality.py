"""Tests of the quality comparison's summary (scripts/quality.py): statistics over seeds, the curve
band, the comparison with the reference, the markov floor, the experiment file's checks, and
that a failed run leaves the results folder as it was. With MOELAB set to a moelab binary (CTest
sets it), every variant runs a few steps on markov:8 end to end; without it that test is skipped.

    /usr/bin/python3 -m unittest -v test_quality      (from scripts/tests)
"""
import contextlib
import io
import json
import math
import os
import stat
import tempfile
import unittest

import fixtures  # noqa: F401  (puts scripts/ on the path)
import quality


def run_result(points, active=1000.0, flops=6000.0, floor=None, data="markov:8", k=2):
    return {"device": "cpu", "commit": "abc", "model": {"seq_len": 8},
            "metrics": {"parameters": {"total": 2000, "active_per_token": active, "top_k": k, "routed_experts": 1000},
                        "model_flops_per_token": flops,
                        "validation": {"data": data, "synthetic": floor is not None, "entropy_rate": floor,
                                       "train_bytes": None, "valid_bytes": None, "tokens_per_evaluation": 64,
                                       "points": points}}}


class Stats(unittest.TestCase):
    def test_mean_std_spread(self):
        s = quality.stats([2.0, 4.0, 9.0])
        self.assertEqual(s["n"], 3)
        self.assertAlmostEqual(s["mean"], 5.0)
        # sample standard deviation (n - 1): sqrt(((-3)^2 + (-1)^2 + 4^2) / 2) = sqrt(13)
        self.assertAlmostEqual(s["std"], math.sqrt(13.0))
        self.assertEqual((s["min"], s["max"], s["spread"]), (2.0, 9.0, 7.0))

    def test_one_seed_has_no_std(self):
        s = quality.stats([3.5])
        self.assertIsNone(s["std"])
        self.assertEqual((s["mean"], s["spread"]), (3.5, 0.0))

    def test_no_values(self):
        with self.assertRaises(ValueError):
            quality.stats([])


class Band(unittest.TestCase):
    def test_mean_min_max_per_step(self):
        b = quality.band([[[0, 5.0], [10, 3.0]], [[0, 5.5], [10, 2.0]], [[0, 4.5], [10, 2.5]]])
        self.assertEqual(b["steps"], [0, 10])
        self.assertAlmostEqual(b["mean"][0], 5.0)
        self.assertAlmostEqual(b["mean"][1], 2.5)
        self.assertEqual(b["min"], [4.5, 2.0])
        self.assertEqual(b["max"], [5.5, 3.0])

    def test_different_steps_refused(self):
        with self.assertRaises(ValueError):
            quality.band([[[0, 5.0], [10, 3.0]], [[0, 5.0], [20, 3.0]]])


class Versus(unittest.TestCase):
    def test_ranges_apart(self):
        v = quality.versus({1: 3.0, 2: 3.1, 3: 3.2}, {1: 2.7, 2: 2.9, 3: 2.8})
        self.assertAlmostEqual(v["delta_mean"], -0.3)
        self.assertAlmostEqual(v["delta_per_seed"]["2"], -0.2)
        self.assertTrue(v["ranges_apart"])
        self.assertIn("lower than", v["verdict"])

    def test_overlapping_ranges(self):
        # means differ, but one seed of the variant is worse than the reference's best
        v = quality.versus({1: 3.0, 2: 3.1, 3: 3.2}, {1: 2.8, 2: 3.05, 3: 2.9})
        self.assertLess(v["delta_mean"], 0)
        self.assertFalse(v["ranges_apart"])
        self.assertIn("within", v["verdict"])

    def test_higher(self):
        v = quality.versus({1: 2.0, 2: 2.1}, {1: 2.5, 2: 2.2})
        self.assertTrue(v["ranges_apart"])
        self.assertIn("higher than", v["verdict"])

    def test_touching_ranges_are_not_apart(self):
        self.assertFalse(quality.versus({1: 2.0, 2: 2.2}, {1: 2.2, 2: 2.4})["ranges_apart"])

    def test_one_seed_has_no_verdict(self):
        v = quality.versus({1: 3.0}, {1: 2.0})
        self.assertAlmostEqual(v["delta_mean"], -1.0)
        self.assertIsNone(v["ranges_apart"])
        self.assertIn("one seed", v["verdict"])

    def test_different_seeds_refused(self):
        with self.assertRaises(ValueError):
            quality.versus({1: 2.0, 2: 2.1}, {1: 2.0, 3: 2.1})


class SummarizeSource(unittest.TestCase):
    def test_markov_source(self):
        floor = math.log(8)
        res = {"top2": {s: run_result([[0, 5.5], [10, 2.4 + 0.1 * s]], floor=floor) for s in (1, 2, 3)},
               "scmoe": {s: run_result([[0, 5.5], [10, 2.3 + 0.05 * s]], active=1500, flops=9000, floor=floor, k=1)
                         for s in (1, 2, 3)}}
        out = quality.summarize_source(res, "top2")
        self.assertEqual(out["entropy_floor"], floor)
        t, c = out["variants"]["top2"], out["variants"]["scmoe"]
        self.assertAlmostEqual(t["final_loss"]["mean"], 2.6)
        self.assertAlmostEqual(t["final_loss"]["spread"], 0.2)
        self.assertAlmostEqual(t["gap_to_floor"], 2.6 - floor)
        self.assertEqual(t["final_loss"]["per_seed"], {"1": 2.5, "2": 2.6, "3": 2.7})
        self.assertEqual(t["curve"]["steps"], [0, 10])
        self.assertAlmostEqual(c["final_loss"]["mean"], 2.4)
        self.assertEqual((c["parameters_active_per_token"], c["training_flops_per_token"], c["top_k"]), (1500, 9000, 1))
        vs = out["versus_reference"]
        self.assertEqual(list(vs), ["scmoe"])
        self.assertAlmostEqual(vs["scmoe"]["delta_mean"], -0.2)
        self.assertTrue(vs["scmoe"]["ranges_apart"])  # ScMoE's worst seed 2.45 < top-2's best 2.5
        table = quality.table({"reference": "top2", "sources": {"markov8": out}}, {"scmoe": "ScMoE"})
        self.assertIn("floor ln K = 2.079", table)
        self.assertIn("| ScMoE | 1,500 |", table)

    def test_text_source_has_no_floor(self):
        res = {"top2": {1: run_result([[0, 5.5], [5, 3.0]], data="/a,/b")}}
        out = quality.summarize_source(res, "top2")
        self.assertIsNone(out["entropy_floor"])
        self.assertNotIn("gap_to_floor", out["variants"]["top2"])
        self.assertIsNone(out["variants"]["top2"]["final_loss"]["std"])
        self.assertEqual(out["versus_reference"], {})
        self.assertIn("| — |", quality.table({"reference": "top2", "sources": {"t": out}}))


class Experiment(unittest.TestCase):
    def test_committed_experiment_is_valid(self):
        e = quality.load_experiment(quality.EXPERIMENT)
        self.assertGreaterEqual(len(e["settings"][e["default_setting"]]["seeds"]), 3)
        for v in e["variants"]:
            self.assertTrue(os.path.isfile(os.path.join(quality.ROOT, v["model"])), v["model"])
        # the same hyperparameters for every variant: none of them carries its own
        self.assertTrue(all(set(v) <= {"name", "label", "model", "impl", "model_override"} for v in e["variants"]))

    def bad(self, change, fragment):
        e = quality.load_experiment(quality.EXPERIMENT)
        change(e)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "q.json")
            with open(path, "w") as f:
                json.dump(e, f)
            with self.assertRaises(quality.InputError) as cm:
                quality.load_experiment(path)
        self.assertIn(fragment, str(cm.exception))

    def test_bad_experiments(self):
        self.bad(lambda e: e.update(reference="top9"), "reference")
        self.bad(lambda e: e["settings"]["quick"].update(seeds=[1, 1]), "settings.quick.seeds")
        self.bad(lambda e: e["settings"]["quick"].update(eval_every=0), "settings.quick")
        self.bad(lambda e: e["sources"][0].update(data="markov:4"), "exactly one of")
        self.bad(lambda e: e.pop("training"), "training")

    def test_text_files_skip_indexes(self):
        with tempfile.TemporaryDirectory() as d:
            for n in ("zeta", "alpha", "alpha.dat", "alpha.u8"):
                open(os.path.join(d, n), "w").close()
            os.mkdir(os.path.join(d, "sub"))
            self.assertEqual([os.path.basename(p) for p in quality.text_files(d)], ["alpha", "zeta"])
            with self.assertRaises(quality.InputError):
                quality.text_files(os.path.join(d, "sub"))
            with self.assertRaises(quality.InputError):
                quality.text_files(os.path.join(d, "absent"))


class FailedRun(unittest.TestCase):
    def test_failure_leaves_out_alone(self):
        with tempfile.TemporaryDirectory() as d:
            fake = os.path.join(d, "moelab")
            with open(fake, "w") as f:
                f.write("#!/bin/sh\necho 'error: something broke' >&2\nexit 3\n")
            os.chmod(fake, os.stat(fake).st_mode | stat.S_IEXEC)
            out = os.path.join(d, "out")
            os.makedirs(out)
            with open(os.path.join(out, "summary.json"), "w") as f:
                f.write("{}")
            # One at a time the first run fails; two at a time the first to fail stops the rest.
            for jobs, failing in (("1", "markov8/top2-seed1.json"), ("2", "-seed1.json")):
                err = io.StringIO()
                with contextlib.redirect_stderr(err):
                    rc = quality.main(["--setting", "quick", "--source", "markov8", "--moelab", fake, "--out", out,
                                       "--no-plot", "--jobs", jobs])
                self.assertEqual(rc, 1)
                self.assertIn(f"{failing} failed (exit code 3)", err.getvalue())
                self.assertEqual(err.getvalue().count("failed (exit code"), 1)
                self.assertIn("error: something broke", err.getvalue())
                self.assertEqual(sorted(os.listdir(out)), ["summary.json"])  # the old one, no staging left
                with open(os.path.join(out, "summary.json")) as f:
                    self.assertEqual(f.read(), "{}")

    def test_bad_input(self):
        for args, fragment in ((["--setting", "nope", "--list"], "--setting nope"),
                               (["--source", "nope", "--list"], "--source nope"),
                               (["--moelab", "/nonexistent/moelab"], "no moelab binary"),
                               (["--seeds", "1,1", "--list"], "--seeds 1,1"),
                               (["--steps", "0", "--list"], "--steps 0"),
                               (["--steps", "10", "--eval-every", "20", "--list"], "--eval-every 20"),
                               (["--jobs", "0", "--list"], "--jobs 0")):
            err = io.StringIO()
            with contextlib.redirect_stderr(err):
                self.assertEqual(quality.main(args), 2)
            self.assertIn(fragment, err.getvalue())
            self.assertEqual(len(err.getvalue().strip().splitlines()), 1)


class Custom(unittest.TestCase):
    def test_overrides_go_to_their_own_folder(self):
        with contextlib.redirect_stdout(io.StringIO()) as log:
            self.assertEqual(quality.main(["--source", "markov8", "--steps", "30", "--seeds", "4,7", "--list"]), 0)
        lines = log.getvalue().strip().splitlines()
        self.assertEqual(len(lines), 8)  # 4 variants x 2 seeds
        self.assertTrue(all("/quality-custom/markov8/" in x and "--steps 30" in x for x in lines))
        self.assertTrue(all("--eval-every 20" in x for x in lines))
        self.assertEqual(sum("--seed 7 " in x for x in lines), 4)


class EndToEnd(unittest.TestCase):
    @unittest.skipUnless(os.environ.get("MOELAB"), "MOELAB (a moelab binary) is not set")
    def test_every_variant_a_few_steps(self):
        e = quality.load_experiment(quality.EXPERIMENT)
        e["settings"] = {"tiny": {"seeds": [5, 6], "steps": 4, "eval_every": 2, "eval_batches": 1}}
        e["default_setting"] = "tiny"
        with tempfile.TemporaryDirectory() as d:
            path, out = os.path.join(d, "q.json"), os.path.join(d, "out")
            with open(path, "w") as f:
                json.dump(e, f)
            summaries = []
            for jobs, where in (("2", out), ("1", os.path.join(d, "one"))):
                with contextlib.redirect_stdout(io.StringIO()) as log:
                    rc = quality.main(["--experiment", path, "--source", "markov8", "--moelab", os.environ["MOELAB"],
                                       "--out", where, "--no-plot", "--jobs", jobs])
                self.assertEqual(rc, 0, log.getvalue())
                with open(os.path.join(where, "summary.json")) as f:
                    summaries.append(json.load(f))
            s = summaries[0]
            # Runs side by side, one BLAS thread each, give the bits of runs one after another.
            self.assertEqual(s["sources"], summaries[1]["sources"])
            self.assertEqual((s["host_seconds"]["runs_at_a_time"], s["host_seconds"]["blas_threads_per_run"]), (2, 1))
            src = s["sources"]["markov8"]
            self.assertAlmostEqual(src["entropy_floor"], math.log(8))
            self.assertEqual(set(src["variants"]), {v["name"] for v in e["variants"]})
            for name, v in src["variants"].items():
                self.assertEqual(v["curve"]["steps"], [0, 2, 4], name)
                self.assertEqual(v["seeds"], [5, 6])
                self.assertTrue(os.path.isfile(os.path.join(out, "markov8", f"{name}-seed5.json")))
            # top-2 sends each token to two experts, the others to one beside a shared expert
            self.assertEqual(src["variants"]["top2"]["top_k"], 2)
            self.assertEqual({v["top_k"] for n, v in src["variants"].items() if n != "top2"}, {1})
            self.assertEqual(set(src["versus_reference"]), {v["name"] for v in e["variants"]} - {"top2"})
            self.assertFalse([n for n in os.listdir(out) if n.startswith(".staging")])


if __name__ == "__main__":
    unittest.main()
