"""Property-based tests (Hypothesis) of the files the python tools read: suite files
(experiments/<name>/suite.json), suite summaries and run results (docs/RESULTS-SCHEMA.md).

    /usr/bin/python3 -m unittest -v test_suite_properties      (from scripts/tests)
    MOELAB_TEST_SEED=123 /usr/bin/python3 -m unittest -v test_suite_properties   # replay one seed
    MOELAB_PROPERTY_EXAMPLES=5000 /usr/bin/python3 -m unittest test_suite_properties   # a long run

Each test starts from valid files (the fixtures and the registered suites) and mutates them:
a field deleted, replaced by a value of another type or an awkward one (NaN, a huge integer, a
string with a line break, a path that leaves the results folder, a format placeholder), an
unknown field added, a list emptied. The properties:

  * a loader (mr.load_suite, load_summary, load_result, load_json) either accepts the file or
    raises SchemaError with one line that names the file (and the field, when the file is JSON
    of the right kind): never another exception;
  * a file the loader accepts is one every reader can use: expanding the suite into runs,
    their result paths and command lines, the summary of a run, the claims, the figures'
    arguments, the report, the comparator; none of them may raise;
  * the command lines (run_suite.py --list, compare_results.py, claims.py, report.py,
    figures.py) end in exit 0, 1 (a difference) or 2 with that one line on stderr: never a
    traceback.

Hypothesis needs python3-hypothesis (scripts/setup.sh installs it); the example database is
off and its caches go to a temporary folder, so nothing is written beside the tests.
"""
import contextlib
import copy
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import types
import unittest

import fixtures
import moelab_results as mr
import run_suite
import compare_results

from hypothesis import HealthCheck, given, settings, seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

sys.path.insert(0, os.path.join(fixtures.ROOT, "plots"))
import report  # noqa: E402
import figures as plot_figures  # noqa: E402

SCRIPTS = fixtures.SCRIPTS
PLOTS = os.path.join(fixtures.ROOT, "plots")

# Hypothesis keeps caches in a folder of its own (.hypothesis/ in the working directory by
# default): a temporary one, so that nothing is written beside the tests.
set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "moelab-hypothesis"))
settings.register_profile("moelab", database=None, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile("moelab")
# Examples per in-process property (the command-line ones get a twelfth): 300 by default, about
# a minute in all; MOELAB_PROPERTY_EXAMPLES=5000 for a long run.
EXAMPLES = int(os.environ.get("MOELAB_PROPERTY_EXAMPLES", "300"))
IN_PROCESS = settings(max_examples=EXAMPLES)
COMMAND_LINE = settings(max_examples=max(1, EXAMPLES // 12))


def replayable(test):
    """Fresh examples every run; MOELAB_TEST_SEED=<n> replays a run (as the C++ tests do)."""
    s = os.environ.get("MOELAB_TEST_SEED")
    return hypothesis_seed(int(s))(test) if s else test


# ---- values and mutations -------------------------------------------------------------------

AWKWARD = [None, True, False, 0, -1, 1, 2, 2**63, 10**30, 0.5, -0.0, 1e308, math.nan, math.inf, -math.inf,
           "", "x", "a\nb", "../../escape", "/abs/path", "a/b", "{", "}", "{x}", "{workload", "{0}",
           "{workload.__class__}", "{impl!r}", "{ranks:>5}", "\u0000", "\ud800", "\u00e9t\u00e9", "fp32", "tf32",
           "bf16", "sim", "cpu", "cuda", "hostfile", "auto", "max", "mean", "speedup", "memory_saving",
           "baseline", "system", "simulated", "measured", "mixed", "full", "quick", "moelab.suite/2",
           "moelab.suite-summary/1", "moelab.result/1", [], {}, [1], ["x"], [[]], {"a": 1}, {"name": "x"}]

scalars = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
values = (st.sampled_from(AWKWARD) | json_values).map(copy.deepcopy)  # no value shared by two places


def node_paths(doc, prefix=()):
    """Every path (tuple of keys and indices) into doc, the root included."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += node_paths(v, prefix + (k,))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += node_paths(v, prefix + (i,))
    return out


def at(doc, path):
    for p in path:
        doc = doc[p]
    return doc


@st.composite
def mutated(draw, base):
    """base (a valid file's JSON) with one to three mutations."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        paths = node_paths(doc)
        path = draw(st.sampled_from(paths))
        op = draw(st.sampled_from(["replace", "replace", "replace", "delete", "insert", "empty", "copy"]))
        if op == "replace" or (op == "delete" and not path):
            v = draw(values)
            if path:
                at(doc, path[:-1])[path[-1]] = v
            else:
                doc = v
        elif op == "delete":
            parent = at(doc, path[:-1])
            del parent[path[-1]]
        elif op == "insert":
            node = at(doc, path)
            if isinstance(node, dict):
                node[draw(st.sampled_from(["extra", "name", "id", "label", "quick", "clusters", "ranks", "path"])
                          | st.text(max_size=6))] = draw(values)
            elif isinstance(node, list):
                node.append(draw(values))
        elif op == "empty":
            node = at(doc, path)
            if isinstance(node, (dict, list)) and path:
                at(doc, path[:-1])[path[-1]] = type(node)()
        elif op == "copy" and path:
            # One valid part of the file where another belongs: types right, meaning wrong.
            other = draw(st.sampled_from(paths))
            at(doc, path[:-1])[path[-1]] = copy.deepcopy(at(doc, other))
    return doc


def write(folder, rel, doc):
    path = os.path.join(folder, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(json.dumps(doc, indent=1))  # NaN and Infinity as Python writes them: what json.loads reads back
    return path


def base_suites():
    out = [fixtures.suite(), fixtures.model_suite()]
    for path in mr.registered_suites():
        s = mr.load_json(path)
        out.append(s)
    return out


BASE_SUITES = base_suites()


class OneLine(unittest.TestCase):
    def assert_clear(self, e, path):
        msg = str(e)
        self.assertIsInstance(e, mr.SchemaError)
        self.assertTrue(msg.startswith(path + ":"), msg)
        self.assertNotIn("\n", msg)
        self.assertLess(len(msg), 2000, msg[:300])


# ---- suite files ----------------------------------------------------------------------------

FAKE_MACHINE = types.SimpleNamespace(moelab="/bin/moelab", hostfile=None, mpirun="/usr/bin/mpirun",
                                     cuda_device=None, nranks=lambda job: 2 if job["ranks"] == "hostfile" else job["ranks"])


def use_suite(s, folder):
    """What run_suite.py, figures.py and report.py do with a loaded suite, without moelab: the
    runs of both subsets, their result paths, command lines, a summary from made-up results,
    the claims, the figures' arguments and the report's section."""
    run_suite.check_quick_subset(s)
    stage = os.path.join(folder, "results", "candidate")
    for quick in (False, True):
        jobs = run_suite.expand(s, quick)
        ids = sorted({j["run"] for j in jobs if j["kind"] == "run"})
        if ids:
            run_suite.select_runs([(s, jobs)], ids[:1], quick)
        for j in jobs:
            where = j["cluster"] or f"np {j['ranks']}"
            f"{s['name']:12} {j['kind']:4} {j['backend']:4} {where:11} {j['workload']:28} {j['impl']['label']}"
            dest = run_suite.destination(j, FAKE_MACHINE)
            full = os.path.normpath(os.path.join(stage, dest))
            if not full.startswith(stage + os.sep):
                raise AssertionError(f"result path {dest!r} leaves the results folder")
            wl = os.path.normpath(os.path.join(stage, s["out"], "workloads", j["workload"] + ".json"))
            if j["workload_gen"] is not None and not wl.startswith(stage + os.sep):
                raise AssertionError(f"workload path {wl!r} leaves the results folder")
            if j["workload_gen"] is not None:
                json.dumps(j["workload_gen"], allow_nan=False)  # what moelab reads: strict JSON
            cmd = run_suite.command(j, FAKE_MACHINE, "/tmp/wl.json", full)
            for a in cmd:
                if not isinstance(a, str):
                    raise AssertionError(f"a command-line argument that is not a string: {a!r}")
                a.encode()  # subprocess encodes every argument
            if j.get("model_run"):
                res = fixtures.model_run_result()
                if j["backend"] != "sim":
                    res.update(mode="measured", backend=j["backend"], cluster=None, calibration=None)
                    del res["routing_model"]
                j["a2a_overlap"] = 0.75 if j["trace"] else None
            else:
                res = fixtures.result("simulated" if j["backend"] == "sim" else "measured")
            res["metrics"]["step_time_s"]["median"] = 0.004 + 0.001 * (len(j["impl"]["label"]) % 3)
            j["result"], j["file"] = res, dest + ".json"
        summary = run_suite.summarize(s, jobs, "quick" if quick else "full", 1.0)
        mr.check_summary(summary, "(the summary being written)")
        for r in summary["runs"]:
            if r.get("run_mode"):
                mr.point_name(r)
                mr.run_key(r)
        json.dumps(summary, allow_nan=False)
        with contextlib.redirect_stdout(io.StringIO()):
            run_suite.print_tables(s, summary)
        report.suite_section(s, summary, os.path.join(folder, "summary.json"), os.path.join(folder, "results"),
                             os.path.join(folder, "figures"), folder)
    values = {"results": "/r", "out": "/r/o", "summary": "/r/o/summary.json", "figures": "/f", "root": "/"}
    for fg in s.get("figures", []):
        [plot_figures.expand(x, values) for x in fg["args"]]


class SuiteFiles(OneLine):
    @replayable
    @IN_PROCESS
    @given(st.data())
    def test_a_mutated_suite_is_rejected_by_field_or_usable(self, data):
        base = data.draw(st.sampled_from(BASE_SUITES))
        doc = data.draw(mutated(base))
        with tempfile.TemporaryDirectory() as d:
            name = doc.get("name") if isinstance(doc, dict) and isinstance(doc.get("name"), str) else "x"
            path = write(d, f"experiments/{name if name.isidentifier() else 'x'}/suite.json", doc)
            try:
                s = mr.load_suite(path)
                use_suite(s, d)
            except mr.SchemaError as e:
                self.assert_clear(e, path)

    @replayable
    @COMMAND_LINE
    @given(st.data())
    def test_run_suite_list_exits_2_naming_the_field(self, data):
        doc = data.draw(mutated(data.draw(st.sampled_from(BASE_SUITES))))
        with tempfile.TemporaryDirectory() as d:
            path = write(d, "experiments/x/suite.json", doc)
            for script, args in ((os.path.join(SCRIPTS, "run_suite.py"), ["--suite", path, "--list"]),
                                 (os.path.join(SCRIPTS, "run_suite.py"), ["--suite", path, "--list", "--quick"]),
                                 (os.path.join(PLOTS, "figures.py"), ["--suite", path, "--results", d])):
                p = subprocess.run([sys.executable, script] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
                self.assertNotIn("Traceback", p.stderr)
                self.assertIn(p.returncode, (0, 2), p.stderr)
                if p.returncode == 2:
                    self.assertIn(path + ":", p.stderr)
                    self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)

    def test_every_registered_suite_is_usable(self):
        with tempfile.TemporaryDirectory() as d:
            for path in mr.registered_suites():
                use_suite(mr.load_suite(path), d)


def with_generated_run(s):
    s["runs"].append({"id": "gen", "backend": "sim", "clusters": ["dgx-a100x1"], "workloads": [
        {"model": "M", "dtype": "bf16", "tokens_per_rank": 256}], "impls": ["Sys"], "path": "simulated/gen/{impl}"})


class SuiteFindings(OneLine):
    """What the properties above found, each as a fixed example: a suite the checks used to
    accept and a reader then failed on with a traceback (or a message of several lines)."""

    CASES = [
        # A quick subset's override was not checked: expand() met null impls, workloads, ranks.
        (lambda s: s["runs"][0].update(quick={"impls": None}), "runs[0].quick.impls"),
        (lambda s: s["runs"][0].update(quick={"workloads": [None]}), "runs[0].quick.workloads[0]"),
        (lambda s: s["runs"][0].update(quick={"id": "other"}), "runs[0].quick.id"),
        # A run's clusters were not checked one by one (--list formats them; moelab gets them).
        (lambda s: s["runs"][0].update(clusters=[{}]), "runs[0].clusters[0]"),
        # A result path with an unknown or broken placeholder: KeyError, ValueError mid-run.
        (lambda s: s["runs"][0].update(path="simulated/{nope}/{impl}"), "runs[0].path"),
        (lambda s: s["runs"][0].update(path="simulated/{impl"), "runs[0].path"),
        (lambda s: s["runs"][0].update(path="simulated/{impl.__class__}"), "runs[0].path"),
        # Names that become file names could leave the results folder.
        (lambda s: s["grid"]["models"][0].update(name="../../../M"), "grid.models[0].name"),
        (lambda s: s["impls"][0].update(label="a/b"), "impls[0].label"),
        # An unpaired surrogate ("\\ud800" in the file): not text; subprocess could not pass it to moelab.
        (lambda s: s["runs"][0].update(clusters=["dgx\ud800"]), "runs[0].clusters[0]"),
        (lambda s: s["grid"]["clusters"][0].update(name=".."), "grid.clusters[0].name"),
        (lambda s: (with_generated_run(s), s["runs"][2]["workloads"][0].update(dtype="../x")),
         "runs[2].workloads[0].dtype"),
        # Ids and workload names that tables and messages print: one line each.
        (lambda s: s["runs"][0].update(id="sim\nrm"), "runs[0].id"),
        (lambda s: s["runs"][0].update(workloads=["a\nb"]), "runs[0].workloads[0]"),
        # A paper figure of 0: ZeroDivisionError in the claims table.
        (lambda s: s["claims"]["items"][0].update(paper=0), "claims.items[0].paper"),
        # Figure arguments and file patterns that are not strings (plots/figures.py, report.py).
        (lambda s: s["figures"][0].update(args=["--summary", None]), "figures[0].args[1]"),
        (lambda s: s["figures"][0].update(files=[3]), "figures[0].files[0]"),
        # The paper's reference (plots/report.py reads its title).
        (lambda s: s.update(paper="MPipeMoE"), "paper"),
        (lambda s: s.update(paper={"venue": "IPDPS"}), "paper.title"),
    ]

    def test_each_is_rejected_naming_the_field(self):
        for change, field in self.CASES:
            s = fixtures.suite()
            change(s)
            with tempfile.TemporaryDirectory() as d:
                path = write(d, "experiments/fake/suite.json", s)
                with self.assertRaises(mr.SchemaError, msg=field) as cm:
                    mr.load_suite(path)
                self.assert_clear(cm.exception, path)
                self.assertIn(f'field "{field}"', str(cm.exception))
                p = subprocess.run([sys.executable, os.path.join(SCRIPTS, "run_suite.py"), "--suite", path, "--list"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                self.assertEqual((p.returncode, p.stderr.count("\n")), (2, 1), p.stderr)

    MODEL_CASES = [
        # A model entry's fields reach moelab's command line and the result's path.
        (lambda s: s["runs"][0]["models"].append({"file": "a/b"}), "runs[0].models[2].file"),
        (lambda s: s["runs"][0]["models"].append({"file": "x", "model": ".."}), "runs[0].models[2].model"),
        (lambda s: s["runs"][0]["models"][1].update(layers="0:2:4"), "runs[0].models[1].layers"),
        (lambda s: s["runs"][0]["models"][0].update(override=[1]), "runs[0].models[0].override"),
        (lambda s: s["runs"][0]["models"][0].update(parallel={"a800x1": "ep=2\nrm"}),
         "runs[0].models[0].parallel.a800x1"),
        (lambda s: s["runs"][0].update(mode=["training", "training"]), "runs[0].mode"),
        (lambda s: s["runs"][0].update(warmup=-1), "runs[0].warmup"),
        (lambda s: s["runs"][1].update(label="a/b"), "runs[1].label"),
        (lambda s: s["runs"][0].update(quick={"models": []}), "runs[0].quick.models"),
        # Claims on runs: labels, selection, range.
        (lambda s: s["claims"]["items"][1].update(system=[]), "claims.items[1].system"),
        (lambda s: s["claims"]["items"][0]["select"].update(mode="serving"), "claims.items[0].select.mode"),
        (lambda s: s["claims"]["items"][1].update(paper_range=[0.7]), "claims.items[1].paper_range"),
        (lambda s: s["claims"]["items"][2].update(metric="latency"), "claims.items[2].metric"),
        (lambda s: s["claims"]["items"][0].update(on="everywhere"), "claims.items[0].on"),
    ]

    def test_model_runs_rejected_naming_the_field(self):
        for change, field in self.MODEL_CASES:
            s = fixtures.model_suite()
            change(s)
            with tempfile.TemporaryDirectory() as d:
                path = write(d, "experiments/fakemodels/suite.json", s)
                with self.assertRaises(mr.SchemaError, msg=field) as cm:
                    mr.load_suite(path)
                self.assert_clear(cm.exception, path)
                self.assertIn(f'field "{field}"', str(cm.exception))

    def test_a_missing_workload_file_is_named_by_field(self):
        s = fixtures.suite()
        s["runs"][0]["quick"] = {"workloads": ["tiny", "no-such-workload"]}
        with tempfile.TemporaryDirectory() as d:
            path = write(d, "experiments/fake/suite.json", s)
            p = subprocess.run([sys.executable, os.path.join(SCRIPTS, "run_suite.py"), "--suite", path, "--list",
                                "--quick"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn(f'{path}: field "runs[0].quick.workloads[1]": workload "no-such-workload": no file '
                          f'experiments/workloads/no-such-workload.json', p.stderr)

    def test_nan_and_infinity_are_not_json(self):
        with tempfile.TemporaryDirectory() as d:
            path = write(d, "experiments/fake/suite.json", fixtures.suite())
            with open(path) as f:
                text = f.read().replace('"capacity_factor": 0', '"capacity_factor": NaN')
            with open(path, "w") as f:
                f.write(text)
            with self.assertRaises(mr.SchemaError) as cm:
                mr.load_suite(path)
            self.assertIn('field "grid.workload_defaults.capacity_factor": NaN is not a JSON number', str(cm.exception))

    def test_a_value_with_a_line_break_is_quoted_on_one_line(self):
        s = fixtures.suite()
        s["name"] = "fake\nrm -rf"
        with tempfile.TemporaryDirectory() as d:
            path = write(d, "experiments/fake/suite.json", s)
            with self.assertRaises(mr.SchemaError) as cm:
                mr.load_suite(path)
            self.assert_clear(cm.exception, path)
            self.assertIn('got "fake\\nrm -rf"', str(cm.exception))

    def test_figures_py_exits_2_on_a_bad_suite(self):
        s = fixtures.suite()
        del s["impls"]
        with tempfile.TemporaryDirectory() as d:
            path = write(d, "experiments/fake/suite.json", s)
            p = subprocess.run([sys.executable, os.path.join(PLOTS, "figures.py"), "--suite", path, "--results", d],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            self.assertEqual(p.returncode, 2, p.stderr)
            self.assertIn('field "impls": missing', p.stderr)


# ---- summaries and results ------------------------------------------------------------------

def use_summary(summ, path, folder):
    """What compare_results.py, claims.py, report.py and plots/scmoe.py's pairing do with a loaded summary."""
    mr.claim_rows(summ)
    runs = summ.get("runs", [])
    for metric in mr.RUN_METRICS:
        mr.run_comparisons(runs, ["Sc-Pos3", "top1"], "top2", metric, {"clusters": ["pcie-a30x1"], "mode": "training"})
    for r in runs:
        if r.get("run_mode"):
            mr.point_name(r)
    compare_results.diff_summaries(summ, summ, 1e-9)
    compare_results.diff_summaries(fixtures.summary(), summ, 1e-9)
    compare_results.diff_summaries(summ, fixtures.summary(), 1e-9)
    report.mode_line(summ)
    s = fixtures.suite()
    s["_path"] = os.path.join(folder, "experiments", "fake", "suite.json")
    report.suite_section(s, summ, path, os.path.join(folder, "results"), os.path.join(folder, "figures"), folder)


def use_result(res):
    """What run_suite.py and compare_results.py do with a loaded result."""
    run_suite.figures(res)
    mr.dtype_label(res)
    compare_results.diff_results(res, fixtures.result(), 1e-9)
    compare_results.diff_results(fixtures.result(), res, 1e-9)
    if res["mode"] == "measured":
        compare_results.measured_note(fixtures.result("measured"), res)
        compare_results.measured_note(res, fixtures.result("measured"))


class ResultFiles(OneLine):
    @replayable
    @IN_PROCESS
    @given(st.data())
    def test_a_mutated_summary_is_rejected_by_field_or_usable(self, data):
        base = data.draw(st.sampled_from([fixtures.summary("full"), fixtures.summary("quick"), fixtures.model_summary()]))
        doc = data.draw(mutated(base))
        with tempfile.TemporaryDirectory() as d:
            path = write(d, "summary.json", doc)
            try:
                use_summary(mr.load_summary(path), path, d)
            except mr.SchemaError as e:
                self.assert_clear(e, path)

    @replayable
    @IN_PROCESS
    @given(st.data())
    def test_a_mutated_result_is_rejected_by_field_or_usable(self, data):
        doc = data.draw(mutated(fixtures.result(data.draw(st.sampled_from(["simulated", "measured"])))))
        with tempfile.TemporaryDirectory() as d:
            path = write(d, "r.json", doc)
            try:
                use_result(mr.load_result(path))
            except mr.SchemaError as e:
                self.assert_clear(e, path)

    @replayable
    @COMMAND_LINE
    @given(st.data())
    def test_the_readers_of_a_results_folder_exit_2_naming_the_file(self, data):
        which = data.draw(st.sampled_from(["summary", "result"]))
        good = (data.draw(st.sampled_from([fixtures.summary(), fixtures.model_summary()])) if which == "summary"
                else fixtures.result())
        doc = data.draw(mutated(good))
        with tempfile.TemporaryDirectory() as d:
            suite = write(d, "experiments/fake/suite.json", fixtures.suite())
            rel = "simulated/fake/summary.json" if which == "summary" else "simulated/fake/r.json"
            base, new = os.path.join(d, "base"), os.path.join(d, "new")
            write(base, rel, good)
            bad = write(new, rel, doc)
            runs = [(os.path.join(SCRIPTS, "compare_results.py"), [base, new]),
                    (os.path.join(SCRIPTS, "compare_results.py"), [new, base, "--complete"])]
            if which == "summary":
                runs += [(os.path.join(SCRIPTS, "claims.py"), ["--results", new, "--suite", suite]),
                         (os.path.join(PLOTS, "scmoe.py"), ["speedup", "--summary", bad, "--out",
                                                            os.path.join(d, "s.png")]),
                         (os.path.join(PLOTS, "report.py"), ["--results", new, "--suite", suite,
                                                             "--out", os.path.join(d, "RESULTS.md")]),
                         (os.path.join(PLOTS, "runs.py"), ["--summary", bad, "--out", os.path.join(d, "r.png")]),
                         (os.path.join(PLOTS, "mpipemoe.py"), ["--summary", bad, "--out-dir", d])]
            for script, args in runs:
                p = subprocess.run([sys.executable, script] + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True)
                self.assertNotIn("Traceback", p.stderr)
                self.assertIn(p.returncode, (0, 1, 2), p.stderr)
                if p.returncode == 2:
                    self.assertIn(bad + ":", p.stderr)
                    self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)


    def test_the_figures_of_a_cluster_without_results(self):
        # Found by the property above: a point with no results (valid: every run of it failed or
        # was skipped) left plots/mpipemoe.py a memory panel of no bars, and matplotlib's legend
        # of zero columns raised.
        s = fixtures.summary()
        s["points"][0].update(results={}, speedup={}, memory_saving={})  # the only point of its cluster
        with tempfile.TemporaryDirectory() as d:
            path = write(d, "summary.json", s)
            for script, args in [("mpipemoe.py", ["--out-dir", d]), ("runs.py", ["--out", os.path.join(d, "r.png")])]:
                p = subprocess.run([sys.executable, os.path.join(PLOTS, script), "--summary", path] + args,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                self.assertEqual(p.returncode, 0, p.stderr)
                self.assertNotIn("Traceback", p.stderr)
            self.assertTrue(os.path.exists(os.path.join(d, "mpipemoe-M.png")))

class SummaryFindings(OneLine):
    """Summaries the checks used to accept and plots/report.py, scripts/claims.py or
    mr.claim_rows then failed on with a traceback."""

    CASES = [
        (lambda s: s["claims"][0]["ours"].update(paper_setup=None), "claims[0].ours.paper_setup"),
        (lambda s: s["claims"][0]["ours"]["paper_setup"].pop("value"), "claims[0].ours.paper_setup.value"),
        (lambda s: s["claims"][0].update(compared_on={}), "claims[0].compared_on"),
        (lambda s: s["claims"][0].update(paper_setup="dgx"), "claims[0].paper_setup"),
        (lambda s: s["skipped"][0].pop("reason"), "skipped[0].reason"),
        (lambda s: s.update(skipped=None), "skipped"),
        (lambda s: s.update(suite_file={}), "suite_file"),
        (lambda s: s["runs"][0]["results"].pop("overlap_ratio"), "runs[0].results.overlap_ratio"),
        (lambda s: s["runs"][0].pop("device"), "runs[0].device"),
        (lambda s: s["points"][0]["results"]["Base"].update(partitions=[]), "points[0].results.Base.partitions"),
        (lambda s: s["points"][0].update(out_of_memory="Sys"), "points[0].out_of_memory"),
        # plots/runs.py stacks a run's phases; plots/mpipemoe.py reads a point's GPUs.
        (lambda s: s["runs"][0]["results"].update(phases_s=None), "runs[0].results.phases_s"),
        (lambda s: s["points"][0].pop("gpus"), "points[0].gpus"),
        (lambda s: s["runs"][0].pop("world_size"), "runs[0].world_size"),
    ]
    MODEL_CASES = [
        # Whole-model rows: what a claim on runs pairs them by, and their ScMoE figures.
        (lambda s: s["runs"][0].update(run_mode="serving"), "runs[0].run_mode"),
        (lambda s: s["runs"][0].pop("label"), "runs[0].label"),
        (lambda s: s["runs"][0].update(layers="all"), "runs[0].layers"),
        (lambda s: s["runs"][2]["results"].update(all_to_all_overlap="most"), "runs[2].results.all_to_all_overlap"),
        (lambda s: s["runs"][0]["results"].update(all_to_all_share=-0.1), "runs[0].results.all_to_all_share"),
        # Claims on runs: the points they used.
        (lambda s: s["claims"][0]["ours"]["runs"].update(used=[1]), "claims[0].ours.runs.used[0]"),
        (lambda s: s["claims"][0]["ours"].pop("runs"), "claims[0].ours.runs"),
        (lambda s: s["claims"][1].update(system=[]), "claims[1].system"),
        (lambda s: s["claims"][0].update(metric="latency"), "claims[0].metric"),
        # the selection, which the claims tables print (found by the properties above)
        (lambda s: s["claims"][0]["select"].update(mode=True), "claims[0].select.mode"),
        (lambda s: s["claims"][0]["select"].update(clusters=3), "claims[0].select.clusters"),
    ]

    def test_each_is_rejected_naming_the_field(self):
        for change, field, base in ([(c, f, fixtures.summary) for c, f in self.CASES]
                                    + [(c, f, fixtures.model_summary) for c, f in self.MODEL_CASES]):
            s = base()
            change(s)
            with tempfile.TemporaryDirectory() as d:
                path = write(d, "summary.json", s)
                with self.assertRaises(mr.SchemaError, msg=field) as cm:
                    mr.load_summary(path)
                self.assert_clear(cm.exception, path)
                self.assertIn(f'field "{field}"', str(cm.exception))


class AnyBytes(OneLine):
    @replayable
    @IN_PROCESS
    @given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode)
           | json_values.map(lambda v: json.dumps(v).encode()))
    def test_load_json_reads_or_names_the_file(self, raw):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "f.json")
            with open(path, "wb") as f:
                f.write(raw)
            for load in (mr.load_json, mr.load_suite, mr.load_summary, mr.load_result):
                try:
                    load(path)
                except mr.SchemaError as e:
                    self.assert_clear(e, path)

    def test_deeply_nested_json_is_an_error_naming_the_file(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "suite.json")
            with open(path, "w") as f:
                f.write("[" * 100000 + "]" * 100000)
            with self.assertRaises(mr.SchemaError) as cm:
                mr.load_json(path)
            self.assert_clear(cm.exception, path)


if __name__ == "__main__":
    unittest.main()
