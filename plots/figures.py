#!/usr/bin/python3
"""plots/figures.py — make every figure the suites name (their "figures" entries), as PNG.

    /usr/bin/python3 plots/figures.py                               # every suite, results/ -> results/figures/
    /usr/bin/python3 plots/figures.py --results /tmp/r --suite foundation

Each entry of a suite's "figures" is a plot script under plots/ and its arguments, in which
{results} (the results folder), {out} (the suite's folder in it), {summary} (its
summary.json), {figures} (the figures folder, default RESULTS/figures) and {root} (the
repository) are replaced. A figure whose inputs are missing from the results folder (the
runs it draws were skipped on this machine) is listed as not made, with the missing file, and
its PNG (an --out under the figures folder) is removed where an earlier run left one;
a plot script that fails makes the exit code 1. Run with /usr/bin/python3 (matplotlib).
"""
import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import moelab_results as mr  # noqa: E402


def expand(arg, values):
    for k, v in values.items():
        arg = arg.replace("{" + k + "}", v)
    return arg


def make(suite, results, figures, log=print):
    """Runs the suite's figure scripts; returns (made, not made, failed) figure ids."""
    values = {"results": results, "out": os.path.join(results, suite["out"]),
              "summary": mr.summary_path(suite, results), "figures": figures, "root": ROOT}
    made, missing, failed = [], [], []
    for fg in suite.get("figures", []):
        args = [expand(x, values) for x in fg["args"]]
        inputs = [x for x in args if x.startswith(results + os.sep) and x.endswith(".json")]
        absent = [x for x in inputs if not os.path.exists(x)]
        if absent:
            log(f"figures.py: [{suite['name']}] {fg['id']}: not made, no {os.path.relpath(absent[0], results)} "
                f"in {results} (its runs did not run here)")
            # A figure of an earlier run left in place would be shown (plots/report.py embeds
            # what exists) for data this folder no longer holds: it goes too.
            for x in args:
                if x.startswith(figures + os.sep) and x.endswith(".png") and os.path.exists(x):
                    os.unlink(x)
                    log(f"figures.py: [{suite['name']}] {fg['id']}: removed {os.path.relpath(x, figures)}, "
                        "drawn from data no longer here")
            missing.append(fg["id"])
            continue
        os.makedirs(figures, exist_ok=True)
        p = subprocess.run([sys.executable, os.path.join(ROOT, fg["script"])] + args,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if p.returncode != 0:
            log(f"figures.py: [{suite['name']}] {fg['id']}: {fg['script']} failed (exit code {p.returncode}):\n"
                + "\n".join(p.stdout.strip().splitlines()[-8:]))
            failed.append(fg["id"])
        else:
            for line in p.stdout.strip().splitlines():
                log(f"figures.py: [{suite['name']}] {line}")
            made.append(fg["id"])
    return made, missing, failed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--results", default=mr.RESULTS, help="the results folder (default results/)")
    ap.add_argument("--figures", help="where the PNGs go (default RESULTS/figures)")
    ap.add_argument("--suite", action="append", help="a suite (repeatable; default every registered suite)")
    ap.add_argument("--experiments", default=mr.EXPERIMENTS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    results = os.path.abspath(a.results)
    figures = os.path.abspath(a.figures or os.path.join(results, "figures"))
    try:
        suites = [mr.load_suite(s, a.experiments) for s in (a.suite or mr.registered_suites(a.experiments))]
    except mr.SchemaError as e:
        print(f"figures.py: {e}", file=sys.stderr)
        return 2
    bad = 0
    for s in suites:
        bad += len(make(s, results, figures)[2])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
